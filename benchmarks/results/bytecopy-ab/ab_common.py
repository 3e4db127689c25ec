"""What ab_w2.py and rs_w2_loop.py share: one pinned core and one torch thread per rank, the
"neuron" group beside a Gloo one for barriers, and the back-to-back timing loop."""
import os, time, torch, torch.distributed as dist
import neuron_dist  # noqa: F401  registers "neuron"


def setup():
    """Pin this rank, join the group; returns (Gloo group, rank, world size)."""
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0)); os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    dist.init_process_group("neuron")
    return dist.new_group(backend="gloo"), dist.get_rank(), dist.get_world_size()


def loop(f, iters, gloo, reps=7):
    """ms per call of `f`: `reps` loops of `iters` back-to-back calls after a barrier, the median
    loop of the slowest rank."""
    f()
    best = []
    for _ in range(reps):
        dist.barrier(group=gloo)
        t = time.perf_counter()
        for _ in range(iters): f()
        best.append((time.perf_counter() - t) / iters)
    T = torch.tensor(best, dtype=torch.float64); dist.all_reduce(T, op=dist.ReduceOp.MAX, group=gloo)
    return T.median().item() * 1e3
