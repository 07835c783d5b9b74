"""Training steps of real torch models: stock torch against ``cukit.nn.patch`` + ``cukit.optim.AdamW``.

Usage::

    python benchmarks/bench_models.py                              # every model, every setting
    python benchmarks/bench_models.py --models llama               # one model (results: bench_models-llama.*)
    python benchmarks/bench_models.py --models mlp,cnn --settings eager-bf16,eager-amp
    python benchmarks/bench_models.py --steps 60 --budget-s 400    # longer loss curves, tighter budget
    python benchmarks/bench_models.py --models llama --repeats 3   # 3 rounds per setting, order alternating
    python benchmarks/bench_models.py --compile-mode max-autotune-no-cudagraphs
    python benchmarks/bench_models.py --dry-run                    # tiny configs on the CPU (smoke test)
    python benchmarks/bench_models.py --dry-run --device cuda      # tiny configs on a GPU

Models (``--models``, run in the order given; default ``llama,mlp,cnn,gpt2``, the targets first):

- ``llama``: Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig`` (6 layers, hidden 768,
  intermediate 2048, 12 heads / 4 KV heads, vocab 32000, ``attn_implementation="sdpa"``), batch
  8 x 512 tokens, loss from ``labels=input_ids``. Skipped, with a row saying so, when transformers
  is not importable. Nothing is downloaded: the weights are the config's random initialisation.
- ``gpt2``: ``GPT2LMHeadModel(GPT2Config())`` (12 layers, 768, 12 heads, vocab 50257, tied
  embeddings, HF ``Conv1D`` projections), batch 8 x 512, dropout set to 0 (see "loss curves").
- ``mlp``: the demo's 64-256-256-10 gelu MLP (``cukit.demo.mlp_models``), batch 64.
- ``cnn``: the demo's 1x8x8 conv 16 -> conv 32 -> linear 10 CNN (``cukit.demo.cnn_models``), batch 64.

Implementations (``impl``), each trained from a deep copy of one model built once per model (same
initial weights), on the same batches, with the same seed:

- ``torch``: the stock model, ``torch.optim.AdamW(fused=True)``.
- ``cukit``: ``cukit.nn.patch(copy)`` with its defaults (a linear layer followed by an activation
  becomes ``cukit.nn.Linear``/``Conv1D`` with it fused, the others stay torch's; norms, gated MLP,
  rotary embedding and the labels loss of HF models become cukit's; parameters shared; the report
  is printed once per model) and ``cukit.optim.AdamW``. ``--patch-linear`` adds ``linear=True,
  conv1d=True`` (every linear layer cukit's). For the CNN, ``patch`` swaps each nn.Conv2d for
  ``cukit.nn.Conv2d`` with the following activation fused (one implicit-GEMM kernel per convolution).
- ``cukit-demo`` (MLP only): the demo's twin (``nn.Linear(bias=False)`` + ``cukit.nn.BiasAct``),
  beside the patched MLP.

Both optimizers: AdamW, the same lr and weight decay 0.01; parameters without decay are not split out.

Settings (``--settings``): ``eager-bf16``, ``compile-bf16``, ``eager-amp``, ``compile-amp``.
``bf16`` = pure bfloat16 parameters, gradients and optimizer state; ``amp`` = float32 parameters,
the forward under ``torch.autocast(dtype=torch.bfloat16)``, backward and step outside it.
``compile`` = ``torch.compile`` of the module that returns the loss (model + loss function; the
optimizer step stays eager), with the same options for both sides, after ``torch._dynamo.reset()``.

Step: forward (loss), ``loss.backward()``, ``opt.step()``, the learning-rate warm-up's
``sched.step()``, ``opt.zero_grad(set_to_none=True)``. The backward runs on autograd's device thread (torch's
default); ``--backward-thread caller`` runs both sides' on the calling thread instead.
Each step is timed on the host clock between two device synchronisations (a whole step as a
training loop sees it, host overhead included: the small models are host-bound). The first
``--warmup`` steps are not timed; every step is in the loss curve. A host-bound step's time drifts
with the machine's load over seconds, so the impls of a setting are trained side by side: each is
built and warmed up in turn, then their timed steps alternate in blocks of ``--interleave`` steps
(default 5), the order reversed every other block, and a drift lands on every impl alike. Each
model still sees its own batches in order (its loss curve is the one it would have alone);
``--interleave 0`` trains the cases one after another, and a model whose impl needs global patches
around its whole case (Liger's, in ``llama8``) always does. ``--repeats R`` trains every case of a
setting R times, the impls' order reversed every other round (torch, cukit, cukit, torch, ...):
``ms`` is then the median of the rounds' medians and ``speedup`` the median of the rounds' paired
ratios (``ms_rounds`` and ``speedup_rounds`` keep them); the loss curve and memory are the first
round's.

Columns (``<out>/<name>.json`` / ``.csv``; ``<name>`` is ``bench_models``, or with the models and
settings appended when a subset runs, so split runs do not overwrite each other):

| column | meaning |
|---|---|
| ``model``, ``setting``, ``mode``, ``precision``, ``impl`` | the case (see above) |
| ``params`` | parameter elements (tied weights counted once); ``cukit_modules``: modules of cukit classes |
| ``batch``, ``seq``, ``tokens_per_step`` | sequences (samples) and tokens per step (tokens: LMs only) |
| ``ms`` | median ms per step over the timed steps (``ms_p20``, ``ms_p80``, ``ms_min`` beside it) |
| ``tokens_per_s``, ``samples_per_s`` | per step / ``ms`` |
| ``first_step_s`` | wall time of step 1: torch.compile and cukit's NVRTC compiles land here, not in ``ms`` |
| ``state_mib`` | memory the case holds between steps after warm-up (parameters + optimizer state) |
| ``peak_mib`` | ``torch.cuda.max_memory_allocated`` over a block of timed steps minus the allocation at the block's start, the largest over the case's blocks (activations, gradients, workspaces: what a step needs above the state; impls trained side by side do not count each other's) |
| ``speedup`` | torch ``ms`` / this ``ms``, same setting, same run (> 1: faster than stock); with ``--repeats``, the median of the rounds' ratios |
| ``loss_rel_diff`` | max over steps of abs(loss - loss_torch) / abs(loss_torch), same setting |
| ``noise_floor`` | the largest of the same for torch eager against torch compiled, and for torch eager against ``--noise-seeds`` stock eager runs from weights moved by one rounding unit (``noise_samples``: all of them): how far two correct implementations drift apart (they round differently); on every row of that precision |
| ``within_noise`` | ``loss_rel_diff <= NOISE_MARGIN * noise_floor`` |
| ``losses`` | the loss curve (JSON list); ``loss_first``, ``loss_last`` |
| ``error`` | why a case has no numbers (exception, skipped: budget, transformers missing, lost CUDA context) |

Loss curves: the data are fixed before the first case (a Markov-chain token stream over 256
tokens for the LMs: learnable, so the curves fall and a wrong gradient shows; Gaussian class
clusters for the demo models, no scikit-learn needed), and every impl starts from the same
weights. GPT-2's dropout is set to 0: eager and compiled dropout draw different masks, which would
swamp the noise floor. The noise floor is the largest of a few samples of how far stock torch drifts
from itself (compiled, or started from weights one rounding unit away: bfloat16 neighbours, or
float32 weights scaled by 1 +- 2^-9 under autocast), and the within-noise check allows
``NOISE_MARGIN`` times it.

The summary is printed last: the table, then the targets as PASS/FAIL lines ("Llama-style decoder:
cukit >= 1.0x stock, eager and compiled, autocast and pure bf16; loss curves within the noise
floor" and "demo MLP/CNN cukit >= 1.0x"), then the failed or skipped cases and where the results
went. A failing case becomes a row with ``error`` and the run goes on; after an error that loses the
CUDA context nothing more is launched; a case that would start after ``--budget-s`` (or whose
predicted duration, from the previous case of the same model and mode, would overrun it) is skipped.
Results are saved after every model, so a run cut off by a time limit keeps what it finished.

The run's time goes mostly into ``torch.compile`` of the HF models (one cold compile per model,
setting and impl, each outside the timed steps). Where a call is time-limited, run the models in
separate calls (``--models llama``, ``--models mlp,cnn``, ``--models gpt2``; each writes its own
files), and keep ``--budget-s`` under the limit with room for one compile.

``--dry-run``: tiny configs (1-layer Llama/GPT-2 of width 64, batch 2 x 32 tokens; small demo
models), 4 steps, on the CPU with the "eager" torch.compile backend and one torch thread
(``--device cuda`` keeps the GPU and inductor). Numbers from a dry run mean nothing.

Results go to ``--out DIR``, else to a new temporary folder (printed); ``benchmarks/results/`` is
written only when named, never by ``--dry-run``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_models from the repository root
    from benchmarks import harness

NAME = "bench_models"
MODELS = ("llama", "mlp", "cnn", "gpt2", "llama8")
SETTINGS = ("eager-bf16", "compile-bf16", "eager-amp", "compile-amp")
TARGET_SPEEDUP = 1.0
LLAMA8_TARGET = 1.35  # issue 11: the 8-layer Llama end to end (Liger's own is 1.26x)
NOISE_MARGIN = 2.0
WEIGHT_DECAY = 0.01
MIB = 2**20

LLAMA_FULL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4)
LLAMA_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)
GPT2_TINY = dict(vocab_size=256, n_embd=64, n_layer=1, n_head=4, n_positions=64, bos_token_id=255,
                 eos_token_id=255)
LM_SHAPE, LM_SHAPE_DRY = (8, 512), (2, 32)  # (batch, tokens per sequence)
# issue 11's end-to-end model: the memory of a 128K vocabulary's logits dominates its step
LLAMA8_FULL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8)
LLAMA8_SHAPE = (4, 2048)
LM_LR = 6e-4  # GPT-2's; the demo models keep the demo's 1e-3
LR_WARMUP = 10  # steps of linear learning-rate warm-up: without it the LMs' loss spikes near step 35
# (both sides alike), and a spike's height, chaotic in the rounding, set the loss-curve comparison
DEMO_LR = 1e-3
DEMO_BATCH = 64  # the demo's default mini-batch
DEMO_ACTIVATION = "gelu"  # the demo's default
MLP_SIZES, MLP_SIZES_DRY = (64, 256, 256, 10), (64, 64, 64, 10)
CNN_CHANNELS, CNN_CHANNELS_DRY = (16, 32), (4, 8)
MARKOV_TOKENS = 256  # the LM data use this many distinct tokens (few enough to learn in 40 steps)
MARKOV_NOISE = 0.25  # probability that a token is drawn at random instead of following its successor


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    """Everything a run depends on; built from the command line by :func:`config_from_args`."""

    device: str = "cuda"
    models: tuple[str, ...] = MODELS
    settings: tuple[str, ...] = SETTINGS
    steps: int = 40
    warmup: int = 5
    budget_s: float = 450.0  # no case starts after this (0: none); room for one compile under a 10-min call
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    compile_policy: str = "inductor"  # cukit.torch.set_compile_policy for the cukit side
    patch_linear: bool = False  # cukit.nn.patch(linear=True, conv1d=True): every linear layer cukit's
    loss_accumulation: str | None = None  # the patched HF models' LinearCrossEntropyOptions.grad_accumulation
    loss_logits: str | None = None  # ... and its logits
    patch_off: tuple[str, ...] = ()  # cukit.nn.patch rules switched off on the cukit side (attribution)
    noise_seeds: int = 2  # stock eager runs from perturbed weights per precision (the noise floor)
    repeats: int = 1  # rounds of every case of a setting, the impls' order alternating
    interleave: int = 5  # a setting's impls trained side by side, timed steps alternating in blocks of this many (0: one after another)
    backward_thread: str = "worker"  # both sides: autograd's device thread (torch's default) or the caller
    dry_run: bool = False
    seed: int = 0
    out: str | None = None

    def compile_kwargs(self) -> dict[str, Any]:
        """The options every torch.compile call of the run gets (cukit and stock alike)."""
        kw: dict[str, Any] = {"backend": self.compile_backend}
        if self.compile_mode:
            kw["mode"] = self.compile_mode
        return kw


def _csv_list(text: str, allowed: Sequence[str], what: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"{NAME}: --{what} takes a comma-separated subset of {','.join(allowed)}; got {text!r}")
    return tuple(dict.fromkeys(items))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_out_argument(p)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {','.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=None, help="training steps per case (default 40; dry run 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5; dry run 1)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no case after this many seconds (default 450; dry run: none)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; "
                   "the CPU dry run uses 'eager')")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, the same for both sides")
    p.add_argument("--compile-policy", default=None, choices=("inductor", "kernels"),
                   help="cukit.torch.set_compile_policy for the cukit side (default inductor: matmul, "
                        "linear and elementwise ops traced as torch's ops; kernels: cukit's custom ops)")
    p.add_argument("--patch-linear", action="store_true",
                   help="cukit side: cukit.nn.patch(linear=True, conv1d=True), every linear layer cukit's "
                        "(default: only those with an activation to fuse)")
    p.add_argument("--loss-accumulation", default=None, choices=("float32", "input", "recompute"),
                   help="cukit side: grad_accumulation of the patched LM loss (model.cukit_loss_options; "
                        "default: cukit's default, float32)")
    p.add_argument("--loss-logits", default=None, choices=("float32", "input"),
                   help="cukit side: logits precision of the patched LM loss (default: the patch's, 'input': "
                        "the model's own rounding)")
    p.add_argument("--patch-off", default=None,
                   help="cukit side: comma-separated cukit.nn.patch rules to switch off (e.g. lm_head_loss,rope), "
                        "to attribute a difference to a rule")
    p.add_argument("--backward-thread", default="worker", choices=("worker", "caller"),
                   help="where both sides' backward runs: worker (autograd's device thread, torch's default) "
                        "or caller (torch.autograd.set_multithreading_enabled(False)) (default worker)")
    p.add_argument("--dry-run", action="store_true", help="tiny configs, CPU unless --device (smoke test)")
    p.add_argument("--device", default=None, help="torch device (default cuda; cpu with --dry-run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every case of a setting, the impls' order reversed every other round; "
                        "ms and speedup become medians over the rounds (default 1)")
    p.add_argument("--interleave", type=int, default=5,
                   help="train a setting's impls side by side, their timed steps alternating in blocks of "
                        "this many steps, so drift in the host's speed lands on all alike (default 5; 0: one "
                        "case after another, each alone on the device)")
    p.add_argument("--noise-seeds", type=int, default=2,
                   help="stock eager runs from weights perturbed by one rounding unit, per precision: "
                        "samples of the noise floor beside eager-vs-compiled (default 2; 0: none)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    if args.repeats < 1:
        raise SystemExit(f"{NAME}: --repeats must be >= 1")
    if args.interleave < 0:
        raise SystemExit(f"{NAME}: --interleave must be >= 0 (0: cases one after another)")
    cfg = Config(out=args.out, seed=args.seed, patch_linear=args.patch_linear, noise_seeds=args.noise_seeds,
                 repeats=args.repeats, interleave=args.interleave, loss_accumulation=args.loss_accumulation, loss_logits=args.loss_logits,
                 backward_thread=args.backward_thread,
                 patch_off=_patch_rules(args.patch_off),
                 models=_csv_list(args.models, MODELS, "models"),
                 settings=_csv_list(args.settings, SETTINGS, "settings"))
    if args.dry_run:
        cfg = replace(cfg, device="cpu", steps=4, warmup=1, budget_s=0.0, compile_backend="eager", dry_run=True)
        if args.device is not None and args.device.startswith("cuda"):
            cfg = replace(cfg, compile_backend="inductor")
    given = ("device", "steps", "warmup", "budget_s", "compile_backend", "compile_mode", "compile_policy")
    cfg = replace(cfg, **{k: getattr(args, k) for k in given if getattr(args, k) is not None})
    if cfg.steps < 2:
        raise SystemExit(f"{NAME}: --steps must be >= 2")
    return replace(cfg, warmup=max(0, min(cfg.warmup, cfg.steps - 1)))


def results_name(cfg: Config) -> str:
    """``bench_models`` for the full run, with the models / settings appended for a subset."""
    parts = [NAME]
    if set(cfg.models) != set(MODELS):
        parts.append("-".join(cfg.models))
    if set(cfg.settings) != set(SETTINGS):
        parts.append("-".join(cfg.settings))
    if cfg.compile_policy != "inductor" and any(s.startswith("compile") for s in cfg.settings):
        parts.append(f"policy-{cfg.compile_policy}")
    if cfg.patch_linear:
        parts.append("patch-linear")
    if cfg.loss_accumulation:
        parts.append(f"loss-{cfg.loss_accumulation}")
    if cfg.loss_logits:
        parts.append(f"logits-{cfg.loss_logits}")
    if cfg.patch_off:
        parts.append("off-" + "-".join(cfg.patch_off))
    if cfg.backward_thread != "worker":
        parts.append(f"backward-{cfg.backward_thread}")
    if cfg.interleave == 0:
        parts.append("alone")
    if cfg.repeats > 1:
        parts.append(f"x{cfg.repeats}")
    return "-".join(parts)


def _patch_rules(arg: str | None) -> tuple[str, ...]:
    """--patch-off's rule names, checked against cukit.nn.patch's rules."""
    if not arg:
        return ()
    from cukit.nn._patch import RULES

    names = tuple(x.strip() for x in arg.split(",") if x.strip())
    bad = [n for n in names if n not in RULES]
    if bad:
        raise SystemExit(f"{NAME}: --patch-off: unknown rule(s) {', '.join(bad)}; rules: {', '.join(RULES)}")
    return names


# ---------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


class ModelUnavailable(RuntimeError):
    """A model or an optional baseline cannot be built here (transformers or liger_kernel missing):
    its rows say so ("skipped: ..."), the run goes on."""


def _transformers() -> Any:
    try:
        import transformers
    except Exception as e:
        raise ModelUnavailable(
            f"skipped: transformers is not importable ({harness.short_error(e, 100)}); "
            "pip install transformers to run the Hugging Face models"
        ) from e
    with contextlib.suppress(Exception):
        transformers.logging.set_verbosity_error()  # config warnings would bury the summary
    return transformers


def cukit_patch(model: Any, every_linear: bool = False, off: tuple[str, ...] = ()) -> Any:
    """``cukit.nn.patch(model)`` in place (`every_linear`: ``linear=True, conv1d=True``; `off`: rules
    switched off); no stand-in when it is missing: the comparison would be void."""
    import cukit.nn

    patch = getattr(cukit.nn, "patch", None)
    if patch is None:
        raise RuntimeError("cukit.nn.patch is not available: this benchmark compares stock torch against "
                           "cukit.nn.patch(model) (issue 9) and uses no stand-in")
    switches = {"linear": True, "conv1d": True} if every_linear else {}
    out = patch(model, inplace=True, **switches, **{rule: False for rule in off})
    return model if out is None else out


def count_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def count_cukit_modules(model: Any) -> int:
    return sum(1 for m in model.modules() if type(m).__module__.split(".")[0] == "cukit")


def _loss_wrappers() -> tuple[type, type]:
    """The modules that return the loss: what gets compiled, so the loss is inside the graph."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class CausalLMLoss(nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: Any) -> Any:
            return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    class ClassifierLoss(nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: Any, y: Any) -> Any:
            return F.cross_entropy(self.model(x).float(), y)

    return CausalLMLoss, ClassifierLoss


