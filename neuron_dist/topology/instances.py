"""Instance models: the modelled Trainium / Inferentia machines, as data.

Every figure is a named field of `InstanceModel`; `InstanceModel.sources` maps each field name
to where the figure comes from (an AWS Neuron SDK page, or "derived: ..." with the arithmetic).
Units: bandwidths in bytes per second per direction, latencies in seconds.

Chip graph: `graph` is one of
  "torus"  - chips on a grid of `torus_dims` (row-major: chip c sits at coordinates
             `chip_coords(c)`), neighbours differ by one in one dimension, with wrap-around where
             `torus_wrap` says so; each neighbour pair is joined by one link of `link_bandwidth`.
  "ring"   - a torus of one dimension (inf2).
  "switch" - every chip reaches every other through a switch port of `link_bandwidth` (Trn3).
  "single" - one chip, no chip-to-chip links (trn1.2xlarge).
`domain_nodes` > 1 means that many consecutive nodes (instances) are joined by NeuronLink into one
domain: on a torus, one larger torus (Trn2 UltraServer: 4 nodes, chips at the same (x, y) form a
ring across the nodes, each hop a link of `domain_link_bandwidth`); on a switch, one switched
fabric (Trn3 UltraServer: each chip's port to the other servers carries `domain_link_bandwidth`).
Nodes outside one domain talk over EFA, each chip through its own share of the node's
`efa_bandwidth` (efa_bandwidth / chips each way: one NIC per chip, as on trn2).

A user describes an unknown instance in a small JSON or TOML file holding the same field names
(`load_instance(path)`), or builds an `InstanceModel` directly, and `register_instance`s it.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

GB = 1e9
GiB = 2**30
Gbps = 1e9 / 8
US = 1e-6

GRAPHS = ("torus", "ring", "switch", "single")
INT_FIELDS = ("chips", "physical_cores_per_chip", "default_lnc", "domain_nodes")
# figures in SI units (bytes/s, seconds, bytes); a description may give them with a unit (_UNITS)
NUMERIC_FIELDS = ("link_bandwidth", "link_latency", "hbm_bandwidth", "hbm_bytes", "efa_bandwidth",
                  "efa_latency", "domain_link_bandwidth", "intra_chip_bandwidth")


def _whole(v, field_name: str) -> int:
    """An integer field: a whole number (4 or 4.0, as TOML/JSON may write it), never a bool or a
    string, which would pass here only to fail later as a TypeError deep in the placement."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    raise ValueError(f"{field_name} must be a whole number, got {v!r}")


def _figure(v, field_name: str) -> float:
    """A numeric field: a finite real number >= 0 (a NaN or negative bandwidth gives nonsense
    times, not an error)."""
    try:
        f = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an integer beyond a float's range (JSON allows one)
        f = math.inf
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{field_name} must be a finite number >= 0, got {v!r}")
    return f


def _flag(v, field_name: str) -> bool:
    """A boolean field: true or false only; bool("no") is True, so strings are refused."""
    if not isinstance(v, bool):
        raise ValueError(f"{field_name} must be true or false, got {v!r}")
    return v


def _seq(model, field_name: str):
    """A list field's value: a list or tuple (a bare 4 for torus_dims was a TypeError)."""
    v = getattr(model, field_name)
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{field_name} must be a list, got {v!r}")
    return v


