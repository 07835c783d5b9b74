"""Benchmark ``cukit.rms_norm`` and ``cukit.layer_norm`` against torch eager, ``torch.compile`` and
Liger-Kernel (when importable).

Usage::

    python benchmarks/bench_norm.py [--out DIR] [--quick] [--dry-run] [--no-compile] [--budget-s S]

Sections, in the order they run (a run cut short by ``--budget-s`` keeps the first ones):

1. copy bandwidth of the device (the physical limit; the "frac" column divides by it);
2. small-call host cost: host microseconds per call on a (1, 1024) float32 input without grad;
3. forward and forward + backward for rows x H in (4096, 768), (8192, 2048), (16384, 4096),
   (4096, 8192), bfloat16 and float32 (the weight, and the bias, in x's dtype):
   rms_norm (cast="llama"): cukit, torch eager with Hugging Face's LlamaRMSNorm formula,
   ``F.rms_norm``, ``torch.compile`` of the HF formula, Liger's ``LigerRMSNormFunction``;
   layer_norm: cukit, ``F.layer_norm``, ``torch.compile`` of it, Liger's ``LigerLayerNormFunction``.

Every case is validated against the float64 reference (``cukit.ops.norm``'s torch references on
upcast inputs) before it is timed, with outputs poisoned with NaN through the caching allocator
first. cukit is held to elementwise tolerances (dx too); baselines, which round elsewhere
(``F.rms_norm`` rounds as Gemma does), and the weight/bias gradients (sums over rows) to a norm
bound. A failing case is recorded with an ``error`` and the run goes on.

Timing: CUDA events, median of repeats, L2 flushed between repeats. "fwd+bwd" times
``y = f(x, w); torch.autograd.grad(y, (x, w[, b]), dy)`` (Liger with ``in_place=False``: dy is
reused across repeats). Bytes are the fewest the op must move: forward reads x and the weight
(and bias) and writes y; forward + backward adds reading x and dy and writing dx and the
parameters' gradients (the saved statistics, 4 bytes per row, are left out).

``--dry-run`` runs the same code on the CPU with tiny shapes (perf_counter timing, torch.compile
with the "eager" backend). Results go to ``--out DIR``, else to a new temporary folder (printed);
``benchmarks/results/`` is written only when named.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_norm from the repository root
    from benchmarks import harness

NAME = "bench_norm"
SHAPES_FULL = ((4096, 768), (8192, 2048), (16384, 4096), (4096, 8192))
SHAPES_QUICK = ((8192, 2048), (4096, 8192))
SHAPES_DRY = ((64, 96), (33, 257))
OPS = ("rms_norm", "layer_norm")
DIRECTIONS = ("fwd", "fwd+bwd")
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}
TARGET_FRACTION = 0.85  # of copy bandwidth, forward and forward + backward, at >= 8M elements
TARGET_MIN_NUMEL = 1 << 23


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    shapes: tuple[tuple[int, int], ...] = SHAPES_FULL
    compile: bool = True
    compile_backend: str = "inductor"
    flush_l2: bool = True
    warmup: int = 5
    repeats: int = 30
    dry_run: bool = False
    host_iters: int = 2000
    host_rounds: int = 5
    copy_nbytes: int = 1 << 30
    budget_s: float = 240.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, shapes=SHAPES_QUICK, repeats=15, host_iters=1000, host_rounds=3,
                      copy_nbytes=1 << 29, budget_s=90.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", shapes=SHAPES_DRY, compile_backend="eager", flush_l2=False, dry_run=True,
                      warmup=1, repeats=3, host_iters=20, host_rounds=2, copy_nbytes=1 << 22, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# The functions being compared
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def hf_rms_norm(x: Any, w: Any) -> Any:
    """Hugging Face's LlamaRMSNorm.forward, as a function (torch eager baseline)."""
    torch = _torch()
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS["rms_norm"])
    return w * h.to(input_dtype)


def torch_rms_norm(x: Any, w: Any) -> Any:
    """torch.nn.functional.rms_norm (rounds once, after the weight: Gemma's convention)."""
    return _torch().nn.functional.rms_norm(x, (x.shape[-1],), w, EPS["rms_norm"])


