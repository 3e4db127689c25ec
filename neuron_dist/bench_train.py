"""neuron_dist.bench_train: DDP and FSDP2 training-step time, "neuron" against "gloo", one run.

    python -m neuron_dist.bench_train                    # 2 ranks, 25M-parameter MLP, ddp + fsdp2
    python -m neuron_dist.bench_train --wrap ddp --steps 20 --json train.json

The model and step follow ../shared/tools/ddp_step.py so numbers compare: an MLP of --layers
Linear(width, width)+ReLU (4 x 2500 = 25M parameters), batch 32, SGD, median step time after
warm-up. The reference is the same step in one process with no communication (compute only),
measured before the first configuration and again after each one; `ratio` = distributed step /
the mean of the two reference measurements beside it: the cost of communication that overlap did
not hide. Measuring the reference between the rows, not once up front, keeps a slow spell of this
host (they last seconds to minutes) from shifting every ratio of a run. Every configuration runs
in this invocation, one after the other, on the same machine.

`--thp on` runs the whole benchmark, reference included, with torch's huge-page switch that
neuronrun sets by default (THP_MEM_ALLOC_ENABLE=1, launcher/neuronrun_launcher/thp.py: fewer page
faults per step; the process restarts itself with it set, as torch reads it when a process first
allocates); `off` (the default) leaves it unset, so rows compare with earlier runs.
`--bucket-view on` wraps DDP with `gradient_as_bucket_view=True`, a setting of the user's, not the
backend's: DDP then keeps the gradients in its communication buckets instead of copying each into
a bucket and the reduced bucket back (ddp_step.py, and so the issue's target, use DDP's default).

`--reshard-after-forward off` shards FSDP2's layers with `reshard_after_forward=False`, also the
user's setting: a layer's full parameters stay from its forward to its backward, so backward
gathers none again (one all-gather per layer and step instead of two), for more memory.

`peak MiB` is the largest peak resident memory among the ranks.

Backend `none` is the host's floor for that ratio: as many ranks at once, each wrapped the same
way but alone (a world-1 group; DDP with a no-op communication hook), so its row holds what the
wrapper and the ranks sharing the host's cores and memory cost before any byte is exchanged.
`agree` says whether every rank ends with the same parameters and, for a backend other than Gloo,
whether they are Gloo's (the same wrapper's row of this run): bit for bit at two ranks, within
1e-6 of each parameter's absolute sum at more, where the backends add in different orders. The
ranks' agreement alone cannot see a wrong FSDP2 gradient shard: the parameter it updates is
all-gathered, so every rank holds the same wrong value. Without Gloo among --backends only the
ranks' agreement is checked. A real backend's row must agree (the exit status is 1 if one does
not); with `none` the ranks train on different data without exchanging anything, so it must not.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import statistics
import sys
import time

from neuronrun_launcher.thp import THP_VAR, rank_vars

BACKENDS = ("neuron", "gloo", "none")


def _model(a):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _steps(m, a, rank) -> float:
    import torch
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.width, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(a.warmup + a.steps):
        t = time.perf_counter()
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[a.warmup:])


def _no_comm(state, bucket):
    """DDP communication hook for the floor: the bucket's gradients, as they are."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _worker(rank, a, backend, wrap, port, q, launcher) -> None:
    from .bench import die_with_launcher, ignore_interrupt
    die_with_launcher(launcher)  # even a SIGKILLed bench_train leaves no rank running
    ignore_interrupt()  # Ctrl-C: the parent stops the ranks (bench.ranks_follow_signals)
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if a.cpu_bind == "core":  # each rank its share of the CPUs, as `neuronrun --cpu-bind core` binds
        from neuronrun_launcher.plan import rank_cpus
        os.sched_setaffinity(0, rank_cpus(tuple(sorted(os.sched_getaffinity(0))), rank, a.world))
    torch.set_num_threads(a.threads)
    from . import c10d  # noqa: F401  registers "neuron"
    if backend == "none":  # the floor: alone, in a world-1 group of its own
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, rank=rank, world_size=a.world)
    m = _model(a)
    if wrap == "ddp":
        m = torch.nn.parallel.DistributedDataParallel(m, gradient_as_bucket_view=a.bucket_view == "on")
        if backend == "none":
            m.register_comm_hook(None, _no_comm)
    else:
        from torch.distributed.fsdp import fully_shard
        reshard = a.reshard_after_forward == "on"
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, reshard_after_forward=reshard)
        m = fully_shard(m, reshard_after_forward=reshard)
    t = _steps(m, a, rank)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)
    with torch.no_grad():  # a fingerprint of the full parameters (FSDP2's are sharded DTensors):
        full = [(x.full_tensor() if hasattr(x, "full_tensor") else x).double() for x in m.parameters()]
        digest = tuple((float(x.sum()), float(x.abs().sum())) for x in full)  # per parameter: sum, |sum|
    dist.destroy_process_group()
    from .bench import put_and_exit
    put_and_exit(q, (t, digest, peak_mib))  # the next row would wait for the interpreter's finalization


