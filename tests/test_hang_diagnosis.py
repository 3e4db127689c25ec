"""A rank that never arrives: a time-out error that lists who had not entered and what each
rank last ran (cases_hang.py)."""
import pytest


def _diagnosing(size, records, peer_records):
    """A stand-in group for `HangDiagnosis`: rank 0 of `size`, its own calls' `records` (their
    count its sequence), and `peer_records()` what its peers' progress records read."""
    from types import SimpleNamespace
    from neuron_dist.diagnosis import HangDiagnosis

    class Group(HangDiagnosis):
        rank, broken = 0, None

        def who(self, r):
            return f"rank {r}"

        def _peer_records(self):
            return peer_records(), [], ""

    g = Group()
    g.size, g.records, g._seq = size, records, len(records)
    g._calls, g.mailbox = len(records), SimpleNamespace(early={}, held={})
    return g


@pytest.mark.parametrize("world", (2, 3))
def test_absent_rank_is_named(pools, world):
    assert all(pools(world).run("cases_hang:absent_rank"))


def test_absent_rank_of_a_subgroup_is_named_with_its_global_rank(pools):
    assert all(pools(3).run("cases_hang:absent_rank_in_a_subgroup"))


@pytest.mark.parametrize("world", (2, 3))
def test_absent_rank_is_named_by_the_users_call_under_the_debug_check(pools, world):
    assert all(pools(world).run("cases_hang:absent_rank_under_the_check"))


@pytest.mark.parametrize("world", (2,))
def test_a_frozen_rank_is_not_said_to_have_skipped_the_call(pools, world):
    assert all(pools(world).run("cases_hang:frozen_rank"))

@pytest.mark.parametrize("world", (2,))
def test_dump_on_failure_and_on_signal(pools, world):
    assert all(pools(world).run("cases_hang:dumps"))


@pytest.mark.parametrize("world", (2,))
def test_a_rank_cut_off_from_the_store_still_fails_at_its_time_out(pools, world):
    assert all(pools(world).run("cases_hang:unreachable_store"))


def test_a_forked_child_does_not_inherit_an_unanswered_store_call():
    """A store call outstanding in the parent (a failure behind a partition) has no thread in a
    forked child: the child must not refuse its own store calls forever because of it."""
    import os
    from neuron_dist import diagnosis
    diagnosis._stuck[-1] = "the progress records"
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not diagnosis._stuck and diagnosis.bounded_store_call(lambda: 7, "x") == 7 else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        diagnosis._stuck.clear()


@pytest.mark.parametrize("world", (2,))
def test_a_slow_store_still_gives_the_diagnosis(pools, world):
    assert all(pools(world).run("cases_hang:slow_store"))


@pytest.mark.parametrize("world", (2,))
def test_groups_failing_together_each_get_their_diagnosis(pools, world):
    assert all(pools(world).run("cases_hang:groups_fail_together"))


def test_the_dump_signals_handler_never_raises_nor_nests(monkeypatch):
    """The dump signal's handler runs between two bytecodes of whatever the main thread does (a
    collective): under a storm of signals the dumps nested until a RecursionError escaped into the
    collective and broke the group. Now nothing escapes it, and a signal during a dump is dropped."""
    from neuron_dist import diagnosis
    written = []

    def dump_all():  # a second signal arrives while the first dump is being written
        diagnosis._dump_on_signal("stderr")
        return "dump"
    monkeypatch.setattr(diagnosis, "dump_all", dump_all)
    monkeypatch.setattr(diagnosis, "emit", lambda text, where: written.append(text))
    diagnosis._dump_on_signal("stderr")
    assert written == ["dump\n"], written

    def failing(text, where):
        raise RuntimeError("the terminal went away")
    monkeypatch.setattr(diagnosis, "emit", failing)
    diagnosis._dump_on_signal("stderr")  # no exception


def test_a_time_out_names_ranks_that_run_one_call_by_different_algorithms():
    """Ranks whose algorithm choice for one call differs (a NEURON_DIST_ALGO changed on some
    ranks mid-job, to a schedule with other peers) wait for frames that never come: the
    time-out's diagnosis names each rank's algorithm from the progress records."""
    from types import SimpleNamespace
    from neuron_dist.op import Record
    from neuron_dist.transport.frame import Kind

    def record(algorithm):
        return {"issued": 1, "recent": [[0, "allreduce", 20, "float32", "running", algorithm]], "broken": None}

    g = _diagnosing(3, [Record(0, "allreduce", 20, "float32", "ring", "running", call=0)],
                    lambda: {1: record("ring"), 2: record(other)})
    op = SimpleNamespace(seq=0, call=0, checks="", checked=False, is_p2p=False, kind=Kind.ALLREDUCE)
    other = "hierarchical"
    said = g.diagnose(op)
    assert "different algorithms (rank 0: ring, rank 1: ring, rank 2: hierarchical)" in said, said
    assert "Rank 2 last ran: #0 allreduce 20B running (hierarchical)" in said, said
    said = g.timeout_diagnosis(op)  # the algorithms, not a slow link, are the cause
    assert "different algorithms" in said and "it had not finished" not in said, said
    other = "ring"
    assert "different algorithms" not in g.diagnose(op)


