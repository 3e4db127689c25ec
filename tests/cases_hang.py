"""Rank-side: a rank that never enters a collective. The others' error, within the group's
timeout, names the rank that had not entered, the collective and its sequence number, and
what each rank last ran."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rankctx as R

TIMEOUT_S = 3.0


def absent_rank(rank, world):
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(8)
    dist.all_reduce(x, group=g)  # seq 0: everyone
    msg, took = None, 0.0
    if rank != 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(x, group=g)  # seq 1: rank 0 never calls it
        except dist.DistBackendError as e:
            msg = str(e)
        took = time.monotonic() - t0
        assert msg is not None, "a collective with an absent rank returned"
        assert took < TIMEOUT_S + 5, f"the error took {took:.1f}s (timeout {TIMEOUT_S}s)"
        assert "timed out" in msg and "seq 1" in msg, msg
        assert "Ranks [0] had not entered allreduce seq 1 by their progress records (the oldest " in msg, msg
        assert "Rank 0 last ran: #0 allreduce" in msg, msg
    dist.barrier(group=R.GLOO)  # rank 0 waits here until the others have their error
    dist.destroy_process_group(g)
    return 1



def absent_rank_in_a_subgroup(rank, world):
    """A subgroup of global ranks [1, 2] (of 3): global rank 2 never enters its second call.
    Global rank 1's error numbered the members within the group and said nothing of it
    ("[rank 0] ... waiting for rank 1 (global rank 2). Ranks [1] had not entered ...; ranks
    [0] had entered it. Rank 1 last ran: ..."): read as global ranks, it blamed the reporting
    rank. Every member is now named with its global rank too."""
    g = dist.new_group([1, 2], timeout=timedelta(seconds=TIMEOUT_S))
    if rank == 1:
        x = torch.ones(4)
        dist.all_reduce(x, group=g)  # seq 0: both
        try:
            dist.all_reduce(x, group=g)  # seq 1: global rank 2 never calls it
        except dist.DistBackendError as e:
            msg = str(e)
        else:
            raise AssertionError("a collective with an absent rank returned")
        assert msg.startswith("[rank 0 (global rank 1)] allreduce(16 bytes, float32, sum) (seq 1) timed out "), msg
        assert "Ranks [1 (global rank 2)] had not entered allreduce seq 1 by their progress records" in msg, msg
        assert "ranks [0 (global rank 1)] had entered it." in msg, msg
        assert "Rank 1 (global rank 2) last ran: #0 allreduce 16B done" in msg, msg
        assert "Rank 0 (global rank 1) (this rank) last ran: #0 allreduce 16B done" in msg, msg
    elif rank == 2:
        dist.all_reduce(torch.ones(4), group=g)
    dist.barrier(group=R.GLOO)  # rank 2 waits here until rank 1 has its error
    dist.destroy_process_group(g)
    return 1


def absent_rank_under_the_check(rank, world):
    """As absent_rank, under the debug check (TORCH_DISTRIBUTED_DEBUG=DETAIL): each call's
    fingerprint all-gather ran first and took a sequence number of its own. The error named
    that all-gather, not the user's call ("allgather(480 bytes, uint8) (seq 2) timed out ...
    Ranks [0] had not entered allgather seq 2"), and every number the user saw was doubled, in
    _get_sequence_number_for_group too. Now the numbers count the user's calls, as without the
    check, and the exchange's failure names the call it checked."""
    from neuron_dist import debug
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    pg = g._get_backend(torch.device("cpu"))
    debug.set_enabled(True)
    try:
        x = torch.ones(4)
        dist.all_reduce(x, group=g)  # seq 0: everyone
        assert pg._get_sequence_number_for_group() == 1, pg._get_sequence_number_for_group()
        try:  # refused on every rank: not run, and no number taken (as under Gloo's wrapper)
            dist.all_reduce(torch.ones(4 if rank else 5), group=g)
        except RuntimeError as e:
            assert "Detected mismatch" in str(e) and "seq 1)" in str(e), e
        assert pg._get_sequence_number_for_group() == 1, pg._get_sequence_number_for_group()
        if rank != 0:
            try:
                dist.all_reduce(x, group=g)  # seq 1: rank 0 never calls it
            except dist.DistBackendError as e:
                msg = str(e)
            else:
                raise AssertionError("a collective with an absent rank returned")
            assert msg.startswith(f"[rank {rank}] the debug check of allreduce(16 bytes, float32, sum) (seq 1) "
                                  f"timed out after"), msg
            assert "Ranks [0] had not entered allreduce seq 1 by their progress records" in msg, msg
            assert "Rank 0 last ran: #0 allreduce check " in msg and "#0 allreduce 16B done" in msg, msg
            assert "(next seq 1)" in msg and "allgather" not in msg and "seq 2" not in msg, msg
    finally:
        debug.set_enabled(None)
    dist.barrier(group=R.GLOO)  # rank 0 waits here until the others have their error
    dist.destroy_process_group(g)
    return 1


def frozen_rank(rank, world):
    """Rank 1 freezes (SIGSTOP) after calls whose progress it could not publish (its heartbeat
    stopped, as a frozen host's or a cut-off one's does): rank 0 completed those calls with it,
    so its error must not say rank 1 "had not entered" the call by that old record, nor point
    at the order of the calls; it says the record predates calls rank 1 took part in. (The
    record used to be read as proof: "Ranks [1] had not entered allreduce seq 6 ... Check that
    every rank of the group calls the same collectives in the same order".)"""
    import os
    import signal
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=R.GLOO)
    x = torch.ones(8)
    dist.all_reduce(x, group=g)  # seq 0
    if rank == 1:
        group = g.group
        group._hb_stop.set()
        group._hb_thread.join(5)
        group._publish_progress()  # the last record anyone sees: next seq 1
    dist.barrier(group=R.GLOO)
    for _ in range(5):
        dist.all_reduce(x, group=g)  # seq 1..5, together: rank 1's record says none of them
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 lets it go on once it has its error
        try:
            dist.all_reduce(x, group=g)  # seq 6: the group was broken meanwhile
        except dist.DistBackendError:
            pass
    else:
        try:
            dist.all_reduce(x, group=g)  # seq 6: rank 1 is stopped
        except dist.DistBackendError as e:
            msg = str(e)
        else:
            raise AssertionError("a collective with a stopped rank returned")
        finally:
            for r in range(1, world):
                os.kill(pids[r], signal.SIGCONT)
        assert "timed out" in msg and "seq 6" in msg, msg
        assert "had not entered" not in msg and "same order" not in msg, msg
        assert ("The progress records of ranks [1] (the oldest " in msg
                and "predate calls they took part in (rank 1: allreduce seq 5)" in msg), msg
        assert "Rank 1 last ran (by that old record): #0 allreduce" in msg and "(next seq 1)" in msg, msg
        assert "Check that the processes of ranks [1] still run" in msg, msg
    dist.barrier(group=R.GLOO)
    dist.destroy_process_group(g)
    return 1

