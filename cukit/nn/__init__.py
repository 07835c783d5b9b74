"""``torch.nn`` modules backed by cukit kernels, and ``patch(model)`` to swap them into a model."""

from cukit.nn import rope as _rope  # noqa: F401  (registers the patch rule "rope")
from cukit.nn._patch import PatchReport, patch, register_rule
from cukit.nn.bias_act import BiasAct
from cukit.nn.checkpointing import checkpoint, checkpoint_context_fn, checkpoint_modules, checkpoint_policy
from cukit.nn.chunking import Chunked, forward_with_chunking
from cukit.nn.conv import Conv2d  # (registers the patch rule "conv2d")
from cukit.nn.glu import GatedActivation  # (registers the patch rule "gated_mlp")
from cukit.nn.linear import Conv1D, Linear
from cukit.nn.loss import LinearCrossEntropy  # (registers the patch rule "lm_head_loss")
from cukit.nn.norm import LayerNorm, RMSNorm  # (registers the patch rules "rms_norm", "layer_norm")
from cukit.nn.recompute import recomputing  # (registers the patch rule "recompute", run last)

__all__ = [
    "BiasAct",
    "Chunked",
    "Conv1D",
    "Conv2d",
    "GatedActivation",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropy",
    "PatchReport",
    "RMSNorm",
    "checkpoint",
    "checkpoint_context_fn",
    "checkpoint_modules",
    "checkpoint_policy",
    "forward_with_chunking",
    "patch",
    "recomputing",
    "register_rule",
]
