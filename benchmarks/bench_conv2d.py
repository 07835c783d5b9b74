"""Benchmark ``cukit.conv2d`` (y = act(conv2d(x, w) + b), one implicit-GEMM kernel) against
``F.conv2d`` + the activation (cuDNN) and ``torch.compile`` of it.

Usage::

    python benchmarks/bench_conv2d.py [--out DIR] [--quick] [--dry-run] [--no-compile] [--budget-s S]

Cases (the demo's first, the targets: the demo CNN is host-bound, so host time per call and the
number of launches matter as much as the kernels):

- ``demo conv1``: x (64, 1, 8, 8), w (16, 1, 3, 3), padding 1: the demo CNN's first layer (its
  input needs no gradient, so its backward has no dx);
- ``demo conv2``: x (64, 16, 8, 8), w (32, 16, 3, 3), padding 1;
- ``56x56 3x3``: x (32, 64, 56, 56), w (64, 64, 3, 3), padding 1 (a ResNet stage: compute-bound);
- ``56x56 1x1``: x (32, 64, 56, 56), w (64, 64, 1, 1).

Each in float32 and bfloat16, activation gelu, for two passes: ``fwd`` (no autograd) and
``fwd+bwd`` (forward with autograd, then ``torch.autograd.grad`` of the inputs that need one: the
layer's share of a training step). Columns: ``kernel_us`` (device time, CUDA events, median; inputs
flushed from L2 for the 56x56 cases), ``host_us`` (host time per call while the device keeps up:
what a host-bound model pays; the demo shapes only), ``tflops`` (the convolution's multiply-adds x 2 over kernel time:
forward 2 N K P Q C R S; fwd+bwd adds dW and, when x needs one, dx), and ratios against torch eager
of the same case (``kernel_vs_torch``, ``host_vs_torch``: > 1 means cukit is faster).

float32 is compared in IEEE float32 on both sides (TF32 off for cuDNN and cuBLAS during the run:
cukit's kernels are SIMT float32); bfloat16 lets cuDNN use its tensor cores (cukit's kernels are
SIMT with fp32 accumulation: expect cuDNN ahead on the large cases). Every case is validated
against the float64 reference (``F.conv2d`` on upcast inputs) before it is timed.

``--dry-run`` runs the same code on the CPU with tiny shapes (cukit's CPU path, torch.compile with
the "eager" backend, perf_counter timing): it tests the script, not the kernels. Results go to
``--out DIR``, else to a new temporary folder (printed).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_conv2d from the repository root
    from benchmarks import harness

NAME = "bench_conv2d"
ACTIVATION = "gelu"


@dataclass(frozen=True)
class Shape:
    """One convolution: x (N, C, H, W), w (K, C, R, S), padding; input_grad: x needs a gradient;
    host_bound: microseconds of device work, where host time per call is what a model pays (measured
    only there); flush_l2: inputs evicted from L2 before each timed call (the large cases)."""

    name: str
    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    padding: int
    input_grad: bool = True
    host_bound: bool = True
    flush_l2: bool = False

    def flops(self, pas: str) -> float:
        N, C, H, W = self.x
        K, _, R, S = self.w
        P = H + 2 * self.padding - R + 1
        Q = W + 2 * self.padding - S + 1
        fwd = 2.0 * N * K * P * Q * C * R * S
        if pas == "fwd":
            return fwd
        return fwd * (3 if self.input_grad else 2)


SHAPES = (
    Shape("demo conv1", (64, 1, 8, 8), (16, 1, 3, 3), 1, input_grad=False),
    Shape("demo conv2", (64, 16, 8, 8), (32, 16, 3, 3), 1),
    Shape("56x56 3x3", (32, 64, 56, 56), (64, 64, 3, 3), 1, host_bound=False, flush_l2=True),
    Shape("56x56 1x1", (32, 64, 56, 56), (64, 64, 1, 1), 0, host_bound=False, flush_l2=True),
)
SHAPES_DRY = (
    Shape("demo conv1", (4, 1, 8, 8), (4, 1, 3, 3), 1, input_grad=False),
    Shape("demo conv2", (4, 4, 8, 8), (8, 4, 3, 3), 1),
)
PASSES = ("fwd", "fwd+bwd")


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    shapes: tuple[Shape, ...] = SHAPES
    compile: bool = True
    compile_backend: str = "inductor"
    warmup: int = 10
    repeats: int = 50
    host_iters: int = 300
    host_rounds: int = 5
    dry_run: bool = False
    budget_s: float = 400.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(cfg, shapes=SHAPES[:3], repeats=20, host_iters=100, host_rounds=3, budget_s=150.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", shapes=SHAPES_DRY, compile_backend="eager", warmup=1, repeats=3,
                      host_iters=5, host_rounds=2, dry_run=True, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device)
    if args.no_compile:
        cfg = replace(cfg, compile=False)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


def _torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# The functions being compared
# ---------------------------------------------------------------------------------------------


def torch_conv_act(padding: int) -> Callable[[Any, Any, Any], Any]:
    """The baseline: cuDNN's convolution (bias included), then the activation: two kernels."""
    F = _torch().nn.functional

    def conv_gelu(x: Any, w: Any, b: Any) -> Any:
        return F.gelu(F.conv2d(x, w, b, padding=padding))

    return conv_gelu


