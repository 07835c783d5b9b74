"""cukit.dp: one-pass clipped sums against explicit per-sample clipping (torch.func oracle, float64,
no noise), noise reproducibility with a generator, averaging, gradient accumulation over
micro-batches, the DPOptimizer wrapper, argument errors. GPU tests (marker gpu) for the lead."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from test_per_sample import Block, ce_sum, cnn_model, mlp, vmap_grads  # noqa: E402  (tests/ is on sys.path)
from torch import nn  # noqa: E402

import cukit  # noqa: E402
from cukit import dp  # noqa: E402

F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def explicit_clipped_sum(model: nn.Module, loss_fn: Any, x: Any, y: Any, C: float) -> dict[str, torch.Tensor]:
    ps = vmap_grads(model, loss_fn, x, y)
    norms = torch.sqrt(sum(v.flatten(1).square().sum(1) for v in ps.values()))
    f = torch.clamp(C / (norms + 1e-6), max=1.0)
    return {k: torch.einsum("i,i...->...", f, v) for k, v in ps.items()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}


def conv_zoo() -> nn.Module:
    """Grouped and padded convolutions, a Conv1d, GroupNorm (fallback), LayerNorm, Linear."""
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2, padding=1, dtype=F64), nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1, padding_mode="reflect", bias=False, dtype=F64), nn.GroupNorm(2, 4, dtype=F64),
        nn.Flatten(2), nn.Conv1d(4, 3, 5, stride=2, dtype=F64), nn.Flatten(), nn.LayerNorm(54, dtype=F64),
        nn.Linear(54, 10, dtype=F64),
    )


CASES = [
    (mlp, lambda: torch.randn(8, 20, dtype=F64), lambda: torch.randint(0, 10, (8,))),
    (conv_zoo, lambda: torch.randn(5, 4, 5, 8, dtype=F64), lambda: torch.randint(0, 10, (5,))),
    (cnn_model, lambda: torch.randn(4, 1, 8, 8, dtype=F64), lambda: torch.randint(0, 10, (4,))),
    (Block, lambda: torch.randint(0, 11, (3, 5)), lambda: torch.randint(0, 11, (3, 5))),
]


@pytest.mark.parametrize("C", [1e-3, 0.5, 1e6])  # every sample clipped, some, none
@pytest.mark.parametrize("case", CASES, ids=["mlp", "conv_zoo", "cnn", "transformer"])
def test_clipped_sum_matches_explicit_clipping(case: Any, C: float) -> None:
    make, xs, ys = case
    model, x, y = make(), xs(), ys()
    r = dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=C)
    got = grads_of(model)
    want = explicit_clipped_sum(model, ce_sum, x, y, C)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)
    assert r.batch_size == x.shape[0] and r.norms.shape == (x.shape[0],)
    assert bool((r.factors <= 1).all())


def test_mean_reduction_and_accumulation_over_micro_batches() -> None:
    model = mlp()
    x, y = torch.randn(8, 20, dtype=F64), torch.randint(0, 10, (8,))
    want = explicit_clipped_sum(model, ce_sum, x, y, 0.3)
    for lo in (0, 3):  # two micro-batches of 3 and 5 add up to the whole batch
        hi = 3 if lo == 0 else 8
        dp.clip_and_accumulate(model, nn.CrossEntropyLoss(), x[lo:hi], y[lo:hi], max_grad_norm=0.3,
                               loss_reduction="mean")
    for k, v in grads_of(model).items():
        torch.testing.assert_close(v, want[k], rtol=1e-9, atol=1e-12)


def test_noise_is_reproducible_and_averaged() -> None:
    def step(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model = mlp()
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 20, dtype=F64), torch.randint(0, 10, (8,))
        dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=1.0, noise_multiplier=2.0, generator=gen)
        return grads_of(model)

    a, b, c = step(5), step(5), step(6)
    for k in a:
        assert torch.equal(a[k], b[k])
        assert not torch.equal(a[k], c[k])
    # the noise: (noisy - clean) * B ~ N(0, (sigma C)^2)
    torch.manual_seed(1)
    model = mlp()
    x, y = torch.randn(8, 20, dtype=F64), torch.randint(0, 10, (8,))
    clean = explicit_clipped_sum(model, ce_sum, x, y, 1.0)
    noise = torch.cat([(a[k] * 8 - clean[k]).flatten() for k in a])
    n = noise.numel()  # five standard errors either way
    assert abs(float(noise.std()) - 2.0) < 5 * 2.0 / (2 * n) ** 0.5 and abs(float(noise.mean())) < 5 * 2.0 / n**0.5


def test_dp_optimizer_step() -> None:
    model = mlp()
    ref = mlp()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 20, dtype=F64), torch.randint(0, 10, (8,))
    opt = dp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=0.5, noise_multiplier=0.0)
    opt.zero_grad()
    opt.backward(ce_sum, x[:5], y[:5])
    opt.backward(ce_sum, x[5:], y[5:])
    assert opt.samples == 8
    opt.step()
    want = explicit_clipped_sum(ref, ce_sum, x, y, 0.5)
    with torch.no_grad():
        for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(p, q - 0.1 * want[k] / 8)
    assert opt.samples == 0
    with pytest.raises(RuntimeError, match="no samples since the last step"):
        opt.step()


def test_bad_arguments() -> None:
    model = mlp()
    x, y = torch.randn(2, 20, dtype=F64), torch.randint(0, 10, (2,))
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=0.0)
    with pytest.raises(TypeError, match="max_grad_norm must be a real number"):
        dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm="1")
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        dp.privatize_(model.parameters(), noise_multiplier=-1.0, max_grad_norm=1.0, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        dp.privatize_(model.parameters(), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=0)
    with pytest.raises(ValueError, match="BatchNorm"):
        dp.clip_and_accumulate(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), ce_sum, torch.randn(4, 3),
                               torch.randint(0, 3, (4,)), max_grad_norm=1.0)
    assert cukit.dp is dp


# ---------------------------------------------------------------------------------------------
# GPU (the lead runs these on an H100)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=["mlp", "conv_zoo", "cnn", "transformer"])
def test_gpu_clipped_sum_matches_cpu_float64(case: Any, dtype: Any) -> None:
    make, xs, ys = case
    model, x, y = make(), xs(), ys()
    want = explicit_clipped_sum(model, ce_sum, x, y, 0.5)
    m = model.to(device="cuda", dtype=dtype)
    xc = x.to("cuda", dtype) if x.is_floating_point() else x.cuda()
    # in bf16 the error is the model's own rounding: no more than twice torch.func's on the same model
    theirs = explicit_clipped_sum(m, ce_sum, xc, y.cuda(), 0.5) if dtype == torch.bfloat16 else None
    dp.clip_and_accumulate(m, ce_sum, xc, y.cuda(), max_grad_norm=0.5)
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3  # cuDNN convolutions use TF32 by default
    for k, p in m.named_parameters():
        err = (p.grad.double().cpu() - want[k]).norm() / want[k].norm().clamp_min(1e-12)
        bound = tol
        if theirs is not None:
            bound = max(tol, 2 * float((theirs[k].double().cpu() - want[k]).norm() / want[k].norm().clamp_min(1e-12)))
        assert err < bound, (k, float(err), bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_has_no_host_sync_and_reproducible_noise() -> None:
    model = mlp(torch.float32).cuda()
    x, y = torch.randn(64, 20, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=1.0)  # compile, build plans
    model.zero_grad()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=1.0, noise_multiplier=1.0, generator=gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    gen = torch.Generator(device="cuda").manual_seed(3)
    dp.clip_and_accumulate(model, ce_sum, x, y, max_grad_norm=1.0, noise_multiplier=1.0, generator=gen)
    for a, p in zip(first, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
