"""``torch.nn`` modules backed by cukit kernels."""

from cukit.nn.bias_act import BiasAct

__all__ = ["BiasAct"]
