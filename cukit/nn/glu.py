"""``cukit.nn.GatedActivation`` (``act(gate) * up`` in one kernel) and the ``cukit.nn.patch`` rule
"gated_mlp", which puts it into Llama-style gated MLPs (Llama, Mistral, Qwen2/3, Gemma, Granite,
OLMo-2, ...: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``)."""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable
from types import CodeType
from typing import Any

import torch
from torch import nn

from cukit.nn._patch import (
    Change,
    PatchContext,
    _hooks,
    _instance_forward,
    activation_of,
    derived_class,
    register_rule,
)
from cukit.nn.recompute import RECORDERS, record
from cukit.ops.glu import GLU_ACTIVATIONS, glu_activation_id
from cukit.torch.glu import glu

__all__ = ["GatedActivation"]


class GatedActivation(nn.Module):
    """``y = act(gate) * up``, one kernel (CUDA) reading gate and up and writing y; the torch
    reference on CPU. No parameters.

    Args:
        activation: "silu" (SwiGLU), "gelu" (GeGLU, exact) or "gelu_tanh" (GeGLU, tanh form).

    Shapes: gate and up (...), the same shape and dtype (float16, bfloat16, float32, float64);
    y like gate. Under autocast, gate and up are cast to the wider of their dtypes.

    See also: ``cukit.swiglu``, ``cukit.geglu``; ``torch.nn.functional.silu(gate) * up``.
    """

    def __init__(self, activation: str = "silu") -> None:
        super().__init__()
        glu_activation_id(activation, "cukit.nn.GatedActivation")
        self.activation = activation

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        act = self.activation
        y = glu(gate, up, act)
        record(y, lambda: glu(gate, up, act), "cukit.nn.GatedActivation", gate, up)
        return y

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


RECORDERS.append(GatedActivation)  # its output can be recomputed (cukit.nn.recompute)


# ---------------------------------------------------------------------------------------------
# The patch rule
# ---------------------------------------------------------------------------------------------

_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


# The forwards the rule knows to compute down_proj(act_fn(gate_proj(x)) * up_proj(x)) exactly
# (transformers' LlamaMLP and its copies write the first; a product commutes exactly in IEEE).
def _known_return(self: Any, x: Any) -> Any:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _known_assign(self: Any, x: Any) -> Any:
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _known_return_up_first(self: Any, x: Any) -> Any:
    return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


def _known_assign_up_first(self: Any, x: Any) -> Any:
    down_proj = self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))
    return down_proj


_SKIP_OPS = frozenset({"RESUME", "NOP", "CACHE", "EXTENDED_ARG", "PRECALL", "KW_NAMES"})


def _shape(code: CodeType) -> tuple[tuple[str, Any], ...]:
    """A code object's instructions with what makes two forwards compute the same thing: opcode
    names, the attribute and global names read, local variables by number (not name), constants;
    no line numbers, offsets or caches."""
    out = []
    for ins in dis.get_instructions(code):
        if ins.opname in _SKIP_OPS:
            continue
        arg: Any = ins.arg if "FAST" in ins.opname else ins.argval
        out.append((ins.opname, arg if isinstance(arg, (int, str, type(None))) else repr(arg)))
    return tuple(out)


_KNOWN = frozenset(_shape(f.__code__) for f in (_known_return, _known_assign, _known_return_up_first,
                                                _known_assign_up_first))


def _is_gated_forward(fn: Callable[..., Any]) -> bool:
    """Whether fn is one of the known gated forwards (two positional parameters, no decorator)."""
    code = getattr(fn, "__code__", None)
    return (
        isinstance(code, CodeType)
        and code.co_argcount == 2
        and not code.co_kwonlyargcount
        and not code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
        and not hasattr(fn, "__wrapped__")
        and _shape(code) in _KNOWN
    )


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down_proj(act_fn(gate_proj(x), up_proj(x))), act_fn a cukit GatedActivation: the forward of a
    patched gated MLP (it reads the same submodules as the original, so ``fuse_activations`` sees
    a known block whose act_fn it has no epilogue for, and leaves it)."""
    return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


_PATCHED: dict[type, type] = {}  # original class -> its patched subclass


def _patched_class(cls: type) -> type:
    """cls with the gated forward, one subclass per class (isinstance and the class name stay; the
    qualified name marks it, so pickling the whole module fails loudly instead of loading an
    unpatched forward beside a GatedActivation: save state_dicts)."""
    sub = _PATCHED.get(cls)
    if sub is None:
        sub = derived_class(cls, "gated_mlp", forward=_gated_forward)
        _PATCHED[cls] = sub
    return sub


@register_rule("gated_mlp", before="fuse_activations")
def _gated_mlp(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """down_proj(act(gate_proj(x)) * up_proj(x)) -> down_proj(glu(gate_proj(x), up_proj(x))): act and product in one kernel."""
    mods = m._modules
    if not all(isinstance(mods.get(k), nn.Module) for k in _PARTS) or type(m) in _PATCHED.values():
        return []
    kind = type(m).__name__
    if not _is_gated_forward(type(m).forward):
        return [Change(name, f"{kind} has gate_proj/up_proj/down_proj/act_fn, but its forward is not known to be "
                             "down_proj(act_fn(gate_proj(x)) * up_proj(x))", skipped=True)]
    old = mods["act_fn"]
    act, why = activation_of(old)
    if act not in GLU_ACTIVATIONS:
        why = why or f"{type(old).__name__} has no gated kernel (silu, gelu, gelu_tanh)"
        return [Change(name, f"{kind}: act_fn: {why}", skipped=True)]
    reason = _instance_forward(m) or _hooks(old, inputs_too=True)
    if reason:
        return [Change(name, f"{kind} not patched: {reason}", skipped=True)]
    new = GatedActivation(act)  # type: ignore[arg-type]
    new.train(old.training)
    mods["act_fn"] = new
    m.__class__ = _patched_class(type(m))
    return [Change(name, f"{kind}: act_fn ({type(old).__name__}) * up_proj -> GatedActivation({act!r}), one kernel")]
