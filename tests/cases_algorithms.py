"""Rank-side: every registered algorithm of the reducing collectives, forced through
NEURON_DIST_ALGO, on real processes, on the default placement and on a 2-node placement
(ranks of one host told they sit on two modelled nodes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rankctx import env, reference, same, values
from neuron_dist.collectives.algorithms import algorithms_for
from neuron_dist.collectives.torus import placed_grid
from neuron_dist.collectives.select import choose


def _run_all(rank, world, group, tag):
    checks = 0
    for coll in ("allreduce", "allgather", "reduce_scatter", "broadcast"):
        for algo in algorithms_for(coll):
            with env(NEURON_DIST_ALGO=f"{coll}:{algo}"):
                if coll == "broadcast":  # every root, one frame and several
                    for root in range(world):
                        for count in (0, 5, 200_003):
                            ins = [values(r, count, torch.float32, "sum", 24 + root) for r in range(world)]
                            x = ins[rank].clone()
                            dist.broadcast(x, group_src(group, root), group=group)
                            same(x, ins[root], f"{tag} broadcast:{algo} root {root} n={count}")
                            checks += 1
                for dtype in (torch.float32, torch.bfloat16, torch.int64) if coll != "broadcast" else ():
                    # 200,003 elements: more than one frame (512 KiB) in float32 and int64, one
                    # frame in bfloat16, so direct all-reduce runs both its two-rank forms
                    for count in (0, 5, 1001) + ((200_003,) if coll == "allreduce" else ()):
                        what = f"{tag} {coll}:{algo} {dtype} n={count}"
                        if coll == "allreduce":
                            ins = [values(r, count, dtype, "sum", 21) for r in range(world)]
                            x = ins[rank].clone()
                            dist.all_reduce(x, group=group)
                            same(x, reference(ins, "sum", dtype), what)
                        elif coll == "allgather":
                            ins = [values(r, count, dtype, "sum", 22) for r in range(world)]
                            out = torch.empty(count * world, dtype=dtype)
                            dist.all_gather_into_tensor(out, ins[rank], group=group)
                            same(out, torch.cat(ins), what)
                        else:
                            ins = [values(r, count * world, dtype, "sum", 23) for r in range(world)]
                            out = torch.empty(count, dtype=dtype)
                            dist.reduce_scatter_tensor(out, ins[rank], group=group)
                            same(out, reference(ins, "sum", dtype)[rank * count:(rank + 1) * count], what)
                        checks += 1
            # the group records what ran: a grid schedule where the placement has no grid for
            # it runs (and is recorded as) the ring
            want, topo = algo, group_of(group).topology
            if algo in ("torus", "hierarchical"):
                want = placed_grid(topo, algo)[1] if topo is not None else "ring"
            used = {(r["collective"], r["algorithm"]) for r in group_of(group).report()}
            assert (coll, want) in used, f"{tag}: forced {coll}:{algo} but the group ran {sorted(used)}"
    return checks


def reductions_agree_bitwise(rank, world):
    """SUM, MAX and MIN over signed zeros and NaNs of either sign, every all-reduce algorithm
    forced: NaN wherever some rank holds one (torch.maximum's rule for MAX and MIN), the
    reference's value elsewhere, and the same bytes on every rank (compared over Gloo). The ops
    are commutative in value only (torch.maximum(+0.0, -0.0) is -0.0 and its mirror +0.0; the
    sign of NaN + -NaN is the first operand's), so ranks that reduce the same two vectors in
    opposite orders end apart (schedule.py, "Operand order"). 200,003 float32 elements: the
    two-rank direct form through scratch as well as the one-frame form."""
    import rankctx
    choices = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), -float("nan")], dtype=torch.float64)
    checks = 0
    for algo in algorithms_for("allreduce"):
        with env(NEURON_DIST_ALGO=f"allreduce:{algo}"):
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                for count in (5, 1001) + ((200_003,) if dtype == torch.float32 and algo == "direct" else ()):
                    ins = []
                    for r in range(world):
                        g = torch.Generator().manual_seed(r * 7919 + count)
                        ins.append(choices[torch.randint(0, 6, (count,), generator=g)].to(dtype))
                    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"),
                                     (dist.ReduceOp.MIN, "min")):
                        what = f"allreduce:{algo} {name} {dtype} n={count}"
                        x = ins[rank].clone()
                        dist.all_reduce(x, op=op)
                        stack = torch.stack([i.double() for i in ins])
                        want = getattr(stack, {"sum": "sum", "max": "amax", "min": "amin"}[name])(0).to(dtype)
                        torch.testing.assert_close(x, want, rtol=0, atol=0, equal_nan=True,
                                                   msg=lambda m: f"{what}: {m}")
                        mine = x.view(torch.uint8)
                        if algo == "direct" and world == 2:  # both ranks put rank 0's operand first
                            # (review AG: with the order swapped on both ranks, every check above still
                            # passed; only the sign of a zero or a NaN tells, which assert_close ignores)
                            fold = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[name](ins[0], ins[1])
                            apart = (fold.view(torch.uint8) != mine).view(count, dtype.itemsize).any(1).nonzero()
                            assert not len(apart), (f"rank {rank}: {what}: not op(rank 0's, rank 1's) at {len(apart)} "
                                                    f"elements, the first {int(apart[0])}")
                        everyone = [torch.empty_like(mine) for _ in range(world)]
                        dist.all_gather(everyone, mine, group=rankctx.GLOO)
                        for r in range(world):
                            apart = (everyone[r] != mine).view(count, dtype.itemsize).any(1).nonzero()
                            assert not len(apart), (f"rank {rank}: {what}: rank {r} holds other bits at "
                                                    f"{len(apart)} elements, the first {int(apart[0])}")
                        checks += 1
    return checks


def group_src(group, root):
    """The global rank of `group`'s rank `root` (broadcast's src is global)."""
    return root if group is None else dist.get_global_rank(group, root)


def group_of(group):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg.group


def every_algorithm(rank, world):
    return _run_all(rank, world, None, "default placement")


def two_node_placement(rank, world):
    """A subgroup created while the environment says: 2 nodes of world/2 ranks each."""
    if world % 2:
        return 1
    half = world // 2
    with env(LOCAL_WORLD_SIZE=half, LOCAL_RANK=rank % half, GROUP_RANK=rank // half):
        g = dist.new_group(list(range(world)))
    topo = g.group.topology
    assert len({s.node for s in topo.slots}) == 2, topo.slots
    checks = _run_all(rank, world, g, "2-node placement")
    dist.destroy_process_group(g)
    return checks


def ultraserver_domains(rank, world):
    """A subgroup whose 4 ranks are told they sit on trn2u nodes 0, 1, 4 and 5: two nodes of
    each of two UltraServers. The torus runs on [nodes of an UltraServer] x [UltraServers] (it
    ran one line 0-1-4-5 over every node) and each reducing collective, torus forced, gives what
    Gloo gives over the same ranks."""
    import rankctx
    from neuron_dist.topology import torus_grid
    if world != 4:
        return 1
    with env(NEURON_DIST_INSTANCE="trn2u.48xlarge", LOCAL_WORLD_SIZE=1, LOCAL_RANK=0,
             GROUP_RANK=(0, 1, 4, 5)[rank]):
        g = dist.new_group(list(range(world)))
    grid = torus_grid(g.group.topology)
    assert (grid.shape, grid.kinds) == ((2, 2), ("node", "domain")), grid
    checks = 0
    for coll in ("allreduce", "allgather", "reduce_scatter"):
        with env(NEURON_DIST_ALGO=f"{coll}:torus"):
            for dtype in (torch.float32, torch.int64):
                for count in (0, 1, 5, 1001, 200_003):
                    what = f"trn2u nodes 0,1,4,5 {coll}:torus {dtype} n={count}"
                    if coll == "allreduce":
                        x = values(rank, count, dtype, "sum", 31)
                        a, b = x.clone(), x.clone()
                        dist.all_reduce(a, group=g)
                        dist.all_reduce(b, group=rankctx.GLOO)
                    elif coll == "allgather":
                        x = values(rank, count, dtype, "sum", 32)
                        a, b = (torch.empty(count * world, dtype=dtype) for _ in range(2))
                        dist.all_gather_into_tensor(a, x, group=g)
                        dist.all_gather_into_tensor(b, x, group=rankctx.GLOO)
                    else:
                        x = values(rank, count * world, dtype, "sum", 33)
                        a, b = (torch.empty(count, dtype=dtype) for _ in range(2))
                        dist.reduce_scatter_tensor(a, x, group=g)
                        dist.reduce_scatter_tensor(b, x, group=rankctx.GLOO)
                    same(a, b, what)
                    checks += 1
    used = {(r["collective"], r["algorithm"]) for r in g.group.report()}
    assert {("allreduce", "torus"), ("allgather", "torus"), ("reduce_scatter", "torus")} <= used, used
    # uneven blocks: the torus builder runs the ring, and the call is recorded as the ring (it was
    # recorded as the torus forced), against Gloo
    with env(NEURON_DIST_ALGO="reduce_scatter:torus"):
        sizes = [1 + r for r in range(world)]
        blocks = [values(rank, n, torch.float32, "sum", 34 + q) for q, n in enumerate(sizes)]
        a, b = torch.empty(sizes[rank]), torch.empty(sizes[rank])
        dist.reduce_scatter(a, [t.clone() for t in blocks], group=g)
        dist.reduce_scatter(b, [t.clone() for t in blocks], group=rankctx.GLOO)
        same(a, b, "trn2u nodes 0,1,4,5 reduce_scatter:torus of uneven blocks")
        ran = g.group.records[-1]
        assert (ran.kind, ran.algorithm) == ("reduce_scatter", "ring"), (ran.kind, ran.algorithm)
        checks += 1
    dist.destroy_process_group(g)
    return checks


def forced_unknown(rank, world):
    with env(NEURON_DIST_ALGO="allreduce:warp"):
        try:
            dist.all_reduce(torch.ones(3))
        except ValueError as e:
            assert "warp" in str(e) and "ring" in str(e), e
            return 1
    raise AssertionError("an unknown forced algorithm was accepted")


def model_policy(rank, world):
    """NEURON_DIST_TUNING=model: the group runs exactly what the cost model picks."""
    from neuron_dist import topology
    g = group_of(None)
    checks = 0
    with env(NEURON_DIST_TUNING="model"):
        for coll in ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier"):
            for nbytes in (4 << 10, 1 << 20, 64 << 20):
                want = topology.choose(coll, nbytes, g.topology, None, available=algorithms_for(coll))
                assert choose(coll, nbytes, g) == want, (coll, nbytes, choose(coll, nbytes, g), want)
                checks += 1
        x = torch.ones(1 << 16)
        dist.all_reduce(x)
        same(x, torch.full((1 << 16,), float(world)), "all_reduce under the model policy")
    return checks


def host_policy(rank, world):
    """NEURON_DIST_TUNING=host on shared memory: all-reduce goes direct while it is latency-bound
    (two ranks: up to one frame each way, reduced from the peer's slot), ring above; at two
    ranks all-gather and reduce-scatter keep the model's pick (ring and direct coincide);
    broadcast goes from the root directly up to 1 MiB, down the tree above (directly at every
    size where the host has fewer cores than the group has ranks)."""
    from neuron_dist import topology
    from neuron_dist.collectives.select import HOST_FLAT_BROADCAST_BYTES, HOST_RING_BYTES
    g = group_of(None)
    if g.transport.name != "shm" or world == 1:
        return 1
    checks = 0
    with env(NEURON_DIST_TUNING="host"):
        direct_up_to = g.frame_bytes if world == 2 else HOST_RING_BYTES
        for nbytes in (4 << 10, HOST_RING_BYTES, HOST_RING_BYTES + 4, g.frame_bytes, g.frame_bytes + 4, 64 << 20):
            want = "direct" if nbytes <= direct_up_to else "ring"
            assert choose("allreduce", nbytes, g) == want, (world, nbytes, choose("allreduce", nbytes, g), want)
            if world == 2:
                for coll in ("allgather", "reduce_scatter"):
                    model = topology.choose(coll, nbytes, g.topology, None, available=algorithms_for(coll))
                    assert choose(coll, nbytes, g) == model, (coll, nbytes)
            checks += 1
        for nbytes in (4 << 10, HOST_FLAT_BROADCAST_BYTES, HOST_FLAT_BROADCAST_BYTES + 4, 64 << 20):
            # more local ranks than cores: the root's own sends at every size
            flat = nbytes <= HOST_FLAT_BROADCAST_BYTES or g.transport.oversubscribed
            want = "direct" if flat else "tree"
            assert choose("broadcast", nbytes, g) == want, (world, nbytes, choose("broadcast", nbytes, g), want)
            checks += 1
        for count in (g.frame_bytes // 4, g.frame_bytes // 4 + 1):  # the last one-frame size, the first two-frame
            ins = [values(r, count, torch.float32, "sum", 31) for r in range(world)]
            x = ins[rank].clone()
            dist.all_reduce(x)
            same(x, reference(ins, "sum", torch.float32), f"host policy all_reduce of {count} floats")
            checks += 1
    return checks
