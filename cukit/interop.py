"""Interop between NumPy, CuPy and torch: the dtype table, array-kind detection, zero-copy views,
streams and the shared allocator.

This module imports neither torch nor CuPy at import time: a NumPy-only user never pays for them.
A library counts as "in use" when the caller hands us one of its arrays, which means it is imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ArrayKind = Literal["numpy", "cupy", "torch"]

__all__ = [
    "DTYPES",
    "ArrayKind",
    "DType",
    "array_kind",
    "as_dtype",
    "asarray",
    "current_stream",
    "device_of",
    "dtype_of",
    "element_strides",
    "numpy_dtype",
    "to_torch",
    "torch_dtype",
    "use_torch_allocator",
]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table: the names a dtype goes by in each library and in CUDA C++."""

    name: str  # canonical name, also NumPy's and torch's attribute name
    ctype: str  # the C++ type a kernel template is instantiated with
    itemsize: int
    kind: Literal["float", "int", "bool"]

    def __str__(self) -> str:
        return self.name


# The one dtype table: extend it here, and raw_kernels/include/cukit/dtypes.cuh on the device side.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float16", "__half", 2, "float"),
        DType("bfloat16", "__nv_bfloat16", 2, "float"),
        DType("float32", "float", 4, "float"),
        DType("float64", "double", 8, "float"),
        DType("int32", "int", 4, "int"),
        DType("int64", "long long", 8, "int"),
        DType("bool", "bool", 1, "bool"),
    )
}


def _loaded(name: str) -> Any | None:
    """The module if the program has imported it, else None (so we never import it ourselves)."""
    return sys.modules.get(name)


def array_kind(x: Any) -> ArrayKind:
    """Which library an array belongs to: "numpy", "cupy" or "torch".

    Raises TypeError for anything else (lists, scalars, other libraries' arrays).
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = _loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = _loaded("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise TypeError(
        f"expected a numpy.ndarray, cupy.ndarray or torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}"
    )


def as_dtype(dtype: Any) -> DType:
    """The table row for a dtype given as a name, a NumPy/CuPy dtype or a torch.dtype."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        name = dtype
    else:
        torch = _loaded("torch")
        if torch is not None and isinstance(dtype, torch.dtype):
            name = str(dtype).removeprefix("torch.")
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError as e:
                raise TypeError(f"not a dtype: {dtype!r}") from e
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(f"dtype {name} is not supported by cukit; supported: {', '.join(DTYPES)}") from None


