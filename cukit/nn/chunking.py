"""Run a loss module over chunks of its batch, exactly and in bounded memory.

The classic helper (``loss += module(input[i:i+c], target[i:i+c])`` then ``loss / (N / c)``) is
wrong twice and saves nothing: the last partial chunk gets a full chunk's weight, a chunk's mean is
not the batch's mean once targets are ignored or classes weighted, and every chunk's autograd graph
(a language model head's logits, chunk x vocabulary) lives until backward.
:func:`forward_with_chunking` sums the chunks' loss sums and divides once by the batch's
denominator (torch's rule: the count of non-ignored targets, or the sum of their class weights),
kept on the device; each chunk runs under activation checkpointing, so forward keeps only the
chunk's inputs and backward rebuilds one chunk's graph at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Chunked", "forward_with_chunking"]

REDUCTIONS = ("mean", "sum", "none")
_FROM_MODULE: Any = type("_FromModule", (), {"__repr__": lambda self: "<the module's>"})()


def _type(x: Any) -> str:
    return type(x).__qualname__


def _check_chunk_size(chunk_size: Any, fn: str) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{fn}: chunk_size must be an int; got {_type(chunk_size)}")
    if chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be >= 1; got {chunk_size}")
    return chunk_size


def _loss_spec(module: Any, reduction: str | None, ignore_index: Any, weight: Any, fn: str
               ) -> tuple[str, int | None, torch.Tensor | None]:
    """(reduction, ignore_index, class weights) for a call: the arguments, else the module's own
    (a module with ``ignore_index`` is read as a cross-entropy-like loss: its ``weight`` is the
    class weights), else "mean" / -100 / None."""
    own_reduction = getattr(module, "reduction", None)
    if isinstance(own_reduction, str) and own_reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: module's reduction must be one of {', '.join(map(repr, REDUCTIONS))} (it is set "
                         f"to 'sum' per chunk); got {own_reduction!r}")
    if reduction is None:
        reduction = own_reduction if isinstance(own_reduction, str) else "mean"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    ce_like = hasattr(module, "ignore_index")
    own_ii = getattr(module, "ignore_index", None)
    own_ii = -100 if own_ii is None else own_ii
    own_w = getattr(module, "weight", None) if ce_like else None
    own_w = own_w if isinstance(own_w, torch.Tensor) else None
    if ignore_index is _FROM_MODULE:
        ignore_index = own_ii
    elif ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"{fn}: ignore_index must be an int or None; got {_type(ignore_index)}")
    elif ce_like and ignore_index != own_ii:
        raise ValueError(f"{fn}: ignore_index must match the module's ({own_ii}), which it applies itself; "
                         f"got {ignore_index}")
    if weight is _FROM_MODULE:
        weight = own_w
    elif weight is not None and not isinstance(weight, torch.Tensor):
        raise TypeError(f"{fn}: weight must be a 1-D tensor or None; got {_type(weight)}")
    elif own_w is not None and weight is not own_w:
        raise ValueError(f"{fn}: weight must be the module's own class weights (module.weight), which it applies "
                         "itself; got another tensor")
    if weight is not None and weight.ndim != 1:
        raise ValueError(f"{fn}: weight must be 1-D (one weight per class); got shape {tuple(weight.shape)}")
    return reduction, ignore_index, weight


def _denominator(target: torch.Tensor, ignore_index: int | None, weight: torch.Tensor | None,
                 class_probabilities: bool) -> torch.Tensor | float:
    """torch's mean denominator for `target` (no host sync): class indices -> the count of targets
    != ignore_index, or the sum of their class weights (a device tensor); floating targets -> the
    number of loss elements (class probabilities: over every dim but dim 1), known on the host."""
    if target.is_floating_point() or target.is_complex():
        return float(target.numel() // target.shape[1] if class_probabilities and target.ndim >= 2
                     else target.numel())
    valid = target != ignore_index if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)
    if weight is None:
        return valid.sum()
    w = weight.gather(0, target.masked_fill(~valid, 0).reshape(-1)).reshape(target.shape)
    return torch.where(valid, w, w.new_zeros(())).sum()


def _per_chunk(module: Any, reduction: str) -> Callable[..., Any]:
    """`module` with its ``reduction`` attribute set to "sum" (or "none"): a shallow copy, sharing
    parameters, buffers and hooks (the caller's module is not mutated, and a chunk recomputed in
    backward sees the same setting). A module without one must return the chunk's sum itself."""
    want = "none" if reduction == "none" else "sum"
    if isinstance(module, nn.Module) and isinstance(getattr(module, "reduction", None), str):
        if module.reduction == want:
            return module
        summing = copy.copy(module)
        summing.reduction = want
        return summing
    return module  # type: ignore[no-any-return]


