"""One rank of a job whose last rank is SIGKILLed while the others wait on it in an all-reduce.
The last rank sleeps `late` seconds first, so the others' engines are deep in their longest
sleeps on the transport; it prints the moment it kills itself ("rank N: killed at T"), the
others how their all-reduce ended and when ("rank N: failed at T: ..."), times from one clock
(time.time(), one host). Started by tests/test_faults.py."""
import os
import signal
import sys
import time
from datetime import timedelta

rank, world, port, late = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
t = torch.ones(1024)
dist.all_reduce(t)
if rank == world - 1:
    time.sleep(late)
    print(f"rank {rank}: killed at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    dist.all_reduce(t)
    print(f"rank {rank}: completed", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: failed at {time.time():.6f}: {e}", flush=True)
os._exit(0)
