"""Topology-aware schedules (torus, hierarchical, recursive doubling) run by the simulator for
many world sizes on several instances, against a reference reduction, with neighbour-only
traffic where the group covers whole chips and tori."""
import functools

import numpy as np
import pytest

from neuron_dist.collectives.algorithms import BUILDERS, OWN_BLOCK_OUT, Spec, build
from neuron_dist.collectives.hierarchical import (hierarchical_allgather, hierarchical_allreduce,
                                                   hierarchical_reduce_scatter)
from neuron_dist.collectives.rdh import rdh_allreduce
from neuron_dist.collectives.schedule import IN, OUT, Chunk, Copy, Recv, Schedule, Send
from neuron_dist.collectives.simulate import Deadlock, ScheduleError, round_conflict, simulate
from neuron_dist.collectives.torus import torus_allgather, torus_allreduce, torus_reduce_scatter
from neuron_dist.topology import GroupTopology, get_instance, link_kind, place
from neuron_dist.topology.graph import ring_order


def rdh_allreduce_topo(rank, topo, count):
    """The recursive halving-doubling all-reduce over the topology's ring order (as the backend's
    builder table runs it)."""
    return rdh_allreduce(rank, ring_order(topo), count)
from neuron_dist.topology.placement import make_slot

SIZES = [1, 2, 3, 4, 5, 8, 16, 32, 64, 128]
INSTANCES = [("trn2.48xlarge", 2), ("trn2.48xlarge", 1), ("trn1.32xlarge", None),
             ("trn2u.48xlarge", 2), ("trn3", 2), ("inf2.48xlarge", None)]


