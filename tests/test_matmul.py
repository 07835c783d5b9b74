"""matmul family front end: cukit.matmul (numpy.matmul semantics), linear, batch_matmul,
chunked_matmul, the precision setting, the Gemm built from arrays, the kernel heuristic, the torch
integration (autograd, opcheck, compile, CUDA graphs) and cukit.nn.Linear.

Oracle: float64 NumPy products of the exact input values. Error bound per element (Higham): a dot
product of K terms accumulated in a type with unit roundoff u_acc, in any order (blocked, FMA or
not), is within gamma_K * sum_k |a_k b_k| <= K * eps_acc * (|A| @ |B|) of the exact value (eps_acc
= 2 u_acc covers gamma_K's denominator and leaves room); the result is then rounded once to the
output dtype (u_out * |C|), and results below the output's smallest normal may be flushed (FTZ),
as may each product and partial sum below the accumulator's smallest normal (2 K tiny_acc).
16-bit inputs are exact in the fp32 accumulator, so only the accumulation and the output rounding
count. TF32 rounds both inputs to 10 explicit mantissa bits: each product is off by up to about
2 * 2**-11 relative (round to nearest; 2 * 2**-10 if truncated), so the bound gets 2**-9 * |A| @ |B|
more: a relative error ~1e-3 of the sum of |terms|, independent of K.
"""

from __future__ import annotations

import ctypes
import math
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import cukit
from cukit.interop import DTYPES
from cukit.ops import matmul as mm
from cukit.ops._gemm import EPI_ACCUMULATE, EPI_STORE, Gemm
from cukit.testing import arrays, assert_close, backend_dtypes, to_numpy, tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional

FLOATS = ["float16", "bfloat16", "float32", "float64"]
ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]

NUMPY_FLOATS = backend_dtypes("numpy", FLOATS)

# unit roundoff of the output rounding, the accumulation epsilon, the smallest normal
U_OUT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
EPS_ACC = {"float16": 2.0**-23, "bfloat16": 2.0**-23, "float32": 2.0**-23, "float64": 2.0**-52}
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}
TF32_REL = 2.0**-9


# ------------------------------------------------------------------------------------- oracles
def product_bound(a64: np.ndarray, b64: np.ndarray, dtype: str, precision: str = "ieee") -> tuple:
    """(exact product, allowed |error|) for a @ b stored in dtype (see the module docstring)."""
    ref = np.matmul(a64, b64)
    l1 = np.matmul(np.abs(a64), np.abs(b64))
    K = a64.shape[-1]
    rel = K * EPS_ACC[dtype] + (TF32_REL if precision == "tf32" and dtype == "float32" else 0.0)
    # underflow: each product and each partial sum may be flushed to zero (FTZ), off by < tiny_acc
    tiny_acc = TINY["float64" if dtype == "float64" else "float32"]
    bound = rel * (1 + U_OUT[dtype]) * l1 + U_OUT[dtype] * np.abs(ref) + TINY[dtype] + 2 * K * tiny_acc
    return ref, bound


def check_product(actual: Any, a: Any, b: Any, dtype: str, precision: str = "ieee") -> None:
    a64, b64 = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    ref, bound = product_bound(a64, b64, dtype, precision)
    got = to_numpy(actual).astype(np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err - bound, -np.inf))), got.shape) if got.ndim else ()
        raise AssertionError(
            f"{int(bad.sum())} of {got.size} elements off: at {i} got {got[i]!r}, exact {ref[i]!r}, "
            f"error {err[i]:.3g} > bound {bound[i]:.3g} (dtype {dtype}, K={a64.shape[-1]}, {precision})"
        )


