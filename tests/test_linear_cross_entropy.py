"""linear_cross_entropy: cross_entropy(x @ W.T + b, y) without the logits.

CPU (CI): the references against an independent float64 oracle built on torch's own
F.cross_entropy / F.linear_cross_entropy (values and autograd gradients) for every option; the
closed-form gradient (the kernels' maths) against autograd; the GPU path's chunk loops
(``run_forward`` / ``run_backward``) run on the CPU with a torch emulation of each kernel and of
the GEMM; the torch op (opcheck, torch.compile under both policies); options; errors; the nn module
and the Hugging Face patch rule against stock transformers. GPU (marker ``gpu``): the kernels
against the float64 oracle (Hypothesis over shapes, dtypes, options), gradcheck, opcheck,
torch.compile, CUDA-graph capture, peak memory, determinism, streams."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cukit
from cukit.ops import linear_cross_entropy as lce
from cukit.testing import assert_close, to_numpy

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytest.importorskip("cukit.torch")  # registers torch.ops.cukit.linear_cross_entropy*, which tests call

REDUCTIONS = ["mean", "sum", "none"]
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# ------------------------------------------------------------------------------------- oracle
def oracle(x, w, y, b=None, cw=None, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
           softcap=None, grad_loss=None, grad_lse=None, round_product=False):
    """float64 (loss, lse, dx, dW, db) from torch's own F.cross_entropy and autograd, independent of
    cukit's formulas: z-loss and soft-capping added around it as their definitions say.
    `round_product`: the exact product x W^T rounded to x's dtype before the bias (logits="input";
    exact where the float32 sums are, see make's `grid`), its gradient passed straight through."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    cw64 = None if cw is None else cw.detach().double()
    yy = y.reshape(-1).long()
    z = x64.reshape(-1, w.shape[1]) @ w64.T
    if round_product:
        z = z + (z.detach().to(x.dtype).double() - z.detach())
    if b64 is not None:
        z = z + b64
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, 1) if z.shape[0] else z.new_zeros(0)
    per = F.cross_entropy(z, yy, weight=cw64, ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing) if z.shape[0] else z.new_zeros(0)
    valid = yy != ignore_index
    per = per + torch.where(valid, z_loss * lse * lse, 0)
    if reduction == "none":
        loss = per.reshape(y.shape)
    elif reduction == "sum":
        loss = per.sum()
    else:
        wy = valid.double() if cw64 is None else torch.where(valid, cw64[torch.where(valid, yy, 0)], 0)
        some = valid.any()  # every token ignored: NaN, with zero gradients (torch's 'mean')
        loss = torch.where(some, per.sum() * torch.where(some, 1 / wy.sum(), 0), math.nan)
    gl = torch.ones_like(loss) if grad_loss is None else grad_loss.detach().double().reshape(loss.shape)
    outs, grads = [loss], [gl]
    if grad_lse is not None:
        outs.append(lse)
        grads.append(grad_lse.detach().double().reshape(-1))
    inputs = [x64, w64] + ([b64] if b64 is not None else [])
    if loss.requires_grad and x.numel():
        gs = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
    else:
        gs = [torch.zeros_like(t) for t in inputs]
    gs = [torch.zeros_like(t) if g is None else g for g, t in zip(gs, inputs, strict=True)]
    return (loss.detach(), lse.detach().reshape(y.shape), gs[0], gs[1], gs[2] if b64 is not None else None)


def rel_err(a, e) -> float:
    """Normwise relative error ||a - e|| / ||e|| in float64 (0 for two empty or zero arrays)."""
    a = torch.as_tensor(to_numpy(a), dtype=torch.float64)
    e = torch.as_tensor(to_numpy(e), dtype=torch.float64)
    d = float(torch.linalg.vector_norm(a - e))
    n = float(torch.linalg.vector_norm(e))
    return d / n if n else d


def grad_bounds(x, w, y, b, cw, *, reduction, grad_loss=None, grad_lse=None, label_smoothing=0.0, z_loss=0.0,
                softcap=None):
    """Elementwise magnitudes that bound each gradient's rounding error: |G| @ |W| for dx,
    |G|^T @ |X| for dW and sum_rows |G| for db, where |G| is the *uncancelled* magnitude of each
    logit's gradient, (|cp| p_c + |cy| [c = y] + |cw| w_c) |cap'| (the terms ce_rows adds,
    computed in fp32 before they cancel, e.g. p_y - 1 ~ 0), float64 on the CPU. A sum of terms
    each rounded once is then within a few roundings of that bound however much it cancels (the
    Higham bound, as bias_act's dbias check)."""
    x64, w64 = x.detach().double().cpu(), w.detach().double().cpu()
    b64 = None if b is None else b.detach().double().cpu()
    cw64 = None if cw is None else cw.detach().double().cpu()
    yy = y.reshape(-1).long().cpu()
    T, V = yy.shape[0], w.shape[0]
    z = lce.reference_logits_torch(x64.reshape(-1, w.shape[1]), w64, b64, softcap or 0.0)
    lse = torch.logsumexp(z, 1) if T else z.new_zeros(0)
    stats = lce.stats_torch(yy, cw64, V, -100, reduction == "mean", torch.float64).nan_to_num(0.0, 0.0, 0.0)
    gl = torch.ones(()) if grad_loss is None else grad_loss.detach().cpu()
    u = gl.double().reshape(-1) if reduction == "none" else (gl.double() * stats[1]).expand(T)
    valid = yy != -100
    u = torch.where(valid, u, 0).abs()
    w_y = valid.double() if cw64 is None else torch.where(valid, cw64[torch.where(valid, yy, 0)], 0)
    a = (1 - label_smoothing) * w_y
    cp = u * (a + label_smoothing / V * stats[2] + 2 * z_loss * lse.abs())
    if grad_lse is not None:
        cp = cp + grad_lse.detach().double().cpu().reshape(-1).abs()
    g = cp[:, None] * torch.exp(z - lse[:, None])
    g = g + (u * label_smoothing / V)[:, None] * (1 if cw64 is None else cw64.abs()[None])
    g = g.scatter_add(1, torch.where(valid, yy, 0)[:, None], (u * a)[:, None])
    if softcap:
        g = g * (1 - (z / softcap) ** 2).abs()
    xa = x64.reshape(-1, w.shape[1]).abs()
    if x.dtype != torch.float16:
        return g @ w64.abs(), g.T @ xa, g.sum(0)
    # float16's subnormals: below 2^-14 a rounding errs by up to 2^-25 absolute, not relative, both
    # for the logits' gradient and for the gradient rounded at the end
    floor = 2.0**-25 / GRAD_TOL["float16"]
    g = g + floor
    return g @ w64.abs() + floor, g.T @ xa + floor, g.sum(0) + floor


def check_grads(got, exp, bounds, tol, dw_tol=None):
    """Each gradient within ``tol * bound`` of the float64 oracle, elementwise (NaN where the
    oracle has NaN)."""
    for i, (g, e, bd) in enumerate(zip(got, exp, bounds, strict=True)):
        if e is None:
            continue
        t = dw_tol if i == 1 and dw_tol is not None else tol
        a = torch.as_tensor(to_numpy(g), dtype=torch.float64)
        assert a.shape == e.shape, (i, a.shape, e.shape)
        nan = torch.isnan(e)
        assert torch.equal(torch.isnan(a), nan), f"gradient {i}: NaN pattern differs"
        err = (a - e).abs().masked_fill(nan, 0)
        limit = t * bd + 1e-300
        assert bool((err <= limit).all()), (
            f"gradient {i}: max error {float(err.max()):.3e}, worst ratio {float((err / limit).max()):.3g}")


