"""``cukit.nn.patch(model)``: put cukit's fused layers into an existing torch model, in place.

The work is a registry of rules (:data:`RULES`, in the order they run). Each rule has a name, which
is also its keyword switch in ``patch``, a default (on or off), and a function that visits one module
and returns the :class:`Change` entries it made or skipped. Later kernels (RMSNorm, gated MLP,
rotary embeddings, the loss) add their own rule with :func:`register_rule`.

Rules swap a module's ``__class__`` in place and do not build new modules. So parameters, buffers,
hooks, ``requires_grad`` and optimizer parameter lists stay valid, and ``state_dict`` keys and values
do not change. An activation that gets fused is replaced by ``nn.Identity`` (it has no parameters, so
indices and keys stay the same).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable
from types import CodeType
from typing import TypeVar

from torch import nn

from cukit.nn.linear import Conv1D, Linear

__all__ = [
    "RULES", "Change", "PatchContext", "PatchReport", "Rule", "activation_of", "derived_class", "patch", "register_rule",
]

ModelT = TypeVar("ModelT", bound=nn.Module)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    """One thing a rule did to the module named `module` ("" is the root), or (`skipped`) chose not
    to do. `what` says what changed, or why nothing did. `rule` is filled in by ``patch``."""

    module: str
    what: str
    skipped: bool = False
    rule: str = ""


@dataclasses.dataclass
class PatchReport:
    """What ``cukit.nn.patch`` did: ``done`` and ``skipped`` (lists of :class:`Change`, in visit
    order) and ``counts`` (rule name -> changes made). ``str(report)`` is a short table. Names
    that differ only in layer indices are folded into one row (``layers.*.mlp``)."""

    done: list[Change] = dataclasses.field(default_factory=list)
    skipped: list[Change] = dataclasses.field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(c.rule for c in self.done))

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {n}" for k, n in self.counts.items()) or "no changes"
        head = f"cukit.nn.patch: {len(self.done)} changed ({counts}), {len(self.skipped)} skipped"
        rows = Counter((c.skipped, c.rule, _fold(c.module), c.what) for c in [*self.done, *self.skipped])
        if not rows:
            return head
        wr = max(len(r[1]) for r in rows) + 5
        wm = max(len(r[2]) for r in rows)
        lines = [head, f"  {'rule':<{wr}} {'module':<{wm}} {'n':>3}  change"]
        for (skipped, rule, module, what), n in rows.items():
            lines.append(f"  {(rule + ' skip' if skipped else rule):<{wr}} {module:<{wm}} {n:>3}  {what}")
        return "\n".join(lines)


def _fold(name: str) -> str:
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", name) or "(root)"


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PatchContext:
    """What a rule may consult besides the module it visits: the model, the rules switched on,
    ``linear_types`` (nn.Linear subclasses to replace too) and ``refs`` (id(module) -> number
    of parent modules holding it, recounted before each rule)."""

    model: nn.Module
    enabled: frozenset[str]
    linear_types: tuple[type[nn.Linear], ...] = ()
    refs: Counter[int] = dataclasses.field(default_factory=Counter)


Visit = Callable[[str, nn.Module, PatchContext], Iterable[Change]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A patch rule: ``visit(qualified_name, module, ctx)`` changes `module` (or its children) in
    place and returns what it did; ``default`` is its switch's value when ``patch`` is not given
    it."""

    name: str
    visit: Visit
    default: bool = True
    doc: str = ""
    last: bool = False


RULES: dict[str, Rule] = {}
_OPTIONS = ("inplace", "verbose", "linear_types")


