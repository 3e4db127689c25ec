"""Per-call time and page faults of one collective, one call per Gloo barrier (collbench's way).

    torchrun --nproc-per-node 2 benchmarks/call_faults.py                      # all-reduce 1 and 4 MiB
    torchrun --nproc-per-node 2 benchmarks/call_faults.py --op reduce_scatter --sizes 1M,16M
    torchrun --nproc-per-node 2 benchmarks/call_faults.py --op reduce_scatter --sizes 25M --reduce-op avg

Prints, per size, the median over calls of the slowest rank's time, and rank 0's minor page
faults per call (`getrusage`): a buffer the backend makes afresh per call and the kernel hands
back unmapped shows here as one fault per 4 KiB page of it (RESULTS.md, "Nineteenth pass").
A/B: run it with PYTHONPATH pointing at a checkout of each commit, interleaved.
"""
import argparse
import resource
import time

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401  registers "neuron"


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=("allreduce", "reduce_scatter"), default="allreduce")
    ap.add_argument("--sizes", default="1M,4M", help="bytes of the (input) tensor, comma-separated")
    ap.add_argument("--reduce-op", choices=("sum", "avg"), default="sum")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in map(size, a.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        out = torch.empty(nbytes // 4 // world)
        op = getattr(dist.ReduceOp, a.reduce_op.upper())
        call = (lambda: dist.all_reduce(x, op=op)) if a.op == "allreduce" else \
            (lambda: dist.reduce_scatter_single(out, x, op=op))
        for _ in range(a.warmup):
            dist.barrier(group=gloo)
            call()
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(a.iters):
            dist.barrier(group=gloo)
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / a.iters
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
        rows.append(f"{nbytes >> 10} KiB: {slowest.median().item() * 1e6:.0f} us, {faults:.0f} faults/call")
    if rank == 0:
        print(f"{a.op} {a.reduce_op} world {world}: " + "; ".join(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
