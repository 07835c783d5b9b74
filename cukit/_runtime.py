"""The one kernel loader: read ``raw_kernels/<name>.cu``, compile it with NVRTC (through CuPy on a GPU,
through cuda.bindings offline), cache per (file, instantiation group, device), launch with typed
arguments on the right stream.

A kernel file is declared once, by the op that uses it::

    BIAS_ACT = KernelModule(
        "bias_act.cu",
        instantiations={"float32": ["bias_act_fwd<float, 0, 4, int>", ...], ...},
        signatures={"bias_act_fwd": "ptr ptr ptr i64 i64", ...},
    )

``instantiations`` groups the template instantiations (NVRTC name expressions) that are compiled
together; one group is compiled on first use of any of its members. ``signatures`` gives each
kernel's parameter types, so Python numbers are sent with the width the kernel expects (CuPy sends
a Python float as a double, silently). ``cukit check-kernels`` compiles every declared
instantiation of every module without a GPU (``cukit._warmup.all_modules``); ``cukit warmup``
compiles a chosen set ahead of time through this loader.

A first call whose group takes longer than :data:`COMPILE_NOTICE_S` to compile prints one note to
stderr (once per process; ``CUKIT_QUIET=1`` hides it): a user otherwise sees an op that seems to hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import importlib.resources
import itertools
import operator
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from cukit.interop import contiguous, is_contiguous

__all__ = [
    "Densify",
    "KernelCompileError",
    "KernelModule",
    "Launch",
    "PlanCache",
    "compile_notices_muted",
    "cuda_include_dirs",
    "include_dir",
    "kernel_dir",
    "quiet",
    "registered_modules",
]

# Options shared by the CuPy path and the offline path. CuPy adds -ftz=true itself; the offline
# compiler adds it too, so both compile the same code.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)

# Dynamic shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
_DEFAULT_SMEM = 48 * 1024


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel: names the .cu file, the instantiation(s) and carries the log."""

    def __init__(self, file: str, instantiation: str, log: str, arch: str | None = None) -> None:
        self.file = file
        self.instantiation = instantiation
        self.log = log
        self.arch = arch
        where = f" for {arch}" if arch else ""
        super().__init__(f"failed to compile {file} [{instantiation}]{where}:\n{log.strip()}")


# --------------------------------------------------------------------------------------------
# The first-compile note
# --------------------------------------------------------------------------------------------

# A group whose compile takes longer than this says so (once per process). Measured, then printed:
# whether CuPy's on-disk cache holds the group is only known once it has loaded (in milliseconds) or
# compiled (seconds), and NVRTC holds the GIL, so no timer thread could print while it compiles.
COMPILE_NOTICE_S = 1.0
_clock = time.perf_counter
_notice_shown = False
_notice_mute = threading.local()


def quiet() -> bool:
    """Whether ``CUKIT_QUIET`` is set (to anything but "" or "0"): cukit prints no notes of its own."""
    return os.environ.get("CUKIT_QUIET", "").strip() not in ("", "0")


@contextlib.contextmanager
def compile_notices_muted() -> Iterator[None]:
    """No first-compile note from this thread inside the block: ``cukit warmup`` and ``cukit info``
    report their compiles themselves."""
    _notice_mute.depth = getattr(_notice_mute, "depth", 0) + 1
    try:
        yield
    finally:
        _notice_mute.depth -= 1


def _device_arch(device: int) -> str:
    try:
        from cukit._device import device_caps

        return f"sm_{device_caps(device).cc}"
    except Exception:  # a device query failing must not turn a finished compile into an error
        return f"GPU {device}"