def register_rule(name: str, *, default: bool = True, before: str | None = None,
                  last: bool = False) -> Callable[[Visit], Visit]:
    """Decorator: add `visit` to :data:`RULES` as rule `name`, which becomes ``patch``'s keyword
    switch `name` (default `default`). Rules run in registration order, or just before rule
    `before` (e.g. a whole-block kernel must see the block before ``fuse_activations`` does);
    `last` rules run after all others (they act on what the swaps made), in registration order."""

    def add(visit: Visit) -> Visit:
        if name in RULES or name in _OPTIONS or not name.isidentifier():
            raise ValueError(f"cukit.nn.patch: rule name {name!r} is taken or not an identifier")
        if before is not None and before not in RULES:
            raise ValueError(f"cukit.nn.patch: no rule {before!r} to insert {name!r} before; rules: {', '.join(RULES)}")
        rule = Rule(name, visit, default, (visit.__doc__ or "").strip().split("\n")[0], last)
        items = list(RULES.items())
        first_last = next((i for i, (_, r) in enumerate(items) if r.last), len(items))
        at = len(items) if last else first_last if before is None else min(list(RULES).index(before), first_last)
        RULES.clear()
        RULES.update([*items[:at], (name, rule), *items[at:]])
        return visit

    return add


def patch(
    model: ModelT,
    *,
    inplace: bool = True,
    verbose: bool = False,
    linear_types: Iterable[type[nn.Linear]] = (),
    **switches: bool,
) -> ModelT:
    """Swap cukit's fused kernels into `model`: ``act(linear(x))`` becomes one
    ``cukit.linear(x, W, b, act)`` wherever that is exact, and the norms, gated MLPs, rotary
    embeddings and the LM head's loss of transformers' models become cukit's fused kernels.

    A linear layer with nothing to fuse stays torch's by default: cuBLAS's GEMM behind torch's C++
    autograd node is as fast as cukit's GEMM and cheaper on the host than a Python autograd node
    (``linear=True`` swaps it anyway).

    Switches (keyword only; one per rule in :data:`RULES`, in the order they run):
        linear=False: every exact ``torch.nn.Linear`` (and the subclasses in `linear_types`) ->
            ``cukit.nn.Linear``, with or without an activation to fuse. Other subclasses are
            skipped, because their forward may differ.
        conv1d=False: likewise every transformers ``Conv1D`` (GPT-2; weight (in, out)) ->
            ``cukit.nn.Conv1D``, found by class name and structure, never by importing transformers.
        fuse_activations=True: an activation (ReLU, GELU erf/tanh, SiLU, transformers'
            GELUActivation, NewGELUActivation, GELUTanh, PytorchGELUTanh, SiLUActivation, ...)
            that directly follows a linear layer (torch's ``nn.Linear``, a `linear_types`
            subclass, transformers' ``Conv1D`` or cukit's) moves into its epilogue: the linear
            becomes cukit's (class swapped) and the activation's module becomes ``nn.Identity``.
            This is done inside ``nn.Sequential`` and in these known blocks, which are found by
            attribute names and by the names their forward reads: Llama-style gated MLP
            (``down(act(gate(x)) * up(x))``: fused into gate_proj when gated_mlp is off),
            ``BertIntermediate``, ``GPT2MLP``, timm's ``Mlp`` (only when ``norm`` is Identity) and
            the ``fc1``/``activation_fn``/``fc2`` MLP of CLIP, SigLIP, ViT and Phi.
            Skipped, with the reason in the report: inexact activations (FastGELU, QuickGELU),
            linears with forward or backward hooks (the fused output is what they would see),
            activations with hooks, modules shared by several parents, forwards replaced on the
            instance (accelerate hooks), and ``nn.Linear`` subclasses not in `linear_types`.

        The rules of the other cukit.nn modules register themselves (``register_rule``), all on by
        default; ``cukit.nn._patch.RULES`` lists them in the order they run:
        gated_mlp=True (runs before fuse_activations): ``down_proj(act(gate_proj(x)) * up_proj(x))``
            -> the activation and the product in one kernel (``cukit.swiglu`` / ``cukit.geglu``).
        rope=True: transformers' ``apply_rotary_pos_emb`` in Llama-family attention ->
            ``cukit.rotary_embedding`` on q and k in place of the two rotations.
        conv2d=True: ``torch.nn.Conv2d`` -> ``cukit.nn.Conv2d`` (implicit GEMM), with a following
            ReLU/GELU/SiLU in an ``nn.Sequential`` fused into it while fuse_activations is on.
        lm_head_loss=True: ``*ForCausalLM`` (Llama- or GPT-2-style) or ``GPT2LMHeadModel`` called with
            ``labels`` -> ``cukit.linear_cross_entropy`` over ``lm_head`` (the logits are never
            made); calls without labels are unchanged.
        rms_norm=True: transformers' RMSNorm modules (Llama-, Gemma- and OLMo-2-style) and
            ``torch.nn.RMSNorm`` over the last dim -> ``cukit.nn.RMSNorm``.
        layer_norm=True: ``torch.nn.LayerNorm`` over the last dim -> ``cukit.nn.LayerNorm``.
        recompute=True (runs last): a module holding cukit's RMSNorm, LayerNorm or
            GatedActivation runs its forward in a ``cukit.nn.recomputing()`` scope: their outputs,
            where later ops save them (the q/k/v and gate/up projections' input, down_proj's
            input), are remade in the backward instead of stored (bitwise the same gradients; a
            Llama block saves about a third less). Off: more memory, no remaking kernels.

    Args:
        model: any ``nn.Module``, on any device, in float16, bfloat16, float32 or float64.
        inplace: False patches ``copy.deepcopy(model)``, so `model` is left untouched.
        verbose: print the report.
        linear_types: subclasses of ``nn.Linear`` whose forward computes ``F.linear``. They are
            replaced too, and lose their own methods.

    Returns:
        The patched model (`model` itself when inplace). Its parameters are the same objects, and
        its ``state_dict`` has the same keys and values. Outputs equal the unpatched model's up to
        rounding: the fused epilogue applies the activation in fp32 and rounds once. The
        :class:`PatchReport` is attached as ``model.cukit_patch_report``. Patching again changes
        nothing (fused activations are already Identity, linears already cukit's).

    Raises:
        TypeError for an unknown keyword (naming the known ones), a switch that is not a bool, a
        model that is not an ``nn.Module``, or `linear_types` that are not ``nn.Linear``
        subclasses.

    See also: ``cukit.nn.Linear``, ``cukit.nn.Conv1D``, ``register_rule``; Liger-Kernel's
    ``apply_liger_kernel_to_llama``.
    """
    unknown = [k for k in switches if k not in RULES]
    if unknown:
        raise TypeError(
            f"cukit.nn.patch() got an unexpected keyword argument {unknown[0]!r}; "
            f"known keywords: {', '.join([*RULES, *_OPTIONS])}"
        )
    for k, v in switches.items():
        if not isinstance(v, bool):
            raise TypeError(f"cukit.nn.patch(): {k} must be True or False; got {v!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"cukit.nn.patch(): model must be a torch.nn.Module; got {type(model).__qualname__}")
    types = tuple(linear_types)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Linear)) or issubclass(t, Linear):
            raise TypeError(f"cukit.nn.patch(): linear_types must be subclasses of torch.nn.Linear; got {t!r}")
    if not inplace:
        model = copy.deepcopy(model)
    enabled = frozenset(n for n, r in RULES.items() if switches.get(n, r.default))
    ctx = PatchContext(model, enabled, types)
    report = PatchReport()
    for rule in RULES.values():
        if rule.name not in enabled:
            continue
        ctx.refs = _parent_counts(model)
        for name, module in list(model.named_modules()):
            for c in rule.visit(name, module, ctx):
                c = dataclasses.replace(c, rule=rule.name)
                (report.skipped if c.skipped else report.done).append(c)
    model.cukit_patch_report = report
    if verbose:
        print(report)
    return model


