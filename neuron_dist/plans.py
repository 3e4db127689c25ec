"""Collective plans: what a collective call needs besides its buffers, made once per form.

For a given group, a collective's description, reducer, frame checksum and schedule depend only
on its argument set (collective, algorithm, dtype, reduce op, sizes, root), so they are made on
the first call of that form and kept (`Plans`): schedules are immutable data. The c10d adapter
checks and flattens a call's arguments and picks its algorithm, asks here for the plan, and, as
the op starts, for the plan's Execution on the call's buffers (`Plan.execution`). The schedule
is built then, not when the call is checked, so a set-up error surfaces from wait(). Point-to-
point messages are planned in `p2p.py`.
"""
from __future__ import annotations

import torch

from . import debug
from .collectives import algorithms, reduce_ops
from .collectives.algorithms import Spec, build
from .collectives.executor import Execution
from .collectives.schedule import Schedule
from .group import Group, _dtype_name, coll_log
from .op import Op
from .transport.frame import Kind

PLAN_CACHE = 1024  # argument sets remembered per process group (cleared when full)
KEEP_SCRATCH = 64 << 10  # scratch buffers up to this size may be kept with their plan (larger: Group.scratch)
_REDUCING = (Kind.ALLREDUCE, Kind.REDUCE, Kind.REDUCE_SCATTER)  # kinds whose description names the op


def keep(cache: dict, key, value):
    """Store `value` under `key` in a cache (p2p.py's) and return it. A cache holds at most
    PLAN_CACHE entries and starts again when full: a program that calls ever new forms (sizes
    that change every step) must not grow it for good, and a plan is cheap to make again."""
    if len(cache) >= PLAN_CACHE:
        cache.clear()
    cache[key] = value
    return value


class Plan:
    """One argument set's description, reducer and frame checksum, with the schedule once
    built and the small scratch buffer kept for it."""
    __slots__ = ("group", "desc", "reduce", "collective", "algo", "spec_args", "dtype", "tag", "_sched", "_tmp",
                 "tmp_views", "_builder", "own_block_out")

    def __init__(self, group: Group, desc, reduce, collective, algo, spec_args, dtype, tag):
        self.group, self.desc, self.reduce, self.collective, self.algo = group, desc, reduce, collective, algo
        self.spec_args, self.dtype, self._sched, self._tmp = spec_args, dtype, None, None
        # the builder registered as the call was made (None: none, an error once built), and
        # whether it keeps OWN_BLOCK_OUT's promise (an in-place call stages where it does not,
        # c10d._run_plan), read together: an op queued before a `register` runs what its call saw
        self._builder, self.own_block_out = algorithms.registered(collective, algo)
        self.tmp_views = None  # the executor's views of the kept scratch buffer, kept (and freed) with it
        self.tag = tag  # the frames' argument checksum (debug.call_tag of kind, desc and algorithm)

    def execution(self, op: Op, src: torch.Tensor | None, out: torch.Tensor | None) -> Execution:
        """The op's Execution of this plan on flat buffers SRC/OUT (run as the op starts). The
        schedule is built on first use. Its TMP buffer, if it has one: a small one is kept for
        the next call of this form, with the views the executor cuts from it (a group runs one
        collective at a time, so no two executions of a plan overlap); a larger one is the
        group's shared scratch (collectives/scratch.py)."""
        g, dtype = self.group, self.dtype
        sched = self._sched
        if sched is None:
            sched = self._sched = self._build()
        tmp = views = None
        if sched.tmp_count:
            tmp = self._tmp
            if tmp is None:
                nbytes = sched.tmp_count * dtype.itemsize
                if g.scratch.holds(src, out):  # staged there as the op started (c10d.scatter, gather):
                    tmp = torch.empty(sched.tmp_count, dtype=dtype)  # a builder of one's own with a TMP
                elif nbytes > KEEP_SCRATCH or not g.scratch.keep_small(nbytes):
                    tmp = g.scratch.take(sched.tmp_count, dtype)
                else:
                    tmp = self._tmp = torch.empty(sched.tmp_count, dtype=dtype)
                    self.tmp_views = {}
            if tmp is self._tmp:
                views = self.tmp_views
        return g.execution(op, sched, [src, out, tmp], self.reduce, dtype, self.tag, views)

    def _build(self) -> Schedule:
        g = self.group
        spec = Spec(self.collective, g.rank, g.size, order=tuple(g.order), topo=g.topology,
                    eager_count=g.frame_bytes // self.dtype.itemsize, **self.spec_args)
        return build(spec, self.algo, self._builder)


class Plans:
    """A process group's collective plans, one per argument set (`by_args`), and the common
    paths' (`common`: plans `get` made, under the adapter's own keys). What they keep is bounded:
    at most PLAN_CACHE plans and one (when either cache is full both start again, so the plans
    of `common` are those of `by_args` but for the one kept as it started again; counted apart,
    the two kept twice PLAN_CACHE), whose small scratch is within the group's budget for it
    (Scratch.keep_small) and whose frame plans are short (executor.MAX_KEPT_FRAMES)."""

    def __init__(self, group: Group):
        self.group = group
        self.by_args: dict[tuple, Plan] = {}
        self._common: dict[tuple, Plan] = {}  # the c10d adapter's common paths' plans, by their own keys
        self.generation = algorithms.GENERATION  # the plans' builders' (algorithms.register)

    def _renew(self) -> None:
        """Both caches made afresh (a builder was registered since their plans were made, or one
        is full): the plans' small scratch goes with them."""
        self.by_args, self._common, self.generation = {}, {}, algorithms.GENERATION
        self.group.scratch.forget_small()

    def keep_common(self, key, plan: Plan) -> Plan:
        """Keep `plan` (one `get` made) for a common path under `key`."""
        if len(self._common) >= PLAN_CACHE:
            self._renew()
        self._common[key] = plan
        return plan

    def common(self) -> dict[tuple, Plan]:
        """The common paths' cache (c10d's _common_plan: plans whose checks passed, kept under
        what those checks depend on), current with the registered builders."""
        if self.generation != algorithms.GENERATION:
            self._renew()
        return self._common

    def get(self, collective: str, kind: Kind, algo: str, spec_args: dict, dtype: torch.dtype, op_name: str,
            nbytes: int, name: str | None = None, detail: str = "") -> Plan:
        """The plan of a call with these arguments. `name` replaces the collective's in the
        description; `detail` ends the description's arguments, and so enters the checksum its
        frames carry."""
        if self.generation != algorithms.GENERATION:
            self._renew()
        key = (collective, algo, dtype, op_name, nbytes, name, detail, *spec_args.items())
        plan = self.by_args.get(key)
        if plan is None:
            g, reduce = self.group, reduce_ops.reducer(op_name, dtype)
            desc = f"{name or collective}({nbytes} bytes, {_dtype_name(dtype)}" + \
                   (f", {op_name}" if kind in _REDUCING else "") + \
                   (f", root {spec_args['root']}" if "root" in spec_args else "") + \
                   (f", {detail}" if detail else "") + ")"
            if len(self.by_args) >= PLAN_CACHE:
                self._renew()
            plan = self.by_args[key] = Plan(g, desc, reduce, collective, algo, dict(spec_args), dtype,
                                            debug.call_tag(kind, desc, algo))
            coll_log.debug("rank %d group %s: %s runs as %s (first call of this form)", g.rank, g.name, desc, algo)
        return plan
