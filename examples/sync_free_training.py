"""Sync-free training: the classic loop without a ``.item()`` per step.

The usual loop reads its running loss with ``loss.item()`` and checks ``torch.isfinite(loss)``
with a Python ``if``. Each read makes the CPU wait until the GPU has finished everything queued so
far, so the CPU cannot queue step n+1 while step n runs; for a small model the GPU then idles most
of the time. This script trains the same MLP four ways and prints, for each, the time per step,
the host syncs per step (counted with ``torch.cuda.set_sync_debug_mode("warn")``), the final
running loss (they train the same) and how many steps were skipped (one sample of the data set is
NaN: every variant must skip the steps whose batch holds it).

1. naive: blocking copies, ``if not torch.isfinite(loss)``, ``loss.item()`` every step;
2. device-side: ``cukit.train.RunningMean`` and ``NonFiniteGuard`` (the NaN step is skipped on the
   GPU, the mean read only when logged);
3. + pinned memory and ``non_blocking=True`` copies;
4. + the whole step captured in a CUDA graph (``cukit.train.capture_step``): one launch per step.

    python examples/sync_free_training.py               # on CUDA: the four variants
    python examples/sync_free_training.py --steps 50    # fewer steps

Without CUDA it runs variants 1 and 2 on the CPU (there is nothing to sync with there) and says
that the rest needs a GPU.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cukit.optim
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cukit
from cukit.train import NonFiniteGuard, RunningMean, capture_step

FEATURES, HIDDEN, CLASSES = 64, 256, 10
LR, MOMENTUM = 0.05, 0.9


@dataclass
class Config:
    warmup: int = 20  # untimed steps first (every variant trains the same steps on the same batches)
    steps: int = 300  # then timed steps
    sync_steps: int = 100  # then steps in sync debug mode, counting host syncs (a multiple of log_every)
    batch_size: int = 256
    samples: int = 8192
    log_every: int = 50  # variants 2-4 read their running loss (one sync) this often


@dataclass
class Result:
    name: str
    ms_per_step: float
    syncs_per_step: float | None  # None on the CPU: there is no device to wait for
    final_loss: float  # the running loss of the last logging window
    skipped: int


# ------------------------------------------------------------------------------ data and model


def make_data(samples: int) -> TensorDataset:
    """A learnable 10-class problem (labels from a random linear teacher) with one NaN sample."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    x[samples // 3, 5] = float("nan")  # the batch that holds it has a NaN loss: skip that step
    return TensorDataset(x, y)


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # every variant starts from the same weights
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, CLASSES),
    ).to(device)


def batches(data: TensorDataset, cfg: Config, pin_memory: bool) -> Iterator[list[torch.Tensor]]:
    """Shuffled batches forever, in the same order for every variant. drop_last: a CUDA graph
    replays one batch shape."""
    loader = DataLoader(
        data,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(1),
    )
    while True:
        yield from loader


# ------------------------------------------------------------------------------ measuring


