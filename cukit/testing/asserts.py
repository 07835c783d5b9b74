"""Comparing a kernel's output with an oracle: per-dtype tolerances, ``assert_close`` with a
readable report of the worst element, and ``check_against_oracle`` that runs both sides.

Needs only NumPy (torch and CuPy arrays are accepted when those libraries are installed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cukit.interop import array_kind, as_dtype, device_of, dtype_name

__all__ = ["TOLERANCES", "assert_close", "check_against_oracle", "to_numpy", "tolerance"]

# (atol, rtol) per storage dtype. The model: the kernel computes in float32 (float64 for float64)
# from exactly representable inputs and rounds the result once to the storage dtype, which costs
# up to half an ulp: a relative error of u = 2**-p for p significand bits. rtol leaves room for that
# rounding plus a few float32 ulps of the maths before it (expf, erff, tanhf are 1-2 ulps); atol
# covers results near zero, where the float32 maths cancels (1 + erf(z) for z << 0) or the storage
# rounding is flushed (float16 subnormals are below 6.1e-5).
#   float16:  p = 11, u = 4.9e-4. rtol 1e-3 ~ 2u; atol 1e-3 ~ one float16 ulp at 1.0 (9.8e-4).
#   bfloat16: p = 8 (7 stored mantissa bits), u = 3.9e-3. rtol 1.6e-2 = 4u (torch.testing's bf16
#             default); atol 1e-2 ~ one bfloat16 ulp at 1.0 (7.8e-3).
#   float32:  p = 24, u = 6e-8. rtol 1.3e-6 ~ 20u (torch.testing's float32 default): a few ulps of
#             transcendental error, amplified a little by the function's condition; atol 1e-5.
#   float64:  p = 53, u = 1.1e-16, computed in float64. rtol 1e-9 is loose for float64 maths but
#             tight enough to fail a float64 kernel that secretly computes in float32 (error ~6e-8),
#             which torch.testing's (1e-7, 1e-7) would pass; atol 1e-10.
# These suit elementwise ops. A reduction over n terms accumulates error with n and with the sum of
# |terms| rather than |result|: pass atol/rtol scaled to it.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-3),
    "bfloat16": (1e-2, 1.6e-2),
    "float32": (1e-5, 1.3e-6),
    "float64": (1e-10, 1e-9),
}


def tolerance(dtype: Any) -> tuple[float, float]:
    """``(atol, rtol)`` for results stored in `dtype` (a name, NumPy dtype or torch.dtype).

    Floating dtypes look up ``TOLERANCES``; integer and boolean dtypes compare exactly, (0, 0).
    """
    try:
        d = as_dtype(dtype)
    except TypeError:
        if _numpy_kind(dtype) in ("i", "u", "b"):  # integer/bool dtypes outside cukit's table (uint8, ...)
            return (0.0, 0.0)
        raise
    if d.kind != "float":
        return (0.0, 0.0)
    return TOLERANCES[d.name]


def _numpy_kind(dtype: Any) -> str:
    for candidate in (dtype, str(dtype).removeprefix("torch.")):
        try:
            return np.dtype(candidate).kind
        except TypeError:
            continue
    return "?"


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy array with the values of `a`: a NumPy, CuPy or torch (CPU or CUDA) array, a Python or
    NumPy scalar, or a nested list. torch tensors are detached (``requires_grad`` is fine);
    bfloat16 becomes float32 (exact), so no ml_dtypes is needed to read it; GPU arrays are copied
    to the host (a sync). NumPy arrays are returned as they are (no copy).
    """
    if isinstance(a, np.ndarray):
        out = a
    else:
        try:
            kind = array_kind(a)
        except TypeError:
            kind = None
        if kind == "torch":
            import torch

            t = a.detach()
            if t.dtype == torch.bfloat16:  # NumPy has no bfloat16; float32 holds it exactly
                t = t.float()
            out = t.cpu().resolve_conj().resolve_neg().numpy()
        elif kind == "cupy":
            import cupy

            out = cupy.asnumpy(a)
        else:
            out = np.asarray(a)
    if out.dtype.name == "bfloat16":  # ml_dtypes.bfloat16, from NumPy or CuPy
        out = out.astype(np.float32)
    return out