@dataclass
class Workload:
    """One model: how to build each impl's fresh copy, its loss module, its data, its learning rate."""

    name: str
    title: str
    builders: dict[str, Callable[[], Any]]  # impl -> a fresh float32 model on the device
    wrap: Callable[[Any], Any]  # model -> module whose forward(*batch) returns the loss
    batches: list[tuple[Any, ...]]  # one per step
    lr: float
    batch: int
    seq: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    report_printed: bool = False
    # impl -> a context manager around its whole case (building included): global patches undone
    case_context: dict[str, Callable[[], Any]] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int | None:
        return self.batch * self.seq if self.seq else None

    def batches_for(self, precision: str) -> list[tuple[Any, ...]]:
        """The batches with floating inputs in bfloat16 for pure-bf16 runs (token ids unchanged)."""
        torch = _torch()
        if precision != "bf16":
            return self.batches
        return [tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in b) for b in self.batches]


def markov_tokens(steps: int, batch: int, seq: int, vocab: int, seed: int, device: str) -> list[tuple[Any]]:
    """Token batches from a fixed random successor table over ``MARKOV_TOKENS`` tokens spread over
    the vocabulary, with ``MARKOV_NOISE`` random tokens: a model learns it within tens of steps, so
    the loss curve has a slope to compare (random uniform tokens would sit at ln(vocab))."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    k = min(vocab, MARKOV_TOKENS)
    tokens = torch.randperm(vocab, generator=g)[:k]
    succ = torch.randperm(k, generator=g)
    n = steps * batch
    ids = torch.empty(n, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(k, (n,), generator=g)
    noise = torch.rand(n, seq, generator=g) < MARKOV_NOISE
    rand = torch.randint(k, (n, seq), generator=g)
    for t in range(1, seq):
        ids[:, t] = torch.where(noise[:, t], rand[:, t], succ[ids[:, t - 1]])
    data = tokens[ids].view(steps, batch, seq).to(device)
    return [(data[i],) for i in range(steps)]


def gaussian_classes(steps: int, batch: int, features: int, classes: int, seed: int,
                     device: str) -> list[tuple[Any, Any]]:
    """Batches of (x, y): x = the class mean + unit noise, means N(0, 1) in `features` dims."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed + 1)
    means = torch.randn(classes, features, generator=g)
    y = torch.randint(classes, (steps, batch), generator=g)
    x = means[y] + torch.randn(steps, batch, features, generator=g)
    x, y = x.to(device), y.to(device)
    return [(x[i], y[i]) for i in range(steps)]


