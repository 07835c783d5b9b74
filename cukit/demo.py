"""``cukit demo``: train the same small model twice, once with stock torch and once with cukit's
kernels, and print a side-by-side table (accuracy, loss, milliseconds per step, speed-up).

The data set is scikit-learn's handwritten digits (1797 8x8 images, shipped inside the package: no
download). Both runs start from identical weights, see the same mini-batches in the same order and
use the same optimizer maths, so their loss curves must agree to rounding error: the demo checks that
and exits with status 1 when they do not. The stock variant steps with ``torch.optim.AdamW``, the
cukit variant with :class:`cukit.optim.AdamW` (one fused launch per step on the GPU, owning flat
gradient storage; its plain-torch reference on the CPU), both lr 1e-3 and weight decay 1e-2.

The demo is a list of experiments (:data:`EXPERIMENTS`); each is a function that takes the parsed
options and returns rows for the table plus notes:

* ``mlp``: 64 -> 256 -> 256 -> 10 MLP. Stock: ``nn.Linear`` (with bias) + the activation from
  ``torch.nn.functional``. cukit: ``nn.Linear(bias=False)`` + :class:`cukit.nn.BiasAct`.
* ``cnn``: the images as 1x8x8: conv 3x3 1 -> 16, act, conv 3x3 16 -> 32, act, flatten, linear
  2048 -> 10. Stock: ``nn.Conv2d`` + the activation + ``nn.Linear``. cukit: each convolution with
  its bias and activation is one :class:`cukit.nn.Conv2d` (an implicit-GEMM kernel with the bias
  and activation in its epilogue; its backward two or three kernels), the classifier
  :class:`cukit.nn.Linear`. (:class:`MatmulConv2d`, im2col + :func:`cukit.matmul`, is the older
  twin, kept for ``examples/cnn_matmul_kernels.py``: ``cnn_models(..., conv="im2col")``.)

On CUDA each experiment adds a third row, ``cukit+graph``: the cukit model and optimizer with each
training step replayed as one CUDA graph (:func:`cukit.train.capture_step`, one line for the user).
Models this small are host-bound: the eager rows measure Python and launch overhead per op, the
graphed row what the step costs once the host is out of the loop.

Every variant's backward runs where torch runs it by default, on autograd's device thread;
``--backward-thread caller`` runs it on the calling thread instead
(``torch.autograd.set_multithreading_enabled(False)``). In a host-bound step the hand-off to the
device thread and back costs a Python backward node (a cukit op) far more than a C++ one, and buys
nothing on one device; torch's maintainers are moving single-device backward to the calling thread
for the same reason.

Usage::

    cukit demo                              # or: python -m cukit demo, make demo
    cukit demo -- --epochs 5 --device cpu --activation relu

From Python: ``cukit.demo.run_mlp(epochs=5, device="cpu")`` (or ``run_cnn``) returns the numbers
as a dict.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import cukit
from cukit.ops.bias_act import ACTIVATIONS as _BIAS_ACT_ACTIVATIONS

__all__ = [
    "BACKWARD_THREADS",
    "CNN_LOSS_TOLERANCE",
    "EXPERIMENTS",
    "LOSS_TOLERANCE",
    "DemoOptions",
    "Digits",
    "ExperimentResult",
    "MatmulConv2d",
    "Row",
    "cnn_experiment",
    "cnn_models",
    "default_cukit_optimizer",
    "default_optimizer",
    "device_label",
    "format_table",
    "load_digits",
    "main",
    "mlp_experiment",
    "optimizer_name",
    "resolve_device",
    "run_cnn",
    "run_mlp",
]

ACTIVATIONS = tuple(_BIAS_ACT_ACTIVATIONS)

#: Builds an optimizer for a model's parameters, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

#: Largest acceptable max |loss_torch - loss_cukit| over a run; the maths is the same, so anything
#: beyond rounding error (amplified a little by many optimizer steps) is a bug.
LOSS_TOLERANCE = 1e-3


BACKWARD_THREADS = ("caller", "worker")
BACKWARD_THREAD_NOTE = {
    "caller": "Every variant's backward ran on the calling thread (torch.autograd.set_multithreading_enabled("
              "False)).",
    "worker": "Every variant's backward ran on autograd's device thread (torch's default); --backward-thread "
              "caller runs it on the calling thread.",
}


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The stock variant's optimizer: ``torch.optim.AdamW(lr=1e-3, weight_decay=1e-2)``."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)


def default_cukit_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The cukit variant's optimizer: ``cukit.optim.AdamW(lr=1e-3, weight_decay=1e-2, flat_grads=True)``,
    the same maths as :func:`default_optimizer`. ``flat_grads``: every ``p.grad`` is a view into one
    buffer that ``zero_grad`` clears in place, so the gradient pointers never change and the step's
    host cost does not grow with the number of tensors (autograd accumulates into the zeroed views:
    the same values as fresh gradients)."""
    import cukit.optim  # here, not at the top: cukit.optim loads its kernel modules on import

    return cukit.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, flat_grads=True)


