"""Hypothesis strategies for fuzzing array kernels: shapes, dtypes, arrays and backends.

The strategies lean towards what breaks kernels: size-0 and size-1 dimensions, odd and prime
sides (tails of vectorised loops, partial warps and blocks), non-contiguous views whose base
pointer is misaligned, and values that are exactly representable in the storage dtype with
subnormals flushed to zero (CuPy compiles kernels with ``-ftz=true``).

Needs the ``hypothesis`` package (``pip install 'cukit[test]'``).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    from hypothesis import strategies as st
    from hypothesis.errors import InvalidArgument
    from hypothesis.extra import numpy as hnp
except ImportError as e:  # pragma: no cover - exercised only without hypothesis
    raise ImportError(
        "cukit.testing's strategies need the hypothesis package: pip install hypothesis "
        "(or pip install 'cukit[test]')"
    ) from e

from cukit.interop import DTYPES, as_dtype, numpy_dtype, torch_dtype

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "ODD_SIDES",
    "BackendUnavailableError",
    "arrays",
    "backend_dtypes",
    "backends",
    "dtypes",
    "shapes",
]

BACKENDS = ("numpy", "torch", "torch-cuda", "cupy")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Sides that break kernels: single, primes, and one either side of the widths kernels tile
# by (vector widths 2/4/8, a warp of 32, blocks of 128/256, ...). Drawn as often as the whole
# range [min_side, max_side] together.
ODD_SIDES = (1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 31, 32, 33, 63, 65, 123, 127, 129, 255, 257, 1023, 1025)

# (smallest normal, largest finite) per float dtype; bfloat16 without needing ml_dtypes.
_LIMITS: dict[str, tuple[float, float]] = {
    "float16": (float(np.finfo(np.float16).tiny), float(np.finfo(np.float16).max)),
    "bfloat16": (2.0**-126, float(np.array(0x7F7F0000, np.uint32).view(np.float32))),
    "float32": (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)),
    "float64": (float(np.finfo(np.float64).tiny), float(np.finfo(np.float64).max)),
}


class BackendUnavailableError(RuntimeError):
    """An array backend was asked for that this machine cannot provide (no torch, no GPU)."""


# ---------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------


def shapes(
    *,
    min_dims: int = 1,
    max_dims: int = 4,
    min_side: int = 0,
    max_side: int = 64,
    max_elements: int = 1 << 14,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes (tuples of ints) that include size 0, size 1 and odd sizes.

    Each side is drawn half the time from ``ODD_SIDES`` (1, primes such as 3, 5, 7, 13, 31, 123,
    and powers of two plus or minus one) and half the time from the whole range
    ``[min_side, max_side]``; when ``min_side`` is 0, about one shape in ten has a side of 0.
    The number of elements (the product of the sides) is at most ``max_elements``: a side that
    would overflow the budget is drawn smaller instead (so large sides go with few dimensions),
    and the order of the sides is shuffled.

    Args:
        min_dims, max_dims: number of dimensions, inclusive (0 gives the scalar shape ``()``).
        min_side, max_side: bounds on each side, inclusive; ``min_side=0`` allows empty arrays.
        max_elements: upper bound on the product of the sides.

    Shrinks towards fewer dimensions and smaller sides.
    """
    if not 0 <= min_dims <= max_dims <= 32:
        raise InvalidArgument(
            f"need 0 <= min_dims <= max_dims <= 32; got min_dims={min_dims}, max_dims={max_dims}"
        )
    if not 0 <= min_side <= max_side:
        raise InvalidArgument(f"need 0 <= min_side <= max_side; got min_side={min_side}, max_side={max_side}")
    if max_elements < 0 or min_side**min_dims > max_elements:
        raise InvalidArgument(
            f"max_elements={max_elements} is below the smallest allowed size min_side**min_dims={min_side**min_dims}"
        )
    if max_side == 0 or max_elements == 0:  # only empty shapes fit (min_side is 0 here)
        return st.integers(min_dims if max_elements else max(min_dims, 1), max_dims).map(lambda n: (0,) * n)
    low = max(min_side, 1)
    top = max_dims  # cap the dimension count so low**ndim fits the budget
    while top > min_dims and low**top > max_elements:
        top -= 1

    @st.composite
    def _shapes(draw: Any) -> tuple[int, ...]:
        ndim = draw(st.integers(min_dims, top))
        sides: list[int] = []
        used = 1  # product of the sides drawn so far
        for i in range(ndim):
            reserve = low ** (ndim - 1 - i)  # the sides still to come need at least this
            cap = min(max_side, max_elements // (used * reserve))
            odd = [s for s in ODD_SIDES if low <= s <= cap]
            side_st = st.integers(low, cap)
            side = draw(st.one_of(st.sampled_from(odd), side_st) if odd else side_st)
            sides.append(side)
            used *= side
        # About one shape in ten is empty: one side (chosen by Hypothesis) is 0.
        if min_side == 0 and ndim and draw(st.sampled_from((False,) * 9 + (True,))):
            sides[draw(st.integers(0, ndim - 1))] = 0
        return tuple(draw(st.permutations(sides)))

    return _shapes()


# ---------------------------------------------------------------------------------------------
# dtypes and backends
# ---------------------------------------------------------------------------------------------


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def backend_dtypes(backend: str | None, names: Sequence[str] = FLOAT_DTYPES) -> tuple[str, ...]:
    """The dtype names of ``names`` that arrays of ``backend`` can hold on this machine: bfloat16
    NumPy/CuPy arrays need ml_dtypes, torch tensors do not; ``backend=None`` means every backend."""
    names = tuple(as_dtype(n).name for n in names)  # TypeError for names outside the table
    if backend is not None:
        _check_backend_name(backend)
    if (backend is None or backend in ("numpy", "cupy")) and not _has_module("ml_dtypes"):
        names = tuple(n for n in names if n != "bfloat16")
    return names


def dtypes(names: Sequence[str] = FLOAT_DTYPES, *, backend: str | None = None) -> st.SearchStrategy[str]:
    """Dtype names (keys of ``cukit.interop.DTYPES``) drawn from ``names``.

    bfloat16 is left out where the backend cannot hold it: NumPy and CuPy arrays need the
    ml_dtypes package for bfloat16, torch does not. ``backend=None`` means "usable with every
    backend", so bfloat16 is left out whenever ml_dtypes is missing; pass ``backend="torch"``
    to keep it for torch tensors.
    """
    names = backend_dtypes(backend, names)
    if not names:
        raise InvalidArgument(f"no dtype left to draw for backend={backend!r} (bfloat16 needs ml_dtypes)")
    return st.sampled_from(names)


def _check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _backend_available(backend: str) -> bool:
    if backend == "numpy":
        return True
    if backend == "cupy":
        import cukit

        return cukit.is_available()
    if not _torch_importable():
        return False
    if backend == "torch":
        return True
    import torch

    return bool(torch.cuda.is_available())


def backends(gpu: bool | None = None) -> list[str]:
    """The array backends this machine can produce, in the order of ``BACKENDS``.

    "numpy" always; "torch" (CPU tensors) when torch imports; "torch-cuda" when
    ``torch.cuda.is_available()``; "cupy" when ``cukit.is_available()`` (CuPy sees a GPU).
    ``gpu=True`` keeps only the GPU backends, ``gpu=False`` only the host ones, ``None`` all.
    Use as ``st.sampled_from(backends())``.
    """
    wanted = [b for b in BACKENDS if gpu is None or (b in ("torch-cuda", "cupy")) == gpu]
    return [b for b in wanted if _backend_available(b)]


def _require_backend(backend: str) -> None:
    _check_backend_name(backend)
    if _backend_available(backend):
        return
    why = {
        "torch": "torch is not installed",
        "torch-cuda": "torch sees no CUDA device (torch.cuda.is_available() is False)",
        "cupy": "CuPy sees no CUDA device (cukit.is_available() is False)",
    }[backend]
    raise BackendUnavailableError(
        f"backend {backend!r} is not available on this machine: {why}; "
        f"cukit.testing.backends() lists the available ones: {backends()}"
    )


# ---------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------


def _round(v: np.ndarray, name: str) -> np.ndarray:
    """float64 values rounded (to nearest) to the nearest value representable in dtype `name`."""
    if name == "float64":
        return v.astype(np.float64)
    if name == "bfloat16":  # round-to-nearest-even on the top 16 bits of the float32 pattern
        bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return v.astype(name).astype(np.float64)


def _next(r: float, name: str, up: bool) -> float:
    """The neighbour of a representable value r in dtype `name`, towards +inf if up."""
    if name == "bfloat16":
        bits = int(np.array(r, np.float32).view(np.uint32))
        if r == 0:
            bits = 0x00010000 if up else 0x80010000
        else:
            bits += 0x10000 if (r > 0) == up else -0x10000
        return float(np.array(bits, np.uint32).view(np.float32))
    t = np.dtype(name).type
    return float(np.nextafter(t(r), t(np.inf if up else -np.inf)))


def _bounds(min_value: float, max_value: float, name: str) -> tuple[float, float]:
    """[min_value, max_value] shrunk to values representable in `name`, normal or zero."""
    tiny, big = _LIMITS[name]
    for label, v in (("min_value", min_value), ("max_value", max_value)):
        if not (math.isfinite(v) and abs(v) <= big):
            raise InvalidArgument(f"{label}={v!r} is not a finite {name} value (largest is {big:g})")
    if min_value > max_value:
        raise InvalidArgument(f"min_value={min_value!r} is greater than max_value={max_value!r}")
    lo = float(_round(np.array([min_value], np.float64), name)[0])
    if lo < min_value:
        lo = _next(lo, name, up=True)
    hi = float(_round(np.array([max_value], np.float64), name)[0])
    if hi > max_value:
        hi = _next(hi, name, up=False)
    # No subnormal bounds: move them inwards to zero or to the smallest normal.
    if 0 < lo < tiny:
        lo = tiny
    elif -tiny < lo < 0:
        lo = 0.0
    if 0 < hi < tiny:
        hi = 0.0
    elif -tiny < hi < 0:
        hi = -tiny
    if lo > hi:
        raise InvalidArgument(f"no normal (or zero) {name} value lies in [{min_value!r}, {max_value!r}]")
    return lo, hi


@st.composite
def _values(draw: Any, name: str, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    """float64 values of `shape` in [lo, hi], exactly representable in `name`, no subnormals.

    Hypothesis places its own elements (edge values: 0, bounds, ±1, ...) at positions it chooses;
    the rest is either one constant (easy to read when shrunk) or uniform noise from a seeded
    generator, so that large arrays are not mostly one value (which would hide indexing bugs).
    """
    elements = st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    chosen = draw(hnp.arrays(np.float64, shape, elements=elements, fill=st.just(np.nan)))
    if draw(st.sampled_from(("constant", "noise"))) == "constant":
        background = np.full(shape, draw(elements), np.float64)
    else:
        u = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random(shape)
        background = lo * (1.0 - u) + hi * u
    v = _round(np.where(np.isnan(chosen), background, chosen), name)
    v[np.abs(v) < _LIMITS[name][0]] = 0.0  # flush subnormals, as the GPU would
    return np.clip(v, lo, hi)


# ---------------------------------------------------------------------------------------------
# layouts (non-contiguous views)
# ---------------------------------------------------------------------------------------------

Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (memory order, steps, offsets)


def _view(buf: Any, shape: tuple[int, ...], layout: Layout, kind: str) -> Any:
    """The view of `shape` in a buffer laid out by `layout` (same code for NumPy, CuPy, torch)."""
    order, steps, offsets = layout
    axes = tuple(int(a) for a in np.argsort(order))  # view axis i is buffer axis axes[i]
    t = buf.permute(*axes) if kind == "torch" else buf.transpose(axes)
    return t[tuple(slice(o, o + n * s, s) for n, s, o in zip(shape, steps, offsets, strict=True))]


def _buffer_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    order, steps, offsets = layout
    padded = [o + n * s for n, s, o in zip(shape, steps, offsets, strict=True)]
    return tuple(padded[i] for i in order)


@st.composite
def _layouts(draw: Any, shape: tuple[int, ...]) -> Layout:
    """A memory order (permutation), a step per dimension and an element offset per dimension,
    such that the view is non-contiguous whenever it has two or more elements."""
    ndim = len(shape)
    order = tuple(draw(st.permutations(range(ndim))))
    steps = [draw(st.sampled_from((1, 2, 3))) for _ in range(ndim)]
    offsets = tuple(draw(st.integers(0, 1)) for _ in range(ndim))
    if math.prod(shape) >= 2:
        layout = (order, tuple(steps), offsets)
        probe = _view(np.empty(_buffer_shape(shape, layout), np.int8), shape, layout, "numpy")
        if probe.flags.c_contiguous:  # e.g. all steps 1 and the order moved only size-1 dims
            big = [i for i, n in enumerate(shape) if n > 1]
            steps[big[-1]] = 2
    return order, tuple(steps), offsets


# ---------------------------------------------------------------------------------------------
# arrays
# ---------------------------------------------------------------------------------------------


def _to_backend(host: np.ndarray, name: str, backend: str) -> Any:
    """A contiguous float32/float64 NumPy buffer converted to `backend` and dtype `name`."""
    if backend == "numpy":
        return host.astype(numpy_dtype(name))
    if backend in ("torch", "torch-cuda"):
        import torch

        device = "cuda" if backend == "torch-cuda" else "cpu"
        return torch.from_numpy(host).to(device=device, dtype=torch_dtype(name)).contiguous()
    import cupy

    h = host.astype(numpy_dtype(name))
    try:
        return cupy.asarray(h)
    except (TypeError, ValueError):  # a CuPy that does not know ml_dtypes' bfloat16: copy the bits
        return cupy.asarray(h.view(np.uint16)).view(h.dtype)


def arrays(
    backend: str | st.SearchStrategy[str],
    dtype: Any,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]],
    *,
    min_value: float = -4.0,
    max_value: float = 4.0,
    noncontiguous: bool | None = False,
) -> st.SearchStrategy[Any]:
    """Floating-point arrays of a given backend, dtype and shape, for feeding kernels.

    Args:
        backend: "numpy", "torch" (CPU tensor), "torch-cuda" (tensor on the current CUDA device)
            or "cupy" (array on the current device); or a strategy drawing one. A GPU backend
            without a GPU raises ``BackendUnavailableError`` (see ``backends()``).
        dtype: "float16", "bfloat16", "float32" or "float64" (or a NumPy / torch dtype, or a
            strategy such as ``dtypes()``). bfloat16 NumPy/CuPy arrays need ml_dtypes.
        shape: a tuple of ints, or a strategy such as ``shapes()``.
        min_value, max_value: bounds on the values, moved inwards to representable values.
        noncontiguous: False gives a C-contiguous array; True gives a non-contiguous view with
            the requested shape into a larger buffer (a permuted memory order, steps of 2 or 3,
            a base offset that misaligns the pointer; the padding holds NaN, so a kernel that
            reads outside the view shows NaN); None lets Hypothesis choose. Views with fewer
            than 2 elements are reported contiguous by every library whatever their strides.

    Values are generated as float64 NumPy values, rounded to ``dtype`` and then cast, so they are
    exactly representable: ``to_numpy(x)`` is exactly what a kernel reads. They are finite, in
    ``[min_value, max_value]``, and never subnormal (CuPy compiles with ``-ftz=true``); zero and
    the bounds are drawn often. A torch tensor does not require grad: call ``.requires_grad_()``.
    """
    if not isinstance(backend, st.SearchStrategy):
        _require_backend(backend)
    if not isinstance(dtype, st.SearchStrategy):  # fail at definition, not at the first draw
        _bounds(
            float(min_value),
            float(max_value),
            _check_dtype(dtype, backend if isinstance(backend, str) else None),
        )
    if noncontiguous not in (True, False, None):
        raise InvalidArgument(f"noncontiguous must be True, False or None; got {noncontiguous!r}")

    @st.composite
    def _arrays(draw: Any) -> Any:
        b = draw(backend) if isinstance(backend, st.SearchStrategy) else backend
        if isinstance(backend, st.SearchStrategy):
            _require_backend(b)
        d = draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
        name = _check_dtype(d, b)
        shp = tuple(int(n) for n in (draw(shape) if isinstance(shape, st.SearchStrategy) else shape))
        lo, hi = _bounds(float(min_value), float(max_value), name)
        values = draw(_values(name, shp, lo, hi))
        host_dtype = np.float64 if name == "float64" else np.float32  # holds `name` values exactly
        nc = draw(st.booleans()) if noncontiguous is None else noncontiguous
        if not nc:
            return _to_backend(values.astype(host_dtype), name, b)
        layout = draw(_layouts(shp))
        host = np.full(_buffer_shape(shp, layout), np.nan, host_dtype)
        _view(host, shp, layout, "numpy")[...] = values
        kind = "torch" if b.startswith("torch") else "numpy"
        return _view(_to_backend(host, name, b), shp, layout, kind)

    return _arrays()


def _check_dtype(dtype: Any, backend: str | None) -> str:
    d = as_dtype(dtype)
    if d.kind != "float":
        floats = [n for n, t in DTYPES.items() if t.kind == "float"]
        raise InvalidArgument(f"arrays() draws floating-point values; dtype must be one of {floats}, got {d}")
    if d.name == "bfloat16" and backend in ("numpy", "cupy"):
        numpy_dtype("bfloat16")  # TypeError with an install hint when ml_dtypes is missing
    return d.name
