import os, sys, time, torch, torch.distributed as dist
import neuron_dist
dist.init_process_group("neuron")
r, w = dist.get_rank(), dist.get_world_size()
if "--pin" in sys.argv:
    os.sched_setaffinity(0, {r % os.cpu_count()})
torch.set_num_threads(1)
op = os.environ.get("OP", "allgather")
for nbytes in [int(x) for x in os.environ.get("SIZES", "1048576,4194304,16777216,67108864").split(",")]:
    n = nbytes // 4
    inp = torch.full((n // w,), float(r + 1))
    out = torch.empty(n)
    ts = []
    for i in range(int(os.environ.get("ITERS", 20)) + 3):
        t = time.perf_counter()
        if op == "allgather":
            dist.all_gather_into_tensor(out, inp)
        else:
            dist.broadcast(out, 0)
        ts.append(time.perf_counter() - t)
    ts = sorted(ts[3:])
    if r == 0:
        med = ts[len(ts)//2]
        print(f"{nbytes>>20:4d} MiB  min {ts[0]*1e3:8.2f} med {med*1e3:8.2f} max {ts[-1]*1e3:8.2f} ms  busbw {nbytes*(w-1)/w/med/1e9:.2f}", flush=True)
dist.destroy_process_group()
