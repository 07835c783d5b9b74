"""The public functions (``cukit.matmul``, ``cukit.linear``, ``cukit.bias_act``, ...): each sends
torch tensors to the torch layer (``cukit/torch``: autograd, autocast, ``torch.compile``, vmap)
and every other array to the array-level op (``cukit/ops``: NumPy, CuPy). This module sits above
both layers, so neither imports the other's caller: ``cukit/ops`` never imports ``cukit/torch``.

The torch layer is imported on the first torch call (it imports torch and registers
``torch.ops.cukit.*``); a NumPy- or CuPy-only program never loads it. The docstrings are the
array-level ops'.
"""

from __future__ import annotations

from typing import Any

from cukit.interop import NotAnArrayError, _loaded, as_arrays
from cukit.ops import bias_act as _bias_act
from cukit.ops import conv2d as _conv2d
from cukit.ops import glu as _glu
from cukit.ops import linear_cross_entropy as _lce
from cukit.ops import matmul as _matmul
from cukit.ops import norm as _norm
from cukit.ops import rope as _rope

__all__ = ["batch_matmul", "bias_act", "bias_act_backward", "conv2d", "geglu", "geglu_backward", "layer_norm",
           "layer_norm_backward", "linear", "linear_cross_entropy", "matmul", "rms_norm", "rms_norm_backward",
           "rotary_embedding", "rotary_embedding_backward", "swiglu", "swiglu_backward"]

_TORCH: Any = None  # cukit.torch's op modules, once loaded
# Once the torch layer is loaded: torch.Tensor and the layer's op modules, so that a torch call's
# routing is one isinstance per argument (host time per call is part of the product).
_TENSOR: Any = None
_TM: Any = None
_TB: Any = None


def _torch_layer() -> Any:
    global _TORCH, _TENSOR, _TM, _TB
    if _TORCH is None:
        import torch

        import cukit.torch as layer  # registers torch.ops.cukit.*

        _TORCH, _TENSOR, _TM, _TB = layer, torch.Tensor, layer.matmul, layer.bias_act
    return _TORCH


def _is_tensor(x: Any) -> bool:
    torch = _loaded("torch")  # not sys.modules: see cukit.interop._loaded
    return torch is not None and isinstance(x, torch.Tensor)


# Array-likes (lists, scalars, ...): each function first tries its arguments as arrays; the
# array-level op raises NotAnArrayError before doing any work when one is not, and only then are
# they converted (cukit.interop.as_arrays) and the call routed again: a list beside a torch tensor
# becomes a tensor and takes the torch layer (autograd, torch.compile), so the arrays' path pays
# nothing for the conversion.


def matmul(a: Any, b: Any, *, out: Any = None, precision: str | None = None) -> Any:
    t = _TENSOR
    if t is not None and isinstance(a, t) and isinstance(b, t):
        return _TM.matmul(a, b, out=out, precision=precision)
    if _is_tensor(a) and _is_tensor(b):
        return _torch_layer().matmul.matmul(a, b, out=out, precision=precision)
    try:
        return _matmul._matmul_arrays(a, b, out, precision)
    except NotAnArrayError:
        a, b = as_arrays("cukit.matmul", (("a", a), ("b", b)))
    if _is_tensor(a) and _is_tensor(b):
        return _torch_layer().matmul.matmul(a, b, out=out, precision=precision)
    return _matmul._matmul_arrays(a, b, out, precision)


def batch_matmul(a: Any, b: Any, *, precision: str | None = None) -> Any:
    try:
        _matmul.validate_batch(a, b)
    except NotAnArrayError:
        a, b = as_arrays("cukit.batch_matmul", (("a", a), ("b", b)))
        _matmul.validate_batch(a, b)
    return matmul(a, b, precision=precision)


def linear(x: Any, weight: Any, bias: Any = None, activation: str | None = None, *, precision: str | None = None) -> Any:
    t = _TENSOR
    if t is not None and isinstance(x, t) and isinstance(weight, t) and (bias is None or isinstance(bias, t)):
        return _TM.linear(x, weight, bias, activation, precision=precision)
    if _is_tensor(x) and _is_tensor(weight) and (bias is None or _is_tensor(bias)):
        return _torch_layer().matmul.linear(x, weight, bias, activation, precision=precision)
    try:
        return _matmul._linear_arrays(x, weight, bias, activation, precision)
    except NotAnArrayError:
        x, weight, bias = _matmul.linear_operands("cukit.linear", x, weight, bias)
    if _is_tensor(x) and _is_tensor(weight) and (bias is None or _is_tensor(bias)):
        return _torch_layer().matmul.linear(x, weight, bias, activation, precision=precision)
    return _matmul._linear_arrays(x, weight, bias, activation, precision)


