"""Train a small MLP with DistributedDataParallel on the "neuron" backend.

    neuronrun --nproc-per-node 2 examples/ddp_train.py --steps 50
    torchrun  --nproc-per-node 2 examples/ddp_train.py          # works the same

The only difference from a Gloo script is the backend name (and `import neuron_dist`).
Each rank draws its own shard of a synthetic regression task (y = x @ W + noise); the loss
printed by rank 0 is the average over ranks.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import neuron_dist  # noqa: F401  registers the "neuron" backend


def synthetic_batch(step: int, rank: int, batch: int, dim: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    w = torch.linspace(-1, 1, dim * 4).reshape(dim, 4)
    x = torch.randn(batch, dim, generator=g)
    return x, x @ w + 0.01 * torch.randn(batch, 4, generator=g)


def train(model, opt, a, rank: int, world: int, label: str) -> None:
    """The loop both examples share: synthetic batches, rank 0 prints the rank-averaged loss."""
    t0 = time.perf_counter()
    for step in range(a.steps):
        x, y = synthetic_batch(step, rank, a.batch, a.dim)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 10 == 0 or step == a.steps - 1):
            print(f"step {step:4d}  loss {avg.item():.5f}", flush=True)
    if rank == 0:
        print(f"done: {label}{a.steps} steps on {world} ranks ({a.backend}) in {time.perf_counter() - t0:.2f}s",
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=os.environ.get("BACKEND", "neuron"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(a.dim, 256), nn.ReLU(), nn.Linear(256, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(model, opt, a, rank, world, "")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
