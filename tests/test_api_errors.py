"""The public NumPy-like API with what newcomers pass first: lists, tuples, Python and NumPy scalars
(converted as ``numpy.asarray`` converts them, in the other operand's library), and its errors:
every one names the function and the argument, what was expected and what was given.

Oracles: NumPy itself (``numpy.matmul``) and the ops' NumPy references on ``numpy.asarray`` of the
same array-likes.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import cukit
from cukit import interop
from cukit.ops.bias_act import reference_backward_numpy
from cukit.ops.bias_act import reference_numpy as bias_act_numpy
from cukit.ops.matmul import linear_reference_numpy
from cukit.testing import assert_close

torch = pytest.importorskip("torch")

ACTS = ["relu", "gelu", "gelu_tanh", "silu"]
X = [[1.0, -2.0, 0.5], [0.25, 3.0, -1.5]]  # Python floats: float64, as in NumPy
W = [[1.0, 0.5, -1.0], [2.0, -0.5, 0.0]]
B = [0.5, -0.25]


# ------------------------------------------------------------------------------- array-likes
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([[1.0, 2.0]], [[3.0], [4.0]]),  # the example
        ([1.0, 2.0], (3.0, 4.0)),  # 1-D @ 1-D: a NumPy scalar, as numpy.matmul returns
        ([[1, 2], [3, 4]], [[5], [6]]),  # ints stay int64, exact
        ([[True, False]], [[True], [True]]),  # bools: NumPy's bool matmul
        ([[1, 2.5]], [[2], [1]]),  # mixed ints and floats promote to float64
        (((1.0, 2.0), (3.0, 4.0)), [[[1.0], [0.0]], [[0.0], [1.0]]]),  # tuples, broadcast batch
        (np.float32([[1.0, 2.0]]), [[3.0], [4.0]]),  # float32 array @ list (float64): float64
        ([[1.0, 2.0]], np.arange(4, dtype=np.float32).reshape(2, 2)),
    ],
)
def test_matmul_takes_array_likes_as_numpy_does(a, b):
    expected = np.matmul(a, b)
    r = cukit.matmul(a, b)
    assert type(r) is type(expected) and r.dtype == expected.dtype and np.shape(r) == expected.shape
    np.testing.assert_array_equal(r, expected)


@pytest.mark.parametrize(("a", "b"), [(2.0, [1.0, 2.0]), ([1.0, 2.0], np.float32(3.0)), (np.int64(1), 2)])
def test_matmul_rejects_scalars_like_numpy(a, b):
    with pytest.raises(ValueError) as expected:
        np.matmul(a, b)
    bad = "a" if np.ndim(a) == 0 else "b"
    with pytest.raises(ValueError, match=rf"^cukit\.matmul: {bad} must have at least 1 dimension") as got:
        cukit.matmul(a, b)
    assert str(got.value).endswith(f"(numpy.matmul raises: {expected.value})")


def test_batch_matmul_and_chunked_matmul_take_lists():
    a = [[[1.0, 2.0]], [[3.0, 4.0]]]
    b = [[[1.0], [1.0]], [[2.0], [0.5]]]
    r = cukit.batch_matmul(a, b)
    assert isinstance(r, np.ndarray) and r.dtype == np.float64
    np.testing.assert_array_equal(r, np.matmul(a, b))
    c = cukit.chunked_matmul(X, [[1.0], [2.0], [3.0]], max_bytes=1e6, use_gpu=False)
    np.testing.assert_array_equal(c, np.matmul(X, [[1.0], [2.0], [3.0]]))


@pytest.mark.parametrize("activation", [None, *ACTS])
def test_linear_takes_lists_and_a_scalar_bias(activation):
    expected = linear_reference_numpy(np.asarray(X), np.asarray(W), np.asarray(B), activation)
    r = cukit.linear(X, W, B, activation)
    assert isinstance(r, np.ndarray) and r.dtype == np.float64
    assert_close(r, expected)
    # a Python scalar bias broadcasts over out_features and takes x's dtype (NumPy's weak scalars)
    x32, w32 = np.float32(X), np.float32(W)
    r32 = cukit.linear(x32, w32, 0.5, activation)
    assert r32.dtype == np.float32
    assert_close(r32, linear_reference_numpy(x32, w32, np.full(2, 0.5, np.float32), activation))


@pytest.mark.parametrize("activation", ACTS)
def test_bias_act_and_backward_take_lists(activation):
    x, b = np.asarray(X), np.asarray([0.5, -0.25, 1.0])
    y = cukit.bias_act(X, [0.5, -0.25, 1.0], activation)
    assert isinstance(y, np.ndarray) and y.dtype == np.float64
    assert_close(y, bias_act_numpy(x, b, activation))
    g = [[1.0, 2.0, -1.0], [0.5, 0.5, 0.5]]
    dx, db = cukit.bias_act_backward(g, X, (0.5, -0.25, 1.0), activation)
    edx, edb = reference_backward_numpy(np.asarray(g), x, b, activation)
    assert dx.dtype == db.dtype == np.float64
    assert_close(dx, edx)
    assert_close(db, edb)


@pytest.mark.parametrize("bias", [0.5, 1, True, np.float32(0.5)])
def test_bias_act_scalar_bias_broadcasts_like_numpy(bias):
    x = np.float32(X)
    y = cukit.bias_act(x, bias, "gelu")
    assert y.dtype == np.float32  # Python scalars are weak; the NumPy scalar here is float32 already
    assert_close(y, bias_act_numpy(x, np.full(3, bias, np.float32), "gelu"))
    dx, db = cukit.bias_act_backward(np.ones_like(x), x, bias, "gelu")
    assert dx.dtype == db.dtype == np.float32 and db.shape == (3,)


def test_numpy_scalar_bias_keeps_its_dtype_and_list_bias_is_float64():
    x = np.float32(X)
    with pytest.raises(TypeError, match=r"^cukit\.bias_act: bias must have x's dtype float32; got float64"):
        cukit.bias_act(x, np.float64(0.5))
    with pytest.raises(TypeError, match=r"^cukit\.bias_act: bias must have x's dtype float32; got float64"):
        cukit.bias_act(x, [0.5, 0.5, 0.5])  # numpy.asarray's dtype: the documented rule
    with pytest.raises(TypeError, match=r"^cukit\.bias_act: x must have dtype float16, bfloat16, float32 or float64; got int64"):
        cukit.bias_act([[1, 2]], [0, 0])


def test_torch_tensors_mixed_with_lists_become_tensors_and_keep_autograd():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    r = cukit.matmul(a, [[1.0], [2.0]])
    assert isinstance(r, torch.Tensor) and r.dtype == torch.float64 and r.requires_grad
    np.testing.assert_array_equal(r.detach().numpy(), np.matmul(a.detach().numpy(), [[1.0], [2.0]]))
    r.sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [[1.0, 2.0], [1.0, 2.0]])
    # a float32 tensor with a list of Python floats: float64, as numpy.matmul(float32, list) is
    r32 = cukit.matmul([[1.0, 2.0]], torch.ones(2, 1))
    assert isinstance(r32, torch.Tensor) and r32.dtype == torch.float64
    x = torch.randn(2, 3, requires_grad=True)
    y = cukit.bias_act(x, 0.5, "silu")  # the scalar bias takes x's dtype and device
    assert y.dtype == torch.float32 and y.requires_grad
    assert_close(y, bias_act_numpy(x.detach().numpy(), np.full(3, 0.5, np.float32), "silu"))
    xl = torch.tensor(X, dtype=torch.float64)
    assert_close(cukit.linear(xl, W, B, "relu"), linear_reference_numpy(np.asarray(X), np.asarray(W), np.asarray(B), "relu"))
    dx, db = cukit.bias_act_backward(torch.ones(2, 3), torch.zeros(2, 3), 0.0, "relu")
    assert isinstance(dx, torch.Tensor) and db.shape == (3,)


def test_to_torch_and_asarray_take_array_likes():
    t = cukit.to_torch([1.0, 2.0])
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match=r"^cukit\.to_torch: a must be an array-like convertible to a numeric array; got dict"):
        cukit.to_torch({})
    with pytest.raises(TypeError, match=r"^cukit\.asarray: x must be an array-like convertible to a numeric array; got dict"):
        cukit.asarray({})
    if cukit.is_available():
        c = cukit.asarray([1.0, 2.0])
        assert c.dtype == np.float64 and c.get().tolist() == [1.0, 2.0]


def test_arrays_never_take_the_conversion_path(monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("an array argument was converted")

    for module in (cukit.interop, cukit.ops.bias_act, cukit.ops.matmul):
        monkeypatch.setattr(module, "as_array", no_conversion)
    monkeypatch.setattr(cukit._api, "as_arrays", no_conversion)
    x, w, b = np.float32(X), np.float32(W), np.float32(B)
    for mk in (lambda a: a, torch.from_numpy):
        cukit.matmul(mk(x), mk(w.T))
        cukit.batch_matmul(mk(x[None]), mk(w.T[None]))
        cukit.linear(mk(x), mk(w), mk(b), "gelu")
        cukit.bias_act(mk(x), mk(x[0]), "gelu")
        cukit.bias_act_backward(mk(x), mk(x), mk(x[0]), "gelu")
        cukit.chunked_matmul(mk(x), mk(w.T), max_bytes=10**6, use_gpu=False)


# -------------------------------------------------------------------------------------- errors
class Weird:
    """No array, no sequence, no number."""


x32, w32, b32 = np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros(4, np.float32)
c32 = np.zeros(3, np.float32)

ERRORS = [
    # (call, exception, the message's start: function, then argument)
    # wrong types
    (lambda: cukit.matmul([[1.0]], {"b": 1}), TypeError,
     r"cukit\.matmul: b must be an array-like convertible to a numeric array; got dict$"),
    (lambda: cukit.matmul(Weird(), x32), TypeError, r"cukit\.matmul: a must be an array-like .*; got test_api_errors\.Weird"),
    (lambda: cukit.matmul(x32, [1.0, None]), TypeError, r"cukit\.matmul: b must be an array-like .*; got list \(numpy\.asarray gives dtype object\)"),
    (lambda: cukit.matmul(x32, [[1.0], [1.0, 2.0]]), ValueError, r"cukit\.matmul: b must be an array-like .*; got list \(numpy\.asarray: "),
    (lambda: cukit.matmul(x32, "abc"), TypeError, r"cukit\.matmul: b must be an array-like .*; got str"),
    (lambda: cukit.matmul(x32, torch.zeros(3, 2)), TypeError, r"cukit\.matmul: b must be the same array type as a \(numpy\.ndarray\); got torch\.Tensor"),
    (lambda: cukit.matmul(x32, x32.T, out=[0.0]), TypeError, r"cukit\.matmul: out must be the same array type as the inputs \(numpy\.ndarray\); got list"),
    (lambda: cukit.batch_matmul(None, x32[None]), TypeError, r"cukit\.batch_matmul: a must be an array-like .*; got NoneType"),
    (lambda: cukit.linear(x32, {}), TypeError, r"cukit\.linear: weight must be an array-like .*; got dict"),
    (lambda: cukit.linear(x32, w32, object()), TypeError, r"cukit\.linear: bias must be an array-like .*; got object"),
    (lambda: cukit.linear(x32, torch.zeros(4, 3)), TypeError, r"cukit\.linear: weight must be the same array type as x"),
    (lambda: cukit.bias_act(x32, {}), TypeError, r"cukit\.bias_act: bias must be an array-like .*; got dict"),
    (lambda: cukit.bias_act(x32, torch.zeros(3)), TypeError, r"cukit\.bias_act: bias must be the same array type as x \(numpy\.ndarray\); got torch\.Tensor"),
    (lambda: cukit.bias_act_backward({}, x32, c32), TypeError, r"cukit\.bias_act_backward: grad must be an array-like .*; got dict"),
    (lambda: cukit.bias_act_backward(torch.zeros(2, 3), x32, c32), TypeError, r"cukit\.bias_act_backward: grad must be the same array type as x"),
    (lambda: cukit.chunked_matmul(x32, {}, max_bytes=100), TypeError, r"cukit\.chunked_matmul: b must be an array-like .*; got dict"),
    # wrong dtypes: each op lists exactly the dtypes it supports
    (lambda: cukit.bias_act(np.zeros((2, 3), np.complex64), np.zeros(3, np.complex64)), TypeError,
     r"cukit\.bias_act: x must have dtype float16, bfloat16, float32 or float64; got complex64$"),
    (lambda: cukit.bias_act(np.zeros((2, 3), np.int32), np.zeros(3, np.int32)), TypeError,
     r"cukit\.bias_act: x must have dtype float16, bfloat16, float32 or float64; got int32$"),
    (lambda: cukit.bias_act(x32, np.zeros(3)), TypeError, r"cukit\.bias_act: bias must have x's dtype float32; got float64"),
    (lambda: cukit.bias_act_backward(np.zeros((2, 3)), x32, c32), TypeError,
     r"cukit\.bias_act_backward: grad must have x's dtype float32; got grad with dtype float64$"),
    (lambda: cukit.bias_act_backward(np.zeros((2, 3), np.float32), x32, np.zeros(3)), TypeError,
     r"cukit\.bias_act_backward: bias must have x's dtype float32; got float64"),
    (lambda: cukit.linear(x32.astype(np.int64), w32.astype(np.int64)), TypeError,
     r"cukit\.linear: x must have dtype float16, bfloat16, float32 or float64; got int64$"),
    (lambda: cukit.linear(x32, w32.astype(np.float16)), TypeError, r"cukit\.linear: weight must have x's dtype float32; got float16"),
    (lambda: cukit.linear(x32, w32, b32.astype(np.float64)), TypeError, r"cukit\.linear: bias must have x's dtype float32; got float64"),
    (lambda: cukit.matmul(x32, x32.T, out=np.zeros((2, 2))), TypeError, r"cukit\.matmul: out must have the result's dtype float32; got float64"),
    # wrong shapes
    (lambda: cukit.matmul(x32, x32), ValueError, r"cukit\.matmul: the second-to-last dimension of b must equal the last dimension of a \(3\); got 2"),
    (lambda: cukit.matmul(np.zeros((2, 1, 3)), np.zeros((3, 3, 1))), ValueError, r"cukit\.matmul: the batch dimensions of a \(2,\) and b \(3,\) must broadcast"),
    (lambda: cukit.matmul(x32, x32.T, out=np.zeros((3, 3), np.float32)), ValueError, r"cukit\.matmul: out must have the result's shape \(2, 2\); got \(3, 3\)"),
    (lambda: cukit.batch_matmul(x32, x32.T), ValueError, r"cukit\.batch_matmul: a and b must both be 3-D"),
    (lambda: cukit.batch_matmul(np.zeros((2, 1, 3)), np.zeros((3, 3, 1))), ValueError, r"cukit\.batch_matmul: b must have a's batch size 2 \(no broadcasting\); got 3"),
    (lambda: cukit.batch_matmul(np.zeros((2, 1, 3)), np.zeros((2, 2, 1))), ValueError, r"cukit\.batch_matmul: b's K .* K differs \(3 vs 2\)"),
    (lambda: cukit.bias_act(x32, np.zeros(4, np.float32)), ValueError, r"cukit\.bias_act: bias must have shape \(3,\) to match x's last dimension .*; got \(4,\)"),
    (lambda: cukit.bias_act(np.float32(1.0), 0.5), ValueError, r"cukit\.bias_act: x must have at least one dimension"),
    (lambda: cukit.bias_act_backward(np.zeros((2, 2), np.float32), x32, c32), ValueError, r"cukit\.bias_act_backward: grad must have x's shape \(2, 3\); got \(2, 2\)"),
    (lambda: cukit.linear(x32, np.zeros(3, np.float32)), ValueError, r"cukit\.linear: weight must be 2-D \(out_features, in_features\); got shape \(3,\)"),
    (lambda: cukit.linear(x32, np.zeros((4, 5), np.float32)), ValueError, r"cukit\.linear: x's last dimension must equal weight's in_features \(5;"),
    (lambda: cukit.linear(x32, w32, c32), ValueError, r"cukit\.linear: bias must have shape \(4,\), \(out_features,\); got \(3,\)"),
    (lambda: cukit.linear(np.float32(1.0), w32), ValueError, r"cukit\.linear: x must have at least one dimension"),
    # torch tensors: the torch layer's checks are the same, with the same messages
    (lambda: cukit.bias_act_backward(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3), torch.zeros(3)), TypeError,
     r"cukit\.bias_act_backward: grad must have x's dtype float32; got grad with dtype float64$"),
    (lambda: cukit.bias_act(torch.zeros(2, 3, requires_grad=True), torch.zeros(4)), ValueError, r"cukit\.bias_act: bias must have shape \(3,\)"),
    (lambda: cukit.bias_act(torch.zeros(2, 3, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64)), TypeError,
     r"cukit\.bias_act: x must have dtype float16, bfloat16, float32 or float64; got complex64$"),
    (lambda: cukit.linear(torch.zeros(2, 3, requires_grad=True), torch.zeros(4, 5)), ValueError, r"cukit\.linear: x's last dimension must equal"),
    (lambda: cukit.matmul(torch.zeros(()), torch.zeros(4, 2)), ValueError, r"cukit\.matmul: a must have at least 1 dimension"),
    (lambda: cukit.linear(torch.zeros(2, 3), [[1.0, 2.0, 3.0]]), TypeError, r"cukit\.linear: weight must have x's dtype float32; got float64"),
    # bad options
    (lambda: cukit.bias_act(x32, c32, "tanh"), ValueError, r"cukit\.bias_act: activation must be one of 'relu', 'gelu', 'gelu_tanh', 'silu'; got 'tanh'$"),
    (lambda: cukit.bias_act_backward(x32, x32, c32, None), ValueError, r"cukit\.bias_act_backward: activation must be one of 'relu', .*; got None$"),
    (lambda: cukit.linear(x32, w32, b32, "tanh"), ValueError, r"cukit\.linear: activation must be one of None, 'relu', 'gelu', 'gelu_tanh', 'silu'; got 'tanh'$"),
    (lambda: cukit.linear(torch.zeros(2, 3), torch.zeros(4, 3), None, "tanh"), ValueError, r"cukit\.linear: activation must be one of None, 'relu'"),
    # what torch's own CPU ops would accept (a 1-D weight, a broadcast bias, mixed dtypes) is
    # refused on the torch-CPU fast path too, as on the GPU
    (lambda: cukit.linear(torch.zeros(2, 3), torch.zeros(3)), ValueError, r"cukit\.linear: weight must be 2-D"),
    (lambda: cukit.linear(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(1)), ValueError, r"cukit\.linear: bias must have shape \(4,\)"),
    (lambda: cukit.linear(torch.zeros(2, 3), torch.zeros(4, 3, dtype=torch.float64)), TypeError, r"cukit\.linear: weight must have x's dtype float32"),
    (lambda: cukit.bias_act(torch.zeros(2, 3), torch.zeros(1)), ValueError, r"cukit\.bias_act: bias must have shape \(3,\)"),
    (lambda: cukit.bias_act(torch.zeros(2, 3), torch.zeros(3, dtype=torch.float64)), TypeError, r"cukit\.bias_act: bias must have x's dtype float32"),
    (lambda: cukit.bias_act(torch.zeros(2, 3), torch.zeros(3), "tanh"), ValueError, r"cukit\.bias_act: activation must be one of"),
    (lambda: cukit.matmul(torch.zeros(2, 3), torch.zeros(4, 2)), ValueError, r"cukit\.matmul"),
    (lambda: cukit.matmul(x32, x32.T, precision="fp16"), ValueError, r"cukit\.matmul: precision must be one of 'ieee', 'tf32'; got 'fp16'"),
    (lambda: cukit.linear(x32, w32, precision="TF32"), ValueError, r"cukit\.linear: precision must be one of"),
    (lambda: cukit.set_matmul_precision("highest"), ValueError, r"cukit\.set_matmul_precision: precision must be one of"),
    (lambda: cukit.chunked_matmul(x32, x32.T, max_bytes=1, use_gpu=False), ValueError, r"cukit\.chunked_matmul: max_bytes=1 is too small: .* need at least 44$"),
]


@pytest.mark.parametrize(("call", "exc", "pattern"), ERRORS, ids=[f"{i:02d}" for i in range(len(ERRORS))])
def test_errors_name_the_function_and_the_argument(call, exc, pattern):
    with pytest.raises(exc, match="^" + pattern):
        call()


@pytest.mark.parametrize("max_bytes", [0, -1, -0.5, 0.5, math.nan, math.inf, -math.inf])
def test_chunked_matmul_rejects_budgets_below_one_byte(max_bytes):
    with pytest.raises(ValueError, match=r"^cukit\.chunked_matmul: max_bytes must be a real number >= 1 \(bytes\); got "):
        cukit.chunked_matmul(x32, x32.T, max_bytes=max_bytes)


@pytest.mark.parametrize("max_bytes", [True, np.bool_(True), "1e6", None, 1j, [100]])
def test_chunked_matmul_rejects_non_numbers(max_bytes):
    with pytest.raises(TypeError, match=r"^cukit\.chunked_matmul: max_bytes must be a real number >= 1 \(bytes\); got .* \(\w"):
        cukit.chunked_matmul(x32, x32.T, max_bytes=max_bytes)


@pytest.mark.parametrize("max_bytes", [1e6, 1000.9, np.float32(1e3), np.int64(1000), 10**12])
def test_chunked_matmul_takes_real_budgets(max_bytes):
    a, b = np.arange(12.0).reshape(4, 3), np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(cukit.chunked_matmul(a, b, max_bytes=max_bytes, use_gpu=False), a @ b)


def test_chunked_matmul_rounds_a_fractional_budget_down():
    a, b = np.ones((10, 8), np.float32), np.ones((8, 6), np.float32)
    need = 4 * (8 * 6 + 8 + 6)
    assert_close(cukit.chunked_matmul(a, b, max_bytes=need + 0.9, use_gpu=False), np.full((10, 6), 8.0))
    with pytest.raises(ValueError, match=rf"need at least {need}$"):
        cukit.chunked_matmul(a, b, max_bytes=need - 0.1, use_gpu=False)


def test_interop_errors_name_their_function():
    with pytest.raises(TypeError, match=r"^cukit\.interop\.as_dtype: dtype complex64 is not supported"):
        interop.as_dtype(np.complex64)
    with pytest.raises(TypeError, match=r"^cukit\.interop\.as_dtype: dtype must be a dtype"):
        interop.as_dtype(object())
    with pytest.raises(interop.NotAnArrayError, match=r"^cukit\.interop\.array_kind: x must be"):
        interop.array_kind(3.0)
    with pytest.raises(TypeError, match=r"^cukit\.asarray: x must be a GPU array; got a numpy\.ndarray"):
        cukit.asarray(np.zeros(3))


# --------------------------------------------------------------------------- NaN/inf, no warnings
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reference_path_gives_ieee_results_without_warnings(activation, dtype):
    big = np.finfo(dtype).max
    x = np.array([[np.nan, np.inf, -np.inf, big, -big, 0.0]], dtype)
    b = np.array([0.0, 0.0, 0.0, big, -big, 0.0], dtype)  # big + big overflows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = cukit.bias_act(x, b, activation)
        cukit.bias_act_backward(np.ones_like(x), x, b, activation)
        cukit.linear(x, np.ones((2, 6), dtype), None, activation)
    assert np.isnan(y[0, 0]) and y[0, 1] == np.inf  # NaN stays NaN; act(+inf) = +inf for all four
    assert y[0, 3] == np.inf


# ---------------------------------------------------------------------------------------- dir()
def test_dir_lists_public_names_and_lazy_submodules_only():
    names = dir(cukit)
    assert {"nn", "optim", "testing", "torch", "train", "matmul", "bias_act", "asarray", "interop"} <= set(names)
    assert not {"Any", "annotations", "importlib"} & set(names)
    assert names == sorted(names)
    assert all(hasattr(cukit, n) for n in names if n not in ("optim", "train"))
