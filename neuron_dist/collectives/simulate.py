"""Run one Schedule per rank in one process, without transports, for tests and tools.

Honours the round semantics of `schedule.py`: a round's local steps run first, then its sends
post their slices (as they stand then) to per-(src, dst) FIFO queues and its receives complete
in order as matching messages arrive. A rank blocked on a receive whose message has not been sent
yet waits; when no rank can move and some have not finished, `Deadlock` names every waiting
rank, its round and the peer it waits on. Every message is recorded as (src, dst, bytes). A
receive that disagrees with its send on the count, or on the `lend` mark or, lent, on whether
it reduces (the two ends would cut the step into different frames), is a `ScheduleError`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .schedule import IN, OUT, Copy, LocalReduce, Recv, Schedule, Send


class Deadlock(RuntimeError):
    pass


class ScheduleError(RuntimeError):
    pass


@dataclass
class SimResult:
    outs: list            # each rank's OUT buffer
    transfers: list = field(default_factory=list)   # (src, dst, bytes) per message, in send order
    rounds: int = 0        # the longest schedule's round count

    def pairs(self) -> set[tuple[int, int]]:
        return {(s, d) for s, d, _ in self.transfers}


def simulate(schedules: Sequence[Schedule], ins: Sequence, outs: Sequence | None = None, *,
             op: Callable | None = None, inplace: bool = False) -> SimResult:
    """Run `schedules[r]` as rank r. `ins[r]`: rank r's IN buffer (1-D numpy array or torch
    tensor); `outs[r]`: its OUT buffer (allocated like IN when None); inplace=True makes OUT the
    same buffer as IN (all-reduce). `op(a, b)` is the reduction (default: addition), its operands in
    the order the steps give (schedule.py, "Operand order"). Returns the OUT buffers and the
    transfers."""
    n = len(schedules)
    if op is None:
        op = np.add if not n or isinstance(ins[0], np.ndarray) else _torch_add
    if len(ins) != n:
        raise ValueError(f"{n} schedules but {len(ins)} inputs")
    bufs = []
    for r in range(n):
        x = ins[r]
        o = x if inplace else (outs[r] if outs is not None else _empty_like(x, len(x)))
        tmp = _empty_like(x, schedules[r].tmp_count)
        bufs.append((x, o, tmp))
    itemsize = _itemsize(ins[0]) if n else 8
    queues: dict[tuple[int, int], deque] = {}
    transfers: list = []
    pc = [0] * n                      # current round
    pending: list = [None] * n        # remaining Recvs of the current round, None = not started
    done = 0
    finished = [False] * n

    def view(r, c):
        return bufs[r][c.buf][c.start:c.start + c.count]

    def start_round(r):
        steps = schedules[r].rounds[pc[r]]
        for s in steps:
            if isinstance(s, Copy) and s.late:
                _check_late(r, pc[r], s, steps, inplace)
            elif isinstance(s, Copy):
                view(r, s.dst)[...] = _copy(view(r, s.src))
            elif isinstance(s, LocalReduce):
                d = view(r, s.dst)
                d[...] = op(view(r, s.src), d) if s.src_first else op(d, view(r, s.src))
        clash = round_conflict(steps, inplace)
        if clash:
            raise ScheduleError(f"rank {r} round {pc[r]}: {clash[0]} reads what {clash[1]} writes")
        recvs = []
        for s in steps:
            if isinstance(s, Send):
                if not 0 <= s.peer < n or s.peer == r:
                    raise ScheduleError(f"rank {r} round {pc[r]}: send to bad peer {s.peer}")
                queues.setdefault((r, s.peer), deque()).append((_copy(view(r, s.src)), s.lend, s.reduced))
                transfers.append((r, s.peer, s.src.count * itemsize))
            elif isinstance(s, Recv):
                if not 0 <= s.peer < n or s.peer == r:
                    raise ScheduleError(f"rank {r} round {pc[r]}: recv from bad peer {s.peer}")
                recvs.append(s)
        for s in steps:  # late copies: once the sends are posted (they touch nothing posted)
            if isinstance(s, Copy) and s.late:
                view(r, s.dst)[...] = _copy(view(r, s.src))
        pending[r] = recvs

    def progress(r) -> bool:
        moved = False
        while not finished[r]:
            if pc[r] >= len(schedules[r].rounds):
                finished[r] = True
                return True
            if pending[r] is None:
                start_round(r)
                moved = True
            recvs = pending[r]
            keep = []
            blocked_peers = set()
            for s in recvs:
                q = queues.get((s.peer, r))
                if s.peer in blocked_peers or not q:
                    blocked_peers.add(s.peer)
                    keep.append(s)
                    continue
                data, lend, reduced = q.popleft()
                if len(data) != s.dst.count:
                    raise ScheduleError(f"rank {r} round {pc[r]}: receives {s.dst.count} elements "
                                        f"from rank {s.peer}, which sent {len(data)}")
                if lend != s.lend:  # the two ends would cut the step into different frames
                    raise ScheduleError(f"rank {r} round {pc[r]}: recv lend={s.lend} from rank "
                                        f"{s.peer}, whose send has lend={lend}")
                if lend and reduced != s.reduce:  # ... from different sizes on (lend_reduce_from)
                    raise ScheduleError(f"rank {r} round {pc[r]}: lent recv reduce={s.reduce} from rank "
                                        f"{s.peer}, whose send has reduced={reduced}")
                d = view(r, s.dst)
                if s.reduce:
                    b = view(r, s.base) if s.base is not None else d
                    d[...] = op(data, b) if s.incoming_first else op(b, data)
                else:
                    d[...] = data
                moved = True
            if keep:
                pending[r] = keep
                return moved
            pending[r] = None
            pc[r] += 1
        return moved

    while done < n:
        moved = False
        for r in range(n):
            if not finished[r]:
                if progress(r):
                    moved = True
                if finished[r]:
                    done += 1
        if not moved and done < n:
            waits = [f"rank {r} round {pc[r]} waits on "
                     f"{sorted({s.peer for s in pending[r] or ()})}"
                     for r in range(n) if not finished[r]]
            raise Deadlock("schedules deadlock: " + "; ".join(waits[:16]) +
                           (f" (+{len(waits) - 16} more)" if len(waits) > 16 else ""))
    left = {k: len(q) for k, q in queues.items() if q}
    if left:
        raise ScheduleError(f"messages sent but never received (src, dst): {left}")
    return SimResult([b[1] for b in bufs], transfers, max((len(s.rounds) for s in schedules), default=0))


def _meets(a, b, inplace: bool) -> bool:
    """Whether chunks `a` and `b` share an element (IN and OUT are one buffer in place)."""
    same = a.buf == b.buf or inplace and {a.buf, b.buf} == {IN, OUT}
    return bool(same and a.count and b.count and a.start < b.start + b.count and b.start < a.start + a.count)


def round_conflict(steps, inplace: bool):
    """The first (Send, Recv) of a round whose send reads what the receive writes, or None. A
    round's sends and receives progress together (schedule.py): an executor sends a slice frame
    by frame while the peer's frames land in it. This simulator copies a send's slice whole when
    it posts it, so without this check it ran such a schedule right (recursive doubling without
    its TMP copy passed every simulated test and gave wrong sums over real transports)."""
    for s in steps:
        if isinstance(s, Send):
            for v in steps:
                if isinstance(v, Recv) and _meets(s.src, v.dst, inplace):
                    return s, v
    return None


def _check_late(r: int, rnd: int, copy: Copy, steps, inplace: bool) -> None:
    """A late Copy (schedule.py) may write nothing its round's sends read or receives write, nor
    read what a receive writes: it runs while they are under way. IN and OUT are one buffer in
    place."""
    for s in steps:
        hit = isinstance(s, Send) and _meets(copy.dst, s.src, inplace) or \
            isinstance(s, Recv) and (_meets(copy.dst, s.dst, inplace) or _meets(copy.src, s.dst, inplace))
        if hit:
            raise ScheduleError(f"rank {r} round {rnd}: late {copy} touches what {s} uses")


def _empty_like(x, count):
    if isinstance(x, np.ndarray):
        return np.zeros(count, dtype=x.dtype)
    import torch
    return torch.zeros(count, dtype=x.dtype)


def _copy(v):
    return v.copy() if isinstance(v, np.ndarray) else v.clone()


def _itemsize(x):
    return x.itemsize if isinstance(x, np.ndarray) else x.element_size()


def _torch_add(a, b):
    import torch
    return torch.add(a, b)