def forward_with_chunking(
    module: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int = 1024,
    *,
    reduction: str | None = None,
    ignore_index: int | None = _FROM_MODULE,
    weight: torch.Tensor | None = _FROM_MODULE,
    denominator: torch.Tensor | float | None = None,
    checkpoint: bool = True,
) -> torch.Tensor:
    """``module(input, target)`` computed over chunks of `chunk_size` rows along dim 0, equal to one
    call on the whole batch: ``loss = sum_chunks sum(chunk losses) / D`` for "mean", the plain sum
    for "sum", the chunks' outputs concatenated along dim 0 for "none".

    The contract: a module with a ``reduction`` attribute (``nn.CrossEntropyLoss``, ``nn.NLLLoss``,
    ``nn.MSELoss``, ``cukit.nn.LinearCrossEntropy``, ...) is called with it set to "sum" (on a
    shallow copy; parameters shared); any other callable must return the chunk's SUM (0-d). D is
    torch's mean denominator, computed once over the whole `target` and kept on the device (no
    host sync): for class-index targets the count of targets != ignore_index, or the sum of
    ``weight[target]`` over them when there are class weights; for floating targets the number of
    loss elements (class probabilities with a cross-entropy module: numel / size(1)).

    Memory: with `checkpoint` (default) each chunk runs under ``torch.utils.checkpoint``
    (non-reentrant, everything recomputed): forward keeps only each chunk's inputs (views of
    `input` and `target`) and its 0-d loss, and backward recomputes one chunk's graph at a time,
    so the peak is one chunk's activations (a language model head: chunk x vocabulary logits and
    their gradient) instead of the batch's. The price is a second forward of `module`. Under
    ``torch.no_grad`` nothing is checkpointed. Under ``torch.compile`` the per-call copy of a
    module with a ``reduction`` attribute is a graph break (``fullgraph=True`` needs a callable
    that returns the sum).

    Args:
        module: ``module(input_chunk, target_chunk)`` -> the chunk's loss (see the contract).
        input: (N, ...) any dtype; target: (N, ...) class indices or values.
        chunk_size: rows per chunk (int >= 1); the last chunk holds the rest.
        reduction: "mean", "sum" or "none"; None: the module's ``reduction`` ("mean" without one).
        ignore_index, weight: for the denominator; by default the module's own (a module with an
            ``ignore_index`` attribute: that and its ``weight`` buffer), else -100 and None.
            Given explicitly, they must equal the module's (which applies them itself).
        denominator: overrides D (a number or a 0-d tensor, e.g. transformers'
            ``num_items_in_batch`` across gradient-accumulation micro-batches).
        checkpoint: checkpoint each chunk (False: the chunks' graphs all live until backward,
            which only helps a module that keeps little, such as ``cukit.nn.LinearCrossEntropy``).

    Returns the loss: 0-d (mean, sum; the chunk losses' dtype, accumulated in float32 at least),
    or the concatenated outputs (none). An empty batch gives the module's result on it.

    Raises:
        TypeError for a non-tensor input/target, a chunk_size that is not an int, a module output
        that is not a tensor; ValueError for chunk_size < 1, first dimensions that differ, a 0-d
        input, an unknown reduction, a chunk loss that is not 0-d for mean/sum.

    See also: ``torch.utils.checkpoint.checkpoint``, ``torch.nn.CrossEntropyLoss``,
    ``cukit.nn.Chunked`` (the module form).
    """
    return _chunked(module, input, target, chunk_size, reduction, ignore_index, weight, denominator, checkpoint,
                    "cukit.nn.forward_with_chunking")


