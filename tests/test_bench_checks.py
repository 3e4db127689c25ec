"""The benchmarks' checks of their own results (a review's findings): wrong data must show in
#wrong, in bench_train's `agree`, in the exit statuses, in tables.py, summary.py and run_all.sh;
and the JSON must say how a run was made. Tiny sizes: speed is not asserted here."""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from neuron_dist import bench
from neuron_dist.ports import free_port  # (a fixed port in the ephemeral range: EADDRINUSE in a CI run)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

# Loaded (through PYTHONPATH) by every process of a run, the fork server's ranks included: with
# CORRUPT_OPS set, rank 1's outputs of those methods of the backend get 1000 added to their
# first element once the call completes.
CORRUPTING_SITECUSTOMIZE = '''
import os
if os.environ.get("CORRUPT_OPS"):
    from neuron_dist import c10d
    cls = c10d.NeuronProcessGroup
    def _wrap(fn, listed):
        def f(self, *args, **kw):
            w = fn(self, *args, **kw)
            if self.rank() == 1:
                w.wait()
                (args[0][0] if listed else args[0]).view(-1)[0] += 1000
            return w
        return f
    for name in os.environ["CORRUPT_OPS"].split(","):
        if name in cls.__dict__:
            setattr(cls, name, _wrap(cls.__dict__[name], name == "allreduce"))
'''


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("op", ["allgather", "reduce_scatter", "alltoall", "sendrecv", "gather", "scatter"])
def test_an_output_the_call_never_writes_counts_as_wrong(op, dtype):
    """Outputs start as a value no collective gives (NaN, or the most negative integer), so a
    receive that never wrote its buffer counts every element: torch.empty's memory could hold the
    expected values already (an earlier size's or Gloo's buffer), and #wrong read 0."""
    import torch
    c = bench.Case(op, 64, getattr(torch, dtype), 0, 2, None)  # constructed, never run
    assert c.out is not c.x and c.wrong() == c.out.numel() > 0
    if dtype == "int32":
        assert (c.out == torch.iinfo(torch.int32).min).all()
    else:
        assert c.out.isnan().all()


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize("op", ["reduce", "gather", "scatter"])
def test_rooted_rows_check_what_the_call_leaves(op, root):
    """reduce, gather and scatter rows (nccl-tests' reduce_perf, gather_perf, scatter_perf) are
    checked like the others, at the root -r names: the two ranks' cases of a world-2 call, given
    the output the call should leave (computed here from their inputs), count no wrong element,
    and one changed element counts one. Reduce's and gather's output is the root's alone (Gloo
    writes over a reduce's other inputs); sizes and counts are nccl-tests' (the largest buffer;
    one rank's block for gather and scatter)."""
    import torch
    cases = [bench.Case(op, 4096, torch.float32, r, 2, None, "sum", root) for r in range(2)]
    if op == "reduce":
        cases[root].out.copy_(cases[0].x + cases[1].x)
    elif op == "gather":
        cases[root].out.copy_(torch.cat([c.x for c in cases]))
    else:
        for r, c in enumerate(cases):
            c.out.copy_(cases[root].x.chunk(2)[r])
    checked = [c for c in cases if c.out.numel()]
    assert checked == (cases if op == "scatter" else [cases[root]])
    assert [c.wrong() for c in cases] == [0, 0]
    checked[-1].out[-1] += 1
    assert sum(c.wrong() for c in cases) == 1
    assert {(c.size, c.count) for c in cases} == {(4096, 1024 if op == "reduce" else 512)}


