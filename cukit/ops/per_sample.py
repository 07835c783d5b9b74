"""Per-sample gradients and ghost norms: the array-level pieces of ``cukit.per_sample_grads``,
``cukit.per_sample_grad_norms`` and ``cukit.dp``.

Rows (dimension 0) are samples. Every function takes torch tensors: CUDA tensors run the kernels of
``raw_kernels/per_sample.cu`` and cukit's matmul (the GEMMs), CPU tensors run the torch references
beside them (``reference_*``: float64-capable, the test oracles and the CPU path). Per-sample
gradients are a torch feature (they need a model), so there is no NumPy/CuPy face.

The maths, per sample i, for a Linear layer ``y = x W^T + b`` with activations A_i (T, d_in) and
output grads G_i (T, d_out) (T = 1 for 2-D inputs; per-sample grad = sum over T):

- per-sample grads:  dW_i = G_i^T A_i,  db_i = sum_t G_i[t]
- ghost norms:       ||dW_i||_F^2 = <A_i A_i^T, G_i G_i^T>_F (Gram route, T^2 per sample) or
                     ||a_i||^2 ||g_i||^2 when T = 1; ||db_i||^2 = ||sum_t G_i[t]||^2
- clipped sum:       sum_i f_i dW_i = (f ⊙ G)^T A: one GEMM after scaling G's rows (Book-Keeping)

A Conv layer is the same Linear over patches: A_i = the (L, C/G kh kw) patches of sample i per group
(L = output pixels), G_i its (L, K/G) output grads. ``conv_grads`` / ``conv_sq_norms`` /
``conv_clipped`` take x and G as they are (NCHW) and pick a route per layer shape
(:func:`conv_route`): an implicit GEMM that gathers the patches on the fly (``conv_per_sample`` in
per_sample.cu), torch's convolution weight gradient with the batch folded into the groups, or the
unfolded patches with the Gram identity.

torch registration: none (these ops are called from ``cukit/per_sample.py`` inside an autograd
backward pass; nothing differentiates through them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cukit._device import sm_count
from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import DTYPES, current_stream

__all__ = [
    "CONV_ROUTES",
    "FLOAT_DTYPES",
    "KERNELS",
    "ConvShape",
    "clip_factors",
    "conv_clipped",
    "conv_grads",
    "conv_route",
    "conv_sq_norms",
    "dense_sq_norms",
    "embedding_grads",
    "embedding_sq_norms",
    "linear_grads",
    "linear_sq_norms",
    "reference_clip_factors",
    "reference_conv_grads",
    "reference_conv_sq_norms",
    "reference_dense_sq_norms",
    "reference_embedding_grads",
    "reference_embedding_sq_norms",
    "reference_linear_grads",
    "reference_linear_sq_norms",
    "reference_row_sq_norms",
    "reference_sum_over_t",
    "reference_weighted_sum",
    "row_sq_norms",
    "scale_rows",
    "sum_over_t",
    "use_gram",
    "weighted_sum",
]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_CONV_MODES = {"grads": 0, "norms": 1, "clipped": 2}  # conv_per_sample's MODE
_CONV_BN = (16, 32, 64)  # its column tiles (output channels per block), instantiated
CLIP_EPS = 1e-6  # clip factor min(1, C / (norm + CLIP_EPS)), as Opacus and Abadi et al.


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        dt = DTYPES[name]
        t = dt.ctype
        a = "double" if name == "float64" else "float"
        outs = [t] if t == a else [t, a]
        exprs: list[str] = []
        for v in sorted({16 // dt.itemsize, 1}, reverse=True):  # the 16-byte vector path and the scalar path
            exprs += [f"row_sumsq_partial<{t}, {two}, {v}>" for two in ("false", "true")]
            exprs += [f"sum_t<{t}, {o}, {prod}, {v}>" for o in outs for prod in ("false", "true")]
            exprs.append(f"scale_rows<{t}, {v}>")
            exprs.append(f"dense_ghost_norms<{t}, {v}>")
            exprs.append(f"outer_rows<{t}, {v}>")
            exprs.append(f"weighted_sum_partial<{t}, {v}>")
        exprs += [f"weighted_sum_reduce<{a}, {o}>" for o in outs if o != a]
        groups[name] = exprs
        # per-sample conv: one group per (dtype, mode), so a model compiles only what it calls
        for mode, m in _CONV_MODES.items():
            groups[f"conv_{mode}_{name}"] = [f"conv_per_sample<{t}, {bn}, {m}>" for bn in _CONV_BN]
        groups[f"conv_norms_{name}"].append(f"conv_norms_reduce<{a}>")
    # the accumulation types' kernels, used by every dtype: a shared group (compiled with the file)
    groups["reduce"] = [f"{k}<{a}>" for a in ("float", "double") for k in ("row_sum_reduce", "clip_factors")]
    groups["reduce"] += [f"weighted_sum_reduce<{a}, {a}>" for a in ("float", "double")]
    return groups


KERNELS = KernelModule(
    "per_sample.cu",
    instantiations=_instantiations(),
    signatures={
        "row_sumsq_partial": "ptr ptr ptr i64 i64 i64 i64",
        "row_sum_reduce": "ptr ptr i64 i64",
        "sum_t": "ptr ptr ptr i64 i64 i64",
        "clip_factors": "ptr ptr ptr f64 i64",
        "outer_rows": "ptr ptr ptr i64 i64 i64",
        "dense_ghost_norms": "ptr" + " ptr ptr" * 4 + " i64" + " i64 i64" * 4 + " i32 i32 i32 i32 f64",
        "scale_rows": "ptr ptr ptr i64 i64",
        "weighted_sum_partial": "ptr ptr ptr i64 i64 i64",
        "weighted_sum_reduce": "ptr ptr i32 i64 i64",
        "conv_per_sample": "ptr ptr ptr ptr ptr ptr ptr" + " i32" * 18,
        "conv_norms_reduce": "ptr ptr ptr i64 i64 i64",
    },
)

_BLOCK = 256
_ROW_UNROLL = 4  # vectors per thread per trip in row_sumsq_partial (U in per_sample.cu)
_BLOCKS_PER_SM = 8
_GRID_Y_MAX = 65535


# ---------------------------------------------------------------------------------------------
# Validation (first call of a signature only)
# ---------------------------------------------------------------------------------------------


def _check(fn: str, name: str, x: Any, *, min_ndim: int = 1, ndim: int | None = None) -> str:
    """x must be a floating torch tensor of a kernel dtype; returns its dtype name."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"cukit.ops.per_sample.{fn}: {name} must be a torch.Tensor; got {type(x).__qualname__}")
    dname = str(x.dtype).removeprefix("torch.")
    if dname not in FLOAT_DTYPES:
        raise TypeError(
            f"cukit.ops.per_sample.{fn}: {name} must have dtype float16, bfloat16, float32 or float64; got {dname}"
        )
    if (ndim is not None and x.ndim != ndim) or x.ndim < min_ndim:
        want = f"{ndim}-D" if ndim is not None else f"at least {min_ndim}-D"
        raise ValueError(f"cukit.ops.per_sample.{fn}: {name} must be {want}; got shape {tuple(x.shape)}")
    return dname


def _check_like(fn: str, name: str, y: Any, x: Any, *, shape: bool = True) -> None:
    _check(fn, name, y)
    if y.dtype != x.dtype:
        raise TypeError(f"cukit.ops.per_sample.{fn}: {name} must have dtype {x.dtype}; got {y.dtype}")
    if shape and y.shape != x.shape:
        raise ValueError(f"cukit.ops.per_sample.{fn}: {name} must have shape {tuple(x.shape)}; got {tuple(y.shape)}")
    if y.device != x.device:
        raise ValueError(f"cukit.ops.per_sample.{fn}: {name} must be on {x.device}; got {y.device}")


def _acc(t: Any) -> Any:
    import torch

    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _vec(itemsize: int, n: int, *tensors: Any) -> int:
    v = 16 // itemsize
    if n % v == 0 and all(t is None or t.data_ptr() % 16 == 0 for t in tensors):
        return v
    return 1


def _key(tag: str, *tensors: Any, extra: Any = None) -> tuple:
    """A call's signature: shape, dtype, device and 16-byte alignment of each tensor (None kept)."""
    return (tag, extra, *((None if t is None else (t.shape, t.dtype, t.device, t.data_ptr() & 15)) for t in tensors))


