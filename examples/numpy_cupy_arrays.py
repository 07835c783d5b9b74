"""cukit for NumPy and CuPy users: the same functions take NumPy arrays (the reference
implementation, on the CPU) and CuPy arrays (cukit's kernels, on the GPU) and return the type they
were given; on the GPU, torch tensors and CuPy arrays view each other's memory without a copy.

Part 1, a table: ``cukit.bias_act``, ``cukit.bias_act_backward``, ``cukit.matmul`` and
``cukit.linear`` (matmul + bias + activation in one kernel) on NumPy arrays and, where a GPU is
usable, on CuPy arrays: the type that comes back, the largest error against a float64 NumPy
oracle (relative to the largest value) and the median time per call (CuPy's: CUDA events, with
``cupyx.profiler.benchmark``).

Part 2, on a GPU only: zero-copy interop with torch, each shown by one pointer comparison and by
writing through one side and reading through the other: ``cukit.to_torch(cupy_array)``,
``cukit.asarray(torch_tensor)`` (bfloat16 too when ml_dtypes is installed), and plain DLPack
(``torch.from_dlpack`` / ``cupy.from_dlpack``), which is what both cukit functions use.

Run it::

    python examples/numpy_cupy_arrays.py              # NumPy, and CuPy when a GPU is usable: 2048 x 2048
    python examples/numpy_cupy_arrays.py --small      # quick (the default on the CPU)
    python examples/numpy_cupy_arrays.py --device cpu # NumPy only

On the CPU only NumPy is used: neither the script nor cukit imports torch for NumPy inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import print_table, time_ms

import cukit
from cukit.ops.bias_act import reference_backward_numpy, reference_numpy

ACTIVATION = "gelu"
TOLERANCE = 1e-4  # float32 results against float64, relative to the largest value


def oracles(x: np.ndarray, w: np.ndarray, b: np.ndarray, g: np.ndarray) -> dict[str, tuple[np.ndarray, ...]]:
    """float64 NumPy results of each op (inputs promoted first)."""
    x, w, b, g = (a.astype(np.float64) for a in (x, w, b, g))
    return {
        "bias_act": (reference_numpy(x, b, ACTIVATION),),
        "bias_act_backward": reference_backward_numpy(g, x, b, ACTIVATION),
        "matmul": (x @ w,),
        "linear": (reference_numpy(x @ w.T, b, ACTIVATION),),
    }


def calls(xp_args: tuple[Any, Any, Any, Any]) -> dict[str, Callable[[], Any]]:
    x, w, b, g = xp_args
    return {
        "bias_act": lambda: cukit.bias_act(x, b, ACTIVATION),
        "bias_act_backward": lambda: cukit.bias_act_backward(g, x, b, ACTIVATION),
        "matmul": lambda: cukit.matmul(x, w),
        "linear": lambda: cukit.linear(x, w, b, ACTIVATION),
    }


def max_rel_err(got: Any, want: tuple[np.ndarray, ...], to_numpy: Callable[[Any], np.ndarray]) -> float:
    got = got if isinstance(got, tuple) else (got,)
    return max(
        float(np.abs(to_numpy(a).astype(np.float64) - e).max() / max(np.abs(e).max(), 1e-30))
        for a, e in zip(got, want, strict=True)
    )


def cupy_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median device milliseconds per call (CUDA events on CuPy's current stream)."""
    from cupyx.profiler import benchmark

    result = benchmark(fn, n_repeat=repeats, n_warmup=3)
    return statistics.median(result.gpu_times[0]) * 1e3


