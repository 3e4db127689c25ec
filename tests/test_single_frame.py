"""A send or receive that fits one copied frame skips the Execution (collectives/executor.py,
SingleFrameSend, SingleFrameRecv), and so does the two-rank all-reduce of one frame
(PairReduce). A send must put on the wire exactly the frame an Execution of the send's schedule
would, be chosen exactly when an Execution would cut the message into one copied frame, and
stall and finish as that Execution does (a full ring, memory the transport still refers to). A
receive must accept exactly the frames an Execution's receive accepts (shorter messages
included), deliver the same bytes, reject the rest naming the frame, and release every frame it
takes. The all-reduce must send the Execution's frame, compute the same bits on both ranks, run
exactly for the schedule shape it stands in for, and stall and fail as the Execution does."""
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives import direct, rdh, reduce_ops, ring
from neuron_dist.collectives.executor import (Execution, Mailbox, PairReduce, SingleFrameRecv, SingleFrameSend, Stamp,
                                              pair_exchange)
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
    t = torch.arange(10, dtype=torch.float32)
    g = _group(None)
    rec = Recorder(full=2, unflushed=2)
    one = SingleFrameSend(rec, PEER, Group.frame_header(g, t.dtype, PEER, 40, TAG), t)
    for _ in range(2):  # a full ring: nothing moved, the peer still owed its frame (the stall check reads it)
        assert not one.progress() and not one.done and list(one.sends) == [PEER]
    for _ in range(2):  # sent, but the transport still refers to the tensor: wait on that peer
        assert one.progress() and not one.done and one.waiting_on == PEER and not one.sends
    assert one.progress() and one.done and one.waiting_on is None and len(rec.frames) == 1


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


# -- the two-rank all-reduce of one frame (PairReduce) --------------------------------------------
class Duplex(Recorder):
    """A Recorder that also hands out the frames queued for it, as an Inbox does."""

    def __init__(self, frames=(), **kw):
        super().__init__(**kw)
        self.inbox = Inbox(list(frames))
        self.recv, self.release, self.pending_frames = self.inbox.recv, self.inbox.release, self.inbox.pending


def _allreduce_stamp(dtype, seq=5, tag=TAG, token=TOKEN):
    return Stamp(Kind.ALLREDUCE, dtype, token, GROUP_ID, seq, tag)


def _pair_run(exe_for, xs, dtype):
    """Both ranks' vectors all-reduced by the executions `exe_for(rank, out, transport)` builds:
    (each rank's output, each rank's sent frames). Rank r's frames go to rank 1 - r."""
    outs, sent = [x.clone() for x in xs], []
    for r in (0, 1):  # each rank's send first (its first progress), collected
        t = Duplex()
        exe_for(r, outs[r].clone(), t).progress()
        sent.append([(1 - r, h, b) for _, h, b in t.frames])
    for r in (0, 1):
        t = Duplex([(1 - r, h, b) for _, h, b in sent[1 - r]])
        exe = exe_for(r, outs[r], t)
        for _ in range(10):
            exe.progress()
            if exe.done:
                break
        assert exe.done and t.pending_frames() == 0 and [f[1:] for f in t.frames] == [f[1:] for f in sent[r]]
    return outs, sent


