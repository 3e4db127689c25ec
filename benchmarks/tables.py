"""Markdown tables for benchmarks/RESULTS.md from the JSON files that run_all.sh writes.

    python benchmarks/tables.py [benchmarks/results]

Prints: the collbench side-by-side (neuron / gloo / Open MPI busbw, ratios, and the target
checks), the neuron_dist.bench tables (world 2, bf16, world 4), the training table and the
64 MiB memory-bound check. Numbers are copied, never edited: rerun run_all.sh to refresh.
"""
from __future__ import annotations

import json
import os
import sys

MiB = 1 << 20


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def wrong_note(rows: dict) -> str:
    """'wrong results: neuron 3' for the implementations whose row (impl -> collbench row or None)
    counted wrong elements, else ''. The collbench tables have no #wrong column: a row of wrong
    data would otherwise look like any other, and meet its targets."""
    bad = [f"{impl} {r['wrong']}" for impl, r in rows.items() if r and r.get("wrong")]
    return f"**wrong results: {', '.join(bad)}**" if bad else ""


def collbench(d: str) -> None:
    for op in ("allreduce", "allgather", "reducescatter"):
        runs = {impl: load(os.path.join(d, f"cb_{op}_{impl}.json")) for impl in ("neuron", "gloo", "mpi")}
        if not all(runs.values()):
            continue
        rows = {impl: {r["size"]: r for r in run["rows"]} for impl, run in runs.items()}
        print(f"\n**{op}, world 2, float32** (collbench, median of 20; busbw GB/s)\n")
        print("| size | neuron us | neuron busbw | gloo busbw | mpi busbw | x gloo | x mpi | targets |")
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        for size in sorted(rows["neuron"]):
            n, g, m = rows["neuron"][size], rows["gloo"].get(size), rows["mpi"].get(size)
            xg = n["busbw"] / g["busbw"] if g else float("nan")
            xm = n["busbw"] / m["busbw"] if m else float("nan")
            checks = []
            wrong = wrong_note({"neuron": n, "gloo": g, "mpi": m})
            if wrong:  # no target is met with wrong data
                checks.append(wrong)
            elif MiB <= size <= 16 * MiB:
                checks.append(f"5x gloo {'met' if xg >= 5 else 'missed'}")
            if MiB <= size <= 64 * MiB and not wrong:
                checks.append(f">= mpi {'met' if xm >= 1 else 'missed'}")
            if op == "allreduce" and size == 4096 and not wrong:
                checks.append(f"<= 30 us {'met' if n['time_us'] <= 30 else 'missed'}")
            print(f"| {human(size)} | {n['time_us']:.1f} | {n['busbw']:.3f} | {g['busbw'] if g else float('nan'):.3f} | "
                  f"{m['busbw'] if m else float('nan'):.3f} | {xg:.2f} | {xm:.2f} | {', '.join(checks)} |")


def loop(d: str) -> None:
    runs = {impl: load(os.path.join(d, f"loop_{impl}.json")) for impl in ("neuron", "gloo", "mpi")}
    if not all(runs.values()):
        return
    rows = {impl: {r["size"]: r for r in run["rows"]} for impl, run in runs.items()}
    print("\n**All-reduce latency, world 2, back to back** (collbench --loop: one barrier, then the "
          "average of 200 calls)\n")
    print("| size | neuron us | gloo us | mpi us | neuron x faster than gloo |")
    print("|---:|---:|---:|---:|---:|")
    for size in sorted(rows["neuron"]):
        n, g, m = (rows[i].get(size, {}).get("time_us", float("nan")) for i in ("neuron", "gloo", "mpi"))
        wrong = wrong_note({i: rows[i].get(size) for i in ("neuron", "gloo", "mpi")})
        print(f"| {human(size)} | {n:.1f} | {g:.1f} | {m:.1f} | {g / n:.1f}{' ' + wrong if wrong else ''} |")


def cell(v, digits: int) -> str:
    """A table cell: '-' where the benchmark had no number (no Gloo run; an unresolved --added row)."""
    return "-" if v is None else f"{v:.{digits}f}"


