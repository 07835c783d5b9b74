"""``torch.ops.cukit.bias_act`` and ``torch.ops.cukit.bias_act_backward`` (through the one
registration helper, ``cukit/torch/_register.py``), and their entry points.

CUDA tensors run raw_kernels/bias_act.cu on torch's current stream (so CUDA graphs capture them);
CPU tensors run the torch reference. Under ``torch.autocast`` bias_act behaves as an elementwise
op: x and bias are cast to the wider of their dtypes.

Autograd, to any order:
- bias_act: ``dx = g * act'(z)``, ``db = sum_rows(dx)`` with ``z = x + bias``: one
  ``bias_act_backward`` call.
- bias_act_backward (double backward): with ``h = gdx + gdb`` (the upstream gradients of dx and
  db, db's broadcast over rows), ``d/dg = h * act'(z)`` (``bias_act_backward`` again) and
  ``d/dz = h * g * act''(z)`` (torch ops; zero for relu), summed over rows for the bias.
"""

from __future__ import annotations

import torch

from cukit.ops import bias_act as _op
from cukit.torch._register import DIRECT, DISPATCH, FLOATS, TorchOp, autocast_promote, eager_path

__all__ = ["bias_act", "bias_act_backward"]


# ---------------------------------------------------------------------------------------------
# cukit::bias_act
# ---------------------------------------------------------------------------------------------


