"""Collective fingerprint check: catch mismatched calls across ranks before they run.

With TORCH_DISTRIBUTED_DEBUG=DETAIL (torch's own switch, also set by dist.set_debug_level before
a group is made) or NEURON_DIST_CHECK=1, every collective
is preceded by a small fixed-size all-gather of its fingerprint (collective, dtype, byte count,
reduce op, root, and the call's description; the form of the user's call and its tensors' dtypes
and shapes, as torch's ProcessGroupWrapper compares them under Gloo) over the same group, in the
same sequence. If any
rank's fingerprint differs, every rank raises the same error listing what each rank called, and
the collective is not run, so the group stays usable (all ranks skipped it alike). Without the
check a mismatch still ends in an error naming both sides (frame checks and ABORT frames), but
possibly only after data moved; with it, before a byte of the real call moves. Like torch's
ProcessGroupWrapper, the check is synchronous and costs one small collective per call: a debug
mode, not for production.
"""
from __future__ import annotations

import re
import struct
import threading
import zlib
from functools import lru_cache

import torch

from .config import env, env_flag
from .transport.frame import DTYPE_CODE, CODE_DTYPE, Kind

_FIELDS = struct.Struct("<qqqqq")   # kind, dtype code, nbytes (-1: not compared), text crc, group size
_TEXT = 240
FP_BYTES = _FIELDS.size + _TEXT
_state = threading.local()
_FORCED: bool | None = None   # set_enabled's


def wanted() -> bool:
    """Whether a group made now is to be checked: TORCH_DISTRIBUTED_DEBUG=DETAIL or
    NEURON_DIST_CHECK in the environment (a bad value raises ValueError), or torch's debug level
    (torch_detail). Read as each group is made and kept by it (Group.check_wanted), as torch decides per group whether
    to wrap a Gloo group in its ProcessGroupWrapper: a process-wide reading kept the first
    group's answer for every later one, a world re-made under another setting included."""
    return env_wanted() or torch_detail()


def env_wanted() -> bool:
    """The environment's part of wanted(). Both variables read, so that a bad NEURON_DIST_CHECK
    is an error under TORCH_DISTRIBUTED_DEBUG=DETAIL too (an `or` skipped it)."""
    detail = (env("TORCH_DISTRIBUTED_DEBUG") or "").upper() == "DETAIL"
    return env_flag("NEURON_DIST_CHECK") or detail


def enabled(group_wanted: bool) -> bool:
    """Whether a group's calls are checked: forced by set_enabled, else what the group read as
    it was made (`group_wanted`, wanted())."""
    return group_wanted if _FORCED is None else _FORCED


def torch_detail() -> bool:
    """Whether torch's debug level is DETAIL: TORCH_DISTRIBUTED_DEBUG as torch read it, or set
    since by `dist.set_debug_level(dist.DebugLevel.DETAIL)`, which the environment alone missed
    (Gloo's groups made after it are checked)."""
    import torch.distributed as dist
    try:
        return dist.get_debug_level() == dist.DebugLevel.DETAIL
    except (AttributeError, RuntimeError):  # a torch built without distributed debug levels
        return False


def set_enabled(on: bool | None) -> None:
    """Force the check on or off for every group (None: back to the environment and torch's
    level). For tests and tools."""
    global _FORCED
    _FORCED = on


def _normalised(kind: Kind, desc: str) -> str:
    """The parts of a call's description every rank must agree on."""
    body = desc[desc.find("("):] if "(" in desc else desc
    if kind == Kind.ALLTOALL:      # uneven splits: byte counts legitimately differ per rank
        body = re.sub(r"\d+ bytes, ", "", body)
    return f"{kind.name.lower()}{body}"


@lru_cache(maxsize=4096)
def call_tag(kind: Kind, desc: str, algorithm: str) -> int:
    """32-bit checksum of a collective's arguments and of the algorithm this rank chose for it,
    carried in its frames' tag field: ranks whose NEURON_DIST_ALGO or NEURON_DIST_TUNING differ
    run different schedules, and their first frame says so instead of a size that does not fit."""
    return zlib.crc32(f"{_normalised(kind, desc)} {algorithm}".encode()) or 1


