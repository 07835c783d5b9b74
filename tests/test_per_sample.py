"""cukit.per_sample_grads / per_sample_grad_norms and the array-level ops of cukit.ops.per_sample.

CPU (CI): every layer kind in float64 against ``torch.func.vmap(torch.func.grad(...))`` of the
per-sample loss (exact up to rounding), 2-D and 3-D (B, T, d) inputs, an MLP, a CNN, a tiny
transformer block, tied weights, a module called twice, an in-place activation after a Linear,
the torch.func fallback, the BatchNorm error; ghost norms against the norms of explicit per-sample
grads, both Linear routes (Gram and materialised); the ops' references on odd shapes.
GPU (marker gpu; the lead runs them on an H100): the kernels against the references in float32 and
bfloat16, the whole feature on CUDA, no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

import cukit  # noqa: E402
import cukit.nn as cnn  # noqa: E402
from cukit.ops import per_sample as ops  # noqa: E402

F64 = torch.float64


def vmap_grads(model: nn.Module, loss_fn: Any, x: Any, y: Any) -> dict[str, torch.Tensor]:
    """The oracle: torch.func per-sample grads of loss_fn on one-sample batches."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss_i(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, x, y)


def sum_sq(out: Any, y: Any) -> torch.Tensor:
    return (out.float() if out.dtype != F64 else out).sub(y).square().sum()


def ce_sum(out: Any, y: Any) -> torch.Tensor:
    out = out if out.dtype == F64 else out.float()  # the loss in float32 for 16-bit models
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


def check(model: nn.Module, x: Any, y: Any, loss_fn: Any = sum_sq, rtol: float = 1e-9, atol: float = 1e-10) -> None:
    got = cukit.per_sample_grads(model, loss_fn, x, y)
    norms = cukit.per_sample_grad_norms(model, loss_fn, x, y)
    # the oracle last: torch.func.functional_call on a module used twice leaves it detached
    ref = vmap_grads(model, loss_fn, x, y)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        torch.testing.assert_close(got[k], ref[k], rtol=rtol, atol=atol, msg=k)
    want = torch.sqrt(sum(v.reshape(v.shape[0], -1).square().sum(1) for v in ref.values()))
    torch.testing.assert_close(norms, want, rtol=rtol * 10, atol=atol)
    for p in model.parameters():
        assert p.grad is None  # untouched


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------
# Each layer kind, float64, against torch.func
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7), (5, 3, 7), (4, 2, 3, 7), (1, 7)])
def test_linear(bias: bool, shape: tuple) -> None:
    m = nn.Linear(7, 4, bias=bias, dtype=F64)
    x = torch.randn(*shape, dtype=F64)
    check(m, x, torch.randn(*shape[:-1], 4, dtype=F64))


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", None])
def test_cukit_linear_fused_activation(activation: str | None) -> None:
    m = cnn.Linear(6, 5, activation=activation, dtype=F64)
    x = torch.randn(4, 3, 6, dtype=F64)
    check(m, x, torch.randn(4, 3, 5, dtype=F64))


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_cukit_linear_fused_activation_chunked_pre_activation(activation: str, monkeypatch: Any) -> None:
    """A G larger than the chunk is overwritten with G * act'(z) a few rows at a time (rows not a
    multiple of the chunk); a G that is part of a larger buffer or an expanded tensor is left alone."""
    import cukit.per_sample as ps

    monkeypatch.setattr(ps, "_PREACT_CHUNK_BYTES", 5 * 5 * 8)  # 5 rows of 5 float64
    m = nn.Sequential(cnn.Linear(6, 5, activation=activation, dtype=F64), nn.Linear(5, 3, dtype=F64))
    x = torch.randn(4, 3, 6, dtype=F64)
    check(m, x, torch.randn(4, 3, 3, dtype=F64))
    lin = m[0]
    xs, g = torch.randn(12, 6, dtype=F64), torch.randn(12, 5, dtype=F64)
    z = xs @ lin.weight.detach().t() + lin.bias.detach()
    want = torch.func.vjp(lambda t: getattr(nn.functional, activation)(t), z)[1](g)[0]
    torch.testing.assert_close(ps._pre_activation_grad(lin, xs, g.clone(), lin.weight.detach().t()), want)
    ones = torch.ones(1, 1, dtype=F64).expand(12, 5)  # the grad of a .sum(): not written
    out = ps._pre_activation_grad(lin, xs, ones, lin.weight.detach().t())
    torch.testing.assert_close(out, torch.func.vjp(lambda t: getattr(nn.functional, activation)(t), z)[1](
        torch.ones(12, 5, dtype=F64))[0])
    assert torch.equal(ones, torch.ones(12, 5, dtype=F64))
    big = torch.randn(13, 5, dtype=F64)
    part, before = big[:12], big[:12].clone()  # contiguous, but not the whole buffer
    torch.testing.assert_close(ps._pre_activation_grad(lin, xs, part, lin.weight.detach().t()),
                               torch.func.vjp(lambda t: getattr(nn.functional, activation)(t), z)[1](before)[0])
    assert torch.equal(part, before)  # untouched


def test_conv1d_transposed_gpt2_style() -> None:
    m = cnn.Conv1D(5, 6, dtype=F64)  # nf=5 outputs, nx=6 inputs: y = x W + b, W (6, 5)
    check(m, torch.randn(3, 4, 6, dtype=F64), torch.randn(3, 4, 5, dtype=F64))


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3),
        dict(kernel_size=3, padding=1, stride=2),
        dict(kernel_size=(2, 3), padding=(1, 0), dilation=(2, 1), bias=False),
        dict(kernel_size=3, groups=2, padding="same"),
        dict(kernel_size=3, padding=1, padding_mode="reflect"),
        dict(kernel_size=4, padding="same", padding_mode="circular"),
    ],
)
def test_conv2d(kw: dict) -> None:
    m = nn.Conv2d(4, 6, dtype=F64, **kw)
    x = torch.randn(3, 4, 9, 8, dtype=F64)
    out = m(x)
    check(m, x, torch.randn_like(out))


def test_cukit_conv2d_with_activation() -> None:
    m = cnn.Conv2d(3, 4, 3, padding=1, activation="gelu", dtype=F64)
    x = torch.randn(2, 3, 6, 6, dtype=F64)
    check(m, x, torch.randn(2, 4, 6, 6, dtype=F64))


@pytest.mark.parametrize("kw", [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=2, groups=2)])
def test_conv1d(kw: dict) -> None:
    m = nn.Conv1d(4, 6, dtype=F64, **kw)
    x = torch.randn(3, 4, 11, dtype=F64)
    check(m, x, torch.randn_like(m(x)))


def test_cukit_conv2d_with_activation_same_padding_and_groups() -> None:
    m = cnn.Conv2d(4, 6, 4, padding="same", groups=2, activation="silu", dtype=F64)
    x = torch.randn(3, 4, 7, 6, dtype=F64)
    check(m, x, torch.randn_like(m(x)))