def job(name, P, lnc=None):
    """P ranks filling nodes in order (the last node may be partly filled)."""
    inst = get_instance(name)
    per = inst.cores(lnc)
    if P > per and not inst.multi_node:
        return None
    slots = [make_slot(inst, r // per, [r % per], lnc) for r in range(P)]
    return GroupTopology(inst, tuple(slots)).validate()


def _data(P, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(-8, 9, n).astype(np.float64) for _ in range(P)]


def check_allreduce(builder, topo, count):
    P = topo.size
    X = _data(P, count, P)
    ref = np.sum(X, axis=0) if P else None
    res = simulate([builder(r, topo, count) for r in range(P)], [x.copy() for x in X], inplace=True)
    for r, o in enumerate(res.outs):
        assert np.array_equal(o, ref), (builder.__name__, P, count, r)
    return res


def check_reduce_scatter(builder, topo, count):
    P = topo.size
    X = _data(P, P * count, P + 1)
    ref = np.sum(X, axis=0)
    ins = [x.copy() for x in X]
    res = simulate([builder(r, topo, count) for r in range(P)], ins,
                   [np.full(count, np.nan) for _ in range(P)])
    for r, o in enumerate(res.outs):
        assert np.array_equal(o, ref[r * count:(r + 1) * count]), (builder.__name__, P, count, r)
    for a, x in zip(ins, X):
        assert np.array_equal(a, x), "reduce_scatter modified IN"
    return res


def check_allgather(builder, topo, count):
    P = topo.size
    X = _data(P, count, P + 2)
    res = simulate([builder(r, topo, count) for r in range(P)], X,
                   [np.full(P * count, np.nan) for _ in range(P)])
    ref = np.concatenate(X) if P else None
    for r, o in enumerate(res.outs):
        assert np.array_equal(o, ref), (builder.__name__, P, count, r)
    return res


def counts(P):
    return sorted({0, 1, P + 3, 3 * P - 1})


def run_all(name, lnc, P):
    topo = job(name, P, lnc)
    assert topo is not None, f"{P} ranks do not fit {name}: excluded from the parameters"
    for count in counts(P):
        for b in (torus_allreduce, hierarchical_allreduce, rdh_allreduce_topo):
            check_allreduce(b, topo, count)
    for count in sorted({0, 1, 3}):
        for b in (torus_reduce_scatter, hierarchical_reduce_scatter):
            check_reduce_scatter(b, topo, count)
        for b in (torus_allgather, hierarchical_allgather):
            check_allgather(b, topo, count)


# every size on trn2, a subset on the other instances (all of 1..128 run under -m slow)
DEFAULT_CASES = [(name, lnc, P) for name, lnc in INSTANCES[:4] for P in SIZES
                 if name == "trn2.48xlarge" or P in (1, 3, 5, 16, 64, 128)]


@pytest.mark.parametrize("name,lnc,P", DEFAULT_CASES)
def test_schedules_match_reference(name, lnc, P):
    run_all(name, lnc, P)


# every size 1..128 that fits the instance (a single-node inf2.48xlarge holds 24 ranks)
ALL_SIZES = [(name, lnc, P) for name, lnc in INSTANCES for P in range(1, 129) if job(name, P, lnc) is not None]


@pytest.mark.slow
@pytest.mark.parametrize("name,lnc,P", ALL_SIZES)
def test_schedules_match_reference_all_sizes(name, lnc, P):
    run_all(name, lnc, P)


FULL = [("trn2.48xlarge", 1, 64, 2), ("trn2.48xlarge", 1, 128, 1), ("trn1.32xlarge", 1, 32, None),
        ("inf2.48xlarge", 1, 24, None), ("trn2u.48xlarge", 4, 16, 1), ("trn2.48xlarge", 2, 64, 2),
        ("trn3", 4, 64, 2), ("trn3-gen2", 4, 16, 2), ("trn2.48xlarge", 1, 16, 2), ("trn2.48xlarge", 2, 32, 2)]


@pytest.mark.parametrize("name,nodes,ppn,lnc", FULL)
def test_traffic_only_between_neighbours(name, nodes, ppn, lnc):
    topo = place(name, nodes, ppn, lnc)
    P = topo.size
    for b, check in [(torus_allreduce, check_allreduce), (torus_allgather, check_allgather),
                     (torus_reduce_scatter, check_reduce_scatter),
                     (hierarchical_allreduce, check_allreduce)]:
        res = check(b, topo, 2)
        bad = [(s, d, link_kind(topo, s, d)) for s, d in res.pairs() if link_kind(topo, s, d) is None]
        assert not bad, (b.__name__, bad[:5])
        if name == "trn2u.48xlarge":
            assert all(link_kind(topo, s, d) != "network" for s, d in res.pairs())


@pytest.mark.parametrize("name,nodes,ppn", [("trn2u.48xlarge", 8, 4), ("trn2u.48xlarge", 8, 16),
                                             ("trn2u.48xlarge", 12, 2), ("trn3", 8, 4), ("trn3-gen2", 72, 1)])
def test_torus_across_ultraservers_crosses_efa_between_domains_only(name, nodes, ppn):
    """A job over several UltraServers (NeuronLink domains of D nodes): the torus ran one line
    over all nodes, 0-1-...-7 on 8 trn2u nodes, whose steps 3->4 and 7->0 cross EFA, so every
    step waited on EFA. Its grid is now [nodes of a domain] x [domains]: the schedules still
    reduce and gather right, and EFA carries only the last dimension's traffic, between nodes
    at the same place in their domains (node n and n +- k*D)."""
    topo = place(name, nodes, ppn)
    D = topo.instance.domain_nodes
    for b, check in [(torus_allreduce, check_allreduce), (torus_allgather, check_allgather),
                     (torus_reduce_scatter, check_reduce_scatter)]:
        for count in (1, 5):
            res = check(b, topo, count)
            efa = [(s, d) for s, d in res.pairs() if link_kind(topo, s, d) == "network"]
            far = [(s, d) for s, d in efa if (topo.slots[s].node - topo.slots[d].node) % D]
            assert efa and not far, (b.__name__, far[:4])
            assert all(link_kind(topo, s, d) is not None for s, d in res.pairs())


def test_bytes_recorded_and_ring_volume():
    topo = place("trn2", 1, 8)
    res = check_allreduce(torus_allreduce, topo, 8 * 64)
    total = sum(b for _, _, b in res.transfers)
    # a ring all-reduce moves 2 (P-1)/P of the buffer per rank; dimension by dimension the same
    assert total == 8 * 2 * 7 * 64 * 8


def test_deadlock_reported():
    a = Schedule("x").add(Recv(1, Chunk(OUT, 0, 1))).add(Send(1, Chunk(OUT, 0, 1)))
    b = Schedule("x").add(Recv(0, Chunk(OUT, 0, 1))).add(Send(0, Chunk(OUT, 0, 1)))
    with pytest.raises(Deadlock, match="rank 0 round 0 waits on \\[1\\]"):
        simulate([a, b], [np.zeros(1), np.zeros(1)], inplace=True)


def test_count_mismatch_and_unreceived_reported():
    a = Schedule("x").add(Send(1, Chunk(OUT, 0, 2)))
    b = Schedule("x").add(Recv(0, Chunk(OUT, 0, 1)))
    with pytest.raises(ScheduleError, match="receives 1 elements"):
        simulate([a, b], [np.zeros(2), np.zeros(2)], inplace=True)
    with pytest.raises(ScheduleError, match="never received"):
        simulate([a, Schedule("x")], [np.zeros(2), np.zeros(2)], inplace=True)


@pytest.mark.parametrize("name,lnc", INSTANCES[:5])
def test_reduce_scatter_output_may_be_the_ranks_own_block_of_the_input(name, lnc):
    """OWN_BLOCK_OUT: every builder of those collectives gives the right blocks with OUT aliasing
    this rank's block of IN (the in-place call, run without a staging buffer), blocks of one
    size and of several; the direct reduce-scatter once overwrote its own block with the first
    rank's before it read it (rank 1 of 2 got 2 x block 0)."""
    checked = 0
    for collective, algo in [k for k in BUILDERS if k[0] in OWN_BLOCK_OUT]:
        for P in (1, 2, 3, 4, 5, 8, 16):
            topo = job(name, P, lnc)
            if topo is None:
                continue
            for counts in ((1,) * P, (3,) * P, tuple(r % 3 + 1 for r in range(P))):
                if algo in ("torus", "hierarchical") and len(set(counts)) > 1:
                    continue  # (placed builders take equal blocks)
                off = [sum(counts[:r]) for r in range(P)]
                X = _data(P, sum(counts), P + 7)
                ins = [x.copy() for x in X]
                outs = [ins[r][off[r]:off[r] + counts[r]] for r in range(P)]  # views: OUT is IN's own block
                scheds = [build(Spec(collective, r, P, counts=counts, order=tuple(ring_order(topo)), topo=topo), algo)
                          for r in range(P)]
                simulate(scheds, ins, outs)
                ref = np.sum(X, axis=0)
                for r in range(P):
                    assert np.array_equal(outs[r], ref[off[r]:off[r] + counts[r]]), (algo, P, counts, r)
                checked += 1
    assert checked > 20


def test_a_late_copy_runs_beside_its_rounds_sends_and_may_not_touch_them():
    """A late Copy (a scatter root's own block, copied while its receivers read theirs) runs once
    its round's sends are posted: it may not write what they send or a receive writes, nor read
    what a receive writes; the simulator refuses such a schedule (in place, IN and OUT are one
    buffer), and a scatter's schedules, whose root's copy is late, give every rank its block."""
    def pair(late: Copy, recv_too: bool = False):
        a = Schedule("x").add(late, Send(1, Chunk(IN, 0, 2)), *([Recv(1, Chunk(OUT, 2, 2))] if recv_too else []))
        b = Schedule("x").add(Recv(0, Chunk(OUT, 0, 2)), *([Send(0, Chunk(IN, 0, 2))] if recv_too else []))
        return simulate([a, b], [np.arange(4.0), np.arange(4.0)], outs=[np.zeros(4), np.zeros(4)])
    assert pair(Copy(Chunk(IN, 2, 2), Chunk(OUT, 0, 2), late=True)).outs[0].tolist() == [2.0, 3.0, 0.0, 0.0]
    with pytest.raises(ScheduleError, match="late Copy.* touches what Send"):
        simulate([Schedule("x").add(Copy(Chunk(OUT, 0, 2), Chunk(IN, 1, 2), late=True), Send(1, Chunk(IN, 0, 2))),
                  Schedule("x").add(Recv(0, Chunk(OUT, 0, 2)))], [np.arange(4.0)] * 2, outs=[np.zeros(4)] * 2)
    with pytest.raises(ScheduleError, match="late Copy.* touches what Recv"):  # writes what a receive writes
        pair(Copy(Chunk(IN, 2, 1), Chunk(OUT, 3, 1), late=True), recv_too=True)
    with pytest.raises(ScheduleError, match="late Copy.* touches what Recv"):  # reads what a receive writes
        pair(Copy(Chunk(OUT, 2, 2), Chunk(OUT, 0, 2), late=True), recv_too=True)
    with pytest.raises(ScheduleError, match="late Copy.* touches what Send"):  # in place: IN is OUT
        simulate([Schedule("x").add(Copy(Chunk(IN, 2, 2), Chunk(OUT, 1, 2), late=True), Send(1, Chunk(IN, 0, 2))),
                  Schedule("x").add(Recv(0, Chunk(OUT, 0, 2)))], [np.arange(4.0)] * 2, inplace=True)
    from neuron_dist.collectives import direct
    for n in (1, 2, 3, 4):
        for root in range(n):
            scheds = [direct.scatter(r, n, root, [3] * n) for r in range(n)]
            assert any(isinstance(s, Copy) and s.late for rnd in scheds[root].rounds for s in rnd)
            X = [np.arange(3.0 * n) if r == root else np.zeros(0) for r in range(n)]
            res = simulate(scheds, X, outs=[np.zeros(3) for _ in range(n)])
            for r, o in enumerate(res.outs):
                assert o.tolist() == list(np.arange(3.0 * n)[3 * r:3 * r + 3]), (n, root, r)


def test_lend_marks_pair_up():
    """A step marked lendable is cut into the transport's lent frames at both ends, so a Send and
    its Recv must carry the same mark, and a lent Send that its Recv reduces must say so
    (`reduced`: such steps are lent from a larger size). The ring all-reduce marks every step,
    its reduce-scatter half `reduced`, as does the ring reduce-scatter, and their schedules pair
    up at every size."""
    a = Schedule("x").add(Send(1, Chunk(OUT, 0, 2), lend=True))
    b = Schedule("x").add(Recv(0, Chunk(OUT, 0, 2)))
    assert a.lends and not b.lends and Schedule("y").extend(a).lends
    with pytest.raises(ScheduleError, match="recv lend=False from rank 0, whose send has lend=True"):
        simulate([a, b], [np.zeros(2), np.zeros(2)], inplace=True)
    c = Schedule("x").add(Recv(0, Chunk(OUT, 0, 2), reduce=True, lend=True))
    with pytest.raises(ScheduleError, match="lent recv reduce=True from rank 0, whose send has reduced=False"):
        simulate([a, c], [np.zeros(2), np.zeros(2)], inplace=True)
    d = Schedule("x").add(Send(1, Chunk(OUT, 0, 2), lend=True, reduced=True))
    with pytest.raises(ScheduleError, match="lent recv reduce=False from rank 0, whose send has reduced=True"):
        simulate([d, Schedule("x").add(Recv(0, Chunk(OUT, 0, 2), lend=True))], [np.zeros(2)] * 2, inplace=True)
    assert simulate([d, c], [np.ones(2), np.ones(2)], inplace=True).outs[1].tolist() == [2.0, 2.0]
    from neuron_dist.collectives import ring
    for n in (2, 3, 4):
        order = list(range(n))[::-1]
        scheds = [ring.allreduce(order, r, 10) for r in range(n)]
        steps = [s for r in scheds[0].rounds for s in r if isinstance(s, (Send, Recv))]
        assert scheds[0].lends and all(s.lend for s in steps) and len(steps) == 4 * (n - 1)
        assert sum(isinstance(s, Send) and s.reduced for s in steps) == n - 1  # the reduce-scatter half
        X = [np.arange(10.0) * (r + 1) for r in range(n)]
        res = simulate(scheds, X, inplace=True)
        assert all(np.array_equal(o, np.arange(10.0) * n * (n + 1) / 2) for o in res.outs)
        counts = [3 + r for r in range(n)]
        scheds = [ring.reduce_scatter(order, r, counts) for r in range(n)]
        steps = [s for r in scheds[0].rounds for s in r if isinstance(s, (Send, Recv))]
        assert all(s.lend and (s.reduced if isinstance(s, Send) else s.reduce) for s in steps)
        X = [np.arange(sum(counts), dtype=float) * (r + 1) for r in range(n)]
        res = simulate(scheds, X, outs=[np.zeros(c) for c in counts])
        want = np.arange(sum(counts), dtype=float) * n * (n + 1) / 2
        for r, o in enumerate(res.outs):
            assert np.array_equal(o, want[sum(counts[:r]):sum(counts[:r + 1])])


def test_simulate_torch_buffers():
    torch = pytest.importorskip("torch")
    topo = place("trn2", 1, 6)
    X = [torch.arange(10, dtype=torch.float64) * (r + 1) for r in range(6)]
    res = simulate([torus_allreduce(r, topo, 10) for r in range(6)], X, inplace=True)
    assert all(torch.equal(o, torch.arange(10, dtype=torch.float64) * 21) for o in res.outs)


def test_rdh_bitwise_identical_results():
    topo = place("trn2", 1, 12)
    rng = np.random.default_rng(1)
    X = [rng.standard_normal(33) for _ in range(12)]
    res = simulate([rdh_allreduce_topo(r, topo, 33) for r in range(12)], X, inplace=True)
    assert all(np.array_equal(o, res.outs[0]) for o in res.outs)
    assert np.allclose(res.outs[0], np.sum([rng2 for rng2 in np.random.default_rng(1).standard_normal((12, 33))], axis=0))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 12, 16])
