"""conv2d: y = act(conv2d(x, weight) + bias). Every path against an independent float64 oracle
(torch.nn.functional and torch autograd on float64 copies), forward and backward; the torch
integration (autograd to second order, opcheck, compile under both policies, autocast, vmap, CUDA
graphs, streams), cukit.nn.Conv2d and its patch rule; bad input.

A convolution sums C*kH*kW products, so its error is bounded by that count times the accumulation
epsilon times the sum of the products' magnitudes (Higham's bound), besides the final rounding:
:func:`check` takes that magnitude (the same convolution of |x|, |w|, |b|)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
from cukit.ops import conv2d as cv
from cukit.testing import arrays, backend_dtypes, to_numpy, tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional
import cukit.nn  # noqa: E402  (imports torch)

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
NUMPY_FLOATS = backend_dtypes("numpy", FLOATS)
TORCH_ACT = {
    None: lambda t: t,
    "relu": F.relu,
    "gelu": lambda t: F.gelu(t, approximate="none"),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


# ------------------------------------------------------------------------------------- oracles
def _f64(a) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.asarray(to_numpy(a), np.float64))


def oracle(x, w, b, stride, padding, dilation, activation):
    """(y, |terms| summed like y) by torch.nn.functional in float64."""
    xt, wt, bt = _f64(x), _f64(w), _f64(b)
    y = TORCH_ACT[activation](F.conv2d(xt, wt, bt, stride, padding, dilation))
    mag = F.conv2d(xt.abs(), wt.abs(), None if bt is None else bt.abs(), stride, padding, dilation)
    return y.numpy(), mag.numpy()


def oracle_backward(dy, x, w, b, stride, padding, dilation, activation):
    """((dx, dw, db), (their |terms| sums)) from torch autograd in float64."""
    xt = _f64(x).requires_grad_()
    wt = _f64(w).requires_grad_()
    bt = None if b is None else _f64(b).requires_grad_()
    y = TORCH_ACT[activation](F.conv2d(xt, wt, bt, stride, padding, dilation))
    g = torch.autograd.grad(y, [t for t in (xt, wt, bt) if t is not None], _f64(dy), allow_unused=True)
    dx, dw = (torch.zeros_like(xt) if g[0] is None else g[0]), g[1]
    db = g[2] if bt is not None else None
    # magnitudes: the same sums over |g'|, g' = dy * act'(z)
    with torch.enable_grad():
        z = F.conv2d(xt.detach(), wt.detach(), None if bt is None else bt.detach(), stride, padding, dilation)
        z.requires_grad_()
        (gp,) = torch.autograd.grad(TORCH_ACT[activation](z), z, _f64(dy))
    ga = gp.abs()
    xa, wa = xt.detach().abs(), wt.detach().abs()
    ma = torch.autograd.grad(F.conv2d(xa.requires_grad_(), wa, None, stride, padding, dilation), xa, ga)[0]
    mw = torch.autograd.grad(F.conv2d(xa.detach(), wa.requires_grad_(), None, stride, padding, dilation), wa, ga)[0]
    mb = ga.sum((0, 2, 3))
    out = [t.detach().numpy() if t is not None else None for t in (dx, dw, db)]
    return out, [ma.numpy(), mw.numpy(), mb.numpy()]


def check(actual, expected, mag, dtype: str, nterms: int, *, stored: bool = False, what: str = "y") -> None:
    """|actual - expected| <= atol + rtol |expected| + (1.2 nterms eps_acc + (2 rtol if stored)) mag:
    one rounding to dtype, the accumulation's error bound over nterms products (1.2: the largest
    slope of the activations), and for 16-bit backward results the roundings of the stored
    intermediates (z, dy * act'(z))."""
    atol, rtol = tolerance(dtype)
    eps = np.finfo(np.float64 if dtype == "float64" else np.float32).eps
    c = 1.2 * max(nterms, 1) * eps + (2 * rtol if stored and dtype in ("float16", "bfloat16") else 0.0)
    a = to_numpy(actual).astype(np.float64)
    assert a.shape == expected.shape, (what, a.shape, expected.shape)
    bound = atol + rtol * np.abs(expected) + c * mag
    err = np.abs(a - expected)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(f"{what} ({dtype}) off at {i}: got {a[i]}, expected {expected[i]} (bound {bound[i]}); "
                             f"{int(bad.sum())} of {bad.size} elements")


# ----------------------------------------------------------------------------------- strategies
@st.composite
def conv_cases(draw, max_n: int = 3, max_c: int = 5, max_k: int = 6, sides=(1, 2, 5, 7, 8, 13)):
    """(x shape, w shape, stride, padding, dilation): 1x1 to 3x3 kernels (non-square too), stride
    1-2, dilation 1-2, padding 0/1/2, pairs, 'same'/'valid', odd sides, C=1, K=1, N=0."""
    R, S = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3]))
    stride = draw(st.sampled_from([1, 2, (1, 2), (2, 1)]))
    dilation = draw(st.sampled_from([1, 2, (2, 1)]))
    pads = [0, 1, 2, (0, 1), "valid"] + (["same"] if stride == 1 else [])
    padding = draw(st.sampled_from(pads))
    _, (pt, pl, pb, pr), (dh, dw) = cv.parse_params(stride, padding, dilation, (R, S))
    H = max(draw(st.sampled_from(sides)), dh * (R - 1) + 1 - pt - pb)
    W = max(draw(st.sampled_from(sides)), dw * (S - 1) + 1 - pl - pr)
    N = draw(st.sampled_from([0, 1, 2, max_n]))
    C = draw(st.sampled_from([1, 2, max_c]))
    K = draw(st.sampled_from([1, 3, max_k]))
    return (N, C, H, W), (K, C, R, S), stride, padding, dilation


