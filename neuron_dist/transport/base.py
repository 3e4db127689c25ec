"""The transport interface: the only thing an executor knows about moving bytes.

One `Transport` object connects this rank to every peer of one process group. It moves frames
(a 56-byte header from `frame.py` plus raw payload bytes) and nothing else: no collective logic,
no reduction; payloads are contiguous tensors whose bytes move as they lie. All calls are
non-blocking except `wait`, `flush` and `close`, so one progress loop can drive many transfers
at once and never deadlocks on a bounded buffer.

Implementations: `zmq_transport.ZmqTransport` (TCP between hosts, IPC within a host),
`shm.ShmTransport` (shared memory within a host), `mpi.MpiTransport` (mpi4py).
"""
from __future__ import annotations

import abc
import os
import resource  # (imported here: at the descriptor limit an import fails)
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .frame import FrameError, Header

if TYPE_CHECKING:
    from .cma import Lent  # (cma imports this module)

# How long after a peer is seen gone its last frames may still arrive, on a transport with
# buffers between the two processes (sockets, MPI's queues): over TCP a socket monitor's close
# can be seen before the data travelling beside it. See `Transport.gone_grace`.
PEER_GRACE_S = 0.5
# what a transport's `check_peer` adds to "rank N closed its ... transport" for a goodbye that
# said it was its process's exit (`close(exiting=True)`, `peer_exiting`)
AT_EXIT = " as its process exits (no destroy_process_group)"


@dataclass
class TransportContext:
    """What a transport needs to connect: who we are, how to meet peers, and the limits."""
    rank: int                 # rank in the group
    size: int                 # group size
    store: object             # a c10d Store already scoped to this group (PrefixStore)
    token: int                # the job's secret, exchanged through the store; every frame carries it
    timeout: timedelta        # connection set-up deadline
    hostname: str             # this rank's host name (peers on the same host may share memory)
    bind_addr: str            # the interface address this job uses (listeners bind only here)
    hosts: list[str] = field(default_factory=list)  # every rank's hostname, filled in at set-up
    mpi_ranks: list[bool] = field(default_factory=list)  # whether each rank is an MPI process (as hosts)
    job_id: str = ""          # names per-job resources (shared-memory segments, IPC paths)
    local_cpus: int = 0       # CPUs the group's ranks on this host may use, together (0: unknown)
    pids: list[int] = field(default_factory=list)  # every rank's pid, as it met (as hosts; 0: unknown)


class TransportError(RuntimeError):
    """A peer is unreachable, closed, or sent something we cannot accept."""


