"""Benchmark cukit's memory helpers: activation checkpointing of a Llama-style model
(``cukit.nn.checkpoint_modules``: none / full / selective "matmul") and
``cukit.nn.forward_with_chunking`` of a big-vocabulary stock head against one unchunked call and
the classic chunking helper.

Usage::

    python benchmarks/bench_memory.py [--out DIR] [--quick] [--dry-run] [--parts model,chunking]
                                      [--compile] [--budget-s S] [--chunk-sizes 512,2048]

Part "model": Hugging Face ``LlamaForCausalLM`` built from bench_models' 8-layer config
(``LLAMA8_FULL``: hidden 2048, ffn 5632, 16/8 heads, vocab 128,256; ``--quick``: bench_models'
6-layer ``LLAMA_FULL``), bf16 parameters, ``attn_implementation="sdpa"``, batch ``LLAMA8_SHAPE``
(4 x 2048 tokens), loss from ``labels=input_ids``. Per impl ("torch": stock; "cukit":
``cukit.nn.patch``) and checkpointing ("plain": none; "full": ``checkpoint_modules(policy="none")``,
every decoder layer recomputed; "matmul": ``checkpoint_modules(policy="matmul")``, GEMM and
attention outputs kept, the rest recomputed): forward + backward ms (CUDA events, median of
repeats; the step is host-bound below a few ms, so L2 is not flushed), peak MiB above the
parameters (``max_memory_allocated`` over one step minus the allocation before it: activations and
gradients), and the loss and gradient differences to the same impl's "plain" row (zero up to
non-deterministic kernels: checkpointing recomputes the same ops). ``--compile`` adds the same
rows under ``torch.compile`` (inductor; "aot_eager" in a dry run).

Part "chunking": x (T, H) bf16 through a bias-free ``nn.Linear(H, V)`` and
``F.cross_entropy(logits.float(), y)`` (what transformers' loss does), ~5% of targets ignored.
Rows: "unchunked" (one call), "classic" (the classic ``forward_with_chunking``: wrong mean, every
chunk's graph kept), and ``cukit.nn.forward_with_chunking`` per chunk size (checkpointed chunks):
forward + backward ms, peak MiB above the inputs (the dW gradient included), loss absolute error and
dx / dW relative error against the unchunked call.

``--dry-run`` runs the same code on the CPU with tiny shapes (perf_counter timing, no memory
figures). Results go to ``--out DIR``, else to a new temporary folder (printed);
``benchmarks/results/`` is written only when named.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import bench_models
    import harness
except ImportError:  # imported as benchmarks.bench_memory from the repository root
    from benchmarks import bench_models, harness

NAME = "bench_memory"
PARTS = ("model", "chunking")
CKPT_MODES = ("plain", "full", "matmul")
CHUNK_SHAPE = (8192, 4096, 128256)  # bench_linear_cross_entropy's headline (T, H, V)
CHUNK_SHAPE_DRY = (96, 32, 1000)
CHUNK_SIZES, CHUNK_SIZES_DRY = (512, 1024, 2048), (16, 40)
MIB = 2**20


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    parts: tuple[str, ...] = PARTS
    llama: dict[str, int] = field(default_factory=lambda: dict(bench_models.LLAMA8_FULL))
    lm_shape: tuple[int, int] = bench_models.LLAMA8_SHAPE
    chunk_shape: tuple[int, int, int] = CHUNK_SHAPE
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES
    compile: bool = False
    compile_backend: str = "inductor"
    warmup: int = 2
    repeats: int = 10
    dry_run: bool = False
    budget_s: float = 540.0
    seed: int = 0
    out: str | None = None


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(out=args.out, seed=args.seed, compile=args.compile)
    if args.quick:
        cfg = replace(cfg, llama=dict(bench_models.LLAMA_FULL), lm_shape=bench_models.LM_SHAPE, chunk_sizes=(1024,),
                      repeats=5, budget_s=300.0)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", dtype="float32", llama=dict(bench_models.LLAMA_TINY),
                      lm_shape=bench_models.LM_SHAPE_DRY, chunk_shape=CHUNK_SHAPE_DRY, chunk_sizes=CHUNK_SIZES_DRY,
                      compile_backend="aot_eager", warmup=1, repeats=2, dry_run=True, budget_s=0.0)
    if args.device is not None:
        cfg = replace(cfg, device=args.device)
    if args.parts:
        cfg = replace(cfg, parts=bench_models._csv_list(args.parts, PARTS, "--parts"))
    if args.chunk_sizes:
        cfg = replace(cfg, chunk_sizes=tuple(int(v) for v in args.chunk_sizes.split(",")))
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    return cfg


def _torch() -> Any:
    import torch

    return torch


@dataclass
class Bench(harness.RunState):
    cfg: Config
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")


def _rel(a: Any, e: Any) -> float:
    torch = _torch()
    n = float(torch.linalg.vector_norm(e.double()))
    return float(torch.linalg.vector_norm(a.double() - e.double())) / n if n else math.nan


def peak_mib(b: Bench, step: Callable[[], Any]) -> float | None:
    """MiB allocated above what was allocated before, at the peak of one `step` (None on the CPU)."""
    if not b.cuda:
        step()
        return None
    torch = _torch()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB


def timed(b: Bench, row: dict[str, Any], step: Callable[[Any], Any], setup: Callable[[], Any]) -> None:
    t = harness.time_cuda(step, warmup=b.cfg.warmup, repeats=b.cfg.repeats, flush_l2=False, setup=setup, cuda=b.cuda)
    row.update(ms=t.ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, repeats=t.repeats, timing=t.method)


# ---------------------------------------------------------------------------------------------
# Part "model": checkpointing a Llama-style model
# ---------------------------------------------------------------------------------------------


def build_llama(cfg: Config) -> tuple[Any, Any, str]:
    """(model, token batch, title): bench_models' Llama config, on the device in cfg.dtype."""
    torch = _torch()
    tf = bench_models._transformers()
    config = tf.LlamaConfig(**cfg.llama, attn_implementation="sdpa", use_cache=False, loss_type="ForCausalLM")
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        model = tf.LlamaForCausalLM(config).to(getattr(torch, cfg.dtype)).train()
    batch, seq = cfg.lm_shape
    (ids,) = bench_models.markov_tokens(1, batch, seq, cfg.llama["vocab_size"], cfg.seed, cfg.device)[0]
    d = cfg.llama
    title = (f"Llama ({d['num_hidden_layers']} layers x {d['hidden_size']}, ffn {d['intermediate_size']}, "
             f"vocab {d['vocab_size']}), {batch} x {seq} tokens, {cfg.dtype}")
    return model, ids, title


