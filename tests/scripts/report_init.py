"""How the rank scripts of test_misuse.py end (set_up_cases.py): the rank runs
init_process_group and prints one line, `rank R: ok` or `rank R: <error type> after <s>s:
<message>`, which the tests read with pool.rank_line."""
import time
from datetime import timedelta

import torch.distributed as dist


def init_and_report(who: int, timeout_s: float, **init_args) -> None:
    t0 = time.monotonic()
    try:
        dist.init_process_group("neuron", timeout=timedelta(seconds=timeout_s), **init_args)
        print(f"rank {who}: ok", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank {who}: {type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}", flush=True)
