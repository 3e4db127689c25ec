"""All-reduce of a sparse COO tensor (DDP's gradient of an `nn.Embedding(sparse=True)`), as
Gloo makes it: every rank's indices and values are all-gathered, concatenated in rank order
and coalesced, so duplicates sum in the same order on every rank (identical results); SUM only.

Built from the group's dense all-gathers, not a schedule of its own: the sizes differ from rank
to rank (each has its own number of non-zeros), so a fixed-size record of every rank's layout
goes first (checked alike on every rank: a mismatch is the same error everywhere, never a hang),
then the indices and values, padded to the largest count.
"""
from __future__ import annotations

import torch

from .transport.frame import CODE_DTYPE, DTYPE_CODE

MAX_DIMS = 16  # dimensions a sparse tensor's layout record holds


def layout_record(t: torch.Tensor) -> torch.Tensor:
    """nnz, sparse dims, dense dims, dtype code, dimensions, then the shape padded with -1, of the
    coalesced tensor `t`."""
    shape = list(t.shape)
    return torch.tensor([t.indices().shape[1], t.sparse_dim(), t.dense_dim(), DTYPE_CODE[t.dtype], len(shape)]
                        + shape + [-1] * (MAX_DIMS - len(shape)), dtype=torch.int64)


def check_layouts(records: list[torch.Tensor], rank: int, what: str) -> list[int]:
    """Every rank's non-zero count, once all agree on the rest of the layout (the same check on
    every rank, from the same records)."""
    def described(r):
        v = records[r].tolist()
        return f"shape {tuple(v[5:5 + v[4]])}, {v[1]} sparse and {v[2]} dense dims, {CODE_DTYPE[v[3]]}"
    mine = records[rank][1:]
    differ = [r for r in range(len(records)) if not torch.equal(records[r][1:], mine)]
    if differ:
        raise ValueError(f"[rank {rank}] {what}: the ranks' sparse tensors differ: " + "; ".join(
            f"rank {r}: {described(r)}" for r in sorted({rank, *differ})))
    return [int(rec[0]) for rec in records]


def allreduce(pg, t: torch.Tensor, what: str = "allreduce") -> None:
    """Sum the coalesced sparse tensor `t` over the group `pg` (a NeuronProcessGroup), in place:
    `t` becomes the coalesced sum, as under Gloo. Runs on the caller's thread, its all-gathers
    ordered with the group's other calls."""
    rank, n = pg.group.rank, pg.group.size
    if t.dim() > MAX_DIMS:
        raise ValueError(f"[rank {rank}] {what}: a sparse tensor of {t.dim()} dimensions (at most {MAX_DIMS})")
    x = t.coalesce()
    mine = layout_record(x)
    records = [torch.empty_like(mine) for _ in range(n)]
    pg.allgather([records], [mine]).wait()
    counts = check_layouts(records, rank, what)
    most = max(counts)
    indices, values = x.indices(), x.values()
    pad_i = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
    pad_i[:, :indices.shape[1]] = indices
    pad_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype)
    pad_v[:values.shape[0]] = values
    all_i = [torch.empty_like(pad_i) for _ in range(n)]
    all_v = [torch.empty_like(pad_v) for _ in range(n)]
    pg.allgather([all_i], [pad_i]).wait()
    pg.allgather([all_v], [pad_v]).wait()
    total = torch.sparse_coo_tensor(torch.cat([i[:, :c] for i, c in zip(all_i, counts)], dim=1),
                                    torch.cat([v[:c] for v, c in zip(all_v, counts)]), x.shape).coalesce()
    with torch.no_grad():
        t.copy_(total)