def _seeded_on_device(cfg: Config, build: Callable[[], Any]) -> Any:
    torch = _torch()
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        return build()


def _patched_copy(base: Any, cfg: Config) -> Callable[[], Any]:
    def build() -> Any:
        model = cukit_patch(copy.deepcopy(base), cfg.patch_linear, cfg.patch_off)
        if cfg.loss_accumulation or cfg.loss_logits:
            import cukit

            model.cukit_loss_options = cukit.LinearCrossEntropyOptions(
                grad_accumulation=cfg.loss_accumulation or "float32", logits=cfg.loss_logits or "input")
        return model

    return build


def build_llama(cfg: Config) -> Workload:
    tf = _transformers()
    batch, seq = LM_SHAPE_DRY if cfg.dry_run else LM_SHAPE
    dims = LLAMA_TINY if cfg.dry_run else LLAMA_FULL
    config = tf.LlamaConfig(**dims, attn_implementation="sdpa", use_cache=False, loss_type="ForCausalLM")
    base = _seeded_on_device(cfg, lambda: tf.LlamaForCausalLM(config))
    lm_loss, _ = _loss_wrappers()
    d = dims
    return Workload(
        name="llama",
        title=(f"Llama-style decoder (HF LlamaForCausalLM, {d['num_hidden_layers']} layers x {d['hidden_size']}, "
               f"ffn {d['intermediate_size']}, {d['num_attention_heads']}/{d['num_key_value_heads']} heads, "
               f"vocab {d['vocab_size']}, sdpa), {batch} x {seq} tokens"),
        builders={"torch": lambda: copy.deepcopy(base), "cukit": _patched_copy(base, cfg)},
        wrap=lm_loss,
        batches=markov_tokens(cfg.steps, batch, seq, d["vocab_size"], cfg.seed, cfg.device),
        lr=LM_LR, batch=batch, seq=seq,
        meta={"config": {k: v for k, v in config.to_dict().items() if not isinstance(v, dict)},
              "transformers": tf.__version__},
    )