def test_a_lost_store_is_left_alone_after_its_first_failed_call():
    """Rank 0's process hosts the store; once it has gone, each store call of a failing rank
    (its progress record after every failed call) printed torch's C++ "sendBytes failed" trace,
    ~20 lines each, burying the group's own error (9 traces for 4 failed calls). One failed call
    now marks the store lost and no more are made."""
    from pool import free_port, run_scripts
    port = free_port()
    (_, out0), (code, out) = run_scripts("store_host_gone.py", [[0, port], [1, port]])
    assert code == 0 and all(f"rank 1: call {i}: GroupError" in out for i in range(4)), out[-3000:]
    traces = out.count("sendBytes failed") + out.count("recvBytes failed")
    assert traces <= 1, f"{traces} store traces:\n{out[-3000:]}"


def test_what_a_rank_saw_of_its_peers_outweighs_their_older_progress_records():
    """A progress record is as old as its rank's last heartbeat, and a frozen or cut-off rank
    publishes no more: a record older than calls that rank took part in is no proof it had not
    entered this one. What this rank saw counts first: frames of the timed-out call already
    received from a peer, and frames of a later call kept early. A completed broadcast proves
    nothing (its root may finish before the others enter), so a record behind it keeps the
    usual "had not entered" and its hint."""
    import time
    from types import SimpleNamespace
    from neuron_dist.op import Record
    from neuron_dist.transport.frame import Kind

    def record(issued):
        return {"issued": issued, "recent": [[0, "allreduce", 32, "float32", "done", "ring"]], "broken": None,
                "t": time.time() - 5}

    g = _diagnosing(4, [Record(0, "allreduce", 32, "float32", "ring", "done", call=0),
                        Record(1, "broadcast", 32, "float32", "ring", "done", call=1),
                        Record(2, "allreduce", 1 << 20, "float32", "ring", "running", call=2)],
                    lambda: {1: record(1), 2: record(1), 3: record(1)})
    op = SimpleNamespace(seq=2, call=2, checks="", checked=False, is_p2p=False, kind=Kind.ALLREDUCE,
                         exe=SimpleNamespace(recv_chunks={2: 3}))
    g.mailbox.early[(3, ("coll", 3))] = [(SimpleNamespace(kind=int(Kind.ALLREDUCE)), None)]
    said = g.diagnose(op)
    assert said.startswith("Ranks [1] had not entered allreduce seq 2 by their progress records"), said
    assert ("the progress records of ranks [2, 3] (the oldest " in said and "predate calls they took part in "
            "(rank 2: allreduce seq 2, rank 3: allreduce seq 3)" in said), said
    assert "ranks [0, 2, 3] had entered it." in said and "Rank 2 last ran (by that old record)" in said, said
    said = g.timeout_diagnosis(op)
    assert "Check that the processes of ranks [2, 3] still run" in said and "same order" not in said, said

    g.mailbox.early.clear()
    op.exe = None
    said = g.timeout_diagnosis(op)
    assert "Ranks [1, 2, 3] had not entered allreduce seq 2" in said and "predate" not in said, said
    # the order, or (a rank cut off from the store publishes no more: review Q cut a host's link,
    # and the ranks there, waiting in the call, "had not entered" it by their last records) a host
    assert said.endswith("calls the same collectives in the same order, or, if ranks [1, 2, 3] did call it, "
                         "that their processes still run and their hosts are reachable (a rank cut off from the "
                         "store publishes no more progress)"), said

    # no record readable here (this rank's host cut off from the store): the order is no suspect
    g._peer_records = lambda: ({}, [1, 2, 3], "the store took over 2s to give 0 of 3 records")
    said = g.timeout_diagnosis(op)
    assert "The progress of ranks [1, 2, 3] is unknown: the store took over 2s" in said and "same order" not in said
    assert said.endswith("Check that this rank reaches the group's store (MASTER_ADDR, or rank 0's host) and the "
                         "hosts of ranks [1, 2, 3], and that their processes still run"), said

    # one record read, saying "not entered", the others unreadable: this rank does reach the
    # store (it read rank 1's), so the hint is the order's, not "check that this rank reaches it"
    g._peer_records = lambda: ({1: record(1)}, [2, 3], "the store took over 2s to give 1 of 3 records")
    said = g.timeout_diagnosis(op)
    assert said.startswith("The progress of ranks [2, 3] is unknown") and "Ranks [1] had not entered" in said, said
    assert said.endswith("calls the same collectives in the same order, or, if ranks [1] did call it, that their "
                         "processes still run and their hosts are reachable (a rank cut off from the store "
                         "publishes no more progress)"), said

    # every rank in the call, by fresh records and by its frames: a large call on a slow link
    # (the time-out bounds the whole call); "the same order" would point at a bug not there
    g._peer_records = lambda: ({1: record(3), 2: record(3), 3: record(3)}, [], "")
    op.exe = SimpleNamespace(recv_chunks={1: 2, 2: 1, 3: 0})
    said = g.timeout_diagnosis(op)
    assert said.startswith("Ranks [0, 1, 2, 3] had entered it.") and "same order" not in said, said
    assert "Every rank had entered it and it had not finished (this rank had received 3 of its frames)" in said, said