@dataclass(frozen=True)
class InstanceModel:
    name: str
    chips: int                         # chips per instance (node)
    physical_cores_per_chip: int
    default_lnc: int
    supported_lnc: tuple[int, ...]
    graph: str                         # "torus" | "ring" | "switch" | "single"
    torus_dims: tuple[int, ...] = ()   # grid of chips within one node (product == chips)
    torus_wrap: tuple[bool, ...] = ()
    link_bandwidth: float = 0.0        # bytes/s per direction, one chip-to-chip link (switch: per port)
    link_latency: float = 0.0          # seconds per hop
    hbm_bandwidth: float = 0.0         # bytes/s per chip
    hbm_bytes: float = 0.0             # HBM capacity per chip
    efa_bandwidth: float = 0.0         # bytes/s per direction per instance (all NICs; a chip gets 1/chips)
    efa_latency: float = 0.0           # seconds, HBM to HBM across instances
    multi_node: bool = False
    domain_nodes: int = 1              # nodes joined into one NeuronLink torus (UltraServer)
    domain_link_bandwidth: float = 0.0 # bytes/s per direction, one link between nodes of a domain
    intra_chip_bandwidth: float = 0.0  # bytes/s between cores of one chip (0: hbm_bandwidth / 2, read + write)
    notes: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"instance {self.name!r}: {msg}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"instance name must be a non-empty string, got {self.name!r}")
        if self.graph not in GRAPHS:
            bad(f"graph must be one of {GRAPHS}, got {self.graph!r}")
        # Types first, so that a description's "4" or "no" is named here rather than failing as a
        # TypeError (or silently reading as True) in the cost model at the first collective.
        try:
            for name in INT_FIELDS:
                object.__setattr__(self, name, _whole(getattr(self, name), name))
            for name in ("supported_lnc", "torus_dims"):
                object.__setattr__(self, name, tuple(_whole(x, f"{name}[{i}]")
                                                     for i, x in enumerate(_seq(self, name))))
            object.__setattr__(self, "torus_wrap", tuple(_flag(x, f"torus_wrap[{i}]")
                                                         for i, x in enumerate(_seq(self, "torus_wrap"))))
            object.__setattr__(self, "multi_node", _flag(self.multi_node, "multi_node"))
            for name in NUMERIC_FIELDS:
                object.__setattr__(self, name, _figure(getattr(self, name), name))
        except ValueError as e:
            raise ValueError(f"instance {self.name!r}: {e}") from None
        if not isinstance(self.notes, str):
            bad(f"notes must be a string, got {self.notes!r}")
        if not isinstance(self.sources, Mapping):
            bad(f"sources must be a table of field name -> source, got {self.sources!r}")
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        if self.chips < 1 or self.physical_cores_per_chip < 1:
            bad("chips and physical_cores_per_chip must be >= 1")
        # the cost model divides by these: a zero here was a ZeroDivisionError at the first collective
        if self.hbm_bandwidth <= 0:
            bad(f"hbm_bandwidth must be > 0 bytes/s, got {self.hbm_bandwidth}")
        if self.graph != "single" and self.link_bandwidth <= 0:
            bad(f"link_bandwidth must be > 0 bytes/s for graph {self.graph!r}, got {self.link_bandwidth}")
        if self.multi_node and self.efa_bandwidth <= 0:
            bad(f"efa_bandwidth must be > 0 bytes/s when multi_node is true, got {self.efa_bandwidth}")
        if self.default_lnc not in self.supported_lnc:
            bad(f"default_lnc {self.default_lnc} not in supported_lnc {self.supported_lnc}")
        for lnc in self.supported_lnc:
            if lnc < 1 or self.physical_cores_per_chip % lnc:
                bad(f"LNC {lnc} does not divide {self.physical_cores_per_chip} physical cores")
        if self.graph in ("torus", "ring"):
            if not self.torus_dims or math.prod(self.torus_dims) != self.chips:
                bad(f"torus_dims {self.torus_dims} must multiply to chips={self.chips}")
            if len(self.torus_wrap) != len(self.torus_dims):
                bad("torus_wrap needs one entry per torus dimension")
            if self.graph == "ring" and len(self.torus_dims) != 1:
                bad("a ring has one dimension")
        if self.graph == "single" and self.chips != 1:
            bad("graph 'single' means one chip")
        if self.domain_nodes < 1:
            bad("domain_nodes must be >= 1")
        if self.domain_nodes > 1 and (self.graph not in ("torus", "switch") or self.domain_link_bandwidth <= 0):
            bad("a multi-node NeuronLink domain needs a torus or switch graph and domain_link_bandwidth")

    # ---- cores -------------------------------------------------------------------------------
    def check_lnc(self, lnc: int | None) -> int:
        lnc = self.default_lnc if lnc is None else int(lnc)
        if lnc not in self.supported_lnc:
            raise ValueError(f"instance {self.name} supports LNC {self.supported_lnc}, not {lnc}")
        return lnc

    def cores_per_chip(self, lnc: int | None = None) -> int:
        """Logical NeuronCores per chip at this LNC."""
        return self.physical_cores_per_chip // self.check_lnc(lnc)

    def cores(self, lnc: int | None = None) -> int:
        """Logical NeuronCores per instance at this LNC."""
        return self.chips * self.cores_per_chip(lnc)

    # ---- chip graph --------------------------------------------------------------------------
    def chip_coords(self, chip: int) -> tuple[int, ...]:
        """Grid coordinates of `chip` (row-major, last dimension fastest)."""
        if not 0 <= chip < self.chips:
            raise ValueError(f"chip {chip} out of range for {self.name} ({self.chips} chips)")
        if not self.torus_dims:
            return (chip,)
        out = []
        for d in reversed(self.torus_dims):
            out.append(chip % d)
            chip //= d
        return tuple(reversed(out))

    def chip_at(self, coords) -> int:
        c = 0
        for x, d in zip(coords, self.torus_dims):
            c = c * d + (x % d)
        return c

    def chip_neighbours(self, chip: int) -> list[int]:
        """Chips one link away from `chip` within one node (switch: all others)."""
        if self.graph == "single":
            return []
        if self.graph == "switch":
            return [c for c in range(self.chips) if c != chip]
        co = self.chip_coords(chip)
        out = []
        for i, (d, wrap) in enumerate(zip(self.torus_dims, self.torus_wrap)):
            for step in (-1, 1):
                x = co[i] + step
                if not 0 <= x < d:
                    if not wrap:
                        continue
                    x %= d
                n = self.chip_at(co[:i] + (x,) + co[i + 1:])
                if n != chip and n not in out:
                    out.append(n)
        return out

    def links_per_chip(self) -> int:
        return len(self.chip_neighbours(0)) if self.chips > 1 else 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data, as a description file holds them. Not dataclasses.asdict:
        it deep-copies, and `sources` is a mappingproxy, which cannot be copied (TypeError)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = dict(self.sources)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "InstanceModel":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown instance fields {sorted(unknown)}; known: {sorted(known)}")
        missing = {"name", "chips", "physical_cores_per_chip", "default_lnc", "supported_lnc",
                   "graph"} - set(d)
        if missing:
            raise ValueError(f"instance description lacks {sorted(missing)}")
        return cls(**dict(d))


