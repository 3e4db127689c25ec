"""Train a small MLP with FSDP2 (`fully_shard`) on the "neuron" backend.

    neuronrun --nproc-per-node 2 examples/fsdp_train.py --steps 30
    neuronrun --nproc-per-node 4 examples/fsdp_train.py --hsdp     # 2-D mesh: replicate x shard
    neuronrun --nproc-per-node 2 examples/fsdp_train.py --fsdp1    # FullyShardedDataParallel

The only difference from a Gloo script is the backend name. Parameters are sharded across
ranks; each step all-gathers them for compute and reduce-scatters gradients.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import neuron_dist  # noqa: F401  registers the "neuron" backend
from ddp_train import train


def build(a, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(a.dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    if a.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if a.hsdp
            else init_device_mesh("cpu", (world,)))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=os.environ.get("BACKEND", "neuron"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hsdp", action="store_true", help="2-D mesh (needs an even world size)")
    p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel instead of fully_shard")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(a, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kind = "FSDP1" if a.fsdp1 else ("HSDP" if a.hsdp else "FSDP2")
    train(model, opt, a, rank, world, f"{kind}, ")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
