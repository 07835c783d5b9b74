"""``cukit.nn.Linear`` (``torch.nn.Linear`` with an optional fused activation) and ``cukit.nn.Conv1D``
(the same layer with the weight stored (in, out), like Hugging Face transformers' GPT-2 ``Conv1D``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cukit.ops.matmul import LINEAR_ACTIVATIONS
from cukit.torch.matmul import linear as cukit_linear

__all__ = ["Conv1D", "Linear"]


def _check_activation(activation: object, owner: str, accepted: Sequence[str | None] = LINEAR_ACTIVATIONS) -> Any:
    """`activation` if it is one of `accepted`; otherwise a ValueError naming `owner` (e.g.
    "cukit.nn.Linear"), the argument, the accepted values and what was given."""
    if activation not in accepted:
        names = ", ".join(repr(a) for a in accepted)
        raise ValueError(f"{owner}: activation must be one of {names}; got {activation!r}")
    return activation


class Linear(nn.Linear):
    """``y = act(x @ weight.T + bias)``: a drop-in for ``torch.nn.Linear`` (a subclass of it), with
    the bias add and the activation fused into the GEMM's epilogue on CUDA (one kernel).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``, positions
            included (``Linear(4, 5, True, "cpu")``). The parameters are the same (``weight``
            (out_features, in_features), ``bias`` (out_features,)), initialised by
            ``torch.nn.Linear.reset_parameters`` (kaiming_uniform with a=sqrt(5), bias uniform in
            ±1/sqrt(in_features)), with the same ``state_dict`` keys: ``load_state_dict`` works in
            both directions.
        activation: keyword only: None (a plain linear layer), "relu", "gelu" (erf), "gelu_tanh"
            or "silu".

    Shapes: x (..., in_features) -> y (..., out_features); float16, bfloat16, float32, float64 (x
    of the weight's dtype). The epilogue computes in fp32 (float64 for float64) and rounds once.
    CPU tensors run the reference with that maths.

    See also: ``torch.nn.Linear``, ``cukit.linear``, ``cukit.nn.patch`` (swaps it into a model).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str | None = None,
    ) -> None:
        activation = _check_activation(activation, "cukit.nn.Linear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cukit_linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


class Conv1D(nn.Module):
    """``y = act(x @ weight + bias)`` with ``weight`` stored (nx, nf) = (in, out): Hugging Face
    transformers' ``Conv1D`` (GPT-2, GPT, ...) run by cukit's fused linear, ``weight.t()`` being
    read in place (no copy).

    Args:
        nf: output features; nx: input features (transformers' argument order).
        bias: learnable bias of shape (nf,) (transformers' Conv1D always has one).
        activation: keyword only: None, "relu", "gelu", "gelu_tanh" or "silu".
        device, dtype: of the parameters. Init as transformers': weight normal(std=0.02), bias 0.

    Shapes: x (..., nx) -> y (..., nf); parameters ``weight`` (nx, nf), ``bias`` (nf,): the
    ``state_dict`` is transformers' Conv1D's, so checkpoints load either way.

    See also: ``transformers.pytorch_utils.Conv1D``, ``cukit.nn.Linear``, ``cukit.nn.patch``.
    """

    def __init__(
        self,
        nf: int,
        nx: int,
        bias: bool = True,
        *,
        activation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        activation = _check_activation(activation, "cukit.nn.Conv1D")
        super().__init__()
        self.nf, self.nx, self.activation = nf, nx, activation
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        bias_p = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype)) if bias else None
        self.register_parameter("bias", bias_p)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cukit_linear(x, self.weight.t(), self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, bias={self.bias is not None}, activation={self.activation!r}"
