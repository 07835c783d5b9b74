"""The torch layer's one registration helper (``cukit/torch/_register.py``) and what every op gets
from it: autocast like torch's own ops (CPU here, CUDA on the GPU), second derivatives
(gradgradcheck in float64), vmap rules, the three call paths; and the launch-plan cache
(``cukit._runtime.PlanCache``): same signature with new pointers reuses a plan, another shape or
stride makes a new one, the cache stays bounded.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import cukit.optim  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cukit  # noqa: E402
import cukit.nn  # noqa: E402
from cukit._runtime import Densify, PlanCache  # noqa: E402
from cukit.interop import contiguous, is_contiguous  # noqa: E402
from cukit.ops import bias_act as bias_act_op  # noqa: E402
from cukit.ops import glu as glu_op  # noqa: E402
from cukit.ops import matmul as matmul_op  # noqa: E402
from cukit.ops import norm as norm_op  # noqa: E402
from cukit.ops import rope as rope_op  # noqa: E402
from cukit.torch import _register as reg  # noqa: E402


def torch_cuda() -> bool:
    return cukit.is_available() and torch.cuda.is_available()

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]
TORCH_ACT = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
cuda = pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]


# ------------------------------------------------------------------------------------ autocast
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_matmul_and_linear_run_in_the_autocast_dtype(device, dtype):
    if device == "cpu" and dtype == torch.float16 and not torch.amp.is_autocast_available("cpu"):
        pytest.skip("no CPU autocast")
    a = torch.randn(8, 16, device=device)
    b = torch.randn(16, 4, device=device)
    w = torch.randn(4, 16, device=device, requires_grad=True)
    bias = torch.randn(4, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        assert cukit.matmul(a, b).dtype == torch.matmul(a, b).dtype == dtype
        for act in ACTS:
            y = cukit.linear(a, w, bias, act)
            ref = TORCH_ACT[act](F.linear(a, w, bias))
            assert y.dtype == dtype, act
            torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2)
        # float64 is not autocast (torch leaves it alone too)
        assert cukit.matmul(a.double(), b.double()).dtype == torch.float64
        # through the dispatcher (what torch.compile and direct op users reach)
        assert torch.ops.cukit.matmul(a, b, "ieee").dtype == dtype
        assert torch.ops.cukit.linear(a, w, bias, "gelu", "ieee").dtype == dtype
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32  # grads in the params' dtype


@pytest.mark.parametrize("device", devices())
def test_dispatcher_shortcuts_keep_autocast_autograd_and_tracing(device):
    """The Autograd and Autocast kernels call the implementation directly only when nothing is
    cast, nothing records a graph and nothing sits between them and the backend: inputs already
    in the autocast dtype, a compiled graph under autocast, grad-requiring inputs under no_grad.
    Otherwise the full path runs: casts happen, graphs are recorded, jit.trace sees the op."""
    w = torch.randn(4, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = torch.ops.cukit.linear(x, w, None, None, "ieee")  # nothing to cast, but a graph to record
        assert y.requires_grad and y.grad_fn is not None
        with torch.no_grad():
            y0 = torch.ops.cukit.linear(x, w, None, None, "ieee")  # the direct shortcut
        assert not y0.requires_grad
        y32 = torch.ops.cukit.linear(x.float(), w, None, None, "ieee")  # cast: x goes to bfloat16
        assert y32.dtype == torch.bfloat16
        f = torch.compile(lambda x, w: cukit.linear(x, w), backend="aot_eager", fullgraph=True)
        yc = f(x.float(), w)
    for out in (y, y0, y32, yc):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    yc.float().sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    if device == "cpu":  # jit.trace records the op (the Tracer key is not skipped)
        with torch.no_grad():
            traced = torch.jit.trace(lambda x, w: cukit.linear(x, w), (x, w.detach()))
        assert "cukit::linear" in str(traced.graph)


@pytest.mark.parametrize("device", devices())
def test_autocast_bias_act_promotes_like_an_elementwise_op(device):
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    b = torch.randn(8, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        ref = F.gelu(x + b)
        y = cukit.bias_act(x, b, "gelu")
        assert y.dtype == ref.dtype == torch.float32
        assert torch.ops.cukit.bias_act(x, b, "gelu").dtype == torch.float32
        same = cukit.bias_act(x, b.bfloat16(), "gelu")
        assert same.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="bias must have x's dtype"):  # outside autocast: strict
        cukit.bias_act(x, b, "gelu")


@pytest.mark.parametrize("device", devices())
def test_autocast_modules_and_amp_recipe(device):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    model = cukit.nn.patch(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)))
    model.load_state_dict(ref.state_dict())
    model.to(device)
    x = torch.randn(8, 16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, y_ref = model(x), ref(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    # the README's AMP recipe: autocast + GradScaler + cukit.optim, a few steps, loss goes down
    opt = cukit.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, enabled=device == "cuda")
    target = torch.randn(8, 4, device=device)
    losses = []
    for _ in range(5):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------- second derivatives
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_gradgradcheck_bias_act(device, activation):
    torch.manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    if activation == "relu":  # keep x + b away from the kink, where finite differences break
        with torch.no_grad():
            x += torch.where(x + b > 0, 0.5, -0.5)
    fn = lambda x, b: cukit.bias_act(x, b, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, b))
    assert torch.autograd.gradgradcheck(fn, (x, b))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_gradgradcheck_linear(device, activation, bias):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, device=device, requires_grad=True)
    if activation == "relu":
        with torch.no_grad():
            z = x @ w.T + b
            x += 0.0 * z.sum()  # keep the draw; relu kinks are measure-zero for random inputs
    inputs = (x, w, b) if bias else (x, w)
    fn = lambda x, w, b=None: cukit.linear(x, w, b, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("sa", "sb"), [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((4,), (2, 4, 3)), ((2, 1, 3, 4), (3, 4, 2))])
def test_gradgradcheck_matmul(device, sa, sb):
    torch.manual_seed(3)
    a = torch.randn(sa, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: cukit.matmul(a, b), (a, b))


# ------------------------------------------------------------------------------------- vmap
@pytest.mark.parametrize("device", devices())
def test_vmap_rules(device):
    vmap = torch.func.vmap
    a = torch.randn(6, 3, 4, device=device)
    b = torch.randn(6, 4, 5, device=device)
    w = torch.randn(5, 4, device=device)
    torch.testing.assert_close(vmap(cukit.matmul)(a, b), torch.matmul(a, b))
    torch.testing.assert_close(vmap(cukit.matmul, in_dims=(0, None))(a, w.T), torch.matmul(a, w.T))
    v = torch.randn(6, 4, device=device)  # per-sample 1-D operands
    torch.testing.assert_close(vmap(cukit.matmul)(v, b), torch.einsum("bk,bkn->bn", v, b))
    torch.testing.assert_close(vmap(cukit.matmul, in_dims=(None, 0))(w, v), torch.einsum("nk,bk->bn", w, v))
    bias = torch.randn(5, device=device)
    for act in ACTS:
        got = vmap(lambda x: cukit.linear(x, w, bias, act))(a)  # noqa: B023
        torch.testing.assert_close(got, TORCH_ACT[act](F.linear(a, w, bias)), rtol=1e-5, atol=1e-5)
    ws = torch.randn(6, 5, 4, device=device)  # per-sample weights
    got = vmap(lambda x, w: cukit.linear(x, w, bias, "silu"))(a, ws)
    torch.testing.assert_close(got, F.silu(torch.einsum("bmk,bnk->bmn", a, ws) + bias), rtol=1e-5, atol=1e-5)
    c = torch.randn(6, 3, 5, device=device)
    bs = torch.randn(6, 5, device=device)
    torch.testing.assert_close(vmap(lambda t: cukit.bias_act(t, bias, "gelu"))(c), F.gelu(c + bias))
    torch.testing.assert_close(vmap(lambda t, b: cukit.bias_act(t, b, "gelu"))(c, bs), F.gelu(c + bs[:, None]))
    # per-sample gradients through the autograd formulas
    per_sample = vmap(torch.func.grad(lambda w, x: cukit.linear(x, w, None, "gelu").sum()), in_dims=(None, 0))(w, a)
    expect = torch.stack([torch.func.grad(lambda w, x: F.gelu(F.linear(x, w)).sum())(w, a[i]) for i in range(6)])
    torch.testing.assert_close(per_sample, expect, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------- call paths
def test_eager_path_choice():
    x = torch.randn(2, 2)
    p = torch.nn.Parameter(torch.randn(2, 2))
    assert reg.eager_path(x, None) == reg.DIRECT
    assert reg.eager_path(x, p) == reg.FUNCTION
    with torch.no_grad():
        assert reg.eager_path(x, p) == reg.DIRECT
    assert torch.func.vmap(lambda t: torch.tensor(reg.eager_path(t)))(x).eq(reg.FUNCTORCH).all()
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):
        assert reg.eager_path(x) == reg.DISPATCH


@pytest.mark.parametrize("device", devices())
def test_no_zero_filled_gradients_for_non_differentiable_outputs(device, monkeypatch):
    """A norm's statistics (rstd, mean) are outputs marked non-differentiable: their backward
    formula gets None for them, not a zero tensor allocated and filled on every backward."""
    import cukit.torch.norm as tn

    seen: list = []
    for op in (tn.RMS_NORM, tn.LAYER_NORM):
        fn = op.Function
        orig = fn.backward

        def spy(ctx, *grads, _orig=orig):
            seen.append(grads[1:])
            return _orig(ctx, *grads)

        monkeypatch.setattr(fn, "backward", staticmethod(spy))
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    cukit.rms_norm(x, w).sum().backward()
    cukit.layer_norm(x, None, w, b).sum().backward()
    assert seen == [(None,), (None, None)]
    # the gradients are still right
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    g = torch.randn(4, 8, device=device)
    cukit.rms_norm(xs[0], w.detach(), 1e-6).backward(g)
    F.rms_norm(xs[1], (8,), w.detach(), 1e-6).backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-5)


def test_every_op_registered_through_the_helper():
    import cukit.torch.bias_act as tb
    import cukit.torch.matmul as tm

    ops = [tb.BIAS_ACT, tb.BIAS_ACT_BACKWARD, tm.MATMUL, tm.LINEAR]
    assert {op.name for op in ops} == {"bias_act", "bias_act_backward", "matmul", "linear"}
    for op in ops:
        assert isinstance(op, reg.TorchOp)
        assert hasattr(torch.ops.cukit, op.name)
        assert op.autocast in ("lower", "promote")


def test_bad_input_errors_name_the_function_and_argument():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        cukit.linear(x, torch.randn(5, 4), None, "tanh")
    with pytest.raises(TypeError, match="linear: weight must have x's dtype float32; got float64"):
        cukit.linear(x, torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="b must be the same array type as a"):
        cukit.matmul(x, x.numpy())
    with pytest.raises(TypeError, match="bias must be the same array type as x"):
        cukit.bias_act(x, x[0].numpy())


# --------------------------------------------------------------------------------- plan cache
def test_plan_cache_is_bounded():
    c = PlanCache("test", maxsize=16)
    for i in range(100):
        c.put(i, i)
        assert len(c) <= 16
    assert c.get(99) == 99 and c.get(0) is None
    assert c.stats()["hits"] == 1 and c.stats()["misses"] == 1
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        PlanCache("bad", maxsize=0)
    assert "matmul" in PlanCache.all_stats()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_cache_reuse_and_new_signatures(dtype):
    plans = matmul_op._PLANS
    plans.clear()
    a = torch.randn(64, 32, device="cuda", dtype=dtype)
    b = torch.randn(32, 48, device="cuda", dtype=dtype)
    c1 = cukit.matmul(a, b)
    assert len(plans) == 1 and plans.misses == 1
    a2, b2 = a.clone(), b.clone() * 2  # new pointers, same signature: the plan is reused
    c2 = cukit.matmul(a2, b2)
    assert len(plans) == 1 and plans.hits == 1
    torch.testing.assert_close(c2.float(), 2 * c1.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(c1.float(), (a.double() @ b.double()).float(), rtol=2e-2, atol=2e-2)
    cukit.matmul(a[:32], b)  # another shape
    cukit.matmul(a.T.contiguous().T, b)  # another stride (column-major view)
    assert len(plans) == 3
    cukit.matmul(a.T.contiguous().T, b)
    assert len(plans) == 3
    # a misaligned pointer is another signature (the kernels pick their load path by alignment)
    big = torch.randn(64 * 32 + 1, device="cuda", dtype=dtype)
    am = big[1:].view(64, 32)
    torch.testing.assert_close(cukit.matmul(am, b).float(), (am.double() @ b.double()).float(), rtol=2e-2, atol=2e-2)
    assert len(plans) == 4
    # bounded: many signatures never grow it past maxsize
    old = plans.maxsize
    plans.maxsize = 8
    try:
        for m in range(1, 40):
            cukit.matmul(a[:m], b)
        assert len(plans) <= 8
    finally:
        plans.maxsize = old
    # linear and bias_act plans
    bias_act_op._FWD_PLANS.clear()
    x = torch.randn(16, 48, device="cuda", dtype=dtype)
    bias = torch.randn(48, device="cuda", dtype=dtype)
    y1 = cukit.bias_act(x, bias, "gelu")
    y2 = cukit.bias_act(x + 1, bias, "gelu")
    assert len(bias_act_op._FWD_PLANS) == 1 and bias_act_op._FWD_PLANS.hits == 1
    torch.testing.assert_close(y2.float(), F.gelu((x + 1).float() + bias.float()), rtol=2e-2, atol=2e-2)
    assert not torch.equal(y1, y2)


def test_densify_entry_copies_only_what_it_flags():
    import numpy as np

    a = np.arange(12.0).reshape(3, 4)
    t = torch.arange(12.0).reshape(3, 4)
    for arr, kind in ((a, "numpy"), (t, "torch")):
        view = arr.T
        assert is_contiguous(arr, kind) and not is_contiguous(view, kind) and is_contiguous(None, kind)
        assert contiguous(arr, kind) is arr and contiguous(None, kind) is None
        assert Densify.needed((arr, arr[:, :2]), kind).mask == (False, True)
        assert Densify.needed((arr, None), kind) is None
        d = Densify.needed((view, arr, None), kind)
        out = d.apply((view, arr, None))
        assert is_contiguous(out[0], kind) and out[1] is arr and out[2] is None
        assert (out[0] == view).all()
        # an explicit mask (an op's own layout rule) wins over contiguity
        assert Densify.needed((arr, view), kind, (True, False)).apply((arr, view))[1] is view


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_cache_serves_non_contiguous_signatures(dtype):
    """A signature with non-contiguous arrays (an expanded gradient, a chunk view, a transpose) is
    planned once: later calls copy and reuse the dense plan instead of missing the cache."""
    dev = "cuda"
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    caches = [bias_act_op._FWD_PLANS, bias_act_op._BWD_PLANS, glu_op._FWD_PLANS, glu_op._BWD_PLANS,
              norm_op._FWD_PLANS, norm_op._BWD_PLANS, rope_op._PLANS]

    def run(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator(device=dev).manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

        def leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
            return [t.detach().float().requires_grad_() for t in ts]

        pairs = []
        # bias_act on a column-major x; backward with the expanded gradient of .sum()
        x, b = rand(24, 64).requires_grad_(), rand(64).requires_grad_()
        cukit.bias_act(x.t().contiguous().t(), b, "gelu").sum().backward()
        xr, br = leaves(x, b)
        F.gelu(xr + br).sum().backward()
        pairs += [(x.grad, xr.grad), (b.grad, br.grad)]
        # swiglu on the halves of one fused projection (chunk views, row stride twice the width)
        gu = rand(6, 128).requires_grad_()
        cukit.swiglu(*gu.chunk(2, dim=-1)).sum().backward()
        (gr,) = leaves(gu)
        gate, up = gr.chunk(2, dim=-1)
        (F.silu(gate) * up).sum().backward()
        pairs.append((gu.grad, gr.grad))
        # rms_norm on a column-major x, backward with an expanded gradient
        x, w = rand(24, 64).requires_grad_(), rand(64).requires_grad_()
        cukit.rms_norm(x.t().contiguous().t(), w, 1e-6).sum().backward()
        xr, wr = leaves(x, w)
        F.rms_norm(xr, (64,), wr, 1e-6).sum().backward()
        pairs += [(x.grad, xr.grad), (w.grad, wr.grad)]
        # rope with a q whose head_dim stride is not 1 (the kernel reads any layout that has it)
        q, k, cos, sin = rand(2, 3, 5, 16), rand(2, 1, 5, 16), rand(2, 5, 16), rand(2, 5, 16)
        qo, _ = cukit.rotary_embedding(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, cos, sin)
        qr, c, sn = q.float(), cos.float()[:, None], sin.float()[:, None]
        pairs.append((qo, qr * c + torch.cat((-qr[..., 8:], qr[..., :8]), -1) * sn))
        return pairs

    run(0)  # first calls: every signature planned (non-contiguous ones as Densify entries)
    misses = [c.misses for c in caches]
    assert any(isinstance(v, Densify) for c in caches for v in c._data.values())
    for got, want in run(1):  # same signatures, new data and pointers: no plan is made again
        torch.testing.assert_close(got.float(), want.float(), **tol)
    assert [c.misses for c in caches] == misses


@pytest.mark.gpu
@cuda
def test_plan_cache_validates_on_first_call_only_for_its_signature():
    a = torch.randn(8, 4, device="cuda")
    b = torch.randn(4, 8, device="cuda")
    cukit.matmul(a, b)
    with pytest.raises(ValueError, match="same device"):
        cukit.matmul(a, b.cpu())
    with pytest.raises(TypeError, match="linear: weight must have x's dtype"):
        cukit.linear(a, b.T.double())
    with pytest.raises(ValueError, match="mismatch in its core dimension"):
        cukit.matmul(a, a)


# ---------------------------------------------------------------------------------------------
# The compile policy: what torch.compile traces for a cukit op
# ---------------------------------------------------------------------------------------------


def _traced_cukit_ops(fn, *args) -> tuple[list[str], torch.Tensor]:
    """The torch.ops.cukit calls in the graphs dynamo hands to an aot_eager backend for fn(*args)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    found = [str(n.target) for g in counter.graphs for n in g.graph.nodes if "cukit" in str(n.target)]
    return found, out


