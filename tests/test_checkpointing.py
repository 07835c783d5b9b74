"""cukit.nn.checkpoint_policy / checkpoint / checkpoint_context_fn / checkpoint_modules: values and
gradients equal to the model without checkpointing (float64), the selective policy saves what it
says (ops counted in backward with a TorchDispatchMode), dropout reproduced, Hugging Face models,
cukit.nn.patch in both orders, torch.compile, errors. GPU tests: peak memory and bf16 gradients."""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

import cukit  # noqa: E402
import cukit.nn as cnn  # noqa: E402
from cukit.nn.checkpointing import GROUPS, SelectivePolicy  # noqa: E402

nn = torch.nn
F = torch.nn.functional
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
aten, ck = torch.ops.aten, torch.ops.cukit


def torch_cuda() -> bool:
    return cukit.is_available() and torch.cuda.is_available()


# --------------------------------------------------------------------------------------- models
class Block(nn.Module):
    """A pre-norm transformer-ish block of cukit modules: RMSNorm -> Linear(gelu) -> Linear, and a
    gated MLP, with residuals."""

    def __init__(self, d: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = cnn.RMSNorm(d)
        self.up = cnn.Linear(d, 2 * d, activation="gelu")
        self.down = cnn.Linear(2 * d, d)
        self.gate, self.val = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)
        self.glu = cnn.GatedActivation("silu")
        self.out = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.down(self.up(self.norm(x))))
        return h + self.out(self.glu(self.gate(h), self.val(h)))


class Stack(nn.Module):
    def __init__(self, n: int = 3, d: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d, dropout) for _ in range(n))
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def stock_block(d: int = 16) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d), nn.Tanh())


def grads_of(model: nn.Module, fn: Callable[[], torch.Tensor], *inputs: torch.Tensor) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(torch.ones_like(out) if out.ndim else None)
    return out.detach(), [p.grad for p in model.parameters()] + [t.grad for t in inputs]


def assert_same(a: tuple[torch.Tensor, list], b: tuple[torch.Tensor, list], tol: float = 1e-12) -> None:
    torch.testing.assert_close(b[0], a[0], rtol=tol, atol=tol)
    assert len(a[1]) == len(b[1])
    for ga, gb in zip(a[1], b[1], strict=True):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=tol, atol=tol)


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach it (by "ns::name")."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def backward_counts(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Counter[str]:
    """The ops run in backward (recomputation included) of fn(x).sum(); the forward runs under
    the counter too, so cukit ops take the same (dispatcher) path with and without checkpointing."""
    with OpCounter() as c:
        y = fn(x).sum()
        c.counts.clear()
        y.backward()
    return c.counts


# ------------------------------------------------------------------------------------- policies
def test_policy_groups_and_decisions():
    p = cnn.checkpoint_policy()
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default,
               aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
               aten.convolution.default, ck.matmul.default, ck.linear.default, ck.conv2d.default,
               ck.linear_cross_entropy.default):
        assert p.decide(op) is SAVE, op
    for op in (aten.gelu.default, aten.mul.Tensor, aten.add.Tensor, aten.native_layer_norm.default,
               aten.native_dropout.default, aten.sum.default, ck.rms_norm.default, ck.layer_norm.default,
               ck.glu.default, ck.bias_act.default, ck.rotary_embedding.default):
        assert p.decide(op) is RECOMPUTE, op
    assert p(None, aten.mm.default, None) is SAVE  # torch's calling convention
    assert GROUPS["matmul"] == GROUPS["gemm"] | GROUPS["attention"] | GROUPS["conv"]
    # every cukit op named in a group exists (the names track cukit/torch/*.py)
    for name in set().union(*GROUPS.values()):
        ns, op = name.split("::")
        if ns == "cukit":
            assert hasattr(ck, op), name


def test_policy_names_ops_predicates_and_precedence():
    p = cnn.checkpoint_policy(("gemm", "norm"), extra_save=[aten.gelu, "aten.tanh", "cukit::glu"],
                              extra_recompute=aten.addmm.default)
    assert p.decide(aten.mm.default) is SAVE and p.decide(ck.rms_norm.default) is SAVE
    assert p.decide(aten.addmm.default) is RECOMPUTE  # extra_recompute wins
    assert p.decide(aten.convolution.default) is RECOMPUTE  # not in "gemm"
    assert all(p.decide(op) is SAVE for op in (aten.gelu.default, aten.tanh.default, ck.glu.default))
    pred = cnn.checkpoint_policy("none", extra_save=lambda op: "norm" in op._schema.name)
    assert pred.decide(aten.native_layer_norm.default) is SAVE and pred.decide(aten.mm.default) is RECOMPUTE
    assert cnn.checkpoint_policy("all").decide(aten.sin.default) is SAVE
    assert cnn.checkpoint_policy("all", extra_recompute="aten::sin").decide(aten.sin.default) is RECOMPUTE
    assert cnn.checkpoint_policy("none").recomputes_everything
    assert "gemm" in repr(p)