# ---- the built-in models -----------------------------------------------------------------------
_ARCH = "aws-neuron-sdk about-neuron/arch/neuron-hardware/"
_INTRA = "aws-neuron-sdk neuron-runtime/explore/intranode-collective-comm.rst"
_INTER = "aws-neuron-sdk neuron-runtime/explore/internode-collective-comm.rst"
_LNC = "aws-neuron-sdk about-neuron/arch/neuron-features/logical-neuroncore-config.rst"
_HOP = 1.5 * US      # intranode doc: "~1-2 us" per ring-type hop; the model uses the midpoint
_HOP_SRC = _INTRA + ": per-hop latency ~1-2 us for ring-type steps; model uses the midpoint 1.5 us"
_EFA_LAT = 15 * US
_EFA_LAT_SRC = _INTER + ": ~15 us EFA per-hop latency (HBM to HBM)"

_TRN1_COMMON = dict(
    physical_cores_per_chip=2, default_lnc=1, supported_lnc=(1,),
    hbm_bandwidth=820 * GiB, hbm_bytes=32 * GiB,
)
_TRN1_SRC = {
    "physical_cores_per_chip": _ARCH + "trn1-arch.rst: 2 NeuronCore-v2 per Trainium1 chip",
    "default_lnc": _LNC + ": LNC=1 is the only setting on trn1/inf2",
    "supported_lnc": _LNC,
    "hbm_bandwidth": _ARCH + "trn1-arch.rst: 32 GiB HBM at 820 GiB/s per chip",
    "hbm_bytes": _ARCH + "trn1-arch.rst",
    "link_latency": _HOP_SRC,
    "efa_latency": _EFA_LAT_SRC,
}


def _trn1(name, efa_gbps, chip_link_gibs, efa_note):
    return InstanceModel(
        name=name, chips=16, graph="torus", torus_dims=(4, 4), torus_wrap=(True, True),
        link_bandwidth=chip_link_gibs * GiB / 4, link_latency=_HOP,
        efa_bandwidth=efa_gbps * Gbps, efa_latency=_EFA_LAT, multi_node=True,
        notes="The docs draw trn1 as a 2D torus and also as a 4D hypercube (axes W X Y Z); "
              "the 4x4 torus with wrap-around is that hypercube (C4 x C4 = Q4), so both agree.",
        sources={**_TRN1_SRC,
                 "chips": _ARCH + "trn1-arch.rst: 16 Trainium1 chips",
                 "graph": _ARCH + "trn1-arch.rst: NeuronLink-v2 2D torus, 4 links per chip",
                 "torus_dims": "derived: 16 chips, 4 links each -> 4x4 with wrap-around",
                 "link_bandwidth": f"derived: {chip_link_gibs} GiB/s per chip ({_ARCH}trn1-arch.rst)"
                                   " / 4 links; the page does not say per direction, the model "
                                   "takes it as per direction per link",
                 "efa_bandwidth": f"{_ARCH}trn1-arch.rst: EFA {efa_gbps} Gbps ({efa_note})"},
        **_TRN1_COMMON)