# ---------------------------------------------------------------------------------------------
# Helpers shared by rules
# ---------------------------------------------------------------------------------------------


def _type_name(t: type) -> str:
    if t.__module__.startswith("torch.nn.modules."):
        return f"torch.nn.{t.__qualname__}"
    return t.__name__


def _parent_counts(model: nn.Module) -> Counter[int]:
    refs: Counter[int] = Counter()
    for parent in model.modules():
        for child in parent._modules.values():
            if child is not None:
                refs[id(child)] += 1
    return refs


def _instance_forward(m: nn.Module) -> str | None:
    # accelerate's hooks (device_map, offload) set forward on the instance, calling the class's
    # original forward: a class swap or a fusion would then be silently bypassed.
    if "forward" in vars(m):
        return f"{type(m).__name__}.forward is replaced on the instance (an accelerate hook?)"
    return None


def derived_class(cls: type, tag: str | None, **attrs: object) -> type:
    """A subclass of `cls` with `attrs` (a new forward, markers), for a rule's class swap: the same
    name and module, so isinstance, reprs and class-name lookups keep working. `tag` marks the
    qualified name (``Cls.<cukit tag>``), so that pickling a whole patched module fails loudly
    instead of loading the unpatched class: save state_dicts."""
    qualname = cls.__qualname__ if tag is None else f"{cls.__qualname__}.<cukit {tag}>"
    return type(cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": qualname, "__doc__": cls.__doc__, **attrs,
    })