def _cukit_factory(optimizer: OptimizerFactory, cukit_optimizer: OptimizerFactory | None) -> OptimizerFactory:
    """The cukit variant's optimizer factory: `cukit_optimizer` when given; cukit.optim.AdamW when
    the stock side keeps the default torch.optim.AdamW; otherwise the stock side's own factory (a
    custom optimizer is compared like for like)."""
    if cukit_optimizer is not None:
        return cukit_optimizer
    return default_cukit_optimizer if optimizer is default_optimizer else optimizer


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    """The public name of an optimizer's class: ``torch.optim.AdamW``, ``cukit.optim.AdamW``, or
    ``module.QualName`` for others."""
    cls = type(opt)
    for package in ("torch.optim", "cukit.optim"):
        if cls.__module__ == package or cls.__module__.startswith(package + "."):
            return f"{package}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------
# Devices and data
# ---------------------------------------------------------------------------------------------


def resolve_device(choice: str = "auto") -> torch.device:
    """The torch device for ``--device``: "auto" picks CUDA when both torch and CuPy see a GPU.

    Raises RuntimeError for "cuda" when torch or CuPy cannot use a GPU, and ValueError for an
    unknown choice.
    """
    gpu = torch.cuda.is_available() and cukit.is_available()
    if choice == "auto":
        return torch.device("cuda" if gpu else "cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--device cuda: this torch build sees no CUDA device (torch.cuda.is_available())"
            )
        if not cukit.is_available():
            raise RuntimeError(
                "--device cuda: CuPy sees no CUDA device, so cukit's kernels cannot run "
                "(install cupy-cuda12x or cupy-cuda13x; see `cukit info`)"
            )
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {choice!r}")


def device_label(device: torch.device) -> str:
    """The device's name for the table: "CPU", or the GPU's name (from :func:`cukit.device_info`,
    else from torch)."""
    if device.type != "cuda":
        return "CPU"
    name = cukit.device_info(device.index).get("name")
    return str(name) if name else torch.cuda.get_device_name(device)


@dataclass(frozen=True)
class Digits:
    """The digits data set, standardised and split, as tensors on one device."""

    x_train: torch.Tensor  # (n_train, 64) float32
    y_train: torch.Tensor  # (n_train,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor


@functools.lru_cache(maxsize=4)
def _digits_numpy(seed: int, test_size: float) -> tuple[Any, Any, Any, Any]:
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
        from sklearn.preprocessing import StandardScaler
    except ImportError:
        raise ImportError(
            "the cukit demo needs scikit-learn for its data set: pip install 'cukit[demo]'"
        ) from None
    x, y = sk_load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)  # statistics from the training split only
    return scaler.transform(x_tr), scaler.transform(x_te), y_tr, y_te


def load_digits(device: torch.device | str = "cpu", *, seed: int = 0, test_size: float = 0.2) -> Digits:
    """scikit-learn's digits (1797 samples, 64 features, 10 classes): a stratified train/test split
    seeded by ``seed``, features standardised with the training split's mean and std."""
    x_tr, x_te, y_tr, y_te = _digits_numpy(seed, test_size)

    def f32(a: Any) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.float32).to(device)

    def i64(a: Any) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.int64).to(device)

    return Digits(f32(x_tr), i64(y_tr), f32(x_te), i64(y_te))


# ---------------------------------------------------------------------------------------------
# Training one variant
# ---------------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One side of a comparison: a name, a model, and the optimizer to train it with."""

    name: str
    description: str
    model: nn.Module
    optimizer: OptimizerFactory = default_optimizer
    graphed: bool = False  # CUDA: full batches replay a cukit.train.capture_step graph