def test_conv_frozen_weight_bias_only() -> None:
    m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, dtype=F64), nn.Flatten(), nn.Linear(3 * 25, 2, dtype=F64))
    m[0].weight.requires_grad_(False)
    check(m, torch.randn(4, 2, 5, 5, dtype=F64), torch.randn(4, 2, dtype=F64))


def test_conv_dp_step_matches_explicit_clipping() -> None:
    """The clipped sum of a conv model (grouped route on the CPU) against clipping torch.func's grads."""
    from cukit import dp

    m = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2, dtype=F64), nn.ReLU(),
                      nn.Conv2d(4, 3, 2, dilation=2, dtype=F64),
                      nn.Flatten(), nn.Linear(12, 2, dtype=F64))
    x, y = torch.randn(5, 2, 7, 7, dtype=F64), torch.randn(5, 2, dtype=F64)
    ref = vmap_grads(m, sum_sq, x, y)
    norms = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in ref.values()))
    f = torch.clamp(0.5 / (norms + 1e-6), max=1.0)
    dp.clip_and_accumulate(m, sum_sq, x, y, max_grad_norm=0.5)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("i,i...->...", f, ref[k]), msg=k)


CONV_SHAPES = [  # (ConvShape, B): groups, strides, dilations, asymmetric "same" pads, Conv1d, PQ = 1, wide K
    (ops.ConvShape(3, 7, 6, 5, 7, 6, 3, 3, (1, 1), (1, 1), (1, 1), 1), 3),
    (ops.ConvShape(4, 9, 8, 6, 9, 8, 4, 2, (1, 1), (3, 0), (2, 1), 2), 2),
    (ops.ConvShape(3, 11, 7, 5, 6, 3, 3, 2, (2, 3), (2, 1), (1, 2), 1), 3),
    (ops.ConvShape(2, 1, 13, 4, 1, 8, 1, 3, (1, 2), (0, 2), (1, 1), 2), 2),
    (ops.ConvShape(8, 5, 5, 70, 3, 3, 3, 3, (1, 1), (0, 0), (1, 1), 1), 2),
    (ops.ConvShape(1, 3, 3, 17, 1, 1, 3, 3, (1, 1), (0, 0), (1, 1), 1), 4),
    (ops.ConvShape(6, 6, 6, 6, 2, 2, 3, 3, (3, 3), (1, 1), (1, 1), 6), 3),
]


