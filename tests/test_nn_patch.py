"""cukit.nn.patch: what it swaps and fuses (and what it skips, with the reason), shared parameters,
state_dict both ways, equal outputs and gradients, each switch, idempotence, errors; on local
copies of the Hugging Face / timm blocks (same class and attribute names and forwards), and on
tiny transformers models when transformers is installed. CPU unless marked gpu."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
from hf_blocks import (  # noqa: E402  (tests/ is on sys.path)
    GPT2MLP,
    Blocks,
    Conv1D,
    FastGELUActivation,
    GluMlp,
    Mlp,
    mlp,
)

import cukit.nn  # noqa: E402  (after the torch skip)
from cukit.nn._patch import RULES, Change, register_rule  # noqa: E402


def torch_cuda() -> bool:
    return cukit.is_available() and torch.cuda.is_available()

nn = torch.nn
F = torch.nn.functional
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# --------------------------------------------------------------------------------------- helpers
# The linear rules alone, each linear swapped (linear=True, conv1d=True: off by default), and the
# rules added with later kernels (norms, gated MLPs, rotary embeddings, the loss, convolutions)
# switched off, for the tests of the linear swap and activation fusion.
CLASSIC = ("linear", "conv1d", "fuse_activations")


def classic(**switches: bool) -> dict[str, bool]:
    return {**{name: name in CLASSIC for name in RULES}, **switches}


def pair(make: Callable[[], nn.Module], dtype: torch.dtype = torch.float32, device: str = "cpu", **kw):
    """(reference, patched copy) with the same weights, in eval mode."""
    torch.manual_seed(0)
    ref = make().to(device=device, dtype=dtype).eval()
    return ref, cukit.nn.patch(copy.deepcopy(ref), **kw)


def check_same(ref: nn.Module, ours: nn.Module, x: torch.Tensor, grads: bool = True) -> None:
    tol = TOL[x.dtype]
    x1, x2 = x.clone().requires_grad_(grads), x.clone().requires_grad_(grads)
    y1, y2 = ref(x1), ours(x2)
    torch.testing.assert_close(y2, y1, rtol=tol, atol=tol)
    if not grads:
        return
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=tol, atol=tol)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=n)


def whats(model: nn.Module, skipped: bool = False) -> dict[str, str]:
    """module name -> what was done (or why not), " | "-joined when several rules reported it."""
    r, out = model.cukit_patch_report, {}
    for c in r.skipped if skipped else r.done:
        out[c.module] = f"{out[c.module]} | {c.what}" if c.module in out else c.what
    return out


# ------------------------------------------------------------------------------------ Sequential
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequential_mlp_swaps_fuses_and_matches(dtype):
    ref, ours = pair(mlp, dtype)
    r = ours.cukit_patch_report
    assert r.counts == {"fuse_activations": 4}  # the last linear has nothing to fuse: torch's stays
    assert [type(m) for m in ours] == [cukit.nn.Linear, nn.Identity] * 2 + [nn.Dropout] + [
        cukit.nn.Linear, nn.Identity] * 2 + [nn.Linear]
    assert [ours[i].activation for i in (0, 2, 5, 7)] == ["relu", "gelu", "gelu_tanh", "silu"]
    assert whats(ours)["0"] == "torch.nn.Linear -> cukit.nn.Linear, 1 (ReLU) fused: activation='relu', 1 -> Identity"
    assert ours.state_dict().keys() == ref.state_dict().keys()
    check_same(ref, ours, torch.randn(3, 5, 8, dtype=dtype))
    ref, every = pair(mlp, dtype, linear=True)
    assert every.cukit_patch_report.counts == {"linear": 5, "fuse_activations": 4}
    assert type(every[9]) is cukit.nn.Linear and every[9].activation is None
    assert whats(every)["0"] == "torch.nn.Linear -> cukit.nn.Linear | 1 (ReLU) fused: activation='relu', 1 -> Identity"
    check_same(ref, every, torch.randn(3, 5, 8, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sequential_mlp_16bit(dtype):
    ref, ours = pair(mlp, dtype)
    check_same(ref, ours, torch.randn(4, 8, dtype=dtype), grads=False)


def test_parameters_are_shared_and_an_old_optimizer_still_trains_the_model():
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    model[2].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    w0 = model[0].weight.detach().clone()
    pre_hook_calls = []
    model[0].register_forward_pre_hook(lambda m, args: pre_hook_calls.append(1))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    assert cukit.nn.patch(model) is model
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
    assert model[0].weight is params[0] and not model[2].weight.requires_grad
    x = torch.randn(6, 8)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert pre_hook_calls == [1]  # forward pre-hooks see the input: kept and fused through
    assert "0" in whats(model)
    for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=n)
    assert not torch.equal(model[0].weight, w0)


def test_state_dict_round_trips_both_ways():
    ref, ours = pair(Blocks)
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert list(ours.state_dict()) == list(ref.state_dict())
    fresh_ref, fresh_ours = Blocks().eval(), cukit.nn.patch(Blocks().eval())
    fresh_ours.load_state_dict(ref.state_dict())
    fresh_ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8)
    torch.testing.assert_close(fresh_ours(x), ref(x), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fresh_ref(x), ref(x), rtol=0, atol=0)


# -------------------------------------------------------------------------------- known blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_known_blocks_fuse_and_match(dtype):
    ref, ours = pair(Blocks, dtype, **classic())
    assert ours.cukit_patch_report.counts == {"linear": 12, "conv1d": 2, "fuse_activations": 6}
    for i in range(2):
        mlp_ = ours.llama[i]
        assert mlp_.gate_proj.activation == "silu" and mlp_.up_proj.activation is None
        assert isinstance(mlp_.act_fn, nn.Identity)
    assert type(ours.gpt2.c_fc) is cukit.nn.Conv1D and ours.gpt2.c_fc.activation == "gelu_tanh"
    assert ours.gpt2.c_fc.weight.shape == (8, 16) and ours.gpt2.c_fc.weight is dict(
        ours.named_parameters())["gpt2.c_fc.weight"]
    assert ours.bert.dense.activation == "gelu" and ours.timm.fc1.activation == "gelu"
    assert ours.siglip.fc1.activation == "gelu_tanh" and isinstance(ours.siglip.activation_fn, nn.Identity)
    assert whats(ours)["llama.0.gate_proj"] == (
        "torch.nn.Linear -> cukit.nn.Linear | gated MLP: act_fn (SiLU) fused: activation='silu', act_fn -> Identity")
    check_same(ref, ours, torch.randn(3, 4, 8, dtype=dtype))
    text = str(ours.cukit_patch_report)
    assert "llama.*.gate_proj" in text and "  2  gated MLP" in text and "conv1d" in text


def test_inexact_activations_and_unknown_forwards_are_skipped():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fast = GPT2MLP(act=FastGELUActivation)
            self.glu = GluMlp()
            self.normed = Mlp(norm=nn.LayerNorm)
            self.seq = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.0), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.seq(self.normed(self.glu(self.fast(x))))

    ref, ours = pair(Model, **classic())
    assert ours.cukit_patch_report.counts == {"linear": 6, "conv1d": 2}
    skipped = whats(ours, skipped=True)
    assert skipped["fast.c_fc"] == "GPT2MLP: act: FastGELUActivation is not exact: tanh gelu with sqrt(2/pi) rounded to 0.7978845608"
    assert "forward also reads cat, chunk" in skipped["glu"]
    assert skipped["normed"] == "timm Mlp: norm is LayerNorm, not Identity"
    assert skipped["seq.0"] == "1: Tanh has no cukit epilogue"
    assert isinstance(ours.fast.act, FastGELUActivation) and isinstance(ours.glu.act, nn.GELU)
    check_same(ref, ours, torch.randn(5, 8))


def test_hooks_subclasses_shared_modules_and_instance_forwards_are_respected():
    class MyLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), MyLinear(8, 8), nn.ReLU(), shared, nn.SiLU(),
                          nn.Sequential(shared), nn.Linear(8, 8), nn.GELU())
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.min().item()))
    model[7].forward = model[7].forward  # what accelerate's hooks do
    ref = copy.deepcopy(model)
    every = cukit.nn.patch(copy.deepcopy(model), linear=True)
    cukit.nn.patch(model)
    skipped = whats(model, skipped=True)
    subclass = "MyLinear subclasses torch.nn.Linear; its forward may differ (see linear_types)"
    instance = "Linear.forward is replaced on the instance (an accelerate hook?)"
    assert skipped["0"] == "1 (ReLU) not fused: Linear has forward hooks"
    assert skipped["2"] == f"3 (ReLU) not fused: {subclass}"
    assert skipped["4"] == "5 (SiLU) not fused: shared by 2 parent modules"
    assert skipped["7"] == f"8 (GELU) not fused: {instance}"
    assert [type(model[i]) for i in (0, 2, 4, 7)] == [nn.Linear, MyLinear, nn.Linear, nn.Linear]
    skipped = whats(every, skipped=True)
    assert skipped["2"] == f"{subclass} | 3 (ReLU) not fused: {subclass}"
    assert skipped["7"] == f"{instance} | 8 (GELU) not fused: {instance}"
    assert [type(every[i]) for i in (0, 2, 4, 7)] == [cukit.nn.Linear, MyLinear, cukit.nn.Linear, nn.Linear]
    assert every[0].activation is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), ref(x), rtol=2e-6, atol=2e-6)
    assert len(seen) == 2 and seen[0] < 0 and seen[1] < 0  # the hook still sees the pre-activation
    listed = cukit.nn.patch(nn.Sequential(MyLinear(8, 8), nn.ReLU()), linear_types=[MyLinear])
    assert type(listed[0]) is cukit.nn.Linear and listed[0].activation == "relu"


# ---------------------------------------------------------------------------------- switches
def test_switches():
    _, ours = pair(Blocks, **classic(linear=False))  # the default: linears swapped where they fuse
    assert ours.cukit_patch_report.counts == {"conv1d": 2, "fuse_activations": 6}
    fused = [m for m in ours.modules() if type(m) is cukit.nn.Linear]
    assert len(fused) == 5 and all(m.activation is not None for m in fused)
    assert type(ours.out) is nn.Linear and type(ours.llama[0].up_proj) is nn.Linear
    assert whats(ours)["bert.dense"] == ("BertIntermediate: torch.nn.Linear -> cukit.nn.Linear, intermediate_act_fn "
                                         "(GELUActivation) fused: activation='gelu', intermediate_act_fn -> Identity")
    _, ours = pair(Blocks, **classic(fuse_activations=False))
    assert ours.cukit_patch_report.counts == {"linear": 12, "conv1d": 2}
    assert all(getattr(m, "activation", None) is None for m in ours.modules())
    assert isinstance(ours.llama[0].act_fn, nn.SiLU)
    _, ours = pair(Blocks, **classic(conv1d=False))  # c_fc becomes cukit's to take its GELU; c_proj stays
    assert ours.cukit_patch_report.counts == {"linear": 12, "fuse_activations": 6}
    assert type(ours.gpt2.c_fc) is cukit.nn.Conv1D and type(ours.gpt2.c_proj) is Conv1D
    _, ours = pair(Blocks, **classic(linear=False, conv1d=False, fuse_activations=False))
    assert ours.cukit_patch_report.counts == {} and "0 changed (no changes)" in str(ours.cukit_patch_report)


def test_idempotent_and_not_inplace():
    ref, ours = pair(Blocks)
    before = str(ours)
    again = cukit.nn.patch(ours)
    assert again is ours and str(ours) == before and again.cukit_patch_report.counts == {}
    check_same(ref, ours, torch.randn(2, 8), grads=False)
    copy_ = cukit.nn.patch(ref, inplace=False)
    assert copy_ is not ref and type(ref.bert.dense) is nn.Linear and type(copy_.bert.dense) is cukit.nn.Linear
    assert copy_.bert.dense.weight is not ref.bert.dense.weight and not hasattr(ref, "cukit_patch_report")


def test_report_and_verbose(capsys):
    model = cukit.nn.patch(mlp(), verbose=True, linear=True)
    out = capsys.readouterr().out
    assert out.strip() == str(model.cukit_patch_report)
    lines = out.splitlines()
    assert lines[0] == "cukit.nn.patch: 9 changed (linear 5, fuse_activations 4), 0 skipped"
    assert lines[2].split() == ["linear", "*", "5", "torch.nn.Linear", "->", "cukit.nn.Linear"]


def test_errors():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'rmsnorm'; known keywords: linear, "
                                        r"conv1d, .*fuse_activations, .*inplace, verbose, linear_types"):
        cukit.nn.patch(mlp(), rmsnorm=True)
    with pytest.raises(TypeError, match="linear must be True or False; got 0"):
        cukit.nn.patch(mlp(), linear=0)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        cukit.nn.patch(lambda x: x)
    with pytest.raises(TypeError, match=r"linear_types must be subclasses of torch\.nn\.Linear"):
        cukit.nn.patch(mlp(), linear_types=[nn.Conv2d])


def test_rules_are_a_registry():
    assert [n for n in RULES if n in CLASSIC] == list(CLASSIC) and list(RULES)[:2] == ["linear", "conv1d"]
    assert all(r.doc for r in RULES.values()) and [n for n, r in RULES.items() if not r.default] == ["linear", "conv1d"]
    rules = list(RULES)
    seen = []

    @register_rule("count_layernorms", default=False, before="fuse_activations")
    def _count(name, module, ctx):
        """Count LayerNorms (test rule)."""
        if isinstance(module, nn.LayerNorm):
            seen.append(name)
            return [Change(name, "counted")]
        return []

    try:
        at = rules.index("fuse_activations")
        assert list(RULES) == [*rules[:at], "count_layernorms", *rules[at:]]
        model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
        cukit.nn.patch(model)
        assert seen == []  # off by default
        cukit.nn.patch(model, count_layernorms=True)
        assert seen == ["0"] and model.cukit_patch_report.counts == {"count_layernorms": 1}
        with pytest.raises(ValueError, match="taken"):
            register_rule("linear")(_count)
        with pytest.raises(ValueError, match="no rule 'rmsnorm'"):
            register_rule("x", before="rmsnorm")(_count)
    finally:
        del RULES["count_layernorms"]


def test_torch_compile_of_a_patched_model(compile_policy: str):
    ref, ours = pair(Blocks)
    torch._dynamo.reset()
    check_same(ref, torch.compile(ours, backend="aot_eager", fullgraph=True), torch.randn(3, 8))


def test_autocast_like_torch():
    ref, ours = pair(mlp)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = ref(x), ours(x)
        assert y2.dtype == y1.dtype == torch.bfloat16
        ours(x.bfloat16())
    torch.testing.assert_close(y2, y1, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------- transformers
def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize(("make", "counts"), [
    # per layer a gated MLP, a rotary embedding, 2 RMSNorms; the final norm; the labels loss. The
    # linears stay torch's: the MLPs' activation is the gated kernel's, so none has one to fuse.
    # recompute: the parents of the norms and gated activations (model, layers, MLPs)
    (tiny_llama, {"gated_mlp": 2, "rope": 2, "lm_head_loss": 1, "rms_norm": 5, "recompute": 5}),
    # c_fc + GELU per layer (c_fc becomes cukit's Conv1D); 2 LayerNorms per layer and the final one;
    # recompute: the blocks and the model; the labels loss over the tied lm_head
    (tiny_gpt2, {"fuse_activations": 2, "layer_norm": 5, "recompute": 3, "lm_head_loss": 1}),
])
def test_transformers_models(make, counts):
    ref, ours = pair(make, torch.float64)
    assert ours.cukit_patch_report.counts == counts, str(ours.cukit_patch_report)
    ids = torch.randint(0, 128, (2, 9))
    # HF's LlamaRMSNorm computes in float32 even for float64 inputs; cukit's norm in float64
    tol = 1e-6 if make is tiny_llama else 1e-10
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=tol, atol=tol)


def tiny_causal_lm(family: str) -> nn.Module:
    """A 2-layer *ForCausalLM of `family` from a config (transformers' own classes)."""
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":
        return tiny_gpt2()
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    config, model = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    }[family]
    extra = {"head_dim": 16} if family == "gemma" else {}
    return getattr(transformers, model)(getattr(transformers, config)(**common, **extra))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma", "gpt2"])
