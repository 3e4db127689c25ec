"""Real jobs: ranks started by torch's elastic agent through neuronrun, talking over gloo.

Every rank writes its pid (and its child's) to a file so that tests can check,
without psutil, that nothing survives a failure or a signal.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import forked_neuronrun as forked
import pytest
from launcher_helpers import clean_env, free_port, neuronrun

pytest.importorskip("torch.distributed")

RANK_SCRIPT = textwrap.dedent('''
    import os, subprocess, sys, time
    piddir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    child = subprocess.Popen(["sleep", "120"])
    pidfile = os.path.join(piddir, f"{rank}.{restart}.pid")
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(pidfile + ".tmp", pidfile)
    env = {k: os.environ[k] for k in ("LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "NEURON_RT_VISIBLE_CORES",
           "NEURON_RT_NUM_CORES", "NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_ROOT_COMM_ID", "NEURON_DIST_INSTANCE")}
    env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    assert "NEURONRUN_PLAN" not in os.environ
    assert env["NEURON_RT_ROOT_COMM_ID"] == f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    print("env", sorted(env.items()), flush=True)
    last = rank == int(os.environ["WORLD_SIZE"]) - 1
    if mode == "graceful" and rank != 1:  # a checkpoint-and-exit SIGTERM handler: stopped ranks exit 1
        import signal
        signal.signal(signal.SIGTERM, lambda *_: (child.kill(), os._exit(1)))
    if (mode in ("fail", "kill", "flaky", "graceful", "term") and rank == 1 or mode == "fail_last" and last) \
            and restart == 0:
        # fail only once every rank is up and recorded
        while len([f for f in os.listdir(piddir) if f.endswith(".pid")]) < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.05)
    if mode == "allreduce":
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        print(f"sum={t.item():g} world={dist.get_world_size()}", flush=True)
        dist.destroy_process_group()
    elif mode == "fail" and rank == 1:
        print("rank 1 is about to fail", flush=True)
        print("ValueError: the root cause", file=sys.stderr, flush=True)
        sys.exit(7)
    elif mode == "fail_last" and last:
        sys.exit(7)
    elif mode == "graceful" and rank == 1:
        child.kill()
        sys.exit(3)
    elif mode == "kill" and rank == 1:
        os.kill(os.getpid(), 9)
    elif mode == "term" and rank == 1:  # stopped from outside (a scheduler, a person), not by the agent
        child.kill()
        os.kill(os.getpid(), 15)
    elif mode == "flaky" and rank == 1 and restart == 0:
        sys.exit(3)
    elif mode in ("fail", "kill", "hang", "fail_last", "graceful", "term"):
        time.sleep(120)
    child.kill()
    print(f"done restart={restart}", flush=True)
''')


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    return script, piddir


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(piddir: Path) -> list[int]:
    return [int(p) for f in piddir.glob("*.pid") for p in f.read_text().split()]


def assert_all_gone(piddir: Path, expected_files: int, within: float = 10.0) -> None:
    assert len(list(piddir.glob("*.pid"))) >= expected_files
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids(piddir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids(piddir) if alive(p)] == []


def wait_for_files(piddir: Path, n: int, proc: subprocess.Popen, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while len(list(piddir.glob("*.pid"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)


def test_two_ranks_allreduce_with_prefixed_output(job):
    script, piddir = job
    r = neuronrun(["--nproc-per-node", "2", "--instance", "trn1.32xlarge", "--cores-per-rank", "2",
                   str(script), str(piddir), "allreduce"])
    assert r.returncode == 0, r.stderr
    assert "[rank0]: sum=1 world=2" in r.stdout and "[rank1]: sum=1 world=2" in r.stdout
    assert "('NEURON_RT_VISIBLE_CORES', '2-3')" in r.stdout.split("[rank1]: env")[1].splitlines()[0]
    assert "('NEURON_DIST_INSTANCE', 'trn1.32xlarge')" in r.stdout
    assert r.stdout.count("('THP_MEM_ALLOC_ENABLE', '1')") == 2  # --thp on, the default
    assert_all_gone(piddir, 2)


def test_two_nodes_on_loopback_c10d(job):
    script, piddir = job
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "loopback", "--local-addr", "127.0.0.1",
            str(script), str(piddir), "allreduce"]
    nodes = [forked.popen(args) for _ in range(2)]
    outs = [p.communicate(timeout=90) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    stdout = "".join(o[0] for o in outs)
    assert sorted(line.split("]:")[0] for line in stdout.splitlines() if "sum=6 world=4" in line) == [
        "[rank0", "[rank1", "[rank2", "[rank3"]
    groups = sorted(line.split("('GROUP_RANK', '")[1][0] for line in stdout.splitlines() if " env " in line)
    assert groups == ["0", "0", "1", "1"]
    assert_all_gone(piddir, 4)


@pytest.mark.parametrize("mode, code, how", [("fail", 7, "exited with code 7"),
                                             ("kill", 128 + 9, "was killed by signal SIGKILL")])
def test_failing_rank_brings_the_job_down(job, mode, code, how):
    script, piddir = job
    t0 = time.monotonic()
    run = neuronrun if mode == "fail" else forked.run  # a fresh neuronrun for one case, a forked one for the other
    r = run(["--nproc-per-node", "2", "--shutdown-timeout", "5", str(script), str(piddir), mode])
    assert r.returncode == code, r.stderr
    assert time.monotonic() - t0 < 30
    assert "neuronrun: rank 1 (local rank 1, node 0, host " in r.stderr and how in r.stderr
    assert "then stopped: rank 0 (was killed by signal SIGTERM" in r.stderr
    if mode == "fail":
        assert "    ValueError: the root cause" in r.stderr and "    rank 1 is about to fail" in r.stderr
    assert_all_gone(piddir, 2)


@pytest.mark.parametrize("mode, code, how, others", [
    ("graceful", 3, "exited with code 3", "rank 0 (exited with code 1), rank 2 (exited with code 1)"),
    ("term", 128 + 15, "was killed by signal SIGTERM", "rank 0 (was killed by signal SIGTERM (15)), rank 2 ("),
])
def test_the_rank_that_failed_first_is_the_root_cause(job, mode, code, how, others):
    """The stopped ranks' failures land in the same whole second as the real one: neither a
    stopped rank's own exit code (graceful) nor rank 1's dying of SIGTERM itself (term) may hand
    the blame to rank 0."""
    script, piddir = job
    r = forked.run(["--nproc-per-node", "3", "--shutdown-timeout", "5", str(script), str(piddir), mode])
    assert r.returncode == code, r.stderr
    assert "neuronrun: rank 1 (local rank 1, node 0, host " in r.stderr and how in r.stderr, r.stderr
    assert "then stopped: " + others in r.stderr, r.stderr
    assert_all_gone(piddir, 3)


def test_a_rendezvous_that_times_out_says_too_few_nodes_came(job):
    """torch's RendezvousTimeoutError has no text: neuronrun said "the rendezvous failed
    (RendezvousTimeoutError: ); the node that holds its store may be gone", where the store was
    fine and the second node simply never came."""
    script, piddir = job
    r = forked.run(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{free_port()}", "--rdzv-id", "alone", "--rdzv-conf", "join_timeout=2",
                    str(script), str(piddir), "allreduce"], timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "neuronrun: the rendezvous timed out (RendezvousTimeoutError): fewer than 2 nodes (--nnodes) joined " \
           "it within its join time-out (--rdzv-conf join_timeout=SECONDS" in r.stderr, r.stderr[-3000:]
    assert "may be gone" not in r.stderr


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_node_whose_rendezvous_store_stopped_answering_ends_once_its_ranks_have(job, tmp_path):
    """The c10d store lives in node 0's neuronrun; node 0 stopped (SIGSTOP, as a node cut off by
    the network: TCP to it gets no answer). Node 1's agent blocked in the store, in torch's C++
    client, from its monitoring loop, and never saw its rank fail: node 1 ran on forever (a
    reviewer's partitioned node, 7 minutes). It now waits while its rank runs, and once none
    runs and a store call has waited past the store's read_timeout it says so and exits 1,
    leaving no process and its directories as any failure does."""
    script, piddir = job
    port = free_port()
    cmd = ["--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stopped",
           "--local-addr", "127.0.0.1", "--rdzv-conf", "read_timeout=3", str(script), str(piddir), "hang"]
    tmps = [tmp_path / "tmp0", tmp_path / "tmp1"]  # each node's neuronrun directories
    procs = []
    try:
        for tmp in tmps:  # node 0 first: it holds the store
            tmp.mkdir()
            procs.append(forked.popen(cmd, env=clean_env(TMPDIR=str(tmp))))
            deadline = time.monotonic() + 60
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()
                time.sleep(0.05)
        host, node = procs
        wait_for_files(piddir, 2, node)
        ranks = {parent(int(f.read_text().split()[0])): f for f in piddir.glob("*.pid")}
        for pid in (host.pid, *map(int, ranks[host.pid].read_text().split())):
            os.kill(pid, signal.SIGSTOP)
        time.sleep(4)  # past read_timeout: node 1's agent is blocked in the store, and its rank runs
        assert node.poll() is None, node.communicate()
        rank_pid = int(ranks[node.pid].read_text().split()[0])
        os.kill(rank_pid, signal.SIGKILL)  # the rank fails (its child is left to neuronrun's sweep)
        _, err = node.communicate(timeout=20)
    finally:
        for proc in procs:
            proc.kill()
        for pid in pids(piddir):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            proc.communicate()
    assert node.returncode == 1, err[-3000:]
    rank = ranks[node.pid].name.split(".")[0]
    assert f"neuronrun: the rendezvous store at 127.0.0.1:{port} stopped answering (a call to it has waited " in err
    assert "--rdzv-conf read_timeout=3; its node may be cut off or stopped) and no rank of this node is running " \
           f"(rank {rank} " in err, err[-3000:]
    assert [p for p in map(int, ranks[node.pid].read_text().split()) if alive(p)] == []
    assert [p.name for p in tmps[1].glob("neuronrun_groups_*")] == []


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_ctrl_c_while_a_node_waits_for_the_others_ends_it(job, backend):
    """A node of a two-node job waits in the rendezvous, in torch's C++ store, where Python's
    Ctrl-C handler never runs: SIGINT was lost (the node went on waiting, and ran the job when
    the other node came). It now ends neuronrun at once, as SIGTERM does (status 130)."""
    script, piddir = job
    port = free_port()
    how = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "sigint"] \
        if backend == "c10d" else ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    proc = subprocess.Popen([sys.executable, "-m", "neuronrun_launcher.run", "--nnodes", "2", "--nproc-per-node", "1",
                             *how, str(script), str(piddir), "allreduce"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the rendezvous listens: the node is then waiting for the other
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), (proc.returncode, err[-3000:])
    assert not list(piddir.iterdir()), "a rank started"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signals_to_neuronrun_leave_no_orphans(job, sig, tmp_path):
    script, piddir = job
    tmp = tmp_path / "tmp"  # neuronrun's own directories (rank logs, process groups) go here
    tmp.mkdir()
    args = ["--nproc-per-node", "2", "--shutdown-timeout", "5", str(script), str(piddir), "hang"]
    if sig == signal.SIGINT:  # a fresh neuronrun
        proc = subprocess.Popen([sys.executable, "-m", "neuronrun_launcher.run", *args], env=clean_env(TMPDIR=str(tmp)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        proc = forked.popen(args, env=clean_env(TMPDIR=str(tmp)))
    wait_for_files(piddir, 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    if sig == signal.SIGKILL:
        # Ranks die with the agent (PR_SET_PDEATHSIG); their own children are the program's business.
        time.sleep(0.5)
        ranks = [int(f.read_text().split()[0]) for f in piddir.glob("*.pid")]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in ranks if alive(p)] == []
        for p in pids(piddir):  # the grandchildren were orphaned: clean them up
            if alive(p):
                os.kill(p, signal.SIGKILL)
        return
    assert proc.returncode == 128 + sig, err
    assert f"received {sig.name}, stopped every rank" in err
    assert_all_gone(piddir, 2)
    assert [p.name for p in tmp.glob("neuronrun_*")] == []  # the output was on the terminal too (--tee 3)


@pytest.mark.parametrize("flags, ends", [(["--local-ranks-filter", "0"], "signal"),
                                          (["--redirects", "3"], "success")])
def test_output_that_went_only_to_files_is_kept(job, tmp_path, flags, ends):
    """Rank 1's output under --local-ranks-filter 0, or every rank's under --redirects 3, exists
    only in neuronrun's log directory: it was deleted at a signal, or when the job succeeded."""
    script, piddir = job
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mode = "hang" if ends == "signal" else "ok"
    proc = forked.popen(["--nproc-per-node", "2", *flags, "--shutdown-timeout", "5", str(script), str(piddir), mode],
                        env=clean_env(TMPDIR=str(tmp)))
    if ends == "signal":
        wait_for_files(piddir, 2, proc)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (128 + 15 if ends == "signal" else 0), err
    kept = [p for p in tmp.glob("neuronrun_*") if not p.name.startswith("neuronrun_groups_")]
    assert len(kept) == 1 and f"the output that went only to files is in {kept[0]}" in err, (err, kept)
    assert any("env" in f.read_text() for f in kept[0].rglob("stdout.log")), list(kept[0].rglob("*"))


def test_max_restarts_restarts_the_group(job):
    script, piddir = job
    r = forked.run(["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
                    str(script), str(piddir), "flaky"])
    assert r.returncode == 0, r.stderr
    assert "[rank0]: done restart=1" in r.stdout and "[rank1]: done restart=1" in r.stdout
    assert {f.name for f in piddir.glob("*.pid")} == {"0.0.pid", "1.0.pid", "0.1.pid", "1.1.pid"}
    assert_all_gone(piddir, 4)


def test_failure_report_names_the_node_when_nodes_differ_in_size(job):
    """Node 0 runs 2 ranks, node 1 runs 1 (torch's agent allows it): the failing rank 2 is on
    node 1, which the report used to give as rank // nproc_per_node = node 2."""
    script, piddir = job
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--shutdown-timeout", "5"]
    procs = []
    for node, nproc in ((0, 2), (1, 1)):
        procs.append(forked.popen([*common, "--node-rank", str(node), "--nproc-per-node", str(nproc), str(script),
                                   str(piddir), "fail_last"]))
    out, err = procs[1].communicate(timeout=120)
    procs[0].terminate()  # its ranks sleep; nothing tells node 0 that node 1 has ended
    procs[0].communicate(timeout=60)
    assert procs[1].returncode == 7, err[-3000:]
    assert "neuronrun: rank 2 (local rank 0, node 1, host " in err, err[-3000:]
    assert_all_gone(piddir, 3)


@pytest.mark.parametrize("flags, ends", [(["-r", "1", "-t", "1"], "success"), (["-r", "3", "-t", "0:3,1:3"], "success"),
                                          (["-t", "0", "--local-ranks-filter", "1"], "success"),
                                          (["-r", "1", "-t", "1"], "signal")])
def test_output_that_also_reached_the_terminal_is_not_said_to_be_only_in_files(job, tmp_path, flags, ends):
    """Redirected and teed (-r 1 -t 1) every line also reached the terminal; a rank left out by
    --local-ranks-filter with nothing redirected wrote to /dev/null. neuronrun decided from the
    flags' text, said "the output that went only to files is in DIR" and kept DIR (empty in the
    last case)."""
    script, piddir = job
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = forked.popen(["--nproc-per-node", "2", *flags, "--shutdown-timeout", "5", str(script), str(piddir),
                         "hang" if ends == "signal" else "ok"], env=clean_env(TMPDIR=str(tmp)))
    if ends == "signal":
        wait_for_files(piddir, 2, proc)
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == (128 + 15 if ends == "signal" else 0), err
    assert "only to files" not in err and list(tmp.iterdir()) == [], (err, list(tmp.rglob("*")))
    if "--local-ranks-filter" not in flags:
        assert "[rank0]: env" in out and "[rank1]: env" in out, out


def test_the_failed_ranks_error_reaches_neuronruns_own_error_file(tmp_path):
    """torchrun copies the error file that the root-cause rank's @record wrote to its own
    $TORCHELASTIC_ERROR_FILE (what an outer launcher or a scheduler reads); neuronrun left it
    unwritten."""
    script = tmp_path / "raise.py"
    script.write_text(textwrap.dedent('''
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise ValueError("the root cause")

        main()
    '''))
    parent = tmp_path / "parent.json"
    r = forked.run(["--nproc-per-node", "1", str(script)], env=clean_env(TORCHELASTIC_ERROR_FILE=str(parent)),
                   timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert parent.is_file(), r.stderr[-3000:]
    message = json.loads(parent.read_text())["message"]
    assert "ValueError: the root cause" in json.dumps(message), message


def test_a_python_exec_wrappers_interpreter_options_reach_the_rank(tmp_path):
    """torchrun starts each rank as `$PYTHON_EXEC -u script`; neuronrun ran its trampoline under
    $PYTHON_EXEC, which then exec'd a plain interpreter: a wrapper's -X and -W options were lost."""
    wrapper = tmp_path / "pywrap.sh"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -X faulthandler -W error::DeprecationWarning '
                       '"$@"\n')
    wrapper.chmod(0o755)
    script = tmp_path / "flags.py"
    script.write_text("import faulthandler, sys\nprint('faulthandler', faulthandler.is_enabled(), sys.warnoptions)\n")
    r = forked.run(["--nproc-per-node", "1", str(script)], env=clean_env(PYTHON_EXEC=str(wrapper)), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[rank0]: faulthandler True ['error::DeprecationWarning']" in r.stdout, r.stdout


def test_an_agent_error_leaves_no_empty_log_directory(tmp_path):
    """A --master-port in use is torch's error (EADDRINUSE from the store), raised before any
    rank starts: neuronrun left its empty neuronrun_* log directory in $TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = forked.run(["--nproc-per-node", "1", "--master-port", str(port), "t.py"], env=clean_env(TMPDIR=str(tmp)),
                       timeout=120)
    assert r.returncode != 0, r.stderr[-3000:]
    assert list(tmp.iterdir()) == [], r.stderr[-3000:]
    assert f"port {port} is taken on this node" in r.stderr and "may be gone" not in r.stderr, r.stderr[-3000:]


def test_ranks_that_failed_without_a_word_leave_no_log_directory(tmp_path):
    """Every failed job kept its neuronrun_* log directory, one more in $TMPDIR per failure,
    also when its files were all empty: the report says the rank "wrote nothing" and names no
    file in it. A failure that wrote something keeps it (the report's paths point there)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    for words, kept in (("", False), ("print('the cause', flush=True); ", True)):
        script = tmp_path / "silent.py"
        script.write_text(f"import os, signal\n{words}os.kill(os.getpid(), signal.SIGKILL)\n")
        r = forked.run(["--nproc-per-node", "1", str(script)], env=clean_env(TMPDIR=str(tmp)), timeout=120)
        assert r.returncode == 128 + 9, r.stderr[-3000:]
        assert ("(it wrote nothing to stdout or stderr)" in r.stderr) != kept, r.stderr[-3000:]
        left = [p for p in tmp.iterdir() if p.name.startswith("neuronrun_")]
        assert len(left) == kept, (left, r.stderr[-3000:])
        if kept:
            assert str(left[0]) in r.stderr, r.stderr[-3000:]  # where the report's lines come from


def test_a_silent_job_under_redirects_names_no_removed_log_directory(tmp_path):
    """Under --redirects 3 a job whose ranks wrote nothing ended with "the output that went only
    to files is in neuronrun_...", a directory its cleanup had removed (its files all empty)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "quiet.py"
    script.write_text("")
    r = forked.run(["--nproc-per-node", "1", "--redirects", "3", str(script)], env=clean_env(TMPDIR=str(tmp)),
                   timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p for p in tmp.iterdir() if p.name.startswith("neuronrun_")] == [], r.stderr[-3000:]
    assert "went only to files" not in r.stderr, r.stderr[-3000:]


def test_ctrl_c_before_the_ranks_start_leaves_no_directories(tmp_path):
    """Ctrl-C as soon as neuronrun made its directories (it made them before importing torch,
    about a second, and outside its cleanup) left neuronrun_* and neuronrun_groups_* in $TMPDIR.
    (On a loaded host the signal may land where torch's rendezvous takes it for a failure and
    retries, as under torchrun: the job then runs its 3 s and ends; either way nothing is left.
    tempfile's own probe of $TMPDIR, interrupted, may leave a file of its own: not neuronrun's.)"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(3)\n")
    proc = subprocess.Popen([sys.executable, "-m", "neuronrun_launcher.run", "--nproc-per-node", "1",
                             "--shutdown-timeout", "5", str(script)],
                            env=clean_env(TMPDIR=str(tmp)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(tmp.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("neuronrun")] == [], err[-3000:]


def _mpirun() -> str | None:
    return shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


def test_the_users_own_mpi_settings_reach_the_rank(tmp_path):
    """neuronrun dropped every OMPI_/PMIX_/PMI_/OPAL_/PRTE_ variable from each rank, the user's own
    Open MPI configuration too, even when no MPI launcher had started it: as root, with
    OMPI_ALLOW_RUN_AS_ROOT* exported, a rank's own `mpirun -np 1 hostname` exited 1 ("prterun has
    detected an attempt to run as root") where it runs under torchrun. Only an MPI launcher's
    per-process variables, and only under one, are dropped (worker.MPI_PROCESS_VARS)."""
    mine = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,vader,tcp",
            "OMPI_MCA_orte_base_help_aggregate": "0", "PMIX_MCA_gds": "hash", "OPAL_PREFIX": sys.prefix}
    script = tmp_path / "mpichild.py"
    script.write_text(textwrap.dedent('''
        import os, subprocess, sys
        print("mpi vars", sorted((k, v) for k, v in os.environ.items() if k.startswith(("OMPI_", "PMIX_", "OPAL_"))))
        if sys.argv[1:]:
            r = subprocess.run([sys.argv[1], "-np", "1", "hostname"], capture_output=True, text=True, timeout=60)
            print("mpirun rc", r.returncode, (r.stdout + r.stderr).strip().splitlines()[:2], flush=True)
    '''))
    mpirun = _mpirun()
    r = forked.run(["--nproc-per-node", "1", str(script), *([mpirun] if mpirun else [])], env=clean_env(**mine),
                   timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[rank0]: mpi vars {sorted(mine.items())}" in r.stdout, r.stdout[-3000:]
    if mpirun:
        assert "[rank0]: mpirun rc 0" in r.stdout, r.stdout[-3000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not installed")
def test_a_one_process_mpirun_runs_every_rank(tmp_path):
    """`mpirun -np 1 neuronrun --nproc-per-node 2 script` on one node was refused ("under mpi the
    address of node 0 is unknown") where `mpirun -np 1 torchrun --nproc-per-node 2` runs both ranks:
    one MPI process is one node, at the default address."""
    script = tmp_path / "argv.py"
    script.write_text("import os, sys\nprint('ARGV', os.environ['RANK'], sys.argv[1:], flush=True)\n")
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [_mpirun(), "-np", "1", *extra, "--bind-to", "none", sys.executable, "-m", "neuronrun_launcher.run",
           "--nproc-per-node", "2", str(script), "x"]
    r = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: ARGV {rank} ['x']" in r.stdout, (r.stdout + r.stderr)[-3000:]
