"""Matrix products: ``matmul`` (``numpy.matmul`` semantics), ``linear`` (``act(x @ W.T + b)`` in one
kernel), ``batch_matmul``, ``chunked_matmul``, ``gemm`` (``out = alpha * (a @ b) + beta * out`` into an
existing, possibly strided or float32, output); the global TF32 setting; the kernel-selection heuristic.

This module is the front end of the matmul family. It validates, promotes dtypes, and turns arrays
into a launch-ready :class:`cukit.ops._gemm.Gemm` (strides, broadcast batch dimensions, bias and
activation epilogue), then hands it to a kernel family:

- ``cukit/ops/matmul_simt.py``: float32 / float64 SIMT kernels (incl. the classic 32x32 tiled "v1");
- ``cukit/ops/matmul_tc.py``: tensor-core (mma.sync) kernels for bfloat16 / float16 inputs with fp32
  accumulation, and float32 with ``precision="tf32"``.

Each family is a :class:`cukit.ops._gemm.GemmFamily` (``supports(g)``, ``prepare(g)``,
``launch(g, stream)``), imported lazily on the first GPU call. ``select_kernel`` documents the
choice. Tests and benchmarks force a family (not public API) with
``force_kernel("simt" | "simt_v1" | "tc")`` around any call, or call ``_matmul_gpu(a, b, kernel=...)``
directly. This module declares no kernels.

The launch path: a GPU call's signature (shapes, strides, dtypes, device, pointer alignment,
options) keys a bounded plan cache (``_PLANS``); a known signature costs a lookup, one output
allocation and a launch of the prepared kernel (a product that splits K: a workspace
allocation and two launches). The first call of a signature validates it and builds the plan.

NumPy and torch-CPU inputs run the references below (``numpy.matmul`` / ``torch.matmul``), which
are also the CPU fallbacks. These functions are array-level: autograd, autocast and
``torch.compile`` support live in the torch layer (``cukit/torch/matmul.py``), which the public
``cukit.matmul`` routes torch tensors to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from cukit._runtime import PlanCache
from cukit.interop import (
    DTYPES,
    DType,
    NotAnArrayError,
    array_class,
    array_kind,
    as_array,
    as_arrays,
    current_stream,
    device_of,
    dtype_name,
    element_strides,
    is_array,
    not_an_array_error,
    type_name,
)
from cukit.interop import (
    contiguous as _contiguous,
)
from cukit.interop import (
    is_contiguous as _is_contiguous,
)
from cukit.ops._gemm import MAX_BATCH_DIMS, Gemm, Workspace
from cukit.ops.bias_act import ACTIVATIONS, FLOAT_DTYPES, activation_id, as_bias
from cukit.ops.bias_act import _torch_act as _bias_act_torch_act
from cukit.ops.bias_act import reference_numpy as _bias_act_numpy
from cukit.ops.bias_act import reference_torch as _bias_act_torch

__all__ = [
    "FLOAT_DTYPES",
    "KERNEL_FAMILIES",
    "LINEAR_ACTIVATIONS",
    "PRECISIONS",
    "batch_matmul",
    "chunked_matmul",
    "force_kernel",
    "gemm",
    "gemm_device_scale",
    "gemm_reference_numpy",
    "gemm_reference_torch",
    "get_matmul_precision",
    "linear",
    "linear_reference_numpy",
    "linear_reference_torch",
    "matmul",
    "matmul_shape",
    "reference_numpy",
    "reference_torch",
    "result_dtype",
    "select_kernel",
    "set_matmul_precision",
]

PRECISIONS = ("ieee", "tf32")
# Kernel family name -> module implementing supports(g) / launch(g, stream) (see _gemm.py).
KERNEL_FAMILIES: dict[str, str] = {"simt": "cukit.ops.matmul_simt", "tc": "cukit.ops.matmul_tc"}

# Activation names linear accepts (None: no activation).
LINEAR_ACTIVATIONS: tuple[str | None, ...] = (None, *ACTIVATIONS)

_SIGNATURE = "(n?,k),(k,m?)->(n?,m?)"  # numpy.matmul's gufunc signature, quoted in its errors


# ---------------------------------------------------------------------------------------------
# The global precision setting (like torch.backends.cuda.matmul.allow_tf32)
# ---------------------------------------------------------------------------------------------

_PRECISION = "ieee"


def _check_precision(precision: str, fn: str = "cukit.matmul") -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}")
    return precision


def set_matmul_precision(precision: str) -> None:
    """Set the default precision of float32 products on CUDA: "ieee" (default: full float32
    products, float32 accumulation) or "tf32" (tensor cores; inputs rounded to 10 mantissa bits,
    float32 accumulation: ~1e-3 relative error per product, several times faster).

    Process-wide, like ``torch.backends.cuda.matmul.allow_tf32``; a ``precision=`` argument of
    ``matmul``/``linear`` overrides it per call. Other dtypes and CPU inputs are not affected.
    Under ``torch.compile`` the setting is read when the function is traced.

    See also: ``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision``.
    """
    global _PRECISION
    _PRECISION = _check_precision(precision, "cukit.set_matmul_precision")


def get_matmul_precision() -> str:
    """The default precision of float32 products on CUDA: "ieee" or "tf32" (see
    ``set_matmul_precision``)."""
    return _PRECISION


def _resolve_precision(precision: str | None, fn: str = "cukit.matmul") -> str:
    return _PRECISION if precision is None else _check_precision(precision, fn)


# ---------------------------------------------------------------------------------------------
# Shapes and dtypes (NumPy's rules and NumPy's error messages)
# ---------------------------------------------------------------------------------------------


def _fmt(shape: Sequence[Any]) -> str:
    return "(" + ",".join(str(s) for s in shape) + ")"


def matmul_shape(
    sa: Sequence[int], sb: Sequence[int], *, fn: str = "cukit.matmul", names: tuple[str, str] = ("a", "b")
) -> tuple[tuple[int, ...], int, int, int, tuple[int, ...]]:
    """``(batch, M, K, N, out_shape)`` of ``a @ b`` for operand shapes sa and sb, by numpy.matmul's
    rules: 1-D operands are promoted ((K,) -> (1, K) for a, (K,) -> (K, 1) for b) and the added axis
    is removed from out_shape; batch dimensions broadcast. Raises ValueError naming fn and the
    operands (``names``), ending with NumPy's own message for the same shapes."""
    sa, sb = tuple(sa), tuple(sb)
    na, nb = names
    for i, (name, s) in enumerate(((na, sa), (nb, sb))):
        if len(s) == 0:
            numpy_msg = (
                f"matmul: Input operand {i} does not have enough dimensions (has 0, gufunc core with "
                f"signature {_SIGNATURE} requires 1)"
            )
            raise ValueError(
                f"{fn}: {name} must have at least 1 dimension (a scalar has none); got shape (){_numpy_says(numpy_msg)}"
            )
    ka = sa[-1]
    kb = sb[0] if len(sb) == 1 else sb[-2]
    if ka != kb:
        numpy_msg = (
            f"matmul: Input operand 1 has a mismatch in its core dimension 0, with gufunc signature "
            f"{_SIGNATURE} (size {kb} is different from {ka})"
        )
        where = "only" if len(sb) == 1 else "second-to-last"
        raise ValueError(
            f"{fn}: the {where} dimension of {nb} must equal the last dimension of {na} ({ka}); got {kb} "
            f"({na}.shape={sa}, {nb}.shape={sb}){_numpy_says(numpy_msg)}"
        )
    M = sa[-2] if len(sa) >= 2 else 1
    N = sb[-1] if len(sb) >= 2 else 1
    ba, bb = sa[:-2], sb[:-2]
    n = max(len(ba), len(bb))
    pa, pb = (1,) * (n - len(ba)) + ba, (1,) * (n - len(bb)) + bb
    batch: list[int] = []
    for x, y in zip(pa, pb, strict=True):
        if x == y or y == 1:
            batch.append(x)
        elif x == 1:
            batch.append(y)
        else:
            nx = ",".join(["newaxis"] * 2)
            numpy_msg = (
                "operands could not be broadcast together with remapped shapes [original->remapped]: "
                f"{_fmt(sa)}->{_fmt([*ba, nx])} {_fmt(sb)}->{_fmt([*bb, nx])}  and requested shape ({M},{N})"
            )
            raise ValueError(
                f"{fn}: the batch dimensions of {na} {ba} and {nb} {bb} must broadcast together; got "
                f"{na}.shape={sa}, {nb}.shape={sb}{_numpy_says(numpy_msg)}"
            )
    out_shape = (*batch, *((M,) if len(sa) >= 2 else ()), *((N,) if len(sb) >= 2 else ()))
    return tuple(batch), M, ka, N, out_shape


def _numpy_says(msg: str) -> str:
    """The suffix quoting NumPy's error for the same operands (searchable, and tests compare it)."""
    return f" (numpy.matmul raises: {msg})"


_FLOAT_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


_dtype_name = dtype_name  # the name cukit.torch.matmul reads


def result_dtype(da: str, db: str, fn: str = "cukit.matmul") -> str:
    """The dtype of ``a @ b`` for operand dtypes named da and db: NumPy's ``result_type``
    (float16 @ float32 -> float32, int64 @ float32 -> float64, ...), extended to bfloat16 like
    torch: bfloat16 @ float16 -> float32, bfloat16 @ wider float -> the wider, bfloat16 @ an
    integer -> what float16 would give, with bfloat16 in place of float16."""
    if da == db:
        return da
    if da in _FLOAT_RANK and db in _FLOAT_RANK:
        if {da, db} == {"float16", "bfloat16"}:
            return "float32"
        return max(da, db, key=_FLOAT_RANK.__getitem__)
    na, nb = ("float16" if d == "bfloat16" else d for d in (da, db))
    try:
        r = np.result_type(np.dtype(na), np.dtype(nb)).name
    except TypeError:
        raise TypeError(f"{fn}: a and b must have dtypes with a common type; got {da} and {db}") from None
    return "bfloat16" if r == "float16" and "float16" not in (da, db) else r


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


