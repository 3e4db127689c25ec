"""Rank-side checks for every collective: each runs the neuron backend and Gloo on the same
inputs and compares both with a reference computed from every rank's (regenerated) input.
Each function returns how many comparisons it made, so the test can assert coverage."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import rankctx as R
from rankctx import DTYPES, c10d_op, env, factor, gloo_ran, ops_for, reference, same, values

COUNTS = (0, 1, 7, 1003)
BIG = 300_001  # > one 512 KiB frame in fp32: exercises pipelined frames


def _ops(dtype):
    return ops_for(dtype)


def allreduce(rank, world, seed=0, dtypes=None):
    checks = 0
    for dtype in dtypes or DTYPES:
        for op in _ops(dtype):
            for count in COUNTS + ((BIG,) if dtype == torch.float32 and op == "sum" else ()):
                ins = [values(r, count, dtype, op, seed) for r in range(world)]
                want = reference(ins, op, dtype)
                x = ins[rank].clone()
                dist.all_reduce(x, op=c10d_op(op))
                same(x, want, f"all_reduce {dtype} {op} n={count}")
                checks += 1
                if op in ("sum", "product", "min", "max", "band", "bor", "bxor"):
                    y = ins[rank].clone()
                    if gloo_ran(lambda: dist.all_reduce(y, op=c10d_op(op), group=R.GLOO)):
                        same(x, y, f"all_reduce vs gloo {dtype} {op} n={count}")
                        checks += 1
                elif op.startswith("premul"):  # Gloo has no PREMUL_SUM: SUM then scale
                    y = ins[rank].clone()
                    dist.all_reduce(y, group=R.GLOO)
                    same(x, (y.double() * factor(op)).to(dtype), f"all_reduce premul vs gloo {dtype}")
                    checks += 1
    return checks


def allreduce_noncontig(rank, world):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    x = base.t()  # non-contiguous
    assert not x.is_contiguous()
    dist.all_reduce(x)
    want = sum(torch.arange(24, dtype=torch.float32).reshape(4, 6) + r for r in range(world)).t()
    same(x, want, "all_reduce non-contiguous")
    s = torch.tensor(float(rank + 1))  # 0-dim
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    same(s, torch.tensor(float(world)), "all_reduce 0-dim")
    return 2


def allreduce_common_path(rank, world):
    """dist.all_reduce of one contiguous dense tensor takes the adapter's common path
    (`_allreduce_common`: checks and plan looked up), every other form the general one, and the
    two interoperate: a rank whose tensor is a non-contiguous view (general path) meets peers
    whose tensor is contiguous (common path) in the same collective, with the same frames."""
    from neuron_dist import NeuronProcessGroup, debug
    pg = dist.distributed_c10d._get_default_group()
    if not isinstance(pg, NeuronProcessGroup):
        pg = pg._get_backend(torch.device("cpu"))
    taken = []
    real = pg._allreduce_common

    def watch(tensors, opts):
        work = real(tensors, opts)
        taken.append(work is not None)
        return work

    pg._allreduce_common = watch
    checks = 0
    try:
        def run(x, op, want, what, common):
            nonlocal checks
            taken.clear()
            dist.all_reduce(x, op=c10d_op(op))
            same(x, want, what)
            assert taken == [common], f"{what}: common path taken {taken}, expected [{common}]"
            checks += 1

        for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.int64, "max"), (torch.bool, "bor")):
            ins = [values(r, 12, dtype, op, 5) for r in range(world)]
            want = reference(ins, op, dtype)
            run(ins[rank].clone(), op, want, f"{dtype} {op} first call", True)
            run(ins[rank].clone().reshape(3, 4), op, want.reshape(3, 4), f"{dtype} {op} 2-D", True)
            # one rank non-contiguous (general path), the others contiguous (common path): same collective
            x = ins[rank].clone()
            if rank == world - 1:
                x = torch.stack([x, x], dim=1)[:, 0]  # same values, stride 2
                assert not x.is_contiguous()
            run(x, op, want, f"{dtype} {op} mixed forms", rank != world - 1)
        ins = [values(r, 9, torch.float32, "premul_sum", 6) for r in range(world)]
        run(ins[rank].clone(), "premul_sum", reference(ins, "premul_sum", torch.float32), "premul_sum", False)
        debug.set_enabled(True)
        try:
            ins = [values(r, 5, torch.float32, "sum", 7) for r in range(world)]
            run(ins[rank].clone(), "sum", reference(ins, "sum", torch.float32), "debug check on", False)
        finally:
            debug.set_enabled(None)
        # a reduce op the dtype lacks is refused with the general path's error, on every call
        for _ in range(2):
            try:
                dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG)
            except ValueError as e:
                assert str(e).startswith(f"[rank {rank}] allreduce: ") and "avg" in str(e).lower(), e
            else:
                raise AssertionError("AVG of bool was accepted")
        checks += 1
    finally:
        del pg._allreduce_common
    return checks


def common_paths(rank, world):
    """dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.broadcast and
    dist.all_to_all_single (without split sizes) of contiguous dense tensors take the adapter's
    common paths (`_allgather_common`, `_reduce_scatter_common`, `_broadcast_common`,
    `_alltoall_common`: checks and plan looked up), every other form the general one, and the
    two meet in one collective: a rank passing a non-contiguous tensor (general path) with peers
    passing contiguous ones (common path). The in-place forms: an all-gather whose input is this
    rank's block of the output (FSDP2's call) stays common, one whose input sits elsewhere in the
    output is copied first; a reduce-scatter whose output is this rank's block of its input stays
    common (written in place), one whose output is another block goes general (staged)."""
    from neuron_dist import NeuronProcessGroup, debug
    pg = dist.distributed_c10d._get_default_group()
    if not isinstance(pg, NeuronProcessGroup):
        pg = pg._get_backend(torch.device("cpu"))
    taken = []
    names = ("_allgather_common", "_reduce_scatter_common", "_broadcast_common", "_alltoall_common")

    def watch(real):
        def call(*args):
            work = real(*args)
            taken.append(work is not None)
            return work
        return call

    for name in names:
        setattr(pg, name, watch(getattr(pg, name)))
    checks = 0

    def expect(what, common):
        nonlocal checks
        assert taken == [common], f"{what}: common path taken {taken}, expected [{common}]"
        taken.clear()
        checks += 1

    def strided(x):  # the same values at stride 2
        y = torch.stack([x, x], dim=1)[:, 0] if x.dim() == 1 else torch.stack([x, x], dim=-1)[..., 0]
        assert not y.is_contiguous()
        return y

    try:
        taken.clear()
        for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.int64, "max")):
            c = 6
            blocks = [values(r, c, dtype, "sum", 11) for r in range(world)]
            gathered = torch.cat(blocks)
            for mixed in (False, True):
                odd = mixed and rank == world - 1
                out = torch.full((world * c,), -1).to(dtype)
                dist.all_gather_into_tensor(strided(out) if odd else out, strided(blocks[rank]) if odd else
                                            blocks[rank].clone())
                if not odd:
                    same(out, gathered, f"all_gather_into_tensor {dtype} mixed={mixed}")
                expect(f"all_gather_into_tensor {dtype} mixed={mixed}", not odd)
            out2 = torch.empty(world, c, dtype=dtype)  # a 2-D output, as FSDP2's
            dist.all_gather_into_tensor(out2, blocks[rank].clone())
            same(out2.view(-1), gathered, f"all_gather_into_tensor 2-D {dtype}")
            expect("all_gather_into_tensor 2-D", True)
            inplace = torch.zeros(world * c, dtype=dtype)  # input = this rank's block of the output
            inplace[rank * c:(rank + 1) * c] = blocks[rank]
            dist.all_gather_into_tensor(inplace, inplace[rank * c:(rank + 1) * c])
            same(inplace, gathered, f"all_gather_into_tensor in place {dtype}")
            expect("all_gather_into_tensor in place", True)
            for k in (c, 70_001):  # input inside the output, not as this rank's block (large: lent frames)
                bs = [values(r, k, dtype, "sum", 15) for r in range(world)]
                elsewhere = torch.zeros(world * k, dtype=dtype)
                at = ((rank + 1) % world) * k
                elsewhere[at:at + k] = bs[rank]
                dist.all_gather_into_tensor(elsewhere, elsewhere[at:at + k])
                same(elsewhere, torch.cat(bs), f"all_gather_into_tensor input elsewhere in the output {dtype} {k}")
                expect("all_gather_into_tensor input elsewhere", True)

            ins = [values(r, world * c, dtype, op, 12) for r in range(world)]
            want = reference(ins, op, dtype)[rank * c:(rank + 1) * c]
            for mixed in (False, True):
                odd = mixed and rank == 0
                out = torch.zeros(c, dtype=dtype)
                dist.reduce_scatter_tensor(out, strided(ins[rank]) if odd else ins[rank].clone(), op=c10d_op(op))
                same(out, want, f"reduce_scatter_tensor {dtype} {op} mixed={mixed}")
                expect(f"reduce_scatter_tensor {dtype} {op} mixed={mixed}", not odd)
            x = ins[rank].clone()  # in place: the output is this rank's block of the input (written
            dist.reduce_scatter_tensor(x[rank * c:(rank + 1) * c], x, op=c10d_op(op))  # there: common)
            same(x[rank * c:(rank + 1) * c], want, f"reduce_scatter_tensor in place {dtype} {op}")
            expect("reduce_scatter_tensor in place", True)
            if world > 1:  # another rank's block of the input: staged (the general path)
                x = ins[rank].clone()
                other = x[(rank + 1) % world * c:((rank + 1) % world + 1) * c]
                dist.reduce_scatter_tensor(other, x, op=c10d_op(op))
                same(other, want, f"reduce_scatter_tensor into another block of its input {dtype} {op}")
                expect("reduce_scatter_tensor into another block of its input", False)

            for root in range(world):
                src = values(root, 2 * c, dtype, "sum", 13).reshape(2, c)
                for mixed in (False, True):
                    odd = mixed and rank == (root + 1) % world
                    t = src.clone() if rank == root else torch.zeros(2, c, dtype=dtype)
                    if odd:
                        t = strided(t)
                    dist.broadcast(t, src=root)
                    same(t, src, f"broadcast {dtype} root {root} mixed={mixed}")
                    expect(f"broadcast root {root} mixed={mixed}", not odd)
            # all_to_all_single without split sizes: block j of rank r's input goes to rank j
            rows = [(torch.arange(world * 2 * c) % 97 + 100 * r).to(dtype).reshape(world * 2, c) for r in range(world)]
            want = torch.cat([rows[j][rank * 2:(rank + 1) * 2] for j in range(world)])
            for mixed in (False, True):
                odd = mixed and rank == world - 1
                out = torch.zeros(world * 2, c, dtype=dtype)
                dist.all_to_all_single(strided(out) if odd else out, rows[rank].clone())
                if not odd:
                    same(out, want, f"all_to_all_single {dtype} mixed={mixed}")
                expect(f"all_to_all_single {dtype} mixed={mixed}", not odd)
            x = rows[rank].clone()  # in place: the general path stages the output
            dist.all_to_all_single(x, x)
            same(x, want, f"all_to_all_single in place {dtype}")
            expect("all_to_all_single in place", False)
            splits = [2] * world  # explicit split sizes: the general path
            out = torch.zeros(world * 2, c, dtype=dtype)
            dist.all_to_all_single(out, rows[rank].clone(), splits, splits)
            same(out, want, f"all_to_all_single with split sizes {dtype}")
            assert taken == [], taken
            checks += 1
        ins = [values(r, world * 3, torch.float32, "premul_sum", 14) for r in range(world)]
        out = torch.zeros(3)
        dist.reduce_scatter_tensor(out, ins[rank].clone(), op=c10d_op("premul_sum"))
        same(out, reference(ins, "premul_sum", torch.float32)[rank * 3:(rank + 1) * 3], "reduce_scatter premul_sum")
        expect("reduce_scatter_tensor premul_sum", False)
        debug.set_enabled(True)
        try:
            t = torch.ones(4)
            dist.broadcast(t, src=0)
            expect("broadcast under the debug check", False)
        finally:
            debug.set_enabled(None)
        # wrong sizes and ops are refused with the general path's errors
        for call, words in ((lambda: dist.all_gather_into_tensor(torch.empty(world * 3 + 1), torch.ones(3)),
                             "all_gather_into_tensor: output has"),
                            (lambda: dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.bool),
                                                                torch.ones(world * 3, dtype=torch.bool),
                                                                op=dist.ReduceOp.AVG), "reduce_scatter_tensor: "),
                            (lambda: dist.broadcast(torch.ones(3), src=world), "broadcast")) + \
                ((lambda: dist.all_to_all_single(torch.empty(world * 2 + 1), torch.ones(world * 2 + 1)),
                  "is not divisible by the group size"),) * (world > 1):
            for _ in range(2):
                try:
                    call()
                except (ValueError, RuntimeError) as e:
                    assert words in str(e), (words, str(e))
                else:
                    raise AssertionError(f"accepted: {words}")
            checks += 1
        taken.clear()
    finally:
        for name in names:
            delattr(pg, name)
    return checks


def allreduce_coalesced(rank, world):
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        ts = [values(rank, c, dtype, "sum", 3) for c in (5, 0, 17)]
        want = [reference([values(r, c, dtype, "sum", 3) for r in range(world)], "sum", dtype) for c in (5, 0, 17)]
        dist.all_reduce_coalesced(ts)
        for t, w in zip(ts, want):
            same(t, w, f"all_reduce_coalesced {dtype}")
            checks += 1
    return checks


def futures_complete_before_wait_returns(rank, world):
    """wait() returned once the op was done, before get_future()'s future completed and its
    `then` callbacks ran (Gloo completes the future first): with a late peer `fut.value()` right
    after wait() failed torch's INTERNAL ASSERT in 18 of 20 calls, and a callback's write landed
    after the caller had read the tensor (a review's probe). The same calls on the Gloo group."""
    import time
    checks = 0
    for group in (None, R.GLOO):
        for i in range(4):
            if rank == world - 1 and world > 1:
                time.sleep(0.02)  # the others' waits start before the op is done
            x = torch.full((4,), 2.0)
            w = dist.all_reduce(x, async_op=True, group=group)
            fut = w.get_future()
            halved = fut.then(lambda f: f.value()[0].div_(2))
            w.wait()
            where = f"{'gloo' if group is not None else 'neuron'} call {i}"
            assert fut.done() and halved.done() and w.is_completed(), f"{where}: the future or its callback still ran"
            assert fut.value()[0] is x, where
            same(x, torch.full((4,), float(world)), f"{where}: the callback's write before wait() returned")
            checks += 1
    return checks


def async_ops(rank, world):
    """async_op=True: several in flight, completed out of order of waiting, futures resolve."""
    xs = [values(rank, 1000 + i, torch.float32, "sum", i) for i in range(4)]
    wants = [reference([values(r, 1000 + i, torch.float32, "sum", i) for r in range(world)], "sum", torch.float32)
             for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    fut = works[2].get_future()
    for w in reversed(works):
        w.wait()
    got = fut.wait()
    assert isinstance(got, list) and got[0] is xs[2], "future must hold the output tensors"
    for x, w in zip(xs, wants):
        same(x, w, "async all_reduce")
    assert all(w.is_completed() and w.is_success() for w in works)
    # polled to completion (is_completed in a loop, never wait): the poll yields the GIL the
    # engine needs (RESULTS.md "Thirty-ninth pass": 60-190 ms to 6-8 ms at 16 MiB)
    big = values(rank, 1 << 20, torch.float32, "sum", 8)
    w = dist.all_reduce(big, async_op=True)
    while not w.is_completed():
        pass
    same(big, reference([values(r, 1 << 20, torch.float32, "sum", 8) for r in range(world)], "sum", torch.float32),
         "async all_reduce polled to completion")
    # a future asked for only after the op finished (it is made lazily) still holds the outputs
    late = works[0].get_future().wait()
    assert isinstance(late, list) and late[0] is xs[0], "a late future must hold the output tensors"
    # asyncOp=False (what a blocking dist.* call passes) marks the op synchronous for the group
    from neuron_dist import NeuronProcessGroup
    pg = dist.distributed_c10d._get_default_group()
    if not isinstance(pg, NeuronProcessGroup):
        pg = pg._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    y = values(rank, 33, torch.float32, "sum", 9)
    w = pg.allreduce([y], opts)
    w.wait()
    assert getattr(w._op, "sync", None) is True and w.get_future().wait()[0] is y
    same(y, reference([values(r, 33, torch.float32, "sum", 9) for r in range(world)], "sum", torch.float32),
         "synchronous all_reduce")
    assert works[1].result()[0] is xs[1]
    # an empty all_reduce_coalesced completes (was IndexError), as the other coalesced forms do
    dist.all_reduce_coalesced([])
    if world > 1:  # result() of an unfinished op raises, as Gloo's does (it returned the input);
        # sourceRank() only on receives (an isend's gave its destination)
        t = torch.zeros(3)
        if rank == 0:
            w = dist.irecv(t, src=1)
            for call, text in ((w.result, "needs to be completed"), (w._source_rank, None)):
                if text is None:
                    assert call() in (-1, 1)  # a recv from a named source: that rank (Gloo's -1 before)
                    continue
                try:
                    call()
                except RuntimeError as e:
                    assert text in str(e) and "recv" in str(e), e
                else:
                    raise AssertionError("result() of an unfinished irecv did not raise")
            # as Gloo's: an unfinished op with no error is a success so far, and wait() takes
            # float seconds (it raised AttributeError on the float) but no int (TypeError)
            assert w.is_success() and not w.is_completed()
            for arg, error, words in ((0.2, RuntimeError, "timed out"), (1, TypeError, "timedelta")):
                try:
                    w.wait(arg)
                except error as e:
                    assert words in str(e), e
                else:
                    raise AssertionError(f"wait({arg!r}) of an unfinished irecv returned")
            dist.barrier(group=R.GLOO)  # rank 1 sends only after this
            assert w.wait(30.0) is True
            assert w.result()[0] is t and w._source_rank() == 1 and t.tolist() == [1.0, 2.0, 3.0]
        elif rank == 1:
            dist.barrier(group=R.GLOO)
            w = dist.isend(torch.tensor([1.0, 2.0, 3.0]), dst=0)
            w.wait()
            try:
                w._source_rank()
            except RuntimeError as e:
                assert "only be called on work objects that correspond to a recv" in str(e), e
            else:
                raise AssertionError("sourceRank() of an isend did not raise")
        else:
            dist.barrier(group=R.GLOO)
    return len(xs)


def allgather(rank, world):
    checks = 0
    for dtype in DTYPES:
        for count in COUNTS + ((BIG,) if dtype == torch.float32 else ()):
            ins = [values(r, count, dtype, "sum", 1) for r in range(world)]
            out = [torch.empty(count, dtype=dtype) for _ in range(world)]
            dist.all_gather(out, ins[rank])
            for r in range(world):
                same(out[r], ins[r], f"all_gather {dtype} n={count} block {r}")
            flat = torch.empty(world * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, ins[rank])
            same(flat, torch.cat(ins), f"all_gather_into_tensor {dtype} n={count}")
            g = torch.empty(world * count, dtype=dtype)
            if gloo_ran(lambda: dist.all_gather_into_tensor(g, ins[rank], group=R.GLOO)):
                same(flat, g, f"all_gather_into_tensor vs gloo {dtype} n={count}")
                checks += 1
            checks += 2
    # 2-D output in the into-tensor form, and a non-contiguous output
    x = torch.full((2, 3), float(rank))
    out2 = torch.empty(2 * world, 3)
    dist.all_gather_into_tensor(out2, x)
    same(out2, torch.cat([torch.full((2, 3), float(r)) for r in range(world)]), "all_gather_into_tensor 2-D")
    nc = torch.empty(3, 2 * world).t()
    dist.all_gather_into_tensor(nc, x)
    same(nc, out2, "all_gather_into_tensor non-contiguous output")
    # in place, as FSDP2 calls it: the input is this rank's block of the output
    for count in (5, BIG):
        whole = torch.zeros(world * count)
        mine = whole.narrow(0, rank * count, count)
        mine.copy_(values(rank, count, torch.float32, "sum", 1))
        dist.all_gather_into_tensor(whole, mine)
        same(whole, torch.cat([values(r, count, torch.float32, "sum", 1) for r in range(world)]),
             f"all_gather_into_tensor in place n={count}")
    return checks + 4


def allgather_coalesced(rank, world):
    ins = [values(rank, c, torch.float32, "sum", 5) for c in (3, 0, 11)]
    outs = [torch.empty(world * i.numel()) for i in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, c in zip(outs, (3, 0, 11)):
        same(o, torch.cat([values(r, c, torch.float32, "sum", 5) for r in range(world)]), "coalesced all_gather")
    pg = dist.distributed_c10d._get_default_group()
    outs2 = [torch.empty(world * i.numel()) for i in ins]
    pg.allgather_into_tensor_coalesced(outs2, ins).wait()
    for o, o2 in zip(outs, outs2):
        same(o2, o, "allgather_into_tensor_coalesced")
    # torch's layout: lists[r][j] is rank r's input j (the number of inputs unrelated to the world)
    for counts in ((3, 0, 11), (4,), (2, 6)):
        mine = [values(rank, c, torch.float32, "sum", 5) for c in counts]
        lists = [[torch.empty(c) for c in counts] for _ in range(world)]
        dist.all_gather_coalesced(lists, mine)
        glists = [[torch.empty(c) for c in counts] for _ in range(world)]
        dist.all_gather_coalesced(glists, mine, group=R.GLOO)
        for r in range(world):
            for j, c in enumerate(counts):
                same(lists[r][j], values(r, c, torch.float32, "sum", 5), f"all_gather_coalesced rank {r} input {j}")
                same(lists[r][j], glists[r][j], "all_gather_coalesced vs gloo")
    # inputs of several dtypes in one coalesced call, a block past one frame. Gloo takes them
    # too, but with these five returns wrong blocks (zeros) even at world 1: the reference only
    kinds = ((torch.float32, 3), (torch.int64, 0), (torch.bool, 5), (torch.bfloat16, 7), (torch.float64, 70_001))
    mixed = [values(rank, c, dt, "sum", 8) for dt, c in kinds]
    outs = [torch.empty(world * c, dtype=dt) for dt, c in kinds]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, mixed):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for o, (dt, c) in zip(outs, kinds):
        same(o, torch.cat([values(r, c, dt, "sum", 8) for r in range(world)]), f"coalesced all_gather of several dtypes ({dt})")
    return 14


def reduce_scatter(rank, world):
    checks = 0
    for dtype in DTYPES:
        for op in _ops(dtype):
            for count in (0, 1, 5) + ((70_001,) if dtype == torch.float32 and op == "sum" else ()):
                ins = [values(r, count * world, dtype, op, 2) for r in range(world)]
                want = reference(ins, op, dtype)[rank * count:(rank + 1) * count]
                out = torch.empty(count, dtype=dtype)
                before = ins[rank].clone()
                dist.reduce_scatter_tensor(out, ins[rank], op=c10d_op(op))
                same(out, want, f"reduce_scatter_tensor {dtype} {op} n={count}")
                same(ins[rank], before, "reduce_scatter_tensor must not modify its input")
                out_l = torch.empty(count, dtype=dtype)
                dist.reduce_scatter(out_l, list(ins[rank].chunk(world)) if count else
                                    [torch.empty(0, dtype=dtype)] * world, op=c10d_op(op))
                same(out_l, want, f"reduce_scatter list {dtype} {op} n={count}")
                checks += 2
                if op == "sum" and dtype != torch.bool:
                    g = torch.empty(count, dtype=dtype)
                    if gloo_ran(lambda: dist.reduce_scatter_tensor(g, ins[rank], group=R.GLOO)):
                        same(out, g, f"reduce_scatter vs gloo {dtype}")
                        checks += 1
    # list form with a block size per rank (Gloo takes it): empty, small and multi-frame blocks
    for sizes in ([j % 3 for j in range(world)], [70_001 + 3 * j for j in range(world)]):
        off = [sum(sizes[:j]) for j in range(world)]
        for dtype, op in ((torch.float32, "sum"), (torch.int32, "max"), (torch.float64, "avg")):
            full = [values(r, sum(sizes), dtype, op, 4) for r in range(world)]
            want = reference(full, op, dtype)[off[rank]:off[rank] + sizes[rank]]
            blocks = list(full[rank].split(sizes))
            out = torch.empty(sizes[rank], dtype=dtype)
            dist.reduce_scatter(out, blocks, op=c10d_op(op))
            same(out, want, f"reduce_scatter list, blocks {sizes[:4]}, {dtype} {op}")
            checks += 1
            g = torch.empty(sizes[rank], dtype=dtype)
            if op != "avg" and gloo_ran(lambda: dist.reduce_scatter(g, blocks, op=c10d_op(op), group=R.GLOO)):
                same(out, g, f"reduce_scatter list, blocks {sizes[:4]}, vs gloo {dtype}")
                checks += 1
    return checks


def reduce_scatter_coalesced(rank, world):
    sizes = (2, 0, 9)
    ins = [values(rank, c * world, torch.float32, "sum", 6) for c in sizes]
    outs = [torch.empty(c) for c in sizes]
    pg = dist.distributed_c10d._get_default_group()
    from torch.distributed import ReduceScatterOptions
    opts = ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    pg.reduce_scatter_tensor_coalesced(outs, ins, opts).wait()
    for o, c in zip(outs, sizes):
        full = reference([values(r, c * world, torch.float32, "sum", 6) for r in range(world)], "avg", torch.float32)
        same(o, full[rank * c:(rank + 1) * c], "reduce_scatter_tensor_coalesced avg")
    # several dtypes in one coalesced call (Gloo takes them): one reduction per dtype
    kinds = ((torch.float32, 3), (torch.float64, 2), (torch.int32, 0), (torch.float32, 70_001), (torch.int32, 5))
    for op in ("sum", "max"):
        ins = [values(rank, c * world, dt, op, 9) for dt, c in kinds]
        for group in (None, R.GLOO):
            outs = [torch.empty(c, dtype=dt) for dt, c in kinds]
            with dist._coalescing_manager(group=group, async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, i, op=c10d_op(op), group=group)
            cm.wait()
            for o, (dt, c) in zip(outs, kinds):
                full = reference([values(r, c * world, dt, op, 9) for r in range(world)], op, dt)
                same(o, full[rank * c:(rank + 1) * c],
                     f"coalesced reduce_scatter of several dtypes ({dt} {op}, {'gloo' if group else 'neuron'})")
    # its Work's result (and future) holds every output, not the last dtype's only
    outs = [torch.empty(c, dtype=dt) for dt, c in kinds]
    work = pg.reduce_scatter_tensor_coalesced(outs, [values(rank, c * world, dt, "sum", 9) for dt, c in kinds],
                                              ReduceScatterOptions())
    value = work.get_future().wait()
    work.wait()
    for got, how in ((work.result(), "result()"), (value, "its future's value")):
        assert len(got) == len(outs) and all(g.dtype == o.dtype and g.data_ptr() == o.data_ptr() for g, o in zip(got, outs)), \
            f"rank {rank}: a coalesced reduce_scatter of several dtypes: {how} holds {len(got)} tensors, not its {len(outs)} outputs"
    return len(sizes) + 2 * 2 * len(kinds) + 1


def in_place(rank, world):
    """Outputs that share memory with their inputs, as NCCL's in-place forms allow: reduce-scatter
    into this rank's piece of its input, all-to-all onto its input, all-gather from another
    rank's block of its output; each against the out-of-place result and Gloo."""
    checks = 0
    for count in (1, 5, 1003, 70_001):
        x = values(rank, count * world, torch.float32, "sum", 7)
        want = torch.empty(count)
        dist.reduce_scatter_tensor(want, x.clone())
        same(want, reference([values(r, count * world, torch.float32, "sum", 7) for r in range(world)],
                             "sum", torch.float32)[rank * count:(rank + 1) * count], "reduce_scatter_tensor out of place")
        inplace = x.clone()
        dist.reduce_scatter_tensor(inplace.narrow(0, rank * count, count), inplace)
        same(inplace.narrow(0, rank * count, count), want, f"reduce_scatter_tensor in place n={count}")
        a2a = x.clone()
        ref = torch.empty_like(x)
        dist.all_to_all_single(ref, x.clone())
        dist.all_to_all_single(a2a, a2a)
        same(a2a, ref, f"all_to_all_single in place n={count}")
        whole = torch.zeros(count * world)
        other = whole.narrow(0, (rank + 1) % world * count, count)
        other.copy_(values(rank, count, torch.float32, "sum", 8))
        dist.all_gather_into_tensor(whole, other)
        same(whole, torch.cat([values(r, count, torch.float32, "sum", 8) for r in range(world)]),
             f"all_gather_into_tensor from another block of the output n={count}")
        checks += 4
    # the same over zmq, whose large sends go out without a copy and are read after the step that
    # sent them: an input in the block the ring receives into in the round it sends from must be
    # sent from a copy (c10d._gather_source; sent as it was, 4-16 MiB ones arrived partly overwritten)
    with env(NEURON_DIST_TRANSPORT="zmq", NEURON_DIST_ALGO="allgather:ring"):
        tcp = dist.new_group(list(range(world)))
    try:
        count = 1 << 21
        want = torch.cat([values(r, count, torch.float32, "sum", 12) for r in range(world)])
        for shift in range(1, world):
            for form in ("tensor", "list"):
                whole = torch.zeros(count * world)
                blocks = list(whole.chunk(world))
                other = blocks[(rank + shift) % world]
                other.copy_(want.narrow(0, rank * count, count))
                if form == "tensor":
                    dist.all_gather_into_tensor(whole, other, group=tcp)
                else:
                    dist.all_gather(blocks, other, group=tcp)
                same(whole, want, f"all_gather {form} over zmq from block {(rank + shift) % world} of the output")
                checks += 1
    finally:
        dist.destroy_process_group(tcp)
    # in place into this rank's own block, written there without staging (algorithms.OWN_BLOCK_OUT:
    # a 64 MiB one staged took 28.6 ms against 10.8 out of place), with every reduce-scatter
    # algorithm forced, several ops, the tensor and the list form, against the reference and Gloo
    from neuron_dist import plans
    written, execution = [], plans.Plan.execution

    def recorded(self, op, src, out):
        written.append(out.data_ptr() if out is not None else None)
        return execution(self, op, src, out)

    plans.Plan.execution = recorded
    try:
        for algo in ("ring", "direct", None):
            with env(NEURON_DIST_ALGO=f"reduce_scatter:{algo}") if algo else contextlib.nullcontext():
                for count, op in ((5, "sum"), (70_001, "avg"), (1003, "max"), (300_001, "premul_sum")):
                    ins = [values(r, count * world, torch.float32, op, 9) for r in range(world)]
                    want = reference(ins, op, torch.float32)[rank * count:(rank + 1) * count]
                    for form in ("tensor", "list"):
                        x = ins[rank].clone()
                        mine = x.narrow(0, rank * count, count)
                        written.clear()
                        if form == "tensor":
                            dist.reduce_scatter_tensor(mine, x, op=c10d_op(op))
                        else:
                            dist.reduce_scatter(mine, list(x.chunk(world)), op=c10d_op(op))
                        same(mine, want, f"reduce_scatter {form} in place {algo} {op} n={count}")
                        assert written == [mine.data_ptr()], \
                            f"rank {rank}: in-place reduce_scatter {form} ({algo}, {op}) was staged, not written in place"
                        g = ins[rank].clone()
                        if gloo_ran(lambda: dist.reduce_scatter_tensor(g.narrow(0, rank * count, count), g,
                                                                       op=c10d_op(op), group=R.GLOO)):
                            same(mine, g.narrow(0, rank * count, count), f"reduce_scatter in place vs Gloo {op}")
                        checks += 1
        # a builder registered without promising OWN_BLOCK_OUT (here the direct one as it was
        # before it kept the promise: rank 0's block copied over OUT first, so rank 1 summed
        # block 0 twice) makes the in-place calls that run it stage; the built-in one put back
        # writes in place again
        from neuron_dist.collectives import algorithms
        from neuron_dist.collectives.schedule import IN, OUT, TMP, Chunk, Copy, LocalReduce, Recv, Schedule, Send
        built_in = algorithms.BUILDERS[("reduce_scatter", "direct")]

        def copy_first(spec):
            r, n, c = spec.rank, spec.size, spec.counts[spec.rank]
            sch, slot = Schedule("direct", tmp_count=c * n), (lambda q: Chunk(TMP, q * c, c))
            sch.add(*[Send(q, Chunk(IN, q * c, c)) for q in range(n) if q != r], *[Recv(q, slot(q)) for q in range(n) if q != r])
            mine = Chunk(IN, r * c, c)
            return sch.add(Copy(mine if r == 0 else slot(0), Chunk(OUT, 0, c)),
                           *[LocalReduce(mine if q == r else slot(q), Chunk(OUT, 0, c)) for q in range(1, n)])

        try:
            algorithms.register("reduce_scatter", "direct", copy_first)
            assert not algorithms.registered("reduce_scatter", "direct")[1]
            with env(NEURON_DIST_ALGO="reduce_scatter:direct"):
                for count in (5, 70_001):
                    ins = [values(r, count * world, torch.float32, "sum", 10) for r in range(world)]
                    want = reference(ins, "sum", torch.float32)[rank * count:(rank + 1) * count]
                    for form in ("tensor", "list"):
                        x = ins[rank].clone()
                        mine = x.narrow(0, rank * count, count)
                        written.clear()
                        if form == "tensor":
                            dist.reduce_scatter_tensor(mine, x)
                        else:
                            dist.reduce_scatter(mine, list(x.chunk(world)))
                        same(mine, want, f"reduce_scatter {form} in place, a builder that made no promise, n={count}")
                        assert written and written != [mine.data_ptr()], \
                            f"rank {rank}: a builder that made no promise wrote OUT in place ({form})"
                        checks += 1
                    apart = torch.empty(count)  # (out of place: its common path keeps this builder's plan)
                    dist.reduce_scatter_tensor(apart, ins[rank].clone())
                    same(apart, want, f"reduce_scatter out of place, a builder that made no promise, n={count}")
        finally:
            algorithms.register("reduce_scatter", "direct", built_in)
        assert algorithms.registered("reduce_scatter", "direct")[1]
        # the built-in one put back runs again (a group's plans kept the schedule the user's
        # builder had made: rank 1 summed block 0 twice), in place; a builder registered after
        # a form's first call runs at its next; and a call queued behind another runs the
        # builder registered when it was made, as the checks made at its call assumed
        ran = []

        def spy(spec):
            ran.append(spec.rank)
            return built_in(spec)

        with env(NEURON_DIST_ALGO="reduce_scatter:direct"):
            count = 70_001
            ins = [values(r, count * world, torch.float32, "sum", 11) for r in range(world)]
            want = reference(ins, "sum", torch.float32)[rank * count:(rank + 1) * count]
            joined = torch.empty(count)  # (first a general-path call, which makes its plans afresh: the
            dist.reduce_scatter(joined, [t.clone() for t in ins[rank].chunk(world)])  # common path's must be too)
            same(joined, want, "reduce_scatter list, the built-in builder put back")
            x = ins[rank].clone()
            mine = x.narrow(0, rank * count, count)
            written.clear()
            dist.reduce_scatter_tensor(mine, x)
            same(mine, want, "reduce_scatter in place, the built-in builder put back")
            assert written == [mine.data_ptr()], f"rank {rank}: the built-in builder put back was staged"
            try:
                algorithms.register("reduce_scatter", "direct", spy, own_block_out=True)
                x = ins[rank].clone()
                mine = x.narrow(0, rank * count, count)
                dist.reduce_scatter_tensor(mine, x)
                same(mine, want, "reduce_scatter in place, a builder registered after the form's first call")
                assert ran == [rank], f"rank {rank}: the builder registered since the form's first call did not run"
                big = torch.ones(4 << 20)
                first = dist.all_reduce(big, async_op=True)  # (the next call queues behind it)
                x = ins[rank].clone()
                mine = x.narrow(0, rank * count, count)
                queued = dist.reduce_scatter_tensor(mine, x, async_op=True)
                algorithms.register("reduce_scatter", "direct", copy_first)
                first.wait()
                queued.wait()
                same(mine, want, "reduce_scatter in place, queued, a builder that made no promise registered meanwhile")
                # another thread registers one between the call's in-place check and its plan
                # (the check read the promise, the plan the builder: rank 1 summed block 0 twice,
                # 90 of 3000 calls with a thread registering in a loop)
                algorithms.register("reduce_scatter", "direct", built_in)
                x = ins[rank].clone()
                mine = x.narrow(0, rank * count, count)
                from neuron_dist import c10d as c10d_module
                choose = c10d_module._choose_algorithm

                def then_register(*args):  # (after the in-place check, before the plan)
                    algorithms.register("reduce_scatter", "direct", copy_first)
                    return choose(*args)

                c10d_module._choose_algorithm = then_register
                try:
                    dist.reduce_scatter_tensor(mine, x)
                finally:
                    c10d_module._choose_algorithm = choose
                same(mine, want, "reduce_scatter in place, a builder that made no promise registered during the call")
                checks += 4
            finally:
                algorithms.register("reduce_scatter", "direct", built_in)
    finally:
        plans.Plan.execution = execution
    return checks


def autograd_tensors(rank, world):
    """Tensors autograd tracks (Parameters, leaves that require grad, views of them), written in
    place by every collective that writes, small (caller's thread) and large (engine thread):
    the data path runs outside autograd, as Gloo's C++ does."""
    checks = 0
    for count in (4, 1 << 20):
        p = torch.nn.Parameter(torch.full((count,), float(rank + 1)))
        dist.all_reduce(p)
        same(p.detach(), torch.full((count,), float(sum(range(1, world + 1)))), f"all_reduce Parameter n={count}")
        b = torch.full((count,), float(rank), requires_grad=True)
        dist.broadcast(b, src=world - 1)
        same(b.detach(), torch.full((count,), float(world - 1)), f"broadcast requires_grad n={count}")
        r = torch.nn.Parameter(torch.ones(count))
        dist.reduce(r.view(2, -1), dst=0)
        same(r.detach(), torch.full((count,), float(world if rank == 0 else 1)), f"reduce view of a Parameter n={count}")
        o = torch.zeros(count * world, requires_grad=True)
        dist.all_gather_into_tensor(o, torch.full((count,), float(rank), requires_grad=True))
        same(o.detach(), torch.arange(world, dtype=torch.float32).repeat_interleave(count), f"all_gather into requires_grad n={count}")
        s = torch.zeros(count, requires_grad=True)
        dist.reduce_scatter_tensor(s, torch.ones(count * world, requires_grad=True), op=dist.ReduceOp.AVG)
        same(s.detach(), torch.ones(count), f"reduce_scatter AVG into requires_grad n={count}")
        w = dist.all_reduce(torch.nn.Parameter(torch.ones(count)), async_op=True)
        w.wait()
        same(w.result()[0].detach(), torch.full((count,), float(world)), f"async all_reduce Parameter n={count}")
        # the general path's joins: a non-contiguous view of a Parameter, and a coalesced call
        # of tensors that require grad (a cat into a buffer refused them: "functions with out=...")
        q = torch.nn.Parameter(torch.ones(max(2, count // 4), 4))
        dist.all_reduce(q.t()[:, :2])
        same(q.detach()[:2].t(), torch.full((4, 2), float(world)), f"all_reduce non-contiguous view of a Parameter n={count}")
        a, b = torch.ones(3, requires_grad=True) * 2, torch.ones(count, requires_grad=True) * 3
        dist.all_reduce_coalesced([a, b])
        same(a.detach(), torch.full((3,), 2.0 * world), "all_reduce_coalesced requires_grad")
        same(b.detach(), torch.full((count,), 3.0 * world), f"all_reduce_coalesced requires_grad n={count}")
        checks += 8
    return checks


def inference_tensors(rank, world):
    """Tensors made under `torch.inference_mode()` (a metric counted in an evaluation loop,
    all-reduced after it), written by every collective that writes, small (caller's thread) and
    large (engine thread), synchronous and async, outside the mode and inside it: Gloo writes
    them from C++; the data path ran under no_grad, where an in-place write into an inference
    tensor is refused, so the call failed and the group with it. Each result against the
    reference and Gloo's on the same tensors, then a plain call on the same group."""
    checks = 0
    for count in (4, 1 << 19):
        for inside in (False, True):
            for async_op in (False, True):
                what = f"n={count} {'inside' if inside else 'after'} inference_mode async={async_op}"
                with torch.inference_mode():
                    made = {"ar": torch.full((count,), float(rank + 1)),
                            "nc": torch.full((2, count), float(rank + 1)).t(),
                            "bc": torch.full((count,), float(rank)),
                            "ag": torch.zeros(count * world), "agl": [torch.zeros(count) for _ in range(world)],
                            "rs": torch.zeros(count), "a2a": torch.zeros(count * world),
                            "red": torch.full((count,), float(rank + 1))}
                src = {"ag": torch.full((count,), float(rank)), "rs": torch.ones(count * world),
                       "a2a": torch.arange(count * world, dtype=torch.float32) + 100 * rank}
                for backend in ("neuron", "gloo"):
                    group = R.GLOO if backend == "gloo" else None
                    with torch.inference_mode(inside):
                        t = {k: [x.clone() for x in v] if isinstance(v, list) else v.clone() for k, v in made.items()}
                        calls = [dist.all_reduce(t["ar"], group=group, async_op=async_op),
                                 dist.all_reduce(t["nc"], group=group, async_op=async_op),
                                 dist.broadcast(t["bc"], src=world - 1, group=group, async_op=async_op),
                                 dist.all_gather_into_tensor(t["ag"], src["ag"], group=group, async_op=async_op),
                                 dist.all_gather(t["agl"], src["ag"], group=group, async_op=async_op),
                                 dist.reduce_scatter_tensor(t["rs"], src["rs"], op=dist.ReduceOp.AVG, group=group, async_op=async_op),
                                 dist.all_to_all_single(t["a2a"], src["a2a"], group=group, async_op=async_op),
                                 dist.reduce(t["red"], dst=0, group=group, async_op=async_op)]
                        for w in calls:
                            if async_op:
                                w.wait()
                    if backend == "neuron":
                        mine = t
                    else:
                        theirs = t
                total = float(sum(range(1, world + 1)))
                same(mine["ar"], torch.full((count,), total), f"all_reduce {what}")
                same(mine["nc"], torch.full((count, 2), total), f"non-contiguous all_reduce {what}")
                same(mine["bc"], torch.full((count,), float(world - 1)), f"broadcast {what}")
                same(mine["ag"], torch.arange(world, dtype=torch.float32).repeat_interleave(count), f"all_gather {what}")
                same(torch.cat(mine["agl"]), mine["ag"], f"all_gather list {what}")
                same(mine["rs"], torch.ones(count), f"reduce_scatter AVG {what}")
                blocks = [(torch.arange(count * world, dtype=torch.float32) + 100 * r)[rank * count:(rank + 1) * count]
                          for r in range(world)]
                same(mine["a2a"], torch.cat(blocks), f"all_to_all_single {what}")
                if rank == 0:
                    same(mine["red"], torch.full((count,), total), f"reduce at the root {what}")
                for k in mine:
                    a, b = (torch.cat(mine[k]), torch.cat(theirs[k])) if k == "agl" else (mine[k], theirs[k])
                    if k != "red" or rank == 0:
                        same(a, b, f"{k} against Gloo {what}")
                checks += 8
    if world > 1:
        with torch.inference_mode():
            got = torch.zeros(1 << 19) if rank == 1 else torch.full((1 << 19,), 3.0)
        if rank == 0:
            dist.send(got, 1)
        elif rank == 1:
            dist.recv(got, 0)
            same(got, torch.full((1 << 19,), 3.0), "recv into an inference tensor")
        checks += 1
    after = torch.ones(3)
    dist.all_reduce(after)
    same(after, torch.full((3,), float(world)), "a plain all_reduce after them")
    return checks + 1


def call_forms(rank, world):
    """torch's convenience overloads of the group's methods (a bare tensor, a reduce op or a
    root where the options go), as DDP's Join and user code call them, against Gloo's group."""
    from torch.distributed.distributed_c10d import _get_default_group
    pgs = {"neuron": _get_default_group(), "gloo": R.GLOO}
    got = {}
    for name, pg in pgs.items():
        x = torch.arange(4.0) + rank
        pg.allreduce(x).wait()
        y = torch.arange(4.0) * (rank + 1)
        pg.allreduce(y, dist.ReduceOp.MAX).wait()
        z = torch.arange(4.0) - rank
        pg.allreduce([z], dist.ReduceOp.MIN).wait()
        s = torch.tensor(float(rank + 1))
        pg.allreduce(s).wait()
        b = torch.full((3,), float(rank))
        pg.broadcast(b, world - 1).wait()
        outs = [torch.empty(2) for _ in range(world)]
        pg.allgather(outs, torch.full((2,), float(rank))).wait()
        rd = torch.full((2,), float(rank + 1))
        pg.reduce(rd, 0, dist.ReduceOp.SUM).wait()
        rs = torch.empty(2)
        pg.reduce_scatter(rs, [torch.full((2,), float(rank + r)) for r in range(world)], dist.ReduceOp.SUM).wait()
        got[name] = [x, y, z, s, b, *outs, rd if rank == 0 else torch.zeros(0), rs]
    # integers of other types where torch's binding takes any (a numpy array of split sizes,
    # numpy integers or a bool as tags: they were refused, or raised on a numpy array's truth
    # value), and a receive's public source_rank() (it raised: only _source_rank reached us)
    import numpy as np
    for name, group in (("neuron", None), ("gloo", R.GLOO)):
        inp = torch.arange(float(sum(range(1, world + 1)))) + 100 * rank
        out = torch.empty((rank + 1) * world)
        dist.all_to_all_single(out, inp, output_split_sizes=np.full(world, rank + 1),
                               input_split_sizes=np.arange(1, world + 1), group=group)
        got[name].append(out)
        if world > 1:
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            for tag in (np.int64(5), True):
                t = torch.empty(3)
                sent = dist.isend(torch.full((3,), float(rank + tag)), nxt, group=group, tag=tag)
                w = dist.irecv(t, prv, group=group, tag=tag)
                w.wait()
                sent.wait()
                assert w.source_rank() == prv, (name, w.source_rank())
                got[name].append(t)
    for a, g in zip(got["neuron"], got["gloo"], strict=True):
        same(a, g, "call form vs gloo")
    return len(got["neuron"])


def broadcast(rank, world):
    checks = 0
    for root in range(world):
        for dtype in DTYPES:
            for count in COUNTS:
                src = values(root, count, dtype, "sum", 4)
                x = src.clone() if rank == root else torch.zeros(count, dtype=dtype)
                dist.broadcast(x, src=root)
                same(x, src, f"broadcast root {root} {dtype} n={count}")
                checks += 1
        x = torch.arange(12.).reshape(3, 4).t().contiguous().t() * (rank == root)
        y = torch.zeros(4, 3).t()
        if rank == root:
            y.copy_(torch.arange(12.).reshape(3, 4))
        dist.broadcast(y, src=root)
        same(y, torch.arange(12.).reshape(3, 4), "broadcast non-contiguous")
        g = values(root, 9, torch.float32) if rank == root else torch.zeros(9)
        dist.broadcast(g, src=root, group=R.GLOO)
        same(g, values(root, 9, torch.float32), "gloo broadcast agrees")
        checks += 2
    return checks


def reduce(rank, world):
    checks = 0
    for root in range(world):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.bool):
            for op in _ops(dtype):
                for count in (0, 1, 13):
                    ins = [values(r, count, dtype, op, 8) for r in range(world)]
                    x = ins[rank].clone()
                    dist.reduce(x, dst=root, op=c10d_op(op))
                    if rank == root:
                        same(x, reference(ins, op, dtype), f"reduce root {root} {dtype} {op} n={count}")
                        checks += 1
                    else:  # a non-root's buffer is its input still, PREMUL_SUM's included (review AL:
                        same(x, ins[rank], f"reduce non-root {rank} {dtype} {op} n={count}")  # scaled in place)
    # AVG under the cross-rank argument check: every rank describes the call the same way (only
    # the root divides, but the non-roots call it AVG too, not SUM)
    from neuron_dist import debug
    debug.set_enabled(True)
    try:
        for root in range(world):
            for dtype in (torch.float32, torch.int32):
                ins = [values(r, 7, dtype, "avg", 8) for r in range(world)]
                x = ins[rank].clone()
                dist.reduce(x, dst=root, op=dist.ReduceOp.AVG)
                if rank == root:
                    same(x, reference(ins, "avg", dtype), f"reduce root {root} {dtype} avg, debug check on")
                    checks += 1
    finally:
        debug.set_enabled(None)
    return checks


def gather_scatter(rank, world):
    checks = 0
    for root in range(world):
        for dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
            for count in (0, 1, 10):
                ins = [values(r, count, dtype, "sum", 9) for r in range(world)]
                outs = [torch.empty(count, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(ins[rank], gather_list=outs, dst=root)
                if rank == root:
                    for r in range(world):
                        same(outs[r], ins[r], f"gather root {root} {dtype} block {r}")
                    checks += 1
                out = torch.empty(count, dtype=dtype)
                dist.scatter(out, scatter_list=ins if rank == root else None, src=root)
                same(out, ins[rank], f"scatter root {root} {dtype}")
                checks += 1
        # what an async call's future holds, as Gloo's: the root's blocks, nothing elsewhere (a
        # non-root gather's held its input); a scatter's output on every rank
        held = {}
        for backend, group in (("neuron", None), ("gloo", R.GLOO)):
            x = torch.full((3,), float(rank))
            outs = [torch.empty(3) for _ in range(world)] if rank == root else None
            g = dist.gather(x, gather_list=outs, dst=root, group=group, async_op=True).get_future().wait()
            out = torch.empty(3)
            blocks = [torch.full((3,), float(r)) for r in range(world)] if rank == root else None
            sc = dist.scatter(out, scatter_list=blocks, src=root, group=group, async_op=True).get_future().wait()
            held[backend] = (g, sc)
        for mine, theirs in zip(held["neuron"], held["gloo"], strict=True):
            assert len(mine) == len(theirs), (root, held)
            for a, b in zip(mine, theirs):
                same(a, b, f"future of an async gather/scatter, root {root}")
        checks += 1
    return checks


def alltoall(rank, world):
    checks = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        # even: dim 0 = world * 3 rows of 2
        x = values(rank, world * 6, dtype, "sum", 10).reshape(world * 3, 2)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        want = torch.cat([values(r, world * 6, dtype, "sum", 10).reshape(world * 3, 2)[rank * 3:(rank + 1) * 3]
                          for r in range(world)])
        same(out, want, f"all_to_all_single even {dtype}")
        # uneven: rank r sends (r + j) % 3 rows to rank j (zero rows included)
        split = lambda r: [(r + j) % 3 for j in range(world)]
        xin = values(rank, sum(split(rank)) * 2, dtype, "sum", 11).reshape(-1, 2)
        recv = [split(j)[rank] for j in range(world)]
        out = torch.empty(sum(recv), 2, dtype=dtype)
        dist.all_to_all_single(out, xin, output_split_sizes=recv, input_split_sizes=split(rank))
        pieces = []
        for j in range(world):
            xj = values(j, sum(split(j)) * 2, dtype, "sum", 11).reshape(-1, 2)
            start = sum(split(j)[:rank])
            pieces.append(xj[start:start + split(j)[rank]])
        same(out, torch.cat(pieces), f"all_to_all_single uneven {dtype}")
        # list form
        ins = [values(rank * world + j, j + 1, dtype, "sum", 12) for j in range(world)]
        outs = [torch.empty(rank + 1, dtype=dtype) for _ in range(world)]
        dist.all_to_all(outs, ins)
        for j in range(world):
            same(outs[j], values(j * world + rank, rank + 1, dtype, "sum", 12), f"all_to_all list {dtype}")
        g = torch.empty_like(x)
        if gloo_ran(lambda: dist.all_to_all_single(g, x, group=R.GLOO)):
            same(g, want, f"gloo all_to_all agrees {dtype}")
        checks += 3
    return checks


def p2p(rank, world):
    """send/recv around a ring, with tags out of order, isend/irecv, batch_isend_irecv and
    recv from any source."""
    if world == 1:
        return 0
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    a = values(rank, 5, torch.float32, "sum", 13)
    b = values(rank, 300_000, torch.float32, "sum", 14)
    r_a, r_b = torch.empty(5), torch.empty(300_000)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt, tag=1), dist.P2POp(dist.isend, b, nxt, tag=2),
                                   dist.P2POp(dist.irecv, r_b, prv, tag=2), dist.P2POp(dist.irecv, r_a, prv, tag=1)])
    for q in reqs:
        q.wait()
    same(r_a, values(prv, 5, torch.float32, "sum", 13), "p2p tag 1")
    same(r_b, values(prv, 300_000, torch.float32, "sum", 14), "p2p tag 2 (large, reordered)")
    # blocking send/recv, even ranks first
    x = torch.full((3,), float(rank))
    y = torch.empty(3, dtype=torch.float32)
    if rank % 2 == 0:
        dist.send(x, nxt)
        dist.recv(y, prv)
    else:
        dist.recv(y, prv)
        dist.send(x, nxt)
    same(y, torch.full((3,), float(prv)), "send/recv")
    # recv from any source at rank 0
    if rank == 0:
        got = set()
        for _ in range(world - 1):
            z = torch.empty(2, dtype=torch.int64)
            src = dist.recv(z, tag=7)
            assert z.tolist() == [src, src * 10], (src, z)
            got.add(src)
        assert got == set(range(1, world)), got
    else:
        dist.send(torch.tensor([rank, rank * 10]), 0, tag=7)
    # a message shorter than the receive buffer fills its front and leaves the rest as it was,
    # as with Gloo and MPI (it used to fail the group): one frame, and five (600,000 floats)
    for n, cap in ((3, 8), (600_000, 700_000)):
        r = torch.full((cap,), -1.0)
        reqs = [dist.irecv(r, prv, tag=11), dist.isend(values(rank, n, torch.float32, "sum", 15), nxt, tag=11)]
        for q in reqs:
            q.wait()
        same(r[:n], values(prv, n, torch.float32, "sum", 15), f"a {n}-element message into {cap} elements")
        assert bool((r[n:] == -1).all()), f"rank {rank}: the buffer past a {n}-element message was written"
    # into a non-contiguous tensor (its elements in row order), the rest keeping its values
    r = torch.full((4, 4), -1.0)[:, :2]
    reqs = [dist.irecv(r, prv, tag=13), dist.isend(values(rank, 3, torch.float32, "sum", 16), nxt, tag=13)]
    for q in reqs:
        q.wait()
    flat = r.reshape(-1)
    same(flat[:3], values(prv, 3, torch.float32, "sum", 16), "a 3-element message into a non-contiguous 8")
    assert flat[3:].tolist() == [-1.0] * 5, f"rank {rank}: a non-contiguous buffer past the message: {flat}"
    if rank == 0:  # and from any source
        for _ in range(world - 1):
            z = torch.full((5,), -1, dtype=torch.int64)
            src = dist.recv(z, tag=12)
            assert z.tolist() == [src, src * 10, -1, -1, -1], (src, z)
    else:
        dist.send(torch.tensor([rank, rank * 10]), 0, tag=12)
    # the largest tag c10d takes (Gloo's too), and a receive from any source into a non-contiguous
    # buffer, which must still say whose message it took (review AL: each untested)
    top = torch.zeros(3)
    reqs = [dist.isend(values(rank, 3, torch.float32, "sum", 17), nxt, tag=2**31 - 1),
            dist.irecv(top, prv, tag=2**31 - 1)]
    for q in reqs:
        q.wait()
    same(top, values(prv, 3, torch.float32, "sum", 17), "a message with tag 2**31 - 1")
    pg = dist.distributed_c10d._get_default_group()
    if rank == 0:
        for _ in range(world - 1):
            z = torch.full((2, 2), -1.0)[:, 0]
            w = pg.recv_anysource([z], 14)
            w.wait()
            src = w._source_rank()
            assert z.tolist() == [src, src * 10], (src, z)
    else:
        dist.send(torch.tensor([rank, rank * 10.0]), 0, tag=14)
    # receives posted before collectives from the same peer: the collectives' frames reach the
    # receive first and wait aside as early frames; none may stay behind (not even empty queues)
    for i in range(50):
        r = torch.empty(4)
        req = dist.irecv(r, prv, tag=9)
        s_ = torch.full((3,), float(rank + i))
        dist.all_reduce(s_)
        dist.send(torch.full((4,), float(rank * 100 + i)), nxt, tag=9)
        req.wait()
        same(r, torch.full((4,), float(prv * 100 + i)), "p2p behind a collective")
        same(s_, torch.full((3,), float(sum(range(world)) + world * i)), "collective behind a receive")
    dist.barrier()
    box = pg.group.mailbox
    assert not box.early, f"rank {rank}: {len(box.early)} early-frame queues left: {list(box.early)[:4]}"
    assert not box.held, f"rank {rank}: frames left held in the transport: {list(box.held)}"
    return 5


def _p2p_groups(world):
    """Groups of every rank over shared memory and over zmq (a test reruns nothing else over
    zmq), each cutting a message into frames of 1 KiB (none lent), with a 10 s time-out: a
    point-to-point case that deadlocks fails in seconds, in its own groups. Then Gloo's."""
    from datetime import timedelta
    groups = []
    for transport in ("shm", "zmq"):
        with env(NEURON_DIST_TRANSPORT=transport, NEURON_DIST_FRAME_BYTES=1024, NEURON_DIST_SHM_LEND=0):
            groups.append(dist.new_group(list(range(world)), timeout=timedelta(seconds=10)))
    return groups + [R.GLOO]


def _drop_groups(groups):
    for g in groups:
        if g is not R.GLOO:
            dist.destroy_process_group(g)


def p2p_tags_apart(rank, world):
    """Point-to-point ops of different tags between two ranks do not wait for each other, as
    with Gloo: rank 0 posts a receive of tag 5, then one of tag 0, from rank 1, which sends tag
    0 and waits for rank 0's answer before it sends tag 5 (receives of one peer ran one at a
    time whatever their tag: the tag-0 receive never ran, and the tag-5 one failed the group at
    the time-out); rank 0 isends a long tag-5 message, then a short tag-0 one, which rank 1
    receives first. Messages of one tag still arrive in the order posted. One frame and 16
    frames, over shared memory, zmq and Gloo. Ranks past 1 look on."""
    if world == 1:
        return 0
    checks = 0
    groups = _p2p_groups(world)
    for g in groups:
        for n in (3, 4000):
            def want(seed):
                return values(1 - rank, n, torch.float32, "sum", seed)
            if rank == 0:
                a, b = torch.zeros(n), torch.zeros(n)
                w5 = dist.irecv(a, 1, group=g, tag=5)
                w0 = dist.irecv(b, 1, group=g, tag=0)
                w0.wait()
                dist.send(torch.ones(1), 1, group=g, tag=9)
                w5.wait()
                same(b, want(0), f"tag 0 received while a receive of tag 5 waits ({g}, n={n})")
                same(a, want(5), f"tag 5 received after tag 0 ({g}, n={n})")
                for w in [dist.isend(values(0, 4000, torch.float32, "sum", 6), 1, group=g, tag=6),
                          dist.isend(values(0, n, torch.float32, "sum", 7), 1, group=g, tag=7)]:
                    w.wait()
                got = [torch.zeros(n) for _ in range(3)]
                ws = [dist.irecv(x, 1, group=g, tag=8) for x in got]
                for w in ws:
                    w.wait()
                for i, x in enumerate(got):
                    same(x, want(10 + i), f"message {i} of one tag in the order sent ({g}, n={n})")
                checks += 5
            elif rank == 1:
                dist.send(values(1, n, torch.float32, "sum", 0), 0, group=g, tag=0)
                dist.recv(torch.zeros(1), 0, group=g, tag=9)
                dist.send(values(1, n, torch.float32, "sum", 5), 0, group=g, tag=5)
                a, b = torch.zeros(n), torch.zeros(4000)
                dist.recv(a, 0, group=g, tag=7)
                dist.recv(b, 0, group=g, tag=6)
                same(a, want(7), f"a short message received before a long one sent first ({g}, n={n})")
                same(b, values(0, 4000, torch.float32, "sum", 6), f"the long one after it ({g}, n={n})")
                for w in [dist.isend(values(1, n, torch.float32, "sum", 10 + i), 0, group=g, tag=8) for i in range(3)]:
                    w.wait()
                checks += 2
    _drop_groups(groups)
    return checks


def p2p_forms_apart(rank, world):
    """Point-to-point plans are kept per form (peer, element count, dtype, tag): rank 0 sends one
    form to each peer in turn and receives one form from each in turn, then sends rank 1 the same
    count in another dtype; and a receive from any source of a message of several frames (16 of
    1 KiB, a `Receive`, not the one-frame path) says which rank sent it. Over shared memory, zmq
    and Gloo (review AW: each untested). Returns the checks made."""
    if world == 1:
        return 0
    checks = 0
    groups = _p2p_groups(world)
    for g in groups:
        n = 4000
        if rank == 0:
            got = set()
            for _ in range(world - 1):
                z = torch.zeros(n)
                src = dist.recv(z, group=g, tag=21)
                same(z, values(src, n, torch.float32, "sum", 21), f"a {n}-element message from any source ({g})")
                got.add(src)
            assert got == set(range(1, world)), (str(g), got)
            for p in range(1, world):
                dist.send(torch.full((3,), float(p)), p, group=g, tag=22)
            for p in range(1, world):
                z = torch.zeros(3)
                dist.recv(z, p, group=g, tag=22)
                assert z.tolist() == [p * 10.0] * 3, (str(g), p, z)
            dist.send(torch.full((3,), 1.5), 1, group=g, tag=23)
            dist.send(torch.tensor([7, 8, 9], dtype=torch.int32), 1, group=g, tag=23)
            checks += 2
        else:
            dist.send(values(rank, n, torch.float32, "sum", 21), 0, group=g, tag=21)
            z = torch.zeros(3)
            dist.recv(z, 0, group=g, tag=22)
            assert z.tolist() == [float(rank)] * 3, (str(g), z)
            dist.send(torch.full((3,), rank * 10.0), 0, group=g, tag=22)
            if rank == 1:
                a, b = torch.zeros(3), torch.zeros(3, dtype=torch.int32)
                dist.recv(a, 0, group=g, tag=23)
                dist.recv(b, 0, group=g, tag=23)
                assert a.tolist() == [1.5] * 3 and b.tolist() == [7, 8, 9], (str(g), a, b)
                checks += 1
    _drop_groups(groups)
    return checks


def receives_out_of_order_look_at_each_peer_once(rank, world, n=1500):
    """Rank 1 posts n receives in reverse tag order of rank 0's n sends: while they waited, the
    engine looked whether their peer was alive once per receive on every look (a /proc read
    each, 4,000 per look at n=4,000: 15 s, and a 5 s group time-out failed where Gloo took
    0.2 s; a review's probe). Each peer is now looked at once per look. Returns the looks at a
    peer per look taken (at most the peer count, 1), and checks the messages against Gloo's."""
    if world == 1:
        return 1
    import time
    from neuron_dist.group import LOOK_INTERVAL_S
    sub = dist.new_group([0, 1])
    looks = 0
    if rank in (0, 1):
        g = sub.group if hasattr(sub, "group") else sub._get_backend(torch.device("cpu")).group
        gone = g._peer_gone

        def counted(*args, **kwargs):
            nonlocal looks
            looks += 1
            return gone(*args, **kwargs)
        g._peer_gone = counted
        for group in (sub, R.GLOO):
            ts = [torch.full((4,), float(i)) if rank == 0 else torch.zeros(4) for i in range(n)]
            t0 = time.monotonic()
            if rank == 0:
                ws = [dist.isend(t, 1, group=group, tag=i) for i, t in enumerate(ts)]
            else:
                ws = [dist.irecv(ts[i], 0, group=group, tag=i) for i in reversed(range(n))]
            for w in ws:
                w.wait()
            took = time.monotonic() - t0
            assert all(t[0].item() == i for i, t in enumerate(ts)), "a receive took another tag's message"
            if group is sub:
                bound = 2 * took / LOOK_INTERVAL_S + 20  # at most one peer per look (and the sweeps)
                assert looks <= bound, f"{looks} looks at the peer in {took:.2f}s (at most {bound:.0f})"
        del g._peer_gone
    dist.destroy_process_group(sub)
    return 1


def p2p_posted_order(rank, world):
    """Receives take messages in the order they were posted, from any source or not, and a
    message's frames all go to the receive that took its first, as with MPI and Gloo. Rank 0
    posts receives of one tag (any source then rank 1; rank 1 then any source; any, any, rank 1)
    and only then tells rank 1 to send its messages of that tag: an any-source receive and a
    specific one from rank 1 took frames of one message at once and failed the group ("expected
    ... chunk 0 ... but received ... chunk 12"). At three ranks, an any-source receive posted after
    one from rank 1 takes rank 2's message while rank 1's is yet to come. One frame and 16 frames,
    over shared memory, zmq and Gloo."""
    if world == 1:
        return 0
    checks = 0
    groups = _p2p_groups(world)

    def sent(src, n, seed):
        return values(src, n, torch.float32, "sum", seed)

    for g in groups:
        for n in (3, 4000):
            for tag, posts in ((3, (None, 1)), (4, (1, None)), (5, (None, None, 1))):
                if rank == 0:
                    bufs = [torch.zeros(n) for _ in posts]
                    works = [dist.irecv(b, src, group=g, tag=tag) for b, src in zip(bufs, posts)]
                    dist.send(torch.ones(1), 1, group=g, tag=9)
                    for w in works:
                        w.wait()
                    if g is R.GLOO:  # Gloo gives each receive a whole message, but in its own order
                        msgs = [sent(1, n, 10 * tag + i) for i in range(len(posts))]
                        took = sorted(next((j for j, m in enumerate(msgs) if torch.equal(b, m)), -1) for b in bufs)
                        assert took == list(range(len(posts))), f"gloo: receives {posts} took messages {took}"
                        checks += len(posts)
                        continue
                    for i, (b, src) in enumerate(zip(bufs, posts)):
                        same(b, sent(1, n, 10 * tag + i), f"receive {i} of {posts} (tag {tag}, {g}, n={n})")
                        checks += 1
                elif rank == 1:
                    dist.recv(torch.zeros(1), 0, group=g, tag=9)
                    for i in range(len(posts)):
                        dist.send(sent(1, n, 10 * tag + i), 0, group=g, tag=tag)
            if world < 3 or rank > 2:
                continue
            if rank == 0:  # from rank 1, then any source: rank 2's message is not rank 1's receive's
                a, b = torch.zeros(n), torch.zeros(n)
                w1 = dist.irecv(a, 1, group=g, tag=6)
                wany = dist.irecv(b, None, group=g, tag=6)
                dist.send(torch.ones(1), 2, group=g, tag=9)
                wany.wait()
                same(b, sent(2, n, 60), f"any source beside a waiting receive from rank 1 ({g}, n={n})")
                dist.send(torch.ones(1), 1, group=g, tag=9)
                w1.wait()
                same(a, sent(1, n, 60), f"the receive from rank 1 after it ({g}, n={n})")
                checks += 2
            else:
                dist.recv(torch.zeros(1), 0, group=g, tag=9)
                dist.send(sent(rank, n, 60), 0, group=g, tag=6)
    _drop_groups(groups)
    return checks


def early_frames_outlive_their_slots(rank, world, late=0.3):
    """Frames that reach a rank before the call that takes them (a receive posted later, a
    collective its peer already runs) are kept as copies: the transport reuses their ring slot
    once they are released, so a kept view of it would read a later frame's bytes, silently.
    Rank 0 isends three rings' worth of small tagged messages to rank 1, which receives them in
    reverse tag order (all but the last kept aside first). Then, in a group of rings of two
    256-byte slots that lends nothing (a lent frame is not in a slot, and two ranks would move
    the whole tensor as one), rank 0 broadcasts a tensor of eight frames, and `late` seconds
    later sends a message that rank 1 receives before it enters the broadcast: the broadcast's
    frames reach rank 1 first and wait aside. Every tensor is compared bit for bit, mismatches
    reported once all ranks are through (a failure does not leave the others to time out).
    Other ranks look on."""
    import time
    if world == 1:
        return 0
    bad = []

    def exact(got, want, what):
        if not torch.equal(got, want):
            bad.append(f"{what}: got {got[:4].tolist()}..., want {want[:4].tolist()}...")

    with env(NEURON_DIST_FRAME_BYTES=256, NEURON_DIST_SHM_SLOTS=2, NEURON_DIST_SHM_LEND=0):
        small = dist.new_group([0, 1])  # every rank calls new_group
    assert rank > 1 or small.group.frame_bytes == 256, small.group.frame_bytes
    g = dist.distributed_c10d._get_default_group().group
    k = 3 * (getattr(g.transport, "nslots", None) or 4)  # more frames than one ring holds
    sent = [values(0, 5, torch.float32, "sum", 400 + t) for t in range(k)]
    data = values(0, 8 * 64, torch.float32, "sum", 401)  # eight 256-byte frames
    if rank == 0:
        for w in [dist.isend(sent[t], dst=1, tag=t) for t in range(k)]:
            w.wait()
        x = data.clone()
        work = dist.broadcast(x, src=0, group=small, async_op=True)  # sends, then waits for rank 1
        time.sleep(late)  # its frames go out (rank 1's receive drains the ring) before the message
        dist.send(torch.arange(3.0), dst=1, tag=k, group=small)
        work.wait()
    elif rank == 1:
        for t in reversed(range(k)):
            got = torch.empty(5)
            dist.recv(got, src=0, tag=t)
            exact(got, sent[t], f"the message of tag {t} of {k}, received in reverse tag order")
        last = torch.empty(3)
        dist.recv(last, src=0, tag=k, group=small)
        exact(last, torch.arange(3.0), "the message sent after the broadcast began")
        x = torch.empty_like(data)
        dist.broadcast(x, src=0, group=small)
        exact(x, data, "a broadcast whose frames were kept before it ran")
    # a message of two copied frames kept aside (a receive of another tag read past it), then
    # taken by a receive from any source, and by one with room to spare (a shorter message): each
    # looks at the kept first frame and puts it back in front of the second (review AG: put back
    # behind it, the receive failed on "chunk 0 ... but received ... chunk 1")
    n = (1 << 20) // 4
    two = torch.arange(n, dtype=torch.float32)
    for tag, room in ((k + 1, n), (k + 3, 2 * n)):
        if rank == 0:
            w = dist.isend(two, dst=1, tag=tag)
            dist.send(torch.tensor([7.0]), dst=1, tag=tag + 1)
            w.wait()
        elif rank == 1:
            one = torch.zeros(1)
            dist.recv(one, src=0, tag=tag + 1)
            got = torch.zeros(room)
            src = dist.recv(got, src=None if room == n else 0, tag=tag)
            what = "from any source" if room == n else "with room to spare"
            exact(got[:n], two, f"a message of two frames kept aside, received {what}")
            if src != 0:
                bad.append(f"a message of two frames kept aside, received {what}: from rank {src}, not 0")
    if rank < 2:
        for group in (g, small.group):
            box = group.mailbox
            if box.early or box.held:
                bad.append(f"frames left behind: {list(box.early)}, {list(box.held)}")
    dist.destroy_process_group(small)
    dist.barrier()
    assert not bad, f"rank {rank}: " + "; ".join(bad)
    return k + 4 if rank == 1 else 0


def _gather_checked(ins, rank, world, root, check, what):
    """dist.gather of `ins[rank]` to `root`, whose blocks `check` compares with every rank's input."""
    outs = [torch.empty_like(ins[rank]) for _ in range(world)] if rank == root else None
    dist.gather(ins[rank], gather_list=outs, dst=root)
    if rank == root:
        for r in range(world):
            check(outs[r], ins[r], f"{what} block {r}")


def move_only_dtypes(rank, world):
    """float8 and uint16/32/64 are moved bit for bit (broadcast, all-gather in both forms,
    all-to-all, gather, scatter, send/recv, Gloo's send/recv beside ours) and never reduced: every
    reduction raises ValueError on the calling rank before a byte moves, and the group goes on."""
    from neuron_dist.transport.frame import MOVE_ONLY
    assert torch.float8_e4m3fn in MOVE_ONLY and torch.uint64 in MOVE_ONLY

    def bits(r, count, dtype, seed):  # arbitrary bit patterns (NaN encodings included)
        g = torch.Generator().manual_seed(seed * 7919 + r * 104729 + count)
        return torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)

    def same_bits(got, want, what):
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"rank {rank}: {what}: bytes differ"

    checks = 0
    for dtype in MOVE_ONLY:
        for count in (0, 5, 70_001):
            ins = [bits(r, count, dtype, 1) for r in range(world)]
            for root in range(world):
                t = ins[rank].clone()
                dist.broadcast(t, src=root)
                same_bits(t, ins[root], f"broadcast {dtype} root {root}")
            out = torch.empty(count * world, dtype=dtype)
            dist.all_gather_into_tensor(out, ins[rank])
            same_bits(out, torch.cat(ins), f"all_gather_into_tensor {dtype}")
            outs = [torch.empty(count, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, ins[rank])
            for r in range(world):
                same_bits(outs[r], ins[r], f"all_gather {dtype} block {r}")
            blocks = [bits(r, count * world, dtype, 2) for r in range(world)]
            got = torch.empty(count * world, dtype=dtype)
            dist.all_to_all_single(got, blocks[rank])
            same_bits(got, torch.cat([b[rank * count:(rank + 1) * count] for b in blocks]), f"all_to_all {dtype}")
            root = count % world
            _gather_checked(ins, rank, world, root, same_bits, f"gather {dtype}")
            sc = torch.empty(count, dtype=dtype)
            dist.scatter(sc, scatter_list=[blocks[root][r * count:(r + 1) * count].clone() for r in range(world)]
                         if rank == root else None, src=root)
            same_bits(sc, blocks[root][rank * count:(rank + 1) * count], f"scatter {dtype}")
            if world > 1:
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                for group in (None, R.GLOO):
                    r_ = torch.empty(count, dtype=dtype)
                    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, ins[rank], nxt, group=group),
                                                   dist.P2POp(dist.irecv, r_, prv, group=group)])
                    for q in reqs:
                        q.wait()
                    same_bits(r_, ins[prv], f"send/recv {dtype} on {'gloo' if group else 'neuron'}")
            checks += 1
        for call in (lambda t: dist.all_reduce(t), lambda t: dist.reduce(t, dst=0),
                     lambda t: dist.reduce_scatter_tensor(t[:1], t.repeat(world)[:world])):
            try:
                call(bits(rank, 4, dtype, 3))
            except ValueError as e:
                assert "never reduced" in str(e) and str(dtype) in str(e), e
                checks += 1
            else:
                raise AssertionError(f"rank {rank}: a reduction of {dtype} did not raise")
    t = torch.ones(3)
    dist.all_reduce(t)
    same(t, torch.full((3,), float(world)), "all_reduce after the refused reductions")
    return checks


