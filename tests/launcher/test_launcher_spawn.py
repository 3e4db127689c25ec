"""Exact argv and environment of every rank, through torch's real elastic agent, with the spawner mocked.

``start_processes`` (what LocalElasticAgent calls to start ranks) is replaced by a
recorder; the agent, rendezvous and our launch code run for real. Each recorded
rank environment is then passed through the worker trampoline's ``rank_env`` and
``command``, which is exactly what the rank's program would see after ``exec``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import pytest
from launcher_helpers import free_port

from neuronrun_launcher import launch, worker
from neuronrun_launcher.dryrun import rank_table
from neuronrun_launcher.run import config_from_argv

torch_agent = pytest.importorskip("torch.distributed.elastic.agent.server.local_elastic_agent")
from torch.distributed.elastic.multiprocessing.api import RunProcsResult  # noqa: E402

TORCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


class Recorder:
    """Stands in for torch.distributed.elastic.multiprocessing.start_processes."""

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, name, entrypoint, args, envs, logs_specs, **kwargs):
        # What the agent's SubprocessHandler would pass to Popen: os.environ updated by the rank's env.
        spawned = {lr: (entrypoint, args[lr], {**os.environ, **envs[lr]}) for lr in envs}
        with self.lock:
            self.calls.append(spawned)
        return FakeContext(envs)

    def ranks(self):
        """Per global rank: (argv after exec, environment after exec)."""
        out = {}
        for call in self.calls:
            for entry, args, env in call.values():
                assert entry == sys.executable and args[:2] == ("-u", launch.WORKER)
                assert env[worker.AGENT_VAR] == str(os.getpid())  # the agent: this process
                final = worker.rank_env(env)
                assert worker.AGENT_VAR not in final and worker.GROUPS_VAR not in final  # launcher-only
                out[int(final["RANK"])] = (worker.command(args[2], args[3], list(args[4:]), sys.executable), final)
        return out


class FakeContext:
    def __init__(self, envs):
        self._pids = {lr: 4_000_000 + lr for lr in envs}

    def pids(self):
        return self._pids

    def wait(self, timeout=-1, period=1):
        return RunProcsResult(return_values=dict.fromkeys(self._pids))

    def close(self, death_sig=None, timeout=30):
        pass


@pytest.fixture(autouse=True)
def _torchs_tail_restored(monkeypatch):
    """launch() replaces torch's tail_log.tail_logfile (the agent's output copier) with
    tail.tail_whole_lines for good; an in-process launch left it replaced in this test process,
    and test_launcher_output's check of torch's own tail, run later in the same process, then
    tested neuronrun's instead (and failed)."""
    from torch.distributed.elastic.multiprocessing import tail_log

    monkeypatch.setattr(tail_log, "tail_logfile", tail_log.tail_logfile)


@pytest.fixture
def recorder(monkeypatch, scrubbed_environ):
    rec = Recorder()
    monkeypatch.setattr(torch_agent, "start_processes", rec)
    for var in ("OMP_NUM_THREADS", "NEURONRUN_PLAN", "NEURONRUN_GROUPS_DIR"):  # launch() sets these; restore them afterwards
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return rec


def _launch_nodes(argv_for_node, nnodes):
    """Run one real agent per node, in threads (signal handlers are skipped off the main thread)."""
    codes, errors = {}, []

    def node(n):
        try:
            codes[n] = launch.launch(config_from_argv(argv_for_node(n), dict(os.environ)))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert codes == dict.fromkeys(range(nnodes), 0)


CASES = {
    # name: (flags, expected visible cores per local rank, lnc, cores per rank, instance)
    "trn2-lnc2": (["--nproc-per-node", "4"], ["0", "1", "2", "3"], "2", "1", "trn2.48xlarge"),
    "trn2-lnc1-4pr": (["--lnc", "1", "--cores-per-rank", "4", "--nproc-per-node", "3"], ["0-3", "4-7", "8-11"],
                      "1", "4", "trn2.48xlarge"),
    "trn1-2pr": (["--instance", "trn1.32xlarge", "--cores-per-rank", "2", "--nproc-per-node", "2"],
                 ["0-1", "2-3"], "1", "2", "trn1.32xlarge"),
    "inf2-auto": (["--instance", "inf2.24xlarge", "--nproc-per-node", "auto", "--cores-per-rank", "4"],
                  ["0-3", "4-7", "8-11"], "1", "4", "inf2.24xlarge"),
}