def bias_act(x: Any, bias: Any, activation: str = "relu") -> Any:
    t = _TENSOR
    if t is not None and isinstance(x, t) and isinstance(bias, t):
        return _TB.bias_act(x, bias, activation)
    if _is_tensor(x) and _is_tensor(bias):
        return _torch_layer().bias_act.bias_act(x, bias, activation)
    try:
        return _bias_act._bias_act_arrays(x, bias, activation)
    except NotAnArrayError:
        x, bias, _ = _bias_act.as_operands("cukit.bias_act", x, bias)
    if _is_tensor(x) and _is_tensor(bias):
        return _torch_layer().bias_act.bias_act(x, bias, activation)
    return _bias_act._bias_act_arrays(x, bias, activation)


def bias_act_backward(grad: Any, x: Any, bias: Any, activation: str = "relu") -> tuple[Any, Any]:
    if _is_tensor(x) and _is_tensor(bias) and _is_tensor(grad):
        return _torch_layer().bias_act.bias_act_backward(grad, x, bias, activation)
    try:
        return _bias_act._backward_arrays(grad, x, bias, activation)
    except NotAnArrayError:
        x, bias, grad = _bias_act.as_operands("cukit.bias_act_backward", x, bias, grad)
    if _is_tensor(x) and _is_tensor(bias) and _is_tensor(grad):
        # the torch layer's checks name cukit.bias_act: a converted argument's error names this function
        kind, _, _ = _bias_act.validate(x, bias, activation, "cukit.bias_act_backward")
        _bias_act._check_grad("cukit.bias_act_backward", grad, x, kind)
        return _torch_layer().bias_act.bias_act_backward(grad, x, bias, activation)
    return _bias_act._backward_arrays(grad, x, bias, activation)


def _torch_args(fn: str, named: tuple[tuple[str, Any], ...]) -> list[Any] | None:
    """The arguments of a call that belongs to the torch layer (all torch tensors, or tensors beside
    array-likes, which become tensors), else None (the array-level op takes it)."""
    values = [v for _, v in named]
    if all(_is_tensor(v) for v in values):
        return values
    if any(_is_tensor(v) for v in values):
        values = as_arrays(fn, named)
        if all(_is_tensor(v) for v in values):
            return values
    return None


def swiglu(gate: Any, up: Any) -> Any:
    t = _torch_args("cukit.swiglu", (("gate", gate), ("up", up)))
    return _glu.swiglu(gate, up) if t is None else _torch_layer().glu.swiglu(*t)


def geglu(gate: Any, up: Any, approximate: str = "none") -> Any:
    t = _torch_args("cukit.geglu", (("gate", gate), ("up", up)))
    return _glu.geglu(gate, up, approximate) if t is None else _torch_layer().glu.geglu(*t, approximate)


def swiglu_backward(grad: Any, gate: Any, up: Any) -> tuple[Any, Any]:
    t = _torch_args("cukit.swiglu_backward", (("grad", grad), ("gate", gate), ("up", up)))
    return _glu.swiglu_backward(grad, gate, up) if t is None else _torch_layer().glu.glu_backward(*t, "silu")


def geglu_backward(grad: Any, gate: Any, up: Any, approximate: str = "none") -> tuple[Any, Any]:
    t = _torch_args("cukit.geglu_backward", (("grad", grad), ("gate", gate), ("up", up)))
    if t is None:
        return _glu.geglu_backward(grad, gate, up, approximate)
    return _torch_layer().glu.glu_backward(*t, _glu.gelu_activation(approximate, "cukit.geglu_backward"))


