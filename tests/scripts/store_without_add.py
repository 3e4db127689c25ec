"""A world of one on a store of the caller's that has set, get, check and wait but no add (a
Python `dist.Store` subclass; Gloo needs no more): the group forms and reduces, twice, as it did
before group generations were counted in the store (started by tests/test_init_methods.py)."""
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import neuron_dist  # noqa: F401


class DictStore(dist.Store):
    def __init__(self):
        super().__init__()
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = v if isinstance(v, bytes) else str(v).encode()
            self.cv.notify_all()

    def get(self, k):
        with self.cv:
            self.cv.wait_for(lambda: k in self.d, timeout=5)
            return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def wait(self, keys, timeout=None):
        for k in keys:
            self.get(k)


store = DictStore()
for _ in range(2):
    dist.init_process_group("neuron", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
print("ok", t.tolist(), flush=True)
