"""rms_norm and layer_norm: every path against an independent float64 oracle (torch autograd in
float64, rounded where the op's convention rounds), forward and backward; the torch integration
(autograd to second order, opcheck, torch.compile under both compile policies, vmap and
per-sample gradients, autocast); parity with Hugging Face's RMSNorm modules; cukit.nn.RMSNorm /
LayerNorm and the patch rules "rms_norm" / "layer_norm"; bad input. Tests marked gpu cover the
kernels' vector, scalar and chunked paths, determinism, CUDA graphs and streams on CUDA."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
from cukit.ops import norm as nm
from cukit.testing import arrays, assert_close, backend_dtypes, shapes, to_numpy, tolerance

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cukit.nn  # noqa: E402  (after the torch skip)
from cukit.nn._patch import RULES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_blocks import GemmaRMSNorm, LlamaRMSNorm  # noqa: E402

FLOATS = ["float16", "bfloat16", "float32", "float64"]
NUMPY_FLOATS = backend_dtypes("numpy", FLOATS)
# unit roundoff of the statistics (float32; float64 for float64 x) and of the storage dtypes
U_ACC = {"float16": 2.0**-24, "bfloat16": 2.0**-24, "float32": 2.0**-24, "float64": 2.0**-53}
U_STORE = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def torch_cuda() -> bool:
    return cukit.is_available() and torch.cuda.is_available()


# ------------------------------------------------------------------------------------- oracles
def t64(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(to_numpy(a), dtype=np.float64))


def rnd(t, name: str):
    """t rounded to dtype `name`, back in float64."""
    return t.to(getattr(torch, name)).double()


def dname(a) -> str:
    """An array's dtype name (NumPy, CuPy or torch)."""
    return str(a.dtype).removeprefix("torch.") if hasattr(a, "data_ptr") else np.dtype(a.dtype).name


def promote(a: str, b: str) -> str:
    return dname(torch.empty(0, dtype=torch.promote_types(getattr(torch, a), getattr(torch, b))))


class Case:
    """One norm call: inputs (any backend), options, and the float64 oracle's statistics."""

    def __init__(self, x, weight, bias=None, *, eps=1e-6, offset=0.0, cast="llama", layer=False):
        self.x, self.w, self.b = x, weight, bias
        self.eps, self.offset, self.cast, self.layer = eps, offset, cast, layer
        self.xname = dname(x)
        self.wname = None if weight is None else dname(weight)
        xt = t64(x)
        self.H = xt.shape[-1]
        self.rows = int(np.prod(xt.shape[:-1]))
        mu = xt.mean(-1, keepdim=True) if layer else torch.zeros_like(xt[..., :1])
        xc = xt - mu
        self.rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
        self.xh = xc * self.rstd
        # error of x̂ from the float32 statistics: relative k·u, and (LayerNorm) the mean's
        # absolute error k·u·max|x| times rstd
        self.k = 4 * math.log2(self.H + 1) + 8
        self.cond = (xt.abs().amax(-1, keepdim=True) * self.rstd) if layer and self.H else torch.zeros_like(mu)
        self.u = U_ACC[self.xname]
        self.scale = (torch.ones(1, dtype=torch.float64) if weight is None
                      else (self.offset + t64(weight)) if not layer else t64(weight))

    @property
    def out(self) -> str:
        if not self.layer and self.cast == "llama" and self.wname is not None:
            return promote(self.xname, self.wname)
        return self.xname

    @property
    def llama_round(self) -> bool:
        return not self.layer and self.cast == "llama"

    def expected(self):
        """The forward's float64 value, rounded where the convention rounds."""
        xh, s = self.xh, self.scale
        if self.layer:
            y = xh * s if self.w is not None else xh
            return rnd(y + (t64(self.b) if self.b is not None else 0.0), self.out)
        if self.llama_round:
            return rnd(s * rnd(xh, self.xname), self.out)
        return rnd(xh * s, self.out)

    def slack(self):
        """Absolute error allowed beside the output dtype's tolerance: the float32 statistics
        and, for cast="llama" with 16-bit x, x̂ rounded to the other side of a rounding boundary."""
        s = self.scale.abs()
        err = self.k * self.u * (self.xh.abs() + self.cond) * s
        if self.llama_round and self.xname in ("float16", "bfloat16"):
            err = err + 2 * U_STORE[self.xname] * self.xh.abs() * s
        return err

    def call(self):
        if self.layer:
            return cukit.layer_norm(self.x, None, self.w, self.b, self.eps)
        return cukit.rms_norm(self.x, self.w, self.eps, offset=self.offset, cast=self.cast)

    def backward_oracle(self, g):
        """(dx, dw, db) in float64 by torch autograd of the unrounded forward (the rounding to x's
        dtype passes gradients through, as its cast does), dw from the rounded x̂ for "llama"."""
        xt = t64(self.x).requires_grad_()
        gt = t64(g)
        mu = xt.mean(-1, keepdim=True) if self.layer else 0.0
        xc = xt - mu
        xh = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + self.eps)
        (dx,) = torch.autograd.grad((xh * self.scale * gt).sum(), xt) if self.rows and self.H else (gt * 0,)
        xw = rnd(self.xh, self.xname) if self.llama_round else self.xh
        dw = None if self.w is None else (gt * xw).reshape(self.rows, self.H).sum(0)
        db = None if self.b is None else gt.reshape(self.rows, self.H).sum(0)
        return dx.detach(), dw, db

    def dx_slack(self, g):
        gt = t64(g) * self.scale
        if not (self.rows and self.H):
            return torch.zeros_like(gt)
        m = gt.abs().amax(-1, keepdim=True) * (1 + self.xh.abs()).amax(-1, keepdim=True)
        return self.k * self.u * self.rstd * (gt.abs() + m * (1 + self.xh.abs()) * (1 + self.cond))

    def sum_slack(self, terms, dtype: str, flip: float = 0.0):
        """A sum over the rows: besides its rounding to the output dtype, the float32 summation
        error is at most rows·u·Σ|terms| (any order; Higham's γ_n), plus the terms' own error
        (k·u each, and `flip`: x̂ rounded the other way for cast="llama")."""
        l1 = terms.reshape(self.rows, self.H).sum(0)
        return ((self.rows + self.k) * self.u + tolerance(dtype)[1] + flip) * l1


