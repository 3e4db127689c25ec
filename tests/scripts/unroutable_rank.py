"""One rank of a 2-rank job that spans two hosts as the backend sees them (rank 1 reports another
host name), in which rank 1 cannot resolve MASTER_ADDR to choose the interface it listens on.
Rank 0 listens on 127.0.0.1 (NEURON_DIST_BIND_ADDR); the ranks meet through a tcp:// store, so
rank 1's bad MASTER_ADDR touches only that choice. Started by tests/test_misuse.py; prints how
init_process_group ended on this rank and how long it took (the group time-out is 60 s)."""
import os
import socket
import sys
import time
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    socket.gethostname = lambda: "elsewhere.invalid"
    os.environ["MASTER_ADDR"] = "no-such-host.invalid"
else:
    os.environ.update(MASTER_ADDR="127.0.0.1", NEURON_DIST_BIND_ADDR="127.0.0.1")
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

t0 = time.monotonic()
try:
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    print(f"rank {rank}: ok", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
