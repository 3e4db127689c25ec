"""One rank of a two-rank job whose rank 1 aborts the world while rank 0 all-reduces (started by
tests/test_lifecycle.py); both destroy it. With the cyclic collector off, rank 0 prints one JSON
line: whether its failed group (and so its store) was still alive after the destroy."""
import gc
import json
import os
import sys
import time
import weakref
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

gc.disable()
dist.init_process_group("neuron", timeout=timedelta(seconds=30))
t = torch.ones(4)
dist.all_reduce(t)
pg = dist.group.WORLD._get_backend(torch.device("cpu"))
ref = weakref.ref(pg.group)
del pg
msg = ""
if rank == 1:
    time.sleep(0.3)
    dist.group.WORLD._get_backend(torch.device("cpu")).abort()
else:
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(dict(failed=msg[:200], alive=ref() is not None)), flush=True)
