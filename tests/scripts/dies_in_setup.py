"""One rank of a 3-rank job in which rank 1 dies after the members met and before it published
its set-up (started by tests/test_misuse.py). Prints how init_process_group ended on this rank."""
import os
import sys

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))

import neuron_dist  # noqa: E402,F401
from neuron_dist import hosts  # noqa: E402
from report_init import init_and_report  # noqa: E402

if rank == 1:
    hosts.forced_bind_addr = lambda: os._exit(3)  # read just before the rank publishes its set-up
init_and_report(rank, 4)