def _nterms(w_shape) -> int:
    return int(np.prod(w_shape[1:]))


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(case=conv_cases(), dtype=st.sampled_from(NUMPY_FLOATS), activation=st.sampled_from(ACTS),
       bias=st.booleans(), data=st.data())
def test_numpy_fallback_matches_oracle(case, dtype, activation, bias, data):
    xs, ws, stride, padding, dilation = case
    x = data.draw(arrays("numpy", dtype, xs))
    w = data.draw(arrays("numpy", dtype, ws, min_value=-1, max_value=1))
    b = data.draw(arrays("numpy", dtype, ws[:1])) if bias else None
    y = cukit.conv2d(x, w, b, stride, padding, dilation, activation)
    ref, mag = oracle(x, w, b, stride, padding, dilation, activation)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.flags.c_contiguous
    check(y, ref, mag, dtype, 0)  # float64 maths: one rounding


@given(case=conv_cases(), dtype=st.sampled_from(FLOATS), activation=st.sampled_from(ACTS), bias=st.booleans(),
       noncontiguous=st.booleans(), data=st.data())
def test_torch_cpu_forward_matches_oracle(case, dtype, activation, bias, noncontiguous, data):
    xs, ws, stride, padding, dilation = case
    x = data.draw(arrays("torch", dtype, xs, noncontiguous=noncontiguous))
    w = data.draw(arrays("torch", dtype, ws, min_value=-1, max_value=1, noncontiguous=noncontiguous))
    b = data.draw(arrays("torch", dtype, ws[:1])) if bias else None
    y = cukit.conv2d(x, w, b, stride, padding, dilation, activation)
    ref, mag = oracle(x, w, b, stride, padding, dilation, activation)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.is_contiguous()
    check(y, ref, mag, dtype, _nterms(ws))


@given(case=conv_cases(max_n=2, max_c=3, max_k=4), dtype=st.sampled_from(["float32", "float64"]),
       activation=st.sampled_from(ACTS), bias=st.booleans(), data=st.data())
def test_torch_cpu_backward_matches_oracle(case, dtype, activation, bias, data):
    xs, ws, stride, padding, dilation = case
    x = data.draw(arrays("torch", dtype, xs)).requires_grad_()
    w = data.draw(arrays("torch", dtype, ws, min_value=-1, max_value=1)).requires_grad_()
    b = data.draw(arrays("torch", dtype, ws[:1])).requires_grad_() if bias else None
    y = cukit.conv2d(x, w, b, stride, padding, dilation, activation)
    dy = data.draw(arrays("torch", dtype, tuple(y.shape)))
    y.backward(dy)
    (dx, dw, db), (mx, mw, mb) = oracle_backward(dy, x, w, b, stride, padding, dilation, activation)
    n = int(np.prod(y.shape)) // max(1, ws[0])
    check(x.grad, dx, mx, dtype, ws[0] * ws[2] * ws[3], what="dx")
    check(w.grad, dw, mw, dtype, n, what="dw")
    if bias:
        check(b.grad, db, mb, dtype, n, what="db")


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize(("stride", "padding", "dilation", "k"), [
    (1, 1, 1, 3), (2, 0, 1, 3), (1, "same", (2, 1), 2), ((2, 1), (1, 2), 1, (3, 2)),
])
def test_cpu_gradcheck_and_gradgradcheck(activation, stride, padding, dilation, k):
    kh, kw = (k, k) if isinstance(k, int) else k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 2, kh, kw, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)

    def f(x, w, b):
        return cukit.conv2d(x, w, b, stride, padding, dilation, activation)

    if activation == "relu":  # finite differences disagree at the kink: the seed keeps z clear of it
        assert F.conv2d(x, w, b, stride, padding, dilation).abs().min() > 1e-3
    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(f, (x, w, b), fast_mode=True)  # full mode: the test below


def test_cpu_gradgradcheck_without_bias_and_input_grad():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, generator=g)  # no grad: no dx in the backward
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda w: cukit.conv2d(x, w, None, 1, 1, 1, "silu"), (w,))
    xg = x.clone().requires_grad_()
    b = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w, b: cukit.conv2d(x, w, b, 1, "same", 1, "gelu"), (xg, w, b))


