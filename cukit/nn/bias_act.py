"""``cukit.nn.BiasAct``: a learnable bias followed by an activation, fused into one kernel."""

from __future__ import annotations

import torch
from torch import nn

from cukit.ops.bias_act import activation_id
from cukit.torch.bias_act import bias_act as cukit_bias_act

__all__ = ["BiasAct"]


class BiasAct(nn.Module):
    """``y = act(x + bias)`` with a learnable bias of shape (features,), broadcast over the last
    dimension of x; one fused kernel on CUDA, the torch reference on CPU.

    Args:
        features: size of x's last dimension.
        activation: "relu", "gelu", "gelu_tanh" or "silu".
        device, dtype: of the bias parameter (initialised to zeros, like nn.Linear's bias is
            usually followed by an activation).

    Shapes: x (..., features) -> y (..., features), float16/bfloat16/float32/float64.

    See also: ``torch.nn.functional.gelu(x + bias)``.
    """

    def __init__(
        self,
        features: int,
        activation: str = "relu",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        activation_id(activation)
        if features < 0:
            raise ValueError(f"features must be >= 0; got {features}")
        self.features = features
        self.activation = activation
        self.bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cukit_bias_act(x, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"features={self.features}, activation={self.activation!r}"
