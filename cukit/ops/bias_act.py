"""Fused bias + activation: ``y = act(x + bias)``, bias broadcast over the last dimension.

Kernels: ``raw_kernels/bias_act.cu``. The NumPy and torch references below are the CPU fallbacks
and the test oracles. torch registration (autograd, torch.compile, CUDA graphs):
``cukit/torch/bias_act.py``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cukit._device import sm_count
from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    DType,
    NotAnArrayError,
    array_class,
    array_kind,
    as_array,
    current_stream,
    device_of,
    dtype_name,
    is_array,
    not_an_array_error,
    type_name,
)

__all__ = [
    "ACTIVATIONS",
    "as_bias",
    "as_operands",
    "bias_act",
    "bias_act_backward",
    "reference_numpy",
    "reference_torch",
]

# Ids match enum Activation in raw_kernels/include/cukit/activations.cuh.
ACTIVATIONS: dict[str, int] = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
_ACT_NAMES = {v: k for k, v in ACTIVATIONS.items()}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        dt = DTYPES[name]
        exprs: list[str] = []
        for a in ACTIVATIONS.values():
            for v in (16 // dt.itemsize, 1):  # the 16-byte vector path and the scalar path
                exprs += [f"bias_act_fwd<{dt.ctype}, {a}, {v}, {idx}>" for idx in ("int", "long long")]
                exprs.append(f"bias_act_fwd_rows<{dt.ctype}, {a}, {v}>")
                exprs.append(f"bias_act_bwd<{dt.ctype}, {a}, {v}>")
        exprs.append(f"bias_act_bwd_reduce<{dt.ctype}>")
        groups[name] = exprs
    return groups


KERNELS = KernelModule(
    "bias_act.cu",
    instantiations=_instantiations(),
    signatures={
        "bias_act_fwd": "ptr ptr ptr i64 i64",
        "bias_act_fwd_rows": "ptr ptr ptr i64 i64",
        "bias_act_bwd": "ptr ptr ptr ptr ptr ptr i64 i64 i64",
        "bias_act_bwd_reduce": "ptr ptr i64 i64",
    },
)

_BLOCK = 256
_FWD_UNROLL = 4  # >= FWD_UNROLL in bias_act.cu (bounds the indices the flat kernel forms)
_MAX_GRID_X, _MAX_GRID_Y = 2**31 - 1, 65535
# The forward kernels' grids cover the array in one trip (their loops are for grids past the launch
# limits): short-lived blocks replacing each other on an SM keep more loads in flight than a fixed
# set of resident blocks looping (benchmarks/NOTES.md)
_ROWS_MIN_VECTORS = 32  # rows of at least a warp's worth of vectors take bias_act_fwd_rows
# Backward problems whose threads would each cover at most this many rows in one split run in one
# launch (dbias written by the kernel, no workspace): a few unrolled trips per thread, cheaper on
# the device than the host's second launch and workspace allocation (see backward_gpu).
_BWD_ONE_SPLIT_ROWS = 16
_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def activation_id(activation: str | None, fn: str = "cukit.bias_act", *, allow_none: bool = False) -> int:
    """The kernel's id of an activation name; -1 for None when ``allow_none`` (linear's "no
    activation"). ValueError naming fn and the accepted values otherwise."""
    try:
        return ACTIVATIONS[activation]  # type: ignore[index]
    except (KeyError, TypeError):
        if allow_none and activation is None:
            return -1
        names = (["None"] if allow_none else []) + [repr(a) for a in ACTIVATIONS]
        raise ValueError(f"{fn}: activation must be one of {', '.join(names)}; got {activation!r}") from None


def _dtypes_text(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}"


