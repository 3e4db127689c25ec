"""The data path's large copies between contiguous buffers: libc's memmove instead of `copy_`.

Why: a frame into a shared-memory slot, a slot into the output, a rank's own block into place
are raw bytes between contiguous buffers of one dtype. On the Xeon host, with one torch thread
(torchrun's default per rank), glibc's memmove copied them faster than `Tensor.copy_` from 1 MiB
up (7-31% in cache, 12-23% from memory) and as fast at 512 KiB, one frame; below that `copy_`
was as fast or faster (benchmarks/RESULTS.md, "Twenty-first pass"). Open MPI's shared-memory
path copies with memcpy too. ctypes releases the GIL for the call, as torch does for copy_.
Where torch may run a copy on several threads (`torch.get_num_threads()` above 1 in the
calling thread), `copy_` keeps that parallelism.

Like Gloo's memcpy into a tensor, memmove writes the memory without bumping autograd's version
counter: the collectives' data path runs outside autograd (group._engine). Anything that is not
a plain byte copy (other dtypes, strided views, broadcasting) goes to `copy_`.
"""
from __future__ import annotations

import ctypes

import torch

MEMMOVE_FROM = 512 << 10  # bytes: one default frame
_memmove = ctypes.memmove
_threads = torch.get_num_threads


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src."""
    n = src.nbytes
    if n >= MEMMOVE_FROM and dst.dtype is src.dtype and dst.nbytes == n and dst.is_contiguous() \
            and src.is_contiguous() and _threads() == 1:
        _memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)