def _chunked(module: Any, input: Any, target: Any, chunk_size: Any, reduction: str | None, ignore_index: Any,
             weight: Any, denominator: Any, checkpoint: bool, fn: str) -> torch.Tensor:
    if not callable(module):
        raise TypeError(f"{fn}: module must be callable (module(input, target) -> loss); got {_type(module)}")
    for name, t in (("input", input), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor; got {_type(t)}")
        if t.ndim == 0:
            raise ValueError(f"{fn}: {name} must have a batch dimension (dim 0); got a 0-d tensor")
    if input.shape[0] != target.shape[0]:
        raise ValueError(f"{fn}: input and target must have the same first dimension; got input "
                         f"{tuple(input.shape)}, target {tuple(target.shape)}")
    chunk_size = _check_chunk_size(chunk_size, fn)
    if not isinstance(checkpoint, bool):
        raise TypeError(f"{fn}: checkpoint must be True or False; got {checkpoint!r}")
    reduction, ignore_index, weight = _loss_spec(module, reduction, ignore_index, weight, fn)
    if denominator is not None and not isinstance(denominator, (int, float, torch.Tensor)):
        raise TypeError(f"{fn}: denominator must be a number, a 0-d tensor or None; got {_type(denominator)}")
    per_chunk = _per_chunk(module, reduction)
    ckpt = checkpoint and torch.is_grad_enabled()
    parts = []
    for x, t in zip(input.split(chunk_size), target.split(chunk_size), strict=True):
        out = (torch.utils.checkpoint.checkpoint(per_chunk, x, t, use_reentrant=False) if ckpt
               else per_chunk(x, t))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{fn}: module must return a tensor (the chunk's loss); got {_type(out)}")
        if reduction != "none" and out.ndim != 0:
            raise ValueError(f"{fn}: module must return the chunk's summed loss (0-d) for reduction "
                             f"{reduction!r}; got shape {tuple(out.shape)} (set its reduction, or sum it)")
        parts.append(out)
    if reduction == "none":
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    dtype = parts[0].dtype
    acc = torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype
    total = parts[0].to(acc) if len(parts) == 1 else torch.stack([p.to(acc) for p in parts]).sum()
    if reduction == "mean":
        d = denominator
        if d is None:
            class_probs = isinstance(module, nn.Module) and hasattr(module, "label_smoothing")
            d = _denominator(target, ignore_index, weight, class_probs)
        total = total / (d.to(total.device) if isinstance(d, torch.Tensor) else d)
    return total.to(dtype)


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + k[len(inner):]] = state_dict.pop(k)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix):]] = state_dict.pop(k)


class Chunked(nn.Module):
    """A loss module run over chunks of its batch: ``Chunked(module, chunk_size)(input, target)``
    is :func:`forward_with_chunking` with these settings (``forward`` also takes `denominator`).

    Args:
        module: the loss module (see :func:`forward_with_chunking` for the contract), held as
            ``self.module``.
        chunk_size, reduction, ignore_index, weight, checkpoint: as ``forward_with_chunking``.

    ``state_dict`` keys are the wrapped module's (no ``module.`` level), and loading accepts them,
    so ``model.loss = Chunked(model.loss, 1024)`` keeps checkpoints loadable;
    ``named_parameters`` shows the ``module.`` level.

    See also: ``torch.nn.CrossEntropyLoss``, ``cukit.nn.LinearCrossEntropy``.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_size: int = 1024,
        *,
        reduction: str | None = None,
        ignore_index: int | None = _FROM_MODULE,
        weight: torch.Tensor | None = _FROM_MODULE,
        checkpoint: bool = True,
    ) -> None:
        super().__init__()
        fn = "cukit.nn.Chunked"
        if not isinstance(module, nn.Module):
            raise TypeError(f"{fn}: module must be a torch.nn.Module; got {_type(module)}")
        self.chunk_size = _check_chunk_size(chunk_size, fn)
        _loss_spec(module, reduction, ignore_index, weight, fn)  # errors now, not at the first call
        if not isinstance(checkpoint, bool):
            raise TypeError(f"{fn}: checkpoint must be True or False; got {checkpoint!r}")
        self.module = module
        self.reduction, self.checkpoint = reduction, checkpoint
        self._ignore_index, self._weight = ignore_index, weight
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, input: torch.Tensor, target: torch.Tensor,
                denominator: torch.Tensor | float | None = None) -> torch.Tensor:
        return _chunked(self.module, input, target, self.chunk_size, self.reduction, self._ignore_index,
                        self._weight, denominator, self.checkpoint, "cukit.nn.Chunked")

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, reduction={self.reduction!r}, checkpoint={self.checkpoint}"