def _compile_notice(what: str, arch: str, seconds: float) -> None:
    """Print the first-compile note to stderr if this compile was slow and none was printed yet.
    stderr, not ``warnings.warn``: shown by default, and a test run under ``-W error`` does not turn
    it into an exception."""
    global _notice_shown
    if _notice_shown or seconds <= COMPILE_NOTICE_S or getattr(_notice_mute, "depth", 0) or quiet():
        return
    _notice_shown = True
    print(
        f"cukit: compiled {what} for {arch} in {seconds:.1f} s on first use; later runs reuse CuPy's "
        "on-disk cache. `cukit warmup` compiles ahead of time; CUKIT_QUIET=1 hides this note.",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# Where the sources are
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def kernel_dir() -> Path:
    """The directory holding the .cu files: ``cukit/raw_kernels`` in a wheel, ``raw_kernels/`` in
    an editable install (setuptools maps it there)."""
    try:
        res = importlib.resources.files("cukit.raw_kernels")
        # A namespace package gives a MultiplexedPath; take its first real directory.
        paths = getattr(res, "_paths", None) or [res]
        for p in paths:
            p = Path(str(p))
            if (p / "include").is_dir():
                return p
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve().parent
    for p in (here / "raw_kernels", here.parent / "raw_kernels"):
        if (p / "include").is_dir():
            return p
    raise FileNotFoundError("cukit's raw_kernels directory is missing from this installation")


def include_dir() -> Path:
    """The directory passed with -I: kernels write ``#include <cukit/...cuh>``."""
    return kernel_dir() / "include"


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """CUDA's own headers (cuda_fp16.h, cuda_bf16.h): from the CUDA toolkit, or from NVIDIA's PyPI
    wheels when there is no toolkit. Empty when none is found (NVRTC may still know them)."""
    found: list[str] = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and Path(root, "include", "cuda_fp16.h").is_file():
            found.append(str(Path(root, "include")))
    for root in ("/usr/local/cuda",):
        if Path(root, "include", "cuda_fp16.h").is_file():
            found.append(str(Path(root, "include")))
    for entry in sys.path:
        base = Path(entry or ".", "nvidia")
        if not base.is_dir():
            continue
        for inc in sorted(base.glob("*/include")):
            if (inc / "cuda_fp16.h").is_file():
                found.append(str(inc))
    seen: dict[str, None] = {}
    for f in found:
        seen.setdefault(os.path.realpath(f), None)
    return tuple(seen)


def headers_digest(root: Path | None = None) -> str:
    """A hash of every header under the include directory (names and contents)."""
    root = include_dir() if root is None else root
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.cuh")):
        h.update(str(p.relative_to(root)).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _headers_digest_cached() -> str:
    return headers_digest()


def prepare_source(text: str, digest: str) -> str:
    """The source handed to NVRTC. CuPy's cache key hashes the source and options but not the
    headers pulled in through -I, so the headers' digest goes into the source: editing a header
    changes the key and forces a recompile."""
    return f"// cukit headers {digest}\n{text}"


# --------------------------------------------------------------------------------------------
# Typed launch arguments
# --------------------------------------------------------------------------------------------

_SCALAR_TYPES: dict[str, type] = {
    "i32": np.int32,
    "i64": np.int64,
    "u64": np.uint64,
    "f32": np.float32,
    "f64": np.float64,
}


def _int_in(typ: type, lo: int, hi: int) -> Any:
    def conv(v: int) -> Any:
        if not lo <= v <= hi:
            raise ValueError(f"{v} does not fit in {typ.__name__}")
        return typ(v)

    return conv


# (kind, Python type) -> converter for the argument types launches pass every call.
_FAST: dict[tuple[str, type], Any] = {
    ("ptr", int): int,
    ("i64", int): _int_in(np.int64, -(2**63), 2**63 - 1),
    ("i32", int): _int_in(np.int32, -(2**31), 2**31 - 1),
    ("f32", float): np.float32,
    ("f64", float): np.float64,
}


def _pointer(v: Any, kernel: str, i: int) -> int:
    if v is None:
        return 0
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    ptr = getattr(v, "data_ptr", None)
    if ptr is not None:  # torch.Tensor
        return ptr()
    data = getattr(v, "data", None)
    if data is not None and hasattr(data, "ptr"):  # cupy.ndarray
        return data.ptr
    raise TypeError(f"{kernel}: argument {i} is a pointer; got {type(v).__qualname__}")


def convert_args(kernel: str, signature: Sequence[str], args: Sequence[Any], *, first: int = 0) -> tuple[Any, ...]:
    """Turn launch arguments into what the kernel's C signature expects: pointers from arrays,
    scalars as NumPy scalars of the declared width (never a Python float, which CuPy sends as a
    double). `first`: the position of ``args[0]`` in the kernel's parameter list (errors name it)."""
    if len(args) != len(signature):
        raise TypeError(f"{kernel} takes {len(signature)} arguments ({' '.join(signature)}), got {len(args)}")
    out: list[Any] = []
    for i, (kind, v) in enumerate(zip(signature, args, strict=True), start=first):
        fast = _FAST.get((kind, type(v)))
        if fast is not None:  # the common cases, one dict lookup each (hot path)
            try:
                out.append(fast(v))
                continue
            except ValueError:
                pass  # out of range: the checks below raise the full message
        if kind == "ptr":
            out.append(_pointer(v, kernel, i))
            continue
        if kind == "b128":  # a 128-byte struct by value (a CUtensorMap): one 128-byte NumPy element
            if not (isinstance(v, np.ndarray) and v.size == 1 and v.dtype.itemsize == 128):
                raise TypeError(f"{kernel}: argument {i} is a 128-byte struct (a NumPy array of one 128-byte element)")
            out.append(v)
            continue
        typ = _SCALAR_TYPES[kind]
        if isinstance(v, np.generic) and type(v) is typ:
            out.append(v)
        elif kind[0] in "iu":
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{kernel}: argument {i} is {kind}; got {type(v).__qualname__}")
            try:
                out.append(typ(operator.index(v)))
            except OverflowError:
                raise ValueError(f"{kernel}: argument {i} = {v} does not fit in {kind}") from None
        else:
            if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
                raise TypeError(f"{kernel}: argument {i} is {kind}; got {type(v).__qualname__}")
            out.append(typ(v))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Kernel modules
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, KernelModule] = {}


@dataclass
class KernelModule:
    """One .cu file, its declared instantiations and its kernels' signatures."""

    file: str  # relative to raw_kernels/, or an absolute path for a user's own kernel file
    instantiations: Mapping[str, Sequence[str]]
    signatures: Mapping[str, str]
    options: tuple[str, ...] = ()
    register: bool = True  # list it in registered_modules() (and so in `cukit check-kernels`)
    # An architecture-specific target such as "sm_90a" (wgmma, setmaxnreg): the module compiles
    # only for it, and only runs on devices of that compute capability.
    arch: str | None = None
    _signatures: dict[str, tuple[str, ...]] = field(init=False, repr=False)
    _group_of: dict[str, str] = field(init=False, repr=False)
    _functions: dict[tuple[str, int], Any] = field(init=False, repr=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _smem_limit: dict[tuple[str, int], int] = field(init=False, repr=False, default_factory=dict)
    compiles: int = field(init=False, default=0)  # how many groups this process compiled

    def __post_init__(self) -> None:
        self._signatures = {k: tuple(v.split()) for k, v in self.signatures.items()}
        for kinds in self._signatures.values():
            bad = [k for k in kinds if k not in ("ptr", "b128") and k not in _SCALAR_TYPES]
            if bad:
                raise ValueError(f"{self.file}: unknown argument kinds {bad}")
        self._group_of = {}
        for group, exprs in self.instantiations.items():
            for e in exprs:
                if _template_name(e) not in self._signatures:
                    raise ValueError(f"{self.file}: no signature declared for {e}")
                self._group_of[e] = group
        if self.register:
            _REGISTRY[self.key] = self

    @property
    def key(self) -> str:
        """The registry name: the file, plus the target for an architecture-specific module."""
        return f"{self.file}[{self.arch}]" if self.arch else self.file

    # -- source --------------------------------------------------------------------------------
    def read_source(self) -> str:
        path = Path(self.file) if os.path.isabs(self.file) else kernel_dir() / self.file
        try:
            return path.read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"kernel source {self.file} is missing from {kernel_dir()}") from None

    def compile_options(self) -> tuple[str, ...]:
        return (*BASE_OPTIONS, f"-I{include_dir()}", *(f"-I{d}" for d in cuda_include_dirs()), *self.options)

    def targets(self, arch: str) -> bool:
        """Whether this module is built for a requested architecture: always for a generic module;
        an "sm_90a" module for "sm_90" or "sm_90a"."""
        return self.arch is None or self.arch.rstrip("a") == arch.rstrip("a")

    def all_instantiations(self) -> list[str]:
        return [e for exprs in self.instantiations.values() for e in exprs]

    # -- GPU path (CuPy) -----------------------------------------------------------------------
    def function(self, name_expr: str, device: int) -> Any:
        """The compiled kernel for one instantiation on one device (compiled on first use)."""
        key = (name_expr, device)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(key)
            if fn is None:
                group = self._group(name_expr)
                t0 = _clock()
                self._compile_group(group, device)
                seconds = _clock() - t0
                if seconds > COMPILE_NOTICE_S:
                    _compile_notice(f"{os.path.basename(self.key)} [{group}]", self.arch or _device_arch(device),
                                    seconds)
                fn = self._functions[key]
        return fn

    def _group(self, name_expr: str) -> str:
        try:
            return self._group_of[name_expr]
        except KeyError:
            raise ValueError(f"{self.file}: {name_expr} is not a declared instantiation") from None

    def _compile_group(self, group: str, device: int) -> None:
        import cupy

        exprs = list(self.instantiations[group])
        src = prepare_source(self.read_source(), _headers_digest_cached())
        options = self.compile_options() + ((f"-arch={self.arch}",) if self.arch else ())
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=src, options=options, name_expressions=exprs)
            try:
                fns = {e: module.get_function(e) for e in exprs}
            except cupy.cuda.compiler.CompileException as e:
                raise KernelCompileError(self.file, ", ".join(exprs), e.get_message()) from None
        self.compiles += 1
        for e, fn in fns.items():
            self._functions[(e, device)] = fn

    def launch(
        self,
        name_expr: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: Sequence[Any],
        *,
        device: int,
        stream: Any,
        shared_mem: int = 0,
    ) -> None:
        """Launch one instantiation. `stream` is an object with ``.ptr`` (see
        ``cukit.interop.current_stream``); `args` are converted by the kernel's signature. Ops
        called in a loop build a :class:`Launch` once with :meth:`prepare` instead."""
        self.prepare(name_expr, grid, block, args, device=device, shared_mem=shared_mem, n_head=0, reuse=False)(
            (), stream
        )

    def prepare(
        self,
        name_expr: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        tail: Sequence[Any],
        *,
        device: int,
        shared_mem: int = 0,
        n_head: int | None = None,
        reuse: bool = True,
    ) -> Launch:
        """A ready launch of one instantiation: compiled, its shared-memory limit raised, the
        trailing `tail` arguments converted once by the kernel's signature. The first `n_head`
        arguments (default: all the signature's arguments before `tail`, usually the pointers)
        are given per call: ``launch(head, stream)``. reuse=False: a launch used once (CuPy
        launches it; building the driver parameter buffer would cost more than it saves)."""
        fn = self.function(name_expr, device)
        sig = self._signatures[_template_name(name_expr)]
        n_head = max(0, len(sig) - len(tail)) if n_head is None else n_head
        if n_head + len(tail) != len(sig):
            raise TypeError(f"{name_expr} takes {len(sig)} arguments ({' '.join(sig)}), got {n_head + len(tail)}")
        typed_tail = convert_args(name_expr, sig[n_head:], tail, first=n_head)
        if shared_mem > _DEFAULT_SMEM and self._smem_limit.get((name_expr, device), 0) < shared_mem:
            self._raise_smem_limit(fn, name_expr, device, shared_mem)
        return Launch(fn, tuple(grid), tuple(block), typed_tail, shared_mem, device, name_expr, sig[:n_head],
                      sig[n_head:] if reuse else ())

    def _raise_smem_limit(self, fn: Any, name_expr: str, device: int, nbytes: int) -> None:
        """Above 48 KiB a kernel must opt in to its dynamic shared memory
        (cudaFuncAttributeMaxDynamicSharedMemorySize, CuPy's ``max_dynamic_shared_size_bytes``);
        set once per (kernel, device), raised when a launch needs more than was set."""
        import cupy

        with self._lock, cupy.cuda.Device(device):
            if self._smem_limit.get((name_expr, device), 0) < nbytes:
                fn.max_dynamic_shared_size_bytes = nbytes
                self._smem_limit[(name_expr, device)] = nbytes

    # -- offline path (no GPU) ---------------------------------------------------------------
    def compile_offline(self, arch: str, groups: Iterable[str] | None = None) -> int:
        """Compile every declared instantiation for `arch` (e.g. "sm_90") through NVRTC, without a
        GPU. Returns how many instantiations compiled (0 when the module targets another
        architecture); raises KernelCompileError otherwise."""
        if not self.targets(arch):
            return 0
        arch = self.arch or arch
        n = 0
        for group in self.instantiations if groups is None else groups:
            exprs = list(self.instantiations[group])
            _nvrtc_compile(
                self.file,
                prepare_source(self.read_source(), headers_digest()),
                exprs,
                (*self.compile_options(), "-ftz=true"),
                arch,
            )
            n += len(exprs)
        return n


