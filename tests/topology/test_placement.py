import json

import pytest

from neuron_dist.topology import GroupTopology, Slot, get_instance, place, placement_from_env
from neuron_dist.topology.placement import make_slot, parse_visible_cores


def test_defaults_trn2_lnc2():
    s = placement_from_env({}, rank=5, world_size=16, local_rank=5, local_world_size=8)
    assert (s.node, s.chip, s.cores, s.lnc, s.instance) == (0, 1, (5,), 2, "trn2.48xlarge")
    s = placement_from_env({}, rank=13, world_size=16, local_rank=5, local_world_size=8)
    assert s.node == 1


def test_env_visible_cores_and_lnc():
    env = {"NEURON_RT_VISIBLE_CORES": "8-15", "NEURON_LOGICAL_NC_CONFIG": "1", "GROUP_RANK": "3"}
    s = placement_from_env(env, 0, 8, 0, 2)
    assert s.node == 3 and s.cores == tuple(range(8, 16)) and s.chip == 1 and s.lnc == 1
    s = placement_from_env({"NEURON_RT_VISIBLE_CORES": "7", "NEURON_DIST_INSTANCE": "trn1.32xlarge"},
                           0, 1, 0, 1)
    assert s.chip == 3 and s.lnc == 1 and s.instance == "trn1.32xlarge"
    assert parse_visible_cores("0,2-3") == (0, 2, 3)


@pytest.mark.parametrize("env,args,match", [
    ({"NEURON_RT_VISIBLE_CORES": "60-70"}, (0, 1, 0, 1), "out of bounds"),
    ({"NEURON_RT_VISIBLE_CORES": "a-b"}, (0, 1, 0, 1), "inclusive range"),
    ({"NEURON_RT_VISIBLE_CORES": "5-3"}, (0, 1, 0, 1), "inclusive range"),
    ({"NEURON_LOGICAL_NC_CONFIG": "3"}, (0, 1, 0, 1), "LNC"),
    ({"NEURON_DIST_INSTANCE": "trn1.32xlarge"}, (0, 40, 0, 40), "only 32 logical cores"),
    ({}, (0, 200, 0, 100), "only 64 logical cores"),
    ({"NEURON_DIST_INSTANCE": "inf2.48xlarge"}, (30, 48, 6, 24), "single-instance|multi-node"),
    ({}, (3, 2, 0, 1), "bad rank"),
])
def test_env_errors(env, args, match):
    with pytest.raises(ValueError, match=match):
        placement_from_env(env, *args)


@pytest.mark.parametrize("var", ["GROUP_RANK", "NODE_ID", "NODE_RANK"])
@pytest.mark.parametrize("value, match", [("abc", "expected a node index, an integer >= 0"),
                                          ("1.5", "expected a node index, an integer >= 0"),
                                          ("-1", "a node index must be >= 0")])
def test_a_bad_node_variable_is_an_error_naming_it(var, value, match):
    """NODE_RANK=abc said only "invalid literal for int()", NODE_ID=-1 "bad slot Slot(node=-1...)":
    neither named the variable."""
    with pytest.raises(ValueError, match=f"^{var}={value!r}: {match}"):
        placement_from_env({var: value}, 0, 2, 0, 1)


def test_the_first_node_variable_set_names_the_node():
    assert placement_from_env({"GROUP_RANK": "2", "NODE_ID": "abc"}, 0, 8, 0, 2).node == 2
    assert placement_from_env({"GROUP_RANK": "", "NODE_ID": "1", "NODE_RANK": "-1"}, 0, 8, 0, 2).node == 1
    assert placement_from_env({"NODE_RANK": "0"}, 5, 8, 1, 2).node == 0
    assert placement_from_env({}, 5, 8, 1, 2).node == 2