def model_case(b: Bench, base: Any, ids: Any, impl: str, mode: str, compiled: bool,
               refs: dict[tuple[str, bool], tuple[float, list[Any]]]) -> dict[str, Any]:
    import cukit.nn

    torch = _torch()
    row: dict[str, Any] = {"part": "model", "impl": impl, "checkpoint": mode, "compiled": compiled,
                           "tokens": ids.numel()}
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        row["error"] = reason
        return row
    model = None
    try:
        model = copy.deepcopy(base)
        if impl == "cukit":
            bench_models.cukit_patch(model)
        if mode != "plain":
            cukit.nn.checkpoint_modules(model, policy="none" if mode == "full" else "matmul")
            row["wrapped"] = len(model.cukit_checkpoint_report.wrapped)
        params = [p for p in model.parameters() if p.requires_grad]
        fn = model
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(model, backend=b.cfg.compile_backend)

        def loss_of() -> Any:
            return fn(input_ids=ids, labels=ids, use_cache=False).loss

        def setup() -> None:
            for p in params:
                p.grad = None

        def step(_: Any = None) -> None:
            loss_of().backward()

        setup()
        loss = loss_of()
        loss.backward()  # first step: compiles (NVRTC, torch.compile) outside the numbers
        setup()
        loss = loss_of()
        loss.backward()
        grads = [p.grad.detach().clone() for p in params]
        ref = refs.get((impl, compiled))
        if mode == "plain":
            refs[(impl, compiled)] = (float(loss.detach()), grads)
        elif ref is not None:
            row["loss_diff"] = abs(float(loss.detach()) - ref[0])
            row["grad_rel_err"] = max(_rel(g, r) for g, r in zip(grads, ref[1], strict=True))
        row["loss"] = float(loss.detach())
        del loss, grads
        setup()
        row["peak_mib"] = peak_mib(b, step)
        timed(b, row, step, setup)
    except Exception as exc:
        row["error"] = b.record_failure(f"model {impl} {mode}{' compiled' if compiled else ''}", exc)
    finally:
        del model
        if compiled:
            torch._dynamo.reset()
        if b.cuda:
            harness.release_cuda_memory()
    return row