def _liger_llama(base: Any) -> Callable[[], Any]:
    """Liger-Kernel's Llama patch (rope, SwiGLU, RMSNorm, fused linear cross-entropy) on a copy of
    `base`; raises ModelUnavailable when liger_kernel is not importable."""
    def build() -> Any:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            raise ModelUnavailable(f"skipped: liger_kernel is not importable ({e})") from e
        model = copy.deepcopy(base)
        apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
        return model
    return build


@contextlib.contextmanager
def _restoring_llama_globals() -> Any:
    """Liger patches transformers' Llama module globally (the rotary function, the classes, the
    causal-LM forward): undo it after its case, so later stock cases run stock code."""
    import transformers.models.llama.modeling_llama as ml

    saved = dict(vars(ml))
    forwards = {c: c.forward for c in vars(ml).values() if isinstance(c, type) and "forward" in vars(c)}
    try:
        yield
    finally:
        for k in list(vars(ml)):
            if k not in saved:
                delattr(ml, k)
        for k, v in saved.items():
            setattr(ml, k, v)
        for c, f in forwards.items():
            c.forward = f


def build_llama8(cfg: Config) -> Workload:
    tf = _transformers()
    batch, seq = LM_SHAPE_DRY if cfg.dry_run else LLAMA8_SHAPE
    dims = LLAMA_TINY if cfg.dry_run else LLAMA8_FULL
    config = tf.LlamaConfig(**dims, attn_implementation="sdpa", use_cache=False, loss_type="ForCausalLM")
    base = _seeded_on_device(cfg, lambda: tf.LlamaForCausalLM(config))
    lm_loss, _ = _loss_wrappers()
    d = dims
    return Workload(
        name="llama8",
        title=(f"Llama 8-layer (HF LlamaForCausalLM, {d['num_hidden_layers']} layers x {d['hidden_size']}, "
               f"ffn {d['intermediate_size']}, {d['num_attention_heads']}/{d['num_key_value_heads']} heads, "
               f"vocab {d['vocab_size']}, sdpa), {batch} x {seq} tokens"),
        builders={"torch": lambda: copy.deepcopy(base), "liger": _liger_llama(base),
                  "cukit": _patched_copy(base, cfg)},
        wrap=lm_loss,
        batches=markov_tokens(cfg.steps, batch, seq, d["vocab_size"], cfg.seed, cfg.device),
        lr=LM_LR, batch=batch, seq=seq,
        meta={"config": {k: v for k, v in config.to_dict().items() if not isinstance(v, dict)},
              "transformers": tf.__version__},
        case_context={"liger": _restoring_llama_globals},
    )


def build_gpt2(cfg: Config) -> Workload:
    tf = _transformers()
    batch, seq = LM_SHAPE_DRY if cfg.dry_run else LM_SHAPE
    tiny = GPT2_TINY if cfg.dry_run else {}
    config = tf.GPT2Config(**tiny, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                           use_cache=False, loss_type="ForCausalLM")
    base = _seeded_on_device(cfg, lambda: tf.GPT2LMHeadModel(config))
    lm_loss, _ = _loss_wrappers()
    return Workload(
        name="gpt2",
        title=(f"GPT-2 small shapes (HF GPT2LMHeadModel, {config.n_layer} layers x {config.n_embd}, "
               f"{config.n_head} heads, vocab {config.vocab_size}, dropout 0, sdpa), {batch} x {seq} tokens"),
        builders={"torch": lambda: copy.deepcopy(base), "cukit": _patched_copy(base, cfg)},
        wrap=lm_loss,
        batches=markov_tokens(cfg.steps, batch, seq, config.vocab_size, cfg.seed, cfg.device),
        lr=LM_LR, batch=batch, seq=seq,
        meta={"config": {k: v for k, v in config.to_dict().items() if not isinstance(v, dict)},
              "transformers": tf.__version__},
    )


def build_mlp(cfg: Config) -> Workload:
    from cukit import demo

    sizes = MLP_SIZES_DRY if cfg.dry_run else MLP_SIZES
    stock, twin = demo.mlp_models(sizes, DEMO_ACTIVATION, device=cfg.device, seed=cfg.seed)
    _, cls_loss = _loss_wrappers()
    return Workload(
        name="mlp",
        title=f"demo MLP {'-'.join(map(str, sizes))} {DEMO_ACTIVATION}, batch {DEMO_BATCH}",
        builders={"torch": lambda: copy.deepcopy(stock), "cukit": _patched_copy(stock, cfg),
                  "cukit-demo": lambda: copy.deepcopy(twin)},
        wrap=cls_loss,
        batches=gaussian_classes(cfg.steps, DEMO_BATCH, sizes[0], sizes[-1], cfg.seed, cfg.device),
        lr=DEMO_LR, batch=DEMO_BATCH,
        meta={"sizes": list(sizes), "cukit-demo": "nn.Linear(bias=False) + cukit.nn.BiasAct (cukit.demo.mlp_models)"},
    )


