"""repack: aligned_copy against the NumPy reference, bit for bit (a copy must not change a value).

CPU: the NumPy path and torch CPU tensors. GPU: the pad_rows kernel (2-byte dtypes) on odd row
lengths, misaligned starts, transposed views, batches, many rows, CuPy arrays, and the library
fallback for layouts the kernel does not take."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukit.ops import repack

torch = pytest.importorskip("torch")


def _check(y, x):
    """y (torch CUDA or CuPy): the same shape and bits as x, rows 16-byte aligned."""
    assert tuple(y.shape) == tuple(x.shape)
    if hasattr(y, "data_ptr"):
        bits = (lambda t: t.view(torch.int16)) if y.element_size() == 2 else (lambda t: t)
        assert torch.equal(bits(y), bits(x))
        assert y.data_ptr() % 16 == 0 and (y.stride(-2) * y.element_size()) % 16 == 0
        return
    import cupy

    assert cupy.array_equal(y.view(cupy.uint16), x.view(cupy.uint16))
    assert y.data.ptr % 16 == 0 and y.strides[-2] % 16 == 0


@given(
    lead=st.lists(st.integers(0, 3), max_size=2),
    r=st.integers(0, 9),
    c=st.integers(0, 21),
    dtype=st.sampled_from(["float16", "float32", "float64", "int32"]),
)
def test_numpy_matches_reference(lead, r, c, dtype):
    x = np.arange(int(np.prod([*lead, r, c])), dtype=dtype).reshape(*lead, r, c)
    y = repack.aligned_copy(x)
    assert np.array_equal(y, x) and y.dtype == x.dtype
    assert repack.reference_numpy(x).shape[-1] == repack.padded_width(c, x.dtype.itemsize)
    if r > 1 and c > 0:
        assert y.strides[-2] % 16 == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_cpu_views(dtype):
    base = torch.randn(3, 7, 13).to(dtype)
    for x in (base, base.mT, base[:, 1:, 2:], base[1]):
        y = repack.aligned_copy(x)
        assert torch.equal(y, x) and y.dtype == x.dtype and y.device == x.device
        assert (y.stride(-2) * y.element_size()) % 16 == 0


def test_bad_input():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        repack.aligned_copy(np.zeros(5))
    with pytest.raises(TypeError):
        repack.aligned_copy([[1.0, 2.0]])


def test_padded_width():
    assert [repack.padded_width(c, 2) for c in (0, 1, 8, 9, 4093)] == [0, 8, 8, 16, 4096]
    assert repack.padded_width(5, 4) == 8 and repack.padded_width(3, 8) == 4


# ------------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("r", "c"), [(1, 1), (5, 7), (33, 15), (17, 16), (130, 4093), (4, 40000), (70000, 3)])
def test_gpu_kernel_bitwise(dtype, r, c, monkeypatch):
    """Odd row lengths (every start alignment), long rows, more rows than one grid dimension
    holds; the kernel path is taken (not the fallback)."""
    calls = []
    real = repack._kernel_copy
    monkeypatch.setattr(repack, "_kernel_copy", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(r, c, device="cuda").to(dtype)
    y = repack.aligned_copy(x)
    torch.cuda.synchronize()
    _check(y, x)
    assert calls and torch.equal(y, x)


@gpu
def test_gpu_misaligned_start_batches_and_views():
    buf = torch.randn(3 * 9 * 11 + 1, device="cuda").to(torch.bfloat16)
    x = buf[1:].view(3, 9, 11)  # starts 2 bytes past an aligned address; row stride 22 bytes
    for v in (x, x[:, 2:, 1:], x.mT, x[1]):
        y = repack.aligned_copy(v)
        torch.cuda.synchronize()
        _check(y, v)
    # batch dimensions that do not collapse into one stride: the library fallback
    p = torch.randn(4, 5, 6, 7, device="cuda").to(torch.float16).permute(1, 0, 2, 3)
    _check(repack.aligned_copy(p), p)
    z = torch.empty(0, 5, device="cuda", dtype=torch.float16)
    assert repack.aligned_copy(z).shape == (0, 5)


@gpu
def test_gpu_cupy_and_float32():
    cp = pytest.importorskip("cupy")
    x = cp.asarray(np.random.default_rng(0).standard_normal((6, 1031)).astype(np.float16))
    y = repack.aligned_copy(x)
    assert isinstance(y, cp.ndarray)
    _check(y, x)
    f = torch.randn(5, 9, device="cuda")
    assert torch.equal(repack.aligned_copy(f), f)
