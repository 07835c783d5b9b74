"""Benchmark ``cukit.linalg.matrix_inverse_root`` (batched inverse 4th roots, Shampoo's preconditioner)
against torch's and CuPy's batched ``eigh`` and the same coupled Newton iteration written with
``torch.bmm``, on issue 12's table.

Usage::

    python benchmarks/bench_linalg.py [--out DIR] [--quick] [--dry-run] [--budget-s S] [--iters N]

Cases: float32 G = A A^T / n + 1e-3 I (A standard normal, (batch, n, n)), p = 4, for batch x n in
512 x 128, 500 x 100, 64 x 512, 8 x 2048 (the issue's rows) and 4096 x 16, 1024 x 32 (where an
eigensolver should win; ``method="auto"``'s threshold, ``cukit.linalg.EIGH_MAX_N``).

Implementations (each validated first against a float64 eigendecomposition, relative Frobenius
error <= 2e-3 for the p = 4 roots; the "torch ns3" row against G^(-1/2)):

- ``cukit newton``: ``method="newton", max_iters=N`` (default 15: the issue's loop length; up to
  n = 128 the fused kernel, which stops each matrix once it converged);
- ``cukit newton gemm``: the same on batched GEMMs for every n (the fused kernel off: every step of
  every matrix runs; only where the fused kernel would run);
- ``cukit newton tf32``: the same with ``precision="tf32"`` (tensor cores; validated to 3e-2 only: its
  residual is O(1) on these matrices, TF32's rounding amplified by the condition number);
- ``cukit eigh``: ``method="eigh"`` (CuPy's batched solver, then a batched GEMM);
- ``cukit auto``: ``method="auto"`` with its default iteration count;
- ``torch newton``: the same algorithm in torch ops, ``torch.bmm`` (cuBLAS), N iterations;
- ``torch ns3``: the issue's baseline, 15 coupled Newton-Schulz iterations of 3 bmm each (an inverse
  square root: a lower bound on any inverse-4th-root loop);
- ``torch eigh``, ``cupy eigh``: ``V diag(w^-1/4) V^T`` from ``torch.linalg.eigh`` / ``cupy.linalg.eigh``.

Columns: median ms (CUDA events, L2 flushed), TFLOP/s of the GEMM routes (2 n^3 per GEMM per
matrix, all steps counted: the fused kernel's early exits make its figure an effective rate) and
their fraction of the GEMM roofline measured in the same run (``torch.bmm`` of one (batch, n, n)
product in float32, TF32 off), each row's speed relative to torch newton and cupy eigh, the
relative Frobenius error against the float64 oracle (``rel_err``), and the residual of the root it
returned, ``max_z ||X_z^p A_r - I||_F / ||I||_F`` with ``A_r = G_z + r_z I`` the matrix the route
took the root of (its own ridge r: eps times its power-iteration estimate of lambda_max on the
Newton routes, times the exact one on the eigh route, 0 for the eigh anchors; p = 2 for ns3),
computed in float64 from the returned X. The summary says, per case, whether cukit's automatic choice is at or ahead of the
torch Newton loop and of CuPy's eigh (the issue's targets). ``--dry-run`` runs the same code on the
CPU with tiny shapes. Results go to ``--out DIR``, else to a new temporary folder (printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_linalg from the repository root
    from benchmarks import harness

NAME = "bench_linalg"
CASES_FULL = ((512, 128), (500, 100), (64, 512), (8, 2048), (4096, 16), (1024, 32))
CASES_QUICK = ((512, 128), (64, 512), (1024, 32))
CASES_DRY = ((3, 8), (2, 33))
P = 4
REL_TOL = 2e-3
REL_TOL_TF32 = 3e-2  # TF32 products (10-bit mantissas): the Newton iteration converges to ~1e-3 of I only


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    cases: tuple[tuple[int, int], ...] = CASES_FULL
    iters: int = 15
    warmup: int = 2
    repeats: int = 10
    slow_repeats: int = 3  # torch eigh: ~1 s a call on the rows
    flush_l2: bool = True
    dry_run: bool = False
    budget_s: float = 420.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, cases=CASES_QUICK, repeats=5, budget_s=150.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", cases=CASES_DRY, warmup=1, repeats=2, slow_repeats=1, flush_l2=False,
                      dry_run=True, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.iters is not None:
        cfg = replace(cfg, iters=args.iters)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


def _torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# The implementations: f(G) -> G^(-1/4) (torch tensors in and out)
# ---------------------------------------------------------------------------------------------


def torch_eigh_root(g: Any, expo: float = -1.0 / P) -> Any:
    """V diag(w^expo) V^T by torch.linalg.eigh (eigenvalues clamped at 0 + tiny)."""
    w, v = _torch().linalg.eigh(g)
    return (v * w.clamp_min(1e-30).pow(expo)[..., None, :]) @ v.mT


def cupy_eigh_root(g: Any, expo: float = -1.0 / P) -> Any:
    """The same through cupy.linalg.eigh on a zero-copy view, on torch's current stream."""
    import cupy

    from cukit.interop import asarray, current_stream, to_torch

    with current_stream(g.get_device(), True):
        w, v = cupy.linalg.eigh(asarray(g))
        x = (v * cupy.maximum(w, 1e-30)[..., None, :] ** expo) @ v.swapaxes(-1, -2)
    return to_torch(x)


