"""One rank: init the neuron backend with the init method given, all-reduce, check, exit 0."""
import os
import sys

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if url == "env":  # under mpirun: every rendezvous variable comes from neuron_dist.mpi_env
    dist.init_process_group("neuron")
else:
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    dist.init_process_group("neuron", init_method=url, rank=rank, world_size=world)
x = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(x)
assert x.tolist() == [world * (world + 1) / 2] * 3, x
print(f"ok rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
