"""Per-sample gradients and their norms for torch models: ``cukit.per_sample_grads`` and
``cukit.per_sample_grad_norms`` (and the engine under ``cukit.dp``).

How it works (one forward, one backward pass, no parameter gradients computed by autograd):

1. Forward hooks on every module that owns trainable parameters record, per call, the layer's
   input (activations) and the gradient edge of its output (``torch.autograd.graph.get_gradient_edge``,
   taken before any in-place op on the output, so an in-place ReLU after a Linear is fine).
2. One ``torch.autograd.grad(loss, edges)`` gives every recorded output's gradient G. The engine
   stops at those edges: no weight-gradient GEMM runs in this pass. Norms and per-sample grads
   ask it only for the layers no other recorded layer leads to, and take every other layer's G
   from a hook on its output's node as the pass reaches it, forming that layer's part at once:
   the G of a few layers are alive at a time, as in a plain backward pass (a DP step keeps them
   all: its clipped sums need the norms of every layer first).
3. Per layer kind, per-sample grads / ghost norms / clipped sums are formed from (A, G) by the
   array-level ops of ``cukit.ops.per_sample`` (kernels on CUDA, torch references on the CPU).

Supported layers (fused path): torch.nn.Linear and cukit.nn.Linear (with a fused activation, the
grad w.r.t. its pre-activation is recovered as G * act'(x W^T + b)), transformers' and cukit's
Conv1D (``y = x W + b``), torch.nn.Conv1d/Conv2d and cukit.nn.Conv2d (any stride, padding, dilation,
groups, padding mode; on CUDA by default an implicit GEMM that never stores the patches, see
``cukit.ops.per_sample.conv_route``), torch.nn.Embedding (not ``scale_grad_by_freq``), LayerNorm
(torch and cukit), RMSNorm (torch.nn.RMSNorm, cukit.nn.RMSNorm, Hugging Face's Llama/Gemma/OLMo-2
RMSNorm recognised by their code), and the biases of all of them. Inputs may be (B, d) or
(B, ..., d) (sequence models: per-sample grad = sum over positions). Any other module owning
parameters takes a ``torch.func`` fallback (vmap over samples of the vector-Jacobian product of
that module alone), which is exact for modules that treat samples independently. BatchNorm in
training mode mixes samples (per-sample gradients are undefined): ValueError naming the module.

Limits: a parameter used both through its module and functionally elsewhere (``F.linear(h,
layer.weight)`` outside ``layer``) is not detected, and that use is missed (one used ONLY
functionally by a module without parameters is a ValueError); the fallback passes keyword
arguments unbatched.

The loss contract: ``loss_fn(outputs, targets)`` returns a scalar that is the SUM over samples of
per-sample losses (``reduction="sum"``), or their MEAN with ``loss_reduction="mean"`` (the result
is then multiplied by the batch size). Per-sample gradient i is the gradient of sample i's loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cukit.ops import per_sample as ops

__all__ = ["Capture", "capture", "per_sample_grad_norms", "per_sample_grads"]

LossFn = Callable[[Any, Any], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Layer kinds: what a call records, and per-sample grads / squared norms / clipped sums from it
# ---------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One forward call of a module that owns parameters: its saved input(s) and the gradient
    edges of the tensor(s) whose gradient the layer's formulas need (one for the fused kinds; each
    differentiable tensor of a tuple output for the fallback)."""

    module: nn.Module
    kind: Kind
    saved: Any
    edges: list[Any]
    params: dict[str, nn.Parameter]  # the module's own trainable parameters by local name
    positions: tuple[int, ...] = (0,)  # where in the module's output the edges' tensors are
    # the output grad (a tensor; a tuple aligned with positions for the fallback); None: unused
    grad: Any = None
    cache: dict[str, Any] = field(default_factory=dict)  # what a kind derives once per call
    roots: tuple[Any, ...] = ()  # the autograd nodes of the call's inputs (where its backward goes on)
    # G is autograd's own buffer, handed to a hook while the backward still runs (it may alias the
    # gradient flowing on): read it, never write over it
    borrowed: bool = False

    @property
    def dtype(self) -> torch.dtype:
        g = self.grad
        return next(t for t in g if t is not None).dtype if isinstance(g, tuple) else g.dtype


