"""Per iteration: a Gloo barrier, then one 4 KiB all-reduce on BACKEND; record each rank's
barrier exit and call end on CLOCK_MONOTONIC (shared by processes on one host)."""
import os, sys, time, json, resource
import torch, torch.distributed as dist
import neuron_dist  # noqa
be = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
bar = sys.argv[3] if len(sys.argv) > 3 else "gloo"
dist.init_process_group("gloo")
r = dist.get_rank()
pg = dist.new_group(backend=be) if be != "gloo" else dist.group.WORLD
t = torch.ones(1024)
bpg = dist.new_group(backend="neuron") if bar == "spin" else None
bt = torch.zeros(1)
rows = []
for i in range(n + 20):
    if bpg is None:
        dist.barrier()
    else:
        dist.all_reduce(bt, group=bpg)
    if bar == "gloo+busy":
        e = time.perf_counter() + 0.002
        while time.perf_counter() < e: pass
    ru0 = resource.getrusage(resource.RUSAGE_THREAD); c0 = time.thread_time()
    a = time.monotonic()
    dist.all_reduce(t, group=pg)
    b = time.monotonic()
    c1 = time.thread_time(); ru1 = resource.getrusage(resource.RUSAGE_THREAD)
    rows.append((a, b, c1 - c0, ru1.ru_nvcsw - ru0.ru_nvcsw, ru1.ru_nivcsw - ru0.ru_nivcsw))
rows = rows[20:]
out = [None, None]
dist.all_gather_object(out, rows)
if r == 0:
    import statistics as st
    skew = [abs(x[0] - y[0]) * 1e6 for x, y in zip(*out)]
    call = [max(x[1] - x[0], y[1] - y[0]) * 1e6 for x, y in zip(*out)]
    late = [ (max(x[1], y[1]) - max(x[0], y[0])) * 1e6 for x, y in zip(*out)]
    cpu = [x[2] * 1e6 for x in out[0]]; vol = sum(x[3] for x in out[0]); inv = sum(x[4] for x in out[0])
    print(f"rank 0 main-thread CPU per call median {st.median(cpu):.1f} us; voluntary switches {vol}, involuntary {inv} over {len(cpu)} calls; wall median {st.median([(x[1]-x[0])*1e6 for x in out[0]]):.1f}")
    print(f"{be} after a {bar} barrier: barrier exit skew median {st.median(skew):.1f} us; collbench-style call (max over ranks) median {st.median(call):.1f}; from the later rank's entry to the last exit median {st.median(late):.1f}")
dist.destroy_process_group()
