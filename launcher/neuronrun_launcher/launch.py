"""Start the job with torch's elastic agent and turn its outcome into an exit code and a report.

Rendezvous, monitoring, restarts and stopping ranks are torch.distributed.elastic's
(``LaunchConfig``/``elastic_launch``); nothing here manages processes. What this
module adds: the worker trampoline as entrypoint, ``NEURONRUN_PLAN`` in the
environment the agent hands down, rank-prefixed output in whole lines (``tail.py``),
and a root-cause report (rank, node, exit code or signal, last lines of its output)
instead of a traceback of the launcher. torch is imported here only, so --help and
--dry-run stay fast.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from .config import RunConfig
from .plan import PLAN_VAR
from .worker import AGENT_VAR, GROUPS_VAR, read_group, start_time

WORKER = str(Path(__file__).resolve().with_name("worker.py"))
LINE_PREFIX = "[rank${rank}]: "
TAIL_LINES = 20
UNSHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's own switch (dynamic_rendezvous.py)


def worker_command(cfg: RunConfig) -> tuple[str, list[str]]:
    """Entrypoint and arguments the agent runs for every local rank.

    The trampoline runs under neuronrun's own interpreter, not $PYTHON_EXEC: torchrun starts
    each rank as ``$PYTHON_EXEC -u script``, and the trampoline execs exactly that (it reads
    PYTHON_EXEC from the environment the agent hands down). Run under a $PYTHON_EXEC wrapper,
    the trampoline itself would get the wrapper's interpreter options (-X, -W) and exec a
    plain interpreter without them."""
    return sys.executable, ["-u", WORKER, cfg.mode, cfg.script or "", *cfg.script_args]


def _std(text: str):
    from torch.distributed.elastic.multiprocessing import Std

    return Std.from_str(text)


def sweep_groups(groups_dir: str | None) -> None:
    """SIGKILL whatever is left in the process groups of ranks that have ended.

    Each rank is a session leader (the agent starts it with start_new_session) and
    the trampoline left its pid in ``groups_dir``. The agent signals the groups of
    ranks still running when it stops a worker group, but not of ranks that already
    exited or were killed, whose children (data loaders, helpers) would be orphaned.
    Called when each attempt starts (previous ranks are all stopped by then) and
    when the job ends."""
    if not groups_dir or not os.path.isdir(groups_dir):
        return
    for name in os.listdir(groups_dir):
        try:
            started, _ = read_group(os.path.join(groups_dir, name))
            pid = int(name)
            # a group whose members outlive its leader keeps the leader's pid from reuse; a
            # process now holding that pid that started at another time is not the rank (the
            # rank and its group are gone, and the pid went to another job's process)
            now = start_time(pid)
            if not (started and now is not None and now != started):
                os.killpg(pid, signal.SIGKILL)
        except (ValueError, OSError):  # (ProcessLookupError, PermissionError: nothing of ours)
            pass
        try:
            os.unlink(os.path.join(groups_dir, name))
        except OSError:
            pass


def _logs_specs_class():
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class RecordingLogsSpecs(DefaultLogsSpecs):
        """torch's default log layout, remembering where each local rank's files went
        (``reify`` is the LogsSpecs plugin hook) so a failure report can quote them."""

        last_dest = None
        groups_dir = None
        node_rank = None  # this node's GROUP_RANK in the current attempt (the rendezvous assigns it)

        def reify(self, envs):  # called as each attempt starts: the previous ranks are stopped
            sweep_groups(self.groups_dir)
            self.node_rank = next((e.get("GROUP_RANK") for e in envs.values()), None)
            self.last_dest = super().reify(envs)
            return self.last_dest

    return RecordingLogsSpecs


def launch_config(cfg: RunConfig, log_dir: str | None = None):
    """The torch LaunchConfig equivalent to ``cfg`` (as torchrun's config_from_args builds it)."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs = _parse_rendezvous_config(cfg.rdzv_conf)
    if cfg.rdzv_backend == "static":
        rdzv_configs["rank"] = cfg.node_rank
    ranks = set(map(int, cfg.local_ranks_filter.split(","))) if cfg.local_ranks_filter else None
    logs = _logs_specs_class()(log_dir=log_dir or cfg.log_dir, redirects=_std(cfg.redirects), tee=_std(cfg.tee),
                            local_ranks_filter=ranks)
    return LaunchConfig(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=cfg.rdzv_id,
        role=cfg.role,
        rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_backend=cfg.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval,
        start_method="spawn",
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", LINE_PREFIX),
        local_addr=cfg.local_addr,
        logs_specs=logs,
        shutdown_timeout=cfg.shutdown_timeout,
    )


def _tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=n)]
    except OSError:
        return []


