"""One rank of a 2-rank job: rank 1 posts an irecv of two frames' worth of elements from rank 0
and is frozen (SIGSTOP) by rank 0, which sends 3 elements and exits (os._exit, as a crash right
after its send would); rank 1 resumes once rank 0's process has ended (a waiter on its pidfd
sends SIGCONT), its sender dead and the whole message in its ring. The buffer is larger than
one frame so that the receive is a `p2p.Receive`, which builds a receive of the message's own
size once its first frame is there: the path under test (a buffer that fits one frame takes
the short message in its one-frame receive, with no second receive built; with 8 elements
this job passed whatever that build checked). Started by tests/test_faults.py; rank 1 prints
the front of what its receive got, and whether the rest of its buffer was left alone."""
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

# rank 1's resumer: SIGCONT once rank 0's process has ended (its pidfd reads ready; one already
# reaped is gone too), so rank 1 builds the message's receive with its sender dead
RESUME_WHEN_GONE = """
import os, select, signal, sys
gone, frozen = map(int, sys.argv[1:])
try:
    select.select([os.pidfd_open(gone)], [], [])
except ProcessLookupError:
    pass
os.kill(frozen, signal.SIGCONT)
"""

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=30))
if rank == 1:
    frame_elements = dist.distributed_c10d._get_default_group().group.frame_bytes // 4
    got = torch.full((2 * frame_elements,), -1.0)
    work = dist.irecv(got, 0)
pid = torch.tensor([os.getpid() if rank == 1 else 0])
dist.broadcast(pid, 1)
if rank == 0:
    time.sleep(0.3)
    os.kill(int(pid), signal.SIGSTOP)
    dist.send(torch.arange(3.0), 1)
    # The message must have left this process before it dies. Over zmq a send under 64 KiB
    # completes once queued, and zmq's I/O thread writes it to the socket a moment later
    # (microseconds; a kill in between loses it: README "Known limits"). Shared memory writes it
    # in the call. (A send of 64 KiB, which completes only once zmq hands it off, cannot be used
    # to wait for it: tried, it did not complete while rank 1 was frozen.)
    time.sleep(0.2)
    subprocess.Popen([sys.executable, "-c", RESUME_WHEN_GONE, str(os.getpid()), str(int(pid))])
    os._exit(0)
try:
    work.wait()
    rest = "untouched" if bool((got[3:] == -1.0).all()) else "written"
    print(f"rank 1: got {got[:8].tolist()}, the rest {rest}", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"rank 1: {type(e).__name__}: {e}", flush=True)
os._exit(0)