def _shape(t: torch.Tensor) -> str:
    """A user's tensor as its call passed it: "float32[2, 3]". dist.all_reduce and its kin hand a
    complex tensor to the backend as torch.view_as_real of it (float32[..., 2]), a view whose
    base is the complex tensor: named as the user's complex64[...], so that a complex64[2] and a
    float32[4] (the same 16 bytes) read as the different calls they are."""
    base, shape, dtype = t._base, list(t.shape), t.dtype
    if base is not None and base.is_complex() and not t.is_complex() and shape[-1:] == [2] and \
            dtype == base.dtype.to_real():
        shape, dtype = shape[:-1], base.dtype
    return f"{str(dtype).removeprefix('torch.')}{shape}"


def _called(call) -> str:
    """The user's call as torch's ProcessGroupWrapper fingerprints it under Gloo: its form (an
    all_gather_into_tensor is not a list all_gather, nor an all_reduce an all_reduce_coalesced)
    and the dtypes and shapes of the tensors it compares for that form (none where the ranks'
    shapes may legitimately differ: all-to-all's splits, the coalesced forms, a list all-gather
    or reduce-scatter of blocks of several shapes). Two ranks moving the same bytes as a (2, 3)
    and a (3, 2) tensor ran without a word: an all-gather then handed each rank's rows to the
    other in the wrong layout. `call`: (form, tensors), or None where the adapter gave none."""
    if not call:
        return ""
    form, tensors = call
    shapes = ", ".join(_shape(t) for t in tensors)
    return f" by {form}" + (f" of {shapes}" if shapes else "")  # "allreduce(...) by allreduce of float32[2, 3]"


def fingerprint(kind: Kind, desc: str, nbytes: int, dtype: torch.dtype, size: int, call=None) -> bytes:
    text = _normalised(kind, desc) + _called(call)  # its crc is compared: every character counts
    fields = _FIELDS.pack(int(kind), DTYPE_CODE.get(dtype, 0), -1 if kind == Kind.ALLTOALL else nbytes,
                          zlib.crc32(text.encode()), size)
    return fields + text.encode()[:_TEXT].ljust(_TEXT, b"\0")


def describe(fp: bytes) -> str:
    kind, dtype, nbytes, _crc, size = _FIELDS.unpack(fp[:_FIELDS.size])
    text = fp[_FIELDS.size:].rstrip(b"\0").decode("utf-8", "replace")
    return text or f"kind {kind} dtype {CODE_DTYPE.get(dtype)} {nbytes} bytes"


def checking() -> str:
    """The description of the call whose fingerprints this thread is exchanging ("" if none): the
    adapter names the exchange after it, and numbers it with it, so that a failure of the
    exchange (a rank that never called, a time-out) names the user's call, not an all-gather
    of fingerprints, and the sequence numbers the user sees count the user's calls."""
    return getattr(_state, "busy", "")


def check(pg, kind: Kind, desc: str, nbytes: int, dtype: torch.dtype, peer=None, call=None) -> bool:
    """The c10d adapter's hook (NeuronProcessGroup._submit): with the check on, all-gather this
    collective's fingerprint across the group and raise on every rank if any rank differs.
    `call`: the user's call form and tensors (see _called). True: the fingerprints agreed."""
    if not enabled(pg.group.check_wanted) or kind == Kind.P2P or peer is not None or checking():
        return False
    from .group import GroupError
    g = pg.group
    mine = fingerprint(kind, desc, nbytes, dtype, g.size, call)
    inp = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    out = torch.empty(FP_BYTES * g.size, dtype=torch.uint8)
    _state.busy = desc
    try:
        pg.all_gather_single(out, inp).wait()  # dist.all_gather_into_tensor's call (not itself checked: busy)
    finally:
        _state.busy = ""
    raw = out.numpy().tobytes()
    fps = [raw[r * FP_BYTES:(r + 1) * FP_BYTES] for r in range(g.size)]
    keys = [fp[:_FIELDS.size] for fp in fps]
    if all(k == keys[0] for k in keys):
        return True
    groups: dict[bytes, list[int]] = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    # each rank as the group names it everywhere: "rank 0 (global rank 1)" in a subgroup
    detail = "; ".join(f"{', '.join(g.who(r) for r in rs)} called {describe(fps[rs[0]])}" for rs in groups.values())
    raise GroupError(f"[{g.who(g.rank)}] Detected mismatch between collectives on ranks (group {g.name!r}, "
                     f"seq {g.issued}): {detail}. Every rank of a group must call the same collective "
                     f"with the same sizes, shapes, dtype, reduce op and root, in the same order; the collective "
                     f"was not run on any rank.")