def test_cpu_opcheck():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 6, 5, generator=g, requires_grad=True)
    w = torch.randn(4, 3, 2, 2, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    op = torch.ops.cukit.conv2d.default
    for act, save in [("gelu", True), ("relu", False), (None, False), ("silu", False), (None, True)]:
        torch.library.opcheck(op, (x, w, b, [1, 1], [1, 0, 1, 1], [1, 1], act, save))
    torch.library.opcheck(op, (x, w, None, [2, 1], [0, 0, 0, 0], [1, 2], "gelu_tanh", True))
    dy = torch.randn(2, 4, 6, 5, generator=g)
    z = torch.randn(2, 4, 6, 5, generator=g)
    bwd = torch.ops.cukit.conv2d_backward.default
    torch.library.opcheck(bwd, (dy, x.detach(), w.detach(), b.detach(), z, [1, 1], [1, 0, 0, 1], [1, 1], "gelu", True))
    torch.library.opcheck(bwd, (dy, x.detach(), w.detach(), None, None, [1, 1], [1, 0, 0, 1], [1, 1], None, False))


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    def f(x, w, b):
        return cukit.conv2d(x * 2, w, b, 1, 1, 1, "gelu").square().mean()

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, 6, generator=g, requires_grad=True)
    w = torch.randn(5, 3, 3, 3, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, b)
    out.backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = f(x2, w2, b2)
    ref.backward()
    for got, want in ((out, ref), (x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cpu_compile_no_grad_and_module(compile_policy: str):
    m = torch.nn.Sequential(cukit.nn.Conv2d(2, 4, 3, padding="same", activation="relu"), torch.nn.Flatten())
    x = torch.randn(3, 2, 5, 5)
    with torch.no_grad():
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        want = F.relu(F.conv2d(x, m[0].weight, m[0].bias, padding="same")).flatten(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cpu_autocast_runs_in_the_autocast_dtype_like_conv2d():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 8, 8, generator=g)
    w = torch.randn(4, 3, 3, 3, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = cukit.conv2d(x, w, b, 1, 1, 1, "gelu")
        ref = F.gelu(F.conv2d(x, w, b, padding=1))
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2)
    y.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_cpu_vmap_and_per_sample_gradients():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 3, 2, 2, dtype=torch.float64, generator=g)
    b = torch.randn(4, dtype=torch.float64, generator=g)
    xb = torch.randn(3, 2, 3, 6, 5, dtype=torch.float64, generator=g)
    yv = torch.func.vmap(lambda x: cukit.conv2d(x, w, b, 1, 1, 1, "gelu"))(xb)
    torch.testing.assert_close(yv, torch.stack([F.gelu(F.conv2d(x, w, b, padding=1)) for x in xb]))
    wb = torch.randn(3, 4, 3, 2, 2, dtype=torch.float64, generator=g)
    yv = torch.func.vmap(lambda x, w: cukit.conv2d(x, w, b, 1, "same", 1, "silu"))(xb, wb)
    torch.testing.assert_close(yv, torch.stack([F.silu(F.conv2d(x, w_, b, padding="same")) for x, w_ in zip(xb, wb, strict=True)]))

    def loss(p, x, conv):
        return conv(x[None], p["w"], p["b"]).square().sum()

    params = {"w": w, "b": b}
    mine = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(
        params, xb[:, 0], lambda x, w, b: cukit.conv2d(x, w, b, 1, 1, 1, "gelu"))
    for i in range(3):
        ref = torch.func.grad(loss)(params, xb[i, 0], lambda x, w, b: F.gelu(F.conv2d(x, w, b, padding=1)))
        torch.testing.assert_close(mine["w"][i], ref["w"])
        torch.testing.assert_close(mine["b"][i], ref["b"])


@pytest.mark.parametrize("shape", [(0, 3, 5, 5), (2, 0, 5, 5)])
def test_size_zero(shape):
    N, C = shape[:2]
    x, w, b = np.zeros(shape, np.float32), np.ones((4, C, 3, 3), np.float32), np.full(4, 0.5, np.float32)
    for args in ((x, w, b), tuple(torch.from_numpy(a) for a in (x, w, b))):
        y = cukit.conv2d(*args, 1, 1, 1, "relu")
        assert tuple(y.shape) == (N, 4, 5, 5)
        assert float(np.abs(to_numpy(y) - 0.5).sum()) == 0.0  # C = 0: relu(bias); N = 0: nothing
    x = torch.zeros(shape, requires_grad=True)
    w = torch.ones(4, C, 3, 3, requires_grad=True)
    b = torch.zeros(4, requires_grad=True)
    cukit.conv2d(x, w, b, 1, 1, 1, "gelu").sum().backward()
    assert x.grad.shape == shape and w.grad.shape == (4, C, 3, 3) and b.grad.shape == (4,)


def test_op_without_saved_preactivation_recomputes_it():
    """torch.ops.cukit.conv2d called directly with save_preact=False, then differentiated: the
    backward recomputes z (the entry point always saves it when autograd needs it)."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    y, z = torch.ops.cukit.conv2d(x, w, b, [1, 1], [1, 1, 1, 1], [1, 1], "gelu", False)
    assert z.numel() == 0 and not z.requires_grad
    got = torch.autograd.grad(y.square().sum(), (x, w, b))
    want = torch.autograd.grad(F.gelu(F.conv2d(x, w, b, padding=1)).square().sum(), (x, w, b))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


def test_unbatched_input_and_array_likes():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 6, 5, generator=g)
    w = torch.randn(4, 3, 3, 3, generator=g)
    y = cukit.conv2d(x, w, None, 1, 1)
    assert y.shape == (4, 6, 5)
    torch.testing.assert_close(y, F.conv2d(x, w, padding=1))
    yn = cukit.conv2d(x.double().numpy(), w.tolist(), 0.25, 1, 1)  # a list weight (float64), a scalar bias
    assert yn.dtype == np.float64
    np.testing.assert_allclose(yn, F.conv2d(x.double(), w.double(), padding=1).numpy() + 0.25, rtol=1e-12)
    with pytest.raises(TypeError, match=r"weight must have x's dtype float32; got float64"):
        cukit.conv2d(x.numpy(), w.tolist())  # NumPy's conversion: a list of floats is float64
    yt = cukit.conv2d(x, w, 0.25, 1, 1)  # a scalar bias beside tensors: the torch layer
    torch.testing.assert_close(yt, F.conv2d(x, w, padding=1) + 0.25)


def test_params_parsing_matches_torch():
    p = cv.parse_params
    assert p(1, 0, 1, (3, 3)) == ((1, 1), (0, 0, 0, 0), (1, 1))
    assert p((2, 1), (1, 2), [1, 2], (3, 3)) == ((2, 1), (1, 2, 1, 2), (1, 2))
    assert p(1, "valid", 1, (3, 3)) == ((1, 1), (0, 0, 0, 0), (1, 1))
    assert p(1, "same", 1, (3, 3)) == ((1, 1), (1, 1, 1, 1), (1, 1))
    assert p(1, "same", 1, (4, 2)) == ((1, 1), (1, 0, 2, 1), (1, 1))  # the odd pixel at the far side, as torch
    assert p(1, "same", (1, 2), (2, 2)) == ((1, 1), (0, 1, 1, 1), (1, 2))
    x = torch.randn(1, 1, 6, 7)
    for k in [(4, 2), (2, 3), (1, 4)]:
        w = torch.randn(2, 1, *k)
        torch.testing.assert_close(cukit.conv2d(x, w, None, 1, "same"), F.conv2d(x, w, padding="same"))
    assert cv.conv_params((1, 1), [1, 1], 1, (3, 3)) is cv.conv_params((1, 1), [1, 1], 1, (3, 3))  # cached
    for bad in (1.0, True, (1, 1.0)):  # hash like 1 or (1, 1): never served from the cache
        with pytest.raises(ValueError, match="stride must be"):
            cv.conv_params(bad, 0, 1, (3, 3))


def test_wgrad_split_plan():
    """wgrad's split of the N*P*Q pixels: a whole number of 8-pixel stages each, none empty, all
    covered, the grid's z limit kept."""
    for npq in [1, 7, 8, 63, 64, 65, 4096, 100352, 10**7]:
        for tiles in [1, 3, 18, 1000]:
            splits, per = cv._splits(npq, tiles, 132)
            assert per % 8 == 0 and 1 <= splits <= 65535
            assert (splits - 1) * per < npq <= splits * per
            assert splits <= -(-npq // 64)  # at least 8 stages of 8 pixels per split, on average
    assert cv._splits(0, 3, 132) == (0, 0)
    assert [cv._tile_cols(n) for n in (1, 16, 17, 32, 33, 64, 1000)] == [16, 16, 32, 32, 64, 64, 64]


# ----------------------------------------------------------------------------------- modules
def test_module_is_a_drop_in_for_nn_conv2d():
    torch.manual_seed(7)
    ref = torch.nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2))
    torch.manual_seed(7)
    m = cukit.nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), activation="silu")
    assert isinstance(m, torch.nn.Conv2d) and m.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters(), strict=True))
    x = torch.randn(2, 3, 9, 8)
    torch.testing.assert_close(m(x), F.silu(ref(x)))
    assert "activation='silu'" in repr(m)
    with torch.no_grad():
        ref.weight.mul_(2)
    m.load_state_dict(ref.state_dict())  # checkpoints load either way
    torch.testing.assert_close(m(x), F.silu(ref(x)))
    with pytest.raises(ValueError, match=r"cukit\.nn\.Conv2d: activation must be one of"):
        cukit.nn.Conv2d(3, 5, 3, activation="tanh")


