"""Imported last by the fork server that starts bench's and bench_train's ranks
(`bench.rank_context`), and nowhere else: that fork server ends as soon as it exits, without the
interpreter's finalization. It exits when the tool it serves has ended (its last client), and its
ranks die with it (`bench.die_with_launcher`, a parent-death signal); finalizing the torch (and
torch._dynamo) it had preloaded took it seconds on a loaded 2-core host, while the ranks of a
SIGKILLed bench_train trained on beside it, slowing it further: the last process of the run
ended 2.3-5.4 s after the kill at load 7 (0.1-0.4 s without the finalization), and in CI's
loaded runs some outlived test_a_sigkilled_tool_leaves_no_rank_running's 10 s. Registered
after every preloaded module's exit handler, this one runs first (their handlers have nothing
of the fork server's to clean up: it only forked). A rank, forked from the fork server,
inherits the handler and ignores it (another pid)."""
import atexit
import os
import sys

_SERVER = os.getpid()


@atexit.register
def _end_now() -> None:
    if os.getpid() == _SERVER:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: nothing to keep
                pass
        os._exit(1 if getattr(sys, "last_value", None) is not None else 0)
