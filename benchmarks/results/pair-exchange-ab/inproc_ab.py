"""In-process A/B of a short form against the path it stands in for: the same pair of processes
alternates batches with it on and off, so both see the same host minute. --switch pair: the pair
form (PairExchange: a plan of one frame each way with one peer run without an Execution)
against the Execution (off: `Group.execution` replaced by a copy of itself without the pair
branch, so both arms build and keep the same plan); --switch common: the adapter's common path
of the call (`_allgather_common`, `_reduce_scatter_common`, `_broadcast_common`,
`_alltoall_common`, `_allreduce_common`) against its general path (patched to answer None).

    NEURON_DIST_TUNING=host torchrun --nproc-per-node 2 inproc_ab.py [--switch pair|common]
        [--op allreduce|allgather|reduce_scatter|broadcast|alltoall] [--bytes 4K] [--pairs 10]
        [--batch 300] [--mode loop|barrier]

Per batch the slowest rank's mean call time (loop: back to back; barrier: a Gloo barrier before
each call, timed from after it, as collbench does). Prints each pair and the median ratio."""
import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from neuron_dist import group as G
from neuron_dist.collectives.executor import Execution, Stamp, execution_plan
from neuron_dist.bench import parse_size
from neuron_dist.c10d import NeuronProcessGroup as PG

p = argparse.ArgumentParser()
p.add_argument("--op", default="allreduce",
               choices=("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"))
p.add_argument("--bytes", default="4K")
p.add_argument("--pairs", type=int, default=10)
p.add_argument("--batch", type=int, default=300)
p.add_argument("--mode", choices=("loop", "barrier"), default="loop")
p.add_argument("--switch", choices=("pair", "common"), default="pair")
a = p.parse_args()

dist.init_process_group("neuron")
meta = dist.new_group(backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
n = parse_size(a.bytes) // 4
x, out = torch.ones(n), torch.empty(n)
part = torch.ones(n // world)
calls = {"allreduce": lambda: dist.all_reduce(x),
         "allgather": lambda: dist.all_gather_into_tensor(out, part),
         "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, x),
         "broadcast": lambda: dist.broadcast(x, 0),
         "alltoall": lambda: dist.all_to_all_single(out, x)}
call = calls[a.op]
real = G.Group.execution
COMMON = {"allreduce": "_allreduce_common", "allgather": "_allgather_common",
          "reduce_scatter": "_reduce_scatter_common", "broadcast": "_broadcast_common",
          "alltoall": "_alltoall_common"}
common = getattr(PG, COMMON.get(a.op, "_allreduce_common"))


def without_pair(self, op, schedule, bufs, reduce, dtype, tag, tmp_views=None, arrived=False):
    """Group.execution as it stands, less its pair branch."""
    if not arrived:
        self._deaths.check(self, op)
    stamp = Stamp(op.kind, dtype, self.token, self.group_id, op.nbytes if op.kind == G._P2P else op.seq, tag)
    if op.kind == G._P2P:
        return Execution(schedule, bufs, reduce, stamp, self.rank, self.mailbox, self.frame_bytes, tmp_views)
    plans = schedule.plans
    plan = plans.get((op.kind, dtype))
    if plan is None:
        plan = plans[(op.kind, dtype)] = execution_plan(schedule, stamp, self.mailbox.transport, self.frame_bytes)
    return Execution(schedule, bufs, reduce, stamp, self.rank, self.mailbox, self.frame_bytes, tmp_views, plan)


def batch(on: bool) -> float:
    if a.switch == "pair":
        G.Group.execution = real if on else without_pair
    else:
        setattr(PG, COMMON[a.op], common if on else (lambda *args: None))
    for _ in range(20):
        call()
    if a.mode == "loop":
        dist.barrier(group=meta)
        t0 = time.perf_counter()
        for _ in range(a.batch):
            call()
        dt = (time.perf_counter() - t0) / a.batch
    else:
        tot = 0.0
        for _ in range(a.batch):
            dist.barrier(group=meta)
            t0 = time.perf_counter()
            call()
            tot += time.perf_counter() - t0
        dt = tot / a.batch
    v = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=meta)
    return v.item() * 1e6


rows = []
for i in range(a.pairs):
    order = (True, False) if i % 2 else (False, True)
    got = {s: batch(s) for s in order}
    rows.append((got[False], got[True]))
    if rank == 0:
        print(f"pair {i}: off {got[False]:7.1f} us   on {got[True]:7.1f} us   "
              f"{got[True] / got[False]:.2f}x", flush=True)
if rank == 0:
    old, new = np.array(rows).T
    print(f"# {a.switch} {a.op} {a.bytes} {a.mode}: median off {np.median(old):.1f} us, on {np.median(new):.1f} us, "
          f"median ratio {np.median(new / old):.2f}x, on faster in {int((new < old).sum())} of {len(rows)}")
dist.destroy_process_group()
