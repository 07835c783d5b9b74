"""Benchmark ``cukit.bias_act`` (y = act(x + bias)) against torch eager and torch.compile.

Usage::

    python benchmarks/bench_bias_act.py [--out DIR] [--quick] [--dry-run] [--no-compile] [--budget-s S]

Sections, in the order they run (the most important first, so a run cut short by ``--budget-s``
still has the headline):

1. copy bandwidth of the device (the physical limit; the "frac" column divides by it);
2. small-call host cost: host microseconds per call on 1K-element tensors, ratio to ``x + b``;
3. forward, activation gelu (exact), bfloat16 and float32, 4K ... 256M elements, x of shape
   (numel / 4096, 4096): cukit vs torch eager ``F.gelu(x + b)`` vs ``torch.compile`` of it;
4. forward, the other activations (relu, gelu_tanh, silu) at 64M elements, float32;
5. backward (dx and dbias) for gelu over the same sizes, and for the other activations at 64M.

Every case is validated against the float64 torch reference (``cukit.ops.bias_act.reference_torch``
on upcast inputs) with fresh random inputs before it is timed; outputs are poisoned with NaN
through the caching allocator first, so an unwritten element fails validation. A failing case is
recorded as a row with an ``error`` and the run goes on. The summary is printed last.

Timing: CUDA events around each call, median of repeats, L2 flushed between repeats (outside the
timed region). Bytes are the fewest the op must move: forward reads x and bias and writes y;
backward reads dy, x and bias and writes dx and dbias.

Backward timing (documented choice): the autograd rows ("torch", "torch.compile",
"cukit-autograd") build a fresh graph in an untimed per-repeat setup (the forward runs there) and
time only ``torch.autograd.grad(y, (x, b), dy)``: no ``retain_graph`` (which torch.compile's
compiled backward need not support, and which keeps saved tensors alive) and no ``.grad``
accumulation (autograd.grad returns fresh tensors). The "cukit" row calls
``torch.ops.cukit.bias_act_backward(dy, x, b, act)`` directly: the kernels and the dispatcher,
no autograd engine.

``--dry-run`` runs the same code on the CPU with tiny sizes (cukit's CPU path, torch.compile with
the "eager" backend, perf_counter timing) so the harness logic is tested without a GPU.

Results go to ``--out DIR``, else to a new temporary folder (printed); ``benchmarks/results/`` holds
the committed ones and is written only when named (never by ``--dry-run``).
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
except ImportError:  # imported as benchmarks.bench_bias_act from the repository root
    from benchmarks import harness

NAME = "bench_bias_act"
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
HEADLINE_ACT = "gelu"
C_MAX = 4096
HEADLINE_NUMEL = 1 << 26  # the targets are stated for >= 64M elements
TARGET_FRACTION = 0.85  # forward >= 85% of measured copy bandwidth ...
TARGET_SPEEDUP = 1.5  # ... and >= 1.5x torch eager

SIZES_FULL = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28)
SIZES_QUICK = (1 << 20, 1 << 26)
SIZES_DRY = (1 << 12, 1 << 16)


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    fwd_sizes: tuple[int, ...] = SIZES_FULL
    bwd_sizes: tuple[int, ...] = SIZES_FULL
    other_acts: tuple[str, ...] = ("relu", "gelu_tanh", "silu")
    other_numel: int = 1 << 26
    other_dtype: str = "float32"
    compile: bool = True
    compile_backend: str = "inductor"
    compile_other_acts: bool = True
    flush_l2: bool = True
    repeat_scale: float = 1.0  # multiplies the repeat counts of :func:`repeats_for`
    dry_run: bool = False
    host_numel: int = 1024
    host_iters: int = 2000
    host_rounds: int = 5
    copy_nbytes: int = 1 << 30
    budget_s: float = 170.0  # wall-clock budget; cases after it are skipped (0: none)
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    """The run's :class:`Config` for ``--quick`` / ``--dry-run`` / the full run."""
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, fwd_sizes=SIZES_QUICK, bwd_sizes=(1 << 26,), compile_other_acts=False,
                      repeat_scale=0.5, host_iters=1000, host_rounds=3, copy_nbytes=1 << 29, budget_s=55.0)
    if args.dry_run:
        cfg = replace(
            cfg, device="cpu", fwd_sizes=SIZES_DRY, bwd_sizes=SIZES_DRY, other_numel=1 << 16,
            compile_backend="eager", compile_other_acts=False, flush_l2=False, dry_run=True,
            host_iters=20, host_rounds=2, copy_nbytes=1 << 22, budget_s=0.0,
        )
    if args.device is not None:  # e.g. --dry-run --device cuda: the tiny sizes on a GPU
        cfg = replace(cfg, device=args.device, flush_l2=args.device.startswith("cuda"))
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


