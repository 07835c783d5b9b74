"""Benchmark ``cukit.rotary_embedding`` (Hugging Face's apply_rotary_pos_emb on q and k) forward and
backward against torch eager (Hugging Face's formula), ``torch.compile`` of it and Liger-Kernel's
``LigerRopeFunction`` when importable.

Usage::

    python benchmarks/bench_rope.py [--out DIR] [--quick] [--dry-run] [--no-compile] [--budget-s S]

Cases (Llama-3-8B's attention at 8K tokens: B=4, S=2048, Hq=32, Hk=8, D=128, tables (1, S, D)):

- ``hf``: q and k as Hugging Face makes them, transposed views of the projections' output (what
  cukit reads in place and the eager formula copies through ``torch.cat``), bfloat16 and float32;
- ``contiguous``: q and k contiguous (B, H, S, D), bfloat16;
- ``hf, fp32 tables``: bfloat16 q and k with float32 cos and sin, as under autocast with float32
  weights: the output is float32 (``q * cos`` promotes; Liger's is bfloat16, in place).

Per case and implementation: forward and backward (the autograd rows build the graph in an
untimed setup and time ``torch.autograd.grad``; the "cukit" backward row calls
``torch.ops.cukit.rotary_embedding_backward`` directly), validated against the float64 reference
first (cukit elementwise, the baselines to a norm bound), then timed with CUDA events (median, L2
flushed). Liger rotates in place: its rows run on clones, which keep their norms.

Bytes are the fewest the op must move: q and k read and their results written, cos and sin read
once. The target (issue 11) is >= 0.85 of the measured copy bandwidth, forward and backward.
``--dry-run`` runs the same code on the CPU with tiny shapes. Results go to ``--out DIR``, else
to a new temporary folder (printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_rope from the repository root
    from benchmarks import harness

NAME = "bench_rope"
SHAPE_FULL = (4, 2048, 32, 8, 128)  # B, S, Hq, Hk, D
SHAPE_DRY = (2, 17, 4, 2, 16)
# (label, layout, q dtype, table dtype)
CASES_FULL = (
    ("hf", "hf", "bfloat16", "bfloat16"),
    ("contiguous", "contiguous", "bfloat16", "bfloat16"),
    ("hf, fp32 tables", "hf", "bfloat16", "float32"),
    ("hf", "hf", "float32", "float32"),
)
CASES_QUICK = CASES_FULL[:1] + CASES_FULL[2:3]
TARGET_FRACTION = 0.85


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    shape: tuple[int, int, int, int, int] = SHAPE_FULL
    cases: tuple[tuple[str, str, str, str], ...] = CASES_FULL
    compile: bool = True
    compile_backend: str = "inductor"
    warmup: int = 5
    repeats: int = 30
    flush_l2: bool = True
    copy_nbytes: int = 1 << 30
    dry_run: bool = False
    budget_s: float = 240.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, cases=CASES_QUICK, repeats=15, budget_s=90.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", shape=SHAPE_DRY, compile_backend="eager", warmup=1, repeats=3,
                      flush_l2=False, copy_nbytes=1 << 22, dry_run=True, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# The implementations: f(q, k, cos, sin) -> (q_embed, k_embed)
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def _rotate_half(x: Any) -> Any:
    return _torch().cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def eager(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """Hugging Face's apply_rotary_pos_emb (transformers.models.llama), written out."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _liger() -> Callable[..., Any] | str:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as e:
        return f"Liger-Kernel not importable ({harness.short_error(e, 80)})"
    return LigerRopeFunction.apply


def implementations(cfg: Config, compiled: list[Any]) -> list[tuple[str, Callable[..., Any] | str]]:
    """(name, forward function or why it is missing), in the order they run."""
    import cukit

    impls: list[tuple[str, Callable[..., Any] | str]] = [("cukit", cukit.rotary_embedding), ("torch", eager)]
    if cfg.compile:
        if not compiled:
            compiled.append(_torch().compile(eager, backend=cfg.compile_backend))
        impls.append(("torch.compile", compiled[0]))
    impls.append(("liger", _liger() if cfg.device.startswith("cuda") else "Liger-Kernel needs a GPU (Triton)"))
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


