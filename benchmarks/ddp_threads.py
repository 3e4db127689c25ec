"""Where a DDP step's CPU goes, per thread of each rank: the training thread, the backend's
threads (ours: the engine, its progress and callback threads; Gloo's), over steps of the
bench_train model (4 x Linear(2500, 2500), batch 32, one torch thread).

    torchrun --nproc-per-node 2 benchmarks/ddp_threads.py neuron      # or gloo
    torchrun --nproc-per-node 2 benchmarks/ddp_threads.py none        # the model without DDP
    torchrun --nproc-per-node 2 benchmarks/ddp_threads.py neuron --bucket-view

Each rank prints its mean step and, per thread that ran, its CPU, its time waiting for a core
(run-queue) and its context switches per step, from /proc/self/task/*/schedstat before and
after the timed steps. Where each rank's CPU per step is about the step's wall time, the step
is bound by CPU (two ranks on two cores), not by waiting for the peer."""
import argparse
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from neuron_dist.bench_train import _model, _steps  # (importing the package registers "neuron")


def _tasks() -> dict[int, tuple[int, int, int]]:
    """Per thread of this process: (ns on CPU, ns waiting for one, switches)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, n = f.read().split()
        except OSError:  # ended meanwhile
            continue
        out[int(tid)] = (int(run), int(wait), int(n))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("backend", choices=("neuron", "gloo", "none"))
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo" if a.backend == "none" else a.backend)
    rank = dist.get_rank()
    model = argparse.Namespace(layers=4, width=2500, batch=32)  # bench_train's defaults
    m = _model(model)
    if a.backend != "none":
        m = DistributedDataParallel(m, gradient_as_bucket_view=a.bucket_view)
    if a.warmup:  # bench_train's step (_steps), untimed here
        _steps(m, argparse.Namespace(**vars(model), warmup=0, steps=a.warmup), rank)
    before, t0 = _tasks(), time.perf_counter()
    _steps(m, argparse.Namespace(**vars(model), warmup=0, steps=a.steps), rank)
    t1, after = time.perf_counter(), _tasks()
    names = {t.native_id: t.name for t in threading.enumerate()}
    lines = [f"rank {rank} {a.backend}{' bucket-view' if a.bucket_view else ''}: step "
             f"{1e3 * (t1 - t0) / a.steps:.1f} ms"]
    for tid in sorted(after):
        if tid in before:
            cpu, wait, n = ((after[tid][i] - before[tid][i]) / a.steps for i in range(3))
            if cpu > 1e5:  # (threads that ran 0.1 ms a step or more)
                lines.append(f"  {names.get(tid, f'thread {tid}'):28} cpu {cpu / 1e6:7.2f} ms/step  run-queue "
                             f"{wait / 1e6:6.2f} ms/step  switches {n:6.1f}/step")
    print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