def reference(x: Any, w: Any, b: Any, dy: Any, padding: int, inputs: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
    """The float64 oracle: y, and the gradients of the `inputs` (among x, w, b) for dy."""
    torch = _torch()
    xd, wd, bd = (t.detach().double().requires_grad_(any(t is i for i in inputs)) for t in (x, w, b))
    y = torch_conv_act(padding)(xd, wd, bd)
    return y.detach(), torch.autograd.grad(y, [t for t in (xd, wd, bd) if t.requires_grad], dy.double())


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """cuDNN and cuBLAS without TF32 (restored on exit): float32 on both sides means IEEE float32."""
    torch = _torch()
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    cfg: Config
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def skip_reason(self) -> str | None:
        return self.stop_reason(self.cfg.budget_s)


def _impls(b: Bench, shape: Shape) -> list[tuple[str, Callable[[Any, Any, Any], Any]]]:
    import cukit

    pad = shape.padding

    def cukit_fn(x: Any, w: Any, bias: Any) -> Any:
        return cukit.conv2d(x, w, bias, 1, pad, 1, ACTIVATION)

    impls: list[tuple[str, Callable[[Any, Any, Any], Any]]] = [("cukit", cukit_fn), ("torch", torch_conv_act(pad))]
    if b.cfg.compile:
        torch = _torch()
        torch._dynamo.reset()  # each case compiles afresh (no recompile limits shared between cases)
        impls.append(("torch.compile", torch.compile(torch_conv_act(pad), backend=b.cfg.compile_backend)))
    return impls


def run_case(b: Bench, shape: Shape, dtype: str) -> None:
    """One shape and dtype: every impl and pass validated, then timed (kernel and host)."""
    torch = _torch()
    cfg = b.cfg
    base = {"shape": shape.name, "x": "x".join(map(str, shape.x)), "w": "x".join(map(str, shape.w)),
            "dtype": dtype, "activation": ACTIVATION}
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    dt = getattr(torch, dtype)
    x = torch.randn(shape.x, device=cfg.device, generator=g).to(dt)
    fan_in = shape.w[1] * shape.w[2] * shape.w[3]
    w = (torch.randn(shape.w, device=cfg.device, generator=g) / math.sqrt(fan_in)).to(dt)
    bias = torch.randn(shape.w[0], device=cfg.device, generator=g).mul_(0.1).to(dt)
    xr = x.clone().requires_grad_(shape.input_grad)
    wr, br = w.clone().requires_grad_(), bias.clone().requires_grad_()
    inputs = [t for t in (xr, wr, br) if t.requires_grad]
    N, _, H, W = shape.x
    K, _, R, S = shape.w
    dy = torch.randn(N, K, H + 2 * shape.padding - R + 1, W + 2 * shape.padding - S + 1, device=cfg.device,
                     generator=g).to(dt)
    expected, expected_grads = reference(xr, wr, br, dy, shape.padding, inputs)
    rel_tol = {"float32": 1e-5, "float64": 1e-12}.get(dtype, 2e-2)
    for impl, fn in _impls(b, shape):
        for pas in PASSES:
            row = {**base, "pass": pas, "impl": impl}
            b.rows.append(row)
            reason = b.skip_reason()
            if reason:
                row["error"] = reason
                continue
            try:
                if pas == "fwd":
                    def call(fn: Callable[..., Any] = fn) -> Any:
                        with torch.no_grad():
                            return fn(x, w, bias)
                    harness.check_close(call(), expected, name=f"{impl} y", elementwise=False, rel_tol=rel_tol)
                else:
                    def call(fn: Callable[..., Any] = fn) -> Any:
                        return torch.autograd.grad(fn(xr, wr, br), inputs, dy)
                    for name, got, want in zip(("dx", "dw", "db")[3 - len(inputs):], call(), expected_grads,
                                               strict=True):
                        # sums over many terms, in another order than the reference's: a norm bound
                        harness.check_close(got, want, name=f"{impl} {name}", elementwise=False, rel_tol=rel_tol * 10)
                harness.synchronize()
                t = harness.time_cuda(call, warmup=cfg.warmup, repeats=cfg.repeats,
                                      flush_l2=shape.flush_l2 and b.cuda, cuda=b.cuda)
                row.update(kernel_us=t.ms * 1e3, kernel_us_p20=t.p20_ms * 1e3, kernel_us_p80=t.p80_ms * 1e3,
                           repeats=t.repeats, timing=t.method)
                row["tflops"] = shape.flops(pas) / (t.ms * 1e-3) / 1e12
                if shape.host_bound:  # elsewhere the launch queue fills and host time becomes device time
                    row["host_us"] = harness.host_cost_us(call, iters=cfg.host_iters, rounds=cfg.host_rounds)
            except Exception as e:
                row["error"] = b.record_failure(f"{shape.name} {dtype} {pas} {impl}", e)
    _ratios(b.rows, base)


def _ratios(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """kernel_vs_torch and host_vs_torch: torch eager's time over each row's, same case and pass."""
    mine = [r for r in rows if all(r.get(k) == v for k, v in base.items())]
    for pas in PASSES:
        ref = next((r for r in mine if r["pass"] == pas and r["impl"] == "torch"), None)
        for r in mine:
            if r["pass"] != pas or ref is None:
                continue
            for key, out in (("kernel_us", "kernel_vs_torch"), ("host_us", "host_vs_torch")):
                if r.get(key) and ref.get(key):
                    r[out] = ref[key] / r[key]


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "shape", "dtype", "pass", "impl", ("kernel_us", "kernel us"), ("tflops", "TFLOP/s"),
    ("kernel_vs_torch", "kernel vs torch"), ("host_us", "host us"), ("host_vs_torch", "host vs torch"),
    ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    """The headline, printed last (the device tool returns only the end of the output)."""
    print()
    harness.print_summary_head(NAME, env, b.elapsed(), f"activation {ACTIVATION}; float32 without TF32 on both sides",
                               cpu="CPU (dry run: numbers mean nothing)")
    harness.print_table(b.rows, COLUMNS, title="\nconv2d + bias + gelu (ratios: torch eager / this, > 1: faster):",
                        formatters=_FMT)
    demo = [r for r in b.rows if r.get("shape", "").startswith("demo") and r["impl"] == "cukit"
            and r["pass"] == "fwd+bwd"]
    if demo:
        print("\ndemo shapes, forward + backward, cukit vs torch eager (host-bound models care about host us):")
        for r in demo:
            print(f"  {r['shape']:<11} {r['dtype']:<9} host {harness.format_value(r.get('host_vs_torch'))}x, "
                  f"kernel {harness.format_value(r.get('kernel_vs_torch'))}x")
    harness.print_outcome(b.failures, saved)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "three shapes, fewer repeats", no_compile=True)
    return p.parse_args(argv)


def run(cfg: Config) -> tuple[Bench, dict[str, Any], list[str]]:
    """Every case; never raises for a failing case."""
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = {k: (v if k != "shapes" else [s.name for s in v]) for k, v in vars(cfg).items()}
    if cfg.compile:
        harness.configure_dynamo()
    print(f"{NAME}: device {cfg.device}, dtypes {', '.join(cfg.dtypes)}, shapes "
          f"{', '.join(s.name for s in cfg.shapes)}, compile {cfg.compile} ({cfg.compile_backend})", flush=True)
    with ieee_float32():
        for shape in cfg.shapes:
            for dtype in cfg.dtypes:
                try:
                    run_case(b, shape, dtype)
                except Exception as e:  # the inputs or the reference failed
                    b.rows.append({"shape": shape.name, "dtype": dtype, "impl": "case",
                                   "error": b.record_failure(f"{shape.name} {dtype}", e)})
                print(f"  {shape.name} {dtype}: done", flush=True)
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
