"""From parsed flags and the environment to one validated :class:`RunConfig`.

All decisions live here, before anything is started, so that ``--dry-run``
shows exactly what a real launch would do and every mistake is reported while
the user is still looking at the terminal. Precedence, highest first:
command line, ``NEURONRUN_*``/``PET_*`` variables, the Neuron variables the user
already exported (``NEURON_DIST_INSTANCE``, ``NEURON_LOGICAL_NC_CONFIG``,
``NEURON_RT_NUM_CORES``, ``NEURON_RT_VISIBLE_CORES``, ``NEURON_RT_ROOT_COMM_ID``),
the scheduler (Slurm/MPI), built-in defaults. An explicit value that disagrees
with an exported Neuron variable or with the scheduler is an error, not a silent pick.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import instances, scheduler, thp
from .cli import ParsedArgs
from .plan import NeuronPlan, check_host_port, join_host_port
from .slots import PlacementError, assign_slots, check_cores_per_rank, parse_core_range

DEFAULT_MASTER_PORT = 29500
# The rendezvous backends torch registers itself (torch.distributed.elastic.rendezvous.registry);
# packages may add their own under the "torchrun.handlers" entry point group (_rdzv_backends)
TORCH_RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
_STD = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")


class ConfigError(ValueError):
    """A launch that cannot be right; the message says how to fix it."""


@dataclass(frozen=True)
class RunConfig:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_conf: str
    local_addr: str | None
    max_restarts: int
    monitor_interval: float
    shutdown_timeout: int | None
    role: str
    log_dir: str | None
    redirects: str
    tee: str
    local_ranks_filter: str
    module: bool
    no_python: bool
    script: str | None
    script_args: tuple[str, ...]
    dry_run: bool
    plan: NeuronPlan
    scheduler: scheduler.SchedulerInfo | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        """How the worker trampoline starts the script: python, module or exec."""
        return "exec" if self.no_python else ("module" if self.module else "python")


def parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if len(parts) > 2 or not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {text!r}: expected N or MIN:MAX with 0 < MIN <= MAX")
    return lo, hi


def visible_pool(value: str) -> tuple[int, int]:
    """An exported NEURON_RT_VISIBLE_CORES as the node's pool: (first core, number of cores).

    The Neuron runtime takes a core index, an inclusive range, or (from 2.16 on, per
    aws-neuron-sdk#1024; Ray sets such lists) a comma-separated list of both. neuronrun places a
    node's ranks in one run of consecutive cores, so a list is taken when its cores are such a
    run (``0,1``, ``0-1,2-3``) and refused, saying so, otherwise."""
    if "," not in value:
        return parse_core_range(value)
    cores: list[int] = []
    for part in value.split(","):
        try:
            first, count = parse_core_range(part)
        except PlacementError:
            raise PlacementError(
                f"NEURON_RT_VISIBLE_CORES={value!r}: {part.strip()!r} is not a core index 'a' or an "
                f"inclusive range 'a-b' (the list is comma-separated core indices and ranges)") from None
        cores.extend(range(first, first + count))
    if len(set(cores)) != len(cores):
        raise PlacementError(f"NEURON_RT_VISIBLE_CORES={value!r} lists a core twice")
    lo, hi = min(cores), max(cores)
    if hi - lo + 1 != len(cores):
        raise PlacementError(
            f"NEURON_RT_VISIBLE_CORES={value!r} is not one run of consecutive cores; the Neuron runtime "
            f"takes such a list, but neuronrun places a node's ranks in one run ('a-b'), so export "
            f"one (or run each run's ranks under a neuronrun of its own)")
    return lo, len(cores)


def _pick(args: ParsedArgs, dest: str, env: Mapping[str, str], var: str, conv=str):
    """An explicit flag, else the user's exported Neuron variable; both set and different is an error."""
    exported = env.get(var, "").strip()
    exported_val = None
    if exported:
        try:
            exported_val = conv(exported)
        except ValueError:
            raise ConfigError(f"${var}={exported!r} is not a valid value") from None
    if args.explicit(dest):
        value = args.values[dest]
        if exported_val is not None and exported_val != value:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(
                f"{flag} {value} (from {args.sources[dest]}) conflicts with ${var}={exported}; "
                f"unset {var} or make them agree"
            )
        return value
    return exported_val


def _source(args: ParsedArgs, dest: str, var: str) -> str:
    """Where a value `_pick` returned came from, for an error about it: the flag, else the
    exported variable (the user may never have given the flag the message would name)."""
    if args.explicit(dest):
        return f"--{dest.replace('_', '-')}, from {args.sources[dest]}"
    return f"from ${var}"


def _instance(args: ParsedArgs, env: Mapping[str, str]):
    """The instance model, and the name ranks get in NEURON_DIST_INSTANCE: the model's own
    name, or the file path when the user described the instance in a .json/.toml file."""
    def load(spec: str, source: str):
        try:
            return instances.get_instance(spec)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    exported = env.get("NEURON_DIST_INSTANCE", "").strip()
    if args.explicit("instance"):
        spec = args.values["instance"]
        model = load(spec, f"--instance (from {args.sources['instance']})")
        if exported and load(exported, "$NEURON_DIST_INSTANCE").name != model.name:
            raise ConfigError(f"--instance {spec} (from {args.sources['instance']}) conflicts with "
                              f"$NEURON_DIST_INSTANCE={exported}; unset NEURON_DIST_INSTANCE or make them agree")
    else:
        spec = exported or instances.DEFAULT_INSTANCE
        model = load(spec, "$NEURON_DIST_INSTANCE" if exported else "default instance")
    return model, (spec if spec.endswith((".json", ".toml")) else model.name)


def _neuron_plan(args: ParsedArgs, env: Mapping[str, str], max_nodes: int) -> NeuronPlan:
    model, spec = _instance(args, env)
    if max_nodes > 1 and not model.multi_node:
        raise ConfigError(f"{model.name} is a single-instance type; it cannot run a {max_nodes}-node job")
    lnc = _pick(args, "lnc", env, "NEURON_LOGICAL_NC_CONFIG", int)
    lnc = model.default_lnc if lnc is None else lnc  # 0 is an error below, not the default
    if lnc not in tuple(model.supported_lnc):
        raise ConfigError(f"{model.name} supports LNC {', '.join(map(str, model.supported_lnc))}, not {lnc} "
                          f"({_source(args, 'lnc', 'NEURON_LOGICAL_NC_CONFIG')})")
    cores_per_chip = model.cores_per_chip(lnc)
    total = model.chips * cores_per_chip
    m = _pick(args, "cores_per_rank", env, "NEURON_RT_NUM_CORES", int)
    m = 1 if m is None else m  # 0 is an error below, not the default
    try:
        named = args.sources["cores_per_rank"] if args.explicit("cores_per_rank") else "$NEURON_RT_NUM_CORES"
        check_cores_per_rank(m, cores_per_chip, "--cores-per-rank" if named == "command line" else named)
        visible = env.get("NEURON_RT_VISIBLE_CORES", "").strip()
        base, pool = visible_pool(visible) if visible else (0, total)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None
    nproc_text = str(args.nproc_per_node).strip()
    if nproc_text == "cpu":  # torchrun's value: one rank per CPU this launcher may use
        nproc_text = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if nproc_text == "auto":
        nproc = pool // m
        if nproc == 0:
            raise ConfigError(f"--nproc-per-node auto: {pool} core(s) available, fewer than {m} per rank")
    else:
        try:
            nproc = int(nproc_text)
        except ValueError:
            raise ConfigError(f"--nproc-per-node {nproc_text!r}: expected an integer, 'auto' or 'cpu'") from None
        if nproc < 1:
            raise ConfigError(f"--nproc-per-node {nproc}: must be at least 1")
    root = env.get("NEURON_RT_ROOT_COMM_ID", "").strip() or None
    if root:
        try:
            check_host_port(root, "$NEURON_RT_ROOT_COMM_ID")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    # the CPUs of the node this launcher runs on (each node's neuronrun plans its own ranks)
    host_cpus = ()
    if args.values["cpu_bind"] == "core":
        if not hasattr(os, "sched_getaffinity"):
            raise ConfigError("--cpu-bind core needs Linux (sched_setaffinity)")
        host_cpus = tuple(sorted(os.sched_getaffinity(0)))
    plan = NeuronPlan(spec, lnc, model.chips, cores_per_chip, m, nproc, base, pool, root, host_cpus,
                      thp.rank_vars(args.values["thp"] == "on", env))
    try:  # validates every slot: too many ranks, misaligned pool, pool outside the instance
        assign_slots(1, nproc, cores_per_chip=cores_per_chip, chips=model.chips, cores_per_rank=m,
                     base_core=base, pool_cores=pool)
    except PlacementError as exc:
        where = f" (instance {model.name}, LNC {lnc})"
        raise ConfigError(str(exc) + where) from None
    return plan


def _apply_scheduler(args: ParsedArgs, sched: scheduler.SchedulerInfo, values: dict) -> None:
    if args.explicit("nnodes"):
        lo, hi = parse_nnodes(values["nnodes"])
        if not lo <= sched.nnodes <= hi:
            raise ConfigError(f"--nnodes {values['nnodes']} conflicts with {sched.name}'s {sched.nnodes} nodes; drop "
                              f"--nnodes, or pass --scheduler none to ignore {sched.name}'s values")
    else:
        values["nnodes"] = str(sched.nnodes)
    if args.explicit("node_rank"):
        if values["node_rank"] != sched.node_rank:
            raise ConfigError(f"--node-rank {values['node_rank']} conflicts with {sched.name}'s node rank "
                              f"{sched.node_rank}; drop --node-rank, or pass --scheduler none to ignore "
                              f"{sched.name}'s values")
    else:
        values["node_rank"] = sched.node_rank
    if not args.explicit("master_addr"):
        if sched.master_addr is not None:
            values["master_addr"] = sched.master_addr
        elif sched.nnodes > 1:
            raise ConfigError(f"under {sched.name} the address of node 0 is unknown: pass --master-addr, or "
                              f"export MASTER_ADDR to every task (mpirun -x MASTER_ADDR=<first host>)")
        # else one node (`mpirun -np 1 neuronrun`): node 0 is this one, at the default address, as
        # under `mpirun -np 1 torchrun`
    if values["rdzv_id"] == "none" and sched.job_id:
        values["rdzv_id"] = sched.job_id


def _rdzv_backends() -> tuple[str, ...]:
    """The backends torch's agent can start: its own and those of the packages that register one
    under the "torchrun.handlers" entry point, as torch's registry loads them (read without
    importing torch, so that --dry-run stays fast)."""
    from importlib.metadata import entry_points

    try:
        plugins = tuple(sorted({ep.name for ep in entry_points(group="torchrun.handlers")}))
    except Exception:  # noqa: BLE001 - a broken installed distribution: torch would skip it too
        plugins = ()
    return TORCH_RDZV_BACKENDS + plugins


def _check_rdzv(args: ParsedArgs, backend: str, conf: str) -> None:
    """--rdzv-backend and --rdzv-conf as torch's agent reads them, checked before anything starts
    (--dry-run accepted `--rdzv-backend bogus` and `--rdzv-conf foo`, which torch refuses only once
    the agent runs): a backend it knows, and comma-separated KEY=VALUE items with both parts, the
    rule of torch's _parse_rendezvous_config."""
    if backend not in TORCH_RDZV_BACKENDS:
        known = _rdzv_backends()
        if backend not in known:
            raise ConfigError(f"--rdzv-backend {backend!r} (from {args.sources['rdzv_backend']}): expected one of "
                              f"{', '.join(known)}")
    if not conf.strip():
        return
    for item in conf.strip().split(","):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise ConfigError(f"--rdzv-conf {conf!r} (from {args.sources['rdzv_conf']}): {item.strip()!r} is not "
                              f"KEY=VALUE; expected comma-separated KEY=VALUE items, e.g. join_timeout=900,"
                              f"read_timeout=60")


def _check_standalone(args: ParsedArgs, sched: scheduler.SchedulerInfo | None, min_nodes: int) -> None:
    """--standalone is one node: each neuronrun holds a rendezvous of its own on a free port of its
    own host, which no other node can join. With more nodes to wait for (srun/mpirun on several
    nodes, --nnodes N) every node waited out the join time-out (600 s) and reported too few nodes."""
    if min_nodes <= 1:
        return
    if sched is not None and not args.explicit("nnodes"):
        raise ConfigError(f"--standalone is one node (a rendezvous of its own on this host), but {sched.name} says "
                          f"{sched.nnodes} nodes: drop --standalone (neuronrun takes the nodes and node 0 from "
                          f"{sched.name}), or pass --scheduler none to run one single-node job on each node")
    raise ConfigError(f"--standalone is one node (a rendezvous of its own on this host), but --nnodes "
                      f"{args.values['nnodes']} (from {args.sources['nnodes']}) asks for {min_nodes} or more: drop "
                      f"one of them")


def build_config(args: ParsedArgs, env: Mapping[str, str]) -> RunConfig:
    values = dict(args.values)
    try:
        sched = scheduler.detect(env, values["scheduler"])
    except scheduler.SchedulerError as exc:
        raise ConfigError(str(exc)) from None
    if sched is not None:
        _apply_scheduler(args, sched, values)
    min_nodes, max_nodes = parse_nnodes(values["nnodes"])
    if values["max_restarts"] < 0:
        raise ConfigError("--max-restarts must be >= 0")
    interval = values["monitor_interval"]
    if not (interval > 0 and math.isfinite(interval)):  # torch's agent asserts > 0; nan fails both
        raise ConfigError(f"--monitor-interval {interval:g} (from {args.sources['monitor_interval']}): "
                          f"expected seconds between health checks > 0, e.g. 0.1")
    if values["shutdown_timeout"] is not None and values["shutdown_timeout"] < 0:
        raise ConfigError(f"--shutdown-timeout {values['shutdown_timeout']} (from "
                          f"{args.sources['shutdown_timeout']}): expected seconds >= 0")
    if values["no_python"] and values["module"]:
        raise ConfigError("--no-python and -m/--module cannot be used together")
    for dest in ("redirects", "tee"):
        if not _STD.match(str(values[dest])):
            raise ConfigError(f"--{dest} {values[dest]!r}: expected 0-3 or local_rank:0-3 pairs like 0:3,1:2")
    if values["local_ranks_filter"] and not re.fullmatch(r"\d+(,\d+)*", values["local_ranks_filter"]):
        raise ConfigError("--local-ranks-filter: expected comma-separated local ranks, e.g. 0,1")
    if not args.script and not values["dry_run"]:
        raise ConfigError("no script given: neuronrun [options] script.py [script args]")

    # Rendezvous, as torchrun resolves it.
    backend, endpoint, rdzv_id = values["rdzv_backend"], values["rdzv_endpoint"], values["rdzv_id"]
    _check_rdzv(args, backend, values["rdzv_conf"])
    master_port = values["master_port"]
    if values["standalone"]:
        _check_standalone(args, sched, min_nodes)
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif backend == "static" and not endpoint and master_port is None and max_nodes == 1:
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    master_port = DEFAULT_MASTER_PORT if master_port is None else master_port
    root_given = bool(env.get("NEURON_RT_ROOT_COMM_ID", "").strip())
    top = 65535 if root_given else 65534  # NEURON_RT_ROOT_COMM_ID defaults to the port after MASTER_PORT
    if not 1 <= master_port <= top:
        raise ConfigError(f"--master-port {master_port}: expected 1-{top}"
                          + ("" if root_given else " (the port after it is NEURON_RT_ROOT_COMM_ID's default)"))
    if args.explicit("redirects") and not args.explicit("tee"):
        values["tee"] = "0"  # --redirects alone means files only, as with torchrun (tee's default is 3)
    if backend == "static":
        if min_nodes != max_nodes:
            raise ConfigError("static rendezvous needs a fixed --nnodes; use --rdzv-backend c10d for MIN:MAX")
        if not 0 <= values["node_rank"] < max_nodes:
            raise ConfigError(f"--node-rank {values['node_rank']} outside 0..{max_nodes - 1}")
        if endpoint:  # torch's static rendezvous needs the port (c10d's defaults to 29400)
            try:
                check_host_port(endpoint, "--rdzv-endpoint")
            except ValueError as exc:
                raise ConfigError(f"{exc} (static rendezvous: give the port, e.g. node0:29500)") from None
            # its port is the ranks' MASTER_PORT, and the next one NEURON_RT_ROOT_COMM_ID's default
            if endpoint.rsplit(":", 1)[1] == "65535" and not root_given:
                raise ConfigError(f"--rdzv-endpoint {endpoint}: expected a port of 1-65534 (static rendezvous "
                                  f"makes it MASTER_PORT, and the port after it is NEURON_RT_ROOT_COMM_ID's "
                                  f"default), or export NEURON_RT_ROOT_COMM_ID")
        endpoint = endpoint or join_host_port(values["master_addr"], master_port)

    plan = _neuron_plan(args, env, max_nodes)
    return RunConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=plan.nproc_per_node,
        node_rank=values["node_rank"], master_addr=values["master_addr"], master_port=master_port,
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, rdzv_conf=values["rdzv_conf"],
        local_addr=values["local_addr"], max_restarts=values["max_restarts"],
        monitor_interval=values["monitor_interval"], shutdown_timeout=values["shutdown_timeout"],
        role=values["role"], log_dir=values["log_dir"], redirects=str(values["redirects"]),
        tee=str(values["tee"]), local_ranks_filter=values["local_ranks_filter"], module=bool(values["module"]),
        no_python=bool(values["no_python"]), script=args.script, script_args=tuple(args.script_args),
        dry_run=bool(values["dry_run"]), plan=plan, scheduler=sched, sources=dict(args.sources),
    )
