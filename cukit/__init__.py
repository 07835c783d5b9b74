"""cukit: hand-written CUDA kernels for PyTorch and NumPy users, compiled at runtime by CuPy.

Every op takes NumPy, CuPy or torch (CPU or CUDA) arrays and returns the type it was given: GPU
inputs run cukit's kernels, host inputs run the reference implementation.
"""

from __future__ import annotations

import importlib
from typing import Any

from cukit._api import batch_matmul, bias_act, bias_act_backward, linear, matmul
from cukit._device import device_info, is_available
from cukit._runtime import KernelCompileError
from cukit.interop import asarray, to_torch, use_torch_allocator
from cukit.ops.matmul import chunked_matmul, get_matmul_precision, set_matmul_precision

__version__ = "0.1.0"

__all__ = [
    "KernelCompileError",
    "__version__",
    "asarray",
    "batch_matmul",
    "bias_act",
    "bias_act_backward",
    "chunked_matmul",
    "device_info",
    "get_matmul_precision",
    "is_available",
    "linear",
    "matmul",
    "set_matmul_precision",
    "to_torch",
    "use_torch_allocator",
]

_LAZY = {"nn", "optim", "testing", "torch", "train"}  # these import torch or hypothesis: load on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"cukit.{name}")
    raise AttributeError(f"module 'cukit' has no attribute {name!r}")
