"""Run by test_transport_mpi.py under mpirun (NEURON_DIST_TRANSPORT=mpi): every rank calls
MPI.Finalize() while its neuron group is still open, then (MODE=call) calls a collective, and
destroys the group."""
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import neuron_dist  # noqa: F401

dist.init_process_group("neuron", timeout=timedelta(seconds=20))
r = dist.get_rank()
t = torch.ones(1 << 16)
dist.all_reduce(t)
MPI.Finalize()
if os.environ.get("MODE") == "call":
    try:
        dist.all_reduce(t)
        print(f"rank {r}: all_reduce after MPI.Finalize returned", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank {r}: all_reduce after MPI.Finalize raised: {e}", flush=True)
dist.destroy_process_group()
print(f"rank {r}: destroyed", flush=True)
