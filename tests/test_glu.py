"""swiglu / geglu: y = act(gate) * up. Every path against an independent float64 oracle
(torch.nn.functional on the CPU), forward and backward; the torch integration (autograd to second
order, opcheck, torch.compile under both compile policies, autocast, vmap, CUDA graphs, streams);
the module and the "gated_mlp" patch rule (local copies of Hugging Face's MLPs, and tiny
transformers Llama / Gemma when installed); bad input."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
from cukit.ops import glu as G
from cukit.testing import arrays, assert_close, backend_dtypes, shapes, to_numpy

torch = pytest.importorskip("torch")
from hf_blocks import FastGELUActivation, GELUActivation, GELUTanh, LlamaMLP  # noqa: E402  (tests/ is on sys.path)

import cukit.nn  # noqa: E402  (after the torch skip)

F = torch.nn.functional
nn = torch.nn
FLOATS = ["float16", "bfloat16", "float32", "float64"]
ACTS = list(G.GLU_ACTIVATIONS)
# the public function and its extra arguments per gate activation
PUBLIC = {"silu": (cukit.swiglu, ()), "gelu": (cukit.geglu, ("none",)), "gelu_tanh": (cukit.geglu, ("tanh",))}
BACKWARD = {"silu": (cukit.swiglu_backward, ()), "gelu": (cukit.geglu_backward, ("none",)),
            "gelu_tanh": (cukit.geglu_backward, ("tanh",))}


def run(act: str, gate, up):
    fn, extra = PUBLIC[act]
    return fn(gate, up, *extra)


def run_backward(act: str, grad, gate, up):
    fn, extra = BACKWARD[act]
    return fn(grad, gate, up, *extra)


# ------------------------------------------------------------------------------------- oracles
def _act(t, act: str):
    return {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[act](t)


def oracle(gate, up, act: str) -> np.ndarray:
    """torch.nn.functional in float64: independent of cukit's own formulas."""
    g = torch.from_numpy(np.asarray(to_numpy(gate), np.float64))
    return (_act(g, act) * torch.from_numpy(np.asarray(to_numpy(up), np.float64))).numpy()


def oracle_backward(grad, gate, up, act: str) -> tuple[np.ndarray, np.ndarray]:
    g = torch.from_numpy(np.asarray(to_numpy(gate), np.float64)).requires_grad_()
    u = torch.from_numpy(np.asarray(to_numpy(up), np.float64)).requires_grad_()
    d = torch.from_numpy(np.asarray(to_numpy(grad), np.float64))
    y = _act(g, act) * u
    if y.numel() == 0:
        return np.zeros(g.shape), np.zeros(g.shape)
    dg, du = torch.autograd.grad(y, (g, u), d)
    return dg.numpy(), du.numpy()


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(
    backend=st.sampled_from(["numpy", "torch"]),
    shape=shapes(min_dims=1, max_dims=3, max_side=40),
    dtype=st.sampled_from(FLOATS),
    act=st.sampled_from(ACTS),
    noncontiguous=st.booleans(),
    data=st.data(),
)
def test_cpu_fallbacks_match_oracle(backend, shape, dtype, act, noncontiguous, data):
    if dtype not in backend_dtypes(backend):
        return
    gate = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    up = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    grad = data.draw(arrays(backend, dtype, shape))
    y = run(act, gate, up)
    assert type(y) is type(gate) and str(y.dtype) == str(gate.dtype) and tuple(y.shape) == shape
    assert_close(y, oracle(gate, up, act), dtype=dtype)
    dg, du = run_backward(act, grad, gate, up)
    odg, odu = oracle_backward(grad, gate, up, act)
    assert_close(dg, odg, dtype=dtype)
    assert_close(du, odu, dtype=dtype)


