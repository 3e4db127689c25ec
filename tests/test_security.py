"""Hostile connections: listeners bind only to the job's address, and a connection that does
not present the job's token (or presents a wrong one) is dropped before any frame is read.
Two zmq transports are built in one process as ranks on two different "hosts" (tests/zmqpair.py),
so they talk over TCP on loopback; a rogue zmq socket then tries to inject a well-formed frame."""
import os
import time

import pytest
import zmq

from neuron_dist.transport.zmq_transport import USER, context
from zmqpair import TOKEN, assert_delivers, make_pair, p2p_header, recv_within


@pytest.fixture
def pair():
    a, b = make_pair()
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
    rogues = []
    try:
        # a perfectly well-formed frame, claiming rank 1, from a fresh rogue socket every 100 ms for
        # 1.5 s, never blocking: once the listener has refused a rogue's handshake the rogue has
        # nowhere to queue a frame, and a blocking send waits for ever (a loaded run hung so)
        offered, end = 0, time.monotonic() + 1.5
        while time.monotonic() < end:
            rogue = context().socket(zmq.PUSH)
            rogues.append(rogue)
            rogue.setsockopt(zmq.LINGER, 0)
            if password is not None:
                rogue.plain_username, rogue.plain_password = USER, password
            rogue.connect(ep)
            try:
                rogue.send_multipart([p2p_header().pack(), b"\x01" * 8], flags=zmq.NOBLOCK, copy=True)
                offered += 1
            except zmq.Again:
                pass
            assert recv_within(a, 1, wait=0.1) is None, "a frame from an unauthenticated connection was read"
        assert offered, "no rogue frame was ever queued: the test proved nothing"
        assert_delivers(a, b)  # the real peer, which has the token, still gets through on the same listener
    finally:
        for rogue in rogues:
            rogue.close(linger=0)


def test_bind_address_choice(monkeypatch):
    """Listeners bind to the interface that routes to the rendezvous host: loopback stays on
    loopback, NEURON_DIST_BIND_ADDR overrides, and an unresolvable host is a clear error
    naming the override (never a listener on every interface)."""
    from neuron_dist.errors import GroupError
    from neuron_dist.hosts import bind_addr
    monkeypatch.delenv("NEURON_DIST_BIND_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert bind_addr() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.5")
    assert bind_addr() == "127.0.0.1"
    monkeypatch.setenv("NEURON_DIST_BIND_ADDR", "10.1.2.3")
    assert bind_addr() == "10.1.2.3"
    monkeypatch.delenv("NEURON_DIST_BIND_ADDR")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(GroupError, match=r"rendezvous host \(MASTER_ADDR\) 'no-such-host.invalid'.*NEURON_DIST_BIND_ADDR"):
        bind_addr()
    for v6 in ("::1", "[::1]"):  # an IPv6 rendezvous (gethostbyname could not resolve it)
        monkeypatch.setenv("MASTER_ADDR", v6)
        assert bind_addr() == "::1"
    for every in ("0.0.0.0", "::", "[::]"):  # would listen everywhere, and peers cannot dial it
        monkeypatch.setenv("NEURON_DIST_BIND_ADDR", every)
        with pytest.raises(GroupError, match="every interface"):
            bind_addr()
    for word in ("banana", "10.1.2", "eth0"):  # was taken silently by a job on one host
        monkeypatch.setenv("NEURON_DIST_BIND_ADDR", word)
        with pytest.raises(GroupError, match=rf"NEURON_DIST_BIND_ADDR='{word}' is not an IPv4 or IPv6 address"):
            bind_addr()
    monkeypatch.setenv("NEURON_DIST_BIND_ADDR", "[fd00::7]")
    assert bind_addr() == "fd00::7"


def test_a_host_whose_name_resolves_to_loopback_listens_on_the_route_to_its_peers(monkeypatch):
    """Debian's /etc/hosts maps the host's own name to 127.0.1.1: on the rendezvous host the
    route to MASTER_ADDR is then loopback, and rank 0 published a 127.0.0.1 endpoint to ranks on
    other hosts (probe G: they dialled their own loopback; one rank exited 0 with its frames
    never delivered). The rank now listens on its route to a rank on another host; with no such
    rank it fails naming what to set."""
    import types
    from neuron_dist import group as G, hosts
    from neuron_dist.errors import GroupError
    routes = {"10.9.9.2": "10.9.9.1"}  # this host's side of the route to each peer address
    monkeypatch.setattr(hosts, "route_from", lambda h, what="": "127.0.0.1" if hosts.is_loopback(h) else routes[h])
    monkeypatch.delenv("NEURON_DIST_BIND_ADDR", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.1.1")

    class Store(dict):
        def set(self, k, v):
            self[k] = v.encode() if isinstance(v, str) else v

        def get(self, k):
            return self[k]

    def rank0(peer_addr):
        store = Store({"addr/1": peer_addr.encode()})
        me = {"host": "node0"}
        g = types.SimpleNamespace(rank=0, name="default_pg", hosts=["node0", "node1"],
                                  peers_info=[me, {"host": "node1"}])
        return G.Group._job_addr(g, me, store), store

    addr, store = rank0("10.9.9.2")
    assert addr == "10.9.9.1" and store["addr/0"] == b"127.0.0.1"
    with pytest.raises(GroupError, match="over loopback.*NEURON_DIST_BIND_ADDR"):
        rank0("127.0.0.1")  # every host thinks the rendezvous is itself: nothing to route to
    monkeypatch.setenv("NEURON_DIST_BIND_ADDR", "10.9.9.7")  # the user's choice stands
    assert rank0("10.9.9.2")[0] == "10.9.9.7"


def test_a_bind_address_that_cannot_work_is_refused_on_one_host_too(tmp_path):
    """NEURON_DIST_BIND_ADDR=0.0.0.0 was accepted silently by a job on one host (which opens no
    TCP listener), though the README says it is refused."""
    import subprocess
    import sys
    from pool import free_port
    code = ("import torch.distributed as dist, neuron_dist\n"
            f"dist.init_process_group('neuron', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n")
    env = dict(os.environ, NEURON_DIST_BIND_ADDR="0.0.0.0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 1 and "NEURON_DIST_BIND_ADDR='0.0.0.0' would listen on every interface" in p.stderr, \
        p.stderr[-2000:]