def conv_oracle(x: torch.Tensor, g: torch.Tensor, s: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample conv grads by autograd, one sample at a time (float64)."""
    import torch.nn.functional as F

    w = torch.zeros(s.K, s.C // s.groups, s.R, s.S, dtype=F64, requires_grad=True)
    b = torch.zeros(s.K, dtype=F64, requires_grad=True)
    xp = F.pad(x.double(), (s.padding[1], s.Q * s.stride[1] + s.dilation[1] * s.S, s.padding[0],
                            s.P * s.stride[0] + s.dilation[0] * s.R))  # generous bottom/right zeros, cropped below
    dws, dbs = [], []
    for i in range(x.shape[0]):
        y = F.conv2d(xp[i:i + 1], w, b, s.stride, 0, s.dilation, s.groups)[:, :, :s.P, :s.Q]
        dw, db = torch.autograd.grad((y * g[i:i + 1].double()).sum(), (w, b))
        dws.append(dw)
        dbs.append(db)
    return torch.stack(dws), torch.stack(dbs)


@pytest.mark.parametrize("case", range(len(CONV_SHAPES)))
def test_conv_ops_routes(case: int) -> None:
    s, B = CONV_SHAPES[case]
    x, g = torch.randn(B, s.C, s.H, s.W, dtype=F64), torch.randn(B, s.K, s.P, s.Q, dtype=F64)
    rw, rb = conv_oracle(x, g, s)
    f = torch.rand(B, dtype=F64)
    for route in (None, "grouped", "unfold"):
        dw, db = ops.conv_grads(x, g, s, route=route)
        torch.testing.assert_close(dw, rw)
        torch.testing.assert_close(db, rb)
        sw, sb = ops.conv_sq_norms(x, g, s, route=route)
        torch.testing.assert_close(sw, rw.flatten(1).square().sum(1))
        torch.testing.assert_close(sb, rb.square().sum(1))
        ow, ob = torch.ones_like(rw[0]), torch.ones_like(rb[0])
        ops.conv_clipped(x, g, s, f, ow, ob, route=route)
        torch.testing.assert_close(ow, 1 + torch.einsum("i,i...->...", f, rw))
        torch.testing.assert_close(ob, 1 + f @ rb)
    dw, db = ops.conv_grads(x, g, s, bias=False)
    assert db is None and ops.conv_sq_norms(x, g, s, bias=False)[1] is None
    torch.testing.assert_close(ops.reference_conv_grads(x, g, s)[0], rw)
    torch.testing.assert_close(ops.reference_conv_sq_norms(x, g, s)[0], rw.flatten(1).square().sum(1))


def test_conv_route_rule() -> None:
    def shape(C: int, K: int, hw: int, k: int = 3, groups: int = 1) -> Any:
        return ops.ConvShape(C, hw, hw, K, hw, hw, k, k, (1, 1), (k // 2, k // 2), (1, 1), groups)

    ops_ = ("grads", "norms", "clipped")
    small, late, depthwise = shape(16, 32, 14), shape(512, 512, 7), shape(64, 64, 16, groups=64)
    assert [ops.conv_route(op, small, 256, True) for op in ops_] == ["kernel"] * 3
    assert ops.conv_route("norms", late, 256, True) == "unfold"  # 8 L^2 (M + N) < M N L, B M N L >= 2^31
    assert ops.conv_route("norms", late, 4, True) == "kernel"  # too little work for the extra launches
    assert ops.conv_route("norms", shape(256, 256, 4), 128, True) == "kernel"
    assert [ops.conv_route(op, depthwise, 256, True) for op in ops_] == ["grouped"] * 3  # tiles 1/112 full
    assert ops.conv_route("grads", depthwise, 8, True) == "kernel"
    assert ops.conv_route("grads", shape(8, 8, 5, groups=4), 256, True) == "kernel"  # 1/28 full, little work
    assert [ops.conv_route(op, small, 256, False) for op in ops_] == ["grouped"] * 3
    assert ops.conv_route("norms", shape(64, 64, 4), 8, False) == "unfold"  # L^2 < M N
    with pytest.raises(ValueError, match="op must be one of"):
        ops.conv_route("sums", small, 8, True)


def test_conv_ops_bad_inputs() -> None:
    s = ops.ConvShape(4, 5, 5, 6, 5, 5, 3, 3, (1, 1), (1, 1), (1, 1), 2)
    x, g = torch.randn(2, 4, 5, 5, dtype=F64), torch.randn(2, 6, 5, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"g \(B, 6, 5, 5\)"):
        ops.conv_grads(x, g[:, :, :4], s)
    with pytest.raises(TypeError, match="share dtype and device"):
        ops.conv_grads(x, g.float(), s)
    with pytest.raises(ValueError, match="route must be None or one of"):
        ops.conv_sq_norms(x, g, s, route="im2col")
    with pytest.raises(ValueError, match="route 'kernel' needs CUDA tensors"):
        ops.conv_grads(x, g, s, route="kernel")
    with pytest.raises(ValueError, match=r"groups \(4\) must divide"):
        ops.conv_grads(x, g, ops.ConvShape(4, 5, 5, 6, 5, 5, 3, 3, (1, 1), (1, 1), (1, 1), 4))
    with pytest.raises(TypeError, match="shape must be a ConvShape"):
        ops.conv_grads(x, g, (4, 5, 5))
    with pytest.raises(TypeError, match="factors must be a contiguous"):
        ops.conv_clipped(x, g, s, torch.ones(3, dtype=F64), torch.zeros(6, 2, 3, 3, dtype=F64))
    with pytest.raises(ValueError, match="out_w must be a floating tensor of 108 elements"):
        ops.conv_clipped(x, g, s, torch.ones(2, dtype=F64), torch.zeros(6, 2, 3, dtype=F64))


@pytest.mark.parametrize("padding_idx", [None, 1])
def test_embedding(padding_idx: int | None) -> None:
    m = nn.Embedding(10, 5, padding_idx=padding_idx, dtype=F64)
    idx = torch.randint(0, 10, (4, 6))
    idx[0, :3] = 2  # repeated tokens within a sample: the ghost norm's cross terms
    idx[1, 0] = 1
    check(m, idx, torch.randn(4, 6, 5, dtype=F64))


def test_embedding_scale_grad_by_freq_falls_back() -> None:
    m = nn.Embedding(10, 5, scale_grad_by_freq=True, dtype=F64)
    idx = torch.randint(0, 10, (4, 6))
    check(m, idx, torch.randn(4, 6, 5, dtype=F64))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(7, dtype=F64),
        lambda: nn.LayerNorm(7, bias=False, dtype=F64),
        lambda: nn.LayerNorm((3, 7), dtype=F64),
        lambda: nn.RMSNorm(7, dtype=F64),
        lambda: nn.RMSNorm(7, eps=1e-5, dtype=F64),
        lambda: cnn.LayerNorm(7, dtype=F64),
        lambda: cnn.RMSNorm(7, dtype=F64),
        lambda: cnn.RMSNorm(7, offset=1.0, dtype=F64),
    ],
)
def test_norms(make: Any) -> None:
    m = make()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    x = torch.randn(4, 3, 7, dtype=F64)
    check(m, x, torch.randn(4, 3, 7, dtype=F64))


def test_hf_llama_rmsnorm_by_structure() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    m = llama.LlamaRMSNorm(7, eps=1e-6).to(F64)
    with torch.no_grad():
        m.weight.add_(torch.randn(7, dtype=F64))
    from cukit.per_sample import NormKind, kind_of

    assert isinstance(kind_of(m), NormKind)
    check(m, torch.randn(4, 3, 7, dtype=F64), torch.randn(4, 3, 7, dtype=F64))


def test_hf_conv1d() -> None:
    pu = pytest.importorskip("transformers.pytorch_utils")
    m = pu.Conv1D(5, 6).to(F64)
    from cukit.per_sample import LinearKind, kind_of

    assert isinstance(kind_of(m), LinearKind)
    check(m, torch.randn(3, 4, 6, dtype=F64), torch.randn(3, 4, 5, dtype=F64))


class Scale(nn.Module):
    """A parameterised layer with no fused rule: the torch.func fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(d, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.s) + x


def test_fallback_and_groupnorm() -> None:
    m = nn.Sequential(nn.Linear(6, 8, dtype=F64), Scale(8), nn.Unflatten(1, (2, 4)),
                      nn.GroupNorm(2, 2, dtype=F64), nn.Flatten(), nn.Linear(8, 3, dtype=F64))
    check(m, torch.randn(5, 6, dtype=F64), torch.randn(5, 3, dtype=F64))


class Attn(nn.Module):
    """torch.nn.MultiheadAttention owns in_proj_weight and returns a tuple: the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


def test_fallback_tuple_output_multihead_attention() -> None:
    check(Attn(), torch.randn(3, 4, 8, dtype=F64), torch.randn(3, 4, 8, dtype=F64))


def test_parameter_used_outside_its_module_is_an_error() -> None:
    class Tied(nn.Module):  # no parameters of its own: nothing records the functional use
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4, dtype=F64)
            self.head = nn.Linear(4, 4, dtype=F64)  # never called: its weight is used by F.linear

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.emb(idx), self.head.weight)

    with pytest.raises(ValueError, match=r"parameter 'head\.weight' is used outside its module's forward"):
        cukit.per_sample_grads(Tied(), sum_sq, torch.randint(0, 6, (3, 2)), torch.randn(3, 2, 4, dtype=F64))


def test_linear_subclass_with_its_own_forward_falls_back() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2.0 * super().forward(x)

    from cukit.per_sample import FallbackKind, kind_of

    m = Scaled(4, 3, dtype=F64)
    assert isinstance(kind_of(m), FallbackKind)
    check(m, torch.randn(5, 4, dtype=F64), torch.randn(5, 3, dtype=F64))


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def mlp(dtype: Any = F64) -> nn.Module:
    return nn.Sequential(nn.Linear(20, 16, dtype=dtype), nn.ReLU(inplace=True), nn.Linear(16, 16, dtype=dtype),
                         nn.ReLU(), nn.Linear(16, 10, dtype=dtype))


def cnn_model(dtype: Any = F64) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, dtype=dtype), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, dtype=dtype), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(64, 10, dtype=dtype),
    )


def test_mlp_inplace_relu_and_cross_entropy() -> None:
    check(mlp(), torch.randn(6, 20, dtype=F64), torch.randint(0, 10, (6,)), ce_sum)


def test_mlp_mean_reduction() -> None:
    m = mlp()
    x, y = torch.randn(6, 20, dtype=F64), torch.randint(0, 10, (6,))
    ref = vmap_grads(m, ce_sum, x, y)
    got = cukit.per_sample_grads(m, nn.CrossEntropyLoss(), x, y, loss_reduction="mean")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k])
    norms = cukit.per_sample_grad_norms(m, nn.CrossEntropyLoss(), x, y, loss_reduction="mean")
    torch.testing.assert_close(norms, torch.sqrt(sum(v.flatten(1).square().sum(1) for v in ref.values())))


def test_cnn() -> None:
    check(cnn_model(), torch.randn(4, 1, 8, 8, dtype=F64), torch.randint(0, 10, (4,)), ce_sum)


class Block(nn.Module):
    """A tiny pre-norm transformer block with tied input/output embeddings."""

    def __init__(self, V: int = 11, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d, dtype=F64)
        self.pos = nn.Parameter(torch.randn(5, d, dtype=F64) * 0.1)  # a bare parameter: fallback on the root
        self.ln1 = nn.LayerNorm(d, dtype=F64)
        self.qkv = nn.Linear(d, 3 * d, dtype=F64)
        self.proj = nn.Linear(d, d, dtype=F64)
        self.ln2 = nn.RMSNorm(d, dtype=F64)
        self.up = cnn.Linear(d, 16, activation="gelu", dtype=F64)
        self.down = nn.Linear(16, d, dtype=F64)
        self.head = nn.Linear(d, V, bias=False, dtype=F64)
        self.head.weight = self.emb.weight  # tied
        self.heads = heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        h = self.emb(idx) + self.pos[:T]
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, -1).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        h = h + self.down(self.up(self.ln2(h)))
        return self.head(h)


def test_tiny_transformer_block_tied_weights() -> None:
    m = Block()
    idx = torch.randint(0, 11, (3, 5))
    check(m, idx, torch.randint(0, 11, (3, 5)), ce_sum)


def test_module_called_twice() -> None:
    lin = nn.Linear(5, 5, dtype=F64)
    m = nn.Sequential(lin, nn.Tanh(), lin)
    check(m, torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64))


def test_no_reference_cycle_keeps_a_step_alive(monkeypatch: Any) -> None:
    """The capture (and with it every saved activation) is freed when the call returns, without
    waiting for the garbage collector."""
    import gc
    import weakref

    import cukit.per_sample as ps

    refs: list[Any] = []
    real = ps.run

    def spy(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        refs.append(weakref.ref(out[1]))
        return out

    monkeypatch.setattr(ps, "run", spy)
    m, x, y = mlp(), torch.randn(6, 20, dtype=F64), torch.randint(0, 10, (6,))
    gc.collect()
    gc.disable()
    try:
        cukit.per_sample_grad_norms(m, ce_sum, x, y)
        cukit.per_sample_grad_norms(m, ce_sum, x, y, per_parameter=True)
        cukit.per_sample_grads(m, ce_sum, x, y)
        cukit.dp.clip_and_accumulate(m, ce_sum, x, y, max_grad_norm=1.0)
        assert len(refs) == 4 and all(r() is None for r in refs)
    finally:
        gc.enable()


class Towers(nn.Module):
    """Two branches fed by the data alone (two sources), a leaf input that requires grad, a
    parameter of the root read in its own forward, a residual cukit.Linear and an unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 5, dtype=F64), nn.ReLU(inplace=True), nn.Linear(5, 5, dtype=F64))
        self.b = nn.Linear(6, 5, dtype=F64)
        self.scale = nn.Parameter(torch.randn(5, dtype=F64))
        self.mix = cnn.Linear(5, 5, activation="silu", dtype=F64)
        self.out = nn.Linear(5, 4, dtype=F64)
        self.unused = nn.Linear(5, 2, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + self.b(x * 2) * self.scale
        h = h + self.mix(h)
        self.unused(h)
        return self.out(h)


def _asked_for(monkeypatch: Any, model: nn.Module) -> list[list[str]]:
    """Per call of cukit.per_sample's run: the names of the layers whose G the backward returns."""
    import cukit.per_sample as ps

    names = {id(m): n for n, m in model.named_modules()}
    asked: list[list[str]] = []
    real = ps._streamed

    def spy(cap: Any, consume: Any) -> Any:
        wanted, hooks = real(cap, consume)
        asked.append([names[id(c.module)] for c in wanted])
        return wanted, hooks

    monkeypatch.setattr(ps, "_streamed", spy)
    return asked


def test_streamed_output_grads_ask_only_for_the_source_layers(monkeypatch: Any) -> None:
    """Norms and per-sample grads take each layer's G from a hook as the backward reaches it; the
    backward returns only the G of layers no other recorded layer leads to (here the first)."""
    m = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8, dtype=F64), nn.Tanh()) for _ in range(4)),
                      nn.Linear(8, 3, dtype=F64))
    x, y = torch.randn(5, 8, dtype=F64), torch.randn(5, 3, dtype=F64)
    asked = _asked_for(monkeypatch, m)
    check(m, x, y)
    assert asked == [["0.0"], ["0.0"]]  # per_sample_grads, per_sample_grad_norms
    cukit.dp.clip_and_accumulate(m, sum_sq, x, y, max_grad_norm=1.0)
    assert len(asked) == 2  # a DP step keeps every G for its clipped sum: nothing streamed


