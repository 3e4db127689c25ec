"""destroy_process_group, abort and re-init in one process release threads, descriptors and
shared memory, and subgroups go down with their parent (tests/scripts/lifecycle.py)."""
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "lifecycle.py")


@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("world", [2, 3])
def test_lifecycle(transport, world, tmp_path):
    env = dict(os.environ, NEURON_DIST_TRANSPORT=transport)
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(r), str(world), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r}: lifecycle ok" in out, out[-3000:]
