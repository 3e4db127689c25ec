"""The schedule: what a collective algorithm produces and an executor runs.

An algorithm never touches a transport. It turns (collective, sizes, rank order, my rank) into a
`Schedule`: a list of rounds, each a tuple of steps on slices of the operation's flat buffers.
An executor (`executor.py` over a real transport, `simulate.py` in one process) runs it.

Buffers are flat 1-D tensors of the collective's dtype, named by index:
  IN  - the caller's input (never written unless it is also OUT, as for in-place all-reduce)
  OUT - the caller's output
  TMP - scratch of `Schedule.tmp_count` elements, owned by the executor

Round semantics (the contract every executor implements):
  1. The round's local steps (Copy, LocalReduce) run first, in the order listed, but a late Copy.
  2. Then its Send and Recv steps progress concurrently until all are complete; a Send reads its
     slice as it stands after step 1, a Recv writes its slice when its data arrives. A late Copy
     (`Copy.late`) runs once the round's sends are under way, before the round ends; it may
     touch nothing the round's sends read or its receives write (the simulator checks).
  3. Messages between a pair of ranks are matched in order: the k-th Send from a to b meets the
     k-th Recv of b from a (within one collective), so counts must agree.
A schedule must be deadlock-free with bounded transport buffers: whenever a rank sends to a peer,
that peer either receives it in the same round or reaches the matching Recv without waiting on
the sender. All schedules here pair their exchanges within a round.

Operand order. A reducing step computes op(a, b) with the rank's own data first (a Recv's base or
dst, a LocalReduce's dst) unless it says otherwise (`Recv.incoming_first`,
`LocalReduce.src_first`). Where several ranks compute the same element (a pair that swaps
vectors and both reduce, as direct all-reduce at two ranks and recursive doubling do), each must
put the same operand first: the reduce ops are commutative in value but not always bit for bit
(torch.maximum(+0.0, -0.0) is -0.0 and its mirror +0.0; NaN + -NaN takes the first operand's
sign), and ranks must end bit-identical. tests/test_schedules_topology.py runs every all-reduce
builder in the simulator with an op that is not commutative at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

IN, OUT, TMP = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Chunk:
    """`count` elements of buffer `buf` starting at element `start`."""
    buf: int
    start: int
    count: int

    def __post_init__(self):
        if self.buf not in (IN, OUT, TMP) or self.start < 0 or self.count < 0:
            raise ValueError(f"bad chunk {self}")


@dataclass(frozen=True, slots=True)
class Send:
    """Send `src` to `peer`. lend=True: a transport that lends (single-copy, transport/cma.py)
    may let the peer read it in place (its Recv says lend=True too); collectives that only move
    data lend every step without marks. reduced=True: the peer reduces what it reads (its Recv
    has reduce=True), so both ends lend the step only from the transport's larger
    `lend_reduce_from` (see executor.frame_plan)."""
    peer: int
    src: Chunk
    lend: bool = False
    reduced: bool = False


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive `dst.count` elements from `peer`. With reduce=True: dst = op(base or dst, incoming),
    or op(incoming, base or dst) with incoming_first (see "Operand order" above).
    lend=True pairs with the matching Send's (and reduce=True with its reduced=True): both ends cut
    the step into frames alike. A reducing receive reads a lent frame in cache-sized parts and
    reduces each as it arrives (executor), never holding the whole frame twice."""
    peer: int
    dst: Chunk
    reduce: bool = False
    base: Chunk | None = None
    lend: bool = False
    incoming_first: bool = False

    def __post_init__(self):
        if self.base is not None and (not self.reduce or self.base.count != self.dst.count):
            raise ValueError(f"bad recv base {self}")
        if self.incoming_first and not self.reduce:
            raise ValueError(f"incoming_first orders a reduction's operands; this recv copies: {self}")


@dataclass(frozen=True, slots=True)
class Copy:
    """dst = src. late=True: run once the round's sends are under way (see "Round semantics"), so
    that a copy no peer waits for overlaps the peers' reading, as a scatter root's own block:
    first, it kept the receivers idle for the whole copy (64 MiB at two ranks: 11.4 ms, 6.0 in
    place, where the copy is skipped)."""
    src: Chunk
    dst: Chunk
    late: bool = False

    def __post_init__(self):
        if self.src.count != self.dst.count:
            raise ValueError(f"copy count mismatch {self}")


@dataclass(frozen=True, slots=True)
class LocalReduce:
    """dst = op(dst, src), or op(src, dst) with src_first (see "Operand order" above)."""
    src: Chunk
    dst: Chunk
    src_first: bool = False

    def __post_init__(self):
        if self.src.count != self.dst.count:
            raise ValueError(f"reduce count mismatch {self}")


Step = Send | Recv | Copy | LocalReduce
LOCAL_STEPS = (Copy, LocalReduce)


@dataclass(slots=True)
class Schedule:
    """One rank's program for one collective."""
    algorithm: str
    rounds: list[tuple[Step, ...]] = field(default_factory=list)
    tmp_count: int = 0
    # whether some Send/Recv is marked lend=True (executors then plan lending for those steps)
    lends: bool = False
    # executors' precomputed frame plans, per (itemsize, frame size, lending) (executor.frame_plan)
    # and per (kind, dtype, group) (Group.execution): a schedule reused for many calls (cached per
    # argument set) is cut into frames once
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    def add(self, *steps: Step) -> "Schedule":
        if steps:
            self.rounds.append(tuple(steps))
            self.plans.clear()
            self.lends = self.lends or any(getattr(s, "lend", False) for s in steps)
        return self

    def extend(self, other: "Schedule") -> "Schedule":
        self.plans.clear()
        self.rounds.extend(other.rounds)
        self.tmp_count = max(self.tmp_count, other.tmp_count)
        self.lends = self.lends or other.lends
        return self

    def peers(self) -> set[int]:
        return {s.peer for r in self.rounds for s in r if isinstance(s, (Send, Recv))}


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of `parts` near-equal contiguous pieces of `count` elements; the first
    `count % parts` pieces are one longer. The same function on every rank, so pieces agree."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out