def _how(failure) -> str:
    return exit_words(failure.exitcode)


def exit_words(code: int | None) -> str:
    """How a rank ended, from its exit code as Popen gives it (-N: killed by signal N); the
    failure report's words, and storewatch's."""
    if code is not None and code < 0:
        try:
            name = f"{signal.Signals(-code).name} "
        except ValueError:  # a real-time signal has no name
            name = ""
        return f"was killed by signal {name}({-code})"
    return f"exited with code {code}"


def root_cause(failures: dict) -> int:
    """The global rank whose failure started it all: the earliest timestamp, and among equal
    ones the failure the agent saw first.

    torch's timestamps are whole seconds, so the rank that failed and the ranks the agent then
    stopped usually tie. The agent records the failures it finds before stopping the others
    first (``failures`` keeps that order), so the tie goes to the first entry, as torch's own
    report does. Neither the lowest rank nor the exit status may break it: a rank stopped by
    the agent can exit non-zero from its own SIGTERM handler, and a rank that a scheduler or a
    person SIGTERMed is the root cause although it died of that signal."""
    order = {rank: i for i, rank in enumerate(failures)}
    return min(failures, key=lambda rank: (failures[rank].timestamp, order[rank]))


def describe_failure(rank: int, failure, node, host: str, logs: dict | None = None) -> str:
    """The root-cause paragraph for one failed rank (``failure``: torch's ProcessFailure;
    ``node``: this node's GROUP_RANK, as the rendezvous assigned it: nodes may run different
    numbers of ranks, so it is not rank // nproc_per_node; ``logs``: stream name -> log file of
    that rank, when its output was captured)."""
    how = _how(failure)
    lines = [f"neuronrun: rank {rank} (local rank {failure.local_rank}, node {node}, host {host}, "
             f"pid {failure.pid}) {how}"]
    msg = getattr(failure, "message", None)
    if isinstance(msg, dict):
        msg = msg.get("message")
    if msg and "To enable traceback" not in str(msg) and not str(msg).startswith("Signal "):
        lines.append("  error: " + str(msg).strip().replace("\n", "\n    "))
    shown = captured = False
    for stream, path in (logs or {}).items():
        captured = captured or bool(path and path != os.devnull and Path(path).is_file())
        tail = _tail(Path(path)) if path and path != os.devnull else []
        if tail:
            shown = True
            lines.append(f"  last {len(tail)} lines of its {stream} ({path}):")
            lines.extend("    " + t for t in tail)
    if not shown:
        lines.append("  (it wrote nothing to stdout or stderr)" if captured else
                     "  (its output was not captured: run with --tee 3 or --redirects 3 to see it here)")
    return "\n".join(lines)


def exit_code_of(failure) -> int:
    code = failure.exitcode
    if code is None:
        return 1
    return 128 - code if code < 0 else (code or 1)