def torch_ns3(g: Any, iters: int = 15) -> Any:
    """The issue's baseline: coupled Newton-Schulz for G^(-1/2), 3 bmm per iteration:
    Y_0 = G / c, Z_0 = I; T = (3 I - Z Y) / 2; Y <- Y T; Z <- T Z; Z -> (G / c)^(-1/2)."""
    torch = _torch()
    n = g.shape[-1]
    eye = torch.eye(n, dtype=g.dtype, device=g.device)
    c = torch.linalg.matrix_norm(g)[:, None, None]
    y, z = g / c, eye.expand_as(g)
    for _ in range(iters):
        t = 1.5 * eye - 0.5 * torch.bmm(z, y)
        y, z = torch.bmm(y, t), torch.bmm(t, z)
    return z / c.sqrt()


EPS = 1e-6  # the ridge of every cukit row and of torch newton (matrix_inverse_root's default eps)


def implementations(cfg: Config, n: int = 0) -> list[tuple[str, Callable[[Any], Any] | str]]:
    """(name, function of G or why it is missing), in the order they run, for n x n matrices."""
    import cukit.linalg as la
    from cukit.interop import DTYPES
    from cukit.ops import linalg as L
    from cukit.ops.linalg import default_tol, newton_reference_torch

    cuda = cfg.device.startswith("cuda")
    it = cfg.iters

    def cukit_newton(g: Any) -> Any:
        return la.matrix_inverse_root(g, P, method="newton", max_iters=it)

    def cukit_newton_gemm(g: Any) -> Any:
        fused, L._FUSED_NEWTON = L._FUSED_NEWTON, False
        try:
            return la.matrix_inverse_root(g, P, method="newton", max_iters=it)
        finally:
            L._FUSED_NEWTON = fused

    has_fused = cuda and L._fused_tile(n, DTYPES["float32"], _torch().cuda.current_device()) > 0

    def torch_newton(g: Any) -> Any:
        return newton_reference_torch(g, P, 1e-6, it, default_tol("float32", g.shape[-1]))[0]

    def cukit_newton_tf32(g: Any) -> Any:
        return la.matrix_inverse_root(g, P, method="newton", max_iters=it, precision="tf32")

    return [
        ("cukit newton", cukit_newton),
        ("cukit newton gemm", cukit_newton_gemm if has_fused else "the GEMM path is cukit newton at this n"),
        ("cukit newton tf32", cukit_newton_tf32 if cuda else "TF32 needs a GPU"),
        ("cukit eigh", lambda g: la.matrix_inverse_root(g, P, method="eigh")),
        ("cukit auto", lambda g: la.matrix_inverse_root(g, P)),
        ("torch newton", torch_newton),
        ("torch ns3", lambda g: torch_ns3(g, 15)),
        ("torch eigh", torch_eigh_root),
        ("cupy eigh", cupy_eigh_root if cuda else "CuPy needs a GPU"),
    ]