def same_params(d, ref, world: int) -> bool:
    """Whether two parameter digests (_worker's: per parameter, its sum and its absolute sum) are
    the same training's: bit for bit at two ranks (a sum of two numbers does not depend on their
    order), each sum within 1e-6 of its parameter's absolute sum at more ranks (a different order
    of addition moves it by some 1e-10; one wrong gradient element, by far more)."""
    if world <= 2:
        return d == ref
    return len(d) == len(ref) and all(abs(s - rs) <= 1e-6 * ra for (s, _), (rs, ra) in zip(d, ref))


def run(a, backend: str, wrap: str) -> tuple[float, list, float]:
    """The slowest rank's median step, each rank's parameter digest (rank order not kept), and the
    largest peak resident memory of a rank in MiB."""
    from .bench import rank_context, rendezvous_port
    port = rendezvous_port(a.port)  # a fresh free port for each row unless one is given
    ctx = rank_context(("torch._dynamo",))  # DDP's and fully_shard's first call imports it: 2 s
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(r, a, backend, wrap, port, q, os.getpid())) for r in range(a.world)]
    for p in ps:
        p.start()
    # a rank that dies (a failed init, an exception in a step) never puts its result and leaves
    # the others waiting for it: poll, so its exit code is noticed within a second, not at 900 s
    results, deadline = [], time.monotonic() + 900
    try:
        while len(results) < len(ps):
            try:
                results.append(q.get(timeout=1))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(ps) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{wrap} {backend}: rank {dead[0][0]} exited with code "
                                       f"{dead[0][1]} (its error is above)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{wrap} {backend}: no result from {len(ps) - len(results)} "
                                       f"rank(s) in 900 s") from None
    finally:
        for p in ps:
            if len(results) < len(ps) and p.is_alive():  # failed: the others would wait forever
                p.terminate()
            p.join()
    return max(r[0] for r in results), [r[1] for r in results], max(r[2] for r in results)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before the reference step runs or any rank is spawned: an unknown
    backend used to kill every rank at init and leave the parent waiting, --steps 0 to fail
    only after the whole run, in statistics.median, and a --json FILE in a missing directory
    only when the results were written, after the whole run (as bench.check does). So are the
    environment's settings and the placement the neuron ranks would fail on at init, each rank
    with a traceback (--world 65 on trn2.48xlarge printed 2,456 lines)."""
    p = argparse.ArgumentParser(prog="python -m neuron_dist.bench_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--wrap", choices=("ddp", "fsdp2", "both"), default="both")
    p.add_argument("--backends", default="neuron,gloo",
                   help="comma-separated among neuron, gloo, none; 'none' is the no-communication floor (see above)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-bind", choices=("none", "core"), default="none",
                   help="core: bind each rank to its own share of the CPUs (neuronrun --cpu-bind core)")
    p.add_argument("--thp", choices=("off", "on"), default="off",
                   help="on: torch's huge pages (neuronrun --thp on) for every process of the run (see above)")
    p.add_argument("--bucket-view", choices=("off", "on"), default="off",
                   help="on: DDP(gradient_as_bucket_view=True), gradients kept in DDP's buckets (see above)")
    p.add_argument("--reshard-after-forward", choices=("on", "off"), default="on",
                   help="off: fully_shard(reshard_after_forward=False), no all-gathers in backward (see above)")
    p.add_argument("--port", type=int, help="rendezvous port of every row's ranks (default $MASTER_PORT, "
                                            "else a free one per row)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    bad = [b for b in a.backends.split(",") if b not in BACKENDS]
    if bad:
        p.error(f"unknown backends {bad}; known: {', '.join(BACKENDS)}")
    for flag, least in (("world", 1), ("layers", 1), ("width", 1), ("batch", 1), ("steps", 1),
                        ("warmup", 0), ("threads", 1)):
        if getattr(a, flag) < least:
            p.error(f"--{flag} must be at least {least}, not {getattr(a, flag)}")
    for flag, value, wrap in (("bucket-view", "on", "ddp"), ("reshard-after-forward", "off", "fsdp2")):
        if getattr(a, flag.replace("-", "_")) == value and a.wrap not in (wrap, "both"):
            p.error(f"--{flag} {value} is a {wrap} setting, and --wrap {a.wrap} runs no {wrap} row")
    from .bench import check_json_path, check_neuron_job, check_port
    check_json_path(p, a.json)
    check_port(p, a.port)
    if "neuron" in a.backends.split(","):  # what each neuron rank would raise at init
        check_neuron_job(p, a.world, "--world")
    return a


def _with_thp(argv) -> None:
    """Restart this process with THP_MEM_ALLOC_ENABLE=1, unless it is set already: torch reads it
    when a process first allocates, and the reference runs in this one."""
    wanted = rank_vars(True, os.environ)
    if not wanted:
        return
    if argv is not None:
        raise SystemExit(f"bench_train --thp on: set {wanted} in the environment first (only the command "
                         f"line restarts itself with it)")
    os.execve(sys.executable, [sys.executable, "-m", "neuron_dist.bench_train", *sys.argv[1:]],
              {**os.environ, **wanted})


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.thp == "on":
        _with_thp(argv)
    from .bench import ranks_follow_signals
    with ranks_follow_signals("neuron_dist.bench_train"):  # SIGTERM/Ctrl-C stop the row's ranks too
        return _main(a)


def _main(a) -> int:
    a.thp = "on" if os.environ.get(THP_VAR) == "1" else "off"  # what torch runs with (it takes "1"
    # only): an exported value counts, as it does under neuronrun
    import torch
    torch.set_num_threads(a.threads)
    nparams = sum(x.numel() for x in _model(a).parameters())
    configs = [(w, b) for w in (("ddp", "fsdp2") if a.wrap == "both" else (a.wrap,))
               for b in a.backends.split(",")]
    def reference() -> float:  # compute only, in this process, with no rank running
        return _steps(_model(a), a, 0)

    refs = [reference()]
    print(f"# bench_train: MLP {a.layers}x{a.width} ({nparams / 1e6:.1f}M params), batch {a.batch}, world {a.world}, "
          f"threads/rank {a.threads}, cpu-bind {a.cpu_bind}, thp {a.thp}, bucket-view {a.bucket_view}, "
          f"reshard-after-forward {a.reshard_after_forward}, "
          f"{a.steps} steps after {a.warmup} "
          f"warm-up, median; cpus {os.cpu_count()}")
    print("# compute-only: the same step in one process, measured before the first row and after each; "
          "a row's ratio is its step over the mean of the two beside it")
    print(f"{'wrap':>6} {'backend':>8} {'step ms':>9} {'compute':>8} {'ratio':>6} {'agree':>6} {'peak MiB':>9}")
    rows, runs = [], []
    for i, (wrap, backend) in enumerate(configs):
        try:
            t, digests, peak = run(a, backend, wrap)
        except RuntimeError as e:
            print(f"bench_train: {e}", file=sys.stderr)
            return 1
        refs.append(reference())
        runs.append((wrap, backend, t, (refs[-2] + refs[-1]) / 2, digests, peak))
        if i + 1 < len(configs) and configs[i + 1][0] == wrap:
            continue  # a wrapper's rows are printed together, once its Gloo row (the reference) ran
        gloo = next((r[4][0] for r in runs if r[1] == "gloo"), None)
        for w, b, t, compute, digests, peak in runs:
            agree = all(d == digests[0] for d in digests) and (
                b in ("gloo", "none") or gloo is None or same_params(digests[0], gloo, a.world))
            rows.append(dict(wrap=w, backend=b, step_ms=t * 1e3, compute_ms=compute * 1e3,
                             ratio=t / compute, agree=agree, peak_mib=peak))
            print(f"{w:>6} {b:>8} {t * 1e3:>9.1f} {compute * 1e3:>8.1f} {t / compute:>6.2f} "
                  f"{str(agree):>6} {peak:>9.0f}", flush=True)
        runs = []
    compute = statistics.median(refs)
    print(f"# compute-only step, median of {len(refs)}: {compute * 1e3:.1f} ms "
          f"({', '.join(f'{r * 1e3:.1f}' for r in refs)})")
    if a.json:
        from .bench import run_env
        with open(a.json, "w") as f:
            json.dump(dict(config=dict(vars(a), env=run_env()), params=nparams, compute_ms=compute * 1e3,
                           compute_runs_ms=[r * 1e3 for r in refs], rows=rows), f, indent=1)
    wrong = [f"{r['wrap']} {r['backend']}" for r in rows if r["backend"] != "none" and not r["agree"]]
    if wrong:
        print(f"bench_train: wrong parameters (ranks disagree, or differ from Gloo's): {', '.join(wrong)}",
              file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