def validate(x: Any, bias: Any, activation: str, fn: str = "cukit.bias_act") -> tuple[str, int, DType]:
    """Check the arguments of bias_act and return (array kind, activation id, dtype).

    Raises NotAnArrayError when x or bias is not an array (the public ops then convert array-likes),
    TypeError/ValueError naming fn and the argument otherwise."""
    try:
        kind = array_kind(x)
        bias_kind = array_kind(bias)
    except NotAnArrayError:
        raise not_an_array_error(fn, (("x", x), ("bias", bias))) from None
    if bias_kind != kind:
        raise TypeError(f"{fn}: bias must be the same array type as x ({array_class(kind)}); got {type_name(bias)}")
    act = activation_id(activation, fn)
    name = dtype_name(x, kind)
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x must have dtype {_dtypes_text(FLOAT_DTYPES)}; got {name}")
    if bias.dtype != x.dtype and dtype_name(bias, kind) != name:  # names: byte order is no mismatch
        raise TypeError(
            f"{fn}: bias must have x's dtype {name}; got {dtype_name(bias, kind)} "
            "(no dtype promotion here: cast one of them)"
        )
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have at least one dimension (..., C), bias broadcasting over the last; got shape ()")
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{fn}: bias must have shape ({x.shape[-1]},) to match x's last dimension (x has shape "
            f"{tuple(x.shape)}); got {tuple(bias.shape)}"
        )
    dx, db = device_of(x), device_of(bias)
    if dx != db:
        raise ValueError(f"{fn}: x and bias must be on the same device; got {_where(dx)} and {_where(db)}")
    return kind, act, DTYPES[name]


def _check_grad(fn: str, grad: Any, x: Any, kind: str) -> None:
    """grad must be x's array type, dtype, shape and device. NotAnArrayError when it is no array."""
    try:
        grad_kind = array_kind(grad)
    except NotAnArrayError:
        raise not_an_array_error(_qualified(fn), (("grad", grad),)) from None
    if grad_kind != kind:
        raise TypeError(
            f"{_qualified(fn)}: grad must be the same array type as x ({array_class(kind)}); got {type_name(grad)}"
        )
    if grad.dtype != x.dtype and dtype_name(grad, kind) != dtype_name(x, kind):
        raise TypeError(
            f"{_qualified(fn)}: grad must have x's dtype {dtype_name(x, kind)}; got grad with dtype "
            f"{dtype_name(grad, kind)}"
        )
    if tuple(grad.shape) != tuple(x.shape):
        raise ValueError(f"{_qualified(fn)}: grad must have x's shape {tuple(x.shape)}; got {tuple(grad.shape)}")
    if device_of(grad) != device_of(x):
        raise ValueError(
            f"{_qualified(fn)}: grad must be on x's device ({_where(device_of(x))}); got {_where(device_of(grad))}"
        )


def _qualified(fn: str) -> str:
    return fn if fn.startswith("cukit.") else f"cukit.{fn}"


# ---------------------------------------------------------------------------------------------
# Array-likes (lists, tuples, scalars): converted off the arrays' path
# ---------------------------------------------------------------------------------------------

_NO_GRAD: Any = object()


def as_bias(bias: Any, x: Any, fn: str, size: int | None) -> Any:
    """A bias that is not an array, as an array like x (x is an array).

    A scalar (Python or NumPy, or anything that converts to a 0-d array) broadcasts to ``(size,)``,
    as ``x + bias`` would in NumPy; a Python bool/int/float takes x's floating dtype (NumPy's weak
    scalars, NEP 50), a NumPy scalar keeps its own dtype. Other array-likes convert with
    ``numpy.asarray``'s dtype (see ``cukit.interop.as_array``). size None (no valid size is known):
    a scalar stays 0-d, for the validation to report the other argument.
    """
    kind = array_kind(x)
    weak = type(bias) in (bool, int, float) and dtype_name(x, kind) in FLOAT_DTYPES
    if not weak:
        bias = as_array(bias, fn, "bias", like=x)
        if bias.ndim or size is None:
            return bias
    shape = () if size is None else (size,)
    if kind == "torch":
        import torch

        if weak:
            return torch.full(shape, bias, dtype=x.dtype, device=x.device)
        return bias.expand(shape).contiguous()
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(x.device.id):
            if weak:
                return cupy.full(shape, bias, dtype=x.dtype)
            return cupy.ascontiguousarray(cupy.broadcast_to(bias, shape))
    return np.full(shape, bias, dtype=x.dtype if weak else bias.dtype)


