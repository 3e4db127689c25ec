"""The order in which queued operations may start (`Group`'s engine admits from here).

Collectives start one at a time in sequence order; point-to-point ops one per (direction, peer,
tag), in the order they were posted; receives from any source follow MPI's matching rule beside
the specific ones of their tag (`Waiting`).
"""
from __future__ import annotations

from collections import deque

from .op import Op


def p2p_key(op: Op) -> tuple:
    """The line a point-to-point op waits in: its direction, peer and tag. Messages of one
    (peer, tag) must keep their posted order (torch's and MPI's non-overtaking rule), and the
    frames of one must not interleave with another's; the mailbox keeps each peer's frames
    apart by tag, so ops of other tags need not wait: a receive of one tag held up by an
    earlier one of another (posted first, sent last) deadlocked a tag-ordered exchange that
    Gloo completes."""
    return op.direction, op.peer, op.tag


def sender(op: Op) -> int | None:
    """The peer a receive takes its message from: its own, or, for one from any source, the
    peer whose frame it matched (its execution's `peer`); None while it has matched none."""
    if op.peer is not None:
        return op.peer
    exe = op.exe
    return None if exe is None else exe.peer


class Waiting:
    """Ops taken from the queue, not yet started, held in the order each kind must start in:
    collectives one at a time in sequence order; point-to-point ops one per (direction, peer,
    tag) at a time, in issue order, beside them (`p2p_key`). Kept per key, so an engine pass
    admits in the same time with ten thousand async ops waiting as with one (a scan of one
    queue made that quadratic: 8,000 outstanding all-reduces took 37 s, Gloo 13 s).

    Receives from any source follow MPI's matching rule beside the specific ones of their tag:
    receives match messages in the order they were posted, and once one has taken a message's
    first frame the rest of it is its own. So a specific receive from P with tag T waits while
    an any-source receive of T posted before it has matched no message yet, or is taking P's;
    the next any-source receive of T starts once the one before it has matched (no sooner), and
    leaves alone the peers whose message of T an earlier-posted receive still waits for or is
    taking (`barred`, which its execution asks on each pass). Both kinds took frames of one
    peer's tag at once and split one message between them, failing the group. Receives of other
    peers and tags wait for nothing more (that could deadlock where Gloo does not). `posted`
    numbers the point-to-point ops in the order they came; 0 is one the caller's thread started
    with nothing else pending (Group._run_inline), so before every other."""
    __slots__ = ("coll", "p2p", "n", "posted", "anys", "before")

    def __init__(self):
        self.coll: deque[Op] = deque()
        self.p2p: dict[tuple, deque[Op]] = {}
        self.n = 0
        self.posted = 0
        self.anys: dict[int, list[Op]] = {}  # tag -> the any-source receives pending, in posted order
        self.before: dict[Op, tuple] = {}    # any-source receive -> the specific ones of its tag posted before it

    def extend(self, ops, active=()) -> None:
        running = None  # the specific receives running, by key: looked up once, for a batch with receives
        for op in ops:
            if op.is_p2p:
                self.posted += 1
                op.posted = self.posted
                key = p2p_key(op)
                if op.direction != "send":
                    if running is None:
                        running = self._running(active)
                    if op.direction == "recv-any":
                        self._note_any(op, running)
                q = self.p2p.get(key)
                if q is None:
                    q = self.p2p[key] = deque()
                q.append(op)
            else:
                self.coll.append(op)
            self.n += 1

    def _running(self, active) -> dict:
        """The specific receives running, by key; an any-source receive the caller's thread
        started (never in this line) is entered in `anys` here, ahead of every other."""
        running = {}
        for o in active:
            if o.is_p2p and not o.finished:
                if o.direction == "recv":
                    running[p2p_key(o)] = o
                elif o.direction == "recv-any" and o.posted == 0:
                    pending = self.anys.setdefault(o.tag, [])
                    while pending and pending[0].finished:
                        del pending[0]
                    if not pending or pending[0] is not o:
                        pending.insert(0, o)
        return running

    def _note_any(self, op: Op, running: dict) -> None:
        """Enter an any-source receive, with the specific receives of its tag posted before it
        (the newest per peer: each peer's run one at a time, in order)."""
        tag = op.tag
        newest = {k: o for k, o in running.items() if k[2] == tag}
        for k, q in self.p2p.items():
            if k[0] == "recv" and k[2] == tag:
                newest[k] = q[-1]
        if newest:
            self.before[op] = tuple(newest.values())
        self.anys.setdefault(tag, []).append(op)

    def barred(self, op: Op) -> set:
        """The peers a receive from any source must not take a message from yet: those whose
        message of its tag a receive posted before it still waits for (a specific one) or is
        taking (an any-source one, matched). Only ever fewer as it waits: later receives bar
        nothing."""
        bar = set()
        earlier = self.before.get(op)
        if earlier:
            live = tuple(o for o in earlier if not o.finished)
            if len(live) < len(earlier):  # (a finished receive is not kept for its tensors' sake)
                if live:
                    self.before[op] = live
                else:
                    del self.before[op]
            bar.update(o.peer for o in live)
        for a in self.anys.get(op.tag, ()):
            if a.posted >= op.posted:
                break
            if not a.finished:
                bar.add(sender(a))
        return bar

    def _held(self, op: Op) -> bool:
        """Whether a specific receive waits for an any-source receive of its tag posted before it
        (one that has matched no message yet, or is taking one from the same peer)."""
        for a in self.anys[op.tag]:
            if a.posted > op.posted:
                break
            if not a.finished:
                peer = sender(a)
                if peer is None or peer == op.peer:
                    return True
        return False

    def _prune(self) -> None:
        """Drop finished any-source receives (only the ones matched come before the first one
        that has not: those are all that can have finished)."""
        for tag in list(self.anys):
            pending = self.anys[tag]
            i = 0
            while i < len(pending):
                a = pending[i]
                if a.finished:
                    del pending[i]
                    self.before.pop(a, None)
                elif sender(a) is None:
                    break
                else:
                    i += 1
            if not pending:
                del self.anys[tag]

    def admit(self, active: list[Op]) -> None:
        """Move to `active` every op whose kind has none running there (an any-source receive
        that has matched a message lets the next of its tag start) and that no receive posted
        before it holds back."""
        busy_coll, busy = False, set()
        for o in active:
            if o.is_p2p:
                if o.direction != "recv-any" or sender(o) is None:
                    busy.add(p2p_key(o))
            else:
                busy_coll = True
        if self.coll and not busy_coll:
            active.append(self.coll.popleft())
            self.n -= 1
        anys = self.anys
        if anys:
            self._prune()
        for key in [k for k in self.p2p if k not in busy]:
            q = self.p2p[key]
            if anys and key[0] == "recv" and key[2] in anys and self._held(q[0]):
                continue
            active.append(q.popleft())
            self.n -= 1
            if not q:
                del self.p2p[key]

    def __iter__(self):
        yield from self.coll
        for q in self.p2p.values():
            yield from q

    def __len__(self) -> int:
        return self.n

    def clear(self) -> None:
        self.coll.clear()
        self.p2p.clear()
        self.anys.clear()
        self.before.clear()
        self.n = 0
