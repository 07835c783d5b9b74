"""Lion on the multi-tensor engine (kernels: raw_kernels/lion.cu)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _reference as ref
from cukit.optim._base import _Plan
from cukit.optim._kernels import LION
from cukit.optim._spec import Spec, SpecOptimizer

if TYPE_CHECKING:
    from cukit.optim._base import EngineOptions
    from typing_extensions import Unpack

__all__ = ["LION_SPEC", "Lion"]


def _reference(spec: Spec, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
    b1, b2 = group["betas"]
    ref.lion(plan.params, plan.grads, plan.states["exp_avg"], plan.masters, lr=float(group["lr"]),
             beta1=float(b1), beta2=float(b2), weight_decay=group["weight_decay"], maximize=group["maximize"],
             gmul=gmul)


LION_SPEC = Spec(
    name="Lion",
    module=LION,
    kernel="lion_step<{P}, {S}, {M}>",
    rules={
        "lr": chk.LR,
        "betas": chk.betas(high_open=False),  # lion-pytorch allows 1
        "weight_decay": chk.NON_NEGATIVE,
        "maximize": chk.FLAG,
    },
    states=lambda group: ("exp_avg",),
    hp=lambda g: (float(g["betas"][0]), float(g["betas"][1]), float(g["weight_decay"]), -1.0 if g["maximize"] else 1.0),
    reference=_reference,
    qstates=(("exp_avg", True),),  # Lion8bit
    qkernel="lion_qstep<{P}, {bits}, {mode}>",
)


class Lion(SpecOptimizer):
    """Lion (Chen et al. 2023), fused over every tensor in one launch:
    ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g); m = b2 m + (1-b2) g``. State: ``exp_avg``.

    torch has no Lion; the arguments follow lion-pytorch (lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0). The keyword-only cukit options are described in
    :class:`cukit.optim.MultiTensorOptimizer`.

    See also: ``lion_pytorch.Lion``.
    """

    spec = LION_SPEC

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **options: Unpack[EngineOptions],
    ) -> None:
        defaults = self._defaults(dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))
        super().__init__(params, defaults, **options)
