"""Placement: which node, chip and NeuronCore(s) each rank runs on.

Neuron conventions followed here:
  * logical cores are numbered per node, chip by chip: core i sits on chip i // cores_per_chip(lnc);
  * `NEURON_RT_VISIBLE_CORES` is one core index ("5"), an inclusive range ("4-7"), or a
    comma-separated list of both ("0,2-3": the Neuron runtime takes these from 2.16 on, per
    aws-neuron-sdk#1024, and Ray sets them, though the runtime's pages show only the first two
    forms); without it a process gets core `local_rank` (what the Neuron torch integration sets
    under torchrun), or, with `NEURON_RT_NUM_CORES=M`, the M consecutive cores from
    `local_rank` x M (as neuronrun lays them out);
  * `NEURON_LOGICAL_NC_CONFIG` is the LNC (default: the instance's, 2 on trn2/trn3, 1 elsewhere);
  * the node of a rank is `GROUP_RANK` (torchrun) or `NODE_ID`/`NODE_RANK`, the first one set
    (an integer >= 0; another value is an error naming the variable), else
    rank // local_world_size; with neither a node variable nor LOCAL_RANK, the rank's host
    (its node and local rank are then decided once the group knows its members' hosts:
    `placement_before_hosts`, `place_by_host`).
`NEURON_DIST_INSTANCE` names the instance model (default trn2.48xlarge); it may be a path to a
.json/.toml description (see instances.load_instance).

The group's placement is agreed at group creation: each rank publishes `Slot.to_dict()` through
the store, every rank builds the same `GroupTopology(instance, slots)` and calls `validate()`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .instances import InstanceModel, get_instance

DEFAULT_INSTANCE = "trn2.48xlarge"


@dataclass(frozen=True)
class Slot:
    """Where one rank runs: node index, chip index on that node, logical core index(es) on the
    node (all of them; `core` is the first), the LNC and the instance model's name."""
    node: int
    chip: int
    cores: tuple[int, ...]
    lnc: int = 2
    instance: str = DEFAULT_INSTANCE

    def __post_init__(self):
        object.__setattr__(self, "cores", tuple(int(c) for c in self.cores))
        if self.node < 0 or self.chip < 0 or not self.cores or min(self.cores) < 0:
            raise ValueError(f"bad slot {self}")

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "chip": self.chip, "cores": list(self.cores),
                "lnc": self.lnc, "instance": self.instance}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Slot":
        return cls(node=int(d["node"]), chip=int(d["chip"]), cores=tuple(d["cores"]),
                   lnc=int(d.get("lnc", 2)), instance=str(d.get("instance", DEFAULT_INSTANCE)))


_CORES = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)  # one part: "5" or "4-7" (neuronrun's own parser agrees)


def parse_visible_cores(spec: str) -> tuple[int, ...]:
    """NEURON_RT_VISIBLE_CORES: core indices and inclusive ranges, comma-separated, as the Neuron
    runtime reads it: "5" -> (5,), "4-7" -> (4, 5, 6, 7), "0,2-3" -> (0, 2, 3). Digits only:
    `int` alone would take "1_0" as core 10 and "+3" as 3, which neuronrun refuses."""
    out: list[int] = []
    for part in spec.replace(" ", "").split(","):
        m = _CORES.fullmatch(part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r}: expected a core index like '5', an "
                             f"inclusive range like '4-7', or a comma-separated list of them like "
                             f"'0,2-3'")
        a = int(m[1])
        out.extend(range(a, int(m[2] or a) + 1))
    if len(set(out)) != len(out):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r} lists a core twice")
    return tuple(out)


def make_slot(instance: InstanceModel, node: int, cores: Sequence[int], lnc: int | None = None) -> Slot:
    """A Slot for `cores` (logical core indices on `node`), checked against the instance."""
    lnc = instance.check_lnc(lnc)
    n = instance.cores(lnc)
    bad = [c for c in cores if not 0 <= c < n]
    if bad:
        raise ValueError(f"core(s) {bad} out of range: {instance.name} at LNC={lnc} has {n} "
                         f"logical cores per node (0-{n - 1})")
    if node > 0 and not instance.multi_node:
        raise ValueError(f"{instance.name} does not support multi-node collectives, but a rank "
                         f"was placed on node {node}")
    return Slot(node=node, chip=cores[0] // instance.cores_per_chip(lnc), cores=tuple(cores),
                lnc=lnc, instance=instance.name)


NODE_VARS = ("GROUP_RANK", "NODE_ID", "NODE_RANK")  # the first one set (not empty) names the node


def node_named(env: Mapping[str, str]) -> bool:
    """Whether the environment names this rank's node (one of NODE_VARS set, not empty)."""
    return any(env.get(k) for k in NODE_VARS)