def _three_ops(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return cukit.linear(x, w, b, "gelu").sum() + cukit.matmul(x, w.t()).sum() + cukit.bias_act(x, b[:16], "silu").sum()


def test_compile_policy_decides_what_is_traced(compile_policy: str):
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    found, out = _traced_cukit_ops(_three_ops, x, w, b)
    if compile_policy == "kernels":
        assert found == ["cukit.linear.default", "cukit.matmul.default", "cukit.bias_act.default"]
    else:
        assert found == []  # torch's own ops: inductor fuses and launches them
    out.backward()
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = _three_ops(*ref_leaves)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip((x, w, b), ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_compile_policy_keeps_the_custom_op_where_torch_differs():
    """A float32 product at a precision torch's ops would not use (tf32 while torch's setting is
    IEEE) stays cukit's op under the inductor policy; a bad argument still gets cukit's error."""
    from cukit.torch import get_compile_policy, set_compile_policy

    assert get_compile_policy() == "inductor"
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    assert not torch.backends.cuda.matmul.allow_tf32
    found, _ = _traced_cukit_ops(lambda a, b: cukit.matmul(a, b, precision="tf32"), a, b)
    assert found == ["cukit.matmul.default"]
    found, _ = _traced_cukit_ops(lambda a, b: cukit.matmul(a, b), a, b)
    assert found == []
    with pytest.raises(Exception, match="activation must be one of"):
        _traced_cukit_ops(lambda a, b: cukit.linear(a, b.t(), None, "tanh"), a, b)
    with pytest.raises(ValueError, match=r"cukit.torch.set_compile_policy: policy must be one of 'inductor', "
                       r"'kernels'; got 'fast'"):
        set_compile_policy("fast")
