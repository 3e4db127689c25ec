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
              "trn2.48xlarge", "trn2u.48xlarge", "trn3", "trn3-gen2"):
        assert n in names


@pytest.mark.parametrize("name", ["trn1.32xlarge", "trn1n.32xlarge", "trn1.2xlarge",
                                  "inf2.24xlarge", "inf2.48xlarge", "trn2.48xlarge",
                                  "trn2u.48xlarge", "trn3", "trn3-gen2"])
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


@pytest.mark.parametrize("name, chips, servers, efa_gbps, words", [
    ("trn3", 16, 4, 12800, "four servers with 16 Trainium3 devices per server"),
    ("trn3-gen2", 4, 36, 28800, "36 servers with 4 Trainium3 devices per server")])
def test_trn3_nodes_are_the_published_servers(name, chips, servers, efa_gbps, words):
    """trn3 took 4 chips per node and 16 nodes per UltraServer, "not published per node"; AWS's
    trn3-arch.rst says a Gen1 UltraServer "consists of four servers with 16 Trainium3 devices per
    server" (Gen2: 36 servers of 4). A Gen1 server's 64 ranks at LNC 2 were refused ("64
    processes per node but trn3 at LNC=2 has only 16 logical cores per node")."""
    from neuron_dist.topology import placement_from_env
    m = get_instance(name)
    assert (m.chips, m.domain_nodes, m.chips * m.domain_nodes) == (chips, servers, 64 if name == "trn3" else 144)
    assert words in m.sources["chips"]
    assert m.efa_bandwidth * servers == efa_gbps * 1e9 / 8  # the UltraServer's EFA, split over its servers
    assert m.cores(2) == 4 * chips and m.cores(1) == 8 * chips
    last = m.cores() - 1  # a full server's last rank, on its last chip
    slot = placement_from_env({"NEURON_DIST_INSTANCE": name, "GROUP_RANK": "1"}, m.cores() + last,
                              2 * m.cores(), last, m.cores())
    assert (slot.node, slot.chip, slot.cores) == (1, chips - 1, (last,))
    assert get_instance("trn3-ultraserver") is get_instance("trn3-gen1") is get_instance("trn3")


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
                                        default_lnc=1, supported_lnc=(1,), graph="switch",
                                        link_bandwidth=1e9, hbm_bandwidth=1e10))
    assert isinstance(GroupTopology("mine2", ()).instance, InstanceModel)
    with pytest.raises(ValueError, match="instance description .*missing.json' does not exist"):
        get_instance(str(tmp_path / "missing.json"))


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry: a test's descriptions (one named like an alias) must not
    shadow the built-ins for the tests after it."""
    from neuron_dist.topology import instances
    monkeypatch.setattr(instances, "_REGISTRY", dict(instances._REGISTRY))


def _small(**over):
    d = {"name": "test.4chip", "chips": 4, "physical_cores_per_chip": 2, "default_lnc": 1,
         "supported_lnc": [1], "graph": "torus", "torus_dims": [2, 2], "torus_wrap": [True, True],
         "link_bandwidth": "100 GB/s", "link_latency": "1.5 us", "hbm_bandwidth": "800 GB/s",
         "efa_bandwidth": "400 Gbps", "efa_latency": "15 us", "multi_node": True}
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}  # None: leave the field out


def _write(tmp_path, d):
    p = tmp_path / "inst.json"
    p.write_text(json.dumps(d))
    return p


def test_instance_file_units_and_whole_floats(tmp_path, registry):
    """Units with or without a space, and the rest of the table (they stayed strings: a
    TypeError in the cost model); chips 4.0 (as TOML/JSON may write it) is the integer 4."""
    m = load_instance(_write(tmp_path, _small(
        chips=4.0, link_bandwidth="800MB/s", link_latency="2 ms", hbm_bandwidth="1 TiB/s",
        hbm_bytes="96 GiB", efa_bandwidth="3.2 Tbps", efa_latency="500ns", intra_chip_bandwidth="1e3 B/s")))
    assert m.chips == 4 and type(m.chips) is int
    assert m.link_bandwidth == 800e6 and m.link_latency == pytest.approx(2e-3)
    assert m.hbm_bandwidth == 2**40 and m.hbm_bytes == 96 * 2**30
    assert m.efa_bandwidth == 3.2e12 / 8 and m.efa_latency == pytest.approx(5e-7)
    assert m.intra_chip_bandwidth == 1e3
    assert estimate("allreduce", "ring", 1 << 20, place(m, 1, 8)) > 0


@pytest.mark.parametrize("over,msg", [
    (dict(hbm_bandwidth=None), "hbm_bandwidth must be > 0"),       # ZeroDivisionError in graph.py
    (dict(link_bandwidth=0), "link_bandwidth must be > 0"),         # the same
    (dict(link_bandwidth=-5), "link_bandwidth must be a finite number >= 0, got -5"),  # negative times
    (dict(link_bandwidth="nan GB/s"), "link_bandwidth must be a finite number >= 0, got nan"),
    (dict(efa_bandwidth=0), "efa_bandwidth must be > 0 .* multi_node"),
    (dict(link_bandwidth="100 Gb/s"), r"link_bandwidth: cannot read '100 Gb/s'.*B/s, .*Tbps"),
    (dict(link_latency="2 GB/s"), r"link_latency: cannot read '2 GB/s'.*s, ms, us, ns"),
    (dict(hbm_bytes="fast"), r"hbm_bytes: cannot read 'fast'.*GiB"),
    (dict(link_latency=True), "link_latency must be a finite number >= 0, got True"),
    (dict(chips="4"), "chips must be a whole number, got '4'"),     # TypeError in placement
    (dict(chips=4.5), "chips must be a whole number, got 4.5"),
    (dict(supported_lnc=[1.5]), r"supported_lnc\[0\] must be a whole number"),
    (dict(torus_dims=4), "torus_dims must be a list, got 4"),
    (dict(torus_wrap=["no", "no"]), r"torus_wrap\[0\] must be true or false, got 'no'"),  # read as True
    (dict(multi_node="false"), "multi_node must be true or false"),
])
def test_instance_file_bad_values_name_the_field(tmp_path, registry, over, msg):
    """Values the model cannot use are a ValueError at load, naming the field, through
    load_instance and get_instance (NEURON_DIST_INSTANCE=<file>: the backend fails at init),
    not a TypeError, a ZeroDivisionError or a wrong number at the first collective."""
    p = _write(tmp_path, _small(**over))
    with pytest.raises(ValueError, match=msg):
        load_instance(p)
    with pytest.raises(ValueError, match=msg):
        get_instance(str(p))


def test_builtins_pass_their_own_checks():
    """Each built-in, written out as a description and read back, passes the validation and
    comes out the same (to_dict raised TypeError: asdict cannot copy `sources`)."""
    for name in ("trn1.32xlarge", "trn1n.32xlarge", "trn1.2xlarge", "inf2.24xlarge", "inf2.48xlarge",
                 "trn2.48xlarge", "trn2u.48xlarge", "trn3", "trn3-gen2"):
        m = get_instance(name)
        assert InstanceModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_instance_file_named_like_an_alias(tmp_path, registry):
    """A description called "trn2" is the model its name finds: aliases were looked up first,
    so get_instance("trn2") gave the built-in trn2.48xlarge and the backend's ranks disagreed
    ("rank 0 says instance 'trn2', the group uses 'trn2.48xlarge')."""
    p = _write(tmp_path, _small(name="trn2"))
    m = get_instance(str(p))
    assert m.name == "trn2" and m.chips == 4
    assert get_instance("trn2") is m
    assert get_instance("trn2.48xlarge").chips == 16 and get_instance("trn1").name == "trn1.32xlarge"