def linear_oracle(x, w, b, activation):
    """torch.nn.functional in float64 (independent of cukit's references)."""
    xt = torch.from_numpy(to_numpy(x).astype(np.float64))
    wt = torch.from_numpy(to_numpy(w).astype(np.float64))
    bt = None if b is None else torch.from_numpy(to_numpy(b).astype(np.float64))
    z = F.linear(xt, wt, bt)
    fn = {
        None: lambda t: t,
        "relu": F.relu,
        "gelu": lambda t: F.gelu(t, approximate="none"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[activation]
    l1 = F.linear(xt.abs(), wt.abs(), None if bt is None else bt.abs())
    return fn(z).numpy(), l1.numpy()


def check_linear(y, x, w, b, activation, dtype: str, precision: str = "ieee") -> None:
    """|y - ref| <= the elementwise tolerance of dtype + 1.2 * (K eps_acc (+ tf32)) * (|x| @ |W|^T + |b|):
    the product's bound carried through an activation whose slope is at most 1.13 (gelu)."""
    ref, l1 = linear_oracle(x, w, b, activation)
    K = to_numpy(x).shape[-1]
    rel = (K + 1) * EPS_ACC[dtype] + (TF32_REL if precision == "tf32" and dtype == "float32" else 0.0)
    atol, rtol = tolerance(dtype)
    got = to_numpy(y).astype(np.float64)
    assert got.shape == ref.shape
    bound = atol + rtol * np.abs(ref) + 1.2 * rel * l1
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"linear off by {err.max():.3g} (bound there {bound.flat[np.argmax(err - bound)]:.3g})"


# ---------------------------------------------------------------------------------- strategies
SIDES = (0, 1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33)
LONG_K = (127, 257, 1000)


@st.composite
def problems(draw, *, long_k: bool = True, max_batch_dims: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(a's shape, b's shape) for matmul: sizes 0, 1, primes and odd, sometimes a long K, 1-D
    operands, batch dimensions that broadcast (1 against n, missing leading dimensions)."""
    side = st.sampled_from(SIDES)
    M, N = draw(side), draw(side)
    K = draw(st.one_of(side, st.sampled_from(LONG_K))) if long_k else draw(side)
    if K > 33:  # keep the work small: a long K with small M and N
        M, N = min(M, 5), min(N, 5)
    a_vec = draw(st.sampled_from([False] * 4 + [True]))
    b_vec = draw(st.sampled_from([False] * 4 + [True]))
    nb = draw(st.integers(0, max_batch_dims))
    batch = [draw(st.sampled_from((1, 2, 3))) for _ in range(nb)]
    if draw(st.sampled_from([False] * 9 + [True])) and batch:
        batch[draw(st.integers(0, nb - 1))] = 0

    def operand_batch() -> tuple[int, ...]:
        keep = draw(st.integers(0, nb))  # leading dimensions dropped, others maybe broadcast (1)
        return tuple(n if draw(st.booleans()) else 1 for n in batch[nb - keep :])

    a_shape = (K,) if a_vec else (*operand_batch(), M, K)
    b_shape = (K,) if b_vec else (*operand_batch(), K, N)
    return a_shape, b_shape


@st.composite
def operands(draw, backend: str, dtype: str, shape: tuple[int, ...], *, max_value: float = 4.0):
    """An operand of `shape`: contiguous, transposed (the transpose of a contiguous array: one
    unit stride, read in place) or strided (non-contiguous view, usually copied)."""
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"] if len(shape) >= 2 else ["contiguous", "strided"]))
    if layout == "transposed":
        x = draw(arrays(backend, dtype, (*shape[:-2], shape[-1], shape[-2]), min_value=-max_value, max_value=max_value))
        return x.transpose(-1, -2) if backend.startswith("torch") else x.swapaxes(-1, -2)
    return draw(arrays(backend, dtype, shape, noncontiguous=layout == "strided", min_value=-max_value, max_value=max_value))


def _dtype_str(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(problem=problems(), backend=st.sampled_from(["numpy", "torch"]), data=st.data())
def test_cpu_matmul_matches_oracle(problem, backend, data):
    dtype = data.draw(st.sampled_from(NUMPY_FLOATS if backend == "numpy" else FLOATS))
    sa, sb = problem
    a = data.draw(operands(backend, dtype, sa))
    b = data.draw(operands(backend, dtype, sb))
    expected_shape = np.matmul(np.zeros(sa), np.zeros(sb)).shape
    r = cukit.matmul(a, b)
    if backend == "torch":
        assert isinstance(r, torch.Tensor) and r.dtype == a.dtype and r.device == a.device
    else:
        r = np.asarray(r)
        assert r.dtype == a.dtype
    assert tuple(r.shape) == expected_shape
    check_product(r, a, b, dtype)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("da", "db"),
    [("float16", "float32"), ("float32", "float64"), ("float16", "float64"), ("int32", "float32"),
     ("int64", "float32"), ("int8", "float16"), ("int32", "int64"), ("bool", "bool"), ("float32", "float32")],
)
def test_result_dtype_is_numpys(backend, da, db):
    a = np.arange(6).reshape(2, 3).astype(da)
    b = (np.arange(12).reshape(3, 4) % 3).astype(db)
    expected = np.matmul(a, b)
    if backend == "torch":
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    r = cukit.matmul(a, b)
    assert _dtype_str(r) == expected.dtype.name == mm.result_dtype(da, db)
    assert np.array_equal(to_numpy(r), expected)


def test_result_dtype_bfloat16_like_torch():
    assert mm.result_dtype("bfloat16", "float16") == "float32"
    assert mm.result_dtype("bfloat16", "float32") == "float32"
    assert mm.result_dtype("bfloat16", "float64") == "float64"
    assert mm.result_dtype("bfloat16", "int8") == "bfloat16"
    assert mm.result_dtype("bfloat16", "bfloat16") == "bfloat16"
    a = torch.ones(2, 3, dtype=torch.bfloat16)
    b = torch.ones(3, 2, dtype=torch.float16)
    r = cukit.matmul(a, b)
    assert r.dtype == torch.float32 and torch.equal(r, torch.full((2, 2), 3.0))


BAD_SHAPES = [
    ((2, 3), (4, 5)), ((3,), (4,)), ((3,), (4, 5)), ((2, 3), (4,)), ((), (3,)), ((3,), ()),
    ((2, 3, 4), (3, 4, 5)), ((2, 3, 3, 4), (5, 4, 6)), ((2, 2, 3), (3, 5, 4)), ((0, 3), (4,)),
]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("sa", "sb"), BAD_SHAPES)
def test_errors_match_numpy(backend, sa, sb):
    with pytest.raises(ValueError) as expected:
        np.matmul(np.ones(sa), np.ones(sb))
    a, b = np.ones(sa), np.ones(sb)
    if backend == "torch":
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    with pytest.raises(ValueError) as got:
        cukit.matmul(a, b)
    # cukit's message names the function and the operand(s), then quotes NumPy's own
    msg = str(got.value)
    assert msg.startswith("cukit.matmul: ") and msg.endswith(f" (numpy.matmul raises: {expected.value})")
    bad = "a" if sa == () else "b"
    assert f" {bad} " in msg


def test_core_dimension_message_is_numpys_wording():
    msg = (r"^cukit\.matmul: the second-to-last dimension of b must equal the last dimension of a \(3\); got 4 "
           r"\(a\.shape=\(2, 3\), b\.shape=\(4, 5\)\) \(numpy\.matmul raises: "
           r"matmul: Input operand 1 has a mismatch in its core dimension 0, with gufunc signature "
           r"\(n\?,k\),\(k,m\?\)->\(n\?,m\?\) \(size 4 is different from 3\)\)$")
    with pytest.raises(ValueError, match=msg):
        cukit.matmul(torch.ones(2, 3), torch.ones(4, 5))


def test_mixed_types_and_devices_are_rejected():
    with pytest.raises(TypeError, match="same array type"):
        cukit.matmul(np.ones((2, 2)), torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"cukit\.matmul: a must be an array-like convertible to a numeric array; got set"):
        cukit.matmul({1.0}, np.ones((1, 1)))
    with pytest.raises(TypeError, match="real dtypes"):
        cukit.matmul(torch.ones(2, 2, dtype=torch.complex64), torch.ones(2, 2, dtype=torch.complex64))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("sa", "sb"), [((0, 3), (3, 4)), ((2, 0), (0, 4)), ((2, 3), (3, 0)), ((0, 2, 3), (3, 4)),
                                        ((2, 1, 0), (1, 0, 5)), ((0,), (0,)), ((1, 1), (1, 1)), ((1,), (1, 7))])
def test_size_zero_and_one(backend, sa, sb):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    expected = np.matmul(a, b)
    if backend == "torch":
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    r = cukit.matmul(a, b)
    assert tuple(np.shape(r)) == expected.shape
    assert_close(np.asarray(to_numpy(r)), expected)
    if 0 in sa[-1:]:  # K == 0: zeros
        assert not np.any(to_numpy(r))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_out_is_written_in_place_and_checked(backend):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    expected = a @ b
    out = np.full((2, 3, 5), np.nan, np.float32)
    mk = (lambda x: x) if backend == "numpy" else torch.from_numpy
    a, b, out = mk(a), mk(b), mk(out)
    r = cukit.matmul(a, b, out=out)
    assert r is out
    assert_close(out, expected)
    with pytest.raises(ValueError, match="shape"):
        cukit.matmul(a, b, out=mk(np.zeros((3, 5), np.float32)))
    with pytest.raises(TypeError, match="dtype"):
        cukit.matmul(a, b, out=mk(np.zeros((2, 3, 5), np.float64)))
    other = torch.zeros(2, 3, 5) if backend == "numpy" else np.zeros((2, 3, 5), np.float32)
    with pytest.raises(TypeError, match="same array type"):
        cukit.matmul(a, b, out=other)
    # a non-contiguous out is filled too
    big = mk(np.zeros((2, 3, 10), np.float32))
    view = big[..., ::2]
    assert cukit.matmul(a, b, out=view) is view
    assert_close(view, expected)


def test_out_with_autograd_raises_like_torch():
    a = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't support automatic differentiation"):
        cukit.matmul(a, torch.randn(3, 4), out=torch.empty(2, 4))
    with torch.no_grad():
        out = torch.empty(2, 4)
        assert cukit.matmul(a, torch.ones(3, 4), out=out) is out


def test_precision_setting():
    assert cukit.get_matmul_precision() == "ieee"
    try:
        cukit.set_matmul_precision("tf32")
        assert cukit.get_matmul_precision() == "tf32"
        a, b = np.random.default_rng(0).standard_normal((2, 5, 7)).astype(np.float32), np.ones((7, 3), np.float32)
        assert np.array_equal(cukit.matmul(a, b), np.matmul(a, b))  # no effect on CPU inputs
        assert np.array_equal(cukit.matmul(a, b, precision="ieee"), np.matmul(a, b))
        with pytest.raises(ValueError, match="precision must be one of"):
            cukit.set_matmul_precision("highest")
        assert cukit.get_matmul_precision() == "tf32"
    finally:
        cukit.set_matmul_precision("ieee")
    with pytest.raises(ValueError, match="precision must be one of"):
        cukit.matmul(np.ones((2, 2)), np.ones((2, 2)), precision="fp16")
    with pytest.raises(ValueError, match="precision must be one of"):
        cukit.linear(np.ones((2, 2)), np.ones((2, 2)), precision="TF32")


def test_batch_matmul_is_strict():
    a, b = np.ones((4, 2, 3), np.float32), np.ones((4, 3, 5), np.float32)
    assert_close(cukit.batch_matmul(a, b), np.full((4, 2, 5), 3.0))
    tb = cukit.batch_matmul(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(tb, torch.Tensor) and tb.shape == (4, 2, 5)
    with pytest.raises(ValueError, match="3-D"):
        cukit.batch_matmul(a[0], b[0])
    with pytest.raises(ValueError, match="3-D"):
        cukit.batch_matmul(a[None], b[None])
    with pytest.raises(ValueError, match="batch sizes differ"):
        cukit.batch_matmul(a[:1], b)  # matmul would broadcast this
    with pytest.raises(ValueError, match="K differs"):
        cukit.batch_matmul(a, np.ones((4, 2, 5), np.float32))


# -------------------------------------------------------------------------------------- linear
@given(
    lead=st.lists(st.sampled_from((0, 1, 2, 3, 5, 7)), min_size=0, max_size=2),
    in_f=st.sampled_from((0, 1, 3, 8, 17, 64)),
    out_f=st.sampled_from((1, 2, 5, 16, 33)),
    has_bias=st.booleans(),
    activation=st.sampled_from(ACTS),
    backend=st.sampled_from(["numpy", "torch"]),
    data=st.data(),
)
def test_cpu_linear_matches_functional(lead, in_f, out_f, has_bias, activation, backend, data):
    dtype = data.draw(st.sampled_from(NUMPY_FLOATS if backend == "numpy" else FLOATS))
    x = data.draw(operands(backend, dtype, (*lead, in_f)))
    w = data.draw(operands(backend, dtype, (out_f, in_f), max_value=1.0))
    b = data.draw(arrays(backend, dtype, (out_f,))) if has_bias else None
    y = cukit.linear(x, w, b, activation)
    assert type(y) is type(x) and _dtype_str(y) == dtype and tuple(y.shape) == (*lead, out_f)
    check_linear(y, x, w, b, activation, dtype)


def test_linear_bad_input():
    x, w, b = np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="activation must be one of"):
        cukit.linear(x, w, b, "tanh")
    with pytest.raises(ValueError, match="in_features"):
        cukit.linear(x, np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        cukit.linear(x, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        cukit.linear(x, w, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        cukit.linear(x, w.astype(np.float64))
    with pytest.raises(TypeError, match=r"cukit\.linear: x must have dtype float16, bfloat16, float32 or float64"):
        cukit.linear(x.astype(np.int32), w.astype(np.int32))
    with pytest.raises(TypeError, match="same array type"):
        cukit.linear(x, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="at least one dimension"):
        cukit.linear(np.zeros((), np.float32), np.zeros((4, 0), np.float32))


# ----------------------------------------------------------------------------------- nn.Linear
@pytest.mark.parametrize("bias", [True, False])
def test_nn_linear_is_a_drop_in(bias):
    torch.manual_seed(5)
    ref = torch.nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    torch.manual_seed(5)
    ours = cukit.nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    assert isinstance(ours, torch.nn.Linear)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():  # same init (reset_parameters) from the same seed
        assert torch.equal(ours.state_dict()[k], v), k
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    assert_close(y2, y1)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert_close(x2.grad, x1.grad)
    assert_close(ours.weight.grad, ref.weight.grad)
    if bias:
        assert_close(ours.bias.grad, ref.bias.grad)
    # state_dict both ways
    fresh = cukit.nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    fresh.load_state_dict(ref.state_dict())
    assert_close(fresh(x), ref(x))
    back = torch.nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    back.load_state_dict(ours.state_dict())
    assert_close(back(x), ours(x))


@pytest.mark.parametrize("activation", ACTS[1:])
def test_nn_linear_activation(activation):
    m = cukit.nn.Linear(6, 4, activation=activation)
    assert f"activation={activation!r}" in repr(m) and "in_features=6" in repr(m)
    x = torch.randn(5, 6)
    check_linear(m(x), x, m.weight, m.bias, activation, "float32")
    with pytest.raises(ValueError, match="activation must be one of"):
        cukit.nn.Linear(2, 2, activation="tanh")


# ------------------------------------------------------------------------------ chunked_matmul
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("max_bytes", [4 * (13 * 11 + 13 + 11), 1000, 4096, 10**9])
def test_chunked_matmul_equals_matmul(backend, max_bytes):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((37, 13)).astype(np.float32), rng.standard_normal((13, 11)).astype(np.float32)
    if backend == "torch":
        a, b = torch.from_numpy(a), torch.from_numpy(b)
    r = cukit.chunked_matmul(a, b, max_bytes=max_bytes, use_gpu=False)
    assert type(r) is type(a) and r.shape == (37, 11)
    check_product(r, a, b, "float32")
    assert_close(r, cukit.matmul(a, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("sa", "sb"), [((2, 1, 9, 4), (3, 4, 6)), ((9, 4), (2, 4, 6)), ((4,), (4, 6)),
                                        ((9, 4), (4,)), ((4,), (4,)), ((0, 4), (4, 6)), ((9, 0), (0, 6))])
def test_chunked_matmul_batched_and_vectors(sa, sb):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    r = cukit.chunked_matmul(a, b, max_bytes=8 * (4 * 6 + 4 + 6) + 1, use_gpu=False)
    expected = np.matmul(a, b)
    assert np.shape(r) == expected.shape
    assert_close(np.asarray(r), expected)
    t = cukit.chunked_matmul(torch.from_numpy(a), torch.from_numpy(b), max_bytes=10**6, use_gpu=False)
    assert_close(t, expected)


def test_chunked_matmul_budget_too_small():
    a, b = np.ones((10, 8), np.float32), np.ones((8, 6), np.float32)
    need = 4 * (8 * 6 + 8 + 6)
    assert_close(cukit.chunked_matmul(a, b, max_bytes=need, use_gpu=False), np.full((10, 6), 8.0))
    with pytest.raises(ValueError, match=f"need at least {need}"):
        cukit.chunked_matmul(a, b, max_bytes=need - 1)
    with pytest.raises(ValueError, match=r"cukit\.chunked_matmul: max_bytes must be a real number >= 1"):
        cukit.chunked_matmul(a, b, max_bytes=0)
    with pytest.raises(ValueError, match="mismatch in its core dimension"):
        cukit.chunked_matmul(a, a, max_bytes=need)


# ------------------------------------------------------------------------------- torch autograd
GRAD_SHAPES = [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 1, 3, 4), (5, 4, 2)),
               ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((1, 3, 4), (2, 4, 5)), ((0, 3, 4), (4, 2))]


@pytest.mark.parametrize(("sa", "sb"), GRAD_SHAPES)
def test_cpu_gradcheck_matmul(sa, sb):
    a = torch.randn(sa, dtype=torch.float64, requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: cukit.matmul(a, b), (a, b))
    assert torch.autograd.gradgradcheck(lambda a, b: cukit.matmul(a, b), (a, b))


def test_cpu_matmul_grads_of_transposed_operands():
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: cukit.matmul(a.mT, b.mT), (a, b))


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_gradcheck_linear(activation, bias):
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True) if bias else None
    if activation == "relu":  # keep the pre-activation away from the kink
        with torch.no_grad():
            z = F.linear(x, w, b)
            x.mul_(1 + 0.3 * (z.abs() < 0.1).any().double())
    inputs = (x, w) if b is None else (x, w, b)
    assert torch.autograd.gradcheck(lambda *t: cukit.linear(*t[:2], t[2] if len(t) > 2 else None, activation), inputs)


def test_cpu_linear_vector_input_and_partial_grads():
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, dtype=torch.float64)
    y = cukit.linear(x, w, None, "silu")
    assert y.shape == (3,)
    y.sum().backward()
    ref_w = w.detach().clone().requires_grad_()
    F.silu(F.linear(x, ref_w)).sum().backward()
    assert_close(w.grad, ref_w.grad)


def test_cpu_opcheck():
    a, b = torch.randn(2, 3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.matmul.default, (a, b, "ieee"))
    torch.library.opcheck(torch.ops.cukit.matmul.default, (torch.randn(4, requires_grad=True), b, "ieee"))
    x, w, bias = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True), torch.randn(5, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.linear.default, (x, w, bias, "gelu", "ieee"))
    torch.library.opcheck(torch.ops.cukit.linear.default, (x, w, None, None, "ieee"))
    torch.library.opcheck(torch.ops.cukit.linear.default, (x, w, bias, "relu", "ieee"))


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    def f(x, w, b, m):
        h = cukit.linear(x, w, b, "gelu")
        return cukit.matmul(h, m).square().sum()

    args = [torch.randn(6, 5), torch.randn(4, 5), torch.randn(4), torch.randn(2, 4, 3)]
    leaves = [t.clone().requires_grad_() for t in args]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    out.backward()
    ref_leaves = [t.clone().requires_grad_() for t in args]
    ref = f(*ref_leaves)
    ref.backward()
    assert_close(out, ref, rtol=1e-5)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------- the Gemm built from arrays (no GPU)
def _view_memory(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A NumPy view of `shape` with element `strides` at address ptr (host memory)."""
    if any(n == 0 for n in shape):
        return np.zeros(shape, dtype)
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))
    buf = np.frombuffer((ctypes.c_char * ((hi - lo + 1) * dtype.itemsize)).from_address(ptr + lo * dtype.itemsize), dtype)
    return np.lib.stride_tricks.as_strided(buf[-lo:], shape, tuple(s * dtype.itemsize for s in strides))


def emulate_gemm(g: Gemm) -> None:
    """Run a Gemm on host memory exactly as the contract (cukit/ops/_gemm.py) defines it: C at
    c + z * sc_batch + m * ldc + n in its own dtype, the matmul or the scaled epilogue."""
    dt, ct = np.dtype(g.dtype.name), np.dtype(g.out_dtype.name)
    A = _view_memory(g.a, (*g.batch, g.M, g.K), (*g.sa_batch, g.sa_m, g.sa_k), dt)
    B = _view_memory(g.b, (*g.batch, g.K, g.N), (*g.sb_batch, g.sb_k, g.sb_n), dt)
    sz = g.sc_batch
    C = _view_memory(g.c, (*g.batch, g.M, g.N), (g.batch[1] * g.batch[2] * sz, g.batch[2] * sz, sz, g.ldc, 1), ct)
    z = np.matmul(A.astype(np.float64), B.astype(np.float64))
    if g.bias:
        z = z + _view_memory(g.bias, (g.N,), (1,), dt)
    if g.act >= 0:
        from cukit.ops.bias_act import ACTIVATIONS, reference_numpy

        z = reference_numpy(z, np.zeros(g.N), {v: k for k, v in ACTIVATIONS.items()}[g.act])
    if g.epilogue != EPI_STORE:
        z = g.alpha * z + (g.beta * C.astype(np.float64) if g.epilogue == EPI_ACCUMULATE else 0.0)
    C[...] = z


def _gemm_for(a, b, c, *, bias=None, act=-1) -> tuple[Gemm, Any, Any]:
    batch, M, K, N, _ = mm.matmul_shape(tuple(a.shape), tuple(b.shape))
    a2 = a if a.ndim >= 2 else a[None, :]
    b2 = b if b.ndim >= 2 else b[:, None]
    return mm._build_gemm(
        a2, b2, "torch", batch=batch, M=M, K=K, N=N, c_ptr=c.data_ptr(),
        bias_ptr=0 if bias is None else bias.data_ptr(), act=act, precision="ieee", device=0,
        dtype=DTYPES[str(a.dtype).removeprefix("torch.")],
    )


@st.composite
def torch_operands(draw, shape: tuple[int, ...]):
    """A float64 CPU tensor of `shape`: contiguous, transposed, strided, or broadcast along some
    batch dimensions with stride 0 (expand)."""
    how = draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded"]))
    if how == "expanded" and len(shape) > 2:
        small = tuple(n if draw(st.booleans()) else 1 for n in shape[:-2]) + shape[-2:]
        return draw(torch_operands(small)).expand(shape)
    if how == "transposed" and len(shape) >= 2:
        return draw(arrays("torch", "float64", (*shape[:-2], shape[-1], shape[-2]))).transpose(-1, -2)
    return draw(arrays("torch", "float64", shape, noncontiguous=how == "strided"))


@given(problem=problems(long_k=False, max_batch_dims=5), data=st.data())
def test_gemm_from_arrays_computes_matmul(problem, data):
    """The front end's Gemm (strides, batch collapse, folding, copies), run by an emulator of the
    contract on host memory, gives numpy.matmul."""
    sa, sb = problem
    a, b = data.draw(torch_operands(sa)), data.draw(torch_operands(sb))
    expected = np.matmul(a.numpy(), b.numpy())
    c = torch.full(expected.shape, float("nan"), dtype=torch.float64)
    if c.numel() == 0:
        return
    g, *alive = _gemm_for(a, b, c)  # the operands (or their copies) the Gemm points into
    assert g.batch[0] * g.batch[1] * g.batch[2] * g.M * g.N == c.numel()
    emulate_gemm(g)
    del alive
    assert_close(c, expected, atol=1e-12, rtol=1e-12)


def test_gemm_reads_transposes_in_place_and_folds_batches():
    x = torch.randn(4, 6, 5, dtype=torch.float64)  # (batch, T, in)
    w = torch.randn(3, 5, dtype=torch.float64)  # (out, in)
    bias = torch.randn(3, dtype=torch.float64)
    c = torch.empty(4, 6, 3, dtype=torch.float64)
    g, _, _ = _gemm_for(x, w.t(), c, bias=bias, act=mm.ACTIVATIONS["silu"])
    # weight read in place as B = W^T (column-major), batch folded into M: one 24 x 3 x 5 GEMM
    assert (g.b, g.sb_k, g.sb_n) == (w.data_ptr(), 1, 5)
    assert (g.a, g.M, g.batch) == (x.data_ptr(), 24, (1, 1, 1))
    emulate_gemm(g)
    check_linear(c, x, w, bias, "silu", "float64")
    # a transposed A is read in place too; a broadcast batch keeps stride 0
    a = torch.randn(2, 5, 7, dtype=torch.float64)
    b = torch.randn(5, 4, dtype=torch.float64).expand(3, 2, 5, 4)
    c = torch.empty(3, 2, 7, 4, dtype=torch.float64)
    g, *_ = _gemm_for(a.mT, b, c)
    assert (g.a, g.sa_m, g.sa_k) == (a.data_ptr(), 1, 7) and g.sb_batch == (0, 0, 0)
    emulate_gemm(g)
    assert_close(c, np.matmul(a.mT.numpy(), b.numpy()))
    # neither dimension unit-strided: copied
    s = torch.randn(6, 8, dtype=torch.float64)[::2, ::2]
    c = torch.empty(3, 4, dtype=torch.float64)
    g, ka, _ = _gemm_for(s, torch.eye(4, dtype=torch.float64), c)
    assert g.a != s.data_ptr() and ka.is_contiguous()


def test_gemm_with_many_interleaved_broadcast_dims():
    a = torch.randn(2, 1, 2, 1, 2, 3, 4, dtype=torch.float64)
    b = torch.randn(1, 2, 1, 2, 1, 4, 5, dtype=torch.float64)
    c = torch.empty(2, 2, 2, 2, 2, 3, 5, dtype=torch.float64)
    g, *alive = _gemm_for(a, b, c)
    assert g.batch_count == 32
    emulate_gemm(g)
    del alive
    assert_close(c, np.matmul(a.numpy(), b.numpy()))


# ------------------------------------------------------------------------- kernel selection
def _fake_family(name: str, accepts) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.supports = accepts  # type: ignore[attr-defined]
    mod.launch = lambda g, stream, **kw: None  # type: ignore[attr-defined]
    return mod


def _gemm(dtype: str, precision: str = "ieee") -> Gemm:
    return Gemm(dtype=DTYPES[dtype], M=4, N=4, K=4, a=0, b=0, c=0, bias=0, act=-1, sa_m=4, sa_k=1,
                sb_k=4, sb_n=1, precision=precision)


def test_select_kernel_heuristic(monkeypatch):
    simt = _fake_family("simt", lambda g: g.dtype.name in ("float32", "float64") and g.precision == "ieee")
    tc = _fake_family("tc", lambda g: g.dtype.name in ("float16", "bfloat16", "float32"))
    families = {"simt": simt, "tc": tc}
    monkeypatch.setattr(mm, "_family", lambda name: families[name])
    assert mm.select_kernel(_gemm("float32")) is simt
    assert mm.select_kernel(_gemm("float64")) is simt
    assert mm.select_kernel(_gemm("float16")) is tc
    assert mm.select_kernel(_gemm("bfloat16")) is tc
    assert mm.select_kernel(_gemm("float32", "tf32")) is tc
    # the preferred family declines: the other one
    families["tc"] = _fake_family("tc", lambda g: False)
    assert mm.select_kernel(_gemm("float32", "tf32")) is simt  # and tf32 is lowered to ieee
    _, g, _ = mm._plan(_gemm("float32", "tf32"))
    assert g.precision == "ieee"
    with pytest.raises(NotImplementedError, match="no matmul kernel for bfloat16"):
        mm.select_kernel(_gemm("bfloat16"))
    families["tc"] = None  # not installed
    with pytest.raises(NotImplementedError, match="matmul_tc is not installed"):
        mm.select_kernel(_gemm("float16"))
    with pytest.raises(TypeError, match="matmul kernels support"):
        mm.select_kernel(_gemm("int32"))
    # forcing a family, with a version
    families["tc"] = tc
    assert mm._plan(_gemm("float32"), "tc")[0] is tc
    assert mm._plan(_gemm("float32"), "simt_v1")[2] == "v1"
    with pytest.raises(NotImplementedError, match="declines"):
        mm._plan(_gemm("float16"), "simt")
    with pytest.raises(ValueError, match="unknown matmul kernel"):
        mm._plan(_gemm("float32"), "cublas")


def test_force_kernel_context_manager():
    assert mm._FORCED is None
    with mm.force_kernel("simt_v1"):
        assert mm._FORCED == "simt_v1"
        with mm.force_kernel("tc"):
            assert mm._FORCED == "tc"
        assert mm._FORCED == "simt_v1"
    assert mm._FORCED is None
    with pytest.raises(ValueError, match="unknown matmul kernel"), mm.force_kernel("fast"):
        pass


def test_cpu_inputs_never_reach_the_kernel_families(monkeypatch):
    def no_family(name):
        raise AssertionError(f"CPU inputs looked up the {name} kernel family")

    monkeypatch.setattr(mm, "_family", no_family)
    cukit.matmul(np.ones((2, 2)), np.ones((2, 2)))
    cukit.linear(torch.ones(2, 2), torch.ones(3, 2), torch.ones(3), "gelu")
    cukit.chunked_matmul(np.ones((4, 2)), np.ones((2, 2)), max_bytes=64, use_gpu=False)


# ------------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = ["cupy", "torch-cuda"]
KERNELS = [None, "simt", "simt_v1", "tc"]


def _family_installed(name: str) -> bool:
    return mm._family(name) is not None


def _preferred_family(dtype: str, precision: str) -> str:
    return "tc" if dtype in ("float16", "bfloat16") or (dtype == "float32" and precision == "tf32") else "simt"


def _gpu_matmul(a, b, kernel, precision):
    """cukit.matmul with a forced kernel family; None when that family does not take the problem."""
    try:
        with mm.force_kernel(kernel):
            return cukit.matmul(a, b, precision=precision)
    except NotImplementedError:
        if kernel is None:
            raise
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@given(problem=problems(), backend=st.sampled_from(GPU_BACKENDS), dtype=st.sampled_from(FLOATS),
       precision=st.sampled_from(["ieee", "tf32"]), data=st.data())
def test_gpu_matmul_matches_oracle(kernel, problem, backend, dtype, precision, data):
    if dtype not in backend_dtypes(backend):
        return
    if kernel is None and not _family_installed(_preferred_family(dtype, precision)):
        assume(dtype in ("float32", "float64"))  # 16-bit dtypes need the tensor-core family
    sa, sb = problem
    a = data.draw(operands(backend, dtype, sa))
    b = data.draw(operands(backend, dtype, sb))
    r = _gpu_matmul(a, b, kernel, precision)
    if r is None:
        return
    assert type(r) is type(a) and _dtype_str(r) == _dtype_str(a)
    if backend == "torch-cuda":
        assert r.device == a.device
    check_product(r, a, b, dtype, precision)


def _cuda(shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_large_and_odd_shapes(dtype, kernel):
    tdt = getattr(torch, dtype)
    rng = np.random.default_rng(0)
    for M, N, K in [(1000, 1000, 1000), (4097, 4095, 4093)]:
        a, b = _cuda((M, K), tdt), _cuda((K, N), tdt)
        with mm.force_kernel(kernel):
            try:
                c = cukit.matmul(a, b)
            except NotImplementedError:
                if kernel is None and _family_installed(_preferred_family(dtype, "ieee")):
                    raise
                pytest.skip(f"{kernel or 'heuristic'} does not take {dtype}")
        rows, cols = rng.choice(M, 64, replace=False), rng.choice(N, 64, replace=False)
        rows[:2], cols[:2] = (0, M - 1), (0, N - 1)  # the edges of the last tiles
        a_s, b_s = to_numpy(a[torch.as_tensor(rows, device="cuda")]), to_numpy(b[:, torch.as_tensor(cols, device="cuda")])
        check_product(to_numpy(c)[np.ix_(rows, cols)], a_s, b_s, dtype)
        assert torch.isfinite(c).all()  # every element written


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_gpu_misaligned_16bit_runs_on_aligned_copies(backend, monkeypatch):
    """Pad-and-run: a large float16 problem whose leading dimensions are odd runs on 16-byte
    aligned copies of its operands (the TMA kernels, on compute capability 9.0): row-major,
    transposed views (both operands), a batch; sampled rows and columns against float64."""
    cp = pytest.importorskip("cupy") if backend == "cupy" else None
    calls: list[tuple[int, ...]] = []
    real = mm._pad_operand
    monkeypatch.setattr(mm, "_pad_operand", lambda x, kind, device: calls.append(tuple(x.shape)) or real(x, kind, device))
    rng = np.random.default_rng(3)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    cases = [
        (_cuda((1025, 1031), torch.float16), _cuda((1031, 1027), torch.float16)),
        (_cuda((1031, 1025), torch.float16).mT, _cuda((1027, 1031), torch.float16).mT),
        (_cuda((2, 600, 1031), torch.float16), _cuda((1031, 903), torch.float16)),
    ]
    for a, b in cases:
        calls.clear()
        if cp is not None:
            a, b = cp.from_dlpack(a), cp.from_dlpack(b)
        c = cukit.matmul(a, b)
        assert type(c) is type(a)
        assert bool(calls) == hopper, calls
        cn, an, bn = to_numpy(c), to_numpy(a), to_numpy(b)
        M, N = an.shape[-2], bn.shape[-1]
        rows, cols = rng.choice(M, 48, replace=False), rng.choice(N, 48, replace=False)
        rows[:2], cols[:2] = (0, M - 1), (0, N - 1)
        check_product(cn[..., rows, :][..., cols], an[..., rows, :], bn[..., cols], "float16")
        assert np.isfinite(cn).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_k_zero_noncontiguous_and_stride_zero_batches(kernel):
    with mm.force_kernel(kernel):
        try:
            for dtype in (torch.float32, torch.float64):
                z = cukit.matmul(torch.empty(3, 0, device="cuda", dtype=dtype), torch.empty(0, 5, device="cuda", dtype=dtype))
                assert z.shape == (3, 5) and not z.any()
                a = _cuda((2, 1, 6, 9), dtype)[..., ::2]  # no unit stride: copied
                b = _cuda((9, 3), dtype).expand(1, 3, 9, 3)[..., 1:6, :]  # stride-0 batch dims
                c = cukit.matmul(a, b)
                check_product(c, a, b, str(dtype).removeprefix("torch."))
                at, bt = _cuda((3, 5, 4), dtype).mT, _cuda((7, 5), dtype).mT  # transposed: read in place
                c = cukit.matmul(at, bt)
                check_product(c, at, bt, str(dtype).removeprefix("torch."))
        except NotImplementedError:
            if kernel in (None, "simt", "simt_v1"):
                raise
            pytest.skip(f"{kernel} does not take float32/float64 ieee")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_linear_matches_functional(backend, dtype, activation):
    if dtype not in backend_dtypes(backend):
        pytest.skip("bfloat16 CuPy arrays need ml_dtypes")
    if not _family_installed(_preferred_family(dtype, "ieee")) and dtype in ("float16", "bfloat16"):
        pytest.skip("matmul_tc not installed")
    tdt = getattr(torch, dtype)
    for lead, in_f, out_f in [((), 17, 5), ((7,), 64, 33), ((3, 129), 96, 200), ((0,), 8, 4), ((5,), 0, 3)]:
        x, w, b = _cuda((*lead, in_f), tdt), _cuda((out_f, in_f), tdt, 0.2), _cuda((out_f,), tdt)
        if backend == "cupy":
            x, w, b = cukit.asarray(x), cukit.asarray(w), cukit.asarray(b)
        y = cukit.linear(x, w, b, activation)
        assert type(y) is type(x) and tuple(y.shape) == (*lead, out_f)
        check_linear(y, x, w, b, activation, dtype)
        y = cukit.linear(x, w, None, activation)
        check_linear(y, x, w, None, activation, dtype)


@pytest.mark.gpu
def test_gpu_tf32_precision_setting():
    if not _family_installed("tc"):
        pytest.skip("matmul_tc not installed")
    a, b = _cuda((256, 512)), _cuda((512, 192))
    exact = cukit.matmul(a, b, precision="ieee")
    check_product(exact, a, b, "float32")
    try:
        cukit.set_matmul_precision("tf32")
        fast = cukit.matmul(a, b)
    finally:
        cukit.set_matmul_precision("ieee")
    check_product(fast, a, b, "float32", "tf32")
    assert not torch.equal(fast, exact)  # tf32 really rounded the inputs


@pytest.mark.gpu
@pytest.mark.parametrize(("sa", "sb"), GRAD_SHAPES)
def test_gpu_gradcheck_float64(sa, sb):
    a = torch.randn(sa, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: cukit.matmul(a, b), (a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_gradcheck_linear_float64(activation):
    x = torch.randn(2, 3, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, device="cuda", requires_grad=True)
    if activation == "relu":
        with torch.no_grad():
            b.add_(torch.where(F.linear(x, w, b).abs().amin((0, 1)) < 0.1, 0.5, 0.0))
    assert torch.autograd.gradcheck(lambda x, w, b: cukit.linear(x, w, b, activation), (x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gpu_opcheck(dtype):
    if dtype == torch.bfloat16 and not _family_installed("tc"):
        pytest.skip("matmul_tc not installed")
    a = _cuda((2, 33, 40), dtype).requires_grad_()
    b = _cuda((40, 24), dtype).requires_grad_()
    torch.library.opcheck(torch.ops.cukit.matmul.default, (a, b, "ieee"))
    x, w, bias = _cuda((17, 40), dtype).requires_grad_(), _cuda((24, 40), dtype).requires_grad_(), _cuda((24,), dtype).requires_grad_()
    torch.library.opcheck(torch.ops.cukit.linear.default, (x, w, bias, "gelu", "ieee"))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(compile_policy: str):
    def f(x, w, b, m):
        h = cukit.linear(x, w, b, "silu")
        return (cukit.matmul(h, m) * 2).square().mean()

    args = [_cuda((64, 32)), _cuda((48, 32)), _cuda((48,)), _cuda((3, 48, 16))]
    leaves = [t.clone().requires_grad_() for t in args]
    out = torch.compile(f, fullgraph=True)(*leaves)
    out.backward()
    ref_leaves = [t.double().requires_grad_() for t in args]
    ref = f(*ref_leaves)
    ref.backward()
    assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_linear_forward_backward():
    x = _cuda((256, 128)).requires_grad_()
    w = _cuda((64, 128), scale=0.1).requires_grad_()
    b = _cuda((64,)).requires_grad_()
    g = _cuda((256, 64))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compiles every kernel the capture will launch
        for _ in range(2):
            x.grad = w.grad = b.grad = None
            cukit.linear(x, w, b, "gelu").backward(g)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cukit.linear(x, w, b, "gelu")
        y.backward(g)
    with torch.no_grad():
        for t in (x, w, b):
            t.copy_(torch.randn_like(t) * (0.1 if t is w else 1.0))
    graph.replay()
    torch.cuda.synchronize()
    check_linear(y, x, w, b, "gelu", "float32")
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    F.gelu(F.linear(xd, wd, bd)).backward(g.double())
    assert_close(x.grad, xd.grad, atol=1e-4, rtol=1e-4)
    assert_close(w.grad, wd.grad, atol=1e-3, rtol=1e-4)
    assert_close(b.grad, bd.grad, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_launches_on_torchs_current_stream():
    n = 2048
    src = _cuda((n, n))
    a = torch.zeros(n, n, device="cuda")
    eye = torch.eye(n, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        a.copy_(src)
        c = cukit.matmul(a, eye)
    torch.cuda.synchronize()
    assert torch.equal(c, src)


@pytest.mark.gpu
def test_gpu_nn_linear_matches_torch():
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 40, device="cuda")
    ours = cukit.nn.Linear(96, 40, device="cuda")
    ours.load_state_dict(ref.state_dict())
    x = _cuda((8, 5, 96))
    assert_close(ours(x), ref(x), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_chunked_matmul_streams_host_operands():
    import cupy

    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((1000, 300)).astype(np.float32), rng.standard_normal((300, 200)).astype(np.float32)
    budget = 4 * (300 * 200 + 64 * (300 + 200))  # B + 64 rows at a time
    r = cukit.chunked_matmul(a, b, max_bytes=budget, use_gpu=True)
    assert isinstance(r, np.ndarray)
    check_product(r, a, b, "float32")
    t = cukit.chunked_matmul(torch.from_numpy(a), torch.from_numpy(b), max_bytes=budget, use_gpu=True)
    assert t.device.type == "cpu"
    check_product(t, a, b, "float32")
    ca, cb = cupy.asarray(a), cupy.asarray(b)
    rc = cukit.chunked_matmul(ca, cb, max_bytes=budget)
    assert isinstance(rc, cupy.ndarray)
    assert_close(rc, cukit.matmul(ca, cb), atol=0, rtol=0)  # same kernel per row: identical
    with pytest.raises(ValueError, match="too small"):
        cukit.chunked_matmul(ca, cb, max_bytes=4 * 300 * 200)


@pytest.mark.gpu
def test_gpu_errors():
    with pytest.raises(TypeError, match="supports"):
        cukit.matmul(torch.ones(2, 2, device="cuda", dtype=torch.int32), torch.ones(2, 2, device="cuda", dtype=torch.int32))
    with pytest.raises(ValueError, match="same device"):
        cukit.matmul(torch.ones(2, 2, device="cuda"), torch.ones(2, 2))
    out = torch.empty(2, 2, device="cuda")
    a = torch.ones(2, 2, device="cuda")
    assert cukit.matmul(a, a, out=out) is out and torch.equal(out, torch.full((2, 2), 2.0, device="cuda"))
    # out overlapping an input: computed through a temporary
    assert cukit.matmul(a, a, out=a) is a and torch.equal(a, torch.full((2, 2), 2.0, device="cuda"))
    assert math.isfinite(float(cukit.matmul(torch.ones(3, device="cuda"), torch.ones(3, device="cuda"))))
