"""Functional forms of cukit.optim's optimizers: one step over lists of tensors (torch or CuPy) that
the caller owns, like ``torch.optim.adamw.adamw``.

Each form is its optimizer's spec (``optim/_spec.py``) applied to the caller's lists: the lists
are grouped into launches (one per device and dtype pair), each launch's device table is built once
and cached by the tensors' addresses, sizes and dtypes, and :func:`cukit.optim._spec.step`, the
same step the optimizer classes run on their cached plans, launches one kernel per launch. Without
a GPU (or for CPU tensors) the spec's plain-torch reference runs instead.

Step counts (``state_steps``) are float32 0-dim tensors (or CuPy arrays), incremented in place as
torch's are; the kernels count in one device vector per launch, filled from them before the step
and copied back after it (one foreach copy each way when they live on the launch's device). State
lists are used as they are: an SGD momentum buffer is never initialised from the gradient (pass
zeros, or ``grads[i].clone()`` for torch's first-step behaviour). CuPy arrays are viewed as torch
tensors (DLPack, zero copy) and updated in place; the step then runs on CuPy's current stream, so
it is ordered with the caller's CuPy work.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim._base import _OnDevice, _Plan, clip_coefficients, values
from cukit.optim._kernels import COMBOS
from cukit.optim._spec import Spec, check_group, step
from cukit.optim.adagrad import ADAGRAD_SPEC
from cukit.optim.adam import ADAM_SPEC, ADAMW_SPEC
from cukit.optim.lamb import LAMB_SPEC
from cukit.optim.lion import LION_SPEC
from cukit.optim.sgd import SGD_SPEC
from cukit.optim.utils import is_cupy, on_cupy_stream

import cukit

__all__ = ["adagrad", "adam", "adamw", "lamb", "lion", "sgd"]

Tensor = torch.Tensor
_CACHE: OrderedDict[tuple[Any, ...], _Launches] = OrderedDict()
_CACHE_SIZE = 8
_MAX_GRAD_NORM = chk.number(low_open=True, none="no clipping")


def _torch_list(xs: Sequence[Any], what: str, fn: str) -> list[Tensor]:
    if isinstance(xs, (Tensor, str)) or not isinstance(xs, Sequence):
        raise TypeError(f"{fn}: {what} must be a list of tensors; got {type(xs).__qualname__}")
    out = []
    for i, x in enumerate(xs):
        if isinstance(x, Tensor):
            out.append(x)
        elif is_cupy(x):
            out.append(cukit.to_torch(x))
        else:
            raise TypeError(f"{fn}: {what}[{i}] must be a torch.Tensor or cupy.ndarray; got {type(x).__qualname__}")
    return out


def _signature(t: Tensor) -> tuple[Any, ...]:
    # what a cached device table depends on: a freed and reallocated tensor at the same address
    # with another size, dtype or layout builds a new one
    return (t.data_ptr(), t.numel(), t.dtype, t.device, t.is_contiguous())


class _Launches:
    """The cached launches of one list-level call: plans (lists and device tables), the callers'
    step tensors of each plan, and the prepared clipping norms."""

    def __init__(self, plans: list[_Plan], steps: list[list[Tensor]], kernels: bool) -> None:
        self.plans = plans
        self.steps = steps
        self.kernels = kernels
        self.norms: dict[int, dict[str, Any]] | None = None


def _build(
    spec: Spec,
    fn: str,
    ps: list[Tensor],
    gs: list[Tensor],
    st: dict[str, list[Tensor]],
    steps: list[Tensor] | None,
    variant: tuple[Any, ...],
) -> _Launches:
    kernels = cukit.is_available() and all(p.is_cuda for p in ps)
    parts: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(ps):
        g = gs[i]
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(
                f"{fn}: grads[{i}] must match params[{i}] (shape {tuple(p.shape)}, {p.dtype}, {p.device}); "
                f"got shape {tuple(g.shape)}, {g.dtype}, {g.device}"
            )
        sdt = p.dtype
        for k, lst in st.items():
            s = lst[i]
            if s.shape != p.shape or s.device != p.device or not s.is_floating_point():
                raise ValueError(
                    f"{fn}: {k}[{i}] must be a floating tensor of params[{i}]'s shape and device "
                    f"({tuple(p.shape)}, {p.device}); got shape {tuple(s.shape)}, {s.dtype}, {s.device}"
                )
            if k == next(iter(st)):
                sdt = s.dtype
            elif s.dtype != sdt:
                raise TypeError(f"{fn}: the states of params[{i}] must share one dtype; got {sdt} and {s.dtype}")
        if steps is not None and (steps[i].numel() != 1 or not steps[i].is_floating_point()):
            raise ValueError(f"{fn}: state_steps[{i}] must be a floating scalar tensor; got {tuple(steps[i].shape)} {steps[i].dtype}")
        if kernels:
            pname, sname = str(p.dtype).removeprefix("torch."), str(sdt).removeprefix("torch.")
            if (pname, sname, False) not in COMBOS:
                raise TypeError(
                    f"{fn}: params of dtype {pname} with states of dtype {sname} are not supported; "
                    f"supported (param, state): {sorted({(a, b) for a, b, _ in COMBOS})}"
                )
            for what, t in (("params", p), ("grads", g), *((k, v[i]) for k, v in st.items())):
                if not t.is_contiguous():
                    raise ValueError(f"{fn}: {what}[{i}] is not contiguous (shape {tuple(t.shape)})")
        parts.setdefault((p.device, p.dtype, sdt), []).append(i)
    plans, plan_steps = [], []
    for (device, pdt, sdt), idx in parts.items():
        plan = _Plan(
            [0],
            [ps[i] for i in idx],
            [gs[i] for i in idx],
            {k: [v[i] for i in idx] for k, v in st.items()},
            None,
            str(pdt).removeprefix("torch."),
            str(sdt).removeprefix("torch."),
            variant,
        )
        plan.member_gids = [0] * len(idx)
        plan.scratch["fresh"] = torch.zeros(len(idx), dtype=torch.bool)  # the caller's states exist
        plan.scratch["first"] = [False] * len(idx)
        src = [steps[i] for i in idx] if steps is not None else []
        if kernels:
            lists = [plan.params, plan.grads, *plan.states.values()]
            plan.table = eng.TensorTable(lists, [0] * len(idx))  # type: ignore[arg-type]
            if spec.counter == "steps":
                plan.steps = torch.zeros(len(idx), dtype=torch.float32, device=device)
                plan.scratch["views"] = list(plan.steps.unbind(0))
        plans.append(plan)
        plan_steps.append(src)
    return _Launches(plans, plan_steps, kernels)


def run(
    spec: Spec,
    params: Sequence[Any],
    grads: Sequence[Any],
    states: dict[str, Sequence[Any] | None],
    state_steps: Sequence[Any] | None,
    hyper: dict[str, Any],
    max_grad_norm: float | None,
) -> None:
    """One step of `spec` over the caller's lists (errors name ``spec.name``): `states`
    by the spec's state names (None where the group has no such state), `hyper` a param group
    without its params."""
    everything = [*params, *grads, *(x for v in states.values() if v is not None for x in v), *(state_steps or ())]
    with on_cupy_stream(everything):
        _run(spec, params, grads, states, state_steps, hyper, max_grad_norm)


def _run(
    spec: Spec,
    params: Sequence[Any],
    grads: Sequence[Any],
    states: dict[str, Sequence[Any] | None],
    state_steps: Sequence[Any] | None,
    hyper: dict[str, Any],
    max_grad_norm: float | None,
) -> None:
    fn = spec.name
    check_group(spec, hyper, fn)
    _MAX_GRAD_NORM(fn, "max_grad_norm", max_grad_norm)
    ps = _torch_list(params, "params", fn)
    gs = _torch_list(grads, "grads", fn)
    if len(ps) != len(gs):
        raise ValueError(f"{fn}: params and grads must have the same length; got {len(ps)} and {len(gs)}")
    st: dict[str, list[Tensor]] = {}
    for k in spec.states(hyper):
        v = states.get(k)
        if v is None:
            raise ValueError(f"{fn}: the {k} lists are required with these arguments; got None")
        st[k] = _torch_list(v, k, fn)
        if len(st[k]) != len(ps):
            raise ValueError(f"{fn}: {k} must have one tensor per param; got {len(st[k])} for {len(ps)}")
    steps: list[Tensor] | None = None
    if spec.counter == "steps":
        if state_steps is None:
            raise ValueError(f"{fn}: state_steps is required; got None")
        steps = _torch_list(state_steps, "state_steps", fn)
        if len(steps) != len(ps):
            raise ValueError(f"{fn}: state_steps must have one tensor per param; got {len(steps)} for {len(ps)}")
    if not ps:
        return
    variant = spec.variant(hyper)
    tensors = [*ps, *gs, *(t for v in st.values() for t in v), *(steps or ())]
    key = (id(spec), variant, tuple(st), *map(_signature, tensors))
    entry = _CACHE.get(key)
    if entry is None:
        entry = _CACHE[key] = _build(spec, fn, ps, gs, st, steps, variant)
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    groups = [hyper]
    with torch.no_grad():
        if not entry.kernels:
            _reference(spec, entry, groups[0], max_grad_norm)
            return
        gmuls: dict[int, Tensor] = {}
        if max_grad_norm is not None:
            if entry.norms is None:
                from cukit.optim import utils

                by: dict[int, list[Tensor]] = {}
                for plan in entry.plans:
                    by.setdefault(plan.table.device, []).extend(plan.grads)  # type: ignore[union-attr]
                entry.norms = {d: utils.prepare_norm(g) for d, g in by.items()}
            gmuls = clip_coefficients(entry.norms, float(max_grad_norm), _OnDevice(None))
        for plan, src in zip(entry.plans, entry.steps, strict=True):
            if plan.steps is not None:
                _copy_steps(plan.scratch["views"], src, plan.steps)
            common = {"grad_div": None, "grad_mul": gmuls.get(plan.table.device), "skip": None}  # type: ignore[union-attr]
            step(spec, plan, groups, common)
            if plan.steps is not None:
                _copy_steps(src, plan.scratch["views"], plan.steps)


def _copy_steps(dst: list[Tensor], src: list[Tensor], vector: Tensor) -> None:
    """Step counts between the caller's tensors and a launch's device vector (`vector`, whose
    0-dim views are ``plan.scratch["views"]``): one foreach copy on one device, else one
    host-device copy of the whole vector."""
    if dst[0].device == src[0].device:
        torch._foreach_copy_(dst, src)
    elif dst[0].device == vector.device:  # into the vector from elsewhere
        vector.copy_(torch.stack([s.reshape(()).to(torch.float32) for s in src]))
    else:  # out of the vector to elsewhere (CPU step tensors)
        torch._foreach_copy_(dst, list(vector.to(dst[0].device).unbind(0)))


def _reference(spec: Spec, entry: _Launches, group: dict[str, Any], max_grad_norm: float | None) -> None:
    gmul: Tensor | None = None
    if max_grad_norm is not None:
        from cukit.optim import utils

        norm = utils.reference_l2norm([g for plan in entry.plans for g in plan.grads])
        gmul = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
    for plan, src in zip(entry.plans, entry.steps, strict=True):
        counts: list[float] = []
        if spec.counter == "steps":
            torch._foreach_add_(src, 1.0)
            counts = values(src)
        spec.reference(spec, group, plan, counts, gmul)


# ---------------------------------------------------------------- the forms
def adam(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    max_exp_avg_sqs: Sequence[Any] | None = None,
    lr: float | Tensor = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Adam step over lists of tensors; see :class:`cukit.optim.Adam` for the maths. Params
    float16, bfloat16, float32 or float64, states of the params' dtype or float32.

    See also: ``torch.optim.adam.adam``.
    """
    run(ADAM_SPEC, params, grads,
        {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs, "max_exp_avg_sq": max_exp_avg_sqs}, state_steps,
        dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize),
        max_grad_norm)


