"""The zmq transport's delivery guarantees at close: what a rank has sent reaches a live peer
even when the rank aborts right after (its last collective completed here, the peer may still
be reading it), and abort stays bounded when nobody reads."""
import time

import torch

from zmqpair import make_pair, p2p_header, recv_within
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
