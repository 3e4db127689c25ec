"""Node count, node rank and master address from Slurm or MPI, so batch scripts need no arithmetic.

``neuronrun`` runs once per node (``srun --ntasks-per-node=1`` / ``mpirun -N 1``)
and each copy reads what the scheduler already knows. Only the *task* environment
counts as "under a scheduler": Slurm's step variables (SLURM_STEP_ID) or MPI's
rank variables. A batch script running ``neuronrun`` directly on the first node is
not a multi-node launch, and treating it as one would wait forever for nodes.

The Slurm node list is expanded here (``node[01-04,07]``) rather than by
``scontrol show hostnames``, because scontrol may be absent inside containers and
costs a round trip to slurmctld per node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


class SchedulerError(ValueError):
    """The scheduler environment is inconsistent with one neuronrun per node."""


@dataclass(frozen=True)
class SchedulerInfo:
    name: str  # "slurm" or "mpi"
    nnodes: int
    node_rank: int
    master_addr: str | None  # None: the scheduler does not say (MPI)
    hosts: tuple[str, ...] = ()
    job_id: str | None = None


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SchedulerError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SchedulerError(f"unbalanced '[' in node list {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise SchedulerError(f"bad range {item!r} in node list {text!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # Slurm keeps the zero padding of the low bound
        if int(hi) < int(lo):
            raise SchedulerError(f"descending range {item!r} in node list {text!r}")
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, text: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [
        head + num + rest
        for num in _expand_range(m.group(1), text)
        for rest in _expand_one(tail, text)
    ]


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list: ``a[1-2],b`` -> [a1, a2, b]; ``n[01-02]-ib`` -> [n01-ib, n02-ib];
    several bracket groups form their product (``r[1-2]n[1-2]``)."""
    hosts = [h for part in _split_top_level(text) for h in _expand_one(part, text)]
    if not hosts:
        raise SchedulerError(f"empty node list {text!r}")
    return hosts


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            try:
                return int(env[name].split("(")[0])
            except ValueError:
                raise SchedulerError(f"{name}={env[name]!r} is not an integer") from None
    return None


def from_slurm(env: Mapping[str, str]) -> SchedulerInfo:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SchedulerError("under srun but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")
    hosts = tuple(expand_nodelist(nodelist))
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or len(hosts)
    node_rank = _int(env, "SLURM_NODEID")
    if node_rank is None:
        raise SchedulerError("under srun but SLURM_NODEID is not set")
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks is not None and ntasks != nnodes:
        raise SchedulerError(
            f"srun started {ntasks} tasks on {nnodes} nodes; neuronrun must run once per node "
            f"(srun --ntasks-per-node=1 neuronrun ...) and starts the ranks itself"
        )
    return SchedulerInfo("slurm", nnodes, node_rank, hosts[0], hosts, env.get("SLURM_JOB_ID"))


def from_mpi(env: Mapping[str, str]) -> SchedulerInfo:
    size = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    if size is None or rank is None:
        raise SchedulerError("under MPI but OMPI_COMM_WORLD_SIZE/OMPI_COMM_WORLD_RANK are not set")
    if local_size is not None and local_size != 1:
        raise SchedulerError(
            f"mpirun started {local_size} copies of neuronrun on one node; run one per node "
            f"(mpirun -N 1 / --map-by ppr:1:node) and let neuronrun start the ranks"
        )
    # MPI publishes no host list; MASTER_ADDR (mpirun -x MASTER_ADDR) or --master-addr must say
    # (one node needs neither: config._apply_scheduler).
    return SchedulerInfo("mpi", size, rank, env.get("MASTER_ADDR") or None, (), None)


_NON_SRUN_STEPS = {"batch", "extern", "interactive", "4294967290", "4294967291", "4294967292", "4294967293", "4294967294", "4294967295"}


def detect(env: Mapping[str, str], mode: str = "auto") -> SchedulerInfo | None:
    """The scheduler this process runs under, or None. ``mode``: auto, slurm, mpi, none."""
    if mode == "none":
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    # The batch script itself may carry the batch/extern step ids; only srun tasks count.
    in_srun = "SLURM_LAUNCH_NODE_IPADDR" in env or (step != "" and step not in _NON_SRUN_STEPS)
    in_slurm_step = in_srun and "SLURM_NODEID" in env
    in_mpi = "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env
    if mode == "slurm" or (mode == "auto" and in_slurm_step):
        return from_slurm(env)
    if mode == "mpi" or (mode == "auto" and in_mpi):
        return from_mpi(env)
    return None