def _node_from_env(env: Mapping[str, str]) -> int | None:
    """The node index the environment gives (None: none of NODE_VARS is set); a value that is no
    integer >= 0 is a ValueError naming the variable."""
    for var in NODE_VARS:
        text = env.get(var)
        if not text:
            continue
        try:
            node = int(text)
        except ValueError:
            raise ValueError(f"{var}={text!r}: expected a node index, an integer >= 0") from None
        if node < 0:
            raise ValueError(f"{var}={text!r}: a node index must be >= 0")
        return node
    return None


def placement_from_env(env: Mapping[str, str], rank: int, world_size: int, local_rank: int,
                       local_world_size: int) -> Slot:
    """This rank's Slot from the environment (see the module docstring)."""
    if not (0 <= rank < world_size) or not (0 <= local_rank < local_world_size):
        raise ValueError(f"bad rank numbers: rank {rank} of {world_size}, local rank "
                         f"{local_rank} of {local_world_size}")
    return _place(env, rank // local_world_size, local_rank, local_world_size)


def placement_before_hosts(env: Mapping[str, str], rank: int, world_size: int) -> tuple[Slot, int]:
    """For a rank no launcher numbered on its node (no node variable and no LOCAL_RANK: a tcp://
    or file:// job given rank and world size, a launcher of its own), whose node and local
    rank only the hosts of its group's members decide (`place_by_host`): what its settings
    decide alone, checked now (instance, LNC, NEURON_RT_VISIBLE_CORES, NEURON_RT_NUM_CORES).
    Taking the rank for local rank `rank` of `world_size` on one node refused every multi-host
    such job ("4 processes per node but ... only 2") before the hosts were known. Returns the
    slot of local rank 0 of 1 on node 0 and the cores a rank takes by its local rank (M), or
    0 where NEURON_RT_VISIBLE_CORES names them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"bad rank numbers: rank {rank} of {world_size}")
    slot = _place(env, 0, 0, 1)
    return slot, 0 if env.get("NEURON_RT_VISIBLE_CORES") else len(slot.cores)


def place_by_host(slots: Sequence[Slot], hosts: Sequence[str], by_host: Sequence[int | None]) -> list[Slot]:
    """The slots of a group once its members' hosts are known: rank r with `by_host[r]` None
    keeps `slots[r]` (its environment placed it); another (see `placement_before_hosts`) is
    on the node of its host (hosts numbered in order of first appearance), its local rank its
    position among its host's ranks, and takes `by_host[r]` consecutive cores from local rank
    x M (0: its own `slots[r].cores`). Checked as `placement_from_env` checks a launcher's
    numbers: no more ranks on a host than the node's logical cores."""
    out = list(slots)
    on_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        on_host.setdefault(h, []).append(r)
    node_of = {h: i for i, h in enumerate(on_host)}
    for r, m in enumerate(by_host):
        if m is None:
            continue
        s, here = slots[r], on_host[hosts[r]]
        instance = get_instance(s.instance)
        ncores, local = instance.cores(s.lnc), here.index(r)
        if len(here) * max(m, 1) > ncores:
            raise ValueError(f"ranks {_ranks(here)} run on host {hosts[r]}: {len(here)} processes"
                             f"{f' x {m} cores (NEURON_RT_NUM_CORES)' if m > 1 else ''} on one node, but "
                             f"{instance.name} at LNC={s.lnc} has only {ncores} logical cores per node")
        out[r] = make_slot(instance, node_of[hosts[r]], range(local * m, local * m + m) if m else s.cores, s.lnc)
    return out


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"


def _place(env: Mapping[str, str], default_node: int, local_rank: int, local_world_size: int) -> Slot:
    """The Slot of local rank `local_rank` of `local_world_size` on the environment's node, else
    on `default_node`, with the environment's instance, LNC and cores."""
    try:
        instance = get_instance(env.get("NEURON_DIST_INSTANCE") or DEFAULT_INSTANCE)
    except ValueError as e:
        raise ValueError(f"NEURON_DIST_INSTANCE={env.get('NEURON_DIST_INSTANCE')!r}: {e}") from None
    lnc_s = env.get("NEURON_LOGICAL_NC_CONFIG")
    try:
        lnc = instance.check_lnc(int(lnc_s) if lnc_s else None)
    except ValueError as e:
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={lnc_s!r}: {e}") from None
    ncores = instance.cores(lnc)
    if local_world_size > ncores:
        raise ValueError(f"{local_world_size} processes per node but {instance.name} at LNC={lnc} "
                         f"has only {ncores} logical cores per node")
    node = _node_from_env(env)
    node = default_node if node is None else node
    vis = env.get("NEURON_RT_VISIBLE_CORES")
    if vis:
        cores = parse_visible_cores(vis)
        bad = [c for c in cores if not 0 <= c < ncores]
        if bad:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={vis!r} is out of bounds: {instance.name} "
                             f"at LNC={lnc} has logical cores 0-{ncores - 1}")
    else:  # the runtime's NEURON_RT_NUM_CORES: M consecutive cores per process, as neuronrun lays them
        m_s = env.get("NEURON_RT_NUM_CORES")
        try:
            m = int(m_s) if m_s else 1
        except ValueError:
            m = 0
        if m < 1:
            raise ValueError(f"NEURON_RT_NUM_CORES={m_s!r}: expected a positive number of cores per process")
        if local_world_size * m > ncores:
            raise ValueError(f"NEURON_RT_NUM_CORES={m_s} x {local_world_size} processes per node needs "
                             f"{local_world_size * m} cores, but {instance.name} at LNC={lnc} has {ncores}")
        cores = tuple(range(local_rank * m, local_rank * m + m))
    return make_slot(instance, node, cores, lnc)