def repeats_for(numel: int, cfg: Config) -> tuple[int, int]:
    """(warmup, repeats) for a case: many repeats for cheap small calls, 20 at >= 64M."""
    if cfg.dry_run:
        return 1, 3
    if numel <= 1 << 20:
        w, r = 10, 100
    elif numel <= 1 << 24:
        w, r = 5, 50
    else:
        w, r = 3, 20
    return w, max(10, int(r * cfg.repeat_scale))


def shape_for(numel: int) -> tuple[int, int]:
    """x's shape for `numel` elements: (numel / C, C) with C = 4096 where possible."""
    c = min(C_MAX, numel)
    if numel % c:
        raise ValueError(f"numel {numel} is not a multiple of {c}")
    return numel // c, c


def fmt_numel(n: int) -> str:
    """4096 -> '4K', 1 << 26 -> '64M'."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# The functions being compared
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


# One function per activation (distinct code objects: dynamo keeps its cache per code object).
def eager_relu(x: Any, b: Any) -> Any:
    """torch eager baseline: add, then activation (two kernels)."""
    return _torch().nn.functional.relu(x + b)


def eager_gelu(x: Any, b: Any) -> Any:
    """torch eager baseline: add, then exact gelu."""
    return _torch().nn.functional.gelu(x + b)


def eager_gelu_tanh(x: Any, b: Any) -> Any:
    """torch eager baseline: add, then tanh-approximated gelu."""
    return _torch().nn.functional.gelu(x + b, approximate="tanh")


def eager_silu(x: Any, b: Any) -> Any:
    """torch eager baseline: add, then silu."""
    return _torch().nn.functional.silu(x + b)


EAGER: dict[str, Callable[[Any, Any], Any]] = {
    "relu": eager_relu,
    "gelu": eager_gelu,
    "gelu_tanh": eager_gelu_tanh,
    "silu": eager_silu,
}


def _fallback_reference(x: Any, b: Any, activation: str) -> Any:
    F = _torch().nn.functional
    z = x + b
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation](z)


def reference_forward(x: Any, b: Any, activation: str) -> Any:
    """The float64 oracle: cukit's torch reference on inputs upcast to float64."""
    xd, bd = x.detach().double(), b.detach().double()
    try:
        from cukit.ops.bias_act import reference_torch
    except Exception:  # cukit broken: the benchmark still validates the baselines
        return _fallback_reference(xd, bd, activation)
    return reference_torch(xd, bd, activation)


def reference_backward(dy: Any, x: Any, b: Any, activation: str) -> tuple[Any, Any]:
    """The float64 oracle of the backward: (dx, dbias)."""
    torch = _torch()
    dyd, xd, bd = dy.detach().double(), x.detach().double(), b.detach().double()
    try:
        from cukit.ops.bias_act import reference_backward_torch
    except Exception:
        xr, br = xd.clone().requires_grad_(), bd.clone().requires_grad_()
        dx, db = torch.autograd.grad(_fallback_reference(xr, br, activation), (xr, br), dyd)
        return dx, db
    return reference_backward_torch(dyd, xd, bd, activation)


