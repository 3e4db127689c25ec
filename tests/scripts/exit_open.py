"""One rank of the exit check: leave the process groups open (no destroy_process_group) and exit.
Rank 0 exits with an asynchronous all-reduce still in flight on the world (its peer never joins
it) and a queue of 16 MiB all-gathers on a group of its own, so the engine thread of that group is
inside torch's copies, the GIL released, when the interpreter shuts down: without the exit hook
(`group._close_at_exit`), back from torch into a finalizing interpreter, that thread was ended
by pthread_exit, whose unwinding through torch's C++ frames called std::terminate. (The
never-joined all-reduce alone leaves its engine asleep in the transport's wait nearly all the
time, outside torch: forked, it exited clean with or without the hook; started afresh, about
half its runs aborted without it.) Rank 1 waits for rank 0's process to end, then exits too.
Both must end with status 0, not SIGABRT."""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401
import rank_wait

QUEUED = 64  # all-gathers queued on rank 0's own group: far more than its exit takes to begin

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
alone = dist.new_group([0])  # (every rank calls new_group; rank 1 is no member)
if rank == 0:
    work = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # never joined by rank 1
    block, out = torch.ones(4 << 20), torch.empty(4 << 20)  # 16 MiB: past INLINE_BYTES, so the engine runs them
    gathers = [dist.all_gather([out], block, group=alone, async_op=True) for _ in range(QUEUED)]
else:
    rank_wait.until_gone(dist.distributed_c10d._get_default_group().group.peers_info[0]["pid"], 30)
print(f"rank {rank}: leaving", flush=True)
