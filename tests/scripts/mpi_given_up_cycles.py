"""Run by test_transport_mpi.py under mpirun (2 ranks, NEURON_DIST_TRANSPORT=mpi): CYCLES rounds
of init_process_group, a 4 MiB send from rank 0 that times out (a 1 s group) because rank 1
comes LATE s late, and destroy_process_group, which closes the group with the send's frames
still open. Rank 0 prints, after each destroy, how many MPI requests its closes keep
(`_LIVE_AT_CLOSE`)."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401
from neuron_dist.transport import mpi

cycles, late = int(os.environ.get("CYCLES", "2")), float(os.environ.get("LATE", "3.5"))
for c in range(cycles):
    dist.init_process_group("neuron", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    dist.barrier()  # (under the long time-out: on a loaded host a rank may start seconds late)
    dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=1))
    try:
        if rank == 0:
            dist.send(torch.ones(1 << 20), 1)
        else:
            time.sleep(late)
    except Exception:  # noqa: BLE001 - the send's time-out, as meant
        pass
    dist.destroy_process_group()
    if rank == 0:
        print(f"rank 0: cycle {c}: kept {len(mpi._LIVE_AT_CLOSE)} requests", flush=True)
