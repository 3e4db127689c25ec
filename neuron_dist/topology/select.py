"""Algorithm choice: the cheapest estimate, unless NEURON_DIST_ALGO forces one per collective."""
from __future__ import annotations

from typing import Mapping, Sequence

from .cost import AVAILABLE, COLLECTIVES, applicable, check_algorithm, estimate, normalise_collective
from .placement import GroupTopology

ENV_ALGO = "NEURON_DIST_ALGO"


def parse_forced(spec: str | None, runnable=None) -> dict[str, str]:
    """"allreduce:ring;allgather:torus" -> {"allreduce": "ring", "allgather": "torus"}.
    Entries are separated by ';' or ','; collective names may be spelt all_reduce etc.;
    an unknown collective or algorithm is a ValueError naming the valid ones: those the cost
    model knows, or `runnable(collective)`'s (a backend's own list) when given; so are two
    entries that force different algorithms for one collective (however spelt), naming both."""
    out: dict[str, str] = {}
    entry_of: dict[str, str] = {}
    if not spec or not spec.strip():
        return out
    for entry in spec.replace(",", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        if ":" not in entry:
            raise ValueError(f"{ENV_ALGO}: entry {entry!r} is not 'collective:algorithm' "
                             f"(for example 'allreduce:ring;allgather:torus')")
        coll, algo = (x.strip() for x in entry.split(":", 1))
        try:
            coll = normalise_collective(coll)
            if runnable is not None:  # the backend's own names, those the model cannot price included
                if algo.strip().lower() not in runnable(coll):
                    raise ValueError(f"unknown algorithm {algo!r} for {coll}; valid: {', '.join(runnable(coll))}")
                algo = algo.strip().lower()
            else:
                algo = check_algorithm(coll, algo)
            if coll in out and out[coll] != algo:
                raise ValueError(f"{entry_of[coll]!r} and {entry!r} force different algorithms for "
                                 f"{coll}; keep one")
            out[coll] = algo
            entry_of.setdefault(coll, entry)
        except ValueError as e:
            raise ValueError(f"{ENV_ALGO}={spec!r}: {e}") from None
    return out


def choose(collective: str, nbytes: int, topo: GroupTopology,
           forced: Mapping[str, str] | None = None,
           available: Sequence[str] | None = None) -> str:
    """The algorithm to run: forced[collective] if given, else the cheapest modelled one among
    `available` (default `cost.AVAILABLE[collective]`, earlier names winning ties)."""
    coll = normalise_collective(collective)
    if forced and coll in forced:
        return check_algorithm(coll, forced[coll])
    cands = [a for a in (available or AVAILABLE[coll]) if applicable(coll, a, topo)]
    if not cands:
        raise ValueError(f"no algorithm available for {coll}")
    return min(cands, key=lambda a: (estimate(coll, a, nbytes, topo), cands.index(a)))


# ---- the backend's own choice ------------------------------------------------------------------
# cost.AVAILABLE lists what the cost model can price, more than the backend has schedules for
# (broadcast "ring", alltoall "ring", ...). The tools that show what the backend would run
# (bench's model column, `python -m neuron_dist.topology predict`) choose as the backend's "model"
# policy does (collectives/select.py): among its builders, with NEURON_DIST_ALGO checked likewise.

def backend_algorithms(collective: str) -> list[str]:
    """The algorithms the neuron backend can run for `collective`, in its order of preference.
    Imported on call: the collectives package imports this one."""
    from ..collectives.algorithms import algorithms_for
    return algorithms_for(normalise_collective(collective))


def backend_forced(spec: str | None) -> dict[str, str]:
    """NEURON_DIST_ALGO as the backend reads it: an algorithm it cannot run is a ValueError."""
    return parse_forced(spec, runnable=backend_algorithms)


def backend_choose(collective: str, nbytes: int, topo: GroupTopology,
                   forced: Mapping[str, str] | None = None) -> str:
    """The algorithm the backend's model policy runs: forced[collective] if given (see
    backend_forced), else the cheapest modelled one among `backend_algorithms`. A builder
    registered under a name the cost model cannot price (collectives.algorithms.register) is
    run only when forced: the model has no estimate to weigh it by."""
    coll = normalise_collective(collective)
    if forced and coll in forced:
        return forced[coll]
    return choose(coll, nbytes, topo, None, available=[a for a in backend_algorithms(coll) if a in AVAILABLE[coll]])


__all__ = ["parse_forced", "choose", "COLLECTIVES", "AVAILABLE", "ENV_ALGO", "backend_algorithms",
           "backend_forced", "backend_choose"]
