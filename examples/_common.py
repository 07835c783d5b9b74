"""Helpers the example scripts share: the ``--device`` / ``--small`` options, a timer and a table
printer. Not an example itself; the scripts next to it import it (``python examples/<name>.py``
puts this directory on ``sys.path``).

Every example runs at full size on a GPU and with small settings on the CPU (or with ``--small``
anywhere): the CPU run checks that the script works, the GPU run is the one whose numbers mean
something.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_size_options", "gpu_available", "print_table", "resolve_size", "time_ms"]


def gpu_available() -> bool:
    """Whether cukit's kernels can run here: CuPy sees a GPU (and torch does too when it is
    installed, since the examples hand torch tensors to cukit)."""
    import cukit

    if not cukit.is_available():
        return False
    try:
        import torch
    except ImportError:
        return True
    return torch.cuda.is_available()


def add_size_options(parser: argparse.ArgumentParser) -> None:
    """``--device auto|cpu|cuda`` and ``--small``; read them back with :func:`resolve_size`."""
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when torch and CuPy both see a GPU, else the CPU (default: auto)",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="small sizes and few repeats: a quick check that the script runs (the default on the CPU)",
    )


def resolve_size(args: argparse.Namespace) -> tuple[str, bool]:
    """(device type "cuda" or "cpu", small?) from the parsed options. ``--device cuda`` without a
    usable GPU exits with status 2 and says why."""
    if args.device == "cuda" and not gpu_available():
        print("--device cuda: no GPU usable by both torch and CuPy here (see `cukit info`)", file=sys.stderr)
        raise SystemExit(2)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and gpu_available()) else "cpu"
    return device, args.small or device == "cpu"


def time_ms(fn: Callable[[], Any], device: str, *, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones.

    On CUDA each call is bracketed by CUDA events on torch's current stream, so the figure is the
    device time of the work the call queued (cukit launches on torch's stream); on the CPU it is
    wall-clock time.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1) -> None:
    """Print rows under a header, columns aligned: the first ``left`` columns left-aligned (names),
    the others right-aligned (numbers). Cells are printed with ``str``."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for r in cells[1:]:
        print(line(r))
