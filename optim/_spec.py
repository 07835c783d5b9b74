"""Declarative optimizers: an optimizer is a :class:`Spec`, and one functional step runs any spec.

A spec says what makes an optimizer: its kernel module and kernel-name template, its argument
rules, its states (which exist for a param group) and how a low-bit variant stores them (the
codecs: which states are quantised and on which map), its hyperparameter packing, its compile-time
variant, how steps are counted, and its plain-torch reference. Everything else is shared:

- :func:`step`: the functional step of one launch (a :class:`~cukit.optim._base._Plan`: lists of
  tensors and their device table) with a spec and its param groups: hyperparameters packed, lrs
  passed by value or read from a device tensor, steps counted on the device, one update kernel.
  The public functional forms (``cukit.optim.functional``: lists in) and the optimizer classes
  (:class:`SpecOptimizer`: plans cached across steps) both call it.
- :class:`SpecOptimizer`: torch.optim.Optimizer's API over the engine
  (:class:`~cukit.optim._base.MultiTensorOptimizer`: plans, pointer checks, the reference path,
  clipping, GradScaler), its hooks taken from ``spec``; a class adds only its torch-compatible
  constructor.
- ``optim/_checks.py`` checks the arguments by ``spec.rules``; the state_dict mapping is torch's,
  or bitsandbytes' for the low-bit specs (optim/lowbit.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from cukit.optim import _checks as chk
from cukit.optim import _engine as eng
from cukit.optim._base import MultiTensorOptimizer, _Plan

from cukit._runtime import KernelModule
from cukit.interop import DTYPES

__all__ = ["Spec", "SpecOptimizer", "quantised", "step"]

Group = Mapping[str, Any]


def _no_variant(group: Group) -> tuple[Any, ...]:
    return ()


@dataclass(frozen=True)
class Spec:
    """What makes one optimizer.

    kernel: the update kernel's name, formatted with P and S (the parameter's and state's C types),
        M (master weights, "true"/"false"), the variant's entries by name (``variant_names``) and
        the spec's ``flags``.
    states: the state names of a param group (torch's names, in the kernel's list order).
    hp: the group's hyperparameters as the kernel reads them (at most eng.K_HP floats).
    counter: "steps" (a float32 step count per tensor, counted by mt_count_step and passed to the
        kernel), or None.
    reference: ``(spec, group, plan, steps, gmul)``: the plain-torch step of one param group.
    check: ``(group, owner)``: checks that involve several arguments (rules check them one by one).
    launch: ``(spec, plan, groups, common)``: an optimizer that needs several kernels (LAMB).
    extra: ``(spec, plan, common)``: more kernel arguments after the step counts (SGD's counts).
    initial_value: the states' start for a group (Adagrad's initial_accumulator_value); None: 0.
    qstates: the codecs of the low-bit variants: per quantisable state (in kernel order), its name
        and whether its map is signed (bitsandbytes' dynamic map; unsigned: dynamic for 8 bits,
        linear for 4).
    qkernel: the quantised update kernel, formatted with P, bits, mode (master weights: 0 none,
        1 float32, 2 bfloat16 + int8 residual) and ``flags``.
    bits: 0 for states in a float dtype; 8 or 4 for the quantised variant (:func:`quantised`).
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
    flags: Mapping[str, bool] = field(default_factory=lambda: MappingProxyType({}))
    counter: str | None = None
    check: Callable[[Group, str], None] | None = None
    launch: Callable[[Spec, _Plan, Sequence[Group], dict[str, Any]], None] | None = None
    extra: Callable[[Spec, _Plan, dict[str, Any]], tuple[Any, ...]] | None = None
    initial_value: Callable[[Group], float] | None = None
    qstates: tuple[tuple[str, bool], ...] = ()
    qkernel: str = ""
    bits: int = 0

    def replace(self, **changes: Any) -> Spec:
        """A copy with `changes` (another optimizer of the same family: AdamW from Adam)."""
        return dataclasses.replace(self, **changes)


def quantised(spec: Spec, bits: int, name: str) -> Spec:
    """The low-bit variant of `spec` (8 or 4 bits): its ``qstates`` stored blockwise-quantised."""
    if not spec.qstates or not spec.qkernel:
        raise TypeError(f"{spec.name} declares no quantisable states")
    if bits not in (4, 8):
        raise ValueError(f"quantised: bits must be 4 or 8; got {bits!r}")
    return spec.replace(name=name, bits=bits)


def _flag(x: Any) -> str:
    return "true" if x else "false"


