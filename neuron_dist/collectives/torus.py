"""Grid (torus) collectives: all-reduce, reduce-scatter and all-gather run dimension by dimension.

The group is a grid (`topology.graph.Grid`): `shape` and each rank's `coords`. Along dimension d
the ranks agreeing on every other coordinate form a line, run as a ring (direction from
`topology.graph.line_direction`, so that the several cores of one chip use both directions of a
link). Reduce-scatter walks the dimensions in order, each stage shrinking the data a rank owns by
the line's length; all-gather walks them back. On a torus the lines are rings of neighbouring
chips, so every message crosses one link. With a one-dimensional grid these are plain rings, and
the hierarchical algorithm is the grid [ranks of a node] x [nodes].

Buffers follow the executor's layouts: all-reduce works in place on OUT (count N); all-gather
gathers `count` elements per rank into OUT with rank r's block at r*count; reduce-scatter reads
IN (size*count, block r for rank r, never written), reduces in TMP (size*count) and writes
`count` elements to OUT.
"""
from __future__ import annotations

from typing import Sequence

from ..topology.graph import line_direction
from .schedule import IN, OUT, TMP, Chunk, Copy, Recv, Schedule, Send, split

Blocks = list[list[Chunk]]     # blocks[j]: the pieces of block j


def _line(shape, coords, rank_at, me: int, d: int) -> tuple[list[int], int, int]:
    c = coords[me]
    line = [rank_at[c[:d] + (j,) + c[d + 1:]] for j in range(shape[d])]
    return line, c[d], line_direction(c, d)


def rs_ring(pos: int, line: Sequence[int], blocks: Blocks, direction: int = 1,
            work: Blocks | None = None) -> list[tuple]:
    """Rounds of a ring reduce-scatter on `line` (this rank at `pos`): afterwards block `pos`
    holds the reduction over the line. In place in `blocks`; or, with `work` (same piece
    counts, other buffer), received sums are written to `work` with base `blocks`, leaving
    `blocks` untouched. Its steps are marked lendable with `reduced`, as ring.reduce_scatter's:
    large pieces are read from the sender's memory and reduced part by part (world 2 and 4,
    forced, 64 MiB: reduce-scatter 0.84-0.93x the time, all-reduce 0.87-1.00x; at 16 MiB, 4 MiB
    pieces at world 4, 0.94-1.05x; benchmarks/RESULTS.md, "Thirty-first pass")."""
    p = len(line)
    nxt, prv = line[(pos + direction) % p], line[(pos - direction) % p]
    rounds = []
    for s in range(p - 1):
        sb, rb = (pos - direction * (s + 1)) % p, (pos - direction * (s + 2)) % p
        src = blocks[sb] if work is None or s == 0 else work[sb]
        steps: list = [Send(nxt, c, lend=True, reduced=True) for c in src if c.count]
        if work is None:
            steps += [Recv(prv, c, reduce=True, lend=True) for c in blocks[rb] if c.count]
        else:
            steps += [Recv(prv, w, reduce=True, base=b, lend=True)
                      for b, w in zip(blocks[rb], work[rb]) if b.count]
        rounds.append(tuple(steps))
    return rounds


def ag_ring(pos: int, line: Sequence[int], blocks: Blocks, direction: int = 1) -> list[tuple]:
    """Rounds of a ring all-gather on `line`: block `pos` is this rank's, afterwards all are.
    Its steps only copy, so they are marked lendable (for an all-reduce's all-gather half)."""
    p = len(line)
    nxt, prv = line[(pos + direction) % p], line[(pos - direction) % p]
    rounds = []
    for s in range(p - 1):
        sb, rb = (pos - direction * s) % p, (pos - direction * (s + 1)) % p
        rounds.append(tuple([Send(nxt, c, lend=True) for c in blocks[sb] if c.count] +
                            [Recv(prv, c, lend=True) for c in blocks[rb] if c.count]))
    return rounds


def _add_rounds(sched: Schedule, rounds, first_local: Sequence = ()):
    first_local = list(first_local)
    for r in rounds:
        if first_local:
            r = tuple(first_local) + tuple(r)
            first_local = []
        sched.add(*r)
    if first_local:
        sched.add(*first_local)


def grid_allreduce(rank: int, shape: Sequence[int], coords: Sequence[tuple], count: int,
                   algorithm: str = "torus") -> Schedule:
    """All-reduce of `count` elements in place on OUT: ring reduce-scatter along each dimension
    in order (on the part this rank owns so far), then ring all-gather back."""
    shape = tuple(shape)
    rank_at = {c: r for r, c in enumerate(coords)}
    sched = Schedule(algorithm)
    start, n = 0, count
    stack = []
    for d, p in enumerate(shape):
        if p < 2:
            continue
        line, pos, dirn = _line(shape, coords, rank_at, rank, d)
        blocks = [[Chunk(OUT, start + s, k)] for s, k in split(n, p)]
        _add_rounds(sched, rs_ring(pos, line, blocks, dirn))
        stack.append((line, pos, dirn, blocks))
        start, n = blocks[pos][0].start, blocks[pos][0].count
    for line, pos, dirn, blocks in reversed(stack):
        _add_rounds(sched, ag_ring(pos, line, blocks, dirn))
    return sched


