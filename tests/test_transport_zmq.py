"""The zmq transport's delivery guarantees at close: what a rank has sent reaches a live peer
even when the rank aborts right after (its last collective completed here, the peer may still
be reading it), and abort stays bounded when nobody reads."""
import time

import pytest
import torch
import zmq

from zmqpair import ipv6_loopback, make_pair, p2p_header, recv_within
from neuron_dist.transport.base import TransportError
from neuron_dist.transport.zmq_transport import ABORT_LINGER_S, ZERO_COPY_BYTES

FRAMES = 64
BYTES = ZERO_COPY_BYTES // 2  # copied into zmq: the caller's buffer is free once send returns


def test_frames_sent_before_an_abort_still_arrive():
    a, b = make_pair("abort-delivery")
    try:
        payloads = [torch.full((BYTES // 4,), float(i)).view(torch.uint8) for i in range(FRAMES)]
        for i, p in enumerate(payloads):  # 2 MiB in all: more than the socket buffers hold at once
            assert b.send(0, p2p_header(nbytes=BYTES, chunk=i), p)
        b.close(abort=True)  # right away: most frames are still queued inside zmq
        for i, p in enumerate(payloads):
            got = recv_within(a, 1, wait=5)
            assert got is not None, f"frame {i} of {FRAMES} sent before the abort never arrived"
            assert got[0].chunk == i and torch.equal(got[1], p), f"frame {i} arrived wrong"
    finally:
        a.close(abort=True)
        b.close(abort=True)


def test_abort_with_nobody_reading_returns_within_the_linger():
    a, b = make_pair("abort-bounded")
    try:
        big = torch.zeros(BYTES, dtype=torch.uint8)
        for i in range(256):  # 8 MiB queued to a peer that never reads
            b.send(0, p2p_header(nbytes=BYTES, chunk=i), big)
        a.close(abort=True)  # the reader goes first: b's frames can never be delivered
        t0 = time.monotonic()
        b.close(abort=True)  # the last transport here: ends the context, which honours the linger
        assert time.monotonic() - t0 < ABORT_LINGER_S + 2.0
    finally:
        a.close(abort=True)
        b.close(abort=True)


def test_ipv6_listeners():
    """A job whose address is IPv6 listens on it and its peers connect over it."""
    if not ipv6_loopback():
        pytest.skip("this machine cannot listen on ::1")
    a, b = make_pair("ipv6", bind_addrs=("::1", "::1"))
    try:
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        payload = torch.arange(4, dtype=torch.float32).view(torch.uint8)
        assert b.send(0, p2p_header(nbytes=16), payload)
        got = recv_within(a, 1, wait=5)
        assert got is not None and torch.equal(got[1], payload)
        assert a.pull.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://[::1]:")
    finally:
        for t in (a, b):
            if not isinstance(t, Exception):
                t.close(abort=True)


def test_an_address_not_of_this_host_is_a_clear_error_on_both_ranks():
    """Rank 0 told to listen on an address this host does not have: its error names the address
    and NEURON_DIST_BIND_ADDR (it was an AttributeError from close() on a half-built transport),
    and rank 1 fails at once with that cause instead of waiting out the store's time-out."""
    t0 = time.monotonic()
    a, b = make_pair("bad-bind", bind_addrs=("192.0.2.55", "127.0.0.1"))
    try:
        assert isinstance(a, TransportError) and "192.0.2.55" in str(a) and "NEURON_DIST_BIND_ADDR" in str(a), repr(a)
        assert isinstance(b, TransportError) and "rank 0" in str(b) and "192.0.2.55" in str(b), repr(b)
        assert time.monotonic() - t0 < 5, "rank 1 waited for rank 0's endpoint"
    finally:
        for t in (a, b):
            if not isinstance(t, Exception):
                t.close(abort=True)
