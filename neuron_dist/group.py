"""The group: membership, connections, ordering and the progress engine of one process group.

Everything here is independent of c10d's calling conventions (that is `c10d.py`'s job):
operations arrive as `Op` objects, are numbered at submission (the same order on every rank,
since every rank issues collectives in the same order), and are driven by one engine thread
per group, so asynchronous collectives overlap the caller's compute. Collectives run one at a
time in sequence order; point-to-point transfers run beside them, serialised per peer and
direction so the frames of two messages never interleave.

A failed collective (mismatch, dead peer, time-out) breaks the group, as in NCCL: every pending
and later operation fails with an error that names the original cause.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives.executor import Execution, Mailbox, Stamp
from .collectives.schedule import Schedule
from .transport.base import TransportContext
from .transport.frame import Kind

log = logging.getLogger("neuron_dist.init")
coll_log = logging.getLogger("neuron_dist.coll")

RECORD_LEN = 64  # recent collectives kept per group for hang diagnosis


class GroupError(dist.DistBackendError):
    """A collective failed: names the rank, the collective, its sequence number and the cause."""


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

    def __init__(self, kind: Kind, desc: str, start, finish=None, outputs=(), peer: int | None = None,
                 direction: str = "", nbytes: int = 0, dtype: torch.dtype = torch.uint8, algorithm: str = ""):
        self.kind, self.desc, self._start, self._finish = kind, desc, start, finish
        self.outputs = list(outputs)
        self.peer, self.direction = peer, direction
        self.nbytes, self.dtype, self.algorithm = nbytes, dtype, algorithm
        self.seq = -1
        self.exe: Execution | None = None
        self.t0 = 0.0
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.source_rank = peer if peer is not None else -1
        self.record: Record | None = None
        self._callbacks: list = []
        self._lock = threading.Lock()

    @property
    def is_p2p(self) -> bool:
        return self.kind == Kind.P2P

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self.event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def complete(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self.event.is_set():
                return
            self.error = error
            self.event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a user's future callback must not kill the engine
                log.exception("completion callback failed")

    def wait(self, timeout: float | None = None) -> None:
        if not self.event.wait(timeout):
            raise GroupError(f"{self.desc}: wait() timed out after {timeout:.1f}s")
        if self.error is not None:
            raise self.error


def _group_hash(name: str) -> int:
    return zlib.crc32(name.encode()) | (len(name) << 32)


def _bind_addr() -> str:
    """The address this job's traffic uses: the interface that reaches MASTER_ADDR."""
    forced = os.environ.get("NEURON_DIST_BIND_ADDR")
    if forced:
        return forced
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        ip = socket.gethostbyname(master)
    except OSError:
        return "127.0.0.1"
    if ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError:
            return "0.0.0.0"


