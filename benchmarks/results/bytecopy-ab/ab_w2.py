"""A/B of the data path's copies (transport/bytecopy.py), world 2, one core per rank, one torch
thread: per-call time of a 32 MiB all-gather (16 MiB per rank) and a 16 MiB all-reduce, back to
back (7 loops of 10 calls, the median loop of the slowest rank). Run once per checkout, with
lending on and off, interleaved:

    TAG="old lend=1" NEURON_DIST_TUNING=host NEURON_DIST_SHM_LEND=1 PYTHONPATH=<checkout> \
        torchrun --nproc-per-node 2 ab_w2.py
"""
import os, torch, torch.distributed as dist
from ab_common import loop, setup
gloo, rank, n = setup()
i = torch.ones((32 << 20) // 4 // n); o = torch.empty((32 << 20) // 4)
x = torch.ones((16 << 20) // 4)
r = [loop(lambda: dist.all_gather_into_tensor(o, i), 10, gloo), loop(lambda: dist.all_reduce(x), 10, gloo)]
if rank == 0:
    print(os.environ.get("TAG", ""), f"allgather 32M {r[0]:.2f} ms; allreduce 16M {r[1]:.2f} ms", flush=True)
dist.destroy_process_group()
