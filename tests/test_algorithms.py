"""Every registered schedule, forced, on real processes (the simulator checks them for
1..128 ranks in tests/test_schedules_topology.py; this runs them over the real transports)."""
import pytest


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("case", ["every_algorithm", "two_node_placement", "forced_unknown", "model_policy",
                                  "host_policy", "reductions_agree_bitwise", "ultraserver_domains"])
def test_algorithms(pools, case, world):
    assert all(pools(world).run(f"cases_algorithms:{case}"))


@pytest.mark.parametrize("oversubscribed", (False, True))
def test_host_broadcast_choice(monkeypatch, oversubscribed):
    """The host policy's broadcast: the root's own sends up to 1 MiB and the tree above, except on
    a host with fewer cores than local ranks, where the tree's extra hop costs more than it
    spreads and the root sends directly at every size (the pure rule, on a stand-in group)."""
    from types import SimpleNamespace

    from neuron_dist.collectives import select
    monkeypatch.delenv("NEURON_DIST_ALGO", raising=False)
    monkeypatch.setenv("NEURON_DIST_TUNING", "host")
    g = SimpleNamespace(size=4, topology=None, frame_bytes=512 << 10,
                        transport=SimpleNamespace(name="shm", oversubscribed=oversubscribed))
    for nbytes in (4 << 10, select.HOST_FLAT_BROADCAST_BYTES, select.HOST_FLAT_BROADCAST_BYTES + 4, 64 << 20):
        big = nbytes > select.HOST_FLAT_BROADCAST_BYTES
        assert select.choose("broadcast", nbytes, g) == ("tree" if big and not oversubscribed else "direct")
    g.transport = SimpleNamespace(name="zmq")  # off shared memory the host rule does not apply
    assert select._host_memory_choice("broadcast", 64 << 20, g) is None
