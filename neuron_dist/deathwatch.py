"""Peer death detection at the start of an operation, and for a waiting one (see `DeathWatch`)."""
from __future__ import annotations

import os
import select
import threading
import time
from typing import TYPE_CHECKING, Callable

from .errors import GroupError

if TYPE_CHECKING:
    from .group import Group
    from .op import Op


class _ExitWaker:
    """One thread per process, asleep in epoll on the pidfds of every group's same-host peers,
    that wakes a group's engine the moment one of those processes ends.

    A stalled engine sleeps in its transport's wait (a futex on shared memory), which cannot
    also wait on pidfds: a killed peer was seen only when that wait ended (up to the engine's
    longest, 0.25 s), and its error came 0.56-0.70 s after the kill. The thread costs nothing
    while it waits, and lives only while some group watches a peer (the last `remove` ends it,
    and waits for it: a destroyed group leaves no thread or descriptor behind). It
    polls the groups' own pidfds, which a group hands back (`remove`, under the lock) before it
    closes them, so an fd the thread looks at is always the one registered; an event that was
    meant for an earlier fd of the same number is told apart by asking the fd itself.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._wakes: dict[int, Callable[[], None]] = {}  # pidfd -> what to call when it ends
        self._ep = None   # the thread's epoll and its eventfd (a `remove` that leaves nothing wakes it)
        self._efd = -1
        self._thread: threading.Thread | None = None

    def add(self, fd: int, wake: Callable[[], None]) -> None:
        with self._lock:
            if self._ep is None:
                self._ep, self._efd = select.epoll(), os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._ep.register(self._efd, select.EPOLLIN)
                self._thread = threading.Thread(target=self._run, args=(self._ep, self._efd),
                                                name="neuron_dist-exits", daemon=True)
                self._thread.start()
            self._wakes[fd] = wake
            self._ep.register(fd, select.EPOLLIN)

    def remove(self, fd: int) -> None:
        """Forget `fd` (before its owner closes it); the last one ends the thread."""
        with self._lock:
            if self._wakes.pop(fd, None) is None:
                return
            self._ep.unregister(fd)
            if self._wakes:
                return
            ep, efd, thread = self._ep, self._efd, self._thread
            self._ep, self._efd, self._thread = None, -1, None
            os.eventfd_write(efd, 1)
        if thread is not threading.current_thread():
            thread.join(timeout=5)
            if thread.is_alive():  # (never seen: its epoll wakes on the eventfd at once) leave
                return             # its descriptors to it rather than close them under its wait
        ep.close()
        os.close(efd)

    def _run(self, ep, efd: int) -> None:
        while True:
            try:
                events = ep.poll()
            except InterruptedError:
                continue
            woken, last = [], False
            with self._lock:
                if self._ep is not ep:  # the last `remove` took them while this thread waited: end
                    return              # (it closes them once we have; a later `add` has its own)
                for fd, _ in events:
                    if fd == efd:
                        os.eventfd_read(efd)  # (level-triggered: unread, it would fire for ever)
                        continue
                    if fd not in self._wakes or not _ended(fd):  # not ours, or meant for an earlier fd
                        continue                                 # of this number
                    ep.unregister(fd)
                    woken.append(self._wakes.pop(fd))
                if not self._wakes:  # every process watched has ended: end, closing our own
                    self._ep, self._efd, self._thread, last = None, -1, None, True
            for wake in woken:
                wake()
            if last:
                ep.close()
                os.close(efd)
                return

    def forget_in_child(self) -> None:
        """A forked child has no thread: its copies of the epoll and eventfd go, and so does the
        list (the parent's groups are not the child's)."""
        if self._ep is not None:
            self._ep.close()
            os.close(self._efd)
        self.__init__()


def _ended(pidfd: int) -> bool:
    """Whether `pidfd`'s process has ended (a pidfd reads as readable then)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


_EXITS = _ExitWaker()
os.register_at_fork(after_in_child=_EXITS.forget_in_child)
# pid -> when waiting for that process to end gives up (`await_exits`), for every group of this
# process: several groups that fail on one exiting peer wait for it once, not one after another
_EXIT_DEADLINES: dict[int, float] = {}