@pytest.mark.parametrize("kw", [{"groups": 2}, {"padding_mode": "reflect"}])
def test_module_falls_back_to_torch_for_groups_and_padding_modes(kw):
    torch.manual_seed(8)
    m = cukit.nn.Conv2d(4, 6, 3, padding=1, activation="gelu", **kw)
    x = torch.randn(2, 4, 7, 7)
    ref = torch.nn.Conv2d(4, 6, 3, padding=1, **kw)
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), F.gelu(ref(x)))


def test_patch_swaps_and_fuses_conv_activation_pairs():
    torch.manual_seed(9)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.GELU(),
        torch.nn.Conv2d(4, 8, 3, padding="same"), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, groups=2), torch.nn.SiLU(),
        torch.nn.Conv2d(8, 8, 1), torch.nn.Tanh(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10),
    )
    x = torch.randn(2, 1, 8, 8)
    want = model(x)
    keys = model.state_dict().keys()
    params = list(model.parameters())
    cukit.nn.patch(model)
    r = model.cukit_patch_report
    assert [type(m).__name__ for m in model] == ["Conv2d", "Identity", "Conv2d", "Identity", "Conv2d", "SiLU",
                                                 "Conv2d", "Tanh", "Flatten", "Linear"]
    assert isinstance(model[0], cukit.nn.Conv2d) and model[0].activation == "gelu"
    assert model[2].activation == "relu" and model[6].activation is None
    assert type(model[4]) is torch.nn.Conv2d  # groups=2 stays torch's
    assert r.counts["conv2d"] == 5  # 3 swaps, 2 fusions
    skipped = {c.what for c in r.skipped if c.rule == "conv2d"}
    assert any("groups=2" in s for s in skipped) and any("Tanh has no cukit epilogue" in s for s in skipped)
    assert model.state_dict().keys() == keys and all(p is q for p, q in zip(model.parameters(), params, strict=True))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)
    cukit.nn.patch(model)  # idempotent
    assert model.cukit_patch_report.counts.get("conv2d", 0) == 0