def object_collectives(rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(world)], objs
    lst = [f"from-{rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from-0", 0], lst
    out = [None]
    dist.scatter_object_list(out, [r * 2 for r in range(world)] if rank == 0 else None, src=0)
    assert out == [rank * 2], out
    g = [None] * world if rank == 0 else None
    dist.gather_object(rank + 100, g, dst=0)
    if rank == 0:
        assert g == [r + 100 for r in range(world)], g
    return 4


def subgroups(rank, world):
    """new_group with a subset in a scrambled order, two groups in flight at once; AVG on a
    group of two of three or four ranks."""
    checks = 0
    ranks = list(range(world))[::-1]
    sub = dist.new_group(ranks)  # every rank calls new_group
    odd = dist.new_group([r for r in range(world) if r % 2 == 1]) if world > 1 else None
    x = torch.tensor([float(rank + 1)])
    w1 = dist.all_reduce(x, group=sub, async_op=True)
    y = torch.tensor([float(rank + 1)])
    w2 = None
    if odd is not None and rank % 2 == 1:
        w2 = dist.all_reduce(y, group=odd, async_op=True)
    w1.wait()
    same(x, torch.tensor([float(world * (world + 1) / 2)]), "subgroup all_reduce")
    checks += 1
    if w2 is not None:
        w2.wait()
        same(y, torch.tensor([float(sum(r + 1 for r in range(world) if r % 2 == 1))]), "odd subgroup all_reduce")
        checks += 1
    dist.barrier(group=sub)
    # broadcast from a group rank that maps to another global rank
    z = torch.tensor([float(rank)])
    dist.broadcast(z, src=ranks[0], group=sub)
    same(z, torch.tensor([float(ranks[0])]), "subgroup broadcast global src")
    dist.destroy_process_group(sub)
    if odd is not None:
        dist.destroy_process_group(odd)
    if world >= 3:  # AVG divides by the group's size (2 here), not the world's
        pair = dist.new_group([0, 2])
        if rank in (0, 2):
            me = rank // 2
            for dtype in (torch.float32, torch.int64):
                ins = [values(r, 5, dtype, "avg", 21) for r in (0, 2)]
                x = ins[me].clone()
                dist.all_reduce(x, op=dist.ReduceOp.AVG, group=pair)
                same(x, reference(ins, "avg", dtype), f"all_reduce AVG of {dtype} on the group [0, 2]")
                full = [values(r, 6, dtype, "avg", 22) for r in (0, 2)]
                out = torch.empty(3, dtype=dtype)
                dist.reduce_scatter_tensor(out, full[me], op=dist.ReduceOp.AVG, group=pair)
                same(out, reference(full, "avg", dtype)[3 * me:3 * me + 3],
                     f"reduce_scatter_tensor AVG of {dtype} on the group [0, 2]")
                checks += 2
        dist.destroy_process_group(pair)
    return checks + 1


