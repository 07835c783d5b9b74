"""Functional forms of cukit.optim's optimizers: one step over lists of tensors (torch or CuPy) that
the caller owns, like ``torch.optim.adamw.adamw``. A thin layer over the optimizer classes: the
lists are adopted as the state of a cached optimizer keyed by their pointers, so a loop that calls
the same function on the same tensors builds the device tables once.

Step counts (``state_steps``) are float32 0-dim tensors (or CuPy arrays), incremented in place (as
torch's). CuPy arrays are viewed as torch tensors (DLPack, zero copy) and updated in place; the step
then runs on CuPy's current stream, so it is ordered with the caller's CuPy work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from cukit.optim.utils import is_cupy, on_cupy_stream

import cukit

__all__ = ["adagrad", "adam", "adamw", "lamb", "lion", "sgd"]

Tensor = torch.Tensor
_CACHE: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_CACHE_SIZE = 8


def _torch_list(xs: Sequence[Any] | None, what: str) -> list[Tensor] | None:
    if xs is None:
        return None
    out = []
    for i, x in enumerate(xs):
        if isinstance(x, Tensor):
            out.append(x)
        elif is_cupy(x):
            out.append(cukit.to_torch(x))
        else:
            raise TypeError(f"{what}[{i}] must be a torch.Tensor or cupy.ndarray; got {type(x).__qualname__}")
    return out


def _run(
    cls: type,
    params: Sequence[Any],
    grads: Sequence[Any],
    states: dict[str, Sequence[Any] | None],
    steps: Sequence[Any] | None,
    hyper: dict[str, Any],
    opts: dict[str, Any],
) -> None:
    everything = [*params, *grads, *(x for v in states.values() if v is not None for x in v), *(steps or ())]
    with on_cupy_stream(everything):
        _step(cls, params, grads, states, steps, hyper, opts)


def _step(
    cls: type,
    params: Sequence[Any],
    grads: Sequence[Any],
    states: dict[str, Sequence[Any] | None],
    steps_in: Sequence[Any] | None,
    hyper: dict[str, Any],
    opts: dict[str, Any],
) -> None:
    ps = _torch_list(params, "params")
    gs = _torch_list(grads, "grads")
    steps = _torch_list(steps_in, "state_steps")
    assert ps is not None and gs is not None
    if len(ps) != len(gs):
        raise ValueError(f"params and grads must have the same length; got {len(ps)} and {len(gs)}")
    st = {k: _torch_list(v, k) for k, v in states.items()}
    for k, v in st.items():
        if v is not None and len(v) != len(ps):
            raise ValueError(f"{k} must have one tensor per param; got {len(v)} for {len(ps)}")
    if steps is not None and len(steps) != len(ps):
        raise ValueError(f"state_steps must have one tensor per param; got {len(steps)} for {len(ps)}")
    if not ps:
        return
    # The tensors are wrapped as leaves sharing storage, so the optimizer's pointers are the caller's.
    key = (
        cls,
        *(p.data_ptr() for p in ps),
        *(g.data_ptr() for g in gs),
        *(t.data_ptr() for v in st.values() if v is not None for t in v),
        tuple(sorted(opts.items())),
    )
    entry = _CACHE.get(key)
    created = entry is None
    if entry is None:
        leaves = [
            torch.nn.Parameter(p.detach(), requires_grad=True) if p.requires_grad is False else p for p in ps
        ]
        opt = cls(leaves, **hyper, **opts)
        entry = (opt, leaves)
        _CACHE[key] = entry
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    opt, leaves = entry
    if not created:  # the constructor checked the first call's
        opt._check_args(hyper)
    group = opt.param_groups[0]
    group.update(hyper)
    for i, p in enumerate(leaves):
        p.grad = gs[i]
        s = opt.state[p]
        for k, v in st.items():
            if v is not None:
                s[k] = v[i]
        # a fresh optimizer takes the caller's step counts, also where its constructor made its
        # own (Adagrad creates state eagerly, as torch's does)
        if steps is not None and ("step" not in s or created):
            s["step"] = steps[i]
    opt.step()
    if steps is not None:
        # the optimizer keeps its step counts on the device; hand the new values back
        new = [opt.state[p]["step"] for p in leaves]
        with torch.no_grad():
            for dst, src in zip(steps, new, strict=True):
                if dst is not src:
                    dst.copy_(src)
                    opt.state[leaves[new.index(src)]]["step"] = src


def _run_adam(
    cls: type,
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    max_exp_avg_sqs: Sequence[Any] | None,
    state_steps: Sequence[Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    max_grad_norm: float | None,
) -> None:
    # adam and adamw differ only in the class (coupled vs decoupled weight decay) and defaults
    _run(
        cls,
        params,
        grads,
        {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs, "max_exp_avg_sq": max_exp_avg_sqs},
        state_steps,
        dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize),
        {"max_grad_norm": max_grad_norm},
    )


def adam(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    max_exp_avg_sqs: Sequence[Any] | None = None,
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Adam step over lists of tensors; see :class:`cukit.optim.Adam` for the maths.

    See also: ``torch.optim.adam.adam``.
    """
    from cukit.optim.adam import Adam

    _run_adam(Adam, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, (beta1, beta2),
              eps, weight_decay, amsgrad, maximize, max_grad_norm)