def test_default_patch_of_causal_lms_same_loss_and_gradients(family):
    """patch() with its defaults (every rule that applies) on each model family: the labels loss and
    every parameter's gradient equal stock's in float64."""
    ref = tiny_causal_lm(family).double().eval()  # no dropout: both sides see the same maths
    torch.manual_seed(0)
    ours = cukit.nn.patch(copy.deepcopy(ref))
    counts = ours.cukit_patch_report.counts
    if family == "gpt2":
        assert counts == {"fuse_activations": 2, "layer_norm": 5, "recompute": 3, "lm_head_loss": 1}, str(ours.cukit_patch_report)
    else:
        assert counts == {"gated_mlp": 2, "rope": 2, "lm_head_loss": 1, "rms_norm": 5, "recompute": 5}, str(ours.cukit_patch_report)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(0, 128, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    l1, l2 = ref(ids, labels=labels).loss, ours(ids, labels=labels).loss
    l1.backward()
    l2.backward()
    # transformers computes the loss of float64 logits in float32 (`logits.float()`), and its RMSNorm
    # modules compute in float32 even for float64 inputs; cukit stays in float64
    assert l1.dtype == torch.float32 and l2.dtype == torch.float64
    torch.testing.assert_close(l2.double(), l1.double(), rtol=1e-6, atol=1e-6)
    tol = 1e-6
    for (n, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=n)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", [mlp, Blocks, tiny_llama, tiny_gpt2])
def test_gpu_patched_models_match(make, dtype):
    ref, ours = pair(make, dtype, "cuda")
    if make in (tiny_llama, tiny_gpt2):
        ids = torch.randint(0, 128, (2, 9), device="cuda")
        y1, y2 = ref(ids).logits, ours(ids).logits
    else:
        x = torch.randn(4, 7, 8, device="cuda", dtype=dtype)
        y1, y2 = ref(x), ours(x)
    # fp32: sums in another order; bf16: torch rounds the linear's output before the activation, cukit after
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y2.float(), y1.float(), rtol=tol, atol=tol)


def test_last_rules_stay_last():
    """A rule registered without `before` goes ahead of the `last` rules (recompute acts on what the
    swaps made); a `last` rule goes after them."""
    from cukit.nn._patch import RULES, register_rule

    def _none(name, m, ctx):
        return []

    try:
        register_rule("plain_probe")(_none)
        register_rule("last_probe", last=True)(_none)
        names = list(RULES)
        assert names[-3:] == ["plain_probe", "recompute", "last_probe"]
    finally:
        RULES.pop("plain_probe", None)
        RULES.pop("last_probe", None)
