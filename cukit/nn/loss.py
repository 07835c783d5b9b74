"""``cukit.nn.LinearCrossEntropy`` (a linear layer and its cross-entropy loss in one module, never
storing the logits) and the ``cukit.nn.patch`` rule "lm_head_loss", which makes a Hugging Face
``*ForCausalLM`` (or GPT-2) model compute its training loss that way."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cukit.nn._patch import (
    Change,
    PatchContext,
    _hooks,
    _instance_forward,
    _reads,
    derived_class,
    register_rule,
)
from cukit.nn.linear import Linear
from cukit.ops.linear_cross_entropy import LinearCrossEntropyOptions, check_spec, resolve_options
from cukit.torch.linear_cross_entropy import linear_cross_entropy

__all__ = ["LinearCrossEntropy", "causal_lm_loss"]


class LinearCrossEntropy(nn.Module):
    """``loss = cross_entropy(input @ linear.weight.T + linear.bias, target)`` through
    ``cukit.linear_cross_entropy``: the tokens x classes logits are never stored (on CUDA they are
    computed in fp32 chunks, the gradients in the forward pass). A drop-in for torch 2.13's
    ``torch.nn.LinearCrossEntropyLoss`` (class-index targets, no ``out_features``), with cukit's
    ``z_loss``, ``softcap`` and ``return_lse``.

    Args:
        in_features, num_classes: the linear layer's sizes (``self.linear``, an ``nn.Linear``
            initialised as torch's).
        bias, device, dtype: of the linear layer.
        reduction, weight (class weights, kept as a buffer), ignore_index, label_smoothing,
        options, z_loss, softcap, return_lse: as ``cukit.linear_cross_entropy``.

    Shapes: input (..., in_features), target input.shape[:-1] (int64/int32) -> the loss (0-d, or
    target's shape for 'none'), float32 (float64 for float64); with return_lse ``(loss, lse)``.

    ``LinearCrossEntropy.from_linear(lm_head, ...)`` wraps an existing linear layer (shared, not
    copied).

    See also: ``torch.nn.LinearCrossEntropyLoss``, ``torch.nn.CrossEntropyLoss``.
    """

    weight: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        reduction: str = "mean",
        weight: torch.Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options: Any = None,
        z_loss: float = 0.0,
        softcap: float | None = None,
        return_lse: bool = False,
        _linear: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        fn = "cukit.nn.LinearCrossEntropy"
        check_spec(reduction, ignore_index, label_smoothing, z_loss, softcap, return_lse, fn)
        resolve_options(options, 1, max(in_features, 1), max(num_classes, 1), fn)  # its type only
        if weight is not None and tuple(weight.shape) != (num_classes,):
            raise ValueError(f"{fn}: weight must have shape ({num_classes},); got {tuple(weight.shape)}")
        self.linear = _linear if _linear is not None else nn.Linear(
            in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.options, self.z_loss, self.softcap, self.return_lse = options, z_loss, softcap, return_lse

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> LinearCrossEntropy:
        """The loss over an existing ``nn.Linear`` (e.g. a language model's ``lm_head``), which
        the module then holds as ``self.linear`` (same parameters)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"cukit.nn.LinearCrossEntropy.from_linear: linear must be a torch.nn.Linear; got "
                            f"{type(linear).__qualname__}")
        return cls(linear.in_features, linear.out_features, _linear=linear, **kwargs)

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def num_classes(self) -> int:
        return self.linear.out_features

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Any:
        return linear_cross_entropy(
            input, self.linear.weight, target, linear_bias=self.linear.bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            options=self.options, z_loss=self.z_loss, softcap=self.softcap, return_lse=self.return_lse,
        )

    def extra_repr(self) -> str:
        parts = [f"reduction={self.reduction!r}"]
        for name, default in (("ignore_index", None), ("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None),
                              ("return_lse", False), ("options", None)):
            if getattr(self, name) != default:
                parts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Hugging Face causal language models
# ---------------------------------------------------------------------------------------------


def causal_lm_loss(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    options: Any = None,
    **unused: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)`` without the logits: position t
    predicts ``labels[..., t + 1]`` (the last position nothing) unless `shift_labels` is given;
    the mean over non-ignored tokens, or with `num_items_in_batch` their sum divided by it (as
    gradient accumulation over micro-batches wants). The loss is float32, like transformers'
    (which upcasts the logits). `options`: ``cukit.linear_cross_entropy``'s (chunking, gradient
    accumulation); None: the defaults with ``logits="input"``, the rounding of the stock model,
    whose lm_head returns its logits in the model's dtype before the loss upcasts them. Extra
    keyword arguments (the model's other kwargs) are ignored, as there."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("cukit.nn.causal_lm_loss: labels or shift_labels must be given")
        labels = F.pad(labels.to(hidden.device), (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    if y.shape[0] != h.shape[0]:
        raise ValueError(
            f"cukit.nn.causal_lm_loss: {h.shape[0]} positions of hidden states but {y.shape[0]} labels "
            f"(hidden {tuple(hidden.shape)}, labels {tuple(shift_labels.shape)})"
        )
    reduction = "mean" if num_items_in_batch is None else "sum"
    if options is None:
        options = _MODEL_ROUNDING
    loss = linear_cross_entropy(h, lm_head.weight, y, linear_bias=lm_head.bias, ignore_index=ignore_index,
                                reduction=reduction, softcap=softcap, options=options)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss  # type: ignore[return-value]


_MODEL_ROUNDING = LinearCrossEntropyOptions(logits="input")


class _Stash(nn.Module):
    """Stands in for lm_head during a labels forward: keeps the hidden states, returns an empty
    placeholder for the logits (whatever the model does to the logits after lm_head runs on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden.new_empty((*hidden.shape[:-1], 0))


# The names a Llama-style *ForCausalLM forward reads (transformers 4.4x-5.x: Llama, Mistral, Qwen2/3,
# Gemma, Phi3, Olmo2, Starcoder2, SmolLM3, GLM4, ...): hidden states -> lm_head -> loss_function.
_CAUSAL_LM_READS = frozenset({
    "CausalLMOutputWithPast", "attentions", "config", "hidden_states", "last_hidden_state", "lm_head",
    "loss_function", "model", "past_key_values", "slice_logits_to_keep", "vocab_size",
})
# (transformers before 5.2x sliced inline: `slice(-logits_to_keep, None) if isinstance(...)`)
_CAUSAL_LM_READS_INLINE_SLICE = (_CAUSAL_LM_READS - {"slice_logits_to_keep"}) | {"int", "isinstance", "slice"}
# GPT2LMHeadModel's: the same steps over `transformer`, with cross-attentions; GPTBigCode's takes the
# hidden states as `transformer_outputs[0]`
_GPT2_READS = (_CAUSAL_LM_READS_INLINE_SLICE - {"model", "CausalLMOutputWithPast"}) | {
    "transformer", "CausalLMOutputWithCrossAttentions", "cross_attentions"}
# Each known forward's reads -> the attribute that holds the model's body
_KNOWN_FORMS = {_CAUSAL_LM_READS: "model", _CAUSAL_LM_READS_INLINE_SLICE: "model", _GPT2_READS: "transformer",
                _GPT2_READS - {"last_hidden_state"}: "transformer"}
# ... and Gemma 2/3's final-logit soft-capping on top (applied here as softcap)
_SOFTCAP_READS = frozenset({"final_logit_softcapping", "tanh", "torch"})
_PATCHED: dict[type, type] = {}


def _patched_class(cls: type, softcap: bool) -> type:
    """A subclass of a *ForCausalLM class (same name and module) whose forward computes a labels
    loss through cukit.linear_cross_entropy (one per class, cached); `softcap`: the forward
    soft-caps the logits by ``config.final_logit_softcapping``."""
    sub = _PATCHED.get(cls)
    if sub is not None:
        return sub
    original = cls.forward
    params = [p for p in inspect.signature(original).parameters.values() if p.name != "self"]
    labels_at = next((i for i, p in enumerate(params) if p.name == "labels"), None)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        if labels is None or getattr(self.loss_function, "__name__", "") != "ForCausalLMLoss":
            return original(self, *args, **kwargs)  # no labels, or a custom loss: the stock forward
        if "labels" in kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
        else:
            args = (*args[:labels_at], None, *args[labels_at + 1:])  # type: ignore[index, operator]
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        head = self._modules["lm_head"]
        stash = _Stash()
        self._modules["lm_head"] = stash
        try:
            out = original(self, *args, return_dict=True, **kwargs)  # labels removed: no stock loss
        finally:
            self._modules["lm_head"] = head
        if stash.hidden is None:
            raise RuntimeError(f"cukit.nn.patch (lm_head_loss): {cls.__name__}.forward did not call lm_head")
        cap = getattr(self.config, "final_logit_softcapping", None) if softcap else None
        loss = causal_lm_loss(stash.hidden, head, labels, softcap=cap,
                              options=getattr(self, "cukit_loss_options", None), **kwargs)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        result = type(out)(loss=loss, **fields)  # logits=None: the point is never to make them
        return result if return_dict else result.to_tuple()

    sub = derived_class(cls, None, forward=forward, _cukit_lm_head_loss=True)
    _PATCHED[cls] = sub
    return sub


@register_rule("lm_head_loss")
def _lm_head_loss(name: str, m: nn.Module, ctx: PatchContext) -> list[Change]:
    """HF *ForCausalLM and GPT2LMHeadModel: labels -> cukit.linear_cross_entropy over lm_head,
    logits never made."""
    cls = type(m)
    if not cls.__name__.endswith(("ForCausalLM", "LMHeadModel")) or getattr(cls, "_cukit_lm_head_loss", False):
        return []
    what = f"{cls.__name__}: "
    reads = _reads(cls.forward)
    form = _KNOWN_FORMS.get(reads)
    softcap = form is None and reads >= _SOFTCAP_READS and reads - _SOFTCAP_READS in _KNOWN_FORMS
    if softcap:
        form = _KNOWN_FORMS[reads - _SOFTCAP_READS]
    if form is None:
        known = min(_KNOWN_FORMS, key=lambda k: len(reads ^ k))  # the nearest known form, to name the difference
        extra, missing = sorted(reads - known - _SOFTCAP_READS), sorted(known - reads)
        diff = "; ".join(f"{w} {', '.join(d[:6])}" for w, d in (("also reads", extra), ("does not read", missing)) if d)
        return [Change(name, what + f"forward {diff}: not known to be Llama- or GPT-2-style", skipped=True)]
    head, body = m._modules.get("lm_head"), m._modules.get(form)
    if body is None or type(head) not in (nn.Linear, Linear):
        got = "none" if head is None else type(head).__name__
        return [Change(name, what + f"needs `{form}` and an nn.Linear `lm_head` (got lm_head {got})", skipped=True)]
    if isinstance(head, Linear) and head.activation is not None:
        return [Change(name, what + f"lm_head applies {head.activation!r}", skipped=True)]
    reason = _hooks(head, inputs_too=True) or _instance_forward(head) or _instance_forward(m)
    if reason:
        return [Change(name, what + f"lm_head's loss not fused: {reason}", skipped=True)]
    m.__class__ = _patched_class(cls, softcap)
    cap = " (final_logit_softcapping as softcap)" if softcap else ""
    return [Change(name, what + f"labels -> cukit.linear_cross_entropy over lm_head{cap}; logits=None then "
                         "(model.cukit_loss_options: its options)")]