def _only_in_files(dest) -> bool:
    """Whether some rank's output reached only its files: a stream written to a log file that
    the agent does not copy to the terminal (redirected and not teed, or teed but left out by
    --local-ranks-filter). ``dest``: torch's LogsDest of the last attempt (every attempt has the
    same layout), None if no rank was started. Decided from where the streams went, not from
    the flags: a stream both redirected and teed reached the terminal too, and a rank left out
    by --local-ranks-filter whose stream was not captured wrote to /dev/null, not to a file."""
    if dest is None:
        return False
    for files, teed in ((dest.stdouts, dest.tee_stdouts), (dest.stderrs, dest.tee_stderrs)):
        for local_rank, path in files.items():
            if path and path != os.devnull and teed.get(local_rank) != path:
                return True
    return False


def _copy_error_file(failure) -> None:
    """Copy the root-cause rank's error file (written by its ``@record``) to neuronrun's own
    $TORCHELASTIC_ERROR_FILE, as torchrun's ``@record`` main does: whatever started neuronrun
    with that variable set (a scheduler, an outer torchrun) reads the rank's error there.
    Nothing is written when the variable is unset or the rank left no error file."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or not os.path.isfile(failure.error_file):
        return
    try:
        get_error_handler().dump_error_file(failure.error_file, failure.exitcode)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable or not torch's format
        print(f"neuronrun: could not copy {failure.error_file} to $TORCHELASTIC_ERROR_FILE: {exc}", file=sys.stderr,
              flush=True)


def launch(cfg: RunConfig) -> int:
    """Run the job on this node; returns neuronrun's exit code."""
    os.environ[PLAN_VAR] = cfg.plan.to_json()  # the agent copies os.environ into every rank
    threads = None if cfg.plan.host_cpus else cfg.plan.omp_threads(0)  # (bound ranks get their share's
    if threads and "OMP_NUM_THREADS" not in os.environ:                 # size from the worker trampoline)
        os.environ["OMP_NUM_THREADS"] = threads
    # torch's elastic modules before the directories: importing them takes about a second, and a
    # SIGTERM then ends neuronrun at once (torch installs its handlers as the first ranks start),
    # which left both directories behind. What remains is the agent's start, a tenth of a second
    # on one node, and a multi-node rendezvous: a Python handler would not run while torch's
    # static store waits in C++ (Ctrl-C does not stop that wait either)
    import torch.distributed.launcher.api  # noqa: F401

    own_log_dir = groups_dir = None
    try:
        # each name bound before its directory is made (not tempfile.mkdtemp, which binds it
        # after): a Ctrl-C landing inside mkdtemp, past its mkdir, left a directory that the
        # cleanup below did not know of
        if not cfg.log_dir:
            own_log_dir = _fresh_dir_name("neuronrun_")
            os.mkdir(own_log_dir, 0o700)
        groups_dir = _fresh_dir_name("neuronrun_groups_")
        os.mkdir(groups_dir, 0o700)
        os.environ[GROUPS_VAR] = groups_dir
        os.environ[AGENT_VAR] = str(os.getpid())  # the ranks' parent (the trampoline's check)
        if cfg.rdzv_backend != "static" and cfg.max_nodes > 1:
            # A fresh store for each round's ranks. torch's agents share the rendezvous store with
            # the ranks and keep it across rounds, and ranks can tell rounds apart only by their
            # node's restart count, which a round begun by another node's failure (a membership
            # change) does not raise: after one rank's failure the other nodes' new ranks met the
            # failed round's keys (the backend's and torch's own), failed on its dead ranks, and
            # spent a restart of their own. Unshared, each round's rank 0 hosts a new store.
            os.environ.setdefault(UNSHARED_STORE_VAR, "1")
        config = launch_config(cfg, own_log_dir)
        config.logs_specs.groups_dir = groups_dir
        return _run(cfg, config, own_log_dir)
    finally:
        _clean_up(groups_dir, own_log_dir)


