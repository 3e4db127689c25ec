"""Per-call cost of a small all-reduce, back to back (the small-message path, RESULTS.md).

    torchrun --nproc-per-node 1 benchmarks/small_msg_loop.py      # no communication at all
    torchrun --nproc-per-node 2 benchmarks/small_msg_loop.py      # shared memory, world 2
    ... [--count 1024] [--iters 2000] [--profile]                 # cProfile of rank 0
    ... --pin --repeat 7 --iters 3000                             # A/B runs: one core per rank

Prints rank 0's wall time and process CPU time per dist.all_reduce call (float32, SUM); with
--repeat, the best and the median of that many timed loops (a barrier before each). --pin puts
each rank on core LOCAL_RANK (mod the cores): the scheduler then cannot move a rank mid-loop,
which on this 2-core VM otherwise adds several us per call at random.
"""
import os
import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401  registers "neuron"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(a.count)
    for _ in range(a.warmup):
        dist.all_reduce(t)
    walls, cpus = [], []
    for _ in range(a.repeat):
        dist.barrier()
        prof = cProfile.Profile() if a.profile and rank == 0 else None
        if prof:
            prof.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(t)
        walls.append((time.perf_counter() - t0) / a.iters * 1e6)
        cpus.append((time.process_time() - c0) / a.iters * 1e6)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if rank == 0:
        walls.sort()
        cpus.sort()
        spread = f" (best {walls[0]:.1f}, median {walls[len(walls) // 2]:.1f} of {a.repeat} loops)" if a.repeat > 1 else ""
        print(f"all_reduce {a.count * 4} B, world {world}: {walls[0]:.1f} us/call wall{spread}, "
              f"{cpus[0]:.1f} us/call CPU (rank 0), {a.iters} calls per loop")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
