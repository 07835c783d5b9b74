"""cukit: hand-written CUDA kernels for PyTorch and NumPy users, compiled at runtime by CuPy.

Every op takes NumPy, CuPy or torch (CPU or CUDA) arrays and returns the type it was given: GPU
inputs run cukit's kernels, host inputs run the reference implementation. Lists, tuples and
scalars are taken as ``numpy.asarray`` takes them (in the other argument's library and device).
"""

import importlib as _importlib
import typing as _typing

from cukit._api import batch_matmul, bias_act, bias_act_backward, linear, matmul
from cukit._device import device_info, is_available
from cukit._runtime import KernelCompileError
from cukit._warmup import warmup
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
    "warmup",
]

_LAZY = {"nn", "optim", "testing", "torch", "train"}  # these import torch or hypothesis: load on first use
_SUBMODULES = {"interop", "ops"}  # imported with the package; public


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        return _importlib.import_module(f"cukit.{name}")
    raise AttributeError(f"module 'cukit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and submodules (lazy ones included), not the imports behind them."""
    return sorted({*__all__, *_LAZY, *_SUBMODULES})
