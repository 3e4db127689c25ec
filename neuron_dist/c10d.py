"""The c10d adapter: the only module that knows torch.distributed's calling conventions.

`NeuronProcessGroup` turns each of c10d's collective calls (options objects, lists of tensors,
Work handles) into one `Op` on the `Group`: arguments are checked here, before any byte moves;
inputs and outputs are flattened (non-contiguous tensors go through staging copies); what a
call of that form needs besides its buffers comes from its plan (`plans.py` for collectives,
`p2p.py` for sends and receives), whose schedule is built when the op starts (on the engine
thread, or on the caller's where the group runs the op at once: Group._run_inline), so a set-up
error surfaces from wait(). Every private torch name used by the package is imported in this
module alone (the launcher, a package of its own, keeps its own: `_parse_rendezvous_config` in
launch.py and the patch of `C10dRendezvousBackend._call_store` in storewatch.py).
"""
from __future__ import annotations

import functools
import operator
import os
import sys
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _AutoDispatchBelowADInplaceOrView as _BelowAutograd  # private: the data path's writes, as C++'s
from torch._C._distributed_c10d import ReduceOp as _ReduceOp  # private: the op enum + PREMUL factor
from torch._C._distributed_c10d import AllgatherOptions as _AllgatherOptions  # private: the type c10d passes

from .collectives import reduce_ops
from .collectives.executor import Execution
from .collectives.scratch import fresh
from .collectives.executor import overlaps as _overlap
from .collectives.select import choose as _choose_algorithm
from . import debug, sparse
from .errors import GroupError
from .group import Group, _dtype_name
from .op import Op, fresh_error
from .p2p import PeerPlans
from .plans import Plan, Plans
from .transport.frame import DTYPE_CODE, Kind

BACKEND = "neuron"

_OPS = {
    _ReduceOp.SUM: "sum", _ReduceOp.AVG: "avg", _ReduceOp.PRODUCT: "product", _ReduceOp.MIN: "min",
    _ReduceOp.MAX: "max", _ReduceOp.BAND: "band", _ReduceOp.BOR: "bor", _ReduceOp.BXOR: "bxor",
    _ReduceOp.PREMUL_SUM: "premul_sum",
}


# keyed by the enum's int value: hashing the pybind enum itself costs ~0.5 us per call
_OPS_BY_VALUE = {int(k): name for k, name in _OPS.items()}


_SUM = _ReduceOp.SUM
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # a Parameter's too; a DTensor's is its own
_AllreduceOptions = dist.AllreduceOptions
_BroadcastOptions = dist.BroadcastOptions
_ReduceScatterOptions = dist.ReduceScatterOptions
_AllToAllOptions = dist.AllToAllOptions


def _reduce_op(op) -> tuple[str, object]:
    """(name, premul factor or None) from a ReduceOp / RedOpType as c10d hands it over."""
    if op == _SUM:  # the usual op, by pybind's comparison (reading op.op.value costs 4x as much)
        return "sum", None
    kind = getattr(op, "op", op)
    name = _OPS_BY_VALUE.get(getattr(kind, "value", None))
    if name is None:
        raise ValueError(f"unsupported reduce op {op!r}")
    factor = None
    if name == "premul_sum":
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError("ReduceOp.PREMUL_SUM needs a factor: use dist._make_nccl_premul_sum(factor)")
    return name, factor


_C10D_PRIVATE = {"_allgather_base", "_reduce_scatter_base", "_source_rank"}  # c10d's own names