@pytest.mark.parametrize("act", ACTS)
def test_cpu_gradcheck_and_gradgradcheck(act):
    g = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    f = lambda g, u: run(act, g, u)  # noqa: E731
    assert torch.autograd.gradcheck(f, (g, u))
    assert torch.autograd.gradgradcheck(f, (g, u))
    # third order too: the double backward is torch ops
    y = f(g, u)
    (dg,) = torch.autograd.grad(y.sum(), g, create_graph=True)
    (ddg,) = torch.autograd.grad(dg.sum(), g, create_graph=True)
    ref_g = g.detach().clone().requires_grad_()
    (rdg,) = torch.autograd.grad((_act(ref_g, act) * u.detach()).sum(), ref_g, create_graph=True)
    (rddg,) = torch.autograd.grad(rdg.sum(), ref_g)
    torch.testing.assert_close(ddg, rddg)


@pytest.mark.parametrize("act", ACTS)
def test_cpu_opcheck(act):
    g = torch.randn(4, 6, requires_grad=True)
    u = torch.randn(4, 6, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.glu.default, (g, u, act))
    torch.library.opcheck(torch.ops.cukit.glu_backward.default, (torch.randn(4, 6), g.detach(), u.detach(), act))


def _traced_cukit_ops(fn, *args) -> tuple[list[str], torch.Tensor]:
    """The torch.ops.cukit calls in the graphs dynamo hands to an aot_eager backend for fn(*args)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    found = [str(n.target) for g in counter.graphs for n in g.graph.nodes if "cukit" in str(n.target)]
    return found, out


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    def f(g, u):
        return (cukit.swiglu(g * 2, u) + cukit.geglu(g, u, "tanh")).sum()

    g = torch.randn(8, 16, requires_grad=True)
    u = torch.randn(8, 16, requires_grad=True)
    found, out = _traced_cukit_ops(f, g, u)
    assert found == (["cukit.glu.default"] * 2 if compile_policy == "kernels" else [])
    out.backward()
    g2, u2 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    ref = f(g2, u2)
    ref.backward()
    assert_close(out, ref)
    assert_close(g.grad, g2.grad)
    assert_close(u.grad, u2.grad)


def test_cpu_autocast_promotes_like_torch():
    g = torch.randn(3, 8, dtype=torch.bfloat16)
    u = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = cukit.swiglu(g, u)
        ref = F.silu(g) * u
    assert y.dtype == ref.dtype == torch.float32
    assert_close(y, oracle(g.float(), u, "silu"), dtype="float32")
    gr, ur = g.float().requires_grad_(), u.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cukit.geglu(gr.bfloat16(), ur, "tanh").sum().backward()
    assert gr.grad is not None and ur.grad is not None
    with pytest.raises(TypeError, match=r"cukit\.swiglu: up must have gate's dtype bfloat16; got float32"):
        cukit.swiglu(g, u)  # no promotion outside autocast


def test_cpu_vmap_and_per_sample_grads():
    g = torch.randn(4, 3, 5, dtype=torch.float64)
    u = torch.randn(4, 3, 5, dtype=torch.float64)
    y = torch.func.vmap(cukit.swiglu)(g, u)
    assert_close(y, oracle(g, u, "silu"))
    y = torch.func.vmap(cukit.swiglu, in_dims=(0, None))(g, u[0])
    assert_close(y, oracle(g, u[0].expand_as(g), "silu"))
    grads = torch.func.vmap(torch.func.grad(lambda g, u: cukit.geglu(g, u).sum()))(g, u)
    assert_close(grads, oracle_backward(np.ones(g.shape), g, u, "gelu")[0])


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), ()])
def test_size_zero_and_scalars(shape):
    for gate, up in [(np.zeros(shape, np.float32), np.ones(shape, np.float32)), (torch.zeros(shape), torch.ones(shape))]:
        y = cukit.swiglu(gate, up)
        assert tuple(y.shape) == shape
        dg, du = cukit.swiglu_backward(y, gate, up)
        assert tuple(dg.shape) == tuple(du.shape) == shape


def test_array_likes_convert_like_numpy():
    y = cukit.swiglu([1.0, -2.0], [3.0, 4.0])
    assert isinstance(y, np.ndarray) and y.dtype == np.float64
    assert_close(y, oracle(np.array([1.0, -2.0]), np.array([3.0, 4.0]), "silu"))
    t = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    y = cukit.geglu(t, [3.0, 4.0])  # a list beside a tensor becomes a tensor: autograd too
    assert isinstance(y, torch.Tensor) and y.grad_fn is not None


def test_module():
    m = cukit.nn.GatedActivation("gelu_tanh")
    g, u = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    assert_close(m(g, u), oracle(g, u, "gelu_tanh"))
    assert "gelu_tanh" in repr(m) and not list(m.parameters())
    with pytest.raises(ValueError, match=r"cukit\.nn\.GatedActivation: activation must be one of 'silu', 'gelu', "
                                         r"'gelu_tanh'; got 'relu'"):
        cukit.nn.GatedActivation("relu")


# ----------------------------------------------------------------------------------- errors
def test_bad_input_raises_clear_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"cukit\.swiglu: up must have gate's shape \(2, 3\) \(no broadcasting\); "
                                         r"got \(3,\)"):
        cukit.swiglu(x, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"cukit\.geglu: up must have gate's dtype float32; got float64"):
        cukit.geglu(x, np.zeros((2, 3)))
    with pytest.raises(TypeError, match=r"cukit\.swiglu: gate must have dtype float16, bfloat16, float32 or "
                                        r"float64; got int32"):
        cukit.swiglu(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match=r"cukit\.swiglu: up must be the same array type as gate \(numpy\.ndarray\); "
                                        r"got torch\.Tensor"):
        cukit.swiglu(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"cukit\.geglu: approximate must be 'none' or 'tanh'; got 'erf'"):
        cukit.geglu(x, x, "erf")
    with pytest.raises(ValueError, match=r"cukit\.swiglu_backward: grad must have gate's shape \(2, 3\); got \(3, 2\)"):
        cukit.swiglu_backward(np.zeros((3, 2), np.float32), x, x)
    with pytest.raises(TypeError, match=r"cukit\.swiglu: gate must be an array-like convertible to a numeric array; "
                                        r"got dict"):
        cukit.swiglu({}, x)
    t = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"cukit\.swiglu: up must have gate's shape"):
        cukit.swiglu(t, torch.zeros(3))
    with pytest.raises(ValueError, match=r"cukit\.geglu_backward: grad must have gate's shape"):
        cukit.geglu_backward(torch.zeros(3), t, t)


# --------------------------------------------------------------------------- patch: gated_mlp
def only(*rules: str, **switches: bool) -> dict[str, bool]:
    """patch() switches with just these rules on (others' rules come and go: tests of one rule
    should not depend on them)."""
    from cukit.nn._patch import RULES

    return {**{r: r in rules for r in RULES}, **switches}


def pair(make, dtype=torch.float64, device="cpu", **switches):
    torch.manual_seed(0)
    ref = make().to(device=device, dtype=dtype).eval()
    return ref, cukit.nn.patch(copy.deepcopy(ref), **only("linear", "gated_mlp", "fuse_activations", **switches))


def check_same(ref, ours, x, tol=1e-12):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    torch.testing.assert_close(y2, y1, rtol=tol, atol=tol)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=tol, atol=tol)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=n)


def whats(model, skipped=False) -> dict[str, str]:
    report = model.cukit_patch_report
    return {c.module: c.what for c in (report.skipped if skipped else report.done) if c.rule == "gated_mlp"}


@pytest.mark.parametrize(("act", "name"), [(nn.SiLU, "silu"), (GELUTanh, "gelu_tanh"), (GELUActivation, "gelu"),
                                           (lambda: nn.GELU(approximate="tanh"), "gelu_tanh")])
def test_gated_mlp_rule(act, name):
    ref, ours = pair(lambda: LlamaMLP(8, 12, act))
    assert isinstance(ours.act_fn, cukit.nn.GatedActivation) and ours.act_fn.activation == name
    assert isinstance(ours, LlamaMLP) and type(ours) is not LlamaMLP and type(ours).__name__ == "LlamaMLP"
    assert ours.cukit_patch_report.counts == {"linear": 3, "gated_mlp": 1}
    assert ours.gate_proj.activation is None  # fuse_activations leaves the patched block alone ...
    assert not ours.cukit_patch_report.skipped  # ... without a skip entry
    assert list(ours.state_dict()) == list(ref.state_dict())
    check_same(ref, ours, torch.randn(3, 5, 8, dtype=torch.float64))


def test_gated_mlp_rule_keeps_other_instances_and_is_idempotent():
    a, b = LlamaMLP(), LlamaMLP()
    cukit.nn.patch(a, **only("gated_mlp"))
    assert type(b) is LlamaMLP and isinstance(b.act_fn, nn.SiLU)
    before = str(a)
    cukit.nn.patch(a, **only("linear", "gated_mlp", "fuse_activations"))
    assert str(a) == before.replace("Linear(in_features=8, out_features=12, bias=False)",
                                    "Linear(in_features=8, out_features=12, bias=False, activation=None)").replace(
        "Linear(in_features=12, out_features=8, bias=False)",
        "Linear(in_features=12, out_features=8, bias=False, activation=None)")
    assert a.cukit_patch_report.counts == {"linear": 3}
    assert type(copy.deepcopy(a)) is type(a)  # deepcopy keeps the patched class
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(a)  # whole-module pickling fails loudly: save state_dicts
    assert type(a).__name__ == "LlamaMLP" and isinstance(a, LlamaMLP)


def test_gated_mlp_rule_on_by_default_and_off_leaves_fuse_activations_unchanged():
    switches = only("linear", "fuse_activations")
    del switches["gated_mlp"]  # its default: on
    model = cukit.nn.patch(LlamaMLP(), **switches)
    assert type(model.act_fn).__name__ == "GatedActivation" and model.gate_proj.activation is None
    model = cukit.nn.patch(LlamaMLP(), **only("linear", "fuse_activations"))
    assert isinstance(model.act_fn, nn.Identity) and model.gate_proj.activation == "silu"


def test_gated_mlp_rule_skips_with_reasons():
    class SwappedRoles(LlamaMLP):  # act on up_proj: not the gated form
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.swapped = SwappedRoles()
            self.relu = LlamaMLP(act=nn.ReLU)
            self.fast = LlamaMLP(act=FastGELUActivation)
            self.hooked = LlamaMLP()
            self.hooked.act_fn.register_forward_hook(lambda m, i, o: None)
            self.instance = LlamaMLP()
            self.instance.forward = self.instance.forward

        def forward(self, x):
            for m in (self.swapped, self.relu, self.fast, self.hooked, self.instance):
                x = x + m(x)
            return x

    ref, ours = pair(Model, linear=False, fuse_activations=False)
    skipped = whats(ours, skipped=True)
    assert skipped["swapped"] == ("SwappedRoles has gate_proj/up_proj/down_proj/act_fn, but its forward is not known to "
                                  "be down_proj(act_fn(gate_proj(x)) * up_proj(x))")
    assert skipped["relu"] == "LlamaMLP: act_fn: ReLU has no gated kernel (silu, gelu, gelu_tanh)"
    assert skipped["fast"].startswith("LlamaMLP: act_fn: FastGELUActivation is not exact")
    assert skipped["hooked"] == "LlamaMLP not patched: SiLU has forward hooks"
    assert skipped["instance"].startswith("LlamaMLP not patched: LlamaMLP.forward is replaced on the instance")
    assert ours.cukit_patch_report.counts == {}
    check_same(ref, ours, torch.randn(2, 8, dtype=torch.float64))


def test_gated_mlp_rule_under_torch_compile(compile_policy: str):
    ref, ours = pair(LlamaMLP, torch.float32)
    found, _ = _traced_cukit_ops(ours, torch.randn(3, 8))
    if compile_policy == "kernels":
        assert "cukit.glu.default" in found
    else:
        assert "cukit.glu.default" not in found
    torch._dynamo.reset()
    check_same(ref, torch.compile(ours, backend="aot_eager", fullgraph=True), torch.randn(3, 8), tol=2e-6)


def _tiny(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GemmaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=16, vocab_size=128)
    return transformers.GemmaForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_transformers_models_same_loss_and_grads(kind):
    ref = _tiny(kind).double()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("linear", "gated_mlp", "rope"))
    assert ours.cukit_patch_report.counts["gated_mlp"] == 2 and ours.cukit_patch_report.counts["rope"] == 2
    act = "silu" if kind == "llama" else "gelu_tanh"
    assert all(m.act_fn.activation == act for m in ours.modules() if isinstance(getattr(m, "act_fn", None),
                                                                                 cukit.nn.GatedActivation))
    ids = torch.randint(0, 128, (2, 9))
    l1, l2 = ref(ids, labels=ids).loss, ours(ids, labels=ids).loss
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-12)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=n)


# ------------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = ["cupy", "torch-cuda"]


@pytest.mark.gpu
@given(
    backend=st.sampled_from(GPU_BACKENDS),
    shape=shapes(min_dims=1, max_dims=3, max_side=300, max_elements=60_000),
    dtype=st.sampled_from(FLOATS),
    act=st.sampled_from(ACTS),
    noncontiguous=st.booleans(),
    data=st.data(),
)
def test_gpu_forward_backward_match_oracle(backend, shape, dtype, act, noncontiguous, data):
    if dtype not in backend_dtypes(backend):
        return
    gate = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    up = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    grad = data.draw(arrays(backend, dtype, shape))
    y = run(act, gate, up)
    assert type(y) is type(gate) and str(y.dtype) == str(gate.dtype)
    assert_close(y, oracle(gate, up, act), dtype=dtype)
    dg, du = run_backward(act, grad, gate, up)
    odg, odu = oracle_backward(grad, gate, up, act)
    assert_close(dg, odg, dtype=dtype)
    assert_close(du, odu, dtype=dtype)


def _cuda(n: int, dtype, offset: int = 0, scale: float = 3.0):
    """n elements starting `offset` elements into a buffer (offset 1: the scalar path)."""
    buf = torch.randn(n + offset, device="cuda").mul_(scale).to(dtype)
    return buf[offset:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", [1, 5, 8, 123, 4097, 4096 * 1024 + 3])
def test_gpu_vector_scalar_and_tail_paths(dtype, offset, n):
    g, u, d = (_cuda(n, dtype, offset) for _ in range(3))
    name = str(dtype).removeprefix("torch.")
    for act in ACTS:
        torch.empty(n, device="cuda", dtype=dtype).fill_(float("nan"))  # an unwritten element shows
        y = run(act, g, u)
        assert_close(y, oracle(g, u, act), dtype=name)
        dg, du = run_backward(act, d, g, u)
        odg, odu = oracle_backward(d, g, u, act)
        assert_close(dg, odg, dtype=name)
        assert_close(du, odu, dtype=name)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_gpu_gradcheck_float64(act):
    g = torch.randn(17, 24, dtype=torch.float64, device="cuda", requires_grad=True)
    u = torch.randn(17, 24, dtype=torch.float64, device="cuda", requires_grad=True)
    f = lambda g, u: run(act, g, u)  # noqa: E731
    assert torch.autograd.gradcheck(f, (g, u))
    assert torch.autograd.gradgradcheck(f, (g, u))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(dtype):
    g = torch.randn(33, 64, device="cuda", dtype=dtype, requires_grad=True)
    u = torch.randn(33, 64, device="cuda", dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.glu.default, (g, u, "silu"))
    d = torch.randn(33, 64, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.cukit.glu_backward.default, (d, g.detach(), u.detach(), "gelu_tanh"))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(compile_policy: str):
    def f(x, w1, w2):
        return cukit.swiglu(x @ w1, x @ w2).square().mean()

    x = torch.randn(64, 32, device="cuda")
    w1 = torch.randn(32, 48, device="cuda", requires_grad=True)
    w2 = torch.randn(32, 48, device="cuda", requires_grad=True)
    out = torch.compile(f, fullgraph=True)(x, w1, w2)
    out.backward()
    r1, r2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    ref = f(x, r1, r2)
    ref.backward()
    assert_close(out, ref, dtype="float32", rtol=1e-5)
    assert_close(w1.grad, r1.grad, dtype="float32", rtol=1e-4, atol=1e-5)
    assert_close(w2.grad, r2.grad, dtype="float32", rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    g = torch.randn(512, 256, device="cuda", requires_grad=True)
    u = torch.randn(512, 256, device="cuda", requires_grad=True)
    d = torch.randn(512, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles the kernels before the capture
            g.grad = u.grad = None
            cukit.swiglu(g, u).backward(d)
    torch.cuda.current_stream().wait_stream(s)
    g.grad = u.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cukit.swiglu(g, u)
        y.backward(d)
    with torch.no_grad():
        g.copy_(torch.randn_like(g))
        u.copy_(torch.randn_like(u))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, oracle(g, u, "silu"), dtype="float32")
    odg, odu = oracle_backward(d, g, u, "silu")
    assert_close(g.grad, odg, dtype="float32")
    assert_close(u.grad, odu, dtype="float32")


@pytest.mark.gpu
def test_gpu_launches_on_torchs_current_stream():
    n = 1 << 22
    src = torch.randn(n, device="cuda")
    g = torch.zeros(n, device="cuda")
    u = torch.randn(n, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        g.copy_(src)
        y = cukit.swiglu(g, u)
        dg, _ = cukit.swiglu_backward(src, g, u)
    torch.cuda.synchronize()
    assert_close(y, oracle(src, u, "silu"), dtype="float32")
    assert_close(dg, oracle_backward(src, src, u, "silu")[0], dtype="float32")


@pytest.mark.gpu
def test_gpu_autocast_and_mixed_devices():
    g = torch.randn(7, 9, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(7, 9, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = cukit.swiglu(g, u)
        assert y.dtype == (F.silu(g) * u).dtype == torch.float32
    with pytest.raises(ValueError, match="same device"):
        cukit.swiglu(u, torch.randn(7, 9))


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    """64-bit indexing: the last elements of a 2^31 + 9 element bfloat16 tensor (about 13 GB in all)."""
    n = 2**31 + 9
    g = torch.full((n,), 0.5, device="cuda", dtype=torch.bfloat16)
    u = torch.full((n,), 2.0, device="cuda", dtype=torch.bfloat16)
    g[-5:] = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0], dtype=torch.bfloat16)
    y = cukit.swiglu(g, u)
    tail = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0], dtype=torch.float64)
    assert_close(y[-5:], (F.silu(tail) * 2).numpy(), dtype="bfloat16")
    assert_close(y[2**31 - 3: 2**31 + 1], oracle(np.full(4, 0.5), np.full(4, 2.0), "silu"), dtype="bfloat16")
    del y
    _, du = cukit.swiglu_backward(u, g, u)
    assert_close(du[-5:], (F.silu(tail) * 2).numpy(), dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_gpu_transformers_models(kind, dtype):
    ref = _tiny(kind).to("cuda", dtype)
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("linear", "gated_mlp", "rope"))
    ids = torch.randint(0, 128, (2, 9), device="cuda")
    l1, l2 = ref(ids, labels=ids).loss, ours(ids, labels=ids).loss
    l1.backward()
    l2.backward()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(l2.float(), l1.float(), rtol=tol, atol=tol)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad.float(), p.grad.float(), rtol=tol * 10, atol=tol, msg=n)
