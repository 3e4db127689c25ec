"""Could the kernel's copy stand in for a non-temporal memmove? One process copies 4-32 MiB between
two torch buffers with glibc memmove and with process_vm_readv from itself (the read the shm
transport lends through), us per copy.

    python copy_kernel_self.py
"""
import ctypes, os, time, torch, statistics as st
from neuron_dist.transport.cma import read
torch.set_num_threads(1)
libc = ctypes.CDLL(None); libc.memmove.restype = ctypes.c_void_p
libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
pid = os.getpid(); out = []
for mib in (4, 8, 16, 32):
    n = mib << 20
    a = torch.ones(n, dtype=torch.uint8); b = torch.empty(n, dtype=torch.uint8)
    r = {}
    for name, f in (("memmove", lambda: libc.memmove(b.data_ptr(), a.data_ptr(), n)), ("self-readv", lambda: read(pid, a.data_ptr(), b.data_ptr(), n))):
        for _ in range(3): f()
        ts = []
        for _ in range(max(5, 100 // mib)):
            t = time.perf_counter(); f(); ts.append((time.perf_counter() - t) * 1e6)
        r[name] = st.median(ts)
    out.append(f"{mib}M memmove {r['memmove']:.0f} readv {r['self-readv']:.0f}")
print(" | ".join(out))
