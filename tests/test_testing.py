"""cukit.testing: the strategies draw what they promise (odd and empty shapes, exact values without
subnormals, non-contiguous views), assert_close passes and fails where it should with a readable
message, and check_against_oracle catches wrong values, wrong array types and wrong counts."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument, NoSuchExample

import cukit
from cukit.interop import DTYPES, array_kind, device_of, dtype_of
from cukit.ops.bias_act import reference_numpy
from cukit.testing import (
    TOLERANCES,
    BackendUnavailableError,
    arrays,
    assert_close,
    backends,
    check_against_oracle,
    dtypes,
    shapes,
    to_numpy,
    tolerance,
)
from cukit.testing import strategies as strat

torch = pytest.importorskip("torch")

FLOATS = ("float16", "bfloat16", "float32", "float64")
CPU_BACKENDS = backends(gpu=False)
GPU_BACKENDS = backends(gpu=True)
FIND = settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=30, deadline=None)


def _has_ml_dtypes() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def _pairs(backend_list: list[str]) -> list[tuple[str, str]]:
    """(backend, dtype) pairs this machine can draw: bfloat16 NumPy/CuPy needs ml_dtypes."""
    return [
        (b, d)
        for b in backend_list
        for d in FLOATS
        if not (d == "bfloat16" and b in ("numpy", "cupy") and not _has_ml_dtypes())
    ]


def _is_contiguous(x) -> bool:
    if array_kind(x) == "torch":
        return x.is_contiguous()
    return bool(x.flags.c_contiguous)


# ------------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("side", [0, 1, 3, 5, 7, 13, 123])
def test_shapes_reach_empty_and_odd_sides(side):
    found = find(shapes(max_side=200, max_elements=100_000), lambda s: side in s, settings=FIND)
    assert side in found


def test_shapes_reach_every_dimension_count():
    for ndim in range(0, 5):
        assert len(find(shapes(min_dims=0, max_dims=4), lambda s, n=ndim: len(s) == n, settings=FIND)) == ndim


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 3).flatmap(
        lambda lo: st.tuples(
            st.just(lo),
            st.integers(lo, 5),
            st.integers(0, 4),
            st.integers(0, 300),
            st.integers(1, 50_000),
        )
    ),
    st.data(),
)
def test_shapes_respect_bounds(bounds, data):
    min_dims, max_dims, min_side, extra, max_elements = bounds
    max_side = min_side + extra
    if min_side**min_dims > max_elements:
        with pytest.raises(InvalidArgument):
            shapes(
                min_dims=min_dims,
                max_dims=max_dims,
                min_side=min_side,
                max_side=max_side,
                max_elements=max_elements,
            )
        return
    s = data.draw(
        shapes(
            min_dims=min_dims,
            max_dims=max_dims,
            min_side=min_side,
            max_side=max_side,
            max_elements=max_elements,
        )
    )
    assert isinstance(s, tuple) and all(type(n) is int for n in s)
    assert min_dims <= len(s) <= max_dims
    assert all(min_side <= n <= max_side for n in s)
    assert math.prod(s) <= max_elements


def test_shapes_edge_cases_and_bad_arguments():
    assert find(shapes(max_side=0), lambda s: True, settings=FIND) == (0,)
    assert find(shapes(min_dims=0, max_dims=0), lambda s: True, settings=FIND) == ()
    assert find(shapes(min_side=5, max_side=5, min_dims=2, max_dims=2), lambda s: True, settings=FIND) == (
        5,
        5,
    )
    for kwargs in (
        {"min_dims": 3, "max_dims": 2},
        {"min_side": 4, "max_side": 3},
        {"min_side": 10, "max_elements": 9},
    ):
        with pytest.raises(InvalidArgument):
            shapes(**kwargs)


# ------------------------------------------------------------------------------ dtypes, backends
def test_dtypes_draw_table_names_and_drop_bfloat16_without_ml_dtypes():
    torch_names = {find(dtypes(backend="torch"), lambda d, n=n: d == n, settings=FIND) for n in FLOATS}
    assert torch_names == set(FLOATS)
    for backend in (None, "numpy"):
        can = set(FLOATS) if _has_ml_dtypes() else set(FLOATS) - {"bfloat16"}
        for name in FLOATS:
            if name in can:
                assert find(dtypes(backend=backend), lambda d, n=name: d == n, settings=FIND) in DTYPES
            else:
                with pytest.raises(NoSuchExample):
                    find(dtypes(backend=backend), lambda d, n=name: d == n, settings=FIND)
    assert find(dtypes(["float32", np.float64]), lambda d: d == "float64", settings=FIND) == "float64"
    with pytest.raises(TypeError, match="not supported"):
        dtypes(["float8"])
    with pytest.raises(InvalidArgument):
        dtypes(backend="jax")


@pytest.mark.skipif(_has_ml_dtypes(), reason="ml_dtypes is installed")
def test_dtypes_without_ml_dtypes_leaves_nothing_for_numpy_bfloat16():
    with pytest.raises(InvalidArgument, match="bfloat16 needs ml_dtypes"):
        dtypes(["bfloat16"], backend="numpy")


def test_backends_lists_what_this_machine_has():
    assert backends()[:2] == ["numpy", "torch"]  # torch is installed in the test environment
    assert backends(gpu=False) == ["numpy", "torch"]
    assert set(backends(gpu=True)) | {"numpy", "torch"} == set(backends())
    assert ("cupy" in backends()) == cukit.is_available()
    assert ("torch-cuda" in backends()) == torch.cuda.is_available()


@pytest.mark.skipif(cukit.is_available(), reason="a GPU is visible")
def test_gpu_backend_without_gpu_raises_clearly():
    with pytest.raises(BackendUnavailableError, match=r"'cupy' is not available.*backends\(\)"):
        arrays("cupy", "float32", (3,))
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="torch-cuda"):
            arrays("torch-cuda", "float32", (3,))


def test_arrays_bad_arguments():
    with pytest.raises(InvalidArgument, match="backend must be one of"):
        arrays("jax", "float32", (3,))
    with pytest.raises(InvalidArgument, match="floating-point"):
        arrays("numpy", "int32", (3,))
    with pytest.raises(InvalidArgument, match="not a finite float16"):
        arrays("numpy", "float16", (3,), max_value=1e5)
    with pytest.raises(InvalidArgument, match="no normal"):
        arrays("numpy", "float16", (3,), min_value=1e-6, max_value=2e-6)
    with pytest.raises(InvalidArgument, match="greater than"):
        arrays("numpy", "float32", (3,), min_value=1.0, max_value=0.0)
    with pytest.raises(InvalidArgument, match="noncontiguous"):
        arrays("numpy", "float32", (3,), noncontiguous="yes")  # type: ignore[arg-type]
    if not _has_ml_dtypes():
        with pytest.raises(TypeError, match="ml_dtypes"):
            arrays("numpy", "bfloat16", (3,))


# ---------------------------------------------------------------------------------------- arrays
def _check_array(
    x, backend: str, dtype: str, shape: tuple[int, ...], lo: float = -4.0, hi: float = 4.0
) -> None:
    assert array_kind(x) == ("torch" if backend.startswith("torch") else backend)
    assert (device_of(x) is None) == (backend in ("numpy", "torch"))
    assert dtype_of(x).name == dtype
    assert tuple(x.shape) == shape
    if array_kind(x) == "torch":
        assert not x.requires_grad
    v = to_numpy(x).astype(np.float64)
    assert np.all(np.isfinite(v))
    assert np.all((v >= lo) & (v <= hi))
    tiny = 2.0**-126 if dtype == "bfloat16" else float(np.finfo(dtype).tiny)
    assert not np.any((v != 0) & (np.abs(v) < tiny)), "subnormal value drawn"
    # exactly representable: rounding to the dtype changes nothing
    np.testing.assert_array_equal(strat._round(v, dtype), v)


@pytest.mark.parametrize(("backend", "dtype"), _pairs(CPU_BACKENDS))
@FEW
@given(shape=shapes(max_dims=3, max_side=40), noncontiguous=st.booleans(), data=st.data())
def test_arrays_respect_backend_dtype_shape_and_layout(backend, dtype, shape, noncontiguous, data):
    x = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    _check_array(x, backend, dtype, shape)
    if not noncontiguous or math.prod(shape) < 2:
        assert _is_contiguous(x)  # libraries call size-0/1 arrays contiguous whatever their strides
    else:
        assert not _is_contiguous(x)
        # the view's values equal a contiguous copy (the padding around it is not part of them)
        dense = x.contiguous() if array_kind(x) == "torch" else np.ascontiguousarray(x)
        assert_close(dense, x, atol=0, rtol=0)


@FEW
@given(
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    bounds=st.tuples(st.floats(-100, 100), st.floats(0, 50)),
    data=st.data(),
)
def test_arrays_respect_arbitrary_bounds(dtype, bounds, data):
    lo, width = bounds
    hi = lo + width
    try:
        strat._bounds(lo, hi, dtype)
    except InvalidArgument:
        return  # an interval with no normal value of the dtype (tiny width around a subnormal)
    x = data.draw(arrays("numpy", dtype, (64,), min_value=lo, max_value=hi, noncontiguous=None))
    _check_array(x, "numpy", dtype, (64,), lo, hi)


def test_arrays_bfloat16_bounds_are_inward_and_exact():
    lo, hi = strat._bounds(0.1, 0.3, "bfloat16")
    assert 0.1 <= lo < 0.1 * (1 + 2**-7) and 0.3 * (1 - 2**-7) < hi <= 0.3
    np.testing.assert_array_equal(strat._round(np.array([lo, hi]), "bfloat16"), [lo, hi])
    assert strat._bounds(-1e-40, 1e-40, "float32") == (0.0, 0.0)  # subnormal bounds move to zero


def test_noncontiguous_views_pad_with_nan_and_can_misalign():
    """The padding holds NaN (so out-of-view reads show), and some views start off the buffer start."""

    def padded_and_offset(x) -> bool:
        base = x.base
        return (
            base is not None
            and base.size > x.size
            and np.isnan(base).any()
            and not np.shares_memory(base[:1], x)
        )

    x = find(arrays("numpy", "float32", (4, 5), noncontiguous=True), padded_and_offset, settings=FIND)
    assert not x.flags.c_contiguous


def test_noncontiguous_includes_transposed_layouts():
    x = find(
        arrays("numpy", "float32", (6, 7), noncontiguous=True),
        lambda a: a.strides[0] < a.strides[1],  # column-major order
        settings=FIND,
    )
    assert x.shape == (6, 7)


def test_noncontiguous_torch_view_can_require_grad():
    x = find(arrays("torch", "float32", (3, 4), noncontiguous=True), lambda t: True, settings=FIND)
    x.requires_grad_()
    cukit.bias_act(x, torch.zeros(4), "silu").sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 4)


def test_large_arrays_are_not_mostly_one_value():
    x = find(arrays("numpy", "float32", (4096,)), lambda a: len(np.unique(a)) > 2000, settings=FIND)
    assert len(np.unique(x)) > 2000


def test_arrays_accept_strategies_for_backend_dtype_and_shape():
    x = find(
        arrays(st.sampled_from(CPU_BACKENDS), dtypes(backend="numpy"), shapes(max_dims=2)),
        lambda a: array_kind(a) == "torch" and a.ndim == 2,
        settings=FIND,
    )
    assert isinstance(x, torch.Tensor)


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "dtype"), _pairs(GPU_BACKENDS) or [("cupy", "float32")])
@FEW
@given(shape=shapes(max_dims=3, max_side=40), noncontiguous=st.booleans(), data=st.data())
def test_gpu_arrays(backend, dtype, shape, noncontiguous, data):
    x = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    _check_array(x, backend, dtype, shape)
    assert _is_contiguous(x) == (not noncontiguous or math.prod(shape) < 2)


# ------------------------------------------------------------------------------------ tolerances
def test_tolerance_table():
    assert set(TOLERANCES) == set(FLOATS)
    for name, (atol, rtol) in TOLERANCES.items():
        assert (
            tolerance(name)
            == (atol, rtol)
            == tolerance(np.dtype(name) if name != "bfloat16" else torch.bfloat16)
        )
        assert tolerance(getattr(torch, name)) == (atol, rtol)
    order = ["float64", "float32", "float16", "bfloat16"]
    assert [TOLERANCES[n][1] for n in order] == sorted(TOLERANCES[n][1] for n in order)
    assert (
        tolerance("int32") == tolerance(np.uint8) == tolerance(torch.uint8) == tolerance(bool) == (0.0, 0.0)
    )
    with pytest.raises(TypeError):
        tolerance(np.complex64)


@pytest.mark.parametrize("dtype", FLOATS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_tolerance_passes_one_rounding_and_fails_a_coarser_one(dtype, seed, scale):
    """The table's premise: one rounding of an exact result to the storage dtype passes, and one
    rounding to the next coarser dtype fails (a kernel that secretly computes or stores in lower
    precision is caught), for numbers of magnitude above 1 (below it atol is what counts)."""
    exact = np.random.default_rng(seed).standard_normal(1000) * scale
    assert_close(strat._round(exact, dtype), exact, dtype=dtype)
    big = np.abs(exact) > 1.0
    if big.any():
        coarser = {"float64": "float32", "float32": "float16", "float16": "bfloat16"}.get(dtype)
        wrong = strat._round(exact, coarser) if coarser else exact * (1 + 10 * 2.0**-7)  # 10 bf16 ulps
        with pytest.raises(AssertionError):
            assert_close(wrong[big], exact[big], dtype=dtype)


# ---------------------------------------------------------------------------------- assert_close
def test_assert_close_passes_within_tolerance():
    x = np.linspace(-4, 4, 101)
    assert_close(x, x)
    assert_close(x * (1 + 5e-4), x, dtype="float16")
    assert_close(x.astype(np.float16), x)  # tolerance from actual's dtype
    assert_close(x * (1 + 1e-2), x, dtype="bfloat16")
    assert_close(x + 5e-6, x, dtype="float32")
    assert_close(x + 0.5, x, atol=0.5, rtol=0)
    assert_close(2.0, np.float64(2.0))
    assert_close(3, np.array(3))


def test_assert_close_fails_outside_tolerance_with_a_useful_message():
    expected = np.zeros((4, 6))
    actual = expected.copy()
    actual[2, 5] = 0.5
    actual[1, 1] = 0.01
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, dtype="float32")
    msg = str(info.value)
    assert "2 of 24 elements mismatch" in msg
    assert "worst at index (2, 5): actual=0.5, expected=0.0" in msg
    assert "abs err=0.5" in msg and "rel err=inf" in msg
    assert "atol=1e-05, rtol=1.3e-06 (dtype float32)" in msg
    assert "first mismatched indices: (1, 1), (2, 5)" in msg


def test_assert_close_uses_actuals_dtype_by_default():
    x = np.linspace(1, 2, 11)
    assert_close((x * (1 + 5e-4)).astype(np.float16).astype(np.float32), x, dtype="float16")
    with pytest.raises(AssertionError, match="dtype float32"):
        assert_close((x * (1 + 5e-4)).astype(np.float32), x)
    with pytest.raises(AssertionError, match="dtype int64"):
        assert_close(np.array([1, 2, 4]), np.array([1, 2, 3]))


def test_assert_close_nan_and_inf():
    nan, inf = np.nan, np.inf
    assert_close(np.array([1.0, nan, inf, -inf]), np.array([1.0, nan, inf, -inf]))
    with pytest.raises(AssertionError, match=r"1 of 2 elements mismatch.*1 with NaN"):
        assert_close(np.array([nan, 1.0]), np.array([1.0, 1.0]))
    with pytest.raises(AssertionError, match="1 with NaN"):
        assert_close(np.array([1.0, 1.0]), np.array([1.0, nan]))
    with pytest.raises(AssertionError, match="1 of 1 elements"):
        assert_close(np.array([nan]), np.array([nan]), equal_nan=False)
    with pytest.raises(AssertionError, match="with inf"):
        assert_close(np.array([inf]), np.array([-inf]))
    with pytest.raises(AssertionError, match="with inf"):
        assert_close(np.array([inf]), np.array([1e308]))


def test_assert_close_shape_mismatch():
    with pytest.raises(AssertionError, match=re.escape("shape mismatch: actual (2, 3) != expected (3, 2)")):
        assert_close(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(np.zeros(1), 0.0)  # no broadcasting
    assert_close(np.zeros((0, 3)), np.zeros((0, 3)))


def test_assert_close_takes_torch_tensors_of_any_kind():
    x = torch.linspace(-3, 3, 50, dtype=torch.float32, requires_grad=True)
    y = x * 2
    assert_close(y, 2 * x.detach().numpy())
    xb = x.detach().to(torch.bfloat16)
    assert_close(xb, x.detach())  # bf16 actual: bf16 tolerance
    with pytest.raises(AssertionError, match="dtype bfloat16"):
        assert_close(xb + 0.5, x.detach())
    assert_close(torch.tensor(1.5), 1.5)
    assert to_numpy(xb).dtype == np.float32
    assert to_numpy(torch.zeros(2, 3).t()).shape == (3, 2)
    assert to_numpy([1.0, 2.0]).dtype == np.float64


def test_assert_close_rejects_complex():
    with pytest.raises(TypeError, match="real numbers"):
        assert_close(np.ones(2, np.complex64), np.ones(2))


# -------------------------------------------------------------------------- check_against_oracle
ACTS = ["relu", "gelu", "gelu_tanh", "silu"]


@pytest.mark.parametrize(("backend", "dtype"), _pairs(CPU_BACKENDS))
@settings(max_examples=15, deadline=None)
@given(shape=shapes(max_dims=3, max_side=40), activation=st.sampled_from(ACTS), data=st.data())
def test_check_against_oracle_passes_bias_act(backend, dtype, shape, activation, data):
    x = data.draw(arrays(backend, dtype, shape, noncontiguous=None))
    b = data.draw(arrays(backend, dtype, shape[-1:]))
    y = check_against_oracle(cukit.bias_act, reference_numpy, x, b, activation)
    assert array_kind(y) == array_kind(x) and dtype_of(y) == dtype_of(x)
    check_against_oracle(cukit.bias_act, reference_numpy, x, bias=b, activation=activation)  # kwargs too


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_check_against_oracle_catches_a_missing_activation(backend):
    x = find(arrays(backend, "float32", (8, 5)), lambda a: bool((to_numpy(a) < -1).any()), settings=FIND)
    b = find(arrays(backend, "float32", (5,)), lambda a: True, settings=FIND)

    def no_activation(x, bias, activation):
        return x + bias

    with pytest.raises(AssertionError, match=r"mismatch[\s\S]*worst at index"):
        check_against_oracle(no_activation, reference_numpy, x, b, "relu")


def test_check_against_oracle_catches_a_wrong_array_type_or_device():
    x, b = torch.randn(4, 3), torch.randn(3)

    def returns_numpy(x, bias, activation):
        return reference_numpy(x.numpy(), bias.numpy(), activation)

    with pytest.raises(
        AssertionError, match=re.escape("returned a numpy.ndarray for a torch.Tensor on the CPU input")
    ):
        check_against_oracle(returns_numpy, reference_numpy, x, b, "relu")
    with pytest.raises(AssertionError, match=re.escape("returned a builtins.float")):
        check_against_oracle(lambda x, b, a: 1.0, reference_numpy, x, b, "relu")


def test_check_against_oracle_multiple_outputs():
    g, x, b = (np.random.default_rng(0).standard_normal(s) for s in ((6, 4), (6, 4), (4,)))
    ref = cukit.ops.bias_act.reference_backward_numpy
    dx, db = check_against_oracle(cukit.bias_act_backward, ref, g, x, b, "gelu")
    assert dx.shape == (6, 4) and db.shape == (4,)
    tg, tx, tb = (torch.from_numpy(a) for a in (g, x, b))
    check_against_oracle(cukit.bias_act_backward, ref, tg, tx, tb, "gelu")

    def wrong_dbias(*args):
        dx, db = ref(*args)
        return dx, db + 1

    with pytest.raises(AssertionError, match="output 1 of 2: arrays not close"):
        check_against_oracle(wrong_dbias, ref, g, x, b, "gelu")
    with pytest.raises(AssertionError, match="op returned 1 outputs, the oracle 2"):
        check_against_oracle(lambda *a: ref(*a)[:1], ref, g, x, b, "gelu")
    with pytest.raises(AssertionError, match="op returned one output but the oracle a sequence"):
        check_against_oracle(lambda *a: ref(*a)[0], ref, g, x, b, "gelu")


def test_check_against_oracle_checks_the_output_dtype():
    x, b = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float16), np.zeros(3, np.float16)

    def upcasts(x, bias, activation):  # right values, wrong dtype: a float16 op must return float16
        return reference_numpy(x.astype(np.float32), bias.astype(np.float32), activation)

    with pytest.raises(AssertionError, match=r"output: op returned dtype float32; expected float16 \(the inputs' floating dtype"):
        check_against_oracle(upcasts, reference_numpy, x, b, "relu")
    check_against_oracle(upcasts, reference_numpy, x, b, "relu", out_dtype="float32")  # by design: say so
    tx, tb = torch.from_numpy(x), torch.from_numpy(b)
    with pytest.raises(AssertionError, match=r"op returned dtype float32; expected float16"):
        check_against_oracle(lambda x, bias, a: cukit.bias_act(x.float(), bias.float(), a), reference_numpy, tx, tb, "gelu")
    ref = cukit.ops.bias_act.reference_backward_numpy
    g, x64, b64 = np.ones((2, 3)), np.ones((2, 3)), np.ones(3)

    def wrong_dbias_dtype(*args):
        dx, db = ref(*args)
        return dx, db.astype(np.float32)

    with pytest.raises(AssertionError, match=r"output 1 of 2: op returned dtype float32; expected float64"):
        check_against_oracle(wrong_dbias_dtype, ref, g, x64, b64, "silu")
    check_against_oracle(wrong_dbias_dtype, ref, g, x64, b64, "silu", out_dtype=[None, np.float32], atol=1e-6, rtol=1e-6)

    def argmax(a):  # integer outputs must have the oracle's dtype
        return a.argmax(axis=-1)

    check_against_oracle(argmax, lambda a: a.argmax(axis=-1), x64)
    with pytest.raises(AssertionError, match=r"op returned dtype int32; expected int64 \(the oracle's output dtype"):
        check_against_oracle(lambda a: argmax(a).astype(np.int32), lambda a: a.argmax(axis=-1), x64)


def test_check_against_oracle_sees_inputs_before_the_op_mutates_them():
    x = np.arange(6, dtype=np.float32)

    def doubles_in_place(a):
        a *= 2
        return a

    seen = {}

    def oracle(a):
        seen["dtype"] = a.dtype
        return a * 2

    check_against_oracle(doubles_in_place, oracle, x)
    assert seen["dtype"] == np.float64
    np.testing.assert_array_equal(x, np.arange(6) * 2)


def test_check_against_oracle_converts_arrays_in_lists_and_keeps_integer_dtypes():
    xs = [torch.ones(3), torch.full((2,), 2.0)]
    idx = torch.tensor([2, 0])

    def op(tensors, index, scale):
        return torch.cat(tensors)[index] * scale

    def oracle(arrays_, index, scale):
        assert isinstance(arrays_, list) and all(a.dtype == np.float64 for a in arrays_)
        assert index.dtype == np.int64
        return np.concatenate(arrays_)[index] * scale

    check_against_oracle(op, oracle, xs, idx, scale=3.0)
    with pytest.raises(TypeError, match="at least one array"):
        check_against_oracle(lambda s: s, lambda s: s, 1.0)


def test_check_against_oracle_tolerance_overrides():
    x = np.linspace(0, 1, 5, dtype=np.float32)
    with pytest.raises(AssertionError):
        check_against_oracle(lambda a: a + np.float32(1e-3), lambda a: a, x)
    check_against_oracle(lambda a: a + np.float32(5e-4), lambda a: a, x, dtype="float16")
    check_against_oracle(lambda a: a + np.float32(1e-3), lambda a: a, x, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "dtype"), _pairs(GPU_BACKENDS) or [("cupy", "float32")])
@FEW
@given(
    shape=shapes(max_dims=3, max_side=300, max_elements=60_000),
    activation=st.sampled_from(ACTS),
    data=st.data(),
)
def test_check_against_oracle_gpu(backend, dtype, shape, activation, data):
    x = data.draw(arrays(backend, dtype, shape, noncontiguous=None))
    b = data.draw(arrays(backend, dtype, shape[-1:]))
    check_against_oracle(cukit.bias_act, reference_numpy, x, b, activation)

    def returns_host(x, bias, activation):
        return to_numpy(cukit.bias_act(x, bias, activation))

    with pytest.raises(AssertionError, match=re.escape("returned a numpy.ndarray")):
        check_against_oracle(returns_host, reference_numpy, x, b, activation)
