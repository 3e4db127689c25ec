"""Slot assignment and scheduler parsing: pure functions, exhaustively."""

from __future__ import annotations

import pytest

from neuronrun_launcher import instances, scheduler
from neuronrun_launcher.plan import NeuronPlan, check_host_port, format_cpus, neuron_env, rank_cpus
from neuronrun_launcher.slots import PlacementError, assign_slots, local_slot, parse_core_range


def test_trn2_default_lnc2_fills_chip_by_chip():
    slots = assign_slots(2, 64, cores_per_chip=4, chips=16)
    assert len(slots) == 128
    s = slots[5]
    assert (s.rank, s.local_rank, s.node_rank, s.first_core, s.chips, s.visible_cores) == (5, 5, 0, 5, (1,), "5")
    last = slots[-1]
    assert (last.rank, last.local_rank, last.node_rank, last.chips, last.visible_cores) == (127, 63, 1, (15,), "63")
    assert {s.world_size for s in slots} == {128} and {s.local_world_size for s in slots} == {64}


def test_nodes_are_symmetric():
    slots = assign_slots(3, 8, cores_per_chip=2, chips=16, cores_per_rank=2)
    per_node = [[(s.local_rank, s.visible_cores) for s in slots if s.node_rank == n] for n in range(3)]
    assert per_node[0] == per_node[1] == per_node[2]
    assert [s.rank for s in slots] == list(range(24))


@pytest.mark.parametrize("m, expect", [
    (1, ["0", "1", "2", "3", "4"]),
    (2, ["0-1", "2-3", "4-5", "6-7", "8-9"]),
    (4, ["0-3", "4-7", "8-11", "12-15", "16-19"]),
    (8, ["0-7", "8-15", "16-23", "24-31", "32-39"]),
])
def test_cores_per_rank_ranges(m, expect):
    # trn2 at LNC 1: 8 logical cores per chip
    got = [local_slot(lr, nproc_per_node=5, cores_per_chip=8, chips=16, cores_per_rank=m).visible_cores
           for lr in range(5)]
    assert got == expect


def test_range_spanning_whole_chips_reports_all_chips():
    s = local_slot(1, nproc_per_node=2, cores_per_chip=2, chips=16, cores_per_rank=4)
    assert (s.visible_cores, s.chips, s.chip_label) == ("4-7", (2, 3), "2-3")


@pytest.mark.parametrize("m, k", [(3, 4), (3, 8), (6, 4), (5, 2)])
def test_cores_per_rank_must_not_straddle_chips(m, k):
    with pytest.raises(PlacementError, match="straddles a chip"):
        local_slot(0, nproc_per_node=1, cores_per_chip=k, chips=16, cores_per_rank=m)


def test_too_many_ranks_is_a_clear_error():
    with pytest.raises(PlacementError, match=r"33 ranks x 1 core\(s\) per rank = 33 cores, but only 32"):
        assign_slots(1, 33, cores_per_chip=2, chips=16)
    with pytest.raises(PlacementError, match="use --nproc-per-node 16"):
        assign_slots(1, 17, cores_per_chip=2, chips=16, cores_per_rank=2)
    # more cores per rank than the node has: no '--nproc-per-node 0' advice (it was given)
    with pytest.raises(PlacementError, match=r"--cores-per-rank 8 is more than the node has: use at most 2$"):
        assign_slots(1, 3, cores_per_chip=2, chips=1, cores_per_rank=8)


def test_pool_from_visible_cores():
    slots = assign_slots(1, 2, cores_per_chip=4, chips=16, cores_per_rank=2, base_core=8, pool_cores=4)
    assert [(s.visible_cores, s.chips) for s in slots] == [("8-9", (2,)), ("10-11", (2,))]
    with pytest.raises(PlacementError, match="not a multiple of --cores-per-rank 2"):
        assign_slots(1, 1, cores_per_chip=4, chips=16, cores_per_rank=2, base_core=3, pool_cores=4)
    with pytest.raises(PlacementError, match="restricted to 4"):
        assign_slots(1, 5, cores_per_chip=4, chips=16, base_core=8, pool_cores=4)
    with pytest.raises(PlacementError, match="outside the instance"):
        assign_slots(1, 1, cores_per_chip=2, chips=1, base_core=1, pool_cores=2)


def test_parse_core_range():
    assert parse_core_range("5") == (5, 1)
    assert parse_core_range("4-7") == (4, 4)
    for bad in ("", "a", "7-4", "1,2", "-3"):
        with pytest.raises(PlacementError):
            parse_core_range(bad)


def test_neuron_env_root_comm_id_and_user_override():
    plan = NeuronPlan("trn1.32xlarge", 1, 16, 2, 2, 4, 0, 32)
    env = neuron_env(plan, 3, "10.0.0.1", "29500")
    assert env == {
        "NEURON_RT_VISIBLE_CORES": "6-7",
        "NEURON_RT_NUM_CORES": "2",
        "NEURON_LOGICAL_NC_CONFIG": "1",
        "NEURON_RT_ROOT_COMM_ID": "10.0.0.1:29501",
        "NEURON_DIST_INSTANCE": "trn1.32xlarge",
    }
    user = NeuronPlan("trn1.32xlarge", 1, 16, 2, 2, 4, 0, 32, root_comm_id="head:6000")
    assert neuron_env(user, 0, "10.0.0.1", 29500)["NEURON_RT_ROOT_COMM_ID"] == "head:6000"
    for v6 in ("::1", "[::1]", "fd00::5"):  # MASTER_ADDR may be an IPv6 address, bracketed or not
        root = neuron_env(plan, 0, v6, 29500)["NEURON_RT_ROOT_COMM_ID"]
        assert root == f"[{v6.strip('[]')}]:29501" and check_host_port(root, "root") == root
    assert NeuronPlan.from_json(user.to_json()) == user


