"""``torch.ops.cukit.conv2d`` and ``torch.ops.cukit.conv2d_backward`` (through the one registration
helper, ``cukit/torch/_register.py``), and their entry points.

CUDA tensors run raw_kernels/conv2d.cu on torch's current stream (so CUDA graphs capture them); CPU
tensors run the torch reference. Under ``torch.autocast`` conv2d runs in the autocast dtype, as
``F.conv2d`` does. Under ``torch.compile`` with the default compile policy it is traced as
``F.conv2d`` + the activation (inductor runs cuDNN and fuses the activation), except float32 on
CUDA while cuDNN may use TF32 (cukit's kernels are IEEE float32: the custom op is kept).

The op returns ``(y, z)``: z, the pre-activation, is filled only when ``save_preact`` (the entry
point asks for it when autograd will need it: gelu, gelu_tanh, silu); it is an output the backward
reads, not differentiable. relu's derivative comes from y; no activation needs nothing.

Autograd, to any order:
- conv2d: one ``conv2d_backward`` call: ``g = dy * act'(z)``, ``dW = wgrad(x, g)``,
  ``db = sum g``, ``dx = conv_transpose(g, W)`` (dx only when x needs it).
- conv2d_backward (double backward), in torch ops: with ``h = conv(gdx, W) + conv(x, gdW) + gdb``
  (what the upstream gradients of dx, dW and db ask of g), ``d/d dy = h * act'(z)`` and
  ``dz = h * dy * act''(z)``, which reaches x, W and b through ``z = conv(x, W) + b``; plus the
  cross terms ``d/dx += conv_transpose(g, gdW)``, ``d/dW += wgrad(gdx, g)``.
"""

from __future__ import annotations

from typing import Any

import torch

from cukit.ops import conv2d as _op
from cukit.ops.bias_act import _torch_act, activation_id
from cukit.torch._register import DIRECT, DISPATCH, TorchOp, autocast_lower, eager_path
from cukit.torch.bias_act import _act_second_derivative

__all__ = ["conv2d", "conv2d_backward"]

_SAVES_Z = _op.SAVES_PREACTIVATION


def _act_id(activation: str | None) -> int:
    return -1 if activation is None else activation_id(activation, "cukit.conv2d", allow_none=True)


def _check_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, params: Any,
               activation: str | None, fn: str = "cukit.conv2d") -> Any:
    """The full checks (the CPU path and fake tensors: no plan cache to skip them); the params."""
    _op.validate(x, weight, bias, activation, fn)
    params = _op._as_params(params)
    _op.geometry(x.shape, weight.shape, params, fn)
    return params


# ---------------------------------------------------------------------------------------------
# cukit::conv2d
# ---------------------------------------------------------------------------------------------