@pytest.mark.parametrize("op", ["allgather", "reduce_scatter", "gather", "scatter"])
def test_in_place_forms_share_one_buffer_and_are_checked(op):
    """nccl-tests' in-place group: all-gather's and gather's input is the rank's block of the
    output, reduce-scatter's and scatter's output the rank's block of the input (at the root for
    the rooted ones). Each form is checked on its own: given what the call should leave, no wrong
    element; a block the call did not write (an in-place reduce-scatter left as its input, the
    other rank's block of an all-gather) counts."""
    import torch
    cases = [bench.Case(op, 64, torch.float32, r, 2, None, "sum", 0, True) for r in range(2)]
    c = cases[0].c
    for r, case in enumerate(cases):
        if case.out.numel() and case.x.numel():
            whole, part = (case.out, case.x) if op in ("allgather", "gather") else (case.x, case.out)
            assert part.data_ptr() == whole.data_ptr() + r * c * 4, op  # its block of the one buffer
    unwritten = sum(case.wrong() for case in cases)
    assert unwritten == {"allgather": 2 * c, "gather": c, "reduce_scatter": 2 * c, "scatter": c}[op]
    if op == "reduce_scatter":
        total = cases[0].x + cases[1].x
        for r, case in enumerate(cases):
            case.out.copy_(total[r * c:(r + 1) * c])
    elif op == "scatter":
        cases[1].out.copy_(cases[0].x[c:])
    else:
        full = torch.cat([case.x for case in cases])
        for case in cases[:2 if op == "allgather" else 1]:
            case.out.copy_(full)
    assert [case.wrong() for case in cases] == [0, 0]
    with pytest.raises(ValueError, match="allreduce has no out-of-place form"):
        bench.Case("allreduce", 64, torch.float32, 0, 2, None, in_place=False)
    assert bench.forms("allgather", "both") == [False, True] and bench.forms("alltoall", "in") == []
    assert bench.forms("allreduce", "out") == [True]


def test_sizes_that_round_to_one_count_run_once():
    """A call moves at least one element per rank: at a few bytes several sizes of the sweep
    give the same buffer, and their rows repeated one another (-b 1 -e 64 -f 2, world 2)."""
    sizes = bench.sweep(1, 64, 2)
    assert bench.distinct_sizes("allreduce", sizes, 4, 2) == [1, 8, 16, 32, 64]
    assert bench.distinct_sizes("allgather", sizes, 4, 2) == [1, 16, 32, 64]  # a block per rank
    assert bench.distinct_sizes("allreduce", [4096, 16384], 4, 2) == [4096, 16384]


def test_json_config_under_a_launcher_and_no_repeated_rows(tmp_path):
    """Under torchrun the JSON's world is the job's (it was -g's default, 2, whatever ran), the
    variables that choose the backend's algorithms are recorded, and sizes that round alike run
    once (world 1: 1, 2 and 4 bytes are all one float32)."""
    out = tmp_path / "w.json"
    env = dict(os.environ, NEURON_DIST_TUNING="host")
    env.pop("NEURON_DIST_ALGO", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), "-m", "neuron_dist.bench", "-b", "1", "-e", "16",
                        "-f", "2", "-n", "1", "-w", "0", "--ops", "allreduce,allgather", "--instance", "",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.load(open(out))
    assert data["config"]["world"] == 1, data["config"]
    assert data["config"]["env"]["NEURON_DIST_TUNING"] == "host" and data["config"]["env"]["NEURON_DIST_ALGO"] is None
    assert [(r["op"], r["size"]) for r in data["rows"]] == [(op, s) for op in ("allreduce", "allgather")
                                                           for s in (4, 8, 16)]


