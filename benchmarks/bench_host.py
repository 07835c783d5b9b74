"""Host cost per call of every cukit torch op on small CUDA tensors, beside torch's equivalent.

Usage::

    python benchmarks/bench_host.py                    # the full table
    python benchmarks/bench_host.py --iters 500 --rounds 11
    python benchmarks/bench_host.py --budget-s 60      # start no case after 60 s
    python benchmarks/bench_host.py --dry-run          # CPU tensors: exercises the code, numbers mean nothing

A torch model calls a cukit op thousands of times per step with the same shapes, so the host time
of a call (Python, validation, plan lookup, dispatcher, autograd, launch) is part of the product:
the target is cukit within 1.5x of torch, forward and backward. Each row compares one call
of cukit with torch's equivalent, measured in the same run on the same shapes:

| op | cukit | torch |
|---|---|---|
| ``matmul`` | ``cukit.matmul(a, b)`` | ``torch.matmul(a, b)`` |
| ``linear`` | ``cukit.linear(x, w, b)`` | ``F.linear(x, w, b)`` |
| ``linear+gelu`` | ``cukit.linear(x, w, b, "gelu")`` | ``F.gelu(F.linear(x, w, b))`` |
| ``bias_act`` | ``cukit.bias_act(z, b, "gelu")`` | ``F.gelu(z + b)`` |
| ``nn.Linear`` | ``cukit.nn.Linear(256, 256)(x)`` | ``nn.Linear(256, 256)(x)`` (same weights) |
| ``rms_norm`` | ``cukit.rms_norm(z, bias)`` | ``F.rms_norm(z, (256,), bias, 1e-6)`` |
| ``layer_norm`` | ``cukit.layer_norm(z, None, bias, bias2)`` | ``F.layer_norm(z, (256,), bias, bias2)`` |
| ``swiglu`` | ``cukit.swiglu(z, u)`` | ``F.silu(z) * u`` |
| ``rope`` | ``cukit.rotary_embedding(q, k, cos, sin)`` | transformers' ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, and k) |

Shapes: a, x (64, 256); b (256, 256) for matmul; w (256, 256) (out, in); bias, bias2 (256,); z, u
(64, 256); q (1, 4, 16, 64) and k (1, 2, 16, 64) in transformers' layout, cos and sin (1, 16, 64).
Each op runs in float32 and bfloat16, and the three linear ops also as float32 tensors under
``torch.autocast(dtype=torch.bfloat16)`` (entered inside each call, as a training step's forward
would: autocast's cast cache lives for one region, so the weight cast is paid per call).

Passes: ``fwd`` = one forward call, inputs (and module parameters) not requiring grad;
``fwd+bwd`` = inputs and parameters requiring grad, ``y = op(...); y.backward(g)``, every leaf's
``.grad`` set to None first (as ``zero_grad(set_to_none=True)`` leaves it: no accumulation kernel).

How the host time is measured: ``harness.host_cost_us`` (host wall time to enqueue ``--iters``
calls with one synchronisation before and after, none inside), the torch and cukit rounds
interleaved (T, C, T, C, ...) so drift in the host's speed hits both alike; median of ``--rounds``.
That measures host cost only while the GPU keeps up: each call's device time must be well under its
host time, or the launch queue fills and the host waits for the device. The shapes are tiny for
that reason, and each row also gives the device time per call (CUDA events, median, with a ~1 ms
GPU spin before each call so the host's launches are not in it); ``bound`` says "host" when both
host times exceed both device times (the host figure is pure host cost), "device?" otherwise.

Columns (``<out>/bench_host.json`` / ``.csv``):

| column | meaning |
|---|---|
| ``op``, ``dtype``, ``pass``, ``shape`` | the case (``dtype`` ``float32+autocast`` for the autocast rows) |
| ``torch_call``, ``cukit_call`` | what each side calls |
| ``torch_us``, ``cukit_us`` | host µs per call, median over the rounds |
| ``ratio`` | ``cukit_us / torch_us`` (< 1: cukit's call is cheaper) |
| ``target``, ``verdict`` | ``<= 1.5x`` and PASS/FAIL |
| ``torch_device_us``, ``cukit_device_us`` | device µs per call (events; see above) |
| ``bound`` | ``host`` or ``device?`` (see above) |
| ``rel_err`` | cukit's output (and gradients) against torch's, relative norm, from the check before timing |
| ``error`` | why a row has no numbers |

The summary (printed last) is the table, the count of rows that meet the target, and the failed
cases. ``--dry-run`` runs every path on CPU tensors with few iterations (cukit's CPU path is its
torch reference; the numbers mean nothing). Results go to ``--out DIR``, else to a new temporary
folder (printed); ``benchmarks/results/`` is written only when named, never by ``--dry-run``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_host from the repository root
    from benchmarks import harness

NAME = "bench_host"
OPS = ("matmul", "linear", "linear+gelu", "bias_act", "nn.Linear", "rms_norm", "layer_norm", "swiglu", "rope")
AUTOCAST_OPS = ("linear", "linear+gelu", "nn.Linear")
PASSES = ("fwd", "fwd+bwd")
TARGET_RATIO = 1.5
LEAD_CYCLES = 2_000_000  # GPU spin before each device-timed call (~1 ms): the host gets ahead

CALLS = {
    "matmul": ("torch.matmul(a, b)", "cukit.matmul(a, b)"),
    "linear": ("F.linear(x, w, b)", "cukit.linear(x, w, b)"),
    "linear+gelu": ("F.gelu(F.linear(x, w, b))", 'cukit.linear(x, w, b, "gelu")'),
    "bias_act": ("F.gelu(z + b)", 'cukit.bias_act(z, b, "gelu")'),
    "nn.Linear": ("nn.Linear(x)", "cukit.nn.Linear(x)"),
    "rms_norm": ("F.rms_norm(z, (n,), w)", "cukit.rms_norm(z, w)"),
    "layer_norm": ("F.layer_norm(z, (n,), w, b)", "cukit.layer_norm(z, None, w, b)"),
    "swiglu": ("F.silu(z) * u", "cukit.swiglu(z, u)"),
    "rope": ("apply_rotary_pos_emb(q, k, cos, sin)", "cukit.rotary_embedding(q, k, cos, sin)"),
}


@dataclass
class Config:
    device: str = "cuda"
    m: int = 64
    k: int = 256
    n: int = 256
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    autocast: bool = True
    iters: int = 200
    rounds: int = 7
    warmup: int = 20
    device_repeats: int = 30
    budget_s: float = 240.0
    dry_run: bool = False
    seed: int = 0
    out: str | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--iters", type=int, default=None, help="calls per timed round (default 200)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per side, interleaved (default 7)")
    p.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds (default 240)")
    p.add_argument("--no-autocast", action="store_true", help="leave out the autocast rows")
    p.add_argument("--dry-run", action="store_true", help="CPU tensors, few iterations (smoke test)")
    p.add_argument("--device", default=None, help="torch device (default cuda; cpu with --dry-run)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed, autocast=not args.no_autocast)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", iters=5, rounds=2, warmup=2, device_repeats=3, budget_s=0.0, dry_run=True)
    if args.device is not None:
        cfg = replace(cfg, device=args.device)
    if args.iters is not None:
        cfg = replace(cfg, iters=max(1, args.iters))
    if args.rounds is not None:
        cfg = replace(cfg, rounds=max(1, args.rounds))
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


@dataclass
class Case:
    """One row: the op, its precision and pass, and the two callables (built by :func:`build_case`)."""

    op: str
    dtype: str  # "float32", "bfloat16" or "float32+autocast"
    pass_: str
    torch_fn: Callable[[], Any] = field(default=lambda: None)
    cukit_fn: Callable[[], Any] = field(default=lambda: None)
    # what each side's call produced, for the check before timing: output or gradients
    torch_result: Callable[[], list[Any]] = field(default=list)
    cukit_result: Callable[[], list[Any]] = field(default=list)
    out_dtypes: tuple[Any, Any] = (None, None)  # (torch, cukit) forward output dtypes


def case_list(cfg: Config) -> list[tuple[str, str, str]]:
    """(op, dtype, pass), forward rows first (the cheapest, and what inference pays)."""
    out = []
    for pass_ in PASSES:
        for dtype in cfg.dtypes:
            out += [(op, dtype, pass_) for op in OPS]
        if cfg.autocast:
            out += [(op, "float32+autocast", pass_) for op in AUTOCAST_OPS]
    return out


def build_case(cfg: Config, op: str, dtype: str, pass_: str) -> Case:
    """Fresh inputs for both sides (separate leaves, so one side's gradients never touch the
    other's) and the two callables, each one complete call of its side."""
    torch = _torch()
    import cukit
    import cukit.nn
    import cukit.torch  # registers torch.ops.cukit: the autograd path

    F = torch.nn.functional
    dev = torch.device(cfg.device)
    autocast = dtype.endswith("+autocast")
    dt = torch.float32 if autocast else getattr(torch, dtype)
    grad = pass_ == "fwd+bwd"
    m, k, n = cfg.m, cfg.k, cfg.n
    g = torch.Generator().manual_seed(cfg.seed)

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dt)

    inputs = {"x": rnd(m, k), "w": rnd(n, k, scale=k**-0.5), "bias": rnd(n, scale=0.1), "b": rnd(k, n, scale=k**-0.5),
              "z": rnd(m, n), "u": rnd(m, n), "bias2": rnd(n, scale=0.1), "q": rnd(1, 4, 16, 64), "k": rnd(1, 2, 16, 64)}
    angles = torch.arange(16, dtype=torch.float64)[:, None] * (1e-4 ** (torch.arange(32) / 32))[None]
    emb = torch.cat([angles, angles], -1)[None]  # (1, 16, 64), as transformers' rotary embedding
    cos, sin = emb.cos().to(device=dev, dtype=dt), emb.sin().to(device=dev, dtype=dt)
    sides: dict[str, dict[str, Any]] = {}
    for side in ("torch", "cukit"):
        sides[side] = {name: t.clone().requires_grad_(grad) for name, t in inputs.items()}
    ref_mod = torch.nn.Linear(k, n, device=dev, dtype=dt)
    ck_mod = cukit.nn.Linear(k, n, device=dev, dtype=dt)
    with torch.no_grad():
        ref_mod.weight.copy_(inputs["w"])
        ref_mod.bias.copy_(inputs["bias"])
        ck_mod.weight.copy_(inputs["w"])
        ck_mod.bias.copy_(inputs["bias"])
    for mod in (ref_mod, ck_mod):
        mod.requires_grad_(grad)
    t, c = sides["torch"], sides["cukit"]
    fwd: dict[str, tuple[Callable[[], Any], Callable[[], Any], list[Any], list[Any]]] = {
        "matmul": (lambda: torch.matmul(t["x"], t["b"]), lambda: cukit.matmul(c["x"], c["b"]),
                   [t["x"], t["b"]], [c["x"], c["b"]]),
        "linear": (lambda: F.linear(t["x"], t["w"], t["bias"]), lambda: cukit.linear(c["x"], c["w"], c["bias"]),
                   [t["x"], t["w"], t["bias"]], [c["x"], c["w"], c["bias"]]),
        "linear+gelu": (lambda: F.gelu(F.linear(t["x"], t["w"], t["bias"])),
                        lambda: cukit.linear(c["x"], c["w"], c["bias"], "gelu"),
                        [t["x"], t["w"], t["bias"]], [c["x"], c["w"], c["bias"]]),
        "bias_act": (lambda: F.gelu(t["z"] + t["bias"]), lambda: cukit.bias_act(c["z"], c["bias"], "gelu"),
                     [t["z"], t["bias"]], [c["z"], c["bias"]]),
        "nn.Linear": (lambda: ref_mod(t["x"]), lambda: ck_mod(c["x"]),
                      [t["x"], ref_mod.weight, ref_mod.bias], [c["x"], ck_mod.weight, ck_mod.bias]),
        "rms_norm": (lambda: F.rms_norm(t["z"], (n,), t["bias"], 1e-6), lambda: cukit.rms_norm(c["z"], c["bias"]),
                     [t["z"], t["bias"]], [c["z"], c["bias"]]),
        "layer_norm": (lambda: F.layer_norm(t["z"], (n,), t["bias"], t["bias2"]),
                       lambda: cukit.layer_norm(c["z"], None, c["bias"], c["bias2"]),
                       [t["z"], t["bias"], t["bias2"]], [c["z"], c["bias"], c["bias2"]]),
        "swiglu": (lambda: F.silu(t["z"]) * t["u"], lambda: cukit.swiglu(c["z"], c["u"]),
                   [t["z"], t["u"]], [c["z"], c["u"]]),
        "rope": (lambda: _hf_rope(t["q"], t["k"], cos, sin), lambda: cukit.rotary_embedding(c["q"], c["k"], cos, sin),
                 [t["q"], t["k"]], [c["q"], c["k"]]),
    }
    torch_fwd, cukit_fwd, torch_leaves, cukit_leaves = fwd[op]
    if autocast:
        torch_fwd, cukit_fwd = _under_autocast(torch_fwd, dev.type), _under_autocast(cukit_fwd, dev.type)
    case = Case(op, dtype, pass_)
    with torch.no_grad():  # under autocast torch's output is bfloat16: cukit's must be too, and dy
        outs = _outputs(torch_fwd())
        case.out_dtypes = (outs[0].dtype, _outputs(cukit_fwd())[0].dtype)
    if not grad:
        case.torch_fn, case.cukit_fn = torch_fwd, cukit_fwd
        case.torch_result = lambda: _outputs(torch_fwd())
        case.cukit_result = lambda: _outputs(cukit_fwd())
        return case
    dy = [torch.randn(o.shape, generator=g).to(device=dev, dtype=case.out_dtypes[0]) for o in outs]
    case.torch_fn = _fwd_bwd(torch_fwd, torch_leaves, dy)
    case.cukit_fn = _fwd_bwd(cukit_fwd, cukit_leaves, dy)
    case.torch_result = _grads_after(case.torch_fn, torch_leaves)
    case.cukit_result = _grads_after(case.cukit_fn, cukit_leaves)
    return case