def _validate_pair(
    a: Any, b: Any, what: str = "b", *, fn: str = "cukit.matmul", first: str = "a"
) -> tuple[str, int | None]:
    """(array kind, device) of two arrays that must share both; ``first``/``what`` name them in the
    errors. NotAnArrayError when either is no array (the public ops then convert array-likes)."""
    try:
        kind = array_kind(a)
        kind_b = array_kind(b)
    except NotAnArrayError:
        raise not_an_array_error(fn, ((first, a), (what, b))) from None
    if kind_b != kind:
        raise TypeError(f"{fn}: {what} must be the same array type as {first} ({array_class(kind)}); got {type_name(b)}")
    da, db = device_of(a), device_of(b)
    if da != db:
        raise ValueError(f"{fn}: {first} and {what} must be on the same device; got {_where(da)} and {_where(db)}")
    return kind, da


def _check_out(
    out: Any, kind: str, device: int | None, shape: tuple[int, ...], dtype: str, fn: str = "cukit.matmul"
) -> None:
    if not is_array(out) or array_kind(out) != kind:
        raise TypeError(f"{fn}: out must be the same array type as the inputs ({array_class(kind)}); got {type_name(out)}")
    if device_of(out) != device:
        raise ValueError(f"{fn}: out must be on the inputs' device ({_where(device)}); got {_where(device_of(out))}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}: out must have the result's shape {tuple(shape)}; got {tuple(out.shape)}")
    if _dtype_name(out) != dtype:
        raise TypeError(f"{fn}: out must have the result's dtype {dtype}; got {_dtype_name(out)}")


def _astype(x: Any, dtype: str, kind: str) -> Any:
    if _dtype_name(x) == dtype:
        return x
    if kind == "torch":
        import torch

        return x.to(getattr(torch, dtype))
    from cukit.interop import numpy_dtype

    return x.astype(numpy_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype))


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def matmul(a: Any, b: Any, *, out: Any = None, precision: str | None = None) -> Any:
    """Matrix product with ``numpy.matmul`` semantics: ``C[..., m, n] = sum_k A[..., m, k] B[..., k, n]``.

    Args:
        a, b: NumPy, CuPy or torch (CPU or CUDA) arrays of the same type and device, at least 1-D.
            A 1-D a is promoted to (1, K) and a 1-D b to (K, 1), and the added axis is removed from
            the result; batch dimensions (all but the last two) broadcast by NumPy's rules. Any
            strides: on CUDA, transposed operands (one unit stride) and broadcast batches (stride
            0) are read in place; operands with no unit stride in their last two dimensions (or
            negative CuPy strides) are copied; batch dimensions are merged where their strides
            allow, and when more than three remain the operands are made contiguous (and, if still
            needed, the broadcast is materialised) so that one batch dimension is left.
            Array-likes (lists, tuples, anything ``numpy.asarray`` takes) are converted as
            ``numpy.asarray`` converts them (Python floats float64, ints int64), into the library
            and device of the other operand when that is a CuPy array or torch tensor; then NumPy's
            promotion applies (``matmul(float32_array, [[1.0]])`` is float64, as in NumPy). Two
            array-likes give a NumPy result. Scalars are 0-d: rejected, as numpy.matmul does.
        out: optional array of the result's exact shape, dtype, type and device, written in place
            and returned (stricter than NumPy, which also broadcasts and casts into out).
        precision: None (the global setting, ``get_matmul_precision()``), "ieee" or "tf32"; tf32
            only affects float32 CUDA inputs.

    Returns:
        The product, of the inputs' array type and device; dtype ``result_dtype`` (NumPy's
        promotion: mixed dtypes are cast to it first). 1-D @ 1-D gives a 0-d result (a NumPy scalar
        for NumPy inputs, like numpy.matmul).

    Dtypes: CUDA inputs (CuPy, torch) run cukit's kernels for float16, bfloat16 (fp32 accumulation),
    float32 and float64; other dtypes raise TypeError there. NumPy inputs run ``numpy.matmul``
    (any dtype NumPy takes; bfloat16 is computed in float32 and rounded once). torch CPU tensors
    run ``torch.matmul`` (real dtypes; bool as NumPy defines it). torch tensors are differentiable
    (through ``torch.ops.cukit.matmul``) and work under torch.compile and CUDA-graph capture.

    Raises:
        ValueError for 0-d operands, mismatched core dimensions or non-broadcastable batch
        dimensions (naming the operands, then quoting NumPy's message); TypeError for mixed array
        types or an argument that converts to no numeric array. Messages start ``cukit.matmul:``.

    See also: ``numpy.matmul``, ``torch.matmul``, ``cukit.linear``, ``cukit.chunked_matmul``.
    """
    try:
        return _matmul_arrays(a, b, out, precision)
    except NotAnArrayError:
        a, b = as_arrays("cukit.matmul", (("a", a), ("b", b)))
    return _matmul_arrays(a, b, out, precision)


def _matmul_arrays(a: Any, b: Any, out: Any, precision: str | None) -> Any:
    """matmul for arrays (NotAnArrayError for anything else, before any work)."""
    kind, device = _validate_pair(a, b)
    prec = _resolve_precision(precision)
    _, _, _, _, out_shape = matmul_shape(tuple(a.shape), tuple(b.shape))
    da, db = _dtype_name(a, kind), _dtype_name(b, kind)
    rdt = result_dtype(da, db)
    if out is not None:
        _check_out(out, kind, device, out_shape, rdt)
    if kind == "numpy":
        return reference_numpy(a, b, out=out)
    if device is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        if a.is_complex() or b.is_complex():
            raise TypeError(f"cukit.matmul: a and b must have real dtypes for torch tensors; got {da} and {db}")
        r = reference_torch(_astype(a, rdt, kind), _astype(b, rdt, kind))
        if out is None:
            return r
        out.copy_(r)
        return out
    if rdt not in FLOAT_DTYPES:
        raise TypeError(
            f"cukit.matmul: a and b on the GPU must have dtypes whose promotion is one of {', '.join(FLOAT_DTYPES)}; "
            f"got {da} and {db} (promoting to {rdt})"
        )
    return _matmul_gpu(_astype(a, rdt, kind), _astype(b, rdt, kind), precision=prec, out=out)


def validate_batch(a: Any, b: Any) -> None:
    """batch_matmul's stricter checks: both 3-D, equal batch sizes, matching K. NotAnArrayError
    when a or b is no array."""
    fn = "cukit.batch_matmul"
    _validate_pair(a, b, fn=fn)
    if a.ndim != 3 or b.ndim != 3:
        bad = "a" if a.ndim != 3 else "b"
        raise ValueError(
            f"{fn}: a and b must both be 3-D, (B, M, K) and (B, K, N); got {bad} with shape "
            f"{tuple((a if bad == 'a' else b).shape)} (a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)}; "
            "cukit.matmul broadcasts)"
        )
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{fn}: b must have a's batch size {a.shape[0]} (no broadcasting); got {b.shape[0]}: batch sizes differ"
        )
    if a.shape[2] != b.shape[1]:
        raise ValueError(
            f"{fn}: b's K (b is (B, K, N) = {tuple(b.shape)}) must equal a's (a is (B, M, K) = "
            f"{tuple(a.shape)}): K differs ({a.shape[2]} vs {b.shape[1]})"
        )


def batch_matmul(a: Any, b: Any, *, precision: str | None = None) -> Any:
    """Strict batched product: ``C[z] = A[z] @ B[z]`` for a (B, M, K) and b (B, K, N) -> (B, M, N).

    No broadcasting and no 1-D promotion: both operands must be 3-D with equal batch sizes and
    matching K (ValueError otherwise). Otherwise as ``cukit.matmul`` (array types, array-likes,
    dtypes, precision, autograd).

    See also: ``torch.bmm``, ``cukit.matmul``.
    """
    try:
        validate_batch(a, b)
    except NotAnArrayError:
        a, b = as_arrays("cukit.batch_matmul", (("a", a), ("b", b)))
        validate_batch(a, b)
    return matmul(a, b, precision=precision)


def _validate_linear(
    x: Any, weight: Any, bias: Any, activation: str | None, fn: str = "cukit.linear"
) -> tuple[str, int]:
    """(array kind, activation id) of linear's arguments; NotAnArrayError when x, weight or bias
    (if not None) is no array, TypeError/ValueError naming fn and the argument otherwise."""
    kind, _ = _validate_pair(x, weight, "weight", fn=fn, first="x")
    if bias is not None:
        _validate_pair(x, bias, "bias", fn=fn, first="x")
    act = -1 if activation is None else activation_id(activation, fn, allow_none=True)
    dt = _dtype_name(x, kind)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x must have dtype {', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}; got {dt}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and _dtype_name(t, kind) != dt:
            raise TypeError(
                f"{fn}: {name} must have x's dtype {dt}; got {_dtype_name(t, kind)} (no dtype promotion here: "
                "cast one of them)"
            )
    if weight.ndim != 2:
        raise ValueError(f"{fn}: weight must be 2-D (out_features, in_features); got shape {tuple(weight.shape)}")
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have at least one dimension (..., in_features); got shape ()")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: x's last dimension must equal weight's in_features ({weight.shape[1]}; weight is "
            f"(out_features, in_features) = {tuple(weight.shape)}); got {x.shape[-1]} (x.shape={tuple(x.shape)})"
        )
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"{fn}: bias must have shape ({weight.shape[0]},), (out_features,); got {tuple(bias.shape)}"
        )
    return kind, act


