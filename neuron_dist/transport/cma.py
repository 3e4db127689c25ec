"""Single-copy reads between processes on one host (Linux cross-memory attach, process_vm_readv).

Why: a frame through a shared-memory slot is copied twice, into the slot by the sender and out
of it by the receiver. For the collectives that only move data (all-gather, broadcast,
all-to-all, gather, scatter), the steps of other collectives that their schedule builders mark
`lend` (those that only copy; from the larger `lend_reduce_from`, those the receiver reduces)
and point-to-point messages larger than the ring, the shm transport
can instead *lend* a frame: the slot carries the address of the sender's own bytes, the receiver
copies them straight into its output with one kernel copy (a reducing receive reads them part
by part, `Lent.read_part`), and the sender's op waits until the
receiver has released the slot (the transport's `released`). Open MPI's smsc/cma component moves
large messages the same way.

Whether it pays depends on the host: on two earlier VMs the kernel's copy ran at half of
`copy_`'s speed and lending lost (benchmarks/RESULTS.md, "Single-copy reads"); on the Xeon host
it halves the time of a 512 KiB-32 MiB exchange (`benchmarks/single_copy.py`). The shm
transport probes each pair at set-up and lends only where every pair can read the others.
"""
from __future__ import annotations

import ctypes
import errno
import os

import torch

from .base import PeerGone, TransportError

_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t


class _iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CmaError(OSError):
    """process_vm_readv failed; `errno` says why (ESRCH: the peer exited)."""


def read(pid: int, addr: int, dst: int, n: int) -> None:
    """Copy `n` bytes at `addr` in process `pid` to `dst` in this one (the GIL is released)."""
    done = 0
    while done < n:
        local, remote = _iovec(dst + done, n - done), _iovec(addr + done, n - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            e = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise CmaError(e, f"process_vm_readv of {n} bytes from pid {pid} at {addr:#x} failed after "
                              f"{done}: {os.strerror(e)}")
        done += got


def probe(pid: int, addr: int, expect: bytes) -> str | None:
    """None if this process can read `expect` at `addr` in process `pid`, else why not
    (no syscall, a seccomp filter, Yama's ptrace scope, another user)."""
    if _readv is None:
        return "this libc has no process_vm_readv"
    buf = ctypes.create_string_buffer(len(expect))
    try:
        read(pid, addr, ctypes.addressof(buf), len(expect))
    except CmaError as e:
        return str(e)
    return None if buf.raw == expect else "process_vm_readv read other bytes than the peer holds"


class Lent:
    """A received frame whose bytes are still in the sender's memory: what the shm transport's
    `recv` returns for a lent frame, in place of a payload view. The executor copies it straight
    into its destination (`read_into`), or a reduction reads it part by part (`read_part`);
    anything else that needs the bytes (an early frame the mailbox keeps) gets them as a fresh
    tensor (`clone`). Valid until the slot is released: the sender keeps the memory unchanged
    until then, unless its call fails first, and a failing sender raises its `failed` word
    before its caller hears of the failure (and may free the tensor), so a read is checked
    against that word after it is done."""
    __slots__ = ("pid", "addr", "nbytes", "dtype", "peer", "failed")

    def __init__(self, pid: int, addr: int, nbytes: int, dtype: torch.dtype, peer: int, failed=None):
        self.pid, self.addr, self.nbytes, self.dtype, self.peer = pid, addr, nbytes, dtype, peer
        self.failed = failed  # the sender's failure word (a ctypes int in shared memory), if any

    def read_into(self, dst: torch.Tensor) -> None:
        if dst.nbytes != self.nbytes or not dst.is_contiguous():
            raise ValueError(f"a lent frame of {self.nbytes} bytes cannot be read into a "
                             f"{'non-contiguous ' if not dst.is_contiguous() else ''}{dst.nbytes}-byte tensor")
        self.read_part(dst, 0)

    def read_part(self, dst: torch.Tensor, offset: int) -> None:
        """dst = the frame's `dst.nbytes` bytes from byte `offset` on (a reduction reads a large
        frame part by part, each into a buffer it reduces from while the part is in cache)."""
        n = dst.nbytes
        if offset < 0 or offset + n > self.nbytes or not dst.is_contiguous():
            raise ValueError(f"bytes {offset}..{offset + n} of a lent frame of {self.nbytes} bytes cannot "
                             f"be read into a {'non-contiguous ' if not dst.is_contiguous() else ''}tensor")
        if n:
            try:
                read(self.pid, self.addr + offset, dst.data_ptr(), n)
            except CmaError as e:
                if e.errno == errno.ESRCH:
                    raise PeerGone(self.peer, f"rank {self.peer} (pid {self.pid}) exited before its lent "
                                              f"frame was read") from None
                raise TransportError(f"cannot read the frame rank {self.peer} lent: {e}") from None
            if self.failed is not None and self.failed.value:
                raise PeerGone(self.peer, f"rank {self.peer}'s copy of the group failed while its lent frame "
                                          f"was read (rank {self.peer}'s own error says why)")

    def clone(self) -> torch.Tensor:
        out = torch.empty(self.nbytes // self.dtype.itemsize, dtype=self.dtype)
        self.read_into(out)
        return out