def _under_autocast(fn: Callable[[], Any], device_type: str) -> Callable[[], Any]:
    torch = _torch()

    def call() -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return fn()

    return call


def _outputs(y: Any) -> list[Any]:
    """An op's outputs as a list (rope returns q and k)."""
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _hf_rope(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """transformers' apply_rotary_pos_emb (Llama), unsqueeze_dim=1."""
    torch = _torch()

    def rotate_half(x: Any) -> Any:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _fwd_bwd(fwd: Callable[[], Any], leaves: list[Any], dy: list[Any]) -> Callable[[], None]:
    torch = _torch()

    def call() -> None:
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(_outputs(fwd()), dy)

    return call


def _grads_after(fn: Callable[[], None], leaves: list[Any]) -> Callable[[], list[Any]]:
    def result() -> list[Any]:
        fn()
        return [leaf.grad for leaf in leaves]

    return result


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def check(case: Case, cfg: Config) -> float:
    """cukit's output (fwd) or gradients (fwd+bwd) against torch's; the largest relative-norm error.
    Raises AssertionError past the dtype's bound (bf16 and autocast round differently per side)."""
    torch = _torch()
    if case.out_dtypes[0] != case.out_dtypes[1]:  # e.g. an op without an autocast rule computes in float32
        raise AssertionError(f"cukit's output dtype {case.out_dtypes[1]} != torch's {case.out_dtypes[0]}"
                             + (" under autocast" if case.dtype.endswith("+autocast") else ""))
    ref, got = case.torch_result(), case.cukit_result()
    harness.synchronize()
    tol = 1e-4 if case.dtype == "float32" else 3e-2
    worst = 0.0
    for i, (r, a) in enumerate(zip(ref, got, strict=True)):
        if r is None or a is None:
            raise AssertionError(f"{case.op} {case.dtype} {case.pass_}: output {i} missing "
                                 f"(torch {'none' if r is None else 'ok'}, cukit {'none' if a is None else 'ok'})")
        res = harness.check_close(a.detach(), r.detach().to(torch.float64), name=f"{case.op} output {i}",
                                  elementwise=False, rel_tol=tol)
        worst = max(worst, res.rel_err)
    return worst


def host_us(fns: Sequence[Callable[[], Any]], cfg: Config) -> list[float]:
    """Host µs per call of each fn: rounds interleaved across the fns, median per fn."""
    for fn in fns:
        for _ in range(cfg.warmup):
            fn()
    harness.synchronize()
    per: list[list[float]] = [[] for _ in fns]
    for _ in range(cfg.rounds):
        for i, fn in enumerate(fns):
            per[i].append(harness.host_cost_us(fn, iters=cfg.iters, rounds=1, warmup=0))
    return [statistics.median(p) for p in per]


def device_us(fn: Callable[[], Any], cfg: Config) -> float:
    """Device µs of one call: CUDA events with the GPU spun ahead first, so the host's launch time
    is hidden as long as it is under the spin (on the CPU: host time, meaningless)."""
    torch = _torch()
    cuda = cfg.device.startswith("cuda")
    lead = (lambda: torch.cuda._sleep(LEAD_CYCLES)) if cuda and hasattr(torch.cuda, "_sleep") else (lambda: None)
    t = harness.time_cuda(lambda _state: fn(), setup=lead, warmup=3, repeats=cfg.device_repeats,
                          flush_l2=False, cuda=cuda)
    return t.ms * 1e3


@dataclass
class Bench(harness.RunState):
    cfg: Config

    def skip_reason(self) -> str | None:
        return self.stop_reason(self.cfg.budget_s)


def run_case(b: Bench, op: str, dtype: str, pass_: str) -> dict[str, Any]:
    cfg = b.cfg
    shape = {"matmul": f"{cfg.m}x{cfg.k} @ {cfg.k}x{cfg.n}", "bias_act": f"{cfg.m}x{cfg.n} + {cfg.n}"}.get(
        op, f"{cfg.m}x{cfg.k} -> {cfg.n}")
    t_call, c_call = CALLS[op]
    row: dict[str, Any] = {"op": op, "dtype": dtype, "pass": pass_, "shape": shape,
                           "torch_call": t_call, "cukit_call": c_call}
    reason = b.skip_reason()
    if reason:
        row["error"] = reason
        b.failures.append(f"{op} {dtype} {pass_}: {reason}")
        return row
    try:
        case = build_case(cfg, op, dtype, pass_)
        row["rel_err"] = check(case, cfg)
        row["torch_us"], row["cukit_us"] = host_us([case.torch_fn, case.cukit_fn], cfg)
        row["ratio"] = row["cukit_us"] / row["torch_us"]
        row["target"] = f"<= {TARGET_RATIO:g}x"
        row["verdict"] = "PASS" if row["ratio"] <= TARGET_RATIO else "FAIL"
        row["torch_device_us"] = device_us(case.torch_fn, cfg)
        row["cukit_device_us"] = device_us(case.cukit_fn, cfg)
        slowest_device = max(row["torch_device_us"], row["cukit_device_us"])
        row["bound"] = "host" if min(row["torch_us"], row["cukit_us"]) > slowest_device else "device?"
    except Exception as e:  # recorded, the run goes on
        row["error"] = b.record_failure(f"{op} {dtype} {pass_}", e)
    return row


COLUMNS: list[str | tuple[str, str]] = [
    "op", "dtype", "pass", ("torch_us", "torch us"), ("cukit_us", "cukit us"), ("ratio", "cukit/torch"),
    "verdict", ("torch_device_us", "torch dev us"), ("cukit_device_us", "cukit dev us"), "bound",
    ("rel_err", "rel err"), "error",
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:70]}


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    cfg = b.cfg
    print()
    print("=" * 110)
    where = env.get("gpu") or "CPU (dry run: CPU tensors, the numbers mean nothing)"
    print(f"SUMMARY {NAME}: {where} | torch {env.get('torch')} | cupy {env.get('cupy')} | "
          f"commit {str(env.get('git_commit'))[:12]} | {time.perf_counter() - b.t0:.0f} s")
    print(f"host µs per call (median of {cfg.rounds} interleaved rounds of {cfg.iters} calls), device µs per "
          f"call (events), x {cfg.m}x{cfg.k}, w {cfg.n}x{cfg.k}; fwd+bwd = y = op(...); y.backward(g)")
    harness.print_table(b.rows, COLUMNS, formatters=_FMT)
    timed = [r for r in b.rows if r.get("verdict")]
    passed = [r for r in timed if r["verdict"] == "PASS"]
    worst = max(timed, key=lambda r: r["ratio"], default=None)
    print(f"\ntarget: cukit host cost <= {TARGET_RATIO:g}x torch's, every row: "
          f"{'PASS' if timed and len(passed) == len(b.rows) else 'FAIL'} ({len(passed)} of {len(b.rows)} rows pass"
          + (f"; worst {worst['op']} {worst['dtype']} {worst['pass']} {worst['ratio']:.2f}x" if worst else "") + ")")
    device_bound = [r for r in timed if r.get("bound") != "host"]
    if device_bound and cfg.device.startswith("cuda"):
        print(f"  {len(device_bound)} rows where a device time reaches a host time: their host figure may include "
              "waiting for the GPU")
    harness.print_outcome(b.failures, saved)


