"""A rank that never arrives: a time-out error that lists who had not entered and what each
rank last ran (cases_hang.py)."""
import pytest


@pytest.mark.parametrize("world", (2, 3))
def test_absent_rank_is_named(pools, world):
    assert all(pools(world).run("cases_hang:absent_rank"))


@pytest.mark.parametrize("world", (2,))
def test_dump_on_failure_and_on_signal(pools, world):
    assert all(pools(world).run("cases_hang:dumps"))


@pytest.mark.parametrize("world", (2,))
def test_a_rank_cut_off_from_the_store_still_fails_at_its_time_out(pools, world):
    assert all(pools(world).run("cases_hang:unreachable_store"))
