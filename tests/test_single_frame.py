"""A send or receive that fits one copied frame skips the Execution (collectives/executor.py,
SingleFrameSend, SingleFrameRecv). A send must put on the wire exactly the frame an Execution of
the send's schedule would, be chosen exactly when an Execution would cut the message into one
copied frame, and stall and finish as that Execution does (a full ring, memory the transport
still refers to). A receive must accept exactly the frames an Execution's receive accepts
(shorter messages included), deliver the same bytes, reject the rest naming the frame, and
release every frame it takes."""
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives.executor import Execution, Mailbox, SingleFrameRecv, SingleFrameSend, Stamp
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