def test_streamed_output_grads_odd_graphs(monkeypatch: Any) -> None:
    """Two sources, an input that requires grad, a root parameter, a residual, an unused output:
    against torch.func; the leaf-fed and root layers are asked for, the rest streamed."""
    m = Towers()
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    asked = _asked_for(monkeypatch, m)
    check(m, x, torch.randn(4, 4, dtype=F64))
    assert x.grad is None
    assert asked == [["a.0", "b", ""]] * 2  # a.2, mix, out and unused streamed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_streamed_consumer_error_propagates(device: str, monkeypatch: Any) -> None:
    """An error raised while a hook forms a layer's part (on CUDA: on autograd's device thread)
    reaches the caller as itself; the next call runs clean."""
    import cukit.per_sample as ps

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    m = mlp(torch.float32).to(device)
    x, y = torch.randn(6, 20, device=device), torch.randint(0, 10, (6,), device=device)
    want = cukit.per_sample_grad_norms(m, ce_sum, x, y)

    def boom(self: Any, c: Any, g: Any) -> bool:
        raise ValueError("boom in a layer's norm")

    with monkeypatch.context() as mp:
        mp.setattr(ps.NormStream, "__call__", boom)
        with pytest.raises(ValueError, match="boom in a layer's norm"):
            cukit.per_sample_grad_norms(m, ce_sum, x, y)
    torch.testing.assert_close(cukit.per_sample_grad_norms(m, ce_sum, x, y), want)


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_streamed_grad_is_never_written_over(activation: str, monkeypatch: Any) -> None:
    """A streamed G is autograd's buffer while the backward runs: a residual hands the same tensor
    to the skip path. The fused activation's pre-activation grad must not overwrite it, even where
    the chunked in-place route would take a G of its own."""
    import cukit.per_sample as ps

    monkeypatch.setattr(ps, "_PREACT_CHUNK_BYTES", 3 * 6 * 8)  # 3 rows of 6 float64

    class Res(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 6, dtype=F64)
            self.mlp = cnn.Linear(6, 6, activation=activation, dtype=F64)
            self.out = nn.Linear(6, 2, dtype=F64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.out(h + self.mlp(h))

    check(Res(), torch.randn(5, 3, 4, dtype=F64), torch.randn(5, 3, 2, dtype=F64))


def test_unused_and_frozen_parameters() -> None:
    m = nn.ModuleDict({"a": nn.Linear(4, 3, dtype=F64), "b": nn.Linear(4, 3, dtype=F64)})
    m["a"].bias.requires_grad_(False)

    class Use(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m["a"](x)

    model = Use()
    x, y = torch.randn(3, 4, dtype=F64), torch.randn(3, 3, dtype=F64)
    got = cukit.per_sample_grads(model, sum_sq, x, y)
    assert "m.a.bias" not in got
    assert torch.equal(got["m.b.weight"], torch.zeros(3, 3, 4, dtype=F64))
    ref = vmap_grads(model, sum_sq, x, y)
    torch.testing.assert_close(got["m.a.weight"], ref["m.a.weight"])


def test_batchnorm_is_a_clear_error() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"BatchNorm1d.*per-sample gradients are undefined"):
        cukit.per_sample_grads(m, sum_sq, torch.randn(3, 4), torch.randn(3, 4))
    m.eval()  # running statistics: samples are independent, the fallback handles it
    x = torch.randn(3, 4)
    got = cukit.per_sample_grads(m, sum_sq, x, torch.randn(3, 4))
    assert got["1.weight"].shape == (3, 4)


def test_bad_arguments() -> None:
    m = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="loss_reduction must be 'sum' or 'mean'"):
        cukit.per_sample_grads(m, sum_sq, torch.randn(2, 3), torch.randn(2, 2), loss_reduction="none")
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        cukit.per_sample_grads(m, lambda o, t: (o - t).square(), torch.randn(2, 3), torch.randn(2, 2))