def make(T, H, V, dtype=torch.float64, *, ignore_frac=0.2, bias=False, weights=False, seed=0, device="cpu",
         scale=1.0, grid=False):
    """Random x (T, H), W (V, H), targets (a fraction ignored), bias and class weights. `grid`: x
    within +-4 and W within +-1 on grids exact in `dtype` (bfloat16: multiples of 1/8 and 1/32;
    float16: of 1/64 and 1/256), so that every float32 sum of up to 128 products is exact whatever
    its order: logits rounded to 16 bits are then the same on every device and in the oracle (and
    most of them do round)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * scale
    w = torch.randn(V, H, generator=g) / math.sqrt(max(H, 1))
    if grid:
        gx, gw = (64, 256) if dtype == torch.float16 else (8, 32)
        x, w = (x * gx).round().clamp(-4 * gx, 4 * gx) / gx, (w * gw).round().clamp(-gw, gw) / gw
    x, w = x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)
    y = torch.randint(0, V, (T,), generator=g)
    if T:
        y[torch.rand(T, generator=g) < ignore_frac] = -100
    b = (torch.randn(V, generator=g) * 0.5).to(device=device, dtype=dtype) if bias else None
    cw = (torch.rand(V, generator=g) + 0.5).to(device=device, dtype=dtype) if weights else None
    return x, w, y.to(device), b, cw


OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 3.0},
    {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 5.0},
]


# ------------------------------------------------------------------------- CPU: references (CI)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("bias,weights", [(False, False), (True, False), (False, True), (True, True)])
def test_cpu_values_and_gradients_match_oracle(reduction, opts, bias, weights):
    x, w, y, b, cw = make(13, 6, 11, bias=bias, weights=weights)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    loss, lse = cukit.linear_cross_entropy(xr, wr, y, linear_bias=br, weight=cw, reduction=reduction,
                                           return_lse=True, **opts)
    exp = oracle(x, w, y, b, cw, reduction=reduction, **opts)
    assert loss.dtype == torch.float64 and loss.shape == exp[0].shape
    assert_close(loss, exp[0], dtype="float64")
    assert_close(lse, exp[1], dtype="float64")
    loss.backward(torch.ones_like(loss))
    assert_close(xr.grad, exp[2], dtype="float64")
    assert_close(wr.grad, exp[3], dtype="float64")
    if b is not None:
        assert_close(br.grad, exp[4], dtype="float64")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [None, -100, 3])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
def test_cpu_matches_torch_linear_cross_entropy(reduction, ignore_index, label_smoothing):
    x, w, y, b, cw = make(9, 5, 7, bias=True, weights=True, ignore_frac=0.0)
    y[::3] = -100 if ignore_index is None else ignore_index
    kw = {"linear_bias": b, "weight": cw, "reduction": reduction, "ignore_index": ignore_index,
          "label_smoothing": label_smoothing}
    assert_close(cukit.linear_cross_entropy(x, w, y, **kw), F.linear_cross_entropy(x, w, y, **kw), dtype="float64")


def test_cpu_reference_gradient_formula_matches_autograd():
    # the closed form the kernels implement, with per-token upstream gradients and an lse gradient
    for reduction in REDUCTIONS:
        for opts in OPTIONS:
            x, w, y, b, cw = make(11, 4, 9, bias=True, weights=True, seed=1)
            loss, _ = lce.reference_torch(x, w, y, b, cw, reduction, -100, opts.get("label_smoothing", 0.0),
                                          opts.get("z_loss", 0.0), opts.get("softcap", 0.0))
            gl = torch.randn(loss.shape, dtype=torch.float64)
            gz = torch.randn(11, dtype=torch.float64)
            exp = oracle(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
            got = lce.reference_grad_torch(
                x, w, y, b, cw, reduction=reduction, ignore_index=-100, grad_loss=gl, grad_lse=gz,
                label_smoothing=opts.get("label_smoothing", 0.0), z_loss=opts.get("z_loss", 0.0),
                softcap=opts.get("softcap", 0.0))
            for g, e in zip(got, exp[2:], strict=True):
                assert_close(g, e, dtype="float64")


@given(T=st.integers(0, 12), H=st.integers(1, 6), V=st.integers(1, 9), reduction=st.sampled_from(REDUCTIONS),
       ls=st.sampled_from([0.0, 0.3]), zl=st.sampled_from([0.0, 0.01]), seed=st.integers(0, 2**16))
def test_cpu_numpy_reference_matches_oracle(T, H, V, reduction, ls, zl, seed):
    x, w, y, b, cw = make(T, H, V, bias=True, weights=True, seed=seed)
    loss, lse = cukit.linear_cross_entropy(x.numpy(), w.numpy(), y.numpy(), linear_bias=b.numpy(),
                                           weight=cw.numpy(), reduction=reduction, label_smoothing=ls, z_loss=zl,
                                           return_lse=True)
    assert isinstance(loss, np.ndarray) and loss.dtype == np.float64
    exp = oracle(x, w, y, b, cw, reduction=reduction, label_smoothing=ls, z_loss=zl)
    assert_close(loss, exp[0], dtype="float64")
    assert_close(lse, exp[1], dtype="float64")


def test_cpu_edge_cases_follow_torch():
    x, w, _, _, _ = make(4, 3, 5)
    y = torch.full((4,), -100)
    for kw in ({}, {"label_smoothing": 0.1}, {"z_loss": 0.1}):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = cukit.linear_cross_entropy(xr, wr, y, **kw)  # every token ignored: nan, as torch
        assert torch.isnan(loss)
        loss.backward()  # ... with zero gradients, as torch
        assert xr.grad.abs().sum() == 0 and wr.grad.abs().sum() == 0
        assert cukit.linear_cross_entropy(x, w, y, reduction="sum", **kw) == 0
    # a single token, unbatched (H,) input and () target, as torch's
    x1, w1 = torch.randn(3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    y1 = torch.tensor(2)
    for reduction in REDUCTIONS:
        got = cukit.linear_cross_entropy(x1, w1, y1, reduction=reduction)
        assert got.shape == () and got.dtype == torch.float64
        assert_close(got, F.linear_cross_entropy(x1, w1, y1, reduction=reduction), dtype="float64")
    # no tokens
    x0, y0 = torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    assert torch.isnan(cukit.linear_cross_entropy(x0, w1, y0))
    assert cukit.linear_cross_entropy(x0, w1, y0, reduction="sum") == 0
    assert cukit.linear_cross_entropy(x0, w1, y0, reduction="none").shape == (0,)
    # batched (B, S, H) input with (B, S) targets: per-token shape kept
    x3, y3 = torch.randn(2, 3, 3, dtype=torch.float64), torch.randint(0, 5, (2, 3))
    out, lse = cukit.linear_cross_entropy(x3, w1, y3, reduction="none", return_lse=True)
    assert out.shape == (2, 3) and lse.shape == (2, 3)
    assert_close(out, F.cross_entropy((x3 @ w1.T).reshape(6, 5), y3.reshape(6), reduction="none").reshape(2, 3),
                 dtype="float64")
    # int32 targets (torch's own cross_entropy wants int64)
    assert_close(cukit.linear_cross_entropy(x3, w1, y3.int()), cukit.linear_cross_entropy(x3, w1, y3),
                 dtype="float64")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cpu_low_precision_inputs_compute_in_float32(dtype):
    x, w, y, b, _ = make(8, 16, 33, dtype=DT[dtype], bias=True)
    loss = cukit.linear_cross_entropy(x, w, y, linear_bias=b)
    assert loss.dtype == torch.float32
    assert_close(loss, oracle(x, w, y, b)[0], atol=1e-5, rtol=1e-5)


def test_cpu_autocast_lowers_like_linear():
    x, w, y, _, _ = make(6, 8, 10, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cukit.linear_cross_entropy(x, w, y)
    assert loss.dtype == torch.float32
    assert_close(loss, oracle(x.bfloat16(), w.bfloat16(), y)[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------- CPU: the torch op, compile, opcheck
def _op_args(x, w, y, b=None, cw=None, reduction="mean", return_lse=False, flags=(True, True, True), **kw):
    return (x, w, y, b, cw, reduction, kw.get("ignore_index", -100), kw.get("label_smoothing", 0.0),
            kw.get("z_loss", 0.0), kw.get("softcap", 0.0), return_lse, 4, "float32", False, *flags)


def test_cpu_opcheck():
    x, w, y, b, cw = make(7, 4, 6, dtype=torch.float32, bias=True, weights=True)
    for reduction in REDUCTIONS:
        args = _op_args(x.requires_grad_(), w.requires_grad_(), y, b.requires_grad_(), cw, reduction,
                        label_smoothing=0.1, z_loss=0.01)
        torch.library.opcheck(torch.ops.cukit.linear_cross_entropy.default, args)
    # the logits option (the schema's last argument), in a 16-bit dtype where it rounds
    xb, wb, bb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (x, w, b))
    torch.library.opcheck(torch.ops.cukit.linear_cross_entropy.default,
                          (*_op_args(xb, wb, y, bb, cw, "mean"), 0, "input"))
    lse = torch.logsumexp(x.detach() @ w.detach().T + b.detach(), 1)
    stats = lce.stats_torch(y, cw, 6, -100, True, torch.float32)
    torch.library.opcheck(torch.ops.cukit.linear_cross_entropy_backward.default,
                          (x.detach(), w.detach(), y, b.detach(), cw, lse, stats, torch.tensor(1.0), None, "mean",
                           -100, 0.1, 0.01, 0.0, 4, "float32", True, True, True))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cpu_dispatch_path_matches_oracle(reduction):
    # the registered op and its own backward formulas (what torch.compile and subclasses reach)
    x, w, y, b, cw = make(9, 5, 8, bias=True, weights=True)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    out = torch.ops.cukit.linear_cross_entropy(*_op_args(xr, wr, y, br, cw, reduction, True, label_smoothing=0.1,
                                                         z_loss=0.01, softcap=4.0))
    gl = torch.randn(out[0].shape, dtype=torch.float64)
    gz = torch.randn(9, dtype=torch.float64)
    torch.autograd.backward([out[0], out[1]], [gl, gz])
    exp = oracle(x, w, y, b, cw, reduction=reduction, label_smoothing=0.1, z_loss=0.01, softcap=4.0, grad_loss=gl,
                 grad_lse=gz)
    assert_close(out[0], exp[0], dtype="float64")
    for got, e in zip((xr.grad, wr.grad, br.grad), exp[2:], strict=True):
        assert_close(got, e, dtype="float64")


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    def f(x, w, y, b):
        loss, lse = cukit.linear_cross_entropy(x * 2, w, y, linear_bias=b, label_smoothing=0.1, z_loss=1e-3,
                                               return_lse=True)
        return loss + 1e-2 * lse.sum()

    x, w, y, b, _ = make(10, 6, 12, dtype=torch.float32, bias=True)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(xr, wr, y, br)
    out.backward()
    x2, w2, b2 = (t.clone().requires_grad_() for t in (x, w, b))
    ref = f(x2, w2, y, b2)
    ref.backward()
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, e in ((xr, x2), (wr, w2), (br, b2)):
        assert_close(a.grad, e.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["default", "plain", "input-logits", "options", "large"])
def test_cpu_compile_traces_torch_form_only_for_small_default_calls(compile_policy: str, case: str, monkeypatch):
    # the "inductor" policy traces a default call with small logits as torch's F.linear +
    # cross-entropy form (also with logits="input", the rounding that form makes); options that
    # chunk otherwise, logits over the limit or the "kernels" policy keep the op
    from torch._dynamo.testing import EagerAndRecordGraphs

    import cukit.torch.linear_cross_entropy as tlce

    if case == "large":
        monkeypatch.setattr(tlce, "COMPILE_AS_TORCH_MAX_LOGITS_BYTES", 5 * 6 * 4 - 1)
    opts = {"options": cukit.LinearCrossEntropyOptions(chunk_size=2),
            "input-logits": cukit.LinearCrossEntropyOptions(logits="input")}.get(case)
    backend = EagerAndRecordGraphs()
    x, w, y, _, _ = make(5, 4, 6, dtype=torch.float32)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    # "plain" (no z_loss): F.cross_entropy itself, with ignored targets, class weights, smoothing
    y[1] = -100
    cw = torch.rand(6) + 0.5 if case == "plain" else None
    zl = 0.0 if case == "plain" else 1e-3

    def f(x, w, y):
        return cukit.linear_cross_entropy(x, w, y, weight=cw, label_smoothing=0.1, z_loss=zl, options=opts)

    out = torch.compile(f, fullgraph=True, backend=backend)(xr, wr, y)
    out.backward()
    torch_form = compile_policy == "inductor" and case in ("default", "plain", "input-logits")
    if torch_form and case == "plain":
        assert "cross_entropy" in backend.graphs[0].code
    assert ("cukit.linear_cross_entropy" in backend.graphs[0].code) is not torch_form
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = f(x2, w2, y)
    ref.backward()
    assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, e in ((xr, x2), (wr, w2)):
        assert_close(a.grad, e.grad, atol=1e-6, rtol=1e-6)


def test_cpu_double_backward_through_reference():
    # eager CPU calls are the reference under torch's autograd: higher derivatives work there
    x, w, y, _, _ = make(4, 3, 5)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(cukit.linear_cross_entropy(xr, w, y), xr, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), xr)
    assert torch.isfinite(h).all()


# --------------------------------------------- CPU: the GPU path's chunk loops, emulated
class TorchSteps:
    """raw_kernels/cross_entropy.cu's kernels in torch: what ``DeviceSteps`` launches, so that
    ``run_forward`` / ``run_backward`` (chunking, buffers, scales, the gradient written over the
    logits) run on the CPU. The per-row maths are the references'; the roundings are the kernels'
    (fp32 accumulators, one rounding to the input dtype)."""

    def __init__(self, plan: lce.Plan) -> None:
        self.plan = plan
        self.calls: list[str] = []

    def stats(self, target, cw, stats, n, stream):
        sp = self.plan.spec
        stats.copy_(lce.stats_torch(target[:n], cw, self.plan.V, sp.ignore_index, sp.reduction == "mean",
                                    stats.dtype))

    def rows(self, mode, ws, bias, target, cw, stats, row_grad, grad0, lse_grad, lse, row_loss, r0, n, stream, *,
             col0=0, cols=None, ld=None, out=None, ldo=0):
        p, sp = self.plan, self.plan.spec
        cols = p.V if cols is None else cols
        assert (col0, cols) == (0, p.V) or mode == lce.MODE_REGRAD, "a block of classes only for the regrad"
        assert ld is None or ws.shape[1] == ld
        self.calls.append(f"rows{mode}:{r0}+{n}" + (f"@{col0}+{cols}" if cols != p.V else ""))
        z = ws[:n, :cols].to(DT[p.acc])  # 16-bit logits (logits="input") widened as the kernel loads them
        if bias is not None:
            z = z + bias[col0:col0 + cols].to(z.dtype)
        if sp.softcap:
            z = sp.softcap * torch.tanh(z / sp.softcap)
        y = target[r0:r0 + n].long()
        if mode == lce.MODE_REGRAD:
            lz = lse[r0:r0 + n]
        else:
            lz = torch.logsumexp(z, 1)
            lse[r0:r0 + n] = lz
            row_loss[r0:r0 + n] = lce.row_loss_torch(z, y, cw, lz, sp.ignore_index, sp.label_smoothing, sp.z_loss)
        if mode == lce.MODE_LOSS:
            return
        if mode == lce.MODE_GRAD and grad0 is None:
            u = torch.ones(n, dtype=z.dtype)
        else:
            u = row_grad[r0:r0 + n] if row_grad is not None else (grad0 * stats[1]).expand(n)
        v = None if lse_grad is None else lse_grad[r0:r0 + n]
        # a block of classes: its columns placed in a full row (each column's gradient depends on its
        # own logit and the row's saved lse only)
        full = z.new_zeros(n, p.V)
        full[:, col0:col0 + cols] = z
        g = lce.dlogits_torch(full, y, cw, lz, stats, u, v, sp.ignore_index, sp.label_smoothing, sp.z_loss,
                              sp.softcap)[:, col0:col0 + cols]
        if out is not None:  # the stored gradient of every token
            assert out.dtype == DT[p.dtype] and out.shape[1] == ldo >= cols
            out[:n, :cols] = g
            return
        view = ws.view(DT[p.dtype]) if p.narrow else ws
        view[:n, :cols] = g  # rounded once to the input dtype, over the logits it came from

    def total(self, row_loss, stats, out, n, stream):
        out.copy_(row_loss[:n].sum() * stats[0])

    def colsum(self, g, ldg, partial, acc, n, first, stream):
        s = g[:n].to(acc.dtype).sum(0)
        acc.copy_(s if first else acc + s)

    def scale_cast(self, src, dst, s0, s1, factor, stream):
        a = src.to(torch.float64 if src.dtype == torch.float64 else torch.float32) * factor
        if s0 is not None:
            a = a * s0.reshape(())
        if s1 is not None:
            a = a * s1.reshape(())
        dst.copy_(a)


def fake_gemm(a, b, out, *, alpha=1.0, beta=0.0):
    """cukit.ops.matmul.gemm's contract: out = alpha a @ b + beta out, accumulated in fp32 (fp64 for
    fp64) and rounded once to out's dtype; beta == 0 never reads out."""
    assert out.stride(-1) == 1 and a.shape[1] == b.shape[0] and tuple(out.shape) == (a.shape[0], b.shape[1])
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    assert a.dtype == b.dtype and out.dtype in (a.dtype, acc)
    r = alpha * (a.to(acc) @ b.to(acc))
    if beta:
        r = r + beta * out.to(acc)
    out.copy_(r)
    return out