def expect_close(actual, expected, dtype: str, slack=0.0, what: str = ""):
    """|actual − expected| <= atol + rtol·|expected| + slack (slack: absolute, broadcastable)."""
    atol, rtol = tolerance(dtype)
    a = torch.from_numpy(np.asarray(to_numpy(actual), dtype=np.float64))
    e = expected.reshape(a.shape) if expected.numel() == a.numel() else expected
    bound = atol + rtol * e.abs() + (slack if isinstance(slack, float) else slack.expand(e.shape))
    err = (a - e).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {a.numel()} off; worst err {float((err - bound).max()):.3g} "
                           f"beyond the bound at {np.unravel_index(int(torch.argmax(err - bound)), tuple(a.shape))}")


def check_case(c: Case, g=None, grads: bool = True):
    """The forward (and, with g, the backward) of one case against the oracle."""
    y = c.call()
    assert type(y) is type(c.x) and tuple(y.shape) == tuple(c.x.shape) and dname(y) == c.out
    expect_close(y, c.expected(), c.out, c.slack(), "y")
    if g is None or not grads:
        return y
    dx_e, dw_e, db_e = c.backward_oracle(g)
    if c.layer:
        dx, dw, db = cukit.layer_norm_backward(g, c.x, None, c.w, c.b, c.eps)
    else:
        (dx, dw), db = cukit.rms_norm_backward(g, c.x, c.w, c.eps, offset=c.offset, cast=c.cast), None
    assert type(dx) is type(c.x) and tuple(dx.shape) == tuple(c.x.shape)
    expect_close(dx, dx_e, c.xname, c.dx_slack(g), "dx")
    gt = t64(g)
    if c.w is None:
        assert dw is None
    else:
        flip = 2 * U_STORE[c.xname] if c.llama_round else 0.0
        expect_close(dw, dw_e, c.wname, c.sum_slack(gt.abs() * (c.xh.abs() + c.cond), c.wname, flip), "dweight")
    if c.b is None:
        assert db is None
    else:
        expect_close(db, db_e, dname(c.b), c.sum_slack(gt.abs(), dname(c.b)), "dbias")
    return y


@st.composite
def rms_cases(draw, backend: str, max_side: int = 40, max_elements: int = 1 << 14):
    names = backend_dtypes(backend, FLOATS)
    shape = draw(shapes(min_dims=1, max_dims=3, max_side=max_side, max_elements=max_elements))
    xname = draw(st.sampled_from(names))
    wname = draw(st.sampled_from([None, xname, *names]))
    x = draw(arrays(backend, xname, shape, noncontiguous=None))
    w = None if wname is None else draw(arrays(backend, wname, shape[-1:]))
    cast = draw(st.sampled_from(nm.CASTS))
    offset = 0.0 if w is None else draw(st.sampled_from([0.0, 1.0]))
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    c = Case(x, w, eps=eps, offset=offset, cast=cast)
    g = draw(arrays(backend, c.out, shape))
    return c, g


@st.composite
def layer_cases(draw, backend: str, max_side: int = 40, max_elements: int = 1 << 14):
    names = backend_dtypes(backend, FLOATS)
    shape = draw(shapes(min_dims=1, max_dims=3, max_side=max_side, max_elements=max_elements))
    xname = draw(st.sampled_from(names))
    pname = draw(st.sampled_from([xname, *names]))
    x = draw(arrays(backend, xname, shape, noncontiguous=None))
    w = draw(st.one_of(st.none(), arrays(backend, pname, shape[-1:])))
    b = draw(st.one_of(st.none(), arrays(backend, pname, shape[-1:])))
    c = Case(x, w, b, eps=draw(st.sampled_from([1e-5, 1e-3])), layer=True)
    g = draw(arrays(backend, xname, shape))
    return c, g


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(case=rms_cases("numpy"))
def test_rms_norm_numpy_fallback(case):
    check_case(*case)


@given(case=rms_cases("torch"))
def test_rms_norm_torch_cpu_fallback(case):
    check_case(*case)


@given(case=layer_cases("numpy"))
def test_layer_norm_numpy_fallback(case):
    check_case(*case)


@given(case=layer_cases("torch"))
def test_layer_norm_torch_cpu_fallback(case):
    check_case(*case)


