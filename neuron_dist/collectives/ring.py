"""Ring reduce-scatter, all-gather and all-reduce over any ring order of the group's ranks.

Blocks are indexed by group rank (block b is rank b's share), whatever the ring order: the
order only decides who talks to whom, so the topology can supply any Hamiltonian cycle.
Position p in the ring sends to position p+1 and receives from p-1 in every round.
"""
from __future__ import annotations

from .schedule import IN, OUT, TMP, Chunk, Copy, Recv, Schedule, Send, split


def _positions(order: list[int], rank: int) -> tuple[int, int, int, int]:
    n = len(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"ring order {order} is not a permutation of 0..{n - 1}")
    p = order.index(rank)
    return n, p, order[(p + 1) % n], order[(p - 1) % n]


def reduce_scatter_rounds(order: list[int], rank: int, blocks: list[tuple[int, int]],
                          src_buf: int, acc_buf: int) -> Schedule:
    """After these n-1 rounds, block `rank` of `acc_buf` holds the reduction of every rank's
    block `rank`. Blocks are read from `src_buf` the first time and accumulated in `acc_buf`
    (src_buf == acc_buf reduces in place; otherwise src_buf is never written). Steps are marked
    lendable: where blocks are large, the receiver reads the sender's block itself and reduces
    it part by part, instead of the sender copying it through the ring (see `reduce_scatter`)."""
    n, p, nxt, prv = _positions(order, rank)
    s = Schedule("ring")
    for step in range(n - 1):
        send_b = order[(p - step - 1) % n]
        recv_b = order[(p - step - 2) % n]
        sb, rb = blocks[send_b], blocks[recv_b]
        send_from = src_buf if step == 0 else acc_buf
        base = None if src_buf == acc_buf else Chunk(src_buf, rb[0], rb[1])
        s.add(Send(nxt, Chunk(send_from, sb[0], sb[1]), lend=True, reduced=True),
              Recv(prv, Chunk(acc_buf, rb[0], rb[1]), reduce=True, base=base, lend=True))
    return s


def all_gather_rounds(order: list[int], rank: int, blocks: list[tuple[int, int]], buf: int,
                      lend: bool = False) -> Schedule:
    """Given block `rank` of `buf`, after these n-1 rounds every block of `buf` is filled.
    lend=True marks the steps lendable (for a collective whose other steps reduce)."""
    n, p, nxt, prv = _positions(order, rank)
    s = Schedule("ring")
    for step in range(n - 1):
        send_b = order[(p - step) % n]
        recv_b = order[(p - step - 1) % n]
        sb, rb = blocks[send_b], blocks[recv_b]
        s.add(Send(nxt, Chunk(buf, sb[0], sb[1]), lend=lend), Recv(prv, Chunk(buf, rb[0], rb[1]), lend=lend))
    return s


def allreduce(order: list[int], rank: int, count: int) -> Schedule:
    """In place on OUT (IN is OUT): reduce-scatter then all-gather, 2(n-1) rounds. Every step
    may be lent: the all-gather half's copies (one copy instead of two), and from larger blocks
    the reduce-scatter half's (see `reduce_scatter`)."""
    blocks = split(count, len(order))
    s = reduce_scatter_rounds(order, rank, blocks, OUT, OUT)
    s.extend(all_gather_rounds(order, rank, blocks, OUT, lend=True))
    s.algorithm = "ring"
    return s


def allgather(order: list[int], rank: int, counts: list[int]) -> Schedule:
    """IN holds counts[rank] elements; OUT holds every rank's block in group-rank order. The first
    round sends the rank's own block from IN, beside its copy into OUT, rather than from OUT in a
    round after the copy: one round fewer (world 2, back to back, 0-11% less time per call at
    4 KiB-16 MiB), and at two ranks the ring is the direct schedule."""
    blocks, start = [], 0
    for c in counts:
        blocks.append((start, c))
        start += c
    own = Copy(Chunk(IN, 0, counts[rank]), Chunk(OUT, blocks[rank][0], counts[rank]))
    s = Schedule("ring")
    rounds = all_gather_rounds(order, rank, blocks, OUT).rounds
    if not rounds:
        return s.add(own)
    (send, recv), *rest = rounds
    s.add(own, Send(send.peer, own.src), recv)
    for steps in rest:
        s.add(*steps)
    return s


def reduce_scatter(order: list[int], rank: int, counts: list[int]) -> Schedule:
    """IN holds every rank's block (group-rank order); OUT gets the reduction of block `rank`.
    IN is never written. A partial sum is only needed until it is sent on in the next round, so
    two block-sized TMP slots alternate, and the last round reduces straight into OUT: scratch
    is 2 blocks (none at 2 ranks) instead of the whole input, and no final copy.

    Steps are marked lendable with `reduced`: over shared memory with single-copy reads, a block
    of at least the transport's `lend_reduce_from` (4 MiB) is read by its receiver straight from
    the sender's memory into a cache-sized buffer and reduced from there, part by part, instead
    of being copied into the ring by the sender and read out of it (one copy fewer per block,
    no ring-full waits). World 2, back to back, 16-64 MiB: reduce-scatter 0.80-0.85x the time,
    all-reduce 0.85-0.96x; world 4, 64 MiB: 0.78x and 0.82x (benchmarks/RESULTS.md, "Thirty-first
    pass"); at 1-2 MiB blocks it lost as often as it won, hence the larger threshold."""
    blocks, start = [], 0
    for c in counts:
        blocks.append((start, c))
        start += c
    n = len(order)
    if n == 1:
        return Schedule("ring").add(Copy(Chunk(IN, 0, counts[0]), Chunk(OUT, 0, counts[0])))
    _, p, nxt, prv = _positions(order, rank)
    m = max(counts)
    s = Schedule("ring", tmp_count=2 * m if n > 2 else 0)
    for step in range(n - 1):
        sb = blocks[order[(p - step - 1) % n]]
        rb = blocks[order[(p - step - 2) % n]]   # the block sent on in the next round
        src = Chunk(IN, sb[0], sb[1]) if step == 0 else Chunk(TMP, ((step - 1) % 2) * m, sb[1])
        dst = Chunk(OUT, 0, rb[1]) if step == n - 2 else Chunk(TMP, (step % 2) * m, rb[1])
        s.add(Send(nxt, src, lend=True, reduced=True),
              Recv(prv, dst, reduce=True, base=Chunk(IN, rb[0], rb[1]), lend=True))
    return s
