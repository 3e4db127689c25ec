"""Per-collective summary of a group: calls, bytes, algorithm, measured host time and the cost
model's device time for the same calls on the modelled instance.

    neuron_dist.report()                 # rows for the default group (or report(group))
    NEURON_DIST_REPORT=1 torchrun ...    # each rank prints its table when its group is destroyed
    NEURON_DIST_REPORT=/tmp/rep.txt      # ... appended to that file instead
"""
from __future__ import annotations

from .config import emit, env_target


def report(group=None) -> list[dict]:
    """Rows of {collective, algorithm, calls, bytes, host_s, model_device_s} for a process
    group (default: the default group)."""
    import torch.distributed as dist
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("no default process group: call dist.init_process_group('neuron') first")
    inner = getattr(pg, "group", None)
    if inner is None:
        raise ValueError(f"{pg!r} is not a neuron process group")
    return inner.report()


def format_rows(rows: list[dict], title: str) -> str:
    out = [title, f"# {'collective':>15} {'algorithm':>13} {'calls':>7} {'bytes':>12} "
                  f"{'host(us/call)':>14} {'model(us/call)':>15}"]
    for r in rows:
        calls = max(r["calls"], 1)
        model = "-" if r["model_device_s"] is None else f"{r['model_device_s'] / calls * 1e6:.2f}"
        out.append(f"  {r['collective']:>15} {r['algorithm']:>13} {r['calls']:>7} {r['bytes']:>12} "
                   f"{r['host_s'] / calls * 1e6:>14.1f} {model:>15}")
    return "\n".join(out) + "\n"


def at_shutdown(group) -> None:
    """Print or append the group's table if NEURON_DIST_REPORT asks for it."""
    where = env_target("NEURON_DIST_REPORT")
    if not where or not group.stats:
        return
    inst = group.topology.instance.name if group.topology is not None else "no placement"
    text = format_rows(group.report(), f"# neuron_dist report: group {group.name!r} rank {group.rank}/"
                                       f"{group.size}, modelled instance {inst}")
    emit(text, where)
