"""Misuse: mismatched calls across ranks end in a clear error on every rank (fast, not at the
time-out), never wrong data or a hang; the fingerprint check (TORCH_DISTRIBUTED_DEBUG=DETAIL /
NEURON_DIST_CHECK=1) catches every mismatch before the call runs and leaves the group usable;
invalid arguments are rejected before a byte moves, with torch's error types."""
import json

import pytest
from pool import free_port, rank_line, run_scripts

TIMEOUT = 10.0
# without the check: what the frames can tell (sizes, dtypes, kinds, reduce ops, roots and the
# algorithm each rank chose via the argument checksum; two ranks that both believe they are a
# broadcast's root meet each other's data where they expect the confirmation receivers send on
# entry; two ranks that each take the other for the root meet each other's confirmation where
# they expect data; in a reduce or a gather each rank's first frame to the next rank carries its
# root).
PLAIN = ["size", "dtype", "dtype_same_bytes", "collective", "op", "algorithm", "alltoall_splits",
         "alltoall_self_splits", "root", "crossed_root", "scatter_root", "crossed_scatter_root", "reduce_root",
         "crossed_reduce_root", "gather_root", "crossed_gather_root", "coalesced_dtype_order", "coalesced_split"]
CHECKED = ["size", "dtype", "collective", "op", "root", "crossed_root", "coalesced_dtype_order", "coalesced_split",
           # shapes and call forms (torch's wrapper compares them under Gloo; the frames cannot see them)
           "shape", "allgather_shape", "broadcast_shape", "complex", "allgather_form", "coalesced_form"]
# alltoall splits: per-rank sizes, caught by the frames (PLAIN)


