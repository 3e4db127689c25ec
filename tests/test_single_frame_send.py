"""A send that fits one copied frame skips the Execution (collectives/executor.py,
SingleFrameSend): it must put on the wire exactly the frame an Execution of the send's schedule
would, be chosen exactly when an Execution would cut the message into one copied frame, and
stall and finish as that Execution does (a full ring, memory the transport still refers to)."""
from types import SimpleNamespace

import pytest
import torch

from neuron_dist.collectives.executor import Execution, Mailbox, SingleFrameSend, Stamp
from neuron_dist.collectives.schedule import IN, Chunk, Schedule, Send
from neuron_dist.group import Group
from neuron_dist.transport.frame import Kind

TOKEN, GROUP_ID, RANK, PEER, TAG = 0x5EC12E7, 77, 1, 3, 9
FRAME = 4096


class Recorder:
    """Takes every frame (copied, as the shared-memory ring does) or lends it, as asked."""

    def __init__(self, lend_bytes=0, eager_bytes=1 << 20, full=0, unflushed=0):
        self.frames, self.lent = [], []
        self.lend_bytes, self.eager_bytes, self.lend_from, self.lend_min = lend_bytes, eager_bytes, 1, 1
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


def _execution_frames(t, transport):
    nbytes = t.numel() * t.element_size()
    exe = Execution(Schedule("p2p").add(Send(PEER, Chunk(IN, 0, t.numel()))), [t, None, None], None,
                    Stamp(Kind.P2P, t.dtype, TOKEN, GROUP_ID, nbytes, TAG), RANK, Mailbox(transport, RANK), FRAME)
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
