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
freed when the call ends, as before. Small scratch (up to 64 KiB) stays with its call's plan
(plans.py), with the views cut from it.
"""
from __future__ import annotations

import torch

from ..config import env_int

DEFAULT_SCRATCH_BYTES = 64 << 20


def scratch_bytes_setting() -> int:
    """NEURON_DIST_SCRATCH_BYTES, checked: the most scratch memory a group keeps between calls
    (0: none kept)."""
    return env_int("NEURON_DIST_SCRATCH_BYTES", DEFAULT_SCRATCH_BYTES, minimum=0)


class Scratch:
    """One byte buffer, handed out as the TMP of one collective at a time (see the module)."""
    __slots__ = ("limit", "_buf")

    def __init__(self, limit: int):
        self.limit = limit
        self._buf: torch.Tensor | None = None

    @property
    def kept_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def take(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `count` elements of `dtype`, contents undefined, valid until the next
        `take`: the kept buffer when it fits the limit, else a fresh one."""
        nbytes = count * dtype.itemsize
        if nbytes > self.limit:
            return torch.empty(count, dtype=dtype)
        buf = self._buf
        if buf is None or buf.numel() < nbytes:
            self._buf = None  # the old one goes before the new one is made
            buf = self._buf = torch.empty(min(self.limit, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    def holds(self, *tensors) -> bool:
        """Whether any of `tensors` lies in the kept buffer (a scatter or gather root's staging,
        taken as its op started): the op's TMP must not be cut from the same memory."""
        buf = self._buf
        return buf is not None and any(t is not None and t.untyped_storage().data_ptr() == buf.data_ptr()
                                       for t in tensors)

    def clear(self) -> None:
        self._buf = None