def test_policy_pickles_and_copies():
    import pickle

    p = cnn.checkpoint_policy(("gemm",), extra_save="aten::tanh")
    p.decide(aten.mm.default)
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert q.decide(aten.mm.default) is SAVE and q.decide(aten.tanh.default) is SAVE
        assert q.decide(aten.gelu.default) is RECOMPUTE and q.context_fn.args == (q,)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"save": "matmull"}, ValueError, "save names must be groups"),
    ({"save": torch.mm}, TypeError, "torch.ops.aten"),
    ({"save": nn.Linear}, TypeError, "not ops"),
    ({"save": 3}, TypeError, "save must be"),
    ({"extra_save": [1.5]}, TypeError, "extra_save must hold"),
    ({"extra_recompute": "all"}, ValueError, "extra_recompute"),
])
def test_policy_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match) as e:
        cnn.checkpoint_policy(**kwargs)
    assert str(e.value).startswith("cukit.nn.checkpoint_policy: ")


# ------------------------------------------------------------------------------ checkpoint(...)
POLICIES = ["matmul", "none", "all", "gemm", ("norm", "attention"), cnn.checkpoint_policy(extra_save="norm")]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("make", [Block, stock_block])
def test_checkpoint_equals_plain_float64(make, policy):
    torch.manual_seed(0)
    m = make().double()
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    ref = grads_of(m, lambda: m(x), x)
    ours = grads_of(m, lambda: cnn.checkpoint(m, x, policy=policy), x)
    assert_same(ref, ours)


def test_checkpoint_passes_kwargs_and_torch_options():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)

    def f(a: torch.Tensor, *, scale: float) -> torch.Tensor:
        return torch.tanh(lin(a)) * scale

    ref = grads_of(lin, lambda: f(x, scale=3.0), x)
    ours = grads_of(lin, lambda: cnn.checkpoint(f, x, scale=3.0, preserve_rng_state=False,
                                                determinism_check="none"), x)
    assert_same(ref, ours)
    with torch.no_grad():  # the torch options are not passed to the function on the plain path
        torch.testing.assert_close(cnn.checkpoint(f, x, scale=3.0, preserve_rng_state=False), f(x, scale=3.0))


def test_no_grad_is_a_plain_call():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with mock.patch("torch.utils.checkpoint.checkpoint") as ckpt, torch.no_grad():
        y = cnn.checkpoint(lin, x)
    ckpt.assert_not_called()
    torch.testing.assert_close(y, lin(x))


def _two_linears() -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(cnn.Linear(8, 16, activation="gelu"), nn.Linear(16, 8), nn.GELU(), cnn.RMSNorm(8)).double()
    return m, m


@pytest.mark.parametrize("policy", ["matmul", "none", "norm"])
def test_selective_policy_saves_what_it_says(policy):
    """Backward under the policy runs exactly the plain backward's ops plus the forward ops the
    policy recomputes: a saved matmul is not run again, an elementwise op is."""
    _, fn = _two_linears()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    plain = backward_counts(fn, x)
    ours = backward_counts(lambda a: cnn.checkpoint(fn, a, policy=policy), x)
    with OpCounter() as c:
        fn(x)
    forward = c.counts
    p = cnn.checkpoint_policy(policy)
    for name in ("cukit::linear", "aten::addmm", "aten::gelu", "cukit::rms_norm"):
        ns, op = name.split("::")
        recomputed = p.decide(getattr(getattr(torch.ops, ns), op).default) is RECOMPUTE
        assert forward[name] == 1, (name, forward)
        assert ours[name] == plain[name] + (forward[name] if recomputed else 0), (policy, name, ours, plain)


def test_policy_is_consulted_under_compile():
    """The policy function decides for the ops of a compiled region too (selective checkpointing
    under torch.compile): a spy policy sees the GEMMs."""
    seen: list[str] = []
    inner = cnn.checkpoint_policy()

    def spy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(op._schema.name)
        return inner(ctx, op, *args, **kwargs)

    m, fn = _two_linears()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    ref = grads_of(m, lambda: fn(x), x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: cnn.checkpoint(fn, a, policy=spy), backend="aot_eager", fullgraph=True)
    ours = grads_of(m, lambda: compiled(x), x)
    assert_same(ref, ours)
    assert seen and any(n in GROUPS["gemm"] for n in seen), seen


