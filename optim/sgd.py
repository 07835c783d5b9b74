"""SGD with momentum on the multi-tensor engine (kernels: raw_kernels/sgd.cu)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim import _reference as ref
from cukit.optim._base import _Plan
from cukit.optim._kernels import SGD as SGD_KERNELS
from cukit.optim._spec import Spec, SpecOptimizer

if TYPE_CHECKING:
    from cukit.optim._base import EngineOptions
    from typing_extensions import Unpack

__all__ = ["SGD", "SGD_SPEC"]


def _reference(spec: Spec, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
    momentum = group["momentum"] != 0
    ref.sgd(
        plan.params,
        plan.grads,
        plan.states.get("momentum_buffer") if momentum else None,
        plan.scratch["first"],
        plan.masters,
        lr=float(group["lr"]),
        momentum=group["momentum"],
        dampening=group["dampening"],
        weight_decay=group["weight_decay"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        gmul=gmul,
    )


def _counts(spec: Spec, plan: _Plan, common: dict[str, Any]) -> tuple[Any, ...]:
    """The kernel's per-tensor count of steps taken with each momentum buffer (its first step sets
    buf = g), counted on the device until a step that cannot be skipped has run (then every buffer
    exists and the kernel gets null)."""
    momentum = plan.variant[0]
    if momentum and "counts" not in plan.scratch:
        fresh = plan.scratch["fresh"]
        plan.scratch["counts"] = torch.where(fresh, 0.0, 2.0).to(device=plan.params[0].device, dtype=torch.float32)
        plan.scratch["pending"] = bool(fresh.any())
    if not (momentum and plan.scratch["pending"]):
        return (None,)
    counts = plan.scratch["counts"]
    eng.launch_count(spec.module, counts, common["skip"])
    if common["skip"] is None:
        plan.scratch["pending"] = False  # this step ran: the next ones find every buffer
    return (counts,)


def _check(group: Mapping[str, Any], owner: str) -> None:
    if group.get("nesterov") and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            f"{owner}: nesterov=True needs momentum > 0 and dampening == 0 (Nesterov momentum); "
            f"got momentum={group['momentum']!r}, dampening={group['dampening']!r}"
        )


SGD_SPEC = Spec(
    name="SGD",
    module=SGD_KERNELS,
    kernel="sgd_step<{P}, {S}, {momentum}, {M}>",
    rules={
        **chk.TORCH_FLAGS,
        "lr": chk.LR,
        "momentum": chk.NON_NEGATIVE,
        "dampening": chk.REAL,
        "weight_decay": chk.number(tensor=True),
        "nesterov": chk.FLAG,
    },
    states=lambda g: ("momentum_buffer",) if g["momentum"] != 0 else (),
    hp=lambda g: (float(g["momentum"]), float(g["dampening"]), float(g["weight_decay"]),
                  -1.0 if g["maximize"] else 1.0, 1.0 if g["nesterov"] else 0.0),
    variant=lambda g: (g["momentum"] != 0,),
    variant_names=("momentum",),
    extra=_counts,
    check=_check,
    reference=_reference,
    qstates=(("momentum_buffer", True),),  # SGD8bit
    qkernel="sgd_qstep<{P}, {bits}, {mode}>",
)


class SGD(SpecOptimizer):
    """SGD, fused over every tensor in one launch: ``g += wd p``;
    ``buf = g`` on the first step, else ``momentum buf + (1-dampening) g``;
    ``p -= lr (nesterov ? g + momentum buf : buf)`` (``p -= lr g`` without momentum).

    Arguments and state (``momentum_buffer`` when momentum != 0) are torch's; the keyword-only
    cukit options are described in :class:`cukit.optim.MultiTensorOptimizer`.

    See also: ``torch.optim.SGD(fused=True)``.
    """

    spec = SGD_SPEC

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        **options: Unpack[EngineOptions],
    ) -> None:
        defaults = self._defaults(
            dict(
                lr=lr,
                momentum=momentum,
                dampening=dampening,
                weight_decay=weight_decay,
                nesterov=nesterov,
                maximize=maximize,
                foreach=foreach,
                differentiable=differentiable,
                fused=fused,
            )
        )
        super().__init__(params, defaults, **options)
