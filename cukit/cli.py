"""The ``cukit`` command: ``info``, ``check-kernels``, ``warmup``, ``demo``, ``bench``."""

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

from cukit._runtime import KernelCompileError
from cukit._warmup import (  # KERNEL_OWNERS, all_modules: re-exported (declared with the compile machinery)
    KERNEL_DTYPES,
    KERNEL_OWNERS,
    OPS,
    Progress,
    all_modules,
    compile_jobs,
    fmt_seconds,
    parse_archs,
    parse_dtypes,
    parse_ops,
    plan,
    plural,
    warmup,
)

__all__ = ["KERNEL_OWNERS", "all_modules", "main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


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
        # every group this GPU's architecture is built for, through the loader (progress on stderr)
        try:
            done = warmup(device=info["device"], progress=True)
        except cukit.KernelCompileError as e:
            print(f"compile      FAILED: {e}")
            return 1
        print(f"compile      ok: {done.instantiations} instantiations for {done.arch} on this GPU "
              f"in {done.seconds:.1f} s")
    return 0


def _selection(args: argparse.Namespace, command: str) -> tuple[list[str] | None, list[str] | None]:
    """--ops / --dtypes as canonical names (ValueError naming the option otherwise)."""
    return (parse_ops(args.ops, where=f"cukit {command}: --ops"),
            parse_dtypes(args.dtypes, where=f"cukit {command}: --dtypes"))


def cmd_check_kernels(args: argparse.Namespace) -> int:
    try:
        archs = parse_archs(args.arch, where="cukit check-kernels: --arch")
        ops, dtypes = _selection(args, "check-kernels")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    total = failed = 0
    for arch in archs:  # one architecture after another: each gets its own progress line
        jobs = plan(arch, ops, dtypes)
        bar = Progress(f"check-kernels {arch}", len(jobs))
        try:
            outcomes = compile_jobs(jobs, bar, processes=args.jobs)
        except RuntimeError as e:  # no NVRTC
            bar.finish("stopped")
            print(f"cukit check-kernels: {e}", file=sys.stderr)
            return 2
        ok = sum(o.job.size for o in outcomes if o.error is None)
        bad = sum(o.job.size for o in outcomes if o.error is not None)
        bar.finish(f"{plural(len(jobs), 'group')}, {ok} instantiations compiled, {bad} failed "
                   f"in {fmt_seconds(bar.elapsed())}")
        for o in outcomes:
            if o.error is not None:
                print(f"FAIL {o.job.module} [{o.job.group}] {arch}\n{o.error.log}", file=sys.stderr)
        total += ok
        failed += bad
    dt = time.perf_counter() - t0
    print(f"check-kernels: compiled {total} instantiations for {','.join(archs)}, {failed} failed ({dt:.1f} s)")
    return 1 if failed else 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from cukit._device import is_available

    try:
        ops, dtypes = _selection(args, "warmup")
        if args.arch is not None and len(parse_archs(args.arch, where="cukit warmup: --arch")) != 1:
            raise ValueError(f"cukit warmup: --arch: one architecture at a time; got {args.arch!r}")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.arch is None and not is_available():
        print("cukit warmup: no CUDA GPU is visible, so there is no kernel cache to fill. To check that the "
              "kernels compile for an architecture without a GPU, name it: --arch sm_90 (compiles offline "
              "through NVRTC, caches nothing; `cukit check-kernels` does it for every kernel).", file=sys.stderr)
        return 2
    try:
        done = warmup(ops, dtypes, arch=args.arch, device=args.device, jobs=args.jobs if args.arch else 1,
                      progress=True)
    except KernelCompileError as e:
        print(f"cukit warmup: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # no NVRTC for the offline path
        print(f"cukit warmup: {e}", file=sys.stderr)
        return 2
    what = ", ".join(ops) if ops else "every op"
    where = (f"offline for {done.arch} (a compile check: nothing cached)" if done.offline
             else f"for {done.arch} on GPU {done.device} (cached on disk for later runs)")
    print(f"warmup: compiled {plural(done.instantiations, 'instantiation')} ({plural(done.groups, 'group')}) of {what}"
          f"{' for ' + ', '.join(dtypes) if dtypes else ''} {where} in {done.seconds:.1f} s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cukit import demo

    return demo.main(args.rest)


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(args.dir) if args.dir else Path.cwd() / "benchmarks"
    script = root / f"bench_{args.op}.py"
    if not script.is_file():
        print(f"cukit bench: {script} not found (benchmarks ship with the source tree; use --dir)", file=sys.stderr)
        return 2
    # The script decides where results go: a new temporary folder unless --out names one.
    rest = [*(["--out", args.out] if args.out else []), *args.rest]
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), *rest]
    sys.path.insert(0, str(root))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the scripts end with sys.exit(main())
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = argv, path
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cukit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, GPU, NVRTC, cache dir, whether the kernels compile")
    p.add_argument("--no-compile", action="store_true", help="skip compiling the kernels on the GPU")
    p.set_defaults(func=cmd_info)

    ops_help = f"comma-separated ops (default: all): {', '.join(OPS)} (also linear, adamw, ...)"
    dtypes_help = f"comma-separated dtypes (default: all): {','.join(KERNEL_DTYPES)}"
    cpus = os.cpu_count() or 1

    p = sub.add_parser("check-kernels", help="compile every kernel instantiation with NVRTC, no GPU needed")
    p.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets, e.g. sm_80,sm_90")
    p.add_argument("--jobs", type=int, default=cpus, help="compiler processes (default: CPUs)")
    p.add_argument("--ops", default=None, help=ops_help)
    p.add_argument("--dtypes", default=None, help=dtypes_help)
    p.set_defaults(func=cmd_check_kernels)

    p = sub.add_parser("warmup", help="compile kernels ahead of time for this GPU (first calls then start at once)",
                       description="Compile kernels ahead of time through the loader, for this machine's GPU; "
                       "CuPy caches them on disk, so later runs start without compiling.")
    p.add_argument("--ops", default=None, help=ops_help)
    p.add_argument("--dtypes", default=None, help=dtypes_help)
    p.add_argument("--device", type=int, default=None, help="GPU index (default: the current device)")
    p.add_argument("--arch", default=None,
                   help="compile offline for this architecture instead (e.g. sm_90; no GPU needed): "
                   "checks that the kernels compile, caches nothing")
    p.add_argument("--jobs", type=int, default=cpus, help="compiler processes with --arch (default: CPUs)")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("demo", help="train a small MLP on the digits data set: stock torch vs cukit")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the demo (see cukit demo -- --help)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="run benchmarks/bench_<op>.py from a source checkout",
                       description="Run benchmarks/bench_<op>.py; arguments after the op go to the script. "
                       "Results go to a new temporary folder (printed) unless --out names one.")
    p.add_argument("op", nargs="?", default="bias_act")
    p.add_argument("--dir", help="the benchmarks directory (default ./benchmarks)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="results folder (default: a new temporary folder; benchmarks/results/ only when named)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    if getattr(args, "rest", None) and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
