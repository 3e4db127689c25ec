"""One rank of a 3-rank job in which rank `bad` has a setting the others do not
(NEURON_RT_VISIBLE_CORES=abc, or the VAR=VALUE given as a fifth argument), started by tests/test_misuse.py. Prints one line: how
init_process_group ended on this rank and how long it took (the group time-out is 60 s)."""
import os
import sys

rank, world, port, bad = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
var, value = (sys.argv[5].split("=", 1) if len(sys.argv) > 5 else ("NEURON_RT_VISIBLE_CORES", "abc"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
if rank == bad:
    os.environ[var] = value

import neuron_dist  # noqa: E402,F401
from report_init import init_and_report  # noqa: E402

init_and_report(rank, 60)
