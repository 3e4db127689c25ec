"""Running under mpirun or srun without torchrun: derive torch's rendezvous variables.

`init_process_group("neuron")` with the default env:// method needs RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Under Open MPI (OMPI_COMM_WORLD_*), MPICH/PMI (PMI_RANK/PMI_SIZE)
or an srun task (SLURM_PROCID/SLURM_NTASKS) the rank and size are known. Only under Open MPI
(OMPI_COMM_WORLD_RANK set) are the master address and a free port agreed through MPI itself
(rank 0 broadcasts them, choosing an address the other hosts reach: `master_addr`) when mpi4py
is installed; otherwise they must be exported
(`mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500`, or `export` before `srun`). Variables the
user already set always win.

A worker of torch's elastic agent (torchrun, neuronrun) takes nothing from them: under
`mpirun -N 1 torchrun ...` it inherits the agent's MPI variables, which name the agent's MPI rank
(shared by the node's workers), not its own; torchrun gives it RANK, WORLD_SIZE and MASTER_*.

Slurm's variables count only inside an srun task: a batch script or `salloc` shell carries
SLURM_PROCID=0 and SLURM_NTASKS of the whole allocation too, and a process started from it
(`python train.py` on the first node) is no rank of an N-task job; taking it for one made
`init_process_group` wait its whole time-out for ranks that never come.

Inside an srun task the node's task count and the node number come from Slurm too:
SLURM_NTASKS_PER_NODE is set only when `--ntasks-per-node` was given, so `srun -N2 -n128` left
LOCAL_WORLD_SIZE unset, the placement took all 128 ranks for one node and refused the job ("128
processes per node but trn2.48xlarge ... has only 64"). The step's own per-node counts
(SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE, compressed as "64(x2),3") at this node's
index (SLURM_NODEID) give the local size, and SLURM_NODEID the node (as GROUP_RANK, torchrun's
name for it) unless the environment already names one. So too when the rank came from MPI's
variables in an srun task: `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE, and no local numbers
(MPI_LOCALRANKID is MPICH's mpiexec's), so the task's own SLURM_LOCALID and node counts apply;
an MPI launcher's local numbers, where it gives them, still win (see `_this_srun_task`).
"""
from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import warnings
from typing import Mapping

from .ports import free_port
from .topology.placement import node_named

# Set in every process an MPI launcher starts (mpirun; srun --mpi=pmix or pmi2), and inherited by
# whatever that process starts in turn
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # (PMIx exports no world size)
# Set by torch's elastic agent (torchrun, neuronrun) in every worker it starts
ELASTIC_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