def as_operands(fn: str, x: Any, bias: Any, grad: Any = _NO_GRAD) -> tuple[Any, Any, Any]:
    """(x, bias, grad) of bias_act / bias_act_backward with array-likes converted: like the first
    array among x, grad and bias (NumPy if none is), bias by ``as_bias``. Arrays stay as they are."""
    has_grad = grad is not _NO_GRAD
    like = next((t for t in (x, grad if has_grad else None, bias) if is_array(t)), None)
    if not is_array(x):
        x = as_array(x, fn, "x", like)
    if has_grad and not is_array(grad):
        grad = as_array(grad, fn, "grad", like)
    if not is_array(bias):
        bias = as_bias(bias, x, fn, x.shape[-1] if x.ndim else None)
    return x, bias, grad


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def bias_act(x: Any, bias: Any, activation: str = "relu") -> Any:
    """Fused bias + activation: ``y = act(x + bias)``.

    Args:
        x: array of shape (..., C), float16, bfloat16, float32 or float64; NumPy, CuPy or torch
            (CPU or CUDA). Non-contiguous inputs are copied to a contiguous buffer first.
        bias: array of shape (C,), same type, dtype and device as x (no dtype promotion). A scalar
            broadcasts over C, as in NumPy's ``x + bias``: a Python float/int takes x's dtype
            (NumPy's weak scalars), a NumPy scalar keeps its dtype (so must be x's).
        activation: "relu", "gelu" (exact, erf), "gelu_tanh" (tanh approximation) or "silu".

    Array-likes (lists, tuples, anything ``numpy.asarray`` takes) are converted as
    ``numpy.asarray`` converts them (a list of Python floats is float64), into the library and
    device of the other argument when that is a CuPy/torch array; two array-likes give a NumPy
    result. ``bias_act(x32, [0.1, 0.2])`` therefore raises (a float64 bias for a float32 x).

    Returns:
        y, contiguous, same shape, dtype and array type as x. CUDA inputs run one fused kernel
        (maths in float32 for the 16-bit types); NumPy and torch-CPU inputs run the reference.
        torch tensors are differentiable (x and bias) and work under torch.compile and CUDA graphs.
        NaN and infinite inputs follow IEEE arithmetic (the CPU reference emits no NumPy warnings).

    Raises:
        TypeError (wrong type or dtype) and ValueError (wrong shape, device or activation); each
        message names ``cukit.bias_act`` and the argument.

    See also: ``torch.nn.functional.gelu(x + bias)``, ``torch.nn.functional.silu``, ``numpy.maximum``.
    """
    try:
        return _bias_act_arrays(x, bias, activation)
    except NotAnArrayError:
        x, bias, _ = as_operands("cukit.bias_act", x, bias)
    return _bias_act_arrays(x, bias, activation)


def _bias_act_arrays(x: Any, bias: Any, activation: str) -> Any:
    """bias_act for arrays (NotAnArrayError for anything else, before any work)."""
    kind, act, _ = validate(x, bias, activation)
    if kind == "numpy":
        return reference_numpy(x, bias, activation)
    if device_of(x) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return reference_torch(x, bias, activation)
    return forward_gpu(x, bias, act)


def bias_act_backward(grad: Any, x: Any, bias: Any, activation: str = "relu") -> tuple[Any, Any]:
    """Gradients of bias_act: ``dx = grad * act'(x + bias)``, ``dbias = dx summed over all but the
    last dimension``.

    For NumPy and CuPy users (torch users get this through autograd). grad has x's shape, dtype
    and type; x and bias as for ``bias_act`` (array-likes and scalar biases included). dbias
    accumulates in float32 (float64 for float64) with a fixed summation order, so it is bitwise
    reproducible on a given GPU.

    Raises:
        TypeError and ValueError naming ``cukit.bias_act_backward`` and the argument (grad's dtype
        mismatch names both dtypes).

    See also: ``torch.autograd.grad``.
    """
    try:
        return _backward_arrays(grad, x, bias, activation)
    except NotAnArrayError:
        x, bias, grad = as_operands("cukit.bias_act_backward", x, bias, grad)
    return _backward_arrays(grad, x, bias, activation)


