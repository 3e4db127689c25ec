"""How long a world-2 all-gather spends in Python before its first byte moves (the local copy of the
rank's own block), back to back, by message size: median us from the call to each stage.

    torchrun --nproc-per-node 2 precopy.py BYTES
"""
import os, sys, time, torch, numpy as np, torch.distributed as dist
import neuron_dist
from neuron_dist.collectives import executor
from neuron_dist import c10d, group
dist.init_process_group("neuron")
r, w = dist.get_rank(), dist.get_world_size()
n = int(sys.argv[1]) // 4
x = torch.from_numpy(np.full(n // w, float(r), np.float32)); out = torch.empty(n)
for _ in range(10): dist.all_gather_into_tensor(out, x)
marks = {}
def wrapm(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        marks.setdefault(name, time.perf_counter()); return f(*a, **k)
    setattr(obj, name, g)
wrapm(c10d.NeuronProcessGroup, "all_gather_single")
wrapm(c10d.NeuronProcessGroup, "_allgather_packed")
wrapm(c10d.NeuronProcessGroup, "_collective")
wrapm(c10d.NeuronProcessGroup, "_submit")
wrapm(group.Group, "submit")
wrapm(executor.Execution, "_next_round")
executor.copy_into = (lambda f: (lambda d, s: (marks.setdefault("copy", time.perf_counter()), f(d, s))[1]))(executor.copy_into)
acc = {}
for _ in range(100):
    marks.clear(); t = time.perf_counter()
    dist.all_gather_into_tensor(out, x)
    for k, v in marks.items(): acc.setdefault(k, []).append((v - t) * 1e6)
if r == 0: print(r, {k: round(sorted(v)[len(v)//2], 1) for k, v in sorted(acc.items(), key=lambda kv: sorted(kv[1])[50])})
dist.destroy_process_group()
