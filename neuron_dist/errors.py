"""The package's communication error: a torch DistBackendError, so callers catch it as they
would NCCL's or Gloo's."""
import sys

import torch.distributed as dist


class GroupError(dist.DistBackendError):
    """A collective failed: names the rank, the collective, its sequence number and the cause."""


def headline(e: BaseException) -> str:
    """`e` as "DistNetworkError: its first line": torch's store errors carry a C++ trace below it."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def exit_cause() -> str | None:
    """The exception the process is exiting on, as "ValueError: why", if it is exiting on one:
    the interpreter keeps the last one it printed in `sys.last_value`. Not in an interactive
    session (`sys.ps1` set), where that may be an error from long before the exit."""
    exc = getattr(sys, "last_value", None)
    if exc is None or hasattr(sys, "ps1"):
        return None
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
