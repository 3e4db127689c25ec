"""Is a single-copy read (Linux cross-memory attach, process_vm_readv) faster than the shared-memory
transport's two copies on this host? Two processes, one per core, each move a buffer of SIZE
bytes from the other at the same time, both ways:

    python benchmarks/single_copy.py [SIZE ...]     # default 512 KiB (one frame) and 2 MiB; 64K, 1MiB...

  cma        each reads the peer's buffer straight into its own (process_vm_readv): one copy
  two copies each copies its buffer into a shared slot, then the peer's slot into its own buffer
             (what neuron_dist's shm transport does per frame it does not lend)
  one copy   a plain local copy of SIZE bytes, for scale

Open MPI reads large messages this way (its `cma` component), and so does neuron_dist's shm
transport for the frames it lends (`neuron_dist/transport/cma.py`, whose read this times). On
the first two benchmark VMs the kernel's read was slower than two user-space copies at a frame's
size (RESULTS.md, "Single-copy reads"); on the Xeon host it is about twice as fast ("Seventeenth
pass").
"""
import multiprocessing as mp
import mmap
import os
import sys
import time

import torch

from neuron_dist.bench import parse_size
from neuron_dist.transport.cma import read as _cma_read  # the read the shm transport lends through

ITERS = 200


def _rank(rank: int, n: int, shm, barrier, addrs, pids, out) -> None:
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    src = torch.full((n,), rank + 1, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    addrs[rank] = src.data_ptr()
    barrier.wait()
    peer = 1 - rank
    peer_pid, peer_addr = pids[peer], addrs[peer]  # (proxies: each lookup is a round trip)
    slots = torch.frombuffer(shm, dtype=torch.uint8)
    mine, theirs = slots[rank * n:(rank + 1) * n], slots[peer * n:(peer + 1) * n]
    res = {}
    for name in ("cma", "two copies", "one copy"):
        barrier.wait()
        t = time.perf_counter()
        for _ in range(ITERS):
            if name == "cma":
                _cma_read(peer_pid, peer_addr, dst.data_ptr(), n)
            elif name == "two copies":
                mine.copy_(src)
                dst.copy_(theirs)
            else:
                dst.copy_(src)
        res[name] = (time.perf_counter() - t) / ITERS
        if name == "cma" and int(dst[0]) != peer + 1:
            raise SystemExit(f"rank {rank}: process_vm_readv read the wrong bytes")
    out[rank] = res


def measure(n: int) -> dict:
    ctx = mp.get_context("fork")
    with ctx.Manager() as m:
        addrs, pids, out = m.dict(), m.dict(), m.dict()
        shm = mmap.mmap(-1, 2 * n)
        barrier = ctx.Barrier(2)
        go = ctx.Event()
        procs = [ctx.Process(target=lambda r=r: (go.wait(), _rank(r, n, shm, barrier, addrs, pids, out)))
                 for r in range(2)]
        for p in procs:
            p.start()
        for r, p in enumerate(procs):
            pids[r] = p.pid
        go.set()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank failed (exit {p.exitcode}): is process_vm_readv allowed here "
                                 f"(kernel.yama.ptrace_scope, seccomp)?")
        return {k: max(out[r][k] for r in range(2)) for k in out[0]}


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        return
    try:  # sizes as neuron_dist.bench takes them ("64K", "2MiB"); int() made "64K" a traceback
        sizes = [parse_size(s) for s in sys.argv[1:]] or [512 << 10, 2 << 20]
    except ValueError as e:
        raise SystemExit(f"single_copy.py: bad size ({e}); sizes are bytes, or 64K, 2M, 1GiB") from None
    if min(sizes) < 1:
        raise SystemExit("single_copy.py: a size must be at least 1 byte")
    print(f"# {ITERS} moves per size, both ranks at once; time per move (slower rank), GB/s of SIZE")
    print(f"# {'size':>10} {'cma us':>9} {'GB/s':>6} {'2 copies us':>12} {'GB/s':>6} {'1 copy us':>10} {'GB/s':>6}")
    for n in sizes:
        r = measure(n)
        print(f"  {n:>10} " + " ".join(f"{r[k] * 1e6:>{w}.1f} {n / r[k] / 1e9:>6.2f}"
                                    for k, w in (("cma", 9), ("two copies", 12), ("one copy", 10))), flush=True)


if __name__ == "__main__":
    main()
