"""Two neuronrun "nodes" with different addresses and host names: each runs in its own network
namespace (joined by a veth pair) and UTS namespace, so the launcher meets over c10d on a real
interface and the backend connects the two nodes over TCP (zmq) and each node's ranks over
shared memory. Needs root and iproute2 (the project's own test hosts, made and removed here)."""
import os
import secrets
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher"))
from launcher_helpers import clean_env, free_port  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "neuronrun_job.py")


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    tag = secrets.token_hex(3)
    ns = [f"nd{tag}a", f"nd{tag}b"]
    net = f"10.231.{int(tag[:2], 16)}"
    addrs = [f"{net}.1", f"{net}.2"]
    if os.geteuid() != 0 or _ip("netns", "add", ns[0]).returncode != 0:
        pytest.skip("network namespaces need root and iproute2")
    try:
        steps = [("netns", "add", ns[1]),
                 ("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"),
                 ("link", "set", f"v{tag}a", "netns", ns[0]), ("link", "set", f"v{tag}b", "netns", ns[1])]
        for i in (0, 1):
            dev = f"v{tag}{'ab'[i]}"
            steps += [("-n", ns[i], "addr", "add", f"{addrs[i]}/24", "dev", dev),
                      ("-n", ns[i], "link", "set", dev, "up"), ("-n", ns[i], "link", "set", "lo", "up")]
        for st in steps:
            r = _ip(*st)
            assert r.returncode == 0, (st, r.stderr)
        yield ns, addrs
    finally:
        for n in ns:
            _ip("netns", "del", n)


def test_two_nodes_in_network_namespaces(two_hosts, tmp_path):
    ns, addrs = two_hosts
    port = free_port()
    hosts = tmp_path / "hosts"  # what a cluster's DNS gives: each node's name resolves to its address
    with open("/etc/hosts") as f:
        hosts.write_text(f.read() + f"\n{addrs[0]} node0\n{addrs[1]} node1\n")
    procs = []
    for i in (0, 1):
        launch = (f"mount --bind {hosts} /etc/hosts && hostname node{i} && "
                  f"exec {sys.executable} -m neuronrun_launcher.run --nnodes 2 "
                  f"--nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint {addrs[0]}:{port} --rdzv-id netns "
                  f"--local-addr {addrs[i]} --instance trn1.32xlarge {JOB}")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns[i], "unshare", "--uts", "--mount", "sh", "-c", launch],
                                      env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-3000:] for o in outs]
    lines = [l for o in outs for l in o[0].splitlines() if "sum=6 world=4" in l]
    assert len(lines) == 4, outs
    for line in lines:
        rank = int(line.split("]:")[0].split("rank")[-1])
        kinds = dict(kv.split(":") for kv in line.split("transports=")[1].split(","))
        for peer, kind in kinds.items():
            same_node = int(peer) // 2 == rank // 2
            assert kind == ("shm" if same_node else "zmq"), (rank, kinds)
