"""One rank of a 3-rank job in which rank `bad` has a setting the others do not
(NEURON_RT_VISIBLE_CORES=abc, or the VAR=VALUE given as a fifth argument), started by tests/test_misuse.py. Prints one line: how
init_process_group ended on this rank and how long it took (the group time-out is 60 s)."""
import os
import sys
import time
from datetime import timedelta

rank, world, port, bad = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
var, value = (sys.argv[5].split("=", 1) if len(sys.argv) > 5 else ("NEURON_RT_VISIBLE_CORES", "abc"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
if rank == bad:
    os.environ[var] = value
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

t0 = time.monotonic()
try:
    dist.init_process_group("neuron", timeout=timedelta(seconds=60))
    print(f"rank {rank}: ok", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