def test_num_cores_without_visible_cores_places_m_cores_per_process():
    """The runtime's NEURON_RT_NUM_CORES=M alone (torchrun, no core list): each process holds M
    consecutive cores, as neuronrun --cores-per-rank M lays them out; it was read as one core
    per local rank (trn1, M=2, 4 ranks: chips 0, 0, 1, 1 instead of one each), and asking for
    more cores than the node has passed (a review's probe)."""
    env = {"NEURON_RT_NUM_CORES": "2", "NEURON_DIST_INSTANCE": "trn1.32xlarge"}
    slots = [placement_from_env(env, r, 4, r, 4) for r in range(4)]
    assert [s.cores for s in slots] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.chip for s in slots] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="NEURON_RT_NUM_CORES=16 x 4 processes per node needs 64 cores"):
        placement_from_env(dict(env, NEURON_RT_NUM_CORES="16"), 0, 4, 0, 4)
    for bad in ("0", "x", "-1"):
        with pytest.raises(ValueError, match="expected a positive number of cores per process"):
            placement_from_env(dict(env, NEURON_RT_NUM_CORES=bad), 0, 4, 0, 4)
    assert placement_from_env(dict(env, NEURON_RT_VISIBLE_CORES="5"), 0, 4, 0, 4).cores == (5,)  # the list wins


def test_visible_cores_errors_name_every_form_the_runtime_takes():
    """The runtime takes an index, a range or a comma-separated list of both (since 2.16); the
    message named only the first two although the list was accepted."""
    assert parse_visible_cores("0, 2-3,5") == (0, 2, 3, 5)
    with pytest.raises(ValueError, match="comma-separated list of them like '0,2-3'"):
        parse_visible_cores("0;1")
    with pytest.raises(ValueError, match="lists a core twice"):
        parse_visible_cores("0-2,1")


@pytest.mark.parametrize("spec", ["1_0", "+3", "0,+3", "\u0663", "3-1", "1,,2", "-1"])
def test_visible_cores_take_digits_only_as_neuronrun_does(spec):
    """`int` alone took "1_0" as core 10 and "+3" as core 3, values neuronrun refuses (a review's
    finding: the two parsers disagreed): the backend now refuses them too, with the same message
    as any other malformed value, and neuronrun's parser agrees on each."""
    with pytest.raises(ValueError, match="expected a core index like '5'"):
        parse_visible_cores(spec)
    launcher_config = pytest.importorskip("neuronrun_launcher.config")
    with pytest.raises(Exception, match="NEURON_RT_VISIBLE_CORES"):
        launcher_config.visible_pool(spec)


def test_slot_roundtrip_json():
    s = Slot(node=2, chip=3, cores=(12, 13), lnc=1, instance="trn2.48xlarge")
    assert Slot.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_group_topology_helpers_and_validate():
    topo = place("trn2.48xlarge", 2, 8)
    assert topo.size == 16 and topo.nodes == [0, 1]
    assert topo.same_node(0, 7) and not topo.same_node(7, 8)
    assert topo.same_chip(0, 3) and not topo.same_chip(3, 4)
    assert topo.is_symmetric()
    inst = get_instance("trn2")
    dup = GroupTopology(inst, (make_slot(inst, 0, [1]), make_slot(inst, 0, [1])))
    with pytest.raises(ValueError, match="both use core 1"):
        dup.validate()
    asym = GroupTopology(inst, (make_slot(inst, 0, [0]), make_slot(inst, 0, [1]),
                                make_slot(inst, 1, [0])))
    asym.validate()  # (a group need not be symmetric: graph.py only looks whether it is)
    assert not asym.is_symmetric()
    mixed = GroupTopology(inst, (make_slot(inst, 0, [0], lnc=2), make_slot(inst, 0, [9], lnc=1)))
    with pytest.raises(ValueError, match="disagree"):
        mixed.validate()
    other = GroupTopology(inst, (Slot(0, 0, (0,), 2, "trn1.32xlarge"),))
    with pytest.raises(ValueError, match="NEURON_DIST_INSTANCE"):
        other.validate()
    with pytest.raises(ValueError, match="need 70 cores"):
        place("trn2", 1, 70)
    with pytest.raises(ValueError, match="single-instance"):
        place("inf2.48xlarge", 2, 4)


def test_place_cores_chip_by_chip():
    topo = place("trn2", 1, 16, lnc=1)
    assert [s.chip for s in topo.slots] == [0] * 8 + [1] * 8
    topo = place("trn1.32xlarge", 1, 4, cores_per_rank=8)
    assert [s.chip for s in topo.slots] == [0, 4, 8, 12]
