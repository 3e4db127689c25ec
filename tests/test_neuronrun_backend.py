"""neuronrun with the neuron backend end to end: the README's main job, and two neuronrun
"nodes" x 2 ranks on loopback whose backend topology matches the launcher's placement."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher"))
import forked_neuronrun as forked  # noqa: E402
from launcher_helpers import REPO, free_port, neuronrun  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "neuronrun_job.py")


def test_main_job_ddp_example():
    r = neuronrun(["--nproc-per-node", "2", str(REPO / "examples" / "ddp_train.py"), "--steps", "12"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 12 steps on 2 ranks (neuron)" in r.stdout, r.stdout[-2000:]


def test_two_nodes_on_loopback_neuron_backend():
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nd",
            "--local-addr", "127.0.0.1", "--instance", "trn1.32xlarge", JOB]
    nodes = [forked.popen(args) for _ in range(2)]  # two neuronrun processes forked from one that imported torch
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    lines = [l for o in outs for l in o[0].splitlines() if "sum=6 world=4" in l]
    assert len(lines) == 4, outs
    assert all("nodes=2" in l for l in lines), lines
    assert sorted(l.split("node=")[1].split()[0] for l in lines) == ["0", "0", "1", "1"], lines


BOUND_JOB = """
import os, torch, torch.distributed as dist, neuron_dist
dist.init_process_group("neuron")
t = torch.ones(8)
dist.all_reduce(t)
shm = dist.distributed_c10d._get_default_group().group.transport
print("bound", int(os.environ["LOCAL_RANK"]), sorted(os.sched_getaffinity(0)), shm.oversubscribed, t.sum().item(),
      os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), flush=True)
dist.destroy_process_group()
"""


def test_cpu_bind_core_places_each_rank_on_its_own_cpus(tmp_path):
    """--cpu-bind core: each rank runs on its own share of the CPUs, and the shared-memory
    transport still sees the job's CPUs together (bound to one core each, two ranks on two
    cores are not oversubscribed: they spin before sleeping, instead of yielding)."""
    script = tmp_path / "bound.py"
    script.write_text(BOUND_JOB)
    r = forked.run(["--cpu-bind", "core", "--nproc-per-node", "2", str(script)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    from neuronrun_launcher.plan import rank_cpus
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    got = {}
    for line in r.stdout.splitlines():
        if "bound " in line:
            local, rest = line.split("bound ", 1)[1].split(" ", 1)
            got[int(local)] = rest
    union = set(rank_cpus(cpus, 0, 2)) | set(rank_cpus(cpus, 1, 2))
    for local in (0, 1):
        share = rank_cpus(cpus, local, 2)  # OMP_NUM_THREADS unset: one intra-op thread per CPU of the share
        assert got[local] == f"{list(share)} {2 > len(union)} 16.0 {len(share)} {len(share)}", r.stdout


RESTART_JOB = """
import os, sys, torch, torch.distributed as dist, neuron_dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("neuron")
t = torch.ones(4)
dist.all_reduce(t)
if attempt == 0 and dist.get_rank() == 1:
    sys.exit(3)  # fails after the group is up: the store keeps this attempt's keys
