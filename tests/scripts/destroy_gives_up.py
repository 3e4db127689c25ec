"""One rank of a 2-rank job whose group time-out is 3 s: rank 0 starts an op (OP: "isend", a
16 MiB send the shared-memory transport lends; "allreduce", a small async all_reduce) and calls
destroy_process_group, which gives up on it after the time-out; its Work fails, and rank 0
reuses its tensor (7.0 where it sent 1.0). Rank 1 posts its side of the op only then, and prints
what it got. Started by tests/test_lifecycle.py."""
import os
import sys
import time
from datetime import timedelta

rank, port, op = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

TIMEOUT = 3.0
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
dist.barrier()  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=TIMEOUT))
n = 4 << 20 if op == "isend" else 4  # 16 MiB of float32: above the ring's eager bytes, lent
if rank == 0:
    t = torch.full((n,), 1.0)
    work = dist.isend(t, 1) if op == "isend" else dist.all_reduce(t, async_op=True)
    dist.destroy_process_group()
    try:
        work.wait()
        print("rank 0: the op completed", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank 0: {type(e).__name__}: {e}", flush=True)
    t.fill_(7.0)  # the caller's tensor is its own again: its op is over
    time.sleep(TIMEOUT + 4)  # alive while rank 1 reads (a dead sender is another case)
    os._exit(0)
time.sleep(TIMEOUT + 2)  # rank 0's destroy has given up by now
t = torch.zeros(n)
try:
    dist.recv(t, 0) if op == "isend" else dist.all_reduce(t)
    print(f"rank 1: got {torch.unique(t).tolist()}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank 1: {type(e).__name__}: {e}", flush=True)
os._exit(0)
