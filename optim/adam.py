"""Adam and AdamW on the multi-tensor engine (kernels: raw_kernels/adam.cu)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _reference as ref
from cukit.optim._base import _Plan
from cukit.optim._kernels import ADAM
from cukit.optim._spec import Spec, SpecOptimizer

if TYPE_CHECKING:
    from cukit.optim._base import EngineOptions
    from typing_extensions import Unpack

__all__ = ["ADAMW_SPEC", "ADAM_SPEC", "Adam", "AdamW"]


def _reference(spec: Spec, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
    b1, b2 = group["betas"]
    ref.adam(
        plan.params,
        plan.grads,
        plan.states["exp_avg"],
        plan.states["exp_avg_sq"],
        plan.states.get("max_exp_avg_sq"),
        steps,
        plan.masters,
        lr=float(group["lr"]),
        beta1=float(b1),
        beta2=float(b2),
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        maximize=group["maximize"],
        decoupled=spec.flags["decoupled"],
        gmul=gmul,
    )


def _hp(group: Mapping[str, Any]) -> tuple[float, ...]:
    b1, b2 = group["betas"]
    return (float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]), -1.0 if group["maximize"] else 1.0)


ADAM_SPEC = Spec(
    name="Adam",
    module=ADAM,
    kernel="adam_step<{P}, {S}, {amsgrad}, {M}, {decoupled}>",
    rules={
        **chk.TORCH_FLAGS,
        "lr": chk.LR,
        "betas": chk.betas(),
        "eps": chk.NON_NEGATIVE,
        "weight_decay": chk.NON_NEGATIVE,
        "amsgrad": chk.FLAG,
        "capturable": chk.FLAG,
        "decoupled_weight_decay": chk.OPTIONAL_FLAG,
    },
    states=lambda g: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if g["amsgrad"] else ("exp_avg", "exp_avg_sq"),
    hp=_hp,
    variant=lambda g: (bool(g["amsgrad"]),),
    variant_names=("amsgrad",),
    flags=MappingProxyType({"decoupled": False}),
    counter="steps",
    reference=_reference,
    qstates=(("exp_avg", True), ("exp_avg_sq", False)),  # Adam8bit, AdamW8bit, AdamW4bit
    qkernel="adam_qstep<{P}, {bits}, {mode}, {decoupled}>",
)
ADAMW_SPEC = ADAM_SPEC.replace(name="AdamW", flags=MappingProxyType({"decoupled": True}))


class Adam(SpecOptimizer):
    """Adam, fused over every tensor in one launch:
    ``m += (1-b1)(g-m); v = b2 v + (1-b2) g²; p -= lr/(1-b1^t) · m / (sqrt(v/(1-b2^t)) + eps)``
    with ``g += wd p`` (L2 penalty; AdamW decays the weights instead).

    Arguments and state (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) are torch's, so
    state_dicts load both ways and LR schedulers work; ``foreach``, ``fused`` and ``capturable``
    are accepted for compatibility (every step is device-side: capturable in a CUDA graph once it
    has run eagerly). ``differentiable=True`` is not supported. The keyword-only ``flat_grads``,
    ``master_weights``, ``state_dtype`` and ``max_grad_norm`` are described in
    :class:`cukit.optim.MultiTensorOptimizer`. Parameters: float16, bfloat16, float32, float64,
    contiguous, on CUDA (any device type with the reference path).

    See also: ``torch.optim.Adam(fused=True)``.
    """

    spec = ADAM_SPEC

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        **options: Unpack[EngineOptions],
    ) -> None:
        defaults = self._defaults(
            dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                amsgrad=amsgrad,
                maximize=maximize,
                foreach=foreach,
                capturable=capturable,
                differentiable=differentiable,
                fused=fused,
                decoupled_weight_decay=decoupled_weight_decay,
            )
        )
        decoupled = self.spec.flags["decoupled"]
        if decoupled_weight_decay is not None and decoupled_weight_decay != decoupled:
            raise ValueError(
                f"{type(self).__name__} has decoupled_weight_decay={decoupled}; use "
                f"cukit.optim.{'AdamW' if decoupled_weight_decay else 'Adam'}"
            )
        defaults["decoupled_weight_decay"] = decoupled
        super().__init__(params, defaults, **options)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self.spec.flags["decoupled"])


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay, ``p *= 1 - lr · wd`` before the Adam update
    (default weight_decay 0.01, as torch). Everything else as :class:`Adam`.

    See also: ``torch.optim.AdamW(fused=True)``.
    """

    spec = ADAMW_SPEC

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
