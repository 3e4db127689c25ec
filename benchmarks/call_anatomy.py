"""Where one small all-reduce's (or, with --op allgather, all-gather's) time goes when calls come
one at a time, as collbench times them.

    torchrun --nproc-per-node 2 benchmarks/call_anatomy.py            # 4 KiB, world 2
    torchrun --nproc-per-node 1 benchmarks/call_anatomy.py            # no peer: the code path alone
    torchrun --nproc-per-node 2 benchmarks/call_anatomy.py --bytes 1M --iters 100

For each way of starting a call (back to back; after a Gloo barrier, collbench's default; after
a 1 ms sleep) it prints, over the iterations, the median and 90th percentile of: the skew
between the ranks' starts, the latest-starting rank's own duration (its peer is already
waiting, so this is mostly its own work), and the slowest rank's duration (collbench's number).
Timestamps are CLOCK_MONOTONIC, comparable across the processes of one host.

    torchrun --nproc-per-node 1 benchmarks/call_anatomy.py --floor

With --floor it first prints, back to back, what the same call costs through three groups of
the same ranks: this backend, Gloo, and a Python backend that does nothing (its collective
returns a finished Work at once). The last is torch's own share of any Python backend's call
(`dist.all_reduce`'s wrapper, the options object, the Work), so the rest of this backend's
time is its own; at world 1 no byte moves and Gloo's number is its C++ path's share.

    torchrun --nproc-per-node 1 benchmarks/call_anatomy.py --cold

With --cold it first prints what a call costs back to back and right after 2 ms of other work
(a busy loop, so the core never idles): for the same three groups, and for three primitives that
belong to no backend (an empty Python call, a 4 KiB `torch.add(out=)`, a 4 KiB `copy_`). Where
the host runs code slowly just after other work (the 2-vCPU EPYC VM of 2026-12-04, world 1: an
empty Python call 5x its back-to-back time, a 4 KiB add 13x, this backend's all-reduce and a
no-op Python backend's 5.5x; benchmarks/RESULTS.md, "Twenty-fifth pass"), this sets what any
call costs when calls come one at a time, whatever the backend does: the cost then grows with
the memory a call's code and data touch, not with what it waits for. A third column times each
call right after a 4 MiB copy between two private buffers (`--evict-bytes`): twice a core's L2
on the Xeon host, so the call's code and data come back from L3, as they do after a large
collective's copies or a training step's compute.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401  registers "neuron"
from neuron_dist.bench import parse_size

CLK = time.CLOCK_MONOTONIC
BUSY_S = 0.002  # the other work before a call in --cold and the "after 2 ms busy" mode
NOOP = "noop_python_backend"


class _FinishedWork(dist.Work):
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _NoopGroup(dist.ProcessGroup):
    """A Python backend whose collectives return a finished Work at once (the --floor row)."""

    def getBackendName(self) -> str:
        return NOOP

    def name(self) -> str:
        return NOOP

    def allreduce(self, tensors, opts=None):
        return _FinishedWork()

    def all_gather_single(self, output, inp, opts=None):  # all_gather_into_tensor's call
        return _FinishedWork()


def register_noop() -> str:
    """Register the no-op Python backend (once per process) and return its name."""
    if NOOP not in dist.Backend.backend_list:
        dist.Backend.register_backend(NOOP, lambda o, _=None: _NoopGroup(o.group_rank, o.group_size),
                                      extended_api=True, devices=["cpu"])
    return NOOP


def _groups() -> dict:
    """The same ranks as this backend's default group (None), a Gloo group and a no-op one."""
    return {"neuron": None, "gloo": dist.new_group(backend="gloo"),
            "no-op Python backend": dist.new_group(backend=register_noop())}


def _floor(call_on, rank: int, iters: int, groups: dict) -> None:
    """Per call, back to back, through this backend, Gloo and the no-op Python backend: the
    median of 5 timed loops of `iters` calls each, the backends interleaved loop by loop."""
    us: dict[str, list[float]] = {k: [] for k in groups}
    for g in groups.values():
        for _ in range(50):
            call_on(g)
    for _ in range(5):
        for name, g in groups.items():
            dist.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            for _ in range(iters):
                call_on(g)
            us[name].append((time.perf_counter() - t0) / iters * 1e6)
    if rank == 0:
        cells = ", ".join(f"{k} {sorted(v)[2]:.1f}" for k, v in us.items())
        print(f"# floor, back to back, us per call (median of 5 x {iters}): {cells}", flush=True)


