"""One rank of the signal-handler check (test_lifecycle.py): rank 0's SIGALRM handler raises its
own exception 20 ms into a synchronous all-reduce its peer joins 0.5 s late (the caller's thread
drives the call then). Rank 0 must get its own exception, as from Gloo's call, not a GroupError
its `except` misses; the call is failed, and rank 1 fails naming rank 0's cause."""
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401


class Alarm(Exception):
    pass


def on_alarm(signum, frame):
    raise Alarm("time limit")


rank, port = int(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGALRM, on_alarm)
dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
dist.all_reduce(torch.ones(1))
meta = dist.new_group(backend="gloo")  # keeps rank 0 alive until rank 1 has failed (else: "rank 0 exited")
t = torch.ones(1000)
if rank == 1:
    time.sleep(0.5)
else:
    signal.setitimer(signal.ITIMER_REAL, 0.02)
try:
    dist.all_reduce(t)
    print(f"rank {rank}: ok", flush=True)
except Alarm as e:
    print(f"rank {rank}: Alarm: {e}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
dist.barrier(group=meta)
dist.destroy_process_group()
