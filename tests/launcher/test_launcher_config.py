"""Command line, environment fallbacks, conflicts and --dry-run, without starting anything."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from launcher_helpers import clean_env, neuronrun

from neuronrun_launcher.cli import FLAGS
from neuronrun_launcher.config import ConfigError
from neuronrun_launcher.dryrun import rank_table, render
from neuronrun_launcher.plan import format_cpus, rank_cpus
from neuronrun_launcher.run import config_from_argv


def cfg(*argv, **env):
    return config_from_argv(list(argv), env)


def test_each_flag_defined_once_with_both_spellings():
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names))
    dests = [f.dest for f in FLAGS]
    assert len(dests) == len(set(dests))
    for f in FLAGS:
        for n in f.names:
            if n.startswith("--") and "-" in n[2:]:
                assert "--" + n[2:].replace("-", "_") in f.names


def test_torchrun_spellings_parse_the_same():
    a = cfg("--nnodes=2", "--nproc-per-node=4", "--node-rank=1", "--master-addr=h0", "--master-port=1234",
            "--max-restarts=2", "--monitor-interval=0.5", "train.py", "--lr", "1")
    b = cfg("--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1", "--master_addr", "h0",
            "--master_port", "1234", "--max_restarts", "2", "--monitor_interval", "0.5", "train.py", "--lr", "1")
    fields = ("min_nodes", "max_nodes", "nproc_per_node", "node_rank", "rdzv_backend", "rdzv_endpoint",
              "max_restarts", "monitor_interval", "script", "script_args")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields] == [
        2, 2, 4, 1, "static", "h0:1234", 2, 0.5, "train.py", ("--lr", "1")]


def test_env_fallback_order():
    assert cfg("t.py", PET_NPROC_PER_NODE="3").nproc_per_node == 3
    assert cfg("t.py", PET_NPROC_PER_NODE="3", NEURONRUN_NPROC_PER_NODE="5").nproc_per_node == 5
    assert cfg("--nproc-per-node", "2", "t.py", NEURONRUN_NPROC_PER_NODE="5").nproc_per_node == 2
    c = cfg("t.py", NEURONRUN_NO_PYTHON="1", NEURONRUN_INSTANCE="trn1.32xlarge")
    assert c.no_python and c.plan.instance == "trn1.32xlarge" and c.sources["instance"] == "$NEURONRUN_INSTANCE"
    with pytest.raises(ConfigError, match=r"\$NEURONRUN_MAX_RESTARTS='x'"):
        cfg("t.py", NEURONRUN_MAX_RESTARTS="x")


@pytest.mark.parametrize("var, value", [("PET_RUN_PATH", "1"), ("PET_START_METHOD", "fork"),
                                        ("NEURONRUN_START_METHOD", "forkserver"), ("PET_SIGNALS_TO_HANDLE", "SIGUSR1")])
def test_a_variable_of_a_torchrun_flag_neuronrun_lacks_is_refused(var, value):
    """--run-path and --start-method are usage errors on neuronrun's command line, but their
    PET_* variables (which torchrun honours) were ignored: the job ran other than its template
    said, without a word."""
    flag = "--" + var.split("_", 1)[1].lower().replace("_", "-")
    with pytest.raises(ConfigError, match=rf"\${var}={value!r}: neuronrun has no {flag} "):
        cfg("t.py", **{var: value})
    cfg("t.py", PET_RUN_PATH="0", PET_START_METHOD="")  # a false switch or an empty value asks for nothing
    # torchrun's defaults, which neuronrun's agent runs with: a template may spell them out
    cfg("t.py", PET_START_METHOD="spawn", PET_EVENT_LOG_HANDLER="null",
        PET_SIGNALS_TO_HANDLE="SIGTERM, SIGINT,SIGQUIT,SIGHUP")


def test_a_mistyped_flag_is_refused_with_the_nearest_flag(capsys):
    """neuronrun takes no abbreviations (torchrun does): `--nproc-per-nod` said only
    'unrecognized arguments'; the usage error now names the flag meant."""
    for argv, typo, meant in ((["--nproc-per-nod", "2", "t.py"], "--nproc-per-nod", "--nproc-per-node"),
                              (["--max-restart=2", "t.py"], "--max-restart=2", "--max-restarts"),
                              (["--master_adr", "h0", "t.py"], "--master_adr", "--master_addr")):
        with pytest.raises(SystemExit) as e:
            cfg(*argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {typo}" in err and f"did you mean {meant}?" in err, err
    with pytest.raises(SystemExit):
        cfg("--banana", "t.py")
    assert "did you mean" not in capsys.readouterr().err


def test_single_node_defaults_like_torchrun():
    c = cfg("t.py")
    assert (c.rdzv_backend, c.rdzv_endpoint, c.nproc_per_node, c.tee, c.max_restarts) == ("c10d", "localhost:0", 1,
                                                                                          "3", 0)
    assert (c.plan.instance, c.plan.lnc, c.plan.cores_per_chip) == ("trn2.48xlarge", 2, 4)
    s = cfg("--standalone", "--rdzv-backend", "static", "t.py")
    assert (s.rdzv_backend, s.rdzv_endpoint) == ("c10d", "localhost:0")


@pytest.mark.parametrize("argv, env, nproc, cpc", [
    (["--nproc-per-node", "auto"], {}, 64, 4),
    (["--nproc-per-node", "auto", "--lnc", "1"], {}, 128, 8),
    (["--nproc-per-node", "auto", "--lnc", "1", "--cores-per-rank", "4"], {}, 32, 8),
    (["--nproc-per-node", "auto", "--instance", "trn1.32xlarge"], {}, 32, 2),
    (["--nproc-per-node", "auto", "--instance", "inf2.24xlarge", "--cores-per-rank", "2"], {}, 6, 2),
    (["--nproc-per-node", "auto"], {"NEURON_RT_VISIBLE_CORES": "8-15"}, 8, 4),
    (["--nproc-per-node", "auto"], {"NEURON_RT_NUM_CORES": "2", "NEURON_DIST_INSTANCE": "trn1.2xlarge"}, 1, 2),
])
def test_auto_is_one_rank_per_logical_core(argv, env, nproc, cpc):
    c = cfg(*argv, "t.py", **env)
    assert (c.nproc_per_node, c.plan.cores_per_chip) == (nproc, cpc)


@pytest.mark.parametrize("argv, env, message", [
    (["--nproc-per-node", "33", "--instance", "trn1.32xlarge"], {}, "only 32 logical NeuronCores"),
    (["--lnc", "2", "--instance", "trn1.32xlarge"], {}, r"supports LNC 1, not 2 \(--lnc, from command line\)"),
    (["--instance", "trn1.32xlarge"], {"NEURON_LOGICAL_NC_CONFIG": "2"}, r"not 2 \(from \$NEURON_LOGICAL_NC_CONFIG\)"),
    (["--lnc", "1"], {"NEURON_LOGICAL_NC_CONFIG": "2"}, r"--lnc 1 \(from command line\) conflicts with "
                                                         r"\$NEURON_LOGICAL_NC_CONFIG=2"),
    (["--instance", "trn1.32xlarge"], {"NEURON_DIST_INSTANCE": "trn2.48xlarge"}, "conflicts with"),
    (["--cores-per-rank", "2"], {"NEURON_RT_NUM_CORES": "4"}, "conflicts with"),
    (["--cores-per-rank", "3"], {}, "straddles a chip"),
    (["--instance", "p4d.24xlarge"], {}, "unknown instance"),
    (["--nproc-per-node", "gpu"], {}, "integer, 'auto' or 'cpu'"),
    (["--cores-per-rank", "0"], {}, "must be >= 1, got 0"),
    ([], {"NEURON_RT_NUM_CORES": "0"}, r"^\$NEURON_RT_NUM_CORES must be >= 1, got 0"),  # not a flag never given
    ([], {"NEURON_RT_NUM_CORES": "3"}, r"^\$NEURON_RT_NUM_CORES 3 does not fit"),
    ([], {"NEURONRUN_CORES_PER_RANK": "3"}, r"^\$NEURONRUN_CORES_PER_RANK 3 does not fit"),
    (["--master-port", "65535"], {}, "expected 1-65534"),
    (["--master-port", "99999"], {}, "expected 1-65534"),
    (["--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:65535"], {}, "expected a port of 1-65534"),
    (["--nnodes", "2", "--rdzv-endpoint", "[::1]:65535"], {}, "expected a port of 1-65534"),
    (["--nnodes", "2", "--instance", "inf2.48xlarge"], {}, "single-instance"),
    (["--nnodes", "1:2", "--rdzv-backend", "static", "--master-port", "1"], {}, "fixed --nnodes"),
    (["--nnodes", "2", "--node-rank", "2"], {}, r"outside 0\.\.1"),
    (["--nproc-per-node", "4"], {"NEURON_RT_VISIBLE_CORES": "0-2"}, "restricted to 3"),
    ([], {"NEURON_RT_ROOT_COMM_ID": "nohostport"}, "not host:port"),
    ([], {"NEURON_LOGICAL_NC_CONFIG": "0"}, r"supports LNC 1, 2, not 0 \(from"),  # 0 is not "the default"
    (["--nnodes", "2", "--rdzv-endpoint", "node0"], {}, "static rendezvous: give the port"),
    (["--rdzv-endpoint", "127.0.0.1"], {}, "static rendezvous: give the port"),
    (["--no-python", "-m"], {}, "cannot be used together"),
    (["--tee", "9"], {}, "--tee '9'"),
])
def test_mistakes_are_clear_errors(argv, env, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*argv, "t.py", **env)


def test_a_static_endpoint_on_the_last_port_runs_where_the_root_comm_id_is_given():
    """A static --rdzv-endpoint on port 65535 left no port for NEURON_RT_ROOT_COMM_ID's default:
    --dry-run crashed with a traceback and a real launch started every rank to fail. It is refused
    up front, unless the user exports NEURON_RT_ROOT_COMM_ID."""
    c = cfg("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:65535", "t.py",
            NEURON_RT_ROOT_COMM_ID="127.0.0.1:40000")
    assert c.plan.root_comm_id == "127.0.0.1:40000"
    c = cfg("--master-port", "65535", "t.py", NEURON_RT_ROOT_COMM_ID="127.0.0.1:40000")  # the same rule
    assert c.master_port == 65535


@pytest.mark.parametrize("argv, env, message", [
    (["--monitor-interval", "0"], {}, r"--monitor-interval 0 \(from command line\): expected seconds between "
                                      r"health checks > 0"),
    (["--monitor-interval", "-1.5"], {}, r"--monitor-interval -1\.5 \(from command line\)"),
    (["--monitor-interval", "nan"], {}, r"--monitor-interval nan"),
    ([], {"NEURONRUN_MONITOR_INTERVAL": "0"}, r"--monitor-interval 0 \(from \$NEURONRUN_MONITOR_INTERVAL\)"),
    (["--shutdown-timeout", "-1"], {}, r"--shutdown-timeout -1 \(from command line\): expected seconds >= 0"),
    ([], {"PET_SHUTDOWN_TIMEOUT": "-5"}, r"--shutdown-timeout -5 \(from \$PET_SHUTDOWN_TIMEOUT\)"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_monitor_interval_and_shutdown_timeout_out_of_range_are_flag_errors(argv, env, message, dry_run):
    """--monitor-interval <= 0 reached torch's agent as a bare AssertionError and
    --shutdown-timeout < 0 a traceback, while --dry-run accepted both: now both are refused
    with the other flags' mistakes, before anything starts."""
    with pytest.raises(ConfigError, match=message):
        cfg(*argv, *(["--dry-run"] if dry_run else []), "t.py", **env)