@pytest.mark.parametrize("policy", ["matmul", "none"])
def test_dropout_is_reproduced_in_recompute(policy):
    torch.manual_seed(0)
    m = Block(16, dropout=0.5).double().train()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(123)
    ref = grads_of(m, lambda: m(x), x)
    torch.manual_seed(123)
    ours = grads_of(m, lambda: cnn.checkpoint(m, x, policy=policy), x)
    assert_same(ref, ours)
    torch.manual_seed(124)
    other = grads_of(m, lambda: m(x), x)
    assert not torch.equal(other[0], ref[0])  # the masks did depend on the seed


@pytest.mark.parametrize("policy_mode", ["inductor", "kernels"])
def test_checkpoint_under_compile_fullgraph(policy_mode):
    torch.manual_seed(0)
    m = Block().double()
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    ref = grads_of(m, lambda: m(x), x)
    before = cukit.torch.get_compile_policy()
    cukit.torch.set_compile_policy(policy_mode)
    try:
        torch._dynamo.reset()
        f = torch.compile(lambda a: cnn.checkpoint(m, a), backend="aot_eager", fullgraph=True)
        ours = grads_of(m, lambda: f(x), x)
    finally:
        cukit.torch.set_compile_policy(before)
        torch._dynamo.reset()
    assert_same(ref, ours)


def test_context_fn_for_torch_checkpoint():
    torch.manual_seed(0)
    m = Block().double()
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    ref = grads_of(m, lambda: m(x), x)
    ctx = cnn.checkpoint_context_fn("matmul")
    ours = grads_of(m, lambda: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False, context_fn=ctx), x)
    assert_same(ref, ours)


def test_checkpoint_errors():
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"^cukit.nn.checkpoint: use_reentrant must be False .* got use_reentrant=True"):
        cnn.checkpoint(lin, x, use_reentrant=True)
    with pytest.raises(ValueError, match=r"^cukit.nn.checkpoint: policy must be one of .* got 'matmull'"):
        cnn.checkpoint(lin, x, policy="matmull")
    with pytest.raises(TypeError, match=r"^cukit.nn.checkpoint: policy must be .* got int"):
        cnn.checkpoint(lin, x, policy=3)
    with pytest.raises(TypeError, match=r"^cukit.nn.checkpoint: use_reentrant must be True or False"):
        cnn.checkpoint(lin, x, use_reentrant=None)  # type: ignore[arg-type]
    # plain checkpointing with the reentrant variant is torch's own
    y = cnn.checkpoint(lin, x, policy="none", use_reentrant=True)
    y.sum().backward()
    assert x.grad is not None


# --------------------------------------------------------------------------- checkpoint_modules
def test_checkpoint_modules_auto_on_a_stack():
    torch.manual_seed(0)
    ref = Stack().double()
    ours = copy.deepcopy(ref)
    keys = list(ours.state_dict())
    names = [n for n, _ in ours.named_parameters()]
    assert cnn.checkpoint_modules(ours) is ours
    rep = ours.cukit_checkpoint_report
    assert rep.wrapped == ["layers.0", "layers.1", "layers.2"] and not rep.skipped
    assert "wrapped layers.* x3" in str(rep)
    assert list(ours.state_dict()) == keys and [n for n, _ in ours.named_parameters()] == names
    assert all("forward" in vars(layer) for layer in ours.layers)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    assert_same(grads_of(ref, lambda: ref(x), x), grads_of(ours, lambda: ours(x), x))
    # under no_grad: plain calls
    with mock.patch("torch.utils.checkpoint.checkpoint") as ckpt, torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))
    ckpt.assert_not_called()
    # a deepcopy keeps working, on its own modules
    again = copy.deepcopy(ours)
    assert vars(again.layers[0])["forward"].module is again.layers[0]
    assert_same(grads_of(ref, lambda: ref(x), x), grads_of(again, lambda: again(x), x))


@pytest.mark.parametrize("modules", [Block, (Block, nn.LayerNorm), "layers.*", lambda name, m: isinstance(m, Block)])
def test_checkpoint_modules_selectors(modules):
    m = Stack()
    cnn.checkpoint_modules(m, modules)
    assert m.cukit_checkpoint_report.wrapped == ["layers.0", "layers.1", "layers.2"]


