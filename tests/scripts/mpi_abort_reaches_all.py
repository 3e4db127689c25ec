"""Run by test_transport_mpi.py under mpirun (3 ranks, NEURON_DIST_TRANSPORT=mpi): rank 0 times
out (1.5 s) on rank 2, which never calls; rank 1 (12 s) has rank 0's data and waits on rank 2
too. Each rank prints how its call ended and how long its destroy took: rank 1 must learn of
rank 0's failure at once, and rank 2's orderly destroy must not wait for closing frames that
ranks whose group failed never send."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

dist.init_process_group("neuron")
r = dist.get_rank()
sub = dist.new_group([0, 1, 2], timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(2), group=sub)  # (under the long time-out: a rank may start seconds late)
sub.set_timeout(timedelta(seconds=1.5 if r == 0 else 12))
t0 = time.monotonic()
if r != 2:
    try:
        dist.all_reduce(torch.ones(16), group=sub)
        print(f"rank {r} returned", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank {r} failed after {time.monotonic() - t0:.1f}s: {e}", flush=True)
dist.barrier(group=dist.new_group(backend="gloo"))
t0 = time.monotonic()
dist.destroy_process_group(sub)
print(f"rank {r} destroyed in {time.monotonic() - t0:.2f}s", flush=True)
dist.destroy_process_group()
