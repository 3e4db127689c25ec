"""Worker trampoline: set one rank's Neuron environment, then become the user's program.

The elastic agent starts ``python -u .../worker.py MODE SCRIPT ARGS...`` for every
local rank with torch's variables (RANK, LOCAL_RANK, MASTER_ADDR, ...) set. Why a
trampoline rather than environment computed in the launcher:

* The agent builds each rank's environment itself, with no per-rank hook, and
  with c10d rendezvous MASTER_ADDR/MASTER_PORT (hence NEURON_RT_ROOT_COMM_ID) are
  only known after rendezvous, inside the agent. Subclassing the agent would mean
  depending on its private ``_start_workers``; the trampoline uses only the
  documented worker variables and survives torch upgrades.
* It ``exec``s the program instead of ``runpy``-ing it: the rank keeps the pid the
  agent monitors and signals, the program gets a pristine interpreter exactly as
  under torchrun (``sys.path[0]``, ``__main__`` pickling for multiprocessing,
  no launcher modules loaded), and ``--no-python`` executables work the same way.
* It is started by file path, not ``-m``, so it works from a source checkout as well
  as an installed package; the ``sys.path`` tweak that allows this dies with ``exec``.

With ``--cpu-bind core`` it binds the rank to its share of the node's CPUs before
``exec`` (the affinity mask survives ``exec`` and is inherited by the rank's threads
and children), so the program starts already placed.

Before ``exec`` it asks Linux to SIGKILL the rank if the agent dies
(PR_SET_PDEATHSIG survives exec), so even a SIGKILLed ``neuronrun`` leaves no ranks
behind, and records its process group so the launcher can kill what a finished or
failed rank left running (see ``launch.sweep_groups``).
"""

from __future__ import annotations

import os
import re
import sys

if __package__ in (None, ""):  # started by file path: make the package importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from neuronrun_launcher.plan import PLAN_VAR, NeuronPlan, format_cpus, neuron_env  # noqa: E402
else:
    from .plan import PLAN_VAR, NeuronPlan, format_cpus, neuron_env

MODES = ("python", "module", "exec")
GROUPS_VAR = "NEURONRUN_GROUPS_DIR"
AGENT_VAR = "NEURONRUN_AGENT_PID"  # the process that starts the ranks (neuronrun, torch's agent in it)


def _plan(environ: dict[str, str]) -> tuple[NeuronPlan, int]:
    """The launcher's plan and this rank's local rank, from the variables the agent set."""
    try:
        return NeuronPlan.from_json(environ[PLAN_VAR]), int(environ["LOCAL_RANK"])
    except KeyError as exc:
        raise RuntimeError(f"{exc.args[0]} is not set; this program is started by neuronrun, not by hand") from None


# What an MPI launcher (mpirun/prterun, MPICH's hydra, srun --mpi=pmi2/pmix) gives each process it
# starts to make it one MPI process: its rank and world, and the handles of the launcher's daemon it
# reports to. Under `mpirun -N 1 neuronrun ...` they describe the launcher's MPI process, not its
# ranks, which are no MPI processes: a rank that kept them took itself for one (MPI transport, K
# ranks sharing one MPI rank) and an MPI_Init in it would join the launcher's job. Only these go,
# and only under such a launcher: the user's own configuration (OMPI_MCA_*, PMIX_MCA_*,
# OMPI_ALLOW_RUN_AS_ROOT*, OPAL_PREFIX) reaches the ranks as under torchrun, so that a rank's own
# `mpirun` runs as the user set it up (stripping every OMPI_/PMIX_/PMI_/OPAL_/PRTE_ variable made
# that `mpirun`, as root, refuse to start).
MPI_LAUNCHER_MARKS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")  # set in every process one starts
MPI_PROCESS_VARS = re.compile(
    r"OMPI_COMM_WORLD_|OMPI_WORLD_|OMPI_APP_CTX_|OMPI_(UNIVERSE_SIZE|NUM_APP_CTX|FIRST_RANKS|FILE_LOCATION"
    r"|ARGV|COMMAND)$"
    # mpirun's per-process MCA values; orte_*/ess*: Open MPI <= 4's daemon URIs, job id and vpid
    r"|OMPI_MCA_(initial_wdir|num_procs|ess|ess_.*|orte_.*)$"
    r"|PMIX_SERVER_|PMIX_DSTORE_|PMIX_(RANK|NAMESPACE|ID|APPNUM|HOSTNAME|VERSION|SECURITY_MODE|GDS_MODULE"
    r"|BFROP_BUFFER_TYPE|PTL_MODULE|SYSTEM_TMPDIR|PARAM_FILE_PASSED)$"
    r"|PMI_(?!MCA_)|MPI_LOCAL(RANKID|NRANKS)$"  # PMI-1/2 (hydra, srun --mpi=pmi2): PMI_RANK/SIZE/FD/JOBID/PORT...
    r"|PRTE_(?!MCA_)")  # prterun's (PRTE_LAUNCHED, ...)


