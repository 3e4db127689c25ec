"""Point-to-point receives that one schedule cannot say: from any source, and of a message
shorter than the buffer (Gloo and MPI take both). The c10d adapter makes one per `recv` whose
message is more than one copied frame (one-frame receives are the group's `recv_frame`); the
engine drives it like an Execution, and it runs Executions of one-Recv schedules inside."""
from __future__ import annotations

import weakref

from .collectives.executor import Execution
from .group import Group
from .op import Op


class Receive:
    """A receive from `peer` (None: from any peer). A message shorter than the buffer fills its
    first elements, as with Gloo and MPI: the receive's first frame carries the message's byte
    count (every point-to-point frame does), and when it says less, the frame goes back and a
    receive of that size takes the message. A longer message, or one of another dtype, fails the
    frame check, naming both. From any source, the first peer with a message for the tag is the
    sender; its frame is looked at and left in place for the receive."""

    def __init__(self, group: Group, op: Op, out, dtype, tag, peer: int | None, schedule_for):
        # the op by weak reference: the op holds this as its `exe`, and a strong reference back
        # made a cycle per receive that only the cyclic GC freed (with the receive's tensor in
        # it), so receives fed the full collections that stall a rank ~100 ms (RESULTS.md)
        self._op = weakref.ref(op)
        self.group, self.schedule_for = group, schedule_for  # schedule_for(peer, count): a one-Recv schedule
        self.out, self.dtype, self.tag, self.peer = out, dtype, tag, peer
        self.done, self.waiting_on = False, None
        self.inner: Execution | None = None if peer is None else self._receive(peer, out.numel(), False)

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
            for peer in range(g.size):
                if peer == g.rank:
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
