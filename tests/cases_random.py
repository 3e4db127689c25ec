"""Rank-side: a seeded random sequence of calls, the same on every rank, checked against a
reference computed from every rank's regenerated input.

The other cases take one collective at a time. Users do not: DDP keeps several all-reduces in
flight while FSDP gathers on another group, and a forced algorithm, an odd size at a frame's
edge or a subgroup call can sit between any two of them. Each step here draws a call (kind,
group, dtype, op, size, root, split sizes, blocking or async, now and then a forced algorithm);
async calls stay in flight until a later step waits for a random few of them in a random order.
Every rank draws the same steps (the draws never depend on the rank), and ranks outside a
step's group skip it, as torch requires."""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

from neuron_dist.collectives.algorithms import algorithms_for
from rankctx import FLOATS, INTS, c10d_op, env, ops_for, reference, same, values

# element counts: empty, tiny, around one 512 KiB frame of float32 (131,072), past several
COUNTS = (0, 1, 3, 7, 64, 1000, 4097, 131_071, 131_073, 300_001)
COUNT_WEIGHTS = (2, 4, 3, 4, 3, 4, 2, 1, 1, 1)
KINDS = {"all_reduce": 6, "all_gather_into_tensor": 3, "all_gather": 2, "reduce_scatter_tensor": 3,
         "broadcast": 3, "reduce": 2, "all_to_all_single": 2, "gather": 1, "scatter": 1, "p2p_shift": 2,
         "all_reduce_coalesced": 1, "barrier": 1}
FORCEABLE = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather", "all_gather": "allgather",
             "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast"}


