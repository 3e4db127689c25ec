"""The diagnostic switches read one way: 0/false/off/no is off for every one of them (it was a
file named "0" for NEURON_DIST_DUMP, an error for NEURON_DIST_DEBUG and "on" for
NEURON_DIST_CHECK=false), and a bad value is an error naming the variable."""
import ast
import os
import subprocess
import sys
import textwrap

import pytest

from neuron_dist import config


@pytest.fixture
def own_environ():
    """os.environ, put back whole after the test: `mpi_env.adopt` writes it itself, so what it
    sets must not outlive the test (monkeypatch restores only what it set)."""
    saved = dict(os.environ)
    try:
        yield os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("YES", True), ("on", True), ("", False),
                                       ("0", False), ("false", False), ("Off", False), ("no", False)])
def test_env_flag(monkeypatch, value, on):
    monkeypatch.setenv("ND_TEST_FLAG", value)
    assert config.env_flag("ND_TEST_FLAG") is on


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("  ", True), ("0", False), ("no", False), ("1", True)])
def test_env_flag_default_applies_only_when_unset_or_empty(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("ND_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("ND_TEST_FLAG", value)
    assert config.env_flag("ND_TEST_FLAG", default=True) is on


def test_env_flag_rejects_other_values(monkeypatch):
    monkeypatch.setenv("ND_TEST_FLAG", "maybe")
    with pytest.raises(ValueError, match="ND_TEST_FLAG='maybe'"):
        config.env_flag("ND_TEST_FLAG")


@pytest.mark.parametrize("value, where", [("0", None), ("false", None), ("", None), ("1", "stderr"),
                                          ("stderr", "stderr"), ("true", "stderr"), ("/tmp/x.txt", "/tmp/x.txt"),
                                          # in any case, as env_flag reads them: not files named "OFF" or "TRUE"
                                          ("OFF", None), ("No", None), ("TRUE", "stderr"), ("STDERR", "stderr")])
def test_env_target(monkeypatch, value, where):
    monkeypatch.setenv("ND_TEST_TARGET", value)
    assert config.env_target("ND_TEST_TARGET") == where


@pytest.mark.parametrize("value, want", [(None, 7), ("", 7), (" 5 ", 5), ("2", 2), ("9", 9), ("1", "must be at least 2"),
                                         ("10", "must be at most 9"), ("x", "is not an integer")])
def test_env_int_takes_its_bounds_inclusively_and_unset_or_empty_as_the_default(monkeypatch, value, want):
    """README's ranges are inclusive (NEURON_DIST_SHM_SLOTS 2 to 65536, NEURON_DIST_FRAME_BYTES 64 B to
    1 GiB, NEURON_DIST_SCRATCH_BYTES from 0), and an empty value is the default, as for env_flag."""
    if value is None:
        monkeypatch.delenv("ND_TEST_INT", raising=False)
    else:
        monkeypatch.setenv("ND_TEST_INT", value)
    if isinstance(want, int):
        assert config.env_int("ND_TEST_INT", 7, minimum=2, maximum=9) == want
    else:
        with pytest.raises(ValueError, match=f"ND_TEST_INT={value!r} {want}"):
            config.env_int("ND_TEST_INT", 7, minimum=2, maximum=9)


def test_the_frame_and_shared_memory_settings_have_readmes_defaults_and_bounds(monkeypatch):
    """README's table: NEURON_DIST_FRAME_BYTES 512 KiB (64 B to 1 GiB); NEURON_DIST_SHM_SLOTS 4
    (2 to 65536), the spin 50 us then 1000 us yielding (20 and 0 where local ranks outnumber
    cores), lending on; NEURON_DIST_SCRATCH_BYTES 64 MiB (0: none)."""
    from neuron_dist.collectives.scratch import scratch_bytes_setting
    from neuron_dist.transport import shm
    from neuron_dist.transport.frame import frame_bytes_setting
    for var in ("NEURON_DIST_FRAME_BYTES", "NEURON_DIST_SHM_SLOTS", "NEURON_DIST_SHM_SPIN_US",
                "NEURON_DIST_SHM_YIELD_US", "NEURON_DIST_SHM_LEND", "NEURON_DIST_SCRATCH_BYTES"):
        monkeypatch.delenv(var, raising=False)
    assert frame_bytes_setting() == 512 << 10 and scratch_bytes_setting() == 64 << 20
    assert shm.settings(False) == (4, 50 * 1e-6, 1000 * 1e-6, True)  # (seconds, as the variables in us x 1e-6)
    assert shm.settings(True) == (4, 20 * 1e-6, 0.0, True)
    for var, ok, bad, why in (("NEURON_DIST_FRAME_BYTES", (64, 1 << 30), 63, "at least 64"),
                              ("NEURON_DIST_SHM_SLOTS", (2, 1 << 16), 1, "at least 2"),
                              ("NEURON_DIST_SCRATCH_BYTES", (0,), -1, "at least 0")):
        read = {"NEURON_DIST_FRAME_BYTES": frame_bytes_setting, "NEURON_DIST_SCRATCH_BYTES": scratch_bytes_setting,
                "NEURON_DIST_SHM_SLOTS": lambda: shm.settings()[0]}[var]
        for v in ok:
            monkeypatch.setenv(var, str(v))
            assert read() == v, var
        monkeypatch.setenv(var, str(bad))
        with pytest.raises(ValueError, match=f"{var}='{bad}' must be {why}"):
            read()
        monkeypatch.delenv(var)


@pytest.mark.parametrize("value", ["ALL", "1"])
def test_debug_all_turns_on_every_subsystem_and_the_variables_read(value):
    """NEURON_DIST_DEBUG=ALL (or 1) logs every subsystem at debug level, the package's own
    logger included: its lines are the NEURON_DIST_* variables read at set-up."""
    code = ("import logging, os, neuron_dist\n"
            "from neuron_dist import config\n"
            "print([logging.getLogger(n).getEffectiveLevel() for n in config._LOGGERS.values()])\n"
            "os.environ['NEURON_DIST_TEST_READ'] = '3'\n"
            "config.env('NEURON_DIST_TEST_READ')\n")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NEURON_DIST_DEBUG=value),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "unknown subsystems" not in p.stderr, p.stderr[-2000:]
    assert p.stdout.split("\n")[0] == str([10] * 5), p.stdout
    assert "neuron_dist DEBUG: env NEURON_DIST_TEST_READ=3" in p.stderr, p.stderr[-2000:]


def test_check_switch_reads_false_as_off(monkeypatch):
    from neuron_dist import debug
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.setenv("NEURON_DIST_CHECK", "false")
    assert debug.env_wanted() is False


def test_each_group_reads_the_check_setting_as_it_is_made():
    """NEURON_DIST_CHECK was read once per process: a world re-made under another value kept
    the first group's reading, and a bad value after a good one passed unseen (as it did under
    TORCH_DISTRIBUTED_DEBUG=DETAIL). Each group reads it as it is made (as torch decides per group
    whether to wrap a Gloo group in its checker)."""
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist, neuron_dist
        def world(value, debug=""):
            os.environ.pop("NEURON_DIST_CHECK", None)
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
            if value is not None:
                os.environ["NEURON_DIST_CHECK"] = value
            try:
                dist.init_process_group("neuron", store=dist.HashStore(), rank=0, world_size=1)
            except ValueError as e:
                return "refused: " + str(e)
            try:
                return dist.group.WORLD._get_backend(torch.device("cpu"))._checked()
            finally:
                dist.destroy_process_group()
        print([world("1"), world("0"), world(None), world("1"), world("maybe"), world("maybe", "DETAIL")])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_DIST_CHECK", "TORCH_DISTRIBUTED_DEBUG")}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = ast.literal_eval(p.stdout.strip().splitlines()[-1])
    assert got[:4] == [True, False, False, True], got
    for refused in got[4:]:  # (the second under TORCH_DISTRIBUTED_DEBUG=DETAIL, which an `or` let skip it)
        assert refused.startswith("refused: ") and "NEURON_DIST_CHECK='maybe'" in refused, got


@pytest.mark.parametrize("value", ["0", "off"])
def test_debug_off_values_import_cleanly(value):
    env = dict(os.environ, NEURON_DIST_DEBUG=value)
    p = subprocess.run([sys.executable, "-c", "import neuron_dist"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def _init_alone(cwd=None, on_thread=False, unset=(), then="", **settings) -> subprocess.CompletedProcess:
    """A one-rank init_process_group("neuron") in a fresh process with these extra settings and
    without the variables in `unset` (on_thread: made on a thread other than the main one, the
    error re-raised there; `then`: a statement run on that thread after the init)."""
    from pool import free_port
    init = f"dist.init_process_group('neuron', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)"
    if on_thread:
        code = ("import threading, torch.distributed as dist, neuron_dist\n"
                "failed = []\n"
                "def make():\n"
                f"    try: {init}; {then or 'pass'}\n"
                "    except BaseException as e: failed.append(e)\n"
                "t = threading.Thread(target=make); t.start(); t.join()\n"
                "if failed: raise failed[0]\n"
                "dist.destroy_process_group()\n")
    else:
        code = "import torch.distributed as dist, neuron_dist\n" + init + "\n"
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([sys.executable, "-c", code], env=dict(env, **settings), capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("on_thread", [False, True], ids=["main-thread", "other-thread"])
@pytest.mark.parametrize("value", ["KILL", "STOP", "FOO"])
def test_a_dump_signal_that_cannot_be_used_is_a_clear_error(value, on_thread, tmp_path):
    """NEURON_DIST_DUMP_SIGNAL=KILL gave a bare 'OSError: [Errno 22] Invalid argument' and then,
    at exit, an AttributeError from the half-built group left among the open groups; made on
    another thread, a group took any value silently (the name was read only where a handler
    can be installed, the main thread)."""
    p = _init_alone(tmp_path, on_thread, NEURON_DIST_DUMP_SIGNAL=value)
    assert p.returncode == 1 and f"NEURON_DIST_DUMP_SIGNAL={value!r}" in p.stderr, p.stderr[-2000:]
    assert "Exception ignored" not in p.stderr and "AttributeError" not in p.stderr, p.stderr[-2000:]


def test_a_dump_signal_asked_for_off_the_main_thread_is_refused_with_a_warning(tmp_path):
    """A good name on a group made off the main thread installs nothing (Python installs
    handlers only there) and says so, once per process (here three groups: a DeviceMesh made
    on a thread builds several), instead of silently."""
    p = _init_alone(tmp_path, True, then="dist.new_group([0]); dist.new_group([0])", NEURON_DIST_DUMP_SIGNAL="USR1")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count("NEURON_DIST_DUMP_SIGNAL=USR1: not installed") == 1, p.stderr[-2000:]


def test_dump_zero_writes_no_file(tmp_path):
    """NEURON_DIST_DUMP=0 means off: a failing group writes no file named '0'."""
    from pool import free_port
    code = ("import torch, torch.distributed as dist, neuron_dist\n"
            f"dist.init_process_group('neuron', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
            "g = dist.distributed_c10d._get_default_group().group\n"
            "g._dump_if_asked('test')\n"
            "dist.destroy_process_group()\n")
    env = dict(os.environ, NEURON_DIST_DUMP="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not (tmp_path / "0").exists()


def test_a_stale_rank_under_mpi_is_warned_about(own_environ):
    """Under mpirun, a RANK exported without WORLD_SIZE (left over from another launcher) won over
    the MPI rank silently: every process took rank 0 and the job failed with EADDRINUSE or a
    store time-out. It still wins (variables the user set win), but with a warning naming both."""
    import os
    import warnings
    from neuron_dist import mpi_env
    for k in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
              "SLURM_NTASKS"):
        os.environ.pop(k, None)
    os.environ.update(RANK="0", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # no MPI exchange of the address here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpi_env.adopt()
    msgs = [str(w.message) for w in caught]
    assert any("RANK=0" in m and "rank 1" in m for m in msgs), msgs
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "2"
    os.environ["RANK"] = "1"  # agreeing: no warning
    del os.environ["WORLD_SIZE"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpi_env.adopt()
    assert not [w for w in caught if "neuron_dist" in str(w.message)]


_MPIRUN = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1"}  # a process mpirun started
_TORCHRUN_WORKER = dict(_MPIRUN, TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0", RANK="3",
                        WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


@pytest.mark.parametrize("env, why", [
    (_MPIRUN, None),
    (dict(_MPIRUN, RANK="1", WORLD_SIZE="2"), None),        # RANK from mpi_env.adopt, or the program's own
    ({"PMIX_RANK": "0"}, None),                              # srun --mpi=pmix: no world size to compare
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "1"}, None),
    ({}, "not started by mpirun"),
    (_TORCHRUN_WORKER, "worker of torchrun or neuronrun (TORCHELASTIC_RUN_ID is set), whose OMPI_COMM_WORLD_RANK=1"),
    (dict(_MPIRUN, RANK="0"), "RANK=0 is not the MPI job's OMPI_COMM_WORLD_RANK=1"),
    (dict(_MPIRUN, WORLD_SIZE="4"), "WORLD_SIZE=4 is not the MPI job's OMPI_COMM_WORLD_SIZE=2"),
])
def test_an_mpi_rank_is_a_process_mpirun_started(env, why):
    """A torchrun worker under mpirun inherits its agent's OMPI/PMIx variables: it was taken for
    an MPI process (the mpi transport between hosts, "ranks 2 and 3 are both MPI rank 1", or a
    restarted worker blocked in MPI_Init). An MPI rank is a process with the variables, no
    elastic agent's, and RANK/WORLD_SIZE (where set) the MPI world's."""
    from neuron_dist import mpi_env
    got = mpi_env.not_an_mpi_rank(env)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got, got


def test_a_torchrun_worker_takes_no_rendezvous_variables_from_mpi():
    """Its MPI and Slurm variables are its agent's (the node's K workers share them): torchrun
    gives it RANK, WORLD_SIZE and MASTER_*, and mpi_env must fill in none from MPI's."""
    from neuron_dist import mpi_env
    assert mpi_env.launcher_vars(_MPIRUN) == {"RANK": "1", "WORLD_SIZE": "2"}
    bare = {k: v for k, v in _TORCHRUN_WORKER.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert mpi_env.launcher_vars(bare) == {}
    assert mpi_env.launcher_vars(dict(bare, SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0")) == {}


@pytest.mark.parametrize("hosts, one_node, resolves, routes, addr", [
    (["n0", "n0"], True, {}, {}, "127.0.0.1"),                                  # one host: loopback
    (["n0", "n1"], False, {"n0": "10.0.0.5"}, {}, "10.0.0.5"),                  # rank 0's name resolves
    (["n0", "n1", "n1"], False, {"n0": "127.0.1.1"}, {"n1": "10.0.0.5"}, "10.0.0.5"),  # Debian's /etc/hosts
    (["n0", "n1", "n2"], False, {"n0": "127.0.0.1"}, {"n2": "10.0.0.5"}, "10.0.0.5"),  # n1 does not resolve
    (["n0", "n1"], False, {}, {"n1": "10.0.0.5"}, "10.0.0.5"),                  # n0 does not resolve
    (["n0", "n1"], False, {"n0": "127.0.1.1"}, {"n1": "127.0.0.1"}, None),      # every route is loopback
    (["n0", "n0"], False, {"n0": "127.0.0.1"}, {}, None),                       # two nodes, one name
])
def test_mpirun_across_hosts_hands_out_no_loopback_master(monkeypatch, hosts, one_node, resolves, routes, addr):
    """Under a multi-host mpirun, rank 0 handed out its host name's address as MASTER_ADDR, with
    no loopback check: where the name maps to 127.0.0.1 or 127.0.1.1, the ranks on the other
    hosts dialled their own loopback and waited out the store's connect time-out. Rank 0 must
    take its address on the route to another rank's host instead, or hand out none, saying why."""
    import socket
    from neuron_dist import errors, hosts as hosts_mod, mpi_env

    def resolve(name):
        if name not in resolves:
            raise socket.gaierror(-2, "Name or service not known")
        return resolves[name]

    def route(host, what=""):
        if host not in routes:
            raise errors.GroupError(f"cannot resolve {what} {host!r}")
        return routes[host]

    monkeypatch.setattr(socket, "gethostbyname", resolve)
    monkeypatch.setattr(hosts_mod, "route_from", route)
    got, why = mpi_env.master_addr(hosts, one_node)
    assert got == addr, (got, why)
    if addr is None:
        assert "rank 0's host name 'n0'" in why and "loopback" in why, why


class _FakeComm:
    """MPI_COMM_WORLD as rank 0 of `size` processes on `hosts` sees it: gather and bcast at the root."""
    rank = 0

    def __init__(self, hosts):
        self.hosts, self.size = hosts, len(hosts)

    def gather(self, value, root=0):
        return list(self.hosts)

    def bcast(self, value, root=0):
        return value


def _fake_mpi(monkeypatch, hosts):
    import types
    from neuron_dist import mpi_env
    monkeypatch.setattr(mpi_env, "mpi", lambda: types.SimpleNamespace(COMM_WORLD=_FakeComm(hosts)))


@pytest.mark.parametrize("local_size, one_node", [("4", True), ("2", False)])
def test_rank_0_under_mpirun_counts_one_node_by_the_local_size(monkeypatch, local_size, one_node):
    """Rank 0 takes the job for one node (and hands out loopback) only when Open MPI counts every
    rank on its node: a job whose hosts report one name (containers) but span nodes must not get
    127.0.0.1, which the other nodes' ranks would dial on their own host."""
    from neuron_dist import mpi_env
    _fake_mpi(monkeypatch, ["n0"] * 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", local_size)
    seen = []
    monkeypatch.setattr(mpi_env, "master_addr", lambda hosts, one: (seen.append((hosts, one)), ("10.0.0.5", ""))[1])
    addr, port, why = mpi_env._master_from_mpi()
    assert seen == [(["n0"] * 4, one_node)] and addr == "10.0.0.5" and port.isdigit(), (seen, addr, port, why)


def test_rank_0_failing_to_choose_a_master_tells_every_rank(monkeypatch):
    """Whatever fails on rank 0 while it chooses MASTER_ADDR/PORT is broadcast as the reason:
    raised there instead, rank 0 died and every other rank waited in the broadcast for good."""
    from neuron_dist import mpi_env

    def no_port(host=""):
        raise OSError(98, "no free port")
    _fake_mpi(monkeypatch, ["n0", "n0"])
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    monkeypatch.setattr(mpi_env, "free_port", no_port)
    addr, port, why = mpi_env._master_from_mpi()
    assert addr is None and port == "" and why == "rank 0 could not choose one: OSError: [Errno 98] no free port", why


def test_under_mpirun_the_users_master_port_wins(monkeypatch, own_environ):
    """With MASTER_PORT exported and MASTER_ADDR not, rank 0 still chooses both through MPI, but
    only the missing address is taken: the user's port (one the firewall allows) is kept."""
    import os
    from neuron_dist import mpi_env
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "PMI_RANK", "PMI_SIZE",
              "SLURM_PROCID", "SLURM_NTASKS") + mpi_env.ELASTIC_VARS:
        os.environ.pop(k, None)
    os.environ.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2",
                      MASTER_PORT="38511")
    _fake_mpi(monkeypatch, ["n0", "n0"])
    mpi_env.adopt()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "38511")


def test_a_program_that_imported_neuronrun_first_still_takes_its_mpi_rank():
    """neuron_dist skipped taking RANK/WORLD_SIZE from MPI or PMI in any process that had imported
    neuronrun_launcher first, for when the launcher read topology models through neuron_dist (a
    launcher is no rank). It no longer imports neuron_dist (instances.py loads the models' file on
    its own), so the guard only broke such programs: under mpirun they found no RANK."""
    code = ("import os, sys\n"
            "from neuronrun_launcher import instances\n"
            "instances.get_instance('trn2.48xlarge')\n"
            "assert 'neuron_dist' not in sys.modules, 'the launcher imported neuron_dist'\n"
            "import neuron_dist\n"
            "print(os.environ.get('RANK'), os.environ.get('WORLD_SIZE'))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
           and not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    env.update(PMI_RANK="0", PMI_SIZE="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["0", "1"], (p.stdout, p.stderr[-2000:])


def test_config_lists_every_variable_the_backend_reads():
    """config.py's docstring is the list of every NEURON_DIST_* variable, and README's table the
    user's: NEURON_DIST_SCRATCH_BYTES (collectives/scratch.py) was missing from the first."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    used = set()
    for d, _, files in os.walk(os.path.join(root, "neuron_dist")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    used.update(re.findall(r"NEURON_DIST_[A-Z_]*[A-Z]", fh.read()))
    listed = set(re.findall(r"^(NEURON_DIST_[A-Z_]*[A-Z]) ", config.__doc__, re.M))
    with open(os.path.join(root, "README.md")) as fh:
        readme = set(re.findall(r"`(NEURON_DIST_[A-Z_]*[A-Z])`", fh.read()))
    assert len(used) > 10, used
    assert used - listed == set(), f"read in neuron_dist/ but not listed in config.py: {sorted(used - listed)}"
    assert used - readme == set(), f"read in neuron_dist/ but not in README: {sorted(used - readme)}"

# A Slurm allocation's own shells: an sbatch script (its step named "batch" or numbered, or not
# set at all), salloc's shell and its interactive step, the extern step; and srun's tasks.
_SLURM_JOB = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "trn[01-02]",
              "SLURM_TASKS_PER_NODE": "1(x2)"}
_NOT_SRUN = [{}, {"SLURM_STEP_ID": "batch"}, {"SLURM_STEP_ID": "4294967291"}, {"SLURM_STEPID": "extern"},
             {"SLURM_STEP_ID": "interactive"}, {"SLURM_STEP_ID": "4294967290"}]
_SRUN = [{"SLURM_STEP_ID": "0"}, {"SLURM_STEPID": "3"}, {"SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"},
         {"SLURM_STEP_ID": "batch", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}]


@pytest.mark.parametrize("step", _NOT_SRUN)
def test_slurm_variables_outside_an_srun_task_are_no_launch(step):
    """A batch or salloc shell carries SLURM_PROCID=0 and the allocation's SLURM_NTASKS: a
    `python train.py` started from it was taken for rank 0 of that many, and
    init_process_group waited its whole time-out (30 min) for ranks that never come."""
    from neuron_dist import mpi_env
    env = dict(_SLURM_JOB, **step)
    assert mpi_env.launcher_vars(env) == {}
    assert not mpi_env.in_srun_task(env)


@pytest.mark.parametrize("step", _SRUN)
def test_slurm_variables_inside_an_srun_task_are_the_launch(step):
    from neuron_dist import mpi_env
    env = dict(_SLURM_JOB, SLURM_PROCID="1", SLURM_NODEID="1", **step)
    assert mpi_env.launcher_vars(env) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                          "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"}
    assert mpi_env.in_srun_task(env)


def test_an_error_about_numbers_neuron_dist_adopted_names_the_launchers_variables(monkeypatch, own_environ):
    """Values the backend took from Slurm's variables are named with them in an error: two tasks
    given SLURM_LOCALID=0 read "ranks 0 and 1 both use core 0 ... more ranks than cores or
    overlapping NEURON_RT_VISIBLE_CORES", and SLURM_LOCALID=5 "local rank 5 of 2", naming
    variables the user never set (review S). Values the user set are named as they are."""
    from neuron_dist import mpi_env
    env = dict(_SLURM_JOB, SLURM_PROCID="1", SLURM_NODEID="0", SLURM_LOCALID="5", SLURM_STEP_ID="0",
               SLURM_STEP_TASKS_PER_NODE="2")
    sources = {}
    assert mpi_env.launcher_vars(env, sources=sources)["LOCAL_RANK"] == "5"
    assert sources == {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID",
                       "LOCAL_WORLD_SIZE": "SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID 0",
                       "GROUP_RANK": "SLURM_NODEID"}, sources
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_ID", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    os.environ.update(env, LOCAL_WORLD_SIZE="2")  # LOCAL_WORLD_SIZE: the user's own, not named as adopted
    monkeypatch.setattr(mpi_env, "ADOPTED", {})
    mpi_env.adopt()
    assert mpi_env.adopted_note(["LOCAL_RANK", "LOCAL_WORLD_SIZE"]) == \
        " (neuron_dist took LOCAL_RANK=5 from SLURM_LOCALID)"
    os.environ["LOCAL_RANK"] = "2"  # the program's own value since: not credited to Slurm
    assert mpi_env.adopted_note(["LOCAL_RANK"]) == ""
    monkeypatch.setattr(mpi_env, "ADOPTED", {})
    assert mpi_env.adopted_note(["LOCAL_RANK"]) == ""


def test_the_ranks_taken_from_mpiruns_variables_name_them():
    """Under mpirun, the numbers neuron_dist takes are credited to Open MPI's variables in an
    error about them, as Slurm's are."""
    from neuron_dist import mpi_env
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    sources = {}
    assert mpi_env.launcher_vars(env, sources=sources) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                                           "LOCAL_WORLD_SIZE": "2"}
    assert sources == {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
                       "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
                       "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}, sources


def test_two_srun_tasks_given_one_local_rank_are_told_it_came_from_slurm(tmp_path):
    """Two tasks both given SLURM_LOCALID=0 fail on one core used twice, and the error names the
    variable neuron_dist took that local rank from (the note on the topology's failure)."""
    from pool import free_port
    port = free_port()
    unset = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_ID", "NODE_RANK")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    procs = []
    for r in (0, 1):
        code = ("import torch.distributed as dist, neuron_dist\n"
                f"dist.init_process_group('neuron', init_method='tcp://127.0.0.1:{port}', rank={r}, world_size=2)\n")
        env = dict(base, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_NTASKS="2",
                   SLURM_NODEID="0", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 1 and "both use core" in err and "LOCAL_RANK=0 from SLURM_LOCALID" in err, err[-2000:]


def test_a_group_whose_local_rank_came_from_slurm_says_so_when_it_is_wrong(tmp_path):
    """The same, end to end: an srun task's bad SLURM_LOCALID fails init_process_group naming it."""
    p = _init_alone(tmp_path, unset=("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_ID",
                                     "NODE_RANK"),
                    SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_NODEID="0",
                    SLURM_LOCALID="3", SLURM_STEP_TASKS_PER_NODE="1", SLURM_JOB_NODELIST="localhost")
    assert p.returncode == 1 and "local rank 3 of 1" in p.stderr and "LOCAL_RANK=3 from SLURM_LOCALID" in p.stderr, \
        p.stderr[-2000:]


@pytest.mark.parametrize("step", _NOT_SRUN + _SRUN)
def test_the_backend_and_neuronrun_agree_on_what_an_srun_task_is(step):
    """mpi_env keeps its own copy of neuronrun's rule (the backend may not import the launcher,
    which imports the backend only lazily): the two must not drift apart."""
    from neuronrun_launcher import scheduler
    from neuron_dist import mpi_env
    env = dict(_SLURM_JOB, **step)
    assert (scheduler.detect(env) is not None) == mpi_env.in_srun_task(env)
    assert set(mpi_env._NON_SRUN_STEPS) == set(scheduler._NON_SRUN_STEPS)


def test_the_backend_and_neuronrun_agree_on_what_marks_an_mpi_process():
    """neuronrun keeps its own copy of the variables every process an MPI launcher starts has
    (it must start without torch): it strips a launcher's per-process variables only under one,
    and the backend takes a process for an MPI rank by the same marks."""
    from neuronrun_launcher import worker
    from neuron_dist import mpi_env
    assert set(worker.MPI_LAUNCHER_MARKS) == set(mpi_env.MPI_RANK_VARS)


# Task 64 of `srun -N2 -n128 python train.py`: no --ntasks-per-node, so no SLURM_NTASKS_PER_NODE;
# Slurm gives the step's tasks per node compressed ("64(x2)") and the task's node (SLURM_NODEID).
_SRUN_128 = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
             "SLURM_PROCID": "64", "SLURM_NTASKS": "128", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
             "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "64(x2)"}


@pytest.mark.parametrize("extra, local", [
    ({}, "64"),
    ({"SLURM_TASKS_PER_NODE": "3,64(x2)"}, "64"),  # uneven: node 1 is the first of the "64(x2)"
    ({"SLURM_STEP_TASKS_PER_NODE": "64,36", "SLURM_TASKS_PER_NODE": "128"}, "36"),  # the step's counts win
    ({"SLURM_TASKS_PER_NODE": "64,36", "SLURM_NTASKS_PER_NODE": "64"}, "36"),  # -n100 --ntasks-per-node=64
])
def test_an_srun_task_without_ntasks_per_node_gets_its_nodes_task_count_and_number(extra, local):
    """`srun -N2 -n128 python train.py` failed at init (Gloo runs): without --ntasks-per-node no
    LOCAL_WORLD_SIZE came from Slurm, the placement took all 128 ranks for one node ("128 processes
    per node but trn2.48xlarge at LNC=2 has only 64 logical cores per node"). The node's count comes
    from the step's tasks per node at SLURM_NODEID, and the node number from SLURM_NODEID."""
    from neuron_dist import mpi_env
    from neuron_dist.topology import placement_from_env
    env = dict(_SRUN_128, **extra)
    got = mpi_env.launcher_vars(env)
    assert got == {"RANK": "64", "WORLD_SIZE": "128", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": local,
                   "GROUP_RANK": "1"}
    slot = placement_from_env(dict(env, **got), 64, 128, 0, int(local))
    assert (slot.node, slot.chip, slot.cores) == (1, 0, (0,))


def test_a_node_number_the_user_set_wins_over_slurms():
    """Variables the user set win: with NODE_ID (or GROUP_RANK, NODE_RANK) exported, SLURM_NODEID
    adds no GROUP_RANK, which placement would read first."""
    from neuron_dist import mpi_env
    for var in ("GROUP_RANK", "NODE_ID", "NODE_RANK"):
        got = mpi_env.launcher_vars(dict(_SRUN_128, **{var: "5"}))
        assert "GROUP_RANK" not in got and got["LOCAL_WORLD_SIZE"] == "64", (var, got)


# What MPI's launchers add to a task: `srun --mpi=pmi2` (Slurm's plugin: rank and size only), and
# MPICH's mpiexec (Hydra, also its local numbers) and Open MPI's mpirun inside an allocation, whose
# ranks inherit the Slurm variables of the step that started the launcher's daemons (one per node).
_PMI2 = {"PMI_RANK": "64", "PMI_SIZE": "128", "PMI_JOBID": "77.0", "PMI_FD": "9"}
_DAEMON_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
                "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("env, want", [
    (dict(_SRUN_128, **_PMI2),  # srun --mpi=pmi2 -N2 -n128: Slurm's per-node numbers, as without --mpi
     {"RANK": "64", "WORLD_SIZE": "128", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "64", "GROUP_RANK": "1"}),
    (dict(_SRUN_128, **_PMI2, SLURM_NTASKS_PER_NODE="64", SLURM_TASKS_PER_NODE="junk"),  # the request, at worst
     {"RANK": "64", "WORLD_SIZE": "128", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "64", "GROUP_RANK": "1"}),
    (dict(_DAEMON_STEP, PMI_RANK="3", PMI_SIZE="4", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2"),  # mpiexec
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    (dict(_DAEMON_STEP, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
          OMPI_COMM_WORLD_LOCAL_SIZE="2", PMIX_RANK="3"),  # Open MPI's mpirun
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    (dict(_DAEMON_STEP, PMI_RANK="3", PMI_SIZE="4"),  # no local numbers, but Slurm's are another step's
     {"RANK": "3", "WORLD_SIZE": "4"}),
    (dict(_DAEMON_STEP, PMI_RANK="1", PMI_SIZE="4"),  # the same, its rank by chance the daemon's task number
     {"RANK": "1", "WORLD_SIZE": "4"}),
    (dict(_PMI2, MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2"),  # mpiexec without Slurm: as it was
     {"RANK": "64", "WORLD_SIZE": "128", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
])
def test_an_srun_pmi2_task_gets_its_nodes_numbers_and_an_mpi_launchers_own_win(env, want):
    """`srun --mpi=pmi2` without torchrun: the PMI variables were read first, and with them
    MPICH's local numbers, which Slurm does not set; so no LOCAL_* and no GROUP_RANK came, the
    placement took the world for one node, and every task failed init_process_group ("4
    processes per node but mini2 at LNC=1 has only 2 logical cores per node") where the same
    tasks without the PMI variables ran. An MPI launcher's own local numbers still win: under
    mpiexec or mpirun inside an allocation the Slurm variables are those of the launcher's
    daemon step (SLURM_LOCALID=0 on every rank)."""
    from neuron_dist import mpi_env
    from neuron_dist.topology import placement_from_env
    got = mpi_env.launcher_vars(env)
    assert got == want
    if "GROUP_RANK" in want:
        slot = placement_from_env(dict(env, **got), 64, 128, 0, 64)
        assert (slot.node, slot.chip, slot.cores) == (1, 0, (0,))


@pytest.mark.parametrize("spec, counts", [("64(x2)", [64, 64]), ("64(x2),3", [64, 64, 3]), ("5", [5]),
                                          ("2,1(x3),4", [2, 1, 1, 1, 4]), ("", None), ("64(x)", None),
                                          ("x2", None), ("64(2)", None)])
def test_slurm_tasks_per_node_expands_slurms_compressed_counts(spec, counts):
    from neuron_dist import mpi_env
    assert mpi_env.slurm_tasks_per_node(spec) == counts


def test_two_srun_tasks_on_two_nodes_without_ntasks_per_node_meet(tmp_path):
    """End to end: two srun tasks, one per node of an instance with one core per node, no
    --ntasks-per-node and no node number of the user's; init_process_group('neuron') refused
    both ("2 processes per node but onecore at LNC=1 has only 1 logical cores per node") where
    Gloo ran."""
    from pool import free_port
    (tmp_path / "onecore.json").write_text(
        '{"name": "onecore", "chips": 1, "physical_cores_per_chip": 1, "default_lnc": 1, "supported_lnc": [1],'
        ' "graph": "single", "hbm_bandwidth": "800 GB/s", "efa_bandwidth": "100 Gbps", "multi_node": true}')
    code = ("import datetime, os, torch, torch.distributed as dist, neuron_dist\n"
            "dist.init_process_group('neuron', timeout=datetime.timedelta(seconds=30))\n"
            "t = torch.ones(3)\n"
            "dist.all_reduce(t)\n"
            "print('rank', dist.get_rank(), 'node', os.environ['GROUP_RANK'], 'local', "
            "os.environ['LOCAL_WORLD_SIZE'], 'sum', t.tolist(), flush=True)\n"
            "dist.destroy_process_group()\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_")) and k not in
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_ID", "NODE_RANK")}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=dict(base, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID=str(r),
                                                  SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(r),
                                                  SLURM_NNODES="2", SLURM_TASKS_PER_NODE="1(x2)",
                                                  SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_ADDR="127.0.0.1",
                                                  MASTER_PORT=port,
                                                  NEURON_DIST_INSTANCE=str(tmp_path / "onecore.json")))
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, out[-3000:]
        assert f"rank {r} node {r} local 1 sum [2.0, 2.0, 2.0]" in out, out[-3000:]


def test_debug_with_an_unknown_subsystem_warns_and_lines_carry_the_rank_set_later(tmp_path):
    """NEURON_DIST_DEBUG=bogus raised at `import neuron_dist`, in programs that might never
    init the backend; and debug lines said 'rank ?' when RANK was set after the import (bench's
    spawned ranks). Now: a warning naming the variable, the known subsystems still log, and the
    rank is read when a line is written."""
    code = ("import os, logging, neuron_dist\n"
            "os.environ['RANK'] = '5'\n"
            "logging.getLogger('neuron_dist.init').debug('hello')\n")
    env = dict(os.environ, NEURON_DIST_DEBUG="INIT,bogus")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "NEURON_DIST_DEBUG names unknown subsystems ['BOGUS'], ignored" in p.stderr, p.stderr[-2000:]
    assert "[neuron_dist rank 5] neuron_dist.init DEBUG: hello" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_frame_above_what_a_receiver_accepts_is_refused_at_init(transport):
    """NEURON_DIST_FRAME_BYTES above the 1 GiB a receiver accepts in one frame passed set-up, and
    then every message larger than 1 GiB failed (over zmq as 'rank 0 is gone', the root
    returning success). Now init refuses it, naming the variable."""
    p = _init_alone(NEURON_DIST_FRAME_BYTES=str((1 << 30) + 4096), NEURON_DIST_TRANSPORT=transport)
    assert p.returncode != 0, p.stdout + p.stderr
    assert f"NEURON_DIST_FRAME_BYTES='{(1 << 30) + 4096}' must be at most {1 << 30}" in p.stderr, p.stderr[-2000:]


def test_a_negative_scratch_bytes_setting_is_refused_at_init():
    p = _init_alone(NEURON_DIST_SCRATCH_BYTES="-1")
    assert p.returncode != 0, p.stdout + p.stderr
    assert "NEURON_DIST_SCRATCH_BYTES='-1' must be at least 0" in p.stderr, p.stderr[-2000:]


def test_scratch_is_one_buffer_kept_within_its_limit():
    """The collectives' shared scratch (collectives/scratch.py): one buffer, grown to a power of
    two as calls need more, handed out viewed as the call's dtype; a call past the limit gets a
    buffer of its own and leaves the kept one alone; limit 0 keeps nothing."""
    import torch
    from neuron_dist.collectives.scratch import Scratch
    s = Scratch(4 << 20)
    a = s.take(1000, torch.float32)
    assert a.dtype == torch.float32 and a.numel() == 1000 and s.kept_bytes == 4096
    b = s.take(500, torch.float64)  # fits: the same memory, another dtype
    assert b.dtype == torch.float64 and b.numel() == 500 and b.data_ptr() == a.data_ptr()
    c = s.take(3000, torch.bfloat16)  # 6000 bytes: grows to 8 KiB
    assert s.kept_bytes == 8192 and c.numel() == 3000
    c.fill_(1.5)
    assert float(c.float().sum()) == 4500.0
    big = s.take(5 << 20, torch.uint8)  # past the limit: its own buffer
    assert big.numel() == 5 << 20 and s.kept_bytes == 8192 and big.data_ptr() != c.data_ptr()
    s.take(3 << 20, torch.uint8)  # grows, capped at the limit
    assert s.kept_bytes == 4 << 20
    s.clear()
    assert s.kept_bytes == 0
    none = Scratch(0)
    none.take(10, torch.float32)
    assert none.kept_bytes == 0
