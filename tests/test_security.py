"""Hostile connections: listeners bind only to the job's address, and a connection that does
not present the job's token (or presents a wrong one) is dropped before any frame is read.
Two zmq transports are built in one process as ranks on two different "hosts", so they talk
over TCP on loopback; a rogue zmq socket then tries to inject a well-formed frame."""
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import zmq

from neuron_dist.transport import frame
from neuron_dist.transport.base import TransportContext
from neuron_dist.transport.zmq_transport import USER, ZmqTransport, context

TOKEN = 0x1234_5678_9ABC


def _pair():
    store = dist.HashStore()
    out = [None, None]

    def make(r):
        ctx = TransportContext(rank=r, size=2, store=store, token=TOKEN, timeout=timedelta(seconds=10),
                               hostname=f"host{r}", bind_addr="127.0.0.1", hosts=["host0", "host1"], job_id="sec")
        out[r] = ZmqTransport(ctx)

    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def _frame(src=1, dst=0, token=TOKEN, nbytes=8):
    h = frame.Header(int(frame.Kind.P2P), frame.DTYPE_CODE[torch.float32], token, 0, nbytes, src, dst, 0, 0, nbytes)
    return [h.pack(), b"\x01" * nbytes]


def _recv(t, peer, wait=1.0):
    end = time.time() + wait
    while time.time() < end:
        got = t.recv(peer)
        if got is not None:
            return got
        t.wait(0.05)
    return None


@pytest.fixture
def pair():
    a, b = _pair()
    yield a, b
    a.close()
    b.close()


def test_listener_binds_only_the_job_address(pair):
    a, _ = pair
    ep = a.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    assert ep.startswith("tcp://127.0.0.1:"), ep


@pytest.mark.parametrize("password", [None, b"wrong-token", str(TOKEN + 1).encode()])
def test_connection_without_the_token_is_dropped(pair, password):
    a, b = pair
    ep = a.pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    rogue = context().socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    if password is not None:
        rogue.plain_username, rogue.plain_password = USER, password
    rogue.connect(ep)
    rogue.send_multipart(_frame(), copy=True)  # a perfectly well-formed frame, claiming rank 1
    try:
        assert _recv(a, 1, wait=1.5) is None, "a frame from an unauthenticated connection was read"
        # the real peer, which has the token, still gets through on the same listener
        payload = torch.arange(2, dtype=torch.float32).view(torch.uint8)
        h = frame.Header(int(frame.Kind.P2P), frame.DTYPE_CODE[torch.float32], TOKEN, 0, 8, 1, 0, 0, 0, 8)
        assert b.send(0, h, payload)
        got = _recv(a, 1, wait=5)
        assert got is not None and got[0].src == 1 and bytes(got[1].numpy()) == bytes(payload.numpy())
    finally:
        rogue.close(linger=0)


def test_bind_address_choice(monkeypatch):
    """Listeners bind to the interface that routes to the rendezvous host: loopback stays on
    loopback, NEURON_DIST_BIND_ADDR overrides, and an unresolvable host is a clear error
    naming the override (never a listener on every interface)."""
    from neuron_dist.errors import GroupError
    from neuron_dist.group import _bind_addr
    monkeypatch.delenv("NEURON_DIST_BIND_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert _bind_addr() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.5")
    assert _bind_addr() == "127.0.0.1"
    monkeypatch.setenv("NEURON_DIST_BIND_ADDR", "10.1.2.3")
    assert _bind_addr() == "10.1.2.3"
    monkeypatch.delenv("NEURON_DIST_BIND_ADDR")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(GroupError, match="NEURON_DIST_BIND_ADDR"):
        _bind_addr()