@dataclass(frozen=True)
class GroupTopology:
    """The instance model and the Slot of every group rank, in group-rank order."""
    instance: InstanceModel
    slots: tuple[Slot, ...]

    def __post_init__(self):
        object.__setattr__(self, "slots", tuple(self.slots))
        if isinstance(self.instance, str):
            object.__setattr__(self, "instance", get_instance(self.instance))

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def lnc(self) -> int:
        return self.slots[0].lnc if self.slots else self.instance.default_lnc

    @property
    def nodes(self) -> list[int]:
        """Distinct node indices of the group, ascending."""
        return sorted({s.node for s in self.slots})

    def same_node(self, a: int, b: int) -> bool:
        return self.slots[a].node == self.slots[b].node

    def same_chip(self, a: int, b: int) -> bool:
        return self.same_node(a, b) and self.slots[a].chip == self.slots[b].chip

    def ranks_on_node(self, node: int) -> list[int]:
        return [r for r, s in enumerate(self.slots) if s.node == node]

    def chip_of(self, r: int) -> tuple[int, int]:
        return (self.slots[r].node, self.slots[r].chip)

    def is_symmetric(self) -> bool:
        """Same number of ranks on every node at the same local cores."""
        per = {}
        for s in self.slots:
            per.setdefault(s.node, []).append(s.cores)
        layouts = {tuple(sorted(v)) for v in per.values()}
        return len(layouts) <= 1

    def validate(self) -> "GroupTopology":
        """Raise ValueError naming the ranks if the placement is impossible."""
        inst = self.instance
        if not self.slots:
            raise ValueError("a group needs at least one rank")
        for r, s in enumerate(self.slots):
            if s.instance != inst.name:
                raise ValueError(f"rank {r} says instance {s.instance!r}, the group uses "
                                 f"{inst.name!r}: set NEURON_DIST_INSTANCE the same on every node")
        lncs = {s.lnc for s in self.slots}
        if len(lncs) > 1:
            raise ValueError(f"ranks disagree on NEURON_LOGICAL_NC_CONFIG: {sorted(lncs)}")
        lnc = inst.check_lnc(self.lnc)
        ncores, cpc = inst.cores(lnc), inst.cores_per_chip(lnc)
        used: dict[tuple[int, int], int] = {}
        for r, s in enumerate(self.slots):
            for c in s.cores:
                if not 0 <= c < ncores:
                    raise ValueError(f"rank {r}: core {c} out of range (0-{ncores - 1}) on "
                                     f"{inst.name} at LNC={lnc}")
                if (s.node, c) in used:
                    raise ValueError(f"ranks {used[s.node, c]} and {r} both use core {c} on node "
                                     f"{s.node}; more ranks than cores, overlapping "
                                     f"NEURON_RT_VISIBLE_CORES, or one local rank (LOCAL_RANK) "
                                     f"given to both")
                used[s.node, c] = r
            if s.chip != s.cores[0] // cpc:
                raise ValueError(f"rank {r}: core {s.cores[0]} is on chip {s.cores[0] // cpc}, "
                                 f"not chip {s.chip}")
            if s.node > 0 and not inst.multi_node:
                raise ValueError(f"{inst.name} is single-instance only; rank {r} is on node "
                                 f"{s.node}")
        return self


def place(instance: "str | InstanceModel", nodes: int, procs_per_node: int, lnc: int | None = None,
          cores_per_rank: int = 1, first_core: int = 0) -> GroupTopology:
    """The placement of a job of `nodes` x `procs_per_node` ranks, rank-major by node, each rank
    on `cores_per_rank` consecutive logical cores starting at `first_core`, filled chip by chip."""
    inst = get_instance(instance)
    lnc = inst.check_lnc(lnc)
    need = first_core + procs_per_node * cores_per_rank
    if need > inst.cores(lnc):
        raise ValueError(f"{procs_per_node} ranks x {cores_per_rank} cores from core {first_core} "
                         f"need {need} cores; {inst.name} at LNC={lnc} has {inst.cores(lnc)}")
    if nodes > 1 and not inst.multi_node:
        raise ValueError(f"{inst.name} is single-instance only; asked for {nodes} nodes")
    slots = []
    for n in range(nodes):
        for i in range(procs_per_node):
            c0 = first_core + i * cores_per_rank
            slots.append(make_slot(inst, n, range(c0, c0 + cores_per_rank), lnc))
    return GroupTopology(inst, tuple(slots)).validate()
