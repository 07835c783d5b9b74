"""Activation checkpointing that knows cukit's ops: a selective policy that keeps what is costly to
recompute (matrix products, attention, convolutions: torch's and cukit's) and recomputes the rest
(elementwise, norms, rotary embeddings, gated activations), ``checkpoint(fn, ...)`` over
``torch.utils.checkpoint``, and ``checkpoint_modules(model)`` for a model's repeated blocks.

How it sees cukit's ops: a selective policy runs under a ``TorchDispatchMode``, and with one active
every cukit op takes its dispatcher path (``cukit/torch/_register.py``, ``eager_path``) and appears
as ``torch.ops.cukit.<name>``, the op the policy decides about. Under ``torch.compile`` with the
"inductor" compile policy a cukit op is traced as its torch form (``aten::mm``, ...), which the same
groups name.

Memory and time: the checkpointed region keeps its inputs and the outputs of the saved ops; in
backward the region runs again, and saved ops return their stored outputs instead of running. With
``policy="matmul"`` a transformer block keeps its GEMM and attention outputs (about half its
activations) and recomputes only memory-bound ops; ``"none"`` keeps only the inputs and recomputes
everything (one more forward per step).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import re
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "GROUPS",
    "CheckpointReport",
    "SelectivePolicy",
    "checkpoint",
    "checkpoint_context_fn",
    "checkpoint_modules",
    "checkpoint_policy",
]

ModelT = TypeVar("ModelT", bound=nn.Module)

# Ops by qualified name ("namespace::name", every overload). Names torch lacks are harmless.
_GEMM = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::addmv",
    "aten::dot", "aten::vdot", "aten::matmul", "aten::linear", "aten::_addmm_activation", "aten::_scaled_mm",
    "aten::_scaled_grouped_mm", "aten::_grouped_mm", "aten::_int_mm", "aten::_weight_int4pack_mm",
    "aten::_weight_int8pack_mm",
    # cukit's GEMMs; linear_cross_entropy's outputs include the gradients it computes in its forward
    "cukit::matmul", "cukit::linear", "cukit::linear_cross_entropy",
)
_ATTENTION = (
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
)
_CONV = (
    "aten::convolution", "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d",
    "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose", "aten::mkldnn_convolution", "aten::_slow_conv2d_forward",
    "aten::slow_conv3d_forward", "aten::_nnpack_spatial_convolution", "cukit::conv2d",
)
_NORM = (
    "aten::native_layer_norm", "aten::layer_norm", "aten::rms_norm", "aten::_fused_rms_norm",
    "aten::native_batch_norm", "aten::_native_batch_norm_legit", "aten::_native_batch_norm_legit_no_training",
    "aten::cudnn_batch_norm", "aten::native_group_norm", "aten::group_norm", "cukit::rms_norm", "cukit::layer_norm",
)
_COLLECTIVE = (
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce", "_c10d_functional::all_to_all_single",
)

GROUPS: dict[str, frozenset[str]] = {
    "gemm": frozenset(_GEMM),
    "attention": frozenset(_ATTENTION),
    "conv": frozenset(_CONV),
    # what a "matmul-class" op is: its cost is a matrix product (torch's and cukit's GEMMs,
    # scaled dot-product attention, convolutions)
    "matmul": frozenset(_GEMM + _ATTENTION + _CONV),
    "norm": frozenset(_NORM),
    "collective": frozenset(_COLLECTIVE),
}
_SPECIAL = ("all", "none")

Decision = CheckpointPolicy


def _names() -> str:
    return ", ".join(map(repr, [*GROUPS, *_SPECIAL]))


def _op_name(op: Any) -> str:
    """"ns::name" of an OpOverload or OpOverloadPacket."""
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    return op._qualified_op_name  # type: ignore[no-any-return]


def _resolve(items: Any, what: str, fn: str) -> tuple[frozenset[str], tuple[Callable[[Any], bool], ...], bool]:
    """(op names, predicates, everything) from a group name, an op name ("aten::mm", "aten.mm",
    "cukit::linear"), an OpOverload / OpOverloadPacket, a predicate ``op -> bool``, or an iterable
    of these."""
    if isinstance(items, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or callable(items):
        items = (items,)
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"{fn}: {what} must be a name, an op, a predicate or a sequence of them; "
                        f"got {type(items).__qualname__}") from None
    names: set[str] = set()
    preds: list[Callable[[Any], bool]] = []
    everything = False
    for it in items:
        if isinstance(it, str):
            if it == "all":
                everything = True
            elif it == "none":
                pass
            elif it in GROUPS:
                names |= GROUPS[it]
            elif re.fullmatch(r"[A-Za-z_]\w*(::|\.)[A-Za-z_]\w*", it):
                names.add(it.replace(".", "::", 1) if "::" not in it else it)
            else:
                raise ValueError(f"{fn}: {what} names must be groups ({_names()}) or ops ('aten::mm', "
                                 f"'cukit::linear'); got {it!r}")
        elif isinstance(it, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            names.add(_op_name(it))
        elif inspect.isbuiltin(it) or isinstance(it, type):
            # torch.mm and friends are callables too, but not ops the dispatcher names
            raise TypeError(f"{fn}: {what} takes ops as torch.ops.aten.<name> (or 'aten::<name>'), classes and "
                            f"torch functions are not ops; got {it!r}")
        elif callable(it):
            preds.append(it)
        else:
            raise TypeError(f"{fn}: {what} must hold names, ops or predicates; got {type(it).__qualname__}")
    return frozenset(names), tuple(preds), everything


class SelectivePolicy:
    """A selective-checkpoint policy, ``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``, as
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes it: MUST_SAVE for the ops
    it saves, PREFER_RECOMPUTE for all others. Made by :func:`checkpoint_policy`. Decisions are
    cached per op overload (the policy runs once per op call in forward and recompute)."""

    def __init__(self, save: frozenset[str], save_preds: tuple[Callable[[Any], bool], ...], save_all: bool,
                 recompute: frozenset[str], recompute_preds: tuple[Callable[[Any], bool], ...], label: str) -> None:
        self.save, self.save_preds, self.save_all = save, save_preds, save_all
        self.recompute, self.recompute_preds = recompute, recompute_preds
        self.label = label
        self._cache: dict[Any, Decision] = {}
        # made here, not per call: torch.compile needs the context_fn as a constant of the trace
        self.context_fn: Callable[[], tuple[Any, Any]] = functools.partial(create_selective_checkpoint_contexts, self)

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles: no cache of op objects
        return {k: v for k, v in vars(self).items() if k not in ("_cache", "context_fn")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._cache = {}
        self.context_fn = functools.partial(create_selective_checkpoint_contexts, self)

    def decide(self, op: Any) -> Decision:
        """The decision for one op overload (cached)."""
        d = self._cache.get(op)
        if d is None:
            name = _op_name(op)
            if name in self.recompute or any(p(op) for p in self.recompute_preds):
                d = Decision.PREFER_RECOMPUTE
            elif self.save_all or name in self.save or any(p(op) for p in self.save_preds):
                d = Decision.MUST_SAVE
            else:
                d = Decision.PREFER_RECOMPUTE
            self._cache[op] = d
        return d

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.decide(op)

    @property
    def recomputes_everything(self) -> bool:
        return not (self.save or self.save_preds or self.save_all)

    def __repr__(self) -> str:
        return f"cukit.nn.SelectivePolicy({self.label})"


def checkpoint_policy(
    save: Any = ("matmul",),
    *,
    extra_save: Any = (),
    extra_recompute: Any = (),
) -> SelectivePolicy:
    """A selective-checkpoint policy: the outputs of the ops in `save` (and `extra_save`) are kept
    from the forward pass; every other op (elementwise, norms, rope, gated activations, reductions,
    dropout) is recomputed in backward. `extra_recompute` wins over both.

    Each argument is one item or a sequence of items: a group name, an op name ("aten::mm",
    "aten.mm", "cukit::linear"), an ``OpOverload`` / ``OpOverloadPacket``
    (``torch.ops.aten.mm``, ``torch.ops.cukit.linear``), or a predicate ``op -> bool`` called
    once per op overload. Groups (:data:`GROUPS`): "matmul" (= "gemm" + "attention" + "conv"),
    "gemm" (torch's mm/addmm/bmm/baddbmm/_scaled_mm/..., cukit::matmul, cukit::linear,
    cukit::linear_cross_entropy), "attention" (scaled dot-product attention: flash, efficient,
    cuDNN, CPU), "conv" (torch's convolutions, cukit::conv2d), "norm" (torch's and cukit's
    layer/RMS/batch/group norms), "collective" (functional all-gather, reduce-scatter, ...),
    "all", "none".

    Random ops are recomputed with the RNG state of the forward pass (``torch.utils.checkpoint``
    restores it; ``preserve_rng_state=True`` is its default), so dropout masks match.

    Returns a :class:`SelectivePolicy` for ``cukit.nn.checkpoint(policy=...)``,
    :func:`checkpoint_context_fn` or ``create_selective_checkpoint_contexts``.

    See also: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``,
    ``torch.utils.checkpoint.CheckpointPolicy``.
    """
    fn = "cukit.nn.checkpoint_policy"
    s_names, s_preds, s_all = _resolve(save, "save", fn)
    e_names, e_preds, e_all = _resolve(extra_save, "extra_save", fn)
    r_names, r_preds, r_all = _resolve(extra_recompute, "extra_recompute", fn)
    if r_all:
        raise ValueError(f"{fn}: extra_recompute must name ops or groups; got 'all' (use save='none')")
    label = ", ".join(f"{k}={v!r}" for k, v in (("save", save), ("extra_save", extra_save),
                                                  ("extra_recompute", extra_recompute)) if v != ())
    return SelectivePolicy(s_names | e_names, s_preds + e_preds, s_all or e_all, r_names, r_preds, label)


def _as_policy(policy: Any, fn: str) -> SelectivePolicy | Callable[..., Any]:
    """A SelectivePolicy (or a torch-style policy function) from `policy` ("matmul", ...)."""
    if isinstance(policy, SelectivePolicy):
        return policy
    if policy is None:
        policy = "none"
    if isinstance(policy, str):
        if policy not in GROUPS and policy not in _SPECIAL:
            raise ValueError(f"{fn}: policy must be one of {_names()}, a cukit.nn.checkpoint_policy(...) or a "
                             f"policy function (ctx, op, *args, **kwargs) -> CheckpointPolicy; got {policy!r}")
        return _NAMED[policy]
    if isinstance(policy, (list, tuple, set, frozenset)):
        return checkpoint_policy(policy)
    if callable(policy) and not isinstance(policy, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return policy  # torch's form: (ctx, op, *args, **kwargs) -> CheckpointPolicy
    raise TypeError(f"{fn}: policy must be a group name, a sequence of ops or names, a "
                    f"cukit.nn.checkpoint_policy(...) or a policy function; got {type(policy).__qualname__}")


_NAMED = {name: checkpoint_policy(name) for name in [*GROUPS, *_SPECIAL]}


def _recomputes_everything(policy: Any) -> bool:
    return isinstance(policy, SelectivePolicy) and policy.recomputes_everything


def checkpoint_context_fn(policy: Any = "matmul") -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (and for Hugging Face's
    ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant":
    False, "context_fn": cukit.nn.checkpoint_context_fn("matmul")})``) applying `policy` (as
    :func:`checkpoint` takes it). Fresh contexts per call, as torch requires.

    See also: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
    """
    pol = _as_policy(policy, "cukit.nn.checkpoint_context_fn")
    if isinstance(pol, SelectivePolicy):
        return pol.context_fn
    return functools.partial(create_selective_checkpoint_contexts, pol)


