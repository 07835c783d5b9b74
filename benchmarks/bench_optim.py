"""Benchmark ``cukit.optim`` against torch.optim's for-loop, foreach and fused implementations.

Usage::

    python benchmarks/bench_optim.py [--out DIR] [--quick] [--dry-run] [--budget-s S]

Parameter sets (issue 4): GPT-2 small (148 tensors, 124M parameters) in float32 and bfloat16,
2,000 x 4,096 and 10,000 x 256 (float32); optimizers AdamW, SGD with momentum, Lion, LAMB; plus
AdamW with fused clipping (max_grad_norm) and GradScaler (grad_scale / found_inf) on GPT-2 float32
and on GPT-2 in the mixed-precision layout (float16 params and grads, float32 master weights and
state; cukit only, torch has no master weights), each also as a multiple of the plain step's time
(``x_plain_step``).
Implementations, in the same run: torch for-loop (``foreach=False``), foreach, fused (where torch
has one) and cukit (and cukit with ``flat_grads=True``). torch has no Lion or LAMB: their "torch
for-loop" row is cukit's plain-torch reference (``optim/_reference.py``), labelled as such.

Per case: one step of each implementation from the same state is validated against the for-loop
before timing; then the device time of a step (CUDA events, median, L2 flushed between repeats),
the effective bandwidth (the bytes the update must move: each list read once, each updated list
written once), its fraction of the measured copy bandwidth, and the host microseconds per step
(the CPU time to enqueue one step; the GPU keeps up because the step is queued behind the next).
``--dry-run`` runs tiny sizes on the CPU with perf_counter (the smoke test of this script).

Low-bit states (issue 13): AdamW8bit, Adam8bit, AdamW4bit, Lion8bit and SGD8bit on GPT-2 small
(float32) and 10,000 x 256, against torch's fused float32 AdamW / SGD (Lion: cukit's float32 Lion)
and bitsandbytes' 8-bit class when it is importable, with the state bytes per parameter; and the
loss of a 200-step GPT-2-style training run (plain torch, 2 layers x 256, Markov tokens) with each optimizer
beside its float32 twin (``--lowbit-only`` runs just this part).

Results go to ``--out DIR`` ("-": none), else to a new temporary folder (printed);
``benchmarks/results/`` is written only when named, never by ``--dry-run``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_optim from the repository root
    from benchmarks import harness

NAME = "bench_optim"
OPTIMIZERS = ("AdamW", "SGD", "Lion", "LAMB")


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter tensors (124.4M elements)."""
    d, v, n_ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(v, d), (n_ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]
    return [*shapes, (d,), (d,)]


@dataclass
class Config:
    device: str = "cuda"
    sets: tuple[str, ...] = ("gpt2-fp32", "gpt2-bf16", "2000x4096", "10000x256")
    optimizers: tuple[str, ...] = OPTIMIZERS
    warmup: int = 3
    repeats: int = 20
    host_iters: int = 20
    flush_l2: bool = True
    dry_run: bool = False
    budget_s: float = 540.0
    out: str | None = None
    lowbit: bool = True
    full: bool = True  # the float32 / 16-bit optimizer sets above (off with --lowbit-only)
    lowbit_sets: tuple[str, ...] = ("gpt2-fp32", "10000x256")
    train_steps: int = 200


def param_set(name: str, dry: bool) -> tuple[list[tuple[int, ...]], str]:
    if dry:
        return {
            "gpt2-fp32": ([(64, 8), (8,), (0,)], "float32"),
            "gpt2-bf16": ([(64, 8), (8,)], "bfloat16"),
            "gpt2-fp16-master": ([(64, 8), (8,)], "float16"),
            "2000x4096": ([(64,)] * 20, "float32"),
            "10000x256": ([(4,)] * 100, "float32"),
        }[name]
    if name.startswith("gpt2"):
        return gpt2_small_shapes(), {"gpt2-fp32": "float32", "gpt2-bf16": "bfloat16"}.get(name, "float16")
    n, m = (int(x) for x in name.split("x"))
    return [(m,)] * n, "float32"