def _inf2(name, chips):
    return InstanceModel(
        name=name, chips=chips, graph="ring", torus_dims=(chips,), torus_wrap=(True,),
        link_bandwidth=192 * GiB / 2, link_latency=_HOP, multi_node=False,
        sources={**_TRN1_SRC,
                 "chips": _ARCH + f"inf2-arch.rst: {chips} Inferentia2 chips",
                 "physical_cores_per_chip": _ARCH + "inf2-arch.rst: 2 NeuronCore-v2 per chip",
                 "graph": _ARCH + "inf2-arch.rst: NeuronLink-v2 ring, 2 links per chip",
                 "link_bandwidth": "derived: 192 GiB/s per chip (inf2-arch.rst) / 2 links",
                 "hbm_bandwidth": _ARCH + "inf2-arch.rst: 32 GiB HBM at 820 GiB/s per chip",
                 "hbm_bytes": _ARCH + "inf2-arch.rst",
                 "multi_node": _ARCH + "inf2-arch.rst: single instance only"},
        **_TRN1_COMMON)


_TRN2_SRC = {
    "chips": _ARCH + "trn2-arch.rst: 16 Trainium2 chips",
    "physical_cores_per_chip": _ARCH + "trainium2.rst: 8 NeuronCore-v3 per chip",
    "default_lnc": _LNC + ": LNC=2 is the default on trn2",
    "supported_lnc": _LNC + ": LNC 1 (8 logical cores per chip) or 2 (4 per chip)",
    "graph": _ARCH + "trn2-arch.rst: NeuronLink-v3 4x4 2D torus, 4 neighbours per chip",
    "torus_dims": _ARCH + "trn2-arch.rst",
    "link_bandwidth": "derived: 1024 GB/s per chip in the instance (trn2-arch.rst) / 4 links "
                      "= 256 GB/s, taken as per direction per link",
    "link_latency": _HOP_SRC,
    "hbm_bandwidth": _ARCH + "trainium2.rst: 96 GiB HBM at 2.9 TB/s per chip (4 banks of 24 GB, "
                             "each shared by 2 physical cores)",
    "hbm_bytes": _ARCH + "trainium2.rst",
    "efa_bandwidth": _ARCH + "trn2-arch.rst: EFAv3 3200 Gbps = 16 x 200 Gbps, one NIC per chip",
    "efa_latency": _EFA_LAT_SRC,
}
_TRN2_COMMON = dict(
    chips=16, physical_cores_per_chip=8, default_lnc=2, supported_lnc=(1, 2), graph="torus",
    torus_dims=(4, 4), torus_wrap=(True, True), link_bandwidth=256 * GB, link_latency=_HOP,
    hbm_bandwidth=2.9e12, hbm_bytes=96 * GiB, efa_bandwidth=3200 * Gbps, efa_latency=_EFA_LAT,
    multi_node=True,
)

BUILTIN: dict[str, InstanceModel] = {}


def _add(m: InstanceModel):
    BUILTIN[m.name] = m


_add(_trn1("trn1.32xlarge", 800, 384, "8 devices"))
_add(_trn1("trn1n.32xlarge", 1600, 768, "16 devices"))
_add(InstanceModel(
    name="trn1.2xlarge", chips=1, graph="single", efa_bandwidth=25 * Gbps,
    efa_latency=_EFA_LAT, multi_node=False, link_latency=_HOP,
    sources={**_TRN1_SRC, "chips": _ARCH + "trn1-arch.rst: 1 Trainium1 chip",
             "graph": _ARCH + "trn1-arch.rst: one chip, no chip-to-chip NeuronLink",
             "efa_bandwidth": _ARCH + "trn1-arch.rst: 25 Gbps network, no multi-node collectives",
             "multi_node": _ARCH + "trn1-arch.rst"},
    **_TRN1_COMMON))
_add(_inf2("inf2.24xlarge", 6))
_add(_inf2("inf2.48xlarge", 12))
_add(InstanceModel(name="trn2.48xlarge", sources=_TRN2_SRC, **_TRN2_COMMON))
_add(InstanceModel(
    name="trn2u.48xlarge", domain_nodes=4, domain_link_bandwidth=128 * GB,
    notes="Trn2 UltraServer: 4 trn2u.48xlarge nodes form a 4x4x4 torus; chips at the same (x, y) "
          "in the 4 nodes are a ring in z. Nodes 4k..4k+3 of a job are one UltraServer.",
    sources={**_TRN2_SRC,
             "domain_nodes": _ARCH + "trn2-arch.rst: UltraServer = 4 instances, 3D torus",
             "domain_link_bandwidth": "derived: 256 GB/s per chip between instances "
                                      "(trn2-arch.rst) / 2 z links = 128 GB/s per link"},
    **_TRN2_COMMON))