def kernel_name(spec: Spec, plan: _Plan, qmode: int | None = None) -> str:
    """The update kernel of `plan` (kept in the plan's scratch after the first call): the float-state
    kernel, or with `qmode` (master weights: 0 none, 1 float32, 2 int8 residual) the quantised one."""
    name = plan.scratch.get("kernel")
    if name is None:
        flags = {k: _flag(v) for k, v in spec.flags.items()}
        if qmode is not None:
            name = spec.qkernel.format(P=DTYPES[plan.pname].ctype, bits=spec.bits, mode=qmode, **flags)
        else:
            names = dict(zip(spec.variant_names, map(_flag, plan.variant), strict=False))
            name = spec.kernel.format(
                P=DTYPES[plan.pname].ctype, S=DTYPES[plan.sname].ctype, M=_flag(plan.masters is not None),
                **names, **flags,
            )
        plan.scratch["kernel"] = name
    return name


def refresh_hp(spec: Spec, plan: _Plan, groups: Sequence[Group]) -> None:
    """Point the plan at a device copy of its groups' hyperparameters (a new copy only when one
    changed: under CUDA-graph capture that is an error, lr aside, which is passed by value)."""
    values = eng.pack_hp([spec.hp(g) for g in groups])
    if values != plan.hp_values:
        if plan.hp is not None and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cukit.optim: hyperparameters other than lr changed during CUDA-graph capture")
        plan.hp = eng.hp_tensor(values, plan.params[0].device)
        plan.hp_values = values


def launch_args(spec: Spec, plan: _Plan, groups: Sequence[Group], common: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of eng.launch_update for `plan` (``common``: grad_div, grad_mul, skip)."""
    refresh_hp(spec, plan, groups)
    lrs, lr_dev = eng.lr_args([g["lr"] for g in groups], plan.params[0].device)
    return {"hp": plan.hp, "groups": len(groups), "lrs": lrs, "lr_dev": lr_dev, **common}


def step(spec: Spec, plan: _Plan, groups: Sequence[Group], common: dict[str, Any]) -> None:
    """The functional step of one launch on the GPU: `plan`'s tensors (its table built), `groups`
    the param groups of plan.gids in order, ``common`` the gradient divisor / multiplier and the
    skip flag (device scalars or None). Counts the steps (``counter``), then one update kernel
    (or the spec's own launch sequence)."""
    if spec.launch is not None:
        spec.launch(spec, plan, groups, common)
        return
    args = launch_args(spec, plan, groups, common)
    extra: tuple[Any, ...] = ()
    if spec.counter == "steps":
        eng.launch_count(spec.module, plan.steps, common["skip"])  # type: ignore[arg-type]
        extra = (plan.steps,)
    if spec.extra is not None:
        extra = (*extra, *spec.extra(spec, plan, common))
    eng.launch_update(spec.module, kernel_name(spec, plan), plan.table, extra=(*extra, *plan.extra), **args)  # type: ignore[arg-type]


def check_group(spec: Spec, group: Group, owner: str, where: str = "") -> None:
    """The argument checks of `spec` over a param group (TypeError / ValueError naming `owner`)."""
    chk.check(owner, spec.rules, group, where)
    if spec.check is not None:
        spec.check(group, f"{owner} ({where})" if where else owner)


class SpecOptimizer(MultiTensorOptimizer):
    """MultiTensorOptimizer whose hooks come from ``spec`` and whose launches run :func:`step`."""

    spec: ClassVar[Spec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is not None:
            cls._has_step = spec.counter == "steps"

    def _check_args(self, values: Mapping[str, Any], where: str = "") -> None:
        check_group(self.spec, values, type(self).__name__, where)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self.spec.states(group)

    def _variant(self, group: dict[str, Any]) -> tuple[Any, ...]:
        return self.spec.variant(group)

    def _new_state(self, p: torch.Tensor, key: str, group: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
        if self.spec.initial_value is None:
            return super()._new_state(p, key, group, dtype)
        # full_like: a DTensor parameter (FSDP2) gets a sharded state, never a global-size one
        return torch.full_like(p, self.spec.initial_value(group), dtype=dtype, memory_format=torch.contiguous_format)

    def _launch(self, plan: _Plan, common: dict[str, Any]) -> None:
        groups = self.param_groups
        step(self.spec, plan, [groups[gi] for gi in plan.gids], common)

    def _reference(self, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: torch.Tensor | None) -> None:
        self.spec.reference(self.spec, group, plan, steps, gmul)
