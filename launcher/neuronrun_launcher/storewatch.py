"""End neuronrun when the c10d rendezvous store stops answering and no rank of this node runs.

torch's agent calls the rendezvous store from its main thread while it monitors the ranks
(``num_nodes_waiting``, every --monitor-interval), when it restarts them and when it shuts the
rendezvous down, and from a heartbeat thread. None of these calls has a time-out that holds:
TCPStore's ``compare_set`` waits for the answer without one, and its ``get``, after its wait for
the key times out (the store's ``read_timeout``), sends a cancel and waits for that answer without
one. A store on a node cut off by the network (TCP retransmits for about 15 minutes before it
gives up) or a stopped one does not answer, so the main thread did not come back to see its failed
ranks: a node's neuronrun was still running 7 minutes after its rank failed (torchrun does the same).

``StoreWatch`` times every call of the c10d backend (``C10dRendezvousBackend._call_store``, the
one place they all go through) and a daemon thread looks once a second: when a call has been
waiting longer than the store's ``read_timeout`` (the bound torch puts on one store operation:
the rendezvous' keys exist, so a store that answers at all answers at once) and no rank started
on this node is still running, it reports the ranks and the store in one line, cleans up as a
failure does and ends the process with status 1. The main thread, blocked in C++, cannot be woken,
hence ``os._exit`` (a program that calls ``launch()`` itself ends with it). While a rank runs nothing is done: the job may still end well, and a rank that
needs the store fails on its own (neuron_dist's time-out).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Callable

from .launch import exit_words
from .worker import proc_stat, read_group

DEFAULT_READ_TIMEOUT = 60  # torch's c10d_rendezvous_backend default for --rdzv-conf read_timeout
POLL_S = 1.0
_in_flight: dict[int, float] = {}  # thread id -> when its store call began (time.monotonic)
_lock = threading.Lock()


def _timed(call: Callable) -> Callable:
    @functools.wraps(call)
    def _call_store(self, *args, **kwargs):
        thread = threading.get_ident()
        with _lock:
            _in_flight[thread] = time.monotonic()
        try:
            return call(self, *args, **kwargs)
        finally:
            with _lock:
                del _in_flight[thread]

    _call_store.neuronrun_timed = True
    return _call_store


def track_store_calls() -> None:
    """Time every call of torch's c10d rendezvous backend to its store (once per process)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    if not getattr(C10dRendezvousBackend._call_store, "neuronrun_timed", False):
        C10dRendezvousBackend._call_store = _timed(C10dRendezvousBackend._call_store)


def oldest_call_s() -> float | None:
    """How long the longest-waiting store call has waited (None: none is waiting)."""
    with _lock:
        since = min(_in_flight.values(), default=None)
    return None if since is None else time.monotonic() - since


def ranks_of(groups_dir: str) -> dict[int, tuple[str, str]]:
    """pid -> (start time, global rank) of the ranks the trampoline recorded in ``groups_dir``
    (worker._register_group; launch.sweep_groups removes those of an ended attempt)."""
    ranks = {}
    for name in os.listdir(groups_dir) if os.path.isdir(groups_dir) else ():
        try:
            ranks[int(name)] = read_group(os.path.join(groups_dir, name))
        except (ValueError, OSError):
            pass
    return ranks


def running(pid: int, started: str) -> bool:
    """Whether the rank is still running: not gone, not a zombie (the agent, stuck, does not
    reap it), and not another process that was given its pid."""
    fields = proc_stat(pid)
    if not fields:
        return False
    return fields[0] not in ("Z", "X") and (not started or fields[19:20] == [started])  # (start_time's field)


def how_it_ended(pid: int) -> str:
    """A rank's exit status, reaped here (the agent that would reap it is stuck)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped already by the agent, or not our child
        return "ended"
    if not done:  # (not yet a zombie: it ended a moment ago)
        return "ended"
    return exit_words(os.waitstatus_to_exitcode(status))


class StoreWatch:
    """The daemon thread described above. ``endpoint``: the store's HOST:PORT, for the report;
    ``bound``: seconds a store call may wait; ``clean_up``: what a failure leaves to do (sweep the
    ranks' process groups, remove neuronrun's directories), run before the process ends."""

    def __init__(self, groups_dir: str, endpoint: str, bound: float, clean_up: Callable[[], None]):
        self.groups_dir, self.endpoint, self.bound, self.clean_up = groups_dir, endpoint, bound, clean_up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="neuronrun-storewatch", daemon=True)

    def __enter__(self) -> "StoreWatch":
        track_store_calls()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def stalled(self) -> float | None:
        """How long a store call has waited, if longer than the bound while no rank of this node
        runs (None otherwise)."""
        waited = oldest_call_s()
        if waited is None or waited < self.bound:
            return None
        if any(running(pid, started) for pid, (started, _) in ranks_of(self.groups_dir).items()):
            return None
        return waited

    def report(self, waited: float) -> str:
        """The one line that says why neuronrun ends: the store, and how each rank of this node ended."""
        ranks = sorted(ranks_of(self.groups_dir).items(), key=lambda item: int(item[1][1]) if item[1][1].isdigit()
                       else -1)
        ended = ", ".join(f"rank {rank} {how_it_ended(pid)}" for pid, (_, rank) in ranks)
        return (f"neuronrun: the rendezvous store at {self.endpoint} stopped answering (a call to it has waited "
                f"{waited:.0f} s, past its time-out, --rdzv-conf read_timeout={self.bound:g}; its node may be cut "
                f"off or stopped) and no rank of this node is running ({ended or 'none had started'}); job failed")

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            waited = self.stalled()
            if waited is None or self._stop.is_set():
                continue
            print(self.report(waited), file=sys.stderr, flush=True)
            try:
                self.clean_up()
                sys.stdout.flush()
            finally:
                os._exit(1)
