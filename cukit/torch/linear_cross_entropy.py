"""``torch.ops.cukit.linear_cross_entropy`` and ``torch.ops.cukit.linear_cross_entropy_backward``
(through the one registration helper, ``cukit/torch/_register.py``), and the entry point
``cukit.linear_cross_entropy`` for torch tensors.

CUDA tensors run the chunked kernels of ``cukit/ops/linear_cross_entropy.py`` on torch's current
stream (no host sync: CUDA graphs capture them); CPU tensors run the torch reference. Under
``torch.autocast`` the op follows ``F.linear``: input, linear_weight, linear_bias (and class
weights) are cast to the autocast dtype; the loss is float32, as ``F.cross_entropy`` under autocast.

Autograd (first order; a double backward raises):
- 'mean' / 'sum': the forward computes the gradients of the unscaled sum of the per-token losses
  as it goes (dx, dW and db, in float32 by default) and returns them as extra, non-differentiable
  outputs; the backward scales them by the reduction's scale (a device scalar) times the upstream
  gradient and rounds them once to the inputs' dtypes (:func:`cukit.ops.linear_cross_entropy.scale_cast_gpu`).
  Where the logit gradients of all tokens are no larger than a float32 dW (16-bit inputs, tokens
  <= 2 x hidden), the forward returns those instead of dW, and the backward makes dW from them in
  one GEMM over all tokens (:func:`cukit.ops.linear_cross_entropy.stored_dw_gpu`).
  It then releases them: a second backward through the same graph (``retain_graph=True``)
  recomputes them like 'none' does, unless ``LinearCrossEntropyOptions(allow_retain_graph=True)``
  kept them.
- 'none', and a loss whose lse output is differentiated (``return_lse=True``): the upstream
  gradient is per token, so the backward recomputes the logits chunk by chunk from the saved lse
  (``linear_cross_entropy_backward``: one GEMM more than 'mean', no second pass over a row).
- CPU: the same formulas in torch ops (``reference_grad_torch``); eager CPU calls use the reference
  with torch's own autograd (double backward included).

Under ``torch.compile`` the op is opaque (``compile_as=None``: inductor cannot chunk it; the fake
implementations give its outputs' metadata), except where chunking buys nothing: under the
"inductor" compile policy, a call with the default options whose float32 logits would take at
most :data:`COMPILE_AS_TORCH_MAX_LOGITS_BYTES` is traced as torch's own
``F.cross_entropy(F.linear(x, W, b).float(), y)`` form (cukit's extensions included), which
inductor fuses into the neighbouring graph at the same peak memory; the chunked op there only
added its host cost and an fp32 logits round trip. Options other than the defaults keep the op
(but for ``logits``, whose "input" is the rounding that form makes).
"""

from __future__ import annotations

import math

import torch

from cukit.ops import linear_cross_entropy as _op
from cukit.torch._register import (
    DIRECT,
    DISPATCH,
    FUNCTION,
    TorchOp,
    _is_compiling,
    autocast_lower,
    eager_path,
    get_compile_policy,
)

__all__ = ["COMPILE_AS_TORCH_MAX_LOGITS_BYTES", "linear_cross_entropy"]

# Under torch.compile's "inductor" policy with default options: torch's form up to this many bytes
# of float32 logits (tokens x vocabulary x 4), the chunked op above it.
COMPILE_AS_TORCH_MAX_LOGITS_BYTES = 1 << 30

Tensor = torch.Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grad_dtype(x: Tensor, accumulate: str) -> torch.dtype:
    """dtype of the gradient buffers the forward fills (see LinearCrossEntropyOptions)."""
    return _acc(x.dtype) if accumulate == "float32" else x.dtype


def _stored(x: Tensor, w: Tensor, accumulate: str, reduction: str) -> bool:
    """Whether the forward's dW buffer is the stored logit gradient (see stores_logit_grads)."""
    return x.device.type == "cuda" and _op.stores_logit_grads(
        x.shape[0], x.shape[1], w.shape[0], str(x.dtype).removeprefix("torch."), accumulate, reduction)