def emulated_gemm():
    """cukit.ops.matmul.gemm replaced by fake_gemm inside the block (the GEMM entry's CPU form)."""
    from unittest import mock

    from cukit.ops import matmul

    return mock.patch.object(matmul, "gemm", fake_gemm, create=True)


def emulated_plan(x, w, y, spec, tc, accumulate="float32", vb=0, logits="float32"):
    dtype = str(x.dtype).removeprefix("torch.")
    acc = "float64" if dtype == "float64" else "float32"
    wdt = lce.logits_dtype(dtype, logits)
    T, H, V = x.shape[0], x.shape[1], w.shape[0]
    asize = DT[wdt].itemsize
    vb = min(vb, V)
    plan = lce.Plan(T, H, V, max(1, min(tc, T)), lce._ld(V, asize), dtype, acc, spec, accumulate, None, vb,
                    lce._ld(vb, asize) if vb else 0, wdt)
    plan.steps = TorchSteps(plan)
    return plan


def emulated_call(x, w, y, b, cw, *, reduction="mean", tc=3, accumulate="float32", grad_loss=None, grad_lse=None,
                  vb=None, logits="float32", **opts):
    """The GPU path on the CPU: forward with gradients ('mean'/'sum') and the torch layer's
    finishing, or forward + recomputing backward ('none', or an lse gradient). `vb`: classes per
    block of "recompute" (default 4)."""
    spec = lce.check_spec(reduction, None, opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0),
                          opts.get("softcap"), False)
    with emulated_gemm():
        return _emulated(x, w, y, b, cw, spec, tc, accumulate, reduction, grad_loss, grad_lse, vb, logits)


def _emulated(x, w, y, b, cw, spec, tc, accumulate, reduction, grad_loss, grad_lse, vb=None, logits="float32"):
    vb = (4 if vb is None else vb) if accumulate == "recompute" else 0
    plan = emulated_plan(x, w, y, spec, tc, accumulate, vb, logits)
    acc = DT[plan.acc]
    cwa = None if cw is None else cw.to(acc)
    precompute = reduction != "none" and grad_lse is None
    loss, lse, dx_b, dw_b, db_b, stats = lce.run_forward(plan, plan.steps, None, x, w, y, b, cwa,
                                                         need_dx=precompute, need_dw=precompute,
                                                         need_db=precompute and b is not None)
    gl = torch.ones_like(loss) if grad_loss is None else grad_loss.to(acc)
    if precompute:
        s = gl if accumulate == "recompute" else stats[1] * gl  # (the torch layer's _finish)
        dx = (dx_b.to(acc) * s).to(x.dtype)
        if plan.stored:  # the logit gradient G of every token: dW in blocks of classes
            assert dw_b.shape == (plan.T, lce.stored_ld(plan.V)) and dw_b.dtype == x.dtype
            dw = lce.stored_dw(dw_b[:, :plan.V], x, torch.empty(plan.V, plan.H, dtype=w.dtype), stats[1:2],
                               gl.reshape(1), lambda src, dst, a, b: dst.copy_(src * a[0] * b[0]))
        else:
            dw = (dw_b.to(acc) * s / plan.dw_alpha()).to(w.dtype)
        db = None if b is None else (db_b * s).to(b.dtype)
    else:
        dx, dw, db = lce.run_backward(plan, plan.steps, None, x, w, y, b, cwa, lse, stats, gl,
                                      None if grad_lse is None else grad_lse.to(acc), need_dx=True, need_dw=True,
                                      need_db=b is not None)
    return loss, lse, dx, dw, db, plan


TOL = {"float64": (1e-10, 1e-9), "float32": (2e-5, 2e-5), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3)}
# gradient error per unit of grad_bounds: the gradient of each logit rounded to the input dtype, the
# GEMM's sum rounded once (fp32 GEMMs: K fp32 roundings, K up to ~4K in these tests)
GRAD_TOL = {"float64": 1e-12, "float32": 1e-4, "bfloat16": 4 * 2.0**-8, "float16": 4 * 2.0**-11}


@given(T=st.integers(0, 11), H=st.integers(1, 6), V=st.sampled_from([1, 2, 5, 7, 13, 33]),
       tc=st.sampled_from([1, 2, 3, 5, 64]), reduction=st.sampled_from(REDUCTIONS),
       dtype=st.sampled_from(["float64", "float32", "bfloat16"]), bias=st.booleans(), weights=st.booleans(),
       ls=st.sampled_from([0.0, 0.2]), zl=st.sampled_from([0.0, 0.01]), cap=st.sampled_from([None, 4.0]),
       lse_grad=st.booleans(), ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16),
       accumulate=st.sampled_from(["float32", "recompute"]), vb=st.sampled_from([1, 2, 5, 64]))
