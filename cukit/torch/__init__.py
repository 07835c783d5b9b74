"""torch integration: cukit's ops registered with ``torch.library`` (autograd, ``torch.compile``,
CUDA graphs). Importing this package imports torch and registers every op under
``torch.ops.cukit``. The modules are named after the ops (``cukit.torch.bias_act``); the functions
users call live at the top level (``cukit.bias_act``). Every op is registered through the one
helper, ``cukit/torch/_register.py``, which also owns the compile policy
(:func:`set_compile_policy`: how cukit ops appear in ``torch.compile``'d code)."""

from cukit.torch import (
    bias_act,  # noqa: F401  (registers torch.ops.cukit.bias_act*)
    conv2d,  # noqa: F401  (registers torch.ops.cukit.conv2d*)
    glu,  # noqa: F401  (registers torch.ops.cukit.glu*)
    linear_cross_entropy,  # noqa: F401  (registers torch.ops.cukit.linear_cross_entropy*)
    matmul,  # noqa: F401  (registers torch.ops.cukit.matmul and cukit.linear)
    norm,  # noqa: F401  (registers torch.ops.cukit.rms_norm* and cukit.layer_norm*)
    rope,  # noqa: F401  (registers torch.ops.cukit.rotary_embedding*)
)
from cukit.torch._register import get_compile_policy, set_compile_policy

__all__ = ["get_compile_policy", "set_compile_policy"]
