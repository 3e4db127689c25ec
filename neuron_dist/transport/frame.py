"""The wire frame: a fixed, validated binary header followed by raw tensor bytes.

No pickle on the data path. Every field is checked against what the receiver expects before a
byte of payload is used; a mismatch raises `FrameError` naming both sides' view of the message.
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import torch

from ..config import env_int

MAGIC = b"NDF1"
VERSION = 1

# magic, version, kind, dtype, token, group, seq, src, dst, chunk, tag, nbytes
HEADER = struct.Struct("<4sHBBQQQIIIIQ")
HEADER_SIZE = HEADER.size  # 56 bytes
MIN_FRAME_BYTES = 64  # NEURON_DIST_FRAME_BYTES floor: one cache line, room for an element of every dtype
MAX_FRAME_BYTES = 1 << 30  # a hard bound on one frame's payload, whatever a peer claims
DEFAULT_FRAME_BYTES = 512 << 10


def frame_bytes_setting() -> int:
    """NEURON_DIST_FRAME_BYTES, checked: the largest frame a step is cut into, and so the size of
    a shared-memory slot. Above MAX_FRAME_BYTES a receiver would refuse every such frame."""
    return env_int("NEURON_DIST_FRAME_BYTES", DEFAULT_FRAME_BYTES, minimum=MIN_FRAME_BYTES,
                   maximum=MAX_FRAME_BYTES)


class Kind(enum.IntEnum):
    """What a frame belongs to. Collectives share one sequence-number space per group."""
    ALLREDUCE = 1
    ALLGATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    GATHER = 6
    SCATTER = 7
    ALLTOALL = 8
    BARRIER = 9
    P2P = 10       # send/recv: seq is the message's size in bytes (messages have no sequence), tag the user's tag
    # 11: unassigned (a frame of this kind is refused like any unknown kind)
    ABORT = 12     # this rank's group failed or was aborted: payload is the cause (UTF-8); peers fail fast
    BYE = 13       # orderly close (destroy/shutdown): everything this rank had to send was sent


# dtype codes on the wire; one table both ways. The dtypes after the first twelve are moved,
# never reduced (torch has no CPU arithmetic for them): float8 for FSDP2's float8 all-gathers,
# unsigned 16-64 bit integers as Gloo's send/recv moves them. A dtype's code is its place in
# these lists whatever torch it runs on (one without the dtype leaves its code unused), and new
# names are appended, so codes never change.
_REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MOVE_ONLY_NAMES = ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                    "float8_e5m2fnuz", "float8_e8m0fnu")
MOVE_ONLY: tuple[torch.dtype, ...] = tuple(getattr(torch, n) for n in _MOVE_ONLY_NAMES if hasattr(torch, n))
DTYPES: tuple[torch.dtype, ...] = _REDUCIBLE + MOVE_ONLY
DTYPE_CODE = {d: i + 1 for i, d in enumerate(_REDUCIBLE)} | {
    getattr(torch, n): len(_REDUCIBLE) + i + 1 for i, n in enumerate(_MOVE_ONLY_NAMES) if hasattr(torch, n)}
CODE_DTYPE = {c: d for d, c in DTYPE_CODE.items()}
ITEMSIZE = {c: torch.empty(0, dtype=d).element_size() for d, c in DTYPE_CODE.items()}
MAX_ABORT_BYTES = 4096  # an abort frame's cause text, bounded whatever a peer claims


class FrameError(RuntimeError):
    """A frame that is malformed or not the one the receiver expected."""


class PeerAborted(FrameError):
    """A peer sent an ABORT frame: its copy of the group failed (the message carries its cause)."""


class Header(NamedTuple):
    """A frame header (immutable; a named tuple: built once per frame on the hot path)."""
    kind: int
    dtype: int
    token: int
    group: int
    seq: int
    src: int
    dst: int
    chunk: int
    tag: int
    nbytes: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.kind, self.dtype, self.token, self.group,
                           self.seq, self.src, self.dst, self.chunk, self.tag, self.nbytes)

    def describe(self) -> str:
        try:
            kind = Kind(self.kind).name.lower()
        except ValueError:
            kind = f"kind#{self.kind}"
        dt = CODE_DTYPE.get(self.dtype, f"dtype#{self.dtype}")
        if self.kind == Kind.P2P:  # a message's seq field holds its total size (messages have no sequence)
            return (f"p2p message of {self.seq} bytes, tag {self.tag}, from rank {self.src} (chunk {self.chunk}, "
                    f"{self.nbytes} bytes, {dt})")
        return (f"{kind} seq={self.seq} from rank {self.src} (chunk {self.chunk}, "
                f"{self.nbytes} bytes, {dt})")


def bye_header(token: int, src: int, dst: int, exiting: bool = False) -> "Header":
    """The header-only frame a transport sends each peer on an orderly close: nothing more follows.
    Its `chunk` is 1 where the close is its process's exit (`Transport.peer_exiting`)."""
    return Header(int(Kind.BYE), 0, token, 0, 0, src, dst, int(exiting), 0, 0)


