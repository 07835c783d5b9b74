"""Batched linear algebra for preconditioners (Shampoo, K-FAC): inverse p-th roots and p-th roots of
symmetric positive semi-definite matrices, integer matrix powers, ``eigh``, ``kron`` and
``kron_matvec``, over any leading batch dimensions.

Kernels: ``raw_kernels/linalg.cu`` (the Newton iteration fused into one block per matrix for
matrices that fit in shared memory; for larger ones the O(n^2) work around batched GEMMs, on row
chunks so that a few large matrices fill the GPU: scales, the Newton step's T and convergence
state; the eigendecomposition route's column scaling; kron).
The GEMMs are cukit's own batched ones (``cukit.ops.matmul.gemm`` on (B, n, n) operands). NumPy
inputs run the NumPy references below, torch CPU tensors the same references on their zero-copy
NumPy views: they are the CPU fallbacks and the test oracles. Not differentiable (no torch layer):
the results of torch tensors are plain tensors on the input's device, computed on torch's current
stream.

Routes of ``matrix_inverse_root`` (``method``):

- ``"eigh"``: ``A = V diag(w) V^T`` (CuPy's batched ``cupy.linalg.eigh`` on the GPU, torch tensors
  through a zero-copy view; LAPACK on the CPU), then ``V diag(f(w)) V^T`` by one batched GEMM.
- ``"newton"``: the coupled Newton iteration (see ``raw_kernels/linalg.cu``), with no host
  synchronisation. For n <= 128 (float32) or 96 (float64) and precision "ieee", one kernel runs
  every step of a matrix in one thread block, the matrices in shared memory, and stops each matrix
  once it converged; otherwise batched GEMMs run max_iters steps, converged matrices frozen.
- ``"auto"``: :func:`choose_method`.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    DType,
    array_class,
    array_kind,
    as_array,
    contiguous,
    current_stream,
    device_of,
    dtype_name,
    is_array,
    type_name,
)

__all__ = [
    "EIGH_MAX_N",
    "MATRIX_DTYPES",
    "METHODS",
    "choose_method",
    "default_max_iters",
    "default_tol",
    "eigh",
    "eigh_root_reference",
    "kron",
    "kron_matvec",
    "kron_reference",
    "matrix_inverse_root",
    "matrix_power",
    "matrix_root",
    "newton_reference",
    "newton_reference_torch",
]

METHODS = ("auto", "eigh", "newton")
MATRIX_DTYPES = ("float32", "float64")
KRON_DTYPES = ("float16", "bfloat16", "float32", "float64")

# method="auto" on a GPU: the eigendecomposition route up to this size, the Newton iteration above.
# CuPy's batched Jacobi solver is at its best for small blocks: 3x the fused Newton kernel at
# 4096 x 16 x 16 (float32, H100, benchmarks/NOTES.md), which is already ahead at 1024 x 32 x 32
# (1.1x) and from there on (2-4x at n = 100-128).
EIGH_MAX_N = 16

POWER_ITERS = 8  # power iterations for the ridge's lambda_max (linalg.cu's POWER_ITERS)
_NEWTON_PARTS = 6  # partial sums per row chunk (linalg.cu's NEWTON_PARTS)
_CHUNK_THREADS = 256  # block of linalg.cu's row-chunk kernels
_KRON_DIMS = 4  # Kronecker dimensions the kron kernel decodes (more: the broadcasting fallback)
_BLOCK = 256
_INT32_MAX = 2**31 - 1

# newton_fused<T, NMAX> (linalg.cu): the tile sizes NMAX (the largest n each takes) per dtype,
# smallest first. The largest are the largest multiples of the tile's 16-byte column groups whose
# three padded buffers fit in 227 KiB (H100, H200); a device with less opt-in shared memory gets
# the tiles that fit on it, or the GEMM path.
_FUSED_TILES = {"float32": (64, 128), "float64": (32, 64, 96)}
_FUSED_THREADS = 256  # linalg.cu's FUSED_THREADS
# False: every Newton route runs on batched GEMMs (tests and benchmarks compare the two paths).
_FUSED_NEWTON = True


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in KRON_DTYPES:
        dt = DTYPES[name]
        exprs = [f"kron_kernel<{dt.ctype}, {v}>" for v in sorted({16 // dt.itemsize, 1})]
        if name in MATRIX_DTYPES:
            exprs += [f"{k}<{dt.ctype}>" for k in ("newton_power", "newton_start", "newton_resid", "newton_step",
                                                    "newton_finish", "eig_scale", "add_diag")]
            exprs += [f"newton_fused<{dt.ctype}, {t}>" for t in _FUSED_TILES[name]]
        groups[name] = exprs
    return groups


KERNELS = KernelModule(
    "linalg.cu",
    instantiations=_instantiations(),
    signatures={
        "newton_power": "ptr ptr ptr i64 i64 i64",
        "newton_start": "ptr ptr ptr ptr ptr ptr i64 i64 f64 i64 i64",
        "newton_resid": "ptr ptr ptr ptr i64 i64",
        "newton_step": "ptr ptr ptr ptr i64 i64 f64 i64",
        "newton_finish": "ptr ptr ptr i64 f64",
        "newton_fused": "ptr ptr ptr ptr i64 i64 i64 f64",
        "eig_scale": "ptr ptr ptr ptr i64 i64 f64 f64",
        "add_diag": "ptr ptr i64 i64",
        "kron_kernel": "ptr ptr ptr " + " ".join(["i64"] * 9),
    },
)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


def _as_array(fn: str, name: str, x: Any, like: Any = None) -> Any:
    return x if is_array(x) else as_array(x, fn, name, like)


def _square(fn: str, name: str, a: Any, dtypes: tuple[str, ...] = MATRIX_DTYPES) -> tuple[str, DType]:
    """(array kind, dtype) of a stack of square matrices (..., n, n); TypeError/ValueError naming fn."""
    kind = array_kind(a)
    dn = dtype_name(a, kind)
    if dn not in dtypes:
        raise TypeError(f"{fn}: {name} must have dtype {' or '.join(dtypes)}; got {dn}")
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"{fn}: {name} must be a stack of square matrices (..., n, n); got shape {tuple(a.shape)}")
    return kind, DTYPES[dn]


def _int_arg(fn: str, name: str, v: Any, lo: int) -> int:
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be an integer; got {type_name(v)}")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an integer; got {type_name(v)}") from None
    if i < lo:
        raise ValueError(f"{fn}: {name} must be an integer >= {lo}; got {i}")
    return i


def _float_arg(fn: str, name: str, v: Any, lo: float = 0.0) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a real number; got {type_name(v)}")
    f = float(v)
    if not (f >= lo and math.isfinite(f)):
        raise ValueError(f"{fn}: {name} must be a finite number >= {lo}; got {v}")
    return f


def _method(fn: str, method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"{fn}: method must be one of {', '.join(repr(m) for m in METHODS)}; got {method!r}")
    return method


def choose_method(n: int, batch: int, dtype: str, device: int | None) -> str:
    """The route ``method="auto"`` takes for ``batch`` matrices of size n x n: "eigh" or "newton".

    On the CPU always "eigh" (LAPACK is exact and beats GEMM iterations there). On a GPU "eigh" for
    n <= EIGH_MAX_N (CuPy's batched Jacobi eigensolver), else "newton" (its batched GEMMs win from
    there on at every batch size in the issue's table, and up to n = 128 its fused kernel, which
    also stops each matrix at its own convergence, is faster still). batch and dtype are accepted
    for thresholds still to be measured; they do not change the answer today."""
    del batch, dtype
    if device is None:
        return "eigh"
    return "eigh" if n <= EIGH_MAX_N else "newton"


def default_tol(dtype: str, n: int) -> float:
    """The Newton route's convergence threshold on max |M - I|: a few hundred units in the last place
    of the dtype, growing like sqrt(n) with the rounding of an n-term dot product."""
    ulp = float(np.finfo(np.float32 if dtype == "float32" else np.float64).eps)
    return 100.0 * ulp * math.sqrt(max(n, 1))


def default_max_iters(dtype: str) -> int:
    """Newton steps when max_iters is None: enough for condition numbers up to ~1e7 at p <= 4."""
    return 30 if dtype == "float64" else 25


# ---------------------------------------------------------------------------------------------
# Array helpers (the caller's library allocates)
# ---------------------------------------------------------------------------------------------


def _ptr(a: Any) -> int:
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def _empty(shape: tuple[int, ...], like: Any, kind: str, dtype: str | None = None) -> Any:
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype) if dtype else like.dtype, device=like.device)
    import cupy

    with like.device:
        return cupy.empty(shape, dtype=dtype or like.dtype)


def _mT(a: Any) -> Any:
    return a.mT if hasattr(a, "mT") else a.swapaxes(-1, -2)


def _eye(nb: int, n: int, like: Any, kind: str) -> Any:
    """nb identity matrices (nb, n, n), a fresh array of like's library, dtype and device."""
    if kind == "torch":
        import torch

        return torch.eye(n, dtype=like.dtype, device=like.device).expand(nb, n, n).clone()
    import cupy

    with like.device:
        return cupy.broadcast_to(cupy.eye(n, dtype=like.dtype), (nb, n, n)).copy()