class PeerGone(TransportError):
    """`peer` is gone (closed connection, dead process): raised where a frame cannot reach it."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


class Transport(abc.ABC):
    name = "abstract"
    # single-copy lending (shm only, see cma.py): the largest frame `lend` takes, 0 where the
    # transport cannot lend; steps of `lend_from` bytes or more are lent (those the receiver
    # reduces from `lend_reduce_from`), except a tail frame under `lend_min` bytes;
    # point-to-point messages are lent only above `eager_bytes` (what a send may leave with no
    # receive posted)
    lend_bytes = 0
    lend_from = 0
    lend_min = 0
    lend_reduce_from = 0
    eager_bytes = 0

    @staticmethod
    def publish_error(store, key: str, rank: int, why: str) -> None:
        """Put `why` where peers read this rank's set-up record (`{key}/{rank}`; the key is the
        transport's name unless a caller chose another), in the form their set-up takes for a
        failure (`setup_error`), so they fail at once with it instead of waiting to connect."""
        store.set(f"{key}/{rank}", "error: " + why)

    @staticmethod
    def setup_error(record: str) -> str | None:
        """The error in a peer's set-up record, if it published one (`publish_error`)."""
        return record[7:] if record.startswith("error: ") else None

    @abc.abstractmethod
    def send(self, peer: int, header: Header, payload: torch.Tensor) -> bool:
        """Try to hand one frame for `peer` to the transport.

        `payload` is a contiguous 1-D tensor of any dtype (possibly empty): its `nbytes` bytes are
        the frame's payload, moved as they lie (the executor hands over slices of the caller's
        tensors without re-viewing them as bytes). Returns False when the frame
        cannot be accepted now (flow control); the caller retries later, after `wait`. Once True is
        returned the transport may keep reading `payload` until `flush` returns."""

    @abc.abstractmethod
    def recv(self, peer: int) -> tuple[Header, torch.Tensor | Lent] | None:
        """The next frame from `peer`, or None if none is complete yet.

        The header has passed `frame.unpack` (well-formed) and the payload's `nbytes` equals
        header.nbytes; whether it is the expected frame is the caller's check. The payload is a
        1-D tensor over those bytes: uint8, or already viewed as the header's dtype where the
        transport keeps such views (shared memory); readers view it as they need. A transport that
        lends (`lend_bytes` set: shared memory) returns a lent frame as a `cma.Lent` instead, whose
        bytes are still in the sender's memory: the caller reads them with its `read_into`,
        `read_part` or `clone`, never as a tensor. The payload stays valid until
        `release(peer)`; call it before the next `recv(peer)`."""

    def lend(self, peer: int, header: Header, payload: torch.Tensor) -> bool:
        """`send`, except that the peer reads `payload` from this process's memory itself.
        Returns a ticket (0: not now, retry after `wait`); the caller leaves `payload` unchanged
        until `released(peer, ticket)`. Only called where `lend_bytes` is set."""
        raise NotImplementedError(f"the {self.name} transport does not lend frames")

    def released(self, peer: int, ticket: int) -> bool:
        """Whether `peer` is done with the frame `lend` returned `ticket` for."""
        raise NotImplementedError(f"the {self.name} transport does not lend frames")

    def release(self, peer: int) -> None:
        """Done with the last frame returned by recv(peer)."""

    @abc.abstractmethod
    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds until a send or recv may make progress. Spurious
        wake-ups are allowed; burning a core is not."""

    def wake(self) -> None:
        """Make a `wait` in progress on another thread of this rank return now, or the next one
        return at once. The caller's thread calls it when it queues an op for the engine, which
        may be asleep in `wait` on an earlier op: a send queued behind a receive the engine waits
        on must not sit out the wait's time-out (`irecv` then `isend` on both ranks stalled each
        call for the whole wait). Default: nothing (the wait returns at its time-out)."""

    def flush(self, timeout: float) -> None:
        """Block until no accepted send still refers to caller memory."""

    def unflushed(self) -> int | None:
        """Without blocking (beyond a brief look): the peer of the oldest accepted send that still
        refers to caller memory, or None when none does. The executor asks before each round
        that may overwrite what the last one sent, and waits on the peer it names with the
        group's time-out and peer checks, never in one long flush."""
        return None

    @abc.abstractmethod
    def close(self, abort: bool = False, exiting: bool = False) -> None:
        """Release every socket, segment and thread. Idempotent. `abort` (the group failed or was
        aborted; its peers may be gone): send no orderly goodbye and do not linger on frames
        nobody may read. `exiting`: an orderly close made as the process exits with the group
        still open (no destroy_process_group): the goodbye says so (`peer_exiting`)."""

    def mark_failed(self) -> None:
        """Tell every peer, through whatever side channel the transport has, that this rank's
        group has failed: the ABORT frames that carry the cause may not fit (a full shared-memory
        ring to a peer that is not reading yet), and a peer that arrives later must still learn
        it (its `check_peer` for this rank then says so)."""

    def check_peer(self, peer: int) -> str | None:
        """A reason if `peer` is known to be gone (closed connection, dead process), else None."""
        return None

    def peer_failed(self, peer: int) -> str | None:
        """A reason if `peer`'s copy of the group has failed or was aborted, as far as this rank
        already knows without a system call (its failure flag in shared memory, an ABORT frame
        already taken in), else None. Asked when an operation starts (`DeathWatch.check`): a
        member that failed never runs another collective of the group."""
        return None

    def take_in(self) -> None:
        """Take in the frames that have arrived, so that what `check_peer` and `peer_finished`
        say from them is current (a peer's ABORT or BYE queued behind frames nothing reads yet:
        the executor reads only the peer it waits on). For transports that queue frames
        in-process (zmq) or take in frame headers ahead of the executor (mpi); a bad frame raises
        FrameError. Called once per stall sweep and as an operation starts (`DeathWatch`), not
        per peer: a drain costs microseconds even when nothing came."""

    def peer_finished(self, peer: int) -> bool:
        """True if `peer` closed its side in an orderly way (destroy_process_group/shutdown)
        rather than dying: its absence is then no fault for the operations it completed."""
        return False

    def peer_exiting(self, peer: int) -> bool:
        """True if `peer` closed its side in order as its process exits with the group still
        open (`close(exiting=True)`), as far as this rank has already taken in: an operation
        that fails on it lets that process end first (`Group._let_the_exiting_go_first`)."""
        return False

    def gone_grace(self, peer: int) -> float:
        """Seconds after `peer` is seen gone (`check_peer`, or its process's end) during which
        frames it sent may still arrive: an operation waiting on it fails only after this (and
        one more look at what came). Default PEER_GRACE_S, for frames in flight."""
        return PEER_GRACE_S


def bye_seen(finished: set, peer: int, read_pending) -> bool:
    """Whether `peer`'s BYE frame (an orderly close) is in `finished`, after `read_pending()` has
    taken in what already arrived. A bad frame met there is the executor's to report, not this
    query's."""
    if peer not in finished:
        try:
            read_pending()
        except FrameError:
            pass
    return peer in finished


def descriptor_advice() -> str:
    """What a set-up that ran out of descriptors tells its user (the shared-memory and zmq
    transports, and a group's set-up that hit the limit elsewhere)."""
    return (f"each open group holds some (4 per rank of a two-rank group over shared memory, 11 over zmq), "
            f"within the process's descriptor limit (ulimit -n {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): "
            f"destroy groups no longer used, or raise the limit")


def process_dead(pid: int) -> bool:
    """True if process `pid` (on this host) has exited, zombies included: a SIGKILLed rank
    stays a zombie until its parent reaps it, and os.kill(pid, 0) still succeeds on it."""
    try:  # os.open, not open(): a stalled engine asks ~20 times a second per peer (8 us, not 13)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        stat = os.read(fd, 4096)
    except ProcessLookupError:  # reaped between the open and the read
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    state = stat.rindex(b")") + 2
    return stat[state:state + 1] in (b"Z", b"X")