@pytest.mark.parametrize("algo", sorted(a for c, a in BUILDERS if c == "allreduce"))
def test_allreduce_bit_identical_under_any_operand_order(algo, n):
    """Every all-reduce builder ends bit-identical on every rank even for an op that is not
    commutative (schedule.py, "Operand order"): op(a, b) = 2a + b. The reduce ops are
    commutative in value only (torch.maximum(+0.0, -0.0) is -0.0 and its mirror +0.0; NaN +
    -NaN takes the first operand's sign), so a pair of ranks that both reduce the same two
    vectors in opposite orders ends apart; this op shows it on any data. Both forms of the
    two-rank direct schedule (one frame; scratch), with no placement, on one node and on two
    (the grid and hierarchical schedules need one), with the placement's ring order as a group
    passes it (at 12 and 16 ranks not the identity, so recursive doubling pairs ranks out of
    rank order)."""
    rng = np.random.default_rng(n)
    topos = [None, place("trn2", 1, n)] + ([place("trn2", 2, n // 2)] if n % 2 == 0 else [])
    for count, eager in ((5, 5), (5, 4), (1, 0), (3 * n + 1, 1 << 10)):
        X = [rng.integers(-8, 9, count).astype(np.float64) for _ in range(n)]
        for t in topos:
            order = tuple(ring_order(t)) if t else ()
            scheds = [build(Spec("allreduce", r, n, count, order=order, eager_count=eager, topo=t), algo)
                      for r in range(n)]
            res = simulate(scheds, [x.copy() for x in X], inplace=True, op=lambda a, b: 2 * a + b)
            for r, o in enumerate(res.outs):
                assert np.array_equal(o.view(np.int64), res.outs[0].view(np.int64)), \
                    (algo, n, count, eager, t and len({s.node for s in t.slots}), r, o, res.outs[0])


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_direct_reductions_combine_in_rank_order(n):
    """direct.py's promise: the direct all-reduce (both two-rank forms, and the staged one from
    three ranks) and the direct reduce-scatter combine the ranks' contributions in group-rank
    order, op(...op(op(x0, x1), x2)..., x(n-1)), on every rank. The op 2a + b shows any other
    order on any data; with the real ops only the sign of a zero or a NaN tells (schedule.py,
    "Operand order"). The bit-identical check above passes a staged all-reduce whose every rank
    puts the received vector first alike, and a reduce-scatter's ranks compute no element twice
    (review AO: mutants D03, D05 and, for the reduce below, D07 each passed every other test)."""
    from neuron_dist.collectives.direct import allreduce, reduce, reduce_scatter

    def op(a, b):
        return 2 * a + b

    def fold(xs):  # op(...op(op(x0, x1), x2)..., x(n-1))
        return functools.reduce(op, xs)

    rng = np.random.default_rng(100 + n)
    for count, eager in ((5, 5), (5, 0)):  # (at two ranks: the one-frame form; through scratch)
        X = [rng.integers(-8, 9, count).astype(np.float64) for _ in range(n)]
        res = simulate([allreduce(r, n, count, eager) for r in range(n)], [x.copy() for x in X], inplace=True, op=op)
        for r, o in enumerate(res.outs):
            assert np.array_equal(o, fold(X)), ("allreduce", n, count, eager, r, o, fold(X))
    counts = [3 + r % 2 for r in range(n)]
    off = np.cumsum([0] + counts)
    X = [rng.integers(-8, 9, sum(counts)).astype(np.float64) for _ in range(n)]
    res = simulate([reduce_scatter(r, n, counts) for r in range(n)], X, [np.full(c, np.nan) for c in counts], op=op)
    for r, o in enumerate(res.outs):
        want = fold([x[off[r]:off[r + 1]] for x in X])
        assert np.array_equal(o, want), ("reduce_scatter", n, r, o, want)
    # the tree reduce: its root takes its children's partial results in rank order counted from
    # the root (the root's own first), so at root 0 the group-rank order of the direct
    # all-reduce: a 3-rank float32 reduce of 2^-24, 1, 2^-24 is 1.0 as that all-reduce's, where
    # the children taken in the other order made it 1.0000001 (review AO: mutant D07). Strings
    # under concatenation (associative, not commutative) show the order whatever the tree's shape.
    for root in range(n):
        S = [np.array([chr(65 + r)], dtype=object) for r in range(n)]
        res = simulate([reduce(r, n, root, 1) for r in range(n)], S, [np.array([""], dtype=object) for _ in range(n)],
                       op=lambda a, b: a + b)
        want = "".join(chr(65 + (root + k) % n) for k in range(n))
        assert res.outs[root][0] == want, ("reduce", n, root, res.outs[root][0], want)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("count,eager", [(7, 0), (7, 7), (7, 6), (0, 4), (1000, 1 << 16)])
def test_direct_allreduce_forms(n, count, eager):
    """Direct all-reduce: bit-identical on every rank; at two ranks a vector of at most one
    frame (`eager_count`) is reduced straight into OUT a round after its send (no scratch), a
    larger one through scratch in the send's round; one rank has nothing to do."""
    from neuron_dist.collectives.direct import allreduce
    rng = np.random.default_rng(count + n)
    X = [rng.standard_normal(count) for _ in range(n)]
    scheds = [allreduce(r, n, count, eager) for r in range(n)]
    res = simulate(scheds, [x.copy() for x in X], inplace=True)
    assert all(np.array_equal(o, res.outs[0]) for o in res.outs)
    assert np.allclose(res.outs[0], np.sum(X, axis=0))
    if n == 1:
        assert not scheds[0].rounds and scheds[0].tmp_count == 0
    if n == 2:
        eager_form = count <= eager
        assert (scheds[0].tmp_count == 0) == eager_form
        first_round_receives = any(isinstance(s, Recv) for s in scheds[0].rounds[0])
        assert first_round_receives != eager_form  # a late receive only for what fits a frame


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("algo", ["tree", "direct"])
def test_broadcast_forms(n, algo):
    """Broadcast from every root: every rank ends with the root's data; the direct form reaches
    every rank in one hop from the root, the tree in ceil(log2 n) rounds; in both every other
    rank confirms to the root with an empty frame (so ranks disagreeing on the root fail)."""
    from neuron_dist.collectives.direct import broadcast, tree_broadcast
    build = tree_broadcast if algo == "tree" else broadcast
    for root in range(n):
        for count in (0, 1, 7):
            X = [np.full(count, float(r)) for r in range(n)]
            res = simulate([build(r, n, root, count) for r in range(n)], X, inplace=True)
            for r, o in enumerate(res.outs):
                assert np.array_equal(o, np.full(count, float(root))), (algo, n, root, count, r)
            confirms = [s for r in range(n) if r != root for rnd in build(r, n, root, count).rounds
                        for s in rnd if isinstance(s, Send) and s.peer == root]
            assert len(confirms) == n - 1 and all(s.src.count == 0 for s in confirms)
            if algo == "direct":
                for r in range(n):
                    if r != root:
                        recvs = [s for rnd in build(r, n, root, count).rounds for s in rnd if isinstance(s, Recv)]
                        assert [s.peer for s in recvs] == [root], (n, root, r)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_reduce_and_gather_forms(n):
    """Reduce and gather to every root: the root gets the sum / every block in rank order, IN is
    untouched. Whatever root a rank holds, its first round sends an empty frame to the next rank
    and waits only for the previous rank's, and that is its first frame to the next rank: going
    round the ranks, a rank whose predecessor holds another root meets that root's argument
    checksum at once (the real frames carry it; tests/test_misuse.py runs it), where ranks that
    both took themselves for the root used to wait for the time-out."""
    from neuron_dist.collectives.direct import gather, reduce
    for root in range(n):
        for count in (0, 1, 7):
            X = [np.arange(count, dtype=float) * (r + 1) for r in range(n)]
            res = simulate([reduce(r, n, root, count) for r in range(n)], X, [np.full(count, -1.0) for _ in range(n)])
            assert np.array_equal(res.outs[root], np.arange(count) * n * (n + 1) / 2), (n, root, count)
            assert all(np.array_equal(x, np.arange(count, dtype=float) * (r + 1)) for r, x in enumerate(X))
            counts = [count + r % 2 for r in range(n)]  # uneven blocks
            X = [np.full(c, float(r)) for r, c in enumerate(counts)]
            res = simulate([gather(r, n, root, counts) for r in range(n)], X, [np.full(sum(counts), -1.0) for _ in range(n)])
            assert np.array_equal(res.outs[root], np.concatenate(X)), (n, root, count)
    for build, args in ((reduce, (7,)), (gather, ([7] * n,))):
        for r in range(n):
            for root in range(n):
                rounds = build(r, n, root, *args).rounds
                first_recvs = [s for s in rounds[0] if isinstance(s, Recv)]
                sends_next = [s for rnd in rounds for s in rnd if isinstance(s, Send) and s.peer == (r + 1) % n]
                if n == 1:
                    assert not first_recvs and not sends_next
                    continue
                assert [(s.peer, s.dst.count) for s in first_recvs] == [((r - 1) % n, 0)], (build, n, r, root)
                assert sends_next[0].src.count == 0 and sends_next[0] in rounds[0], (build, n, r, root)


def test_an_unreadable_instance_file_is_a_clear_error(tmp_path):
    """NEURON_DIST_INSTANCE pointing at a file that is not JSON gave a bare JSONDecodeError
    naming neither the file nor the variable."""
    import pytest
    from neuron_dist.topology.instances import load_instance
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match=r"instance description '.*bad\.json' cannot be read"):
        load_instance(bad, register=False)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a table of fields"):
        load_instance(bad, register=False)


def test_forced_algorithm_errors_list_what_the_backend_runs():
    """NEURON_DIST_ALGO=broadcast:bogus listed the cost model's names ('tree, ring, direct'),
    and 'ring', taken from that list, was then refused: the list is now the backend's own."""
    import pytest
    from neuron_dist.collectives import select
    for spec in ("broadcast:bogus", "broadcast:ring"):
        with pytest.raises(ValueError, match=r"for broadcast; valid: tree, direct$"):
            select.parse_forced(spec)
    assert select.parse_forced("all_reduce:RING") == {"allreduce": "ring"}


def test_hosts_decide_the_nodes_when_no_launcher_numbered_them():
    """Ranks started by hand with LOCAL_RANK/LOCAL_WORLD_SIZE but no GROUP_RANK, laid out
    across hosts in turn (0 and 2 on one host, 1 and 3 on the other): the node guessed as
    rank // LOCAL_WORLD_SIZE put ranks 0 and 1 on one node with core 0 each, and every rank
    failed with 'both use core 0 on node 0' (probe G; Gloo ran it). The hosts decide now; a
    launcher's node numbers, when given, still stand."""
    import types
    from neuron_dist.group import Group
    from neuron_dist.topology import placement_from_env

    def members(hosts, local_ranks, given):
        env = {"GROUP_RANK": "0"} if given else {}
        return [{"slot": placement_from_env(env, r, 4, lr, 2).to_dict(), "node_given": given}
                for r, lr in enumerate(local_ranks)]

    hosts = ["a", "b", "a", "b"]
    g = types.SimpleNamespace(rank=0, name="default_pg", hosts=hosts, peers_info=members(hosts, [0, 0, 1, 1], False))
    topo, order = Group._build_topology(g)
    assert [(s.node, s.cores) for s in topo.slots] == [(0, (0,)), (1, (0,)), (0, (1,)), (1, (1,))]
    assert sorted(order) == [0, 1, 2, 3]
    one_host = ["a"] * 4  # one host: the environment's numbering (a simulated 2-node job) stands
    g = types.SimpleNamespace(rank=0, name="default_pg", hosts=one_host, peers_info=members(one_host, [0, 1, 0, 1], False))
    assert [s.node for s in Group._build_topology(g)[0].slots] == [0, 0, 1, 1]


@pytest.mark.parametrize("hosts, extra, want", [
    (["a", "a", "b", "b"], {}, [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))]),
    (["a", "b", "a", "b"], {}, [(0, (0,)), (1, (0,)), (0, (1,)), (1, (1,))]),  # hosts in turn
    (["a", "a", "b", "b"], {"LOCAL_WORLD_SIZE": "2"}, [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))]),
    (["a", "b", "c", "d"], {"NEURON_RT_NUM_CORES": "2"}, [(n, (0, 1)) for n in range(4)]),
    (["a", "a", "b", "b"], {"NEURON_RT_VISIBLE_CORES": "1"}, "ranks 0 and 1 both use core 1 on node 0"),
    (["a", "b", "b", "b"], {}, "ranks 1, 2, 3 run on host b: 3 processes on one node, but mini2 at LNC=1 has "
                               "only 2 logical cores per node"),
    (["a", "a", "b", "b"], {"NEURON_RT_NUM_CORES": "2"}, "ranks 0, 1 run on host a: 2 processes x 2 cores"),
])
def test_ranks_without_local_numbers_are_placed_by_their_hosts(monkeypatch, tmp_path, hosts, extra, want):
    """A job started with rank and world size only (tcp:// or file:// init, a launcher of its
    own: no LOCAL_RANK, no node number) was placed as local rank `rank` of `world_size`, and 4
    ranks on two hosts of an instance with 2 cores per node failed at init ("4 processes per
    node but mini2 at LNC=1 has only 2 logical cores per node"; with LOCAL_WORLD_SIZE=2 alone
    "bad rank numbers: rank 2 of 4, local rank 2 of 2"), where Gloo ran. The hosts decide now:
    a rank's position among its host's ranks is its local rank."""
    import types
    from neuron_dist.group import Group, GroupError
    (tmp_path / "mini2.json").write_text(
        '{"name": "mini2", "chips": 1, "physical_cores_per_chip": 2, "default_lnc": 1, "supported_lnc": [1],'
        ' "graph": "single", "hbm_bandwidth": "800 GB/s", "efa_bandwidth": "100 Gbps", "multi_node": true}')
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "GROUP_RANK", "NODE_ID", "NODE_RANK", "NEURON_RT_VISIBLE_CORES",
                "NEURON_RT_NUM_CORES", "NEURON_LOGICAL_NC_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NEURON_DIST_INSTANCE", str(tmp_path / "mini2.json"))
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    peers = [Group._placement_info(types.SimpleNamespace(rank=r, size=4)) for r in range(4)]
    assert all(p["by_host"] is not None and not p["node_given"] for p in peers)
    g = types.SimpleNamespace(rank=0, name="default_pg", hosts=hosts, peers_info=peers)
    if isinstance(want, str):
        with pytest.raises((GroupError, ValueError), match=want):
            Group._build_topology(g)
        return
    topo, order = Group._build_topology(g)
    assert [(s.node, s.cores) for s in topo.slots] == want
    assert sorted(order) == [0, 1, 2, 3]
    monkeypatch.setenv("LOCAL_RANK", "0")  # a launcher's local rank: placed by the environment, as before
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert Group._placement_info(types.SimpleNamespace(rank=0, size=4))["by_host"] is None


