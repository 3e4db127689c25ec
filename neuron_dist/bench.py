"""neuron_dist.bench: nccl-tests-style collective benchmark of the "neuron" backend.

    python -m neuron_dist.bench                              # all-reduce, 2 ranks, 4 KiB .. 64 MiB
    python -m neuron_dist.bench -g 4 --ops all --vs gloo     # every collective, Gloo beside it
    python -m neuron_dist.bench --ops allreduce -d bfloat16 --json out.json
    python -m neuron_dist.bench --instance trn2.48xlarge     # modelled busbw for that instance

Spawns `-g` CPU ranks on this host, which meet on `--port` (default $MASTER_PORT, else a free
port), or joins a launcher's RANK/WORLD_SIZE job. Sizes run from
`-b` to `-e`, times `-f` each row (one row when -b equals -e). `--ops` takes allreduce,
allgather, reduce_scatter, broadcast, reduce, gather, scatter, alltoall, sendrecv (nccl-tests'
*_perf programs), or all. Columns follow nccl-tests: size (bytes of the largest buffer:
all-gather's and gather's output, reduce-scatter's and scatter's input), count (elements of one
rank's call, nccl-tests' paramcount: all-gather's and gather's input, reduce-scatter's and
scatter's output, all-to-all's block for each peer; the whole buffer for the others; the JSON's
`count` is the same), type, time (median over iterations of the slowest rank's time; each
iteration preceded by a barrier on a separate Gloo group), algbw = size / time, busbw = algbw x
the collective's bus factor (all-reduce 2(n-1)/n; all-gather, reduce-scatter, gather, scatter,
all-to-all (n-1)/n; broadcast, reduce, send/recv 1), #wrong = mismatching elements over all
ranks in the worse of two checked calls, untimed: the first, and one after the timed calls with
the data written afresh, as nccl-tests checks after its timed loop, so that a fault that shows
only once a call's form is reused is seen (outputs start as NaN, so an element the call never
wrote counts; reduce's and gather's output is the root's alone; each rank's reduction data is
its own, the extremes at different ranks, and exact in the dtype: a world too large for that,
as bfloat16 sums over 128 ranks, is refused). As in nccl-tests, time, algbw, busbw and
#wrong come in two groups, out-of-place and in-place, each form timed and checked on its own:
in place, all-gather's and gather's input is the rank's block of the output, reduce-scatter's
and scatter's output the rank's block of the input (at the root for the rooted ones); all-reduce,
broadcast and reduce, whose torch.distributed calls take one buffer, run in place only, and
all-to-all and send/recv out of place only (`-` in the other group). `--place out` or `in` times
one form (the default, both, doubles only all-gather's, reduce-scatter's, gather's and scatter's
timed calls); `--place in` leaves all-to-all and send/recv out. The JSON row's `neuron`, `gloo`
and `ratio` hold the row's main form, which `place` names ("out" where the call has that form,
else "in"), and `in_place` the in-place form beside it where both ran. `-o` picks the reduction of all-reduce,
reduce-scatter and reduce (sum, prod, min, max, avg), `-r` the root of broadcast, reduce, gather
and scatter, as nccl-tests' flags do (the header line names both); `-d` takes float and
int32/int64 types. Sizes that round to the
count of an earlier row (a call moves at least one element per rank) are left out, and so is
send/recv at world 1 (no peer: no backend to measure).
With `--vs gloo` Gloo runs the same sizes in the same processes, interleaved size by size so both
see the same machine, and `ratio` is neuron's busbw over Gloo's, of the row's main form (out of
place where the call has that form and --place allows it, else in place; the Gloo columns' header
names the form that ran, "gloo: out of place" or "gloo: in place"). `ran` is the algorithm the
backend ran (its flight record of the checked call; `-` for send/recv, which has none); under
NEURON_DIST_TUNING=host it may differ from `algo`. `model` is the busbw that
`neuron_dist.topology.estimate` predicts for `algo`, the algorithm the backend picks under its
model policy (NEURON_DIST_ALGO honoured), on the modelled instance (`--instance`, default
$NEURON_DIST_INSTANCE or trn2.48xlarge, each rank on `--cores-per-rank` cores, default
$NEURON_RT_NUM_CORES, else one, as neuronrun places them (the ranks bench spawns are placed so
too), on one node or, under a launcher, LOCAL_WORLD_SIZE to a node): the device the backend is
tuned for, not this host; `-` where it predicts no time, as for one rank. The ranks model the
`--instance` too (it is exported to them as NEURON_DIST_INSTANCE), so under the model policy `ran`
is `algo`; under a launcher whose ranks already model another one (neuronrun --instance) it is
refused. GB = 1e9 bytes. The exit status is 1 if any element was wrong, neuron's or (with
`--vs gloo`) the Gloo reference's. Python's cyclic collector is paused while a row is timed
(a collection in one rank stalls its peers inside a timed call: 100-200 ms rows), for both
backends.

`--loop` times as nccl-tests does: one barrier, then `-n` back-to-back calls, time = the slowest
rank's average. It shows a backend's own per-call cost; the default (a Gloo barrier before every
call) includes the cost of coming out of that barrier, which on a host with fewer cores than
ranks favours whichever backend's next call is cheapest to schedule.

`--thp on` runs every rank, Gloo's rows included, with torch's huge-page switch that neuronrun sets
by default (THP_MEM_ALLOC_ENABLE=1: tensors of 2 MiB and more on transparent huge pages; the
command restarts itself with it set); on the 2-vCPU hosts here it made the 64 MiB rows a quarter
to a third faster under both backends (benchmarks/RESULTS.md, "Forty-eighth pass"). The default
leaves the environment as it is, so rows compare with earlier runs.

`--added` times what a call costs the job: per iteration, the wall time of (call + barrier) less
that of the barrier just before it alone, averaged over the ranks, median over iterations. Work a
backend leaves running when its call returns (Gloo's worker threads, the wake-ups they cause) is
then charged to it, not to whatever comes next. A call that costs less than the barrier's own
jitter (median difference <= 0) has no such time: `-` in the table, null in the JSON.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

from .ports import free_port  # the benchmarks' rendezvous port
from .topology.placement import DEFAULT_INSTANCE

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "alltoall",
       "sendrecv")
BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
       "gather": lambda n: (n - 1) / n, "scatter": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "sendrecv": lambda n: 1.0}
# count is one rank's block (paramcount): all-gather's, gather's input, reduce-scatter's, scatter's output
PER_RANK = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")
REDUCING = ("allreduce", "reduce_scatter", "reduce")  # the collectives -o/--redop applies to
IN_PLACE_ONLY = ("allreduce", "broadcast", "reduce")  # torch.distributed's call takes one buffer
OUT_OF_PLACE_ONLY = ("alltoall", "sendrecv")  # no in-place form (torch stages one, NCCL has none for all-to-all)
PLACES = ("both", "out", "in")  # --place
REDOPS = ("sum", "prod", "min", "max", "avg")  # nccl-tests' -o
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64")  # check values exact (reduction_levels)
# what the backend runs depends on these (None: unset, the default), so the JSON records them
TUNING_VARS = ("NEURON_DIST_TUNING", "NEURON_DIST_ALGO")


def forms(op: str, place: str) -> list[bool]:
    """The forms `op` is timed in under --place `place`, as in_place flags, the row's main form
    first (the one the JSON's neuron/gloo/ratio hold and Gloo runs): out of place where the call
    has that form, as nccl-tests' first column group, else in place. "out" keeps only the main
    form (bench's behaviour before the in-place group), "in" only in-place forms (none for
    all-to-all and send/recv, whose rows are then left out)."""
    if op in IN_PLACE_ONLY:
        return [True]
    if op in OUT_OF_PLACE_ONLY:
        return [] if place == "in" else [False]
    return {"both": [False, True], "out": [False], "in": [True]}[place]


def parse_size(s: str) -> int:
    """"4K", "4KiB", "64MB", "7" -> bytes (K, M, G are powers of two). A ValueError, which
    argparse turns into a usage error, for what is not a whole finite number of bytes: "inf" was
    an OverflowError traceback, "0.5" silently became 0 bytes."""
    t = str(s).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    v = float(t[:-1] if mult > 1 else t) * mult
    if not math.isfinite(v) or not v.is_integer():
        raise ValueError(f"size {s!r} is not a whole number of bytes")
    return int(v)


def paramcount(nbytes: int, elem_size: int, n: int, per_rank: bool) -> int:
    """nccl-tests' count column (its paramcount): the elements of one rank's call, which is one
    rank's block (per_rank: all-gather's input, reduce-scatter's output, all-to-all's block per
    peer) or the whole buffer; at least one element, as a call moves at least one. Shared with
    `python -m neuron_dist.topology predict` so the two tables agree."""
    return max(1, nbytes // (elem_size * n)) if per_rank else max(1, nbytes // elem_size)


def sweep(lo: int, hi: int, factor: int) -> list[int]:
    """The sizes -b lo -e hi -f factor times: lo, lo x factor, ... up to hi. With lo == hi there
    is one size whatever the factor (as in nccl-tests); check() rejects the arguments (lo < 1,
    factor < 2 otherwise) for which the multiplication would never pass hi."""
    sizes = [lo]
    while lo < hi and sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def distinct_sizes(op: str, sizes: list[int], elem_size: int, n: int) -> list[int]:
    """The sizes of the sweep that give `op` a buffer of its own, in order: a call moves at least
    one element per rank, so at a few bytes several sizes round to the same count, and their
    rows would repeat one another (-b 1 -e 64 -f 2 at world 2 printed four identical rows)."""
    seen, out = set(), []
    for s in sizes:
        c = paramcount(s, elem_size, n, op in PER_RANK)
        if c not in seen:
            seen.add(c)
            out.append(s)
    return out


# the variables that place a rank on the modelled cores, and so decide the algorithm (neuronrun sets them)
PLACEMENT_VARS = ("NEURON_LOGICAL_NC_CONFIG", "NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES")


def run_env() -> dict:
    """The environment that decides what the backend runs: TUNING_VARS always (None where unset,
    the default), and whatever other NEURON_DIST_* variable or placement variable (PLACEMENT_VARS:
    rank 0's, under a launcher) is set, so a JSON file says how its numbers were made (a run under
    NEURON_DIST_TUNING=host and one under the model policy were indistinguishable, and so were
    ranks on one core and on four)."""
    env = {k: os.environ.get(k) for k in TUNING_VARS}
    env.update({k: v for k, v in sorted(os.environ.items())
                if k.startswith("NEURON_DIST_") or k in PLACEMENT_VARS})
    return env


def expand_ops(ops: list[str]) -> list[str]:
    """`all` wherever it appears stands for every collective; each op once, in the order given."""
    out = []
    for o in ops:
        for x in (OPS if o == "all" else (o,)):
            if x not in out:
                out.append(x)
    return out


def last_record(pg):
    """The group's latest flight record (one per collective; point-to-point is not recorded)."""
    records = getattr(getattr(pg, "group", None), "records", None)
    return records[-1] if records else None


