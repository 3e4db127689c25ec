"""Run by test_transport_mpi.py under mpirun (2 ranks, NEURON_DIST_TRANSPORT=mpi, a 3 s group):
rank 0 isends 16 MiB (32 frames, each above MPI's eager limit: MPI reads them from the tensor
only once rank 1 posts its receives; COUNT float32, e.g. 256 KiB: one frame) and gives up on it, MODE "destroy": its
destroy_process_group gives up on the send; MODE "timeout": the send fails at the group's
time-out. Rank 0 then reuses its tensor (7.0 where it sent 1.0), as a caller whose call has
failed may. Rank 1 posts its receive only then, and prints what it got or why it failed."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

TIMEOUT = 3.0
mode = os.environ["MODE"]
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
dist.barrier()  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=TIMEOUT))
rank, n = dist.get_rank(), int(os.environ.get("COUNT", 4 << 20))
if rank == 0:
    t = torch.full((n,), 1.0)
    time.sleep(1)  # rank 1 may still poll MPI in its barrier: it would take in and receive a frame sent now
    work = dist.isend(t, 1)
    if mode == "destroy":
        dist.destroy_process_group()
    try:
        work.wait()
        print("rank 0: the send completed", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank 0: {type(e).__name__}: {e}", flush=True)
    t.fill_(7.0)  # the caller's tensor is its own again: its send is over
    time.sleep(TIMEOUT + 5)  # alive while rank 1 reads (a sender that left is another case)
    os._exit(0)  # (MPI_Finalize would wait for rank 1 to receive whatever it has not)
time.sleep(TIMEOUT + 3)  # rank 0 has given up by now
t = torch.zeros(n)
try:
    dist.recv(t, 0)
    print(f"rank 1: got {torch.unique(t).tolist()}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank 1: {type(e).__name__}: {e}", flush=True)
os._exit(0)