class Kind:
    """A layer kind. Subclasses implement :meth:`grads`; :meth:`sq_norms` and :meth:`clipped`
    default to materialising the per-sample grads (right for small parameters: norm weights,
    biases, the fallback)."""

    name = "?"

    def save(self, m: nn.Module, args: tuple, kwargs: dict, out: Any) -> tuple[Any, torch.Tensor]:
        """(what to keep, the tensor whose gradient is wanted); the default: input 0, output."""
        return args[0].detach(), out

    def grads(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def sq_norms(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: ops.row_sq_norms(v) for k, v in self.grads(c, g).items()}

    def clipped(self, c: Call, g: torch.Tensor, f: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """out[name] += sum_i f[i] * per-sample grad i (out holds p.grad-shaped accumulators)."""
        for k, v in self.grads(c, g).items():
            ops.weighted_sum(v, f, out[k])


def _like(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Activations in the output grad's dtype (under autocast a layer's input is float32 while
    its output, and so G, is 16-bit): the GEMMs take one dtype."""
    return a if a.dtype == g.dtype else a.to(g.dtype)


def _rows_as(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return v.reshape(v.shape[0], *p.shape)


_PREACT_CHUNK_BYTES = 16 << 20  # rows of the pre-activation remade at once when G is large


def _act_backward(act: str, g: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = g * act'(z) for cukit's activations, by torch's own derivative kernels (one
    elementwise pass; ``out`` may be g or z itself: each element is read before it is written)."""
    aten = torch.ops.aten
    if act == "relu":
        return aten.threshold_backward.grad_input(g, z, 0, grad_input=out)
    if act == "silu":
        return aten.silu_backward.grad_input(g, z, grad_input=out)
    return aten.gelu_backward.grad_input(g, z, approximate="tanh" if act == "gelu_tanh" else "none", grad_input=out)


def _pre_activation_grad(m: nn.Module, x: torch.Tensor, g: torch.Tensor, weight_t: torch.Tensor,
                         borrowed: bool = False) -> torch.Tensor:
    """G * act'(x W^T + b) for a cukit layer with a fused activation (one extra x W^T + b, the
    bias in the GEMM's epilogue, then one elementwise pass). A large G that fills its whole
    storage (the backward hands G over as a view of its own buffer) is overwritten with the result
    a chunk of rows at a time: the whole pre-activation beside G and a second output-sized buffer
    would add two layer outputs to the peak (G is not read again: the kinds keep the result).
    borrowed: G belongs to a backward still running (never written over)."""
    act = getattr(m, "activation", None)
    if act is None:
        return g
    xg, wt = _like(x, g), _like(weight_t, g)
    b = _like(m.bias.detach(), g) if m.bias is not None else None
    n_out = g.shape[-1]
    rows = g.numel() // max(1, n_out)
    x2 = xg.reshape(rows, xg.shape[-1])

    def pre(lo: int, hi: int) -> torch.Tensor:
        return torch.matmul(x2[lo:hi], wt) if b is None else torch.addmm(b, x2[lo:hi], wt)

    step = max(1, _PREACT_CHUNK_BYTES // max(1, n_out * g.element_size()))
    owns = not borrowed and g.is_contiguous() and g.untyped_storage().nbytes() == g.numel() * g.element_size()
    if rows <= step or not owns:
        z = pre(0, rows)
        return _act_backward(act, g.reshape(rows, n_out), z, z).view(g.shape)  # over z: it is ours
    g2 = g.view(rows, n_out)
    for lo in range(0, rows, step):
        gi = g2[lo:lo + step]
        _act_backward(act, gi, pre(lo, lo + step), gi)
    return g


class LinearKind(Kind):
    """``y = act(x W^T + b)``; ``transposed``: Conv1D's ``y = act(x W + b)`` with W (in, out)."""

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed
        self.name = "Conv1D" if transposed else "Linear"

    def _ag(self, c: Call, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G w.r.t. the pre-activation): kept on the call, so that the norms and the clipped
        sum of a DP step recompute a fused activation's pre-activation once."""
        ag = c.cache.get("ag")
        if ag is None:
            w = c.module.weight.detach()
            g = _pre_activation_grad(c.module, c.saved, g, w if self.transposed else w.t(), c.borrowed)
            ag = c.cache["ag"] = (_like(c.saved, g), g)
        return ag

    def grads(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        a, g = self._ag(c, g)
        out = {}
        if "weight" in c.params:
            dw = ops.linear_grads(a, g)
            out["weight"] = dw.transpose(1, 2) if self.transposed else dw
        if "bias" in c.params:
            out["bias"] = ops.sum_over_t(ops._as_3d(g))
        return out

    def sq_norms(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        a, g = self._ag(c, g)
        if a.ndim == 2 and "weight" in c.params and "bias" in c.params:
            gn = ops.row_sq_norms(g)  # ||g_i||^2 is both the bias's norm and a factor of the weight's
            return {"weight": ops.row_sq_norms(a) * gn, "bias": gn}
        out = {}
        if "weight" in c.params:
            out["weight"] = ops.linear_sq_norms(a, g)
        if "bias" in c.params:
            out["bias"] = ops.row_sq_norms(ops.sum_over_t(ops._as_3d(g), out_dtype=torch.float64 if g.dtype ==
                                                          torch.float64 else torch.float32))
        return out

    def clipped(self, c: Call, g: torch.Tensor, f: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        # Book-Keeping: sum_i f_i G_i^T A_i = (f ⊙ G)^T A, one GEMM over all B * T rows
        a, g = self._ag(c, g)
        g3 = ops._as_3d(g)
        if "weight" in c.params:
            a2 = _unit(ops._as_3d(a).reshape(-1, a.shape[-1]))
            g2 = ops.scale_rows(g3, f).reshape(-1, g3.shape[-1])
            lhs, rhs = (a2.t(), g2) if self.transposed else (g2.t(), a2)
            _addmm_(out["weight"], lhs, rhs)
        if "bias" in c.params:  # per-sample sums (B blocks wide), then their weighted sum
            ops.weighted_sum(ops.sum_over_t(g3), f, out["bias"])


def _unit(t: torch.Tensor) -> torch.Tensor:
    """t itself when one of its two strides is 1 (gemm reads it in place), else a copy."""
    return t if t.stride(-1) == 1 or t.stride(-2) == 1 else t.contiguous()


def _addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b: cukit's gemm (beta = 1, fp32 accumulation, no copy of the transposed
    operand) on CUDA, torch's addmm on the CPU."""
    wide = out.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)
    if out.is_cuda and (out.dtype == a.dtype or wide) and out.stride(-1) == 1:
        from cukit.ops.matmul import gemm

        gemm(a, b, out, alpha=1.0, beta=1.0, precision="ieee")
    else:
        out.add_(a.to(out.dtype) @ b.to(out.dtype))


class ConvKind(Kind):
    """torch.nn.Conv1d/Conv2d and cukit.nn.Conv2d: per-sample grads, ghost norms and clipped sums
    from the saved input x and the output grad G, by ``cukit.ops.per_sample``'s conv ops (a Conv1d
    as a Conv2d of height 1; the route, per layer shape, by ``ops.conv_route``)."""

    name = "Conv"

    def save(self, m: nn.Module, args: tuple, kwargs: dict, out: Any) -> tuple[Any, torch.Tensor]:
        return args[0].detach(), out

    def _xg(self, c: Call, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ops.ConvShape]:
        """(x, G w.r.t. the pre-activation, shape) as the conv ops take them; kept on the call, so
        that a DP step's norms and clipped sum prepare them once."""
        hit = c.cache.get("xg")
        if hit is not None:
            return hit
        m = c.module
        x = c.saved
        one_d = isinstance(m, nn.Conv1d)
        if one_d:  # a (B, C, W) conv is a (B, C, 1, W) one
            x, g = x.unsqueeze(2), g.unsqueeze(2)
        ks = (1, *m.kernel_size) if one_d else tuple(m.kernel_size)
        st = (1, *m.stride) if one_d else tuple(m.stride)
        dil = (1, *m.dilation) if one_d else tuple(m.dilation)
        if getattr(m, "activation", None) is not None:  # G * act'(z), z remade with its bias
            b = _like(m.bias.detach(), g) if m.bias is not None else None
            z = F.conv2d(_pad_input(m, _like(x, g), one_d, ks, dil), _like(m.weight.detach(), g), b, st, 0, dil,
                         m.groups)
            g = _act_backward(m.activation, g, z, z)
        if m.padding_mode == "zeros":  # the kernels read past the input as zeros: no padded copy
            pad = _zero_pads(m, one_d, ks, dil)
        else:
            x, pad = _pad_input(m, x, one_d, ks, dil), (0, 0)
        x = _like(x, g).contiguous()
        g = g.contiguous()
        _, C, H, W = x.shape
        _, K, P, Q = g.shape
        shape = ops.ConvShape(C, H, W, K, P, Q, ks[0], ks[1], st, pad, dil, m.groups)
        hit = c.cache["xg"] = (x, g, shape)
        return hit

    def grads(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        x, g, s = self._xg(c, g)
        out = {}
        if "weight" in c.params:
            dw, db = ops.conv_grads(x, g, s, bias="bias" in c.params)
            out["weight"] = dw.view(g.shape[0], *c.module.weight.shape)
            if db is not None:
                out["bias"] = db
        elif "bias" in c.params:
            out["bias"] = g.sum((2, 3), dtype=ops._acc(g)).to(g.dtype)
        return out

    def sq_norms(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        x, g, s = self._xg(c, g)
        if "weight" not in c.params:
            return {"bias": ops.row_sq_norms(g.sum((2, 3), dtype=ops._acc(g)))}
        sw, sb = ops.conv_sq_norms(x, g, s, bias="bias" in c.params)
        return {"weight": sw} if sb is None else {"weight": sw, "bias": sb}

    def clipped(self, c: Call, g: torch.Tensor, f: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        x, g, s = self._xg(c, g)
        if "weight" in c.params:
            ops.conv_clipped(x, g, s, f, out["weight"], out.get("bias") if "bias" in c.params else None)
        elif "bias" in c.params:
            ops.weighted_sum(g.sum((2, 3), dtype=ops._acc(g)), f, out["bias"])


def _zero_pads(m: nn.Module, one_d: bool, ks: tuple, dil: tuple) -> tuple[int, int]:
    """The top and left zero pads of a zeros-mode conv ("same": torch's split, the odd pixel at
    the bottom/right, which the kernels never need to see)."""
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return 0, 0
        return tuple(d * (k - 1) // 2 for k, d in zip(ks, dil, strict=True))  # type: ignore[return-value]
    return (0, *m.padding) if one_d else tuple(m.padding)  # type: ignore[return-value]


def _pad_input(m: nn.Module, x: torch.Tensor, one_d: bool, ks: tuple, dil: tuple) -> torch.Tensor:
    """x padded as the module pads it (any padding mode, "same"/"valid" included)."""
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return x
        pads: list[int] = []
        for k, d in zip(reversed(ks), reversed(dil), strict=True):  # F.pad: last dimension first
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        if one_d:
            pads[2:] = [0, 0]
    else:
        p = (0, *m.padding) if one_d else tuple(m.padding)
        pads = [p[1], p[1], p[0], p[0]]
    if not any(pads):
        return x
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    if one_d and mode != "constant":  # reflect/replicate/circular on the W axis only
        return F.pad(x.squeeze(2), pads[:2], mode=mode).unsqueeze(2)
    return F.pad(x, pads, mode=mode)


class EmbeddingKind(Kind):
    name = "Embedding"

    def grads(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        m = c.module
        return {"weight": ops.embedding_grads(c.saved, g, m.num_embeddings, m.padding_idx)}

    def sq_norms(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": ops.embedding_sq_norms(c.saved, g, c.module.padding_idx)}

    def clipped(self, c: Call, g: torch.Tensor, f: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        m = c.module
        idx = c.saved.reshape(-1)
        gs = ops.scale_rows(g.reshape(g.shape[0], -1, g.shape[-1]), f).reshape(-1, g.shape[-1])
        if m.padding_idx is not None:
            gs = gs * (idx != m.padding_idx).unsqueeze(1).to(gs.dtype)
        scatter_rows_sum_(out["weight"], idx, gs)


def scatter_rows_sum_(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[idx[j]] += rows[j]`` for every j, deterministic and sync-free: on CUDA (16-bit and
    float32 out) the rows sorted by index (stable) and summed per index through a float64 prefix
    sum; only the last row of each index's
    run carries the run's sum, the others add exact zeros, so the order in which CUDA's accumulating
    index_put adds duplicates (atomics) cannot change the result. idx (n,) integer, rows (n, d),
    out (V, d)."""
    n = idx.shape[0]
    if n == 0:
        return out
    if out.device.type == "cpu" or out.dtype == torch.float64:
        # the CPU accumulates in order (deterministic); float64 sums directly, without a prefix sum's
        # cancellation (CUDA's float64 atomics may differ in the last bit run to run)
        return out.index_put_((idx,), rows.to(out.dtype), accumulate=True)
    return _scatter_rows_sum_sorted_(out, idx, rows)


def _scatter_rows_sum_sorted_(out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`scatter_rows_sum_`'s CUDA path (any device; n >= 1)."""
    n = idx.shape[0]
    order = torch.argsort(idx, stable=True)
    sidx = idx[order]
    csum = torch.cumsum(rows[order].to(torch.float64), 0)
    first = torch.ones(n, dtype=torch.bool, device=idx.device)
    first[1:] = sidx[1:] != sidx[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    run_start = torch.cummax(torch.where(first, torch.arange(n, device=idx.device), 0), 0).values
    before = torch.cat([csum.new_zeros((1, csum.shape[1])), csum[:-1]])  # the prefix before row j
    run_sum = csum - before[run_start]
    out.index_put_((sidx,), torch.where(last.unsqueeze(1), run_sum, 0).to(out.dtype), accumulate=True)
    return out

class NormKind(Kind):
    """LayerNorm and RMSNorm: per-sample weight grad = sum over positions of G * x̂, bias = sum of
    G; x̂ is recomputed from the saved input (float32 maths for 16-bit inputs)."""

    def __init__(self, rms: bool, eps_attr: str, fp32: bool = False) -> None:
        # fp32: x̂ in float32 whatever the input dtype, as transformers' RMSNorms compute it
        self.rms, self.eps_attr, self.fp32 = rms, eps_attr, fp32
        self.name = "RMSNorm" if rms else "LayerNorm"

    def _dims(self, c: Call) -> int:
        ns = getattr(c.module, "normalized_shape", None)
        return len(ns) if ns is not None else 1

    def grads(self, c: Call, g: torch.Tensor) -> dict[str, torch.Tensor]:
        m, x = c.module, c.saved
        k = self._dims(c)
        dims = tuple(range(x.ndim - k, x.ndim))
        acc = torch.float64 if x.dtype == torch.float64 and not self.fp32 else torch.float32
        xf = x.to(acc)
        eps = getattr(m, self.eps_attr)
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        if self.rms:
            xhat = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
        else:
            var, mean = torch.var_mean(xf, dims, correction=0, keepdim=True)
            xhat = (xf - mean) * torch.rsqrt(var + eps)
        B = x.shape[0]
        D = math.prod(x.shape[x.ndim - k:])
        g3 = g.reshape(B, -1, D)
        out = {}
        if "weight" in c.params:
            w = c.params["weight"]
            out["weight"] = ops.sum_over_t(g3, xhat.to(g.dtype).reshape(B, -1, D)).reshape(B, *w.shape)
        if "bias" in c.params:
            out["bias"] = ops.sum_over_t(g3).reshape(B, *c.params["bias"].shape)
        return out


class FallbackKind(Kind):
    """Any other module owning parameters: ``torch.func.vmap`` over samples of ``torch.func.grad``
    of <module(params, input_i), G_i>, the module's own parameters only."""

    name = "torch.func"

    def save(self, m: nn.Module, args: tuple, kwargs: dict, out: Any) -> tuple[Any, Any]:
        if not isinstance(out, (torch.Tensor, tuple, list)):
            raise ValueError(
                f"cukit.per_sample_grads: {type(m).__name__} has no fused per-sample rule and returns "
                f"{type(out).__name__}; the torch.func fallback needs a tensor or a tuple of tensors"
            )
        return (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs)), out

    def grads(self, c: Call, g: Any) -> dict[str, torch.Tensor]:
        from torch.func import functional_call, grad, vmap

        m = c.module
        args, kwargs = c.saved
        gs = g if isinstance(g, tuple) else (g,)
        used = [(pos, gi) for pos, gi in zip(c.positions, gs, strict=True) if gi is not None]
        B = used[0][1].shape[0]
        dims = tuple(0 if isinstance(a, torch.Tensor) and a.ndim and a.shape[0] == B else None for a in args)
        params = {k: p.detach() for k, p in c.params.items()}

        def vjp(p: dict[str, torch.Tensor], gi: list[torch.Tensor], *ai: Any) -> torch.Tensor:
            one = tuple(a.unsqueeze(0) if d == 0 else a for a, d in zip(ai, dims, strict=True))
            y = functional_call(m, p, one, kwargs)
            ys = y if isinstance(y, (tuple, list)) else (y,)
            return sum((ys[pos] * gk.unsqueeze(0)).sum() for (pos, _), gk in zip(used, gi, strict=True))

        with _paused():
            return vmap(grad(vjp), in_dims=(None, 0, *dims))(params, [gi for _, gi in used], *args)


_LINEAR, _CONV1D, _CONV, _EMB = LinearKind(), LinearKind(transposed=True), ConvKind(), EmbeddingKind()
_LN = NormKind(rms=False, eps_attr="eps")
_FALLBACK = FallbackKind()


def kind_of(m: nn.Module) -> Kind:
    """The layer kind of a module owning parameters (ValueError for training-mode BatchNorm)."""
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
        raise ValueError(
            f"cukit.per_sample_grads: {type(m).__name__} normalises with batch statistics, which mix the samples: "
            "per-sample gradients are undefined (use GroupNorm or LayerNorm, or put it in eval mode)"
        )
    import cukit.nn as cnn

    fwd = type(m).forward  # a subclass with its own forward (LoRA, quantised layers) takes the fallback
    if isinstance(m, nn.Linear) and fwd in (nn.Linear.forward, cnn.Linear.forward):
        return _LINEAR
    if _is_conv1d_transposed(m):
        return _CONV1D
    if isinstance(m, (nn.Conv1d, nn.Conv2d)) and fwd in (nn.Conv1d.forward, nn.Conv2d.forward, cnn.Conv2d.forward):
        return _CONV
    if isinstance(m, nn.Embedding) and not m.scale_grad_by_freq and fwd is nn.Embedding.forward:
        return _EMB
    if isinstance(m, nn.LayerNorm) and fwd in (nn.LayerNorm.forward, cnn.LayerNorm.forward):
        return _LN
    if isinstance(m, nn.RMSNorm) and fwd is nn.RMSNorm.forward:
        return NormKind(rms=True, eps_attr="eps")
    rms = _rms_eps_attr(m)
    if rms is not None:
        return NormKind(rms=True, eps_attr=rms, fp32=not isinstance(m, _cukit_rms_norm()))
    return _FALLBACK


def _is_conv1d_transposed(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2) and cukit.nn.Conv1D: ``y = x W + b``, W of shape (nx, nf)."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.ndim == 2
            and tuple(w.shape) == (getattr(m, "nx", -1), getattr(m, "nf", -1)))


def _cukit_rms_norm() -> type:
    from cukit.nn.norm import RMSNorm

    return RMSNorm


def _rms_eps_attr(m: nn.Module) -> str | None:
    """Where the eps of an RMSNorm lives, for cukit.nn.RMSNorm and the transformers RMSNorms whose
    code cukit.nn.norm recognises (Llama, Gemma, OLMo-2); None for anything else."""
    from cukit.nn.norm import RMSNorm, _style_of

    if isinstance(m, RMSNorm):
        return "eps"
    if type(m).__name__.endswith("RMSNorm"):
        s = _style_of(m)
        if s is not None:
            return s.eps_attr
    return None


# ---------------------------------------------------------------------------------------------
# Capture: hooks recording each call
# ---------------------------------------------------------------------------------------------

_STATE = {"paused": 0}


@contextmanager
def _paused() -> Iterator[None]:
    """No recording inside (the fallback re-runs modules under vmap)."""
    _STATE["paused"] += 1
    try:
        yield
    finally:
        _STATE["paused"] -= 1


@dataclass
class Capture:
    """The calls recorded during one forward pass, the model's trainable parameter names, and
    what the norms need of its parameters (read in the same walk of the module tree)."""

    calls: list[Call] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # id(trainable parameter) -> model's name for it
    any_float64: bool = False  # some parameter is float64: norms are float64
    device: torch.device | None = None  # the first parameter's device (None: no parameters)
    consumer: Any = None  # what took the output grads during the backward (see run)


@contextmanager
def capture(model: nn.Module) -> Iterator[Capture]:
    """Record every call of every module of `model` that owns trainable parameters (see the module
    docstring). ValueError for a training-mode BatchNorm before anything runs."""
    from torch.autograd.graph import get_gradient_edge

    cap = Capture()
    handles = []

    def hook(m: nn.Module, args: tuple, kwargs: dict, out: Any, kind: Kind, params: dict) -> None:
        if _STATE["paused"] or not torch.is_grad_enabled():
            return
        saved, t = kind.save(m, args, kwargs, out)
        ts = tuple(t) if isinstance(t, (tuple, list)) else (t,)
        pos = tuple(i for i, o in enumerate(ts) if isinstance(o, torch.Tensor) and o.grad_fn is not None)
        if pos:
            roots = tuple(a.grad_fn for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor) and a.grad_fn is not None)
            cap.calls.append(Call(m, kind, saved, [get_gradient_edge(ts[i]) for i in pos], params, pos,
                                  roots=roots))

    try:
        # one walk (named_parameters() per module and for the model would each walk it again: the
        # call is host-bound for small models); names and order are named_parameters()'s
        names = cap.names
        for prefix, m in model.named_modules():
            own = {}
            for k, p in m._parameters.items():
                if p is None:
                    continue
                if cap.device is None:
                    cap.device = p.device
                cap.any_float64 = cap.any_float64 or p.dtype == torch.float64
                if p.requires_grad:
                    own[k] = p
                    if id(p) not in names:
                        names[id(p)] = f"{prefix}.{k}" if prefix else k
            if not own:
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    kind_of(m)
                continue
            kind = kind_of(m)
            handles.append(m.register_forward_hook(
                lambda m, a, kw, o, kind=kind, own=own: hook(m, a, kw, o, kind, own), with_kwargs=True))
        yield cap
    finally:
        for h in handles:
            h.remove()


def _as_args(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _batch_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.ndim:
            return int(a.shape[0])
    raise ValueError("cukit.per_sample_grads: inputs must hold a tensor with a batch dimension (dimension 0)")


def _check_reduction(loss_reduction: str, fn: str) -> None:
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"{fn}: loss_reduction must be 'sum' or 'mean'; got {loss_reduction!r}")


Consume = Callable[[Call, Any], bool]


def run(model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, loss_reduction: str, fn: str,
        consumer: Callable[[Capture], Consume] | None = None) -> tuple[torch.Tensor, Capture, int, float]:
    """Forward with capture, the loss, one backward pass to the recorded edges. Returns (loss,
    capture with each call's output grad, batch size, the per-sample scale: B for a mean loss).

    consumer: when given, ``consume = consumer(capture)`` is made after the forward (kept as
    ``capture.consumer``), and each call's output grad G is handed to ``consume(call, G)`` as soon
    as the backward has it (see :func:`_streamed`), kept on the call only where it returns False:
    no more than a few layers' G are alive at once, as in a plain backward pass."""
    _check_reduction(loss_reduction, fn)
    args = _as_args(inputs)
    B = _batch_size(args)
    with capture(model) as cap:
        outputs = model(*args)
    loss = loss_fn(outputs, targets)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ValueError(f"{fn}: loss_fn must return a scalar tensor (a sum or mean over samples); got "
                         f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
    _attach_orphans(model, cap, loss, fn)
    consume = None
    if consumer is not None:
        consume = cap.consumer = consumer(cap)
    if cap.calls:
        wanted, handles = (cap.calls, []) if consume is None else _streamed(cap, consume)
        try:
            grads = iter(torch.autograd.grad(loss, [e for c in wanted for e in c.edges], allow_unused=True))
        finally:
            for h in handles:
                h.remove()
        for c in wanted:
            gs = tuple(next(grads) for _ in c.edges)
            if any(g is not None for g in gs):
                g = gs if isinstance(c.kind, FallbackKind) else gs[0]
                if consume is None:
                    c.grad = g
                else:
                    _hand_over(c, g, consume)
    return loss.detach(), cap, B, float(B) if loss_reduction == "mean" else 1.0


def _hand_over(c: Call, g: Any, consume: Consume) -> None:
    """G to `consume`; kept on the call where it declines, else the call drops what it kept: its
    saved input (a layer's activations, which autograd frees once the layer below no longer needs
    them) and what its kind derived."""
    if consume(c, g):
        c.saved = None
        c.cache.clear()
    else:
        c.grad = g


def _streamed(cap: Capture, consume: Consume) -> tuple[list[Call], list[Any]]:
    """The calls whose G the backward must return, and hooks that hand every other call's G to
    `consume` while the backward runs.

    A call's G reaches a hook on its output's autograd node (run after that node: G is then
    ``borrowed``) when the node is sure to run: some path from the call's inputs leads to another
    call's output node, which itself runs or is returned. Each returned edge is a source of the
    layer graph (the first layer, a branch fed by the data alone, a fallback call); everything
    between them runs anyway, and computes no parameter gradients: autograd evaluates only what
    leads to the requested edges."""
    targets = {id(e.node) for c in cap.calls for e in c.edges}  # the edges keep these nodes alive
    memo: dict[int, tuple[Any, bool]] = {}
    wanted: list[Call] = []
    handles: list[Any] = []
    for c in cap.calls:
        if isinstance(c.kind, FallbackKind) or len(c.edges) != 1 or not _reaches(c.roots, targets, memo):
            wanted.append(c)
            continue
        edge = c.edges[0]

        def hook(_gin: Any, gout: tuple, c: Call = c, nr: int = edge.output_nr) -> None:
            g = gout[nr]
            if g is not None:
                c.borrowed = True  # also when kept: another call's G may be a view of it
                _hand_over(c, g, consume)

        handles.append(edge.node.register_hook(hook))
    return wanted, handles


def _reaches(roots: Sequence[Any], targets: set[int], memo: dict[int, tuple[Any, bool]]) -> bool:
    """Whether a path from any of the autograd nodes `roots` leads to a node in `targets` (ids of
    node objects the caller keeps alive). Depth-first, each node's answer remembered across the
    calls of one backward (the walks of successive layers stop at the previous layer's output
    node). The memo keeps every node it answers for: torch may hand out a new wrapper object per
    visit and free the last, whose id a different node's wrapper could then reuse."""
    for root in roots:
        k = id(root)
        if k in targets or memo.get(k, (None, False))[1]:
            return True
        if k in memo:
            continue
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, nexts = stack[-1]
            for nxt, _ in nexts:
                if nxt is None:
                    continue
                k = id(nxt)
                if k in targets or memo.get(k, (None, False))[1]:
                    for n, _ in stack:
                        memo[id(n)] = (n, True)
                    return True
                if k not in memo:
                    stack.append((nxt, iter(nxt.next_functions)))
                    break
            else:  # every successor answered no
                memo[id(node)] = (node, False)
                stack.pop()
    return False


def _attach_orphans(model: nn.Module, cap: Capture, loss: torch.Tensor, fn: str) -> None:
    """Parameters whose own module recorded no call (torch.nn.MultiheadAttention reads
    out_proj.weight without calling out_proj) join the torch.func fallback of the nearest
    recorded ancestor. One that no such ancestor covers but that the loss depends on (used
    functionally by a module without parameters of its own) is a ValueError: its per-sample
    gradient would be silently missed. Unused parameters are fine (their grads are zeros)."""
    covered = {id(p) for c in cap.calls for p in c.params.values()}
    orphans = {pid: n for pid, n in cap.names.items() if pid not in covered}
    if not orphans:
        return
    for c in cap.calls:
        if isinstance(c.kind, FallbackKind):
            extra = {k: p for k, p in c.module.named_parameters() if id(p) in orphans and id(p) not in covered}
            if extra:
                c.params = {**c.params, **extra}
                covered.update(id(p) for p in extra.values())
    left = {pid for pid in orphans if pid not in covered}
    if not left or loss.grad_fn is None:
        return
    # by id, each node kept: torch may hand out a new wrapper object per visit and free the last,
    # whose id a different node's wrapper may then reuse
    seen: dict[int, Any] = {}
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf the loss depends on
        if var is not None and id(var) in left:
            raise ValueError(
                f"{fn}: parameter {orphans[id(var)]!r} is used outside its module's forward by a module "
                "without parameters of its own (functional use or weight tying); its per-sample gradient "
                "cannot be recorded: call its module, or give the using module the parameter"
            )
        todo.extend(nxt for nxt, _ in node.next_functions)


def _param_calls(cap: Capture) -> dict[int, list[tuple[Call, str]]]:
    """Each trainable parameter's (call, local name) pairs, tied parameters gathered."""
    out: dict[int, list[tuple[Call, str]]] = {}
    for c in cap.calls:
        if c.grad is None:
            continue
        for k, p in c.params.items():
            out.setdefault(id(p), []).append((c, k))
    return out


def _add_grads(res: dict[int, torch.Tensor], c: Call, g: Any) -> None:
    """res[id(param)] += the call's per-sample grads of each of its parameters (tied uses sum)."""
    for k, v in c.kind.grads(c, g).items():
        p = c.params[k]
        v = _rows_as(v, p)
        res[id(p)] = v if id(p) not in res else res[id(p)] + v


def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, *,
                     loss_reduction: str = "sum") -> dict[str, torch.Tensor]:
    """Per-sample gradients: ``{name: d loss_i / d param}`` of shape (B, *param.shape) for every
    trainable parameter, in one forward and one backward pass.

    Args:
        model: a torch.nn.Module; ``model(*inputs)`` (or ``model(inputs)`` for one tensor) runs it.
        loss_fn: ``loss_fn(outputs, targets)`` -> scalar: the sum over samples of per-sample losses,
            or their mean with ``loss_reduction="mean"`` (see the module docstring).
        inputs: a tensor or a tuple of them, samples along dimension 0.
        targets: passed to loss_fn as is.
        loss_reduction: "sum" or "mean".

    Returns: a dict name -> (B, *param.shape) tensor in the parameter's dtype (zeros for a
    parameter that the loss does not reach). Parameters' ``.grad`` are untouched.

    Raises: ValueError for a model with a training-mode BatchNorm, a loss that is not a scalar, a
    bad loss_reduction.

    See also: ``torch.func.vmap(torch.func.grad(...))``, Opacus' ``GradSampleModule``.
    """
    res: dict[int, torch.Tensor] = {}

    def consume(c: Call, g: Any) -> bool:
        _add_grads(res, c, g)
        return True

    _, _, B, scale = run(model, loss_fn, inputs, targets, loss_reduction, "cukit.per_sample_grads",
                         lambda _cap: consume)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        v = res.get(id(p))
        if v is None:
            v = p.new_zeros((B, *p.shape))
        out[name] = v.to(p.dtype) if scale == 1.0 else (v * scale).to(p.dtype)
    return out


class NormStream:
    """The norms' consumer of :func:`run`: each call's squared per-sample norms formed as soon as
    its G arrives (``per``: id(param) -> (B,); ``dense``: accumulation dtype -> one (B,) running sum
    over the Linear layers with 2-D inputs, one :func:`cukit.ops.per_sample.dense_sq_norms` launch
    per layer adding into it), G then dropped.
    A call with a parameter that another call also uses keeps its G for :func:`sq_norms_of`: the
    norm of a sum is not the sum of norms."""

    def __init__(self, calls: list[Call], per_parameter: bool) -> None:
        # the calls, not the capture that holds this consumer: no reference cycle keeping a step's
        # activations alive until the garbage collector runs
        self.calls, self.per_parameter = calls, per_parameter
        self.multi: set[int] | None = None
        self.per: dict[int, torch.Tensor] = {}
        self.dense: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, c: Call, g: Any) -> bool:
        if self.multi is None:  # every call is recorded by the time the backward runs
            seen: set[int] = set()
            self.multi = set()
            for cc in self.calls:
                for p in cc.params.values():
                    (self.multi if id(p) in seen else seen).add(id(p))
        single = {k for k, p in c.params.items() if id(p) not in self.multi}
        if len(single) < len(c.params):
            return False
        if not self.per_parameter and _is_dense(c, single):
            a, g2 = c.kind._ag(c, g)  # type: ignore[attr-defined]
            acc = torch.float64 if a.dtype == torch.float64 else torch.float32
            self.dense[acc] = ops.dense_sq_norms([(a, g2, "bias" in single)], out=self.dense.get(acc))
        else:
            for k, v in c.kind.sq_norms(c, g).items():
                self.per[id(c.params[k])] = v
        return True


def sq_norms_of(cap: Capture, B: int, device: Any, dtype: Any, per_parameter: bool = False,
                finish_scale: float | None = None, streamed: NormStream | None = None) -> Any:
    """Squared per-sample gradient norms summed over all parameters (B,) (ghost norms wherever a
    parameter has one use; a parameter used by several calls or modules is materialised, since
    the norm of a sum is not the sum of norms), from the calls' kept G and what `streamed` formed
    during the backward. per_parameter: a dict id(param) -> (B,) instead. finish_scale: the norms
    of the loss scaled by it, ``sqrt(finish_scale^2 * sum)``, instead."""
    per: dict[int, torch.Tensor] = {}
    multi: set[int] = {pid for pid, uses in _param_calls(cap).items() if len(uses) > 1}
    shared: dict[int, torch.Tensor] = {}
    dense: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, bool]]] = {}
    for c in cap.calls:
        if c.grad is None:
            continue
        single = {k for k, p in c.params.items() if id(p) not in multi}
        if not per_parameter and _is_dense(c, single):
            a, g = c.kind._ag(c, c.grad)  # type: ignore[attr-defined]
            dense.setdefault(g.dtype, []).append((a, g, "bias" in single))
            continue
        if single:
            for k, s in c.kind.sq_norms(c, c.grad).items():
                if k in single:
                    per[id(c.params[k])] = s.to(dtype)
        if len(single) < len(c.params):
            for k, v in c.kind.grads(c, c.grad).items():
                if k not in single:
                    p = c.params[k]
                    v = _rows_as(v, p)
                    shared[id(p)] = v if id(p) not in shared else shared[id(p)] + v
    for pid, v in shared.items():
        per[pid] = ops.row_sq_norms(v).to(dtype)
    done: list[torch.Tensor] = []
    if streamed is not None:
        per.update((pid, v.to(dtype)) for pid, v in streamed.per.items())
        done = [v.to(dtype) for v in streamed.dense.values()]
    if per_parameter:
        return per
    if len(dense) == 1 and not per and not done:  # every layer in one launch (per four layers), the norms included
        sq = ops.dense_sq_norms(next(iter(dense.values())), finish_scale=finish_scale)
        return sq if sq.dtype == dtype else sq.to(dtype)
    parts = list(per.values()) + done + [ops.dense_sq_norms(layers).to(dtype) for layers in dense.values()]
    # one stacked sum, not a launch per parameter: the call is host-bound at small batches
    sq = torch.zeros(B, device=device, dtype=dtype) if not parts else parts[0] if len(parts) == 1 else (
        torch.stack(parts).sum(0))
    if finish_scale is None:
        return sq
    return (sq if finish_scale == 1.0 else sq * (finish_scale * finish_scale)).sqrt()


def _is_dense(c: Call, single: set[str]) -> bool:
    """A Linear call whose ghost norm is ||a_i||^2 ||g_i||^2 (2-D input) with its weight (and bias)
    used by this call alone: :func:`cukit.ops.per_sample.dense_sq_norms` takes it."""
    return (isinstance(c.kind, LinearKind) and c.saved.ndim == 2 and "weight" in single
            and single == set(c.params) and set(c.params) <= {"weight", "bias"})


def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, *,
                          loss_reduction: str = "sum", per_parameter: bool = False) -> Any:
    """Per-sample gradient norms ``||d loss_i / d theta||_2`` over all trainable parameters, (B,),
    without materialising per-sample gradients where a ghost norm exists (Linear, Conv, Embedding:
    ``||a||^2 ||g||^2`` or Gram matrices; the small norm-weight and bias grads are formed).

    Arguments as :func:`per_sample_grads`. per_parameter: a dict name -> (B,) norms instead.
    Returns float32 (float64 for a float64 model). One forward and one backward pass; on CUDA the
    norms of every Linear layer with 2-D inputs come from one launch (per four layers).

    See also: Opacus' ghost clipping, Li et al. 2022 ("Large language models can be strong
    differentially private learners"), Bu et al. 2023 (Book-Keeping).
    """
    _, cap, B, scale = run(model, loss_fn, inputs, targets, loss_reduction, "cukit.per_sample_grad_norms",
                           lambda cap: NormStream(cap.calls, per_parameter))
    streamed = cap.consumer
    dtype = _norm_dtype(cap)
    device = _device_of(cap, inputs)
    if per_parameter:
        per = sq_norms_of(cap, B, device, dtype, per_parameter=True, streamed=streamed)
        return {n: (per[pid] * scale * scale).sqrt() if pid in per else torch.zeros(B, device=device, dtype=dtype)
                for pid, n in cap.names.items()}
    return sq_norms_of(cap, B, device, dtype, finish_scale=scale, streamed=streamed)


def _norm_dtype(cap: Capture) -> torch.dtype:
    return torch.float64 if cap.any_float64 else torch.float32


def _device_of(cap: Capture, inputs: Any) -> torch.device:
    return cap.device if cap.device is not None else _as_args(inputs)[0].device


def named_trainable(model: nn.Module) -> Sequence[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
