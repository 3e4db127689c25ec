"""In-process A/B of a short form of the small all-reduce against the path it stands in for:
the same pair of processes alternates batches with the short form on and off, so both see the
same host minute. --switch pair: the two-rank one-frame all-reduce (PairReduce) against the
Execution (`group.pair_exchange` patched to answer None); --switch common: the adapter's common
all-reduce (`NeuronProcessGroup._allreduce_common`) against its general path (patched to answer
None).

    NEURON_DIST_TUNING=host torchrun --nproc-per-node 2 inproc_ab.py [--switch pair|common]
        [--bytes 4K] [--pairs 10] [--batch 300] [--mode loop|barrier]

Per batch the slowest rank's mean call time (loop: back to back; barrier: a Gloo barrier before
each call, timed from after it, as collbench does). Prints each pair and the median ratio.
It runs against stop 42's code (bcedfc1-5eced00): `pair_exchange` and `PairReduce` gave way to
the pair form in the thirty-fifth pass, measured by ../pair-exchange-ab/inproc_ab.py."""
import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401
from neuron_dist import group as G
from neuron_dist.c10d import NeuronProcessGroup as PG
from neuron_dist.bench import parse_size

p = argparse.ArgumentParser()
p.add_argument("--bytes", default="4K")
p.add_argument("--pairs", type=int, default=10)
p.add_argument("--batch", type=int, default=300)
p.add_argument("--mode", choices=("loop", "barrier"), default="loop")
p.add_argument("--switch", choices=("pair", "common"), default="pair")
a = p.parse_args()

dist.init_process_group("neuron")
meta = dist.new_group(backend="gloo")
rank = dist.get_rank()
t = torch.ones(parse_size(a.bytes) // 4)
real = G.pair_exchange if a.switch == "pair" else PG._allreduce_common


def batch(short: bool) -> float:
    if a.switch == "pair":
        G.pair_exchange = real if short else (lambda *args: None)
    else:
        PG._allreduce_common = real if short else (lambda *args: None)
    for _ in range(20):
        dist.all_reduce(t)
    if a.mode == "loop":
        dist.barrier(group=meta)
        t0 = time.perf_counter()
        for _ in range(a.batch):
            dist.all_reduce(t)
        dt = (time.perf_counter() - t0) / a.batch
    else:
        tot = 0.0
        for _ in range(a.batch):
            dist.barrier(group=meta)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            tot += time.perf_counter() - t0
        dt = tot / a.batch
    x = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=meta)
    return x.item() * 1e6


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
    print(f"# {a.switch} {a.bytes} {a.mode}: median off {np.median(old):.1f} us, on {np.median(new):.1f} us, "
          f"median ratio {np.median(new / old):.2f}x, on faster in {int((new < old).sum())} of {len(rows)}")
dist.destroy_process_group()
