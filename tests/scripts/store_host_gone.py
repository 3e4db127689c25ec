"""Run by test_hang_diagnosis.py as `store_host_gone.py RANK PORT` (2 ranks): rank 0, whose
process hosts the store, leaves without a word after one all-reduce; rank 1 makes four more
calls, each of which fails, and prints each error's first words."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(4))  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=5))
if rank == 0:
    os._exit(0)
for i in range(4):
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        print(f"rank 1: call {i}: {type(e).__name__}", flush=True)
    time.sleep(0.3)  # the progress heartbeat (every 0.25 s here) writes each failed call's record
os._exit(0)
