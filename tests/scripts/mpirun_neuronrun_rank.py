"""A rank of `mpirun -n 1 neuronrun --nproc-per-node 2 ...`: reports whether it still sees the
launcher's MPI process variables (it must not: it is no MPI process) and whether its parent,
the neuronrun launcher, loaded an MPI library (it must not initialise MPI either)."""
import os, torch, torch.distributed as dist
import neuron_dist
from neuron_dist.transport import select
dist.init_process_group("neuron")
t = torch.ones(2) * (dist.get_rank() + 1); dist.all_reduce(t)
with open(f"/proc/{os.getppid()}/maps") as f:
    launcher_mpi = "libmpi" in f.read()
leaked = sorted(k for k in os.environ if k.startswith(("OMPI_COMM_WORLD", "PMIX_RANK", "PMI_RANK")))
print(f"rank {dist.get_rank()}: sum={t[0].item():.0f} is_mpi_rank={select.is_mpi_rank()} leaked={leaked} launcher_mpi={launcher_mpi}", flush=True)
dist.destroy_process_group()