def linear_operands(fn: str, x: Any, weight: Any, bias: Any) -> tuple[Any, Any, Any]:
    """(x, weight, bias) with array-likes converted like the first array among them (NumPy if none
    is); a scalar bias broadcasts to (out_features,) (``cukit.ops.bias_act.as_bias``)."""
    like = next((t for t in (x, weight, bias) if t is not None and is_array(t)), None)
    if not is_array(x):
        x = as_array(x, fn, "x", like)
    if not is_array(weight):
        weight = as_array(weight, fn, "weight", like)
    if bias is not None and not is_array(bias):
        bias = as_bias(bias, x, fn, weight.shape[0] if weight.ndim == 2 else None)
    return x, weight, bias


def linear(
    x: Any, weight: Any, bias: Any = None, activation: str | None = None, *, precision: str | None = None
) -> Any:
    """Fused linear layer: ``y = act(x @ weight.T + bias)``, one kernel on CUDA (the GEMM's epilogue
    adds the bias and applies the activation before the single store).

    Args:
        x: (..., in_features); weight: (out_features, in_features), read in place as the transposed
            operand (no copy); bias: (out_features,) or None. Same array type, dtype and device
            (no dtype promotion); float16, bfloat16, float32 or float64. NumPy, CuPy or torch (CPU
            or CUDA). Array-likes convert as ``numpy.asarray`` converts them, into the library and
            device of the first array argument (see ``cukit.matmul``); a scalar bias broadcasts to
            (out_features,), a Python float taking x's dtype (as ``cukit.bias_act``'s bias).
        activation: None, "relu", "gelu" (erf), "gelu_tanh" or "silu".
        precision: as for ``cukit.matmul`` (tf32 affects float32 CUDA inputs only).

    Returns:
        y of shape (..., out_features), the inputs' type, dtype and device. The maths is fp32
        (float64 for float64) with one rounding of y; CPU inputs run the reference with that maths.
        torch tensors are differentiable in x, weight and bias (``torch.ops.cukit.linear``): the
        backward recomputes the pre-activation with one GEMM for gelu/gelu_tanh/silu instead of
        saving it (relu needs only the saved output), then ``dy' = dy * act'``, ``dx = dy' @ W``,
        ``dW = dy'^T @ x``, ``db = sum(dy')``.

    Raises:
        TypeError and ValueError naming ``cukit.linear`` and the argument.

    See also: ``torch.nn.functional.linear``, ``cukit.nn.Linear``, ``cukit.bias_act``.
    """
    try:
        return _linear_arrays(x, weight, bias, activation, precision)
    except NotAnArrayError:
        x, weight, bias = linear_operands("cukit.linear", x, weight, bias)
    return _linear_arrays(x, weight, bias, activation, precision)


def _linear_arrays(x: Any, weight: Any, bias: Any, activation: str | None, precision: str | None) -> Any:
    """linear for arrays (NotAnArrayError for anything else, before any work)."""
    kind, act = _validate_linear(x, weight, bias, activation)
    prec = _resolve_precision(precision, "cukit.linear")
    if kind == "numpy":
        return linear_reference_numpy(x, weight, bias, activation)
    if device_of(x) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return linear_reference_torch(x, weight, bias, activation)
    return linear_gpu(x, weight, bias, act, precision=prec)


def chunked_matmul(
    a: Any,
    b: Any,
    *,
    max_bytes: float,
    precision: str | None = None,
    use_gpu: bool | None = None,
) -> Any:
    """``a @ b`` (``cukit.matmul`` semantics) computed in row blocks of A, so that each step's
    working set (the A row block + its output block, plus B) stays under ``max_bytes``.

    - Host inputs (NumPy, torch CPU) with a GPU (``use_gpu=None``: when ``cukit.is_available()``;
      True forces it, False keeps everything on the host): B is copied to the GPU once, then each
      row block of A is copied in, multiplied by cukit's kernels, and copied back into the host
      result. The GPU never holds more than ``max_bytes`` of operands, so this multiplies operands
      larger than GPU memory (copies and compute do not overlap: each block is synchronous).
      Without a GPU each block runs the CPU fallback, bounding the temporaries.
    - GPU inputs: each block is written straight into the result; temporaries (a contiguous copy of
      an A block with unusable strides) stay under ``max_bytes``.

    Batched operands (more than 2-D, broadcast like matmul) run the 2-D algorithm per batch index;
    1-D operands are promoted like matmul; array-likes are converted as by ``cukit.matmul``. The
    result is not differentiable (torch).

    max_bytes: the budget in bytes, any real number >= 1 (``1e6`` is fine; a fraction rounds down).

    Raises:
        ValueError if even one row of A plus its output row and B exceed ``max_bytes``, or for a
        max_bytes that is no real number >= 1 (0, negative, NaN, inf, a bool, a str: TypeError for
        the non-numbers).

    See also: ``cukit.matmul``, ``numpy.matmul``.
    """
    fn = "cukit.chunked_matmul"
    try:
        kind, device = _validate_pair(a, b, fn=fn)
    except NotAnArrayError:
        a, b = as_arrays(fn, (("a", a), ("b", b)))
        kind, device = _validate_pair(a, b, fn=fn)
    prec = _resolve_precision(precision, fn)
    budget = _byte_budget(max_bytes, fn)
    batch, M, K, N, out_shape = matmul_shape(tuple(a.shape), tuple(b.shape), fn=fn)
    rdt = result_dtype(_dtype_name(a, kind), _dtype_name(b, kind), fn)
    isz = _itemsize(rdt)
    b_bytes, row_bytes = K * N * isz, (K + N) * isz
    if M > 0 and math.prod(batch) > 0 and b_bytes + row_bytes > budget:
        raise ValueError(
            f"{fn}: max_bytes={max_bytes!r} is too small: it must cover B ({b_bytes} bytes) plus one row of A "
            f"and its output row ({row_bytes}); need at least {b_bytes + row_bytes}"
        )
    max_bytes = budget
    rows = M if row_bytes == 0 else max(1, (max_bytes - b_bytes) // row_bytes)
    host = device is None
    if use_gpu is None:
        use_gpu = host and rdt in FLOAT_DTYPES and _gpu_available(kind)
    elif use_gpu and host:
        if rdt not in FLOAT_DTYPES:
            raise TypeError(
                f"{fn}: with use_gpu=True, a and b must have dtypes whose promotion is one of "
                f"{', '.join(FLOAT_DTYPES)}; got {rdt}"
            )
        if not _gpu_available(kind):
            raise RuntimeError(f"{fn}: use_gpu=True needs a CUDA GPU; none is available (cukit.is_available())")
    a2 = a if a.ndim >= 2 else a[None, :]
    b2 = b if b.ndim >= 2 else b[:, None]
    if kind == "torch":
        import torch

        grad_ctx: Any = torch.no_grad()
    else:
        grad_ctx = contextlib.nullcontext()
    with grad_ctx:
        full = _empty_like_kind((*batch, M, N), a, kind, rdt)
        if M and N:
            stage = _Stage(kind, rdt, prec, use_gpu and host)
            loaded: tuple[int, ...] | None = None
            for idx in np.ndindex(*batch):
                bidx = _sub_index(idx, b2.shape[:-2])
                if bidx != loaded:  # B once, or once per batch index where B is batched
                    stage.load_b(b2[bidx])
                    loaded = bidx
                ai, oi = a2[_sub_index(idx, a2.shape[:-2])], full[idx]
                for r0 in range(0, M, rows):
                    stage.block(ai[r0 : r0 + rows], oi[r0 : r0 + rows])
        result = full.reshape(out_shape)
        return result[()] if kind == "numpy" else result


def _byte_budget(max_bytes: Any, fn: str) -> int:
    """max_bytes as a whole number of bytes: a real number >= 1, rounded down."""
    if isinstance(max_bytes, (bool, np.bool_)) or not isinstance(max_bytes, numbers.Real):
        raise TypeError(f"{fn}: max_bytes must be a real number >= 1 (bytes); got {max_bytes!r} ({type_name(max_bytes)})")
    if not (math.isfinite(max_bytes) and max_bytes >= 1):
        raise ValueError(f"{fn}: max_bytes must be a real number >= 1 (bytes); got {max_bytes!r}")
    return math.floor(max_bytes)


def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        import torch

        return getattr(torch, dtype).itemsize


def _gpu_available(kind: str) -> bool:
    from cukit._device import is_available

    if not is_available():
        return False
    if kind == "torch":
        import torch

        return bool(torch.cuda.is_available())
    return True


def _sub_index(idx: tuple[int, ...], bshape: Sequence[int]) -> tuple[int, ...]:
    """The index into an operand's batch dimensions for a broadcast batch index."""
    lead = len(idx) - len(bshape)
    return tuple(0 if n == 1 else i for i, n in zip(idx[lead:], bshape, strict=True))


def _empty_like_kind(shape: tuple[int, ...], like: Any, kind: str, dtype: str) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=like.dtype if _dtype_name(like) == dtype else _np_dtype(dtype))
    return np.empty(shape, dtype=_np_dtype(dtype))


def _np_dtype(dtype: str) -> np.dtype:
    from cukit.interop import numpy_dtype

    return numpy_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype)


