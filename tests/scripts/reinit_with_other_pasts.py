"""One process of a job that makes world after world in the same processes, each on a fresh
tcp:// store, where the processes' pasts differ (started by tests/test_lifecycle.py). Mode
"solo" (2 processes): world A of both; then process 1 alone as a world of 1; then world C of
both, ranks swapped. Mode "subgroup" (3 processes): world A with new_group([0, 1]) (process 2
is no member, so never makes that group); then world B of the same ranks with new_group([1, 2]).
Both times the last world's groups must form and reduce right, as under Gloo: the groups' keys
were kept apart by counts each process kept of its own groups, which differed here, so the
ranks met under different keys and waited out the time-out. Mode "samestore" (3 processes):
one TCPStore passed to both worlds (as torchrun's agent store outlives each), world A with
new_group([1, 2]), world B with new_group([0, 2]), which torch names alike: rank 0 read rank 2's
member list of world A, still in the store, and failed on "ranks disagree on the group's
members" (review Y). Mode "samestore-failed": the same store, world A's new_group([1, 2]) called by
ranks 0 and 1 only, so rank 1's times out (its list left in the store), world B's new_group([0, 1])
with rank 1 last: it must form (review AA). A "-then-gloo" suffix: the second world on Gloo, its
subgroup on neuron (a neuron world's id left behind after its close scoped it wrongly, review AE).
Prints one JSON line."""
import json
import sys
import time
from datetime import timedelta

proc, nprocs, ports, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
# "gloo-MODE": MODE with both worlds on Gloo, their subgroups on neuron; "MODE-then-gloo": the
# second world on Gloo (its subgroup on neuron)
first_backend = "gloo" if mode.startswith("gloo-") else "neuron"
second_backend = "gloo" if mode.startswith("gloo-") or mode.endswith("-then-gloo") else "neuron"
mode = mode.removeprefix("gloo-").removesuffix("-then-gloo")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

T = timedelta(seconds=8)
url = lambda k: f"tcp://127.0.0.1:{ports[k]}"  # noqa: E731
store = None
if mode.startswith("samestore"):
    store = dist.TCPStore("127.0.0.1", int(ports[0]), nprocs, is_master=proc == 0, timeout=T)
    dist.init_process_group(first_backend, store=store, rank=proc, world_size=nprocs, timeout=T)
else:
    dist.init_process_group("neuron", init_method=url(0), rank=proc, world_size=nprocs, timeout=T)
if mode in ("subgroup", "samestore"):
    first = [0, 1] if mode == "subgroup" else [1, 2]
    g = dist.new_group(first, timeout=T, backend="neuron")
    if proc in first:
        dist.all_reduce(torch.ones(2), group=g)
elif mode == "samestore-failed" and proc in (0, 1):
    try:
        dist.new_group([1, 2], timeout=timedelta(seconds=2), backend="neuron")
        assert proc == 0, "rank 1's group formed without rank 2"
    except Exception as e:  # noqa: BLE001
        assert proc == 1 and "did not join" in str(e), e
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
if mode == "solo":
    if proc == 1:
        dist.init_process_group("neuron", init_method=url(1), rank=0, world_size=1, timeout=T)
        dist.all_reduce(torch.ones(2))
        dist.destroy_process_group()
    time.sleep(0.5)
t0 = time.monotonic()
try:
    rank = (nprocs - 1 - proc) if mode == "solo" else proc
    if store is not None:
        dist.init_process_group(second_backend, store=store, rank=rank, world_size=nprocs, timeout=T)
    else:
        dist.init_process_group("neuron", init_method=url(2), rank=rank, world_size=nprocs, timeout=T)
    t = torch.full((3,), float(rank + 1))
    if mode in ("subgroup", "samestore", "samestore-failed"):
        second = {"subgroup": [1, 2], "samestore": [0, 2], "samestore-failed": [0, 1]}[mode]
        if mode.startswith("samestore") and rank == second[-1]:
            time.sleep(0.3)  # the member whose old list is still in the store comes last
        g = dist.new_group(second, timeout=T, backend="neuron")
        if rank in second:
            dist.all_reduce(t, group=g)
    else:
        dist.all_reduce(t)
    dist.barrier()
    out = dict(kind="ok", values=t.tolist())
    dist.destroy_process_group()
except Exception as e:  # noqa: BLE001
    out = dict(kind=type(e).__name__, values=str(e)[:500])
out.update(proc=proc, elapsed=time.monotonic() - t0)
print(json.dumps(out), flush=True)