_TRN3_SRC = {
    "physical_cores_per_chip": _ARCH + "trainium3.rst: 8 NeuronCore-v4 per chip",
    "default_lnc": _LNC + ": LNC=2 default on trn3",
    "supported_lnc": _ARCH + "trainium3.rst: LNC 1 or 2",
    "graph": _ARCH + "trn3-arch.rst: NeuronSwitch-v1 switched all-to-all fabric, no torus",
    "link_bandwidth": "derived: 256 GB/s per chip bidirectional in a server (trn3-arch.rst, "
                      "'Intra-server connectivity') / 2 = 128 GB/s per direction per switch port",
    "link_latency": _HOP_SRC + " (trn2 figure reused; no trn3 figure published)",
    "hbm_bandwidth": _ARCH + "trainium3.rst: 144 GiB at 4.9 TB/s per chip",
    "hbm_bytes": _ARCH + "trainium3.rst",
    "domain_link_bandwidth": "derived: 320 GB/s per chip bidirectional between servers "
                             "(trn3-arch.rst, 'Inter-server connectivity') / 2 = 160 GB/s per direction",
    "efa_latency": _EFA_LAT_SRC + " (trn2 figure reused)",
}
_TRN3_COMMON = dict(
    physical_cores_per_chip=8, default_lnc=2, supported_lnc=(1, 2), graph="switch",
    link_bandwidth=128 * GB, link_latency=_HOP, domain_link_bandwidth=160 * GB,
    hbm_bandwidth=4.9e12, hbm_bytes=144 * GiB, efa_latency=_EFA_LAT, multi_node=True,
)
_add(InstanceModel(
    name="trn3", chips=16, domain_nodes=4, efa_bandwidth=12.8e12 / 8 / 4,
    notes="Trn3 Gen1 UltraServer: 4 servers of 16 Trainium3 chips (nodes 4k..4k+3 of a job are one "
          "UltraServer), NeuronSwitch-v1 all-to-all fabric, not a torus. Each chip has a switch "
          "port in its server and one to the other servers of its UltraServer (320 GB/s per chip "
          "bidirectional); UltraServers talk over EFA. trn3-arch.rst's connectivity section draws "
          "a server (sled) of 4 chips on one switch, the Gen2 layout: how a Gen1 server's 16 chips "
          "share switches is not published, so the model puts them on one switch at the sled's "
          "per-chip figure.",
    sources={**_TRN3_SRC,
             "chips": _ARCH + "trn3-arch.rst: 'Each UltraServer consists of four servers with 16 "
                              "Trainium3 devices per server' (Gen1; 768 host vCPUs per UltraServer "
                              "= 192 per server, a trn2.48xlarge's)",
             "domain_nodes": _ARCH + "trn3-arch.rst: a Gen1 UltraServer is four servers, 64 chips "
                                     "in one scale-up domain",
             "efa_bandwidth": "derived: EFA 12,800 Gbps per Gen1 UltraServer (trn3-arch.rst) / 4 "
                              "servers = 3200 Gbps per node"},
    **_TRN3_COMMON))
_add(InstanceModel(
    name="trn3-gen2", chips=4, domain_nodes=36, efa_bandwidth=28.8e12 / 8 / 36,
    notes="Trn3 Gen2 UltraServer: 36 servers of 4 Trainium3 chips (nodes 36k..36k+35 of a job are "
          "one UltraServer); a first-level NeuronSwitch-v1 in each server, two second-level "
          "switches across the servers, modelled as each chip's port to the other servers of its "
          "UltraServer; UltraServers talk over EFA. The 128 GB/s per chip between racks is not "
          "modelled (no rack in the model).",
    sources={**_TRN3_SRC,
             "chips": _ARCH + "trn3-arch.rst: 'Each UltraServer consists of 36 servers with 4 "
                              "Trainium3 devices per server' (Gen2; 2304 host vCPUs = 64 per server)",
             "graph": _TRN3_SRC["graph"] + "; first-level switch in a server, two second-level "
                                           "switches across servers",
             "domain_nodes": _ARCH + "trn3-arch.rst: a Gen2 UltraServer is 36 servers, 144 chips "
                                     "in one scale-up domain",
             "efa_bandwidth": "derived: EFA 28,800 Gbps per Gen2 UltraServer (trn3-arch.rst) / 36 "
                              "servers = 800 Gbps per node"},
    **_TRN3_COMMON))