def inputs(cfg: Config, layout: str, tq: str, tc: str) -> tuple[Any, Any, Any, Any]:
    """q (B, Hq, S, D), k (B, Hk, S, D) in `layout`, and Llama's tables (1, S, D)."""
    torch = _torch()
    B, S, Hq, Hk, D = cfg.shape
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed)

    def rotated(H: int) -> Any:
        if layout == "hf":  # proj(x).view(B, S, H, D).transpose(1, 2)
            return torch.randn(B, S, H, D, device=cfg.device, generator=g).to(getattr(torch, tq)).transpose(1, 2)
        return torch.randn(B, H, S, D, device=cfg.device, generator=g).to(getattr(torch, tq))

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=cfg.device, dtype=torch.float32) / D))
    freqs = torch.arange(S, device=cfg.device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return rotated(Hq), rotated(Hk), emb.cos().to(getattr(torch, tc)), emb.sin().to(getattr(torch, tc))


def _tol(name: str, dtype: str) -> dict[str, Any]:
    if name.startswith("cukit"):
        return {}
    return {"elementwise": False, "rel_tol": 2e-2 if dtype in ("bfloat16", "float16") else 1e-5}


def run_case(b: Bench, label: str, layout: str, tq: str, tc: str, compiled: list[Any]) -> None:
    """Forward and backward rows of every implementation for one case."""
    torch = _torch()
    from cukit.ops.rope import promote, reference_backward_torch, reference_torch

    B, S, Hq, Hk, D = b.cfg.shape
    to = promote(tq, tc)
    isz = {n: torch.empty((), dtype=getattr(torch, n)).element_size() for n in {tq, tc, to}}
    n_rot, n_tab = B * S * (Hq + Hk) * D, 2 * S * D
    base = {"case": label, "dtype": tq, "tables": tc, "shape": "x".join(map(str, b.cfg.shape))}
    impls = implementations(b.cfg, compiled)
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        b.rows += [{**base, "op": op, "impl": name, "error": reason} for op in ("fwd", "bwd") for name, _ in impls]
        return
    q, k, cos, sin = inputs(b.cfg, layout, tq, tc)
    want = reference_torch(q.double(), k.double(), cos.double(), sin.double())
    # output gradients in q's and k's layout (SDPA's backward hands them back in q_embed's, which is q's)
    gq, gk = (torch.empty_like(t, dtype=getattr(torch, to)).copy_(torch.randn(t.shape, device=t.device))
              for t in (q, k))
    want_d = reference_backward_torch(gq.double(), gk.double(), cos.double(), sin.double(), 1, torch.float64)

    fwd_bytes = n_rot * (isz[tq] + isz[to]) + n_tab * isz[tc]
    for name, fn in impls:
        row: dict[str, Any] = {**base, "op": "fwd", "impl": name, "bytes": fwd_bytes}
        if isinstance(fn, str):
            row["error"] = f"skipped: {fn}"
        else:
            try:
                args = (q.clone(), k.clone(), cos, sin) if name == "liger" else (q, k, cos, sin)  # in place
                got = fn(*args)
                for i, t in enumerate(got):
                    harness.check_close(t, want[i], name=f"{name} {'qk'[i]}_embed", **_tol(name, tq))
                del got
                b.timed(row, lambda fn=fn, args=args: fn(*args), fwd_bytes)
            except Exception as e:
                row["error"] = b.record_failure(f"fwd {label} {tq} {name}", e)
        b.rows.append(row)

    bwd_bytes = n_rot * (isz[to] + isz[tq]) + n_tab * isz[tc]
    ql, kl = q.detach().requires_grad_(), k.detach().requires_grad_()
    direct = ("cukit", lambda: torch.ops.cukit.rotary_embedding_backward(gq, gk, cos, sin, 1, q.dtype))
    for name, fn in [direct, *(("cukit-autograd" if n_ == "cukit" else n_, f) for n_, f in impls)]:
        row = {**base, "op": "bwd", "impl": name, "bytes": bwd_bytes}
        if isinstance(fn, str):
            row["error"] = f"skipped: {fn}"
            b.rows.append(row)
            continue
        try:
            setup: Callable[[], Any] | None = None
            call: Callable[..., Any] = fn
            if name != "cukit":
                leaves = (ql.detach().clone().requires_grad_(), kl.detach().clone().requires_grad_()) \
                    if name == "liger" else (ql, kl)

                def setup(fn: Callable[..., Any] = fn, leaves: tuple[Any, Any] = leaves,
                          in_place: bool = name == "liger") -> Any:
                    return fn(*(x.clone() if in_place else x for x in leaves), cos, sin)

                def call(out: Any, leaves: tuple[Any, Any] = leaves) -> Any:
                    g = (gq, gk) if out[0].dtype == gq.dtype else (gq.to(out[0].dtype), gk.to(out[1].dtype))
                    return torch.autograd.grad(out, leaves, g)

            dq, dk = call(setup()) if setup is not None else call()
            for i, t in enumerate((dq, dk)):
                harness.check_close(t, want_d[i], name=f"{name} d{'qk'[i]}", **_tol(name, tq))
            del dq, dk
            b.timed(row, call, bwd_bytes, setup)
        except Exception as e:
            row["error"] = b.record_failure(f"bwd {label} {tq} {name}", e)
        b.rows.append(row)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "op", "case", "dtype", "tables", "impl", ("ms", "ms (median)"), ("gbps", "GB/s"), ("frac_copy", "frac of copy"),
    ("vs_torch", "vs torch"), ("vs_liger", "vs liger"), ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def ratios(rows: Sequence[dict[str, Any]]) -> None:
    """vs_torch, vs_liger: their ms / this row's ms, same (op, case, dtype)."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("op"), r.get("case"), r.get("dtype")

    ms = {(key(r), r["impl"]): r["ms"] for r in rows if r.get("ms")}
    for r in rows:
        for base, col in (("torch", "vs_torch"), ("liger", "vs_liger")):
            if r.get("ms") and ms.get((key(r), base)):
                r[col] = ms[(key(r), base)] / r["ms"]


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r.get("impl") == "cukit":
            v = r.get("frac_copy")
            ok = isinstance(v, float) and v >= TARGET_FRACTION
            out.append(f"  {r['op']} {r['case']:<16} {r['dtype']:<9} {harness.format_value(v)} >= {TARGET_FRACTION}: "
                       f"{'PASS' if ok else 'FAIL'}")
    return out or ["  no cukit rows"]


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), f"B,S,Hq,Hk,D = {b.cfg.shape}",
                               f"copy {harness.format_value(b.copy_bps / 1e9)} GB/s")
    harness.print_table(b.rows, COLUMNS, title="\nrotary embedding of q and k, forward and backward:", formatters=_FMT)
    print("\ntargets (cukit, fraction of copy bandwidth):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "the bfloat16 HF-layout cases only, fewer repeats", no_compile=True)
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    torch = _torch()
    torch.manual_seed(cfg.seed)
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    if cfg.compile:
        harness.configure_dynamo()
    print(f"{NAME}: device {cfg.device}, B,S,Hq,Hk,D = {cfg.shape}, cases "
          f"{'; '.join(f'{c[0]} {c[2]}' for c in cfg.cases)}", flush=True)
    try:
        b.copy_bps = harness.copy_bandwidth(cfg.device, nbytes=cfg.copy_nbytes, repeats=5 if cfg.dry_run else 20)
    except Exception as e:
        b.record_failure("copy bandwidth", e)
    compiled: list[Any] = []
    for label, layout, tq, tc in cfg.cases:
        try:
            run_case(b, label, layout, tq, tc, compiled)
        except Exception as e:  # the inputs or the reference failed: record, go on
            b.record_failure(f"{label} {tq}", e)
        if b.cuda:
            harness.release_cuda_memory()
        done = [r for r in b.rows if r.get("case") == label and r.get("dtype") == tq]
        print(f"  {label} {tq}: " + "  ".join(
            f"{r['op']} {r['impl']}=" + (f"{r['gbps']:.4g}GB/s" if r.get("gbps") else
                                          "skip" if str(r.get("error")).startswith("skipped") else "ERR")
            for r in done), flush=True)
    ratios(b.rows)
    env = harness.environment()
    saved = harness.save_run(b, NAME, cfg.out, env,
                             meta={"copy_gbps": b.copy_bps / 1e9, "targets": {"fraction": TARGET_FRACTION}})
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    return harness.main_run(NAME, config_from_args(args), run)


if __name__ == "__main__":
    sys.exit(main())