class CompileGroup:
    """``torch.compile`` of one eager function for one (direction, dtype, activation) group.

    Compiled on first use after ``torch._dynamo.reset()`` (so groups never share recompile limits
    or guards); a compile error is remembered and later cases of the group are skipped at once.
    Shapes change across sizes: dynamo's automatic dynamic shapes recompile once with a symbolic
    row count (C = 4096 stays static), so a group compiles about twice, not once per size.
    """

    def __init__(self, fn: Callable[..., Any], backend: str) -> None:
        self.fn = fn
        self.backend = backend
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


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    """State of one run: configuration, result rows, failures, budget, device facts."""

    cfg: Config
    copy_bps: float = math.nan
    meta: dict[str, Any] = field(default_factory=dict)

    # -- bookkeeping -------------------------------------------------------------------------
    def skip_reason(self) -> str | None:
        """Why new cases should not start: a lost CUDA context, or the time budget spent."""
        return self.stop_reason(self.cfg.budget_s)

    def fail(self, row: dict[str, Any], exc: BaseException) -> None:
        """Record a failed case (and stop launching if the CUDA context is gone)."""
        where = " ".join(str(row.get(k)) for k in ("op", "dtype", "activation", "numel", "impl") if row.get(k))
        row["error"] = self.record_failure(where, exc)

    @property
    def cuda(self) -> bool:
        """Whether cases run on a CUDA device (CUDA-event timing) or the CPU (perf_counter)."""
        return self.cfg.device.startswith("cuda")

    def add_timing(self, row: dict[str, Any], t: harness.Timing, nbytes: int) -> None:
        row.update(ms=t.ms, ms_min=t.min_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats,
                   timing=t.method, flushed_l2=t.flushed_l2)
        row["gbps"] = nbytes / (t.ms * 1e-3) / 1e9
        row["frac_copy"] = row["gbps"] * 1e9 / self.copy_bps if self.copy_bps > 0 else math.nan

    # -- inputs ----------------------------------------------------------------------------------
    def randn(self, shape: Sequence[int] | int, dtype: str, scale: float = 1.0) -> Any:
        torch = _torch()
        t = torch.randn(shape, dtype=getattr(torch, dtype), device=self.cfg.device)
        return t.mul_(scale) if scale != 1.0 else t


def _sync() -> None:
    harness.synchronize()


# -- 1. copy bandwidth ---------------------------------------------------------------------------


def run_copy(b: Bench) -> None:
    """Measure the device's copy bandwidth (read + write): the physical limit for this op."""
    row: dict[str, Any] = {"op": "copy", "impl": "torch copy_", "numel": b.cfg.copy_nbytes // 4,
                           "dtype": "float32"}
    try:
        b.copy_bps = harness.copy_bandwidth(b.cfg.device, nbytes=b.cfg.copy_nbytes,
                                            repeats=5 if b.cfg.dry_run else 20)
        row["gbps"] = b.copy_bps / 1e9
        row["frac_copy"] = 1.0
    except Exception as e:
        b.fail(row, e)
    b.rows.append(row)


# -- 2. host cost --------------------------------------------------------------------------------


def run_host_cost(b: Bench) -> list[dict[str, Any]]:
    """Host microseconds per call for tiny (1K-element float32) calls: cukit's paths against
    torch's own ``x + b`` and ``F.gelu(x + b)`` (and CuPy's paths when CuPy sees a GPU)."""
    torch = _torch()
    F = torch.nn.functional
    cfg = b.cfg
    rows: list[dict[str, Any]] = []
    act = HEADLINE_ACT
    shape = (1, cfg.host_numel)
    x = b.randn(shape, "float32")
    bias = b.randn(cfg.host_numel, "float32", 0.5)
    xr = x.clone().requires_grad_()
    br = bias.clone().requires_grad_()
    ref = reference_forward(x, bias, act)
    ref_add = x.double() + bias.double()
    cases: list[tuple[str, Callable[[], Any] | None, Any]] = [
        ("torch x + b", lambda: x + bias, ref_add),
        ("torch F.gelu(x + b)", lambda: F.gelu(x + bias), ref),
    ]
    try:  # resolved once, outside the timed loops (an import statement per call costs time too)
        import cukit
        import cukit.torch  # registers torch.ops.cukit
        from cukit.ops.bias_act import ACTIVATIONS as act_ids
        from cukit.ops.bias_act import forward_gpu

        cukit_op = torch.ops.cukit.bias_act
    except Exception as e:
        missing = f"cukit unavailable: {harness.short_error(e, 150)}"
        cases += [(label, None, missing) for label in (
            "cukit.bias_act (fast path, no grad)", "torch.ops.cukit.bias_act (dispatcher)",
            "cukit.bias_act (requires_grad: autograd)")]
    else:
        cases += [
            ("cukit.bias_act (fast path, no grad)", lambda: cukit.bias_act(x, bias, act), ref),
            ("torch.ops.cukit.bias_act (dispatcher)", lambda: cukit_op(x, bias, act), ref),
            ("cukit.bias_act (requires_grad: autograd)", lambda: cukit.bias_act(xr, br, act), ref),
        ]
        if x.is_cuda:
            act_id = act_ids[act]
            cases.append(("cukit forward_gpu (launch only, no validation)",
                          lambda: forward_gpu(x, bias, act_id), ref))
    if x.is_cuda:
        cases += _cupy_host_cases(x, bias, act, ref, ref_add)

    for label, fn, expected in cases:
        row: dict[str, Any] = {"op": "host", "impl": label, "numel": cfg.host_numel, "dtype": "float32",
                               "activation": act}
        reason = b.skip_reason()
        if reason:
            row["error"] = reason
            rows.append(row)
            continue
        try:
            if fn is None:
                raise RuntimeError(str(expected))
            out = fn()
            _sync()
            harness.check_close(_as_torch(out), expected, name=label)
            del out
            row["us_per_call"] = harness.host_cost_us(fn, iters=cfg.host_iters, rounds=cfg.host_rounds)
        except Exception as e:
            b.fail(row, e)
        rows.append(row)
    base = next((r.get("us_per_call") for r in rows if r["impl"] == "torch x + b"), None)
    for r in rows:
        if base and r.get("us_per_call"):
            r["ratio_vs_add"] = r["us_per_call"] / base
    b.rows.extend(rows)
    return rows


