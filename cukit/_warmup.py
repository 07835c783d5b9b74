"""Compiling kernels ahead of time: ``cukit.warmup()`` and ``cukit warmup``, and the offline compile
check ``cukit check-kernels`` on the same machinery.

A kernel group compiles on the first call that needs it, which takes seconds per group. ``warmup``
compiles a chosen set of groups up front, with a progress line:

- on a GPU (no `arch`): through the loader itself (``KernelModule.function``) for that device, so
  the process's kernel table and CuPy's on-disk cache are filled: later calls, and later processes,
  start without compiling;
- offline (``arch="sm_90"``, no GPU needed): through NVRTC, one process per group as
  ``cukit check-kernels`` does; this checks that the kernels compile for that architecture and
  fills no cache (CuPy's cache is filled only by a compile on the GPU).

Groups are chosen by op (:data:`OPS`, the public names) and by dtype: a group named
``<dtype>/...`` belongs to that dtype; a group without one (``steps``, ``reduce``, ...) is shared and
compiled whenever its kernel file is.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from cukit._runtime import KernelCompileError, KernelModule, compile_notices_muted, quiet, registered_modules

__all__ = [
    "KERNEL_DTYPES",
    "KERNEL_OWNERS",
    "OPS",
    "Job",
    "Outcome",
    "Progress",
    "WarmupResult",
    "all_modules",
    "compile_jobs",
    "fmt_seconds",
    "parse_archs",
    "parse_dtypes",
    "parse_ops",
    "plan",
    "plural",
    "warmup",
]

# Modules that declare kernels: importing them completes the loader's registry.
KERNEL_OWNERS = (
    "cukit.ops.bias_act",
    "cukit.ops.conv2d",
    "cukit.ops.glu",
    "cukit.ops.linear_cross_entropy",
    "cukit.ops.rope",
    "cukit.ops.norm",
    "cukit.ops.matmul_simt",
    "cukit.ops.matmul_tc",
    "cukit.ops.repack",
    "cukit.optim._kernels",
    "cukit.ops.per_sample",
    "cukit.ops.linalg",
)

# Each public op and the kernel files its calls launch (files as in raw_kernels/; a file's
# architecture-specific variant, e.g. matmul_tc.cu[sm_90a], comes with it). The optimizers take the
# norm kernels for clipping.
OPS: dict[str, tuple[str, ...]] = {
    "bias_act": ("bias_act.cu",),
    "conv2d": ("conv2d.cu",),
    "swiglu": ("glu.cu",),
    "rotary_embedding": ("rope.cu",),
    "rms_norm": ("norm.cu",),
    "matmul": ("matmul_simt.cu", "matmul_tc.cu", "repack.cu"),
    "linear_cross_entropy": ("cross_entropy.cu", "matmul_simt.cu", "matmul_tc.cu", "repack.cu"),
    "adagrad": ("adagrad.cu", "multi_tensor_l2norm.cu"),
    "adam": ("adam.cu", "multi_tensor_l2norm.cu"),
    "lamb": ("lamb.cu", "multi_tensor_l2norm.cu"),
    "lion": ("lion.cu", "multi_tensor_l2norm.cu"),
    "sgd": ("sgd.cu", "multi_tensor_l2norm.cu"),
    "multi_tensor_l2norm": ("multi_tensor_l2norm.cu",),
    "per_sample_grads": ("per_sample.cu", "matmul_simt.cu", "matmul_tc.cu", "repack.cu"),
    "matrix_inverse_root": ("linalg.cu", "matmul_simt.cu", "matmul_tc.cu"),
    "shampoo": ("shampoo.cu", "linalg.cu", "matmul_simt.cu", "matmul_tc.cu"),
}
# Other public names of the same kernels.
_ALIASES: dict[str, str] = {
    "bias_act_backward": "bias_act",
    "swiglu_backward": "swiglu",
    "geglu": "swiglu",
    "geglu_backward": "swiglu",
    "rotary_embedding_backward": "rotary_embedding",
    "rms_norm_backward": "rms_norm",
    "layer_norm": "rms_norm",
    "layer_norm_backward": "rms_norm",
    "linear": "matmul",
    "batch_matmul": "matmul",
    "chunked_matmul": "matmul",
    "adamw": "adam",
    "clip_grad_norm_": "multi_tensor_l2norm",
    "per_sample_grad_norms": "per_sample_grads",
    "dp": "per_sample_grads",
    "matrix_root": "matrix_inverse_root",
    "matrix_power": "matrix_inverse_root",
    "kron": "matrix_inverse_root",
}
# The dtypes kernels are instantiated for (a group's name starts with one of them).
KERNEL_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")

_ARCH = re.compile(r"sm_\d{2,3}a?")


def all_modules() -> dict[str, KernelModule]:
    """Every declared kernel module (``cukit._runtime.KernelModule``) by registry key."""
    for owner in KERNEL_OWNERS:
        importlib.import_module(owner)
    return registered_modules()


# --------------------------------------------------------------------------------------------
# Choosing groups
# --------------------------------------------------------------------------------------------


def _names(value: str | Iterable[Any] | None) -> list[Any] | None:
    """None (everything), or the items of a list or of a comma-separated string."""
    if value is None:
        return None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def parse_ops(ops: str | Iterable[str] | None, *, where: str = "cukit.warmup: ops") -> list[str] | None:
    """Canonical op names (keys of :data:`OPS`) from public names, any case; None for all.
    ValueError naming `where`, the expected names and what was given for anything else."""
    given = _names(ops)
    if given is None:
        return None
    expected = ", ".join([*OPS, *(f"{a} (= {o})" for a, o in _ALIASES.items())])
    if not given:
        raise ValueError(f"{where}: no op given; expected one or more of {expected}")
    out: list[str] = []
    for name in given:
        key = str(name).strip().lower()
        key = _ALIASES.get(key, key)
        if not isinstance(name, str) or key not in OPS:
            raise ValueError(f"{where}: unknown op {name!r}; expected one or more of {expected}; got {given!r}")
        if key not in out:
            out.append(key)
    return out


def parse_dtypes(dtypes: str | Iterable[Any] | None, *, where: str = "cukit.warmup: dtypes") -> list[str] | None:
    """Dtype names from names, NumPy dtypes or torch dtypes; None for all. ValueError naming
    `where`, the expected names and what was given for a dtype no kernel is built for."""
    given = _names(dtypes)
    if given is None:
        return None
    expected = ", ".join(KERNEL_DTYPES)
    if not given:
        raise ValueError(f"{where}: no dtype given; expected one or more of {expected}")
    from cukit.interop import as_dtype

    out: list[str] = []
    for d in given:
        try:
            name = as_dtype(d).name
        except TypeError:
            name = None
        if name not in KERNEL_DTYPES:
            raise ValueError(f"{where}: {d!r} is not a dtype the kernels are built for; expected one or more "
                             f"of {expected}; got {given!r}")
        if name not in out:
            out.append(name)
    return out


def parse_archs(arch: str | Iterable[str], *, where: str = "cukit.warmup: arch") -> list[str]:
    """Architecture names ("sm_80", "sm_90a") from a list or a comma-separated string."""
    given = _names(arch) or []
    bad = [a for a in given if not (isinstance(a, str) and _ARCH.fullmatch(a))]
    if bad or not given:
        raise ValueError(f"{where}: expected architectures such as sm_80, sm_90, sm_90a; got {arch!r}")
    return list(dict.fromkeys(given))


@dataclass(frozen=True)
class Job:
    """One instantiation group of one kernel module, to compile for one architecture."""

    module: str  # registry key, e.g. "matmul_tc.cu[sm_90a]"
    group: str
    arch: str
    size: int  # instantiations in the group

    def __str__(self) -> str:
        return f"{self.module} [{self.group}]"


def _group_dtype(group: str) -> str | None:
    head = group.split("/", 1)[0]
    return head if head in KERNEL_DTYPES else None


def plan(
    arch: str,
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    modules: dict[str, KernelModule] | None = None,
) -> list[Job]:
    """The groups to compile for `arch`: those of the modules built for it (``KernelModule.targets``),
    of the files of `ops` (canonical names; None: every module), of `dtypes` (None: all; groups of no
    dtype always). Largest groups first, so the slowest compiles do not start last."""
    modules = all_modules() if modules is None else modules
    files = None if ops is None else {f for op in ops for f in OPS[op]}
    jobs = [
        Job(key, group, arch, len(exprs))
        for key, m in sorted(modules.items())
        if m.targets(arch) and (files is None or os.path.basename(m.file) in files)
        for group, exprs in m.instantiations.items()
        if dtypes is None or _group_dtype(group) in (None, *dtypes)
    ]
    return sorted(jobs, key=lambda j: -j.size)


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    """`n` and the noun, plural unless n is 1: "1 group", "2 groups"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fmt_seconds(seconds: float) -> str:
    """Elapsed time for a progress line: "42 s", "3m58s"."""
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Progress:
    """A task's progress on a stream (stderr by default): done/total, percent, elapsed time.

    On a terminal one line is rewritten in place (``\\r``) after every step, with the step's name.
    Elsewhere (a CI log) a plain line is printed at the start, at every tenth of the way and when
    30 s passed since the last one: about a dozen lines for hundreds of steps."""

    EVERY_S = 30.0

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "groups",
        stream: TextIO | None = None,
        tty: bool | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit, self.enabled, self.clock = label, total, unit, enabled, clock
        self.stream = sys.stderr if stream is None else stream
        if tty is None:
            try:
                tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self.done = self.failed = 0
        self.t0 = clock()
        self._last_print = self.t0
        self._last_tenth = 0
        self._width = 0
        self._emit(self._line())

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def _line(self, detail: str = "") -> str:
        pct = 100 * self.done // self.total if self.total else 100
        line = f"{self.label}: {self.done}/{self.total} {self.unit} ({pct}%), {fmt_seconds(self.elapsed())}"
        if self.failed:
            line += f", {self.failed} failed"
        return f"{line}  {detail}" if detail and self.tty else line

    def _emit(self, line: str, *, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            cols = shutil.get_terminal_size((100, 20)).columns - 1
            line = line[:cols]  # a wrapped line cannot be rewritten with \r
            self.stream.write("\r" + line.ljust(self._width) + ("\n" if final else ""))
            self._width = 0 if final else len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_print = self.clock()

    def advance(self, n: int = 1, *, detail: str = "", failed: bool = False) -> None:
        """`n` more steps done (`detail`: what just finished, shown on a terminal)."""
        self.done += n
        self.failed += int(failed)
        tenth = 10 * self.done // self.total if self.total else 10
        if self.tty or tenth > self._last_tenth or self.clock() - self._last_print >= self.EVERY_S:
            self._last_tenth = tenth
            if not (not self.tty and self.done >= self.total):  # the final line says it
                self._emit(self._line(detail))

    def finish(self, summary: str = "") -> None:
        """The last line: `summary` after the label (default: the counts)."""
        self._emit(f"{self.label}: {summary}" if summary else self._line(), final=True)


# --------------------------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """A compiled (or failed) job and how long it took."""

    job: Job
    seconds: float
    error: KernelCompileError | None = None


def _offline(job: Job) -> tuple[Job, float, tuple[str, str, str, str | None] | None]:
    """Compile one job through NVRTC (a worker process). A KernelCompileError travels back as its
    fields: its constructor's arguments are not its ``args``, so it does not unpickle."""
    module = all_modules()[job.module]
    t0 = time.perf_counter()
    try:
        module.compile_offline(job.arch, [job.group])
    except KernelCompileError as e:
        return job, time.perf_counter() - t0, (e.file, e.instantiation, e.log, e.arch)
    return job, time.perf_counter() - t0, None


def _on_device(job: Job, device: int) -> Outcome:
    """Compile one job through the loader, for `device` (its first instantiation compiles the group)."""
    module = all_modules()[job.module]
    t0 = time.perf_counter()
    try:
        with compile_notices_muted():
            module.function(module.instantiations[job.group][0], device)
    except KernelCompileError as e:
        return Outcome(job, time.perf_counter() - t0, e)
    return Outcome(job, time.perf_counter() - t0)


def compile_jobs(
    jobs: Sequence[Job],
    progress: Progress,
    *,
    device: int | None = None,
    processes: int = 1,
) -> list[Outcome]:
    """Compile `jobs` and report each on `progress`: through the loader on `device`, or offline
    (device None) in `processes` worker processes. Failures are returned, not raised; RuntimeError
    when offline compilation is unavailable (no NVRTC)."""
    outcomes: list[Outcome] = []

    def done(o: Outcome) -> None:
        outcomes.append(o)
        progress.advance(detail=str(o.job), failed=o.error is not None)

    if device is not None:
        for job in jobs:
            done(_on_device(job, device))
        return outcomes

    def offline_outcome(r: tuple[Job, float, tuple[str, str, str, str | None] | None]) -> Outcome:
        job, seconds, err = r
        return Outcome(job, seconds, None if err is None else KernelCompileError(*err))

    if processes > 1 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # NVRTC holds the GIL, so groups compile in parallel only in separate processes; forked,
        # so the workers see the parent's registry as it is.
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(processes, len(jobs)), mp_context=ctx) as pool:
            futures = [pool.submit(_offline, j) for j in jobs]
            try:
                for f in as_completed(futures):
                    done(offline_outcome(f.result()))
            except BaseException:  # no NVRTC, or Ctrl-C: leaving the pool must not wait for every group
                for f in futures:
                    f.cancel()
                raise
    else:
        for job in jobs:
            done(offline_outcome(_offline(job)))
    return outcomes


