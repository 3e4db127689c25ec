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
from typing import NamedTuple

import torch

from ..transport.bytecopy import copy_into
from ..transport.cma import Lent
from ..transport.frame import DEFAULT_FRAME_BYTES as FRAME_BYTES
from ..transport.frame import DTYPE_CODE, FrameError, Header, Kind, PeerAborted, abort_reason, check, make_header
from .reduce_ops import Reducer
from .schedule import LOCAL_STEPS, TMP, Chunk, Copy, LocalReduce, Recv, Schedule, Send


class Stamp:
    """What every frame of one operation carries (fixed at creation; the wire codes of kind and
    dtype are computed once, not per frame)."""
    __slots__ = ("kind", "dtype", "token", "group", "seq", "tag", "_kind", "_dtype")

    def __init__(self, kind: Kind, dtype: torch.dtype, token: int, group: int, seq: int, tag: int = 0):
        self.kind, self.dtype, self.token, self.group, self.seq, self.tag = kind, dtype, token, group, seq, tag
        self._kind, self._dtype = int(kind), DTYPE_CODE[dtype]

    def header(self, src: int, dst: int, chunk: int, nbytes: int) -> Header:
        return make_header(Header, (self._kind, self._dtype, self.token, self.group, self.seq, src, dst, chunk,
                                     self.tag, nbytes))

    def __repr__(self) -> str:
        return (f"Stamp(kind={self.kind!r}, dtype={self.dtype}, token={self.token}, group={self.group}, "
                f"seq={self.seq}, tag={self.tag})")


