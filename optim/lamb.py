"""LAMB on the multi-tensor engine (kernels: raw_kernels/lamb.cu)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim import _reference as ref
from cukit.optim._base import _Plan
from cukit.optim._kernels import LAMB as LAMB_KERNELS
from cukit.optim._spec import Spec, SpecOptimizer, launch_args

if TYPE_CHECKING:
    from cukit.optim._base import EngineOptions
    from typing_extensions import Unpack

from cukit.interop import DTYPES, current_stream

__all__ = ["LAMB", "LAMB_SPEC"]


def _launch(spec: Spec, plan: _Plan, groups: Sequence[Mapping[str, Any]], common: dict[str, Any]) -> None:
    """Two passes and a per-tensor ratio: stage 1 (moments, update direction, per-chunk norms),
    the trust ratios, stage 2 (the step)."""
    table = plan.table
    assert table is not None and plan.steps is not None
    if "stage1" not in plan.scratch:
        m = "true" if plan.masters is not None else "false"
        types = f"{DTYPES[plan.pname].ctype}, {DTYPES[plan.sname].ctype}, {m}"
        plan.scratch["stage1"] = f"lamb_stage1<{types}>"
        plan.scratch["stage2"] = f"lamb_stage2<{types}>"
        plan.scratch["ratio_kernel"] = f"lamb_ratio<{table.L}>"
        dev = plan.params[0].device
        # float64 for every dtype: float64 launches keep their norms exact (lamb.cu)
        plan.scratch["partial"] = torch.empty(2 * max(table.C, 1), dtype=torch.float64, device=dev)
        plan.scratch["ratio"] = torch.empty(max(table.T, 1), dtype=torch.float64, device=dev)
    partial, ratio = plan.scratch["partial"], plan.scratch["ratio"]
    args = launch_args(spec, plan, groups, common)
    eng.launch_count(LAMB_KERNELS, plan.steps, common["skip"])
    eng.launch_update(LAMB_KERNELS, plan.scratch["stage1"], table, extra=(plan.steps, partial), **args)
    if table.C:
        warps_per_block = 8
        LAMB_KERNELS.launch(
            plan.scratch["ratio_kernel"],
            (max(1, min(-(-table.T // warps_per_block), 4096)),),
            (32 * warps_per_block,),
            (table.table, table.T, table.C, partial, ratio, common["skip"]),
            device=table.device,
            stream=current_stream(table.device, True),
        )
    eng.launch_update(LAMB_KERNELS, plan.scratch["stage2"], table, extra=(plan.steps, ratio), **args)


def _reference(spec: Spec, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
    b1, b2 = group["betas"]
    ref.lamb(
        plan.params,
        plan.grads,
        plan.states["exp_avg"],
        plan.states["exp_avg_sq"],
        steps,
        plan.masters,
        lr=float(group["lr"]),
        beta1=float(b1),
        beta2=float(b2),
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        bias_correction=group["bias_correction"],
        maximize=group["maximize"],
        gmul=gmul,
    )


def _hp(group: Mapping[str, Any]) -> tuple[float, ...]:
    b1, b2 = group["betas"]
    return (float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
            -1.0 if group["maximize"] else 1.0, 1.0 if group["bias_correction"] else 0.0)


LAMB_SPEC = Spec(
    name="LAMB",
    module=LAMB_KERNELS,
    kernel="lamb_stage1<{P}, {S}, {M}>",
    rules={
        "lr": chk.LR,
        "betas": chk.betas(),
        "eps": chk.NON_NEGATIVE,
        "weight_decay": chk.NON_NEGATIVE,
        "bias_correction": chk.FLAG,
        "maximize": chk.FLAG,
        "capturable": chk.FLAG,
    },
    states=lambda g: ("exp_avg", "exp_avg_sq"),
    hp=_hp,
    counter="steps",
    launch=_launch,
    reference=_reference,
)


class LAMB(SpecOptimizer):
    """LAMB (You et al. 2020), fused: Adam's direction ``u = m̂ / (sqrt(v̂) + eps) + wd p`` scaled
    per tensor by the trust ratio ``‖p‖ / ‖u‖`` (1 when either norm is 0): ``p -= lr · ratio · u``.
    The per-tensor norms come from the same engine: three launches and no host sync.
    State: ``step``, ``exp_avg``, ``exp_avg_sq``. torch has no LAMB; the arguments follow apex's
    FusedLAMB (``bias_correction``; gradient clipping through ``max_grad_norm``).

    See also: ``apex.optimizers.FusedLAMB``.
    """

    spec = LAMB_SPEC
    _no_sharding = "LAMB's trust ratio needs each tensor's global norm"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        *,
        maximize: bool = False,
        capturable: bool = False,
        **options: Unpack[EngineOptions],
    ) -> None:
        defaults = self._defaults(
            dict(
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                bias_correction=bias_correction,
                maximize=maximize,
                capturable=capturable,
            )
        )
        super().__init__(params, defaults, **options)
