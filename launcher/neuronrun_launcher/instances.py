"""Instance models for placement: ``neuron_dist.topology`` when available, else a small table.

The launcher and the backend must agree on the topology, so the source of truth is
``neuron_dist.topology.instances.get_instance``. It is loaded lazily (the launcher
must work, and its tests must pass, without the backend), and only if it cannot be
found does the fallback table below answer, for the six instance types whose core
counts are fixed by AWS documentation.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_INSTANCE = "trn2.48xlarge"  # the current Trainium generation; LNC 2 by default


@dataclass(frozen=True)
class FallbackInstance:
    """The subset of ``neuron_dist.topology.instances.InstanceModel`` the launcher reads."""

    name: str
    chips: int
    physical_cores_per_chip: int
    default_lnc: int
    supported_lnc: tuple[int, ...]
    multi_node: bool

    def cores_per_chip(self, lnc: int) -> int:
        if lnc not in self.supported_lnc:
            raise ValueError(f"{self.name} supports LNC {self.supported_lnc}, not {lnc}")
        return self.physical_cores_per_chip // lnc

    def cores(self, lnc: int) -> int:
        return self.chips * self.cores_per_chip(lnc)


_FALLBACK = {
    m.name: m
    for m in (
        FallbackInstance("trn1.32xlarge", 16, 2, 1, (1,), True),
        FallbackInstance("trn1n.32xlarge", 16, 2, 1, (1,), True),
        FallbackInstance("trn1.2xlarge", 1, 2, 1, (1,), False),
        FallbackInstance("inf2.24xlarge", 6, 2, 1, (1,), False),
        FallbackInstance("inf2.48xlarge", 12, 2, 1, (1,), False),
        FallbackInstance("trn2.48xlarge", 16, 8, 2, (1, 2), True),
    )
}


_BACKEND_MODULE = "neuron_dist.topology.instances"
_OWN_COPY = "neuronrun_launcher._neuron_dist_instances"


def _topology():
    """neuron_dist's instance models: the backend's module where this process has imported it,
    else its file loaded on its own. Importing it through its package would run
    neuron_dist/__init__, which registers the backend and so imports torch: 7 s and 230 MB on a
    loaded 2-core host for a --dry-run that needs neither, against 0.3 s. The file imports only
    the standard library (tests/launcher/test_launcher_config.py checks that torch stays out)."""
    mod = sys.modules.get(_BACKEND_MODULE) or sys.modules.get(_OWN_COPY)
    if mod is None:
        try:
            spec = importlib.util.find_spec("neuron_dist")  # (finds the package without running it)
        except (ImportError, ValueError):
            return None
        path = next(iter(spec.submodule_search_locations or ()), None) if spec is not None else None
        source = Path(path, "topology", "instances.py") if path else None
        if source is None or not source.is_file():
            return None
        own = importlib.util.spec_from_file_location(_OWN_COPY, source)
        mod = importlib.util.module_from_spec(own)
        sys.modules[_OWN_COPY] = mod  # (dataclasses look their module up while the file runs)
        try:
            own.loader.exec_module(mod)
        except Exception:
            del sys.modules[_OWN_COPY]
            raise
    return mod


def get_instance(name: str, *, use_topology: bool = True):
    """The instance model called ``name``; a clear error naming the known ones otherwise."""
    topo = _topology() if use_topology else None
    if topo is not None:
        return topo.get_instance(name)  # (its ValueError names the instance and the known ones)
    try:
        return _FALLBACK[name]
    except KeyError:
        raise ValueError(
            f"unknown instance {name!r}; known: {', '.join(sorted(_FALLBACK))} "
            f"(neuron_dist.topology is not importable, so only the built-in table is used)"
        ) from None
