"""Rank-side helpers shared by the test cases: the Gloo comparison group, deterministic inputs
every rank can regenerate for every other rank, and a float64/int64 reference reduction."""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

GLOO = None  # set by the pool worker: a gloo group over the same ranks
RANK = WORLD = 0

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
DTYPES = FLOATS + INTS + (torch.bool,)

OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR,
}


@contextmanager
def env(**kv):
    """Set environment variables for the block (e.g. NEURON_DIST_ALGO to force an algorithm),
    then restore what was there."""
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["sum", "product", "min", "max", "band", "bor", "bxor"]
    if dtype.is_floating_point:
        return ["sum", "avg", "product", "min", "max", "premul_sum", "premul_tensor"]
    return ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def c10d_op(op: str):
    if op == "premul_sum":
        return dist._make_nccl_premul_sum(0.5)
    if op == "premul_tensor":
        return dist._make_nccl_premul_sum(torch.tensor([0.25], dtype=torch.float64))
    return OPS[op]


def factor(op: str) -> float:
    return {"premul_sum": 0.5, "premul_tensor": 0.25}.get(op, 1.0)


def values(rank: int, count: int, dtype: torch.dtype, op: str = "sum", seed: int = 0) -> torch.Tensor:
    """Small integers, exact in every dtype for the reductions of up to 8 ranks."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + count)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if op == "product":
        v = torch.randint(1, 3, (count,), generator=g)
    elif dtype == torch.uint8 or op in ("band", "bor", "bxor"):
        v = torch.randint(0, 8, (count,), generator=g)
    else:
        v = torch.randint(-4, 5, (count,), generator=g)
    return v.to(dtype)


def reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of `inputs` (one per rank) computed in float64/int64, cast to dtype."""
    n = len(inputs)
    if dtype == torch.bool:
        x = torch.stack([i.to(torch.int64) for i in inputs])
        fn = {"sum": "any", "max": "any", "bor": "any", "product": "all", "min": "all", "band": "all"}.get(op)
        if op == "bxor":
            return (x.sum(0) % 2).bool()
        return (x.any(0) if fn == "any" else x.all(0)).bool()
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    x = torch.stack([i.to(wide) for i in inputs])
    if op in ("sum", "premul_sum", "premul_tensor"):
        r = (x * factor(op)).sum(0) if op != "sum" else x.sum(0)
    elif op == "avg":
        s = x.sum(0)
        r = s / n if dtype.is_floating_point else torch.div(s, n, rounding_mode="trunc")
    elif op == "product":
        r = x.prod(0)
    elif op == "min":
        r = x.min(0).values
    elif op == "max":
        r = x.max(0).values
    else:
        r = x[0].clone()
        for y in x[1:]:
            r = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op](r, y)
    return r.to(dtype)


def tol(dtype: torch.dtype) -> dict:
    if dtype in (torch.float16, torch.bfloat16):
        return dict(atol=2e-2, rtol=2e-2)
    if dtype.is_floating_point:
        return dict(atol=1e-6, rtol=1e-6)
    return dict(atol=0, rtol=0)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
    if want.dtype == torch.bool or not want.dtype.is_floating_point:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()[:5].flatten().tolist()
            raise AssertionError(f"{what}: mismatch at {bad}: got {got.flatten()[:8]} want {want.flatten()[:8]}")
        return
    torch.testing.assert_close(got, want, **tol(want.dtype), msg=lambda m: f"{what}: {m}")


def gloo_ran(fn) -> bool:
    """Run a Gloo call for comparison; False where Gloo itself does not support the case
    (its dtype/op coverage is narrower than torch's). The reference check runs regardless."""
    try:
        fn()
        return True
    except (RuntimeError, ValueError, TypeError):
        return False
