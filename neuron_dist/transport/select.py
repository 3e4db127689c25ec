"""Transport choice per peer pair, and the composite transport that routes each peer to its own.

Order of preference per pair, as NCCL picks transports from an ordered list with a `canConnect`
test: shared memory when both ranks are on one host (`shm`), MPI for pairs on different hosts
when both ranks are processes that mpirun started (`mpi`), TCP through zmq otherwise (`zmq`).
Both ranks of a pair decide from the same facts (each rank's host, and whether it is an MPI
process, exchanged through the store: `TransportContext.hosts` and `.mpi_ranks`), so they always
agree. Being under mpirun is not enough: a torchrun worker under mpirun inherits its agent's MPI
variables but is no MPI process (`mpi_env.not_an_mpi_rank`).
NEURON_DIST_TRANSPORT forces one transport for every pair; a choice that cannot connect some
pair is an error naming both ranks and their hosts. The choice is logged at debug level
(NEURON_DIST_DEBUG=TRANSPORT).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from .. import mpi_env
from ..config import env
from ..errors import headline
from .base import Transport, TransportContext, TransportError, process_dead

log = logging.getLogger("neuron_dist.transport")
KNOWN = ("shm", "zmq", "mpi")
MPI_ENV = mpi_env.MPI_RANK_VARS


def is_mpi_rank() -> bool:
    """Whether this process is a rank of an MPI job (`mpi_env.not_an_mpi_rank`): the fact each
    rank publishes to its group, and `plan` reads for both ends of a pair."""
    return mpi_env.not_an_mpi_rank() is None


def plan(ctx: TransportContext, forced: str = "") -> dict[int, str]:
    """{peer: transport name} for every peer of this rank (pure: no connection is made).
    `ctx.mpi_ranks` empty (a forecast before the ranks meet): every rank is taken to be what
    this one is."""
    from . import shm
    shm_why = shm.available()
    shm_ok = shm_why is None
    mpi = ctx.mpi_ranks or [is_mpi_rank()] * ctx.size
    if forced == "mpi" and ctx.size > 1:  # checked before mpi4py starts MPI (a singleton, or a hang)
        why = mpi_env.not_an_mpi_rank()
        if why:
            raise TransportError(f"NEURON_DIST_TRANSPORT=mpi, but rank {ctx.rank} is no MPI process: {why}; launch "
                                 f"each rank with mpirun, or use shm/zmq")
        others = [p for p in range(ctx.size) if p != ctx.rank and not mpi[p]]
        if others:
            raise TransportError(f"NEURON_DIST_TRANSPORT=mpi, but rank{'s' if len(others) > 1 else ''} "
                                 f"{', '.join(map(str, others))} {'are' if len(others) > 1 else 'is'} no MPI "
                                 f"process (rank {ctx.rank} is; each says why in its own error); launch each rank "
                                 f"with mpirun, or use shm/zmq")
    out = {}
    for p in range(ctx.size):
        if p == ctx.rank:
            continue
        same_host = not ctx.hosts or ctx.hosts[p] == ctx.hostname
        if forced:
            if forced == "shm" and not same_host:
                raise TransportError(f"NEURON_DIST_TRANSPORT=shm, but rank {ctx.rank} (on {ctx.hostname}) and "
                                     f"rank {p} (on {ctx.hosts[p]}) are on different hosts; use zmq or mpi")
            if forced == "shm" and not shm_ok:
                raise TransportError(f"NEURON_DIST_TRANSPORT=shm, but ranks {ctx.rank} and {p} cannot use "
                                     f"shared memory: {shm_why}")
            out[p] = forced
        elif same_host and shm_ok:
            out[p] = "shm"
        elif mpi[ctx.rank] and mpi[p]:
            out[p] = "mpi"
        else:
            out[p] = "zmq"
    local = [p for p in out if not forced and (not ctx.hosts or ctx.hosts[p] == ctx.hostname)]
    if local and not shm_ok:  # why ranks on one host talk over the network (NEURON_DIST_DEBUG=TRANSPORT)
        log.debug("rank %d: no shared memory with ranks %s on this host (%s): %s instead", ctx.rank, local,
                  shm_why, out[local[0]])
    return out


def _store_failed(ctx: TransportContext, e: BaseException) -> str | None:
    """What to say when a store call fails during the set-up (its host gone: rank 0's process
    under env://, a launcher's agent), else None. torch's words alone ("DistNetworkError:
    Connection reset by peer") named neither this rank, nor the step, nor the local peer whose
    death took the store with it (`TransportContext.pids`), whose segment this rank unlinks.
    Only a lost connection (DistNetworkError) counts: a DistStoreError is a live store's time-out
    (a peer that never published), whose failure is still published for the peers (review BO)."""
    if not isinstance(e, torch.distributed.DistNetworkError):
        return None
    from .shm import unlink_gone_peer
    gone = [(p, pid) for p, pid in enumerate(ctx.pids)
            if p != ctx.rank and pid > 0 and ctx.hosts and ctx.hosts[p] == ctx.hostname and process_dead(pid)]
    for p, pid in gone:  # (its shared-memory segment, if it made one: nobody else is left to unlink it)
        unlink_gone_peer(ctx.job_id, p, pid)
    named = "; ".join(f"rank {p} (pid {pid}) exited" for p, pid in gone)
    return (f"rank {ctx.rank}: a store call failed during the transport set-up"
            f"{' (' + named + ')' if named else ''}: {headline(e)}")


def publish_failure(store, rank: int, why: str, names=KNOWN) -> None:
    """Tell the peers that this rank, which failed before building its transports (`names`:
    those of them it never began), never will: each transport's set-up key gets the error form
    its own set-up publishes when it fails (a full /dev/shm, an address it cannot listen on),
    so a peer waiting to connect to this rank fails at once with its cause instead of at the
    group's time-out."""
    from .mpi import MpiTransport
    from .shm import ShmTransport
    from .zmq_transport import ZmqTransport
    for t in (ShmTransport, ZmqTransport, MpiTransport):
        if t.name in names:
            t.publish_error(store, t.name, rank, why)


def _make(name: str, ctx: TransportContext, peers: list[int]) -> Transport:
    if name == "shm":
        from .shm import ShmTransport
        return ShmTransport(ctx, peers)
    if name == "mpi":
        from .mpi import MpiTransport
        return MpiTransport(ctx, peers)
    from .zmq_transport import ZmqTransport
    return ZmqTransport(ctx, peers)


def settings() -> str:
    """This rank's transport settings, read and checked before its group meets its peers (a bad
    value is then published to them, as a bad placement is, instead of leaving them waiting for
    this rank's records until the time-out); returns the transport NEURON_DIST_TRANSPORT forces
    ("" for none), which the group compares across its ranks."""
    from . import shm
    forced = (env("NEURON_DIST_TRANSPORT") or "").strip().lower()
    if forced and forced not in KNOWN:
        raise ValueError(f"NEURON_DIST_TRANSPORT={forced!r} is not a transport; known: {', '.join(KNOWN)}")
    shm.settings()
    return forced


def create(ctx: TransportContext) -> Transport:
    forced = settings()
    choice = plan(ctx, forced)
    by_name: dict[str, list[int]] = {}
    for p, name in choice.items():
        by_name.setdefault(name, []).append(p)
    # store keys are per rank and per transport, so ranks need not build the same set
    names = [n for n in KNOWN if n in by_name] or [forced or "shm"]  # world 1: an idle transport
    parts = {}
    try:
        for n in names:
            parts[n] = _make(n, ctx, by_name.get(n, []))
    except BaseException as e:
        lost = _store_failed(ctx, e)
        why = lost or str(e) or type(e).__name__
        why = why if why.startswith("rank ") else f"rank {ctx.rank}: {why}"
        for n, t in parts.items():
            _abandon(t, ctx, by_name.get(n, []), why)
        # the peers of the transports this rank never began would wait for its records until
        # the store's time-out (the group's: 30 minutes by default), never learning why
        unbuilt = names[len(parts) + 1:]
        if unbuilt and lost is None:  # (a store that failed takes no records)
            publish_failure(ctx.store, ctx.rank, why, unbuilt)
        if lost is not None:
            raise TransportError(lost) from None
        raise
    for n in names:
        log.debug("rank %d: transport %s for ranks %s%s", ctx.rank, n, by_name.get(n, []),
                  " (forced by NEURON_DIST_TRANSPORT)" if forced else "")
    if "zmq" in by_name and any(k in os.environ for k in MPI_ENV) and not is_mpi_rank():
        log.debug("rank %d: no mpi transport: this process is no MPI process: %s", ctx.rank,
                  mpi_env.not_an_mpi_rank())
    if len(parts) == 1:
        return next(iter(parts.values()))
    return Composite(parts, {p: parts[n] for p, n in choice.items()})


def _abandon(t: Transport, ctx: TransportContext, peers: list[int], why: str) -> None:
    """Close transport `t`, built before a later one of this rank failed (`why`), as a failed
    group's is closed: an ABORT frame with the cause to each of its peers, the failure flag, no
    orderly goodbye. A plain close said goodbye, and those peers (on this host, over shared
    memory) took the rank for one that had left in order: their first collective then waited
    on, and named, other ranks, never this rank's cause. Best effort: a peer may be gone."""
    from .frame import MAX_ABORT_BYTES, Header, Kind
    msg = why.encode("utf-8", "replace")[:MAX_ABORT_BYTES]
    payload = torch.frombuffer(bytearray(msg), dtype=torch.uint8) if msg else torch.empty(0, dtype=torch.uint8)
    try:
        for p in peers:  # group and seq 0: no collective has run; a peer reads any ABORT's cause
            t.send(p, Header(int(Kind.ABORT), 0, ctx.token, 0, 0, ctx.rank, p, 0, 0, payload.numel()), payload)
        t.flush(1.0)
        t.mark_failed()
    except Exception as e:  # noqa: BLE001 - the close below still runs; the set-up error is raised
        log.debug("rank %d: %s transport not told of the failure: %s", ctx.rank, t.name, e)
    try:
        t.close(abort=True)
    except Exception as e:  # noqa: BLE001
        log.debug("rank %d: %s transport not closed: %s", ctx.rank, t.name, e)


class Composite(Transport):
    """Routes each peer to the transport chosen for its pair; waits on all of them."""

    def __init__(self, parts: dict[str, Transport], route: dict[int, Transport]):
        self.parts, self.route = parts, route
        self.name = "+".join(parts)

    def send(self, peer, header, payload):
        return self.route[peer].send(peer, header, payload)

    def recv(self, peer):
        return self.route[peer].recv(peer)

    def release(self, peer):
        self.route[peer].release(peer)

    def wait(self, timeout):
        # no single fd/futex covers every transport: a slice on each, then let the caller look
        # (spurious wake-ups are allowed by the interface). A slice is 0.5 ms, so news on one
        # transport waits at most that while another is waited on; in a long stall (the engine
        # waits 50 ms and more once nothing has moved for 0.1 s) a tenth of the wait, at most
        # 10 ms, so news waits at most that: 0.5 ms slices had a rank waiting for a late peer on
        # another host poll ~2,000 times a second (shared memory beside MPI: 8-11% of a core)
        slice_ = min(timeout, 0.0005) if timeout < 0.05 else min(timeout / 10, 0.01)
        for t in self.parts.values():
            t0 = time.perf_counter()
            t.wait(slice_)
            if time.perf_counter() - t0 < slice_ * 0.9:  # back early: news (or a spurious wake-up,
                return                                 # which the interface allows): look now

    def wake(self):
        for t in self.parts.values():
            t.wake()

    def flush(self, timeout):
        for t in self.parts.values():
            t.flush(timeout)

    def unflushed(self):
        for t in self.parts.values():
            peer = t.unflushed()
            if peer is not None:
                return peer
        return None

    def mark_failed(self):
        for t in self.parts.values():
            t.mark_failed()

    def check_peer(self, peer):
        return self.route[peer].check_peer(peer)

    def peer_failed(self, peer):
        return self.route[peer].peer_failed(peer)

    def peer_finished(self, peer):
        return self.route[peer].peer_finished(peer)

    def peer_exiting(self, peer):
        return self.route[peer].peer_exiting(peer)

    def gone_grace(self, peer):
        return self.route[peer].gone_grace(peer)

    def take_in(self):
        for t in self.parts.values():
            t.take_in()

    def close(self, abort: bool = False, exiting: bool = False):
        """Close every part, even after one's close raised (the others' sockets and segments
        would leak), then raise the first error."""
        first = None
        for t in self.parts.values():
            try:
                t.close(abort=abort, exiting=exiting)
            except Exception as e:  # noqa: BLE001 - raised below, after the other parts
                first = first or e
        if first is not None:
            raise first
