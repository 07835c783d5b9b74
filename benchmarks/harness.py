"""Shared benchmark utilities for ``benchmarks/bench_<op>.py``.

Everything here works with or without a GPU: on a CUDA device it times with CUDA events, flushes L2
and synchronises; on the CPU (``--dry-run`` smoke mode, the tests) the same functions fall back to
``time.perf_counter`` so every code path runs somewhere before it runs on a lent GPU.

What each helper measures (see ``benchmarks/README.md``):

- :func:`time_cuda`: device time of one call, median (and min/p20/p80) over repeats, L2 flushed
  between repeats outside the timed region, an optional per-repeat ``setup`` that is not timed.
- :func:`host_cost_us`: host microseconds to enqueue one call (no sync inside the loop).
- :func:`copy_bandwidth`: device-to-device copy bandwidth (bytes read + bytes written per second),
  the physical limit of a memory-bound kernel: the "fraction" column divides by it.
- :func:`check_close`: validation before timing: relative-norm error, NaN checks and an
  elementwise ``atol + rtol * |expected|`` test, per dtype.
- :func:`environment`, :func:`save_results`, :func:`plot`, :func:`print_table`: reporting.
- :func:`add_out_argument`, :func:`results_dir`: where results go. Never ``benchmarks/results/`` (the
  committed results) unless ``--out`` names it: without ``--out`` a run writes into a new temporary
  folder and prints its path, and a ``--dry-run`` (numbers that mean nothing) refuses that folder.

torch is imported lazily (a benchmark that only uses CuPy still works); matplotlib is optional.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "CheckResult",
    "RunState",
    "Timing",
    "add_out_argument",
    "check_close",
    "configure_dynamo",
    "copy_bandwidth",
    "cuda_available",
    "environment",
    "flush_l2_cache",
    "format_value",
    "host_cost_us",
    "is_fatal_cuda_error",
    "main_run",
    "one_cpu_thread",
    "plot",
    "poison_allocator",
    "print_table",
    "quantile",
    "release_cuda_memory",
    "results_dir",
    "save_results",
    "short_error",
    "synchronize",
    "time_cuda",
    "with_results_dir",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
# The committed results (the figures NOTES.md cites): written only by a run whose --out names it.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device."""
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available())


def synchronize(device: Any = None) -> None:
    """Wait for all work on the current CUDA device (no-op without CUDA). Surfaces async errors."""
    if cuda_available():
        import torch

        torch.cuda.synchronize(device)


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """True for errors after which the CUDA context is unusable (illegal address, launch failure):
    every later GPU call would fail too, so a benchmark should stop launching and report."""
    msg = str(exc).lower()
    return any(
        s in msg
        for s in (
            "illegal memory access",
            "illegal address",
            "unspecified launch failure",
            "misaligned address",
            "device-side assert",
            "cudaerrorillegal",
            "cuda_error_illegal",
            "hardware stack error",
            "an illegal instruction",
        )
    )


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to `limit` characters (for tables and CSV cells)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(kw_only=True)
class RunState:
    """What every benchmark run keeps: result rows, failures, the start time and, once a CUDA
    error has made the context unusable, that error (no further launches). Each bench_<op>.py
    subclasses it with its config and case bookkeeping."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    fatal: str | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def stop_reason(self, budget_s: float, estimate_s: float = 0.0) -> str | None:
        """Why a new case should not start: a lost CUDA context, the time budget spent, or the
        case's predicted duration overrunning it (no budget: 0)."""
        if self.fatal:
            return f"skipped: CUDA context unusable after an earlier error ({self.fatal[:120]})"
        if budget_s and self.elapsed() > budget_s:
            return f"skipped: time budget of {budget_s:.0f} s spent"
        if budget_s and estimate_s and self.elapsed() + estimate_s > budget_s:
            return f"skipped: predicted {estimate_s:.0f} s would overrun the {budget_s:.0f} s budget"
        return None

    def record_failure(self, where: str, exc: BaseException | str) -> str:
        """Note a failed case (and whether it lost the CUDA context); returns the short message.
        Out-of-memory errors hand the caching allocator's blocks back."""
        msg = exc if isinstance(exc, str) else short_error(exc)
        self.failures.append(f"{where}: {msg}")
        if isinstance(exc, BaseException):
            if is_fatal_cuda_error(exc):
                self.fatal = msg
            if "out of memory" in msg.lower():
                release_cuda_memory()
        return msg


