"""A receive that reduces a lent frame (the ring reduce-scatter's large blocks over shared memory,
collectives/executor.py `Execution._reduce_lent`) reads the sender's bytes part by part into the
group's part buffer and reduces each part: the result must equal, bit for bit, what the same
receive makes of the same bytes copied through the ring, in the step's operand order, in place
and not, over part edges; a frame whose sender failed meanwhile must fail the receive and still
be released. The frames are lent from this process's own memory (process_vm_readv of itself)."""
import ctypes
import os
from collections import deque

import pytest
import torch

from neuron_dist.collectives.executor import LENT_PART_BYTES, Execution, Mailbox, Stamp, frame_plan
from neuron_dist.collectives.schedule import IN, OUT, Chunk, Recv, Schedule
from neuron_dist.transport.base import PeerGone
from neuron_dist.transport.cma import Lent, probe
from neuron_dist.transport.frame import Kind

TOKEN, GROUP_ID, RANK, PEER, SEQ = 0x5EC12E7, 5, 0, 1, 3
FRAME = 4096  # copied frames (the ring's slots)
LEND_FROM = 1 << 16  # a reducing step of at least this many bytes is lent, in one frame

_self = torch.arange(4, dtype=torch.int64)
if probe(os.getpid(), _self.data_ptr(), _self.numpy().tobytes()) is not None:
    pytest.skip("this host forbids process_vm_readv even of the process itself", allow_module_level=True)


class Inbox:
    """Hands out the peer's frames in order, the first again until released (as the ring does);
    `lend_reduce_from` 0: copies every frame, as a transport that cannot lend."""

    def __init__(self, frames, lend_reduce_from):
        self.q = deque(frames)
        self.lend_bytes = 1 << 30 if lend_reduce_from else 0
        self.lend_from = self.lend_min = 1
        self.lend_reduce_from = lend_reduce_from
        self.eager_bytes = 1 << 20
        self.released = 0

    def recv(self, peer):
        assert peer == PEER
        return self.q[0] if self.q else None

    def release(self, peer):
        self.q.popleft()
        self.released += 1


def _frames(incoming: torch.Tensor, lent: bool, failed=None):
    """The frames of one step carrying `incoming`: one lent frame, or copied frames of FRAME bytes."""
    stamp = Stamp(Kind.REDUCE_SCATTER, incoming.dtype, TOKEN, GROUP_ID, SEQ)
    raw = incoming.view(torch.uint8)
    if lent:
        return [(stamp.header(PEER, RANK, 0, raw.numel()),
                 Lent(os.getpid(), raw.data_ptr(), raw.numel(), incoming.dtype, PEER, failed))]
    per = FRAME // incoming.element_size()
    return [(stamp.header(PEER, RANK, i, min(per, incoming.numel() - o) * incoming.element_size()),
             incoming[o:o + per]) for i, o in enumerate(range(0, incoming.numel(), per))]


def _receive(incoming, base, out, lent, reduce, incoming_first=False, mailbox=None, failed=None):
    n = incoming.numel()
    step = Recv(PEER, Chunk(OUT, 0, n), reduce=True, base=None if base is None else Chunk(IN, 0, n),
                lend=True, incoming_first=incoming_first)
    inbox = Inbox(_frames(incoming, lent, failed), LEND_FROM if lent else 0)
    mailbox = mailbox or Mailbox(inbox, RANK)
    mailbox.transport = inbox
    exe = Execution(Schedule("ring").add(step), [base, out, None], reduce,
                    Stamp(Kind.REDUCE_SCATTER, out.dtype, TOKEN, GROUP_ID, SEQ), RANK, mailbox, FRAME)
    cut = [k for _, _, k in exe.rounds[0][2][0][1]]  # the receive's frames, as the plan cuts them
    assert cut == ([n] if lent else [p.numel() for _, p in inbox.q]), cut
    try:
        for _ in range(10_000):
            exe.progress()
            if exe.done:
                break
        assert exe.done
    finally:
        assert not inbox.q and inbox.released == len(_frames(incoming, lent)), "a frame was left unreleased"
    return mailbox


