"""A rank under neuronrun on the neuron backend: all-reduce, then check that the backend's
topology agrees with the launcher's placement (node, cores, instance)."""
import os

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

dist.init_process_group("neuron")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
topo = dist.distributed_c10d._get_default_group().group.topology
slot = topo.slots[rank]
assert str(slot.node) == os.environ["GROUP_RANK"], (slot, os.environ["GROUP_RANK"])
assert topo.instance.name == os.environ["NEURON_DIST_INSTANCE"], topo.instance.name
vis = os.environ["NEURON_RT_VISIBLE_CORES"]
assert str(slot.cores[0]) == vis.split("-")[0], (slot, vis)
transport = dist.distributed_c10d._get_default_group().group.transport
route = getattr(transport, "route", {})
kinds = ",".join(f"{p}:{route[p].name if p in route else transport.name}" for p in range(world) if p != rank)
print(f"sum={t.item():g} world={world} node={slot.node} chip={slot.chip} cores={vis} "
      f"nodes={len({s.node for s in topo.slots})} transports={kinds}", flush=True)
dist.destroy_process_group()