class _Stage:
    """One step of chunked_matmul: multiply a row block of A by B into the matching output rows."""

    def __init__(self, kind: str, dtype: str, precision: str, to_gpu: bool) -> None:
        self.kind, self.dtype, self.precision, self.to_gpu = kind, dtype, precision, to_gpu
        self.b: Any = None

    def _prepare(self, x: Any) -> Any:
        """x in the result dtype; on the GPU when host blocks are streamed through it."""
        if not self.to_gpu:
            return _astype(x, self.dtype, self.kind)
        if self.kind == "torch":
            import torch

            dev = torch.device("cuda", torch.cuda.current_device())
            return x.to(device=dev, dtype=getattr(torch, self.dtype))
        import cupy

        h = np.ascontiguousarray(x).astype(_np_dtype(self.dtype), copy=False)
        try:
            return cupy.asarray(h)
        except (TypeError, ValueError):  # a CuPy that does not know ml_dtypes' bfloat16: copy the bits
            return cupy.asarray(h.view(np.uint16)).view(h.dtype)

    def load_b(self, b: Any) -> None:
        self.b = None  # free the previous batch's B first
        self.b = self._prepare(b)

    def block(self, a_blk: Any, out_blk: Any) -> None:
        a_blk = self._prepare(a_blk)
        if self.to_gpu:
            c = _matmul_gpu(a_blk, self.b, precision=self.precision, pad=False)
            if self.kind == "torch":
                out_blk.copy_(c)
            else:
                c.get(out=out_blk)
        elif self.kind == "numpy":
            reference_numpy(a_blk, self.b, out=out_blk)
        elif device_of(out_blk) is None:  # torch CPU
            out_blk.copy_(reference_torch(a_blk, self.b))
        else:
            _matmul_gpu(a_blk, self.b, precision=self.precision, out=out_blk, pad=False)


# ---------------------------------------------------------------------------------------------
# Kernel selection
# ---------------------------------------------------------------------------------------------

_FORCED: str | None = None


@contextlib.contextmanager
def force_kernel(kernel: str | None) -> Iterator[None]:
    """Make every GPU matmul/linear in the block use one kernel family, to compare them (tests,
    benchmarks, ``examples/cnn_matmul_kernels.py``): "simt", "tc", or a family with a version such
    as "simt_v1" (prepared with ``module.prepare(g, version="v1")``). None restores the heuristic.

    Process-wide (a module global, not a context variable): torch runs CUDA backward passes on its
    own threads, which must see it too. Not thread-safe; nest freely."""
    global _FORCED
    if kernel is not None:
        _parse_kernel(kernel)
    prev, _FORCED = _FORCED, kernel
    try:
        yield
    finally:
        _FORCED = prev


def _parse_kernel(kernel: str) -> tuple[str, str | None]:
    family, _, variant = kernel.partition("_")
    if family not in KERNEL_FAMILIES:
        raise ValueError(
            f"cukit.ops.matmul.force_kernel: kernel must be a family ({', '.join(KERNEL_FAMILIES)}), optionally "
            f"with a variant (e.g. 'simt_v1'); got unknown matmul kernel {kernel!r}"
        )
    return family, variant or None


def _family(name: str) -> ModuleType | None:
    """The kernel family's module, or None when it is not part of this installation."""
    modname = KERNEL_FAMILIES[name]
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name == modname:
            return None
        raise


def _family_order(g: Gemm) -> tuple[str, str]:
    if g.dtype.name in ("float16", "bfloat16") or (g.dtype.name == "float32" and g.precision == "tf32"):
        return ("tc", "simt")
    return ("simt", "tc")


def _describe(g: Gemm) -> str:
    lay = ("row" if g.a_row_major else "col") + "/" + ("row" if g.b_row_major else "col")
    return (
        f"{g.dtype.name} M={g.M} N={g.N} K={g.K} batch={g.batch} layouts(A/B)={lay} precision={g.precision}"
        f"{' +bias' if g.bias else ''}{f' act={g.act}' if g.act >= 0 else ''}"
        f"{f' C={g.out_dtype.name} epilogue={g.epilogue}' if g.epilogue else ''}"
    )


def select_kernel(g: Gemm) -> ModuleType:
    """The kernel family that runs ``g``: the heuristic.

    1. bfloat16/float16 inputs, and float32 with precision "tf32": the tensor-core family
       (``matmul_tc``), which is what makes those precisions fast. Within it
       (``matmul_tc.route``): on compute capability 9.0, 16-bit problems with 16-byte aligned rows
       run on the TMA + warp-specialised wgmma kernel (any layout); misaligned ``x @ W.T`` on the
       cp.async wgmma kernel; everything else on mma.sync. Large misaligned 16-bit problems
       (>= 2^30 multiply-adds) first get 16-byte aligned operand copies (``cukit.ops.repack``,
       ~20 us per 32 MB operand) and then take the TMA kernel ("pad-and-run").
    2. float32 "ieee" and float64: the SIMT family (``matmul_simt``): tensor cores would round
       float32 inputs (tf32) and Hopper has no mma.sync path that is faster for float64.
    3. If the preferred family is not installed or its ``supports(g)`` says no (a dtype, layout,
       alignment or size it does not handle), the other family. For a tf32 problem no family takes,
       the "ieee" version of it is tried (tf32 is a permission, like torch's allow_tf32, not a
       requirement); ``_matmul_gpu`` then retries with contiguous operand copies.

    Raises TypeError for a dtype no family handles (not a float type), NotImplementedError when no
    installed family supports the problem.
    """
    return _plan(g)[0]


def _plan(g: Gemm, kernel: str | None = None) -> tuple[ModuleType, Gemm, str | None]:
    """(family module, the Gemm to launch (its precision may be lowered to "ieee"), variant)."""
    if g.dtype.name not in FLOAT_DTYPES:
        raise TypeError(f"matmul kernels support {', '.join(FLOAT_DTYPES)}; got {g.dtype.name}")
    candidates = [g] if g.precision == "ieee" else [g, dataclasses.replace(g, precision="ieee")]
    if kernel is not None:
        family, variant = _parse_kernel(kernel)
        mod = _family(family)
        if mod is None:
            raise NotImplementedError(f"matmul kernel family {family!r} ({KERNEL_FAMILIES[family]}) is not installed")
        for cand in candidates:
            if mod.supports(cand):
                return mod, cand, variant
        raise NotImplementedError(f"{KERNEL_FAMILIES[family]}.supports() declines {_describe(g)}")
    notes: list[str] = []
    for cand in candidates:
        for family in _family_order(cand):
            mod = _family(family)
            if mod is None:
                notes.append(f"{KERNEL_FAMILIES[family]} is not installed")
                continue
            if mod.supports(cand):
                return mod, cand, None
            notes.append(f"{KERNEL_FAMILIES[family]}.supports() declines it")
    raise NotImplementedError(f"no matmul kernel for {_describe(g)}: {'; '.join(dict.fromkeys(notes))}")


def _prepare(mod: ModuleType, g: Gemm, variant: str | None, workspace: Workspace | None = None) -> Any:
    """The family's ready launch for ``g`` (``run(g.head(), stream)``); a variant such as "v1" goes
    to ``prepare(g, version=variant)``. workspace: scratch memory for families that can split K
    (``SPLITS_K``), which then decide whether to."""
    if variant is None:
        if workspace is not None and getattr(mod, "SPLITS_K", False):
            return mod.prepare(g, workspace=workspace)
        return mod.prepare(g)
    return mod.prepare(g, version=variant)


def _workspace(kind: str, device: int) -> Workspace:
    """An allocator of scratch bytes on `device` from the caller's library (see
    ``cukit.ops._gemm.Workspace``): torch's caching allocator on its current stream (the stream the
    launch uses; CUDA-graph capture included), or CuPy's pool."""
    if kind == "torch":
        import torch

        dev = torch.device("cuda", device)

        def alloc(nbytes: int) -> tuple[Any, int]:
            t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            return t, t.data_ptr()

        return alloc
    import cupy

    def alloc_cupy(nbytes: int) -> tuple[Any, int]:
        with cupy.cuda.Device(device):
            a = cupy.empty(nbytes, dtype=cupy.uint8)
        return a, a.data.ptr

    return alloc_cupy


# ---------------------------------------------------------------------------------------------
# GPU path: arrays -> Gemm
# ---------------------------------------------------------------------------------------------


def _ptr(x: Any, kind: str) -> int:
    return x.data_ptr() if kind == "torch" else x.data.ptr


def _expand(x: Any, shape: tuple[int, ...], kind: str) -> Any:
    if kind == "torch":
        return x.expand(shape)
    import cupy

    return cupy.broadcast_to(x, shape)


def _matrix_layout(r: int, c: int, sr: int, sc: int) -> tuple[int, int] | None:
    """(row stride, column stride) for a (r, c) matrix with exactly one unit stride, as Gemm wants;
    the strides of size-1 sides are free and chosen so the layout looks contiguous. None: no unit
    stride (the operand must be copied)."""
    if r <= 1 and c <= 1:
        return (max(c, 1), 1)
    if c <= 1:  # a column: column-major when its elements are adjacent
        return (1, r) if sr == 1 else (sr, 1)
    if r <= 1:  # a row
        return (c, 1) if sc == 1 else (1, sc)
    if sc == 1 and sr != 1:
        return (sr, 1)
    if sr == 1 and sc != 1:
        return (1, sc)
    return None


def _operand(x: Any, kind: str, r: int, c: int) -> tuple[Any, tuple[int, ...], tuple[int, int]]:
    """(array to read, its batch strides, its matrix strides), copying x when no layout fits."""
    st = element_strides(x, kind)
    lay = None if st is None else _matrix_layout(r, c, st[-2], st[-1])
    if lay is None:
        x = _contiguous(x, kind)
        st = element_strides(x, kind)
        assert st is not None
        lay = _matrix_layout(r, c, st[-2], st[-1])
        assert lay is not None
    return x, st[:-2], lay


