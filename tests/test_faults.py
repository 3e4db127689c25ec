"""Fault matrix: a rank is SIGKILLed before, during (mid-transfer of a large message) or after a
collective; every survivor must raise a DistBackendError naming the dead rank, the collective and
its sequence number within the group's timeout plus a margin, exit cleanly, and hold no socket,
fd, thread or child process after destroy_process_group (cases_faults.py has the harness).

Default run: a short form (every collective killed mid-transfer at 4 ranks on the default
transport, plus before/after at 2 ranks). `pytest -m slow tests/test_faults.py`: the whole
matrix (7 collectives x 2 and 4 ranks x before/during/after) on the default transport and on zmq.
Standalone with a summary line: `python tests/cases_faults.py [zmq|shm]`.
"""
import pytest

import cases_faults as cf

TIMEOUT, MARGIN = 10.0, 5.0


def _check(world, coll, phase, env=None):
    out = cf.run_fault_case(world, coll, phase, TIMEOUT, MARGIN, env=env)
    problems = cf.judge(world, coll, phase, out, TIMEOUT, MARGIN)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("coll", cf.COLLECTIVES)
def test_killed_mid_transfer(coll):
    _check(4, coll, "during")


@pytest.mark.parametrize("phase", ["before", "after"])
@pytest.mark.parametrize("coll", ["allreduce", "sendrecv"])
def test_killed_between_collectives(coll, phase):
    _check(2, coll, phase)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["default", "zmq"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("phase", cf.PHASES)
@pytest.mark.parametrize("coll", cf.COLLECTIVES)
def test_fault_matrix(coll, phase, world, transport):
    _check(world, coll, phase, env=None if transport == "default" else {"NEURON_DIST_TRANSPORT": transport})


@pytest.mark.parametrize("phase", ["before", "after"])
def test_broadcast_ranks_off_the_dead_ranks_branch_still_raise(phase):
    """The root and the ranks whose tree never touches the dead rank fail at the collective's
    start too (the death watch), not only the dead rank's own branch."""
    _check(4, "broadcast", phase)