def _dtype_name(x: Any) -> Any:
    """The dtype whose tolerance applies to x: its own dtype, float64 for a Python float."""
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int64"
    if isinstance(x, float):
        return "float64"
    return x.dtype


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(i)) for i in idx) + ("," if len(idx) == 1 else "") + ")"


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: Any = None,
    atol: float | None = None,
    rtol: float | None = None,
    equal_nan: bool = True,
    msg: str | None = None,
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise.

    Args:
        actual, expected: NumPy, CuPy or torch (CPU or CUDA, requiring grad or not) arrays of any
            dtype (bfloat16 included), Python or NumPy scalars; any mix. Shapes must be equal
            (no broadcasting). Both are compared in float64 on the host.
        dtype: the storage dtype whose ``TOLERANCES`` entry applies; defaults to actual's dtype
            (float64 for a Python float). Integer and boolean dtypes compare exactly.
        atol, rtol: override the table's values (each one separately).
        equal_nan: NaN in both at the same position counts as equal. A NaN on one side only, or
            infinities of different sign, always mismatch; equal infinities match.
        msg: a prefix for the failure message (e.g. which output of an op).

    Raises:
        AssertionError naming the number of mismatched elements and the worst one (index, actual,
        expected, absolute and relative error, and the error allowed there).
    """
    prefix = f"{msg}: " if msg else ""
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{prefix}shape mismatch: actual {a.shape} != expected {e.shape}")
    for name, x in (("actual", a), ("expected", e)):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"assert_close compares real numbers; {name} has dtype {x.dtype}")
    tol_dtype = _dtype_name(actual) if dtype is None else dtype
    d_atol, d_rtol = tolerance(tol_dtype)
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)

    a64, e64 = a.astype(np.float64), e.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a64 - e64)  # NaN for inf - inf
        allowed = atol + rtol * np.abs(e64)
        # infinities match only themselves (inf <= atol + rtol * inf would pass anything)
        close = (a64 == e64) | (np.isfinite(a64) & np.isfinite(e64) & (err <= allowed))
        if equal_nan:
            close |= np.isnan(a64) & np.isnan(e64)
    bad = ~close
    n_bad = int(bad.sum())
    if n_bad == 0:
        return

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        score = np.where(np.isnan(err), np.inf, err / allowed)  # > 1 where mismatched (inf: no slack)
        score = np.where(bad, np.nan_to_num(score, nan=np.inf), -1.0)
    flat = int(np.argmax(score))
    idx = np.unravel_index(flat, a.shape) if a.shape else ()
    av, ev = float(a64[idx]), float(e64[idx])
    abs_err = abs(av - ev) if not (math.isnan(av) or math.isnan(ev)) else math.nan
    rel_err = abs_err / abs(ev) if ev != 0 else math.inf if abs_err > 0 else 0.0
    n_nan = int((bad & (np.isnan(a64) | np.isnan(e64))).sum())
    n_inf = int((bad & (np.isinf(a64) | np.isinf(e64))).sum())
    finite_err = np.where(np.isfinite(err), err, 0.0)
    lines = [
        f"{prefix}arrays not close: {n_bad} of {a.size} elements mismatch ({100.0 * n_bad / a.size:.3g}%)"
        f"{f', {n_nan} with NaN' if n_nan else ''}{f', {n_inf} with inf' if n_inf else ''}.",
        f"  tolerance: atol={atol:g}, rtol={rtol:g} (dtype {_name(tol_dtype)}); "
        "passes when |actual - expected| <= atol + rtol * |expected|",
        f"  worst at index {_fmt_index(tuple(idx))}: actual={av!r}, expected={ev!r}, "
        f"abs err={abs_err:.6g}, rel err={rel_err:.6g}, allowed abs err={float(allowed[idx]):.6g}",
        f"  largest finite abs err over all elements: {float(finite_err.max()):.6g}",
    ]
    if a.ndim:
        first = [_fmt_index(tuple(int(i) for i in t)) for t in np.argwhere(bad)[:5]]
        lines.append(f"  first mismatched indices: {', '.join(first)}{', ...' if n_bad > 5 else ''}")
    raise AssertionError("\n".join(lines))


def _name(dtype: Any) -> str:
    try:
        return as_dtype(dtype).name
    except TypeError:
        return str(dtype)


# ---------------------------------------------------------------------------------------------
# check_against_oracle
# ---------------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    try:
        array_kind(x)
    except TypeError:
        return False
    return True


def _first_array(tree: Any) -> Any:
    if _is_array(tree):
        return tree
    if isinstance(tree, (list, tuple)):
        items: Any = tree
    elif isinstance(tree, dict):
        items = tree.values()
    else:
        return None
    for item in items:
        found = _first_array(item)
        if found is not None:
            return found
    return None


def _host_copy(tree: Any) -> Any:
    """Arrays (also inside lists, tuples and dicts) as fresh NumPy arrays: floating ones in float64,
    others in their own dtype (integer indices stay integers). Everything else as it is."""
    if _is_array(tree):
        a = to_numpy(tree)
        return a.astype(np.float64) if a.dtype.kind == "f" else a.copy()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_copy(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _host_copy(v) for k, v in tree.items()}
    return tree


def _describe(x: Any) -> str:
    if not _is_array(x):
        return f"a {type(x).__module__}.{type(x).__qualname__}"
    kind = array_kind(x)
    cls = {"numpy": "numpy.ndarray", "cupy": "cupy.ndarray", "torch": "torch.Tensor"}[kind]
    if kind == "numpy":
        return f"a {cls}"
    dev = device_of(x)
    return f"a {cls} on {'the CPU' if dev is None else f'cuda:{dev}'}"


def _dtype_label(dtype: Any) -> str:
    """A dtype's name, given as a name, NumPy/CuPy dtype or torch.dtype (also outside cukit's table)."""
    try:
        return as_dtype(dtype).name
    except TypeError:
        pass
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).removeprefix("torch.")


def _inputs_float_dtype(tree: Any) -> str | None:
    """The floating dtype of the array inputs, promoted together (cukit.matmul's result_dtype:
    NumPy's promotion, bfloat16 as torch); None when no input array is floating."""
    names: list[str] = []

    def walk(t: Any) -> None:
        if _is_array(t):
            name = dtype_name(t)
            if name in ("float16", "bfloat16", "float32", "float64"):
                names.append(name)
        elif isinstance(t, (list, tuple)):
            for item in t:
                walk(item)
        elif isinstance(t, dict):
            for item in t.values():
                walk(item)

    walk(tree)
    if not names:
        return None
    from cukit.ops.matmul import result_dtype

    out = names[0]
    for name in names[1:]:
        out = result_dtype(out, name)
    return out


def _expected_dtype(out_dtype: Any, i: int, exp: np.ndarray, inputs_float: str | None) -> tuple[str, str]:
    """(the dtype output i must have, where that rule comes from): check_against_oracle's step 3."""
    if isinstance(out_dtype, (list, tuple)):
        if len(out_dtype) <= i:
            raise TypeError(f"check_against_oracle: out_dtype has {len(out_dtype)} entries; the op returned more outputs")
        given = out_dtype[i]
    else:
        given = out_dtype
    if given is not None:
        return _dtype_label(given), "out_dtype"
    if exp.dtype.kind == "f" and inputs_float is not None:
        return inputs_float, "the inputs' floating dtype"
    return exp.dtype.name, "the oracle's output dtype"


def check_against_oracle(
    op: Callable[..., Any],
    oracle: Callable[..., Any],
    *args: Any,
    dtype: Any = None,
    atol: float | None = None,
    rtol: float | None = None,
    out_dtype: Any = None,
    **kwargs: Any,
) -> Any:
    """Run ``op(*args, **kwargs)`` and check it against ``oracle`` on float64 NumPy copies.

    1. Every array in args and kwargs (also inside lists, tuples and dicts) is copied to NumPy with
       ``to_numpy``, floating ones in float64 (integer and boolean arrays keep their dtype), before
       the op runs, so an op that writes into its inputs does not change what the oracle sees.
    2. ``op`` runs on the arrays as given; ``oracle`` runs on the copies, with the same non-array
       arguments.
    3. Each output of ``op`` (one array, or a tuple/list of arrays matched to the oracle's tuple/list)
       must be of the array type (NumPy, CuPy, torch) and on the device of the first array argument;
       must have the expected dtype: ``out_dtype`` when given (one dtype for every output, or a
       list/tuple with one per output, None entries inferred), else inferred: where the oracle's
       output is floating, the floating array inputs' dtype promoted together (NumPy's promotion,
       bfloat16 as torch: float16 with bfloat16 gives float32), so a float16 op must return
       float16; where it is not (integer indices, bool masks), the oracle's own dtype; and must be
       close to the oracle's output by ``assert_close(out, expected, dtype=dtype, atol=atol,
       rtol=rtol)`` (the tolerance of each output's own dtype unless dtype is given).

    Returns op's result. Raises AssertionError on a wrong type, device, dtype, count or value.
    ``dtype``, ``atol``, ``rtol`` and ``out_dtype`` are consumed here: they are not passed on to op
    or oracle.

    See also: ``numpy.testing.assert_allclose``, ``torch.testing.assert_close``.
    """
    first = _first_array((args, kwargs))
    if first is None:
        raise TypeError("check_against_oracle needs at least one array argument (NumPy, CuPy or torch)")
    host_args, host_kwargs = _host_copy(args), _host_copy(kwargs)
    result = op(*args, **kwargs)
    expected = oracle(*host_args, **host_kwargs)

    many = isinstance(result, (tuple, list))
    if many != isinstance(expected, (tuple, list)):
        raise AssertionError(
            f"op returned {'a sequence' if many else 'one output'} but the oracle "
            f"{'a sequence' if isinstance(expected, (tuple, list)) else 'one output'}"
        )
    outs, exps = (list(result), list(expected)) if many else ([result], [expected])
    if len(outs) != len(exps):
        raise AssertionError(f"op returned {len(outs)} outputs, the oracle {len(exps)}")

    kind, device = array_kind(first), device_of(first)
    inputs_float = _inputs_float_dtype((args, kwargs))
    for i, (out, exp) in enumerate(zip(outs, exps, strict=True)):
        label = f"output {i} of {len(outs)}" if many else "output"
        if not _is_array(out) or array_kind(out) != kind or device_of(out) != device:
            raise AssertionError(
                f"{label}: op returned {_describe(out)} for {_describe(first)} input; "
                "outputs must have the input's array type and device"
            )
        want, source = _expected_dtype(out_dtype, i, to_numpy(exp), inputs_float)
        if dtype_name(out) != want:
            raise AssertionError(
                f"{label}: op returned dtype {dtype_name(out)}; expected {want} ({source}; pass "
                "out_dtype= to check_against_oracle if the op's output dtype differs by design)"
            )
        assert_close(out, exp, dtype=dtype, atol=atol, rtol=rtol, msg=label)
    return result