# inf2 is a single-instance model: its 2-node form is a config error, tested in test_launcher_config
@pytest.mark.parametrize("case,nnodes", [(c, n) for c in CASES for n in (1, 2)
                                         if n == 1 or not CASES[c][4].startswith("inf2")])
def test_every_rank_argv_and_env(recorder, case, nnodes):
    flags, cores, lnc, m, inst = CASES[case]
    port = free_port()
    script = ["train.py", "--epochs", "2"]
    if nnodes == 1:
        node_argv = lambda n: [*flags, "--max-restarts", "1", *script]  # noqa: E731
    else:
        node_argv = lambda n: ["--nnodes", str(nnodes), "--node-rank", str(n), "--master-addr", "127.0.0.1",  # noqa: E731
                               "--master-port", str(port), "--rdzv-id", "job1", "--max-restarts", "1", *flags, *script]
    _launch_nodes(node_argv, nnodes)
    ranks = recorder.ranks()
    nproc = len(cores)
    world = nproc * nnodes
    assert sorted(ranks) == list(range(world))
    master = {ranks[r][1]["MASTER_ADDR"] + ":" + ranks[r][1]["MASTER_PORT"] for r in ranks}
    assert len(master) == 1
    (master,) = master
    host, mport = master.rsplit(":", 1)
    if nnodes > 1:
        assert master == f"127.0.0.1:{port}"
    for rank, (argv, env) in ranks.items():
        lr, node = rank % nproc, rank // nproc
        assert argv == [sys.executable, "-u", "train.py", "--epochs", "2"]
        assert {k: env[k] for k in TORCH_KEYS} == {
            "RANK": str(rank), "LOCAL_RANK": str(lr), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nnodes), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": host, "MASTER_PORT": mport,
            "TORCHELASTIC_RUN_ID": env["TORCHELASTIC_RUN_ID"], "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "1",
        }
        assert {k: v for k, v in env.items() if k.startswith("NEURON")} == {
            "NEURON_RT_VISIBLE_CORES": cores[lr],
            "NEURON_RT_NUM_CORES": m,
            "NEURON_LOGICAL_NC_CONFIG": lnc,
            "NEURON_RT_ROOT_COMM_ID": f"{host}:{int(mport) + 1}",
            "NEURON_DIST_INSTANCE": inst,
        }
        if nproc > 1:
            assert env["OMP_NUM_THREADS"] == "1"
        assert not [k for k in env if k.startswith("NEURONRUN_")]
    if nnodes > 1:  # --dry-run promises the same environment the agent produces (static rendezvous)
        dry = rank_table(config_from_argv(node_argv(0), {}))
        for fields, denv in dry:
            real = ranks[int(fields["rank"])][1]
            assert {k: real[k] for k in denv if k != "TORCHELASTIC_RUN_ID"} == {
                k: v for k, v in denv.items() if k != "TORCHELASTIC_RUN_ID"}


def test_module_and_no_python_argv(recorder):
    _launch_nodes(lambda n: ["--nproc-per-node", "2", "-m", "pkg.train", "x"], 1)
    assert {r: a for r, (a, _) in recorder.ranks().items()} == {
        r: [sys.executable, "-u", "-m", "pkg.train", "x"] for r in (0, 1)}
    recorder.calls.clear()
    _launch_nodes(lambda n: ["--nproc-per-node", "1", "--no-python", "/bin/echo", "hi"], 1)
    assert recorder.ranks()[0][0] == ["/bin/echo", "hi"]