@settings(max_examples=80)
def test_cpu_emulated_chunk_loops_match_oracle(T, H, V, tc, reduction, dtype, bias, weights, ls, zl,
                                               cap, lse_grad, ignored, seed, accumulate, vb):
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=bias, weights=weights, seed=seed, ignore_frac=ignored)
    opts = {"label_smoothing": ls, "z_loss": zl, "softcap": cap}
    gen = torch.Generator().manual_seed(seed)
    gl = torch.randn(() if reduction != "none" else (T,), generator=gen, dtype=torch.float64)
    gz = torch.randn(T, generator=gen, dtype=torch.float64) if lse_grad else None
    loss, lse, dx, dw, db, _ = emulated_call(x, w, y, b, cw, reduction=reduction, tc=tc, grad_loss=gl,
                                             grad_lse=gz, accumulate=accumulate, vb=vb, **opts)
    exp = oracle(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
    lt = TOL["float64" if dtype == "float64" else "float32"]
    assert_close(loss, exp[0], atol=lt[0], rtol=lt[1])
    assert_close(lse.reshape(-1), exp[1].reshape(-1), atol=lt[0], rtol=lt[1])
    bounds = grad_bounds(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
    # "recompute" rounds the scaled gradients in the forward and multiplies the upstream gradient
    # (random here, not a power of two) after: a second rounding
    check_grads((dx, dw, db), exp[2:], bounds, GRAD_TOL[dtype] * (2 if accumulate == "recompute" else 1))


@given(T=st.integers(0, 11), H=st.integers(1, 6), V=st.sampled_from([1, 5, 13, 33]), tc=st.sampled_from([1, 3, 64]),
       reduction=st.sampled_from(REDUCTIONS), dtype=st.sampled_from(["bfloat16", "float16"]), bias=st.booleans(),
       weights=st.booleans(), ls=st.sampled_from([0.0, 0.2]), zl=st.sampled_from([0.0, 0.01]),
       cap=st.sampled_from([None, 4.0]), lse_grad=st.booleans(), ignored=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 2**16), accumulate=st.sampled_from(["float32", "input", "recompute"]),
       vb=st.sampled_from([1, 5, 64]))
@settings(max_examples=60)
def test_cpu_emulated_input_logits_match_rounded_oracle(T, H, V, tc, reduction, dtype, bias, weights, ls, zl, cap,
                                                        lse_grad, ignored, seed, accumulate, vb):
    # logits="input": a 16-bit workspace (the gradient written over the logits it came from, same
    # width), every mode, against the oracle whose product is rounded once to the input dtype
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=bias, weights=weights, seed=seed, ignore_frac=ignored,
                          scale=2.0, grid=True)
    opts = {"label_smoothing": ls, "z_loss": zl, "softcap": cap}
    gen = torch.Generator().manual_seed(seed)
    gl = torch.randn(() if reduction != "none" else (T,), generator=gen, dtype=torch.float64)
    gz = torch.randn(T, generator=gen, dtype=torch.float64) if lse_grad else None
    loss, lse, dx, dw, db, plan = emulated_call(x, w, y, b, cw, reduction=reduction, tc=tc, grad_loss=gl,
                                                grad_lse=gz, accumulate=accumulate, vb=vb, logits="input", **opts)
    assert plan.wdt == dtype and not plan.narrow
    exp = oracle(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, round_product=True, **opts)
    assert_close(loss, exp[0], atol=2e-5, rtol=2e-5)
    assert_close(lse.reshape(-1), exp[1].reshape(-1), atol=2e-5, rtol=2e-5)
    bounds = grad_bounds(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
    tol = GRAD_TOL[dtype] * (2 if accumulate == "recompute" else 1)
    chunks = -(-T // max(1, min(tc, T))) if T else 1
    dw_tol = tol * max(1.0, 2 * math.sqrt(chunks)) if accumulate == "input" else None
    check_grads((dx, dw, db), exp[2:], bounds, tol, dw_tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_input_logits_round_the_product_once(dtype):
    """logits="input" rounds x W^T once to the input dtype, before the bias: on the emulated GPU
    path, on the CPU path of cukit.linear_cross_entropy (and its gradients), on the registered op
    and on the NumPy path; logits="float32" does not round."""
    x, w, y, b, _ = make(64, 16, 50, dtype=DT[dtype], bias=True, scale=2.0, grid=True, seed=5)
    exp16 = oracle(x, w, y, b, round_product=True)
    exp32 = oracle(x, w, y, b)
    lse16 = emulated_call(x, w, y, b, None, tc=16, logits="input")[1]
    lse32 = emulated_call(x, w, y, b, None, tc=16)[1]
    assert_close(lse16, exp16[1], atol=2e-5, rtol=2e-5)
    assert_close(lse32, exp32[1], atol=2e-5, rtol=2e-5)
    assert float((lse16 - exp32[1]).abs().max()) > 1e-3  # the rounding is there
    opts = cukit.LinearCrossEntropyOptions(logits="input")
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    loss, lse = cukit.linear_cross_entropy(xr, wr, y, linear_bias=br, options=opts, return_lse=True)
    loss.backward()
    assert_close(lse, exp16[1], atol=2e-5, rtol=2e-5)
    assert_close(loss, exp16[0], atol=2e-5, rtol=2e-5)
    bounds = grad_bounds(x, w, y, b, None, reduction="mean")
    check_grads((xr.grad, wr.grad, br.grad), exp16[2:], bounds, GRAD_TOL[dtype])
    # the registered op (the dispatch path) with its own backward formulas
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    out = torch.ops.cukit.linear_cross_entropy(x, w, y, b, None, "mean", -100, 0.0, 0.0, 0.0, True, 4, "float32",
                                               False, True, True, True, 0, "input")
    assert_close(out[1], exp16[1], atol=2e-5, rtol=2e-5)
    out = torch.ops.cukit.linear_cross_entropy(xr, wr, y, br, None, "none", -100, 0.0, 0.0, 0.0, True, 4, "float32",
                                               False, True, True, True, 0, "input")
    out[0].sum().backward()
    exp_none = oracle(x, w, y, b, reduction="none", round_product=True)
    check_grads((xr.grad, wr.grad, br.grad), exp_none[2:], grad_bounds(x, w, y, b, None, reduction="none"),
                GRAD_TOL[dtype])
    if dtype == "float16":  # NumPy has float16
        got = cukit.linear_cross_entropy(x.numpy(), w.numpy(), y.numpy(), linear_bias=b.numpy(), options=opts,
                                         return_lse=True)[1]
        assert_close(torch.from_numpy(np.asarray(got)), exp16[1], atol=2e-5, rtol=2e-5)


def test_stores_logit_grads_rule():
    """The stored logit gradient (tokens x vocab, 16-bit) replaces the float32 dW accumulator only
    where it is no larger (tokens <= 2 x hidden), for 'mean'/'sum' with float32 accumulation."""
    f = lce.stores_logit_grads
    assert f(8192, 4096, 128256, "bfloat16", "float32", "mean")
    assert f(8192, 4096, 128256, "float16", "float32", "sum")
    assert not f(8192, 2048, 128256, "bfloat16", "float32", "mean")  # 2 GiB of G against 1 GiB of dW
    assert not f(100, 64, 1000, "bfloat16", "float32", "none")
    assert not f(100, 64, 1000, "bfloat16", "input", "mean") and not f(100, 64, 1000, "bfloat16", "recompute", "mean")
    assert not f(100, 64, 1000, "float32", "float32", "mean") and not f(0, 64, 1000, "bfloat16", "float32", "mean")
    assert lce.stored_ld(1) == 8 and lce.stored_ld(128256) == 128256 and lce.stored_ld(32001) == 32008


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cpu_emulated_stored_logit_grads(dtype, reduction, monkeypatch):
    """The forward keeps G (every token's logit gradient, written by the row kernel into its own
    buffer chunk by chunk) and dW comes from it in blocks of classes through a float32 scratch:
    three blocks here (the scratch shrunk to 128 classes), the chunk loop of 3 tokens, bias,
    class weights and every option."""
    monkeypatch.setattr(lce, "STORED_SCRATCH_BYTES", 128 * 4 * 8)
    T, H, V = 11, 8, 300
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=True, weights=True, seed=3)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 4.0}
    gl = torch.tensor(0.75, dtype=torch.float64)
    loss, lse, dx, dw, db, plan = emulated_call(x, w, y, b, cw, reduction=reduction, tc=3, grad_loss=gl, **opts)
    assert_close(lse, exp_lse := oracle(x, w, y, b, cw, reduction=reduction, **opts)[1], atol=2e-5, rtol=2e-5)
    assert exp_lse.shape == (T,) and plan.stored and plan.steps.calls == ["rows1:0+3", "rows1:3+3", "rows1:6+3", "rows1:9+2"]
    exp = oracle(x, w, y, b, cw, reduction=reduction, grad_loss=gl, **opts)
    assert_close(loss, exp[0], atol=2e-5, rtol=2e-5)
    check_grads((dx, dw, db), exp[2:], grad_bounds(x, w, y, b, cw, reduction=reduction, grad_loss=gl, **opts),
                GRAD_TOL[dtype])


def test_cpu_emulated_recompute_passes():
    # the first pass over 4-token chunks (gradient scaled by the reduction, dx per chunk), the
    # second over blocks of 3 classes of every token (dW rows per block)
    x, w, y, _, _ = make(10, 4, 7, dtype=torch.float32)
    *_, plan = emulated_call(x, w, y, None, None, tc=4, accumulate="recompute", vb=3)
    assert plan.steps.calls == ["rows1:0+4", "rows1:4+4", "rows1:8+2", "rows2:0+10@0+3", "rows2:0+10@3+3",
                                "rows2:0+10@6+1"]
    assert (plan.vb, plan.ldb) == (3, 8)
    # 'none': the recomputing backward's two passes
    *_, plan = emulated_call(x, w, y, None, None, tc=4, reduction="none", accumulate="recompute", vb=4)
    assert plan.steps.calls[3:] == ["rows2:0+4", "rows2:4+4", "rows2:8+2", "rows2:0+10@0+4", "rows2:0+10@4+3"]


def test_cpu_emulated_recompute_is_exact_in_bf16():
    # dW of every block from one GEMM over all tokens, rounded once: the error of one rounding, as
    # float32 accumulation's (its gradient is rounded at another scale: not bitwise the same), and
    # below 'input''s, which rounds dW once per chunk (16 chunks here)
    x, w, y, _, _ = make(256, 32, 64, dtype=torch.bfloat16, seed=3)
    exp = oracle(x, w, y)

    def errs(**kw):
        return [rel_err(t, e) for t, e in zip(emulated_call(x, w, y, None, None, tc=16, **kw)[2:4], exp[2:4],
                                              strict=True)]

    e32, erc, ein = errs(), errs(accumulate="recompute", vb=24), errs(accumulate="input")
    assert max(erc) <= 2 ** -8 and all(a <= 1.5 * b for a, b in zip(erc, e32, strict=True)), (erc, e32)
    assert erc[1] < ein[1], (erc, ein)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("reduction,lse_grad", [("mean", False), ("sum", True), ("none", False)])
@pytest.mark.parametrize("accumulate", ["float32", "input", "recompute"])
def test_cpu_chunk_loops_with_cukit_gemm(dtype, reduction, lse_grad, accumulate):
    # the chunk loops through cukit.ops.matmul.gemm itself (its CPU reference): the entry accepts the
    # operands the GPU path hands it (a padded fp32 out, g with row stride 2 ld, g.T column-major,
    # beta = 1 into fp32 and 16-bit outputs)
    from cukit.ops import matmul

    if not hasattr(matmul, "gemm"):
        pytest.skip("cukit.ops.matmul.gemm has not landed")
    x, w, y, b, cw = make(13, 8, 33, dtype=DT[dtype], bias=True, weights=True, seed=4, scale=2.0)
    gl = torch.randn(() if reduction != "none" else (13,), dtype=torch.float64)
    gz = torch.randn(13, dtype=torch.float64) if lse_grad else None
    opts = {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 4.0}
    spec = lce.check_spec(reduction, None, 0.1, 1e-2, 4.0, False)
    out = _emulated(x, w, y, b, cw, spec, 4, accumulate, reduction, gl, gz)
    exp = oracle(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
    lt = TOL["float64" if dtype == "float64" else "float32"]
    assert_close(out[0], exp[0], atol=lt[0], rtol=lt[1])
    bounds = grad_bounds(x, w, y, b, cw, reduction=reduction, grad_loss=gl, grad_lse=gz, **opts)
    dw_tol = 2 * math.sqrt(4) * GRAD_TOL[dtype] if accumulate == "input" else None
    check_grads(out[2:5], exp[2:], bounds, GRAD_TOL[dtype], dw_tol)


def test_cpu_emulated_chunks_cover_every_row_once():
    x, w, y, _, _ = make(10, 4, 7, dtype=torch.float32)
    *_, plan = emulated_call(x, w, y, None, None, tc=4)
    assert plan.steps.calls == ["rows1:0+4", "rows1:4+4", "rows1:8+2"]
    *_, plan = emulated_call(x, w, y, None, None, tc=4, reduction="none")
    assert plan.steps.calls == ["rows0:0+4", "rows0:4+4", "rows0:8+2", "rows2:0+4", "rows2:4+4", "rows2:8+2"]


def test_cpu_emulated_input_accumulation_error_is_bounded():
    # bf16 dW accumulated in bf16 across 16 chunks vs float32 accumulators rounded once
    x, w, y, _, _ = make(256, 32, 64, dtype=torch.bfloat16, seed=3)
    exp = oracle(x, w, y)
    e32 = rel_err(emulated_call(x, w, y, None, None, tc=16, accumulate="float32")[3], exp[3])
    ein = rel_err(emulated_call(x, w, y, None, None, tc=16, accumulate="input")[3], exp[3])
    assert e32 <= 2 ** -8 and ein <= 4 * 2 ** -8 and e32 <= ein * 1.05, (e32, ein)


def test_cpu_emulated_float16_input_accumulation_keeps_range():
    # 4096 tokens all of class 0 with large activations: the mean's dW fits float16, but the unscaled
    # sum the forward accumulates (4096 x 40 x 2 / 3) does not; the 1 / T factor keeps it in range
    T = 4096
    x = torch.full((T, 4), 40.0, dtype=torch.float16)
    w = torch.zeros(3, 4, dtype=torch.float16)
    y = torch.zeros(T, dtype=torch.long)
    dw = emulated_call(x, w, y, None, None, tc=512, accumulate="input")[3]
    assert torch.isfinite(dw).all()
    assert_close(dw, oracle(x, w, y)[3], dtype="float16")


# ------------------------------------------------------------------------ CPU: options, errors
def test_options_chunking_and_translation():
    o = cukit.LinearCrossEntropyOptions()
    # float32 accumulation of 16-bit inputs: up to 1024 tokens within half the fp32 dW accumulator
    assert o.grad_accumulation == "float32" and o.chunk_rows(8192, 128256, 4096) == 1024
    assert o.chunk_rows(8192, 256000, 2304) == 1024 and o.chunk_rows(16384, 32000, 2048) == 2048
    lean = cukit.LinearCrossEntropyOptions(grad_accumulation="input")
    assert lean.chunk_rows(8192, 128256, 4096) == 512  # 256 MiB
    assert o.chunk_rows(8192, 128256, 4096, "float32") == 512
    assert o.chunk_rows(100, 128256, 4096) == 100 and o.chunk_rows(8192, 10**9, 64, "float32") == 1
    assert cukit.LinearCrossEntropyOptions(chunk_size=77).chunk_rows(50, 10) == 50
    assert cukit.LinearCrossEntropyOptions(workspace_bytes=64 << 20).chunk_rows(8192, 128256, 4096) == 128
    # "recompute": first-pass chunks up to dW's size (1,002 MiB: 2,048 tokens), second-pass blocks of
    # every token's logits within workspace_bytes (64 MiB: 2,048 classes), at least 128 classes
    rc = cukit.LinearCrossEntropyOptions(grad_accumulation="recompute")
    assert rc.chunk_rows(8192, 128256, 4096) == 2048 and rc.vocab_block(8192, 128256) == 2048
    assert rc.vocab_block(8192, 100) == 100 and rc.vocab_block(10**7, 128256) == 128
    assert rc.chunk_rows(4096, 32000, 1024) == 512 and rc.vocab_block(4096, 32000, "float64") == 2048
    assert o.vocab_block(8192, 128256) == 0 and lean.vocab_block(8192, 128256) == 0
    # 16-bit logits: twice the tokens in the same bytes (llama8's head: 2,048 tokens, 501 MiB)
    i16 = cukit.LinearCrossEntropyOptions(logits="input")
    assert i16.chunk_rows(8192, 128256, 2048) == 2048 and o.chunk_rows(8192, 128256, 2048) == 1024
    assert i16.chunk_rows(8192, 128256, 4096, "float32") == 512  # float32 inputs ignore it
    assert cukit.LinearCrossEntropyOptions(logits="input", grad_accumulation="recompute").vocab_block(8192, 128256) == 4096
    assert lce.logits_dtype("bfloat16", "input") == "bfloat16" and lce.logits_dtype("float32", "input") == "float32"
    assert lce.logits_dtype("float16") == "float32" and lce.logits_dtype("float64", "input") == "float64"
    assert lce.is_default_chunking(i16) and lce.is_default_chunking(o) and not lce.is_default_chunking(lean)
    with pytest.raises(ValueError, match="logits must be one of 'float32', 'input'; got 'bf16'"):
        cukit.LinearCrossEntropyOptions(logits="bf16")
    t = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=256, acc_policy="compact")
    r = lce.resolve_options(t, 8192, 4096, 128256)
    assert r.chunk_size == 256 and r.grad_accumulation == "input"
    r = lce.resolve_options(torch.nn.LinearCrossEntropyOptions(chunking_method="aspect_ratio:2",
                                                               acc_policy="balanced"), 8192, 4096, 128256)
    assert r.chunk_size == 128 and r.grad_accumulation == "float32"
    assert lce.resolve_options(torch.nn.LinearCrossEntropyOptions(), 8192, 4096, 128256).chunk_size is None
    with pytest.raises(ValueError, match="grad_accumulation must be one of"):
        cukit.LinearCrossEntropyOptions(grad_accumulation="bf16")
    with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1"):
        cukit.LinearCrossEntropyOptions(chunk_size=0)
    with pytest.raises(TypeError, match=r"options must be None, a cukit\.LinearCrossEntropyOptions"):
        cukit.linear_cross_entropy(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long),
                                   options={"chunk_size": 4})


