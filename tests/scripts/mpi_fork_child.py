"""Run by test_transport_mpi.py under mpirun (NEURON_DIST_TRANSPORT=mpi): each rank forks a child
after init_process_group; the child ends normally (sys.exit(0): its exit hooks run). mpi4py's
exit hook ran MPI_Finalize in the child, where Open MPI's finalize never returns: the parent
waited on the child for ever. Then a collective and an orderly destroy."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

dist.init_process_group("neuron", timeout=timedelta(seconds=20))
r = dist.get_rank()
t = torch.ones(1000)
dist.all_reduce(t)
pid = os.fork()
if pid == 0:
    sys.exit(0)
deadline = time.monotonic() + 15
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print(f"rank {r}: the forked child had not exited after 15 s", flush=True)
        break
    time.sleep(0.05)
else:
    print(f"rank {r}: the forked child exited", flush=True)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size() ** 2, t[0].item()
dist.destroy_process_group()
print(f"rank {r}: destroyed", flush=True)
