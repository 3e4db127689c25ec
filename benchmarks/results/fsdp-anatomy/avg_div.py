"""Would dividing AVG's result frame by frame, while each frame is still in cache, beat the one
pass over the whole output that the backend makes after the reduction? One process, one core:
the receiving side of a world-2 reduce-scatter of a 25 MiB input (a 12.5 MiB block, reduced in
512 KiB frames), three ways, median of 30 (ms).

    python benchmarks/results/fsdp-anatomy/avg_div.py
"""
import time

import torch

torch.set_num_threads(1)
n = 25 * 2**20 // 4 // 2
a, b, o = torch.ones(n), torch.ones(n), torch.empty(n)
F = 512 * 1024 // 4


def sum_only():
    for i in range(0, n, F):
        torch.add(a[i:i + F], b[i:i + F], out=o[i:i + F])


def per_frame():
    for i in range(0, n, F):
        f = o[i:i + F]
        torch.add(a[i:i + F], b[i:i + F], out=f)
        f.div_(2)


def one_pass_after():
    sum_only()
    o.div_(2)


def median_ms(f, k=30):
    f()
    ts = []
    for _ in range(k):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[k // 2] * 1e3


for r in range(3):
    print(f"round {r}: sum only {median_ms(sum_only):.2f}, divided per frame {median_ms(per_frame):.2f}, "
          f"divided in one pass after {median_ms(one_pass_after):.2f}", flush=True)
