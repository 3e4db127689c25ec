"""Reduction operators on torch tensors, in the tensor's own dtype (fp64 stays fp64, bf16 is
reduced as bf16 like Gloo does), with torch.distributed's meaning of every ReduceOp.

AVG and PREMUL_SUM are SUM on the wire: PREMUL_SUM scales the input first, AVG divides the
result by the group size last (integers: truncating division, as NCCL does).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..transport.frame import MOVE_ONLY

Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (out, a, b): out = a op b

OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
_BITWISE = ("band", "bor", "bxor")
_COMPLEX = (torch.complex64, torch.complex128)


def _fn(op: str, dtype: torch.dtype):
    if dtype == torch.bool:  # torch treats bool SUM/MAX as OR, PRODUCT/MIN as AND
        return {"sum": torch.logical_or, "max": torch.logical_or, "bor": torch.logical_or,
                "product": torch.logical_and, "min": torch.logical_and, "band": torch.logical_and,
                "bxor": torch.logical_xor}.get(op)
    table = {"sum": torch.add, "avg": torch.add, "premul_sum": torch.add, "product": torch.mul,
             "min": torch.minimum, "max": torch.maximum, "band": torch.bitwise_and,
             "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    if op in _BITWISE and dtype.is_floating_point:
        return None
    if dtype in _COMPLEX and op in ("min", "max") + _BITWISE:
        return None
    return table.get(op)


CHECKED: set = set()  # (op, dtype) pairs that passed check(); callers on a hot path may test it first
_REDUCERS: dict = {}  # (op, dtype) -> Reducer


def check(op: str, dtype: torch.dtype) -> None:
    """Raise ValueError for op/dtype pairs that have no meaning, before any byte moves."""
    if (op, dtype) in CHECKED:
        return
    _check(op, dtype)
    CHECKED.add((op, dtype))


def _check(op: str, dtype: torch.dtype) -> None:
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}")
    if op in ("avg", "premul_sum") and dtype == torch.bool:
        raise ValueError(f"ReduceOp.{op.upper()} is not defined for torch.bool tensors")
    if op == "premul_sum" and not (dtype.is_floating_point or dtype in _COMPLEX):
        raise ValueError(f"ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}")
    if dtype in MOVE_ONLY:
        raise ValueError(f"ReduceOp.{op.upper()} is not supported for {dtype} tensors: they are moved "
                         f"(broadcast, all-gather, all-to-all, gather, scatter, send/recv), never reduced")
    if _fn(op, dtype) is None:
        raise ValueError(f"ReduceOp.{op.upper()} is not supported for {dtype} tensors")


def reducer(op: str, dtype: torch.dtype) -> Reducer:
    r = _REDUCERS.get((op, dtype))
    if r is not None:
        return r
    if dtype in MOVE_ONLY:  # a collective that only moves such a dtype still gets a reducer it never calls
        def refuse(out, a, b):
            check(op, dtype)
        return refuse
    check(op, dtype)
    fn = _fn(op, dtype)

    def reduce(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        fn(a, b, out=out)

    _REDUCERS[(op, dtype)] = reduce
    return reduce


def finish_avg(t: torch.Tensor, size: int) -> None:
    """In place: the SUM already in `t` becomes the average over `size` ranks (a complex one part
    by part, as `dist.all_reduce` divides it through `view_as_real`: torch's complex division
    is off by an ulp where a real one is exact to the rounding)."""
    if t.dtype.is_floating_point:
        t.div_(size)
    elif t.dtype in _COMPLEX:
        torch.view_as_real(t).div_(size)
    else:
        t.copy_(torch.div(t, size, rounding_mode="trunc"))
