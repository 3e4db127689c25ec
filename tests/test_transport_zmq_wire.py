"""Crafted bytes from a connection that passed authentication (it holds the job token: a buggy
or hostile peer, or another build of this package) into a ZmqTransport's listener: what the
receive path (`ZmqTransport._drain`) takes and what it refuses, and how. Each test pins one
check of that path, or of the header parser beneath it: review AM removed each one in turn
and every earlier test still passed (the fuzzer's random headers fail the magic check first;
a peer's real frames are always well formed). A refusal is a FrameError naming what was wrong,
which fails the call that meets it with the rank and the collective."""
import time

import pytest
import torch
import zmq

from zmqpair import TOKEN, make_pair, recv_within
from neuron_dist.transport import frame
from neuron_dist.transport.frame import FrameError, Header, Kind
from neuron_dist.transport.zmq_transport import USER, context

F32 = frame.DTYPE_CODE[torch.float32]


@pytest.fixture
def pair():
    a, b = make_pair(job="wire")
    assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
    ep = a.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    s = context().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.plain_username, s.plain_password = USER, str(TOKEN).encode()
    s.connect(ep)
    yield a, b, s
    s.close(linger=0)
    a.close(abort=True)
    b.close(abort=True)


def hdr(kind=Kind.P2P, dtype=F32, token=TOKEN, src=1, dst=0, chunk=0, nbytes=8, seq=8, tag=0):
    return Header(int(kind), dtype, token, 0, seq, src, dst, chunk, tag, nbytes)


def until(fn, wait=3.0):
    """Call fn every 20 ms until it returns something truthy or raises, for at most `wait`
    seconds; its last value."""
    end = time.monotonic() + wait
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.02)


def inject(s, *parts):
    s.send_multipart(list(parts), copy=True)


def test_a_frame_with_the_wrong_job_token_is_dropped_not_delivered(pair):
    """A frame whose header carries another job's token is dropped; the good frame after it is
    the one delivered."""
    a, b, s = pair
    inject(s, hdr(token=TOKEN + 1).pack(), b"\x01" * 8)
    inject(s, hdr().pack(), b"\x02" * 8)  # then a good one: the bad one must not be what arrives
    got = recv_within(a, 1, 3.0)
    assert got is not None and bytes(got[1].numpy()) == b"\x02" * 8 and got[0].token == TOKEN, got


@pytest.mark.parametrize("field", ["dst", "src", "self"])
def test_a_frame_for_another_rank_or_from_a_rank_not_a_peer_is_refused(pair, field):
    """A frame addressed to another rank, or claiming to come from a rank outside the group or
    from this rank itself, is refused naming both ranks (not a KeyError, not counted as the peer's)."""
    a, b, s = pair
    h = {"dst": hdr(dst=1), "src": hdr(src=7), "self": hdr(src=0)}[field]
    inject(s, h.pack(), b"\x01" * 8)
    with pytest.raises(FrameError, match=r"^rank 0: frame claims to come from rank \d to rank \d$"):
        until(lambda: a.take_in() or a.recv(1))


@pytest.mark.parametrize("nparts", [1, 3])
def test_a_message_of_other_than_two_parts_is_refused(pair, nparts):
    """Every frame is two zmq parts, header and payload; any other count is refused."""
    a, b, s = pair
    inject(s, *([hdr().pack(), b"\x01" * 8, b"x"][:nparts]))
    with pytest.raises(FrameError, match=f"malformed message of {nparts} parts"):
        until(lambda: a.take_in() or a.recv(1))


@pytest.mark.parametrize("body", [4, 12, 0])
def test_a_payload_shorter_or_longer_than_its_header_says_is_refused(pair, body):
    """The payload's length must be the header's `nbytes`, exactly."""
    a, b, s = pair
    inject(s, hdr(nbytes=8).pack(), b"\x01" * body)
    with pytest.raises(FrameError, match="announces 8 bytes but carries"):
        until(lambda: a.take_in() or a.recv(1))


def test_a_bye_is_no_data_and_says_whether_its_process_exits(pair):
    """A BYE marks the peer finished (an orderly close), is never delivered as data, and is no
    failure."""
    a, b, s = pair
    inject(s, frame.bye_header(TOKEN, 1, 0, exiting=False).pack(), b"")
    assert until(lambda: a.peer_finished(1))
    assert a.recv(1) is None and not a.peer_exiting(1) and a.check_peer(1) is None


def test_an_exiting_bye_is_reported_as_the_peers_exit(pair):
    """A BYE with its exiting mark (chunk 1) is reported as the peer's process exiting."""
    a, b, s = pair
    inject(s, frame.bye_header(TOKEN, 1, 0, exiting=True).pack(), b"")
    assert until(lambda: a.peer_exiting(1))
    assert "as its process exits" in a.check_peer(1)


def test_an_abort_is_kept_aside_with_its_printable_cause(pair):
    """An ABORT is kept aside as the peer's failure, not delivered to a receive, with its cause
    made printable (a terminal's escape codes from the wire never reach the user's error) and
    bounded."""
    a, b, s = pair
    cause = b"boom \x1b[31mred\x1b[0m" + b"x" * 5000
    inject(s, hdr(kind=Kind.ABORT, dtype=0, nbytes=4096).pack(), cause[:4096])
    assert until(lambda: (a.take_in(), a.peer_failed(1))[1])
    why = a.peer_failed(1)
    assert why.startswith("rank 1 aborted the group: boom ?[31mred") and "\x1b" not in why, why
    assert len(why) < 4200


def test_an_abort_claiming_more_than_its_bound_is_refused(pair):
    """An ABORT's cause is at most MAX_ABORT_BYTES, whatever its header claims."""
    a, b, s = pair
    inject(s, hdr(kind=Kind.ABORT, dtype=0, nbytes=4097).pack(), b"x" * 4097)
    with pytest.raises(FrameError, match="abort frame claims 4097 bytes"):
        until(lambda: a.take_in() or a.recv(1))


@pytest.mark.parametrize("what", ["magic", "version", "kind11", "dtype", "odd"])
def test_a_header_of_another_build_or_kind_is_refused(pair, what):
    """Another build's magic or version, an unknown kind or dtype code, a payload that is no whole
    number of elements: each refused (test_frame_fuzz.py checks each message)."""
    a, b, s = pair
    raw = bytearray(hdr().pack())
    if what == "magic":
        raw[0:4] = b"NDF2"
    elif what == "version":
        raw[4:6] = (2).to_bytes(2, "little")
    elif what == "kind11":
        raw[6] = 11
    elif what == "dtype":
        raw[7] = 200
    else:
        raw = bytearray(hdr(nbytes=6).pack())
    inject(s, bytes(raw), b"\x01" * (6 if what == "odd" else 8))
    with pytest.raises(FrameError):
        until(lambda: a.take_in() or a.recv(1))


def test_small_float64_payloads_are_aligned(pair):
    """A small payload zmq hands over at an odd address is copied to an aligned one before it is
    viewed as float64."""
    a, b, s = pair
    f64 = frame.DTYPE_CODE[torch.float64]
    for n in (8, 16, 24):
        inject(s, hdr(dtype=f64, nbytes=n, seq=n).pack(), b"\x00" * n)
    for n in (8, 16, 24):
        got = recv_within(a, 1, 3.0)
        assert got[1].data_ptr() % 8 == 0
