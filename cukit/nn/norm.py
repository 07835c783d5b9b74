"""``cukit.nn.RMSNorm`` and ``cukit.nn.LayerNorm``, and the ``cukit.nn.patch`` rules "rms_norm"
and "layer_norm" that swap them into a model (the module's class is swapped in place: parameters,
buffers, hooks and ``state_dict`` keys are unchanged)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cukit.nn import recompute
from cukit.nn._patch import Change, PatchContext, _instance_forward, _type_name, register_rule
from cukit.nn.recompute import RECORDERS, record
from cukit.ops.norm import check_cast, check_number
from cukit.torch.norm import layer_norm as cukit_layer_norm
from cukit.torch.norm import rms_norm as cukit_rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x̂ · (offset + weight)``, ``x̂ = x / sqrt(mean(x²) + eps)`` over the last dimension,
    one kernel on CUDA (the torch reference on CPU); see ``cukit.rms_norm`` for the maths and the
    two rounding conventions.

    Args:
        hidden_size: size of x's last dimension (H).
        eps: added to mean(x²); None: float32's machine epsilon (float64's for float64 x), as
            torch.nn.RMSNorm.
        offset: keyword only; the scale is ``offset + weight`` (Gemma: 1.0).
        cast: keyword only; "llama" (LlamaRMSNorm: x̂ rounded to x's dtype, then the weight
            product in the promoted dtype) or "gemma" (GemmaRMSNorm, torch.nn.RMSNorm: the product
            in float32, rounded once to x's dtype).
        device, dtype: of the weight, a Parameter of shape (hidden_size,) initialised so that
            ``offset + weight`` is 1 (ones for offset 0, zeros for Gemma's offset 1).

    Shapes: x (..., hidden_size) -> y (..., hidden_size), float16/bfloat16/float32/float64.

    See also: ``torch.nn.RMSNorm``, transformers' ``LlamaRMSNorm`` and ``GemmaRMSNorm``,
    ``cukit.nn.patch`` (swaps those into a model).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float | None = 1e-6,
        *,
        offset: float = 0.0,
        cast: str = "llama",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_cast("cukit.nn.RMSNorm", cast)
        if eps is not None:
            check_number("cukit.nn.RMSNorm", "eps", eps, nonneg=True)
        offset = check_number("cukit.nn.RMSNorm", "offset", offset)
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 0:
            raise ValueError(f"cukit.nn.RMSNorm: hidden_size must be an int >= 0; got {hidden_size!r}")
        self.hidden_size, self.eps, self.offset, self.cast = hidden_size, eps, offset, cast
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, eps, offset, cast = self.weight, self.eps, self.offset, self.cast
        y = cukit_rms_norm(x, w, eps, offset=offset, cast=cast)
        record(y, lambda: cukit_rms_norm(x, w, eps, offset=offset, cast=cast), "cukit.nn.RMSNorm", x, w)
        return y

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, cast={self.cast!r}"


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (a subclass: same arguments, parameters, initialisation and
    ``state_dict``) whose forward runs ``cukit.layer_norm`` when it normalises one dimension (the
    last): one kernel on CUDA, statistics in float32. A longer ``normalized_shape`` runs torch's
    layer_norm, and so does an x under ``cukit.nn.recompute.MIN_BYTES`` (16 MiB): torch's
    layer_norm is one fused kernel behind a C++ autograd node, and at such sizes a model's step is
    bound by its host, where cukit's Python autograd node costs more than its faster kernel saves
    (GPT-2 small at 8 x 512 tokens: 6 MiB per norm; see benchmarks/NOTES.md). Set that constant to
    0 for cukit's kernel at every size.

    Args: as ``torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
    device=None, dtype=None)``.

    Shapes: x (..., H) -> y (..., H), x's dtype (float32 under CUDA autocast, as torch's).

    See also: ``torch.nn.LayerNorm``, ``cukit.layer_norm``, ``cukit.nn.patch``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1 or x.numel() * x.element_size() < recompute.MIN_BYTES:
            return super().forward(x)
        shape, w, b, eps = self.normalized_shape, self.weight, self.bias, self.eps
        y = cukit_layer_norm(x, shape, w, b, eps)
        record(y, lambda: cukit_layer_norm(x, shape, w, b, eps), "cukit.nn.LayerNorm", x, w, b)
        return y


RECORDERS.extend((RMSNorm, LayerNorm))  # their outputs can be recomputed (cukit.nn.recompute)


# ---------------------------------------------------------------------------------------------
# Patch rules
# ---------------------------------------------------------------------------------------------


# The forwards of the RMSNorm modules the rule knows, as transformers writes them (over a hundred
# of its models copy Llama's). A module qualifies by its code (the bytecode, constants and names
# its methods read equal these), not by its class name alone: OLMo-2's forward reads the same names
# as Llama's but rounds after the weight product.
class _LlamaRMSNorm(nn.Module):  # transformers.models.llama.modeling_llama.LlamaRMSNorm
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _Olmo2RMSNorm(nn.Module):  # transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class _GemmaRMSNorm(nn.Module):  # transformers.models.gemma.modeling_gemma.GemmaRMSNorm (Gemma 2, 3)
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


@dataclasses.dataclass(frozen=True)
class _Style:
    """A known RMSNorm: its code (`like`'s methods), where its eps lives, and cukit's arguments."""

    label: str
    like: type[nn.Module]
    methods: tuple[str, ...]
    eps_attr: str
    offset: float
    cast: str


_STYLES = (
    _Style("Llama", _LlamaRMSNorm, ("forward",), "variance_epsilon", 0.0, "llama"),
    _Style("Gemma", _GemmaRMSNorm, ("_norm", "forward"), "eps", 1.0, "gemma"),
    _Style("OLMo-2", _Olmo2RMSNorm, ("forward",), "variance_epsilon", 0.0, "gemma"),
)


def _same_code(a: Callable[..., Any] | None, b: Callable[..., Any]) -> bool:
    ca, cb = getattr(a, "__code__", None), b.__code__
    return ca is not None and (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def _style_of(m: nn.Module) -> _Style | None:
    t = type(m)
    for s in _STYLES:
        if all(_same_code(getattr(t, k, None), getattr(s.like, k)) for k in s.methods):
            return s
    return None


@register_rule("rms_norm")
def _swap_rms_norm(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """transformers' RMSNorm modules (Llama-, Gemma- and OLMo-2-style code) and torch.nn.RMSNorm
    over the last dim -> cukit.nn.RMSNorm (the same object, its class swapped)."""
    t = type(m)
    if isinstance(m, RMSNorm):
        return []
    if isinstance(m, nn.RMSNorm):
        if t is not nn.RMSNorm:
            return [Change(name, f"{t.__name__} subclasses torch.nn.RMSNorm; its forward may differ", skipped=True)]
        if len(m.normalized_shape) != 1:
            return [Change(name, f"torch.nn.RMSNorm over the last {len(m.normalized_shape)} dimensions "
                                 "(cukit normalises the last one only)", skipped=True)]
        if why := _instance_forward(m):
            return [Change(name, why, skipped=True)]
        m.__class__ = RMSNorm
        m.hidden_size, m.offset, m.cast = m.normalized_shape[0], 0.0, "gemma"
        return [Change(name, "torch.nn.RMSNorm -> cukit.nn.RMSNorm (cast='gemma')")]
    if not t.__name__.endswith("RMSNorm"):
        return []
    style = _style_of(m)
    if style is None:
        known = ", ".join(s.label for s in _STYLES)
        return [Change(name, f"{t.__name__}'s code is none of the RMSNorms cukit knows ({known})", skipped=True)]
    w, eps = getattr(m, "weight", None), getattr(m, style.eps_attr, None)
    if not (isinstance(w, nn.Parameter) and w.ndim == 1) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        why = f"{t.__name__}: {style.label}'s code without its attributes (a 1-D weight Parameter, float {style.eps_attr})"
        return [Change(name, why, skipped=True)]
    if why := _instance_forward(m):
        return [Change(name, why, skipped=True)]
    m.__class__ = RMSNorm
    m.hidden_size, m.eps, m.offset, m.cast = w.shape[0], float(eps), style.offset, style.cast
    what = f"{t.__name__} -> cukit.nn.RMSNorm (cast={style.cast!r}" + (f", offset={style.offset:g})" if style.offset else ")")
    return [Change(name, what)]


@register_rule("layer_norm")
def _swap_layer_norm(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """torch.nn.LayerNorm over the last dim -> cukit.nn.LayerNorm (a subclass; class swapped)."""
    t = type(m)
    if not isinstance(m, nn.LayerNorm) or isinstance(m, LayerNorm):
        return []
    if t is not nn.LayerNorm:
        return [Change(name, f"{t.__name__} subclasses torch.nn.LayerNorm; its forward may differ", skipped=True)]
    if len(m.normalized_shape) != 1:
        return [Change(name, f"torch.nn.LayerNorm over the last {len(m.normalized_shape)} dimensions "
                             "(cukit normalises the last one only)", skipped=True)]
    if why := _instance_forward(m):
        return [Change(name, why, skipped=True)]
    m.__class__ = LayerNorm
    return [Change(name, f"{_type_name(t)} -> cukit.nn.LayerNorm")]
