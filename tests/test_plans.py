"""The plans the c10d adapter asks for (plans.py for collectives, p2p.py for sends and receives)
and the adapter's boundary. A collective's plan must describe its call as the frames' checksum
and every error expect, be made once per argument set, build its schedule once, keep a small
scratch buffer (and the executor's views of it) for the next call and take a larger one from the
group's shared scratch. A send or receive that fits one copied frame must be planned as that
frame (the headers the group makes), a larger one as a schedule or a `Receive`. Private torch
names stay in c10d.py, and debug.py reaches the adapter and the group through public names."""
import ast
import pathlib
from types import SimpleNamespace

import torch

import neuron_dist
from neuron_dist import debug
from neuron_dist.collectives import direct
from neuron_dist.collectives.scratch import Scratch
from neuron_dist.group import Group
from neuron_dist.op import Op
from neuron_dist.p2p import PeerPlans, Receive
from neuron_dist.plans import KEEP_SCRATCH, PLAN_CACHE, Plans
from neuron_dist.transport.frame import Kind

FRAME = 4096
PACKAGE = pathlib.Path(neuron_dist.__file__).parent


def _collective_group(calls):
    """What a plan reads of its group; `execution` records its arguments and returns them."""
    return SimpleNamespace(rank=0, size=3, order=[0, 1, 2], topology=None, frame_bytes=FRAME, name="g",
                           scratch=Scratch(1 << 20), execution=lambda *a: calls.append(a) or a)


def _allreduce(plans, count):
    return plans.get("allreduce", Kind.ALLREDUCE, "direct", {"count": count}, torch.float32, "sum", 4 * count)


def test_a_collective_plan_is_made_once_per_argument_set_and_describes_the_call():
    plans = Plans(_collective_group([]))
    plan = _allreduce(plans, 1000)
    assert _allreduce(plans, 1000) is plan and _allreduce(plans, 1001) is not plan
    assert plan.desc == "allreduce(4000 bytes, float32, sum)"
    assert plan.tag == debug.call_tag(Kind.ALLREDUCE, plan.desc, "direct")
    rs = plans.get("reduce_scatter", Kind.REDUCE_SCATTER, "ring", {"counts": (2, 2, 2)}, torch.float32, "max", 24,
                   name="reduce_scatter_tensor_coalesced", detail="parts [float32[1], float32[1]]")
    assert rs.desc == "reduce_scatter_tensor_coalesced(24 bytes, float32, max, parts [float32[1], float32[1]])"
    bc = plans.get("broadcast", Kind.BROADCAST, "direct", {"count": 3, "root": 2}, torch.int64, "sum", 24)
    assert bc.desc == "broadcast(24 bytes, int64, root 2)"  # no reduce op named
    for count in range(PLAN_CACHE):  # bounded: a full cache starts again
        _allreduce(plans, 2000 + count)
    assert len(plans.by_args) <= PLAN_CACHE and _allreduce(plans, 1000) is not plan


