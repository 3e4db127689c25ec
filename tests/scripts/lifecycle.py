"""One rank of the lifecycle checks: init -> subgroup -> destroy releases everything; init again
works; abort and shutdown release everything; subgroups go down with destroy_process_group()."""
import gc
import os
import sys
import threading
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401
from cases_faults import fds  # noqa: E402

rank, world, store_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1")  # the interface the backend binds: loopback


def ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("neuron_dist"))


def shm() -> list[str]:
    """This process's segments (the transport names each nd-<job>-<rank>-<pid>): another job's,
    alive for a moment while its peers map it, is no leak of ours."""
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith("nd-") and e.endswith(f"-{os.getpid()}"))


def allreduce(group=None) -> None:
    x = torch.ones(1000) * (rank + 1)
    dist.all_reduce(x, group=group)
    assert x[0].item() == world * (world + 1) / 2, x[:3]


def init(round_: int, backend: str = "neuron") -> None:
    # a file store per round: no port to race for between rounds or with other tests
    dist.init_process_group(backend, init_method=f"file://{store_dir}/round{round_}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))


# torch's own one-time resources (a pipe the store's event loop keeps) first: a Gloo
# init/destroy, so the baseline holds them and only what the neuron backend keeps counts.
init(3, "gloo")
dist.barrier()  # every rank has finished Gloo's connection mesh before any tears it down
dist.destroy_process_group()
gc.collect()
base_fds, base_shm = fds(), shm()

def check_released(when: str) -> None:
    gc.collect()  # the caller's dropped references to groups (and their stores) are gone
    extra_fds = {fd: p for fd, p in fds().items() if fd not in base_fds and not p.startswith("/dev/pts")}
    assert not ours(), f"{when}: threads left: {ours()}"
    assert not extra_fds, f"{when}: descriptors left: {extra_fds}"
    assert shm() == base_shm, f"{when}: /dev/shm entries left: {sorted(set(shm()) - set(base_shm))}"


# 1. init, a subgroup in a scrambled order, destroy everything at once
init(0)
sub = dist.new_group(list(range(world))[::-1])
allreduce()
allreduce(sub)
assert ours(), "the groups should have engine threads while alive"
dist.destroy_process_group()
del sub
check_released("after destroy_process_group() with a live subgroup")

# 2. init again in the same process, destroy the subgroup alone, then the default group
init(1)
sub = dist.new_group(list(range(world)))
allreduce(sub)
dist.destroy_process_group(sub)
del sub
allreduce()
dist.destroy_process_group()
check_released("after the second init/destroy")

# 3. one store that outlives the groups (as torchrun's agent store does), three rounds: every
# round's keys stay apart from the last one's; and a destroyed group is freed at once, not left
# to the cycle collector holding its store (a TCPStore server on rank 0, met by the next init)
import weakref  # noqa: E402
store = dist.FileStore(f"{store_dir}/persistent", world)
for round_ in range(3):
    gc.disable()
    dist.init_process_group("neuron", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    sub = dist.new_group(list(range(world)))
    allreduce()
    allreduce(sub)
    freed = weakref.ref(dist.distributed_c10d._get_default_group().group)
    del sub
    dist.destroy_process_group()
    assert freed() is None, f"round {round_}: the destroyed group is still alive (a reference cycle)"
    gc.enable()
del store
check_released("after three rounds on one store")

# 4. destroy with work still queued: it runs first, as Gloo's destructor drains its queue (async
# all-reduces of 4 MiB issued back to back, the next queued while the engine drives the last;
# and an isend whose receiver comes later): each completes with the right values
N = 1 << 20
for round_ in (4, 5):
    init(round_)
    sub = dist.new_group(list(range(world)))
    xs = [torch.full((N,), float(rank + 1 + i)) for i in range(4)]
    works = [dist.all_reduce(x, group=sub, async_op=True) for x in xs]
    dist.destroy_process_group(sub)
    for i, (x, w) in enumerate(zip(xs, works)):
        w.wait()
        assert x[0].item() == x[-1].item() == world * (world + 1) / 2 + world * i, (round_, i, x[:3])
    if rank == 0:
        w = dist.isend(torch.full((N,), 7.0), 1)
    elif rank == 1:
        got = torch.zeros(N)
        time.sleep(0.3)
        dist.recv(got, 0)
        assert got[0].item() == got[-1].item() == 7.0, got[:3]
    dist.destroy_process_group()
    if rank == 0:
        w.wait()
check_released("after destroy with work still queued")

# 5. abort: pending work fails, everything is released
init(2)
allreduce()
dist.distributed_c10d._abort_process_group()
check_released("after abort")
print(f"rank {rank}: lifecycle ok", flush=True)
