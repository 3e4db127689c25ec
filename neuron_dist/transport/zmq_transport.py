"""pyzmq transport: TCP between hosts, abstract-namespace IPC sockets within a host.

Each rank binds one PULL socket and connects one PUSH socket to every peer's PULL, so each
ordered pair of ranks has a FIFO channel. Incoming frames are demultiplexed by the validated
header's source rank. Queues are unbounded (HWM 0): a send never blocks, which keeps every
schedule deadlock-free; memory is bounded by what the collectives in flight move.

Zero-copy both ways: large sends hand zmq a view of the tensor's memory (tracked, so `flush`
knows when it may be reused); receives hand back a tensor view of zmq's frame buffer.
Abstract IPC endpoints (`ipc://@...`) leave no file behind, even after a crash.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import warnings
from collections import deque

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import frame
from .base import Transport, TransportContext, TransportError

log = logging.getLogger("neuron_dist.transport")

# torch warns that zmq's receive buffers are read-only; payloads are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

ZERO_COPY_BYTES = 64 << 10  # below this zmq copies (cheaper than tracking)
_CONTEXT: zmq.Context | None = None
_CONTEXT_PID = 0


def context() -> zmq.Context:
    """One zmq context per process (re-made after fork: a zmq context must not cross a fork)."""
    global _CONTEXT, _CONTEXT_PID
    if _CONTEXT is None or _CONTEXT_PID != os.getpid():
        _CONTEXT, _CONTEXT_PID = zmq.Context(io_threads=1), os.getpid()
    return _CONTEXT


def memory_of(t: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous uint8 tensor's bytes without `.numpy()` (which would pin
    the storage's size forever and break FSDP's resize_(0))."""
    n = t.numel()
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

    def __init__(self, ctx: TransportContext, peers: list[int] | None = None, key: str = "zmq"):
        self.rank, self.size, self.token = ctx.rank, ctx.size, ctx.token
        self.peers = [p for p in (peers if peers is not None else range(ctx.size)) if p != ctx.rank]
        zctx = context()
        self.pull = zctx.socket(zmq.PULL)
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
            port = self.pull.bind_to_random_port(f"tcp://{ctx.bind_addr}")
            endpoints["tcp"] = f"tcp://{ctx.bind_addr}:{port}"
        ctx.store.set(f"{key}/{self.rank}", json.dumps(endpoints))
        self.push: dict[int, zmq.Socket] = {}
        self.monitors: dict[int, zmq.Socket] = {}
        self.gone: dict[int, str] = {}
        for p in self.peers:
            theirs = json.loads(ctx.store.get(f"{key}/{p}"))
            ep = theirs["ipc"] if ctx.hosts[p] == ctx.hostname and "ipc" in theirs else theirs.get("tcp")
            if ep is None:
                raise TransportError(f"rank {self.rank}: no reachable endpoint for rank {p}: {theirs}")
            s = zctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 5000)
            s.setsockopt(zmq.IMMEDIATE, 0)
            self.monitors[p] = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(ep)
            self.push[p] = s
            log.debug("rank %d -> rank %d over %s", self.rank, p, ep)
        self.queues: dict[int, deque] = {p: deque() for p in self.peers}
        self.trackers: list[tuple[zmq.MessageTracker, torch.Tensor]] = []
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.closed = False

    def send(self, peer, header, payload):
        hb = header.pack()
        n = payload.numel()
        if n < ZERO_COPY_BYTES:
            self.push[peer].send_multipart([hb, memory_of(payload)], copy=True)
        else:
            tracker = self.push[peer].send_multipart([hb, memory_of(payload)], copy=False, track=True)
            self.trackers.append((tracker, payload))
        return True

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
            body = parts[1].buffer
            if body.nbytes != h.nbytes:
                raise frame.FrameError(f"rank {self.rank}: frame from rank {h.src} announces {h.nbytes} bytes "
                                       f"but carries {body.nbytes}")
            self.queues[h.src].append((h, tensor_of(body)))

    def recv(self, peer):
        q = self.queues[peer]
        if not q:
            self._drain()
        return q.popleft() if q else None

    def wait(self, timeout):
        if any(self.queues.values()):
            return
        self.poller.poll(max(0, int(timeout * 1000)))

    def flush(self, timeout):
        for tracker, _ in self.trackers:
            tracker.wait(timeout)
        self.trackers.clear()

    def check_peer(self, peer):
        mon = self.monitors.get(peer)
        while mon is not None and peer not in self.gone:
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self.gone[peer] = f"connection to rank {peer} closed (process exited or crashed)"
        return self.gone.get(peer)

    def close(self, abort: bool = False):
        if self.closed:
            return
        self.closed = True
        for p, s in self.push.items():
            s.disable_monitor()
            self.monitors[p].close(linger=0)
            s.close(linger=0 if abort else 5000)
        self.pull.close(linger=0)
        self.trackers.clear()