def _none(t: Tensor | None) -> Tensor | None:
    """A buffer output as autograd's bookkeeping wants it: None when absent (an empty tensor)."""
    return None if t is None or (t.ndim == 1 and t.shape[0] == 0) else t


# ---------------------------------------------------------------------------------------------
# cukit::linear_cross_entropy
# ---------------------------------------------------------------------------------------------


def _lce_impl(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    reduction: str, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, return_lse: bool,
    chunk_size: int, accumulate: str, allow_retain_graph: bool, compute_dx: bool, compute_dw: bool, compute_db: bool,
    vocab_block: int = 0, logits: str = "float32",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, dx_buf, dw_buf, db_buf, stats) for input (T, H), target (T,): see the module
    docstring. The buffers are empty (shape (0,)) where nothing was computed."""
    spec = _op.Spec(reduction, ignore_index, label_smoothing, z_loss, softcap, return_lse)
    if input.is_cuda:
        out = _op.forward_gpu(input, linear_weight, target, linear_bias, weight, spec, chunk_size, accumulate,
                              vocab_block, logits, need_dx=compute_dx, need_dw=compute_dw, need_db=compute_db)
        # absent buffers: distinct empty tensors (a custom op's outputs must not alias each other)
        return tuple(input.new_empty(0) if t is None else t for t in out)  # type: ignore[return-value]
    _op.validate(input, linear_weight, target, linear_bias, weight)
    V = linear_weight.shape[0]
    _op.check_targets_host(target, V, ignore_index)
    loss, lse = _op.reference_torch(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                    label_smoothing, z_loss, softcap, round_product=logits == "input")
    acc = lse.dtype
    stats = _op.stats_torch(target, weight, V, ignore_index, reduction == "mean", acc)
    return loss, lse, input.new_empty(0), input.new_empty(0), input.new_empty(0), stats


def _buffer_shapes(input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None, reduction: str,
                   accumulate: str, flags: tuple[bool, bool, bool]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the three gradient buffers the implementation returns."""
    T, H = input.shape
    V = linear_weight.shape[0]
    grads = input.device.type == "cuda" and reduction != "none" and any(flags)
    gdt = _grad_dtype(input, accumulate)
    dw = ((T, _op.stored_ld(V)), input.dtype) if _stored(input, linear_weight, accumulate, reduction) else ((V, H), gdt)
    return [
        ((T, H), gdt) if grads and flags[0] else ((0,), input.dtype),
        dw if grads and flags[1] else ((0,), input.dtype),
        ((V,), _acc(input.dtype)) if grads and flags[2] and linear_bias is not None else ((0,), input.dtype),
    ]


