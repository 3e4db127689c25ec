"""Every registered schedule, forced, on real processes (the simulator checks them for
1..128 ranks in tests/test_schedules_topology.py; this runs them over the real transports)."""
import pytest


@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("case", ["every_algorithm", "two_node_placement", "forced_unknown", "model_policy",
                                  "host_policy"])
def test_algorithms(pools, case, world):
    assert all(pools(world).run(f"cases_algorithms:{case}"))
