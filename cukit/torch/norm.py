"""``torch.ops.cukit.rms_norm``, ``layer_norm`` and their backward ops (through the one
registration helper, ``cukit/torch/_register.py``), and their entry points.

CUDA tensors run raw_kernels/norm.cu on torch's current stream (so CUDA graphs capture them); CPU
tensors run the torch reference. The forward ops return the output and the per-row statistics
(rstd, and mean for layer_norm: float32, float64 for float64 x), which autograd saves beside x: no
normalised copy of x is kept. The entry points return the output only, and skip the statistics
when nothing records a graph.

Autocast: layer_norm follows torch's rule for ``aten::layer_norm`` (CUDA autocast runs it in
float32: every floating input is cast to float32 and the output is float32; CPU autocast leaves it
alone). rms_norm follows Hugging Face's RMSNorm modules, which handle mixed dtypes themselves: no
cast (a bfloat16 x with a float32 weight gives float32 for cast="llama", bfloat16 for "gemma").

Autograd: the backward ops compute dx in one pass over each row from x and the saved statistics,
and the weight (bias) gradient as per-block partial sums reduced in a fixed order. Their own
backward (double backward) is the vector-Jacobian product of the torch reference's backward
formula (``torch.func.vjp``), which recomputes the statistics from x: exact to second order and
differentiable again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cukit.ops import norm as _op
from cukit.torch._register import DIRECT, TorchOp, eager_path

__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward"]

_is_autocast_enabled = torch.is_autocast_enabled


def _mode(cast: str) -> int:
    mode = _op.MODE_OF_CAST.get(cast)  # type: ignore[call-overload]
    return _op.check_cast("cukit.rms_norm", cast) if mode is None else mode


def _lead(t: torch.Tensor | None, dim: int | None, batch: int) -> torch.Tensor | None:
    """t with its vmap batch dimension first (an unbatched t expanded to the batch)."""
    if t is None:
        return None
    return t.movedim(dim, 0) if dim is not None else t.expand(batch, *t.shape)


def _per_sample(p: torch.Tensor, dim: int, x: torch.Tensor) -> torch.Tensor:
    """A per-sample (B, H) parameter broadcastable against x (B, ..., H)."""
    return p.movedim(dim, 0).reshape(x.shape[0], *([1] * (x.ndim - 2)), x.shape[-1])


def _zeros_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def _vjp(f: Callable[..., tuple[torch.Tensor, ...]], primals: tuple[torch.Tensor, ...],
         cotangents: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The vector-Jacobian product of the torch reference `f` at `primals` (the double backward)."""
    _, vjp = torch.func.vjp(f, *primals)
    return vjp(cotangents)


# ---------------------------------------------------------------------------------------------
# cukit::rms_norm
# ---------------------------------------------------------------------------------------------


def _rms_impl(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd); see ``cukit.rms_norm``."""
    if x.is_cuda:
        y, _, rstd = _op.forward_gpu(x, weight, None, _mode(cast), eps, offset, True)
        return y, rstd
    _op.validate_rms(x, weight, eps, offset, cast)
    return _op.rms_norm_reference_torch(x, weight, eps, offset, cast)


def _rms_fake(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: str
) -> tuple[torch.Tensor, torch.Tensor]:
    c = _op.validate_rms(x, weight, eps, offset, cast)
    return (torch.empty(x.shape, dtype=getattr(torch, c.out), device=x.device),
            torch.empty(x.shape[:-1], dtype=_op._acc(x.dtype), device=x.device))


def _rms_compile_as(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, cast: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (inductor fuses it into one reduction kernel): what torch.compile traces
    for cukit::rms_norm under the "inductor" compile policy."""
    _op.validate_rms(x, weight, eps, offset, cast)
    return _op.rms_norm_reference_torch(x, weight, eps, offset, cast)


def _rms_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, eps, offset, cast = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset, ctx.cast = eps, offset, cast


def _rms_bwd(ctx: Any, gy: torch.Tensor, _grstd: Any) -> tuple:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(gy, x, weight, rstd, ctx.eps, ctx.offset, ctx.cast)
    need = ctx.needs_input_grad
    return dx if need[0] else None, dw if weight is not None and need[1] else None, None, None, None


