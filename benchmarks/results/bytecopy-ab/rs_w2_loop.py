"""A/B of the data path's copies on reduce-scatter, world 2, one core per rank, one torch thread,
default settings: a 25 MiB and a 4 MiB input, back to back (7 loops of 10 and 40 calls, the
median loop of the slowest rank). Interleaved per checkout:

    TAG=old PYTHONPATH=<checkout> torchrun --nproc-per-node 2 rs_w2_loop.py
"""
import os, sys, time, torch, torch.distributed as dist
import neuron_dist
torch.set_num_threads(1)
cores = sorted(os.sched_getaffinity(0)); os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
dist.init_process_group("neuron")
gloo = dist.new_group(backend="gloo")
rank, n = dist.get_rank(), dist.get_world_size()
def loop(f, iters, reps=7):
    f()
    best = []
    for _ in range(reps):
        dist.barrier(group=gloo)
        t = time.perf_counter()
        for _ in range(iters): f()
        best.append((time.perf_counter() - t) / iters)
    T = torch.tensor(best, dtype=torch.float64); dist.all_reduce(T, op=dist.ReduceOp.MAX, group=gloo)
    return T.median().item() * 1e3
x = torch.ones((25 << 20) // 4); o = torch.empty((25 << 20) // 4 // n)
y = torch.ones((4 << 20) // 4); p = torch.empty((4 << 20) // 4 // n)
r = [loop(lambda: dist.reduce_scatter_single(o, x), 10), loop(lambda: dist.reduce_scatter_single(p, y), 40)]
if rank == 0:
    print(os.environ.get("TAG", ""), f"reduce_scatter 25M {r[0]:.2f} ms; 4M {r[1]:.3f} ms", flush=True)
dist.destroy_process_group()
