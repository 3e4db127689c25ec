"""One rank of the fork check: rank 0 forks a child that tries a collective on the inherited group
(it must fail at once), destroys the groups it inherited, as a helper that cleans up might, and
exits normally (atexit hooks run, as a subprocess helper's do) while the group is up; then every
rank runs a collective. The child's exit closed the parent's groups: rank 1 failed with "rank 0
closed its shared-memory transport" (over zmq the child also spun at exit); so did the child's
destroy, which marked the parent's shared-memory transport closed."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1")
dist.init_process_group("neuron", init_method=f"file://{store}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=30))
sub = dist.new_group(list(range(world)))
t = torch.ones(1000)
dist.all_reduce(t, group=sub)
if rank == 0:
    pid = os.fork()
    if pid == 0:  # the child: a call on an inherited group fails at once; then a normal exit
        try:
            dist.all_reduce(torch.ones(4), group=sub)
            print("rank 0's child: a collective on the parent's group did not raise", flush=True)
        except Exception as e:  # noqa: BLE001
            if "forked child" not in str(e):
                print(f"rank 0's child: unexpected error {e}", flush=True)
        dist.destroy_process_group(sub)
        dist.destroy_process_group()
        sys.exit(0)  # atexit hooks run in the child
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        time.sleep(0.05)
    else:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
            print("rank 0: the child did not exit within 20 s", flush=True)
dist.barrier(group=dist.new_group(backend="gloo"))  # the child is gone before anyone goes on
for group in (None, sub):
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)
    assert t[0].item() == world, t[:3]
dist.destroy_process_group()
print(f"rank {rank}: fork ok", flush=True)
