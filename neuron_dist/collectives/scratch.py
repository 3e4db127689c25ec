"""The scratch buffer (a schedule's TMP) that a group's collectives share, kept between calls.

Why: TMP holds what a rank receives before it reduces it (the direct all-reduce's and
reduce-scatter's received vectors, the ring reduce-scatter's blocks at three or more ranks,
recursive doubling's and the torus' partial sums). Made afresh per call, a buffer of more than a
few hundred KiB often came back from the kernel (whether depends on the process's heap, and
changes from run to run), and the call then faulted every page in again, most of them inside the
`process_vm_readv` of a lent frame: a default-policy 4 MiB all-reduce at two ranks, in the runs
where that happened, took 700-1,000 page faults and 4.0-5.3 ms per call; with the kept buffer no
run faulted, and calls took 1.5-3.6 ms (benchmarks/RESULTS.md, "Nineteenth pass").

Why one buffer per group is enough: a group runs one collective at a time (the engine admits
the next only once the last is done), and a finished collective's buffers are no longer read by
anyone (its executor waits until every send is flushed and every lent frame released).
Point-to-point ops, which run beside collectives, have no TMP. A scatter's root joins its blocks
into it, and a gather's root receives into it, as the op starts (c10d.scatter, c10d.gather: the
direct schedules of both have no TMP of their own).

Bounded: the buffer grows to the largest scratch a call needs, rounded up to a power of two, up
to `NEURON_DIST_SCRATCH_BYTES` (default 64 MiB); a call needing more gets a buffer of its own,
freed when the call ends, as before. Small scratch (up to 64 KiB) may stay with its call's plan
(plans.py), with the views cut from it, while the group's plans keep no more than
SMALL_KEPT_BYTES of it in all (and none with the setting at 0): a job whose call sizes change
every step made a plan for each, and ~2,000 plans of 64 KiB kept ~120 MiB. Past that budget a
plan's small scratch is cut from the one buffer like any other.
"""
from __future__ import annotations

import mmap

import torch

from ..config import env_int

DEFAULT_SCRATCH_BYTES = 64 << 20
SMALL_KEPT_BYTES = 4 << 20  # the most small scratch a group's plans keep (within the setting)


def scratch_bytes_setting() -> int:
    """NEURON_DIST_SCRATCH_BYTES, checked: the most scratch memory a group keeps between calls
    (0: none kept)."""
    return env_int("NEURON_DIST_SCRATCH_BYTES", DEFAULT_SCRATCH_BYTES, minimum=0)


class Scratch:
    """One byte buffer, handed out as the TMP of one collective at a time (see the module)."""
    __slots__ = ("limit", "_buf", "_small_left")

    def __init__(self, limit: int):
        self.limit = limit
        self._buf: torch.Tensor | None = None
        self._small_left = min(limit, SMALL_KEPT_BYTES)  # what the plans may still keep (keep_small)

    def keep_small(self, nbytes: int) -> bool:
        """Whether a plan may keep `nbytes` of small scratch of its own, counted as kept."""
        if nbytes > self._small_left:
            return False
        self._small_left -= nbytes
        return True

    def forget_small(self) -> None:
        """The plans that kept small scratch are gone (their caches started again)."""
        self._small_left = min(self.limit, SMALL_KEPT_BYTES)

    @property
    def kept_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def take(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `count` elements of `dtype`, contents undefined, valid until the next
        `take`: the kept buffer when it fits the limit, else a fresh one."""
        nbytes = count * dtype.itemsize
        if nbytes > self.limit:
            return fresh(count, dtype)
        buf = self._buf
        if buf is None or buf.numel() < nbytes:
            self._buf = None  # the old one goes before the new one is made
            buf = self._buf = huge_page_bytes(min(self.limit, 1 << (nbytes - 1).bit_length()))
        return buf[:nbytes].view(dtype)

    def holds(self, *tensors) -> bool:
        """Whether any of `tensors` lies in the kept buffer (a scatter or gather root's staging,
        taken as its op started): the op's TMP must not be cut from the same memory."""
        buf = self._buf
        if buf is None:
            return False
        base = buf.untyped_storage().data_ptr()  # (the buffer may start inside its storage: huge_page_bytes)
        return any(t is not None and t.untyped_storage().data_ptr() == base for t in tensors)

    def clear(self) -> None:
        self._buf = None


HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of uint8 that the kernel may back with transparent huge pages (MADV_HUGEPAGE,
    on a 2 MiB boundary; the setting's "madvise" mode, the usual one, gives them only to memory
    so advised). Why: torch's allocator advises nothing unless THP_MEM_ALLOC_ENABLE is set
    (neuronrun sets it), and on the 2-vCPU VMs measured, peers' kernel reads (process_vm_readv)
    of a scatter root's staged blocks were slower from 4 KiB pages: a 16 MiB scatter of separate
    tensors took 4.0-4.9 ms against 2.5-3.4 from huge pages, interleaved rounds (benchmarks/
    RESULTS.md, "Forty-eighth pass"). The memory goes back to the kernel with the
    tensor (the tensor holds the mapping). Smaller than a huge page, or where the platform
    has no MADV_HUGEPAGE: torch.empty."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    # private: an anonymous mapping is shared by default, which is shmem, whose huge pages are a
    # setting of their own (off on these hosts); room to start on a huge page's boundary
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        m.madvise(advice, start, nbytes)
    except OSError:  # (a kernel without transparent huge pages: small pages, as before)
        pass
    return whole[start:start + nbytes]


# glibc's malloc maps a block afresh (and faults its pages in) on every allocation above its
# mmap threshold, which rises with the blocks freed up to this size and no further
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20


def fresh(count: int, dtype: torch.dtype) -> torch.Tensor:
    """A call's own buffer of `count` elements: above GLIBC_MMAP_THRESHOLD_MAX on huge pages
    (huge_page_bytes), where malloc would map it in 4 KiB pages every call (a 64 MiB all-to-all
    of two lists joined its input so: 53-66 ms a call against 28-34; RESULTS.md "Forty-eighth
    pass"); below it, torch.empty, which malloc serves again from memory it kept."""
    nbytes = count * dtype.itemsize
    if nbytes <= GLIBC_MMAP_THRESHOLD_MAX:
        return torch.empty(count, dtype=dtype)
    return huge_page_bytes(nbytes).view(dtype)
