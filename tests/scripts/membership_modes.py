"""One rank of a 3-rank job that runs new_group with members the ranks disagree on, mode after
mode, on one world group (started by tests/test_misuse.py as `membership_modes.py RANK WORLD PORT
MODE...`; modes: subset, collide, collide-late, absent, each once a 3-rank job of its own),
between an all-reduce of the world that starts the ranks on it together and one that checks the
world still works. Prints one JSON line per mode (how its new_group and all-reduce ended), with
the threads counted before and after the mode and "shm_left" the shared-memory segments of this
process that the mode left (none may outlive a group), then, once the world is destroyed, a line
{"rank": R, "mode": "end", "shm_left": [...]}: what is left of them all."""
import gc
import glob
import json
import os
import sys
import threading
import time
from datetime import timedelta

rank, world, port, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

MEMBERS = {"subset": ([0, 1], [0, 1, 2]), "collide": ([0, 2], [1, 2]), "collide-late": ([0, 2], [1, 2]),
           "absent": ([0, 1], [0, 2])}


def shm() -> set:
    return set(glob.glob(f"/dev/shm/nd-*-{os.getpid()}"))


dist.init_process_group("neuron", timeout=timedelta(seconds=30))
for mode in modes:
    dist.all_reduce(torch.ones(1))  # every rank starts the mode together, as after its set-up
    gc.collect()
    threads, segments = threading.active_count(), shm()
    if mode == "collide-late" and rank == 0:
        time.sleep(1.0)
    t0 = time.monotonic()
    try:
        g = dist.new_group(MEMBERS[mode][rank != 0], timeout=timedelta(seconds=3 if mode == "absent" else 10))
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
    out = dict(rank=rank, mode=mode, kind=err[0], msg=err[1], elapsed=elapsed,
               world_ok=t.tolist() == [float(world)] * 2, threads_before=threads,
               threads_after=threading.active_count(), shm_left=sorted(shm() - segments))
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
print(json.dumps(dict(rank=rank, mode="end", shm_left=sorted(shm()))), flush=True)