def torch_layer_norm(x: Any, w: Any, b: Any) -> Any:
    return _torch().nn.functional.layer_norm(x, (x.shape[-1],), w, b, EPS["layer_norm"])


def cukit_rms_norm(x: Any, w: Any) -> Any:
    import cukit

    return cukit.rms_norm(x, w, EPS["rms_norm"])


def cukit_layer_norm(x: Any, w: Any, b: Any) -> Any:
    import cukit

    return cukit.layer_norm(x, None, w, b, EPS["layer_norm"])


def _liger(op: str) -> Callable[..., Any]:
    """Liger-Kernel's autograd Function for `op` (ImportError when liger_kernel is missing)."""
    if op == "rms_norm":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS["rms_norm"], 0.0, "llama", False)
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS["layer_norm"])


def reference(op: str, x: Any, params: Sequence[Any]) -> Any:
    """The float64 oracle of the forward."""
    from cukit.ops import norm

    xd, pd = x.detach().double(), [p.detach().double() for p in params]
    if op == "rms_norm":
        return norm.rms_norm_reference_torch(xd, pd[0], EPS[op], 0.0, "llama")[0]
    return norm.layer_norm_reference_torch(xd, pd[0], pd[1], EPS[op])[0]


def reference_grads(op: str, dy: Any, x: Any, params: Sequence[Any]) -> tuple[Any, ...]:
    """The float64 oracle of the backward: (dx, dweight[, dbias])."""
    from cukit.ops import norm

    dyd, xd, pd = dy.double(), x.detach().double(), [p.detach().double() for p in params]
    if op == "rms_norm":
        return norm.rms_norm_backward_reference_torch(dyd, xd, pd[0], EPS[op], 0.0, "llama")
    return norm.layer_norm_backward_reference_torch(dyd, xd, pd[0], pd[1], EPS[op])


class CompileGroup:
    """``torch.compile`` of one eager function per (op, dtype): compiled on first use after
    ``torch._dynamo.reset()``; a compile error is remembered and later cases skip at once."""

    def __init__(self, fn: Callable[..., Any], backend: str) -> None:
        self.fn, self.backend = fn, backend
        self.compiled: Callable[..., Any] | None = None
        self.error: str | None = None

    def get(self) -> Callable[..., Any]:
        if self.error is not None:
            raise RuntimeError(f"skipped: torch.compile failed earlier in this group ({self.error})")
        if self.compiled is None:
            torch = _torch()
            torch._dynamo.reset()
            self.compiled = torch.compile(self.fn, backend=self.backend)
        return self.compiled


def impls(op: str, cfg: Config, groups: dict[tuple[str, str], CompileGroup], dtype: str) -> list[tuple[str, Any]]:
    """(name, function or maker) for one op: a maker is called once per case (compile, import)."""
    eager = hf_rms_norm if op == "rms_norm" else torch_layer_norm
    out: list[tuple[str, Any]] = [("cukit", cukit_rms_norm if op == "rms_norm" else cukit_layer_norm)]
    if op == "rms_norm":
        out += [("torch (HF formula)", hf_rms_norm), ("torch F.rms_norm", torch_rms_norm)]
    else:
        out.append(("torch F.layer_norm", torch_layer_norm))
    if cfg.compile:
        group = groups.setdefault((op, dtype), CompileGroup(eager, cfg.compile_backend))
        out.append(("torch.compile", group))
    out.append(("liger", lambda: _liger(op)))
    return out


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    cfg: Config
    copy_bps: float = math.nan
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def skip_reason(self) -> str | None:
        return self.stop_reason(self.cfg.budget_s)

    def fail(self, row: dict[str, Any], exc: BaseException | str) -> None:
        where = " ".join(str(row.get(k)) for k in ("op", "direction", "dtype", "shape", "impl") if row.get(k))
        row["error"] = self.record_failure(where, exc)

    def randn(self, shape: Sequence[int] | int, dtype: str, scale: float = 1.0, shift: float = 0.0) -> Any:
        torch = _torch()
        t = torch.randn(shape, dtype=getattr(torch, dtype), device=self.cfg.device)
        if scale != 1.0:
            t.mul_(scale)
        return t.add_(shift) if shift else t