def _cupy_host_cases(x: Any, bias: Any, act: str, ref: Any, ref_add: Any) -> list[tuple[str, Any, Any]]:
    """CuPy rows of the host-cost table: cukit on CuPy arrays vs ``cupy.add`` (no GPU: none)."""
    try:
        import cupy

        xc = cupy.from_dlpack(x.detach())  # zero-copy views: x and bias stay alive with them
        bc = cupy.from_dlpack(bias.detach())
    except Exception as e:
        return [("cupy (unavailable)", None, f"CuPy unavailable: {harness.short_error(e, 150)}")]

    try:
        import cukit
    except Exception as e:
        return [("cupy.add(x, b)", lambda: cupy.add(xc, bc), ref_add),
                ("cukit.bias_act (CuPy arrays)", None, f"cukit unavailable: {harness.short_error(e, 150)}")]

    def cukit_cupy() -> Any:
        return cukit.bias_act(xc, bc, act)

    return [
        ("cupy.add(x, b)", lambda: cupy.add(xc, bc), ref_add),
        ("cukit.bias_act (CuPy arrays)", cukit_cupy, ref),
    ]


def _as_torch(a: Any) -> Any:
    """torch view of a CuPy result (validation compares torch tensors)."""
    torch = _torch()
    if isinstance(a, torch.Tensor):
        return a
    return torch.from_dlpack(a)


# -- 3./4. forward ------------------------------------------------------------------------------


def _forward_impls(b: Bench, dtype: str, act: str, use_compile: bool,
                   groups: dict[tuple[str, str, str], CompileGroup]) -> list[tuple[str, Callable[..., Any]]]:
    """(name, maker) pairs; maker(x, bias) returns the zero-argument callable to validate and time."""

    def make_cukit(x: Any, bias: Any) -> Callable[[], Any]:
        import cukit

        return lambda: cukit.bias_act(x, bias, act)

    def make_eager(x: Any, bias: Any) -> Callable[[], Any]:
        fn = EAGER[act]
        return lambda: fn(x, bias)

    impls: list[tuple[str, Callable[..., Any]]] = [("cukit", make_cukit), ("torch", make_eager)]
    if use_compile:
        group = groups.setdefault(("fwd", dtype, act), CompileGroup(EAGER[act], b.cfg.compile_backend))

        def make_compiled(x: Any, bias: Any) -> Callable[[], Any]:
            fn = group.get()
            return lambda: fn(x, bias)

        impls.append(("torch.compile", make_compiled))
    return impls