class Group:
    """Connections and the progress engine of one process group."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, name: str = "0",
                 global_ranks: list[int] | None = None):
        from .transport import select as transport_select
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.name = name
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self.group_id = _group_hash(name)
        self.records: deque[Record] = deque(maxlen=RECORD_LEN)
        self.stats: dict[tuple[str, str], list] = {}
        self.broken: BaseException | None = None
        self.closed = False
        self._abort = False
        self._seq = 0
        t0 = time.perf_counter()
        # -- meet the peers through the store ------------------------------------------------
        if rank == 0:
            store.set("token", str(secrets.randbits(63)))
        self.token = int(store.get("token"))
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        me.update(self._placement_info())
        store.set(f"peer/{rank}", json.dumps(me))
        self.peers_info = [json.loads(store.get(f"peer/{r}")) for r in range(size)]
        self.hosts = [p["host"] for p in self.peers_info]
        self.topology, self.order = self._build_topology()
        ctx = TransportContext(rank=rank, size=size, store=store, token=self.token, timeout=timeout,
                               hostname=me["host"], bind_addr=_bind_addr(), hosts=self.hosts,
                               job_id=f"{self.token:x}"[:12])
        self.transport = transport_select.create(ctx)
        self.mailbox = Mailbox(self.transport, rank)
        # -- the engine ------------------------------------------------------------------------
        self._cv = threading.Condition()
        self._queue: deque[Op] = deque()
        self._thread = threading.Thread(target=self._engine, name=f"neuron_dist-{name}", daemon=True)
        self._thread.start()
        log.debug("group %s rank %d/%d up in %.1f ms over %s", name, rank, size,
                  (time.perf_counter() - t0) * 1e3, self.transport.name)

    # -- topology ----------------------------------------------------------------------------
    def _placement_info(self) -> dict:
        try:
            from . import topology
            env = os.environ
            local_rank = int(env.get("LOCAL_RANK", self.rank))
            local_world = int(env.get("LOCAL_WORLD_SIZE", self.size))
            world_rank = int(env.get("RANK", self.rank))
            world = int(env.get("WORLD_SIZE", self.size))
            slot = topology.placement_from_env(env, world_rank, world, local_rank, local_world)
            return {"slot": slot.to_dict()}
        except (ImportError, AttributeError):  # topology not available: plain ring order
            return {}

    def _build_topology(self):
        try:
            from . import topology
        except ImportError:
            return None, list(range(self.size))
        if not all("slot" in p for p in self.peers_info):
            return None, list(range(self.size))
        slots = [topology.Slot.from_dict(p["slot"]) for p in self.peers_info]
        topo = topology.GroupTopology(topology.get_instance(slots[0].instance), slots)
        return topo, list(topology.ring_order(topo))

    def choose(self, collective: str, nbytes: int) -> str:
        from .collectives.select import choose
        return choose(collective, nbytes, self)

    # -- submission --------------------------------------------------------------------------
    def submit(self, op: Op) -> Op:
        with self._cv:
            if self.broken is not None:
                op.complete(GroupError(f"[rank {self.rank}] {op.desc}: the group is unusable after an "
                                       f"earlier failure: {self.broken}"))
                return op
            if self.closed:
                op.complete(GroupError(f"[rank {self.rank}] {op.desc}: the process group was destroyed"))
                return op
            if not op.is_p2p:
                op.seq = self._seq
                self._seq += 1
                op.record = Record(op.seq, op.kind.name.lower(), op.nbytes, str(op.dtype).replace("torch.", ""),
                                   op.algorithm)
                self.records.append(op.record)
            self._queue.append(op)
            self._cv.notify()
        return op

    def stamp(self, op: Op, dtype: torch.dtype, tag: int = 0) -> Stamp:
        seq = op.seq if not op.is_p2p else op.nbytes
        return Stamp(op.kind, dtype, self.token, self.group_id, seq, tag)

    def execution(self, op: Op, schedule: Schedule, bufs, reduce, dtype: torch.dtype, tag: int = 0) -> Execution:
        from .collectives.executor import FRAME_BYTES
        from .config import env_int
        return Execution(schedule, bufs, reduce, self.stamp(op, dtype, tag), self.rank, self.mailbox,
                         env_int("NEURON_DIST_FRAME_BYTES", FRAME_BYTES))

    # -- the engine --------------------------------------------------------------------------
    def _engine(self) -> None:
        active: list[Op] = []
        waiting: deque[Op] = deque()
        while True:
            if self._abort:
                err = GroupError(f"[rank {self.rank}] the process group was aborted")
                for o in active + list(waiting):
                    self._done(o, GroupError(f"[rank {self.rank}] {o.desc}: {err}"))
                return
            with self._cv:
                while not self._queue and not active and not waiting and not self.closed:
                    self._cv.wait()
                if self.closed and not self._queue and not active and not waiting:
                    return
                waiting.extend(self._queue)
                self._queue.clear()
            self._admit(active, waiting)
            moved = False
            for op in list(active):
                try:
                    if op.exe is None:
                        op.t0 = time.monotonic()
                        if op.record:
                            op.record.state, op.record.t_start = "running", time.perf_counter()
                        op.exe = op._start(op)
                        moved = True
                    moved |= op.exe.progress()
                    if op.exe.done:
                        if op._finish:
                            op._finish(op)
                        active.remove(op)
                        self._done(op, None)
                        moved = True
                except BaseException as e:  # noqa: BLE001 - every failure must reach wait()
                    active.remove(op)
                    self._fail(op, e, active, waiting)
                    moved = True
            if not moved and active:
                self._check_stalled(active, waiting)
                self.transport.wait(0.005)

    def _admit(self, active: list[Op], waiting: deque[Op]) -> None:
        busy_coll = any(not o.is_p2p for o in active)
        busy_p2p = {(o.direction, o.peer) for o in active if o.is_p2p}
        for op in list(waiting):
            if op.is_p2p:
                key = (op.direction, op.peer)
                if key in busy_p2p:
                    continue
                busy_p2p.add(key)
            else:
                if busy_coll:
                    continue
                busy_coll = True
            waiting.remove(op)
            active.append(op)

    def _done(self, op: Op, error) -> None:
        if op.record:
            op.record.state = "failed" if error else "done"
            op.record.t_end = time.perf_counter()
            if not error:
                st = self.stats.setdefault((op.record.kind, op.algorithm), [0, 0, 0.0, {}])
                st[0] += 1
                st[1] += op.nbytes
                st[2] += op.record.t_end - op.record.t_start
                st[3][op.nbytes] = st[3].get(op.nbytes, 0) + 1
        op.complete(error)

    def _fail(self, op: Op, e: BaseException, active: list[Op], waiting: deque[Op]) -> None:
        if not isinstance(e, dist.DistBackendError):
            err = GroupError(f"[rank {self.rank}] {op.desc} (seq {op.seq}) failed: {e}")
            err.__cause__ = e
        else:
            err = e
        coll_log.debug("%s", err)
        self._done(op, err)
        # the peers' view of this group is now unknown: nothing after it can be trusted
        with self._cv:
            self.broken = err
            rest = active[:] + list(waiting) + list(self._queue)
            active.clear()
            waiting.clear()
            self._queue.clear()
        for o in rest:
            self._done(o, GroupError(f"[rank {self.rank}] {o.desc}: not run, the group failed: {err}"))

    def _check_stalled(self, active: list[Op], waiting: deque[Op]) -> None:
        now = time.monotonic()
        limit = self.timeout.total_seconds()
        for op in list(active):
            peer = op.exe.waiting_on if op.exe else None
            if peer is not None:
                gone = self.transport.check_peer(peer)
                if gone:
                    active.remove(op)
                    self._fail(op, GroupError(
                        f"[rank {self.rank}] {op.desc} (seq {op.seq}) failed: rank {peer} is gone: {gone}"),
                        active, waiting)
                    return
            if now - op.t0 > limit:
                active.remove(op)
                who = f"waiting for rank {peer}" if peer is not None else "waiting to send"
                self._fail(op, GroupError(
                    f"[rank {self.rank}] {op.desc} (seq {op.seq}) timed out after {limit:.1f}s {who}. "
                    f"{self.diagnose()} Check that every rank of the group calls the same collectives "
                    f"in the same order, or raise the timeout in init_process_group/new_group."),
                    active, waiting)
                return

    def diagnose(self) -> str:
        recent = ", ".join(f"#{r.seq} {r.kind} {r.nbytes}B {r.state}" for r in list(self.records)[-4:])
        return f"Recent collectives on rank {self.rank}: {recent}."

    # -- reporting and shutdown ----------------------------------------------------------------
    def report(self) -> list[dict]:
        """Per (collective, algorithm): calls, bytes, measured host time, modelled device time."""
        rows = []
        for (kind, algo), (calls, nbytes, host, sizes) in sorted(self.stats.items()):
            model = None
            if self.topology is not None:
                try:
                    from .topology import estimate
                    model = sum(n * estimate(kind, algo, b, self.topology) for b, n in sizes.items())
                except (ImportError, ValueError, KeyError):
                    model = None
            rows.append(dict(collective=kind, algorithm=algo, calls=calls, bytes=nbytes,
                             host_s=host, model_device_s=model))
        return rows

    def close(self, abort: bool = False) -> None:
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self._abort = abort
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for op in pending:
            op.complete(GroupError(f"[rank {self.rank}] {op.desc}: the process group was destroyed"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=0.5 if abort else self.timeout.total_seconds())
        self.transport.close(abort=abort) if _accepts_abort(self.transport) else self.transport.close()


def _accepts_abort(t) -> bool:
    import inspect
    return "abort" in inspect.signature(t.close).parameters
