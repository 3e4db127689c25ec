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


def test_failure_names_the_member_that_went_first():
    """A rank that fails on another's death closes next; when its close is all this rank has
    seen of it (its ABORT frame not yet read, as over TCP it can trail the close), the error must
    still name the member seen gone first, and a member that closed in order is not blamed."""
    import time
    from collections import deque
    from datetime import timedelta
    from types import SimpleNamespace

    from neuron_dist.group import PEER_GRACE_S, Group

    gone, finished = {}, set()
    g = Group.__new__(Group)  # only the failure path: a fake transport, no frames at all
    g.rank, g.size, g.global_ranks, g.timeout = 0, 4, [0, 1, 2, 3], timedelta(seconds=60)
    g.transport = SimpleNamespace(check_peer=gone.get, peer_finished=lambda p: p in finished)
    g.mailbox = SimpleNamespace(take=lambda p, key: None)
    errors = []
    g._fail = lambda op, e, active, waiting: errors.append(str(e))

    def stalled_until_failure(op):
        g._gone_seen, g._next_sweep, errors[:] = {}, 0.0, []
        gone.clear()
        gone[1] = "connection to rank 1 closed (process exited or crashed)"
        g._check_stalled([op], deque())  # waits on rank 2, alive: only notes rank 1
        time.sleep(0.06)
        gone[2] = "connection to rank 2 closed (process exited or crashed)"
        deadline = time.monotonic() + PEER_GRACE_S + 2
        while not errors and time.monotonic() < deadline:
            g._check_stalled([op], deque())
            time.sleep(0.02)
        assert errors, "the stalled collective never failed"
        return errors[0]

    def op():
        return SimpleNamespace(desc="reduce_scatter_tensor(8 MiB)", seq=0, is_p2p=False, t0=time.monotonic(),
                               exe=SimpleNamespace(waiting_on=2, sends=()))

    msg = stalled_until_failure(op())
    assert "rank 1 is gone: connection to rank 1 closed" in msg and "then rank 2" in msg, msg
    finished.add(1)  # rank 1 left in order (destroy_process_group): rank 2 is the one to name
    msg = stalled_until_failure(op())
    assert "rank 2 is gone" in msg and "rank 1" not in msg, msg