def test_device_steps_cache_a_launch_per_row_stride(monkeypatch):
    """DeviceSteps bakes each launch's scalar arguments, so calls that differ in one need launches
    of their own: the column sums of the forward's stored gradient (16-byte rows) and of the
    backward's workspace (32-byte rows) in one plan read rows of different strides (a launch
    cached by the row count alone summed the wrong elements of the other). Every launch is
    prepared once per argument set."""
    from cukit._device import DeviceCaps

    prepared = []
    monkeypatch.setattr(lce.KERNELS, "prepare", lambda name, grid, block, tail, **k: (
        prepared.append((name, tail)) or (lambda args, stream: None)))
    monkeypatch.setattr(lce, "sm_count", lambda device: 4)
    spec = lce.check_spec("mean", None, 0.0, 0.0, None, False)
    steps = lce.DeviceSteps("bfloat16", "int64", 0, 33, lce._ld(33, 2), spec, "bfloat16")
    for ldg in (lce.stored_ld(33), lce._ld(33, 2), lce.stored_ld(33)):
        steps.colsum(None, ldg, None, None, 5, True, None)
    strides = [tail[2] for name, tail in prepared if name.startswith("ce_colsum<")]
    assert strides == [lce.stored_ld(33), lce._ld(33, 2)]
    # every launch: one per distinct argument set, reused on a repeat (ce_rows off Hopper)
    monkeypatch.setattr(lce, "device_caps", lambda device: DeviceCaps(80, 4, 163 * 1024))
    prepared.clear()
    for n in (5, 7, 5):
        steps.stats(None, None, None, n, None)
        steps.total(None, None, None, n, None)
        for ld in (lce._ld(33, 2), 2 * lce._ld(33, 2), lce._ld(33, 2)):
            steps.rows(lce.MODE_GRAD, None, None, None, None, None, None, None, None, None, None, 0, n, None, ld=ld)
    counts = {}
    for name, _ in prepared:
        counts[name.split("<")[0]] = counts.get(name.split("<")[0], 0) + 1
    assert counts == {"ce_stats": 2, "ce_total": 2, "ce_rows": 4}


def test_held_config_covers_the_row_and_prefers_two_ctas_per_sm():
    """ce_rows_held's (cluster, vectors per thread, threads): the CTAs of the cluster hold the whole
    row (threads x R x 4 elements each), R = 8 while a cluster of 8 suffices, threads trimmed to
    a multiple of 32; ce_rows below HELD_MIN_VOCAB, for float64 and beyond 262,144 classes."""
    assert lce.held_config(lce.HELD_MIN_VOCAB - 1, "bfloat16") is None
    assert lce.held_config(128256, "float64") is None
    assert lce.held_config(8 * 512 * 16 * 4 + 4, "bfloat16") is None
    assert lce.held_config(32000, "bfloat16") == (2, 8, 512)
    assert lce.held_config(50257, "float16") == (4, 8, 416)
    assert lce.held_config(128256, "bfloat16") == (8, 8, 512)
    assert lce.held_config(256000, "float32") == (8, 16, 512)
    for v in (16384, 16387, 40001, 65536, 65537, 100003, 131072, 131075, 200001, 262144):
        cl, r, threads = lce.held_config(v, "float32")
        assert (cl, r) in lce.HELD_CONFIGS and threads % 32 == 0 and 32 <= threads <= 512
        assert cl * threads * r * 4 >= v - v % 4  # the tail (< 4 elements) rides on rank 0
        assert cl * (threads - 32) * r * 4 < v or threads == 32  # no idle warp in every CTA
        # 16-bit logits: vectors of 8, half as many per thread, the same threads and cluster
        assert lce.held_config(v, "bfloat16", "bfloat16") == (cl, r // 2, threads)
    assert lce.held_config(128256, "bfloat16", "bfloat16") == (8, 4, 512)


def test_bad_input_raises_clear_errors():
    x, w, y = torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)
    f = cukit.linear_cross_entropy
    with pytest.raises(ValueError, match=r"cukit\.linear_cross_entropy: reduction must be one of"):
        f(x, w, y, reduction="avg")
    with pytest.raises(ValueError, match=r"linear_weight must have shape \(num_classes >= 1, 3\)"):
        f(x, torch.zeros(5, 4), y)
    with pytest.raises(TypeError, match="linear_weight must have input's dtype float32; got float64"):
        f(x, w.double(), y)
    with pytest.raises(TypeError, match="target must hold class indices of dtype int64 or int32; got float32 "
                                        r"\(class probabilities"):
        f(x, w, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"target must have shape \(2,\)"):
        f(x, w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target must hold class indices in \[0, 5\) or ignore_index \(-100\); got 7"):
        f(x, w, torch.tensor([1, 7]))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        f(x, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be None or a finite float > 0"):
        f(x, w, y, softcap=0.0)
    with pytest.raises(ValueError, match="z_loss must be a finite float >= 0"):
        f(x, w, y, z_loss=-1.0)
    with pytest.raises(ValueError, match=r"linear_bias must have shape \(5,\)"):
        f(x, w, y, linear_bias=torch.zeros(4))
    with pytest.raises(ValueError, match=r"weight must have shape \(5,\) \(one weight per class\)"):
        f(x, w, y, weight=torch.ones(4))
    with pytest.raises(TypeError, match="input must have dtype float16, bfloat16, float32 or float64; got int64"):
        f(torch.zeros(2, 3, dtype=torch.long), w.long(), y)
    with pytest.raises(TypeError, match="ignore_index must be None or an int"):
        f(x, w, y, ignore_index=1.5)
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        f(x, w, y, return_lse=1)
    with pytest.raises(TypeError, match="linear_weight must be the same array type as input"):
        f(x, np.zeros((5, 3), np.float32), y)
    with pytest.raises(TypeError, match=r"cukit\.linear_cross_entropy: input must be"):
        f({}, w, y)


# ---------------------------------------------------------------------------- CPU: the module
def test_module_matches_torch_linear_cross_entropy_loss():
    torch.manual_seed(0)
    cw = torch.rand(9, dtype=torch.float64) + 0.5
    m = cukit.nn.LinearCrossEntropy(6, 9, bias=True, dtype=torch.float64, weight=cw, label_smoothing=0.1,
                                    ignore_index=4)
    ref = torch.nn.LinearCrossEntropyLoss(6, 9, bias=True, dtype=torch.float64, weight=cw, label_smoothing=0.1,
                                          ignore_index=4)
    ref.load_state_dict(m.state_dict())
    x, y = torch.randn(2, 5, 6, dtype=torch.float64), torch.randint(0, 9, (10,))
    x2 = x.reshape(10, 6)
    assert_close(m(x2, y), ref(x2, y), dtype="float64")
    m(x2, y).backward()
    ref(x2, y).backward()
    assert_close(m.linear.weight.grad, ref.linear.weight.grad, dtype="float64")
    assert "label_smoothing=0.1" in repr(m) and m.num_classes == 9 and m.in_features == 6
    head = torch.nn.Linear(6, 9, bias=False, dtype=torch.float64)
    shared = cukit.nn.LinearCrossEntropy.from_linear(head, z_loss=1e-3, return_lse=True)
    assert shared.linear is head
    loss, lse = shared(x, torch.randint(0, 9, (2, 5)))
    assert loss.shape == () and lse.shape == (2, 5)
    with pytest.raises(ValueError, match=r"cukit\.nn\.LinearCrossEntropy: reduction must be one of"):
        cukit.nn.LinearCrossEntropy(6, 9, reduction="avg")


# ---------------------------------------------------------------- CPU: Hugging Face patch rule
def tiny_llama(dtype=torch.float32, cls_name="LlamaForCausalLM", **cfg):
    # skips only the tests that build a model: the rest of the module runs without transformers
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if cls_name in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM"):  # lm_head tied to the token embedding
        prefix = cls_name.removesuffix("LMHeadModel").removesuffix("ForCausalLM")
        config = getattr(transformers, prefix + "Config")(vocab_size=61, n_embd=32, n_layer=2, n_head=4,
                                                          n_positions=32, **cfg)
        return getattr(transformers, cls_name)(config).to(dtype)
    if cls_name == "Gemma2ForCausalLM":
        config = transformers.Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=3.0, **cfg)
        return transformers.Gemma2ForCausalLM(config).to(dtype)
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, **cfg)
    return getattr(transformers, cls_name)(config).to(dtype)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "Gemma2ForCausalLM", "GPT2LMHeadModel",
                                      "GPTBigCodeForCausalLM"])
