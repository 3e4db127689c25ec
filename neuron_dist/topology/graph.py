"""The chip graph: links, routes, Hamiltonian cycles, rings over placed ranks, and grids.

A place is (node, chip). A route is the list of links a transfer between two places uses, with
dimension-order routing on a torus (shortest way round each wrapped dimension, ties go +1):
  ("hbm", node, chip)             - between cores of one chip, through its HBM (read + write)
  ("nl", node, chip_a, chip_b)    - one direction of a NeuronLink between neighbouring chips
  ("z", node_a, node_b, chip)     - one direction of a NeuronLink between nodes of one domain
  ("port_out"/"port_in", node, chip) - a chip's switch port (switched fabric)
  ("xport_out"/"xport_in", node, chip) - a chip's port to the other nodes of its switched domain
  ("efa_out"/"efa_in", node, chip) - a chip's share of its node's network: EFA is one NIC per
                                    chip (trn2: 16 x 200 Gbps), so a flow from one chip gets
                                    efa_bandwidth / chips, not the whole node's
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from .instances import InstanceModel
from .placement import GroupTopology

Place = tuple[int, int]


# ---- links and routes ---------------------------------------------------------------------------
def link_bandwidth(inst: InstanceModel, link: tuple) -> float:
    kind = link[0]
    if kind == "hbm":
        return inst.intra_chip_bandwidth or inst.hbm_bandwidth / 2
    if kind == "nl" or kind in ("port_out", "port_in"):
        return inst.link_bandwidth
    if kind in ("z", "xport_out", "xport_in"):
        return inst.domain_link_bandwidth
    if kind in ("efa_out", "efa_in"):
        return inst.efa_bandwidth / inst.chips
    raise ValueError(f"unknown link {link}")


def _torus_path(inst: InstanceModel, a: int, b: int, dims: Sequence[int] | None = None):
    """Chips visited going from chip a to chip b (excluding a), dimension by dimension."""
    dims = range(len(inst.torus_dims)) if dims is None else dims
    cur = list(inst.chip_coords(a))
    goal = inst.chip_coords(b)
    path = []
    for i in dims:
        d, wrap = inst.torus_dims[i], inst.torus_wrap[i]
        delta = goal[i] - cur[i]
        if wrap:
            fwd = delta % d
            step, n = (1, fwd) if fwd <= d - fwd else (-1, d - fwd)
        else:
            step, n = (1 if delta > 0 else -1), abs(delta)
        for _ in range(n):
            cur[i] = (cur[i] + step) % d
            path.append(inst.chip_at(cur))
    return path


@functools.lru_cache(maxsize=None)
def route(inst: InstanceModel, a: Place, b: Place) -> tuple[tuple[tuple, ...], float]:
    """(links used, latency in seconds) of a transfer from place a to place b."""
    (na, ca), (nb, cb) = a, b
    if a == b:
        return (("hbm", na, ca),), inst.link_latency
    D = inst.domain_nodes
    one_domain = D > 1 and na // D == nb // D
    if na != nb and one_domain and inst.graph == "switch":  # across a switched domain
        return (("xport_out", na, ca), ("xport_in", nb, cb)), 2 * inst.link_latency
    if na == nb or one_domain:
        links = []
        if ca != cb:
            if inst.graph == "switch":
                links += [("port_out", na, ca), ("port_in", na, cb)]
            else:
                prev = ca
                for c in _torus_path(inst, ca, cb):
                    links.append(("nl", na, prev, c))
                    prev = c
        if na != nb:   # z ring across the nodes of one domain, at chip cb
            za, zb = na % D, nb % D
            fwd = (zb - za) % D
            step, n = (1, fwd) if fwd <= D - fwd else (-1, D - fwd)
            z, base = za, na - za
            for _ in range(n):
                nz = (z + step) % D
                links.append(("z", base + z, base + nz, cb))
                z = nz
        return tuple(links), max(1, len(links)) * inst.link_latency
    return (("efa_out", na, ca), ("efa_in", nb, cb)), inst.efa_latency


def link_kind(topo: GroupTopology, a: int, b: int) -> str | None:
    """How group ranks a and b are joined: "chip" (same chip), "link" (neighbouring chips),
    "domain" (one NeuronLink hop between nodes of a domain), "network" (different nodes over
    EFA), or None (same node, more than one hop apart)."""
    sa, sb = topo.slots[a], topo.slots[b]
    inst = topo.instance
    links, _ = route(inst, (sa.node, sa.chip), (sb.node, sb.chip))
    if links[0][0] == "hbm":
        return "chip"
    if links[0][0] == "efa_out":
        return "network"
    if len(links) == 1:
        return "domain" if links[0][0] == "z" else "link"
    if links[0][0] == "xport_out":
        return "domain"
    if inst.graph == "switch" and len(links) == 2:
        return "link"
    return None


def pattern_cost(inst: InstanceModel, flows) -> tuple[float, float]:
    """For flows that run at the same time, each moving the same number of bytes:
    (alpha: the slowest flow's latency, beta: seconds per byte on the busiest link). `flows`:
    (source, destination) place pairs, or a mapping of such a pair to how many flows take it
    (an all-pairs pattern of many ranks per place: one route per pair of places, not per pair
    of ranks)."""
    load: dict[tuple, int] = {}
    alpha = 0.0
    for (a, b), k in (flows.items() if isinstance(flows, Mapping) else ((f, 1) for f in flows)):
        links, lat = route(inst, a, b)
        alpha = max(alpha, lat)
        for l in links:
            load[l] = load.get(l, 0) + k
    beta = max((n / link_bandwidth(inst, l) for l, n in load.items()), default=0.0)
    return alpha, beta


# ---- Hamiltonian cycles ------------------------------------------------------------------------
def _ham_cycles(nodes: Sequence[int], adj, limit: int = 200_000):
    """Yield Hamiltonian cycles (lists starting at nodes[0]) of the graph induced on `nodes`."""
    nodes = list(nodes)
    if len(nodes) <= 2:
        yield nodes
        return
    S = set(nodes)
    nb = {v: [u for u in adj(v) if u in S] for v in nodes}
    start = nodes[0]
    path, seen = [start], {start}
    budget = [limit]

    def dfs():
        budget[0] -= 1
        if budget[0] < 0:
            return
        v = path[-1]
        if len(path) == len(nodes):
            if start in nb[v]:
                yield list(path)
            return
        # Warnsdorff: fewest onward choices first
        for u in sorted((u for u in nb[v] if u not in seen),
                        key=lambda u: sum(w not in seen for w in nb[u])):
            path.append(u)
            seen.add(u)
            yield from dfs()
            path.pop()
            seen.discard(u)

    yield from dfs()


def _edges(cycle):
    return {frozenset((cycle[i], cycle[(i + 1) % len(cycle)])) for i in range(len(cycle))}


@functools.lru_cache(maxsize=None)
def hamiltonian_cycles(inst: InstanceModel) -> tuple[tuple[int, ...], ...]:
    """Hamiltonian cycles of one node's chip graph whose every hop is one link. For a torus
    whose chips have 4 links (4x4 with wrap-around) two link-disjoint cycles are returned, usable
    as two channels; otherwise one."""
    n = inst.chips
    if n == 1 or inst.graph in ("single", "switch"):
        return (tuple(range(n)),)
    if inst.graph == "ring":
        return (tuple(range(n)),)
    first = None
    deg = inst.links_per_chip()
    for cyc in _ham_cycles(range(n), inst.chip_neighbours):
        if first is None:
            first = cyc
        if deg != 4 or n < 5:
            break
        rest = {frozenset((v, u)) for v in range(n) for u in inst.chip_neighbours(v)} - _edges(cyc)
        adj2: dict[int, list[int]] = {}
        for e in rest:
            a, b = tuple(e)
            adj2.setdefault(a, []).append(b)
            adj2.setdefault(b, []).append(a)
        if all(len(adj2.get(v, ())) == 2 for v in range(n)):
            c2 = next(_ham_cycles(range(n), lambda v: adj2[v]), None)
            if c2 is not None and len(c2) == n:
                return (tuple(cyc), tuple(c2))
    return (tuple(first),) if first else (tuple(range(n)),)


def _cycle_score(inst: InstanceModel, node: int, order: Sequence[int]):
    """(busiest link's seconds per byte, slowest hop's latency, hop count) of the ring `order`
    of chips on one node: the order `chip_order` minimises."""
    if len(order) < 2:
        return (0.0, 0.0, 0)
    flows = [((node, order[i]), (node, order[(i + 1) % len(order)])) for i in range(len(order))]
    alpha, beta = pattern_cost(inst, flows)
    hops = sum(len(route(inst, a, b)[0]) for a, b in flows)
    return (beta, alpha, hops)


class _Rings:
    """`_cycle_score` for rings over a fixed chip set, from a table of every pair's route (links
    as integers), for the searches of `chip_order` (an order's score is a few list updates)."""

    def __init__(self, inst: InstanceModel, chips: Sequence[int]):
        ids: dict[tuple, int] = {}
        self.bw: list[float] = []
        self.path: dict[tuple[int, int], tuple[int, ...]] = {}
        self.lat: dict[tuple[int, int], float] = {}
        for a in chips:
            for b in chips:
                if a != b:
                    links, self.lat[a, b] = route(inst, (0, a), (0, b))
                    for l in links:
                        if l not in ids:
                            ids[l] = len(ids)
                            self.bw.append(link_bandwidth(inst, l))
                    self.path[a, b] = tuple(ids[l] for l in links)
        self.links = len(ids)

    def score(self, order: Sequence[int]):
        load = [0] * self.links
        alpha, hops = 0.0, 0
        for i, a in enumerate(order):
            e = (a, order[(i + 1) % len(order)])
            alpha = max(alpha, self.lat[e])
            hops += len(self.path[e])
            for l in self.path[e]:
                load[l] += 1
        return (max(n / bw for n, bw in zip(load, self.bw) if n), alpha, hops)

    def best(self, chips: Sequence[int], bound):
        """The best ring through all `chips` (the first fixed) by branch and bound: every part of
        the score only grows as a path grows, and each chip still to leave needs at least its
        shortest hop, so a path that cannot score better than `bound` (the best ring known) is
        cut. (order, score), or None when nothing beats `bound`. Both directions are searched:
        dimension-order routes differ, so a ring and its reverse may load different links."""
        first, n = chips[0], len(chips)
        load = [0] * self.links
        path, left = [first], set(chips[1:])
        short = {a: min(len(self.path[a, b]) for b in chips if b != a) for a in chips}
        best: list = [None, bound]

        def extend(a: int, b: int, beta: float, alpha: float, hops: int):
            e = self.path[a, b]
            for l in e:
                load[l] += 1
            beta = max([beta] + [load[l] / self.bw[l] for l in e])
            return beta, max(alpha, self.lat[a, b]), hops + len(e)

        def undo(a: int, b: int):
            for l in self.path[a, b]:
                load[l] -= 1

        def dfs(beta: float, alpha: float, hops: int, rest: int):
            """Extend `path`; `rest`: the shortest hops onward of the chips not on it."""
            v = path[-1]
            if len(path) == n:
                key = extend(v, first, beta, alpha, hops)
                undo(v, first)
                if key < best[1]:
                    best[:] = [tuple(path), key]
                return
            for c in sorted(left, key=lambda c: len(self.path[v, c])):  # short hops first: early bounds
                key = extend(v, c, beta, alpha, hops)
                if key[:2] + (key[2] + rest,) < best[1]:  # rest: the hops c and the chips left need at least
                    path.append(c)
                    left.discard(c)
                    dfs(*key, rest - short[c])
                    left.add(c)
                    path.pop()
                undo(v, c)

        dfs(0.0, 0.0, 0, sum(short[c] for c in chips[1:]))
        return None if best[0] is None else (best[0], best[1])

    def two_opt(self, order: Sequence[int], key, max_passes: int = 8):
        """Improve a ring by reversing segments (2-opt), taking the first better ring found,
        until no reversal helps (or `max_passes`). A reversal is scored whole (routes are not
        symmetric: its inner steps change links), and only where its two new steps take fewer
        hops than the two they replace, or as many with a shorter longest one."""
        order, n = list(order), len(order)
        h = {e: len(p) for e, p in self.path.items()}
        for _ in range(max_passes):
            better = False
            for i in range(1, n - 1):
                for j in range(i + 1, n):
                    a, b, c, d = order[i - 1], order[i], order[j], order[(j + 1) % n]
                    if d == a:
                        continue  # the whole ring but one chip: the same ring reversed
                    old, new = (h[a, b], h[c, d]), (h[a, c], h[b, d])
                    if (sum(new), max(new)) >= (sum(old), max(old)):
                        continue
                    cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                    k = self.score(cand)
                    if k < key:
                        order, key, better = cand, k, True
            if not better:
                break
        return tuple(order), key


EXHAUSTIVE_CHIPS = 9  # up to this many chips chip_order searches every ring (a few ms of CPU, 17 ms at worst)


@functools.lru_cache(maxsize=None)
def chip_order(inst: InstanceModel, chips: frozenset) -> tuple[int, ...]:
    """A cyclic order of `chips` (on one node) that minimises the busiest link's load, then the
    slowest hop, then the total hop count. Candidates: the node's Hamiltonian cycles restricted to
    the chips, a Hamiltonian cycle of the chips' own subgraph where one exists, the chips in
    order; then, for up to EXHAUSTIVE_CHIPS chips, every ring (branch and bound from the best
    candidate), above that the best candidate improved by 2-opt. The candidates alone missed
    better rings of subsets without a Hamiltonian cycle of their own: chips 0, 2, ..., 14 of a
    trn2 node (the DP groups of an 8x8 mesh at LNC 2) got a ring with a 3-hop step and 12 hops
    where one with at most 2 hops a step, 10 in all, loads no link more (64 KiB ring
    all-reduce modelled 63.5 us against 42.5)."""
    chips_l = sorted(chips)
    if len(chips_l) <= 2 or inst.graph in ("single", "switch"):
        return tuple(chips_l)
    cands = [tuple(c for c in cyc if c in chips) for cyc in hamiltonian_cycles(inst)]
    if len(chips_l) < inst.chips:
        sub = next(_ham_cycles(chips_l, inst.chip_neighbours, limit=20_000), None)
        if sub is not None and len(sub) == len(chips_l):
            cands.append(tuple(sub))
    cands.append(tuple(chips_l))
    rings = _Rings(inst, chips_l)
    order = min(cands, key=rings.score)
    key = rings.score(order)
    if key[2] == len(chips_l) and key[0] * inst.link_bandwidth <= 1 + 1e-9:
        return order  # every step one link, no link used twice: no ring does better
    if len(chips_l) <= EXHAUSTIVE_CHIPS:
        found = rings.best(chips_l, key)
        return found[0] if found else order
    return rings.two_opt(order, key)[0]


def _by_chip(topo: GroupTopology, ranks: Sequence[int]):
    per: dict[tuple[int, int], list[int]] = {}
    for r in ranks:
        per.setdefault(topo.chip_of(r), []).append(r)
    for v in per.values():
        v.sort(key=lambda r: (topo.slots[r].cores, r))
    return per


def _node_ring(topo: GroupTopology, node: int, ranks: Sequence[int]) -> list[int]:
    per = _by_chip(topo, ranks)
    order = chip_order(topo.instance, frozenset(c for (_, c) in per))
    return [r for c in order for r in per[node, c]]


def ring_order(topo: GroupTopology) -> list[int]:
    """A ring of all group ranks: ranks of one chip adjacent (by core), chips of a node in the
    order of `chip_order`, nodes ascending, every other node walked backwards so that a node's
    last chip meets the next node's first at the same chip (a z-link on an UltraServer)."""
    out: list[int] = []
    for i, node in enumerate(topo.nodes):
        seg = _node_ring(topo, node, topo.ranks_on_node(node))
        if i % 2 == 1:
            seg = _reverse_chips(topo, seg)
        out += seg
    return out


def _reverse_chips(topo: GroupTopology, seg: list[int]) -> list[int]:
    """Reverse the chip order of a node segment, keeping each chip's ranks in core order."""
    groups: list[list[int]] = []
    for r in seg:
        if groups and topo.same_chip(groups[-1][0], r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return [r for g in reversed(groups) for r in g]


def ring_orders(topo: GroupTopology) -> list[list[int]]:
    """One ring per channel: two for a single node whose every chip is in the group and whose
    graph has two link-disjoint Hamiltonian cycles, else one (`ring_order`)."""
    cycles = hamiltonian_cycles(topo.instance)
    if len(topo.nodes) == 1 and len(cycles) > 1:
        per = _by_chip(topo, range(topo.size))
        if len(per) == topo.instance.chips:
            node = topo.nodes[0]
            return [[r for c in cyc for r in per[node, c]] for cyc in cycles]
    return [ring_order(topo)]


# ---- grids: ranks arranged as a product of rings -----------------------------------------------
@dataclass(frozen=True)
class Grid:
    """Group ranks as a grid: `coords[r]` is rank r's coordinate in each dimension of `shape`,
    a bijection onto the whole grid. Along dimension d, the ranks that agree on every other
    coordinate form a line, ordered by coordinate d, run as a ring. `kinds` names the dimensions.
    """
    shape: tuple[int, ...]
    coords: tuple[tuple[int, ...], ...]
    kinds: tuple[str, ...] = ()

    def __post_init__(self):
        import math
        if len(set(self.coords)) != len(self.coords) or len(self.coords) != math.prod(self.shape):
            raise ValueError("grid coordinates must be a bijection onto the grid")

    def rank_at(self) -> dict[tuple[int, ...], int]:
        return {c: r for r, c in enumerate(self.coords)}


def line_direction(coords: Sequence[int], d: int) -> int:
    """Ring direction of the line along dimension d through `coords`: +1, or -1 for lines of odd
    first coordinate (d >= 1), so that the lines of the cores of one chip share a link's two
    directions instead of loading one. Depends on coordinates other than d only."""
    return -1 if d >= 1 and coords[0] % 2 == 1 else 1


def line_next(grid: Grid, rank: int, d: int, rank_at=None) -> int:
    rank_at = rank_at or grid.rank_at()
    c = grid.coords[rank]
    step = line_direction(c, d)
    nc = c[:d] + ((c[d] + step) % grid.shape[d],) + c[d + 1:]
    return rank_at[nc]


def _squeeze(shape, coords, kinds) -> Grid:
    keep = [i for i, n in enumerate(shape) if n > 1]
    return Grid(tuple(shape[i] for i in keep), tuple(tuple(c[i] for i in keep) for c in coords),
                tuple(kinds[i] for i in keep))


def ring_grid(topo: GroupTopology) -> Grid:
    order = ring_order(topo)
    coords = [None] * topo.size
    for i, r in enumerate(order):
        coords[r] = (i,)
    return Grid((topo.size,), tuple(coords), ("ring",))


def _node_coords(topo: GroupTopology, split: bool):
    """(shape, coordinates of each group node, kinds) of the node part of a grid: one dimension
    over the nodes, or with `split` [nodes of a domain] x [domains] (None where the group's nodes
    are not the same number in each of several NeuronLink domains)."""
    nodes = topo.nodes
    if not split:
        return (len(nodes),), {n: (i,) for i, n in enumerate(nodes)}, ("node",)
    D = topo.instance.domain_nodes
    per: dict[int, list[int]] = {}
    for n in nodes:
        per.setdefault(n // D, []).append(n)
    sizes = {len(v) for v in per.values()}
    if D == 1 or len(per) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    coords = {n: (i, j) for j, dom in enumerate(sorted(per)) for i, n in enumerate(per[dom])}
    return (sizes.pop(), len(per)), coords, ("node", "domain")


def _bandwidth_price(topo: GroupTopology, grid: Grid) -> float:
    """Seconds per byte of a large all-reduce on `grid`, by the cost model's own terms."""
    from .cost import _grid_terms  # cost imports this module
    return sum(steps * beta for steps, _, beta in _grid_terms(topo, grid, True, True))


@functools.lru_cache(maxsize=256)  # pure in topo; cost.applicable asks at every choice, pricing grids
def torus_grid(topo: GroupTopology) -> Grid | None:
    """The group as [cores of a chip] x [torus dimensions] x [nodes] when every placed chip holds
    the same number of ranks and every node the same chips: the full torus in its own
    dimensions; otherwise the chips of a node as one ring (`chip_order`). None when the group is
    not such a product (the caller falls back to `ring_grid`).

    Across several NeuronLink domains (UltraServers) holding the same number of the group's
    nodes each, the nodes are [nodes of a domain] x [domains]: one line over every node crossed
    EFA at two domain boundaries and each of its steps waited on the slowest hop (trn2u, 8 nodes
    x 4 ranks, 64 MiB all-reduce: 3.29 ms modelled); split, the in-domain lines run over
    NeuronLink and only the last dimension, on the smallest blocks, crosses EFA (1.84 ms). Kept
    unless the model prices it dearer for large messages, where the torus runs: with two nodes
    of each of many domains the single line can be (up to 11% at 1 GiB, 8 domains), as half its
    lines cross EFA at each boundary where every domain line does."""
    inst = topo.instance
    per = _by_chip(topo, range(topo.size))
    ks = {len(v) for v in per.values()}
    nodes = topo.nodes
    chipsets = {frozenset(c for (n, c) in per if n == node) for node in nodes}
    if len(ks) != 1 or len(chipsets) != 1:
        return None
    k = ks.pop()
    chips = chipsets.pop()
    full_torus = len(chips) == inst.chips and inst.graph in ("torus", "ring") and inst.chips > 1
    order = None if full_torus else chip_order(inst, frozenset(chips))

    def build(node_shape, node_at, node_kinds) -> Grid:
        coords: list = [None] * topo.size
        if full_torus:
            shape = (k, *inst.torus_dims, *node_shape)
            kinds = ("core", *"xyw"[:len(inst.torus_dims)], *node_kinds)
            for (n, c), rs in per.items():
                for i, r in enumerate(rs):
                    coords[r] = (i, *inst.chip_coords(c), *node_at[n])
        else:
            shape = (k, len(order), *node_shape)
            kinds = ("core", "chips", *node_kinds)
            for (n, c), rs in per.items():
                for i, r in enumerate(rs):
                    coords[r] = (i, order.index(c), *node_at[n])
        return _squeeze(shape, coords, kinds)

    g = build(*_node_coords(topo, False))
    split = _node_coords(topo, True)
    if split is not None:
        g2 = build(*split)
        if _bandwidth_price(topo, g2) <= _bandwidth_price(topo, g) * (1 + 1e-9):
            g = g2
    return g if g.shape else None


def hierarchical_grid(topo: GroupTopology) -> Grid | None:
    """[ranks of a node, as the node's ring] x [nodes], for a symmetric multi-node group."""
    nodes = topo.nodes
    if len(nodes) < 2 or not topo.is_symmetric():
        return None
    coords: list = [None] * topo.size
    for j, n in enumerate(nodes):
        for i, r in enumerate(_node_ring(topo, n, topo.ranks_on_node(n))):
            coords[r] = (i, j)
    L = len(topo.ranks_on_node(nodes[0]))
    return _squeeze((L, len(nodes)), coords, ("local", "node"))


def grid_for(topo: GroupTopology, algorithm: str) -> Grid:
    """The grid an algorithm runs on ("ring", "torus", "hierarchical"); falls back to the ring."""
    g = None
    if algorithm == "torus":
        g = torus_grid(topo)
    elif algorithm == "hierarchical":
        g = hierarchical_grid(topo)
    return g or ring_grid(topo)