def run_copy(b: Bench) -> None:
    row: dict[str, Any] = {"op": "copy", "impl": "torch copy_", "dtype": "float32"}
    try:
        b.copy_bps = harness.copy_bandwidth(b.cfg.device, nbytes=b.cfg.copy_nbytes, repeats=5 if b.cfg.dry_run else 20)
        row.update(gbps=b.copy_bps / 1e9, frac_copy=1.0)
    except Exception as e:
        b.fail(row, e)
    b.rows.append(row)


def run_host_cost(b: Bench) -> list[dict[str, Any]]:
    """Host µs per call for a (1, 1024) float32 input without grad: the per-call overhead a model
    pays thousands of times per step."""
    torch = _torch()
    x = b.randn((1, 1024), "float32")
    w = b.randn(1024, "float32", 0.5, 1.0)
    bias = b.randn(1024, "float32", 0.5)
    cases = [
        ("torch HF RMSNorm formula", lambda: hf_rms_norm(x, w), reference("rms_norm", x, [w])),
        ("torch F.rms_norm", lambda: torch_rms_norm(x, w), reference("rms_norm", x, [w])),
        ("cukit.rms_norm", lambda: cukit_rms_norm(x, w), reference("rms_norm", x, [w])),
        ("torch F.layer_norm", lambda: torch_layer_norm(x, w, bias), reference("layer_norm", x, [w, bias])),
        ("cukit.layer_norm", lambda: cukit_layer_norm(x, w, bias), reference("layer_norm", x, [w, bias])),
    ]
    rows = []
    with torch.no_grad():
        for label, fn, expected in cases:
            row: dict[str, Any] = {"op": "host", "impl": label, "dtype": "float32", "shape": "1x1024"}
            reason = b.skip_reason()
            if reason:
                row["error"] = reason
                rows.append(row)
                continue
            try:
                out = fn()
                harness.synchronize()
                harness.check_close(out, expected, name=label, elementwise=False, rel_tol=1e-5)
                row["us_per_call"] = harness.host_cost_us(fn, iters=b.cfg.host_iters, rounds=b.cfg.host_rounds)
            except Exception as e:
                b.fail(row, e)
            rows.append(row)
    for r in rows:  # each cukit op against torch's own
        base = next((q.get("us_per_call") for q in rows if q["impl"] == ("torch F.rms_norm" if "rms" in r["impl"]
                                                                          else "torch F.layer_norm")), None)
        if base and r.get("us_per_call"):
            r["ratio_vs_torch"] = r["us_per_call"] / base
    b.rows.extend(rows)
    return rows


def _nbytes(op: str, direction: str, rows: int, H: int, itemsize: int) -> int:
    nparams = 1 if op == "rms_norm" else 2
    fwd = 2 * rows * H * itemsize + nparams * H * itemsize
    if direction == "fwd":
        return fwd
    return fwd + 3 * rows * H * itemsize + nparams * H * itemsize


def _tolerances(impl: str, dtype: str, what: str) -> dict[str, Any]:
    """cukit elementwise (y and dx); baselines and the parameters' gradients by a norm bound."""
    if impl == "cukit" and what in ("y", "dx"):
        return {}
    return {"elementwise": False, "rel_tol": 2e-2 if dtype in ("bfloat16", "float16") else 1e-4}


