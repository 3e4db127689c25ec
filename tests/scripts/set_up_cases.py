"""One process of a job that runs several group set-ups in turn (started by tests/test_misuse.py as
`set_up_cases.py PROC SPEC`, SPEC a JSON file): each case of SPEC names its ranks' processes
({"PROC": rank}), its world size, its own rendezvous port and what goes wrong, each once a script
of its own that started fresh processes: "placement" (rank `bad` has the setting VAR=VALUE),
"unroutable" (rank 1 cannot resolve MASTER_ADDR), "two_hosts" (ranks on two hosts given one node
number) and "dies" (rank 1 exits as it would publish its set-up, so a process may take that rank
only in its last case). Before each of its cases a process prints "@@case ID", then the
rank's line (report_init.py), then "@@store closed" or "@@store open": whether anything still
listens on the case's port once the case is over and its objects are freed (rank 0 hosts the
store, which died with its process when each case had processes of its own). Each case runs in
the process's own environment with only its variables (and those of its "env", every rank's)
set, and leaves nothing set behind; its ranks start it together (a file per process beside SPEC
says it is there: "I.PROC.here", I the case's index)."""
import atexit
import gc
import json
import os
import socket
import sys
import time

proc, spec = sys.argv[1], sys.argv[2]
with open(spec) as f:
    cases = json.load(f)

import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401
from neuron_dist import hosts  # noqa: E402
from report_init import init_and_report  # noqa: E402

BASE_ENV = dict(os.environ)
REAL = {"gethostname": socket.gethostname, "machine_key": hosts.machine_key,
        "forced_bind_addr": hosts.forced_bind_addr}


def run(case: dict, rank: int) -> None:
    kind, world, port = case["kind"], case["world"], str(case["port"])
    os.environ.update(case.get("env", {}))
    args = {}
    if kind == "unroutable":
        if rank == 1:
            socket.gethostname = lambda: "elsewhere.invalid"
            os.environ["MASTER_ADDR"] = "no-such-host.invalid"
        else:
            os.environ.update(MASTER_ADDR="127.0.0.1", NEURON_DIST_BIND_ADDR="127.0.0.1")
        args = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    if kind == "placement" and rank == case["bad"]:
        var, value = case["setting"].split("=", 1)
        os.environ[var] = value
    if kind == "two_hosts":
        os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
        if rank >= world // 2:
            hosts.machine_key = lambda: "0ther0ne"
    if kind == "dies" and rank == 1:
        hosts.forced_bind_addr = lambda: os._exit(3)  # read just before the rank publishes its set-up
    init_and_report(rank, case["timeout"], **args)


def meet(i: int, case: dict) -> None:
    """Wait until every process of the case is here, so that its ranks start together as the
    processes of a job of its own did (a rank's time-out also bounds its wait for the store)."""
    here = os.path.join(os.path.dirname(spec), f"{i}.{proc}.here")
    open(here, "w").close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(os.path.dirname(spec), f"{i}.{p}.here")) for p in case["ranks"]):
            return
        time.sleep(0.02)
    print(f"@@late: not every process of case {case['id']} came within 300s", flush=True)


for i, case in enumerate(cases):
    rank = case["ranks"].get(proc)
    if rank is None:
        continue
    meet(i, case)
    # torch names each group by its count of groups made in the process, which a failed set-up
    # raised: a fresh process's world is group '0', as destroy_process_group leaves the count
    assert not dist.is_initialized() and not dist.distributed_c10d._world.pg_names, "a case left a group"
    dist.distributed_c10d._world.group_count = 0
    print(f"@@case {case['id']}", flush=True)
    try:
        run(case, rank)
    finally:
        if dist.is_initialized():  # a case whose set-up did work (a fault): leave room for the next
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(BASE_ENV)
        socket.gethostname, hosts.machine_key = REAL["gethostname"], REAL["machine_key"]
        hosts.forced_bind_addr = REAL["forced_bind_addr"]
        gc.collect()
    with socket.socket() as s:
        s.settimeout(5)
        print(f"@@store {'open' if s.connect_ex(('127.0.0.1', case['port'])) == 0 else 'closed'}", flush=True)
atexit._run_exitfuncs()
sys.stdout.flush()
os._exit(0)  # (the interpreter's finalization over torch's objects takes seconds on a loaded host)