def run_forward_case(b: Bench, dtype: str, act: str, numel: int, use_compile: bool,
                     groups: dict[tuple[str, str, str], CompileGroup]) -> None:
    """One (dtype, activation, size): fresh random inputs, validate every impl, time it."""
    torch = _torch()
    rows_n, c = shape_for(numel)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    nbytes = (2 * numel + c) * itemsize
    base = {"op": "fwd", "dtype": dtype, "activation": act, "numel": numel, "shape": f"{rows_n}x{c}",
            "bytes": nbytes}
    impls = _forward_impls(b, dtype, act, use_compile, groups)
    case_rows = [{**base, "impl": name} for name, _ in impls]
    reason = b.skip_reason()
    if reason:
        for r in case_rows:
            r["error"] = reason
        b.rows.extend(case_rows)
        return
    x = bias = expected = None
    try:
        x = b.randn((rows_n, c), dtype)
        bias = b.randn(c, dtype, 0.5)
        expected = reference_forward(x, bias, act)
    except Exception as e:  # inputs or reference failed: every impl of the case fails with it
        for r in case_rows:
            b.fail(r, e)
        b.rows.extend(case_rows)
        return
    warmup, repeats = repeats_for(numel, b.cfg)
    for (name, make), row in zip(impls, case_rows, strict=True):
        reason = b.skip_reason()
        if reason:
            row["error"] = reason
            continue
        group = groups.get(("fwd", dtype, act)) if name == "torch.compile" else None
        try:
            fn = make(x, bias)
            harness.poison_allocator((rows_n, c), x.dtype, x.device)
            t_first = time.perf_counter()
            out = fn()
            _sync()
            row["first_call_s"] = time.perf_counter() - t_first
            res = harness.check_close(out, expected, name=f"{name} y",
                                      **_tolerances(name, dtype))
            row["rel_err"] = res.rel_err
            del out
            t = harness.time_cuda(fn, warmup=warmup, repeats=repeats, flush_l2=b.cfg.flush_l2, cuda=b.cuda)
            b.add_timing(row, t, nbytes)
        except Exception as e:
            if group is not None and "first_call_s" not in row:  # compiling failed, not validation
                group.error = harness.short_error(e, 150)
            b.fail(row, e)
    _speedups(case_rows)
    b.rows.extend(case_rows)
    del x, bias, expected


def _tolerances(impl: str, dtype: str) -> dict[str, Any]:
    """cukit must match the reference elementwise; the torch baselines round differently (bf16
    eager rounds x + b to bf16 before the activation), so they are held to a norm bound only."""
    if impl.startswith("cukit"):
        return {}
    return {"elementwise": False, "rel_tol": 2e-2 if dtype in ("bfloat16", "float16") else 1e-5}


def _speedups(case_rows: list[dict[str, Any]]) -> None:
    eager = next((r.get("ms") for r in case_rows if r["impl"] == "torch"), None)
    for r in case_rows:
        if eager and r.get("ms"):
            r["speedup_vs_torch"] = eager / r["ms"]


# -- 5. backward --------------------------------------------------------------------------------


