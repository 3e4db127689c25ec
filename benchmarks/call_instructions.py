"""Instructions one small collective call executes, counted by Valgrind's callgrind: a cost that
does not move with the host's load or clock, for A/B comparisons of the call path on hosts
whose wall-clock times drift between minutes.

    python benchmarks/call_instructions.py                     # 4 KiB all-reduce, world 1
    python benchmarks/call_instructions.py --groups neuron --calls 500
    PYTHONPATH=/path/to/other/checkout python benchmarks/call_instructions.py --groups neuron

Each group (this backend; Gloo; a Python backend that does nothing, the --floor group of
call_anatomy.py, whose count is torch's own share of any Python backend's call) runs in its own
one-rank process under `valgrind --tool=callgrind --instr-atstart=no`. The process warms up,
then this script switches counting on (`callgrind_control -i on`), lets it make --calls calls
back to back, switches counting off and reads the total: instructions per call, over every
thread of the process (Gloo's worker thread included). World 1: no byte crosses processes, so
the count is the call path's own. Needs valgrind on PATH; it runs about 50x slower than native.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

GROUPS = ("neuron", "gloo", "noop")


def child(group: str, calls: int, nbytes: int, port: int, flags: str) -> None:
    """The measured process: make the calls between the parent's go and done files."""
    import torch
    import torch.distributed as dist

    import neuron_dist  # noqa: F401  registers "neuron"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import call_anatomy

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("neuron", store=store, rank=0, world_size=1)
    g = None if group == "neuron" else dist.new_group(
        backend="gloo" if group == "gloo" else call_anatomy.register_noop())
    x = torch.zeros(max(1, nbytes // 4))
    for _ in range(50):
        dist.all_reduce(x, group=g)
    open(os.path.join(flags, "ready"), "w").close()
    while not os.path.exists(os.path.join(flags, "go")):
        time.sleep(0.01)
    for _ in range(calls):
        dist.all_reduce(x, group=g)
    open(os.path.join(flags, "done"), "w").close()
    while not os.path.exists(os.path.join(flags, "stop")):
        time.sleep(0.01)
    os._exit(0)  # no teardown under valgrind (slow, and nothing to measure)


def _wait_for(path: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"the measured process exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {os.path.basename(path)} file after {timeout:.0f} s")
        time.sleep(0.1)


def measure(group: str, calls: int, nbytes: int, timeout: float) -> float:
    """Instructions per call of `group`, counted over `calls` back-to-back calls."""
    from neuron_dist.ports import free_port
    with tempfile.TemporaryDirectory(prefix="callinstr-") as d:
        out = os.path.join(d, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               sys.executable, os.path.abspath(__file__), "--child", group, "--calls", str(calls),
               "--bytes", str(nbytes), "--port", str(free_port()), "--flags", d]
        with open(os.path.join(d, "log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_for(os.path.join(d, "ready"), proc, timeout)
                subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
                open(os.path.join(d, "go"), "w").close()
                _wait_for(os.path.join(d, "done"), proc, timeout)
                subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
                open(os.path.join(d, "stop"), "w").close()
                proc.wait(timeout)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        text = open(os.path.join(d, "log")).read()
        m = re.search(r"Collected : ([\d,]+)", text)
        if proc.returncode != 0 or m is None:
            raise RuntimeError(f"callgrind run of {group} failed (status {proc.returncode}):\n{text[-2000:]}")
        return int(m.group(1).replace(",", "")) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=600, help="seconds for each process's phases")
    p.add_argument("--child", choices=GROUPS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--flags", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.calls, a.bytes, a.port, a.flags)
        return
    groups = [g.strip() for g in a.groups.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        p.error(f"unknown group(s) {bad}; choose from {', '.join(GROUPS)}")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            p.error(f"{tool} is not on PATH (install valgrind)")
    print(f"# call_instructions: all_reduce {a.bytes} B, world 1, {a.calls} calls back to back; "
          f"instructions per call (callgrind, every thread)", flush=True)
    for g in groups:
        print(f"{g:>8} {measure(g, a.calls, a.bytes, a.timeout):>12,.0f}", flush=True)


if __name__ == "__main__":
    main()
