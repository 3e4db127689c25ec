"""Hierarchical multi-node collectives (the Neuron runtime's default across instances).

The group is the grid [ranks of a node, in the node's ring order] x [nodes] (see
`topology.graph.hierarchical_grid`), run by the grid builders of `torus.py`:
  all-reduce     = intra-node reduce-scatter, inter-node all-reduce (on 1/L of the data, L rings
                   of one rank per node, in parallel), intra-node all-gather;
  all-gather     = inter-node all-gather, then intra-node all-gather;
  reduce-scatter = intra-node reduce-scatter, then inter-node reduce-scatter.
A group on one node, or one with a different number of ranks per node, runs the plain ring.
"""
from __future__ import annotations

from .schedule import Schedule
from .torus import grid_allgather, grid_allreduce, grid_reduce_scatter, placed_grid


def hierarchical_allreduce(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "hierarchical")
    return grid_allreduce(rank, g.shape, g.coords, count, name)


def hierarchical_reduce_scatter(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "hierarchical")
    return grid_reduce_scatter(rank, g.shape, g.coords, count, name)


def hierarchical_allgather(rank: int, topo, count: int) -> Schedule:
    g, name = placed_grid(topo, "hierarchical")
    return grid_allgather(rank, g.shape, g.coords, count, name)