def rotary_embedding(q: Any, k: Any, cos: Any, sin: Any, *, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
    t = _torch_args("cukit.rotary_embedding", (("q", q), ("k", k), ("cos", cos), ("sin", sin)))
    if t is None:
        return _rope.rotary_embedding(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    return _torch_layer().rope.rotary_embedding(*t, unsqueeze_dim=unsqueeze_dim)


def rotary_embedding_backward(
    grad_q: Any, grad_k: Any, cos: Any, sin: Any, *, unsqueeze_dim: int = 1, dtype: Any = None
) -> tuple[Any, Any]:
    fn = "cukit.rotary_embedding_backward"
    t = _torch_args(fn, (("grad_q", grad_q), ("grad_k", grad_k), ("cos", cos), ("sin", sin)))
    if t is None:
        return _rope.rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim=unsqueeze_dim, dtype=dtype)
    if dtype is not None:  # a name or NumPy dtype as torch's
        from cukit.interop import torch_dtype

        dtype = torch_dtype(_rope._dtype_arg(dtype, fn))
    return _torch_layer().rope.rotary_embedding_backward(*t, unsqueeze_dim=unsqueeze_dim, dtype=dtype)


def linear_cross_entropy(
    input: Any,
    linear_weight: Any,
    target: Any,
    *,
    linear_bias: Any = None,
    weight: Any = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: Any = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
) -> Any:
    kw = {"linear_bias": linear_bias, "weight": weight, "reduction": reduction, "ignore_index": ignore_index,
          "label_smoothing": label_smoothing, "options": options, "z_loss": z_loss, "softcap": softcap,
          "return_lse": return_lse}
    if _is_tensor(input) and _is_tensor(linear_weight):
        if not _is_tensor(target):  # class indices given as a list: a tensor like input
            target = as_arrays("cukit.linear_cross_entropy", (("input", input), ("target", target)))[1]
        return _torch_layer().linear_cross_entropy.linear_cross_entropy(input, linear_weight, target, **kw)
    return _lce.linear_cross_entropy(input, linear_weight, target, **kw)


def rms_norm(x: Any, weight: Any = None, eps: float | None = 1e-6, *, offset: float = 0.0, cast: str = "llama") -> Any:
    t = _TENSOR
    if t is not None and isinstance(x, t) and (weight is None or isinstance(weight, t)):
        return _TORCH.norm.rms_norm(x, weight, eps, offset=offset, cast=cast)
    if _is_tensor(x) or _is_tensor(weight):
        x, weight = _norm._operands("cukit.rms_norm", (("x", x), ("weight", weight)))
        if _is_tensor(x) and (weight is None or _is_tensor(weight)):
            return _torch_layer().norm.rms_norm(x, weight, eps, offset=offset, cast=cast)
    return _norm.rms_norm(x, weight, eps, offset=offset, cast=cast)


def rms_norm_backward(grad: Any, x: Any, weight: Any = None, eps: float | None = 1e-6, *, offset: float = 0.0,
                      cast: str = "llama") -> tuple[Any, Any]:
    fn = "cukit.rms_norm_backward"
    if _is_tensor(x) or _is_tensor(grad) or _is_tensor(weight):
        grad, x, weight = _norm._operands(fn, (("grad", grad), ("x", x), ("weight", weight)))
        if _is_tensor(grad) and _is_tensor(x) and (weight is None or _is_tensor(weight)):
            return _torch_layer().norm.rms_norm_grads(grad, x, weight, eps, offset=offset, cast=cast)
    return _norm.rms_norm_backward(grad, x, weight, eps, offset=offset, cast=cast)


def layer_norm(x: Any, normalized_shape: Any = None, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    t = _TENSOR
    if t is not None and isinstance(x, t) and (weight is None or isinstance(weight, t)) and (
        bias is None or isinstance(bias, t)
    ):
        return _TORCH.norm.layer_norm(x, normalized_shape, weight, bias, eps)
    if _is_tensor(x) or _is_tensor(weight) or _is_tensor(bias):
        x, weight, bias = _norm._operands("cukit.layer_norm", (("x", x), ("weight", weight), ("bias", bias)))
        if all(a is None or _is_tensor(a) for a in (x, weight, bias)):
            return _torch_layer().norm.layer_norm(x, normalized_shape, weight, bias, eps)
    return _norm.layer_norm(x, normalized_shape, weight, bias, eps)


def layer_norm_backward(grad: Any, x: Any, normalized_shape: Any = None, weight: Any = None, bias: Any = None,
                        eps: float = 1e-5) -> tuple[Any, Any, Any]:
    fn = "cukit.layer_norm_backward"
    if any(_is_tensor(a) for a in (grad, x, weight, bias)):
        grad, x, weight, bias = _norm._operands(fn, (("grad", grad), ("x", x), ("weight", weight), ("bias", bias)))
        if _is_tensor(grad) and all(a is None or _is_tensor(a) for a in (x, weight, bias)):
            return _torch_layer().norm.layer_norm_grads(grad, x, normalized_shape, weight, bias, eps)
    return _norm.layer_norm_backward(grad, x, normalized_shape, weight, bias, eps)


def conv2d(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
           activation: str | None = None) -> Any:
    t = _TENSOR
    if t is not None and isinstance(x, t) and isinstance(weight, t) and (bias is None or isinstance(bias, t)):
        return _TORCH.conv2d.conv2d(x, weight, bias, stride, padding, dilation, activation)
    if _is_tensor(x) or _is_tensor(weight) or _is_tensor(bias):  # array-likes beside tensors become tensors
        x, weight, bias = _conv2d._operands("cukit.conv2d", x, weight, bias)
        if _is_tensor(x) and _is_tensor(weight) and (bias is None or _is_tensor(bias)):
            return _torch_layer().conv2d.conv2d(x, weight, bias, stride, padding, dilation, activation)
    return _conv2d.conv2d(x, weight, bias, stride, padding, dilation, activation)


for _f, _src in (
    (matmul, _matmul.matmul),
    (batch_matmul, _matmul.batch_matmul),
    (linear, _matmul.linear),
    (linear_cross_entropy, _lce.linear_cross_entropy),
    (bias_act, _bias_act.bias_act),
    (bias_act_backward, _bias_act.bias_act_backward),
    (conv2d, _conv2d.conv2d),
    (rms_norm, _norm.rms_norm),
    (rms_norm_backward, _norm.rms_norm_backward),
    (layer_norm, _norm.layer_norm),
    (layer_norm_backward, _norm.layer_norm_backward),
    (swiglu, _glu.swiglu),
    (geglu, _glu.geglu),
    (swiglu_backward, _glu.swiglu_backward),
    (geglu_backward, _glu.geglu_backward),
    (rotary_embedding, _rope.rotary_embedding),
    (rotary_embedding_backward, _rope.rotary_embedding_backward),
):
    _f.__doc__ = _src.__doc__
del _f, _src
