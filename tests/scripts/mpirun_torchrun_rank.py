"""A worker of `mpirun -n 2 torchrun --nnodes 2 --node-rank $OMPI_COMM_WORLD_RANK --nproc-per-node 2`
(started by tests/test_transport_mpi.py): each torchrun agent is one MPI process on a (pretend)
host of its own, and its workers inherit its MPI variables but are no MPI processes. Prints
each rank's transport and the all-reduce's sum, or how init_process_group failed."""
import os
import socket
import time
from datetime import timedelta

host = "host" + os.environ["OMPI_COMM_WORLD_RANK"]  # the agent's MPI rank: one host per agent
socket.gethostname = lambda: host

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

rank = int(os.environ["RANK"])
t0 = time.monotonic()
try:
    dist.init_process_group("neuron", timeout=timedelta(seconds=30))
    t = torch.ones(8) * (rank + 1)
    dist.all_reduce(t)
    transport = dist.distributed_c10d._get_default_group().group.transport.name
    print(f"rank {rank}: transport {transport} sum={t[0].item():.0f}", flush=True)
    dist.destroy_process_group()
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
    raise SystemExit(1)