# Bytes and alignment of each argument kind in a kernel's parameter buffer (cuLaunchKernel).
_PARAM_LAYOUT: dict[str, tuple[str, int, int]] = {
    "ptr": ("Q", 8, 8),
    "u64": ("Q", 8, 8),
    "i64": ("q", 8, 8),
    "f64": ("d", 8, 8),
    "i32": ("i", 4, 4),
    "f32": ("f", 4, 4),
    "b128": ("128s", 128, 64),
}
_CUDA_ERROR_INVALID_CONTEXT = 201


def retry_without_context(rc: int, device: int, call: Callable[[], int]) -> int:
    """A driver call's CUresult `rc`, retried once through `call` in `device`'s primary context
    when it failed because the calling thread had no current context (a fresh thread: autograd's
    device thread before any CUDA call of its own); else `rc` as it was."""
    if rc != _CUDA_ERROR_INVALID_CONTEXT:
        return rc
    import cupy

    cupy.cuda.runtime.setDevice(device)
    return call()


@functools.lru_cache(maxsize=1)
def _cu_launch_kernel() -> Any:
    """The driver's cuLaunchKernel through ctypes, or None where libcuda cannot be loaded.

    A PyDLL call keeps the GIL: packing a Launch's parameter buffer and launching from it are one
    step that no other Python thread can interleave with (torch runs backward on its own thread),
    and the driver copies the parameters before the call returns."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuLaunchKernel
    u32 = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u32, u32, u32, u32, u32, u32, u32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class Launch:
    """One kernel launch with everything but its leading arguments fixed: the compiled function,
    grid, block, dynamic shared memory, device and the typed trailing arguments. Calling it with
    the leading arguments (device pointers as Python ints; a CUtensorMap as 128 bytes) enqueues
    the kernel: the hot path of every op.

    The trailing arguments are packed once into a parameter buffer laid out as the kernel's
    parameter list; a call packs the leading ones into it (one ``struct.pack_into``) and calls the
    driver's ``cuLaunchKernel`` directly, which costs a fraction of a generic launch that
    converts every argument per call. Where libcuda cannot be loaded, CuPy launches it.
    """

    __slots__ = (
        "_base", "_buf", "_cu", "_cufn", "_fixed", "_params", "_struct", "block", "device", "fn", "grid",
        "head_kinds", "name", "smem", "tail",
    )

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        tail: tuple[Any, ...],
        smem: int,
        device: int,
        name: str,
        head_kinds: tuple[str, ...],
        tail_kinds: tuple[str, ...] = (),
    ) -> None:
        self.fn, self.smem, self.tail = fn, smem, tail
        self.grid = (*grid, 1, 1)[:3]
        self.block = (*block, 1, 1)[:3]
        self.device, self.name, self.head_kinds = device, name, head_kinds
        self._cufn = self._fixed = None
        self._cu = _cu_launch_kernel()
        if self._cu is not None and len(tail_kinds) == len(tail):
            self._build_params(head_kinds, tail_kinds)
            # cuLaunchKernel's arguments before the stream, in one tuple: the hot path unpacks it
            self._fixed = (self._cufn, *self.grid, *self.block, smem)

    def _build_params(self, head_kinds: tuple[str, ...], tail_kinds: tuple[str, ...]) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            self._cufn = int(self.fn.kernel.ptr)
        offsets, off = [], 0
        for kind in (*head_kinds, *tail_kinds):
            _, size, align = _PARAM_LAYOUT[kind]
            off = -(-off // align) * align
            offsets.append(off)
            off += size
        self._buf = ctypes.create_string_buffer(off + 64)
        self._base = -ctypes.addressof(self._buf) % 64  # 64-byte aligned parameter block
        base_addr = ctypes.addressof(self._buf) + self._base
        self._params = (ctypes.c_void_p * max(1, len(offsets)))(*(base_addr + o for o in offsets))
        n = len(head_kinds)
        fmt, cur = "<", 0
        for kind, o in zip(head_kinds, offsets[:n], strict=True):
            fmt += "x" * (o - cur) + _PARAM_LAYOUT[kind][0]
            cur = o + _PARAM_LAYOUT[kind][1]
        self._struct = struct.Struct(fmt)
        for kind, o, v in zip(tail_kinds, offsets[n:], self.tail, strict=True):
            raw = np.asarray(v).tobytes()
            assert len(raw) == _PARAM_LAYOUT[kind][1], (kind, len(raw))
            ctypes.memmove(base_addr + o, raw, len(raw))

    def __call__(self, head: tuple[Any, ...], stream: Any) -> None:
        fixed = self._fixed
        if fixed is not None and _get_device() == self.device:
            self._struct.pack_into(self._buf, self._base, *head)
            rc = self._cu(*fixed, stream.ptr, self._params, None)
            if rc:  # nothing was enqueued
                self._recover(head, stream, rc)
        elif _get_device() == self.device:
            self._launch(head, stream)
        else:  # a kernel runs in its device's context: switch for tensors on another GPU
            import cupy

            with cupy.cuda.Device(self.device):
                self._launch(head, stream)

    def _launch(self, head: tuple[Any, ...], stream: Any) -> None:
        if self._cufn is None:
            self.fn(self.grid, self.block, self._cupy_head(head) + self.tail, shared_mem=self.smem, stream=stream)
            return
        rc = self._driver_launch(head, stream)
        if rc:
            self._recover(head, stream, rc)

    def _recover(self, head: tuple[Any, ...], stream: Any, rc: int) -> None:
        """A driver launch that failed with `rc`: retried in the device's primary context when the
        thread had none (a fresh thread), else relaunched through CuPy, which raises the error by
        its name."""
        rc = retry_without_context(rc, self.device, lambda: self._driver_launch(head, stream))
        if rc:
            self.fn(self.grid, self.block, self._cupy_head(head) + self.tail, shared_mem=self.smem, stream=stream)

    def _cupy_head(self, head: tuple[Any, ...]) -> tuple[Any, ...]:
        """The leading arguments as CuPy's launch takes them: scalars as NumPy scalars of their
        declared width (CuPy would send a Python int or float at 8 bytes), 128 raw bytes as a
        one-element NumPy struct, pointers as they are."""
        return tuple(_bytes_to_arg(v) if k == "b128" else v if k == "ptr" else _SCALAR_TYPES[k](v)
                     for k, v in zip(self.head_kinds, head, strict=True))

    def _driver_launch(self, head: tuple[Any, ...], stream: Any) -> int:
        """Pack the leading arguments and call cuLaunchKernel; its CUresult."""
        self._struct.pack_into(self._buf, self._base, *head)
        return self._cu(*self._fixed, stream.ptr, self._params, None)

    def __repr__(self) -> str:
        return f"Launch({self.name}, grid={self.grid}, block={self.block}, smem={self.smem}, device={self.device})"


def _get_device() -> int:
    """CUDA's current device (``cudaGetDevice``), the function looked up once."""
    global _get_device
    import cupy

    _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


