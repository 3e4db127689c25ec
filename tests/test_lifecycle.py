"""destroy_process_group, abort and re-init in one process release threads, descriptors and
shared memory, and subgroups go down with their parent (tests/scripts/lifecycle.py)."""
import json
import os
import re
import time
import types

import pytest
import forkserver
from pool import free_port, rank_line

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "lifecycle.py")


def run_scripts(script, argvs, env=None, timeout=120):
    """pool.run_scripts, each rank forked from the fork server."""
    return forkserver.run_forked(script, argvs, env, timeout)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("world", [2, 3])
def test_lifecycle(transport, world, tmp_path):
    env = dict(os.environ, NEURON_DIST_TRANSPORT=transport)
    for r, (code, out) in enumerate(run_scripts("lifecycle.py", [[r, world, tmp_path] for r in range(world)], env)):
        assert code == 0 and f"rank {r}: lifecycle ok" in out, out[-3000:]


def test_exit_with_the_group_open_and_work_in_flight():
    """A process that exits without destroy_process_group, async collectives still running on
    the engine threads, ends with its own status, not SIGABRT from torch's C++ at finalization.
    One engine is kept inside torch's copies as the process exits (exit_open.py): without the
    exit hook (`_close_at_exit`) every run tried aborted, forked or started afresh. With only the
    never-joined all-reduce, whose engine sleeps in its transport's wait, the fork server's runs
    passed without the hook too (about half the fresh ones aborted)."""
    from pool import free_port
    for run in range(4):
        port = free_port()
        for r, (code, out) in enumerate(run_scripts("exit_open.py", [[0, port], [1, port]])):
            assert code == 0 and f"rank {r}: leaving" in out, f"run {run}, rank {r}: status {code}\n{out[-2000:]}"
            assert "terminate called" not in out, out[-2000:]


def test_an_op_a_destroy_outwaited_says_the_group_was_destroyed():
    """An all-reduce whose own time-out (30 s) outlasts the group's (2 s) is still running when
    destroy_process_group gives up on it: it failed with "the process group was aborted", a call
    the program never made. It says the group was destroyed while it ran, and how long the
    destroy waited."""
    port = free_port()
    (_, out0), (code1, out1) = run_scripts("destroy_outwaited.py", [[0, port], [1, port]], timeout=60)
    line = rank_line(out0, 0)
    assert line.startswith("rank 0: GroupError: [rank 0] allreduce") and line.endswith(
        "[rank 0] the process group was destroyed while this op ran (destroy_process_group waited 2.5s for it)"), \
        out0[-2000:]
    assert code1 == 0 and "rank 1: leaving" in out1, out1[-2000:]


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("op", ["isend", "allreduce"])
def test_an_op_a_destroy_gave_up_on_fails_on_the_peer_too_naming_the_rank(transport, op):
    """Rank 0's destroy_process_group gives up (group time-out) on an op its peer has not joined
    yet, fails its Work, and rank 0 reuses the tensor (7.0 where it sent 1.0); rank 1 joins
    after that. Either the op completed on both ranks with rank 0's data (an eager zmq send), or
    rank 1's side fails naming rank 0. Before, over shared memory, rank 1 silently completed:
    its all_reduce with rank 0's frame (rank 0 never told it of the failure), its receive of the
    lent 16 MiB with rank 0's later 7.0."""
    port = free_port()
    env = dict(os.environ, NEURON_DIST_TRANSPORT=transport)
    (_, out0), (_, out1) = run_scripts("destroy_gives_up.py", [[0, port, op], [1, port, op]], env, timeout=60)
    sender, receiver = rank_line(out0, 0), rank_line(out1, 1)
    if sender == "rank 0: the op completed":
        assert receiver == "rank 1: got [1.0]", (sender, receiver)
    else:
        assert sender.startswith("rank 0: GroupError"), out0[-2000:]
        assert re.match(r"rank 1: GroupError: .* rank 0 (aborted the group|is gone)", receiver), (sender, receiver)


