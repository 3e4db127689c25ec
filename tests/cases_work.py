"""Rank-side cases for a Work's completion (c10d.NeuronWork: wait(), is_completed(), its future's
`then` callbacks) and for what a group's executions keep between calls. Each returns what rank 0
saw (None elsewhere); test_work_futures.py judges it."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rankctx as R
from rankctx import env

SLOW_CALLBACK_S = 0.5  # a `then` callback's own time: the caller must not get ahead of it
LATE_S = 0.3  # rank 1 starts late, so rank 0 asks for the future while its op still runs


def _slow_then(work):
    """The future of a `then` callback on `work`'s future that takes SLOW_CALLBACK_S, and a list
    that holds one item once it has run."""
    ran = []

    def slow(f):
        time.sleep(SLOW_CALLBACK_S)
        ran.append(1)
    return work.get_future().then(slow), ran


def _callback_seen_when_done(rank, done_when) -> bool | None:
    """Rank 0 issues an all-reduce (rank 1 comes LATE_S late), puts a slow `then` callback on its
    future, then `done_when(work)` until that says the call is done: whether the callback had run
    by then (None on rank 1)."""
    if rank == 1:
        time.sleep(LATE_S)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    seen = None
    if rank == 0:
        fut, ran = _slow_then(work)
        deadline = time.monotonic() + 30
        while not done_when(work):
            assert time.monotonic() < deadline, "the all-reduce never finished"
        seen = bool(ran)
        fut.wait()
    else:
        work.wait()
    dist.barrier(group=R.GLOO)
    return seen


def wait_after_the_op_finished(rank, world):
    """Rank 0 waits on an all-reduce once the op itself has finished while its future's slow
    callback still runs: whether that callback had run when wait() returned."""
    def finished_then_wait(work):
        if not work._op.finished:
            time.sleep(0.001)
            return False
        work.wait()
        return True
    return _callback_seen_when_done(rank, finished_then_wait)


def is_completed_while_callbacks_run(rank, world):
    """Rank 0 polls is_completed() on an all-reduce whose future has a slow callback: whether
    that callback had run when is_completed() first said True."""
    return _callback_seen_when_done(rank, lambda work: work.is_completed())


def wait_on_a_failed_op(rank, world):
    """Rank 0's all-reduce on a group with a 1 s time-out that rank 1 never joins; its future has
    a slow callback. Returns (the error wait() raised, whether the future was done and whether
    the callback had run when it did)."""
    sub = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    seen = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
        fut, ran = _slow_then(work)
        try:
            work.wait()
            error = None
        except Exception as e:  # noqa: BLE001 - the failure this case makes
            error = f"{type(e).__name__}: {e}"
        seen = (error, fut.done(), bool(ran))
        fut.wait()
    dist.barrier(group=R.GLOO)
    dist.destroy_process_group(sub)
    return seen


def frame_plans_kept_after_a_long_all_reduce(rank, world, count=1 << 20):
    """A 4 MB all-reduce on a group of 4 KiB frames, lending off (so it is cut into ~1,000
    copied frames): (how many of its plans have a schedule, the frame counts of the frame plans
    those schedules keep)."""
    with env(NEURON_DIST_FRAME_BYTES=4096, NEURON_DIST_SHM_LEND=0):
        sub = dist.new_group(list(range(world)))
    try:
        x = torch.ones(count)
        dist.all_reduce(x, group=sub)
        assert torch.equal(x, torch.full((count,), float(world))), "the all-reduce's result is wrong"
        plans = sub._get_backend(torch.device("cpu"))._plans
        built = [p for cache in (plans.by_args, plans.common()) for p in cache.values() if p._sched is not None]
        kept = [fp.frames for p in built for fp in p._sched.plans.values()]
    finally:
        dist.destroy_process_group(sub)
    dist.barrier(group=R.GLOO)
    return len(built), kept


def a_failed_ops_future(rank, world):
    """Rank 0's all-reduce on a group with a 1 s time-out that rank 1 never joins, its future
    asked for while the op runs and again once it failed: what each future's wait() gave (the
    error's text, or 'value' where it returned one), and is_success()/exception() after."""
    sub = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    seen = None
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
        early = work.get_future()
        got = []
        for fut in (early, None):
            fut = fut or work.get_future()
            try:
                fut.wait()
                got.append("value")
            except Exception as e:  # noqa: BLE001 - the failure this case makes
                got.append(f"{type(e).__name__}: {e}")
        seen = (got, work.is_success(), type(work.exception()).__name__)
    dist.barrier(group=R.GLOO)
    dist.destroy_process_group(sub)
    return seen