def _hooks(m: nn.Module, *, inputs_too: bool) -> str | None:
    kinds = ["forward", "backward", "backward_pre"] + (["forward_pre"] if inputs_too else [])
    found = [k for k in kinds if getattr(m, f"_{k}_hooks", None)]
    return f"{type(m).__name__} has {'/'.join(found)} hooks" if found else None


def _reads(fn: Callable[..., object]) -> frozenset[str]:
    """The attribute and global names a function's code reads (nested code included)."""
    names: set[str] = set()
    stack = [getattr(inspect.unwrap(fn), "__code__", None)]
    while stack:
        code = stack.pop()
        if isinstance(code, CodeType):
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return frozenset(names)


# cukit activation of transformers' activation modules, matched by class name.
_HF_EXACT = {
    "GELUActivation": "gelu",  # F.gelu or x/2 (1 + erf(x/sqrt 2))
    "NewGELUActivation": "gelu_tanh",  # x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUTanhActivation": "gelu_tanh",
    "SiLUActivation": "silu",
    "ReLUActivation": "relu",
}
_NOT_EXACT = {
    "FastGELUActivation": "tanh gelu with sqrt(2/pi) rounded to 0.7978845608",
    "QuickGELUActivation": "x * sigmoid(1.702 x), not gelu",
    "ClippedGELUActivation": "clip(gelu(x), min, max)",
    "AccurateGELUActivation": "tanh gelu with other constants",
}


def activation_of(m: nn.Module) -> tuple[str | None, str | None]:
    """``(name, None)`` when module `m` computes cukit's activation `name` ("relu", "gelu" (erf),
    "gelu_tanh", "silu") exactly; ``(None, why)`` for an activation cukit does not compute;
    ``(None, None)`` for anything else. torch's ReLU/GELU/SiLU are matched by exact type, and
    transformers' activations by class name (transformers is not imported)."""
    t = type(m)
    if t is nn.ReLU:
        return "relu", None
    if t is nn.SiLU:
        return "silu", None
    if t is nn.GELU:
        act = {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate)
        return (act, None) if act else (None, f"GELU(approximate={m.approximate!r}): unknown approximation")
    if t.__name__ in _HF_EXACT:
        return _HF_EXACT[t.__name__], None
    if t.__name__ in _NOT_EXACT:
        return None, f"{t.__name__} is not exact: {_NOT_EXACT[t.__name__]}"
    if t.__module__ == "torch.nn.modules.activation":
        return None, f"{t.__name__} has no cukit epilogue"
    return None, None