@dataclass
class TrainResult:
    """What training one variant produced."""

    losses: list[float]  # per step, in order
    step_ms: list[float]  # per step, warm-up steps included
    steps_per_epoch: int
    test_accuracy: float
    warmup_steps: int
    optimizer: str = ""  # optimizer_name() of the optimizer it trained with

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last epoch."""
        last = self.losses[-self.steps_per_epoch :]
        return sum(last) / len(last) if last else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Median milliseconds per training step, warm-up steps excluded."""
        timed = self.step_ms[self.warmup_steps :] or self.step_ms
        return statistics.median(timed) if timed else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch_orders(n: int, epochs: int, seed: int) -> list[torch.Tensor]:
    """The sample order of every epoch, drawn once from ``seed`` so every variant sees the same
    mini-batches in the same order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(n, generator=g) for _ in range(epochs)]


def train(
    variant: Variant,
    data: Digits,
    orders: Sequence[torch.Tensor],
    *,
    batch_size: int,
    warmup_steps: int = 10,
) -> TrainResult:
    """Train ``variant.model`` with cross-entropy over ``orders`` (one permutation per epoch) and
    evaluate on the test split; :func:`train_variants` with one variant."""
    return _train_lockstep([variant], data, orders, batch_size=batch_size, warmup_steps=warmup_steps)[0]


class _Run:
    """One variant's training state inside :func:`_train_lockstep`."""

    def __init__(self, variant: Variant, n_steps: int, device: torch.device) -> None:
        self.model = variant.model
        self.opt = variant.optimizer(self.model.parameters())
        self.loss_log = torch.empty(n_steps, device=device)
        self.step_ms: list[float] = []
        self.model.train()

    def step(self, k: int, xb: torch.Tensor, yb: torch.Tensor, device: torch.device) -> None:
        """One timed training step on (xb, yb); its loss is kept on the device at index k."""
        _sync(device)
        t0 = time.perf_counter()
        loss = self._train(xb, yb)
        _sync(device)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.loss_log[k] = loss.detach()

    def _train(self, xb: torch.Tensor, yb: torch.Tensor, set_to_none: bool = True) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(self.model(xb), yb)
        loss.backward()
        self.opt.step()
        return loss


class _GraphedRun(_Run):
    """A variant whose full-size batches replay one CUDA graph of the whole step
    (``cukit.train.capture_step``: forward, backward and the cukit.optim step, captured on the first
    full batch after eager warm-up steps that train nothing). A smaller last batch of an epoch runs
    eagerly on the same optimizer, its gradients zeroed in place so the graph's stay valid."""

    def __init__(self, variant: Variant, n_steps: int, device: torch.device) -> None:
        super().__init__(variant, n_steps, device)
        self.captured: Any = None
        self.batch: int | None = None

    def _train(self, xb: torch.Tensor, yb: torch.Tensor, set_to_none: bool = True) -> torch.Tensor:
        from cukit.train import capture_step

        if self.batch is None:
            self.batch = xb.shape[0]
        if xb.shape[0] != self.batch:
            return super()._train(xb, yb, set_to_none=False)
        if self.captured is None:
            self.captured = capture_step(self.model, F.cross_entropy, self.opt, (xb, yb))
        return self.captured(xb, yb)


