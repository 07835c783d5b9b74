"""The one registration helper: how a cukit op becomes a torch op.

:class:`TorchOp` takes an op's implementation (CUDA tensors: cukit's kernels; CPU tensors: the
reference) and its formulas, and registers, once:

- ``torch.ops.cukit.<name>``, a ``torch.library`` custom op (opaque to ``torch.compile``), with
  its fake implementation (output metadata for tracing), its autograd formula
  (``setup_context`` + ``backward``), its vmap rule where it has one, and its autocast rule for
  CUDA and CPU (``"lower"``: floating inputs cast to the autocast dtype, as ``torch.matmul`` and
  ``F.linear`` do; ``"promote"``: cast to the widest input dtype, as elementwise ops behave);
- ``TorchOp.Function``, a ``torch.autograd.Function`` built from the same formulas, which eager
  calls use: the dispatcher round trip of a Python custom op costs more host time than the
  kernel launch it wraps. It is an old-style Function (``forward(ctx, ...)``): one with a
  ``setup_context`` binds its arguments with ``inspect.signature`` on every call;
- ``TorchOp.FunctorchFunction``, the same formulas with ``setup_context`` and the vmap rule, for
  functorch transforms (``torch.func.vmap`` / ``grad`` / ``jacrev``: per-sample gradients), which
  torch's custom ops do not support under ``grad``.

Under ``torch.compile`` an op that has a ``compile_as`` form (the same maths in torch's own ops)
is traced as that form while the compile policy is "inductor" (the default): inductor then
generates the fused code itself (cuBLAS or its own GEMM templates with the bias and activation fused,
one Triton kernel for an elementwise or reduction op) and calls it from its generated wrapper, where a
custom op costs a Python kernel behind the dispatcher on every call. In a compiled model that host
cost outweighs what cukit's kernel saves on the GPU for matmul, linear and elementwise ops
(benchmarks/NOTES.md, "The compile policy"). Ops with no torch form that inductor could produce (a
chunked fused loss) stay custom ops. :func:`set_compile_policy` ("kernels") keeps every cukit op as
its custom op in compiled graphs.

Each op's entry point (``cukit/torch/<op>.py``) then picks one of four paths per call:

1. DIRECT launch: plain tensors, no autograd graph to record, nothing tracing (the hot path of
   inference and of backward passes);
2. FUNCTION (``Function.apply``): plain tensors that need a graph (eager training);
3. FUNCTORCH (``FunctorchFunction.apply``): inside functorch transforms;
4. DISPATCH (``op``, the dispatcher): ``torch.compile``, tensor subclasses, dispatch modes,
   ``torch.jit`` tracing.

:func:`eager_path` makes that choice in one place, and :func:`autocast_lower` /
:func:`autocast_promote` apply an autocast rule on the eager paths (the dispatcher applies the
registered rule itself). Backward formulas call the ops' entry points, so they are
differentiable again (double backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from cukit import interop

# torch recorded in interop's module cache now, so that array_kind inside a compiled region
# reads that cache rather than sys.modules (see interop._loaded)
interop._loaded("torch")

__all__ = [
    "DIRECT",
    "DISPATCH",
    "FLOATS",
    "FUNCTION",
    "FUNCTORCH",
    "TorchOp",
    "autocast_lower",
    "autocast_promote",
    "eager_path",
    "get_compile_policy",
    "set_compile_policy",
]

_LIB = torch.library.Library("cukit", "FRAGMENT")  # the autocast kernels live here

DIRECT, FUNCTION, FUNCTORCH, DISPATCH = 0, 1, 2, 3
# The float dtypes cukit's kernels take (cukit.ops' FLOAT_DTYPES), as torch dtypes.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_AUTOCAST_CUDA, _AUTOCAST_CPU = torch._C.DispatchKey.AutocastCUDA, torch._C.DispatchKey.AutocastCPU
_AUTOGRAD = (torch._C.DispatchKey.AutogradCUDA, torch._C.DispatchKey.AutogradCPU)

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_tracing = torch._C._is_tracing  # torch.jit.is_tracing without its Python frame (eager only: dynamo
# never reaches it, _is_compiling answers first)


COMPILE_POLICIES = ("inductor", "kernels")
_COMPILE_POLICY = "inductor"


def set_compile_policy(policy: str) -> None:
    """How cukit ops appear in ``torch.compile``'d code: "inductor" (default) traces every op that
    has a form in torch's own ops as that form, so inductor fuses and launches it without a Python
    call per op; "kernels" keeps each op as its ``torch.ops.cukit`` custom op (cukit's kernels run
    inside the compiled graph). Ops without a torch form (fused losses) are custom ops either way.
    Read when a function is traced (dynamo guards on it: changing it recompiles).

    See also: ``torch.compiler.disable``, ``torch.library.custom_op``.
    """
    global _COMPILE_POLICY
    if policy not in COMPILE_POLICIES:
        raise ValueError(
            f"cukit.torch.set_compile_policy: policy must be one of {', '.join(map(repr, COMPILE_POLICIES))}; "
            f"got {policy!r}"
        )
    _COMPILE_POLICY = policy


def get_compile_policy() -> str:
    """The current compile policy: "inductor" or "kernels" (see :func:`set_compile_policy`)."""
    return _COMPILE_POLICY


def eager_path(*tensors: torch.Tensor | None) -> int:
    """Which path a call takes (see the module docstring): DIRECT, FUNCTION, FUNCTORCH or
    DISPATCH. The first tensor must not be None."""
    if _is_compiling() or _len_dispatch_stack() or _is_tracing():
        return DISPATCH
    functorch = _functorch_active()
    grad = _is_grad_enabled()
    needs = False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN:
            return DISPATCH
        if functorch:
            continue
        if grad and t.requires_grad:
            needs = True
    if functorch:
        return FUNCTORCH
    return FUNCTION if needs else DIRECT


def _eligible(t: Any, device_type: str) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype is not torch.float64
        and t.device.type == device_type
    )


def autocast_lower(tensors: Sequence[torch.Tensor | None], device_type: str) -> list[torch.Tensor | None] | None:
    """The tensors cast to the autocast dtype when autocast is on for `device_type` (float64 and
    non-floating tensors are left alone, as torch's autocast does); None when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dt = torch.get_autocast_dtype(device_type)
    return [t.to(dt) if t is not None and t.dtype is not dt and _eligible(t, device_type) else t for t in tensors]


def autocast_promote(tensors: Sequence[torch.Tensor | None], device_type: str) -> list[torch.Tensor | None] | None:
    """The tensors cast to the widest floating dtype among them when autocast is on (what an
    elementwise op does with mixed dtypes); None when autocast is off or nothing changes."""
    if not torch.is_autocast_enabled(device_type):
        return None
    eligible = [t for t in tensors if t is not None and _eligible(t, device_type)]
    if len({t.dtype for t in eligible}) <= 1:
        return None
    dt = eligible[0].dtype
    for t in eligible[1:]:
        dt = torch.promote_types(dt, t.dtype)
    return [t.to(dt) if t is not None and _eligible(t, device_type) and t.dtype is not dt else t for t in tensors]


AutocastRule = Literal["lower", "promote"] | None
_RULES: dict[str, Callable[..., Any]] = {"lower": autocast_lower, "promote": autocast_promote}


class TorchOp:
    """One cukit op in torch (see the module docstring).

    Args:
        name: the op's name in the ``cukit`` namespace (``torch.ops.cukit.<name>``).
        impl: the implementation, with type annotations (torch infers the op's schema from them);
            dispatches on the device itself (CUDA: kernels, CPU: reference).
        fake: output metadata for tracing (same arguments).
        setup_context, backward: the autograd formula, as ``torch.library.register_autograd``
            takes it; ``backward`` returns one gradient (or None) per input.
        autocast: "lower", "promote" or None (see the module docstring); applies to the op's
            tensor arguments.
        vmap: a rule as ``torch.library.register_vmap`` takes it, or None (vmap then falls back
            to torch's per-sample loop, which custom ops do not support: an error).
        compile_as: the op in torch's own ops (same arguments as `impl`), traced by
            ``torch.compile`` instead of the custom op under the "inductor" compile policy; it may
            return ``NotImplemented`` to keep the custom op for a call (semantics torch's ops do not
            reproduce). None: always the custom op.

    See also: ``torch.library.custom_op``, ``torch.autograd.Function``.
    """

    def __init__(
        self,
        name: str,
        impl: Callable[..., Any],
        *,
        fake: Callable[..., Any],
        setup_context: Callable[..., None] | None = None,
        backward: Callable[..., Any] | None = None,
        autocast: AutocastRule = None,
        vmap: Callable[..., Any] | None = None,
        compile_as: Callable[..., Any] | None = None,
    ) -> None:
        self.name = name
        self.impl = impl
        self.compile_as = compile_as
        self._direct: Callable[..., bool] | None = None  # set by _register_light_autograd
        self.op = torch.library.custom_op(f"cukit::{name}", impl, mutates_args=())
        # CUDA tensors reach `impl` straight from the dispatcher's CUDA key (what compiled graphs
        # call): custom_op's own default kernel wraps every call in dynamo-disabling and aliasing
        # checks, several µs of host time per op.
        _LIB.impl(name, impl, "CUDA")
        self.op.register_fake(fake)
        if backward is not None:
            if setup_context is None:
                raise TypeError(f"TorchOp {name}: backward needs setup_context")
            self.op.register_autograd(backward, setup_context=setup_context)
            self._register_light_autograd(impl)

            def forward(ctx: Any, *args: Any) -> Any:
                out = impl(*args)
                setup_context(ctx, args, out)
                # the backward formulas ignore the gradients of outputs marked non-differentiable
                # (a norm's statistics): None, not a zero-filled tensor allocated and launched for
                # each one per backward (torch.library's own autograd does the same)
                ctx._materialize_non_diff_grads = False
                return out

            self.Function: type[torch.autograd.Function] = type(
                f"{name}_function",
                (torch.autograd.Function,),
                {
                    "forward": staticmethod(forward),
                    "backward": staticmethod(backward),
                    "__doc__": f"Eager autograd for cukit::{name} (the op's own formulas).",
                },
            )
            # the C-level apply: Function.apply's Python wrapper only adds functorch handling,
            # which the FUNCTION path never needs (FUNCTORCH takes FunctorchFunction)
            self._function_apply = super(torch.autograd.Function, self.Function).apply  # type: ignore[misc]

            def functorch_setup(ctx: Any, inputs: tuple, output: Any) -> None:
                setup_context(ctx, inputs, output)
                ctx._materialize_non_diff_grads = False

            members: dict[str, Any] = {
                "forward": staticmethod(impl),
                "setup_context": staticmethod(functorch_setup),
                "backward": staticmethod(backward),
                "__doc__": f"cukit::{name} under functorch transforms (the op's own formulas and vmap rule).",
            }
            if vmap is not None:
                members["vmap"] = staticmethod(vmap)
            self.FunctorchFunction: type[torch.autograd.Function] = type(
                f"{name}_functorch_function", (torch.autograd.Function,), members
            )
        if vmap is not None:
            self.op.register_vmap(vmap)
        self.autocast = autocast
        if autocast is not None:
            self._register_autocast(_RULES[autocast])

    def _register_light_autograd(self, impl: Callable[..., Any]) -> None:
        """A lighter kernel on the AutogradCUDA / AutogradCPU keys: when nothing needs a graph
        (grad mode off, or no input requires grad: every call inside a compiled graph, whose
        autograd is AOTAutograd's) and nothing but the backend lies below (no tracing, fake or
        functionalization key), it calls the implementation directly; otherwise it defers to the
        kernel ``register_autograd`` generated. custom_op's generated kernel redispatches through
        a second Python kernel on every call, which doubled the host cost of a cukit op in a
        compiled model. Skipped (the generated kernel serves alone) where torch lacks the pieces."""
        try:
            from torch._library.autograd import make_autograd_impl

            generated = make_autograd_impl(self.op._opoverload, self.op)
            after = torch._C._after_autograd_keyset
            below = torch._C._AutoDispatchBelowAutograd
            any_requires_grad = torch._C._any_requires_grad
        except (ImportError, AttributeError, TypeError):
            return
        overload = self.op._opoverload
        backends = (torch._C.DispatchKey.CUDA, torch._C.DispatchKey.CPU)

        def direct(keyset: Any, args: Sequence[Any]) -> bool:
            """Whether a call may go straight to `impl`: no graph to record, only a backend below."""
            return not (_is_grad_enabled() and any_requires_grad(*args)) and (
                (keyset & after).highestPriorityTypeId() in backends
            )

        def kernel(keyset: Any, *args: Any) -> Any:
            if _is_grad_enabled() and any_requires_grad(*args):
                return generated(keyset, *args)
            rest = keyset & after
            if rest.highestPriorityTypeId() in backends:
                return impl(*args)
            with below():
                return overload.redispatch(rest, *args)

        self._direct = direct
        for device_type in ("CUDA", "CPU"):
            _LIB.impl(self.name, kernel, "Autograd" + device_type, with_keyset=True)

    def _register_autocast(self, rule: Callable[..., Any]) -> None:
        for device_type in ("cuda", "cpu"):
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

            def kernel(keyset: Any, *args: Any, _excluded: Any = excluded, _dev: str = device_type) -> Any:
                # Below this key autocast is off for the call, as in torch's own autocast kernels.
                idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
                cast = rule([args[i] for i in idx], _dev)
                changed = False
                if cast is not None:
                    args = list(args)  # type: ignore[assignment]
                    for i, t in zip(idx, cast, strict=True):
                        changed = changed or t is not args[i]
                        args[i] = t
                # nothing to cast and nothing to record (a compiled graph under autocast: its casts
                # are in the graph): the implementation, without a second trip through the dispatcher
                # (the check: autograd is the next key below autocast, so no tracer or other layer
                # sits in between, and the light autograd kernel would call impl itself)
                direct = self._direct
                if (
                    not changed
                    and direct is not None
                    and keyset.remove(_AUTOCAST_CUDA).remove(_AUTOCAST_CPU).highestPriorityTypeId() in _AUTOGRAD
                    and direct(keyset, args)
                ):
                    return self.impl(*args)
                with torch._C._ExcludeDispatchKeyGuard(_excluded):
                    return self.op._opoverload(*args)

            _LIB.impl(self.name, kernel, key, with_keyset=True)

    def __call__(self, *args: Any) -> Any:
        """Call the registered op through the dispatcher (every path: autocast, autograd, vmap);
        while ``torch.compile`` traces under the "inductor" policy, the op's ``compile_as`` form."""
        if self.compile_as is not None and _is_compiling() and _COMPILE_POLICY == "inductor":
            out = self.compile_as(*self._autocast_args(args))
            if out is not NotImplemented:
                return out
        return self.op(*args)

    def _autocast_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with the op's autocast rule applied, as its Autocast kernel would (the compile_as
        form is traced instead of the op, so the rule is applied here)."""
        if self.autocast is None:
            return args
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if not idx:
            return args
        cast = _RULES[self.autocast]([args[i] for i in idx], args[idx[0]].device.type)
        if cast is None:
            return args
        out = list(args)
        for i, t in zip(idx, cast, strict=True):
            out[i] = t
        return tuple(out)

    def graph_call(self, path: int, *args: Any) -> Any:
        """The op on the FUNCTION, FUNCTORCH or DISPATCH path (``eager_path``'s answer)."""
        if path == FUNCTION:
            return self._function_apply(*args)
        if path == FUNCTORCH:
            return self.FunctorchFunction.apply(*args)
        return self(*args)