def _linear_why_not(m: nn.Module, ctx: PatchContext) -> str | None:
    """Why torch's linear `m` cannot become ``cukit.nn.Linear`` (None: it can)."""
    t = type(m)
    if t is not nn.Linear and t not in ctx.linear_types:
        return f"{_type_name(t)} subclasses torch.nn.Linear; its forward may differ (see linear_types)"
    return _instance_forward(m)


def _to_cukit_linear(m: nn.Module) -> str:
    """Swap an exact torch linear's class to ``cukit.nn.Linear`` in place; what changed."""
    t = type(m)
    m.__class__ = Linear
    m.activation = None
    return f"{_type_name(t)} -> cukit.nn.Linear"


def _conv1d_why_not(m: nn.Module) -> str | None:
    """Why transformers' ``Conv1D`` `m` cannot become ``cukit.nn.Conv1D`` (None: it can)."""
    w, b, nf = getattr(m, "weight", None), getattr(m, "bias", None), getattr(m, "nf", None)
    like_hf = (
        isinstance(w, nn.Parameter)
        and w.ndim == 2
        and w.shape[1] == nf
        and (b is None or (isinstance(b, nn.Parameter) and tuple(b.shape) == (nf,)))
        and {"addmm", "weight", "bias"} <= _reads(type(m).forward)
    )
    if not like_hf:
        return "Conv1D unlike transformers' (nf; weight (nx, nf); bias (nf,); forward addmm(bias, x, weight))"
    return _instance_forward(m)


def _to_cukit_conv1d(m: nn.Module) -> str:
    m.__class__ = Conv1D
    m.nx, m.activation = m.weight.shape[0], None
    return "Conv1D -> cukit.nn.Conv1D"


def _cukit_why_not(lin: nn.Module, ctx: PatchContext) -> str | None:
    """Why the linear `lin` (torch's, transformers' Conv1D or cukit's) cannot carry a fused
    activation (None: it is cukit's, or can become cukit's)."""
    if isinstance(lin, (Linear, Conv1D)):
        return None
    if isinstance(lin, nn.Linear):
        return _linear_why_not(lin, ctx)
    return _conv1d_why_not(lin)


def _fuse(parent: nn.Module, pname: str, lin_key: str, act_key: str, ctx: PatchContext) -> Change | None:
    """Fuse ``parent.<act_key>`` into the linear ``parent.<lin_key>`` (reported under the linear's
    name), or say why not; None when the pair is no candidate (not a linear and an activation)."""
    lin, act = parent._modules.get(lin_key), parent._modules.get(act_key)
    if lin is None or act is None:
        return None
    fn, why = activation_of(act)
    if fn is None and why is None:
        return None
    if not isinstance(lin, (nn.Linear, Conv1D)) and type(lin).__name__ != "Conv1D":
        return None
    where = f"{pname}.{lin_key}" if pname else lin_key
    if fn is None:
        return Change(where, f"{act_key}: {why}", skipped=True)
    reason = (
        _cukit_why_not(lin, ctx)
        or (f"already applies {lin.activation!r}" if getattr(lin, "activation", None) is not None else None)
        or _hooks(lin, inputs_too=False)
        or _hooks(act, inputs_too=True)
        or _instance_forward(lin)
        or _instance_forward(act)
        or (f"shared by {ctx.refs[id(lin)]} parent modules" if ctx.refs[id(lin)] > 1 else None)
    )
    if reason:
        return Change(where, f"{act_key} ({type(act).__name__}) not fused: {reason}", skipped=True)
    swapped = ""
    if not isinstance(lin, (Linear, Conv1D)):
        swapped = (_to_cukit_linear(lin) if isinstance(lin, nn.Linear) else _to_cukit_conv1d(lin)) + ", "
    lin.activation = fn
    identity = nn.Identity()
    identity.train(act.training)
    parent._modules[act_key] = identity
    return Change(where, f"{swapped}{act_key} ({type(act).__name__}) fused: activation={fn!r}, {act_key} -> Identity")