def test_norms_per_parameter() -> None:
    m = mlp()
    x, y = torch.randn(6, 20, dtype=F64), torch.randint(0, 10, (6,))
    ref = vmap_grads(m, ce_sum, x, y)
    per = cukit.per_sample_grad_norms(m, ce_sum, x, y, per_parameter=True)
    for k in ref:
        torch.testing.assert_close(per[k], ref[k].flatten(1).norm(dim=1))


# ---------------------------------------------------------------------------------------------
# Array-level ops (references; the CPU path)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (3, 4097), (0, 5), (4, 0), (2, 3, 5)])
def test_row_sq_norms(shape: tuple) -> None:
    x, y = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    rows = (shape[0], math.prod(shape[1:]))
    torch.testing.assert_close(ops.row_sq_norms(x), x.reshape(rows).square().sum(1))
    torch.testing.assert_close(ops.row_sq_norms(x, y), (x * y).reshape(rows).sum(1))


def _dense_layers(B: int, dims: list[tuple[int, int]], dtype: Any, device: str = "cpu") -> list[tuple]:
    return [(torch.randn(B, i, dtype=dtype, device=device), torch.randn(B, o, dtype=dtype, device=device),
             bool(k % 2 == 0)) for k, (i, o) in enumerate(dims)]


def _dense_want(layers: list[tuple], materialise: bool = True) -> torch.Tensor:
    """||dW_i||^2 + ||db_i||^2 per sample in float64: from the materialised per-sample grads, or
    (materialise=False, for shapes whose grads would not fit) from the row norms."""
    total = 0
    for a, g, b in layers:
        a, g = a.double().cpu(), g.double().cpu()
        dw = (g[:, :, None] * a[:, None, :]).flatten(1).square().sum(1) if materialise else (
            g.square().sum(1) * a.square().sum(1))
        total = total + dw + (g.square().sum(1) if b else 0)
    return total


@pytest.mark.parametrize("dims", [[(5, 3)], [(7, 4), (4, 1), (1, 9)], [(3, 2)] * 9, [(0, 3), (3, 0)]])
def test_dense_sq_norms(dims: list) -> None:
    layers = _dense_layers(6, dims, F64)
    torch.testing.assert_close(ops.dense_sq_norms(layers), _dense_want(layers))
    torch.testing.assert_close(ops.dense_sq_norms(layers, finish_scale=3.0), (9 * _dense_want(layers)).sqrt())
    # layers one at a time into one accumulator: the same sums
    acc = None
    for layer in layers:
        acc = ops.dense_sq_norms([layer], out=acc)
    torch.testing.assert_close(acc, _dense_want(layers))
    start = torch.rand(6, dtype=F64)
    got = ops.dense_sq_norms(layers, out=start.clone(), finish_scale=2.0)
    torch.testing.assert_close(got, (4 * (start + _dense_want(layers))).sqrt())


def test_dense_sq_norms_bad_inputs() -> None:
    a, g = torch.randn(4, 3), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"dense_sq_norms: layers must hold at least one"):
        ops.dense_sq_norms([])
    with pytest.raises(TypeError, match=r"dense_sq_norms: layers\[0\] must be a tuple \(a, g, bias\)"):
        ops.dense_sq_norms([(a, g)])
    with pytest.raises(TypeError, match=r"layers\[0\]\[2\] \(bias\) must be a bool; got int"):
        ops.dense_sq_norms([(a, g, 1)])
    with pytest.raises(ValueError, match=r"layers\[1\] g must have 4 rows \(samples, layers\[0\]'s\); got shape \(5, 2\)"):
        ops.dense_sq_norms([(a, g, True), (a, torch.randn(5, 2), True)])
    with pytest.raises(TypeError, match=r"layers\[1\] a must have dtype torch.float32 \(layers\[0\]'s\); got torch.float64"):
        ops.dense_sq_norms([(a, g, True), (a.double(), g, True)])
    with pytest.raises(ValueError, match=r"layers\[0\]\[0\] \(a\) must be 2-D; got shape \(4, 1, 3\)"):
        ops.dense_sq_norms([(a[:, None], g, True)])
    for bad in (torch.zeros(5), torch.zeros(4, dtype=F64), torch.zeros(8)[::2]):
        with pytest.raises(ValueError, match=r"dense_sq_norms: out must be a contiguous \(4,\) tensor of dtype "
                                             r"torch.float32"):
            ops.dense_sq_norms([(a, g, True)], out=bad)


def test_norms_mixed_dense_and_other_layers() -> None:
    """Linear layers with 2-D inputs take the one-launch route; a conv, a tied (materialised)
    weight and a frozen weight with a trainable bias take the others; the sum is exact."""
    lin = nn.Linear(6, 6, dtype=F64)
    m = nn.Sequential(nn.Conv2d(1, 2, 3, dtype=F64), nn.Flatten(), nn.Linear(18, 6, dtype=F64), nn.Tanh(), lin,
                      nn.ReLU(), lin, nn.Linear(6, 4, dtype=F64))
    m[7].weight.requires_grad_(False)
    x, y = torch.randn(5, 1, 5, 5, dtype=F64), torch.randint(0, 4, (5,))
    check(m, x, y, ce_sum)
    for reduction in ("sum", "mean"):
        def loss(o: Any, t: Any, reduction: str = reduction) -> torch.Tensor:
            return nn.functional.cross_entropy(o, t, reduction=reduction)

        ref = vmap_grads(m, loss, x, y)
        want = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in ref.values()))  # sample i's own loss
        torch.testing.assert_close(cukit.per_sample_grad_norms(m, loss, x, y, loss_reduction=reduction), want)


@pytest.mark.parametrize("T,d_in,d_out", [(1, 5, 3), (4, 5, 3), (7, 2, 3), (3, 1, 1)])
def test_linear_routes_agree(T: int, d_in: int, d_out: int) -> None:
    a, g = torch.randn(4, T, d_in, dtype=F64), torch.randn(4, T, d_out, dtype=F64)
    explicit = ops.linear_grads(a, g).flatten(1).square().sum(1)
    for gram in (True, False):
        torch.testing.assert_close(ops.linear_sq_norms(a, g, gram=gram), explicit)
    assert ops.use_gram(3, 5, 3) and not ops.use_gram(4, 5, 3)