def test_patch_switches():
    def seq():
        return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU())

    m = cukit.nn.patch(seq(), fuse_activations=False)
    assert isinstance(m[0], cukit.nn.Conv2d) and m[0].activation is None and isinstance(m[1], torch.nn.ReLU)
    m = cukit.nn.patch(seq(), conv2d=False)
    assert type(m[0]) is torch.nn.Conv2d
    m = seq()
    m[1].register_forward_hook(lambda *a: None)
    cukit.nn.patch(m)
    assert m[0].activation is None and any("hooks" in c.what for c in m.cukit_patch_report.skipped)


# --------------------------------------------------------------------------------- benchmark
def test_bench_conv2d_dry_run(tmp_path, capsys):
    """benchmarks/bench_conv2d.py --dry-run: every case validated and timed on the CPU, results saved,
    the summary last (numbers that mean nothing: the code paths are the point)."""
    import importlib
    import json
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    bench = importlib.import_module("bench_conv2d")
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SUMMARY bench_conv2d" in out and "all cases validated and timed" in out
    rows = json.loads((tmp_path / "bench_conv2d.json").read_text())["rows"]
    assert {(r["shape"], r["pass"], r["impl"]) for r in rows} == {
        (s.name, p, i) for s in bench.SHAPES_DRY for p in bench.PASSES for i in ("cukit", "torch", "torch.compile")}
    assert all(r.get("error") is None and r["kernel_us"] > 0 and r["host_us"] > 0 for r in rows)