def build_cnn(cfg: Config) -> Workload:
    from cukit import demo

    channels = CNN_CHANNELS_DRY if cfg.dry_run else CNN_CHANNELS
    stock, _ = demo.cnn_models(DEMO_ACTIVATION, channels=channels, device=cfg.device, seed=cfg.seed)
    _, cls_loss = _loss_wrappers()
    return Workload(
        name="cnn",
        title=(f"demo CNN 1x8x8, conv3x3 {'-'.join(map(str, channels))}, linear 10, {DEMO_ACTIVATION}, "
               f"batch {DEMO_BATCH}"),
        builders={"torch": lambda: copy.deepcopy(stock), "cukit": _patched_copy(stock, cfg)},
        wrap=cls_loss,
        batches=gaussian_classes(cfg.steps, DEMO_BATCH, 64, 10, cfg.seed, cfg.device),
        lr=DEMO_LR, batch=DEMO_BATCH,
        meta={"channels": list(channels),
              "cukit": "cukit.nn.patch: cukit.nn.Conv2d with the activation fused, cukit.nn.Linear head (the demo's "
                       "twin)"},
    )


BUILDERS: dict[str, Callable[[Config], Workload]] = {
    "llama": build_llama, "gpt2": build_gpt2, "mlp": build_mlp, "cnn": build_cnn, "llama8": build_llama8,
}
IMPLS: dict[str, tuple[str, ...]] = {
    "llama": ("torch", "cukit"), "gpt2": ("torch", "cukit"), "mlp": ("torch", "cukit", "cukit-demo"),
    "cnn": ("torch", "cukit"), "llama8": ("torch", "liger", "cukit"),
}


def make_optimizer(impl: str, params: list[Any], lr: float) -> Any:
    torch = _torch()
    if impl in ("torch", "liger"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
    import cukit.optim

    return cukit.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class Bench(harness.RunState):
    """State of one run: configuration, rows, failures, budget bookkeeping."""

    cfg: Config
    meta: dict[str, Any] = field(default_factory=dict)
    case_s: dict[tuple[str, str], float] = field(default_factory=dict)  # last duration per (model, mode)

    @property
    def cuda(self) -> bool:
        return self.cfg.device.startswith("cuda")

    def skip_reason(self, estimate_s: float = 0.0) -> str | None:
        """Why a case should not start: a lost CUDA context, or the budget (spent, or overrun by
        the case's predicted duration)."""
        return self.stop_reason(self.cfg.budget_s, estimate_s)

    def fail(self, row: dict[str, Any], exc: BaseException | str) -> None:
        where = f"{row.get('model')} {row.get('setting', '')} {row.get('impl', '')}"
        row["error"] = self.record_failure(where, str(exc) if isinstance(exc, ModelUnavailable) else exc)


def release_memory(cuda: bool) -> None:
    """Hand the last case's blocks back to the device (gc first: compiled graphs hold cycles). On the
    CPU there is no cache to empty, and a collection per case would dominate a dry run."""
    if cuda:
        harness.release_cuda_memory()


def _sync(cuda: bool) -> None:
    if cuda:
        _torch().cuda.synchronize()


def perturb_(model: Any, seed: int) -> None:
    """Every parameter moved by one rounding unit of the training precision, in a random direction
    per element: a bfloat16 parameter to its neighbouring bfloat16 value, a float32 one (autocast,
    whose matmuls round to bfloat16) by a factor 1 +- 2^-9, bfloat16's half unit. Two correct
    implementations differ by roundings of this size; how far such a start drifts is the noise."""
    torch = _torch()
    g = torch.Generator().manual_seed(10_007 + seed)
    with torch.no_grad():
        for p in model.parameters():
            up = (torch.rand(p.shape, generator=g) < 0.5).to(p.device)
            if p.dtype == torch.bfloat16:
                p.copy_(torch.where(up, torch.nextafter(p, p.new_tensor(math.inf)),
                                    torch.nextafter(p, p.new_tensor(-math.inf))))
            else:
                p.mul_(torch.where(up, 1.0 + 2.0**-9, 1.0 - 2.0**-9).to(p.dtype))


@dataclass
class _Case:
    """One (model, setting, impl) being trained: what :func:`run_steps` advances and
    :func:`finish_case` reports into `row`."""

    impl: str
    row: dict[str, Any]
    fn: Any  # the (compiled) loss module
    opt: Any
    sched: Any
    batches: list[tuple[Any, ...]]
    losses: Any  # device tensor, one loss per step
    autocast: Callable[[], Any]
    held: tuple[Any, ...]  # the model and loss module, dropped by finish_case
    mem0: int
    times_ms: list[float] = field(default_factory=list)
    done: int = 0  # steps run so far
    base_mem: int | None = None  # allocated once the warm-up steps are done (state, no gradients)
    peak: int = 0  # the most any timed block allocated above its start


def _own_forward(module: Any) -> Any:
    """`module` with a forward of its own code object: dynamo keeps its compiled graphs per code
    object, so cases trained side by side (interleaved) each find their own graph first instead of
    failing the others' guards on every call."""
    cls = type(module)
    f = cls.forward
    fresh = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    module.__class__ = type(cls.__name__, (cls,), {"forward": fresh, "__module__": cls.__module__})
    return module


def start_case(b: Bench, work: Workload, setting: str, impl: str, row: dict[str, Any],
               perturb: int | None = None) -> _Case:
    """Build one case (model, loss module, optimizer, schedule, compile): nothing run yet.
    `perturb`: start from weights moved by one rounding unit (:func:`perturb_`, this seed)."""
    torch = _torch()
    cfg = b.cfg
    mode, precision = setting.split("-")
    device_type = torch.device(cfg.device).type
    mem0 = torch.cuda.memory_allocated() if b.cuda else 0
    torch.manual_seed(cfg.seed)
    model = work.builders[impl]()
    if impl.startswith("cukit"):
        report = getattr(model, "cukit_patch_report", None)
        if report is not None and not work.report_printed:
            print(f"  cukit.nn.patch report ({work.name}):\n    " + str(report).replace("\n", "\n    "), flush=True)
            b.meta.setdefault("patch_reports", {})[work.name] = str(report)
            work.report_printed = True
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if perturb is not None:
        perturb_(model, perturb)
    loss_module = work.wrap(model).train()
    row["params"] = count_params(loss_module)
    row["cukit_modules"] = count_cukit_modules(loss_module)
    opt = make_optimizer(impl, list(loss_module.parameters()), work.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / LR_WARMUP))
    fn = loss_module
    if mode == "compile":
        import cukit.torch

        cukit.torch.set_compile_policy(cfg.compile_policy)
        fn = torch.compile(_own_forward(loss_module), **cfg.compile_kwargs())

    def autocast() -> Any:
        if precision == "amp":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    losses = torch.empty(cfg.steps, dtype=torch.float32, device=cfg.device)
    return _Case(impl, row, fn, opt, sched, work.batches_for(precision), losses, autocast,
                 (model, loss_module), mem0)


def run_steps(b: Bench, case: _Case, n: int) -> None:
    """The case's next `n` training steps, each timed between two device synchronisations. Its
    timed steps (after ``cfg.warmup``) run in blocks: the peak allocation of a block is measured
    from the block's own start, so cases trained side by side do not count each other's memory."""
    torch = _torch()
    cfg = b.cfg
    fn, opt, sched, batches, losses = case.fn, case.opt, case.sched, case.batches, case.losses
    block_base = None
    for i in range(case.done, case.done + n):
        if i == cfg.warmup:
            _mark_state(b, case)
        if i >= cfg.warmup and block_base is None:
            _sync(b.cuda)
            if b.cuda:  # state settled: params, optimizer state; grads are None
                block_base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            else:
                block_base = 0
        _sync(b.cuda)
        t0 = time.perf_counter()
        with case.autocast():
            loss = fn(*batches[i])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses[i] = loss.detach()
        _sync(b.cuda)
        case.times_ms.append((time.perf_counter() - t0) * 1e3)
        del loss
    case.done += n
    if case.done == cfg.warmup:  # warmed up alone (side by side: before the next case is built)
        _mark_state(b, case)
    if block_base is not None and b.cuda:
        case.peak = max(case.peak, torch.cuda.max_memory_allocated() - block_base)


