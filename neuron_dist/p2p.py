"""Point-to-point messages: how each form travels, and the receives one schedule cannot say.

A send or receive of one argument form (peer, element count, dtype, tag) is planned once per
process group (`PeerPlans`): a message that fits one copied frame skips the Execution (the
group's `send_frame` / `recv_frame`, with the frame headers made here); a larger one runs a
one-Send schedule, or a `Receive`. A `Receive` takes what one schedule cannot say: a message
from any source, and one shorter than the buffer (Gloo and MPI take both); the engine drives it
like an Execution, and it runs Executions of one-Recv schedules inside. The c10d adapter checks
and flattens the call's tensor and asks here for the plan."""
from __future__ import annotations

import functools
import weakref

import torch

from .collectives import direct
from .collectives.executor import Execution
from .collectives.schedule import Schedule
from .group import Group
from .op import Op
from .plans import keep


class Receive:
    """A receive from `peer` (None: from any peer). A message shorter than the buffer fills its
    first elements, as with Gloo and MPI: the receive's first frame carries the message's byte
    count (every point-to-point frame does), and when it says less, the frame goes back and a
    receive of that size takes the message. A longer message, or one of another dtype, fails the
    frame check, naming both. From any source, the first peer with a message for the tag is the
    sender (leaving alone the peers an earlier-posted receive of the tag has a claim on:
    waiting.Waiting); its frame is looked at and left in place for the receive."""

    def __init__(self, group: Group, op: Op, out, dtype, tag, peer: int | None, schedule_for):
        # the op by weak reference: the op holds this as its `exe`, and a strong reference back
        # made a cycle per receive that only the cyclic GC freed (with the receive's tensor in
        # it), so receives fed the full collections that stall a rank ~100 ms (RESULTS.md)
        self._op = weakref.ref(op)
        self.group, self.schedule_for = group, schedule_for  # schedule_for(peer, count): a one-Recv schedule
        self.out, self.dtype, self.tag, self.peer = out, dtype, tag, peer
        self.done, self.waiting_on = False, None
        self.inner: Execution | None = None if peer is None else self._receive(peer, out.numel(), False)
        # from any source: the peers whose message of the tag an earlier-posted receive still
        # waits for or is taking, and so not to be matched here yet (None: there are none)
        self.barred = group.barred_for(op) if peer is None else None

    @property
    def op(self) -> Op:
        return self._op()  # alive while driven: the engine or the caller's fast path holds it

    def _receive(self, peer: int, count: int, arrived: bool = True) -> Execution:
        exe = self.group.execution(self.op, self.schedule_for(peer, count), [None, self.out, None], None,
                                   self.dtype, self.tag, arrived=arrived)
        exe.shorter_ok = count == self.out.numel()
        return exe

    def progress(self) -> bool:
        g = self.group
        if self.inner is None:
            key = ("p2p", self.tag)
            barred = self.barred() if self.barred is not None else ()
            for peer in range(g.size):
                if peer == g.rank or peer in barred:
                    continue
                got = g.mailbox.take(peer, key)
                if got is None:
                    continue
                g.mailbox.put_back(peer, key, *got)  # (left in the transport: no copy)
                self.peer = self.op.source_rank = peer
                self.inner = self._receive(peer, self.out.numel())
                break
            else:
                return False
        moved = self.inner.progress()
        if self.inner.shorter is not None:
            self.op.nbytes = self.inner.shorter  # what moves, and what its frames' headers say
            self.inner = self._receive(self.peer, self.op.nbytes // self.dtype.itemsize)
            moved = self.inner.progress() or True
        self.done, self.waiting_on = self.inner.done, self.inner.waiting_on
        return True if self.done else moved


class SendPlan:
    """A send of one form: its description, and how it travels: as one copied frame with this
    `header` (`Group.send_frame`), else by an Execution of a one-Send `schedule`."""
    __slots__ = ("group", "peer", "dtype", "tag", "nbytes", "desc", "header", "schedule")

    def __init__(self, group: Group, peer: int, count: int, dtype: torch.dtype, tag: int):
        self.group, self.peer, self.dtype, self.tag = group, peer, dtype, tag
        self.nbytes = nbytes = count * dtype.itemsize
        self.desc = f"send({nbytes} bytes, to rank {peer}, tag {tag})"
        self.header = self.schedule = None
        if group.one_frame(count, dtype.itemsize):
            self.header = group.frame_header(dtype, peer, nbytes, tag)
        else:
            self.schedule = direct.send(peer, count)

    def start(self, payload: torch.Tensor, op: Op):
        """The op's execution, sending the flat `payload` (an Op's start, with the payload bound)."""
        if self.header is not None:
            return self.group.send_frame(op, self.peer, self.header, payload)
        return self.group.execution(op, self.schedule, [payload, None, None], None, self.dtype, self.tag)


def _sender_from_frame(op: Op) -> None:
    """A one-frame receive from any source learns its sender from the frame it took (a
    `Receive` sets it when it finds the frame)."""
    op.source_rank = op.exe.peer


class RecvPlan:
    """A receive of one form from `peer` (None: any source), into the front of the buffer: its
    description; for a message that fits one copied frame, the headers its possible senders'
    frames must carry (`sources`, for `Group.recv_frame`), else None (a `Receive`, whose
    one-Recv schedules come from `schedule_for(peer, count)`); and `note_sender`, the op's
    finish that sets its source rank where the execution does not (else None)."""
    __slots__ = ("group", "peer", "dtype", "tag", "desc", "sources", "schedule_for", "note_sender")

    def __init__(self, group: Group, peer: int | None, count: int, dtype: torch.dtype, tag: int, schedule_for):
        self.group, self.peer, self.dtype, self.tag, self.schedule_for = group, peer, dtype, tag, schedule_for
        nbytes = count * dtype.itemsize
        self.desc = f"recv({nbytes} bytes, from rank {peer}, tag {tag})" if peer is not None else \
            f"recv(any source, tag {tag}, {nbytes} bytes)"
        self.sources = None
        if group.one_frame(count, dtype.itemsize):
            self.sources = tuple((p, group.frame_header(dtype, p, nbytes, tag, incoming=True))
                                 for p in ((peer,) if peer is not None else range(group.size)) if p != group.rank)
        self.note_sender = _sender_from_frame if peer is None and self.sources is not None else None

    def start(self, out: torch.Tensor, op: Op):
        """The op's execution, receiving into the flat `out` (an Op's start, with the buffer bound)."""
        if self.sources is None:
            return Receive(self.group, op, out, self.dtype, self.tag, self.peer, self.schedule_for)
        return self.group.recv_frame(op, self.peer, self.sources, self.tag, out, self.dtype)


def _one_recv(kept: dict, peer: int, count: int) -> Schedule:
    """A one-Recv schedule from `peer`, kept per (peer, count) in `kept` with the frame plan
    the executor caches on it."""
    sched = kept.get((peer, count))
    if sched is None:
        sched = keep(kept, (peer, count), direct.recv(peer, count))
    return sched


class PeerPlans:
    """A process group's send and receive plans, one per argument form (cleared when full),
    and the one-Recv schedules its `Receive`s run. The schedules are kept apart from the plans,
    which refer to them: in one dict each receive plan would be a reference cycle."""

    def __init__(self, group: Group):
        self.group = group
        self.by_args: dict[tuple, SendPlan | RecvPlan] = {}
        self._schedule_for = functools.partial(_one_recv, {})

    def send(self, peer: int, count: int, dtype: torch.dtype, tag: int) -> SendPlan:
        key = ("send", peer, count, dtype, tag)
        plan = self.by_args.get(key)
        if plan is None:
            plan = keep(self.by_args, key, SendPlan(self.group, peer, count, dtype, tag))
        return plan

    def recv(self, peer: int | None, count: int, dtype: torch.dtype, tag: int) -> RecvPlan:
        key = ("recv", peer, count, dtype, tag)
        plan = self.by_args.get(key)
        if plan is None:
            plan = keep(self.by_args, key, RecvPlan(self.group, peer, count, dtype, tag, self._schedule_for))
        return plan
