"""Plain-torch references with the kernels' maths: the CPU fallback of cukit.optim and the oracle of
its tests. One tensor at a time, in float32 (float64 for float64 tensors) from the stored values,
rounded once to each storage dtype, with the hyperparameters rounded to float32 as the kernels
receive them. Steps are counted by the caller before the update (as the kernels' mt_count_step).

See also: torch/optim/adam.py ``_single_tensor_adam``, sgd.py ``_single_tensor_sgd``,
adagrad.py ``_single_tensor_adagrad``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["adagrad", "adam", "lamb", "lion", "sgd"]

Tensor = torch.Tensor


def f32(x: float | Tensor) -> float:
    """A hyperparameter as the kernel sees it: rounded to float32."""
    return float(np.float32(float(x)))


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _grad(g: Tensor, sign: float, gmul: Tensor | None) -> Tensor:
    out = _acc(g) * sign
    if gmul is not None:
        out = out * gmul.to(device=out.device, dtype=out.dtype)
    return out


def _weight(p: Tensor, master: Tensor | None) -> Tensor:
    return _acc(master if master is not None else p)


def _store_weight(p: Tensor, master: Tensor | None, w: Tensor) -> None:
    if master is not None:
        master.copy_(w)
    p.copy_(w)


def _one_minus(b: float) -> float:
    return float(np.float32(1.0) - np.float32(b))


def adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor] | None,
    steps: Sequence[float],
    masters: Sequence[Tensor | None] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    decoupled: bool,
    gmul: Tensor | None = None,
) -> None:
    """Adam / AdamW: ``m += (1-b1)(g-m); v = b2 v + (1-b2) g²; p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)``."""
    b1, b2, e, wd = f32(beta1), f32(beta2), f32(eps), f32(weight_decay)
    lr = f32(lr)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        master = masters[i] if masters is not None else None
        w = _weight(p, master)
        g = _grad(grads[i], -1.0 if maximize else 1.0, gmul)
        t = float(steps[i])
        if decoupled:
            w = w * float(np.float32(1.0 - lr * wd))
        else:
            g = g + wd * w
        m = _acc(exp_avgs[i])
        m = m + _one_minus(b1) * (g - m)
        v = b2 * _acc(exp_avg_sqs[i]) + _one_minus(b2) * g * g
        vk = v
        if max_exp_avg_sqs is not None:
            vmax = torch.maximum(_acc(max_exp_avg_sqs[i]), v)
            max_exp_avg_sqs[i].copy_(vmax)
            vk = vmax
        step_size = f32(lr / (1.0 - b1**t))
        bc2_sqrt = f32(math.sqrt(1.0 - b2**t))
        denom = vk.sqrt() / bc2_sqrt + e
        w = w - step_size * (m / denom)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        _store_weight(p, master, w)


def sgd(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor] | None,
    first: Sequence[bool] | None,
    masters: Sequence[Tensor | None] | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    gmul: Tensor | None = None,
) -> None:
    """SGD: ``g += wd p; buf = g (first step) or momentum buf + (1-dampening) g; p -= lr (nesterov ? g + momentum buf : buf)``."""
    lr, mom, wd = f32(lr), f32(momentum), f32(weight_decay)
    damp1 = _one_minus(dampening)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        master = masters[i] if masters is not None else None
        w = _weight(p, master)
        g = _grad(grads[i], -1.0 if maximize else 1.0, gmul) + wd * w
        if momentum_buffers is not None:
            assert first is not None
            b = g if first[i] else mom * _acc(momentum_buffers[i]) + damp1 * g
            momentum_buffers[i].copy_(b)
            g = g + mom * b if nesterov else b
        _store_weight(p, master, w - lr * g)


def lion(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
    gmul: Tensor | None = None,
) -> None:
    """Lion: ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g); m = b2 m + (1-b2) g``."""
    lr, b1, b2 = f32(lr), f32(beta1), f32(beta2)
    decay = float(np.float32(1.0 - lr * f32(weight_decay)))
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        master = masters[i] if masters is not None else None
        w = _weight(p, master)
        g = _grad(grads[i], -1.0 if maximize else 1.0, gmul)
        m = _acc(exp_avgs[i])
        u = b1 * m + _one_minus(b1) * g
        w = w * decay - lr * torch.sign(u)
        exp_avgs[i].copy_(b2 * m + _one_minus(b2) * g)
        _store_weight(p, master, w)


def adagrad(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state_sums: Sequence[Tensor],
    steps: Sequence[float],
    masters: Sequence[Tensor | None] | None,
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    gmul: Tensor | None = None,
) -> None:
    """Adagrad: ``g += wd p; sum += g²; p -= lr / (1 + (t-1) lr_decay) · g / (sqrt(sum) + eps)``."""
    lr, wd, e, decay = f32(lr), f32(weight_decay), f32(eps), f32(lr_decay)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        master = masters[i] if masters is not None else None
        w = _weight(p, master)
        g = _grad(grads[i], -1.0 if maximize else 1.0, gmul) + wd * w
        clr = f32(lr / (1.0 + (float(steps[i]) - 1.0) * decay))
        s = _acc(state_sums[i]) + g * g
        state_sums[i].copy_(s)
        _store_weight(p, master, w - clr * (g / (s.sqrt() + e)))


def lamb(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[float],
    masters: Sequence[Tensor | None] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    maximize: bool,
    gmul: Tensor | None = None,
) -> None:
    """LAMB: Adam's ``u = m̂ / (sqrt(v̂) + eps) + wd p``; ``p -= lr · (‖p‖ / ‖u‖) · u`` (ratio 1 if either norm is 0)."""
    lr, b1, b2, e, wd = f32(lr), f32(beta1), f32(beta2), f32(eps), f32(weight_decay)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        master = masters[i] if masters is not None else None
        w = _weight(p, master)
        g = _grad(grads[i], -1.0 if maximize else 1.0, gmul)
        t = float(steps[i])
        m = _acc(exp_avgs[i])
        m = m + _one_minus(b1) * (g - m)
        v = b2 * _acc(exp_avg_sqs[i]) + _one_minus(b2) * g * g
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        m, v = _acc(exp_avgs[i]), _acc(exp_avg_sqs[i])  # as stored: what the kernel's stage 2 reads
        bc1 = f32(1.0 - b1**t) if bias_correction else 1.0
        bc2 = f32(1.0 - b2**t) if bias_correction else 1.0
        u = (m / bc1) / ((v / bc2).sqrt() + e) + wd * w
        wn, un = float(w.double().norm()), float(u.double().norm())
        r = f32(wn / un) if wn > 0 and un > 0 else 1.0
        _store_weight(p, master, w - (lr * r) * u)
