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

from cukit.ops import bias_act as _bias_act
from cukit.ops import matmul as _matmul

__all__ = ["batch_matmul", "bias_act", "bias_act_backward", "linear", "matmul"]

_TORCH: Any = None  # cukit.torch's op modules, once loaded


def _torch_layer() -> Any:
    global _TORCH
    if _TORCH is None:
        import cukit.torch as layer  # registers torch.ops.cukit.*

        _TORCH = layer
    return _TORCH


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def matmul(a: Any, b: Any, *, out: Any = None, precision: str | None = None) -> Any:
    if _is_tensor(a) and _is_tensor(b):
        return _torch_layer().matmul.matmul(a, b, out=out, precision=precision)
    return _matmul.matmul(a, b, out=out, precision=precision)


def batch_matmul(a: Any, b: Any, *, precision: str | None = None) -> Any:
    _matmul.validate_batch(a, b)
    return matmul(a, b, precision=precision)


def linear(x: Any, weight: Any, bias: Any = None, activation: str | None = None, *, precision: str | None = None) -> Any:
    if _is_tensor(x) and _is_tensor(weight) and (bias is None or _is_tensor(bias)):
        return _torch_layer().matmul.linear(x, weight, bias, activation, precision=precision)
    return _matmul.linear(x, weight, bias, activation, precision=precision)


def bias_act(x: Any, bias: Any, activation: str = "relu") -> Any:
    if _is_tensor(x) and _is_tensor(bias):
        return _torch_layer().bias_act.bias_act(x, bias, activation)
    return _bias_act.bias_act(x, bias, activation)


def bias_act_backward(grad: Any, x: Any, bias: Any, activation: str = "relu") -> tuple[Any, Any]:
    if _is_tensor(x) and _is_tensor(bias) and _is_tensor(grad):
        return _torch_layer().bias_act.bias_act_backward(grad, x, bias, activation)
    return _bias_act.bias_act_backward(grad, x, bias, activation)


for _f, _src in (
    (matmul, _matmul.matmul),
    (batch_matmul, _matmul.batch_matmul),
    (linear, _matmul.linear),
    (bias_act, _bias_act.bias_act),
    (bias_act_backward, _bias_act.bias_act_backward),
):
    _f.__doc__ = _src.__doc__
del _f, _src