def adamw(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    max_exp_avg_sqs: Sequence[Any] | None = None,
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One AdamW step over lists of tensors; see :class:`cukit.optim.AdamW` for the maths.

    See also: ``torch.optim.adamw.adamw``.
    """
    from cukit.optim.adam import AdamW

    _run_adam(AdamW, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, (beta1, beta2),
              eps, weight_decay, amsgrad, maximize, max_grad_norm)


def sgd(
    params: Sequence[Any],
    grads: Sequence[Any],
    momentum_buffers: Sequence[Any] | None = None,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One SGD step; `momentum_buffers` (required when momentum != 0) are used as they are (no
    first-step initialisation: pass ``grads[i].clone()`` buffers with momentum 0 semantics, or zeros).

    See also: ``torch.optim.sgd.sgd``.
    """
    from cukit.optim.sgd import SGD

    if momentum != 0 and momentum_buffers is None:
        raise ValueError("momentum_buffers are required when momentum != 0")
    _run(
        SGD,
        params,
        grads,
        {"momentum_buffer": momentum_buffers if momentum != 0 else None},
        None,
        dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        ),
        {"max_grad_norm": max_grad_norm},
    )


def lion(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    *,
    lr: float = 1e-4,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Lion step over lists of tensors; see :class:`cukit.optim.Lion`.

    See also: ``lion_pytorch.Lion``.
    """
    from cukit.optim.lion import Lion

    _run(
        Lion,
        params,
        grads,
        {"exp_avg": exp_avgs},
        None,
        dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay, maximize=maximize),
        {"max_grad_norm": max_grad_norm},
    )


def adagrad(
    params: Sequence[Any],
    grads: Sequence[Any],
    state_sums: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    lr: float = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Adagrad step over lists of tensors; see :class:`cukit.optim.Adagrad`.

    See also: ``torch.optim.adagrad.adagrad``.
    """
    from cukit.optim.adagrad import Adagrad

    _run(
        Adagrad,
        params,
        grads,
        {"sum": state_sums},
        state_steps,
        dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize),
        {"max_grad_norm": max_grad_norm},
    )


def lamb(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One LAMB step over lists of tensors; see :class:`cukit.optim.LAMB`."""
    from cukit.optim.lamb import LAMB

    _run(
        LAMB,
        params,
        grads,
        {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs},
        state_steps,
        dict(
            lr=lr,
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            maximize=maximize,
        ),
        {"max_grad_norm": max_grad_norm},
    )
