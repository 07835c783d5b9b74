"""Benchmark ``cukit.swiglu`` / ``cukit.geglu`` (y = act(gate) * up) forward and backward against
torch eager (``F.silu(gate) * up``), ``torch.compile`` of it and Liger-Kernel
(``LigerSiLUMulFunction``, ``LigerGELUMulFunction``) when importable.

Usage::

    python benchmarks/bench_glu.py [--out DIR] [--quick] [--dry-run] [--no-compile] [--budget-s S]

Cases: gate and up of shape (tokens, intermediate) from 4096 x 2048 to 16384 x 14336 (Llama-3-8B's
MLP at 16K tokens), bfloat16 and float32, silu; gelu_tanh (Gemma's) at one size. Per case and
implementation: forward (y) and backward (dgate, dup from dy; the autograd rows build the graph in
an untimed setup and time ``torch.autograd.grad``; the "cukit" backward row calls
``torch.ops.cukit.glu_backward`` directly), validated against the float64 reference first (cukit
elementwise with cukit.testing's tolerances, the baselines to a norm bound: eager torch rounds
act(gate) before the product), then timed with CUDA events (median, L2 flushed).

Bytes are the fewest the op must move: forward reads gate and up and writes y (3 n elements);
backward reads dy, gate, up and writes dgate, dup (5 n). The "frac" column divides by the
measured copy bandwidth; the target (issue 11) is >= 0.85 forward and backward. A small-call
host-cost table (1K elements) comes first. ``--dry-run`` runs the same code on the CPU with tiny
shapes. Results go to ``--out DIR``, else to a new temporary folder (printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_glu from the repository root
    from benchmarks import harness

NAME = "bench_glu"
SHAPES_FULL = ((4096, 2048), (4096, 8192), (8192, 11008), (16384, 14336))
SHAPES_QUICK = ((4096, 8192), (16384, 14336))
SHAPES_DRY = ((64, 96), (33, 123))
TARGET_FRACTION = 0.85


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    shapes: tuple[tuple[int, int], ...] = SHAPES_FULL
    acts: tuple[str, ...] = ("silu",)
    other_act: str = "gelu_tanh"  # also run at other_shape, bfloat16
    other_shape: tuple[int, int] = (8192, 11008)
    compile: bool = True
    compile_backend: str = "inductor"
    warmup: int = 3
    repeats: int = 20
    flush_l2: bool = True
    host_iters: int = 2000
    copy_nbytes: int = 1 << 30
    dry_run: bool = False
    budget_s: float = 300.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, shapes=SHAPES_QUICK, repeats=10, host_iters=500, budget_s=120.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", shapes=SHAPES_DRY, other_shape=SHAPES_DRY[1], compile_backend="eager",
                      warmup=1, repeats=3, flush_l2=False, host_iters=20, copy_nbytes=1 << 22, dry_run=True,
                      budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# The implementations: f(gate, up) -> y
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def eager_silu(gate: Any, up: Any) -> Any:
    """Hugging Face's LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)."""
    return _torch().nn.functional.silu(gate) * up


def eager_gelu_tanh(gate: Any, up: Any) -> Any:
    """Gemma's MLP (gelu_pytorch_tanh)."""
    return _torch().nn.functional.gelu(gate, approximate="tanh") * up


EAGER = {"silu": eager_silu, "gelu_tanh": eager_gelu_tanh}


def _liger(act: str) -> Callable[[Any, Any], Any] | str:
    try:
        if act == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Fn
        else:  # Liger's GeGLU is the tanh form
            from liger_kernel.ops.geglu import LigerGELUMulFunction as Fn
    except Exception as e:
        return f"Liger-Kernel not importable ({harness.short_error(e, 80)})"
    return Fn.apply


def implementations(cfg: Config, act: str, compiled: dict[str, Any]) -> list[tuple[str, Callable[..., Any] | str]]:
    """(name, forward function or why it is missing), in the order they run."""
    import cukit

    cukit_fn = (lambda g, u: cukit.swiglu(g, u)) if act == "silu" else (lambda g, u: cukit.geglu(g, u, "tanh"))
    impls: list[tuple[str, Callable[..., Any] | str]] = [("cukit", cukit_fn), ("torch", EAGER[act])]
    if cfg.compile:
        if act not in compiled:
            compiled[act] = _torch().compile(EAGER[act], backend=cfg.compile_backend)
        impls.append(("torch.compile", compiled[act]))
    impls.append(("liger", _liger(act) if cfg.device.startswith("cuda") else "Liger-Kernel needs a GPU (Triton)"))
    return impls


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    cfg: Config
    copy_bps: float = float("nan")
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def timed(self, row: dict[str, Any], fn: Callable[..., Any], nbytes: int,
              setup: Callable[[], Any] | None = None) -> None:
        t = harness.time_cuda(fn, warmup=self.cfg.warmup, repeats=self.cfg.repeats, flush_l2=self.cfg.flush_l2,
                              setup=setup, cuda=self.cuda)
        row.update(ms=t.ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats, timing=t.method)
        row["gbps"] = nbytes / (t.ms * 1e-3) / 1e9
        row["frac_copy"] = row["gbps"] * 1e9 / self.copy_bps if self.copy_bps > 0 else float("nan")