def test_checkpoint_modules_outermost_only_rewrap_and_skips():
    m = Stack()
    cnn.checkpoint_modules(m, lambda name, mod: name.startswith("layers."))  # blocks and their children
    assert m.cukit_checkpoint_report.wrapped == ["layers.0", "layers.1", "layers.2"]
    cnn.checkpoint_modules(m, Block, policy="none")  # again: the policy replaced
    assert vars(m.layers[0])["forward"].label == "'none'"
    m2 = Stack()
    m2.layers[1].forward = lambda x: x  # someone else's instance forward (accelerate)
    m2.layers[2].gradient_checkpointing = True  # transformers' own checkpointing on
    cnn.checkpoint_modules(m2)
    rep = m2.cukit_checkpoint_report
    assert rep.wrapped == ["layers.0"]
    assert [w for w, _ in rep.skipped] == ["layers.1", "layers.2"]
    assert "accelerate" in rep.skipped[0][1] and "gradient checkpointing" in rep.skipped[1][1]
    m3 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # leaves: nothing "auto" would wrap
    cnn.checkpoint_modules(m3)
    assert not m3.cukit_checkpoint_report.wrapped and "modules=" in str(m3.cukit_checkpoint_report)


def test_checkpoint_modules_errors():
    with pytest.raises(TypeError, match=r"^cukit.nn.checkpoint_modules: model must be"):
        cnn.checkpoint_modules(3)  # type: ignore[type-var]
    with pytest.raises(TypeError, match=r"^cukit.nn.checkpoint_modules: modules must be"):
        cnn.checkpoint_modules(Stack(), 3)
    with pytest.raises(TypeError, match=r"modules classes must be"):
        cnn.checkpoint_modules(Stack(), (int,))
    with pytest.raises(ValueError, match=r"^cukit.nn.checkpoint_modules: policy must be one of"):
        cnn.checkpoint_modules(Stack(), policy="nope")