def release_cuda_memory() -> None:
    """Collect garbage (compiled graphs hold reference cycles) and empty torch's CUDA cache."""
    import gc

    gc.collect()
    if cuda_available():
        _torch().cuda.empty_cache()  # type: ignore[union-attr]


def configure_dynamo() -> None:
    """torch.compile's recompile limits up: a case that hits the limit would silently fall back to
    eager and be timed as compiled."""
    import contextlib
    import warnings

    torch = _torch()
    if torch is None:
        return
    cfg = torch._dynamo.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                            ("accumulated_recompile_limit", 1024), ("accumulated_cache_size_limit", 1024)):
            if hasattr(cfg, name):
                with contextlib.suppress(Exception):
                    setattr(cfg, name, value)


def one_cpu_thread(device: str) -> Any:
    """A context that runs torch on one CPU thread while `device` is the CPU (tiny ops gain nothing
    from more, and OpenMP threads spinning at barriers stall every op on a busy host); restored on
    exit. A no-op for other devices."""
    import contextlib

    @contextlib.contextmanager
    def ctx() -> Any:
        torch = _torch()
        if torch is None or not device.startswith("cpu"):
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    return ctx()


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Times of one benchmarked call, in milliseconds. ``ms`` is the median."""

    ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    repeats: int
    method: str  # "cuda-events" or "perf_counter"
    flushed_l2: bool
    times_ms: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """The fields that go into a result row (without the raw list of times)."""
        d = asdict(self)
        d.pop("times_ms")
        return d


def quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted sequence (q in [0, 1])."""
    if not sorted_vals:
        return math.nan
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _timing(times_ms: list[float], method: str, flushed: bool) -> Timing:
    s = sorted(times_ms)
    return Timing(
        ms=statistics.median(s),
        min_ms=s[0],
        p20_ms=quantile(s, 0.2),
        p80_ms=quantile(s, 0.8),
        mean_ms=statistics.fmean(s),
        repeats=len(s),
        method=method,
        flushed_l2=flushed,
        times_ms=times_ms,
    )


_FLUSH_BUFFERS: dict[int, Any] = {}


def _l2_bytes(device: int) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0) or 64 * 2**20