def _batch_dims(
    batch: tuple[int, ...], a_shape: Sequence[int], a_st: Sequence[int], b_shape: Sequence[int], b_st: Sequence[int]
) -> list[tuple[int, int, int]]:
    """The broadcast batch dimensions as [(size, A stride, B stride)], outermost first, with size-1
    dimensions dropped and adjacent dimensions merged where both operands (and the contiguous C)
    allow it. A stride of 0 means the operand is broadcast along that dimension."""

    def aligned(shape: Sequence[int], st: Sequence[int]) -> list[int]:
        lead = len(batch) - len(shape)
        return [0 if i < lead or shape[i - lead] == 1 else st[i - lead] for i in range(len(batch))]

    sa, sb = aligned(a_shape, a_st), aligned(b_shape, b_st)
    dims: list[tuple[int, int, int]] = []
    for n, x, y in zip(batch, sa, sb, strict=True):
        if n == 1:
            continue
        if dims:
            pn, px, py = dims[-1]
            if px == x * n and py == y * n:  # outer = inner * n for both operands: one dimension
                dims[-1] = (pn * n, x, y)
                continue
        dims.append((n, x, y))
    return dims


def _build_gemm(
    a: Any,
    b: Any,
    kind: str,
    *,
    batch: tuple[int, ...],
    M: int,
    K: int,
    N: int,
    c_ptr: int,
    bias_ptr: int,
    act: int,
    precision: str,
    device: int,
    dtype: DType,
    contiguous: bool = False,
) -> tuple[Gemm, Any, Any]:
    """The Gemm for a (..., M, K) @ b (..., K, N) into the contiguous C at c_ptr, and the arrays it
    reads (keep them alive until the launch is enqueued).

    Operands with no unit stride in their last two dimensions (or negative CuPy strides) are copied.
    More than MAX_BATCH_DIMS batch dimensions that do not merge: both operands are made contiguous;
    if that is still too many (broadcasting interleaves), the broadcast is materialised (expanded
    copies), which leaves one batch dimension. When B is the same matrix for every batch and A's
    batches follow each other with A's row stride, the batch is folded into M (one big GEMM).
    """
    if contiguous:
        a, b = _contiguous(a, kind), _contiguous(b, kind)
    a, a_bst, (sa_m, sa_k) = _operand(a, kind, M, K)
    b, b_bst, (sb_k, sb_n) = _operand(b, kind, K, N)
    dims = _batch_dims(batch, a.shape[:-2], a_bst, b.shape[:-2], b_bst)
    if len(dims) > MAX_BATCH_DIMS:
        a, a_bst, (sa_m, sa_k) = _operand(_contiguous(a, kind), kind, M, K)
        b, b_bst, (sb_k, sb_n) = _operand(_contiguous(b, kind), kind, K, N)
        dims = _batch_dims(batch, a.shape[:-2], a_bst, b.shape[:-2], b_bst)
    if len(dims) > MAX_BATCH_DIMS:
        a = _contiguous(_expand(a, (*batch, M, K), kind), kind)
        b = _contiguous(_expand(b, (*batch, K, N), kind), kind)
        a, a_bst, (sa_m, sa_k) = _operand(a, kind, M, K)
        b, b_bst, (sb_k, sb_n) = _operand(b, kind, K, N)
        dims = _batch_dims(batch, a.shape[:-2], a_bst, b.shape[:-2], b_bst)
        assert len(dims) <= 1
    m_eff = M
    if len(dims) == 1 and dims[0][2] == 0:  # B is one matrix for every batch: try one big GEMM
        n, za, _ = dims[0]
        if M == 1 and sa_k == 1 and (za != 1 or K <= 1):
            sa_m = za  # a single row's stride is free: rows then follow each other by za
        if za == M * sa_m:  # A's batches continue its rows: A is (n * M, K) with the same strides
            m_eff, dims = M * n, []
    dims = [(1, 0, 0)] * (MAX_BATCH_DIMS - len(dims)) + dims
    g = Gemm(
        dtype=dtype,
        M=m_eff,
        N=N,
        K=K,
        a=_ptr(a, kind),
        b=_ptr(b, kind),
        c=c_ptr,
        bias=bias_ptr,
        act=act,
        sa_m=sa_m,
        sa_k=sa_k,
        sb_k=sb_k,
        sb_n=sb_n,
        batch=(dims[0][0], dims[1][0], dims[2][0]),
        sa_batch=(dims[0][1], dims[1][1], dims[2][1]),
        sb_batch=(dims[0][2], dims[1][2], dims[2][2]),
        precision=precision if dtype.name == "float32" else "ieee",
        device=device,
    )
    return g, a, b


def _extent(x: Any, kind: str) -> tuple[int, int] | None:
    """The byte range [lo, hi) an array's elements occupy, None when it has none."""
    if any(n == 0 for n in x.shape):
        return None
    st = tuple(x.stride()) if kind == "torch" else tuple(s // x.itemsize for s in x.strides)
    isz = x.element_size() if kind == "torch" else x.itemsize
    p = _ptr(x, kind)
    lo = sum(min(0, (n - 1) * s) for n, s in zip(x.shape, st, strict=True))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(x.shape, st, strict=True))
    return p + lo * isz, p + (hi + 1) * isz


def _overlaps(x: Any, others: Sequence[Any], kind: str) -> bool:
    ex = _extent(x, kind)
    if ex is None:
        return False
    for o in others:
        if o is None:
            continue
        eo = _extent(o, kind)
        if eo is not None and ex[0] < eo[1] and eo[0] < ex[1]:
            return True
    return False


def _empty_gpu(shape: tuple[int, ...], like: Any, kind: str, device: int) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)
    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        return cupy.empty(shape, dtype=like.dtype)
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=like.dtype)


# Misaligned 16-bit problems (a leading dimension or pointer that is not a multiple of 16 bytes,
# e.g. K = 4093) of at least this many multiply-adds are repacked into 16-byte aligned copies and
# run on the TMA kernels ("pad-and-run"): the copies cost two passes over A and B at copy
# bandwidth (~40 us for 4097 x 4093 bf16), the staged kernel ~2-4x the aligned one's time.
_PAD_MIN_MACS = 1 << 30


def _pad_operand(x: Any, kind: str, device: int) -> Any:
    """A copy of x (..., R, C) with the same values and shape whose rows start 16-byte aligned
    (cukit.ops.repack): the unit-stride dimension (the last one unless x is a transposed view)
    padded to a multiple of 8 elements, the layout kept."""
    from cukit.ops.repack import aligned_copy

    strides = element_strides(x, kind)
    if strides is not None and strides[-1] != 1 and strides[-2] == 1 and x.shape[-1] > 1:
        xt = x.mT if kind == "torch" else x.swapaxes(-1, -2)
        y = aligned_copy(xt)
        return y.mT if kind == "torch" else y.swapaxes(-1, -2)
    return aligned_copy(x)


def _pad_pays(g: Gemm, mod: ModuleType, kind: str) -> bool:
    """Whether repacking the operands moves ``g`` from the staged (misaligned) tensor-core path to
    the TMA kernels (the family's ``tma_if_aligned``) and is worth two copies (see _PAD_MIN_MACS)."""
    tma_if_aligned = getattr(mod, "tma_if_aligned", None)
    if tma_if_aligned is None or g.M * g.N * g.K * g.batch_count < _PAD_MIN_MACS:
        return False
    if mod.load_path(g) != 0 or not tma_if_aligned(g):
        return False
    if kind == "cupy":  # no CuPy pool allocation inside a CUDA-graph capture
        import cupy

        if cupy.cuda.get_current_stream().is_capturing():
            return False
    return True


class _GemmPlan:
    """What a matmul call with a known signature needs: the result's shape and a ready launch
    (``run((a, b, c, bias), stream)``, from the kernel family's ``prepare``)."""

    __slots__ = ("out_shape", "run")

    def __init__(self, out_shape: tuple[int, ...], run: Any) -> None:
        self.out_shape, self.run = out_shape, run


# Signatures -> _GemmPlan. Plans exist only for calls that launch on the caller's arrays as they
# are (no operand copy, no padding): their pointers are the only per-call inputs.
_PLANS = PlanCache("matmul", maxsize=1024)


def _plan_key(tag: str, a: Any, b: Any, bias: Any, act: int, precision: str, kernel: str | None) -> tuple:
    """A call's signature: everything a plan is derived from (kinds, shapes, strides, dtypes,
    devices, 16-byte alignment of every pointer, options), never the pointers themselves."""
    if type(a) is np.ndarray or type(b) is np.ndarray:
        raise TypeError("cukit.ops.matmul._matmul_gpu: a and b must be CUDA arrays; got a numpy.ndarray")
    if hasattr(a, "data_ptr"):  # torch (tensor subclasses included: only their pointers are read)
        bk = None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device(), bias.data_ptr() & 15)
        return (
            tag, a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15,
            b.shape, b.stride(), b.dtype, b.get_device(), b.data_ptr() & 15, type(b) is type(a),
            bk, act, precision, kernel,
        )
    bk = None if bias is None else (bias.shape, bias.strides, bias.dtype, _cupy_device(bias), bias.data.ptr & 15)
    return (
        tag, a.shape, a.strides, a.dtype, _cupy_device(a), a.data.ptr & 15,
        b.shape, b.strides, b.dtype, _cupy_device(b), b.data.ptr & 15, type(b) is type(a),
        bk, act, precision, kernel,
    )


def _cupy_device(x: Any) -> int:
    dev = getattr(x, "device", None)
    return -1 if dev is None else dev.id


