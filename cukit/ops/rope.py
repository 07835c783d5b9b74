"""Rotary position embedding (RoPE) of q and k, with exactly the semantics of Hugging Face's
``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` (and the same for k), cos and sin of
shape (batch, seq, rotary_dim) unsqueezed at ``unsqueeze_dim`` to broadcast over the heads.

Kernels: ``raw_kernels/rope.cu`` (one launch for q and k, strided: Hugging Face's q and k are
transposed views of the projections' output and are read and written in place of a copy). The NumPy
and torch references below are the CPU fallbacks and the test oracles. torch registration
(autograd, torch.compile, CUDA graphs): ``cukit/torch/rope.py``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    NotAnArrayError,
    array_class,
    array_kind,
    as_arrays,
    as_dtype,
    current_stream,
    device_of,
    dtype_name,
    element_strides,
    not_an_array_error,
    numpy_dtype,
    type_name,
)
from cukit.ops.bias_act import FLOAT_DTYPES, _dtypes_text, _ptr, _where

__all__ = [
    "RopeSpec",
    "backward_gpu",
    "forward_gpu",
    "promote",
    "reference_backward_numpy",
    "reference_backward_torch",
    "reference_numpy",
    "reference_torch",
    "rotary_embedding",
    "rotary_embedding_backward",
    "validate",
]

_SIZE = {name: DTYPES[name].itemsize for name in FLOAT_DTYPES}


def promote(a: str, b: str) -> str:
    """torch's (and NumPy's) type promotion of two float dtype names: float16 with bfloat16 is
    float32, otherwise the wider."""
    if a == b:
        return a
    if "float64" in (a, b):
        return "float64"
    return "float32"  # float32 with anything narrower, and float16 with bfloat16


def _vec(ti: str, to: str) -> int:
    """Elements per 16-byte vector of the wider of the rotated input and output types."""
    return 16 // max(_SIZE[ti], _SIZE[to])


def _kernel(ti: str, tc: str, to: str, vec: int, transpose: bool, index: str) -> str:
    c = DTYPES
    return f"rope<{c[ti].ctype}, {c[tc].ctype}, {c[to].ctype}, {vec}, {'true' if transpose else 'false'}, {index}>"


def _instantiations() -> dict[str, list[str]]:
    """One group per (q dtype, cos dtype): the forward (out = promote(q, cos)) and its transpose
    (promote(q, cos) -> q's dtype), vectorised and scalar, 32- and 64-bit indexing. Mixed groups
    serve autocast (bfloat16 q and k, float32 tables) without casting q and k first."""
    groups: dict[str, list[str]] = {}
    for t in FLOAT_DTYPES:
        for c in FLOAT_DTYPES:
            o = promote(t, c)
            exprs = [
                _kernel(ti, c, to, v, transpose, index)
                for ti, to, transpose in ((t, o, False), (o, t, True))
                for v in (_vec(ti, to), 1)
                for index in ("int", "long long")
            ]
            groups[t if t == c else f"{t}/{c}"] = exprs
    return groups


KERNELS = KernelModule(
    "rope.cu",
    instantiations=_instantiations(),
    signatures={"rope": "ptr ptr ptr ptr ptr ptr " + " ".join(["i64"] * 20)},
)

_THREADS = 256  # threads per block to aim for
_ROW_UNROLL = 3  # = ROW_UNROLL in rope.cu: heads of one token a thread rotates
_MAX_BX = 64  # column-pair threads per block (more pairs: a thread loops)
_MAX_GRID = 2**31 - 1
_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class RopeSpec(NamedTuple):
    """What validation derives from a call: array kind, unsqueeze_dim (1 or 2), sizes, dtype names
    (input of the rotated tensors, cos/sin, output)."""

    kind: str
    unsqueeze_dim: int
    B: int
    S: int
    Hq: int
    Hk: int
    D: int
    R: int
    ti: str
    tc: str
    to: str


def _unsqueeze_dim(unsqueeze_dim: Any, fn: str) -> int:
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, (int, np.integer)):
        raise TypeError(f"{fn}: unsqueeze_dim must be an int (1 or 2); got {type_name(unsqueeze_dim)}")
    ud = int(unsqueeze_dim)
    ud = ud + 4 if ud in (-3, -2) else ud  # the same dims of 4-d q, counted from the end
    if ud not in (1, 2):
        raise ValueError(
            f"{fn}: unsqueeze_dim must be 1 (q and k of shape (batch, heads, seq, head_dim)) or 2 ((batch, seq, "
            f"heads, head_dim)); got {unsqueeze_dim}"
        )
    return ud


def validate(
    q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any = 1, fn: str = "cukit.rotary_embedding",
    *, transpose: bool = False, dtype: Any = None,
) -> RopeSpec:
    """Check rotary_embedding's arguments, or with ``transpose`` the backward's (q and k are then
    the gradients grad_q and grad_k, and ``dtype`` (default grad_q's) the dtype wanted for the
    result); return a :class:`RopeSpec`.

    NotAnArrayError when an argument is not an array (the public functions then convert
    array-likes); TypeError (types, dtypes) or ValueError (shapes, devices, unsqueeze_dim) naming fn
    and the argument otherwise."""
    nq, nk = ("grad_q", "grad_k") if transpose else ("q", "k")
    try:
        kinds = [array_kind(t) for t in (q, k, cos, sin)]
    except NotAnArrayError:
        raise not_an_array_error(fn, ((nq, q), (nk, k), ("cos", cos), ("sin", sin))) from None
    kind = kinds[0]
    for name, t, tk in zip((nk, "cos", "sin"), (k, cos, sin), kinds[1:], strict=True):
        if tk != kind:
            raise TypeError(f"{fn}: {name} must be the same array type as {nq} ({array_class(kind)}); got {type_name(t)}")
    ud = _unsqueeze_dim(unsqueeze_dim, fn)
    ti, tk_, tc, ts = (dtype_name(t, kind) for t in (q, k, cos, sin))
    for name, d in ((nq, ti), ("cos", tc)):
        if d not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: {name} must have dtype {_dtypes_text(FLOAT_DTYPES)}; got {d}")
    if tk_ != ti:
        raise TypeError(f"{fn}: {nk} must have {nq}'s dtype {ti}; got {tk_}")
    if ts != tc:
        raise TypeError(f"{fn}: sin must have cos's dtype {tc}; got {ts}")
    if not transpose:
        to = promote(ti, tc)
    else:  # gradients of a forward whose q and k had dtype `to`
        to = ti if dtype is None else _dtype_arg(dtype, fn)
        if promote(to, tc) != ti:
            raise TypeError(
                f"{fn}: dtype must be a dtype whose promotion with cos's dtype {tc} is {nq}'s dtype {ti} (the "
                f"dtype of the forward's q and k); got {to}"
            )
    layout = "(batch, heads, seq, head_dim)" if ud == 1 else "(batch, seq, heads, head_dim)"
    if q.ndim != 4:
        raise ValueError(f"{fn}: {nq} must have 4 dimensions {layout} for unsqueeze_dim={ud}; got shape {tuple(q.shape)}")
    B, D = int(q.shape[0]), int(q.shape[3])
    S, Hq = (int(q.shape[2]), int(q.shape[1])) if ud == 1 else (int(q.shape[1]), int(q.shape[2]))
    k_ok = k.ndim == 4 and k.shape[0] == B and k.shape[3] == D and k.shape[2 if ud == 1 else 1] == S
    if not k_ok:
        want = f"({B}, heads, {S}, {D})" if ud == 1 else f"({B}, {S}, heads, {D})"
        raise ValueError(f"{fn}: {nk} must have shape {want} (q's batch, seq and head_dim); got {tuple(k.shape)}")
    Hk = int(k.shape[1 if ud == 1 else 2])
    if cos.ndim != 3 or cos.shape[0] not in (1, B) or cos.shape[1] not in (1, S) or not _rotary_dim_ok(cos, D):
        raise ValueError(
            f"{fn}: cos must have shape ({B} or 1, {S} or 1, R) with R even and 2 <= R <= head_dim ({D}) "
            f"(R < head_dim: partial rotary, the other dims pass through); got {tuple(cos.shape)}"
        )
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"{fn}: sin must have cos's shape {tuple(cos.shape)}; got {tuple(sin.shape)}")
    devices = [device_of(t) for t in (q, k, cos, sin)]
    if len(set(devices)) > 1:
        where = ", ".join(f"{n} on {_where(d)}" for n, d in zip((nq, nk, "cos", "sin"), devices, strict=True))
        raise ValueError(f"{fn}: {nq}, {nk}, cos and sin must be on the same device; got {where}")
    return RopeSpec(kind, ud, B, S, Hq, Hk, D, int(cos.shape[2]), ti, tc, to)


def _rotary_dim_ok(cos: Any, D: int) -> bool:
    R = int(cos.shape[2])
    return R % 2 == 0 and 2 <= R <= D


def _dtype_arg(dtype: Any, fn: str) -> str:
    """A dtype given as a name, NumPy dtype or torch.dtype, as a float dtype name."""
    try:
        name = dtype if isinstance(dtype, str) else as_dtype(dtype).name
    except TypeError:
        name = None
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: dtype must be one of {_dtypes_text(FLOAT_DTYPES)}; got {dtype!r}")
    return name


# ---------------------------------------------------------------------------------------------
# Public API (array level; cukit/_api.py routes torch tensors to cukit/torch/rope.py)
# ---------------------------------------------------------------------------------------------


def rotary_embedding(q: Any, k: Any, cos: Any, sin: Any, *, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
    """Rotary position embedding of q and k: ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``
    with ``rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])``: Hugging Face's ``apply_rotary_pos_emb``.

    Args:
        q: (batch, heads_q, seq, head_dim) for unsqueeze_dim=1 (Hugging Face's layout), or (batch,
            seq, heads_q, head_dim) for unsqueeze_dim=2; float16, bfloat16, float32 or float64; NumPy,
            CuPy or torch (CPU or CUDA). Any strides (transposed views are read in place); a
            head_dim stride other than 1 is copied first.
        k: q's batch, seq, head_dim and dtype; its own number of heads (grouped-query attention).
        cos, sin: (batch or 1, seq or 1, R), a dtype of their own, R even and <= head_dim. They
            broadcast over the heads (unsqueezed at unsqueeze_dim) and over batch or seq where they
            have size 1. R < head_dim is partial rotary (Phi-3, GPT-NeoX): the first R dims
            rotate, the rest pass through.
        unsqueeze_dim: 1 or 2 (also -3 or -2), as in ``apply_rotary_pos_emb``.

    Returns:
        (q_embed, k_embed), same shapes and memory layout as q and k (a dense layout is kept; others
        become contiguous), in the dtype torch promotes q and cos to (float32 for bfloat16 q and k
        with float32 tables: what ``q * cos`` gives under autocast). One kernel for both on CUDA,
        maths in float32 (float64 when a dtype is float64) rounded once; NumPy and torch-CPU inputs
        run the reference. torch tensors are differentiable to any order (q and k through the
        transposed rotation; cos and sin too, through torch ops, when they require grad) and work
        under torch.compile, vmap and CUDA graphs.

    Raises:
        TypeError (types, dtypes: k must have q's, sin cos's) and ValueError (shapes, devices,
        unsqueeze_dim), naming ``cukit.rotary_embedding`` and the argument.

    See also: ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``; Liger-Kernel's
    ``liger_rotary_pos_emb``.
    """
    fn = "cukit.rotary_embedding"
    try:
        return _rotate_arrays(q, k, cos, sin, unsqueeze_dim, None, fn)
    except NotAnArrayError:
        q, k, cos, sin = as_arrays(fn, (("q", q), ("k", k), ("cos", cos), ("sin", sin)))
    return _rotate_arrays(q, k, cos, sin, unsqueeze_dim, None, fn)


def rotary_embedding_backward(
    grad_q: Any, grad_k: Any, cos: Any, sin: Any, *, unsqueeze_dim: int = 1, dtype: Any = None
) -> tuple[Any, Any]:
    """Gradients of rotary_embedding with respect to q and k: the transposed rotation,
    ``dq = grad_q * cos + rotate_half^T(grad_q * sin)`` (and dk), ``rotate_half^T(x) = cat(x[..., R/2:R], -x[..., :R/2])``.

    For NumPy and CuPy users (torch users get this through autograd). grad_q and grad_k as q and k
    of :func:`rotary_embedding` (the gradients of its outputs); dtype: the dtype of the forward's q
    and k, in which the gradients are returned (default: grad_q's); its promotion with cos's dtype
    must be grad_q's dtype. The layouts of grad_q and grad_k are kept. One kernel on CUDA inputs.
    Errors name ``cukit.rotary_embedding_backward``.

    See also: ``torch.autograd.grad``.
    """
    fn = "cukit.rotary_embedding_backward"
    args = (("grad_q", grad_q), ("grad_k", grad_k), ("cos", cos), ("sin", sin))
    try:
        return _rotate_arrays(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype, fn)
    except NotAnArrayError:
        grad_q, grad_k, cos, sin = as_arrays(fn, args)
    return _rotate_arrays(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype, fn)


def _rotate_arrays(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any, dtype: Any, fn: str) -> tuple[Any, Any]:
    """The forward (dtype None) or the transpose, for arrays (NotAnArrayError before any work)."""
    transpose = fn.endswith("_backward")
    spec = validate(q, k, cos, sin, unsqueeze_dim, fn, transpose=transpose, dtype=dtype)
    if spec.kind == "numpy":
        return _reference_numpy(q, k, cos, sin, spec, transpose)
    if device_of(q) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return _reference_torch(q, k, cos, sin, spec, transpose)
    return _rotate_gpu(q, k, cos, sin, spec.unsqueeze_dim, transpose, spec.to)


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------

# Signatures -> plans. A plan exists for calls whose arrays are used as they are (head_dim stride 1,
# cos and sin with equal strides): any other strides are kernel arguments, so HF's transposed views
# take the cached path. Fresh outputs keep the inputs' layout and are 16-byte aligned.
_PLANS = PlanCache("rope", maxsize=1024)


class _Plan:
    __slots__ = ("k_out", "q_out", "run", "to")

    def __init__(self, q_out: tuple | None, k_out: tuple | None, to: Any, run: Any) -> None:
        # q_out, k_out: (shape, strides) of the outputs (strides in elements; CuPy: in bytes); for
        # torch None where torch.empty_like gives that layout
        self.q_out, self.k_out, self.to, self.run = q_out, k_out, to, run


_empty_like: Any = None  # torch.empty_like, once a torch plan exists


def forward_gpu(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
    """rotary_embedding for CuPy arrays or torch CUDA tensors: one launch for q and k. Validated on a
    signature's first call; later calls are a plan-cache lookup, two allocations and a launch."""
    return _rotate_gpu(q, k, cos, sin, unsqueeze_dim, False, None)


def backward_gpu(grad_q: Any, grad_k: Any, cos: Any, sin: Any, unsqueeze_dim: int, dtype: Any) -> tuple[Any, Any]:
    """rotary_embedding_backward for CuPy arrays or torch CUDA tensors (dtype: the gradients'
    dtype, a dtype name or torch.dtype): one launch of the transposed rotation."""
    return _rotate_gpu(grad_q, grad_k, cos, sin, unsqueeze_dim, True, dtype)


def _rotate_gpu(q: Any, k: Any, cos: Any, sin: Any, ud: int, transpose: bool, dtype: Any) -> tuple[Any, Any]:
    if hasattr(q, "data_ptr"):
        # the signature, written out (a generator over the four tensors costs a microsecond more)
        key = (transpose, ud, dtype,
               q.shape, q.stride(), q.dtype, q.get_device(), q.data_ptr() & 15,
               k.shape, k.stride(), k.dtype, k.get_device(), k.data_ptr() & 15,
               cos.shape, cos.stride(), cos.dtype, cos.get_device(), cos.data_ptr() & 15,
               sin.shape, sin.stride(), sin.dtype, sin.get_device(), sin.data_ptr() & 15)
        plan = _PLANS.get(key)
        if plan is None:
            return _rotate_first(q, k, cos, sin, ud, transpose, dtype, key)
        if plan.__class__ is Densify:
            return _rotate_gpu(*plan.apply((q, k, cos, sin)), ud, transpose, dtype)
        # empty_like keeps q's layout and is the cheaper call; the plan's strides where it did not
        qo = _empty_like(q, dtype=plan.to) if plan.q_out is None else q.new_empty_strided(*plan.q_out, dtype=plan.to)
        ko = _empty_like(k, dtype=plan.to) if plan.k_out is None else k.new_empty_strided(*plan.k_out, dtype=plan.to)
        if plan.run is not None:
            plan.run((q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), qo.data_ptr(), ko.data_ptr()),
                     current_stream(q.get_device(), True))
        return qo, ko
    if any(type(t) is np.ndarray for t in (q, k, cos, sin)):
        raise TypeError("cukit.ops.rope: the GPU path (forward_gpu, backward_gpu) needs CuPy arrays or torch CUDA "
                        "tensors; got a numpy.ndarray")
    key = (transpose, ud, dtype, *((t.shape, t.strides, t.dtype, t.device.id, t.data.ptr & 15)
                                   for t in (q, k, cos, sin)))
    plan = _PLANS.get(key)
    if plan is None:
        return _rotate_first(q, k, cos, sin, ud, transpose, dtype, key)
    if plan.__class__ is Densify:
        return _rotate_gpu(*plan.apply((q, k, cos, sin)), ud, transpose, dtype)
    qo = _cupy_strided(*plan.q_out, plan.to, q)
    ko = _cupy_strided(*plan.k_out, plan.to, k)
    if plan.run is not None:
        plan.run((q.data.ptr, k.data.ptr, cos.data.ptr, sin.data.ptr, qo.data.ptr, ko.data.ptr),
                 current_stream(q.device.id, False))
    return qo, ko


