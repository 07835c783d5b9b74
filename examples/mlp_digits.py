"""Drop ``cukit.nn.BiasAct`` and ``cukit.optim.AdamW`` into your own training script.

``Linear(bias=False) + BiasAct`` replaces ``Linear + activation`` and fuses the bias add with the
activation (one kernel on CUDA, forward and backward); ``cukit.optim.AdamW`` replaces
``torch.optim.AdamW`` with the same arguments and updates every parameter in one launch. The script
trains the same MLP on scikit-learn's digits twice, from the same weights on the same batches, once
stepping with ``torch.optim.AdamW`` and once with ``cukit.optim.AdamW``, and prints both loss and
accuracy curves side by side: the optimizers compute the same update, so the curves agree to
rounding. ``cukit demo`` times the whole comparison against stock torch.

Run it (needs scikit-learn for the data: ``pip install 'cukit[demo]'``)::

    python examples/mlp_digits.py                  # on a GPU: 10 epochs
    python examples/mlp_digits.py --small          # 3 epochs (the default on the CPU)
    python examples/mlp_digits.py --device cpu --epochs 5
"""

from __future__ import annotations

import argparse
import sys

import cukit.optim
import torch
import torch.nn.functional as F
from _common import add_size_options, print_table, resolve_size
from torch import nn

import cukit
import cukit.nn
from cukit.demo import Digits, device_label, load_digits


def make_model(device: str) -> nn.Sequential:
    torch.manual_seed(0)  # both runs start from the same weights
    return nn.Sequential(
        nn.Linear(64, 256, bias=False),  # the bias lives in BiasAct ...
        cukit.nn.BiasAct(256, "gelu"),  # ... y = gelu(x + bias), one fused kernel
        nn.Linear(256, 256, bias=False),
        cukit.nn.BiasAct(256, "gelu"),
        nn.Linear(256, 10),
    ).to(device)


def train(model: nn.Module, opt: torch.optim.Optimizer, data: Digits, epochs: int) -> list[tuple[float, float]]:
    """(mean training loss, test accuracy) after each epoch. The batch order comes from a fixed
    seed, so every run sees the same batches."""
    order = torch.Generator().manual_seed(1)
    curve = []
    for _ in range(epochs):
        model.train()
        losses = []
        for idx in torch.randperm(len(data.x_train), generator=order).split(64):
            idx = idx.to(data.x_train.device)
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())  # read once per epoch: no host sync per step
        model.eval()
        with torch.no_grad():
            accuracy = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        curve.append((torch.stack(losses).mean().item(), accuracy))
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser)
    parser.add_argument("--epochs", type=int, default=None, help="default: 10 on a GPU, 3 with --small or on the CPU")
    args = parser.parse_args(argv)
    device, small = resolve_size(args)
    epochs = args.epochs or (3 if small else 10)
    data = load_digits(device, seed=0)  # standardised 8x8 digits, 80/20 split, as tensors on `device`

    curves = {}
    for name, optimizer in (("torch.optim", torch.optim.AdamW), ("cukit.optim", cukit.optim.AdamW)):
        model = make_model(device)
        opt = optimizer(model.parameters(), lr=1e-3, weight_decay=1e-2)
        curves[name] = train(model, opt, data, epochs)

    print(f"64-256-256-10 MLP (Linear + cukit.nn.BiasAct gelu) on digits, AdamW lr 1e-3, on {device_label(torch.device(device))}")
    print()
    rows = []
    for epoch, ((t_loss, t_acc), (c_loss, c_acc)) in enumerate(zip(curves["torch.optim"], curves["cukit.optim"], strict=True)):
        rows.append([epoch + 1, f"{t_loss:.4f}", f"{c_loss:.4f}", f"{t_acc:.2%}", f"{c_acc:.2%}"])
    print_table(["epoch", "loss torch.optim", "loss cukit.optim", "acc torch.optim", "acc cukit.optim"], rows)
    diff = max(abs(t[0] - c[0]) for t, c in zip(curves["torch.optim"], curves["cukit.optim"], strict=True))
    agree = diff <= 1e-3
    print()
    print(f"loss curves agree (max |difference| {diff:.1e} <= 1e-3): {'yes' if agree else 'NO'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