# bytes moved per element, as multiples of the param itemsize (state in the param's dtype):
# reads + writes of the lists each update touches
TRAFFIC = {"AdamW": 7, "SGD": 5, "Lion": 5, "LAMB": 10}
# "gpt2-fp16-master": float16 params and grads, float32 master weights and state (the usual
# mixed-precision layout for GradScaler): read master 4, grad 2, m 4, v 4; write master 4, param 2,
# m 4, v 4. Its clipping pass reads 2 more bytes: a floor of 30/28 = 1.07x the plain step.
MASTER_SET = "gpt2-fp16-master"
MASTER_BYTES = 28
SLOW_STEP_S = 0.05  # one step slower than this is timed with 3 repeats, not cfg.repeats


def traffic_bytes(set_name: str, opt: str, dtype_name: str) -> int:
    """Bytes per element the update must move (each list read once, each updated list written once)."""
    if set_name == MASTER_SET:
        return MASTER_BYTES
    return TRAFFIC[opt] * (2 if dtype_name in ("bfloat16", "float16") else 4)


def make_impls(opt: str, device: str) -> list[tuple[str, Callable[[list[Any]], Any]]]:
    import cukit.optim as co
    import torch

    kw: dict[str, Any] = {"lr": 1e-3}
    if opt == "SGD":
        kw["momentum"] = 0.9
    out: list[tuple[str, Callable[[list[Any]], Any]]] = []
    if opt in ("AdamW", "SGD"):
        tcls = getattr(torch.optim, opt)
        out.append(("torch for-loop", functools.partial(tcls, foreach=False, **kw)))
        out.append(("torch foreach", functools.partial(tcls, foreach=True, **kw)))
        if device.startswith("cuda"):
            out.append(("torch fused", functools.partial(tcls, fused=True, **kw)))
    else:
        # torch has none: cukit's plain-torch reference, one tensor at a time (forced off the kernels)
        def ref_factory(params: list[Any], _opt: str = opt) -> Any:
            o = getattr(co, _opt)(params, **kw)
            o._use_kernels = lambda ps: False  # type: ignore[method-assign]
            return o

        out.append(("torch for-loop (cukit reference)", ref_factory))
    ccls = getattr(co, opt)
    out.append(("cukit", functools.partial(ccls, **kw)))
    out.append(("cukit flat_grads", functools.partial(ccls, flat_grads=True, **kw)))
    return out


def step_numbers(t: Any, host_us: float, nbytes: float, copy_bw: float) -> dict[str, Any]:
    """A timed step's row entries: median and min ms, the effective TB/s of `nbytes` moved, its
    fraction of the copy bandwidth, host µs per step."""
    rate = nbytes / (t.ms * 1e-3)
    return {"ms": t.ms, "min_ms": t.min_ms, "tbps": rate / 1e12, "frac_copy": rate / copy_bw if copy_bw else None,
            "host_us": host_us}


