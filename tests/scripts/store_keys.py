"""One rank of a two-rank job that makes and destroys a subgroup again and again on one TCPStore
(started by tests/test_lifecycle.py): prints the store's key count after init and after the
cycles, as one JSON line from rank 0 (which hosts the store)."""
import json
import sys
from datetime import timedelta

rank, port, cycles = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

T = timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=T)
dist.init_process_group("neuron", store=store, rank=rank, world_size=2, timeout=T)
dist.barrier()
before = store.num_keys()
for _ in range(cycles):
    g = dist.new_group([0, 1], timeout=T)
    t = torch.ones(4)
    dist.all_reduce(t, group=g)
    assert t.tolist() == [2.0] * 4, t
    dist.destroy_process_group(g)
dist.barrier()
after = store.num_keys()
dist.barrier()  # (rank 0's store outlives rank 1's last look)
if rank == 0:
    print(json.dumps(dict(before=before, after=after, cycles=cycles)), flush=True)
dist.destroy_process_group()
