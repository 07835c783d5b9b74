"""cukit.train: the classic training loop without a host sync per step.

A loop that calls ``loss.item()`` for its running loss and ``if not torch.isfinite(loss)`` for its
NaN check waits for the GPU twice per step: the CPU can no longer queue the next step while the
current one runs, and a small model spends most of its time in that gap. This module keeps both
on the device and reads them only when you log:

- :class:`RunningMean` / :class:`Metrics`: weighted running means in preallocated device tensors;
  ``update`` queues a few kernels, ``read`` is the one sync (one device-to-host copy for all metrics).
- :class:`NonFiniteGuard`: a device flag (NaN/inf in the loss or any gradient) handed to a
  cukit.optim optimizer as ``found_inf``, the attribute torch.amp.GradScaler uses: the step is
  skipped on the GPU (parameters and optimizer state untouched) and counted on the device.
- :func:`capture_step`: forward + backward + optimizer step captured once in a CUDA graph (warm-up
  and capture done for you) and replayed per batch: one launch for the whole step, no host sync,
  with loud :class:`CaptureError` messages naming the cause when a step cannot be captured.

Everything here is also CUDA-graph safe on its own (in-place updates of buffers allocated by the
first update), so the pieces work inside a graph you capture yourself.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

import cukit
from cukit.optim._base import MultiTensorOptimizer

__all__ = ["CaptureError", "CapturedStep", "Metrics", "NonFiniteGuard", "RunningMean", "capture_step"]

Tensor = torch.Tensor
_ACC_DTYPES = (torch.float32, torch.float64)
_MISSING = object()


def _capturing(device: torch.device) -> bool:
    # torch.cuda.is_current_stream_capturing() raises on a CPU-only build: ask only for CUDA tensors
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------
# Running means
# ---------------------------------------------------------------------------------------------


class RunningMean:
    """A weighted running mean kept on the device: ``mean = Σ w_i x_i / Σ w_i`` over every element
    ``x_i`` of every value passed to :meth:`update` (``weight`` broadcast to the value's shape).

    ``update`` queues a few kernels and never syncs; :meth:`compute` returns a 0-dim device tensor;
    :meth:`read` is the one sync (a Python float). The sum lives in a 0-dim tensor of ``dtype``
    (float32 or float64) on the device of the first value (``device`` when the first value is a
    Python number, CPU by default); the total weight is a float64 device tensor when weights are
    tensors (or updates are captured in a CUDA graph) plus a host float when they are Python
    numbers, so neither kind syncs. Elements whose weight is 0 are ignored even when they are NaN
    or inf: ``update(loss, weight=guard.finite)`` averages the steps a :class:`NonFiniteGuard` let
    through. With no weight yet, the mean is NaN.

    CUDA-graph safe: the buffers are allocated by the first update and updated in place after it,
    so an ``update`` inside a captured step accumulates on every replay.

    Args:
        dtype: accumulation dtype, ``torch.float32`` or ``torch.float64``.
        device: where the buffers go when the first value is a Python number.

    See also: ``torchmetrics.MeanMetric`` (which syncs for its NaN handling), ``torch.cuda.make_graphed_callables``.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if dtype not in _ACC_DTYPES:
            raise TypeError(f"RunningMean accumulates in torch.float32 or torch.float64; got {dtype!r}")
        self.dtype = dtype
        self._device = torch.device(device) if device is not None else None
        self._sum: Tensor | None = None  # 0-dim, dtype
        self._wsum: Tensor | None = None  # 0-dim float64: tensor weights and captured updates
        self._host_w = 0.0  # Python-number weights of eager updates

    def __repr__(self) -> str:  # no values: reading them would sync
        return f"RunningMean(dtype={self.dtype}, device={self.device})"

    @property
    def device(self) -> torch.device:
        """The buffers' device (``device`` or CPU before the first update)."""
        if self._sum is not None:
            return self._sum.device
        return self._device or torch.device("cpu")

    def _alloc(self, device: torch.device) -> None:
        self._sum = torch.zeros((), dtype=self.dtype, device=device)
        self._wsum = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, value: Tensor | float, weight: Tensor | float = 1.0) -> None:
        """Add ``value`` (a tensor of any shape, detached, or a Python number) with ``weight`` (a
        Python number or a tensor broadcastable to ``value``'s shape) to the mean. No host sync."""
        if isinstance(value, Tensor):
            v = value.detach()
            if v.is_complex():
                raise TypeError(f"RunningMean takes real values; got {v.dtype}")
            if self._sum is None:
                self._alloc(v.device)
            if v.device != self.device:
                v = v.to(self.device, non_blocking=True)
        else:
            if self._sum is None:
                self._alloc(self.device)
            v = float(value)  # type: ignore[assignment]
        acc, wsum = self._sum, self._wsum
        assert acc is not None and wsum is not None
        if not isinstance(weight, Tensor):
            w = float(weight)
            if w == 0.0:
                return  # NaN * 0 is NaN: a zero weight must not touch the sum
            if isinstance(v, Tensor):
                acc.add_(v.sum(dtype=self.dtype), alpha=w)
                n = v.numel()
            else:
                acc.add_(v * w)
                n = 1
            if _capturing(acc.device):
                wsum.add_(w * n)  # a host counter would not advance when the graph replays
            else:
                self._host_w += w * n
            return
        if not isinstance(v, Tensor):
            v = torch.full((), v, dtype=self.dtype, device=acc.device)
        w = weight.detach().to(device=acc.device, non_blocking=True)
        if torch.broadcast_shapes(w.shape, v.shape) != v.shape:
            raise ValueError(
                f"RunningMean.update: weight of shape {tuple(w.shape)} does not broadcast to the value's "
                f"shape {tuple(v.shape)}"
            )
        w = w.expand(v.shape)
        acc.add_(torch.where(w == 0, 0.0, v.to(self.dtype) * w.to(self.dtype)).sum())
        wsum.add_(w.sum(dtype=torch.float64))  # float64 whatever `dtype`: counts stay exact

    def weight(self) -> Tensor:
        """The total weight so far (float64 0-dim tensor on the buffers' device; no sync)."""
        if self._wsum is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return self._wsum + self._host_w

    def compute(self) -> Tensor:
        """The mean as a 0-dim tensor of ``dtype`` on the buffers' device (NaN with no weight; no sync)."""
        if self._sum is None or self._wsum is None:
            return torch.full((), math.nan, dtype=self.dtype, device=self.device)
        return (self._sum.to(torch.float64) / (self._wsum + self._host_w)).to(self.dtype)

    def read(self, reset: bool = False) -> float:
        """The mean as a Python float: the one host sync. ``reset=True`` then starts a new window."""
        out = math.nan if self._sum is None else float(self.compute().item())
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        """Zero the mean in place (the buffers stay, so a captured graph keeps writing into them)."""
        if self._sum is not None and self._wsum is not None:
            self._sum.zero_()
            self._wsum.zero_()
        self._host_w = 0.0

    def _snapshot(self) -> Callable[[], None]:
        """A function that puts the current state back, in place (capture_step's warm-up)."""
        saved = None if self._sum is None else (self._sum.clone(), self._wsum.clone())  # type: ignore[union-attr]
        host_w = self._host_w

        def restore() -> None:
            if self._sum is not None and self._wsum is not None:
                if saved is None:
                    self._sum.zero_()
                    self._wsum.zero_()
                else:
                    self._sum.copy_(saved[0])
                    self._wsum.copy_(saved[1])
            self._host_w = host_w

        return restore


