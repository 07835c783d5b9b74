"""Fused bias + activation, ``cukit.bias_act(x, b, "gelu")``, against eager torch, ``F.gelu(x + b)``:
time and memory, forward and forward + backward.

Eager torch runs two kernels: ``x + b`` writes a full-size temporary that the activation reads
back, and for gelu and silu autograd keeps that temporary alive until the backward pass. cukit's
kernel reads x once and writes y once, and autograd keeps only the inputs (the backward
recomputes ``x + b``); its backward is one kernel for dx plus a deterministic column reduction for
db. For each activation the script first checks that both sides agree (outputs and gradients), then
prints:

- ``fwd ms`` and ``fwd+bwd ms``: median device time (CUDA events) or wall time on the CPU;
- ``fwd MiB`` and ``fwd+bwd MiB``: peak memory allocated above the inputs (CUDA only: torch's
  allocator statistics);
- ``saved MiB``: what autograd keeps for the backward beyond the inputs and the output (counted
  with ``torch.autograd.graph.saved_tensors_hooks``, on any device).

Run it::

    python examples/bias_act_vs_torch.py                         # on a GPU: 8192 x 8192 bfloat16
    python examples/bias_act_vs_torch.py --small                 # quick (the default on the CPU)
    python examples/bias_act_vs_torch.py --rows 4096 --cols 11008 --dtype float16

Without a GPU, cukit.bias_act runs its torch reference (the same maths, unfused): the CPU table
shows that the script works, not what the kernel gains.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import add_size_options, print_table, resolve_size, time_ms

import cukit

MIB = 2**20
EAGER: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
# Largest acceptable max |cukit - torch| relative to max |torch|, per dtype: one rounding of the
# result for the elementwise parts, a little more for db (a sum over every row in another order).
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def variants(activation: str) -> dict[str, Fn]:
    act = EAGER[activation]
    return {
        "torch": lambda x, b: act(x + b),
        "cukit": lambda x, b: cukit.bias_act(x, b, activation),
    }


def forward_backward(fn: Fn, x: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> None:
    x.grad = b.grad = None
    fn(x, b).backward(g)


def peak_mib(work: Callable[[], object], device: str) -> str:
    """Peak memory allocated while ``work()`` runs and its result lives, above what was allocated
    before; "n/a" on the CPU (torch keeps no statistics there)."""
    if device != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = work()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return f"{peak / MIB:.0f}"


def saved_mib(fn: Fn, x: torch.Tensor, b: torch.Tensor) -> float:
    """MiB of the tensors autograd saves for the backward, leaving out the inputs' and the
    output's storage (those are alive anyway)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, b)
    for t in (x, b, y):
        saved.pop(t.untyped_storage().data_ptr(), None)
    return sum(saved.values()) / MIB


def max_rel_diff(fn: Fn, ref: Fn, x: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> float:
    """max |fn - ref| / max |ref| over the output, dx and db."""
    results = []
    for f in (fn, ref):
        x.grad = b.grad = None
        y = f(x, b)
        y.backward(g)
        results.append((y.detach(), x.grad, b.grad))
    x.grad = b.grad = None
    worst = 0.0
    for got, want in zip(*results, strict=True):
        scale = want.abs().max().float().clamp_min(1e-30)
        worst = max(worst, ((got.float() - want.float()).abs().max() / scale).item())
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser)
    parser.add_argument("--rows", type=int, default=None, help="rows of x (default: 8192; --small: 256)")
    parser.add_argument("--cols", type=int, default=None, help="columns of x, the bias length (default: 8192; --small: 1024)")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--activations", default="relu,gelu,gelu_tanh,silu", help="comma-separated (default: all four)")
    args = parser.parse_args(argv)
    device, small = resolve_size(args)
    rows = args.rows or (256 if small else 8192)
    cols = args.cols or (1024 if small else 8192)
    dtype_name = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    warmup, repeats = (1, 3) if small else (5, 30)
    activations = args.activations.split(",")
    unknown = [a for a in activations if a not in EAGER]
    if unknown:
        parser.error(f"unknown activation(s) {', '.join(unknown)}; choose from {', '.join(EAGER)}")

    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(cols, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, cols, device=device, dtype=dtype)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"bias + activation on {where}: x {rows} x {cols} {dtype_name} ({x.numel() * x.element_size() / MIB:.0f} MiB), "
          f"median of {repeats}")

    table = []
    ok = True
    for activation in activations:
        fns = variants(activation)
        diff = max_rel_diff(fns["cukit"], fns["torch"], x, b, g)
        agree = diff <= TOLERANCE[dtype_name]
        ok &= agree
        base: dict[str, float] = {}
        for name, fn in fns.items():
            fwd = time_ms(lambda fn=fn: fn(x, b), device, warmup=warmup, repeats=repeats)
            both = time_ms(lambda fn=fn: forward_backward(fn, x, b, g), device, warmup=warmup, repeats=repeats)
            base.setdefault("fwd", fwd)
            base.setdefault("both", both)
            table.append([
                activation,
                name,
                f"{fwd:.3f}",
                f"{both:.3f}",
                f"{base['fwd'] / fwd:.2f}x",
                f"{base['both'] / both:.2f}x",
                peak_mib(lambda fn=fn: fn(x, b), device),
                peak_mib(lambda fn=fn: forward_backward(fn, x, b, g), device),
                f"{saved_mib(fn, x, b):.1f}",
                f"{diff:.1e}" if name == "cukit" else "",
            ])
            x.grad = b.grad = None
    print()
    print_table(
        ["activation", "variant", "fwd ms", "fwd+bwd ms", "fwd vs torch", "f+b vs torch", "fwd MiB",
         "fwd+bwd MiB", "saved MiB", "max rel diff"],
        table,
        left=2,
    )
    print()
    print("torch: F.<act>(x + b); cukit: cukit.bias_act(x, b, act). vs torch: torch's time over this row's "
          "(> 1: faster).")
    print(f"outputs and gradients agree within {TOLERANCE[dtype_name]:.0e} (relative): {'yes' if ok else 'NO'}")
    if device != "cuda":
        print("On the CPU cukit.bias_act runs its torch reference (no fused kernel) and peak memory is not "
              "tracked: run on a GPU for the real comparison.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