@pytest.mark.parametrize("module", ["neuron_dist.bench", "neuron_dist.bench_train"])
def test_an_unwritable_json_path_is_a_usage_error(module, tmp_path, monkeypatch, capsys):
    """--json in a directory that exists but refuses new files (/proc; permission bits do not
    stop root) was found only when the results were written, after the whole run: a traceback,
    the results lost. A path that can be written is left as it was (no empty file)."""
    args = ["-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--instance", ""] if module.endswith("bench") else \
        ["--layers", "1", "--width", "8", "--steps", "1", "--warmup", "0", "--wrap", "ddp", "--backends", "gloo"]
    if module.endswith("bench"):
        # bench's command line in this process (main; test_bench.py's test_loop_and_added_are_exclusive
        # runs its usage errors through a real `python -m`): refused before any rank starts
        def started(*args, **kw):
            raise AssertionError("bench started ranks instead of refusing --json /proc/nope.json")
        monkeypatch.setattr(bench, "launch", started)
        monkeypatch.setattr(bench, "worker", started)
        for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
            monkeypatch.delenv(k, raising=False)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench.main([*args, "--json", "/proc/nope.json"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "cannot be written" in err and "Traceback" not in err, err
    else:
        p = subprocess.run([sys.executable, "-m", module, *args, "--json", "/proc/nope.json"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "cannot be written" in p.stderr and "Traceback" not in p.stderr, \
            p.stdout + p.stderr
    import argparse
    ok = tmp_path / "ok.json"
    bench.check_json_path(argparse.ArgumentParser(), str(ok))
    assert not ok.exists()


# Loaded (through PYTHONPATH) by every process of a bench run, the fork server's ranks included:
# with BENCH_FAULTS set ("op:when,..."), rank 1's output of that torch.distributed call gets 1000
# added to its first element once the call completes. `when`: "first" (the backend under test's
# first call of the op), "last" (its fifth: the check after -w 1 -n 2), "in_place" (its calls whose
# input is a block of the output, or the output a block of the input) or "gloo" (the reference's).
FAULTY_SITECUSTOMIZE = '''
import os
if os.environ.get("BENCH_FAULTS"):
    import torch.distributed as dist
    faults = dict(f.split(":") for f in os.environ["BENCH_FAULTS"].split(","))
    def _wrap(name, fn):
        calls = [0]
        def f(output, input, *args, **kw):
            w = fn(output, input, *args, **kw)
            gloo = kw.get("group") is not None
            calls[0] += not gloo
            lo, hi = output.data_ptr(), output.data_ptr() + output.numel() * output.element_size()
            in_place = lo <= input.data_ptr() < hi or input.data_ptr() <= lo < input.data_ptr() + input.nbytes
            when = faults.get(name)
            if dist.get_rank() == 1 and when and (
                    (when == "gloo") == gloo and when in ("gloo", "in_place" if in_place else "-")
                    or not gloo and (when, calls[0]) in (("first", 1), ("last", 5))):
                output.view(-1)[0] += 1000
            return w
        return f
    for name in faults:
        setattr(dist, name, _wrap(name, getattr(dist, name)))
'''


def _faulty_bench(tmp_path, faults, *args):
    (tmp_path / "sitecustomize.py").write_text(FAULTY_SITECUSTOMIZE)
    out = tmp_path / "f.json"
    env = dict(os.environ, BENCH_FAULTS=faults,
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench", "-g", "2", "-b", "4K", "-e", "4K", "-n", "2",
                        "-w", "1", "--instance", "", "--no-progress", "--json", str(out), *args],
                       env=env, capture_output=True, text=True, timeout=300)
    rows = {r["op"]: r for r in json.load(open(out))["rows"]}
    table = [l.split() for l in p.stdout.splitlines() if l.strip() and not l.startswith("#")]
    return p, rows, table


def test_wrong_elements_show_in_the_form_and_check_that_saw_them(tmp_path):
    """Faults planted in rank 1's calls, each in one place only, must reach rank 0's table, the
    JSON, the summary line and the exit status: all-gather wrong on its first (checked) call alone
    (rank 0's check saw nothing: only the sum over the ranks shows it), all-to-all on its last
    call alone (the check after the timed calls), reduce-scatter in its in-place form alone (the
    in-place group's #wrong, not the out-of-place one's). In a second run only the Gloo reference
    is wrong: the table's #wrong stays 0, its own line says so, and the exit status is 1."""
    p, rows, table = _faulty_bench(tmp_path, "all_gather_single:first,all_to_all_single:last,"
                                             "reduce_scatter_single:in_place",
                                   "--ops", "allgather,reduce_scatter,alltoall", "--vs", "gloo")
    assert p.returncode == 1, p.stdout + p.stderr
    got = {op: (r["neuron"]["wrong"], (r.get("in_place") or {}).get("neuron", {}).get("wrong"), r["gloo"]["wrong"])
           for op, r in rows.items()}
    assert got == {"allgather": (1, 0, 0), "reduce_scatter": (0, 1, 0), "alltoall": (1, None, 0)}, got
    # the table's rows are printed in the same order: size count type, then two groups of time algbw busbw #wrong
    printed = [[t[6], t[10]] for t in table]
    assert printed == [["1", "0"], ["0", "1"], ["1", "-"]], p.stdout
    assert "# Out of bounds values : 3 FAILED" in p.stdout and "Gloo reference" not in p.stdout, p.stdout
    p, rows, _ = _faulty_bench(tmp_path, "all_gather_single:gloo", "--ops", "allgather", "--place", "out",
                               "--vs", "gloo")
    assert p.returncode == 1, p.stdout + p.stderr
    assert (rows["allgather"]["neuron"]["wrong"], rows["allgather"]["gloo"]["wrong"]) == (0, 1), rows
    assert "# Out of bounds values : 0 OK" in p.stdout and "Gloo reference values wrong : 1 FAILED" in p.stdout, p.stdout


def test_training_bench_fails_on_wrong_gradients(tmp_path):
    """The backend under test corrupts rank 1's all-reduce (DDP's gradients) and reduce-scatter
    (FSDP2's gradient shards). FSDP2's wrong shard updates a parameter that every rank then
    all-gathers, so the ranks agree on the wrong value: only the comparison with Gloo's
    parameters sees it. Either row must read agree False, and the exit status must be 1."""
    (tmp_path / "sitecustomize.py").write_text(CORRUPTING_SITECUSTOMIZE)
    out = tmp_path / "t.json"
    env = dict(os.environ, CORRUPT_OPS="allreduce,reduce_scatter_single,_reduce_scatter_base",
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench_train", "--layers", "2", "--width", "64",
                        "--steps", "2", "--warmup", "1", "--backends", "neuron,gloo", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    rows = json.load(open(out))["rows"]
    assert [(r["wrap"], r["backend"], r["agree"]) for r in rows] == [
        ("ddp", "neuron", False), ("ddp", "gloo", True), ("fsdp2", "neuron", False), ("fsdp2", "gloo", True)], p.stdout
    assert p.returncode == 1 and "wrong parameters" in p.stderr, p.stdout + p.stderr


def test_training_digests_compare_exactly_at_two_ranks_within_rounding_at_more():
    from neuron_dist.bench_train import same_params
    ref = ((1.0, 10.0), (-2.0, 30.0))
    assert same_params(ref, ref, 2) and not same_params(((1.0 + 1e-12, 10.0), (-2.0, 30.0)), ref, 2)
    assert same_params(((1.0 + 1e-12, 10.0), (-2.0, 30.0)), ref, 3)      # another order of addition
    assert not same_params(((1.0, 10.0), (-2.0 + 1e-3, 30.0)), ref, 3)   # a wrong element


def _cb(d, name, rows):
    (d / name).write_text(json.dumps({"config": {}, "rows": rows}))


def _wrong_run(d):
    """A run folder whose 1 MiB all-reduce (collbench, neuron) and DDP neuron row were wrong."""
    d.mkdir()
    (d / "machine.txt").write_text("Model name:   AMD EPYC\nL3 cache:   32 MiB (1 instance)\n")
    for impl, bw in (("neuron", (10.0, 10.0, 8.0)), ("gloo", (1.0,) * 3), ("mpi", (2.0,) * 3)):
        _cb(d, f"cb_allreduce_{impl}.json",
            [{"size": s, "busbw": b, "time_us": 20.0, "wrong": 3 if (impl, s) == ("neuron", MiB) else 0}
             for s, b in zip((4096, MiB, 4 * MiB), bw)])
    (d / "train.json").write_text(json.dumps({"config": {"world": 2}, "params": 1e6, "compute_ms": 1.0, "rows": [
        {"wrap": "ddp", "backend": b, "step_ms": 1.0, "compute_ms": 1.0, "ratio": r, "agree": a, "peak_mib": 1}
        for b, r, a in (("neuron", 1.1, False), ("gloo", 1.5, True), ("none", 1.0, False))]}))


def test_tables_mark_wrong_results(tmp_path):
    """tables.py: the collbench tables have no #wrong column, so a row of wrong data looked like
    any other and met its targets; a real backend's training row whose ranks disagree is marked
    (the floor's must disagree)."""
    _wrong_run(tmp_path / "r")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tables.py"), str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    line = next(l for l in p.stdout.splitlines() if l.startswith("| 1 MiB |"))
    assert "wrong results: neuron 3" in line and "met" not in line, line
    assert "wrong" not in next(l for l in p.stdout.splitlines() if l.startswith("| 4 MiB |"))
    assert "| ddp | neuron | 1.0 | 1.0 | 1.10 | **False: wrong parameters** |" in p.stdout
    assert "| ddp | none (floor: no communication) | 1.0 | 1.0 | 1.00 | False |" in p.stdout


def test_tables_per_core_bound_counts_the_lent_path(tmp_path):
    """tables.py's per-core work bound of the 64 MiB all-reduce counted the slot path's three
    copies of N/2 per rank (1.5 N / c + 0.5 N / a); since the eighteenth and thirty-first passes
    both halves of the two-rank ring are lent (one process_vm_readv read of N/2 each), so a rank
    copies N and reduces N/2, and four kept runs measured 101-104% of the old bound. With one
    core's copy at 8 GB/s and add at 6 GB/s the bound is 1 / (1/8 + 0.5/6) = 4.80 GB/s (it
    printed 3.69); the 5N DRAM bound (traffic 20 GB/s: 4.00 GB/s) is unchanged."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "membw.json").write_text(json.dumps({"rows": [
        {"kind": "copy", "procs": 1, "agg_gbs": 8.0, "traffic_gbs": 16.0},
        {"kind": "copy", "procs": 2, "agg_gbs": 10.0, "traffic_gbs": 20.0},
        {"kind": "add", "procs": 1, "agg_gbs": 6.0, "traffic_gbs": 18.0}]}))
    _cb(d, "cb_allreduce_neuron.json", [{"size": 64 * MiB, "busbw": 3.0, "time_us": 1.0, "wrong": 0}])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tables.py"), str(d)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "-> bound busbw 4.00 GB/s (5N model" in p.stdout and "= 75% of the bound" in p.stdout, p.stdout
    assert "busbw <= 4.80 GB/s; measured = 62% of it." in p.stdout, p.stdout


def test_tables_read_the_right_numbers_and_judge_targets_at_their_thresholds(tmp_path):
    """tables.py on a run with known numbers: the bench table's columns are the JSON's (busbw is
    not algbw), the rows slower than Gloo are those with ratio < 1, and a row whose in-place form
    alone was wrong is listed with the wrong rows; the back-to-back table's "x faster than gloo"
    is Gloo's time over neuron's (25 us against 1000: 40.0); the collbench table's ratios are
    neuron's busbw over Gloo's and Open MPI's, with 5x Gloo a target at 1-16 MiB alone; the bound
    takes the better of the run's two copy measurements (at its start and end), as its line says,
    and 55% of it misses the 60% target."""
    d = tmp_path / "r"
    d.mkdir()
    form = lambda t, wrong=0: {"time_us": t, "algbw": 4096 / t / 1e3, "busbw": 4096 / t / 2e3, "wrong": wrong}
    _cb(d, "bench_w2.json", [
        {"op": "allgather", "size": 4096, "count": 512, "type": "float32", "place": "out", "neuron": form(10.0),
         "gloo": form(20.0), "ratio": 2.0, "in_place": {"neuron": form(10.0, wrong=5)}},
        {"op": "reduce_scatter", "size": 4096, "count": 512, "type": "float32", "place": "out", "neuron": form(40.0),
         "gloo": form(20.0), "ratio": 0.5, "in_place": {"neuron": form(40.0)}}])
    for impl, us in (("neuron", 25.0), ("gloo", 1000.0), ("mpi", 5.0)):
        _cb(d, f"loop_{impl}.json", [{"size": 4096, "time_us": us, "wrong": 0}])
    for name, traffic in (("membw.json", 20.0), ("membw_end.json", 10.0)):
        (d / name).write_text(json.dumps({"rows": [
            {"kind": "copy", "procs": 1, "agg_gbs": 8.0, "traffic_gbs": 16.0},
            {"kind": "copy", "procs": 2, "agg_gbs": 10.0, "traffic_gbs": traffic},
            {"kind": "add", "procs": 1, "agg_gbs": 6.0, "traffic_gbs": 18.0}]}))
    for impl, bw in (("neuron", (3.0, 2.2)), ("gloo", (1.0, 0.2)), ("mpi", (2.0, 4.4))):
        _cb(d, f"cb_allreduce_{impl}.json", [{"size": s, "busbw": b, "time_us": 1.0, "wrong": 0}
                                             for s, b in zip((MiB, 64 * MiB), bw)])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tables.py"), str(d)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    # collbench: x gloo and x mpi are neuron's busbw over theirs; 5x Gloo is a target at 1-16 MiB only
    assert "| 1 MiB | 1.0 | 3.000 | 1.000 | 2.000 | 3.00 | 1.50 | 5x gloo missed, >= mpi met |" in p.stdout, p.stdout
    assert "| 64 MiB | 1.0 | 2.200 | 0.200 | 4.400 | 11.00 | 0.50 | >= mpi missed |" in p.stdout, p.stdout
    assert "| allgather | 4 KiB | 512 | float32 | 10.0 | 0.410 | 0.205 | 0 | 20.0 | 0.102 | 2.00 | - |" in p.stdout, p.stdout
    assert "Rows where neuron is slower than Gloo: reduce_scatter 4 KiB." in p.stdout, p.stdout
    assert "**Rows with wrong results** (elements): allgather 4 KiB (neuron 0, gloo 0, neuron in place 5)." in p.stdout
    assert "| 4 KiB | 25.0 | 1000.0 | 5.0 | 40.0 |" in p.stdout, p.stdout
    assert "-> bound busbw 4.00 GB/s (5N model" in p.stdout, p.stdout  # 20 GB/s, not the end's 10
    assert "measured 2.20 GB/s = 55% of the bound (target 60%: missed)" in p.stdout, p.stdout


def test_summary_leaves_wrong_rows_out(tmp_path):
    """summary.py: a row with wrong elements, or a real backend's training row that disagrees,
    says nothing of speed: it is left out of the ranges and named under the table."""
    _wrong_run(tmp_path / "r")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "summary.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = {l.split("|")[1].strip(): l.split("|")[2].strip() for l in p.stdout.splitlines() if l.startswith("| ")}
    assert rows["world 2 all-reduce, busbw x Gloo, 1-16 MiB"] == "8.0 (1/1)"    # 1 MiB's 10.0 left out
    assert rows["DDP step x compute-only"] == "-" and rows["DDP under Gloo, same run"] == "1.50"
    assert rows["DDP with no communication (the floor)"] == "1.00"          # the floor must disagree
    assert ("Left out, their results were wrong: r's allreduce 1048576 B (collbench); r's training ddp neuron."
            in p.stdout), p.stdout


def test_run_all_records_failures_and_exits_non_zero(tmp_path):
    """run_all.sh (set -u, no -e) ignored its commands' exit statuses, sent bench's stderr to
    /dev/null and exited with its last line's status: a benchmark that found wrong results (exit
    1) or crashed left no trace. With `python` stubbed to fail for one bench and one collbench
    run, the script must go on, name both in FAILED, keep their stderr, and exit 1."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text('#!/bin/sh\ncase "$*" in *bench_w4.json*|*cb_allgather_mpi.json*) '
                                 'echo "boom: $*" >&2; exit 3;; esac\nexit 0\n')
    (stub / "python").chmod(stat.S_IRWXU)
    out = tmp_path / "out"
    (tmp_path / "cb.py").touch()
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "run_all.sh"), str(out)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}",
                                                        COLLBENCH=str(tmp_path / "cb.py")))
    assert p.returncode == 1, p.stdout + p.stderr
    assert (out / "FAILED").read_text().splitlines() == ["cb_allgather_mpi: exit status 3",
                                                         "bench_w4: exit status 3"]
    assert "boom" in (out / "bench_w4.err").read_text()
    assert not (out / "bench_w2.err").exists()   # a command that succeeded keeps no .err
    assert "bench_w4" in p.stderr and (out / "machine.txt").exists()