# --------------------------------------------------------------------------------------------
# warmup
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WarmupResult:
    """What :func:`warmup` compiled."""

    arch: str  # e.g. "sm_90"
    groups: int
    instantiations: int
    seconds: float
    offline: bool  # compiled through NVRTC without a GPU: checked, nothing cached
    device: int | None = None


def _current_device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def warmup(
    ops: str | Iterable[str] | None = None,
    dtypes: str | Iterable[Any] | None = None,
    *,
    arch: str | None = None,
    device: int | None = None,
    jobs: int = 1,
    progress: bool | None = None,
) -> WarmupResult:
    """Compile kernels ahead of time, so that the first call of an op does not.

    ``cukit.warmup(ops=["matmul", "bias_act"], dtypes=["bfloat16", "float32"])`` compiles the
    kernel groups those ops use for those dtypes on the current GPU (CuPy's current device, or
    `device`); compiled groups are kept by this process and cached on disk by CuPy for later ones.

    ops: public op names (``matmul``, ``linear``, ``bias_act``, ``adamw``, ... see ``OPS``), a list or a
        comma-separated string; None: every kernel. dtypes: names, NumPy or torch dtypes among
        float16, bfloat16, float32, float64; None: all. Groups shared by every dtype always compile.
    arch: e.g. ``"sm_90"``: compile offline for that architecture instead, through NVRTC, without a
        GPU (what ``cukit check-kernels`` does): a check that the kernels compile, nothing cached.
        `jobs` worker processes then compile in parallel.
    progress: a progress line on stderr (default: on unless ``CUKIT_QUIET`` is set).

    Raises ValueError for an unknown op, dtype or architecture; RuntimeError without a GPU (and no
    `arch`) or without NVRTC offline; KernelCompileError for the first group that failed to compile.
    """
    op_names = parse_ops(ops)
    dtype_names = parse_dtypes(dtypes)
    archs = None if arch is None else parse_archs(arch)
    if archs is not None and len(archs) != 1:
        raise ValueError(f"cukit.warmup: arch: one architecture at a time; got {arch!r}")
    if not (isinstance(jobs, int) and not isinstance(jobs, bool) and jobs >= 1):
        raise ValueError(f"cukit.warmup: jobs: expected an integer >= 1; got {jobs!r}")
    show = not quiet() if progress is None else progress
    if archs is None:
        from cukit._device import device_caps, is_available

        if not is_available():
            raise RuntimeError(
                "cukit.warmup: no CUDA GPU is visible, so there is no kernel cache to fill. To check that "
                "the kernels compile for an architecture without a GPU, name it: arch='sm_90' "
                "(`cukit warmup --arch sm_90`); that compiles offline and caches nothing."
            )
        device = _current_device() if device is None else device
        target = f"sm_{device_caps(device).cc}"
        label = f"cukit warmup {target} (GPU {device})"
    else:
        target, device = archs[0], None
        label = f"cukit warmup {target} (offline)"
    chosen = plan(target, op_names, dtype_names)
    bar = Progress(label, len(chosen), enabled=show)
    outcomes = compile_jobs(chosen, bar, device=device, processes=jobs)
    errors = [o.error for o in outcomes if o.error is not None]
    n = sum(o.job.size for o in outcomes if o.error is None)
    bar.finish(f"{plural(len(outcomes) - len(errors), 'group')} ({plural(n, 'instantiation')}) compiled"
               + (f", {len(errors)} failed" if errors else "") + f" in {fmt_seconds(bar.elapsed())}")
    if errors:
        raise errors[0]  # its message names the file, the group and NVRTC's log
    return WarmupResult(target, len(outcomes), n, bar.elapsed(), device is None, device)