def _pieces(coords, shape, me_c, d: int, j: int, fixed_dims, buf: int, count: int) -> list[Chunk]:
    """The rank blocks (buf, r*count, count) of block j along dimension d: ranks with
    coordinate j in d and this rank's coordinates in `fixed_dims`, merged where contiguous."""
    out: list[Chunk] = []
    for r, c in enumerate(coords):
        if c[d] != j or any(c[e] != me_c[e] for e in fixed_dims):
            continue
        if out and out[-1].start + out[-1].count == r * count:
            out[-1] = Chunk(buf, out[-1].start, out[-1].count + count)
        else:
            out.append(Chunk(buf, r * count, count))
    return out


def grid_reduce_scatter(rank: int, shape: Sequence[int], coords: Sequence[tuple], count: int,
                        algorithm: str = "torus") -> Schedule:
    """Reduce-scatter: IN holds size*count elements (block r for rank r), OUT gets this rank's
    `count`. Dimension by dimension; IN is only read, partial sums live in TMP (size*count)."""
    shape = tuple(shape)
    size = len(coords)
    rank_at = {c: r for r, c in enumerate(coords)}
    me_c = coords[rank]
    sched = Schedule(algorithm, tmp_count=size * count if size > 1 else 0)
    if count == 0:
        return sched
    dims = [d for d, p in enumerate(shape) if p > 1]
    if not dims:
        return sched.add(Copy(Chunk(IN, rank * count, count), Chunk(OUT, 0, count)))
    for i, d in enumerate(dims):
        line, pos, dirn = _line(shape, coords, rank_at, rank, d)
        fixed = dims[:i]
        if i == 0:
            blocks = [_pieces(coords, shape, me_c, d, j, fixed, IN, count) for j in range(shape[d])]
            work = [[Chunk(TMP, c.start, c.count) for c in b] for b in blocks]
            _add_rounds(sched, rs_ring(pos, line, blocks, dirn, work))
        else:
            blocks = [_pieces(coords, shape, me_c, d, j, fixed, TMP, count) for j in range(shape[d])]
            _add_rounds(sched, rs_ring(pos, line, blocks, dirn))
    return sched.add(Copy(Chunk(TMP, rank * count, count), Chunk(OUT, 0, count)))


def grid_allgather(rank: int, shape: Sequence[int], coords: Sequence[tuple], count: int,
                   algorithm: str = "torus") -> Schedule:
    """All-gather: IN holds this rank's `count` elements, OUT gets size*count with rank r's at
    r*count. Dimensions are walked in reverse order (the largest blocks on the first one)."""
    shape = tuple(shape)
    rank_at = {c: r for r, c in enumerate(coords)}
    me_c = coords[rank]
    sched = Schedule(algorithm)
    if count == 0:
        return sched
    first = [Copy(Chunk(IN, 0, count), Chunk(OUT, rank * count, count))]
    dims = [d for d, p in enumerate(shape) if p > 1]
    for i, d in reversed(list(enumerate(dims))):
        line, pos, dirn = _line(shape, coords, rank_at, rank, d)
        fixed = dims[:i]
        blocks = [_pieces(coords, shape, me_c, d, j, fixed, OUT, count) for j in range(shape[d])]
        _add_rounds(sched, ag_ring(pos, line, blocks, dirn), first)
        first = []
    if first:
        sched.add(*first)
    return sched


# ---- entry points on a GroupTopology ------------------------------------------------------------
def placed_grid(topo, algorithm: str):
    """(grid, name) for `algorithm` ("torus", "hierarchical") on the group's placement: its grid
    and name, or the ring's grid and "ring" where the placement has none, so that the op's
    record names the schedule that runs (a torus forced at five ranks on one chip was recorded
    as a torus)."""
    from ..topology.graph import grid_for
    g = grid_for(topo, algorithm)
    return g, "ring" if g.kinds == ("ring",) else algorithm


def torus_allreduce(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "torus")
    return grid_allreduce(rank, g.shape, g.coords, count, name)


def torus_reduce_scatter(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "torus")
    return grid_reduce_scatter(rank, g.shape, g.coords, count, name)


def torus_allgather(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "torus")
    return grid_allgather(rank, g.shape, g.coords, count, name)
