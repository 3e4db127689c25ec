"""The algorithm table: (collective, algorithm name) -> schedule builder.

Every builder takes one `Spec` so the group can build any algorithm the same way; the topology's
selector names the algorithm, this table turns the name into a schedule.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from . import direct, hierarchical, rdh, ring, torus
from .schedule import Schedule

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "gather",
               "scatter", "alltoall", "barrier")


@dataclass(frozen=True)
class Spec:
    """Everything a builder may use. `counts` is per group rank: for allgather the block each
    rank contributes, for reduce_scatter the block each rank receives, for gather/scatter each
    rank's block; `recv_counts` is all-to-all's. `order` is the ring order from the topology,
    `topo` the GroupTopology (or None when no placement is known). `eager_count` is how many
    elements one send may carry before its peer receives (the group's frame; 0 when unknown):
    up to that a schedule may put a send a round ahead of the matching receive."""
    collective: str
    rank: int
    size: int
    count: int = 0
    counts: tuple[int, ...] = ()
    recv_counts: tuple[int, ...] = ()
    root: int = 0
    order: tuple[int, ...] = ()
    eager_count: int = 0  # elements every transport accepts without the peer receiving (one frame)
    topo: object = field(default=None, compare=False)

    @property
    def ring(self) -> list[int]:
        return list(self.order) if self.order else list(range(self.size))


Builder = Callable[[Spec], Schedule]

# Every reduce-scatter builder takes OUT as this rank's own block of IN (an in-place call, as NCCL
# allows: reduce_scatter_tensor(x.chunk(n)[rank], x)): none reads that block after it writes OUT,
# so the call needs no staging buffer (tests/test_schedules_topology.py runs each aliased).
OWN_BLOCK_OUT = ("reduce_scatter",)

BUILDERS: dict[tuple[str, str], Builder] = {
    ("allreduce", "ring"): lambda s: ring.allreduce(s.ring, s.rank, s.count),
    ("allreduce", "direct"): lambda s: direct.allreduce(s.rank, s.size, s.count, s.eager_count),
    ("allgather", "ring"): lambda s: ring.allgather(s.ring, s.rank, list(s.counts)),
    ("allgather", "direct"): lambda s: direct.allgather(s.rank, s.size, list(s.counts)),
    ("reduce_scatter", "ring"): lambda s: ring.reduce_scatter(s.ring, s.rank, list(s.counts)),
    ("reduce_scatter", "direct"): lambda s: direct.reduce_scatter(s.rank, s.size, list(s.counts)),
    ("broadcast", "tree"): lambda s: direct.tree_broadcast(s.rank, s.size, s.root, s.count),
    ("broadcast", "direct"): lambda s: direct.broadcast(s.rank, s.size, s.root, s.count),
    ("reduce", "tree"): lambda s: direct.reduce(s.rank, s.size, s.root, s.count),
    ("gather", "direct"): lambda s: direct.gather(s.rank, s.size, s.root, list(s.counts)),
    ("scatter", "direct"): lambda s: direct.scatter(s.rank, s.size, s.root, list(s.counts)),
    ("alltoall", "direct"): lambda s: direct.alltoall(s.rank, s.size, list(s.counts), list(s.recv_counts)),
    ("barrier", "dissemination"): lambda s: direct.barrier(s.rank, s.size),
}


def _even(spec: Spec) -> bool:
    return len(set(spec.counts)) <= 1


def _placed(fn, fallback):
    """A topology builder, or `fallback` where the group has no placement or uneven blocks
    (the grid schedules assume equal per-rank blocks)."""
    def build_(s: Spec) -> Schedule:
        if s.topo is None or not _even(s):
            return fallback(s)
        return fn(s.rank, s.topo, s.count if s.collective == "allreduce" else s.counts[0] if s.counts else 0)
    return build_


BUILDERS.update({
    ("allreduce", "torus"): _placed(torus.torus_allreduce, BUILDERS[("allreduce", "ring")]),
    ("allreduce", "hierarchical"): _placed(hierarchical.hierarchical_allreduce, BUILDERS[("allreduce", "ring")]),
    ("allreduce", "rdh"): lambda s: rdh.rdh_allreduce(s.rank, s.ring, s.count),
    ("allgather", "torus"): _placed(torus.torus_allgather, BUILDERS[("allgather", "ring")]),
    ("allgather", "hierarchical"): _placed(hierarchical.hierarchical_allgather, BUILDERS[("allgather", "ring")]),
    ("reduce_scatter", "torus"): _placed(torus.torus_reduce_scatter, BUILDERS[("reduce_scatter", "ring")]),
    ("reduce_scatter", "hierarchical"): _placed(hierarchical.hierarchical_reduce_scatter,
                                                BUILDERS[("reduce_scatter", "ring")]),
})


def algorithms_for(collective: str) -> list[str]:
    return [a for (c, a) in BUILDERS if c == collective]


_BUILT_IN = dict(BUILDERS)
# how many times `register` has run: a group's plans (plans.py, the c10d adapter's common paths)
# are made afresh once it moves, so that a call runs the builder registered when it was made
GENERATION = 0
# the (collective, algorithm) pairs of OWN_BLOCK_OUT collectives whose builder makes no promise
# (registered without own_block_out=True): an in-place call whose plan holds one stages
_UNPROMISED: set[tuple[str, str]] = set()
# taken by `register` while it changes the three above and by `registered` while it reads a
# pair: a builder and its promise are always read together (a plan made while another thread
# registered held the new builder with the old promise, and wrote an in-place result early)
_LOCK = threading.Lock()


def registered(collective: str, algorithm: str) -> tuple[Builder | None, bool]:
    """The builder registered now for the pair (None: none) and whether it keeps OWN_BLOCK_OUT's
    promise: an in-place call may have its schedule write the rank's own block of the input
    directly (false for the collectives outside OWN_BLOCK_OUT)."""
    key = (collective, algorithm)
    with _LOCK:
        return BUILDERS.get(key), collective in OWN_BLOCK_OUT and key not in _UNPROMISED


def register(collective: str, algorithm: str, builder: Builder, *, own_block_out: bool = False) -> None:
    """Add or replace the builder run for `algorithm` (a lower-case name). A name the cost model
    prices (topology/cost.AVAILABLE) joins the model policy's choice; any other runs only when
    NEURON_DIST_ALGO forces it (an experimental schedule, tried beside the built-in ones). For a
    collective in OWN_BLOCK_OUT, `own_block_out=True` says the builder keeps that promise (the
    built-in ones are checked in the simulator, tests/test_schedules_topology.py; `simulate` can
    check another); without it, an in-place call that runs this builder stages its result (a
    built-in one put back keeps the promise). A call runs the builder registered when it was
    made: calls already made, queued or not, are not affected."""
    if algorithm != algorithm.strip().lower() or not algorithm:
        raise ValueError(f"algorithm names are lower case without spaces (NEURON_DIST_ALGO is read so): {algorithm!r}")
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    global GENERATION
    key = (collective, algorithm)
    with _LOCK:
        BUILDERS[key] = builder
        if collective in OWN_BLOCK_OUT and not own_block_out and _BUILT_IN.get(key) is not builder:
            _UNPROMISED.add(key)
        else:
            _UNPROMISED.discard(key)
        GENERATION += 1


def build(spec: Spec, algorithm: str, builder: Builder | None = None) -> Schedule:
    """The schedule `builder` (by default the one registered now for the collective and
    `algorithm`) makes for `spec`."""
    if builder is None:
        try:
            builder = BUILDERS[(spec.collective, algorithm)]
        except KeyError:
            raise ValueError(f"no algorithm {algorithm!r} for {spec.collective}; available: "
                             f"{', '.join(algorithms_for(spec.collective))}") from None
    return builder(spec)