def run_case(
    cfg: Config,
    set_name: str,
    opt: str,
    copy_bw: float,
    rows: list[dict[str, Any]],
    failures: list[str],
    extra: str = "",
) -> None:
    import torch

    shapes, dtype_name = param_set(set_name, cfg.dry_run)
    dtype = getattr(torch, dtype_name)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(s, generator=g).to(device=cfg.device, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device=cfg.device, dtype=dtype) for s in shapes]
    if set_name == MASTER_SET:  # torch has no master weights: this set measures cukit's own clip cost
        import cukit.optim as co

        impls = [("cukit", functools.partial(co.AdamW, lr=1e-3, master_weights=True, state_dtype=torch.float32))]
    else:
        impls = make_impls(opt, cfg.device)
        if extra:
            impls = [(n, f) for n, f in impls if n in ("torch fused", "cukit")]
    reference: list[Any] | None = None
    if set_name == MASTER_SET:  # master weights = torch's for-loop on float32 copies, rounded to float16
        p32 = [p.float().requires_grad_() for p in init]
        for p, gr in zip(p32, grads, strict=True):
            p.grad = gr.float()
        torch.optim.AdamW(p32, lr=1e-3, foreach=False).step()
        reference = [torch.cat([p.detach().to(dtype).float().reshape(-1) for p in p32])]
        del p32
    for impl, factory in impls:
        row: dict[str, Any] = {
            "set": set_name,
            "opt": opt + extra,
            "impl": impl,
            "dtype": dtype_name,
            "tensors": len(shapes),
            "numel": numel,
        }
        try:
            params = [p.clone().requires_grad_() for p in init]
            kwargs: dict[str, Any] = {}
            if extra and impl == "cukit":
                kwargs["max_grad_norm"] = 1e9  # computed and applied; too large to change the result
            o = factory(params, **kwargs) if kwargs else factory(params)
            for p, gr in zip(params, grads, strict=True):
                if p.grad is None:
                    p.grad = gr.clone()
                else:
                    p.grad.copy_(gr)
            if extra:
                scale = torch.tensor(1.0, device=cfg.device)
                found = torch.zeros((), device=cfg.device)
                if impl == "cukit":
                    o.grad_scale, o.found_inf = scale, found
                else:  # torch fused takes them the same way
                    o.grad_scale, o.found_inf = scale, found
            o.step()
            harness.synchronize()
            flat = torch.cat([p.detach().float().reshape(-1) for p in params])
            if reference is None:
                reference = [flat]
            else:
                harness.check_close(
                    flat,
                    reference[0],
                    name=f"{set_name} {opt} {impl}",
                    atol={"bfloat16": 2e-2, "float16": 1e-3}.get(dtype_name, 1e-5),  # 16-bit: rounding may
                    rtol={"bfloat16": 2e-2, "float16": 1e-3}.get(dtype_name, 1e-4),  # flip by an ulp
                )
            wu, rep = (1, 3) if cfg.dry_run else (cfg.warmup, cfg.repeats)
            hi, rounds = cfg.host_iters, 3
            t_one = time.perf_counter()
            o.step()
            harness.synchronize()
            t_one = time.perf_counter() - t_one
            if t_one > SLOW_STEP_S:  # a host-bound baseline (for-loops at 10,000 tensors): fewer repeats
                wu, rep, hi, rounds = 1, 3, 2, 1
            t = harness.time_cuda(
                o.step, warmup=wu, repeats=rep, flush_l2=cfg.flush_l2, cuda=cfg.device.startswith("cuda")
            )
            host = harness.host_cost_us(o.step, iters=hi, rounds=rounds, warmup=1)
            nbytes = numel * traffic_bytes(set_name, opt, dtype_name)
            row.update(step_numbers(t, host, nbytes, copy_bw))
            del o, params
            print(f"  {set_name:17s} {opt + extra:19s} {impl:34s} {t.ms:9.3f} ms", flush=True)
        except Exception as e:  # recorded, the run goes on
            if harness.is_fatal_cuda_error(e):
                raise
            row["error"] = harness.short_error(e)
            failures.append(f"{set_name} {opt}{extra} {impl}: {row['error']}")
        rows.append(row)
    base = {r["impl"]: r.get("ms") for r in rows if r["set"] == set_name and r["opt"] == opt + extra}
    ref_ms = (
        base.get("torch fused") or base.get("torch foreach") or base.get("torch for-loop (cukit reference)")
    )
    plain = {r["impl"]: r.get("ms") for r in rows if r["set"] == set_name and r["opt"] == opt}
    for r in rows:
        if r["set"] == set_name and r["opt"] == opt + extra and r.get("ms"):
            if ref_ms and set_name != MASTER_SET:
                r["speedup_vs_best_torch"] = ref_ms / r["ms"]
            if extra and plain.get(r["impl"]):  # the fused extras' cost: time over the plain step's
                r["x_plain_step"] = r["ms"] / plain[r["impl"]]


