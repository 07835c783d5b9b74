"""``torch.ops.cukit.rotary_embedding`` and ``torch.ops.cukit.rotary_embedding_backward`` (through the
one registration helper, ``cukit/torch/_register.py``), and their entry points.

CUDA tensors run raw_kernels/rope.cu on torch's current stream (so CUDA graphs capture them); CPU
tensors run the torch reference. The output dtype is torch's promotion of q's and cos's dtypes,
which is what ``q * cos`` gives with or without ``torch.autocast``: the kernel reads mixed dtypes
itself, so the op has no autocast rule (none is needed, and a cast of q and k would be a copy).
Under ``torch.compile`` (the "inductor" compile policy) the torch reference is traced instead.

Autograd, to any order (both ops are linear in q and k):
- rotary_embedding: ``(dq, dk)`` = the transposed rotation of the output gradients, in q's dtype: one
  ``rotary_embedding_backward`` call. cos and sin are usually buffers; when they require grad,
  ``dcos = sum_heads(g * x)`` and ``dsin = sum_heads(g * rotate_half(x))`` (over q and k, reduced to
  their broadcast shape) in torch ops, and q and k are saved for them.
- rotary_embedding_backward: its transpose is the forward rotation (``rotary_embedding`` again);
  ``dcos = sum_heads(a * g)``, ``dsin = sum_heads(g * rotate_half(a))`` for upstream gradients a.
"""

from __future__ import annotations

import torch

from cukit.ops import rope as _op
from cukit.torch._register import DIRECT, DISPATCH, TorchOp, eager_path

__all__ = ["rotary_embedding", "rotary_embedding_backward"]

