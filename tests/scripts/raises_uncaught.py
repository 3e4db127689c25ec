"""One rank of a two-rank job whose rank 1 ends on an uncaught ValueError. MODE "during": rank 0
waits on rank 1 in an all-reduce meanwhile, and prints how it ended and whether rank 1's
process had ended by then; MODE "after": rank 1 raises
after the job's last collective, and rank 0 destroys its group and prints that it ended cleanly;
MODE "exit": as "during", but rank 1 ends with sys.exit(3), its group left open and idle.
Started by tests/test_faults.py."""
import os
import sys
import time
from datetime import timedelta

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
pids = [None, None]
dist.all_gather_object(pids, os.getpid())
t = torch.ones(1 << 16)
dist.all_reduce(t)
if rank == 1:
    if mode == "after":
        dist.barrier()
    time.sleep(0.5)
    if mode == "exit":
        sys.exit(3)
    raise ValueError("the root cause on rank 1")
if mode == "after":
    dist.barrier()
    time.sleep(1.5)  # rank 1 has exited by now
    dist.destroy_process_group()
    print("rank 0: ended cleanly", flush=True)
    sys.exit(0)
try:
    dist.all_reduce(t)
    print("rank 0: completed", flush=True)
except Exception as e:  # noqa: BLE001
    import select
    p = select.poll()
    p.register(os.pidfd_open(pids[1]), select.POLLIN)  # readable once rank 1's process has ended
    print(f"rank 0: {type(e).__name__}: {e} [rank 1 had ended: {bool(p.poll(0))}]", flush=True)
