"""Hostile bytes: the frame parser and the receive path fed malformed, truncated, oversized and
reordered frames. Every case must end in FrameError (or wait for more frames when the stream is
merely short), never another exception, a hang, or a write outside the destination tensor.

Default run: 20,000 mutated streams + a hypothesis pass on raw headers. `pytest -m slow`:
120,000 mutated streams. The count is printed (-s)."""
import random
import re
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from neuron_dist.collectives.executor import Execution, Mailbox, Stamp
from neuron_dist.collectives.schedule import OUT, Chunk, Recv, Schedule
from neuron_dist.transport import frame
from neuron_dist.transport.frame import FrameError, Kind

TOKEN, GROUP, SEQ, N, FRAME = 0x5EC12E7, 77, 5, 256, 512   # 256 float32 in two 512-byte frames
GUARD = 64


class FakeTransport:
    """Hands the executor whatever raw (header bytes, payload bytes) pairs the fuzzer made,
    parsed exactly as a real transport does (frame.unpack, then a payload-length check)."""

    def __init__(self, raw):
        self.raw = list(raw)

    def recv(self, peer):
        if not self.raw:
            return None
        hb, body = self.raw.pop(0)
        h = frame.unpack(hb)
        if len(body) != h.nbytes:
            raise FrameError(f"frame announces {h.nbytes} bytes but carries {len(body)}")
        return h, torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)

    def send(self, *a):
        return True

    def release(self, peer):
        pass

    def flush(self, timeout):
        pass

    def wait(self, timeout):
        pass


def valid_stream(rng):
    data = torch.randn(N)
    raw = data.view(torch.uint8).numpy().tobytes()
    frames = []
    for chunk, off in enumerate(range(0, len(raw), FRAME)):
        body = raw[off:off + FRAME]
        h = frame.Header(int(Kind.ALLREDUCE), frame.DTYPE_CODE[torch.float32], TOKEN, GROUP, SEQ, 1, 0, chunk, 9,
                         len(body))
        frames.append((h.pack(), body))
    return data, frames


def mutate(rng, frames):
    frames = [(bytearray(h), bytearray(b)) for h, b in frames]
    m = rng.randrange(9)
    i = rng.randrange(len(frames))
    h, b = frames[i]
    if m == 0:                                   # flip random header bytes
        for _ in range(rng.randint(1, 4)):
            h[rng.randrange(len(h))] ^= 1 << rng.randrange(8)
    elif m == 1:                                 # truncate or extend the header
        h = h[:rng.randrange(len(h))] if rng.random() < 0.7 else h + bytes(rng.randint(1, 9))
    elif m == 2:                                 # oversized / odd nbytes claims
        struct.pack_into("<Q", h, 48, rng.choice([1 << 40, frame.MAX_FRAME_BYTES + 1, 2 ** 64 - 1,
                                                  len(b) + rng.randint(1, 3), rng.randrange(1 << 20)]))
    elif m == 3:                                 # truncated or padded payload
        b = b[:rng.randrange(len(b) + 1)] if rng.random() < 0.5 else b + bytes(rng.randint(1, 4096))
    elif m == 4:                                 # reordered frames
        rng.shuffle(frames)
        return [(bytes(x), bytes(y)) for x, y in frames] if len(frames) > 1 and frames != [] else frames
    elif m == 5:                                 # duplicated / dropped frames
        frames = frames + [frames[i]] if rng.random() < 0.5 else frames[:i] + frames[i + 1:]
        return [(bytes(x), bytes(y)) for x, y in frames]
    elif m == 6:                                 # a field of another collective/rank/group/token
        off, fmt = rng.choice([(7, "<B"), (8, "<Q"), (16, "<Q"), (24, "<Q"), (32, "<I"), (36, "<I"), (40, "<I"),
                               (44, "<I")])
        struct.pack_into(fmt, h, off, rng.randrange(1 << (8 * struct.calcsize(fmt))))
    elif m == 7:                                 # random garbage
        h = bytearray(rng.randbytes(rng.choice([0, 1, 55, 56, 57, 200])))
    else:                                        # an abort frame with a hostile reason
        a = frame.Header(int(Kind.ABORT), 0, TOKEN, GROUP, SEQ, 1, 0, 0, 0, rng.randint(0, 5000))
        h, b = bytearray(a.pack()), bytearray(rng.randbytes(a.nbytes))
    frames[i] = (h, b)
    return [(bytes(x), bytes(y)) for x, y in frames]


