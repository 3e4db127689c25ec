"""Many zmq transports held open in one process, as a rank's many live groups are: each holds
1 + 3 sockets per zmq peer (a PULL; a PUSH and a monitor pair per peer), and libzmq's default
budget of 1023 sockets per context made the ~256th two-rank group fail with a bare ZMQError
("Too many open files") while the process had thousands of descriptors to spare. Here 300
one-peer transports (1,200 sockets) under a descriptor limit of 8,192 must all be made (a
subprocess: the limit is the process's)."""
import json
import resource
from datetime import timedelta

import torch.distributed as dist

from neuron_dist.transport import zmq_transport
from neuron_dist.transport.base import TransportContext, TransportError

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
store = dist.HashStore()


def make(i):
    ctx = TransportContext(rank=0, size=2, store=store, token=7, timeout=timedelta(seconds=10), hostname="h",
                           bind_addr="127.0.0.1", hosts=["h", "h"], job_id=f"budget{i}")
    return zmq_transport.ZmqTransport(ctx)


resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))
store.set("zmq/1", json.dumps({"ipc": "ipc://@neuron_dist-budget-nobody"}))  # rank 1: nobody listens yet
built = []
try:
    while len(built) < 300:
        built.append(make(len(built)))
        if len(built) == 1:  # the others' peer: the first transport's own listener
            store.set("zmq/1", json.dumps({"ipc": json.loads(store.get("zmq/0"))["ipc"]}))
    print(f"built {len(built)}", flush=True)
except TransportError as e:
    print(f"built {len(built)}; error: {e}; record: {store.get('zmq/0').decode()}", flush=True)
finally:
    for t in built:
        t.close(abort=True)
print(f"closed; context ended: {zmq_transport._CONTEXT is None}", flush=True)
