"""One rank of a 3-rank job in which rank 1 waits in a receive from any source, ranks 0 and 2
its possible senders.
  dead:    rank 0 exits without sending (os._exit, as a crash would); rank 2 lives on and sends
           nothing, until rank 1's process has ended.
  orderly: rank 2 leaves in order (destroy_process_group), and rank 0 sends 2 s later.
Started by tests/test_faults.py; rank 1 prints how its receive ended and after how long (the
group time-out is 30 s)."""
import os
import sys
import time
from datetime import timedelta

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="3")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401
import rank_wait  # noqa: E402

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
dist.barrier()
if rank == 0:
    time.sleep(0.5 if mode == "dead" else 2.0)
    if mode == "dead":
        os._exit(0)
    dist.send(torch.full((4,), 5.0), 1)
elif rank == 2:
    if mode == "dead":  # alive and silent (no destroy, no failure) while rank 1 waits
        rank_wait.until_gone(dist.distributed_c10d._get_default_group().group.peers_info[1]["pid"], 60)
    else:
        dist.destroy_process_group()
    os._exit(0)
else:
    t0 = time.monotonic()
    try:
        got = torch.empty(4)
        src = dist.recv(got)
        print(f"rank 1: received {got.tolist()} from rank {src}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank 1: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
if mode == "orderly":
    dist.destroy_process_group()
os._exit(0)