Pair = tuple[torch.Tensor, torch.Tensor]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _empty_like_each(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> Pair:
    """Outputs as the kernels allocate them (cukit.ops.rope._alloc_like): q's and k's layout kept."""
    return _op._alloc_like(q, "torch", _name(dtype)), _op._alloc_like(k, "torch", _name(dtype))


def _in_layout(ys: Pair, q: torch.Tensor, k: torch.Tensor) -> Pair:
    """The reference's (contiguous) outputs in the layout the kernels give, so that a CPU call and
    the fake implementation agree on strides."""
    out = _empty_like_each(q, k, ys[0].dtype)
    return out[0].copy_(ys[0]), out[1].copy_(ys[1])


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _table_grads(pairs: list[Pair], cos: torch.Tensor, unsqueeze_dim: int) -> Pair:
    """(sum of a * b, sum of a * rotate_half(b)) over the heads of every (a, b) in pairs, on the
    first R dims, reduced to cos's shape: the gradients of cos and sin (torch ops)."""
    R = cos.shape[-1]
    acc = torch.float64 if torch.float64 in (cos.dtype, pairs[0][0].dtype) else torch.float32
    shape = cos.unsqueeze(unsqueeze_dim).shape
    dc = ds = None
    for a, b in pairs:
        a, b = a[..., :R].to(acc), b[..., :R].to(acc)
        c_part = (a * b).sum_to_size(shape)
        s_part = (a * _rot_half(b)).sum_to_size(shape)
        dc, ds = (c_part, s_part) if dc is None else (dc + c_part, ds + s_part)
    return dc.squeeze(unsqueeze_dim).to(cos.dtype), ds.squeeze(unsqueeze_dim).to(cos.dtype)  # type: ignore[union-attr]


def _zeros_if_none(g: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device) if g is None else g


def _batched(info: torch.library.VmapInfo, in_dims: tuple, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """vmap: the vmapped dim folded into the batch dim (cos and sin expanded to match)."""
    n = info.batch_size
    q, k, cos, sin = (t.movedim(d, 0) if d is not None else t.expand(n, *t.shape)
                      for t, d in zip((q, k, cos, sin), in_dims[:4], strict=True))
    B = q.shape[1]
    if cos.shape[1] != B:
        cos, sin = cos.expand(n, B, *cos.shape[2:]), sin.expand(n, B, *sin.shape[2:])
    return tuple(t.reshape(n * B, *t.shape[2:]) for t in (q, k, cos, sin))


# ---------------------------------------------------------------------------------------------
# cukit::rotary_embedding
# ---------------------------------------------------------------------------------------------


def _rope_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin); see ``cukit.rotary_embedding``."""
    if q.is_cuda:
        return _op.forward_gpu(q, k, cos, sin, unsqueeze_dim)
    return _in_layout(_op.reference_torch(q, k, cos, sin, unsqueeze_dim), q, k)


def _rope_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _op.validate(q, k, cos, sin, unsqueeze_dim)
    return _empty_like_each(q, k, getattr(torch, spec.to))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_compile_as(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile traces under the "inductor" policy. Tables of q's dtype over the whole
    head_dim (transformers' Llama family): ``x * cos + rotate_half(x) * sin``, transformers' own
    expression, so that inductor fuses the patched model's forward and backward exactly as the
    stock model's (the kernel's form adds a table copy and a transpose per layer there). inductor
    keeps the intermediates in fp32 and rounds once, as the kernel does. Otherwise the reference."""
    _op.validate(q, k, cos, sin, unsqueeze_dim)
    if q.dtype == k.dtype == cos.dtype == sin.dtype and cos.shape[-1] == q.shape[-1] == k.shape[-1]:
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    return _op.reference_torch(q, k, cos, sin, unsqueeze_dim)


def _rope_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, cos, sin, unsqueeze_dim = inputs
    ctx.unsqueeze_dim, ctx.dtype = unsqueeze_dim, q.dtype
    ctx.outputs = (output[0].shape, output[1].shape, output[0].dtype, output[0].device)
    tables = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(cos, sin, q if tables else None, k if tables else None)


def _rope_bwd(ctx: torch.autograd.function.FunctionCtx, gq: torch.Tensor | None, gk: torch.Tensor | None) -> tuple:
    cos, sin, q, k = ctx.saved_tensors
    need = ctx.needs_input_grad
    shape_q, shape_k, dtype, device = ctx.outputs
    gq, gk = _zeros_if_none(gq, shape_q, dtype, device), _zeros_if_none(gk, shape_k, dtype, device)
    dq = dk = dcos = dsin = None
    if need[0] or need[1]:
        dq, dk = rotary_embedding_backward(gq, gk, cos, sin, unsqueeze_dim=ctx.unsqueeze_dim, dtype=ctx.dtype)
    if need[2] or need[3]:
        dcos, dsin = _table_grads([(gq, q), (gk, k)], cos, ctx.unsqueeze_dim)  # type: ignore[list-item]
    return (dq if need[0] else None, dk if need[1] else None, dcos if need[2] else None,
            dsin if need[3] else None, None)


def _rope_vmap(info: torch.library.VmapInfo, in_dims: tuple, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, unsqueeze_dim: int) -> tuple[Pair, tuple[int, int]]:
    n = info.batch_size
    qb, kb, cb, sb = _batched(info, in_dims, q, k, cos, sin)
    yq, yk = rotary_embedding(qb, kb, cb, sb, unsqueeze_dim=unsqueeze_dim)
    return (yq.unflatten(0, (n, -1)), yk.unflatten(0, (n, -1))), (0, 0)


ROPE = TorchOp(
    "rotary_embedding",
    _rope_impl,
    fake=_rope_fake,
    setup_context=_rope_setup,
    backward=_rope_bwd,
    vmap=_rope_vmap,
    compile_as=_rope_compile_as,
)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                     unsqueeze_dim: int = 1) -> Pair:
    """(q_embed, k_embed) for torch tensors, differentiable; see ``cukit.rotary_embedding``."""
    path = eager_path(q, k, cos, sin)
    if path == DIRECT:
        if q.is_cuda:
            return _op.forward_gpu(q, k, cos, sin, unsqueeze_dim)
        return _rope_impl(q, k, cos, sin, unsqueeze_dim)
    if path == DISPATCH:
        return ROPE(q, k, cos, sin, unsqueeze_dim)
    return ROPE.graph_call(path, q, k, cos, sin, unsqueeze_dim)