def run(cfg: Config) -> Bench:
    torch = _torch()
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg)
    env = harness.environment()
    print(f"{NAME}: {env.get('gpu') or cfg.device} | torch {torch.__version__} | iters {cfg.iters} x "
          f"{cfg.rounds} rounds | budget {cfg.budget_s:.0f} s", flush=True)
    for op, dtype, pass_ in case_list(cfg):
        row = run_case(b, op, dtype, pass_)
        b.rows.append(row)
        if row.get("verdict"):
            print(f"  {op:12s} {dtype:17s} {pass_:8s} torch {row['torch_us']:8.1f} us  cukit {row['cukit_us']:8.1f} us"
                  f"  {row['ratio']:5.2f}x {row['verdict']}", flush=True)
        else:
            print(f"  {op:12s} {dtype:17s} {pass_:8s} ERROR {str(row.get('error'))[:100]}", flush=True)
    saved: list[str] = []
    if cfg.out != "-":
        try:
            meta = {"config": dict(vars(cfg)), "failures": b.failures, "target_ratio": TARGET_RATIO}
            saved = [str(p) for p in harness.save_results(b.rows, NAME, cfg.out, env=env, meta=meta)]
        except Exception as e:
            b.failures.append(f"saving results: {harness.short_error(e)}")
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(parse_args(argv))
    return harness.main_run(NAME, cfg, run)


if __name__ == "__main__":
    sys.exit(main())