def run_one(rng):
    data, frames = valid_stream(rng)
    stream = mutate(rng, frames)
    mem = torch.full((N + 2 * GUARD,), 12345.0)
    dst = mem[GUARD:GUARD + N]
    sched = Schedule("p2p").add(Recv(1, Chunk(OUT, 0, N)))
    exe = Execution(sched, [None, dst, None], None, Stamp(Kind.ALLREDUCE, torch.float32, TOKEN, GROUP, SEQ, 9), 0,
                    Mailbox(FakeTransport(stream), 0), FRAME)
    outcome = "waiting"
    try:
        for _ in range(len(stream) + 2):
            exe.progress()
            if exe.done:
                outcome = "done"
                break
    except FrameError as e:
        assert str(e), "a FrameError without a message"
        outcome = "error"
    assert (mem[:GUARD] == 12345.0).all() and (mem[GUARD + N:] == 12345.0).all(), "write outside the destination"
    if outcome == "done":
        # only a mutation that left the needed frames intact (a trailing duplicate, a field set
        # to its own value) may complete, and then with exactly the sent data
        assert torch.equal(dst, data), "completed with wrong data on a mutated stream"
    return outcome


def fuzz(count, seed=1):
    rng = random.Random(seed)
    seen = {"error": 0, "waiting": 0, "done": 0}
    for _ in range(count):
        seen[run_one(rng)] += 1
    print(f"frame fuzz: {count} mutated streams: {seen}")
    return seen


def test_frame_fuzz_short():
    seen = fuzz(20_000)
    assert seen["error"] > 15_000


@pytest.mark.slow
def test_frame_fuzz_long():
    seen = fuzz(120_000, seed=2)
    assert sum(seen.values()) == 120_000


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=0, max_size=80))
def test_unpack_raw_bytes(buf):
    try:
        h = frame.unpack(buf)
    except FrameError:
        return
    assert len(buf) == frame.HEADER_SIZE and h.nbytes <= frame.MAX_FRAME_BYTES


def test_mismatch_messages_say_what_the_frames_carry():
    """A point-to-point header's seq field holds the message's size (messages have no sequence):
    the error says so instead of calling two sizes sequence numbers."""
    f32 = frame.DTYPE_CODE[torch.float32]
    want = frame.Header(int(Kind.P2P), f32, TOKEN, GROUP, 32, 1, 0, 0, 3, 32)
    got = frame.Header(int(Kind.P2P), f32, TOKEN, GROUP, 16, 1, 0, 0, 3, 16)
    with pytest.raises(FrameError, match=r"expected p2p message of 32 bytes, tag 3, from rank 1 .* "
                                         r"received p2p message of 16 bytes, tag 3, from rank 1"):
        frame.check(got, want, 16)
    want_c = want._replace(kind=int(Kind.ALLREDUCE), seq=5, tag=0)
    with pytest.raises(FrameError, match=r"expected allreduce seq=5 from rank 1 .* received allreduce seq=6"):
        frame.check(want_c._replace(seq=6), want_c, 32)


def test_an_exception_that_is_no_parse_error_is_not_called_a_bad_frame(monkeypatch):
    """A signal handler's exception (an alarm's time limit) raised while a header was parsed came
    out as "unparseable frame header: time limit" (every Exception was taken for a bad frame)."""
    from neuron_dist.transport import frame

    class Limit(Exception):
        pass

    class Header:
        size = frame.HEADER.size

        def unpack(self, *args):
            raise Limit("time limit")
        unpack_from = unpack
    monkeypatch.setattr(frame, "HEADER", Header())
    with pytest.raises(Limit):
        frame.unpack(bytes(frame.HEADER_SIZE))
    with pytest.raises(Limit):
        frame.unpack_from(bytes(frame.HEADER_SIZE))


