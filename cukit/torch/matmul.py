"""``torch.ops.cukit.matmul`` and ``torch.ops.cukit.linear``, registered with ``torch.library.custom_op``.

Both ops are opaque to torch.compile (``register_fake`` gives the output metadata) and
differentiable (``register_autograd``). CUDA tensors run cukit's GEMM kernels on torch's current
stream (so they are captured by CUDA graphs); CPU tensors run the torch references.

Autograd:
- matmul: ``dA = dC @ B^T``, ``dB = A^T @ dC``, with broadcast batch dimensions summed back to each
  operand's shape and 1-D promotion undone. When an operand is one matrix broadcast over every
  batch (a weight), its gradient is one GEMM over the folded batch instead of a batched product
  and a sum. The products run through ``cukit.matmul``, so on CUDA they use cukit's kernels (and
  are differentiable again: double backward works).
- linear: ``dy' = dy * act'(z)``, ``dx = dy' @ W``, ``dW = dy'^T @ x``, ``db = sum_rows dy'``.
  The pre-activation z is not saved (that would cost one more output-sized tensor per layer): for
  gelu/gelu_tanh/silu the backward recomputes ``x @ W^T`` with one GEMM (time instead of memory),
  and ``cukit.bias_act_backward`` then gives dy' and db in one kernel. relu needs no recompute:
  ``act'(z) = (y > 0)`` comes from the saved output.

Dispatch cost: as for bias_act, when no autograd graph is needed and nothing is being traced the
functions below launch directly, skipping the dispatcher.
"""

from __future__ import annotations

import torch

from cukit.ops import matmul as _op
from cukit.torch import bias_act as _bias_act  # noqa: F401  (torch.ops.cukit.bias_act_backward)

__all__ = ["linear", "matmul"]