def test_bad_monitor_interval_is_a_neuronrun_error_on_the_command_line():
    r = neuronrun(["--dry-run", "--monitor-interval", "0", "t.py"])
    assert r.returncode == 2 and "neuronrun: error: --monitor-interval 0" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = neuronrun(["--dry-run", "t.py"], env=clean_env(NEURONRUN_SHUTDOWN_TIMEOUT="-1"))
    assert r.returncode == 2 and "neuronrun: error: --shutdown-timeout -1" in r.stderr, r.stderr
    c = cfg("--monitor-interval", "0.25", "--shutdown-timeout", "0", "t.py")  # the smallest that work
    assert (c.monitor_interval, c.shutdown_timeout) == (0.25, 0)


@pytest.mark.parametrize("visible, base, pool", [("0,1", 0, 2), ("0-1,2-3", 0, 4), ("4,5-7", 4, 4), ("3,2", 2, 2),
                                                 ("8-15", 8, 8), ("6", 6, 1)])
def test_an_exported_comma_list_of_consecutive_cores_is_the_pool(visible, base, pool):
    """The Neuron runtime takes NEURON_RT_VISIBLE_CORES as a comma-separated list of indices and
    ranges too (the backend already did); neuronrun refused `0,1`, a device plugin's way of
    saying `0-1`."""
    c = cfg("--nproc-per-node", str(pool), "t.py", NEURON_RT_VISIBLE_CORES=visible)
    assert (c.plan.base_core, c.plan.pool_cores) == (base, pool)
    assert rank_table(c)[0][1]["NEURON_RT_VISIBLE_CORES"] == str(base)


