import time, statistics as st, torch, ctypes
mm = ctypes.memmove
def run(fn, gap_s, n=200):
    out = []
    for _ in range(n):
        if gap_s:
            e = time.perf_counter() + gap_s
            while time.perf_counter() < e: pass
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e6)
    return st.median(out)
for nb in (4096, 64 << 10, 512 << 10, 4 << 20):
    a = torch.ones(nb // 4); c = torch.empty(nb // 4)
    ap, cp = a.data_ptr(), c.data_ptr()
    f = lambda: mm(cp, ap, nb)
    print(f"memmove {nb >> 10:6d} KiB: b2b {run(f, 0):8.1f} us | after 2 ms busy {run(f, 0.002):8.1f} | after 0.2 ms busy {run(f, 0.0002):8.1f} | after 20 ms busy {run(f, 0.02, 50):8.1f}")