def _flush_buffer(device: int) -> Any:
    """A device buffer of twice the L2 size (at least 64 MiB), allocated once per device."""
    buf = _FLUSH_BUFFERS.get(device)
    if buf is None:
        import torch

        nbytes = max(2 * _l2_bytes(device), 64 * 2**20)
        buf = torch.empty(nbytes // 4, dtype=torch.int32, device=f"cuda:{device}")
        _FLUSH_BUFFERS[device] = buf
    return buf


def flush_l2_cache(device: int | None = None) -> None:
    """Evict the L2 cache by writing a buffer twice its size (enqueued on the current stream).
    A write, so dirty lines of the timed data are written back here, not inside the next repeat."""
    import torch

    dev = torch.cuda.current_device() if device is None else device
    _flush_buffer(dev).fill_(1)


# Cycles to spin the GPU before each timed region (about 0.1 ms at 1.5-2 GHz): the host gets ahead
# of the device, so launch latency of the timed call is hidden and events measure device time. A
# call whose host time is longer (an autograd backward, a Python-launched Triton kernel on a slow
# host) gets a spin of 1.5x its last warm-up call's host time at _LEAD_HZ (above any SM clock, so
# the spin lasts at least that long), at most _HOST_LEAD_MAX_CYCLES.
_HOST_LEAD_CYCLES = 200_000
_HOST_LEAD_MAX_CYCLES = 40_000_000
_LEAD_HZ = 2.0e9


def _lead_cycles(host_s: float | None) -> int:
    """GPU spin cycles before a timed call whose host time is `host_s` (None: not measured)."""
    if host_s is None:
        return _HOST_LEAD_CYCLES
    return int(min(_HOST_LEAD_MAX_CYCLES, max(_HOST_LEAD_CYCLES, 1.5 * host_s * _LEAD_HZ)))


def time_cuda(
    fn: Callable[..., Any],
    *,
    warmup: int,
    repeats: int,
    flush_l2: bool,
    setup: Callable[[], Any] | None = None,
    cuda: bool | None = None,
    host_lead: bool = True,
) -> Timing:
    """Time `fn` on the device: median (and min/p20/p80) over `repeats`, after `warmup` calls.

    Each repeat is ``state = setup()`` (if given; untimed), L2 flush (if asked; untimed), a GPU spin
    so the host runs ahead (untimed; longer than the last warm-up call's host time, so a call whose
    launches take long on the host is still timed on the device alone), then ``fn(state)``
    (``fn()`` without setup) between two CUDA events recorded on torch's current stream. The events of all repeats are read after a
    single synchronisation at the end, so the loop never stalls the device between repeats.

    ``setup`` is how to time only part of a pipeline, e.g. build a fresh autograd graph in setup and
    time only ``torch.autograd.grad`` in fn. Without CUDA (or with ``cuda=False``) the same loop
    times with ``time.perf_counter`` and no flush: the CPU smoke mode of every benchmark.

    Validation is the caller's job: run and check `fn` once before timing it (:func:`check_close`).
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    use_cuda = cuda_available() if cuda is None else cuda

    def call(state: Any) -> Any:
        return fn(state) if setup is not None else fn()

    host_s = None
    for _ in range(warmup):
        state = setup() if setup is not None else None
        t0 = time.perf_counter()
        call(state)
        host_s = time.perf_counter() - t0
        del state
    if not use_cuda:
        times: list[float] = []
        for _ in range(repeats):
            state = setup() if setup is not None else None
            t0 = time.perf_counter()
            call(state)
            times.append((time.perf_counter() - t0) * 1e3)
            del state
        return _timing(times, "perf_counter", False)

    import torch

    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    sleep = getattr(torch.cuda, "_sleep", None) if host_lead else None
    cycles = _lead_cycles(host_s)
    for i in range(repeats):
        state = setup() if setup is not None else None
        if flush_l2:
            flush_l2_cache()
        if sleep is not None:
            sleep(cycles)
        starts[i].record()
        call(state)
        ends[i].record()
        del state
    torch.cuda.synchronize()
    return _timing([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], "cuda-events", flush_l2)


def host_cost_us(
    fn: Callable[[], Any],
    *,
    iters: int,
    rounds: int = 5,
    warmup: int | None = None,
) -> float:
    """Host microseconds per call of `fn`: the CPU wall time of enqueueing `iters` calls.

    The device is synchronised once before and once after each round, never inside the loop, so
    this is the Python + dispatcher + launch cost a small call pays (as long as the device keeps up:
    use tiny tensors). Returns the median per-call figure over `rounds` rounds.
    """
    if iters < 1 or rounds < 1:
        raise ValueError("iters and rounds must be >= 1")
    for _ in range(max(1, iters // 10) if warmup is None else warmup):
        fn()
    synchronize()
    per_call: list[float] = []
    for _ in range(rounds):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        synchronize()
        per_call.append((t1 - t0) / iters * 1e6)
    return statistics.median(per_call)


def copy_bandwidth(
    device: Any = "cuda",
    *,
    nbytes: int = 1 << 30,
    warmup: int = 3,
    repeats: int = 20,
) -> float:
    """Measured copy bandwidth in bytes per second, counting bytes read plus bytes written.

    Copies a `nbytes` buffer (default 1 GiB, far larger than L2) into another with
    ``dst.copy_(src)``. This is the "physical limit" of a memory-bound kernel on this device: the
    benchmarks' fraction column is achieved bandwidth divided by it. On a CPU device (smoke mode)
    it measures a host memcpy with ``time.perf_counter``.
    """
    import torch

    dev = torch.device(device)
    n = max(1, nbytes // 4)
    src = torch.randn(n, dtype=torch.float32, device=dev)  # random, never zeros
    dst = torch.empty_like(src)

    def copy() -> Any:
        return dst.copy_(src)

    t = time_cuda(copy, warmup=warmup, repeats=repeats, flush_l2=False, cuda=dev.type == "cuda")
    if not torch.equal(dst[:1024], src[:1024]):
        raise RuntimeError("copy_bandwidth: the copy did not copy")
    return 2 * n * 4 / (t.ms * 1e-3)


def poison_allocator(shape: Sequence[int] | int, dtype: Any, device: Any) -> None:
    """Allocate a tensor of `shape` filled with NaN (or the type's max) and free it at once.

    torch's caching allocator hands the most recently freed block of a size to the next request of
    that size, so the next output allocated with this shape most likely starts as NaN: an element
    the kernel forgot to write shows up in :func:`check_close` instead of holding a stale correct
    value from the reference computed just before. Best effort; never fails.
    """
    try:
        import torch

        t = torch.empty(shape, dtype=dtype, device=device)
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(torch.iinfo(dtype).max if dtype != torch.bool else True)
        del t
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

# (atol, rtol) for the elementwise test and the relative-norm bound, per dtype name. (atol, rtol)
# are cukit.testing.TOLERANCES' values (taken from there when it imports: one table for the project);
# the norm bound: float32 maths lands far under 1e-5, bfloat16 results rounded
# once sit near 2e-3.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float64": (1e-10, 1e-9, 1e-12),
    "float32": (1e-5, 1.3e-6, 1e-5),
    "float16": (1e-3, 1e-3, 2e-3),
    "bfloat16": (1e-2, 1.6e-2, 1e-2),
}
_CHUNK = 1 << 24  # elements per chunk of the float64 comparison (keeps memory bounded at 256M)


@dataclass
class CheckResult:
    """Outcome of :func:`check_close`: ``rel_err`` = ||actual - expected|| / ||expected||."""

    ok: bool
    rel_err: float
    max_abs_err: float
    n_bad: int
    n_nan: int
    message: str


def _dtype_name(t: Any) -> str:
    return str(getattr(t, "dtype", "float64")).removeprefix("torch.")


def _default_tolerances(dtype: str) -> tuple[float, float, float]:
    """(atol, rtol, rel_tol) for results stored in `dtype`."""
    atol, rtol, rel = TOLERANCES.get(dtype, TOLERANCES["float32"])
    try:
        from cukit.testing import tolerance

        atol, rtol = (float(v) for v in tolerance(dtype))
    except Exception:  # cukit.testing missing, or a dtype it does not know
        pass
    return atol, rtol, rel


def _cukit_assert_close() -> Callable[..., Any] | None:
    try:
        from cukit.testing import assert_close  # written by another helper; optional
    except Exception:
        return None
    return assert_close


def check_close(
    actual: Any,
    expected: Any,
    *,
    name: str = "output",
    atol: float | None = None,
    rtol: float | None = None,
    rel_tol: float | None = None,
    elementwise: bool = True,
    raise_on_fail: bool = True,
    use_cukit_testing: bool = True,
) -> CheckResult:
    """Compare a result with its reference before timing (torch tensors, any device).

    Fails on: a shape mismatch; NaN or inf where the reference is finite (an unwritten element of
    a poisoned output shows up here); relative-norm error over `rel_tol`; with `elementwise`, any
    element with ``|a - e| > atol + rtol * |e|``. Defaults come from :data:`TOLERANCES` by the
    reference's dtype. When ``cukit.testing.assert_close`` exists and the tensor is small it is
    run as well (its per-dtype tolerances are the project's); a signature mismatch is ignored.
    Returns a :class:`CheckResult`; raises AssertionError on failure if `raise_on_fail`.
    """
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        msg = f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        if raise_on_fail:
            raise AssertionError(msg)
        return CheckResult(False, math.inf, math.inf, -1, -1, msg)
    # tolerances follow the result's dtype: the reference is usually float64 (upcast inputs)
    d_atol, d_rtol, d_rel = _default_tolerances(_dtype_name(actual))
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    rel_tol = d_rel if rel_tol is None else rel_tol

    a_flat = actual.detach().reshape(-1)
    e_flat = expected.detach().reshape(-1).to(a_flat.device)
    diff2 = ref2 = 0.0
    max_abs = 0.0
    n_bad = n_nan = 0
    with torch.no_grad():
        for i in range(0, a_flat.numel(), _CHUNK):
            a = a_flat[i : i + _CHUNK].to(torch.float64)
            e = e_flat[i : i + _CHUNK].to(torch.float64)
            e_finite = torch.isfinite(e)
            a_finite = torch.isfinite(a)
            n_nan += int((e_finite & ~a_finite).sum())
            both = e_finite & a_finite
            d = torch.where(both, (a - e).abs(), torch.zeros_like(a))
            e0 = torch.where(e_finite, e, torch.zeros_like(e))
            diff2 += float((d * d).sum())
            ref2 += float((e0 * e0).sum())
            if d.numel():
                max_abs = max(max_abs, float(d.max()))
            if elementwise:
                n_bad += int((d > atol + rtol * e0.abs()).sum())
                # non-finite reference values must match exactly (inf == inf, nan == nan)
                n_bad += int((~e_finite & ~((a == e) | (a.isnan() & e.isnan()))).sum())
    rel = math.sqrt(diff2) / math.sqrt(ref2) if ref2 > 0 else math.sqrt(diff2)
    problems = []
    if n_nan:
        problems.append(f"{n_nan} non-finite values where the reference is finite")
    if not rel <= rel_tol:
        problems.append(f"relative error {rel:.3g} > {rel_tol:.3g}")
    if n_bad:
        problems.append(f"{n_bad} elements outside atol={atol:g} rtol={rtol:g} (max abs err {max_abs:.3g})")
    if not problems and elementwise and use_cukit_testing and actual.numel() <= (1 << 20):
        ext = _cukit_assert_close()
        if ext is not None:
            try:
                ext(actual, expected)
            except AssertionError as e:
                problems.append(f"cukit.testing.assert_close: {str(e).splitlines()[0] if str(e) else e!r}")
            except TypeError:
                pass  # a different signature than assumed here: our own checks stand
    ok = not problems
    msg = f"{name}: " + ("ok" if ok else "; ".join(problems)) + f" (rel err {rel:.3g})"
    if not ok and raise_on_fail:
        raise AssertionError(msg)
    return CheckResult(ok, rel, max_abs, n_bad, n_nan, msg)


# ---------------------------------------------------------------------------------------------
# Environment and results
# ---------------------------------------------------------------------------------------------


def _git_commit() -> str:
    env = os.environ.get("CUKIT_GIT_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        commit = head.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=10,
        )
        return commit + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


def _nvidia_smi() -> dict[str, str] | None:
    """Clocks, power limit and temperature as nvidia-smi reports them (read only), or None."""
    fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,persistence_mode"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except Exception:
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values, strict=False))


def environment(device: int | None = None) -> dict[str, Any]:
    """Where the numbers came from: GPU name, SM count, L2 size, memory, torch/CuPy/cukit/CUDA
    versions, git commit (or "unknown"; ``CUKIT_GIT_COMMIT`` overrides), date (UTC, ISO 8601)."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "argv": sys.argv,
    }
    torch = _torch()
    env["torch"] = getattr(torch, "__version__", None)
    env["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    try:
        import cukit

        env["cukit"] = cukit.__version__
    except Exception as e:
        env["cukit"] = f"unavailable ({short_error(e, 120)})"
    try:
        import cupy

        env["cupy"] = cupy.__version__
        try:
            env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            env["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception:
            pass
    except Exception:
        env["cupy"] = None
    if torch is not None and torch.cuda.is_available():
        dev = torch.cuda.current_device() if device is None else device
        p = torch.cuda.get_device_properties(dev)
        env.update(
            device="cuda",
            gpu=p.name,
            sm_count=int(p.multi_processor_count),
            compute_capability=f"{p.major}.{p.minor}",
            l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0),
            memory_bytes=int(p.total_memory),
        )
        env["nvidia_smi"] = _nvidia_smi()
    else:
        env.update(device="cpu", gpu=None, sm_count=None)
    return env


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Mapping):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _columns_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for r in rows:
        for k in r:
            cols.setdefault(k, None)
    return list(cols)


def add_out_argument(parser: ArgumentParser) -> None:
    """The ``--out`` option every benchmark takes (read it with :func:`results_dir`)."""
    parser.add_argument(
        "--out", default=None, metavar="DIR",
        help="results folder (default: a new temporary folder, printed; '-' saves nothing). The committed "
             "results in benchmarks/results/ are written only when named here, never by --dry-run",
    )


def add_run_arguments(parser: ArgumentParser, quick: str, *, no_compile: bool = False) -> None:
    """The options the kernel benchmarks share: ``--quick`` (`quick` says what it keeps),
    ``--dry-run``, ``--no-compile`` (when the bench has a torch.compile baseline), ``--budget-s``,
    ``--device`` and ``--seed``."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--dry-run", action="store_true", help="CPU smoke mode: tiny shapes, perf_counter timing")
    if no_compile:
        parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds")
    parser.add_argument("--device", default=None, help="torch device (default cuda; cpu with --dry-run)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the inputs")


def run_parser(doc: str, quick: str, *, no_compile: bool = False) -> ArgumentParser:
    """A kernel benchmark's parser: its description (`doc`'s first paragraph), ``--out``
    (:func:`add_out_argument`) and the shared run options (:func:`add_run_arguments`)."""
    parser = ArgumentParser(description=doc.split("\n\n")[0], formatter_class=RawDescriptionHelpFormatter)
    add_out_argument(parser)
    add_run_arguments(parser, quick, no_compile=no_compile)
    return parser


def _within(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def results_dir(out: str | os.PathLike[str] | None, name: str, *, dry_run: bool = False) -> str:
    """Where a run of benchmark `name` writes: `out` when given ("-": nothing), else a new temporary
    folder, created and announced on stdout. ValueError for a dry run aimed at the committed
    results (benchmarks/results/): its numbers mean nothing."""
    if out is not None and str(out) == "-":
        return "-"
    if out is None:
        path = tempfile.mkdtemp(prefix=f"{name}-dry-" if dry_run else f"{name}-")
        print(f"{name}: results go to {path} (a new temporary folder; --out DIR to choose)", flush=True)
        return path
    if dry_run and _within(Path(out), RESULTS_DIR):
        raise ValueError(f"--dry-run never writes into {RESULTS_DIR} (the committed results; dry-run numbers "
                         f"mean nothing): drop --out for a temporary folder or name another; got --out {out}")
    return str(out)


def main_run(name: str, cfg: Any, run: Callable[[Any], Any]) -> int:
    """Every bench's CLI tail: 2 (and why, on stderr) when the config asks for CUDA that torch
    does not see or names a results folder it may not write; else ``run(cfg)`` with the results
    folder resolved (:func:`with_results_dir`), on one CPU thread for CPU runs
    (:func:`one_cpu_thread`), and 0 (failed cases are reported by the run, not fatal)."""
    if cfg.device.startswith("cuda") and not cuda_available():
        print(f"{name}: torch sees no CUDA device; use --dry-run for the CPU smoke mode", file=sys.stderr)
        return 2
    try:
        cfg = with_results_dir(cfg, name)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    with one_cpu_thread(cfg.device):
        run(cfg)
    return 0


def with_results_dir(cfg: Any, name: str) -> Any:
    """A benchmark's config (a dataclass with ``out`` and ``dry_run``) with ``out`` resolved by
    :func:`results_dir`: the same config once resolved, so calling it twice creates one folder."""
    return dataclasses.replace(cfg, out=results_dir(cfg.out, name, dry_run=cfg.dry_run))


def save_results(
    rows: Sequence[Mapping[str, Any]],
    name: str,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    plot_kwargs: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write ``<name>.json`` (environment, meta and rows), ``<name>.csv`` (rows) and, when
    matplotlib is importable and `plot_kwargs` is given, ``<name>.png`` into `out_dir` (default:
    a new temporary folder, see :func:`results_dir`; "-": nothing). Returns the paths written."""
    if out_dir is not None and str(out_dir) == "-":
        return []
    out = Path(results_dir(None, name) if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    doc = {
        "name": name,
        "environment": dict(environment() if env is None else env),
        "meta": dict(meta or {}),
        "rows": list(rows),
    }
    jpath = out / f"{name}.json"
    jpath.write_text(json.dumps(_json_safe(doc), indent=1) + "\n")
    written.append(jpath)
    cpath = out / f"{name}.csv"
    cols = _columns_of(rows)
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_cell(r.get(k)) for k in cols})
    written.append(cpath)
    if plot_kwargs is not None:
        p = plot(rows, out / f"{name}.png", **plot_kwargs)
        if p is not None:
            written.append(p)
    return written