# ---------------------------------------------------------------- low-bit states
LOWBIT = ("AdamW8bit", "Adam8bit", "AdamW4bit", "Lion8bit", "SGD8bit")
# the float32 baseline of each: (torch.optim class or None for cukit's, cukit float32 twin)
LOWBIT_TWIN = {"AdamW8bit": "AdamW", "Adam8bit": "Adam", "AdamW4bit": "AdamW", "Lion8bit": "Lion", "SGD8bit": "SGD"}
LOWBIT_KW: dict[str, dict[str, Any]] = {
    "AdamW8bit": {"lr": 1e-3}, "Adam8bit": {"lr": 1e-3}, "AdamW4bit": {"lr": 1e-3},
    "Lion8bit": {"lr": 1e-4}, "SGD8bit": {"lr": 1e-2, "momentum": 0.9},
}
# bytes one element's update moves: param r+w 8, grad 4, and per quantised state a code read and
# written (1 + 1 bytes at 8 bits, 0.5 + 0.5 at 4; the block scales' 2 x 4 / block are ignored)
LOWBIT_STATES = {"AdamW8bit": 2, "Adam8bit": 2, "AdamW4bit": 2, "Lion8bit": 1, "SGD8bit": 1}


def lowbit_bytes(opt: str) -> float:
    per_code = 1.0 if opt == "AdamW4bit" else 2.0
    return 12 + LOWBIT_STATES[opt] * per_code


def state_bytes(opt: Any) -> int:
    """Bytes of an optimizer's per-parameter state (codes, scales, float32 states; not the code
    tables bitsandbytes and cukit share across tensors, nor step counters)."""
    import torch

    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k not in ("step", "qmap1", "qmap2") and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def lowbit_impls(opt: str, device: str) -> list[tuple[str, Callable[[list[Any]], Any]]]:
    import cukit.optim as co
    import torch

    kw = LOWBIT_KW[opt]
    twin = LOWBIT_TWIN[opt]
    out: list[tuple[str, Callable[[list[Any]], Any]]] = []
    tkw = {**kw, "weight_decay": 1e-2} if twin == "AdamW" else kw
    if twin in ("AdamW", "Adam", "SGD") and device.startswith("cuda"):
        out.append((f"torch fused {twin}", functools.partial(getattr(torch.optim, twin), fused=True, **tkw)))
    out.append((f"cukit {twin}", functools.partial(getattr(co, twin), **kw)))
    bnb = _bitsandbytes()
    if bnb is not None and hasattr(bnb.optim, opt) and device.startswith("cuda"):
        out.append((f"bitsandbytes {opt}", functools.partial(getattr(bnb.optim, opt), **kw)))
    out.append((f"cukit {opt}", functools.partial(getattr(co, opt), **kw)))
    return out


def _bitsandbytes() -> Any:
    try:
        import bitsandbytes

        return bitsandbytes
    except Exception:  # not installed, or no library for this CUDA: the rows are left out
        return None


