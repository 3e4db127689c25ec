"""neuronrun with the neuron backend end to end: the README's main job, and two neuronrun
"nodes" x 2 ranks on loopback whose backend topology matches the launcher's placement."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher"))
from launcher_helpers import REPO, clean_env, free_port, neuronrun  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "neuronrun_job.py")


def test_main_job_ddp_example():
    r = neuronrun(["--nproc-per-node", "2", str(REPO / "examples" / "ddp_train.py"), "--steps", "12"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 12 steps on 2 ranks (neuron)" in r.stdout, r.stdout[-2000:]


def test_two_nodes_on_loopback_neuron_backend():
    port = free_port()
    cmd = [sys.executable, "-m", "neuronrun_launcher.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nd",
           "--local-addr", "127.0.0.1", "--instance", "trn1.32xlarge", JOB]
    nodes = [subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    lines = [l for o in outs for l in o[0].splitlines() if "sum=6 world=4" in l]
    assert len(lines) == 4, outs
    assert all("nodes=2" in l for l in lines), lines
    assert sorted(l.split("node=")[1].split()[0] for l in lines) == ["0", "0", "1", "1"], lines