def _backward_arrays(grad: Any, x: Any, bias: Any, activation: str) -> tuple[Any, Any]:
    """bias_act_backward for arrays (NotAnArrayError for anything else, before any work)."""
    kind, act, _ = validate(x, bias, activation, "cukit.bias_act_backward")
    _check_grad("cukit.bias_act_backward", grad, x, kind)
    if kind == "numpy":
        return reference_backward_numpy(grad, x, bias, activation)
    if device_of(x) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return reference_backward_torch(grad, x, bias, activation)
    return backward_gpu(grad, x, bias, act)


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------


def _empty(shape: tuple[int, ...], like: Any, kind: str, dtype: str | None = None) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype) if dtype else like.dtype, device=like.device)
    import cupy

    with like.device:  # allocate on the input's GPU, not the current one
        return cupy.empty(shape, dtype=dtype or like.dtype)


def _ptr(a: Any, kind: str) -> int:
    return a.data_ptr() if kind == "torch" else a.data.ptr


def _vec(dt: DType, C: int, ptrs: list[int]) -> int:
    v = 16 // dt.itemsize
    if C % v == 0 and all(p % 16 == 0 for p in ptrs):
        return v
    return 1


# Signatures -> plans. A plan launches on contiguous arrays, whose pointers are then the only
# per-call inputs; a signature with non-contiguous arrays maps to a Densify entry (copy, then the
# contiguous signature's plan). Fresh outputs are always 16-byte aligned.
_FWD_PLANS = PlanCache("bias_act_fwd", maxsize=1024)
_BWD_PLANS = PlanCache("bias_act_bwd", maxsize=1024)


def _key(tag: str, act: int, *arrays: Any) -> tuple:
    """A call's signature: kind, shape, strides, dtype, device and 16-byte alignment of each array."""
    if hasattr(arrays[0], "data_ptr"):
        return (tag, act, *((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15) for t in arrays))
    for t in arrays:
        if type(t) is np.ndarray:
            raise TypeError(
                "cukit.ops.bias_act: the GPU path (forward_gpu, backward_gpu) needs CuPy arrays or torch CUDA "
                "tensors; got a numpy.ndarray"
            )
    return (tag, act, *((t.shape, t.strides, t.dtype, t.device.id, t.data.ptr & 15) for t in arrays))


class _FwdPlan:
    __slots__ = ("run", "shape")

    def __init__(self, shape: tuple[int, ...], run: Any) -> None:
        self.shape, self.run = shape, run


class _BwdPlan:
    __slots__ = ("acc", "main", "reduce", "splits")

    def __init__(self, main: Any, reduce: Any, splits: int, acc: str) -> None:
        self.main, self.reduce, self.splits, self.acc = main, reduce, splits, acc


def forward_gpu(x: Any, bias: Any, act: int) -> Any:
    """``act(x + bias)`` for a CuPy array or torch CUDA tensor pair: one kernel launch. Arguments
    are validated on a signature's first call (see :func:`validate`); later calls with the same
    signature are a plan-cache lookup, an allocation and a launch."""
    key = _key("fwd", act, x, bias)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _forward_first(x, bias, act, key)
    if plan.__class__ is Densify:
        return forward_gpu(*plan.apply((x, bias)), act)
    if hasattr(x, "data_ptr"):
        y = x.new_empty(plan.shape)
        if plan.run is not None:
            plan.run((x.data_ptr(), bias.data_ptr(), y.data_ptr()), current_stream(x.get_device(), True))
        return y
    y = _empty(plan.shape, x, "cupy")
    if plan.run is not None:
        plan.run((x.data.ptr, bias.data.ptr, y.data.ptr), current_stream(x.device.id, False))
    return y


