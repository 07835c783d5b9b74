"""Differentially private SGD with one-pass clipping: ``cukit.dp.clip_and_accumulate``,
``cukit.dp.privatize_`` and the optimizer wrapper ``cukit.dp.DPOptimizer``.

DP-SGD (Abadi et al. 2016) replaces the batch gradient by ``(sum_i clip(g_i) + N(0, (sigma C)^2 I)) / B``
with ``clip(g_i) = g_i * min(1, C / (||g_i|| + 1e-6))``. The scheme here (Book-Keeping, Bu et al.
2023) needs ONE forward and ONE backward pass and never holds B per-sample gradients of a large
layer:

1. forward with hooks recording each layer's input A; one backward pass to the layers' outputs
   gives their grads G (autograd computes no weight gradient in it);
2. per-sample squared norms from (A, G) per layer, summed over layers: ghost norms
   (``||a||^2 ||g||^2``; Gram matrices ``<A A^T, G G^T>`` for sequences when T^2 < d_in d_out,
   else per-sample grads one layer at a time), see ``cukit.per_sample``;
3. clip factors ``f = min(1, C / (norm + 1e-6))`` (one small kernel);
4. per layer, the second contraction with the factors: ``sum_i f_i G_i^T A_i = (f ⊙ G)^T A``, one
   GEMM accumulated straight into ``p.grad`` (beta = 1; fp32 accumulation), the cost of the weight
   gradient of a plain backward. Small parameters (norm weights, biases, fallback layers) take
   ``sum_i f_i g_i`` over their per-sample grads.

So a step costs about a plain forward + backward plus the norms, where Opacus' ghost clipping needs
two backward passes. Gradients ACCUMULATE into ``p.grad`` (as ``loss.backward()`` does): several
micro-batches add up, then :func:`privatize_` adds the noise once and averages (what
:class:`DPOptimizer` does in ``step``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cukit import per_sample as _ps
from cukit.ops import per_sample as ops

__all__ = ["ClipResult", "DPOptimizer", "clip_and_accumulate", "privatize_"]


@dataclass(frozen=True)
class ClipResult:
    """What one :func:`clip_and_accumulate` call saw: the (detached) loss, the per-sample gradient
    norms before clipping (B,), the clip factors applied (B,) and the batch size."""

    loss: torch.Tensor
    norms: torch.Tensor
    factors: torch.Tensor
    batch_size: int


def _check_positive(fn: str, name: str, v: Any, *, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{fn}: {name} must be a real number; got {type(v).__name__}")
    v = float(v)
    if not (v >= 0 if zero_ok else v > 0) or v != v or v == float("inf"):
        raise ValueError(f"{fn}: {name} must be {'>= 0' if zero_ok else '> 0'} and finite; got {v}")
    return v


def _grad_buffer(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return p.grad


def clip_and_accumulate(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    *,
    max_grad_norm: float,
    noise_multiplier: float | None = None,
    generator: torch.Generator | None = None,
    loss_reduction: str = "sum",
) -> ClipResult:
    """``p.grad += sum_i clip(g_i)`` for every trainable parameter, with ``clip(g_i) = g_i *
    min(1, C / (||g_i|| + 1e-6))`` and ||g_i|| the norm over ALL parameters of sample i's gradient,
    in one forward and one backward pass (see the module docstring for the scheme).

    Args:
        model, loss_fn, inputs, targets, loss_reduction: as ``cukit.per_sample_grads`` (loss_fn
            returns the sum over samples, or the mean with loss_reduction="mean").
        max_grad_norm: the clipping bound C > 0.
        noise_multiplier: None (default): only the clipped sum is accumulated (call it once per
            micro-batch, then :func:`privatize_`). A number sigma >= 0: the call is a whole DP
            step's gradient: ``p.grad = (p.grad + sum_i clip(g_i) + N(0, (sigma C)^2)) / B``.
        generator: the torch.Generator (on the parameters' device) that draws the noise.

    Returns: :class:`ClipResult` (loss, norms before clipping, factors, batch size).

    Raises: as ``cukit.per_sample_grads``; ValueError/TypeError for a bad max_grad_norm or
    noise_multiplier.

    See also: Opacus' ``GradSampleModule`` + ``DPOptimizer``; ``torch.nn.utils.clip_grad_norm_``
    (which clips the batch gradient, not each sample's).
    """
    fn = "cukit.dp.clip_and_accumulate"
    C = _check_positive(fn, "max_grad_norm", max_grad_norm)
    if noise_multiplier is not None:
        _check_positive(fn, "noise_multiplier", noise_multiplier, zero_ok=True)
    loss, cap, B, scale = _ps.run(model, loss_fn, inputs, targets, loss_reduction, fn)
    dtype = _ps._norm_dtype(cap)
    device = _ps._device_of(cap, inputs)
    sq = _ps.sq_norms_of(cap, B, device, dtype)
    if scale != 1.0:
        sq = sq * (scale * scale)
    norms, factors = ops.clip_factors(sq.contiguous(), C)
    f = factors * scale if scale != 1.0 else factors  # per-sample grads of a mean loss carry B
    cast: dict[torch.dtype, torch.Tensor] = {}
    for c in cap.calls:
        if c.grad is None:
            continue
        acc = torch.float64 if c.dtype == torch.float64 else torch.float32
        fc = cast.get(acc)
        if fc is None:
            fc = cast[acc] = f.to(acc).contiguous()
        c.kind.clipped(c, c.grad, fc, {k: _grad_buffer(p) for k, p in c.params.items()})
    if noise_multiplier is not None:
        privatize_(_trainable(model), noise_multiplier=noise_multiplier, max_grad_norm=C, batch_size=B,
                   generator=generator)
    return ClipResult(loss, norms, factors, B)


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def privatize_(
    params: Iterable[torch.Tensor],
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> None:
    """``p.grad = (p.grad + N(0, (noise_multiplier * max_grad_norm)^2)) / batch_size`` for each
    parameter (a missing grad counts as zeros): the noise and averaging of a DP-SGD step, once per
    logical batch after :func:`clip_and_accumulate` over its micro-batches. The noise is drawn in
    float32 (float64 for float64 parameters) from `generator` (reproducible for a seeded one),
    parameter by parameter in the given order. batch_size: the logical batch size (the expected
    one under Poisson sampling).

    See also: Opacus' ``DPOptimizer.add_noise``.
    """
    fn = "cukit.dp.privatize_"
    sigma = _check_positive(fn, "noise_multiplier", noise_multiplier, zero_ok=True)
    C = _check_positive(fn, "max_grad_norm", max_grad_norm)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{fn}: batch_size must be a positive int; got {batch_size!r}")
    std = sigma * C
    for p in params:
        g = _grad_buffer(p)
        if std > 0:
            nd = torch.float64 if p.dtype == torch.float64 else torch.float32
            noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=nd)
            if g.dtype == nd:
                g.add_(noise, alpha=std)
            else:
                g.copy_(g.to(nd).add_(noise, alpha=std))
        g.div_(batch_size)


class DPOptimizer:
    """DP-SGD around any torch optimizer: ``backward`` clips and accumulates a (micro-)batch in one
    pass, ``step`` adds the noise, averages and steps.

    Example::

        opt = cukit.dp.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                   max_grad_norm=1.0, noise_multiplier=1.1)
        for x, y in loader:
            opt.zero_grad()
            opt.backward(loss_fn, x, y)     # may be called several times (gradient accumulation)
            opt.step()

    Args:
        optimizer: a torch.optim.Optimizer over the model's parameters.
        model: the module whose trainable parameters are privatised.
        max_grad_norm: C. noise_multiplier: sigma (noise std sigma * C on the sum).
        expected_batch_size: the averaging denominator (Poisson sampling's expected size); None:
            the number of samples given to ``backward`` since the last step.
        loss_reduction: "sum" or "mean", as for ``clip_and_accumulate``.
        generator: the torch.Generator for the noise.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: int | None = None,
        loss_reduction: str = "sum",
        generator: torch.Generator | None = None,
    ) -> None:
        fn = "cukit.dp.DPOptimizer"
        self.max_grad_norm = _check_positive(fn, "max_grad_norm", max_grad_norm)
        self.noise_multiplier = _check_positive(fn, "noise_multiplier", noise_multiplier, zero_ok=True)
        if expected_batch_size is not None and (not isinstance(expected_batch_size, int) or expected_batch_size < 1):
            raise ValueError(f"{fn}: expected_batch_size must be None or a positive int; got {expected_batch_size!r}")
        _ps._check_reduction(loss_reduction, fn)
        self.optimizer, self.model = optimizer, model
        self.expected_batch_size, self.loss_reduction, self.generator = expected_batch_size, loss_reduction, generator
        self.samples = 0  # samples accumulated since the last step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def backward(self, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: Any, targets: Any) -> ClipResult:
        """Clip and accumulate one (micro-)batch into the parameters' grads."""
        r = clip_and_accumulate(self.model, loss_fn, inputs, targets, max_grad_norm=self.max_grad_norm,
                                loss_reduction=self.loss_reduction)
        self.samples += r.batch_size
        return r

    def step(self) -> None:
        """Noise, average (by expected_batch_size, else the samples seen) and the optimizer's step."""
        n = self.expected_batch_size or self.samples
        if n < 1:
            raise RuntimeError("cukit.dp.DPOptimizer.step: no samples since the last step; call backward first")
        privatize_(_trainable(self.model), noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                   batch_size=n, generator=self.generator)
        self.optimizer.step()
        self.samples = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
