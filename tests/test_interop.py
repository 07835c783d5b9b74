"""Interop: the dtype table, array kinds, zero-copy views both ways, streams, the shared allocator."""

from __future__ import annotations

import numpy as np
import pytest

import cukit
from cukit import interop

torch = pytest.importorskip("torch")


def test_dtype_table_maps_every_library_to_one_row():
    for name, d in interop.DTYPES.items():
        assert interop.as_dtype(name) is d
        assert interop.as_dtype(getattr(torch, name)) is d
        if name != "bfloat16":
            assert interop.as_dtype(np.dtype(name)) is d
    assert interop.as_dtype(torch.bfloat16).ctype == "__nv_bfloat16"
    assert interop.as_dtype(np.float16).ctype == "__half"
    assert interop.as_dtype("int64").ctype == "long long"
    assert {d.itemsize for d in interop.DTYPES.values()} == {1, 2, 4, 8}
    assert interop.torch_dtype("bfloat16") is torch.bfloat16


def test_unsupported_dtypes_raise_type_error():
    with pytest.raises(TypeError, match="complex64 is not supported"):
        interop.as_dtype(np.complex64)
    with pytest.raises(TypeError, match="not supported"):
        interop.as_dtype(torch.uint8)


def test_array_kind_and_device():
    assert interop.array_kind(np.zeros(2)) == "numpy"
    assert interop.array_kind(torch.zeros(2)) == "torch"
    assert interop.device_of(torch.zeros(2)) is None
    with pytest.raises(
        interop.NotAnArrayError, match=r"x must be a numpy\.ndarray, cupy\.ndarray or torch\.Tensor; got list"
    ):
        interop.array_kind([1.0, 2.0])


def test_array_likes_convert_as_numpy_asarray_does_in_the_first_arrays_library():
    assert [a.dtype for a in interop.as_arrays("f", [("a", [1.0]), ("b", [1]), ("c", [True]), ("d", 2.5)])] == [
        np.float64, np.int64, np.bool_, np.float64]
    t = torch.zeros(2, dtype=torch.float16)
    a, b, c = interop.as_arrays("f", [("a", [1.0, 2.0]), ("b", t), ("c", (1, 2))])
    assert b is t and isinstance(a, torch.Tensor) and a.dtype == torch.float64 and c.dtype == torch.int64
    arr = np.zeros(2, np.float32)
    x, y = interop.as_arrays("f", [("x", arr), ("y", [1.0, 2.0])])
    assert x is arr and isinstance(y, np.ndarray) and y.dtype == np.float64
    with pytest.raises(TypeError, match=r"^f: y must be an array-like convertible to a numeric array; got NoneType$"):
        interop.as_arrays("f", [("x", arr), ("y", None)])
    assert interop.is_array(arr) and interop.is_array(t) and not interop.is_array([1.0])
    assert interop.dtype_name(t) == "float16" and interop.dtype_name(arr) == "float32"


def test_asarray_rejects_host_memory_with_a_clear_error():
    with pytest.raises(TypeError, match="not a CUDA device"):
        cukit.asarray(torch.zeros(3))
    with pytest.raises(TypeError, match="host memory"):
        cukit.asarray(np.zeros(3))


def test_to_torch_is_zero_copy_and_refuses_negative_strides():
    a = np.arange(6, dtype=np.float32)
    t = cukit.to_torch(a)
    assert t.data_ptr() == a.ctypes.data
    a[0] = 42.0
    assert t[0].item() == 42.0
    with pytest.raises(ValueError, match="negative strides"):
        cukit.to_torch(a[::-1])


def test_is_available_and_device_info_without_gpu():
    info = cukit.device_info()
    assert info["available"] is cukit.is_available()
    if not info["available"]:
        assert "reason" in info


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_asarray_views_a_torch_tensor_with_zero_copy():
    import cupy

    t = torch.arange(10, dtype=torch.float32, device="cuda")
    a = cukit.asarray(t)
    assert isinstance(a, cupy.ndarray) and a.data.ptr == t.data_ptr()
    a[3] = -1.0  # a write through CuPy is seen by torch
    assert t[3].item() == -1.0
    t[4] = -2.0
    assert float(a[4]) == -2.0
    back = cukit.to_torch(a)
    assert back.data_ptr() == t.data_ptr()