@pytest.mark.parametrize("visible, message", [
    ("0,2-3", r"'0,2-3' is not one run of consecutive cores; the Neuron runtime takes such a list, but neuronrun"),
    ("0,,1", r"'' is not a core index 'a' or an inclusive range 'a-b' \(the list is comma-separated"),
    ("0-1,1", "lists a core twice"),
])
def test_a_comma_list_neuronrun_cannot_place_is_a_clear_error(visible, message):
    with pytest.raises(ConfigError, match=message):
        cfg("t.py", NEURON_RT_VISIBLE_CORES=visible)


def test_torchrun_values_redirects_alone_and_nproc_cpu():
    """-r alone writes files only (torchrun's meaning; --tee defaults to 3 otherwise), -r with
    an explicit --tee keeps it; --nproc-per-node cpu is one rank per CPU this process may use."""
    assert (cfg("-r", "3", "t.py").tee, cfg("-r", "3", "t.py").redirects) == ("0", "3")
    assert cfg("-r", "3", "--tee", "1", "t.py").tee == "1"
    assert cfg("t.py").tee == "3"
    assert cfg("--nproc-per-node", "cpu", "--instance", "trn1.32xlarge", "t.py").nproc_per_node == \
        len(os.sched_getaffinity(0))


def test_user_set_neuron_values_are_respected():
    c = cfg("--nproc-per-node", "2", "t.py", NEURON_LOGICAL_NC_CONFIG="1", NEURON_RT_NUM_CORES="2",
            NEURON_DIST_INSTANCE="trn2.48xlarge", NEURON_RT_VISIBLE_CORES="4-7", NEURON_RT_ROOT_COMM_ID="h:9")
    p = c.plan
    assert (p.lnc, p.cores_per_rank, p.base_core, p.pool_cores, p.root_comm_id) == (1, 2, 4, 4, "h:9")
    # agreeing explicit flags are fine
    cfg("--lnc", "1", "--instance", "trn2.48xlarge", "t.py", NEURON_LOGICAL_NC_CONFIG="1",
        NEURON_DIST_INSTANCE="trn2.48xlarge")