def _ctype(t: Any) -> str:
    return DTYPES[str(t.dtype).removeprefix("torch.")].ctype


def _acc_ctype(t: Any) -> str:
    import torch

    return "double" if t.dtype == torch.float64 else "float"


# ---------------------------------------------------------------------------------------------
# row_sq_norms: s[i] = sum_j x[i, j]^2 (or x[i, j] y[i, j])
# ---------------------------------------------------------------------------------------------

_ROW_PLANS = PlanCache("per_sample_rows", maxsize=1024)


class _RowPlan:
    __slots__ = ("main", "reduce", "splits")

    def __init__(self, main: Any, reduce: Any, splits: int) -> None:
        self.main, self.reduce, self.splits = main, reduce, splits


def row_sq_norms(x: Any, y: Any = None) -> Any:
    """Per-row sums of squares ``s[i] = sum_j x[i, j]^2`` over every dimension but the first, or
    per-row dot products ``sum_j x[i, j] y[i, j]`` when y is given (Gram-route ghost norms).

    x, y: torch tensors of one shape (B, ...) and dtype (float16, bfloat16, float32, float64), any
    strides (made contiguous). Returns (B,) in float32 (float64 for float64 x). On CUDA: one launch
    (two when a row is split over blocks; fixed-order two-pass sum, bitwise reproducible), no sync.

    See also: ``x.flatten(1).square().sum(1)``, ``torch.linalg.vector_norm(x.flatten(1), dim=1) ** 2``.
    """
    if not x.is_cuda:
        _check("row_sq_norms", "x", x)
        if y is not None:
            _check_like("row_sq_norms", "y", y, x)
        return reference_row_sq_norms(x, y)
    x = x.contiguous()
    y = None if y is None else y.contiguous()
    key = _key("rows", x, y)
    plan = _ROW_PLANS.get(key)
    if plan is None:
        return _row_first(x, y, key)
    B = x.shape[0]
    out = x.new_empty((B,), dtype=_acc(x))
    if plan.main is None:
        return out.zero_()
    stream = current_stream(x.get_device(), True)
    py = 0 if y is None else y.data_ptr()
    if plan.reduce is None:
        plan.main((x.data_ptr(), py, out.data_ptr()), stream)
        return out
    partial = x.new_empty((B, plan.splits), dtype=_acc(x))
    plan.main((x.data_ptr(), py, partial.data_ptr()), stream)
    plan.reduce((partial.data_ptr(), out.data_ptr()), stream)
    return out


