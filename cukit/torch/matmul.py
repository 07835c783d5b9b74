"""``torch.ops.cukit.matmul`` and ``torch.ops.cukit.linear`` (through the one registration helper,
``cukit/torch/_register.py``), and their entry points.

CUDA tensors run cukit's GEMM kernels on torch's current stream (so CUDA graphs capture them); CPU
tensors run the torch references. Under ``torch.autocast`` both run in the autocast dtype, as
``torch.matmul`` and ``F.linear`` do.

Autograd (the backward formulas call the entry points below, so they are differentiable again):
- matmul: ``dA = dC @ B^T``, ``dB = A^T @ dC``, with broadcast batch dimensions summed back to each
  operand's shape and 1-D promotion undone. When an operand is one matrix broadcast over every
  batch (a weight), its gradient is one GEMM over the folded batch instead of a batched product
  and a sum.
- linear: ``dy' = dy * act'(z)``, ``dx = dy' @ W``, ``dW = dy'^T @ x``, ``db = sum_rows dy'``.
  The pre-activation z is not saved (that would cost one more output-sized tensor per layer): for
  gelu/gelu_tanh/silu the backward recomputes ``x @ W^T`` with one GEMM (time instead of memory),
  and ``cukit.bias_act_backward`` then gives dy' and db in one kernel. relu needs no recompute:
  ``act'(z) = (y > 0)`` comes from the saved output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cukit.ops import matmul as _op
from cukit.ops.bias_act import ACTIVATIONS, _torch_act, activation_id
from cukit.torch._register import DIRECT, DISPATCH, FLOATS, FUNCTION, TorchOp, autocast_lower, eager_path
from cukit.torch.bias_act import bias_act_backward

__all__ = ["linear", "matmul"]


def _prec(precision: str | None) -> str:
    return _op._resolve_precision(precision)


# ---------------------------------------------------------------------------------------------
# cukit::matmul
# ---------------------------------------------------------------------------------------------


def _matmul_impl(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b (numpy.matmul semantics) for tensors of one float dtype; see ``cukit.matmul``."""
    if a.is_cuda:
        return _op._matmul_gpu(a, b, precision=precision)  # validated on a signature's first call
    # CPU: torch.matmul has numpy.matmul's semantics for same-dtype tensors and refuses everything
    # else; cukit's checks run only then, so the error names cukit.matmul and the argument
    try:
        return _op.reference_torch(a, b)
    except RuntimeError:
        _refused(a, b)
        raise


def _refused(a: torch.Tensor, b: torch.Tensor) -> None:
    """cukit's checks, run once torch has refused a CPU product: the error then names
    cukit.matmul and the argument (torch's own is raised where they pass)."""
    _op._validate_pair(a, b)
    _op.matmul_shape(tuple(a.shape), tuple(b.shape))