dist.all_reduce(t)
print("attempt", attempt, "rank", dist.get_rank(), "sum", t.sum().item(), flush=True)
dist.destroy_process_group()
"""


def test_a_restarted_attempt_builds_a_fresh_group(tmp_path):
    """--max-restarts: torch's agent keeps its store across attempts, so attempt 1's group must
    not read attempt 0's keys (it used to map attempt 0's dead shared-memory segment and fail
    with FileNotFoundError, or over TCP send to attempt 0's dead endpoints and time out). The
    attempt number in the keys no longer keeps that apart alone: attempt 0's group formed, so
    every member counted it in the store (`_generation`), and attempt 1's group is the next
    generation even under attempt 0's number (this job passed with the number fixed at 0). A
    group's setup records are written only once all its members have counted it, so no later
    group reads them; the number still matters where attempt 0's group never formed (next test)."""
    script = tmp_path / "restart.py"
    script.write_text(RESTART_JOB)
    r = forked.run(["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1", str(script)],
                   timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(l.split("]: ", 1)[-1] for l in r.stdout.splitlines() if "attempt 1 rank" in l)
    assert lines == ["attempt 1 rank 0 sum 16.0", "attempt 1 rank 1 sum 16.0"], r.stdout[-2000:]


HALF_FORMED_JOB = """
import os, sys, threading, time, torch, torch.distributed as dist, neuron_dist
from datetime import timedelta
flag = sys.argv[1]
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 0 and rank == 1:  # fails before its init, once rank 0 has counted the group in the store
    while not os.path.exists(flag):
        time.sleep(0.01)
    sys.exit(3)
if attempt == 0:  # the flag: rank 0 is past the count, waiting for rank 1 (its agent kills it there)
    main = threading.main_thread().ident
    def watch():
        while True:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code.co_name != "_agree_on_members":
                frame = frame.f_back
            if frame is not None:
                open(flag, "w").close()
                return
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
dist.init_process_group("neuron", timeout=timedelta(seconds=20))
t = torch.ones(4)
dist.all_reduce(t)
print("attempt", attempt, "rank", rank, "sum", t.sum().item(), flush=True)
dist.destroy_process_group()
"""


def test_a_restart_after_a_group_that_never_formed_forms_its_own(tmp_path):
    """Attempt 0's rank 1 fails before its init_process_group while rank 0 waits for it inside
    the group's meeting, where its agent kills it: the store's count of that group (`_generation`)
    is left short of its members, and nobody retires it. Attempt 1's ranks must meet afresh: the
    attempt number keeps their count apart. With the number fixed at 0 they continued the short
    count: one rank met in attempt 0's half-formed generation (where attempt 0's rank 0 had posted
    its member list), the other in the next, and the group failed at its time-out ("global ranks
    [1] did not join within 20s"), the restart spent."""
    script = tmp_path / "half_formed.py"
    script.write_text(HALF_FORMED_JOB)
    r = forked.run(["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1", str(script),
                    str(tmp_path / "rank0-counted")], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(l.split("]: ", 1)[-1] for l in r.stdout.splitlines() if "attempt 1 rank" in l)
    assert lines == ["attempt 1 rank 0 sum 8.0", "attempt 1 rank 1 sum 8.0"], r.stdout[-2000:]


NODE_RESTART_JOB = """
import os, sys, time, torch, torch.distributed as dist, neuron_dist
flag = sys.argv[1]
first_round = not os.path.exists(flag)
dist.init_process_group("neuron")
t = torch.ones(4)
dist.all_reduce(t)
if first_round and dist.get_rank() == 1:
    open(flag, "w").close()
    sys.exit(3)  # once in the job, after the group is up: the store holds this round's keys
if first_round:  # rank 0 idles until its agent restarts it for the new round (a membership change)
    time.sleep(60)
dist.all_reduce(t)
print("round done: rank", dist.get_rank(), "sum", t.sum().item(), flush=True)
dist.destroy_process_group()
"""


def test_a_rank_failing_on_one_node_costs_one_restart_round_not_two():
    """c10d rendezvous over two nodes, one rank failing once. Its node's restart count rises; the
    other node's ranks restart for the membership change with their count unchanged. The agents
    share one store across rounds, so the other node's new ranks met the failed round's keys (the
    backend's carried the restart count, which now differed), failed on its dead segment ("no
    shared memory with rank 1"), and spent a restart of their own: a third round, or with no
    restart left, a failed job. neuronrun now gives each round a fresh store (torch's
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and the backend keys on the count only where the store
    is shared."""
    import tempfile
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "job.py")
        with open(script, "w") as f:
            f.write(NODE_RESTART_JOB)
        cmd = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart",
               "--local-addr", "127.0.0.1", "--max-restarts", "1", "--monitor-interval", "0.1", script,
               os.path.join(d, "failed-once")]
        nodes = [forked.popen(cmd) for _ in range(2)]
        outs = [p.communicate(timeout=150) for p in nodes]
    err = "".join(o[1] for o in outs)
    assert [p.returncode for p in nodes] == [0, 0], err[-4000:]
    lines = sorted(l.split("]: ", 1)[-1] for o in outs for l in o[0].splitlines() if "round done" in l)
    assert lines == ["round done: rank 0 sum 16.0", "round done: rank 1 sum 16.0"], outs
    failed = [l for l in err.splitlines() if "failed (exitcode" in l]
    assert len(failed) == 1 and "exitcode: 3" in failed[0], err[-6000:]  # the one deliberate failure only
