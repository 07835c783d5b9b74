"""Benchmark ``cukit.matmul`` and ``cukit.linear`` against cuBLAS (``torch.matmul``) and torch eager.

Usage::

    python benchmarks/bench_matmul.py [--out DIR] [--quick] [--dry-run] [--budget-s S] [--modes M,...] [--gemm]
                                      [--tiles]

Modes (each compares cukit and cuBLAS at the same precision, in the same run, on the same inputs):

========  ==========  ==============================================================================
mode      dtype       precision
========  ==========  ==============================================================================
fp32      float32     IEEE float32 on CUDA cores (SIMT): ``precision="ieee"``, TF32 off in torch
                      (``torch.backends.cuda.matmul.allow_tf32 = False``)
tf32      float32     TF32 tensor cores: ``precision="tf32"``, ``allow_tf32 = True``
bf16      bfloat16    tensor cores, float32 accumulation (torch's reduced-precision reduction flags
                      left at their defaults; recorded in the JSON)
fp16      float16     likewise
========  ==========  ==============================================================================

Sections, in the order they run (the issue's targets first, so a run cut short by ``--budget-s``
still has them):

1. the headline cases: fp32 4096^3, bf16 4096^3 and 8192^3, the in-model shapes in bf16 (1024^3,
   8192x768x768 and 4096x4096x1024: ``cukit.matmul(a, b)`` per call, target 0.9x cuBLAS),
   bf16 4097x4095x4093 (M x N x K), and
   ``cukit.linear(x, W, b, "gelu")`` vs torch eager ``F.gelu(F.linear(x, W, b))`` in bf16 at a
   transformer MLP shape (x 8192x4096, W 16384x4096);
2. every mode over square sizes 256 ... 8192, 4097x4095x4093, 32768x1024x1024, and a batched bf16
   case (64 x 512^3);
3. the linear case in float32 (IEEE);
4. the readable v1 kernel (``matmul_v1``, through cukit/ops/matmul.py's private kernel hook) at
   fp32 1024-4096: the progression from the first kernel to the tuned one;
5. with ``--gemm`` only: ``cukit.ops.matmul.gemm(a, b, c, beta=1)``, bf16 inputs accumulated into a
   float32 C (the fused-loss ``dW += G^T X``: A a transposed view), against ``cukit.matmul`` and
   cuBLAS on the same bf16 operands with a bf16 result (``vs_cukit``: the bf16-output path's ms
   over gemm's; it writes 2x the bytes of C and reads C too).
6. weight gradients: ``cukit.matmul(G.T, X)`` with G (K, M) read transposed, as autograd's
   ``dW = G^T X`` over K tokens, in fp32 and bf16 against cuBLAS: outputs with few tiles and a
   long K (the SIMT family's split-K, ``matmul_simt.choose_split``);
7. with ``--tiles`` only: the Hopper TMA kernel forced to each block-tile width (``cukit tma256``,
   ``tma192``, ``tma128``, ``tma64``: ``matmul_tc.prepare(g, tile_n=...)``) beside ``cukit.matmul`` (the wave
   model's pick) and cuBLAS, bf16, at shapes that exercise the wave model (small problems, the
   in-model shapes, and two with full waves for every width: the calibration of
   ``matmul_tc.TMA_PINGPONG_RATE`` / ``TMA_NARROW_RATE`` / ``TMA_MID_RATE``); the summary lists, per shape, the
   fastest width and the model's pick. Needs compute capability 9.0 (elsewhere the rows say
   skipped).

Validation before timing: each case draws fresh standard-normal inputs; every implementation runs
once into an output poisoned with NaN (through torch's caching allocator) and must have no NaN/inf
anywhere and a relative error ``||C - C_ref|| / ||C_ref||`` under the mode's bound against a
float64 product of the same (upcast) inputs: fp32 1e-5, tf32 3e-3, bf16/fp16 1e-2. For M > 1024
the reference covers a subsample of rows (the first and last 128 and 256 spread between: partial
edge tiles included). A failing case is a row with an ``error``; the run goes on.

Timing: CUDA events around each call, median of repeats, L2 flushed between repeats (outside the
timed region). The repeat count adapts to the call's duration (a second, untimed call estimates
it): about ``repeat_s`` seconds of timed calls per implementation, at least 3, at most 100.
TFLOP/s = 2*M*N*K*batch / time; ``vs_cublas`` (``vs_torch`` for linear) = baseline ms / this ms
(> 1: cukit faster).

``--dry-run`` runs the same code on the CPU with tiny sizes (cukit's torch fallback, perf_counter
timing); ``--dry-run --device cuda`` runs those tiny sizes through the real CUDA paths. A full run
takes < 4 minutes on an H100/H200 (``--budget-s`` default 200), ``--quick`` < 90 s.

Results: ``<out>/bench_matmul.{json,csv,png}`` and nothing else (``--out DIR``, else a new temporary
folder, printed; ``benchmarks/results/`` is written only when named, never by ``--dry-run``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_matmul from the repository root
    from benchmarks import harness

NAME = "bench_matmul"


@dataclass(frozen=True)
class Mode:
    """A (dtype, precision) pair benchmarked as one family of cases."""

    name: str
    dtype: str
    precision: str | None  # cukit precision= / torch TF32 switch; None for 16-bit types
    label: str  # panel and table label
    rel_tol: float  # validation bound on ||C - C_ref|| / ||C_ref||


MODES: dict[str, Mode] = {
    "fp32": Mode("fp32", "float32", "ieee", "float32 SIMT (ieee)", 1e-5),
    "tf32": Mode("tf32", "float32", "tf32", "float32 TF32", 3e-3),
    "bf16": Mode("bf16", "bfloat16", None, "bfloat16", 1e-2),
    "fp16": Mode("fp16", "float16", None, "float16", 1e-2),
}

# The targets: (mode, shape, minimum ratio cukit / cuBLAS speed).
TARGET_FP32 = 0.9
TARGET_BF16 = 0.75
TARGET_ODD = 3.0
TARGET_LINEAR = 1.2
TARGET_MEDIUM = 0.9  # the in-model issue: cukit.matmul bf16 per call at the shapes models use

# A tf32 result closer to the float64 product than this was computed without TF32 rounding (TF32
# is a permission: cukit and cuBLAS may fall back to IEEE float32); the summary says so.
TF32_MIN_ERR = 2e-5

# Kernel families the private hook can force (cukit/ops/matmul.py).
V1_KERNEL = "simt_v1"
GEMM_IMPL = "cukit gemm fp32 +="  # cukit.ops.matmul.gemm(a, b, c_float32, beta=1)
HOOK_NAMES = ("_matmul_gpu", "matmul_gpu", "_gpu_matmul", "_launch_matmul")
# The TMA kernel forced to one block-tile width (section 6): "cukit tma<width>".
TILE_PREFIX = "cukit tma"
TILE_IMPLS = tuple(f"{TILE_PREFIX}{bn}" for bn in (256, 192, 128, 64))


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

Shape = tuple[int, int, int]  # (M, N, K)


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    modes: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
    squares: dict[str, tuple[int, ...]] = field(default_factory=lambda: {
        m: (256, 512, 1024, 2048, 4096, 8192) for m in MODES})
    odd: Shape = (4097, 4095, 4093)
    odd_modes: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
    tall: Shape = (32768, 1024, 1024)
    tall_modes: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
    batched: tuple[int, int, int, int] = (64, 512, 512, 512)  # (batch, M, N, K)
    batched_modes: tuple[str, ...] = ("bf16",)
    linear: Shape = (8192, 16384, 4096)  # (tokens, out features, in features): x (M, K), W (N, K)
    linear_modes: tuple[str, ...] = ("bf16", "fp32")
    v1_sizes: tuple[int, ...] = (1024, 2048, 4096)
    # gemm into float32 (section 5, --gemm): (M, N, K) of dW (V, H) += G^T (V, T) X (T, H)
    gemm: tuple[Shape, ...] = ()
    gemm_shapes: tuple[Shape, ...] = ((4096, 4096, 4096), (4096, 1024, 4096), (8192, 768, 768))
    # weight gradients (section 6): (M, N, K) of dW (M, N) = G^T (M, K) X (K, N), G read transposed
    dw: tuple[Shape, ...] = ((1024, 256, 16384), (256, 1024, 16384), (768, 768, 16384), (768, 3072, 4096))
    dw_modes: tuple[str, ...] = ("fp32", "bf16")
    # TMA tile widths forced (section 7, --tiles)
    tiles: tuple[Shape, ...] = ()
    tile_shapes: tuple[Shape, ...] = (
        (1024, 1024, 1024), (512, 1024, 4096), (2048, 512, 2048), (4096, 768, 768), (8192, 768, 768),
        (4096, 4096, 1024), (2048, 2048, 2048), (4096, 2048, 768), (16896, 256, 768), (8448, 256, 2048),
        (4096, 1536, 4096), (32768, 384, 4096),
    )
    # the sizes the targets are stated for (scaled down in dry runs)
    target_fp32: int = 4096
    target_bf16: tuple[int, ...] = (4096, 8192)
    # the in-model issue's shapes (M, N, K): a small GEMM and two transformer projections
    medium: tuple[Shape, ...] = ((1024, 1024, 1024), (8192, 768, 768), (4096, 4096, 1024))
    repeat_s: float = 0.3  # seconds of timed calls per implementation (adaptive repeat count)
    min_repeats: int = 3
    max_repeats: int = 100
    full_ref_rows: int = 1024  # validate every row up to this M, a subsample of rows above
    flush_l2: bool = True
    dry_run: bool = False
    budget_s: float = 200.0  # wall-clock budget; cases after it are skipped (0: none)
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    """The run's :class:`Config` for ``--quick`` / ``--dry-run`` / the full run."""
    cfg = Config(out=args.out, seed=args.seed)
    if args.quick:
        cfg = replace(
            cfg,
            squares={"fp32": (4096,), "tf32": (4096,), "bf16": (1024, 4096, 8192), "fp16": (4096,)},
            odd_modes=("bf16",), tall_modes=("bf16",), linear=(4096, 16384, 4096), v1_sizes=(),
            repeat_s=0.12, budget_s=80.0,
        )
    if args.dry_run:
        cfg = replace(
            cfg, device="cpu", squares={m: (16, 33) for m in MODES}, odd=(17, 15, 13), tall=(64, 16, 16),
            batched=(3, 8, 8, 8), linear=(32, 24, 16), v1_sizes=(), target_fp32=33, target_bf16=(16, 33),
            medium=((16, 16, 16), (40, 24, 24), (32, 32, 8)), dw=((24, 16, 64),),
            repeat_s=0.0, min_repeats=3, max_repeats=3, full_ref_rows=8, flush_l2=False, dry_run=True,
            budget_s=0.0,
        )
    if args.device is not None:  # e.g. --dry-run --device cuda: the tiny sizes on a GPU
        cuda = args.device.startswith("cuda")
        cfg = replace(cfg, device=args.device, flush_l2=cuda)
        if cfg.dry_run and cuda:
            cfg = replace(cfg, v1_sizes=(33,))
    if getattr(args, "gemm", False):
        cfg = replace(cfg, gemm=((24, 16, 40),) if cfg.dry_run else cfg.gemm_shapes)
    if getattr(args, "tiles", False):
        cfg = replace(cfg, tiles=((40, 136, 24),) if cfg.dry_run else cfg.tile_shapes)
    if args.modes:
        wanted = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        unknown = [m for m in wanted if m not in MODES]
        if unknown:
            raise SystemExit(f"{NAME}: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
        cfg = replace(cfg, modes=wanted)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One problem: ``op`` "matmul" (C = A @ B, A (batch, M, K), B (batch, K, N)), "linear"
    (y = gelu(x @ W.T + b), x (M, K), W (N, K)) or "gemm" (C += A @ B, A (M, K) a transposed view,
    C float32)."""

    op: str
    mode: str
    M: int
    N: int
    K: int
    batch: int = 1
    kind: str = "square"  # square, medium, odd, tall, batched, linear
    impls: tuple[str, ...] = ("cukit", "cuBLAS")
    headline: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K * self.batch

    @property
    def shape_label(self) -> str:
        if self.kind == "square":
            return f"{self.M}^3"
        s = f"{self.M}x{self.N}x{self.K}"
        return f"{self.batch} x {s}" if self.batch > 1 else s

    def key(self) -> tuple[Any, ...]:
        return (self.op, self.mode, self.M, self.N, self.K, self.batch, self.impls)


def plan(cfg: Config) -> list[Case]:
    """Every case of the run, headline cases first, no duplicates."""
    modes = [m for m in cfg.modes if m in MODES]
    sq = {m: cfg.squares.get(m, ()) for m in modes}
    cases: list[Case] = []

    def add(c: Case) -> None:
        if c.mode in modes and all(c.key() != o.key() for o in cases):
            cases.append(c)

    # 1. the targets
    if cfg.target_fp32 in sq.get("fp32", ()):
        add(Case("matmul", "fp32", *(cfg.target_fp32,) * 3, headline=True))
    for n in cfg.target_bf16:
        if n in sq.get("bf16", ()):
            add(Case("matmul", "bf16", n, n, n, headline=True))
    if "bf16" in modes:
        for shape in cfg.medium:
            add(Case("matmul", "bf16", *shape, kind="medium", headline=True))
    if "bf16" in cfg.odd_modes:
        add(Case("matmul", "bf16", *cfg.odd, kind="odd", headline=True))
    if "bf16" in cfg.linear_modes:
        add(Case("linear", "bf16", *cfg.linear, kind="linear", impls=("cukit.linear", "torch eager"),
                 headline=True))
    # 2. the sweeps
    for m in modes:
        for n in sq[m]:
            add(Case("matmul", m, n, n, n))
        if m in cfg.odd_modes:
            add(Case("matmul", m, *cfg.odd, kind="odd"))
        if m in cfg.tall_modes:
            add(Case("matmul", m, *cfg.tall, kind="tall"))
        if m in cfg.batched_modes:
            b, mm, nn, kk = cfg.batched
            add(Case("matmul", m, mm, nn, kk, batch=b, kind="batched"))
    # 3. linear in the other dtypes
    for m in cfg.linear_modes:
        add(Case("linear", m, *cfg.linear, kind="linear", impls=("cukit.linear", "torch eager")))
    # 4. the v1 kernel, for the progression
    for n in cfg.v1_sizes:
        add(Case("matmul", "fp32", n, n, n, impls=(f"cukit {V1_KERNEL}", "cuBLAS")))
    # 5. gemm accumulating into float32 (--gemm)
    if "bf16" in modes:
        for shape in cfg.gemm:
            add(Case("gemm", "bf16", *shape, kind="accumulate", impls=(GEMM_IMPL, "cukit", "cuBLAS")))
    # 6. weight gradients (G^T X)
    for m in cfg.dw_modes:
        if m in modes:
            for shape in cfg.dw:
                add(Case("matmul", m, *shape, kind="dw"))
    # 7. the TMA kernel's tile widths forced (--tiles)
    if "bf16" in modes:
        for shape in cfg.tiles:
            add(Case("matmul", "bf16", *shape, kind="tiles", impls=(*TILE_IMPLS, "cukit", "cuBLAS")))
    return cases


# ---------------------------------------------------------------------------------------------
# The implementations
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def cukit_function(name: str) -> Callable[..., Any]:
    """``cukit.<name>`` (matmul, linear), or an ImportError saying it is missing."""
    try:
        import cukit

        return getattr(cukit, name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"cukit.{name} is not available ({harness.short_error(e, 120)}): the matmul front end "
            "(cukit/ops/matmul.py, issue 3) is not installed in this checkout"
        ) from e


def kernel_hook(kernel: str) -> Callable[[Any, Any], Any]:
    """A callable ``(a, b) -> a @ b`` that forces one kernel family through cukit/ops/matmul.py's
    private hook (``_matmul_gpu(a, b, *, kernel=...)``); ImportError/AttributeError when the module
    or the hook is missing, with what the module does offer."""
    try:
        import cukit.ops.matmul as mod
    except ImportError as e:
        raise ImportError(f"cukit.ops.matmul is not available ({harness.short_error(e, 120)})") from e
    fn = next((getattr(mod, n) for n in HOOK_NAMES if callable(getattr(mod, n, None))), None)
    if fn is None:
        offered = sorted(n for n in dir(mod) if "gpu" in n.lower() or "kernel" in n.lower())
        raise AttributeError(
            f"cukit.ops.matmul has no kernel hook (looked for {', '.join(HOOK_NAMES)}; it has: "
            f"{', '.join(offered) or 'nothing matching'})"
        )
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if params and "kernel" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise AttributeError(f"cukit.ops.matmul.{fn.__name__} takes no kernel= argument: {list(params)}")
    extra = {"precision": "ieee"} if "precision" in params else {}

    def call(a: Any, b: Any) -> Any:
        return fn(a, b, kernel=kernel, **extra)

    return call


@contextlib.contextmanager
def precision_mode(mode: Mode) -> Iterator[None]:
    """torch's TF32 switch (and cukit's global matmul precision, where it exists) for `mode`;
    restored on exit. 16-bit modes leave both alone."""
    torch = _torch()
    if mode.precision is None:
        yield
        return
    flags = torch.backends.cuda.matmul
    saved = flags.allow_tf32
    cukit_prev: str | None = None
    setter = getter = None
    with contextlib.suppress(Exception):
        import cukit

        setter = getattr(cukit, "set_matmul_precision", None)
        getter = getattr(cukit, "get_matmul_precision", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch may deprecate allow_tf32 in favour of fp32_precision
        flags.allow_tf32 = mode.precision == "tf32"
    if setter is not None:
        with contextlib.suppress(Exception):
            cukit_prev = getter() if getter is not None else None
        setter(mode.precision)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flags.allow_tf32 = saved
        if setter is not None:
            with contextlib.suppress(Exception):
                setter(cukit_prev or "ieee")


def make_matmul(impl: str, mode: Mode, a: Any, b: Any) -> Callable[[], Any]:
    """The zero-argument call to validate and time for one matmul implementation."""
    torch = _torch()
    if impl == "cuBLAS":
        return lambda: torch.matmul(a, b)
    if impl == "cukit":
        mm = cukit_function("matmul")
        if mode.precision is not None:
            prec = mode.precision
            return lambda: mm(a, b, precision=prec)
        return lambda: mm(a, b)
    if impl.startswith(TILE_PREFIX):
        return tma_width_call(a, b, int(impl.removeprefix(TILE_PREFIX)))
    if impl.startswith("cukit "):
        hook = kernel_hook(impl.split(" ", 1)[1])
        return lambda: hook(a, b)
    raise ValueError(f"unknown matmul implementation {impl!r}")


class Skipped(Exception):
    """An implementation this device cannot run: its row says why, and the run has no failure."""


# (M, N, K) -> the TMA width the wave model picks on this device (section 6's summary)
TILE_PICKS: dict[Shape, int] = {}


def tma_width_call(a: Any, b: Any, tile_n: int) -> Callable[[], Any]:
    """``a @ b`` (2-D torch CUDA tensors, bf16/fp16) on the TMA kernel with block tiles of
    128 x `tile_n`, a fresh output per call as ``cukit.matmul`` allocates one. Raises
    :class:`Skipped` where the TMA kernel does not run (CPU, compute capability other than 9.0)."""
    torch = _torch()
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) != (9, 0):
        raise Skipped("skipped: the TMA kernel runs on compute capability 9.0 only")
    from cukit.interop import DTYPES, current_stream
    from cukit.ops import matmul as mm
    from cukit.ops import matmul_tc as mt

    M, K = (int(n) for n in a.shape)
    N = int(b.shape[1])
    dev = a.device.index or 0
    probe = torch.empty((M, N), dtype=a.dtype, device=a.device)
    g, ka, kb = mm._build_gemm(a, b, "torch", batch=(), M=M, K=K, N=N, c_ptr=probe.data_ptr(), bias_ptr=0,
                               act=-1, precision="ieee", device=dev, dtype=DTYPES[str(a.dtype).removeprefix("torch.")])
    if mt.route(g) != "tma":
        raise Skipped(f"skipped: this problem does not run on the TMA kernel ({mt.route(g)})")
    TILE_PICKS[(M, N, K)] = mt.tma_tile_n(g)
    run = mt.prepare(g, version="tma", tile_n=tile_n)
    pa, pb = ka.data_ptr(), kb.data_ptr()

    def call() -> Any:
        c = torch.empty((M, N), dtype=a.dtype, device=a.device)
        run((pa, pb, c.data_ptr(), 0), current_stream(dev, True))
        return c

    return call


def make_gemm(a: Any, b: Any, c: Any) -> Callable[[], Any]:
    """``c += a @ b`` by ``cukit.ops.matmul.gemm`` (c float32, a and b 16-bit); returns c. The
    first call (validated) adds to zeros."""
    from cukit.ops.matmul import gemm

    return lambda: gemm(a, b, c, beta=1.0)


def torch_linear_gelu(x: Any, w: Any, bias: Any) -> Any:
    """torch eager baseline: the cuBLAS GEMM with bias (addmm), then exact GELU (two kernels)."""
    F = _torch().nn.functional
    return F.gelu(F.linear(x, w, bias))


def make_linear(impl: str, mode: Mode, x: Any, w: Any, bias: Any) -> Callable[[], Any]:
    """The zero-argument call to validate and time for one linear implementation."""
    if impl == "torch eager":
        return lambda: torch_linear_gelu(x, w, bias)
    if impl == "cukit.linear":
        lin = cukit_function("linear")
        if mode.precision is not None:
            prec = mode.precision
            return lambda: lin(x, w, bias, activation="gelu", precision=prec)
        return lambda: lin(x, w, bias, activation="gelu")
    raise ValueError(f"unknown linear implementation {impl!r}")


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def reference_rows(M: int, cfg: Config) -> list[int] | None:
    """Rows validated for an M-row output: None (all) up to ``full_ref_rows``, else the first and
    last 128 (edge tiles) and 256 spread between."""
    if cfg.full_ref_rows >= M:
        return None
    edge = min(128, M // 4)
    inner = M - 2 * edge
    n_spread = min(256, inner // 2)  # at most every other inner row
    spread = [edge + (i * inner) // n_spread for i in range(n_spread)]
    return sorted(set(range(edge)) | set(spread) | set(range(M - edge, M)))


def _take_rows(t: Any, rows: list[int] | None) -> Any:
    if rows is None:
        return t
    torch = _torch()
    return t.index_select(-2, torch.as_tensor(rows, device=t.device))


def reference_matmul(a: Any, b: Any, rows: list[int] | None) -> Any:
    """float64 product of the (upcast) inputs, for the selected rows of A."""
    torch = _torch()
    return torch.matmul(_take_rows(a, rows).double(), b.double())


def reference_linear(x: Any, w: Any, bias: Any, rows: list[int] | None) -> Any:
    """float64 ``gelu(x @ W.T + b)`` (exact GELU) for the selected rows of x."""
    F = _torch().nn.functional
    return F.gelu(F.linear(_take_rows(x, rows).double(), w.double(), bias.double()))


def validate(out: Any, expected: Any, rows: list[int] | None, rel_tol: float, name: str) -> float:
    """No NaN/inf anywhere in `out` (it was poisoned), relative error of the selected rows under
    `rel_tol`; returns the relative error, raises AssertionError otherwise."""
    torch = _torch()
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{name}: returned {type(out).__name__}, not a torch.Tensor")
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        raise AssertionError(f"{name}: {bad} non-finite elements of {out.numel()} (unwritten or overflowed)")
    res = harness.check_close(_take_rows(out, rows), expected, name=name, elementwise=False, rel_tol=rel_tol,
                              use_cukit_testing=False)
    return res.rel_err


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    """State of one run: configuration, result rows, failures, budget."""

    cfg: Config

    def skip_reason(self) -> str | None:
        """Why new cases should not start: a lost CUDA context, or the time budget spent."""
        return self.stop_reason(self.cfg.budget_s)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def fail(self, row: dict[str, Any], exc: BaseException) -> None:
        """Record a failed case (and stop launching if the CUDA context is gone)."""
        where = f"{row.get('op')} {row.get('mode')} {row.get('shape')} {row.get('impl')}"
        row["error"] = self.record_failure(where, exc)

    def repeats(self, est_ms: float) -> tuple[int, int]:
        """(warmup, repeats) for a call of about `est_ms` milliseconds."""
        cfg = self.cfg
        if cfg.dry_run:
            return 1, cfg.max_repeats
        r = int(cfg.repeat_s * 1e3 / max(est_ms, 1e-3))
        r = max(cfg.min_repeats, min(cfg.max_repeats, r))
        return max(1, min(10, r // 10)), r

    def randn(self, shape: Sequence[int], dtype: str) -> Any:
        torch = _torch()
        return torch.randn(tuple(shape), dtype=getattr(torch, dtype), device=self.cfg.device)


def _base_row(case: Case) -> dict[str, Any]:
    mode = MODES[case.mode]
    return {
        "op": case.op, "mode": case.mode, "dtype": mode.dtype, "precision": mode.precision,
        "panel": mode.label, "kind": case.kind, "shape": case.shape_label,
        "M": case.M, "N": case.N, "K": case.K, "batch": case.batch, "flops": case.flops,
        "headline": case.headline,
    }


def run_case(b: Bench, case: Case) -> list[dict[str, Any]]:
    """One case: fresh inputs, every implementation validated then timed. Never raises."""
    mode = MODES[case.mode]
    rows = [{**_base_row(case), "impl": impl} for impl in case.impls]
    reason = b.skip_reason()
    if reason:
        for r in rows:
            r["error"] = reason
        b.rows.extend(rows)
        return rows
    torch = _torch()
    ref_rows = reference_rows(case.M, b.cfg)
    try:
        if case.op == "gemm":  # A as G^T: a transposed view
            a = b.randn((case.K, case.M), mode.dtype).t()
            bb = b.randn((case.K, case.N), mode.dtype)
            c = torch.zeros((case.M, case.N), dtype=torch.float32, device=b.cfg.device)
            expected = reference_matmul(a, bb, ref_rows)
            makers = {impl: (lambda impl=impl: make_gemm(a, bb, c) if impl == GEMM_IMPL else make_matmul(impl, mode, a, bb))
                      for impl in case.impls}
            out_shape: tuple[int, ...] = (case.M, case.N)
        elif case.op == "matmul":
            lead = (case.batch,) if case.batch > 1 else ()
            if case.kind == "dw":  # G^T: a transposed view
                a = b.randn((case.K, case.M), mode.dtype).t()
            else:
                a = b.randn((*lead, case.M, case.K), mode.dtype)
            bb = b.randn((*lead, case.K, case.N), mode.dtype)
            expected = reference_matmul(a, bb, ref_rows)
            makers = {impl: (lambda impl=impl: make_matmul(impl, mode, a, bb)) for impl in case.impls}
            out_shape = (*lead, case.M, case.N)
        else:
            x = b.randn((case.M, case.K), mode.dtype)
            w = b.randn((case.N, case.K), mode.dtype).mul_(case.K ** -0.5)  # unit-scale pre-activations
            bias = b.randn((case.N,), mode.dtype)
            expected = reference_linear(x, w, bias, ref_rows)
            makers = {impl: (lambda impl=impl: make_linear(impl, mode, x, w, bias)) for impl in case.impls}
            out_shape = (case.M, case.N)
        out_dtype = getattr(torch, mode.dtype)
    except Exception as e:  # inputs or reference failed: every implementation fails with it
        for r in rows:
            b.fail(r, e)
        b.rows.extend(rows)
        return rows
    with precision_mode(mode):
        for row in rows:
            impl = row["impl"]
            reason = b.skip_reason()
            if reason:
                row["error"] = reason
                continue
            try:
                try:
                    fn = makers[impl]()
                except Skipped as e:
                    row["error"] = str(e)
                    continue
                harness.poison_allocator(out_shape, out_dtype, b.cfg.device)
                t_first = time.perf_counter()
                out = fn()
                harness.synchronize()
                row["first_call_s"] = time.perf_counter() - t_first
                row["rel_err"] = validate(out, expected, ref_rows, mode.rel_tol, f"{impl} {case.shape_label}")
                row["ref_rows"] = case.M if ref_rows is None else len(ref_rows)
                if mode.precision == "tf32":  # TF32 rounds inputs to 10 bits: ~1e-4 relative error
                    row["tf32_seen"] = row["rel_err"] > TF32_MIN_ERR
                del out
                t_est = time.perf_counter()
                fn()
                harness.synchronize()
                warmup, repeats = b.repeats((time.perf_counter() - t_est) * 1e3)
                t = harness.time_cuda(fn, warmup=max(0, warmup - 1), repeats=repeats, flush_l2=b.cfg.flush_l2,
                                      cuda=b.cuda)
                row.update(ms=t.ms, ms_min=t.min_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats,
                           timing=t.method, flushed_l2=t.flushed_l2)
                row["tflops"] = case.flops / (t.ms * 1e-3) / 1e12
            except Exception as e:
                b.fail(row, e)
    _ratios(rows)
    b.rows.extend(rows)
    return rows


def _ratios(rows: list[dict[str, Any]]) -> None:
    """vs_cublas (matmul, gemm) / vs_torch (linear) / vs_cukit (gemm against cukit's bf16-output
    matmul): the baseline's ms over each row's ms."""
    for base_impl, key in (("cuBLAS", "vs_cublas"), ("torch eager", "vs_torch"), ("cukit", "vs_cukit")):
        base = next((r.get("ms") for r in rows if r["impl"] == base_impl), None)
        if base is None:
            continue
        for r in rows:
            if r.get("ms") and (key != "vs_cukit" or r["impl"] == GEMM_IMPL):
                r[key] = base / r["ms"]


def _progress(case: Case, rows: Sequence[dict[str, Any]]) -> None:
    parts = []
    for r in rows:
        if r.get("error"):
            parts.append(f"{r['impl']}=ERR")
        elif r.get("ms") is not None:
            parts.append(f"{r['impl']}={r['ms']:.4g}ms/{r['tflops']:.4g}TF")
    ratio = next((r.get("vs_cublas") or r.get("vs_torch") for r in rows
                  if r["impl"] not in ("cuBLAS", "torch eager") and (r.get("vs_cublas") or r.get("vs_torch"))),
                 None)
    tail = f"  ratio {ratio:.3f}" if ratio else ""
    print(f"  {case.op} {case.mode} {case.shape_label}: " + "  ".join(parts) + tail, flush=True)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

COLUMNS: list[str | tuple[str, str]] = [
    "op", "dtype", "precision", "M", "N", "K", "batch", "impl", ("ms", "ms (median)"), ("tflops", "TFLOP/s"),
    ("vs_cublas", "vs cuBLAS"), ("vs_torch", "vs torch"), ("vs_cukit", "vs cukit bf16"), ("rel_err", "rel err"),
    ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:90]}
_FMT_SHORT = {"error": lambda v: "" if v is None else str(v)[:60]}


def _find(rows: Sequence[dict[str, Any]], op: str, mode: str, shape: Shape, impl: str,
          batch: int = 1) -> dict[str, Any] | None:
    for r in rows:
        if (r.get("op"), r.get("mode"), r.get("M"), r.get("N"), r.get("K"), r.get("batch"), r.get("impl")) == (
                op, mode, *shape, batch, impl):
            return r
    return None


def target_lines(rows: Sequence[dict[str, Any]], cfg: Config) -> list[str]:
    """PASS / FAIL / NOT RUN for each of the issue's targets."""
    checks: list[tuple[str, str, str, Shape, str, str, float]] = []
    n = cfg.target_fp32
    checks.append(("float32 SIMT (ieee) " + f"{n}^3", "matmul", "fp32", (n, n, n), "cukit", "vs_cublas",
                   TARGET_FP32))
    for n in cfg.target_bf16:
        checks.append((f"bfloat16 {n}^3", "matmul", "bf16", (n, n, n), "cukit", "vs_cublas", TARGET_BF16))
    for shape in cfg.medium:
        checks.append(("bfloat16 {}x{}x{} (per call)".format(*shape), "matmul", "bf16", shape, "cukit",
                       "vs_cublas", TARGET_MEDIUM))
    checks.append(("bfloat16 {}x{}x{}".format(*cfg.odd), "matmul", "bf16", cfg.odd, "cukit", "vs_cublas",
                   TARGET_ODD))
    checks.append(("linear+bias+GELU bf16 x {0}x{2} W {1}x{2}".format(*cfg.linear), "linear", "bf16", cfg.linear,
                   "cukit.linear", "vs_torch", TARGET_LINEAR))
    out = []
    for label, op, mode, shape, impl, key, target in checks:
        r = _find(rows, op, mode, shape, impl)
        base = "cuBLAS" if key == "vs_cublas" else "torch eager"
        why = ""
        if r is None:
            verdict, val = "NOT RUN", "-"
        elif r.get(key) is None:
            verdict, val = "FAIL", "-"
            why = f"  no ratio: {str(r.get('error') or 'not timed')[:70]}"
        else:
            verdict, val = ("PASS" if r[key] >= target else "FAIL"), f"{r[key]:.3f}x"
        out.append(f"  {verdict:<7} {label:<40} cukit vs {base:<11} {val:>7}  (target >= {target}x){why}")
    r = _find(rows, "linear", "fp32", cfg.linear, "cukit.linear")
    if r is not None:
        v = f"{r['vs_torch']:.3f}x" if r.get("vs_torch") is not None else "-"
        out.append(f"  (info)  {'linear+bias+GELU float32 (ieee)':<40} cukit vs {'torch eager':<11} {v:>7}  "
                   "(no target: the float32 GEMM is ~98% of torch's time)")
    return out


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per case: cukit's and the baseline's ms and TFLOP/s side by side."""
    out: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if r.get("op") not in ("matmul", "linear", "gemm"):
            continue
        k = (r["op"], r["mode"], r["M"], r["N"], r["K"], r["batch"])
        line = seen.get(k)
        if line is None:
            line = {"op": r["op"], "mode": r["mode"], "shape": r["shape"], "kind": r.get("kind"),
                    "flops": r.get("flops")}
            seen[k] = line
            out.append(line)
        if r["impl"] in ("cuBLAS", "torch eager"):
            line.update(base_ms=r.get("ms"), base_tflops=r.get("tflops"))
            if r.get("error"):
                line["error"] = f"{r['impl']}: {r['error']}"
        else:
            if "impl" in line:  # a second cukit impl (v1) for this case: its own line
                line = {**{k: line.get(k) for k in ("op", "mode", "shape", "kind", "flops", "base_ms",
                                                     "base_tflops")}}
                out.append(line)
            line.update(impl=r["impl"], ms=r.get("ms"), tflops=r.get("tflops"),
                        ratio=r.get("vs_cublas") or r.get("vs_torch"))
            if r.get("error"):
                line["error"] = f"{r['impl']}: {r['error']}"
    return sorted(out, key=_case_order)


def tile_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per section-6 shape: each forced width's µs, cuBLAS's, the fastest width and the model's
    pick (``matmul_tc.tma_tile_n``). Empty when no tile row ran."""
    lines = []
    by_shape: dict[Shape, dict[str, float]] = {}
    for r in rows:
        if r.get("kind") == "tiles" and r.get("ms"):
            by_shape.setdefault((r["M"], r["N"], r["K"]), {})[r["impl"]] = r["ms"] * 1e3
    for shape, t in by_shape.items():
        widths = {int(i.removeprefix(TILE_PREFIX)): us for i, us in t.items() if i.startswith(TILE_PREFIX)}
        if not widths:
            continue
        fastest = min(widths, key=widths.__getitem__)
        pick = TILE_PICKS.get(shape)
        verdict = "" if pick is None else ("  model picks it" if pick == fastest else
                                            f"  model picks {pick} (+{widths[pick] / widths[fastest] - 1:.1%})")
        cells = "  ".join(f"{bn}: {us:.1f}" for bn, us in sorted(widths.items(), reverse=True))
        base = f"  cuBLAS {t['cuBLAS']:.1f}" if "cuBLAS" in t else ""
        lines.append(f"  {'x'.join(map(str, shape))}: {cells}{base}  fastest {fastest}{verdict}")
    return lines