def run_lowbit_case(cfg: Config, set_name: str, opt: str, copy_bw: float, rows: list[dict[str, Any]],
                    failures: list[str]) -> None:
    import torch

    shapes, _ = param_set(set_name, cfg.dry_run)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(s, generator=g).to(cfg.device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(cfg.device) for s in shapes]
    reference: Any = None
    for impl, factory in lowbit_impls(opt, cfg.device):
        row: dict[str, Any] = {"set": set_name, "opt": opt, "impl": impl, "dtype": "float32",
                               "tensors": len(shapes), "numel": numel}
        try:
            params = [p.clone().requires_grad_() for p in init]
            o = factory(params)
            for p, gr in zip(params, grads, strict=True):
                p.grad = gr.clone()
            o.step()
            harness.synchronize()
            flat = torch.cat([p.detach().reshape(-1) - q.reshape(-1) for p, q in zip(params, init, strict=True)])
            if reference is None:
                reference = flat
            else:  # one step from zero state: the quantised first moments move it by ~1 % of lr
                lr = LOWBIT_KW[opt]["lr"]
                harness.check_close(flat, reference, name=f"{set_name} {opt} {impl} (update)", atol=lr * 0.15,
                                    rtol=0.05, rel_tol=0.05, use_cukit_testing=False)
            row["state_bytes_per_param"] = state_bytes(o) / numel
            wu, rep = (1, 3) if cfg.dry_run else (cfg.warmup, cfg.repeats)
            t = harness.time_cuda(o.step, warmup=wu, repeats=rep, flush_l2=cfg.flush_l2,
                                  cuda=cfg.device.startswith("cuda"))
            host = harness.host_cost_us(o.step, iters=cfg.host_iters, rounds=3, warmup=1)
            fp32_bytes = 4 * TRAFFIC["AdamW" if LOWBIT_TWIN[opt] == "Adam" else LOWBIT_TWIN[opt]]
            nbytes = numel * (lowbit_bytes(opt) if "bit" in impl.split()[-1] else fp32_bytes)
            row.update(step_numbers(t, host, nbytes, copy_bw))
            del o, params
            print(f"  {set_name:17s} {opt:19s} {impl:34s} {t.ms:9.3f} ms  "
                  f"{row['state_bytes_per_param']:.3f} B/param", flush=True)
        except Exception as e:  # recorded, the run goes on
            if harness.is_fatal_cuda_error(e):
                raise
            row["error"] = harness.short_error(e)
            failures.append(f"{set_name} {opt} {impl}: {row['error']}")
        rows.append(row)
    mine = [r for r in rows if r["set"] == set_name and r["opt"] == opt]
    ms = {r["impl"].split()[0] + (" fp32" if "bit" not in r["impl"].split()[-1] else ""): r.get("ms") for r in mine}
    for r in mine:
        if r.get("ms") and r["impl"] == f"cukit {opt}":
            for key, col in (("torch fp32", "speedup_vs_torch_fp32"), ("bitsandbytes", "speedup_vs_bnb"),
                             ("cukit fp32", "speedup_vs_cukit_fp32")):
                if ms.get(key):
                    r[col] = ms[key] / r["ms"]


def gpt_model(vocab: int, d: int, layers: int, seq: int) -> Any:
    """A GPT-2-style causal language model in plain torch: token and position embeddings,
    pre-norm transformer blocks (4d GELU MLP, no dropout), a final LayerNorm and the LM head."""
    import torch

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Embedding(seq, d)
            block = torch.nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, activation="gelu",
                                                     batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, vocab, bias=False)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, ids: Any) -> Any:
            n = ids.shape[1]
            x = self.tok(ids) + self.pos.weight[:n]
            x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
            logits = self.head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    return GPT()


