"""``torch.ops.cukit.bias_act`` and its backward, registered with ``torch.library.custom_op``.

The op is opaque to torch.compile (``register_fake`` gives its output metadata) and differentiable
(``register_autograd``). CUDA tensors run raw_kernels/bias_act.cu on torch's current stream;
CPU tensors run the torch reference.

Dispatch cost: a custom op call goes through torch's dispatcher (and Python-side schema checks),
which costs a few microseconds more than launching the kernel directly. When no autograd graph is
needed and nothing is being traced, ``bias_act`` below launches directly; otherwise it calls the
registered op. ``benchmarks/bench_bias_act.py`` measures both paths against torch's ``x + b``.
"""

from __future__ import annotations

import torch

from cukit.ops import bias_act as _op

__all__ = ["bias_act"]


@torch.library.custom_op("cukit::bias_act", mutates_args=())
def bias_act_op(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """y = act(x + bias); see ``cukit.bias_act``."""
    _, act, _ = _op.validate(x, bias, activation)
    if x.is_cuda:
        return _op.forward_gpu(x, bias, act)
    return _op.reference_torch(x, bias, activation)


@bias_act_op.register_fake
def _bias_act_fake(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    _op.validate(x, bias, activation)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("cukit::bias_act_backward", mutates_args=())
def bias_act_backward_op(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) = (grad * act'(x + bias), dx summed over all but the last dimension)."""
    _, act, _ = _op.validate(x, bias, activation)
    if x.is_cuda:
        return _op.backward_gpu(grad, x, bias, act)
    return _op.reference_backward_torch(grad, x, bias, activation)


@bias_act_backward_op.register_fake
def _bias_act_backward_fake(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(bias.shape, dtype=bias.dtype, device=bias.device),
    )


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, bias, activation = inputs
    ctx.save_for_backward(x, bias)
    ctx.activation = activation


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx, dbias = bias_act_backward_op(grad, x, bias, ctx.activation)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dbias if ctx.needs_input_grad[1] else None,
        None,
    )


bias_act_op.register_autograd(_backward, setup_context=_setup_context)


# Tensor subclasses (FakeTensor, DTensor, functorch wrappers), tracers and dispatch modes
# (make_fx, FlopCounterMode) must see the op, so they go through the dispatcher.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_current_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode


def bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str = "relu") -> torch.Tensor:
    """y = act(x + bias) for torch tensors; see ``cukit.bias_act`` (arguments already validated)."""
    if (
        type(x) in _PLAIN
        and type(bias) in _PLAIN
        and x.is_cuda
        and not (torch.is_grad_enabled() and (x.requires_grad or bias.requires_grad))
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and _current_dispatch_mode() is None
    ):
        # Direct launch: skips the dispatcher when there is nothing for it to do.
        return _op.forward_gpu(x, bias, _op.ACTIVATIONS[activation])
    return bias_act_op(x, bias, activation)