def run_backward_case(b: Bench, dtype: str, act: str, numel: int, use_compile: bool,
                      groups: dict[tuple[str, str, str], CompileGroup]) -> None:
    """One backward case: dy, x, bias fresh; every impl validated on (dx, dbias), then timed."""
    torch = _torch()
    rows_n, c = shape_for(numel)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    nbytes = (3 * numel + 2 * c) * itemsize
    base = {"op": "bwd", "dtype": dtype, "activation": act, "numel": numel, "shape": f"{rows_n}x{c}",
            "bytes": nbytes}
    names = ["cukit", "cukit-autograd", "torch"] + (["torch.compile"] if use_compile else [])
    case_rows = [{**base, "impl": n} for n in names]
    reason = b.skip_reason()
    if reason:
        for r in case_rows:
            r["error"] = reason
        b.rows.extend(case_rows)
        return
    try:
        x = b.randn((rows_n, c), dtype)
        bias = b.randn(c, dtype, 0.5)
        dy = b.randn((rows_n, c), dtype)
        exp_dx, exp_db = reference_backward(dy, x, bias, act)
    except Exception as e:
        for r in case_rows:
            b.fail(r, e)
        b.rows.extend(case_rows)
        return
    xl = x.detach().requires_grad_()  # leaves for the autograd rows
    bl = bias.detach().clone().requires_grad_()
    group = None
    if use_compile:
        group = groups.setdefault(("bwd", dtype, act), CompileGroup(EAGER[act], b.cfg.compile_backend))
    warmup, repeats = repeats_for(numel, b.cfg)

    def grad_of(forward: Callable[[Any, Any], Any]) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
        def setup() -> Any:
            return forward(xl, bl)

        def backward(y: Any) -> Any:
            return torch.autograd.grad(y, (xl, bl), dy)

        return setup, backward

    for row in case_rows:
        name = row["impl"]
        reason = b.skip_reason()
        if reason:
            row["error"] = reason
            continue
        try:
            setup: Callable[[], Any] | None
            if name == "cukit":
                import cukit.torch  # registers torch.ops.cukit

                xd, bd = x.detach(), bias.detach()
                setup, fn = None, (lambda xd=xd, bd=bd: torch.ops.cukit.bias_act_backward(dy, xd, bd, act))
            elif name == "cukit-autograd":
                import cukit

                setup, fn = grad_of(lambda xx, bb: cukit.bias_act(xx, bb, act))
            elif name == "torch":
                setup, fn = grad_of(EAGER[act])
            else:
                assert group is not None
                compiled = group.get()
                setup, fn = grad_of(compiled)
            harness.poison_allocator((rows_n, c), x.dtype, x.device)
            harness.poison_allocator((c,), x.dtype, x.device)
            t_first = time.perf_counter()
            state = setup() if setup is not None else None
            dx, db = fn(state) if setup is not None else fn()
            _sync()
            row["first_call_s"] = time.perf_counter() - t_first
            del state
            tol = _tolerances(name, dtype)
            r1 = harness.check_close(dx, exp_dx, name=f"{name} dx", **tol)
            # dbias is a sum over rows: summation order differs, so a norm bound, not elementwise
            r2 = harness.check_close(db, exp_db, name=f"{name} dbias", elementwise=False,
                                     rel_tol=tol.get("rel_tol"))
            row["rel_err"] = max(r1.rel_err, r2.rel_err)
            del dx, db
            t = harness.time_cuda(fn, warmup=warmup, repeats=repeats, flush_l2=b.cfg.flush_l2, setup=setup,
                                  cuda=b.cuda)
            b.add_timing(row, t, nbytes)
        except Exception as e:
            if name == "torch.compile" and group is not None and "first_call_s" not in row:
                group.error = harness.short_error(e, 150)
            b.fail(row, e)
    _speedups(case_rows)
    b.rows.extend(case_rows)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

TIMING_COLUMNS: list[str | tuple[str, str]] = [
    "op", "dtype", ("activation", "act"), ("numel", "numel"), "impl", ("ms", "ms (median)"),
    ("ms_p20", "p20"), ("ms_p80", "p80"), ("gbps", "GB/s"), ("frac_copy", "frac of copy"),
    ("speedup_vs_torch", "vs torch"), ("error", "error"),
]
HOST_COLUMNS: list[str | tuple[str, str]] = [
    ("impl", "call (1K float32 elements)"), ("us_per_call", "host us/call"),
    ("ratio_vs_add", "ratio to x + b"), ("error", "error"),
]
_FMT = {"numel": lambda v: fmt_numel(v) if isinstance(v, int) else "-",
        "error": lambda v: "" if v is None else str(v)[:90]}
_FMT_SHORT = {**_FMT, "error": lambda v: "" if v is None else str(v)[:48]}  # the summary: keep it short


def headline_rows(rows: Sequence[dict[str, Any]], op: str, act: str = HEADLINE_ACT) -> list[dict[str, Any]]:
    """Rows of `op` for `act` at >= 64M elements (or at the largest size run, in smoke runs)."""
    sel = [r for r in rows if r.get("op") == op and r.get("activation") == act]
    if not sel:
        return []
    big = [r for r in sel if r["numel"] >= HEADLINE_NUMEL]
    if not big:
        top = max(r["numel"] for r in sel)
        big = [r for r in sel if r["numel"] == top]
    return big


def _sizes_label(rows: Sequence[dict[str, Any]]) -> str:
    if rows and min(r["numel"] for r in rows) < HEADLINE_NUMEL:
        return f"largest size run ({fmt_numel(max(r['numel'] for r in rows))}; the targets are for >= 64M)"
    return ">= 64M elements"