def train_losses(cfg: Config, rows: list[dict[str, Any]], failures: list[str]) -> None:
    """A GPT-2-style model (:func:`gpt_model`: 2 layers x 256, vocab 8,192, Markov tokens) trained
    for cfg.train_steps with each low-bit optimizer and its float32 twin from the same start: the
    final loss (mean of the last 10 steps) and its relative difference from the twin's."""
    import copy

    import cukit.optim as co
    import torch

    try:
        from bench_models import markov_tokens
    except ImportError:
        from benchmarks.bench_models import markov_tokens
    steps = 8 if cfg.dry_run else cfg.train_steps
    batch, seq = (2, 16) if cfg.dry_run else (8, 128)
    vocab = 8192
    torch.manual_seed(0)
    base = gpt_model(vocab, 64 if cfg.dry_run else 256, 2, seq).to(cfg.device)
    data = markov_tokens(steps, batch, seq, vocab, 0, cfg.device)
    bnb = _bitsandbytes()
    runs: list[tuple[str, str, Callable[[list[Any]], Any]]] = []
    for opt in LOWBIT:
        twin = LOWBIT_TWIN[opt]
        kw = LOWBIT_KW[opt]
        if twin in ("AdamW", "Adam", "SGD"):
            tkw = {**kw, "weight_decay": 1e-2} if twin == "AdamW" else kw
            runs.append((opt, f"torch {twin}", functools.partial(getattr(torch.optim, twin), **tkw)))
        runs.append((opt, f"cukit {twin}", functools.partial(getattr(co, twin), **kw)))
        if bnb is not None and hasattr(bnb.optim, opt) and cfg.device.startswith("cuda"):
            runs.append((opt, f"bitsandbytes {opt}", functools.partial(getattr(bnb.optim, opt), **kw)))
        runs.append((opt, f"cukit {opt}", functools.partial(getattr(co, opt), **kw)))
    done: dict[tuple[str, str], float] = {}
    for opt, impl, factory in runs:
        row: dict[str, Any] = {"set": "train gpt2 2x256", "opt": opt, "impl": impl, "dtype": "float32"}
        try:
            if (LOWBIT_TWIN[opt], impl) in done:  # the same float32 run as another optimizer's
                row["final_loss"] = done[(LOWBIT_TWIN[opt], impl)]
            else:
                model = copy.deepcopy(base)
                o = factory(list(model.parameters()))
                losses = []
                for (ids,) in data:
                    loss = model(ids)
                    loss.backward()
                    o.step()
                    o.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
                tail = torch.stack(losses[-10:]).float().mean().item()
                row["final_loss"] = tail
                row["first_loss"] = losses[0].item()
                if "bit" not in impl.split()[-1]:
                    done[(LOWBIT_TWIN[opt], impl)] = tail
                del model, o
            print(f"  train {opt:10s} {impl:28s} final loss {row['final_loss']:.4f}", flush=True)
        except Exception as e:
            if harness.is_fatal_cuda_error(e):
                raise
            row["error"] = harness.short_error(e)
            failures.append(f"train {opt} {impl}: {row['error']}")
        rows.append(row)
    for opt in LOWBIT:
        mine = [r for r in rows if r.get("set") == "train gpt2 2x256" and r["opt"] == opt]
        twin = next((r.get("final_loss") for r in mine if r["impl"] == f"torch {LOWBIT_TWIN[opt]}"), None) or next(
            (r.get("final_loss") for r in mine if r["impl"] == f"cukit {LOWBIT_TWIN[opt]}"), None)
        for r in mine:
            if twin and r.get("final_loss") is not None:
                r["loss_vs_fp32"] = r["final_loss"] / twin - 1.0


