import time, statistics as st, ctypes, mmap, sys
mm = ctypes.memmove
libc = ctypes.CDLL(None, use_errno=True)
def buf(nbytes, huge):
    size = nbytes + (2 << 20)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = (base + (2 << 20) - 1) & ~((2 << 20) - 1)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE, 0, size)
    else:
        m.madvise(mmap.MADV_NOHUGEPAGE, 0, size)
    ctypes.memset(start, 1, nbytes)
    return m, start
def run(fn, gap_s, n=100):
    out = []
    for _ in range(n):
        if gap_s:
            e = time.perf_counter() + gap_s
            while time.perf_counter() < e: pass
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e6)
    return st.median(out)
for nb in (4096, 512 << 10, 4 << 20):
    for huge in (False, True):
        m1, a = buf(nb, huge); m2, c = buf(nb, huge)
        f = lambda: mm(c, a, nb)
        print(f"memmove {nb >> 10:5d} KiB huge={huge!s:5}: b2b {run(f, 0):7.1f} | 2 ms busy {run(f, 0.002):7.1f} | 20 ms busy {run(f, 0.02, 40):7.1f}")
import re
print(re.findall(r"AnonHugePages:\s+\d+ kB", open("/proc/self/smaps_rollup").read()))