def interop_rows() -> list[list[str]]:
    """Zero-copy checks between CuPy and torch on the GPU: (what, same pointer, a write through one
    side seen through the other). Both libraries use the legacy default stream here, so the write
    is ordered before the read."""
    import cupy as cp
    import torch

    rows = []

    def row(what: str, same_pointer: bool, write_seen: bool) -> None:
        rows.append([what, "yes" if same_pointer else "NO", "yes" if write_seen else "NO"])

    x = cp.zeros((4, 8), dtype=cp.float32)
    t = cukit.to_torch(x)
    t[1, 2] = 42.0
    row("cukit.to_torch(cupy array) -> torch.Tensor", t.data_ptr() == x.data.ptr, float(x[1, 2]) == 42.0)

    u = torch.zeros(4, 8, device="cuda")
    a = cukit.asarray(u)
    a[3, 1] = 7.0
    row("cukit.asarray(torch tensor) -> cupy.ndarray", a.data.ptr == u.data_ptr(), u[3, 1].item() == 7.0)

    d = torch.from_dlpack(x)
    c = cp.from_dlpack(u)
    d[0, 0], c[0, 0] = 1.0, 2.0
    row("torch.from_dlpack(cupy) / cupy.from_dlpack(torch)", d.data_ptr() == x.data.ptr and c.data.ptr == u.data_ptr(),
        float(x[0, 0]) == 1.0 and u[0, 0].item() == 2.0)

    try:
        h = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
        hb = cukit.asarray(h)  # DLPack: CuPy's own path would see 2-byte void elements
        h[2, 3] = 3.0
        row(f"cukit.asarray(bfloat16 tensor) -> {hb.dtype}", hb.data.ptr == h.data_ptr(),
            float(cp.asnumpy(hb)[2, 3]) == 3.0)
    except ImportError as e:  # ml_dtypes is not installed: cukit says so
        rows.append(["cukit.asarray(bfloat16 tensor)", f"n/a ({e})", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CuPy too when a GPU is usable; cpu: NumPy only (default: auto)")
    parser.add_argument("--small", action="store_true", help="256 x 256 and few repeats (the default on the CPU)")
    args = parser.parse_args(argv)
    gpu = cukit.is_available() and args.device != "cpu"
    if args.device == "cuda" and not gpu:
        parser.error("--device cuda: CuPy sees no usable GPU (see `cukit info`)")
    small = args.small or not gpu
    n = 256 if small else 2048
    repeats = 3 if small else 20

    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(3))
    b = rng.standard_normal(n, dtype=np.float32)
    want = oracles(x, w, b, g)
    backends: list[tuple[str, tuple[Any, ...], Callable[[Any], np.ndarray]]] = [("numpy", (x, w, b, g), np.asarray)]
    if gpu:
        import cupy as cp

        backends.append(("cupy", tuple(cp.asarray(a) for a in (x, w, b, g)), cp.asnumpy))
        where = f"NumPy (CPU) and CuPy ({cukit.device_info().get('name', 'GPU')})"
    else:
        where = "NumPy (CPU)"
    print(f"cukit ops on {where}: float32, {n} x {n} operands, activation {ACTIVATION}")

    rows = []
    ok = True
    numpy_ms: dict[str, float] = {}
    for backend, arrays, to_numpy in backends:
        for op, fn in calls(arrays).items():
            out = fn()
            first = out[0] if isinstance(out, tuple) else out
            err = max_rel_err(out, want[op], to_numpy)
            ms = cupy_ms(fn, repeats) if backend == "cupy" else time_ms(fn, "cpu", warmup=1, repeats=min(repeats, 3))
            numpy_ms.setdefault(op, ms)
            ok &= err <= TOLERANCE and type(first) is type(arrays[0])
            kind = f"{type(first).__module__.split('.')[0]}.{type(first).__name__}"
            rows.append([op, backend, kind, f"{err:.1e}", f"{ms:.3f}", f"{numpy_ms[op] / ms:.1f}x"])
    print()
    print_table(["op", "input", "output", "max rel err", "ms/call", "vs numpy"], rows, left=3)
    print()
    print("max rel err: against float64 NumPy, relative to the largest value. NumPy inputs run cukit's reference "
          "implementation, CuPy inputs its kernels.")
    print(f"outputs of the input's type and within {TOLERANCE:.0e}: {'yes' if ok else 'NO'}")
    if gpu:
        print()
        try:
            interop = interop_rows()
        except ImportError as e:  # torch is not installed: the NumPy/CuPy part stands alone
            print(f"zero-copy interop with torch skipped: {e}")
        else:
            print_table(["zero copy", "same pointer", "write seen"], interop)
            ok &= all("NO" not in r for r in interop)
    else:
        print("zero-copy interop with torch needs GPU arrays: run on a GPU with CuPy to see it. "
              f"torch imported by this NumPy-only run: {'yes' if 'torch' in sys.modules else 'no'}.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