def _cupy_strided(shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, like: Any) -> Any:
    """A CuPy array of `shape` with `strides` (bytes, a dense layout) on like's device."""
    import cupy

    with like.device:
        buf = cupy.empty(math.prod(shape) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return cupy.ndarray(shape, dtype, buf.data, strides)


def _d_stride_one(a: Any, kind: str) -> bool:
    st = element_strides(a, kind)
    return st is not None and (a.shape[-1] <= 1 or st[-1] == 1)


def _copies(q: Any, k: Any, cos: Any, sin: Any, kind: str) -> tuple[bool, bool, bool, bool]:
    """Which of (q, k, cos, sin) the kernel cannot read as they are: it takes any layout whose
    head_dim stride is 1, with cos and sin laid out alike."""
    tables = (not _d_stride_one(cos, kind) or not _d_stride_one(sin, kind)
              or element_strides(cos, kind) != element_strides(sin, kind))
    return not _d_stride_one(q, kind), not _d_stride_one(k, kind), tables, tables


def _alloc_like(a: Any, kind: str, dtype: str) -> Any:
    """An output like `a` (its dense layout kept, head_dim stride 1) in `dtype`."""
    if kind == "torch":
        import torch

        out = torch.empty_like(a, dtype=getattr(torch, dtype))
        if not _d_stride_one(out, kind):
            out = torch.empty(a.shape, dtype=out.dtype, device=a.device)
        return out
    import cupy

    dt = numpy_dtype(dtype)
    bits = np.dtype(f"u{dt.itemsize}")  # allocated as unsigned ints and viewed: a CuPy without
    with a.device:                       # ml_dtypes' bfloat16 still views it (as cukit.testing does)
        out = cupy.empty_like(a, dtype=bits)
        if not _d_stride_one(out, kind):
            out = cupy.empty(a.shape, dtype=bits)
    return out.view(dt)


def _rotate_first(q: Any, k: Any, cos: Any, sin: Any, ud: int, transpose: bool, dtype: Any,
                  key: tuple) -> tuple[Any, Any]:
    fn = "cukit.rotary_embedding_backward" if transpose else "cukit.rotary_embedding"
    spec = validate(q, k, cos, sin, ud, fn, transpose=transpose, dtype=dtype)
    kind = spec.kind
    device = device_of(q)
    if device is None:
        raise ValueError(f"{fn}: the GPU path needs CUDA arrays; got arrays on the CPU")
    cacheable = True
    mask = _copies(q, k, cos, sin, kind)
    if any(mask):
        dense = Densify(mask, kind)
        q, k, cos, sin = dense.apply((q, k, cos, sin))
        if not any(_copies(q, k, cos, sin, kind)):  # later calls copy and take the copies' plan
            _PLANS.put(key, dense)
            return _rotate_gpu(q, k, cos, sin, ud, transpose, dtype)
        cacheable = False  # tables of different shapes whose copies' strides still differ: rare
    qo, ko = _alloc_like(q, kind, spec.to), _alloc_like(k, kind, spec.to)
    tokens, H = spec.B * spec.S, spec.Hq + spec.Hk
    run = None
    if tokens and H:
        run = _prepare(spec, transpose, (q, k, cos, sin, qo, ko), device)
        ptrs = tuple(_ptr(t, kind) for t in (q, k, cos, sin, qo, ko))
        run(ptrs, current_stream(device, kind == "torch"))
    if kind == "torch":
        global _empty_like
        import torch

        _empty_like = torch.empty_like
        outs = [None if o.stride() == torch.empty_like(x, dtype=o.dtype).stride() else (tuple(o.shape), o.stride())
                for o, x in ((qo, q), (ko, k))]
    else:
        outs = [(qo.shape, qo.strides), (ko.shape, ko.strides)]
    if cacheable:
        _PLANS.put(key, _Plan(outs[0], outs[1], qo.dtype, run))
    return qo, ko


def _bsh(strides: tuple[int, ...], ud: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-d tensor laid out as unsqueeze_dim says."""
    return (strides[0], strides[2], strides[1]) if ud == 1 else (strides[0], strides[1], strides[2])


def _prepare(spec: RopeSpec, transpose: bool, arrays: tuple[Any, ...], device: int) -> Any:
    """The launch for one signature: vector width, block shape and the 20 scalar arguments."""
    kind, ud = spec.kind, spec.unsqueeze_dim
    # strides of size-1 dims are 0: never used, and whatever torch or CuPy gave them must not
    # decide the vector width (for cos and sin this is the broadcast over batch or seq)
    st = [tuple(0 if n == 1 else s for n, s in zip(t.shape, element_strides(t, kind), strict=True)) for t in arrays]
    rot = [_bsh(s, ud) for s in (st[0], st[4], st[1], st[5])]  # q, q_out, k, k_out
    c_sb, c_ss = st[2][0], st[2][1]
    half = spec.R // 2
    vec = _vec(spec.ti, spec.to)
    itemsizes = (_SIZE[spec.ti], _SIZE[spec.ti], _SIZE[spec.tc], _SIZE[spec.tc], _SIZE[spec.to], _SIZE[spec.to])
    aligned = (
        half % vec == 0
        and spec.D % vec == 0
        and all(_ptr(t, kind) % (vec * isz) == 0 for t, isz in zip(arrays, itemsizes, strict=True))
        and all(s % vec == 0 for trip in rot for s in trip)
        and c_sb % vec == 0
        and c_ss % vec == 0
    )
    vec = vec if aligned else 1
    pairs, passes = half // vec, (spec.D - spec.R) // vec
    bx = max(1, min(max(pairs, passes), _MAX_BX))
    H = spec.Hq + spec.Hk
    tokens = spec.B * spec.S
    groups = tokens * -(-H // _ROW_UNROLL)  # a thread's rows: _ROW_UNROLL heads of one token
    by = max(1, min(_THREADS // bx, groups))
    grid = min(-(-groups // by), _MAX_GRID)
    # int indexing while every value the kernel forms fits: an offset is at most a tensor's extent
    # (+ a vector), the group loop reaches groups + a grid's trip
    extent = max(sum((n - 1) * s for n, s in zip(t.shape, st_t, strict=True)) for t, st_t in zip(arrays, st, strict=True))
    index = "int" if max(extent + vec, groups + (grid + 1) * by, H + _ROW_UNROLL) <= _INT32_MAX else "long long"
    scalars = (tokens, spec.S, spec.Hq, spec.Hk, spec.R, spec.D, *rot[0], *rot[1], *rot[2], *rot[3], c_sb, c_ss)
    return KERNELS.prepare(_kernel(spec.ti, spec.tc, spec.to, vec, transpose, index), (grid,), (bx, by), scalars,
                           device=device)


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------


def _rotate(x: Any, c: Any, s: Any, transpose: bool, cat: Any) -> Any:
    """The rotation of x (..., D) by tables c, s (broadcasting, (..., R)): forward or transpose;
    `cat` concatenates along the last axis (numpy.concatenate or torch.cat)."""
    R = c.shape[-1]
    h = R // 2
    lo, hi, rest = x[..., :h], x[..., h:R], x[..., R:]
    c_lo, c_hi, s_lo, s_hi = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if transpose:
        parts = [lo * c_lo + hi * s_hi, hi * c_hi - lo * s_lo]
    else:
        parts = [lo * c_lo - hi * s_lo, hi * c_hi + lo * s_hi]
    if x.shape[-1] > R:
        parts.append(rest)
    return cat(parts)


def _reference_numpy(q: Any, k: Any, cos: Any, sin: Any, spec: RopeSpec, transpose: bool) -> tuple[Any, Any]:
    c = np.expand_dims(np.asarray(cos, np.float64), spec.unsqueeze_dim)
    s = np.expand_dims(np.asarray(sin, np.float64), spec.unsqueeze_dim)
    out = numpy_dtype(spec.to)

    def cat(parts: list[Any]) -> Any:
        return np.concatenate(parts, axis=-1)

    with np.errstate(over="ignore", invalid="ignore"):  # IEEE results on inf/NaN inputs, as the kernels
        return tuple(
            np.ascontiguousarray(_rotate(np.asarray(x, np.float64), c, s, transpose, cat).astype(out)) for x in (q, k)
        )  # type: ignore[return-value]


def _reference_torch(q: Any, k: Any, cos: Any, sin: Any, spec: RopeSpec, transpose: bool) -> tuple[Any, Any]:
    import torch

    acc = torch.float64 if "float64" in (spec.ti, spec.tc, spec.to) else torch.float32
    out = getattr(torch, spec.to)
    c = cos.to(acc).unsqueeze(spec.unsqueeze_dim)
    s = sin.to(acc).unsqueeze(spec.unsqueeze_dim)

    def cat(parts: list[Any]) -> Any:
        return torch.cat(parts, dim=-1)

    return tuple(_rotate(x.to(acc), c, s, transpose, cat).to(out) for x in (q, k))  # type: ignore[return-value]


def reference_numpy(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """NumPy rotary_embedding computed in float64 and rounded once to the promoted dtype."""
    spec = validate(q, k, cos, sin, unsqueeze_dim)
    return _reference_numpy(q, k, cos, sin, spec, False)


def reference_backward_numpy(grad_q: Any, grad_k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1,
                             dtype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """NumPy rotary_embedding_backward (the transposed rotation) in float64, rounded to dtype
    (default grad_q's)."""
    spec = validate(grad_q, grad_k, cos, sin, unsqueeze_dim, "cukit.rotary_embedding_backward", transpose=True,
                    dtype=dtype)
    return _reference_numpy(grad_q, grad_k, cos, sin, spec, True)


def reference_torch(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
    """torch rotary_embedding with the kernel's maths (float32, float64 when a dtype is float64;
    one rounding to the promoted dtype); contiguous outputs. The torch-CPU fallback and what
    torch.compile traces (inductor fuses it)."""
    spec = validate(q, k, cos, sin, unsqueeze_dim)
    return _reference_torch(q, k, cos, sin, spec, False)


def reference_backward_torch(grad_q: Any, grad_k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1,
                             dtype: Any = None) -> tuple[Any, Any]:
    """torch rotary_embedding_backward with the kernel's maths, in dtype (default grad_q's)."""
    spec = validate(grad_q, grad_k, cos, sin, unsqueeze_dim, "cukit.rotary_embedding_backward", transpose=True,
                    dtype=dtype)
    return _reference_torch(grad_q, grad_k, cos, sin, spec, True)
