"""Where an FSDP2 step's communication time goes: per collective, the caller's wait, the
collective's own time, and page faults, for one backend.

    torchrun --nproc-per-node 2 benchmarks/fsdp_anatomy.py --backend neuron
    torchrun --nproc-per-node 2 benchmarks/fsdp_anatomy.py --backend gloo --steps 8

The model and step are bench_train's (an MLP of 4 x Linear(2500, 2500), 25M parameters, batch
32, SGD; each Linear and the whole model `fully_shard`ed). FSDP2 on the CPU issues its
collectives one at a time and waits for each (no streams to overlap on), through
`dist.all_gather_single` (parameters, forward and backward) and `dist.reduce_scatter_single`
(gradients, ReduceOp.AVG); both are wrapped here. Per collective it prints, over the timed steps:

  wait      rank 0's time in the call (median): its peers' lateness included
  own       from the last rank's entry to the last rank's exit (median; CLOCK_MONOTONIC,
            comparable across the processes of one host): the collective's own time
  faults    rank 0's minor page faults inside the call (median): buffers the backend makes
            afresh and the kernel hands back unmapped cost one fault per 4 KiB page

and the median step time and rank 0's faults per step (FSDP2's own allocations included).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401  registers "neuron"
from neuron_dist.bench_train import _model

WRAPPED = ("all_gather_single", "reduce_scatter_single")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="neuron")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import fully_shard
    m = _model(SimpleNamespace(layers=4, width=2500))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    m = fully_shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(32, 2500, generator=torch.Generator().manual_seed(rank))

    calls: list[tuple] = []  # (name, wait s, t_in, t_out, faults)

    def wrap(name):
        inner = getattr(dist, name)

        def call(*args, **kwargs):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t_in = time.clock_gettime(time.CLOCK_MONOTONIC)
            work = inner(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()
            t_out = time.clock_gettime(time.CLOCK_MONOTONIC)
            calls.append((name, t_out - t_in, t_in, t_out, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
            return work
        setattr(dist, name, call)

    for name in WRAPPED:
        wrap(name)

    def step():
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    calls.clear()
    steps, f0 = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
    faults_per_step = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / a.steps
    everyone = [None] * world
    dist.all_gather_object(everyone, calls)
    if rank == 0:
        ms = lambda v: f"{statistics.median(v) * 1e3:8.2f}"
        print(f"# fsdp_anatomy: backend {a.backend}, world {world}, {a.steps} steps after {a.warmup}; "
              f"step {ms(steps).strip()} ms median, rank 0 {faults_per_step:.0f} faults per step")
        print(f"# {'collective':>22} {'per step':>8} {'wait ms':>8} {'own ms':>8} {'faults':>7}")
        for name in WRAPPED:
            mine = [c for c in calls if c[0] == name]
            if not mine:
                continue
            rows = [[r[i] for r in everyone] for i in range(len(everyone[0])) if everyone[0][i][0] == name]
            own = [max(c[3] for c in row) - max(c[2] for c in row) for row in rows]
            print(f"  {name:>22} {len(mine) / a.steps:8.0f} {ms([c[1] for c in mine])} {ms(own)} "
                  f"{statistics.median(c[4] for c in mine):7.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
