"""Cost model: modelled device time of a collective, from the instance's links.

An algorithm is a sequence of phases; in each, every rank sends one block to one peer at the same
time (a ring step along a grid line, a doubling exchange, an all-pairs burst). A phase of
`steps` steps moving b bytes per flow costs

    steps * (alpha + b * beta + b * passes * ranks_per_chip / hbm_bandwidth)

alpha: the slowest flow's latency (hops x link latency, or the EFA latency across nodes);
beta: seconds per byte on the busiest link, i.e. (flows sharing the link) / (its bandwidth),
with flows routed dimension by dimension over the torus (`graph.route`); between cores of one
chip the "link" is the chip's HBM at half its bandwidth (read and write);
passes: HBM passes per byte on the receiving chip (3 to reduce: two reads and a write; 2 to copy).

Sizes follow nccl-tests: `nbytes` is the buffer of all-reduce, broadcast and reduce, and the
whole gathered buffer (size x per-rank block) of all-gather, reduce-scatter, gather, scatter and
all-to-all. Rooted collectives are costed with root 0.
"""
from __future__ import annotations

import collections
import functools

from .graph import Grid, grid_for, line_next, pattern_cost, ring_order, torus_grid, hierarchical_grid
from .placement import GroupTopology

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "gather",
               "scatter", "alltoall", "barrier")
# Algorithms the cost model prices, per collective, in order of preference on equal cost: more
# than the backend has schedules for (broadcast "ring", alltoall "ring", ...); the backend
# chooses among those it can build (topology/select.py, backend_choose).
AVAILABLE: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "torus", "hierarchical", "rdh", "direct"),
    "allgather": ("ring", "torus", "hierarchical", "direct"),
    "reduce_scatter": ("ring", "torus", "hierarchical", "direct"),
    "broadcast": ("tree", "ring", "direct"),
    "reduce": ("tree", "ring", "direct"),
    "gather": ("ring", "direct"),
    "scatter": ("ring", "direct"),
    "alltoall": ("direct", "ring"),
    "barrier": ("dissemination", "direct", "ring"),
}
REDUCE_PASSES, COPY_PASSES = 3, 2
# nccl-tests bus bandwidth factors: busbw = algbw * factor(n)
BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}

Term = tuple[int, float, float]   # (steps, alpha seconds, seconds per byte of nbytes)

ALIASES = {"all_reduce": "allreduce", "all_gather": "allgather", "reducescatter": "reduce_scatter",
           "reduce-scatter": "reduce_scatter", "all_to_all": "alltoall", "alltoall_base": "alltoall",
           "allgather_into_tensor": "allgather", "reduce_scatter_tensor": "reduce_scatter"}


def normalise_collective(name: str) -> str:
    n = ALIASES.get(name.strip().lower(), name.strip().lower())
    if n not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; valid: {', '.join(COLLECTIVES)}")
    return n


def check_algorithm(collective: str, algorithm: str) -> str:
    coll = normalise_collective(collective)
    a = algorithm.strip().lower()
    if a not in AVAILABLE[coll]:
        raise ValueError(f"unknown algorithm {algorithm!r} for {coll}; valid: "
                         f"{', '.join(AVAILABLE[coll])}")
    return a


def _places(topo: GroupTopology):
    return [(s.node, s.chip) for s in topo.slots]


def _k(topo: GroupTopology) -> int:
    per: dict = {}
    for s in topo.slots:
        per[s.node, s.chip] = per.get((s.node, s.chip), 0) + 1
    return max(per.values())


def _hbm(topo: GroupTopology, passes: int) -> float:
    bw = topo.instance.hbm_bandwidth
    return passes * _k(topo) / bw if bw else 0.0


def _grid_terms(topo: GroupTopology, grid: Grid, rs: bool, ag: bool) -> list[Term]:
    pl = _places(topo)
    rank_at = grid.rank_at()
    stages, frac = [], 1.0
    for d, p in enumerate(grid.shape):
        flows = [(pl[r], pl[line_next(grid, r, d, rank_at)]) for r in range(topo.size)]
        alpha, beta = pattern_cost(topo.instance, flows)
        frac /= p
        stages.append((p, alpha, beta, frac))
    terms: list[Term] = []
    if rs:
        terms += [(p - 1, a, f * (b + _hbm(topo, REDUCE_PASSES))) for p, a, b, f in stages]
    if ag:
        terms += [(p - 1, a, f * (b + _hbm(topo, COPY_PASSES))) for p, a, b, f in reversed(stages)]
    return terms


def _all_pairs(topo, frac, passes, root=None, to_root=False) -> Term:
    """Every rank to every other, or (root given) the root to every other rank, or with
    `to_root` every other rank to the root (gather, reduce): routes are not symmetric (dimension
    order), so the direction decides which links carry the load."""
    pl = _places(topo)
    n = topo.size
    if root is None:  # rank pairs counted per pair of places (n*(n-1) flows, fewer routes)
        per_place = collections.Counter(pl)
        flows = {(p, q): cp * (cq - (p == q)) for p, cp in per_place.items() for q, cq in per_place.items()
                 if p != q or cp > 1}
    elif to_root:
        flows = [(pl[b], pl[root]) for b in range(n) if b != root]
    else:
        flows = [(pl[root], pl[b]) for b in range(n) if b != root]
    alpha, beta = pattern_cost(topo.instance, flows)
    return (1, alpha, frac * (beta + _hbm(topo, passes)))


