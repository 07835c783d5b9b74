"""The ``cukit`` command: ``info``, ``check-kernels``, ``demo``, ``bench``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import runpy
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# Modules that declare kernels: importing them completes the loader's registry.
KERNEL_OWNERS = (
    "cukit.ops.bias_act",
    "cukit.ops.matmul_simt",
    "cukit.ops.matmul_tc",
    "cukit.ops.repack",
    "cukit.optim._kernels",
)


def all_modules() -> dict[str, Any]:
    """Every declared kernel module (``cukit._runtime.KernelModule``) by registry key."""
    from cukit._runtime import registered_modules

    for owner in KERNEL_OWNERS:
        importlib.import_module(owner)
    return registered_modules()


def cmd_info(args: argparse.Namespace) -> int:
    import cukit
    from cukit._runtime import kernel_dir, nvrtc_version

    print(f"cukit        {cukit.__version__}")
    print(f"python       {platform.python_version()} ({sys.executable})")
    print(f"numpy        {_version('numpy')}")
    print(f"torch        {_version('torch')}")
    cupy_dist = next((d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _version(d) != "not installed"), "cupy")
    print(f"cupy         {_version(cupy_dist)} ({cupy_dist})")
    print(f"nvrtc        {nvrtc_version() or 'not found'}")
    print(f"kernels      {kernel_dir()}")
    try:
        from cupy.cuda import _compiler_cache

        cache = os.environ.get("CUPY_CACHE_DIR", _compiler_cache._default_cache_dir)
    except Exception:  # CuPy missing, or a CuPy whose cache module moved
        cache = os.environ.get("CUPY_CACHE_DIR", "~/.cupy/kernel_cache (CuPy's default)")
    print(f"cache dir    {cache}")
    info = cukit.device_info()
    if info["available"]:
        gib = 2**30
        print(
            f"gpu          {info['name']} (cc {info['compute_capability']}, {info['sm_count']} SMs, "
            f"{info['memory_free'] / gib:.1f}/{info['memory_total'] / gib:.1f} GiB free)"
        )
    else:
        print(f"gpu          none ({info.get('reason', 'unavailable')}); NumPy/torch-CPU fallbacks in use")
    modules = all_modules()
    print(f"kernel files {len(modules)}: " + ", ".join(sorted(modules)))
    if info["available"] and not args.no_compile:
        t0 = time.perf_counter()
        n = 0
        try:
            for m in modules.values():
                for exprs in m.instantiations.values():
                    m.function(exprs[0], info["device"])  # compiles the whole group
                    n += len(exprs)
        except cukit.KernelCompileError as e:
            print(f"compile      FAILED: {e}")
            return 1
        print(f"compile      ok: {n} instantiations on this GPU in {time.perf_counter() - t0:.1f} s")
    return 0


def _compile_one(job: tuple[str, str, str]) -> tuple[str, str, str, int, str]:
    from cukit._runtime import KernelCompileError

    name, arch, group = job
    module = all_modules()[name]
    try:
        return name, arch, group, module.compile_offline(arch, [group]), ""
    except KernelCompileError as e:
        return name, arch, group, -len(module.instantiations[group]), e.log


def cmd_check_kernels(args: argparse.Namespace) -> int:
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    modules = all_modules()
    jobs = [
        (name, arch, group)
        for name, module in sorted(modules.items())
        for arch in archs
        if module.targets(arch)
        for group in module.instantiations
    ]
    t0 = time.perf_counter()
    try:
        if args.jobs > 1 and len(jobs) > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # NVRTC holds the GIL, so groups compile in parallel only in separate processes.
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
                results = list(pool.map(_compile_one, jobs))
        else:
            results = [_compile_one(j) for j in jobs]
    except RuntimeError as e:  # no NVRTC
        print(f"cukit check-kernels: {e}", file=sys.stderr)
        return 2
    total = sum(n for *_, n, _ in results if n > 0)
    failed = -sum(n for *_, n, _ in results if n < 0)
    for name, arch, group, n, log in results:
        if n < 0:
            print(f"FAIL {name} [{group}] {arch}\n{log}", file=sys.stderr)
    dt = time.perf_counter() - t0
    print(f"check-kernels: compiled {total} instantiations for {','.join(archs)}, {failed} failed ({dt:.1f} s)")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cukit import demo

    return demo.main(args.rest)


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(args.dir) if args.dir else Path.cwd() / "benchmarks"
    script = root / f"bench_{args.op}.py"
    if not script.is_file():
        print(f"cukit bench: {script} not found (benchmarks ship with the source tree; use --dir)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    sys.path.insert(0, str(root))
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cukit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, GPU, NVRTC, cache dir, whether the kernels compile")
    p.add_argument("--no-compile", action="store_true", help="skip compiling the kernels on the GPU")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check-kernels", help="compile every kernel instantiation with NVRTC, no GPU needed")
    p.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets, e.g. sm_80,sm_90")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: CPUs)")
    p.set_defaults(func=cmd_check_kernels)

    p = sub.add_parser("demo", help="train a small MLP on the digits data set: stock torch vs cukit")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the demo (see cukit demo -- --help)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="run benchmarks/bench_<op>.py from a source checkout")
    p.add_argument("op", nargs="?", default="bias_act")
    p.add_argument("--dir", help="the benchmarks directory (default ./benchmarks)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    if getattr(args, "rest", None) and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
