"""2-D convolution with a fused bias + activation: ``y = act(conv2d(x, weight) + bias)``, NCHW,
``torch.nn.functional.conv2d``'s semantics with groups = 1.

Kernels: ``raw_kernels/conv2d.cu`` (implicit GEMMs: one launch forward; backward: the weight
gradient and db in one pass of split partial sums plus a fixed-order reduction, and the input
gradient as a transposed convolution). The NumPy and torch references below are the CPU fallbacks
and the test oracles. torch registration (autograd, torch.compile, CUDA graphs):
``cukit/torch/conv2d.py``.

Geometry: ``params`` is ``(stride, padding, dilation)`` normalised by :func:`conv_params`:
``stride = (sh, sw)``, ``padding = (top, left, bottom, right)``, ``dilation = (dh, dw)``. The
kernels take the top and left pads; the bottom and right ones only set the output size (a read past
the input is a zero), which is how ``padding="same"`` with an even kernel costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cukit._device import sm_count
from cukit._runtime import KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    NotAnArrayError,
    array_class,
    array_kind,
    as_array,
    contiguous,
    current_stream,
    device_of,
    dtype_name,
    is_array,
    is_contiguous,
    not_an_array_error,
    type_name,
)
from cukit.ops.bias_act import ACTIVATIONS, _np_act, _torch_act, activation_id, as_bias

__all__ = [
    "CONV_ACTIVATIONS",
    "SAVES_PREACTIVATION",
    "backward_gpu",
    "conv2d",
    "conv_params",
    "forward_gpu",
    "geometry",
    "output_hw",
    "output_shape",
    "parse_params",
    "reference_backward_torch",
    "reference_numpy",
    "reference_torch",
    "validate",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
CONV_ACTIVATIONS: tuple[str | None, ...] = (None, *ACTIVATIONS)
# Activations whose derivative needs the pre-activation z: the forward stores z for the backward.
# relu's comes from the output (y > 0 exactly where z > 0); None needs nothing.
SAVES_PREACTIVATION = frozenset(a for a in ACTIVATIONS if a != "relu")

Params = tuple[tuple[int, int], tuple[int, int, int, int], tuple[int, int]]

_THREADS = 128  # every conv2d.cu GEMM kernel (THREADS)
_BM = 64  # GEMM rows per block (BM)
_BK = 8  # reduction depth of a stage (BK)
_TILE_COLS = (16, 32, 64)  # BN instantiated: the column tile, picked from the GEMM's column count
_ACT_IDS = (-1, *ACTIVATIONS.values())
_ACT_NAMES = {v: k for k, v in ACTIVATIONS.items()}
_WGRAD_BLOCKS_PER_SM = 2  # wgrad's split target: about two resident waves of 128-thread blocks
_WGRAD_MIN_STAGES = 8  # ... with at least 8 stages (64 pixels) per split: fewer, larger partials
_REDUCE_BLOCK = 256
_INT32_LIMIT = 2**31 - 2**12  # 32-bit kernel indices, with room for a tile's overhang
_GRID_Y_MAX = 65535


def _instantiations() -> dict[str, list[str]]:
    """Groups small enough that a model compiles only what it calls (about a second per
    instantiation): per dtype, the forward and the weight gradient per activation, and the
    activation-free backward kernels."""
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        t = DTYPES[name].ctype
        for a in _ACT_IDS:
            act = _ACT_NAMES.get(a, "none")
            groups[f"{name}/fwd/{act}"] = [f"conv2d_fprop<{t}, {bn}, {a}>" for bn in _TILE_COLS]
            groups[f"{name}/wgrad/{act}"] = [f"conv2d_wgrad<{t}, {bn}, {a}>" for bn in _TILE_COLS]
        groups[f"{name}/bwd"] = [*(f"conv2d_dgrad<{t}, {bn}>" for bn in _TILE_COLS), f"conv2d_wgrad_reduce<{t}>"]
    return groups


_GEOMETRY_ARGS = " ".join(["i32"] * 15)  # N C H W K P Q R S sh sw ph pw dh dw
KERNELS = KernelModule(
    "conv2d.cu",
    instantiations=_instantiations(),
    signatures={
        "conv2d_fprop": f"ptr ptr ptr ptr ptr {_GEOMETRY_ARGS} i32",
        "conv2d_dgrad": f"ptr ptr ptr {_GEOMETRY_ARGS} i32",
        "conv2d_wgrad": f"ptr ptr ptr ptr ptr ptr {_GEOMETRY_ARGS} i64",
        "conv2d_wgrad_reduce": "ptr ptr ptr ptr i64 i64 i64",
    },
)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _int(v: Any) -> int | None:
    """v as a Python int when it is an integer (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        return None
    return int(v)


def _pair(v: Any, name: str, fn: str, minimum: int) -> tuple[int, int]:
    what = "a positive int or a pair of positive ints" if minimum else "a non-negative int or a pair of them"
    if isinstance(v, (tuple, list)):
        vals = [_int(e) for e in v]
        if len(vals) == 2 and all(e is not None and e >= minimum for e in vals):
            return vals[0], vals[1]  # type: ignore[return-value]
    else:
        i = _int(v)
        if i is not None and i >= minimum:
            return i, i
    raise ValueError(f"{fn}: {name} must be {what}; got {v!r}")


def parse_params(stride: Any, padding: Any, dilation: Any, kernel_size: Sequence[int],
                 fn: str = "cukit.conv2d") -> Params:
    """``(stride, padding, dilation)`` as ``((sh, sw), (top, left, bottom, right), (dh, dw))``.

    stride and dilation: a positive int or a pair; padding: a non-negative int, a pair, ``"valid"``
    (no padding) or ``"same"`` (output size = input size; stride 1 only; with an even kernel the
    extra pixel goes to the bottom/right, as torch does). ValueError naming fn otherwise.
    :func:`conv_params` is the same with a cache (eager calls)."""
    R, S = int(kernel_size[0]), int(kernel_size[1])
    st = _pair(stride, "stride", fn, 1)
    dil = _pair(dilation, "dilation", fn, 1)
    if isinstance(padding, str):
        if padding == "valid":
            return st, (0, 0, 0, 0), dil
        if padding != "same":
            raise ValueError(f"{fn}: padding must be an int, a pair of ints, 'same' or 'valid'; got {padding!r}")
        if st != (1, 1):
            raise ValueError(f"{fn}: padding='same' needs stride 1 (as torch.nn.functional.conv2d); got stride {st}")
        th, tw = dil[0] * (R - 1), dil[1] * (S - 1)  # torch's split: the odd pixel goes to the far side
        return st, (th // 2, tw // 2, th - th // 2, tw - tw // 2), dil
    ph, pw = _pair(padding, "padding", fn, 0)
    return st, (ph, pw, ph, pw), dil


_PARAMS: dict[tuple, Params] = {}


def _cache_key(a: Any) -> Any:
    """a as a cache key when it is an exact int, str or tuple/list of ints; else None (1.0 and True
    hash like 1, and must still be refused)."""
    t = type(a)
    if t is int or t is str:
        return a
    if (t is tuple or t is list) and all(type(e) is int for e in a):
        return tuple(a)
    return None


def conv_params(stride: Any, padding: Any, dilation: Any, kernel_size: Sequence[int],
                fn: str = "cukit.conv2d") -> Params:
    """:func:`parse_params` through a small cache keyed by the arguments as given (a module's
    stride, padding and dilation are the same every call)."""
    key = (_cache_key(stride), _cache_key(padding), _cache_key(dilation), kernel_size[0], kernel_size[1], fn)
    if None in key[:3]:
        return parse_params(stride, padding, dilation, kernel_size, fn)
    hit = _PARAMS.get(key)
    if hit is None:
        hit = parse_params(stride, padding, dilation, kernel_size, fn)
        if len(_PARAMS) >= 256:
            _PARAMS.clear()
        _PARAMS[key] = hit
    return hit


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


def validate(x: Any, weight: Any, bias: Any, activation: str | None, fn: str = "cukit.conv2d") -> tuple[str, int]:
    """Check conv2d's array arguments; return (array kind, activation id: -1 for None).

    x (N, C, H, W), weight (K, C, R, S), bias (K,) or None: the same array type, float dtype and
    device. NotAnArrayError when one is not an array; TypeError/ValueError naming fn otherwise."""
    try:
        kind = array_kind(x)
        kinds = [array_kind(weight), None if bias is None else array_kind(bias)]
    except NotAnArrayError:
        raise not_an_array_error(fn, (("x", x), ("weight", weight), ("bias", bias))) from None
    for name, k, t in (("weight", kinds[0], weight), ("bias", kinds[1], bias)):
        if k is not None and k != kind:
            raise TypeError(f"{fn}: {name} must be the same array type as x ({array_class(kind)}); got {type_name(t)}")
    act = -1 if activation is None else activation_id(activation, fn, allow_none=True)
    dt = dtype_name(x, kind)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x must have dtype {', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}; got {dt}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and dtype_name(t, kind) != dt:
            raise TypeError(
                f"{fn}: {name} must have x's dtype {dt}; got {dtype_name(t, kind)} (no dtype promotion here: "
                "cast one of them)"
            )
    if x.ndim != 4:
        raise ValueError(f"{fn}: x must be 4-D (N, C, H, W) or 3-D (C, H, W); got shape {tuple(x.shape)}")
    if weight.ndim != 4:
        raise ValueError(
            f"{fn}: weight must be 4-D (out_channels, in_channels, kH, kW); got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{fn}: weight must have x's {x.shape[1]} input channels in dimension 1 (weight is (out_channels, "
            f"in_channels, kH, kW), groups=1); got weight of shape {tuple(weight.shape)} for x of shape "
            f"{tuple(x.shape)}"
        )
    if min(weight.shape[0], weight.shape[2], weight.shape[3]) < 1:
        raise ValueError(
            f"{fn}: weight must have at least one output channel and a kernel of at least 1x1; got shape "
            f"{tuple(weight.shape)}"
        )
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{fn}: bias must have shape ({weight.shape[0]},), (out_channels,); got {tuple(bias.shape)}")
    dx = device_of(x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and device_of(t) != dx:
            raise ValueError(f"{fn}: x and {name} must be on the same device; got {_where(dx)} and "
                             f"{_where(device_of(t))}")
    return kind, act


def output_hw(H: Any, W: Any, R: Any, S: Any, params: Params | Sequence[Sequence[int]]) -> tuple[Any, Any]:
    """The output's (P, Q) for an H x W input and an R x S kernel (plain arithmetic: symbolic
    sizes work too)."""
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = params
    return (H + pt + pb - dh * (R - 1) - 1) // sh + 1, (W + pl + pr - dw * (S - 1) - 1) // sw + 1


def geometry(x_shape: Sequence[int], w_shape: Sequence[int], params: Params, fn: str = "cukit.conv2d") -> tuple[int, ...]:
    """The kernels' geometry ``(N, C, H, W, K, P, Q, R, S, sh, sw, ph, pw, dh, dw)`` (P, Q: the
    output's height and width). ValueError when the output would be empty in H or W (as torch) or a
    size passes the kernels' 32-bit limits."""
    N, C, H, W = (int(v) for v in x_shape)
    K, _, R, S = (int(v) for v in w_shape)
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = params
    eh, ew = dh * (R - 1) + 1, dw * (S - 1) + 1  # the dilated kernel
    P, Q = output_hw(H, W, R, S, params)
    if H + pt + pb < eh or W + pl + pr < ew:
        raise ValueError(
            f"{fn}: the padded input ({H + pt + pb} x {W + pl + pr}) must be at least the dilated kernel "
            f"({eh} x {ew}); got x of shape {tuple(x_shape)}, weight {tuple(w_shape)}, padding (top, left, bottom, "
            f"right) = {(pt, pl, pb, pr)}, dilation {(dh, dw)}"
        )
    sizes = (("N", N), ("out_channels", K), ("H*W", H * W), ("P*Q", P * Q), ("C*kH*kW", C * R * S),
             ("kH*kW", R * S), ("the padded height", H + pt + pb), ("the padded width", W + pl + pr))
    big = [n for n, v in sizes if v > _INT32_LIMIT]
    if big:
        raise ValueError(f"{fn}: x and weight must keep N, out_channels, H*W, P*Q (the output plane), C*kH*kW and "
                         f"the padded sides below 2^31 - 2^12 (the kernels' 32-bit indices); {', '.join(big)} is not")
    return (N, C, H, W, K, P, Q, R, S, sh, sw, pt, pl, dh, dw)


def output_shape(x_shape: Sequence[int], w_shape: Sequence[int], params: Params | Sequence[Sequence[int]],
                 fn: str = "cukit.conv2d") -> tuple[Any, Any, Any, Any]:
    """y's shape (N, K, P, Q), checked as :func:`geometry` checks it when the sizes are ints (fake
    tensors with symbolic sizes get the arithmetic only)."""
    if all(type(v) is int for v in (*x_shape, *w_shape)):
        g = geometry(x_shape, w_shape, _as_params(params), fn)
        return g[0], g[4], g[5], g[6]
    P, Q = output_hw(x_shape[2], x_shape[3], w_shape[2], w_shape[3], params)
    return x_shape[0], w_shape[0], P, Q


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def conv2d(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    activation: str | None = None,
) -> Any:
    """Fused 2-D convolution: ``y = act(conv2d(x, weight) + bias)``, one kernel on CUDA.

    Args:
        x: (N, C, H, W), or (C, H, W) for one image; float16, bfloat16, float32 or float64. NumPy,
            CuPy or torch (CPU or CUDA). Non-contiguous inputs are copied to contiguous NCHW first.
        weight: (out_channels K, C, kH, kW); bias: (K,) or None. The same array type, dtype and
            device as x (no dtype promotion); a scalar bias broadcasts to (K,).
        stride, dilation: a positive int or a pair (height, width).
        padding: a non-negative int or pair (zeros, both sides), "valid" (none) or "same" (output
            H x W = input's; stride 1).
        activation: None, "relu", "gelu" (erf), "gelu_tanh" or "silu".

    Array-likes convert as ``numpy.asarray`` converts them, into the library and device of the
    first array argument (see ``cukit.linear``).

    Returns:
        y (N, K, P, Q) (or (K, P, Q)), contiguous, x's type, dtype and device, with
        ``P = (H + 2 ph - dh (kH - 1) - 1) // sh + 1`` (Q likewise). The maths is fp32 (float64 for
        float64) with one rounding of y; CUDA inputs run an implicit-GEMM kernel with the bias and
        activation in its epilogue; NumPy and torch-CPU inputs run the references (the NumPy one in
        float64). torch tensors are differentiable in x, weight and bias (``torch.ops.cukit.conv2d``):
        the backward is a weight-gradient pass that also sums db and forms dy * act'(z), then a
        transposed convolution for dx; for gelu, gelu_tanh and silu the forward keeps z for it (as
        torch keeps the activation's input), relu reads its output.

    Raises:
        TypeError and ValueError naming ``cukit.conv2d`` and the argument.

    See also: ``torch.nn.functional.conv2d``, ``cukit.nn.Conv2d``, ``cukit.bias_act``.
    """
    try:
        return _conv2d_arrays(x, weight, bias, stride, padding, dilation, activation)
    except NotAnArrayError:
        x, weight, bias = _operands("cukit.conv2d", x, weight, bias)
    return _conv2d_arrays(x, weight, bias, stride, padding, dilation, activation)


def _operands(fn: str, x: Any, weight: Any, bias: Any) -> tuple[Any, Any, Any]:
    """(x, weight, bias) with array-likes converted like the first array among them (NumPy if none
    is); a scalar bias broadcasts to (out_channels,)."""
    like = next((t for t in (x, weight, bias) if t is not None and is_array(t)), None)
    if not is_array(x):
        x = as_array(x, fn, "x", like)
    if not is_array(weight):
        weight = as_array(weight, fn, "weight", like)
    if bias is not None and not is_array(bias):
        bias = as_bias(bias, x, fn, weight.shape[0] if weight.ndim == 4 else None)
    return x, weight, bias


def _conv2d_arrays(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                   activation: str | None) -> Any:
    """conv2d for arrays (NotAnArrayError for anything else, before any work)."""
    if is_array(x) and x.ndim == 3:  # one image: a batch of one
        y = _conv2d_arrays(x[None], weight, bias, stride, padding, dilation, activation)
        return y[0]
    kind, act = validate(x, weight, bias, activation)
    params = conv_params(stride, padding, dilation, weight.shape[2:])
    geometry(x.shape, weight.shape, params)
    if kind == "numpy":
        return reference_numpy(x, weight, bias, params, activation)
    if device_of(x) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return reference_torch(x, weight, bias, params, activation)[0]
    return forward_gpu(x, weight, bias, params, act, False)[0]


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------


def _tile_cols(n: int) -> int:
    """The column tile (BN) for a GEMM with n columns: the smallest of 16, 32, 64 that holds it."""
    return next((bn for bn in _TILE_COLS if n <= bn), _TILE_COLS[-1])


def _empty(shape: tuple[int, ...], like: Any, kind: str, dtype: str | None = None) -> Any:
    if kind == "torch":
        import torch

        return like.new_empty(shape, dtype=getattr(torch, dtype) if dtype else like.dtype)
    import cupy

    with like.device:  # on the input's GPU, not the current one
        return cupy.empty(shape, dtype=dtype or like.dtype)


def _ptr(a: Any) -> int:
    if a is None:
        return 0
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def _sig(t: Any) -> tuple:
    """What a plan depends on for one array: type, shape, strides, dtype, device (None: absent).
    No pointer alignment: the kernels read inputs element by element."""
    if t is None:
        return ()
    if hasattr(t, "data_ptr"):
        return (t.shape, t.stride(), t.dtype, t.get_device())
    if type(t) is np.ndarray:
        raise TypeError("cukit.ops.conv2d: the GPU path needs CuPy arrays or torch CUDA tensors; got a numpy.ndarray")
    return (type(t), t.shape, t.strides, t.dtype, t.device.id)


class _FwdPlan:
    """A forward signature's launch: output shape, which inputs need a contiguous copy, the Launch."""

    __slots__ = ("copies", "run", "y_shape")

    def __init__(self, y_shape: tuple[int, ...], copies: tuple[bool, bool, bool], run: Any) -> None:
        self.y_shape, self.copies, self.run = y_shape, copies, run


_FWD_PLANS = PlanCache("conv2d_fwd", maxsize=1024)
_BWD_PLANS = PlanCache("conv2d_bwd", maxsize=1024)


def forward_gpu(x: Any, weight: Any, bias: Any, params: Params | Sequence[Sequence[int]], act: int,
                save_z: bool) -> tuple[Any, Any]:
    """``(y, z)`` with ``z = conv2d(x, weight) + bias``, ``y = act(z)`` for CuPy arrays or torch CUDA
    tensors: one launch. z is None unless save_z. ``params`` as :func:`conv_params` returns it
    (lists are fine). Arguments are validated on a signature's first call; later calls are a plan
    lookup, the output allocation(s) and a launch."""
    stride, padding, dilation = params
    key = ("fwd", act, save_z, *stride, *padding, *dilation, *_sig(x), *_sig(weight), *_sig(bias))
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _forward_first(x, weight, bias, params, act, save_z, key)
    torch_in = hasattr(x, "data_ptr")
    kind = "torch" if torch_in else "cupy"
    if plan.copies[0]:
        x = contiguous(x, kind)
    if plan.copies[1]:
        weight = contiguous(weight, kind)
    if plan.copies[2]:
        bias = contiguous(bias, kind)
    if torch_in:
        y = x.new_empty(plan.y_shape)
        z = x.new_empty(plan.y_shape) if save_z else None
        if plan.run is not None:
            plan.run((x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                      0 if z is None else z.data_ptr()), current_stream(x.get_device(), True))
        return y, z
    y = _empty(plan.y_shape, x, kind)
    z = _empty(plan.y_shape, x, kind) if save_z else None
    if plan.run is not None:
        plan.run((x.data.ptr, weight.data.ptr, _ptr(bias), y.data.ptr, _ptr(z)), current_stream(x.device.id, False))
    return y, z


def _forward_first(x: Any, weight: Any, bias: Any, params: Any, act: int, save_z: bool, key: tuple) -> tuple[Any, Any]:
    kind, _ = validate(x, weight, bias, None if act < 0 else _ACT_NAMES[act])
    device = device_of(x)
    if device is None:
        raise ValueError("cukit.ops.conv2d.forward_gpu: x, weight and bias must be CUDA arrays; got arrays on the CPU")
    params = _as_params(params)
    geo = geometry(x.shape, weight.shape, params)
    N, _, _, _, K, P, Q = geo[:7]
    copies = (not is_contiguous(x, kind), not is_contiguous(weight, kind),
              bias is not None and not is_contiguous(bias, kind))
    x, weight = contiguous(x, kind), contiguous(weight, kind)
    bias = None if bias is None else contiguous(bias, kind)
    y_shape = (N, K, P, Q)
    y = _empty(y_shape, x, kind)
    z = _empty(y_shape, x, kind) if save_z else None
    M = N * P * Q
    run = None
    if M:
        dt = DTYPES[dtype_name(x, kind)]
        bn = _tile_cols(K)
        grid = (-(-M // _BM), _grid_y(K, bn))
        run = KERNELS.prepare(f"conv2d_fprop<{dt.ctype}, {bn}, {act}>", grid, (_THREADS,), (*geo, int(P * Q % 4 == 0)),
                              device=device)
        run((_ptr(x), _ptr(weight), _ptr(bias), _ptr(y), _ptr(z)), current_stream(device, kind == "torch"))
    _FWD_PLANS.put(key, _FwdPlan(y_shape, copies, run))
    return y, z


def _as_params(params: Any) -> Params:
    (sh, sw), pad, (dh, dw) = params
    pt, pl, pb, pr = pad
    return (int(sh), int(sw)), (int(pt), int(pl), int(pb), int(pr)), (int(dh), int(dw))


def _grid_y(cols: int, bn: int) -> int:
    g = -(-cols // bn)
    if g > _GRID_Y_MAX:
        raise ValueError(f"cukit.conv2d: at most {_GRID_Y_MAX * bn} channels per GEMM column tile; got {cols}")
    return g


class _BwdPlan:
    """A backward signature's launches and the sizes of what they write."""

    __slots__ = ("acc", "copies", "dgrad", "dx_shape", "reduce", "splits_k", "splits_kcrs", "wgrad", "y_shape")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


def backward_gpu(grad: Any, x: Any, weight: Any, saved: Any, params: Params | Sequence[Sequence[int]], act: int,
                 has_bias: bool, need_input: bool) -> tuple[Any, Any, Any]:
    """Gradients of ``y = act(conv2d(x, weight) + bias)``: ``(dx, dweight, dbias)`` for CuPy arrays
    or torch CUDA tensors; dx is None unless need_input, dbias None unless has_bias.

    grad: dy, y's shape. saved: z (the pre-activation, from ``forward_gpu(..., save_z=True)``) for
    gelu, gelu_tanh and silu, y for relu, None without an activation. Launches: the weight-gradient
    pass (partial sums of dweight and dbias per split of the N*P*Q pixels; it also stores
    ``g = dy * act'(z)`` when dx is wanted), the fixed-order reduction of the partials
    (deterministic), and the transposed convolution for dx. Validated on a signature's first call."""
    stride, padding, dilation = params
    if act < 0:
        saved = None  # nothing to differentiate through
    key = ("bwd", act, has_bias, need_input, *stride, *padding, *dilation, *_sig(grad), *_sig(x), *_sig(weight),
           *_sig(saved))
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _backward_first(grad, x, weight, saved, params, act, has_bias, need_input, key)
    return _backward_run(plan, grad, x, weight, saved, has_bias, need_input)


def _backward_run(plan: _BwdPlan, grad: Any, x: Any, weight: Any, saved: Any, has_bias: bool,
                  need_input: bool) -> tuple[Any, Any, Any]:
    torch_in = hasattr(x, "data_ptr")
    kind = "torch" if torch_in else "cupy"
    if plan.copies[0]:
        grad = contiguous(grad, kind)
    if plan.copies[1]:
        x = contiguous(x, kind)
    if plan.copies[2]:
        weight = contiguous(weight, kind)
    if plan.copies[3]:
        saved = contiguous(saved, kind)
    K = weight.shape[0]
    dw = _empty(tuple(weight.shape), weight, kind)
    db = _empty((K,), weight, kind) if has_bias else None
    ws = _empty((plan.splits_kcrs + plan.splits_k,), x, kind, plan.acc) if plan.splits_kcrs + plan.splits_k else None
    need_g = need_input and plan.dgrad is not None and saved is not None
    g = _empty(plan.y_shape, x, kind) if need_g else None
    dx = _empty(plan.dx_shape, x, kind) if need_input else None
    stream = current_stream(x.get_device() if torch_in else x.device.id, torch_in)
    part = _ptr(ws)
    dbp = part + plan.splits_kcrs * (8 if plan.acc == "float64" else 4) if has_bias and part else 0
    if plan.wgrad is not None:
        plan.wgrad((_ptr(x), _ptr(grad), _ptr(saved), _ptr(g), part, dbp), stream)
    plan.reduce((part, dbp, _ptr(dw), _ptr(db)), stream)
    if need_input and plan.dgrad is not None:
        plan.dgrad((_ptr(g if need_g else grad), _ptr(weight), _ptr(dx)), stream)
    return dx, dw, db


def _backward_first(grad: Any, x: Any, weight: Any, saved: Any, params: Any, act: int, has_bias: bool,
                    need_input: bool, key: tuple) -> tuple[Any, Any, Any]:
    fn = "cukit.conv2d (backward)"
    kind, _ = validate(x, weight, None, None if act < 0 else _ACT_NAMES[act], fn)
    device = device_of(x)
    if device is None:
        raise ValueError("cukit.ops.conv2d.backward_gpu: grad, x and weight must be CUDA arrays; got arrays on the CPU")
    params = _as_params(params)
    geo = geometry(x.shape, weight.shape, params, fn)
    N, C, H, W, K, P, Q, R, S = geo[:9]
    y_shape = (N, K, P, Q)
    for name, t, needed in (("grad", grad, True), ("saved", saved, act >= 0)):
        if t is None and not needed:
            continue
        if t is None or array_kind(t) != kind or tuple(t.shape) != y_shape or dtype_name(t, kind) != dtype_name(x, kind) \
                or device_of(t) != device:
            what = "the pre-activation z (gelu, gelu_tanh, silu) or the output y (relu)" if name == "saved" else "dy"
            got = "None" if t is None else f"{type_name(t)} of shape {tuple(t.shape)}, dtype {dtype_name(t, array_kind(t))}"
            raise ValueError(f"{fn}: {name} must be {what}: {array_class(kind)} of shape {y_shape}, x's dtype and "
                             f"device; got {got}")
    if act < 0:
        saved = None
    copies = tuple(t is not None and not is_contiguous(t, kind) for t in (grad, x, weight, saved))
    dt = DTYPES[dtype_name(x, kind)]
    acc = "float64" if dt.name == "float64" else "float32"
    crs = C * R * S
    npq = N * P * Q
    bn_w = _tile_cols(K)
    tiles = max(1, -(-crs // _BM)) * _grid_y(K, bn_w)
    splits, per_split = _splits(npq, tiles, sm_count(device))
    wgrad = None
    if splits:
        wgrad = KERNELS.prepare(f"conv2d_wgrad<{dt.ctype}, {bn_w}, {act}>", (max(1, -(-crs // _BM)), _grid_y(K, bn_w), splits),
                                (_THREADS,), (*geo, per_split), device=device)
    total = K * crs + (K if has_bias else 0)
    reduce = KERNELS.prepare(
        f"conv2d_wgrad_reduce<{dt.ctype}>", (max(1, min(-(-total // _REDUCE_BLOCK), 8 * sm_count(device))),),
        (_REDUCE_BLOCK,), (splits, K * crs, K), device=device,
    )
    dgrad = None
    if N * H * W and C:
        bn_d = _tile_cols(C)
        dgrad = KERNELS.prepare(f"conv2d_dgrad<{dt.ctype}, {bn_d}>", (-(-(N * H * W) // _BM), _grid_y(C, bn_d)),
                                (_THREADS,), (*geo, int(H * W % 4 == 0)), device=device)
    plan = _BwdPlan(acc=acc, copies=copies, dgrad=dgrad, dx_shape=(N, C, H, W), reduce=reduce,
                    splits_kcrs=splits * K * crs, splits_k=splits * K if has_bias else 0, wgrad=wgrad, y_shape=y_shape)
    _BWD_PLANS.put(key, plan)
    return _backward_run(plan, grad, x, weight, saved, has_bias, need_input)


def _splits(npq: int, tiles: int, sms: int) -> tuple[int, int]:
    """(splits, pixels per split) of wgrad's reduction over the npq pixels: about
    _WGRAD_BLOCKS_PER_SM blocks per SM over `tiles` output tiles, each split at least
    _WGRAD_MIN_STAGES stages long, a whole number of stages, none empty. (0, 0) for no pixels."""
    if npq == 0:
        return 0, 0
    want = -(-_WGRAD_BLOCKS_PER_SM * sms // tiles)
    splits = max(1, min(want, -(-npq // (_BK * _WGRAD_MIN_STAGES)), _GRID_Y_MAX))
    per = -(-npq // splits)
    per = -(-per // _BK) * _BK
    return -(-npq // per), per


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------


def reference_numpy(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, params: Params,
                    activation: str | None) -> np.ndarray:
    """NumPy conv2d: ``act(conv2d(x, weight) + bias)`` computed in float64 (one product per kernel
    tap, summed over the taps) and rounded once to x's dtype."""
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = params
    N, _, _, _, K, P, Q, R, S = geometry(x.shape, weight.shape, params)[:9]
    with np.errstate(over="ignore", invalid="ignore"):
        xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
        wd = np.asarray(weight, np.float64)
        z = np.zeros((N, K, P, Q))
        for r in range(R):
            for s in range(S):
                tap = xp[:, :, r * dh: r * dh + sh * (P - 1) + 1: sh, s * dw: s * dw + sw * (Q - 1) + 1: sw]
                z += np.einsum("ncpq,kc->nkpq", tap, wd[:, :, r, s], optimize=True)
        if bias is not None:
            z += np.asarray(bias, np.float64)[None, :, None, None]
        y = z if activation is None else _np_act(z, activation)
        return np.ascontiguousarray(y.astype(x.dtype))


def _acc_dtype(t: Any) -> Any:
    import torch

    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _symmetric(padding: Sequence[int]) -> tuple[int, int] | None:
    pt, pl, pb, pr = padding
    return (pt, pl) if (pt, pl) == (pb, pr) else None


def torch_conv(x: Any, weight: Any, bias: Any, params: Params | Sequence[Sequence[int]]) -> Any:
    """``conv2d(x, weight) + bias`` by torch's own convolution (asymmetric padding by an explicit
    zero pad), in the tensors' dtype; differentiable."""
    import torch.nn.functional as F

    stride, padding, dilation = params
    if x.shape[1] == 0:  # no input channels: z = bias (torch's conv2d would return no output channels)
        N, _, H, W = x.shape
        K, _, R, S = weight.shape
        P, Q = output_hw(H, W, R, S, params)
        z = x.new_zeros((N, K, P, Q))
        return z if bias is None else z + bias.reshape(1, K, 1, 1)
    sym = _symmetric(padding)
    if sym is None:
        x = F.pad(x, (padding[1], padding[3], padding[0], padding[2]))
        sym = (0, 0)
    return F.conv2d(x, weight, bias, tuple(stride), sym, tuple(dilation))


def torch_conv_input_grad(g: Any, weight: Any, x_shape: Sequence[int], params: Params | Sequence[Sequence[int]]) -> Any:
    """The transposed convolution: ``d conv2d(x, weight) / dx`` applied to g (y's shape), by torch's
    ``convolution_backward``; differentiable."""
    import torch

    stride, padding, dilation = params
    N, C, H, W = x_shape
    if N == 0 or C == 0:
        return g.new_zeros(tuple(x_shape))
    sym = _symmetric(padding)
    pad = (0, 0) if sym is None else sym
    shape = (N, C, H + padding[0] + padding[2], W + padding[1] + padding[3]) if sym is None else tuple(x_shape)
    x0 = g.new_empty(()).expand(shape)  # only its shape is read
    dx = torch.ops.aten.convolution_backward(g, x0, weight, None, list(stride), list(pad), list(dilation), False,
                                             [0, 0], 1, [True, False, False])[0]
    if sym is None:
        dx = dx[:, :, padding[0]: padding[0] + H, padding[1]: padding[1] + W]
    return dx


def torch_conv_weight_grad(x: Any, g: Any, w_shape: Sequence[int], params: Params | Sequence[Sequence[int]]) -> Any:
    """``d conv2d(x, weight) / dweight`` applied to g, by torch's ``convolution_backward``;
    differentiable."""
    import torch
    import torch.nn.functional as F

    stride, padding, dilation = params
    if x.shape[1] == 0 or x.shape[0] == 0:
        return g.new_zeros(tuple(w_shape))
    sym = _symmetric(padding)
    if sym is None:
        x = F.pad(x, (padding[1], padding[3], padding[0], padding[2]))
        sym = (0, 0)
    w0 = g.new_empty(()).expand(tuple(w_shape))
    return torch.ops.aten.convolution_backward(g, x, w0, None, list(stride), list(sym), list(dilation), False,
                                               [0, 0], 1, [False, True, False])[1]


def reference_torch(x: Any, weight: Any, bias: Any, params: Params | Sequence[Sequence[int]], activation: str | None,
                    *, return_z: bool = False) -> tuple[Any, Any]:
    """torch conv2d with the kernels' maths (fp32 for the 16-bit types, one rounding): ``(y, z)``,
    z (x's dtype) only when return_z, else None. The torch-CPU fallback."""
    acc = _acc_dtype(x)
    z = torch_conv(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc), params)
    y = (z if activation is None else _torch_act(z, activation)).to(x.dtype).contiguous()
    if not return_z:
        return y, None
    z = z.to(x.dtype).contiguous()
    return y, (z.clone() if z is y else z)  # two outputs, never one tensor twice


def act_derivative_torch(saved: Any, activation: str | None) -> Any:
    """act'(z) from what the forward saved (z; y for relu) in torch ops, differentiable; None for
    no activation."""
    from cukit.ops.bias_act import _torch_act_grad

    if activation is None:
        return None
    if activation == "relu":
        return (saved > 0).to(saved.dtype)
    return _torch_act_grad(saved, activation)


def reference_backward_torch(grad: Any, x: Any, weight: Any, saved: Any, params: Params | Sequence[Sequence[int]],
                             activation: str | None, has_bias: bool, need_input: bool) -> tuple[Any, Any, Any]:
    """conv2d's gradients with the kernels' maths (fp32 for the 16-bit types): ``(dx, dweight,
    dbias)``, dx None unless need_input, dbias None unless has_bias. saved as for
    :func:`backward_gpu`."""
    import torch

    acc = _acc_dtype(x)
    g = grad.to(acc)
    if activation == "relu":
        g = torch.where(saved <= 0, torch.zeros((), dtype=acc, device=g.device), g)  # torch's threshold_backward
    elif activation is not None:
        g = g * act_derivative_torch(saved.to(acc), activation)
    xa, wa = x.to(acc), weight.to(acc)
    dx = torch_conv_input_grad(g, wa, tuple(x.shape), params).to(x.dtype).contiguous() if need_input else None
    dw = torch_conv_weight_grad(xa, g, tuple(weight.shape), params).to(weight.dtype).contiguous()
    db = g.sum((0, 2, 3)).to(weight.dtype) if has_bias else None
    return dx, dw, db