def test_a_timed_out_send_or_receive_is_told_to_check_its_peers_matching_call():
    """A send or receive that times out ended with the collectives' hint ("Check that every rank
    of the group calls the same collectives in the same order"), which points at the wrong
    thing: what to check is that the peer posts the matching receive or send, with the call's
    tag and a fitting size (and does not block first on this rank), naming global ranks in a
    subgroup as the error's other words do."""
    from types import SimpleNamespace
    import torch
    from neuron_dist.diagnosis import HangDiagnosis
    from neuron_dist.op import Record
    from neuron_dist.transport.frame import Kind

    class Group(HangDiagnosis):
        rank, size, _seq, _calls, broken = 0, 3, 1, 1, None
        records = [Record(0, "barrier", 0, "uint8", "dissemination", "done", call=0)]
        global_ranks = [0, 1, 2]

        def who(self, r):
            g = self.global_ranks[r]
            return f"rank {r}" if g == r else f"rank {r} (global rank {g})"

        def _peer_records(self):
            raise AssertionError("a send or receive reads no progress records")

    def p2p(direction, peer, tag=5, nbytes=262144, dtype=torch.float32):
        return SimpleNamespace(is_p2p=True, kind=Kind.P2P, seq=-1, direction=direction, peer=peer, tag=tag,
                               nbytes=nbytes, dtype=dtype, exe=None)

    g = Group()
    said = g.timeout_diagnosis(p2p("send", 2))
    assert said.startswith("Rank 0 (this rank) last ran: #0 barrier 0B done (dissemination). "), said
    assert said.endswith("Check that rank 2 posts a recv from rank 0 with tag 5 and room for 262144 bytes of float32, "
                         "and that it does not block first in a call that waits on this rank"), said
    said = g.timeout_diagnosis(p2p("recv", 1, tag=0, nbytes=8, dtype=torch.bfloat16))
    assert said.endswith("Check that rank 1 sends rank 0 a message with tag 0, of at most 8 bytes of bfloat16, "
                         "and that it does not block first in a call that waits on this rank"), said
    said = g.timeout_diagnosis(p2p("recv-any", None))
    assert "Check that a rank of the group sends rank 0 a message with tag 5, of at most 262144 bytes" in said, said
    g.global_ranks = [4, 6, 7]  # a subgroup: its members' global ranks too
    said = g.timeout_diagnosis(p2p("send", 1))
    assert "Check that rank 1 (global rank 6) posts a recv from rank 0 (global rank 4) with tag 5" in said, said
    for direction in ("send", "recv", "recv-any"):
        assert "same collectives" not in g.timeout_diagnosis(p2p(direction, 1)), direction
    g.records = []  # a rank that ran only sends and receives (review AI: it "last ran: nothing")
    said = g.timeout_diagnosis(p2p("recv", 1))
    assert said.startswith("Rank 0 (global rank 4) (this rank) last ran: no collective yet (sends and receives are "
                           "not recorded). "), said