@pytest.mark.parametrize("num_items", [None, 13])
def test_patch_lm_head_loss_matches_stock(cls_name, num_items):
    stock = tiny_llama(cls_name=cls_name).eval()  # GPT-2's dropout off: both sides see the same maths
    patched = cukit.nn.patch(copy.deepcopy(stock))
    assert patched.cukit_patch_report.counts.get("lm_head_loss") == 1
    if cls_name in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM"):
        assert patched.lm_head.weight is patched.transformer.wte.weight  # still tied
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    a = stock(input_ids=ids, labels=labels, **kw)
    b = patched(input_ids=ids, labels=labels, **kw)
    assert b.logits is None and b.loss.dtype == torch.float32
    assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-5)
    a.loss.backward()
    b.loss.backward()
    ga, gb = _grads(stock), _grads(patched)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert_close(gb[n], ga[n], atol=1e-6, rtol=1e-4)
    # without labels the forward is the stock one: logits as before
    c = patched(input_ids=ids)
    assert_close(c.logits, stock(input_ids=ids).logits, atol=1e-6, rtol=1e-5)
    assert patched.state_dict().keys() == stock.state_dict().keys()


def test_patch_lm_head_loss_takes_the_models_options():
    patched = cukit.nn.patch(tiny_llama())
    ids = torch.randint(0, 61, (2, 9))
    ref = patched(input_ids=ids, labels=ids).loss
    patched.cukit_loss_options = cukit.LinearCrossEntropyOptions(grad_accumulation="recompute")
    assert_close(patched(input_ids=ids, labels=ids).loss, ref)  # the CPU reference ignores the options
    patched.cukit_loss_options = "recompute"  # handed to cukit.linear_cross_entropy, which checks them
    with pytest.raises(TypeError, match=r"options must be None, a cukit\.LinearCrossEntropyOptions"):
        patched(input_ids=ids, labels=ids)


def test_patch_lm_head_loss_call_forms():
    stock = tiny_llama(torch.float64)
    patched = cukit.nn.patch(copy.deepcopy(stock), linear=False, fuse_activations=False)
    ids = torch.randint(0, 61, (1, 7))
    ref = stock(input_ids=ids, labels=ids).loss
    out = patched(ids, None, None, None, None, ids)  # labels positional, as the signature allows
    assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)  # transformers computes its loss in float32
    tup = patched(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out.loss)
    shift = torch.roll(ids, -1, 1)
    shift[:, -1] = -100
    assert_close(patched(input_ids=ids, labels=ids, shift_labels=shift).loss, ref, atol=1e-6, rtol=1e-6)
    # a custom loss function: the stock path, logits included
    patched.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    assert patched(input_ids=ids, labels=ids).logits is not None


def test_patch_lm_head_loss_skips_what_it_cannot_reproduce():
    m = tiny_llama()
    m.lm_head.register_forward_hook(lambda *a: None)
    report = cukit.nn.patch(m, linear=False).cukit_patch_report
    assert any("hooks" in c.what for c in report.skipped if c.rule == "lm_head_loss")

    class ScaledForCausalLM(torch.nn.Module):  # post-processes its logits (like Cohere's logit_scale)
        def __init__(self):
            super().__init__()
            self.model, self.lm_head, self.logit_scale = torch.nn.Identity(), torch.nn.Linear(4, 6), 0.5

        def forward(self, x, labels=None):
            return self.lm_head(self.model(x)) * self.logit_scale

    report = cukit.nn.patch(ScaledForCausalLM(), linear=False).cukit_patch_report
    assert any("not known to be Llama- or GPT-2-style" in c.what for c in report.skipped if c.rule == "lm_head_loss")
    m2 = cukit.nn.patch(tiny_llama(), lm_head_loss=False)
    assert "lm_head_loss" not in m2.cukit_patch_report.counts


# ------------------------------------------------------------------------- CPU: the benchmark
def test_benchmark_dry_run(tmp_path):
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        bench = importlib.import_module("bench_linear_cross_entropy")
    finally:
        sys.path.remove(str(root / "benchmarks"))
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench_linear_cross_entropy.json").exists()


# ------------------------------------------------------------------------------------------ GPU
GPU_TOL = {"float32": 1e-4, "bfloat16": 1.5e-2, "float16": 3e-3, "float64": 1e-9}


def _cuda_call(x, w, y, b, cw, *, reduction, options=None, grad_loss=None, grad_lse=None, **opts):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    loss, lse = cukit.linear_cross_entropy(xr, wr, y, linear_bias=br, weight=cw, reduction=reduction,
                                           options=options, return_lse=True, **opts)
    outs, grads = [loss], [torch.ones_like(loss) if grad_loss is None else grad_loss]
    if grad_lse is not None:
        outs.append(lse)
        grads.append(grad_lse)
    torch.autograd.backward(outs, grads)
    return loss, lse, xr.grad, wr.grad, None if br is None else br.grad


def _check_gpu(got, exp, dtype, bounds=None, chunks=1, accumulate="float32"):
    """Loss and lse to float32 accuracy; each gradient within its error bound (grad_bounds) when
    given, else normwise. "input" accumulation of 16-bit dW adds one rounding per chunk;
    "recompute" a rounding of the upstream gradient's product (random here, not a power of two)."""
    loss, lse = got[0], got[1]
    lt = 1e-9 if dtype == "float64" else 2e-5
    assert_close(loss.cpu(), exp[0], atol=lt, rtol=lt)
    assert_close(lse.cpu(), exp[1], atol=lt, rtol=lt)
    if bounds is not None:
        dw_tol, tol = None, GRAD_TOL[dtype] * (2 if accumulate == "recompute" else 1)
        if accumulate == "input" and dtype in ("bfloat16", "float16"):
            dw_tol = GRAD_TOL[dtype] * max(1.0, 2 * math.sqrt(chunks))
        check_grads(got[2:], exp[2:], bounds, tol, dw_tol)
        return
    for g, e in zip(got[2:], exp[2:], strict=True):
        if e is not None:
            assert g is not None and torch.isfinite(g).all()
            assert rel_err(g, e) <= GPU_TOL[dtype], (rel_err(g, e), dtype)


@pytest.mark.gpu
@given(T=st.sampled_from([1, 5, 123, 600]), H=st.sampled_from([8, 64, 136]),
       V=st.sampled_from([1, 3, 127, 1000, 4097]), reduction=st.sampled_from(REDUCTIONS),
       dtype=st.sampled_from(["bfloat16", "float16", "float32", "float64"]), bias=st.booleans(),
       weights=st.booleans(), ls=st.sampled_from([0.0, 0.1]), zl=st.sampled_from([0.0, 1e-3]),
       cap=st.sampled_from([None, 10.0]), chunk=st.sampled_from([None, 1, 64, 100]),
       accumulate=st.sampled_from(["float32", "input", "recompute"]), lse_grad=st.booleans(),
       ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_gpu_matches_oracle(T, H, V, reduction, dtype, bias, weights, ls, zl, cap, chunk, accumulate, lse_grad,
                            ignored, seed):
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=bias, weights=weights, seed=seed, device="cuda", scale=2.0,
                          ignore_frac=ignored)
    opts = {"label_smoothing": ls, "z_loss": zl, "softcap": cap}
    gl = torch.randn(() if reduction != "none" else (T,), device="cuda", dtype=DT["float64" if dtype == "float64"
                                                                                 else "float32"])
    gz = torch.randn(T, device="cuda", dtype=gl.dtype) if lse_grad else None
    options = cukit.LinearCrossEntropyOptions(chunk_size=chunk, grad_accumulation=accumulate)
    got = _cuda_call(x, w, y, b, cw, reduction=reduction, options=options, grad_loss=gl, grad_lse=gz, **opts)
    cpu = [None if t is None else t.cpu() for t in (x, w, y, b, cw, gl, gz)]
    exp = oracle(*cpu[:5], reduction=reduction, grad_loss=cpu[5], grad_lse=cpu[6], **opts)
    bounds = grad_bounds(*cpu[:5], reduction=reduction, grad_loss=cpu[5], grad_lse=cpu[6], **opts)
    chunks = -(-T // options.chunk_rows(T, V, H, dtype))
    _check_gpu(got, exp, dtype, bounds, chunks, accumulate)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 64, 1), (7, 64, 5), (257, 128, 4097), (1000, 256, 32000)])
