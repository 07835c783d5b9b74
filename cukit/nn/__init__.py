"""``torch.nn`` modules backed by cukit kernels."""

from cukit.nn.bias_act import BiasAct
from cukit.nn.linear import Linear

__all__ = ["BiasAct", "Linear"]