def _busy(seconds: float) -> None:
    """Keep the core on other work (a loop over the clock) for `seconds`: no idle, no syscall."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _evictor(nbytes: int):
    """A copy of `nbytes` between two private buffers (libc memmove, as the data path's large
    copies): run before a call, it pushes the call's code and data out of the core's caches."""
    src, dst = torch.ones(max(1, nbytes // 4)), torch.empty(max(1, nbytes // 4))
    return lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)


def _cold(call_on, rank: int, iters: int, groups: dict, gap: float = BUSY_S, evict_bytes: int = 4 << 20) -> None:
    """Per call, the median of `iters` single timed calls back to back, the median of `iters`
    calls each made right after `gap` seconds of other work, and the median of `iters` calls
    each made right after a copy of `evict_bytes`, for the three groups of _floor and three
    primitives of no backend; rank 0 prints one line each, with the ratios to back to back."""
    a, b, out = torch.ones(1024), torch.ones(1024), torch.empty(1024)
    evict = _evictor(evict_bytes)
    calls = {name: (lambda g=g: call_on(g)) for name, g in groups.items()}
    calls.update({"empty Python call": lambda: None,
                  "torch.add 4 KiB (out=)": lambda: torch.add(a, b, out=out),
                  "Tensor.copy_ 4 KiB": lambda: out.copy_(a)})
    clock = time.perf_counter
    if rank == 0:
        print(f"# cold: us per call, median of {iters}; back to back, each call right after "
              f"{gap * 1e3:g} ms of other work (a busy loop), each right after a {evict_bytes >> 10} KiB copy",
              flush=True)
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        medians = []
        for before in (None, lambda: _busy(gap), evict):
            dist.barrier(group=groups["gloo"])
            us = []
            for _ in range(iters):
                if before is not None:
                    before()
                t0 = clock()
                fn()
                us.append((clock() - t0) * 1e6)
            medians.append(sorted(us)[len(us) // 2])
        if rank == 0:
            warm, busy, evicted = medians
            print(f"  {name:>24} {warm:>8.2f} {busy:>8.2f} x{busy / warm:<5.1f} {evicted:>8.2f} x{evicted / warm:.1f}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", default="4K", help="size (float32; all-gather: the output), e.g. 4K, 1M")
    p.add_argument("--op", choices=("allreduce", "allgather"), default="allreduce")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--pin", action="store_true", help="pin each rank to core LOCAL_RANK %% cores")
    p.add_argument("--floor", action="store_true",
                   help="first time the call through Gloo and a no-op Python backend as well (see above)")
    p.add_argument("--cold", action="store_true",
                   help="first time calls and primitives back to back, after 2 ms of other work and after "
                        "a copy of --evict-bytes (see above)")
    p.add_argument("--evict-bytes", default="4M", help="the copy before each call in --cold's last column")
    a = p.parse_args()
    if a.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = dist.new_group(backend="gloo")
    x = torch.zeros(max(world, parse_size(a.bytes) // 4 // world * world))
    part = torch.ones(x.numel() // world)
    if a.op == "allreduce":
        def call(group=None):
            dist.all_reduce(x, group=group)
    else:
        def call(group=None):
            dist.all_gather_into_tensor(x, part, group=group)
    groups = _groups() if a.floor or a.cold else None
    if a.floor:
        _floor(call, rank, a.iters, groups)
    if a.cold:
        _cold(call, rank, a.iters, groups, evict_bytes=parse_size(a.evict_bytes))
    for _ in range(50):
        call()
    modes = {"back to back": lambda: None, "after gloo barrier": lambda: dist.barrier(group=meta),
             "after 1 ms sleep": lambda: time.sleep(0.001), "after 2 ms busy": lambda: _busy(BUSY_S)}
    if rank == 0:
        print(f"# call_anatomy: {a.op} {x.numel() * 4} B, world {world}, {a.iters} calls per mode; "
              f"us, median / p90")
        print(f"# {'mode':>20} {'start skew':>16} {'latest rank':>16} {'slowest rank':>16}")
    for name, before in modes.items():
        dist.barrier(group=meta)
        stamps = torch.empty(a.iters, 2, dtype=torch.float64)
        for i in range(a.iters):
            before()
            t0 = time.clock_gettime(CLK)
            call()
            stamps[i, 0], stamps[i, 1] = t0, time.clock_gettime(CLK)
        every = [torch.empty_like(stamps) for _ in range(world)]
        dist.all_gather(every, stamps, group=meta)
        if rank == 0:
            t = torch.stack(every)                      # world, iters, (start, end)
            start, dur = t[:, :, 0], t[:, :, 1] - t[:, :, 0]
            latest = start.argmax(0, keepdim=True)
            cols = [start.max(0).values - start.min(0).values, dur.gather(0, latest)[0], dur.max(0).values]
            cells = " ".join(f"{c.median().item() * 1e6:>7.1f} / {c.quantile(0.9).item() * 1e6:>6.1f}" for c in cols)
            print(f"  {name:>20} {cells}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