def run_case(b: Bench, op: str, direction: str, dtype: str, shape: tuple[int, int],
             groups: dict[tuple[str, str], CompileGroup]) -> None:
    """One (op, direction, dtype, shape): fresh inputs, every implementation validated, then timed."""
    torch = _torch()
    rows_n, H = shape
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    base = {"op": op, "direction": direction, "dtype": dtype, "shape": f"{rows_n}x{H}", "rows": rows_n, "H": H,
            "numel": rows_n * H, "bytes": _nbytes(op, direction, rows_n, H, itemsize)}
    case_rows = []
    reason = b.skip_reason()
    try:
        x = b.randn(shape, dtype, 1.0, 0.5 if op == "layer_norm" else 0.0)  # a nonzero mean for layer_norm
        params = [b.randn(H, dtype, 0.5, 1.0)] + ([b.randn(H, dtype, 0.5)] if op == "layer_norm" else [])
        dy = b.randn(shape, dtype)
        expected = reference(op, x, params) if direction == "fwd" else reference_grads(op, dy, x, params)
    except Exception as e:
        row = {**base, "impl": "inputs"}
        b.fail(row, e)
        b.rows.append(row)
        return
    for name, fn in impls(op, b.cfg, groups, dtype):
        row = {**base, "impl": name}
        case_rows.append(row)
        reason = b.skip_reason()
        if reason:
            row["error"] = reason
            continue
        group = fn if isinstance(fn, CompileGroup) else None
        try:
            if group is not None:
                fn = group.get()
            elif name == "liger":
                fn = fn()
        except ImportError as e:  # an optional baseline: noted, not a failure
            row["error"] = f"skipped: {harness.short_error(e, 100)}"
            continue
        except Exception as e:  # compiling failed
            if group is not None:
                group.error = harness.short_error(e, 150)
            b.fail(row, e)
            continue
        try:
            _validate_and_time(b, row, fn, direction, x, params, dy, expected, dtype)
        except Exception as e:
            if group is not None and "first_call_s" not in row:
                group.error = harness.short_error(e, 150)
            b.fail(row, e)
    eager = next((r.get("ms") for r in case_rows if r["impl"] in ("torch (HF formula)", "torch F.layer_norm")), None)
    for r in case_rows:
        if eager and r.get("ms"):
            r["speedup_vs_torch"] = eager / r["ms"]
    b.rows.extend(case_rows)


