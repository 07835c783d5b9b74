"""cukit's matmul kernels inside a small CNN: the classic 32x32 tiled kernel ("v1"), the
register-blocked SIMT kernel and the tensor-core kernel, against stock torch (cuDNN/cuBLAS).

The model is ``cukit demo``'s CNN (:func:`cukit.demo.cnn_models`): 3x3 convolutions (padding 1)
with an activation, then a linear classifier. The torch twin uses ``nn.Conv2d`` + the activation +
``nn.Linear``; the cukit twin computes each convolution as im2col + one GEMM
(:class:`cukit.demo.MatmulConv2d`: ``F.unfold``, ``cukit.matmul``, ``cukit.bias_act``) and the
classifier with ``cukit.nn.Linear``. Every row trains the same model from the same weights on the
same synthetic batches (images of noise, labels from a fixed random linear teacher), and steps
with ``cukit.optim.AdamW``, so the rows differ only in who runs the convolutions and the linear
layer:

- ``torch``: float32 (TF32 off); ``torch tf32``: cuDNN and cuBLAS allowed to use TF32;
- ``cukit v1``: ``matmul_v1``, 32x32 shared-memory tiles, one output per thread (the readable one);
- ``cukit simt``: register-blocked (each thread computes a tile of outputs from registers, operands
  double-buffered through shared memory);
- ``cukit tc``: tensor cores (mma.sync) in TF32, ``cukit.set_matmul_precision("tf32")``.

The table gives the time per training step, the matmul throughput it implies (the step's GEMM
flops, forward and backward, over the whole step's time) and how far each row's loss curve is from
torch's (float32 rows within 1e-3, TF32 rows within 5e-2).

Run it::

    python examples/cnn_matmul_kernels.py                     # on a GPU: 16x16 images, 512 per batch
    python examples/cnn_matmul_kernels.py --small             # quick (the default on the CPU)
    python examples/cnn_matmul_kernels.py --image 32 --channels 64,128 --batch 128

A kernel is chosen with ``cukit.ops.matmul.force_kernel("simt_v1" | "simt" | "tc")`` around the
step (the benchmarks' switch, not public API; without it cukit picks by dtype and shape). On the CPU
every cukit row runs the same torch fallback (there is no kernel to choose): the run checks the
script, not the kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import cukit.optim
import torch
import torch.nn.functional as F
from _common import add_size_options, print_table, resolve_size, time_ms
from torch import nn

import cukit
from cukit.demo import CNN_LOSS_TOLERANCE, cnn_models
from cukit.ops.matmul import force_kernel

TF32_LOSS_TOLERANCE = 5e-2  # TF32 rounds every operand to 10 mantissa bits: curves drift apart faster


@dataclass(frozen=True)
class Variant:
    name: str
    kernel: str  # what runs the convolutions and the linear layer
    cukit: bool  # the cukit twin (else torch's model)
    tf32: bool
    force: str | None = None  # force_kernel's argument


VARIANTS = [
    Variant("torch", "cuDNN / cuBLAS, float32", cukit=False, tf32=False),
    Variant("torch tf32", "cuDNN / cuBLAS, TF32", cukit=False, tf32=True),
    Variant("cukit v1", "matmul_v1: 32x32 tiles", cukit=True, tf32=False, force="simt_v1"),
    Variant("cukit simt", "matmul_simt: register-blocked", cukit=True, tf32=False, force="simt"),
    Variant("cukit tc", "matmul_tc: tensor cores, TF32", cukit=True, tf32=True, force="tc"),
]


@contextlib.contextmanager
def precision(tf32: bool) -> Iterator[None]:
    """TF32 on or off for torch's convolutions and matmuls and for cukit's float32 matmuls;
    restored on exit."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, cukit.get_matmul_precision())
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    cukit.set_matmul_precision("tf32" if tf32 else "ieee")
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:2]
        cukit.set_matmul_precision(saved[2])


