"""One rank of a 3-rank job whose ranks call new_group with different members (started by
tests/test_misuse.py). Mode "subset": rank 0 calls new_group([0, 1]), ranks 1 and 2
new_group([0, 1, 2]). Mode "collide": rank 0 calls new_group([0, 2]), ranks 1 and 2
new_group([1, 2]), so ranks 0 and 1 both believe they are the group's rank 0; "collide-late": the
same with rank 0 a second late, once ranks 1 and 2 have formed their group. Mode "absent":
rank 0 calls new_group([0, 1]), ranks 1 and 2 new_group([0, 2]), so rank 1 (not a member in its
own view) never joins the group rank 0 waits for (a 3 s group time-out). Prints one JSON
line: what new_group (and an all-reduce on the group) did, how long it took, whether the world
group still works, and what was left behind."""
import glob
import json
import os
import sys
import threading
import time
from datetime import timedelta

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
threads = threading.active_count()
if mode == "collide-late" and rank == 0:
    time.sleep(1.0)
t0 = time.monotonic()
try:
    members = {"subset": ([0, 1], [0, 1, 2]), "collide": ([0, 2], [1, 2]), "collide-late": ([0, 2], [1, 2]),
               "absent": ([0, 1], [0, 2])}[mode]
    g = dist.new_group(members[rank != 0], timeout=timedelta(seconds=3 if mode == "absent" else 10))
    if g is dist.GroupMember.NON_GROUP_MEMBER:
        err = ("not a member", [])
    else:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=g)
        err = ("ok", t.tolist())
        dist.destroy_process_group(g)
except Exception as e:  # noqa: BLE001
    err = (type(e).__name__, str(e))
elapsed = time.monotonic() - t0
t = torch.ones(2)
dist.all_reduce(t)
out = dict(rank=rank, kind=err[0], msg=err[1], elapsed=elapsed, world_ok=t.tolist() == [float(world)] * 2,
           threads_before=threads, threads_after=threading.active_count())
dist.destroy_process_group()
out["shm_left"] = glob.glob(f"/dev/shm/nd-*-{os.getpid()}")
print(json.dumps(out), flush=True)
