"""Benchmark ``cukit.linear_cross_entropy`` (fused linear + cross-entropy) against the naive
``F.cross_entropy((x @ W.T).float(), y)``, ``torch.compile`` of it, torch 2.13's chunked
``F.linear_cross_entropy``, Liger-Kernel and Cut Cross-Entropy (the last two when importable).

Usage::

    python benchmarks/bench_linear_cross_entropy.py [--out DIR] [--quick] [--dry-run] [--no-compile]
                                                     [--budget-s S] [--shapes T,H,V;...]

Per (shape, implementation), bf16 inputs x (T, H) and W (V, H), targets with ~5% ignored:

- forward + backward time (``loss = f(x, W, y); loss.backward()``): CUDA events, median of
  repeats, L2 flushed; the TFLOP/s column counts the three GEMMs (3 x 2 T H V), so it is the
  fraction of cuBLAS's rate the whole op reaches;
- peak memory above the inputs: ``max_memory_allocated`` during one forward + backward (peak
  stats reset, x, W, y allocated, their gradients None) minus what was allocated before; the
  gradients the op returns (dW 1,002 MiB at V = 128,256 x H = 4,096 bf16) are part of it;
- gradient error: normwise relative error of dx and dW against a float32 reference (float32
  logits, TF32 off), on the first ``--err-tokens`` tokens (the same H and V), and the loss's
  absolute error.

Rows: "naive", "torch.compile", "torch chunked" (``F.linear_cross_entropy(...,
options=LinearCrossEntropyOptions())``), "liger", "cce", "cukit" (defaults: float32
accumulation), "cukit 16-bit logits" (``logits="input"``: the product rounded to bf16 as the naive
code and Liger round it), "cukit recompute" (``grad_accumulation="recompute"``: exact, no float32
gradient buffers, a fourth GEMM) and "cukit lean" (``grad_accumulation="input"``, 64 MiB workspace). The
issue's targets (H100/H200, 8,192 x 4,096 x 128,256 bf16): peak <= 1,150 MiB, forward + backward
<= 35 ms, gradient error no worse than Liger's; they are printed as PASS/FAIL last.

``--dry-run`` runs the same code on the CPU with tiny shapes (perf_counter timing, no memory
figures, torch.compile with the "eager" backend). Results go to ``--out DIR``, else to a new
temporary folder (printed); ``benchmarks/results/`` is written only when named.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_linear_cross_entropy from the repository root
    from benchmarks import harness

NAME = "bench_linear_cross_entropy"
SHAPES_FULL = ((8192, 4096, 128256), (16384, 2048, 32000), (8192, 2304, 256000))
SHAPES_QUICK = ((8192, 4096, 128256),)
SHAPES_DRY = ((96, 32, 1000), (33, 16, 257))
HEADLINE = (8192, 4096, 128256)
TARGET_MIB, TARGET_MS = 1150.0, 35.0
LEAN_WORKSPACE = 64 << 20


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    shapes: tuple[tuple[int, int, int], ...] = SHAPES_FULL
    compile: bool = True
    compile_backend: str = "inductor"
    warmup: int = 2
    repeats: int = 10
    err_tokens: int = 1024
    flush_l2: bool = True
    dry_run: bool = False
    budget_s: float = 540.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, shapes=SHAPES_QUICK, repeats=5, budget_s=240.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", dtype="float32", shapes=SHAPES_DRY, compile_backend="eager", warmup=1,
                      repeats=2, err_tokens=32, flush_l2=False, dry_run=True, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.shapes:
        cfg = replace(cfg, shapes=tuple(tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")))
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# The implementations: f(x, W, y) -> scalar mean loss over non-ignored tokens
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def naive(x: Any, w: Any, y: Any) -> Any:
    """The unfused baseline: bf16 logits, upcast, cross-entropy (what HF's loss does)."""
    return _torch().nn.functional.cross_entropy((x @ w.T).float(), y)


def torch_chunked(x: Any, w: Any, y: Any) -> Any:
    torch = _torch()
    return torch.nn.functional.linear_cross_entropy(x, w, y, options=torch.nn.LinearCrossEntropyOptions())


def cukit_default(x: Any, w: Any, y: Any) -> Any:
    import cukit

    return cukit.linear_cross_entropy(x, w, y)


def cukit_input_logits(x: Any, w: Any, y: Any) -> Any:
    import cukit

    return cukit.linear_cross_entropy(x, w, y, options=cukit.LinearCrossEntropyOptions(logits="input"))


def cukit_lean(x: Any, w: Any, y: Any) -> Any:
    import cukit

    opts = cukit.LinearCrossEntropyOptions(grad_accumulation="input", workspace_bytes=LEAN_WORKSPACE)
    return cukit.linear_cross_entropy(x, w, y, options=opts)


def cukit_recompute(x: Any, w: Any, y: Any) -> Any:
    import cukit

    opts = cukit.LinearCrossEntropyOptions(grad_accumulation="recompute")
    return cukit.linear_cross_entropy(x, w, y, options=opts)


def _liger() -> Callable[[Any, Any, Any], Any] | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, y: loss(w, x, y)


def _cce() -> Callable[[Any, Any, Any], Any] | None:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception:
        return None
    return lambda x, w, y: linear_cross_entropy(x, w, y)


def implementations(cfg: Config) -> list[tuple[str, Callable[[Any, Any, Any], Any] | str]]:
    """(name, function or the reason it is missing), in the order they run."""
    torch = _torch()
    impls: list[tuple[str, Callable[[Any, Any, Any], Any] | str]] = [("naive", naive)]
    if cfg.compile:
        impls.append(("torch.compile", torch.compile(naive, backend=cfg.compile_backend)))
    has_chunked = hasattr(torch.nn, "LinearCrossEntropyOptions") and hasattr(torch.nn.functional,
                                                                              "linear_cross_entropy")
    impls.append(("torch chunked", torch_chunked if has_chunked else "torch has no F.linear_cross_entropy"))
    for name, make in (("liger", _liger), ("cce", _cce)):
        fn = make() if cfg.device.startswith("cuda") else None
        impls.append((name, fn if fn is not None else "not importable (or no GPU)"))
    impls += [("cukit", cukit_default), ("cukit 16-bit logits", cukit_input_logits),
              ("cukit recompute", cukit_recompute), ("cukit lean", cukit_lean)]
    return impls


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    cfg: Config
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")


def inputs(cfg: Config, T: int, H: int, V: int, seed: int) -> tuple[Any, Any, Any]:
    torch = _torch()
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    dt = getattr(torch, cfg.dtype)
    x = torch.randn(T, H, device=cfg.device, generator=g, dtype=torch.float32).to(dt).requires_grad_()
    w = (torch.randn(V, H, device=cfg.device, generator=g, dtype=torch.float32) / math.sqrt(H)).to(dt)
    y = torch.randint(0, V, (T,), device=cfg.device, generator=g)
    y[torch.rand(T, device=cfg.device, generator=g) < 0.05] = -100
    return x, w.requires_grad_(), y


def fp32_reference(x: Any, w: Any, y: Any) -> tuple[float, Any, Any]:
    """(loss, dx, dW) in float32 (TF32 off), by torch autograd on float32 logits."""
    torch = _torch()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        xf = x.detach().float().requires_grad_()
        wf = w.detach().float().requires_grad_()
        loss = torch.nn.functional.cross_entropy(xf @ wf.T, y)
        dx, dw = torch.autograd.grad(loss, (xf, wf))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return float(loss.detach()), dx, dw


def _rel(a: Any, e: Any) -> float:
    torch = _torch()
    n = float(torch.linalg.vector_norm(e.double()))
    return float(torch.linalg.vector_norm(a.double() - e.double())) / n if n else math.nan


def measure_error(fn: Callable[..., Any], x: Any, w: Any, y: Any, ref: tuple[float, Any, Any]) -> dict[str, float]:
    """Loss and gradient errors of fn on (x, w, y) against the float32 reference `ref`."""
    torch = _torch()
    xa, wa = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xa, wa, y)
    dx, dw = torch.autograd.grad(loss, (xa, wa))
    if not (torch.isfinite(dx).all() and torch.isfinite(dw).all()):
        raise AssertionError("non-finite gradient")
    return {"loss_err": abs(float(loss.detach()) - ref[0]), "dx_err": _rel(dx, ref[1]), "dw_err": _rel(dw, ref[2])}


