"""One rank of an MPI job (started by tests/test_transport_mpi.py through mpirun): brings up the
"neuron" backend with NEURON_DIST_TRANSPORT=mpi, plus a Gloo group for comparison, and runs the
named cases ("allreduce" is cases_collectives.allreduce, "cases_training:ddp" names its module),
exiting non-zero on the first failure."""
import importlib
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("NEURON_DIST_TRANSPORT", "mpi")
    from mpi4py import MPI  # noqa: F401  initialise MPI before torch spawns any thread
    import torch
    import torch.distributed as dist
    import neuron_dist  # noqa: F401
    import rankctx
    torch.set_num_threads(1)
    dist.init_process_group("neuron", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    pg = dist.distributed_c10d._get_default_group()
    transport = getattr(getattr(pg, "group", None), "transport", None)
    assert transport is not None and transport.name == os.environ["NEURON_DIST_TRANSPORT"], transport
    rankctx.GLOO = dist.new_group(backend="gloo")
    rankctx.RANK, rankctx.WORLD = rank, world
    status = 0
    for case in sys.argv[1:]:
        try:
            module, _, name = case.rpartition(":")
            n = getattr(importlib.import_module(module or "cases_collectives"), name)(rank, world)
            print(f"rank {rank}: {case} ok ({n} checks)", flush=True)
        except BaseException:  # noqa: BLE001
            print(f"rank {rank}: {case} FAILED\n{traceback.format_exc()}", flush=True)
            status = 1
            break
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