def _bias_act_impl(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """y = act(x + bias); see ``cukit.bias_act``."""
    if x.is_cuda:
        return _op.forward_gpu(x, bias, _op.activation_id(activation))
    # CPU: the checks torch's own broadcasting would not make (bias exactly (C,) of x's float
    # dtype, a known activation) are cheap; the rest only when torch refuses
    if not (
        x.dtype is bias.dtype
        and x.dtype in FLOATS
        and bias.ndim == 1
        and x.ndim >= 1
        and bias.shape[0] == x.shape[-1]
        and activation in _op.ACTIVATIONS
    ):
        _op.validate(x, bias, activation)
    try:
        return _op.reference_torch(x, bias, activation)
    except RuntimeError:
        _op.validate(x, bias, activation)
        raise



def _bias_act_fake(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    _op.validate(x, bias, activation)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _bias_act_compile_as(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """The torch reference (one pointwise kernel once inductor fuses it): what torch.compile traces
    for cukit::bias_act under the "inductor" compile policy."""
    _op.validate(x, bias, activation)
    return _op.reference_torch(x, bias, activation)


def _bias_act_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, bias, activation = inputs
    ctx.save_for_backward(x, bias)
    ctx.activation = activation


def _bias_act_bwd(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx, dbias = bias_act_backward(grad, x, bias, ctx.activation)  # launches directly when not recorded
    return (dx if ctx.needs_input_grad[0] else None, dbias if ctx.needs_input_grad[1] else None, None)


def _bias_act_vmap(info: torch.library.VmapInfo, in_dims: tuple, x: torch.Tensor, bias: torch.Tensor,
                   activation: str) -> tuple[torch.Tensor, int]:
    xd, bd = in_dims[0], in_dims[1]
    x = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
    if bd is None:  # one bias for every sample: the kernel as it is, batch in front
        return bias_act(x, bias, activation), 0
    # a bias per sample: (B, C) broadcast over each sample's rows (plain torch maths)
    bias = bias.movedim(bd, 0).reshape(info.batch_size, *([1] * (x.ndim - 2)), x.shape[-1])
    acc = _op._acc_dtype(x)
    return _op._torch_act(x.to(acc) + bias.to(acc), activation).to(x.dtype), 0


BIAS_ACT = TorchOp(
    "bias_act",
    _bias_act_impl,
    fake=_bias_act_fake,
    setup_context=_bias_act_setup,
    backward=_bias_act_bwd,
    autocast="promote",
    vmap=_bias_act_vmap,
    compile_as=_bias_act_compile_as,
)


def bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str = "relu") -> torch.Tensor:
    """y = act(x + bias) for torch tensors, differentiable; see ``cukit.bias_act``."""
    path = eager_path(x, bias)
    if path == DISPATCH:
        return BIAS_ACT(x, bias, activation)
    cast = autocast_promote((x, bias), "cuda" if x.is_cuda else "cpu")
    if cast is not None:
        x, bias = cast  # type: ignore[assignment]
    if path == DIRECT:
        if x.is_cuda:
            return _op.forward_gpu(x, bias, _op.activation_id(activation))
        return _bias_act_impl(x, bias, activation)
    return BIAS_ACT.graph_call(path, x, bias, activation)


# ---------------------------------------------------------------------------------------------
# cukit::bias_act_backward
# ---------------------------------------------------------------------------------------------


def _bwd_impl(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) = (grad * act'(x + bias), dx summed over all but the last dimension)."""
    if x.is_cuda:
        return _op.backward_gpu(grad, x, bias, _op.activation_id(activation))
    kind, _, _ = _op.validate(x, bias, activation)
    _op._check_grad("bias_act_backward", grad, x, kind)
    return _op.reference_backward_torch(grad, x, bias, activation)


def _bwd_fake(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    kind, _, _ = _op.validate(x, bias, activation)
    _op._check_grad("bias_act_backward", grad, x, kind)
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(bias.shape, dtype=bias.dtype, device=bias.device),
    )


def _bwd_compile_as(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    _op.validate(x, bias, activation, "cukit.bias_act_backward")
    _op._check_grad("cukit.bias_act_backward", grad, x, "torch")
    return _op.reference_backward_torch(grad, x, bias, activation)


def _bwd_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    grad, x, bias, activation = inputs
    ctx.save_for_backward(grad, x, bias)
    ctx.activation = activation


def _act_second_derivative(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act''(z) in torch ops (differentiable again)."""
    if activation == "relu":
        return torch.zeros_like(z)
    if activation == "gelu":  # d/dz [Phi(z) + z phi(z)] = 2 phi(z) - z^2 phi(z)
        phi = _op._INV_SQRT_2PI * torch.exp(-0.5 * z * z)
        return phi * (2 - z * z)
    if activation == "gelu_tanh":
        c, a = _op._SQRT_2_OVER_PI, 0.044715
        u = c * (z + a * z * z * z)
        du = c * (1 + 3 * a * z * z)
        t = torch.tanh(u)
        sech2 = 1 - t * t
        # d/dz [0.5 (1 + t) + 0.5 z sech2 du]
        return sech2 * du - z * sech2 * t * du * du + 0.5 * z * sech2 * c * 6 * a * z
    s = torch.sigmoid(z)  # silu: d/dz [s (1 + z (1 - s))] = s (1 - s) (2 + z (1 - 2 s))
    return s * (1 - s) * (2 + z * (1 - 2 * s))


def _bwd_bwd(ctx: torch.autograd.function.FunctionCtx, gdx: torch.Tensor | None, gdb: torch.Tensor | None) -> tuple:
    grad, x, bias = ctx.saved_tensors
    act = ctx.activation
    if gdx is None and gdb is None:
        return None, None, None, None
    h = gdb.expand(x.shape) if gdx is None else (gdx if gdb is None else gdx + gdb)  # type: ignore[union-attr]
    d_grad = d_x = d_bias = None
    if ctx.needs_input_grad[0]:
        d_grad = bias_act_backward(h.contiguous(), x, bias, act)[0]
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        acc = _op._acc_dtype(x)
        z = x.to(acc) + bias.to(acc)
        dz = h.to(acc) * grad.to(acc) * _act_second_derivative(z, act)
        if ctx.needs_input_grad[1]:
            d_x = dz.to(x.dtype)
        if ctx.needs_input_grad[2]:
            d_bias = dz.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return d_grad, d_x, d_bias, None


def _bwd_vmap(info: torch.library.VmapInfo, in_dims: tuple, grad: torch.Tensor, x: torch.Tensor,
              bias: torch.Tensor, activation: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    B = info.batch_size
    gd, xd, bd = in_dims[0], in_dims[1], in_dims[2]
    grad = grad.movedim(gd, 0) if gd is not None else grad.expand(B, *grad.shape)
    x = x.movedim(xd, 0) if xd is not None else x.expand(B, *x.shape)
    C = x.shape[-1]
    acc = _op._acc_dtype(x)
    if bd is None:  # the kernel for dx; dbias per sample, not over the whole batch
        dx, _ = bias_act_backward(grad.contiguous(), x.contiguous(), bias, activation)
    else:
        b = bias.movedim(bd, 0).reshape(B, *([1] * (x.ndim - 2)), C)
        z = x.to(acc) + b.to(acc)
        dx = (grad.to(acc) * _op._torch_act_grad(z, activation)).to(x.dtype)
    dbias = dx.to(acc).reshape(B, -1, C).sum(1).to(bias.dtype)
    return (dx, dbias), (0, 0)


BIAS_ACT_BACKWARD = TorchOp(
    "bias_act_backward",
    _bwd_impl,
    fake=_bwd_fake,
    setup_context=_bwd_setup,
    backward=_bwd_bwd,
    autocast="promote",
    vmap=_bwd_vmap,
    compile_as=_bwd_compile_as,
)


def bias_act_backward(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str = "relu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) of bias_act for torch tensors, differentiable (double backward); see
    ``cukit.bias_act_backward``."""
    path = eager_path(x, grad, bias)
    if path == DIRECT:
        if x.is_cuda:
            return _op.backward_gpu(grad, x, bias, _op.activation_id(activation))
        return _bwd_impl(grad, x, bias, activation)
    return BIAS_ACT_BACKWARD.graph_call(path, grad, x, bias, activation)
