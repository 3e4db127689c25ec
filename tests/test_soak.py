"""Soak: randomized collectives (op, size, dtype, group: world or a pair subgroup, sync/async
mixed) at 3 ranks, every result checked against a reference: 0 wrong elements, resident memory
flat after warm-up, no growth in open fds. Default: 1,500 calls; `pytest -m slow`: 10,000."""
import pytest

RSS_SLACK_KIB = 24 << 10   # allocator noise, not growth per call


def _soak(pools, count):
    res = pools(3).run("cases_faults:soak", timeout=1800, count=count)
    total = sum(r["checked"] for r in res)
    for r, x in enumerate(res):
        assert x["wrong"] == 0, f"rank {r}: {x['wrong']} wrong elements"
        assert x["fd1"] <= x["fd0"], f"rank {r}: open fds grew {x['fd0']} -> {x['fd1']}"
        assert x["rss1"] - x["rss0"] < RSS_SLACK_KIB, f"rank {r}: RSS grew {x['rss0']} -> {x['rss1']} KiB"
    print(f"soak: {count} randomized collectives per rank program, {total} checked results across 3 ranks, "
          f"0 wrong; RSS after warm-up/end (KiB): {[(x['rss0'], x['rss1']) for x in res]}; "
          f"fds: {[(x['fd0'], x['fd1']) for x in res]}")
    return total


def test_soak_short(pools):
    _soak(pools, 1500)


@pytest.mark.slow
def test_soak_10k(pools):
    _soak(pools, 10_000)
