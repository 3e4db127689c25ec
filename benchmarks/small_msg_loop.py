"""Per-call cost of a small all-reduce, back to back (the small-message path, RESULTS.md).

    torchrun --nproc-per-node 1 benchmarks/small_msg_loop.py      # no communication at all
    torchrun --nproc-per-node 2 benchmarks/small_msg_loop.py      # shared memory, world 2
    ... [--count 1024] [--iters 2000] [--profile]                 # cProfile of rank 0

Prints rank 0's wall time and process CPU time per dist.all_reduce call (float32, SUM).
"""
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
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(a.count)
    for _ in range(a.warmup):
        dist.all_reduce(t)
    dist.barrier()
    prof = cProfile.Profile() if a.profile and rank == 0 else None
    if prof:
        prof.enable()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(t)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if rank == 0:
        print(f"all_reduce {a.count * 4} B, world {world}: {wall / a.iters * 1e6:.1f} us/call wall, "
              f"{cpu / a.iters * 1e6:.1f} us/call CPU (rank 0), {a.iters} calls")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