def _train_lockstep(
    variants: Sequence[Variant],
    data: Digits,
    orders: Sequence[torch.Tensor],
    *,
    batch_size: int,
    warmup_steps: int,
) -> list[TrainResult]:
    """Train every variant on the same batches, one step of each in turn (the order alternating
    between steps), so that their timings see the same machine: a host-bound step's time drifts
    with the machine's load over a run, and variants trained one after the other would compare
    different stretches of it.

    Each step is timed on its own: the device is synchronised before reading the clock on both
    sides, and the batch is gathered before the clock starts. Losses stay on the device until the
    end (no host sync inside the step)."""
    device = data.x_train.device
    n = data.x_train.shape[0]
    steps_per_epoch = -(-n // batch_size)
    runs = [(_GraphedRun if v.graphed else _Run)(v, len(orders) * steps_per_epoch, device) for v in variants]
    k = 0
    for order in orders:
        order = order.to(device)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            xb, yb = data.x_train[idx], data.y_train[idx]
            for r in runs if k % 2 == 0 else runs[::-1]:
                r.step(k, xb, yb, device)
            k += 1
    out = []
    for r in runs:
        r.model.eval()
        with torch.no_grad():
            pred = r.model(data.x_test).argmax(dim=1)
            accuracy = (pred == data.y_test).float().mean().item()
        out.append(TrainResult(
            losses=r.loss_log[:k].tolist(),
            step_ms=r.step_ms,
            steps_per_epoch=steps_per_epoch,
            test_accuracy=accuracy,
            warmup_steps=min(warmup_steps, max(0, k - 1)),
            optimizer=optimizer_name(r.opt),
        ))
    return out


# ---------------------------------------------------------------------------------------------
# The MLP experiment
# ---------------------------------------------------------------------------------------------


def torch_activation(activation: str) -> nn.Module:
    """torch's own module for a cukit activation name (each calls ``torch.nn.functional``)."""
    return {
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "gelu_tanh": nn.GELU(approximate="tanh"),
        "silu": nn.SiLU(),
    }[activation]


def mlp_models(
    sizes: Sequence[int], activation: str, *, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[nn.Sequential, nn.Sequential]:
    """The stock MLP and its cukit twin, with identical initial weights.

    Stock: ``Linear(bias) -> act -> ... -> Linear(bias)``. cukit: every hidden ``Linear`` loses its
    bias, which moves into the following :class:`cukit.nn.BiasAct`; the output layer is a plain
    ``Linear`` in both. The stock model is initialised under ``torch.manual_seed(seed)`` and its
    parameters are copied into the cukit model.
    """
    if len(sizes) < 2:
        raise ValueError(f"sizes needs at least an input and an output size; got {list(sizes)}")
    torch.manual_seed(seed)
    pairs = list(itertools.pairwise(sizes))
    stock: list[nn.Module] = []
    fused: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(pairs):
        lin = nn.Linear(fan_in, fan_out, device=device)
        stock.append(lin)
        if i == len(pairs) - 1:  # output layer: logits, no activation
            out = nn.Linear(fan_in, fan_out, device=device)
            fused.append(out)
            with torch.no_grad():
                out.weight.copy_(lin.weight)
                out.bias.copy_(lin.bias)
            break
        stock.append(torch_activation(activation))
        hidden = nn.Linear(fan_in, fan_out, bias=False, device=device)
        bias_act = cukit.nn.BiasAct(fan_out, activation, device=device)
        with torch.no_grad():
            hidden.weight.copy_(lin.weight)
            bias_act.bias.copy_(lin.bias)
        fused += [hidden, bias_act]
    return nn.Sequential(*stock), nn.Sequential(*fused)


def train_variants(
    variants: Sequence[Variant],
    data: Any,
    orders: Any,
    label: str,
    *,
    batch_size: int,
    warmup_steps: int,
    log: Callable[[str], None] | None,
) -> tuple[dict[str, TrainResult], float]:
    """Train the variants on the same batches, in lockstep (:func:`_train_lockstep`); returns the
    results by name and the largest |loss_torch - loss_v| over the steps and the other variants."""
    results: dict[str, TrainResult] = {}
    for v, r in zip(variants, _train_lockstep(variants, data, orders, batch_size=batch_size,
                                              warmup_steps=warmup_steps), strict=True):
        results[v.name] = r
        if log:
            log(
                f"  {v.name:<6} {label}, {r.optimizer}: {r.ms_per_step:.3f} ms/step, "
                f"test accuracy {r.test_accuracy:.2%}"
            )
    base = results["torch"].losses
    diff = max(
        abs(a - b) for name, r in results.items() if name != "torch" for a, b in zip(base, r.losses, strict=True)
    )
    return results, diff


def _graphed_variant(cukit_variant: Variant, device: torch.device, graphed: bool | None) -> list[Variant]:
    """The "cukit+graph" twin of the cukit variant (a copy of its model, same initial weights), or
    nothing: when `graphed` is False, or None off CUDA."""
    if graphed is None:
        graphed = device.type == "cuda"
    if not graphed:
        return []
    if device.type != "cuda":
        raise ValueError(f"graphed=True needs a CUDA device (CUDA graphs); got {device}")
    return [
        Variant(
            "cukit+graph",
            f"{cukit_variant.description}, each step one CUDA graph (cukit.train.capture_step)",
            copy.deepcopy(cukit_variant.model),
            cukit_variant.optimizer,
            graphed=True,
        )
    ]


def _variant_summaries(variants: Sequence[Variant], results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each variant's row of an experiment's result (speedup against the "torch" variant)."""
    base = results["torch"]
    return {
        v.name: {
            "description": v.description,
            "test_accuracy": results[v.name].test_accuracy,
            "final_loss": results[v.name].final_loss,
            "ms_per_step": results[v.name].ms_per_step,
            "speedup": base.ms_per_step / results[v.name].ms_per_step,
            "losses": results[v.name].losses,
            "optimizer": results[v.name].optimizer,
        }
        for v in variants
    }


def run_mlp(
    *,
    epochs: int = 15,
    batch_size: int = 64,
    device: str | torch.device = "auto",
    seed: int = 0,
    activation: str = "gelu",
    hidden: Sequence[int] = (256, 256),
    optimizer: OptimizerFactory = default_optimizer,
    cukit_optimizer: OptimizerFactory | None = None,
    warmup_steps: int = 10,
    graphed: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train the digits MLP with stock torch and with cukit; return the numbers.

    Args:
        epochs, batch_size, seed: the training run (seed fixes the split, the initial weights and
            the batch order, shared by both variants).
        device: "auto", "cpu", "cuda" or a torch.device.
        activation: "relu", "gelu", "gelu_tanh" or "silu".
        hidden: hidden layer widths (input 64 and output 10 are fixed by the data).
        optimizer: builds the stock variant's optimizer from a model's parameters.
        cukit_optimizer: builds the cukit variant's; None: :func:`default_cukit_optimizer`
            (cukit.optim.AdamW) when `optimizer` is the default torch.optim.AdamW, else `optimizer`.
        warmup_steps: steps left out of the timing median (on CUDA the first cukit step compiles
            its kernels).
        graphed: add the "cukit+graph" variant (the cukit model and optimizer, each full batch one
            replay of a ``cukit.train.capture_step`` graph); None: on CUDA only (graphs need it).
        log: called with a progress line per variant, if given.

    Returns:
        ``{"device": "CPU" or GPU name, "torch_device": str, "activation", "epochs", "batch_size",
        "steps", "n_train", "n_test", "sizes", "loss_max_abs_diff", "loss_tolerance", "losses_agree",
        "variants": {"torch": {...}, "cukit": {...}[, "cukit+graph": {...}]}}``, each variant with "test_accuracy",
        "final_loss" (mean over the last epoch), "ms_per_step" (median), "speedup" (torch's
        ms/step over this variant's), "losses" (per step), "description" and "optimizer" (e.g.
        "cukit.optim.AdamW").
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1; got {epochs} and {batch_size}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    data = load_digits(dev, seed=seed)
    sizes = [data.x_train.shape[1], *hidden, 10]
    stock, fused = mlp_models(sizes, activation, device=dev, seed=seed)
    arch = "-".join(map(str, sizes))
    variants = [
        Variant("torch", f"nn.Linear + F.{activation}", stock, optimizer),
        Variant(
            "cukit",
            "nn.Linear(bias=False) + cukit.nn.BiasAct",
            fused,
            _cukit_factory(optimizer, cukit_optimizer),
        ),
    ]
    variants += _graphed_variant(variants[1], dev, graphed)
    results, diff = train_variants(
        variants, data, epoch_orders(data.x_train.shape[0], epochs, seed), f"{arch} MLP, {epochs} epochs",
        batch_size=batch_size, warmup_steps=warmup_steps, log=log,
    )
    base = results["torch"]
    return {
        "device": device_label(dev),
        "torch_device": str(dev),
        "activation": activation,
        "epochs": epochs,
        "batch_size": batch_size,
        "steps": len(base.losses),
        "n_train": int(data.x_train.shape[0]),
        "n_test": int(data.x_test.shape[0]),
        "sizes": sizes,
        "loss_max_abs_diff": diff,
        "loss_tolerance": LOSS_TOLERANCE,
        "losses_agree": diff <= LOSS_TOLERANCE,
        "variants": _variant_summaries(variants, results),
    }


# ---------------------------------------------------------------------------------------------
# The CNN experiment
# ---------------------------------------------------------------------------------------------

#: Largest acceptable max |loss_torch - loss_cukit| for the CNN: the MLP's. The two convolutions
#: sum in different orders (torch's conv algorithm vs cukit's implicit GEMM), but the loss is insensitive
#: to that: on the CPU the curves differ by ~1e-7, and perturbing every conv GEMM of the cukit
#: variant by random relative noise of 1e-5 (100x float32 rounding) moves the loss by at most
#: 1.5e-6 over 345 steps, by 1.7e-4 at 1e-3 (TF32-sized errors). 1e-3 leaves room for the GPU's
#: summation orders without hiding a real bug (a wrong gradient moves the loss by > 1e-2 within
#: a few steps).
CNN_LOSS_TOLERANCE = LOSS_TOLERANCE
CNN_EPOCHS = 10  # default epochs of the cnn experiment (~97% test accuracy)


def cnn_missing() -> str | None:
    """Why the cnn experiment cannot run (``cukit.nn.Conv2d`` / ``cukit.nn.Linear`` missing), or None."""
    try:
        import cukit.nn

        missing = [n for n, ok in (("cukit.nn.Conv2d", hasattr(cukit.nn, "Conv2d")),
                                   ("cukit.nn.Linear", hasattr(cukit.nn, "Linear"))) if not ok]
    except Exception as e:  # pragma: no cover - a broken install
        return f"{type(e).__name__}: {e}"
    return f"{' and '.join(missing)} not available" if missing else None


class MatmulConv2d(nn.Module):
    """A stride-1 2-D convolution + bias + activation computed as im2col + GEMM with cukit (the
    demo's first CNN twin; :class:`cukit.nn.Conv2d` does it in one kernel):

    ``cols = F.unfold(x)`` (B, C*kh*kw, L), ``y = cukit.matmul(cols^T, weight2d^T)`` (B, L, out),
    ``y = cukit.bias_act(y, bias, activation)`` (bias over the last dim: fused with the
    activation), then back to (B, out, H_out, W_out). Differentiable through cukit.matmul's and
    cukit.bias_act's autograd. Parameters have nn.Conv2d's names and shapes (weight (out, in, kh,
    kw), bias (out,)), so a Conv2d's weights copy straight in.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        padding: int = 0,
        activation: str = "relu",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.padding, self.activation = kernel_size, padding, activation
        k = kernel_size
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, k, k, device=device))
        self.bias = nn.Parameter(torch.empty(out_channels, device=device))
        # nn.Conv2d's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for both
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(in_channels * k * k) if in_channels * k * k else 0.0
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        k, p = self.kernel_size, self.padding
        h_out, w_out = h + 2 * p - k + 1, w + 2 * p - k + 1
        cols = F.unfold(x, k, padding=p)  # (B, C*k*k, L)
        w2d = self.weight.reshape(self.out_channels, -1)  # (out, C*k*k)
        y = cukit.matmul(cols.mT, w2d.mT)  # (B, L, out): per image, the patches times the filters
        y = cukit.bias_act(y, self.bias, self.activation)
        return y.mT.reshape(n, self.out_channels, h_out, w_out)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"padding={self.padding}, activation={self.activation!r}")


def cnn_models(
    activation: str,
    *,
    channels: Sequence[int] = (16, 32),
    image: tuple[int, int] = (8, 8),
    classes: int = 10,
    device: torch.device | str = "cpu",
    seed: int = 0,
    conv: str = "conv2d",
) -> tuple[nn.Sequential, nn.Sequential]:
    """The stock CNN and its cukit twin, with identical initial weights.

    Both take the flat 64-feature rows of :class:`Digits` and view them as 1-channel images.
    Stock: ``(Conv2d(3x3, pad 1) -> act) x len(channels) -> Flatten -> Linear``. cukit:
    ``cukit.nn.Conv2d(3x3, pad 1, activation=act) x len(channels) -> Flatten -> cukit.nn.Linear``
    (``conv="conv2d"``: the bias and activation fused into each convolution's kernel), or
    ``MatmulConv2d`` (im2col + ``cukit.matmul`` + ``cukit.bias_act``) for each convolution
    (``conv="im2col"``). The stock model is initialised under ``torch.manual_seed(seed)`` and its
    parameters are copied into the cukit model.
    """
    import cukit.nn

    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if conv not in ("conv2d", "im2col"):
        raise ValueError(f"conv must be 'conv2d' or 'im2col'; got {conv!r}")
    torch.manual_seed(seed)
    fans = list(itertools.pairwise([1, *channels]))
    convs = [nn.Conv2d(a, b, 3, padding=1, device=device) for a, b in fans]
    features = fans[-1][1] * image[0] * image[1] if fans else image[0] * image[1]
    head = nn.Linear(features, classes, device=device)
    stock: list[nn.Module] = [nn.Unflatten(1, (1, *image))]
    fused: list[nn.Module] = [nn.Unflatten(1, (1, *image))]
    with torch.no_grad():
        for layer, (a, b) in zip(convs, fans, strict=True):
            if conv == "conv2d":
                twin: nn.Module = cukit.nn.Conv2d(a, b, 3, padding=1, device=device, activation=activation)
            else:
                twin = MatmulConv2d(a, b, 3, padding=1, activation=activation, device=device)
            twin.weight.copy_(layer.weight)
            twin.bias.copy_(layer.bias)
            stock += [layer, torch_activation(activation)]
            fused.append(twin)
        fused_head = cukit.nn.Linear(features, classes, device=device)
        fused_head.weight.copy_(head.weight)
        fused_head.bias.copy_(head.bias)
    stock += [nn.Flatten(), head]
    fused += [nn.Flatten(), fused_head]
    return nn.Sequential(*stock), nn.Sequential(*fused)


@contextlib.contextmanager
def _ieee_float32() -> Iterator[None]:
    """torch's float32 convolutions and matmuls in full float32 (no TF32) while the CNN trains.

    cuDNN convolutions use TF32 by default on Ampere and newer GPUs; cukit's convolution kernels
    and cukit.matmul's default precision are IEEE float32: the comparison is between equal
    precisions. Restored on exit.
    """
    cudnn, cuda_mm = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, cuda_mm.allow_tf32)
    cudnn.allow_tf32 = False
    cuda_mm.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32, cuda_mm.allow_tf32 = saved


