"""Run by test_transport_mpi.py under mpirun (NEURON_DIST_TRANSPORT=mpi): a program that imported
mpi4py.MPI itself, before neuron_dist, keeps mpi4py's ways at exit (mpi_env.mpi): mpi4py, not
neuron_dist, finalizes MPI, after the program's own exit hooks.

MODE=hook: the program registers an exit hook that calls MPI (before it imports neuron_dist, so
the hook runs after neuron_dist's): it must find MPI still running, on both ranks.
MODE=raise: rank 1 raises; mpi4py's MPI_Finalize then holds it until its peer ends, so its ABORT
must not tell the peer to wait for its process to end (`group._close_at_exit`): rank 0 fails at
once, not EXIT_FIRST_S later."""
import atexit
import os
import time
from datetime import timedelta

from mpi4py import MPI

mode = os.environ.get("MODE", "hook")
if mode == "hook":
    def _the_programs_hook():
        n = MPI.COMM_WORLD.allreduce(1)  # MPI must not be finalized yet
        print(f"rank {MPI.COMM_WORLD.Get_rank()}: the program's exit hook summed {n}", flush=True)
    atexit.register(_the_programs_hook)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=20))
r = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if mode == "raise":
    if r == 1:
        time.sleep(0.3)
        raise ValueError("the root cause on rank 1")
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        print(f"rank {r} failed after {time.monotonic() - t0:.1f}s: {e}".replace("\n", " "), flush=True)
    dist.destroy_process_group()
else:
    dist.destroy_process_group()
    print(f"rank {r}: destroyed", flush=True)
