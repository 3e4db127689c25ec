"""Which algorithm runs a collective.

1. NEURON_DIST_ALGO forces one per collective.
2. NEURON_DIST_TUNING picks the policy:
   - "model" (default): the topology cost model's cheapest algorithm for the modelled instance,
     among those this backend has builders for, on every group: the host runs the collective the
     way the modelled device would (the brief: the cost model picks the algorithm).
   - "host": where every peer of the group shares this host's memory (the shm transport),
     bytes cross the host's memory bus, not the modelled links, so the choice follows measured
     host behaviour (all-reduce direct up to 64 KiB, or up to one 512 KiB frame at two ranks;
     ring above; broadcast from the root directly up to 1 MiB, tree above, or directly at every
     size where local ranks outnumber cores); other groups use
     the model. The fastest setting for plain host training (e.g. 4 MiB all-reduce at world 2:
     ring 6.1 GB/s busbw, the model's direct 3.5 GB/s).
   The ring order always comes from the topology, and `Group.report()` gives the modelled
   device time either way.
3. Without a placement, a size rule.
Choices are cached per group and size: both policies are pure functions of (collective, size).
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache

from ..config import env
from . import algorithms
from .algorithms import algorithms_for

log = logging.getLogger("neuron_dist.tuning")
SMALL_BYTES = 64 << 10
_environ = os.environ
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython: the encoded mapping os.environ updates
if not isinstance(_ENV_DATA, dict):
    _ENV_DATA = None
_ALGO_KEY = os.environ.encodekey("NEURON_DIST_ALGO") if _ENV_DATA is not None else None
_TUNING_KEY = os.environ.encodekey("NEURON_DIST_TUNING") if _ENV_DATA is not None else None


@lru_cache(maxsize=8)
def parse_forced(spec: str) -> dict[str, str]:
    """NEURON_DIST_ALGO syntax ("allreduce:ring;allgather:direct"), checked against the
    algorithms that have builders here: an unknown or unbuilt name is a ValueError."""
    from ..topology.select import backend_forced
    return backend_forced(spec)  # errors list what this backend runs (bench and predict check the same way)


TUNINGS = ("host", "model")


def tuning() -> str:
    t = (env("NEURON_DIST_TUNING", "model") or "model").strip().lower()
    if t not in TUNINGS:
        raise ValueError(f"NEURON_DIST_TUNING={t!r} is not a policy; choose one of {', '.join(TUNINGS)}")
    return t


def forced() -> dict[str, str]:
    return parse_forced(env("NEURON_DIST_ALGO", "") or "")


def check_settings() -> dict:
    """Raise on a bad NEURON_DIST_TUNING or NEURON_DIST_ALGO when a group is made: read only at
    a collective, a bad value on one rank raised there alone, and its peers waited for it until
    the time-out (the group publishes a set-up error to them). Returns both, normalized, for the
    group to compare across ranks: ranks that choose algorithms differently may run schedules
    with disjoint peers, whose frames never meet to be checked."""
    policy = tuning()
    return {"algo": ",".join(f"{c}:{a}" for c, a in sorted(forced().items())) or None, "tuning": policy}


def choose(collective: str, nbytes: int, group) -> str:
    """`nbytes` follows nccl-tests: the whole gathered/scattered buffer for all-gather and
    reduce-scatter, the buffer for all-reduce. The hot path is one dict lookup keyed by the raw
    values of the two variables (so a changed NEURON_DIST_ALGO/TUNING takes effect at once) and
    the builders' generation (algorithms.register: a name the model prices joins its choice)."""
    fast = group.__dict__.get("_choice_cache")
    if fast is None:
        fast = group.__dict__.setdefault("_choice_cache", {})
    if _ENV_DATA is not None:  # os.environ's own dict: ~20x cheaper than os.environ.get
        key = (collective, nbytes, _ENV_DATA.get(_ALGO_KEY), _ENV_DATA.get(_TUNING_KEY), algorithms.GENERATION)
    else:
        key = (collective, nbytes, _environ.get("NEURON_DIST_ALGO"), _environ.get("NEURON_DIST_TUNING"),
               algorithms.GENERATION)
    algo = fast.get(key)
    if algo is None:
        algo = _choose(collective, nbytes, group)
        if len(fast) >= 4096:
            fast.clear()
        fast[key] = algo
    return algo