@pytest.mark.gpu
def test_asarray_of_awkward_tensors():
    import cupy

    # requires_grad: detached view, same memory
    w = torch.ones(4, device="cuda", requires_grad=True)
    assert cukit.asarray(w).data.ptr == w.data_ptr()
    # non-contiguous view: strides carried over, no copy
    m = torch.arange(12.0, device="cuda").reshape(3, 4).t()
    am = cukit.asarray(m)
    assert am.data.ptr == m.data_ptr() and not am.flags.c_contiguous
    np.testing.assert_array_equal(cupy.asnumpy(am), m.cpu().numpy())
    # size 0
    z = torch.empty(0, 5, device="cuda")
    assert cukit.asarray(z).shape == (0, 5)
    # bfloat16 goes through DLPack (CuPy's __cuda_array_interface__ path would give |V2)
    b = torch.randn(7, device="cuda").to(torch.bfloat16)
    ab = cukit.asarray(b)
    assert ab.dtype.name == "bfloat16" and ab.data.ptr == b.data_ptr()
    b2 = cukit.to_torch(ab)
    assert b2.dtype == torch.bfloat16 and b2.data_ptr() == b.data_ptr()


@pytest.mark.gpu
def test_to_torch_of_cupy_arrays():
    import cupy

    a = cupy.arange(8, dtype=cupy.float32)
    t = cukit.to_torch(a)
    assert t.is_cuda and t.data_ptr() == a.data.ptr
    t[0] = 5.0
    assert float(a[0]) == 5.0
    with pytest.raises(ValueError, match="negative strides"):
        cukit.to_torch(a[::-1])
    s = cukit.to_torch(a[::2])  # positive strides are fine
    assert s.stride() == (2,) and s.data_ptr() == a.data.ptr


@pytest.mark.gpu
def test_torch_allocator_makes_one_pool():
    import cupy

    if not torch.cuda.is_available():
        pytest.skip("torch CUDA")
    cukit.use_torch_allocator()
    try:
        before = torch.cuda.memory_allocated()
        a = cupy.empty(64 * 2**20, dtype=cupy.uint8)
        assert torch.cuda.memory_allocated() >= before + 64 * 2**20
        del a
        assert torch.cuda.memory_allocated() == before
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@pytest.mark.gpu
def test_device_info_on_gpu():
    info = cukit.device_info()
    assert info["available"] and info["sm_count"] > 0 and info["memory_total"] > info["memory_free"] > 0
    assert "torch_allocated" in info


def test_element_strides():
    import numpy as np

    from cukit.interop import element_strides

    x = np.zeros((3, 4), np.float32)
    assert element_strides(x) == (4, 1) and element_strides(x.T) == (1, 4)
    assert element_strides(x[:, ::-1]) is None  # negative stride
    assert element_strides(np.zeros(4, "f4,i1")["f0"]) is None  # 5-byte stride, 4-byte elements
    torch = pytest.importorskip("torch")
    assert element_strides(torch.zeros(3, 4).mT) == (1, 4)


def test_loaded_modules_are_cached_outside_sys_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.compile traces array_kind inside the ops' validation: it must read interop's own cache,
    # never the interpreter-wide sys.modules (which dynamo would wrap whole, racing with imports
    # on inductor's worker threads). The torch layer records torch at import.
    import types

    import cukit.torch  # noqa: F401

    assert interop._MODULES["torch"] is torch
    monkeypatch.setattr(interop, "sys", types.SimpleNamespace(modules={}))
    assert interop._loaded("torch") is torch
    assert interop.array_kind(torch.zeros(1)) == "torch"
    assert interop._loaded("not_a_module_cukit_knows") is None