SRUN = {"SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "trn[07-08]", "SLURM_JOB_ID": "4242"}


@pytest.mark.parametrize("argv, env, message", [
    (["--rdzv-backend", "bogus"], {}, r"--rdzv-backend 'bogus' \(from command line\): expected one of c10d, static, "
                                      r"etcd, etcd-v2"),
    ([], {"PET_RDZV_BACKEND": "C10D"}, r"--rdzv-backend 'C10D' \(from \$PET_RDZV_BACKEND\)"),
    (["--rdzv-conf", "foo"], {}, r"--rdzv-conf 'foo' \(from command line\): 'foo' is not KEY=VALUE; expected "
                                 r"comma-separated KEY=VALUE items"),
    (["--rdzv-conf", "join_timeout="], {}, r"'join_timeout=' is not KEY=VALUE"),
    (["--rdzv-conf", "join_timeout=5,,read_timeout=3"], {}, r"'' is not KEY=VALUE"),
    ([], {"NEURONRUN_RDZV_CONF": "=5"}, r"--rdzv-conf '=5' \(from \$NEURONRUN_RDZV_CONF\): '=5' is not KEY=VALUE"),
])
def test_a_rendezvous_backend_or_conf_torch_would_refuse_is_refused_up_front(argv, env, message):
    """--dry-run accepted `--rdzv-backend bogus` and `--rdzv-conf foo` (exit 0) although config.py
    promises every mistake before launch; torch's agent refused them only once it ran. Both are
    now checked as torch reads them, --dry-run included."""
    for dry in ([], ["--dry-run"]):
        with pytest.raises(ConfigError, match=message):
            cfg(*argv, *dry, "t.py", **env)


def test_every_backend_torch_registers_and_its_conf_are_taken(monkeypatch):
    """torch's own backends, and one a package registers under the "torchrun.handlers" entry point
    (torch's registry loads those too)."""
    import importlib.metadata
    plugin = importlib.metadata.EntryPoint("myrdzv", "mypkg:handler", "torchrun.handlers")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [plugin] if group == "torchrun.handlers" else [])
    assert cfg("--nnodes", "2", "--rdzv-backend", "myrdzv", "--rdzv-endpoint", "h:1", "t.py").rdzv_backend == "myrdzv"
    with pytest.raises(ConfigError, match="expected one of c10d, static, etcd, etcd-v2, myrdzv"):
        cfg("--rdzv-backend", "bogus", "t.py")
    for backend in ("c10d", "static", "etcd", "etcd-v2"):
        c = cfg("--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint", "h:1", "--rdzv-conf",
                " join_timeout=5, read_timeout = 3 ", "t.py")
        assert (c.rdzv_backend, c.rdzv_conf) == (backend, " join_timeout=5, read_timeout = 3 ")
    r = neuronrun(["--dry-run", "--rdzv-conf", "foo", "t.py"])
    assert r.returncode == 2 and "neuronrun: error: --rdzv-conf 'foo'" in r.stderr, r.stderr