def _fresh_dir_name(prefix: str) -> str:
    """An unused, unguessable name in the temporary directory, as tempfile.mkdtemp picks one
    (a name taken meanwhile makes os.mkdir raise FileExistsError: 64 random bits make that a
    bug or an attack, not a race to retry)."""
    return os.path.join(tempfile.gettempdir(), prefix + secrets.token_hex(8))


def _clean_up(groups_dir: str | None, own_log_dir: str | None) -> None:
    """What every end of the job leaves to do: kill what the ranks left running, remove the
    process-group directory, and neuronrun's own log directory if it holds nothing to read."""
    if groups_dir:
        sweep_groups(groups_dir)
        shutil.rmtree(groups_dir, ignore_errors=True)
    # a log directory whose files are all empty (Ctrl-C before the ranks started, the agent's
    # own error such as a --master-port in use, ranks that failed without a word: the report
    # says "it wrote nothing" and names no file) holds nothing to read
    if own_log_dir and not _holds_output(own_log_dir):
        shutil.rmtree(own_log_dir, ignore_errors=True)


def _output_kept(own_log_dir: str | None, dest) -> bool:
    """Whether neuronrun keeps its log directory at a job's end, and says where it is: some output
    reached only its files (`_only_in_files`) and some file there holds any. One whose files are
    all empty (ranks that wrote nothing under --redirects) goes (`_clean_up`): the line naming it
    pointed at a directory already removed."""
    return bool(own_log_dir) and _only_in_files(dest) and _holds_output(own_log_dir)


def _holds_output(folder: str) -> bool:
    for where, _, files in os.walk(folder):
        for f in files:
            try:
                if os.path.getsize(os.path.join(where, f)):
                    return True
            except OSError:  # (gone meanwhile)
                pass
    return False


def store_watch(cfg: RunConfig, groups_dir: str, own_log_dir: str | None):
    """A StoreWatch for a c10d rendezvous (storewatch.py), else a no-op context (a static
    rendezvous' agent does not call its store while it monitors the ranks). The bound is the
    store's read_timeout (--rdzv-conf)."""
    from contextlib import nullcontext
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint

    from .storewatch import DEFAULT_READ_TIMEOUT, StoreWatch

    if cfg.rdzv_backend != "c10d":
        return nullcontext()
    try:
        bound = float(_parse_rendezvous_config(cfg.rdzv_conf).get("read_timeout", DEFAULT_READ_TIMEOUT))
        host, port = parse_rendezvous_endpoint(cfg.rdzv_endpoint, default_port=DEFAULT_PORT)
    except ValueError:  # torch's rendezvous refuses these values itself, in its own words
        return nullcontext()
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return StoreWatch(groups_dir, endpoint, bound, lambda: _clean_up(groups_dir, own_log_dir))


def port_taken(cfg: RunConfig) -> str:
    """What to say when the static rendezvous' store cannot listen because its port is in use: the
    port is taken on this node (node 0 hosts the store), not a node gone, and which flag moves it."""
    flag = "--rdzv-endpoint" if cfg.sources.get("rdzv_endpoint", "default") != "default" else "--master-port"
    port = cfg.rdzv_endpoint.rpartition(":")[2]
    return (f"port {port} is taken on this node (another process listens on it: another job, or a neuronrun "
            f"still running); pass another {flag}; no rank was started")


