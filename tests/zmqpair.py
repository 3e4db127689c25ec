"""Two zmq transports in one process, as ranks on two different "hosts" (TCP on loopback), and
the small frame helpers the zmq transport tests share."""
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from neuron_dist.transport import frame
from neuron_dist.transport.base import TransportContext
from neuron_dist.transport.zmq_transport import ZmqTransport

TOKEN = 0x1234_5678_9ABC


def make_pair(job: str = "sec", bind_addrs=("127.0.0.1", "127.0.0.1"), tokens=(TOKEN, TOKEN)):
    """Both transports, or for a rank whose set-up raised, the exception. Ranks given different
    `tokens` refuse each other's connections, as processes of two jobs would."""
    store = dist.HashStore()
    out = [None, None]

    def make(r):
        ctx = TransportContext(rank=r, size=2, store=store, token=tokens[r], timeout=timedelta(seconds=10),
                               hostname=f"host{r}", bind_addr=bind_addrs[r], hosts=["host0", "host1"], job_id=job)
        try:
            out[r] = ZmqTransport(ctx)
        except Exception as e:  # noqa: BLE001 - the caller checks which rank failed, and how
            out[r] = e

    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (a container may have IPv6 off)."""
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def p2p_header(src=1, dst=0, token=TOKEN, nbytes=8, chunk=0):
    return frame.Header(int(frame.Kind.P2P), frame.DTYPE_CODE[torch.float32], token, 0, 0, src, dst, chunk, 0,
                        nbytes)


def recv_within(t, peer, wait=1.0):
    """The next frame from `peer`, or None if none arrives within `wait` seconds."""
    end = time.time() + wait
    while time.time() < end:
        got = t.recv(peer)
        if got is not None:
            return got
        t.wait(0.05)
    return None


def assert_delivers(a, b):
    """A frame from b (rank 1) reaches a (rank 0) intact within 5 s."""
    payload = torch.arange(4, dtype=torch.float32).view(torch.uint8)
    assert b.send(0, p2p_header(nbytes=16), payload)
    got = recv_within(a, 1, wait=5)
    assert got is not None and got[0].src == 1 and torch.equal(got[1], payload), got


def assert_wake_ends_waits(t):
    """Any transport: wake() from another thread ends a wait in progress on which nothing
    arrives, and a wake() before a wait ends that wait at once (both well before the wait's 10 s)."""
    timer = threading.Timer(0.05, t.wake)
    timer.start()
    t0 = time.monotonic()
    t.wait(10.0)
    assert time.monotonic() - t0 < 5.0
    timer.join()
    t.wake()
    t0 = time.monotonic()
    t.wait(10.0)
    assert time.monotonic() - t0 < 5.0
