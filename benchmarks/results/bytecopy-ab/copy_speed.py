"""torch's copy_ against libc memmove (ctypes) for one contiguous float32 copy, one torch thread:
'hot' copies the same buffers each time (in cache up to a few MiB), 'cold' walks a 256 MiB pool.

    python benchmarks/results/bytecopy-ab/copy_speed.py
"""
import ctypes
import time

import torch

torch.set_num_threads(1)
POOL = 256 * 2**20
src, dst = torch.ones(POOL // 4), torch.empty(POOL // 4)


def bench(size, cold):
    n = size // 4
    k = max(20, min(2000, (64 * 2**20) // size))
    offs = [(i * n) % (POOL // 4 - n) if cold else 0 for i in range(k)]
    best = {}
    for name in ("copy_", "memmove") * 2:
        ts = []
        for o in offs:
            s, d = src[o:o + n], dst[o:o + n]
            t = time.perf_counter()
            if name == "copy_":
                d.copy_(s)
            else:
                ctypes.memmove(d.data_ptr(), s.data_ptr(), size)
            ts.append(time.perf_counter() - t)
        best[name] = min(best.get(name, 1e9), sorted(ts)[len(ts) // 2])
    return best


for cold in (False, True):
    for size in (64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 8 << 20, 32 << 20):
        r = bench(size, cold)
        print(f"{'cold' if cold else 'hot '} {size >> 10:>6} KiB: copy_ {r['copy_'] * 1e6:8.1f} us  "
              f"memmove {r['memmove'] * 1e6:8.1f} us  copy_/memmove {r['copy_'] / r['memmove']:.2f}", flush=True)
