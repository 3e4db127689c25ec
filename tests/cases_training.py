"""Rank-side training checks: DDP, FSDP1, FSDP2 (1-D and 2-D meshes), DTensor and distributed
checkpoint on the neuron backend, against the same run on Gloo and against one process that
trains on every rank's batch at once (data parallelism must equal large-batch training)."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import rankctx as R
from rankctx import same

STEPS = 20


def _model(unused: bool = False) -> nn.Module:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)
            if unused:  # never used in forward: DDP needs find_unused_parameters
                self.spare = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    return Net()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(model, rank, world, steps=STEPS, no_sync_every=0, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        x, y = _batch(s, rank)
        if no_sync_every and s % no_sync_every == 0 and hasattr(model, "no_sync"):
            with model.no_sync():  # accumulate locally, synchronise on the next step
                nn.functional.mse_loss(model(x), y).backward()
            x, y = _batch(s + 10_000, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(world, steps=STEPS, no_sync_every=0, lr=0.05, unused=False):
    """One process, the whole global batch: what data parallelism must reproduce."""
    model = _model(unused)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        if no_sync_every and s % no_sync_every == 0:
            for r in range(world):
                x, y = _batch(s, r)
                (nn.functional.mse_loss(model(x), y) / world).backward()
            xs = [_batch(s + 10_000, r) for r in range(world)]
        else:
            xs = [_batch(s, r) for r in range(world)]
        for x, y in xs:
            (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: dict, b: dict, what: str, atol=1e-5):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=lambda m: f"{what} {k}: {m}")


def ddp(rank, world, bucket_view=False, no_sync=False, unused=False):
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = dict(gradient_as_bucket_view=bucket_view, find_unused_parameters=unused, bucket_cap_mb=0.0005)
    results = {}
    for name, pg in (("neuron", None), ("gloo", R.GLOO)):
        m = DDP(_model(unused), process_group=pg, **kw)
        losses = _train(m, rank, world, no_sync_every=3 if no_sync else 0)
        results[name] = ({k: v.detach().clone() for k, v in m.module.state_dict().items()}, losses)
    _close(results["neuron"][0], results["gloo"][0], "ddp neuron vs gloo")
    ref = _reference(world, no_sync_every=3 if no_sync else 0, unused=unused)
    _close(results["neuron"][0], ref, "ddp neuron vs single-process reference")
    return results["neuron"][1][-1]


def compiled(rank, world):
    """torch.compile over the group's calls: a compiled function that broadcasts and waits at a
    barrier, and a compiled DDP model (its reducer broadcasts while the compiled forward runs).
    Dynamo traced into the backend's Python methods and failed ("UnsafeScriptObjectError") where
    Gloo's C++ methods break the graph; results equal Gloo's and the reference."""
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch._dynamo.reset()

    @torch.compile
    def f(x, group):
        y = x * 2
        dist.broadcast(y, src=0, group=group)
        dist.barrier(group=group)
        return y + 1

    for group in (None, R.GLOO):
        got = f(torch.arange(4.0) + rank, group)
        same(got, torch.arange(4.0) * 2 + 1, f"compiled broadcast + barrier on {'gloo' if group else 'neuron'}")
    results = {}
    for name, pg in (("neuron", None), ("gloo", R.GLOO)):
        m = DDP(_model(), process_group=pg)
        _train(torch.compile(m), rank, world, steps=3)
        results[name] = {k: v.detach().clone() for k, v in m.module.state_dict().items()}
    _close(results["neuron"], results["gloo"], "compiled ddp neuron vs gloo")
    _close(results["neuron"], _reference(world, steps=3), "compiled ddp neuron vs single-process reference")
    torch._dynamo.reset()
    return True


def ddp_hook_and_join(rank, world):
    """Stock torch code that leans on the group's corners: PowerSGD's hook all-reduces inside
    its future's callback and waits there (it deadlocked when callbacks ran on the engine
    thread); Join with uneven inputs and unused parameters calls `pg.allreduce(tensor)` (the
    bare-tensor overload). Parameters after training equal Gloo's."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = {}
    for name, pg in (("neuron", None), ("gloo", R.GLOO)):
        # one bucket: with several, the hook's all-reduces (issued from a completion callback)
        # race the next bucket's across ranks, on this backend and Gloo alike (README)
        m = DDP(_model(), process_group=pg, bucket_cap_mb=25)
        m.register_comm_hook(psgd.PowerSGDState(process_group=pg, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                min_compression_rate=0.1, random_seed=0), psgd.powerSGD_hook)
        _train(m, rank, world, steps=6)
        j = DDP(_model(unused=True), process_group=pg, find_unused_parameters=True)
        opt = torch.optim.SGD(j.parameters(), lr=0.05)
        with Join([j]):
            for s in range(4 + rank):  # uneven: rank r runs 4 + r steps
                x, y = _batch(s, rank)
                nn.functional.mse_loss(j(x), y).backward()
                opt.step()
                opt.zero_grad()
        results[name] = ({k: v.detach().clone() for k, v in m.module.state_dict().items()},
                         {k: v.detach().clone() for k, v in j.module.state_dict().items()})
    _close(results["neuron"][0], results["gloo"][0], "powerSGD neuron vs gloo")
    _close(results["neuron"][1], results["gloo"][1], "join neuron vs gloo")
    return True


