"""The group: ordering, the progress engine and failure handling of one process group (how its
members meet and connect is `meeting.py`'s, which ops may start next `waiting.py`'s).

Everything here is independent of c10d's calling conventions (that is `c10d.py`'s job):
operations arrive as `Op` objects, are numbered at submission (the same order on every rank,
since every rank issues collectives in the same order), and are driven by one engine thread
per group, so asynchronous collectives overlap the caller's compute (an op of up to 1 MiB that
finds the group idle starts on the caller's own thread instead, for a bounded time before the
engine takes it over: `submit`, `_run_inline`). Collectives run one at a time in sequence
order; point-to-point transfers run beside them, one at a time per direction, peer and tag, so
the frames of two messages of one (peer, tag) never interleave (the mailbox sorts a peer's
frames by tag: messages of other tags may).

A failed collective (mismatch, dead peer, time-out) breaks the group, as in NCCL: every pending
and later operation fails with an error that names the original cause.
"""
from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import os
import resource  # (imported here: at the descriptor limit an import fails)
import signal
import threading
import time
import weakref
import zlib
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives.executor import (BarredFrameRecv, Execution, Mailbox, PairExchange, SingleFrameRecv,
                                   MAX_KEPT_FRAMES, SingleFrameSend, Stamp, execution_plan,
                                   one_copied_frame)
from .collectives.schedule import Schedule
from .collectives.scratch import Scratch, scratch_bytes_setting
from .deathwatch import DeathWatch
from .diagnosis import LIVE, HangDiagnosis, install_dump_signal
from .errors import GroupError, exit_cause, headline  # (GroupError re-exported: debug imports it from here)
from . import meeting
from .meeting import GroupMeeting
from .mpi_env import finalizes_at_exit
from .op import CallbackRunner, Op, Record
from .transport.base import PEER_GRACE_S, TransportError, descriptor_advice
from .transport.frame import Kind, frame_bytes_setting
from .waiting import Waiting

log = logging.getLogger("neuron_dist.init")
coll_log = logging.getLogger("neuron_dist.coll")

RECORD_LEN = 64  # recent collectives kept per group for hang diagnosis
INLINE_BYTES = 1 << 20       # unmarked ops up to this size may run on the caller's thread
INLINE_BUDGET = 0.0005       # ... for at most this long before the engine takes over
INLINE_SYNC_BUDGET = 0.05    # synchronous ops (asyncOp=False): the caller waits anyway
STATS_SIZES = 512  # distinct (collective, algorithm, size) rows a group counts exactly, for NEURON_DIST_REPORT
SWEEP_INTERVAL_S = 0.05  # a stalled collective looks at every member this often (who went first)
LOOK_INTERVAL_S = 0.01  # a waiting op looks at the peers it waits on this often (at most)
# A stalled engine waits on its transport for half the stall so far, within these, and never
# past the moment something falls due that no peer's word would wake it for (an op's time-out,
# the end of a gone peer's grace). Every frame, freed slot, peer's close or failure and new
# call wakes it at once; a peer that dies without a word is seen within STALL_WAIT_MAX_S. A
# wake-up costs a sleeping engine ~0.27 ms of CPU on the VMs measured (mostly the futex's own
# return): with a quarter of the stall and a 0.1 s cap, a rank that waited 2 s for a late peer
# woke 36 times (0.6% of a core, and a fixed 5 ms wait ~2% over zmq); now ~16
STALL_WAIT_MIN_S, STALL_WAIT_MAX_S = 0.005, 0.25
DUE_SLACK_S = 0.001  # a wait for something due ends just past it (time-outs are "more than")
# how much longer than the group's time-out a destroy waits for work still running (`close`): an
# op the engine started as the destroy began (an isend just before destroy_process_group) is
# due at the same moment as the destroy's own wait, and whichever came first decided its error:
# its time-out, naming the peer it waited on, or "the process group was aborted" (which the
# caller never asked for, sent to the peers as the cause), run by run (review BI). This margin
# lets the op's own time-out come first
DESTROY_GRACE_S = 0.5
# how an exiting rank's ABORT names its cause (`_close_at_exit`), and how long a same-host peer
# that fails on it waits for that rank's process to end before telling its caller
# (`_let_the_exiting_go_first`), once per exiting process: a process that has imported torch ends
# 0.45-0.5 s after its last atexit handler here (the interpreter's finalization; 7 ms without torch),
# but 2 s and over 3 s on a loaded 2-core host, where a 3 s bound ran out first and mpirun named a
# peer (4 of 15 runs of test_mpirun_names_the_rank_that_raised_not_a_peer_that_failed_on_it at load
# 7-9). The wait ends as the process does: the bound costs only where one lingers (an exit handler
# after ours)
EXITING = "exiting on an uncaught"
EXIT_FIRST_S = 10.0
# how an ABORT sent as the process exits with work still pending names itself; every exit's
# ABORT reads "[rank N] exiting ..." (an orderly close at exit says so in its goodbye instead:
# `Transport.peer_exiting`)
EXITING_PENDING = "exiting with work still pending (no destroy_process_group)"


_PLAN_KEYS = itertools.count()  # one per group in this process: see Group.execution
_KIND_NAMES = {k: k.name.lower() for k in Kind}  # enum .name is slow on the per-call path
_P2P = Kind.P2P
_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _group_hash(name: str) -> int:
    return zlib.crc32(name.encode()) | (len(name) << 32)


