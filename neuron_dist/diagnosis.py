"""Hang diagnosis: what each rank last ran, on demand and at a failure.

Every group keeps its recent collectives (`Record`s) and publishes a small progress record to
the store when it changes (the heartbeat thread in `Group`), so a rank that times out can say
which ranks had not entered the collective and what every rank last ran. `dump()` prints a
group's history; NEURON_DIST_DUMP / NEURON_DIST_DUMP_SIGNAL write every group's on failure or
on a signal.

`HangDiagnosis` is a mixin of `Group`: it reads the group's `records`, `rank`, `size`, `name`,
`store`, `_seq`, `_calls`, `broken`, `_published` and `mailbox`, calls its `who`, and keeps
`_store_lost`.

Numbers: a group numbers its collectives for their frames (`seq`), and under the debug check
(debug.py) each call's fingerprint exchange takes a number of its own; what the texts show is
the user's call number (`Op.call`, `Record.call`), shared by a call and its exchange, so that
they read alike with the check on or off. The comparisons below are made on the frames' numbers.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import weakref
from typing import NamedTuple

from .config import emit, env, env_target
from .op import Op
from .transport.frame import Kind

_KIND_NAMES = {int(k): k.name.lower() for k in Kind}  # a frame's kind as the records name it

# what a rank "last ran" reads before its first collective: only collectives are recorded, and a
# rank that had run sends and receives read "last ran: nothing" (review AI)
NO_COLLECTIVE = "no collective yet (sends and receives are not recorded)"


class _Said(NamedTuple):
    """What `_diagnose` found, for the hint a time-out adds (timeout_diagnosis)."""
    text: str
    lost: list[int]        # ranks whose progress record predates calls they took part in
    inside: list[int]      # ranks known to have entered the call
    missing: list[int]     # ranks whose records say they had not entered it
    unread: list[int]      # ranks whose records this rank could not read (the store unreachable or slow)
    mixed: bool            # the ranks run the call by different algorithms (the text says what to set)


def _what(op: Op) -> str:
    """The kind of call `op` is, as the user called it (a debug check's exchange: its call's)."""
    return op.checks.split("(")[0] if op.checks else op.kind.name.lower()


def _call_at(op: Op, seq: int) -> int:
    """The user's call number of a collective at frame number `seq`, one of `op`'s or after it
    (a peer's frame, kept early): counted on from `op`'s, two numbers a call where `op` went
    through the debug check (each call after its fingerprint exchange), else one."""
    if seq <= op.seq:
        return op.call
    if op.checks or op.checked:
        return op.call + (seq - (op.seq if op.checks else op.seq - 1)) // 2
    return op.call + seq - op.seq


def _received(op: Op) -> dict[int, int]:
    """Frames of `op` received so far, per peer (none before its Execution is made)."""
    return getattr(getattr(op, "exe", None), "recv_chunks", None) or {}


log = logging.getLogger("neuron_dist.init")
LIVE: "weakref.WeakSet" = weakref.WeakSet()  # every open group of this process (for dumps)
# How long a failing rank waits for the store's answer. The store lives in rank 0's process, on
# another host for most ranks: cut off from it by a network partition, a store call blocks until
# the kernel gives up on the TCP connection (about 15 minutes), whatever the store's time-out.
STORE_ANSWER_S = 2.0   # one store call
STORE_READ_S = 10.0    # all the records a diagnosis reads (a large job has many, read one by one)


class StoreUnanswered(TimeoutError):
    pass


_stuck_lock = threading.Lock()
_stuck: dict[int, str] = {}  # calls that outlived their wait and still have not returned


def bounded_store_call(fn, what: str, limit: float = STORE_ANSWER_S):
    """fn() on a helper thread, waited for at most `limit` seconds: a failing op must fail at
    its time-out even when the store cannot be reached. Calls run side by side (groups fail
    together); but once one has outlived its wait, the connection is taken for dead and later
    calls give up at once, until it returns, instead of piling up threads on it."""
    with _stuck_lock:
        if _stuck:
            raise StoreUnanswered(f"the store has not answered an earlier call ({next(iter(_stuck.values()))})")
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            with _stuck_lock:
                done.set()
                _stuck.pop(threading.get_ident(), None)

    t = threading.Thread(target=run, name="neuron_dist-store-call", daemon=True)
    t.start()
    if not done.wait(limit):
        with _stuck_lock:
            if not done.is_set():
                _stuck[t.ident] = what
        if not done.is_set():
            raise StoreUnanswered(f"the store did not answer {what} within {limit:g}s (is rank 0's host reachable?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _forget_stuck_in_child() -> None:
    _stuck.clear()  # the threads making those calls were not forked


os.register_at_fork(after_in_child=_forget_stuck_in_child)


class HangDiagnosis:
    """Progress records, diagnosis and dumps of one group (mixed into `Group`)."""
    _store_lost: str | None = None  # why a store call failed outright: none is made after it

    def progress_record(self) -> dict:
        """This rank's small progress record: the next sequence number it will issue (`issued`:
        frame sequence numbers, a debug check's exchanges included; `calls` counts the user's
        calls, as `Group.issued` does), the last collective it completed and its most recent
        collectives (seq, kind, bytes, dtype, state, algorithm)."""
        recs = list(self.records)
        done = max((r.seq for r in recs if r.state == "done"), default=-1)
        return {"rank": self.rank, "pid": os.getpid(), "issued": self._seq, "calls": self._calls, "done": done,
                "broken": str(self.broken)[:300] if self.broken else None, "t": time.time(),
                "recent": [[r.seq, f"{r.checks} check" if r.checks else r.kind, r.nbytes, r.dtype, r.state,
                            r.algorithm, r.call] for r in recs[-4:]]}

    def _publish_progress(self, bounded: bool = False) -> None:
        """Write this rank's record if it changed. `bounded` (the engine thread, failing an op):
        wait for the store at most STORE_ANSWER_S; the heartbeat thread may block instead."""
        if self._store_lost:
            return
        try:
            rec = self.progress_record()
            key = (rec["issued"], rec["done"], tuple(tuple(x) for x in rec["recent"]), rec["broken"])
            if key != self._published:
                def put(store=self.store, k=f"progress/{self.rank}", v=json.dumps(rec)):
                    store.set(k, v)
                bounded_store_call(put, "a progress record") if bounded else put()
                self._published = key
        except StoreUnanswered as e:
            log.debug("rank %d: progress record not published: %s", self.rank, e)
        except Exception as e:  # noqa: BLE001 - the store (rank 0's process) may be gone
            self._lose_store(e)
            log.debug("rank %d: progress record not published: %s", self.rank, e)

    def _lose_store(self, e: BaseException) -> None:
        """A store call failed outright (its host, rank 0's process, has gone): no more calls. Each
        one printed torch's C++ 'sendBytes failed' trace on this rank's stderr, once per failed
        call after it, burying the group's own error."""
        self._store_lost = f"{type(e).__name__}: {e}"

    def _peer_records(self) -> tuple[dict[int, dict], list[int], str]:
        """The other ranks' progress records; the ranks whose record could not be read, and why.
        Each store call is bounded, and so is the whole read, so a dead store costs a failing op
        at most a few seconds; what was read before stays."""
        records = {}
        others = [r for r in range(self.size) if r != self.rank]
        if self._store_lost:
            return records, others, f"the store could not be read ({self._store_lost})"
        deadline = time.monotonic() + STORE_READ_S
        for i, r in enumerate(others):
            left = deadline - time.monotonic()
            if left <= 0:
                return records, others[i:], (f"the store took over {STORE_READ_S:g}s to give {i} of "
                                             f"{len(others)} records")
            key, limit = f"progress/{r}", min(STORE_ANSWER_S, left)
            try:
                raw = None  # a rank that never published has no key: get() would wait for it
                if bounded_store_call(lambda: self.store.check([key]), f"rank {r}'s progress record", limit):
                    raw = bounded_store_call(lambda: self.store.get(key), f"rank {r}'s progress record", limit)
            except StoreUnanswered as e:
                return records, others[i:], str(e)
            except Exception as e:  # noqa: BLE001 - a dead store must not hide the local diagnosis
                self._lose_store(e)
                return records, others[i:], f"the store could not be read ({type(e).__name__}: {e})"
            if raw is not None:
                records[r] = json.loads(raw)
        return records, [], ""

    def diagnose(self, op: Op | None = None) -> str:
        """Which ranks had not entered `op` and what each rank last ran (from the progress
        records every rank keeps in the store), plus this rank's recent collectives."""
        return self._diagnose(op).text

    def timeout_diagnosis(self, op: Op) -> str:
        """diagnose(op) and what to check, for a timed-out `op`. Ranks whose records predate
        calls they took part in are frozen or cut off, not out of order: the usual hint (the
        same collectives in the same order) would send the user after a bug that is not there;
        nor does that hint fit a send or a receive, which has its own (_p2p_hint)."""
        said = self._diagnose(op)
        if op.is_p2p:
            return f"{said.text} {self._p2p_hint(op)}"
        if said.lost:
            return (f"{said.text} Check that the processes of ranks {self._ranks(said.lost)} still run (not stopped by "
                    f"SIGSTOP or a debugger) and that their hosts are reachable")
        if said.unread and not said.missing:  # this rank may be the one cut off: the order is no suspect
            return (f"{said.text} Check that this rank reaches the group's store (MASTER_ADDR, or rank 0's host) "
                    f"and the hosts of ranks {self._ranks(said.unread)}, and that their processes still run")
        if said.inside == list(range(self.size)) and not said.mixed:  # nobody missing: not the order
            got = sum(_received(op).values())
            return (f"{said.text} Every rank had entered it and it had not finished (this rank had received {got} "
                    f"of its frames): a large call on a slow link or a busy host needs a longer time-out, which "
                    f"bounds the whole call; check the hosts' links and load")
        hint = "Check that every rank of the group calls the same collectives in the same order"
        if said.missing and not said.mixed:  # a rank cut off from the store (its host's link down)
            # publishes no more: its record says it had not entered a call it may be waiting in
            hint += (f", or, if ranks {self._ranks(said.missing)} did call it, that their processes still run and "
                     f"their hosts are reachable (a rank cut off from the store publishes no more progress)")
        return f"{said.text} {hint}"

    def _p2p_hint(self, op: Op) -> str:
        """What to check for a timed-out send or receive: its peer's matching call (a receive
        takes a message of its tag from its source, as long as the buffer or shorter), and the
        usual deadlock of point-to-point code, both ranks blocked in calls that wait on each
        other (two blocking sends past the transport's buffering, say)."""
        me = self.who(self.rank)
        tag = f"tag {op.tag}" if op.tag is not None else "its tag"
        size = f"{op.nbytes} bytes of {str(op.dtype).removeprefix('torch.')}"
        if op.direction == "send":
            want = f"{self.who(op.peer)} posts a recv from {me} with {tag} and room for {size}"
        else:
            sender = self.who(op.peer) if op.direction == "recv" and op.peer is not None else "a rank of the group"
            want = f"{sender} sends {me} a message with {tag}, of at most {size}"
        return f"Check that {want}, and that it does not block first in a call that waits on this rank"

    def _ranks(self, ranks: list[int]) -> str:
        """Members as the diagnosis lists them: "[1, 2]", or "[0 (global rank 1), 1 (global rank 2)]"
        in a subgroup, whose numbers read as global ranks blamed the wrong processes (see who)."""
        return "[" + ", ".join(self.who(r).removeprefix("rank ") for r in ranks) + "]"

    def _took_part(self, op: Op) -> dict[int, tuple[int, str, int]]:
        """Peer -> (seq, kind, call number) of the latest collective this rank knows it entered, from what
        this rank saw itself, not from the peer's progress record (published by its heartbeat
        every timeout/20, at most 1 s, and never again once its process is stopped or its host
        cut off):
        - a completed all-reduce (of one element or more) or barrier: every member's frames reach
          every member, so each had entered it. Not the rooted kinds (a root's broadcast may
          complete with its frames unread in the transport), nor the others, whose uneven or
          empty blocks may leave a rank nothing to receive from some member; point-to-point
          ops have no sequence number and involve two ranks, and are not recorded here;
        - a frame of `op` already received from the peer (an Execution counts them per peer);
        - a frame of a later collective, kept early in the mailbox (the peer is ahead)."""
        seen: dict[int, tuple[int, str, int]] = {}

        def saw(r: int, seq: int, kind: str, call: int) -> None:
            if r != self.rank and seq > seen.get(r, (-1, "", -1))[0]:
                seen[r] = (seq, kind, call)
        done = [(r.seq, r.kind, r.call) for r in list(self.records) if r.state == "done" and
                (r.kind == "barrier" or r.kind == "allreduce" and r.nbytes > 0)]
        if done:
            seq, kind, call = max(done)
            for r in range(self.size):
                saw(r, seq, kind, call)
        for r, n in _received(op).items():
            if n:
                saw(r, op.seq, _what(op), op.call)
        mailbox = getattr(self, "mailbox", None)
        if mailbox is not None:
            kept = []
            for (r, key), q in list(mailbox.early.items()):
                try:  # (the engine may take the frame meanwhile: read at most what is there)
                    kept.append((r, key, q[0][0]))
                except IndexError:
                    pass
            kept += [(r, key, h) for r, (key, h, _p) in list(mailbox.held.items())]
            for r, key, h in kept:
                if key[0] == "coll":
                    saw(r, key[1], _KIND_NAMES.get(h.kind, "collective"), _call_at(op, key[1]))
        return seen

    def _diagnose(self, op: Op | None) -> _Said:
        """diagnose()'s text, and what timeout_diagnosis asks of it (see _Said)."""
        def fmt(recent):  # [seq, kind, bytes, dtype, state, algorithm, call number]
            return ", ".join(f"#{a[1] if len(a) > 1 else s} {k} {n}B {st}" + (f" ({a[0]})" if a and a[0] else "")
                             for s, k, n, _dt, st, *a in recent) or NO_COLLECTIVE
        mine = self.progress_record()
        parts, lost, inside, missing, mixed = [], [], [], [], False
        collective = op is not None and not op.is_p2p
        peers, unread, why = self._peer_records() if collective else ({}, [], "")
        if collective:
            others = [r for r in range(self.size) if r != self.rank]
            took = self._took_part(op)
            # a record that predates a call its rank took part in says nothing of where it is now
            # (it had entered that call, and maybe this one): the rank stopped publishing
            stale = [r for r in others if r in peers and r in took and peers[r]["issued"] <= took[r][0]]
            quiet = [r for r in others if r not in peers and r not in unread and r in took]
            lost = stale + quiet
            missing = [r for r in others if r in peers and r not in lost and peers[r]["issued"] <= op.seq]
            silent = [r for r in others if r not in peers and r not in unread and r not in lost]
            inside = [r for r in range(self.size) if r not in missing and r not in silent and r not in unread
                      and (r not in lost or took[r][0] >= op.seq)]

            def calls(ranks):
                return ", ".join(f"{self.who(r)}: {took[r][1]} seq {took[r][2]}" for r in ranks)
            if unread:
                parts.append(f"The progress of ranks {self._ranks(unread)} is unknown: {why};")
            if missing:  # a record is as old as its rank's last heartbeat: a rank frozen (SIGSTOP, a
                # debugger) just after entering the call is not in it yet, so say how old it is
                age = max(0.0, time.time() - min(peers[r].get("t", time.time()) for r in missing))
                parts.append(f"Ranks {self._ranks(missing)} had not entered {_what(op)} seq {op.call} by their "
                             f"progress records (the oldest {age:.1f}s old);")
            if stale:
                age = max(0.0, time.time() - min(peers[r].get("t", time.time()) for r in stale))
                parts.append(f"the progress records of ranks {self._ranks(stale)} (the oldest {age:.1f}s old) "
                             f"predate calls they took part in ({calls(stale)});")
            if quiet:
                parts.append(f"ranks {self._ranks(quiet)} published no progress record, though they took part in calls "
                             f"({calls(quiet)});")
            if lost:
                parts.append("their processes may be frozen or stopped (SIGSTOP, a debugger), or their hosts "
                             "unreachable;")
            if silent:
                parts.append(f"ranks {self._ranks(silent)} published no progress record;")
            parts.append(f"ranks {self._ranks(inside)} had entered it.")
            parts[0] = parts[0][:1].upper() + parts[0][1:]  # (whichever of the above comes first)
            # ranks that chose different algorithms for one call may send to disjoint peers (a
            # ring beside a hierarchical grid): no frame meets its checksum, all wait
            ran = {r: a[0] for r, p in [*peers.items(), (self.rank, mine)] for s, _k, _n, _dt, _st, *a in p["recent"]
                   if s == op.seq and a and a[0]}
            mixed = len(set(ran.values())) > 1
            if mixed:
                parts.append("The ranks run it by different algorithms ("
                             + ", ".join(f"{self.who(r)}: {a}" for r, a in sorted(ran.items()))
                             + "): set NEURON_DIST_ALGO and NEURON_DIST_TUNING alike on every rank.")
            for r in sorted(peers):
                p = peers[r]
                parts.append(f"{self.who(r).capitalize()} last ran" + (" (by that old record)" if r in stale else "")
                             + f": {fmt(p['recent'])} (next seq {p.get('calls', p['issued'])}"
                             + (f", broken: {p['broken']}" if p.get("broken") else "") + ").")
        me = self.who(self.rank).capitalize()  # "Rank 0 (global rank 1)" in a subgroup
        parts.append(f"{me} (this rank) last ran: {fmt(mine['recent'])}.")
        return _Said(" ".join(parts), lost, inside, missing, unread, mixed)

    def dump(self) -> str:
        """Human-readable record of this group's recent collectives (also via NEURON_DIST_DUMP /
        NEURON_DIST_DUMP_SIGNAL)."""
        lines = [f"neuron_dist group {self.name!r} rank {self.rank}/{self.size} pid {os.getpid()}: "
                 f"next seq {self._calls}, broken: {self.broken or 'no'}"]
        for r in list(self.records):
            took = (r.t_end - r.t_start) * 1e3 if r.t_end else 0.0
            kind = f"{r.checks} check" if r.checks else r.kind
            lines.append(f"  #{r.call} {kind} {r.nbytes}B {r.dtype} {r.algorithm or '-'} {r.state}"
                         + (f" {took:.2f} ms" if r.t_end else ""))
        return "\n".join(lines)

    def _dump_if_asked(self, why: str) -> None:
        where = env_target("NEURON_DIST_DUMP")
        if where:
            emit(f"[{why}]\n{self.dump()}\n", where)


def dump_all() -> str:
    """The records of every open group of this process."""
    return "\n".join(g.dump() for g in list(LIVE))


_SIGNAL_INSTALLED = False
_SIGNAL_WARNED = False  # the off-main-thread warning, given once


_DUMPING = threading.local()


def _dump_on_signal(where: str) -> None:
    """The dump signal's handler: it runs between two bytecodes of whatever the main thread was
    doing (a collective, often), so nothing may escape it, and a signal arriving while it still
    writes does not start a second dump inside the first (under a storm of signals the dumps
    nested until a RecursionError broke the collective beneath)."""
    if getattr(_DUMPING, "on", False):
        return
    _DUMPING.on = True
    try:
        emit(dump_all() + "\n", where)
    except Exception:  # noqa: BLE001 - a diagnostic must never fail the call it interrupted
        pass
    finally:
        _DUMPING.on = False


def install_dump_signal() -> None:
    """NEURON_DIST_DUMP_SIGNAL=USR1 (or USR2): on that signal, write every group's record to
    NEURON_DIST_DUMP (a path) or stderr. Installed once, from the main thread only (Python runs
    handlers there); the name is checked on every thread, so a group made on another thread
    refuses a bad one as the main thread's would, and warns that it installs nothing."""
    global _SIGNAL_INSTALLED, _SIGNAL_WARNED
    name = (env("NEURON_DIST_DUMP_SIGNAL") or "").strip().upper()
    if not name or _SIGNAL_INSTALLED:
        return
    signum = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if not isinstance(signum, signal.Signals):
        raise ValueError(f"NEURON_DIST_DUMP_SIGNAL={name!r} is not a signal name (try USR1)")
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"NEURON_DIST_DUMP_SIGNAL={name!r}: that signal cannot be caught; try USR1")
    if threading.current_thread() is not threading.main_thread():
        if not _SIGNAL_WARNED:
            _SIGNAL_WARNED = True
            log.warning("NEURON_DIST_DUMP_SIGNAL=%s: not installed (the group was made off the main thread, and "
                        "Python installs signal handlers only from there)", name)
        return
    where = env_target("NEURON_DIST_DUMP") or "stderr"
    try:
        signal.signal(signum, lambda *_: _dump_on_signal(where))
    except (OSError, ValueError, RuntimeError) as e:  # (a signal the platform refuses)
        raise ValueError(f"NEURON_DIST_DUMP_SIGNAL={name!r}: cannot handle that signal ({e}); try USR1") from None
    _SIGNAL_INSTALLED = True