# ----------------------------------------------------------------------------------- errors
def test_bad_input_raises_clear_errors():
    x = np.zeros((2, 3, 5, 5), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    cases = [
        (ValueError, r"cukit\.conv2d: activation must be one of None, 'relu'", dict(activation="tanh")),
        (ValueError, r"cukit\.conv2d: weight must be 4-D", dict(w=np.zeros((4, 3, 3), np.float32))),
        (ValueError, r"cukit\.conv2d: weight must have x's 3 input channels", dict(w=np.zeros((4, 2, 3, 3), np.float32))),
        (ValueError, r"cukit\.conv2d: bias must have shape \(4,\)", dict(b=np.zeros(5, np.float32))),
        (TypeError, r"cukit\.conv2d: weight must have x's dtype float32; got float64", dict(w=np.zeros((4, 3, 3, 3)))),
        (TypeError, r"cukit\.conv2d: x must have dtype float16, bfloat16, float32 or float64; got int32",
         dict(x=np.zeros((2, 3, 5, 5), np.int32), w=np.zeros((4, 3, 3, 3), np.int32))),
        (ValueError, r"cukit\.conv2d: stride must be a positive int or a pair of positive ints; got 0", dict(stride=0)),
        (ValueError, r"cukit\.conv2d: padding must be a non-negative int or a pair of them; got -1", dict(padding=-1)),
        (ValueError, r"cukit\.conv2d: padding must be an int, a pair of ints, 'same' or 'valid'", dict(padding="full")),
        (ValueError, r"cukit\.conv2d: padding='same' needs stride 1", dict(padding="same", stride=2)),
        (ValueError, r"cukit\.conv2d: dilation must be a positive int", dict(dilation=(1, 2, 3))),
        (ValueError, r"cukit\.conv2d: the padded input \(5 x 5\) must be at least the dilated kernel \(7 x 7\)",
         dict(dilation=3)),
        (ValueError, r"cukit\.conv2d: x must be 4-D \(N, C, H, W\) or 3-D", dict(x=np.zeros((3, 5), np.float32))),
        (ValueError, r"cukit\.conv2d: weight must have at least one output channel",
         dict(w=np.zeros((0, 3, 3, 3), np.float32))),
    ]
    for mod in (np, torch):
        for exc, msg, kw in cases:
            args = {"x": x, "w": w, "b": None, "stride": 1, "padding": 0, "dilation": 1, "activation": None} | kw
            if mod is torch:
                args = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
            with pytest.raises(exc, match=msg):
                cukit.conv2d(args["x"], args["w"], args["b"], args["stride"], args["padding"], args["dilation"],
                             args["activation"])
    with pytest.raises(TypeError, match=r"cukit\.conv2d: weight must be the same array type as x"):
        cukit.conv2d(x, torch.zeros(4, 3, 3, 3))
    with pytest.raises(TypeError, match=r"cukit\.conv2d: x must be an array-like"):
        cukit.conv2d({}, w)


# ------------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = ["torch-cuda", "cupy"]


def _cuda_case(xs, ws, dtype, bias=True, seed=0, noncontiguous=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(xs, device="cuda", generator=g).to(dt)
    w = (torch.rand(ws, device="cuda", generator=g) * 2 - 1).to(dt)
    b = torch.randn(ws[0], device="cuda", generator=g).to(dt) if bias else None
    if noncontiguous:
        x = x.to(memory_format=torch.channels_last)
    return x, w, b


def _gpu_forward_backward(x, w, b, stride, padding, dilation, activation, dtype, check_backward=True):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = cukit.conv2d(x, w, b, stride, padding, dilation, activation)
    ref, mag = oracle(x, w, b, stride, padding, dilation, activation)
    assert y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    check(y, ref, mag, dtype, _nterms(w.shape))
    if not check_backward:
        return
    dy = torch.randn(y.shape, device="cuda", dtype=torch.float32).to(y.dtype)
    y.backward(dy)
    (dx, dw, db), (mx, mw, mb) = oracle_backward(dy, x, w, b, stride, padding, dilation, activation)
    n = y.numel() // max(1, w.shape[0])
    check(x.grad, dx, mx, dtype, w.shape[0] * w.shape[2] * w.shape[3], stored=True, what="dx")
    check(w.grad, dw, mw, dtype, n, stored=True, what="dw")
    if b is not None:
        check(b.grad, db, mb, dtype, n, stored=True, what="db")


@pytest.mark.gpu
@given(case=conv_cases(max_n=5, max_c=40, max_k=70, sides=(1, 2, 5, 7, 8, 13, 16, 17, 33)),
       dtype=st.sampled_from(FLOATS), activation=st.sampled_from(ACTS), bias=st.booleans(),
       noncontiguous=st.booleans(), seed=st.integers(0, 2**16))
def test_gpu_forward_backward_match_oracle(case, dtype, activation, bias, noncontiguous, seed):
    xs, ws, stride, padding, dilation = case
    x, w, b = _cuda_case(xs, ws, dtype, bias, seed, noncontiguous)
    _gpu_forward_backward(x, w, b, stride, padding, dilation, activation, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize(("xs", "ws"), [((64, 1, 8, 8), (16, 1, 3, 3)), ((64, 16, 8, 8), (32, 16, 3, 3))])
def test_gpu_demo_shapes(xs, ws, activation, dtype):
    """The demo CNN's two convolutions (3x3, padding 1, batch 64)."""
    x, w, b = _cuda_case(xs, ws, dtype)
    _gpu_forward_backward(x, w, b, 1, 1, 1, activation, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_larger_shape(dtype):
    """The benchmark's larger case (C = K = 64, 56x56, 3x3), batch 4: the 64-wide tiles, many splits."""
    x, w, b = _cuda_case((4, 64, 56, 56), (64, 64, 3, 3), dtype)
    _gpu_forward_backward(x, w, b, 1, 1, 1, "relu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(("xs", "ws", "stride", "padding", "dilation"), [
    ((3, 5, 7, 9), (8, 5, 3, 3), 1, 1, 1),  # P*Q odd: the scalar store path; BN 16
    ((2, 24, 9, 10), (24, 24, 1, 1), 1, 0, 1),  # 1x1, BN 32 for both directions
    ((2, 40, 11, 11), (40, 40, 3, 3), 2, 1, 1),  # BN 64, stride 2 in dgrad
    ((1, 3, 33, 17), (100, 3, 5, 3), (2, 1), (2, 0), (1, 2)),  # two column tiles, dilation
    ((5, 70, 6, 6), (3, 70, 3, 3), 1, "same", 2),  # C*R*S = 630: 10 row tiles in wgrad
])
def test_gpu_tile_paths(xs, ws, stride, padding, dilation):
    for act in ("gelu", None):
        x, w, b = _cuda_case(xs, ws, "float32", seed=len(xs))
        _gpu_forward_backward(x, w, b, stride, padding, dilation, act, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize(("xs", "ws"), [((0, 3, 5, 5), (4, 3, 3, 3)), ((2, 0, 5, 5), (4, 0, 3, 3))])
def test_gpu_size_zero(xs, ws):
    """N = 0 (no pixels: no wgrad launch, the reduction writes zeros) and C = 0 (y = act(bias), no
    dgrad, an empty dW, db from the one crs tile)."""
    x = torch.zeros(xs, device="cuda", requires_grad=True)
    w = torch.ones(ws, device="cuda", requires_grad=True)
    b = torch.full((ws[0],), 0.5, device="cuda", requires_grad=True)
    y = cukit.conv2d(x, w, b, 1, 1, 1, "relu")
    assert y.shape == (xs[0], ws[0], 5, 5) and bool((y == 0.5).all())
    y.backward(torch.ones_like(y))
    assert x.grad.shape == xs and w.grad.shape == ws and not w.grad.any()
    assert torch.equal(b.grad, torch.full_like(b, float(xs[0] * 25)))


@pytest.mark.gpu
def test_gpu_cupy_forward_and_backward():
    import cupy

    x, w, b = _cuda_case((3, 4, 9, 7), (6, 4, 3, 3), "float32")
    xc, wc, bc = (cupy.asarray(t) for t in (x, w, b))
    params = cv.conv_params(1, 1, 1, (3, 3))
    y, z = cv.forward_gpu(xc, wc, bc, params, cv.ACTIVATIONS["silu"], True)
    assert isinstance(y, cupy.ndarray)
    ref, mag = oracle(x, w, b, 1, 1, 1, "silu")
    check(y, ref, mag, "float32", 36)
    check(cukit.conv2d(xc, wc, bc, 1, 1, 1, "silu"), ref, mag, "float32", 36)
    dy = cupy.asarray(torch.randn(y.shape, device="cuda"))
    dx, dw, db = cv.backward_gpu(dy, xc, wc, z, params, cv.ACTIVATIONS["silu"], True, True)
    (rdx, rdw, rdb), (mx, mw, mb) = oracle_backward(dy, x, w, b, 1, 1, 1, "silu")
    check(dx, rdx, mx, "float32", 54, what="dx")
    check(dw, rdw, mw, "float32", 3 * 9 * 7, what="dw")
    check(db, rdb, mb, "float32", 3 * 9 * 7, what="db")


@pytest.mark.gpu
def test_gpu_every_output_element_is_written():
    x, w, b = _cuda_case((7, 5, 13, 11), (9, 5, 3, 3), "float32")
    torch.full((7, 9, 13, 11), float("nan"), device="cuda")  # freed: the next output of this size reuses it
    for act in ACTS:
        y = cukit.conv2d(x, w, b, 1, 1, 1, act)
        assert torch.isfinite(y).all(), act


@pytest.mark.gpu
def test_gpu_weight_and_bias_gradients_are_deterministic():
    x, w, b = _cuda_case((32, 16, 16, 16), (32, 16, 3, 3), "float32")
    grads = []
    for _ in range(3):
        ww, bb = w.clone().requires_grad_(), b.clone().requires_grad_()
        cukit.conv2d(x, ww, bb, 1, 1, 1, "gelu").square().sum().backward()
        grads.append((ww.grad, bb.grad))
    assert all(torch.equal(grads[0][0], g[0]) and torch.equal(grads[0][1], g[1]) for g in grads[1:])


@pytest.mark.gpu
def test_gpu_no_input_gradient_when_x_needs_none():
    x, w, b = _cuda_case((4, 3, 8, 8), (5, 3, 3, 3), "float32")
    w.requires_grad_()
    cukit.conv2d(x, w, b, 1, 1, 1, "gelu").sum().backward()
    assert x.grad is None and w.grad is not None
    (_, dw, _), (_, mw, _) = oracle_backward(torch.ones(4, 5, 8, 8), x, w, b, 1, 1, 1, "gelu")
    check(w.grad, dw, mw, "float32", 256, what="dw")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_gradcheck_float64(activation):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(4, 3, 3, 2, dtype=torch.float64, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device="cuda", generator=g, requires_grad=True)

    def f(x, w, b):
        return cukit.conv2d(x, w, b, (2, 1), 1, (1, 2), activation)

    assert torch.autograd.gradcheck(f, (x, w, b))  # nondet_tol 0: cukit's backward is bitwise reentrant
    # The double backward is torch's convolutions (cuDNN), whose float64 weight gradient may add
    # with atomics: reentrant to rounding only. (The first GPU run failed the check at 0 for gelu,
    # gelu_tanh and silu only: relu's act'' = 0 leaves just products with the sparse one-hot
    # upstream gradients; test_gpu_backward_is_bitwise_reproducible covers cukit's own backward.)
    assert torch.autograd.gradgradcheck(f, (x, w, b), nondet_tol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_backward_is_bitwise_reproducible(activation, dtype):
    """Every gradient (dx, dW, db) bitwise equal over repeated backward passes of one graph, with
    one-hot and dense upstream gradients (gradcheck's reentrancy check, at scale)."""
    x, w, b = _cuda_case((2, 3, 6, 5), (4, 3, 3, 2), str(dtype).removeprefix("torch."))
    for t in (x, w, b):
        t.requires_grad_()
    y = cukit.conv2d(x, w, b, (2, 1), 1, (1, 2), activation)
    ones = [torch.zeros_like(y).view(-1).index_fill_(0, torch.tensor([i], device="cuda"), 1).view(y.shape)
            for i in range(0, y.numel(), 7)]
    for dy in [*ones, torch.randn_like(y)]:
        g1 = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        g2 = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        for name, a, c in zip(("dx", "dw", "db"), g1, g2, strict=True):
            assert torch.equal(a, c), (name, (a - c).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(dtype):
    x = torch.randn(2, 3, 9, 7, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(8, 3, 3, 3, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(8, device="cuda", dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.conv2d.default, (x, w, b, [1, 1], [1, 1, 1, 1], [1, 1], "gelu", True))
    torch.library.opcheck(torch.ops.cukit.conv2d.default, (x, w, None, [2, 2], [0, 0, 0, 0], [1, 1], "relu", False))
    dy = torch.randn(2, 8, 9, 7, device="cuda", dtype=dtype)
    z = torch.randn(2, 8, 9, 7, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.cukit.conv2d_backward.default,
                          (dy, x.detach(), w.detach(), b.detach(), z, [1, 1], [1, 1, 1, 1], [1, 1], "silu", True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_torch_compile_fullgraph_inductor(compile_policy: str, dtype):
    def f(x, w, b):
        return cukit.conv2d(x * 2, w, b, 1, 1, 1, "gelu").float().square().mean()

    x = torch.randn(8, 16, 8, 8, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(32, 16, 3, 3, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(32, device="cuda", dtype=dtype, requires_grad=True)
    out = torch.compile(f, fullgraph=True)(x, w, b)
    out.backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = f(x2, w2, b2)
    ref.backward()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-4}
    for got, want in ((out, ref), (x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    x, w, b = _cuda_case((8, 4, 10, 10), (6, 4, 3, 3), "float32")
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    dy = torch.randn(8, 6, 10, 10, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and plan first, as capture requires
        for _ in range(2):
            x.grad = w.grad = b.grad = None
            cukit.conv2d(x, w, b, 1, 1, 1, "silu").backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cukit.conv2d(x, w, b, 1, 1, 1, "silu")
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
    graph.replay()
    torch.cuda.synchronize()
    ref, mag = oracle(x, w, b, 1, 1, 1, "silu")
    check(y, ref, mag, "float32", 36)
    (dx, dw, db), (mx, mw, mb) = oracle_backward(dy, x, w, b, 1, 1, 1, "silu")
    check(x.grad, dx, mx, "float32", 54, what="dx")
    check(w.grad, dw, mw, "float32", 800, what="dw")
    check(b.grad, db, mb, "float32", 800, what="db")


@pytest.mark.gpu
def test_gpu_launches_on_torchs_current_stream():
    x, w, b = _cuda_case((16, 8, 32, 32), (8, 8, 3, 3), "float32")
    src = x.clone()
    x.zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        y = cukit.conv2d(x, w, b, 1, 1, 1, "relu")
    torch.cuda.synchronize()
    ref, mag = oracle(src, w, b, 1, 1, 1, "relu")
    check(y, ref, mag, "float32", 72)


@pytest.mark.gpu
def test_gpu_plan_cache_hit_path_and_mixed_devices():
    x, w, b = _cuda_case((4, 3, 8, 8), (5, 3, 3, 3), "float32")
    cukit.conv2d(x, w, b, 1, 1, 1, "gelu")
    before = cv._FWD_PLANS.stats()["hits"]
    y = cukit.conv2d(x + 1, w, b, 1, 1, 1, "gelu")  # new pointers, same signature
    assert cv._FWD_PLANS.stats()["hits"] == before + 1
    ref, mag = oracle(x + 1, w, b, 1, 1, 1, "gelu")
    check(y, ref, mag, "float32", 27)
    with pytest.raises(ValueError, match="same device"):
        cukit.conv2d(x, w.cpu(), b.cpu())


@pytest.mark.gpu
def test_gpu_module_and_patch_match_stock():
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.GELU(),
                                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.GELU(), torch.nn.Flatten(),
                                torch.nn.Linear(2048, 10)).cuda()
    patched = cukit.nn.patch(copy.deepcopy(stock))
    x = torch.randn(64, 1, 8, 8, device="cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.backends.cudnn.flags(allow_tf32=False), torch.no_grad():
            torch.testing.assert_close(patched(x), stock(x), rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, c = patched(x), stock(x)
    assert a.dtype == c.dtype
    torch.testing.assert_close(a.float(), c.float(), rtol=5e-2, atol=5e-2)
