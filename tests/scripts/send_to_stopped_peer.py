"""One rank of a 2-rank job with a 2 s group time-out: rank 1 freezes itself (SIGSTOP) for 8 s
while rank 0 sends it 256 KiB messages (one frame each), until one does not complete: the
transport still reads it (over zmq, the kernel's socket buffers full) and the send must time
out at 2 s, waiting, not spinning. Started by tests/test_faults.py; rank 0 prints how its sends
ended, with the CPU time the last one used."""
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neuron_dist  # noqa: E402,F401

dist.init_process_group("neuron", timeout=timedelta(seconds=60))
pid = torch.tensor([os.getpid() if rank == 1 else 0])
dist.broadcast(pid, 1)  # (under the long time-out: on a loaded host a rank may start seconds late)
dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=2))
if rank == 1:
    subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)  # (rank 0 failed meanwhile: nothing more to receive)
time.sleep(0.5)  # rank 1 has stopped
msg = torch.ones(1 << 16)
for i in range(64):
    t0, c0 = time.monotonic(), time.process_time()
    try:
        dist.send(msg, 1)
    except Exception as e:  # noqa: BLE001
        print(f"rank 0: send {i} failed after {time.monotonic() - t0:.1f}s (cpu {time.process_time() - c0:.1f}s): "
              f"{e}", flush=True)
        os._exit(0)
    if time.monotonic() - t0 > 1:  # returned once rank 1 woke: it never timed out
        print(f"rank 0: send {i} returned after {time.monotonic() - t0:.1f}s (cpu {time.process_time() - c0:.1f}s)",
              flush=True)
print(f"rank 0: all 64 sends returned, the last after {time.monotonic() - t0:.1f}s", flush=True)
os._exit(0)
