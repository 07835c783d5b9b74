"""Declarative optimizer specs (issue 13 item 3, work in progress on branch item3-specs).

An optimizer is described by a :class:`Spec`: its kernel module and kernel-name template, its
argument rules, its states (which exist for a param group), its hyperparameter packing, its
compile-time variant, how steps are counted, and its plain-torch reference. :class:`SpecOptimizer`
implements MultiTensorOptimizer's hooks from the spec, so a class keeps only its torch-compatible
constructor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim._base import MultiTensorOptimizer, _Plan

from cukit._runtime import KernelModule
from cukit.interop import DTYPES

__all__ = ["Spec", "SpecOptimizer"]

Group = Mapping[str, Any]


def _no_variant(group: Group) -> tuple[Any, ...]:
    return ()


@dataclass(frozen=True)
class Spec:
    """What makes one optimizer.

    kernel: the update kernel's name, formatted with P and S (the parameter's and state's C types),
        M (master weights, "true"/"false"), the variant's entries by name (``variant_names``) and
        the class's flags (``class_flags``: AdamW's ``_decoupled``).
    states: the state names of a param group (torch's names, in the kernel's list order).
    hp: the group's hyperparameters as the kernel reads them (at most eng.K_HP floats).
    counter: "steps" (a float32 step count per tensor, counted by mt_count_step and passed to the
        kernel), or None.
    reference: ``(opt, group, plan, steps, gmul)``: the plain-torch step of one param group.
    """

    name: str
    module: KernelModule
    kernel: str
    rules: Mapping[str, chk.Rule]
    states: Callable[[Group], tuple[str, ...]]
    hp: Callable[[Group], tuple[float, ...]]
    reference: Callable[..., None]
    variant: Callable[[Group], tuple[Any, ...]] = _no_variant
    variant_names: tuple[str, ...] = ()
    class_flags: tuple[str, ...] = ()  # kernel-template flags from the class (``_<name>`` attributes)
    counter: str | None = None
    launch: Callable[[Any, _Plan, dict[str, Any]], None] | None = None  # several kernels (LAMB)
    initial_value: Callable[[Group], float] | None = None  # the states' start (Adagrad's sum); None: 0
    extra: Callable[[Any, _Plan, dict[str, Any]], tuple[Any, ...]] | None = field(default=None)


def _flag(x: Any) -> str:
    return "true" if x else "false"


class SpecOptimizer(MultiTensorOptimizer):
    """MultiTensorOptimizer whose hooks come from ``spec``."""

    spec: ClassVar[Spec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is not None:
            cls._module = spec.module
            cls._rules = dict(spec.rules)
            cls._has_step = spec.counter == "steps"

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.spec.states(group)

    def _variant(self, group: dict[str, Any]) -> tuple[Any, ...]:
        return self.spec.variant(group)

    def _hp(self, group: dict[str, Any]) -> tuple[float, ...]:
        return self.spec.hp(group)

    def _new_state(self, p: torch.Tensor, key: str, group: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
        if self.spec.initial_value is None:
            return super()._new_state(p, key, group, dtype)
        # full_like: a DTensor parameter (FSDP2) gets a sharded state, never a global-size one
        return torch.full_like(p, self.spec.initial_value(group), dtype=dtype, memory_format=torch.contiguous_format)

    def _kernel(self, plan: _Plan) -> str:
        name = plan.scratch.get("kernel")
        if name is None:
            names = dict(zip(self.spec.variant_names, map(_flag, plan.variant), strict=False))
            names.update({f: _flag(getattr(self, f"_{f}")) for f in self.spec.class_flags})
            name = plan.scratch["kernel"] = self.spec.kernel.format(
                P=DTYPES[plan.pname].ctype, S=DTYPES[plan.sname].ctype, M=_flag(plan.masters is not None), **names
            )
        return name

    def _launch(self, plan: _Plan, common: dict[str, Any]) -> None:
        if self.spec.launch is not None:
            self.spec.launch(self, plan, common)
            return
        name = self._kernel(plan)
        args = self._common_args(plan, common)
        extra: tuple[Any, ...] = ()
        if self.spec.counter == "steps":
            eng.launch_count(self.spec.module, plan.steps, common["skip"])  # type: ignore[arg-type]
            extra = (plan.steps,)
        if self.spec.extra is not None:
            extra = (*extra, *self.spec.extra(self, plan, common))
        eng.launch_update(self.spec.module, name, plan.table, extra=(*extra, *plan.extra), **args)  # type: ignore[arg-type]

    def _reference(self, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
        self.spec.reference(self, group, plan, steps, gmul)
