"""One rank of a 4-rank job whose ranks 2 and 3 stand for a second host (another machine key, so
the backend takes them for one), every rank given GROUP_RANK=0 by a mistaken launcher (started
by tests/test_misuse.py). Prints how init_process_group ended on this rank."""
import os
import sys

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                  LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK="0")

import neuron_dist  # noqa: E402,F401
from neuron_dist import hosts  # noqa: E402
from report_init import init_and_report  # noqa: E402

if rank >= world // 2:
    hosts.machine_key = lambda: "0ther0ne"
init_and_report(rank, 20)
