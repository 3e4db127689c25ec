"""neuron_dist: a topology-aware torch.distributed backend ("neuron") for Trainium-style clusters.

    import neuron_dist
    torch.distributed.init_process_group("neuron")

Importing the package registers the backend once; DDP, FSDP, DTensor and plain
torch.distributed code then run unchanged.
"""
from . import config as _config
from . import mpi_env as _mpi_env
from .c10d import NeuronProcessGroup, NeuronWork, register as _register
from .report import report

__all__ = ["NeuronProcessGroup", "NeuronWork", "report"]
__version__ = "0.1.0"

_mpi_env.adopt()  # under mpirun/srun without torchrun: RANK, WORLD_SIZE, MASTER_* from MPI
_config.setup_logging()  # after adopt: its lines carry the rank
_register()
