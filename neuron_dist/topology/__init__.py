"""Topology: modelled instances, rank placement, rings and tori, cost model, algorithm choice.

Data plus pure functions: nothing here imports torch.distributed or opens a socket.
"""
from .instances import InstanceModel, get_instance, list_instances, load_instance, register_instance

__all__ = ["InstanceModel", "get_instance", "list_instances", "load_instance", "register_instance"]
