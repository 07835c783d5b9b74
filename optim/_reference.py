"""Plain-torch references with the kernels' maths: the CPU fallback of cukit.optim and the oracle of
its tests. Each function updates whole lists with torch's ``_foreach_*`` ops, one call per
operation for all the tensors, as torch.optim's foreach path: the number of torch calls per step
does not grow with the number of tensors. That matters beyond the calls' own cost: every torch
call releases the GIL, and while other Python threads are busy, retaking it can wait for the
interpreter's switch interval (longer still when the op started an OpenMP team that has to wait
for a core).

The numbers are the kernels': the update runs in float32 (float64 for float64 tensors) from the
stored values and is rounded once to each storage dtype; tensors already in that dtype are updated
in place, others through float copies. Hyperparameters are rounded to the accumulation dtype as the
kernels round them (``load_shared<A>`` in multi_tensor.cuh): to float32 for every dtype but float64,
whose updates use them exactly; constants derived from them (bias corrections, ``1 - b``,
``1 - lr·wd``) are computed in float64 and rounded to the tensor's dtype by the op, as the kernels
compute them in double and cast. The formulas are the kernels', operation by operation, except
where one foreach op fuses two (``lerp``, ``addcmul``, ``addcdiv``): there the rounding may differ in
the last bit (the kernels contract into FMAs too). float64 lists follow torch's single-tensor
formulas where the order of operations differs (``lerp`` at every weight), so they
agree with torch.optim's ``foreach=False`` path to float64 rounding. Steps are counted by the caller
before the update (as the kernels' mt_count_step). Zero-size tensors are skipped.

See also: torch/optim/adam.py ``_multi_tensor_adam``, sgd.py ``_multi_tensor_sgd``,
adagrad.py ``_multi_tensor_adagrad``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["adagrad", "adam", "lamb", "lion", "sgd"]

Tensor = torch.Tensor
Acc = torch.dtype | list[torch.dtype]  # one accumulation dtype for a list, or one per tensor
_FLOAT = struct.Struct("f")


def f32(x: float | Tensor) -> float:
    """A hyperparameter as a float32 launch sees it: rounded to float32 (inf beyond its range)."""
    x = float(x)
    try:
        return _FLOAT.unpack(_FLOAT.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _exact(x: float | Tensor) -> float:
    """A hyperparameter as a float64 launch sees it: unrounded."""
    return float(x)


def _rounding(acc: Acc) -> Callable[[float | Tensor], float]:
    """How the hyperparameters of a list accumulating in `acc` are rounded: not at all for float64
    (:func:`_exact`), else to float32 (:func:`f32`). Mixed lists (never the optimizers' plans) take
    float32."""
    return _exact if acc is torch.float64 else f32


def _acc(params: Sequence[Tensor]) -> Acc:
    """The accumulation dtype of the params (float64 for float64, else float32): one dtype when they
    all agree (the optimizers' plans always do), else one per tensor."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) == 1:
        return torch.float64 if torch.float64 in dtypes else torch.float32
    return [torch.float64 if p.dtype == torch.float64 else torch.float32 for p in params]


def _nonempty(lists: list[Any]) -> list[Any]:
    """The lists (None allowed) without the entries of zero-size tensors; lists[0] holds the params."""
    params = lists[0]
    keep = [i for i, p in enumerate(params) if p.numel()]
    if len(keep) == len(params):
        return lists
    return [None if x is None else [x[i] for i in keep] for x in lists]


def _work(ts: Sequence[Tensor], acc: Acc) -> list[Tensor]:
    """`ts` in the accumulation dtype: the list itself when every tensor has it (updated in place),
    else float copies where needed (written back by :func:`_store`)."""
    if isinstance(acc, torch.dtype):
        if all(t.dtype == acc for t in ts):
            return ts if isinstance(ts, list) else list(ts)
        return [t if t.dtype == acc else t.to(acc) for t in ts]
    return [t if t.dtype == a else t.to(a) for t, a in zip(ts, acc, strict=True)]


def _store(dst: Sequence[Tensor], work: Sequence[Tensor]) -> None:
    """Round the work list to storage where it holds copies."""
    if work is dst:
        return
    pairs = [(d, w) for d, w in zip(dst, work, strict=True) if d is not w]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [w for _, w in pairs])


def _weights(params: Sequence[Tensor], masters: Sequence[Tensor | None] | None, acc: Acc) -> list[Tensor]:
    if masters is None:
        return _work(params, acc)
    return _work([p if m is None else m for p, m in zip(params, masters, strict=True)], acc)


def _store_weights(params: Sequence[Tensor], masters: Sequence[Tensor | None] | None, w: list[Tensor]) -> None:
    if masters is not None:
        _store([p if m is None else m for p, m in zip(params, masters, strict=True)], w)
    _store(params, w)


def _grads(grads: Sequence[Tensor], acc: Acc, sign: float, gmul: Tensor | None) -> tuple[list[Tensor], bool]:
    """``sign · grad · gmul`` in the accumulation dtype, and whether the list is ours to modify in
    place (False: it holds some of the caller's gradients themselves)."""
    g = _work(grads, acc)
    owned = g is not grads and all(a is not b for a, b in zip(g, grads, strict=True))
    if sign != 1.0:
        if owned:
            torch._foreach_mul_(g, sign)
        else:
            g, owned = list(torch._foreach_mul(g, sign)), True
    if gmul is not None:
        by: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for t in g:
            if (t.device, t.dtype) not in by:
                by[(t.device, t.dtype)] = gmul.to(device=t.device, dtype=t.dtype)
        if len(by) == 1:
            ((_, m),) = by.items()
            if owned:
                torch._foreach_mul_(g, m)
            else:
                g, owned = list(torch._foreach_mul(g, m)), True
        else:
            g, owned = [t * by[(t.device, t.dtype)] for t in g], True
    return g, owned


def _add_scaled(g: list[Tensor], owned: bool, x: list[Tensor], alpha: float) -> list[Tensor]:
    """``g + alpha · x`` (in place when `owned`)."""
    if owned:
        torch._foreach_add_(g, x, alpha=alpha)
        return g
    return list(torch._foreach_add(g, x, alpha=alpha))


def _ema_(m: list[Tensor], g: list[Tensor], b: float, acc: Acc) -> None:
    """``m += (1-b)(g - m)``. lerp evaluates this formula for weights below 0.5 but ``g - (g - m) b``
    above, so larger weights take two ops that keep the kernels' formula; float64 lists take lerp at
    every weight, as torch's single-tensor Adam does."""
    w = 1.0 - b
    if w < 0.5 or acc is torch.float64:
        torch._foreach_lerp_(m, g, w)
    else:
        torch._foreach_add_(m, torch._foreach_sub(g, m), alpha=w)


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
    """Adam / AdamW: ``m += (1-b1)(g-m); v = b2 v + (1-b2) g²; p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)``
    with ``g += wd p`` (Adam) or ``p *= 1 - lr wd`` first (AdamW: `decoupled`). Lists of float16,
    bfloat16, float32 or float64 tensors; `steps`: each tensor's step number, this step counted."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters = _nonempty(
        [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters]
    )
    if not params:
        return
    acc = _acc(params)
    r = _rounding(acc)
    b1, b2, e, wd, lr = r(beta1), r(beta2), r(eps), r(weight_decay), r(lr)
    w = _weights(params, masters, acc)
    g, owned = _grads(grads, acc, -1.0 if maximize else 1.0, gmul)
    if decoupled:
        if wd != 0.0:
            torch._foreach_mul_(w, 1.0 - lr * wd)
    elif wd != 0.0:
        g, owned = _add_scaled(g, owned, w, wd), True
    m, v = _work(exp_avgs, acc), _work(exp_avg_sqs, acc)
    _ema_(m, g, b1, acc)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - b2)
    vk = v
    if max_exp_avg_sqs is not None:
        vk = _work(max_exp_avg_sqs, acc)
        torch._foreach_maximum_(vk, v)
        _store(max_exp_avg_sqs, vk)
    denom = torch._foreach_sqrt(vk)
    torch._foreach_div_(denom, [math.sqrt(1.0 - b2**t) for t in steps])
    torch._foreach_add_(denom, e)
    torch._foreach_addcdiv_(w, m, denom, [-lr / (1.0 - b1**t) for t in steps])
    _store(exp_avgs, m)
    _store(exp_avg_sqs, v)
    _store_weights(params, masters, w)


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
    """SGD: ``g += wd p; buf = g (first step) or momentum buf + (1-dampening) g; p -= lr (nesterov ? g + momentum buf : buf)``.
    Lists of float16, bfloat16, float32 or float64 tensors; `first`: whether each buffer is new."""
    params, grads, momentum_buffers, first, masters = _nonempty([params, grads, momentum_buffers, first, masters])
    if not params:
        return
    acc = _acc(params)
    r = _rounding(acc)
    lr, mom, wd = r(lr), r(momentum), r(weight_decay)
    w = _weights(params, masters, acc)
    g, owned = _grads(grads, acc, -1.0 if maximize else 1.0, gmul)
    if wd != 0.0:
        g, owned = _add_scaled(g, owned, w, wd), True
    if momentum_buffers is not None:
        assert first is not None
        b = _work(momentum_buffers, acc)
        new = [i for i, f in enumerate(first) if f]
        old = [i for i, f in enumerate(first) if not f] if new else list(range(len(b)))
        if new:
            torch._foreach_copy_([b[i] for i in new], [g[i] for i in new])
        if old:
            bo, go = ([b[i] for i in old], [g[i] for i in old]) if new else (b, g)
            torch._foreach_mul_(bo, mom)
            torch._foreach_add_(bo, go, alpha=1.0 - r(dampening))
        _store(momentum_buffers, b)
        g = _add_scaled(g, owned, b, mom) if nesterov else b
    torch._foreach_add_(w, g, alpha=-lr)
    _store_weights(params, masters, w)


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
    """Lion: ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g); m = b2 m + (1-b2) g``. Lists of float16,
    bfloat16, float32 or float64 tensors."""
    params, grads, exp_avgs, masters = _nonempty([params, grads, exp_avgs, masters])
    if not params:
        return
    acc = _acc(params)
    r = _rounding(acc)
    lr, b1, b2, wd = r(lr), r(beta1), r(beta2), r(weight_decay)
    w = _weights(params, masters, acc)
    g, _ = _grads(grads, acc, -1.0 if maximize else 1.0, gmul)
    m = _work(exp_avgs, acc)
    u = torch._foreach_mul(m, b1)
    torch._foreach_add_(u, g, alpha=1.0 - b1)
    torch._foreach_sign_(u)
    if wd != 0.0:
        torch._foreach_mul_(w, 1.0 - lr * wd)
    torch._foreach_add_(w, u, alpha=-lr)
    torch._foreach_mul_(m, b2)
    torch._foreach_add_(m, g, alpha=1.0 - b2)
    _store(exp_avgs, m)
    _store_weights(params, masters, w)


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
    """Adagrad: ``g += wd p; sum += g²; p -= lr / (1 + (t-1) lr_decay) · g / (sqrt(sum) + eps)``. Lists
    of float16, bfloat16, float32 or float64 tensors; `steps`: each tensor's step, this one counted."""
    params, grads, state_sums, steps, masters = _nonempty([params, grads, state_sums, steps, masters])
    if not params:
        return
    acc = _acc(params)
    r = _rounding(acc)
    lr, wd, e, decay = r(lr), r(weight_decay), r(eps), r(lr_decay)
    w = _weights(params, masters, acc)
    g, owned = _grads(grads, acc, -1.0 if maximize else 1.0, gmul)
    if wd != 0.0:
        g, owned = _add_scaled(g, owned, w, wd), True
    s = _work(state_sums, acc)
    torch._foreach_addcmul_(s, g, g)
    std = torch._foreach_sqrt(s)
    torch._foreach_add_(std, e)
    torch._foreach_addcdiv_(w, g, std, [-lr / (1.0 + (float(t) - 1.0) * decay) for t in steps])
    _store(state_sums, s)
    _store_weights(params, masters, w)


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
    """LAMB: Adam's ``u = m̂ / (sqrt(v̂) + eps) + wd p``; ``p -= lr · (‖p‖ / ‖u‖) · u`` (ratio 1 if either
    norm is 0). Norms in the accumulation dtype (the kernels sum squares in float32, float64 for
    float64 tensors), the ratio rounded to float32 except for float64 tensors (as the kernels' stage
    2 reads it). Lists of float16, bfloat16, float32 or float64 tensors; `steps`: each tensor's step,
    this one counted."""
    params, grads, exp_avgs, exp_avg_sqs, steps, masters = _nonempty(
        [params, grads, exp_avgs, exp_avg_sqs, steps, masters]
    )
    if not params:
        return
    acc = _acc(params)
    r = _rounding(acc)
    lr, b1, b2, e, wd = r(lr), r(beta1), r(beta2), r(eps), r(weight_decay)
    w = _weights(params, masters, acc)
    g, _ = _grads(grads, acc, -1.0 if maximize else 1.0, gmul)
    m, v = _work(exp_avgs, acc), _work(exp_avg_sqs, acc)
    _ema_(m, g, b1, acc)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, value=1.0 - b2)
    _store(exp_avgs, m)
    _store(exp_avg_sqs, v)
    # stage 2 of the kernels reads the moments as stored
    m, v = _work(exp_avgs, acc), _work(exp_avg_sqs, acc)
    if bias_correction:
        u = torch._foreach_div(m, [1.0 - b1**t for t in steps])
        d = torch._foreach_div(v, [1.0 - b2**t for t in steps])
    else:
        u, d = torch._foreach_mul(m, 1.0), torch._foreach_mul(v, 1.0)
    torch._foreach_sqrt_(d)
    torch._foreach_add_(d, e)
    torch._foreach_div_(u, d)
    if wd != 0.0:
        torch._foreach_add_(u, w, alpha=wd)
    wn = torch.stack(torch._foreach_norm(w)).double()
    un = torch.stack(torch._foreach_norm(u)).double()
    ratio = torch.where((wn > 0) & (un > 0), wn / un, 1.0)
    if acc is not torch.float64:
        ratio = ratio.float()  # lr · ratio below: products of two float32 values
    coef = [lr * q for q in ratio.tolist()]
    torch._foreach_mul_(u, coef)
    torch._foreach_sub_(w, u)
    _store_weights(params, masters, w)