def _key(tag: str, a: Any, *extra: Any) -> tuple:
    if hasattr(a, "data_ptr"):
        return (tag, a.shape, a.stride(), a.dtype, a.get_device(), *extra)
    return (tag, a.shape, a.strides, a.dtype, a.device.id, *extra)


def _chunk_rows(n: int) -> int:
    """Rows per block of linalg.cu's row-chunk kernels: about 16K elements each (a few large
    matrices still fill the GPU; small ones take one block), at most 1024 chunks per matrix (a
    block reduces a matrix's partials in one pass)."""
    return max(-(-n // 1024), 16384 // max(n, 1), 1)


def _gemm(a: Any, b: Any, out: Any, precision: str, sym: bool = False) -> None:
    """out = a @ b, batched. sym: b is symmetric (every right operand of the Newton iteration is a
    polynomial in A), so b^T may stand for b: tf32 products then read b as a K-major operand,
    which Hopper's TMA + wgmma kernel takes (its tf32 form has no transposed operands)."""
    from cukit.ops.matmul import gemm

    gemm(a, _mT(b) if sym and precision == "tf32" else b, out, precision=precision)


def _apply_power(t: Any, p: int, m: Any, m_free: Any, bases: list[Any], precision: str,
                 sym: bool = False) -> tuple[Any, Any]:
    """T^p M by binary powering on batched GEMMs: (result, the free buffer of the result's pair).
    Results ping-pong between m and m_free, the squares T^2, T^4, ... between the buffers of bases
    (floor(log2 p) squarings: len(bases) >= min(2, that)). sym: T and M are symmetric (_gemm)."""
    res, free = m, m_free
    base, e, k = t, p, 0
    while True:
        if e & 1:
            _gemm(base, res, free, precision, sym)
            res, free = free, res
        e >>= 1
        if not e:
            return res, free
        nxt = bases[k % 2]
        _gemm(base, base, nxt, precision, sym)
        base, k = nxt, k + 1


def _n_bases(p: int) -> int:
    return min(2, max(p.bit_length() - 1, 0))


# ---------------------------------------------------------------------------------------------
# matrix_inverse_root / matrix_root
# ---------------------------------------------------------------------------------------------


def matrix_inverse_root(
    A: Any,
    p: int,
    *,
    eps: float = 1e-6,
    method: str = "auto",
    max_iters: int | None = None,
    tol: float | None = None,
    return_info: bool = False,
    precision: str = "ieee",
) -> Any:
    """Inverse p-th root of symmetric PSD matrices: ``X = (A + r I)^(-1/p)``, ``r = eps * lambda_max(A)``.

    Args:
        A: (..., n, n) float32 or float64 NumPy, CuPy or torch (CPU or CUDA) array of symmetric
            positive semi-definite matrices, batched over the leading dimensions (any strides; a
            non-contiguous A is copied). Array-likes become NumPy arrays.
        p: the root, an integer >= 1 (Shampoo: 2 or 4).
        eps: the ridge relative to each matrix's largest eigenvalue (scale-free damping for rank
            deficiency). The eigh route uses the exact lambda_max and treats eigenvalues below 0
            (round-off) as 0; the Newton route estimates lambda_max by 8 power iterations (a
            lower bound), so the two routes' ridges differ by eps times that estimate's error.
        method: "auto" (:func:`choose_method`), "eigh" or "newton" (see the module docstring).
        max_iters: the most Newton steps (default :func:`default_max_iters`). No host
            synchronisation: the fused kernel stops each matrix once it converged or failed; the
            GEMM path runs every step, converged matrices frozen (the same X either way).
        tol: a matrix has converged when max |M - I| <= tol (M = X^p (A + r I), tested before
            each step's update of X; info tests the M the last step used); default
            :func:`default_tol`.
        return_info: also return ``info``, an int32 array of the batch shape in A's library and
            device (never read on the host here): 0 ok, 1 not converged within max_iters (Newton),
            2 failed (a zero or non-finite matrix; a singular one with eps == 0 on the eigh route).
            Failed matrices hold NaN or inf.
        precision: the GEMMs' precision on CUDA, "ieee" or "tf32" (float32 only; see cukit.matmul).
            With "tf32" a converged matrix is no longer frozen bitwise: each remaining step's X T
            (T = I) rounds X's inputs to TF32's 10-bit mantissa again.

    Returns:
        X, of A's shape, dtype and library (device, and torch's current stream for CUDA tensors);
        or (X, info).

    See also: ``scipy.linalg.fractional_matrix_power``, Distributed Shampoo's
    ``matrix_inverse_root``, ``torch.linalg.eigh``.
    """
    fn = "cukit.linalg.matrix_inverse_root"
    return _root(fn, A, p, -1, eps, method, max_iters, tol, return_info, precision)


def matrix_root(
    A: Any,
    p: int,
    *,
    eps: float = 0.0,
    method: str = "auto",
    max_iters: int | None = None,
    tol: float | None = None,
    return_info: bool = False,
    precision: str = "ieee",
) -> Any:
    """p-th root of symmetric PSD matrices: ``Y = (A + r I)^(1/p)``, ``r = eps * lambda_max(A)``.

    As :func:`matrix_inverse_root` (arguments, routes, info). The Newton route computes
    ``Y = X^(p-1) (A + r I)`` from the inverse root X (p - 1 more GEMMs at most); it needs a
    nonsingular A + r I (eps > 0 for a singular A), the eigh route does not.

    See also: ``scipy.linalg.fractional_matrix_power``, ``scipy.linalg.sqrtm``.
    """
    fn = "cukit.linalg.matrix_root"
    return _root(fn, A, p, 1, eps, method, max_iters, tol, return_info, precision)


def _root(fn: str, A: Any, p: Any, sign: int, eps: Any, method: Any, max_iters: Any, tol: Any,
          return_info: bool, precision: str) -> Any:
    A = _as_array(fn, "A", A)
    kind, dt = _square(fn, "A", A)
    p = _int_arg(fn, "p", p, 1)
    eps = _float_arg(fn, "eps", eps)
    method = _method(fn, method)
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"{fn}: precision must be 'ieee' or 'tf32'; got {precision!r}")
    n = int(A.shape[-1])
    batch = tuple(int(s) for s in A.shape[:-2])
    nb = math.prod(batch)
    device = device_of(A)
    iters = default_max_iters(dt.name) if max_iters is None else _int_arg(fn, "max_iters", max_iters, 0)
    tol = default_tol(dt.name, n) if tol is None else _float_arg(fn, "tol", tol)
    route = choose_method(n, nb, dt.name, device) if method == "auto" else method
    if device is None:
        x, info = _root_host(A, kind, p, sign, eps, route, iters, tol)
    elif nb == 0 or n == 0:
        x, info = _empty(tuple(A.shape), A, kind), _empty(batch, A, kind, "int32")
        if nb:
            info[...] = 0
    else:
        a3 = contiguous(A, kind).reshape(nb, n, n)
        if route == "eigh":
            x, info = _eigh_root_gpu(a3, kind, device, dt, sign / p, eps)
        else:
            x, info = _newton_gpu(a3, kind, device, dt, p, eps, iters, tol, precision, sign > 0)
        x, info = x.reshape(A.shape), info.reshape(batch)
    return (x, info) if return_info else x


def _root_host(A: Any, kind: str, p: int, sign: int, eps: float, route: str, iters: int, tol: float) -> Any:
    a = A.detach().resolve_conj().numpy() if kind == "torch" else A
    batch, n = a.shape[:-2], a.shape[-1]
    a3 = np.ascontiguousarray(a).reshape(-1, n, n)
    if route == "eigh":
        x, info = eigh_root_reference(a3, sign / p, eps)
    else:
        x, info = newton_reference(a3, p, eps, iters, tol, root=sign > 0)
    x, info = x.reshape(a.shape), info.reshape(batch)
    if kind == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(info))
    return x, info