def _dynamo_hook_query():
    """A function giving the eval-frame callback Dynamo has set on the calling thread (None when
    nothing compiles there); where this torch has no such query, one that answers "set"."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback  # private
    except ImportError:
        return lambda: True
    return get_eval_frame_callback


def _eager_under_compile(cls):
    """Run the methods torch calls on `cls` (public ones and c10d's underscore names) eagerly
    under torch.compile. Gloo's methods are C++, so a compiled region that calls one (DDP's
    bucket broadcast, `dist.barrier()` in a compiled function) breaks its graph and calls it;
    ours are Python, and Dynamo would trace into them and fail on the ProcessGroup object
    ("UnsafeScriptObjectError"). Each method goes through torch._dynamo.disable, made on first
    need, but only while Dynamo's frame hook is set on the calling thread: a process that never
    imported Dynamo (importing it costs seconds) is not compiling, and one that did but runs
    eagerly (every DDP or fully_shard process: they import it) has no hook. Both call the method
    directly; the disable wrapper would only set the hook to None and back, for 10-20 us a call
    on a slow host."""
    for name, fn in list(vars(cls).items()):
        if not callable(fn) or isinstance(fn, type) or name.startswith("__") or \
                (name.startswith("_") and name not in _C10D_PRIVATE):
            continue

        def wrap(fn):
            eager = hook = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal eager, hook
                if "torch._dynamo" not in sys.modules:
                    return fn(*args, **kwargs)
                if eager is None:
                    eager, hook = torch._dynamo.disable(fn, recursive=True), _dynamo_hook_query()
                if hook() is None:
                    return fn(*args, **kwargs)
                return eager(*args, **kwargs)
            return call

        setattr(cls, name, wrap(fn))
    return cls


_COMPLETING = threading.local()  # .op: the op whose future this thread is completing (its callbacks may wait() on it)


@_eager_under_compile
class NeuronWork(dist.Work):
    """A handle on one Op: wait() blocks and raises the op's error; get_future() completes with
    the output tensors, or fails through a `.then` callback (a future's stored exception would
    reach DDP's reducer as a value and crash it). The future is made on the first get_future()
    (most callers only wait): completed at once if the op already finished, else when it does."""

    def __init__(self, op: Op, group: Group | None = None):
        super().__init__()
        self._op, self._group = op, group  # (the group names this rank in a wait's time-out)
        self._fut = None
        self._fut_done: threading.Event | None = None  # set once get_future()'s future and its callbacks are done

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the op is done and, where get_future() was called, its future completed
        and the future's `then` callbacks run, as Gloo's wait() returns (its future completes
        before the Work does): a wait() that returned first let `fut.value()` fail torch's
        INTERNAL ASSERT and a callback's writes land after the caller read the tensor."""
        if isinstance(timeout, timedelta):  # torch's binding takes a timedelta or float seconds
            secs = timeout.total_seconds()
        elif isinstance(timeout, float):
            secs = timeout
        else:
            raise TypeError(f"wait(): timeout must be a datetime.timedelta or float seconds, "
                            f"not {type(timeout).__name__}")
        op, done = self._op, self._fut_done
        if op.finished and op.error is None and (done is None or done.is_set()):
            return True
        g = self._group
        t0 = time.monotonic()
        try:
            op.wait(secs if secs > 0 else None, g.who(g.rank) if g is not None and secs > 0 else "")
        except Exception:  # noqa: BLE001 - the op's error, or this wait's time-out
            if done is not None and op.finished and getattr(_COMPLETING, "op", None) is not op:
                done.wait(1.0)  # its future fails first, as Gloo's (bounded: the error matters more)
            raise
        if done is not None and not done.is_set() and getattr(_COMPLETING, "op", None) is not op:
            left = max(secs - (time.monotonic() - t0), 0.001) if secs > 0 else None
            if not done.wait(left):  # (not from one of this future's own callbacks: they run before it is set)
                raise GroupError(f"[{g.who(g.rank) if g is not None else 'rank ?'}] {op.desc}: wait() timed out "
                                 f"after {secs:.1f}s; the operation is done, its future's callbacks still run")
        return True

    def is_completed(self) -> bool:
        done = self._fut_done
        if self._op.finished:
            return done is None or done.is_set()
        # a caller polling in a loop holds the GIL the engine thread needs, which then ran once
        # per switch interval (5 ms): a 16 MiB async all-reduce polled to completion took 60-190
        # ms against 6-8 ms waited for (Gloo's engine is C++). A yield, GIL released, lets it run
        os.sched_yield()
        return self._op.finished and (done is None or done.is_set())

    def is_success(self) -> bool:
        return self._op.error is None  # torch's Work::isSuccess: no error so far, finished or not

    def exception(self):
        return self._op.error

    def result(self):
        op = self._op
        if not op.finished:  # the outputs still hold what the caller passed in (Gloo raises too)
            raise RuntimeError(f"{op.desc}: Work needs to be completed before calling result() "
                               f"(call wait() first)")
        return op.outputs

    def synchronize(self) -> None:
        self._op.wait()

    def _source_rank(self) -> int:
        op = self._op
        if op.direction not in ("recv", "recv-any"):  # a send's peer is no source (Gloo raises too)
            raise RuntimeError(f"{op.desc}: sourceRank() may only be called on work objects that "
                               f"correspond to a recv or recv-from-any call")
        return op.source_rank

    source_rank = _source_rank  # the public (deprecated) name: torch's binding of it does not reach Python

    def get_future(self) -> torch.futures.Future:
        op = self._op
        fut = self._fut
        if fut is None:
            fut = self._fut = torch.futures.Future()
            done = self._fut_done = threading.Event()

            def complete(o: Op) -> None:  # (on a callback thread: `then` callbacks run inside set_result)
                outer, _COMPLETING.op = getattr(_COMPLETING, "op", None), o
                try:
                    fut.set_result(o.outputs)  # outputs is always a list: a future is never completed with None
                finally:
                    _COMPLETING.op = outer
                    done.set()
            op.add_done_callback(complete)

        def check(f):
            if op.error is not None:
                raise fresh_error(op.error)
            return f.value()

        return fut.then(check)


def _check_tensor(t, what: str, rank: int, written: bool = False) -> None:
    """Argument checks that fail on this rank before any byte moves; `written`: the call writes
    into `t`, so no two of its elements may share memory (an expand()ed view), which would
    otherwise fail only when the result is copied back, after the peers have sent."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"[rank {rank}] {what}: expected a torch.Tensor, got {type(t).__name__}")
    if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:  # Gloo: DTensor's NotImplementedError
        raise TypeError(f"[rank {rank}] {what}: a {type(t).__name__} is a tensor subclass with a dispatch of "
                        f"its own, not a plain tensor; pass the tensor it holds (a DTensor's .to_local())")
    if t.is_nested or t.layout not in (torch.strided, torch.sparse_coo):
        raise ValueError(f"[rank {rank}] {what}: {'nested' if t.is_nested else str(t.layout)} tensors are not "
                         f"supported (dense tensors, and sparse COO in all_reduce)")
    if not t.is_cpu:
        raise ValueError(f"[rank {rank}] {what}: tensor is on {t.device}; the neuron backend "
                         f"moves CPU tensors (register the group for 'cpu' or move the tensor)")
    if t.dtype not in DTYPE_CODE:
        raise ValueError(f"[rank {rank}] {what}: dtype {t.dtype} is not supported")
    if t.is_sparse:
        raise ValueError(f"[rank {rank}] {what}: sparse tensors are not supported here (all_reduce takes "
                         f"one, with SUM)")
    if written and not t.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise ValueError(f"[rank {rank}] {what}: the output tensor (shape {tuple(t.shape)}, strides "
                         f"{t.stride()}) has elements that share memory, as an expand()ed view does; "
                         f"pass one whose elements have their own memory (.clone())")


def _common_tensor(t) -> bool:
    """Whether `t` may take a common path (_allreduce_common and its kin): a contiguous dense CPU
    tensor (and the group's debug check off, see NeuronProcessGroup._checked). Anything else
    takes the general path, which checks it."""
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_nested and t.is_cpu and \
        type(t).__torch_dispatch__ is _PLAIN_DISPATCH and t.is_contiguous()


def _common_op(rop) -> str | None:
    """The reduce op's name for a common path, None for PREMUL_SUM (its factor: the general path)."""
    if rop == _SUM:
        return "sum"
    op_name, factor = _reduce_op(rop)
    return op_name if factor is None else None


def _one(tensors, what: str, rank: int) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"[rank {rank}] {what}: expects exactly one tensor per process, got {len(tensors)}")
    return tensors[0]


def _options(cls, **fields):
    """An options object for torch's convenience overloads, which pass a reduce op, a root rank
    or a timeout where the options go (`pg.allreduce(t, ReduceOp.MAX)`, `pg.broadcast(t, 1)`;
    DDP's Join calls `pg.allreduce(tensor)`)."""
    o = cls()
    for k, v in fields.items():
        if v is not None:
            setattr(o, k, v)
    return o


def _factor_for(factor, dtype: torch.dtype):
    """PREMUL_SUM's factor rounded to the tensor's dtype, as NCCL's PreMulSum takes it: a float64
    factor tensor must not promote, and a Python number kept in double precision gave bfloat16
    and float16 products other than the same factor as a tensor gave."""
    return (factor if isinstance(factor, torch.Tensor) else torch.tensor(factor, dtype=torch.float64)).to(dtype)


def _sizes(splits) -> list[int]:
    """Split sizes as ints: torch's binding takes any sequence of integers (a numpy array,
    numpy integers), as Gloo does; `not splits` on a numpy array raised."""
    return [] if splits is None else [operator.index(s) for s in splits]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat view of `t` if contiguous (`t` itself if already 1-D), else a flat staging copy."""
    if t.is_contiguous():
        return t if t.dim() == 1 else t.view(-1)
    return t.contiguous().view(-1)


def _back_to_back(tensors) -> torch.Tensor | None:
    """One flat view over `tensors` where they lie back to back, in order, in one storage (the
    blocks of `t.chunk(n)` or `t.split(sizes)` of a contiguous `t`, as a scatter list or an
    all-gather list usually is): a list call then moves its data in place, not through a joined
    copy (a 64 MiB scatter's root joined its blocks first, 0.67x Gloo). None otherwise, empty
    blocks included (their addresses say nothing), and storages that only start at one address
    (numpy arrays or buffers imported one slice at a time: the span must lie in the first's)."""
    first = tensors[0]
    storage = first.untyped_storage()
    start, es, end = storage.data_ptr(), first.element_size(), first.data_ptr()
    for t in tensors:
        if t.dtype is not first.dtype or not t.is_contiguous() or t.numel() == 0 or t.data_ptr() != end or \
                t.untyped_storage().data_ptr() != start:
            return None
        end += t.numel() * es
    if end - start > storage.nbytes():
        return None
    return first.detach().as_strided(((end - first.data_ptr()) // es,), (1,), first.storage_offset())


def _own_block(output: torch.Tensor, inp: torch.Tensor, start: int) -> bool:
    """Whether contiguous `output` is exactly elements start.. of flat `inp`: an in-place call's
    own block (a reduce-scatter's output in its input, which every reduce-scatter schedule
    writes without staging, collectives/algorithms.OWN_BLOCK_OUT; an all-gather's or gather's
    input in its output, a scatter's output in its input: a copy to itself, skipped)."""
    return output.is_contiguous() and output.dtype is inp.dtype and \
        output.data_ptr() == inp.data_ptr() + start * inp.element_size() and output.numel() + start <= inp.numel()


def _outputs_apart(output: torch.Tensor, inp: torch.Tensor) -> bool:
    """Whether a call may write its result straight into `output`: contiguous, and sharing no
    memory with `inp`. Schedules read their input until their last round, so an output that
    overlaps it (an in-place form, as NCCL allows) gets the result in a staging buffer first
    (common paths leave such calls to the general path, which stages)."""
    return output.is_contiguous() and not _overlap(output, inp)


def _gather_source(out: torch.Tensor, inp: torch.Tensor, rank: int) -> torch.Tensor:
    """All-gather's flat input as the schedule may read it: the input itself where it lies apart
    from the flat output, or is exactly this rank's block of it (FSDP2's in-place call: nothing
    to move); a copy where it lies elsewhere inside the output, which the gather overwrites
    before the input is sent."""
    if _overlap(out, inp) and not _own_block(inp, out, rank * inp.numel()):
        return inp.clone()
    return inp


def _check_op(op_name: str, dtype: torch.dtype, what: str, rank: int) -> None:
    """reduce_ops.check, its error naming the rank and the call as every argument error does."""
    if (op_name, dtype) in reduce_ops.CHECKED:  # every call after the first of its kind
        return
    try:
        reduce_ops.check(op_name, dtype)
    except ValueError as e:
        raise ValueError(f"[rank {rank}] {what}: {e}") from None


def _typed(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (a slice of a byte buffer, at any offset) as elements of `dtype`, in fresh memory:
    a view of another dtype needs its start aligned to that dtype's size."""
    shape = (*block.shape[:-1], block.shape[-1] // dtype.itemsize)
    return torch.empty(block.shape, dtype=torch.uint8).copy_(block).view(-1).view(dtype).view(shape)


def _layout(items: list[str], noun: str = "parts") -> str:
    """A packed call's parts (or uneven blocks) for its description, and so for the checksum its
    frames carry: ranks that pack other dtypes or sizes into the same bytes then fail naming each
    other instead of reading each other's bytes as something else. Up to 8 listed, more as a CRC."""
    text = ", ".join(items)
    return f"{noun} [{text}]" if len(items) <= 8 else f"{len(items)} {noun}, layout {zlib.crc32(text.encode()):08x}"


def _parts(tensors) -> str:
    return _layout([f"{_dtype_name(t.dtype)}[{t.numel()}]" for t in tensors])


def _same_shapes(tensors) -> bool:
    """Whether a list form's blocks share one shape: only then does torch's wrapper compare the
    call's shapes across ranks (ProcessGroupWrapper's check_same_size), and so does the debug check."""
    return all(t.shape == tensors[0].shape for t in tensors) if tensors else True


def _same_dtype(tensors, what: str, rank: int) -> torch.dtype:
    if len(tensors) == 1:
        return tensors[0].dtype
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"[rank {rank}] {what}: tensors must share one dtype, got {sorted(map(str, dtypes))}")
    return tensors[0].dtype


_MAX_TAG = 2**31 - 1  # c10d's `int tag`
_NO_TIMEOUT = timedelta(0)  # an options object's time-out at or below this is unset
@_eager_under_compile
class NeuronProcessGroup(dist.ProcessGroup):
    """torch.distributed ProcessGroup for the "neuron" backend (CPU tensors)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_name: str = "",
                 global_ranks: list[int] | None = None):
        super().__init__(rank, size)
        self._name, self._desc = group_name, ""
        self.group = Group(store, rank, size, timeout, name=group_name or "default",
                           global_ranks=global_ranks, outside_autograd=_BelowAutograd)
        self._plans = Plans(self.group)  # collectives' plans, per argument set
        self._p2p = PeerPlans(self.group)  # sends' and receives' plans, per argument form

    # -- identity (c10d asks for these; without a name DeviceMesh/FSDP2 fail) ------------------
    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def _device_types(self):
        return [torch.device("cpu")]

    def __repr__(self) -> str:
        return f"NeuronProcessGroup(rank={self.rank()}, size={self.size()}, name={self._name!r})"

    # -- what torch asks a group's backend (this group is its own CPU backend) ---------------
    def _get_backend(self, device):
        """torch's Python asks a group for its backend per device (FSDP2's
        `set_allocate_memory_from_process_group_for_comm`, `_set_pg_timeout` in
        `dist.breakpoint`); torch's C++ answer knows no backend of a Python group."""
        if torch.device(device).type != "cpu":
            raise RuntimeError(f"[rank {self._r}] the neuron backend has no backend for device type "
                               f"{torch.device(device).type}; it moves CPU tensors")
        return self

    def supports_tensor_alloc(self, device) -> bool:
        return False  # FSDP2 then allocates its buffers with torch.empty

    @property
    def supports_splitting(self) -> bool:
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        """The group's time-out from now on (torch's C++ version sets its backends', which a
        Python group has none of, and returned doing nothing); calls given their own keep it."""
        if not isinstance(timeout, timedelta) or timeout <= _NO_TIMEOUT:
            raise ValueError(f"[rank {self._r}] set_timeout: expected a positive timedelta, got {timeout!r}")
        self.group.timeout = timeout

    _set_default_timeout = set_timeout

    def _get_sequence_number_for_group(self) -> int:
        return self.group.issued  # the user's collectives issued on the group (a debug check's exchange
        # not counted, as Gloo's under torch's wrapper): equal across ranks

    def _set_sequence_number_for_group(self) -> None:
        pass  # every rank's numbering starts at 0 when the group is made

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def _r(self) -> int:
        return self.group.rank

    def _checked(self) -> bool:
        """Whether this group's collectives go through the debug check (debug.enabled: the
        environment, or torch's debug level as this group was made)."""
        return debug.enabled(self.group.check_wanted)

    def _submit(self, kind: Kind, desc: str, make_exe, finish=None, outputs=(), nbytes=0,
                dtype=torch.uint8, algorithm="", peer=None, direction="", opts=None, tag=0, call=None) -> NeuronWork:
        """Check (the debug check: `call` is the user's call form and the tensors it compares,
        see debug._called), number and queue one op."""
        checks, checked = "", False
        if self._checked():  # TORCH_DISTRIBUTED_DEBUG=DETAIL: fingerprints agree
            checks = debug.checking()  # this op is the check's own all-gather, for that call
            if not checks:
                checked = debug.check(self, kind, desc, nbytes, dtype, peer, call)
        op = Op(kind, f"the debug check of {checks}" if checks else desc, make_exe, finish, outputs, peer=peer,
                direction=direction, nbytes=nbytes, dtype=dtype, algorithm=algorithm, tag=tag)
        if checks or checked:  # numbered as the user's call it checks, or had checked (Group.submit)
            op.checks, op.checked = checks, checked
        if opts is not None:
            if getattr(opts, "asyncOp", True) is False:
                op.sync = True  # the caller waits at once: run it on this thread whatever its size
            timeout = getattr(opts, "timeout", None)  # unset: -1 ms (c10d's kUnsetTimeout)
            if timeout is not None and timeout > _NO_TIMEOUT:  # dist.barrier(timeout=...), as Gloo
                op.timeout = timeout.total_seconds()
        return NeuronWork(self.group.submit(op), self.group)

    def _collective(self, collective: str, kind: Kind, spec_args: dict, inp: torch.Tensor | None,
                    out: torch.Tensor | None, dtype: torch.dtype, op_name: str = "sum",
                    before=None, after=None, outputs=(), nbytes: int = 0, algorithm: str | None = None,
                    opts=None, name: str | None = None, detail: str = "", out_at_start=None, call=None,
                    own_block: bool = False):
        """Submit one collective on flat buffers IN/OUT. `before` runs as the op starts, just
        before its schedule, on whichever thread runs it (premultiply; it may return a new IN to
        use), `after` once it has finished (AVG, copy-back); `out_at_start`, if given, returns OUT
        as the op starts (a buffer in the group's kept scratch, which a call may take only then).
        `name` replaces the collective's in the description; `detail` is added to its arguments
        (see Plans.get); `call`: the user's call form and tensors, for the debug check (_submit);
        `own_block`: OUT is this rank's own block of IN, a reduce-scatter's in-place output."""
        algo = algorithm or _choose_algorithm(collective, nbytes, self.group)
        plan = self._plans.get(collective, kind, algo, spec_args, dtype, op_name, nbytes, name, detail)
        return self._run_plan(plan, kind, algo, inp, out, dtype, op_name, before, after, outputs, nbytes, opts,
                              out_at_start, call, own_block)

    def _run_plan(self, plan: Plan, kind: Kind, algo: str, inp, out, dtype: torch.dtype, op_name: str,
                  before, after, outputs, nbytes: int, opts, out_at_start=None, call=None,
                  own_block: bool = False) -> NeuronWork:
        """Submit one call of `plan` on flat buffers IN/OUT (see _collective)."""
        g = self.group
        # a reduce-scatter's own block written in place only by a builder that promised to read
        # it first (algorithms.OWN_BLOCK_OUT); the plan holds the builder and its promise as read
        # together when it was made, so a `register` from another thread cannot part them
        staged = fresh(out.numel(), dtype) if own_block and not plan.own_block_out else None

        def start(op: Op) -> Execution:
            src = inp
            if before:
                replaced = before()
                if replaced is not None:
                    src = replaced
            dst = out_at_start() if out_at_start else out
            return plan.execution(op, src, dst if staged is None else staged)  # built on first use: an error reaches wait()

        finish = None
        if (op_name == "avg" and out is not None) or after or staged is not None:
            def finish(op: Op) -> None:
                if staged is not None:
                    out.copy_(staged)
                if op_name == "avg" and out is not None:
                    reduce_ops.finish_avg(out, g.size)
                if after:
                    after()

        return self._submit(kind, plan.desc, start, finish, outputs, nbytes, dtype, algo, opts=opts, call=call)

    # -- all-reduce ----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, timeout=None):
        if type(tensors) is list and len(tensors) == 1 and type(opts) is _AllreduceOptions:
            work = self._allreduce_common(tensors, opts)  # dist.all_reduce's call
            if work is not None:
                return work
        if isinstance(tensors, torch.Tensor):  # allreduce(tensor, op)
            tensors = [tensors]
        # allreduce(tensors, op); a type check, as hasattr would build a ReduceOp to test for one
        if opts is not None and not isinstance(opts, dist.AllreduceOptions):
            opts = _options(dist.AllreduceOptions, reduceOp=opts, timeout=timeout)
        t = _one(tensors, "allreduce", self.group.rank)
        if isinstance(t, torch.Tensor) and t.is_sparse:
            return self._allreduce_sparse(t, opts)
        return self._allreduce_flat([t], opts, "allreduce")

    def _allreduce_sparse(self, t, opts) -> NeuronWork:
        """A sparse COO tensor (DDP's gradient of a sparse embedding): summed in place by
        `sparse.allreduce`, SUM only, as Gloo's; the Work returned completes after it."""
        r = self.group.rank
        op_name, _ = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        if op_name != "sum":
            raise ValueError(f"[rank {r}] allreduce: a sparse tensor reduces with ReduceOp.SUM only (as "
                             f"with Gloo), not {op_name.upper()}")
        if not t.is_cpu or t.dtype not in DTYPE_CODE:
            _check_tensor(t._values(), "allreduce", r)  # its error: the device or dtype (coalesced or not)
        _check_op("sum", t.dtype, "allreduce", r)  # (a dtype only moved bit for bit: float8, uint16, ...)
        sparse.allreduce(self, t)
        return self._empty_work([t], "allreduce")

    def _allreduce_common(self, tensors, opts) -> NeuronWork | None:
        """The common all-reduce, `dist.all_reduce` of one contiguous dense CPU tensor with any op
        but PREMUL_SUM, with what `_allreduce_flat` checks and decides per call looked up instead:
        for such a tensor the checks and the plan depend on (dtype, size, op, algorithm) alone,
        so they are made once per group and kept (`Plans.common`). The same plan, so the same frames
        and checksum, as the general path (a peer may take either). About a tenth of a 4 KiB
        call at two ranks (RESULTS.md "Thirty-fourth pass"). None: take the general path (the
        debug check on, any other argument form, an unsupported dtype: its error comes from
        there)."""
        t = tensors[0]
        if self._checked() or not _common_tensor(t):
            return None
        op_name = _common_op(opts.reduceOp)
        if op_name is None:
            return None
        dtype, n = t.dtype, t.numel()
        nbytes = n * dtype.itemsize
        g = self.group
        algo = _choose_algorithm("allreduce", nbytes, g)
        plan = self._common_plan(("allreduce", dtype, n, op_name, algo), "allreduce", Kind.ALLREDUCE, algo,
                                 {"count": n}, dtype, op_name, nbytes, check_as="allreduce")
        if plan is None:
            return None
        buf = _flat(t)
        return self._run_plan(plan, Kind.ALLREDUCE, algo, buf, buf, dtype, op_name, None, None, tensors, nbytes, opts)

    def _common_plan(self, key: tuple, collective: str, kind: Kind, algo: str, spec_args: dict, dtype: torch.dtype,
                     op_name: str, nbytes: int, name: str | None = None, check_as: str | None = None):
        """A common path's plan (_allreduce_common and its kin), kept per group under `key`
        (what the general path's checks and plan depend on): on a miss the general path's op
        check (`check_as`, its error naming that call) and its plan (`Plans.get`). None for a
        dtype the general path refuses (its check says so)."""
        common = self._plans.common()
        plan = common.get(key)
        if plan is None:
            if dtype not in DTYPE_CODE:
                return None
            if check_as:
                _check_op(op_name, dtype, check_as, self.group.rank)
            plan = self._plans.get(collective, kind, algo, spec_args, dtype, op_name, nbytes, name)
            self._plans.keep_common(key, plan)
        return plan

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = list(tensors)
        if not tensors:  # nothing to reduce, as the other coalesced forms: still ordered after earlier ops
            return self._empty_work([], "allreduce_coalesced")
        return self._allreduce_flat(tensors, opts, "allreduce_coalesced")

    def _allreduce_flat(self, tensors, opts, what):
        r = self.group.rank
        for t in tensors:
            _check_tensor(t, what, r, written=True)
        dtype = _same_dtype(tensors, what, r)
        op_name, factor = _reduce_op(opts.reduceOp if opts is not None else _ReduceOp.SUM)
        _check_op(op_name, dtype, what, r)
        if len(tensors) == 1 and tensors[0].is_contiguous():
            buf, back = _flat(tensors[0]), None
        else:
            with torch.no_grad():  # (a cat into `out` refuses inputs that require grad)
                buf = torch.cat([t.reshape(-1) for t in tensors], out=fresh(sum(t.numel() for t in tensors), dtype))
            back = tensors

        before = after = None
        if factor is not None:
            def before():
                buf.mul_(_factor_for(factor, dtype))

        if back is not None:
            def after():
                off = 0
                for t in back:
                    t.copy_(buf[off:off + t.numel()].view_as(t))
                    off += t.numel()

        n = buf.numel()
        # (torch's wrapper compares no shapes of a coalesced call: its lists may differ in layout)
        return self._collective("allreduce", Kind.ALLREDUCE, {"count": n}, buf, buf, dtype,
                                op_name, before, after, tensors, n * buf.element_size(), opts=opts,
                                call=(what, tensors if what == "allreduce" else ()))

    # -- broadcast -----------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None, timeout=None):
        if type(tensors) is list and len(tensors) == 1 and type(opts) is _BroadcastOptions:
            work = self._broadcast_common(tensors[0], opts)  # dist.broadcast's call
            if work is not None:
                return work
        if isinstance(tensors, torch.Tensor):  # broadcast(tensor, root)
            tensors, opts = [tensors], _options(dist.BroadcastOptions, rootRank=opts, timeout=timeout)
        t = _one(tensors, "broadcast", self._r)
        root = self._root(opts.rootRank if opts is not None else 0, "broadcast")
        sends = self.group.rank == root  # the root's tensor is only read (an expand()ed one will do)
        _check_tensor(t, "broadcast", self._r, written=not sends)
        buf = _flat(t)
        after = None if sends or buf.data_ptr() == t.data_ptr() or t.numel() == 0 else \
            (lambda: t.copy_(buf.view_as(t)))
        return self._collective("broadcast", Kind.BROADCAST, dict(count=buf.numel(), root=root), buf, buf,
                                t.dtype, after=after, outputs=[t], nbytes=t.numel() * t.element_size(), opts=opts,
                                call=("broadcast", [t]))

    def _broadcast_common(self, t, opts) -> NeuronWork | None:
        """`dist.broadcast` of one contiguous dense CPU tensor: broadcast's checks and plan
        looked up (as _allreduce_common), the plan `broadcast` makes. None: the general path."""
        root = opts.rootRank
        if self._checked() or not _common_tensor(t) or not 0 <= root < self.group.size:
            return None
        dtype, n = t.dtype, t.numel()
        nbytes = n * dtype.itemsize
        algo = _choose_algorithm("broadcast", nbytes, self.group)
        plan = self._common_plan(("broadcast", dtype, n, root, algo), "broadcast", Kind.BROADCAST, algo,
                                 dict(count=n, root=root), dtype, "sum", nbytes)
        if plan is None:
            return None
        buf = _flat(t)
        return self._run_plan(plan, Kind.BROADCAST, algo, buf, buf, dtype, "sum", None, None, [t], nbytes, opts)

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self.group.size:
            raise ValueError(f"[rank {self._r}] {what}: root rank {root} is out of range for a group of "
                             f"size {self.group.size}")
        return root

    # -- all-gather ----------------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if isinstance(input_tensors, torch.Tensor):  # allgather(output_tensors, input_tensor)
            output_tensors, input_tensors, opts = [output_tensors], [input_tensors], None
        inp = _one(input_tensors, "allgather", self._r)
        outs = _one(output_tensors, "allgather", self._r)
        return self._allgather_lists([outs], [inp], "allgather", outputs=list(outs), opts=opts,
                                     call=("allgather", [inp] if _same_shapes(outs) else ()))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """`output_lists[r][j]` receives rank r's `input_list[j]` (torch's and Gloo's layout)."""
        what, n = "allgather_coalesced", self.group.size
        output_lists, inputs = [list(lst) for lst in output_lists], list(input_list)
        if len(output_lists) != n:
            raise ValueError(f"[rank {self._r}] {what}: needs {n} output lists (one per rank), got {len(output_lists)}")
        for r, lst in enumerate(output_lists):
            if len(lst) != len(inputs):
                raise ValueError(f"[rank {self._r}] {what}: output list {r} has {len(lst)} tensors for "
                                 f"{len(inputs)} inputs")
        if not inputs:
            return self._empty_work([], what)
        per_input = [[lst[j] for lst in output_lists] for j in range(len(inputs))]
        return self._allgather_lists(per_input, inputs, what, outputs=[t for lst in output_lists for t in lst],
                                     opts=opts)

    def _allgather_lists(self, output_lists, inputs, what, outputs, opts=None, call=None):
        for inp, outs in zip(inputs, output_lists):
            _check_tensor(inp, what, self._r)
            self._check_per_rank(outs, inp, what, "output", "input")
        if len(inputs) != len(output_lists):
            raise ValueError(f"[rank {self._r}] {what}: {len(inputs)} inputs but {len(output_lists)} output lists")
        return self._allgather_packed(inputs, output_lists, what, outputs, opts, call)

    def _allgather_packed(self, inputs, output_lists, what, outputs, opts=None, call=None):
        """All-gather several inputs in one collective: each rank's block is its inputs packed
        back to back; the result is unpacked into each output (list of per-rank tensors or one
        flat tensor per input). `call`: the debug check's (see _submit); default `what`, no shapes."""
        n = self.group.size
        detail = _parts(inputs) if len(inputs) > 1 else ""
        # inputs of several dtypes (a coalesced all-gather, which Gloo takes) move as bytes: an
        # all-gather never looks at its elements
        as_bytes = len({i.dtype for i in inputs}) > 1
        if as_bytes:
            inputs = [i.reshape(-1).view(torch.uint8) for i in inputs]
        dtype = _same_dtype(inputs, what, self._r) if inputs else torch.float32
        sizes = [i.numel() for i in inputs]
        c = sum(sizes)
        inp = _flat(inputs[0]) if len(inputs) == 1 else torch.cat([i.reshape(-1) for i in inputs])
        single = len(inputs) == 1 and isinstance(output_lists[0], torch.Tensor) and output_lists[0].is_contiguous()
        out = output_lists[0].view(-1) if single else None
        if len(inputs) == 1 and not single and not as_bytes and c:  # a list: written in place if
            out = _back_to_back(output_lists[0])                    # it holds one tensor's blocks
            single = out is not None
        if single:
            inp = _gather_source(out, inp, self._r)
        elif not c:
            out = torch.empty(0, dtype=dtype)
        staged = out is None  # (a 64 MiB list all-gather staged in fresh memory: 49.8 ms; 10.9 into a tensor)
        receive_buffer, got = self._staging(c * n, dtype) if staged else (None, None)

        def after():
            rows, off = got.pop().view(n, c), 0
            typed = _typed if as_bytes else (lambda block, dtype: block)
            for dst, sz in zip(output_lists, sizes):
                if isinstance(dst, torch.Tensor):  # into_tensor form: rank r's block is row r
                    dst.copy_(typed(rows[:, off:off + sz], dst.dtype).reshape(dst.shape))
                else:                               # list form: one tensor per rank
                    for r in range(n):
                        dst[r].copy_(typed(rows[r, off:off + sz], dst[r].dtype).reshape(dst[r].shape))
                off += sz

        return self._collective("allgather", Kind.ALLGATHER, dict(counts=(c,) * n), inp, out, dtype,
                                after=after if staged else None, outputs=outputs, nbytes=c * n * dtype.itemsize,
                                opts=opts, detail=detail, call=call or (what, ()), out_at_start=receive_buffer)

    def all_gather_single(self, output, input, opts=None):
        if type(opts) is _AllgatherOptions:
            work = self._allgather_common(output, input, opts)  # dist.all_gather_into_tensor's call
            if work is not None:
                return work
        self._check_whole_part(output, input, "all_gather_into_tensor", "output", "input")
        return self._allgather_packed([input], [output], "all_gather_into_tensor", [output], opts,
                                      ("all_gather_into_tensor", [input]))

    _allgather_base = all_gather_single

    def _allgather_common(self, output, inp, opts) -> NeuronWork | None:
        """`dist.all_gather_into_tensor` of contiguous dense CPU tensors of one dtype, the output
        world_size times the input: the checks and plan `_allgather_packed` makes, looked up
        (as _allreduce_common). The input may be the output's block (FSDP2's in-place call);
        elsewhere inside the output it is copied first, as there. None: the general path."""
        g = self.group
        if self._checked() or not (_common_tensor(output) and _common_tensor(inp)) or output.dtype is not inp.dtype or \
                output.numel() != inp.numel() * g.size:
            return None
        dtype, c = inp.dtype, inp.numel()
        nbytes = c * g.size * dtype.itemsize
        algo = _choose_algorithm("allgather", nbytes, g)
        plan = self._common_plan(("allgather", dtype, c, algo), "allgather", Kind.ALLGATHER, algo,
                                 dict(counts=(c,) * g.size), dtype, "sum", nbytes)
        if plan is None:
            return None
        out = _flat(output)
        src = _gather_source(out, _flat(inp), g.rank)
        return self._run_plan(plan, Kind.ALLGATHER, algo, src, out, dtype, "sum", None, None, [output], nbytes, opts)

    def _check_whole_part(self, whole, part, what, whole_is: str, part_is: str) -> None:
        """`whole` must hold world_size x `part` elements of the same dtype (all-gather's output
        and input, reduce-scatter's input and output)."""
        r, n = self.group.rank, self.group.size
        _check_tensor(whole, what, r, written=whole_is == "output")
        _check_tensor(part, what, r, written=part_is == "output")
        if whole.numel() != part.numel() * n:
            raise ValueError(f"[rank {r}] {what}: {whole_is} has {whole.numel()} elements, expected "
                             f"world_size ({n}) x {part_is} ({part.numel()}) = {n * part.numel()}")
        if whole.dtype != part.dtype:
            raise ValueError(f"[rank {r}] {what}: {whole_is} dtype {whole.dtype} != {part_is} dtype {part.dtype}")

    def _check_per_rank(self, tensors, ref, what: str, role: str, ref_role: str) -> None:
        """`tensors` must be one per rank, each with `ref`'s element count and dtype."""
        n = self.group.size
        if len(tensors) != n:
            raise ValueError(f"[rank {self._r}] {what}: needs {n} {role} tensors (one per rank), got {len(tensors)}")
        for t in tensors:
            _check_tensor(t, what, self._r, written=role == "output")
            if t.numel() != ref.numel() or t.dtype != ref.dtype:
                raise ValueError(f"[rank {self._r}] {what}: {role} tensor of {t.numel()} {t.dtype} does not match "
                                 f"the {ref_role}'s {ref.numel()} {ref.dtype}")

    def _coalesced_pairs(self, outputs, inputs, what: str, gather: bool):
        """The (outputs, inputs) lists of a coalesced all-gather (output = world x input) or
        reduce-scatter (input = world x output), checked pair by pair."""
        outputs, inputs = list(outputs), list(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"[rank {self._r}] {what}: {len(inputs)} inputs, {len(outputs)} outputs")
        for o, i in zip(outputs, inputs):
            if gather:
                self._check_whole_part(o, i, what, "output", "input")
            else:
                self._check_whole_part(i, o, what, "input", "output")
        return outputs, inputs

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = self._coalesced_pairs(outputs, inputs, "allgather_into_tensor_coalesced", gather=True)
        if not inputs:
            return self._empty_work(outputs, "allgather_into_tensor_coalesced")
        return self._allgather_packed(inputs, outputs, "allgather_into_tensor_coalesced", outputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # -- reduce-scatter ------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None, timeout=None):
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(output, inputs, op)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            opts = _options(dist.ReduceScatterOptions, reduceOp=opts, timeout=timeout)
        out = _one(output_tensors, "reduce_scatter", self._r)
        ins = list(_one(input_tensors, "reduce_scatter", self._r))
        _check_tensor(out, "reduce_scatter", self._r, written=True)
        self._check_blocks(ins, out, "reduce_scatter")
        # input j is rank j's block: blocks may differ in size from rank to rank (as with Gloo)
        joined = _back_to_back(ins) if out.numel() else None  # one tensor's blocks: read in place
        return self._reduce_scatter_packed([out], [joined] if joined is not None else ins, opts,
                                           "reduce_scatter", counts=tuple(t.numel() for t in ins),
                                           call=("reduce_scatter", [out] if _same_shapes(ins) else ()),
                                           join=joined is None)

    def _check_blocks(self, blocks, mine, what: str) -> None:
        """`blocks` must be one per rank, of `mine`'s dtype, this rank's with `mine`'s element count."""
        n, r = self.group.size, self._r
        if len(blocks) != n:
            raise ValueError(f"[rank {r}] {what}: needs {n} input tensors (one per rank), got {len(blocks)}")
        for j, t in enumerate(blocks):
            _check_tensor(t, what, r)
            if t.dtype != mine.dtype:
                raise ValueError(f"[rank {r}] {what}: input tensor {j} is {t.dtype}, the output {mine.dtype}")
        if blocks[r].numel() != mine.numel():
            raise ValueError(f"[rank {r}] {what}: input tensor {r} (this rank's block) has {blocks[r].numel()} "
                             f"elements, the output {mine.numel()}")

    def reduce_scatter_single(self, output, input, opts=None):
        if type(opts) is _ReduceScatterOptions:
            work = self._reduce_scatter_common(output, input, opts)  # dist.reduce_scatter_tensor's call
            if work is not None:
                return work
        self._check_whole_part(input, output, "reduce_scatter_tensor", "input", "output")
        return self._reduce_scatter_packed([output], [input], opts, "reduce_scatter_tensor",
                                           call=("reduce_scatter_tensor", [input, output]))

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_common(self, output, inp, opts) -> NeuronWork | None:
        """`dist.reduce_scatter_tensor` of contiguous dense CPU tensors of one dtype, the input
        world_size times the output, apart or the rank's own block of it (in place), any op but
        PREMUL_SUM: the checks and plan `_reduce_scatter_packed` makes, looked up (as
        _allreduce_common). None: the general path (an output elsewhere inside the input is
        staged there)."""
        g = self.group
        if self._checked() or not (_common_tensor(output) and _common_tensor(inp)) or output.dtype is not inp.dtype or \
                inp.numel() != output.numel() * g.size:
            return None
        apart = _outputs_apart(output, inp)
        if not (apart or _own_block(output, inp, g.rank * output.numel())):
            return None
        op_name = _common_op(opts.reduceOp)
        if op_name is None:
            return None
        dtype, c = inp.dtype, output.numel()
        nbytes = c * g.size * dtype.itemsize
        algo = _choose_algorithm("reduce_scatter", nbytes, g)
        plan = self._common_plan(("reduce_scatter", dtype, c, op_name, algo), "reduce_scatter", Kind.REDUCE_SCATTER,
                                 algo, {"counts": (c,) * g.size}, dtype, op_name, nbytes, "reduce_scatter_tensor",
                                 check_as="reduce_scatter_tensor")
        if plan is None:
            return None
        return self._run_plan(plan, Kind.REDUCE_SCATTER, algo, _flat(inp), _flat(output), dtype, op_name, None, None,
                              [output], nbytes, opts, own_block=not apart)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "reduce_scatter_tensor_coalesced"
        outputs, inputs = self._coalesced_pairs(outputs, inputs, what, gather=False)
        if not inputs:
            return self._empty_work(outputs, what)
        dtypes = list(dict.fromkeys(i.dtype for i in inputs))  # in order of first use: the same on every rank
        if len(dtypes) == 1:
            return self._reduce_scatter_packed(outputs, inputs, opts, what)
        # several dtypes (Gloo takes them): one collective per dtype. A group runs collectives one
        # at a time, in order, so the last one's Work ends after the others, and fails if one
        # did (the group is then unusable, and the error says why). The op is checked against
        # every dtype first: a refusal comes before any of them starts
        op_name, _ = _reduce_op(opts.reduceOp if opts is not None else _ReduceOp.SUM)
        for dt in dtypes:
            _check_op(op_name, dt, what, self._r)
        for dt in dtypes:
            pairs = [(o, i) for o, i in zip(outputs, inputs) if i.dtype == dt]
            work = self._reduce_scatter_packed([o for o, _ in pairs], [i for _, i in pairs], opts, what,
                                               work_outputs=outputs)
        return work

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _reduce_scatter_packed(self, outputs, inputs, opts, what, counts=None, work_outputs=None, call=None,
                               join=False):
        """Reduce-scatter several (output, input) pairs in one collective: rank r's block is the
        r-th piece of every input, packed back to back. `counts`: each rank's block size, when
        they differ (one input, its blocks back to back); `work_outputs`: the Work's result, if
        not `outputs`; `call`: the debug check's (see _submit), default `what`, no shapes.
        `join`: `inputs` are one output's blocks, rank by rank, in tensors of their own (the
        list form), joined as the op starts in the group's kept scratch: joined per call in
        fresh memory, a 64 MiB one was mapped and faulted in every call."""
        n = self.group.size
        dtype = _same_dtype(inputs + outputs, what, self._r)
        op_name, factor = _reduce_op(opts.reduceOp if opts is not None else _ReduceOp.SUM)
        _check_op(op_name, dtype, what, self._r)
        sizes = [o.numel() for o in outputs]
        c = sum(sizes)
        detail = _parts(outputs) if len(outputs) > 1 else \
            _layout([str(k) for k in counts], "blocks") if counts and len(set(counts)) > 1 else ""
        counts = counts or (c,) * n
        if join:
            inp = None  # (joined in `before`, below)
        elif len(inputs) == 1:
            inp = _flat(inputs[0])
        else:
            inp = torch.cat([i.reshape(n, -1) for i in inputs], dim=1).view(-1) if c else torch.empty(0, dtype=dtype)
        # in place (the output a piece of the input, as NCCL allows): schedules read the input
        # until the end, so the result goes to a staging buffer first, unless it is this rank's
        # own block, which the built-in reduce-scatter schedules write last (OWN_BLOCK_OUT; a
        # call whose builder made no such promise stages as it starts, _run_plan)
        one = len(outputs) == 1
        apart = one and not join and _outputs_apart(outputs[0], inp)
        own_block = one and not join and not apart and _own_block(outputs[0], inp, sum(counts[:self.group.rank]))
        single = one and (outputs[0].is_contiguous() if join else apart or own_block)
        out = outputs[0].view(-1) if single else fresh(c, dtype)

        before = after = None
        if join:
            def before():  # (before the schedule writes any output: an output among the inputs is read first)
                joined = self._join(inputs, sum(counts), dtype)
                return joined if factor is None else joined.mul_(_factor_for(factor, dtype))
        elif factor is not None:
            def before():
                return inp * _factor_for(factor, dtype)  # never scale the caller's input in place

        if not single:
            def after():
                off = 0
                for o, sz in zip(outputs, sizes):
                    o.copy_(out[off:off + sz].view(o.shape))
                    off += sz

        return self._collective("reduce_scatter", Kind.REDUCE_SCATTER, {"counts": counts}, inp, out, dtype,
                                op_name, before, after, outputs if work_outputs is None else work_outputs,
                                sum(counts) * dtype.itemsize, opts=opts, name=what, detail=detail,
                                call=call or (what, ()), own_block=own_block)

    # -- rooted collectives --------------------------------------------------------------------
    def reduce(self, tensors, opts=None, op=None, timeout=None):
        if isinstance(tensors, torch.Tensor):  # reduce(tensor, root, op)
            tensors, opts = [tensors], _options(dist.ReduceOptions, rootRank=opts, reduceOp=op, timeout=timeout)
        t = _one(tensors, "reduce", self._r)
        root = self._root(opts.rootRank if opts is not None else 0, "reduce")
        _check_tensor(t, "reduce", self._r, written=self.group.rank == root)  # others only read theirs
        op_name, factor = _reduce_op(opts.reduceOp if opts is not None else _ReduceOp.SUM)
        _check_op(op_name, t.dtype, "reduce", self._r)
        buf = t.contiguous().view(-1) if factor is None else t.reshape(-1) * _factor_for(factor, t.dtype)
        is_root = self.group.rank == root
        out = buf if is_root else None  # (the tree reduce's root may sum into its input: a staged
        after = None                    # or premultiplied one is already a copy of its own)
        if is_root and out.data_ptr() != t.data_ptr():
            after = lambda: t.copy_(out.view_as(t))
        outs = out if is_root else torch.empty(0, dtype=t.dtype)
        return self._collective("reduce", Kind.REDUCE, dict(count=buf.numel(), root=root), buf, outs, t.dtype,
                                op_name, after=after, outputs=[t], nbytes=t.numel() * t.element_size(), opts=opts,
                                call=("reduce", [t]))

    def gather(self, output_tensors, input_tensors, opts=None, timeout=None):
        if isinstance(input_tensors, torch.Tensor):  # gather(output_tensors, input_tensor, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            opts = _options(dist.GatherOptions, rootRank=opts, timeout=timeout)
        inp = _one(input_tensors, "gather", self._r)
        _check_tensor(inp, "gather", self._r)
        n, root = self.group.size, self._root(opts.rootRank if opts is not None else 0, "gather")
        outs = []
        if self.group.rank == root:
            outs = list(_one(output_tensors, "gather", self._r))
            self._check_per_rank(outs, inp, "gather", "output", "input")
        elif output_tensors and any(len(lst) for lst in output_tensors):
            raise ValueError(f"[rank {self._r}] gather: only the root (rank {root}) passes output tensors")
        c = inp.numel()
        src = _flat(inp)
        span = _back_to_back(outs) if outs and c else None  # the blocks of one tensor: written in place
        receive_buffer = after = None
        if outs and not (span is not None and (_outputs_apart(src, span) or _own_block(src, span, root * c))):
            span, (receive_buffer, got) = None, self._staging(c * n, inp.dtype)  # (the direct gather has no TMP)

            def after():
                staged = got.pop()
                for r, o in enumerate(outs):
                    o.copy_(staged[r * c:(r + 1) * c].view(o.shape))

        return self._collective("gather", Kind.GATHER, dict(counts=(c,) * n, root=root), src, span,
                                inp.dtype, after=after, outputs=outs, nbytes=c * n * inp.element_size(), opts=opts,
                                out_at_start=receive_buffer, call=("gather", [inp]))

    def scatter(self, output_tensors, input_tensors, opts=None, timeout=None):
        if isinstance(output_tensors, torch.Tensor):  # scatter(output_tensor, input_tensors, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            opts = _options(dist.ScatterOptions, rootRank=opts, timeout=timeout)
        out_t = _one(output_tensors, "scatter", self._r)
        _check_tensor(out_t, "scatter", self._r, written=True)
        n, root = self.group.size, self._root(opts.rootRank if opts is not None else 0, "scatter")
        c = out_t.numel()
        out = _flat(out_t) if out_t.is_contiguous() else torch.empty(c, dtype=out_t.dtype)
        inp = before = None
        if self.group.rank == root:
            ins = list(_one(input_tensors, "scatter", self._r))
            self._check_per_rank(ins, out_t, "scatter", "input", "output")
            inp = torch.empty(0, dtype=out_t.dtype)
            span = _back_to_back(ins) if c else None
            if span is not None and (_outputs_apart(out, span) or _own_block(out, span, root * c)):
                inp = span  # the blocks of one tensor, read where they lie
            elif c:
                def before():  # (the direct scatter has no TMP; joined in fresh memory: 0.3x Gloo)
                    return self._join(ins, c * n, out_t.dtype)
        elif input_tensors and any(len(lst) for lst in input_tensors):
            raise ValueError(f"[rank {self._r}] scatter: only the root (rank {root}) passes input tensors")
        after = None if out_t.is_contiguous() else (lambda: out_t.copy_(out.view(out_t.shape)))
        return self._collective("scatter", Kind.SCATTER, dict(counts=(c,) * n, root=root), inp, out,
                                out_t.dtype, before=before, after=after, outputs=[out_t],
                                nbytes=c * n * out_t.element_size(), opts=opts, call=("scatter", [out_t]))

    # -- all-to-all ----------------------------------------------------------------------------
    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins, n = list(output_tensors), list(input_tensors), self.group.size
        if len(outs) != n or len(ins) != n:
            raise ValueError(f"[rank {self._r}] all_to_all: needs {n} input and {n} output tensors, "
                             f"got {len(ins)} and {len(outs)}")
        for t in ins:
            _check_tensor(t, "all_to_all", self._r)
        for t in outs:
            _check_tensor(t, "all_to_all", self._r, written=True)
        dtype = _same_dtype(ins + outs, "all_to_all", self._r)
        send, recv = [i.numel() for i in ins], [o.numel() for o in outs]
        inp, out = _back_to_back(ins), _back_to_back(outs)  # the blocks of one tensor: used in place
        join = inp is None
        stage = out is None or not join and _overlap(out, inp)
        if not (join or stage):
            return self._alltoall(inp, out, send, recv, dtype, None, outs, opts, "all_to_all")
        # a list of separate tensors is joined, and an output list staged, in the group's kept
        # scratch as the op starts (the direct all-to-all has no TMP): in buffers made per call,
        # mapped and faulted in every call past glibc's mmap threshold, a 64 MiB all-to-all of
        # two lists took 109-114 ms (all_to_all_single 11-16)
        n_in, n_out, staged = sum(send) if join else 0, sum(recv) if stage else 0, []

        def before():
            scratch = self.group.scratch
            both = (n_in + n_out) * dtype.itemsize <= scratch.limit  # (else the output has it)
            buf = scratch.take(n_in + n_out if both else n_out, dtype)
            if stage:
                staged[:] = [buf[n_in:] if both else buf]
            if join:
                return torch.cat([i.reshape(-1) for i in ins],
                                 out=buf[:n_in] if both else fresh(n_in, dtype))

        def after():
            off, got = 0, staged.pop()
            for o in outs:
                o.copy_(got[off:off + o.numel()].view(o.shape))
                off += o.numel()

        return self._alltoall(inp, out, send, recv, dtype, after if stage else None, outs, opts, "all_to_all",
                              (lambda: staged[0]) if stage else None, before)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        output_split_sizes, input_split_sizes = _sizes(output_split_sizes), _sizes(input_split_sizes)
        if not output_split_sizes and not input_split_sizes and type(opts) is _AllToAllOptions:
            work = self._alltoall_common(output, input, opts)  # dist.all_to_all_single's even call
            if work is not None:
                return work
        _check_tensor(input, "all_to_all_single", self._r)
        _check_tensor(output, "all_to_all_single", self._r, written=True)
        if output.dtype != input.dtype:
            raise ValueError(f"[rank {self._r}] all_to_all_single: output dtype {output.dtype} != input dtype {input.dtype}")
        n = self.group.size
        send = self._splits(input, input_split_sizes, n, "input")
        recv = self._splits(output, output_split_sizes, n, "output")
        inp = _flat(input)
        if _outputs_apart(output, inp):
            return self._alltoall(inp, output.view(-1), send, recv, input.dtype, None, [output], opts,
                                  "all_to_all_single")
        receive_buffer, got = self._staging(output.numel(), output.dtype)  # in place, or non-contiguous
        return self._alltoall(inp, None, send, recv, input.dtype, lambda: output.copy_(got.pop().view(output.shape)),
                              [output], opts, "all_to_all_single", receive_buffer)

    alltoall_base = all_to_all_single

    def _alltoall_common(self, output, inp, opts) -> NeuronWork | None:
        """`dist.all_to_all_single` without split sizes, of contiguous dense CPU tensors of one
        dtype, apart, each dim 0 divisible by the group size: the checks and plan the general
        path makes, looked up (as _allreduce_common). None: the general path."""
        g = self.group
        n = g.size
        if self._checked() or not (_common_tensor(output) and _common_tensor(inp)) or output.dtype is not inp.dtype or \
                not inp.dim() or not output.dim() or inp.shape[0] % n or output.shape[0] % n or \
                not _outputs_apart(output, inp):
            return None
        dtype, ci, co = inp.dtype, inp.numel() // n, output.numel() // n
        nbytes = ci * n * dtype.itemsize
        algo = _choose_algorithm("alltoall", nbytes, g)
        plan = self._common_plan(("alltoall", dtype, ci, co, algo), "alltoall", Kind.ALLTOALL, algo,
                                 dict(counts=(ci,) * n, recv_counts=(co,) * n), dtype, "sum", nbytes)
        if plan is None:
            return None
        return self._run_plan(plan, Kind.ALLTOALL, algo, _flat(inp), _flat(output), dtype, "sum", None, None, [output],
                              nbytes, opts)

    def _splits(self, t, splits, n, which) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if not splits:
            if rows % n:
                raise ValueError(f"[rank {self._r}] all_to_all_single: {which} dim 0 ({rows}) is not divisible "
                                 f"by the group size {n}; pass split sizes")
            return [rows // n * row] * n
        if len(splits) != n or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"[rank {self._r}] all_to_all_single: {which} split sizes {splits} must be {n} "
                             f"non-negative numbers summing to dim 0 ({rows})")
        return [s * row for s in splits]

    def _alltoall(self, inp, out, send, recv, dtype, after, outputs, opts=None, what="all_to_all_single",
                  out_at_start=None, before=None):
        nbytes = sum(send) * dtype.itemsize  # (its shapes may differ per rank, by the splits: none compared)
        return self._collective("alltoall", Kind.ALLTOALL, dict(counts=tuple(send), recv_counts=tuple(recv)),
                                inp, out, dtype, before=before, after=after, outputs=outputs, nbytes=nbytes,
                                opts=opts, call=(what, ()), out_at_start=out_at_start)

    # -- barrier -------------------------------------------------------------------------------
    def barrier(self, opts=None):
        if opts is not None and not hasattr(opts, "asyncOp"):  # barrier(timeout)
            opts = _options(dist.BarrierOptions, timeout=opts)
        empty = torch.empty(0, dtype=torch.uint8)
        return self._collective("barrier", Kind.BARRIER, {}, empty, empty, torch.uint8, outputs=[empty], opts=opts,
                                call=("barrier", ()))

    def _staging(self, count: int, dtype: torch.dtype):
        """A call's staging buffer in the group's kept scratch (collectives/scratch.py), taken as
        its op starts (a group runs one collective at a time; made per call, a large buffer was
        mapped and faulted in again on every call, past glibc's mmap threshold): (take, held),
        `take` for _collective's out_at_start, `held` holding the buffer for the op's `after`,
        which pops it (before the group's next collective takes the scratch)."""
        held = []

        def take():
            held[:] = [self.group.scratch.take(count, dtype)]
            return held[0]
        return take, held

    def _join(self, tensors, count: int, dtype: torch.dtype) -> torch.Tensor:
        """`tensors` (`count` elements in all) flat and back to back in the group's kept scratch:
        a list call's input joined as its op starts (see _staging)."""
        return torch.cat([t.reshape(-1) for t in tensors], out=self.group.scratch.take(count, dtype))

    def _empty_work(self, outputs, what: str) -> NeuronWork:
        """A Work for `what`, a call with nothing to move (still ordered after earlier ops)."""
        empty = torch.empty(0, dtype=torch.uint8)
        return self._collective("barrier", Kind.BARRIER, {}, empty, empty, torch.uint8, outputs=list(outputs),
                                algorithm="dissemination", call=(what, ()))

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensors, dstRank, tag=0):
        r = self.group.rank
        t = _one(tensors, "send", r)
        _check_tensor(t, "send", r)
        self._peer(dstRank, "send")
        tag = self._tag(tag, "send")
        plan = self._p2p.send(dstRank, t.numel(), t.dtype, tag)
        return self._submit(Kind.P2P, plan.desc, functools.partial(plan.start, _flat(t)), None, [t], plan.nbytes,
                            t.dtype, "p2p", peer=dstRank, direction="send", tag=tag)

    def recv(self, tensors, srcRank, tag=0):
        self._peer(srcRank, "recv")
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._recv(tensors, None, tag)

    def _recv(self, tensors, peer, tag):
        """A receive from `peer` (None: any source) into the front of the tensor: a message
        shorter than the tensor fills its first elements, as with Gloo and MPI (`p2p.Receive`)."""
        r = self.group.rank
        t = _one(tensors, "recv", r)
        _check_tensor(t, "recv", r, written=True)
        tag = self._tag(tag, "recv")
        # a non-contiguous tensor receives into a contiguous copy of itself, copied back after:
        # its current values, so that a shorter message leaves the rest of the tensor as it was
        contiguous = t.is_contiguous()
        out = t.view(-1) if contiguous else t.contiguous().view(-1)
        count, dtype = t.numel(), t.dtype
        plan = self._p2p.recv(peer, count, dtype, tag)
        finish = note_sender = plan.note_sender
        if not contiguous:
            def finish(op: Op) -> None:
                if note_sender is not None:
                    note_sender(op)
                t.copy_(out.view(t.shape))

        return self._submit(Kind.P2P, plan.desc, functools.partial(plan.start, out), finish, [t],
                            count * t.element_size(), dtype, "p2p", peer=peer,
                            direction="recv" if peer is not None else "recv-any", tag=tag)

    def _tag(self, tag, what: str) -> int:
        """The tag as an int. c10d's tags are C++ ints, which torch's binding fills from anything
        with __index__ (a numpy integer, a bool), as Gloo takes them; a negative one, or one
        past 2**31 - 1, fails here, before any byte moves, as with Gloo. (A frame's tag field
        would take up to 2**32 - 1; a negative tag failed the group at its first frame, and a
        receive with one waited out the time-out.)"""
        try:
            value = operator.index(tag)
        except TypeError:
            value = -1
        if not 0 <= value <= _MAX_TAG:
            raise ValueError(f"[rank {self._r}] {what}: tag {tag!r} is invalid: a tag is an integer "
                             f"from 0 to {_MAX_TAG}")
        return value

    def _peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.group.size or peer == self.group.rank:
            raise ValueError(f"[rank {self._r}] {what}: peer rank {peer} is invalid in a group of size "
                             f"{self.group.size} (and cannot be this rank)")

    # -- life cycle ----------------------------------------------------------------------------
    def abort(self) -> None:
        self.group.close(abort=True)

    def shutdown(self) -> None:
        self.group.close()

    def report(self) -> list[dict]:
        return self.group.report()


def create_extended(opts, backend_opts=None) -> NeuronProcessGroup:
    """c10d's creator hook (`register`, run by `neuron_dist/__init__.py`), through its extended
    API: the options also carry the group's global ranks (for error messages)."""
    timeout = getattr(opts, "timeout", None) or timedelta(minutes=30)
    ranks = list(getattr(opts, "global_ranks_in_group", []) or [])
    return NeuronProcessGroup(opts.store, opts.group_rank, opts.group_size, timeout,
                              group_name=str(getattr(opts, "group_id", "")), global_ranks=ranks or None)


def _shardless_device_is_cpu() -> None:
    """torch's ShardedTensor takes the device of a rank that holds no shard of it to be the CPU
    only when its group's backend is named "gloo", and otherwise torch.cuda.current_device(),
    both in `.device` and in `.to()`. So FSDP1's SHARDED_STATE_DICT saved or loaded through
    torch.distributed.checkpoint failed on every rank with "Torch not compiled with CUDA
    enabled" when a parameter was too small to give each rank a shard (a 2-element bias at
    world 3), as did `.to(torch.bfloat16)` on such an entry. This backend's tensors are on the
    CPU, so its groups get Gloo's answer; every other group still gets torch's own."""
    import copy
    from torch.distributed._shard.sharded_tensor import _SHARDED_OPS, ShardedTensor

    getter = torch.Tensor.device.__get__
    torch_device, torch_to = _SHARDED_OPS.get(getter), ShardedTensor.to
    if torch_device is None or getattr(torch_to, "_neuron_cpu", False):
        return

    def shardless_here(st, pg) -> bool:
        return not st._local_shards and pg is not None and pg._get_backend_name() == BACKEND

    @functools.wraps(torch_device)
    def device(types, args=(), kwargs=None, pg=None):
        if shardless_here(args[0], pg):
            return torch.device("cpu")
        return torch_device(types, args, kwargs, pg)

    @functools.wraps(torch_to)
    def to(self, *args, **kwargs):
        if not shardless_here(self, self._process_group):
            return torch_to(self, *args, **kwargs)
        # the target dtype and device, read from the same arguments by an empty CPU tensor
        like = torch.empty(0, dtype=self.dtype).to(*args, **{k: v for k, v in kwargs.items()
                                                              if k in ("dtype", "device")})
        if like.dtype == self.dtype and like.device.type == "cpu" and not kwargs.get("copy", False):
            return self
        meta = copy.deepcopy(self.metadata())  # as torch's own .to(): nothing local to move
        meta.tensor_properties.dtype = like.dtype
        for shard in meta.shards_metadata:
            shard.placement._device = like.device
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [], sharded_tensor_metadata=meta, process_group=kwargs.get("process_group") or self._process_group,
            init_rrefs=self._init_rrefs)

    to._neuron_cpu = True
    _SHARDED_OPS[getter] = device
    ShardedTensor.to = to


def register() -> None:
    if BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND, create_extended, extended_api=True, devices=["cpu"])
    _shardless_device_is_cpu()