@given(case=rms_cases("torch", max_side=20, max_elements=600), layer=st.booleans())
def test_torch_autograd_matches_the_backward_functions(case, layer):
    c, g = case
    if layer:
        c = Case(c.x, None if c.w is None else c.w.to(c.x.dtype), None if c.w is None else c.w.to(c.x.dtype),
                 eps=1e-5, layer=True)
        g = g.to(c.x.dtype)
    x = c.x.detach().requires_grad_()  # same strides as c.x: the same summation order
    w = None if c.w is None else c.w.detach().clone().requires_grad_()
    b = None if c.b is None else c.b.detach().clone().requires_grad_()
    if layer:
        y = cukit.layer_norm(x, x.shape[-1], w, b, c.eps)
        want = cukit.layer_norm_backward(g, c.x, None, c.w, c.b, c.eps)
    else:
        y = cukit.rms_norm(x, w, c.eps, offset=c.offset, cast=c.cast)
        want = cukit.rms_norm_backward(g, c.x, c.w, c.eps, offset=c.offset, cast=c.cast)
    assert y.grad_fn is not None or x.numel() == 0
    if x.numel():
        y.backward(g)
    for p, d in zip((x, w, b), want, strict=False):
        if p is not None and x.numel():
            assert torch.equal(p.grad, d.detach()), "autograd and the backward function differ"


@pytest.mark.parametrize("cast", nm.CASTS)
def test_hf_forward_bit_for_bit_on_cpu(cast):
    """The torch path reproduces Hugging Face's rounding points exactly (the CPU reference; the
    kernels compute the same maths, see the gpu test)."""
    torch.manual_seed(0)
    for xd in (torch.bfloat16, torch.float16, torch.float32):
        for wd in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(16, 129).to(xd)
            m = (LlamaRMSNorm(129, 1e-6) if cast == "llama" else GemmaRMSNorm(129, 1e-6))
            m.weight.data = torch.randn(129).to(wd)
            ref = m(x)
            y = cukit.rms_norm(x, m.weight.detach(), 1e-6, offset=1.0 if cast == "gemma" else 0.0, cast=cast)
            assert y.dtype == ref.dtype and torch.equal(y, ref), (xd, wd)


def test_torch_rms_norm_and_layer_norm_equivalents():
    torch.manual_seed(0)
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.randn(8, 33).to(dt)
        w = torch.randn(33).to(dt)
        # eps=None: the statistics' machine epsilon, as torch's rms_norm (not finfo(x.dtype).eps)
        assert torch.equal(cukit.rms_norm(x, w, None, cast="gemma"), F.rms_norm(x, (33,), w, None))
        tol = tolerance(str(dt).removeprefix("torch."))
        torch.testing.assert_close(cukit.layer_norm(x, (33,), w, w, 1e-5), F.layer_norm(x, (33,), w, w, 1e-5),
                                   atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("cast", nm.CASTS)
@pytest.mark.parametrize("with_weight", [True, False])
def test_cpu_gradcheck_and_gradgradcheck_rms_norm(cast, with_weight):
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    off = 1.0 if cast == "gemma" and with_weight else 0.0

    def f(x, *w):
        return cukit.rms_norm(x, w[0] if w else None, 1e-6, offset=off, cast=cast)

    args = (x, w) if with_weight else (x,)
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("params", ["wb", "w", "b", ""])
def test_cpu_gradcheck_and_gradgradcheck_layer_norm(params):
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    args = (x, *((w,) if "w" in params else ()), *((b,) if "b" in params else ()))

    def f(x, *p):
        it = iter(p)
        return cukit.layer_norm(x, None, next(it) if "w" in params else None, next(it) if "b" in params else None)

    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


def test_third_order_through_the_reference():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64)

    def third(norm, x):
        (g1,) = torch.autograd.grad(norm(x).pow(3).sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g2.sum(), x)[0]

    for ours, ref in [
        (lambda x: cukit.rms_norm(x, w), lambda x: nm.rms_norm_reference_torch(x, w, 1e-6)[0]),
        (lambda x: cukit.layer_norm(x, None, w, w), lambda x: nm.layer_norm_reference_torch(x, w, w, 1e-5)[0]),
    ]:
        torch.testing.assert_close(third(ours, x), third(ref, x))


def test_cpu_opcheck():
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    ops = torch.ops.cukit
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6, 0.0, "llama"))
    torch.library.opcheck(ops.rms_norm.default, (x, None, 1e-6, 0.0, "gemma"))
    torch.library.opcheck(ops.layer_norm.default, (x, w, b, 1e-5))
    torch.library.opcheck(ops.layer_norm.default, (x, None, None, 1e-5))
    _, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-6, 1.0, "gemma")
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn(4, 6), x.detach(), w.detach(), rstd, 1e-6, 1.0,
                                                          "gemma"))
    _, mean, rstd = ops.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    torch.library.opcheck(ops.layer_norm_backward.default, (torch.randn(4, 6), x.detach(), w.detach(), b.detach(),
                                                            mean, rstd, 1e-5))