@given(B=st.integers(1, 5), T=st.integers(1, 9), d_in=st.integers(1, 13), d_out=st.integers(1, 7),
       three_d=st.booleans())
def test_linear_ops_property(B: int, T: int, d_in: int, d_out: int, three_d: bool) -> None:
    shape = (B, T) if three_d else (B,)
    a = torch.randn(*shape, d_in, dtype=F64)
    g = torch.randn(*shape, d_out, dtype=F64)
    want = torch.einsum("b...o,b...i->boi", g, a)
    torch.testing.assert_close(ops.linear_grads(a, g), want)
    for gram in (True, False, None):
        torch.testing.assert_close(ops.linear_sq_norms(a, g, gram=gram), want.flatten(1).square().sum(1))
    f = torch.rand(B, dtype=F64)
    torch.testing.assert_close(ops.weighted_sum(want, f), torch.einsum("b,boi->oi", f, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_16_and_32_bit_models_on_cpu(dtype: Any) -> None:
    m64 = mlp()
    x, y = torch.randn(6, 20, dtype=F64), torch.randint(0, 10, (6,))
    ref = cukit.per_sample_grads(m64, ce_sum, x, y)
    m = m64.to(dtype)
    got = cukit.per_sample_grads(m, ce_sum, x.to(dtype), y)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for k in ref:
        assert got[k].dtype == dtype
        assert float((got[k].double() - ref[k]).norm() / ref[k].norm()) < tol, k
    assert cukit.per_sample_grad_norms(m, ce_sum, x.to(dtype), y).dtype == torch.float32


def test_clip_scale_weighted_sum() -> None:
    sq = torch.tensor([0.0, 4.0, 100.0, float("nan")], dtype=F64)
    norms, f = ops.clip_factors(sq, 5.0)
    torch.testing.assert_close(norms[:3], torch.tensor([0.0, 2.0, 10.0], dtype=F64))
    torch.testing.assert_close(f[:3], torch.tensor([1.0, 1.0, 5.0 / (10.0 + 1e-6)], dtype=F64))
    assert torch.isnan(f[3])
    ps = torch.randn(3, 4, 5, dtype=F64)
    w = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    torch.testing.assert_close(ops.scale_rows(ps, w), ps * w.view(3, 1, 1))
    out = torch.ones(4, 5, dtype=F64)
    ops.weighted_sum(ps, w, out)
    torch.testing.assert_close(out, 1 + (ps * w.view(3, 1, 1)).sum(0))


def test_sum_over_t_and_bad_inputs() -> None:
    g, x = torch.randn(3, 5, 4, dtype=F64), torch.randn(3, 5, 4, dtype=F64)
    torch.testing.assert_close(ops.sum_over_t(g), g.sum(1))
    torch.testing.assert_close(ops.sum_over_t(g, x), (g * x).sum(1))
    assert ops.sum_over_t(g.half(), out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="g must be 3-D"):
        ops.sum_over_t(g[0])
    with pytest.raises(TypeError, match=r"x must have dtype torch\.float64"):
        ops.sum_over_t(g, x.float())
    with pytest.raises(TypeError, match="must have dtype float16, bfloat16, float32 or float64"):
        ops.row_sq_norms(torch.ones(3, 2, dtype=torch.int64))


def test_embedding_ops() -> None:
    idx = torch.tensor([[1, 1, 2], [0, 3, 3]])
    g = torch.randn(2, 3, 4, dtype=F64)
    ps = ops.embedding_grads(idx, g, 5)
    torch.testing.assert_close(ps[0, 1], g[0, 0] + g[0, 1])
    torch.testing.assert_close(ops.embedding_sq_norms(idx, g), ps.flatten(1).square().sum(1))


# ---------------------------------------------------------------------------------------------
# GPU (the lead runs these on an H100)
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3),
       torch.float64: (1e-12, 1e-12)}
DTYPES = list(TOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (3, 4097), (257, 1000), (2, 1 << 20), (0, 4), (70000, 3)])
def test_gpu_row_sq_norms(dtype: Any, shape: tuple) -> None:
    x = torch.randn(shape, device="cuda").to(dtype)
    y = torch.randn(shape, device="cuda").to(dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(ops.row_sq_norms(x), ops.reference_row_sq_norms(x), rtol=rtol, atol=atol * shape[-1])
    torch.testing.assert_close(ops.row_sq_norms(x, y), ops.reference_row_sq_norms(x, y), rtol=rtol,
                               atol=atol * shape[-1])
    assert torch.equal(ops.row_sq_norms(x), ops.row_sq_norms(x))  # bitwise reproducible (plan-cache hit)
    torch.testing.assert_close(ops.row_sq_norms(x[:, 1:]), ops.reference_row_sq_norms(x[:, 1:]), rtol=rtol,
                               atol=atol * shape[-1])  # misaligned rows: the scalar path


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 1, 7), (5, 123, 64), (3, 33, 4097), (256, 1, 512), (2, 0, 8)])
def test_gpu_sum_t_scale_weighted(dtype: Any, shape: tuple) -> None:
    g = torch.randn(shape, device="cuda").to(dtype)
    x = torch.randn(shape, device="cuda").to(dtype)
    rtol, atol = TOL[dtype]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for xx in (None, x):
        for od in (dtype, acc):
            torch.testing.assert_close(ops.sum_over_t(g, xx, out_dtype=od),
                                       ops.reference_sum_over_t(g, xx, out_dtype=od), rtol=rtol, atol=atol * shape[1])
    f = torch.rand(shape[0], device="cuda", dtype=acc)
    torch.testing.assert_close(ops.scale_rows(g, f), (g.to(acc) * f.view(-1, 1, 1)).to(dtype), rtol=rtol, atol=atol)
    out = torch.zeros(shape[1:], device="cuda", dtype=acc)
    ops.weighted_sum(g, f, out)
    torch.testing.assert_close(out, ops.reference_weighted_sum(g, f), rtol=rtol, atol=atol * shape[0])
    sq = torch.rand(shape[0], device="cuda", dtype=acc) * 10
    sq[0] = float("nan")  # kept: a poisoned sample shows in the result
    for a, b in zip(ops.clip_factors(sq, 1.5), ops.reference_clip_factors(sq, 1.5), strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)
        assert torch.isnan(a[0])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [[(784, 512), (512, 512), (512, 10)], [(7, 3)], [(64, 24)] * 9,
                                  [(1000, 4097), (3, 1)], [(0, 8), (8, 0)]])
