"""Argument checks shared by every cukit.optim optimizer, in the spirit of torch.optim's (same ranges),
stricter about types: a string, None or bool where a number is expected is a TypeError at once
rather than a failure steps later (``float("1e-3")`` would pass silently, and an LR scheduler then
multiplies a string). Every message names the optimizer, the argument, what was expected and what
was given, e.g. ``AdamW: lr must be a non-negative float or a 1-element tensor; got str '1e-3'``.

A rule is a callable ``rule(owner, name, value)`` that raises TypeError (wrong type) or ValueError
(right type, value out of range); each optimizer maps its hyperparameters to rules
(``MultiTensorOptimizer._rules``) and the base class applies them to the constructor's arguments
and to every group given to ``add_param_group``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import torch
from cukit.optim._kernels import COMBOS

__all__ = [
    "FLAG",
    "LR",
    "NON_NEGATIVE",
    "OPTIONAL_FLAG",
    "REAL",
    "Rule",
    "betas",
    "check",
    "check_param_dtypes",
    "check_state_dtype",
    "describe",
    "number",
]

Rule = Callable[[str, str, Any], None]

# What the kernels store (COMBOS): the state dtypes each parameter dtype may use.
_STATE_FOR: dict[str, tuple[str, ...]] = {}
for _p, _s, _ in COMBOS:
    if _s not in _STATE_FOR.setdefault(_p, ()):
        _STATE_FOR[_p] += (_s,)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def describe(value: Any) -> str:
    """A value as an error message shows it: ``-1.0``, ``str '1e-3'``, ``None``, ``a tensor of shape (2,)``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Real) and not isinstance(value, bool):
        return repr(value)
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__qualname__} {text}"


def _is_real(value: Any) -> bool:
    # bool is an int, but lr=True is a mistake, never a learning rate of 1
    return isinstance(value, Real) and not isinstance(value, bool)


def _range_text(low: float | None, low_open: bool, high: float | None, high_open: bool) -> str:
    if high is None:
        if low is None:
            return "a float"
        if low == 0.0:
            return "a positive float" if low_open else "a non-negative float"
        return f"a float {'>' if low_open else '>='} {low:g}"
    lo = "-inf" if low is None else f"{low:g}"
    return f"a float in {'(' if low_open or low is None else '['}{lo}, {high:g}{')' if high_open else ']'}"


def _in_range(x: float, low: float | None, low_open: bool, high: float | None, high_open: bool) -> bool:
    # written so that NaN fails every bound, as torch's ``not 0.0 <= lr``
    if low is not None and not (x > low if low_open else x >= low):
        return False
    if high is not None and not (x < high if high_open else x <= high):
        return False
    return not math.isnan(x)


def number(
    *,
    low: float | None = 0.0,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = True,
    tensor: bool = False,
    none: str | None = None,
) -> Rule:
    """A rule for a real number (not a bool) in ``[low, high)`` (by default; either end may be open
    or closed, None for unbounded); with ``tensor=True`` a 1-element floating tensor is accepted
    too (its value is read once, here); with `none` (what None means, for the messages) None too."""
    expected = _range_text(low, low_open, high, high_open) + (" or a 1-element tensor" if tensor else "")
    if none is not None:
        expected += f" or None ({none})"

    def rule(owner: str, name: str, value: Any) -> None:
        if value is None and none is not None:
            return
        if isinstance(value, torch.Tensor) and tensor:
            if not value.is_floating_point():
                raise TypeError(f"{owner}: {name} must be {expected}; got {describe(value)}")
            if value.numel() != 1:
                raise ValueError(f"{owner}: {name} must be {expected}; got {describe(value)}")
            x = float(value)
        elif _is_real(value):
            x = float(value)
        else:
            raise TypeError(f"{owner}: {name} must be {expected}; got {describe(value)}")
        if not _in_range(x, low, low_open, high, high_open):
            raise ValueError(f"{owner}: {name} must be {expected}; got {describe(value)}")

    return rule


