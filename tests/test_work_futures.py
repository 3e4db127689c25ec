"""A Work completes after its future: wait() and is_completed() tell the caller the op is done
only once get_future()'s future has completed and its `then` callbacks have run, as Gloo's do
(its future completes before the Work), also when the op failed; and what a group keeps of a
long collective's frame plan is bounded. The ranks' side is in cases_work.py."""
from neuron_dist.collectives.executor import MAX_KEPT_FRAMES


def test_wait_returns_only_after_the_futures_callbacks_have_run(pools):
    """wait() on an op that has already finished still waits for its future's `then` callbacks
    (rank 0 asked for the future while the op ran; a callback takes 0.5 s). A wait() that
    returned as soon as the op was done let the caller read a tensor a callback still writes,
    and `fut.value()` fail torch's INTERNAL ASSERT."""
    seen, _ = pools(2).run("cases_work:wait_after_the_op_finished")
    assert seen is True, "wait() returned while the future's callback still ran"


def test_is_completed_becomes_true_only_after_the_futures_callbacks_have_run(pools):
    """is_completed() says True only once the future's `then` callbacks have run, not as soon
    as the op is done: a caller that polls it and then reads the future's value or the tensor
    a callback writes (DDP's comm hooks) would get ahead of the callback."""
    seen, _ = pools(2).run("cases_work:is_completed_while_callbacks_run")
    assert seen is True, "is_completed() said True while the future's callback still ran"


def test_wait_on_a_failed_op_raises_only_after_its_future_failed_and_its_callbacks_ran(pools):
    """wait() on an op that failed (its 1 s time-out: the peer never joined) raises once the
    future has failed too and its callbacks have run, as Gloo's (the future fails first):
    raising at once left the future pending and a callback running while the caller, handling
    the error, tore the group down beneath it."""
    (error, done, ran), _ = pools(2).run("cases_work:wait_on_a_failed_op", timeout=60)
    assert error is not None and "rank 0" in error and "allreduce" in error.lower(), error
    assert done and ran, f"wait() raised with the future done: {done}, its callback run: {ran}"


def test_no_kept_frame_plan_is_longer_than_the_executor_keeps(pools):
    """A 4 MB all-reduce at 4 KiB frames, lending off, is ~1,000 frames: the group cuts its frame
    plan again per call instead of keeping it with the schedule (executor.MAX_KEPT_FRAMES), as
    executor.frame_plan does. Kept, each call form's plan held ~0.34 MB, and with up to 1,024
    forms cached a group held hundreds of MB of frame plans."""
    for built, kept in pools(2).run("cases_work:frame_plans_kept_after_a_long_all_reduce"):
        assert built > 0, "no plan of the all-reduce built a schedule"
        assert all(frames <= MAX_KEPT_FRAMES for frames in kept), \
            f"frame plans of {sorted(kept)} frames kept (at most {MAX_KEPT_FRAMES})"


def test_the_future_of_a_failed_op_fails_as_gloos(pools):
    """get_future() of an op that failed (its 1 s time-out: the peer never joined) fails with the
    op's error, asked for while the op ran or after, as Gloo's does (its future raises on
    wait()); a future that completed with the outputs handed a DDP comm hook the caller's
    unreduced tensors as the result. is_success() says False and exception() is the error."""
    (got, success, exc), _ = pools(2).run("cases_work:a_failed_ops_future", timeout=60)
    for i, text in enumerate(got):
        assert text != "value" and "rank 0" in text and "allreduce" in text.lower(), \
            f"future {i} ({'asked while the op ran' if i == 0 else 'asked after it failed'}): {text}"
    assert success is False and exc != "NoneType", (success, exc)
