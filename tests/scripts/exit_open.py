"""One rank of the exit check: leave the process group open (no destroy_process_group) and exit.
Rank 0 exits with an asynchronous all-reduce still in flight (its peer never joins it), so its
engine thread is busy in torch ops when the interpreter shuts down; rank 1 waits for rank 0's
process to end, then exits too. Both must end with status 0, not SIGABRT."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
if rank == 0:
    work = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # never joined by rank 1
else:
    pid = dist.distributed_c10d._get_default_group().group.peers_info[0]["pid"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
print(f"rank {rank}: leaving", flush=True)
