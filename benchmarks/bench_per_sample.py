"""Benchmark ``cukit.per_sample_grads``, ``cukit.per_sample_grad_norms`` and one-pass DP-SGD
(``cukit.dp.clip_and_accumulate``) against torch.func and plain (non-private) training.

Usage::

    python benchmarks/bench_per_sample.py [--out DIR] [--quick] [--dry-run] [--budget-s S] [--dtypes float32,bfloat16]

Models (issue 12, item 3), batch 256:

- ``mlp``: 784-512-512-10, ReLU;
- ``cnn``: Opacus' MNIST CNN (Conv 1->16 k8 s2 p3, MaxPool 2/1, Conv 16->32 k4 s2, MaxPool 2/1,
  Linear 512->32, Linear 32->10) on 1x28x28;
- ``seq``: a sequence MLP on (B, T=64, 256) tokens: LayerNorm, Linear 256->1024 gelu, Linear
  1024->256, Linear 256->10 (per-sample grads summed over T; ghost norms by Gram matrices).

Rows per model and dtype ("impl"): ``plain`` (loss.backward(), the non-private reference),
``vmap grads`` (torch.func.vmap(grad)), ``cukit grads`` (per_sample_grads), ``vmap norms`` (vmap
grads then their norms), ``cukit norms`` (per_sample_grad_norms: ghost norms), ``vmap dp step``
(vmap grads, explicit clipping, sum, noise), ``cukit dp step`` (clip_and_accumulate with noise:
one forward + one backward pass). Each forward + loss + backward is timed whole (CUDA events,
median of repeats, no L2 flush: the model's working set is what it is) with its peak memory above
the model and inputs (``torch.cuda.max_memory_allocated``; the base is taken with every ``.grad``
cleared, so a row that makes parameter gradients counts them, and none is credited with freeing
an earlier row's). Ratios: ``vs plain`` = plain / this
(the brief's "x the speed of non-private training"), ``vs vmap`` = vmap's time / this for the same
quantity.

Every cukit row is validated against its torch.func counterpart first (relative error of the
stacked per-sample grads, of the norms, of the clipped sum with noise 0). ``--dry-run`` runs the
same code on the CPU with batch 8 (numbers mean nothing) so the code paths are tested in CI.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_per_sample from the repository root
    from benchmarks import harness

NAME = "bench_per_sample"
MODELS = ("mlp", "cnn", "seq")
COLUMNS = [("model", "model"), ("dtype", "dtype"), ("impl", "impl"), ("ms", "ms"), ("peak_mib", "peak MiB"),
           ("vs_plain", "vs plain"), ("vs_vmap", "vs vmap"), ("err", "rel err"), ("error", "error")]


@dataclass(frozen=True)
class Config:
    device: str = "cuda"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    models: tuple[str, ...] = MODELS
    batch: int = 256
    warmup: int = 3
    repeats: int = 20
    budget_s: float | None = None
    out: str | None = None
    dry_run: bool = False
    seed: int = 0


@dataclass
class Bench(harness.RunState):
    cfg: Config = field(default_factory=Config)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")


def build(name: str, dtype: Any, device: str, B: int) -> tuple[Any, Any, Any]:
    """(model, inputs, targets) of one benchmark model."""
    import torch
    from torch import nn

    import cukit.nn as cnn

    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x = torch.randn(B, 784, generator=g)
        y = torch.randint(0, 10, (B,), generator=g)
    elif name == "cnn":
        m = nn.Sequential(
            nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10),
        )
        x = torch.randn(B, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (B,), generator=g)
    else:
        T = 64 if B >= 64 else 4
        m = nn.Sequential(nn.LayerNorm(256), cnn.Linear(256, 1024, activation="gelu"), nn.Linear(1024, 256),
                          nn.Linear(256, 10))
        x = torch.randn(B, T, 256, generator=g)
        y = torch.randint(0, 10, (B, T), generator=g)
    m = m.to(device=device, dtype=dtype)
    return m, x.to(device=device, dtype=dtype), y.to(device)


def loss_sum(out: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


def vmap_grads(model: Any, x: Any, y: Any) -> dict[str, Any]:
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_i(p: dict, xi: Any, yi: Any) -> Any:
        return loss_sum(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, x, y)


def vmap_dp_step(model: Any, x: Any, y: Any, C: float, sigma: float, gen: Any) -> None:
    """The explicit DP-SGD step: per-sample grads, norms, clip, sum, noise, average into .grad."""
    import torch

    ps = vmap_grads(model, x, y)
    norms = torch.sqrt(sum(v.float().flatten(1).square().sum(1) for v in ps.values()))
    f = torch.clamp(C / (norms + 1e-6), max=1.0)
    for k, p in model.named_parameters():
        s = torch.einsum("i,i...->...", f, ps[k].float())
        if sigma:
            s = s + sigma * C * torch.randn(s.shape, generator=gen, device=s.device)
        p.grad = (s / x.shape[0]).to(p.dtype)


def rel_err(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_model(b: Bench, name: str, dtype_name: str) -> None:
    import torch

    import cukit
    from cukit import dp

    cfg = b.cfg
    dtype = getattr(torch, dtype_name)
    model, x, y = build(name, dtype, cfg.device, cfg.batch)
    C, sigma = 1.0, 1.0
    tol = 5e-2 if dtype_name == "bfloat16" else 1e-3

    # validation first: cukit against torch.func on the same model and inputs
    ref = vmap_grads(model, x, y)
    got = cukit.per_sample_grads(model, loss_sum, x, y)
    per_param = {k: rel_err(got[k], ref[k]) for k in ref}
    err_grads = max(per_param.values())
    ref_norms = torch.sqrt(sum(v.double().flatten(1).square().sum(1) for v in ref.values()))
    err_norms = rel_err(cukit.per_sample_grad_norms(model, loss_sum, x, y), ref_norms)
    model.zero_grad(set_to_none=True)
    dp.clip_and_accumulate(model, loss_sum, x, y, max_grad_norm=C)
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    vmap_dp_step(model, x, y, C, 0.0, None)
    theirs = {k: p.grad.clone() for k, p in model.named_parameters()}
    # the clipped sum of a 16-bit model cancels across samples, so both sides' roundings show at
    # the few-percent level: each is judged against float64 maths on the same weights, and cukit
    # may be at most twice torch.func's own error (or within tol)
    m64 = copy.deepcopy(model).double()
    m64.zero_grad(set_to_none=True)
    vmap_dp_step(m64, x.double(), y, C, 0.0, None)
    exact = {k: p.grad for k, p in m64.named_parameters()}
    per_param_dp = {k: rel_err(ours[k] / x.shape[0], exact[k]) for k in exact}
    err_dp = max(per_param_dp.values())
    dp_tol = max(tol, 2 * max(rel_err(theirs[k], exact[k]) for k in exact))
    del m64, exact, theirs
    errs = {"cukit grads": err_grads, "cukit norms": err_norms, "cukit dp step": err_dp}
    tols = {"cukit dp step": dp_tol}
    bad = {k: v for k, v in errs.items() if not v <= tols.get(k, tol)}
    if bad:
        where = {"grads by parameter": {k: f"{v:.2e}" for k, v in per_param.items()},
                 "dp step by parameter": {k: f"{v:.2e}" for k, v in per_param_dp.items()}}
        raise AssertionError(f"validation failed (tolerance {tol:g}; dp step {dp_tol:.3g}): {bad}; {where}")
    del ref, got, ours

    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_sum(model(x), y).backward()

    def vm_norms() -> None:
        ps = vmap_grads(model, x, y)
        torch.sqrt(sum(v.float().flatten(1).square().sum(1) for v in ps.values()))

    def ck_dp() -> None:
        model.zero_grad(set_to_none=True)
        dp.clip_and_accumulate(model, loss_sum, x, y, max_grad_norm=C, noise_multiplier=sigma, generator=gen)

    def vm_dp() -> None:
        model.zero_grad(set_to_none=True)
        vmap_dp_step(model, x, y, C, sigma, gen)

    impls: list[tuple[str, Callable[[], Any], str | None]] = [
        ("plain", plain, None),
        ("vmap grads", lambda: vmap_grads(model, x, y), None),
        ("cukit grads", lambda: cukit.per_sample_grads(model, loss_sum, x, y), "vmap grads"),
        ("vmap norms", vm_norms, None),
        ("cukit norms", lambda: cukit.per_sample_grad_norms(model, loss_sum, x, y), "vmap norms"),
        ("vmap dp step", vm_dp, None),
        ("cukit dp step", ck_dp, "vmap dp step"),
    ]
    times: dict[str, float] = {}
    for impl, fn, versus in impls:
        row: dict[str, Any] = {"model": name, "dtype": dtype_name, "impl": impl, "batch": cfg.batch}
        why = b.stop_reason(cfg.budget_s or 0.0)
        if why:
            row["error"] = why
            b.failures.append(f"{name} {dtype_name} {impl}: {why}")
            b.rows.append(row)
            continue
        try:
            if b.cuda:
                model.zero_grad(set_to_none=True)  # the base: the model and inputs, no stale gradients
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = harness.time_cuda(lambda fn=fn: fn(), warmup=cfg.warmup, repeats=cfg.repeats, flush_l2=False)
            row["ms"] = t.ms
            times[impl] = t.ms
            if b.cuda:
                row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if "plain" in times:
                row["vs_plain"] = times["plain"] / t.ms
            if versus in times:
                row["vs_vmap"] = times[versus] / t.ms
            if impl in errs:
                row["err"] = errs[impl]
        except Exception as e:
            row["error"] = b.record_failure(f"{name} {dtype_name} {impl}", e)
        b.rows.append(row)


def config_from_args(args: argparse.Namespace) -> Config:
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if args.dry_run:
        return Config(device=args.device or "cpu", dtypes=("float32",), models=models, batch=8, warmup=1, repeats=2,
                      budget_s=args.budget_s, out=args.out, dry_run=True, seed=args.seed)
    return Config(device=args.device or "cuda", dtypes=dtypes, models=models, batch=args.batch,
                  warmup=2 if args.quick else 3, repeats=5 if args.quick else 20, budget_s=args.budget_s, out=args.out,
                  seed=args.seed)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "fewer repeats")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated models: mlp, cnn, seq")
    p.add_argument("--batch", type=int, default=256, help="batch size")
    return p.parse_args(argv)


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    """The headline, printed last (the device tool returns only the end of the output)."""
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), f"batch {b.cfg.batch}", cpu="CPU (dry run: numbers mean nothing)")
    harness.print_table(b.rows, COLUMNS, title="\nper-sample grads, ghost norms, DP-SGD step (vs plain: plain ms / "
                        "this; vs vmap: torch.func ms / this, > 1: faster):")
    harness.print_outcome(b.failures, saved)


def run(cfg: Config) -> tuple[Bench, dict[str, Any], list[str]]:
    """Every case; never raises for a failing case."""
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    print(f"{NAME}: device {cfg.device}, dtypes {', '.join(cfg.dtypes)}, models {', '.join(cfg.models)}, batch "
          f"{cfg.batch}", flush=True)
    for name in cfg.models:
        for dtype in cfg.dtypes:
            try:
                run_model(b, name, dtype)
            except Exception as e:  # building, validation
                b.rows.append({"model": name, "dtype": dtype, "impl": "case",
                               "error": b.record_failure(f"{name} {dtype}", e)})
            print(f"  {name} {dtype}: done", flush=True)
            if b.cuda:
                harness.release_cuda_memory()
    env = harness.environment()
    saved = harness.save_run(b, NAME, cfg.out, env)
    print_summary(b, env, saved)
    return b, env, saved


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    return harness.main_run(NAME, config_from_args(parse_args(argv)), run)


if __name__ == "__main__":
    sys.exit(main())
