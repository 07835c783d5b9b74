"""AdamW four ways: a Python for-loop over the parameters, torch's foreach, torch's fused and
``cukit.optim.AdamW``; kernel launches per step and milliseconds per step as the number of tensors
grows.

Why the number of tensors matters. A CUDA kernel's arguments travel in a small parameter buffer:
4 KB classically (32 KB on CUDA 12.1+ drivers with Volta or newer GPUs, which torch's CUDA 13 builds
use). torch's multi-tensor apply, like apex's, passes the tensors' addresses *by value* in that
buffer, so one launch can take only so many tensors and so many 64K-element chunks: for AdamW's four
lists (param, grad, exp_avg, exp_avg_sq) 36 tensors and 320 chunks in 4 KB (252 and 2240 in 32 KB),
and the list is split over several launches. ``cukit.optim`` writes the addresses once into a table
in device memory and passes one pointer to it: one update launch covers any number of tensors (plus
one small launch that counts the step).

For each parameter set (N tensors of S elements, float32) the table shows:

- ``launches`` counted with ``torch.profiler`` on the GPU (``n/a`` on the CPU);
- ``pred 4KB`` / ``pred 32KB``: what torch's chunking rule predicts for the fused step (its
  ``_foreach_add_`` of the step counters plus the fused kernel), and cukit's two launches;
- ``ms/step``: median time of ``opt.step()`` with fixed gradients.

Every variant starts from the same parameters and gradients; their first steps are compared
before anything is timed.

Run it::

    python examples/optimizer_launches.py                      # on a GPU: 16 to 4000 tensors
    python examples/optimizer_launches.py --small              # quick (the default on the CPU)
    python examples/optimizer_launches.py --sets 148x65536,10000x256

On the CPU there are no launches to count (torch runs its CPU loops, cukit.optim its plain-torch
reference); the predictions still show how the tensor count drives torch's launch count.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import cukit.optim
import torch
from _common import add_size_options, print_table, resolve_size, time_ms

LR, WEIGHT_DECAY = 1e-3, 1e-2
CHUNK = 65536  # torch's kChunkSize: elements per block of a multi-tensor launch
# torch's per-launch limits (aten/src/ATen/native/cuda/MultiTensorApply.cuh), indexed by the number
# of tensor lists: (max tensors, max chunks) for a 4 KB and a 32 KB parameter buffer.
LIMITS = {
    "4KB": {1: (110, 320), 4: (36, 320)},
    "32KB": {1: (770, 2240), 4: (252, 2240)},
}
FULL_SETS = "16x4194304,148x65536,1000x16384,4000x4096"
SMALL_SETS = "8x1024,200x64"

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
VARIANTS: dict[str, Factory] = {
    "torch for-loop": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False),
    "torch foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True),
    "torch fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
    "cukit.optim": lambda ps: cukit.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY),
}


def multi_tensor_launches(numels: Sequence[int], max_tensors: int, max_chunks: int) -> int:
    """Launches torch's multi_tensor_apply makes for tensors of these sizes: a launch whenever the
    tensors or the chunks of the current one are full (a tensor whose chunks straddle two launches
    counts in both), plus one for the rest. Empty tensors are skipped."""
    launches = tensors = chunks = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        per_tensor = -(-n // CHUNK)
        for c in range(per_tensor):
            chunks += 1
            last = c == per_tensor - 1
            if (tensors == max_tensors and last) or chunks == max_chunks:
                launches += 1
                chunks = 0
                tensors = 0 if last else 1
    return launches + (chunks > 0)


def predicted(variant: str, numels: Sequence[int], table: str) -> str:
    if variant == "torch fused":
        steps = multi_tensor_launches([1] * len(numels), *LIMITS[table][1])  # _foreach_add_(steps, 1)
        return str(steps + multi_tensor_launches(numels, *LIMITS[table][4]))  # _fused_adamw_
    if variant == "cukit.optim":
        return "2"  # the step counter and the update, whatever the number of tensors
    return ""  # several launches per tensor or per foreach op: counted on the GPU


def count_launches(step: Callable[[], object]) -> str:
    """Kernels one call of ``step`` runs on the GPU (copies and memsets left out), counted by
    torch.profiler, which sees CuPy's launches too (CUPTI records every kernel of the process)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [
        e for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return str(len(kernels))