_SOURCES = (  # (rank, size, local rank, local size)
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


# Slurm step ids that are not srun steps: the batch script's, the extern step's and salloc's
# interactive one, by name or as the reserved numbers at the top of the 32-bit range that Slurm
# gives such steps. The same rule as neuronrun's scheduler.detect
# (launcher/neuronrun_launcher/scheduler.py, _NON_SRUN_STEPS), kept here rather than imported:
# neuron_dist may not import the launcher, and the launcher imports neuron_dist only lazily
# (it must start without torch); tests/test_config.py checks that the two agree.
_NON_SRUN_STEPS = frozenset({"batch", "extern", "interactive", "4294967290", "4294967291", "4294967292",
                             "4294967293", "4294967294", "4294967295"})


def in_srun_task(env=os.environ) -> bool:
    """Whether this process is a task srun started (not a batch script or salloc shell)."""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    return "SLURM_LAUNCH_NODE_IPADDR" in env or (step != "" and step not in _NON_SRUN_STEPS)


_TASK_COUNTS = re.compile(r"(\d+)(?:\(x(\d+)\))?", re.ASCII)  # one entry of "64(x2),3"


def slurm_tasks_per_node(spec: str) -> list[int] | None:
    """Slurm's compressed task counts, one per node of the step: "64(x2),3" -> [64, 64, 3]
    (None when `spec` is not of that form)."""
    out: list[int] = []
    for part in spec.replace(" ", "").split(","):
        m = _TASK_COUNTS.fullmatch(part)
        if m is None:
            return None
        out.extend([int(m[1])] * int(m[2] or 1))
    return out


def _slurm_node_vars(env, sources: dict) -> dict[str, str]:
    """This srun task's local size and node number (see the module docstring): LOCAL_WORLD_SIZE
    from the step's count on node SLURM_NODEID (before SLURM_NTASKS_PER_NODE, which is the
    request, may be inherited from the batch script and says nothing of an uneven last node),
    and GROUP_RANK = SLURM_NODEID unless GROUP_RANK, NODE_ID or NODE_RANK is already set."""
    node = env.get("SLURM_NODEID", "")
    if not node.isdigit():
        return {}
    out = {} if node_named(env) else {"GROUP_RANK": node}
    sources.update(GROUP_RANK="SLURM_NODEID")
    spec_var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    counts = slurm_tasks_per_node(env.get(spec_var) or "")
    if counts and int(node) < len(counts):
        out["LOCAL_WORLD_SIZE"] = str(counts[int(node)])
        sources.update(LOCAL_WORLD_SIZE=f"{spec_var} at SLURM_NODEID {node}")
    return out


def elastic_worker(env=os.environ) -> str | None:
    """The variable that marks this process as a worker of torch's elastic agent (torchrun,
    neuronrun), if one is set. Such a worker inherits the MPI and Slurm variables of the agent
    that mpirun or srun started (`mpirun -N 1 torchrun --nproc-per-node K`): they name the agent's
    MPI rank, which the node's K workers share, and none of them is that MPI process."""
    return next((k for k in ELASTIC_VARS if k in env), None)


def not_an_mpi_rank(env=os.environ) -> str | None:
    """None where this process is a rank of an MPI job, one that mpirun (or srun --mpi=pmix/pmi2)
    started itself; otherwise why not, as a clause ("it is ..."). The MPI variables alone do not
    say so: a torchrun worker under mpirun inherits its agent's, and took itself for MPI rank
    N beside the node's other workers (the mpi transport then refused the job, "ranks 2 and 3
    are both MPI rank 1", or a restarted worker blocked in MPI_Init for good). So also: no
    elastic agent's variables, and RANK and WORLD_SIZE, where set, the MPI world's own rank and
    size (a process some other launcher inside the job numbered is no rank of that world).
    Read from the environment only: asking MPI would start it, which is what must not happen
    in a process that is no MPI rank."""
    rank_var = next((k for k in MPI_RANK_VARS if k in env), None)
    if rank_var is None:
        return (f"it was not started by mpirun or as an MPI process (none of {', '.join(MPI_RANK_VARS)} is set: "
                f"srun needs --mpi=pmix or pmi2)")
    elastic = elastic_worker(env)
    if elastic:
        return (f"it is a worker of torchrun or neuronrun ({elastic} is set), whose {rank_var}={env[rank_var]} "
                f"is inherited from the agent that mpirun started: the agent is that MPI process, not its workers")
    size_var = next((k for k in _MPI_SIZE_VARS if k in env), None)
    for var, mpi_var in (("RANK", rank_var), ("WORLD_SIZE", size_var)):
        if var in env and mpi_var and env[var].strip() != env[mpi_var].strip():
            return (f"its {var}={env[var]} is not the MPI job's {mpi_var}={env[mpi_var]}: another launcher "
                    f"inside the MPI job numbered it")
    return None


def launcher_vars(env=os.environ, sources: dict | None = None) -> dict[str, str]:
    """torch's variables implied by an MPI/Slurm environment (empty when not under one; Slurm's
    only inside an srun task, where the node number comes too, also for a rank numbered by
    MPI's variables without local ones, as `srun --mpi=pmi2` starts it; none in a worker of
    torch's elastic agent, whose MPI and Slurm variables are its agent's: see `elastic_worker`).
    `sources`, if given, is filled with the variable each value came from (for errors)."""
    sources = {} if sources is None else sources
    if elastic_worker(env):
        return {}
    for rank, size, lrank, lsize in _SOURCES:
        if rank in env and size in env:
            if rank == "SLURM_PROCID" and not in_srun_task(env):
                continue
            out = {"RANK": env[rank], "WORLD_SIZE": env[size]}
            sources.update(RANK=rank, WORLD_SIZE=size)
            if rank == "SLURM_PROCID" or (lrank not in env and lsize not in env and _this_srun_task(env, out)):
                return dict(out, **_slurm_local_vars(env, sources))
            if lrank in env:
                out["LOCAL_RANK"] = env[lrank]
                sources.update(LOCAL_RANK=lrank)
            if lsize in env and env[lsize].isdigit():
                out["LOCAL_WORLD_SIZE"] = env[lsize]
                sources.update(LOCAL_WORLD_SIZE=lsize)
            return out
    return {}


def _this_srun_task(env, found: Mapping[str, str]) -> bool:
    """Whether Slurm's task variables describe this process, which an MPI launcher numbered
    `found` (RANK, WORLD_SIZE) without local numbers of its own: `srun --mpi=pmi2` sets PMI_RANK
    and PMI_SIZE but not MPICH's MPI_LOCALRANKID/MPI_LOCALNRANKS, and every task was taken for
    one node ("4 processes per node but ... only 2"). It is that srun task when Slurm numbers it
    alike. Not so under mpirun or mpiexec inside an allocation: their ranks inherit the
    variables of the srun step that started the launcher's daemons (one task per node, each
    rank SLURM_LOCALID=0), which is why the launcher's own local numbers, where given, win."""
    return (in_srun_task(env) and env.get("SLURM_PROCID", "").strip() == found["RANK"].strip()
            and env.get("SLURM_NTASKS", "").strip() == found["WORLD_SIZE"].strip())


def _slurm_local_vars(env, sources: dict) -> dict[str, str]:
    """An srun task's LOCAL_RANK (SLURM_LOCALID), LOCAL_WORLD_SIZE and GROUP_RANK (see
    `_slurm_node_vars`; SLURM_NTASKS_PER_NODE, the request, where the step's counts are missing)."""
    out = {}
    if "SLURM_LOCALID" in env:
        out["LOCAL_RANK"] = env["SLURM_LOCALID"]
        sources.update(LOCAL_RANK="SLURM_LOCALID")
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        out["LOCAL_WORLD_SIZE"] = env["SLURM_NTASKS_PER_NODE"]
        sources.update(LOCAL_WORLD_SIZE="SLURM_NTASKS_PER_NODE")
    out.update(_slurm_node_vars(env, sources))
    return out


_MPI_STARTED_BY = 0  # the pid whose `mpi()` started MPI (it, and only it, finalizes MPI at exit)


def mpi():
    """mpi4py's MPI module (ImportError without mpi4py). If nothing in the process had imported it
    yet, this call starts MPI, and neuron_dist, not mpi4py, finalizes it at exit, in this process
    only: mpi4py's own exit hook ran MPI_Finalize in a forked child too (`os.fork()` after
    init_process_group, a child that ends with sys.exit or returns), where Open MPI's finalize
    never returns, and the job hung with the parent waiting on the child (Gloo's did not: it
    starts no MPI). A program that imported mpi4py.MPI first keeps mpi4py's ways."""
    global _MPI_STARTED_BY
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py
        mpi4py.rc.finalize = False
        _MPI_STARTED_BY = os.getpid()  # (_finalize_mpi_at_exit also asks whether mpi4py.MPI was loaded)
    from mpi4py import MPI
    return MPI


@atexit.register  # registered at import, before group.py's _close_at_exit: so it runs after it
def _finalize_mpi_at_exit() -> None:
    """MPI_Finalize, unless the process exits on an uncaught exception: Open MPI's finalize
    waits for every rank, so the rank that raised could not end before the peers it had told
    (its ABORT frames, `group._close_at_exit`), and mpirun's summary, which names the first
    process to exit non-zero, named one of them (5 of 7 runs at three ranks). Unfinalized, it
    ends at once and mpirun names it and ends the job, as it does for a Gloo job's rank (or,
    under --enable-recovery, lets the others go on)."""
    if _MPI_STARTED_BY == os.getpid() and finalizes_at_exit():
        sys.modules["mpi4py.MPI"].Finalize()


def finalizes_at_exit() -> bool:
    """Whether MPI_Finalize will run as this process exits (neuron_dist's `_finalize_mpi_at_exit`,
    or mpi4py's own where the program imported it): under Open MPI it waits for every rank, so
    this process cannot end before its peers do, and they must not wait for it to
    (`group._close_at_exit`)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return False
    if _MPI_STARTED_BY == os.getpid():
        from .errors import exit_cause
        return exit_cause() is None
    import mpi4py
    return bool(mpi4py.rc.finalize) if mpi4py.rc.finalize is not None else True


def master_addr(hosts: list[str], one_node: bool) -> tuple[str | None, str]:
    """The address rank 0 hands out as MASTER_ADDR, or None, and the reason (a clause) when none.
    `hosts`: every rank's host name, rank 0's first; `one_node`: whether Open MPI counts every
    rank on rank 0's node. On one host: loopback. Across hosts: the address rank 0's name
    resolves to, unless that is loopback (a name mapped to 127.0.0.1, as on this VM, or to
    127.0.1.1 by Debian's and Ubuntu's /etc/hosts: the ranks on other hosts would dial their own
    loopback and wait out the store's connect time-out); then rank 0's address on the route to
    another rank's host, as a rank in a group that spans hosts chooses where to listen
    (`hosts.route_from`); else none."""
    if one_node and len(set(hosts)) == 1:
        return "127.0.0.1", ""
    from .errors import GroupError
    from .hosts import is_loopback, route_from
    try:
        addr = socket.gethostbyname(hosts[0])
    except OSError as e:
        why = f"rank 0's host name {hosts[0]!r} does not resolve ({e})"
    else:
        if not is_loopback(addr):
            return addr, ""
        why = f"rank 0's host name {hosts[0]!r} resolves to {addr}, a loopback address"
    others = list(dict.fromkeys(h for h in hosts if h != hosts[0]))
    for other in others:
        try:
            mine = route_from(other, f"the host {other!r} of another rank")
        except GroupError:
            continue
        if not is_loopback(mine):
            return mine, ""
    return None, why + (f", and no route to the other ranks' hosts ({', '.join(others)}) gives another"
                        if others else ", and the other hosts' ranks report that host name too")


def _master_from_mpi() -> tuple[str | None, str, str] | None:
    """(MASTER_ADDR or None, MASTER_PORT, why no address), as rank 0 chose them, on every rank."""
    try:
        MPI = mpi()
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    hosts = comm.gather(socket.gethostname(), root=0)
    found = None
    if comm.rank == 0:
        try:  # every other rank waits in the broadcast: whatever happens, it must come
            addr, why = master_addr(hosts, comm.size == int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", -1)))
            found = (addr, str(free_port("")), why)  # the port below the ephemeral range: see ports.py
        except Exception as e:  # noqa: BLE001 - told to every rank below
            found = (None, "", f"rank 0 could not choose one: {type(e).__name__}: {e}")
    return comm.bcast(found, root=0)


ADOPTED: dict[str, tuple[str, str]] = {}  # what `adopt` set -> (the launcher's variable it came from, the value)


def adopted_note(names) -> str:
    """" (neuron_dist took LOCAL_RANK=5 from SLURM_LOCALID)": where these of torch's variables
    came from, for an error about their values, if `adopt` set them; else "" (the user set
    them: their names say it)."""
    said = [f"{n}={v} from {src}" for n in names if n in ADOPTED
            for src, v in [ADOPTED[n]] if os.environ.get(n) == v]  # (not one the program set since)
    return f" (neuron_dist took {', '.join(said)})" if said else ""


def adopt() -> None:
    """Fill in RANK/WORLD_SIZE/LOCAL_* and, under Open MPI through MPI, MASTER_ADDR/PORT, where unset."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    sources: dict[str, str] = {}
    found = launcher_vars(sources=sources)
    if not found:
        return
    for k in ("RANK", "WORLD_SIZE"):  # one set and the other not: most likely left over from elsewhere
        if k in os.environ and os.environ[k] != found[k]:
            warnings.warn(f"neuron_dist: {k}={os.environ[k]} is set in the environment, but this process is "
                          f"{'rank ' + found['RANK'] if k == 'RANK' else found['WORLD_SIZE'] + ' processes'} of "
                          f"its MPI job; the environment's value is kept (ranks that share one rank number then "
                          f"fail to meet): unset {k}, or set both RANK and WORLD_SIZE", stacklevel=2)
    for k, v in found.items():
        if k not in os.environ:
            os.environ[k] = v
            if k in sources:
                ADOPTED[k] = (sources[k], v)
    if ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ) and "OMPI_COMM_WORLD_RANK" in os.environ:
        master = _master_from_mpi()
        if master:
            addr, port, why = master
            if addr:
                os.environ.setdefault("MASTER_ADDR", addr)
            elif "MASTER_ADDR" not in os.environ:  # init_process_group then fails at once, for want of it
                warnings.warn(f"neuron_dist: MASTER_ADDR is left unset: this MPI job spans hosts, but {why}; "
                              f"set it to an address of rank 0's host that every host reaches "
                              f"(mpirun -x MASTER_ADDR=...)", stacklevel=2)
            if port:
                os.environ.setdefault("MASTER_PORT", port)