def _compiled_model_check(device: str, backend: str, tol: float):
    def f(x, w, b):
        h = cukit.rms_norm(x * 2, w, 1e-6, cast="llama")
        h = cukit.rms_norm(h, w, 1e-6, offset=1.0, cast="gemma")
        return cukit.layer_norm(h, None, w, b, 1e-5).square().mean()

    x = torch.randn(8, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device, requires_grad=True)
    b = torch.randn(48, device=device, requires_grad=True)
    out = torch.compile(f, fullgraph=True, backend=backend)(x, w, b)
    out.backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = f(x2, w2, b2)
    ref.backward()
    for a, e in ((out, ref), (x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    _compiled_model_check("cpu", "aot_eager", 1e-5)


def test_vmap_and_per_sample_gradients():
    from torch.func import grad, vmap

    x = torch.randn(3, 5, 7, dtype=torch.float64)
    w = torch.randn(7, dtype=torch.float64)
    b = torch.randn(7, dtype=torch.float64)

    def loss(w, b, xi):
        return (cukit.layer_norm(cukit.rms_norm(xi, w, 1e-6, offset=1.0, cast="gemma"), None, w, b) ** 2).sum()

    def loss_ref(w, b, xi):
        h = nm.rms_norm_reference_torch(xi, w, 1e-6, 1.0, "gemma")[0]
        return (nm.layer_norm_reference_torch(h, w, b, 1e-5)[0] ** 2).sum()

    for dims in [(None, None, 0), (0, 0, 0)]:
        ws = w if dims[0] is None else torch.randn(3, 7, dtype=torch.float64)
        bs = b if dims[1] is None else torch.randn(3, 7, dtype=torch.float64)
        got = vmap(grad(loss, argnums=(0, 1)), in_dims=dims)(ws, bs, x)
        want = vmap(grad(loss_ref, argnums=(0, 1)), in_dims=dims)(ws, bs, x)
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e)
    ws = torch.randn(3, 7, dtype=torch.float64)
    torch.testing.assert_close(vmap(lambda xi, wi: cukit.rms_norm(xi, wi))(x, ws),
                               torch.stack([cukit.rms_norm(x[i], ws[i]) for i in range(3)]))
    hess = torch.func.jacrev(torch.func.jacrev(lambda w: (cukit.rms_norm(x[0], w) ** 3).sum()))(w)
    want = torch.func.jacrev(torch.func.jacrev(lambda w: (nm.rms_norm_reference_torch(x[0], w, 1e-6)[0] ** 3).sum()))(w)
    torch.testing.assert_close(hess, want)


def test_mixed_dtypes_and_autocast_on_cpu():
    x = torch.randn(4, 8).bfloat16()
    w = torch.randn(8)
    assert cukit.rms_norm(x, w).dtype == torch.float32  # llama: promoted, as LlamaRMSNorm
    assert cukit.rms_norm(x, w, offset=1.0, cast="gemma").dtype == torch.bfloat16
    assert cukit.rms_norm(x, w.double()).dtype == torch.float64
    assert cukit.layer_norm(x, None, w, w).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast leaves both alone, as torch's
        assert cukit.layer_norm(x.float(), None, w, w).dtype == torch.float32
        assert cukit.layer_norm(x, None, w, w).dtype == F.layer_norm(x, (8,), w, w).dtype == torch.bfloat16
        assert cukit.rms_norm(x, w).dtype == torch.float32


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
def test_size_zero(shape):
    for x, w in [(np.zeros(shape, np.float32), np.ones(shape[-1:], np.float32)),
                 (torch.zeros(shape), torch.ones(shape[-1:]))]:
        for y in (cukit.rms_norm(x, w), cukit.layer_norm(x, None, w, w)):
            assert tuple(y.shape) == shape
        dx, dw = cukit.rms_norm_backward(cukit.rms_norm(x, w), x, w)
        assert tuple(dx.shape) == shape and tuple(dw.shape) == shape[-1:] and not np.abs(to_numpy(dw)).sum()
        dx, dw, db = cukit.layer_norm_backward(x, x, None, w, w)
        assert tuple(dx.shape) == shape and tuple(db.shape) == shape[-1:] and not np.abs(to_numpy(db)).sum()


def test_bad_input_raises_clear_errors():
    x = np.zeros((2, 3), np.float32)
    w = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"cukit\.rms_norm: cast must be 'llama' or 'gemma'; got 'x'"):
        cukit.rms_norm(x, w, cast="x")
    with pytest.raises(ValueError, match=r"cukit\.rms_norm: weight must have shape \(3,\) to match x's last dimension"):
        cukit.rms_norm(x, np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"weight must have dtype float16, bfloat16, float32 or float64; got int64"):
        cukit.rms_norm(x, np.ones(3, np.int64))
    with pytest.raises(TypeError, match=r"cukit\.rms_norm: x must have dtype .* got int32"):
        cukit.rms_norm(np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match="weight must be the same array type as x"):
        cukit.rms_norm(x, torch.ones(3))
    with pytest.raises(ValueError, match="at least one dimension"):
        cukit.rms_norm(np.float32(1.0) * np.ones((), np.float32))
    with pytest.raises(ValueError, match=r"eps must be a non-negative finite number; got -1"):
        cukit.rms_norm(x, w, -1.0)
    with pytest.raises(TypeError, match=r"eps must be a real number; got str"):
        cukit.layer_norm(x, None, w, w, "1e-5")
    with pytest.raises(ValueError, match=r"offset scales a weight .* got offset=1.0 and weight=None"):
        cukit.rms_norm(x, None, offset=1.0)
    with pytest.raises(ValueError, match=r"cukit\.layer_norm: normalized_shape must be x's last dimension, \(3,\) "
                                         r"\(cukit normalises the last dimension only\); got \(2, 3\)"):
        cukit.layer_norm(x, (2, 3))
    with pytest.raises(ValueError, match=r"normalized_shape must be x's last dimension, \(3,\); got \(4,\)"):
        cukit.layer_norm(x, 4)
    with pytest.raises(TypeError, match="normalized_shape must be None, an int or a sequence of one int"):
        cukit.layer_norm(x, "3")
    with pytest.raises(TypeError, match=r"cukit\.layer_norm: bias must have weight's dtype float32; got float64"):
        cukit.layer_norm(x, None, w, np.zeros(3))
    with pytest.raises(TypeError, match=r"rms_norm_backward: grad must have the output's dtype float32; got float64"):
        cukit.rms_norm_backward(np.zeros((2, 3)), x, w)
    with pytest.raises(ValueError, match=r"layer_norm_backward: grad must have x's shape \(2, 3\); got \(3, 3\)"):
        cukit.layer_norm_backward(np.zeros((3, 3), np.float32), x)
    with pytest.raises(TypeError, match=r"cukit\.rms_norm: x must be an array-like"):
        cukit.rms_norm({}, w)
    xt = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"cast must be 'llama' or 'gemma'"):
        cukit.rms_norm(xt, torch.ones(3), cast="t5")
    with pytest.raises(ValueError, match=r"cukit\.rms_norm: weight must have shape \(3,\)"):
        cukit.rms_norm(xt, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"last dimension only"):
        cukit.layer_norm(xt, xt.shape)
    assert_close(cukit.rms_norm([[3.0, 4.0]]), np.array([[3.0, 4.0]]) / np.sqrt(12.5 + 1e-6))


