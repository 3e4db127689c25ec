"""pyzmq transport: TCP between hosts, abstract-namespace IPC sockets within a host.

Each rank binds one PULL socket and connects one PUSH socket to every peer's PULL, so each
ordered pair of ranks has a FIFO channel. Incoming frames are demultiplexed by the validated
header's source rank. Queues are unbounded (HWM 0): a send never blocks, which keeps every
schedule deadlock-free; memory is bounded by what the collectives in flight move.

Zero-copy both ways: large sends hand zmq a view of the tensor's memory (tracked, so `flush`
knows when it may be reused); receives hand back a tensor view of zmq's frame buffer.
Abstract IPC endpoints (`ipc://@...`) leave no file behind, even after a crash.

Authentication: every PULL socket is a ZAP PLAIN server whose only accepted password is the
group's job token (exchanged through the store at group creation); the peers' PUSH sockets
present it. A connection without it fails the ZMTP handshake and is dropped before a single
message from it is read. TCP listeners bind only to the job's address (`bind_addr`).
One ZAP handler thread per process serves every group; it and the zmq context are released
when the last transport closes, so a destroyed process group leaves no socket or thread behind.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import resource
import secrets
import threading
import time
import warnings
from collections import deque

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import frame
from .base import AT_EXIT, PeerGone, Transport, TransportContext, TransportError, bye_seen, descriptor_advice

log = logging.getLogger("neuron_dist.transport")

# torch warns that zmq's receive buffers are read-only; payloads are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

ZERO_COPY_BYTES = 64 << 10  # below this zmq copies (cheaper than tracking)
ABORT_LINGER_S = 1.0  # on abort, how long frames already sent may still drain to live peers: an op
                      # that completed here may have a peer still reading its last frames
CLOSE_LINGER_S = 5.0  # on an orderly close, the same for frames still queued to live peers
TERM_GRACE_S = 5.0    # beyond the sockets' linger, how long ending the context may take (see _term)
BYE_WAIT_S = 0.25     # how long an orderly close listens for its peers' BYEs (`_take_byes`)
USER = b"neuron_dist"
_CONTEXT: zmq.Context | None = None
_CONTEXT_PID = 0
_AUTH = None            # the process's ZAP handler (zmq.auth.thread.ThreadAuthenticator)
_USERS = 0              # open transports using the context
_LOCK = threading.Lock()


def context() -> zmq.Context:
    """One zmq context per process (re-made after fork: a zmq context must not cross a fork).

    Its socket budget is the process's descriptor limit, not libzmq's default of 1023: a group
    holds 1 + 3 sockets per zmq peer (a PUSH and a monitor pair each), so at the default a
    process could keep only ~250 two-rank groups open (Gloo, 600 and more), and a world of a few
    hundred zmq peers could not make its default group. Each socket costs a descriptor (its
    mailbox), so the descriptor limit is the real bound, and its error is the one to meet."""
    global _CONTEXT, _CONTEXT_PID, _AUTH, _USERS
    if _CONTEXT is None or _CONTEXT_PID != os.getpid():
        _CONTEXT, _CONTEXT_PID, _AUTH, _USERS = zmq.Context(io_threads=1), os.getpid(), None, 0
        _CONTEXT.set(zmq.MAX_SOCKETS, _socket_budget(_CONTEXT.get(zmq.SOCKET_LIMIT)))
    return _CONTEXT


def _socket_budget(most: int) -> int:
    """Sockets one context may hold: the soft descriptor limit, within libzmq's `most`."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1023, min(most if soft == resource.RLIM_INFINITY else soft, most))


class _HideSecrets(logging.Filter):
    """pyzmq's authenticator logs each accepted peer's PLAIN password (our job token) at debug
    level, which NEURON_DIST_DEBUG=TRANSPORT turns on: logs that users paste into bug reports
    must not carry it. The record stays, the password masked."""

    def filter(self, record):
        if isinstance(record.msg, str) and "password=" in record.msg and isinstance(record.args, tuple):
            record.args = record.args[:-1] + ("<hidden>",)
        return True


_ZAP_LOG = logging.getLogger("neuron_dist.transport.zap")
_ZAP_LOG.addFilter(_HideSecrets())