def under_mpi_launcher(environ: dict[str, str]) -> bool:
    """Whether neuronrun itself was started by an MPI launcher (its variables reach the ranks
    through the agent, which copies neuronrun's environment)."""
    return any(k in environ for k in MPI_LAUNCHER_MARKS)


def mpi_process_var(name: str) -> bool:
    """Whether ``name`` is one of an MPI launcher's per-process variables (MPI_PROCESS_VARS)."""
    return MPI_PROCESS_VARS.match(name) is not None


def rank_env(environ: dict[str, str], plan: NeuronPlan | None = None) -> dict[str, str]:
    """The full environment of the rank: ``environ`` (as the agent built it) plus Neuron's.

    The launcher already reconciled the user's exported Neuron variables with the plan,
    so the plan's values win here (the exported NEURON_RT_VISIBLE_CORES is the node's
    pool, and each rank gets its own slice of it). Under an MPI launcher the launcher's per-process
    MPI variables are left out (MPI_PROCESS_VARS). ``plan``: already parsed from ``environ``."""
    if plan is None:
        plan, _ = _plan(environ)
    local_rank = int(environ["LOCAL_RANK"])
    try:
        master_addr, master_port = environ["MASTER_ADDR"], environ["MASTER_PORT"]
    except KeyError as exc:
        raise RuntimeError(f"{exc.args[0]} is not set; this program is started by neuronrun, not by hand") from None
    drop_mpi = under_mpi_launcher(environ)
    env = {k: v for k, v in environ.items()
           if k not in (PLAN_VAR, GROUPS_VAR, AGENT_VAR) and not (drop_mpi and mpi_process_var(k))}
    env.update(neuron_env(plan, local_rank, master_addr, master_port))
    if plan.host_cpus and "OMP_NUM_THREADS" not in env:  # bound: one intra-op thread per CPU of the share
        env["OMP_NUM_THREADS"] = plan.omp_threads(local_rank)
    return env


def bind_cpus(cpus: tuple[int, ...]) -> str | None:
    """Bind this process to the rank's CPUs (none: unbound); a warning if that failed."""
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return f"--cpu-bind core: cannot bind to CPUs {format_cpus(cpus)} ({exc}); running unbound"
    return None


def command(mode: str, target: str, args: list[str], python: str) -> list[str]:
    if mode == "python":
        return [python, "-u", target, *args]
    if mode == "module":
        return [python, "-u", "-m", target, *args]
    if mode == "exec":
        return [target, *args]
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        # the agent died before prctl took effect: this rank was handed to another parent. The
        # agent's pid comes from the launcher: neuronrun may itself be pid 1 (a container's
        # command), where "our parent is pid 1" is no sign of anything
        agent = os.environ.get(AGENT_VAR, "")
        if os.getppid() != int(agent) if agent.isdigit() else os.getppid() == 1:
            os._exit(1)
    except (OSError, AttributeError):
        pass


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (the state first), or None if there is no
    such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), or
    None if there is no such process: with its pid, it names one process for good."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def read_group(path: str) -> tuple[str, str]:
    """(start time, global rank) from a file ``_register_group`` wrote; "" for a start time
    that was not known, "?" for an unknown rank. OSError if it cannot be read."""
    with open(path) as f:
        fields = f.read().split()
    started = fields[0] if fields and fields[0] != "-" else ""
    return started, fields[1] if len(fields) > 1 else "?"


def _register_group() -> None:
    """Leave this rank's process group id (= its pid: the agent starts ranks in a new
    session) where the launcher sweeps leftovers: the agent only signals ranks that
    are still running, so children of a rank that exited would otherwise outlive the job.
    The file holds the rank's start time, so that the sweep can tell the rank from a
    later process that was given its pid (launch.sweep_groups), then its global rank, so
    that a report written while the agent is stuck can name it (storewatch)."""
    groups = os.environ.get(GROUPS_VAR)
    if groups and os.getpgid(0) == os.getpid():
        try:
            with open(os.path.join(groups, str(os.getpid())), "w") as f:
                f.write(f"{start_time(os.getpid()) or '-'} {os.environ.get('RANK', '?')}")
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit("usage: worker.py {python|module|exec} SCRIPT [ARGS...] (started by neuronrun)")
    mode, target, args = argv[0], argv[1], argv[2:]
    try:
        plan, local_rank = _plan(dict(os.environ))
        env = rank_env(dict(os.environ), plan)
        # torchrun's ranks run $PYTHON_EXEC (a wrapper, say, that adds interpreter options); the
        # trampoline itself runs under neuronrun's interpreter (launch.worker_command)
        cmd = command(mode, target, args, os.environ.get("PYTHON_EXEC") or sys.executable)
        warning = bind_cpus(plan.cpus(local_rank))
    except (RuntimeError, ValueError) as exc:
        print(f"neuronrun worker (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if warning:
        print(f"neuronrun worker (rank {env.get('RANK', '?')}): {warning}", file=sys.stderr, flush=True)
    _die_with_parent()
    _register_group()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"neuronrun worker (rank {env.get('RANK', '?')}): cannot run {cmd[0]!r}: {exc}", file=sys.stderr,
              flush=True)
        sys.exit(127)


if __name__ == "__main__":
    main()