# ------------------------------------------------------------------------------- nn modules
def test_rms_norm_module():
    m = cukit.nn.RMSNorm(6, 1e-5, dtype=torch.float64)
    assert torch.equal(m.weight, torch.ones(6, dtype=torch.float64))
    g = cukit.nn.RMSNorm(6, offset=1.0, cast="gemma")
    assert torch.equal(g.weight, torch.zeros(6)) and "cast='gemma'" in repr(g)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, nm.rms_norm_reference_torch(x, m.weight, 1e-5)[0])
    y.sum().backward()
    assert m.weight.grad is not None and x.grad is not None
    assert list(m.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="cast must be"):
        cukit.nn.RMSNorm(4, cast="t5")


@pytest.mark.parametrize("min_bytes", [None, 0])
def test_layer_norm_module_is_a_drop_in(min_bytes, monkeypatch):
    """Over recompute.MIN_BYTES (0 here: every size) the module runs cukit.layer_norm; under it
    (these 160 bytes by default) torch's layer_norm: the same results either way."""
    import cukit.nn.norm as nn_norm
    from cukit.nn import recompute

    if min_bytes is not None:
        monkeypatch.setattr(recompute, "MIN_BYTES", min_bytes)
    calls = []
    monkeypatch.setattr(nn_norm, "cukit_layer_norm", lambda *a: calls.append(1) or cukit.layer_norm(*a))
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm(10)
    torch.manual_seed(0)
    m = cukit.nn.LayerNorm(10)
    assert isinstance(m, torch.nn.LayerNorm) and m.state_dict().keys() == ref.state_dict().keys()
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(4, 10, requires_grad=True)
    torch.testing.assert_close(m(x), ref(x))
    assert len(calls) == (0 if min_bytes is None else 1)
    gx, gw, gb = torch.autograd.grad(m(x).square().sum(), (x, m.weight, m.bias))
    for a, b in zip((gx, gw, gb), torch.autograd.grad(ref(x).square().sum(), (x, ref.weight, ref.bias)), strict=True):
        torch.testing.assert_close(a, b)
    calls.clear()
    two = cukit.nn.LayerNorm((3, 10), elementwise_affine=False)  # more than one dim: torch's own
    torch.testing.assert_close(two(torch.randn(2, 3, 10)).std(), torch.tensor(1.0), atol=0.1, rtol=0.1)
    assert not calls
    assert cukit.nn.LayerNorm(10, bias=False).bias is None