def device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    checks = 0
    mesh = init_device_mesh("cpu", (world,))
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=mesh.get_group())
    same(x, torch.tensor([float(world)]), "1-D mesh")
    checks += 1
    if world % 2 == 0:
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        y = torch.tensor([float(rank)])
        dist.all_reduce(y, group=mesh2.get_group("shard"))
        row = rank // (world // 2)
        same(y, torch.tensor([float(sum(range(row * world // 2, (row + 1) * world // 2)))]), "2-D mesh shard dim")
        z = torch.tensor([float(rank)])
        dist.all_reduce(z, group=mesh2.get_group("rep"))
        col = rank % (world // 2)
        same(z, torch.tensor([float(col + col + world // 2)]), "2-D mesh rep dim")
        checks += 2
    return checks


def no_reference_cycles(rank, world):
    """A finished call leaves nothing for the cyclic garbage collector: every receive once made
    a cycle (op -> its receive -> op) that held the tensor until a collection, and fed the full
    collections that stall a rank for ~100 ms in a long job."""
    import gc
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    x, y = torch.ones(64), torch.empty(64)

    def calls():
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(1 << 18), async_op=True).wait()  # (the engine's path)
        dist.broadcast(x, 0)
        dist.all_to_all_single(torch.empty(8 * world), torch.ones(8 * world))
        dist.barrier()
        if world > 1:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]):
                w.wait()
            reqs = [dist.irecv(torch.empty(8), prv, tag=3), dist.isend(torch.ones(3), nxt, tag=3)]  # short message
            for w in reqs:
                w.wait()
            if rank == 0:
                for _ in range(world - 1):
                    dist.recv(torch.empty(2), tag=4)  # from any source
            else:
                dist.send(torch.ones(2), 0, tag=4)

    calls()
    dist.barrier()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            calls()
        dist.barrier()
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("neuron_dist")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, f"rank {rank}: objects left in reference cycles: {sorted(set(ours))} ({len(ours)})"
    return 1


def kept_scratch(rank, world):
    """The group's shared scratch buffer (collectives/scratch.py), which every collective whose
    schedule receives into scratch now reuses instead of allocating per call: results stay
    exact through growing and shrinking sizes and changing dtypes, across algorithms, with many
    async calls queued on it at once, and past the size limit (a buffer of the call's own); and
    the buffer is kept (the same memory from call to call) within its limit."""
    pg = dist.distributed_c10d._get_default_group()
    scratch = pg.group.scratch
    checks = 0
    forms = (("allreduce", "direct"), ("allreduce", "rdh"), ("reduce_scatter", "ring"), ("reduce_scatter", "direct"))
    for collective, algo in forms:
        with env(NEURON_DIST_ALGO=f"{collective}:{algo}"):
            for count, dtype in ((70_001, torch.float32), (300_001, torch.bfloat16), (40_001, torch.float64),
                                 (300_001, torch.float32)):
                ins = [values(r, count * world, dtype, "sum", 31) for r in range(world)]
                want = reference(ins, "sum", dtype)
                if collective == "allreduce":
                    x = ins[rank].clone()
                    dist.all_reduce(x)
                    got, g = x, ins[rank].clone()
                    ran = gloo_ran(lambda: dist.all_reduce(g, group=R.GLOO))
                else:
                    want = want[rank * count:(rank + 1) * count]
                    got, g = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
                    dist.reduce_scatter_tensor(got, ins[rank])
                    ran = gloo_ran(lambda: dist.reduce_scatter_tensor(g, ins[rank], group=R.GLOO))
                same(got, want, f"{algo} {collective} {dtype} n={count}")
                if ran:
                    same(got, g, f"{algo} {collective} vs gloo {dtype} n={count}")
                checks += 1
            # many calls queued on the one buffer at once, each with its own inputs
            xs = [values(rank, 90_001 * world, torch.float32, "sum", 40 + i) for i in range(6)]
            wants = [reference([values(r, 90_001 * world, torch.float32, "sum", 40 + i) for r in range(world)],
                               "sum", torch.float32) for i in range(6)]
            if collective == "allreduce":
                works = [dist.all_reduce(x, async_op=True) for x in xs]
                outs = xs
            else:
                outs = [torch.empty(90_001) for _ in xs]
                works = [dist.reduce_scatter_tensor(o, x, async_op=True) for o, x in zip(outs, xs)]
                wants = [w[rank * 90_001:(rank + 1) * 90_001] for w in wants]
            for w in works:
                w.wait()
            for i, (o, w) in enumerate(zip(outs, wants)):
                same(o, w, f"{algo} {collective} async #{i}")
                checks += 1
    if world > 1:  # (one rank's direct all-reduce needs no scratch)
        with env(NEURON_DIST_ALGO="allreduce:direct"):
            x = values(rank, 300_001, torch.float32, "sum", 32)
            dist.all_reduce(x)
            kept, ptr = scratch.kept_bytes, scratch._buf.data_ptr()
            assert kept >= 300_001 * 4, f"rank {rank}: scratch keeps {kept} bytes after a 1.2 MB direct all-reduce"
            dist.all_reduce(x)
            assert scratch._buf.data_ptr() == ptr, f"rank {rank}: the scratch buffer was not reused"
            limit, scratch.limit = scratch.limit, 1 << 20  # past the limit: a buffer of the call's own
            try:
                ins = [values(r, 400_001, torch.float32, "sum", 33) for r in range(world)]
                x = ins[rank].clone()
                dist.all_reduce(x)
                same(x, reference(ins, "sum", torch.float32), "direct all_reduce past the scratch limit")
                assert scratch._buf.data_ptr() == ptr and scratch.kept_bytes == kept, \
                    f"rank {rank}: a call past the limit replaced the kept buffer"
            finally:
                scratch.limit = limit
            checks += 1
    # a scatter's root joins its blocks (tensors of their own: blocks of one tensor are read in
    # place, see back_to_back_lists) into the kept buffer as each op starts (joined per call in
    # fresh memory, a 64 MiB scatter faulted its buffer in every call): async scatters queued
    # at once, each with its own blocks and root, stay exact, and the root reuses the buffer
    count = 100_003
    blocks = [[values(r, count * world, torch.float32, "sum", 50 + i) for r in range(world)] for i in range(4)]
    apart = lambda t: [b.clone() for b in t.chunk(world)]
    scratch.clear()  # (no call in flight: every one above was waited for)
    outs = [torch.empty(count) for _ in blocks]
    works = [dist.scatter(o, scatter_list=apart(b[i % world]) if rank == i % world else None,
                          src=i % world, async_op=True) for i, (o, b) in enumerate(zip(outs, blocks))]
    for w in works:
        w.wait()
    for i, (o, b) in enumerate(zip(outs, blocks)):
        same(o, b[i % world][rank * count:(rank + 1) * count], f"async scatter #{i} from root {i % world}")
        checks += 1
    kept, ptr = scratch.kept_bytes, scratch._buf.data_ptr() if scratch._buf is not None else None
    dist.scatter(outs[0], scatter_list=apart(blocks[0][0]) if rank == 0 else None, src=0)
    same(outs[0], blocks[0][0][rank * count:(rank + 1) * count], "scatter from root 0 again")
    # and a gather's root receives into it (its blocks then copied out), queued async likewise
    ptr_after_scatter = scratch._buf.data_ptr() if scratch._buf is not None else None
    scratch.clear()
    ins = [values(rank, count, torch.float32, "sum", 60 + i) for i in range(4)]
    lists = [[torch.empty(count) for _ in range(world)] if rank == i % world else None for i in range(4)]
    works = [dist.gather(x, gather_list=lst, dst=i % world, async_op=True)
             for i, (x, lst) in enumerate(zip(ins, lists))]
    for w in works:
        w.wait()
    kept_by_gather = scratch.kept_bytes
    for i, lst in enumerate(lists):
        if lst is not None:
            for r in range(world):
                same(lst[r], values(r, count, torch.float32, "sum", 60 + i), f"async gather #{i} block {r}")
            checks += 1
    # and a list all-gather into tensors of their own receives into it (then copied out), queued
    # async likewise: made per call, a 64 MiB one faulted its buffer in every call (49.8 ms)
    scratch.clear()
    xs = [values(rank, count, torch.float32, "sum", 80 + i) for i in range(4)]
    lists = [[torch.empty(count) for _ in range(world)] for _ in xs]
    works = [dist.all_gather(lst, x, async_op=True) for lst, x in zip(lists, xs)]
    for w in works:
        w.wait()
    kept_by_all_gather = scratch.kept_bytes  # (at one rank the list of one is written in place)
    for i, lst in enumerate(lists):
        for r in range(world):
            same(lst[r], values(r, count, torch.float32, "sum", 80 + i), f"async list all_gather #{i} block {r}")
        checks += 1
    # an all-to-all list of separate tensors and an in-place all_to_all_single stage their output
    # there too (then copied out), against the reference and Gloo
    scratch.clear()
    ins = [[values(r * world + j, count, torch.float32, "sum", 90) for j in range(world)] for r in range(world)]
    forms = []  # (inputs, outputs): separate and separate, separate and one tensor's, one's and separate
    for joined_in, joined_out in ((False, False), (False, True), (True, False)):
        src = [t.clone() for t in ins[rank]] if not joined_in else list(torch.cat(ins[rank]).chunk(world))
        dst = [torch.empty(count) for _ in range(world)] if not joined_out else list(torch.empty(count * world).chunk(world))
        forms.append((src, dst, dist.all_to_all(dst, src, async_op=True)))
    x = torch.cat(ins[rank])
    dist.all_to_all_single(x, x)
    for *_, w in forms:
        w.wait()
    kept_by_all_to_all = scratch.kept_bytes
    outs = forms[0][1]
    for j in range(world):
        for k, (_, dst, _) in enumerate(forms):
            same(dst[j], ins[j][rank], f"all_to_all list form {k} block {j}")
        same(x[j * count:(j + 1) * count], ins[j][rank], f"in-place all_to_all_single block {j}")
    g = [torch.empty(count) for _ in range(world)]
    if gloo_ran(lambda: dist.all_to_all(g, [t.clone() for t in ins[rank]], group=R.GLOO)):
        for j in range(world):
            same(outs[j], g[j], f"all_to_all list vs gloo block {j}")
    checks += 1
    # a reduce-scatter list of separate tensors joins them there as the op starts (sum, avg and
    # premul; one whose output is one of its inputs reads it first), queued async
    scratch.clear()
    works = []
    for op in ("sum", "avg", "premul_sum"):
        ins = [values(rank, count * world, torch.float32, op, 95).chunk(world)[j].clone() for j in range(world)]
        out = torch.empty(count) if op != "avg" else ins[rank]  # (avg: the output is its own input block)
        works.append((op, out, dist.reduce_scatter(out, ins, op=c10d_op(op), async_op=True)))
    for op, out, w in works:
        w.wait()
        want = reference([values(r, count * world, torch.float32, op, 95) for r in range(world)], op, torch.float32)
        same(out, want[rank * count:(rank + 1) * count], f"reduce_scatter list of separate tensors {op}")
        checks += 1
    kept_by_reduce_scatter = scratch.kept_bytes
    assert world == 1 or kept_by_reduce_scatter >= count * world * 4, \
        f"rank {rank}: scratch keeps {kept_by_reduce_scatter} bytes after reduce-scatters of {count * world * 4}"
    assert world == 1 or kept_by_all_to_all >= count * world * 4, \
        f"rank {rank}: scratch keeps {kept_by_all_to_all} bytes after all-to-alls of {count * world * 4}"
    assert world == 1 or kept_by_all_gather >= count * world * 4, \
        f"rank {rank}: scratch keeps {kept_by_all_gather} bytes after a list all-gather of {count * world * 4}"
    if world > 1 and rank == 0:  # (checked after the last call, so that a failure leaves no peer waiting)
        assert kept >= count * world * 4, f"rank 0: scratch keeps {kept} bytes after a scatter of {count * world * 4}"
        assert ptr_after_scatter == ptr, "rank 0: the scatter did not reuse the kept buffer"
        assert kept_by_gather >= count * world * 4, \
            f"rank 0: scratch keeps {kept_by_gather} bytes after a gather of {count * world * 4}"
    return checks


def back_to_back_lists(rank, world):
    """List calls whose tensors are the blocks of one tensor (`t.chunk(world)`, the usual
    scatter or gather list) move data where it lies, not through a joined copy or the group's
    scratch: scatter, gather, all_gather, reduce_scatter and all_to_all, out of place and in
    place (a rank's own block as its other argument), small and past one frame, sync and async,
    equal to the reference and to Gloo on the same lists; and lists that only look alike
    (blocks in another order, with gaps) or a scatter whose output is another rank's block of
    the root's list still right."""
    scratch = dist.distributed_c10d._get_default_group().group.scratch
    checks = 0

    def ran(backend, call):  # the neuron call (async, waited) always runs; Gloo's where it can
        if backend == "neuron":
            call(None).wait()
            return True
        return gloo_ran(lambda: call(R.GLOO).wait())

    for count in (5, BIG):
        for dtype in (torch.float32, torch.bfloat16):
            ins = [values(r, count * world, dtype, "sum", 70) for r in range(world)]
            blocks = lambda r: ins[r][rank * count:(rank + 1) * count]  # rank r's block for this rank
            for backend in ("neuron", "gloo"):
                for in_place in (False, True):
                    for root in sorted({0, world - 1}):
                        scratch.clear()
                        # scatter: in place, the root's own block of its list is its output
                        src = ins[root].clone()
                        out = src.chunk(world)[rank] if in_place and rank == root else torch.empty(count, dtype=dtype)
                        lst = list(src.chunk(world)) if rank == root else None
                        if ran(backend, lambda g: dist.scatter(out, lst, src=root, group=g, async_op=True)):
                            same(out, blocks(root), f"{backend} scatter of one tensor's blocks {dtype} n={count} "
                                                    f"root {root} in place {in_place}")
                            same(src, ins[root], f"{backend} scatter left the root's list as it was")
                            checks += 1
                        # gather: in place, the root's own block of its list is its input
                        whole = torch.full((count * world,), -1, dtype=dtype)
                        x = ins[rank][:count].clone()
                        if in_place and rank == root:
                            x = whole[rank * count:(rank + 1) * count].copy_(x)
                        lst = list(whole.chunk(world)) if rank == root else None
                        if ran(backend, lambda g: dist.gather(x, lst, dst=root, group=g, async_op=True)) and rank == root:
                            same(whole, torch.cat([ins[r][:count] for r in range(world)]),
                                 f"{backend} gather into one tensor's blocks {dtype} n={count} root {root} in place {in_place}")
                            checks += 1
                        if backend == "neuron" and world > 1:
                            assert scratch.kept_bytes == 0, f"rank {rank}: a scatter or gather of one tensor's blocks " \
                                                            f"went through the scratch ({scratch.kept_bytes} B)"
                    # all_gather into one tensor's blocks; in place, this rank's block is its input
                    whole = torch.full((count * world,), -1, dtype=dtype)
                    x = ins[rank][:count].clone()
                    if in_place:
                        x = whole[rank * count:(rank + 1) * count].copy_(x)
                    if ran(backend, lambda g: dist.all_gather(list(whole.chunk(world)), x, group=g, async_op=True)):
                        same(whole, torch.cat([ins[r][:count] for r in range(world)]),
                             f"{backend} all_gather into one tensor's blocks {dtype} n={count} in place {in_place}")
                        checks += 1
                    # reduce_scatter from one tensor's blocks; in place, this rank's block is its output
                    src = ins[rank].clone()
                    out = src.chunk(world)[rank] if in_place else torch.empty(count, dtype=dtype)
                    if ran(backend, lambda g: dist.reduce_scatter(out, list(src.chunk(world)), group=g, async_op=True)):
                        same(out, reference(ins, "sum", dtype)[rank * count:(rank + 1) * count],
                             f"{backend} reduce_scatter of one tensor's blocks {dtype} n={count} in place {in_place}")
                        checks += 1
                    # all_to_all between one tensor's blocks; in place, the output list is the input's
                    # (each block goes elsewhere: staged, never read after it is written)
                    src = ins[rank].clone()
                    whole = src if in_place else torch.full((count * world,), -1, dtype=dtype)
                    want = torch.cat([blocks(j) for j in range(world)])
                    if ran(backend, lambda g: dist.all_to_all(list(whole.chunk(world)), list(src.chunk(world)),
                                                              group=g, async_op=True)):
                        same(whole, want, f"{backend} all_to_all between one tensor's blocks {dtype} n={count} "
                                          f"in place {in_place}")
                        checks += 1
    # lists that only look like one tensor's blocks (another order; gaps between them), and a
    # scatter whose output is another rank's block of the root's list (the block as it was when
    # the call began, as the staged path always gave)
    x = values(0, 4 * world, torch.float32, "sum", 71)
    for lst in (list(x.chunk(world))[::-1], [x[2 * i:2 * i + 1] for i in range(world)]):
        mine = torch.empty(lst[0].numel())
        dist.scatter(mine, scatter_list=lst if rank == 0 else None, src=0)
        same(mine, lst[rank], "scatter of a list that only looks back to back")
        whole = torch.zeros(x.numel())
        got = list(whole.chunk(world))[::-1] if lst[0].numel() == 4 else [whole[2 * i:2 * i + 1] for i in range(world)]
        dist.gather(lst[rank].clone(), gather_list=got if rank == 0 else None, dst=0)
        if rank == 0:
            for r in range(world):
                same(got[r], lst[r], "gather into a list that only looks back to back")
        checks += 1
    # storages that only start at one address (numpy's array and a slice of it, imported apart):
    # not one tensor's blocks (taken for one, the flat view ran past the first's storage)
    import numpy as np
    arr = values(0, 4 * world, torch.float32, "sum", 73).numpy()
    lst = [torch.from_numpy(arr[:4])] + [torch.from_numpy(arr)[4 * k:4 * (k + 1)] for k in range(1, world)]
    mine = torch.empty(4)
    dist.scatter(mine, scatter_list=lst if rank == 0 else None, src=0)
    same(mine, values(0, 4 * world, torch.float32, "sum", 73)[4 * rank:4 * (rank + 1)],
         "scatter of blocks whose storages only start at one address")
    checks += 1
    if world > 1:
        src = values(0, 3 * world, torch.float32, "sum", 72)
        out = src.chunk(world)[1] if rank == 0 else torch.empty(3)
        dist.scatter(out, scatter_list=list(src.chunk(world)) if rank == 0 else None, src=0)
        want = values(0, 3 * world, torch.float32, "sum", 72).chunk(world)
        same(out, want[0] if rank == 0 else want[rank], "scatter whose output is another rank's block of the root's list")
        checks += 1
    return checks


def lent_reductions(rank, world):
    """Ring and torus reduce-scatter and all-reduce blocks of at least the shm transport's
    `lend_reduce_from` (4 MiB), which the receiver reads from the sender's memory part by part
    and reduces (executor.Execution._reduce_lent), against a reference and Gloo: float32 with
    every kind of op (sums, averages, comparisons, pre-multiplied sums) and bfloat16 sums on the
    ring, float32 sums on the torus, in place and not, a block size that ends mid-part, an async
    call, and nothing left lent afterwards. Over other transports (zmq, MPI) the same calls copy."""
    t = dist.distributed_c10d._get_default_group().group.transport
    lending = bool(getattr(t, "lend_bytes", 0))
    if lending:
        assert t.lend_reduce_from == max(t.lend_from, 4 << 20), (t.lend_reduce_from, t.lend_from)
    checks = 0
    for algo, dtype, ops in (("ring", torch.float32, ("sum", "avg", "max", "premul_sum")),
                             ("ring", torch.bfloat16, ("sum",)), ("torus", torch.float32, ("sum",))):
        n = (4 << 20) // dtype.itemsize + 1001  # elements per block: just over the threshold
        ins = [values(r, world * n, dtype, "sum", 31) for r in range(world)]  # (the same for these ops)
        what = f"lent {algo} {dtype}"
        with env(NEURON_DIST_ALGO=f"allreduce:{algo},reduce_scatter:{algo}"):
            for op in ops:
                want = reference(ins, op, dtype)
                out = torch.empty(n, dtype=dtype)
                before, lent_before = ins[rank].clone(), getattr(t, "lent_frames", 0)
                dist.reduce_scatter_tensor(out, ins[rank], op=c10d_op(op))
                if lending and world > 1:  # every step of it reduces: lent only under the new rule
                    assert t.lent_frames > lent_before, f"rank {rank}: no block of a {algo} reduce-scatter was lent"
                same(out, want[rank * n:(rank + 1) * n], f"{what} reduce_scatter {op}")
                same(ins[rank], before, f"{what} reduce_scatter must not modify its input ({op})")
                x = ins[rank].clone()
                dist.all_reduce(x, op=c10d_op(op))
                same(x, want, f"{what} all_reduce {op}")
                checks += 2
                if op in ("sum", "max"):
                    g = torch.empty(n, dtype=dtype)
                    if gloo_ran(lambda: dist.reduce_scatter_tensor(g, ins[rank], op=c10d_op(op), group=R.GLOO)):
                        same(out, g, f"{what} reduce_scatter vs gloo {op}")
                        checks += 1
                    g = ins[rank].clone()
                    if gloo_ran(lambda: dist.all_reduce(g, op=c10d_op(op), group=R.GLOO)):
                        same(x, g, f"{what} all_reduce vs gloo {op}")
                        checks += 1
            x = ins[rank].clone()
            w = dist.all_reduce(x, async_op=True)  # the buffer is lent, and read by the peer, until the wait
            w.wait()
            same(x, reference(ins, "sum", dtype), f"{what} all_reduce async")
            checks += 1
    dist.barrier()
    if lending:
        assert t.still_lent() is None, f"rank {rank}: a frame is still lent to rank {t.still_lent()}"
    return checks


def lent_frames(rank, world):
    """Large frames of the collectives that only move data, which the shm transport lends (the
    receiver reads the sender's memory once, transport/cma.py), against a reference and Gloo:
    every form, in place included, the all-gather half of a ring all-reduce, the direct
    reduce-scatter's blocks (received into scratch, reduced after), point-to-point
    messages larger than the ring (a shorter message into a larger buffer, from any source), and
    nothing left lent afterwards."""
    t = dist.distributed_c10d._get_default_group().group.transport
    lending = bool(t.lend_bytes)
    if t.name == "shm" and world > 1 and not lending:  # only a failed probe or the setting turns it off
        import os
        assert "cannot read" in t._probe_result or os.environ.get("NEURON_DIST_SHM_LEND") == "0", \
            f"rank {rank}: lending off: {t._probe_result}"
    lent0 = getattr(t, "lent_frames", 0)
    checks = 0
    from neuron_dist.transport.shm import LEND_STEP_OVERSUBSCRIBED
    for dtype in (torch.float32, torch.bfloat16):
        n = LEND_STEP_OVERSUBSCRIBED // dtype.itemsize + 1001  # blocks lent with or without a core per rank
        ins = [values(r, n, dtype, "sum", 21) for r in range(world)]
        flat = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, ins[rank])
        same(flat, torch.cat(ins), f"lent all_gather {dtype}")
        g = torch.empty_like(flat)
        if gloo_ran(lambda: dist.all_gather_into_tensor(g, ins[rank], group=R.GLOO)):
            same(flat, g, f"lent all_gather vs gloo {dtype}")
            checks += 1
        whole = torch.zeros(world * n, dtype=dtype)
        whole.narrow(0, rank * n, n).copy_(ins[rank])
        dist.all_gather_into_tensor(whole, whole.narrow(0, rank * n, n))
        same(whole, torch.cat(ins), f"lent all_gather in place {dtype}")
        for root in range(world):
            x = ins[root].clone() if rank == root else torch.zeros(n, dtype=dtype)
            dist.broadcast(x, src=root)
            same(x, ins[root], f"lent broadcast root {root} {dtype}")
        blocks = [values(rank * world + j, n, dtype, "sum", 22) for j in range(world)]
        want = torch.cat([values(j * world + rank, n, dtype, "sum", 22) for j in range(world)])
        out = torch.empty(world * n, dtype=dtype)
        dist.all_to_all_single(out, torch.cat(blocks))
        same(out, want, f"lent all_to_all {dtype}")
        g = torch.empty_like(out)
        if gloo_ran(lambda: dist.all_to_all_single(g, torch.cat(blocks), group=R.GLOO)):
            same(out, g, f"lent all_to_all vs gloo {dtype}")
            checks += 1
        both = torch.cat(blocks)
        dist.all_to_all_single(both, both)
        same(both, want, f"lent all_to_all in place {dtype}")
        root = world - 1
        _gather_checked(ins, rank, world, root, same, f"lent gather {dtype}")
        got = torch.empty(n, dtype=dtype)
        dist.scatter(got, scatter_list=ins if rank == root else None, src=root)
        same(got, ins[rank], f"lent scatter {dtype}")
        checks += 6
    assert not lending or t.lent_frames > lent0, f"rank {rank}: lending is on but no collective frame was lent"
    if world > 1:  # all-reduces lend the steps that only copy (marked by their builders): the ring's and
        # the torus' all-gather half, the direct schedule's whole vectors (received into scratch,
        # reduced after), the recursive-doubling answer to a folded-in rank (world 3)
        for algo in ("ring", "direct", "rdh", "torus"):
            lent_before_ar = getattr(t, "lent_frames", 0)
            with env(NEURON_DIST_ALGO=f"allreduce:{algo}"):
                for dtype in (torch.float32, torch.bfloat16):
                    n = world * (LEND_STEP_OVERSUBSCRIBED // dtype.itemsize + 1001)
                    for op in (("sum", "avg", "max") if algo == "ring" else ("sum",)):
                        ins = [values(r, n, dtype, op, 26) for r in range(world)]
                        x = ins[rank].clone()
                        dist.all_reduce(x, op=getattr(dist.ReduceOp, op.upper()))
                        same(x, reference(ins, op, dtype), f"lent {algo} all_reduce {op} {dtype}")
                        g = ins[rank].clone()
                        if gloo_ran(lambda: dist.all_reduce(g, op=getattr(dist.ReduceOp, op.upper()), group=R.GLOO)):
                            same(x, g, f"lent {algo} all_reduce {op} vs gloo {dtype}")
                        checks += 1
                    ins = [values(r, n, dtype, "sum", 27) for r in range(world)]  # async: the buffer
                    x = ins[rank].clone()                                          # is lent until the wait
                    w = dist.all_reduce(x, async_op=True)
                    w.wait()
                    same(x, reference(ins, "sum", dtype), f"lent {algo} all_reduce async {dtype}")
                    checks += 1
            if lending and algo in ("ring", "direct"):  # every rank lends
                assert t.lent_frames > lent_before_ar, f"rank {rank}: no frame of a {algo} all-reduce was lent"
            if lending and algo == "rdh" and world == 3:  # the rank that folded one in lends it the answer
                lent = torch.tensor([t.lent_frames - lent_before_ar])
                dist.all_reduce(lent, group=R.GLOO)
                assert lent.item() > 0, f"rank {rank}: no frame of the rdh all-reduce was lent"
    if world > 1:  # the direct reduce-scatter receives whole blocks into scratch as copies: lent too
        with env(NEURON_DIST_ALGO="reduce_scatter:direct"):
            n = LEND_STEP_OVERSUBSCRIBED // 4 + 1001
            for op in ("sum", "max"):
                ins = [values(r, world * n, torch.float32, op, 28) for r in range(world)]
                out = torch.empty(n)
                lent_before_rs = getattr(t, "lent_frames", 0)
                dist.reduce_scatter_tensor(out, ins[rank], op=c10d_op(op))
                same(out, reference(ins, op, torch.float32)[rank * n:(rank + 1) * n], f"lent direct reduce_scatter {op}")
                g = torch.empty(n)
                if gloo_ran(lambda: dist.reduce_scatter_tensor(g, ins[rank], op=c10d_op(op), group=R.GLOO)):
                    same(out, g, f"lent direct reduce_scatter {op} vs gloo")
                checks += 1
                if lending:
                    assert t.lent_frames > lent_before_rs, f"rank {rank}: no block of a direct reduce-scatter was lent"
    if world > 1:  # point-to-point messages larger than the ring (2 MiB) are lent too
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        m = 3 << 18  # 3 MiB of float32
        lent_before_p2p = getattr(t, "lent_frames", 0)
        for dtype in (torch.float32, torch.bfloat16):
            mine, theirs = values(rank, m, dtype, "sum", 23), values(prv, m, dtype, "sum", 23)
            got = torch.empty(m, dtype=dtype)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, got, prv)]):
                w.wait()
            same(got, theirs, f"lent send/recv ring {dtype}")
            roomy = torch.full((m + 1000,), 7, dtype=dtype)  # a shorter message fills the front
            reqs = [dist.irecv(roomy, prv, tag=5), dist.isend(mine, nxt, tag=5)]
            for w in reqs:
                w.wait()
            same(roomy[:m], theirs, f"lent send/recv into a larger buffer {dtype}")
            same(roomy[m:], torch.full((1000,), 7, dtype=dtype), f"lent send/recv leaves the rest {dtype}")
            if rank == 0:  # from any source
                for _ in range(world - 1):
                    src = dist.recv(got, tag=6)
                    same(got, values(src, m, dtype, "sum", 24), f"lent recv from any source {dtype}")
            else:
                dist.send(values(rank, m, dtype, "sum", 24), 0, tag=6)
            checks += 3
        assert not lending or t.lent_frames > lent_before_p2p, f"rank {rank}: no point-to-point frame was lent"
    if world >= 4:  # a large isend lent to a rank that posts its receive only after a ring
        # collective in which it never reads from the sender: the sender's collective must not wait
        # for that frame (each op watches its own lent frames, not the transport's)
        order = dist.distributed_c10d._get_default_group().group.order
        sender, target = order[0], order[2]  # two apart on the ring: neither reads from the other
        big = values(sender, 3 << 18, torch.float32, "sum", 25)
        small = torch.full((4099,), float(rank))
        flat = torch.empty(world * 4099)
        with env(NEURON_DIST_ALGO="allgather:ring"):
            w = dist.isend(big, target, tag=8) if rank == sender else None
            dist.all_gather_into_tensor(flat, small)
            if rank == target:
                got = torch.empty_like(big)
                dist.recv(got, sender, tag=8)
                same(got, big, "lent isend behind a ring collective")
            if w is not None:
                w.wait()
        same(flat, torch.cat([torch.full((4099,), float(r)) for r in range(world)]), "ring all-gather beside it")
        checks += 1
    dist.barrier()
    if lending:
        assert t.still_lent() is None, f"rank {rank}: a frame is still lent to rank {t.still_lent()}"
    return checks


def groups_on_threads(rank, world, calls=40):
    """Three threads of each rank, each on its own group (the default one and two subgroups of
    every rank), issue collectives at once: a data loader's or a checkpoint thread's group
    beside training's. Groups share nothing a call waits on (each has its engine, transport and
    scratch), so every result must be exact whatever the interleaving; a thread's draws are the
    same on every rank."""
    import random
    import threading
    groups = [None, dist.new_group(list(range(world))), dist.new_group(list(range(world))[::-1])]
    counts = COUNTS + (BIG,)
    checks, errors = [0, 0, 0], []

    def run(k):
        group, rng = groups[k], random.Random(1000 + k)
        me = dist.get_rank(group) if group is not None else rank
        try:
            for i in range(calls):
                kind, count = rng.choice(("all_reduce", "async", "all_gather", "reduce_scatter", "broadcast")), \
                    rng.choice(counts)
                dtype = rng.choice((torch.float32, torch.bfloat16, torch.int64))
                seed = k * 10_000 + i
                ins = [values(m, count, dtype, "sum", seed) for m in range(world)]
                what = f"thread {k} call {i}: {kind} of {count} {dtype}"
                if kind in ("all_reduce", "async"):
                    x = ins[me].clone()
                    work = dist.all_reduce(x, group=group, async_op=kind == "async")
                    if work is not None:
                        work.wait()
                    same(x, reference(ins, "sum", dtype), what)
                elif kind == "all_gather":
                    out = torch.empty(count * world, dtype=dtype)
                    dist.all_gather_into_tensor(out, ins[me], group=group)
                    same(out, torch.cat(ins), what)
                elif kind == "reduce_scatter":
                    full = [values(m, count * world, dtype, "sum", seed) for m in range(world)]
                    out = torch.empty(count, dtype=dtype)
                    dist.reduce_scatter_tensor(out, full[me], group=group)
                    same(out, reference(full, "sum", dtype)[me * count:(me + 1) * count], what)
                else:
                    root = rng.randrange(world)  # a group rank
                    x = ins[me].clone()
                    src = dist.get_global_rank(group, root) if group is not None else root
                    dist.broadcast(x, src=src, group=group)
                    same(x, ins[root], what)
                checks[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"rank {rank}, {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), f"rank {rank}: a thread never finished: {checks}"
    assert not errors, errors[0]
    for g in groups[1:]:
        dist.destroy_process_group(g)
    return sum(checks)


def waits_sleep_beside_an_early_message(rank, world, late=0.6, bound=0.3):
    """Rank 0 waits `late` seconds in a receive from rank 1 while rank 2's message, sent ahead
    of the receive that takes it (an isend posted early, as pipeline schedules do), and rank 2's
    frames of the next collective already wait for it (at world 2, only the wait itself). Those
    frames are not news to a wait after its first look: the wait must sleep, not return at once
    on every turn, which spun rank 0's engine a whole core until rank 1 came (shared memory,
    zmq and MPI alike). Rank 0's process may use at most `bound` of a core meanwhile."""
    import time
    early = torch.arange(16, dtype=torch.float32) + 7
    got, checks = torch.empty(16), 0
    dist.barrier()
    if rank == 2:
        work = dist.isend(early, dst=0, tag=7)
        dist.all_reduce(torch.ones(4))  # straight on into the next collective: its frames reach rank 0 early
        work.wait()
    elif rank == 1:
        time.sleep(late)
        dist.send(early * 2, dst=0, tag=3)
        dist.all_reduce(torch.ones(4))
    elif rank == 0:
        time.sleep(0.1)  # rank 2's frames land before the receive starts waiting
        c0, w0 = time.process_time(), time.monotonic()
        dist.recv(got, src=1, tag=3)
        share = (time.process_time() - c0) / (time.monotonic() - w0)
        assert share < bound, f"rank 0 used {share:.0%} of a core while it waited"
        assert torch.equal(got, early * 2), got
        if world > 2:
            dist.recv(got, src=2, tag=7)
            assert torch.equal(got, early), got
        x = torch.ones(4)
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((4,), float(world))), x
        checks = 3
    else:
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    return checks


def a_long_wait_sleeps(rank, world, late=2.0):
    """Ranks that wait long for a late peer (rank 0 comes `late` seconds after the others, as
    when it checkpoints) sleep, as Gloo's do, instead of waking every few milliseconds: the
    shared-memory wait napped 1 ms at a time (a lost wake-up's bound) and the engine looked
    every 5 ms, ~4% of a core per waiting rank (~2% over zmq) taken from the rank they waited
    for. Returns each waiter's process CPU seconds per second of its all-reduce's and its
    receive's waits (rank 0: its own short waits), the results checked."""
    import time
    x, got = torch.full((64,), float(rank + 1)), torch.empty(64)
    dist.barrier()
    shares = []
    for kind in ("all_reduce", "recv"):
        if rank == 0:
            time.sleep(late)
        c0, w0 = time.process_time(), time.monotonic()
        if kind == "all_reduce":
            dist.all_reduce(x)
        elif rank == 0:
            for p in range(1, world):
                dist.send(x, dst=p)
        else:
            dist.recv(got, src=0)
        shares.append((time.process_time() - c0) / (time.monotonic() - w0))
    assert torch.equal(x, torch.full((64,), float(world * (world + 1) // 2))), x
    assert rank == 0 or torch.equal(got, x), got
    dist.barrier()
    return shares


def finished_calls_hold_no_tensors(rank, world):
    """A tensor the caller drops after its async call ended is freed, as with Gloo: the engine
    thread held its last op (and the op its tensors and the call's scratch) while it slept,
    until the group's next op (a 256 MiB all-reduce's input and output stayed resident). And
    so did the group's callback thread that ran a `then` callback of the op's future, idle
    until the next callback (op.CallbackRunner)."""
    import gc
    import time
    import weakref
    checks = 0
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_then"):
        x = torch.ones((1 << 19) * world)  # 2 MiB a rank and more: past the caller's inline size
        out = torch.empty(x.numel() // world if kind == "reduce_scatter" else x.numel() * world)
        fut = None
        if kind.startswith("all_reduce"):
            w = dist.all_reduce(x, async_op=True)
            if kind == "all_reduce_then":
                fut = w.get_future().then(lambda f: None)
                fut.wait()
        elif kind == "reduce_scatter":
            w = dist.reduce_scatter_tensor(out, x, async_op=True)
        else:
            w = dist.all_gather_into_tensor(out, x, async_op=True)
        w.wait()
        refs = [weakref.ref(x), weakref.ref(out)]
        del x, out, w, fut
        deadline = time.monotonic() + 5
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        held = [r() for r in refs if r() is not None]
        assert not held, f"{kind}: a tensor still held after the call ended, by " + \
            ", ".join(sorted({type(o).__name__ for t in held for o in gc.get_referrers(t)}))
        checks += 1
    # a finished call's Work the caller keeps holds none of the group's kept scratch (a list
    # all-to-all of separate inputs into one tensor's blocks kept a view of it through its
    # closures: after destroy_process_group its 32 MiB stayed while the Work was kept)
    scratch = dist.distributed_c10d._get_default_group().group.scratch
    n = 1 << 18
    for form in ("all_to_all joined", "all_to_all staged", "reduce_scatter joined"):
        ins = [torch.ones(n) for _ in range(world)]
        if form == "all_to_all joined":
            out = torch.empty(n * world)
            w = dist.all_to_all(list(out.chunk(world)), ins, async_op=True)
        elif form == "all_to_all staged":
            w = dist.all_to_all([torch.empty(n) for _ in range(world)], list(torch.ones(n * world).chunk(world)),
                                async_op=True)
        else:
            w = dist.reduce_scatter(torch.empty(n), ins, async_op=True)
        w.wait()
        if scratch._buf is None:  # (world 1: nothing staged)
            assert world == 1, f"{form}: the call used no scratch: the check tests nothing"
            continue
        from torch.multiprocessing.reductions import StorageWeakRef  # (views keep the storage, not the tensor)
        buf = StorageWeakRef(scratch._buf.untyped_storage())
        scratch.clear()
        gc.collect()
        assert buf.expired(), f"rank {rank}: {form}: a finished call's kept Work holds the group's scratch"
        del w
        checks += 1
    dist.barrier()
    return checks


def _sparse_input(rank, rows, dense, dtype, seed):
    """Rank `rank`'s sparse COO tensor of `rows` rows (each a vector of `dense` values, or a
    scalar where dense is 0): a random number of non-zeros, zero included, repeats included
    (uncoalesced), every rank able to regenerate every other rank's."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    nnz = int(torch.randint(0, 2 * rows, (1,), generator=g)) if rank % 3 else int(rank == 0) * rows
    idx = torch.randint(0, rows, (1, nnz), generator=g)
    shape = (nnz, dense) if dense else (nnz,)
    vals = torch.randint(-9, 10, shape, generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, (rows, dense) if dense else (rows,))


def sparse_allreduce(rank, world):
    """all_reduce of a sparse COO tensor (DDP's gradient of a sparse embedding): summed in place
    and coalesced, as Gloo does, against Gloo and a dense reference; other ops, and tensors whose
    layout differs across ranks, are the same clear error on every rank, the group usable after."""
    checks = 0
    for seed, (rows, dense, dtype) in enumerate([(7, 0, torch.float32), (50, 4, torch.float32), (9, 3, torch.float64),
                                                 (30, 2, torch.bfloat16), (12, 0, torch.int64)]):
        ins = [_sparse_input(r, rows, dense, dtype, seed) for r in range(world)]
        want = sum(x.to_dense().double() for x in ins).to(dtype)
        t = ins[rank].clone()
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        assert w.result()[0] is t and t.is_sparse and t.is_coalesced(), (t, w.result())
        same(t.to_dense(), want, f"sparse all_reduce {dtype} rows={rows} dense={dense}")
        checks += 1
        y = ins[rank].clone()
        if gloo_ran(lambda: dist.all_reduce(y, group=R.GLOO)):
            same(t.to_dense(), y.to_dense(), f"sparse all_reduce vs gloo {dtype}")
            assert torch.equal(t.coalesce().indices(), y.coalesce().indices())
            checks += 1
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.ones(2).to(torch.float8_e4m3fn), (3,))
    bad = [(lambda: dist.all_reduce(_sparse_input(rank, 5, 0, torch.float32, 0), op=dist.ReduceOp.MAX), "SUM only"),
           (lambda: dist.all_reduce(uncoalesced), "float8_e4m3fn"),
           (lambda: dist.all_reduce(torch.sparse_coo_tensor(torch.zeros((17, 1), dtype=torch.long), torch.ones(1),
                                                            (1,) * 17)), "at most 16"),
           (lambda: dist.all_reduce(_sparse_input(rank, 5 + (rank == world - 1), 0, torch.float32, 0)),
            "sparse tensors differ"),
           # the same shape in another dtype (its values could not be gathered with the others')
           (lambda: dist.all_reduce(_sparse_input(rank, 5, 0, torch.float64 if rank == world - 1 else torch.float32,
                                                  0)), "sparse tensors differ")]
    for call, why in bad[:5 if world > 1 else 3]:
        try:
            call()
        except ValueError as e:
            assert f"[rank {rank}]" in str(e) and why in str(e), e
            if why == "sparse tensors differ":  # this rank's layout and each differing one's
                assert f"rank {rank}: shape" in str(e) and f"rank {world - 1}: shape" in str(e), e
            checks += 1
        else:
            raise AssertionError(f"a bad sparse all_reduce did not raise ({why})")
    t16 = torch.sparse_coo_tensor(torch.zeros((16, 1), dtype=torch.long), torch.ones(1), (1,) * 16)
    dist.all_reduce(t16)  # MAX_DIMS dimensions: the most a layout record holds, taken
    assert t16.to_dense().flatten().tolist() == [float(world)], t16
    x = torch.ones(3)
    dist.all_reduce(x)  # the group is still in step
    same(x, torch.full((3,), float(world)), "all_reduce after the sparse errors")
    return checks


def ddp_sparse_embedding(rank, world, steps=3):
    """DDP over a model with a sparse embedding (its gradient a sparse tensor DDP all-reduces)
    and a dense layer, against the same training on Gloo: the same parameters after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    params = {}
    for name, group in (("neuron", None), ("gloo", R.GLOO)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(40, 6, sparse=True), torch.nn.Linear(6, 2))
        ddp = DDP(model, process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            ids = torch.randint(0, 40, (8,), generator=g)
            opt.zero_grad()
            ddp(ids).square().sum().backward()
            assert model[0].weight.grad.is_sparse
            opt.step()
        params[name] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params["neuron"], params["gloo"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return len(params["neuron"])


def read_only_expanded_inputs(rank, world):
    """A tensor a call only reads may be an expand()ed view (elements sharing memory): a
    broadcast's root tensor, a reduce's input on ranks other than the root. They were refused
    as if written ("the output tensor ... has elements that share memory"), on that rank only,
    so the peers failed at their next call; Gloo takes them (and there returns garbage on the
    receiving ranks). Results against the reference (a written expanded tensor stays an error:
    cases_faults.misuse_invalid)."""
    checks = 0
    for root in range(world):
        t = torch.tensor([float(root + 5)]).expand(6) if rank == root else torch.zeros(6)
        dist.broadcast(t, src=root)
        same(t.contiguous(), torch.full((6,), float(root + 5)), f"broadcast from an expanded root {root}")
        t = torch.zeros(6) if rank == root else torch.tensor([float(rank + 1)]).expand(6)
        dist.reduce(t, dst=root)
        if rank == root:
            same(t, torch.full((6,), float(sum(r + 1 for r in range(world) if r != root))),
                 f"reduce with expanded inputs to root {root}")
        checks += 2
    return checks


def rounding_as_nccl(rank, world):
    """Two roundings where the call form changed the result. A complex AVG reduce-scatter was
    divided in complex arithmetic (an ulp off the parts' own quotients at world 3, 5), while
    `dist.all_reduce` hands the backend the real view; and PREMUL_SUM's Python-number factor
    stayed in double precision while the same factor as a tensor was rounded to the data's
    dtype first, as NCCL's PreMulSum takes it (bfloat16 and float16 products differed). Against
    the parts' quotients and a reference built from the rounded factor."""
    checks = 0
    count = 12
    parts = [values(r, 2 * count * world, torch.float32, "sum", 12) for r in range(world)]
    ins = [torch.view_as_complex(p.view(-1, 2)) for p in parts]
    want = torch.view_as_complex(torch.view_as_real(sum(ins)).div_(world))[rank * count:(rank + 1) * count]
    out = torch.empty(count, dtype=torch.complex64)
    dist.reduce_scatter_tensor(out, ins[rank].clone(), op=dist.ReduceOp.AVG)
    assert torch.equal(out, want), f"rank {rank}: complex AVG reduce_scatter_tensor {out} != {want}"
    dist.reduce_scatter(out, list(ins[rank].clone().chunk(world)), op=dist.ReduceOp.AVG)
    assert torch.equal(out, want), f"rank {rank}: complex AVG reduce_scatter (list) {out} != {want}"
    whole = ins[rank].clone()
    dist.all_reduce(whole, op=dist.ReduceOp.AVG)
    assert torch.equal(whole[rank * count:(rank + 1) * count], want), f"rank {rank}: complex AVG all_reduce"
    checks += 3
    for dtype in (torch.bfloat16, torch.float16):
        ins = [values(r, 64, dtype, "sum", 13) for r in range(world)]
        scaled = [x * torch.tensor(0.3, dtype=torch.float64).to(dtype) for x in ins]  # NCCL: x * T(factor)
        results = []
        for f in (0.3, torch.tensor(0.3, dtype=torch.float64)):
            t = ins[rank].clone()
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(f))
            results.append(t)
        assert torch.equal(results[0], results[1]), \
            f"rank {rank}: {dtype} PREMUL_SUM with the factor 0.3 as a number and as a tensor differ"
        if world <= 2:  # (one addition: no order to differ in)
            same(results[0], scaled[0] if world == 1 else scaled[0] + scaled[1], f"{dtype} PREMUL_SUM 0.3")
        checks += 1
    return checks
