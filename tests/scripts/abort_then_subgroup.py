"""One rank of a two-rank job whose rank 1 aborts the world's group; then both ranks make a
subgroup [0, 1] and all-reduce on it (started by tests/test_lifecycle.py). Prints one JSON line:
how new_group and the all-reduce ended and how long they took."""
import json
import os
import sys
import time
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=8))
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    dist.group.WORLD._get_backend(torch.device("cpu")).abort()
time.sleep(0.5)
t0 = time.monotonic()
try:
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=8))
    x = torch.ones(4)
    dist.all_reduce(x, group=sub)
    res = ("ok", x.tolist())
    dist.destroy_process_group(sub)
except Exception as e:  # noqa: BLE001
    res = (type(e).__name__, str(e)[:300])
print(json.dumps(dict(rank=rank, res=res, took=time.monotonic() - t0)), flush=True)
os._exit(0)