def _matmul_gpu(
    a: Any,
    b: Any,
    *,
    precision: str = "ieee",
    kernel: str | None = None,
    out: Any = None,
    bias: Any = None,
    act: int = -1,
    pad: bool = True,
    tag: str = "matmul",
    check: Callable[[], Any] | None = None,
) -> Any:
    """``act(a @ b + bias)`` on the GPU with ``numpy.matmul`` shape semantics: the launch path of
    every GPU matmul (and the hook tests and benchmarks call; not public API).

    a, b: CuPy arrays or torch CUDA tensors of the same type, device and float dtype (no
    promotion here). bias: None or (N,) of that dtype; act: -1 or an id of ``ACTIVATIONS``.
    kernel: None (``select_kernel``'s heuristic, or ``force_kernel``'s), "simt", "tc" or
    "simt_v1" etc. out: None, or an array of the result's shape and dtype: written directly when it
    is contiguous and overlaps no input, else through a temporary. pad: large misaligned 16-bit
    problems run on 16-byte aligned copies of the operands (see _PAD_MIN_MACS; chunked_matmul
    turns it off to stay within its memory budget). tag: names the calling op in the plan key.
    check: the calling op's own validation, run on a signature's first call only.

    The result is allocated with the caller's library on the inputs' device; the launch goes on
    ``cukit.interop.current_stream(device, torch_involved)``. A call whose signature (see
    ``_plan_key``) was seen before is a plan-cache lookup, an allocation and a launch: it is
    validated only the first time.
    """
    forced = kernel if kernel is not None else _FORCED
    key = None
    if out is None and pad:
        key = _plan_key(tag, a, b, bias, act, precision, forced)
        plan = _PLANS.get(key)
        if plan is not None:
            if hasattr(a, "data_ptr"):
                c = a.new_empty(plan.out_shape)
                dev = a.get_device()
                plan.run((a.data_ptr(), b.data_ptr(), c.data_ptr(), 0 if bias is None else bias.data_ptr()),
                         current_stream(dev, True))
                return c
            c = _empty_gpu(plan.out_shape, a, "cupy", a.device.id)
            plan.run((a.data.ptr, b.data.ptr, c.data.ptr, 0 if bias is None else bias.data.ptr),
                     current_stream(a.device.id, False))
            return c
    if check is not None:
        check()
    return _matmul_gpu_slow(a, b, precision=precision, forced=forced, out=out, bias=bias, act=act, pad=pad, key=key)


def _matmul_gpu_slow(
    a: Any,
    b: Any,
    *,
    precision: str,
    forced: str | None,
    out: Any,
    bias: Any,
    act: int,
    pad: bool,
    key: tuple | None,
) -> Any:
    """The first call of a signature (validate, build the Gemm, pick and prepare the kernel, cache
    the plan when it launches on the caller's arrays as they are), and every call with ``out=``,
    operand copies or padding."""
    fn = "cukit.linear" if key is not None and key[0] == "linear" else "cukit.matmul"
    kind, device = _validate_pair(a, b, fn=fn)
    if bias is not None:
        _validate_pair(a, bias, "bias", fn=fn)
    name = _dtype_name(a, kind)
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: a on the GPU must have dtype {', '.join(FLOAT_DTYPES)}; got {name}")
    if b.dtype != a.dtype or (bias is not None and bias.dtype != a.dtype):
        raise TypeError(
            f"cukit.ops.matmul._matmul_gpu: b and bias must have a's dtype {name} (no promotion here); got "
            f"{_dtype_name(b, kind)}{'' if bias is None else ' and ' + _dtype_name(bias, kind)}"
        )
    dt = DTYPES[name]
    if kind == "numpy" or device is None:
        raise ValueError("cukit.ops.matmul._matmul_gpu: a and b must be CUDA arrays; got arrays on the CPU")
    batch, M, K, N, out_shape = matmul_shape(tuple(a.shape), tuple(b.shape), fn=fn)
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"cukit.ops.matmul._matmul_gpu: bias must have shape ({N},); got {tuple(bias.shape)}")
    direct = (
        out is not None
        and tuple(out.shape) == out_shape
        and out.dtype == a.dtype
        and _is_contiguous(out, kind)
        and not _overlaps(out, (a, b, bias), kind)
    )
    c = out if direct else _empty_gpu(out_shape, a, kind, device)
    if M * N * math.prod(batch) > 0:
        a2 = a if a.ndim >= 2 else a[None, :]
        b2 = b if b.ndim >= 2 else b[:, None]
        bias_in = bias
        if bias is not None:
            bias = _contiguous(bias, kind)
        args = {
            "batch": batch,
            "M": M,
            "K": K,
            "N": N,
            "c_ptr": _ptr(c, kind),
            "bias_ptr": 0 if bias is None else _ptr(bias, kind),
            "act": act,
            "precision": precision,
            "device": device,
            "dtype": dt,
        }
        g, ka, kb = _build_gemm(a2, b2, kind, **args)
        try:
            mod, g, variant = _plan(g, forced)
        except NotImplementedError:
            if _is_contiguous(ka, kind) and _is_contiguous(kb, kind):
                raise
            g, ka, kb = _build_gemm(a2, b2, kind, contiguous=True, **args)
            mod, g, variant = _plan(g, forced)
        if pad and variant is None and _pad_pays(g, mod, kind):
            g2, pa, pb = _build_gemm(_pad_operand(a2, kind, device), _pad_operand(b2, kind, device), kind, **args)
            if mod.supports(g2) and mod.uses_tma(g2):
                g, ka, kb = g2, pa, pb
        run = _prepare(mod, g, variant, _workspace(kind, device))
        run(g.head(), current_stream(device, kind == "torch"))
        as_is = g.a == _ptr(a, kind) and g.b == _ptr(b, kind) and (bias is None or g.bias == _ptr(bias_in, kind))
        if key is not None and as_is and not direct:
            _PLANS.put(key, _GemmPlan(out_shape, run))
        del ka, kb  # the launch is enqueued: copies may go back to the pool (stream-ordered)
    elif key is not None:
        _PLANS.put(key, _GemmPlan(out_shape, _noop_run))
    if out is not None and not direct:
        if kind == "torch":
            out.copy_(c)
        else:
            out[...] = c
        return out
    return c


def _noop_run(head: tuple[int, ...], stream: Any) -> None:
    """The launch of an empty product (M, N or the batch is 0): nothing to compute."""


def linear_gpu(
    x: Any,
    weight: Any,
    bias: Any,
    act: int,
    *,
    precision: str = "ieee",
    kernel: str | None = None,
    check: Callable[[], Any] | None = None,
) -> Any:
    """``act(x @ weight.T + bias)`` in one GEMM launch (bias/activation epilogue) for CUDA arrays;
    validated on a signature's first call. weight (out, in), row-major, is read as B with
    sb_k = 1, sb_n = in: no copy."""
    if weight.ndim != 2:
        raise ValueError(
            f"cukit.linear: weight must be 2-D (out_features, in_features); got shape {tuple(weight.shape)}"
        )
    w_t = weight.t() if hasattr(weight, "data_ptr") else weight.T
    return _matmul_gpu(x, w_t, precision=precision, kernel=kernel, bias=bias, act=act, tag="linear", check=check)


# ---------------------------------------------------------------------------------------------
# gemm: out = alpha * (a @ b) + beta * out, into an existing output
# ---------------------------------------------------------------------------------------------

_GEMM = "cukit.ops.matmul.gemm"
_OVERLAP = f"{_GEMM}: out must not overlap a or b (it is written while they are read); got overlapping memory"
_WIDE_OUT = ("float16", "bfloat16")  # a dtypes whose products gemm may write in float32


def gemm(a: Any, b: Any, out: Any, *, alpha: float = 1.0, beta: float = 0.0, precision: str | None = None) -> Any:
    """Matrix product into an existing output: ``out = alpha * (a @ b) + beta * out``.

    The BLAS GEMM, for code that accumulates products (``dW += G^T @ X`` over chunks of tokens:
    ``beta=1``), keeps float32 results of 16-bit inputs, or writes into part of a larger buffer.

    Args:
        a: (M, K) and b: (K, N), 2-D (or 3-D, see out), one dtype (float16, bfloat16, float32 or float64; no
            promotion). CuPy arrays or torch CUDA tensors run cukit's kernels; NumPy arrays and
            torch CPU tensors run the reference (:func:`gemm_reference_numpy`,
            :func:`gemm_reference_torch`). Each must have a unit stride along one dimension: a
            transposed view (``x.T``, ``x.mT``: ``gemm(g.T, x, dw)`` is dW = G^T X) or a slice of a
            larger array is read in place; nothing is copied.
        out: (M, N), the same array type and device; dtype a's, or float32 when a is float16 or
            bfloat16 (the fp32 accumulation written without rounding to 16 bits). Unit column
            stride and row stride >= N: a row slice or a column block of a larger buffer is
            written in place and its other elements are untouched. It must not overlap a or b.
            Batched: a (B, M, K), b (B, K, N) and out (B, M, N), all 3-D with one batch size
            (no broadcasting of shapes), give ``out[z] = alpha * (a[z] @ b[z]) + beta * out[z]``
            in one launch; each matrix follows the rules above, a's and b's batch strides are
            free (0 reads one matrix for every z), out's matrices must not overlap.
        alpha, beta: real numbers (Python or NumPy scalars), applied in the accumulation type
            (float32; float64 for float64). beta == 0 never reads out (it may hold NaN or
            garbage); otherwise each element of out is read once. alpha multiplies the product
            (IEEE: alpha == 0 with an infinite product gives NaN).
        precision: None (the global setting), "ieee" or "tf32", as for ``cukit.matmul`` (float32
            inputs only).

    Returns:
        out.

    On CUDA: one kernel launch on the current stream (torch's for tensors), no allocation, no host
    synchronisation. A call whose signature (shapes, strides, dtypes, device, 16-byte alignment,
    whether beta is 0: not the values of alpha and beta) was seen before is a plan-cache lookup and
    a launch. Not differentiable: out is written through its pointer, unseen by torch's autograd.

    Raises:
        TypeError (array types, dtypes, alpha/beta) and ValueError (shapes, strides, devices,
        overlap), each naming ``cukit.ops.matmul.gemm`` and the argument; NotImplementedError when
        no kernel family runs the problem on the device.

    See also: ``torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)``, BLAS ``?gemm``,
    ``cukit.matmul``.
    """
    if type(alpha) is not float or type(beta) is not float:
        alpha, beta = _gemm_scalars(alpha, beta)
    prec = _PRECISION if precision is None else _check_precision(precision, _GEMM)
    try:
        key = _gemm_key(a, b, out, beta != 0.0, prec)
    except (AttributeError, TypeError):  # not three CUDA arrays of one kind: the first-call checks say why
        return _gemm_first(a, b, out, alpha, beta, prec, None)
    plan = _PLANS.get(key)
    if plan is None:
        return _gemm_first(a, b, out, alpha, beta, prec, key)
    if hasattr(a, "data_ptr"):
        pa, pb, pc = a.data_ptr(), b.data_ptr(), out.data_ptr()
        stream = current_stream(a.get_device(), True)
    else:
        pa, pb, pc = a.data.ptr, b.data.ptr, out.data.ptr
        stream = current_stream(a.device.id, False)
    if plan.ext is not None:
        _check_disjoint(pa, pb, pc, plan.ext)
    plan.run((pa, pb, pc, 0, alpha, beta), stream)
    return out


