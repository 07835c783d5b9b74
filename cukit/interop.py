"""Interop between NumPy, CuPy and torch: the dtype table, array-kind detection, the conversion of
array-likes (lists, tuples, scalars: ``as_array``/``as_arrays``, the rule every NumPy-like op
follows), zero-copy views, streams and the shared allocator.

This module imports neither torch nor CuPy at import time: a NumPy-only user never pays for them.
A library counts as "in use" when the caller hands us one of its arrays, which means it is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ArrayKind = Literal["numpy", "cupy", "torch"]

__all__ = [
    "DTYPES",
    "ArrayKind",
    "DType",
    "NotAnArrayError",
    "array_class",
    "array_kind",
    "as_array",
    "as_arrays",
    "as_dtype",
    "asarray",
    "current_stream",
    "device_of",
    "dtype_name",
    "dtype_of",
    "element_strides",
    "is_array",
    "not_an_array_error",
    "numpy_dtype",
    "to_torch",
    "torch_dtype",
    "type_name",
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


_MODULES: dict[str, Any] = {}  # torch / cupy once seen in sys.modules


def _loaded(name: str) -> Any | None:
    """The module if the program has imported it, else None (so we never import it ourselves).

    Found modules are kept in a small dict: ``torch.compile`` traces this function inside the
    validation of cukit ops, and reading ``sys.modules`` there makes dynamo wrap the whole
    interpreter-wide dict, which another thread (inductor's compile workers) may be importing
    into: "dictionary changed size during iteration". cukit's torch layer records torch at import."""
    mod = _MODULES.get(name)
    if mod is None:
        mod = sys.modules.get(name)
        if mod is not None:
            _MODULES[name] = mod
    return mod


class NotAnArrayError(TypeError):
    """An argument is not a NumPy, CuPy or torch array. Raised by ``array_kind`` and by the ops'
    validation; the public ops catch it and convert array-likes (lists, scalars, ...) instead."""


_CLASS_NAMES: dict[str, str] = {"numpy": "numpy.ndarray", "cupy": "cupy.ndarray", "torch": "torch.Tensor"}
_ARRAY_CLASSES = "a numpy.ndarray, cupy.ndarray or torch.Tensor"
_ARRAY_LIKE = "an array-like convertible to a numeric array"


def array_kind(x: Any) -> ArrayKind:
    """Which library an array belongs to: "numpy", "cupy" or "torch".

    Raises NotAnArrayError (a TypeError) for anything else (lists, scalars, other libraries' arrays).
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = _loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = _loaded("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise NotAnArrayError(f"cukit.interop.array_kind: x must be {_ARRAY_CLASSES}; got {type_name(x)}")


def is_array(x: Any) -> bool:
    """Whether x is a NumPy, CuPy or torch array (``array_kind`` would accept it)."""
    if isinstance(x, np.ndarray):
        return True
    torch, cupy = _loaded("torch"), _loaded("cupy")
    return (torch is not None and isinstance(x, torch.Tensor)) or (cupy is not None and isinstance(x, cupy.ndarray))


def array_class(kind: str) -> str:
    """The class name of an array kind: "numpy.ndarray", "cupy.ndarray" or "torch.Tensor"."""
    return _CLASS_NAMES[kind]


def type_name(x: Any) -> str:
    """x's type as error messages print it: ``list`` for builtins, else ``module.Class``."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def not_an_array_error(fn: str, args: Sequence[tuple[str, Any]]) -> NotAnArrayError:
    """The error for the first of ``(name, value)`` args that is not an array, naming fn and it."""
    for name, x in args:
        if not is_array(x):
            return NotAnArrayError(f"{fn}: {name} must be {_ARRAY_CLASSES}; got {type_name(x)}")
    return NotAnArrayError(f"{fn}: {', '.join(n for n, _ in args)} must be arrays")


def as_array(x: Any, fn: str, name: str, like: Any = None) -> Any:
    """An array-like that is not an array (list, tuple, Python or NumPy scalar, anything
    ``numpy.asarray`` takes) as an array: ``numpy.asarray(x)``, so with NumPy's values and dtype
    (Python floats float64, ints int64, bools bool, mixed ones promoted), moved to ``like``'s library
    and device when ``like`` is a CuPy array (``cupy.asarray``) or a torch tensor
    (``torch.as_tensor(..., device=like.device)``); a NumPy array otherwise.

    fn and name (the calling function and the argument) go into the errors: TypeError (ValueError
    for ragged sequences, as NumPy raises) when x does not convert to a bool, integer, float or
    complex array.

    See also: ``numpy.asarray``, ``cupy.asarray``, ``torch.as_tensor``.
    """
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{fn}: {name} must be {_ARRAY_LIKE}; got {type_name(x)} (numpy.asarray: {e})") from e
    if a.dtype.kind not in "biufc":
        # a 0-d object array is x itself (a dict, None, ...): its type says it all
        why = "" if a.dtype.kind == "O" and a.ndim == 0 else f" (numpy.asarray gives dtype {a.dtype})"
        raise TypeError(f"{fn}: {name} must be {_ARRAY_LIKE}; got {type_name(x)}{why}")
    if like is None or isinstance(like, np.ndarray):
        return a
    kind = array_kind(like)
    if kind == "torch":
        import torch

        try:
            return torch.as_tensor(a, device=like.device)
        except (TypeError, RuntimeError, ValueError) as e:
            raise TypeError(
                f"{fn}: {name} ({type_name(x)}, dtype {a.dtype} after numpy.asarray) cannot become a torch "
                f"tensor like the other arguments: {e}"
            ) from e
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(a)
    return a


def as_arrays(fn: str, args: Sequence[tuple[str, Any]]) -> list[Any]:
    """The values of ``(name, value)`` args with every non-array converted by ``as_array``, like
    the first argument that is an array (NumPy when none is). Arrays are returned as they are.

    The conversion rule of cukit's NumPy-like ops: an array-like argument becomes exactly what
    ``numpy.asarray`` makes of it (dtype included), in the library and on the device of the call's
    first array argument; the op then applies its usual rules (promotion, dtype checks) to it.
    """
    like = next((x for _, x in args if is_array(x)), None)
    return [x if is_array(x) else as_array(x, fn, name, like) for name, x in args]


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
                raise TypeError(
                    f"cukit.interop.as_dtype: dtype must be a dtype name, NumPy/CuPy dtype or torch.dtype; "
                    f"got {dtype!r}"
                ) from e
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(
            f"cukit.interop.as_dtype: dtype {name} is not supported: cukit's dtype table has "
            f"{', '.join(DTYPES)} (each op supports a subset; its docstring lists which)"
        ) from None


def dtype_of(x: Any) -> DType:
    """The table row for an array's dtype (NumPy, CuPy or torch)."""
    return as_dtype(x.dtype)


_NAMES_NUMPY: dict[Any, str] = {}  # NumPy/CuPy dtype -> name


def dtype_name(x: Any, kind: str | None = None) -> str:
    """The name of an array's dtype ("float32", "bfloat16", "complex64", ...: NumPy's name, torch's
    without "torch."), also outside cukit's table. `kind`: ``array_kind(x)`` if known.

    Cached per dtype: NumPy computes ``dtype.name`` in Python (microseconds), and validation reads
    it on every call."""
    d = x.dtype
    if (kind or array_kind(x)) == "torch":
        # not cached: filling a cache while dynamo traces a call makes a guard on the cache's
        # contents that fails in the frame that made it (torch's str(dtype) is cheap anyway)
        return str(d).removeprefix("torch.")
    name = _NAMES_NUMPY.get(d)
    if name is None:
        name = _NAMES_NUMPY[d] = np.dtype(d).name
    return name


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype for a table dtype; bfloat16 needs the ml_dtypes package."""
    d = as_dtype(dtype)
    if d.name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                "cukit.interop.numpy_dtype: bfloat16 NumPy/CuPy arrays need the ml_dtypes package "
                "(pip install ml_dtypes)"
            ) from None
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
    raise TypeError(
        f"cukit.interop.device_of: x must be a CPU or CUDA tensor; got a torch.Tensor on {x.device.type!r}"
    )


def element_strides(x: Any, kind: str | None = None) -> tuple[int, ...] | None:
    """An array's strides in elements (torch, CuPy, NumPy); None for negative strides or strides
    that are not whole elements (possible in NumPy/CuPy). `kind`: ``array_kind(x)`` if known."""
    if (kind or array_kind(x)) == "torch":
        return tuple(x.stride())
    isz = x.itemsize
    if any(s < 0 or s % isz for s in x.strides):
        return None
    return tuple(s // isz for s in x.strides)


def is_contiguous(a: Any, kind: str) -> bool:
    """Whether `a` is C-contiguous (torch or CuPy/NumPy, `kind` as :func:`array_kind` names it);
    None counts as contiguous (an absent optional array)."""
    if a is None:
        return True
    return bool(a.is_contiguous() if kind == "torch" else a.flags.c_contiguous)


def contiguous(a: Any, kind: str) -> Any:
    """`a` itself when C-contiguous, else a C-contiguous copy in the same library (None stays None).

    See also: ``torch.Tensor.contiguous``, ``numpy.ascontiguousarray``."""
    if a is None:
        return None
    if kind == "torch":
        return a.contiguous()
    if kind == "numpy":
        return np.ascontiguousarray(a)
    import cupy

    return cupy.ascontiguousarray(a)


def asarray(x: Any) -> Any:
    """A CuPy array viewing a GPU array with zero copy: ``y = x`` (same memory).

    Accepts torch CUDA tensors (also ones that require grad: the view is detached from autograd),
    CuPy arrays (returned as they are) and any object with ``__dlpack__`` or
    ``__cuda_array_interface__``. bfloat16 goes through DLPack and needs ml_dtypes installed.
    Host arrays (NumPy, torch CPU tensors) raise TypeError: a GPU view of host memory does not
    exist; copy with ``cupy.asarray`` if a copy is what you want. Lists, tuples and scalars have no
    memory to view: they are copied to a new CuPy array with ``numpy.asarray``'s dtype (Python
    floats float64, ints int64), like ``cupy.asarray`` does.

    See also: ``cupy.from_dlpack``, ``cupy.asarray``.
    """
    if isinstance(x, np.ndarray):
        raise TypeError(
            "cukit.asarray: x must be a GPU array; got a numpy.ndarray, which lives in host memory "
            "(no zero-copy GPU view exists): use cupy.asarray(x) to copy it"
        )
    torch = _loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type != "cuda":
        raise TypeError(
            f"cukit.asarray: x must be a GPU array; got a torch.Tensor on {x.device}, not a CUDA device: "
            "zero-copy needs a CUDA tensor (use x.cuda(), or cupy.asarray(x.numpy()) for a copy)"
        )
    gpu_protocol = hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")
    try:
        import cupy
    except ImportError as e:
        if not gpu_protocol:
            as_array(x, "cukit.asarray", "x")  # a wrong type is reported before the missing library
        raise ImportError("cukit.asarray: needs CuPy, which is not installed (pip install cupy-cuda12x)") from e

    if isinstance(x, cupy.ndarray):
        return x
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            try:
                numpy_dtype("bfloat16")
            except TypeError:
                raise TypeError(
                    "cukit.asarray: x is a bfloat16 tensor, whose CuPy view needs the ml_dtypes package "
                    "(pip install ml_dtypes)"
                ) from None
        return cupy.from_dlpack(x.detach())
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    return cupy.asarray(as_array(x, "cukit.asarray", "x"))


def to_torch(a: Any) -> Any:
    """A torch tensor viewing a CuPy array (or any DLPack array: NumPy, GPU arrays) with zero copy.

    Views with negative strides raise ValueError: torch has no negative strides, so no zero-copy
    view exists (``cupy.ascontiguousarray(a)`` first if a copy is fine). Lists, tuples and scalars
    have no memory to view: they are copied to a new CPU tensor with ``numpy.asarray``'s dtype
    (Python floats float64, ints int64).

    See also: ``torch.from_dlpack``, ``torch.as_tensor``.
    """
    import torch

    if isinstance(a, torch.Tensor):
        return a
    strides = getattr(a, "strides", None)
    if strides is not None and any(s < 0 for s in strides):
        raise ValueError(
            f"cukit.to_torch: a must have non-negative strides (torch has no negative strides, so no "
            f"zero-copy view exists); got strides {tuple(strides)}: use cupy.ascontiguousarray(a) first (a copy)"
        )
    if hasattr(a, "__dlpack__"):
        return torch.from_dlpack(a)
    return torch.as_tensor(as_array(a, "cukit.to_torch", "a"))


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
