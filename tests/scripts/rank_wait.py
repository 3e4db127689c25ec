"""What a rank script waits on besides the group: another rank's process ending. Polled with
signal 0, since the fork server reaps ranks in order (tests/forkserver.py): an ended rank stays
a zombie, its pid still answering, until the ranks before it end, so a script waits only on an
earlier rank, or on a later one once the earlier ones have gone."""
import os
import time


def until_gone(pid: int, bound_s: float) -> None:
    """Return once process `pid` has ended and been reaped, or after `bound_s` seconds."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