def measure_memory(fn: Callable[..., Any], x: Any, w: Any, y: Any) -> float:
    """MiB allocated above the inputs at the peak of one forward + backward (gradients included)."""
    torch = _torch()
    x.grad = w.grad = None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(x, w, y).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    x.grad = w.grad = None
    return peak / 2**20


def run_case(b: Bench, shape: tuple[int, int, int], name: str, fn: Callable[..., Any] | str,
             data: tuple[Any, Any, Any], ref: tuple[float, Any, Any] | None) -> dict[str, Any]:
    T, H, V = shape
    row: dict[str, Any] = {"shape": f"{T}x{H}x{V}", "T": T, "H": H, "V": V, "impl": name, "dtype": b.cfg.dtype}
    if isinstance(fn, str):
        row["error"] = f"skipped: {fn}"
        return row
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        row["error"] = reason
        return row
    x, w, y = data
    try:
        if ref is not None:
            e = b.cfg.err_tokens
            row.update(measure_error(fn, x[:e], w, y[:e], ref))
        if b.cuda:
            row["peak_mib"] = measure_memory(fn, x, w, y)

        def setup() -> None:
            x.grad = w.grad = None

        def step(_: Any) -> None:
            fn(x, w, y).backward()

        t = harness.time_cuda(step, warmup=b.cfg.warmup, repeats=b.cfg.repeats, flush_l2=b.cfg.flush_l2,
                              setup=setup, cuda=b.cuda)
        row.update(ms=t.ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats, timing=t.method)
        row["tflops"] = 3 * 2 * T * H * V / (t.ms * 1e-3) / 1e12
    except Exception as exc:
        row["error"] = b.record_failure(f"{row['shape']} {name}", exc)
    finally:
        x.grad = w.grad = None
        if b.cuda:
            harness.release_cuda_memory()
    return row


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "shape", "impl", ("ms", "fwd+bwd ms"), ("tflops", "TFLOP/s (3 GEMMs)"), ("peak_mib", "peak MiB above inputs"),
    ("dx_err", "dx rel err"), ("dw_err", "dW rel err"), ("loss_err", "loss abs err"), ("vs_liger", "time vs liger"),
    ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:70]}