def _validate_and_time(b: Bench, row: dict[str, Any], fn: Callable[..., Any], direction: str, x: Any,
                       params: list[Any], dy: Any, expected: Any, dtype: str) -> None:
    torch = _torch()
    if direction == "fwd":
        def call() -> Any:
            with torch.no_grad():
                return fn(x, *params)
    else:
        xl = x.detach().requires_grad_()
        pl = [p.detach().requires_grad_() for p in params]

        def call() -> Any:
            y = fn(xl, *pl)
            return torch.autograd.grad(y, (xl, *pl), dy)

    harness.poison_allocator(x.shape, x.dtype, x.device)
    t0 = time.perf_counter()
    out = call()
    harness.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    if direction == "fwd":
        res = harness.check_close(out, expected, name=f"{row['impl']} y", **_tolerances(row["impl"], dtype, "y"))
        row["rel_err"] = res.rel_err
    else:
        errs = []
        for what, a, e in zip(("dx", "dweight", "dbias"), out, expected, strict=False):
            errs.append(harness.check_close(a, e, name=f"{row['impl']} {what}",
                                            **_tolerances(row["impl"], dtype, what)).rel_err)
        row["rel_err"] = max(errs)
    del out
    t = harness.time_cuda(call, warmup=b.cfg.warmup, repeats=b.cfg.repeats, flush_l2=b.cfg.flush_l2, cuda=b.cuda)
    row.update(ms=t.ms, ms_min=t.min_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats, timing=t.method,
               flushed_l2=t.flushed_l2)
    row["gbps"] = row["bytes"] / (t.ms * 1e-3) / 1e9
    row["frac_copy"] = row["gbps"] * 1e9 / b.copy_bps if b.copy_bps > 0 else math.nan


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "op", ("direction", "dir"), "dtype", "shape", "impl", ("ms", "ms"), ("gbps", "GB/s"),
    ("frac_copy", "frac of copy"), ("speedup_vs_torch", "vs torch"), ("error", "error"),
]
HOST_COLUMNS: list[str | tuple[str, str]] = [
    ("impl", "call ((1, 1024) float32, no grad)"), ("us_per_call", "host us/call"),
    ("ratio_vs_torch", "ratio to torch's op"), ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """PASS/FAIL of cukit's fraction of copy bandwidth per (op, direction, dtype), shapes of at
    least TARGET_MIN_NUMEL elements."""
    out = []
    sel = [r for r in rows if r.get("impl") == "cukit" and r.get("op") in OPS and r.get("numel", 0) >= TARGET_MIN_NUMEL]
    for key in sorted({(r["op"], r["direction"], r["dtype"]) for r in sel}):
        rs = [r for r in sel if (r["op"], r["direction"], r["dtype"]) == key]
        fr = [r.get("frac_copy") for r in rs]
        ok = all(isinstance(v, float) and v >= TARGET_FRACTION for v in fr)
        vals = ", ".join(f"{r['shape']} {harness.format_value(r.get('frac_copy'))}" for r in rs)
        out.append(f"  {key[0]:<10} {key[1]:<8} {key[2]:<9} [{vals}] >= {TARGET_FRACTION}: {'PASS' if ok else 'FAIL'}")
    return out or [f"  no cukit rows of >= {TARGET_MIN_NUMEL} elements (all failed, skipped, or a dry run)"]


def print_summary(b: Bench, env: dict[str, Any], host_rows: list[dict[str, Any]], saved: list[str]) -> None:
    print()
    print("=" * 100)
    print(f"SUMMARY {NAME}: {env.get('gpu') or 'CPU (dry run)'} | torch {env.get('torch')} | cupy {env.get('cupy')} | "
          f"commit {str(env.get('git_commit'))[:12]} | {b.elapsed():.0f} s")
    print(f"copy bandwidth (read + write): {harness.format_value(b.copy_bps / 1e9)} GB/s")
    for direction in DIRECTIONS:
        sel = [r for r in b.rows if r.get("direction") == direction]
        harness.print_table(sel, COLUMNS, title=f"\n{direction}:", formatters=_FMT)
    harness.print_table(host_rows, HOST_COLUMNS, title="\nsmall-call host cost:", formatters=_FMT)
    print(f"\ntargets (cukit, fraction of copy bandwidth, >= {TARGET_MIN_NUMEL >> 20}M elements):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "two shapes, fewer repeats (< 90 s)", no_compile=True)
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    torch = _torch()
    torch.manual_seed(cfg.seed)
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    if cfg.compile:
        harness.configure_dynamo()
    groups: dict[tuple[str, str], CompileGroup] = {}
    print(f"{NAME}: device {cfg.device}, dtypes {', '.join(cfg.dtypes)}, shapes "
          f"{', '.join(f'{r}x{h}' for r, h in cfg.shapes)}, compile {cfg.compile} ({cfg.compile_backend})", flush=True)
    run_copy(b)
    print(f"copy bandwidth: {harness.format_value(b.copy_bps / 1e9)} GB/s", flush=True)
    host_rows = run_host_cost(b)
    harness.print_table(host_rows, HOST_COLUMNS, title="\nsmall-call host cost", formatters=_FMT)
    for direction in DIRECTIONS:
        start = len(b.rows)
        for op in OPS:
            for dtype in cfg.dtypes:
                for shape in cfg.shapes:
                    try:
                        run_case(b, op, direction, dtype, shape, groups)
                    except Exception as e:  # a bug in the case runner itself: record, go on
                        row = {"op": op, "direction": direction, "dtype": dtype, "shape": f"{shape[0]}x{shape[1]}",
                               "impl": "case"}
                        b.fail(row, e)
                        b.rows.append(row)
                    if b.cuda and shape[0] * shape[1] >= 1 << 24:
                        gc.collect()
                        torch.cuda.empty_cache()
        harness.print_table(b.rows[start:], COLUMNS, title=f"\n{direction}", formatters=_FMT)
    b.meta["compile_groups"] = {"/".join(k): (g.error or "ok") for k, g in groups.items()}
    env = harness.environment()
    saved: list[str] = []
    try:
        paths = harness.save_results(
            b.rows, NAME, cfg.out, env=env,
            meta={**b.meta, "copy_gbps": b.copy_bps / 1e9, "failures": b.failures, "elapsed_s": b.elapsed(),
                  "target_fraction": TARGET_FRACTION},
            plot_kwargs={
                "x": "numel", "y": "gbps", "series": "impl", "panels": ("op", "direction", "dtype"),
                "where": lambda r: r.get("op") in OPS, "hline": b.copy_bps / 1e9, "xlabel": "elements (rows x H)",
                "ylabel": "GB/s (min bytes)", "title": f"norms: {env.get('gpu') or 'CPU dry run'}",
            },
        )
        saved = [str(p) for p in paths]
    except Exception as e:
        b.failures.append(f"saving results: {harness.short_error(e)}")
    print_summary(b, env, host_rows, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; 0 when the run completed (failed cases are reported, not fatal)."""
    return harness.main_run(NAME, config_from_args(parse_args(argv)), run)


if __name__ == "__main__":
    sys.exit(main())
