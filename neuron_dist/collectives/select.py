"""Which algorithm runs a collective: forced by NEURON_DIST_ALGO, else the topology's cost
model's cheapest, else (no placement known) a size rule."""
from __future__ import annotations

import logging
from functools import lru_cache

from ..config import env
from .algorithms import COLLECTIVES, algorithms_for

log = logging.getLogger("neuron_dist.tuning")
SMALL_BYTES = 64 << 10
DEFAULTS = {"broadcast": "tree", "reduce": "tree", "gather": "direct", "scatter": "direct",
            "alltoall": "direct", "barrier": "dissemination"}


@lru_cache(maxsize=8)
def parse_forced(spec: str) -> dict[str, str]:
    """"allreduce:ring;allgather:direct" -> {collective: algorithm}; unknown names are errors."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.replace(",", ";").split(";"))):
        coll, sep, algo = part.partition(":")
        coll, algo = coll.strip().lower().replace("all_reduce", "allreduce").replace("all_gather", "allgather"), algo.strip().lower()
        if not sep or coll not in COLLECTIVES:
            raise ValueError(f"NEURON_DIST_ALGO: {part!r} should be collective:algorithm with a collective "
                             f"among {', '.join(COLLECTIVES)}")
        if algo not in algorithms_for(coll):
            raise ValueError(f"NEURON_DIST_ALGO: no algorithm {algo!r} for {coll}; available: "
                             f"{', '.join(algorithms_for(coll))}")
        out[coll] = algo
    return out


def forced() -> dict[str, str]:
    return parse_forced(env("NEURON_DIST_ALGO", "") or "")


def choose(collective: str, nbytes: int, group) -> str:
    f = forced()
    if collective in f:
        return f[collective]
    if collective in DEFAULTS:
        return DEFAULTS[collective]
    topo = getattr(group, "topology", None)
    if topo is not None:
        try:
            from ..topology import choose as topo_choose
            algo = topo_choose(collective, nbytes, topo, None)
            if algo in algorithms_for(collective):
                return algo
        except (ImportError, AttributeError):
            pass
    return "direct" if nbytes <= SMALL_BYTES or group.size <= 2 else "ring"
