"""A/B of the data path's copies on reduce-scatter, world 2, one core per rank, one torch thread,
default settings: a 25 MiB and a 4 MiB input, back to back (7 loops of 10 and 40 calls, the
median loop of the slowest rank). Interleaved per checkout:

    TAG=old PYTHONPATH=<checkout> torchrun --nproc-per-node 2 rs_w2_loop.py
"""
import os, torch, torch.distributed as dist
from ab_common import loop, setup
gloo, rank, n = setup()
x = torch.ones((25 << 20) // 4); o = torch.empty((25 << 20) // 4 // n)
y = torch.ones((4 << 20) // 4); p = torch.empty((4 << 20) // 4 // n)
r = [loop(lambda: dist.reduce_scatter_single(o, x), 10, gloo), loop(lambda: dist.reduce_scatter_single(p, y), 40, gloo)]
if rank == 0:
    print(os.environ.get("TAG", ""), f"reduce_scatter 25M {r[0]:.2f} ms; 4M {r[1]:.3f} ms", flush=True)
dist.destroy_process_group()
