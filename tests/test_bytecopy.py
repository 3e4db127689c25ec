"""The data path's copy (transport/bytecopy.py): libc memmove for large contiguous byte copies
with one torch thread, `copy_` for everything else, the same result either way."""
import pytest
import torch

from neuron_dist.transport import bytecopy
from neuron_dist.transport.bytecopy import MEMMOVE_FROM, copy_into

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64)


@pytest.fixture
def moved(monkeypatch):
    """Counts the copies that went through memmove; the test runs with one torch thread."""
    calls = []
    real = bytecopy._memmove

    def counted(dst, src, n):
        calls.append(n)
        return real(dst, src, n)
    monkeypatch.setattr(bytecopy, "_memmove", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)


def _values(n, dtype):
    return (torch.arange(n) % 11).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_size_and_dtype_copies_exactly(moved, dtype):
    size = dtype.itemsize
    for n in (0, 1, MEMMOVE_FROM // size - 1, MEMMOVE_FROM // size, MEMMOVE_FROM // size + 7, 3 * MEMMOVE_FROM // size):
        src = _values(n, dtype)
        whole = torch.zeros(n + 10, dtype=dtype)
        dst = whole[3:3 + n]  # a slice at an offset, as the executor's views are
        copy_into(dst, src)
        assert torch.equal(dst, src), (dtype, n)
        assert not whole[:3].any() and not whole[3 + n:].any(), f"{dtype} n={n}: wrote outside the slice"
    assert moved == [MEMMOVE_FROM, MEMMOVE_FROM + 7 * size, 3 * MEMMOVE_FROM], moved


def test_only_plain_large_byte_copies_take_memmove(moved):
    n = MEMMOVE_FROM // 4 * 2
    src = _values(n, torch.float32)
    copy_into(torch.empty(n), src)
    assert moved == [n * 4]
    strided = torch.zeros(2 * n)[::2]
    copy_into(strided, src)  # strided destination
    assert torch.equal(strided, src)
    wider = torch.zeros(n, dtype=torch.float64)
    copy_into(wider, src)  # a conversion, not a byte copy
    assert torch.equal(wider, src.double())
    filled = torch.zeros(n)
    copy_into(filled, torch.tensor(2.0))  # broadcasting
    assert (filled == 2).all()
    copy_into(torch.empty(100), src[:100])  # small
    assert moved == [n * 4], "only the first copy is a plain large byte copy"
    torch.set_num_threads(2)  # torch may split a copy_ over threads: keep it
    out = torch.empty(n)
    copy_into(out, src)
    assert torch.equal(out, src) and moved == [n * 4]


def test_overlapping_ranges_copy_as_memmove_does(moved):
    n = MEMMOVE_FROM  # float32 elements: 4 x the threshold in bytes
    buf = torch.arange(2 * n, dtype=torch.float32)
    want = buf[: n + 5].clone()
    copy_into(buf[5:n + 10], buf[: n + 5])  # forwards, overlapping
    assert torch.equal(buf[5:n + 10], want)
    buf = torch.arange(2 * n, dtype=torch.float32)
    want = buf[5:n + 10].clone()
    copy_into(buf[: n + 5], buf[5:n + 10])  # backwards, overlapping
    assert torch.equal(buf[: n + 5], want)
    assert len(moved) == 2


def test_large_copies_of_other_shapes_or_layouts_are_copy_s(moved):
    """Only a copy of a whole contiguous source into a destination of its size is a byte copy:
    a strided source is copied element by element (memmove of its span gave every second
    element and the bytes between), and a destination of another size fails as copy_ fails
    (memmove filled half of it silently)."""
    n = MEMMOVE_FROM // 4 * 2
    wide = _values(2 * n, torch.float32)
    out = torch.empty(n)
    copy_into(out, wide[::2])  # strided source
    assert torch.equal(out, wide[::2])
    bigger = torch.zeros(2 * n)
    with pytest.raises(RuntimeError):
        copy_into(bigger, wide[:n])
    assert moved == []