def _sub(d, a, b):  # not commutative: the operand order shows
    torch.sub(a, b, out=d)


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("incoming_first", [False, True])
def test_a_lent_frame_reduces_as_the_same_bytes_copied_through_the_ring(dtype, incoming_first):
    part = LENT_PART_BYTES // dtype.itemsize
    g = torch.Generator().manual_seed(3)
    for n in (LEND_FROM // dtype.itemsize, part, part + 1, 3 * part + 1001):
        incoming = (torch.randn(n, generator=g) * 50).to(dtype)
        base = (torch.randn(n, generator=g) * 50).to(dtype)
        copied, lent = torch.full((n,), 9, dtype=dtype), torch.full((n,), 9, dtype=dtype)
        _receive(incoming, base, copied, False, _sub, incoming_first)
        _receive(incoming, base, lent, True, _sub, incoming_first)
        want = incoming - base if incoming_first else base - incoming
        assert torch.equal(lent, copied) and torch.equal(lent, want), (dtype, n)
        assert torch.equal(base, base.clone()) and incoming.numel() == n  # inputs untouched
        # in place (the ring all-reduce: base is dst)
        acc_copied, acc_lent = base.clone(), base.clone()
        _receive(incoming, None, acc_copied, False, _sub, incoming_first)
        _receive(incoming, None, acc_lent, True, _sub, incoming_first)
        assert torch.equal(acc_lent, acc_copied) and torch.equal(acc_lent, want), (dtype, n, "in place")


def test_the_part_buffer_is_one_per_group_and_dtype_and_fits_in_cache():
    mb = Mailbox(None, RANK)
    a = mb.part_buffer(torch.float32)
    assert a is mb.part_buffer(torch.float32) and a.nbytes == LENT_PART_BYTES <= 1 << 20
    assert mb.part_buffer(torch.bfloat16).dtype == torch.bfloat16
    x = torch.arange(3 * a.numel() + 7, dtype=torch.float32)
    out = torch.zeros_like(x)
    _receive(x, torch.ones_like(x), out, True, lambda d, p, q: torch.add(p, q, out=d), mailbox=mb)
    assert torch.equal(out, x + 1) and mb.part_buffer(torch.float32) is a  # reused, not grown


def test_reducing_steps_are_lent_only_from_the_transports_larger_threshold():
    n = LEND_FROM // 4
    step = Recv(PEER, Chunk(OUT, 0, n), reduce=True, lend=True)
    for rf, lent in ((LEND_FROM, True), (LEND_FROM + 4, False)):
        (_, _, recvs), = frame_plan(Schedule("ring").add(step), 4, FRAME // 4, (1 << 28, 1, 1, rf), marked_only=True)
        assert len(recvs[0][1]) == (1 if lent else LEND_FROM // FRAME), (rf, recvs)


def test_a_sender_that_fails_during_the_read_fails_the_receive_and_the_frame_is_released():
    x = torch.arange(3 * LENT_PART_BYTES // 4, dtype=torch.float32)
    failed = ctypes.c_int32(1)  # the sender's "failed" word, raised while its frame was lent
    with pytest.raises(PeerGone, match="rank 1's copy of the group failed while its lent frame was read"):
        _receive(x, torch.zeros_like(x), torch.zeros_like(x), True, lambda d, p, q: torch.add(p, q, out=d),
                 failed=failed)


def test_a_part_outside_the_frame_is_refused():
    x = torch.arange(16, dtype=torch.float32)
    lent = Lent(os.getpid(), x.data_ptr(), x.nbytes, x.dtype, PEER)
    got = torch.empty(4)
    lent.read_part(got, 48)
    assert torch.equal(got, x[12:])
    for off in (-4, 52):
        with pytest.raises(ValueError, match="of a lent frame of 64 bytes"):
            lent.read_part(got, off)


def test_a_read_the_kernel_splits_is_completed(monkeypatch):
    """process_vm_readv may copy fewer bytes than asked (a read that crosses into memory it
    cannot fault in now): `cma.read` goes on from where the kernel stopped, on both sides, until
    every byte is in. Here the kernel copies at most 1000 bytes per call."""
    from neuron_dist.transport import cma
    real, calls = cma._readv, []

    def split(pid, local, lcount, remote, rcount, flags):
        lo, re_ = local._obj, remote._obj
        calls.append((lo.base, re_.base, lo.len, re_.len))
        return real(pid, ctypes.byref(cma._iovec(lo.base, min(lo.len, 1000))), 1,
                    ctypes.byref(cma._iovec(re_.base, min(re_.len, 1000))), 1, flags)
    monkeypatch.setattr(cma, "_readv", split)
    x = torch.arange(2500, dtype=torch.int16)  # 5000 bytes: five calls
    got = torch.zeros(2500, dtype=torch.int16)
    Lent(os.getpid(), x.data_ptr(), x.nbytes, x.dtype, PEER).read_into(got)
    assert torch.equal(got, x)
    assert [c[1] - x.data_ptr() for c in calls] == [0, 1000, 2000, 3000, 4000]
    assert [c[0] - got.data_ptr() for c in calls] == [0, 1000, 2000, 3000, 4000]
    assert [c[2] for c in calls] == [c[3] for c in calls] == [5000, 4000, 3000, 2000, 1000]