def _tol(name: str, dtype: str) -> dict[str, Any]:
    """cukit elementwise (cukit.testing's tolerances); baselines to a norm bound only."""
    if name.startswith("cukit"):
        return {}
    return {"elementwise": False, "rel_tol": 2e-2 if dtype in ("bfloat16", "float16") else 1e-5}


def run_shape(b: Bench, dtype: str, act: str, shape: tuple[int, int], compiled: dict[str, Any]) -> None:
    """Forward and backward rows of every implementation for one (dtype, act, shape)."""
    torch = _torch()
    from cukit.ops.glu import reference_backward_torch, reference_torch

    T, inter = shape
    n = T * inter
    dt = getattr(torch, dtype)
    isz = torch.empty((), dtype=dt).element_size()
    base = {"dtype": dtype, "act": act, "shape": f"{T}x{inter}", "numel": n}
    impls = implementations(b.cfg, act, compiled)
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        b.rows += [{**base, "op": op, "impl": name, "error": reason} for op in ("fwd", "bwd") for name, _ in impls]
        return
    g = torch.Generator(device=b.cfg.device).manual_seed(b.cfg.seed)
    gate, up, dy = (torch.randn(T, inter, device=b.cfg.device, generator=g).mul_(2).to(dt) for _ in range(3))
    want_y = reference_torch(gate.double(), up.double(), act)
    want_dg, want_du = reference_backward_torch(dy.double(), gate.double(), up.double(), act)
    gl, ul = gate.detach().requires_grad_(), up.detach().requires_grad_()

    for name, fn in impls:  # forward
        row: dict[str, Any] = {**base, "op": "fwd", "impl": name, "bytes": 3 * n * isz}
        if isinstance(fn, str):
            row["error"] = f"skipped: {fn}"
        else:
            try:
                harness.poison_allocator((T, inter), dt, gate.device)
                harness.check_close(fn(gate, up), want_y, name=f"{name} y", **_tol(name, dtype))
                b.timed(row, lambda fn=fn: fn(gate, up), row["bytes"])
            except Exception as e:
                row["error"] = b.record_failure(f"fwd {dtype} {act} {row['shape']} {name}", e)
        b.rows.append(row)

    direct = ("cukit", lambda: torch.ops.cukit.glu_backward(dy, gate, up, act))
    for name, fn in [direct, *(("cukit-autograd" if n_ == "cukit" else n_, f) for n_, f in impls)]:
        row = {**base, "op": "bwd", "impl": name, "bytes": 5 * n * isz}
        if isinstance(fn, str):
            row["error"] = f"skipped: {fn}"
            b.rows.append(row)
            continue
        try:
            setup: Callable[[], Any] | None = None
            call: Callable[..., Any] = fn
            if name != "cukit":
                def setup(fn: Callable[..., Any] = fn) -> Any:
                    return fn(gl, ul)

                def call(y: Any) -> Any:
                    return torch.autograd.grad(y, (gl, ul), dy)

            harness.poison_allocator((T, inter), dt, gate.device)
            dg, du = call(setup()) if setup is not None else call()
            tol = _tol(name, dtype)
            harness.check_close(dg, want_dg, name=f"{name} dgate", **tol)
            harness.check_close(du, want_du, name=f"{name} dup", **tol)
            del dg, du
            b.timed(row, call, row["bytes"], setup)
        except Exception as e:
            row["error"] = b.record_failure(f"bwd {dtype} {act} {row['shape']} {name}", e)
        b.rows.append(row)