def _ratios(rows: Sequence[dict[str, Any]]) -> None:
    liger = {r["shape"]: r.get("ms") for r in rows if r["impl"] == "liger" and r.get("ms")}
    for r in rows:
        if r.get("ms") and liger.get(r["shape"]):
            r["vs_liger"] = liger[r["shape"]] / r["ms"]


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """PASS/FAIL of the issue's targets at the headline shape, for each cukit row."""
    head = f"{HEADLINE[0]}x{HEADLINE[1]}x{HEADLINE[2]}"
    sel = [r for r in rows if r.get("shape") == head]
    liger = next((r for r in sel if r["impl"] == "liger" and r.get("dw_err") is not None), None)
    out = []
    for r in (r for r in sel if r["impl"].startswith("cukit")):
        if r.get("error"):
            out.append(f"  {r['impl']}: {r['error'][:100]}")
            continue
        mem, ms = r.get("peak_mib", math.nan), r.get("ms", math.nan)
        line = (f"  {r['impl']:<15} peak {harness.format_value(mem)} MiB <= {TARGET_MIB:.0f}: "
                f"{'PASS' if mem <= TARGET_MIB else 'FAIL'};  {harness.format_value(ms)} ms <= {TARGET_MS:.0f}: "
                f"{'PASS' if ms <= TARGET_MS else 'FAIL'}")
        if liger is not None:
            ok = r.get("dw_err", math.inf) <= liger["dw_err"] and r.get("dx_err", math.inf) <= liger["dx_err"]
            line += f";  gradient error <= liger's: {'PASS' if ok else 'FAIL'}"
        out.append(line)
    return out or [f"  headline shape {head} not run"]


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), b.cfg.dtype)
    harness.print_table(b.rows, COLUMNS, title="\nforward + backward, mean loss:", formatters=_FMT)
    print(f"\ntargets ({HEADLINE[0]} x {HEADLINE[1]} x {HEADLINE[2]}):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "the headline shape only, fewer repeats", no_compile=True)
    p.add_argument("--shapes", default=None, help="T,H,V;T,H,V;... instead of the default shapes")
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    torch = _torch()
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    if cfg.compile:
        harness.configure_dynamo()
    print(f"{NAME}: device {cfg.device}, {cfg.dtype}, shapes "
          f"{'; '.join('x'.join(map(str, s)) for s in cfg.shapes)}", flush=True)
    impls = implementations(cfg)
    for shape in cfg.shapes:
        T, H, V = shape
        data = inputs(cfg, T, H, V, cfg.seed)
        e = min(cfg.err_tokens, T)
        ref = None
        try:
            ref = fp32_reference(data[0][:e], data[1], data[2][:e])
        except Exception as exc:
            b.record_failure(f"{T}x{H}x{V} float32 reference", exc)
        for name, fn in impls:
            if name == "torch.compile" and not isinstance(fn, str):
                torch._dynamo.reset()
            row = run_case(b, shape, name, fn, data, ref)
            b.rows.append(row)
            print(f"  {row['shape']} {name}: " + ("ERR " + str(row["error"])[:80] if row.get("error") else
                  f"{harness.format_value(row.get('ms'))} ms, {harness.format_value(row.get('peak_mib'))} MiB, "
                  f"dW err {harness.format_value(row.get('dw_err'))}"), flush=True)
        del data
        if b.cuda:
            harness.release_cuda_memory()
    _ratios(b.rows)
    env = harness.environment()
    saved = harness.save_run(b, NAME, cfg.out, env,
                             meta={"targets": {"peak_mib": TARGET_MIB, "ms": TARGET_MS, "shape": HEADLINE}})
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    return harness.main_run(NAME, config_from_args(args), run)


if __name__ == "__main__":
    sys.exit(main())