def gemm_count(name: str, cfg: Config, n: int) -> int:
    """Batched GEMMs a GEMM route runs (0: not a GEMM route)."""
    from cukit.ops.linalg import choose_method, default_max_iters

    power = (P.bit_length() - 1) + bin(P).count("1")  # T^P M by binary powering, skipped in the last step

    def newton(iters: int) -> int:
        return iters * (1 + power) - power if iters else 0

    if name in ("cukit newton", "cukit newton gemm", "cukit newton tf32", "torch newton"):
        return newton(cfg.iters)
    if name == "cukit auto" and choose_method(n, 2, "float32", 0 if cfg.device.startswith("cuda") else None) == "newton":
        return newton(default_max_iters("float32"))
    if name == "torch ns3":
        return 15 * 3
    return 0


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

    def timed(self, row: dict[str, Any], fn: Callable[[], Any], repeats: int) -> None:
        t = harness.time_cuda(fn, warmup=self.cfg.warmup, repeats=repeats, flush_l2=self.cfg.flush_l2,
                              cuda=self.cuda)
        row.update(ms=t.ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats, timing=t.method)


def inputs(cfg: Config, batch: int, n: int) -> Any:
    torch = _torch()
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    a = torch.randn(batch, n, n, device=cfg.device, generator=gen)
    return a @ a.mT / n + 1e-3 * torch.eye(n, device=cfg.device)


def eigh64(g: Any) -> tuple[Any, Any]:
    """(w, V) of G in float64 (CuPy's eigh on a GPU: torch's float64 batched eigh is the slow one here)."""
    torch = _torch()
    g64 = g.double()
    if not g.is_cuda:
        return torch.linalg.eigh(g64)
    import cupy

    from cukit.interop import asarray, current_stream, to_torch

    with current_stream(g.get_device(), True):
        w, v = cupy.linalg.eigh(asarray(g64))
    return to_torch(w), to_torch(v)


def oracle(w: Any, v: Any, expo: float) -> Any:
    """G^expo from eigh64's (w, V)."""
    return (v * w.clamp_min(1e-300).pow(expo)[..., None, :]) @ v.mT


def newton_ridge(g64: Any, eps: float) -> Any:
    """The Newton route's ridge per matrix: eps times the Rayleigh quotient after the route's power
    iterations from its start vector (cukit.ops.linalg.newton_reference's), here in float64."""
    torch = _torch()
    from cukit.ops.linalg import POWER_ITERS, _power_start

    v = torch.as_tensor(_power_start(g64.shape[-1], "float64"), device=g64.device).expand(g64.shape[:-1]).clone()
    lam = torch.zeros(g64.shape[0], dtype=g64.dtype, device=g64.device)
    for _ in range(POWER_ITERS):
        inv = (v * v).sum(-1).rsqrt()
        y = torch.bmm(g64, v[..., None])[..., 0] * inv[:, None]
        lam = (v * y).sum(-1) * inv
        v = y
    return eps * lam.clamp_min(0)


def residual_spec(name: str, cfg: Config, n: int, batch: int) -> tuple[int, str] | None:
    """(p, ridge: "newton", "eigh" or "none") of the root a row returns; None: no X to check."""
    from cukit.ops.linalg import choose_method

    if name == "torch ns3":
        return 2, "none"
    if name in ("torch eigh", "cupy eigh"):
        return P, "none"
    if name == "cukit eigh":
        return P, "eigh"
    if name == "cukit auto":
        return P, choose_method(n, batch, "float32", 0 if cfg.device.startswith("cuda") else None)
    if name.startswith(("cukit newton", "torch newton")):
        return P, "newton"
    return None