class DeathWatch:
    """Fails an operation at its start if a peer it needs has died, or its copy of the group failed.

    A collective needs every member; a point-to-point transfer its peer. A peer that closed in
    order (destroy_process_group after its last collective, seen by the transport's
    `peer_finished`) may already have done its part, and does not count. A receive is not failed
    on a member that failed but lives: what it sent before is delivered (a receive that waits on
    it in vain fails there, on the transport's word). Same-host peers are watched
    through pidfds in one epoll set (a non-blocking poll at an operation's start, at most one
    per POLL_INTERVAL; zombies included); peers on other hosts through the transport's
    connection state. A same-host peer's end also wakes the group's engine asleep in its
    transport's wait (`_ExitWaker`), and raises `news` for its next stall check to look at once.
    """

    POLL_INTERVAL = 0.001  # seconds between polls of the pidfds: back-to-back small operations share
                           # one (a death in between is still caught inside the operation)

    def __init__(self, group: "Group", host: str):
        # no reference to the group kept: the group owns this watch, and a cycle between them
        # would keep the group (and the store it holds, a TCPStore server on rank 0) alive after
        # destroy_process_group until the cycle collector ran, so a new init_process_group on
        # the same address met the old store
        self.ep = None
        self._next_poll = 0.0
        self.fds: dict[int, int] = {}      # pidfd -> peer
        self.pids: dict[int, int] = {}     # peer -> its process id (those watched)
        self.dead: dict[int, str] = {}     # peer -> reason
        self.news = False                  # a watched peer's process ended since the engine last looked
        self._closed = False
        self._waking = threading.Lock()    # held while the waker's thread wakes the transport: `close`
                                           # takes it, so no wake reaches a transport closed after it
        self.failed: set[int] = set()      # those of them alive, whose copy of the group failed
        self.remote = [r for r, h in enumerate(group.hosts) if r != group.rank and h != host]
        local = [r for r, h in enumerate(group.hosts) if r != group.rank and h == host]
        if local and hasattr(os, "pidfd_open"):
            self.ep = select.epoll()
            for r in local:
                try:
                    fd = os.pidfd_open(group.peers_info[r]["pid"])
                except OSError as e:  # already gone at creation, or no permission
                    if e.errno == 3:  # ESRCH
                        self.dead[r] = f"rank {r} (pid {group.peers_info[r]['pid']}) exited"
                    continue
                self.fds[fd] = r
                self.pids[r] = group.peers_info[r]["pid"]
                self.ep.register(fd, select.EPOLLIN)
                _EXITS.add(fd, self._woken_by(group.transport.wake))

    def _woken_by(self, wake: Callable[[], None]) -> Callable[[], None]:
        def on_exit() -> None:  # (on the waker's thread, which may have taken it from the list
            with self._waking:  # just before `close` took it back: a wake then must not write
                if not self._closed:  # to a zmq pipe whose descriptor the transport closed, and
                    self.news = True  # the number another file may have taken since)
                    wake()
        return on_exit

    def _poll(self, g: "Group") -> None:
        """Note the same-host peers whose processes have ended since the last look, and the
        members whose copy of the group has failed (`_failed`)."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + self.POLL_INTERVAL
        if self.ep is not None:
            for fd, _ in self.ep.poll(0):
                r = self.fds.pop(fd)
                self.ep.unregister(fd)
                _EXITS.remove(fd)
                os.close(fd)
                self.dead[r] = f"rank {r} (pid {g.peers_info[r]['pid']}) exited"
                self.failed.discard(r)  # (dead now, not only failed)
        self._failed(g)

    def _failed(self, g: "Group") -> None:
        """Note the members whose copy of the group failed or was aborted (their failure flag, an
        ABORT already taken in): such a member runs no further collective of the group. A rank
        that came late to a small collective, whose peers had timed out on it after sending their
        data, completed it with the result they had given up on and failed only at its next call
        (Gloo fails that call on every rank)."""
        if not self.remote:  # (with peers on other hosts, `check` has just drained)
            g.transport.take_in()  # an ABORT behind frames not read yet (zmq between ranks of one host)
        for r in range(g.size):
            if r != g.rank and r not in self.dead:
                reason = g.transport.peer_failed(r)
                if reason:
                    self.dead[r] = reason
                    self.failed.add(r)

    def exited(self, g: "Group", peer: int) -> str | None:
        """Why same-host `peer` is gone if its process has ended: asked by an operation that
        waits on it, for transports that cannot tell (MPI says nothing when a peer dies: with
        the job kept alive, as under `mpirun --enable-recovery` or srun without -K, its peers
        waited out the time-out, told the dead rank "had not entered")."""
        self._poll(g)
        return self.dead.get(peer) if peer not in self.remote and peer not in self.failed else None

    def check(self, g: "Group", op: "Op") -> None:
        """Raise if a peer `op` of group `g` needs has died or (but for a receive) failed."""
        if self.remote:
            g.transport.take_in()  # their ABORTs queued behind frames not read yet (zmq): one drain for all
        self._poll(g)
        for r in self.remote:
            reason = g.transport.check_peer(r)
            if reason:
                self.dead.setdefault(r, reason)
        if not self.dead:
            return
        needed = [op.peer] if op.is_p2p and op.peer is not None else range(g.size)
        dead = [r for r in needed if r in self.dead and not g.transport.peer_finished(r)]
        if op.is_p2p and op.direction != "send":  # a message a failed member sent before it failed
            dead = [r for r in dead if r not in self.failed]  # is still there to take (eager sends)
        if not dead:
            return
        r = dead[0]
        if len(self.dead) == 1 and r not in self.failed:
            raise GroupError(f"[{g.who(g.rank)}] {g._name(op)} failed: {g.who(r)} is gone "
                             f"({self.dead[r]}) before the operation started")
        # several members gone, seen in one look: which went first is what their ABORT frames say
        # (a peer that failed on another's death tells its cause, then exits); a member that
        # failed says why in its ABORT too (a mismatch it found, the rank it timed out on)
        raise GroupError(f"[{g.who(g.rank)}] {g._name(op)} failed before it started: "
                         f"{g._gone_cause(r, self.dead[r])}")

    def await_exits(self, peers: list[int], timeout: float) -> None:
        """Wait for these same-host peers' processes to end, each at most `timeout` after this
        process first waited for it (those on other hosts, or already seen ended, are not
        waited for)."""
        p, left, now = select.poll(), set(), time.monotonic()
        deadline = now
        for fd, r in list(self.fds.items()):
            if r in peers:
                p.register(fd, select.POLLIN)
                left.add(fd)
                deadline = max(deadline, _EXIT_DEADLINES.setdefault(self.pids[r], now + timeout))
        while left:
            ms = (deadline - time.monotonic()) * 1000
            if ms <= 0:
                return
            for fd, _ in p.poll(ms):  # (an fd a concurrent `close` took reads as POLLNVAL: done)
                left.discard(fd)
                p.unregister(fd)

    def close(self) -> None:
        with self._waking:
            self._closed = True
        for fd in self.fds:
            _EXITS.remove(fd)
            os.close(fd)
        self.fds.clear()
        if self.ep is not None:
            self.ep.close()
            self.ep = None
