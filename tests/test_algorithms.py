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


def test_a_changed_tuning_policy_takes_effect_at_once(monkeypatch):
    """select.choose: a changed NEURON_DIST_TUNING takes effect at the next call. The choice is
    cached per group, policy and size; without the policy in the second cache's key, a size
    chosen under the model policy kept the model's pick under the host policy (review AR: S06).
    A stand-in group without a placement, on shared memory: the model policy's size rule
    broadcasts down the tree, the host policy from the root directly up to 1 MiB."""
    from types import SimpleNamespace

    from neuron_dist.collectives import select
    monkeypatch.delenv("NEURON_DIST_ALGO", raising=False)
    g = SimpleNamespace(size=4, topology=None, frame_bytes=512 << 10,
                        transport=SimpleNamespace(name="shm", oversubscribed=False))
    for policy, want in (("model", "tree"), ("host", "direct"), ("model", "tree")):
        monkeypatch.setenv("NEURON_DIST_TUNING", policy)
        assert select.choose("broadcast", 4 << 10, g) == want, policy


def test_a_registered_builder_the_model_prices_joins_a_choice_already_made(monkeypatch):
    """algorithms.register: a name the cost model prices joins the model policy's choice, also
    for sizes a group has already chosen for (each cache is keyed by the builders' generation;
    review AR: S05, the first cache without it kept the old pick). A ring broadcast, which the
    model prices cheapest from 1 MiB on 8 ranks of one trn2 chip set but the backend does not
    build, registered between two choices of the same size."""
    from types import SimpleNamespace

    from neuron_dist.collectives import algorithms, direct, select
    from neuron_dist.topology import place
    monkeypatch.delenv("NEURON_DIST_ALGO", raising=False)
    monkeypatch.setenv("NEURON_DIST_TUNING", "model")
    g = SimpleNamespace(size=8, topology=place("trn2", 1, 8), transport=None, frame_bytes=512 << 10)
    assert select.choose("broadcast", 1 << 20, g) == "direct"
    key = ("broadcast", "ring")
    assert key not in algorithms.BUILDERS
    try:
        algorithms.register("broadcast", "ring", lambda s: direct.broadcast(s.rank, s.size, s.root, s.count))
        assert select.choose("broadcast", 1 << 20, g) == "ring"
    finally:
        with algorithms._LOCK:
            algorithms.BUILDERS.pop(key, None)
            algorithms._UNPROMISED.discard(key)
            algorithms.GENERATION += 1
    assert select.choose("broadcast", 1 << 20, g) == "direct"