@pytest.mark.parametrize("kind, dtype, limit", [(Kind.ALLREDUCE, torch.float32, frame.MAX_FRAME_BYTES),
                                                (Kind.P2P, torch.uint8, frame.MAX_FRAME_BYTES),
                                                (Kind.ABORT, None, frame.MAX_ABORT_BYTES)],
                         ids=["allreduce", "p2p", "abort"])
def test_a_header_claiming_more_than_its_limit_is_refused_by_both_parsers(kind, dtype, limit):
    """A header whose nbytes is one element past its limit (MAX_FRAME_BYTES for any frame,
    MAX_ABORT_BYTES for an abort's cause) is a FrameError naming the limit, from `unpack` and from
    `unpack_from` (a shared-memory slot's parser) alike; at the limit it parses. The fuzzer's
    oversized claims never showed the frame bound mattered: each was also an odd element count
    or met the payload-length check, so a parser without the bound passed (a mutation review)."""
    code = frame.DTYPE_CODE[dtype] if dtype is not None else 0
    over = limit + (torch.empty(0, dtype=dtype).element_size() if dtype is not None else 1)
    what = "abort frame" if kind == Kind.ABORT else "frame"
    for nbytes, refused in ((limit, False), (over, True)):
        raw = frame.Header(int(kind), code, TOKEN, GROUP, SEQ, 1, 0, 0, 9, nbytes).pack()
        slot = bytes(24) + raw + bytes(8)  # a header inside a larger buffer, as in a ring slot
        for parse in (lambda: frame.unpack(raw), lambda: frame.unpack_from(slot, 24)):
            if refused:
                with pytest.raises(FrameError, match=f"^{what} claims {nbytes} bytes, above the {limit} limit$"):
                    parse()
            else:
                assert parse().nbytes == nbytes


@pytest.mark.parametrize("field", ["magic", "version", "kind", "dtype", "part_element"])
def test_each_header_check_refuses_on_its_own(field):
    """One field at a time made wrong in a valid header (another build's magic or version, a
    kind or dtype code this build does not know, a payload that is no whole number of elements)
    is refused by its own check, naming that field, by both parsers. The fuzzer's random headers
    almost always fail the magic check first, so a parser without any later check passed every
    test (review AM: the version, kind and element checks each removed survived)."""
    f32 = frame.DTYPE_CODE[torch.float32]
    good = frame.Header(int(Kind.ALLREDUCE), f32, TOKEN, GROUP, SEQ, 1, 0, 0, 9, 16).pack()
    assert frame.unpack(good).nbytes == 16
    raw = bytearray(good)
    if field == "magic":
        raw[0:4], says = b"NDF2", "bad frame magic b'NDF2': not a neuron_dist peer"
    elif field == "version":
        raw[4:6], says = (frame.VERSION + 1).to_bytes(2, "little"), f"frame version {frame.VERSION + 1}, this build"
    elif field == "kind":
        raw[6], says = max(Kind) + 1, f"unknown frame kind {max(Kind) + 1}"
    elif field == "dtype":
        raw[7], says = 200, "unknown dtype code 200"
    else:
        raw = bytearray(frame.Header(int(Kind.ALLREDUCE), f32, TOKEN, GROUP, SEQ, 1, 0, 0, 9, 6).pack())
        says = "frame of torch.float32 claims 6 bytes, not a whole number of elements"
    for parse in (lambda: frame.unpack(bytes(raw)), lambda: frame.unpack_from(bytes(8) + bytes(raw), 8)):
        with pytest.raises(FrameError, match=re.escape(says)):
            parse()