@pytest.mark.parametrize("B", [1, 256, 3000])
def test_gpu_dense_sq_norms(dtype: Any, dims: list, B: int) -> None:
    layers = _dense_layers(B, dims, dtype, "cuda")
    rtol, atol = TOL[dtype]
    want = _dense_want(layers, materialise=False)  # the identity itself is tested on the CPU
    scale = atol * max(1, max(i * o for i, o in dims))
    got = ops.dense_sq_norms(layers)
    assert got.dtype == (F64 if dtype == F64 else torch.float32)
    torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=scale)
    assert torch.equal(ops.dense_sq_norms(layers), got)  # bitwise reproducible (plan-cache hit)
    torch.testing.assert_close(ops.dense_sq_norms(layers, finish_scale=2.0).double().cpu(), (4 * want).sqrt(),
                               rtol=rtol, atol=scale ** 0.5)
    # one layer at a time into one accumulator (the streamed norms' way), then a finish over the sum
    acc = None
    for layer in layers:
        acc = ops.dense_sq_norms([layer], out=acc)
    assert acc is not None and acc.dtype == got.dtype
    torch.testing.assert_close(acc.double().cpu(), want, rtol=rtol, atol=scale)
    start = torch.rand(B, device="cuda", dtype=got.dtype)
    fin = ops.dense_sq_norms(layers, out=start.clone(), finish_scale=2.0)
    torch.testing.assert_close(fin.double().cpu(), (4 * (start.double().cpu() + want)).sqrt(), rtol=rtol,
                               atol=scale ** 0.5)
    # strided and misaligned views: copied, or the scalar path
    odd = [(torch.randn(B, a.shape[1] + 1, device="cuda").to(dtype)[:, 1:], g.t().contiguous().t(), b)
           for a, g, b in layers]
    torch.testing.assert_close(ops.dense_sq_norms(odd).double().cpu(), _dense_want(odd, materialise=False),
                               rtol=rtol, atol=scale)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunked_pre_activation_grad(dtype: Any, monkeypatch: Any) -> None:
    import cukit.per_sample as ps

    monkeypatch.setattr(ps, "_PREACT_CHUNK_BYTES", 7 * 48 * 4)
    lin = cnn.Linear(32, 48, activation="gelu", device="cuda", dtype=dtype)
    xs, g = torch.randn(100, 32, device="cuda", dtype=dtype), torch.randn(100, 48, device="cuda", dtype=dtype)
    z = (xs.float() @ lin.weight.detach().float().t() + lin.bias.detach().float())
    want = torch.func.vjp(nn.functional.gelu, z)[1](g.float())[0]
    got = ps._pre_activation_grad(lin, xs, g, lin.weight.detach().t())
    assert got.data_ptr() == g.data_ptr()  # in place
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, m, n", [(256, 512, 784), (3, 17, 5), (1, 1, 1), (5, 33, 4097), (0, 4, 8), (4, 0, 8),
                                     (70, 3, 40)])
