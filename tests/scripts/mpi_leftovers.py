"""Run by test_transport_mpi.py under mpirun (NEURON_DIST_TRANSPORT=mpi): two groups run and are
destroyed, then the program uses MPI itself. Prints, per rank, how many messages the backend
left queued in MPI_COMM_WORLD and what the program's own any-tag receive got."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import neuron_dist  # noqa: F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
r, n = dist.get_rank(), dist.get_world_size()
sub = dist.new_group(list(range(n)))
for g in (None, sub):
    t = torch.full((1000,), float(r))
    dist.all_reduce(t, group=g)
    assert t[0].item() == n * (n - 1) / 2
# rank 0 closes first, and rank 1 sees its closing frame before its own close (as a receive
# or the engine's look at its peers does): its close then sent rank 0 none, and rank 0 waited
# for it for 2 s
if r == 1:
    pg = sub if isinstance(sub, neuron_dist.NeuronProcessGroup) else sub._get_backend(torch.device("cpu"))
    transport = pg.group.transport
    deadline = time.monotonic() + 10
    while not transport.peer_finished(0) and time.monotonic() < deadline:
        time.sleep(0.01)
t0 = time.monotonic()
dist.destroy_process_group(sub)
took = time.monotonic() - t0
dist.destroy_process_group()
print(f"rank {r}: destroy took {took:.3f}s", flush=True)
comm = MPI.COMM_WORLD
comm.Barrier()
left, status = [], MPI.Status()
while comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
    left.append((status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)))
    comm.Recv(bytearray(status.Get_count(MPI.BYTE)), source=status.Get_source(), tag=status.Get_tag())
comm.Barrier()
if r == 0:
    comm.send({"epoch": 1}, dest=1)
    got = None
elif r == 1:
    got = comm.recv(source=0)
print(f"rank {r}: left {len(left)} {left} got {got}", flush=True)
