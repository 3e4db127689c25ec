"""One rank of a 4-rank tcp:// job given only rank and world size (no LOCAL_RANK, LOCAL_WORLD_SIZE
or node number, as a custom launcher starts it), whose ranks 2 and 3 stand for a second host
(another machine key, so the backend takes them for one). Started by tests/test_init_methods.py
with NEURON_DIST_INSTANCE naming an instance of 2 cores per node; prints each rank's node and
cores as the group placed them, and the all-reduce's sum."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from neuron_dist import hosts

rank, url = int(sys.argv[1]), sys.argv[2]
if rank >= 2:
    hosts.machine_key = lambda: "0ther0ne"
dist.init_process_group("neuron", init_method=url, rank=rank, world_size=4, timeout=timedelta(seconds=30))
t = torch.ones(3)
dist.all_reduce(t)
slots = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).group.topology.slots
print(f"rank {rank}: placed {[(s.node, s.cores) for s in slots]} sum {t.tolist()}", flush=True)
dist.destroy_process_group()