def test_a_plan_keeps_a_small_scratch_buffer_and_its_views_and_takes_a_large_one_from_the_group():
    calls = []
    g = _collective_group(calls)
    plans = Plans(g)
    small, large = _allreduce(plans, 1000), _allreduce(plans, 20_000)  # direct at 3 ranks: TMP per peer
    inp = out = torch.ones(1000)
    first, second = small.execution("op1", inp, out), small.execution("op2", inp, out)
    op, sched, bufs, reduce, dtype, tag, views = first
    assert op == "op1" and bufs[:2] == [inp, out] and dtype is torch.float32 and tag == small.tag
    assert 0 < sched.tmp_count * 4 <= KEEP_SCRATCH and bufs[2].numel() == sched.tmp_count
    assert second[1] is sched, "the schedule was built again"
    assert second[2][2] is bufs[2] and isinstance(views, dict) and second[6] is views, \
        "a small scratch buffer and its views are kept for the next call"
    big = torch.ones(20_000)
    sched = large.execution("op3", big, big)[1]
    tmp, views = calls[-1][2][2], calls[-1][6]
    assert sched.tmp_count * 4 > KEEP_SCRATCH and views is None and large._tmp is None
    assert tmp.data_ptr() == g.scratch.take(1, torch.uint8).data_ptr(), "a large one is the group's scratch"
    none = plans.get("broadcast", Kind.BROADCAST, "direct", {"count": 3, "root": 0}, torch.float32, "sum", 12)
    assert none.execution("op4", None, None)[2][2] is None  # no TMP, none made
    # an input or output staged in the group's scratch as its op started (a scatter or gather
    # root's) keeps it: a schedule of the call that needs a TMP (a builder of one's own) gets
    # memory apart, never the same buffer
    for staged in ("in", "out"):
        flat = g.scratch.take(20_000, torch.float32)
        src, dst = (flat, big) if staged == "in" else (big, flat)
        tmp = large.execution("op5", src, dst)[2][2]
        assert tmp.numel() == sched.tmp_count and \
            tmp.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr(), staged
        assert not g.scratch.holds(big, None) and g.scratch.holds(None, flat[5:])


