"""Is the slow Python before a large call's first copy the caches? A 64 KiB world-2 all-gather with
two 32 MiB memmoves (outside the call) before each call, against none, and a 16 MiB all-gather:
median us from the call to its own-block copy.

    torchrun --nproc-per-node 2 precopy_polluted.py MSG_BYTES POLLUTE_BYTES   # 65536 0 | 65536 33554432 | 16777216 0
"""
import os, sys, time, ctypes, torch, numpy as np, torch.distributed as dist
import neuron_dist
from neuron_dist.collectives import executor
dist.init_process_group("neuron")
r, w = dist.get_rank(), dist.get_world_size()
n = int(sys.argv[1]) // 4
pol = int(sys.argv[2])
libc = ctypes.CDLL(None); libc.memmove.restype = ctypes.c_void_p
libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
pa = torch.ones(max(pol, 1), dtype=torch.uint8); pb = torch.empty(max(pol, 1), dtype=torch.uint8)
x = torch.full((n // w,), float(r)); out = torch.empty(n)
for _ in range(10): dist.all_gather_into_tensor(out, x)
orig = executor.copy_into; first = []
executor.copy_into = lambda d, s: (first.append(time.perf_counter()), orig(d, s))[1]
pre = []
for _ in range(150):
    if pol: libc.memmove(pb.data_ptr(), pa.data_ptr(), pol); libc.memmove(pa.data_ptr(), pb.data_ptr(), pol)
    first.clear(); t = time.perf_counter()
    dist.all_gather_into_tensor(out, x)
    pre.append((first[0] - t) * 1e6)
pre.sort()
if r == 0: print(f"msg {n*4} pollute {pol}: pre-copy median {pre[75]:.1f} us", flush=True)
dist.destroy_process_group()