def test_gpu_linear_grads_outer_rows(dtype: Any, B: int, m: int, n: int) -> None:
    """2-D inputs: per-sample weight grads g_b^T a_b in one launch; each product rounded once, as
    torch's multiply; strided and misaligned inputs."""
    a, g = torch.randn(B, n, device="cuda").to(dtype), torch.randn(B, m, device="cuda").to(dtype)
    want = g[:, :, None] * a[:, None, :]
    got = ops.linear_grads(a, g)
    assert got.shape == (B, m, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    a2 = torch.randn(B, n + 1, device="cuda").to(dtype)[:, 1:]  # misaligned rows: the scalar path
    g2 = torch.randn(m, B, device="cuda").to(dtype).t()  # strided: copied
    torch.testing.assert_close(ops.linear_grads(a2, g2), g2[:, :, None] * a2[:, None, :], rtol=0, atol=0)
    torch.testing.assert_close(ops.linear_grads(a2, g2), g2[:, :, None] * a2[:, None, :], rtol=0, atol=0)  # cached


@gpu
@needs_cuda
def test_gpu_dense_sq_norms_plan_cache() -> None:
    layers = _dense_layers(32, [(16, 8), (8, 4)], torch.float32, "cuda")
    ops.dense_sq_norms(layers)
    n = len(ops._DENSE_PLANS)
    fresh = [(a.clone(), g.clone(), b) for a, g, b in layers]  # new pointers, same signature
    ops.dense_sq_norms(fresh)
    assert len(ops._DENSE_PLANS) == n
    ops.dense_sq_norms(fresh[:1])  # another signature: a new plan
    assert len(ops._DENSE_PLANS) == n + 1


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factory", [mlp, cnn_model, Block])
def test_gpu_models_match_cpu_float64(dtype: Any, factory: Any) -> None:
    m64 = factory() if factory is not Block else Block()
    x = torch.randint(0, 11, (3, 5)) if factory is Block else (
        torch.randn(4, 1, 8, 8, dtype=F64) if factory is cnn_model else torch.randn(6, 20, dtype=F64))
    y = torch.randint(0, 11 if factory is Block else 10, (3, 5) if factory is Block else (x.shape[0],))
    ref = cukit.per_sample_grads(m64, ce_sum, x, y)
    ref_n = cukit.per_sample_grad_norms(m64, ce_sum, x, y)
    m = m64.to(device="cuda", dtype=dtype)
    xc = x.cuda() if not x.is_floating_point() else x.to("cuda", dtype)
    got = cukit.per_sample_grads(m, ce_sum, xc, y.cuda())
    # in bf16 the error is the model's own rounding: no more than twice torch.func's on the same model
    theirs = vmap_grads(m, ce_sum, xc, y.cuda()) if dtype == torch.bfloat16 else None
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3  # cuDNN convolutions use TF32 by default
    for k in ref:
        err = (got[k].double().cpu() - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)
        bound = tol
        if theirs is not None:
            bound = max(tol, 2 * float((theirs[k].double().cpu() - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)))
        assert err < bound, (k, float(err), bound)
    n = cukit.per_sample_grad_norms(m, ce_sum, xc, y.cuda())
    torch.testing.assert_close(n.double().cpu(), ref_n, rtol=tol, atol=tol)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


CONV_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CONV_SHAPES)))
def test_gpu_conv_ops(dtype: Any, case: int) -> None:
    s, B = CONV_SHAPES[case]
    x = torch.randn(B, s.C, s.H, s.W, device="cuda").to(dtype)
    g = torch.randn(B, s.K, s.P, s.Q, device="cuda").to(dtype)
    rw, rb = conv_oracle(x.cpu(), g.cpu(), s)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    f = torch.rand(B, device="cuda", dtype=acc)
    for route in ("kernel", "grouped", "unfold"):
        # cuDNN's float32 convolutions and 16-bit outputs round more than the kernel's fp32 sums
        tol = CONV_TOL[dtype] if route == "kernel" or dtype == torch.float64 else max(CONV_TOL[dtype], 5e-3)
        dw, db = ops.conv_grads(x, g, s, route=route)
        assert dw.dtype == dtype and dw.shape == rw.shape
        assert rel_err(dw, rw) < tol and rel_err(db, rb) < tol, route
        sw, sb = ops.conv_sq_norms(x, g, s, route=route)
        assert sw.dtype == acc
        assert rel_err(sw, rw.flatten(1).square().sum(1)) < 2 * tol and rel_err(sb, rb.square().sum(1)) < 2 * tol, route
        for out_dtype in (dtype, acc):
            ow = torch.ones(rw.shape[1:], device="cuda", dtype=out_dtype)
            ob = torch.ones(s.K, device="cuda", dtype=out_dtype)
            ops.conv_clipped(x, g, s, f, ow, ob, route=route)
            fc = f.double().cpu()
            assert rel_err(ow - 1, torch.einsum("i,i...->...", fc, rw)) < 4 * tol + (1e-2 if out_dtype != acc else 0)
            assert rel_err(ob - 1, fc @ rb) < 4 * tol + (1e-2 if out_dtype != acc else 0)
    again = ops.conv_grads(x, g, s, route="kernel")
    assert torch.equal(again[0], ops.conv_grads(x, g, s, route="kernel")[0])  # bitwise reproducible
    assert torch.equal(ops.conv_sq_norms(x, g, s)[0], ops.conv_sq_norms(x, g, s)[0])
    assert ops.conv_grads(x, g, s, bias=False, route="kernel")[1] is None
    wt = torch.zeros(s.C // s.groups, s.K, s.R, s.S, device="cuda", dtype=dtype).transpose(0, 1)  # not contiguous
    ops.conv_clipped(x, g, s, f, wt, None, route="kernel")
    ref = torch.einsum("i,i...->...", f.double().cpu(), rw)
    assert rel_err(wt, ref) < 4 * CONV_TOL[dtype] + (1e-2 if dtype in (torch.float16, torch.bfloat16) else 0)


def conv_zoo(dtype: Any = F64) -> nn.Module:
    """Every conv feature the kernel route reads: 'same', groups with stride and reflect padding,
    dilation, more than 64 output channels, a Conv1d."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding="same", dtype=dtype), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=4, padding_mode="reflect", dtype=dtype), nn.ReLU(),
        nn.Conv2d(8, 70, 2, dilation=2, dtype=dtype), nn.Flatten(2), nn.Conv1d(70, 4, 3, padding=1, dtype=dtype),
        nn.Flatten(), nn.Linear(36, 10, dtype=dtype),
    )


@gpu
@needs_cuda
def test_gpu_conv_model_grads_norms_dp_match_cpu_float64() -> None:
    from cukit import dp

    m64 = conv_zoo()
    x, y = torch.randn(6, 3, 9, 9, dtype=F64), torch.randint(0, 10, (6,))
    ref = cukit.per_sample_grads(m64, ce_sum, x, y)
    ref_n = cukit.per_sample_grad_norms(m64, ce_sum, x, y)
    dp.clip_and_accumulate(m64, ce_sum, x, y, max_grad_norm=0.1)
    ref_dp = {k: p.grad for k, p in m64.named_parameters()}
    m = conv_zoo(torch.float32).cuda()
    m.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    xc, yc = x.float().cuda(), y.cuda()
    got = cukit.per_sample_grads(m, ce_sum, xc, yc)
    for k in ref:
        assert rel_err(got[k], ref[k]) < 2e-3, k  # torch's own convolutions (the G's) use TF32 by default
    assert rel_err(cukit.per_sample_grad_norms(m, ce_sum, xc, yc), ref_n) < 2e-3
    dp.clip_and_accumulate(m, ce_sum, xc, yc, max_grad_norm=0.1)
    for k, p in m.named_parameters():
        assert rel_err(p.grad, ref_dp[k]) < 2e-3, k


@gpu
@needs_cuda
def test_gpu_no_host_sync() -> None:
    m = mlp(torch.float32).cuda()
    x, y = torch.randn(64, 20, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    cukit.per_sample_grad_norms(m, ce_sum, x, y)  # plans built, kernels compiled
    c = cnn_model(torch.float32).cuda()
    xc = torch.randn(8, 1, 8, 8, device="cuda")
    for fn in (cukit.per_sample_grad_norms, cukit.per_sample_grads):
        fn(c, ce_sum, xc, y[:8])  # plans built, kernels compiled
    torch.cuda.set_sync_debug_mode("error")
    try:
        cukit.per_sample_grad_norms(m, ce_sum, x, y)
        cukit.per_sample_grads(m, ce_sum, x, y)
        cukit.per_sample_grad_norms(c, ce_sum, xc, y[:8])
        cukit.per_sample_grads(c, ce_sum, xc, y[:8])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scatter_rows_sum_matches_accumulation_and_is_deterministic(device, dtype):
    from cukit.per_sample import _scatter_rows_sum_sorted_, scatter_rows_sum_

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    g = torch.Generator().manual_seed(0)
    for n, V, d in ((0, 4, 2), (1, 3, 2), (50, 7, 3), (4000, 13, 8)):
        idx = torch.randint(0, V, (n,), generator=g).to(device)
        rows = torch.randn(n, d, generator=g, dtype=torch.float64).to(device)
        base = torch.randn(V, d, generator=g, dtype=torch.float64).to(device)
        exp = base.clone().index_put_((idx,), rows, accumulate=True)
        got = scatter_rows_sum_(base.to(dtype), idx, rows.to(dtype))
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol * max(1.0, n ** 0.5))
        again = scatter_rows_sum_(base.to(dtype), idx, rows.to(dtype))
        assert torch.equal(got, again)
        if n and dtype != torch.float64:  # the sorted prefix-sum path CUDA takes, on any device
            got = _scatter_rows_sum_sorted_(base.to(dtype), idx, rows.to(dtype))
            torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol * max(1.0, n ** 0.5))


@gpu
@needs_cuda
@pytest.mark.parametrize("act", [None, "gelu"])
def test_gpu_streamed_norms_hold_a_few_output_grads_not_all(act: str | None) -> None:
    """The norms of a deep MLP form each layer's part as its G arrives. The capture keeps every
    layer's input to the end either way; keeping every G too (a DP step's way) peaks at least
    three layers' G higher. The norms match per-sample grads'."""
    import os

    import cukit.per_sample as ps

    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip("torch's allocator statistics are off (every allocation is a cudaMalloc)")
    B, d, L = 512, 1024, 8

    def block() -> nn.Module:
        return cnn.Linear(d, d, activation=act) if act else nn.Sequential(nn.Linear(d, d), nn.ReLU())

    m = nn.Sequential(*(block() for _ in range(L)), nn.Linear(d, 10)).cuda()
    x, y = torch.randn(B, d, device="cuda"), torch.randint(0, 10, (B,), device="cuda")
    g_bytes = B * d * 4

    def kept_all() -> torch.Tensor:
        _, cap, n, scale = ps.run(m, ce_sum, x, y, "sum", "test")
        return ps.sq_norms_of(cap, n, x.device, torch.float32, finish_scale=scale)

    def peak(fn: Any) -> tuple[int, torch.Tensor]:
        fn()  # warm: kernels compiled, plans made
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        return torch.cuda.max_memory_allocated() - base, out

    p_all, want = peak(kept_all)
    p_stream, norms = peak(lambda: cukit.per_sample_grad_norms(m, ce_sum, x, y))
    assert p_stream + 3 * g_bytes <= p_all, (p_stream / 2**20, p_all / 2**20, g_bytes / 2**20)
    torch.testing.assert_close(norms, want, rtol=1e-5, atol=1e-6)
    grads = torch.sqrt(sum(v.float().flatten(1).square().sum(1)
                           for v in cukit.per_sample_grads(m, ce_sum, x, y).values()))
    torch.testing.assert_close(norms, grads, rtol=1e-4, atol=1e-6)
