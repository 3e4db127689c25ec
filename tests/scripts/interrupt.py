"""One rank of the Ctrl-C check (test_lifecycle.py): two ranks all-reduce 16 MiB in a loop; the
test sends SIGINT to rank 0. Rank 0 must see KeyboardInterrupt itself (as with Gloo), not a
backend error; rank 1 must fail with an error naming rank 0."""
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

rank, port = int(sys.argv[1]), sys.argv[2]
# Ctrl-C raises KeyboardInterrupt even where this was started with SIGINT ignored (a test run
# started in the background by a shell without job control): Python leaves an ignored SIGINT
# ignored, and the signal then did nothing while the ranks all-reduced on for 100,000 rounds
signal.signal(signal.SIGINT, signal.default_int_handler)
dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=30))
t = torch.ones(4 << 20)
try:
    for i in range(100000):
        dist.all_reduce(t)
        if i == 3:
            print(f"rank {rank}: looping", flush=True)
except KeyboardInterrupt:
    print(f"rank {rank}: KeyboardInterrupt", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank {rank}: {type(e).__name__}: {e}", flush=True)
