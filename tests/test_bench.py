"""The user-facing benchmarks run end to end (tiny sizes: speed is not asserted here)."""
import json
import os
import subprocess
import sys
import textwrap
import time as _time

import pytest

from neuron_dist import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the variables a launcher sets for its ranks (a shell outside one has none of them)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _usage_error(monkeypatch, capsys, argv, env, tool="bench") -> str:
    """`python -m neuron_dist.<tool> argv` under the environment variables `env` (None: unset),
    run in this process as its command line runs it (main): it must be a usage error (exit
    status 2) before any rank starts; its stderr. Starting ranks, or the process restarting
    itself, fails the test instead (a fresh interpreter per refused command line cost seconds
    of CPU each)."""
    from neuron_dist import bench_train

    def started(*args, **kw):
        raise AssertionError(f"{tool} {argv}: started ranks or restarted instead of refusing")
    for name in ("launch", "worker", "rank_context"):
        monkeypatch.setattr(bench, name, started)
    monkeypatch.setattr(bench_train, "_main", started)
    monkeypatch.setattr(os, "execve", started)
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        (bench if tool == "bench" else bench_train).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, (argv, e.value.code, err)
    return err


class _BenchSession:
    """tests/scripts/bench_session.py: `python -m neuron_dist.TOOL ARGV` command lines run one
    after another in one process (the tool's main, as its command line runs it), their ranks real
    processes forked from one fork server: a fresh interpreter and fork server per command line,
    each importing torch, cost seconds of CPU. Its ranks run with the environment of a shell
    outside a launcher (this process's, without the variables below), and `ranks_env` over it."""
    SCRIPT = os.path.join(ROOT, "tests", "scripts", "bench_session.py")
    UNSET = LAUNCHER_VARS + ("THP_MEM_ALLOC_ENABLE", "NEURON_RT_NUM_CORES", "NEURON_DIST_ALGO", "NEURON_DIST_INSTANCE")

    def __init__(self, tmp_path_factory, tool: str = "bench", ranks_env: dict | None = None):
        self.tmp, self.tool, self.ranks_env, self.p = tmp_path_factory, tool, ranks_env or {}, None

    def __call__(self, argv: list[str], env: dict | None = None, timeout: float = 300):
        """What `subprocess.run([python, "-m", "neuron_dist.TOOL", *argv], capture_output=True,
        text=True, timeout=timeout)` would give, with `env` ({name: value, or None to unset}) over
        the session's environment in the process that runs main."""
        import threading
        if self.p is None or self.p.poll() is not None:
            env0 = dict({k: v for k, v in os.environ.items() if k not in self.UNSET}, **self.ranks_env)
            self.p = subprocess.Popen([sys.executable, self.SCRIPT, str(self.tmp.mktemp("bench_session")), self.tool],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env0,
                                      start_new_session=True)
        self.p.stdin.write(json.dumps({"argv": argv, "env": env or {}}) + "\n")
        self.p.stdin.flush()
        line = []
        reader = threading.Thread(target=lambda: line.append(self.p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not (line and line[0]):
            self.close(kill=True)
            raise AssertionError(f"neuron_dist.{self.tool} {argv}: no answer in {timeout} s (or its session ended)")
        r = json.loads(line[0])
        return subprocess.CompletedProcess([f"neuron_dist.{self.tool}", *argv], r["returncode"], r["stdout"],
                                           r["stderr"])

    def close(self, kill: bool = False) -> None:
        import signal
        if self.p is None:
            return
        if not kill:
            self.p.stdin.close()
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                kill = True
        if kill:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)  # it, its fork server and any rank left
            except ProcessLookupError:
                pass
            self.p.wait()
        self.p = None


@pytest.fixture(scope="session")
def bench_cli(tmp_path_factory):
    session = _BenchSession(tmp_path_factory)
    yield session
    session.close()


@pytest.fixture(scope="session")
def bench_cli_model(tmp_path_factory):
    """bench's session whose ranks run under the model policy (NEURON_DIST_TUNING=model)."""
    session = _BenchSession(tmp_path_factory, ranks_env={"NEURON_DIST_TUNING": "model"})
    yield session
    session.close()


@pytest.fixture(scope="session")
def train_cli(tmp_path_factory):
    """bench_train's session (its fork server preloads torch._dynamo, as bench_train's does)."""
    session = _BenchSession(tmp_path_factory, "bench_train")
    yield session
    session.close()


# what a shell's environment holds for a command line not under a launcher
NOT_LAUNCHED = dict.fromkeys(LAUNCHER_VARS)


def test_parse_size():
    assert bench.parse_size("4K") == 4096 and bench.parse_size("64MiB") == 64 << 20 and bench.parse_size("7") == 7


def test_free_port_is_below_the_ephemeral_range_and_free(monkeypatch):
    """A rendezvous port the kernel handed out by bind(0) can be taken by any other socket before
    the rendezvous binds it (CI once failed so): free_port draws below the ephemeral range, free,
    and falls back to the kernel's pick where the range is unknown or leaves no room."""
    import socket
    from neuron_dist import ports
    drawn = [bench.free_port() for _ in range(20)] + [ports.free_port("") for _ in range(5)]
    low = ports.ephemeral_low()
    assert low >= 1024  # Linux: the range is readable here
    if low > ports.LOWEST + 1024:
        assert all(ports.LOWEST <= p < low for p in drawn), (low, drawn)
        assert len(set(drawn)) > 1, drawn
    for p in drawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 0)  # unknown: the kernel's pick
    assert bench.free_port() >= low