def _conv2d_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = act(conv2d(x, weight) + bias), z the pre-activation when save_preact (else an
    empty tensor). padding: (top, left, bottom, right). See ``cukit.conv2d``."""
    if x.is_cuda:
        y, z = _op.forward_gpu(x, weight, bias, (stride, padding, dilation), _act_id(activation), save_preact)
        return y, (y.new_empty(0) if z is None else z)
    params = _check_cpu(x, weight, bias, (stride, padding, dilation), activation)
    y, z = _op.reference_torch(x, weight, bias, params, activation, return_z=save_preact)
    return y, (y.new_empty(0) if z is None else z)


def _conv2d_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    save_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _op.validate(x, weight, bias, activation)
    shape = _op.output_shape(x.shape, weight.shape, (stride, padding, dilation))
    return x.new_empty(shape), x.new_empty(shape if save_preact else (0,))


def _conv2d_compile_as(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    save_preact: bool,
) -> Any:
    """``act(F.conv2d(x, weight, bias))`` in torch's ops, what inductor compiles cukit::conv2d as
    (the compile policy). float32 on CUDA while cuDNN may use TF32 keeps the custom op: cukit's
    kernels compute in IEEE float32. Numerics are torch's: a 16-bit convolution is rounded before
    the activation."""
    if x.is_cuda and x.dtype is torch.float32 and torch.backends.cudnn.allow_tf32:
        return NotImplemented
    _op.validate(x, weight, bias, activation)
    _op.output_shape(x.shape, weight.shape, (stride, padding, dilation))
    z = _op.torch_conv(x, weight, bias, (stride, padding, dilation))
    y = z if activation is None else _torch_act(z, activation)
    return y, (z if save_preact else z.new_empty(0))


def _conv2d_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x, weight, bias, stride, padding, dilation, activation, save_preact = inputs
    y, z = output
    ctx.mark_non_differentiable(z)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for z (y-sized) per backward
    saved = z if save_preact and activation in _SAVES_Z else y if activation == "relu" else None
    ctx.save_for_backward(x, weight, bias, saved)
    ctx.params = (stride, padding, dilation)
    ctx.activation = activation


def _conv2d_bwd(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor | None, dz: torch.Tensor | None) -> tuple:
    x, weight, bias, saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None or not (needs[0] or needs[1] or needs[2]):
        return (None,) * 8
    act = ctx.activation
    if act in _SAVES_Z and saved is None:  # called without save_preact: recompute z
        saved = CONV2D(x.detach(), weight.detach(), None if bias is None else bias.detach(), *ctx.params, None,
                       False)[0]
    dx, dw, db = conv2d_backward(dy, x, weight, bias, saved, *ctx.params, act, needs[0])
    return dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, None, None, None, None, None


def _conv2d_pair(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
                 padding: list[int], dilation: list[int], activation: str | None,
                 save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's outputs in torch ops (vmap's per-sample fallback)."""
    y, z = _op.reference_torch(x, weight, bias, (stride, padding, dilation), activation, return_z=True)
    return y, (z if save_preact else z.new_empty(0))