def test_under_srun_nothing_is_hand_computed():
    c = cfg("--nproc-per-node", "auto", "t.py", **SRUN)
    assert (c.max_nodes, c.node_rank, c.master_addr, c.rdzv_backend, c.rdzv_endpoint, c.rdzv_id) == (
        2, 1, "trn07", "static", "trn07:29500", "4242")
    assert cfg("--master-addr", "trn07-ib", "t.py", **SRUN).rdzv_endpoint == "trn07-ib:29500"
    with pytest.raises(ConfigError, match="--node-rank 0 conflicts with slurm's node rank 1"):
        cfg("--node-rank", "0", "t.py", **SRUN)
    with pytest.raises(ConfigError, match="conflicts with slurm's 2 nodes; drop --nnodes, or pass --scheduler none"):
        cfg("--nnodes", "3", "t.py", **SRUN)
    assert cfg("--scheduler", "none", "t.py", **SRUN).max_nodes == 1


def test_under_mpirun():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(ConfigError, match="mpirun -x MASTER_ADDR"):
        cfg("t.py", **mpi)
    c = cfg("t.py", MASTER_ADDR="head", **mpi)
    assert (c.max_nodes, c.node_rank, c.rdzv_endpoint) == (2, 1, "head:29500")


@pytest.mark.parametrize("argv, env, message", [
    ([], SRUN, r"--standalone is one node \(a rendezvous of its own on this host\), but slurm says 2 nodes: drop "
               r"--standalone .*or pass --scheduler none"),
    ([], {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1", "MASTER_ADDR": "head"}, "but mpi says 3 nodes"),
    (["--nnodes", "2"], {}, r"but --nnodes 2 \(from command line\) asks for 2 or more: drop one of them"),
    ([], {"NEURONRUN_NNODES": "2:4"}, r"but --nnodes 2:4 \(from \$NEURONRUN_NNODES\) asks for 2 or more"),
])
def test_standalone_with_several_nodes_is_refused_before_the_rendezvous(argv, env, message):
    """--standalone under a multi-node srun or mpirun took the node count from the scheduler and
    pointed each node at a rendezvous of its own (localhost:0): no node could ever join another's,
    so each waited out the join time-out (600 s) and reported too few nodes. One node is all that
    --standalone can run; more is a usage error, --dry-run's too."""
    for dry in ([], ["--dry-run"]):
        with pytest.raises(ConfigError, match=message):
            cfg("--standalone", *argv, *dry, "t.py", **env)


def test_standalone_on_one_node_of_a_scheduler_or_elastic_from_one_runs():
    one = dict(SRUN, SLURM_NODEID="0", SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_JOB_NODELIST="trn07")
    for c in (cfg("--standalone", "t.py", **one), cfg("--standalone", "--nnodes", "1:2", "t.py")):
        assert (c.min_nodes, c.rdzv_backend, c.rdzv_endpoint) == (1, "c10d", "localhost:0")


def test_standalone_under_a_multi_node_srun_is_a_usage_error_at_once():
    env = clean_env(SLURM_STEP_ID="0", SLURM_NODEID="0", SLURM_STEP_NODELIST="n[0-1]", SLURM_STEP_NUM_NODES="2",
                    SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="77")
    r = neuronrun(["--standalone", "--rdzv-conf", "join_timeout=5", "t.py"], env=env, timeout=30)
    assert r.returncode == 2 and "neuronrun: error: --standalone is one node" in r.stderr, r.stderr


def test_under_a_one_process_mpirun_the_one_node_needs_no_address():
    """`mpirun -np 1 neuronrun --nproc-per-node 2` was refused ("under mpi the address of node 0 is
    unknown") where `mpirun -np 1 torchrun --nproc-per-node 2` runs: a world of one MPI process is
    one node, node 0 is this one, and the default address serves, as without mpirun."""
    mpi = {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    alone = cfg("--nproc-per-node", "2", "t.py")
    for env in (mpi, {"PMI_SIZE": "1", "PMI_RANK": "0"}):
        c = cfg("--nproc-per-node", "2", "t.py", **env)
        assert (c.max_nodes, c.node_rank, c.master_addr, c.rdzv_backend, c.rdzv_endpoint) == (
            1, 0, "127.0.0.1", alone.rdzv_backend, alone.rdzv_endpoint), env
    assert cfg("--master-port", "29600", "t.py", **mpi).rdzv_endpoint == "127.0.0.1:29600"
    assert cfg("t.py", MASTER_ADDR="head", **mpi).master_addr == "head"


def test_rank_table_two_nodes_trn1_two_cores_per_rank():
    c = cfg("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.1.1", "--master-port", "7000",
            "--instance", "trn1.32xlarge", "--cores-per-rank", "2", "--nproc-per-node", "auto", "t.py")
    rows = rank_table(c)
    assert len(rows) == 32
    fields, env = rows[17]
    assert fields == {"rank": "17", "host": "(node 1)", "node rank": "1", "local rank": "1", "chip": "1",
                      "cores": "2-3"}
    assert env["RANK"] == "17" and env["GROUP_RANK"] == "1" and env["WORLD_SIZE"] == "32"
    assert env["NEURON_RT_VISIBLE_CORES"] == "2-3" and env["NEURON_RT_ROOT_COMM_ID"] == "10.1.1.1:7001"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1" and env["NEURON_RT_NUM_CORES"] == "2"


def test_rank_table_ipv6_master():
    c = cfg("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "[::1]:7000", "t.py")
    fields, env = rank_table(c)[0]
    assert env["MASTER_ADDR"] == "::1" and env["MASTER_PORT"] == "7000"
    assert env["NEURON_RT_ROOT_COMM_ID"] == "[::1]:7001"  # host:port, as neuronrun itself checks it
    for addr in ("::1", "[::1]"):  # --master-addr as an IPv6 address, bracketed or not
        c = cfg("--master-addr", addr, "--master-port", "7000", "t.py")
        assert c.rdzv_endpoint == "[::1]:7000"
        fields, env = rank_table(c)[0]
        assert env["MASTER_ADDR"] == "::1" and env["NEURON_RT_ROOT_COMM_ID"] == "[::1]:7001"


def test_dry_run_cli_output():
    r = neuronrun(["--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.9",
                   "--master-port", "6000", "--nproc-per-node", "2", "--lnc", "1", "--cores-per-rank", "8",
                   "train.py", "--epochs", "3"], env=clean_env(SLURM_STEP_ID="0", SLURM_NODEID="1",
                                                               SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "trn2.48xlarge, LNC 1 (16 chips x 8 logical cores), 2 node(s) x 2 rank(s), 8 core(s) per rank" in out
    assert "worker.py python train.py --epochs 3" in out
    assert "\nwhich execs: " in out and "-u train.py --epochs 3\n" in out, out
    r = neuronrun(["--dry-run", "-m", "pkg.train", "--lr", "1"], env=clean_env(PYTHON_EXEC="/opt/py-wrap"))
    assert r.returncode == 0 and "\nwhich execs: /opt/py-wrap -u -m pkg.train --lr 1\n" in r.stdout, r.stdout + r.stderr
    block = out.split("rank 3, ")[1]
    assert block.startswith("host n2, node rank 1, local rank 1, chip 1, cores 8-15\n")
    for line in ("RANK=3", "LOCAL_RANK=1", "WORLD_SIZE=4", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=1",
                 "MASTER_ADDR=10.0.0.9", "MASTER_PORT=6000", "NEURON_RT_VISIBLE_CORES=8-15",
                 "NEURON_RT_NUM_CORES=8", "NEURON_LOGICAL_NC_CONFIG=1", "NEURON_RT_ROOT_COMM_ID=10.0.0.9:6001",
                 "NEURON_DIST_INSTANCE=trn2.48xlarge"):
        assert f"\n  {line}\n" in block + "\n"


def test_a_dry_run_read_in_part_ends_quietly_and_one_node_is_not_told_of_others():
    """`neuronrun --dry-run ... | head` ended in a BrokenPipeError traceback; a one-node dry run
    under a c10d rendezvous said "ranks of nodes other than this one are ordered at rendezvous"."""
    p = subprocess.Popen([sys.executable, "-m", "neuronrun_launcher.run", "--dry-run", "--lnc", "1", "--nproc-per-node",
                          "128", "train.py"],  # (82 KB: more than a pipe holds, so the write meets the closed end)
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # as `head -1` does once it has its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    one = render(cfg("--standalone", "--nproc-per-node", "2", "t.py"))
    assert "\nMASTER_ADDR/MASTER_PORT come from node 0's agent\n" in one and "other than this one" not in one, one
    two = render(cfg("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "t.py"))
    assert "ranks of nodes other than this one are ordered at rendezvous; MASTER_ADDR" in two, two


def test_cpu_bind_dry_run_and_bad_value():
    r = neuronrun(["--dry-run", "--cpu-bind", "core", "--nproc-per-node", "2", "train.py"])
    assert r.returncode == 0, r.stderr
    cpus = sorted(os.sched_getaffinity(0))
    for local in (0, 1):
        want = format_cpus(rank_cpus(tuple(cpus), local, 2))
        assert f"local rank {local}, chip 0, cores {local}, cpus {want}\n" in r.stdout
    r = neuronrun(["--dry-run", "--nproc-per-node", "2", "train.py"])  # default: not bound, not shown
    assert r.returncode == 0 and "cpus" not in r.stdout


def test_dry_run_lists_the_omp_threads_neuronrun_sets():
    """--dry-run promised each rank's environment but left out OMP_NUM_THREADS, which neuronrun
    sets where unset: 1 with several ranks (as torchrun), the share's size with --cpu-bind core."""
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    share = len(rank_cpus(tuple(sorted(os.sched_getaffinity(0))), 0, 1))
    for flags, want in ((["--nproc-per-node", "2"], "1"), (["--nproc-per-node", "1", "--cpu-bind", "core"], str(share))):
        r = neuronrun(["--dry-run", *flags, "train.py"], env=env)
        assert r.returncode == 0 and f"\n  OMP_NUM_THREADS={want}\n" in r.stdout, (flags, r.stdout + r.stderr)
    r = neuronrun(["--dry-run", "--nproc-per-node", "1", "train.py"], env=env)  # one rank: left to torch
    assert r.returncode == 0 and "OMP_NUM_THREADS" not in r.stdout, r.stdout
    r = neuronrun(["--dry-run", "--nproc-per-node", "2", "train.py"], env={**env, "OMP_NUM_THREADS": "3"})
    assert r.returncode == 0 and "OMP_NUM_THREADS" not in r.stdout, r.stdout  # the user's own, inherited
    r = neuronrun(["--cpu-bind", "socket", "train.py"])
    assert r.returncode == 2 and "--cpu-bind" in r.stderr and "Traceback" not in r.stderr


def test_help_is_the_manual_and_errors_exit_2():
    r = neuronrun(["--help"])
    assert r.returncode == 0 and "Environment of each rank" in r.stdout and "NEURONRUN_FOO_BAR" in r.stdout
    r = neuronrun(["--nproc-per-node", "999", "t.py"])
    assert r.returncode == 2 and "neuronrun: error:" in r.stderr and "Traceback" not in r.stderr


def test_dry_run_and_help_import_neither_torch_nor_the_backend():
    """The package's promise (`--help` and `--dry-run` answer at once): the instance models come
    from neuron_dist's topology file loaded on its own, not through neuron_dist/__init__, which
    registers the backend and imports torch (7 s and 230 MB on a loaded 2-core host)."""
    probe = ("import sys\nfrom neuronrun_launcher import run\n"
             "for argv in (['--dry-run', '--nproc-per-node', '2', '--instance', 'trn1.32xlarge', 't.py'], ['--help']):\n"
             "    try:\n        rc = run.main(argv)\n    except SystemExit as e:\n        rc = e.code\n"
             "    assert rc == 0, (argv, rc)\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('neuron_dist')))\n"
             "print('own copy' if 'neuronrun_launcher._neuron_dist_instances' in sys.modules else 'fallback')\n")
    r = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    *_, loaded, source = r.stdout.strip().splitlines()
    assert loaded == "[]", r.stdout[-2000:]
    assert source == "own copy" and "trn1.32xlarge" in r.stdout, r.stdout[-2000:]  # neuron_dist's models, placed on


@pytest.mark.parametrize("argv, env, message", [
    (["--nnodes", "2:1"], {}, r"--nnodes '2:1': expected N or MIN:MAX with 0 < MIN <= MAX"),
    (["--nnodes", "1:2:3"], {}, r"--nnodes '1:2:3': expected N or MIN:MAX"),
    (["--nproc-per-node", "0"], {}, r"--nproc-per-node 0: must be at least 1"),
    (["--max-restarts", "-1"], {}, r"--max-restarts must be >= 0"),
    ([], {"NEURON_RT_ROOT_COMM_ID": "h:0"}, r"\$NEURON_RT_ROOT_COMM_ID='h:0' is not host:port"),
    ([], {"NEURONRUN_CPU_BIND": "socket"}, r"\$NEURONRUN_CPU_BIND='socket': choose from none, core"),
])
def test_values_torchrun_or_the_neuron_runtime_would_refuse_are_refused_up_front(argv, env, message):
    """Each of these reached torch's agent or the ranks (an elastic range MAX < MIN, a third
    --nnodes field, a job of no ranks, a negative restart count, a root on port 0), or was
    silently dropped (--cpu-bind from the environment outside its choices ran unbound)."""
    with pytest.raises(ConfigError, match=message):
        cfg(*argv, "t.py", **env)


def test_an_empty_variable_is_no_value():
    """A template that exports a flag's variable empty (PET_MASTER_PORT=, NEURONRUN_STANDALONE=)
    asks for nothing: the next variable, then the default, answers."""
    assert cfg("t.py", NEURONRUN_NPROC_PER_NODE="", PET_NPROC_PER_NODE="3").nproc_per_node == 3
    assert cfg("--nproc-per-node", "2", "t.py", PET_MASTER_PORT="").master_port == 29500
    assert cfg("t.py", NEURONRUN_STANDALONE="", NEURONRUN_NO_PYTHON="").no_python is False


def test_nproc_per_node_cpu_counts_the_cpus_this_launcher_may_use(monkeypatch):
    """`--nproc-per-node cpu` is torchrun's one rank per CPU the launcher may run on (taskset, a
    cgroup's cpuset), not per CPU of the host."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5}, raising=False)
    assert cfg("--nproc-per-node", "cpu", "--instance", "trn1.32xlarge", "t.py").nproc_per_node == 3


def test_an_instance_described_in_a_file_reaches_the_ranks_as_its_path(tmp_path):
    """NEURON_DIST_INSTANCE is the file's path, which the backend loads in every rank; the name
    inside the file is known only to a process that loaded it (the ranks would fail at init)."""
    pytest.importorskip("neuron_dist.topology.instances")
    desc = {"name": "test.neuronrun.file", "chips": 4, "physical_cores_per_chip": 2, "default_lnc": 1,
            "supported_lnc": [1], "graph": "ring", "torus_dims": [4], "torus_wrap": [True],
            "link_bandwidth": "100 GB/s", "hbm_bandwidth": "800 GB/s", "multi_node": False}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(desc))
    c = cfg("--instance", str(path), "--nproc-per-node", "auto", "t.py")
    assert (c.plan.instance, c.nproc_per_node) == (str(path), 8)
    assert {env["NEURON_DIST_INSTANCE"] for _, env in rank_table(c)} == {str(path)}
    c = cfg("--nproc-per-node", "2", "t.py", NEURON_DIST_INSTANCE=str(path))
    assert rank_table(c)[1][1]["NEURON_DIST_INSTANCE"] == str(path)


def test_under_srun_an_explicit_value_must_agree_and_an_explicit_id_stands():
    """An explicit --nnodes that does not cover Slurm's node count is a conflict (fewer as much as
    more); an explicit --rdzv-id is the user's, not replaced by $SLURM_JOB_ID."""
    with pytest.raises(ConfigError, match="--nnodes 1 conflicts with slurm's 2 nodes"):
        cfg("--nnodes", "1", "t.py", **SRUN)
    assert cfg("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "t.py", **SRUN).max_nodes == 4
    assert cfg("--rdzv-id", "mine", "t.py", **SRUN).rdzv_id == "mine"


def test_the_highest_master_port_leaves_the_root_the_port_after_it():
    """--master-port 65534 is accepted (65535 is not): every rank's NEURON_RT_ROOT_COMM_ID is then
    on 65535, the last port, which the ranks and --dry-run must take."""
    c = cfg("--master-port", "65534", "t.py")
    assert {env["NEURON_RT_ROOT_COMM_ID"] for _, env in rank_table(c)} == {"127.0.0.1:65535"}


def test_dry_run_lists_an_exported_root_and_this_nodes_host_under_any_rendezvous():
    """--dry-run's listing is what the ranks get: under c10d an exported NEURON_RT_ROOT_COMM_ID is
    used as is (not a placeholder); under static rendezvous this node, whatever its --node-rank,
    is the host neuronrun runs on, the others unknown."""
    c = cfg("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "t.py",
            NEURON_RT_ROOT_COMM_ID="head:9000")
    assert {env["NEURON_RT_ROOT_COMM_ID"] for _, env in rank_table(c)} == {"head:9000"}
    c = cfg("--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--nproc-per-node", "2", "t.py")
    assert [f["host"] for f, _ in rank_table(c)] == ["(node 0)", "(node 0)", socket.gethostname(),
                                                    socket.gethostname()]
