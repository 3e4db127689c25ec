"""Helpers shared by the launcher tests (a uniquely named module: ``import conftest`` could
resolve to another directory's conftest once the repository has several)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from neuron_dist.ports import free_port  # noqa: F401  (one picker for every test's rendezvous port)

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launcher"

_SCRUB = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "NEURON_", "NEURONRUN_", "PET_", "TORCHELASTIC_", "MASTER_",
          "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "THP_MEM_ALLOC_ENABLE")


_JOBS_TMP: list[str] = []


def _jobs_tmp() -> str:
    """A temporary directory for the jobs this test process starts, removed when it exits:
    neuronrun keeps a run's logs in a neuronrun_* directory under $TMPDIR, as torchrun keeps its
    torchelastic_* ones, and the suite left ~20 of them in /tmp per run."""
    if not _JOBS_TMP:
        _JOBS_TMP.append(tempfile.mkdtemp(prefix="nd-jobs-"))
        atexit.register(shutil.rmtree, _JOBS_TMP[0], True)
    return _JOBS_TMP[0]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    env["TMPDIR"] = _jobs_tmp()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LAUNCHER), str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def neuronrun(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 60,
              cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuronrun_launcher.run", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