class Mailbox:
    """Per-group demultiplexer in front of the transport: hands each operation only its own
    frames and keeps frames that arrive early (a peer already on the next collective, or a
    point-to-point message nobody asked for yet), copied out of transport buffers. `who`: a
    member as errors name it (`Group.who`: "rank 1 (global rank 2)" in a subgroup)."""

    def __init__(self, transport, rank: int, who=lambda r: f"rank {r}"):
        self.transport, self.rank, self.who = transport, rank, who
        self.early: dict[tuple[int, tuple], deque] = {}
        # peer -> (key, header, payload): a frame looked at and put back, still in the transport
        # (at most one per peer: the transport hands out the next frame only after a release)
        self.held: dict[int, tuple] = {}
        self._parts: dict[torch.dtype, torch.Tensor] = {}  # see part_buffer
        # frames set aside in `early` so far: one taken by another op than its own used up the
        # doorbell's news, so the engine counts it as progress and looks again (Group._drive_ops)
        self.set_aside = 0

    def part_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer a reducing receive reads a lent frame into, part by part (Execution
        ._reduce_lent): LENT_PART_BYTES, made on first use, one per group and dtype (ops of a
        group run on one thread at a time, under its drive lock), small enough that each part
        is still in cache when the reduction reads it."""
        b = self._parts.get(dtype)
        if b is None:
            b = self._parts[dtype] = torch.empty(max(1, LENT_PART_BYTES // dtype.itemsize), dtype=dtype)
        return b

    def clear(self) -> None:
        """Drop every frame and buffer kept, at the group's close: the process group object may
        outlive it (a caller's reference), and a lent frame put back (`held`) keeps a view of
        its sender's segment, which would stop the transport from unmapping it."""
        self.early, self.held, self._parts = {}, {}, {}

    @staticmethod
    def key(h: Header) -> tuple:
        return ("p2p", h.tag) if h.kind == Kind.P2P else ("coll", h.seq)

    def take(self, peer: int, key: tuple, current_seq: int | None = None):
        """(header, payload, owned) of the next frame from `peer` for `key`, or None."""
        if self.early:  # (empty on the common path: skip building the key)
            q = self.early.get((peer, key))
            if q:
                h, p = q.popleft()
                if not q:  # drained: drop the key (one per early sequence number would pile up)
                    del self.early[(peer, key)]
                return h, p, True
        if self.held:
            held = self.held.pop(peer, None)
            if held is not None:
                k, h, p = held
                if k == key:
                    return h, p, False
                self._set_aside(peer, k, h, p)
        while True:
            got = self.transport.recv(peer)
            if got is None:
                return None
            h, payload = got
            if h.kind == Kind.ABORT:  # the peer's group failed: fail here too, with its cause
                reason = abort_reason(payload)
                self.transport.release(peer)
                raise PeerAborted(f"{self.who(peer)} aborted the group: {reason}")
            k = self.key(h)
            if k == key:
                return h, payload, False
            if k[0] == "coll" and current_seq is not None and h.seq < current_seq:
                self.transport.release(peer)
                raise FrameError(f"rank {self.rank} received a frame of an already finished "
                                 f"collective: {h.describe()}; collectives were called in a "
                                 f"different order or with different sizes across ranks")
            self._set_aside(peer, k, h, payload)

    def _set_aside(self, peer: int, key: tuple, header: Header, payload) -> None:
        """Keep a frame `take` read for another op (`key`'s) in `early`, copied out of the
        transport's buffer, which goes back to the peer, and count it (`set_aside`)."""
        self.early.setdefault((peer, key), deque()).append((header, payload.clone()))
        self.set_aside += 1
        self.transport.release(peer)

    def put_back(self, peer: int, key: tuple, header: Header, payload, owned: bool) -> None:
        """Return a frame `take` handed out so that the next `take(peer, key)` gets it again (a
        receive looks at a message's first frame to learn its size and, from any source, its
        sender). A frame still in the transport stays there, uncopied, until taken again."""
        if owned:
            self.early.setdefault((peer, key), deque()).appendleft((header, payload))
        else:
            self.held[peer] = (key, header, payload)


def frame_plan(schedule: Schedule, itemsize: int, frame_elems: int, lend: tuple = (0, 0, 0, 0),
               marked_only: bool = False) -> tuple:
    """The schedule cut into frames, once per (schedule, itemsize, frame size, lending): per round,
    (local steps as (is_copy, src, dst, src_first), sends as ((peer, ((buf, element offset,
    elements, bytes, lent), ...)), ...), receives as ((peer, ((step, element offset, elements),
    ...)), ...)).

    `lend` = (elements per lent frame, bytes from which a step is lent, bytes from which a frame
    of such a step is lent, bytes from which a step that its receiver reduces is lent): a step
    of at least the second (the fourth if reduced) is cut into lent-size frames, and those of at
    least the third are lent (a shorter tail is copied: it fits a slot); smaller steps are cut
    at `frame_elems` and copied. `marked_only`: only steps marked `lend` (a collective whose
    other steps reduce); otherwise every step. A step's sender and receiver move the same
    number of elements and carry the same marks (Send.reduced, Recv.reduce), so both cut it
    alike."""
    key = (itemsize, frame_elems, lend, marked_only)
    plan = schedule.plans.get(key)
    if plan is not None:
        return plan
    lend_elems, lend_from, lend_min, lend_reduce_from = lend

    def frames(count, marked, reduced=False):  # (offset, n, lent) of `count` elements; one empty frame for 0
        if count == 0:
            return [(0, 0, False)]
        if lend_elems and (marked or not marked_only) and \
                count * itemsize >= (lend_reduce_from if reduced else lend_from):
            return [(o, min(lend_elems, count - o), min(lend_elems, count - o) * itemsize >= lend_min)
                    for o in range(0, count, lend_elems)]
        return [(o, min(frame_elems, count - o), False) for o in range(0, count, frame_elems)]

    rounds, reduce_lent, late = [], False, {}
    for i, steps in enumerate(schedule.rounds):
        local = tuple((isinstance(s, Copy), s.src, s.dst, isinstance(s, LocalReduce) and s.src_first)
                      for s in steps if isinstance(s, (Copy, LocalReduce)) and not (type(s) is Copy and s.late))
        if any(type(s) is Copy and s.late for s in steps):
            late[i] = tuple((True, s.src, s.dst, False) for s in steps if type(s) is Copy and s.late)
        sends: dict[int, list] = {}
        recvs: dict[int, list] = {}
        for s in steps:
            if isinstance(s, Send):
                sends.setdefault(s.peer, []).extend(
                    (s.src.buf, s.src.start + off, n, n * itemsize, lent)
                    for off, n, lent in frames(s.src.count, s.lend, s.reduced))
            elif isinstance(s, Recv):
                cut = frames(s.dst.count, s.lend, s.reduce)
                recvs.setdefault(s.peer, []).extend((s, off, n) for off, n, _ in cut)
                reduce_lent |= s.reduce and any(lent for *_, lent in cut)
        rounds.append((local, tuple((p, tuple(q)) for p, q in sends.items()),
                       tuple((p, tuple(q)) for p, q in recvs.items())))
    plan = Plan(rounds)
    plan.lends = any(lent for _, sends, _ in rounds for _, q in sends for *_, lent in q)
    plan.late = late
    plan.frames = sum(len(q) for _, sends, recvs in rounds for _, q in sends + recvs)
    if not reduce_lent and not schedule.tmp_count and not late:
        plan.pair = pair_shape(rounds)
    if plan.frames <= MAX_KEPT_FRAMES:
        schedule.plans[key] = plan
    return plan


class Plan(tuple):
    """frame_plan's rounds; `lends`: whether any frame of them is lent (a plan that lends
    none runs without the per-round in-place check); `pair`: the PairShape that PairExchange
    runs in place of an Execution, or None; `late`: the late copies (Copy.late) of the rounds
    that have them, by round, in run_local's form; `frames`: how many frames it sends and
    receives."""
    lends = False
    pair = None
    late: dict = {}
    frames = 0


# A frame plan of more frames than this is cut again for each call instead of kept with its
# schedule: kept, its ~60-145 bytes a frame stayed as long as the group's plan of that call form
# (up to 1,024 of them, 0.34 MB each for 4 MB all-reduces at 4 KiB frames), and cutting costs
# ~0.4 us a frame, a small part of moving one (a frame is up to NEURON_DIST_FRAME_BYTES)
MAX_KEPT_FRAMES = 128


def execution_plan(schedule: Schedule, stamp: "Stamp", transport, frame_bytes: int) -> Plan:
    """The frame plan an Execution of `schedule` runs over `transport` (frame_plan, with the
    lending this call's kind and size allow; see transport/cma.py): large steps are cut into
    large frames the peer reads from this process, the rest is copied through the transport.
    Lent are every step of a collective that only moves data, and of a point-to-point message
    larger than what the ring holds (it already waits for its receiver, so lending it changes
    nothing a caller sees; the size rule is one both ends know); elsewhere the steps the
    schedule marks (e.g. the all-gather half of a ring all-reduce)."""
    itemsize = stamp.dtype.itemsize
    lend, marked_only = (0, 0, 0, 0), False
    lend_bytes = getattr(transport, "lend_bytes", 0)  # (duck-typed transports: none)
    if lend_bytes:
        every = stamp._kind in _LENDABLE or stamp._kind == _P2P and p2p_lent(transport, stamp.seq)
        if every or schedule.lends:
            lend = (max(1, lend_bytes // itemsize), transport.lend_from, transport.lend_min,
                    transport.lend_reduce_from)
            marked_only = not every
    return frame_plan(schedule, itemsize, max(1, frame_bytes // itemsize), lend, marked_only)


_P2P = int(Kind.P2P)
# collectives whose receives only copy: their frames may be lent (transport.lend_bytes), every
# rank then cutting them at that size (the kind, unlike one rank's schedule, is the same on all);
# point-to-point messages larger than the transport's eager_bytes; and in other collectives the
# steps whose Send and Recv are both marked `lend` (a step's two ends carry the same mark)
_LENDABLE = frozenset(int(k) for k in (Kind.ALLGATHER, Kind.BROADCAST, Kind.GATHER, Kind.SCATTER, Kind.ALLTOALL))
_EMPTIES = {d: torch.empty(0, dtype=d) for d in DTYPE_CODE}


def _with_empties(bufs: list, dtype: torch.dtype) -> list:
    """`bufs` with each absent buffer (an empty step may name one) an empty tensor of `dtype`."""
    empty = _EMPTIES.get(dtype)
    if empty is None:
        empty = torch.empty(0, dtype=dtype)
    return [empty if b is None else b for b in bufs]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two flat (contiguous) tensors intersect: an output that shares
    memory with its input (in-place forms) must not be written while the input is still read."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def p2p_lent(transport, nbytes: int) -> bool:
    """Whether a point-to-point message of `nbytes` is lent rather than copied: on a transport
    that lends, one larger than what its ring holds (the sender waits for its receiver anyway).
    Both ends know the size, so both cut the message alike (Execution; SingleFrameSend's choice)."""
    return bool(getattr(transport, "lend_bytes", 0)) and nbytes > transport.eager_bytes


def shorter_message(h: Header, want_bytes: int, dtype_code: int, itemsize: int) -> bool:
    """Whether frame `h` starts a point-to-point message shorter than the `want_bytes` a receive
    expects, in the receive's dtype and whole elements: one that fills the buffer's front
    (Execution's `shorter` path; SingleFrameRecv). Any other size mismatch fails the frame check."""
    return h.seq < want_bytes and h.dtype == dtype_code and h.seq % itemsize == 0


def one_copied_frame(transport, frame_bytes: int, count: int, itemsize: int) -> bool:
    """Whether an Execution sends a point-to-point message of `count` elements as one copied
    frame (at most a frame's elements, not lent): the messages SingleFrameSend sends, and the
    buffers SingleFrameRecv receives into."""
    return 0 < count <= max(1, frame_bytes // itemsize) and not p2p_lent(transport, count * itemsize)


def run_local(local: tuple, view, reduce: Reducer | None) -> None:
    """A round's local steps, as frame_plan lists them: (is_copy, src, dst, src_first) with
    `view` cutting a Chunk's tensor."""
    for is_copy, src, dst, src_first in local:
        d = view(dst)
        if is_copy:
            s = view(src)
            if s.data_ptr() != d.data_ptr():  # an in-place call (FSDP2's all-gather input
                copy_into(d, s)               # is its block of the output): nothing to copy
        elif src_first:
            reduce(d, view(src), d)
        else:
            reduce(d, d, view(src))


class Execution:
    """One schedule in flight. Raises from progress() on any protocol error."""

    __slots__ = ("bufs", "reduce", "stamp", "rank", "mailbox", "transport", "itemsize", "rounds",
                 "_tviews", "sent_chunks", "recv_chunks", "round", "sends", "recvs", "round_had_sends", "done",
                 "waiting_on", "_key", "_cur", "shorter_ok", "shorter", "lending", "_lend_safe", "_lent", "_late")

    def __init__(self, schedule: Schedule, bufs: list[torch.Tensor], reduce: Reducer | None,
                 stamp: Stamp, rank: int, mailbox: Mailbox, frame_bytes: int = FRAME_BYTES,
                 tmp_views: dict | None = None, plan: Plan | None = None):
        """`tmp_views`: where to keep the views cut from TMP, when the caller keeps TMP itself
        across calls (a collective's plan, plans.py, keeps its small scratch buffer, and its views
        with it: slicing costs ~1 us a view). `plan`: execution_plan's answer for these arguments,
        when the caller has it already."""
        dtype = stamp.dtype
        if bufs[0] is None or bufs[1] is None or bufs[2] is None:  # (not `None in bufs`: that calls Tensor.__eq__)
            bufs = _with_empties(bufs, dtype)
        self.bufs, self.reduce = bufs, reduce
        self.stamp, self.rank, self.mailbox = stamp, rank, mailbox
        self.transport = mailbox.transport
        self.itemsize = dtype.itemsize
        if plan is None:
            plan = execution_plan(schedule, stamp, self.transport, frame_bytes)
        self.rounds = plan
        self.lending = plan.lends
        self._lend_safe = True
        self._lent: list = []  # (peer, ticket) of the frames this op lent and has yet to see released
        self._late = None  # the round's late copies, run once its sends are under way (progress)
        self._tviews = tmp_views
        self.sent_chunks: dict[int, int] = {}
        self.recv_chunks: dict[int, int] = {}
        self.round = -1
        self.sends: dict[int, deque] = {}
        self.recvs: dict[int, deque] = {}
        self.round_had_sends = False
        self.done = False
        self.waiting_on: int | None = None
        # a receive that accepts a shorter message (p2p.Receive): its first frame, if it says the
        # message is shorter than the buffer, is put back and its size noted in `shorter`
        self.shorter_ok, self.shorter = False, None
        if stamp._kind == _P2P:
            self._key, self._cur = ("p2p", stamp.tag), None
        else:
            self._key, self._cur = ("coll", stamp.seq), stamp.seq
        self._next_round()

    # -- helpers ---------------------------------------------------------------------------
    def _view(self, c: Chunk) -> torch.Tensor:
        b = self.bufs[c.buf]
        if c.start == 0 and c.count == b.numel():  # the whole buffer: no slicing (about 1 us each)
            return b
        if c.buf == TMP and self._tviews is not None:  # a kept scratch buffer: its views are kept too
            key = (c.start, c.count)
            v = self._tviews.get(key)
            if v is None:
                v = self._tviews[key] = b[c.start:c.start + c.count]
            return v
        return b[c.start:c.start + c.count]

    def _next_round(self) -> bool:
        """Start the next round with work in it; False while a send of the last round still reads
        its buffers (the transport names the peer: the stall check then watches it)."""
        view = self._view
        while True:
            if self.round_had_sends:
                if self._lent:  # frames this op lent: read and released by their peers?
                    for peer, ticket in self._lent:
                        if not self.transport.released(peer, ticket):
                            self.waiting_on = peer
                            return False
                    self._lent.clear()
                peer = self.transport.unflushed()
                if peer is not None:
                    self.waiting_on = peer
                    return False
                self.round_had_sends = False
            self.round += 1
            if self.round >= len(self.rounds):
                self.done = True
                return True
            local, sends, recvs = self.rounds[self.round]
            if local:
                run_local(local, view, self.reduce)
            if self.rounds.late:
                self._late = self.rounds.late.get(self.round)
                if self._late and not sends:  # (nothing under way to overlap)
                    run_local(self._late, view, self.reduce)
                    self._late = None
            self.sends = {p: deque(q) for p, q in sends} if sends else {}
            self.recvs = {p: deque(q) for p, q in recvs} if recvs else {}
            if self.lending:
                self._lend_safe = not (sends and recvs and self._overlap(sends, recvs))
            if sends:
                self.round_had_sends = True
            if sends or recvs:
                return True

    def _overlap(self, sends, recvs) -> bool:
        """Whether a receive of this round writes where a send of it reads (an in-place call):
        a lent frame must stay unchanged until its reader is done, so such a round lends copies."""
        isz, bufs = self.itemsize, self.bufs
        out = [(bufs[b].data_ptr() + a * isz, nb) for _, q in sends for b, a, _, nb, lent in q if lent]
        for _, q in recvs:
            for step, off, n in q:
                d = step.dst
                lo = bufs[d.buf].data_ptr() + (d.start + off) * isz
                hi = lo + n * isz
                if any(lo < s + nb and s < hi for s, nb in out):
                    return True
        return False

    # -- progress --------------------------------------------------------------------------
    def progress(self) -> bool:
        # who this pass waits on, not who an earlier round waited on: a peer whose frames have
        # all arrived may close in order while this rank still sends to others, and a stale
        # mark would have the stall check blame it
        self.waiting_on = None
        moved = False
        while not self.done:
            if self.sends:
                moved |= self._progress_sends()
            if self._late:  # (the round's sends are under way)
                late, self._late = self._late, None
                run_local(late, self._view, self.reduce)
                moved = True
            if self.recvs:
                moved |= self._progress_recvs()
            if self.sends or self.recvs or not self._next_round():
                return moved
        return moved

    def _progress_sends(self) -> bool:
        moved = False
        for peer in list(self.sends):
            q = self.sends[peer]
            while q:
                b, a, n, nb, lent = q[0]
                if nb:  # the frame's slice of the buffer, in its own dtype (transports move bytes)
                    t = self.bufs[b]
                    payload = t if a == 0 and n == t.numel() else t[a:a + n]
                else:
                    payload = _EMPTY
                chunk = self.sent_chunks.get(peer, 0)
                header = self.stamp.header(self.rank, peer, chunk, nb)
                if lent:
                    ok = self.transport.lend(peer, header, payload if self._lend_safe else payload.clone())
                    if ok:
                        self._lent.append((peer, ok))
                else:
                    ok = self.transport.send(peer, header, payload)
                if not ok:
                    break
                self.sent_chunks[peer] = chunk + 1
                q.popleft()
                moved = True
            if not q:
                del self.sends[peer]
        return moved

    def _progress_recvs(self) -> bool:
        moved = False
        key, cur = self._key, self._cur
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
                if self.shorter_ok and not chunk and \
                        shorter_message(h, self.stamp.seq, self.stamp._dtype, self.itemsize):
                    self.mailbox.put_back(peer, key, h, payload, owned)  # for the receive of its size
                    self.shorter = h.seq
                    return moved
                try:
                    check(h, self.stamp.header(peer, self.rank, chunk, n * self.itemsize), payload.nbytes)
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
        d = step.dst
        dst = self._view(d) if off == 0 and n == d.count else self.bufs[d.buf][d.start + off:d.start + off + n]
        lent = type(payload) is Lent  # the sender's own bytes, read straight into place
        if not lent and payload.dtype is not self.stamp.dtype:
            payload = payload.view(self.stamp.dtype)
        if not step.reduce:
            if lent:
                payload.read_into(dst)
            else:
                copy_into(dst, payload)
            return
        b = step.base
        base = dst if b is None else self.bufs[b.buf][b.start + off:b.start + off + n]
        if lent:
            self._reduce_lent(step, dst, base, payload)
        else:
            self._reduce(step, dst, base, payload)

    def _reduce(self, step: Recv, dst: torch.Tensor, base: torch.Tensor, incoming: torch.Tensor) -> None:
        if step.incoming_first:  # operand order: see schedule.py
            self.reduce(dst, incoming, base)
        else:
            self.reduce(dst, base, incoming)

    def _reduce_lent(self, step: Recv, dst: torch.Tensor, base: torch.Tensor, lent: Lent) -> None:
        """A reducing receive of a lent frame: read it into the group's part buffer one part at
        a time and reduce each part while it is in cache (a whole-frame copy would be written to
        memory and read back)."""
        part = self.mailbox.part_buffer(self.stamp.dtype)
        m, n, isz = part.numel(), dst.numel(), self.itemsize
        for o in range(0, n, m):
            k = min(m, n - o)
            p = part if k == m else part[:k]
            lent.read_part(p, o * isz)
            self._reduce(step, dst[o:o + k], base[o:o + k], p)


LENT_PART_BYTES = 256 << 10  # 64 KiB and 1 MiB parts were slower at a 16 MiB reduce-scatter (L2: 2 MiB+)
_EMPTY = torch.empty(0, dtype=torch.uint8)


class PairShape(NamedTuple):
    """What PairExchange runs: a round's local steps (frame_plan's), then at most one frame
    sent to `peer` (buffer, element offset, elements, bytes) and at most one received from it
    (its Recv step, the frame covering the whole step); `split`: the send is a round of its own
    before the receive's (the receive overwrites what the send reads); `lent`: the frame sent
    is lent (transport/cma.py: the peer reads it from this process), not copied."""
    peer: int
    local: tuple
    send: tuple | None
    recv: Recv | None
    split: bool
    lent: bool = False


def pair_shape(rounds: tuple) -> PairShape | None:
    """The PairShape of a frame plan without scratch or a lent frame its receiver reduces, or
    None. Two shapes, by what the frames are, whoever built the schedule: one round of local
    steps and at most one frame each way with one peer (at two ranks the all-gather,
    reduce-scatter, all-to-all and barrier; at any size a direct broadcast's or a scatter's
    non-root), or a round sending one frame and a round receiving one from the same peer (at
    two ranks the all-reduce within a frame, direct's eager form, and the broadcast's root,
    whose second round is its peer's empty confirmation). Either frame may be lent (the
    all-gather's, all-to-all's and broadcast's blocks from the transport's lending size up to
    one lent frame)."""
    if len(rounds) == 1:
        (local, sends, recvs), split = rounds[0], False
    elif len(rounds) == 2 and not rounds[0][0] and not rounds[0][2] and not rounds[1][0] and not rounds[1][1]:
        local, sends, recvs, split = (), rounds[0][1], rounds[1][2], True
        if not sends or not recvs:
            return None
    else:
        return None
    if len(sends) > 1 or len(recvs) > 1 or not (sends or recvs):
        return None
    send = recv = None
    lent = False
    if sends:
        peer, q = sends[0]
        if len(q) != 1:
            return None
        send, lent = q[0][:4], q[0][4]
    if recvs:
        (rpeer, q), peer = recvs[0], (peer if sends else recvs[0][0])
        if len(q) != 1 or rpeer != peer:
            return None
        recv = q[0][0]
    return PairShape(peer, local, send, recv, split, lent)


def _cut(bufs: list, b: int, start: int, count: int) -> torch.Tensor:
    """Buffer `b`'s elements start..start+count (the whole buffer unsliced: slicing costs ~1 us)."""
    t = bufs[b]
    return t if start == 0 and count == t.numel() else t[start:start + count]


class PairExchange:
    """A frame plan of `pair_shape`'s shape, run without an Execution: the small collectives
    at two ranks (and the non-root ends of rooted ones at any size).

    An Execution's set-up (per-round dicts and queues) and its walk through the rounds cost a
    4 KiB all-reduce at two ranks a fifth of its time (RESULTS.md "Thirty-fourth pass"), as
    they did the small send (SingleFrameSend). This moves the same frames (chunk 0 each way,
    copied through the transport) in the Execution's order: the local steps; the send; for a
    split shape, the wait until the transport no longer refers to what was sent (the
    Execution's wait before its second round, which overwrites it); the peer's frame, checked
    against the header the Execution would expect and copied or reduced into place with the
    same operand order (`Recv.incoming_first`: at two ranks the all-reduce puts rank 0's vector
    first on both, so both compute the same bits); for one round, the same wait at the end.
    A lent frame goes as the Execution lends it: a copy where the receive writes what it
    reads (an in-place call), and the wait covers its release by the peer (the ticket); a
    lent frame received is read straight into place."""
    __slots__ = ("transport", "mailbox", "peer", "payload", "header", "want", "dst", "base", "incoming_first",
                 "reduce", "dtype", "key", "seq", "split", "sends", "done", "waiting_on", "lent", "ticket")

    def __init__(self, shape: PairShape, bufs: list, reduce: Reducer | None, stamp: Stamp, rank: int,
                 mailbox: Mailbox):
        self.mailbox, self.transport, self.peer, self.reduce = mailbox, mailbox.transport, shape.peer, reduce
        self.dtype = dtype = stamp.dtype
        self.split = shape.split
        self.key, self.seq = ("coll", stamp.seq), stamp.seq
        peer, local, send, step, _, self.lent = shape
        self.ticket = 0
        if bufs[0] is None or bufs[1] is None:  # (an empty step may name an absent buffer; no scratch here)
            bufs = _with_empties(bufs, dtype)
        if local:
            run_local(local, lambda c: _cut(bufs, c.buf, c.start, c.count), reduce)
        self.sends, self.header = {}, None
        if send is not None:
            b, a, n, nb = send
            self.payload = _cut(bufs, b, a, n) if nb else _EMPTY
            self.header = stamp.header(rank, peer, 0, nb)
            self.sends = {peer: None}  # what the stall check reads: the peer still owed a frame
        self.want = self.dst = self.base = None
        if step is not None:
            d = step.dst
            self.want = stamp.header(peer, rank, 0, d.count * dtype.itemsize)
            if d.count:
                self.dst = _cut(bufs, d.buf, d.start, d.count)
                if step.reduce:
                    b = step.base
                    self.base = self.dst if b is None else _cut(bufs, b.buf, b.start, b.count)
                self.incoming_first = step.incoming_first
        if self.lent and self.dst is not None and not self.split and overlaps(self.payload, self.dst):
            self.payload = self.payload.clone()  # the peer reads it while the receive writes here
        self.done = False
        self.waiting_on: int | None = None

    def progress(self) -> bool:
        self.waiting_on = None
        moved = False
        if self.sends:
            if self.lent:
                self.ticket = self.transport.lend(self.peer, self.header, self.payload)
                sent = self.ticket != 0
            else:
                sent = self.transport.send(self.peer, self.header, self.payload)
            if sent:
                self.sends, moved = {}, True
            elif self.split or self.want is None:
                return False  # a full ring: the engine waits, watching the peer
        if self.split:
            if self.sends or not self._flushed():
                return moved
        if self.want is not None:
            got = self.mailbox.take(self.peer, self.key, self.seq)
            if got is None:
                self.waiting_on = self.peer
                return moved
            self._deliver(*got)
            self.want, moved = None, True
        if self.sends or (self.header is not None and not self.split and not self._flushed()):
            return moved
        self.done = True
        return True

    def _flushed(self) -> bool:
        """Whether the transport no longer refers to what was sent, nor the peer to what was
        lent (else wait on the peer)."""
        if self.ticket:
            if not self.transport.released(self.peer, self.ticket):
                self.waiting_on = self.peer
                return False
            self.ticket = 0
        waiting = self.transport.unflushed()
        if waiting is not None:
            self.waiting_on = waiting
            return False
        return True

    def _deliver(self, h: Header, payload, owned: bool) -> None:
        try:
            check(h, self.want, payload.nbytes)
            dst = self.dst
            if dst is not None:
                if type(payload) is Lent:  # the sender's own bytes: read straight into place
                    if self.base is None:
                        payload.read_into(dst)
                        return
                    payload = payload.clone()  # (the plan lends no frame its receiver reduces)
                if payload.dtype is not self.dtype:
                    payload = payload.view(self.dtype)
                base = self.base
                if base is None:
                    copy_into(dst, payload)
                elif self.incoming_first:  # operand order: see schedule.py
                    self.reduce(dst, payload, base)
                else:
                    self.reduce(dst, base, payload)
        finally:
            if not owned:
                self.transport.release(self.peer)


class SingleFrameSend:
    """A point-to-point message that fits one copied frame, sent without an Execution.

    An Execution's set-up (frame plan, rounds, per-peer queues) and its walk through them cost a
    small send a quarter of its time (about 20 us of 80 on the hosts measured; RESULTS.md
    "Twenty-ninth pass"). The frame is the one an Execution of the send's schedule would send:
    chunk 0, the caller's header (fixed per peer, size, dtype and tag, so kept with the plan),
    the tensor's bytes copied into the transport; then, like the Execution's last round, it
    waits until the transport no longer refers to the tensor (`unflushed`). A pass that only
    finds the transport still reading reports no progress, as the Execution's does: the engine
    then runs its stall check (the time-out, the peer's liveness) and sleeps in the transport's
    wait; reporting progress there spun a core until the peer took the frame, never timing out."""
    __slots__ = ("transport", "peer", "header", "payload", "sends", "done", "waiting_on")

    def __init__(self, transport, peer: int, header: Header, payload: torch.Tensor):
        self.transport, self.peer, self.header, self.payload = transport, peer, header, payload
        self.sends = {peer: None}  # what the stall check reads: the peer still owed a frame
        self.done = False
        self.waiting_on: int | None = None

    def progress(self) -> bool:
        self.waiting_on = None
        moved = False
        if self.sends:
            if not self.transport.send(self.peer, self.header, self.payload):
                return False  # a full ring: the engine waits, watching the peer
            self.sends, moved = {}, True
        peer = self.transport.unflushed()
        if peer is not None:
            self.waiting_on = peer
            return moved  # moved only on the pass that handed the frame over
        self.done = True
        return True


class SingleFrameRecv:
    """A receive whose buffer fits one copied frame (`one_copied_frame`), without an Execution.

    The sender cuts such a message, or any shorter one, into a single copied frame: chunk 0,
    the message's byte count in its header. So the receive takes one frame from its peer (from
    any source: the first peer, in rank order, with a frame for the tag), checks it against the
    header an Execution of the receive would expect, and copies its bytes to the front of the
    buffer. A shorter message (same dtype, whole elements) is checked against the header of a
    receive of its size, as the Execution's `shorter` path does, and fills the buffer's first
    elements; a longer one, or one of another dtype, fails the check naming both. What it saves
    is the Execution's set-up and walk, about a quarter of a small receive's time (RESULTS.md
    "Thirtieth pass")."""
    __slots__ = ("mailbox", "sources", "key", "out", "dtype", "done", "waiting_on", "peer", "nbytes")

    def __init__(self, mailbox: Mailbox, sources: tuple, tag: int, out: torch.Tensor, dtype: torch.dtype):
        """`sources`: ((peer, the header its frame must carry), ...) in the order they are tried."""
        self.mailbox, self.sources, self.key, self.out, self.dtype = mailbox, sources, ("p2p", tag), out, dtype
        self.done = False
        self.waiting_on: int | None = sources[0][0] if len(sources) == 1 else None
        self.peer: int | None = None  # the sender, once its frame is taken
        self.nbytes: int | None = None  # the message's size, once known

    def progress(self) -> bool:
        take, key = self.mailbox.take, self.key
        for peer, want in self.sources:
            got = take(peer, key)
            if got is not None:
                break
        else:
            return False
        h, payload, owned = got
        try:
            if shorter_message(h, want.seq, want.dtype, self.dtype.itemsize):
                want = want._replace(seq=h.seq, nbytes=h.seq)  # a shorter message: its receive's header
            check(h, want, payload.nbytes)
            nbytes = want.nbytes
            if nbytes:
                out = self.out
                if nbytes != out.nbytes:
                    out = out[:nbytes // self.dtype.itemsize]
                copy_into(out, payload if payload.dtype is self.dtype else payload.view(self.dtype))
        finally:
            if not owned:
                self.mailbox.transport.release(peer)
        self.peer, self.nbytes, self.done, self.waiting_on = peer, nbytes, True, None
        return True


class BarredFrameRecv(SingleFrameRecv):
    """A SingleFrameRecv from any source posted while earlier receives of its tag were pending:
    on each pass it leaves alone the peers `barred()` names (whose message of the tag one of
    those still waits for or is taking: waiting.Waiting.barred). Apart from SingleFrameRecv, so
    that the common receive pays nothing for it."""
    __slots__ = ("every", "barred")

    def __init__(self, mailbox: Mailbox, sources: tuple, tag: int, out: torch.Tensor, dtype: torch.dtype, barred):
        super().__init__(mailbox, sources, tag, out, dtype)
        self.every, self.barred = sources, barred

    def progress(self) -> bool:
        bar = self.barred()
        self.sources = tuple(s for s in self.every if s[0] not in bar)
        return super().progress()


__all__ = ["BarredFrameRecv", "Execution", "Mailbox", "PairExchange", "PairShape", "SingleFrameRecv", "SingleFrameSend", "Stamp",
           "FrameError", "LOCAL_STEPS", "execution_plan", "one_copied_frame", "overlaps", "p2p_lent", "pair_shape",
           "run_local"]
