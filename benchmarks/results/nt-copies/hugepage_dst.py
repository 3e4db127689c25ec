"""A world-2 all-gather back to back with its input (x) and/or output (o) from numpy, which madvises
huge pages for arrays of 4 MiB or more, instead of torch (4 KiB pages; t: both from torch): us per
call and the time in the own-block copy and the kernel read of the peer's block.

    torchrun --nproc-per-node 2 hugepage_dst.py BYTES MODES ITERS     # e.g. 16777216 t,o,t,o 200
"""
import os, sys, time, torch, numpy as np, torch.distributed as dist
import neuron_dist
from neuron_dist.transport import cma
from neuron_dist.collectives import executor
acc = {}
def wrap(mod, name, key):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] = acc.get(key, 0) + time.perf_counter() - t
    setattr(mod, name, g)
wrap(cma, "read", "read"); wrap(executor, "copy_into", "copy")
dist.init_process_group("neuron")
r, w = dist.get_rank(), dist.get_world_size()
n = int(sys.argv[1]) // 4
res = []
for mode in sys.argv[2].split(","):
    x = torch.from_numpy(np.full(n // w, float(r), np.float32)) if "x" in mode else torch.full((n // w,), float(r))
    out = torch.from_numpy(np.empty(n, np.float32)) if "o" in mode else torch.empty(n)
    for _ in range(20): dist.all_gather_into_tensor(out, x)
    dist.barrier(); acc.clear(); N = int(sys.argv[3])
    t = time.perf_counter()
    for _ in range(N): dist.all_gather_into_tensor(out, x)
    el = (time.perf_counter() - t) / N * 1e6
    res.append(f"{mode:>6} {el:7.0f} (copy {acc['copy']/N*1e6:5.0f} read {acc['read']/N*1e6:5.0f})")
    del x, out
if r == 0: print(" | ".join(res), flush=True)
dist.destroy_process_group()