def test_the_plans_keep_bounded_memory_however_many_call_forms_a_job_makes():
    """A job whose call sizes change every step (dynamic shapes) makes a plan per size. Kept
    with them: small scratch only within the group's budget (none with NEURON_DIST_SCRATCH_BYTES
    at 0; a budget spent, the plan cuts it from the one buffer), at most PLAN_CACHE plans in the
    two caches together, and frame plans only up to MAX_KEPT_FRAMES frames. Before, ~2,000
    plans each kept up to 64 KiB (~120 MiB a group, with the setting at 0 too) and a 4 MB
    all-reduce's frame plan at 4 KiB frames 0.34 MB."""
    from neuron_dist.collectives.algorithms import Spec, build
    from neuron_dist.collectives.executor import MAX_KEPT_FRAMES, frame_plan
    from neuron_dist.collectives.scratch import SMALL_KEPT_BYTES

    def kept(plans):
        return sum(p._tmp.numel() * p._tmp.itemsize for c in (plans.by_args, plans.common()) for p in c.values()
                   if p._tmp is not None)

    g = _collective_group([])
    g.scratch = Scratch(0)  # none kept: each call's small scratch is its own
    plans = Plans(g)
    plan = _allreduce(plans, 1000)
    first, second = plan.execution("op1", None, None)[2][2], plan.execution("op2", None, None)[2][2]
    assert plan._tmp is None and first is not second and first.numel() == second.numel() > 0
    g.scratch = Scratch(64 << 20)
    plans = Plans(g)
    count = (KEEP_SCRATCH // 4) // 3 - 10  # direct at 3 ranks: 3 x count floats of TMP, just under 64 KiB
    for i in range(2 * SMALL_KEPT_BYTES // KEEP_SCRATCH):
        _allreduce(plans, count - i).execution(f"op{i}", None, None)
    assert SMALL_KEPT_BYTES - KEEP_SCRATCH < kept(plans) <= SMALL_KEPT_BYTES, kept(plans)
    spent = _allreduce(plans, g.scratch._small_left // 12 + 1)  # a TMP just past what the budget has left
    assert spent.execution("op", None, None)[2][2].data_ptr() == g.scratch.take(1, torch.uint8).data_ptr() \
        and spent._tmp is None, "past the budget, a plan's small scratch is the group's one buffer"
    # the common paths' cache and the argument sets' start again together, the budget with them
    for i in range(PLAN_CACHE):
        plans.keep_common(("form", i), spent)
    assert len(plans.by_args) > 0 and len(plans.common()) == PLAN_CACHE
    plans.keep_common(("form", PLAN_CACHE), spent)
    assert not plans.by_args and list(plans.common().values()) == [spent] and kept(plans) == 0
    fresh = _allreduce(plans, count)
    fresh.execution("op", None, None)
    assert fresh._tmp is not None, "the budget came back with the caches"
    # frame plans: kept with their schedule up to MAX_KEPT_FRAMES frames, cut again past that
    for n, keep in ((MAX_KEPT_FRAMES // 4 * 256, True), (MAX_KEPT_FRAMES * 256, False)):
        sched = build(Spec("allreduce", 0, 2, count=n, order=(0, 1)), "ring")  # 1 KiB frames below: n/256 a step
        plan = frame_plan(sched, 4, 256)
        assert (plan.frames <= MAX_KEPT_FRAMES) is keep and (frame_plan(sched, 4, 256) is plan) is keep
        assert bool(sched.plans) is keep, (n, plan.frames)


def test_no_plan_keeps_small_scratch_with_the_setting_at_0_even_after_the_caches_start_again():
    """NEURON_DIST_SCRATCH_BYTES=0 promises no small scratch kept by any plan. The budget comes
    back whenever the plan caches start again (Scratch.forget_small), and must come back within
    the setting: reset to the full SMALL_KEPT_BYTES instead, every plan made after the first
    restart would keep its scratch again (4 MiB a group) with the setting at 0."""
    g = _collective_group([])
    g.scratch = Scratch(0)
    plans = Plans(g)
    plan = _allreduce(plans, 1000)
    plan.execution("op1", None, None)
    assert plan._tmp is None
    for i in range(PLAN_CACHE + 1):  # past a full cache: both start again, the budget with them
        _allreduce(plans, 2000 + i)
    assert _allreduce(plans, 1000) is not plan, "the caches did not start again"
    for count in (1000, 1001, 5):
        after = _allreduce(plans, count)
        after.execution("op2", None, None)
        assert after._tmp is None, f"a plan made after the caches started again kept {after._tmp.numel()} " \
                                   f"elements of small scratch with NEURON_DIST_SCRATCH_BYTES at 0"
    assert g.scratch._small_left == 0


def test_a_full_argument_set_cache_starts_both_caches_and_the_small_scratch_budget_again():
    """When `get`'s cache of argument sets fills, the common paths' cache (which holds plans
    `get` made) and the small-scratch budget start again with it: emptying only `by_args` left
    the common cache holding its plans and their scratch while the budget stayed spent, so no
    plan made after kept small scratch again (each call's cut from the group's one buffer), and
    the plans of the two caches drifted apart."""
    g = _collective_group([])
    g.scratch = Scratch(64 << 20)
    plans = Plans(g)
    full = g.scratch._small_left
    for i in range(10):  # ~12 KB of small scratch each, kept for the common paths too
        p = _allreduce(plans, 1000 + i)
        p.execution("op", None, None)
        assert p._tmp is not None
        plans.keep_common(("form", i), p)
    assert g.scratch._small_left < full and len(plans.common()) == 10
    g.scratch._small_left = 0  # the budget spent: a new form keeps none
    for i in range(PLAN_CACHE - len(plans.by_args)):  # fills `by_args` exactly
        _allreduce(plans, 100_000 + i)
    assert len(plans.by_args) == PLAN_CACHE and len(plans.common()) == 10
    _allreduce(plans, 5)  # one form more: `get` starts again
    assert len(plans.by_args) == 1, "the argument sets' cache did not start again"
    assert plans.common() == {}, f"the common paths' cache kept {len(plans.common())} plans as `get` started again"
    assert g.scratch._small_left == full, "the small-scratch budget did not come back with the caches"
    fresh = _allreduce(plans, 5)
    fresh.execution("op", None, None)
    assert fresh._tmp is not None, "a plan made after the caches started again kept no small scratch"


def _p2p_group(sent):
    """What a send or receive plan reads of its group (a transport that copies every frame)."""
    g = SimpleNamespace(token=0x5EC12E7, group_id=77, rank=1, size=4, frame_bytes=FRAME, transport=SimpleNamespace(),
                        mailbox=None)
    g.one_frame = lambda count, itemsize: Group.one_frame(g, count, itemsize)
    g.frame_header = lambda *a, **k: Group.frame_header(g, *a, **k)
    g.send_frame = lambda op, peer, header, payload: sent.append(("frame", peer, header, payload))
    g.recv_frame = lambda op, peer, sources, tag, out, dtype: sent.append(("frame in", peer, sources, out))
    g.execution = lambda op, sched, bufs, reduce, dtype, tag, **k: sent.append(("execution", sched, bufs, tag))
    g.barred_for = lambda op: None  # (no receive posted before: an any-source one may take from every peer)
    return g


def test_a_message_that_fits_one_frame_is_planned_as_that_frame_and_a_larger_one_as_a_schedule():
    sent = []
    g = _p2p_group(sent)
    plans = PeerPlans(g)
    one = plans.send(3, 10, torch.float32, 7)
    assert plans.send(3, 10, torch.float32, 7) is one and plans.send(3, 10, torch.float32, 8) is not one
    assert one.desc == "send(40 bytes, to rank 3, tag 7)" and one.nbytes == 40 and one.schedule is None
    assert one.header == Group.frame_header(g, torch.float32, 3, 40, 7)
    many = plans.send(3, FRAME, torch.float32, 7)  # four frames
    assert many.header is None and many.schedule == direct.send(3, FRAME)
    payload = torch.ones(10)
    one.start(payload, None)
    many.start(payload, None)
    assert sent[0] == ("frame", 3, one.header, payload)
    assert sent[1][:2] == ("execution", many.schedule) and sent[1][2][0] is payload and sent[1][3] == 7

    from_any, from_two = plans.recv(None, 10, torch.float32, 7), plans.recv(2, 10, torch.float32, 7)
    assert plans.recv(None, 10, torch.float32, 7) is from_any
    assert from_any.desc == "recv(any source, tag 7, 40 bytes)"
    assert from_two.desc == "recv(40 bytes, from rank 2, tag 7)"
    assert from_any.sources == tuple((p, Group.frame_header(g, torch.float32, p, 40, 7, incoming=True))
                                     for p in (0, 2, 3))
    assert [p for p, _ in from_two.sources] == [2] and from_two.note_sender is None
    op = Op(Kind.P2P, "recv", None)
    op.exe = SimpleNamespace(peer=3)
    from_any.note_sender(op)
    assert op.source_rank == 3, "a one-frame receive from any source learns its sender from the frame"
    out = torch.zeros(10)
    from_two.start(out, op)
    assert sent[-1] == ("frame in", 2, from_two.sources, out)

    large = plans.recv(None, FRAME, torch.float32, 7)
    assert large.sources is None and large.note_sender is None  # a Receive sets the sender itself
    receive = large.start(torch.zeros(FRAME), op)
    assert isinstance(receive, Receive) and receive.peer is None and receive.schedule_for is large.schedule_for
    assert large.schedule_for(2, 5) is large.schedule_for(2, 5) == direct.recv(2, 5)


def _private_torch_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [f"{path.name}:{node.lineno} {n}" for n in names
                  if n.split(".")[0] == "torch" and any(part.startswith("_") for part in n.split("."))]
    return found


def test_only_the_adapter_imports_private_torch_names():
    found = [f for path in sorted(PACKAGE.rglob("*.py")) if path.name != "c10d.py"
             for f in _private_torch_imports(path)]
    assert not found, found
    assert _private_torch_imports(PACKAGE / "c10d.py"), "the check finds nothing where there is something"


def test_debug_reads_no_private_name_of_the_adapter_or_the_group():
    tree = ast.parse((PACKAGE / "debug.py").read_text())
    private = [f"{ast.unparse(n)} (line {n.lineno})" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and n.attr != "_base"]  # (a tensor's view base, torch's documented attribute: not ours)
    assert not private, private


def test_kept_scratch_lies_on_huge_pages_and_goes_back_with_its_group():
    """The group's kept scratch (2 MiB and more) is advised MADV_HUGEPAGE on a 2 MiB boundary:
    torch's allocator advises nothing without THP_MEM_ALLOC_ENABLE, and a root's staged scatter
    blocks, which its peers read with process_vm_readv, took a fifth to a third longer to read
    from small pages here (benchmarks/RESULTS.md, "Forty-eighth pass"). The memory goes back
    with the buffer, and `holds` knows views of it (the buffer starts inside its mapping)."""
    import gc
    from neuron_dist.collectives.scratch import HUGE_PAGE, Scratch, huge_page_bytes

    def mapping(addr):  # this process's /proc/self/smaps entry that holds addr: (start, end, AnonHugePages kB)
        entry = None
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = [lo, hi, 0] if lo <= addr < hi else None
            elif entry is not None and line.startswith("AnonHugePages:"):
                entry[2] = int(line.split()[1])
                return tuple(entry)
        return entry

    s = Scratch(64 << 20)
    t = s.take(3 << 20, torch.float32)  # 12 MiB: a 16 MiB buffer
    t.fill_(1.0)
    assert s.kept_bytes == 16 << 20 and s._buf.data_ptr() % HUGE_PAGE == 0
    assert s.holds(t[5:]) and not s.holds(torch.ones(3))
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    lo, hi, huge_kb = mapping(t.data_ptr())
    if "[never]" in mode:  # (the host gives no huge pages: small ones, as torch.empty's)
        assert huge_kb == 0
    else:
        assert huge_kb >= 8 << 10, f"{huge_kb} kB of the kept scratch on huge pages ({mode.strip()})"
    del t
    s.clear()
    gc.collect()
    assert mapping(lo) is None or mapping(lo)[:2] != (lo, hi), "the scratch's memory was not given back"
    assert Scratch(64 << 20).take(100, torch.float32).numel() == 100  # small: torch.empty
    # sizes that are no whole number of huge pages (a call's own buffer past 32 MiB, a limit set
    # to one) are mapped off a 2 MiB boundary by this kernel: the buffer still starts on one
    # (review AO: a start computed the wrong way round passed the check above, whose mapping the
    # kernel had put on a boundary already)
    for nbytes in ((4 << 20) + 4096, (2 << 20) + 12288):
        b = huge_page_bytes(nbytes)
        assert b.numel() == nbytes and b.data_ptr() % HUGE_PAGE == 0, (nbytes, b.data_ptr() % HUGE_PAGE)


def test_calls_that_differ_only_in_their_detail_get_plans_of_their_own():
    """`detail` (a coalesced call's parts) enters the plan's description and so the checksum its
    frames carry: two calls alike but for it must not share a plan, or the second's errors name
    the first's parts and a mismatch between ranks in it goes unseen."""
    plans = Plans(_collective_group([]))
    args = ("reduce_scatter", Kind.REDUCE_SCATTER, "ring", {"counts": (2, 2, 2)}, torch.float32, "sum", 24)
    a = plans.get(*args, name="reduce_scatter_tensor_coalesced", detail="parts [float32[1], float32[1]]")
    b = plans.get(*args, name="reduce_scatter_tensor_coalesced", detail="parts [float32[2]]")
    assert a is not b and b.desc.endswith("parts [float32[2]])") and a.tag != b.tag, (a.desc, b.desc)


def test_a_builder_registered_later_renews_the_common_paths_plans():
    """A call runs the builder registered when it was made (README): once a builder is
    registered, the common paths' cache starts again as the argument-set cache does, instead of
    running a plan made with the builder it replaced."""
    from neuron_dist.collectives import algorithms
    plans = Plans(_collective_group([]))
    kept = plans.keep_common(("allreduce", torch.float32, 1000, "direct"), _allreduce(plans, 1000))
    assert plans.common() == {("allreduce", torch.float32, 1000, "direct"): kept}
    key = ("allreduce", "direct")
    builder = algorithms.BUILDERS[key]
    algorithms.register("allreduce", "direct", builder)  # the built-in one put back: a new generation
    assert algorithms.BUILDERS[key] is builder
    assert plans.common() == {}, "the common paths still run plans made before the register"
    assert _allreduce(plans, 1000) is not kept