def _conv2d_vmap(info: torch.library.VmapInfo, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, stride: list[int], padding: list[int], dilation: list[int],
                 activation: str | None, save_preact: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    xd, wd, bd = in_dims[0], in_dims[1], in_dims[2]
    B = info.batch_size
    if wd is None and bd is None and xd is not None:  # shared parameters: the batch folds into N
        x = x.movedim(xd, 0)
        y, z = CONV2D(x.flatten(0, 1), weight, bias, stride, padding, dilation, activation, save_preact)
        y = y.unflatten(0, x.shape[:2])
        z = z.unflatten(0, x.shape[:2]) if save_preact else z.new_empty(B, 0)
        return (y, z), (0, 0)
    # per-sample parameters: torch's own batching rules over the reference
    def one(x_: torch.Tensor, w_: torch.Tensor, b_: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return _conv2d_pair(x_, w_, b_, stride, padding, dilation, activation, save_preact)

    return torch.vmap(one, in_dims=(xd, wd, bd))(x, weight, bias), (0, 0)


CONV2D = TorchOp(
    "conv2d",
    _conv2d_impl,
    fake=_conv2d_fake,
    setup_context=_conv2d_setup,
    backward=_conv2d_bwd,
    autocast="lower",
    vmap=_conv2d_vmap,
    compile_as=_conv2d_compile_as,
)


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    activation: str | None = None,
) -> torch.Tensor:
    """y = act(conv2d(x, weight) + bias) for torch tensors, differentiable; see ``cukit.conv2d``."""
    if x.ndim == 3:  # one image
        return conv2d(x.unsqueeze(0), weight, bias, stride, padding, dilation, activation).squeeze(0)
    ks = weight.shape[2:] if weight.ndim == 4 else (1, 1)
    path = eager_path(x, weight, bias)
    if path == DISPATCH:
        params = _op.parse_params(stride, padding, dilation, ks)
        save = activation in _SAVES_Z and torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        return CONV2D(x, weight, bias, *params, activation, save)[0]
    params = _op.conv_params(stride, padding, dilation, ks)
    act = _act_id(activation)
    cast = autocast_lower((x, weight, bias), "cuda" if x.is_cuda else "cpu")
    if cast is not None:
        x, weight, bias = cast  # type: ignore[assignment]
    if path == DIRECT:
        if x.is_cuda:
            return _op.forward_gpu(x, weight, bias, params, act, False)[0]
        return _conv2d_impl(x, weight, bias, *params, activation, False)[0]
    return CONV2D.graph_call(path, x, weight, bias, *params, activation, activation in _SAVES_Z)[0]


# ---------------------------------------------------------------------------------------------
# cukit::conv2d_backward
# ---------------------------------------------------------------------------------------------


def _bwd_impl(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    need_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of conv2d: dx empty unless need_input, dbias empty without a bias.
    saved: z for gelu, gelu_tanh, silu; y for relu; None without an activation. bias is read only
    for its presence (and by the double backward)."""
    params = (stride, padding, dilation)
    if x.is_cuda:
        dx, dw, db = _op.backward_gpu(grad, x, weight, saved, params, _act_id(activation), bias is not None,
                                      need_input)
    else:
        params = _check_cpu(x, weight, bias, params, activation, "cukit.conv2d (backward)")
        _check_saved(grad, x, weight, saved, params, activation)
        dx, dw, db = _op.reference_backward_torch(grad, x, weight, saved, params, activation, bias is not None,
                                                  need_input)
    return (x.new_empty(0) if dx is None else dx), dw, (weight.new_empty(0) if db is None else db)


def _check_saved(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, saved: torch.Tensor | None, params: Any,
                 activation: str | None) -> None:
    shape = _op.output_shape(x.shape, weight.shape, params)
    for name, t, needed in (("grad", grad, True), ("saved", saved, activation is not None)):
        if needed and (t is None or tuple(t.shape) != tuple(shape) or t.dtype != x.dtype):
            got = "None" if t is None else f"shape {tuple(t.shape)}, dtype {t.dtype}"
            raise ValueError(f"cukit.conv2d (backward): {name} must have y's shape {tuple(shape)} and x's dtype "
                             f"{x.dtype}; got {got}")


def _bwd_fake(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    need_input: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _op.validate(x, weight, bias, activation, "cukit.conv2d (backward)")
    _op.output_shape(x.shape, weight.shape, (stride, padding, dilation))
    return (
        x.new_empty(x.shape if need_input else (0,)),
        weight.new_empty(weight.shape),
        weight.new_empty((weight.shape[0],) if bias is not None else (0,)),
    )


def _bwd_compile_as(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    activation: str | None,
    need_input: bool,
) -> Any:
    """The reference backward in torch's ops (cuDNN's convolution_backward once compiled)."""
    if x.is_cuda and x.dtype is torch.float32 and torch.backends.cudnn.allow_tf32:
        return NotImplemented
    _op.validate(x, weight, bias, activation, "cukit.conv2d (backward)")
    dx, dw, db = _op.reference_backward_torch(grad, x, weight, saved, (stride, padding, dilation), activation,
                                              bias is not None, need_input)
    return (x.new_empty(0) if dx is None else dx), dw, (weight.new_empty(0) if db is None else db)


def _bwd_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    grad, x, weight, bias, saved, stride, padding, dilation, activation, need_input = inputs
    ctx.save_for_backward(grad, x, weight, bias, saved)
    ctx.params = (stride, padding, dilation)
    ctx.activation = activation
    ctx.need_input = need_input


def _bwd_bwd(ctx: torch.autograd.function.FunctionCtx, gdx: torch.Tensor | None, gdw: torch.Tensor | None,
             gdb: torch.Tensor | None) -> tuple:
    grad, x, weight, bias, saved = ctx.saved_tensors
    params, act = ctx.params, ctx.activation
    if not ctx.need_input:
        gdx = None
    if bias is None:
        gdb = None
    none = (None,) * 10
    if gdx is None and gdw is None and gdb is None:
        return none
    acc = _op._acc_dtype(x)
    w, xa, dy = weight.to(acc), x.to(acc), grad.to(acc)
    # h = dL/dg for g = dy * act'(z), through dx = conv_transpose(g, W), dW = wgrad(x, g), db = sum g
    h = None
    if gdx is not None:
        h = _op.torch_conv(gdx.to(acc), w, None, params)
    if gdw is not None:
        t = _op.torch_conv(xa, gdw.to(acc), None, params)
        h = t if h is None else h + t
    if gdb is not None:
        t = gdb.to(acc).reshape(1, -1, 1, 1)
        h = t.expand(dy.shape) if h is None else h + t
    s1 = _op.act_derivative_torch(saved.to(acc), act) if act is not None else None
    g = dy if s1 is None else dy * s1
    needs = ctx.needs_input_grad
    d_grad = (h if s1 is None else h * s1).to(grad.dtype) if needs[0] else None
    dz = h * dy * _act_second_derivative(saved.to(acc), act) if act in _SAVES_Z else None
    d_x = d_w = d_b = None
    if needs[1]:
        d_x = _add(None if dz is None else _op.torch_conv_input_grad(dz, w, tuple(x.shape), params),
                   None if gdw is None else _op.torch_conv_input_grad(g, gdw.to(acc), tuple(x.shape), params))
        d_x = None if d_x is None else d_x.to(x.dtype)
    if needs[2]:
        d_w = _add(None if dz is None else _op.torch_conv_weight_grad(xa, dz, tuple(weight.shape), params),
                   None if gdx is None else _op.torch_conv_weight_grad(gdx.to(acc), g, tuple(weight.shape), params))
        d_w = None if d_w is None else d_w.to(weight.dtype)
    if needs[3] and dz is not None:
        d_b = dz.sum((0, 2, 3)).to(bias.dtype)
    return d_grad, d_x, d_w, d_b, None, None, None, None, None, None


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


def _bwd_vmap(info: torch.library.VmapInfo, in_dims: tuple, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, saved: torch.Tensor | None, stride: list[int], padding: list[int],
              dilation: list[int], activation: str | None, need_input: bool) -> tuple[tuple, tuple[int, int, int]]:
    """Per-sample gradients by torch's batching rules over the reference backward."""
    def one(g_: torch.Tensor, x_: torch.Tensor, w_: torch.Tensor, s_: torch.Tensor | None) -> tuple:
        dx, dw, db = _op.reference_backward_torch(g_, x_, w_, s_, (stride, padding, dilation), activation,
                                                  bias is not None, need_input)
        return (x_.new_empty(0) if dx is None else dx), dw, (w_.new_empty(0) if db is None else db)

    dims = (in_dims[0], in_dims[1], in_dims[2], in_dims[4])
    return torch.vmap(one, in_dims=dims)(grad, x, weight, saved), (0, 0, 0)


CONV2D_BACKWARD = TorchOp(
    "conv2d_backward",
    _bwd_impl,
    fake=_bwd_fake,
    setup_context=_bwd_setup,
    backward=_bwd_bwd,
    autocast="lower",
    vmap=_bwd_vmap,
    compile_as=_bwd_compile_as,
)


def conv2d_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    saved: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    activation: str | None,
    need_input: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) of ``cukit.conv2d`` for torch tensors, differentiable (double backward):
    dx None unless need_input, dbias None when bias is None. stride, padding (top, left, bottom,
    right), dilation as ``cukit.ops.conv2d.conv_params`` gives them; saved: z for gelu, gelu_tanh and
    silu, y for relu, None without an activation."""
    path = eager_path(grad, x, weight, bias, saved)
    if path == DIRECT and x.is_cuda:
        return _op.backward_gpu(grad, x, weight, saved, (stride, padding, dilation), _act_id(activation),
                                bias is not None, need_input)
    if path == DIRECT:
        dx, dw, db = _bwd_impl(grad, x, weight, bias, saved, stride, padding, dilation, activation, need_input)
    else:
        dx, dw, db = CONV2D_BACKWARD.graph_call(path, grad, x, weight, bias, saved, stride, padding, dilation,
                                                activation, need_input)
    return (dx if need_input else None), dw, (db if bias is not None else None)