def residual(x: Any, g64: Any, w: Any, p: int, ridge: str) -> float:
    """max over the batch of ||X^p (G + r I) - I||_F / ||I||_F, in float64 (see the module docstring)."""
    torch = _torch()
    n = g64.shape[-1]
    eye = torch.eye(n, dtype=torch.float64, device=g64.device)
    if ridge == "newton":
        r = newton_ridge(g64, EPS)
    elif ridge == "eigh":
        r = EPS * w[..., -1].clamp_min(0)
    else:
        r = torch.zeros(g64.shape[0], dtype=torch.float64, device=g64.device)
    x64 = x.double()
    res = torch.linalg.matrix_power(x64, p) @ (g64 + r[:, None, None] * eye) - eye
    return float((torch.linalg.matrix_norm(res) / n**0.5).max())


def run_case(b: Bench, batch: int, n: int) -> None:
    torch = _torch()
    base = {"case": f"{batch}x{n}x{n}", "batch": batch, "n": n, "p": P, "dtype": "float32", "iters": b.cfg.iters}
    impls = implementations(b.cfg, n)
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        b.rows += [{**base, "impl": name, "error": reason} for name, _ in impls]
        return
    g = inputs(b.cfg, batch, n)
    g64 = g.double()
    w, v = eigh64(g)
    want = {-0.25: oracle(w, v, -0.25), -0.5: oracle(w, v, -0.5)}
    del v
    # the GEMM roofline at this shape: one float32 torch.bmm (cuBLAS), TF32 off
    tb = harness.time_cuda(lambda: torch.bmm(g, g), warmup=b.cfg.warmup, repeats=b.cfg.repeats,
                           flush_l2=b.cfg.flush_l2, cuda=b.cuda)
    bmm_tflops = 2.0 * batch * n**3 / (tb.ms * 1e-3) / 1e12
    b.rows.append({**base, "impl": "torch bmm (1 GEMM)", "ms": tb.ms, "tflops": bmm_tflops, "frac_gemm": 1.0})
    for name, fn in impls:
        row: dict[str, Any] = {**base, "impl": name}
        if isinstance(fn, str):
            row["error"] = f"skipped: {fn}"
            b.rows.append(row)
            continue
        try:
            got = fn(g)
            expo = -0.5 if name == "torch ns3" else -0.25
            chk = harness.check_close(got, want[expo], name=name, elementwise=False,
                                      rel_tol=REL_TOL_TF32 if name.endswith("tf32") else REL_TOL)
            row["rel_err"] = chk.rel_err
            spec = residual_spec(name, b.cfg, n, batch)
            if spec is not None:
                row["residual"] = residual(got, g64, w, *spec)
            del got
            b.timed(row, lambda fn=fn: fn(g), b.cfg.slow_repeats if name == "torch eigh" else b.cfg.repeats)
            k = gemm_count(name, b.cfg, n)
            if k:
                row["gemms"] = k
                row["tflops"] = k * 2.0 * batch * n**3 / (row["ms"] * 1e-3) / 1e12
                row["frac_gemm"] = row["tflops"] / bmm_tflops
        except Exception as e:
            row["error"] = b.record_failure(f"{base['case']} {name}", e)
        b.rows.append(row)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "case", "impl", ("ms", "ms (median)"), "gemms", ("tflops", "TFLOP/s"), ("frac_gemm", "frac of bmm"),
    ("vs_torch_newton", "vs torch newton"), ("vs_cupy_eigh", "vs cupy eigh"), ("rel_err", "rel err"),
    "residual", ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def ratios(rows: Sequence[dict[str, Any]]) -> None:
    """vs_<baseline>: the baseline's ms / this row's ms, same case (> 1: this row is faster)."""
    ms = {(r["case"], r["impl"]): r["ms"] for r in rows if r.get("ms")}
    for r in rows:
        for base, col in (("torch newton", "vs_torch_newton"), ("cupy eigh", "vs_cupy_eigh")):
            if r.get("ms") and ms.get((r["case"], base)):
                r[col] = ms[(r["case"], base)] / r["ms"]


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per case: cukit auto at or ahead of the faster of the torch Newton loop and CuPy's eigh (the
    right tool for the case), and each cukit route against its own counterpart."""
    out = []
    ms = {(r["case"], r["impl"]): r.get("ms") for r in rows}
    for case in dict.fromkeys(r["case"] for r in rows):
        def get(impl: str, case: str = case) -> float | None:
            v = ms.get((case, impl))
            return v if isinstance(v, float) else None

        auto, tn, ce, cn, ck, cg = (get(i) for i in ("cukit auto", "torch newton", "cupy eigh", "cukit newton",
                                                     "cukit eigh", "cukit newton gemm"))
        best = min((v for v in (tn, ce) if v is not None), default=None)
        if auto is None or best is None:
            out.append(f"  {case:<14} auto vs best baseline: n/a (a row failed or was skipped)")
            continue
        tool = "torch newton" if best == tn else "cupy eigh"
        out.append(f"  {case:<14} auto {auto:.3g} ms vs {tool} {best:.3g} ms: "
                   f"{'PASS' if auto <= best * 1.02 else 'FAIL'} (x{best / auto:.2f})")
        if cn is not None and tn is not None:
            out.append(f"  {'':<14} cukit newton vs torch newton (same iterations): x{tn / cn:.2f}")
        if cn is not None and cg is not None:
            out.append(f"  {'':<14} cukit newton (fused kernel) vs its GEMM path: x{cg / cn:.2f}")
        ns3 = get("torch ns3")
        if ns3 is not None and auto is not None:
            out.append(f"  {'':<14} cukit auto vs torch ns3 (the issue's 3-bmm loop, an inverse square root): "
                       f"x{ns3 / auto:.2f}")
        if ck is not None and ce is not None:
            out.append(f"  {'':<14} cukit eigh vs cupy eigh: x{ce / ck:.2f}")
    return out or ["  no rows"]


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), f"p = {P}, float32, Newton iterations {b.cfg.iters}")
    harness.print_table(b.rows, COLUMNS, title="\nbatched inverse 4th root of G = A A^T / n + 1e-3 I:", formatters=_FMT)
    print("\ntargets (at or ahead of the torch Newton loop and of CuPy eigh, whichever is the right tool):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "three cases, fewer repeats")
    p.add_argument("--iters", type=int, default=None, help="Newton iterations of the newton rows (default 15)")
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    torch = _torch()
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baselines in IEEE fp32, as cukit's GEMMs
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    print(f"{NAME}: device {cfg.device}, cases {', '.join(f'{bb}x{n}x{n}' for bb, n in cfg.cases)}, p = {P}",
          flush=True)
    for batch, n in cfg.cases:
        try:
            run_case(b, batch, n)
        except Exception as e:  # the inputs or the oracle failed: record, go on
            b.record_failure(f"{batch}x{n}", e)
        if b.cuda:
            harness.release_cuda_memory()
        done = [r for r in b.rows if r.get("case") == f"{batch}x{n}x{n}"]
        print(f"  {batch}x{n}x{n}: " + "  ".join(
            f"{r['impl']}=" + (f"{r['ms']:.4g}ms" if r.get("ms") else
                               "skip" if str(r.get("error")).startswith("skipped") else "ERR") for r in done),
              flush=True)
    ratios(b.rows)
    env = harness.environment()
    saved = harness.save_run(b, NAME, cfg.out, env, meta={"rel_tol": REL_TOL})
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    return harness.main_run(NAME, config_from_args(args), run)


if __name__ == "__main__":
    sys.exit(main())
