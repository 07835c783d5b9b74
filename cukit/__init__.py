"""cukit: hand-written CUDA kernels for PyTorch and NumPy users, compiled at runtime by CuPy.

Every op takes NumPy, CuPy or torch (CPU or CUDA) arrays and returns the type it was given: GPU
inputs run cukit's kernels, host inputs run the reference implementation. Lists, tuples and
scalars are taken as ``numpy.asarray`` takes them (in the other argument's library and device).
"""

import importlib as _importlib
import typing as _typing

from cukit._api import (
    batch_matmul,
    bias_act,
    bias_act_backward,
    conv2d,
    geglu,
    geglu_backward,
    layer_norm,
    layer_norm_backward,
    linear,
    linear_cross_entropy,
    matmul,
    rms_norm,
    rms_norm_backward,
    rotary_embedding,
    rotary_embedding_backward,
    swiglu,
    swiglu_backward,
)
from cukit._device import device_info, is_available
from cukit._memory import memory_info
from cukit._runtime import KernelCompileError
from cukit._warmup import warmup
from cukit.interop import asarray, to_torch, use_torch_allocator
from cukit.ops.linear_cross_entropy import LinearCrossEntropyOptions
from cukit.ops.matmul import chunked_matmul, get_matmul_precision, set_matmul_precision

__version__ = "0.1.0"

__all__ = [
    "KernelCompileError",
    "LinearCrossEntropyOptions",
    "__version__",
    "asarray",
    "batch_matmul",
    "bias_act",
    "bias_act_backward",
    "chunked_matmul",
    "conv2d",
    "device_info",
    "geglu",
    "geglu_backward",
    "get_matmul_precision",
    "is_available",
    "layer_norm",
    "layer_norm_backward",
    "linear",
    "linear_cross_entropy",
    "matmul",
    "memory_info",
    "rms_norm",
    "rms_norm_backward",
    "rotary_embedding",
    "rotary_embedding_backward",
    "set_matmul_precision",
    "swiglu",
    "swiglu_backward",
    "to_torch",
    "use_torch_allocator",
    "warmup",
]

_LAZY = {"dp", "linalg", "nn", "optim", "testing", "torch", "train"}  # loaded on first use (most import torch)
_SUBMODULES = {"interop", "ops"}  # imported with the package; public
# functions of lazy modules (they import torch), loaded on first use
_LAZY_FUNCTIONS = {"per_sample_grads": "cukit.per_sample", "per_sample_grad_norms": "cukit.per_sample"}


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return _importlib.import_module(f"cukit.{name}")
    if name in _LAZY_FUNCTIONS:
        return getattr(_importlib.import_module(_LAZY_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'cukit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and submodules (lazy ones included), not the imports behind them."""
    return sorted({*__all__, *_LAZY, *_SUBMODULES, *_LAZY_FUNCTIONS})
