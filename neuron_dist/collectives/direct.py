"""Tree and direct (mesh) schedules: rooted collectives, all-to-all, barrier, and the
one-round all-reduce / all-gather / reduce-scatter for latency-bound sizes.

Direct reductions combine contributions in group-rank order on every rank, so all ranks end
bit-identical, and at two ranks a sum equals Gloo's.
"""
from __future__ import annotations

from .schedule import IN, OUT, TMP, Chunk, Copy, LocalReduce, Recv, Schedule, Send


def _offsets(counts: list[int]) -> list[int]:
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def _binomial(rank: int, root: int, n: int) -> tuple[int | None, list[int]]:
    """(parent, children) of `rank` in the binomial tree rooted at `root`; children nearest
    the root's subtree split first, so the deepest subtree starts earliest."""
    rel = (rank - root) % n
    parent, mask = None, 1
    while mask < n:
        if rel & mask:
            parent = ((rel - mask) + root) % n
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            children.append(((rel + mask) + root) % n)
        mask >>= 1
    return parent, children


def tree_broadcast(rank: int, n: int, root: int, count: int) -> Schedule:
    """OUT is the tensor on every rank (the root's holds the data), sent down a binomial tree.
    Every other rank confirms to the root with an empty frame as it enters the call: a rank that
    wrongly believes it is the root (ranks disagreeing on `root`) would otherwise return its own
    data without ever receiving; with the confirmation it meets a data frame where it expects one
    and fails, naming both (and two ranks that each take the other for the root meet each
    other's confirmation instead of both waiting for data). Confirming on entry rather than once
    the data is in means the root, which waits for every confirmation, waits for its peers to
    arrive, not for each of them to be scheduled again after receiving."""
    parent, children = _binomial(rank, root, n)
    s = Schedule("tree")
    whole, empty = Chunk(OUT, 0, count), Chunk(OUT, 0, 0)
    if parent is None:
        s.add(*[Send(c, whole) for c in children])
        return s.add(*[Recv(r, empty) for r in range(n) if r != root])
    s.add(Send(root, empty), Recv(parent, whole))
    return s.add(*[Send(c, whole) for c in children])


def broadcast(rank: int, n: int, root: int, count: int) -> Schedule:
    """The root sends the whole tensor to every other rank itself: one hop where the tree takes
    ceil(log2 n), at the price of n-1 sends from the root, so for small tensors. Receivers
    confirm to the root as in `tree_broadcast`, for the same reason."""
    s = Schedule("direct")
    whole, empty = Chunk(OUT, 0, count), Chunk(OUT, 0, 0)
    if rank != root:
        return s.add(Send(root, empty), Recv(root, whole))
    s.add(*[Send((root + k) % n, whole) for k in range(1, n)])
    return s.add(*[Recv((root + k) % n, empty) for k in range(1, n)])


def _roll_call(rank: int, n: int) -> list:
    """An empty frame to the next rank in rank order and one taken from the previous: put in a
    rooted collective's first round (where the rank waits for nothing else) and sent before any
    other frame to that peer. Ranks that disagree on the root of a reduce or gather would
    otherwise wait on peers that never send (two ranks that both take themselves for the root)
    or return with their data read by no one (two that each take the other). Going round the
    ranks, some rank's predecessor holds another root, and its frame carries that root in its
    argument checksum, so that rank fails at once, naming both, and its abort reaches the others."""
    if n == 1:
        return []
    return [Send((rank + 1) % n, Chunk(IN, 0, 0)), Recv((rank - 1) % n, Chunk(OUT, 0, 0))]