def test_gpu_shapes_chunks_and_all_ignored(dtype, shape):
    T, H, V = shape
    x, w, y, b, _ = make(T, H, V, dtype=DT[dtype], bias=True, device="cuda")
    for chunk in (None, 1, 96):
        opts = cukit.LinearCrossEntropyOptions(chunk_size=chunk)
        for reduction in REDUCTIONS:
            got = _cuda_call(x, w, y, b, None, reduction=reduction, options=opts)
            cpu = (x.cpu(), w.cpu(), y.cpu(), b.cpu(), None)
            _check_gpu(got, oracle(*cpu, reduction=reduction), dtype, grad_bounds(*cpu, reduction=reduction))
    ign = torch.full_like(y, -100)
    loss, _, dx, dw, db = _cuda_call(x, w, ign, b, None, reduction="mean")
    assert torch.isnan(loss) and dx.abs().sum() == 0 and dw.abs().sum() == 0 and db.abs().sum() == 0


@pytest.mark.gpu
@given(T=st.sampled_from([1, 5, 123, 600]), H=st.sampled_from([8, 64, 128]),
       V=st.sampled_from([1, 3, 127, 1000, 4097, 16387]), reduction=st.sampled_from(REDUCTIONS),
       dtype=st.sampled_from(["bfloat16", "float16"]), bias=st.booleans(), weights=st.booleans(),
       ls=st.sampled_from([0.0, 0.1]), zl=st.sampled_from([0.0, 1e-3]), cap=st.sampled_from([None, 10.0]),
       chunk=st.sampled_from([None, 1, 64, 100]), accumulate=st.sampled_from(["float32", "input", "recompute"]),
       lse_grad=st.booleans(), ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_gpu_input_logits_match_rounded_oracle(T, H, V, reduction, dtype, bias, weights, ls, zl, cap, chunk,
                                               accumulate, lse_grad, ignored, seed):
    """logits="input": the 16-bit workspace through every kernel (ce_rows in each mode, the held rows
    at 16,387 classes, the recompute mode's blocks) against the oracle that rounds the exact
    product (inputs on a grid where every float32 sum is exact, so the roundings agree)."""
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=bias, weights=weights, seed=seed, device="cuda", scale=2.0,
                          ignore_frac=ignored, grid=True)
    opts = {"label_smoothing": ls, "z_loss": zl, "softcap": cap}
    gl = torch.randn(() if reduction != "none" else (T,), device="cuda")
    gz = torch.randn(T, device="cuda") if lse_grad else None
    options = cukit.LinearCrossEntropyOptions(chunk_size=chunk, grad_accumulation=accumulate, logits="input")
    got = _cuda_call(x, w, y, b, cw, reduction=reduction, options=options, grad_loss=gl, grad_lse=gz, **opts)
    cpu = [None if t is None else t.cpu() for t in (x, w, y, b, cw, gl, gz)]
    exp = oracle(*cpu[:5], reduction=reduction, grad_loss=cpu[5], grad_lse=cpu[6], round_product=True, **opts)
    bounds = grad_bounds(*cpu[:5], reduction=reduction, grad_loss=cpu[5], grad_lse=cpu[6], **opts)
    chunks = -(-T // options.chunk_rows(T, V, H, dtype))
    _check_gpu(got, exp, dtype, bounds, chunks, accumulate)


def _worst_ratios(got, exp, bounds):
    """Per gradient: the largest |got - exp| / bound (NaN patterns must agree)."""
    out = []
    for g, e, bd in zip(got, exp, bounds, strict=True):
        if e is None:
            continue
        a = torch.as_tensor(to_numpy(g), dtype=torch.float64)
        nan = torch.isnan(e)
        assert torch.equal(torch.isnan(a), nan)
        out.append(float(((a - e).abs().masked_fill(nan, 0) / (bd + 1e-300)).max()))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("V", [16387, 40001, 100003, 200001])  # each (CL, R) of HELD_CONFIGS, a tail of 3 or 1
@pytest.mark.parametrize("dtype,logits", [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float32"),
                                          ("bfloat16", "input"), ("float16", "input")])
def test_gpu_held_rows_match_oracle(V, dtype, logits, monkeypatch):
    """The gradient-in-the-forward rows at vocabularies where ce_rows_held runs (compute capability
    9.0), with bias, class weights, label smoothing, z-loss, soft-capping, ignored rows and int32
    targets: loss and lse to float32 accuracy, gradients no further from the float64 oracle than
    ce_rows' (the same GEMMs; at float32 their sums over ~10^5 classes, not the rows, set the
    error), and a bad target's NaN confined to its row. logits="input": 16-bit rows (vectors of 8,
    a tail of up to 7), against the oracle that rounds the product (inputs on an exact grid)."""
    names: list[str] = []
    prepare = lce.KERNELS_SM90.prepare
    monkeypatch.setattr(lce.KERNELS_SM90, "prepare", lambda name, *a, **k: names.append(name) or prepare(name, *a, **k))
    for H in (16, 24):  # 24: 16-bit inputs store the logit gradients (37 <= 2 x 24), 16 writes them in place
        _held_case(V, dtype, H, monkeypatch, names, logits)


def _held_case(V, dtype, H, monkeypatch, names, logits="float32"):
    from cukit._device import device_caps

    T = 37
    assert lce.stores_logit_grads(T, H, V, dtype, "float32", "mean") == (H == 24 and dtype != "float32")
    rounded = logits == "input"
    x, w, y, b, cw = make(T, H, V, dtype=DT[dtype], bias=True, weights=True, seed=V, device="cuda", scale=3.0,
                          grid=rounded)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 20.0}
    lo = {"options": cukit.LinearCrossEntropyOptions(logits=logits)}
    cpu = (x.cpu(), w.cpu(), y.cpu(), b.cpu(), cw.cpu())
    cases = [((b, cw), cpu, "mean", opts), ((None, None), (*cpu[:3], None, None), "sum", {})]
    held = [_cuda_call(x, w, y.to(torch.int32), *bc, reduction=red, **o, **lo) for bc, _, red, o in cases]
    if device_caps(x.device.index or 0).cc == 90:
        wdt = lce.logits_dtype(dtype, logits)
        cl, r, _ = lce.held_config(V, dtype, wdt)
        assert any(n.startswith(f"ce_rows_held<{lce.DTYPES[dtype].ctype}, {lce.DTYPES[wdt].ctype},")
                   and f", {cl}, {r}>" in n for n in names), names
    lce._PLANS.clear()
    with monkeypatch.context() as m:
        m.setattr(lce, "held_config", lambda *a: None)  # ce_rows for the comparison
        rows = [_cuda_call(x, w, y.to(torch.int32), *bc, reduction=red, **o, **lo) for bc, _, red, o in cases]
    lce._PLANS.clear()
    for got, base, (_, c, red, o) in zip(held, rows, cases, strict=True):
        exp = oracle(*c, reduction=red, round_product=rounded, **o)
        bounds = grad_bounds(*c, reduction=red, **o)
        lt = 2e-5
        assert_close(got[0].cpu(), exp[0], atol=lt, rtol=lt)
        assert_close(got[1].cpu(), exp[1], atol=lt, rtol=lt)
        for h, p in zip(_worst_ratios(got[2:], exp[2:], bounds), _worst_ratios(base[2:], exp[2:], bounds),
                        strict=True):
            assert h <= max(GRAD_TOL[dtype], 1.25 * p), (h, p)
    bad = y.clone()
    bad[3] = V  # out of range: NaN in its row only
    per = cukit.linear_cross_entropy(x, w, bad, reduction="none")
    loss = cukit.linear_cross_entropy(x, w, bad)
    torch.cuda.synchronize()
    assert torch.isnan(per[3]) and torch.isfinite(per[torch.arange(T, device="cuda") != 3]).all()
    assert torch.isnan(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,logits", [("bfloat16", "float32"), ("bfloat16", "input"), ("float16", "input"),
                                          ("float32", "float32")])