def _launch_failing_with(monkeypatch, exc, argv=("--nproc-per-node", "2", "train.py")) -> int:
    """neuronrun's exit status when torch's elastic launch raises `exc`."""
    import torch.distributed.launcher.api as launcher_api

    def failing(config, entrypoint):
        def run(*args):
            raise exc
        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", failing)
    for var in ("OMP_NUM_THREADS", "NEURONRUN_PLAN", "NEURONRUN_GROUPS_DIR"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return launch.launch(config_from_argv(list(argv), dict(os.environ)))


@pytest.mark.parametrize("nth", [1, 2])
def test_a_ctrl_c_as_a_directory_is_made_leaves_nothing(monkeypatch, scrubbed_environ, tmp_path, nth):
    """A Ctrl-C landing inside tempfile.mkdtemp, after its mkdir and before the name reached
    launch(), left the directory in $TMPDIR (test_ctrl_c_before_the_ranks_start_leaves_no_directories
    caught it under load, 1 run in 4). The signal is stood in for by a KeyboardInterrupt raised
    as the nth of neuronrun's directories (its log directory, then the groups directory) is made."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_mkdir, made = os.mkdir, []

    def mkdir_then_ctrl_c(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if os.path.basename(path).startswith("neuronrun"):
            made.append(path)
            if len(made) == nth:
                raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", mkdir_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        _launch_failing_with(monkeypatch, AssertionError("the job must not start"))
    assert len(made) == nth and list(tmp_path.iterdir()) == []


def test_a_lost_rendezvous_is_a_report_not_a_traceback(monkeypatch, scrubbed_environ, capsys):
    """When the node that holds the c10d rendezvous store dies, torch's agent on the other node
    raises RendezvousConnectionError; neuronrun printed torch's traceback. It now says what
    failed and exits 1."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    code = _launch_failing_with(monkeypatch, RendezvousConnectionError("The connection to the C10d store has failed."))
    err = capsys.readouterr().err
    assert code == 1, err
    assert "neuronrun: the rendezvous failed (RendezvousConnectionError: The connection to the C10d store" in err, err


def test_a_lost_static_rendezvous_store_is_a_report_not_a_traceback(monkeypatch, scrubbed_environ, capsys):
    """With static rendezvous the store is node 0's agent's: when node 0 died during a restart,
    node 1's agent raised DistNetworkError ("Broken pipe") and neuronrun printed torch's
    traceback. It now says what failed and exits 1."""
    from torch.distributed import DistNetworkError
    code = _launch_failing_with(monkeypatch, DistNetworkError("Broken pipe\nException raised from sendBytes ..."))
    err = capsys.readouterr().err
    assert code == 1, err
    assert "neuronrun: the rendezvous store failed (DistNetworkError: Broken pipe); the node that holds it" in err, err


@pytest.mark.parametrize("argv, flag", [
    (["--nproc-per-node", "1", "--master-port", "34050", "train.py"], "--master-port"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:34050", "train.py"], "--rdzv-endpoint"),
])
def test_a_rendezvous_port_in_use_on_this_node_says_so(monkeypatch, scrubbed_environ, capsys, argv, flag):
    """Node 0's agent hosts the static rendezvous' store: when its port is taken on this node,
    torch raises DistNetworkError EADDRINUSE, and neuronrun said "the node that holds it (node 0,
    --master-addr) may be gone" of the node it runs on. It now says the port is taken here and
    which flag moves it."""
    from torch.distributed import DistNetworkError
    code = _launch_failing_with(monkeypatch, DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 34050, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"), argv)
    err = capsys.readouterr().err
    assert code == 1, err
    assert "name: EADDRINUSE, message: address already in use): port 34050 is taken on this node" in err, err
    assert f"pass another {flag}; no rank was started" in err and "may be gone" not in err, err


def test_node_0_alone_in_a_static_rendezvous_says_the_others_never_came(monkeypatch, scrubbed_environ, capsys):
    """Node 0 holds the static rendezvous's store: its time-out waiting for the other nodes
    (torch's DistStoreError "waiting for clients") is too few nodes, not a store gone away (a
    re-read's finding: the line above named the store's node, itself, as maybe gone)."""
    from torch.distributed import DistStoreError
    code = _launch_failing_with(
        monkeypatch, DistStoreError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."),
        ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--nproc-per-node", "1", "train.py"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "neuronrun: the rendezvous timed out (DistStoreError: Timed out after 6 seconds waiting for clients. " \
           "1/2 clients joined.): fewer than 2 nodes (--nnodes) joined it" in err and "may be gone" not in err, err


def _trampoline_check(agent: str | None) -> int:
    """Exit status of a process that runs the rank trampoline's parent check with
    NEURONRUN_AGENT_PID set to `agent` (None: unset)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != worker.AGENT_VAR}
    if agent is not None:
        env[worker.AGENT_VAR] = agent
    code = "from neuronrun_launcher.worker import _die_with_parent; _die_with_parent(); print('alive')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode == 0) == ("alive" in p.stdout), p
    return p.returncode


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_checks_for_the_agent_it_was_started_by():
    """The trampoline leaves at once if the agent died before its death signal was set (its
    parent is then another process); it took "my parent is pid 1" for that sign, so every rank
    of a neuronrun that is itself pid 1 (a container's command) exited with code 1 before the
    user's script ran. The launcher now names the agent's pid."""
    assert _trampoline_check(str(os.getpid())) == 0  # started by the agent named: runs
    assert _trampoline_check("1") == 1               # (its parent is not pid 1 here): leaves
    assert _trampoline_check(None) == 0              # no agent named, parent not pid 1: runs


def test_the_sweep_kills_a_ranks_leftovers_but_not_a_process_given_its_pid(tmp_path):
    """sweep_groups SIGKILLs the process groups of ranks that ended (their children would
    outlive the job), named by the rank's pid; a pid the kernel gave to another job's process
    since (a session leader too, as every torch-agent rank is) is not the rank's: its start
    time differs from the one the rank recorded, and it is left alone."""
    import subprocess
    import time

    def session():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)

    ours, other = session(), session()
    try:
        (tmp_path / str(ours.pid)).write_text(worker.start_time(ours.pid))
        (tmp_path / str(other.pid)).write_text("1")  # the start time of the rank that had this pid
        launch.sweep_groups(str(tmp_path))
        assert ours.wait(timeout=10) == -9
        time.sleep(0.2)
        assert other.poll() is None, "a process that only reused a rank's pid was killed"
        assert not list(tmp_path.iterdir())
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


# What a rank of `mpirun -N 1 neuronrun` inherits: Open MPI 5's mpirun/prterun's per-process variables
# (as `mpirun -np 1 env` shows them), Open MPI <= 4's (ORTE: its daemon's URI, job id and vpid as MCA
# values), MPICH's hydra / srun --mpi=pmi2's (PMI_*), and the user's own configuration beside them.
MPI_PROCESS = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_NODE_RANK": "0", "OMPI_UNIVERSE_SIZE": "2",
    "OMPI_WORLD_SIZE": "2", "OMPI_WORLD_LOCAL_SIZE": "1", "OMPI_NUM_APP_CTX": "1", "OMPI_ARGV": "",
    "OMPI_COMMAND": "neuronrun", "OMPI_FILE_LOCATION": "/tmp/ompi.1/1/1", "OMPI_MCA_initial_wdir": "/tmp",
    "OMPI_MCA_num_procs": "2", "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-1@1", "PMIX_SECURITY_MODE": "native",
    "PMIX_SERVER_URI4": "prterun-vm-1@0.0;tcp4://127.0.0.1:5", "PMIX_SERVER_TMPDIR": "/tmp/ompi.1",
    "PMIX_GDS_MODULE": "shmem2,hash", "PMIX_BFROP_BUFFER_TYPE": "PMIX_BFROP_BUFFER_NON_DESC", "PMIX_HOSTNAME": "vm",
    "PMIX_SYSTEM_TMPDIR": "/tmp", "PMIX_VERSION": "5.0.11", "PMIX_PARAM_FILE_PASSED": "1", "PRTE_LAUNCHED": "1",
    "PRTE_SHARED_FS": "FALSE",
    "OMPI_MCA_ess": "env", "OMPI_MCA_ess_base_jobid": "1234", "OMPI_MCA_ess_base_vpid": "1",
    "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5", "OMPI_MCA_orte_local_daemon_uri": "1234.1;tcp://10.0.0.2:6",
    "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "7", "PMI_JOBID": "77.0", "PMI_PORT": "n0:5",
    "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
}
USER_MPI_CONFIG = {"OMPI_MCA_btl": "self,vader,tcp", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OPAL_PREFIX": "/opt/ompi", "PMIX_MCA_gds": "hash",
                   "PRTE_MCA_prte_silence_shared_fs": "1"}


def _rank_of_mpirun_neuronrun(environ: dict[str, str]) -> dict[str, str]:
    plan = config_from_argv(["--nproc-per-node", "1", "t.py"], {}).plan
    return worker.rank_env({**environ, worker.PLAN_VAR: plan.to_json(), "LOCAL_RANK": "0", "RANK": "0",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_under_an_mpi_launcher_a_rank_loses_its_process_variables_not_the_users_settings():
    """A rank of `mpirun -N 1 neuronrun` is no MPI process: none of the launcher's per-process
    variables may reach it (tests/test_transport_mpi.py runs that job), while the user's own MPI
    configuration does; every OMPI_/PMIX_/PMI_/OPAL_/PRTE_ variable was dropped, that too."""
    env = _rank_of_mpirun_neuronrun({**MPI_PROCESS, **USER_MPI_CONFIG})
    assert [k for k in MPI_PROCESS if k in env] == []
    assert {k: env.get(k) for k in USER_MPI_CONFIG} == USER_MPI_CONFIG
    # no MPI launcher started neuronrun: whatever MPI variables the user set are theirs, and stay
    mine = {**USER_MPI_CONFIG, "OMPI_MCA_orte_base_help_aggregate": "0", "PMI_FD": "9"}
    assert {k: v for k, v in _rank_of_mpirun_neuronrun(mine).items() if k in mine} == mine


def test_under_mpich_hydra_alone_a_rank_loses_its_process_variables():
    """MPICH's hydra (and srun --mpi=pmi2) set PMI_* but no OMPI_*/PMIX_* variables: neuronrun is
    under an MPI launcher there too, and its ranks must not take themselves for MPI processes."""
    hydra = {k: v for k, v in MPI_PROCESS.items() if k.startswith(("PMI_", "MPI_LOCAL"))}
    env = _rank_of_mpirun_neuronrun({**hydra, **USER_MPI_CONFIG})
    assert [k for k in hydra if k in env] == []
    assert {k: env.get(k) for k in USER_MPI_CONFIG} == USER_MPI_CONFIG


def test_the_users_omp_num_threads_stands(recorder, monkeypatch):
    """OMP_NUM_THREADS is set only where the user left it unset (as torchrun): an exported value
    reaches every rank, bound (--cpu-bind core) or not."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _launch_nodes(lambda n: ["--nproc-per-node", "2", "t.py"], 1)
    assert {r: env["OMP_NUM_THREADS"] for r, (_, env) in recorder.ranks().items()} == {0: "3", 1: "3"}
    plan = config_from_argv(["--nproc-per-node", "2", "--cpu-bind", "core", "t.py"], {}).plan
    base = {worker.PLAN_VAR: plan.to_json(), "LOCAL_RANK": "1", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
    assert worker.rank_env({**base, "OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"
    assert worker.rank_env(base)["OMP_NUM_THREADS"] == str(len(plan.cpus(1)))


def test_a_program_that_cannot_be_run_exits_127(tmp_path):
    """The trampoline's exec of a missing program (--no-python with a typo) ends the rank with
    127, the shell's "command not found", naming the rank and the program."""
    import subprocess
    plan = config_from_argv(["--nproc-per-node", "1", "t.py"], {}).plan
    env = {**os.environ, worker.PLAN_VAR: plan.to_json(), "LOCAL_RANK": "0", "RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env.pop(worker.GROUPS_VAR, None)
    missing = str(tmp_path / "no-such-program")
    p = subprocess.run([sys.executable, launch.WORKER, "exec", missing], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 127, p
    assert f"neuronrun worker (rank 0): cannot run {missing!r}" in p.stderr, p.stderr