@pytest.mark.parametrize("tool", [
    ["neuron_dist.bench", "-g", "1", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--instance", ""],
    ["neuron_dist.bench_train", "--world", "1", "--layers", "1", "--width", "8", "--steps", "1", "--warmup", "0",
     "--wrap", "ddp", "--backends", "gloo"]])
@pytest.mark.parametrize("given", ["MASTER_PORT", "--port"])
def test_spawned_ranks_meet_on_the_port_given(tool, given, bench_cli, train_cli):
    """The ranks bench and bench_train spawn meet on --port, else MASTER_PORT (both ignored it:
    every run drew a random port). Held by the test, the port makes their rendezvous fail and
    name it; a port picked at random would not."""
    import socket
    port = bench.free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    argv = [sys.executable, "-m", *tool]
    if given == "--port":
        argv += ["--port", str(port)]
    else:
        env["MASTER_PORT"] = str(port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        # (the command line in its tool's session)
        p = (bench_cli if tool[0] == "neuron_dist.bench" else train_cli)(argv[3:],
                                                                           env={"MASTER_PORT": env.get("MASTER_PORT")})
    assert p.returncode != 0 and f"port: {port}" in p.stderr and "EADDRINUSE" in p.stderr, p.stdout + p.stderr


def test_bench_records_the_port_and_rejects_a_bad_one(tmp_path, monkeypatch, capsys, bench_cli):
    """The JSON says which port the ranks met on; a MASTER_PORT or --port that is no port number
    is a usage error before any rank starts."""
    out, port = tmp_path / "p.json", bench.free_port()
    # (the session runs without RANK, WORLD_SIZE and THP_MEM_ALLOC_ENABLE)
    p = bench_cli(["-g", "1", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--instance", "", "--json", str(out)],
                  env={"MASTER_PORT": str(port)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.load(open(out))["config"]["port"] == port
    # (test_thp_on_runs_every_rank_with_torchs_huge_pages's "off" half: without --thp and without
    # THP_MEM_ALLOC_ENABLE the ranks run without torch's huge pages, and the header says so)
    assert " thp off " in p.stdout.splitlines()[0], p.stdout
    monkeypatch.delenv("RANK", raising=False)
    for argv, value, said in ((["--port", "70000"], None, "--port '70000'"), ([], "29x", "MASTER_PORT '29x'")):
        if value is not None:
            monkeypatch.setenv("MASTER_PORT", value)
        with pytest.raises(SystemExit) as e:
            p = bench.parser()
            bench.check(p, p.parse_args(argv))
        assert e.value.code == 2 and f"{said} is not a port number" in capsys.readouterr().err
        from neuron_dist import bench_train
        with pytest.raises(SystemExit) as e:
            bench_train.parse_args(argv)
        assert e.value.code == 2 and f"{said} is not a port number" in capsys.readouterr().err


def _live_in_session(sid: int) -> dict[int, int]:
    """{pid: parent pid} of the processes of session `sid` that have not ended (zombies left out)."""
    out = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out[int(d)] = int(fields[1])
    return out


def _assert_session_ends(p, within: float = 10.0) -> None:
    """Every process of `p`'s session (its ranks, fork server, resource tracker) is gone within
    `within` seconds."""
    deadline = _time.monotonic() + within
    while _live_in_session(p.pid) and _time.monotonic() < deadline:
        _time.sleep(0.2)
    assert not _live_in_session(p.pid), _live_in_session(p.pid)


def _kill_session(p) -> None:
    import signal
    for pid in _live_in_session(p.pid):
        os.kill(pid, signal.SIGKILL)


def _start_with_ranks(tool: list[str]) -> subprocess.Popen:
    """`python -m tool...` in a session of its own, as a shell starts it, once its two ranks
    (children of the fork server, the tool's child) are in their first calls."""
    import signal
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.Popen([sys.executable, "-m", *tool], env=env, start_new_session=True, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = _time.monotonic() + 120
    while True:
        live = _live_in_session(p.pid)
        if sum(1 for ppid in live.values() if ppid in live and ppid != p.pid and live[ppid] == p.pid) >= 2:
            break
        if p.poll() is not None or _time.monotonic() > deadline:
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(p.communicate())
        _time.sleep(0.2)
    _time.sleep(1)  # in their first calls
    return p


SIGNALLED_TOOLS = [
    ["neuron_dist.bench", "-b", "1M", "-e", "1M", "-n", "100000", "-w", "0", "--instance", "", "--no-progress"],
    ["neuron_dist.bench_train", "--layers", "1", "--width", "8", "--steps", "5000", "--warmup", "0",
     "--wrap", "ddp", "--backends", "neuron"]]


@pytest.mark.parametrize("tool", SIGNALLED_TOOLS)
@pytest.mark.parametrize("how", ["SIGTERM to the parent", "Ctrl-C to the group"])
def test_a_signal_to_the_tool_stops_its_ranks(tool, how):
    """SIGTERM to bench's or bench_train's process left its two ranks running the whole sweep
    (and /dev/shm/sem.mp-* behind when they were killed); Ctrl-C, which signals the whole process
    group, printed a KeyboardInterrupt traceback from every process. Either must end every process
    of the run at once, with one line and the shell's exit status for the signal."""
    import signal
    p = _start_with_ranks(tool)
    try:
        if how.startswith("SIGTERM"):
            os.kill(p.pid, signal.SIGTERM)
        else:
            os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
        sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
        assert p.returncode == 128 + sig, (p.returncode, err)
        assert err.strip().splitlines() == [f"{tool[0]}: stopped by {sig.name}, and so were its 2 rank processes"], err
        _assert_session_ends(p)  # the fork server and resource tracker follow their parent
    finally:
        _kill_session(p)
        p.wait()


@pytest.mark.parametrize("tool", SIGNALLED_TOOLS)
def test_a_sigkilled_tool_leaves_no_rank_running(tool):
    """SIGKILL reaches no handler: bench's and bench_train's ranks, which had no parent-death
    signal, ran the whole sweep on (100000 iterations here) after their tool was killed. They
    now ask for SIGKILL when their parent, the fork server, exits, which it does when the tool
    dies; so within seconds no process of the run is left."""
    _sigkill_ends_the_session(_start_with_ranks(tool))


def _sigkill_ends_the_session(p) -> None:
    """SIGKILL to the tool `p`: within seconds no process of its run is left."""
    import signal
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        _assert_session_ends(p)
    finally:
        _kill_session(p)


def test_the_fork_server_ends_with_its_tool_at_once(tmp_path, monkeypatch):
    """The ranks die with their fork server, which ended only after the interpreter's
    finalization of what it had preloaded: bench_train's torch and torch._dynamo took it 2-5 s
    on a loaded 2-core host, its ranks training on meanwhile, and in CI's loaded runs some were
    still running 10 s after their tool's SIGKILL. Here a preloaded module's exit handler takes a minute: the fork
    server must end without it (bench.rank_context), and its ranks with it."""
    (tmp_path / "slow_exit_preload.py").write_text("import atexit, time\natexit.register(time.sleep, 60)\n")
    (tmp_path / "ranks_tool.py").write_text(textwrap.dedent("""
        import os, time
        from neuron_dist import bench

        def rank(launcher):
            bench.die_with_launcher(launcher)
            time.sleep(120)

        if __name__ == "__main__":
            ctx = bench.rank_context(("slow_exit_preload",))
            ps = [ctx.Process(target=rank, args=(os.getpid(),)) for _ in range(2)]
            for p in ps:
                p.start()
            for p in ps:
                p.join()
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    _sigkill_ends_the_session(_start_with_ranks(["ranks_tool"]))


def test_a_rank_whose_tool_died_before_it_asked_exits():
    """The race: a tool that died before its rank's prctl took effect sends no parent-death
    signal; the rank finds another process where its tool should be (its parent, or its
    parent's parent under the fork server) and exits at once. Here the "tool" named is pid 1,
    neither: the process ends with status 1 before it prints; named as its parent, it goes on."""
    # one interpreter for both: its forked child names pid 1 (neither its parent, the process
    # below, nor that one's parent, this test) and must end before it prints; then the process
    # names this test, its parent, and goes on
    code = textwrap.dedent("""
        import os, sys
        from neuron_dist import bench
        pid = os.fork()
        if pid == 0:
            bench.die_with_launcher(1)
            print('on', flush=True)
            os._exit(0)
        print('gone', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        bench.die_with_launcher(int(sys.argv[1]))
        print('on')
    """)
    p = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=120)
    gone, _, here = p.stdout.partition("\n")
    assert gone == "gone 1", p  # status 1, nothing printed before
    assert (p.returncode, here) == (0, "on\n"), p


@pytest.mark.parametrize("instance,n,op,nbytes", [
    ("trn2.48xlarge", 8, "broadcast", 1 << 20),    # the cost model alone picked "ring": no builder
    ("trn1.32xlarge", 4, "alltoall", 64 << 20),    # the same
    ("trn3", 16, "broadcast", 64 << 20),
    ("inf2.48xlarge", 8, "allreduce", 4096),
    ("trn2.48xlarge", 16, "allgather", 64 << 20),
    ("trn2.48xlarge", 64, "reduce_scatter", 1 << 20),
])
def test_model_column_is_the_backends_choice(monkeypatch, instance, n, op, nbytes):
    """The model column's algorithm is the one the backend runs on a group of that topology (its
    model policy, collectives.select.choose), not the cost model's pick among algorithms the
    backend has no schedule for; its busbw is that algorithm's predicted algbw x the bus factor."""
    from types import SimpleNamespace

    from neuron_dist.collectives import select
    from neuron_dist.collectives.algorithms import algorithms_for
    from neuron_dist.topology import place
    monkeypatch.delenv("NEURON_DIST_ALGO", raising=False)
    monkeypatch.delenv("NEURON_DIST_TUNING", raising=False)
    group = SimpleNamespace(topology=place(instance, 1, n), size=n, transport=None)  # what choose reads
    algo, busbw = bench.model_busbw(op, nbytes, n, instance)
    assert algo == select.choose(op, nbytes, group) and algo in algorithms_for(op) and busbw > 0
    # the column is a bus bandwidth, as the measured one beside it: the predicted time's, x the bus factor
    from neuron_dist.topology import estimate
    assert busbw == pytest.approx(nbytes / estimate(op, algo, nbytes, group.topology) / 1e9 * NCCL_BUS[op](n))


# nccl-tests' bus factors (PERFORMANCE.md), written out here rather than read from bench.BUS
NCCL_BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
            "allgather": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n,
            "scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1, "reduce": lambda n: 1,
            "sendrecv": lambda n: 1}


def _check_numbers(stdout, rows):
    """What a bench run prints and writes follows from its times: algbw = size / time, busbw =
    algbw x nccl-tests' factor, for every form and Gloo's; ratio = neuron's busbw over Gloo's (of
    the main form); each table line shows its row's JSON (the out-of-place group the out-of-place
    form, the in-place group the in-place one, '-' where none ran); the average bus bandwidth is
    over every timed form of neuron."""
    import statistics
    lines = [l.split() for l in stdout.splitlines() if l.strip() and not l.startswith("#")]
    assert len(lines) == len(rows), stdout
    for r, t in zip(rows, lines):
        ip = (r.get("in_place") or {}).get("neuron")
        forms = {"out": r["neuron"] if r["place"] == "out" else None,
                 "in": r["neuron"] if r["place"] == "in" else ip}
        for f in [r["neuron"], ip, r.get("gloo")]:
            if f and f["time_us"] is not None:
                assert f["algbw"] == pytest.approx(r["size"] / f["time_us"] / 1e3), r
                assert f["busbw"] == pytest.approx(f["algbw"] * NCCL_BUS[r["op"]](r["world"])), r
        cells = lambda f: ["-"] * 4 if f is None else [f"{f['time_us']:.1f}", f"{f['algbw']:.3f}",
                                                      f"{f['busbw']:.3f}", str(f["wrong"])]
        assert t[:3] == [str(r["size"]), str(r["count"]), r["type"]] and t[3:11] == cells(forms["out"]) + \
            cells(forms["in"]), (r, t)
        if "gloo" in r:
            assert r["ratio"] == pytest.approx(r["neuron"]["busbw"] / r["gloo"]["busbw"]), r
            assert t[11:14] == [f"{r['gloo']['time_us']:.1f}", f"{r['gloo']['busbw']:.3f}", f"{r['ratio']:.2f}"], t
    timed = [f["busbw"] for r in rows for f in (r["neuron"], (r.get("in_place") or {}).get("neuron")) if f]
    assert f"# Avg bus bandwidth    : {statistics.mean(timed):.4f}" in stdout, stdout


def test_collective_bench_vs_gloo_json(tmp_path, bench_cli):
    out = tmp_path / "b.json"
    p = bench_cli(["-g", "2", "--ops", "all", "-b", "1K", "-e", "64K", "-f", "64", "-n", "2", "-w", "1", "--vs", "gloo",
                   "--json", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    for col in ("size", "count", "type", "time", "algbw", "busbw", "#wrong", "ratio", "model"):
        assert col in p.stdout
    assert "Out of bounds values : 0 OK" in p.stdout
    rows = json.load(open(out))["rows"]
    assert {r["op"] for r in rows} == set(bench.OPS)
    assert {r["size"] for r in rows if r["op"] == "allreduce"} == {1024, 65536}
    for r in rows:
        assert r["neuron"]["wrong"] == 0 and r["gloo"]["wrong"] == 0, r
        assert r["neuron"]["busbw"] > 0 and r["ratio"] > 0
        assert (r["model"] is None) == (r["op"] == "sendrecv"), r
        # the default (model) policy runs what the model column names; send/recv has no algorithm
        assert r["neuron"]["algorithm"] == (None if r["op"] == "sendrecv" else r["model"]["algorithm"]), r
    _check_numbers(p.stdout, rows)


def test_rooted_rows_at_another_root(tmp_path, bench_cli):
    """reduce, gather and scatter rows run at the root -r names, checked, with nccl-tests' bus
    factors (reduce 1, gather and scatter (n-1)/n) and the cost model's price."""
    out = tmp_path / "r.json"
    p = bench_cli(["-g", "2", "--ops", "reduce,gather,scatter", "-r", "1", "-b", "64K", "-e", "64K", "-n", "2",
                   "-w", "1", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.load(open(out))["rows"]
    assert [(r["op"], r["size"], r["count"]) for r in rows] == [("reduce", 65536, 16384), ("gather", 65536, 8192),
                                                               ("scatter", 65536, 8192)]
    for r in rows:
        n = r["neuron"]
        assert n["wrong"] == 0 and n["busbw"] == pytest.approx(n["algbw"] * (1 if r["op"] == "reduce" else 0.5)), r
        assert r["model"]["busbw"] > 0 and n["algorithm"] == r["model"]["algorithm"], r


def test_out_of_place_and_in_place_groups(tmp_path, bench_cli):
    """nccl-tests prints an out-of-place and an in-place group of columns (time, algbw, busbw,
    #wrong): all-gather runs both; all-reduce, whose torch call takes one buffer, only in place;
    all-to-all only out of place ('-' in the other group). The JSON keeps its old fields for
    the main form (`place` names it; Gloo and the ratio compare it) and adds `in_place`;
    benchmarks/tables.py reads it. --place in leaves all-to-all out."""
    out = tmp_path / "bench_w2.json"
    p = bench_cli(["-g", "2", "--ops", "allreduce,allgather,alltoall", "-b", "64K", "-e", "64K", "-n", "2", "-w", "1",
                   "--vs", "gloo", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "out-of-place" in p.stdout and "in-place" in p.stdout
    # the Gloo columns name the form Gloo ran: all-reduce's only form, all-gather's and all-to-all's main one
    assert [l.split("gloo: ")[1].strip() for l in p.stdout.splitlines() if "gloo: " in l] == [
        "in place", "out of place", "out of place"], p.stdout
    rows = {r["op"]: r for r in json.load(open(out))["rows"]}
    assert {op: (r["place"], "in_place" in r) for op, r in rows.items()} == {
        "allreduce": ("in", False), "allgather": ("out", True), "alltoall": ("out", False)}
    for r in rows.values():
        forms = [r["neuron"]] + ([r["in_place"]["neuron"]] if "in_place" in r else [])
        assert all(f["wrong"] == 0 and f["busbw"] > 0 for f in forms) and r["gloo"]["wrong"] == 0, r
    table = [l.split() for l in p.stdout.splitlines() if l.strip().startswith("65536")]
    assert [t[3:11].count("-") for t in table] == [4, 0, 4], p.stdout  # allreduce, allgather, alltoall
    assert table[0][3] == "-" and table[2][7] == "-", p.stdout  # out of place, in place: none
    _check_numbers(p.stdout, json.load(open(out))["rows"])
    tp = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tables.py"), str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert tp.returncode == 0 and "| allgather | 64 KiB |" in tp.stdout, tp.stdout + tp.stderr
    p = bench_cli(["-g", "2", "--ops", "allgather,alltoall", "--place", "in", "-b", "64K", "-e", "64K", "-n", "1",
                   "-w", "0", "--vs", "gloo", "--json", str(out)])
    assert p.returncode == 0 and "# alltoall: left out under --place in" in p.stdout, p.stdout + p.stderr
    assert [(r["op"], r["place"]) for r in json.load(open(out))["rows"]] == [("allgather", "in")]
    assert "gloo: in place" in p.stdout and "gloo: out" not in p.stdout, p.stdout  # (it said "out, else in place")


def test_ran_column_is_what_the_backend_ran(tmp_path):
    """Under NEURON_DIST_TUNING=host the backend runs the ring for a two-rank 1 MiB all-reduce
    (more than one frame) where the model policy, which the `algo` column follows, picks direct:
    `ran` must come from the call itself, not from the model."""
    import os
    out = tmp_path / "h.json"
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench", "-g", "2", "--ops", "allreduce", "-b", "1M",
                        "-e", "1M", "-n", "1", "-w", "0", "--json", str(out)],
                       env=dict(os.environ, NEURON_DIST_TUNING="host"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.load(open(out))["rows"]
    assert row["neuron"]["algorithm"] == "ring" and row["model"]["algorithm"] == "direct", row
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith("1048576"))
    assert line.split()[-3:-2] == ["ring"] and line.split()[-1] == "direct", p.stdout


@pytest.mark.parametrize("mode,header,key", [("--loop", "time loop-avg", "loop"), ("--added", "time added", "added")])
def test_collective_bench_timing_modes(tmp_path, mode, header, key, bench_cli):
    """--loop (one barrier, back-to-back calls) and --added (what a call adds to a barrier):
    same columns, results still checked."""
    out = tmp_path / "m.json"
    p = bench_cli(["-g", "2", "--ops", "allreduce,broadcast,sendrecv", "-b", "4K", "-e", "4K", "-n", "5", "-w", "1",
                   mode, "--vs", "gloo", "--json", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert header in p.stdout and "Out of bounds values : 0 OK" in p.stdout
    data = json.load(open(out))
    assert data["config"][key] is True
    assert {r["op"] for r in data["rows"]} == {"allreduce", "broadcast", "sendrecv"}
    # --added may leave a row unresolved (null) when a 4 KiB call costs less than the barrier's
    # jitter; a time it reports is positive, and --loop always reports one
    ok = (lambda v: v is None or v > 0) if key == "added" else (lambda v: v is not None and v > 0)
    assert all(ok(r["neuron"]["time_us"]) and ok(r["gloo"]["time_us"]) for r in data["rows"]), data["rows"]


def test_sendrecv_is_left_out_at_world_one(tmp_path):
    """At world 1 send/recv has no peer: its row copied the tensor locally for "neuron" and
    "gloo" alike and printed a busbw (38 GB/s) and a ratio that measured no backend. The row is
    left out, with a line that says so, and a Case for it cannot be built."""
    import torch
    out = tmp_path / "w1.json"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(bench.free_port()), GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench", "--ops", "sendrecv,allreduce", "-b", "4K", "-e",
                        "4K", "-n", "1", "-w", "0", "--vs", "gloo", "--instance", "", "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["op"] for r in json.load(open(out))["rows"]] == ["allreduce"]
    assert "# sendrecv: left out at world 1" in p.stdout and "# sendrecv\n" not in p.stdout, p.stdout
    with pytest.raises(ValueError, match="two ranks"):
        bench.Case("sendrecv", 4096, torch.float32, 0, 1, None)


def test_loop_and_added_are_exclusive():
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench", "--loop", "--added"], capture_output=True, text=True)
    assert p.returncode == 2 and "choose one" in p.stderr


class FakeDist:
    """Just enough of torch.distributed for `bench._time` in one process: a barrier that sleeps
    `barrier_s(i)` on its i-th call, reductions over one rank."""
    class ReduceOp:
        MAX, SUM = "max", "sum"

    def __init__(self, barrier_s):
        self.barrier_s, self.barriers = barrier_s, 0

    def barrier(self, group=None):
        _time.sleep(self.barrier_s(self.barriers))
        self.barriers += 1

    def all_reduce(self, t, op=None, group=None):
        pass

    def get_world_size(self, group=None):
        return 1


class SleepCase:
    def __init__(self, secs):
        self.secs, self.calls = secs, 0

    def run(self):
        self.calls += 1
        if self.secs:
            _time.sleep(self.secs)


def test_added_time_subtracts_the_barriers():
    """--added's arithmetic on a fake group: a call that takes 2 ms behind a barrier that takes
    1 ms adds about 2 ms (its own time; the barrier's is subtracted), and is run n times."""
    import torch
    case = SleepCase(0.002)
    t = bench._time(case, 20, 2, None, FakeDist(lambda i: 0.001), torch, added=True)
    assert case.calls == 22
    # a sleep never returns early; not subtracting the barriers would give 3 ms
    assert 0.0019 <= t < 0.0028, t


def test_added_time_below_the_barrier_jitter_is_unresolved():
    """A call cheaper than the barrier's jitter has no time under --added: the timed barrier
    before it (every third barrier) takes 2 ms, the one after 1 ms, the call nothing, so the
    difference is negative. It must come back as NaN and print as '-' (a clamp to a tiny time
    printed 163 GB/s for a 16 KiB broadcast), not as a number."""
    import math

    import torch
    t = bench._time(SleepCase(0), 10, 0, None, FakeDist(lambda i: 0.002 if i % 3 == 1 else 0.001), torch,
                    added=True)
    assert math.isnan(t), t
    assert bench._num(None, 9, 1) == "        -" and bench._num(12.345, 9, 1) == "     12.3"


class ClockDist:
    """torch.distributed for `bench._timed` on a fake clock, with a second rank simulated: each
    barrier advances the clock by `barrier_s`, each call by `call_s(i)` (the i-th call); the
    group's all_reduce combines this rank's tensor with `peer` (the other rank's values) by the
    reduction asked for, so the reduction and the statistic over iterations can be told apart."""
    class ReduceOp:
        MAX, MIN, SUM = "max", "min", "sum"

    def __init__(self, peer, barrier_s=0.001):
        self.now, self.peer, self.barrier_s, self.ops = 0.0, peer, barrier_s, []

    def clock(self):
        return self.now

    def barrier(self, group=None):
        self.now += self.barrier_s

    def all_reduce(self, t, op=None, group=None):
        import torch
        self.ops.append(op)
        other = torch.tensor(self.peer, dtype=t.dtype)
        t.copy_({"max": torch.maximum, "min": torch.minimum, "sum": torch.add}[op](t, other))

    def get_world_size(self, group=None):
        return 2


class ClockCase:
    def __init__(self, dist, call_s):
        self.dist, self.call_s, self.calls = dist, call_s, 0

    def run(self):
        self.dist.now += self.call_s(self.calls)
        self.calls += 1


def test_row_time_is_the_median_of_the_slowest_ranks_iterations(monkeypatch):
    """The three timings' arithmetic, on a fake clock with a simulated second rank (no sleeps):
    the default time is the median over iterations of the slower rank's time (one slow iteration
    of five moves the median, not a mean; the other rank's 2 ms is the maximum, not a sum); --loop
    the slower rank's average per call; --added the ranks' mean of (call + barrier) - barrier,
    median over iterations. A mean, a sum over ranks or an average over one call too many would
    each print a wrong time, and every bandwidth from it."""
    import types

    import torch
    fake = ClockDist(peer=[0.002] * 5)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=fake.clock))
    warm = 2  # the warm-up calls are not timed
    mine = [0.0] * warm + [0.001, 0.001, 0.001, 0.001, 0.010]
    t = bench._time(ClockCase(fake, lambda i: mine[i]), 5, warm, None, fake, torch)
    assert t == pytest.approx(0.002) and fake.ops == ["max"], t  # max(1, 2) ms x 4, max(10, 2): median 2
    fake = ClockDist(peer=[0.001])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=fake.clock))
    t = bench._time(ClockCase(fake, lambda i: 0.002), 4, 1, None, fake, torch, loop=True)
    assert t == pytest.approx(0.002) and fake.ops == ["max"], t  # 8 ms over 4 calls; the other rank 1 ms
    fake = ClockDist(peer=[0.001] * 3, barrier_s=0.001)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=fake.clock))
    t = bench._time(ClockCase(fake, lambda i: 0.003), 3, 0, None, fake, torch, added=True)
    assert t == pytest.approx(0.002) and fake.ops == ["sum"], t  # (3 + 1) - 1 = 3 ms here, 1 ms there: mean 2


class ReusedCase(bench.Case):
    """A world-1 Case whose "call" is right the first time and, from the second call on, leaves
    its output's last element one off when `broken` (a fault of a reused form); it counts calls."""
    def __init__(self, op, broken, **kw):
        super().__init__(op, 4 * 64, __import__("torch").float32, 0, 1, None, **kw)
        self.broken, self.calls = broken, 0

    def run(self):
        self.calls += 1
        if self.out.data_ptr() != self.x.data_ptr():  # (an all-reduce of one rank leaves its input)
            self.out.copy_(self.x)
        if self.broken and self.calls > 1:
            self.out[-1] += 1


@pytest.mark.parametrize("op", ["allgather", "allreduce"])
def test_the_result_is_checked_after_the_timed_calls_too(op):
    """The output was checked on the first call of each size alone, before warm-up and timing; a
    fault that appears only once a form is reused (plans.py keeps state per form: a review's
    planted bug, one element off from the second all-gather on, read 0 wrong) went unseen.
    nccl-tests writes the data again and checks after its timed loop (BenchTime): so does
    _measure, untimed, and #wrong is the worse check. A right call reads 0 wrong, after the timed
    calls too (an all-reduce's input, zeroed while timing, is written again)."""
    import torch
    from types import SimpleNamespace
    a = SimpleNamespace(iters=3, warmup=1, loop=False, added=False)
    for broken in (True, False):
        case = ReusedCase(op, broken)
        out = bench._measure(case, a, None, None, FakeDist(lambda i: 0), torch)
        assert out["wrong"] == (1 if broken else 0), (broken, out)
        assert case.calls == 1 + a.warmup + a.iters + 1 and out["algbw"] > 0


def _reduce(xs, redop):
    """The ranks' inputs `xs` reduced by `redop`, in float64 (the reference)."""
    import torch
    t = torch.stack([x.double() for x in xs])
    return {"sum": t.sum(0), "prod": t.prod(0), "min": t.amin(0), "max": t.amax(0), "avg": t.mean(0)}[redop]


def _collective(op, cases, redop="sum", root=0):
    """What each rank's output holds after `op` over the ranks' `cases`, computed in one process."""
    import torch
    n, c = len(cases), cases[0].c
    xs = [case.x for case in cases]
    if op == "allreduce":
        return [_reduce(xs, redop)] * n
    if op == "allgather":
        return [torch.cat(xs)] * n
    if op == "reduce_scatter":
        return [_reduce(xs, redop)[r * c:(r + 1) * c] for r in range(n)]
    if op == "broadcast":
        return [xs[root]] * n
    if op == "alltoall":
        return [torch.cat([x[r * c:(r + 1) * c] for x in xs]) for r in range(n)]
    if op in ("reduce", "gather"):  # the root's alone (the others check nothing)
        return [(_reduce(xs, redop) if op == "reduce" else torch.cat(xs)) if r == root else xs[r][:0]
                for r in range(n)]
    if op == "scatter":
        return [xs[root][r * c:(r + 1) * c] for r in range(n)]
    return [xs[(r - 1) % n] for r in range(n)]  # sendrecv: from the previous rank


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", bench.OPS)
def test_bench_checks_outputs_chunk_by_chunk(monkeypatch, op, dtype):
    """Case builds its inputs and checks its output a chunk at a time (CHUNK, 7 elements here, so
    every block straddles chunks): an output that holds what the collective gives over the ranks'
    inputs has no wrong element, and each corrupted element counts once."""
    import torch
    monkeypatch.setattr(bench, "CHUNK", 7)
    n = 3
    cases = [bench.Case(op, 4 * 100, getattr(torch, dtype), r, n, None) for r in range(n)]
    for case, result in zip(cases, _collective(op, cases)):
        case.out.copy_(result)
    for case in cases:
        assert case.wrong() == 0
    bad = cases[1] if cases[1].out.numel() else cases[0]  # (reduce, gather: the root's output)
    bad.out[8:10] = 7
    assert bad.wrong() == 2


@pytest.mark.parametrize("redop,dtype", [(o, d) for o in bench.REDOPS for d in ("float32", "bfloat16", "int32")
                                          if (o, d) != ("avg", "int32")])  # refused: not exact
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "reduce"])
def test_bench_checks_every_reduction(op, redop, dtype):
    """-o picks the reduction (nccl-tests' flag): each one's expected values are what the ranks'
    inputs reduce to (float64 reference), at worlds 1-4; a wrong element counts."""
    import torch
    for n in (1, 2, 3, 4):
        cases = [bench.Case(op, 4 * 96, getattr(torch, dtype), r, n, None, redop=redop) for r in range(n)]
        for case, result in zip(cases, _collective(op, cases, redop)):
            case.out.copy_(result.to(case.out.dtype))
        assert [case.wrong() for case in cases] == [0] * n, (n, [case.out[:6] for case in cases])
        bad = cases[0] if op == "reduce" else cases[-1]  # (reduce: the root's output)
        bad.out[3] += 1
        assert bad.wrong() == 1


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "reduce"])
def test_a_reduction_that_returns_one_ranks_input_or_another_reduction_is_wrong(op):
    """The reductions' inputs were (k % 5) + rank + 1, rising with the rank: rank 0 held every
    minimum and rank n-1 every maximum, so a MIN that returned rank 0's input read 0 wrong, and
    PRODUCT's one 2 per index made MAX's result right for it too (a review's planted bugs,
    `-o min` and `-o prod` over the backend, both passed). Each rank now has data of its own, the
    extremes at different ranks: at worlds 2-8, for every -o, the right output counts no wrong
    element, and an output that holds any one rank's input, or another reduction of the same
    inputs, counts some."""
    import torch
    for n in range(2, 9):
        for redop in bench.REDOPS:
            cases = [bench.Case(op, 4 * 96, torch.float32, r, n, None, redop=redop) for r in range(n)]
            outputs = {redop: _collective(op, cases, redop)}
            outputs.update({f"rank {j}'s input": _collective(op, [cases[j]] * n, "max") for j in range(n)})
            outputs.update({other: _collective(op, cases, other) for other in bench.REDOPS if other != redop})
            for name, result in outputs.items():
                for case, out in zip(cases, result):
                    case.out.copy_(out.to(case.out.dtype))
                wrong = sum(case.wrong() for case in cases)
                assert (wrong == 0) == (name == redop), (n, redop, name, wrong)


@pytest.mark.parametrize("dtype", bench.DTYPES)
def test_reduction_checks_are_exact_at_every_world(dtype):
    """The sum of the old inputs, 4n + n(n+1)/2, passed bfloat16's exact integers (256) from 19
    ranks on and float16's (2048) from 60: a 20-rank bfloat16 all-reduce, right on every backend,
    read 117960 wrong. At worlds 1-64, for every -o and dtype bench offers, reducing the ranks'
    inputs in the dtype itself, one rank at a time in either order (so every partial sum a ring
    or tree may form is met), gives exactly what the check wants; and a world where no exact data
    exists is refused (bfloat16 at 129 ranks; no Case either)."""
    import torch
    dt = getattr(torch, dtype)
    g = torch.arange(60)
    ops = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}
    for n in range(1, 65):
        for redop, fn in ops.items():
            if redop == "avg" and not dt.is_floating_point:  # refused by bench
                continue
            m = bench.reduction_levels(redop, n, dt)
            xs = [bench.reduction_input(redop, n, m, r, g) for r in range(n)]
            assert all(bool((x.to(dt).double() == x.double()).all()) for x in xs), (n, redop)  # inputs exact
            want = bench.reduction_want(redop, n, m, g)
            for order in (xs, xs[::-1]):
                acc = order[0].to(dt)
                for x in order[1:]:
                    acc = fn(acc, x.to(dt))
                if redop == "avg":
                    acc = acc / n
                assert bool((acc.double() == want.double()).all()), (n, redop, acc[:6], want[:6])
    for n in (20, 64):  # the Cases a 20-rank bench builds: their check passes the sum the dtype gives
        cases = [bench.Case("allreduce", 4 * 40, dt, r, n, None) for r in range(n)]
        xs = [case.x.clone() for case in cases]  # (the output is the input: in place)
        for order in (xs, xs[::-1]):
            acc = order[0].clone()
            for x in order[1:]:
                acc += x
            for case in cases:
                case.out.copy_(acc)
            assert [case.wrong() for case in cases] == [0] * n, (n, acc[:6])
    if dtype in ("bfloat16", "float16"):
        n = bench.exact_integers(dt) // 2 + 1  # (a sum of at least 2 per rank)
        assert bench.inexact_reduction("sum", n - 1, dt) is None and "the check would count" in \
            bench.inexact_reduction("sum", n, dt)
        with pytest.raises(ValueError, match=f"-o avg over {n} ranks in {dtype}"):
            bench.Case("allreduce", 64, dt, 0, n, None, redop="avg")
        assert bench.inexact_reduction("max", n, dt) is None


def test_a_reduction_that_cannot_be_exact_is_refused_up_front(capsys):
    """A world and dtype whose sums no data keeps exact is a usage error, not rows of #wrong."""
    p = bench.parser()
    with pytest.raises(SystemExit) as e:
        bench.check(p, p.parse_args(["-g", "129", "-d", "bfloat16", "--ops", "allgather,reduce", "--instance", ""]))
    assert e.value.code == 2 and "-o sum over 129 ranks in bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("root", [0, 2])
def test_bench_broadcast_takes_its_root(root):
    """-r: the root's input reaches every rank; the others start at -1."""
    import torch
    cases = [bench.Case("broadcast", 4 * 64, torch.float32, r, 3, None, root=root) for r in range(3)]
    assert all(bool((case.x == -1).all()) == (r != root) for r, case in enumerate(cases))
    for case, result in zip(cases, _collective("broadcast", cases, root=root)):
        case.out.copy_(result)
    assert [case.wrong() for case in cases] == [0, 0, 0]


def test_bench_refuses_reductions_and_roots_it_cannot_check(monkeypatch, capsys):
    # in this process, as the command line runs them (test_loop_and_added_are_exclusive runs one)
    for argv, message in ((["-r", "2"], "-r/--root 2: a rank of the 2-rank job"),
                          (["-o", "avg", "-d", "int32"], "an integer average is not exact"),
                          (["-o", "avg", "--vs", "gloo"], "Gloo has no AVG")):
        err = _usage_error(monkeypatch, capsys, argv, NOT_LAUNCHED)
        assert message in err and "Traceback" not in err, (argv, err)


def test_bench_case_memory_is_its_buffers(tmp_path):
    """A rank's peak memory for a case is its two buffers, not 8-9 times the largest: int64
    index tensors and whole-buffer temporaries for the inputs and expected values, a kept
    expected output and two float copies in the check made a 128 MiB all-gather peak at 1261
    MiB per rank. In a fresh process: the peak resident set grows by at most the buffers (a
    64 MiB all-gather: 32 MiB in, 64 MiB out) and 48 MiB of chunks and allocator slack."""
    code = textwrap.dedent("""
        import resource, torch
        from neuron_dist import bench
        bench.Case("allgather", 4096, torch.float32, 0, 2, None).wrong()  # whatever a first call sets up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        c = bench.Case("allgather", 64 << 20, torch.float32, 0, 2, None)
        assert c.wrong() == c.out.numel()  # nothing written yet: every element is wrong
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout) <= 96 + 48, p.stdout


def test_training_bench_runs(tmp_path, train_cli):
    """Both wrappers over both backends and the no-communication floor: the real backends must
    leave every rank with the same parameters, the floor (ranks alone on different data) must not."""
    out = tmp_path / "t.json"
    p = train_cli(["--layers", "2", "--width", "64", "--steps", "2", "--warmup", "1", "--cpu-bind", "core",
                   "--backends", "neuron,gloo,none", "--json", str(out)], timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.load(open(out))
    rows = result["rows"]
    assert result["config"]["cpu_bind"] == "core" and "cpu-bind core" in p.stdout
    assert [(r["wrap"], r["backend"]) for r in rows] == [(w, b) for w in ("ddp", "fsdp2")
                                                         for b in ("neuron", "gloo", "none")]
    assert all(r["step_ms"] > 0 for r in rows)
    assert [r["agree"] for r in rows] == [True, True, False] * 2
    refs = result["compute_runs_ms"]  # one before the first row, one after each
    assert len(refs) == len(rows) + 1 and result["compute_ms"] == sorted(refs)[len(rows) // 2]
    for i, r in enumerate(rows):
        assert r["compute_ms"] == pytest.approx((refs[i] + refs[i + 1]) / 2)
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["compute_ms"])
        assert r["peak_mib"] > 50  # a rank's peak resident memory (torch alone is more than that)
    assert result["config"]["thp"] == "off" and "thp off" in p.stdout


class _FakeRanks:
    """bench.rank_context for bench_train.run in one process: a rank "runs" as it starts, putting
    (step seconds, digest, peak MiB) from `result(backend, rank)` on the queue."""
    def __init__(self, result):
        import queue
        self.result, self.Queue = result, queue.Queue

    def Process(self, target, args):
        from types import SimpleNamespace
        rank, a, backend, wrap, port, q, launcher = args
        return SimpleNamespace(start=lambda: q.put(self.result(backend, rank)), exitcode=0, join=lambda: None,
                               is_alive=lambda: False, terminate=lambda: None)


def test_training_rows_take_the_slowest_rank_and_the_references_beside_them(monkeypatch, capsys, tmp_path):
    """bench_train's arithmetic in one process, the ranks and the compute-only reference faked with
    known times: a row's step is the slowest rank's (rank 1: 30 ms against rank 0's 10), its
    compute-only time the mean of the references measured just before and after it, its ratio step
    over that, in the JSON and the printed table alike; peak MiB the largest rank's. A step time
    taken from the fastest rank, or a reference from elsewhere in the run, printed a ratio the
    backend did not have."""
    import torch
    from neuron_dist import bench_train
    monkeypatch.setattr(bench, "rank_context", lambda preload=(): _FakeRanks(
        lambda backend, rank: ((0.010, 0.030)[rank] * (2 if backend == "gloo" else 1), ((1.0, 2.0),), 100.0 + rank)))
    refs = iter([0.010, 0.020, 0.040])  # before the first row, after it, after the second
    monkeypatch.setattr(bench_train, "_steps", lambda m, a, rank: next(refs))
    out = tmp_path / "t.json"
    a = bench_train.parse_args(["--wrap", "ddp", "--backends", "neuron,gloo", "--layers", "1", "--width", "8",
                                "--port", "38570", "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        assert bench_train._main(a) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.load(open(out))["rows"]
    assert [(r["backend"], r["step_ms"], r["compute_ms"], r["ratio"], r["peak_mib"]) for r in rows] == [
        ("neuron", pytest.approx(30), pytest.approx(15), pytest.approx(2), 101.0),
        ("gloo", pytest.approx(60), pytest.approx(30), pytest.approx(2), 101.0)]
    printed = [l.split() for l in capsys.readouterr().out.splitlines() if l.split()[:1] == ["ddp"]]
    assert [p[2:5] for p in printed] == [["30.0", "15.0", "2.00"], ["60.0", "30.0", "2.00"]], printed


def test_training_step_is_the_median_after_the_warm_up(monkeypatch):
    """_steps times --warmup + --steps steps and takes the median of the last --steps: the
    warm-up steps (first-call allocations, lazy initialisation; 1 s each on the fake clock here)
    must not enter it."""
    import types

    import torch
    from neuron_dist import bench_train
    now = [0.0]

    class Slow(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            now[0] += 1.0 if Slow.calls < 3 else 0.001
            Slow.calls += 1
            return super().forward(x)

    monkeypatch.setattr(bench_train, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    a = types.SimpleNamespace(batch=2, width=4, warmup=3, steps=2)
    assert bench_train._steps(Slow(4, 4), a, 0) == pytest.approx(0.001)


def test_training_bench_with_torch_huge_pages(tmp_path, monkeypatch):
    """--thp on restarts the benchmark with THP_MEM_ALLOC_ENABLE=1 (torch reads it once, when a
    process first allocates), so the reference and every rank run with it; called in-process
    without the variable it refuses instead of replacing the caller's process."""
    out = tmp_path / "t.json"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench_train", "--layers", "2", "--width", "64",
                        "--steps", "2", "--warmup", "1", "--wrap", "ddp", "--backends", "neuron", "--thp", "on",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "thp on" in p.stdout and json.load(open(out))["config"]["thp"] == "on"
    from neuron_dist import bench_train
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    with pytest.raises(SystemExit, match="THP_MEM_ALLOC_ENABLE"):
        bench_train.main(["--thp", "on", "--backends", "neuron"])


@pytest.mark.parametrize("wrap, flag, value", [("ddp", "bucket-view", "on"), ("fsdp2", "reshard-after-forward", "off")])
def test_training_bench_with_the_users_own_settings(tmp_path, wrap, flag, value):
    """--bucket-view on wraps DDP with gradient_as_bucket_view=True (a user's setting: 25-30 ms
    off this host's two-rank step, RESULTS.md "Fifty-eighth pass"), --reshard-after-forward off
    shards FSDP2's layers with reshard_after_forward=False; the rows still agree with Gloo's, and
    the run says which it timed."""
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench_train", "--layers", "2", "--width", "64",
                        "--steps", "2", "--warmup", "1", "--wrap", wrap, "--backends", "neuron,gloo",
                        f"--{flag}", value, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.load(open(out))
    assert f"{flag} {value}" in p.stdout and result["config"][flag.replace("-", "_")] == value, p.stdout
    assert [(r["backend"], r["agree"]) for r in result["rows"]] == [("neuron", True), ("gloo", True)], result["rows"]


def test_a_wrappers_setting_without_its_rows_is_refused(capsys):
    """--bucket-view is DDP's setting and --reshard-after-forward FSDP2's: given with a --wrap that
    runs no row of that wrapper, each was ignored without a word (review BO)."""
    from neuron_dist import bench_train
    for argv, said in ((["--wrap", "fsdp2", "--bucket-view", "on"], "--bucket-view on is a ddp setting"),
                       (["--wrap", "ddp", "--reshard-after-forward", "off"],
                        "--reshard-after-forward off is a fsdp2 setting")):
        with pytest.raises(SystemExit) as e:
            bench_train.parse_args(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    for argv in (["--bucket-view", "on", "--reshard-after-forward", "off"], ["--wrap", "ddp", "--bucket-view", "on"]):
        bench_train.parse_args(argv)  # (--wrap both runs both)


def test_cores_per_rank_places_the_spawned_ranks_and_the_model_column_alike(tmp_path, monkeypatch, capsys,
                                                                           bench_cli_model):
    """`neuronrun --cores-per-rank 4` on trn2 puts a rank on each of 4 chips, where the backend
    runs the ring for a 1 MiB all-reduce; bench modelled one rank per core (4 ranks on one chip:
    `direct`) and had no flag to say otherwise. --cores-per-rank now places the ranks it spawns
    (NEURON_RT_NUM_CORES) and the model column alike, and is checked as neuronrun checks it."""
    assert bench.model_busbw("allreduce", 1 << 20, 4, "trn2.48xlarge")[0] == "direct"
    assert bench.model_busbw("allreduce", 1 << 20, 4, "trn2.48xlarge", 1, 4)[0] == "ring"
    out = tmp_path / "c.json"
    # (in the session whose ranks run with NEURON_DIST_TUNING=model, without NEURON_RT_NUM_CORES and
    # NEURON_DIST_ALGO)
    p = bench_cli_model(["-g", "4", "--ops", "allreduce", "-b", "1M", "-e", "1M", "-n", "1", "-w", "0", "--instance",
                         "trn2.48xlarge", "--cores-per-rank", "4", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 node(s) of 4 ranks, 4 cores per rank" in p.stdout, p.stdout
    (row,) = json.load(open(out))["rows"]
    assert row["neuron"]["algorithm"] == row["model"]["algorithm"] == "ring", row
    for args, msg in ((["--cores-per-rank", "3"], "--cores-per-rank: 3 cores per rank do not fit 4 logical cores per chip"),
                      (["--cores-per-rank", "3", "--instance", ""], "--cores-per-rank: 3 cores per rank do not fit"),
                      (["--cores-per-rank", "0"], "--cores-per-rank: cores per rank must be at least 1")):
        # (in this process, as the command line runs it: the refusals come before any rank starts)
        err = _usage_error(monkeypatch, capsys, ["-g", "4", *args],
                           dict(NOT_LAUNCHED, NEURON_RT_NUM_CORES=None, NEURON_DIST_ALGO=None))
        assert msg in err, (args, err)
    # under a launcher the ranks are placed already: a flag that says otherwise is refused
    launched = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="1", NEURON_RT_NUM_CORES=None, NEURON_DIST_ALGO=None)
    err = _usage_error(monkeypatch, capsys, ["--cores-per-rank", "4"], launched)
    assert "the launcher placed these ranks on 1 cores each" in err, err


def test_instance_reaches_the_ranks_and_the_json_records_their_placement(tmp_path, monkeypatch, capsys, bench_cli,
                                                                         bench_cli_model):
    """`--instance` priced the model column while the ranks bench spawns modelled
    $NEURON_DIST_INSTANCE (trn2.48xlarge), so under the model policy `ran` (trn2's direct) and
    `algo` (trn1.2xlarge's ring) differed for a 4 MiB all-reduce; the ranks now model it too. The
    JSON recorded one core per rank where `--instance ''` ran them on four, and no placement
    variable: it now records both. Under a launcher whose ranks model another instance the flag
    is refused."""
    import os
    assert bench.model_busbw("allreduce", 4 << 20, 2, "trn1.2xlarge")[0] != \
        bench.model_busbw("allreduce", 4 << 20, 2, "trn2.48xlarge")[0]
    # (both runs in sessions whose ranks run without NEURON_RT_NUM_CORES, NEURON_DIST_ALGO and
    # NEURON_DIST_INSTANCE; this one's with NEURON_DIST_TUNING=model)
    out = tmp_path / "i.json"
    p = bench_cli_model(["-g", "2", "--ops", "allreduce", "-b", "4M", "-e", "4M", "-n", "1", "-w", "0", "--instance",
                         "trn1.2xlarge", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.load(open(out))["rows"]
    assert row["neuron"]["algorithm"] == row["model"]["algorithm"], row
    out = tmp_path / "c.json"
    p = bench_cli(["-g", "2", "--ops", "allreduce", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--instance", "",
                   "--cores-per-rank", "4", "--json", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    config = json.load(open(out))["config"]
    assert config["cores_per_rank"] == 4 and config["env"]["NEURON_RT_NUM_CORES"] == "4", config
    # the check runs in the caller's process (tests call it): the instance goes to the ranks, not into
    # the caller's environment (it reached every worker the test session started after it)
    before = [os.environ.get(k) for k in ("NEURON_DIST_INSTANCE", "NEURON_RT_NUM_CORES")]
    p = bench.parser()
    bench.check(p, p.parse_args(["-g", "2", "--instance", "trn1.2xlarge"]))
    bench.check(p, p.parse_args(["-g", "2", "--instance", "", "--cores-per-rank", "2"]))
    assert [os.environ.get(k) for k in ("NEURON_DIST_INSTANCE", "NEURON_RT_NUM_CORES")] == before
    launched = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="1", NEURON_DIST_INSTANCE="trn2.48xlarge", NEURON_RT_NUM_CORES=None,
                    NEURON_DIST_ALGO=None)
    err = _usage_error(monkeypatch, capsys, ["--instance", "trn1.2xlarge"], launched)
    assert "the launcher's ranks model trn2.48xlarge" in err, err


def test_the_collector_is_paused_while_a_row_is_timed():
    """A cyclic collection in one rank (100-200 ms early in a sweep) stalled every peer inside a
    timed call; the collector is now off while a row is timed, in every timing mode, and back on
    after."""
    import gc
    import torch
    from types import SimpleNamespace
    seen = []
    case = SimpleNamespace(run=lambda: seen.append(gc.isenabled()))
    fake = SimpleNamespace(barrier=lambda group=None: None, all_reduce=lambda t, op=None, group=None: None,
                           get_world_size=lambda g=None: 1, ReduceOp=SimpleNamespace(MAX=0, SUM=1))
    assert gc.isenabled()
    for loop, added in ((False, False), (True, False), (False, True)):
        bench._time(case, 3, 1, None, fake, torch, loop, added)
    assert seen and not any(seen), seen
    assert gc.isenabled()


def test_thp_on_runs_every_rank_with_torchs_huge_pages(monkeypatch, capsys):
    """`--thp on` restarts the command with THP_MEM_ALLOC_ENABLE=1, so its ranks (a fork server
    that imported torch) and Gloo's rows run as neuronrun runs jobs; ranks a launcher started
    without it are refused, not run as if it were set."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    p = subprocess.run([sys.executable, "-m", "neuron_dist.bench", "-g", "2", "-b", "4K", "-e", "4K", "-n", "1",
                        "-w", "0", "--thp", "on", "--vs", "gloo", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert " thp on " in p.stdout.splitlines()[0], p.stdout
    # without --thp (and without the variable) the header reads " thp off ": checked on the run of
    # test_bench_records_the_port_and_rejects_a_bad_one (a bench run of its own cost seconds of CPU)
    # the refusals, in this process as the command line runs them (before any rank starts or a restart)
    err = _usage_error(monkeypatch, capsys, ["--thp", "on"], dict(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1", THP_MEM_ALLOC_ENABLE=None))
    assert "without THP_MEM_ALLOC_ENABLE=1" in err, err
    err = _usage_error(monkeypatch, capsys, ["--thp", "on"], dict(NOT_LAUNCHED, THP_MEM_ALLOC_ENABLE="0"))
    assert "THP_MEM_ALLOC_ENABLE='0' is set" in err, err