# Header from a tuple of its 10 fields without NamedTuple's Python-level __new__ (~3x cheaper on
# the per-frame path); callers pass exactly the fields, in order.
make_header = tuple.__new__


def unpack(buf) -> Header:
    """Parse and sanity-check a header from untrusted bytes. Raises FrameError, never anything else."""
    try:
        mv = memoryview(buf)
        if mv.nbytes != HEADER_SIZE:
            raise FrameError(f"frame header is {mv.nbytes} bytes, expected {HEADER_SIZE}")
        fields = HEADER.unpack(mv)
    except FrameError:
        raise
    except (struct.error, TypeError, ValueError) as e:  # (odd buffer types; not whatever a signal
        raise FrameError(f"unparseable frame header: {e}") from None  # handler raises meanwhile)
    return _validated(fields)


def unpack_from(buf, offset: int = 0) -> Header:
    """`unpack` of the header at `offset` of a larger buffer (a shared-memory slot), no copy."""
    try:
        fields = HEADER.unpack_from(buf, offset)
    except (struct.error, TypeError, ValueError) as e:  # (odd buffer types; not whatever a signal
        raise FrameError(f"unparseable frame header: {e}") from None  # handler raises meanwhile)
    return _validated(fields)


def _validated(fields) -> Header:
    magic, version, kind, dtype, token, group, seq, src, dst, chunk, tag, nbytes = fields
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r}: not a neuron_dist peer")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this build speaks {VERSION}")
    if kind not in Kind._value2member_map_:
        raise FrameError(f"unknown frame kind {kind}")
    if dtype not in CODE_DTYPE and dtype != 0:
        raise FrameError(f"unknown dtype code {dtype}")
    if nbytes > MAX_FRAME_BYTES:
        raise FrameError(f"frame claims {nbytes} bytes, above the {MAX_FRAME_BYTES} limit")
    if dtype and nbytes % ITEMSIZE[dtype]:
        raise FrameError(f"frame of {CODE_DTYPE[dtype]} claims {nbytes} bytes, not a whole number of elements")
    if kind == Kind.ABORT and nbytes > MAX_ABORT_BYTES:
        raise FrameError(f"abort frame claims {nbytes} bytes, above the {MAX_ABORT_BYTES} limit")
    return make_header(Header, fields[2:])


def abort_reason(payload) -> str:
    """The cause carried by an ABORT frame's payload (untrusted bytes: bounded, decoded leniently)."""
    try:
        raw = bytes(memoryview(payload).cast("B")[:MAX_ABORT_BYTES]) if not isinstance(payload, torch.Tensor) \
            else payload[:MAX_ABORT_BYTES].contiguous().numpy().tobytes()
    except Exception as e:  # noqa: BLE001 - a hostile payload must still yield a message
        return f"<unreadable abort reason: {e}>"
    text = raw.decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "?" for ch in text)


def check(got: Header, want: Header, payload_nbytes: int) -> None:
    """Raise FrameError unless `got` is exactly the frame `want` describes."""
    if got == want and payload_nbytes == got.nbytes:  # the common case: one tuple comparison
        return
    if got.token != want.token:
        raise FrameError(f"frame from rank {got.src} carries the wrong job token; dropped")
    if payload_nbytes != got.nbytes:
        raise FrameError(f"frame from rank {got.src} announces {got.nbytes} bytes but carries {payload_nbytes}")
    if (got.kind, got.dtype, got.group, got.seq, got.src, got.dst, got.chunk, got.tag, got.nbytes) != \
            (want.kind, want.dtype, want.group, want.seq, want.src, want.dst, want.chunk, want.tag, want.nbytes):
        if got.kind == want.kind and got.kind != Kind.P2P and got.tag != want.tag:
            raise FrameError(f"rank {want.dst} and rank {got.src} called {Kind(got.kind).name.lower()} seq "
                             f"{got.seq} with different arguments (sizes, dtypes, reduce op, root or packed "
                             f"layout differ, or the algorithm each chose: NEURON_DIST_ALGO and "
                             f"NEURON_DIST_TUNING must be alike on every rank; argument checksums "
                             f"{want.tag:#x} here, {got.tag:#x} there)")
        raise FrameError(f"rank {want.dst} expected {want.describe()} but received {got.describe()}")
