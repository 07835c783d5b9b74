"""cukit.optim driven by a real torch.amp.GradScaler (``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()``), against torch.optim.AdamW driven the same way by a second
scaler: the same parameters, step counts and loss scales every step, including a step whose
gradient holds an inf (skipped: parameters and state untouched, the scale backs off).

GradScaler treats cukit's optimizers like torch's fused ones (``_step_supports_amp_scaling``): it
sets ``opt.grad_scale`` (the scale, on the scaler's device) and ``opt.found_inf`` and lets the step
unscale and skip on the device. "cpu" runs the reference path; "cuda" (marked gpu) the kernels; the
two-GPU test checks launches on a device other than the scaler's.
"""

from __future__ import annotations

from typing import Any

import cukit.optim as co
import pytest

import cukit

torch = pytest.importorskip("torch")

GPU = cukit.is_available() and torch.cuda.is_available()

STEPS = 8
INF_STEP = 4  # a gradient element is set to inf after this step's backward
INIT_SCALE = 2.0**12
GROWTH_INTERVAL = 3  # the scale also grows during the run


def make_models(devices: tuple[str, str]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical 6 -> 5 -> 3 MLPs; layer i lives on devices[i] (the forward moves between them)."""

    class TwoLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(6, 5, device=devices[0])
            self.b = torch.nn.Linear(5, 3, device=devices[1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x.to(devices[0])))
            return self.b(h.to(devices[1]))

    torch.manual_seed(0)
    m = TwoLayer()
    twin = TwoLayer()
    twin.load_state_dict(m.state_dict())
    return m, twin


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params]
    return values, states


def assert_untouched(opt: torch.optim.Optimizer, params: list[torch.Tensor], snap: tuple[list, list]) -> None:
    values, states = snap
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), values[i]), f"param {i} changed on a skipped step"
        assert set(opt.state[p]) == set(states[i])
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(states[i][k])), (i, k)


def train_both(
    devices: tuple[str, str],
    torch_kwargs: dict[str, Any],
    *,
    max_grad_norm: float | None = None,
    inf_param: int = 0,
) -> None:
    """Train a torch.optim.AdamW model and a cukit.optim.AdamW twin, each with its own GradScaler
    (on the device of the loss), and compare them after every step."""
    scaler_device = torch.device(devices[1]).type
    ref_model, model = make_models(devices)
    ref_params, params = list(ref_model.parameters()), list(model.parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=0.01, **torch_kwargs)
    opt = co.AdamW(params, lr=0.01, max_grad_norm=max_grad_norm)
    assert opt._step_supports_amp_scaling  # GradScaler hands it grad_scale / found_inf
    scalers = [
        torch.amp.GradScaler(scaler_device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(1)
    skipped = 0
    for step in range(STEPS):
        x = torch.randn(4, 6, generator=g)
        y = torch.randn(4, 3, generator=g)
        snap = None
        for k, (m, o, sc) in enumerate(((ref_model, ref_opt, scalers[0]), (model, opt, scalers[1]))):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y.to(devices[1]))
            sc.scale(loss).backward()
            ps = list(m.parameters())
            if step == INF_STEP:
                with torch.no_grad():
                    ps[inf_param].grad.view(-1)[1] = float("inf")  # type: ignore[union-attr]
            if max_grad_norm is not None and k == 0:
                sc.unscale_(o)  # torch: unscale, clip, step; cukit clips inside the step
                torch.nn.utils.clip_grad_norm_(ps, max_grad_norm)
            if k == 1 and step == INF_STEP:
                snap = snapshot(o, ps)
            before = sc.get_scale()
            sc.step(o)
            sc.update()
            if step == INF_STEP:
                assert sc.get_scale() == before * 0.5  # backoff_factor
        if snap is not None:
            assert_untouched(opt, params, snap)
            skipped += 1
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        for i, (a, b) in enumerate(zip(ref_params, params, strict=True)):
            torch.testing.assert_close(
                b.detach(), a.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, i=i, s=step: f"step {s}, param {i}: {m}"
            )
            assert float(opt.state[b]["step"]) == float(ref_opt.state[a]["step"]) == step + 1 - skipped
    assert skipped == 1
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # GradScaler removed them
    # the scale grew (every GROWTH_INTERVAL finite steps) and backed off once
    assert scalers[1].get_scale() != INIT_SCALE


@pytest.mark.parametrize(
    "torch_kwargs", [{"foreach": False}, {"fused": True}], ids=["vs-for-loop", "vs-fused"]
)
def test_grad_scaler_drives_adamw_like_torch(device: str, torch_kwargs: dict[str, Any]) -> None:
    """torch's for-loop AdamW goes through GradScaler's unscale_ + host check; its fused AdamW and
    cukit's through grad_scale / found_inf: all three must agree, the inf step skipped by each."""
    train_both((device, device), torch_kwargs)


def test_grad_scaler_with_fused_clipping(device: str) -> None:
    """max_grad_norm inside cukit's step (norm of the unscaled gradients) equals torch's
    scaler.unscale_ + clip_grad_norm_ + step."""
    train_both((device, device), {"foreach": False}, max_grad_norm=0.05)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Lion", "LAMB"])
def test_inf_step_skipped_by_every_optimizer(device: str, name: str) -> None:
    """Through a real GradScaler: a non-finite gradient leaves every optimizer's params and state
    untouched and halves the scale; the next finite step updates again."""
    kw = {"momentum": 0.9} if name == "SGD" else {}
    model, _ = make_models((device, device))
    params = list(model.parameters())
    opt = getattr(co, name)(params, lr=0.01, **kw)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE)
    x = torch.randn(4, 6)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if step == 1:
            params[2].grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
            snap = snapshot(opt, params)
        scaler.step(opt)
        scaler.update()
        if step == 1:
            assert_untouched(opt, params, snap)
            assert scaler.get_scale() == INIT_SCALE * 0.5
    assert not torch.equal(params[0].detach(), snap[0][0])  # the finite step after it did update


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
@pytest.mark.parametrize("inf_param", [0, 3], ids=["inf-on-cuda0", "inf-on-cuda1"])
def test_two_gpus_grad_scaler(max_grad_norm: float | None, inf_param: int) -> None:
    """Layer a on cuda:0, layer b and the loss (hence GradScaler's scale and found_inf) on cuda:1:
    the cuda:0 launches must read per-device copies of grad_scale / found_inf (and of the clipping
    coefficient), and an inf on either device skips the step on both."""
    train_both(("cuda:0", "cuda:1"), {"foreach": False}, max_grad_norm=max_grad_norm, inf_param=inf_param)