# ---------------------------------------------------------------------------------------------
# cukit::rotary_embedding_backward
# ---------------------------------------------------------------------------------------------


def _rope_bwd_impl(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed rotation of (grad_q, grad_k), in dtype; see ``cukit.rotary_embedding_backward``."""
    if grad_q.is_cuda:
        return _op.backward_gpu(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype)
    return _in_layout(_op.reference_backward_torch(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype), grad_q, grad_k)


def _rope_bwd_fake(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _op.validate(grad_q, grad_k, cos, sin, unsqueeze_dim, "cukit.rotary_embedding_backward", transpose=True,
                 dtype=dtype)
    return _empty_like_each(grad_q, grad_k, dtype)


def _rope_bwd_compile_as(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _op.reference_backward_torch(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype)


def _rope_bwd_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    grad_q, grad_k, cos, sin, unsqueeze_dim, dtype = inputs
    ctx.unsqueeze_dim = unsqueeze_dim
    tables = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(cos, sin, grad_q if tables else None, grad_k if tables else None)
    ctx.shapes = (grad_q.shape, grad_k.shape, grad_q.dtype, grad_q.device, dtype)


def _rope_bwd_bwd(ctx: torch.autograd.function.FunctionCtx, aq: torch.Tensor | None, ak: torch.Tensor | None) -> tuple:
    cos, sin, gq, gk = ctx.saved_tensors
    need = ctx.needs_input_grad
    shape_q, shape_k, gdtype, device, dtype = ctx.shapes
    aq, ak = _zeros_if_none(aq, shape_q, dtype, device), _zeros_if_none(ak, shape_k, dtype, device)
    d_gq = d_gk = d_cos = d_sin = None
    if need[0] or need[1]:
        d_gq, d_gk = rotary_embedding(aq, ak, cos, sin, unsqueeze_dim=ctx.unsqueeze_dim)
        if d_gq.dtype != gdtype:  # a gradient of another dtype than the forward's output (a caller's own)
            d_gq, d_gk = d_gq.to(gdtype), d_gk.to(gdtype)
    if need[2] or need[3]:
        d_cos, d_sin = _table_grads([(gq, aq), (gk, ak)], cos, ctx.unsqueeze_dim)
    return (d_gq if need[0] else None, d_gk if need[1] else None, d_cos if need[2] else None,
            d_sin if need[3] else None, None, None)


def _rope_bwd_vmap(info: torch.library.VmapInfo, in_dims: tuple, grad_q: torch.Tensor, grad_k: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
                   dtype: torch.dtype) -> tuple[Pair, tuple[int, int]]:
    n = info.batch_size
    qb, kb, cb, sb = _batched(info, in_dims, grad_q, grad_k, cos, sin)
    dq, dk = rotary_embedding_backward(qb, kb, cb, sb, unsqueeze_dim=unsqueeze_dim, dtype=dtype)
    return (dq.unflatten(0, (n, -1)), dk.unflatten(0, (n, -1))), (0, 0)


ROPE_BACKWARD = TorchOp(
    "rotary_embedding_backward",
    _rope_bwd_impl,
    fake=_rope_bwd_fake,
    setup_context=_rope_bwd_setup,
    backward=_rope_bwd_bwd,
    vmap=_rope_bwd_vmap,
    compile_as=_rope_bwd_compile_as,
)


def rotary_embedding_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                              unsqueeze_dim: int = 1, dtype: torch.dtype | None = None) -> Pair:
    """(dq, dk) of rotary_embedding for torch tensors, differentiable (double backward); see
    ``cukit.rotary_embedding_backward``."""
    dtype = grad_q.dtype if dtype is None else dtype
    path = eager_path(grad_q, grad_k, cos, sin)
    if path == DIRECT:
        if grad_q.is_cuda:
            return _op.backward_gpu(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype)
        return _rope_bwd_impl(grad_q, grad_k, cos, sin, unsqueeze_dim, dtype)
    return ROPE_BACKWARD.graph_call(path, grad_q, grad_k, cos, sin, unsqueeze_dim, dtype)
