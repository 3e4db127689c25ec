"""A zero-copy zmq send still being written out when its transport closes (abort), its tensor
freed by the caller right after: libzmq's I/O thread went on reading the freed buffer, failed on
EFAULT and aborted the process ("Bad address (src/tcp.cpp:...)", exit 134). Prints how many of
the rounds found the frame unfinished at the close (the case under test), then "survived"."""
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from zmqpair import make_pair, p2p_header  # noqa: E402

N = 256 << 20  # freed with munmap (far above malloc's mmap threshold)
keep, unfinished = [], 0
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    a, b = make_pair(f"closing{i}")
    t = torch.full((N,), 7, dtype=torch.uint8)
    b.send(0, p2p_header(src=1, dst=0, nbytes=N), t)  # nobody receives: libzmq is still writing
    time.sleep(0.005)
    unfinished += not b.trackers[0][0].done
    b.close(abort=True)
    del t
    gc.collect()
    time.sleep(0.3)  # libzmq's I/O thread runs on
    keep.append(a)
for a in keep:
    a.close(abort=True)
print(f"unfinished at close: {unfinished}; survived", flush=True)
