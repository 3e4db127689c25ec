"""One submitted operation and its record: what the engine drives and what a Work waits on.

An `Op` is built by the c10d adapter, numbered by `Group.submit`, driven by the group's engine
(or inline on the caller's thread) and completed exactly once, with or without an error; a
`Record` is its line in the group's recent history (hang diagnosis, dumps).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import GroupError
from .transport.frame import Kind

if TYPE_CHECKING:
    from .collectives.executor import Execution

log = logging.getLogger("neuron_dist.init")
_P2P = Kind.P2P


@dataclass
class Record:
    seq: int
    kind: str
    nbytes: int
    dtype: str
    algorithm: str
    state: str = "queued"  # queued -> running -> done | failed
    t_start: float = 0.0
    t_end: float = 0.0
    call: int = -1     # the number the user sees (Op.call; the group passes it: no __post_init__
    checks: str = ""   # on the small-call path); a debug check's exchange: the kind of the call it checks


class Op:
    """One submitted operation. `_start(op)` builds its Execution when the op is run (on the
    engine thread, or on the caller's own where the group runs it at once: Group._run_inline),
    never while the call is checked, so argument-dependent set-up errors surface from wait();
    `_finish(op)` runs after the last frame (copy-back, AVG division); callbacks fire on completion."""
    __slots__ = ("kind", "desc", "_start", "_finish", "outputs", "peer", "direction", "tag", "posted", "nbytes", "dtype",
                 "algorithm", "seq", "call", "checks", "checked", "exe", "t0", "finished", "_event", "error",
                 "source_rank", "record", "_callbacks", "_lock", "sync", "timeout", "__weakref__")

    def __init__(self, kind: Kind, desc: str, start, finish=None, outputs=(), peer: int | None = None,
                 direction: str = "", nbytes: int = 0, dtype: torch.dtype = torch.uint8, algorithm: str = "",
                 tag: int = 0):
        self.kind, self.desc, self._start, self._finish = kind, desc, start, finish
        self.outputs = list(outputs)
        self.peer, self.direction, self.tag = peer, direction, tag  # a send/recv's (waiting.Waiting, a time-out's hint)
        self.posted = 0  # a send/recv's place in the order posted (waiting.Waiting)
        self.nbytes, self.dtype, self.algorithm = nbytes, dtype, algorithm
        self.seq = -1  # the group's number of it, in its frames (a debug check's exchange takes one too)
        # the number errors and diagnoses show, counting the user's collectives: the debug check's
        # all-gather of a call's fingerprint (`checks`: that call's description) shares its call's
        # number, and `checked` marks a call that had one (Group.submit, diagnosis._call_at)
        self.call = -1
        self.checks: str = ""
        self.checked = False
        self.exe: Execution | None = None
        self.t0 = 0.0
        self.finished = False            # set once, under _lock, by complete()
        self._event: threading.Event | None = None  # made only for a wait on an unfinished op
        self.error: BaseException | None = None
        self.source_rank = peer if peer is not None else -1
        self.record: Record | None = None
        self._callbacks: list | None = None  # made by the first add_done_callback on an unfinished op
        self._lock = threading.Lock()
        self.sync: bool | None = None    # True: the caller waits at once (c10d's asyncOp=False)
        self.timeout: float | None = None  # seconds: this call's own time-out (c10d's opts.timeout), else the group's

    @property
    def is_p2p(self) -> bool:
        return self.kind == _P2P

    @property
    def event(self) -> threading.Event:
        """Set when the op completes (made lazily: an op that finished inline never needs one)."""
        ev = self._event
        if ev is None:
            with self._lock:
                if self._event is None:
                    self._event = threading.Event()
                    if self.finished:
                        self._event.set()
                ev = self._event
        return ev

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self.finished:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def complete(self, error: BaseException | None = None, runner: "CallbackRunner | None" = None) -> None:
        """Finish the op; its callbacks run here, or on `runner`'s threads when given."""
        with self._lock:
            if self.finished:
                return
            self.error = error
            self.finished = True
            # what the call's closures hold (a list call's staging in the group's scratch, joined
            # inputs) goes now, not with a Work or future kept after, failed or not
            self._start = self._finish = None
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        if callbacks:
            if runner is not None:
                runner.submit(self._run_callbacks, callbacks)
            else:
                self._run_callbacks(callbacks)

    def _run_callbacks(self, callbacks) -> None:
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a user's future callback must not kill the thread that runs it
                log.exception("completion callback failed")

    def wait(self, timeout: float | None = None, who: str = "") -> None:
        """Block until the op completes (for at most `timeout` seconds) and raise its error. A
        wait's own time-out fails the wait, not the op, which goes on (a later wait may see it
        complete): the error says so, naming the rank (`who`: "rank 0 (global rank 1)" in a
        subgroup, as `Group.who` names it) and the call as the op's own errors do."""
        if not self.finished and not self.event.wait(timeout):
            where = f"[{who}] " if who else ""
            seq = "" if self.is_p2p else f" (seq {self.call})"
            raise GroupError(f"{where}{self.desc}{seq}: wait() timed out after {timeout:.1f}s; the operation "
                             f"is still running (a later wait() may still see it complete)")
        if self.error is not None:
            raise fresh_error(self.error)


def fresh_error(err: BaseException) -> BaseException:
    """A copy of an op's error to raise: raising the one object at every wait() chained each
    waiting caller's frames onto its traceback, and the failed op (and the broken group) kept
    them, with their locals, until the group was destroyed (three callers' 100 MB tensors; Gloo
    raises afresh). `Work.exception()` still hands out the op's own."""
    try:
        new = copy.copy(err)
    except Exception:  # noqa: BLE001 - an exception type that cannot be copied: raise it as it is
        return err.with_traceback(None)
    new.__cause__, new.__suppress_context__ = err.__cause__, err.__suppress_context__
    return new


class CallbackRunner:
    """Threads that run completion callbacks (futures' `then`, DDP's communication hooks) off
    the engine thread.

    A callback may issue another collective of the same group and wait for it: PowerSGD's hook
    all-reduces inside its callback and waits on that future. On the engine thread, which must
    drive that collective, this deadlocked. Here a thread busy in a callback is not idle, so the
    next callback (the inner collective's) starts a new thread, as Gloo's several worker
    threads allow: nested waits up to MAX_THREADS deep. Threads start on first use, idle ones
    wait for more, and `close` drains the queue and joins them."""

    MAX_THREADS = 8

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._jobs: deque = deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stop = False

    def submit(self, fn, arg) -> None:
        with self._cv:
            self._jobs.append((fn, arg))
            # more jobs queued than idle threads: an idle thread already told of an earlier job
            # still counts as idle until it wakes, and two jobs on one thread put a callback's
            # wait on the other's future behind that same callback (a hang; a review's probe)
            if len(self._jobs) > self._idle and len(self._threads) < self.MAX_THREADS:
                t = threading.Thread(target=self._run, name=f"{self.name}-callbacks-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                while not self._jobs and not self._stop:
                    self._cv.wait()
                self._idle -= 1
                if not self._jobs:
                    return
                fn, arg = self._jobs.popleft()
            try:
                fn(arg)
            finally:
                # dropped now, not when the next job comes: an idle thread kept the last op (its
                # callbacks are its bound method and their list) and so the call's tensors alive
                fn = arg = None

    def close(self, timeout: float) -> None:
        """Drain the queue and join the threads, all within `timeout` (one deadline for all: a
        join of its own for each thread stuck in a user's callback made a destroy wait 5 s per
        such thread, up to MAX_THREADS times; they are daemons, left to their callbacks)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        me = threading.current_thread()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
