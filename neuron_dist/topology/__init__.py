"""Topology: modelled instances, rank placement, rings and tori, cost model, algorithm choice.

Data plus pure functions: nothing here imports torch.distributed or opens a socket.
"""
from .instances import InstanceModel, get_instance, list_instances, load_instance, register_instance
from .placement import GroupTopology, Slot, parse_visible_cores, place, placement_from_env
from .graph import (Grid, grid_for, hamiltonian_cycles, hierarchical_grid, link_kind, ring_order,
                    ring_orders, torus_grid)
from .cost import AVAILABLE, COLLECTIVES, bus_factor, estimate
from .select import ENV_ALGO, choose, parse_forced

__all__ = ["InstanceModel", "get_instance", "list_instances", "load_instance", "register_instance",
           "GroupTopology", "Slot", "parse_visible_cores", "place", "placement_from_env",
           "Grid", "grid_for", "hamiltonian_cycles", "hierarchical_grid", "link_kind",
           "ring_order", "ring_orders", "torus_grid", "AVAILABLE", "COLLECTIVES", "bus_factor",
           "estimate", "ENV_ALGO", "choose", "parse_forced"]