def dtype_of(x: Any) -> DType:
    """The table row for an array's dtype (NumPy, CuPy or torch)."""
    return as_dtype(x.dtype)


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype for a table dtype; bfloat16 needs the ml_dtypes package."""
    d = as_dtype(dtype)
    if d.name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("bfloat16 NumPy/CuPy arrays need the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(d.name)


def torch_dtype(dtype: Any) -> Any:
    """The torch.dtype for a table dtype."""
    import torch

    return getattr(torch, as_dtype(dtype).name)


def device_of(x: Any) -> int | None:
    """The CUDA device index of an array, or None for host arrays (NumPy, torch CPU)."""
    kind = array_kind(x)
    if kind == "numpy":
        return None
    if kind == "cupy":
        return int(x.device.id)
    if x.is_cuda:
        return x.get_device()  # cheaper than building x.device (this runs on every call)
    if x.device.type == "cpu":
        return None
    raise TypeError(f"torch tensors on {x.device.type!r} are not supported; use CPU or CUDA tensors")


def element_strides(x: Any, kind: str | None = None) -> tuple[int, ...] | None:
    """An array's strides in elements (torch, CuPy, NumPy); None for negative strides or strides
    that are not whole elements (possible in NumPy/CuPy). `kind`: ``array_kind(x)`` if known."""
    if (kind or array_kind(x)) == "torch":
        return tuple(x.stride())
    isz = x.itemsize
    if any(s < 0 or s % isz for s in x.strides):
        return None
    return tuple(s // isz for s in x.strides)


def asarray(x: Any) -> Any:
    """A CuPy array viewing a GPU array with zero copy.

    Accepts torch CUDA tensors (also ones that require grad: the view is detached from autograd),
    CuPy arrays (returned as they are) and any object with ``__dlpack__`` or
    ``__cuda_array_interface__``. bfloat16 goes through DLPack and needs ml_dtypes installed.
    Host arrays (NumPy, torch CPU tensors) raise TypeError: a GPU view of host memory does not
    exist; copy with ``cupy.asarray`` if a copy is what you want.

    See also: ``cupy.from_dlpack``, ``cupy.asarray``.
    """
    if isinstance(x, np.ndarray):
        raise TypeError("cukit.asarray: a NumPy array lives in host memory; use cupy.asarray(x) to copy it")
    torch = _loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type != "cuda":
        raise TypeError(
            f"cukit.asarray: tensor is on {x.device}, not a CUDA device; zero-copy needs a CUDA tensor "
            "(use x.cuda(), or cupy.asarray(x.numpy()) for a copy)"
        )
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            numpy_dtype("bfloat16")  # a clear error if ml_dtypes is missing
        return cupy.from_dlpack(x.detach())
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"cukit.asarray: cannot view {type(x).__qualname__} as a GPU array")


def to_torch(a: Any) -> Any:
    """A torch tensor viewing a CuPy array (or any DLPack GPU array) with zero copy.

    Views with negative strides raise ValueError: torch has no negative strides, so no zero-copy
    view exists (``cupy.ascontiguousarray(a)`` first if a copy is fine).

    See also: ``torch.from_dlpack``.
    """
    import torch

    if isinstance(a, torch.Tensor):
        return a
    strides = getattr(a, "strides", None)
    if strides is not None and any(s < 0 for s in strides):
        raise ValueError(
            "cukit.to_torch: the array has negative strides, which torch cannot view; "
            "use cupy.ascontiguousarray(a) first (a copy)"
        )
    return torch.from_dlpack(a)


def current_stream(device: int | None, torch_involved: bool) -> Any:
    """The stream a launch should use: torch's current stream on `device` when torch tensors are
    involved (so our kernels order with torch's work and land in CUDA-graph captures), else CuPy's.

    Returns an object with a ``.ptr`` attribute, as ``cupy.RawKernel.__call__(stream=...)`` wants.
    """
    if torch_involved and device is not None:
        raw = _RAW_STREAM[0]
        if raw is None:
            import torch

            raw = _RAW_STREAM[0] = torch._C._cuda_getCurrentRawStream  # an int, no Stream object built
        cached = _EXTERNAL.get((raw(device), device))
        if cached is not None:
            return cached
    import cupy

    if torch_involved:
        import torch

        # Wrapping costs a few µs; torch hands out few distinct streams, so keep one wrapper per
        # (stream pointer, device): the legacy default stream is 0 on every device. The wrapper
        # holds the torch stream, so the pointer stays valid.
        stream = torch.cuda.current_stream(device)
        cached = _EXTERNAL[(stream.cuda_stream, device)] = cupy.cuda.Stream.from_external(stream)
        return cached
    return cupy.cuda.get_current_stream(device)


_RAW_STREAM: list[Any] = [None]  # torch._C._cuda_getCurrentRawStream, looked up on first use
_EXTERNAL: dict[tuple[int, int | None], Any] = {}


_TORCH_ALLOCATOR: Any = None


def use_torch_allocator() -> None:
    """Make CuPy allocate device memory through torch's caching allocator: one pool, not two.

    Each block is allocated for CuPy's current stream (the stream CuPy's own work on it will be
    queued on), so torch's allocator reuses it only after that stream's work, and is freed back to
    torch's pool. Memory used on other streams follows torch's usual rule (``record_stream`` or a
    synchronisation before the array is freed). Call once, before allocating CuPy arrays.

    See also: ``cupy.cuda.set_allocator``, ``torch.cuda.caching_allocator_alloc``.
    """
    global _TORCH_ALLOCATOR
    import cupy
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("cukit.use_torch_allocator: torch sees no CUDA device")

    def malloc(size: int, device: int) -> int:
        return torch.cuda.caching_allocator_alloc(size, device, cupy.cuda.get_current_stream(device).ptr)

    def free(ptr: int, device: int) -> None:
        torch.cuda.caching_allocator_delete(ptr)

    _TORCH_ALLOCATOR = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
    cupy.cuda.set_allocator(_TORCH_ALLOCATOR.malloc)