def test_ctrl_c_in_a_collective_is_a_keyboard_interrupt():
    """SIGINT while a rank is inside a collective (a 16 MiB all-reduce in a loop: nearly all the
    time is spent inside one) reaches the caller as KeyboardInterrupt; it used to come out as a
    backend error whose cause read empty ("... failed: "). The peer fails naming the rank."""
    import signal
    import time
    from pool import free_port
    port = str(free_port())
    job, outs = forkserver.start_forked("interrupt.py", [[0, port], [1, port]]), None
    try:
        deadline = time.monotonic() + 180
        while "\n" not in job.out(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        first = job.out(0).split("\n")[0]
        assert "rank 0: looping" in first, job.out(0)[-2000:]
        time.sleep(0.2)
        os.kill(job.pids[0], signal.SIGINT)
        outs = [out for _, out in job.wait(120)]
    finally:
        if not job.reaped:  # a failed check must not leave the ranks all-reducing on
            for pid in job.pids:
                os.kill(pid, signal.SIGKILL)
            job.wait(60)
    assert "rank 0: KeyboardInterrupt" in outs[0], outs[0][-2000:]
    assert "rank 1: GroupError: [rank 1] allreduce" in outs[1] and "rank 0" in outs[1], outs[1][-2000:]
    assert "failed: \n" not in outs[1] and not outs[1].rstrip().endswith("failed:"), outs[1][-2000:]


def test_a_signal_handlers_exception_in_a_call_reaches_its_caller():
    """A SIGALRM handler's own exception raised inside a synchronous collective reached the
    caller as a GroupError ("... failed: time limit"), which its `except Alarm` missed; Gloo's
    call raises the handler's exception. Now the caller gets its own exception; the call (stopped
    at an arbitrary point) is failed, and the peer fails naming the cause."""
    from pool import free_port
    port = str(free_port())
    outs = [out for _, out in run_scripts("alarm_in_call.py", [[0, port], [1, port]])]
    assert "rank 0: Alarm: time limit" in outs[0], outs[0][-2000:]
    assert "rank 1: GroupError: [rank 1] allreduce" in outs[1] and "rank 0" in outs[1] and \
        "signal handler's Alarm (time limit)" in outs[1], outs[1][-2000:]


def test_kept_scratch_buffers_go_with_their_group(pools):
    assert all(n > 0 for n in pools(3).run("cases_faults:scratch_freed"))


def test_a_closed_group_drops_its_buffers_while_its_object_is_kept(pools):
    assert pools(2).run("cases_faults:closed_group_drops_its_buffers") == [1, 1]


def test_a_destroy_waits_for_a_call_another_thread_runs(pools):
    """destroy_process_group on one thread while another is inside a synchronous all-reduce of
    the same group (on its own thread, the peers late): the call completes, exactly."""
    assert pools(2).run("cases_faults:destroy_beside_a_running_call") == ["ok", "ok"]


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_forked_child_that_destroys_and_exits_leaves_the_parents_groups_alone(transport, tmp_path):
    env = dict(os.environ, NEURON_DIST_TRANSPORT=transport)
    for r, (code, out) in enumerate(run_scripts("fork_child.py", [[r, 2, tmp_path / "store"] for r in range(2)], env)):
        assert code == 0 and f"rank {r}: fork ok" in out and "child" not in out, out[-3000:]


class _FakeOp(types.SimpleNamespace):
    """What the waiting room reads of an op (waiting.Waiting), compared and hashed by identity."""
    __eq__, __hash__ = object.__eq__, object.__hash__
    exe, finished, posted = None, False, 0


def test_waiting_ops_start_in_order_per_kind():
    """The engine's waiting room: collectives one at a time in sequence order, point-to-point ops
    one per (direction, peer, tag) at a time in issue order, beside the collectives (a receive
    of another tag from the same peer starts at once); held per kind so an engine pass does not
    scan every waiting op (8,000 outstanding all-reduces took 37 s)."""
    from neuron_dist.waiting import Waiting
    Op = _FakeOp
    ops = [Op(name=f"c{i}", is_p2p=False, direction="", peer=None, tag=0) for i in range(3)]
    ops += [Op(name=f"s1.{i}", is_p2p=True, direction="send", peer=1, tag=0) for i in range(2)]
    ops += [Op(name="r1", is_p2p=True, direction="recv", peer=1, tag=0), Op(name="s2", is_p2p=True, direction="send",
                                                                            peer=2, tag=0),
            Op(name="any", is_p2p=True, direction="recv-any", peer=None, tag=1),
            Op(name="r1.t5", is_p2p=True, direction="recv", peer=1, tag=5),
            Op(name="r1.t0", is_p2p=True, direction="recv", peer=1, tag=0)]
    w = Waiting()
    w.extend(ops)
    assert len(w) == 10 and [o.name for o in w] == ["c0", "c1", "c2", "s1.0", "s1.1", "r1", "r1.t0", "s2", "any",
                                                    "r1.t5"]
    active = []
    w.admit(active)
    assert [o.name for o in active] == ["c0", "s1.0", "r1", "s2", "any", "r1.t5"] and len(w) == 4
    w.admit(active)  # nothing of a running kind starts
    assert len(active) == 6
    active = [o for o in active if o.name not in ("c0", "s1.0", "r1")]
    w.admit(active)
    assert [o.name for o in active][-3:] == ["c1", "s1.1", "r1.t0"] and len(w) == 1
    w.clear()
    assert not w and list(w) == []


def test_receives_of_one_tag_start_in_the_order_posted():
    """MPI's matching rule in the waiting room (waiting.Waiting): a receive from rank 1 posted after
    one from any source waits until that one has matched a message from another peer (or is
    done); an any-source receive posted after one from rank 1 starts, but leaves rank 1 alone."""
    from types import SimpleNamespace
    from neuron_dist.waiting import Waiting

    def recv(name, peer, tag=3):
        return _FakeOp(name=name, is_p2p=True, direction="recv" if peer is not None else "recv-any", peer=peer, tag=tag)
    w, active = Waiting(), []
    first, spec, other = recv("any", None), recv("from1", 1), recv("from1.t4", 1, tag=4)
    w.extend([first, spec, other], active)
    w.admit(active)
    assert [o.name for o in active] == ["any", "from1.t4"], "a receive from 1 started beside an unmatched any-source"
    first.exe = SimpleNamespace(peer=1)  # matched rank 1's message: its rest is the any-source receive's
    w.admit(active)
    assert spec not in active
    first.finished = True
    w.admit(active)
    assert spec in active
    late = recv("any.late", None)
    w.extend([late], active)
    w.admit(active)
    assert late in active and w.barred(late) == {1}, w.barred(late)
    spec.finished = True
    assert w.barred(late) == set()


def test_an_any_source_receive_is_held_back_only_by_receives_of_its_own_tag():
    """MPI's matching rule orders the receives of one tag only: an any-source receive of tag 3
    posted after receives of tag 4 (one from rank 1 running, one from rank 2 waiting) may take
    a message of tag 3 from either rank at once. Barred from them, it would wait for their
    messages (an exchange whose tag-4 sends come after the tag-3 reply would deadlock); a
    receive of its own tag posted before it does bar its peer."""
    from neuron_dist.waiting import Waiting

    def recv(name, peer, tag):
        return _FakeOp(name=name, is_p2p=True, direction="recv" if peer is not None else "recv-any", peer=peer, tag=tag)
    w, active = Waiting(), []
    running = recv("from1.t4", 1, 4)
    w.extend([running], active)
    w.admit(active)
    assert active == [running]
    waiting, any3 = recv("from2.t4", 2, 4), recv("any.t3", None, 3)
    w.extend([recv("from2.t4.first", 2, 4), waiting, any3], active)
    assert w.barred(any3) == set(), w.barred(any3)
    w.admit(active)
    assert any3 in active
    first, any3b = recv("from2.t3", 2, 3), recv("any.t3.b", None, 3)
    w.extend([first, any3b], active)
    assert w.barred(any3b) - {None} == {2}, w.barred(any3b)  # rank 2's tag-3 receive (None: any3, unmatched)


def test_report_counts_stay_bounded_and_exact(pools):
    assert all(n > 0 for n in pools(2).run("cases_faults:stats_bounded"))


def test_a_schedule_two_groups_share_is_planned_per_group(pools):
    assert pools(2).run("cases_faults:one_schedule_for_two_groups", timeout=120) == [[True, True, True]] * 2


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_the_names_other_local_users_can_list_hold_nothing_of_the_job_token(pools, transport):
    for r in pools(2).run("cases_faults:names_give_nothing_of_the_token_away", transport=transport):
        assert r["seen"] >= 1 and r["leaks"] == [], r


@pytest.mark.parametrize("mode, want", [("solo", [[3.0] * 3, [3.0] * 3]),
                                        ("subgroup", [[1.0] * 3, [5.0] * 3, [5.0] * 3]),
                                        ("samestore", [[4.0] * 3, [2.0] * 3, [4.0] * 3]),
                                        ("samestore-failed", [[3.0] * 3] * 3),
                                        ("samestore-then-gloo", [[4.0] * 3, [2.0] * 3, [4.0] * 3])])
def test_worlds_after_worlds_form_whatever_each_process_did_before(mode, want):
    """A new world on a fresh store forms, and its subgroups with it, whatever groups each
    process made before (a review's probe: Gloo formed these; the neuron groups waited out the
    time-out, blaming a member that 'did not join'); on the same store too, where torch gives
    the second world's subgroup of other members the first one's name (review Y)."""
    ports = ",".join(str(free_port()) for _ in range(3))
    n = len(want)
    for proc, (code, out) in enumerate(run_scripts("reinit_with_other_pasts.py", [[p, n, ports, mode] for p in range(n)],
                                                   timeout=90)):
        assert code == 0, out[-3000:]
        x = json.loads(out.strip().splitlines()[-1])
        rank = n - 1 - proc if mode == "solo" else proc
        assert x["kind"] == "ok" and x["values"] == want[rank], x
        assert x["elapsed"] < 6, x


def test_groups_made_again_and_again_leave_few_keys_in_the_store():
    """Each group's set-up records (the token, every rank's peer, addr and transport records) are
    deleted once every member's transport is up: 1,000 two-rank subgroups made and destroyed
    left 12 keys each in the store (13 MB in its process; Gloo's 2), review AC. What stays per
    group: its members' lists and the count of its name's generations (and a progress record
    per member once a heartbeat has passed)."""
    port = free_port()
    outs = run_scripts("store_keys.py", [[r, port, 20] for r in range(2)], timeout=120)
    for code, out in outs:
        assert code == 0, out[-3000:]
    x = json.loads(outs[0][1].strip().splitlines()[-1])
    assert (x["after"] - x["before"]) / x["cycles"] <= 4, x


def test_a_failed_group_is_freed_at_its_destroy():
    """A group whose call failed (its peer aborted) was kept alive past its destroy, store and
    all, until the cyclic collector ran: its error's traceback held the engine's frame, still
    running when the error was first cleared (review AD). The destroy clears it again once the
    engine has ended."""
    port = free_port()
    outs = run_scripts("failed_group_freed.py", [[r, port] for r in range(2)], timeout=120)
    for code, out in outs:
        assert code == 0, out[-3000:]
    x = json.loads(outs[0][1].strip().splitlines()[-1])
    assert "aborted the group" in x["failed"] and x["alive"] is False, x


def test_a_subgroup_forms_after_one_rank_aborted_the_world():
    """Rank 1 aborts the world's group; both ranks then make a subgroup, as under Gloo. The
    aborting rank forgot the world's id at its abort while its peer's copy kept it, so they
    posted their member lists under different scopes and each waited out the time-out blaming
    the other (review AF): the id now goes when the world is destroyed, not at an abort."""
    port = free_port()
    for code, out in run_scripts("abort_then_subgroup.py", [[r, port] for r in range(2)], timeout=120):
        assert code == 0, out[-3000:]
        x = json.loads(out.strip().splitlines()[-1])
        assert x["res"] == ["ok", [2.0] * 4] and x["took"] < 6, x


def test_a_forked_child_forgets_its_parents_world():
    """A forked child's subgroups belong to a world of its own: it kept the parent's world id,
    so its neuron subgroups in a later world met under the parent's scope and waited out the
    time-out for peers that posted under their own (review AD)."""
    code = ("import os, torch.distributed as dist, neuron_dist\n"
            "from neuron_dist import meeting\n"
            f"dist.init_process_group('neuron', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
            "assert meeting.WORLD['id']\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0 if meeting.WORLD['id'] is None else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print('child', os.waitstatus_to_exitcode(status))\n"
            "dist.destroy_process_group()\n"
            "print('after destroy', meeting.WORLD['id'])\n")
    [(returncode, stdout, stderr)] = forkserver.run_forked(None, [[]], timeout=120, code=code, split=True)
    assert returncode == 0 and "child 0" in stdout and "after destroy None" in stdout, stdout + stderr[-2000:]


def test_a_callback_waiting_on_another_finds_a_thread_for_it():
    """Two ops finishing in one engine pass with one idle callback thread: the runner started no
    thread for the second job (the idle one, told of the first, had not woken yet), so both ran
    on it, and a `then` callback that waited on the second op's future (Work.wait() waits for
    it now) waited for ever behind itself (a review's probe: 7 of 10 callbacks). A job queued
    beyond the idle threads now starts one."""
    import threading

    from neuron_dist.op import CallbackRunner

    runner, second_ran, waited = CallbackRunner("pair"), threading.Event(), []
    runner.submit(lambda _: None, None)  # one thread, idle once it has run this
    deadline = time.monotonic() + 5
    while runner._idle != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with runner._cv:  # both submitted before the idle thread can wake (the condition's lock is held)
        runner.submit(lambda _: waited.append(second_ran.wait(5)), None)
        runner.submit(lambda _: second_ran.set(), None)
    deadline = time.monotonic() + 10
    while not waited and time.monotonic() < deadline:
        time.sleep(0.01)
    runner.close(timeout=1)
    assert waited == [True] and len(runner._threads) == 2, (waited, len(runner._threads))


def test_a_destroy_waits_for_callbacks_stuck_in_user_code_once_not_per_thread():
    """Threads stuck in a user's future callback (each blocked callback holds one, up to 8) are
    joined within one deadline at close: a join of its own for each made a destroy_process_group
    wait 5 s per such thread (15 s with three)."""
    import threading
    import time

    from neuron_dist.op import CallbackRunner

    runner, release = CallbackRunner("stuck"), threading.Event()
    for _ in range(4):  # each finds the others busy: four threads
        runner.submit(lambda _: release.wait(30), None)
    time.sleep(0.2)
    t0 = time.monotonic()
    runner.close(timeout=0.5)
    took = time.monotonic() - t0
    release.set()
    assert len(runner._threads) == 4 and took < 1.2, f"close took {took:.2f}s for {len(runner._threads)} threads"


def test_running_out_of_descriptors_is_a_clear_error():
    """Groups made until the process's descriptor limit runs out: the set-up that hits it fails
    naming the rank, the group and the limit, on both ranks (it failed with whatever call ran
    out first: an import's OSError, zmq's "Authenticator thread failed to start")."""
    port = free_port()
    for rank, (code, out) in enumerate(run_scripts("descriptor_limit.py", [[r, port] for r in range(2)], timeout=150)):
        x = json.loads(out.strip().splitlines()[-1])
        assert x["made"] > 5 and "ulimit -n 256" in x["error"] and "raise the limit" in x["error"], x
        assert f"rank {rank}" in x["error"] and "Enlarge /dev/shm" not in x["error"], x