def _row_first(x: Any, y: Any, key: tuple) -> Any:
    _check("row_sq_norms", "x", x)
    if y is not None:
        _check_like("row_sq_norms", "y", y, x)
    B = x.shape[0]
    n = math.prod(x.shape[1:])
    out = x.new_empty((B,), dtype=_acc(x))
    if B == 0 or n == 0:
        _ROW_PLANS.put(key, _RowPlan(None, None, 0))
        return out.zero_()
    device = x.get_device()
    vec = _vec(x.element_size(), n, x, y)
    per_block = _BLOCK * vec * _ROW_UNROLL
    splits = max(1, min(-(-sm_count(device) * _BLOCKS_PER_SM // B), -(-n // per_block)))
    per_split = -(-n // splits)
    chunk = -(-per_split // vec) * vec  # a whole number of vectors, so rows stay aligned
    splits = -(-n // chunk)
    two = "true" if y is not None else "false"
    main = KERNELS.prepare(
        f"row_sumsq_partial<{_ctype(x)}, {two}, {vec}>", (splits, min(B, _GRID_Y_MAX)), (_BLOCK,),
        (B, n, chunk, splits), device=device,
    )
    reduce = None
    if splits > 1:
        reduce = KERNELS.prepare(
            f"row_sum_reduce<{_acc_ctype(x)}>", (-(-B // _BLOCK),), (_BLOCK,), (B, splits), device=device
        )
    plan = _ROW_PLANS.put(key, _RowPlan(main, reduce, splits))
    stream = current_stream(device, True)
    py = 0 if y is None else y.data_ptr()
    if reduce is None:
        main((x.data_ptr(), py, out.data_ptr()), stream)
        return out
    partial = x.new_empty((B, plan.splits), dtype=_acc(x))
    main((x.data_ptr(), py, partial.data_ptr()), stream)
    reduce((partial.data_ptr(), out.data_ptr()), stream)
    return out


def reference_row_sq_norms(x: Any, y: Any = None) -> Any:
    """torch row_sq_norms in the accumulation type (float32; float64 for float64)."""
    acc = _acc(x)
    rows = (x.shape[0], math.prod(x.shape[1:]))  # not -1: B may be 0
    xf = x.reshape(rows).to(acc)
    if y is None:
        return (xf * xf).sum(1)
    return (xf * y.reshape(rows).to(acc)).sum(1)


# ---------------------------------------------------------------------------------------------
# sum_over_t: out[i, c] = sum_t g[i, t, c] (* x[i, t, c])
# ---------------------------------------------------------------------------------------------

_SUM_PLANS = PlanCache("per_sample_sum_t", maxsize=1024)


def sum_over_t(g: Any, x: Any = None, *, out_dtype: Any = None) -> Any:
    """Per-sample sums over the middle dimension: ``out[i, c] = sum_t g[i, t, c]``, or
    ``sum_t g[i, t, c] x[i, t, c]`` when x is given (per-sample bias grads; per-sample norm-weight
    grads with x the normalised input x̂).

    g, x: (B, T, d) torch tensors of one dtype (float16, bfloat16, float32, float64), any strides
    (made contiguous). out_dtype: g's dtype (default) or its accumulation type (float32; float64).
    Returns (B, d). On CUDA: one launch, t summed in a fixed order (bitwise reproducible), no sync.

    See also: ``g.sum(1)``, ``(g * x).sum(1)``.
    """
    if out_dtype is None:
        out_dtype = g.dtype
    if not g.is_cuda:
        _check("sum_over_t", "g", g, ndim=3)
        if x is not None:
            _check_like("sum_over_t", "x", x, g)
        return reference_sum_over_t(g, x, out_dtype=out_dtype)
    g = g.contiguous()
    x = None if x is None else x.contiguous()
    key = _key("sum_t", g, x, extra=out_dtype)
    plan = _SUM_PLANS.get(key)
    if plan is None:
        return _sum_first(g, x, out_dtype, key)
    out = g.new_empty((g.shape[0], g.shape[2]), dtype=out_dtype)
    if plan is _EMPTY:
        return out.zero_()
    plan((g.data_ptr(), 0 if x is None else x.data_ptr(), out.data_ptr()), current_stream(g.get_device(), True))
    return out


_EMPTY: Any = object()  # the plan of a call with nothing to launch (a zero fill)


def _sum_first(g: Any, x: Any, out_dtype: Any, key: tuple) -> Any:
    _check("sum_over_t", "g", g, ndim=3)
    if x is not None:
        _check_like("sum_over_t", "x", x, g)
    if out_dtype not in (g.dtype, _acc(g)):
        raise TypeError(f"cukit.ops.per_sample.sum_over_t: out_dtype must be {g.dtype} or {_acc(g)}; got {out_dtype}")
    B, T, d = (int(s) for s in g.shape)
    out = g.new_empty((B, d), dtype=out_dtype)
    if B == 0 or d == 0 or T == 0:
        _SUM_PLANS.put(key, _EMPTY)
        return out.zero_()
    device = g.get_device()
    vec = _vec(g.element_size(), d, g, x)
    cv = d // vec
    bx = min(32, 1 << (cv - 1).bit_length())
    by = min(_BLOCK // bx, 1 << (T - 1).bit_length())  # no idle rows of threads for short T
    o = _ctype(g) if out_dtype == g.dtype else _acc_ctype(g)
    acc_size = 8 if _acc_ctype(g) == "double" else 4
    run = KERNELS.prepare(
        f"sum_t<{_ctype(g)}, {o}, {'true' if x is not None else 'false'}, {vec}>",
        (-(-cv // bx), min(B, _GRID_Y_MAX)), (bx, by), (B, T, d), device=device, shared_mem=bx * by * vec * acc_size,
    )
    _SUM_PLANS.put(key, run)
    run((g.data_ptr(), 0 if x is None else x.data_ptr(), out.data_ptr()), current_stream(device, True))
    return out


def reference_sum_over_t(g: Any, x: Any = None, *, out_dtype: Any = None) -> Any:
    """torch sum_over_t, accumulated in float32 (float64 for float64) and cast once."""
    acc = _acc(g)
    s = g.to(acc) if x is None else g.to(acc) * x.to(acc)
    return s.sum(1).to(g.dtype if out_dtype is None else out_dtype)


# ---------------------------------------------------------------------------------------------
# clip_factors, scale_rows, weighted_sum: the clipping arithmetic
# ---------------------------------------------------------------------------------------------

_SMALL_PLANS = PlanCache("per_sample_small", maxsize=1024)


def clip_factors(sq_norms: Any, max_norm: float) -> tuple[Any, Any]:
    """``norms = sqrt(sq_norms)``, ``factors = min(1, max_norm / (norms + 1e-6))``.

    sq_norms: (B,) float32 or float64 torch tensor (from :func:`row_sq_norms`). max_norm: a
    positive Python number (the clipping bound C). Returns (norms, factors) of sq_norms' dtype.
    On CUDA one launch, no sync; a NaN norm gives a NaN factor (never a silent drop).

    See also: Opacus' ``torch.clamp(max_norm / (norms + 1e-6), max=1.0)``.
    """
    if not sq_norms.is_cuda:
        return reference_clip_factors(sq_norms, max_norm)
    key = ("clip", sq_norms.shape, sq_norms.dtype, sq_norms.device)
    run = _SMALL_PLANS.get(key)
    if run is None:
        run = _clip_first(sq_norms, key)
    norms = sq_norms.new_empty(sq_norms.shape)
    factors = sq_norms.new_empty(sq_norms.shape)
    if run is not _EMPTY:
        run((sq_norms.data_ptr(), norms.data_ptr(), factors.data_ptr(), np.float64(max_norm)),
            current_stream(sq_norms.get_device(), True))
    return norms, factors


def _clip_first(sq: Any, key: tuple) -> Any:
    import torch

    if sq.dtype not in (torch.float32, torch.float64) or sq.ndim != 1 or not sq.is_contiguous():
        raise TypeError(
            "cukit.ops.per_sample.clip_factors: sq_norms must be a contiguous 1-D float32 or float64 tensor; got "
            f"{sq.dtype} of shape {tuple(sq.shape)}"
        )
    B = sq.shape[0]
    run = _EMPTY
    if B:
        ct = "double" if sq.dtype == torch.float64 else "float"
        run = KERNELS.prepare(f"clip_factors<{ct}>", (-(-B // _BLOCK),), (_BLOCK,), (B,), device=sq.get_device(),
                              n_head=4)
    return _SMALL_PLANS.put(key, run)


def reference_clip_factors(sq_norms: Any, max_norm: float) -> tuple[Any, Any]:
    """torch clip_factors: (sqrt(sq), min(1, C / (sqrt(sq) + 1e-6))), NaN kept."""
    import torch

    norms = sq_norms.clamp_min(0).sqrt()
    f = max_norm / (norms + CLIP_EPS)
    return norms, torch.where(torch.isnan(f), f, f.clamp(max=1.0))


def scale_rows(x: Any, factors: Any) -> Any:
    """``y[i, ...] = x[i, ...] * factors[i]`` in x's dtype (the factor applied in float32).

    x: (B, ...) torch tensor (float16, bfloat16, float32, float64), made contiguous; factors: (B,)
    in x's accumulation type. One launch on CUDA. See also: ``x * factors.view(-1, 1, ...)``.
    """
    if not x.is_cuda:
        return (x.to(factors.dtype) * factors.view(-1, *([1] * (x.ndim - 1)))).to(x.dtype)
    x = x.contiguous()
    key = _key("scale", x, factors)
    run = _SMALL_PLANS.get(key)
    if run is None:
        run = _scale_first(x, factors, key)
    y = x.new_empty(x.shape)
    if run is not _EMPTY:
        run((x.data_ptr(), factors.data_ptr(), y.data_ptr()), current_stream(x.get_device(), True))
    return y


def _check_factors(fn: str, x: Any, factors: Any) -> None:
    """TypeError unless `factors` is a contiguous (x.shape[0],) tensor of x's accumulator dtype."""
    if factors.dtype != _acc(x) or tuple(factors.shape) != (x.shape[0],) or not factors.is_contiguous():
        raise TypeError(
            f"cukit.ops.per_sample.{fn}: factors must be a contiguous ({x.shape[0]},) tensor of dtype "
            f"{_acc(x)}; got {factors.dtype} of shape {tuple(factors.shape)}"
        )


def _scale_first(x: Any, factors: Any, key: tuple) -> Any:
    _check("scale_rows", "x", x)
    _check_factors("scale_rows", x, factors)
    B = x.shape[0]
    n = math.prod(x.shape[1:])
    if B == 0 or n == 0:
        return _SMALL_PLANS.put(key, _EMPTY)
    device = x.get_device()
    vec = _vec(x.element_size(), n, x)
    col_blocks = max(1, min(-(-n // (_BLOCK * vec)), 64))
    row_blocks = max(1, min(B, -(-sm_count(device) * _BLOCKS_PER_SM // col_blocks), _GRID_Y_MAX))
    run = KERNELS.prepare(f"scale_rows<{_ctype(x)}, {vec}>", (col_blocks, row_blocks), (_BLOCK,), (B, n),
                          device=device)
    return _SMALL_PLANS.put(key, run)


def weighted_sum(ps: Any, factors: Any, out: Any = None) -> Any:
    """``out (+)= sum_i factors[i] ps[i]``: the clipped sum of materialised per-sample grads.

    ps: (B, *shape) torch tensor (float16, bfloat16, float32, float64), made contiguous; factors:
    (B,) in ps' accumulation type; out: None (a new (*shape) tensor of ps' dtype) or a contiguous
    tensor of that shape, of ps' dtype or its accumulation type, accumulated into (p.grad). On
    CUDA two launches (rows split over blocks into fp32/fp64 partial sums, then a fixed-order
    reduction into out: bitwise reproducible), no sync.

    See also: ``torch.einsum("i,i...->...", factors, ps)``.
    """
    if not ps.is_cuda:
        r = reference_weighted_sum(ps, factors)
        if out is None:
            return r.to(ps.dtype)
        return out.add_(r.to(out.dtype))
    ps = ps.contiguous()
    acc = out is not None
    if out is None:
        out = ps.new_empty(ps.shape[1:])
    key = _key("wsum", ps, factors, out)
    plan = _SMALL_PLANS.get(key)
    if plan is None:
        plan = _wsum_first(ps, factors, out, key)
    if plan is _EMPTY:
        return out if acc else out.zero_()
    main, reduce, splits = plan
    partial = ps.new_empty((splits, out.numel()), dtype=factors.dtype)
    stream = current_stream(ps.get_device(), True)
    main((ps.data_ptr(), factors.data_ptr(), partial.data_ptr()), stream)
    reduce((partial.data_ptr(), out.data_ptr(), np.int32(acc)), stream)
    return out


def _wsum_first(ps: Any, factors: Any, out: Any, key: tuple) -> Any:
    _check("weighted_sum", "ps", ps)
    _check_factors("weighted_sum", ps, factors)
    if out.shape != ps.shape[1:] or out.dtype not in (ps.dtype, _acc(ps)) or not out.is_contiguous():
        raise ValueError(
            f"cukit.ops.per_sample.weighted_sum: out must be a contiguous tensor of shape {tuple(ps.shape[1:])} and "
            f"dtype {ps.dtype} or {_acc(ps)}; got {out.dtype} of shape {tuple(out.shape)}"
        )
    B = ps.shape[0]
    n = math.prod(ps.shape[1:])
    if n == 0 or B == 0:
        return _SMALL_PLANS.put(key, _EMPTY)
    device = ps.get_device()
    vec = _vec(ps.element_size(), n, ps)
    cv = n // vec
    bx = min(32, 1 << (cv - 1).bit_length())
    by = _BLOCK // bx
    col_blocks = -(-cv // bx)
    target = sm_count(device) * (2048 // _BLOCK)  # a full wave of resident blocks
    splits = max(1, min(-(-target // col_blocks), -(-B // by), _GRID_Y_MAX))
    rows_per_split = -(-B // splits)
    splits = -(-B // rows_per_split)
    a = _acc_ctype(ps)
    o = _ctype(ps) if out.dtype == ps.dtype else a
    acc_size = 8 if a == "double" else 4
    main = KERNELS.prepare(f"weighted_sum_partial<{_ctype(ps)}, {vec}>", (col_blocks, splits), (bx, by),
                           (B, n, rows_per_split), device=device, shared_mem=bx * by * vec * acc_size)
    reduce = KERNELS.prepare(f"weighted_sum_reduce<{a}, {o}>", (max(1, min(-(-n // _BLOCK), target)),), (_BLOCK,),
                             (splits, n), device=device, n_head=3)
    return _SMALL_PLANS.put(key, (main, reduce, splits))


def reference_weighted_sum(ps: Any, factors: Any) -> Any:
    """torch weighted_sum in the accumulation type (rows in order)."""
    acc = factors.dtype
    return (ps.to(acc) * factors.view(-1, *([1] * (ps.ndim - 1)))).sum(0)


# ---------------------------------------------------------------------------------------------
# Linear: per-sample grads and ghost norms
# ---------------------------------------------------------------------------------------------


def _as_3d(t: Any) -> Any:
    """(B, d) -> (B, 1, d); (B, ..., d) -> (B, T, d) with the middle dimensions merged."""
    if t.ndim == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def use_gram(T: int, d_in: int, d_out: int) -> bool:
    """Whether ghost norms of a (B, T, d_in) -> (B, T, d_out) Linear take the Gram route
    (``<A A^T, G G^T>``, T^2 per sample) rather than materialising dW_i (d_in * d_out per sample):
    the one holding fewer numbers per sample, which is also the cheaper one in FLOPs."""
    return d_in * d_out > T * T


def linear_grads(a: Any, g: Any) -> Any:
    """Per-sample weight grads of ``y = x W^T``: ``dW[i] = sum_t g[i, t]^T a[i, t]`` -> (B, d_out, d_in).

    a: (B, d_in) or (B, ..., d_in) activations, g: matching (B, d_out) or (B, ..., d_out) output
    grads, one dtype. CUDA: cukit.batch_matmul (fp32 accumulation, g read transposed in place); for
    T = 1 (2-D inputs) the broadcast outer product ``g[:, :, None] * a[:, None, :]``.
    See also: ``torch.einsum("b...o,b...i->boi", g, a)``, Opacus' grad sampler for nn.Linear.
    """
    a3, g3 = _as_3d(a), _as_3d(g)
    if not a.is_cuda:
        return reference_linear_grads(a3, g3)
    if a3.shape[1] == 1:  # an outer product per sample: bound by its writes, a GEMM with K = 1 gains nothing
        return _outer_rows(g3[:, 0], a3[:, 0])
    from cukit.ops.matmul import batch_matmul

    return batch_matmul(g3.transpose(1, 2), a3, precision="ieee")


_OUTER_ROWS = 16  # kOuterRows in per_sample.cu


def _outer_rows(g: Any, a: Any) -> Any:
    """``out[b] = g[b]^T a[b]`` (B, m, n) from g (B, m) and a (B, n) of one dtype and device (CUDA):
    one launch bound by its writes (``outer_rows``); strided inputs are copied."""
    key = _key("outer", g, a, extra=(g.stride(), a.stride()))
    plan = _SMALL_PLANS.get(key)
    if plan is None:
        _check("linear_grads", "g", g, ndim=2)
        _check_like("linear_grads", "a", a, g, shape=False)
        if a.shape[0] != g.shape[0]:
            raise ValueError(f"cukit.ops.per_sample.linear_grads: a must have {g.shape[0]} rows (g's); got shape "
                             f"{tuple(a.shape)}")
        dense = Densify.needed((g, a), "torch")
        plan = _SMALL_PLANS.put(key, dense if dense is not None else _outer_plan(g, a))
    if plan.__class__ is Densify:
        return _outer_rows(*plan.apply((g, a)))
    B, m, n = g.shape[0], g.shape[1], a.shape[1]
    out = g.new_empty((B, m, n))
    if plan is not _EMPTY:
        plan((g.data_ptr(), a.data_ptr(), out.data_ptr()), current_stream(g.get_device(), True))
    return out


def _outer_plan(g: Any, a: Any) -> Any:
    B, m, n = (int(s) for s in (g.shape[0], g.shape[1], a.shape[1]))
    if B == 0 or m == 0 or n == 0:
        return _EMPTY
    device = g.get_device()
    vec = _vec(a.element_size(), n, a)
    nvec = -(-n // vec)
    threads = min(_BLOCK, -(-nvec // 32) * 32)
    col_blocks = -(-nvec // threads)
    work = B * -(-m // _OUTER_ROWS)
    row_blocks = max(1, min(work, -(-sm_count(device) * _BLOCKS_PER_SM * 4 // col_blocks), _GRID_Y_MAX))
    return KERNELS.prepare(f"outer_rows<{_ctype(g)}, {vec}>", (col_blocks, row_blocks), (threads,), (B, m, n),
                           device=device)


def reference_linear_grads(a: Any, g: Any) -> Any:
    """torch per-sample Linear weight grads, (B, d_out, d_in), in the accumulation type then cast."""
    a3, g3 = _as_3d(a), _as_3d(g)
    acc = _acc(a3)
    return (g3.to(acc).transpose(1, 2) @ a3.to(acc)).to(a.dtype)


def linear_sq_norms(a: Any, g: Any, *, gram: bool | None = None) -> Any:
    """Squared Frobenius norms of the per-sample weight grads of ``y = x W^T`` without forming
    them when possible: ``||a_i||^2 ||g_i||^2`` for 2-D inputs (T = 1), else the Gram route
    ``<A_i A_i^T, G_i G_i^T>_F`` (gram=None: :func:`use_gram` decides) or ``||G_i^T A_i||_F^2``.

    a: (B, d_in) or (B, ..., d_in); g: (B, d_out) or (B, ..., d_out); one dtype. Returns (B,) in
    float32 (float64 for float64). See also: Opacus' ghost clipping (``ghost_norm`` of Li et al.).
    """
    a3, g3 = _as_3d(a), _as_3d(g)
    _, T, d_in = a3.shape
    if T == 1:
        return row_sq_norms(a3) * row_sq_norms(g3)
    if gram is None:
        gram = use_gram(T, d_in, g3.shape[2])
    if not gram:
        return row_sq_norms(linear_grads(a3, g3))
    if not a.is_cuda:
        return reference_linear_sq_norms(a3, g3, gram=True)
    from cukit.ops.matmul import batch_matmul

    aa = batch_matmul(a3, a3.transpose(1, 2), precision="ieee")
    gg = batch_matmul(g3, g3.transpose(1, 2), precision="ieee")
    return row_sq_norms(aa, gg)


def reference_linear_sq_norms(a: Any, g: Any, *, gram: bool = True) -> Any:
    """torch linear_sq_norms in the accumulation type, by the chosen route."""
    a3, g3 = _as_3d(a), _as_3d(g)
    acc = _acc(a3)
    a3, g3 = a3.to(acc), g3.to(acc)
    if gram:
        return ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
    return (g3.transpose(1, 2) @ a3).square().sum((1, 2))


# ---------------------------------------------------------------------------------------------
# dense_sq_norms: the ghost norms of several Linear layers with 2-D inputs, summed, in one launch
# ---------------------------------------------------------------------------------------------

_DENSE_LAYERS = 4  # kDenseLayers in per_sample.cu: layers per launch
_DENSE_PLANS = PlanCache("per_sample_dense", maxsize=1024)


def dense_sq_norms(layers: Any, *, finish_scale: float | None = None, out: Any = None) -> Any:
    """``s[i] = sum_l ||g_l[i]||^2 (||a_l[i]||^2 + bias_l)``: the squared per-sample gradient
    norms of Linear layers ``y = a W^T (+ b)`` with 2-D inputs, weight and bias together, summed
    over the layers, without forming a per-sample gradient (``||dW_i||^2 = ||a_i||^2 ||g_i||^2``,
    ``||db_i||^2 = ||g_i||^2``).

    layers: a sequence of ``(a, g, bias)``: a (B, d_in) activations, g (B, d_out) output grads (the
    grads of the pre-activation), bias a bool (the layer's bias is counted); every tensor of one
    dtype (float16, bfloat16, float32, float64) and device, any strides (made contiguous).
    finish_scale: return ``sqrt(finish_scale^2 * s)``, the norms of a loss scaled by it, instead.
    out: a contiguous (B,) tensor of the result's dtype to add s into (``out += s``, returned; the
    finish then applies to the sum): layers that arrive one at a time share one accumulator.
    Returns (B,) in float32 (float64 for float64). On CUDA: one launch per four layers (fixed-order
    sums, bitwise reproducible), no sync.

    See also: ``sum(a.square().sum(1) * g.square().sum(1) ...)``, :func:`linear_sq_norms` (one
    layer, 3-D inputs too).
    """
    layers = tuple(layers)
    if not layers:
        raise ValueError("cukit.ops.per_sample.dense_sq_norms: layers must hold at least one (a, g, bias); got none")
    a0 = layers[0][0]
    if not a0.is_cuda:
        _dense_check(layers, out)
        s = reference_dense_sq_norms(layers)
        if out is not None:
            s = out.add_(s)
        return s if finish_scale is None else s.mul_(float(finish_scale) ** 2).sqrt_()
    acc = out is not None
    key = ("dense", finish_scale, acc, *((a.shape, a.stride(), g.shape, g.stride(), a.dtype, g.dtype, a.device,
                                          g.device, (a.data_ptr() | g.data_ptr()) & 15, bool(b)) for a, g, b in layers))
    plan = _DENSE_PLANS.get(key)
    if plan is None:
        _dense_check(layers, out)
        dense = Densify.needed([t for a, g, _ in layers for t in (a, g)], "torch")
        if dense is not None:  # later calls copy the strided arrays and take the copies' plan
            _DENSE_PLANS.put(key, dense)
            return dense_sq_norms(_densified(dense, layers), finish_scale=finish_scale, out=out)
        plan = _DENSE_PLANS.put(key, _dense_plan(layers, finish_scale, acc))
    elif plan.__class__ is Densify:
        return dense_sq_norms(_densified(plan, layers), finish_scale=finish_scale, out=out)
    if out is None:
        out = a0.new_empty((a0.shape[0],), dtype=_acc(a0))
        if not plan:
            return out.zero_()
    elif not plan:
        return out
    stream = current_stream(a0.get_device(), True)
    for run, first in plan:
        ptrs = [out.data_ptr()]
        for a, g, _ in layers[first:first + _DENSE_LAYERS]:
            ptrs += [a.data_ptr(), g.data_ptr()]
        ptrs += [0] * (1 + 2 * _DENSE_LAYERS - len(ptrs))
        run(tuple(ptrs), stream)
    return out


def _densified(dense: Densify, layers: tuple) -> tuple:
    flat = dense.apply([t for a, g, _ in layers for t in (a, g)])
    return tuple((flat[2 * i], flat[2 * i + 1], b) for i, (_, _, b) in enumerate(layers))


def _dense_check(layers: tuple, out: Any = None) -> None:
    fn = "dense_sq_norms"
    a0 = layers[0][0]
    if out is not None and not (
        isinstance(out, type(a0)) and out.shape == (a0.shape[0],) and out.dtype == _acc(a0)
        and out.device == a0.device and out.is_contiguous()
    ):
        raise ValueError(f"cukit.ops.per_sample.{fn}: out must be a contiguous ({a0.shape[0]},) tensor of dtype "
                         f"{_acc(a0)} on {a0.device}; got {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', '')} {getattr(out, 'device', '')}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, tuple) or len(layer) != 3:
            raise TypeError(f"cukit.ops.per_sample.{fn}: layers[{i}] must be a tuple (a, g, bias); got {layer!r}")
        a, g, b = layer
        _check(fn, f"layers[{i}][0] (a)", a, ndim=2)
        _check(fn, f"layers[{i}][1] (g)", g, ndim=2)
        if not isinstance(b, bool):
            raise TypeError(f"cukit.ops.per_sample.{fn}: layers[{i}][2] (bias) must be a bool; got {type(b).__name__}")
        for name, t in (("a", a), ("g", g)):
            if t.dtype != a0.dtype:
                raise TypeError(f"cukit.ops.per_sample.{fn}: layers[{i}] {name} must have dtype {a0.dtype} "
                                f"(layers[0]'s); got {t.dtype}")
            if t.device != a0.device:
                raise ValueError(f"cukit.ops.per_sample.{fn}: layers[{i}] {name} must be on {a0.device}; got {t.device}")
            if t.shape[0] != a0.shape[0]:
                raise ValueError(f"cukit.ops.per_sample.{fn}: layers[{i}] {name} must have {a0.shape[0]} rows "
                                 f"(samples, layers[0]'s); got shape {tuple(t.shape)}")


def _dense_plan(layers: tuple, finish_scale: float | None, accumulate: bool = False) -> list[tuple[Any, int]]:
    """[(launch, first layer)] per group of four layers; [] when there are no rows. accumulate: the
    first group adds into the output too (the later groups always do)."""
    a0 = layers[0][0]
    B = int(a0.shape[0])
    if B == 0:
        return []
    device = a0.get_device()
    v = 16 // a0.element_size()
    vec = v if all(a.shape[1] % v == 0 and g.shape[1] % v == 0 and a.data_ptr() % 16 == 0 and g.data_ptr() % 16 == 0
                   for a, g, _ in layers) else 1
    grid = (min(B, sm_count(device) * _BLOCKS_PER_SM),)
    plan = []
    for first in range(0, len(layers), _DENSE_LAYERS):
        group = layers[first:first + _DENSE_LAYERS]
        dims: list[int] = []
        for a, g, _ in group:
            dims += [int(a.shape[1]), int(g.shape[1])]
        dims += [0] * (2 * _DENSE_LAYERS - len(dims))
        mask = sum(1 << i for i, (_, _, b) in enumerate(group) if b)
        last = first + _DENSE_LAYERS >= len(layers)
        finish = last and finish_scale is not None
        tail = (B, *dims, len(group), mask, int(first > 0 or accumulate), int(finish), float(finish_scale or 1.0) ** 2)
        plan.append((KERNELS.prepare(f"dense_ghost_norms<{_ctype(a0)}, {vec}>", grid, (_BLOCK,), tail, device=device),
                     first))
    return plan


def reference_dense_sq_norms(layers: Any, *, finish_scale: float | None = None) -> Any:
    """torch dense_sq_norms in the accumulation type (float32; float64 for float64)."""
    s = None
    for a, g, b in layers:
        acc = _acc(a)
        term = g.to(acc).square().sum(1) * (a.to(acc).square().sum(1) + float(b))
        s = term if s is None else s + term
    return s if finish_scale is None else (s * float(finish_scale) ** 2).sqrt()


# ---------------------------------------------------------------------------------------------
# Embedding: per-sample grads (scatter) and ghost norms (index-equality masked Gram matrix)
# ---------------------------------------------------------------------------------------------


def embedding_grads(idx: Any, g: Any, num_embeddings: int, padding_idx: int | None = None) -> Any:
    """Per-sample grads of an embedding table: ``dE[i, v] = sum_{t: idx[i, t] = v} g[i, t]`` ->
    (B, V, d); rows of padding_idx stay zero (torch's rule). idx: (B, ...) integer indices, g:
    (B, ..., d). Dense: B * V * d numbers (prefer the norms or the clipped sum for large tables).
    Both paths are torch's index_put with accumulate (deterministic under
    ``torch.use_deterministic_algorithms``). See also: ``torch.func.vmap(torch.func.grad(...))``.
    """
    return reference_embedding_grads(idx, g, num_embeddings, padding_idx)


def reference_embedding_grads(idx: Any, g: Any, num_embeddings: int, padding_idx: int | None = None) -> Any:
    """torch per-sample embedding grads, (B, V, d)."""
    import torch

    B = idx.shape[0]
    d = g.shape[-1]
    idx2 = idx.reshape(B, -1)
    g3 = g.reshape(B, -1, d)
    if padding_idx is not None:
        g3 = g3 * (idx2 != padding_idx).unsqueeze(-1).to(g3.dtype)
    out = g3.new_zeros((B, num_embeddings, d))
    rows = torch.arange(B, device=idx.device).unsqueeze(1).expand_as(idx2)
    out.index_put_((rows, idx2), g3, accumulate=True)
    return out


def embedding_sq_norms(idx: Any, g: Any, padding_idx: int | None = None) -> Any:
    """Squared norms of per-sample embedding grads without forming them:
    ``sum_{t, s: idx[t] = idx[s]} <g[t], g[s]>`` (one (T, T) Gram matrix per sample). idx: (B, ...),
    g: (B, ..., d). Returns (B,) in the accumulation type."""
    return reference_embedding_sq_norms(idx, g, padding_idx)


def reference_embedding_sq_norms(idx: Any, g: Any, padding_idx: int | None = None) -> Any:
    """torch embedding ghost norms (masked Gram route)."""
    B = idx.shape[0]
    acc = _acc(g)
    idx2 = idx.reshape(B, -1)
    g3 = g.reshape(B, -1, g.shape[-1]).to(acc)
    if padding_idx is not None:
        g3 = g3 * (idx2 != padding_idx).unsqueeze(-1).to(acc)
    same = (idx2.unsqueeze(2) == idx2.unsqueeze(1)).to(acc)
    return ((g3 @ g3.transpose(1, 2)) * same).sum((1, 2))


# ---------------------------------------------------------------------------------------------
# Conv (Conv1d as H = R = P = 1, Conv2d): per-sample grads, ghost norms, clipped sums
# ---------------------------------------------------------------------------------------------

CONV_ROUTES = ("kernel", "grouped", "unfold")
_CONV_BM = 64  # conv_per_sample's rows (c, r, s) per block
_CONV_THREADS = 128
_CONV_BLOCKS_PER_SM = 4  # the clipped route's split target: about one wave of resident blocks
_INT32_LIMIT = 2**31 - 2**12


@dataclass(frozen=True)
class ConvShape:
    """A convolution as the per-sample conv ops see it (NCHW): x (B, C, H, W) after any non-zero
    padding mode was applied, G = dL/dy (B, K, P, Q), kernel R x S, stride, the top and left zero
    pads (the bottom and right ones are implicit in P and Q), dilation, groups. A Conv1d is H = R =
    P = 1. Hashable: it keys the launch plans."""

    C: int
    H: int
    W: int
    K: int
    P: int
    Q: int
    R: int
    S: int
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    @property
    def patch(self) -> int:
        """N = C/G * R * S: one output channel's weights, one patch's length."""
        return self.C // self.groups * self.R * self.S

    @property
    def out_per_group(self) -> int:
        """M = K/G."""
        return self.K // self.groups

    @property
    def pixels(self) -> int:
        """L = P * Q, the output pixels a sample's gradient sums over."""
        return self.P * self.Q

    def reach(self) -> tuple[int, int]:
        """The input rows and columns the windows reach from the top/left pad: (P - 1) sh + dh (R - 1) + 1, ..."""
        (sh, sw), (dh, dw) = self.stride, self.dilation
        return (self.P - 1) * sh + dh * (self.R - 1) + 1, (self.Q - 1) * sw + dw * (self.S - 1) + 1


def conv_route(op: str, shape: ConvShape, batch: int, cuda: bool) -> str:
    """The one rule: how a conv layer's per-sample quantity is computed, for op "grads", "norms"
    or "clipped" (the sum of f_i-weighted per-sample grads) over `batch` samples. With M = K/G,
    N = C/G R S, L = P Q per group:

    - "kernel" (CUDA only): ``conv_per_sample``, an implicit GEMM per sample and group, M N L FMAs
      on tiles of 64 x (16, 32 or 64), the patches gathered on the fly, one launch (norms and
      clipped sums: plus a fixed-order reduction); norms reduce each tile of dW_i to a sum of
      squares as it is made, so they hold O(B) numbers whatever the layer. The CUDA choice unless
      one of the two rules below applies.
    - "grouped": torch's convolution weight gradient (cuDNN, oneDNN) with the batch folded into
      the groups (x as (1, B C, H, W), G as (1, B K, P, Q), B G groups). On CUDA where the
      kernel's tiles would be under 1/16 full (M N small: depthwise and similar) and the padded
      tiles' work B G L (tile area) reaches 2^30 FMAs, below which the kernel's one launch is
      still cheaper than cuDNN's; on the CPU for grads and clipped sums (there without the fold:
      the batch sum is the plain weight gradient of f ⊙ G), and for norms where the Gram route
      is not cheaper.
    - "unfold" for norms: the patches materialised (B L N numbers, one strided copy) and
      ||dW_i||^2 = <A_i A_i^T, G_i G_i^T> (Gram matrices, L^2 (M + N) FMAs per sample). On CUDA
      where that is under 1/8 of M N L and the kernel's B M N L FMAs reach 2^31 (late layers of
      wide networks: few pixels, many channels; below that the route's extra launches cost more
      than the FMAs it saves); on the CPU wherever L^2 < M N (:func:`use_gram`).

    The CUDA thresholds were measured on an H100 (benchmarks/NOTES.md, issue 12).

    See also: Rochette et al. 2019 (per-example conv gradients by grouped convolutions); Opacus'
    ``unfold2d`` grad sampler; Li et al. 2022 (ghost clipping for conv layers).
    """
    if op not in _CONV_MODES:
        raise ValueError(f"cukit.ops.per_sample.conv_route: op must be one of {tuple(_CONV_MODES)}; got {op!r}")
    M, N, L = shape.out_per_group, shape.patch, shape.pixels
    if not cuda:
        return "unfold" if op == "norms" and use_gram(L, N, M) else "grouped"
    if op == "norms" and 8 * L * L * (M + N) < M * N * L and batch * M * N * L >= 1 << 31:
        return "unfold"
    bn = _conv_bn(M)
    tiles = -(-M // bn) * bn * -(-N // _CONV_BM) * _CONV_BM  # the (M, N) the kernel computes, padded
    if M * N / tiles < 1 / 16 and batch * shape.groups * L * tiles >= 1 << 30:
        return "grouped"
    return "kernel"


_FN = {"grads": "conv_grads", "norms": "conv_sq_norms", "clipped": "conv_clipped"}


def _conv_check(mode: str, x: Any, g: Any, shape: ConvShape, route: str | None) -> str:
    """Validate x, G against shape (once per signature on CUDA); return the route."""
    fn = _FN[mode]
    if not isinstance(shape, ConvShape):
        raise TypeError(f"cukit.ops.per_sample.{fn}: shape must be a ConvShape; got {type(shape).__qualname__}")
    _check(fn, "x", x, ndim=4)
    _check(fn, "g", g, ndim=4)
    if g.dtype != x.dtype or g.device != x.device:
        raise TypeError(f"cukit.ops.per_sample.{fn}: x and g must share dtype and device; got {x.dtype} on "
                        f"{x.device} and {g.dtype} on {g.device}")
    s = shape
    B = x.shape[0]
    if s.groups < 1 or s.C % s.groups or s.K % s.groups:
        raise ValueError(f"cukit.ops.per_sample.{fn}: groups ({s.groups}) must divide C ({s.C}) and K ({s.K})")
    if min(s.C, s.H, s.W, s.K, s.P, s.Q, s.R, s.S, *s.stride, *s.dilation) < 1 or min(s.padding) < 0:
        raise ValueError(f"cukit.ops.per_sample.{fn}: sizes, strides and dilations must be positive and pads "
                         f"non-negative; got {s}")
    if tuple(x.shape) != (B, s.C, s.H, s.W) or tuple(g.shape) != (B, s.K, s.P, s.Q):
        raise ValueError(f"cukit.ops.per_sample.{fn}: x must have shape (B, {s.C}, {s.H}, {s.W}) and g (B, {s.K}, "
                         f"{s.P}, {s.Q}); got {tuple(x.shape)} and {tuple(g.shape)}")
    route = route if route is not None else conv_route(mode, s, B, x.is_cuda)
    if route not in CONV_ROUTES:
        raise ValueError(f"cukit.ops.per_sample.{fn}: route must be None or one of {CONV_ROUTES}; got {route!r}")
    if route == "kernel" and not x.is_cuda:
        raise ValueError(f"cukit.ops.per_sample.{fn}: route 'kernel' needs CUDA tensors")
    return route


def conv_grads(x: Any, g: Any, shape: ConvShape, *, bias: bool = True, route: str | None = None) -> tuple[Any, Any]:
    """Per-sample Conv weight and bias grads: ``dW_i[k, (c, r, s)] = sum_l G_i[k, l] A_i[(c, r, s), l]``
    -> (B, K, C/G, R, S), ``db_i[k] = sum_l G_i[k, l]`` -> (B, K) (None when bias is False).

    x: (B, C, H, W) input as the layer saw it after any non-zero padding mode (zero pads are given
    by shape); g: (B, K, P, Q) output grads; one dtype (float16, bfloat16, float32, float64), made
    contiguous. shape: a :class:`ConvShape`. route: None (:func:`conv_route` decides) or one of
    CONV_ROUTES. Results in x's dtype (fp32 accumulation; fp64 for float64). On CUDA the kernel
    route is one launch, no sync, bitwise reproducible.

    See also: ``torch.func.vmap(torch.func.grad(...))``, ``torch.nn.grad.conv2d_weight`` (which
    sums over the batch), Opacus' conv grad sampler.
    """
    if x.is_cuda and route in (None, "kernel"):
        return _conv_kernel("grads", x, g, shape, bias, route)
    return _conv_torch("grads", _conv_check("grads", x, g, shape, route), x, g, shape, bias)


def conv_sq_norms(x: Any, g: Any, shape: ConvShape, *, bias: bool = True, route: str | None = None
                  ) -> tuple[Any, Any]:
    """Squared norms of the per-sample Conv grads, ``(||dW_i||_F^2, ||db_i||^2)``, each (B,) in
    the accumulation type (None for the bias when bias is False), without storing dW_i on the
    kernel route (tiles of dW_i reduced to sums of squares as they are made) and by
    ``<A_i A_i^T, G_i G_i^T>`` on the unfold route. Arguments as :func:`conv_grads`.

    See also: ``cukit.ops.per_sample.linear_sq_norms``, Opacus' ghost clipping.
    """
    if x.is_cuda and route in (None, "kernel"):
        return _conv_kernel("norms", x, g, shape, bias, route)
    return _conv_torch("norms", _conv_check("norms", x, g, shape, route), x, g, shape, bias)


def conv_clipped(x: Any, g: Any, shape: ConvShape, factors: Any, out_w: Any, out_b: Any = None, *,
                 route: str | None = None) -> None:
    """``out_w += sum_i f_i dW_i`` and ``out_b += sum_i f_i db_i`` (when out_b is given): the
    clipped sum of a DP step, without per-sample grads (the batch's weight gradient of f ⊙ G).

    factors: (B,) in x's accumulation type; out_w: (K, C/G, R, S) or any shape of K C/G R S
    elements (p.grad), out_b: (K,); of x's dtype or its accumulation type. Other arguments as
    :func:`conv_grads`; routes "grouped" and "unfold" both take torch's convolution weight
    gradient. On CUDA (kernel route) two or three launches: split partial sums, then fixed-order
    reductions into out (bitwise reproducible), no sync.

    See also: Bu et al. 2023 (Book-Keeping), ``torch.nn.grad.conv2d_weight``.
    """
    if x.is_cuda and route in (None, "kernel"):
        _conv_kernel("clipped", x, g, shape, out_b is not None, route, factors, out_w, out_b)
        return
    _conv_torch("clipped", _conv_check("clipped", x, g, shape, route), x, g, shape, out_b is not None, factors,
                out_w, out_b)


def _conv_torch(mode: str, route: str, x: Any, g: Any, s: ConvShape, bias: bool, factors: Any = None,
                out_w: Any = None, out_b: Any = None) -> Any:
    """The grouped and unfold routes (any device)."""
    if mode == "grads":
        return _grouped_grads(x, g, s, bias) if route == "grouped" else reference_conv_grads(x, g, s, bias=bias)
    if mode == "norms":
        return _conv_norms_torch(x, g, s, bias, route)
    _check_factors("conv_clipped", x, factors)
    _check_out("conv_clipped", x, s, out_w, out_b)
    dw, db = _batch_weight_grad(x, scale_rows(g, factors), s, bias)
    out_w.add_(dw.reshape(out_w.shape).to(out_w.dtype))
    if bias:
        out_b.add_(db.to(out_b.dtype))
    return None


def _check_out(fn: str, x: Any, s: ConvShape, out_w: Any, out_b: Any) -> None:
    for name, o, n in (("out_w", out_w, s.K * s.patch), ("out_b", out_b, s.K)):
        if o is not None and (o.numel() != n or o.device != x.device or not o.is_floating_point()):
            raise ValueError(f"cukit.ops.per_sample.{fn}: {name} must be a floating tensor of {n} elements on "
                             f"{x.device}; got {o.dtype} of shape {tuple(o.shape)} on {o.device}")


# -- the torch routes (any device) -----------------------------------------------------------


def _zero_padded(x: Any, s: ConvShape, symmetric: bool) -> tuple[Any, tuple[int, int]]:
    """x with the zero pads the windows need made explicit where a torch op cannot take them:
    (x, padding) for torch's ops, which pad top = bottom and left = right. symmetric: keep the
    pads as an argument when top = bottom, left = right reproduces (P, Q)."""
    import torch.nn.functional as F

    (ph, pw), (sh, sw) = s.padding, s.stride
    rh, rw = s.reach()
    if symmetric and (s.H + 2 * ph - rh) // sh == s.P - 1 and (s.W + 2 * pw - rw) // sw == s.Q - 1:
        return x, (ph, pw)
    if ph == pw == 0 and rh <= s.H and rw <= s.W:
        return x, (0, 0)
    return F.pad(x, (pw, max(0, rw - s.W - pw), ph, max(0, rh - s.H - ph))), (0, 0)


def _grouped_grads(x: Any, g: Any, s: ConvShape, bias: bool) -> tuple[Any, Any]:
    """Per-sample grads as ONE weight gradient of a convolution with the batch folded into its
    groups (sample i's channels form groups i G .. i G + G - 1)."""
    import torch

    B = x.shape[0]
    if B == 0:
        return x.new_zeros((0, s.K, s.C // s.groups, s.R, s.S)), (x.new_zeros((0, s.K)) if bias else None)
    xp, pad = _zero_padded(x, s, symmetric=True)
    xg = xp.reshape(1, B * s.C, xp.shape[2], xp.shape[3])
    gg = g.reshape(1, B * s.K, s.P, s.Q)
    w = g.new_empty(1).expand(B * s.K, s.C // s.groups, s.R, s.S)
    _, dw, db = torch.ops.aten.convolution_backward(gg, xg, w, [B * s.K] if bias else None, list(s.stride), list(pad),
                                                    list(s.dilation), False, [0, 0], B * s.groups, [False, True, bias])
    return dw.view(B, s.K, s.C // s.groups, s.R, s.S), (db.view(B, s.K) if bias else None)


def _batch_weight_grad(x: Any, g: Any, s: ConvShape, bias: bool) -> tuple[Any, Any]:
    """The ordinary (batch-summed) weight and bias gradient of the convolution."""
    import torch

    xp, pad = _zero_padded(x, s, symmetric=True)
    w = g.new_empty(1).expand(s.K, s.C // s.groups, s.R, s.S)
    _, dw, db = torch.ops.aten.convolution_backward(g, xp, w, [s.K] if bias else None, list(s.stride), list(pad),
                                                    list(s.dilation), False, [0, 0], s.groups, [False, True, bias])
    return dw, db


def _patches(x: Any, s: ConvShape) -> Any:
    """The patches (B, G, N, L) in x's dtype (B L C R S numbers: the unfold route), F.unfold's
    layout. One strided copy: CUDA's F.unfold launches a kernel per sample."""
    xp, _ = _zero_padded(x, s, symmetric=False)
    xp = xp.contiguous()
    B, C, Hp, Wp = xp.shape
    (sh, sw), (dh, dw) = s.stride, s.dilation
    windows = xp.as_strided((B, C, s.R, s.S, s.P, s.Q), (C * Hp * Wp, Hp * Wp, dh * Wp, dw, sh * Wp, sw))
    return windows.reshape(B, s.groups, s.patch, s.pixels)


def _bias_sq_norms(g: Any) -> Any:
    return row_sq_norms(g.sum((2, 3), dtype=_acc(g)))


def _conv_norms_torch(x: Any, g: Any, s: ConvShape, bias: bool, route: str) -> tuple[Any, Any]:
    """conv_sq_norms by the unfold (Gram) or grouped (materialised) route."""
    B = x.shape[0]
    if route == "grouped":
        dw, db = _grouped_grads(x, g, s, bias)
        return row_sq_norms(dw), (row_sq_norms(db) if bias else None)
    p = _patches(x, s).reshape(B * s.groups, s.patch, s.pixels)
    gt = g.reshape(B * s.groups, s.out_per_group, s.pixels)
    sw = linear_sq_norms(p.transpose(1, 2), gt.transpose(1, 2), gram=True).view(B, s.groups).sum(1)
    return sw, (_bias_sq_norms(g) if bias else None)


def reference_conv_grads(x: Any, g: Any, shape: ConvShape, *, bias: bool = True) -> tuple[Any, Any]:
    """torch per-sample conv grads over unfolded patches, in the accumulation type then cast."""
    import torch

    s = shape
    acc = _acc(x)
    B = x.shape[0]
    p = _patches(x.to(acc), s)
    gg = g.to(acc).reshape(B, s.groups, s.out_per_group, s.pixels)
    dw = torch.einsum("bgkl,bgnl->bgkn", gg, p).reshape(B, s.K, s.C // s.groups, s.R, s.S).to(x.dtype)
    return dw, (g.to(acc).sum((2, 3)).to(g.dtype) if bias else None)


def reference_conv_sq_norms(x: Any, g: Any, shape: ConvShape, *, bias: bool = True) -> tuple[Any, Any]:
    """torch squared norms of the per-sample conv grads, from :func:`reference_conv_grads` in
    the accumulation type."""
    s = shape
    acc = _acc(x)
    dw, db = reference_conv_grads(x.to(acc), g.to(acc), s, bias=bias)
    return reference_row_sq_norms(dw), (reference_row_sq_norms(db) if bias else None)


# -- the kernel route (CUDA) -----------------------------------------------------------------

_CONV_PLANS = PlanCache("per_sample_conv", maxsize=1024)


class _ConvPlan:
    __slots__ = ("main", "out_b", "out_w", "reduce", "splits", "tiles")

    def __init__(self, main: Any, reduce: Any, splits: int, tiles: tuple[int, int], out_w: Any = None,
                 out_b: Any = None) -> None:
        self.main, self.reduce, self.splits, self.tiles = main, reduce, splits, tiles
        self.out_w, self.out_b = out_w, out_b  # the clipped route's reductions into p.grad


def _conv_bn(m: int) -> int:
    """conv_per_sample's column tile: the smallest instantiated one holding M = K/G columns."""
    return next((bn for bn in _CONV_BN if m <= bn), _CONV_BN[-1])


def _conv_kernel(mode: str, x: Any, g: Any, s: ConvShape, bias: bool, route: str | None, factors: Any = None,
                 out_w: Any = None, out_b: Any = None) -> Any:
    """conv_grads / conv_sq_norms / conv_clipped of CUDA tensors: a plan-cache lookup, then
    conv_per_sample (or the route the plan names, for shapes the rule or the grid sends elsewhere)."""
    x = x.contiguous()
    g = g.contiguous()
    key = ("conv", mode, s, route, x.shape, x.dtype, g.shape, g.dtype, x.device, bias,
           None if out_w is None else (out_w.dtype, out_w.is_contiguous()),
           None if out_b is None else (out_b.dtype, out_b.is_contiguous()))
    plan = _CONV_PLANS.get(key)
    if plan is None:
        plan = _conv_plan(mode, x, g, s, bias, route, factors, out_w, out_b, key)
    if type(plan) is str:  # the rule's or the grid's other route
        return _conv_torch(mode, plan, x, g, s, bias, factors, out_w, out_b)
    B = x.shape[0]
    acc = _acc(x)
    if mode == "grads":
        dw = g.new_empty((B, s.K, s.C // s.groups, s.R, s.S))
        db = g.new_empty((B, s.K)) if bias else None
        if plan is _EMPTY:
            return dw.zero_(), (None if db is None else db.zero_())
        plan.main((x.data_ptr(), g.data_ptr(), 0, dw.data_ptr(), 0 if db is None else db.data_ptr(), 0, 0),
                  current_stream(x.get_device(), True))
        return dw, db
    if mode == "norms":
        out = g.new_empty((2 if bias else 1, B), dtype=acc)
        if plan is _EMPTY:
            out.zero_()
        else:
            stream = current_stream(x.get_device(), True)
            part = g.new_empty((B, plan.tiles[0]), dtype=acc)
            partb = g.new_empty((B, plan.tiles[1]), dtype=acc) if bias else None  # alive until both launches
            pb = 0 if partb is None else partb.data_ptr()
            plan.main((x.data_ptr(), g.data_ptr(), 0, 0, 0, part.data_ptr(), pb), stream)
            plan.reduce((part.data_ptr(), pb, out.data_ptr()), stream)
            del part, partb  # the launches are enqueued: stream-ordered reuse from here
        return out[0], (out[1] if bias else None)
    if plan is _EMPTY:
        return None
    stream = current_stream(x.get_device(), True)
    part = g.new_empty((plan.splits, s.K * s.patch), dtype=acc)
    partb = g.new_empty((plan.splits, s.K), dtype=acc) if bias else None
    pb = 0 if partb is None else partb.data_ptr()
    plan.main((x.data_ptr(), g.data_ptr(), factors.data_ptr(), 0, 0, part.data_ptr(), pb), stream)
    if plan.out_w is not None:
        plan.out_w((part.data_ptr(), out_w.data_ptr(), np.int32(1)), stream)
    else:  # a p.grad of another dtype or layout
        out_w.add_(part.sum(0).view(out_w.shape).to(out_w.dtype))
    if partb is not None:
        if plan.out_b is not None:
            plan.out_b((pb, out_b.data_ptr(), np.int32(1)), stream)
        else:
            out_b.add_(partb.sum(0).to(out_b.dtype))
    return None


def _conv_plan(mode: str, x: Any, g: Any, s: ConvShape, bias: bool, route: str | None, factors: Any, out_w: Any,
               out_b: Any, key: tuple) -> Any:
    """Validate a CUDA call's arguments and build its plan: a _ConvPlan, _EMPTY (nothing to
    launch) or the name of the torch route to take (the rule's choice, or "grouped" for sizes
    beyond the kernel's 32-bit grid and index limits)."""
    route = _conv_check(mode, x, g, s, route)
    if mode == "clipped":
        _check_factors("conv_clipped", x, factors)
        _check_out("conv_clipped", x, s, out_w, out_b)
    if route != "kernel":
        return _CONV_PLANS.put(key, route)
    B = x.shape[0]
    if B == 0:
        return _CONV_PLANS.put(key, _EMPTY)
    M, N = s.out_per_group, s.patch
    bn = _conv_bn(M)
    row_tiles = -(-N // _CONV_BM)
    col_blocks = -(-M // bn) * s.groups
    device = x.get_device()
    if mode == "clipped":  # about one wave of blocks: splits of the batch, each summed in registers
        want = -(-sm_count(device) * _CONV_BLOCKS_PER_SM // (row_tiles * col_blocks))
        per_split = -(-B // max(1, min(B, want)))
        splits = -(-B // per_split)
    else:
        per_split, splits = 1, B
    sizes = (s.C, s.H, s.W, s.K, s.P, s.Q, N, row_tiles * splits, s.H + s.padding[0], s.W + s.padding[1])
    if col_blocks > _GRID_Y_MAX or max(sizes) > _INT32_LIMIT:
        return _CONV_PLANS.put(key, "grouped")
    main = KERNELS.prepare(
        f"conv_per_sample<{_ctype(x)}, {bn}, {_CONV_MODES[mode]}>", (row_tiles * splits, col_blocks), (_CONV_THREADS,),
        (B, s.C, s.H, s.W, s.K, s.P, s.Q, s.R, s.S, *s.stride, *s.padding, *s.dilation, s.groups, per_split, splits),
        device=device,
    )
    tiles = (row_tiles * col_blocks, col_blocks)  # norms' partial sums per sample: weight, bias
    if mode == "grads":
        return _CONV_PLANS.put(key, _ConvPlan(main, None, splits, tiles))
    a = _acc_ctype(x)
    if mode == "norms":
        n_out = 2 * B if bias else B
        reduce = KERNELS.prepare(f"conv_norms_reduce<{a}>", (-(-n_out // _BLOCK),), (_BLOCK,), (B, *tiles),
                                 device=device)
        return _CONV_PLANS.put(key, _ConvPlan(main, reduce, splits, tiles))
    target = sm_count(device) * (2048 // _BLOCK)
    reductions = []
    for o, n in ((out_w, s.K * N), (out_b, s.K)):
        r = None
        if o is not None and o.is_contiguous() and o.dtype in (x.dtype, _acc(x)):
            oc = _ctype(x) if o.dtype == x.dtype else a
            r = KERNELS.prepare(f"weighted_sum_reduce<{a}, {oc}>", (max(1, min(-(-n // _BLOCK), target)),), (_BLOCK,),
                                (splits, n), device=device, n_head=3)
        reductions.append(r)
    return _CONV_PLANS.put(key, _ConvPlan(main, None, splits, tiles, *reductions))