ALIASES = {"trn2": "trn2.48xlarge", "trn1": "trn1.32xlarge", "trn1n": "trn1n.32xlarge",
           "trn2-ultraserver": "trn2u.48xlarge", "trn2u": "trn2u.48xlarge",
           "trn3-ultraserver": "trn3", "trn3-gen1": "trn3", "inf2": "inf2.48xlarge"}

_REGISTRY: dict[str, InstanceModel] = dict(BUILTIN)


def register_instance(model: InstanceModel, *, replace: bool = False) -> InstanceModel:
    """Make `model` known to `get_instance` (and so to NEURON_DIST_INSTANCE)."""
    if not isinstance(model, InstanceModel):
        raise TypeError("register_instance takes an InstanceModel")
    if model.name in _REGISTRY and _REGISTRY[model.name] != model and not replace:
        raise ValueError(f"instance {model.name!r} is already registered; pass replace=True")
    _REGISTRY[model.name] = model
    return model


def list_instances() -> list[str]:
    return sorted(_REGISTRY)


def get_instance(name: "str | InstanceModel") -> InstanceModel:
    """The model called `name` (a built-in, an alias, a registered one, or a path to a
    .json/.toml description). The exact name wins over an alias: a description that calls
    itself "trn2" must be the model NEURON_DIST_INSTANCE gets, not the built-in trn2.48xlarge."""
    if isinstance(name, InstanceModel):
        return name
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ALIASES.get(name) in _REGISTRY:
        return _REGISTRY[ALIASES[name]]
    if name.endswith((".json", ".toml")):
        if not Path(name).exists():
            raise ValueError(f"instance description {name!r} does not exist (working directory {os.getcwd()})")
        return load_instance(name)
    raise ValueError(f"unknown instance {name!r}; known: {', '.join(list_instances())} "
                     f"(or describe it in a .json/.toml file, see load_instance)")


_RATE = {"B/s": 1, "KB/s": 1e3, "KiB/s": 2**10, "MB/s": 1e6, "MiB/s": 2**20, "GB/s": GB,
         "GiB/s": GiB, "TB/s": 1e12, "TiB/s": 2**40, "Mbps": 1e6 / 8, "Gbps": Gbps, "Tbps": 1e12 / 8}
_TIME = {"s": 1, "ms": 1e-3, "us": US, "ns": 1e-9}
_BYTES = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": GB, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
          "GiB": GiB, "TiB": 2**40}
# which units each numeric field takes: a bandwidth in seconds is a mistake, not a conversion
_UNITS = {name: _RATE if name.endswith("bandwidth") else _TIME if name.endswith("latency") else _BYTES
          for name in NUMERIC_FIELDS}
_WITH_UNIT = re.compile(r"\s*(\S+?)\s*([A-Za-z/]+)\s*")


def _parse_value(name: str, v):
    """A description's value for field `name`: numeric fields may be strings like "256 GB/s",
    "100GB/s", "1.5 us", converted to SI units; other fields, and numbers, pass through unchanged
    (InstanceModel checks them). A string a numeric field cannot use is an error naming the field
    and its units, not a string left for the cost model to trip over."""
    if name not in _UNITS or not isinstance(v, str):
        return v
    units = _UNITS[name]
    m = _WITH_UNIT.fullmatch(v)
    if m and m.group(2) in units:
        try:
            return float(m.group(1)) * units[m.group(2)]
        except ValueError:
            pass
    raise ValueError(f"{name}: cannot read {v!r}; expected a number (SI units) or a number with "
                     f"one of the units {', '.join(units)}")


def load_instance(path: "str | Path", *, register: bool = True) -> InstanceModel:
    """Read an instance description (JSON or TOML, the field names of InstanceModel; figures as
    numbers in SI units or strings like "256 GB/s", "1.5 us") and register it."""
    import tomllib
    p = Path(path)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"instance description {str(path)!r} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"instance description {str(path)!r} is not a table of fields")
    try:
        data = {k: _parse_value(k, v) for k, v in data.items()}
        model = InstanceModel.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"instance description {str(path)!r}: {e}") from None
    if register:
        register_instance(model, replace=True)
    return model
