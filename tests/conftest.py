import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pool import Pool  # noqa: E402

_POOLS: dict = {}


@pytest.fixture(scope="session")
def pools():
    """pools(world) -> a running Pool of that many ranks, started once per session."""
    def get(world: int) -> Pool:
        if world not in _POOLS:
            _POOLS[world] = Pool(world)
        return _POOLS[world]
    yield get
    for p in _POOLS.values():
        p.stop()
    for p in _POOLS.values():
        p.join()
    _POOLS.clear()