def _from_signal_handler(e: BaseException) -> bool:
    """Whether `e` was raised by a Python signal handler that ran while the caller's thread drove
    its call (a time limit's SIGALRM handler, say): the caller's own exception, which it must get
    as it would from Gloo's call, not a GroupError ("... failed: alarm") its `except` misses. The
    call itself is failed all the same: it was stopped at an arbitrary point of its schedule."""
    handlers = set()
    for sig in signal.valid_signals():
        h = signal.getsignal(sig)
        code = getattr(getattr(h, "__func__", h), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def _close_at_exit() -> None:
    """Close the groups a process leaves open (no destroy_process_group) before the interpreter
    finalizes. Otherwise an engine thread (a daemon) can be inside a torch op, with the GIL
    released, when finalization begins; taking the GIL back then ends the thread with
    pthread_exit, whose unwinding through torch's C++ frames calls std::terminate: the process
    died with SIGABRT ('terminate called without an active exception') instead of its exit
    status. A group with work still pending is aborted (its peers are told); an idle one closes
    in order, as destroy_process_group would. A process that exits on an uncaught exception
    (`sys.last_value`, set as the interpreter prints it) aborts every group it leaves, and its
    ABORT frames say why: closed in order, it had a same-host peer waiting on it fail on "rank 3
    closed its shared-memory transport" and exit first, and the launcher's summary blamed that
    peer instead of the exception. Any other exit (`sys.exit(3)`, the program's end) says so
    too, in its ABORT or in its orderly goodbye (`exiting`), for the same reason: told "rank 3
    closed its shared-memory transport", a peer that still needed it failed and exited ~0.5 s
    before rank 3's process ended, and torchrun's summary named that peer in 4 of 6 runs. Not
    where MPI_Finalize will keep this process until its peers end (`mpi_env.finalizes_at_exit`):
    a peer would wait its EXIT_FIRST_S for nothing."""
    cause = exit_cause()
    ends_first = not finalizes_at_exit()
    for g in list(LIVE):
        why = f"{EXITING} {cause}" if cause else EXITING_PENDING if g._queue or g._active or g._waiting else None
        if why is None:
            g.close(exiting=ends_first)
        else:  # (worded without the "[rank N] exiting" a peer waits on where MPI_Finalize holds us)
            me = g.who(g.rank)
            g.close(abort=True, reason=f"[{me}] {why}" if ends_first else f"{me} is {why}")


atexit.register(_close_at_exit)


def _forget_groups_in_child() -> None:
    """A forked child (a DataLoader worker, a subprocess helper) inherits the parent's groups but
    none of their threads: at its exit, closing them would mark the parent's shared-memory
    transport closed and send its peers ABORT frames, failing the parent's group; a collective
    on them would write into the parent's rings or hang (torch's groups are not for use in a
    forked child). The child forgets them, and a call on one fails at once saying why (with
    fresh locks: a thread of the parent may have held one at the fork)."""
    for g in list(LIVE):
        LIVE.discard(g)
        g._inherited = True
        g._mu = threading.RLock()
        g._cv = threading.Condition(g._mu)
        g._drive = threading.Lock()
        g.broken = GroupError(f"[{g.who(g.rank)}] group {g.name!r} belongs to the process that created it; this "
                              f"is a forked child (pid {os.getpid()}), which cannot use it: create groups in "
                              f"the child, or start it with the spawn method")
    meeting.WORLD["id"] = None  # the parent's world: a group the child makes belongs to a world of its own


os.register_at_fork(after_in_child=_forget_groups_in_child)

def _descriptors_full() -> bool:
    """Whether this process is at its descriptor limit: a group's set-up that ran out failed
    with whatever call hit it first, naming no rank, group or limit (an import's "Too many open
    files: '.../mpi.py'")."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    try:
        return len(os.listdir("/proc/self/fd")) >= limit - 4  # (the listing takes a descriptor of its own)
    except OSError as e:
        return e.errno == errno.EMFILE


def _who(global_ranks: list[int], r: int) -> str:
    """`Group.who`, given the group's global ranks."""
    g = global_ranks[r] if r < len(global_ranks) else r
    return f"rank {r}" if g == r else f"rank {r} (global rank {g})"


class Group(GroupMeeting, HangDiagnosis):
    """Connections and the progress engine of one process group."""

    _next_look = 0.0  # when a waiting op next looks at its peers' liveness (_check_stalled)
    _inherited = False  # a forked child's copy of its parent's group (_forget_groups_in_child)
    _deaths = None  # its DeathWatch, once its transport is up
    _graces = None  # per member, how long after it is seen gone its frames may still land (transport.gone_grace)

    def __init__(self, store, rank: int, size: int, timeout: timedelta, name: str = "0",
                 global_ranks: list[int] | None = None, outside_autograd=torch.no_grad):
        """`outside_autograd`: the context the data path runs in, on the engine thread and on the
        caller's (see `_drive_ops`). The c10d adapter passes torch's guard that dispatches below
        autograd and its in-place/view bookkeeping, as Gloo's C++ writes: under no_grad alone an
        in-place write into a tensor made under `torch.inference_mode()` is refused."""
        from .collectives import select as algorithm_select
        from .transport import select as transport_select
        if not 0 <= rank < size:  # torch passes env:// RANK as it is (Gloo: "rank < size. 2 vs 2"); a -1
            # indexed the member list from its end and posed as the last rank until the time-out
            raise ValueError(f"[rank {rank}] group {name!r}: rank {rank} is outside the group's ranks 0..{size - 1} "
                             f"(size {size}); check RANK and WORLD_SIZE")
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self._outside_autograd = outside_autograd
        self.name = name
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self.group_id = _group_hash(name)
        self._plan_key = next(_PLAN_KEYS)  # this group's frame plans on a schedule (execution)
        self.records: deque[Record] = deque(maxlen=RECORD_LEN)
        # (kind, algorithm, bytes, or minus a power-of-two bin past STATS_SIZES) -> [calls, host s, bytes]
        self.stats: dict[tuple[str, str, int], list] = {}
        self.broken: BaseException | None = None
        self.closed = False
        self._abort = False
        self._abort_why = "the process group was aborted"  # what the engine fails its ops with then
        self._seq = 0    # collectives numbered, for their frames
        self._calls = 0  # the user's collectives numbered (a debug check's exchange shares its call's)
        t0 = time.perf_counter()
        # -- what this rank can check alone, before any store traffic ------------------------
        # a bad setting is published to the peers below, so they fail with it at once (they
        # would otherwise wait for this rank's records until the group's time-out)
        from . import debug
        self.frame_bytes = forced = None
        self.check_wanted = False  # whether its collectives are checked (debug.wanted, read below)
        choice = {}  # NEURON_DIST_ALGO and _TUNING, normalized (a bad value: this rank's error, published)
        try:
            install_dump_signal()  # a bad NEURON_DIST_DUMP_SIGNAL fails here, holding nothing yet
            self.check_wanted = debug.wanted()  # so does a bad NEURON_DIST_CHECK
            self.frame_bytes = frame_bytes_setting()  # the shared-memory slots are sized from the same setting
            self.scratch = Scratch(scratch_bytes_setting())  # the collectives' TMP, kept between calls
            forced = transport_select.settings()  # NEURON_DIST_TRANSPORT and the transports' own
            choice = algorithm_select.check_settings()  # NEURON_DIST_TUNING and NEURON_DIST_ALGO
            placement, placement_error = self._placement_info(), None
        except (ValueError, KeyError, OSError) as e:
            placement, placement_error = None, e
        # -- meet the peers through the store ------------------------------------------------
        # a store can outlive the group (torchrun's agent store; one a caller passes again after
        # destroy_process_group), and torch reuses group names after a destroy: the generation
        # keeps every key of a new group apart from an old one's; and a job that torch's elastic
        # agent restarts (--max-restarts) meets the failed attempt's keys in the agent's store,
        # which lives on across attempts: the attempt number keeps them apart
        attempt = meeting.elastic_attempt()
        members = f"{zlib.crc32(','.join(map(str, self.global_ranks)).encode()):08x}"  # the member list's key
        with meeting.forming(name, self.global_ranks[rank], self.who(rank)) as beside_others:
            if beside_others:  # (threads making groups at once)
                store = meeting.own_connection(store)
            try:
                key, generation = self._generation(store, attempt, members)
            except dist.DistNetworkError as e:
                raise self._lost_store_error(e) from None
            try:
                self._meet(dist.PrefixStore(f"gen-{attempt}.{generation}/", store), members, placement,
                           placement_error, forced, choice)
                self._start_engine(t0)
                if not dist.is_initialized():  # this world's default group, now formed (`_meet`)
                    meeting.WORLD["id"] = self.job_id
            except BaseException as e:
                meeting.retire_generation(store, key, generation, size)
                # the transports say so themselves; elsewhere the call that hit the limit named none
                # (an OSError naming a module file, zmq's "Authenticator thread failed to start")
                if isinstance(e, Exception) and not isinstance(e, (GroupError, TransportError)) and _descriptors_full():
                    raise GroupError(f"[{self.who(rank)}] group {name!r} cannot be set up, out of descriptors: "
                                     f"{descriptor_advice()} ({type(e).__name__}: {e})") from None
                if isinstance(e, dist.DistNetworkError):
                    raise self._lost_store_error(e) from None
                raise

    def _lost_store_error(self, e: BaseException) -> GroupError:
        """The members' store gone while they met (its host: rank 0's process under env://, a
        launcher's agent): torch's words alone ("DistNetworkError: Connection reset by peer")
        named no rank, group or step."""
        return GroupError(f"[{self.who(self.rank)}] group {self.name!r}: the store was lost while the members met "
                          f"(its host gone: rank 0's process under env://, a launcher's agent): "
                          f"{headline(e)}")

    def _start_engine(self, t0: float) -> None:
        """Once the members have met and the transport is up: the mailbox, the watch on same-host
        peers' processes, the engine thread and the progress record's thread."""
        rank, size, name = self.rank, self.size, self.name
        # (a partial over the member list, not the bound `who`: the group would be in a cycle
        # through its mailbox, kept alive past its destroy until the cyclic collector ran)
        self.mailbox = Mailbox(self.transport, rank, functools.partial(_who, self.global_ranks))
        self._deaths = DeathWatch(self, self.hosts[rank])
        self._graces = [self.transport.gone_grace(p) if p != rank else 0.0 for p in range(size)]
        # -- the engine ------------------------------------------------------------------------
        self._mu = threading.RLock()          # the engine's condition's lock (entered directly on the hot path)
        self._cv = threading.Condition(self._mu)
        self._queue: deque[Op] = deque()
        self._active: list[Op] = []          # ops the engine drives (only under self._drive)
        self._waiting = Waiting()           # taken from the queue, not yet started
        self._drive = threading.Lock()       # held by whoever drives the transport
        self._callback_runner = CallbackRunner(f"neuron_dist-{name}")
        self._thread = threading.Thread(target=self._engine, name=f"neuron_dist-{name}", daemon=True)
        self._thread.start()
        self._start_failure_watch()
        log.debug("group %s rank %d/%d up in %.1f ms over %s", name, rank, size,
                  (time.perf_counter() - t0) * 1e3, self.transport.name)

    # -- submission --------------------------------------------------------------------------
    def submit(self, op: Op) -> Op:
        """Number the op and queue it for the engine, or run it right here (the fast path).

        The fast path skips two thread hand-offs (tens of microseconds each): when the engine is
        idle and nothing is queued, the caller's thread takes the drive lock and runs the op
        itself. It applies to ops marked synchronous (`op.sync = True`, set from c10d's
        `opts.asyncOp=False`) and, when unmarked, to small ops (INLINE_BYTES) that finish in
        microseconds: collectives and sends for up to INLINE_BUDGET, a receive for one pass only
        (taking what has already arrived: it may depend on a send the caller issues next). If
        the op is not done within its budget (a late peer), it is handed to the engine, which
        owns time-outs and peer checks."""
        sync = op.sync
        held = False  # the drive lock, taken for a run on this thread
        try:
            with self._mu:
                if self.broken is not None:
                    op.complete(GroupError(f"[{self.who(self.rank)}] {op.desc}: the group is unusable after an "
                                           f"earlier failure: {self.broken}"))
                    return op
                if self.closed:
                    op.complete(GroupError(f"[{self.who(self.rank)}] {op.desc}: the process group was destroyed"))
                    return op
                p2p = op.kind == _P2P
                if not p2p:
                    op.seq = self._seq
                    self._seq += 1
                    op.call = self._calls
                    if not op.checks:  # (a check's exchange: its call, next, takes the number)
                        self._calls += 1
                    op.record = Record(op.seq, _KIND_NAMES[op.kind], op.nbytes, _dtype_name(op.dtype), op.algorithm,
                                       call=op.call, checks=op.checks and op.checks.split("(")[0])
                    self.records.append(op.record)
                # an unmarked receive may wait on a send this caller has yet to issue: it only takes
                # what has already arrived here, and the engine waits for the rest
                recv = p2p and op.direction != "send"
                held = (sync or (sync is None and op.nbytes <= INLINE_BYTES)) and self._drive.acquire(blocking=False)
                if held and (self._queue or self._active or self._waiting.n):  # (.n: no __len__ call)
                    held = False
                    self._drive.release()
                if not held:
                    self._queue.append(op)
                    self._cv.notify()
                    if self._active or self._waiting.n:  # the engine may sleep in the transport's wait
                        self.transport.wake()            # on them: it takes this op up now
                    return op
            try:
                with self._outside_autograd():  # as on the engine thread: see _drive_ops
                    self._run_inline(op, INLINE_SYNC_BUDGET if sync else 0.0 if recv else INLINE_BUDGET)
            finally:
                held = False
                self._drive.release()
        except BaseException as e:
            # raised into this thread between taking the drive lock and running the op (a signal
            # handler's exception: Ctrl-C, an alarm's time limit): the lock stayed held, the
            # engine blocked on it for good, and the op, numbered, never ran while the peers
            # waited for it. Fail the op and the group (the peers are told), then let go.
            if held:
                try:
                    if not op.finished:
                        self._fail(op, e, self._active, self._waiting)
                finally:
                    self._drive.release()
            raise
        return op

    def _run_inline(self, op: Op, budget: float) -> None:
        """Drive `op` on the caller's thread (drive lock held) for up to `budget` seconds."""
        try:
            op.t0 = time.monotonic()
            if op.record:
                op.record.state, op.record.t_start = "running", time.perf_counter()
            op.exe = op._start(op)
            deadline = time.perf_counter() + budget
            while True:
                moved = op.exe.progress()
                if op.exe.done:
                    if op._finish:
                        op._finish(op)
                    self._done(op, None)
                    return
                if time.perf_counter() > deadline:
                    break
                if not moved:  # every transport's wait returns on news (a frame, a freed slot, a wake)
                    self.transport.wait(max(0.0, deadline - time.perf_counter()))
        except BaseException as e:  # noqa: BLE001 - every failure must reach wait()
            self._fail(op, e, self._active, self._waiting)
            if not isinstance(e, Exception) or _from_signal_handler(e):  # Ctrl-C, SystemExit, a time
                raise  # limit's handler: the caller's own, as with Gloo; the group is failed all the same
            return
        with self._cv:  # hand over: the engine finishes it (time-outs and peer checks live there)
            broken = self.broken
            if broken is None:
                self._active.append(op)
                self._cv.notify()
        if broken is not None:  # (the engine failed meanwhile: nobody would finish it)
            self._done(op, GroupError(f"[{self.who(self.rank)}] {self._name(op)}: not run, the group failed: {broken}"))

    def execution(self, op: Op, schedule: Schedule, bufs, reduce, dtype: torch.dtype, tag: int,
                  tmp_views: dict | None = None, arrived: bool = False) -> Execution:
        """The op's Execution. `tag`: a send/recv's user tag; a collective's checksum of its
        arguments and chosen algorithm (`debug.call_tag`, kept with the adapter's plan), so a
        receiver whose peer called it differently (reduce op, root, sizes) or chose another
        algorithm fails its frame check instead of mixing data.
        `arrived`: a receive built once its message's first frame is here, whose sender may have
        exited since, its data delivered (no check that the peers are alive).
        A collective whose frame plan moves one frame each way with one peer (the small calls at
        two ranks) runs as a PairExchange instead; the plan is kept with the schedule, which is
        this group's own (built per call form by the adapter) unless a user's builder hands one
        schedule to several groups, so the group keys it too (their transports may cut and lend
        frames differently)."""
        if not arrived:
            self._deaths.check(self, op)
        # the frames' stamp: a message's size stands in a send/recv's sequence field
        stamp = Stamp(op.kind, dtype, self.token, self.group_id, op.nbytes if op.kind == _P2P else op.seq, tag)
        if op.kind == _P2P:
            return Execution(schedule, bufs, reduce, stamp, self.rank, self.mailbox, self.frame_bytes, tmp_views)
        if schedule.algorithm != op.algorithm:  # a builder that fell back (a torus without a grid,
            op.algorithm = op.record.algorithm = schedule.algorithm  # uneven blocks): record what runs
        plans, key = schedule.plans, (op.kind, dtype, self._plan_key)
        plan = plans.get(key)
        if plan is None:
            plan = execution_plan(schedule, stamp, self.mailbox.transport, self.frame_bytes)
            if plan.frames <= MAX_KEPT_FRAMES:  # (a longer one is cut again per call)
                plans[key] = plan
        pair = plan.pair
        if pair is not None and pair.peer != self.rank:  # one frame each way with one peer: the small
            return PairExchange(pair, bufs, reduce, stamp, self.rank, self.mailbox)  # calls at two ranks
        return Execution(schedule, bufs, reduce, stamp, self.rank, self.mailbox, self.frame_bytes, tmp_views, plan)

    def one_frame(self, count: int, itemsize: int) -> bool:
        """Whether a point-to-point message of `count` elements travels as one copied frame in
        this group (executor.one_copied_frame)."""
        return one_copied_frame(self.transport, self.frame_bytes, count, itemsize)

    def frame_header(self, dtype: torch.dtype, peer: int, nbytes: int, tag: int, incoming: bool = False):
        """The header of a one-frame message to `peer`, or from it if `incoming` (what an
        Execution's stamp would make, or expect)."""
        src, dst = (peer, self.rank) if incoming else (self.rank, peer)
        return Stamp(_P2P, dtype, self.token, self.group_id, nbytes, tag).header(src, dst, 0, nbytes)

    def send_frame(self, op: Op, peer: int, header, payload: torch.Tensor) -> SingleFrameSend:
        """The op's execution for a one-frame message (see SingleFrameSend)."""
        self._deaths.check(self, op)
        return SingleFrameSend(self.transport, peer, header, payload)

    def recv_frame(self, op: Op, peer: int | None, sources: tuple, tag: int, out: torch.Tensor,
                   dtype: torch.dtype) -> SingleFrameRecv:
        """The op's execution for a receive that fits one frame (see SingleFrameRecv); `peer`
        None: from any source (whose sender is found by its frame, so no liveness check here;
        one posted after other receives of its tag leaves them their peers: BarredFrameRecv)."""
        if peer is not None:
            self._deaths.check(self, op)
        else:
            barred = self.barred_for(op)
            if barred is not None:
                return BarredFrameRecv(self.mailbox, sources, tag, out, dtype, barred)
        return SingleFrameRecv(self.mailbox, sources, tag, out, dtype)

    def barred_for(self, op: Op):
        """For a receive from any source as it starts: a function that gives the peers it must
        not take a message from yet (`Waiting.barred`), or None where there are none now, and
        so none later (only receives posted before it bar peers, and they only finish)."""
        waiting = self._waiting
        if not waiting.barred(op):
            return None
        ref = weakref.ref(op)  # (the op holds the execution that holds this)
        return lambda: waiting.barred(ref())

    # -- the engine --------------------------------------------------------------------------
    def _engine(self) -> None:
        """The engine thread. Every op's own failure is handled inside `_drive_ops`; should the
        loop itself ever raise (a bug in the engine), every op left to it fails with that error
        and the group is broken, instead of waiting for ever: a Work's wait() without a time-out
        (the default) waits for the engine, which owns the ops' time-outs."""
        try:
            with self._outside_autograd():  # see _drive_ops
                self._drive_ops()
        except BaseException as e:  # noqa: BLE001 - every op waiting on the engine must hear of it
            err = GroupError(f"[{self.who(self.rank)}] the group's engine thread failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            _drop_locals(e)
            coll_log.error("%s", err)
            self._abort_peers(str(err))
            self._break(err, self._active, self._waiting)

    def _drive_ops(self) -> None:
        # A collective writes into tensors autograd may track (a Parameter broadcast or
        # all-reduced in place, views of one) and into tensors made under inference_mode: like
        # Gloo's C++, the data path works outside autograd (`_engine` enters `outside_autograd`
        # for this thread; the fast path in submit does the same for the caller's thread), so
        # out= reductions and in-place copies on them are allowed.
        active, waiting = self._active, self._waiting
        stalled_since = None
        while True:
            # the last op this loop ran is no longer named here: held while the engine slept, it
            # kept its tensors and its call's scratch (a 256 MiB all-reduce's input and output,
            # deleted by the caller) until this group's next op
            op = None
            if self._abort:
                err = GroupError(f"[{self.who(self.rank)}] {self._abort_why}")
                with self._drive:
                    ops = active + list(waiting)
                    if ops:  # the peers hear of it before the callers, as in `_fail`: an op failed
                        # here may have lent the caller's tensor to a peer that reads it later
                        # (after a destroy gave up on it), when the caller has reused it
                        self._send_abort(str(err))
                    for o in ops:
                        self._done(o, GroupError(f"[{self.who(self.rank)}] {o.desc}: {err}"))
                return
            with self._cv:
                while not self._queue and not active and not waiting and not self.closed:
                    self._cv.wait()
                leaving = self.closed and not self._queue and not active and not waiting
            if leaving:
                # an op the caller's thread is running (the fast path, drive lock held) finishes
                # or is handed over first: leaving under it would strand the op, and `close`
                # would close the transport beneath it (submit admits none once closed)
                with self._drive, self._cv:
                    if not self._queue and not active:
                        return
                continue
            with self._drive:  # the caller's fast path may hold it: wait for it to finish or hand over
                with self._cv:
                    waiting.extend(self._queue, active)
                    self._queue.clear()
                self._admit(active, waiting)
                moved, aside = False, self.mailbox.set_aside
                for op in list(active):
                    if op.finished:  # failed by an earlier op's failure in this pass (`_break`)
                        continue
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
                        if op in active:
                            active.remove(op)
                        self._fail(op, e, active, waiting)
                        moved = True
                # a frame one op set aside for another that had looked already this pass: its
                # doorbell's news is spent, so look again rather than sleep on it (up to 0.25 s)
                if moved or not active or self.mailbox.set_aside != aside:
                    stalled_since = None
                else:
                    now = time.monotonic()
                    if stalled_since is None:
                        stalled_since = now
                    try:
                        self._check_stalled(active, waiting)
                        # wait with the drive lock held: nobody else may drive meanwhile, and the
                        # transport's wait releases the GIL (spin with yields, then futex/poll)
                        self.transport.wait(self._stall_wait(active, now, stalled_since))
                    except BaseException as e:  # noqa: BLE001 - a broken transport (a malformed frame,
                        # an MPI error on a dead peer): fail what runs, never let it kill the engine
                        for op in list(active):
                            if op in active:
                                active.remove(op)
                                self._fail(op, e, active, waiting)

    def _admit(self, active: list[Op], waiting: "Waiting") -> None:
        if waiting:
            waiting.admit(active)

    def _done(self, op: Op, error) -> None:
        if op.record:
            op.record.state = "failed" if error else "done"
            op.record.t_end = time.perf_counter()
            if not error:  # calls, host seconds and bytes per (collective, algorithm, size)
                key = (op.record.kind, op.algorithm, op.nbytes)
                st = self.stats.get(key)
                if st is None:
                    if len(self.stats) >= STATS_SIZES:  # bounded: later sizes share power-of-two bins
                        key = (op.record.kind, op.algorithm, -(1 << op.nbytes.bit_length()))
                        st = self.stats.get(key)
                    if st is None:
                        st = self.stats[key] = [0, 0.0, 0]
                st[0] += 1
                st[1] += op.record.t_end - op.record.t_start
                st[2] += op.nbytes
        op.exe = None  # its buffers (a large call's own scratch) go now, not with a Work kept after
        op.complete(error, self._callback_runner)  # callbacks never on the engine (nor under the drive lock)

    @property
    def issued(self) -> int:
        """How many of the user's collectives this group has numbered: the next one's sequence
        number, as errors show it (a debug check's exchange is numbered with its call)."""
        return self._calls

    def _name(self, op: Op) -> str:
        return op.desc if op.is_p2p else f"{op.desc} (seq {op.call})"

    def who(self, r: int) -> str:
        """Member `r` as errors name it: "rank 1", or "rank 1 (global rank 3)" in a subgroup."""
        return _who(self.global_ranks, r)

    def _gone_cause(self, p: int, reason: str) -> str:
        """Why peer `p` is gone: the cause it sent in an ABORT frame before closing, if any
        (it failed first, naming the real culprit); else the member seen gone before `p`, if
        any (a rank that fails on another's death closes next, and over TCP its close can
        reach us before its ABORT frame does); else the transport's reason."""
        from .transport.frame import PeerAborted
        # A peer that failed sends its ABORT, then closes; over TCP the close can be seen first
        # (a socket monitor's event, beside the data socket the frame is still travelling on),
        # so its ABORT is waited for until `p` has been seen gone for its grace (`_grace`), the
        # grace a waiting op gives a peer seen gone anyway. A killed peer sends none: its
        # neighbours fail that much later, naming it.
        deadline = self._gone_seen.setdefault(p, time.monotonic()) + self._grace(p)
        while True:
            try:
                self.mailbox.take(p, ("abort-probe",))
            except PeerAborted as e:
                return str(e)
            except Exception:  # noqa: BLE001 - a broken channel: fall back to the transport's reason
                break
            if time.monotonic() >= deadline:
                break
            self.transport.wait(0.005)
        seen = self._gone_seen[p]
        earlier = sorted((t, q) for q, t in self._gone_seen.items() if q != p and t < seen)
        for _, q in earlier:
            first = self._gone_now(q)
            if first:
                return f"{self.who(q)} is gone: {first}; then {self.who(p)}: {reason}"
        # none seen to go before `p`: a member that went first may not have been looked at yet
        # (its messenger's failure flag seen first, its ABORT lost to a full ring), so say
        # which others are gone now
        also = [f"{self.who(q)} is gone too: {gone}" for q in range(self.size)
                if q not in (self.rank, p) and (gone := self._gone_now(q))]
        return "; ".join([f"{self.who(p)} is gone: {reason}"] + also)

    def _gone_now(self, q: int) -> str | None:
        """The transport's reason for member `q` being gone now, unless it closed in order."""
        try:
            return self.transport.check_peer(q) if not self.transport.peer_finished(q) else None
        except Exception:  # noqa: BLE001 - a broken channel tells nothing more
            return None

    def _fail(self, op: Op, e: BaseException, active: list[Op], waiting: Waiting) -> None:
        from .transport.base import PeerGone
        if isinstance(e, PeerGone):
            e = GroupError(f"[{self.who(self.rank)}] {self._name(op)} failed: {self._gone_cause(e.peer, str(e))}")
        if not isinstance(e, dist.DistBackendError):
            why = str(e) or type(e).__name__  # str(KeyboardInterrupt()) is empty
            if isinstance(e, (LookupError, AttributeError, TypeError)):  # a slip, not a failure we
                why = f"{type(e).__name__}: {why}"                     # word: str(KeyError(1)) is '1'
            if isinstance(e, KeyboardInterrupt):
                why = "interrupted (KeyboardInterrupt) in the middle of the operation"
            elif _from_signal_handler(e):
                why = f"interrupted by a signal handler's {type(e).__name__} ({why}) in the middle of the operation"
            err = GroupError(f"[{self.who(self.rank)}] {self._name(op)} failed: {why}")
            err.__cause__ = e
        else:
            err = e
        _drop_locals(e)
        coll_log.debug("%s", err)
        # the peers hear of it before the caller does: a peer may be reading a frame this rank
        # lent (transport/cma.py) from the caller's tensor, which the caller may free or reuse
        # once its call has failed; the peer checks this rank's failure flag after each read
        self._send_abort(str(err))
        try:
            self._let_the_exiting_go_first(str(err))
        finally:  # (an exception a signal handler raises in the wait, on the caller's thread)
            self._done(op, err)
            self._break(err, active, waiting)

    def _let_the_exiting_go_first(self, why: str) -> None:
        """A failure caused by a same-host member that is exiting (on an uncaught exception or
        otherwise with the group open: its ABORT or its goodbye says so, `_close_at_exit`)
        reaches the caller once that member's process has ended (EXIT_FIRST_S at most, counted
        from the first such wait on it in this process, so several groups failing on it pay it
        once; only for the members the failure names, not one exiting beside it): told at once,
        the caller, failing in turn, raced it to the exit, and the launchers' summaries, which
        name the first rank to exit non-zero, blamed this rank instead of the exception
        (mpirun's in 5 of 7 runs at three ranks). It costs the caller that rank's exit, ~0.5 s
        with torch loaded. The peers are told first (`_send_abort`), so none of them waits on
        this rank meanwhile."""
        if self._deaths is None:
            return
        exiting = [r for r in range(self.size) if r != self.rank and (
            f"[{self.who(r)}] exiting " in why  # its ABORT's cause, or its goodbye (the transport's words)
            or (f"rank {r} closed its " in why and self._goodbye_at_exit(r)))]
        if exiting:
            self._deaths.await_exits(exiting, EXIT_FIRST_S)

    def _goodbye_at_exit(self, r: int) -> bool:
        """Whether member `r` closed its side in order as its process exits (`peer_exiting`)."""
        try:
            return self.transport.peer_exiting(r)
        except Exception:  # noqa: BLE001 - a broken channel tells nothing more
            return False

    def _break(self, err: GroupError, active: list[Op], waiting: Waiting) -> None:
        """After a failure (the peers already told): the peers' view of this group is now
        unknown, so nothing after it can be trusted: the group is broken and every op not yet
        finished fails with `err`. The first cause stays the group's (later calls name it)."""
        with self._cv:
            if self.broken is None:
                self.broken = err
            rest = active[:] + list(waiting) + list(self._queue)
            active.clear()
            waiting.clear()
            self._queue.clear()
        for o in rest:
            self._done(o, GroupError(f"[{self.who(self.rank)}] {o.desc}: not run, the group failed: {err}"))
        self._publish_progress(bounded=True)
        self._dump_if_asked(f"failure: {err}")

    def _abort_peers(self, reason: str) -> None:
        """`_send_abort` from a thread that is not driving the transport (an abort, the engine's
        own failure): under the drive lock, so that its frames never interleave with a send the
        engine or a caller's fast path is making (two threads taking one ring slot, or one zmq
        socket). A driver that keeps the lock past a second leaves the peers the failure flag."""
        locked = self._drive.acquire(timeout=1.0)
        try:
            self._send_abort(reason, frames=locked)
        finally:
            if locked:
                self._drive.release()

    def _send_abort(self, reason: str, frames: bool = True) -> None:
        """Tell every peer this rank's copy of the group is dead, so a peer waiting on us fails
        now with our cause instead of at its time-out. Best effort: a peer may be gone too.
        `frames` False: the failure flag alone (the caller could not take the drive lock)."""
        if self._abort_sent:
            return
        self._abort_sent = True
        from .transport.frame import MAX_ABORT_BYTES, Header
        msg = reason.encode("utf-8", "replace")[:MAX_ABORT_BYTES]
        payload = torch.frombuffer(bytearray(msg), dtype=torch.uint8) if msg else torch.empty(0, dtype=torch.uint8)
        for p in range(self.size if frames else 0):
            if p == self.rank:
                continue
            h = Header(int(Kind.ABORT), 0, self.token, self.group_id, max(self._seq - 1, 0), self.rank, p, 0, 0,
                       payload.numel())
            try:
                if not self.transport.send(p, h, payload):  # a full ring: the peer reads nothing yet
                    coll_log.debug("rank %d: abort notice to rank %d did not fit; flagged instead", self.rank, p)
            except Exception as e:  # noqa: BLE001 - the peer may be the one that died
                coll_log.debug("rank %d: abort notice to rank %d not sent: %s", self.rank, p, e)
        try:
            self.transport.mark_failed()  # for a peer whose ring had no room for the frame
        except Exception as e:  # noqa: BLE001 - best effort, like the frames
            coll_log.debug("rank %d: failure flag not set: %s", self.rank, e)

    def _grace(self, p: int) -> float:
        """How long after member `p` is seen gone an op waiting on it still waits: frames it
        sent may yet land (the transport's `gone_grace`: half a second over sockets, one more
        look on shared memory)."""
        return PEER_GRACE_S if self._graces is None else self._graces[p]

    def _peer_gone(self, p: int, now: float | None = None, at_least: float = 0.0) -> str | None:
        """The transport's reason for `p` being gone, once it has held for `p`'s grace (or
        `at_least`); when `p` is first seen gone, the next sweep falls due as that ends, and the
        next look (an op waiting on `p`) as `p`'s own grace ends."""
        try:
            reason = self.transport.check_peer(p)
            if not reason and self._deaths is not None:  # a same-host peer's process, where the transport
                reason = self._deaths.exited(self, p)    # cannot tell (an epoll look, at most one a millisecond),
                if reason and self.transport.peer_finished(p):  # unless it closed in order first
                    reason = None
        except Exception as e:  # noqa: BLE001
            reason = f"liveness check failed: {e}"
        if not reason:
            return None
        now = time.monotonic() if now is None else now
        own, first = self._grace(p), self._gone_seen.get(p)
        grace = max(own, at_least)
        if first is None:
            first = self._gone_seen[p] = now
            self._next_sweep = min(self._next_sweep, now + grace)
        if now - first < own:
            self._next_look = min(self._next_look, first + own)
        return reason if now - first >= grace else None

    def _stall_wait(self, active: list[Op], now: float, since: float) -> float:
        """How long a stalled engine waits on its transport (see STALL_WAIT_MAX_S)."""
        wait = min(STALL_WAIT_MAX_S, max(STALL_WAIT_MIN_S, (now - since) / 2))
        limit = self.timeout.total_seconds()
        for op in active:
            wait = min(wait, op.t0 + (op.timeout or limit) - now + DUE_SLACK_S)
        for p, seen in self._gone_seen.items():
            for end in (seen + self._grace(p), seen + PEER_GRACE_S):  # a look's, and the sweep's
                if end > now:
                    wait = min(wait, end - now + DUE_SLACK_S)
        return max(wait, 0.0)

    def _check_stalled(self, active: list[Op], waiting: Waiting) -> None:
        now = time.monotonic()
        deaths = self._deaths
        if deaths is not None and deaths.news:  # a same-host peer's process ended (its pidfd woke
            deaths.news = False                 # the engine): look at the peers now
            self._next_sweep = self._next_look = 0.0
        limit = self.timeout.total_seconds()
        if now >= self._next_sweep and any(not o.is_p2p for o in active):
            # note when each member is first seen gone, so a failure names the first to go; and a
            # member whose copy of the group failed (its ABORT, its failure flag) or that died
            # breaks every collective of the group, not only one waiting on it: a rank that had
            # that member's data and waited on a late third rank waited out its own time-out
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.transport.take_in()  # a member's ABORT behind frames nothing reads yet (zmq)
            for q in range(self.size):
                if q == self.rank:
                    continue
                # a member no op waits on may have done its part and ended (a gather's leaf that
                # exits once its data is sent): the sweep gives it the socket's grace, not
                # shared memory's one look, or a gather still taking other ranks' data failed
                gone = self._peer_gone(q, now, at_least=PEER_GRACE_S)
                if gone and not self.transport.peer_finished(q):  # one that closed in order broke nothing
                    op = next(o for o in active if not o.is_p2p)
                    active.remove(op)
                    self._fail(op, GroupError(
                        f"[{self.who(self.rank)}] {self._name(op)} failed: {self._gone_cause(q, gone)}"),
                        active, waiting)
                    return
        # a peer's liveness costs a system call or two (shared memory reads /proc/PID/stat):
        # looked at every LOOK_INTERVAL_S, not on every idle pass of a waiting receive
        look = now >= self._next_look
        if look:
            self._next_look = now + LOOK_INTERVAL_S
        gone_at_look: dict[int, str | None] = {}  # each peer looked at once per look, not once per op
        for op in list(active):
            peer = op.exe.waiting_on if op.exe else None
            if look:
                suspects = [peer] if peer is not None else []
                if peer is None and op.is_p2p and op.direction == "recv-any":
                    # a receive from any source not yet matched: every member still in the group may
                    # be its sender, so one that died fails it now (as MPI's ULFM and Gloo's broken
                    # pairs do), not at the time-out; one that closed in order sends nothing more
                    suspects = [q for q in range(self.size) if q != self.rank and not self.transport.peer_finished(q)]
                # the peer we wait on, and any peer we still have frames for (a full queue to a dead peer)
                for p in suspects + list(getattr(op.exe, "sends", None) or ()):
                    if p not in gone_at_look:  # (4,000 receives posted out of order, one peer: 4,000
                        gone_at_look[p] = self._peer_gone(p, now)  # /proc reads per look, 80% of the time)
                    gone = gone_at_look[p]
                    if gone:
                        active.remove(op)
                        self._fail(op, GroupError(
                            f"[{self.who(self.rank)}] {self._name(op)} failed: {self._gone_cause(p, gone)}"),
                            active, waiting)
                        return
            own = op.timeout  # the call's own (dist.barrier(timeout=...)), else the group's
            if now - op.t0 > (own or limit):
                active.remove(op)
                who = f"waiting for {self.who(peer)}" if peer is not None else \
                    "waiting for a message from any rank" if op.is_p2p and op.direction != "send" else "waiting to send"
                raise_it = "raise the call's timeout" if own else "raise the timeout in init_process_group/new_group"
                self._fail(op, GroupError(
                    f"[{self.who(self.rank)}] {self._name(op)} timed out after {own or limit:.1f}s {who}. "
                    f"{self.timeout_diagnosis(op)}, or {raise_it}."),
                    active, waiting)
                return

    def _start_failure_watch(self) -> None:
        """A small thread that keeps this rank's progress record in the store current (only when
        it changed, at most every `interval`), so a rank that times out can say what every rank
        last ran. Idle groups cost nothing: nothing changes, nothing is written."""
        self._gone_seen: dict[int, float] = {}
        self._next_sweep = 0.0
        self._abort_sent = False
        self._published = None
        self._hb_stop = threading.Event()
        self._hb_interval = max(0.05, min(1.0, self.timeout.total_seconds() / 20))
        LIVE.add(self)

        def beat(ref=weakref.ref(self), stop=self._hb_stop, interval=self._hb_interval):
            while not stop.wait(interval):
                g = ref()
                if g is None:
                    return
                g._publish_progress()
                del g

        self._hb_thread = threading.Thread(target=beat, name=f"neuron_dist-{self.name}-progress", daemon=True)
        self._hb_thread.start()

    # -- reporting and shutdown ----------------------------------------------------------------
    def report(self) -> list[dict]:
        """Per (collective, algorithm): calls, bytes, measured host time, modelled device time."""
        per: dict[tuple[str, str], list] = {}
        for (kind, algo, _), (n, secs, total) in list(self.stats.items()):
            row = per.setdefault((kind, algo), [0, 0, 0.0, {}])
            row[0] += n
            row[1] += total
            row[2] += secs
            size = total // n  # a size, or a bin's mean size (what the model is asked about)
            row[3][size] = row[3].get(size, 0) + n
        rows = []
        for (kind, algo), (calls, nbytes, host, sizes) in sorted(per.items()):
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

    def close(self, abort: bool = False, reason: str | None = None, exiting: bool = False) -> None:
        """Destroy (abort=False): work already issued still runs, queued or started, as Gloo's
        destructor drains its queue (an isend or async all-reduce just before
        destroy_process_group completes), bounded by the group's time-out (and DESTROY_GRACE_S, for
        an op started as the destroy began to fail on its own time-out). Abort: every op not
        finished, started or not, fails at once (the engine's next pass), the engine thread gets
        half a second to leave, and the peers are told `reason` (by default that this rank
        aborted the group). `exiting`: an orderly close made as the process exits (its
        transport's goodbye says so, `_close_at_exit`)."""
        if self._inherited:  # a forked child's destroy: the transport, its segments and the
            self.closed = True  # peers are the parent's (closing would tell them it closed)
            return
        engine = threading.current_thread() is self._thread
        if not abort and meeting.WORLD["id"] == getattr(self, "job_id", None):  # this world's default group,
            meeting.WORLD["id"] = None  # destroyed (after an abort too); not at an abort alone: the peers' copies
        with self._cv:           # still scope the world's new groups by it
            if self.closed:
                return
            self.closed = True
            self._abort = abort
            pending = []
            if abort or engine:  # (the engine itself cannot wait for its own queue)
                pending = list(self._queue)
                self._queue.clear()
            self._cv.notify_all()
        if abort:  # the engine may sleep in the transport's wait with the drive lock held, which
            self.transport.wake()  # _abort_peers takes: the abort waited out that sleep (to 0.25 s)
        if abort and self.broken is None:
            self._abort_peers(reason or f"{self.who(self.rank)} aborted the process group")
        self._hb_stop.set()
        ended = "aborted" if abort else "destroyed"
        for op in pending:
            op.complete(GroupError(f"[{self.who(self.rank)}] {op.desc}: the process group was {ended}"))
        if not engine:
            waited = 0.5 if abort else self.timeout.total_seconds() + DESTROY_GRACE_S
            self._thread.join(timeout=waited)
            if self._thread.is_alive():  # an op still runs: fail it before the transport goes away
                if not abort:  # (said as such: "aborted" named a call nobody made)
                    self._abort_why = (f"the process group was destroyed while this op ran "
                                       f"(destroy_process_group waited {waited:.1f}s for it)")
                self._abort = True
                with self._cv:
                    self._cv.notify_all()
                self.transport.wake()
                self._thread.join(timeout=1.0)
            with self._cv:  # what the engine never took up (it was aborted first)
                pending = list(self._queue)
                self._queue.clear()
            for op in pending:
                op.complete(GroupError(f"[{self.who(self.rank)}] {op.desc}: the process group was {ended} "
                                       f"before it ran"))
        if threading.current_thread() is not self._hb_thread:
            self._hb_thread.join(timeout=5)
        self._callback_runner.close(timeout=5)  # after the engine: the last completions' callbacks run first
        if self.broken is not None and not self._thread.is_alive():  # the engine's frames in its cause's
            _drop_locals(self.broken)  # traceback were still running when it was cleared, and hold the group
        self.scratch.clear()  # (an op still running keeps its own view of it)
        self.mailbox.clear()  # before the transport's close: a held lent frame pins a mapping
        LIVE.discard(self)
        self._deaths.close()
        if not abort:
            from .report import at_shutdown
            at_shutdown(self)
        # a broken group's peers may be gone: do not linger on frames nobody will read; nor
        # after the engine failed what a destroy waited on (its peers were told: no orderly BYE)
        hard = abort or self.broken is not None or self._abort_sent
        self.transport.close(abort=hard, exiting=exiting)


def _drop_locals(e: BaseException) -> None:
    """Clear the locals of this package's finished frames in `e`'s traceback (and its causes'
    and contexts'). The error outlives the op (the group's `broken`, the Work, whoever catches
    it), and a frame that raised in a receive holds what it was reading: a lent frame's handle
    (transport/cma.py) keeps a ctypes view of the sender's failure word, and while any such view
    lives, `mmap.close` of the sender's segment refuses at the group's close (`BufferError`),
    leaving its descriptor and mapping for the life of the error. The traceback itself (files,
    lines, functions) stays; frames still running are skipped, and so are frames of other code
    (a caller's exception that was being handled when the call was made, say). The frames that
    called them (`f_back`: the engine thread's loop, whose `self` is the group) are cleared too
    once they have ended: the group's close clears its error again after the engine has left,
    or the group outlived its destroy until the cyclic collector ran."""
    seen, frames = set(), set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            while frame is not None and id(frame) not in frames:
                frames.add(id(frame))
                if frame.f_globals.get("__name__", "").startswith(_PACKAGE):
                    try:
                        frame.clear()
                    except RuntimeError:  # still running (the engine's loop, the caller's submit)
                        pass
                frame = frame.f_back
            tb = tb.tb_next
        e = e.__cause__ or e.__context__


_PACKAGE = __name__.partition(".")[0] + "."