def _acquire(domain: str, token: int) -> zmq.Context:
    """The context, with the ZAP handler running and accepting `token` for `domain`."""
    global _AUTH, _USERS
    from zmq.auth.thread import ThreadAuthenticator
    with _LOCK:
        ctx = context()
        if _AUTH is None:
            _AUTH = ThreadAuthenticator(ctx, log=_ZAP_LOG)
            _AUTH.start()
        _AUTH.configure_plain(domain=domain, passwords={USER.decode(): str(token)})
        _USERS += 1
        return ctx


# Zero-copy frames libzmq had not finished sending when their transport closed, with the
# tensors they read: closing a socket (even with no linger) returns before its I/O thread is
# done with a frame it is writing, and a buffer freed meanwhile made libzmq fail on EFAULT and
# abort the process. Kept until their trackers say libzmq let go (pruned at each close).
_READING_AT_CLOSE: list = []


def _release(domain: str, linger_ok: bool) -> None:
    """Forget `domain`; with the last transport gone, stop the ZAP thread and end the context
    (which waits up to the sockets' linger for frames still queued to live peers)."""
    global _AUTH, _USERS, _CONTEXT
    with _LOCK:
        if _CONTEXT is None or _CONTEXT_PID != os.getpid():
            return
        if _AUTH is not None:
            _AUTH.passwords.pop(domain, None)
        _USERS -= 1
        if _USERS > 0:
            return
        if _AUTH is not None:
            _AUTH.stop()
            _AUTH = None
        ctx, _CONTEXT = _CONTEXT, None
    _term(ctx, (CLOSE_LINGER_S if linger_ok else ABORT_LINGER_S) + TERM_GRACE_S)
    from zmq.utils.garbage import gc as zero_copy_gc  # pyzmq's zero-copy helper thread; restarts on demand
    zero_copy_gc.stop()


def _term(ctx: zmq.Context, bound_s: float) -> None:
    """End the context, waiting at most `bound_s`. `zmq_ctx_term` returns only when every socket
    on the context is closed and its connections have wound down: one socket left open (a test's
    rogue socket, once, when its test failed before closing it) or a connection libzmq never winds
    down (an open report with ZAP on slow machines, zeromq/libzmq#2733) would hang the process in
    `destroy_process_group` for ever. Past the bound the context is left to end at the process's
    exit, with a warning."""
    ender = threading.Thread(target=ctx.term, name="neuron_dist-zmq-term", daemon=True)
    ender.start()
    ender.join(bound_s)
    if ender.is_alive():
        log.warning("the zmq context did not end within %.1fs of the last transport's close (a socket still open "
                    "on it, or a connection libzmq has not wound down); it is left to end at the process's exit",
                    bound_s)