def _run(cfg: RunConfig, config, own_log_dir: str | None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.elastic.multiprocessing import tail_log
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed import DistNetworkError, DistStoreError

    from .tail import tail_whole_lines

    tail_log.tail_logfile = tail_whole_lines  # the agent's per-rank output copier; see tail.py
    entrypoint, args = worker_command(cfg)
    if cfg.max_nodes > 1 and threading.current_thread() is threading.main_thread():
        # the rendezvous waits for the other nodes in torch's C++ store, where Python's Ctrl-C
        # handler never runs: Ctrl-C was lost (the node kept waiting and ran the job when the
        # others came). The default action ends neuronrun at once, as SIGTERM's does; torch
        # installs its own handlers as the ranks start. (Only the main thread may set handlers:
        # a program that runs launch() on another thread keeps its own.)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        with store_watch(cfg, config.logs_specs.groups_dir, own_log_dir):
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        rank = root_cause(err.failures)
        first = err.failures[rank]
        dest = config.logs_specs.last_dest
        logs = {}
        if dest is not None:
            logs = {"stderr": dest.stderrs.get(first.local_rank), "stdout": dest.stdouts.get(first.local_rank)}
        node = config.logs_specs.node_rank
        _copy_error_file(first)
        report = [describe_failure(rank, first, "?" if node is None else node, socket.gethostname(), logs)]
        others = [f"{r} ({_how(f)})" for r, f in sorted(err.failures.items()) if r != rank]
        if others:
            report.append(f"neuronrun: then stopped: rank {', rank '.join(others)}")
        report.append("neuronrun: job failed; every rank on this node is stopped")
        print("\n".join(report), file=sys.stderr, flush=True)
        return exit_code_of(first)
    except RendezvousTimeoutError as err:  # too few nodes came (its text is empty)
        print(f"neuronrun: the rendezvous timed out ({type(err).__name__}{': ' if str(err) else ''}{err}): fewer "
              f"than {cfg.min_nodes} node{'s' if cfg.min_nodes > 1 else ''} (--nnodes) joined it within its join "
              f"time-out (--rdzv-conf join_timeout=SECONDS, 600 by default); every rank on this node is stopped",
              file=sys.stderr, flush=True)
        return 1
    except RendezvousError as err:  # the node holding the rendezvous store went away, or it was closed
        print(f"neuronrun: the rendezvous failed ({type(err).__name__}: {err}); the node that holds its "
              f"store (--rdzv-endpoint) may be gone; every rank on this node is stopped", file=sys.stderr,
              flush=True)
        return 1
    except (DistNetworkError, DistStoreError) as err:  # a static rendezvous's store (node 0's agent)
        text = str(err).splitlines()[0] if str(err) else ""
        if isinstance(err, DistStoreError) and "waiting for clients" in text:  # node 0 holds it: the others never came
            print(f"neuronrun: the rendezvous timed out ({type(err).__name__}: {text}): fewer than {cfg.min_nodes} "
                  f"nodes (--nnodes) joined it within its time-out (--rdzv-conf timeout=SECONDS); every rank on "
                  f"this node is stopped", file=sys.stderr, flush=True)
            return 1
        if "EADDRINUSE" in text or "address already in use" in text:  # this node is node 0 and cannot host it
            print(f"neuronrun: the rendezvous store could not start ({type(err).__name__}: {text}): {port_taken(cfg)}",
                  file=sys.stderr, flush=True)
            return 1
        print(f"neuronrun: the rendezvous store failed ({type(err).__name__}: {text}); the node that holds it "
              f"(node 0, --master-addr) may be gone; every rank on this node is stopped", file=sys.stderr, flush=True)
        return 1
    except SignalException as sig:
        kept = ""
        if _output_kept(own_log_dir, config.logs_specs.last_dest):
            kept = f"; the output that went only to files is in {own_log_dir}"
        elif own_log_dir:  # every line was also on the terminal (or none written): nothing the report points at
            shutil.rmtree(own_log_dir, ignore_errors=True)
        print(f"neuronrun: received {signal.Signals(sig.sigval).name}, stopped every rank{kept}",
              file=sys.stderr, flush=True)
        return 128 + int(sig.sigval)
    if _output_kept(own_log_dir, config.logs_specs.last_dest):  # some output's only copy: kept, as torchrun does
        print(f"neuronrun: the output that went only to files is in {own_log_dir}", file=sys.stderr, flush=True)
    elif own_log_dir:  # success: nothing to look at; failures keep their logs for the report's paths
        shutil.rmtree(own_log_dir, ignore_errors=True)
    return 0