def run_host(b: Bench) -> None:
    """Host microseconds per call on 1K-element float32 tensors: cukit against torch's two ops."""
    torch = _torch()
    import cukit

    gate, up = (torch.randn(1, 1024, device=b.cfg.device) for _ in range(2))
    want = (torch.nn.functional.silu(gate.double()) * up.double())
    for name, fn in (("torch F.silu(g) * u", lambda: eager_silu(gate, up)),
                     ("cukit.swiglu (no grad)", lambda: cukit.swiglu(gate, up))):
        row: dict[str, Any] = {"op": "host", "impl": name, "numel": 1024, "dtype": "float32"}
        try:
            harness.check_close(fn(), want, name=name)
            row["us_per_call"] = harness.host_cost_us(fn, iters=b.cfg.host_iters, rounds=3)
        except Exception as e:
            row["error"] = b.record_failure(f"host {name}", e)
        b.rows.append(row)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "op", "dtype", "act", "shape", "impl", ("ms", "ms (median)"), ("gbps", "GB/s"), ("frac_copy", "frac of copy"),
    ("vs_torch", "vs torch"), ("vs_liger", "vs liger"), ("error", "error"),
]
HOST_COLUMNS: list[str | tuple[str, str]] = [("impl", "call (1K float32)"), ("us_per_call", "host us/call"),
                                             ("error", "error")]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def ratios(rows: Sequence[dict[str, Any]]) -> None:
    """vs_torch, vs_liger: their ms / this row's ms, same (op, dtype, act, shape)."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("op"), r.get("dtype"), r.get("act"), r.get("shape")

    ms = {(key(r), r["impl"]): r["ms"] for r in rows if r.get("ms")}
    for r in rows:
        for base, col in (("torch", "vs_torch"), ("liger", "vs_liger")):
            if r.get("ms") and ms.get((key(r), base)):
                r[col] = ms[(key(r), base)] / r["ms"]


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """cukit's fraction of copy bandwidth forward and backward at every size against the target."""
    out = []
    for op in ("fwd", "bwd"):
        for dtype in sorted({r["dtype"] for r in rows if r.get("op") == op}):
            sel = [r for r in rows if r.get("op") == op and r["dtype"] == dtype and r["impl"] == "cukit"]
            fr = [r.get("frac_copy") for r in sel]
            ok = bool(fr) and all(isinstance(v, float) and v >= TARGET_FRACTION for v in fr)
            out.append(f"  {op} {dtype:<9} [{', '.join(harness.format_value(v) for v in fr)}] >= {TARGET_FRACTION}: "
                       f"{'PASS' if ok else 'FAIL'}")
    return out or ["  no cukit rows"]


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), f"copy {harness.format_value(b.copy_bps / 1e9)} GB/s")
    harness.print_table([r for r in b.rows if r.get("op") in ("fwd", "bwd")], COLUMNS,
                        title="\nact(gate) * up, forward and backward:", formatters=_FMT)
    harness.print_table([r for r in b.rows if r.get("op") == "host"], HOST_COLUMNS, title="\nhost cost:",
                        formatters=_FMT)
    print("\ntargets (cukit, fraction of copy bandwidth):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "two sizes, fewer repeats", no_compile=True)
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    torch = _torch()
    torch.manual_seed(cfg.seed)
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    if cfg.compile:
        harness.configure_dynamo()
    print(f"{NAME}: device {cfg.device}, dtypes {', '.join(cfg.dtypes)}, shapes "
          f"{'; '.join('x'.join(map(str, s)) for s in cfg.shapes)}", flush=True)
    try:
        b.copy_bps = harness.copy_bandwidth(cfg.device, nbytes=cfg.copy_nbytes, repeats=5 if cfg.dry_run else 20)
    except Exception as e:
        b.record_failure("copy bandwidth", e)
    run_host(b)
    compiled: dict[str, Any] = {}
    cases = [(d, a, s) for d in cfg.dtypes for a in cfg.acts for s in cfg.shapes]
    cases.append(("bfloat16", cfg.other_act, cfg.other_shape))
    for dtype, act, shape in cases:
        try:
            run_shape(b, dtype, act, shape, compiled)
        except Exception as e:  # the inputs or the reference failed: record, go on
            b.record_failure(f"{dtype} {act} {shape}", e)
        if b.cuda:  # the case's tensors are gone with its frame: hand their blocks back
            harness.release_cuda_memory()
        done = [r for r in b.rows if r.get("dtype") == dtype and r.get("act") == act
                and r.get("shape") == "x".join(map(str, shape))]
        print(f"  {dtype} {act} {'x'.join(map(str, shape))}: " + "  ".join(
            f"{r['op']} {r['impl']}=" + (f"{r['gbps']:.4g}GB/s" if r.get("gbps") else
                                          "skip" if str(r.get("error")).startswith("skipped") else "ERR")
            for r in done), flush=True)
    ratios(b.rows)
    env = harness.environment()
    saved = harness.save_run(
        b, NAME, cfg.out, env, meta={"copy_gbps": b.copy_bps / 1e9, "targets": {"fraction": TARGET_FRACTION}},
        plot_kwargs={"x": "numel", "y": "gbps", "series": "impl", "panels": ("op", "dtype"),
                     "where": lambda r: r.get("op") in ("fwd", "bwd") and r.get("act") == "silu",
                     "hline": b.copy_bps / 1e9, "xlabel": "elements of gate", "ylabel": "GB/s (min bytes)",
                     "title": f"swiglu: {env.get('gpu') or 'CPU dry run'}"})
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    return harness.main_run(NAME, config_from_args(args), run)


if __name__ == "__main__":
    sys.exit(main())