def _rms_vmap(info: Any, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
              cast: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
    x = _lead(x, in_dims[0], info.batch_size)  # type: ignore[assignment]
    if weight is None or in_dims[1] is None:  # one weight for every sample: the kernel, batch in front
        return _rms_call(x, weight, eps, offset, cast), (0, 0)
    w = _per_sample(weight, in_dims[1], x)
    return _op.rms_norm_reference_torch(x, w, eps, offset, cast), (0, 0)


RMS_NORM = TorchOp(
    "rms_norm",
    _rms_impl,
    fake=_rms_fake,
    setup_context=_rms_setup,
    backward=_rms_bwd,
    vmap=_rms_vmap,
    compile_as=_rms_compile_as,
)


def _rms_call(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
              cast: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) through the path eager_path picks."""
    path = eager_path(x, weight)
    if path == DIRECT:
        return _rms_impl(x, weight, eps, offset, cast)
    return RMS_NORM.graph_call(path, x, weight, eps, offset, cast)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = 1e-6, *, offset: float = 0.0,
             cast: str = "llama") -> torch.Tensor:
    """y = x̂ · (offset + weight) for torch tensors, differentiable; see ``cukit.rms_norm``."""
    if eps is None:
        eps = _op.EPS_OF["float64" if x.dtype is torch.float64 else "float32"]
    path = eager_path(x, weight)
    if path == DIRECT:
        if x.is_cuda:  # inference: no statistics kept
            return _op.forward_gpu(x, weight, None, _mode(cast), eps, offset, False)[0]
        return _rms_impl(x, weight, eps, offset, cast)[0]
    return RMS_NORM.graph_call(path, x, weight, eps, offset, cast)[0]


# ---------------------------------------------------------------------------------------------
# cukit::rms_norm_backward
# ---------------------------------------------------------------------------------------------


def _rms_bwd_impl(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, eps: float, offset: float,
    cast: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) from the forward's rstd; dweight is empty without a weight. eps serves the
    double backward (which recomputes the statistics)."""
    if x.is_cuda:
        dx, dw, _ = _op.backward_gpu(grad, x, weight, None, None, rstd, _mode(cast), offset)
    else:
        c = _op.validate_rms(x, weight, eps, offset, cast, "cukit.rms_norm_backward")
        _op.check_grad("cukit.rms_norm_backward", grad, x, c)
        dx, dw = _op.rms_norm_backward_reference_torch(grad, x, weight, eps, offset, cast, rstd)
    return dx, x.new_empty(0) if dw is None else dw


def _rms_bwd_fake(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, eps: float, offset: float,
    cast: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = _op.validate_rms(x, weight, eps, offset, cast, "cukit.rms_norm_backward")
    _op.check_grad("cukit.rms_norm_backward", grad, x, c)
    dw = torch.empty(0, dtype=x.dtype, device=x.device) if weight is None else torch.empty_like(weight)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw


def _rms_bwd_compile_as(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, eps: float, offset: float,
    cast: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = _op.validate_rms(x, weight, eps, offset, cast, "cukit.rms_norm_backward")
    _op.check_grad("cukit.rms_norm_backward", grad, x, c)
    dx, dw = _op.rms_norm_backward_reference_torch(grad, x, weight, eps, offset, cast, rstd)
    return dx, x.new_empty(0) if dw is None else dw


def _rms_bwd_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    grad, x, weight, _rstd, eps, offset, cast = inputs
    ctx.save_for_backward(grad, x, weight)
    ctx.eps, ctx.offset, ctx.cast = eps, offset, cast


def _rms_bwd_bwd(ctx: Any, gdx: torch.Tensor | None, gdw: torch.Tensor | None) -> tuple:
    grad, x, weight = ctx.saved_tensors
    eps, offset, cast = ctx.eps, ctx.offset, ctx.cast
    if weight is None:
        def f(g: torch.Tensor, xx: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (_op.rms_norm_backward_reference_torch(g, xx, None, eps, offset, cast)[0],)

        dg, dxx = _vjp(f, (grad, x), (_zeros_if_none(gdx, x),))
        return dg, dxx, None, None, None, None, None

    def fw(g: torch.Tensor, xx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _op.rms_norm_backward_reference_torch(g, xx, w, eps, offset, cast)  # type: ignore[return-value]

    dg, dxx, dww = _vjp(fw, (grad, x, weight), (_zeros_if_none(gdx, x), _zeros_if_none(gdw, weight)))
    return dg, dxx, dww, None, None, None, None


def _rms_bwd_vmap(info: Any, in_dims: tuple, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                  rstd: torch.Tensor, eps: float, offset: float,
                  cast: str) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int | None]]:
    B = info.batch_size
    grad, x, rstd = (_lead(t, d, B) for t, d in zip((grad, x, rstd), (in_dims[0], in_dims[1], in_dims[3]),
                                                      strict=True))
    if weight is not None and in_dims[2] is not None:  # a weight per sample: torch ops
        dx, dw = _op.rms_norm_backward_reference_torch(grad, x, _per_sample(weight, in_dims[2], x), eps, offset,
                                                       cast, rstd, keep=1)
        return (dx, dw), (0, 0)
    dx, _ = rms_norm_backward(grad.contiguous(), x.contiguous(), weight, rstd.contiguous(), eps, offset, cast)
    if weight is None:
        return (dx, x.new_empty(0)), (0, None)
    # the kernel's dweight sums over the whole batch: per sample with torch ops
    _, dw = _op.rms_norm_backward_reference_torch(grad, x, weight, eps, offset, cast, rstd, keep=1)
    return (dx, dw), (0, 0)


RMS_NORM_BACKWARD = TorchOp(
    "rms_norm_backward",
    _rms_bwd_impl,
    fake=_rms_bwd_fake,
    setup_context=_rms_bwd_setup,
    backward=_rms_bwd_bwd,
    vmap=_rms_bwd_vmap,
    compile_as=_rms_bwd_compile_as,
)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      eps: float, offset: float, cast: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight or None) of rms_norm from its saved rstd, differentiable (double backward)."""
    path = eager_path(x, grad, weight)
    if path == DIRECT:
        if x.is_cuda:
            dx, dw, _ = _op.backward_gpu(grad, x, weight, None, None, rstd, _mode(cast), offset)
            return dx, dw
        dx, dw = _rms_bwd_impl(grad, x, weight, rstd, eps, offset, cast)
    else:
        dx, dw = RMS_NORM_BACKWARD.graph_call(path, grad, x, weight, rstd, eps, offset, cast)
    return dx, None if weight is None else dw


# ---------------------------------------------------------------------------------------------
# cukit::layer_norm
# ---------------------------------------------------------------------------------------------


def _ln_impl(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd); see ``cukit.layer_norm``."""
    if x.is_cuda:
        return _op.forward_gpu(x, weight, bias, _op.LAYER, eps, 0.0, True)  # type: ignore[return-value]
    _op.validate_layer(x, None, weight, bias, eps)
    return _op.layer_norm_reference_torch(x, weight, bias, eps)


def _ln_fake(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _op.validate_layer(x, None, weight, bias, eps)
    acc = _op._acc(x.dtype)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape[:-1], dtype=acc, device=x.device),
            torch.empty(x.shape[:-1], dtype=acc, device=x.device))


def _ln_compile_as(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference: what torch.compile traces for cukit::layer_norm under the "inductor"
    compile policy (the entry point has applied autocast already)."""
    _op.validate_layer(x, None, weight, bias, eps)
    return _op.layer_norm_reference_torch(x, weight, bias, eps)


def _ln_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps = eps


def _ln_bwd(ctx: Any, gy: torch.Tensor, _gmean: Any, _grstd: Any) -> tuple:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(gy, x, weight, bias, mean, rstd, ctx.eps)
    need = ctx.needs_input_grad
    return dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None


def _ln_vmap(info: Any, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             eps: float) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int]]:
    x = _lead(x, in_dims[0], info.batch_size)  # type: ignore[assignment]
    if (weight is None or in_dims[1] is None) and (bias is None or in_dims[2] is None):
        return _ln_call(x, weight, bias, eps), (0, 0, 0)
    w = weight if weight is None or in_dims[1] is None else _per_sample(weight, in_dims[1], x)
    b = bias if bias is None or in_dims[2] is None else _per_sample(bias, in_dims[2], x)
    return _op.layer_norm_reference_torch(x, w, b, eps), (0, 0, 0)


LAYER_NORM = TorchOp(
    "layer_norm",
    _ln_impl,
    fake=_ln_fake,
    setup_context=_ln_setup,
    backward=_ln_bwd,
    vmap=_ln_vmap,
    compile_as=_ln_compile_as,
)


def _ln_call(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path = eager_path(x, weight, bias)
    if path == DIRECT:
        return _ln_impl(x, weight, bias, eps)
    return LAYER_NORM.graph_call(path, x, weight, bias, eps)


def _autocast_fp32(x: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """torch's CUDA autocast rule for layer_norm: floating inputs other than float64 to float32."""
    def f32(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_cuda or not t.is_floating_point() or t.dtype in (torch.float32, torch.float64):
            return t
        return t.float()

    return f32(x), f32(weight), f32(bias)  # type: ignore[return-value]


def layer_norm(x: torch.Tensor, normalized_shape: Any = None, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """y = (x − mean) / sqrt(var + eps) · weight + bias for torch tensors, differentiable; see
    ``cukit.layer_norm``."""
    if normalized_shape is not None and not (
        type(normalized_shape) in (tuple, torch.Size) and len(normalized_shape) == 1
        and normalized_shape[0] == x.shape[-1]
    ):
        _op.last_dim("cukit.layer_norm", x, normalized_shape)
    # the autocast rule on every path: torch.compile traces these casts (no Autocast kernel is registered)
    if x.is_cuda and _is_autocast_enabled("cuda"):
        x, weight, bias = _autocast_fp32(x, weight, bias)
    path = eager_path(x, weight, bias)
    if path == DIRECT:
        if x.is_cuda:
            return _op.forward_gpu(x, weight, bias, _op.LAYER, eps, 0.0, False)[0]
        return _ln_impl(x, weight, bias, eps)[0]
    return LAYER_NORM.graph_call(path, x, weight, bias, eps)[0]


# ---------------------------------------------------------------------------------------------
# cukit::layer_norm_backward
# ---------------------------------------------------------------------------------------------


def _ln_bwd_impl(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) from the forward's statistics; empty for a missing weight or bias."""
    if x.is_cuda:
        dx, dw, db = _op.backward_gpu(grad, x, weight, bias, mean, rstd, _op.LAYER, 0.0)
    else:
        c = _op.validate_layer(x, None, weight, bias, eps, "cukit.layer_norm_backward")
        _op.check_grad("cukit.layer_norm_backward", grad, x, c)
        dx, dw, db = _op.layer_norm_backward_reference_torch(grad, x, weight, bias, eps, mean, rstd)
    return dx, x.new_empty(0) if dw is None else dw, x.new_empty(0) if db is None else db


def _ln_bwd_fake(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _op.validate_layer(x, None, weight, bias, eps, "cukit.layer_norm_backward")
    _op.check_grad("cukit.layer_norm_backward", grad, x, c)

    def like(p: torch.Tensor | None) -> torch.Tensor:
        return torch.empty(0, dtype=x.dtype, device=x.device) if p is None else torch.empty_like(p)

    return torch.empty(x.shape, dtype=x.dtype, device=x.device), like(weight), like(bias)


def _ln_bwd_compile_as(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
    rstd: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = _op.validate_layer(x, None, weight, bias, eps, "cukit.layer_norm_backward")
    _op.check_grad("cukit.layer_norm_backward", grad, x, c)
    dx, dw, db = _op.layer_norm_backward_reference_torch(grad, x, weight, bias, eps, mean, rstd)
    return dx, x.new_empty(0) if dw is None else dw, x.new_empty(0) if db is None else db


def _ln_bwd_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    grad, x, weight, bias, _mean, _rstd, eps = inputs
    ctx.save_for_backward(grad, x, weight)
    ctx.has_bias, ctx.eps = bias is not None, eps


def _ln_bwd_bwd(ctx: Any, gdx: torch.Tensor | None, gdw: torch.Tensor | None, gdb: torch.Tensor | None) -> tuple:
    grad, x, weight = ctx.saved_tensors
    eps = ctx.eps
    # dbias = sum_rows(grad) is linear in grad alone: its part of the product is gdb broadcast over rows
    g_db = None if gdb is None or not ctx.has_bias else gdb.expand(grad.shape)
    if weight is None:
        def f(g: torch.Tensor, xx: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (_op.layer_norm_backward_reference_torch(g, xx, None, None, eps)[0],)

        dg, dxx = _vjp(f, (grad, x), (_zeros_if_none(gdx, x),))
        dww = None
    else:
        def fw(g: torch.Tensor, xx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            dx, dw, _ = _op.layer_norm_backward_reference_torch(g, xx, w, None, eps)
            return dx, dw  # type: ignore[return-value]

        dg, dxx, dww = _vjp(fw, (grad, x, weight), (_zeros_if_none(gdx, x), _zeros_if_none(gdw, weight)))
    if g_db is not None:
        dg = dg + g_db.to(dg.dtype)
    return dg, dxx, dww, None, None, None, None


def _ln_bwd_vmap(info: Any, in_dims: tuple, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                 eps: float) -> tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]:
    B = info.batch_size
    grad, x, mean, rstd = (_lead(t, d, B) for t, d in zip((grad, x, mean, rstd),
                                                            (in_dims[0], in_dims[1], in_dims[4], in_dims[5]),
                                                            strict=True))
    w = weight if weight is None or in_dims[2] is None else _per_sample(weight, in_dims[2], x)
    if w is not None and in_dims[2] is not None:
        dx = _op.layer_norm_backward_reference_torch(grad, x, w, None, eps, mean, rstd)[0]
    else:  # the kernel for dx; the parameters' gradients per sample with torch ops below
        dx = layer_norm_backward(grad.contiguous(), x.contiguous(), weight, None, mean.contiguous(),
                                 rstd.contiguous(), eps)[0]
    _, dw, db = _op.layer_norm_backward_reference_torch(grad, x, None if weight is None else w,
                                                        bias, eps, mean, rstd, keep=1)
    empty = x.new_empty(0)
    return (dx, empty if dw is None else dw, empty if db is None else db), (
        0, None if dw is None else 0, None if db is None else 0)


LAYER_NORM_BACKWARD = TorchOp(
    "layer_norm_backward",
    _ln_bwd_impl,
    fake=_ln_bwd_fake,
    setup_context=_ln_bwd_setup,
    backward=_ln_bwd_bwd,
    vmap=_ln_bwd_vmap,
    compile_as=_ln_bwd_compile_as,
)


def layer_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        mean: torch.Tensor, rstd: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) of layer_norm from its saved statistics (None for a missing weight or
    bias), differentiable (double backward)."""
    path = eager_path(x, grad, weight, bias)
    if path == DIRECT:
        if x.is_cuda:
            return _op.backward_gpu(grad, x, weight, bias, mean, rstd, _op.LAYER, 0.0)  # type: ignore[return-value]
        dx, dw, db = _ln_bwd_impl(grad, x, weight, bias, mean, rstd, eps)
    else:
        dx, dw, db = LAYER_NORM_BACKWARD.graph_call(path, grad, x, weight, bias, mean, rstd, eps)
    return dx, None if weight is None else dw, None if bias is None else db



# ---------------------------------------------------------------------------------------------
# cukit.rms_norm_backward / cukit.layer_norm_backward for torch tensors
# ---------------------------------------------------------------------------------------------


def rms_norm_grads(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None,
                   eps: float | None = 1e-6, *, offset: float = 0.0,
                   cast: str = "llama") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``cukit.rms_norm_backward`` for torch tensors: the statistics recomputed from x, then the
    backward op (differentiable)."""
    if eps is None:
        eps = _op.EPS_OF["float64" if x.dtype is torch.float64 else "float32"]
    _op.validate_rms(x, weight, eps, offset, cast, "cukit.rms_norm_backward")
    rstd = _rms_call(x.detach(), None, eps, 0.0, cast)[1]
    return rms_norm_backward(grad, x, weight, rstd, eps, offset, cast)


def layer_norm_grads(grad: torch.Tensor, x: torch.Tensor, normalized_shape: Any = None,
                     weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``cukit.layer_norm_backward`` for torch tensors: the statistics recomputed from x, then the
    backward op (differentiable; no autocast: grad has x's dtype)."""
    _op.validate_layer(x, normalized_shape, weight, bias, eps, "cukit.layer_norm_backward")
    _, mean, rstd = _ln_call(x.detach(), None, None, eps)
    return layer_norm_backward(grad, x, weight, bias, mean, rstd, eps)
