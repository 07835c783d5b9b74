"""cukit.optim: fused multi-tensor optimizers, drop-in for ``torch.optim``.

Every step is one launch over every tensor (whatever their number: the tensor tables live in
device memory, see raw_kernels/include/cukit/multi_tensor.cuh), with GradScaler unscaling,
global-norm clipping, master weights and 16-bit state in the same pass and no host sync.
Installed from the top-level ``optim/`` directory as ``cukit.optim`` (setuptools package-dir).
Without a GPU the same classes run a plain-torch reference with the kernels' maths.
"""

from cukit.optim import functional
from cukit.optim._base import MultiTensorOptimizer
from cukit.optim.adagrad import Adagrad
from cukit.optim.adam import Adam, AdamW
from cukit.optim.lamb import LAMB
from cukit.optim.lion import Lion
from cukit.optim.sgd import SGD
from cukit.optim.utils import clip_grad_norm_, multi_tensor_l2norm, nonfinite_flag

__all__ = [
    "LAMB",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lion",
    "MultiTensorOptimizer",
    "clip_grad_norm_",
    "functional",
    "multi_tensor_l2norm",
    "nonfinite_flag",
]