def parse_sets(text: str) -> list[tuple[int, int]]:
    """"16x4096,148x65536" -> [(16, 4096), (148, 65536)]; ValueError for anything else."""
    sets = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    if any(len(s) != 2 or s[0] < 1 or s[1] < 1 for s in sets):
        raise ValueError(text)
    return [(s[0], s[1]) for s in sets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_options(parser)
    parser.add_argument("--sets", default=None,
                        help=f"parameter sets NxSIZE: N tensors of SIZE elements (default: {FULL_SETS}; "
                             f"--small: {SMALL_SETS})")
    args = parser.parse_args(argv)
    device, small = resolve_size(args)
    try:
        sets = parse_sets(args.sets or (SMALL_SETS if small else FULL_SETS))
    except ValueError:
        parser.error(f"--sets: expected NxSIZE[,NxSIZE...] with positive integers; got {args.sets!r}")
    warmup, repeats = (1, 3) if small else (3, 20)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    build = torch.version.cuda
    applies = ("32KB" if int(build.split(".")[0]) >= 13 else "4KB") if build else None
    print(f"AdamW step (lr {LR}, weight decay {WEIGHT_DECAY}) on {where}, float32, fixed gradients; "
          f"median of {repeats} steps")

    rows = []
    ok = True
    for n, size in sets:
        gen = torch.Generator().manual_seed(n)
        init = [torch.randn(size, generator=gen) for _ in range(n)]
        grads = [torch.randn(size, generator=gen) for _ in range(n)]
        numels = [size] * n
        reference: list[torch.Tensor] | None = None
        base_ms = None
        for name, make in VARIANTS.items():
            params = [torch.nn.Parameter(t.to(device, copy=True)) for t in init]  # init stays unchanged
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(device, copy=True)
            opt = make(params)
            opt.step()  # creates the state (and compiles cukit's kernels): not timed
            if reference is None:
                reference = [p.detach().clone() for p in params]
            else:
                ok &= all(torch.allclose(p, r, rtol=1e-5, atol=1e-6) for p, r in zip(params, reference, strict=True))
            launches = count_launches(opt.step) if device == "cuda" else "n/a"
            ms = time_ms(opt.step, device, warmup=warmup, repeats=repeats)
            base_ms = base_ms or ms
            rows.append([f"{n} x {size}", name, launches, predicted(name, numels, "4KB"),
                         predicted(name, numels, "32KB"), f"{ms:.3f}", f"{base_ms / ms:.1f}x"])
            del opt, params
    print()
    print_table(["tensors", "variant", "launches", "pred 4KB", "pred 32KB", "ms/step", "vs for-loop"], rows, left=2)
    print()
    print("launches: kernels per step counted by torch.profiler; pred: torch's chunking rule for the fused step "
          f"(at most {LIMITS['4KB'][4][0]} tensors / {LIMITS['4KB'][4][1]} chunks of {CHUNK} per launch in 4 KB, "
          f"{LIMITS['32KB'][4][0]} / {LIMITS['32KB'][4][1]} in 32 KB) and cukit's two launches.")
    if applies:
        print(f"This torch build (CUDA {build}) uses the {applies} limits.")
    print(f"first steps agree with the for-loop's: {'yes' if ok else 'NO'}")
    if device != "cuda":
        print("On the CPU nothing launches: torch runs its CPU loops and cukit.optim its plain-torch reference. "
              "Run on a GPU to count launches and time the fused kernels.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