def lowbit_targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 13's AdamW8bit targets, from this run's rows."""
    out = []
    r = next((r for r in rows if r["set"] == "gpt2-fp32" and r["impl"] == "cukit AdamW8bit" and r.get("ms")), None)
    if r is None:
        return ["  [n/a ] AdamW8bit on GPT-2 small: not measured"]
    vb, vt, b = r.get("speedup_vs_bnb"), r.get("speedup_vs_torch_fp32"), r.get("state_bytes_per_param")
    out.append(f"  [{'PASS' if vb and vb >= 1.5 else ('n/a ' if vb is None else 'FAIL')}] AdamW8bit >= 1.5x "
               f"bitsandbytes AdamW8bit: {vb and f'{vb:.2f}x'}")
    out.append(f"  [{'PASS' if vt and vt >= 1.3 else 'FAIL'}] AdamW8bit >= 1.3x torch fused fp32 AdamW: "
               f"{vt and f'{vt:.2f}x'}")
    out.append(f"  [{'PASS' if b is not None and b <= 2.1 else 'FAIL'}] AdamW8bit state <= 2.1 bytes/param: "
               f"{b and f'{b:.3f}'}")
    t = next((r for r in rows if r.get("set") == "train gpt2 2x256" and r["impl"] == "cukit AdamW8bit"), None)
    d = t and t.get("loss_vs_fp32")
    out.append(f"  [{'PASS' if d is not None and abs(d) <= 0.01 else ('n/a ' if d is None else 'FAIL')}] "
               f"AdamW8bit 200-step loss within 1% of fp32 AdamW: {d if d is None else f'{d:+.4%}'}")
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    import torch

    cfg = harness.with_results_dir(cfg, NAME)
    env = harness.environment()
    print(f"{NAME}: {env.get('gpu') or 'cpu'}  torch {env.get('torch')}  commit {env.get('git_commit')}")
    copy_bw = harness.copy_bandwidth(cfg.device, nbytes=1 << 22 if cfg.dry_run else 1 << 30)
    print(f"copy bandwidth: {copy_bw / 1e12:.3f} TB/s")
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    cases = [(s, o, "") for s in cfg.sets for o in cfg.optimizers] if cfg.full else []
    if "AdamW" in cfg.optimizers and cfg.full:  # the fused-extras target, early: fp32, then the AMP layout
        cases[1:1] = [
            ("gpt2-fp32", "AdamW", " +clip+scaler"),
            (MASTER_SET, "AdamW", ""),
            (MASTER_SET, "AdamW", " +clip+scaler"),
        ]
    for set_name, opt, extra in cases:
        if cfg.budget_s and time.perf_counter() - t0 > cfg.budget_s:
            failures.append(f"{set_name} {opt}{extra}: skipped (time budget)")
            continue
        run_case(cfg, set_name, opt, copy_bw, rows, failures, extra)
        torch.cuda.empty_cache() if cfg.device.startswith("cuda") else None
    if cfg.lowbit:
        for set_name in cfg.lowbit_sets:
            for opt in LOWBIT:
                if cfg.budget_s and time.perf_counter() - t0 > cfg.budget_s:
                    failures.append(f"{set_name} {opt}: skipped (time budget)")
                    continue
                run_lowbit_case(cfg, set_name, opt, copy_bw, rows, failures)
                torch.cuda.empty_cache() if cfg.device.startswith("cuda") else None
        if not (cfg.budget_s and time.perf_counter() - t0 > cfg.budget_s):
            train_losses(cfg, rows, failures)
        else:
            failures.append("train: skipped (time budget)")
    harness.print_table(
        rows,
        [
            "set",
            "opt",
            "impl",
            "dtype",
            "tensors",
            "ms",
            "tbps",
            "frac_copy",
            "host_us",
            "speedup_vs_best_torch",
            "x_plain_step",
        ],
        title="optimizer step: device ms (median), effective TB/s, fraction of copy bandwidth, host µs/step",
    ) if cfg.full else None
    if cfg.lowbit:
        harness.print_table(
            [r for r in rows if r["opt"] in LOWBIT and "final_loss" not in r and r.get("set") != "train gpt2 2x256"],
            ["set", "opt", "impl", "ms", "tbps", "frac_copy", "host_us", "state_bytes_per_param",
             "speedup_vs_torch_fp32", "speedup_vs_cukit_fp32", "speedup_vs_bnb"],
            title="low-bit states: device ms, effective TB/s (the bytes each impl's own layout moves), "
                  "state bytes per parameter, speed-ups of cukit's low-bit step",
        )
        harness.print_table(
            [r for r in rows if r.get("set") == "train gpt2 2x256"],
            ["opt", "impl", "first_loss", "final_loss", "loss_vs_fp32"],
            title=f"training: GPT-2-style 2 x 256, {8 if cfg.dry_run else cfg.train_steps} steps, final loss (mean of the last 10 steps)",
        )
        print("targets:")
        for line in lowbit_targets(rows):
            print(line)
    saved: list[str] = []
    if cfg.out != "-":
        paths = harness.save_results(
            rows,
            NAME,
            cfg.out,
            env=env,
            meta={"copy_bandwidth": copy_bw},
            plot_kwargs={
                "x": "tensors",
                "y": "ms",
                "series": "impl",
                "panels": ("opt", "dtype"),
                "ylabel": "ms per step (log)",
                "logx": True,
                "logy": True,
            },
        )
        saved = [str(p) for p in paths]
    harness.print_outcome(failures, saved)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, AdamW only")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (smoke test)")
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--lowbit-only", action="store_true", help="only the 8-bit / 4-bit rows and the training run")
    ap.add_argument("--no-lowbit", action="store_true", help="leave the 8-bit / 4-bit part out")
    ap.add_argument("--train-steps", type=int, default=200, help="steps of the low-bit training run")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(out=args.out)
    if args.quick:
        cfg = replace(cfg, optimizers=("AdamW",), repeats=10, host_iters=10)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", flush_l2=False, dry_run=True, host_iters=2, budget_s=0.0)
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    cfg = replace(cfg, full=not args.lowbit_only, lowbit=not args.no_lowbit, train_steps=args.train_steps)
    return harness.main_run(NAME, cfg, run)


if __name__ == "__main__":
    sys.exit(main())
