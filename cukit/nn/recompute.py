"""Saved activations recomputed instead of stored: the outputs of cukit's norms and gated
activations, when a later op saves them for its backward (a linear layer saves its input), are
kept as the recipe that made them and recomputed in the backward. The ``cukit.nn.patch`` rule
"recompute" turns this on for the blocks that hold such modules; ``recomputing()`` does it for any
region.

Why: in a transformer block the normalised input of the q/k/v and gate/up projections (tokens x
hidden) and the gated MLP's product ``act(gate) * up`` (tokens x ffn) are stored only because a
GEMM's weight gradient reads them. Their own inputs are stored anyway (the norm's backward reads x,
the gated activation's reads gate and up), so keeping the recipe costs no memory, and remaking the
output is one memory-bound kernel per consumer group. For a Llama block that is about a third of
its saved activations.

How: ``torch.autograd.graph.saved_tensors_hooks``. While a scope is active, cukit's RMSNorm,
LayerNorm and GatedActivation modules record each output they make (a weak reference, the inputs,
their versions); the pack hook replaces a saved tensor that is such an output, or a view of one, by
its recipe, and the unpack hook recomputes it once for all the ops that saved it (the last one to
unpack drops it). The recomputation runs the same kernel on the same inputs, so it is bitwise the
stored value. An input modified in place between the forward and the backward is an error, as it
is for autograd's own saved tensors.

A scope does nothing under ``torch.compile`` (inductor makes its own recompute decisions), without
grad mode, or inside another saved-tensor hooks context (``torch.utils.checkpoint``, whose regions
already recompute everything).

Outputs under :data:`MIN_BYTES` stay stored: a remake is an op call on the host, which at small
sizes costs more than its kernel, and a model of such activations is bound by its host, not its
memory.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from cukit.nn._patch import Change, PatchContext, _instance_forward, derived_class, register_rule
from cukit.nn.checkpointing import _CheckpointedForward

__all__ = ["recomputing"]


#: The smallest output a scope recomputes (bytes); a scoped module whose first floating-point input
#: is smaller enters no scope at all (no hooks). The patch rule's blocks are scoped by it: a
#: 6-layer, 768-hidden Llama at 4,096 tokens (6 MiB per norm output) stays stored, an 8-layer,
#: 2,048-hidden one at 8,192 tokens (32 MiB) is recomputed. ``cukit.nn.LayerNorm`` runs torch's
#: own layer_norm under it (the same reason: below it a model's step is bound by its host).
MIN_BYTES = 16 << 20


class _State(threading.local):
    depth = 0  # active scopes on this thread (only the outermost pushes the hooks)
    min_bytes = MIN_BYTES  # the outermost scope's


_STATE = _State()


class _Recipe:
    """How to remake one output: ``fn()`` under the autocast state of the forward, from `inputs`
    at `versions`; `value` holds the remade output while ops that saved it have yet to unpack."""

    __slots__ = ("amp", "dtype", "fn", "inputs", "pending", "shape", "value", "versions", "where")

    def __init__(self, fn: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...], out: torch.Tensor,
                 where: str) -> None:
        self.fn, self.inputs, self.where = fn, inputs, where
        self.versions = tuple(t._version for t in inputs)
        self.shape, self.dtype = out.shape, out.dtype
        self.amp = tuple((d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d))
        self.value: torch.Tensor | None = None
        self.pending = 0

    def materialize(self) -> torch.Tensor:
        v = self.value
        if v is not None:
            return v
        for i, (t, seen) in enumerate(zip(self.inputs, self.versions, strict=True)):
            if t._version != seen:
                raise RuntimeError(
                    f"cukit.nn.recomputing: input {i} of {self.where} was modified in place after the forward "
                    f"(version {seen} -> {t._version}); its output, saved for the backward as a recipe, cannot be "
                    "remade. Patch with recompute=False, or do not modify it in place."
                )
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            for device, dtype in self.amp:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            v = self.fn()
        if v.shape != self.shape or v.dtype != self.dtype or not v.is_contiguous():
            raise RuntimeError(f"cukit.nn.recomputing: {self.where} remade a {v.dtype} {tuple(v.shape)} tensor in "
                               f"place of its contiguous {self.dtype} {tuple(self.shape)} output (a cukit bug)")
        self.value = v
        return v


class _Saved:
    """What the pack hook stores for a recorded output: its recipe and, for a view, the view."""

    __slots__ = ("recipe", "view")

    def __init__(self, recipe: _Recipe, view: tuple | None) -> None:
        self.recipe, self.view = recipe, view


# id(output) -> (weak reference to it, its recipe), for the outputs alive now
_LIVE: dict[int, tuple[weakref.ref, _Recipe]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    hit = _LIVE.get(key)
    if hit is not None and hit[0] is ref:
        del _LIVE[key]


def record(out: torch.Tensor, fn: Callable[[], torch.Tensor], where: str, *inputs: torch.Tensor | None) -> None:
    """Inside a scope, note that `out` is remade by ``fn()`` from the tensors `inputs` (None ones
    skipped; `out`'s own backward saves them anyway). Called by cukit.nn modules after their
    forward; outside a scope it returns at the first test."""
    # a contiguous tensor of its own (not a view): a saved view of it is remade by its geometry
    if (not _STATE.depth or not out.requires_grad or out._base is not None or not out.is_contiguous()
            or out.nbytes < _STATE.min_bytes):
        return
    key = id(out)
    ref = weakref.ref(out, functools.partial(_forget, key))
    _LIVE[key] = (ref, _Recipe(fn, tuple(t for t in inputs if t is not None), out, where))


def _pack(t: torch.Tensor) -> Any:
    base = t._base
    if base is None:
        base = t
    hit = _LIVE.get(id(base))
    if hit is None or hit[0]() is not base or t.dtype is not base.dtype:
        return t
    recipe = hit[1]
    recipe.pending += 1
    return _Saved(recipe, None if t is base else (t.shape, t.stride(), t.storage_offset() - base.storage_offset()))


def _unpack(p: Any) -> torch.Tensor:
    if type(p) is not _Saved:
        return p
    recipe = p.recipe
    v = recipe.materialize()
    recipe.pending -= 1
    if recipe.pending <= 0:  # the last op that saved it: drop it (a second backward remakes it)
        recipe.value = None
    return v if p.view is None else v.as_strided(*p.view)


def _stands_aside() -> bool:
    """A scope is already active, or one would change nothing or the wrong thing: no grad mode,
    dynamo tracing, or other saved-tensor hooks (checkpoint) on top."""
    return (bool(_STATE.depth) or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)


@contextlib.contextmanager
def recomputing(min_bytes: int | None = None) -> Iterator[None]:
    """Within this context, outputs of cukit's RMSNorm, LayerNorm and GatedActivation modules that
    later ops save for their backward are stored as recipes and recomputed in the backward (bitwise
    the same values; an input modified in place in between raises). Nested scopes are one scope
    (the outermost's `min_bytes`). Does nothing under ``torch.compile``, without grad mode, or
    inside another saved-tensor hooks context such as ``torch.utils.checkpoint``.

    Args:
        min_bytes: outputs smaller than this stay stored (default :data:`MIN_BYTES`; 0: all).

    Example: ``with cukit.nn.recomputing(): loss = model(x); loss.backward()`` (the backward may
    run outside). ``cukit.nn.patch`` sets this up in each block that holds such a module.

    See also: ``torch.autograd.graph.saved_tensors_hooks``, ``torch.utils.checkpoint``,
    ``cukit.nn.checkpoint`` (recomputes whole regions).
    """
    if min_bytes is None:
        min_bytes = MIN_BYTES
    elif not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 0:
        raise ValueError(f"cukit.nn.recomputing: min_bytes must be None or an int >= 0; got {min_bytes!r}")
    if _stands_aside():
        yield
        return
    _STATE.depth += 1
    _STATE.min_bytes = min_bytes
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _STATE.depth -= 1


def _scoped_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # the common nested case and small inputs, without a context manager's cost
        if _stands_aside() or _small(args, kwargs):
            return original(self, *args, **kwargs)
        with recomputing():
            return original(self, *args, **kwargs)

    return forward


def _small(args: tuple, kwargs: dict) -> bool:
    """The first floating-point tensor among a forward's arguments is under MIN_BYTES (its
    activations, of that size or a small multiple, are not worth remaking)."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.nbytes < MIN_BYTES
    return False


_SCOPED: dict[type, type] = {}


def _scoped_class(cls: type) -> type:
    sub = _SCOPED.get(cls)
    if sub is None:
        sub = derived_class(cls, "recompute", forward=_scoped_forward(cls.forward))  # type: ignore[attr-defined]
        _SCOPED[cls] = sub
    return sub


#: The module classes that call :func:`record` (cukit.nn.norm and cukit.nn.glu add theirs).
RECORDERS: list[type[nn.Module]] = []


@register_rule("recompute", last=True)
def _recompute(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """A module whose children include cukit's RMSNorm, LayerNorm or GatedActivation runs its
    forward in a ``recomputing()`` scope: their outputs, where later ops save them, are recomputed
    in the backward instead of stored."""
    if type(m) in _SCOPED.values():
        return []
    kids = [k for k, c in m._modules.items() if isinstance(c, tuple(RECORDERS))]
    if not kids:
        return []
    what = f"{type(m).__name__} ({', '.join(kids)})"
    if isinstance(vars(m).get("forward"), _CheckpointedForward):
        return []  # a checkpointed region recomputes all it saves (a scope inside it stands aside)
    if why := _instance_forward(m):
        return [Change(name, f"{what}: {why}", skipped=True)]
    m.__class__ = _scoped_class(type(m))
    return [Change(name, f"{what}: outputs saved by later ops are recomputed in the backward, not stored")]