def target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """PASS/FAIL against the issue's targets, per dtype, from the forward headline rows."""
    out = []
    fwd = [r for r in headline_rows(rows, "fwd") if r["impl"] == "cukit"]
    for dtype in sorted({r["dtype"] for r in fwd}):
        sel = [r for r in fwd if r["dtype"] == dtype]
        fr = [r.get("frac_copy") for r in sel]
        sp = [r.get("speedup_vs_torch") for r in sel]
        sizes = ",".join(fmt_numel(r["numel"]) for r in sel)
        ok_f = all(isinstance(v, float) and v >= TARGET_FRACTION for v in fr)
        ok_s = all(isinstance(v, float) and v >= TARGET_SPEEDUP for v in sp)
        fmt = ", ".join(harness.format_value(v) for v in fr)
        fmt_s = ", ".join(harness.format_value(v) for v in sp)
        out.append(f"  fwd {dtype:<9} @ {sizes}: fraction of copy bw [{fmt}] >= {TARGET_FRACTION}: "
                   f"{'PASS' if ok_f else 'FAIL'};  vs torch eager [{fmt_s}] >= {TARGET_SPEEDUP}x: "
                   f"{'PASS' if ok_s else 'FAIL'}")
    return out or ["  no forward headline rows (all cases failed or were skipped)"]


def print_summary(b: Bench, env: dict[str, Any], host_rows: list[dict[str, Any]], saved: list[str]) -> None:
    """The headline, printed last (the device tool returns only the end of the output)."""
    print()
    print("=" * 100)
    print(f"SUMMARY {NAME}: {env.get('gpu') or 'CPU (dry run)'} | torch {env.get('torch')} | "
          f"cupy {env.get('cupy')} | commit {str(env.get('git_commit'))[:12]} | {b.elapsed():.0f} s")
    print(f"copy bandwidth (read + write, {b.cfg.copy_nbytes >> 20} MiB copy): "
          f"{harness.format_value(b.copy_bps / 1e9)} GB/s")
    cols: list[str | tuple[str, str]] = [
        "dtype", ("numel", "numel"), "impl", ("ms", "ms"), ("gbps", "GB/s"), ("frac_copy", "frac of copy"),
        ("speedup_vs_torch", "vs torch"), ("error", "error"),
    ]
    fwd = headline_rows(b.rows, "fwd")
    harness.print_table(fwd, cols, title=f"\nforward {HEADLINE_ACT}, {_sizes_label(fwd)}:", formatters=_FMT_SHORT)
    bwd = headline_rows(b.rows, "bwd")
    harness.print_table(bwd, cols, title=f"\nbackward {HEADLINE_ACT} (dx + dbias), {_sizes_label(bwd)}:",
                        formatters=_FMT_SHORT)
    others = [r for r in b.rows if r.get("op") in ("fwd", "bwd") and r.get("activation") != HEADLINE_ACT]
    if others:
        harness.print_table(
            others, ["op", ("activation", "act"), "dtype", ("numel", "numel"), "impl", ("gbps", "GB/s"),
                     ("frac_copy", "frac of copy"), ("speedup_vs_torch", "vs torch"), ("error", "error")],
            title="\nother activations:", formatters=_FMT_SHORT)
    harness.print_table(host_rows, HOST_COLUMNS, title="\nsmall-call host cost:", formatters=_FMT_SHORT)
    print("\ntargets (forward, >= 64M elements):")
    for line in target_lines(b.rows):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--quick", action="store_true", help="1M and 64M elements only, fewer repeats (< 60 s)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke mode: tiny sizes, torch CPU tensors, perf_counter timing")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip cases that would start after this many seconds (default 170, quick 55)")
    p.add_argument("--device", default=None,
                   help="torch device (default cuda; cpu with --dry-run; --dry-run --device cuda: tiny GPU run)")
    p.add_argument("--seed", type=int, default=0, help="torch random seed")
    return p.parse_args(argv)