_KIND_ORDER = {"square": 0, "odd": 1, "tall": 2, "batched": 3, "linear": 4, "dw": 5, "tiles": 6}


def _case_order(r: dict[str, Any]) -> tuple[Any, ...]:
    """Sort key of rows: matmul before linear, modes in MODES order, then kind and size."""
    modes = list(MODES)
    return (r.get("op") == "linear", modes.index(r["mode"]) if r.get("mode") in modes else len(modes),
            _KIND_ORDER.get(str(r.get("kind")), 9), r.get("flops") or 0)


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    """The headline, printed last (the device tool returns only the end of the output)."""
    print()
    print("=" * 100)
    print(f"SUMMARY {NAME}: {env.get('gpu') or 'CPU (dry run)'} | torch {env.get('torch')} | "
          f"cupy {env.get('cupy')} | commit {str(env.get('git_commit'))[:12]} | {b.elapsed():.0f} s")
    harness.print_table(
        summary_rows(b.rows),
        ["op", "mode", "shape", "impl", ("ms", "ms"), ("tflops", "TFLOP/s"), ("base_ms", "base ms"),
         ("base_tflops", "base TFLOP/s"), ("ratio", "ratio"), ("error", "error")],
        title="\nall cases (base: cuBLAS for matmul, torch eager F.gelu(F.linear) for linear; "
              "ratio = base ms / cukit ms):",
        formatters=_FMT_SHORT,
    )
    no_tf32 = [f"{r['impl']} {r['shape']}" for r in b.rows if r.get("tf32_seen") is False]
    if no_tf32:
        print(f"\nmode tf32: float32-level error (no TF32 rounding: ran as IEEE float32) for: {', '.join(no_tf32)}")
    tiles = tile_lines(b.rows)
    if tiles:
        print("\nTMA tile widths (section 6; per call, µs):")
        for line in tiles:
            print(line)
    scaled = " (dry run: sizes scaled down, CPU timings mean nothing)" if b.cfg.dry_run else ""
    print(f"\ntargets{scaled}:")
    for line in target_lines(b.rows, b.cfg):
        print(line)
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--quick", action="store_true",
                   help="the target cases and a few sizes per mode, shorter timing (< 60 s)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke mode: tiny sizes, torch CPU tensors, perf_counter timing")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip cases that would start after this many seconds (default 200, quick 50)")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(MODES)} (default: all)")
    p.add_argument("--device", default=None,
                   help="torch device (default cuda; cpu with --dry-run; --dry-run --device cuda: tiny GPU run)")
    p.add_argument("--seed", type=int, default=0, help="torch random seed")
    p.add_argument("--gemm", action="store_true",
                   help="also time cukit.ops.matmul.gemm accumulating bf16 products into float32 (section 5)")
    p.add_argument("--tiles", action="store_true",
                   help="also time the Hopper TMA kernel forced to each tile width (section 6: the wave "
                        "model's calibration)")
    return p.parse_args(argv)