def fsdp1(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    out = {}
    for name, pg in (("neuron", dist.distributed_c10d._get_default_group()), ("gloo", R.GLOO)):
        m = FSDP(_model(), process_group=pg, use_orig_params=True, device_id=torch.device("cpu"))
        _train(m, rank, world)
        with FSDP.state_dict_type(m, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            out[name] = {k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in m.state_dict().items()}
    _close(out["neuron"], out["gloo"], "fsdp1 neuron vs gloo")
    _close(out["neuron"], _reference(world), "fsdp1 vs reference")
    return 1


def _fsdp2_model(mesh):
    from torch.distributed.fsdp import fully_shard
    m = _model()
    fully_shard(m.a, mesh=mesh)
    fully_shard(m.b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _full(m) -> dict:
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in m.state_dict().items()}


def fsdp2(rank, world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    res = {}
    for name, mesh in (("neuron", init_device_mesh("cpu", (world,))), ("gloo", DeviceMesh.from_group(R.GLOO, "cpu"))):
        m = _fsdp2_model(mesh)
        _train(m, rank, world)
        res[name] = _full(m)
    _close(res["neuron"], res["gloo"], "fsdp2 neuron vs gloo")
    _close(res["neuron"], _reference(world), "fsdp2 vs reference")
    return 1


def fsdp2_hsdp(rank, world):
    """HSDP: replicate over dim 0, shard over dim 1 of a 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m = _model()
    fully_shard(m.a, mesh=mesh)
    fully_shard(m.b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    _train(m, rank, world)
    _close(_full(m), _reference(world), "hsdp vs reference")
    return 1


def dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    full = torch.randn(world * 3, 5)
    d = distribute_tensor(full, mesh, [Shard(0)])
    same(d.to_local(), full[rank * 3:(rank + 1) * 3], "distribute_tensor shard")
    same(d.full_tensor(), full, "DTensor all-gather")
    r = d.redistribute(mesh, [Replicate()])
    same(r.to_local(), full, "redistribute to replicate")
    s = (d * 2).sum()  # a partial -> all-reduce
    torch.testing.assert_close(s.full_tensor(), full.sum() * 2)
    t = distribute_tensor(full, mesh, [Shard(1)]) if full.shape[1] % world == 0 else None
    if t is not None:
        same(t.redistribute(mesh, [Shard(0)]).to_local(), full[rank * 3:(rank + 1) * 3], "all-to-all redistribute")
    return 4


def checkpoint(rank, world):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    m = _fsdp2_model(mesh)
    _train(m, rank, world, steps=3)
    before = _full(m)
    path = [tempfile.mkdtemp(prefix="neuron_dist_dcp_")] if rank == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(m.state_dict(), checkpoint_id=path[0])
    m2 = _fsdp2_model(mesh)
    sd = m2.state_dict()
    dcp.load(sd, checkpoint_id=path[0])
    m2.load_state_dict(sd)
    _close(_full(m2), before, "checkpoint round trip", atol=0)
    dist.barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(path[0], ignore_errors=True)
    return 1


def fsdp1_sharded_checkpoint(rank, world):
    """FSDP1's SHARDED_STATE_DICT through DCP where some rank holds no shard of a parameter (the
    4-row layer's weight and bias split 2, 2, none at world 3): torch asked CUDA for such a rank's
    device unless the group was Gloo's. Saved, converted with .to() and loaded back, on both."""
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    res, shardless = {}, 0
    for name, pg in (("neuron", dist.distributed_c10d._get_default_group()), ("gloo", R.GLOO)):
        def make():
            return FSDP(_model(), process_group=pg, use_orig_params=True, device_id=torch.device("cpu"))
        m = make()
        _train(m, rank, world, steps=3)
        path = [tempfile.mkdtemp(prefix="neuron_dist_dcp1_")] if rank == 0 else [None]
        dist.broadcast_object_list(path, src=0, group=pg)
        with FSDP.state_dict_type(m, StateDictType.SHARDED_STATE_DICT):
            sd = m.state_dict()
            assert all(v.device == torch.device("cpu") for v in sd.values()), name
            shardless += sum(not v.local_shards() for v in sd.values())
            wide = {k: v.to(torch.float64) for k, v in sd.items()}  # a collective when shardless
            assert all(v.dtype == torch.float64 and v.device.type == "cpu" for v in wide.values()), name
            dcp.save(sd, checkpoint_id=path[0], process_group=pg)
        m2 = make()
        with FSDP.state_dict_type(m2, StateDictType.SHARDED_STATE_DICT):
            sd2 = m2.state_dict()
            dcp.load(sd2, checkpoint_id=path[0], process_group=pg)
            m2.load_state_dict(sd2)
        with FSDP.summon_full_params(m), FSDP.summon_full_params(m2):
            res[name] = {k: v.detach().clone() for k, v in m2.named_parameters()}
            _close(res[name], {k: v.detach().clone() for k, v in m.named_parameters()}, f"{name} round trip", atol=0)
        dist.barrier(group=pg)
        if rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    _close(res["neuron"], res["gloo"], "sharded checkpoint neuron vs gloo")
    return shardless


def pipeline(rank, world, steps=2):
    """Pipeline parallelism (torch.distributed.pipelining, its point-to-point batches): 1F1B with
    one stage per rank and interleaved 1F1B with two, on the neuron group and on Gloo; the
    parameters after `steps` SGD steps equal both Gloo's and one process training the whole
    model on the whole batch (the schedules scale gradients by the microbatch count)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    width, cpu = 16, torch.device("cpu")

    def layers(n):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])

    def data(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(4 * world, width, generator=g), torch.randn(4 * world, width, generator=g)  # 2 a microbatch

    loss_fn = lambda out, y: nn.functional.mse_loss(out, y)
    checks = 0
    for schedule, per_rank in ((Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2)):
        n = per_rank * world
        ref = layers(n)
        for s in range(steps):
            x, y = data(s)
            loss_fn(ref(x), y).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        results = {}
        for name, group in (("neuron", None), ("gloo", R.GLOO)):
            full = layers(n)
            idx = [rank + k * world for k in range(per_rank)]  # interleaved: stages rank, rank + world
            stages = [PipelineStage(full[i:i + 1], i, n, cpu, group=group) for i in idx]
            sched = schedule(stages if per_rank > 1 else stages[0], n_microbatches=2 * world, loss_fn=loss_fn)
            for s in range(steps):
                x, y = data(s)
                if rank == 0:
                    sched.step(x, target=y if world == 1 else None)
                elif rank == world - 1:
                    sched.step(target=y)
                else:
                    sched.step()
                with torch.no_grad():
                    for st in stages:
                        for p in st.submod.parameters():
                            p -= 0.1 * p.grad
                            p.grad = None
            results[name] = {f"{i}.{k.split('.', 1)[1]}": v.detach().clone() for i, st in zip(idx, stages)
                             for k, v in st.submod.state_dict().items()}  # "0.weight" of layer i: "i.weight"
        mine = {k: v for k, v in ref.state_dict().items() if int(k.split(".")[0]) in idx}
        _close(results["neuron"], results["gloo"], f"{schedule.__name__} neuron vs gloo", atol=0)
        _close(results["neuron"], mine, f"{schedule.__name__} vs one process")
        checks += 2
    return checks