class _NewtonPlan:
    """The launches of one Newton signature: the start (POWER_ITERS newton_power passes, then
    newton_start), then fused (newton_fused) or resid, step and finish (the GEMM path)."""

    __slots__ = ("add_diag", "chunks", "finish", "fused", "power", "resid", "start", "step")

    def __init__(self, power: list[Any], start: Any, add_diag: Any, chunks: int, *, fused: Any = None,
                 resid: Any = None, step: Any = None, finish: Any = None) -> None:
        self.power, self.start, self.add_diag, self.chunks = power, start, add_diag, chunks
        self.fused, self.resid, self.step, self.finish = fused, resid, step, finish

    def init(self, a: int, x: int, m: int, state: int, work: int, part: int, stream: Any) -> None:
        """X_0, M_0, the state and the ridge (work[:, 2 n]) of every matrix."""
        for run in self.power:
            run((a, work, part), stream)
        self.start((a, x, m, state, work, part), stream)


def _fused_smem(nmax: int, itemsize: int) -> int:
    """Dynamic shared memory of newton_fused<T, nmax>: X, M, T with rows padded by 16 bytes."""
    return 3 * nmax * (nmax + 16 // itemsize) * itemsize


def _smem_optin(device: int) -> int:
    """Shared memory one block may opt in to on a device (0 where it cannot be read)."""
    try:
        from cukit._device import device_caps

        return device_caps(device).smem_optin
    except Exception:  # no CuPy / no such device
        return 0


def _fused_tile(n: int, dt: DType, device: int) -> int:
    """The smallest newton_fused tile that takes n x n matrices of dt and fits the device's shared
    memory (with the kernel's static reduction scratch, 32 accumulators), or 0: the GEMM path."""
    optin = _smem_optin(device)
    for t in _FUSED_TILES.get(dt.name, ()):
        if n <= t and _fused_smem(t, dt.itemsize) + 32 * dt.itemsize <= optin:
            return t
    return 0


_NEWTON_PLANS = PlanCache("linalg_newton", maxsize=256)
_EIG_PLANS = PlanCache("linalg_eig_scale", maxsize=256)
_KRON_PLANS = PlanCache("linalg_kron", maxsize=1024)


def _newton_gpu(a: Any, kind: str, device: int, dt: DType, p: int, eps: float, iters: int, tol: float,
                precision: str, root: bool) -> tuple[Any, Any]:
    """X = (A + r I)^(-1/p) (root: (A + r I)^(1/p)) and info for contiguous (B, n, n) CUDA arrays:
    on the current stream, no host sync: newton_power and newton_start, then either newton_fused
    (the whole loop, one block per matrix) or per step newton_resid, newton_step, X T and (but in
    the last step, whose M would only be tested) T^p M by binary powering, then newton_resid and
    newton_finish."""
    nb, n = int(a.shape[0]), int(a.shape[1])
    key = _key("newton", a, p, eps, tol, iters, precision, _FUSED_NEWTON)
    plan = _NEWTON_PLANS.get(key)
    if plan is None:
        c = dt.ctype
        rows = _chunk_rows(n)
        chunks = -(-n // rows)
        grid, th = (nb * chunks,), (_CHUNK_THREADS,)
        power = [KERNELS.prepare(f"newton_power<{c}>", grid, th, (n, rows, it), device=device)
                 for it in range(POWER_ITERS)]
        start = KERNELS.prepare(f"newton_start<{c}>", grid, th, (n, p, eps, rows, POWER_ITERS), device=device)
        add_diag = KERNELS.prepare(f"add_diag<{c}>", (max(1, min(-(-nb * n // _BLOCK), 65535)),), (_BLOCK,),
                                   (nb, n), device=device)
        tile = _fused_tile(n, dt, device) if _FUSED_NEWTON and precision == "ieee" else 0
        if tile:
            plan = _NewtonPlan(power, start, add_diag, chunks, fused=KERNELS.prepare(
                f"newton_fused<{c}, {tile}>", (nb,), (_FUSED_THREADS,), (n, p, iters, tol), device=device,
                shared_mem=_fused_smem(tile, dt.itemsize)))
        else:
            plan = _NewtonPlan(
                power, start, add_diag, chunks,
                resid=KERNELS.prepare(f"newton_resid<{c}>", grid, th, (n, rows), device=device),
                step=KERNELS.prepare(f"newton_step<{c}>", grid, th, (n, p, tol, rows), device=device),
                finish=KERNELS.prepare(f"newton_finish<{c}>", (nb,), th, (chunks, tol), device=device),
            )
        _NEWTON_PLANS.put(key, plan)
    stream = current_stream(device, kind == "torch")
    shape = (nb, n, n)
    acc = "float64" if dt.name == "float64" else "float32"
    small = _empty((nb, 2 * n + 1), a, kind, acc)  # power-iteration vectors, the ridge r
    part = _empty((_NEWTON_PARTS, nb, plan.chunks), a, kind, acc)  # the row chunks' partial sums
    state, info = _empty((nb,), a, kind, "int32"), _empty((nb,), a, kind, "int32")
    x = _empty(shape, a, kind)
    pa, ps, pw, pp = _ptr(a), _ptr(state), _ptr(small), _ptr(part)
    if plan.fused is not None:
        m = _empty(shape, a, kind)
        plan.init(pa, _ptr(x), _ptr(m), ps, pw, pp, stream)
        plan.fused((_ptr(x), _ptr(m), ps, _ptr(info)), stream)
        del m
        x_free = _empty(shape, a, kind) if root else None
        bases = [_empty(shape, a, kind) for _ in range(_n_bases(p - 1))] if root else []
    else:
        x_free = _empty(shape, a, kind)
        work = _empty((4 + _n_bases(p), nb, n, n), a, kind)  # M, its pair, T, the squares of T
        m, m_free, t, bases = work[0], work[1], work[2], [work[3 + i] for i in range(_n_bases(p))]
        plan.init(pa, _ptr(x), _ptr(m), ps, pw, pp, stream)
        for k in range(iters):
            plan.resid((_ptr(m), 0, ps, pp), stream)
            plan.step((_ptr(m), _ptr(t), ps, pp), stream)
            _gemm(x, t, x_free, precision, sym=True)
            x, x_free = x_free, x
            if k + 1 < iters:  # the last M would only be tested: finish tests the one the last step used
                m, m_free = _apply_power(t, p, m, m_free, bases, precision, sym=True)
        plan.resid((_ptr(m), _ptr(x), 0, pp), stream)
        plan.finish((pp, ps, _ptr(info)), stream)
    if not root:
        return x, info
    # Y = X^(p-1) (A + r I): the ridge r is the last column of `small`. Results in fresh
    # allocations only, so that Y does not keep the workspace alive.
    ar = _empty(shape, a, kind)
    ar[...] = a
    plan.add_diag((_ptr(ar), pw), stream)
    y, _ = _apply_power(x, p - 1, ar, x_free, bases, precision, sym=True)
    return y, info


def _eigh_root_gpu(a: Any, kind: str, device: int, dt: DType, expo: float, eps: float) -> tuple[Any, Any]:
    """(max(w, 0) + r)^expo applied through V for contiguous (B, n, n) CUDA arrays."""
    nb, n = int(a.shape[0]), int(a.shape[1])
    w, v = _eigh_gpu(a, kind, device)
    v = contiguous(v, kind)
    w = contiguous(w, kind)
    key = _key("eig", a, expo, eps)
    run = _EIG_PLANS.get(key)
    if run is None:
        total = nb * n * n
        blocks = max(1, min(-(-total // _BLOCK), 65535))
        run = KERNELS.prepare(f"eig_scale<{dt.ctype}>", (blocks,), (_BLOCK,), (nb, n, expo, eps), device=device)
        _EIG_PLANS.put(key, run)
    s = _empty((nb, n, n), a, kind)
    info = _empty((nb,), a, kind, "int32")
    run((_ptr(v), _ptr(w), _ptr(s), _ptr(info)), current_stream(device, kind == "torch"))
    x = _empty((nb, n, n), a, kind)
    _gemm(s, _mT(v), x, "ieee")
    return x, info


# ---------------------------------------------------------------------------------------------
# eigh
# ---------------------------------------------------------------------------------------------


def eigh(A: Any, UPLO: str = "L") -> tuple[Any, Any]:
    """Eigendecomposition of symmetric matrices, batched: ``A = V diag(w) V^T``, w ascending.

    Args:
        A: (..., n, n) float32 or float64 NumPy, CuPy or torch (CPU or CUDA) array; only the
            triangle UPLO ("L" or "U") is read. Array-likes become NumPy arrays.

    Returns:
        (w, V): w (..., n) and V (..., n, n) with orthonormal columns, in A's library, dtype and
        device. CUDA: CuPy's batched solver (``cupy.linalg.eigh``, syevj for stacks), on torch's
        current stream for torch tensors (through a zero-copy view; CuPy's pool holds the results'
        memory); no host synchronisation. CPU: ``numpy.linalg.eigh`` / ``torch.linalg.eigh``.

    See also: ``numpy.linalg.eigh``, ``torch.linalg.eigh``, ``cupy.linalg.eigh``.
    """
    fn = "cukit.linalg.eigh"
    A = _as_array(fn, "A", A)
    kind, _ = _square(fn, "A", A)
    if UPLO not in ("L", "U"):
        raise ValueError(f"{fn}: UPLO must be 'L' or 'U'; got {UPLO!r}")
    if kind == "numpy":
        return np.linalg.eigh(A, UPLO=UPLO)
    device = device_of(A)
    if device is None:
        import torch

        return torch.linalg.eigh(A, UPLO=UPLO)
    return _eigh_gpu(A, kind, device, UPLO)


def _eigh_gpu(a: Any, kind: str, device: int, UPLO: str = "L") -> tuple[Any, Any]:
    import cupy

    from cukit.interop import asarray, to_torch

    # The views are made inside the stream's scope: DLPack then orders them on that one stream.
    with cupy.cuda.Device(device), current_stream(device, kind == "torch"):
        ca = asarray(a) if kind == "torch" else a
        if ca.size == 0:
            w, v = cupy.empty(ca.shape[:-1], ca.dtype), cupy.empty(ca.shape, ca.dtype)
        else:
            w, v = cupy.linalg.eigh(ca, UPLO=UPLO)
        if kind == "torch":
            return to_torch(w), to_torch(v)
    return w, v


# ---------------------------------------------------------------------------------------------
# matrix_power
# ---------------------------------------------------------------------------------------------


def matrix_power(A: Any, k: int, *, precision: str = "ieee") -> Any:
    """Integer matrix power ``A^k`` (k >= 0) of square matrices, batched, by repeated squaring.

    Args:
        A: (..., n, n) float32 or float64 NumPy, CuPy or torch (CPU or CUDA) array (any square
            matrices, not only symmetric ones). Array-likes become NumPy arrays.
        k: an integer >= 0; A^0 is the identity. (Negative powers need an inverse: for a PSD A use
            ``matrix_inverse_root(A, 1)``, or ``matrix_inverse_root(A, p)`` and this for A^(-k/p).)
        precision: the GEMMs' precision on CUDA, "ieee" or "tf32".

    Returns:
        A^k in A's library, dtype and device. CUDA: floor(log2 k) + popcount(k) - 1 batched GEMMs.

    See also: ``numpy.linalg.matrix_power``, ``torch.linalg.matrix_power``.
    """
    fn = "cukit.linalg.matrix_power"
    A = _as_array(fn, "A", A)
    kind, _ = _square(fn, "A", A)
    k = _int_arg(fn, "k", k, 0)
    if precision not in ("ieee", "tf32"):
        raise ValueError(f"{fn}: precision must be 'ieee' or 'tf32'; got {precision!r}")
    if kind == "numpy":
        return np.linalg.matrix_power(A, k)
    device = device_of(A)
    if device is None:
        import torch

        return torch.linalg.matrix_power(A, k)
    n = int(A.shape[-1])
    nb = math.prod(A.shape[:-2])
    if nb == 0 or n == 0:
        return _empty(tuple(A.shape), A, kind)
    a = contiguous(A, kind).reshape(nb, n, n)
    if k == 0:
        return _eye(nb, n, A, kind).reshape(A.shape)
    # A^k = A^(k-1) applied to A: the squares of A in two buffers, results ping-pong
    res = _empty((nb, n, n), A, kind)
    res[...] = a
    free = _empty((nb, n, n), A, kind)
    bases = [_empty((nb, n, n), A, kind) for _ in range(_n_bases(k - 1))] if k > 1 else []
    if k > 1:
        res, _ = _apply_power(a, k - 1, res, free, bases, precision)
    return res.reshape(A.shape)


# ---------------------------------------------------------------------------------------------
# kron and kron_matvec
# ---------------------------------------------------------------------------------------------


def kron(a: Any, b: Any, *, batch_dims: int = 0) -> Any:
    """Kronecker product with ``numpy.kron`` semantics, optionally batched.

    ``out[..., i_0 q_0 + k_0, ..., i_d q_d + k_d] = a[..., i_0, ..., i_d] * b[..., k_0, ..., k_d]``.

    Args:
        a, b: NumPy, CuPy or torch (CPU or CUDA) arrays of one library, device and float dtype
            (float16, bfloat16, float32, float64 on CUDA; any dtype numpy.kron takes for NumPy).
            As in numpy.kron, the one with fewer (non-batch) dimensions gets leading 1s.
            Array-likes are converted like the other argument.
        batch_dims: how many leading dimensions are a batch (equal in a and b, not broadcast):
            ``kron(a, b, batch_dims=1)[z] == numpy.kron(a[z], b[z])``. 0: numpy.kron exactly.

    Returns:
        The product, shape ``batch + tuple(p_d * q_d)``, in the inputs' library and device. CUDA:
        one kernel for up to 4 Kronecker dimensions (16-byte stores when b's last dimension allows),
        a broadcasting product beyond.

    See also: ``numpy.kron``, ``torch.kron``.
    """
    fn = "cukit.linalg.kron"
    if not (is_array(a) and is_array(b)):
        like = a if is_array(a) else b if is_array(b) else None
        a, b = _as_array(fn, "a", a, like), _as_array(fn, "b", b, like)
    kind = array_kind(a)
    if array_kind(b) != kind:
        raise TypeError(f"{fn}: b must be the same array type as a ({array_class(kind)}); got {type_name(b)}")
    batch_dims = _int_arg(fn, "batch_dims", batch_dims, 0)
    if batch_dims > min(a.ndim, b.ndim) or tuple(a.shape[:batch_dims]) != tuple(b.shape[:batch_dims]):
        raise ValueError(
            f"{fn}: a and b must have the same {batch_dims} leading batch dimensions; got shapes "
            f"{tuple(a.shape)} and {tuple(b.shape)}"
        )
    if kind == "numpy" and batch_dims == 0:
        return np.kron(a, b)
    da, db = device_of(a), device_of(b)
    if da != db:
        raise ValueError(f"{fn}: a and b must be on the same device; got {_where(da)} and {_where(db)}")
    if da is None:
        return kron_reference(a, b, batch_dims)
    na, nbn = dtype_name(a, kind), dtype_name(b, kind)
    if na not in KRON_DTYPES or nbn != na:
        raise TypeError(
            f"{fn}: a and b on the GPU must have one dtype of {', '.join(KRON_DTYPES)} (no promotion); "
            f"got {na} and {nbn}"
        )
    return _kron_gpu(a, b, batch_dims, kind, da, DTYPES[na])


def _kron_shapes(a_shape: tuple[int, ...], b_shape: tuple[int, ...], batch_dims: int) -> tuple[tuple, tuple, tuple]:
    """(batch, a's Kronecker shape, b's Kronecker shape), the shorter padded with leading 1s."""
    batch = a_shape[:batch_dims]
    pa, qb = a_shape[batch_dims:], b_shape[batch_dims:]
    nd = max(len(pa), len(qb))
    return batch, (1,) * (nd - len(pa)) + pa, (1,) * (nd - len(qb)) + qb


def kron_reference(a: Any, b: Any, batch_dims: int = 0) -> Any:
    """kron by broadcasting (NumPy, torch, CuPy): the interleaved outer product reshaped; the
    CPU fallback for torch, the GPU fallback beyond 4 Kronecker dimensions, and the oracle."""
    batch, pa, qb = _kron_shapes(tuple(a.shape), tuple(b.shape), batch_dims)
    nd = len(pa)
    a_x = a.reshape(*batch, *[s for d in pa for s in (d, 1)])
    b_x = b.reshape(*batch, *[s for d in qb for s in (1, d)])
    out = a_x * b_x
    return out.reshape(*batch, *(pa[d] * qb[d] for d in range(nd)))


class _KronPlan:
    __slots__ = ("run", "shape")

    def __init__(self, shape: tuple[int, ...], run: Any) -> None:
        self.shape, self.run = shape, run


def _kron_gpu(a: Any, b: Any, batch_dims: int, kind: str, device: int, dt: DType) -> Any:
    key = (_key("kron", a, batch_dims), _key("kron_b", b), _ptr(a) & 15, _ptr(b) & 15)
    plan = _KRON_PLANS.get(key)
    if plan.__class__ is Densify:
        return _kron_gpu(*plan.apply((a, b)), batch_dims, kind, device, dt)
    if plan is not None and plan.run is not None:
        out = _empty(plan.shape, a, kind)
        plan.run((_ptr(a), _ptr(b), _ptr(out)), current_stream(device, kind == "torch"))
        return out
    batch, pa, qb = _kron_shapes(tuple(int(s) for s in a.shape), tuple(int(s) for s in b.shape), batch_dims)
    nd = len(pa)
    shape = (*batch, *(pa[d] * qb[d] for d in range(nd)))
    if nd > _KRON_DIMS or math.prod(shape) == 0 or (nd and pa[-1] * qb[-1] > _INT32_MAX):
        return kron_reference(contiguous(a, kind), contiguous(b, kind), batch_dims)
    dense = Densify.needed((a, b), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _KRON_PLANS.put(key, dense)
        return _kron_gpu(*dense.apply((a, b)), batch_dims, kind, device, dt)
    out = _empty(shape, a, kind)
    p4 = (1,) * (_KRON_DIMS - nd) + pa
    q4 = (1,) * (_KRON_DIMS - nd) + qb
    rows = math.prod(batch) * math.prod(p4[:-1]) * math.prod(q4[:-1])
    vec = 16 // dt.itemsize
    if q4[-1] % vec or any(_ptr(x) % 16 for x in (a, b, out)):
        vec = 1
    wv = p4[-1] * q4[-1] // vec
    bx = min(_BLOCK, 1 << max(wv - 1, 0).bit_length())
    by = _BLOCK // bx
    gx = max(1, min(-(-wv // bx), 65535))
    gy = max(1, min(-(-rows // by), 65535))
    run = KERNELS.prepare(f"kron_kernel<{dt.ctype}, {vec}>", (gx, gy), (bx, by), (rows, *p4, *q4), device=device)
    run((_ptr(a), _ptr(b), _ptr(out)), current_stream(device, kind == "torch"))
    _KRON_PLANS.put(key, _KronPlan(shape, run))
    return out


def kron_matvec(A: Any, B: Any, X: Any) -> Any:
    """Kronecker matrix-vector product without forming the Kronecker product: ``Y = A X B^T``.

    Row-major vec (NumPy's reshape): ``Y.reshape(..., m * p) == kron(A, B) @ X.reshape(..., n * q)``.
    Column-major vec (the maths' convention, vec stacking columns): ``(A ⊗ B) vec(Z) = vec(B Z A^T)``
    with ``Z = X^T`` (q, n); the two statements are the same product.

    Args:
        A: (..., m, n), B: (..., p, q), X: (..., n, q): NumPy, CuPy or torch (CPU or CUDA) arrays
            of one library and device; batch dimensions broadcast (cukit.matmul's rules), dtypes
            promote as in NumPy. Array-likes are converted like the first array argument.

    Returns:
        Y (..., m, p): two matmuls, in the cheaper order ((A X) B^T or A (X B^T)); B^T is read
        in place (a transposed view).

    See also: ``numpy.kron``, K-FAC's ``G^-1 dW A^-1`` (``kron_matvec(G_inv, A_inv, dW)``).
    """
    fn = "cukit.linalg.kron_matvec"
    if not all(is_array(x) for x in (A, B, X)):
        like = next((x for x in (A, B, X) if is_array(x)), None)
        A, B, X = (_as_array(fn, nm, x, like) for nm, x in (("A", A), ("B", B), ("X", X)))
    for nm, x in (("A", A), ("B", B), ("X", X)):
        if x.ndim < 2:
            raise ValueError(f"{fn}: {nm} must be at least 2-D (a matrix or a stack); got shape {tuple(x.shape)}")
    m, n = A.shape[-2:]
    p, q = B.shape[-2:]
    if tuple(X.shape[-2:]) != (n, q):
        raise ValueError(
            f"{fn}: X must be (..., n, q) = (..., {n}, {q}) for A (..., m, n) = {tuple(A.shape)} and B (..., p, q) "
            f"= {tuple(B.shape)}; got {tuple(X.shape)}"
        )
    from cukit.ops.matmul import matmul

    bt = _mT(B)
    if m * q * (n + p) <= n * p * (q + m):
        return matmul(matmul(A, X), bt)
    return matmul(A, matmul(X, bt))


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles (NumPy; torch CPU runs them on zero-copy views)
# ---------------------------------------------------------------------------------------------


def eigh_root_reference(a: np.ndarray, expo: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``V diag((max(w, 0) + r)^expo) V^T`` with r = eps * max(lambda_max, 0), and info (see
    linalg.cu's eig_scale), for a (B, n, n) NumPy array, in its dtype."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if a.shape[0] == 0 or a.shape[-1] == 0:
            return np.empty_like(a), np.zeros(a.shape[0], np.int32)
        finite = np.isfinite(a).all(axis=(-2, -1))
        w, v = np.linalg.eigh(np.where(finite[:, None, None], a, 0))
        w = np.where(finite[:, None], w, np.nan).astype(a.dtype)
        lmax = w[:, -1]
        r = a.dtype.type(eps) * np.maximum(lmax, 0)
        d = np.maximum(w, 0) + r[:, None]
        s = v * d[:, None, :] ** a.dtype.type(expo)
        x = np.matmul(s, v.swapaxes(-1, -2)).astype(a.dtype)
        bad = ~np.isfinite(lmax) | ((expo < 0) & ~(d[:, 0] > 0))
        return x, bad.astype(np.int32) * 2


def _power_start(n: int, dtype: Any) -> np.ndarray:
    j = np.arange(n)
    return (1 + 0.5 * ((j * 37) % 11) / 10).astype(dtype)


def _np_apply_power(t: np.ndarray, p: int, m: np.ndarray) -> np.ndarray:
    res, base, e = m, t, p
    while True:
        if e & 1:
            res = base @ res
        e >>= 1
        if not e:
            return res
        base = base @ base


def newton_reference(a: np.ndarray, p: int, eps: float, max_iters: int, tol: float, *,
                     root: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The coupled Newton route in NumPy, step for step as on the GPU (power iterations, ridge,
    scale, frozen matrices, info) for a (B, n, n) array, in its dtype; root=True gives
    (A + r I)^(1/p) = X^(p-1) (A + r I)."""
    dt = a.dtype.type
    nb, n = a.shape[0], a.shape[-1]
    if nb == 0 or n == 0:
        return np.empty_like(a), np.zeros(nb, np.int32)
    eye = np.eye(n, dtype=a.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ss = (a * a).sum(axis=(-2, -1))
        tr = np.trace(a, axis1=-2, axis2=-1)
        v = np.broadcast_to(_power_start(n, a.dtype), (nb, n)).copy()
        vv = (v * v).sum(-1)
        lam = np.zeros(nb, a.dtype)
        live = np.ones(nb, bool)
        for _ in range(POWER_ITERS):
            inv = dt(1) / np.sqrt(vv)
            y = np.matmul(a, v[..., None])[..., 0] * inv[:, None]
            lam = np.where(live, (v * y).sum(-1) * inv, lam)
            vv = np.where(live, (y * y).sum(-1), vv)
            v = np.where(live[:, None], y, v)
            live &= vv > 0
        r = dt(eps) * np.maximum(lam, 0)
        fro = np.sqrt(np.maximum(ss + dt(2) * r * tr + dt(n) * r * r, 0))
        ok = (fro > 0) & np.isfinite(fro)
        sc = np.where(ok, dt(p + 1) / (dt(2) * fro), 0).astype(a.dtype)
        xs = np.where(ok, sc ** (dt(1) / dt(p)), np.nan).astype(a.dtype)
        x = xs[:, None, None] * eye
        ar = a + r[:, None, None] * eye
        m = sc[:, None, None] * ar
        state = np.where(ok, 0, 2)
        a0, a1 = dt(p + 1) / dt(p), dt(-1) / dt(p)
        for k in range(max_iters):
            d = m - eye
            bad = ~np.isfinite(d).all(axis=(-2, -1))
            res = np.abs(np.where(np.isfinite(d), d, 0)).max(axis=(-2, -1))
            running = state == 0
            state = np.where(running & bad, 2, np.where(running & (res <= tol), 1, state))
            t = np.where((state == 0)[:, None, None], a1 * m + a0 * eye, eye).astype(a.dtype)
            x = x @ t
            if k + 1 < max_iters:
                m = _np_apply_power(t, p, m)
        d = m - eye
        bad = ~(np.isfinite(d).all(axis=(-2, -1)) & np.isfinite(x).all(axis=(-2, -1)))
        res = np.abs(np.where(np.isfinite(d), d, 0)).max(axis=(-2, -1))
        info = np.where((state == 2) | bad, 2, np.where((state == 1) | (res <= tol), 0, 1)).astype(np.int32)
        if root:
            x = _np_apply_power(x, p - 1, ar.astype(a.dtype))
    return x.astype(a.dtype), info


def newton_reference_torch(a: Any, p: int, eps: float, max_iters: int, tol: float) -> tuple[Any, Any]:
    """The coupled Newton route in torch ops (torch.bmm; CPU or CUDA), for (B, n, n) tensors: the
    benchmark's "torch loop" baseline and a GPU oracle. Same maths as :func:`newton_reference`;
    it runs on torch's current stream with no host synchronisation."""
    import torch

    nb, n = a.shape[0], a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    ss = (a * a).sum(dim=(-2, -1))
    tr = a.diagonal(dim1=-2, dim2=-1).sum(-1)
    v = torch.as_tensor(_power_start(n, np.float64), dtype=a.dtype, device=a.device).expand(nb, n).clone()
    vv = (v * v).sum(-1)
    lam = torch.zeros(nb, dtype=a.dtype, device=a.device)
    live = torch.ones(nb, dtype=torch.bool, device=a.device)
    for _ in range(POWER_ITERS):
        inv = vv.rsqrt()
        y = torch.bmm(a, v[..., None])[..., 0] * inv[:, None]
        lam = torch.where(live, (v * y).sum(-1) * inv, lam)
        vv = torch.where(live, (y * y).sum(-1), vv)
        v = torch.where(live[:, None], y, v)
        live = live & (vv > 0)
    r = eps * lam.clamp_min(0)
    fro = (ss + 2 * r * tr + n * r * r).clamp_min(0).sqrt()
    ok = (fro > 0) & fro.isfinite()
    sc = torch.where(ok, (p + 1) / (2 * fro), torch.zeros_like(fro))
    xs = torch.where(ok, sc ** (1.0 / p), torch.full_like(fro, float("nan")))
    x = xs[:, None, None] * eye
    m = sc[:, None, None] * (a + r[:, None, None] * eye)
    state = torch.where(ok, 0, 2).to(torch.int32)
    for k in range(max_iters):
        d = m - eye
        bad = ~d.isfinite().all(-1).all(-1)
        res = d.nan_to_num(0.0, 0.0, 0.0).abs().amax(dim=(-2, -1))
        running = state == 0
        state = torch.where(running & bad, 2, torch.where(running & (res <= tol), 1, state)).to(torch.int32)
        t = torch.where((state == 0)[:, None, None], m * (-1.0 / p) + eye * ((p + 1) / p), eye)
        x = torch.bmm(x, t)
        if k + 1 == max_iters:
            break
        res_m, base, e = m, t, p
        while True:
            if e & 1:
                res_m = torch.bmm(base, res_m)
            e >>= 1
            if not e:
                break
            base = torch.bmm(base, base)
        m = res_m
    d = m - eye
    bad = ~(d.isfinite().all(-1).all(-1) & x.isfinite().all(-1).all(-1))
    res = d.nan_to_num(0.0, 0.0, 0.0).abs().amax(dim=(-2, -1))
    info = torch.where((state == 2) | bad, 2, torch.where((state == 1) | (res <= tol), 0, 1)).to(torch.int32)
    return x, info

