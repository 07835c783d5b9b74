"""rotary_embedding: (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), Hugging Face's
apply_rotary_pos_emb. Every path against an independent float64 oracle (transformers' formula written
out), forward and backward (the transposed rotation), over layouts (HF's transposed views, both
unsqueeze_dim layouts, padded views), grouped-query heads, broadcast tables, mixed dtypes and
partial rotary; the torch integration (autograd with and without table gradients, opcheck,
torch.compile under both policies, autocast, vmap, CUDA graphs, streams); the "rope" patch rule
(local copies of Hugging Face attention, and tiny transformers models when installed); bad input."""

from __future__ import annotations

import copy
import functools
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
from cukit.testing import assert_close, backend_dtypes, to_numpy

torch = pytest.importorskip("torch")
from hf_blocks import LlamaAttention, LlamaBlock, rotary_tables  # noqa: E402  (tests/ is on sys.path)

import cukit.nn  # noqa: E402  (after the torch skip)
import cukit.nn.rope as nn_rope  # noqa: E402

F = torch.nn.functional
nn = torch.nn
FLOATS = ["float16", "bfloat16", "float32", "float64"]


# ------------------------------------------------------------------------------------- oracle
def oracle(q, k, cos, sin, unsqueeze_dim=1, transpose=False):
    """transformers' formula (Phi-3's for partial rotary) in float64 torch; transpose: autograd's
    gradient of it, i.e. the transposed rotation applied to q and k taken as gradients."""
    q, k, cos, sin = (torch.from_numpy(np.asarray(to_numpy(t), np.float64)) for t in (q, k, cos, sin))

    def rot(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def apply(x, c, s):
        c, s = c.unsqueeze(unsqueeze_dim), s.unsqueeze(unsqueeze_dim)
        r = c.shape[-1]
        return torch.cat(((x[..., :r] * c) + (rot(x[..., :r]) * s), x[..., r:]), dim=-1)

    if not transpose:
        return apply(q, cos, sin).numpy(), apply(k, cos, sin).numpy()
    x = torch.zeros_like(q, requires_grad=True), torch.zeros_like(k, requires_grad=True)
    outs = apply(x[0], cos, sin), apply(x[1], cos, sin)
    if q.numel() + k.numel() == 0:
        return q.numpy(), k.numpy()
    g = torch.autograd.grad(outs, x, (q, k), allow_unused=True)
    return tuple((torch.zeros_like(t) if d is None else d).numpy() for d, t in zip(g, (q, k), strict=True))


def promote(a: str, b: str) -> str:
    return str(torch.promote_types(getattr(torch, a), getattr(torch, b))).removeprefix("torch.")


# ------------------------------------------------------------------------------------- inputs
@st.composite
def cases(draw, backend: str, max_tokens: int = 40):
    """(q, k, cos, sin, unsqueeze_dim) of random sizes, layouts and dtypes (q's and cos's apart)."""
    B = draw(st.integers(0, 3))
    S = draw(st.integers(1, max(1, max_tokens // max(B, 1))))
    Hq, Hk = draw(st.integers(0, 5)), draw(st.integers(1, 3))
    D = 2 * draw(st.integers(1, 20))
    Rd = D if draw(st.booleans()) else 2 * draw(st.integers(1, D // 2))
    ud = draw(st.sampled_from([1, 2]))
    tq, tc = (draw(st.sampled_from(backend_dtypes(backend if backend != "torch-cuda" else "torch", FLOATS)))
              for _ in range(2))
    layout = draw(st.sampled_from(["hf", "contiguous", "padded", "offset"]))
    cb, cs = draw(st.sampled_from([B, 1])), draw(st.sampled_from([S, S, 1]))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_case(backend, B, S, Hq, Hk, D, Rd, tq, tc, ud, layout, cb, cs, seed)


def make_case(backend, B, S, Hq, Hk, D, Rd, tq, tc, ud=1, layout="hf", cb=None, cs=None, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)

    def convert(a: np.ndarray, dtype: str):
        from cukit.testing.strategies import _to_backend  # what arrays() uses (bfloat16 CuPy arrays too)

        return _to_backend(a.astype(np.float64 if dtype == "float64" else np.float32), dtype, backend)

    def rotated(H):
        logical = (B, H, S, D) if ud == 1 else (B, S, H, D)
        if layout == "hf":  # a (B, S, H, D) buffer: for ud=1 the transposed view HF makes
            x = convert(rng.standard_normal((B, S, H, D)) * scale, tq)
            return x.transpose(0, 2, 1, 3) if ud == 1 and backend in ("numpy", "cupy") else (
                x.transpose(1, 2) if ud == 1 else x)
        if layout == "contiguous":
            return convert(rng.standard_normal(logical) * scale, tq)
        if layout == "padded":  # non-dense: head_dim padded by 3 on both sides
            x = convert(rng.standard_normal((*logical[:3], D + 6)) * scale, tq)
            return x[..., 3:3 + D]
        n = int(np.prod(logical))  # offset: starts one element into a buffer (misaligned)
        x = convert(rng.standard_normal(n + 1) * scale, tq)
        return x[1:].reshape(logical)

    q, k = rotated(Hq), rotated(Hk)
    cb = B if cb is None else cb
    cs = S if cs is None else cs
    angles = rng.uniform(-4, 4, (cb, cs, Rd))
    cos, sin = convert(np.cos(angles), tc), convert(np.sin(angles), tc)
    return q, k, cos, sin, ud


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(backend=st.sampled_from(["numpy", "torch"]), data=st.data())
def test_cpu_fallbacks_match_oracle(backend, data):
    q, k, cos, sin, ud = data.draw(cases(backend))
    tq, tc = str(q.dtype).removeprefix("torch."), str(cos.dtype).removeprefix("torch.")
    out = promote(tq, tc)
    yq, yk = cukit.rotary_embedding(q, k, cos, sin, unsqueeze_dim=ud)
    assert type(yq) is type(q) and str(yq.dtype).removeprefix("torch.") == out
    assert tuple(yq.shape) == tuple(q.shape) and tuple(yk.shape) == tuple(k.shape)
    oq, ok = oracle(q, k, cos, sin, ud)
    assert_close(yq, oq, dtype=out)
    assert_close(yk, ok, dtype=out)
    # the backward: gradients in the promoted dtype, back in q's
    gq, gk = (t.astype(yq.dtype) if backend == "numpy" else t.to(yq.dtype) for t in (q, k))
    dq, dk = cukit.rotary_embedding_backward(gq, gk, cos, sin, unsqueeze_dim=ud, dtype=tq)
    assert str(dq.dtype).removeprefix("torch.") == tq
    oq, ok = oracle(gq, gk, cos, sin, ud, transpose=True)
    assert_close(dq, oq, dtype=tq)
    assert_close(dk, ok, dtype=tq)


def test_hf_layout_is_kept_and_matches_transformers_formula():
    from hf_blocks import apply_rotary_pos_emb

    q, k, cos, sin, _ = make_case("torch", 2, 7, 4, 2, 16, 16, "float64", "float64", cb=1)
    assert not q.is_contiguous()
    yq, yk = cukit.rotary_embedding(q, k, cos, sin)
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(yq, hq, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(yk, hk, rtol=1e-14, atol=1e-14)
    assert yq.stride() == q.stride() and yk.stride() == k.stride()  # torch.empty_like's layout
    with torch.no_grad():  # the registered op's CPU implementation too (what the fake must match)
        oq, _ = torch.ops.cukit.rotary_embedding(q, k, cos, sin, 1)
    assert oq.stride() == q.stride()


def test_cpu_autograd_gradcheck_and_gradgradcheck():
    q, k, cos, sin, _ = make_case("torch", 2, 3, 3, 1, 8, 8, "float64", "float64", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()
    f = functools.partial(cukit.rotary_embedding, unsqueeze_dim=1)
    assert torch.autograd.gradcheck(f, (q, k, cos, sin))
    assert torch.autograd.gradgradcheck(f, (q, k, cos, sin))
    # tables that require grad get their gradients (torch ops), partial rotary included
    for rd in (8, 4):
        c, s = cos[..., :rd].clone().requires_grad_(), sin[..., :rd].clone().requires_grad_()
        assert torch.autograd.gradcheck(f, (q, k, c, s))
    assert torch.autograd.gradgradcheck(f, (q, k, c, s))
    g = functools.partial(cukit.rotary_embedding_backward, unsqueeze_dim=2)
    q2, k2 = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k))
    c2 = cos.clone().requires_grad_()
    assert torch.autograd.gradcheck(g, (q2, k2, c2, sin))
    assert torch.autograd.gradgradcheck(g, (q2, k2, c2, sin))


def test_backward_keeps_the_forward_dtype():
    q, k, cos, sin, _ = make_case("torch", 2, 3, 3, 1, 8, 8, "bfloat16", "float32")
    q, k = q.requires_grad_(), k.requires_grad_()
    yq, yk = cukit.rotary_embedding(q, k, cos, sin)
    assert yq.dtype == torch.float32  # q * cos promotes, as in transformers
    (yq.square().sum() + yk.sum()).backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16
    oq, ok = oracle(2 * yq.detach(), torch.ones_like(yk), cos, sin, transpose=True)
    assert_close(q.grad, oq, dtype="bfloat16")
    assert_close(k.grad, ok, dtype="bfloat16")


def test_cpu_opcheck():
    q, k, cos, sin, _ = make_case("torch", 2, 3, 3, 1, 8, 8, "float32", "float32", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()
    torch.library.opcheck(torch.ops.cukit.rotary_embedding.default, (q, k, cos, sin, 1))
    torch.library.opcheck(torch.ops.cukit.rotary_embedding.default,
                          (q, k, cos.requires_grad_(), sin.requires_grad_(), 1))
    gq, gk = q.detach().transpose(1, 2), k.detach().transpose(1, 2)
    torch.library.opcheck(torch.ops.cukit.rotary_embedding_backward.default,
                          (gq, gk, cos.detach(), sin.detach(), 2, torch.float32))
    q16, k16, c16, s16, _ = make_case("torch", 1, 4, 2, 2, 8, 4, "bfloat16", "float32")
    torch.library.opcheck(torch.ops.cukit.rotary_embedding.default, (q16.requires_grad_(), k16, c16, s16, 1))


def _traced_cukit_ops(fn, *args) -> tuple[list[str], object]:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    found = [str(n.target) for g in counter.graphs for n in g.graph.nodes if "cukit" in str(n.target)]
    return found, out


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    q, k, cos, sin, _ = make_case("torch", 2, 5, 4, 2, 8, 8, "float32", "float32", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()

    def f(q, k, cos, sin):
        a, b = cukit.rotary_embedding(q * 2, k, cos, sin)
        return (a.square().sum() + b.sum()) / 3

    found, out = _traced_cukit_ops(f, q, k, cos, sin)
    assert found == (["cukit.rotary_embedding.default"] if compile_policy == "kernels" else [])
    out.backward()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = f(q2, k2, cos, sin)
    ref.backward()
    assert_close(out, ref)
    assert_close(q.grad, q2.grad)


@pytest.mark.parametrize("D, R, tc", [(8, 8, "float64"), (8, 4, "float64"), (8, 8, "float32")])
def test_cpu_compile_form_is_transformers_expression_where_tables_match(D: int, R: int, tc: str):
    """Under the inductor policy, full-width tables of q's dtype trace as transformers'
    ``x * cos + rotate_half(x) * sin`` (the stock model's graph, fused alike); partial rotary or
    tables of another dtype trace as the reference. Both equal the float64 reference, values and
    gradients."""
    q, k, cos, sin, _ = make_case("torch", 2, 5, 4, 2, D, R, "float64", tc)
    q, k = q.requires_grad_(), k.requires_grad_()

    def f(q, k, cos, sin):
        a, b = cukit.rotary_embedding(q, k, cos, sin)
        return (a.square().sum() + (b * 3).sum()) / 3

    from torch._dynamo.testing import CompileCounterWithBackend

    from cukit.ops import rope as rope_ops
    from cukit.torch import get_compile_policy, set_compile_policy

    old = get_compile_policy()
    set_compile_policy("inductor")
    try:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        out = torch.compile(f, backend=counter, fullgraph=True)(q, k, cos, sin)
    finally:
        set_compile_policy(old)
    targets = [str(n.target) for g in counter.graphs for n in g.graph.nodes]
    transformers_form = D == R and tc == "float64"
    assert any("neg" in t for t in targets) == transformers_form, targets  # rotate_half's negation
    out.backward()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qr, kr = (torch.from_numpy(v) for v in rope_ops.reference_numpy(q2.detach().numpy(), k2.detach().numpy(),
                                                                  cos.double().numpy(), sin.double().numpy()))
    assert_close(out, (qr.square().sum() + (kr * 3).sum()) / 3)
    ref = f(q2, k2, cos.double(), sin.double())
    ref.backward()
    assert_close(q.grad, q2.grad)
    assert_close(k.grad, k2.grad)
    assert_close(k.grad, k2.grad)


def test_cpu_autocast_matches_transformers_dtypes():
    from hf_blocks import apply_rotary_pos_emb

    q, k, cos, sin, _ = make_case("torch", 2, 5, 4, 2, 8, 8, "bfloat16", "float32", cb=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yq, yk = cukit.rotary_embedding(q, k, cos, sin)
        hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    assert yq.dtype == hq.dtype == torch.float32 and yk.dtype == hk.dtype
    assert_close(yq, oracle(q, k, cos, sin)[0], dtype="float32")


def test_cpu_vmap():
    q, k, cos, sin, _ = make_case("torch", 3, 5, 4, 2, 8, 8, "float64", "float64")
    qs, ks = torch.stack([q, 2 * q]), torch.stack([k, -k])
    yq, yk = torch.func.vmap(cukit.rotary_embedding, in_dims=(0, 0, None, None))(qs, ks, cos, sin)
    for i in range(2):
        oq, ok = oracle(qs[i], ks[i], cos, sin)
        assert_close(yq[i], oq)
        assert_close(yk[i], ok)
    cs = torch.stack([cos, cos.flip(0)])
    yq, _ = torch.func.vmap(cukit.rotary_embedding, in_dims=(None, None, 0, None))(q, k, cs, sin)
    assert_close(yq[1], oracle(q, k, cos.flip(0), sin)[0])
    grads = torch.func.vmap(torch.func.grad(lambda q, k: cukit.rotary_embedding(q, k, cos, sin)[0].sum()))(qs, ks)
    assert_close(grads[0], oracle(torch.ones_like(q), torch.ones_like(k), cos, sin, transpose=True)[0])


@pytest.mark.parametrize("sizes", [(0, 3, 2, 1), (2, 0, 2, 1), (2, 3, 0, 1), (2, 3, 0, 0)])
def test_size_zero(sizes):
    B, S, Hq, Hk = sizes
    for backend in ("numpy", "torch"):
        q, k, cos, sin, _ = make_case(backend, B, S, Hq, Hk, 8, 8, "float32", "float32", cb=max(B, 1) if B else 1,
                                      cs=max(S, 1))
        if S == 0:
            cos, sin = cos[:, :0], sin[:, :0]
        yq, yk = cukit.rotary_embedding(q, k, cos, sin)
        assert tuple(yq.shape) == tuple(q.shape) and tuple(yk.shape) == tuple(k.shape)


def test_array_likes():
    q = np.ones((1, 1, 2, 4))
    yq, _ = cukit.rotary_embedding(q.tolist(), q, [[[1.0, 1.0, 1.0, 1.0]] * 2], np.zeros((1, 2, 4)))
    assert isinstance(yq, np.ndarray) and yq.dtype == np.float64
    assert_close(yq, q)


# ----------------------------------------------------------------------------------- errors
def test_bad_input_raises_clear_errors():
    q, k, cos, sin, _ = make_case("numpy", 2, 5, 4, 2, 8, 8, "float32", "float32")
    fn = cukit.rotary_embedding
    with pytest.raises(ValueError, match=r"cukit\.rotary_embedding: q must have 4 dimensions \(batch, heads, seq, "
                                         r"head_dim\) for unsqueeze_dim=1; got shape \(4, 5, 8\)"):
        fn(q[0], k, cos, sin)
    with pytest.raises(ValueError, match=r"k must have shape \(2, heads, 5, 8\) \(q's batch, seq and head_dim\); "
                                         r"got \(2, 2, 5, 6\)"):
        fn(q, k[..., :6], cos, sin)
    with pytest.raises(ValueError, match=r"cos must have shape \(2 or 1, 5 or 1, R\) with R even and 2 <= R <= "
                                         r"head_dim \(8\)"):
        fn(q, k, cos[..., :3], sin[..., :3])
    with pytest.raises(ValueError, match=r"cos must have shape"):
        fn(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match=r"sin must have cos's shape \(2, 5, 8\); got \(1, 5, 8\)"):
        fn(q, k, cos, sin[:1])
    with pytest.raises(TypeError, match=r"k must have q's dtype float32; got float64"):
        fn(q, k.astype(np.float64), cos, sin)
    with pytest.raises(TypeError, match=r"sin must have cos's dtype float32; got float16"):
        fn(q, k, cos, sin.astype(np.float16))
    with pytest.raises(TypeError, match=r"q must have dtype float16, bfloat16, float32 or float64; got int64"):
        fn(q.astype(np.int64), k.astype(np.int64), cos, sin)
    with pytest.raises(ValueError, match=r"unsqueeze_dim must be 1 \(q and k of shape \(batch, heads, seq, head_dim\)\) "
                                         r"or 2 \(\(batch, seq, heads, head_dim\)\); got 0"):
        fn(q, k, cos, sin, unsqueeze_dim=0)
    with pytest.raises(TypeError, match=r"unsqueeze_dim must be an int \(1 or 2\); got bool"):
        fn(q, k, cos, sin, unsqueeze_dim=True)
    with pytest.raises(TypeError, match=r"cos must be the same array type as q \(numpy\.ndarray\); got torch\.Tensor"):
        fn(q, k, torch.from_numpy(cos), sin)
    with pytest.raises(TypeError, match=r"cukit\.rotary_embedding_backward: dtype must be a dtype whose promotion "
                                        r"with cos's dtype float32 is grad_q's dtype float16"):
        cukit.rotary_embedding_backward(q.astype(np.float16), k.astype(np.float16), cos, sin, dtype="float16")
    with pytest.raises(TypeError, match=r"cukit\.rotary_embedding_backward: dtype must be one of float16, bfloat16, "
                                        r"float32 or float64; got 'int8'"):
        cukit.rotary_embedding_backward(q, k, cos, sin, dtype="int8")
    t = [torch.from_numpy(a) for a in (q, k, cos, sin)]
    with pytest.raises(ValueError, match=r"cukit\.rotary_embedding: k must have shape"):
        cukit.rotary_embedding(t[0], t[1][:1], t[2], t[3])
    with pytest.raises(TypeError, match=r"cukit\.rotary_embedding: k must have q's dtype"):
        cukit.rotary_embedding(t[0], t[1].double(), t[2], t[3])


# -------------------------------------------------------------------------------- patch: rope
def only(*rules: str) -> dict[str, bool]:
    from cukit.nn._patch import RULES

    return {r: r in rules for r in RULES}


@pytest.fixture
def calls(monkeypatch):
    """How many times the patched forwards call cukit.rotary_embedding."""
    seen = []
    real = nn_rope.rotary_embedding

    def counting(*args, **kwargs):
        seen.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(nn_rope, "rotary_embedding", counting)
    return seen


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


def test_rope_rule_on_llama_attention(calls):
    torch.manual_seed(0)
    ref = LlamaBlock().double()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("rope"))
    assert ours.cukit_patch_report.counts == {"rope": 1}
    (change,) = ours.cukit_patch_report.done
    assert change.module == "self_attn" and change.what == "LlamaAttention.forward: hf_blocks.apply_rotary_pos_emb -> " \
                                                           "cukit.rotary_embedding"
    assert isinstance(ours.self_attn, LlamaAttention) and type(ours.self_attn) is not LlamaAttention
    assert type(ref.self_attn) is LlamaAttention  # other instances, the class and the module: untouched
    import hf_blocks

    assert hf_blocks.apply_rotary_pos_emb.__module__ == "hf_blocks" and hf_blocks.LlamaAttention.forward is \
        LlamaAttention.forward
    check_same(ref, ours, torch.randn(2, 6, 32, dtype=torch.float64))
    assert calls == [(2, 4, 6, 8)]
    again = cukit.nn.patch(ours, **only("rope"))  # idempotent
    assert again.cukit_patch_report.counts == {}
    assert type(copy.deepcopy(ours).self_attn) is type(ours.self_attn)


def test_rope_rule_with_the_gated_mlp_and_linear_under_compile(compile_policy: str):
    torch.manual_seed(0)
    ref = LlamaBlock()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("linear", "gated_mlp", "fuse_activations", "rope"))
    assert ours.cukit_patch_report.counts == {"linear": 7, "gated_mlp": 1, "rope": 1}
    found, _ = _traced_cukit_ops(ours, torch.randn(2, 6, 32))
    if compile_policy == "kernels":
        assert "cukit.rotary_embedding.default" in found and "cukit.glu.default" in found
    else:
        assert not [f for f in found if "rotary" in f or "glu" in f]
    torch._dynamo.reset()
    check_same(ref, torch.compile(ours, backend="aot_eager", fullgraph=True), torch.randn(2, 6, 32), tol=2e-5)


# A module of its own (its globals are what the rule reads): attention forwards calling other
# apply_rotary_pos_emb functions.
_OTHER = '''
import functools
import torch

def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

{rope}

def traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.k_proj = torch.nn.Linear(16, 8, bias=False)

    {decorator}
    def forward(self, x, cos, sin):
        q = self.q_proj(x).view(*x.shape[:-1], -1, 8).transpose(1, 2)
        k = self.k_proj(x).view(*x.shape[:-1], -1, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q.sum(1), k.sum(1)
'''
_INTERLEAVED = '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J's rotate-every-two
    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin
'''
_PHI3 = '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # Phi-3's partial rotary
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed
'''
_LLAMA = '''
def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # transformers < 4.38's signature
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
'''


def _module(name: str, rope: str, decorator: str = "") -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(_OTHER.format(rope=rope, decorator=decorator), mod.__dict__)  # the test's own source
    return mod


def _tables(rd: int = 8):
    positions = torch.arange(3).expand(2, -1)
    cos, sin = rotary_tables(positions, rd)
    return cos.float(), sin.float()


def test_rope_rule_skips_other_conventions_with_the_reason(calls):
    mod = _module("gptj_like", _INTERLEAVED)
    m = mod.Attention()
    cukit.nn.patch(m, **only("rope"))
    (skip,) = m.cukit_patch_report.skipped
    assert skip.what == ("Attention: apply_rotary_pos_emb is not the rotate_half form: on a probe it computes other "
                         "values than q * cos + rotate_half(q) * sin")
    assert type(m) is mod.Attention
    m(torch.randn(2, 3, 16), *_tables())
    assert calls == []


def test_rope_rule_partial_rotary_and_fallback(calls):
    x = torch.randn(2, 3, 16)
    phi3 = _module("phi3_like", _PHI3)
    ref = phi3.Attention()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("rope"))
    assert ours.cukit_patch_report.counts == {"rope": 1}
    for rd in (8, 4):  # full and partial rotary: cukit's kernel computes both as Phi-3 does
        torch.testing.assert_close(ours(x, *_tables(rd)), ref(x, *_tables(rd)))
    assert len(calls) == 2
    # a function without partial rotary: partial tables go to the original (which refuses them)
    llama = _module("llama_like", _LLAMA)
    m = cukit.nn.patch(llama.Attention(), **only("rope"))
    assert m.cukit_patch_report.counts == {"rope": 1}
    m(x, *_tables(8))
    assert len(calls) == 3
    with pytest.raises(RuntimeError, match="size of tensor"):
        m(x, *_tables(4))
    assert len(calls) == 3


def test_rope_rule_rebuilds_decorated_forwards(calls):
    mod = _module("decorated", _PHI3, decorator="@traced")
    ref = mod.Attention()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("rope"))
    assert ours.cukit_patch_report.counts == {"rope": 1}
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ours(x, *_tables()), ref(x, *_tables()))
    assert len(calls) == 1
    assert type(ours).forward.__wrapped__ is not mod.Attention.forward.__wrapped__


def test_rope_rule_skips_instance_forwards():
    torch.manual_seed(0)
    block = LlamaBlock()
    block.self_attn.forward = block.self_attn.forward
    cukit.nn.patch(block, **only("rope"))
    (skip,) = block.cukit_patch_report.skipped
    assert skip.what.startswith("LlamaAttention not patched: LlamaAttention.forward is replaced on the instance")


def test_transformers_llama_rope_only_and_under_autocast(calls):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ours = cukit.nn.patch(copy.deepcopy(ref), **only("rope"))
    assert ours.cukit_patch_report.counts == {"rope": 2}
    ids = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=2e-6, atol=2e-6)
    assert len(calls) == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bfloat16 q and k, float32 tables: float32 out
        y1, y2 = ref(ids).logits, ours(ids).logits
    assert y1.dtype == y2.dtype
    torch.testing.assert_close(y2.float(), y1.float(), rtol=3e-2, atol=3e-2)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@given(backend=st.sampled_from(["torch-cuda", "cupy"]), data=st.data())
def test_gpu_matches_oracle(backend, data):
    q, k, cos, sin, ud = data.draw(cases(backend, max_tokens=300))
    tq, tc = (str(t.dtype).removeprefix("torch.") for t in (q, cos))
    out = promote(tq, tc)
    yq, yk = cukit.rotary_embedding(q, k, cos, sin, unsqueeze_dim=ud)
    assert type(yq) is type(q) and str(yq.dtype).removeprefix("torch.") == out
    oq, ok = oracle(q, k, cos, sin, ud)
    assert_close(yq, oq, dtype=out)
    assert_close(yk, ok, dtype=out)
    if backend == "torch-cuda" and 0 not in q.stride() and torch.empty_like(q).stride() == q.stride():  # kept
        # (a size-1 dimension's stride is arbitrary: compare the others)
        assert [s for s, n in zip(yq.stride(), q.shape, strict=True) if n > 1] == [
            s for s, n in zip(q.stride(), q.shape, strict=True) if n > 1
        ]
    gq, gk = yq, yk  # gradients in the promoted dtype
    dq, dk = cukit.rotary_embedding_backward(gq, gk, cos, sin, unsqueeze_dim=ud, dtype=tq)
    oq, ok = oracle(gq, gk, cos, sin, ud, transpose=True)
    assert_close(dq, oq, dtype=tq)
    assert_close(dk, ok, dtype=tq)


@pytest.mark.gpu
@pytest.mark.parametrize("tq", FLOATS)
@pytest.mark.parametrize("tc", FLOATS)
@pytest.mark.parametrize("layout", ["hf", "contiguous", "padded", "offset"])
@pytest.mark.parametrize(("D", "Rd", "ud"), [(128, 128, 1), (64, 64, 2), (80, 32, 1), (10, 6, 1)])
def test_gpu_layouts_dtypes_and_paths(tq, tc, layout, D, Rd, ud):
    q, k, cos, sin, _ = make_case("torch-cuda", 2, 33, 8, 2, D, Rd, tq, tc, ud, layout, cb=1)
    out = promote(tq, tc)
    torch.empty(2 * 33 * 8 * D, device="cuda", dtype=getattr(torch, out)).fill_(float("nan"))  # unwritten shows
    yq, yk = cukit.rotary_embedding(q, k, cos, sin, unsqueeze_dim=ud)
    oq, ok = oracle(q, k, cos, sin, ud)
    assert_close(yq, oq, dtype=out)
    assert_close(yk, ok, dtype=out)
    if layout in ("hf", "contiguous"):
        assert yq.stride() == q.stride() and yk.stride() == k.stride()
    dq, dk = cukit.rotary_embedding_backward(yq, yk, cos, sin, unsqueeze_dim=ud, dtype=getattr(torch, tq))
    oq, ok = oracle(yq, yk, cos, sin, ud, transpose=True)
    assert_close(dq, oq, dtype=tq)
    assert_close(dk, ok, dtype=tq)


@pytest.mark.gpu
def test_gpu_autograd_gradcheck_and_opcheck():
    q, k, cos, sin, _ = make_case("torch-cuda", 2, 5, 3, 1, 16, 16, "float64", "float64", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()
    f = functools.partial(cukit.rotary_embedding, unsqueeze_dim=1)
    assert torch.autograd.gradcheck(f, (q, k, cos, sin))
    assert torch.autograd.gradgradcheck(f, (q, k, cos, sin))
    c, s = cos[..., :8].clone().requires_grad_(), sin[..., :8].clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (q, k, c, s))
    for tq, tc in (("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")):
        q, k, cos, sin, _ = make_case("torch-cuda", 2, 9, 4, 2, 64, 64, tq, tc, cb=1)
        torch.library.opcheck(torch.ops.cukit.rotary_embedding.default, (q.requires_grad_(), k, cos, sin, 1))
        torch.library.opcheck(torch.ops.cukit.rotary_embedding_backward.default,
                              (q.detach().to(getattr(torch, promote(tq, tc))), k.to(getattr(torch, promote(tq, tc))),
                               cos, sin, 1, getattr(torch, tq)))


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(compile_policy: str):
    q, k, cos, sin, _ = make_case("torch-cuda", 2, 17, 8, 2, 64, 64, "float32", "float32", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()

    def f(q, k, cos, sin):
        a, b = cukit.rotary_embedding(q * 2, k, cos, sin)
        return a.square().mean() + b.mean()

    out = torch.compile(f, fullgraph=True)(q, k, cos, sin)
    out.backward()
    q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = f(q2, k2, cos, sin)
    ref.backward()
    assert_close(out, ref, dtype="float32", rtol=1e-5)
    assert_close(q.grad, q2.grad, dtype="float32", rtol=1e-5)
    assert_close(k.grad, k2.grad, dtype="float32", rtol=1e-5)


@pytest.mark.gpu
def test_gpu_cuda_graph_and_current_stream():
    q, k, cos, sin, _ = make_case("torch-cuda", 2, 64, 8, 2, 128, 128, "bfloat16", "bfloat16", cb=1)
    q, k = q.requires_grad_(), k.requires_grad_()
    gq = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            q.grad = k.grad = None
            yq, yk = cukit.rotary_embedding(q, k, cos, sin)
            torch.autograd.backward((yq, yk), (gq, torch.ones_like(yk)))
    torch.cuda.current_stream().wait_stream(s)
    q.grad = k.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yq, yk = cukit.rotary_embedding(q, k, cos, sin)
        torch.autograd.backward((yq, yk), (gq, torch.ones_like(yk)))
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(yq, oracle(q, k, cos, sin)[0], dtype="bfloat16")
    assert_close(q.grad, oracle(gq, torch.ones_like(yk), cos, sin, transpose=True)[0], dtype="bfloat16")
    # launched on torch's current stream: a side stream's pending copy is seen
    src = torch.randn_like(q.detach())
    x = torch.zeros_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        yq, _ = cukit.rotary_embedding(x, k.detach(), cos, sin)
    torch.cuda.synchronize()
    assert_close(yq, oracle(src, k, cos, sin)[0], dtype="bfloat16")


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    """64-bit indexing: q of 2^31 bfloat16 elements (4 GiB) in Hugging Face's layout; the last token checked."""
    B, S, Hq, Hk, D = 1, 2**17, 128, 8, 128
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (t.to("cuda", torch.bfloat16) for t in rotary_tables(torch.arange(S).view(1, S), D))
    yq, yk = cukit.rotary_embedding(q, k, cos, sin)
    assert_close(yq[:, :, -2:], oracle(q[:, :, -2:], k[:, :, -2:], cos[:, -2:], sin[:, -2:])[0], dtype="bfloat16")
    assert_close(yk[:, :, -2:], oracle(q[:, :, -2:], k[:, :, -2:], cos[:, -2:], sin[:, -2:])[1], dtype="bfloat16")
