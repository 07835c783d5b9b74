"""RMSNorm and LayerNorm over the last dimension, forward and backward.

    rms_norm:   y = x̂ · (offset + weight),  x̂ = x / sqrt(mean(x²) + eps)
    layer_norm: y = x̂ · weight + bias,      x̂ = (x − mean(x)) / sqrt(var(x) + eps)  (biased variance)

Statistics are computed per row of x (..., H) in float32 (float64 for float64 x). rms_norm
reproduces the two rounding conventions of Hugging Face transformers: ``cast="llama"``
(LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm: x̂ rounded to x's dtype, then multiplied by the weight
in torch's promotion of the two dtypes) and ``cast="gemma"`` (GemmaRMSNorm, ``offset=1``, and
torch.nn.RMSNorm, ``offset=0``: the product in float32, rounded once to x's dtype).

Kernels: ``raw_kernels/norm.cu`` (forward: a row per group of threads, kept in registers; backward:
dx and per-block partial sums of the weight/bias gradients, then a fixed-order reduction). The
NumPy and torch references below are the CPU fallbacks and the test oracles. torch registration
(autograd, autocast, torch.compile, vmap): ``cukit/torch/norm.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from cukit._device import device_caps, sm_count
from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    NotAnArrayError,
    array_class,
    array_kind,
    as_array,
    current_stream,
    device_of,
    dtype_name,
    is_array,
    not_an_array_error,
    numpy_dtype,
    type_name,
)

__all__ = [
    "CASTS",
    "LAYER",
    "RMS",
    "RMS_ROUND",
    "backward_gpu",
    "forward_gpu",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_reference_numpy",
    "layer_norm_backward_reference_torch",
    "layer_norm_reference_numpy",
    "layer_norm_reference_torch",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_backward_reference_numpy",
    "rms_norm_backward_reference_torch",
    "rms_norm_reference_numpy",
    "rms_norm_reference_torch",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
CASTS = ("llama", "gemma")
# Kernel modes: ids match enum NormMode in raw_kernels/norm.cu.
RMS_ROUND, RMS, LAYER = 0, 1, 2
MODE_OF_CAST = {"llama": RMS_ROUND, "gemma": RMS}
_FN = {RMS_ROUND: "cukit.rms_norm", RMS: "cukit.rms_norm", LAYER: "cukit.layer_norm"}
# rms_norm's eps=None, as torch.nn.functional.rms_norm: the machine epsilon of the statistics' dtype
# (float32's for the 16-bit types too, not torch.finfo(x.dtype).eps as its docstring says)
EPS_OF = {"float16": 2.0**-23, "bfloat16": 2.0**-23, "float32": 2.0**-23, "float64": 2.0**-52}


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def _kernel_weights(x: str) -> list[tuple[str, tuple[int, ...]]]:
    """(weight dtype, modes) the kernels are instantiated with for x's dtype: x's own; float32
    (mixed precision: a weight of any other dtype is cast to it on the host, exactly for the 16-bit
    ones, which is also where the maths happens); float64 for RMS_ROUND, whose output is then
    float64 (torch's promotion) and whose product must be formed in float64."""
    out = [(x, (RMS_ROUND, RMS, LAYER))]
    if x != "float32":
        out.append(("float32", (RMS_ROUND, RMS, LAYER)))
    if x != "float64":
        out.append(("float64", (RMS_ROUND,)))
    return out


def _nv(backward: bool, vec: int, itemsize: int, wsize: int = 0, layer: bool = False) -> int:
    """Vectors per thread per chunk of a row (the kernels' NV). Forward: 32 bytes of x per thread
    for RMSNorm of the 16-bit types (16 elements: 40 registers, so a multiprocessor holds twice the
    warps of the 64-byte form's 64 registers, and twice the threads share a row), 64 bytes for
    LayerNorm (`layer`: two row reductions, each slower with twice the threads per row) and for
    float32 and float64 (benchmarks/NOTES.md, "norm forward"). Backward, whose weight and bias
    sums take a register per element: 64 bytes of x; 32 for the 16-bit types in LayerNorm (the
    bias sums) or beside a float32 weight (its loads), which would spill at 64; one vector beside
    a float64 weight of a narrower x (`wsize` 8: float64 sums) (benchmarks/NOTES.md, "norm
    backward"). The scalar path (vec 1) holds 8 (forward) or 4 (backward) elements. Sized so
    that the vector paths do not spill at 128 registers (ptxas -v, sm_90)."""
    if vec == 1:
        return 4 if backward else 8
    if not backward:
        return 2 if itemsize == 2 and not layer else 4
    if wsize == 8 and itemsize < 8:
        return 1
    return 2 if itemsize == 2 and (layer or wsize == 4) else 4


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        dt = DTYPES[name]
        fwd: list[str] = []
        bwd: list[str] = []
        for wname, modes in _kernel_weights(name):
            wt = DTYPES[wname].ctype
            for mode in modes:
                for vec in (16 // dt.itemsize, 1):  # the 16-byte vector path and the scalar path
                    nvf = _nv(False, vec, dt.itemsize, layer=mode == LAYER)
                    fwd += [f"norm_fwd<{dt.ctype}, {wt}, {mode}, {vec}, {nvf}, {one}>" for one in ("true", "false")]
                    nvb = _nv(True, vec, dt.itemsize, DTYPES[wname].itemsize, layer=mode == LAYER)
                    bwd += [f"norm_bwd<{dt.ctype}, {wt}, {mode}, {vec}, {nvb}, {one}>" for one in ("true", "false")]
        groups[f"{name}/fwd"] = fwd
        groups[f"{name}/bwd"] = bwd
    groups["reduce"] = [f"norm_reduce<{m}, {DTYPES[d].ctype}>" for m in ("float", "double") for d in FLOAT_DTYPES]
    return groups


KERNELS = KernelModule(
    "norm.cu",
    instantiations=_instantiations(),
    signatures={
        "norm_fwd": "ptr ptr ptr ptr ptr ptr i64 i64 f64 f64",  # x w b y mean rstd rows H eps offset
        "norm_bwd": "ptr ptr ptr ptr ptr ptr ptr ptr i64 i64 f64 i64",  # dy x w mean rstd dx pw pb rows H offset smem_acc
        "norm_reduce": "ptr ptr ptr i64 i64",  # partial out0 out1 parts H
    },
)

_BLOCK = 256  # threads per block when several rows share one
_MAX_THREADS = 512  # kMaxThreads in norm.cu: threads per row at most
_REDUCE_SPLIT = 16  # kReduceSplit in norm.cu
_GRID_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class Checked(NamedTuple):
    """What validation learns once per signature: the array kind, the kernel mode, the dtype names
    of x, of the weight (None without one) and of the output."""

    kind: str
    mode: int
    x: str
    w: str | None
    out: str


def _dtypes_text(names: Sequence[str]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


def promote(a: str, b: str) -> str:
    """torch's type promotion of two float dtype names (float16 with bfloat16 gives float32)."""
    if a == b:
        return a
    return "float64" if "float64" in (a, b) else "float32"


def check_number(fn: str, name: str, v: Any, *, nonneg: bool = False) -> float:
    """`v` as a float: TypeError for a non-number (bools too), ValueError for a non-finite one (or
    a negative one when `nonneg`)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a real number; got {type_name(v)}")
    f = float(v)
    if not math.isfinite(f) or (nonneg and f < 0):
        raise ValueError(f"{fn}: {name} must be a {'non-negative ' if nonneg else ''}finite number; got {v!r}")
    return f


def check_cast(fn: str, cast: Any) -> int:
    """The kernel mode of rms_norm's `cast` ("llama" or "gemma")."""
    try:
        return MODE_OF_CAST[cast]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: cast must be 'llama' or 'gemma'; got {cast!r}") from None


def _check_arrays(fn: str, x: Any, params: Sequence[tuple[str, Any]]) -> tuple[str, str, str | None]:
    """x and its 1-D parameters (weight, bias; None allowed): (kind, x's dtype name, the
    parameters' common dtype name or None). NotAnArrayError when one is not an array."""
    present = [(n, p) for n, p in params if p is not None]
    try:
        kind = array_kind(x)
        kinds = [array_kind(p) for _, p in present]
    except NotAnArrayError:
        raise not_an_array_error(fn, (("x", x), *present)) from None
    for (n, p), k in zip(present, kinds, strict=True):
        if k != kind:
            raise TypeError(f"{fn}: {n} must be the same array type as x ({array_class(kind)}); got {type_name(p)}")
    xname = dtype_name(x, kind)
    if xname not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x must have dtype {_dtypes_text(FLOAT_DTYPES)}; got {xname}")
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have at least one dimension (..., H), normalised over the last; got shape ()")
    H = x.shape[-1]
    pname: str | None = None
    for n, p in present:
        name = dtype_name(p, kind)
        if name not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {n} must have dtype {_dtypes_text(FLOAT_DTYPES)}; got {name}")
        if pname is not None and name != pname:
            raise TypeError(f"{fn}: {n} must have weight's dtype {pname}; got {name}")
        pname = name
        if p.ndim != 1 or p.shape[0] != H:
            raise ValueError(
                f"{fn}: {n} must have shape ({H},) to match x's last dimension (x has shape {tuple(x.shape)}); "
                f"got {tuple(p.shape)}"
            )
        dx, dp = device_of(x), device_of(p)
        if dx != dp:
            raise ValueError(f"{fn}: x and {n} must be on the same device; got {_where(dx)} and {_where(dp)}")
    return kind, xname, pname


def validate_rms(x: Any, weight: Any, eps: Any, offset: Any, cast: Any, fn: str = "cukit.rms_norm") -> Checked:
    """Check rms_norm's arguments (eps already resolved from None). NotAnArrayError when x or
    weight is not an array; TypeError/ValueError naming fn and the argument otherwise."""
    kind, xname, wname = _check_arrays(fn, x, (("weight", weight),))
    mode = check_cast(fn, cast)
    check_number(fn, "eps", eps, nonneg=True)
    if check_number(fn, "offset", offset) != 0.0 and weight is None:
        raise ValueError(f"{fn}: offset scales a weight (y = x^ * (offset + weight)); got offset={offset!r} "
                         "and weight=None")
    out = promote(xname, wname) if mode == RMS_ROUND and wname is not None else xname
    return Checked(kind, mode, xname, wname, out)


def last_dim(fn: str, x: Any, normalized_shape: Any) -> None:
    """layer_norm's normalized_shape: None, an int or a sequence of one int, equal to x's last
    dimension (cukit normalises the last dimension only)."""
    if normalized_shape is None:
        return
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else normalized_shape
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or isinstance(normalized_shape, bool) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims
    ):
        raise TypeError(f"{fn}: normalized_shape must be None, an int or a sequence of one int; got {normalized_shape!r}")
    H = x.shape[-1] if x.ndim else None
    if len(dims) != 1 or dims[0] != H:
        hint = " (cukit normalises the last dimension only)" if len(dims) != 1 else ""
        raise ValueError(f"{fn}: normalized_shape must be x's last dimension, ({H},){hint}; got {tuple(dims)}")


def validate_layer(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any,
                   fn: str = "cukit.layer_norm") -> Checked:
    """Check layer_norm's arguments (weight and bias of one dtype, any float dtype beside x's)."""
    kind, xname, wname = _check_arrays(fn, x, (("weight", weight), ("bias", bias)))
    last_dim(fn, x, normalized_shape)
    check_number(fn, "eps", eps, nonneg=True)
    return Checked(kind, LAYER, xname, wname, xname)


def check_grad(fn: str, grad: Any, x: Any, c: Checked) -> None:
    """grad must be x's array type, shape and device, with the forward output's dtype."""
    try:
        grad_kind = array_kind(grad)
    except NotAnArrayError:
        raise not_an_array_error(fn, (("grad", grad),)) from None
    if grad_kind != c.kind:
        raise TypeError(f"{fn}: grad must be the same array type as x ({array_class(c.kind)}); got {type_name(grad)}")
    if dtype_name(grad, c.kind) != c.out:
        raise TypeError(f"{fn}: grad must have the output's dtype {c.out}; got {dtype_name(grad, c.kind)}")
    if tuple(grad.shape) != tuple(x.shape):
        raise ValueError(f"{fn}: grad must have x's shape {tuple(x.shape)}; got {tuple(grad.shape)}")
    if device_of(grad) != device_of(x):
        raise ValueError(f"{fn}: grad must be on x's device ({_where(device_of(x))}); got {_where(device_of(grad))}")


def _check_stats(fn: str, x: Any, kind: str, xname: str, stats: Sequence[tuple[str, Any]]) -> None:
    """The saved statistics (mean, rstd): arrays of shape x.shape[:-1] in the accumulation dtype."""
    acc = "float64" if xname == "float64" else "float32"
    for n, s in stats:
        if not is_array(s) or array_kind(s) != kind or dtype_name(s, kind) != acc or tuple(s.shape) != tuple(x.shape[:-1]) \
                or device_of(s) != device_of(x):
            raise ValueError(f"{fn}: {n} must be a {acc} array of shape {tuple(x.shape[:-1])} on x's device (the "
                             f"forward's statistics); got {type_name(s)}"
                             + (f" {dtype_name(s, array_kind(s))} {tuple(s.shape)}" if is_array(s) else ""))


# ---------------------------------------------------------------------------------------------
# Public API (NumPy, CuPy and torch arrays; cukit/_api.py sends torch tensors to cukit/torch/norm.py)
# ---------------------------------------------------------------------------------------------


def resolve_eps(eps: Any, x: Any) -> Any:
    """rms_norm's eps: None means :data:`EPS_OF` for x's dtype (torch.nn.functional.rms_norm's default)."""
    if eps is None and is_array(x):
        return EPS_OF.get(dtype_name(x), eps)
    return eps


def _operands(fn: str, pairs: Sequence[tuple[str, Any]]) -> list[Any]:
    """The arrays of (name, value) pairs, array-likes converted like the first array (None kept)."""
    like = next((v for _, v in pairs if is_array(v)), None)
    return [v if v is None or is_array(v) else as_array(v, fn, n, like) for n, v in pairs]


def rms_norm(x: Any, weight: Any = None, eps: float | None = 1e-6, *, offset: float = 0.0, cast: str = "llama") -> Any:
    """RMSNorm over the last dimension: ``y = x̂ · (offset + weight)``, ``x̂ = x / sqrt(mean(x²) + eps)``.

    Args:
        x: array of shape (..., H), float16, bfloat16, float32 or float64; NumPy, CuPy or torch
            (CPU or CUDA). Non-contiguous inputs are copied to a contiguous buffer first.
        weight: (H,) of any of those float dtypes (float32 beside bfloat16 x is usual under
            autocast), same array type and device; None: no scale (y = x̂; offset must be 0).
        eps: added to mean(x²); None: the machine epsilon of the statistics' dtype (float32's;
            float64's for float64 x), as torch.nn.functional.rms_norm does.
        offset: keyword only; the scale is ``offset + weight`` (Gemma: 1).
        cast: keyword only; where the result is rounded, as Hugging Face's modules do:
            "llama" (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm): x̂ computed in float32, rounded to
            x's dtype, then multiplied by (offset + weight) in the promoted dtype of x and weight,
            which is the output dtype (bfloat16 x with a float32 weight gives float32);
            "gemma" (GemmaRMSNorm with offset=1, torch.nn.RMSNorm with offset=0):
            ``(x̂ · (offset + weight.float())).to(x.dtype)``.

    The statistics are float32 (float64 for float64 x) on every path. CUDA inputs run one kernel
    (rows in registers, 16-byte vectors when H and the pointers allow); NumPy inputs run the
    float64 reference, rounded where the kernel rounds; torch tensors are differentiable (x and
    weight, to second order) and work under torch.compile, vmap and CUDA graphs.

    Returns:
        y of x's shape, contiguous, same array type; dtype as ``cast`` says.

    Raises:
        TypeError (wrong type or dtype) and ValueError (wrong shape, device, eps, cast); each
        message names ``cukit.rms_norm`` and the argument.

    See also: ``torch.nn.functional.rms_norm``, ``torch.nn.RMSNorm``, transformers' ``LlamaRMSNorm``
    and ``GemmaRMSNorm``, ``cukit.nn.RMSNorm``.
    """
    try:
        return _rms_norm_arrays(x, weight, eps, offset, cast)
    except NotAnArrayError:
        x, weight = _operands("cukit.rms_norm", (("x", x), ("weight", weight)))
    return _rms_norm_arrays(x, weight, eps, offset, cast)


def _rms_norm_arrays(x: Any, weight: Any, eps: Any, offset: float, cast: str) -> Any:
    eps = resolve_eps(eps, x)
    c = validate_rms(x, weight, eps, offset, cast)
    if c.kind == "numpy":
        return rms_norm_reference_numpy(x, weight, eps, offset, cast)
    if device_of(x) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return rms_norm_reference_torch(x, weight, eps, offset, cast)[0]
    return forward_gpu(x, weight, None, c.mode, float(eps), float(offset), False)[0]


def rms_norm_backward(grad: Any, x: Any, weight: Any = None, eps: float | None = 1e-6, *, offset: float = 0.0,
                      cast: str = "llama") -> tuple[Any, Any]:
    """Gradients of rms_norm: ``(dx, dweight)`` for the upstream gradient ``grad`` (dweight is None
    without a weight). With g = grad · (offset + weight): ``dx = (g − x̂ · mean(g x̂)) / rms``;
    ``dweight = Σ_rows grad · x̂`` (x̂ rounded to x's dtype for cast="llama", as the forward uses it).

    For NumPy and CuPy users (torch users get this through autograd). grad has x's shape and the
    forward output's dtype; the other arguments as for ``rms_norm``. The statistics are recomputed
    from x. On CUDA: one statistics pass, one kernel for dx and per-block partial sums in float32
    (float64 for float64), and a fixed-order reduction: bitwise reproducible on a given GPU.

    See also: ``torch.autograd.grad``.
    """
    fn = "cukit.rms_norm_backward"
    try:
        return _rms_backward_arrays(grad, x, weight, eps, offset, cast)
    except NotAnArrayError:
        grad, x, weight = _operands(fn, (("grad", grad), ("x", x), ("weight", weight)))
    return _rms_backward_arrays(grad, x, weight, eps, offset, cast)


def _rms_backward_arrays(grad: Any, x: Any, weight: Any, eps: Any, offset: float, cast: str) -> tuple[Any, Any]:
    fn = "cukit.rms_norm_backward"
    eps = resolve_eps(eps, x)
    c = validate_rms(x, weight, eps, offset, cast, fn)
    check_grad(fn, grad, x, c)
    if c.kind == "numpy":
        return rms_norm_backward_reference_numpy(grad, x, weight, eps, offset, cast)
    if device_of(x) is None:
        return rms_norm_backward_reference_torch(grad, x, weight, eps, offset, cast)
    _, _, rstd = forward_gpu(x, None, None, c.mode, float(eps), 0.0, True, False)
    dx, dw, _ = backward_gpu(grad, x, weight, None, None, rstd, c.mode, float(offset))
    return dx, dw


def layer_norm(x: Any, normalized_shape: Any = None, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """LayerNorm over the last dimension: ``y = (x − mean) / sqrt(var + eps) · weight + bias``
    (biased variance), the signature of ``torch.nn.functional.layer_norm`` restricted to the last
    dimension.

    Args:
        x: array of shape (..., H), float16, bfloat16, float32 or float64; NumPy, CuPy or torch
            (CPU or CUDA). Non-contiguous inputs are copied to a contiguous buffer first.
        normalized_shape: None, H or (H,): cukit normalises the last dimension only (a longer
            shape is a ValueError saying so).
        weight, bias: (H,) or None, one float dtype for both (float32 beside 16-bit x is usual),
            same array type and device as x.
        eps: added to the variance.

    Mean and variance are float32 (float64 for float64 x), the variance from the centred values
    (two passes over a row held in registers); the output is rounded once to x's dtype. Under CUDA
    autocast the torch op runs in float32 (torch's rule for layer_norm: its output is float32).

    Returns:
        y of x's shape and dtype, contiguous, same array type.

    Raises:
        TypeError and ValueError naming ``cukit.layer_norm`` and the argument.

    See also: ``torch.nn.functional.layer_norm``, ``torch.nn.LayerNorm``, ``cukit.nn.LayerNorm``.
    """
    try:
        return _layer_norm_arrays(x, normalized_shape, weight, bias, eps)
    except NotAnArrayError:
        x, weight, bias = _operands("cukit.layer_norm", (("x", x), ("weight", weight), ("bias", bias)))
    return _layer_norm_arrays(x, normalized_shape, weight, bias, eps)


def _layer_norm_arrays(x: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any) -> Any:
    c = validate_layer(x, normalized_shape, weight, bias, eps)
    if c.kind == "numpy":
        return layer_norm_reference_numpy(x, weight, bias, eps)
    if device_of(x) is None:
        return layer_norm_reference_torch(x, weight, bias, eps)[0]
    return forward_gpu(x, weight, bias, LAYER, float(eps), 0.0, False)[0]


def layer_norm_backward(grad: Any, x: Any, normalized_shape: Any = None, weight: Any = None, bias: Any = None,
                        eps: float = 1e-5) -> tuple[Any, Any, Any]:
    """Gradients of layer_norm: ``(dx, dweight, dbias)`` (None for a missing weight or bias). With
    g = grad · weight: ``dx = (g − mean(g) − x̂ · mean(g x̂)) / sqrt(var + eps)``,
    ``dweight = Σ_rows grad · x̂``, ``dbias = Σ_rows grad``.

    For NumPy and CuPy users (torch users get this through autograd); arguments as for
    ``layer_norm``, grad of x's shape and dtype. Statistics recomputed from x; on CUDA the sums are
    float32 partials per block and a fixed-order reduction (bitwise reproducible on a given GPU).

    See also: ``torch.autograd.grad``.
    """
    fn = "cukit.layer_norm_backward"
    try:
        return _layer_backward_arrays(grad, x, normalized_shape, weight, bias, eps)
    except NotAnArrayError:
        grad, x, weight, bias = _operands(fn, (("grad", grad), ("x", x), ("weight", weight), ("bias", bias)))
    return _layer_backward_arrays(grad, x, normalized_shape, weight, bias, eps)


def _layer_backward_arrays(grad: Any, x: Any, normalized_shape: Any, weight: Any, bias: Any,
                           eps: Any) -> tuple[Any, Any, Any]:
    fn = "cukit.layer_norm_backward"
    c = validate_layer(x, normalized_shape, weight, bias, eps, fn)
    check_grad(fn, grad, x, c)
    if c.kind == "numpy":
        return layer_norm_backward_reference_numpy(grad, x, weight, bias, eps)
    if device_of(x) is None:
        return layer_norm_backward_reference_torch(grad, x, weight, bias, eps)
    _, mean, rstd = forward_gpu(x, None, None, LAYER, float(eps), 0.0, True, False)
    return backward_gpu(grad, x, weight, bias, mean, rstd, LAYER, 0.0)


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------


def _lib_dtype(dtype: Any, kind: str) -> Any:
    """A dtype name (or the library's dtype) as the array library's dtype object."""
    if kind == "torch":
        import torch

        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    return numpy_dtype(dtype)


def _empty(shape: tuple[int, ...], like: Any, kind: str, dtype: Any) -> Any:
    if kind == "torch":
        return like.new_empty(shape, dtype=_lib_dtype(dtype, kind))
    import cupy

    with like.device:  # allocate on the input's GPU, not the current one
        return cupy.empty(shape, dtype=numpy_dtype(dtype))


def _cast(a: Any, dtype: Any, kind: str) -> Any:
    """a in `dtype` (a weight whose dtype has no kernel beside x's; None: as it is)."""
    if a is None or dtype is None:
        return a
    return a.to(_lib_dtype(dtype, kind)) if kind == "torch" else a.astype(numpy_dtype(dtype))


def _ptr(a: Any, kind: str) -> int:
    if a is None:
        return 0
    return a.data_ptr() if kind == "torch" else a.data.ptr


def _vec(x: str, H: int, arrays: Sequence[tuple[int, int]]) -> int:
    """The kernels' VEC: 16 bytes of x per vector when H is a multiple of it and every pointer
    (with its itemsize) is aligned to its own vectors (min(16, VEC * itemsize) bytes), else 1."""
    v = 16 // DTYPES[x].itemsize
    if H % v == 0 and all(p % min(16, v * size) == 0 for p, size in arrays if p):
        return v
    return 1


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _threads(H: int, vec: int, nv: int) -> tuple[int, int]:
    """(threads per row, rows per block): the fewest threads that hold a row in registers (a
    power of two, at most 512; longer rows are chunked), but at least enough for the warp's loads to
    be contiguous (min(32, vectors per row)); several rows per block of 256 threads when they fit."""
    nvec = -(-H // vec)
    tpr = min(_MAX_THREADS, max(_pow2(-(-nvec // nv)), min(32, _pow2(nvec))))
    return tpr, max(1, _BLOCK // tpr)


def _one_chunk(H: int, tpr: int, nv: int, vec: int) -> str:
    """The kernels' ONE template argument: "true" when a row of H elements is one chunk of tpr
    threads x nv vectors x vec elements (held in registers; the loops compile away), else "false"."""
    return "true" if tpr * nv * vec >= H else "false"


def _bwd_threads(H: int, vec: int, nv: int, itemsize: int) -> tuple[int, int]:
    """The backward's (threads per row, rows per block): :func:`_threads`'s, except two rows per
    block of 512 where 16-bit rows take 256 threads (measured 9-12% faster than one row per block
    of 256; rows of 128 threads or fewer were slower in blocks of 512: benchmarks/NOTES.md, "norm
    backward")."""
    tpr, rpb = _threads(H, vec, nv)
    return (tpr, 2) if itemsize == 2 and tpr == _BLOCK else (tpr, rpb)


@functools.lru_cache(maxsize=64)
def _sm_limits(device: int) -> tuple[int, int, int]:
    """Threads, registers and shared memory per multiprocessor (read once per device)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return (
        int(props.get("maxThreadsPerMultiProcessor", 2048)),
        int(props.get("regsPerMultiprocessor", 65536)),
        int(props.get("sharedMemPerMultiprocessor", 228 * 1024)),
    )


def _resident_blocks(fn: Any, threads: int, smem: int, device: int) -> int:
    """Blocks of `fn` one multiprocessor holds at once (the occupancy calculator's limits from
    threads, registers and shared memory), at least 1: the persistent backward grid is this times
    the SM count, so that every block runs in the first wave."""
    import cupy

    max_threads, regs_sm, smem_sm = _sm_limits(device)
    try:
        with cupy.cuda.Device(device):  # a function's attributes are read in its device's context
            regs, static = int(fn.num_regs), int(fn.shared_size_bytes)
    except Exception:  # no attributes to read: the launch bounds' worst case
        regs, static = 128, 1024
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    smem_block = smem + static + 1024  # 1 KiB reserved per block
    return max(1, min(max_threads // threads, regs_sm // (regs_per_warp * warps), smem_sm // smem_block, 32))


# Signatures -> plans. A plan launches on contiguous arrays, whose pointers are then the only
# per-call inputs; a signature with non-contiguous arrays maps to a Densify entry (copy, then the
# contiguous signature's plan). Fresh outputs are always 16-byte aligned.
_FWD_PLANS = PlanCache("norm_fwd", maxsize=1024)
_BWD_PLANS = PlanCache("norm_bwd", maxsize=1024)


def _tsig(t: Any) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def _csig(t: Any) -> tuple | None:
    return None if t is None else (t.shape, t.strides, t.dtype, t.device.id, t.data.ptr & 15)


class _FwdPlan:
    __slots__ = ("acc", "mean", "out", "run", "shape", "stats", "wcast")

    def __init__(self, run: Any, shape: tuple[int, ...], out: Any, acc: Any, mean: bool, wcast: Any) -> None:
        self.run, self.shape, self.out, self.acc, self.mean, self.wcast = run, shape, out, acc, mean, wcast
        self.stats = shape[:-1]


class _BwdPlan:
    __slots__ = ("macc", "main", "nout", "partial", "reduce", "step", "wcast")

    def __init__(self, main: Any, reduce: Any, partial: tuple[int, int, int], macc: Any, step: int, wcast: Any) -> None:
        self.main, self.reduce, self.partial, self.macc, self.step, self.wcast = main, reduce, partial, macc, step, wcast
        self.nout = partial[0]


def forward_gpu(x: Any, weight: Any, bias: Any, mode: int, eps: float, offset: float, stats: bool,
                output: bool = True) -> tuple[Any, Any, Any]:
    """``(y, mean, rstd)`` of one norm on a CuPy array or torch CUDA tensor: one kernel launch.
    mean is None except for LAYER; mean and rstd are None unless `stats` (float32, float64 for
    float64 x, of shape x.shape[:-1]); y is None unless `output`. eps and offset are Python floats
    (part of the plan's key); arguments are validated on a signature's first call (see
    :func:`validate_rms`, :func:`validate_layer`), later calls with the same signature are a
    plan-cache lookup, the allocations and a launch."""
    if hasattr(x, "data_ptr"):
        key = (mode, eps, offset, stats, output, x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15,
               _tsig(weight), _tsig(bias))
        plan = _FWD_PLANS.get(key)
        if plan is None:
            return _forward_first(x, weight, bias, mode, eps, offset, stats, output, key)
        if plan.__class__ is Densify:
            return forward_gpu(*plan.apply((x, weight, bias)), mode, eps, offset, stats, output)
        if plan.wcast is not None:
            weight = None if weight is None else weight.to(plan.wcast)
            bias = None if bias is None else bias.to(plan.wcast)
        y = x.new_empty(plan.shape, dtype=plan.out) if output else None
        rstd = x.new_empty(plan.stats, dtype=plan.acc) if stats else None
        mean = x.new_empty(plan.stats, dtype=plan.acc) if stats and plan.mean else None
        if plan.run is not None:
            plan.run(
                (x.data_ptr(), 0 if weight is None else weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 0 if y is None else y.data_ptr(), 0 if mean is None else mean.data_ptr(),
                 0 if rstd is None else rstd.data_ptr()),
                current_stream(x.get_device(), True),
            )
        return y, mean, rstd
    key = (mode, eps, offset, stats, output, x.shape, x.strides, x.dtype, x.device.id, x.data.ptr & 15,
           _csig(weight), _csig(bias))
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _forward_first(x, weight, bias, mode, eps, offset, stats, output, key)
    if plan.__class__ is Densify:
        return forward_gpu(*plan.apply((x, weight, bias)), mode, eps, offset, stats, output)
    weight, bias = _cast(weight, plan.wcast, "cupy"), _cast(bias, plan.wcast, "cupy")
    y = _empty(plan.shape, x, "cupy", plan.out) if output else None
    rstd = _empty(plan.stats, x, "cupy", plan.acc) if stats else None
    mean = _empty(plan.stats, x, "cupy", plan.acc) if stats and plan.mean else None
    if plan.run is not None:
        plan.run(tuple(_ptr(a, "cupy") for a in (x, weight, bias, y, mean, rstd)), current_stream(x.device.id, False))
    return y, mean, rstd


def _validate(fn: str, x: Any, weight: Any, bias: Any, mode: int, eps: float, offset: float) -> Checked:
    if mode == LAYER:
        return validate_layer(x, None, weight, bias, eps, fn)
    if bias is not None:
        raise TypeError(f"{fn}: rms_norm takes no bias")
    return validate_rms(x, weight, eps, offset, CASTS[mode], fn)


def _forward_first(x: Any, weight: Any, bias: Any, mode: int, eps: float, offset: float, stats: bool, output: bool,
                   key: tuple) -> tuple[Any, Any, Any]:
    c = _validate(_FN[mode], x, weight, bias, mode, eps, offset)
    kind = c.kind
    device = device_of(x)
    if device is None:
        raise ValueError(f"cukit.ops.norm.forward_gpu: x must be a CUDA array; got {type_name(x)} on the CPU")
    dense = Densify.needed((x, weight, bias), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _FWD_PLANS.put(key, dense)
        return forward_gpu(*dense.apply((x, weight, bias)), mode, eps, offset, stats, output)
    wk = _kernel_weight(c, mode)
    wcast = wk if c.w is not None and wk != c.w else None
    weight, bias = _cast(weight, wcast, kind), _cast(bias, wcast, kind)
    acc = "float64" if c.x == "float64" else "float32"
    shape = tuple(x.shape)
    y = _empty(shape, x, kind, c.out) if output else None
    rstd = _empty(shape[:-1], x, kind, acc) if stats else None
    mean = _empty(shape[:-1], x, kind, acc) if stats and mode == LAYER else None
    H = int(shape[-1])
    rows = math.prod(shape[:-1])
    plan_args = (shape, _lib_dtype(c.out, kind), _lib_dtype(acc, kind), mode == LAYER,
                 None if wcast is None else _lib_dtype(wcast, kind))
    if rows == 0 or H == 0:
        if H == 0:  # the mean of no elements: NaN, as torch's (not cached: rare, and not a launch of ours)
            for s in (mean, rstd):
                if s is not None:
                    s[...] = math.nan
        else:
            _FWD_PLANS.put(key, _FwdPlan(None, *plan_args))
        return y, mean, rstd
    T, W, out = DTYPES[c.x], DTYPES[wk], DTYPES[c.out]
    ptrs = tuple(_ptr(a, kind) for a in (x, weight, bias, y, mean, rstd))
    vec = _vec(c.x, H, [(ptrs[0], T.itemsize), (ptrs[1], W.itemsize), (ptrs[2], W.itemsize), (ptrs[3], out.itemsize)])
    nv = _nv(False, vec, T.itemsize, layer=mode == LAYER)
    tpr, rpb = _threads(H, vec, nv)
    grid = -(-rows // rpb)
    if grid > _GRID_MAX:
        raise ValueError(f"{_FN[mode]}: x has {rows} rows; at most {_GRID_MAX * rpb} are supported at H = {H}")
    one = _one_chunk(H, tpr, nv, vec)
    run = KERNELS.prepare(f"norm_fwd<{T.ctype}, {W.ctype}, {mode}, {vec}, {nv}, {one}>", (grid,), (tpr, rpb),
                          (rows, H, eps, offset), device=device)
    run(ptrs, current_stream(device, kind == "torch"))
    _FWD_PLANS.put(key, _FwdPlan(run, *plan_args))
    return y, mean, rstd


def _kernel_weight(c: Checked, mode: int) -> str:
    """The weight dtype the kernel reads (see _kernel_weights): x's, float64 for a float64 weight
    in RMS_ROUND, else float32."""
    if c.w is None or c.w == c.x:
        return c.x
    if c.w == "float64" and mode == RMS_ROUND:
        return "float64"
    return "float32"


def backward_gpu(grad: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any, mode: int,
                 offset: float) -> tuple[Any, Any, Any]:
    """``(dx, dweight, dbias)`` of one norm from the forward's statistics (mean for LAYER, rstd) on
    CuPy arrays or torch CUDA tensors; dweight (dbias) is None without a weight (bias). Two
    launches: dx and per-block partial sums (float32; float64 for float64 x or weight), then a
    fixed-order reduction to the weight's (bias's) dtype: bitwise reproducible. Validated on a
    signature's first call."""
    if hasattr(x, "data_ptr"):
        key = (mode, offset, _tsig(grad), _tsig(x), _tsig(weight), _tsig(bias), _tsig(mean), _tsig(rstd))
        plan = _BWD_PLANS.get(key)
        if plan is None:
            return _backward_first(grad, x, weight, bias, mean, rstd, mode, offset, key)
        if plan.__class__ is Densify:
            return backward_gpu(*plan.apply((grad, x, weight, bias, mean, rstd)), mode, offset)
        dx = x.new_empty(x.shape)
        dw = None if weight is None else weight.new_empty(weight.shape)
        db = None if bias is None else bias.new_empty(bias.shape)
        if plan.wcast is not None and weight is not None:
            weight = weight.to(plan.wcast)
        stream = current_stream(x.get_device(), True)
        if plan.reduce is None:  # no weight nor bias: dx only
            plan.main((grad.data_ptr(), x.data_ptr(), 0, 0 if mean is None else mean.data_ptr(), rstd.data_ptr(),
                       dx.data_ptr(), 0, 0), stream)
            return dx, dw, db
        partial = x.new_empty(plan.partial, dtype=plan.macc)
        pp = partial.data_ptr()
        pb = 0 if db is None else pp + (plan.step if dw is not None else 0)
        plan.main((grad.data_ptr(), x.data_ptr(), 0 if weight is None else weight.data_ptr(),
                   0 if mean is None else mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), 0 if dw is None else pp, pb),
                  stream)
        outs = [o.data_ptr() for o in (dw, db) if o is not None]
        plan.reduce((pp, outs[0], outs[-1]), stream)
        return dx, dw, db
    key = (mode, offset, _csig(grad), _csig(x), _csig(weight), _csig(bias), _csig(mean), _csig(rstd))
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _backward_first(grad, x, weight, bias, mean, rstd, mode, offset, key)
    if plan.__class__ is Densify:
        return backward_gpu(*plan.apply((grad, x, weight, bias, mean, rstd)), mode, offset)
    return _backward_run(plan, grad, x, weight, bias, mean, rstd, "cupy", current_stream(x.device.id, False))


def _backward_run(plan: _BwdPlan, grad: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any, kind: str,
                  stream: Any) -> tuple[Any, Any, Any]:
    """A backward launch from a plan, any array kind (the first call and the CuPy path)."""
    H = int(x.shape[-1])
    dx = _empty(tuple(x.shape), x, kind, dtype_name(x, kind))
    dw = None if weight is None else _empty((H,), weight, kind, dtype_name(weight, kind))
    db = None if bias is None else _empty((H,), bias, kind, dtype_name(bias, kind))
    weight = _cast(weight, plan.wcast, kind)
    p = _ptr
    if plan.reduce is None:
        plan.main((p(grad, kind), p(x, kind), 0, p(mean, kind), p(rstd, kind), p(dx, kind), 0, 0), stream)
        return dx, dw, db
    partial = _empty(plan.partial, x, kind, plan.macc)
    pp = p(partial, kind)
    pb = 0 if db is None else pp + (plan.step if dw is not None else 0)
    plan.main((p(grad, kind), p(x, kind), p(weight, kind), p(mean, kind), p(rstd, kind), p(dx, kind),
               0 if dw is None else pp, pb), stream)
    outs = [p(o, kind) for o in (dw, db) if o is not None]
    plan.reduce((pp, outs[0], outs[-1]), stream)
    return dx, dw, db


def _backward_first(grad: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any, mode: int, offset: float,
                    key: tuple) -> tuple[Any, Any, Any]:
    fn = _FN[mode] + "_backward"
    c = _validate(fn, x, weight, bias, mode, 0.0, offset)
    kind = c.kind
    check_grad(fn, grad, x, c)
    _check_stats(fn, x, kind, c.x, [("rstd", rstd)] + ([("mean", mean)] if mode == LAYER else []))
    device = device_of(x)
    if device is None:
        raise ValueError(f"cukit.ops.norm.backward_gpu: x must be a CUDA array; got {type_name(x)} on the CPU")
    arrays = (grad, x, weight, bias, mean, rstd)
    dense = Densify.needed(arrays, kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _BWD_PLANS.put(key, dense)
        return backward_gpu(*dense.apply(arrays), mode, offset)
    H = int(x.shape[-1])
    rows = math.prod(x.shape[:-1])
    if rows == 0 or H == 0:  # not cached: rare, and the zero fills are not launches of ours
        dx = _empty(tuple(x.shape), x, kind, c.x)
        outs = [None if a is None else _empty((H,), a, kind, dtype_name(a, kind)) for a in (weight, bias)]
        for o in outs:
            if o is not None:
                o[...] = 0
        return dx, outs[0], outs[1]
    wk = _kernel_weight(c, mode)
    wcast = wk if c.w is not None and wk != c.w else None
    T, W, out = DTYPES[c.x], DTYPES[wk], DTYPES[c.out]
    macc = "float64" if "float64" in (c.x, wk) else "float32"
    msize = DTYPES[macc].itemsize
    wptr = _ptr(weight, kind)
    if wcast is not None:  # the cast copy is fresh (aligned); the caller's weight is what the key saw
        wptr = 0
    vec = _vec(c.x, H, [(_ptr(grad, kind), out.itemsize), (_ptr(x, kind), T.itemsize), (wptr, W.itemsize)])
    nv = _nv(True, vec, T.itemsize, W.itemsize, layer=mode == LAYER)
    tpr, rpb = _bwd_threads(H, vec, nv, T.itemsize)
    one = _one_chunk(H, tpr, nv, vec)
    in_regs = one == "true"
    nout = (weight is not None) + (mode == LAYER and bias is not None)
    smem, smem_acc = 0, 0
    if nout and in_regs and rpb > 1:
        smem = rpb * H * msize
    elif nout and not in_regs and nout * H * msize + 1024 <= device_caps(device).smem_optin:
        smem, smem_acc = nout * H * msize, 1
    name = f"norm_bwd<{T.ctype}, {W.ctype}, {mode}, {vec}, {nv}, {one}>"
    blocks = -(-rows // rpb)
    if nout:  # persistent: every block in the first wave, each summing its rows into one partial row
        per_sm = _resident_blocks(KERNELS.function(name, device), tpr * rpb, smem, device)
        blocks = min(blocks, sm_count(device) * per_sm)
    if blocks > _GRID_MAX:
        raise ValueError(f"{fn}: x has {rows} rows; at most {_GRID_MAX * rpb} are supported at H = {H}")
    main = KERNELS.prepare(name, (blocks,), (tpr, rpb), (rows, H, offset, smem_acc), device=device, shared_mem=smem)
    reduce = None
    if nout:
        dname = c.w if c.w is not None else c.x
        reduce = KERNELS.prepare(f"norm_reduce<{DTYPES[macc].ctype}, {DTYPES[dname].ctype}>",
                                 (-(-H // 32), nout), (32, _REDUCE_SPLIT), (blocks, H), device=device)
    plan = _BwdPlan(main, reduce, (nout, blocks, H), _lib_dtype(macc, kind), blocks * H * msize,
                    None if wcast is None else _lib_dtype(wcast, kind))
    out = _backward_run(plan, grad, x, weight, bias, mean, rstd, kind, current_stream(device, kind == "torch"))
    _BWD_PLANS.put(key, plan)
    return out


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------

# NaN and infinite inputs follow IEEE arithmetic, as in the kernels: results, not accidents, so the
# NumPy references silence NumPy's warnings about them.
_IEEE = {"over": "ignore", "invalid": "ignore", "divide": "ignore"}


def _np64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _rows_sum_np(a: np.ndarray, H: int) -> np.ndarray:
    return a.reshape(-1, H).sum(axis=0) if a.size else np.zeros(H)


def rms_norm_reference_numpy(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6,
                             offset: float = 0.0, cast: str = "llama") -> np.ndarray:
    """NumPy rms_norm in float64, rounded where the kernels round (cast="llama": x̂ to x's dtype
    before the weight; the output once, to its dtype)."""
    mode = check_cast("cukit.rms_norm", cast)
    with np.errstate(**_IEEE):
        xf = _np64(x)
        xh = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps) if xf.shape[-1] else xf
        if weight is None:
            return np.ascontiguousarray(xh.astype(x.dtype))
        scale = offset + _np64(weight)
        if mode == RMS_ROUND:
            out = numpy_dtype(promote(dtype_name(x), dtype_name(weight)))
            return np.ascontiguousarray((scale * _np64(xh.astype(x.dtype))).astype(out))
        return np.ascontiguousarray((xh * scale).astype(x.dtype))


def rms_norm_backward_reference_numpy(grad: np.ndarray, x: np.ndarray, weight: np.ndarray | None = None,
                                      eps: float = 1e-6, offset: float = 0.0,
                                      cast: str = "llama") -> tuple[np.ndarray, np.ndarray | None]:
    """NumPy rms_norm backward in float64: (dx in x's dtype, dweight in weight's dtype or None)."""
    mode = check_cast("cukit.rms_norm_backward", cast)
    H = x.shape[-1]
    with np.errstate(**_IEEE):
        xf, d = _np64(x), _np64(grad)
        rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps) if H else xf
        xh = xf * rstd
        g = d if weight is None else d * (offset + _np64(weight))
        dx = rstd * (g - xh * np.mean(g * xh, axis=-1, keepdims=True)) if H else g
        dw = None
        if weight is not None:
            xw = _np64(xh.astype(x.dtype)) if mode == RMS_ROUND else xh
            dw = _rows_sum_np(d * xw, H).astype(weight.dtype)
        return np.ascontiguousarray(dx.astype(x.dtype)), dw


def layer_norm_reference_numpy(x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None,
                               eps: float = 1e-5) -> np.ndarray:
    """NumPy layer_norm in float64 (biased variance), rounded once to x's dtype."""
    with np.errstate(**_IEEE):
        xf = _np64(x)
        if xf.shape[-1]:
            xc = xf - xf.mean(axis=-1, keepdims=True)
            xf = xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)
        if weight is not None:
            xf = xf * _np64(weight)
        if bias is not None:
            xf = xf + _np64(bias)
        return np.ascontiguousarray(xf.astype(x.dtype))


def layer_norm_backward_reference_numpy(grad: np.ndarray, x: np.ndarray, weight: np.ndarray | None = None,
                                        bias: np.ndarray | None = None,
                                        eps: float = 1e-5) -> tuple[np.ndarray, Any, Any]:
    """NumPy layer_norm backward in float64: (dx, dweight or None, dbias or None) in the inputs' dtypes."""
    H = x.shape[-1]
    with np.errstate(**_IEEE):
        xf, d = _np64(x), _np64(grad)
        if H:
            xc = xf - xf.mean(axis=-1, keepdims=True)
            rstd = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)
            xh = xc * rstd
        else:
            rstd = xh = xf
        g = d if weight is None else d * _np64(weight)
        dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xh * np.mean(g * xh, axis=-1, keepdims=True)) if H else g
        dw = None if weight is None else _rows_sum_np(d * xh, H).astype(weight.dtype)
        db = None if bias is None else _rows_sum_np(d, H).astype(bias.dtype)
        return np.ascontiguousarray(dx.astype(x.dtype)), dw, db


def _acc(dtype: Any) -> Any:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _sum_rows(t: Any, keep: int) -> Any:
    """t summed over every dimension but the first `keep` and the last (a weight's gradient; keep=1
    under vmap: one per sample)."""
    dims = tuple(range(keep, t.ndim - 1))
    return t.sum(dims) if dims else t


def rms_norm_reference_torch(x: Any, weight: Any, eps: float, offset: float = 0.0,
                             cast: str = "llama") -> tuple[Any, Any]:
    """torch rms_norm with the kernels' maths and rounding points: ``(y, rstd)``, rstd of shape
    x.shape[:-1] in float32 (float64 for float64 x). The torch-CPU fallback and what torch.compile
    traces; `weight` may broadcast against x (vmap over per-sample weights)."""
    import torch

    acc = _acc(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    xh = xf * rstd.unsqueeze(-1)
    if weight is None:
        return xh.to(x.dtype).contiguous(), rstd
    if cast == "llama":
        out = torch.promote_types(weight.dtype, x.dtype)
        m = torch.float64 if torch.float64 in (weight.dtype, acc) else acc
        return ((offset + weight.to(m)) * xh.to(x.dtype).to(m)).to(out).contiguous(), rstd
    return (xh * (offset + weight.to(acc))).to(x.dtype).contiguous(), rstd


def rms_norm_backward_reference_torch(grad: Any, x: Any, weight: Any, eps: float, offset: float = 0.0,
                                      cast: str = "llama", rstd: Any = None, keep: int = 0) -> tuple[Any, Any]:
    """torch rms_norm backward with the kernels' maths: ``(dx, dweight or None)``. rstd None:
    recomputed from x (differentiable: the double backward's form). `keep` leading dimensions are
    kept in dweight (vmap)."""
    import torch

    acc = _acc(x.dtype)
    xf = x.to(acc)
    r = (torch.rsqrt(xf.square().mean(-1) + eps) if rstd is None else rstd.to(acc)).unsqueeze(-1)
    xh = xf * r
    m = torch.float64 if weight is not None and torch.float64 in (weight.dtype, acc) else acc
    d = grad.to(m)
    g = (d if weight is None else d * (offset + weight.to(m))).to(acc)
    dx = (r * (g - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype).contiguous()
    if weight is None:
        return dx, None
    xw = xh.to(x.dtype).to(m) if cast == "llama" else xh.to(m)
    return dx, _sum_rows(d * xw, keep).to(weight.dtype)


def layer_norm_reference_torch(x: Any, weight: Any, bias: Any, eps: float) -> tuple[Any, Any, Any]:
    """torch layer_norm with the kernels' maths: ``(y, mean, rstd)``, the statistics of shape
    x.shape[:-1] in float32 (float64 for float64 x). The torch-CPU fallback and what torch.compile
    traces; weight and bias may broadcast against x."""
    import torch

    acc = _acc(x.dtype)
    xf = x.to(acc)
    mean = xf.mean(-1)
    xc = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    y = xc * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).contiguous(), mean, rstd


def layer_norm_backward_reference_torch(grad: Any, x: Any, weight: Any, bias: Any, eps: float, mean: Any = None,
                                        rstd: Any = None, keep: int = 0) -> tuple[Any, Any, Any]:
    """torch layer_norm backward with the kernels' maths: ``(dx, dweight, dbias)`` (None for a
    missing weight or bias). Statistics None: recomputed from x (differentiable)."""
    import torch

    acc = _acc(x.dtype)
    xf = x.to(acc)
    if mean is None or rstd is None:
        mu = xf.mean(-1, keepdim=True)
        r = torch.rsqrt((xf - mu).square().mean(-1, keepdim=True) + eps)
    else:
        mu, r = mean.to(acc).unsqueeze(-1), rstd.to(acc).unsqueeze(-1)
    xh = (xf - mu) * r
    d = grad.to(acc)
    g = d if weight is None else d * weight.to(acc)
    dx = (r * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype).contiguous()
    dw = None if weight is None else _sum_rows(d * xh, keep).to(weight.dtype)
    db = None if bias is None else _sum_rows(d, keep).to(bias.dtype)
    return dx, dw, db
