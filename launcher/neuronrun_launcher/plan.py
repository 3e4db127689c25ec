"""The Neuron part of a job, shared by the launcher and the worker trampoline.

The launcher decides a :class:`NeuronPlan` once (instance, LNC, cores per rank,
the node's core pool) and passes it to every rank as JSON in ``NEURONRUN_PLAN``.
Each rank then derives its own Neuron variables with :func:`neuron_env` from its
LOCAL_RANK and the MASTER_ADDR/MASTER_PORT the elastic agent chose. The plan is
data only and this module imports nothing heavy: the trampoline runs it before
every rank starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from .slots import Slot, local_slot

PLAN_VAR = "NEURONRUN_PLAN"
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\s]+):(\d{1,5})$")


@dataclass(frozen=True)
class NeuronPlan:
    instance: str
    lnc: int
    chips: int
    cores_per_chip: int  # logical, at this LNC
    cores_per_rank: int
    nproc_per_node: int
    base_core: int  # first core of this node's pool
    pool_cores: int  # cores of the pool (all of the instance unless NEURON_RT_VISIBLE_CORES said otherwise)
    root_comm_id: str | None = None  # user-set NEURON_RT_ROOT_COMM_ID, used as is
    host_cpus: tuple[int, ...] = ()  # --cpu-bind core: the node's CPUs to share out; () = no binding
    thp_env: dict[str, str] = field(default_factory=dict)  # --thp: what every rank gets (thp.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "NeuronPlan":
        fields = json.loads(text)
        fields["host_cpus"] = tuple(fields.get("host_cpus", ()))
        return cls(**fields)

    def cpus(self, local_rank: int) -> tuple[int, ...]:
        """The CPUs local rank `local_rank` is bound to (empty: not bound)."""
        return rank_cpus(self.host_cpus, local_rank, self.nproc_per_node)

    def omp_threads(self, local_rank: int) -> str | None:
        """The OMP_NUM_THREADS local rank `local_rank` gets where none is set: bound (--cpu-bind
        core), one intra-op thread per CPU of its share; unbound, 1 when ranks share the node (as
        torchrun, against oversubscribing its CPUs); else None (torch's own default). One rule for
        launch() (unbound), the rank trampoline (bound) and --dry-run (both)."""
        if self.host_cpus:
            return str(len(self.cpus(local_rank)))
        return "1" if self.nproc_per_node > 1 else None

    def slot(self, local_rank: int) -> Slot:
        return local_slot(
            local_rank,
            nproc_per_node=self.nproc_per_node,
            cores_per_chip=self.cores_per_chip,
            chips=self.chips,
            cores_per_rank=self.cores_per_rank,
            base_core=self.base_core,
            pool_cores=self.pool_cores,
        )


def rank_cpus(host_cpus: tuple[int, ...], local_rank: int, nproc: int) -> tuple[int, ...]:
    """Local rank `local_rank`'s share of `host_cpus`, as ``mpirun --bind-to core`` shares a
    node out: contiguous, even blocks (sizes differ by at most one) in CPU order; with more
    ranks than CPUs, one CPU each, wrapping around. Empty `host_cpus`: no binding."""
    if not host_cpus:
        return ()
    n = len(host_cpus)
    if nproc >= n:
        return (host_cpus[local_rank % n],)
    return tuple(host_cpus[local_rank * n // nproc:(local_rank + 1) * n // nproc])


def format_cpus(cpus: tuple[int, ...]) -> str:
    """``0-3,8,10-11``: a CPU list as taskset and /proc print one."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def check_host_port(value: str, what: str) -> str:
    m = _HOST_PORT.match(value)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{what}={value!r} is not host:port")
    return value


def root_comm_id(plan: NeuronPlan, master_addr: str, master_port: int | str) -> str:
    """The Neuron collectives bootstrap root: the user's value, else ``MASTER_ADDR:MASTER_PORT+1``.

    MASTER_PORT itself is taken by torch's store; the next port is the documented
    convention here (the job's host must leave it free)."""
    if plan.root_comm_id:
        return plan.root_comm_id
    port = int(master_port) + 1
    if port > 65535:
        raise ValueError(f"MASTER_PORT={master_port} leaves no port for NEURON_RT_ROOT_COMM_ID; set it yourself")
    return join_host_port(master_addr, port)


def join_host_port(host: str, port: int | str) -> str:
    """host:port, an IPv6 address in brackets ([::1]:29500), bracketed already or not."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(value: str) -> tuple[str, str]:
    """'host:port' or '[v6 address]:port' -> (host without brackets, port)."""
    host, port = check_host_port(value, "endpoint").rsplit(":", 1)
    return host.strip("[]"), port


def neuron_env(plan: NeuronPlan, local_rank: int, master_addr: str, master_port: int | str) -> dict[str, str]:
    """The variables neuronrun sets in one rank: Neuron's, and torch's huge-page switch (--thp)."""
    slot = plan.slot(local_rank)
    env = {
        "NEURON_RT_VISIBLE_CORES": slot.visible_cores,
        "NEURON_RT_NUM_CORES": str(plan.cores_per_rank),
        "NEURON_LOGICAL_NC_CONFIG": str(plan.lnc),
        "NEURON_RT_ROOT_COMM_ID": root_comm_id(plan, master_addr, master_port),
        "NEURON_DIST_INSTANCE": plan.instance,
    }
    env.update(plan.thp_env)
    return env
