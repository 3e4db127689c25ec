"""Runs one rank's Schedule over a Transport, as a non-blocking state machine.

`progress()` does whatever can be done now and returns whether anything moved, so one engine
thread can drive a collective and several point-to-point transfers at once and wait on the
transport only when nothing moves. Large steps are cut into frames so the receiver reduces one
frame while the next is in flight.

Frames are matched per peer in order; each carries the collective's (kind, dtype, seq) and a
per-peer frame counter, and `frame.check` rejects anything else with an error naming both sides.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..transport.frame import DTYPE_CODE, FrameError, Header, Kind, PeerAborted, abort_reason, check
from .reduce_ops import Reducer
from .schedule import LOCAL_STEPS, Chunk, Copy, LocalReduce, Recv, Schedule, Send

FRAME_BYTES = 512 << 10


@dataclass(frozen=True)
class Stamp:
    """What every frame of one operation carries."""
    kind: Kind
    dtype: torch.dtype
    token: int
    group: int
    seq: int
    tag: int = 0

    def header(self, src: int, dst: int, chunk: int, nbytes: int) -> Header:
        return Header(int(self.kind), DTYPE_CODE[self.dtype], self.token, self.group, self.seq,
                      src, dst, chunk, self.tag, nbytes)


class Mailbox:
    """Per-group demultiplexer in front of the transport: hands each operation only its own
    frames and keeps frames that arrive early (a peer already on the next collective, or a
    point-to-point message nobody asked for yet), copied out of transport buffers."""

    def __init__(self, transport, rank: int):
        self.transport, self.rank = transport, rank
        self.early: dict[tuple[int, tuple], deque] = {}

    @staticmethod
    def key(h: Header) -> tuple:
        return ("p2p", h.tag) if h.kind == Kind.P2P else ("coll", h.seq)

    def take(self, peer: int, key: tuple, current_seq: int | None = None):
        """(header, payload, owned) of the next frame from `peer` for `key`, or None."""
        q = self.early.get((peer, key))
        if q:
            h, p = q.popleft()
            return h, p, True
        while True:
            got = self.transport.recv(peer)
            if got is None:
                return None
            h, payload = got
            if h.kind == Kind.ABORT:  # the peer's group failed: fail here too, with its cause
                reason = abort_reason(payload)
                self.transport.release(peer)
                raise PeerAborted(f"rank {peer} aborted the group: {reason}")
            k = self.key(h)
            if k == key:
                return h, payload, False
            if k[0] == "coll" and current_seq is not None and h.seq < current_seq:
                self.transport.release(peer)
                raise FrameError(f"rank {self.rank} received a frame of an already finished "
                                 f"collective: {h.describe()}; collectives were called in a "
                                 f"different order or with different sizes across ranks")
            self.early.setdefault((peer, k), deque()).append((h, payload.clone()))
            self.transport.release(peer)


class Execution:
    """One schedule in flight. Raises from progress() on any protocol error."""

    def __init__(self, schedule: Schedule, bufs: list[torch.Tensor], reduce: Reducer | None,
                 stamp: Stamp, rank: int, mailbox: Mailbox, frame_bytes: int = FRAME_BYTES):
        empty = torch.empty(0, dtype=stamp.dtype)
        bufs = [empty if b is None else b for b in bufs]
        self.rounds, self.bufs, self.reduce = schedule.rounds, bufs, reduce
        self.stamp, self.rank, self.mailbox = stamp, rank, mailbox
        self.transport = mailbox.transport
        self.itemsize = torch.empty(0, dtype=stamp.dtype).element_size()
        self.frame_elems = max(1, frame_bytes // self.itemsize)
        self.bytes = [b.view(torch.uint8) if b is not None and b.numel() else None for b in bufs]
        self.sent_chunks: dict[int, int] = {}
        self.recv_chunks: dict[int, int] = {}
        self.round = -1
        self.sends: dict[int, deque] = {}
        self.recvs: dict[int, deque] = {}
        self.round_had_sends = False
        self.done = False
        self.waiting_on: int | None = None
        self._next_round()

    # -- helpers ---------------------------------------------------------------------------
    def _view(self, c: Chunk) -> torch.Tensor:
        return self.bufs[c.buf][c.start:c.start + c.count]

    def _frames(self, count: int):
        """Frame boundaries (offset, n) of a step of `count` elements; one empty frame for 0."""
        if count == 0:
            return [(0, 0)]
        f = self.frame_elems
        return [(o, min(f, count - o)) for o in range(0, count, f)]

    def _next_round(self) -> None:
        while True:
            if self.round_had_sends:
                self.transport.flush(60.0)
                self.round_had_sends = False
            self.round += 1
            if self.round >= len(self.rounds):
                self.done = True
                return
            steps = self.rounds[self.round]
            for s in steps:
                if isinstance(s, Copy):
                    self._view(s.dst).copy_(self._view(s.src))
                elif isinstance(s, LocalReduce):
                    d = self._view(s.dst)
                    self.reduce(d, d, self._view(s.src))
            self.sends, self.recvs = {}, {}
            for s in steps:
                if isinstance(s, Send):
                    q = self.sends.setdefault(s.peer, deque())
                    for off, n in self._frames(s.src.count):
                        a = (s.src.start + off) * self.itemsize
                        q.append((self.bytes[s.src.buf], a, n * self.itemsize))
                    self.round_had_sends = True
                elif isinstance(s, Recv):
                    q = self.recvs.setdefault(s.peer, deque())
                    for off, n in self._frames(s.dst.count):
                        q.append((s, off, n))
            if self.sends or self.recvs:
                return

    # -- progress --------------------------------------------------------------------------
    def progress(self) -> bool:
        moved = False
        while not self.done:
            step_moved = self._progress_sends() | self._progress_recvs()
            moved |= step_moved
            if self.sends or self.recvs:
                return moved
            self._next_round()
        return moved

    def _progress_sends(self) -> bool:
        moved = False
        for peer in list(self.sends):
            q = self.sends[peer]
            while q:
                buf, a, nb = q[0]
                payload = buf[a:a + nb] if nb else _EMPTY
                chunk = self.sent_chunks.get(peer, 0)
                if not self.transport.send(peer, self.stamp.header(self.rank, peer, chunk, nb), payload):
                    break
                self.sent_chunks[peer] = chunk + 1
                q.popleft()
                moved = True
            if not q:
                del self.sends[peer]
        return moved

    def _progress_recvs(self) -> bool:
        moved = False
        key = ("p2p", self.stamp.tag) if self.stamp.kind == Kind.P2P else ("coll", self.stamp.seq)
        cur = None if self.stamp.kind == Kind.P2P else self.stamp.seq
        for peer in list(self.recvs):
            q = self.recvs[peer]
            while q:
                got = self.mailbox.take(peer, key, cur)
                if got is None:
                    self.waiting_on = peer
                    break
                h, payload, owned = got
                step, off, n = q[0]
                chunk = self.recv_chunks.get(peer, 0)
                try:
                    check(h, self.stamp.header(peer, self.rank, chunk, n * self.itemsize), payload.numel())
                    self._deliver(step, off, n, payload)
                finally:
                    if not owned:
                        self.transport.release(peer)
                self.recv_chunks[peer] = chunk + 1
                q.popleft()
                moved = True
            if not q:
                del self.recvs[peer]
        return moved

    def _deliver(self, step: Recv, off: int, n: int, payload: torch.Tensor) -> None:
        if n == 0:
            return
        incoming = payload.view(self.stamp.dtype)
        d = step.dst
        dst = self.bufs[d.buf][d.start + off:d.start + off + n]
        if step.reduce:
            base = dst if step.base is None else self.bufs[step.base.buf][step.base.start + off:step.base.start + off + n]
            self.reduce(dst, base, incoming)
        else:
            dst.copy_(incoming)


_EMPTY = torch.empty(0, dtype=torch.uint8)


def describe_kind(kind: Kind) -> str:
    return kind.name.lower()


__all__ = ["Execution", "Mailbox", "Stamp", "FrameError", "LOCAL_STEPS"]