def _meta(b: Bench) -> dict[str, Any]:
    torch = _torch()
    flags = torch.backends.cuda.matmul
    meta: dict[str, Any] = {
        "config": {k: v for k, v in vars(b.cfg).items()},
        "failures": b.failures,
        "elapsed_s": b.elapsed(),
        "targets": {"fp32_vs_cublas": TARGET_FP32, "bf16_vs_cublas": TARGET_BF16, "odd_bf16_vs_cublas": TARGET_ODD,
                    "medium_bf16_vs_cublas": TARGET_MEDIUM,
                    "linear_vs_torch_eager": TARGET_LINEAR},
        "rel_tol": {m.name: m.rel_tol for m in MODES.values()},
        "torch_flags": {
            "allow_bf16_reduced_precision_reduction": getattr(flags, "allow_bf16_reduced_precision_reduction", None),
            "allow_fp16_reduced_precision_reduction": getattr(flags, "allow_fp16_reduced_precision_reduction", None),
        },
    }
    return meta


def run(cfg: Config) -> tuple[Bench, dict[str, Any], list[str]]:
    """Run every case; never raises for a failing case. Returns (bench, env, saved paths)."""
    torch = _torch()
    torch.manual_seed(cfg.seed)
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg)
    cases = plan(cfg)
    print(f"{NAME}: device {cfg.device}, modes {', '.join(cfg.modes)}, {len(cases)} cases, "
          f"budget {cfg.budget_s:.0f} s", flush=True)
    for case in cases:
        try:
            rows = run_case(b, case)
        except Exception as e:  # a bug in the case runner itself: record, go on
            row = {**_base_row(case), "impl": "case"}
            b.fail(row, e)
            b.rows.append(row)
            rows = [row]
        _progress(case, rows)
        if b.cuda and case.flops >= 2 * 2048**3:
            harness.release_cuda_memory()
    harness.print_table(b.rows, COLUMNS, title="\nall rows", formatters=_FMT)

    env = harness.environment()
    saved: list[str] = []
    try:
        paths = harness.save_results(b.rows, NAME, cfg.out, env=env, meta=_meta(b))
        png = None if not paths else harness.plot(  # panels in MODES order, whatever order the cases ran in
            sorted(b.rows, key=_case_order), paths[0].with_suffix(".png"),
            x="M", y="tflops", series="impl", panels=("panel",),
            where=lambda r: r.get("op") == "matmul" and r.get("kind") == "square",
            xlabel="M = N = K", ylabel="TFLOP/s",
            title=f"matmul, square sizes, cukit vs cuBLAS: {env.get('gpu') or 'CPU dry run'}",
        )
        saved = [str(p) for p in [*paths, *([png] if png is not None else [])]]
    except Exception as e:
        b.failures.append(f"saving results: {harness.short_error(e)}")
    print_summary(b, env, saved)
    return b, env, saved


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    cfg = config_from_args(args)
    return harness.main_run(NAME, cfg, run)


if __name__ == "__main__":
    sys.exit(main())