def run_cnn(
    *,
    epochs: int = CNN_EPOCHS,
    batch_size: int = 64,
    device: str | torch.device = "auto",
    seed: int = 0,
    activation: str = "gelu",
    channels: Sequence[int] = (16, 32),
    optimizer: OptimizerFactory = default_optimizer,
    cukit_optimizer: OptimizerFactory | None = None,
    warmup_steps: int = 10,
    graphed: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train the digits CNN with stock torch and with cukit (``cukit.nn.Conv2d`` with the
    activation fused, ``cukit.nn.Linear``); return the numbers, in the same form as
    :func:`run_mlp` (``"sizes"`` is replaced by ``"channels"`` and ``"architecture"``).

    Both variants train in IEEE float32 (TF32 off for torch's convolutions and matmuls while they
    train; cukit's kernels compute in IEEE float32). On the CPU cukit's layers run their torch
    references. `optimizer`, `cukit_optimizer` and `graphed` as in :func:`run_mlp`. Raises RuntimeError when
    cukit.nn.Conv2d or cukit.nn.Linear is not available.
    """
    why = cnn_missing()
    if why:
        raise RuntimeError(f"the cnn experiment needs cukit.nn.Conv2d and cukit.nn.Linear: {why}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1; got {epochs} and {batch_size}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    data = load_digits(dev, seed=seed)
    if data.x_train.shape[1] != 64:
        raise ValueError(f"expected 8x8 digit images (64 features); got {data.x_train.shape[1]}")
    stock, fused = cnn_models(activation, channels=channels, device=dev, seed=seed)
    arch = "-".join(f"conv{c}" for c in channels) + "-fc10"
    variants = [
        Variant("torch", f"nn.Conv2d + F.{activation} + nn.Linear", stock, optimizer),
        Variant(
            "cukit",
            f"cukit.nn.Conv2d(activation={activation!r}) + cukit.nn.Linear",
            fused,
            _cukit_factory(optimizer, cukit_optimizer),
        ),
    ]
    variants += _graphed_variant(variants[1], dev, graphed)
    with _ieee_float32():
        results, diff = train_variants(
            variants, data, epoch_orders(data.x_train.shape[0], epochs, seed), f"{arch} CNN, {epochs} epochs",
            batch_size=batch_size, warmup_steps=warmup_steps, log=log,
        )
    base = results["torch"]
    return {
        "device": device_label(dev),
        "torch_device": str(dev),
        "activation": activation,
        "epochs": epochs,
        "batch_size": batch_size,
        "steps": len(base.losses),
        "n_train": int(data.x_train.shape[0]),
        "n_test": int(data.x_test.shape[0]),
        "channels": list(channels),
        "architecture": arch,
        "loss_max_abs_diff": diff,
        "loss_tolerance": CNN_LOSS_TOLERANCE,
        "losses_agree": diff <= CNN_LOSS_TOLERANCE,
        "variants": _variant_summaries(variants, results),
    }


# ---------------------------------------------------------------------------------------------
# Experiments and the table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoOptions:
    """The command-line options every experiment receives. ``epochs=None``: the experiment's default."""

    device: torch.device
    seed: int = 0
    epochs: int | None = None
    batch_size: int = 64
    activation: str = "gelu"
    log: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Row:
    """One line of the comparison table."""

    experiment: str
    variant: str
    description: str
    test_accuracy: float
    final_loss: float
    ms_per_step: float
    speedup: float  # baseline ms/step over this row's; 1.0 for the baseline itself
    optimizer: str = ""  # e.g. "cukit.optim.AdamW"


@dataclass
class ExperimentResult:
    """What an experiment hands back: table rows, lines printed under the table, whether its
    self-check passed, and the raw numbers."""

    name: str
    title: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    ok: bool = True
    data: dict[str, Any] = field(default_factory=dict)


Experiment = Callable[[DemoOptions], ExperimentResult]


def _rows_and_agreement(experiment: str, r: dict[str, Any], extra: str = "") -> tuple[list[Row], list[str]]:
    """The table rows of a two-variant run (see :func:`train_variants`) and its loss-agreement note."""
    rows = [
        Row(
            experiment,
            name,
            v["description"],
            v["test_accuracy"],
            v["final_loss"],
            v["ms_per_step"],
            v["speedup"],
            v.get("optimizer", ""),
        )
        for name, v in r["variants"].items()
    ]
    verdict = "yes" if r["losses_agree"] else "NO"
    notes = [
        f"{experiment}: loss curves agree: {verdict} (max |loss_torch - loss_cukit| = "
        f"{r['loss_max_abs_diff']:.2e} over {r['steps']} steps; tolerance {r['loss_tolerance']:.0e}{extra})"
    ]
    return rows, notes


def mlp_experiment(opts: DemoOptions) -> ExperimentResult:
    """The digits MLP, stock torch vs ``cukit.nn.BiasAct`` (see :func:`run_mlp`)."""
    r = run_mlp(
        epochs=opts.epochs or 15,
        batch_size=opts.batch_size,
        device=opts.device,
        seed=opts.seed,
        activation=opts.activation,
        log=opts.log,
    )
    rows, notes = _rows_and_agreement("mlp", r)
    title = (
        f"mlp: {'-'.join(map(str, r['sizes']))} MLP, {r['activation']}, {r['epochs']} epochs x "
        f"{r['steps'] // r['epochs']} steps of {r['batch_size']} ({r['n_train']} train / {r['n_test']} test "
        "digits), AdamW"
    )
    return ExperimentResult("mlp", title, rows, notes, ok=r["losses_agree"], data=r)


def cnn_experiment(opts: DemoOptions) -> ExperimentResult:
    """The digits CNN, stock torch vs ``cukit.nn.Conv2d`` + ``cukit.nn.Linear`` (see
    :func:`run_cnn`). Skipped, with a note, while those are not available."""
    why = cnn_missing()
    if why:
        return ExperimentResult("cnn", f"cnn: skipped ({why})", [], [f"cnn: skipped: {why}"], ok=True)
    r = run_cnn(
        epochs=opts.epochs or CNN_EPOCHS,
        batch_size=opts.batch_size,
        device=opts.device,
        seed=opts.seed,
        activation=opts.activation,
        log=opts.log,
    )
    rows, notes = _rows_and_agreement("cnn", r, "; float32 without TF32 on both sides")
    convs = ", ".join(f"conv3x3 {a}->{b}" for a, b in itertools.pairwise([1, *r["channels"]]))
    title = (
        f"cnn: 1x8x8 images, {convs} (pad 1, {r['activation']}), linear {r['channels'][-1] * 64}->10, "
        f"{r['epochs']} epochs x {r['steps'] // r['epochs']} steps of {r['batch_size']}, AdamW"
    )
    return ExperimentResult("cnn", title, rows, notes, ok=r["losses_agree"], data=r)


#: The demo's experiments, run in order. Each takes the options and returns an ExperimentResult.
EXPERIMENTS: dict[str, Experiment] = {"mlp": mlp_experiment, "cnn": cnn_experiment}


def format_table(rows: Sequence[Row]) -> str:
    """The comparison table as text: one line per row, columns aligned."""
    header = ("experiment", "variant", "model", "optimizer", "test acc", "train loss", "ms/step", "vs torch")
    lines = [
        (
            r.experiment,
            r.variant,
            r.description,
            r.optimizer,
            f"{r.test_accuracy:.2%}",
            f"{r.final_loss:.4f}",
            f"{r.ms_per_step:.3f}",
            f"{r.speedup:.2f}x",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [header, *lines]) for i in range(len(header))]
    left = 4  # text columns are left-aligned, numbers right-aligned

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(c) for c in lines)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cukit demo",
        description="Train the same small models with stock torch and with cukit's kernels; compare "
        "accuracy, loss and time per step.",
    )
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: 15 for the MLP, 10 for the CNN)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch size (default: 64)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when torch and CuPy both see a GPU, else CPU (default: auto)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the split, the weights and the batch order")
    p.add_argument(
        "--activation", choices=ACTIVATIONS, default="gelu", help="hidden activation (default: gelu)"
    )
    p.add_argument(
        "--backward-thread",
        choices=BACKWARD_THREADS,
        default="worker",
        help="where every variant's backward runs: worker (autograd's device thread, torch's default) or "
        "caller (the training loop's thread, torch.autograd.set_multithreading_enabled(False)) "
        "(default: worker)",
    )
    p.add_argument(
        "--quiet", action="store_true", help="print nothing; the exit status says whether the runs agree"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run every experiment in :data:`EXPERIMENTS` and print the comparison table.

    Returns 0 when every experiment's self-check passed (e.g. the loss curves agree), 1 when one
    failed, 2 for a usage error (such as ``--device cuda`` without a usable GPU).
    """
    args = _parser().parse_args(argv)
    out = (lambda _s: None) if args.quiet else print
    if args.epochs is not None and args.epochs < 1:
        print("cukit demo: --epochs must be >= 1", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print("cukit demo: --batch-size must be >= 1", file=sys.stderr)
        return 2
    try:
        device = resolve_device(args.device)
    except RuntimeError as e:
        print(f"cukit demo: {e}", file=sys.stderr)
        return 2
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    out(f"cukit {cukit.__version__} demo: stock torch vs cukit kernels")
    out(f"device: {device_label(device)} (torch {torch.__version__}{threads})")
    opts = DemoOptions(
        device=device,
        seed=args.seed,
        epochs=args.epochs,
        batch_size=args.batch_size,
        activation=args.activation,
        log=out,
    )
    results: list[ExperimentResult] = []
    # Thread-local; the same for every variant. A small model's step is host time, and autograd's
    # hand-off to its device thread and back costs a Python backward node (cukit's ops) far more than
    # a C++ one (the stock variant's): --backward-thread caller shows a step without it.
    with torch.autograd.set_multithreading_enabled(args.backward_thread == "worker"):
        for name, experiment in EXPERIMENTS.items():
            out(f"running {name} ...")
            try:
                results.append(experiment(opts))
            except ImportError as e:  # scikit-learn missing
                print(f"cukit demo: {e}", file=sys.stderr)
                return 1
    out("")
    for r in results:
        out(r.title)
    out("")
    out(format_table([row for r in results for row in r.rows]))
    out("")
    for r in results:
        for note in r.notes:
            out(note)
    out("vs torch: torch's median ms/step divided by this row's (> 1: faster); warm-up steps excluded;")
    out("ms/step is the whole training step, the optimizer's included.")
    out(BACKWARD_THREAD_NOTE[args.backward_thread])
    if device.type == "cpu":
        out(
            "On the CPU cukit (its ops and cukit.optim) runs its torch reference (no GPU): the fused kernels "
            "need --device cuda."
        )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