def _mark_state(b: Bench, case: _Case) -> None:
    """The case's state (params, optimizer state, no gradients) as allocated now, once."""
    if case.base_mem is None and b.cuda:
        _sync(b.cuda)
        case.base_mem = _torch().cuda.memory_allocated()


def finish_case(b: Bench, case: _Case) -> None:
    """Fill the case's row with its numbers (all ``cfg.steps`` steps run) and drop its model."""
    cfg = b.cfg
    timed = sorted(case.times_ms[cfg.warmup:])
    curve = [float(v) for v in case.losses.tolist()]
    ms = statistics.median(timed)
    work_batch, tokens = case.row.get("batch"), case.row.get("tokens_per_step")
    case.row.update(
        ms=ms, ms_p20=harness.quantile(timed, 0.2), ms_p80=harness.quantile(timed, 0.8), ms_min=timed[0],
        timed_steps=len(timed), first_step_s=case.times_ms[0] / 1e3,
        samples_per_s=work_batch * 1e3 / ms if work_batch else None,
        tokens_per_s=tokens * 1e3 / ms if tokens else None,
        loss_first=curve[0], loss_last=curve[-1], losses=curve,
    )
    if b.cuda and case.base_mem is not None:
        case.row["state_mib"] = (case.base_mem - case.mem0) / MIB
        case.row["peak_mib"] = case.peak / MIB
    if not all(math.isfinite(v) for v in curve):
        case.row["note"] = "non-finite loss"
    case.fn = case.opt = case.sched = case.losses = None
    case.held = ()


def train_case(b: Bench, work: Workload, setting: str, impl: str, row: dict[str, Any],
               perturb: int | None = None) -> None:
    """Train one (model, setting, impl) for ``cfg.steps`` steps, alone; fill `row` with its numbers
    (:func:`train_cases` with one case, whose exception it raises).
    `perturb`: start from weights moved by one rounding unit (:func:`perturb_`, this seed)."""
    error = train_cases(b, work, setting, [(impl, row)], b.cfg.steps, perturb).get(impl)
    if error is not None:
        raise error


def train_cases(b: Bench, work: Workload, setting: str, cases: Sequence[tuple[str, dict[str, Any]]],
                block: int, perturb: int | None = None) -> dict[str, BaseException]:
    """Train impls of one setting side by side: each is built and warmed up in turn, then their
    timed steps alternate in blocks of `block` steps (the order reversed every other block), so a
    drift in the host's speed lands on every impl alike. Each model still sees its own batches in
    order, so the loss curves are those of cases trained alone. Fills each row; returns the impls
    that failed, with their exceptions (the others go on). `perturb`: see :func:`start_case`."""
    torch = _torch()
    cfg = b.cfg
    compiled = setting.startswith("compile")
    errors: dict[str, BaseException] = {}
    live: list[_Case] = []
    if compiled:
        torch._dynamo.reset()  # no guards, caches or recompile counts carried over from the last cases
    try:
        for impl, row in cases:
            try:
                _row_shape(row, work)
                case = start_case(b, work, setting, impl, row, perturb)
                live.append(case)
                run_steps(b, case, cfg.warmup)
            except Exception as e:
                errors[impl] = e
        live = [c for c in live if c.impl not in errors]
        k = 0
        while any(c.done < cfg.steps for c in live):
            for case in live if k % 2 == 0 else live[::-1]:
                if case.impl in errors or case.done >= cfg.steps:
                    continue
                try:
                    run_steps(b, case, min(block, cfg.steps - case.done))
                except Exception as e:
                    errors[case.impl] = e
                    case.done = cfg.steps
            k += 1
        for case in live:
            if case.impl not in errors:
                finish_case(b, case)
    finally:
        live.clear()
        if compiled:
            torch._dynamo.reset()  # drop the compiled graphs (they hold the models)
    return errors


def _row_shape(row: dict[str, Any], work: Workload) -> None:
    row.setdefault("batch", work.batch)
    row.setdefault("tokens_per_step", work.tokens_per_step)


def loss_rel_diff(a: Sequence[float] | None, ref: Sequence[float] | None) -> float | None:
    """max_i |a_i - ref_i| / |ref_i|; inf when a curve has a non-finite value; None without both curves."""
    if not a or not ref or len(a) != len(ref):
        return None
    worst = 0.0
    for x, r in zip(a, ref, strict=True):
        if not (math.isfinite(x) and math.isfinite(r)):
            return math.inf
        worst = max(worst, abs(x - r) / max(abs(r), 1e-12))
    return worst


def compare_setting(rows: list[dict[str, Any]]) -> None:
    """speedup and loss_rel_diff of every row of one (model, setting) against its torch row."""
    ref = next((r for r in rows if r["impl"] == "torch" and r.get("ms")), None)
    if ref is None:
        return
    for r in rows:
        if r.get("ms"):
            r["speedup"] = ref["ms"] / r["ms"]
            r["loss_rel_diff"] = loss_rel_diff(r.get("losses"), ref.get("losses"))
            a, b = ref.get("ms_rounds", []), r.get("ms_rounds", [])
            if len(a) > 1 and len(a) == len(b):  # paired rounds: the ratio of each, then their median
                r["speedup_rounds"] = [x / y for x, y in zip(a, b, strict=True)]
                r["speedup"] = statistics.median(r["speedup_rounds"])


def noise_floors(rows: list[dict[str, Any]], perturbed: dict[str, list[list[float]]] | None = None) -> None:
    """Per precision of one model, the noise floor: the largest of torch eager against torch
    compiled and of torch eager against its runs from perturbed weights (`perturbed`: precision ->
    loss curves), written on every row of that precision with its samples, and each row's
    within-noise verdict."""
    for precision in ("bf16", "amp"):
        sel = [r for r in rows if r.get("precision") == precision]
        curves = {r["mode"]: r.get("losses") for r in sel if r["impl"] == "torch" and r.get("losses")}
        samples = [loss_rel_diff(curves.get("compile"), curves.get("eager"))]
        samples += [loss_rel_diff(c, curves.get("eager")) for c in (perturbed or {}).get(precision, [])]
        got = [x for x in samples if x is not None]
        floor = max(got) if got else None
        for r in sel:
            r["noise_floor"] = floor
            r["noise_samples"] = got
            d = r.get("loss_rel_diff")
            if r["impl"] != "torch" and d is not None and floor is not None:
                r["within_noise"] = bool(d <= NOISE_MARGIN * floor)


