"""A send or receive that fits one copied frame skips the Execution (collectives/executor.py,
SingleFrameSend, SingleFrameRecv), and so does a collective whose plan moves one frame each way
with one peer (PairExchange: the small calls at two ranks). A send must put on the wire exactly
the frame an Execution of the send's schedule would, be chosen exactly when an Execution would
cut the message into one copied frame, and stall and finish as that Execution does (a full ring, memory the transport still refers to). A
receive must accept exactly the frames an Execution's receive accepts (shorter messages
included), deliver the same bytes, reject the rest naming the frame, and release every frame it
takes. The pair form must send the Execution's frames, leave the same buffers (the same bits on
both ranks of an all-reduce), run exactly for the plan shape it stands in for, and stall and
fail as the Execution does."""
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives import direct, rdh, reduce_ops, ring
from neuron_dist.collectives.executor import (Execution, Mailbox, PairExchange, SingleFrameRecv, SingleFrameSend, Stamp,
                                              execution_plan)
from neuron_dist.collectives.schedule import IN, OUT, Chunk, Recv, Schedule, Send
from neuron_dist.group import Group
from neuron_dist.transport.frame import FrameError, Kind

TOKEN, GROUP_ID, RANK, PEER, TAG = 0x5EC12E7, 77, 1, 3, 9
FRAME = 4096


class Recorder:
    """Takes every frame (copied, as the shared-memory ring does) or lends it, as asked."""

    def __init__(self, lend_bytes=0, eager_bytes=1 << 20, full=0, unflushed=0):
        self.frames, self.lent = [], []
        self.lend_bytes, self.eager_bytes, self.lend_from, self.lend_min = lend_bytes, eager_bytes, 1, 1
        self.lend_reduce_from = 1
        self.full, self.pending = full, unflushed  # refuse the next `full` sends; name the peer `pending` times

    def send(self, peer, header, payload):
        if self.full:
            self.full -= 1
            return False
        self.frames.append((peer, header, bytes(payload.contiguous().view(torch.uint8).numpy())))
        return True

    def lend(self, peer, header, payload):
        self.lent.append((peer, header))
        return len(self.lent)

    def released(self, peer, ticket):
        return True

    def unflushed(self):
        if self.pending:
            self.pending -= 1
            return PEER
        return None


def _group(transport):
    return SimpleNamespace(token=TOKEN, group_id=GROUP_ID, rank=RANK, frame_bytes=FRAME, transport=transport)


def _execution_frames(t, transport, src=RANK, dst=PEER, tag=TAG, token=TOKEN):
    """The frames an Execution sends for `t` from `src` to `dst`, as `transport` records them."""
    nbytes = t.numel() * t.element_size()
    exe = Execution(Schedule("p2p").add(Send(dst, Chunk(IN, 0, t.numel()))), [t, None, None], None,
                    Stamp(Kind.P2P, t.dtype, token, GROUP_ID, nbytes, tag), src, Mailbox(transport, src), FRAME)
    for _ in range(100):
        exe.progress()
        if exe.done:
            return transport.frames
    raise AssertionError("the Execution never finished")


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.complex128, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_frame_send_puts_the_executions_frame_on_the_wire(dtype):
    g = _group(Recorder())
    per = FRAME // torch.empty(0, dtype=dtype).element_size()
    for count in (1, 3, per - 1, per):
        t = (torch.arange(count) % 7).to(dtype)
        nbytes = count * t.element_size()
        assert Group.one_frame(g, count, t.element_size()), (dtype, count)
        want = _execution_frames(t, Recorder())
        sent = Recorder()
        one = SingleFrameSend(sent, PEER, Group.frame_header(g, dtype, PEER, nbytes, TAG), t)
        assert one.progress() and one.done and one.waiting_on is None
        assert sent.frames == want and len(want) == 1, (dtype, count, sent.frames, want)


