"""Issue 5's targets over every full run kept in benchmarks/results, one column per host type.

    python benchmarks/summary.py [benchmarks/results]

A full run is a folder that `benchmarks/run_all.sh` wrote (it holds `cb_allreduce_neuron.json`);
the top folder holds the first. Runs are grouped by the host in their `machine.txt` (CPU model
and L3 size): the shared 2-vCPU VM changed hardware during the task, and the same code ran 2-3x
apart between them. Each cell gives the lowest and highest value over that host's runs, each run
at its own commit (its `machine.txt`), so a range spans code versions as well as minutes. The
last column is the target; "(k/n)" after a range: in k of the n runs that measured the row, every
value of that run met it (all sizes, for the ratio rows). Numbers are read from the JSON, never
typed: `tables.py` prints one run in full, this prints what every run says about each target.
"""
from __future__ import annotations

import os
import re
import sys

from tables import MiB, copy_bound_inputs, load

# Rows of a run that RESULTS.md judged to say nothing about a target, and why (by run folder and
# row group): they are left out of the ranges, and listed under the table.
SET_ASIDE = {
    ("sixth-pass", "train"): "its compute-only reference ran in a slow moment, 204 ms against 146-180 in every "
                             "other run that day, so every ratio was low, the floor's 0.89x included; RESULTS.md, "
                             "\"Sixth pass\"",
    ("twenty-fourth-pass-2", "bound"): "its 68% comes from a low copy measurement; its busbw against the run "
                                       "before's bound is 48%; RESULTS.md, \"Twenty-fourth pass\"",
    ("thirty-sixth-pass", "train"): "its DDP rows ran in a slow moment: the compute-only references beside them "
                                    "took 206-245 ms against 133-173 after and 118-139 in the next two runs, so "
                                    "its DDP ratio read 1.03x; RESULTS.md, \"Thirty-sixth pass\"",
}

OPS = (("allreduce", "all-reduce"), ("allgather", "all-gather"), ("reducescatter", "reduce-scatter"))

# (run folder, what) of the rows left out because their results were wrong: listed under the table
WRONG: set[tuple[str, str]] = set()


def clean(d: str, what: str, *rows) -> bool:
    """Whether none of `rows` (a run's JSON rows, None where absent) counted wrong elements or, for a
    training row of a real backend, ended with ranks (or Gloo) disagreeing; a row that did says
    nothing about speed and is left out of the ranges (noted in WRONG)."""
    bad = any(r and (r.get("wrong") or (r.get("agree") is False and r.get("backend") != "none")) for r in rows)
    if bad:
        WRONG.add((d, what))
    return not bad


def runs(root: str) -> list[str]:
    """`root` and its folders that hold a full run, in name order."""
    candidates = [root] + [os.path.join(root, n) for n in sorted(os.listdir(root))]
    return [d for d in candidates if os.path.isfile(os.path.join(d, "cb_allreduce_neuron.json"))]


def host(d: str) -> str:
    try:
        text = open(os.path.join(d, "machine.txt")).read()
    except FileNotFoundError:
        return "unknown"
    model = re.search(r"Model name:\s*(.+)", text)
    l3 = re.search(r"L3 cache:\s*(\d+ [KMG]iB)", text)
    name = model.group(1).strip() if model else "unknown"
    name = "Intel Xeon" if "Xeon" in name else "AMD EPYC" if "EPYC" in name else name
    return f"{name}, L3 {l3.group(1)}" if l3 else name


def _rows(d: str, name: str) -> dict:
    run = load(os.path.join(d, name))
    return {r["size"]: r for r in run["rows"]} if run else {}


def ratios(d: str, op: str, other: str, lo: int, hi: int) -> list[float]:
    """neuron's collbench busbw over `other`'s at each size in [lo, hi]."""
    n, o = _rows(d, f"cb_{op}_neuron.json"), _rows(d, f"cb_{op}_{other}.json")
    return [n[s]["busbw"] / o[s]["busbw"] for s in n if lo <= s <= hi and s in o and o[s]["busbw"] > 0
            and clean(d, f"{op} {s} B (collbench)", n[s], o[s])]


def loop_us(d: str, impl: str, size: int = 4096) -> list[float]:
    r = _rows(d, f"loop_{impl}.json").get(size)
    return [r["time_us"]] if r and clean(d, f"allreduce {size} B (collbench --loop, {impl})", r) else []


def one_at_a_time_us(d: str, size: int = 4096) -> list[float]:
    r = _rows(d, "cb_allreduce_neuron.json").get(size)
    return [r["time_us"]] if r and clean(d, f"allreduce {size} B (collbench)", r) else []


def bound_fraction(d: str) -> list[float]:
    """The 64 MiB all-reduce's busbw over T/5 (tables.bound's derivation, the better copy rate)."""
    got = copy_bound_inputs(d)
    if got is None or not clean(d, f"allreduce {64 * MiB} B (collbench)", got[1]):
        return []
    return [got[1]["busbw"] / (got[2] / 5)]


def train(d: str, wrap: str, backend: str) -> list[float]:
    run = load(os.path.join(d, "train.json"))
    return [r["ratio"] for r in run["rows"] if r["wrap"] == wrap and r["backend"] == backend
            and clean(d, f"training {wrap} {backend}", r)] if run else []