_GEMM_DS = "cukit.ops.matmul.gemm_device_scale"


def gemm_device_scale(a: Any, b: Any, out: Any, scale: Any) -> bool:
    """``out = scale[0] * (a @ b)``, the float32 product scaled and rounded once into out, where
    ``scale`` is read on the device when the kernel runs: a product scaled by values that earlier
    kernels computed (a mean loss's 1 / count times its upstream gradient), with no host sync.

    Runs where the TMA kernels do (compute capability 9.0; a, b and out bfloat16 or float16, one
    dtype, rows 16-byte aligned; :func:`cukit.ops.matmul_tc.supports`) and returns True; elsewhere
    (other devices and dtypes, CPU arrays) it launches nothing and returns False, and the caller
    takes another route (a float32 product, then a scaling cast). Arrays as :func:`gemm`'s
    (2-D or batched 3-D, read in place); scale: a 1-element float32 array of the same kind and
    device. A signature seen before is a plan-cache lookup and, where it runs, one launch.

    Raises: TypeError / ValueError (arrays as :func:`gemm`'s, scale's kind, dtype, size, device),
    each naming ``cukit.ops.matmul.gemm_device_scale`` and the argument.

    See also: :func:`gemm` (a host alpha), ``torch.mm(a, b) * scale``.
    """
    try:
        key = (*_gemm_key(a, b, out, False, _PRECISION), "device scale", _scale_sig(scale))
    except (AttributeError, TypeError):  # not CUDA arrays of one kind: the first call's checks say why
        return _gemm_device_scale_first(a, b, out, scale, None)
    plan = _PLANS.get(key)
    if plan is None:
        return _gemm_device_scale_first(a, b, out, scale, key)
    if plan is False:
        return False
    if hasattr(a, "data_ptr"):
        pa, pb, pc, ps = a.data_ptr(), b.data_ptr(), out.data_ptr(), scale.data_ptr()
        stream = current_stream(a.get_device(), True)
    else:
        pa, pb, pc, ps = a.data.ptr, b.data.ptr, out.data.ptr, scale.data.ptr
        stream = current_stream(a.device.id, False)
    if plan.ext is not None:
        _check_disjoint(pa, pb, pc, plan.ext, _GEMM_DS)
    plan.run((pa, pb, pc, ps, 1.0, 0.0), stream)
    return True


def _scale_sig(scale: Any) -> tuple:
    if hasattr(scale, "data_ptr"):
        return (type(scale), scale.shape, scale.dtype, scale.get_device(), scale.data_ptr() & 3)
    return (type(scale), scale.shape, scale.dtype, scale.device.id, scale.data.ptr & 3)


def _gemm_device_scale_first(a: Any, b: Any, out: Any, scale: Any, key: tuple | None) -> bool:
    fn = _GEMM_DS
    kind, device = _validate_gemm(a, b, out, fn)
    _validate_pair(a, scale, "scale", fn=fn)
    if _dtype_name(scale, kind) != "float32" or math.prod(scale.shape) != 1:
        raise TypeError(f"{fn}: scale must be a 1-element float32 array; got {_dtype_name(scale, kind)} of shape "
                        f"{tuple(scale.shape)}")
    plan: Any = False
    name, oname = _dtype_name(a, kind), _dtype_name(out, kind)
    if device is not None and name in _WIDE_OUT and oname == name and math.prod(out.shape) and a.shape[-1]:
        g = _gemm_problem(a, b, out, kind, device, alpha=1.0, beta=0.0, precision=_PRECISION)
        g = dataclasses.replace(g, device_scale=True, bias=_ptr(scale, kind))
        try:
            mod, g, variant = _plan(g, _FORCED)
        except NotImplementedError:  # no TMA kernel for it: the caller's other route
            mod = None
        if mod is not None:
            span_c = _span(out, kind)
            ext = None if span_c is None else (span_c, _span(a, kind), _span(b, kind))
            if ext is not None:
                _check_disjoint(_ptr(a, kind), _ptr(b, kind), _ptr(out, kind), ext, fn)
            plan = _GemmIntoPlan(_prepare(mod, g, variant), ext)
            plan.run(g.head(), current_stream(device, kind == "torch"))
    if key is not None:
        _PLANS.put(key, plan)
    return plan is not False


def _gemm_scalars(alpha: Any, beta: Any) -> tuple[float, float]:
    """alpha and beta as Python floats (the kernels take doubles); TypeError for anything but a
    real number (a 0-d tensor would need a host sync)."""
    vals = []
    for name, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise TypeError(f"{_GEMM}: {name} must be a real number (a Python or NumPy scalar); got {type_name(v)}")
        vals.append(float(v))
    return vals[0], vals[1]


def _gemm_key(a: Any, b: Any, out: Any, reads_c: bool, precision: str) -> tuple:
    """A gemm call's signature (see _plan_key): AttributeError/TypeError when a, b and out are not
    CUDA arrays of one library (the first-call checks then name the problem)."""
    if hasattr(a, "data_ptr"):  # torch
        return (
            "gemm", a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15,
            b.shape, b.stride(), b.dtype, b.get_device(), b.data_ptr() & 15,
            out.shape, out.stride(), out.dtype, out.get_device(), out.data_ptr() & 15,
            type(b) is type(a) and type(out) is type(a), reads_c, precision, _FORCED,
        )
    return (
        "gemm", a.shape, a.strides, a.dtype, a.device.id, a.data.ptr & 15,
        b.shape, b.strides, b.dtype, b.device.id, b.data.ptr & 15,
        out.shape, out.strides, out.dtype, out.device.id, out.data.ptr & 15,
        type(b) is type(a) and type(out) is type(a), reads_c, precision, _FORCED,
    )


class _GemmIntoPlan:
    """A gemm signature's ready launch (``run((a, b, out, 0, alpha, beta), stream)``) and the byte
    ranges its arrays span relative to their pointers (:func:`_check_disjoint`; None: out is empty)."""

    __slots__ = ("ext", "run")

    def __init__(self, run: Any, ext: tuple | None) -> None:
        self.run, self.ext = run, ext


def _span(x: Any, kind: str) -> tuple[int, int] | None:
    """The byte range [lo, hi) of x's elements relative to its data pointer; None when empty."""
    ext = _extent(x, kind)
    if ext is None:
        return None
    p = _ptr(x, kind)
    return ext[0] - p, ext[1] - p


def _check_disjoint(pa: int, pb: int, pc: int, ext: tuple, fn: str = _GEMM) -> None:
    """ValueError naming `fn` when out's byte range (at pc) meets a's (pa) or b's (pb): ext is
    (out's span, a's span or None, b's span or None), spans relative to the pointers."""
    (c0, c1), sa, sb = ext
    lo, hi = pc + c0, pc + c1
    if (sa is not None and pa + sa[0] < hi and lo < pa + sa[1]) or (sb is not None and pb + sb[0] < hi and lo < pb + sb[1]):
        raise ValueError(_OVERLAP.replace(_GEMM, fn))


def _strides_text(x: Any, kind: str) -> str:
    st = element_strides(x, kind)
    return f"element strides {st}" if st is not None else f"byte strides {tuple(x.strides)}"


