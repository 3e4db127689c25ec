"""``--thp``: every rank's large tensors on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE).

Why. torch takes a CPU tensor's memory from glibc's malloc, which maps a large block afresh for
each allocation and unmaps it when it is freed (its mmap threshold rises by itself to at most
32 MiB, and the heap's free top is trimmed beyond twice that). A training step frees and
allocates the same large tensors every step (gradients, activations, FSDP's unsharded
parameters), so every step the kernel faults their 4 KiB pages in again: 24,400 faults per step
for a 25M-parameter MLP (its 100 MB of gradients), about a third of its single-process step on
the 2-vCPU hosts this project runs on; with this switch two ranks' DDP and FSDP2 steps took about
a sixth less time under either backend (benchmarks/RESULTS.md, "Thirty-second pass").

What. ``THP_MEM_ALLOC_ENABLE=1`` is torch's own switch (c10's CPU allocator): allocations of
2 MiB and more are advised ``MADV_HUGEPAGE``, so the kernel backs them with 2 MiB pages, each
faulted in once where 512 small ones were (a block's ends, where it does not start or stop on a
2 MiB boundary, stay in small pages: a 48 MiB tensor faulted 536 times here instead of 12,289).
Memory is still returned on free, as before. It takes effect where
/sys/kernel/mm/transparent_hugepage/enabled is ``madvise`` or ``always``; at ``never`` nothing
changes. torch reads it once, when a process first allocates, so it must be in the environment a
rank starts with: neuronrun puts it there, and leaves a value the user exported alone.

Not chosen: glibc's malloc thresholds raised so that freed blocks stay in the process (what
torch's CPU launcher gets from jemalloc told never to return memory). That saves the zeroing
too, but torch asks glibc for 64-byte-aligned blocks, which glibc often cannot carve from a
freed block of the same size: two 48 MiB tensors made and freed in a loop grew the heap for
five rounds before reusing it (RESULTS.md, "Thirty-second pass").
"""

from __future__ import annotations

from collections.abc import Mapping

THP_VAR = "THP_MEM_ALLOC_ENABLE"
SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def rank_vars(enabled: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """What a rank that inherits `environ` gets for ``--thp on|off`` ({}: nothing)."""
    return {THP_VAR: "1"} if enabled and THP_VAR not in environ else {}


def host_mode(path: str = SYSFS) -> str | None:
    """The kernel's THP mode (always, madvise or never), or None where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None