def run_model(b: Bench, name: str) -> list[dict[str, Any]]:
    """Every selected setting and impl of one model; never raises for a failing case."""
    cfg = b.cfg
    settings = sorted(cfg.settings, key=lambda s: (s.startswith("compile"), SETTINGS.index(s)))  # eager first
    rows = [{"model": name, "setting": s, "mode": s.split("-")[0], "precision": s.split("-")[1], "impl": i}
            for s in settings for i in IMPLS[name]]
    reason = b.skip_reason()
    work: Workload | None = None
    if reason is None:
        try:
            work = BUILDERS[name](cfg)
        except ModelUnavailable as e:
            reason = str(e)
        except Exception as e:
            reason = f"building the model failed: {harness.short_error(e)}"
            if harness.is_fatal_cuda_error(e):
                b.fatal = reason
    if work is None:
        for r in rows:
            b.fail(r, reason or "skipped")
        return rows
    print(f"\n{work.title}", flush=True)
    b.meta.setdefault("models", {})[name] = {"title": work.title, **work.meta}
    for s in settings:
        srows = [r for r in rows if r["setting"] == s]
        for row in srows:
            row.update(batch=work.batch, seq=work.seq, tokens_per_step=work.tokens_per_step,
                       steps=cfg.steps, warmup=cfg.warmup)
        mode = s.split("-")[0]

        def done(row: dict[str, Any], rnd: int, into: dict[str, Any], exc: BaseException | None) -> None:
            if exc is None:
                row.setdefault("ms_rounds", []).append(into["ms"])
                _progress(into if rnd == 0 else {**row, "ms": into["ms"]})
            elif rnd == 0:
                b.fail(row, exc)
                print(f"  {name:5s} {row['setting']:12s} {row['impl']:10s} ERROR {row['error'][:120]}", flush=True)
            else:  # a later round's failure: the rounds so far stand, paired ones only
                row["note"] = f"round {rnd + 1} failed: {harness.short_error(exc)}"

        # side by side unless an impl needs a context around its whole case (global patches)
        together = cfg.interleave > 0 and len(srows) > 1 and not any(r["impl"] in work.case_context for r in srows)
        for rnd in range(cfg.repeats):
            order = [r for r in (srows if rnd % 2 == 0 else srows[::-1]) if not rnd or "ms_rounds" in r]
            for group in [order] if together else [[r] for r in order]:
                reason = b.skip_reason(b.case_s.get((name, mode), 0.0) * len(group))
                if reason:
                    for row in group:
                        if rnd == 0:
                            b.fail(row, reason)
                    continue
                t0 = time.perf_counter()
                intos = [row if rnd == 0 else {} for row in group]
                context = contextlib.nullcontext if together else work.case_context.get(group[0]["impl"],
                                                                                          contextlib.nullcontext)
                with context():
                    errors = train_cases(b, work, s, [(r["impl"], i) for r, i in zip(group, intos, strict=True)],
                                         cfg.interleave if together else cfg.steps)
                for row, into in zip(group, intos, strict=True):
                    done(row, rnd, into, errors.get(row["impl"]))
                b.case_s[(name, mode)] = (time.perf_counter() - t0) / len(group)
                release_memory(b.cuda)
        rounds = min((len(r.get("ms_rounds", [])) for r in srows if "ms_rounds" in r), default=0)
        for row in srows:
            if "ms_rounds" in row:
                row["ms_rounds"] = row["ms_rounds"][:rounds]
                if rounds > 1:
                    row["ms"] = statistics.median(row["ms_rounds"])
        compare_setting(srows)
    noise_floors(rows, perturbed_curves(b, work, name, rows))
    del work
    release_memory(b.cuda)
    return rows


