"""Misuse: mismatched calls across ranks end in a clear error on every rank (fast, not at the
time-out), never wrong data or a hang; the fingerprint check (TORCH_DISTRIBUTED_DEBUG=DETAIL /
NEURON_DIST_CHECK=1) catches every mismatch before the call runs and leaves the group usable;
invalid arguments are rejected before a byte moves, with torch's error types."""
import pytest

TIMEOUT = 10.0
# without the check: what the frames can tell (sizes, dtypes, kinds, reduce ops and roots via the
# argument checksum; two ranks that both believe they are a broadcast's root meet each other's
# data where they expect the children's confirmation).
PLAIN = ["size", "dtype", "collective", "op", "alltoall_splits", "root", "scatter_root"]
CHECKED = ["size", "dtype", "collective", "op", "root"]  # alltoall splits: per-rank sizes, caught by the frames (PLAIN)


@pytest.mark.parametrize("case", PLAIN)
def test_mismatch_fails_fast_on_every_rank(pools, case):
    res = pools(2).run("cases_faults:misuse_mismatch", case=case, check=False, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["kind"] != "ok", f"rank {r}: mismatched {case} did not raise"
        assert x["runtime_error"], f"rank {r}: {x['kind']}: {x['msg']}"
        assert x["elapsed"] < TIMEOUT / 2, f"rank {r}: took {x['elapsed']:.1f}s (the time-out, not detection)"
        assert "seq" in x["msg"], x["msg"]


@pytest.mark.parametrize("case", CHECKED)
def test_fingerprint_check_catches_mismatch(pools, case):
    res = pools(2).run("cases_faults:misuse_mismatch", case=case, check=True, timeout_s=TIMEOUT)
    for r, x in enumerate(res):
        assert x["kind"] != "ok", f"rank {r}: mismatched {case} did not raise"
        assert "Detected mismatch between collectives" in x["msg"], x["msg"]
        assert "rank 0" in x["msg"] and "rank 1" in x["msg"], x["msg"]
        assert x["usable"], f"rank {r}: the group was not usable after the check rejected the call"


def test_fingerprint_check_three_ranks(pools):
    res = pools(3).run("cases_faults:misuse_mismatch", case="op", check=True, timeout_s=TIMEOUT)
    assert all("Detected mismatch" in x["msg"] and x["usable"] for x in res), res


def test_invalid_arguments_rejected_before_any_byte_moves(pools):
    res = pools(2).run("cases_faults:misuse_invalid")
    assert all(len(x) == 13 for x in res), res
