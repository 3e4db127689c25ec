"""Recursive doubling all-reduce, for latency-bound (small) messages: log2(P) rounds.

Ranks are taken in `order` (a ring order, so that the first rounds pair ranks of one chip).
With P not a power of two, the P - P2 ranks beyond the largest power of two P2 first fold their
data into a partner, which runs the doubling rounds for both and hands the result back.
In every round both ranks of a pair reduce the same two operands, the one from the lower position
in `order` first (schedule.py, "Operand order"), so all ranks end bit-identical. Each exchange
sends from a TMP copy, never from the slice being reduced.
"""
from __future__ import annotations

from typing import Sequence

from .schedule import OUT, TMP, Chunk, Copy, Recv, Schedule, Send


def rdh_allreduce(rank: int, order: Sequence[int], count: int) -> Schedule:
    """All-reduce of `count` elements in place on OUT among the ranks of `order`."""
    order = list(order)
    P = len(order)
    sched = Schedule("rdh", tmp_count=count if P > 1 else 0)
    if P < 2 or count == 0:
        return sched
    pos = order.index(rank)
    P2 = 1 << (P.bit_length() - 1)
    data, tmp = Chunk(OUT, 0, count), Chunk(TMP, 0, count)
    extra = P - P2
    if pos >= P2:                                   # fold in, wait for the answer
        partner = order[pos - P2]
        return sched.add(Send(partner, data)).add(Recv(partner, data, lend=True))  # the answer: a copy
    if pos < extra:
        sched.add(Recv(order[pos + P2], data, reduce=True))
    k = 1
    while k < P2:
        partner = order[pos ^ k]
        sched.add(Copy(data, tmp), Send(partner, tmp),
                  Recv(partner, data, reduce=True, incoming_first=bool(pos & k)))
        k <<= 1
    if pos < extra:
        sched.add(Send(order[pos + P2], data, lend=True))
    return sched