def ran_algorithm(pg, before) -> str | None:
    """The algorithm the backend ran for the collective called since `before` (its flight
    record): what NEURON_DIST_TUNING and NEURON_DIST_ALGO chose on this host, where the `algo`
    column is the model policy's choice. None when the call left no record (send/recv)."""
    rec = last_record(pg)
    return rec.algorithm if rec is not None and rec is not before else None


def unwritten(dtype):
    """What an output holds before the checked call: a value no collective is expected to give
    (NaN, or the most negative integer). torch.empty's memory may already hold the expected
    values, left there by an earlier size or backend, and a receive that never wrote its buffer
    then counted no wrong element."""
    import torch
    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min


CHUNK = 1 << 18  # elements per piece when Case fills an input or checks an output
LEVELS = 5  # a reduction's base values a(g) = g % m + 2, m at most LEVELS (reduction_input)


def exact_integers(dtype) -> int:
    """The largest M such that every integer 0..M is exact in `dtype`: 2 / eps for a float type
    (bfloat16 256, float16 2048, float32 2^24, float64 2^53), the largest value for an integer."""
    import torch
    return int(2 / torch.finfo(dtype).eps) if dtype.is_floating_point else torch.iinfo(dtype).max


def reduction_levels(redop: str, n: int, dtype) -> int:
    """m, the number of base values (2..m+1) of n ranks' reduction_input in `dtype`: LEVELS, or
    for sum and avg, whose total n x a(g) must be exact (every input is positive, so no partial
    sum of any order is larger), as many as keep it so; 0 where not even m = 1 does (bfloat16
    above 128 ranks, float16 above 1024). The total was 4n + n(n+1)/2, past bfloat16's 256 from
    19 ranks on (float16's 2048 from 60): any backend's right answer, rounded on the way, was
    counted wrong."""
    if redop not in ("sum", "avg"):
        return LEVELS
    return max(0, min(LEVELS, exact_integers(dtype) // n - 1))


def inexact_reduction(redop: str, n: int, dtype) -> str | None:
    """Why a `-o redop` check over n ranks cannot be exact in `dtype`, else None (bench's check
    refuses such a run before any rank starts, and Case refuses to build one)."""
    if reduction_levels(redop, n, dtype):
        return None
    return (f"-o {redop} over {n} ranks in {str(dtype).removeprefix('torch.')}: the check's sum, at least 2 "
            f"per rank, passes {exact_integers(dtype)}, the largest integer up to which that type is exact, so "
            f"the check would count rounding as wrong (take fewer ranks or a wider type, as float32)")


def reduction_input(redop: str, n: int, m: int, r: int, g):
    """Rank r's input, of n ranks, at global indices `g` (an index tensor) of a reduction (-o
    redop): each rank's own data, as nccl-tests gives each rank, so that a wrong reduction cannot
    pass. The inputs were (g % 5) + r + 1, rising with the rank: rank 0 held every minimum and
    rank n-1 every maximum, so a MIN that returned rank 0's input passed; and PRODUCT put one 2
    at each index, where MAX gives 2 as well.
    sum, avg, min, max: a(g) = g % m + 2 plus d, where the ranks pair up (0 with 1, 2 with 3, ...)
    and hold d = +1 and -1, which of the two alternating with g and from pair to pair (an odd
    world's last three ranks hold +1, -1 and 0 in turn). The extremes a(g) +- 1 are thus held by
    different ranks at different indices, no rank always holds the average, and the d cancel:
    the sum is n x a(g) and the average a(g), exact. Every input is at least 1, so at two ranks
    or more no input equals the sum (an in-place reduce-scatter left as its input is all wrong).
    prod: e(g) = g % 3 ranks (at most n), starting at rank g mod n, hold a 2, the others 1: the
    product 2^e(g) is 4 where MAX gives 2, and exact in every dtype."""
    if redop == "prod":
        return ((r - g) % n < (g % 3).clamp(max=n)).long() + 1
    a = g % m + 2
    if n == 1:
        return a
    if n % 2 and r >= n - 3:  # an odd world's last three ranks: +1, -1 and 0, in turn
        q = (r - (n - 3) + g) % 3
        return a + (q == 0).long() - (q == 1).long()
    d = 1 - 2 * ((g + r // 2) % 2)  # a pair: +1 and -1, swapped at every index and pair to pair
    return a + d if r % 2 == 0 else a - d


def reduction_want(redop: str, n: int, m: int, g):
    """What reducing the n ranks' reduction_input by `redop` gives at global indices `g`."""
    if redop == "prod":
        return 2 ** (g % 3).clamp(max=n)
    a = g % m + 2
    step = int(n > 1)  # (one rank: its own input)
    return {"sum": n * a, "avg": a, "min": a - step, "max": a + step}[redop]


class Case:
    """One collective at one size on one backend's group: inputs, the call, the check. Inputs
    and expected values are made CHUNK elements at a time, and the output checked so, never
    held whole: the int64 index tensors and temporaries of whole-buffer expressions, a kept
    copy of the expected output and the check's float copies made a rank's peak memory 8-9
    times its buffer (1261 MiB for a 128 MiB all-gather)."""

    def __init__(self, op: str, nbytes: int, dtype, rank: int, n: int, group, redop: str = "sum", root: int = 0,
                 in_place: bool | None = None):
        import torch
        import torch.distributed as dist
        if op == "sendrecv" and n < 2:  # a local copy measured no backend, yet printed a busbw (worker leaves it out)
            raise ValueError("sendrecv needs two ranks or more")
        in_place = op in IN_PLACE_ONLY if in_place is None else in_place  # (None: the op's main form)
        if in_place != (op in IN_PLACE_ONLY) and op in IN_PLACE_ONLY + OUT_OF_PLACE_ONLY:
            raise ValueError(f"{op} has no {'in-place' if in_place else 'out-of-place'} form")
        self.in_place = in_place
        self.op, self.rank, self.n, self.g, self.dist, self.dtype = op, rank, n, group, dist, dtype
        self.redop, self.root = redop, root  # (-o: REDUCING's; -r: broadcast's, reduce's, gather's, scatter's)
        self._op = getattr(dist.ReduceOp, "PRODUCT" if redop == "prod" else redop.upper())
        es = torch.empty(0, dtype=dtype).element_size()
        per = op in PER_RANK
        c = paramcount(nbytes, es, n, per)                                # per-rank block / count
        C = c * n if per else c                                           # the largest buffer
        self.c = c
        self.count, self.size = c, C * es   # nccl-tests' paramcount (one rank's call), bytes
        pat = lambda r: lambda k: (k % 5) + r + 1   # rank r's input at index k (all but all-to-all)
        if op in REDUCING:  # each rank's own data, the extremes held by different ranks (reduction_input)
            self.m = reduction_levels(redop, n, dtype)
            if not self.m:
                raise ValueError(inexact_reduction(redop, n, dtype))
            pat = lambda r: lambda k: reduction_input(redop, n, self.m, r, k)
        root_of = rank == root
        if op in ("allgather", "reduce_scatter", "alltoall", "sendrecv", "gather", "scatter"):
            # (gather's output is the root's alone; the other ranks check nothing)
            self.out = torch.empty(c if op in ("reduce_scatter", "scatter") else 0 if op == "gather" and not root_of
                                   else C, dtype=dtype)
        count = c if op in ("allgather", "gather") else 0 if op == "scatter" and not root_of else C
        if op in ("allgather", "gather"):  # rank r's block of the output
            self._values = lambda k: pat(rank)(k + rank * c)
        elif op == "alltoall":  # block j of rank r's input goes to rank j
            self._values = lambda k: k % 97 + 100 * rank
        elif op == "broadcast" and not root_of:
            self._values = lambda k: k * 0 - 1
        elif op == "scatter":  # the root's block r, for rank r (the others send nothing)
            self._values = lambda k: (k % 5) + k // c + 1
        else:
            self._values = pat(0 if op == "broadcast" else rank)
        self.x = torch.empty(count, dtype=dtype)
        if op in ("allreduce", "broadcast", "reduce"):
            # reduce: only the root's buffer is the output (Gloo writes the others' too: no check there)
            self.out = self.x if op != "reduce" or root_of else self.x[:0]
        if in_place and op in ("allgather", "gather") and self.out.numel():  # the input is this rank's block
            self.x = self.out[rank * c:(rank + 1) * c]                         # of the output
        elif in_place and (op == "reduce_scatter" or op == "scatter" and root_of):  # the output is this
            self.out = self.x[rank * c:(rank + 1) * c]                              # rank's block of the input
        # the output is (a block of) the input: fill() writes no unwritten() values there
        self._out_in_x = op in IN_PLACE_ONLY or in_place and (op == "reduce_scatter" or op == "scatter" and root_of)
        self.blocks = list(self.out.chunk(n)) if op == "gather" and root_of else \
            list(self.x.chunk(n)) if op == "scatter" and root_of else None  # the root's list of blocks
        self.fill()

    def fill(self) -> None:
        """Give the checked call its data: the outputs unwritten() and the inputs their values,
        computed a chunk of indices at a time. Once when the case is made, and again after the
        timed calls (`_measure`), which left the right values in the outputs already and, in
        the calls that reduce into their input, ran on zeros (reset)."""
        import torch
        if not self._out_in_x:  # (first: an in-place all-gather's input is a block of its output)
            self.out.fill_(unwritten(self.dtype))
        for lo in range(0, self.x.numel(), CHUNK):
            self.x[lo:lo + CHUNK] = self._values(torch.arange(lo, min(self.x.numel(), lo + CHUNK)))

    def want(self, k):
        """The checked call's expected output at indices `k` (an index tensor), in its dtype."""
        n, r, c = self.n, self.rank, self.c
        if self.op in REDUCING:  # over the ranks' reduction_input at the global index
            v = reduction_want(self.redop, n, self.m, k + r * c if self.op == "reduce_scatter" else k)
        elif self.op in ("allgather", "gather"):
            v = (k % 5) + k // c + 1
        elif self.op == "scatter":  # the root's block r
            v = ((k + r * c) % 5) + r + 1
        elif self.op == "broadcast":
            v = (k % 5) + 1
        elif self.op == "alltoall":  # block j came from rank j: its block r, offset k % c
            v = (r * c + k % c) % 97 + 100 * (k // c)
        else:  # sendrecv: the previous rank's input
            v = (k % 5) + (r - 1) % n + 1
        return v.to(self.dtype)

    def run(self) -> None:
        d, g = self.dist, self.g
        if self.op == "allreduce":
            d.all_reduce(self.x, op=self._op, group=g)
        elif self.op == "allgather":
            (getattr(d, "all_gather_single", None) or d.all_gather_into_tensor)(self.out, self.x, group=g)
        elif self.op == "reduce_scatter":
            (getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor)(self.out, self.x, op=self._op,
                                                                                  group=g)
        elif self.op == "broadcast":
            d.broadcast(self.x, src=self.root, group=g)
        elif self.op == "reduce":
            d.reduce(self.x, dst=self.root, op=self._op, group=g)
        elif self.op == "gather":
            d.gather(self.x, self.blocks, dst=self.root, group=g)
        elif self.op == "scatter":
            d.scatter(self.out, self.blocks, src=self.root, group=g)
        elif self.op == "alltoall":
            d.all_to_all_single(self.out, self.x, group=g)
        else:
            nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            for w in d.batch_isend_irecv([d.P2POp(d.isend, self.x, nxt, g), d.P2POp(d.irecv, self.out, prv, g)]):
                w.wait()

    def wrong(self) -> int:
        """Elements of the output that differ from the expected values (NaN never equals),
        compared a chunk at a time in float (exact for every benchmarked dtype's values)."""
        import torch
        out, bad = self.out, 0
        for lo in range(0, out.numel(), CHUNK):
            k = torch.arange(lo, min(out.numel(), lo + CHUNK))
            bad += int(torch.count_nonzero(out[lo:lo + CHUNK].float() != self.want(k).float()))
        return bad

    def reset(self) -> None:
        """Keep the values of calls that reduce into their input bounded while timing."""
        if self.op in ("allreduce", "reduce") or self.op == "reduce_scatter" and self.in_place:
            self.x.zero_()


def _lnc() -> int | None:
    """The logical-core setting the ranks run with (NEURON_LOGICAL_NC_CONFIG, as the backend
    places them), else None: the instance's default."""
    v = (os.environ.get("NEURON_LOGICAL_NC_CONFIG") or "").strip()
    return int(v) if v.isdigit() else None


def job_nodes(n: int) -> int | None:
    """How many nodes the `n` ranks of this job span, as the model column places them: a
    launcher's LOCAL_WORLD_SIZE (or Open MPI's local size) ranks per node, else one node (the
    ranks bench spawns). The column placed every job on one node: under a multi-node launcher it
    modelled a placement the job did not have, and more ranks than one node's cores were
    refused. None where the nodes hold unequal numbers of ranks (srun -n100 with 64 a node):
    the model places equal nodes, so the column is left out rather than the job refused."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or ""
    ppn = int(local) if local.isdigit() and int(local) > 0 else n
    return n // ppn if n % ppn == 0 else None


def model_busbw(op: str, nbytes: int, n: int, instance: str, nodes: int = 1,
                cores_per_rank: int = 1) -> tuple[str, float] | None:
    """(algorithm, busbw GB/s) the topology's cost model predicts, or None if not modelled or
    predicted to take no time (one rank moves nothing: no bandwidth to divide by). The algorithm
    is the one the backend runs under its model policy: among those it has builders for, or the
    one NEURON_DIST_ALGO forces (read now, as the backend reads it at each call). The `n` ranks
    sit `n // nodes` to a node (job_nodes: the launcher's layout), each on `cores_per_rank`
    consecutive cores (`--cores-per-rank`, as neuronrun places them)."""
    if op == "sendrecv" or nodes is None:
        return None
    try:
        from .topology import estimate, place
        from .topology.select import ENV_ALGO, backend_choose, backend_forced
        topo = place(instance, nodes, n // nodes, lnc=_lnc(), cores_per_rank=cores_per_rank)
        algo = backend_choose(op, nbytes, topo, backend_forced(os.environ.get(ENV_ALGO)))
        t = estimate(op, algo, nbytes, topo)
    except (ImportError, ValueError, KeyError):  # instance or collective not modelled
        return None
    return (algo, nbytes / t / 1e9 * BUS[op](n)) if t > 0 else None


def _num(v: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


def _time(case: Case, iters: int, warmup: int, meta, dist, torch, loop: bool = False,
          added: bool = False) -> float:
    """The row's time (see the module's docstring), with Python's cyclic collector paused: a
    collection in one rank (100-200 ms at a sweep's first rows) stalls every peer inside a timed
    call, which nccl-tests' C loop never sees; both backends are timed so."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _timed(case, iters, warmup, meta, dist, torch, loop, added)
    finally:
        if was:
            gc.enable()


def _timed(case: Case, iters: int, warmup: int, meta, dist, torch, loop: bool, added: bool) -> float:
    for _ in range(warmup):
        case.run()
    if added:  # wall time a call adds to a barrier: (call + barrier) - barrier, paired per iteration
        diffs = []
        for _ in range(iters):
            dist.barrier(group=meta)
            t0 = time.perf_counter()
            dist.barrier(group=meta)
            t1 = time.perf_counter()
            case.run()
            dist.barrier(group=meta)  # work a call left running (a backend's threads) is counted here
            diffs.append((time.perf_counter() - t1) - (t1 - t0))
        # the mean over ranks: a rank that leaves the first barrier early counts its lead twice
        # (a shorter barrier, a longer call), so the maximum would be biased by the skew
        t = torch.tensor(diffs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=meta)
        med = statistics.median(t.tolist()) / dist.get_world_size(meta)
        # at or below zero the call costs less than the barrier's own jitter: no time to report
        # (a clamp to a tiny positive number would print an absurd bandwidth)
        return med if med > 0 else float("nan")
    if loop:  # one barrier, back-to-back calls, the slowest rank's average
        dist.barrier(group=meta)
        t0 = time.perf_counter()
        for _ in range(iters):
            case.run()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=meta)
        return t.item()
    ts = []
    for _ in range(iters):
        dist.barrier(group=meta)
        t0 = time.perf_counter()
        case.run()
        ts.append(time.perf_counter() - t0)
    t = torch.tensor(ts, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=meta)  # the slowest rank's time per iteration
    return statistics.median(t.tolist())


def _measure(case: Case, a, meta, pg, dist, torch) -> dict:
    """One form of one row on one backend: a checked call (the algorithm its flight record names,
    None for Gloo's calls and send/recv), the timed ones, then, untimed, the data written afresh
    and a second checked call, as nccl-tests checks after its timed loop (BenchTime): a fault
    that shows only once a form is reused (plans.py keeps state per form) passed a check of the
    first call alone. `wrong` is the worse of the two checks, each summed over the ranks.
    time_us, algbw and busbw are None where --added resolved no time ("-" in the table)."""
    before = last_record(pg)
    case.run()
    ran = ran_algorithm(pg, before) if case.g is None else None
    first = torch.tensor([case.wrong()], dtype=torch.int64)
    dist.all_reduce(first, group=meta)
    case.reset()
    t = _time(case, a.iters, a.warmup, meta, dist, torch, a.loop, a.added)
    case.fill()
    case.run()
    last = torch.tensor([case.wrong()], dtype=torch.int64)
    dist.all_reduce(last, group=meta)
    bad = max(int(first), int(last))
    if math.isnan(t):
        out = dict(time_us=None, algbw=None, busbw=None, wrong=bad)
    else:
        algbw = case.size / t / 1e9
        out = dict(time_us=t * 1e6, algbw=algbw, busbw=algbw * BUS[case.op](case.n), wrong=bad)
    if case.g is None:
        out["algorithm"] = ran
    return out


def worker(a) -> int:
    import torch
    import torch.distributed as dist
    from . import c10d  # noqa: F401  registers "neuron"
    torch.set_num_threads(a.threads)
    os.environ.update(a.rank_vars)  # in the rank only: check() may run in a test's own process
    dist.init_process_group("neuron")
    rank, n = dist.get_rank(), dist.get_world_size()
    nodes = job_nodes(n)  # as the launcher laid the ranks out (the model column)
    meta = dist.new_group(backend="gloo")
    gloo = dist.new_group(backend="gloo") if a.vs == "gloo" else None
    dtype = getattr(torch, a.dtype)
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    pg = dist.group.WORLD
    transport = getattr(getattr(pg, "group", None), "transport", None)
    say(f"# neuron_dist.bench: world {n} dtype {a.dtype} redop {a.redop} root {a.root} iters {a.iters} warmup {a.warmup} "
        f"time {'loop-avg' if a.loop else 'added' if a.added else 'median'} "
        f"threads/rank {a.threads} thp {'on' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else 'off'} "
        f"cpus {os.cpu_count()} host {platform.node()} transport "
        f"{getattr(transport, 'name', '?')} torch {torch.__version__}"
        + ("" if not a.instance else f" | model: {a.instance}, {nodes} node(s) of {n // nodes} ranks, "
           + (f"{a.cores_per_rank} cores per rank" if a.cores_per_rank > 1 else "one per core")
           if nodes else " | model: left out (the launcher's nodes hold unequal numbers of ranks)"))
    rows, sizes = [], sweep(a.min_bytes, a.max_bytes, a.factor)
    es = torch.empty(0, dtype=dtype).element_size()
    ops = expand_ops(a.ops)
    if n == 1 and "sendrecv" in ops:  # no peer: its row timed a local copy, for both backends alike
        ops.remove("sendrecv")
        say("# sendrecv: left out at world 1 (no peer to send to: no backend would be measured)")
    for op in [o for o in ops if not forms(o, a.place)]:
        ops.remove(op)
        say(f"# {op}: left out under --place in (no in-place form)")
    plan = [(op, distinct_sizes(op, sizes, es, n)) for op in ops]
    total, done, t_start, t_said = sum(len(s) for _, s in plan), 0, time.time(), time.time()
    group = f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    units = f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
    for op, op_sizes in plan:
        label = f"#{'':>11} {'':>11} {'':>8} {'out-of-place':^33} {'in-place':^33}"
        head = f"#{'size':>11} {'count':>11} {'type':>8}" + group * 2
        unit = f"#{'(B)':>11} {'(elements)':>11} {'':>8}" + units * 2
        if gloo is not None:  # Gloo runs the row's main form, which the header names (it read "gloo: out,
            # else in place" whatever ran: under --place in, Gloo's all-gather ran in place)
            label += f" {'gloo: ' + ('in place' if forms(op, a.place)[0] else 'out of place'):^25}"
            head += f" {'gloo us':>9} {'gloo bw':>7} {'ratio':>6}"
            unit += f" {'':>9} {'(GB/s)':>7} {'':>6}"
        head += f" {'ran':>6}"
        unit += f" {'':>6}"
        if a.instance:
            head += f" {'model':>7} {'algo':>6}"
            unit += f" {'(GB/s)':>7} {'':>6}"
        say(f"# {op}")
        say(label)
        say(head)
        say(unit)
        for nbytes in op_sizes:
            main, *more = forms(op, a.place)
            row = {"op": op, "world": n, "type": a.dtype, "place": "in" if main else "out"}
            runs = [(row, "neuron", None, main), (row, "gloo", gloo, main)]
            if more:  # the in-place form beside the main one: neuron's alone (the ratio compares the main form)
                row["in_place"] = {}
                runs.append((row["in_place"], "neuron", None, True))
            for into, name, g, in_place in runs:
                if name == "gloo" and g is None:
                    continue
                case = None  # the previous call's buffers go before this one's are made
                case = Case(op, nbytes, dtype, rank, n, g, a.redop, a.root, in_place)
                row.update(size=case.size, count=case.count)
                into[name] = _measure(case, a, meta, pg, dist, torch)
            r = row["neuron"]
            out_of_place, in_place = (None, r) if main else (r, row.get("in_place", {}).get("neuron"))
            line = f"{row['size']:>12} {row['count']:>11} {a.dtype:>8}"
            for f in (out_of_place, in_place):
                line += (f" {_num(f['time_us'], 9, 1)} {_num(f['algbw'], 7, 3)} {_num(f['busbw'], 7, 3)} "
                         f"{f['wrong']:>6}") if f else f" {'-':>9} {'-':>7} {'-':>7} {'-':>6}"
            if gloo is not None:
                gr = row["gloo"]
                row["ratio"] = r["busbw"] / gr["busbw"] if r["busbw"] and gr["busbw"] else None
                line += f" {_num(gr['time_us'], 9, 1)} {_num(gr['busbw'], 7, 3)} {_num(row['ratio'], 6, 2)}"
            line += f" {r['algorithm'] or '-':>6}"
            if a.instance:
                m = model_busbw(op, row["size"], n, a.instance, nodes, a.cores_per_rank)
                row["model"] = None if m is None else {"algorithm": m[0], "busbw": m[1]}
                line += f" {m[1]:>7.1f} {m[0]:>6}" if m else f" {'-':>7} {'-':>6}"
            say(line)
            rows.append(row)
            done += 1
            if rank == 0 and a.progress and time.time() - t_said > 10:  # long sweeps only
                el, t_said = time.time() - t_start, time.time()
                print(f"[bench] {done}/{total} rows, {el:.0f}s elapsed, ~{el / done * (total - done):.0f}s left",
                      file=sys.stderr, flush=True)
    nwrong, gwrong = count_wrong(rows)
    say(f"# Out of bounds values : {nwrong} {'OK' if nwrong == 0 else 'FAILED'}")
    if gwrong:  # the table's #wrong is neuron's, so the reference's gets a line of its own
        say(f"# Gloo reference values wrong : {gwrong} FAILED (the --vs gloo rows; not counted above)")
    measured = [r["neuron"] for r in rows] + [r["in_place"]["neuron"] for r in rows if r.get("in_place")]
    timed = [m["busbw"] for m in measured if m["busbw"] is not None]  # both forms, as nccl-tests averages
    if timed:
        say(f"# Avg bus bandwidth    : {statistics.mean(timed):.4f}")
    if len(timed) < len(measured) or any(r.get("gloo", {}).get("busbw", 0) is None for r in rows):
        say("# -: the call cost less than the barrier's jitter (median difference <= 0); use more iterations")
    if rank == 0 and a.json:
        # world: the ranks that ran (under a launcher -g is ignored, and vars(a) holds its default)
        # port: the rendezvous port the ranks met on (a launcher's MASTER_PORT, or the spawned job's)
        meta_info = dict(vars(a), world=n, port=int(os.environ.get("MASTER_PORT", 0)) or None,
                         host=platform.node(), cpus=os.cpu_count(), python=sys.version.split()[0], torch=torch.__version__,
                         transport=getattr(transport, "name", "?"), env=run_env())
        with open(a.json, "w") as f:
            json.dump({"config": meta_info, "rows": rows}, f, indent=1)
    dist.barrier(group=meta)
    dist.destroy_process_group()
    return 1 if nwrong or gwrong else 0


def count_wrong(rows: list[dict]) -> tuple[int, int]:
    """Wrong elements of the backend under test (the table's #wrong columns, both forms, summed)
    and of the Gloo reference (`--vs gloo`), apart: the summary line counts what the table shows."""
    return (sum(r["neuron"]["wrong"] + ((r.get("in_place") or {}).get("neuron") or {}).get("wrong", 0) for r in rows),
            sum(r.get("gloo", {}).get("wrong", 0) for r in rows))


def _spawned(rank: int, a, port: int, q, launcher: int) -> None:
    die_with_launcher(launcher)
    ignore_interrupt()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(a.world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(a.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    put_and_exit(q, (rank, worker(a)))


def put_and_exit(q, item) -> None:
    """Hand a spawned rank's result to its parent through `q`, then end the process without the
    interpreter's finalization: its full garbage collections over torch's objects take seconds
    per rank on a small host, and the parent waits for them. The exit hooks still run."""
    q.put(item)
    q.close()
    q.join_thread()  # the item has left the queue's feeder thread
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_context(preload: tuple[str, ...] = ()):
    """The multiprocessing context that starts the ranks of this benchmark and bench_train: a
    fork server that imported torch, the backend and `preload` once, so that a rank starts in a
    fraction of a second instead of importing them again (seconds per process on a small host,
    and bench_train starts a pair per row). Spawn where the platform has no fork server. The fork
    server imports neuron_dist.forkserver_exit last: it ends without finalizing all that, so that
    the ranks, which die with it (die_with_launcher), end within a second of their tool."""
    import multiprocessing as mp
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "neuron_dist", *preload, "neuron_dist.forkserver_exit"])
    return ctx


def rendezvous_port(port: int | None) -> int:
    """The port the ranks this command spawns meet on: --port, else $MASTER_PORT, else a free
    one (ports.free_port). MASTER_PORT was ignored: every run drew a random port, whatever port
    the job script or CI slot had set aside for it (collbench's --port has the same default)."""
    if port:
        return port
    return int(os.environ.get("MASTER_PORT") or 0) or free_port()


def check_port(p: argparse.ArgumentParser, port: int | None) -> None:
    """--port, or the MASTER_PORT it defaults to, is a port number: a usage error now, not a
    ValueError in the launching process or a failed rendezvous in every rank. Under a launcher
    MASTER_PORT is the launcher's, torch reads it, and bench does not call this."""
    raw = str(port) if port is not None else os.environ.get("MASTER_PORT") or ""
    if raw and not (raw.isdigit() and 1 <= int(raw) <= 65535):
        p.error(f"{'--port' if port is not None else 'MASTER_PORT'} {raw!r} is not a port number (1-65535)")


@contextlib.contextmanager
def ranks_follow_signals(prog: str):
    """While the ranks this process spawned run, SIGTERM or SIGINT to it stops them too: it used
    to die alone (SIGTERM) or beside them (Ctrl-C, a KeyboardInterrupt traceback from every
    process), and ranks it left behind finished the whole sweep unseen, their queue's semaphores
    left in /dev/shm. The handler terminates and joins every live child, says so on one line, and
    exits 128 + the signal's number, as a shell reports a process that signal ended (the exit
    runs the multiprocessing finalizers that unlink the semaphores). The ranks ignore SIGINT
    (`ignore_interrupt`), so Ctrl-C reaches them only through here. Under a launcher there is no
    such parent: torchrun and neuronrun forward the signal to the ranks themselves."""
    import multiprocessing as mp
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def stop(signum, frame):
        ranks = mp.active_children()
        # every rank stopped before any is ended, and each resumed only to take its SIGTERM
        # (pending while it is stopped): ended one by one, a rank could see its peer end first
        # (a same-host peer's end is seen in milliseconds), fail its collective and print the
        # error's traceback before its own SIGTERM came (a CI run under load)
        for how in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            for c in ranks:
                try:
                    os.kill(c.pid, how)
                except ProcessLookupError:  # (ended by itself meanwhile)
                    pass
        for c in ranks:
            c.join(10)
            if c.is_alive():  # stuck in a call that ignores SIGTERM
                c.kill()
                c.join()
        print(f"{prog}: stopped by {signal.Signals(signum).name}"
              + (f", and so were its {len(ranks)} rank processes" if ranks else ""), file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    sigs = (signal.SIGTERM, signal.SIGINT)
    old = {s: signal.signal(s, stop) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def ignore_interrupt() -> None:
    """In a spawned rank: Ctrl-C signals the whole process group, and the parent then stops the
    ranks (ranks_follow_signals); each rank printed a KeyboardInterrupt traceback of its own.
    SIGTERM stays at its default, which the shared-memory transport's set-up watches for."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _parent_of(pid: int) -> int | None:
    """The parent pid of process `pid` (/proc/PID/stat's fourth field), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def die_with_launcher(launcher: int) -> None:
    """In a rank that bench or bench_train spawned: die when the tool that spawned it (pid
    `launcher`) dies, even by SIGKILL, which no handler sees (ranks_follow_signals): such ranks
    ran the rest of the sweep on, unseen. As neuronrun's ranks do (launcher/neuronrun_launcher/
    worker.py), the rank asks Linux for SIGKILL when its parent exits (PR_SET_PDEATHSIG). Its
    parent is the fork server (rank_context), which ends when its last client has; every rank
    held a copy of the fork server's "alive" pipe, keeping it up, so the rank closes its copy:
    the tool is then the last client, the fork server ends with it, and the ranks with the fork
    server. The race: a parent, or the tool above the fork server, that died before prctl took
    effect leaves this rank with another parent or grandparent, and it exits at once. Linux
    only; elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)  # set in a fork server's child only
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None
    parent = os.getppid()
    if launcher not in (parent, _parent_of(parent)):  # (a spawned rank: its parent; a fork server's: above it)
        os._exit(1)


def launch(a) -> int:
    port = a.port = rendezvous_port(a.port)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, a, port, q, os.getpid())) for r in range(a.world)]
    with ranks_follow_signals("neuron_dist.bench"):
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    codes = [p.exitcode for p in procs]
    status = 0
    while not q.empty():
        status |= q.get()[1]
    return status or next((c for c in codes if c), 0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neuron_dist.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-g", "--world", type=int, default=2, help="ranks to spawn (ignored under a launcher)")
    p.add_argument("--ops", type=lambda s: [o.strip() for o in s.split(",")], default=["allreduce"],
                   help=f"comma-separated among {', '.join(OPS)}, or all (default allreduce)")
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--factor", type=int, default=4, help="size multiplier between rows (default 4)")
    p.add_argument("-d", "--dtype", choices=DTYPES, default="float32")
    p.add_argument("-o", "--redop", choices=REDOPS, default="sum",
                   help="reduction of all-reduce, reduce-scatter and reduce (default sum; avg: float types, "
                        "not --vs gloo)")
    p.add_argument("-r", "--root", type=int, default=0,
                   help="root rank of broadcast, reduce, gather and scatter (default 0)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--place", choices=PLACES, default="both",
                   help="the forms timed, nccl-tests' two column groups: both (default; it doubles the timed "
                        "calls of all-gather, reduce-scatter, gather and scatter only), out (out of place only, "
                        "where the call has that form), in (in place only; all-to-all and send/recv are left out)")
    p.add_argument("--loop", action="store_true",
                   help="one barrier, then back-to-back iterations averaged (nccl-tests style)")
    p.add_argument("--added", action="store_true",
                   help="time = wall time a call adds to a Gloo barrier (what it costs the job)")
    p.add_argument("--vs", choices=("gloo",), help="also run Gloo, same sizes, same processes; adds a ratio")
    p.add_argument("--instance", default=os.environ.get("NEURON_DIST_INSTANCE") or DEFAULT_INSTANCE,
                   help="instance the cost model predicts busbw for (default $NEURON_DIST_INSTANCE, "
                        "as the backend models, else trn2.48xlarge; '' to omit the column)")
    p.add_argument("--cores-per-rank", type=int, metavar="M",
                   help="logical cores each rank takes, as neuronrun's --cores-per-rank: the ranks it "
                        "spawns are placed so, and the model column places them so (default "
                        "$NEURON_RT_NUM_CORES, which neuronrun sets, else 1)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--thp", choices=("off", "on"), default="off",
                   help="on: torch's huge pages for every rank's tensors, as neuronrun runs jobs "
                        "(THP_MEM_ALLOC_ENABLE=1; Gloo's rows too); off (default): as set in the environment")
    p.add_argument("--port", type=int, help="rendezvous port of the ranks it spawns (default $MASTER_PORT, "
                                            "else a free one; under a launcher, the launcher's)")
    p.add_argument("--json", metavar="FILE", help="write the configuration and every row to FILE")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress lines on stderr")
    return p


def check_json_path(p: argparse.ArgumentParser, path: str | None) -> None:
    """--json FILE is written after the whole run: a path that cannot be written is a usage
    error now, not a traceback then (bench and bench_train). Writability is tried by opening the
    file to append (a file this creates is removed again): permission bits say nothing for root,
    and a directory such as /proc passes them yet refuses new files. Under a launcher only rank 0,
    which writes the file, looks: the ranks' checks raced on it (two could create and remove it
    together, one then failing, or leave an empty file)."""
    if path and os.environ.get("RANK", "0") == "0":
        d = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(d):
            p.error(f"--json {path}: directory {d} does not exist")
        if os.path.isdir(path):
            p.error(f"--json {path} is a directory")
        existed = os.path.lexists(path)
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            p.error(f"--json {path} cannot be written: {e.strerror}")
        if not existed:
            os.remove(path)


def settings_error(world: int) -> str | None:
    """What every rank of a `world`-rank job on the "neuron" backend would raise while it builds
    its group, from the settings each rank reads alone, else None. Each rank's set-up error
    reached the user as a traceback from every rank (65 ranks: 2,456 lines): NEURON_DIST_TUNING,
    _ALGO, _FRAME_BYTES, _SCRATCH_BYTES, _TRANSPORT and the shared-memory settings, read by the
    group's own validators, and NEURON_DIST_TRANSPORT=mpi in a job mpirun did not start (the
    transports' own plan, for one of the ranks of this host). The launching process calls it once
    and makes the answer a usage error (bench, bench_train)."""
    from .collectives import select as algorithm_select
    from .collectives.scratch import scratch_bytes_setting
    from .transport import select as transport_select
    from .transport.base import TransportContext, TransportError
    from .transport.frame import frame_bytes_setting
    try:
        frame_bytes_setting()
        scratch_bytes_setting()
        forced = transport_select.settings()
        algorithm_select.check_settings()
        transport_select.plan(TransportContext(rank=0, size=world, store=None, token=0, timeout=None,
                                               hostname="", bind_addr=""), forced)
    except (ValueError, TransportError) as e:
        return str(e)
    return None


def placement_error(world: int, env=None) -> str | None:
    """Why the `world` ranks this command spawns on this host cannot place themselves as the
    backend does (the modelled instance, NEURON_LOGICAL_NC_CONFIG, NEURON_RT_*), else None: the
    last one is checked, on one node (bench, bench_train)."""
    from .topology import placement_from_env
    try:
        placement_from_env(os.environ if env is None else env, world - 1, world, world - 1, world)
    except ValueError as e:
        return str(e)
    return None


def check_neuron_job(p: argparse.ArgumentParser, world: int, world_flag: str | None, env=None) -> None:
    """A usage error (p.error) for what every neuron rank of a `world`-rank job would raise at
    init, each with a traceback of its own: the environment's settings (settings_error) and, for
    ranks the command spawns on this host (`world_flag`, the flag that sets their number; None
    under a launcher, whose ranks are placed by it), their placement (placement_error). bench
    and bench_train both call it."""
    why = settings_error(world)
    if why:
        p.error(why)
    if world_flag is not None:
        why = placement_error(world, env)
        if why:
            p.error(f"{world_flag} {world}: the ranks cannot place themselves: {why}")


def check(p: argparse.ArgumentParser, a) -> None:
    """Reject, before any rank starts, what the sweep would spin on (a size that never passes -e),
    fail on late (a --json directory that does not exist, written after the whole sweep) or turn
    into a silent '-' column (an --instance the cost model does not know, or too small for the
    ranks). p.error exits 2 with the usage, as argparse's own errors do."""
    bad = [o for o in a.ops if o not in OPS + ("all",)]
    if bad:
        p.error(f"unknown ops {bad}; known: {', '.join(OPS)}, all")
    if a.min_bytes < 1:
        p.error("-b/--min-bytes must be at least 1 byte")
    if a.max_bytes < a.min_bytes:
        p.error("-e/--max-bytes must be at least -b/--min-bytes")
    if a.factor < 2 and a.max_bytes != a.min_bytes:
        p.error("-f/--factor must be at least 2 (unless -b equals -e: one size)")
    for flag, value, least in (("-g/--world", a.world, 1), ("-n/--iters", a.iters, 1),
                               ("-w/--warmup", a.warmup, 0), ("--threads", a.threads, 1)):
        if value < least:
            p.error(f"{flag} must be at least {least}, not {value}")
    if a.loop and a.added:
        p.error("--loop and --added are two ways of timing: choose one")
    check_json_path(p, a.json)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else a.world
    if not 0 <= a.root < world:
        p.error(f"-r/--root {a.root}: a rank of the {world}-rank job (0-{world - 1})")
    if a.redop == "avg" and a.dtype.startswith("int"):
        p.error(f"-o avg with -d {a.dtype}: an integer average is not exact (take a float type)")
    if a.redop == "avg" and a.vs == "gloo":
        p.error("-o avg with --vs gloo: Gloo has no AVG reduction")
    if set(expand_ops(a.ops)) & set(REDUCING):
        import torch
        why = inexact_reduction(a.redop, world, getattr(torch, a.dtype))
        if why:
            p.error(why)
    from .topology import get_instance, place
    from .topology.__main__ import cores_per_rank
    modelled = os.environ.get("NEURON_DIST_INSTANCE") or DEFAULT_INSTANCE
    # the ranks model what the column prices, so `ran` is `algo`'s (worker exports it in each rank)
    if a.instance and a.instance != modelled and launched and os.environ.get("NEURON_DIST_INSTANCE"):
        p.error(f"--instance {a.instance}: the launcher's ranks model {modelled} (NEURON_DIST_INSTANCE; "
                f"neuronrun --instance sets it)")
    # what each rank sets in its own environment as it starts (worker): the instance the column
    # prices, and the cores bench places its spawned ranks on; the caller's stays as it was
    a.rank_vars = {"NEURON_DIST_INSTANCE": a.instance} if a.instance else {}
    if a.cores_per_rank is not None:
        placed = (os.environ.get("NEURON_RT_NUM_CORES") or "1").strip()
        if launched and placed != str(a.cores_per_rank):  # (the launcher placed the ranks, not bench)
            p.error(f"--cores-per-rank {a.cores_per_rank}: the launcher placed these ranks on {placed} cores each "
                    f"(NEURON_RT_NUM_CORES; neuronrun --cores-per-rank sets it)")
        if not launched:  # the ranks it spawns take them, as neuronrun's would: checked as neuronrun checks
            try:
                inst = get_instance(a.instance or modelled)
                cores_per_rank(a.cores_per_rank, None, inst, inst.check_lnc(_lnc()))
            except ValueError as e:
                p.error(str(e))
            a.rank_vars["NEURON_RT_NUM_CORES"] = str(a.cores_per_rank)
    rank_env = dict(os.environ, **a.rank_vars)
    if not launched:
        check_port(p, a.port)
    check_neuron_job(p, world, None if launched else "-g/--world", rank_env)
    m = a.cores_per_rank  # what the ranks take, for the JSON's config, with or without a model column
    placed = (rank_env.get("NEURON_RT_NUM_CORES") or "1").strip()
    a.cores_per_rank = m if m is not None else int(placed) if placed.isdigit() else 1
    if a.instance:  # the check `python -m neuron_dist.topology predict` makes: known, and big enough
        try:
            inst = get_instance(a.instance)
            lnc = inst.check_lnc(_lnc())
        except ValueError as e:
            p.error(f"--instance: {e} ('' omits the model column)")
        try:  # (its errors name --cores-per-rank or NEURON_RT_NUM_CORES)
            a.cores_per_rank = cores_per_rank(m, rank_env.get("NEURON_RT_NUM_CORES"), inst, lnc)
        except ValueError as e:
            p.error(str(e))
        try:
            nodes = job_nodes(world) if launched else 1
            if nodes:  # (unequal nodes: no column, nothing to refuse)
                place(a.instance, nodes, world // nodes, lnc=_lnc(), cores_per_rank=a.cores_per_rank)
        except ValueError as e:
            p.error(f"--instance: {e} ('' omits the model column)")


def _with_thp(p, argv) -> None:
    """`--thp on`: restart with THP_MEM_ALLOC_ENABLE=1 unless it is set (torch reads it when a
    process first allocates, and the ranks come from a fork server that imported torch). Ranks
    a launcher started must have it already (neuronrun sets it by default)."""
    from neuronrun_launcher.thp import THP_VAR, rank_vars
    if os.environ.get(THP_VAR, "1") != "1":
        p.error(f"--thp on: {THP_VAR}={os.environ[THP_VAR]!r} is set in the environment (torch takes \"1\" only)")
    wanted = rank_vars(True, os.environ)
    if not wanted:
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        p.error(f"--thp on: the launcher started these ranks without {THP_VAR}=1 (neuronrun --thp on sets it)")
    if argv is not None:
        p.error(f"--thp on: set {THP_VAR}=1 in the environment first (only the command line restarts itself with it)")
    os.execve(sys.executable, [sys.executable, "-m", "neuron_dist.bench", *sys.argv[1:]], {**os.environ, **wanted})


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    check(p, a)
    if a.thp == "on":
        _with_thp(p, argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(a)
    return launch(a)


if __name__ == "__main__":
    sys.exit(main())