@pytest.mark.parametrize("case", PLAIN)
def test_mismatch_fails_fast_on_every_rank(pools, case):
    res = pools(2).run("cases_faults:misuse_mismatch", case=case, check=False, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["kind"] != "ok", f"rank {r}: mismatched {case} did not raise"
        assert x["runtime_error"], f"rank {r}: {x['kind']}: {x['msg']}"
        assert x["elapsed"] < TIMEOUT / 2, f"rank {r}: took {x['elapsed']:.1f}s (the time-out, not detection)"
        assert "seq" in x["msg"], x["msg"]
        if case == "alltoall_self_splits":
            assert "sends itself 2 elements but expects 1 from itself" in x["msg"], x["msg"]
        if case == "dtype_same_bytes":
            assert "different arguments (sizes, dtypes," in x["msg"], x["msg"]
        if case == "algorithm":  # the chosen algorithm is in the argument checksum: named, not a size misfit
            assert "different arguments" in x["msg"] and "NEURON_DIST_ALGO" in x["msg"], x["msg"]


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"])
def test_a_mismatch_on_a_common_path_reads_as_on_the_general_path(pools, collective):
    """The adapter's common paths (c10d.py: contiguous tensors, c10d's options object) keep
    their own plan, description included; the frames' checksum leaves the description out, so
    only a failure's message shows it: the same call's must read alike on both paths."""
    said = {}
    for path in ("common", "general"):
        res = pools(2).run("cases_faults:misuse_mismatch", case=f"{path}_{collective}", check=False,
                           timeout_s=TIMEOUT)
        for r, x in enumerate(res):
            assert x["kind"] != "ok" and x["runtime_error"], (path, r, x)
            assert x["elapsed"] < TIMEOUT / 2, f"{path}, rank {r}: took {x['elapsed']:.1f}s (the time-out)"
            assert " (seq " in x["msg"], (path, r, x["msg"])
        said[path] = [x["msg"].split(" (seq ")[0] for x in res]
    assert said["common"] == said["general"], said
    assert all(s.startswith(f"[rank {r}] ") and collective in s for r, s in enumerate(said["common"])), said


def test_ranks_that_disagree_on_the_frame_size_fail_at_group_creation(pools):
    res = pools(2).run("cases_faults:frame_bytes_mismatch")
    for r, x in enumerate(res):
        assert x["kind"] == "GroupError", (r, x)
        assert "disagree on NEURON_DIST_FRAME_BYTES (rank 0: 524288, rank 1: 262144)" in x["msg"], x["msg"]
        assert x["elapsed"] < TIMEOUT / 2, f"rank {r}: took {x['elapsed']:.1f}s"
        assert x["usable"], f"rank {r}: a group made alike afterwards did not work"


def test_reduce_roots_disagreeing_at_three_ranks_fail_fast(pools):
    """Ranks 0 and 1 reduce to rank 0, rank 2 to rank 1: every rank waited for the time-out
    before each rank's first frame to the next carried its root. Now ranks 2 and 0 (whose
    predecessors hold another root) fail at once; rank 1 has sent its part to the root it
    believes in and may return before the abort reaches it, as a broadcast receiver whose root
    did send to it does (README, Known limits)."""
    res = pools(3).run("cases_faults:misuse_mismatch", case="reduce_root_third", check=False, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["elapsed"] < TIMEOUT / 2, f"rank {r}: took {x['elapsed']:.1f}s (the time-out, not detection)"
        if r != 1:
            assert x["kind"] != "ok" and x["runtime_error"], (r, x)
            assert "reduce" in x["msg"] and "seq" in x["msg"], x["msg"]


def test_reduce_scatter_blocks_disagreeing_at_three_ranks_fail_fast(pools):
    """List-form reduce_scatter with a block size per rank; rank 2 swaps blocks 0 and 1. Rank 2's
    own block agrees with its peers', so it received exactly what it expected and returned
    while ranks 0 and 1 failed: the block sizes are now in the argument checksum."""
    res = pools(3).run("cases_faults:misuse_mismatch", case="reduce_scatter_blocks", check=False, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["kind"] != "ok" and x["runtime_error"], (r, x)
        assert x["elapsed"] < TIMEOUT / 2, f"rank {r}: took {x['elapsed']:.1f}s (the time-out, not detection)"
        assert "reduce_scatter" in x["msg"] and "different arguments" in x["msg"], x["msg"]


@pytest.mark.parametrize("case", CHECKED)
def test_fingerprint_check_catches_mismatch(pools, case):
    res = pools(2).run("cases_faults:misuse_mismatch", case=case, check=True, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["kind"] != "ok", f"rank {r}: mismatched {case} did not raise"
        assert "Detected mismatch between collectives" in x["msg"], x["msg"]
        assert "rank 0" in x["msg"] and "rank 1" in x["msg"], x["msg"]
        assert x["usable"], f"rank {r}: the group was not usable after the check rejected the call"


def test_fingerprint_check_names_the_shapes_that_differ(pools):
    """A (2, 3) and a (3, 2) tensor of one dtype move the same bytes: the check compared no
    shapes and the call ran (an all-gather handed each rank the other's rows in the wrong
    layout); a complex64[2] read as the float32[2, 2] torch hands over, against a float32[4]."""
    for case, sides in (("shape", ("allreduce of float32[2, 3]", "allreduce of float32[3, 2]")),
                        ("allgather_shape", ("allgather of float32[2, 3]", "allgather of float32[3, 2]")),
                        ("complex", ("allreduce of complex64[2]", "allreduce of float32[4]"))):
        res = pools(2).run("cases_faults:misuse_mismatch", case=case, check=True, timeout_s=TIMEOUT)
        for x in res:
            assert "Detected mismatch" in x["msg"] and x["usable"], (case, x)
            assert "rank 0 called" in x["msg"] and all(side in x["msg"] for side in sides), (case, x["msg"])


def test_fingerprint_check_passes_shapes_that_may_differ(pools):
    assert all(pools(2).run("cases_faults:check_passes_shapes_that_may_differ"))
    assert all(pools(3).run("cases_faults:check_passes_shapes_that_may_differ"))


def test_torch_set_debug_level_detail_turns_the_check_on_for_groups_made_after(pools):
    """dist.set_debug_level(dist.DebugLevel.DETAIL) did not turn the check on (only the
    environment was read, once per process): a group made under it is checked, one made after
    the level is set back is not."""
    for r, (checked, plain) in enumerate(pools(2).run("cases_faults:torch_debug_level")):
        assert checked.startswith(f"[rank {r}] Detected mismatch between collectives"), checked
        assert plain == "ran", plain


@pytest.mark.parametrize("case", ["op", "reduce_root_third"])  # rank 0 differs; rank 2 does
def test_fingerprint_check_three_ranks(pools, case):
    res = pools(3).run("cases_faults:misuse_mismatch", case=case, check=True, timeout_s=TIMEOUT)
    assert all("Detected mismatch" in x["msg"] and x["usable"] for x in res), res


def test_fingerprint_check_names_global_ranks_in_a_subgroup(pools):
    """In a subgroup of global ranks [1, 2] the check's message gave group ranks 0 and 1 with
    nothing to say so; it now gives each with its global rank."""
    res = pools(3).run("cases_faults:misuse_mismatch", case="op", check=True, members=[1, 2], timeout_s=TIMEOUT)
    assert res[0] is None, res
    for g, x in ((1, res[1]), (2, res[2])):
        assert "Detected mismatch" in x["msg"] and x["usable"], x
        assert f"[rank {g - 1} (global rank {g})]" in x["msg"], x["msg"]
        assert "rank 0 (global rank 1) called" in x["msg"] and "rank 1 (global rank 2) called" in x["msg"], x["msg"]


def test_invalid_arguments_rejected_before_any_byte_moves(pools):
    res = pools(2).run("cases_faults:misuse_invalid")
    assert all(len(x) == 42 for x in res), res
    for r, seen in enumerate(res):  # the backend's own errors name the rank and the call
        for what, _, msg in seen:
            if "tag" in what or "reduce_scatter list" in what or "DTensor" in what or "CSR" in what or "nested" in what:
                assert msg.startswith(f"[rank {r}] ") and msg.split("] ")[1].split(":")[0] in what, (what, msg)
            if what in ("BAND on float32", "AVG on bool") or "BAND on the float32" in what:
                call = "reduce_scatter_tensor_coalesced" if "coalesced" in what else "allreduce"
                assert msg.startswith(f"[rank {r}] {call}: ReduceOp."), (what, msg)



MEMBERSHIP_MODES = ["subset", "collide", "collide-late", "absent"]


@pytest.fixture(scope="module")
def membership_jobs():
    """Each membership mode (each once a 3-rank job of its own), run in turn by one 3-rank job on one world group
    (scripts/membership_modes.py): {mode: each rank's JSON line}, every rank's checked as each job
    of its own was (it ended well, its world group still worked, the mode started no thread
    that outlived it and left no shared memory), and nothing left once the world is destroyed."""
    port = free_port()
    res = {mode: [] for mode in MEMBERSHIP_MODES}
    for code, out in run_scripts("membership_modes.py", [[r, 3, port, *MEMBERSHIP_MODES] for r in range(3)]):
        assert code == 0, out[-3000:]
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [x["mode"] for x in lines] == MEMBERSHIP_MODES + ["end"], out[-3000:]
        assert lines[-1]["shm_left"] == [], lines[-1]
        for x in lines[:-1]:
            res[x["mode"]].append(x)
    return res


def _membership_job(jobs: dict, mode: str) -> list[dict]:
    res = jobs[mode]
    for x in res:
        assert x["world_ok"], x
        assert x["threads_after"] == x["threads_before"], x
        assert x["shm_left"] == [], x
    return res


def test_group_membership_mismatch_fails_on_every_rank(membership_jobs):
    """Ranks that call new_group with different member lists get a clear error naming who thinks
    what, within seconds; the world group keeps working and the failed group leaves nothing."""
    for r, x in enumerate(_membership_job(membership_jobs, "subset")):
        assert x["kind"] == "GroupError", x
        assert f"[rank {r}]" in x["msg"] and "disagree on the group's members" in x["msg"], x["msg"]
        mine = "[0, 1]" if r == 0 else "[0, 1, 2]"
        assert f"global rank {r}, this process: {mine}" in x["msg"], x["msg"]
        assert ("global rank 1: [0, 1, 2]" if r == 0 else "global rank 0: [0, 1]") in x["msg"], x["msg"]
        assert x["elapsed"] < TIMEOUT / 2, x


@pytest.mark.parametrize("mode", ["collide", "collide-late"])
def test_group_membership_collision_never_mixes_data(membership_jobs, mode):
    """Rank 0 calls new_group([0, 2]) while ranks 1 and 2 call new_group([1, 2]): ranks 0 and 1
    both claim group rank 0 of a group with the same name. Rank 0 fails at once, naming the
    disagreement (rank 2 disagrees with it); ranks 1 and 2 agree with each other and form their
    group without ever reading rank 0's keys: their all-reduce is right. Also where rank 0 comes
    once the others have formed their group (their member lists then still there to read: a
    version that deleted them had rank 0 wait out the time-out, review AA)."""
    res = _membership_job(membership_jobs, mode)
    x = res[0]
    assert x["kind"] == "GroupError" and "disagree on the group's members" in x["msg"], x
    assert "global rank 0, this process: [0, 2]; global rank 2: [1, 2]" in x["msg"], x["msg"]
    assert x["elapsed"] < TIMEOUT / 2, x
    for x in res[1:]:
        assert x["kind"] == "ok" and x["msg"] == [5.0] * 4, x   # (1 + 1) + (2 + 1)


def test_group_member_that_never_joins_is_named_at_the_time_out(membership_jobs):
    """Rank 0 calls new_group([0, 1]); ranks 1 and 2 call new_group([0, 2]), so rank 1 never joins
    rank 0's group: rank 0 fails at the group's 3 s time-out naming global rank 1, rank 2 fails
    at once (rank 0 disagrees with it), rank 1 is no member; the world group still works."""
    res = _membership_job(membership_jobs, "absent")
    x = res[0]
    assert x["kind"] == "GroupError" and "global ranks [1] did not join within 3s" in x["msg"], x
    assert x["msg"].endswith("every process must call new_group with the same ranks"), x
    assert 2.5 < x["elapsed"] < 3 + TIMEOUT / 2, x
    assert res[1]["kind"] == "not a member", res[1]
    x = res[2]
    assert x["kind"] == "GroupError" and "global rank 2, this process: [0, 2]; global rank 0: [0, 1]" in x["msg"], x


def test_threads_of_a_rank_making_one_subgroup_leave_one_group_and_clear_errors(pools):
    """Three threads of ranks 0 and 1 call new_group(use_local_synchronization=True) with the
    same ranks at once, which torch names alike (under Gloo one group forms per rank, torch
    refuses another and the third often hangs in new_group): every call hung or failed at 1-3
    times the time-out. One group forms per rank, with the last rank's one call; the other calls
    fail at once, naming the rank, the group and why."""
    res = pools(3).run("cases_faults:threads_making_one_subgroup", local=True, timeout_s=TIMEOUT, timeout=120)
    for r, calls in enumerate(res):
        formed = [x for x in calls if x["kind"] == "ok"]
        assert len(formed) == 1 and formed[0]["sum"] == [3.0, 3.0], (r, calls)
        assert formed[0]["elapsed"] < TIMEOUT, (r, calls)
        refused = [x for x in calls if x["kind"] != "ok"]
        assert len(refused) == (2 if r < 2 else 0), (r, calls)
        for x in refused:
            assert x["kind"] == "GroupError" and x["msg"].startswith(f"[rank {r}] group '"), (r, x)
            assert "another thread of this process is forming a group of this name" in x["msg"], x["msg"]
            assert x["elapsed"] < TIMEOUT / 2, (r, x)


def test_threads_of_a_rank_making_subgroups_of_other_names_each_form_one(pools):
    """Three threads of every rank call new_group with the same ranks at once, without
    use_local_synchronization: torch names the three groups apart, and each forms. Their store
    waits shared one connection, each held up the others', and they failed at 2-4 times the
    time-out."""
    res = pools(3).run("cases_faults:threads_making_one_subgroup", local=False, timeout_s=TIMEOUT, timeout=120)
    for r, calls in enumerate(res):
        assert [x["kind"] for x in calls] == ["ok"] * 3, (r, calls)
        assert all(x["sum"] == [3.0, 3.0] and x["elapsed"] < TIMEOUT for x in calls), (r, calls)


PLACEMENT = [(0, "NEURON_RT_VISIBLE_CORES=abc"), (2, "NEURON_RT_VISIBLE_CORES=abc"),
             (1, "NEURON_DIST_BIND_ADDR=0.0.0.0"), (2, "NEURON_DIST_FRAME_BYTES=abc"),
             (1, "NEURON_DIST_SHM_SLOTS=x"), (2, "NEURON_DIST_TRANSPORT=tcp"),
             (1, "NEURON_DIST_CHECK=maybe"), (2, "NEURON_DIST_ALGO=allreduce:bogus"),
             (1, "NEURON_DIST_TUNING=fast")]
ALGO_SETTINGS = ["NEURON_DIST_ALGO=allreduce:ring", "NEURON_DIST_TUNING=host"]


@pytest.fixture(scope="module")
def set_up_cases(tmp_path_factory):
    """The group set-ups that fail by design, each once, all in one job of four processes that
    take them in turn (scripts/set_up_cases.py: starting three fresh ranks per case cost most
    of this file's time, in torch's import). Each case has its own rendezvous port, its ranks
    start it together and its rank 0's store is gone once it is over, as with processes of its
    own. Returns {case id: [rank 0's output of the case, rank 1's, ...]}."""
    from neuron_dist.topology import get_instance
    where = tmp_path_factory.mktemp("set_up_cases")
    a = dict(get_instance("trn1.32xlarge").to_dict(), name="custom-t6d")
    b = dict(a, graph="ring", torus_dims=[16], torus_wrap=[True])
    (where / "a.json").write_text(json.dumps(a))
    (where / "b.json").write_text(json.dumps(b))
    three = {"0": 0, "1": 1, "2": 2}
    cases = [dict(id=f"placement {bad} {setting}", kind="placement", bad=bad, setting=setting)
             for bad, setting in PLACEMENT + [(1, "NEURON_DIST_TRANSPORT=zmq")] + [(1, s) for s in ALGO_SETTINGS]]
    cases.append(dict(id="instance", kind="placement", bad=1, setting=f"NEURON_DIST_INSTANCE={where / 'b.json'}",
                      env={"NEURON_DIST_INSTANCE": str(where / "a.json")}))
    for c in cases:
        c.update(ranks=three, world=3, timeout=60)
    cases += [dict(id="unroutable", kind="unroutable", ranks={"0": 0, "1": 1}, world=2, timeout=60),
              dict(id="two_hosts", kind="two_hosts", ranks={"0": 0, "1": 1, "2": 2, "3": 3}, world=4, timeout=20),
              # last: its rank 1 exits in it
              dict(id="dies", kind="dies", ranks=three, world=3, timeout=4)]
    ports = set()
    for c in cases:
        while (port := free_port()) in ports:
            pass
        ports.add(port)
        c["port"] = port
    (where / "spec.json").write_text(json.dumps(cases))
    outs = run_scripts("set_up_cases.py", [[p, where / "spec.json"] for p in range(4)], timeout=240)
    said = {}
    for c in cases:
        said[c["id"]] = by_rank = [None] * c["world"]
        for p, r in c["ranks"].items():
            out = outs[int(p)][1]
            start = out.find(f"@@case {c['id']}\n")
            assert start >= 0, f"process {p} did not reach case {c['id']}:\n{out[-3000:]}"
            section = out[start:].split("\n@@case ", 1)[0]
            by_rank[r] = section
    return said


def _store_gone(out: str) -> None:
    """Rank 0's process hosts the store: once its case is over, nothing may listen on the case's
    port (the store ended with the rank's process when each case had processes of its own)."""
    assert "@@store closed" in out, out[-3000:]


@pytest.mark.parametrize("bad, setting", PLACEMENT)
def test_a_placement_error_on_one_rank_fails_every_rank_at_once(set_up_cases, bad, setting):
    """One rank's placement setting is wrong (NEURON_RT_VISIBLE_CORES=abc). That rank's clear
    error reaches every rank within seconds: with the bad rank 0 (the store's host), the others
    used to get 'Connection reset by peer' from the store; with a bad rank 2, ranks 0 and 1
    waited for the whole group time-out (so did the others of a rank whose NEURON_DIST_BIND_ADDR
    could never work, and until the review of stop 48 those of a rank with a bad frame size,
    shared-memory setting, forced transport or NEURON_DIST_CHECK: only placement was published;
    a bad algorithm or tuning setting was read only at a collective, where it raised on its own
    rank, its peers waiting for it until the time-out)."""
    outs = set_up_cases[f"placement {bad} {setting}"]
    _store_gone(outs[0])
    for r, out in enumerate(outs):
        line = rank_line(out, r)
        var, value = setting.split("=")
        assert f"{var}={value!r}" in line, line
        if r != bad:
            assert f"rank {bad} cannot take part" in line, line
        assert float(line.split(" after ")[1].split("s:")[0]) < 20, line


def test_ranks_that_force_different_transports_fail_at_group_creation(set_up_cases):
    """Rank 1 alone forces zmq: it waited for its peers' zmq records and they for its shared-memory
    segment, each until the group's time-out, and neither error named the setting."""
    outs = set_up_cases["placement 1 NEURON_DIST_TRANSPORT=zmq"]
    _store_gone(outs[0])
    for r, out in enumerate(outs):
        line = rank_line(out, r)
        assert "disagree on NEURON_DIST_TRANSPORT (rank 0: unset, rank 1: zmq, rank 2: unset)" in line, line
        assert float(line.split(" after ")[1].split("s:")[0]) < 20, line


def test_a_rank_that_cannot_choose_its_address_fails_its_peers_at_once(set_up_cases):
    """In a group that spans hosts, rank 1 cannot resolve MASTER_ADDR, so it cannot choose the
    interface to listen on and fails at once. Rank 0 used to wait the whole group time-out for
    rank 1's transport keys, and then reported a time-out; it now fails within seconds with
    rank 1's cause."""
    outs = set_up_cases["unroutable"]
    _store_gone(outs[0])
    lines = [rank_line(out, r) for r, out in enumerate(outs)]
    for line in lines:
        assert "'no-such-host.invalid'" in line and "MASTER_ADDR" in line, lines
        assert float(line.split(" after ")[1].split("s:")[0]) < 20, lines
    assert "no connection with rank 1" in lines[0], lines


def test_ranks_that_describe_one_instance_name_differently_fail_at_group_creation(set_up_cases):
    """Rank 1 loads an instance description under the name the others load theirs (a file
    edited on one node): the group compared only the name, each side built its own ring order,
    and the first collective waited out the time-out naming no cause (a review's probe). The
    descriptions' digests now go with the placement, and differing ones fail the group at once."""
    outs = set_up_cases["instance"]
    _store_gone(outs[0])
    for r, out in enumerate(outs):
        line = rank_line(out, r)
        assert "disagree on the instance description" in line and "rank 1: custom-t6d " in line, line
        assert float(line.split(" after ")[1].split("s:")[0]) < 20, line


@pytest.mark.parametrize("setting", ALGO_SETTINGS)
def test_ranks_that_choose_algorithms_differently_fail_at_group_creation(set_up_cases, setting):
    """One host's environment forces a ring, another's a hierarchical grid (a review's probe on
    two namespaced hosts): the two send to disjoint peers, so no frame's checksum met the other
    and every rank waited out the time-out naming no cause. The settings that decide each call's
    algorithm are now compared when the group is made."""
    var, value = setting.split("=")
    outs = set_up_cases[f"placement 1 {setting}"]
    _store_gone(outs[0])
    for r, out in enumerate(outs):
        line = rank_line(out, r)
        assert f"the ranks disagree on {var} (" in line and f"rank 1: {value}" in line, line
        assert float(line.split(" after ")[1].split("s:")[0]) < 20, line


def test_a_member_that_dies_in_set_up_is_a_clear_error(set_up_cases):
    """A member that died after the members met and before it published its set-up (a host
    killed while the others made a group): its peers failed with the store's bare "wait timeout
    after 4000ms, keys: /.../peer/1" (a review's probe on namespaced hosts)."""
    outs = set_up_cases["dies"]
    for r in (0, 2):
        line = rank_line(outs[r], r)
        assert "GroupError" in line and "not every one published its set-up within 4s" in line, line


def test_ranks_on_two_hosts_given_one_node_number_are_told_so(set_up_cases):
    """A launcher that gives ranks on two hosts one node number (GROUP_RANK=0 everywhere): the
    group failed on every rank with "ranks 0 and 2 both use core 0 on node 0; more ranks than
    cores or overlapping NEURON_RT_VISIBLE_CORES", naming neither the hosts nor the variable
    (a review's probe on namespaced hosts)."""
    outs = set_up_cases["two_hosts"]
    _store_gone(outs[0])
    for r, out in enumerate(outs):
        line = rank_line(out, r)
        assert "ranks 0 and 2 run on different hosts" in line and "both on node 0 by the launcher's node number" \
            in line and "GROUP_RANK" in line, line


def test_reduce_ops_of_complex_tensors_are_decided_before_any_byte_moves():
    """torch hands the backend complex tensors unviewed in reduce_scatter_tensor and reduce. MIN,
    MAX and the bitwise ops have no meaning there and must be refused by the argument check
    (ValueError naming the op and dtype); without it torch.minimum raised mid-call, failing the
    group ("minimum not implemented for complex tensors", then "the group is unusable"; review
    AR: O09). SUM, AVG, PREMUL_SUM and PRODUCT are reduced (review AR: O08 refused PREMUL_SUM,
    which reduce_scatter_tensor of complex tensors ran: 1.5+3j from 1+2j and 2+4j at 0.5)."""
    import torch

    from neuron_dist.collectives import reduce_ops
    for dtype in (torch.complex64, torch.complex128):
        for op in ("min", "max", "band", "bor", "bxor"):
            with pytest.raises(ValueError, match=f"ReduceOp.{op.upper()} is not supported for {dtype}"):
                reduce_ops.check(op, dtype)
        for op in ("sum", "avg", "premul_sum", "product"):
            reduce_ops.check(op, dtype)
            a, b = torch.tensor([1 + 2j], dtype=dtype), torch.tensor([3 - 1j], dtype=dtype)
            out = torch.empty_like(a)
            reduce_ops.reducer(op, dtype)(out, a, b)
            assert out.item() == ((1 + 2j) * (3 - 1j) if op == "product" else 4 + 1j), (op, dtype, out)
