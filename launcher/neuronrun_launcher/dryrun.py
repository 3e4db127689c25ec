"""``--dry-run``: what every rank would get, without starting anything.

The Neuron variables come from the same :func:`plan.neuron_env` the worker uses.
torch's variables are written out the way the elastic agent sets them
(``LocalElasticAgent._start_workers``); a test runs the real agent with a mocked
spawner and checks that the two agree, so this listing cannot drift silently.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

from .config import RunConfig
from .launch import worker_command
from .plan import format_cpus, neuron_env, split_host_port
from .slots import assign_slots
from .thp import THP_VAR, host_mode
from .worker import command

AT_RENDEZVOUS = "<chosen at rendezvous>"


def torch_env(cfg: RunConfig, rank: int, local_rank: int, node_rank: int, nnodes: int,
              master_addr: str, master_port: str) -> dict[str, str]:
    world = nnodes * cfg.nproc_per_node
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_NAME": cfg.role,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.rdzv_id,
    }


def _host(cfg: RunConfig, node: int) -> str:
    if cfg.scheduler is not None and node < len(cfg.scheduler.hosts):
        return cfg.scheduler.hosts[node]
    if cfg.max_nodes == 1 or (cfg.rdzv_backend == "static" and node == cfg.node_rank):
        return socket.gethostname()
    return f"(node {node})"


def rank_table(cfg: RunConfig) -> list[tuple[dict[str, str], dict[str, str]]]:
    """For each rank of the job: (placement fields, environment set for it)."""
    static = cfg.rdzv_backend == "static"
    nnodes = cfg.max_nodes
    if static:
        master_addr, master_port = split_host_port(cfg.rdzv_endpoint)
    else:
        master_addr, master_port = AT_RENDEZVOUS, AT_RENDEZVOUS
    plan = cfg.plan
    rows = []
    for slot in assign_slots(nnodes, plan.nproc_per_node, cores_per_chip=plan.cores_per_chip, chips=plan.chips,
                             cores_per_rank=plan.cores_per_rank, base_core=plan.base_core,
                             pool_cores=plan.pool_cores):
        env = torch_env(cfg, slot.rank, slot.local_rank, slot.node_rank, nnodes, master_addr, master_port)
        if static:
            env.update(neuron_env(plan, slot.local_rank, master_addr, master_port))
        else:
            env.update(neuron_env(plan, slot.local_rank, "<MASTER_ADDR>", 0))
            env["NEURON_RT_ROOT_COMM_ID"] = plan.root_comm_id or "<MASTER_ADDR>:<MASTER_PORT + 1>"
        fields = {
            "rank": str(slot.rank),
            "host": _host(cfg, slot.node_rank),
            "node rank": str(slot.node_rank),
            "local rank": str(slot.local_rank),
            "chip": slot.chip_label,
            "cores": slot.visible_cores,
        }
        if plan.host_cpus:  # --cpu-bind core (CPUs of the node neuronrun runs on; each node plans its own)
            fields["cpus"] = format_cpus(plan.cpus(slot.local_rank))
        threads = plan.omp_threads(slot.local_rank)  # as launch() and the rank trampoline set it
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = threads
        rows.append((fields, env))
    return rows


def render(cfg: RunConfig) -> str:
    plan = cfg.plan
    nodes = str(cfg.max_nodes) if cfg.min_nodes == cfg.max_nodes else f"{cfg.min_nodes}:{cfg.max_nodes}"
    entry, args = worker_command(cfg)
    lines = [
        f"neuronrun dry run: {plan.instance}, LNC {plan.lnc} ({plan.chips} chips x {plan.cores_per_chip} logical "
        f"cores), {nodes} node(s) x {plan.nproc_per_node} rank(s), {plan.cores_per_rank} core(s) per rank",
        f"rendezvous: {cfg.rdzv_backend} {cfg.rdzv_endpoint} id={cfg.rdzv_id}"
        + (f" (from {cfg.scheduler.name})" if cfg.scheduler else ""),
        "every rank runs: " + shlex.join([entry, *args]),
        # what the trampoline then execs: $PYTHON_EXEC (a wrapper, say) where set, as torchrun runs it
        "which execs: " + shlex.join(command(cfg.mode, cfg.script or "", list(cfg.script_args),
                                             os.environ.get("PYTHON_EXEC") or sys.executable)),
    ]
    if THP_VAR in plan.thp_env:  # --thp on: whether this node's kernel will honour it
        mode = host_mode()
        lines.append(f"torch's huge pages: {THP_VAR}=1 in every rank; this node's transparent huge pages: "
                     f"{mode or 'unknown'}" + (" (so it changes nothing here; --thp off to drop it)"
                                               if mode == "never" else ""))
    if cfg.rdzv_backend != "static":
        lines.append(("ranks of nodes other than this one are ordered at rendezvous; " if cfg.max_nodes > 1 else "")
                     + "MASTER_ADDR/MASTER_PORT come from node 0's agent")
    for fields, env in rank_table(cfg):
        lines.append("")
        lines.append(", ".join(f"{k} {v}" for k, v in fields.items()))
        lines.extend(f"  {k}={v}" for k, v in env.items())
    return "\n".join(lines)