def test_a_rank_that_published_nothing_and_was_seen_in_nothing_is_silent_and_records_show_the_latest_calls():
    """A rank with no progress record that this rank saw take part in no call (it never got as
    far as its first heartbeat) "published no progress record": it is neither "frozen" (a rank
    whose frames arrived) nor in the call. Every record, this rank's own included, lists the
    rank's latest four collectives, not its first four (what it last ran is the point)."""
    from types import SimpleNamespace
    from neuron_dist.op import Record
    from neuron_dist.transport.frame import Kind

    g = _diagnosing(3, [Record(i, "broadcast", 8, "float32", "ring", "done", call=i) for i in range(5)]
                    + [Record(5, "broadcast", 8, "float32", "ring", "running", call=5)],
                    lambda: {1: {"issued": 6, "calls": 6, "broken": None,
                                 "recent": [[5, "broadcast", 8, "float32", "running", "ring", 5]]}})
    assert [r[0] for r in g.progress_record()["recent"]] == [2, 3, 4, 5]
    op = SimpleNamespace(seq=5, call=5, checks="", checked=False, is_p2p=False, kind=Kind.BROADCAST,
                         exe=SimpleNamespace(recv_chunks={1: 1}))
    said = g.diagnose(op)
    assert said.startswith("Ranks [2] published no progress record; ranks [0, 1] had entered it. "), said
    assert "frozen" not in said and "took part in calls" not in said, said
    assert said.endswith("Rank 0 (this rank) last ran: #2 broadcast 8B done (ring), #3 broadcast 8B done (ring), "
                         "#4 broadcast 8B done (ring), #5 broadcast 8B running (ring)."), said


def test_a_frame_kept_early_is_named_by_the_users_call_under_the_debug_check():
    """Under the debug check each user call takes two frame numbers (its fingerprint exchange,
    then the call): a peer's frame kept early is named by the user's call it belongs to, whether
    the op that timed out is a call or its exchange."""
    from types import SimpleNamespace
    from neuron_dist.diagnosis import _call_at
    call = SimpleNamespace(seq=5, call=2, checks="", checked=True)  # call 2: exchange 4, call 5
    assert [_call_at(call, s) for s in (4, 5, 6, 7, 8, 9)] == [2, 2, 3, 3, 4, 4]
    exchange = SimpleNamespace(seq=4, call=2, checks="allreduce", checked=False)
    assert [_call_at(exchange, s) for s in (4, 5, 6, 7, 8)] == [2, 2, 3, 3, 4]
    plain = SimpleNamespace(seq=5, call=5, checks="", checked=False)
    assert [_call_at(plain, s) for s in (5, 6, 8)] == [5, 6, 8]


def test_a_rank_seen_in_the_call_whose_record_stops_just_before_it_is_not_said_to_have_skipped_it():
    """A rank frozen (SIGSTOP, a debugger) just after it entered the call: its frames of the call
    arrived, but its last record was published before it issued it (`issued` is the call's own
    number). That record predates the call: the rank had entered it, and the hint is its
    process, not the order of calls."""
    import time
    from types import SimpleNamespace
    from neuron_dist.op import Record
    from neuron_dist.transport.frame import Kind

    g = _diagnosing(2, [Record(0, "broadcast", 32, "float32", "ring", "done", call=0),
                        Record(1, "broadcast", 32, "float32", "ring", "done", call=1),
                        Record(2, "allreduce", 1 << 20, "float32", "ring", "running", call=2)],
                    lambda: {1: {"issued": 2, "recent": [[1, "broadcast", 32, "float32", "done", "ring"]],
                                 "broken": None, "t": time.time() - 3}})
    op = SimpleNamespace(seq=2, call=2, checks="", checked=False, is_p2p=False, kind=Kind.ALLREDUCE,
                         exe=SimpleNamespace(recv_chunks={1: 1}))
    said = g.timeout_diagnosis(op)
    assert said.startswith("The progress records of ranks [1] (the oldest "), said
    assert "predate calls they took part in (rank 1: allreduce seq 2)" in said and "had not entered" not in said, said
    assert "ranks [0, 1] had entered it." in said and "Check that the processes of ranks [1] still run" in said, said


def test_a_rank_that_never_published_is_not_waited_for_in_the_store():
    """A rank with no progress record (it never reached its first heartbeat) has no key: the
    diagnosis asks the store whether the key is there before it reads it, since a get() of a
    missing key waits for it (the store's time-out, or STORE_ANSWER_S here), and then every
    later rank's record went unread ("the store did not answer"), a live store blamed."""
    import json
    import time
    from datetime import timedelta
    import torch.distributed as dist
    from neuron_dist.diagnosis import HangDiagnosis

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    store.set("progress/2", json.dumps({"issued": 1, "recent": []}))

    class Group(HangDiagnosis):
        rank, size = 0, 3

    g = Group()
    g.store = store
    t0 = time.monotonic()
    records, unread, why = g._peer_records()
    assert (sorted(records), unread, why) == ([2], [], ""), (records, unread, why)
    assert time.monotonic() - t0 < 1.5
