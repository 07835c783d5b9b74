"""The public functions (``cukit.matmul``, ``cukit.linear``, ``cukit.bias_act``, ...): each sends
torch tensors to the torch layer (``cukit/torch``: autograd, autocast, ``torch.compile``, vmap)
and every other array to the array-level op (``cukit/ops``: NumPy, CuPy). This module sits above
both layers, so neither imports the other's caller: ``cukit/ops`` never imports ``cukit/torch``.

The torch layer is imported on the first torch call (it imports torch and registers
``torch.ops.cukit.*``); a NumPy- or CuPy-only program never loads it. The docstrings are the
array-level ops'.
"""

from __future__ import annotations

import sys
from typing import Any

from cukit.interop import NotAnArrayError, as_arrays
from cukit.ops import bias_act as _bias_act
from cukit.ops import matmul as _matmul

__all__ = ["batch_matmul", "bias_act", "bias_act_backward", "linear", "matmul"]

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
    torch = sys.modules.get("torch")
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


for _f, _src in (
    (matmul, _matmul.matmul),
    (batch_matmul, _matmul.batch_matmul),
    (linear, _matmul.linear),
    (bias_act, _bias_act.bias_act),
    (bias_act_backward, _bias_act.bias_act_backward),
):
    _f.__doc__ = _src.__doc__
del _f, _src