def run(cfg: Config) -> tuple[Bench, list[dict[str, Any]], dict[str, Any], list[str]]:
    """Run every section; never raises for a failing case. Returns (bench, host rows, env, saved)."""
    torch = _torch()
    torch.manual_seed(cfg.seed)
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg)
    b.meta["config"] = {k: v for k, v in vars(cfg).items()}
    if cfg.compile:
        harness.configure_dynamo()
    groups: dict[tuple[str, str, str], CompileGroup] = {}

    print(f"{NAME}: device {cfg.device}, dtypes {', '.join(cfg.dtypes)}, fwd sizes "
          f"{', '.join(fmt_numel(n) for n in cfg.fwd_sizes)}, compile {cfg.compile} ({cfg.compile_backend})",
          flush=True)
    run_copy(b)
    print(f"copy bandwidth: {harness.format_value(b.copy_bps / 1e9)} GB/s", flush=True)
    host_rows: list[dict[str, Any]] = []
    try:
        host_rows = run_host_cost(b)
    except Exception as e:  # the inputs themselves failed
        row: dict[str, Any] = {"op": "host", "impl": "host cost setup"}
        b.fail(row, e)
        b.rows.append(row)
        host_rows = [row]
    harness.print_table(host_rows, HOST_COLUMNS, title="\nsmall-call host cost", formatters=_FMT)

    sections: list[tuple[str, Callable[..., None], list[tuple[str, str, int, bool]]]] = [
        ("forward", run_forward_case,
         [(d, HEADLINE_ACT, n, cfg.compile) for d in cfg.dtypes for n in cfg.fwd_sizes]
         + [(cfg.other_dtype, a, cfg.other_numel, cfg.compile and cfg.compile_other_acts)
            for a in cfg.other_acts]),
        ("backward", run_backward_case,
         [(d, HEADLINE_ACT, n, cfg.compile) for d in cfg.dtypes for n in cfg.bwd_sizes]
         + [(cfg.other_dtype, a, cfg.other_numel, False) for a in cfg.other_acts]),
    ]
    for title, case_fn, cases in sections:
        start = len(b.rows)
        for dtype, act, numel, use_compile in cases:
            try:
                case_fn(b, dtype, act, numel, use_compile, groups)
            except Exception as e:  # a bug in the case runner itself: record, go on
                row = {"op": title[:3], "dtype": dtype, "activation": act, "numel": numel, "impl": "case"}
                b.fail(row, e)
                b.rows.append(row)
            if b.cuda and numel >= 1 << 24:  # hand big blocks back (gc.collect costs ~0.1 s: not per tiny case)
                gc.collect()
                torch.cuda.empty_cache()
            done = [r for r in b.rows[start:] if r.get("numel") == numel and r.get("activation") == act
                    and r.get("dtype") == dtype]
            _progress(title, done)
        harness.print_table(b.rows[start:], TIMING_COLUMNS, title=f"\n{title}", formatters=_FMT)
    b.meta["compile_groups"] = {"/".join(k): (g.error or "ok") for k, g in groups.items()}

    env = harness.environment()
    saved: list[str] = []
    try:
        paths = harness.save_results(
            b.rows, NAME, cfg.out, env=env,
            meta={**b.meta, "copy_gbps": b.copy_bps / 1e9, "failures": b.failures, "elapsed_s": b.elapsed(),
                  "targets": {"fraction": TARGET_FRACTION, "speedup": TARGET_SPEEDUP,
                              "min_numel": HEADLINE_NUMEL}},
            plot_kwargs={
                "x": "numel", "y": "gbps", "series": "impl", "panels": ("op", "dtype"),
                "where": lambda r: r.get("op") in ("fwd", "bwd") and r.get("activation") == HEADLINE_ACT,
                "hline": b.copy_bps / 1e9, "xlabel": "elements", "ylabel": "GB/s (min bytes)",
                "title": f"bias_act {HEADLINE_ACT}: {env.get('gpu') or 'CPU dry run'}",
            },
        )
        saved = [str(p) for p in paths]
    except Exception as e:
        b.failures.append(f"saving results: {harness.short_error(e)}")
    print_summary(b, env, host_rows, saved)
    return b, host_rows, env, saved


def _progress(title: str, rows: Sequence[dict[str, Any]]) -> None:
    parts = []
    for r in rows:
        if r.get("error"):
            parts.append(f"{r['impl']}=ERR")
        elif r.get("gbps") is not None:
            parts.append(f"{r['impl']}={r['ms']:.4g}ms/{r['gbps']:.4g}GB/s")
    if rows:
        r0 = rows[0]
        print(f"  {title} {r0.get('dtype')} {r0.get('activation')} {fmt_numel(r0.get('numel', 0))}: "
              + "  ".join(parts), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    cfg = config_from_args(args)
    return harness.main_run(NAME, cfg, run)


if __name__ == "__main__":
    sys.exit(main())
