import json

import pytest

from neuron_dist.topology import (GroupTopology, estimate, get_instance, list_instances,
                                  load_instance, place, register_instance, ring_order)
from neuron_dist.topology.instances import InstanceModel

FIGURES = ("link_bandwidth", "link_latency", "hbm_bandwidth", "efa_bandwidth", "efa_latency",
           "domain_link_bandwidth")


def test_builtins_present():
    names = set(list_instances())
    for n in ("trn1.32xlarge", "trn1n.32xlarge", "trn1.2xlarge", "inf2.24xlarge", "inf2.48xlarge",
              "trn2.48xlarge", "trn2u.48xlarge", "trn3"):
        assert n in names


@pytest.mark.parametrize("name", ["trn1.32xlarge", "trn1n.32xlarge", "trn1.2xlarge",
                                  "inf2.24xlarge", "inf2.48xlarge", "trn2.48xlarge",
                                  "trn2u.48xlarge", "trn3"])
def test_every_figure_has_a_source(name):
    m = get_instance(name)
    for f in FIGURES + ("chips", "physical_cores_per_chip", "graph"):
        v = getattr(m, f)
        if v:
            assert m.sources.get(f), f"{name}.{f} has no source"


def test_cores_and_lnc():
    t2 = get_instance("trn2.48xlarge")
    assert t2.default_lnc == 2 and t2.supported_lnc == (1, 2)
    assert t2.cores_per_chip(2) == 4 and t2.cores(2) == 64
    assert t2.cores_per_chip(1) == 8 and t2.cores(1) == 128
    assert t2.cores() == 64
    assert get_instance("trn1.32xlarge").cores() == 32
    assert get_instance("inf2.48xlarge").cores() == 24
    assert get_instance("inf2.24xlarge").cores() == 12
    assert get_instance("trn1.2xlarge").cores() == 2
    with pytest.raises(ValueError, match="LNC"):
        get_instance("trn1.32xlarge").cores(2)


def test_graphs():
    t2 = get_instance("trn2")
    assert t2.graph == "torus" and t2.torus_dims == (4, 4) and t2.links_per_chip() == 4
    assert sorted(t2.chip_neighbours(0)) == [1, 3, 4, 12]
    assert get_instance("inf2.48xlarge").links_per_chip() == 2
    assert get_instance("trn3").graph == "switch"
    assert get_instance("trn2u.48xlarge").domain_nodes == 4
    assert not get_instance("inf2.48xlarge").multi_node
    assert get_instance("trn1n.32xlarge").efa_bandwidth == 2 * get_instance("trn1.32xlarge").efa_bandwidth


def test_unknown_instance_is_clear():
    with pytest.raises(ValueError, match="known: .*trn2.48xlarge"):
        get_instance("trn9.huge")


def _desc():
    return {"name": "test.8chip", "chips": 8, "physical_cores_per_chip": 2, "default_lnc": 1,
            "supported_lnc": [1, 2], "graph": "torus", "torus_dims": [2, 4],
            "torus_wrap": [False, True], "link_bandwidth": "100 GB/s", "link_latency": "2 us",
            "hbm_bandwidth": "1 TB/s", "efa_bandwidth": "400 Gbps", "efa_latency": "20 us",
            "multi_node": True, "sources": {"link_bandwidth": "my lab"}}


def test_user_instance_json_and_toml(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(_desc()))
    m = load_instance(p)
    assert m.link_bandwidth == 100e9 and m.link_latency == 2e-6 and m.efa_bandwidth == 50e9
    assert get_instance("test.8chip") is m
    assert get_instance(str(p)).name == "test.8chip"
    topo = place("test.8chip", 2, 16)
    assert len(ring_order(topo)) == 32
    assert estimate("allreduce", "torus", 1 << 20, topo) > 0
    t = tmp_path / "mine.toml"
    t.write_text('name = "test.toml"\nchips = 4\nphysical_cores_per_chip = 1\ndefault_lnc = 1\n'
                 'supported_lnc = [1]\ngraph = "ring"\ntorus_dims = [4]\ntorus_wrap = [true]\n'
                 'link_bandwidth = "50 GB/s"\nhbm_bandwidth = "500 GB/s"\n')
    assert load_instance(t).chips == 4


def test_user_instance_errors(tmp_path):
    d = _desc()
    d["torus_dims"] = [3, 3]
    with pytest.raises(ValueError, match="multiply"):
        InstanceModel.from_dict({**d, "link_bandwidth": 1, "link_latency": 1, "hbm_bandwidth": 1,
                                 "efa_bandwidth": 1, "efa_latency": 1})
    with pytest.raises(ValueError, match="unknown instance fields"):
        InstanceModel.from_dict({**_desc(), "colour": "red"})
    m = InstanceModel(name="mine2", chips=2, physical_cores_per_chip=1, default_lnc=1,
                      supported_lnc=(1,), graph="switch", link_bandwidth=1e9, hbm_bandwidth=1e10)
    register_instance(m)
    with pytest.raises(ValueError, match="already registered"):
        register_instance(InstanceModel(name="mine2", chips=4, physical_cores_per_chip=1,
                                        default_lnc=1, supported_lnc=(1,), graph="switch"))
    assert isinstance(GroupTopology("mine2", ()).instance, InstanceModel)
    with pytest.raises(ValueError, match="instance description .*missing.json' does not exist"):
        get_instance(str(tmp_path / "missing.json"))