# ---------------------------------------------------------------------------------------------
# Rules (in the order they run)
# ---------------------------------------------------------------------------------------------


# Off by default: with nothing to fuse, cukit's GEMM replaces cuBLAS's at a similar speed and a
# Python autograd node replaces torch's C++ one (benchmarks/NOTES.md, "What patch swaps").
@register_rule("linear", default=False)
def _swap_linear(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """torch.nn.Linear -> cukit.nn.Linear (the same object, its class swapped), fused or not."""
    if not isinstance(m, nn.Linear) or isinstance(m, Linear):
        return []
    if why := _linear_why_not(m, ctx):
        return [Change(name, why, skipped=True)]
    return [Change(name, _to_cukit_linear(m))]


@register_rule("conv1d", default=False)
def _swap_conv1d(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """transformers' Conv1D (y = x @ W + b, W (nx, nf)) -> cukit.nn.Conv1D, same parameters."""
    if type(m).__name__ != "Conv1D" or isinstance(m, Conv1D):
        return []
    if why := _conv1d_why_not(m):
        return [Change(name, why, skipped=True)]
    return [Change(name, _to_cukit_conv1d(m))]


@dataclasses.dataclass(frozen=True)
class _Block:
    """A known MLP block: its forward reads exactly `reads` (all submodules) and applies `act`
    directly to `linear`'s output, once; `identity` lists submodules that must be nn.Identity."""

    kind: str
    linear: str
    act: str
    reads: frozenset[str]
    identity: tuple[str, ...] = ()


_BLOCKS = (
    _Block("gated MLP", "gate_proj", "act_fn", frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})),
    _Block("BertIntermediate", "dense", "intermediate_act_fn", frozenset({"dense", "intermediate_act_fn"})),
    _Block("GPT2MLP", "c_fc", "act", frozenset({"c_fc", "act", "c_proj", "dropout"})),
    _Block("timm Mlp", "fc1", "act", frozenset({"fc1", "act", "drop1", "norm", "fc2", "drop2"}), ("norm",)),
    _Block("timm Mlp", "fc1", "act", frozenset({"fc1", "act", "drop", "fc2"})),  # timm < 0.6
    _Block("fc1/activation_fn/fc2 MLP", "fc1", "activation_fn", frozenset({"fc1", "activation_fn", "fc2"})),
)


@register_rule("fuse_activations")
def _fuse_activations(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """act(linear(x)) -> one cukit linear with act in its epilogue (Sequential, known MLP blocks)."""
    if isinstance(m, nn.Sequential):
        # a subclass with its own forward may not chain its children
        if type(m).forward is not nn.Sequential.forward or "forward" in vars(m):
            return []
        keys = list(m._modules)
        found = (_fuse(m, name, a, b, ctx) for a, b in itertools.pairwise(keys))
        return [c for c in found if c is not None]
    for block in _BLOCKS:
        if not all(isinstance(m._modules.get(k), nn.Module) for k in block.reads):
            continue
        reads = _reads(type(m).forward)
        if reads != block.reads:
            diff = [f"{w} {', '.join(sorted(d)[:6])}{', ...' if len(d) > 6 else ''}"
                    for w, d in (("also reads", reads - block.reads), ("does not read", block.reads - reads)) if d]
            why = f"{block.kind}'s submodules, but its forward {'; '.join(diff)}: not known to be exact"
            return [Change(name, why, skipped=True)]
        for k in block.identity:
            if type(m._modules[k]) is not nn.Identity:
                return [Change(name, f"{block.kind}: {k} is {type(m._modules[k]).__name__}, not Identity", skipped=True)]
        c = _fuse(m, name, block.linear, block.act, ctx)
        return [] if c is None else [dataclasses.replace(c, what=f"{block.kind}: {c.what}")]
    return []