def _typed(value: Any) -> str:
    """:func:`describe`, with the type of numbers too (``int 1`` where a bool is expected)."""
    if value is None or isinstance(value, torch.Tensor):
        return describe(value)
    text = repr(value)
    return f"{type(value).__qualname__} {text if len(text) <= 60 else text[:57] + '...'}"


def _flag(owner: str, name: str, value: Any) -> None:
    # a string is truthy: amsgrad="False" would silently turn amsgrad on
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool; got {_typed(value)}")


def _optional_flag(owner: str, name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool or None; got {_typed(value)}")


FLAG: Rule = _flag
OPTIONAL_FLAG: Rule = _optional_flag
NON_NEGATIVE: Rule = number()
REAL: Rule = number(low=None)
LR: Rule = number(tensor=True)
# the flags torch.optim's Adam, AdamW, SGD and Adagrad all take (accepted for drop-in use)
TORCH_FLAGS: dict[str, Rule] = {
    "maximize": FLAG,
    "foreach": OPTIONAL_FLAG,
    "differentiable": FLAG,
    "fused": OPTIONAL_FLAG,
}


def betas(*, high_open: bool = True) -> Rule:
    """A rule for a pair of coefficients in ``[0, 1)`` (``[0, 1]`` with ``high_open=False``), each a
    float or a 1-element tensor."""
    each = number(high=1.0, high_open=high_open, tensor=True)
    expected = f"a pair of floats in [0, 1{')' if high_open else ']'}"

    def rule(owner: str, name: str, value: Any) -> None:
        if isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(value, "__len__"):
            raise TypeError(f"{owner}: {name} must be {expected}; got {describe(value)}")
        if len(value) != 2:
            raise ValueError(f"{owner}: {name} must be {expected}; got {len(value)} values: {value!r}")
        for i, b in enumerate(value):
            each(owner, f"{name}[{i}]", b)

    return rule


def check(owner: str, rules: Mapping[str, Rule], values: Mapping[str, Any], where: str = "") -> None:
    """Apply ``rules[k]`` to every ``values[k]`` that has a rule; `where` (e.g. ``param group 1``)
    goes into the messages after the optimizer's name."""
    label = f"{owner} ({where})" if where else owner
    for name, value in values.items():
        rule = rules.get(name)
        if rule is not None:
            rule(label, name, value)


def check_state_dtype(owner: str, state_dtype: Any) -> None:
    """`state_dtype` is None or one of the floating dtypes the kernels store."""
    if state_dtype is None:
        return
    names = ", ".join(str(d) for d in _STATE_DTYPES)
    if not isinstance(state_dtype, torch.dtype) or state_dtype not in _STATE_DTYPES:
        raise TypeError(
            f"{owner}: state_dtype must be None (the parameter's dtype) or one of {names}; "
            f"got {describe(state_dtype) if not isinstance(state_dtype, torch.dtype) else state_dtype}"
        )


def check_param_dtypes(
    owner: str, params: list[torch.Tensor], state_dtype: torch.dtype | None, master_weights: bool, where: str
) -> None:
    """Every parameter's dtype, and the state dtype it would get, is a combination the kernels are
    built for (COMBOS); a TypeError that lists what is supported otherwise."""
    for i, p in enumerate(params):
        pname = str(p.dtype).removeprefix("torch.")
        allowed = _STATE_FOR.get(pname)
        if allowed is None:
            raise TypeError(
                f"{owner}: parameters must be float16, bfloat16, float32 or float64; got {p.dtype} "
                f"(parameter {i} of {where})"
            )
        sname = pname if state_dtype is None else str(state_dtype).removeprefix("torch.")
        master = master_weights and pname in ("float16", "bfloat16")
        if (pname, sname, master) not in COMBOS:
            options = ", ".join(f"torch.{s}" for s in allowed)
            raise TypeError(
                f"{owner}: state_dtype torch.{sname} is not supported for {pname} parameters "
                f"(parameter {i} of {where}); {pname} parameters keep their state in {options} "
                f"(state_dtype=None: the parameter's dtype)"
            )
