"""The fork server that starts the rank scripts of test_faults.py, test_lifecycle.py and
test_init_methods.py (tests/forkserver.py): a rank starts and ends as a fresh `python -c` would,
and what the tests read of a job is what run_scripts would give: each rank's exit status and
output, the ranks reaped in order (an ended rank's pid kept while the ranks before it run), a job
that ends with its first rank (first_only), one whose ranks still running at its time-out are
killed, never left behind."""
import json
import os
import subprocess

import pytest

from forkserver import run_forked, start_forked

# rank 1 sleeps until it is killed (its job's time-out, or first_only once rank 0 has ended)
_RANK_1_SLEEPS = "import sys, time\nprint('rank', sys.argv[1], flush=True)\nif sys.argv[1] == '1': time.sleep(300)\n"


def test_a_rank_starts_and_ends_as_a_fresh_python_does(tmp_path):
    """Its argv, environment, working directory and sys.path[0] are the script's; neuron_dist is
    not imported before the script's own code (which may register an exit hook that must run
    after neuron_dist's); an uncaught exception prints its traceback, sets sys.last_value for the
    exit hooks and exits 1; sys.exit(3) exits 3."""
    code = ("import atexit, json, os, sys\n"
            "atexit.register(lambda: print('at exit:', repr(getattr(sys, 'last_value', None)), flush=True))\n"
            "print(json.dumps([sys.argv, os.getcwd(), sys.path[0], os.environ.get('FORKED_MARK'),\n"
            "                  'neuron_dist' in sys.modules]), flush=True)\n"
            "if sys.argv[1] == '1': sys.exit(3)\n"
            "raise ValueError('the root cause')\n")
    env = dict(os.environ, FORKED_MARK="marked")
    (code0, out0, err0), (code1, out1, _) = run_forked(None, [[0, "x"], [1, "x"]], env, timeout=60, code=code,
                                                        split=True, cwd=tmp_path)
    assert json.loads(out0.splitlines()[0]) == [["-c", "0", "x"], str(tmp_path), "", "marked", False], out0
    assert code0 == 1 and "Traceback (most recent call last)" in err0 and "ValueError: the root cause" in err0, \
        (code0, err0[-2000:])
    assert out0.splitlines()[1] == "at exit: ValueError('the root cause')", out0
    assert code1 == 3 and out1.splitlines()[1] == "at exit: None", (code1, out1)


def test_a_rank_that_ended_stays_a_zombie_while_the_ranks_before_it_run(tmp_path):
    """Ranks are reaped in order, as run_scripts's communicate() rank by rank reaps them, so an
    ended rank's pid stays taken while an earlier rank may still open it (raises_uncaught.py's
    rank 0 opens rank 1's pidfd once rank 1 has ended). Rank 1 hands rank 0 its pid through a
    FIFO and exits; rank 0 waits for its end, then looks half a second later (not a
    synchronisation: the window in which a reaper that reaps ranks as they end, every 20 ms,
    would show) whether the pid is still rank 1's, a zombie's."""
    code = ("import os, select, signal, sys, time\n"
            "if sys.argv[1] == '1':\n"
            "    with open(sys.argv[2], 'w') as f: f.write(str(os.getpid()))\n"
            "    sys.exit(0)\n"
            "with open(sys.argv[2]) as f: ended = os.pidfd_open(int(f.read()))  # readable once rank 1 has ended\n"
            "select.select([ended], [], [])\n"
            "time.sleep(0.5)\n"
            "signal.pidfd_send_signal(ended, 0)  # ProcessLookupError once rank 1 is reaped\n"
            "print('rank 1 ended, not reaped', flush=True)\n")
    fifo = tmp_path / "rank1_pid"
    os.mkfifo(fifo)
    (code0, out0), (code1, _) = run_forked(None, [[0, fifo], [1, fifo]], timeout=60, code=code)
    assert (code0, out0, code1) == (0, "rank 1 ended, not reaped\n", 0), (code0, out0[-2000:], code1)


def test_first_only_ends_the_job_once_its_first_rank_has_ended():
    """The other ranks, still running, are killed then (not waited for)."""
    (code0, out0), (code1, _) = run_forked(None, [[0], [1]], timeout=60, code=_RANK_1_SLEEPS, first_only=True)
    assert (code0, out0, code1) == (0, "rank 0\n", -9), (code0, out0, code1)


def test_a_rank_still_running_at_the_time_out_is_killed_and_the_wait_fails():
    """As run_scripts's wait: the job's ranks still running are killed, never left behind, and
    the wait raises with each rank's status and output."""
    job = start_forked(None, [[0], [1]], code=_RANK_1_SLEEPS)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        job.wait(timeout=3)
    assert "--- rank 1: status -9" in timed_out.value.output, timed_out.value.output
    with pytest.raises(ProcessLookupError):
        os.kill(job.pids[1], 0)  # killed and reaped