def _pair_reduce_exe(op_name, dtype):
    red = reduce_ops.reducer(op_name, dtype)

    def make(r, out, transport):
        first = pair_exchange(direct.allreduce(r, 2, out.numel(), FRAME // out.element_size()), out.numel(),
                              out.element_size(), FRAME)
        assert first == (1 - r, r == 1)
        return PairReduce(Mailbox(transport, r), _allreduce_stamp(dtype), r, 1 - r, out, red, first[1])
    return make


def _execution_exe(op_name, dtype):
    red = reduce_ops.reducer(op_name, dtype)

    def make(r, out, transport):
        sched = direct.allreduce(r, 2, out.numel(), FRAME // out.element_size())
        return Execution(sched, [out, out, None], red, _allreduce_stamp(dtype), r, Mailbox(transport, r), FRAME)
    return make


@pytest.mark.parametrize("op_name,dtype", [("sum", torch.float32), ("max", torch.float32), ("sum", torch.bfloat16),
                                           ("product", torch.float64), ("bxor", torch.int64), ("min", torch.int8),
                                           ("sum", torch.complex64)])
def test_the_pair_all_reduce_sends_and_computes_what_the_execution_does(op_name, dtype):
    """The same frames on the wire and the same bits on both ranks, with operands whose order
    shows in the bits (max of +0.0 and -0.0; NaNs of either sign added)."""
    per = FRAME // torch.empty(0, dtype=dtype).element_size()
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
        got, frames = _pair_run(_pair_reduce_exe(op_name, dtype), xs, dtype)
        want, want_frames = _pair_run(_execution_exe(op_name, dtype), xs, dtype)
        assert frames == want_frames, (op_name, dtype, count)
        for r in (0, 1):
            b = lambda t: t.view(torch.uint8) if t.numel() else t  # noqa: E731 - bitwise, NaN payloads included
            assert torch.equal(b(got[r]), b(want[r])), (op_name, dtype, count, r)
        assert torch.equal(b(got[0]), b(got[1]))


def test_the_pair_all_reduce_shape_is_recognised_exactly():
    """Recognised by shape: direct's two-rank schedule of a vector within one frame, on both
    ranks; not its scratch form past the frame, nor any other algorithm or world."""
    for isz, dtype in ((4, torch.float32), (2, torch.bfloat16), (8, torch.int64)):
        per = FRAME // isz
        for count in (0, 1, per - 1, per, per + 1, 3 * per):
            for r in (0, 1):
                s = direct.allreduce(r, 2, count, per)
                want = (1 - r, r == 1) if count <= per else None
                assert pair_exchange(s, count, isz, FRAME) == want, (isz, count, r)
                # a larger frame's eager schedule, run over a group of smaller frames: two frames
                assert pair_exchange(direct.allreduce(r, 2, count, 4 * per), count, isz, FRAME) == want
        assert pair_exchange(ring.allreduce([0, 1], 0, 8), 8, 4, FRAME) is None
        assert pair_exchange(rdh.rdh_allreduce(0, [0, 1], 8), 8, 4, FRAME) is None
        assert pair_exchange(direct.allreduce(0, 3, 8, per), 8, 4, FRAME) is None
    # marks that change how frames are cut: lent or reduced-on-receipt sends are not this shape
    whole = Chunk(OUT, 0, 8)
    lent = Schedule("x").add(Send(1, whole, lend=True)).add(Recv(1, whole, reduce=True, lend=True))
    copied = Schedule("x").add(Send(1, whole)).add(Recv(1, whole))
    part = Schedule("x").add(Send(1, Chunk(OUT, 0, 4))).add(Recv(1, Chunk(OUT, 0, 4), reduce=True))
    assert [pair_exchange(s, 8, 4, FRAME) for s in (lent, copied, part)] == [None, None, None]


def test_group_execution_runs_the_pair_form_exactly_for_a_two_rank_all_reduce_of_that_shape():
    g = SimpleNamespace(token=TOKEN, group_id=GROUP_ID, frame_bytes=FRAME, mailbox=Mailbox(Duplex(), 0),
                        _deaths=SimpleNamespace(check=lambda group, op: None))
    red = reduce_ops.reducer("sum", torch.float32)
    for size, rank, kind, count, want in ((2, 0, Kind.ALLREDUCE, 8, PairReduce), (2, 1, Kind.ALLREDUCE, 8, PairReduce),
                                          (2, 0, Kind.REDUCE, 8, Execution), (3, 0, Kind.ALLREDUCE, 8, Execution),
                                          (2, 0, Kind.ALLREDUCE, 2 * FRAME, Execution)):
        g.size, g.rank = size, rank
        out = torch.ones(count)
        op = SimpleNamespace(kind=kind, nbytes=4 * count, seq=3)
        sched = direct.allreduce(rank, size, count, FRAME // 4)
        exe = Group.execution(g, op, sched, [out, out, torch.empty(3 * count)], red, torch.float32, TAG)
        assert type(exe) is want, (size, rank, kind, count)


def test_the_pair_all_reduce_stalls_fails_and_releases_as_the_execution_does():
    x = torch.arange(8, dtype=torch.float32)
    make = _pair_reduce_exe("sum", torch.float32)
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