def save_run(b: Any, name: str, out_dir: str | os.PathLike[str] | None, env: Mapping[str, Any], *,
             meta: Mapping[str, Any] | None = None, plot_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """:func:`save_results` of a bench run `b` (``rows``, ``meta``, ``failures``, ``elapsed()``): its
    meta, failures and elapsed seconds, plus `meta`. A failure to save is recorded in
    ``b.failures`` (the run's tables still print), not raised. Returns the paths as strings."""
    try:
        return [str(p) for p in save_results(
            b.rows, name, out_dir, env=env,
            meta={**b.meta, "failures": b.failures, "elapsed_s": b.elapsed(), **(meta or {})},
            plot_kwargs=plot_kwargs)]
    except Exception as e:
        b.failures.append(f"saving results: {short_error(e)}")
        return []


def _csv_cell(v: Any) -> Any:
    if isinstance(v, float):
        return "" if not math.isfinite(v) else f"{v:.6g}"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(_json_safe(v))
    return "" if v is None else v


def plot(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    x: str = "numel",
    y: str = "gbps",
    series: str = "impl",
    panels: Sequence[str] = ("op", "dtype"),
    where: Callable[[Mapping[str, Any]], bool] | None = None,
    hline: float | None = None,
    hline_label: str = "copy bandwidth",
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    logx: bool = True,
    logy: bool = False,
) -> Path | None:
    """Line plot of `y` against `x`, one line per value of `series`, one panel per combination of
    `panels`, an optional horizontal reference line (e.g. copy bandwidth); `logy` for values that
    span orders of magnitude (optimizer steps: ms to seconds). Returns the PNG path,
    or None when matplotlib is missing or there is nothing to plot (never raises for those)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    pts = [
        r for r in rows
        if (where is None or where(r)) and _is_num(r.get(x)) and _is_num(r.get(y))
    ]
    if not pts:
        return None
    keys = list(dict.fromkeys(tuple(str(r.get(p)) for p in panels) for r in pts))  # order of appearance
    names = list(dict.fromkeys(str(r.get(series)) for r in pts))
    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    colors = {s: cycle[i % len(cycle)] for i, s in enumerate(names)}  # one colour per series everywhere
    ncols = min(len(keys), 2)
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        sub = [r for r in pts if tuple(str(r.get(p)) for p in panels) == key]
        for s in dict.fromkeys(str(r.get(series)) for r in sub):
            line = sorted((r[x], r[y]) for r in sub if str(r.get(series)) == s)
            ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", label=s, color=colors[s])
        if hline is not None and math.isfinite(hline):
            ax.axhline(hline, color="k", linestyle="--", linewidth=1, label=hline_label)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(" ".join(key))
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def format_value(v: Any) -> str:
    """A table cell: 4 significant digits for floats, thousands kept compact (4096 -> 4K)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(
    rows: Iterable[Mapping[str, Any]],
    columns: Sequence[str | tuple[str, str]],
    *,
    title: str | None = None,
    file: Any = None,
    formatters: Mapping[str, Callable[[Any], str]] | None = None,
) -> str:
    """Print rows as an aligned plain-text table and return the text.

    `columns` are row keys, or ``(key, header)`` pairs. Numbers are right-aligned, text left-
    aligned; missing values print as ``-``. `formatters` maps a key to a cell formatter.
    """
    cols = [(c, c) if isinstance(c, str) else (c[0], c[1]) for c in columns]
    fmts = dict(formatters or {})
    body: list[list[str]] = []
    numeric = [True] * len(cols)
    rows = list(rows)
    for r in rows:
        line = []
        for j, (key, _) in enumerate(cols):
            v = r.get(key)
            line.append(fmts[key](v) if key in fmts else format_value(v))
            if v is not None and not _is_num(v) and not (isinstance(v, float)):
                numeric[j] = False
        body.append(line)
    widths = [max([len(h)] + [len(line[j]) for line in body]) for j, (_, h) in enumerate(cols)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if numeric[j] else c.ljust(w) for j, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(fmt([h for _, h in cols]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(line) for line in body)
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def format_exception(exc: BaseException) -> str:
    """The full traceback of `exc` as text (for logs; tables use :func:`short_error`)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def print_summary_head(name: str, env: Mapping[str, Any], seconds: float, *extras: str,
                       cpu: str = "CPU (dry run)") -> None:
    """The summary's first lines: a rule, then ``SUMMARY <name>: <gpu> | torch .. | commit .. | N s``
    and `extras`, " | "-joined (`cpu` stands for the GPU's name in a dry run)."""
    print("=" * 110)
    parts = [env.get("gpu") or cpu, f"torch {env.get('torch')}", f"commit {str(env.get('git_commit'))[:12]}",
             f"{seconds:.0f} s", *extras]
    print(f"SUMMARY {name}: " + " | ".join(parts))


def print_outcome(failures: Sequence[str], saved: Sequence[str]) -> None:
    """The last lines of a benchmark's summary: its failed or skipped cases (or that every case
    was validated and timed) and where the results were saved."""
    if failures:
        print(f"\n{len(failures)} FAILED or skipped cases (rows with an error in the results):")
        for f in failures[:12]:
            print(f"  - {f[:160]}")
        if len(failures) > 12:
            print(f"  ... and {len(failures) - 12} more")
    else:
        print("\nall cases validated and timed")
    print("results: " + (", ".join(saved) if saved else "not saved"))
