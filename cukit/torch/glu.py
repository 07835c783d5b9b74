"""``torch.ops.cukit.glu`` and ``torch.ops.cukit.glu_backward`` (through the one registration helper,
``cukit/torch/_register.py``), and their entry points ``swiglu``, ``geglu``, ``glu``.

CUDA tensors run raw_kernels/glu.cu on torch's current stream (so CUDA graphs capture them); CPU
tensors run the torch reference. Under ``torch.autocast`` glu behaves as an elementwise op: gate and
up are cast to the wider of their dtypes. Under ``torch.compile`` (the "inductor" compile policy)
the torch reference is traced instead, which inductor fuses into one kernel.

Autograd, to any order:
- glu: ``dgate = g * up * act'(gate)``, ``dup = g * act(gate)``: one ``glu_backward`` call (the
  activation is recomputed; only gate and up are saved).
- glu_backward (double backward), with upstream gradients ``(a, b)`` of (dgate, dup):
  ``d/dg = a * up * act' + b * act``, ``d/dup = a * g * act'``,
  ``d/dgate = a * g * up * act'' + b * g * act'``, in torch ops.
"""

from __future__ import annotations

import torch

from cukit.ops import bias_act as _ba
from cukit.ops import glu as _op
from cukit.torch._register import DIRECT, DISPATCH, FLOATS, TorchOp, autocast_promote, eager_path
from cukit.torch.bias_act import _act_second_derivative

__all__ = ["geglu", "glu", "glu_backward", "swiglu"]


# ---------------------------------------------------------------------------------------------
# cukit::glu
# ---------------------------------------------------------------------------------------------


def _glu_impl(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up; see ``cukit.swiglu`` / ``cukit.geglu``."""
    if gate.is_cuda:
        return _op.forward_gpu(gate, up, _op.glu_activation_id(activation, _op.public_name(activation)))
    if not (gate.dtype is up.dtype and gate.dtype in FLOATS and gate.shape == up.shape
            and activation in _op.GLU_ACTIVATIONS):
        _op.validate(gate, up, activation)
    return _op.reference_torch(gate, up, activation)


def _glu_fake(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    _op.validate(gate, up, activation)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _glu_compile_as(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """What torch.compile traces under the "inductor" policy: the reference (one fused kernel)."""
    _op.validate(gate, up, activation)
    return _op.reference_torch(gate, up, activation)


def _glu_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _glu_bwd(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    dgate, dup = glu_backward(grad, gate, up, ctx.activation)
    return (dgate if ctx.needs_input_grad[0] else None, dup if ctx.needs_input_grad[1] else None, None)


def _batch_first(info: torch.library.VmapInfo, t: torch.Tensor, dim: int | None) -> torch.Tensor:
    return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)


def _glu_vmap(info: torch.library.VmapInfo, in_dims: tuple, gate: torch.Tensor, up: torch.Tensor,
              activation: str) -> tuple[torch.Tensor, int]:
    gate, up = _batch_first(info, gate, in_dims[0]), _batch_first(info, up, in_dims[1])
    return glu(gate, up, activation), 0


GLU = TorchOp(
    "glu",
    _glu_impl,
    fake=_glu_fake,
    setup_context=_glu_setup,
    backward=_glu_bwd,
    autocast="promote",
    vmap=_glu_vmap,
    compile_as=_glu_compile_as,
)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for torch tensors, differentiable; activation "silu" (``cukit.swiglu``),
    "gelu" or "gelu_tanh" (``cukit.geglu``)."""
    path = eager_path(gate, up)
    if path == DISPATCH:
        return GLU(gate, up, activation)
    cast = autocast_promote((gate, up), "cuda" if gate.is_cuda else "cpu")
    if cast is not None:
        gate, up = cast  # type: ignore[assignment]
    if path == DIRECT:
        if gate.is_cuda:
            return _op.forward_gpu(gate, up, _op.glu_activation_id(activation, _op.public_name(activation)))
        return _glu_impl(gate, up, activation)
    return GLU.graph_call(path, gate, up, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for torch tensors; see ``cukit.swiglu``."""
    return glu(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate, approximate) * up for torch tensors; see ``cukit.geglu``."""
    return glu(gate, up, _op.gelu_activation(approximate))


# ---------------------------------------------------------------------------------------------
# cukit::glu_backward
# ---------------------------------------------------------------------------------------------


def _bwd_impl(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad * up * act'(gate), grad * act(gate))."""
    if gate.is_cuda:
        return _op.backward_gpu(grad, gate, up, _op.glu_activation_id(activation, _op.public_name(activation, True)))
    _check(grad, gate, up, activation)
    return _op.reference_backward_torch(grad, gate, up, activation)


def _check(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    fn = _op.public_name(activation, backward=True)
    kind, _, _ = _op.validate(gate, up, activation, fn)
    _op.check_grad(fn, grad, gate, kind)


def _bwd_fake(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check(grad, gate, up, activation)
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


def _bwd_compile_as(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    _check(grad, gate, up, activation)
    return _op.reference_backward_torch(grad, gate, up, activation)


def _bwd_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    grad, gate, up, activation = inputs
    ctx.save_for_backward(grad, gate, up)
    ctx.activation = activation


def _bwd_bwd(ctx: torch.autograd.function.FunctionCtx, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple:
    grad, gate, up = ctx.saved_tensors
    act = ctx.activation
    if a is None and b is None:
        return None, None, None, None
    acc = _ba._acc_dtype(gate)
    g, z, u = grad.to(acc), gate.to(acc), up.to(acc)
    a = torch.zeros_like(z) if a is None else a.to(acc)
    b = torch.zeros_like(z) if b is None else b.to(acc)
    a1 = _ba._torch_act_grad(z, act)
    need = ctx.needs_input_grad
    d_grad = (a * u * a1 + b * _ba._torch_act(z, act)).to(grad.dtype) if need[0] else None
    d_gate = (g * (a * u * _act_second_derivative(z, act) + b * a1)).to(gate.dtype) if need[1] else None
    d_up = (a * g * a1).to(up.dtype) if need[2] else None
    return d_grad, d_gate, d_up, None


def _bwd_vmap(info: torch.library.VmapInfo, in_dims: tuple, grad: torch.Tensor, gate: torch.Tensor,
              up: torch.Tensor, activation: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    grad, gate, up = (_batch_first(info, t, d) for t, d in zip((grad, gate, up), in_dims[:3], strict=True))
    return glu_backward(grad, gate, up, activation), (0, 0)


GLU_BACKWARD = TorchOp(
    "glu_backward",
    _bwd_impl,
    fake=_bwd_fake,
    setup_context=_bwd_setup,
    backward=_bwd_bwd,
    autocast="promote",
    vmap=_bwd_vmap,
    compile_as=_bwd_compile_as,
)


def glu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of glu for torch tensors, differentiable (double backward); see
    ``cukit.swiglu_backward``."""
    path = eager_path(gate, grad, up)
    if path == DIRECT:
        if gate.is_cuda:
            return _op.backward_gpu(grad, gate, up,
                                    _op.glu_activation_id(activation, _op.public_name(activation, True)))
        return _bwd_impl(grad, gate, up, activation)
    return GLU_BACKWARD.graph_call(path, grad, gate, up, activation)
