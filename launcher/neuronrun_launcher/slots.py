"""Slot assignment: which rank runs on which NeuronCores. Pure functions, no I/O.

Kept apart from the launcher (like Horovod's ``hosts.py``) so placement can be
tested exhaustively without spawning anything, and so the worker trampoline and
``--dry-run`` compute the environment with the *same* code.

Numbering follows the Neuron runtime: logical core ``c`` on an instance with
``k`` logical cores per chip sits on chip ``c // k``. Ranks of a node fill cores
chip by chip; with ``cores_per_rank = m`` local rank ``l`` owns cores
``base + l*m .. base + l*m + m - 1`` where ``base`` is the first core of the
node's pool (0 unless the user restricted it with NEURON_RT_VISIBLE_CORES).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class PlacementError(ValueError):
    """The requested ranks do not fit the instance's NeuronCores."""


@dataclass(frozen=True)
class Slot:
    """Where one rank runs. ``rank`` assumes node-major ranks (static rendezvous);
    with c10d rendezvous the agent may order nodes differently, but the core
    placement depends only on the local rank, so it is the same either way."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    first_core: int
    num_cores: int
    chips: tuple[int, ...]

    @property
    def visible_cores(self) -> str:
        """NEURON_RT_VISIBLE_CORES value: ``a`` or inclusive range ``a-b``."""
        last = self.first_core + self.num_cores - 1
        return str(self.first_core) if self.num_cores == 1 else f"{self.first_core}-{last}"

    @property
    def chip_label(self) -> str:
        return str(self.chips[0]) if len(self.chips) == 1 else f"{self.chips[0]}-{self.chips[-1]}"


def check_cores_per_rank(cores_per_rank: int, cores_per_chip: int, what: str = "--cores-per-rank") -> None:
    """A rank's core range may cross chips only in whole chips: ``m`` must divide
    ``k`` (ranks never straddle a chip) or be a multiple of it (ranks own whole chips).
    ``what`` names where ``m`` came from (the flag, or ``$NEURON_RT_NUM_CORES`` exported)."""
    m, k = cores_per_rank, cores_per_chip
    if m < 1:
        raise PlacementError(f"{what} must be >= 1, got {m}")
    if k % m and m % k:
        raise PlacementError(
            f"{what} {m} does not fit {k} logical cores per chip: it must divide {k} "
            f"or be a multiple of it, so that no rank's range straddles a chip boundary"
        )


def local_slot(
    local_rank: int,
    *,
    nproc_per_node: int,
    cores_per_chip: int,
    chips: int,
    cores_per_rank: int = 1,
    base_core: int = 0,
    pool_cores: int | None = None,
    node_rank: int = 0,
    nnodes: int = 1,
) -> Slot:
    """The slot of one local rank. ``pool_cores`` is how many cores of the instance
    (starting at ``base_core``) this node may use; default: all of them."""
    total = cores_per_chip * chips
    pool = total - base_core if pool_cores is None else pool_cores
    m = cores_per_rank
    check_cores_per_rank(m, cores_per_chip)
    if not 0 <= local_rank < nproc_per_node:
        raise PlacementError(f"local rank {local_rank} outside 0..{nproc_per_node - 1}")
    if base_core < 0 or base_core + pool > total:
        raise PlacementError(
            f"cores {base_core}-{base_core + pool - 1} are outside the instance's {total} logical cores"
        )
    if base_core % m:
        raise PlacementError(
            f"first core {base_core} is not a multiple of --cores-per-rank {m}; "
            f"the Neuron runtime needs each rank's range to start at a multiple of its size"
        )
    if nproc_per_node * m > pool:
        raise PlacementError(
            f"{nproc_per_node} ranks x {m} core(s) per rank = {nproc_per_node * m} cores, "
            f"but only {pool} logical NeuronCores are available on this node "
            f"({chips} chips x {cores_per_chip} cores{'' if pool == total else f', restricted to {pool}'}); "
            + (f"use --nproc-per-node {pool // m} (or auto), fewer cores per rank, or more nodes" if pool >= m
               else f"--cores-per-rank {m} is more than the node has: use at most {pool}")
        )
    first = base_core + local_rank * m
    chip_ids = tuple(range(first // cores_per_chip, (first + m - 1) // cores_per_chip + 1))
    return Slot(
        rank=node_rank * nproc_per_node + local_rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=nnodes * nproc_per_node,
        local_world_size=nproc_per_node,
        first_core=first,
        num_cores=m,
        chips=chip_ids,
    )


def assign_slots(
    nnodes: int,
    nproc_per_node: int,
    *,
    cores_per_chip: int,
    chips: int,
    cores_per_rank: int = 1,
    base_core: int = 0,
    pool_cores: int | None = None,
) -> list[Slot]:
    """Every slot of a job, in global rank order (node-major, as static rendezvous does).
    Groups are symmetric: every node uses the same local core indices."""
    return [
        local_slot(
            lr,
            nproc_per_node=nproc_per_node,
            cores_per_chip=cores_per_chip,
            chips=chips,
            cores_per_rank=cores_per_rank,
            base_core=base_core,
            pool_cores=pool_cores,
            node_rank=node,
            nnodes=nnodes,
        )
        for node in range(nnodes)
        for lr in range(nproc_per_node)
    ]


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$", re.ASCII)  # ASCII digits: the backend agrees


def parse_core_range(value: str) -> tuple[int, int]:
    """Parse a NEURON_RT_VISIBLE_CORES value ``a`` or ``a-b`` into (first, count)."""
    m = _RANGE.match(value)
    if not m:
        raise PlacementError(
            f"NEURON_RT_VISIBLE_CORES={value!r} is not a core index 'a' or an inclusive range 'a-b'"
        )
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a:
        raise PlacementError(f"NEURON_RT_VISIBLE_CORES={value!r}: range end is before its start")
    return a, b - a + 1