def run_model_part(b: Bench) -> None:
    try:
        base, ids, title = build_llama(b.cfg)
    except bench_models.ModelUnavailable as exc:
        b.rows.append({"part": "model", "error": str(exc)})
        return
    b.meta["model"] = title
    print(f"  model: {title}", flush=True)
    refs: dict[tuple[str, bool], tuple[float, list[Any]]] = {}
    for compiled in (False, True) if b.cfg.compile else (False,):
        for impl in ("torch", "cukit"):
            for mode in CKPT_MODES:
                row = model_case(b, base, ids, impl, mode, compiled, refs)
                b.rows.append(row)
                _progress(row)
    del base, refs
    if b.cuda:
        harness.release_cuda_memory()


# ---------------------------------------------------------------------------------------------
# Part "chunking": a big-vocabulary stock head
# ---------------------------------------------------------------------------------------------


def head_loss_class() -> type:
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class HeadLoss(nn.Module):
        """``cross_entropy(linear(x).float(), y)``: a stock LM head and transformers' loss."""

        def __init__(self, weight: Any) -> None:
            super().__init__()
            self.weight_v = weight  # (V, H), shared with the caller
            self.reduction, self.ignore_index = "mean", -100

        def forward(self, x: Any, y: Any) -> Any:
            return F.cross_entropy(F.linear(x, self.weight_v).float(), y, ignore_index=self.ignore_index,
                                   reduction=self.reduction)

    return HeadLoss


def classic(module: Any, input: Any, target: Any, chunk_size: int) -> Any:
    """The classic helper, as users write it (wrong mean, no memory saved)."""
    n, loss = input.shape[0], 0.0
    for i in range(0, n, chunk_size):
        loss += module(input[i:i + chunk_size], target[i:i + chunk_size])
    return loss / (n / chunk_size)


def chunk_case(b: Bench, name: str, fn: Callable[[Any, Any], Any], data: tuple[Any, Any, Any],
               ref: tuple[float, Any, Any] | None, chunk: int | None) -> dict[str, Any]:
    T, H, V = b.cfg.chunk_shape
    row: dict[str, Any] = {"part": "chunking", "impl": name, "chunk_size": chunk, "shape": f"{T}x{H}x{V}"}
    reason = b.stop_reason(b.cfg.budget_s)
    if reason:
        row["error"] = reason
        return row
    x, w, y = data
    try:
        def setup() -> None:
            x.grad = w.grad = None

        def step(_: Any = None) -> None:
            fn(x, y).backward()

        setup()
        loss = fn(x, y)
        loss.backward()
        if ref is not None:
            row["loss_err"] = abs(float(loss.detach()) - ref[0])
            row["dx_err"], row["dw_err"] = _rel(x.grad, ref[1]), _rel(w.grad, ref[2])
        del loss
        setup()
        row["peak_mib"] = peak_mib(b, step)
        timed(b, row, step, setup)
    except Exception as exc:
        row["error"] = b.record_failure(f"chunking {name}", exc)
    finally:
        x.grad = w.grad = None
        if b.cuda:
            harness.release_cuda_memory()
    return row


def run_chunking_part(b: Bench) -> None:
    import cukit.nn

    torch = _torch()
    cfg = b.cfg
    T, H, V = cfg.chunk_shape
    g = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    dt = getattr(torch, cfg.dtype)
    x = torch.randn(T, H, device=cfg.device, generator=g).to(dt).requires_grad_()
    w = (torch.randn(V, H, device=cfg.device, generator=g) / math.sqrt(H)).to(dt).requires_grad_()
    y = torch.randint(0, V, (T,), device=cfg.device, generator=g)
    y[torch.rand(T, device=cfg.device, generator=g) < 0.05] = -100
    head = head_loss_class()(w)
    print(f"  chunking: {T} x {H} -> {V} classes, {cfg.dtype}", flush=True)
    ref = None
    with contextlib.suppress(Exception):
        loss = head(x, y)
        loss.backward()
        ref = (float(loss.detach()), x.grad.detach().clone(), w.grad.detach().clone())
        x.grad = w.grad = None
        del loss
    if ref is None:
        b.failures.append("chunking: the unchunked reference failed (out of memory?): errors not measured")
    cases: list[tuple[str, Callable[[Any, Any], Any], int | None]] = [("unchunked", head, None)]
    c0 = cfg.chunk_sizes[0]
    cases.append(("classic", lambda a, t: classic(head, a, t, c0), c0))
    for c in cfg.chunk_sizes:
        cases.append(("cukit chunked", lambda a, t, c=c: cukit.nn.forward_with_chunking(head, a, t, c), c))
    for name, fn, chunk in cases:
        row = chunk_case(b, name, fn, (x, w, y), ref, chunk)
        b.rows.append(row)
        _progress(row)
    del x, w, y, ref


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

