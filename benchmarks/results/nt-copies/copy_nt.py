"""One process, one torch thread: glibc memmove of 1-64 MiB between two torch buffers, us per copy
(median). Run it with and without GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x800000 to
compare glibc's default (temporal stores up to ~41 MiB on this VM) with non-temporal stores from 8 MiB.

    python copy_nt.py
"""
import ctypes, time, torch, statistics as st
torch.set_num_threads(1)
libc = ctypes.CDLL(None); libc.memmove.restype = ctypes.c_void_p
libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
out = []
for mib in (1, 2, 4, 8, 16, 32, 64):
    n = mib << 20
    a = torch.ones(n, dtype=torch.uint8); b = torch.empty(n, dtype=torch.uint8)
    for _ in range(3): libc.memmove(b.data_ptr(), a.data_ptr(), n)
    cp = []
    for _ in range(max(5, 200 // mib)):
        t = time.perf_counter(); libc.memmove(b.data_ptr(), a.data_ptr(), n); cp.append((time.perf_counter() - t) * 1e6)
    out.append(f"{mib}M {st.median(cp):.0f}")
print(" ".join(out))