def memory_of(t: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous tensor's bytes without `.numpy()` (which would pin the
    storage's size forever and break FSDP's resize_(0))."""
    n = t.nbytes
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def tensor_of(buf) -> torch.Tensor:
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


class ZmqTransport(Transport):
    name = "zmq"

    @staticmethod
    def publish_error(store, key: str, rank: int, why: str) -> None:
        """As the base's, in this transport's record form: JSON holding the endpoints or an
        "error" (its set-up reads that field from the record it parses anyway)."""
        store.set(f"{key}/{rank}", json.dumps({"error": why}))

    def __init__(self, ctx: TransportContext, peers: list[int] | None = None, key: str = "zmq"):
        self.rank, self.size, self.token = ctx.rank, ctx.size, ctx.token
        self.peers = [p for p in (peers if peers is not None else range(ctx.size)) if p != ctx.rank]
        self.timeout = ctx.timeout.total_seconds() if ctx.timeout else 1800.0
        self.domain = f"nd-{ctx.job_id}-{key}-{secrets.token_hex(4)}"
        zctx = _acquire(self.domain, self.token)
        self.closed = True  # until set-up completes, close() only releases the context
        self.push: dict[int, zmq.Socket] = {}
        self.monitors: dict[int, zmq.Socket] = {}
        self.gone: dict[int, str] = {}
        self.finished: set[int] = set()  # peers that sent BYE (closed in order)
        self.exiting: set[int] = set()  # ... as their process exits
        self.aborted: dict[int, str] = {}  # peers that sent ABORT: its cause (`check_peer`)
        self.queues: dict[int, deque] = {p: deque() for p in self.peers}
        self._arrived = self._arrived_seen = 0  # frames drained in all, and as the last wait saw them
        self.trackers: list[tuple[zmq.MessageTracker, torch.Tensor, int]] = []
        # wake(): a byte down this pipe ends the poll in wait() (the poller watches its read end)
        self._wake_r = self._wake_w = -1
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._setup(ctx, zctx, key)
        except (zmq.ZMQError, OSError) as e:  # a socket or pipe the process could not make: say whose, and why
            why = f"rank {self.rank}: cannot set up zmq sockets for {len(self.peers)} peers ({e})"
            if e.errno == errno.EMFILE:
                why += f"; {descriptor_advice()} (zmq: 1 + 3 sockets per peer)"
            self.closed = False
            self.close(abort=True)
            self.publish_error(ctx.store, key, self.rank, why)  # peers fail at once, not at the time-out
            raise TransportError(why) from None
        except BaseException:
            self.closed = False
            self.close(abort=True)
            raise

    def _setup(self, ctx: TransportContext, zctx: zmq.Context, key: str) -> None:
        self.pull = zctx.socket(zmq.PULL)
        self.pull.plain_server = True
        self.pull.zap_domain = self.domain.encode()
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, frame.MAX_FRAME_BYTES)
        self.pull.setsockopt(zmq.LINGER, 0)
        remote = any(ctx.hosts[p] != ctx.hostname for p in self.peers)
        local = any(ctx.hosts[p] == ctx.hostname for p in self.peers)
        endpoints = {}
        if local:
            ep = f"ipc://@neuron_dist-{ctx.job_id}-{os.getpid()}-{secrets.token_hex(6)}"
            self.pull.bind(ep)
            endpoints["ipc"] = ep
        if remote:
            host = f"[{ctx.bind_addr}]" if ":" in ctx.bind_addr else ctx.bind_addr  # IPv6 in brackets
            self.pull.ipv6 = ":" in ctx.bind_addr
            try:
                port = self.pull.bind_to_random_port(f"tcp://{host}")
            except zmq.ZMQError as e:
                why = (f"rank {self.rank} cannot listen on {ctx.bind_addr} ({e.strerror}): it is not an address of "
                       f"this host ({ctx.hostname}); set NEURON_DIST_BIND_ADDR to one, on the job's network")
                self.publish_error(ctx.store, key, self.rank, why)  # peers fail at once
                raise TransportError(why) from None
            endpoints["tcp"] = f"tcp://{host}:{port}"
        ctx.store.set(f"{key}/{self.rank}", json.dumps(endpoints))
        for p in self.peers:
            theirs = json.loads(ctx.store.get(f"{key}/{p}"))
            if "error" in theirs:
                raise TransportError(f"rank {self.rank}: no connection with rank {p}: {theirs['error']}")
            ep = theirs["ipc"] if ctx.hosts[p] == ctx.hostname and "ipc" in theirs else theirs.get("tcp")
            if ep is None:
                raise TransportError(f"rank {self.rank}: no reachable endpoint for rank {p}: {theirs}")
            s = self.push[p] = zctx.socket(zmq.PUSH)  # (kept at once: a failure below must close it,
            s.setsockopt(zmq.SNDHWM, 0)                 # or ending the context waits out its bound)
            s.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))
            s.setsockopt(zmq.IMMEDIATE, 0)
            s.plain_username = USER
            s.plain_password = str(self.token).encode()
            s.ipv6 = ep.startswith("tcp://[")
            self.monitors[p] = s.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            try:
                s.connect(ep)
            except zmq.ZMQError as e:  # a record no peer of this job would write: say whose
                raise TransportError(f"rank {self.rank}: cannot connect to rank {p} at {ep!r}: {e}") from None
            log.debug("rank %d -> rank %d over %s", self.rank, p, ep)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.closed = False

    def send(self, peer, header, payload):
        gone = self.check_peer(peer)
        if gone and header.kind != frame.Kind.ABORT:  # a frame we have not sent yet can never arrive
            raise PeerGone(peer, gone)
        parts = [header.pack(), memory_of(payload)]
        if payload.nbytes < ZERO_COPY_BYTES:
            self._queue(peer, parts, copy=True)
        else:
            self.trackers.append((self._queue(peer, parts, copy=False, track=True), payload, peer))
        return True

    def _queue(self, peer: int, parts: list, **how):
        """Queue one frame to `peer` without blocking. With no HWM a PUSH socket queues at once
        whenever it has a connection, pending or not; it has none only once the peer refused the
        handshake (a process of another job: wrong token), and a blocking send would then wait for
        ever. That refusal may land between `send`'s check and this call, so a send that cannot
        queue re-checks the peer until it names the refusal, and gives up at the time-out."""
        sock, deadline = self.push[peer], None
        while True:
            try:
                return sock.send_multipart(parts, flags=zmq.NOBLOCK, **how)
            except zmq.Again:
                pass
            deadline = deadline or time.monotonic() + self.timeout  # set on the first miss only
            gone = self.check_peer(peer)
            if gone:
                raise PeerGone(peer, gone)
            if time.monotonic() > deadline:
                raise TransportError(f"rank {self.rank}: no connection to rank {peer} to send on after "
                                     f"{self.timeout:.1f}s")
            sock.poll(50, zmq.POLLOUT)

    def _drain(self) -> None:
        while True:
            try:
                parts = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:
                raise frame.FrameError(f"rank {self.rank}: malformed message of {len(parts)} parts on the data socket")
            h = frame.unpack(parts[0].buffer)
            if h.token != self.token:
                log.warning("rank %d: dropped a frame with a wrong job token (claims rank %d)", self.rank, h.src)
                continue
            if h.src not in self.queues or h.dst != self.rank:
                raise frame.FrameError(f"rank {self.rank}: frame claims to come from rank {h.src} to rank {h.dst}")
            if h.kind == frame.Kind.BYE:  # the peer closed in order: nothing more will come
                self.finished.add(h.src)
                if h.chunk:  # ... as its process exits (frame.bye_header)
                    self.exiting.add(h.src)
                self._arrived += 1
                continue
            body = parts[1].buffer
            if body.nbytes != h.nbytes:
                raise frame.FrameError(f"rank {self.rank}: frame from rank {h.src} announces {h.nbytes} bytes "
                                       f"but carries {body.nbytes}")
            payload = tensor_of(body)
            if h.dtype and payload.data_ptr() % frame.ITEMSIZE[h.dtype]:
                # zero-copy receives sit where libzmq put them: below 8 KiB in its decoder's
                # buffer at any byte offset (4 or 11 past a 16-byte line), above it in a buffer
                # of their own 8 past one; torch's kernels assume an element's alignment, and a
                # complex128 reduction read them with aligned loads and the rank died on SIGSEGV.
                # Misaligned payloads (small ones; complex128 at any size) get an aligned copy.
                payload = payload.clone()
            self.queues[h.src].append((h, payload))
            if h.kind == frame.Kind.ABORT:  # kept aside too: the executor may be waiting on another
                self.aborted.setdefault(h.src, frame.abort_reason(payload))  # peer, never reading this one's
            self._arrived += 1

    def recv(self, peer):
        q = self.queues[peer]
        if not q:
            self._drain()
        return q.popleft() if q else None

    def wait(self, timeout):
        # frames drained since the last wait are news; frames that were already queued then are
        # not (the caller's progress pass since saw them and could not take them yet: a peer's
        # next collective, a receive not yet posted); counting them kept the wait from ever
        # sleeping, the engine spinning a core until the op it waited on moved
        if self._arrived != self._arrived_seen:
            self._arrived_seen = self._arrived
            return
        if self.trackers:  # zmq's I/O thread handing a zero-copy frame off wakes no poll: look again soon
            timeout = min(timeout, 0.002)
        for sock, _ in self.poller.poll(max(0, int(timeout * 1000))):
            if sock == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:  # (BlockingIOError: drained by an earlier wait)
                    pass

    def wake(self):
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"w")
        except OSError:  # a full pipe: a wake-up is already pending
            pass

    def flush(self, timeout):
        """Wait until zmq no longer reads any caller buffer handed to `send`. A frame queued to a
        dead peer is never released, so the wait checks the peer's liveness and raises naming it
        (or gives up at `timeout`) instead of blocking for ever."""
        deadline = time.monotonic() + min(timeout, self.timeout)
        while self.trackers:
            tracker, _, peer = self.trackers[0]
            try:
                tracker.wait(0.05)
            except zmq.NotDone:
                gone = self.check_peer(peer)
                if gone:
                    raise PeerGone(peer, f"{gone} (frames still queued to it)") from None
                if time.monotonic() > deadline:
                    raise TransportError(f"rank {self.rank}: frames to rank {peer} not handed off after "
                                         f"{min(timeout, self.timeout):.1f}s") from None
                continue
            self.trackers.pop(0)

    def unflushed(self):
        """The oldest zero-copy frame zmq still reads, after a brief wait for it (its I/O thread
        usually hands a frame to the kernel within microseconds): its peer, or None."""
        while self.trackers:
            tracker, _, peer = self.trackers[0]
            if not tracker.done:
                try:
                    tracker.wait(0.002)
                except zmq.NotDone:
                    return peer
            self.trackers.pop(0)
        return None

    def check_peer(self, peer):
        mon = self.monitors.get(peer)
        while mon is not None and peer not in self.gone:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self.gone[peer] = f"connection to rank {peer} closed (its group destroyed, or its process exited or crashed)"
            elif ev["event"] in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self.gone[peer] = (f"rank {peer} rejected this rank's connection (job token or protocol "
                                   f"mismatch: is it a process of the same job and group?)")
        failed = self.peer_failed(peer)
        if failed:
            return failed
        if peer in self.exiting:  # its goodbye said why it left
            return f"rank {peer} closed its zmq transport{AT_EXIT}"
        return self.gone.get(peer)

    def peer_failed(self, peer):
        cause = self.aborted.get(peer)
        return None if cause is None else f"rank {peer} aborted the group: {cause}"

    def peer_finished(self, peer):
        return bye_seen(self.finished, peer, self._drain)

    def peer_exiting(self, peer):
        return bye_seen(self.finished, peer, self._drain) and peer in self.exiting

    def take_in(self):
        self._drain()  # every peer shares the one pull socket: one drain serves them all

    def _take_byes(self, timeout: float) -> None:
        """After sending our BYEs, keep the data socket open until every live peer's BYE is in,
        for at most `timeout`. Ranks that close together then each close their listener only
        after the other's BYE arrived, and a peer whose BYE is in gets no linger at our close (it
        finished every op, so nothing still queued to it is owed): a BYE queued to a listener
        closed under it held the sender's zmq context for the whole close linger, a 5 s
        `destroy_process_group` in 1 of 20-100 whole-world destroys with subgroups alive."""
        end = time.monotonic() + timeout
        while True:
            try:
                self._drain()
            except frame.FrameError:
                return  # not ours to report here: the group is closing
            waiting = [p for p in self.push if p not in self.finished and not self.check_peer(p)]
            left = end - time.monotonic()
            if not waiting or left <= 0:
                return
            self.pull.poll(max(1, min(20, int(left * 1000))))

    def close(self, abort: bool = False, exiting: bool = False):
        if getattr(self, "_released", False):
            return
        self._released = True
        if not abort:  # tell every live peer this is an orderly close, after all our data
            for p, s in self.push.items():
                if p not in self.gone and p not in self.finished:
                    bye = frame.bye_header(self.token, self.rank, p, exiting)
                    try:
                        s.send_multipart([bye.pack(), b""], flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
            self._take_byes(BYE_WAIT_S)
        # zero-copy frames still unsent read the caller's tensors, which may be freed once we
        # return: those peers get no linger (their op had not completed, so nothing is owed)
        reading = {peer for tracker, _, peer in self.trackers if not tracker.done}
        for p, s in self.push.items():
            try:
                self.check_peer(p)
                s.disable_monitor()
            except zmq.ZMQError:
                pass
            if p in self.monitors:
                self.monitors[p].close(linger=0)
            if p in self.gone or p in reading or p in self.finished:
                linger = 0
            else:
                linger = int((ABORT_LINGER_S if abort else CLOSE_LINGER_S) * 1000)
            s.close(linger=linger)
        for p, m in self.monitors.items():
            if p not in self.push:
                m.close(linger=0)
        if getattr(self, "pull", None) is not None:
            self.pull.close(linger=0)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if reading:  # libzmq may still be writing them out after the socket's close returned
            _READING_AT_CLOSE[:] = [(t, p) for t, p in _READING_AT_CLOSE if not t.done] + \
                [(t, p) for t, p, _ in self.trackers if not t.done]
        self.trackers.clear()
        self.closed = True
        _release(self.domain, not abort)