# ------------------------------------------------------------------------------ patch rules
class Block(torch.nn.Module):
    """Norms as transformers and torch write them, around linears."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(16, 1e-5)
        self.gemma_norm = GemmaRMSNorm(16)
        self.torch_rms = torch.nn.RMSNorm(16)
        self.ln = torch.nn.LayerNorm(16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        x = self.input_layernorm(x)
        x = self.proj(self.gemma_norm(x))
        return self.ln(self.torch_rms(x))


class T5LayerNorm(torch.nn.Module):  # transformers' T5: another RMSNorm, rounding elsewhere
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class FakeRMSNorm(LlamaRMSNorm):  # Llama's attributes, another forward
    def forward(self, hidden_states):
        return self.weight * hidden_states


def whats(model, skipped=False):
    return {c.module: c.what for c in (model.cukit_patch_report.skipped if skipped else model.cukit_patch_report.done)
            if c.rule in ("rms_norm", "layer_norm")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_patch_swaps_norms_and_matches(dtype):
    torch.manual_seed(0)
    ref = Block().to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    ours = cukit.nn.patch(copy.deepcopy(ref), linear=False)
    assert whats(ours) == {
        "input_layernorm": "LlamaRMSNorm -> cukit.nn.RMSNorm (cast='llama')",
        "gemma_norm": "GemmaRMSNorm -> cukit.nn.RMSNorm (cast='gemma', offset=1)",
        "torch_rms": "torch.nn.RMSNorm -> cukit.nn.RMSNorm (cast='gemma')",
        "ln": "torch.nn.LayerNorm -> cukit.nn.LayerNorm",
    }
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert all(a is not b for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
    assert type(ours.input_layernorm) is cukit.nn.RMSNorm and ours.input_layernorm.eps == 1e-5
    x = torch.randn(3, 5, 16, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    # float64: transformers' RMSNorms compute in float32 even then; cukit keeps float64
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y2, y1, atol=tol, rtol=tol)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, atol=tol * 10, rtol=tol * 10)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=tol * 10, rtol=tol * 10, msg=n)
    again = cukit.nn.patch(ours)
    assert not whats(again)  # idempotent


def test_patch_skips_what_it_does_not_know():
    model = torch.nn.ModuleDict({
        "t5": T5LayerNorm(8), "fake": FakeRMSNorm(8), "ln2d": torch.nn.LayerNorm((4, 8)),
        "rms2d": torch.nn.RMSNorm((4, 8)), "hooked": torch.nn.LayerNorm(8), "sub": type("MyLN", (torch.nn.LayerNorm,), {})(8),
    })
    model["hooked"].forward = model["hooked"].forward  # an instance forward (accelerate's hooks)
    cukit.nn.patch(model)
    skipped = whats(model, skipped=True)
    assert "none of the RMSNorms cukit knows" in skipped["fake"]
    assert "t5" not in skipped  # not named *RMSNorm: not a candidate
    assert skipped["ln2d"] == "torch.nn.LayerNorm over the last 2 dimensions (cukit normalises the last one only)"
    assert "last 2 dimensions" in skipped["rms2d"]
    assert "replaced on the instance" in skipped["hooked"]
    assert "subclasses torch.nn.LayerNorm" in skipped["sub"]
    assert not whats(model)
    assert {"rms_norm", "layer_norm"} <= set(RULES)
    plain = cukit.nn.patch(Block(), rms_norm=False, layer_norm=False, linear=False)
    assert not whats(plain) and type(plain.ln) is torch.nn.LayerNorm


def test_patch_and_torch_compile(compile_policy: str):
    torch.manual_seed(0)
    ref = Block()
    ours = cukit.nn.patch(copy.deepcopy(ref))
    x = torch.randn(2, 3, 16)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(ours, backend="aot_eager", fullgraph=True)(x), ref(x), atol=1e-5,
                               rtol=1e-5)


def _tiny(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "gemma":
        cfg = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
        return transformers.GemmaForCausalLM(cfg)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("kind", "n"), [("llama", ("rms_norm", 5)), ("gemma", ("rms_norm", 5)),
                                         ("gpt2", ("layer_norm", 5))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transformers_models_same_loss_and_gradients(kind, n, dtype, device="cpu", tol=None):
    ref = _tiny(kind).to(device=device, dtype=dtype).eval()  # no dropout
    with torch.no_grad():  # Gemma's norms start at zero: make them matter
        for name, p in ref.named_parameters():
            if "norm" in name or "ln" in name:
                p.normal_(0.0, 0.5)
    only = {r: r == n[0] for r in RULES}
    ours = cukit.nn.patch(copy.deepcopy(ref), **only)
    assert ours.cukit_patch_report.counts == {n[0]: n[1]}, str(ours.cukit_patch_report)
    ids = torch.randint(0, 128, (2, 9), device=device)
    l1, g1 = _loss_and_grads(ref, ids)
    l2, g2 = _loss_and_grads(ours, ids)
    tol = tol or (1e-6 if dtype == torch.float64 else 2e-5)  # float64: HF's RMSNorms compute in float32
    torch.testing.assert_close(l2, l1, atol=tol, rtol=tol)
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=tol * 10, rtol=tol * 10, msg=k)


def test_launch_geometry_and_declared_instantiations():
    """The host's choices meet the kernels' contract (raw_kernels/norm.cu): threads per row a power
    of two up to 512, whole warps per block, a row in one chunk unless the block holds one row; and
    every instantiation the host can ask for is declared (compiled by check-kernels)."""
    declared = set(nm.KERNELS.all_instantiations())
    for H in [*range(1, 70), 96, 123, 768, 1000, 1024, 2048, 4095, 4096, 4097, 8192, 16384, 32768, 65536, 65537]:
        for backward in (False, True):
            for itemsize in (2, 4, 8):
                for vec in (16 // itemsize, 1):
                    if vec > 1 and H % vec:
                        continue
                    for layer in (False, True):
                        for wsize in {itemsize, 4}:
                            nv = nm._nv(backward, vec, itemsize, wsize, layer=layer)
                            tpr, rpb = (nm._bwd_threads(H, vec, nv, itemsize) if backward
                                        else nm._threads(H, vec, nv))
                            assert tpr & (tpr - 1) == 0 and 1 <= tpr <= 512 and (tpr * rpb) % 32 == 0, (H, vec, nv)
                            assert tpr * rpb in (256, 512, tpr) and tpr * rpb <= 512
                            assert tpr * nv * vec >= H or (tpr == 512 and rpb == 1), (H, vec, nv)
    from cukit.interop import DTYPES

    for x in FLOATS:
        for w in FLOATS:
            for mode in (nm.RMS_ROUND, nm.RMS, nm.LAYER):
                c = nm.Checked("torch", mode, x, w, x)
                wk = DTYPES[nm._kernel_weight(c, mode)].ctype
                T = DTYPES[x]
                for vec in (16 // T.itemsize, 1):
                    nvf = nm._nv(False, vec, T.itemsize, layer=mode == nm.LAYER)
                    for one in ("true", "false"):
                        assert f"norm_fwd<{T.ctype}, {wk}, {mode}, {vec}, {nvf}, {one}>" in declared
                    nv = nm._nv(True, vec, T.itemsize, DTYPES[nm._kernel_weight(c, mode)].itemsize,
                                layer=mode == nm.LAYER)
                    for one in ("true", "false"):
                        assert f"norm_bwd<{T.ctype}, {wk}, {mode}, {vec}, {nv}, {one}>" in declared


def test_benchmark_dry_run(tmp_path):
    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    import bench_norm

    assert bench_norm.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = tmp_path / "bench_norm.json"
    assert out.is_file() and (tmp_path / "bench_norm.csv").is_file()
    import json

    rows = json.loads(out.read_text())["rows"]
    cukit_rows = [r for r in rows if r.get("impl") == "cukit" and r.get("op") in ("rms_norm", "layer_norm")]
    assert len(cukit_rows) == 2 * 2 * 2 * 2  # ops x directions x dtypes x shapes
    assert all(not r.get("error") and r.get("gbps") for r in cukit_rows), [r.get("error") for r in cukit_rows]
    assert {r["direction"] for r in cukit_rows} == {"fwd", "fwd+bwd"}


# ------------------------------------------------------------------------------------------ GPU
needs_cuda = pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")


@pytest.mark.gpu
@given(backend=st.sampled_from(["cupy", "torch-cuda"]), data=st.data())
def test_gpu_rms_norm_matches_oracle(backend, data):
    check_case(*data.draw(rms_cases(backend, max_side=300, max_elements=60_000)))


@pytest.mark.gpu
@given(backend=st.sampled_from(["cupy", "torch-cuda"]), data=st.data())
def test_gpu_layer_norm_matches_oracle(backend, data):
    check_case(*data.draw(layer_cases(backend, max_side=300, max_elements=60_000)))


def _cuda(shape, dtype, offset=0, scale=1.0):
    """A contiguous CUDA tensor whose data starts `offset` elements into its buffer (offset=1
    breaks 16-byte alignment and forces the scalar path)."""
    n = int(np.prod(shape))
    buf = torch.randn(n + offset, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)
    return buf[offset:].view(shape)


GPU_SHAPES = [(3, 1), (5, 3), (1031, 8), (7, 33, 520), (64, 768), (33, 4097), (16, 8192), (8, 16384), (3, 65536),
              (2, 65537)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize(("xd", "wd"), [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                        (torch.float16, torch.float16), (torch.float32, torch.float32),
                                        (torch.float64, torch.float64), (torch.float16, torch.bfloat16),
                                        (torch.float32, torch.float64)])
def test_gpu_vector_scalar_and_chunked_paths(shape, offset, xd, wd):
    """Rows in registers (one warp to 512 threads per row), chunked rows (re-read per pass; the
    backward's sums in shared or global memory), the 16-byte and the scalar path (offset=1),
    mixed weight dtypes (cast to float32 on the host, or float64 maths)."""
    x = _cuda(shape, xd, offset, 2.0)
    w = _cuda(shape[-1:], wd, offset)
    b = _cuda(shape[-1:], wd, offset)
    for c in (Case(x, w, cast="llama"), Case(x, w, offset=1.0, cast="gemma"), Case(x, None),
              Case(x, w, b, eps=1e-5, layer=True), Case(x, None, b, eps=1e-5, layer=True)):
        g = _cuda(shape, getattr(torch, c.out), offset)
        check_case(c, g)


@pytest.mark.gpu
@needs_cuda
def test_gpu_every_output_element_is_written():
    x = _cuda((1234, 77), torch.float32)
    w = _cuda((77,), torch.float32)
    for _ in range(2):  # the caching allocator hands the poisoned block back
        torch.full((1234, 77), float("nan"), device="cuda")
        y = cukit.rms_norm(x, w)
        assert torch.isfinite(y).all()
        torch.full((1234, 77), float("nan"), device="cuda")
        assert torch.isfinite(cukit.layer_norm(x, None, w, w)).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 1000), (4096, 4096), (64, 65536)])
def test_gpu_weight_gradients_are_bitwise_reproducible(shape):
    x = _cuda(shape, torch.bfloat16)
    w = _cuda(shape[-1:], torch.float32)
    g = _cuda(shape, torch.float32)
    runs = [cukit.rms_norm_backward(g, x, w) for _ in range(3)]
    assert all(torch.equal(runs[0][1], r[1]) and torch.equal(runs[0][0], r[0]) for r in runs[1:])
    gb = g.bfloat16()
    runs = [cukit.layer_norm_backward(gb, x, None, w, w) for _ in range(3)]
    assert all(torch.equal(runs[0][i], r[i]) for r in runs[1:] for i in range(3))


@pytest.mark.gpu
@needs_cuda
def test_gpu_inference_and_autograd_paths_agree_bitwise():
    x = _cuda((300, 1024), torch.bfloat16)
    w = _cuda((1024,), torch.float32)
    with torch.no_grad():
        y0 = cukit.rms_norm(x, w)
        l0 = cukit.layer_norm(x, None, w, w)
    xr = x.clone().requires_grad_()
    assert torch.equal(cukit.rms_norm(xr, w), y0)
    assert torch.equal(cukit.layer_norm(xr, None, w, w), l0)
    y, rstd = torch.ops.cukit.rms_norm(x, w, 1e-6, 0.0, "llama")
    assert torch.equal(y, y0) and rstd.dtype == torch.float32 and rstd.shape == (300,)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cast", nm.CASTS)
def test_gpu_hf_parity(cast):
    """cukit's kernels against Hugging Face's modules on CUDA: the same rounding points, so the
    outputs differ by at most one unit in the last place (rsqrt and summation order)."""
    torch.manual_seed(0)
    for xd, wd in [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                   (torch.float32, torch.float32)]:
        x = torch.randn(512, 2048, device="cuda").to(xd)
        m = (LlamaRMSNorm(2048) if cast == "llama" else GemmaRMSNorm(2048)).cuda()
        m.weight.data = torch.randn(2048, device="cuda").to(wd)
        ref = m(x)
        y = cukit.rms_norm(x, m.weight.detach(), 1e-6, offset=1.0 if cast == "gemma" else 0.0, cast=cast)
        assert y.dtype == ref.dtype
        # one rounding step of the coarser of x's and y's dtypes (llama rounds x̂ to x's dtype first);
        # float32 throughout: a few ulps of the statistics' summation order and rsqrt
        low = {xd, ref.dtype}
        spacing = 2.0**-7 if torch.bfloat16 in low else 2.0**-10 if torch.float16 in low else 2.0**-20
        diff = (y.float() - ref.float()).abs()
        assert (diff <= 2 * spacing * ref.float().abs() + 1e-6).all(), (xd, wd, float(diff.max()))
        if ref.dtype != torch.float32:  # 16-bit results: the few-ulp float32 differences rarely show
            assert (diff == 0).float().mean() > 0.99, (xd, wd)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cast", nm.CASTS)
def test_gpu_gradcheck_float64(cast):
    x = torch.randn(17, 24, dtype=torch.float64, device="cuda", requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: cukit.rms_norm(x, w, cast=cast), (x, w))
    assert torch.autograd.gradgradcheck(lambda x, w: cukit.rms_norm(x, w, cast=cast), (x, w))
    assert torch.autograd.gradcheck(lambda x, w, b: cukit.layer_norm(x, None, w, b), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w, b: cukit.layer_norm(x, None, w, b), (x, w, b))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(dtype):
    x = torch.randn(33, 64, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    b = torch.randn(64, device="cuda", requires_grad=True)
    ops = torch.ops.cukit
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6, 0.0, "llama"))
    torch.library.opcheck(ops.layer_norm.default, (x, w, b, 1e-5))
    y, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-6, 1.0, "gemma")
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn_like(y), x.detach(), w.detach(), rstd, 1e-6,
                                                          1.0, "gemma"))
    y, mean, rstd = ops.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    torch.library.opcheck(ops.layer_norm_backward.default, (torch.randn_like(y), x.detach(), w.detach(), b.detach(),
                                                            mean, rstd, 1e-5))


@pytest.mark.gpu
@needs_cuda
def test_gpu_torch_compile_fullgraph_inductor(compile_policy: str):
    _compiled_model_check("cuda", "inductor", 1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_autocast_like_torch():
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x.bfloat16()
        assert cukit.layer_norm(h, None, w, w).dtype == F.layer_norm(h, (64,), w, w).dtype == torch.float32
        assert cukit.rms_norm(h, w).dtype == torch.float32  # LlamaRMSNorm: promoted, no autocast rule
        assert cukit.rms_norm(h, w, offset=1.0, cast="gemma").dtype == torch.bfloat16
        compiled = torch.compile(lambda a: cukit.layer_norm(a, None, w, w), fullgraph=True)
        assert compiled(h).dtype == torch.float32


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture_and_replay():
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.randn(512, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            x.grad = w.grad = None
            cukit.layer_norm(cukit.rms_norm(x, w), None, w, w).backward(g)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cukit.layer_norm(cukit.rms_norm(x, w), None, w, w)
        y.backward(g)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
    graph.replay()
    torch.cuda.synchronize()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = cukit.layer_norm(cukit.rms_norm(x2, w2), None, w2, w2)
    y2.backward(g)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.gpu
@needs_cuda
def test_gpu_launches_on_torchs_current_stream():
    n, c = 4096, 1024
    src = torch.randn(n, c, device="cuda")
    x = torch.zeros(n, c, device="cuda")
    w = torch.randn(c, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        y = cukit.rms_norm(x, w)
        _, dw = cukit.rms_norm_backward(src, x, w)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, cukit.rms_norm(src, w))
    torch.testing.assert_close(dw, cukit.rms_norm_backward(src, src, w)[1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_devices_are_rejected():
    x = torch.randn(4, 3, device="cuda")
    with pytest.raises(ValueError, match="same device"):
        cukit.rms_norm(x, torch.randn(3))
    with pytest.raises(ValueError, match="same device"):
        cukit.layer_norm(x, None, torch.randn(3, device="cuda"), torch.randn(3))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("kind", "n"), [("llama", ("rms_norm", 5)), ("gemma", ("rms_norm", 5)),
                                         ("gpt2", ("layer_norm", 5))])
def test_gpu_transformers_models_same_loss_and_gradients(kind, n):
    test_transformers_models_same_loss_and_gradients(kind, n, torch.float32, device="cuda", tol=1e-4)
