"""One submitted operation and its record: what the engine drives and what a Work waits on.

An `Op` is built by the c10d adapter, numbered by `Group.submit`, driven by the group's engine
(or inline on the caller's thread) and completed exactly once, with or without an error; a
`Record` is its line in the group's recent history (hang diagnosis, dumps).
"""
from __future__ import annotations

import logging
import threading
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


class Op:
    """One submitted operation. `start()` builds its Execution (run on the engine thread, so
    argument-dependent set-up errors surface from wait()); `finish()` runs after the last
    frame (copy-back, AVG division); callbacks fire on completion."""
    __slots__ = ("kind", "desc", "_start", "_finish", "outputs", "peer", "direction", "nbytes", "dtype",
                 "algorithm", "seq", "exe", "t0", "finished", "_event", "error", "source_rank", "record",
                 "_callbacks", "_lock", "sync", "__weakref__")

    def __init__(self, kind: Kind, desc: str, start, finish=None, outputs=(), peer: int | None = None,
                 direction: str = "", nbytes: int = 0, dtype: torch.dtype = torch.uint8, algorithm: str = ""):
        self.kind, self.desc, self._start, self._finish = kind, desc, start, finish
        self.outputs = list(outputs)
        self.peer, self.direction = peer, direction
        self.nbytes, self.dtype, self.algorithm = nbytes, dtype, algorithm
        self.seq = -1
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

    def complete(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self.finished:
                return
            self.error = error
            self.finished = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # a user's future callback must not kill the engine
                log.exception("completion callback failed")

    def wait(self, timeout: float | None = None) -> None:
        if not self.finished and not self.event.wait(timeout):
            raise GroupError(f"{self.desc}: wait() timed out after {timeout:.1f}s")
        if self.error is not None:
            raise self.error
