"""python -m neuron_dist.topology: look at the modelled hardware and the cost model.

  show INSTANCE [--lnc N] [--svg FILE]
      the instance's chips, cores and links, every figure with its source, and the node's
      Hamiltonian ring(s) drawn over the chip graph to an SVG file (default INSTANCE-rings.svg)
  predict COLLECTIVE [--instance NAME] [--nodes N] [--ppn K] [--lnc N] [--cores-per-rank M]
          [--sizes 8K,1M,64M] [--algo NAME]
      an nccl-tests-like table of modelled time, algbw and busbw, with the algorithm the backend
      would choose at each size (or the one given with --algo); NEURON_DIST_ALGO is honoured.
      The ranks are placed as neuronrun lays them out: M consecutive logical cores each
      (default $NEURON_RT_NUM_CORES, else 1), so --cores-per-rank 4 at LNC=2 on trn2 is one
      rank per chip; --ppn defaults to every logical core divided by M.
      '-' where there is nothing to show: every column of a one-rank group, and a barrier's
      bandwidths (it moves no data).
  list
      the known instance models
"""
from __future__ import annotations

import argparse
import os
import sys

from ..bench import paramcount, parse_size  # one size syntax and count column for bench and this tool
from .cost import bus_factor, estimate, normalise_collective
from .draw import svg
from .graph import hamiltonian_cycles
from .instances import get_instance, list_instances
from .placement import DEFAULT_INSTANCE, place
from .select import ENV_ALGO, backend_algorithms, backend_choose, backend_forced


def parse_sizes(s: str) -> list[int]:
    """--sizes: a comma-separated list of positive sizes, parsed before any table row prints
    (parse_size's ValueError for "inf" or "0.5" becomes argparse's usage error, exit 2)."""
    sizes = []
    for x in s.split(","):
        try:
            sizes.append(parse_size(x))
        except ValueError:
            sizes.append(0)
        if sizes[-1] < 1:
            raise argparse.ArgumentTypeError(
                f"expected sizes like 8K,4KiB,1M (each a whole number of bytes, at least 1), "
                f"got {x.strip()!r} in {s!r}")
    return sizes


def _fmt_bw(v: float) -> str:
    return f"{v / 1e9:.2f} GB/s" if v >= 1e9 else f"{v / 1e6:.1f} MB/s"


def cmd_show(args) -> int:
    inst = get_instance(args.instance)
    lnc = inst.check_lnc(args.lnc)
    path = args.svg or f"{inst.name}-rings.svg"
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):  # before the description prints, not after it as a traceback
        raise ValueError(f"--svg {path}: directory {d} does not exist")
    if os.path.isdir(path) or not os.access(d, os.W_OK):  # so are these (the error came after the description)
        raise ValueError(f"--svg {path}: " + ("a directory, not a file" if os.path.isdir(path) else
                                              f"directory {d} is not writable"))
    p = print
    p(f"{inst.name}: {inst.chips} chips x {inst.physical_cores_per_chip} physical cores; "
      f"LNC={lnc}: {inst.cores_per_chip(lnc)} logical cores per chip, {inst.cores(lnc)} per node "
      f"(LNC supported: {', '.join(map(str, inst.supported_lnc))}; default {inst.default_lnc})")
    graph = inst.graph + (f" {'x'.join(map(str, inst.torus_dims))} wrap={list(inst.torus_wrap)}"
                          if inst.torus_dims else "")
    if inst.domain_nodes > 1:
        graph += f", {inst.domain_nodes} nodes per NeuronLink domain " + \
            ("(3D torus)" if inst.graph == "torus" else "(one switched fabric)")
    p(f"  chip graph: {graph}; {inst.links_per_chip()} links per chip")
    for name in ("link_bandwidth", "domain_link_bandwidth", "hbm_bandwidth", "efa_bandwidth"):
        v = getattr(inst, name)
        if v:
            p(f"  {name:22s} {_fmt_bw(v):>14}   [{inst.sources.get(name, '-')}]")
    for name in ("link_latency", "efa_latency"):
        v = getattr(inst, name)
        if v:
            p(f"  {name:22s} {v * 1e6:11.1f} us   [{inst.sources.get(name, '-')}]")
    p(f"  multi_node: {inst.multi_node}")
    if inst.notes:
        p(f"  notes: {inst.notes}")
    for c in range(inst.chips):
        p(f"  chip {c:2d} at {inst.chip_coords(c)}: cores {c * inst.cores_per_chip(lnc)}-"
          f"{(c + 1) * inst.cores_per_chip(lnc) - 1}, neighbours {inst.chip_neighbours(c)}")
    rings = hamiltonian_cycles(inst)
    for i, r in enumerate(rings):
        p(f"  ring {i}: {' '.join(map(str, r))}")
    with open(path, "w") as f:
        f.write(svg(inst, rings, lnc, f"{inst.name} (LNC={lnc}): chips, links, "
                                      f"{len(rings)} link-disjoint ring(s)"))
    p(f"  drawing: {path}")
    return 0