def test_an_unknown_instance_in_the_environment_names_the_variable():
    """'unknown instance trn9' did not say where the name came from."""
    from neuron_dist.topology import placement_from_env
    with pytest.raises(ValueError, match=r"NEURON_DIST_INSTANCE='trn9': unknown instance 'trn9'"):
        placement_from_env({"NEURON_DIST_INSTANCE": "trn9"}, 0, 2, 0, 2)
    with pytest.raises(ValueError, match=r"NEURON_DIST_INSTANCE='/nope/x.json': instance description"):
        placement_from_env({"NEURON_DIST_INSTANCE": "/nope/x.json"}, 0, 2, 0, 2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_ring_allgather_sends_its_own_block_from_the_input(n):
    """The ring all-gather's first round copies the rank's block into OUT and sends it from IN in
    the same round (one round fewer than copy, then send from OUT): n-1 rounds, uneven blocks in
    any ring order fill every output, and at two ranks the ring is the direct schedule."""
    from neuron_dist.collectives import direct, ring
    rng = np.random.default_rng(n)
    order = [int(r) for r in rng.permutation(n)]
    blocks = [int(c) for c in rng.integers(0, 6, n)]
    X = [rng.integers(-8, 9, c).astype(np.float64) for c in blocks]
    scheds = [ring.allgather(order, r, blocks) for r in range(n)]
    assert all(len(s.rounds) == max(1, n - 1) for s in scheds)
    res = simulate(scheds, [x.copy() for x in X], [np.full(sum(blocks), np.nan) for _ in range(n)])
    for r, o in enumerate(res.outs):
        assert np.array_equal(o, np.concatenate(X)), (n, r)
    if n == 2:
        assert [s.rounds for s in scheds] == [direct.allgather(r, 2, blocks).rounds for r in range(2)]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_no_round_sends_a_slice_its_receives_write(n):
    """Round semantics (schedule.py): a round's sends and receives progress together, so a Send
    must not read what a Recv of its round writes: an executor sends a large slice frame by
    frame while the peer's frames are reduced into it. The simulator copies a send's slice
    whole when it posts it and cannot see that; recursive doubling sending straight from the
    slice it reduces (without its TMP copy) passed every simulated test and gave wrong sums
    over shared memory and zmq from 3M float32 (rdh forced, worlds 2 and 3; review AR, D08).
    Every builder, in place for all-reduce, with and without a placement; and the simulator
    itself refuses such a round (`simulate.round_conflict`), so every simulated test checks it."""
    clash = [Schedule("x").add(Send(1 - r, Chunk(OUT, 0, 4)), Recv(1 - r, Chunk(OUT, 0, 4), reduce=True))
             for r in range(2)]
    with pytest.raises(ScheduleError, match=r"rank 0 round 0: .* reads what .* writes"):
        simulate(clash, [np.ones(4)] * 2, inplace=True)
    topos = [None, place("trn2", 1, n)] + ([place("trn2", 2, n // 2)] if n % 2 == 0 else [])
    for t in topos:
        order = tuple(ring_order(t)) if t else ()
        for collective, algo in BUILDERS:
            for count in (1, 7, 3 * n + 1):
                for r in range(n):
                    spec = Spec(collective, r, n, count, counts=(count,) * n, recv_counts=(count,) * n,
                                order=order, eager_count=4, topo=t)
                    for k, rnd in enumerate(build(spec, algo).rounds):
                        clash = round_conflict(rnd, collective == "allreduce")
                        assert clash is None, (collective, algo, n, count, r, k, clash)


@pytest.mark.parametrize("nodes,ppn", [(2, 4), (3, 4), (4, 2)])
def test_hierarchical_schedules_send_across_nodes_the_least_data(nodes, ppn):
    """The hierarchical schedules put the network on the smallest pieces (hierarchical.py): each
    rank sends (N-1) * count elements to other nodes for all-gather and reduce-scatter (the
    inter-node step first in all-gather, last in reduce-scatter) and 2 (N-1)/N of its 1/L share
    for all-reduce, where the dimensions walked the other way send L times as much (review AR)."""
    topo = place("trn2.48xlarge", nodes, ppn, 2)
    P, c = topo.size, 12
    for build_, count, want in ((hierarchical_allgather, c, (nodes - 1) * c),
                                (hierarchical_reduce_scatter, c, (nodes - 1) * c),
                                (hierarchical_allreduce, c * P, 2 * (nodes - 1) * c)):
        check = {hierarchical_allgather: check_allgather, hierarchical_reduce_scatter: check_reduce_scatter,
                 hierarchical_allreduce: check_allreduce}[build_]
        res = check(build_, topo, count)
        sent = [0] * P
        for s, d, b in res.transfers:
            if topo.slots[s].node != topo.slots[d].node:
                sent[s] += b // 8
        assert sent == [want] * P, (build_.__name__, nodes, ppn, sent, want)


def test_ring_builders_follow_the_ring_order_they_are_given():
    """The ring order comes from the topology (select.py), so that a ring crosses each link and
    each network boundary once: the registered ring and recursive-doubling builders pair ranks
    along `Spec.order`, not in rank order (review AR: a builder taking range(size) still
    reduced right, and every other test passed). Order 0, 2, 1, 3: rank 0's ring neighbours
    are 2 (next) and 3 (previous), its first doubling partner 2."""
    order = (0, 2, 1, 3)
    for collective, algo in (("allreduce", "ring"), ("allgather", "ring"), ("reduce_scatter", "ring"),
                             ("allreduce", "rdh")):
        for rank in range(4):
            s = build(Spec(collective, rank, 4, 8, counts=(8,) * 4, order=order), algo)
            sends = [st.peer for rnd in s.rounds for st in rnd if isinstance(st, Send)]
            recvs = [st.peer for rnd in s.rounds for st in rnd if isinstance(st, Recv)]
            p = order.index(rank)
            if algo == "ring":
                assert set(sends) == {order[(p + 1) % 4]} and set(recvs) == {order[(p - 1) % 4]}, \
                    (collective, rank, sends, recvs)
            else:
                assert sends == [order[p ^ 1], order[p ^ 2]], (rank, sends)


def test_a_schedule_lends_when_any_round_does_whatever_follows():
    """`Schedule.lends` tells the executor to plan lending for the steps marked so; a round
    without such steps after one with them must not clear it: the two-rank direct all-reduce
    (its scratch form), the direct reduce-scatter and the folding ranks of recursive doubling
    end on rounds that lend nothing (review AR: with `add` resetting the mark, those calls lost
    single-copy reads, and every other test passed)."""
    from neuron_dist.collectives import direct
    a = Schedule("x").add(Send(1, Chunk(OUT, 0, 2), lend=True)).add(Copy(Chunk(OUT, 0, 2), Chunk(IN, 0, 2)))
    assert a.lends
    assert direct.allreduce(0, 2, 1000, 0).lends and direct.allreduce(0, 3, 1000, 0).lends
    assert direct.reduce_scatter(1, 3, [4, 4, 4]).lends
    assert rdh_allreduce(4, range(5), 10).lends  # (fold in, then the answer: lent)
