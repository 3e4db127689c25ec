import time, statistics as st, torch, ctypes, numpy as np
a = torch.ones(1024); b = torch.ones(1024); c = torch.empty(1024)
an, bn, cn = a.numpy(), b.numpy(), c.numpy()
mm = ctypes.memmove
ap, cp = a.data_ptr(), c.data_ptr()
def run(fn, gap_s, n=400):
    out = []
    for _ in range(n):
        if gap_s:
            e = time.perf_counter() + gap_s
            while time.perf_counter() < e: pass
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e6)
    return st.median(out)
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
    print(f"{name:45s} b2b {run(fn, 0):7.2f} us | after 2 ms busy {run(fn, 0.002):7.2f}")