def reduce(rank: int, n: int, root: int, count: int) -> Schedule:
    """IN is each rank's contribution (never written); OUT (the root's tensor) gets the result.
    Partial results accumulate in TMP along a binomial tree, after the roll call (`_roll_call`)."""
    parent, children = _binomial(rank, root, n)
    s = Schedule("tree", tmp_count=count)
    acc = Chunk(TMP, 0, count)
    s.add(Copy(Chunk(IN, 0, count), acc), *_roll_call(rank, n))
    for c in reversed(children):  # deepest subtree last: it finishes last
        s.add(Recv(c, acc, reduce=True))
    if parent is not None:
        s.add(Send(parent, acc))
    else:
        s.add(Copy(acc, Chunk(OUT, 0, count)))
    return s


def gather(rank: int, n: int, root: int, counts: list[int]) -> Schedule:
    """IN: counts[rank] elements; on the root OUT gets every rank's block in rank order, sent
    after the roll call (`_roll_call`)."""
    s = Schedule("direct").add(*_roll_call(rank, n))
    if rank != root:
        return s.add(Send(root, Chunk(IN, 0, counts[rank])))
    off = _offsets(counts)
    s.add(Copy(Chunk(IN, 0, counts[rank]), Chunk(OUT, off[rank], counts[rank])),
          *[Recv(r, Chunk(OUT, off[r], counts[r])) for r in range(n) if r != rank])
    return s


def scatter(rank: int, n: int, root: int, counts: list[int]) -> Schedule:
    """On the root IN holds every rank's block in rank order; OUT gets this rank's block. Each
    receiver confirms with an empty frame as it enters, for the same reasons as broadcast's."""
    s = Schedule("direct")
    empty = Chunk(OUT, 0, 0)
    if rank != root:
        return s.add(Send(root, empty), Recv(root, Chunk(OUT, 0, counts[rank])))
    off = _offsets(counts)  # (its own block copied while the receivers read theirs: late)
    s.add(Copy(Chunk(IN, off[rank], counts[rank]), Chunk(OUT, 0, counts[rank]), late=True),
          *[Send(r, Chunk(IN, off[r], counts[r])) for r in range(n) if r != rank])
    s.add(*[Recv(r, empty) for r in range(n) if r != rank])
    return s


def alltoall(rank: int, n: int, send_counts: list[int], recv_counts: list[int]) -> Schedule:
    """IN holds send_counts[j] elements for rank j, in rank order; OUT receives recv_counts[j]
    from rank j. Sends are staggered (rank+k) so no rank is everyone's first target."""
    if send_counts[rank] != recv_counts[rank]:  # raised at the op's start: the group fails, peers are told
        raise ValueError(f"all_to_all: rank {rank} sends itself {send_counts[rank]} elements but expects "
                         f"{recv_counts[rank]} from itself (its input and output split sizes at index "
                         f"{rank} must agree)")
    so, ro = _offsets(send_counts), _offsets(recv_counts)
    steps = [Copy(Chunk(IN, so[rank], send_counts[rank]), Chunk(OUT, ro[rank], recv_counts[rank]))]
    for k in range(1, n):
        to, frm = (rank + k) % n, (rank - k) % n
        steps += [Send(to, Chunk(IN, so[to], send_counts[to])),
                  Recv(frm, Chunk(OUT, ro[frm], recv_counts[frm]))]
    return Schedule("direct").add(*steps)


def send(peer: int, count: int) -> Schedule:
    """A point-to-point send of IN's `count` elements to `peer` (the executor cuts it into frames)."""
    return Schedule("p2p").add(Send(peer, Chunk(IN, 0, count)))


def recv(peer: int, count: int) -> Schedule:
    """A point-to-point receive of `count` elements from `peer` into OUT."""
    return Schedule("p2p").add(Recv(peer, Chunk(OUT, 0, count)))


def barrier(rank: int, n: int) -> Schedule:
    """Dissemination barrier: ceil(log2 n) rounds of empty messages."""
    s, k, empty = Schedule("dissemination"), 1, Chunk(OUT, 0, 0)
    while k < n:
        s.add(Send((rank + k) % n, empty), Recv((rank - k) % n, empty))
        k <<= 1
    return s