MODEL_COLUMNS: list[str | tuple[str, str]] = [
    "impl", "checkpoint", "compiled", ("ms", "fwd+bwd ms"), ("peak_mib", "peak MiB above params"),
    ("vs_plain_ms", "time vs plain"), ("vs_plain_mib", "memory vs plain"), ("loss_diff", "loss diff"),
    ("grad_rel_err", "grad rel err"), ("error", "error"),
]
CHUNK_COLUMNS: list[str | tuple[str, str]] = [
    "impl", "chunk_size", ("ms", "fwd+bwd ms"), ("peak_mib", "peak MiB above inputs"), ("loss_err", "loss abs err"),
    ("dx_err", "dx rel err"), ("dw_err", "dW rel err"), ("error", "error"),
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:70]}


def _progress(r: dict[str, Any]) -> None:
    what = " ".join(str(r.get(k)) for k in ("impl", "checkpoint", "chunk_size") if r.get(k) is not None)
    print(f"    {what}: " + ("ERR " + str(r["error"])[:80] if r.get("error") else
          f"{harness.format_value(r.get('ms'))} ms, {harness.format_value(r.get('peak_mib'))} MiB"), flush=True)


def ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Each model row's time and memory against the plain row of the same impl and compile mode."""
    plain = {(r["impl"], r["compiled"]): r for r in rows
             if r.get("part") == "model" and r.get("checkpoint") == "plain" and r.get("ms")}
    for r in rows:
        p = plain.get((r.get("impl"), r.get("compiled")))
        if r.get("part") != "model" or p is None or not r.get("ms"):
            continue
        r["vs_plain_ms"] = r["ms"] / p["ms"]
        if r.get("peak_mib") and p.get("peak_mib"):
            r["vs_plain_mib"] = r["peak_mib"] / p["peak_mib"]


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    print()
    harness.print_summary_head(NAME, env, b.elapsed())
    model_rows = [r for r in b.rows if r.get("part") == "model"]
    if model_rows:
        harness.print_table(model_rows, MODEL_COLUMNS, formatters=_FMT,
                            title=f"\nactivation checkpointing, forward + backward: {b.meta.get('model', '')}")
    chunk_rows = [r for r in b.rows if r.get("part") == "chunking"]
    if chunk_rows:
        T, H, V = b.cfg.chunk_shape
        harness.print_table(chunk_rows, CHUNK_COLUMNS, formatters=_FMT,
                            title=f"\nforward_with_chunking, stock head + cross_entropy, {T} x {H} -> {V}:")
    harness.print_outcome(b.failures, saved)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = harness.run_parser(__doc__, "the 6-layer Llama, one chunk size, fewer repeats")
    p.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--compile", action="store_true", help="also the model rows under torch.compile")
    p.add_argument("--chunk-sizes", default=None, help="comma-separated chunk sizes for forward_with_chunking")
    return p.parse_args(argv)


def run(cfg: Config) -> Bench:
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg=cfg)
    b.meta["config"] = dict(vars(cfg))
    if cfg.compile:
        harness.configure_dynamo()
    print(f"{NAME}: device {cfg.device}, {cfg.dtype}, parts {','.join(cfg.parts)}", flush=True)
    if "model" in cfg.parts:
        run_model_part(b)
    if "chunking" in cfg.parts:
        run_chunking_part(b)
    ratios(b.rows)
    env = harness.environment()
    saved = harness.save_run(b, NAME, cfg.out, env)
    print_summary(b, env, saved)
    return b


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when the run completed (failed cases are reported, not fatal)."""
    args = parse_args(argv)
    return harness.main_run(NAME, config_from_args(args), run)


if __name__ == "__main__":
    sys.exit(main())
