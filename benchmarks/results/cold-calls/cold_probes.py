"""The one-process probes behind memmove_probes.txt and primitives_probe.txt (twenty-fifth pass):
the median time of single calls back to back and right after GAP of a busy loop (no idle).

    python cold_probes.py primitives   # torch, ctypes and numpy primitives on 4 KiB
    python cold_probes.py memmove      # ctypes.memmove of 4 KiB-4 MiB between torch buffers
    python cold_probes.py hugepage     # the same between 2 MiB-aligned mappings, with and without THP

Kept as run (one script since, with the timing loop shared), as a record; nothing runs it.
"""
import ctypes
import mmap
import re
import statistics as st
import sys
import time

import numpy as np
import torch

mm = ctypes.memmove


def run(fn, gap_s, n):
    """Median us of `n` single calls of `fn`, each right after `gap_s` seconds of a busy loop."""
    out = []
    for _ in range(n):
        if gap_s:
            e = time.perf_counter() + gap_s
            while time.perf_counter() < e:
                pass
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return st.median(out)


def primitives():
    a, b, c = torch.ones(1024), torch.ones(1024), torch.empty(1024)
    an, bn, cn = a.numpy(), b.numpy(), c.numpy()
    ap, cp = a.data_ptr(), c.data_ptr()
    cases = [
        ("c.copy_(a)", lambda: c.copy_(a)),
        ("torch.add(a,b,out=c)", lambda: torch.add(a, b, out=c)),
        ("memmove(ptrs) cached", lambda: mm(cp, ap, 4096)),
        ("memmove(c.data_ptr(),a.data_ptr())", lambda: mm(c.data_ptr(), a.data_ptr(), 4096)),
        ("np.add cached views", lambda: np.add(an, bn, out=cn)),
        ("np.add(a.numpy(),b.numpy(),out=c.numpy())", lambda: np.add(a.numpy(), b.numpy(), out=c.numpy())),
        ("a.numpy()", lambda: a.numpy()),
        ("a.data_ptr()", lambda: a.data_ptr()),
        ("a.is_contiguous()", lambda: a.is_contiguous()),
        ("a[0:512] slice", lambda: a[0:512]),
        ("nothing", lambda: None),
    ]
    for name, fn in cases:
        print(f"{name:45s} b2b {run(fn, 0, 400):7.2f} us | after 2 ms busy {run(fn, 0.002, 400):7.2f}")


def memmove():
    for nb in (4096, 64 << 10, 512 << 10, 4 << 20):
        a, c = torch.ones(nb // 4), torch.empty(nb // 4)
        ap, cp = a.data_ptr(), c.data_ptr()

        def f():
            mm(cp, ap, nb)
        print(f"memmove {nb >> 10:6d} KiB: b2b {run(f, 0, 200):8.1f} us | after 2 ms busy {run(f, 0.002, 200):8.1f}"
              f" | after 0.2 ms busy {run(f, 0.0002, 200):8.1f} | after 20 ms busy {run(f, 0.02, 50):8.1f}")


def _aligned(nbytes, huge):
    """An anonymous mapping with `nbytes` from a 2 MiB boundary, in huge pages or not, touched."""
    size = nbytes + (2 << 20)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = (base + (2 << 20) - 1) & ~((2 << 20) - 1)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, 0, size)
    ctypes.memset(start, 1, nbytes)
    return m, start


def hugepage():
    keep = []
    for nb in (4096, 512 << 10, 4 << 20):
        for huge in (False, True):
            (m1, a), (m2, c) = _aligned(nb, huge), _aligned(nb, huge)
            keep += [m1, m2]

            def f():
                mm(c, a, nb)
            print(f"memmove {nb >> 10:5d} KiB huge={huge!s:5}: b2b {run(f, 0, 100):7.1f} | "
                  f"2 ms busy {run(f, 0.002, 100):7.1f} | 20 ms busy {run(f, 0.02, 40):7.1f}")
    print(re.findall(r"AnonHugePages:\s+\d+ kB", open("/proc/self/smaps_rollup").read()))


if __name__ == "__main__":
    {"primitives": primitives, "memmove": memmove, "hugepage": hugepage}[sys.argv[1]]()