@pytest.mark.parametrize("order", ["patch_then_checkpoint", "checkpoint_then_patch"])
def test_checkpoint_modules_with_patch_on_sequential_blocks(order):
    """Patch first: every fusion, then checkpointed. Checkpoint first: patch leaves a module whose
    own forward is checkpointed alone (here the Sequential blocks it would fuse in); still exact."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(3)]).double()
    ref = cnn.patch(copy.deepcopy(base))
    ours = copy.deepcopy(base)
    if order == "patch_then_checkpoint":
        cnn.patch(ours)
        cnn.checkpoint_modules(ours)
        assert ours.cukit_patch_report.counts == ref.cukit_patch_report.counts == {"fuse_activations": 3}
    else:
        cnn.checkpoint_modules(ours)
        cnn.patch(ours)
        assert "fuse_activations" not in ours.cukit_patch_report.counts
    assert len(ours.cukit_checkpoint_report.wrapped) == 3
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert_same(grads_of(ref, lambda: ref(x), x), grads_of(ours, lambda: ours(x), x))


# ------------------------------------------------------------------------------- transformers
def tiny_llama(**kw: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def llama_step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    return grads_of(model, lambda: model(ids, labels=ids).loss)


def test_hf_llama_same_loss_grads_and_keys():
    ref = tiny_llama(use_cache=False).double().train()
    ours = copy.deepcopy(ref)
    keys = list(ours.state_dict())
    cnn.checkpoint_modules(ours)
    assert ours.cukit_checkpoint_report.wrapped == ["model.layers.0", "model.layers.1"]
    assert list(ours.state_dict()) == keys
    ids = torch.randint(0, 128, (2, 9))
    assert_same(llama_step(ref, ids), llama_step(ours, ids))


def test_hf_llama_kv_cache_dropped_in_training_with_a_warning():
    ref = tiny_llama().double().train()  # use_cache=True: the model makes a DynamicCache
    ours = cnn.checkpoint_modules(copy.deepcopy(ref))
    ids = torch.randint(0, 128, (2, 9))
    with pytest.warns(UserWarning, match="use_cache=False and no KV cache"):
        out = llama_step(ours, ids)
    assert_same(llama_step(ref, ids), out)


@pytest.mark.parametrize("order", ["patch_then_checkpoint", "checkpoint_then_patch"])
def test_hf_llama_with_patch(order):
    base = tiny_llama(use_cache=False).double().train()
    ref = cnn.patch(copy.deepcopy(base))
    ours = copy.deepcopy(base)
    steps = [cnn.patch, cnn.checkpoint_modules]
    for step in steps if order == "patch_then_checkpoint" else steps[::-1]:
        step(ours)
    counts = dict(ref.cukit_patch_report.counts)
    if order == "checkpoint_then_patch":  # a checkpointed layer needs no recompute scope
        counts["recompute"] -= 2
    assert ours.cukit_patch_report.counts == counts
    assert not ours.cukit_patch_report.skipped
    assert ours.cukit_checkpoint_report.wrapped == ["model.layers.0", "model.layers.1"]
    ids = torch.randint(0, 128, (2, 9))
    assert_same(llama_step(ref, ids), llama_step(ours, ids))


@pytest.mark.parametrize("policy_mode", ["inductor", "kernels"])
def test_hf_llama_patched_checkpointed_compiled_fullgraph(policy_mode):
    base = tiny_llama(use_cache=False).double().train()
    ref = cnn.patch(copy.deepcopy(base))
    ours = cnn.checkpoint_modules(cnn.patch(copy.deepcopy(base)))
    ids = torch.randint(0, 128, (2, 9))
    expected = llama_step(ref, ids)
    before = cukit.torch.get_compile_policy()
    cukit.torch.set_compile_policy(policy_mode)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = grads_of(ours, lambda: compiled(ids, labels=ids).loss)
    finally:
        cukit.torch.set_compile_policy(before)
        torch._dynamo.reset()
    assert_same(expected, got, tol=1e-10)


def test_hf_activation_checkpointing_enable_takes_the_context_fn():
    ref = tiny_llama(use_cache=False).double().train()
    ours = copy.deepcopy(ref)
    enable = getattr(ours, "activation_checkpointing_enable", None)
    seen: Counter[CheckpointPolicy] = Counter()
    inner = cnn.checkpoint_policy("matmul")

    def spy(ctx: Any, op: Any, *args: Any, **kw: Any) -> Any:
        seen[inner(ctx, op)] += 1
        return inner(ctx, op)

    kwargs = {"use_reentrant": False, "context_fn": cnn.checkpoint_context_fn(spy)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, 128, (2, 9))
    got = llama_step(ours, ids)
    assert seen[SAVE] and seen[RECOMPUTE], seen  # transformers' layers ran under the policy
    assert_same(llama_step(ref, ids), got)
    # and cukit's wrapper refuses to checkpoint those layers a second time
    cnn.checkpoint_modules(ours)
    assert not ours.cukit_checkpoint_report.wrapped and len(ours.cukit_checkpoint_report.skipped) == 2


def test_selective_policy_is_a_policy_object():
    assert isinstance(cnn.checkpoint_policy(), SelectivePolicy)


# ----------------------------------------------------------------------------------------- GPU
def _peak_step(model: nn.Module, x: torch.Tensor) -> tuple[int, list]:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
@pytest.mark.parametrize(("policy", "factor"), [("none", 0.6), ("matmul", 0.95)])
def test_gpu_checkpoint_lowers_peak_memory_bf16(policy, factor):
    """Per block, plain autograd keeps ~11 d-wide tensors, "matmul" the 5 GEMM outputs (9 d: some
    are not needed by backward, only by the recompute) and "none" the block's input (1 d)."""
    torch.manual_seed(0)
    ref = Stack(n=8, d=256).cuda().bfloat16()
    ours = cnn.checkpoint_modules(copy.deepcopy(ref), policy=policy)
    x = torch.randn(16, 512, 256, device="cuda", dtype=torch.bfloat16)
    peak_ref, g_ref = _peak_step(ref, x)
    peak_ours, g_ours = _peak_step(ours, x)
    assert peak_ours < factor * peak_ref, (peak_ours, peak_ref)
    for a, b in zip(g_ref, g_ours, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
def test_gpu_selective_saves_more_than_none_less_than_plain():
    torch.manual_seed(0)
    ref = Stack(n=8, d=256).cuda().bfloat16()
    x = torch.randn(16, 512, 256, device="cuda", dtype=torch.bfloat16)
    peaks = {p: _peak_step(cnn.checkpoint_modules(copy.deepcopy(ref), policy=p), x)[0] for p in ("none", "matmul")}
    peaks["plain"] = _peak_step(ref, x)[0]
    assert peaks["none"] < peaks["matmul"] < peaks["plain"], peaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs torch with CUDA and CuPy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_patched_llama_checkpointed(dtype):
    base = tiny_llama(use_cache=False).to("cuda", dtype).train()
    ref = cnn.patch(copy.deepcopy(base))
    ours = cnn.checkpoint_modules(cnn.patch(copy.deepcopy(base)))
    ids = torch.randint(0, 128, (2, 33), device="cuda")
    a, b = llama_step(ref, ids), llama_step(ours, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(b[0], a[0], rtol=tol, atol=tol)
    for ga, gb in zip(a[1], b[1], strict=True):
        if ga is not None:
            torch.testing.assert_close(gb.float(), ga.float(), rtol=tol, atol=tol)

