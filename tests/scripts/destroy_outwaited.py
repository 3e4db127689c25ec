"""One rank of a 2-rank job: rank 0 issues an all-reduce with a call time-out of 30 s (the group's
is 2 s), which rank 1 never joins, and destroys the group while it runs; the destroy waits the
group's time-out and half a second, gives up, and fails the op. Rank 0 prints how the op ended
(it said "the process group was aborted", a call nobody made); rank 1 leaves once rank 0's
process has ended."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401
import rank_wait

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=2))
if rank == 0:
    opts = dist.AllreduceOptions()
    opts.timeout = timedelta(seconds=30)
    work = dist.group.WORLD._get_backend(torch.device("cpu")).allreduce([torch.ones(4)], opts)
    dist.destroy_process_group()
    try:
        work.wait()
        print("rank 0: the op completed", flush=True)
    except Exception as e:  # noqa: BLE001 - the test reads it
        print(f"rank 0: {type(e).__name__}: {e}", flush=True)
else:
    rank_wait.until_gone(dist.distributed_c10d._get_default_group().group.peers_info[0]["pid"], 60)
    print("rank 1: leaving", flush=True)
