"""Every NEURON_DIST_* environment variable the backend reads, and `env`/`env_int`, which read
and log them. A few are read where they are used instead: NEURON_DIST_ALGO and _TUNING on the
fast path (collectives/select.py: a dict lookup per call), NEURON_DIST_DEBUG by setup_logging
below, NEURON_DIST_BIND_ADDR by hosts.py, NEURON_DIST_INSTANCE from the mapping placement reads.

NEURON_DIST_ALGO       force algorithms per collective: "allreduce:ring;allgather:direct"
NEURON_DIST_TUNING     model (default): every group runs the topology cost model's choice; host:
                       groups whose peers all share this host's memory pick by measured host speed
NEURON_DIST_TRANSPORT  force a transport for every peer pair: zmq | shm | mpi
NEURON_DIST_DEBUG      log subsystems at debug level: INIT,TOPO,TUNING,TRANSPORT,COLL (or ALL / 1; 0: none)
NEURON_DIST_REPORT     print a per-collective summary (bytes, algorithm, host time, modelled
                       device time) when a group is destroyed: 1, or a file path (0: off)
NEURON_DIST_BIND_ADDR  the address listeners bind to (default: the interface that reaches
                       MASTER_ADDR; a job on one host opens no TCP listener)
NEURON_DIST_FRAME_BYTES  largest frame a step is cut into (default 524288, 64 to 2**30); with shared memory
                       also the size of one ring slot
NEURON_DIST_SCRATCH_BYTES  the most scratch memory a group keeps between collectives (default
                       64 MiB, 0: none; collectives/scratch.py): a call needing more gets its own
NEURON_DIST_SHM_SLOTS  slots per shared-memory ring, one ring per peer pair and direction
                       (default 4, at least 2): memory per pair = slots x FRAME_BYTES each way
NEURON_DIST_SHM_SPIN_US  how long a waiting rank spins on its shared-memory doorbell (default 50;
                       20, with sched_yield, when local ranks outnumber cores)
NEURON_DIST_SHM_YIELD_US  how much longer it then spins yielding its core at each turn, before it
                       sleeps on a futex (default 1000; 0 when local ranks outnumber cores);
                       both are spent once per episode of waiting, not per call
NEURON_DIST_SHM_LEND   0 (or false/off/no) turns single-copy lending off (default on in a group on
                       one host whose every pair can read the other's memory: transport/cma.py;
                       a group spanning hosts never lends)
NEURON_DIST_INSTANCE   the modelled instance (set by neuronrun; default trn2.48xlarge)
NEURON_DIST_CHECK      1 (or true/on/yes; 0/false/off/no: off): check a fingerprint of every collective across ranks before running it
                       (also on with TORCH_DISTRIBUTED_DEBUG=DETAIL)
NEURON_DIST_DUMP       1/stderr or a file (0: off): write a group's record of recent collectives on failure
NEURON_DIST_DUMP_SIGNAL  a signal name (USR1, ...) that dumps every group's record on demand
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("neuron_dist")

SUBSYSTEMS = ("INIT", "TOPO", "TUNING", "TRANSPORT", "COLL")
_LOGGERS = {"INIT": "neuron_dist.init", "TOPO": "neuron_dist.topology", "TUNING": "neuron_dist.tuning",
            "TRANSPORT": "neuron_dist.transport", "COLL": "neuron_dist.coll"}


def env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return default
    log.debug("env %s=%s", name, value)
    return value


def env_int(name: str, default: int, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = env(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={raw!r} must be at most {maximum}")
    return value


_OFF = ("", "0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def env_flag(name: str, default: bool = False) -> bool:
    """A switch: 1/true/on/yes or 0/false/off/no (unset or empty: `default`); anything else is
    an error."""
    raw = (env(name) or "").strip().lower()
    if not raw:
        return default
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    raise ValueError(f"{name}={raw!r}: expected 1/true/on/yes or 0/false/off/no")


def env_target(name: str) -> str | None:
    """Where a diagnostic goes: None when unset or off (0/false/off/no), "stderr" for
    1/true/on/yes/stderr, else the file path given."""
    raw = (env(name) or "").strip()
    if raw.lower() in _OFF:
        return None
    if raw.lower() in _ON or raw.lower() == "stderr":
        return "stderr"
    return raw


def emit(text: str, where: str) -> None:
    """Write a diagnostic text where `env_target` says: "stderr", or append to the file named."""
    try:
        if where == "stderr":
            sys.stderr.write(text)
            sys.stderr.flush()
        else:
            with open(where, "a") as f:
                f.write(text)
    except OSError as e:
        log.warning("could not write diagnostics to %s: %s", where, e)


class _RankFormatter(logging.Formatter):
    """Reads RANK when a line is written, not at import: a process may learn its rank later
    (bench's spawned ranks, code that sets RANK before init_process_group)."""

    def format(self, record):
        record.rank = os.environ.get("RANK", "?")
        return super().format(record)


def setup_logging() -> None:
    """Turn on debug logging for the subsystems named in NEURON_DIST_DEBUG."""
    raw = os.environ.get("NEURON_DIST_DEBUG", "").strip()
    if raw.lower() in _OFF:
        return
    names = SUBSYSTEMS if raw.lower() in _ON + ("all",) else [s.strip().upper() for s in raw.split(",") if s.strip()]
    unknown = [n for n in names if n not in _LOGGERS]
    if unknown:  # a warning, not an error: this runs at import, in programs that may never init
        import warnings
        warnings.warn(f"NEURON_DIST_DEBUG names unknown subsystems {unknown}, ignored; known: "
                      f"{', '.join(SUBSYSTEMS)}", stacklevel=2)
    # one handler, on the package's logger: the subsystems' records propagate to it (a handler on
    # each as well printed every line twice); subsystems not named stay quiet at INFO
    handler = logging.StreamHandler()
    handler.setFormatter(_RankFormatter("[neuron_dist rank %(rank)s] %(name)s %(levelname)s: %(message)s"))
    for n, logger_name in _LOGGERS.items():
        logging.getLogger(logger_name).setLevel(logging.DEBUG if n in names else logging.INFO)
    log.setLevel(logging.DEBUG if "INIT" in names else logging.INFO)  # its own lines: variables read at set-up
    if not log.handlers:
        log.addHandler(handler)