# the collectives the world-4 rows count ("of 48": these six at eight sizes): bench's reduce,
# gather and scatter rows, added later, are left out so that old and new runs count the same rows
WORLD4_OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv")


def world4_slower(d: str, name: str) -> list[float]:
    """How many of the world-4 rows (WORLD4_OPS at every size) ran slower than Gloo."""
    run = load(os.path.join(d, name))
    if not run:
        return []
    rows = [r for r in run["rows"] if r.get("ratio") is not None and r["op"] in WORLD4_OPS
            and clean(d, f"{name} {r['op']} {r['size']} B", r["neuron"], r.get("gloo"),
                      (r.get("in_place") or {}).get("neuron"))]
    return [sum(r["ratio"] < 1 for r in rows)] if rows else []


def span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "results")
    by_host: dict[str, list[str]] = {}
    names = {}  # run folder -> how the table names it (SET_ASIDE's keys)
    for d in runs(root):
        by_host.setdefault(host(d), []).append(d)
        names[d] = "the top folder" if d == root else os.path.basename(d)
    hosts = sorted(by_host)

    metrics = []  # (label, SET_ASIDE group, values of one run, format, target, test of one value)
    for op, name in OPS:
        metrics.append((f"world 2 {name}, busbw x Gloo, 1-16 MiB", "collbench",
                        lambda d, op=op: ratios(d, op, "gloo", MiB, 16 * MiB), "{:.1f}", ">= 5", lambda v: v >= 5))
    for op, name in OPS:
        metrics.append((f"world 2 {name}, busbw x Open MPI, 1-64 MiB", "collbench",
                        lambda d, op=op: ratios(d, op, "mpi", MiB, 64 * MiB), "{:.2f}", ">= 1", lambda v: v >= 1))
    metrics += [
        ("64 MiB all-reduce, fraction of the 5N copy bound", "bound", bound_fraction, "{:.0%}", ">= 60%",
         lambda v: v >= 0.6),
        ("4 KiB all-reduce back to back, us (collbench --loop)", "loop", lambda d: loop_us(d, "neuron"), "{:.0f}",
         "<= 30", lambda v: v <= 30),
        ("  4 KiB under Gloo, same run", "loop", lambda d: loop_us(d, "gloo"), "{:.0f}", "", None),
        ("  4 KiB under Open MPI, same run", "loop", lambda d: loop_us(d, "mpi"), "{:.1f}", "", None),
        ("4 KiB all-reduce one call at a time, us (collbench)", "collbench", one_at_a_time_us, "{:.0f}", "<= 30",
         lambda v: v <= 30),
        ("world 4 on 2 cores: rows slower than Gloo (of 48), one call at a time", "world4",
         lambda d: world4_slower(d, "bench_w4.json"), "{:.0f}", "0", lambda v: v == 0),
        ("  world 4, back to back (--loop)", "world4", lambda d: world4_slower(d, "bench_w4_loop.json"), "{:.0f}",
         "0", lambda v: v == 0),
        ("DDP step x compute-only", "train", lambda d: train(d, "ddp", "neuron"), "{:.2f}", "<= 1.25",
         lambda v: v <= 1.25),
        ("  DDP under Gloo, same run", "train", lambda d: train(d, "ddp", "gloo"), "{:.2f}", "", None),
        ("  DDP with no communication (the floor)", "train", lambda d: train(d, "ddp", "none"), "{:.2f}", "", None),
        ("FSDP2 step x compute-only", "train", lambda d: train(d, "fsdp2", "neuron"), "{:.2f}", "<= 1.6",
         lambda v: v <= 1.6),
        ("  FSDP2 under Gloo, same run", "train", lambda d: train(d, "fsdp2", "gloo"), "{:.2f}", "", None),
        ("  FSDP2 with no communication (the floor)", "train", lambda d: train(d, "fsdp2", "none"), "{:.2f}", "",
         None),
    ]

    print(f"Full runs in {os.path.relpath(root)}: " +
          "; ".join(f"{h}: {', '.join(names[d] for d in by_host[h])}" for h in hosts) + "\n")
    print("| | " + " | ".join(f"{h} ({len(by_host[h])} run{'s' if len(by_host[h]) != 1 else ''})" for h in hosts)
          + " | target |")
    print("|---|" + "---:|" * len(hosts) + "---|")
    for label, group, get, fmt, target, ok in metrics:
        cells = []
        for h in hosts:
            per_run = [get(d) for d in by_host[h] if (names[d], group) not in SET_ASIDE]
            cell = span([v for vs in per_run for v in vs], fmt)
            measured = [vs for vs in per_run if vs]
            if ok is not None and measured:  # runs in which every value of the row meets the target
                cell += f" ({sum(all(ok(v) for v in vs) for vs in measured)}/{len(measured)})"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + f" | {target} |")
    aside = [f"{run}'s {group} rows ({why})" for (run, group), why in SET_ASIDE.items()
             if run in names.values()]
    if aside:
        print("\nSet aside: " + "; ".join(aside) + ".")
    if WRONG:  # only where a run counted wrong elements: what it says of speed is no result
        print("\nLeft out, their results were wrong: " + "; ".join(f"{names[d]}'s {what}" for d, what in sorted(WRONG))
              + ".")


if __name__ == "__main__":
    main()