_B128 = np.dtype((np.void, 128))


def _bytes_to_arg(v: Any) -> Any:
    """A leading argument as CuPy's launch takes it (128 raw bytes -> a one-element NumPy struct)."""
    if isinstance(v, bytes):
        return np.frombuffer(v, _B128).copy()
    return v


class PlanCache:
    """The one launch-plan cache: a bounded mapping from a call's signature (shapes, strides,
    dtypes, device, pointer alignment, options: everything a plan is derived from, never the
    data pointers themselves) to the plan an op built for it. A call whose signature is known does
    one dict lookup; new data pointers with the same signature reuse the plan.

    Least recently *inserted* entries are dropped first once `maxsize` is reached (a hit does not
    reorder: keeping the hit path to a single lookup matters more than perfect LRU order for the
    few hundred signatures a model uses). ``stats()`` reports hits, misses and size (tests)."""

    __slots__ = ("_data", "hits", "maxsize", "misses", "name")

    _ALL: ClassVar[list[PlanCache]] = []

    def __init__(self, name: str, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ValueError(f"PlanCache: maxsize must be >= 1; got {maxsize}")
        self.name, self.maxsize = name, maxsize
        self._data: dict[Any, Any] = {}
        self.hits = self.misses = 0
        PlanCache._ALL.append(self)

    def get(self, key: Any) -> Any | None:
        plan = self._data.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key: Any, plan: Any) -> Any:
        data = self._data
        if key not in data and len(data) >= self.maxsize:
            # dicts keep insertion order: drop the oldest eighth at once (amortised O(1) per insert)
            for k in list(itertools.islice(data, max(1, self.maxsize // 8))):
                del data[k]
        data[key] = plan
        return plan

    def clear(self) -> None:
        self._data.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict[str, int]:
        return {"size": len(self._data), "maxsize": self.maxsize, "hits": self.hits, "misses": self.misses}

    @classmethod
    def all_stats(cls) -> dict[str, dict[str, int]]:
        """Every plan cache of the process by name (``cukit info`` and tests)."""
        return {c.name: c.stats() for c in cls._ALL}


class Densify:
    """A plan-cache entry for a signature some of whose arrays a kernel cannot take as they are
    (not C-contiguous, or a layout the op's kernels do not read): the call copies those arrays
    (``mask``: one flag per array, in the order the op passes them) and runs again under the dense
    signature, which has its own entry. The key holds every stride, so the entry is exact. Without
    it such a signature would miss the cache on every call and repeat the first call's validation
    and planning: an expanded gradient from ``y.sum().backward()``, a ``chunk`` view."""

    __slots__ = ("kind", "mask")

    def __init__(self, mask: Sequence[bool], kind: str) -> None:
        self.mask, self.kind = tuple(mask), kind

    def apply(self, arrays: Sequence[Any]) -> list[Any]:
        """The arrays with the flagged ones copied to C-contiguous."""
        return [contiguous(a, self.kind) if m else a for a, m in zip(arrays, self.mask, strict=True)]

    @classmethod
    def needed(cls, arrays: Sequence[Any], kind: str, mask: Sequence[bool] | None = None) -> Densify | None:
        """The entry for `arrays` (flagged: `mask`, else the arrays that are not C-contiguous), or
        None when nothing needs copying."""
        if mask is None:
            mask = [not is_contiguous(a, kind) for a in arrays]
        return cls(mask, kind) if any(mask) else None


def _template_name(name_expr: str) -> str:
    return name_expr.split("<", 1)[0].strip()


def registered_modules() -> dict[str, KernelModule]:
    """The kernel modules declared so far, by registry key (``cukit.cli.all_modules`` imports
    every module that declares kernels first: the loader never imports the ops above it)."""
    return dict(_REGISTRY)


def _nvrtc_compile(file: str, source: str, exprs: Sequence[str], options: Sequence[str], arch: str) -> None:
    """Compile with cuda.bindings.nvrtc (no device needed) and check every name expression
    resolves to a kernel."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise RuntimeError(
            "offline compilation needs cuda-bindings and NVRTC: pip install 'cukit[nvrtc]'"
        ) from None

    def check(result: Any, what: str) -> None:
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(file, ", ".join(exprs), f"{what}: {result.name}", arch)

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), file.encode(), 0, [], [])
    check(err, "nvrtcCreateProgram")
    try:
        for e in exprs:
            check(nvrtc.nvrtcAddNameExpression(prog, e.encode())[0], f"nvrtcAddNameExpression({e})")
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise KernelCompileError(file, ", ".join(exprs), log.decode(errors="replace").rstrip("\0"), arch)
        for e in exprs:
            err, lowered = nvrtc.nvrtcGetLoweredName(prog, e.encode())
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or not lowered:
                raise KernelCompileError(file, e, "name expression did not resolve to a kernel", arch)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def nvrtc_version() -> str | None:
    """NVRTC's version as "major.minor" (CuPy's on a GPU machine, else cuda.bindings'), or None."""
    try:
        import cupy

        major, minor = cupy.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"
    except Exception:
        pass
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:
        return None
