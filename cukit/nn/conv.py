"""``cukit.nn.Conv2d`` (``torch.nn.Conv2d`` with an optional fused activation, run by cukit's
implicit-GEMM kernels) and the ``cukit.nn.patch`` rule "conv2d" that swaps it into a model."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from cukit.nn._patch import (
    Change,
    PatchContext,
    _hooks,
    _instance_forward,
    _type_name,
    activation_of,
    register_rule,
)
from cukit.nn.linear import _check_activation
from cukit.ops.bias_act import _torch_act
from cukit.ops.conv2d import CONV_ACTIVATIONS
from cukit.torch.conv2d import conv2d as cukit_conv2d

__all__ = ["Conv2d"]


class Conv2d(nn.Conv2d):
    """``y = act(conv2d(x, weight) + bias)``: a drop-in for ``torch.nn.Conv2d`` (a subclass of it)
    whose forward is one cukit kernel on CUDA (an implicit GEMM with the bias and the activation in
    its epilogue), forward and backward (see ``cukit.conv2d``).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode, device, dtype: as ``torch.nn.Conv2d``, positions included; the same
            parameters (``weight`` (out, in / groups, kH, kW), ``bias`` (out,)), initialisation and
            ``state_dict`` keys, so checkpoints load either way. ``groups != 1`` or
            ``padding_mode != "zeros"`` run torch's own convolution (then the activation in torch
            ops): cukit's kernels take groups = 1 and zero padding.
        activation: keyword only: None, "relu", "gelu" (erf), "gelu_tanh" or "silu".

    Shapes: x (N, C, H, W) or (C, H, W) -> y (N, out, P, Q), contiguous NCHW; float16, bfloat16,
    float32, float64 (x of the weight's dtype, or any float dtype under autocast). The epilogue
    computes in fp32 (float64 for float64) and rounds once. CPU tensors run the reference with that
    maths.

    See also: ``torch.nn.Conv2d``, ``cukit.conv2d``, ``cukit.nn.patch`` (swaps it into a model).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        activation: str | None = None,
    ) -> None:
        activation = _check_activation(activation, "cukit.nn.Conv2d", CONV_ACTIVATIONS)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups != 1 or self.padding_mode != "zeros":
            y = self._conv_forward(x, self.weight, self.bias)
            return y if self.activation is None else _torch_act(y, self.activation)
        return cukit_conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


# ---------------------------------------------------------------------------------------------
# cukit.nn.patch rule "conv2d"
# ---------------------------------------------------------------------------------------------


def _not_swappable(m: nn.Conv2d) -> str | None:
    if m.groups != 1:
        return f"groups={m.groups}: cukit's kernels take groups=1"
    if m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r}: cukit's kernels pad with zeros"
    return _instance_forward(m)


def _swap(name: str, m: nn.Module) -> Change | None:
    """nn.Conv2d `m` -> cukit.nn.Conv2d in place, or why not; None for a module that is no
    candidate (not exactly torch.nn.Conv2d, or already cukit's)."""
    t = type(m)
    if t is not nn.Conv2d:
        if isinstance(m, nn.Conv2d) and not isinstance(m, Conv2d):
            return Change(name, f"{_type_name(t)} subclasses torch.nn.Conv2d; its forward may differ", skipped=True)
        return None
    if why := _not_swappable(m):
        return Change(name, why, skipped=True)
    m.__class__ = Conv2d
    m.activation = None
    return Change(name, "torch.nn.Conv2d -> cukit.nn.Conv2d")


def _fuse(seq: nn.Sequential, pname: str, conv_key: str, act_key: str, ctx: PatchContext) -> Change | None:
    """Fuse ``seq.<act_key>`` into the cukit Conv2d ``seq.<conv_key>`` (reported under the conv's
    name), or say why not; None when the pair is no candidate."""
    conv, act = seq._modules.get(conv_key), seq._modules.get(act_key)
    if not isinstance(conv, Conv2d) or act is None:
        return None
    fn, why = activation_of(act)
    if fn is None and why is None:
        return None
    where = f"{pname}.{conv_key}" if pname else conv_key
    if fn is None:
        return Change(where, f"{act_key}: {why}", skipped=True)
    reason = (
        (f"already applies {conv.activation!r}" if conv.activation is not None else None)
        or _not_swappable(conv)
        or _hooks(conv, inputs_too=False)
        or _hooks(act, inputs_too=True)
        or _instance_forward(act)
        or (f"shared by {ctx.refs[id(conv)]} parent modules" if ctx.refs[id(conv)] > 1 else None)
    )
    if reason:
        return Change(where, f"{act_key} ({type(act).__name__}) not fused: {reason}", skipped=True)
    conv.activation = fn
    identity = nn.Identity()
    identity.train(act.training)
    seq._modules[act_key] = identity
    return Change(where, f"{act_key} ({type(act).__name__}) fused: activation={fn!r}, {act_key} -> Identity")


@register_rule("conv2d")
def _patch_conv2d(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """torch.nn.Conv2d -> cukit.nn.Conv2d (the same object, its class swapped); inside an
    nn.Sequential, a following ReLU/GELU/SiLU fused into it (while fuse_activations is on)."""
    if isinstance(m, nn.Sequential):
        if type(m).forward is not nn.Sequential.forward or "forward" in vars(m):
            return []  # a subclass with its own forward may not chain its children
        # the children first, so the pairs below see cukit convs (a child that cannot be swapped is
        # reported when the rule visits it)
        out = [_swap(f"{name}.{key}" if name else key, child) for key, child in m._modules.items()
               if type(child) is nn.Conv2d and not _not_swappable(child)]
        if "fuse_activations" in ctx.enabled:
            found = (_fuse(m, name, a, b, ctx) for a, b in itertools.pairwise(list(m._modules)))
            out += [c for c in found if c is not None]
        return out  # type: ignore[return-value]
    c = _swap(name, m)
    return [] if c is None else [c]