def test_run_all_wants_a_new_folder_and_finds_collbench_or_says_where_it_is(tmp_path):
    """run_all.sh without a folder wrote into benchmarks/results, over the kept run's tracked
    files; and from a clone without the workspace beside it every collbench row failed, one
    'can't open file' at a time. Each is one usage error now, before anything is written. (The
    script runs from a copy, with `python` stubbed, so that a regression writes nothing real.)"""
    (tmp_path / "repo" / "benchmarks").mkdir(parents=True)
    script = tmp_path / "repo" / "benchmarks" / "run_all.sh"
    shutil.copy(os.path.join(ROOT, "benchmarks", "run_all.sh"), script)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text("#!/bin/sh\nexit 0\n")
    (stub / "python").chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", COLLBENCH=str(tmp_path / "cb.py"))
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "usage: benchmarks/run_all.sh OUTDIR" in p.stderr, p.stderr
    assert not (tmp_path / "repo" / "benchmarks" / "results").exists()
    (tmp_path / "cb.py").touch()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "machine.txt").write_text("a run\n")
    p = subprocess.run(["bash", str(script), str(kept)], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2 and "holds a run already" in p.stderr, p.stderr
    assert (kept / "machine.txt").read_text() == "a run\n"
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, timeout=60,
                       env=dict(env, COLLBENCH=str(tmp_path / "nowhere.py")))
    assert p.returncode == 2 and "collbench not found at" in p.stderr and "COLLBENCH=" in p.stderr, p.stderr
    assert not out.exists()