def _forward_first(x: Any, bias: Any, act: int, key: tuple) -> Any:
    kind, _, dt = validate(x, bias, _ACT_NAMES[act])
    device = device_of(x)
    if device is None:
        raise ValueError("cukit.ops.bias_act.forward_gpu: x and bias must be CUDA arrays; got arrays on the CPU")
    dense = Densify.needed((x, bias), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _FWD_PLANS.put(key, dense)
        return forward_gpu(*dense.apply((x, bias)), act)
    y = _empty(tuple(x.shape), x, kind)
    n = math.prod(x.shape)
    if n == 0:
        _FWD_PLANS.put(key, _FwdPlan(tuple(y.shape), None))
        return y
    C = int(bias.shape[0])
    px, pb, py = _ptr(x, kind), _ptr(bias, kind), _ptr(y, kind)
    vec = _vec(dt, C, [px, pb, py])
    cv = C // vec
    if cv >= _ROWS_MIN_VECTORS:
        rows = n // C
        bx = min(_BLOCK, 1 << (cv - 1).bit_length())
        by = _BLOCK // bx
        col_blocks = -(-cv // bx)
        row_blocks = max(1, min(-(-rows // by), _MAX_GRID_Y))
        run = KERNELS.prepare(
            f"bias_act_fwd_rows<{dt.ctype}, {act}, {vec}>", (col_blocks, row_blocks), (bx, by), (rows, C), device=device
        )
    else:
        nv = n // vec
        blocks = max(1, min(-(-nv // _BLOCK), _MAX_GRID_X))
        # int indexing while no index the kernel forms (up to nv + FWD_UNROLL * threads) can overflow
        index = "int" if nv + _FWD_UNROLL * blocks * _BLOCK <= _INT32_MAX else "long long"
        run = KERNELS.prepare(
            f"bias_act_fwd<{dt.ctype}, {act}, {vec}, {index}>", (blocks,), (_BLOCK,), (n, C), device=device
        )
    run((px, pb, py), current_stream(device, kind == "torch"))
    _FWD_PLANS.put(key, _FwdPlan(tuple(y.shape), run))
    return y


def backward_gpu(grad: Any, x: Any, bias: Any, act: int) -> tuple[Any, Any]:
    """``(dx, dbias) = (grad * act'(x + bias), dx summed over all but the last dimension)`` for
    CuPy arrays or torch CUDA tensors. Large problems: two launches (per-split partial sums in
    fp32/fp64, then a fixed-order reduction); small ones (at most ``_BWD_ONE_SPLIT_ROWS`` rows per
    thread): one launch whose blocks sum whole columns, no workspace. Either way bitwise
    reproducible for a given shape. Validated on a signature's first call."""
    key = _key("bwd", act, grad, x, bias)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _backward_first(grad, x, bias, act, key)
    if plan.__class__ is Densify:
        return backward_gpu(*plan.apply((grad, x, bias)), act)
    C = bias.shape[0]
    if hasattr(x, "data_ptr"):
        dx = x.new_empty(x.shape)
        dbias = bias.new_empty((C,))
        stream = current_stream(x.get_device(), True)
        if plan.reduce is None:
            plan.main((grad.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(), 0, dbias.data_ptr()), stream)
            return dx, dbias
        import torch

        partial = x.new_empty((plan.splits, C), dtype=getattr(torch, plan.acc))
        pp = partial.data_ptr()
        plan.main((grad.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(), pp, 0), stream)
        plan.reduce((pp, dbias.data_ptr()), stream)
        return dx, dbias
    dx = _empty(tuple(x.shape), x, "cupy")
    dbias = _empty((C,), bias, "cupy")
    stream = current_stream(x.device.id, False)
    if plan.reduce is None:
        plan.main((grad.data.ptr, x.data.ptr, bias.data.ptr, dx.data.ptr, 0, dbias.data.ptr), stream)
        return dx, dbias
    partial = _empty((plan.splits, C), x, "cupy", plan.acc)
    plan.main((grad.data.ptr, x.data.ptr, bias.data.ptr, dx.data.ptr, partial.data.ptr, 0), stream)
    plan.reduce((partial.data.ptr, dbias.data.ptr), stream)
    return dx, dbias


def _backward_first(grad: Any, x: Any, bias: Any, act: int, key: tuple) -> tuple[Any, Any]:
    kind, _, dt = validate(x, bias, _ACT_NAMES[act], "cukit.bias_act_backward")
    _check_grad("cukit.bias_act_backward", grad, x, kind)
    device = device_of(x)
    if device is None:
        raise ValueError(
            "cukit.ops.bias_act.backward_gpu: grad, x and bias must be CUDA arrays; got arrays on the CPU"
        )
    dense = Densify.needed((grad, x, bias), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _BWD_PLANS.put(key, dense)
        return backward_gpu(*dense.apply((grad, x, bias)), act)
    dx = _empty(tuple(x.shape), x, kind)
    C = int(bias.shape[0])
    n = math.prod(x.shape)
    if n == 0:  # not cached: rare, and the zero fill is not a launch of ours
        dbias = _empty((C,), bias, kind)
        dbias[...] = 0
        return dx, dbias
    dbias = _empty((C,), bias, kind)
    rows = n // C
    pg, px, pb, pdx = _ptr(grad, kind), _ptr(x, kind), _ptr(bias, kind), _ptr(dx, kind)
    vec = _vec(dt, C, [pg, px, pb, pdx])
    cv = C // vec
    bx = min(32, 1 << (cv - 1).bit_length())
    by = _BLOCK // bx
    col_blocks = -(-cv // bx)
    target_blocks = sm_count(device) * (2048 // _BLOCK)
    if -(-rows // by) <= _BWD_ONE_SPLIT_ROWS:
        splits = 1
    else:
        splits = max(1, min(-(-target_blocks // col_blocks), -(-rows // by), 65535))
    rows_per_split = -(-rows // splits)
    splits = -(-rows // rows_per_split)
    acc = "float64" if dt.name == "float64" else "float32"
    stream = current_stream(device, kind == "torch")
    acc_size = 8 if acc == "float64" else 4
    main = KERNELS.prepare(
        f"bias_act_bwd<{dt.ctype}, {act}, {vec}>",
        (col_blocks, splits),
        (bx, by),
        (rows, C, rows_per_split),
        device=device,
        shared_mem=bx * by * vec * acc_size,
    )
    reduce = None
    if splits == 1:  # the kernel writes dbias
        main((pg, px, pb, pdx, 0, _ptr(dbias, kind)), stream)
    else:
        partial = _empty((splits, C), x, kind, acc)
        reduce = KERNELS.prepare(
            f"bias_act_bwd_reduce<{dt.ctype}>", (max(1, min(-(-C // _BLOCK), target_blocks)),), (_BLOCK,),
            (splits, C), device=device,
        )
        pp = _ptr(partial, kind)
        main((pg, px, pb, pdx, pp, 0), stream)
        reduce((pp, _ptr(dbias, kind)), stream)
    _BWD_PLANS.put(key, _BwdPlan(main, reduce, splits, acc))
    return dx, dbias


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _np_erfc(z: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erfc
    except ImportError:  # exact, but a Python call per element
        return np.frompyfunc(math.erfc, 1, 1)(z).astype(np.float64)
    return erfc(z)


# The forms below are the kernels' exact ones (raw_kernels/include/cukit/activations.cuh): the
# normal CDF as erfc(-z / sqrt2) / 2, (1 + tanh u) / 2 as sigmoid(2u), and 1 - sigmoid(v) as
# sigmoid(-v), none of which cancels in either tail as 1 + erf, 1 + tanh and 1 - s do.


# The references follow IEEE arithmetic on NaN/inf inputs as the kernels do (inf * 0 is NaN, exp
# overflows to inf, a float16 cast of a large value is inf): those are results, not accidents, so
# reference_numpy and reference_backward_numpy silence NumPy's RuntimeWarnings about them (the
# helpers below run only inside those two).
_IEEE = {"over": "ignore", "invalid": "ignore"}


def _np_act(z: np.ndarray, activation: str) -> np.ndarray:
    if activation == "relu":
        return np.maximum(z, 0.0)
    if activation == "gelu":
        return 0.5 * z * _np_erfc(-z * _INV_SQRT2)
    if activation == "gelu_tanh":
        return z / (1.0 + np.exp(-2.0 * _SQRT_2_OVER_PI * (z + 0.044715 * z**3)))
    return z / (1.0 + np.exp(-z))


def _np_act_grad(z: np.ndarray, activation: str) -> np.ndarray:
    if activation == "relu":
        return (z > 0).astype(np.float64)
    if activation == "gelu":
        return 0.5 * _np_erfc(-z * _INV_SQRT2) + z * _INV_SQRT_2PI * np.exp(-0.5 * z * z)
    if activation == "gelu_tanh":
        v = 2.0 * _SQRT_2_OVER_PI * (z + 0.044715 * z**3)
        s, q = 1.0 / (1.0 + np.exp(-v)), 1.0 / (1.0 + np.exp(v))  # sigmoid(v), 1 - sigmoid(v)
        return s + 2.0 * z * s * q * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)
    s, q = 1.0 / (1.0 + np.exp(-z)), 1.0 / (1.0 + np.exp(z))
    return s * (1.0 + z * q)


def reference_numpy(x: np.ndarray, bias: np.ndarray, activation: str) -> np.ndarray:
    """NumPy bias_act, ``act(x + bias)`` computed in float64 and rounded once to x's dtype."""
    activation_id(activation)
    with np.errstate(**_IEEE):
        z = np.asarray(x, dtype=np.float64) + np.asarray(bias, dtype=np.float64)
        return np.ascontiguousarray(_np_act(z, activation).astype(x.dtype))


def reference_backward_numpy(
    grad: np.ndarray, x: np.ndarray, bias: np.ndarray, activation: str
) -> tuple[np.ndarray, np.ndarray]:
    """NumPy bias_act backward in float64: (dx, dbias) in x's dtype."""
    with np.errstate(**_IEEE):
        z = np.asarray(x, dtype=np.float64) + np.asarray(bias, dtype=np.float64)
        g = np.asarray(grad, dtype=np.float64) * _np_act_grad(z, activation)
        dbias = g.reshape(-1, x.shape[-1]).sum(axis=0) if g.size else np.zeros(x.shape[-1])
        return np.ascontiguousarray(g.astype(x.dtype)), dbias.astype(bias.dtype)


def _torch_act(z: Any, activation: str) -> Any:
    """act(z) by torch's own fused CPU/CUDA ops (one pass each: the torch-CPU fallback's speed).
    Their textbook forms lose relative accuracy far in the left tail, where act(z) itself is
    below float32's absolute tolerance; the derivatives, summed into dbias, use the exact forms."""
    import torch
    import torch.nn.functional as F

    if activation == "relu":
        return torch.clamp_min(z, 0)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return F.silu(z)


def _torch_act_grad(z: Any, activation: str) -> Any:
    import torch

    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        return 0.5 * torch.erfc(z * -_INV_SQRT2) + z * _INV_SQRT_2PI * torch.exp(-0.5 * z * z)
    if activation == "gelu_tanh":
        z2 = z * z
        v = (2.0 * _SQRT_2_OVER_PI) * z * (1 + 0.044715 * z2)
        du = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z2)
        s = torch.sigmoid(v)
        return s + 2.0 * z * s * torch.sigmoid(-v) * du
    return torch.sigmoid(z) * (1 + z * torch.sigmoid(-z))


def _acc_dtype(t: Any) -> Any:
    import torch

    return torch.float64 if t.dtype == torch.float64 else torch.float32


def reference_torch(x: Any, bias: Any, activation: str) -> Any:
    """torch bias_act with the kernel's maths (float32 for the 16-bit types); the torch-CPU fallback."""
    activation_id(activation)
    acc = _acc_dtype(x)
    z = x.to(acc) + bias.to(acc)
    return _torch_act(z, activation).to(x.dtype).contiguous()


def reference_backward_torch(grad: Any, x: Any, bias: Any, activation: str) -> tuple[Any, Any]:
    """torch bias_act backward with the kernel's maths; returns (dx, dbias)."""
    acc = _acc_dtype(x)
    z = x.to(acc) + bias.to(acc)
    g = grad.to(acc) * _torch_act_grad(z, activation)
    dbias = g.reshape(-1, x.shape[-1]).sum(0) if g.numel() else g.new_zeros(x.shape[-1])
    return g.to(x.dtype).contiguous(), dbias.to(bias.dtype)