def bench(d: str, name: str, title: str) -> None:
    run = load(os.path.join(d, name))
    if not run:
        return
    stat = ("average of back-to-back calls" if run["config"].get("loop") else
            "wall time a call adds to a barrier, median" if run["config"].get("added") else "median")
    print(f"\n**{title}** (`neuron_dist.bench`, {stat}; busbw GB/s; model = cost-model busbw on "
          f"{run['config'].get('instance')}, not this host)\n")
    print("| op | size | count | type | time us | algbw | busbw | #wrong | gloo us | gloo busbw | ratio | model |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    slower, wrong = [], []
    for r in run["rows"]:
        n, g = r["neuron"], r.get("gloo", {})
        m = r.get("model") or {}
        if g and (r.get("ratio") or 1) < 1:
            slower.append(f"{r['op']} {human(r['size'])}")
        ip = (r.get("in_place") or {}).get("neuron") or {}  # bench's in-place form beside the main one
        if n["wrong"] or g.get("wrong") or ip.get("wrong"):  # (the table's #wrong is neuron's main form's)
            wrong.append(f"{r['op']} {human(r['size'])} (neuron {n['wrong']}, gloo {g.get('wrong', '-')}"
                         + (f", neuron in place {ip['wrong']}" if ip else "") + ")")
        print(f"| {r['op']} | {human(r['size'])} | {r['count']} | {r['type']} | {cell(n['time_us'], 1)} | "
              f"{cell(n['algbw'], 3)} | {cell(n['busbw'], 3)} | {n['wrong']} | {cell(g.get('time_us'), 1)} | "
              f"{cell(g.get('busbw'), 3)} | {cell(r.get('ratio'), 2)} | "
              f"{('%.1f ' % m['busbw'] + m['algorithm']) if m else '-'} |")
    print(f"\nRows where neuron is slower than Gloo: {', '.join(slower) if slower else 'none'}.")
    if wrong:
        print(f"\n**Rows with wrong results** (elements): {', '.join(wrong)}.")


def train(d: str) -> None:
    for name, how in (("train.json", ""), ("train_thp.json", ", every process with torch's huge pages (`--thp on`)")):
        run = load(os.path.join(d, name))
        if run:
            _train_table(run, how)


def _train_table(run: dict, how: str) -> None:
    print(f"\n**Training step, {run['params'] / 1e6:.1f}M-parameter MLP, world {run['config']['world']}{how}** "
          f"(`neuron_dist.bench_train`; compute-only step {run['compute_ms']:.1f} ms, median)\n")
    print("| wrap | backend | step ms | compute-only ms | x compute-only | ranks agree | peak MiB |")
    print("|---|---|---:|---:|---:|---|---:|")
    for r in run["rows"]:
        name = "none (floor: no communication)" if r["backend"] == "none" else r["backend"]
        local = r.get("compute_ms", run["compute_ms"])  # runs before the reference was interleaved
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"  # (older runs did not record it)
        agree = r.get("agree", "-")
        if agree is False and r["backend"] != "none":  # the floor must disagree; a backend must not
            agree = "**False: wrong parameters**"
        print(f"| {r['wrap']} | {name} | {r['step_ms']:.1f} | {local:.1f} | {r['ratio']:.2f} | "
              f"{agree} | {peak} |")


def _rate(mems, kind: str, procs: int, field: str) -> float:
    """The best of the run's measurements (run_all.sh measures at its start and its end): a
    bound from one slow minute would be too low, and a fraction of it too flattering."""
    return max(next(r for r in m["rows"] if r["kind"] == kind and r["procs"] == procs)[field] for m in mems)


def copy_bound_inputs(d: str):
    """(copy-rate measurements, the 64 MiB all-reduce row, the better copy traffic of two
    processes in GB/s) of run `d`, or None where the run lacks either file or the row."""
    mems = [m for m in (load(os.path.join(d, f)) for f in ("membw.json", "membw_end.json")) if m]
    cb = load(os.path.join(d, "cb_allreduce_neuron.json"))
    row = next((r for r in cb["rows"] if r["size"] == 64 * MiB), None) if cb else None
    if not (mems and row):
        return None
    # GB/s of DRAM traffic (read + write) two copying processes sustain
    return mems, row, _rate(mems, "copy", 2, "traffic_gbs")


def bound(d: str) -> None:
    got = copy_bound_inputs(d)
    if got is None:
        return
    mems, row, traffic = got
    if len(mems) > 1:
        each = ", ".join(f"{_rate([m], 'copy', 2, 'traffic_gbs'):.2f}" for m in mems)
        print(f"\nCopy traffic with 2 processes, measured at the run's start and end: {each} GB/s; the bound "
              f"below takes the higher.")
    bound_busbw = traffic / 5       # 5 N bytes of DRAM traffic per all-reduce of N bytes, both ranks
    loose = traffic / 9             # the slot path's count, had its slot traffic gone to DRAM (RESULTS.md)
    print(f"\n64 MiB all-reduce: copy traffic with 2 processes {traffic:.2f} GB/s -> bound busbw "
          f"{bound_busbw:.2f} GB/s (5N model; {loose:.2f} GB/s with the 9N model); measured {row['busbw']:.2f} GB/s "
          f"= {row['busbw'] / bound_busbw:.0%} of the bound "
          f"(target 60%: {'met' if row['busbw'] >= 0.6 * bound_busbw else 'missed'}).")
    c, a = _rate(mems, "copy", 1, "agg_gbs"), _rate(mems, "add", 1, "agg_gbs")
    # one core's work per rank on the lent path (both halves of the ring read with process_vm_readv
    # since the eighteenth and thirty-first passes): N copied + 0.5 N reduced. It was 1.5 N copied,
    # the slot path's count, and measured busbw passed that bound in four runs (101-104%).
    core = 1 / (1 / c + 0.5 / a)
    print(f"Per-core work bound, N copied + 0.5 N reduced per rank (copy {c:.2f} GB/s, add {a:.2f} GB/s on one "
          f"core): busbw <= {core:.2f} GB/s; measured = {row['busbw'] / core:.0%} of it.")


def human(n: int) -> str:
    for unit, s in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << s and n % (1 << s) == 0:
            return f"{n >> s} {unit}iB"
    return f"{n} B"


def main() -> None:
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    collbench(d)
    bound(d)
    loop(d)
    bench(d, "bench_w2.json", "All collectives, world 2, float32")
    bench(d, "bench_w2_thp.json", "All-reduce, all-gather, reduce-scatter, world 2, float32, torch's huge pages "
                                  "in every rank (`--thp on`, as neuronrun runs jobs; Gloo too)")
    bench(d, "bench_w2_bf16.json", "All-reduce, world 2, bfloat16")
    bench(d, "bench_w4.json", "All collectives, world 4 on 2 cores, float32")
    bench(d, "bench_w4_loop.json", "All collectives, world 4 on 2 cores, float32, back to back (`--loop`)")
    bench(d, "bench_w4_added.json", "All collectives, world 4 on 2 cores, float32, cost to the job (`--added`)")
    train(d)


if __name__ == "__main__":
    main()
