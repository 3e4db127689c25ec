"""One rank of a 2-rank job that spans two hosts as the backend sees them (rank 1 reports another
host name), in which rank 1 cannot resolve MASTER_ADDR to choose the interface it listens on.
Rank 0 listens on 127.0.0.1 (NEURON_DIST_BIND_ADDR); the ranks meet through a tcp:// store, so
rank 1's bad MASTER_ADDR touches only that choice. Started by tests/test_misuse.py; prints how
init_process_group ended on this rank and how long it took (the group time-out is 60 s)."""
import os
import socket
import sys

rank, port = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    socket.gethostname = lambda: "elsewhere.invalid"
    os.environ["MASTER_ADDR"] = "no-such-host.invalid"
else:
    os.environ.update(MASTER_ADDR="127.0.0.1", NEURON_DIST_BIND_ADDR="127.0.0.1")

import neuron_dist  # noqa: E402,F401
from report_init import init_and_report  # noqa: E402

init_and_report(rank, 60, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
