"""Rank-side: a rank that never enters a collective. The others' error, within the group's
timeout, names the rank that had not entered, the collective and its sequence number, and
what each rank last ran."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rankctx as R

TIMEOUT_S = 3.0


def absent_rank(rank, world):
    g = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    x = torch.ones(8)
    dist.all_reduce(x, group=g)  # seq 0: everyone
    msg, took = None, 0.0
    if rank != 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(x, group=g)  # seq 1: rank 0 never calls it
        except dist.DistBackendError as e:
            msg = str(e)
        took = time.monotonic() - t0
        assert msg is not None, "a collective with an absent rank returned"
        assert took < TIMEOUT_S + 5, f"the error took {took:.1f}s (timeout {TIMEOUT_S}s)"
        assert "timed out" in msg and "seq 1" in msg, msg
        assert "Ranks [0] had not entered allreduce seq 1" in msg, msg
        assert "Rank 0 last ran: #0 allreduce" in msg, msg
    dist.barrier(group=R.GLOO)  # rank 0 waits here until the others have their error
    dist.destroy_process_group(g)
    return 1