class _CutOffStore:
    """A store behind a network partition: every call blocks (a real one blocks until the
    kernel gives up on the TCP connection, about 15 minutes)."""

    def __init__(self):
        import threading
        self.gate = threading.Event()

    def __getattr__(self, name):
        def blocked(*args, **kwargs):
            self.gate.wait(60)
            raise RuntimeError("store call released")
        return blocked


def unreachable_store(rank, world):
    """A rank cut off from the store (rank 0's host) still fails a timed-out collective at the
    group's time-out: its diagnosis waits for the store at most a bounded time."""
    from neuron_dist import diagnosis
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(8)
    dist.all_reduce(x, group=g)  # seq 0: everyone
    if rank != 0:
        group = g.group
        cut = _CutOffStore()
        real, group.store = group.store, cut
        t0 = time.monotonic()
        try:
            dist.all_reduce(x, group=g)  # seq 1: rank 0 never calls it
        except dist.DistBackendError as e:
            msg = str(e)
        else:
            raise AssertionError("a collective with an absent rank returned")
        finally:
            took = time.monotonic() - t0
            group.store = real
            cut.gate.set()  # let the blocked helper threads go
        # README: the failure path waits at most 2 s for each store call (the number, not the
        # package's constant: a constant raised would raise the bound with it)
        limit = TIMEOUT_S + 2 * 2.0 + 2
        assert took < limit, f"the error took {took:.1f}s (timeout {TIMEOUT_S}s, limit {limit:.1f}s)"
        assert "timed out" in msg and "seq 1" in msg, msg
        assert "The progress of ranks [0] is unknown: the store did not answer rank 0's progress record" in msg, msg
        deadline = time.monotonic() + 5
        while diagnosis._stuck and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.barrier(group=R.GLOO)
    dist.destroy_process_group(g)
    return 1


