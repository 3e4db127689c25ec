"""Run by test_transport_mpi.py under mpirun (3 ranks, NEURON_DIST_TRANSPORT=mpi): rank 2 comes
LATE s late to an all-reduce of COUNT float32 (default 256 KiB, above MPI's eager limit) in a
group of TIMEOUT s; ranks 0 and 1 time out, send their ABORT frames, stay HOLD s (default 0)
and exit. Rank 2 prints how long its call took to fail and why."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

late, timeout = float(os.environ.get("LATE", "6")), float(os.environ.get("TIMEOUT", "4"))
count, hold = int(os.environ.get("COUNT", 1 << 16)), float(os.environ.get("HOLD", "0"))
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
r = dist.get_rank()
t = torch.ones(count)
dist.all_reduce(t)  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=timeout))
if r == 2:
    time.sleep(late)
t0 = time.monotonic()
try:
    dist.all_reduce(t)
    print(f"rank {r} returned", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {r} failed after {time.monotonic() - t0:.1f}s: {e}", flush=True)
if r != 2:
    time.sleep(hold)
# ranks 0 and 1 leave into MPI_Finalize, which never progresses their rendezvous sends to rank 2