def _context_fn(policy: Any, use_reentrant: bool, fn: str) -> Callable[[], tuple[Any, Any]]:
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"{fn}: use_reentrant must be True or False; got {use_reentrant!r}")
    pol = _as_policy(policy, fn)
    if _recomputes_everything(pol):
        return torch.utils.checkpoint.noop_context_fn
    if use_reentrant:
        raise ValueError(f"{fn}: use_reentrant must be False with a selective policy (torch supports "
                         f"context_fn only without reentrant autograd); got use_reentrant=True, policy={policy!r}")
    if isinstance(pol, SelectivePolicy):
        return pol.context_fn
    return functools.partial(create_selective_checkpoint_contexts, pol)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    policy: Any = "matmul",
    use_reentrant: bool = False,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` under activation checkpointing with a selective `policy`:
    ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., context_fn=<policy>,
    **kwargs)``. Under ``torch.no_grad`` (nothing to save) it is a plain call.

    Args:
        function: what to run; its outputs are what the call returns.
        policy: "matmul" (default: keep GEMM, attention and convolution outputs, recompute the rest),
            another group or op list (see :func:`checkpoint_policy`), a :class:`SelectivePolicy`,
            a torch policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``, or "none" /
            None: plain checkpointing (keep only the inputs, recompute everything).
        use_reentrant: False (torch's recommendation); True only with policy "none".
        kwargs: passed to `function`, except ``torch.utils.checkpoint``'s own options
            (``preserve_rng_state``, ``determinism_check``, ``debug``), passed to it.

    Raises:
        ValueError for an unknown policy name, or use_reentrant=True with a selective policy;
        TypeError for a policy of another type.

    See also: ``torch.utils.checkpoint.checkpoint``, :func:`checkpoint_modules`.
    """
    context_fn = _context_fn(policy, use_reentrant, "cukit.nn.checkpoint")
    if not torch.is_grad_enabled():
        own = ("preserve_rng_state", "determinism_check", "debug", "early_stop")
        return function(*args, **{k: v for k, v in kwargs.items() if k not in own})
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, context_fn=context_fn,
                                             **kwargs)


# ---------------------------------------------------------------------------------------------
# checkpoint_modules
# ---------------------------------------------------------------------------------------------


class _CheckpointedForward:
    """A module's forward, checkpointed while grad is enabled (set as the instance's ``forward``,
    so parameters, buffers, hooks and state_dict keys stay as they are). It calls the class's
    forward of the moment: a later class swap (``cukit.nn.patch``) is seen."""

    def __init__(self, module: nn.Module, policy: Any, label: str) -> None:
        self.module = module
        self.policy = policy
        self.label = label
        self.context_fn = _context_fn(policy, False, "cukit.nn.checkpoint_modules")
        self._warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        forward = type(m).forward
        if not torch.is_grad_enabled():
            return forward(m, *args, **kwargs)
        if not getattr(m, "_can_checkpoint_with_cache", False):
            kwargs = self._drop_cache(kwargs)
        return torch.utils.checkpoint.checkpoint(forward, m, *args, use_reentrant=False,
                                                 context_fn=self.context_fn, **kwargs)

    def _drop_cache(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """As transformers' GradientCheckpointingLayer: the recompute would write a KV cache a
        second time (and see the first write), so a checkpointed layer gets none."""
        drop = [k for k in ("past_key_values", "past_key_value", "layer_past") if kwargs.get(k) is not None]
        if not drop and not kwargs.get("use_cache"):
            return kwargs
        if not self._warned:
            self._warned = True
            warnings.warn(f"cukit.nn.checkpoint_modules: {type(self.module).__name__} is checkpointed, so it "
                          f"gets use_cache=False and no KV cache ({', '.join(drop) or 'use_cache'}) in training",
                          stacklevel=3)
        kwargs = dict(kwargs)
        for k in drop:
            kwargs[k] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return kwargs

    def __repr__(self) -> str:
        return f"<checkpointed {type(self.module).__name__}.forward, policy {self.label}>"


@dataclasses.dataclass
class CheckpointReport:
    """What ``checkpoint_modules`` did: ``wrapped`` (module names) and ``skipped`` ((name, why)
    pairs), and the policy. ``str(report)`` folds layer indices (``model.layers.*``)."""

    policy: str
    wrapped: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"cukit.nn.checkpoint_modules: {len(self.wrapped)} wrapped (policy {self.policy}), "
                 f"{len(self.skipped)} skipped"]
        for name, n in Counter(_fold(w) for w in self.wrapped).items():
            lines.append(f"  wrapped {name} x{n}")
        for (name, why), n in Counter((_fold(w), why) for w, why in self.skipped).items():
            lines.append(f"  skipped {name} x{n}: {why}")
        return "\n".join(lines)


def _fold(name: str) -> str:
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", name) or "(root)"


def _repeated_blocks(model: nn.Module) -> list[str]:
    """The children of each outermost ModuleList / Sequential holding two or more modules of one
    class that have submodules of their own (a transformer's layers, a ViT's blocks)."""
    out: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        kids = [c for c in m._modules.values() if c is not None]
        if len(kids) < 2 or len({type(c) for c in kids}) != 1 or not any(True for _ in kids[0].children()):
            continue
        out.extend(f"{name}.{k}" if name else k for k, c in m._modules.items() if c is not None)
    return out


def _selector(modules: Any, model: nn.Module, fn: str) -> Callable[[str, nn.Module], bool]:
    if isinstance(modules, str):
        if modules == "auto":
            chosen = set(_repeated_blocks(model))
            return lambda name, m: name in chosen
        return lambda name, m: fnmatch.fnmatchcase(name, modules)
    if isinstance(modules, type):
        modules = (modules,)
    if isinstance(modules, tuple) and modules and all(isinstance(t, type) for t in modules):
        if not all(issubclass(t, nn.Module) for t in modules):
            raise TypeError(f"{fn}: modules classes must be torch.nn.Module subclasses; got {modules!r}")
        return lambda name, m: isinstance(m, modules)
    if callable(modules):
        return lambda name, m: bool(modules(name, m))
    raise TypeError(f"{fn}: modules must be 'auto', a name pattern ('model.layers.*'), a module class, a tuple of "
                    f"classes, or a predicate (name, module) -> bool; got {modules!r}")


def checkpoint_modules(
    model: ModelT,
    modules: Any = "auto",
    *,
    policy: Any = "matmul",
    verbose: bool = False,
) -> ModelT:
    """Checkpoint the forward of each selected submodule of `model`, in place: while grad is
    enabled the module runs under ``cukit.nn.checkpoint(policy=...)``; under ``no_grad`` it is a
    plain call. The forward is replaced on the instance: no wrapper module, no hooks, so
    parameter names, ``state_dict`` keys and optimizer parameter lists do not change.

    Args:
        model: any ``nn.Module``.
        modules: which submodules: "auto" (the blocks of each outermost ``ModuleList`` /
            ``Sequential`` of two or more composite modules of one class: a Hugging Face decoder's
            ``model.layers.*`` / ``transformer.h.*``, a ViT's ``blocks.*``), a qualified-name
            pattern ("model.layers.*", fnmatch), a module class or tuple of classes, or a
            predicate ``(name, module) -> bool``. Only the outermost match of nested matches is
            wrapped.
        policy: as :func:`checkpoint` ("matmul", "none", a :func:`checkpoint_policy`, ...).
            Wrapping again replaces the policy.
        verbose: print the report.

    Returns `model`, with the :class:`CheckpointReport` as ``model.cukit_checkpoint_report``.

    Skipped (with the reason in the report): modules whose forward is already replaced on the
    instance by someone else (accelerate hooks), and transformers layers with their own gradient
    checkpointing on (they would be checkpointed twice). A checkpointed layer that is passed a KV
    cache in training gets none and ``use_cache=False`` (as transformers does).

    With ``cukit.nn.patch``: patch first, then checkpoint (any modules). Checkpointing first and
    patching after also works when the checkpointed modules are blocks whose children patch
    rewrites (a decoder's layers); patch skips a module whose own forward is checkpointed.

    See also: ``transformers.PreTrainedModel.activation_checkpointing_enable`` (pass it
    ``activation_checkpointing_kwargs={"use_reentrant": False, "context_fn":
    cukit.nn.checkpoint_context_fn("matmul")}``), ``torch.distributed.algorithms.
    _checkpoint.checkpoint_wrapper``.
    """
    fn = "cukit.nn.checkpoint_modules"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module; got {type(model).__qualname__}")
    if not isinstance(verbose, bool):
        raise TypeError(f"{fn}: verbose must be True or False; got {verbose!r}")
    pol = _as_policy(policy, fn)
    _context_fn(pol, False, fn)
    label = repr(policy) if isinstance(policy, str) or policy is None else repr(pol)
    select = _selector(modules, model, fn)
    report = CheckpointReport(label)
    taken: list[str] = []
    for name, m in model.named_modules():
        if not name and modules == "auto":
            continue
        if any(not t or name.startswith(t + ".") for t in taken) or not select(name, m):
            continue
        own = vars(m).get("forward")
        if own is not None and not isinstance(own, _CheckpointedForward):
            report.skipped.append((name, f"{type(m).__name__}.forward is replaced on the instance (an accelerate hook?)"))
            continue
        if getattr(m, "gradient_checkpointing", False) is True:
            report.skipped.append((name, f"{type(m).__name__} has transformers' gradient checkpointing on "
                                         "(model.activation_checkpointing_disable() first)"))
            continue
        m.forward = _CheckpointedForward(m, pol, label)  # type: ignore[method-assign]
        taken.append(name)
        report.wrapped.append(name)
    if not report.wrapped and not report.skipped and modules == "auto":
        report.skipped.append(("", "no ModuleList / Sequential of repeated blocks found: pass modules="))
    model.cukit_checkpoint_report = report  # type: ignore[assignment]
    if verbose:
        print(report)
    return model