def _groups(rank, world):
    """The default group, then subgroups every rank creates in the same order: a twin of the
    world, the same ranks placed on two modelled nodes (so the model may pick the hierarchical
    schedules), and three smaller ones."""
    everyone = list(range(world))
    groups = [(None, everyone)]
    if world >= 2:
        groups.append((dist.new_group(everyone), everyone))
    if world % 2 == 0:
        half = world // 2
        with env(LOCAL_WORLD_SIZE=half, LOCAL_RANK=rank % half, GROUP_RANK=rank // half):
            groups.append((dist.new_group(everyone), everyone))
    if world >= 3:
        for ranks in ([0, 1], list(range(1, world)), [0, world - 1]):
            groups.append((dist.new_group(ranks), ranks))
    return groups


def _inputs(members, count, dtype, op, seed):
    return [values(m, count, dtype, op, seed) for m in members]


def random_sequence(rank, world, seed=0, steps=150):
    rng = random.Random(seed)  # drawn identically on every rank
    local = random.Random(seed * 131 + rank)  # which async calls a rank waits for, and in what order
    groups = _groups(rank, world)
    pending = []  # (work, check) of async calls not yet waited for
    checks = 0

    def settle(n):
        nonlocal checks
        picked = local.sample(range(len(pending)), min(n, len(pending)))
        for i in picked:
            work, check = pending[i]
            work.wait()
            check()
            checks += 1
        for i in sorted(picked, reverse=True):
            del pending[i]

    for step in range(steps):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        group, members = rng.choice(groups)
        dtype = rng.choice(FLOATS + INTS if kind not in ("all_reduce", "reduce") or rng.random() < 0.9
                           else (torch.bool,))
        op = rng.choice(ops_for(dtype))
        count = rng.choices(COUNTS, weights=COUNT_WEIGHTS)[0]
        if dtype.itemsize > 4 or world > 2:
            count = min(count, 131_073)  # keep four ranks on two cores quick
        is_async = rng.random() < 0.4 and kind not in ("barrier", "p2p_shift")
        root_i = rng.randrange(len(members))
        shift = rng.randrange(1, len(members)) if len(members) > 1 else 0
        splits = [[rng.randrange(0, 4) for _ in members] for _ in members]  # rows i -> j
        strided = kind == "all_reduce" and rng.random() < 0.15
        coll = FORCEABLE.get(kind)
        forced = rng.choice(algorithms_for(coll)) if coll and rng.random() < 0.25 else None
        settle_now = rng.randrange(0, 4) if rng.random() < 0.3 else 0
        reverse = rng.random() < 0.5
        if rank not in members:
            if settle_now:
                settle(settle_now)
            continue
        me = members.index(rank)
        n = len(members)
        what = f"step {step} {kind} {dtype} {op} n={count} group={members} async={is_async} algo={forced}"
        seed_ = seed * 1000 + step
        check = None
        with env(NEURON_DIST_ALGO=f"{coll}:{forced}" if forced else ""):
            if kind == "all_reduce":
                ins = _inputs(members, count, dtype, op, seed_)
                want = reference(ins, op, dtype)
                if strided:  # every other element of a larger tensor, reduced in place
                    base = torch.full((2 * count,), 7, dtype=dtype)
                    base[::2] = ins[me]
                    x = base[::2]
                else:
                    x = ins[me].clone()
                work = dist.all_reduce(x, op=c10d_op(op), group=group, async_op=is_async)

                def check(x=x, want=want, what=what, base=base if strided else None):
                    same(x, want, what)
                    if base is not None:
                        same(base[1::2], torch.full_like(base[1::2], 7), what + " (the gaps)")
            elif kind == "all_reduce_coalesced":
                sizes = (count % 50, 5, 0)
                ins = [_inputs(members, c, dtype, "sum", seed_ + i) for i, c in enumerate(sizes)]
                xs = [i[me].clone() for i in ins]
                work = dist.all_reduce_coalesced(xs, group=group, async_op=is_async)

                def check(xs=xs, ins=ins, what=what, dtype=dtype):
                    for x, i in zip(xs, ins):
                        same(x, reference(i, "sum", dtype), what)
            elif kind in ("all_gather_into_tensor", "all_gather"):
                ins = _inputs(members, count, dtype, "sum", seed_)
                if kind == "all_gather":
                    outs = [torch.full((count,), 9, dtype=dtype) for _ in members]
                    work = dist.all_gather(outs, ins[me], group=group, async_op=is_async)

                    def check(outs=outs, ins=ins, what=what):
                        for o, i in zip(outs, ins):
                            same(o, i, what)
                else:
                    out = torch.full((count * n,), 9, dtype=dtype)
                    work = dist.all_gather_into_tensor(out, ins[me], group=group, async_op=is_async)

                    def check(out=out, ins=ins, what=what):
                        same(out, torch.cat(ins), what)
            elif kind == "reduce_scatter_tensor":
                ins = _inputs(members, count * n, dtype, op, seed_)
                out = torch.full((count,), 9, dtype=dtype)
                work = dist.reduce_scatter_tensor(out, ins[me], op=c10d_op(op), group=group, async_op=is_async)
                want = reference(ins, op, dtype)[me * count:(me + 1) * count]

                def check(out=out, want=want, what=what):
                    same(out, want, what)
            elif kind == "broadcast":
                ins = _inputs(members, count, dtype, "sum", seed_)
                x = ins[me].clone()
                work = dist.broadcast(x, members[root_i], group=group, async_op=is_async)

                def check(x=x, want=ins[root_i], what=what):
                    same(x, want, what)
            elif kind == "reduce":
                ins = _inputs(members, count, dtype, op, seed_)
                x = ins[me].clone()
                work = dist.reduce(x, members[root_i], op=c10d_op(op), group=group, async_op=is_async)
                want = reference(ins, op, dtype) if me == root_i else None

                def check(x=x, want=want, what=what):
                    if want is not None:
                        same(x, want, what)
            elif kind == "all_to_all_single":
                rows = [[s * (1 + count % 5) for s in row] for row in splits]
                ins = [values(m, sum(rows[i]) * 2, dtype, "sum", seed_).reshape(-1, 2) for i, m in enumerate(members)]
                recv = [rows[j][me] for j in range(n)]
                out = torch.full((sum(recv), 2), 9, dtype=dtype)
                work = dist.all_to_all_single(out, ins[me], output_split_sizes=recv, input_split_sizes=rows[me],
                                              group=group, async_op=is_async)
                want = torch.cat([ins[j][sum(rows[j][:me]):sum(rows[j][:me]) + rows[j][me]] for j in range(n)])

                def check(out=out, want=want, what=what):
                    same(out, want, what)
            elif kind == "gather":
                ins = _inputs(members, count, dtype, "sum", seed_)
                outs = [torch.full((count,), 9, dtype=dtype) for _ in members] if me == root_i else None
                work = dist.gather(ins[me], gather_list=outs, dst=members[root_i], group=group, async_op=is_async)

                def check(outs=outs, ins=ins, what=what):
                    for o, i in zip(outs or (), ins):
                        same(o, i, what)
            elif kind == "scatter":
                ins = _inputs(members, count, dtype, "sum", seed_)
                out = torch.full((count,), 9, dtype=dtype)
                work = dist.scatter(out, scatter_list=[i.clone() for i in ins] if me == root_i else None,
                                    src=members[root_i], group=group, async_op=is_async)

                def check(out=out, want=ins[me], what=what):
                    same(out, want, what)
            elif kind == "p2p_shift":  # everyone sends to the member `shift` ahead
                if n == 1:
                    continue
                ins = _inputs(members, count, dtype, "sum", seed_)
                r = torch.full((count,), 9, dtype=dtype)
                to, frm = members[(me + shift) % n], members[(me - shift) % n]
                ops = [dist.P2POp(dist.isend, ins[me], to, group=group, tag=step),
                       dist.P2POp(dist.irecv, r, frm, group=group, tag=step)]
                if reverse:
                    ops.reverse()
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                work = None

                def check(r=r, want=ins[(me - shift) % n], what=what):
                    same(r, want, what)
            else:  # barrier
                dist.barrier(group=group)
                work = None
        if work is not None and is_async:
            pending.append((work, check))
        elif check is not None:
            check()
            checks += 1
        if settle_now:
            settle(settle_now)
    settle(len(pending))
    dist.barrier()
    for group, members in groups[1:]:  # the workers live on for other cases
        dist.destroy_process_group(group)
    return checks


def ring_settings(rank, world):
    """(frame bytes, slots per ring) of the default group, as its transport set them up."""
    g = dist.distributed_c10d._get_default_group().group
    return g.frame_bytes, getattr(g.transport, "nslots", None)
