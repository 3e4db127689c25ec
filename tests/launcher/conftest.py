"""Make the launcher importable from a source checkout and give tests a clean environment.

The launcher reads many variables (SLURM_*, OMPI_*, NEURON_*, PET_*, NEURONRUN_*);
a test run inside a Slurm job or a Neuron container must not see them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launcher"
try:
    import neuronrun_launcher  # noqa: F401  (installed)
except ImportError:
    sys.path.insert(0, str(LAUNCHER))

_SCRUB = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "NEURON_", "NEURONRUN_", "PET_", "TORCHELASTIC_", "MASTER_",
          "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LAUNCHER), str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def neuronrun(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 60,
              cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuronrun_launcher.run", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture
def scrubbed_environ(monkeypatch):
    """os.environ without scheduler/Neuron/torchrun variables (for in-process launches)."""
    for key in list(os.environ):
        if key.startswith(_SCRUB):
            monkeypatch.delenv(key)
    return os.environ