def cores_per_rank(arg: int | None, env_value: str | None, inst, lnc: int) -> int:
    """Logical cores per rank as neuronrun takes them: --cores-per-rank, else $NEURON_RT_NUM_CORES,
    else 1. Predict modelled one core per rank while the backend placed such a job one rank per
    chip (trn2 LNC=2, M=4: 'direct' predicted at 1 MiB, 'ring' run). Like neuronrun, M must
    divide the cores per chip or be a multiple of them (no rank straddles a chip)."""
    where = "--cores-per-rank" if arg is not None else f"NEURON_RT_NUM_CORES={env_value!r}"
    if arg is not None:
        m = arg
    elif env_value and env_value.strip():
        try:
            m = int(env_value)
        except ValueError:
            raise ValueError(f"{where}: expected a positive number of cores per rank") from None
    else:
        return 1
    if m < 1:
        raise ValueError(f"{where}: cores per rank must be at least 1, not {m}")
    k, total = inst.cores_per_chip(lnc), inst.cores(lnc)
    if k % m and m % k:
        raise ValueError(f"{where}: {m} cores per rank do not fit {k} logical cores per chip on "
                         f"{inst.name} at LNC={lnc}; it must divide {k} or be a multiple of it "
                         f"(as neuronrun requires)")
    if m > total:
        raise ValueError(f"{where}: {m} cores per rank, but {inst.name} at LNC={lnc} has {total} "
                         f"logical cores per node")
    return m


def cmd_predict(args) -> int:
    coll = normalise_collective(args.collective)
    job_instance = args.instance is None  # the job's own (NEURON_DIST_INSTANCE), not one named here
    inst = get_instance(args.instance or os.environ.get("NEURON_DIST_INSTANCE") or DEFAULT_INSTANCE)
    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, not {args.nodes}")
    # the job's LNC is the default for the job's instance; an instance named with --instance gets its own
    lnc_env = os.environ.get("NEURON_LOGICAL_NC_CONFIG") if job_instance else None
    try:
        lnc = inst.check_lnc(args.lnc if args.lnc is not None else int(lnc_env) if lnc_env else None)
    except ValueError as e:
        raise ValueError(f"{'--lnc' if args.lnc is not None else f'NEURON_LOGICAL_NC_CONFIG={lnc_env!r}'}: {e}") from None
    if args.ppn is not None and args.ppn < 1:  # 0 is not "every core": that is --ppn left out
        raise ValueError(f"--ppn must be at least 1, not {args.ppn} (leave it out for every logical core)")
    m = cores_per_rank(args.cores_per_rank, os.environ.get("NEURON_RT_NUM_CORES"), inst, lnc)
    ppn = inst.cores(lnc) // m if args.ppn is None else args.ppn
    topo = place(inst, args.nodes, ppn, lnc, cores_per_rank=m)
    # what the backend would run: its algorithms only, NEURON_DIST_ALGO checked as it checks it
    forced = backend_forced(os.environ.get(ENV_ALGO))
    if args.algo:
        runnable = backend_algorithms(coll)
        if args.algo.strip().lower() not in runnable:
            raise ValueError(f"--algo {args.algo!r}: the backend has no such algorithm for {coll}; "
                             f"valid: {', '.join(runnable)}")
        forced[coll] = args.algo.strip().lower()
    n = topo.size
    rows = []  # every row computed before the header prints, so an error comes alone
    for nbytes in args.sizes:
        algo = backend_choose(coll, nbytes, topo, forced)
        rows.append((nbytes, algo, estimate(coll, algo, nbytes, topo)))
    per_rank = f", {m} cores per rank" if m > 1 else ""
    print(f"# {coll} on {args.nodes} x {inst.name} ({ppn} ranks per node{per_rank}, LNC={lnc}, {n} ranks); "
          f"modelled device time")
    print(f"# {'size(B)':>12} {'count':>12} {'type':>6} {'time(us)':>10} {'algbw(GB/s)':>12} "
          f"{'busbw(GB/s)':>12}  algorithm")
    busbws = []
    # nccl-tests' count (bench's column too): one rank's block where the buffer holds one per rank
    per_rank = coll in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")
    for nbytes, algo, t in rows:
        count = paramcount(nbytes, 4, n, per_rank)
        if n == 1:  # one rank runs no algorithm and moves nothing: '-', as in bench's model column
            print(f"  {nbytes:>12} {count:>12} {'float':>6} {'-':>10} {'-':>12} {'-':>12}  -")
            continue
        if coll == "barrier" or t <= 0:  # no data moved: bytes / a size-independent time means nothing
            print(f"  {nbytes:>12} {count:>12} {'float':>6} {t * 1e6:>10.2f} {'-':>12} {'-':>12}  {algo}")
            continue
        algbw = nbytes / t / 1e9
        busbw = algbw * bus_factor(coll, n)
        busbws.append(busbw)
        print(f"  {nbytes:>12} {count:>12} {'float':>6} {t * 1e6:>10.2f} {algbw:>12.2f} "
              f"{busbw:>12.2f}  {algo}")
    if busbws:
        print(f"# Avg bus bandwidth (modelled): {sum(busbws) / len(busbws):.2f} GB/s")
    else:
        print(f"# Avg bus bandwidth (modelled): - ({'one rank' if n == 1 else 'a barrier'} moves no data)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m neuron_dist.topology", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("show")
    s.add_argument("instance")
    s.add_argument("--lnc", type=int)
    s.add_argument("--svg")
    pr = sub.add_parser("predict")
    pr.add_argument("collective")
    pr.add_argument("--instance", help="default: $NEURON_DIST_INSTANCE, else " + DEFAULT_INSTANCE)
    pr.add_argument("--nodes", type=int, default=1)
    pr.add_argument("--ppn", type=int, help="ranks per node (default: every logical core)")
    pr.add_argument("--lnc", type=int)
    pr.add_argument("--cores-per-rank", type=int,
                    help="logical cores per rank, as neuronrun's (default: $NEURON_RT_NUM_CORES, else 1)")
    pr.add_argument("--sizes", type=parse_sizes, default="8K,64K,1M,16M,64M,512M")
    pr.add_argument("--algo")
    sub.add_parser("list")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "show":
            return cmd_show(args)
        if args.cmd == "predict":
            return cmd_predict(args)
        for name in list_instances():
            print(name)
        return 0
    except (ValueError, OSError) as e:  # OSError: the --svg file could not be written
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
