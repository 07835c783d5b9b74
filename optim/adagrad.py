"""Adagrad on the multi-tensor engine (kernels: raw_kernels/adagrad.cu)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _reference as ref
from cukit.optim._base import _Plan
from cukit.optim._kernels import ADAGRAD
from cukit.optim._spec import Spec, SpecOptimizer

if TYPE_CHECKING:
    from cukit.optim._base import EngineOptions
    from typing_extensions import Unpack

__all__ = ["ADAGRAD_SPEC", "Adagrad"]


def _reference(spec: Spec, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
    ref.adagrad(
        plan.params,
        plan.grads,
        plan.states["sum"],
        steps,
        plan.masters,
        lr=float(group["lr"]),
        lr_decay=group["lr_decay"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        gmul=gmul,
    )


ADAGRAD_SPEC = Spec(
    name="Adagrad",
    module=ADAGRAD,
    kernel="adagrad_step<{P}, {S}, {M}>",
    rules={
        **chk.TORCH_FLAGS,
        "lr": chk.LR,
        "lr_decay": chk.NON_NEGATIVE,
        "weight_decay": chk.NON_NEGATIVE,
        "initial_accumulator_value": chk.NON_NEGATIVE,
        "eps": chk.NON_NEGATIVE,
    },
    states=lambda g: ("sum",),
    hp=lambda g: (float(g["lr_decay"]), float(g["weight_decay"]), float(g["eps"]), -1.0 if g["maximize"] else 1.0),
    initial_value=lambda g: float(g["initial_accumulator_value"]),
    counter="steps",
    reference=_reference,
)


class Adagrad(SpecOptimizer):
    """Adagrad, fused over every tensor in one launch:
    ``g += wd p; sum += g²; p -= lr / (1 + (t-1) lr_decay) · g / (sqrt(sum) + eps)``.

    Arguments and state (``step``, ``sum``, created in the constructor as torch does) are torch's;
    the keyword-only cukit options are described in :class:`cukit.optim.MultiTensorOptimizer`.

    See also: ``torch.optim.Adagrad(fused=True)``.
    """

    spec = ADAGRAD_SPEC

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **options: Unpack[EngineOptions],
    ) -> None:
        defaults = self._defaults(
            dict(
                lr=lr,
                lr_decay=lr_decay,
                weight_decay=weight_decay,
                initial_accumulator_value=initial_accumulator_value,
                eps=eps,
                foreach=foreach,
                maximize=maximize,
                differentiable=differentiable,
                fused=fused,
            )
        )
        super().__init__(params, defaults, **options)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                sdt = self._state_dtype or p.dtype
                st["sum"] = self._new_state(p, "sum", group, sdt)
