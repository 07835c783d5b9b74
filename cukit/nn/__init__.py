"""``torch.nn`` modules backed by cukit kernels, and ``patch(model)`` to swap them into a model."""

from cukit.nn._patch import PatchReport, patch, register_rule
from cukit.nn.bias_act import BiasAct
from cukit.nn.linear import Conv1D, Linear

__all__ = ["BiasAct", "Conv1D", "Linear", "PatchReport", "patch", "register_rule"]
