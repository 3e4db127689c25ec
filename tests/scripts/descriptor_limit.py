"""One rank of a two-rank job that makes groups until its descriptor limit (a soft limit of 256
set here) runs out (started by tests/test_lifecycle.py). A shared-memory group's set-up failed
with whatever call hit the limit first, naming no rank, group or limit (an import's "Too many
open files: '.../mpi.py'", zmq's "Authenticator thread failed to start"). Prints one JSON line."""
import json
import resource
import sys
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=10))
made, error = 0, None
try:
    for _ in range(200):
        dist.new_group([0, 1])
        made += 1
except Exception as e:  # noqa: BLE001 - the failure this script makes
    error = f"{type(e).__name__}: {e}"
print(json.dumps(dict(made=made, error=error)), flush=True)