class _SlowStore:
    """A store that answers, slowly (a busy store of a large job)."""

    def __init__(self, store, delay):
        self.store, self.delay = store, delay

    def __getattr__(self, name):
        def slow(*args, **kwargs):
            time.sleep(self.delay)
            return getattr(self.store, name)(*args, **kwargs)
        return slow


def slow_store(rank, world):
    """Each store call takes 1.2 s: the diagnosis still reads the records (each call is bounded,
    not the whole read, which had 2 s for all of them and blamed the store's reachability)."""
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(8)
    dist.all_reduce(x, group=g)
    if rank != 0:
        group = g.group
        real, group.store = group.store, _SlowStore(group.store, 1.2)
        try:
            dist.all_reduce(x, group=g)  # rank 0 never calls it
        except dist.DistBackendError as e:
            msg = str(e)
        else:
            raise AssertionError("a collective with an absent rank returned")
        finally:
            group.store = real
        assert "Ranks [0] had not entered allreduce seq 1" in msg and "unknown" not in msg, msg
    dist.barrier(group=R.GLOO)
    dist.destroy_process_group(g)
    return 1


def groups_fail_together(rank, world):
    """Three groups time out at the same moment, each on its own engine thread: each error
    carries its own diagnosis (a process-wide 'one store call at a time' refused all but one)."""
    groups = [dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S)) for _ in range(3)]
    for g in groups:
        dist.all_reduce(torch.ones(8), group=g)  # seq 0 on each, everyone
    if rank == 0:
        works = [dist.all_reduce(torch.ones(8), group=g, async_op=True) for g in groups]  # no one else comes
        msgs = []
        for w in works:
            try:
                w.wait()
            except dist.DistBackendError as e:
                msgs.append(str(e))
        assert len(msgs) == 3, msgs
        for m in msgs:
            assert f"Ranks {list(range(1, world))} had not entered allreduce seq 1" in m and "unknown" not in m, m
    dist.barrier(group=R.GLOO)
    for g in groups:
        dist.destroy_process_group(g)
    return 1


def dumps(rank, world):
    """NEURON_DIST_DUMP writes a group's record of recent collectives when one fails, and
    NEURON_DIST_DUMP_SIGNAL dumps every open group's record on that signal."""
    import os
    import shutil
    import signal
    import tempfile

    from neuron_dist import diagnosis
    folder = tempfile.mkdtemp(prefix="nd-dump-")
    where = os.path.join(folder, f"rank{rank}.txt")
    saved = {k: os.environ.get(k) for k in ("NEURON_DIST_DUMP", "NEURON_DIST_DUMP_SIGNAL")}
    os.environ.update(NEURON_DIST_DUMP=where, NEURON_DIST_DUMP_SIGNAL="USR1")
    before = signal.getsignal(signal.SIGUSR1)
    try:
        g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))  # installs the handler
        dist.all_reduce(torch.ones(8), group=g)       # seq 0
        dist.broadcast(torch.ones(4), src=0, group=g)  # seq 1
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not (os.path.exists(where) and "#1 broadcast" in open(where).read()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs between bytecodes of this thread
        text = open(where).read()
        assert f"rank {rank}/{world}" in text and "#0 allreduce 32B float32" in text and "#1 broadcast 16B" in text, text
        assert "[failure" not in text, text
        # a failure: rank 0 calls with another size, so every rank's frame check fails
        try:
            dist.all_reduce(torch.ones(8 if rank else 16), group=g)  # seq 2
        except dist.DistBackendError:
            pass
        else:
            raise AssertionError("an all-reduce with mismatched sizes succeeded")
        deadline = time.monotonic() + 5
        while "[failure" not in open(where).read() and time.monotonic() < deadline:
            time.sleep(0.01)
        text = open(where).read()
        assert "[failure: " in text and "#2 allreduce" in text and "failed" in text.split("[failure: ")[1], text
        dist.barrier(group=R.GLOO)
        dist.destroy_process_group(g)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signal.SIGUSR1, before)
        diagnosis._SIGNAL_INSTALLED = False
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 1