def allreduce(rank: int, n: int, count: int, eager_count: int = 0) -> Schedule:
    """One round: everyone sends its vector to everyone; each rank then reduces all n vectors
    in rank order. n-1 messages of the full size per rank: for latency-bound sizes only.

    Two ranks need no staging: each reduces the peer's vector into its own, rank 0's operand
    first on both (schedule.py, "Operand order"), so both compute the same op(x0, x1). When
    the vector fits what the transport takes without the peer receiving (`eager_count`
    elements: one frame), the send goes in a round of its own and the next round reduces the
    peer's frame straight into OUT (a round starts once the previous round's sends no longer
    read their buffers): no scratch buffer, no copy. A larger vector cannot wait a round for
    its receive (both ranks' sends would fill the other's buffers and stop), so it is received
    into scratch in the send's round and reduced after."""
    whole = Chunk(OUT, 0, count)
    if n == 1:
        return Schedule("direct")  # OUT already holds the result
    if n == 2:
        peer = 1 - rank
        if count <= eager_count:
            return (Schedule("direct").add(Send(peer, whole))
                    .add(Recv(peer, whole, reduce=True, incoming_first=rank == 1)))
        theirs = Chunk(TMP, 0, count)
        return (Schedule("direct", tmp_count=count)  # (received as a copy: lendable)
                .add(Send(peer, whole, lend=True), Recv(peer, theirs, lend=True))
                .add(LocalReduce(theirs, whole, src_first=rank == 1)))
    s = Schedule("direct", tmp_count=count * n)
    slot = lambda r: Chunk(TMP, r * count, count)
    s.add(Copy(whole, slot(rank)),
          *[Send(r, whole, lend=True) for r in range(n) if r != rank],
          *[Recv(r, slot(r), lend=True) for r in range(n) if r != rank])
    s.add(Copy(slot(0), whole), *[LocalReduce(slot(r), whole) for r in range(1, n)])
    return s


def allgather(rank: int, n: int, counts: list[int]) -> Schedule:
    off = _offsets(counts)
    mine = Chunk(IN, 0, counts[rank])
    return Schedule("direct").add(
        Copy(mine, Chunk(OUT, off[rank], counts[rank])),
        *[Send(r, mine) for r in range(n) if r != rank],
        *[Recv(r, Chunk(OUT, off[r], counts[r])) for r in range(n) if r != rank])


def reduce_scatter(rank: int, n: int, counts: list[int]) -> Schedule:
    """Each rank sends block j to rank j; each rank reduces the n blocks it holds in rank order.
    The blocks are received into scratch as copies, so they are marked lendable, as the direct
    all-reduce's vectors are: over shared memory with single-copy reads a large block is read
    from its sender's memory once instead of passing through a slot (worlds 2-4, 4-64 MiB, back
    to back: 0.77-1.00x the time, 0.77-0.92x at 64 MiB; benchmarks/RESULTS.md, "Thirty-first
    pass"). OUT may be this rank's block of IN (an in-place call, algorithms.OWN_BLOCK_OUT): rank
    0 reduces into OUT from its own block on; the others sum into the first block's slot and copy
    the sum out last, once their own block has been read (the same steps and operand order)."""
    off, c = _offsets(counts), counts[rank]
    s = Schedule("direct", tmp_count=c * n)
    slot = lambda r: Chunk(TMP, r * c, c)
    s.add(*[Send(r, Chunk(IN, off[r], counts[r]), lend=True) for r in range(n) if r != rank],
          *[Recv(r, slot(r), lend=True) for r in range(n) if r != rank])
    mine, out = Chunk(IN, off[rank], c), Chunk(OUT, 0, c)
    acc = out if rank == 0 else slot(0)
    steps = [Copy(mine, out)] if rank == 0 else []
    for r in range(1, n):
        steps.append(LocalReduce(mine if r == rank else slot(r), acc))
    if rank:
        steps.append(Copy(acc, out))
    return s.add(*steps)