# ---------------------------------------------------------------------------------------------
# cukit::matmul
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cukit::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b (numpy.matmul semantics) for tensors of one float dtype; see ``cukit.matmul``."""
    if a.is_cuda:
        return _op._matmul_gpu(a, b, precision=precision)
    return _op.reference_torch(a, b)


@matmul_op.register_fake
def _matmul_fake(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    _, _, _, _, out_shape = _op.matmul_shape(tuple(a.shape), tuple(b.shape))
    return a.new_empty(out_shape)


def _matmul_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    a, b, precision = inputs
    ctx.save_for_backward(a, b)
    ctx.precision = precision


def _sum_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """t summed over the dimensions it was broadcast along to reach its shape from `shape`."""
    lead = t.ndim - len(shape)
    if lead:
        t = t.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    if dims:
        t = t.sum(dim=dims, keepdim=True)
    return t


def _is_one_matrix(shape: tuple[int, ...]) -> bool:
    """The operand is a single matrix for every batch index (no batch dimension larger than 1)."""
    return all(n == 1 for n in shape[:-2])


def _matmul_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    prec = ctx.precision
    a2 = a.unsqueeze(0) if a.ndim == 1 else a  # (..., M, K)
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b  # (..., K, N)
    batch, M, K, N, _ = _op.matmul_shape(tuple(a.shape), tuple(b.shape))
    g = grad.reshape((*batch, M, N))
    nbatch = 1
    for n in batch:
        nbatch *= n
    da = db = None
    if ctx.needs_input_grad[0]:
        if _is_one_matrix(tuple(a2.shape)) and nbatch > 1:
            # dA[m, k] = sum_{z, n} g[z, m, n] b[z, k, n]: one GEMM with the batch folded into N
            gf = g.movedim(-2, 0).reshape(M, nbatch * N)
            bf = b2.expand((*batch, K, N)).movedim(-2, 0).reshape(K, nbatch * N)
            da = _op.matmul(gf, bf.t(), precision=prec)
        else:
            da = _sum_to(_op.matmul(g, b2.mT, precision=prec), tuple(a2.shape))
        da = da.reshape(a.shape)
    if ctx.needs_input_grad[1]:
        if _is_one_matrix(tuple(b2.shape)) and nbatch > 1:
            # dB = sum_z A[z]^T g[z] = A'^T g' with A' (batch * M, K), g' (batch * M, N)
            af = a2.expand((*batch, M, K)).reshape(nbatch * M, K)
            db = _op.matmul(af.t(), g.reshape(nbatch * M, N), precision=prec)
        else:
            db = _sum_to(_op.matmul(a2.mT, g, precision=prec), tuple(b2.shape))
        db = db.reshape(b.shape)
    return da, db, None


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


# ---------------------------------------------------------------------------------------------
# cukit::linear
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("cukit::linear", mutates_args=())
def linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, precision: str
) -> torch.Tensor:
    """act(x @ weight.T + bias); see ``cukit.linear``."""
    _, act = _op._validate_linear(x, weight, bias, activation)
    if x.is_cuda:
        return _op.linear_gpu(x, weight, bias, act, precision=precision)
    return _op.linear_reference_torch(x, weight, bias, activation)


@linear_op.register_fake
def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, precision: str
) -> torch.Tensor:
    _op._validate_linear(x, weight, bias, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias, activation, precision = inputs
    # relu's derivative comes from the output; the others recompute the pre-activation.
    ctx.save_for_backward(x, weight, bias, output if activation == "relu" else None)
    ctx.activation = activation
    ctx.precision = precision


def _linear_backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
    x, weight, bias, y = ctx.saved_tensors
    act, prec = ctx.activation, ctx.precision
    out_f, in_f = weight.shape
    dy2 = dy.reshape(-1, out_f)
    db = None
    if act is None:
        g = dy2
        if bias is not None and ctx.needs_input_grad[2]:
            db = g.sum(0, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32).to(g.dtype)
    else:
        if act == "relu":
            z, zb = y.reshape(-1, out_f), dy2.new_zeros(out_f)  # (y + 0 > 0) == (x W^T + b > 0)
        else:
            z = _op.matmul(x.reshape(-1, in_f), weight.t(), precision=prec)  # recomputed x W^T
            zb = dy2.new_zeros(out_f) if bias is None else bias
        g, db = torch.ops.cukit.bias_act_backward(dy2, z, zb, act)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _op.matmul(g, weight, precision=prec).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        dw = _op.matmul(g.t(), x.reshape(-1, in_f), precision=prec)
    return dx, dw, db if bias is not None and ctx.needs_input_grad[2] else None, None, None


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ---------------------------------------------------------------------------------------------
# Entry points (arguments validated by cukit.ops.matmul)
# ---------------------------------------------------------------------------------------------

# Tensor subclasses (FakeTensor, DTensor, functorch wrappers), tracers and dispatch modes
# (make_fx, FlopCounterMode) must see the ops, so they go through the dispatcher.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_current_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode


def _direct(*tensors: torch.Tensor | None) -> bool:
    """Launch without the dispatcher: plain CUDA tensors, no autograd graph, nothing tracing."""
    ts = [t for t in tensors if t is not None]
    return (
        all(type(t) in _PLAIN for t in ts)
        and ts[0].is_cuda
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and _current_dispatch_mode() is None
    )


def matmul(
    a: torch.Tensor, b: torch.Tensor, *, precision: str, out: torch.Tensor | None = None, dtype: str | None = None
) -> torch.Tensor:
    """a @ b for validated torch tensors, promoted here to `dtype` (the result dtype, computed when
    None); see ``cukit.matmul``."""
    rdt = dtype or _op.result_dtype(_op._dtype_name(a, "torch"), _op._dtype_name(b, "torch"))
    dt = getattr(torch, rdt)
    if a.dtype != dt:
        a = a.to(dt)
    if b.dtype != dt:
        b = b.to(dt)
    if rdt not in _op.FLOAT_DTYPES:
        if a.is_cuda:
            raise TypeError(f"matmul on the GPU supports {', '.join(_op.FLOAT_DTYPES)}; got {rdt}")
        if a.is_complex():
            raise TypeError(f"cukit.matmul supports real dtypes for torch tensors; got {rdt}")
        r = _op.reference_torch(a, b)  # integers and bool: torch.matmul, differentiable as it is
    elif _direct(a, b):
        return _op._matmul_gpu(a, b, precision=precision, out=out)
    else:
        if out is not None and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            raise RuntimeError(
                "cukit.matmul(): functions with out=... arguments don't support automatic differentiation, "
                "but one of the arguments requires grad."
            )
        r = matmul_op(a, b, precision)
    if out is None:
        return r
    out.copy_(r)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, *, precision: str
) -> torch.Tensor:
    """act(x @ weight.T + bias) for validated torch tensors; see ``cukit.linear``."""
    if _direct(x, weight, bias):
        act = -1 if activation is None else _op.ACTIVATIONS[activation]
        return _op.linear_gpu(x, weight, bias, act, precision=precision)
    return linear_op(x, weight, bias, activation, precision)