def gemm_flops(batch: int, image: int, channels: list[int], classes: int = 10) -> int:
    """Multiply-adds x 2 of one training step's GEMMs: each convolution as im2col (M = batch x
    pixels, K = in_channels x 9, N = out_channels), forward, weight gradient and, except for the
    first layer (its input needs no gradient), input gradient; the linear layer likewise."""
    pixels = image * image
    flops = 0
    for i, (cin, cout) in enumerate(zip([1, *channels], channels, strict=False)):
        flops += (2 if i == 0 else 3) * 2 * batch * pixels * cin * 9 * cout
    return flops + 3 * 2 * batch * channels[-1] * pixels * classes


def synthetic_batches(n: int, batch: int, image: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of flat noise images (batch, image*image) with labels from a random linear
    teacher: a learnable task, the same for every row."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(image * image, 10, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(batch, image * image, generator=g)
        out.append((x.to(device), (x @ teacher).argmax(1).to(device)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser)
    parser.add_argument("--image", type=int, default=None, help="image side (default: 16; --small: 8)")
    parser.add_argument("--channels", default=None, help="conv output channels (default: 32,64; --small: 4,8)")
    parser.add_argument("--batch", type=int, default=None, help="images per batch (default: 512; --small: 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default: 20; --small: 3)")
    parser.add_argument("--activation", default="relu", choices=("relu", "gelu", "gelu_tanh", "silu"))
    args = parser.parse_args(argv)
    device, small = resolve_size(args)
    image = args.image or (8 if small else 16)
    channels = [int(c) for c in (args.channels or ("4,8" if small else "32,64")).split(",")]
    batch = args.batch or (16 if small else 512)
    steps = args.steps or (3 if small else 20)
    warmup = 3 if small else 5  # the first cukit steps compile kernels
    data = synthetic_batches(4, batch, image, device)
    stock, twin = cnn_models(args.activation, channels=channels, image=(image, image), device=device, seed=0,
                              conv="im2col")
    flops = gemm_flops(batch, image, channels)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    convs = ", ".join(f"conv3x3 {a}->{b}" for a, b in zip([1, *channels], channels, strict=False))
    print(f"CNN on {where}: {image}x{image} images, {convs} ({args.activation}), linear "
          f"{channels[-1] * image * image}->10; batch {batch}; cukit.optim.AdamW; median of {steps} steps "
          f"after {warmup} warm-up")

    rows = []
    curves: dict[str, list[float]] = {}
    base_ms = 0.0
    ok = True
    for v in VARIANTS:
        model = copy.deepcopy(twin if v.cukit else stock)
        opt = cukit.optim.AdamW(model.parameters(), lr=1e-3)
        losses: list[torch.Tensor] = []

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt, losses: list = losses) -> None:
            x, y = data[len(losses) % len(data)]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())

        force = force_kernel(v.force) if device == "cuda" else contextlib.nullcontext()
        with precision(v.tf32), force:
            ms = time_ms(step, device, warmup=warmup, repeats=steps)
        curves[v.name] = torch.stack(losses).tolist()
        diff = max(abs(a - b) for a, b in zip(curves[v.name], curves["torch"], strict=True))
        tolerance = TF32_LOSS_TOLERANCE if v.tf32 else CNN_LOSS_TOLERANCE
        ok &= diff <= tolerance
        base_ms = base_ms or ms
        kernel = v.kernel if device == "cuda" else ("torch's CPU fallback" if v.cukit else "torch on the CPU")
        rows.append([v.name, kernel, f"{ms:.3f}", f"{base_ms / ms:.2f}x", f"{flops / ms / 1e9:.3g}",
                     f"{curves[v.name][-1]:.4f}", f"{diff:.1e}", "yes" if diff <= tolerance else "NO"])
    print()
    print_table(["variant", "matmul", "ms/step", "vs torch", "GEMM TFLOP/s", "last loss", "max |dloss|",
                 "agrees"], rows, left=2)
    print()
    print(f"GEMM TFLOP/s: the step's {flops / 1e9:.3g} GFLOP of GEMMs (forward and backward) over the whole "
          "step's time, optimizer and im2col included. max |dloss|: largest difference from torch's loss "
          f"over the {warmup + steps} steps.")
    if device != "cuda":
        print("On the CPU every cukit row runs the same torch fallback (no kernel to choose) and TF32 does not "
              "apply: run on a GPU to compare the kernels.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