def test_gpu_held_clusters_loop_over_rows_bitwise(dtype, logits, monkeypatch):
    """ce_rows_held's clusters each take several rows (two clusters for 37 rows, so the partial
    sums' two buffers alternate many times) and give bitwise the results of a cluster per row: a
    row's sums do not depend on the cluster that takes it. With and without bias and soft-cap
    (the 16-bit workspace's two forms of the row loop), ignored rows and a ragged tail."""
    from cukit._device import device_caps

    V, T = 40001, 37
    x, w, y, b, cw = make(T, 24, V, dtype=DT[dtype], bias=True, weights=True, seed=5, device="cuda", scale=3.0)
    if device_caps(x.device.index or 0).cc != 90:
        pytest.skip("ce_rows_held runs on compute capability 9.0")
    lo = {"options": cukit.LinearCrossEntropyOptions(logits=logits)}
    cases = [((b, cw), "mean", {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 20.0}),
             ((None, None), "sum", {})]
    one = [_cuda_call(x, w, y, *bc, reduction=red, **o, **lo) for bc, red, o in cases]
    lce._PLANS.clear()
    with monkeypatch.context() as m:
        m.setattr(lce, "sm_count", lambda device: 1)  # 2 clusters (and fewer blocks for ce_rows, casts)
        few = [_cuda_call(x, w, y, *bc, reduction=red, **o, **lo) for bc, red, o in cases]
    lce._PLANS.clear()
    for a, c in zip(one, few, strict=True):
        for p, q in zip(a, c, strict=True):
            if p is not None:
                assert torch.equal(torch.isnan(p), torch.isnan(q)) and torch.equal(p.nan_to_num(), q.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("logits", ["float32", "input"])
def test_gpu_bias_grad_from_both_paths_of_one_plan(logits):
    """One signature's plan serves the forward that stores the logit gradients (5 tokens <= 2 x 8
    hidden) and the recomputing backward that an lse gradient needs; their column sums read rows
    of different strides. Each call's gradients (the bias's among them) against the oracle, with
    the two paths alternating."""
    T, H, V = 5, 8, 33
    x, w, y, b, _ = make(T, H, V, dtype=torch.bfloat16, bias=True, seed=3, device="cuda", scale=2.0, grid=True)
    gz = torch.randn(T, device="cuda")
    options = cukit.LinearCrossEntropyOptions(logits=logits)
    cpu = (x.cpu(), w.cpu(), y.cpu(), b.cpu(), None)
    lce._PLANS.clear()
    for grad_lse in (None, gz, None, gz):
        got = _cuda_call(x, w, y, b, None, reduction="mean", options=options, grad_lse=grad_lse)
        g = None if grad_lse is None else grad_lse.cpu()
        exp = oracle(*cpu, reduction="mean", grad_lse=g, round_product=logits == "input")
        _check_gpu(got, exp, "bfloat16", grad_bounds(*cpu, reduction="mean", grad_lse=g))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_stored_dw_device_scale_equals_the_blocks(dtype, monkeypatch):
    """The stored logit gradient's dW (tokens <= 2 x hidden) as one GEMM whose epilogue reads the
    scale (1 / valid tokens times the upstream gradient) on the device, where the TMA kernels run:
    bitwise what float32 blocks of classes and a scaling cast give, ignored rows included."""
    from cukit._device import device_caps

    T, H, V = 96, 64, 5000
    x, w, y, _, _ = make(T, H, V, dtype=DT[dtype], seed=9, device="cuda", scale=2.0, ignore_frac=0.3)
    gl = torch.tensor(0.75, device="cuda")
    ran = []
    real = lce._matmul.gemm_device_scale
    monkeypatch.setattr(lce._matmul, "gemm_device_scale", lambda *a: ran.append(real(*a)) or ran[-1])
    lce._PLANS.clear()
    got = _cuda_call(x, w, y, None, None, reduction="mean", grad_loss=gl)
    assert ran == [device_caps(x.device.index or 0).cc == 90]
    monkeypatch.setattr(lce._matmul, "gemm_device_scale", lambda *a: False)
    lce._PLANS.clear()
    blocks = _cuda_call(x, w, y, None, None, reduction="mean", grad_loss=gl)
    lce._PLANS.clear()
    assert torch.equal(got[3], blocks[3]) and torch.equal(got[2], blocks[2])


@pytest.mark.gpu
def test_gpu_bad_target_gives_nan_not_a_fault():
    x, w, _, _, _ = make(6, 32, 10, dtype=torch.float32, device="cuda")
    y = torch.tensor([1, 2, 10, 3, -5, -100], device="cuda")
    per = cukit.linear_cross_entropy(x, w, y, reduction="none")
    torch.cuda.synchronize()
    assert torch.isnan(per[2]) and torch.isnan(per[4]) and torch.isfinite(per[[0, 1, 3, 5]]).all()
    assert torch.isnan(cukit.linear_cross_entropy(x, w, y))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gpu_gradcheck_float64(reduction):
    x, w, y, b, cw = make(9, 16, 37, bias=True, weights=True, device="cuda")
    opts = cukit.LinearCrossEntropyOptions(chunk_size=4, allow_retain_graph=True)

    def f(x, w, b):
        loss, lse = cukit.linear_cross_entropy(x, w, y, linear_bias=b, weight=cw, reduction=reduction, options=opts,
                                               label_smoothing=0.1, z_loss=1e-2, softcap=5.0, return_lse=True)
        return loss, lse

    assert torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in (x, w, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_opcheck(dtype):
    x, w, y, b, cw = make(33, 64, 100, dtype=dtype, bias=True, weights=True, device="cuda")
    for reduction in REDUCTIONS:
        args = _op_args(x.requires_grad_(), w.requires_grad_(), y, b.requires_grad_(), cw, reduction,
                        label_smoothing=0.1)
        args = (*args[:11], 16, *args[12:])
        # By default the backward scales the forward's gradient buffers in place (no second dW):
        # in float32 that rewrites outputs which opcheck's eager-vs-AOT comparison reads after the
        # backward, so that comparison runs with allow_retain_graph=True (buffers left intact),
        # and the other checks with the default.
        op = torch.ops.cukit.linear_cross_entropy.default
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        torch.library.opcheck(op, (*args[:13], True, *args[14:]))
        if dtype == torch.bfloat16:  # the 16-bit workspace (the schema's logits argument)
            torch.library.opcheck(op, (*args[:13], True, *args[14:], 0, "input"))


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph(compile_policy: str):
    def f(x, w, y):
        return cukit.linear_cross_entropy(torch.nn.functional.silu(x), w, y, z_loss=1e-4)

    x, w, y, _, _ = make(256, 128, 1000, dtype=torch.bfloat16, device="cuda")
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.compile(f, fullgraph=True)(xr, wr, y)
    out.backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = f(x2, w2, y)
    ref.backward()
    # "inductor": small default calls trace torch's form, whose logits are rounded to bf16 once
    tol = 1e-5 if compile_policy == "kernels" else 2e-3
    assert_close(out, ref, atol=tol, rtol=tol)
    assert rel_err(xr.grad, x2.grad) < 1e-2 and rel_err(wr.grad, w2.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("H", [128, 160])  # 160: 'mean' stores the logit gradients (300 <= 2 x 160)
@pytest.mark.parametrize("logits", ["float32", "input"])
def test_gpu_cuda_graph_capture_and_replay(reduction, H, logits):
    x, w, y, _, _ = make(300, H, 1000, dtype=torch.bfloat16, device="cuda", grid=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    opts = cukit.LinearCrossEntropyOptions(chunk_size=128, logits=logits)

    def step():
        xr.grad = wr.grad = None
        loss = cukit.linear_cross_entropy(xr, wr, y, reduction=reduction, options=opts)
        loss.sum().backward()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles the kernels and settles the allocator before capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    xr.grad = wr.grad = None
    with torch.cuda.graph(graph):
        loss = cukit.linear_cross_entropy(xr, wr, y, reduction=reduction, options=opts)
        loss.sum().backward()
    new_y = torch.randint(0, 1000, y.shape, device="cuda")
    with torch.no_grad():
        xr.copy_(make(300, H, 1000, dtype=torch.bfloat16, device="cuda", grid=True, seed=1)[0])
    y.copy_(new_y)
    graph.replay()
    torch.cuda.synchronize()
    exp = oracle(xr.detach().cpu(), w.cpu(), y.cpu(), reduction=reduction, round_product=logits == "input")
    assert_close(loss.cpu(), exp[0], atol=2e-5, rtol=2e-5)
    assert rel_err(xr.grad, exp[2]) < 1.5e-2 and rel_err(wr.grad, exp[3]) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", ["float32", "input", "recompute"])
def test_gpu_peak_memory_is_bounded(accumulate):
    # 4096 tokens x 1024 x 32000 bf16: the logits alone would be 250 MiB in bf16, 500 in fp32
    T, H, V = 4096, 1024, 32000
    x, w, y, _, _ = make(T, H, V, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_()
    w.requires_grad_()
    ws = 32 << 20
    opts = cukit.LinearCrossEntropyOptions(workspace_bytes=ws, grad_accumulation=accumulate)
    cukit.linear_cross_entropy(x, w, y, options=opts).backward()  # warm up (compiles, plans)
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cukit.linear_cross_entropy(x, w, y, options=opts).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    dw16, dx16 = V * H * 2, T * H * 2
    if accumulate == "float32":  # fp32 dW and dx accumulators, then their bf16 roundings
        bound = 2 * dw16 + dw16 + 2 * dx16 + dx16 + ws + (8 << 20)
    else:  # "recompute": the first pass's chunk (<= dW's size) lives before dW, the block after
        bound = dw16 + dx16 + ws + (8 << 20)
    assert peak <= bound, f"peak {peak / 2**20:.0f} MiB above inputs > bound {bound / 2**20:.0f} MiB"


@pytest.mark.gpu
def test_gpu_retain_graph_and_release():
    x, w, y, _, _ = make(64, 64, 300, dtype=torch.float32, device="cuda")
    wr = w.clone().requires_grad_()
    for keep in (False, True):  # released and recomputed, or kept
        xr = x.clone().requires_grad_()
        wr.grad = None
        loss = cukit.linear_cross_entropy(xr, wr, y, options=cukit.LinearCrossEntropyOptions(allow_retain_graph=keep))
        loss.backward(retain_graph=True)
        first_x, first_w = xr.grad.clone(), wr.grad.clone()
        loss.backward()
        assert_close(xr.grad, 2 * first_x, atol=1e-6, rtol=1e-5)
        assert_close(wr.grad, 2 * first_w, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="double backward"):
        xr2 = x.clone().requires_grad_()
        torch.autograd.grad(cukit.linear_cross_entropy(xr2, w, y), xr2, create_graph=True)


@pytest.mark.gpu
def test_gpu_float16_grad_scaler_scale_is_exact():
    # a GradScaler-sized upstream gradient multiplies the fp32 accumulators before the one rounding
    x, w, y, _, _ = make(512, 128, 5000, dtype=torch.float16, device="cuda")
    got = _cuda_call(x, w, y, None, None, reduction="mean",
                     grad_loss=torch.tensor(65536.0, device="cuda"))
    exp = oracle(x.cpu(), w.cpu(), y.cpu(), grad_loss=torch.tensor(65536.0))
    assert torch.isfinite(got[2]).all() and torch.isfinite(got[3]).all()
    assert rel_err(got[2], exp[2]) < 3e-3 and rel_err(got[3], exp[3]) < 3e-3


@pytest.mark.gpu
def test_gpu_deterministic():
    x, w, y, b, _ = make(700, 128, 3001, dtype=torch.bfloat16, bias=True, device="cuda")
    runs = [_cuda_call(x, w, y, b, None, reduction="mean") for _ in range(3)]
    for r in runs[1:]:
        for a, e in zip(r, runs[0], strict=True):
            assert torch.equal(a, e)


@pytest.mark.gpu
def test_gpu_launches_on_torchs_current_stream():
    x, w, y, _, _ = make(512, 256, 8000, dtype=torch.float32, device="cuda")
    src = x.clone()
    x.zero_()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        loss = cukit.linear_cross_entropy(x, w, y)
    torch.cuda.synchronize()
    assert_close(loss.cpu(), oracle(src.cpu(), w.cpu(), y.cpu())[0], atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
def test_gpu_cupy_arrays_forward():
    import cupy

    x, w, y, _, _ = make(50, 64, 333, dtype=torch.float32, device="cuda")
    loss, lse = cukit.linear_cross_entropy(cupy.asarray(x), cupy.asarray(w), cupy.asarray(y), reduction="none",
                                           return_lse=True)
    assert isinstance(loss, cupy.ndarray) and loss.shape == (50,)
    exp = oracle(x.cpu(), w.cpu(), y.cpu(), reduction="none")
    assert_close(loss, exp[0], atol=2e-5, rtol=2e-5)
    assert_close(lse, exp[1], atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_gpu_patch_lm_head_loss_bf16(cls_name):
    stock = tiny_llama(torch.bfloat16, cls_name=cls_name).cuda().eval()
    patched = cukit.nn.patch(copy.deepcopy(stock))
    assert patched.cukit_patch_report.counts.get("lm_head_loss") == 1
    ids = torch.randint(0, 61, (4, 31), device="cuda")
    a = stock(input_ids=ids, labels=ids)
    b = patched(input_ids=ids, labels=ids)
    assert b.logits is None
    assert abs(float(a.loss) - float(b.loss)) < 3e-2  # both round the logits; the patched blocks round their own way
    a.loss.backward()
    b.loss.backward()
    # GPT-2's lm_head is the token embedding: its gradient sums the loss's dW and the lookup's
    w_a, w_b = stock.get_output_embeddings().weight, patched.get_output_embeddings().weight
    assert w_b is patched.get_input_embeddings().weight or cls_name != "GPT2LMHeadModel"
    assert_close(w_b.grad.float(), w_a.grad.float(), atol=3e-2, rtol=5e-2)