class Metrics(Mapping[str, RunningMean]):
    """Several named running means, ``mean[name] = Σ w_i x_i / Σ w_i`` over that name's values,
    read together: ``read()`` stacks every mean on the device and makes one device-to-host copy
    (one sync for all of them).

    ``update(loss=loss, acc=acc, weight=n)`` adds each value with the same weight; a name seen for
    the first time gets its own RunningMean (``names`` creates them up front). A mapping, so
    ``metrics["loss"]`` is the RunningMean and ``list(metrics)`` the names. Shapes and dtypes as in
    :class:`RunningMean`; ``read()`` returns ``{name: float}`` (NaN for a metric with no weight).

    See also: ``torchmetrics.MetricCollection``, ``torchmetrics.MeanMetric``.
    """

    def __init__(
        self, *names: str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> None:
        if dtype not in _ACC_DTYPES:
            raise TypeError(f"Metrics accumulate in torch.float32 or torch.float64; got {dtype!r}")
        self.dtype = dtype
        self._device = device
        self._means: dict[str, RunningMean] = {}
        for name in names:
            self._add(name)

    def _add(self, name: str) -> RunningMean:
        if not isinstance(name, str):
            raise TypeError(f"metric names must be strings; got {name!r}")
        m = self._means[name] = RunningMean(self.dtype, self._device)
        return m

    def __getitem__(self, name: str) -> RunningMean:
        return self._means[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._means)

    def __len__(self) -> int:
        return len(self._means)

    def __repr__(self) -> str:
        return f"Metrics({', '.join(map(repr, self._means))}, dtype={self.dtype})"

    def update(
        self,
        values: Mapping[str, Tensor | float] | None = None,
        /,
        *,
        weight: Tensor | float = 1.0,
        **named: Tensor | float,
    ) -> None:
        """Add each value (from ``values`` and the keywords) to its mean with ``weight``. No sync."""
        items = {**(values or {}), **named}
        for name, value in items.items():
            m = self._means.get(name)
            if m is None:
                m = self._add(name)
            m.update(value, weight)

    def compute(self) -> dict[str, Tensor]:
        """``{name: 0-dim device tensor}`` (no sync)."""
        return {name: m.compute() for name, m in self._means.items()}

    def read(self, reset: bool = False) -> dict[str, float]:
        """``{name: float}`` with one device-to-host copy (the one sync); ``reset=True`` then zeroes all."""
        live = [(name, m) for name, m in self._means.items() if m._sum is not None]
        out = dict.fromkeys(self._means, math.nan)
        if live:
            home = live[0][1].device
            stacked = torch.stack(
                [m.compute().to(device=home, dtype=torch.float64, non_blocking=True) for _, m in live]
            )
            out.update(zip([name for name, _ in live], stacked.tolist(), strict=True))
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        for m in self._means.values():
            m.reset()

    def _snapshot(self) -> Callable[[], None]:
        names = set(self._means)
        restores = [m._snapshot() for m in self._means.values()]

        def restore() -> None:
            for r in restores:
                r()
            for name in set(self._means) - names:  # created by the warm-up
                self._means[name].reset()

        return restore


# ---------------------------------------------------------------------------------------------
# Non-finite guard
# ---------------------------------------------------------------------------------------------


def _require_cukit_optimizer(optimizer: Any, what: str) -> None:
    if isinstance(optimizer, MultiTensorOptimizer):
        return
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    hint = ""
    if isinstance(optimizer, torch.optim.Optimizer):
        import cukit.optim as co

        twin = f"cukit.optim.{cls.__name__}" if cls.__name__ in co.__all__ else "a cukit.optim optimizer"
        hint = (
            f" torch.optim's for-loop and foreach steps ignore `found_inf` (torch.amp.GradScaler reads its "
            f"flag on the host for them: a sync per step), and its fused SGD leaves momentum buffers "
            f"uninitialised when the first step is skipped. Use {twin}(...) with the same arguments."
        )
    raise TypeError(
        f"{what} needs a cukit.optim optimizer (one whose step reads `found_inf` and skips on the GPU); "
        f"got {name}.{hint}"
    )


class NonFiniteGuard:
    """Skips an optimizer step on the GPU when the loss or a gradient is NaN or inf, and counts the
    skipped steps on the device: ``flag = 1 if any(!isfinite(loss), !isfinite(g) for g in grads) else 0``.

    Use it like torch.amp.GradScaler, without the scaling::

        guard = NonFiniteGuard(optimizer)
        loss.backward()
        guard.step(loss)        # or: guard.check(loss); optimizer.step()
        ...
        print(guard.skipped())  # the only sync, when you log

    :meth:`check` computes the flag (float32 0-dim, on the gradients' device) into a preallocated
    buffer and arms it for the next ``optimizer.step()``: a step pre-hook hands it over as
    ``optimizer.found_inf`` (what GradScaler sets) and a post-hook removes it and adds it to the
    skipped count. The cukit.optim kernels read the flag and, when it is 1, leave parameters and
    state untouched (no host sync); on CPU the reference step reads it on the host. The gradient
    check is one pass over every gradient (``cukit.optim.nonfinite_flag``); ``check_grads=False``
    checks the loss only.

    Needs a cukit.optim optimizer (TypeError otherwise). Do not combine with GradScaler (it already
    skips non-finite steps; both setting ``found_inf`` raises). CUDA-graph safe once it has run
    eagerly: a :meth:`check` and step inside a captured graph skip and count on every replay.

    Attributes:
        flag: float32 0-dim: 1.0 when the last check found a non-finite value (None before a check).
        finite: float32 0-dim: ``1 - flag``, a weight for ``RunningMean.update`` (None before a check).

    See also: ``torch.amp.GradScaler``, ``cukit.optim.nonfinite_flag``,
    ``torch._amp_foreach_non_finite_check_and_unscale_``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, check_grads: bool = True) -> None:
        _require_cukit_optimizer(optimizer, "NonFiniteGuard")
        self.optimizer = optimizer
        self.check_grads = bool(check_grads)
        self.flag: Tensor | None = None
        self.finite: Tensor | None = None
        self._skipped: Tensor | None = None  # float64 0-dim: exact counts up to 2**53
        self._steps: Tensor | None = None
        self._armed = False
        self._hooks = [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def __repr__(self) -> str:
        return f"NonFiniteGuard({type(self.optimizer).__name__}, check_grads={self.check_grads})"

    def _alloc(self, device: torch.device) -> None:
        if self.flag is not None and _capturing(device):
            raise RuntimeError(
                "NonFiniteGuard: the gradients moved to another device during CUDA-graph capture"
            )
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        self.finite = torch.ones((), dtype=torch.float32, device=device)
        self._skipped = torch.zeros((), dtype=torch.float64, device=device)
        self._steps = torch.zeros((), dtype=torch.float64, device=device)

    def _compute(self, loss: Tensor | None) -> Tensor:
        grads: list[Tensor] = []
        if self.check_grads:
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if loss is None and not grads:
            raise ValueError(
                "NonFiniteGuard.check: nothing to check (no loss given and no parameter has a gradient); "
                "call it after loss.backward()"
            )
        device = grads[0].device if grads else loss.device  # type: ignore[union-attr]
        if self.flag is None or self.flag.device != device:
            self._alloc(device)
        flag, finite = self.flag, self.finite
        assert flag is not None and finite is not None
        bad = self._grads_nonfinite(grads, device) if grads else None
        if loss is not None:
            loss_bad = torch.logical_not(torch.isfinite(loss.detach()).all()).to(torch.float32)
            loss_bad = loss_bad.to(device, non_blocking=device.type == "cuda")
            bad = loss_bad if bad is None else torch.maximum(bad, loss_bad)
        flag.copy_(bad)  # type: ignore[arg-type]
        finite.fill_(1.0).sub_(flag)
        return flag

    def _grads_nonfinite(self, grads: list[Tensor], device: torch.device) -> Tensor:
        """float32 0-dim on `device`: 1.0 if any gradient holds a NaN or inf. No host sync."""
        from cukit.optim.utils import nonfinite_flag

        return nonfinite_flag(grads).to(device, non_blocking=True)

    def check(self, loss: Tensor | None = None) -> Tensor:
        """Compute the flag from ``loss`` (if given) and the gradients, and arm it for the next
        ``optimizer.step()``. Returns :attr:`flag` (float32 0-dim, 1.0 = skip). No host sync."""
        flag = self._compute(loss)
        self._armed = True
        return flag

    def step(self, loss: Tensor | None = None, closure: Callable[[], Any] | None = None) -> Any:
        """``check(loss)`` then ``optimizer.step(closure)``: skipped on the GPU when the flag is 1."""
        self.check(loss)
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._armed:
            return
        current = optimizer.__dict__.get("found_inf", _MISSING)
        if current is _MISSING:
            optimizer.found_inf = self.flag
        elif current is not self.flag:
            self._armed = False
            raise RuntimeError(
                "NonFiniteGuard: the optimizer's `found_inf` is already set by someone else (torch.amp."
                "GradScaler?). GradScaler already skips non-finite steps: use one of the two"
            )

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._armed:
            return
        self._armed = False
        if optimizer.__dict__.get("found_inf", _MISSING) is self.flag:
            del optimizer.found_inf
        self._skipped.add_(self.flag)  # type: ignore[union-attr, arg-type]
        self._steps.add_(1.0)  # type: ignore[union-attr]

    @property
    def skipped_count(self) -> Tensor:
        """Steps skipped so far, a float64 0-dim device tensor (no sync; stack it with your metrics)."""
        if self._skipped is None:
            return torch.zeros((), dtype=torch.float64)
        return self._skipped

    def skipped(self) -> int:
        """Steps skipped since creation or :meth:`reset`: reads the device counter (a host sync)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    def steps(self) -> int:
        """Steps taken through the guard (skipped or not): a host sync."""
        return 0 if self._steps is None else int(self._steps.item())

    def reset(self) -> None:
        """Zero the counters in place (a captured graph keeps counting into them)."""
        if self._skipped is not None and self._steps is not None:
            self._skipped.zero_()
            self._steps.zero_()

    def remove(self) -> None:
        """Detach the guard from its optimizer (removes its step hooks)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.optimizer.__dict__.get("found_inf", _MISSING) is self.flag:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
        self._armed = False

    def _snapshot(self) -> Callable[[], None]:
        bufs = (self.flag, self.finite, self._skipped, self._steps)
        saved = None if self.flag is None else tuple(b.clone() for b in bufs)  # type: ignore[union-attr]

        def restore() -> None:
            self._armed = False
            if self.flag is None:
                return
            now = (self.flag, self.finite, self._skipped, self._steps)
            if saved is None:
                for b, v in zip(now, (0.0, 1.0, 0.0, 0.0), strict=True):
                    b.fill_(v)  # type: ignore[union-attr]
            else:
                for b, s in zip(now, saved, strict=True):
                    b.copy_(s)  # type: ignore[union-attr]

        return restore


# ---------------------------------------------------------------------------------------------
# Captured training step
# ---------------------------------------------------------------------------------------------


class CaptureError(RuntimeError):
    """A training step that cannot be captured in a CUDA graph; the message names the likely cause,
    where it happened (when it can tell) and the fix. The original error is chained (``__cause__``)."""


_SYNC_CAUSE = (
    "a host synchronisation inside the step: .item(), float()/int()/bool() or `if` on a CUDA tensor, "
    ".cpu()/.tolist()/.numpy(), print(tensor), torch.cuda.synchronize(), a blocking or pageable copy "
    "between host and GPU (e.g. torch.tensor(..., device='cuda') created inside the step), or an op "
    "whose output shape depends on the data (nonzero, masked_select, boolean-mask indexing, unique)",
    "keep values on the GPU inside the step (torch.where instead of `if`; cukit.train.RunningMean "
    "and NonFiniteGuard instead of .item() and isfinite checks; tensors created once, outside the "
    "step) and read them after step() returns",
)

_CAUSES: list[tuple[tuple[str, ...], tuple[str, str]]] = [
    (("called a synchronizing cuda operation",), _SYNC_CAUSE),
    (
        (
            "operation not permitted when stream is capturing",
            "cudaerrorstreamcaptureunsupported",
            "item()",
            "local_scalar_dense",
        ),
        _SYNC_CAUSE,
    ),
    (
        ("capturable is false", "capturable=false"),
        (
            "an optimizer whose param_groups have capturable=False",
            "pass capturable=True (or use a cukit.optim optimizer, whose steps are always capturable)",
        ),
    ),
    (
        ("parameters or gradients changed during cuda-graph capture",),
        (
            "gradients re-created inside the step (a .grad set to None and allocated again by backward, "
            "e.g. model.zero_grad() or optimizer.zero_grad() in loss_fn), or a parameter that got its "
            "first gradient only during capture",
            "leave zeroing to capture_step (optimizer.zero_grad(set_to_none=False) inside the graph); "
            "every parameter the step trains must get a gradient during warm-up",
        ),
    ),
    (
        ("hyperparameters other than lr changed during cuda-graph capture",),
        ("optimizer hyperparameters changed inside the step", "change them outside the step"),
    ),
    (
        ("legacy stream depend on a capturing blocking stream", "cudaerrorstreamcaptureimplicit"),
        (
            "work queued on the legacy default stream while capturing (a library that ignores torch's "
            "current stream, e.g. CuPy code on CuPy's default stream)",
            "run it on torch.cuda.current_stream() (cupy.cuda.ExternalStream(torch.cuda.current_stream()"
            ".cuda_stream)) or outside the step",
        ),
    ),
    (
        ("capture was not joined", "cudaerrorstreamcaptureunjoined"),
        (
            "a side stream used inside the step was not joined back to the capture stream",
            "make the capturing stream wait for it: torch.cuda.current_stream().wait_stream(side)",
        ),
    ),
    (
        ("uncaptured work in another stream", "cudaerrorstreamcaptureisolation"),
        (
            "the step waited on work (an event or stream) recorded outside the capture",
            "create and record streams/events inside the step only",
        ),
    ),
    (
        ("current_seed", "manual_seed", "get_rng_state", "set_rng_state", "seed during"),
        (
            "the step reads or re-seeds the CUDA random generator",
            "seed once before capture_step; random ops (dropout) themselves are fine",
        ),
    ),
    (
        ("expected all tensors to be on the same device", "found at least two devices"),
        (
            "a CPU tensor used by the step (a buffer, a loss weight or a constant left on the CPU)",
            "move it to the GPU once, outside the step (register it as a buffer so model.to() moves it)",
        ),
    ),
    (
        ("out of memory",),
        (
            "the graph's private memory pool ran out of GPU memory",
            "use a smaller batch, or free memory before capturing",
        ),
    ),
    (
        ("operation failed due to a previous error during capture", "cudaerrorstreamcaptureinvalidated"),
        (
            "an earlier operation in the step invalidated the capture (usually a host synchronisation)",
            _SYNC_CAUSE[1],
        ),
    ),
]


def _chain(exc: BaseException) -> list[BaseException]:
    """exc, its cause/context, ...: the root (the first error raised) last."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


_TORCH_DIR = os.path.dirname(torch.__file__)


def _user_frame(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame outside torch and this module, in the earliest
    error of the chain (a failed capture's "previous error" chains the real one as its context)."""
    for e in reversed(_chain(exc)):
        for fr in reversed(traceback.extract_tb(e.__traceback__)):
            f = os.path.abspath(fr.filename)
            if f.startswith(_TORCH_DIR) or f == os.path.abspath(__file__) or fr.filename.startswith("<"):
                continue
            return f"{fr.filename}:{fr.lineno}: {(fr.line or '').strip()}"
    return None


def _compiled(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod") for m in model.modules())


def _explain(exc: BaseException, stage: str, model: torch.nn.Module) -> str:
    text = " ".join(str(e) for e in _chain(exc)).lower()
    cause, fix = (
        "an operation that CUDA graphs do not allow",
        (
            "the step must be the same static sequence of GPU work every time: no host syncs (.item()), "
            "no CPU tensors, no shapes that depend on the data; see the constraints in "
            "https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs"
        ),
    )
    for needles, cf in _CAUSES:
        if any(n in text for n in needles):
            cause, fix = cf
            break
    lines = [f"capture_step: the training step cannot be captured in a CUDA graph ({stage})."]
    lines.append(f"  Likely cause: {cause}.")
    where = _user_frame(exc)
    if where:
        lines.append(f"  Where: {where}")
    lines.append(f"  Fix: {fix}.")
    if _compiled(model):
        lines.append(
            "  Note: the model is torch.compile'd; with mode='reduce-overhead' or 'max-autotune' it "
            "captures its own CUDA graphs, which cannot nest in this one: compile with mode='default' "
            "or 'max-autotune-no-cudagraphs', or replay its graphs yourself instead of capture_step."
        )
    root = _chain(exc)[-1]
    first = (str(root).strip().splitlines() or [""])[0]
    lines.append(f"  Original error: {type(root).__name__}: {first}")
    return "\n".join(lines)


@contextlib.contextmanager
def _sync_errors(enabled: bool) -> Iterator[None]:
    """Within the block, a synchronising CUDA op raises (torch's sync debug mode "error")."""
    if not enabled:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    _set_sync_debug_mode("error")
    try:
        yield
    finally:
        _set_sync_debug_mode(previous)


def _set_sync_debug_mode(mode: int | str) -> None:
    """torch.cuda.set_sync_debug_mode without its "prototype feature" warning (known, and ours to use)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


def _end_failed_capture(
    graph: torch.cuda.CUDAGraph,
    pool: Any,
    stream: torch.cuda.Stream,
    previous: torch.cuda.Stream,
    device: int,
) -> None:
    """Leave the process usable after a failed capture. torch.cuda.graph's __exit__ does not
    restore the caller's stream when capture_end raises, and CUDAGraph.capture_end raises before it
    stops routing the caching allocator's allocations to the graph's pool (every later allocation
    would then query the capture state): undo both. Best effort: these are torch internals."""
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            with contextlib.suppress(Exception):
                graph.capture_end()
    torch.cuda.set_stream(previous)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    try:
        end(device, pool)
    except Exception:
        return  # torch ended it (the capture ended); the graph object releases its pool
    with contextlib.suppress(Exception):
        release(device, pool)


def _detach(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def _split_loss(res: Any) -> tuple[Tensor, dict[str, Tensor]]:
    if isinstance(res, Tensor):
        return res, {}
    if (
        isinstance(res, (tuple, list))
        and len(res) == 2
        and isinstance(res[0], Tensor)
        and isinstance(res[1], Mapping)
    ):
        return res[0], dict(res[1])
    raise TypeError(
        "capture_step: loss_fn must return the loss (a 0-dim tensor) or (loss, {name: tensor}) for extra "
        f"metrics; got {type(res).__qualname__}"
    )


def _hyper_key(optimizer: torch.optim.Optimizer) -> list[list[tuple[str, Any]]]:
    """The optimizer's own hyperparameters (the keys of its defaults: not the bookkeeping LR
    schedulers add, such as initial_lr), whose changes a replay cannot see: Python values as they
    are, tensors by identity (their values are read on the device at every replay)."""
    keys = optimizer.defaults
    return [
        [(k, ("tensor", id(v)) if isinstance(v, Tensor) else v) for k, v in g.items() if k in keys]
        for g in optimizer.param_groups
    ]


class CapturedStep:
    """A training step captured in a CUDA graph by :func:`capture_step`: ``loss = step(*inputs)``
    copies the inputs into the static buffers and replays forward, backward, optimizer step (and
    the metrics update / guard, when given) as one graph launch. No host sync.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
        inputs: the static input tensors (copy into them yourself and call :meth:`replay` to save the
            argument checks and copies).
        loss: the static loss (detached, 0-dim): overwritten by every replay; clone it to keep it.
        outputs: the model's static outputs (detached), overwritten by every replay.
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        inputs: tuple[Tensor, ...],
        loss: Tensor,
        outputs: Any,
        optimizer: torch.optim.Optimizer,
        keepalive: list[Any],
        sentinels: list[tuple[Tensor, Tensor, int]],
    ) -> None:
        self.graph = graph
        self.inputs = inputs
        self.loss = loss
        self.outputs = outputs
        self.optimizer = optimizer
        self._hyper = _hyper_key(optimizer)
        self._keepalive = keepalive  # every tensor the graph reads or writes that it does not own
        self._sentinels = sentinels
        self._plans = getattr(optimizer, "_plans", None)  # a rebuild (load_state_dict, ...) replaces the list

    def __call__(self, *inputs: Tensor) -> Tensor:
        """Copy ``inputs`` (same count, shapes, dtypes and device as the sample inputs) into the
        static buffers, replay, and return the static loss tensor (no sync)."""
        static = self.inputs
        if len(inputs) != len(static):
            raise TypeError(f"step() takes {len(static)} tensors (as the sample inputs); got {len(inputs)}")
        for i, (dst, src) in enumerate(zip(static, inputs, strict=True)):
            if src is dst:
                continue
            if (
                not isinstance(src, Tensor)
                or src.shape != dst.shape
                or src.dtype != dst.dtype
                or src.device != dst.device
            ):
                raise self._bad_input(i, src)
            dst.copy_(src, non_blocking=True)
        return self.replay()

    def replay(self) -> Tensor:
        """Replay the graph on the current contents of :attr:`inputs`; returns :attr:`loss`."""
        for p, g, ptr in self._sentinels:
            if p.grad is not g or p.data_ptr() != ptr:
                raise CaptureError(
                    "CapturedStep: a parameter or its gradient is no longer the tensor the graph was captured "
                    "with (zero_grad(set_to_none=True) or model.to(...) after capture?). "
                    "The graph would update stale tensors: capture the step again"
                )
        if (
            getattr(self.optimizer, "_plans", None) is not self._plans
            or getattr(self.optimizer, "_key", 0) is None
        ):
            raise CaptureError(
                "CapturedStep: the optimizer rebuilt its tensors since capture (load_state_dict or "
                "add_param_group?); the graph would update the old ones: capture the step again"
            )
        if _hyper_key(self.optimizer) != self._hyper:
            raise CaptureError(self._hyper_changed())
        self.graph.replay()
        return self.loss

    def _bad_input(self, i: int, src: Any) -> Exception:
        dst = self.inputs[i]
        if not isinstance(src, Tensor):
            return TypeError(f"step(): argument {i} must be a tensor; got {type(src).__qualname__}")
        got = f"shape {tuple(src.shape)}, {src.dtype}, {src.device}"
        want = f"shape {tuple(dst.shape)}, {dst.dtype}, {dst.device}"
        hint = ""
        if src.shape != dst.shape:
            hint = (
                " A CUDA graph replays fixed shapes: use DataLoader(drop_last=True) or pad the last batch, "
                "or capture one step per shape"
            )
        elif src.device != dst.device:
            hint = (
                f" Copy it first: x.to({str(dst.device)!r}, non_blocking=True) (from pinned memory: no sync)"
            )
        return ValueError(f"step(): argument {i} has {got}; the graph was captured with {want}.{hint}")

    def _hyper_changed(self) -> str:
        now = _hyper_key(self.optimizer)
        what = "the number of param groups"
        if len(now) == len(self._hyper):
            for gi, (a, b) in enumerate(zip(self._hyper, now, strict=True)):
                da, db = dict(a), dict(b)
                keys = [k for k in {**da, **db} if da.get(k, _MISSING) != db.get(k, _MISSING)]
                if keys:
                    what = f"param group {gi}'s {', '.join(repr(k) for k in keys)}"
                    break
        return (
            f"CapturedStep: {what} changed since capture, but a CUDA graph replays the values it was "
            "captured with. Pass lr as a CUDA tensor (cukit.optim accepts lr=torch.tensor(1e-3, "
            "device='cuda'); LR schedulers then update it in place with fill_) or capture the step again"
        )


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, MultiTensorOptimizer):
        note = (
            " capture_step runs its warm-up steps with found_inf=1, so that they change nothing, and a "
            "replay needs a step with no host sync."
        )
        if isinstance(optimizer, torch.optim.Optimizer) and any(
            g.get("capturable") is False for g in optimizer.param_groups
        ):
            note += (
                " Its param_groups also have capturable=False, with which torch refuses to capture its step."
            )
        try:
            _require_cukit_optimizer(optimizer, "capture_step")
        except TypeError as e:
            raise CaptureError(f"{e}{note}") from None
    for gi, g in enumerate(optimizer.param_groups):
        lr = g.get("lr")
        if isinstance(lr, Tensor) and lr.device.type != "cuda":
            raise CaptureError(
                f"capture_step: param group {gi}'s lr is a tensor on {lr.device}; a captured step cannot read "
                f"a CPU tensor. Pass lr=torch.tensor(..., device='cuda') (or a float, fixed at capture)"
            )


def _check_devices(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sample_inputs: Sequence[Any]
) -> torch.device:
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device: torch.device | None = None
    for p in [*model.parameters(), *params]:
        if p.device.type != "cuda":
            name = names.get(id(p), "(an optimizer parameter outside the model)")
            raise CaptureError(
                f"capture_step: parameter {name} is on {p.device}; a CUDA graph captures GPU work only. "
                "Move the model with model.to('cuda') before creating the optimizer"
            )
        if device is None:
            device = p.device
        elif p.device != device:
            raise CaptureError(
                f"capture_step: parameters on {device} and {p.device}; one graph captures one device's "
                "stream: use one GPU per process (DistributedDataParallel) or capture per device yourself"
            )
    if device is None:
        raise CaptureError("capture_step: the optimizer has no parameters")
    for i, x in enumerate(sample_inputs):
        if not isinstance(x, Tensor):
            raise CaptureError(
                f"capture_step: sample_inputs[{i}] is a {type(x).__qualname__}; every input must be a tensor "
                "(constants belong in the model or loss_fn)"
            )
        if x.device != device:
            raise CaptureError(
                f"capture_step: sample_inputs[{i}] is on {x.device}; the model is on {device}. The graph "
                f"reads its inputs from static GPU buffers: pass x.to({str(device)!r})"
            )
    return device


def capture_step(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    sample_inputs: Sequence[Tensor],
    *,
    n_targets: int = 1,
    warmup: int = 3,
    metrics: RunningMean | Metrics | None = None,
    guard: NonFiniteGuard | None = None,
    check_syncs: bool = True,
) -> CapturedStep:
    """Capture one training step in a CUDA graph: ``optimizer.zero_grad(set_to_none=False);
    loss = loss_fn(model(*inputs[:-n_targets]), *inputs[-n_targets:]); loss.backward();
    optimizer.step()`` (+ ``guard.check(loss)`` before the step and ``metrics.update(loss)`` after
    it, when given). Returns a :class:`CapturedStep`: ``loss = step(x, y)`` replays it.

    What it does for you: checks that the step can be captured (CUDA, parameters and inputs on one
    GPU, a cukit.optim optimizer, lr tensors on the GPU); runs ``warmup`` eager steps on a side stream
    with ``found_inf=1`` handed to the optimizer, so the kernels compile, the gradients and the
    optimizer state are allocated and yet nothing trains (model buffers, the CUDA RNG state, the
    metrics and the guard counters are put back afterwards); runs the last warm-up step under
    ``torch.cuda.set_sync_debug_mode("error")`` to catch host syncs before capturing (turn off with
    ``check_syncs=False``); captures on a side stream into a private memory pool. The gradients
    stay allocated (zeroed in place inside the graph) so the optimizer's tensor tables stay valid.

    Args:
        model: an ``nn.Module`` whose parameters are all on one CUDA device.
        loss_fn: ``loss_fn(outputs, *targets)`` -> 0-dim loss, or ``(loss, {name: tensor})`` to log
            extra metrics into ``metrics`` (a :class:`Metrics`).
        optimizer: a cukit.optim optimizer over (some of) the model's parameters. A float lr is
            frozen into the graph; pass a CUDA tensor lr to change it between replays.
        sample_inputs: tensors on the model's device with the shapes and dtypes of every batch,
            model inputs first, then ``n_targets`` targets (e.g. ``(x, y)``).
        n_targets: how many trailing inputs go to ``loss_fn`` instead of the model (0: ``loss_fn(out)``).
        warmup: eager warm-up steps before capture (at least 1; the sync check needs 2).
        metrics: a :class:`RunningMean` (gets the loss) or :class:`Metrics` (gets ``loss`` and the
            extras) updated inside the graph; with a guard, skipped steps get weight 0.
        guard: a :class:`NonFiniteGuard` on ``optimizer``: a replay with a NaN/inf loss or gradient
            is skipped on the GPU and counted.
        check_syncs: run the last warm-up step with sync errors on (see above).

    Raises:
        CaptureError: the step cannot be captured; the message names the cause and the fix (no CUDA,
            a CPU parameter or input, a torch.optim optimizer, a host sync such as ``.item()``, ...).
            After a failed capture the caller's stream and the caching allocator are restored.

    The graph keeps the parameters, gradients and optimizer state it was captured with: after
    setting grads to None, moving the model or loading an optimizer state_dict, replays raise
    CaptureError (capture again); so do they after a change of a hyperparameter held as a Python
    number. A model state_dict loads in place (fine), and between replays the model can run eagerly
    (evaluation) on the same parameters.

    See also: ``torch.cuda.make_graphed_callables``, ``torch.cuda.graph``, the whole-network capture
    example in torch's CUDA semantics notes, ``torch.amp.GradScaler``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture_step: model must be a torch.nn.Module; got {type(model).__qualname__}")
    if not callable(loss_fn):
        raise TypeError("capture_step: loss_fn must be callable")
    if isinstance(sample_inputs, Tensor) or not isinstance(sample_inputs, Sequence):
        raise TypeError("capture_step: sample_inputs must be a tuple or list of tensors, e.g. (x, y)")
    sample_inputs = tuple(sample_inputs)
    if not 0 <= n_targets <= len(sample_inputs) or (n_targets == len(sample_inputs) and n_targets > 0):
        raise ValueError(
            f"capture_step: n_targets={n_targets} with {len(sample_inputs)} sample inputs leaves the model none"
        )
    if int(warmup) < 1:
        raise ValueError(f"capture_step: warmup must be at least 1; got {warmup}")
    if metrics is not None and not isinstance(metrics, (RunningMean, Metrics)):
        raise TypeError(
            f"capture_step: metrics must be a RunningMean or Metrics; got {type(metrics).__qualname__}"
        )
    if guard is not None and guard.optimizer is not optimizer:
        raise ValueError("capture_step: the guard watches another optimizer")
    _check_optimizer(optimizer)
    if not torch.cuda.is_available():
        raise CaptureError(
            "capture_step needs a CUDA GPU: torch.cuda.is_available() is False (torch "
            f"{torch.__version__}). CUDA graphs exist on CUDA only; on this machine run the eager step "
            "(RunningMean and NonFiniteGuard work on any device)"
        )
    if not cukit.is_available():
        raise CaptureError(
            "capture_step: cukit's kernels are not available (CuPy sees no GPU: see `cukit info`), so the "
            "cukit.optim step runs its torch reference, which reads values on the host and cannot be "
            "captured. Install CuPy for your CUDA (pip install 'cukit[cuda13]' or 'cukit[cuda12]')"
        )
    device = _check_devices(model, optimizer, sample_inputs)
    with torch.cuda.device(device):
        return _capture(
            model,
            loss_fn,
            optimizer,
            sample_inputs,
            device,
            n_targets,
            int(warmup),
            metrics,
            guard,
            check_syncs,
        )


def _capture(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    sample_inputs: tuple[Tensor, ...],
    device: torch.device,
    n_targets: int,
    warmup: int,
    metrics: RunningMean | Metrics | None,
    guard: NonFiniteGuard | None,
    check_syncs: bool,
) -> CapturedStep:
    inputs = tuple(x.detach().clone() for x in sample_inputs)
    split = len(inputs) - n_targets
    xs, ys = inputs[:split], inputs[split:]
    skip = torch.ones((), dtype=torch.float32, device=device)

    def one_step(warm: bool) -> tuple[Any, Tensor]:
        optimizer.zero_grad(set_to_none=False)  # set_to_none would re-allocate the grads in the graph
        out = model(*xs)
        loss, extras = _split_loss(loss_fn(out, *ys))
        loss.backward()
        if guard is not None:
            if warm:
                guard._compute(loss)  # builds its tables; the step below is skipped anyway
            else:
                guard.check(loss)
        if warm:
            prev = optimizer.__dict__.get("found_inf", _MISSING)
            optimizer.found_inf = skip  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                if prev is _MISSING:
                    del optimizer.found_inf  # type: ignore[attr-defined]
                else:
                    optimizer.found_inf = prev  # type: ignore[attr-defined]
        else:
            optimizer.step()
        if metrics is not None:
            weight: Tensor | float = guard.finite if guard is not None else 1.0  # type: ignore[assignment]
            if isinstance(metrics, Metrics):
                metrics.update({"loss": loss, **extras}, weight=weight)
            elif extras:
                raise TypeError(
                    "capture_step: loss_fn returned extra metrics but `metrics` is a RunningMean: pass a "
                    "cukit.train.Metrics to log them"
                )
            else:
                metrics.update(loss, weight)
        return out, loss

    # Warm-up: eager, on a side stream (as torch's capture notes require), nothing trained.
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.cuda.get_rng_state(device)
    restores = [x._snapshot() for x in (metrics, guard) if x is not None]
    side = torch.cuda.Stream(device)
    caller = torch.cuda.current_stream(device)
    side.wait_stream(caller)
    try:
        with torch.cuda.stream(side):
            for i in range(warmup):
                last = i == warmup - 1 and i > 0  # the first step builds tables with synchronous copies
                try:
                    with _sync_errors(check_syncs and last):
                        one_step(warm=True)
                except RuntimeError as e:
                    if check_syncs and last and "synchroniz" in str(e).lower():
                        raise CaptureError(
                            _explain(
                                e,
                                "found by the last warm-up step, run with "
                                "torch.cuda.set_sync_debug_mode('error'); check_syncs=False skips this check",
                                model,
                            )
                        ) from e
                    raise
    finally:
        caller.wait_stream(side)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.cuda.set_rng_state(rng, device)
        for r in restores:
            r()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        raise CaptureError(
            "capture_step: no parameter of the optimizer has a gradient after the warm-up: the loss does "
            "not depend on them (detached outputs? requires_grad=False?), so there is no step to capture"
        )

    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out, loss = one_step(warm=False)
    except Exception as e:
        _end_failed_capture(graph, pool, stream, caller, device.index if device.index is not None else 0)
        del graph
        if guard is not None:  # the capture may have stopped between its check and the step
            guard._armed = False
            if optimizer.__dict__.get("found_inf", _MISSING) is guard.flag:
                del optimizer.found_inf  # type: ignore[attr-defined]
        raise CaptureError(_explain(e, "during capture", model)) from e

    plans = getattr(optimizer, "_plans", [])
    keepalive: list[Any] = [
        [p.grad for p in params],
        list(plans),
        [(pl.table, pl.hp, pl.steps, dict(pl.scratch)) for pl in plans],
        getattr(optimizer, "_flat_buffers", None),
        getattr(optimizer, "_norm", None),
        model,  # its buffers (e.g. BatchNorm statistics) are written by every replay
        metrics,
        guard,
    ]
    sentinels = [
        (p, p.grad, p.data_ptr()) for p in {id(q): q for q in (with_grad[0], with_grad[-1])}.values()
    ]
    return CapturedStep(
        graph,
        inputs,
        loss.detach(),
        _detach(out),
        optimizer,
        keepalive,
        sentinels,  # type: ignore[arg-type]
    )