def _lce_fake(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    reduction: str, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, return_lse: bool,
    chunk_size: int, accumulate: str, allow_retain_graph: bool, compute_dx: bool, compute_dw: bool, compute_db: bool,
    vocab_block: int = 0, logits: str = "float32",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _op.validate(input, linear_weight, target, linear_bias, weight)
    acc = _acc(input.dtype)
    T = input.shape[0]
    loss = input.new_empty((T,) if reduction == "none" else (), dtype=acc)
    bufs = [input.new_empty(s, dtype=d) for s, d in _buffer_shapes(
        input, linear_weight, linear_bias, reduction, accumulate, (compute_dx, compute_dw, compute_db))]
    return loss, input.new_empty((T,), dtype=acc), *bufs, input.new_empty((3,), dtype=acc)  # type: ignore[return-value]


def _lce_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x, w, target, b, cw, reduction, ignore_index, ls, zl, cap, return_lse, chunk, accumulate, retain = inputs[:14]
    _, lse, dx_buf, dw_buf, db_buf, stats = output
    ctx.save_for_backward(x, w, target, b, cw, lse, stats)
    ctx.mark_non_differentiable(dx_buf, dw_buf, db_buf, stats)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient (not a tensor of zeros)
    ctx.spec = _op.Spec(reduction, ignore_index, ls, zl, cap, return_lse)
    ctx.chunk, ctx.accumulate, ctx.retain = chunk, accumulate, retain
    ctx.vocab_block, ctx.logits = inputs[17], inputs[18]
    # The forward's gradients, held as attributes (detached: as outputs they would link back to
    # this node) so the backward can release them early; None where absent.
    ctx.bufs = [_none(t.detach()) for t in (dx_buf, dw_buf, db_buf)]
    ctx.stored = _stored(x, w, accumulate, reduction)
    ctx.precomputed = x.is_cuda and reduction != "none" and any(t is not None for t in ctx.bufs)


def _lce_bwd(ctx: torch.autograd.function.FunctionCtx, g_loss: Tensor | None, g_lse: Tensor | None,
             *unused: Tensor | None) -> tuple:
    x, w, target, b, cw, lse, stats = ctx.saved_tensors
    spec = ctx.spec
    if not spec.return_lse:
        g_lse = None  # lse was not handed to the user: a gradient for it is zeros at most
    nx, nw, nb = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    nothing = (None,) * 19
    if (g_loss is None and g_lse is None) or not (nx or nw or nb):
        return nothing
    g = g_loss if g_loss is not None else g_lse
    path = eager_path(g, x, w)
    if path == FUNCTION:  # plain tensors and a graph being recorded: create_graph=True
        raise RuntimeError(
            "cukit.linear_cross_entropy: double backward (create_graph=True) is not supported: the gradients "
            "are computed by fused kernels (use torch.nn.functional.linear_cross_entropy for higher-order "
            "derivatives)"
        )
    direct = path == DIRECT and x.is_cuda
    # the forward's gradients when each one needed is there (a first backward), else recompute
    have = [t is not None for t in ctx.bufs]
    wanted = (nx, nw, nb and b is not None)
    if ctx.precomputed and g_lse is None and all(h or not n for h, n in zip(have, wanted, strict=True)):
        dx, dw, db = _finish(ctx, x, w, b, stats, g_loss, direct)  # type: ignore[arg-type]
    else:
        dx, dw, db = _recompute(ctx, x, w, target, b, cw, lse, stats, g_loss, g_lse, (nx, nw, nb), direct)
    out = [None] * 19
    out[0], out[1], out[3] = (dx if nx else None), (dw if nw else None), (db if nb else None)
    return tuple(out)


def _finish(ctx: torch.autograd.function.FunctionCtx, x: Tensor, w: Tensor, b: Tensor | None, stats: Tensor,
            g_loss: Tensor, direct: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The forward's gradients times stats[1] * g_loss (and dW's 1 / alpha), rounded once to the
    parameters' dtypes; released afterwards (scaled in place where the dtype allows) unless
    allow_retain_graph or a traced backward. "recompute" has applied stats[1] already."""
    T = x.shape[0]
    scale = None if ctx.accumulate == "recompute" else stats[1:2]
    dw_factor = float(T) if ctx.accumulate == "input" and x.dtype == torch.float16 and T else 1.0
    targets = (x.dtype, w.dtype, None if b is None else b.dtype)
    factors = (1.0, dw_factor, 1.0)
    outs: list[Tensor | None] = [None, None, None]
    keep = ctx.retain or not direct
    for i in range(3):
        buf = ctx.bufs[i]
        if buf is None or targets[i] is None:
            continue
        if not keep:
            ctx.bufs[i] = None  # this backward holds the only reference: freed once rounded
        if i == 1 and ctx.stored:  # the logit gradient G: dW = scale * g_loss * G^T x
            V = w.shape[0]
            if direct:
                outs[i] = _op.stored_dw_gpu(buf, x, V, str(w.dtype).removeprefix("torch."), scale, g_loss)
            else:
                g = buf[:, :V].t()
                try:  # float32 products of the 16-bit operands, as the kernels
                    prod = torch.mm(g, x, out_dtype=torch.float32)
                except TypeError:  # a torch without mm's out_dtype
                    prod = g.float() @ x.float()
                outs[i] = (prod * (scale[0] * g_loss.float())).to(w.dtype)
        elif direct:
            outs[i] = _op.scale_cast_gpu(buf, str(targets[i]).removeprefix("torch."), scale, g_loss,
                                         factors[i], inplace=not ctx.retain)
        else:  # compile / functorch: torch ops (inductor fuses them into one pass)
            acc = _acc(x.dtype)
            s = g_loss.to(acc) * factors[i] if scale is None else scale[0] * g_loss.to(acc) * factors[i]
            outs[i] = (buf.to(acc) * s).to(targets[i])
        del buf
    return outs[0], outs[1], outs[2]


def _recompute(ctx: torch.autograd.function.FunctionCtx, x: Tensor, w: Tensor, target: Tensor, b: Tensor | None,
               cw: Tensor | None, lse: Tensor, stats: Tensor, g_loss: Tensor | None, g_lse: Tensor | None,
               needs: tuple[bool, bool, bool], direct: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    spec = ctx.spec
    if g_loss is None:
        g_loss = lse.new_zeros(lse.shape if spec.reduction == "none" else ())
    need_db = needs[2] and b is not None
    if direct:
        return _op.backward_gpu(x, w, target, b, cw, lse, stats, spec, ctx.chunk, ctx.accumulate, ctx.vocab_block,
                                ctx.logits, grad_loss=g_loss, grad_lse=g_lse, need_dx=needs[0], need_dw=needs[1],
                                need_db=need_db)
    if not x.is_cuda:  # torch ops: eager, or traced by torch.compile
        return _op.reference_grad_torch(
            x, w, target, b, cw, reduction=spec.reduction, ignore_index=spec.ignore_index,
            label_smoothing=spec.label_smoothing, z_loss=spec.z_loss, softcap=spec.softcap, grad_loss=g_loss,
            grad_lse=g_lse, lse=lse, stats=stats, round_product=ctx.logits == "input")
    dx, dw, db = LCE_BACKWARD(x, w, target, b, cw, lse, stats, g_loss, g_lse, spec.reduction, spec.ignore_index,
                              spec.label_smoothing, spec.z_loss, spec.softcap, ctx.chunk, ctx.accumulate,
                              needs[0], needs[1], need_db, ctx.vocab_block, ctx.logits)
    return _none(dx), _none(dw), _none(db)


LCE = TorchOp(
    "linear_cross_entropy",
    _lce_impl,
    fake=_lce_fake,
    setup_context=_lce_setup,
    backward=_lce_bwd,
    autocast="lower",
    compile_as=None,  # inductor cannot chunk it (small default calls never reach the op: see the docstring)
)


# ---------------------------------------------------------------------------------------------
# cukit::linear_cross_entropy_backward (the recomputing backward, for traced graphs)
# ---------------------------------------------------------------------------------------------


def _bwd_impl(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    lse: Tensor, stats: Tensor, grad_loss: Tensor, grad_lse: Tensor | None, reduction: str, ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: float, chunk_size: int, accumulate: str, compute_dx: bool,
    compute_dw: bool, compute_db: bool, vocab_block: int = 0, logits: str = "float32",
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) of linear_cross_entropy for per-token (or 0-d) upstream gradients; empty
    tensors for gradients not computed."""
    if input.is_cuda:
        spec = _op.Spec(reduction, ignore_index, label_smoothing, z_loss, softcap, grad_lse is not None)
        out = _op.backward_gpu(input, linear_weight, target, linear_bias, weight, lse, stats, spec, chunk_size,
                               accumulate, vocab_block, logits, grad_loss=grad_loss, grad_lse=grad_lse, need_dx=compute_dx,
                               need_dw=compute_dw, need_db=compute_db)
    else:
        out = _op.reference_grad_torch(
            input, linear_weight, target, linear_bias, weight, reduction=reduction, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, grad_loss=grad_loss, grad_lse=grad_lse,
            lse=lse, stats=stats, round_product=logits == "input")
        out = (out[0] if compute_dx else None, out[1] if compute_dw else None,
               out[2] if compute_db else None)
    return tuple(input.new_empty(0) if t is None else t for t in out)  # type: ignore[return-value]


def _bwd_fake(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    lse: Tensor, stats: Tensor, grad_loss: Tensor, grad_lse: Tensor | None, reduction: str, ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: float, chunk_size: int, accumulate: str, compute_dx: bool,
    compute_dw: bool, compute_db: bool, vocab_block: int = 0, logits: str = "float32",
) -> tuple[Tensor, Tensor, Tensor]:
    T, H = input.shape
    V = linear_weight.shape[0]
    return (
        input.new_empty((T, H) if compute_dx else (0,)),
        linear_weight.new_empty((V, H) if compute_dw else (0,)),
        input.new_empty(0) if not compute_db or linear_bias is None else linear_bias.new_empty((V,)),
    )


LCE_BACKWARD = TorchOp("linear_cross_entropy_backward", _bwd_impl, fake=_bwd_fake, compile_as=None)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    weight: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: object = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``cukit.linear_cross_entropy`` for torch tensors, differentiable; see
    ``cukit.ops.linear_cross_entropy.linear_cross_entropy``."""
    spec = _op.check_spec(reduction, ignore_index, label_smoothing, z_loss, softcap, return_lse)
    _op.validate(input, linear_weight, target, linear_bias, weight)
    path = eager_path(input, linear_weight, linear_bias)
    shape = tuple(target.shape)
    H, V = input.shape[-1], linear_weight.shape[0]
    T = math.prod(shape)
    opts = _op.resolve_options(options, T, H, V)  # checked on every path; the CPU reference ignores it
    if path != DISPATCH and not input.is_cuda:
        # plain CPU tensors: the reference, differentiated by torch's own autograd
        cast = autocast_lower((input, linear_weight, linear_bias), "cpu")
        if cast is not None:
            input, linear_weight, linear_bias = cast  # type: ignore[assignment]
        _op.check_targets_host(target, linear_weight.shape[0], spec.ignore_index)
        loss, lse = _op.reference_torch(input, linear_weight, target, linear_bias, weight, spec.reduction,
                                        spec.ignore_index, spec.label_smoothing, spec.z_loss, spec.softcap,
                                        round_product=opts.logits == "input")
        return (loss, lse) if return_lse else loss
    # (16-bit logits are what torch's form computes anyway; the options are compared last, once
    # the cheap tests pass)
    if (path == DISPATCH and _is_compiling() and get_compile_policy() == "inductor"
            and T * V * 4 <= COMPILE_AS_TORCH_MAX_LOGITS_BYTES and _op.is_default_chunking(opts)):
        if not (spec.z_loss or return_lse):  # exactly torch's graph: its fused loss, its saved tensors
            z = _op.reference_logits_torch(input.reshape(T, H), linear_weight, linear_bias, spec.softcap,
                                           product_in_input_dtype=True)
            loss = torch.nn.functional.cross_entropy(
                z, target.reshape(T).long(), weight=None if weight is None else weight.to(z.dtype),
                ignore_index=spec.ignore_index, reduction=spec.reduction, label_smoothing=spec.label_smoothing)
            return loss.reshape(shape) if spec.reduction == "none" else loss
        loss, lse = _op.reference_torch(input, linear_weight, target, linear_bias, weight, spec.reduction,
                                        spec.ignore_index, spec.label_smoothing, spec.z_loss, spec.softcap,
                                        product_in_input_dtype=True)
        return (loss, lse) if return_lse else loss
    dtype = str(input.dtype).removeprefix("torch.")
    chunk, vocab_block = opts.chunk_rows(T, V, H, dtype), opts.vocab_block(T, V, dtype)
    grad = torch.is_grad_enabled()
    flags = (grad and input.requires_grad, grad and linear_weight.requires_grad,
             grad and linear_bias is not None and linear_bias.requires_grad)
    args = (input.reshape(T, H), linear_weight, target.reshape(T), linear_bias, weight, spec.reduction,
            spec.ignore_index, spec.label_smoothing, spec.z_loss, spec.softcap, spec.return_lse, chunk,
            opts.grad_accumulation, opts.allow_retain_graph, *flags, vocab_block, opts.logits)
    if path == DISPATCH:
        out = LCE(*args)
    else:
        cast = autocast_lower(args[:5], "cuda")
        if cast is not None:
            args = (*cast, *args[5:])
        out = _lce_impl(*args) if path == DIRECT else LCE.graph_call(path, *args)
    loss = out[0].reshape(shape) if spec.reduction == "none" else out[0]
    return (loss, out[1].reshape(shape)) if return_lse else loss