@pytest.mark.parametrize("lend", [0, FRAME // 2])
@pytest.mark.parametrize("itemsize_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_one_frame_is_chosen_exactly_when_an_execution_sends_one_copied_frame(lend, itemsize_dtype):
    """At the frame's edge, and with lending on for messages past a small eager size."""
    es = torch.empty(0, dtype=itemsize_dtype).element_size()
    per = FRAME // es
    for count in (0, 1, 2, per // 4, per // 4 + 1, per - 1, per, per + 1, 3 * per):
        t = torch.zeros(count, dtype=itemsize_dtype)
        rec = Recorder(lend_bytes=lend, eager_bytes=FRAME // 4)
        _execution_frames(t, rec)
        one_copied = len(rec.frames) == 1 and not rec.lent
        assert Group.one_frame(_group(Recorder(lend_bytes=lend, eager_bytes=FRAME // 4)), count, es) == \
            (one_copied and count > 0), (count, es, lend, len(rec.frames), len(rec.lent))


def test_a_one_frame_send_stalls_and_finishes_as_the_execution_does():
    """Pass by pass, the same answers as an Execution of the send: "moved" only on the pass that
    hands the frame over. A pass that finds the transport still reading said "moved" too, and
    the engine, never seeing a stall, spun without a time-out or peer check until the peer took
    the frame (a 256 KiB send over MPI to a rank 12 s late in a 3 s group)."""
    t = torch.arange(10, dtype=torch.float32)
    g = _group(None)

    def passes(exe):
        seen = []
        while not exe.done and len(seen) < 10:
            moved = exe.progress()  # (a finishing pass counts as moved for the engine, whatever it says)
            seen.append((moved or exe.done, exe.done, exe.waiting_on, list(exe.sends)))
        return seen

    rec = Recorder(full=2, unflushed=3)
    one = passes(SingleFrameSend(rec, PEER, Group.frame_header(g, t.dtype, PEER, 40, TAG), t))
    exe = passes(Execution(Schedule("p2p").add(Send(PEER, Chunk(IN, 0, 10))), [t, None, None], None,
                           Stamp(Kind.P2P, t.dtype, TOKEN, GROUP_ID, 40, TAG), RANK,
                           Mailbox(Recorder(full=2, unflushed=3), RANK), FRAME))
    assert one == exe, (one, exe)
    assert one == [(False, False, None, [PEER])] * 2 + [  # a full ring: the peer still owed its frame
        (True, False, PEER, [])] + [  # sent; the transport still refers to the tensor: wait on that peer
        (False, False, PEER, [])] * 2 + [  # still: no progress, so the engine's stall check runs
        (True, True, None, [])], one
    assert len(rec.frames) == 1


# -- receives -------------------------------------------------------------------------------------
class Inbox:
    """Hands out each peer's frames in order, the first one again until it is released (as the
    shared-memory ring does); counts what is still unreleased."""

    def __init__(self, frames):  # [(peer, header, payload bytes)]
        self.q: dict[int, deque] = {}
        for peer, h, b in frames:
            self.q.setdefault(peer, deque()).append((h, torch.frombuffer(bytearray(b), dtype=torch.uint8)
                                                     if b else torch.empty(0, dtype=torch.uint8)))

    def recv(self, peer):
        q = self.q.get(peer)
        return q[0] if q else None

    def release(self, peer):
        self.q[peer].popleft()

    def pending(self) -> int:
        return sum(len(q) for q in self.q.values())


def _message(t, src=PEER, dst=RANK, tag=TAG, token=TOKEN):
    """The frames an Execution sends for `t` from `src` to `dst`, as an Inbox takes them."""
    return [(src, h, b) for _, h, b in _execution_frames(t, Recorder(), src, dst, tag, token)]


def _one_frame_recv(frames, out, peers=(PEER,), tag=TAG):
    g = _group(None)
    inbox = Inbox(frames)
    nbytes = out.numel() * out.element_size()
    sources = tuple((p, Group.frame_header(g, out.dtype, p, nbytes, tag, incoming=True)) for p in peers)
    one = SingleFrameRecv(Mailbox(inbox, RANK), sources, tag, out, out.dtype)
    return one, inbox


def _execution_recv(frames, out):
    inbox = Inbox(frames)
    nbytes = out.numel() * out.element_size()
    exe = Execution(Schedule("p2p").add(Recv(PEER, Chunk(OUT, 0, out.numel()))), [None, out, None], None,
                    Stamp(Kind.P2P, out.dtype, TOKEN, GROUP_ID, nbytes, TAG), RANK, Mailbox(inbox, RANK), FRAME)
    exe.progress()
    return exe, inbox


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_frame_receive_delivers_what_an_execution_does_and_shorter_messages_to_the_front(dtype):
    per = FRAME // torch.empty(0, dtype=dtype).element_size()
    for count in (1, 3, per - 1, per):
        for m in sorted({count, count // 2, 1, 0}):
            msg = ((torch.arange(m) * 5 + 1) % 7).to(dtype)
            fill = torch.full((count,), 1, dtype=dtype) if dtype is torch.bool else torch.full((count,), 9).to(dtype)
            out = fill.clone()
            one, inbox = _one_frame_recv(_message(msg), out)
            assert one.progress() and one.done and one.peer == PEER and one.nbytes == m * msg.element_size()
            assert torch.equal(out[:m], msg) and torch.equal(out[m:], fill[m:]), (dtype, count, m)
            assert inbox.pending() == 0
            if m == count:  # the Execution's receive of the same frames: the same bytes
                ref = fill.clone()
                exe, _ = _execution_recv(_message(msg), ref)
                assert exe.done and torch.equal(ref, out)


def test_a_one_frame_receive_rejects_what_an_execution_rejects_and_releases_the_frame():
    out = torch.zeros(8, dtype=torch.float32)
    bad = {
        "longer": _message(torch.ones(9)),
        "another dtype, same bytes": _message(torch.ones(8, dtype=torch.int32)),
        "another dtype, shorter": _message(torch.ones(4, dtype=torch.int32)),
        "part of an element": _message(torch.ones(6, dtype=torch.uint8)),
        "another job's token": _message(torch.ones(8), token=TOKEN + 1),
        "addressed to another rank": _message(torch.ones(8), dst=RANK + 1),
    }
    for what, frames in bad.items():
        one, inbox = _one_frame_recv(frames, out.clone())
        with pytest.raises(FrameError) as e1:
            one.progress()
        assert inbox.pending() == 0 and not one.done, what
        with pytest.raises(FrameError) as e2:
            _execution_recv(frames, out.clone())
        assert str(e1.value) == str(e2.value), (what, str(e1.value), str(e2.value))


def test_a_one_frame_receive_waits_for_its_tag_and_takes_from_the_first_source_with_a_frame():
    out = torch.zeros(4)
    # nothing yet: no progress; a known peer is the one waited on (the stall check reads it)
    one, _ = _one_frame_recv([], out)
    assert not one.progress() and not one.done and one.waiting_on == PEER
    # another tag's message first: kept aside for its own receive, ours taken after it
    frames = _message(torch.full((4,), 2.0), tag=TAG + 1) + _message(torch.full((4,), 3.0))
    one, inbox = _one_frame_recv(frames, out)
    assert one.progress() and one.done and out.tolist() == [3.0] * 4 and inbox.pending() == 0
    # any source: the first peer in order with a frame for the tag; the others are left alone
    peers = (0, 2, PEER)
    frames = _message(torch.full((4,), 5.0), src=2, tag=TAG + 1) + _message(torch.full((4,), 6.0), src=PEER) \
        + _message(torch.full((4,), 7.0), src=0, tag=TAG + 2)
    one, inbox = _one_frame_recv(frames, out, peers=peers)
    assert one.progress() and one.done and one.peer == PEER and out.tolist() == [6.0] * 4
    one, _ = _one_frame_recv([], out, peers=peers)
    assert not one.progress() and one.waiting_on is None


# -- one frame each way with one peer (PairExchange) ----------------------------------------------
class Duplex(Recorder):
    """A Recorder that also hands out the frames queued for it, as an Inbox does."""

    def __init__(self, frames=(), **kw):
        super().__init__(**kw)
        self.inbox = Inbox(list(frames))
        self.recv, self.release, self.pending_frames = self.inbox.recv, self.inbox.release, self.inbox.pending


def _allreduce_stamp(dtype, seq=5, tag=TAG, token=TOKEN):
    return Stamp(Kind.ALLREDUCE, dtype, token, GROUP_ID, seq, tag)


def _pair_exe(sched, bufs, red, stamp, r, transport):
    """PairExchange for `sched`'s frame plan where it has the pair shape, else the Execution
    (as Group.execution chooses)."""
    plan = execution_plan(sched, stamp, transport, FRAME)
    if plan.pair is None:
        return _plain_exe(sched, bufs, red, stamp, r, transport)
    return PairExchange(plan.pair, bufs, red, stamp, r, Mailbox(transport, r))


def _plain_exe(sched, bufs, red, stamp, r, transport):
    return Execution(sched, bufs, red, stamp, r, Mailbox(transport, r), FRAME)


def _execution_exe(op_name, dtype):
    red = reduce_ops.reducer(op_name, dtype)

    def make(r, out, transport):
        return _plain_exe(direct.allreduce(r, 2, out.numel(), FRAME // out.element_size()), [out, out, None], red,
                          _allreduce_stamp(dtype), r, transport)
    return make


def _both_ranks(make, scheds, bufs, red, stamp):
    """Both ranks of a two-rank collective run by the executions `make` builds: (each rank's
    buffers after it, each rank's sent frames). Each rank's sends come first (collected from a
    run on copies of its buffers), then each rank runs to the end on the peer's frames."""
    sent = []
    for r in (0, 1):
        t = Duplex()
        make(scheds[r], [None if b is None else b.clone() for b in bufs[r]], red, stamp, r, t).progress()
        sent.append([(1 - r, h, b) for _, h, b in t.frames])
    outs = []
    for r in (0, 1):
        t = Duplex([(1 - r, h, b) for _, h, b in sent[1 - r]])
        mine = [None if b is None else b.clone() for b in bufs[r]]
        exe = make(scheds[r], mine, red, stamp, r, t)
        for _ in range(10):
            exe.progress()
            if exe.done:
                break
        assert exe.done and t.pending_frames() == 0 and [f[1:] for f in t.frames] == [f[1:] for f in sent[r]]
        outs.append(mine)
    return outs, sent


def _bits(t):
    return t.view(torch.uint8) if t is not None and t.numel() else t


def _same_as_the_execution(scheds, bufs, red, stamp):
    got, frames = _both_ranks(_pair_exe, scheds, bufs, red, stamp)
    want, want_frames = _both_ranks(_plain_exe, scheds, bufs, red, stamp)
    assert frames == want_frames
    for r in (0, 1):
        for g_, w_ in zip(got[r], want[r]):
            assert (g_ is None and w_ is None) or torch.equal(_bits(g_), _bits(w_)), r
    return got


def _pair_allreduce_exe(op_name, dtype):
    red = reduce_ops.reducer(op_name, dtype)

    def make(r, out, transport):
        sched = direct.allreduce(r, 2, out.numel(), FRAME // out.element_size())
        exe = _pair_exe(sched, [out, out, None], red, _allreduce_stamp(dtype), r, transport)
        assert type(exe) is PairExchange
        return exe
    return make


@pytest.mark.parametrize("op_name,dtype", [("sum", torch.float32), ("max", torch.float32), ("sum", torch.bfloat16),
                                           ("product", torch.float64), ("bxor", torch.int64), ("min", torch.int8),
                                           ("sum", torch.complex64)])
def test_the_pair_all_reduce_sends_and_computes_what_the_execution_does(op_name, dtype):
    """The same frames on the wire and the same bits on both ranks, with operands whose order
    shows in the bits (max of +0.0 and -0.0; NaNs of either sign added)."""
    per = FRAME // torch.empty(0, dtype=dtype).element_size()
    red = reduce_ops.reducer(op_name, dtype)
    for count in (0, 1, 7, per):
        g = torch.Generator().manual_seed(count)
        if dtype.is_floating_point:
            xs = [torch.randn(count, generator=g).to(dtype) for _ in range(2)]
            if count >= 7:
                xs[0][:4] = torch.tensor([0.0, -0.0, float("nan"), -float("nan")])
                xs[1][:4] = torch.tensor([-0.0, 0.0, -float("nan"), float("nan")])
        elif dtype.is_complex:
            xs = [torch.randn(count, generator=g, dtype=dtype) for _ in range(2)]
        else:
            xs = [torch.randint(-50, 50, (count,), generator=g).to(dtype) for _ in range(2)]
        scheds = [direct.allreduce(r, 2, count, per) for r in (0, 1)]
        bufs = [[x, x, None] for x in xs]  # in place, as dist.all_reduce calls it
        assert all(execution_plan(scheds[r], _allreduce_stamp(dtype), Recorder(), FRAME).pair for r in (0, 1))
        got = _same_as_the_execution(scheds, bufs, red, _allreduce_stamp(dtype))
        assert torch.equal(_bits(got[0][1]), _bits(got[1][1])), (op_name, dtype, count)


def _two_rank_cases(per):
    """(name, kind, schedules of ranks 0 and 1, their [IN, OUT] sizes, the ranks whose plan has
    the pair shape) of the two-rank calls within a frame."""
    c = per // 2
    return [
        ("allgather", Kind.ALLGATHER, [ring.allgather([0, 1], r, [c, c]) for r in (0, 1)], (c, 2 * c), (0, 1)),
        ("reduce_scatter", Kind.REDUCE_SCATTER, [ring.reduce_scatter([0, 1], r, [c, c]) for r in (0, 1)], (2 * c, c),
         (0, 1)),
        ("alltoall", Kind.ALLTOALL, [direct.alltoall(r, 2, [c, c], [c, c]) for r in (0, 1)], (2 * c, 2 * c), (0, 1)),
        ("broadcast", Kind.BROADCAST, [direct.broadcast(r, 2, 1, per) for r in (0, 1)], (0, per), (0, 1)),
        ("barrier", Kind.BARRIER, [direct.barrier(r, 2) for r in (0, 1)], (0, 0), (0, 1)),
        ("scatter", Kind.SCATTER, [direct.scatter(r, 2, 0, [c, c]) for r in (0, 1)], (2 * c, c), (1,)),
        ("reduce", Kind.REDUCE, [direct.reduce(r, 2, 0, per) for r in (0, 1)], (per, per), ()),  # scratch
        ("gather", Kind.GATHER, [direct.gather(r, 2, 1, [c, c]) for r in (0, 1)], (c, 2 * c), ()),  # three rounds
    ]


@pytest.mark.parametrize("dtype,op_name", [(torch.float32, "sum"), (torch.bfloat16, "max"), (torch.int64, "bxor")])
def test_the_pair_form_moves_and_computes_what_the_execution_does_for_every_two_rank_call(dtype, op_name):
    """All-gather, reduce-scatter (in place too), all-to-all, broadcast, scatter (whose root
    keeps the Execution) and barrier at two ranks: the same frames, the same buffers afterwards."""
    per = FRAME // torch.empty(0, dtype=dtype).element_size()
    red = reduce_ops.reducer(op_name, dtype)
    for name, kind, scheds, (n_in, n_out), pair_ranks in _two_rank_cases(per):
        if not pair_ranks:
            continue
        stamp = Stamp(kind, dtype, TOKEN, GROUP_ID, 11, TAG)
        bufs = []
        for r in (0, 1):
            x = (torch.arange(n_in) * (r + 3) % 113).to(dtype) if n_in else None
            out = torch.full((n_out,), -1).to(dtype)
            bufs.append([x, out, None])
        got = _same_as_the_execution(scheds, bufs, red, stamp)
        if name == "allgather":
            assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][1][:per // 2], bufs[0][0])
        if name == "reduce_scatter":  # the in-place form: each rank's input is the output's whole
            ip = [[b[0], b[0][r * (per // 2):(r + 1) * (per // 2)], None] for r, b in enumerate(bufs)]
            _same_as_the_execution(scheds, ip, red, stamp)


def test_the_pair_shape_is_recognised_exactly():
    """By the frames a plan moves, whoever built the schedule: one frame each way with one peer
    in one round (local steps before), or a send round and then a receive round, either frame
    copied or lent; not two frames of a step, a lent frame its receiver reduces, scratch, a
    second peer or a third round."""
    def shape(sched, kind=Kind.ALLREDUCE, isz=4, transport=None):
        stamp = Stamp(kind, {4: torch.float32, 2: torch.bfloat16, 8: torch.int64}[isz], TOKEN, GROUP_ID, 3, TAG)
        return execution_plan(sched, stamp, transport or Recorder(), FRAME).pair
    for isz in (4, 2, 8):
        per = FRAME // isz
        for count in (0, 1, per - 1, per, per + 1, 3 * per):
            for r in (0, 1):
                got = shape(direct.allreduce(r, 2, count, per), isz=isz)
                if count <= per:
                    assert got is not None and got.split and got.peer == 1 - r, (isz, count, r)
                    assert got.send == (OUT, 0, count, count * isz) and got.recv.reduce and \
                        got.recv.incoming_first == (r == 1) and not got.local
                else:
                    assert got is None, (isz, count, r)
                # a larger frame's eager schedule over this group's frames: a step of two frames
                big = shape(direct.allreduce(r, 2, count, 4 * per), isz=isz)
                assert (big is not None) == (count <= per), (isz, count, r)
    for name, kind, scheds, _, pair_ranks in _two_rank_cases(FRAME // 4):
        for r in (0, 1):
            got = shape(scheds[r], kind)
            assert (got is not None) == (r in pair_ranks) and (got is None or got.peer == 1 - r), (name, r)
    assert shape(ring.allreduce([0, 1], 0, 8)) is None  # two rounds each way
    assert shape(rdh.rdh_allreduce(0, [0, 1], 8)) is None  # scratch
    assert shape(direct.allreduce(0, 3, 8, FRAME // 4)) is None  # two peers
    assert shape(ring.allgather([0, 1, 2, 3], 1, [4] * 4), Kind.ALLGATHER) is None  # three rounds
    assert shape(direct.barrier(0, 4), Kind.BARRIER) is None  # a peer per round
    assert shape(direct.broadcast(0, 4, 0, 8), Kind.BROADCAST) is None  # the root of four
    assert shape(direct.broadcast(2, 4, 0, 8), Kind.BROADCAST) is not None  # a non-root of four
    # a step the transport lends (all-gather's from its lending size; all-reduce's where marked)
    lender = Recorder(lend_bytes=FRAME, eager_bytes=FRAME)
    lender.lend_from = lender.lend_min = lender.lend_reduce_from = 64
    got = shape(ring.allgather([0, 1], 0, [32, 32]), Kind.ALLGATHER, transport=lender)
    assert got is not None and got.lent and got.send == (IN, 0, 32, 128)  # one lent frame each way
    got = shape(ring.allgather([0, 1], 0, [8, 8]), Kind.ALLGATHER, transport=lender)
    assert got is not None and not got.lent  # below the lending size: copied
    lender.lend_bytes = 64  # a step of two lent frames
    assert shape(ring.allgather([0, 1], 0, [32, 32]), Kind.ALLGATHER, transport=lender) is None
    lender.lend_bytes = FRAME
    whole = Chunk(OUT, 0, 32)
    lent = Schedule("x").add(Send(1, whole, lend=True)).add(Recv(1, whole, reduce=True, lend=True))
    assert shape(lent, transport=lender) is None and shape(lent) is not None
    # another peer for the receive, and a receive round before the send's
    assert shape(Schedule("x").add(Send(1, whole), Recv(2, whole))) is None
    assert shape(Schedule("x").add(Recv(1, whole)).add(Send(1, whole))) is None


def test_group_execution_runs_the_pair_form_exactly_for_plans_of_that_shape():
    g = SimpleNamespace(token=TOKEN, group_id=GROUP_ID, frame_bytes=FRAME, mailbox=Mailbox(Duplex(), 0),
                        _deaths=SimpleNamespace(check=lambda group, op: None), _plan_key=0)
    red = reduce_ops.reducer("sum", torch.float32)
    for size, rank, kind, count, want in ((2, 0, Kind.ALLREDUCE, 8, PairExchange),
                                          (2, 1, Kind.ALLREDUCE, 8, PairExchange),
                                          (2, 0, Kind.REDUCE, 8, PairExchange), (3, 0, Kind.ALLREDUCE, 8, Execution),
                                          (2, 0, Kind.ALLREDUCE, 2 * FRAME, Execution),
                                          (2, 0, Kind.P2P, 8, Execution)):
        g.size, g.rank = size, rank
        out = torch.ones(count)
        op = SimpleNamespace(kind=kind, nbytes=4 * count, seq=3, algorithm="direct")
        sched = direct.allreduce(rank, size, count, FRAME // 4)
        exe = Group.execution(g, op, sched, [out, out, torch.empty(3 * count)], red, torch.float32, TAG)
        assert type(exe) is want, (size, rank, kind, count)


def test_a_one_round_pair_takes_its_frame_while_its_send_waits_then_waits_for_the_flush():
    """As the Execution: a send the ring refuses does not keep the round's receive waiting; the
    round ends once the send is out and the transport no longer refers to it."""
    c = 8
    scheds = [ring.allgather([0, 1], r, [c, c]) for r in (0, 1)]
    stamp = Stamp(Kind.ALLGATHER, torch.float32, TOKEN, GROUP_ID, 11, TAG)
    src = Duplex()
    _plain_exe(scheds[1], [torch.arange(c, dtype=torch.float32) + 100, torch.zeros(2 * c), None], None, stamp, 1,
               src).progress()
    t = Duplex([(1, h, b) for _, h, b in src.frames], full=2, unflushed=1)
    out = torch.zeros(2 * c)
    exe = _pair_exe(scheds[0], [torch.arange(c, dtype=torch.float32), out, None], None, stamp, 0, t)
    assert exe.progress() and not exe.done and list(exe.sends) == [1]  # its frame taken, its own refused
    assert out[c:].tolist() == [100.0 + i for i in range(c)] and t.pending_frames() == 0
    assert not exe.progress() and not exe.done and list(exe.sends) == [1]  # refused again: nothing moved
    assert exe.progress() and not exe.done and exe.waiting_on == PEER and not exe.sends  # sent, unflushed
    assert exe.progress() and exe.done and exe.waiting_on is None and len(t.frames) == 1


class Lender(Recorder):
    """A transport that lends as the shared-memory one does from `lend_from` bytes: it records
    each lent payload (as the pointer the peer would read), holds every ticket unreleased for
    `hold` looks, and hands out `incoming` (peer, header, tensor) frames as lent frames the
    receiver reads from this very process (cma.Lent over the tensor's memory)."""

    def __init__(self, incoming=(), hold=0, lend_from=64):
        super().__init__(lend_bytes=1 << 20, eager_bytes=FRAME)
        self.lend_from = self.lend_min = self.lend_reduce_from = lend_from
        self.hold, self.looks, self.lent_payloads, self.released_frames = hold, 0, [], 0
        self.incoming = {p: deque([(h, t)]) for p, h, t in incoming}

    def lend(self, peer, header, payload):
        self.lent_payloads.append(payload)
        return super().lend(peer, header, payload)

    def released(self, peer, ticket):
        self.looks += 1
        return self.looks > self.hold

    def recv(self, peer):
        import os
        from neuron_dist.transport.cma import Lent
        q = self.incoming.get(peer)
        if not q:
            return None
        h, t = q[0]
        return h, Lent(os.getpid(), t.data_ptr(), t.nbytes, t.dtype, peer)

    def release(self, peer):
        self.incoming[peer].popleft()
        self.released_frames += 1


def test_a_lent_pair_lends_reads_into_place_and_waits_for_the_release():
    """A two-rank all-gather whose blocks the transport lends runs as the pair form too: it lends
    the frame the Execution lends (same header, the caller's own memory), reads the peer's lent
    frame straight into the output, releases it, and is done only once the peer has released
    what it lent, as the Execution's next round waits for it."""
    c = 32
    stamp = Stamp(Kind.ALLGATHER, torch.float32, TOKEN, GROUP_ID, 11, TAG)
    scheds = [ring.allgather([0, 1], r, [c, c]) for r in (0, 1)]
    plan = execution_plan(scheds[0], stamp, Lender(), FRAME)
    assert plan.lends and plan.pair is not None and plan.pair.lent and plan.pair.peer == 1
    assert not execution_plan(scheds[0], stamp, Lender(lend_from=4 * c + 4), FRAME).pair.lent  # below: copied
    want_lent = Lender()
    _plain_exe(scheds[0], [torch.arange(c, dtype=torch.float32), torch.zeros(2 * c), None], None, stamp, 0,
               want_lent).progress()
    peer_block = torch.arange(c, dtype=torch.float32) + 100
    t = Lender([(1, stamp.header(1, 0, 0, 4 * c), peer_block)], hold=2)
    mine, out = torch.arange(c, dtype=torch.float32), torch.zeros(2 * c)
    exe = _pair_exe(scheds[0], [mine, out, None], None, stamp, 0, t)
    assert type(exe) is PairExchange
    assert exe.progress() and not exe.done and exe.waiting_on == 1  # lent and read; its own still lent
    assert t.lent == want_lent.lent and t.lent_payloads[0].data_ptr() == mine.data_ptr()
    assert torch.equal(out, torch.cat([mine, peer_block])) and t.released_frames == 1 and not t.frames
    assert not exe.progress() and not exe.done and exe.waiting_on == 1
    assert exe.progress() and exe.done and exe.waiting_on is None
    # a round whose receive writes where its lent send reads (an in-place call): a copy is lent
    whole = Chunk(OUT, 0, c)
    sched = Schedule("x").add(Send(1, whole), Recv(1, whole))
    buf = torch.arange(c, dtype=torch.float32)
    t = Lender([(1, stamp.header(1, 0, 0, 4 * c), peer_block)])
    exe = _pair_exe(sched, [None, buf, None], None, stamp, 0, t)
    assert type(exe) is PairExchange and exe.progress() and exe.done
    assert t.lent_payloads[0].data_ptr() != buf.data_ptr() and t.lent_payloads[0].tolist() == list(range(c))
    assert torch.equal(buf, peer_block)
    # a split pair (the broadcast's root): its receive round waits for the lent frame's release
    sched = direct.broadcast(0, 2, 0, c)
    t = Lender([(1, Stamp(Kind.BROADCAST, torch.float32, TOKEN, GROUP_ID, 11, TAG).header(1, 0, 0, 0),
                 torch.empty(0))], hold=1)
    bstamp = Stamp(Kind.BROADCAST, torch.float32, TOKEN, GROUP_ID, 11, TAG)
    exe = _pair_exe(sched, [None, buf, None], None, bstamp, 0, t)
    assert type(exe) is PairExchange and exe.progress() and not exe.done and exe.waiting_on == 1
    assert t.released_frames == 0  # the confirmation not taken before the release
    assert exe.progress() and exe.done and t.released_frames == 1


def test_the_pair_all_reduce_stalls_fails_and_releases_as_the_execution_does():
    x = torch.arange(8, dtype=torch.float32)
    make = _pair_allreduce_exe("sum", torch.float32)
    t = Duplex(full=2, unflushed=2)
    exe = make(RANK % 2, x.clone(), t)
    for _ in range(2):  # a full ring: nothing moved, the peer still owed its frame
        assert not exe.progress() and not exe.done and list(exe.sends) == [1 - RANK % 2]
    for moved in (True, False):  # sent, but the transport still refers to the vector: wait on the peer it names
        assert exe.progress() is moved and not exe.done and exe.waiting_on == PEER and not exe.sends
    assert not exe.progress() and not exe.done and exe.waiting_on == 1 - RANK % 2  # nothing from the peer yet
    # a frame of other arguments (another op's checksum, a longer vector): the Execution's error, frame released
    r = RANK % 2
    for what, frames in (("tag", (TAG + 1, x)), ("size", (TAG, torch.arange(9.0)))):
        tag, v = frames
        peer_frames = []
        src = Duplex()
        Execution(direct.allreduce(1 - r, 2, v.numel(), FRAME // 4), [v.clone(), v.clone(), None],
                  reduce_ops.reducer("sum", torch.float32), _allreduce_stamp(torch.float32, tag=tag), 1 - r,
                  Mailbox(src, 1 - r), FRAME).progress()
        peer_frames = [(1 - r, h, b) for _, h, b in src.frames]
        errors = []
        for exe_for in (make, _execution_exe("sum", torch.float32)):
            t = Duplex(peer_frames)
            exe = exe_for(r, x.clone(), t)
            with pytest.raises(FrameError) as e:
                for _ in range(5):
                    exe.progress()
            assert t.pending_frames() == 0 and not exe.done, what
            errors.append(str(e.value))
        assert errors[0] == errors[1], (what, errors)