def perturbed_curves(b: Bench, work: Workload, name: str, rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Stock eager runs from perturbed weights (``cfg.noise_seeds`` per precision with a stock
    eager row): their loss curves by precision. Untimed for the table; a failure only drops the
    sample (recorded)."""
    out: dict[str, list[list[float]]] = {}
    for r in rows:
        if r["impl"] != "torch" or r["mode"] != "eager" or not r.get("losses"):
            continue
        for seed in range(b.cfg.noise_seeds):
            if b.skip_reason(b.case_s.get((name, "eager"), 0.0)):
                break
            extra: dict[str, Any] = {}
            try:
                train_case(b, work, r["setting"], "torch", extra, perturb=seed)
                out.setdefault(r["precision"], []).append(extra["losses"])
            except Exception as e:
                b.record_failure(f"{name} {r['setting']} noise sample {seed}", e)
            release_memory(b.cuda)
    return out


def _progress(r: dict[str, Any]) -> None:
    tok = f"  {r['tokens_per_s'] / 1e3:8.1f}K tok/s" if r.get("tokens_per_s") else ""
    mem = f"  peak +{r['peak_mib']:.0f} MiB" if r.get("peak_mib") is not None else ""
    print(f"  {r['model']:5s} {r['setting']:12s} {r['impl']:10s} {r['ms']:9.3f} ms/step{tok}  "
          f"first step {r['first_step_s']:.1f} s{mem}  loss {r['loss_first']:.4g} -> {r['loss_last']:.4g}",
          flush=True)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

TABLE_COLUMNS: list[str | tuple[str, str]] = [
    "model", "setting", "impl", ("ms", "ms/step"), ("tokens_per_s", "tok/s"), ("first_step_s", "1st step s"),
    ("peak_mib", "peak MiB"), ("speedup", "torch/this"), ("loss_rel_diff", "loss diff"),
    ("noise_floor", "noise floor"), ("within_noise", "in noise"), ("cukit_modules", "cukit mods"), "error",
]
_FMT = {"error": lambda v: "" if v is None else str(v)[:60]}


def _fmt_x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _fmt_e(v: Any) -> str:
    return f"{v:.1e}" if isinstance(v, (int, float)) and v is not None else "-"


def target_lines(rows: Sequence[dict[str, Any]], cfg: Config) -> list[str]:
    """The targets as PASS/FAIL lines, with the numbers behind each verdict."""
    out: list[str] = []
    settings = [s for s in SETTINGS if s in cfg.settings]
    partial = "" if len(settings) == len(SETTINGS) else f" (only {','.join(settings)} selected)"

    def cukit_row(model: str, setting: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["model"] == model and r["setting"] == setting and r["impl"] == "cukit"),
                    None)

    head = ("Llama-style decoder: cukit >= 1.0x stock, eager and compiled, autocast and pure bf16; "
            "loss curves within the noise floor")
    if "llama" not in cfg.models:
        out.append(f"  [n/a ] {head}: llama not selected")
    else:
        speed, loss, ok = [], [], True
        for s in settings:
            r = cukit_row("llama", s) or {}
            sp, d, fl, within = r.get("speedup"), r.get("loss_rel_diff"), r.get("noise_floor"), r.get("within_noise")
            ok &= isinstance(sp, float) and sp >= TARGET_SPEEDUP and within is True
            speed.append(f"{s} {_fmt_x(sp)}")
            loss.append(f"{s} {_fmt_e(d)} vs {_fmt_e(fl)} {'ok' if within else 'NO' if within is False else '-'}")
        out.append(f"  [{'PASS' if ok else 'FAIL'}] {head}{partial}")
        out.append("      speed (torch ms / cukit ms): " + ", ".join(speed))
        out.append(f"      loss (max rel diff cukit vs torch | torch eager vs compiled, allowed {NOISE_MARGIN:g}x): "
                   + ", ".join(loss))
    head = "demo MLP/CNN cukit >= 1.0x"
    demo_models = [m for m in ("mlp", "cnn") if m in cfg.models]
    if not demo_models:
        out.append(f"  [n/a ] {head}: mlp and cnn not selected")
    else:
        parts, ok = [], True
        for m in demo_models:
            vals = []
            for s in settings:
                sp = (cukit_row(m, s) or {}).get("speedup")
                ok &= isinstance(sp, float) and sp >= TARGET_SPEEDUP
                vals.append(f"{s} {_fmt_x(sp)}")
            parts.append(f"{m}: " + ", ".join(vals))
        miss = [m for m in ("mlp", "cnn") if m not in demo_models]
        extra = f" ({', '.join(miss)} not selected)" if miss else ""
        out.append(f"  [{'PASS' if ok else 'FAIL'}] {head}{partial}{extra}")
        out.extend(f"      {p}" for p in parts)
    head = (f"8-layer Llama: cukit >= {LLAMA8_TARGET:g}x stock and ahead of Liger, peak memory at or below "
            "Liger's (issue 11)")
    if "llama8" not in cfg.models:
        out.append(f"  [n/a ] {head}: llama8 not selected")
    else:
        for s in settings:
            by = {r["impl"]: r for r in rows if r["model"] == "llama8" and r["setting"] == s}
            ck, lg = by.get("cukit", {}), by.get("liger", {})
            sp, lsp = ck.get("speedup"), lg.get("speedup")
            mem, lmem = ck.get("peak_mib"), lg.get("peak_mib")
            ok = (isinstance(sp, float) and sp >= LLAMA8_TARGET and (not isinstance(lsp, float) or sp > lsp)
                  and (not isinstance(lmem, float) or (isinstance(mem, float) and mem <= lmem)))
            out.append(f"  [{'PASS' if ok else 'FAIL'}] {head}, {s}")
            out.append(f"      speed vs stock: cukit {_fmt_x(sp)}, liger {_fmt_x(lsp)}; peak MiB above state: "
                       f"cukit {mem if mem is None else round(mem)}, liger {lmem if lmem is None else round(lmem)}"
                       + ("" if lg.get("error") is None else f" (liger: {str(lg['error'])[:80]})"))
    return out


def print_summary(b: Bench, env: dict[str, Any], saved: list[str]) -> None:
    """The headline, printed last (the device tool returns only the end of the output)."""
    cfg = b.cfg
    print()
    print("=" * 110)
    print(f"SUMMARY {NAME}: {env.get('gpu') or 'CPU (dry run: numbers mean nothing)'} | torch {env.get('torch')} | "
          f"transformers {b.meta.get('transformers')} | commit {str(env.get('git_commit'))[:12]} | "
          f"{b.elapsed():.0f} s")
    print(f"{cfg.steps} steps per case ({cfg.warmup} untimed), torch.compile {cfg.compile_kwargs()}; "
          "torch: torch.optim.AdamW(fused=True); cukit: cukit.nn.patch + cukit.optim.AdamW")
    harness.print_table(b.rows, TABLE_COLUMNS, formatters=_FMT,
                        title="\nms/step: median over timed steps; torch/this > 1: faster than stock; "
                              "loss diff / noise floor: max relative loss-curve difference")
    notes = [f"{r['model']} {r['setting']} {r['impl']}: {r['note']}" for r in b.rows if r.get("note")]
    torch_params = {(r["model"], r["setting"]): r.get("params") for r in b.rows if r["impl"] == "torch"}
    for r in b.rows:  # patch must share parameters: a different count means a weight was copied or untied
        p0 = torch_params.get((r["model"], r["setting"]))
        if r["impl"] == "cukit" and r.get("params") and p0 and r["params"] != p0:
            notes.append(f"{r['model']} {r['setting']} cukit: {r['params']} parameter elements vs torch's {p0} "
                         "(did patch untie a shared weight?)")
    for n in notes:
        print(f"note: {n}")
    print("\ntargets:")
    for line in target_lines(b.rows, cfg):
        print(line)
    harness.print_outcome(b.failures, saved)


def loss_plot_points(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (row, step) for the loss-curve plot."""
    return [{"model": r["model"], "precision": r["precision"], "series": f"{r['impl']} {r['mode']}",
             "step": i, "loss": v}
            for r in rows if r.get("losses") for i, v in enumerate(r["losses"])]


def save(b: Bench, env: dict[str, Any], out: str | None, final: bool) -> list[str]:
    """JSON + CSV (after every model and at the end), the loss-curve plot at the end."""
    if out == "-":
        return []
    name = results_name(b.cfg)
    meta = {**b.meta, "config": {k: v for k, v in vars(b.cfg).items()}, "failures": b.failures,
            "elapsed_s": b.elapsed(), "complete": final,
            "targets": {"speedup": TARGET_SPEEDUP, "noise_margin": NOISE_MARGIN}}
    paths = [str(p) for p in harness.save_results(b.rows, name, out, env=env, meta=meta)]
    if final:
        from pathlib import Path

        png = harness.plot(loss_plot_points(b.rows), Path(paths[0]).with_suffix(".png"),
                           x="step", y="loss", series="series", panels=("model", "precision"), logx=False,
                           xlabel="step", ylabel="training loss",
                           title=f"loss curves: {env.get('gpu') or 'CPU dry run'}")
        if png is not None:
            paths.append(str(png))
    return paths


def run(cfg: Config) -> Bench:
    """Every selected model; never raises for a failing case."""
    torch = _torch()
    cfg = harness.with_results_dir(cfg, NAME)
    b = Bench(cfg)
    with contextlib.suppress(Exception):
        import transformers

        b.meta["transformers"] = transformers.__version__
    b.meta["compile_policy"] = cfg.compile_policy
    b.meta["patch_linear"] = cfg.patch_linear
    b.meta["loss_accumulation"] = cfg.loss_accumulation
    b.meta["loss_logits"] = cfg.loss_logits
    b.meta["patch_off"] = list(cfg.patch_off)
    b.meta["backward_thread"] = cfg.backward_thread
    if any(s.startswith("compile") for s in cfg.settings):
        harness.configure_dynamo()
    env = harness.environment()
    print(f"{NAME}: {env.get('gpu') or cfg.device} | torch {torch.__version__} | models {','.join(cfg.models)} | "
          f"settings {','.join(cfg.settings)} | {cfg.steps} steps | backward on the {cfg.backward_thread} thread | "
          f"compile {cfg.compile_kwargs()} "
          f"(cukit policy {cfg.compile_policy}) | "
          f"budget {cfg.budget_s:.0f} s", flush=True)
    saved: list[str] = []
    # thread-local, so it holds for every step below (and is restored when the run returns)
    with torch.autograd.set_multithreading_enabled(cfg.backward_thread == "worker"):
        _run_models(b, env, cfg)
    try:
        saved = save(b, env, cfg.out, final=True)
    except Exception as e:
        b.failures.append(f"saving results: {harness.short_error(e)}")
    print_summary(b, env, saved)
    return b


def _run_models(b: Bench, env: dict[str, Any], cfg: Config) -> None:
    for name in cfg.models:
        try:
            b.rows.extend(run_model(b, name))
        except Exception as e:  # a bug in the runner itself: recorded, the run goes on
            row = {"model": name, "setting": "-", "impl": "-"}
            b.fail(row, e)
            b.rows.append(row)
        try:
            save(b, env, cfg.out, final=False)
        except Exception as e:
            b.failures.append(f"saving results: {harness.short_error(e)}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; 0 when the run completed (failed cases are reported, not fatal)."""
    cfg = config_from_args(parse_args(argv))
    return harness.main_run(NAME, cfg, run)


if __name__ == "__main__":
    sys.exit(main())
