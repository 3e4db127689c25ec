"""Run by test_transport_mpi.py under `mpirun --enable-recovery` (3 ranks, the MPI transport, one
host): rank 0 isends 4 MiB (above MPI's eager limit) to rank 1, then 4 MiB to rank 2, in a group
of 6 s. Rank 1 kills itself (SIGKILL) at 1 s without receiving; rank 2 sleeps 12 s before its
receive. Rank 0's send to rank 1 waits on the oldest open MPI send's peer (`unflushed`), rank 1,
whose death the stall check sees at once; the newest one's peer (rank 2, alive) hid it until the
time-out, which then named rank 2 for a send to rank 1. Rank 0 prints how each send ended."""
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
r = dist.get_rank()
dist.barrier()  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=6))
t0 = time.monotonic()
if r == 0:
    works = [("to 1", dist.isend(torch.ones(1 << 20), 1)), ("to 2", dist.isend(torch.ones(1 << 20), 2))]
    for name, w in works:
        try:
            w.wait()
            print(f"rank 0 send {name} returned after {time.monotonic() - t0:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"rank 0 send {name} failed after {time.monotonic() - t0:.1f}s: {e}".replace("\n", " "), flush=True)
elif r == 1:
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
else:
    time.sleep(12)
    try:
        dist.recv(torch.empty(1 << 20), 0)
    except Exception:  # noqa: BLE001
        pass
# not MPI_Finalize: a peer is dead and the job kept alive (see mpi_peer_killed.py)
os._exit(0)