def adamw(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    max_exp_avg_sqs: Sequence[Any] | None = None,
    lr: float | Tensor = 1e-3,
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
    run(ADAMW_SPEC, params, grads,
        {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs, "max_exp_avg_sq": max_exp_avg_sqs}, state_steps,
        dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize),
        max_grad_norm)


def sgd(
    params: Sequence[Any],
    grads: Sequence[Any],
    momentum_buffers: Sequence[Any] | None = None,
    *,
    lr: float | Tensor = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One SGD step; see :class:`cukit.optim.SGD`. `momentum_buffers` (required when momentum != 0)
    are used as they are (no first-step initialisation: pass zeros, or ``grads[i].clone()`` for
    torch's first step).

    See also: ``torch.optim.sgd.sgd``.
    """
    run(SGD_SPEC, params, grads, {"momentum_buffer": momentum_buffers}, None,
        dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
             maximize=maximize),
        max_grad_norm)


def lion(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    *,
    lr: float | Tensor = 1e-4,
    beta1: float = 0.9,
    beta2: float = 0.99,
    weight_decay: float = 0.0,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Lion step over lists of tensors; see :class:`cukit.optim.Lion`.

    See also: ``lion_pytorch.Lion``.
    """
    run(LION_SPEC, params, grads, {"exp_avg": exp_avgs}, None,
        dict(lr=lr, betas=(beta1, beta2), weight_decay=weight_decay, maximize=maximize), max_grad_norm)


def adagrad(
    params: Sequence[Any],
    grads: Sequence[Any],
    state_sums: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    lr: float | Tensor = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One Adagrad step over lists of tensors; see :class:`cukit.optim.Adagrad`.

    See also: ``torch.optim.adagrad.adagrad``.
    """
    run(ADAGRAD_SPEC, params, grads, {"sum": state_sums}, state_steps,
        dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize), max_grad_norm)


def lamb(
    params: Sequence[Any],
    grads: Sequence[Any],
    exp_avgs: Sequence[Any],
    exp_avg_sqs: Sequence[Any],
    state_steps: Sequence[Any],
    *,
    lr: float | Tensor = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    maximize: bool = False,
    max_grad_norm: float | None = None,
) -> None:
    """One LAMB step over lists of tensors; see :class:`cukit.optim.LAMB`."""
    run(LAMB_SPEC, params, grads, {"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs}, state_steps,
        dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
             maximize=maximize),
        max_grad_norm)
