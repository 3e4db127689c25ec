"""Make the launcher importable from a source checkout and give tests a clean environment.

The launcher reads many variables (SLURM_*, OMPI_*, NEURON_*, PET_*, NEURONRUN_*);
a test run inside a Slurm job or a Neuron container must not see them.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from launcher_helpers import _SCRUB, LAUNCHER  # noqa: E402

try:
    import neuronrun_launcher  # noqa: F401  (installed)
except ImportError:
    sys.path.insert(0, str(LAUNCHER))


@pytest.fixture
def scrubbed_environ(monkeypatch):
    """os.environ without scheduler/Neuron/torchrun variables (for in-process launches)."""
    for key in list(os.environ):
        if key.startswith(_SCRUB):
            monkeypatch.delenv(key)
    return os.environ