@pytest.mark.parametrize("name, cores", [
    ("trn1.32xlarge", {1: 32}), ("trn1n.32xlarge", {1: 32}), ("trn1.2xlarge", {1: 2}),
    ("inf2.24xlarge", {1: 12}), ("inf2.48xlarge", {1: 24}), ("trn2.48xlarge", {1: 128, 2: 64}),
])
@pytest.mark.parametrize("use_topology", [False, True])
def test_instance_table(name, cores, use_topology):
    if use_topology:
        pytest.importorskip("neuron_dist.topology.instances")
    model = instances.get_instance(name, use_topology=use_topology)
    assert model.name == name
    assert {lnc: model.cores(lnc) for lnc in model.supported_lnc} == cores
    assert model.default_lnc == (2 if name.startswith("trn2") else 1)


def test_unknown_instance_names_known_ones():
    with pytest.raises(ValueError, match="trn1.32xlarge"):
        instances.get_instance("p5.48xlarge", use_topology=False)


# --- scheduler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
    ("trn-[8-9]-ib", ["trn-8-ib", "trn-9-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("ip-10-0-0-[5,17]", ["ip-10-0-0-5", "ip-10-0-0-17"]),
])
def test_expand_nodelist(text, hosts):
    assert scheduler.expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1", "node[a-b]", "node[3-1]", ""])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(scheduler.SchedulerError):
        scheduler.expand_nodelist(bad)


SRUN = {"SLURM_STEP_ID": "0", "SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "trn[03-05,09]", "SLURM_JOB_ID": "777"}


def test_slurm_task_env():
    info = scheduler.detect(SRUN)
    assert (info.name, info.nnodes, info.node_rank, info.master_addr, info.job_id) == ("slurm", 4, 2, "trn03", "777")
    assert info.hosts == ("trn03", "trn04", "trn05", "trn09")


def test_slurm_step_values_win_over_job_values():
    env = dict(SRUN, SLURM_STEP_NODELIST="trn[04-05]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2",
               SLURM_NODEID="1")
    info = scheduler.detect(env)
    assert (info.nnodes, info.node_rank, info.master_addr) == (2, 1, "trn04")


def test_batch_script_is_not_a_launch():
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert scheduler.detect(batch) is None
    assert scheduler.detect(dict(batch, SLURM_STEP_ID="4294967294")) is None
    assert scheduler.detect(SRUN, "none") is None
    assert scheduler.detect(batch, "slurm").node_rank == 2


def test_slurm_one_task_per_node():
    with pytest.raises(scheduler.SchedulerError, match="--ntasks-per-node=1"):
        scheduler.detect(dict(SRUN, SLURM_NTASKS="16"))


def test_mpi():
    env = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    info = scheduler.detect(env)
    assert (info.name, info.nnodes, info.node_rank, info.master_addr) == ("mpi", 3, 1, None)
    assert scheduler.detect(dict(env, MASTER_ADDR="h0")).master_addr == "h0"
    with pytest.raises(scheduler.SchedulerError, match="mpirun -N 1"):
        scheduler.detect(dict(env, OMPI_COMM_WORLD_LOCAL_SIZE="2"))


@pytest.mark.parametrize("cpus, nproc, expect", [
    ((0, 1), 2, [(0,), (1,)]),
    ((0, 1, 2, 3, 4, 5, 6, 7), 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ((0, 1, 2, 3, 4), 2, [(0, 1), (2, 3, 4)]),                  # uneven: blocks differ by one
    ((0, 1), 4, [(0,), (1,), (0,), (1,)]),                      # more ranks than CPUs: wrap, one each
    ((2, 3, 8, 9), 2, [(2, 3), (8, 9)]),                        # a restricted (taskset/cgroup) set
    ((), 3, [(), (), ()]),                                      # no binding
])
def test_rank_cpus_share_the_node_out(cpus, nproc, expect):
    got = [rank_cpus(cpus, r, nproc) for r in range(nproc)]
    assert got == expect
    if cpus and nproc <= len(cpus):  # a partition: every CPU used once
        assert sorted(c for g in got for c in g) == list(cpus)


def test_format_cpus_and_plan_round_trip():
    assert format_cpus((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11" and format_cpus((5,)) == "5" and format_cpus(()) == ""
    plan = NeuronPlan("trn2.48xlarge", 2, 16, 4, 1, 2, 0, 64, None, (0, 1, 2, 3))
    back = NeuronPlan.from_json(plan.to_json())
    assert back == plan and back.cpus(1) == (2, 3)
    old = plan.to_json().replace(',"host_cpus":[0,1,2,3]', "")  # a plan without the field: no binding
    assert "host_cpus" not in old and NeuronPlan.from_json(old).cpus(0) == ()


def test_mpich_hydra_and_srun_pmi2_are_mpi_launchers():
    """MPICH's hydra and srun --mpi=pmi2 publish PMI_SIZE/PMI_RANK only (no OMPI_*): neuronrun
    under them reads its node count and node rank from those, as README says."""
    info = scheduler.detect({"PMI_SIZE": "3", "PMI_RANK": "2", "PMI_FD": "7"})
    assert (info.name, info.nnodes, info.node_rank) == ("mpi", 3, 2)
