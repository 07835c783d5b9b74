"""``cukit.nn.Linear``: ``torch.nn.Linear`` with an optional activation, fused into one GEMM kernel."""

from __future__ import annotations

import torch
from torch import nn

from cukit.ops.matmul import LINEAR_ACTIVATIONS
from cukit.ops.matmul import linear as cukit_linear

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``y = act(x @ weight.T + bias)``: a drop-in for ``torch.nn.Linear`` (a subclass of it), with
    the bias add and the activation fused into the GEMM's epilogue on CUDA (one kernel).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``. The parameters are
            the same (``weight`` (out_features, in_features), ``bias`` (out_features,)), initialised
            by ``torch.nn.Linear.reset_parameters`` (kaiming_uniform with a=sqrt(5), bias uniform in
            ±1/sqrt(in_features)), with the same ``state_dict`` keys: ``load_state_dict`` works in
            both directions.
        activation: None (a plain linear layer), "relu", "gelu", "gelu_tanh" or "silu".

    Shapes: x (..., in_features) -> y (..., out_features); float16, bfloat16, float32, float64.
    CPU tensors run the reference (fp32 maths for 16-bit dtypes).

    See also: ``torch.nn.Linear``, ``torch.nn.functional.linear``, ``cukit.linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if activation not in LINEAR_ACTIVATIONS:
            names = ", ".join(repr(a) for a in LINEAR_ACTIVATIONS)
            raise ValueError(f"activation must be one of {names}; got {activation!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cukit_linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"