def _matmul_fake(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    _, _, _, _, out_shape = _op.matmul_shape(tuple(a.shape), tuple(b.shape))
    return a.new_empty(out_shape)


def _same_fp32_precision(t: torch.Tensor, precision: str) -> bool:
    """Whether torch's ops multiply float32 `t` with cukit's `precision` (other dtypes: always).
    dynamo traces the ``allow_tf32`` read and guards on it (``get_float32_matmul_precision`` it
    cannot trace)."""
    return t.dtype is not torch.float32 or torch.backends.cuda.matmul.allow_tf32 == (precision == "tf32")


def _matmul_compile_as(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``torch.matmul``, what inductor compiles cukit::matmul as (the compile policy); float32 with a
    precision other than torch's own setting keeps the custom op."""
    if not _same_fp32_precision(a, precision):
        return NotImplemented
    _op._validate_pair(a, b)
    _op.matmul_shape(tuple(a.shape), tuple(b.shape))
    return _op.reference_torch(a, b)


def _matmul_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
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


def _backward_is_direct(*tensors: torch.Tensor | None) -> bool:
    """Whether a backward formula may launch the kernels straight away: nothing records or traces
    it (a backward without create_graph). Else it calls the differentiable entry points (double
    backward, torch.compile, tensor subclasses)."""
    first = tensors[0]
    return first is not None and first.is_cuda and eager_path(*tensors) == DIRECT


def _product(prec: str, direct: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product a backward formula uses (see _backward_is_direct)."""
    if direct:
        return lambda a, b: _op._matmul_gpu(a, b, precision=prec)
    return lambda a, b: matmul(a, b, precision=prec)


def _matmul_bwd(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    mm = _product(ctx.precision, _backward_is_direct(grad, a, b))
    if a.ndim == 2 and b.ndim == 2:  # the common case, without the batch bookkeeping
        da = mm(grad, b.mT) if ctx.needs_input_grad[0] else None
        db = mm(a.mT, grad) if ctx.needs_input_grad[1] else None
        return da, db, None
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
            da = mm(gf, bf.t())
        else:
            da = _sum_to(mm(g, b2.mT), tuple(a2.shape))
        da = da.reshape(a.shape)
    if ctx.needs_input_grad[1]:
        if _is_one_matrix(tuple(b2.shape)) and nbatch > 1:
            # dB = sum_z A[z]^T g[z] = A'^T g' with A' (batch * M, K), g' (batch * M, N)
            af = a2.expand((*batch, M, K)).reshape(nbatch * M, K)
            db = mm(af.t(), g.reshape(nbatch * M, N))
        else:
            db = _sum_to(mm(a2.mT, g), tuple(b2.shape))
        db = db.reshape(b.shape)
    return da, db, None


def _matmul_vmap(info: torch.library.VmapInfo, in_dims: tuple, a: torch.Tensor, b: torch.Tensor,
                 precision: str) -> tuple[torch.Tensor, int]:
    """vmap of numpy.matmul semantics: the vmapped dimension becomes a leading batch dimension
    (1-D per-sample operands promoted, and the added axis removed, as matmul does)."""
    ad, bd = in_dims[0], in_dims[1]
    sa = a.shape[1:] if ad is not None else a.shape  # per-sample shapes
    sb = b.shape[1:] if bd is not None else b.shape
    a = a.movedim(ad, 0) if ad is not None else a
    b = b.movedim(bd, 0) if bd is not None else b
    va, vb = len(sa) == 1, len(sb) == 1
    if va:
        a = a.unsqueeze(-2)
    if vb:
        b = b.unsqueeze(-1)
    ra, rb = max(len(sa), 2), max(len(sb), 2)
    rank = max(ra, rb)  # per-sample rank after promotion; the vmapped one gets B in front
    if ad is not None:
        a = a.reshape(a.shape[0], *([1] * (rank - ra)), *a.shape[1:])
    if bd is not None:
        b = b.reshape(b.shape[0], *([1] * (rank - rb)), *b.shape[1:])
    out = matmul(a, b, precision=precision)
    if vb:
        out = out.squeeze(-1)
    if va:
        out = out.squeeze(-1 if vb else -2)
    return out, 0


MATMUL = TorchOp(
    "matmul",
    _matmul_impl,
    fake=_matmul_fake,
    setup_context=_matmul_setup,
    backward=_matmul_bwd,
    autocast="lower",
    vmap=_matmul_vmap,
    compile_as=_matmul_compile_as,
)


def matmul(
    a: torch.Tensor, b: torch.Tensor, *, precision: str | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """a @ b for torch tensors, differentiable; see ``cukit.matmul``."""
    if not isinstance(b, torch.Tensor):
        _op._validate_pair(a, b)  # a clear TypeError for mixed array types
    path = eager_path(a, b)
    if (
        path in (DIRECT, FUNCTION)  # plain tensors; no compile, tracing, functorch
        and out is None
        and not a.is_cuda
        and a.dtype is b.dtype
        and a.dtype in FLOATS
        and (precision is None or precision in _op.PRECISIONS)
        and not torch.is_autocast_enabled("cpu")
    ):
        # plain CPU tensors: the reference is torch.matmul itself, autograd included (its formulas
        # are the ones cukit's would run on the CPU)
        try:
            return torch.matmul(a, b)
        except RuntimeError:
            _refused(a, b)
            raise
    if path == DISPATCH and out is None and a.dtype == b.dtype:
        return MATMUL(a, b, _prec(precision))
    cast = autocast_lower((a, b), "cuda" if a.is_cuda else "cpu")
    if cast is not None:
        a, b = cast  # type: ignore[assignment]
    prec = _prec(precision)
    if a.dtype != b.dtype or out is not None or a.dtype not in FLOATS:
        return _matmul_general(a, b, prec, out, path)
    if path == DIRECT:
        return _matmul_impl(a, b, prec)
    return MATMUL.graph_call(path, a, b, prec)



def _matmul_general(a: torch.Tensor, b: torch.Tensor, prec: str, out: torch.Tensor | None, path: int) -> torch.Tensor:
    """Mixed dtypes (NumPy's promotion), non-float dtypes (torch.matmul on the CPU) and ``out=``."""
    _op._validate_pair(a, b)
    _, _, _, _, out_shape = _op.matmul_shape(tuple(a.shape), tuple(b.shape))
    rdt = _op.result_dtype(_op._dtype_name(a, "torch"), _op._dtype_name(b, "torch"))
    if out is not None:
        _op._check_out(out, "torch", _op.device_of(a), out_shape, rdt)
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            raise RuntimeError(
                "cukit.matmul(): functions with out=... arguments don't support automatic differentiation, "
                "but one of the arguments requires grad."
            )
    dt = getattr(torch, rdt)
    a, b = a.to(dt), b.to(dt)
    if rdt not in _op.FLOAT_DTYPES:
        if a.is_cuda:
            raise TypeError(f"matmul on the GPU supports {', '.join(_op.FLOAT_DTYPES)}; got {rdt}")
        if a.is_complex():
            raise TypeError(f"cukit.matmul supports real dtypes for torch tensors; got {rdt}")
        r = _op.reference_torch(a, b)  # integers and bool: torch.matmul, differentiable as it is
    elif out is not None and a.is_cuda and path == DIRECT:
        return _op._matmul_gpu(a, b, precision=prec, out=out)
    else:
        r = matmul(a, b, precision=prec)
    if out is None:
        return r
    out.copy_(r)
    return out


# ---------------------------------------------------------------------------------------------
# cukit::linear
# ---------------------------------------------------------------------------------------------


def _act_id(activation: str | None) -> int:
    return -1 if activation is None else activation_id(activation)


def _linear_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, precision: str
) -> torch.Tensor:
    """act(x @ weight.T + bias); see ``cukit.linear``."""
    if x.is_cuda:
        return _op.linear_gpu(
            x, weight, bias, _act_id(activation), precision=precision,
            check=lambda: _op._validate_linear(x, weight, bias, activation),
        )
    # CPU: what torch would accept but cukit does not (a 1-D weight, a broadcast bias, an unknown
    # activation) is checked here; the rest only when torch refuses, for an error naming the argument
    if (
        weight.ndim != 2
        or (bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]))
        or (activation is not None and activation not in ACTIVATIONS)
        or x.dtype is not weight.dtype
        or (bias is not None and bias.dtype is not x.dtype)
    ):
        _op._validate_linear(x, weight, bias, activation)
    try:
        return _op.linear_reference_torch(x, weight, bias, activation)
    except RuntimeError:
        _op._validate_linear(x, weight, bias, activation)
        raise


def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, precision: str
) -> torch.Tensor:
    _op._validate_linear(x, weight, bias, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_compile_as(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, precision: str
) -> torch.Tensor:
    """``act(F.linear(x, weight, bias))`` in torch's ops, what inductor compiles cukit::linear as
    (the compile policy: it fuses the bias and activation into its GEMM's epilogue or one pointwise
    kernel). Numerics are torch's: a 16-bit product is rounded before the activation."""
    if not _same_fp32_precision(x, precision):
        return NotImplemented
    _op._validate_linear(x, weight, bias, activation)
    z = torch.nn.functional.linear(x, weight, bias)
    return z if activation is None else _torch_act(z, activation)


def _linear_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias, activation, precision = inputs
    # relu's derivative comes from the output; the others recompute the pre-activation.
    ctx.save_for_backward(x, weight, bias, output if activation == "relu" else None)
    ctx.activation = activation
    ctx.precision = precision


def _linear_bwd(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
    x, weight, bias, y = ctx.saved_tensors
    act, prec = ctx.activation, ctx.precision
    out_f, in_f = weight.shape
    dy2 = dy.reshape(-1, out_f)
    mm = _product(prec, _backward_is_direct(dy, x, weight, bias))
    needs = ctx.needs_input_grad
    db = None
    if act is None:
        g = dy2
        if bias is not None and needs[2]:
            db = g.sum(0)  # torch accumulates 16-bit sums in float32
    else:
        if act == "relu":
            z, zb = y.reshape(-1, out_f), dy2.new_zeros(out_f)  # (y + 0 > 0) == (x W^T + b > 0)
        else:
            z = mm(x.reshape(-1, in_f), weight.t())  # recomputed x W^T
            zb = dy2.new_zeros(out_f) if bias is None else bias
        g, db = bias_act_backward(dy2.contiguous(), z, zb, act)
    dx = mm(g, weight).reshape(x.shape) if needs[0] else None
    dw = mm(g.t(), x.reshape(-1, in_f)) if needs[1] else None
    return dx, dw, db if bias is not None and needs[2] else None, None, None


def _linear_vmap(info: torch.library.VmapInfo, in_dims: tuple, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, activation: str | None, precision: str) -> tuple[torch.Tensor, int]:
    xd, wd, bd = in_dims[0], in_dims[1], in_dims[2]
    x = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
    if wd is None and bd is None:  # shared parameters: one linear over the folded batch
        return linear(x, weight, bias, activation, precision=precision), 0
    # per-sample parameters: a batched product, then bias and activation in plain torch maths
    B = info.batch_size
    w = weight.movedim(wd, 0) if wd is not None else weight.expand(B, *weight.shape)
    xs = x.reshape(B, -1, x.shape[-1])
    z = matmul(xs, w.mT, precision=precision)
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    z = z.to(acc)
    if bias is not None:
        b = bias.movedim(bd, 0) if bd is not None else bias.expand(B, *bias.shape)
        z = z + b.to(acc).unsqueeze(1)
    if activation is not None:
        from cukit.ops.bias_act import _torch_act

        z = _torch_act(z, activation)
    return z.to(x.dtype).reshape(*x.shape[:-1], w.shape[1]), 0


LINEAR = TorchOp(
    "linear",
    _linear_impl,
    fake=_linear_fake,
    setup_context=_linear_setup,
    backward=_linear_bwd,
    autocast="lower",
    vmap=_linear_vmap,
    compile_as=_linear_compile_as,
)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    precision: str | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) for torch tensors, differentiable; see ``cukit.linear``."""
    path = eager_path(x, weight, bias)
    prec = _prec(precision)
    if path == DISPATCH:
        return LINEAR(x, weight, bias, activation, prec)
    if activation is not None and activation not in ACTIVATIONS:
        _op._validate_linear(x, weight, bias, activation)  # the error names the accepted values
    cast = autocast_lower((x, weight, bias), "cuda" if x.is_cuda else "cpu")
    if cast is not None:
        x, weight, bias = cast  # type: ignore[assignment]
    if path == DIRECT:
        return _linear_impl(x, weight, bias, activation, prec)
    return LINEAR.graph_call(path, x, weight, bias, activation, prec)