def _ring_pattern(topo):
    pl = _places(topo)
    o = ring_order(topo)
    return pattern_cost(topo.instance, [(pl[o[i]], pl[o[(i + 1) % len(o)]]) for i in range(len(o))])


def _rdh_terms(topo) -> list[Term]:
    pl = _places(topo)
    o = ring_order(topo)
    P = len(o)
    P2 = 1 << (P.bit_length() - 1)
    terms: list[Term] = []
    extra = P - P2
    if extra:
        a, b = pattern_cost(topo.instance, [(pl[o[P2 + i]], pl[o[i]]) for i in range(extra)])
        terms.append((2, a, b + _hbm(topo, REDUCE_PASSES)))
    k = 1
    while k < P2:
        a, b = pattern_cost(topo.instance, [(pl[o[i]], pl[o[i ^ k]]) for i in range(P2)])
        terms.append((1, a, b + _hbm(topo, REDUCE_PASSES + COPY_PASSES)))
        k <<= 1
    return terms


def _log_terms(topo, c, a) -> list[Term]:
    """Binomial tree (broadcast, reduce; root 0, group-rank numbering) or dissemination barrier:
    ceil(log2 n) steps; level k pairs rank i with i + 2^k."""
    pl = _places(topo)
    n = topo.size
    terms: list[Term] = []
    k = 1
    while k < n:
        if a == "tree":  # a broadcast sends down the tree (i to i + k), a reduce up it
            flows = [(pl[i + k], pl[i]) if c == "reduce" else (pl[i], pl[i + k]) for i in range(k) if i + k < n]
            alpha, beta = pattern_cost(topo.instance, flows)
            passes = REDUCE_PASSES if c == "reduce" else COPY_PASSES
            terms.append((1, alpha, beta + _hbm(topo, passes)))
        else:
            alpha, _ = pattern_cost(topo.instance, [(pl[i], pl[(i + k) % n]) for i in range(n)])
            terms.append((1, alpha, 0.0))
        k <<= 1
    return terms


@functools.lru_cache(maxsize=4096)
def plan_terms(collective: str, algorithm: str, topo: GroupTopology) -> tuple[Term, ...]:
    """The (steps, alpha, beta) terms of one collective and algorithm on a group."""
    n = topo.size
    if n < 2:
        return ()
    c, a = collective, algorithm
    if c in ("allreduce", "allgather", "reduce_scatter") and a in ("ring", "torus", "hierarchical"):
        g = grid_for(topo, a)
        return tuple(_grid_terms(topo, g, rs=c != "allgather", ag=c != "reduce_scatter"))
    if c == "allreduce" and a == "rdh":
        return tuple(_rdh_terms(topo))
    if c == "allreduce" and a == "direct":
        # one burst: every rank sends its whole vector to every other, then reduces n vectors
        _, alpha, beta = _all_pairs(topo, 1.0, 0)
        return ((1, alpha, beta + _hbm(topo, n + 1)),)
    if a in ("tree", "dissemination"):
        return tuple(_log_terms(topo, c, a))
    if c in ("allgather", "reduce_scatter", "alltoall") and a == "direct":
        return (_all_pairs(topo, 1 / n, REDUCE_PASSES if c == "reduce_scatter" else COPY_PASSES),)
    if c == "alltoall" and a == "ring":
        alpha, beta = _ring_pattern(topo)
        return ((n - 1, alpha, (beta + _hbm(topo, COPY_PASSES)) / n),)
    if c in ("broadcast", "reduce"):
        passes = REDUCE_PASSES if c == "reduce" else COPY_PASSES
        if a == "direct":
            return (_all_pairs(topo, 1.0, passes, root=0, to_root=c == "reduce"),)
        alpha, beta = _ring_pattern(topo)     # pipelined chain along the ring
        return ((n - 1, alpha, 0.0), (1, 0.0, beta + _hbm(topo, passes)))
    if c in ("gather", "scatter"):
        if a == "direct":
            return (_all_pairs(topo, 1 / n, COPY_PASSES, root=0, to_root=c == "gather"),)
        alpha, beta = _ring_pattern(topo)
        return ((n - 1, alpha, (beta + _hbm(topo, COPY_PASSES)) / n),)
    if c == "barrier":
        if a == "direct":
            return ((1, _all_pairs(topo, 0, 0)[1], 0.0),)
        alpha, _ = _ring_pattern(topo)
        return ((2 * (n - 1), alpha, 0.0),)
    raise ValueError(f"no cost model for {c} with {a}")


def estimate(collective: str, algorithm: str, nbytes: int, topo: GroupTopology) -> float:
    """Modelled device seconds of `collective` run with `algorithm` on `nbytes` (nccl-tests
    sizes, see the module docstring) over the group `topo`."""
    c = normalise_collective(collective)
    a = check_algorithm(c, algorithm)
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return sum(steps * (alpha + beta * nbytes) for steps, alpha, beta in plan_terms(c, a, topo))


def applicable(collective: str, algorithm: str, topo: GroupTopology) -> bool:
    """Whether the algorithm is more than a fallback to the ring on this group."""
    if algorithm == "hierarchical":
        return hierarchical_grid(topo) is not None and len(hierarchical_grid(topo).shape) > 1
    if algorithm == "torus":
        g = torus_grid(topo)
        return g is not None and len(g.shape) > 1
    return True


def bus_factor(collective: str, n: int) -> float:
    f = BUS_FACTOR.get(normalise_collective(collective))
    return f(n) if f and n > 0 else 1.0
