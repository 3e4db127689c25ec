"""Tail latency of a small all-reduce against the shared-memory spin before a futex sleep.

    NEURON_DIST_SHM_SPIN_US=50 torchrun --nproc-per-node 2 spin_loop.py 4096 4000 loop
    ... spin_loop.py BYTES CALLS {loop|barrier}

Each rank pinned to its own core (PIN=0 turns that off), one thread; `loop`: calls back to
back, `barrier`: one call per Gloo barrier. Prints, over the slowest rank per call, the mean,
median, 90th and 99th percentile, and rank 0's futex wakes and sleeps per call (the transport's
_futex_wake / _futex_wait, counted by wrapping them).
"""
import os, sys, time, torch, torch.distributed as dist
import neuron_dist
import neuron_dist.transport.shm as shm
torch.set_num_threads(1)
if os.environ.get("PIN", "1") == "1":
    os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
cnt = [0, 0]
ow, owt = shm._futex_wake, shm._futex_wait
def wake(a): cnt[0] += 1; ow(a)
def wait(a, e, to): cnt[1] += 1; owt(a, e, to)
shm._futex_wake, shm._futex_wait = wake, wait
dist.init_process_group("neuron")
gloo = dist.new_group(backend="gloo")
nbytes, N, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x = torch.ones(nbytes // 4)
for _ in range(max(N // 10, 5)): dist.all_reduce(x)
cnt[:] = [0, 0]
ts = []
dist.barrier(group=gloo)
t0 = time.perf_counter()
for _ in range(N):
    if mode == "barrier": dist.barrier(group=gloo)
    a = time.perf_counter(); dist.all_reduce(x); ts.append(time.perf_counter() - a)
tot = time.perf_counter() - t0
T = torch.tensor(ts, dtype=torch.float64)
dist.all_reduce(T, op=dist.ReduceOp.MAX, group=gloo)
T, _ = T.sort()
if dist.get_rank() == 0:
    q = lambda p: T[int(p * (N - 1))].item() * 1e6
    print(f"spin {os.environ.get('NEURON_DIST_SHM_SPIN_US','-')} {nbytes>>10} KiB {mode}: mean {T.mean().item()*1e6:.0f} median {q(.5):.0f} p90 {q(.9):.0f} p99 {q(.99):.0f} us; wakes {cnt[0]/N:.2f} sleeps {cnt[1]/N:.2f} per call", flush=True)
dist.destroy_process_group()