def test_single_copy_takes_sizes_as_bench_does():
    """benchmarks/single_copy.py 64K was a ValueError traceback (int('64K'))."""
    script = os.path.join(ROOT, "benchmarks", "single_copy.py")
    p = subprocess.run([sys.executable, script, "4K"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    # (a host that forbids process_vm_readv says so instead of timing)
    assert (p.returncode == 0 and "\n        4096 " in p.stdout) or "process_vm_readv" in p.stderr, p.stdout + p.stderr
    # the bad size in this process, as `python single_copy.py 4X` runs it (a SystemExit whose
    # message Python prints, exit status 1; any other exception would be a traceback)
    import runpy
    from unittest import mock
    with mock.patch.object(sys, "argv", [script, "4X"]), pytest.raises(SystemExit) as e:
        runpy.run_path(script, run_name="__main__")
    assert isinstance(e.value.code, str) and "bad size" in e.value.code, e.value.code


def test_only_rank_0_checks_the_json_path_under_a_launcher(tmp_path, monkeypatch):
    """Under a launcher every rank parses the arguments, and their writability checks raced on
    the one path (two created and removed it together, one failing on the removal, or left an
    empty file; a review's probe). Only rank 0 writes the file, so only rank 0 looks: another
    rank's check touches nothing, rank 0's still refuses a path it cannot write."""
    import argparse
    path = tmp_path / "r.json"
    monkeypatch.setattr(os, "remove", lambda p: (_ for _ in ()).throw(AssertionError(f"rank 1 removed {p}")))
    monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"rank 1 opened {a[0]}")))
    monkeypatch.setenv("RANK", "1")
    bench.check_json_path(argparse.ArgumentParser(), str(path))
    monkeypatch.undo()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        bench.check_json_path(argparse.ArgumentParser(), "/proc/nope.json")
    bench.check_json_path(argparse.ArgumentParser(), str(path))
    assert not path.exists()