def _choose(collective: str, nbytes: int, group) -> str:
    f = forced()
    if collective in f:
        return f[collective]
    cache = group.__dict__.setdefault("_algo_cache", {})
    policy = tuning()
    key = (collective, nbytes, policy, algorithms.GENERATION)  # (a registered builder may join the choice)
    algo = cache.get(key)
    if algo is None:
        topo = getattr(group, "topology", None)
        algo = _host_memory_choice(collective, nbytes, group) if policy == "host" else None
        if algo is not None:
            pass
        elif topo is not None:
            from ..topology.select import backend_choose  # bench's model column and predict use it too
            algo = backend_choose(collective, nbytes, topo)
        else:
            algo = algorithms_for(collective)[0] if collective not in ("allreduce", "allgather", "reduce_scatter") \
                else ("direct" if nbytes <= SMALL_BYTES else "ring")
        if len(cache) < 4096:
            cache[key] = algo
        log.debug("%s of %d bytes on %d ranks: %s", collective, nbytes, group.size, algo)
    return algo


# Measured on the shared-memory transport (benchmarks/RESULTS.md): above this size the ring's
# n-1 sends of 1/n each beat the direct schedule's full-size sends and n-fold scratch buffer
# (world 2, 16 MiB all-reduce: ring 5.4 GB/s busbw, direct 0.6 GB/s).
HOST_RING_BYTES = 64 << 10


# Broadcast on shared memory: the root's own sends (direct) up to this size, the binomial tree
# above. World 3 and 4 on 2 cores, one call per barrier: direct 590/520/820 us at 4 KiB/64 KiB/
# 1 MiB against the tree's 740/630/1050 (the tree's extra hop is another process to schedule);
# above, the root's n-1 copies of the whole tensor would serialise on one core where cores abound.
# Where they do not (more local ranks than cores, the transport's `oversubscribed`), the tree's
# extra hop costs more than it spreads: world 4 on 2 cores, back to back, direct against tree at
# 64 MiB 48.6-62.9 / 96.8-102.7 ms against 83.3-112.7 / 106.9-114.3 (two sessions), 16 MiB
# 12.9-23.7 against 14.2-28.5, 4 MiB even (benchmarks/RESULTS.md, fifteenth pass): direct there.
HOST_FLAT_BROADCAST_BYTES = 1 << 20


def _host_memory_choice(collective: str, nbytes: int, group) -> str | None:
    """When every peer of the group shares this host's memory (transport "shm"), data moves
    over the host's memory bus, not the modelled device links: pick by memory traffic."""
    t = getattr(group, "transport", None)
    if getattr(t, "name", None) != "shm":
        return None
    if collective == "broadcast":
        flat = nbytes <= HOST_FLAT_BROADCAST_BYTES or getattr(t, "oversubscribed", False)
        return "direct" if flat else "tree"
    if collective not in ("allreduce", "allgather", "reduce_scatter"):
        return None
    size = getattr(group, "size", 0)
    if collective != "allreduce" and size <= 2:
        return None  # the model picks the ring: at two ranks all-gather's is the direct schedule, and
        # reduce-scatter's reduces on receipt in one round, where direct adds a round and scratch
    if size == 2 and nbytes <= getattr(group, "frame_bytes", 0):
        # one frame each way, reduced straight from the peer's slot: one round trip, no scratch
        # (4 KiB-512 KiB, pinned back-to-back loops: 34 vs 52 us at 64 KiB, 61 vs 82 at 512 KiB)
        return "direct"
    return "direct" if nbytes <= HOST_RING_BYTES else "ring"
