"""cukit.nn.recomputing and the patch rule "recompute": outputs of cukit's norms and gated activations
that later ops save are stored as recipes and remade in the backward, bitwise the same gradients."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import cukit.nn
from cukit.nn import recompute as rc
from tests.conftest import torch_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch_cuda(), reason="needs torch with CUDA and CuPy")])]
# Under compute-sanitizer (run with torch's caching allocator off) a frame of the model's forward
# outlived the forward on the H100, and with it the outputs: lifetimes are checked elsewhere.
SANITIZER = bool(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"))


class Block(nn.Module):
    """A pre-norm gated MLP and a pre-norm projection: norm -> 2 linears, glu -> linear."""

    def __init__(self, h: int, f: int, norm: str) -> None:
        super().__init__()
        self.norm = cukit.nn.RMSNorm(h) if norm == "rms" else cukit.nn.LayerNorm(h)
        self.gate, self.up, self.down = nn.Linear(h, f), nn.Linear(h, f), nn.Linear(f, h)
        self.act = cukit.nn.GatedActivation("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.down(self.act(self.gate(y), self.up(y)))


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    """These models are tiny: recompute every output (MIN_BYTES has its own test)."""
    monkeypatch.setattr(rc, "MIN_BYTES", 0)


def _model(norm: str, dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(Block(16, 24, norm), Block(16, 24, norm)).to(device, dtype)
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return m


def _grads(model: nn.Module, x: torch.Tensor, scope: bool) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    if scope:
        with cukit.nn.recomputing():
            loss = model(x).square().sum()
    else:
        loss = model(x).square().sum()
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_recomputed_gradients_are_bitwise_the_stored_ones(norm, dtype, device, monkeypatch):
    model = _model(norm, dtype, device)
    x = torch.randn(3, 5, 16, device=device, dtype=dtype)
    made: list[str] = []
    materialize = rc._Recipe.materialize

    def counted(self: rc._Recipe) -> torch.Tensor:
        if self.value is None:
            made.append(self.where)
        return materialize(self)

    monkeypatch.setattr(rc._Recipe, "materialize", counted)
    stored = _grads(model, x, False)
    assert made == []
    remade = _grads(model, x, True)
    # once per output (both linears after a norm share one remake), in backward order
    name = "cukit.nn.RMSNorm" if norm == "rms" else "cukit.nn.LayerNorm"
    assert made == ["cukit.nn.GatedActivation", name] * 2
    for a, b in zip(stored, remade, strict=True):
        assert torch.equal(a, b)
    assert SANITIZER or not rc._LIVE  # every record went with its output


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.skipif(SANITIZER, reason="lifetimes differ under compute-sanitizer")
def test_outputs_are_not_kept_alive(device):
    """The norm's and the gated activation's outputs are freed after the forward: the linears keep
    recipes, not the tensors (and without the scope they keep the tensors)."""
    model = _model("rms", torch.float32, device)
    block = model[0]
    seen: dict[str, StorageWeakRef] = {}
    for name in ("norm", "act"):
        getattr(block, name).register_forward_hook(
            lambda _m, _i, out, name=name: seen.__setitem__(name, StorageWeakRef(out.untyped_storage())))
    x = torch.randn(4, 16, device=device, requires_grad=True)
    for scope, freed in ((True, True), (False, False)):
        seen.clear()
        if scope:
            with cukit.nn.recomputing():
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        assert [seen[k].expired() for k in ("norm", "act")] == [freed, freed]
        loss.backward()


def test_input_modified_in_place_raises():
    model = _model("rms", torch.float32, "cpu")
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1.0
    with cukit.nn.recomputing():
        y = model[0].norm(h)
        loss = nn.functional.linear(y, model[0].gate.weight).sum()
    with torch.no_grad():
        h.add_(1.0)  # the norm's input changes between forward and backward
    with pytest.raises(RuntimeError, match=r"cukit.nn.recomputing: input 0 of cukit.nn.RMSNorm was modified in place"):
        loss.backward()


def test_second_backward_and_double_backward():
    model = _model("rms", torch.float64, "cpu")
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    with cukit.nn.recomputing():
        loss = model(x).square().sum()
    g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(loss, x, retain_graph=True)[0]  # the recipes remake their outputs again
    assert torch.equal(g1, g2)
    ref = torch.autograd.grad(model(x).square().sum(), x)[0]
    assert torch.equal(g1, ref)

    def f(inp: torch.Tensor) -> torch.Tensor:
        with cukit.nn.recomputing():
            return model(inp)

    assert torch.autograd.gradgradcheck(f, (x[:2].detach().requires_grad_(),))


def test_scope_stands_aside():
    """Nested scopes push one pair of hooks; no grad mode, another hooks context (checkpoint) and
    compilation leave saves alone."""
    model = _model("rms", torch.float32, "cpu")
    x = torch.randn(4, 16, requires_grad=True)
    with cukit.nn.recomputing():
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with cukit.nn.recomputing():
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
        with torch.no_grad():
            model(x)
        assert not rc._LIVE
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), cukit.nn.recomputing():
        model(x)
        assert rc._STATE.depth == 0
    ref = _grads(model, x, False)
    x2 = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    with cukit.nn.recomputing():
        loss = torch.utils.checkpoint.checkpoint(model, x2, use_reentrant=False).square().sum()
    loss.backward()
    for a, b in zip(ref, [x2.grad, *(p.grad for p in model.parameters())], strict=True):
        torch.testing.assert_close(a, b)


def test_autocast_state_is_replayed():
    model = _model("rms", torch.float32, "cpu")
    x = torch.randn(4, 16)
    outs = []
    for scope in (False, True):
        xx = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), (cukit.nn.recomputing() if scope else torch.enable_grad()):
            loss = model(xx).float().square().sum()
        loss.backward()
        outs.append([xx.grad, *(p.grad for p in model.parameters())])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_patch_rule_scopes_the_parents_and_can_be_switched_off():
    model = _model("rms", torch.float32, "cpu")
    ref = copy.deepcopy(model)
    off = cukit.nn.patch(copy.deepcopy(model), recompute=False)
    assert "recompute" not in off.cukit_patch_report.counts
    cukit.nn.patch(model)
    assert model.cukit_patch_report.counts == {"recompute": 2}
    assert [type(b).__qualname__ for b in model] == ["Block.<cukit recompute>"] * 2
    assert isinstance(model[0], Block) and model.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 16)
    for a, b in zip(_grads(ref, x, False), _grads(model, x, False), strict=True):
        assert torch.equal(a, b)
    cukit.nn.patch(model)  # again: nothing more to do
    assert model.cukit_patch_report.counts == {}


def test_hf_llama_patched_gradients_with_and_without_recompute():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).double()
    on, off = cukit.nn.patch(copy.deepcopy(base)), cukit.nn.patch(copy.deepcopy(base), recompute=False)
    assert on.cukit_patch_report.counts["recompute"] == 5
    ids = torch.randint(0, 128, (2, 9))
    for m in (on, off):
        m(ids, labels=ids).loss.backward()
    for (n, p), q in zip(off.named_parameters(), on.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    assert not rc._LIVE


def test_views_with_offsets_are_remade_in_place():
    """Ops that save slices of a recorded output get the same slices of the remade one."""
    torch.manual_seed(1)
    norm = cukit.nn.RMSNorm(16, dtype=torch.float64)
    w = torch.randn(16, 12, dtype=torch.float64, requires_grad=True)
    c = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)

    def run(scope: bool) -> list[torch.Tensor]:
        x = torch.linspace(-2, 3, 5 * 16, dtype=torch.float64).reshape(5, 16).requires_grad_()
        with cukit.nn.recomputing() if scope else torch.enable_grad():
            y = norm(x)
            loss = (y[1:] @ w).square().sum() + (y[1:, 4:] * c).sum()
        loss.backward()
        out = [x.grad, norm.weight.grad, w.grad, c.grad]
        norm.weight.grad = w.grad = c.grad = None
        return out

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_min_bytes_keeps_small_outputs_stored(monkeypatch):
    """Outputs under min_bytes are stored (no remake); a scoped block whose first floating-point
    input is under MIN_BYTES enters no scope (its saves meet no hooks); a bad min_bytes raises."""
    model = _model("rms", torch.float32, "cpu")
    x = torch.randn(3, 5, 16)  # norm outputs 960 bytes, gated products 1,440 bytes
    made: list[str] = []
    materialize = rc._Recipe.materialize
    monkeypatch.setattr(rc._Recipe, "materialize", lambda self: made.append(self.where) or materialize(self))

    def remakes(min_bytes):
        made.clear()
        xr = x.clone().requires_grad_()
        with cukit.nn.recomputing(min_bytes):
            model(xr).sum().backward()
        return sorted(set(made))

    assert remakes(2000) == []
    assert remakes(1000) == ["cukit.nn.GatedActivation"]
    assert len(remakes(0)) == 2
    monkeypatch.setattr(rc, "MIN_BYTES", 961)
    assert remakes(None) == ["cukit.nn.GatedActivation"]
    # the patch rule's scoped forward: no scope for an input under MIN_BYTES
    scoped = cukit.nn.patch(copy.deepcopy(model))
    seen: list[bool] = []
    inner = type(scoped[0].norm).forward
    monkeypatch.setattr(type(scoped[0].norm), "forward", lambda self, *a: seen.append(
        rc._STATE.depth > 0) or inner(self, *a))
    scoped(x.clone().requires_grad_())  # 960 bytes < 961
    monkeypatch.setattr(rc, "MIN_BYTES", 960)
    scoped(x.clone().requires_grad_())
    assert seen == [False, False, True, True]
    with pytest.raises(ValueError, match=r"cukit.nn.recomputing: min_bytes must be None or an int >= 0; got -1"), \
            cukit.nn.recomputing(-1):
        pass
    # a bad value is an error even where the scope would stand aside (no grad mode, nested)
    with torch.no_grad(), pytest.raises(ValueError, match="min_bytes"), cukit.nn.recomputing(1.5):  # type: ignore[arg-type]
        pass
    with cukit.nn.recomputing(), pytest.raises(ValueError, match="min_bytes"), cukit.nn.recomputing(True):
        pass
