"""Run by test_transport_mpi.py under mpirun (2 ranks, NEURON_DIST_TRANSPORT=mpi): rank 1 starts
MPI at thread level SINGLE (mpi4py.rc.thread_level), rank 0 at mpi4py's default; both then
create a neuron group and print how that went."""
import os

import mpi4py

if os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    mpi4py.rc.thread_level = "single"
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import neuron_dist  # noqa: E402,F401

me = MPI.COMM_WORLD.Get_rank()
try:
    dist.init_process_group("neuron", timeout=timedelta(seconds=20))
    t = torch.ones(4)
    dist.all_reduce(t)
    print(f"rank {me} (thread level {MPI.Query_thread()}) created the group", flush=True)
    dist.destroy_process_group()
except Exception as e:  # noqa: BLE001
    print(f"rank {me} (thread level {MPI.Query_thread()}) error: {e}", flush=True)