class SyncCounter:
    """Counts host syncs in a block: torch warns on each one in sync debug mode "warn"."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.count = 0

    def __enter__(self) -> SyncCounter:
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._catcher = warnings.catch_warnings(record=True)
            self._log = self._catcher.__enter__()
            warnings.simplefilter("always")  # record every sync, not only the first per line
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.count = sum("synchroniz" in str(w.message) for w in self._log)
            self._catcher.__exit__(*exc)
            torch.cuda.set_sync_debug_mode(self._mode)


def measure(
    step: Callable[[torch.Tensor, torch.Tensor, int], None], data: Iterator, device: torch.device, cfg: Config
) -> tuple[float, float | None]:
    """Runs ``step(x, y, i)`` on cfg.warmup batches, then on cfg.steps batches timed, then on
    cfg.sync_steps batches counting host syncs (apart from the timing: every sync then costs a
    Python warning). Returns (ms per step, syncs per step)."""
    for i in range(cfg.warmup):
        step(*next(data), i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(cfg.warmup, cfg.warmup + cfg.steps):
        step(*next(data), i)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the queued work belongs to the timed steps
    ms = (time.perf_counter() - t0) * 1e3 / cfg.steps
    first = cfg.warmup + cfg.steps
    with SyncCounter(device) as syncs:
        for i in range(first, first + cfg.sync_steps):
            step(*next(data), i)
    return ms, (syncs.count / cfg.sync_steps if syncs.cuda and cfg.sync_steps else None)


def is_log_step(i: int, cfg: Config) -> bool:
    return (i + 1) % cfg.log_every == 0


# ------------------------------------------------------------------------------ the four loops


def naive(data: TensorDataset, device: torch.device, cfg: Config) -> Result:
    model = make_model(device)
    opt = cukit.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    total, count, skipped, logged = 0.0, 0, 0, [float("nan")]

    def step(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        nonlocal total, count, skipped
        x, y = x.to(device), y.to(device)  # blocking copies: 2 syncs
        loss = F.cross_entropy(model(x), y)
        if not torch.isfinite(loss):  # the NaN check: 1 sync
            skipped += 1
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()  # the running loss: 1 sync
            count += 1
        if is_log_step(i, cfg):
            logged.append(total / max(count, 1))
            total, count = 0.0, 0

    ms, syncs = measure(step, batches(data, cfg, pin_memory=False), device, cfg)
    return Result("1 naive: .item(), isfinite, blocking copies", ms, syncs, logged[-1], skipped)


def device_side(data: TensorDataset, device: torch.device, cfg: Config, *, pinned: bool = False) -> Result:
    model = make_model(device)
    opt = cukit.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    running = RunningMean()  # sums on the device
    guard = NonFiniteGuard(opt)  # a NaN/inf loss or gradient skips the step on the device
    logged = [float("nan")]

    def step(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        x, y = x.to(device, non_blocking=pinned), y.to(device, non_blocking=pinned)
        loss = F.cross_entropy(model(x), y)
        # set_to_none=False keeps the gradient tensors: cukit.optim's tensor tables stay valid
        opt.zero_grad(set_to_none=False)
        loss.backward()
        guard.step(loss)
        running.update(loss, weight=guard.finite)  # a skipped step has weight 0
        if is_log_step(i, cfg):
            logged.append(running.read(reset=True))  # the only sync, when logging

    ms, syncs = measure(step, batches(data, cfg, pin_memory=pinned), device, cfg)
    name = "3 + pinned memory, non_blocking copies" if pinned else "2 RunningMean + NonFiniteGuard"
    return Result(name, ms, syncs, logged[-1], guard.skipped())


def graphed(data: TensorDataset, device: torch.device, cfg: Config) -> Result:
    model = make_model(device)
    opt = cukit.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    running = RunningMean()
    guard = NonFiniteGuard(opt)
    x0, y0 = data.tensors[0][: cfg.batch_size], data.tensors[1][: cfg.batch_size]  # shapes and dtypes
    # warm-up (which trains nothing) and capture of zero_grad + forward + backward + guarded step
    # + running.update, replayed by one launch per call
    train_step = capture_step(
        model, F.cross_entropy, opt, (x0.to(device), y0.to(device)), metrics=running, guard=guard
    )
    logged = [float("nan")]

    def step(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        train_step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        if is_log_step(i, cfg):
            logged.append(running.read(reset=True))

    ms, syncs = measure(step, batches(data, cfg, pin_memory=True), device, cfg)
    return Result("4 + CUDA graph (capture_step)", ms, syncs, logged[-1], guard.skipped())


# ------------------------------------------------------------------------------ main


def default_config(device: torch.device) -> Config:
    if device.type == "cuda":
        return Config()
    return Config(warmup=10, steps=40, sync_steps=0, log_every=10)  # a CPU step takes milliseconds


def main(cfg: Config | None = None, device: torch.device | str | None = None) -> list[Result]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() and cukit.is_available() else "cpu"
    device = torch.device(device)
    cfg = cfg or default_config(device)
    data = make_data(cfg.samples)
    results = [naive(data, device, cfg), device_side(data, device, cfg)]
    if device.type == "cuda":
        results += [device_side(data, device, cfg, pinned=True), graphed(data, device, cfg)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    counted = (
        f"syncs/step over {cfg.sync_steps}" if device.type == "cuda" else "syncs are counted on CUDA only"
    )
    print(
        f"{cfg.warmup + cfg.steps + cfg.sync_steps} steps of a {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} MLP, "
        f"batch {cfg.batch_size}, on {where}; ms/step over {cfg.steps} steps, {counted}"
    )
    print(f"{'variant':<44} {'ms/step':>8} {'syncs/step':>11} {'final loss':>11} {'skipped':>8}")
    for r in results:
        syncs = "n/a" if r.syncs_per_step is None else f"{r.syncs_per_step:.2f}"
        print(f"{r.name:<44} {r.ms_per_step:>8.3f} {syncs:>11} {r.final_loss:>11.5f} {r.skipped:>8}")
    if device.type != "cuda":
        print("variants 3 and 4 (pinned memory, non_blocking copies, CUDA graphs) need a CUDA GPU with CuPy")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args()
    dev = torch.device(
        args.device or ("cuda" if torch.cuda.is_available() and cukit.is_available() else "cpu")
    )
    config = default_config(dev)
    if args.steps is not None:
        config.steps = args.steps
    main(config, dev)