def _validate_gemm(a: Any, b: Any, out: Any, fn: str = _GEMM) -> tuple[str, int | None]:
    """gemm's checks: (array kind, device), or TypeError/ValueError naming the argument."""
    kind, device = _validate_pair(a, b, fn=fn)
    _validate_pair(a, out, "out", fn=fn)
    name = _dtype_name(a, kind)
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: a must have dtype {', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}; got {name}")
    if _dtype_name(b, kind) != name:
        raise TypeError(f"{fn}: b must have a's dtype {name} (no dtype promotion here); got {_dtype_name(b, kind)}")
    outs = (name, "float32") if name in _WIDE_OUT else (name,)
    if _dtype_name(out, kind) not in outs:
        raise TypeError(
            f"{fn}: out must have dtype {' or '.join(outs)} (a's{', or float32 for 16-bit a' if len(outs) > 1 else ''}); "
            f"got {_dtype_name(out, kind)}"
        )
    if a.ndim == 3:  # batched: (B, M, K) @ (B, K, N) -> (B, M, N)
        for nm, x, want in (("b", b, "(B, K, N)"), ("out", out, "(B, M, N)")):
            if x.ndim != 3:
                raise ValueError(f"{fn}: {nm} must be 3-D {want} like a (B, M, K); got shape {tuple(x.shape)}")
        for nm, x in (("b", b), ("out", out)):
            if x.shape[0] != a.shape[0]:
                raise ValueError(
                    f"{fn}: {nm} must have a's batch size {a.shape[0]} (no broadcasting); got shape {tuple(x.shape)}"
                )
    else:
        for nm, x, want in (("a", a, "(M, K)"), ("b", b, "(K, N)"), ("out", out, "(M, N)")):
            if x.ndim != 2:
                raise ValueError(
                    f"{fn}: {nm} must be 2-D {want}{' (or a, b, out all 3-D)' if nm == 'a' else ''}; "
                    f"got shape {tuple(x.shape)}"
                )
    M, K = (int(n) for n in a.shape[-2:])
    if b.shape[-2] != K:
        raise ValueError(
            f"{fn}: b must have K = {K} rows, a's last dimension (b is (K, N)); got shape {tuple(b.shape)} "
            f"(a.shape={tuple(a.shape)})"
        )
    N = int(b.shape[-1])
    if tuple(out.shape[-2:]) != (M, N):
        raise ValueError(f"{fn}: out must have shape (M, N) = {(M, N)}; got {tuple(out.shape)}")
    for nm, x, (r, c) in (("a", a, (M, K)), ("b", b, (K, N))):
        if r * c == 0:  # nothing is read: any strides
            continue
        st = element_strides(x, kind)
        if st is None or _matrix_layout(r, c, st[-2], st[-1]) is None or any(
            s == 0 and n > 1 for n, s in zip(x.shape[-2:], st[-2:], strict=True)
        ):
            raise ValueError(
                f"{fn}: {nm} must have unit stride along one dimension and no broadcast (zero-stride) dimension "
                f"(row-major, or a transposed view; gemm copies nothing); got {_strides_text(x, kind)}"
            )
    st = element_strides(out, kind)
    if M * N and (st is None or (N > 1 and st[-1] != 1) or (M > 1 and st[-2] < N)):
        raise ValueError(
            f"{fn}: out must have unit column stride and a row stride >= N = {N} (row-major, or a row slice or "
            f"column block of a row-major array); got {_strides_text(out, kind)}"
        )
    if out.ndim == 3 and out.shape[0] > 1 and M * N and st is not None and st[0] < (M - 1) * max(st[1], 1) + N:
        raise ValueError(
            f"{fn}: out must have a batch stride >= {(M - 1) * max(st[1], 1) + N} (its matrices must not overlap); "
            f"got {_strides_text(out, kind)}"
        )
    return kind, device


def _gemm_first(a: Any, b: Any, out: Any, alpha: float, beta: float, precision: str, key: tuple | None) -> Any:
    """A gemm signature's first call (and every CPU call): validate, run the reference on the CPU,
    else build the Gemm, pick and prepare the kernel, launch, cache the plan."""
    kind, device = _validate_gemm(a, b, out)
    if kind == "numpy":
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            raise ValueError(_OVERLAP)
        return gemm_reference_numpy(a, b, out, alpha=alpha, beta=beta)
    if device is None:
        if _overlaps(out, (a, b), kind):
            raise ValueError(_OVERLAP)
        return gemm_reference_torch(a, b, out, alpha=alpha, beta=beta)
    ext = None
    span_c = _span(out, kind)
    if span_c is not None:
        ext = (span_c, _span(a, kind), _span(b, kind))
        _check_disjoint(_ptr(a, kind), _ptr(b, kind), _ptr(out, kind), ext)
    run: Any = _noop_run
    if math.prod(out.shape):
        g = _gemm_problem(a, b, out, kind, device, alpha=alpha, beta=beta, precision=precision)
        mod, g, variant = _plan(g, _FORCED)
        run = _prepare(mod, g, variant)
        run(g.head(), current_stream(device, kind == "torch"))
    if key is not None:
        _PLANS.put(key, _GemmIntoPlan(run, ext))
    return out


def _gemm_problem(
    a: Any, b: Any, out: Any, kind: str, device: int, *, alpha: float, beta: float, precision: str
) -> Gemm:
    """The scaled Gemm of ``gemm(a, b, out)`` for arrays that passed :func:`_validate_gemm`: A and
    B read in place by their unit strides, C at out with ldc = out's row stride."""
    M, K = (int(n) for n in a.shape[-2:])
    N = int(b.shape[-1])
    sa, sb, sc = (element_strides(x, kind) for x in (a, b, out))
    assert sa is not None and sb is not None and sc is not None
    # K == 0: nothing is read; layouts whose rows are along K (none), so no alignment is needed
    lay_a = _matrix_layout(M, K, sa[-2], sa[-1]) if K else (1, max(M, 1))
    lay_b = _matrix_layout(K, N, sb[-2], sb[-1]) if K else (max(N, 1), 1)
    assert lay_a is not None and lay_b is not None
    name = _dtype_name(a, kind)
    nb = int(a.shape[0]) if a.ndim == 3 else 1
    batched = nb > 1  # one batch dimension, the innermost of the Gemm's three (a zero stride broadcasts)
    return Gemm(
        dtype=DTYPES[name], M=M, N=N, K=K, a=_ptr(a, kind), b=_ptr(b, kind), c=_ptr(out, kind), bias=0, act=-1,
        sa_m=lay_a[0], sa_k=lay_a[1], sb_k=lay_b[0], sb_n=lay_b[1],
        batch=(1, 1, nb), sa_batch=(0, 0, sa[0] if batched else 0), sb_batch=(0, 0, sb[0] if batched else 0),
        precision=precision if name == "float32" else "ieee", device=device,
        c_dtype=DTYPES[_dtype_name(out, kind)], ldc=sc[-2] if M > 1 else N, sc_batch=sc[0] if batched else None,
        alpha=alpha, beta=beta, scaled=True,
    )


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------


def reference_numpy(a: np.ndarray, b: np.ndarray, *, out: np.ndarray | None = None) -> Any:
    """``numpy.matmul(a, b, out=out)``; bfloat16 (ml_dtypes), for which NumPy returns float32, is
    computed in float32 and rounded once to bfloat16."""
    if a.dtype.name == "bfloat16" or b.dtype.name == "bfloat16":
        rdt = result_dtype(a.dtype.name, b.dtype.name)
        if rdt == "bfloat16":
            r = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(_np_dtype(rdt))
            if out is None:
                return r
            out[...] = r
            return out
        a, b = a.astype(_np_dtype(rdt)), b.astype(_np_dtype(rdt))
    return np.matmul(a, b, out=out)


def reference_torch(a: Any, b: Any) -> Any:
    """``torch.matmul(a, b)`` for same-dtype tensors; bool as NumPy defines it (any of the ANDs)."""
    import torch

    if a.dtype == torch.bool:
        return torch.matmul(a.to(torch.int64), b.to(torch.int64)) != 0
    return torch.matmul(a, b)


def _acc_name(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def gemm_reference_numpy(a: np.ndarray, b: np.ndarray, out: np.ndarray, *, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """``out[...] = alpha * (a @ b) + beta * out`` (:func:`gemm`'s CPU path for NumPy) with the
    kernels' maths: float32 (float64 for float64) products, sums and scaling, one rounding into
    out's dtype; beta == 0 never reads out."""
    acc = np.dtype(_acc_name(a.dtype.name))
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.matmul(a.astype(acc), b.astype(acc)) * acc.type(alpha)
        if beta != 0:
            r += acc.type(beta) * out.astype(acc)
    out[...] = r.astype(out.dtype)
    return out


def gemm_reference_torch(a: Any, b: Any, out: Any, *, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """torch ``out = alpha * (a @ b) + beta * out`` with the kernels' maths (fp32 for 16-bit dtypes,
    one rounding into out's dtype; beta == 0 never reads out): :func:`gemm`'s torch-CPU path,
    outside autograd."""
    import torch

    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        r = torch.matmul(a.to(acc), b.to(acc))
        if alpha != 1.0:
            r.mul_(alpha)
        if beta != 0.0:
            r.add_(out.to(acc), alpha=beta)
        out.copy_(r)
    return out


def linear_reference_numpy(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, activation: str | None) -> Any:
    """NumPy ``act(x @ weight.T + bias)`` with the kernel's maths: fp32 (float64 for float64)
    product and epilogue, one rounding to x's dtype."""
    acc = np.dtype(_acc_name(x.dtype.name))
    # IEEE results on NaN/inf and overflow (as the kernel gives them) are results: no NumPy warnings
    with np.errstate(over="ignore", invalid="ignore"):
        z = np.matmul(x.astype(acc), weight.astype(acc).T)
        if activation is None:
            y = z if bias is None else z + bias.astype(acc)
        else:
            bb = np.zeros(weight.shape[0], acc) if bias is None else bias.astype(acc)
            y = _bias_act_numpy(z, bb, activation)
        return np.ascontiguousarray(np.asarray(y).astype(x.dtype))


def linear_reference_torch(x: Any, weight: Any, bias: Any, activation: str | None) -> Any:
    """torch ``act(x @ weight.T + bias)`` with the kernel's maths (fp32 for 16-bit dtypes, one
    rounding); the torch-CPU fallback."""
    import torch

    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dtype is acc and weight.dtype is acc and (bias is None or bias.dtype is acc):
        z = torch.nn.functional.linear(x, weight, bias)  # one op: the product and the bias
        return z if activation is None else _bias_act_torch_act(z, activation)
    z = torch.matmul(x.to(acc), weight.to(acc).t())
    if activation is None:
        y = z if bias is None else z + bias.to(acc)
    else:
        bb = z.new_zeros(weight.shape[0]) if bias is None else bias.to(acc)
        y = _bias_act_torch(z, bb, activation)
    return y.to(x.dtype).contiguous()

