"""cukit.optim: fused multi-tensor optimizers, drop-in for ``torch.optim``.

Every step is one launch over every tensor (whatever their number: the tensor tables live in
device memory, see raw_kernels/include/cukit/multi_tensor.cuh), with GradScaler unscaling,
global-norm clipping, master weights and 16-bit state in the same pass and no host sync.
Installed from the top-level ``optim/`` directory as ``cukit.optim`` (setuptools package-dir).
Without a GPU the same classes run a plain-torch reference with the kernels' maths.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cukit.optim import functional
    from cukit.optim._base import MultiTensorOptimizer
    from cukit.optim.adagrad import Adagrad
    from cukit.optim.adam import Adam, AdamW
    from cukit.optim.lamb import LAMB
    from cukit.optim.lion import Lion
    from cukit.optim.lowbit import Adam8bit, AdamW4bit, AdamW8bit, Lion8bit, SGD8bit
    from cukit.optim.sgd import SGD
    from cukit.optim.shampoo import Shampoo
    from cukit.optim.utils import clip_grad_norm_, multi_tensor_l2norm, nonfinite_flag

# Loaded on first use, so that `cukit check-kernels` (which imports cukit.optim._kernels) and a
# torch-less install can import the package; the optimizers themselves need torch.
_EXPORTS: dict[str, str] = {
    "functional": "cukit.optim.functional",
    "MultiTensorOptimizer": "cukit.optim._base",
    "Adagrad": "cukit.optim.adagrad",
    "Adam": "cukit.optim.adam",
    "AdamW": "cukit.optim.adam",
    "LAMB": "cukit.optim.lamb",
    "Lion": "cukit.optim.lion",
    "Adam8bit": "cukit.optim.lowbit",
    "AdamW8bit": "cukit.optim.lowbit",
    "AdamW4bit": "cukit.optim.lowbit",
    "Lion8bit": "cukit.optim.lowbit",
    "SGD8bit": "cukit.optim.lowbit",
    "lowbit": "cukit.optim.lowbit",
    "SGD": "cukit.optim.sgd",
    "Shampoo": "cukit.optim.shampoo",
    "clip_grad_norm_": "cukit.optim.utils",
    "multi_tensor_l2norm": "cukit.optim.utils",
    "nonfinite_flag": "cukit.optim.utils",
}


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'cukit.optim' has no attribute {name!r}")
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name == "torch":
            raise ImportError("cukit.optim needs torch: pip install 'cukit[torch]'") from None
        raise
    value = module if name in ("functional", "lowbit") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

__all__ = [
    "LAMB",
    "SGD",
    "Adagrad",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "Lion",
    "Lion8bit",
    "MultiTensorOptimizer",
    "SGD8bit",
    "Shampoo",
    "clip_grad_norm_",
    "functional",
    "multi_tensor_l2norm",
    "nonfinite_flag",
]
