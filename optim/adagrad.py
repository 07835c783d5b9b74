"""Adagrad on the multi-tensor engine (kernels: raw_kernels/adagrad.cu)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim import _reference as ref
from cukit.optim._base import MultiTensorOptimizer, _Plan
from cukit.optim._kernels import ADAGRAD

from cukit.interop import DTYPES

__all__ = ["Adagrad"]


class Adagrad(MultiTensorOptimizer):
    """Adagrad, fused over every tensor in one launch:
    ``g += wd p; sum += g²; p -= lr / (1 + (t-1) lr_decay) · g / (sqrt(sum) + eps)``.

    Arguments and state (``step``, ``sum``, created in the constructor as torch does) are torch's;
    the keyword-only cukit options are described in :class:`cukit.optim.MultiTensorOptimizer`.

    See also: ``torch.optim.Adagrad(fused=True)``.
    """

    _module = ADAGRAD
    _rules: ClassVar[dict[str, chk.Rule]] = {
        "lr": chk.LR,
        "lr_decay": chk.NON_NEGATIVE,
        "weight_decay": chk.NON_NEGATIVE,
        "initial_accumulator_value": chk.NON_NEGATIVE,
        "eps": chk.NON_NEGATIVE,
        "foreach": chk.OPTIONAL_FLAG,
        "maximize": chk.FLAG,
        "differentiable": chk.FLAG,
        "fused": chk.OPTIONAL_FLAG,
    }

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
        flat_grads: bool = False,
        master_weights: bool = False,
        state_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
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
        super().__init__(
            params,
            defaults,
            flat_grads=flat_grads,
            master_weights=master_weights,
            state_dtype=state_dtype,
            max_grad_norm=max_grad_norm,
        )
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                sdt = self._state_dtype or p.dtype
                st["sum"] = self._new_state(p, "sum", group, sdt)

    def _new_state(
        self, p: torch.Tensor, key: str, group: dict[str, Any], dtype: torch.dtype
    ) -> torch.Tensor:
        # full_like: a DTensor parameter (FSDP2) gets a sharded state, never a global-size one
        return torch.full_like(p, float(group["initial_accumulator_value"]), dtype=dtype,
                               memory_format=torch.contiguous_format)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def _hp(self, group: dict[str, Any]) -> tuple[float, ...]:
        return (
            float(group["lr_decay"]),
            float(group["weight_decay"]),
            float(group["eps"]),
            -1.0 if group["maximize"] else 1.0,
        )

    def _launch(self, plan: _Plan, common: dict[str, Any]) -> None:
        name = plan.scratch.get("kernel")
        if name is None:
            m = "true" if plan.masters is not None else "false"
            name = plan.scratch["kernel"] = (
                f"adagrad_step<{DTYPES[plan.pname].ctype}, {DTYPES[plan.sname].ctype}, {m}>"
            )
        args = self._common_args(plan, common)
        eng.launch_count(ADAGRAD, plan.steps, common["skip"])  # type: ignore[arg-type]
        eng.launch_update(ADAGRAD, name, plan.table, extra=(plan.steps,), **args)  # type: ignore[arg-type]

    def _reference(
        self, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None
    ) -> None:
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
