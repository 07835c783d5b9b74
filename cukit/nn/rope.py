"""The ``cukit.nn.patch`` rule "rope": Hugging Face attention modules apply rotary embeddings with the
module-level function ``apply_rotary_pos_emb`` of their modeling file, called from ``forward``;
the rule makes a patched module's forward call ``cukit.rotary_embedding`` (one kernel for q and k,
reading the transposed q and k views in place) instead.

Per instance, never global: the module's class is swapped for a subclass (one per original class)
whose ``forward`` is a copy of the original function with its own globals, in which
``apply_rotary_pos_emb`` is cukit's. Other instances of the class and the modeling module are left
alone. The copy's globals are a snapshot of the module's taken at patch time (a later rebinding of
another global of that module is not seen by patched instances), without ``__name__`` so that
torch.compile traces them as they are (see ``_rebuilt_forward``). Decorated forwards
(``functools.wraps``) are rebuilt through their closures; others are skipped with the reason.

The original function is checked numerically before anything is swapped (on tiny float64 CPU
tensors: random tables, grouped-query heads, both ``unsqueeze_dim`` layouts, broadcast batch,
mixed dtypes, partial rotary): only a function that computes exactly ``q * cos + rotate_half(q) *
sin`` is replaced. Calls outside what was checked (other ranks or dtypes, or partial rotary when the
original does not do it as cukit does) go to the original function.
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cukit.nn._patch import Change, PatchContext, _instance_forward, derived_class, register_rule
from cukit.ops.rope import reference_torch
from cukit.torch._register import FLOATS
from cukit.torch.rope import rotary_embedding

__all__: list[str] = []

_NAME = "apply_rotary_pos_emb"


# ---------------------------------------------------------------------------------------------
# Checking the original function
# ---------------------------------------------------------------------------------------------


class _Verdict:
    """What the probe found: why the function may not be replaced (None: it may), and whether it
    does partial rotary (cos shorter than head_dim) as cukit does."""

    __slots__ = ("partial", "why")

    def __init__(self, why: str | None, partial: bool = False) -> None:
        self.why, self.partial = why, partial


_VERDICTS: weakref.WeakKeyDictionary[Callable[..., Any], _Verdict] = weakref.WeakKeyDictionary()


def _agrees(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int) -> str | None:
    """None when fn's (q_embed, k_embed) equal cukit's reference (values and dtype), else why not."""
    try:
        with torch.no_grad():
            out = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim) if unsqueeze_dim != 1 else fn(q, k, cos, sin)
    except Exception as e:  # the function refuses the call: it is not what the probe assumed
        return f"raised {type(e).__name__}"
    want = reference_torch(q, k, cos, sin, unsqueeze_dim)
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return "does not return (q_embed, k_embed)"
    for got, ref in zip(out, want, strict=True):
        if got.shape != ref.shape or got.dtype != ref.dtype:
            return f"returns {got.dtype} {tuple(got.shape)} where q * cos gives {ref.dtype} {tuple(ref.shape)}"
        if not torch.allclose(got.double(), ref.double(), rtol=1e-6 if ref.dtype != torch.float64 else 1e-12,
                              atol=1e-6 if ref.dtype != torch.float64 else 1e-12):
            return "computes other values than q * cos + rotate_half(q) * sin"
    return None


def _probe(fn: Callable[..., Any], has_unsqueeze_dim: bool) -> _Verdict:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    B, S, Hq, Hk, D = 2, 5, 3, 1, 8
    q, k = randn(B, Hq, S, D), randn(B, Hk, S, D)
    cos, sin = randn(B, S, D), randn(B, S, D)  # random tables: the formula for any cos and sin
    checks = [
        ("", (q, k, cos, sin, 1)),
        (" (batch-broadcast tables)", (q, k, cos[:1], sin[:1], 1)),
        (" (float32 q and k, float64 tables)", (q.float(), k.float(), cos, sin, 1)),
    ]
    if has_unsqueeze_dim:
        checks.append((" (unsqueeze_dim=2)", (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)))
    for what, args in checks:
        why = _agrees(fn, *args)
        if why:
            return _Verdict(f"{_NAME} is not the rotate_half form: on a probe{what} it {why}")
    partial = _agrees(fn, q, k, cos[..., :4], sin[..., :4], 1) is None
    return _Verdict(None, partial)


def _verdict(fn: Callable[..., Any]) -> _Verdict:
    v = _VERDICTS.get(fn)
    if v is None:
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        if params[:4] != ["q", "k", "cos", "sin"] or params[4:] not in ([], ["unsqueeze_dim"],
                                                                          ["position_ids", "unsqueeze_dim"]):
            v = _Verdict(f"{_NAME}({', '.join(params)}): not a known signature")
        else:
            v = _probe(fn, "unsqueeze_dim" in params)
        _VERDICTS[fn] = v
    return v


# ---------------------------------------------------------------------------------------------
# The replacement and the patched forward
# ---------------------------------------------------------------------------------------------


def _replacement(original: Callable[..., Any], partial: bool) -> Callable[..., Any]:
    """cukit's apply_rotary_pos_emb for calls of the kind the probe checked, the original for the
    rest; the original's signature (names and defaults: callers pass keywords)."""
    sig = inspect.signature(original)
    default_dim = sig.parameters["unsqueeze_dim"].default if "unsqueeze_dim" in sig.parameters else 1

    def fits(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: Any) -> bool:
        return (
            unsqueeze_dim in (1, 2)
            and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
            and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
            and q.dtype in FLOATS and k.dtype is q.dtype and cos.dtype in FLOATS and sin.dtype is cos.dtype
            and (partial or cos.shape[-1] == q.shape[-1])
        )

    if "position_ids" in sig.parameters:  # transformers < 4.38: a position_ids argument, since unused

        def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=default_dim):  # type: ignore[no-untyped-def]
            if position_ids is None and fits(q, k, cos, sin, unsqueeze_dim):
                return rotary_embedding(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
            return original(q, k, cos, sin, position_ids, unsqueeze_dim)

    elif "unsqueeze_dim" in sig.parameters:

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=default_dim):  # type: ignore[no-untyped-def]
            if fits(q, k, cos, sin, unsqueeze_dim):
                return rotary_embedding(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
            return original(q, k, cos, sin, unsqueeze_dim)

    else:

        def apply_rotary_pos_emb(q, k, cos, sin):  # type: ignore[no-untyped-def]
            if fits(q, k, cos, sin, 1):
                return rotary_embedding(q, k, cos, sin)
            return original(q, k, cos, sin)

    apply_rotary_pos_emb.__doc__ = f"cukit.rotary_embedding in place of {original.__module__}.{_NAME}."
    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _copy(fn: types.FunctionType, globals_: dict[str, Any], closure: tuple[Any, ...] | None) -> types.FunctionType:
    """fn with other globals (and closure): code, name, defaults, keyword defaults, attributes kept."""
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(fn.__annotations__)
    return new


def _rebuilt_forward(forward: Callable[..., Any]) -> tuple[Callable[..., Any] | None, str | None]:
    """A copy of forward in which the global apply_rotary_pos_emb is cukit's, or (None, why not).
    A decorated forward (``functools.wraps``: ``__wrapped__``) is rebuilt level by level: the
    innermost function that reads the global gets new globals, and each wrapper a closure whose
    cell held the old inner function now holds the new one."""
    chain = [forward]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    at = next((i for i, f in enumerate(chain) if _reads_global(f)), None)
    if at is None:
        return None, f"forward does not call the global {_NAME}"
    inner = chain[at]
    original = inner.__globals__.get(_NAME)
    if not callable(original):
        return None, f"{_NAME} is not a function of {inner.__module__}"
    verdict = _verdict(original)
    if verdict.why:
        return None, verdict.why
    globals_ = dict(inner.__globals__)
    globals_[_NAME] = _replacement(original, verdict.partial)
    # No __name__: torch.compile (dynamo) reads an inlined function's globals as the module
    # sys.modules[__name__] when the name is there, which would be the unpatched module; without it
    # dynamo guards on this dict itself. (The copy's __module__ is set from the original below.)
    globals_.pop("__name__", None)
    new = _copy(inner, globals_, inner.__closure__)
    for i in range(at - 1, -1, -1):  # the wrappers, innermost first
        wrapper, old = chain[i], chain[i + 1]
        cells = getattr(wrapper, "__closure__", None) or ()
        if not isinstance(wrapper, types.FunctionType) or not any(_holds(c, old) for c in cells):
            return None, f"forward is wrapped by {getattr(wrapper, '__qualname__', wrapper)!r}, which cukit cannot rebuild"
        closure = tuple(types.CellType(new) if _holds(c, old) else c for c in cells)
        inner_new, new = new, _copy(wrapper, wrapper.__globals__, closure)
        new.__wrapped__ = inner_new  # type: ignore[attr-defined]
    return new, None


def _holds(cell: Any, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


_PATCHED: dict[type, type | str] = {}  # original class -> patched subclass, or why there is none
_SUBCLASSES: set[type] = set()  # the patched subclasses


def _patched_class(cls: type) -> type | str:
    """cls with the rebuilt forward, one subclass per class (isinstance and the class name stay;
    the qualified name marks it, so pickling the whole module fails loudly: save state_dicts)."""
    sub = _PATCHED.get(cls)
    if sub is None:
        forward, why = _rebuilt_forward(cls.forward)  # type: ignore[attr-defined]
        sub = why if forward is None else derived_class(cls, "rope", forward=forward)
        _PATCHED[cls] = sub
        if isinstance(sub, type):
            _SUBCLASSES.add(sub)
    return sub  # type: ignore[return-value]


@register_rule("rope")
def _rope(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """apply_rotary_pos_emb (module-level, called by HF attention forwards) -> cukit.rotary_embedding."""
    cls = type(m)
    if cls in _SUBCLASSES:
        return []
    forward = getattr(cls, "forward", None)
    if forward is None or not any(_reads_global(f) for f in _unwrapped(forward)):
        return []
    if why := _instance_forward(m):
        return [Change(name, f"{cls.__name__} not patched: {why}", skipped=True)]
    sub = _patched_class(cls)
    if isinstance(sub, str):
        return [Change(name, f"{cls.__name__}: {sub}", skipped=True)]
    m.__class__ = sub
    return [Change(name, f"{cls.__name__}.forward: {cls.__module__}.{_NAME} -> cukit.rotary_embedding")]


def _reads_global(fn: Any) -> bool:
    """Whether fn's code (nested functions included) reads the name apply_rotary_pos_emb."""
    stack = [getattr(fn, "__code__", None)] if isinstance(fn, types.FunctionType) else []
    while stack:
        code = stack.pop()
        if _NAME in code.co_names:
            return True
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def _unwrapped(fn: Any) -> list[types.FunctionType]:
    out = []
    while fn is not None:
        if isinstance(fn, types.FunctionType):
            out.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return out

