"""Fused linear + cross-entropy: ``cross_entropy(input @ linear_weight.T + linear_bias, target)``
without ever storing the tokens x vocabulary logits.

Kernels: ``raw_kernels/cross_entropy.cu`` (the row kernels) and the GEMMs of
``cukit.ops.matmul.gemm``. The NumPy and torch references below are the CPU fallbacks and the test
oracles. torch registration (autograd, torch.compile, CUDA graphs, autocast):
``cukit/torch/linear_cross_entropy.py``.

The GPU path works in chunks of ``Tc`` tokens (see :class:`LinearCrossEntropyOptions`). Per chunk:

1. ``logits = x_c @ W^T`` into a workspace of ``Tc`` rows: float32 (float64 for float64 inputs),
   or, with ``logits="input"``, the input's 16-bit dtype (the product rounded once, as ``F.linear``
   rounds it: half the bytes per token);
2. ``ce_rows`` (one block per row): the row's log-sum-exp, its loss and, when gradients are
   wanted, ``g = d loss / d logits`` (bias, soft-capping, z-loss, label smoothing, class weights
   and ignore_index included), written in the input dtype over the workspace row it was read from;
3. ``dx_c = g_c @ W`` (rows of dx) and ``dW += g_c^T @ x_c``; ``db += column sums of g_c``.
   Where the gradients of all tokens take no more memory than a float32 dW (16-bit inputs,
   tokens <= 2 x hidden: :func:`stores_logit_grads`), ce_rows writes ``g_c`` into a buffer of
   every token's gradient instead, and the backward makes dW from it in one GEMM over all tokens.

For 'mean' and 'sum' the gradients come out of the forward pass (three GEMMs in all, no
recomputation), unscaled: the reduction's scale (a device scalar from ``ce_stats``, computed
before the chunk loop, so there is no host sync) and the upstream gradient are applied once, in
the backward, when the float32 accumulators are rounded to the parameters' dtypes. For 'none' (the
upstream gradient is per token) and for a differentiated lse the backward recomputes the logits
chunk by chunk from the saved lse (one pass: four GEMMs in all).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from cukit._device import device_caps, sm_count
from cukit._runtime import KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    NotAnArrayError,
    array_class,
    array_kind,
    as_arrays,
    current_stream,
    device_of,
    dtype_name,
    not_an_array_error,
    type_name,
)
from cukit.ops import matmul as _matmul

__all__ = [
    "ACCUMULATIONS",
    "DEFAULT_WORKSPACE_BYTES",
    "REDUCTIONS",
    "LinearCrossEntropyOptions",
    "linear_cross_entropy",
    "reference_grad_torch",
    "reference_numpy",
    "reference_torch",
]

FN = "cukit.linear_cross_entropy"
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
TARGET_DTYPES = ("int64", "int32")
REDUCTIONS: dict[str, int] = {"none": 0, "mean": 1, "sum": 2}
ACCUMULATIONS = ("float32", "input", "recompute")
LOGITS = ("float32", "input")
DEFAULT_WORKSPACE_BYTES = 256 << 20
# "recompute": the second pass's workspace (every token's logits for a block of classes) when
# workspace_bytes is None, and the fewest classes per block
RECOMPUTE_BLOCK_BYTES = 64 << 20
_MIN_VOCAB_BLOCK = 128
IGNORE_INDEX = -100  # ignore_index=None, as torch maps it

# ce_rows modes (enum Mode in cross_entropy.cu)
MODE_LOSS, MODE_GRAD, MODE_REGRAD = 0, 1, 2


def _acc_name(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def logits_dtype(dtype: str, logits: str = "float32") -> str:
    """dtype of the chunk's logits workspace for inputs of `dtype` (see the option `logits`): the
    input's own for 16-bit inputs with ``logits="input"``, else the accumulator's."""
    return dtype if logits == "input" and dtype in ("float16", "bfloat16") else _acc_name(dtype)


def _vec(wdt: str) -> int:
    """Elements of `wdt` in the row kernels' 16-byte vectors."""
    return 16 // DTYPES[wdt].itemsize


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        t, a = DTYPES[name].ctype, DTYPES[_acc_name(name)].ctype
        ws = (a, t) if t != a else (a,)  # the workspace: A, or the 16-bit T (logits="input")
        exprs = [f"ce_rows<{t}, {w}, {y}, {m}>" for w in ws for y in ("long long", "int") for m in (0, 1, 2)]
        exprs.append(f"ce_colsum<{t}>")
        for v in (4, 1):  # the vector path and the scalar path
            exprs.append(f"scale_cast<{a}, {t}, {v}>")
            if a != t:
                exprs.append(f"scale_cast<{t}, {t}, {v}>")
        groups[name] = exprs
    # the accumulator-level kernels, shared by every input dtype of one accumulator type
    groups["reduce"] = [
        *(f"ce_stats<{a}, {y}>" for a in ("float", "double") for y in ("long long", "int")),
        *(f"ce_total<{a}>" for a in ("float", "double")),
        *(f"ce_colsum_finish<{a}>" for a in ("float", "double")),
    ]
    return groups


KERNELS = KernelModule(
    "cross_entropy.cu",
    instantiations=_instantiations(),
    signatures={
        # the first column (col0) is given per call, after the pointers
        "ce_rows": "ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr i64 i64 i64 i64 i64 i64 i64 f64 f64 f64",
        "ce_stats": "ptr ptr ptr i64 i64 i64 i32",
        "ce_total": "ptr ptr ptr i64",
        "ce_colsum": "ptr ptr i64 i64 i64 i64",
        "ce_colsum_finish": "ptr ptr i64 i64 i32",
        "scale_cast": "ptr ptr ptr ptr i64 f64",
    },
)

# ce_rows_held (compute capability 9.0): a cluster of CL CTAs holds a row in registers, R x 4 floats
# per thread, so the row is read once (ce_rows reads it twice: at large vocabularies the second
# read misses L2). (CL, R) pairs in order of preference: R = 8 fits two CTAs per SM. The kernel
# loads 16-byte vectors of the workspace: R vectors of 4 floats, or R / 2 of 8 16-bit logits.
HELD_CONFIGS = ((2, 8), (4, 8), (8, 8), (8, 16))
# Below this many classes ce_rows' resident rows (blocks x V x 4 bytes) fit in L2, and its second
# read of a row hits there: the held kernel's cluster exchange would cost more than it saves.
HELD_MIN_VOCAB = 16384
_HELD_THREADS = 512
# Clusters per SM of a ce_rows_held launch, each looping over rows: a cluster per row spends more
# on launching its CTAs than on its row, and exactly the resident clusters leave SMs idle while
# one waits at its barriers; a few times that many measured fastest (benchmarks/NOTES.md, "held
# rows' clusters").
_HELD_CLUSTERS_PER_SM = 2

KERNELS_SM90 = KernelModule(
    "cross_entropy.cu",
    instantiations={
        f"{name}/held": [f"ce_rows_held<{DTYPES[name].ctype}, {DTYPES[wdt].ctype}, {y}, {cl}, {r * 4 // _vec(wdt)}>"
                         for wdt in dict.fromkeys(("float32", name)) for y in ("long long", "int")
                         for cl, r in HELD_CONFIGS]
        for name in ("bfloat16", "float16", "float32")
    },
    signatures={"ce_rows_held": KERNELS.signatures["ce_rows"]},
    arch="sm_90",
)


def held_config(vocab: int, dtype: str, wdt: str = "float32") -> tuple[int, int, int] | None:
    """(cluster size CL, vectors per thread R, threads per CTA) of ce_rows_held for rows of `vocab`
    classes of inputs in `dtype`, the logits in a workspace of `wdt` (R counts its 16-byte
    vectors: a pair of :data:`HELD_CONFIGS` with its R scaled to them). The first pair whose CTAs
    hold the row, threads trimmed to a multiple of 32; None where ce_rows runs: float64, vocab
    below :data:`HELD_MIN_VOCAB` or above the largest configuration's 262,144."""
    if dtype not in ("bfloat16", "float16", "float32") or vocab < HELD_MIN_VOCAB:
        return None
    per = _vec(wdt)
    nvec = vocab // per
    for cl, r4 in HELD_CONFIGS:
        r = r4 * 4 // per
        if nvec <= cl * _HELD_THREADS * r:
            threads = max(32, -(-nvec // (cl * r * 32)) * 32)
            return cl, r, threads
    return None


_ROW_THREADS = 512
# Resident rows of ce_rows: its second pass re-reads a row the first pass read; the fewer rows in
# flight (rows x V x 4 bytes), the more of that re-read L2 serves. 2 per SM keeps enough loads in
# flight for DRAM (16 KiB per block) at 128K-vocabulary rows.
_ROW_BLOCKS_PER_SM = 2
_ELEMENTWISE_BLOCK = 256
_COLSUM_ROWS = 64  # rows per split of the bias gradient's column sums
# Tokens per chunk at which the dW GEMM with a float32 accumulator (beta = 1) stops being
# memory-bound on an H100: 2 Tc flops per 8 bytes of dW read and written, at ~770 TFLOP/s and
# ~3.3 TB/s, is Tc ~ 930.
_COMPUTE_BOUND_ROWS = 1024


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """How ``cukit.linear_cross_entropy`` splits its work and accumulates its gradients (the GPU
    path; the CPU reference ignores them).

    Args:
        chunk_size: tokens per chunk (``Tc``); None: the most that fit in the workspace (a
            multiple of 128 when that is >= 128), at least 1, at most the number of tokens.
        workspace_bytes: bound on the chunk's logits buffer, ``Tc x V x 4`` bytes (8 for
            float64, 2 for 16-bit logits), the only memory proportional to the vocabulary that the
            op allocates besides the gradients. None (default): 256 MiB, raised for 16-bit inputs
            with float32 accumulation to up to the bytes of 1,024 float32 rows as long as it stays
            within half the float32 dW accumulator (the op's peak is then still set by the
            backward's rounding of that accumulator, not by the workspace): the dW GEMM reads and
            writes its float32 output once per chunk, and on an H100 needs ~1,000 tokens per chunk
            to be compute-bound (8 bytes per element against 2 x Tc flops). 8,192 x 4,096 x
            128,256: 1,024 tokens (501 MiB), 2,048 with 16-bit logits. Larger chunks make every
            GEMM more efficient (and, with ``grad_accumulation="input"``, round dW fewer times).
        grad_accumulation: how the gradients of 16-bit inputs accumulate over the chunks.
            "float32" (default, exact): dx and dW accumulate in float32 buffers and are rounded
            once to the input's dtype, in the backward, after the reduction's scale and the
            upstream gradient (e.g. a GradScaler's scale) are applied: the same single rounding as
            torch's ``F.linear`` + ``F.cross_entropy``. Costs a float32 dW (``V x H x 4`` bytes)
            while the loss is alive, plus the rounded copy when the backward runs: 3 GiB at
            V = 128,256 x H = 4,096 (bf16 dW alone is 1 GiB). Where every token's logit gradient
            (``T x V`` in the input dtype) is no larger (16-bit inputs, T <= 2 H:
            :func:`stores_logit_grads`), the forward keeps that instead and the backward makes dW
            from it in one GEMM over all tokens: the same rounding and peak, and no float32 dW
            read and written per chunk.
            "input" (opt-in approximation, minimum memory): dx and dW are written in the input
            dtype; dW accumulates over chunks inside each chunk's GEMM (fp32 within the GEMM, one
            rounding per chunk, ``ceil(T / Tc)`` in all: relative error about
            ``sqrt(chunks / 3)`` times one rounding's) and is scaled in place in the backward. With
            ``workspace_bytes=64 << 20`` this keeps the op's peak at 8,192 x 4,096 x 128,256
            (bf16) under 1,150 MiB (the memory target), at the price of 128-token chunks whose
            dW GEMMs are bound by reading and writing dW. float16 partial sums are kept in range
            by a 1 / T factor.
            "recompute" (exact, minimum memory, one more GEMM): no float32 gradient buffers. A
            first pass over chunks of tokens computes each chunk's log-sum-exp, loss and dx (one
            GEMM over the whole vocabulary per chunk, fp32 inside it, rounded once); a second
            pass recomputes the logits of every token for one block of classes at a time and
            writes that block's rows of dW from one GEMM over all tokens (rounded once). The
            reduction's scale is applied before rounding; the upstream gradient after, which is
            exact when it is 1 or a power of two (``loss.backward()``, a GradScaler's scale).
            ``workspace_bytes`` (default 64 MiB) bounds the second pass's block, which sets the
            peak: dW + dx + the block, ~1,130 MiB at 8,192 x 4,096 x 128,256 (bf16); the first
            pass's chunk may take up to dW's size as well (dW does not exist yet). Costs a
            fourth GEMM of the logits' size. float16 gradients scaled by 1 / tokens before a
            GradScaler's scale can lose their smallest entries: prefer "float32" for float16.
            float32 and float64 inputs accumulate in their own dtype in every mode.
        logits: the precision of each chunk's logits, for 16-bit inputs. "float32" (default): the
            GEMM's float32 sums, never rounded: the loss and lse to float32 accuracy, and gradients
            more accurate than torch's ``F.cross_entropy(F.linear(x, W).float(), y)``. "input":
            the product ``x W^T`` rounded once to the input dtype, as that reference (and a model
            whose head returns logits in its own dtype) rounds it; bias, soft-capping and
            everything after are float32 as before. Half the workspace per token, so twice the
            tokens per chunk in the same bytes (half the float32 dW accumulator's passes), a GEMM
            that writes half the bytes and row kernels that read half. float16 logits overflow
            beyond 65,504 as the reference's do. float32 and float64 inputs ignore it.
        allow_retain_graph: the backward of 'mean' / 'sum' scales and releases the gradients the
            forward computed (in place where it can); a second backward through the same graph
            (``retain_graph=True``) then recomputes them from the saved lse, as 'none' does. True
            keeps them instead (a gradient-sized copy per backward), like torch's option of the
            same name (torch's chunked op raises on a second backward without it).

    ``torch.nn.LinearCrossEntropyOptions`` is accepted too: ``batch_chunk_size`` and
    ``chunking_method`` give the chunk size, ``acc_policy="compact"`` (or a 16-bit ``acc_dtype``)
    means ``grad_accumulation="input"``, anything else "float32"; ``allow_retain_graph`` as is;
    ``logits`` "float32".

    See also: ``torch.nn.LinearCrossEntropyOptions``.
    """

    chunk_size: int | None = None
    workspace_bytes: int | None = None
    grad_accumulation: str = "float32"
    allow_retain_graph: bool = False
    logits: str = "float32"

    def __post_init__(self) -> None:
        where = "cukit.LinearCrossEntropyOptions"
        if self.chunk_size is not None and not (_is_int(self.chunk_size) and self.chunk_size >= 1):
            raise ValueError(f"{where}: chunk_size must be None or an int >= 1; got {self.chunk_size!r}")
        if self.workspace_bytes is not None and not (_is_int(self.workspace_bytes) and self.workspace_bytes >= 1):
            raise ValueError(f"{where}: workspace_bytes must be None or an int >= 1; got {self.workspace_bytes!r}")
        if self.grad_accumulation not in ACCUMULATIONS:
            raise ValueError(
                f"{where}: grad_accumulation must be one of {', '.join(map(repr, ACCUMULATIONS))}; "
                f"got {self.grad_accumulation!r}"
            )
        if not isinstance(self.allow_retain_graph, bool):
            raise TypeError(f"{where}: allow_retain_graph must be True or False; got {self.allow_retain_graph!r}")
        if self.logits not in LOGITS:
            raise ValueError(f"{where}: logits must be one of {', '.join(map(repr, LOGITS))}; got {self.logits!r}")

    def chunk_rows(self, tokens: int, vocab: int, hidden: int = 0, dtype: str = "bfloat16") -> int:
        """Tokens per chunk for `tokens` x `hidden` -> `vocab` in `dtype` (see `chunk_size`; with
        "recompute", the first pass's chunk)."""
        if self.chunk_size is not None:
            return max(1, min(self.chunk_size, tokens))
        asize = DTYPES[logits_dtype(dtype, self.logits)].itemsize
        row = _ld(vocab, asize) * asize
        budget = self.workspace_bytes
        if self.grad_accumulation == "recompute":
            # the first pass runs before dW is allocated: a chunk the size of dW adds no peak
            budget = max(budget or RECOMPUTE_BLOCK_BYTES, vocab * hidden * DTYPES[dtype].itemsize)
        elif budget is None:
            budget = DEFAULT_WORKSPACE_BYTES
            if self.grad_accumulation == "float32" and dtype in ("float16", "bfloat16"):
                budget = max(budget, min(vocab * hidden * 2, _COMPUTE_BOUND_ROWS * _ld(vocab, 4) * 4))
        tc = budget // row
        if tc >= 128:
            tc -= tc % 128
        return max(1, min(tc, tokens))

    def vocab_block(self, tokens: int, vocab: int, dtype: str = "bfloat16") -> int:
        """Classes per block of the "recompute" mode's second pass (0 in the other modes): as
        many as keep every token's logits for the block within ``workspace_bytes`` (default
        64 MiB), a multiple of 128, at least 128 (or the vocabulary)."""
        if self.grad_accumulation != "recompute":
            return 0
        asize = DTYPES[logits_dtype(dtype, self.logits)].itemsize
        budget = self.workspace_bytes or RECOMPUTE_BLOCK_BYTES
        cols = budget // (max(tokens, 1) * asize)
        cols -= cols % _MIN_VOCAB_BLOCK
        return max(1, min(vocab, max(cols, _MIN_VOCAB_BLOCK)))


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def resolve_options(options: Any, tokens: int, hidden: int, vocab: int, fn: str = FN) -> LinearCrossEntropyOptions:
    """`options` as a :class:`LinearCrossEntropyOptions` (None: the defaults; a
    ``torch.nn.LinearCrossEntropyOptions`` translated, its chunking rule evaluated for this
    tokens x hidden x vocab problem). TypeError for anything else."""
    if options is None:
        return _DEFAULT_OPTIONS
    if isinstance(options, LinearCrossEntropyOptions):
        return options
    if type(options).__name__ == "LinearCrossEntropyOptions" and hasattr(options, "acc_policy"):
        return _from_torch_options(options, tokens, hidden, vocab)
    raise TypeError(
        f"{fn}: options must be None, a cukit.LinearCrossEntropyOptions or a torch.nn.LinearCrossEntropyOptions; "
        f"got {type_name(options)}"
    )


_DEFAULT_OPTIONS = LinearCrossEntropyOptions()


def is_default_chunking(opts: LinearCrossEntropyOptions) -> bool:
    """Whether `opts` are the defaults but for the logits' precision."""
    return dataclasses.replace(opts, logits="float32") == _DEFAULT_OPTIONS


def _from_torch_options(o: Any, tokens: int, hidden: int, vocab: int) -> LinearCrossEntropyOptions:
    chunk = o.batch_chunk_size
    method = o.chunking_method
    if method == "auto" and chunk is None:
        method = None  # cukit's own default chunking
    if method is not None and method != "auto" and str(method).startswith("aspect_ratio"):
        # torch's rule (torch/nn/modules/linear_cross_entropy_options.py): a logits chunk about
        # the size of the input, divided by N
        factor = int(method.split(":", 1)[1]) if ":" in method else 1
        target = -(-tokens // max(1, -(-vocab // max(hidden, 1))))
        chunk = max(1, min((1 << max(0, target - 1).bit_length()) // factor, tokens))
    acc_dtype = getattr(o, "acc_dtype", None)
    lean = o.acc_policy == "compact" or (acc_dtype is not None and "float32" not in str(acc_dtype)
                                         and "float64" not in str(acc_dtype))
    return LinearCrossEntropyOptions(
        chunk_size=chunk, grad_accumulation="input" if lean else "float32",
        allow_retain_graph=bool(o.allow_retain_graph),
    )


def _ld(vocab: int, acc_itemsize: int) -> int:
    """The workspace's row stride in elements: a multiple of 32 bytes, so rows (and the narrower
    gradient rows written over them) start 16-byte aligned for vector and TMA accesses."""
    per = 32 // acc_itemsize
    return max(per, -(-vocab // per) * per)


def stores_logit_grads(tokens: int, hidden: int, vocab: int, dtype: str, accumulate: str, reduction: str) -> bool:
    """Whether the forward of 'mean' / 'sum' with a dW wanted keeps every token's logit gradient,
    G (tokens x vocab, in the input dtype), instead of accumulating dW chunk by chunk in float32.

    With G the backward makes dW with K = every token (:func:`stored_dw_gpu`: one GEMM whose
    epilogue applies the reduction's scale and the upstream gradient, read on the device, where
    the TMA kernels run; elsewhere the float32 products of each block of classes, scaled and
    rounded once, as the float32 accumulator is): no dW read and written per chunk. Chosen for
    16-bit inputs with float32 accumulation where G is no larger than the float32 dW it replaces
    (tokens <= 2 x hidden), so the peak never grows.
    """
    return (dtype in ("bfloat16", "float16") and accumulate == "float32" and reduction != "none"
            and 0 < tokens <= 2 * hidden and vocab > 0)


def stored_ld(vocab: int) -> int:
    """Row stride of the stored logit gradient G, in elements of a 16-bit dtype: 16-byte rows."""
    return max(8, -(-vocab // 8) * 8)


# The float32 scratch of the stored-gradient dW: blocks of classes small enough to stay in L2
# between the GEMM that writes them and the cast that rounds them.
STORED_SCRATCH_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """The non-array arguments of one call, validated."""

    reduction: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float  # 0.0: no soft-capping
    return_lse: bool


def check_spec(
    reduction: Any,
    ignore_index: Any,
    label_smoothing: Any,
    z_loss: Any,
    softcap: Any,
    return_lse: Any,
    fn: str = FN,
) -> Spec:
    """Validate the scalar arguments; ValueError (TypeError for a wrong type) naming fn and the
    argument."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of 'none', 'mean', 'sum'; got {reduction!r}")
    if ignore_index is None:
        ignore_index = IGNORE_INDEX
    elif not _is_int(ignore_index):
        raise TypeError(f"{fn}: ignore_index must be None or an int; got {type_name(ignore_index)}")
    ls = _real(label_smoothing, "label_smoothing", fn)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"{fn}: label_smoothing must be in [0, 1]; got {label_smoothing!r}")
    zl = _real(z_loss, "z_loss", fn)
    if not (zl >= 0.0 and math.isfinite(zl)):
        raise ValueError(f"{fn}: z_loss must be a finite float >= 0; got {z_loss!r}")
    cap = 0.0
    if softcap is not None:
        cap = _real(softcap, "softcap", fn)
        if not (cap > 0.0 and math.isfinite(cap)):
            raise ValueError(f"{fn}: softcap must be None or a finite float > 0; got {softcap!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse must be True or False; got {return_lse!r}")
    return Spec(str(reduction), int(ignore_index), ls, zl, cap, return_lse)


def _real(v: Any, name: str, fn: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a float; got {type_name(v)}")
    return float(v)


def _where(d: int | None) -> str:
    return "the CPU" if d is None else f"cuda:{d}"


def validate(input: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any, fn: str = FN) -> str:
    """Check the array arguments; return their array kind ("numpy", "cupy", "torch").

    input (..., H) float16/bfloat16/float32/float64; linear_weight (V, H) of input's dtype;
    target (...) = input.shape[:-1], int64 or int32 class indices; linear_bias None or (V,) of
    input's dtype; weight None or (V,) of any float dtype; all of one array type and device.
    Raises NotAnArrayError when a required argument is no array (the public function then
    converts array-likes), TypeError/ValueError naming fn and the argument otherwise."""
    named = [("input", input), ("linear_weight", linear_weight), ("target", target)]
    try:
        kind = array_kind(input)
        for _, a in named[1:]:
            array_kind(a)
    except NotAnArrayError:
        raise not_an_array_error(fn, named) from None
    for name, a in (*named[1:], ("linear_bias", linear_bias), ("weight", weight)):
        if a is None and name in ("linear_bias", "weight"):
            continue
        try:
            k = array_kind(a)
        except NotAnArrayError:
            raise TypeError(f"{fn}: {name} must be None or {array_class(kind)} like input; got {type_name(a)}") from None
        if k != kind:
            raise TypeError(f"{fn}: {name} must be the same array type as input ({array_class(kind)}); got {type_name(a)}")
    dt = dtype_name(input, kind)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: input must have dtype float16, bfloat16, float32 or float64; got {dt}")
    if input.ndim < 1:
        raise ValueError(f"{fn}: input must have shape (..., in_features); got shape ()")
    H = int(input.shape[-1])
    if dtype_name(linear_weight, kind) != dt:
        raise TypeError(
            f"{fn}: linear_weight must have input's dtype {dt}; got {dtype_name(linear_weight, kind)} "
            "(no dtype promotion here: cast one of them, or use torch.autocast)"
        )
    if linear_weight.ndim != 2 or int(linear_weight.shape[1]) != H or int(linear_weight.shape[0]) < 1:
        raise ValueError(
            f"{fn}: linear_weight must have shape (num_classes >= 1, {H}) to match input's last dimension "
            f"(input has shape {tuple(input.shape)}); got {tuple(linear_weight.shape)}"
        )
    V = int(linear_weight.shape[0])
    tdt = dtype_name(target, kind)
    if tdt not in TARGET_DTYPES:
        why = " (class probabilities are not supported)" if tdt in FLOAT_DTYPES else ""
        raise TypeError(f"{fn}: target must hold class indices of dtype int64 or int32; got {tdt}{why}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"{fn}: target must have shape {tuple(input.shape[:-1])} (input's shape without its last dimension); "
            f"got {tuple(target.shape)}"
        )
    if linear_bias is not None:
        if dtype_name(linear_bias, kind) != dt:
            raise TypeError(f"{fn}: linear_bias must have input's dtype {dt}; got {dtype_name(linear_bias, kind)}")
        if tuple(linear_bias.shape) != (V,):
            raise ValueError(f"{fn}: linear_bias must have shape ({V},); got {tuple(linear_bias.shape)}")
    if weight is not None:
        if dtype_name(weight, kind) not in FLOAT_DTYPES:
            raise TypeError(f"{fn}: weight must have a float dtype; got {dtype_name(weight, kind)}")
        if tuple(weight.shape) != (V,):
            raise ValueError(f"{fn}: weight must have shape ({V},) (one weight per class); got {tuple(weight.shape)}")
    dev = device_of(input)
    for name, a in (("linear_weight", linear_weight), ("target", target), ("linear_bias", linear_bias),
                    ("weight", weight)):
        if a is not None and device_of(a) != dev:
            raise ValueError(f"{fn}: {name} must be on input's device ({_where(dev)}); got {_where(device_of(a))}")
    return kind


def check_targets_host(target: Any, vocab: int, ignore_index: int, fn: str = FN) -> None:
    """The CPU paths check the class indices (free there; on a GPU it would be a sync, so the
    kernels give the token a NaN loss instead): ValueError naming the first bad index."""
    t = np.asarray(target.detach().cpu().numpy() if hasattr(target, "detach") else target).reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if bad.any():
        raise ValueError(
            f"{fn}: target must hold class indices in [0, {vocab}) or ignore_index ({ignore_index}); "
            f"got {int(t[bad.argmax()])}"
        )


# ---------------------------------------------------------------------------------------------
# Public API (arrays; torch tensors go through cukit/torch/linear_cross_entropy.py)
# ---------------------------------------------------------------------------------------------


def linear_cross_entropy(
    input: Any,
    linear_weight: Any,
    target: Any,
    *,
    linear_bias: Any = None,
    weight: Any = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: Any = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
) -> Any:
    """Cross-entropy of a linear layer's output, ``cross_entropy(input @ linear_weight.T +
    linear_bias, target)``, without storing the logits: the loss of token i is
    ``(1 - eps) w_{y_i} (lse_i - z_{i,y_i}) + (eps / V) sum_c w_c (lse_i - z_{i,c}) + z_loss lse_i^2``
    with ``z = softcap tanh(logits / softcap)`` (or the logits) and ``lse_i = log sum_c exp z_{i,c}``.

    torch 2.13's ``torch.nn.functional.linear_cross_entropy`` signature and semantics for class
    indices, plus three arguments (keyword only):

    Args:
        input: (..., H) float16, bfloat16, float32 or float64 (torch's takes (H,) or (N, H)).
        linear_weight: (V, H), input's dtype.
        target: input.shape[:-1], int64 or int32 class indices in [0, V) or ignore_index
            (class probabilities are not supported).
        linear_bias: None or (V,), input's dtype.
        weight: None or (V,) class weights (any float dtype; used in float32, float64 for
            float64 inputs).
        reduction: "mean" (sum of the per-token losses over the sum of the weights of the
            non-ignored targets, their number without class weights: NaN when there are none, as
            torch), "sum" or "none" (per token, 0 for ignored tokens).
        ignore_index: targets equal to it contribute nothing; None means -100, as in torch.
        label_smoothing: eps in [0, 1], mixed with class weights as ``F.cross_entropy`` does.
        options: None, a :class:`LinearCrossEntropyOptions` (chunking, gradient accumulation) or
            a ``torch.nn.LinearCrossEntropyOptions``.
        z_loss: coefficient of PaLM's ``lse^2`` penalty, added to each non-ignored token's loss
            (so 'mean' divides it by the same denominator as the rest).
        softcap: None, or s > 0: logits soft-capped to ``s tanh(logits / s)`` (Gemma 2).
        return_lse: also return the per-token log-sum-exp (input.shape[:-1]; ignored tokens
            included).

    Returns:
        The loss (0-d for "mean"/"sum", input.shape[:-1] for "none") in float32 (float64 for
        float64 inputs), as ``F.cross_entropy`` under autocast, and with `return_lse` ``(loss,
        lse)``; the array type of input. CUDA arrays run cukit's kernels (logits in fp32 chunks,
        never all at once), NumPy and torch-CPU arrays the reference. torch tensors are
        differentiable (input, linear_weight, linear_bias; lse too) and work under
        torch.compile, autocast and CUDA graphs (see ``cukit/torch/linear_cross_entropy.py``).

    A target outside [0, V) that is not ignore_index raises ValueError on the CPU; on a GPU it
    makes that token's loss (and so a reduced loss) NaN (a check would be a host sync).

    Raises:
        TypeError and ValueError naming ``cukit.linear_cross_entropy`` and the argument.

    See also: ``torch.nn.functional.linear_cross_entropy``, ``torch.nn.functional.cross_entropy``,
    ``cukit.nn.LinearCrossEntropy``.
    """
    spec = check_spec(reduction, ignore_index, label_smoothing, z_loss, softcap, return_lse)
    try:
        kind = validate(input, linear_weight, target, linear_bias, weight)
    except NotAnArrayError:
        input, linear_weight, target = as_arrays(
            FN, (("input", input), ("linear_weight", linear_weight), ("target", target))
        )
        kind = validate(input, linear_weight, target, linear_bias, weight)
    V = int(linear_weight.shape[0])
    T = math.prod(input.shape[:-1])
    opts = resolve_options(options, T, int(input.shape[-1]), V)
    if kind == "numpy" or device_of(input) is None:
        check_targets_host(target, V, spec.ignore_index)
        ref = reference_numpy if kind == "numpy" else reference_torch
        loss, lse = ref(input, linear_weight, target, linear_bias, weight, spec.reduction, spec.ignore_index,
                        spec.label_smoothing, spec.z_loss, spec.softcap, round_product=opts.logits == "input")
        return (loss, lse) if return_lse else loss
    dtype = dtype_name(input, kind)
    out = forward_gpu(input.reshape(T, input.shape[-1]), linear_weight, target.reshape(T), linear_bias, weight,
                      spec, opts.chunk_rows(T, V, int(input.shape[-1]), dtype), opts.grad_accumulation,
                      opts.vocab_block(T, V, dtype), opts.logits)
    loss = out[0] if spec.reduction != "none" else out[0].reshape(target.shape)
    return (loss, out[1].reshape(target.shape)) if return_lse else loss


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles
# ---------------------------------------------------------------------------------------------


def reference_numpy(
    input: np.ndarray, linear_weight: np.ndarray, target: np.ndarray, linear_bias: np.ndarray | None = None,
    weight: np.ndarray | None = None, reduction: str = "mean", ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0, round_product: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """NumPy linear + cross-entropy in float64: (loss, lse), both float64 (arrays, 0-d for a
    reduced loss). Same arguments as :func:`reference_torch`."""
    H, V = linear_weight.shape[1], linear_weight.shape[0]
    x = np.asarray(input, np.float64).reshape(-1, H)
    y = np.asarray(target).reshape(-1).astype(np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        z = x @ np.asarray(linear_weight, np.float64).T
        if round_product and np.asarray(input).dtype.itemsize == 2:
            z = z.astype(np.asarray(input).dtype).astype(np.float64)
        if linear_bias is not None:
            z = z + np.asarray(linear_bias, np.float64)
        if softcap:
            z = softcap * np.tanh(z / softcap)
        m = z.max(axis=1, keepdims=True) if z.shape[0] else np.zeros((0, 1))
        m = np.where(np.isfinite(m), m, 0.0)
        lse = (np.log(np.exp(z - m).sum(axis=1, keepdims=True)) + m)[:, 0]
        valid = y != ignore_index
        yc = np.where(valid, y, 0)
        w = np.ones(V) if weight is None else np.asarray(weight, np.float64)
        w_y = np.where(valid, w[yc], 0.0)
        per = (1.0 - label_smoothing) * w_y * (lse - z[np.arange(len(y)), yc])
        if label_smoothing:
            per = per + np.where(valid, label_smoothing / V * ((w * (lse[:, None] - z)).sum(axis=1)), 0.0)
        if z_loss:
            per = per + np.where(valid, z_loss * lse * lse, 0.0)
        shape = np.shape(target)
        if reduction == "none":
            loss = per.reshape(shape)
        elif reduction == "sum":
            loss = np.asarray(per.sum())
        else:
            den = w_y.sum()
            loss = np.asarray(per.sum() / den if den != 0 else np.nan)
    return loss, lse.reshape(shape)


def reference_logits_torch(x: Any, linear_weight: Any, linear_bias: Any, softcap: float,
                           product_in_input_dtype: bool = False, round_product: bool = False) -> Any:
    """``z = cap(x @ W^T + b)`` for x (T, H) in float32 (float64 for float64): the kernels' maths.
    `product_in_input_dtype`: ``F.linear`` in the inputs' dtype, then widened (torch's own
    ``F.cross_entropy(F.linear(x, W, b).float(), y)``: one rounding of each logit to that dtype).
    `round_product`: the float32 product ``x W^T`` of 16-bit inputs rounded once to their dtype
    before the bias (the kernels' ``logits="input"``)."""
    import torch

    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if product_in_input_dtype:
        z = torch.nn.functional.linear(x, linear_weight, linear_bias).to(acc)
        return softcap * torch.tanh(z / softcap) if softcap else z
    with torch.autocast(x.device.type, enabled=False):  # the product in acc, also under autocast
        z = x.to(acc) @ linear_weight.to(acc).T
    if round_product and x.dtype in (torch.float16, torch.bfloat16):
        z = z.to(x.dtype).to(acc)
    if linear_bias is not None:
        z = z + linear_bias.to(acc)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def reference_torch(
    input: Any, linear_weight: Any, target: Any, linear_bias: Any = None, weight: Any = None,
    reduction: str = "mean", ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
    z_loss: float = 0.0, softcap: float = 0.0, product_in_input_dtype: bool = False, round_product: bool = False,
) -> tuple[Any, Any]:
    """torch linear + cross-entropy with the kernels' maths (float32 logits, float64 for float64
    inputs), differentiable by torch's autograd: (loss, lse), the torch-CPU fallback.

    input (..., H), linear_weight (V, H), target input.shape[:-1] (valid indices or
    ignore_index); softcap 0 means none. The loss is float32 (float64 for float64 inputs).
    `product_in_input_dtype`, `round_product`: see :func:`reference_logits_torch`."""
    import torch

    H, V = linear_weight.shape[1], linear_weight.shape[0]
    shape = tuple(target.shape)
    y = target.reshape(-1).long()
    z = reference_logits_torch(input.reshape(-1, H), linear_weight, linear_bias, softcap, product_in_input_dtype,
                               round_product)
    lse = torch.logsumexp(z, dim=1) if z.shape[0] else z.new_zeros(0)
    per = row_loss_torch(z, y, weight, lse, ignore_index, label_smoothing, z_loss)
    if reduction == "none":
        loss = per.reshape(shape)
    elif reduction == "sum":
        loss = per.sum()
    else:
        # torch's: NaN when every token is ignored, but zero gradients then (not 0 * inf)
        some = (y != ignore_index).any()
        den = _target_weights(y, weight, V, ignore_index, z.dtype).sum()
        loss = torch.where(some, per.sum() * torch.where(some, 1 / den, 0), math.nan)
    return loss, lse.reshape(shape)


def _target_weights(y: Any, weight: Any, vocab: int, ignore_index: int, acc: Any) -> Any:
    """w_{y_i} per row: 0 for ignored rows, NaN for targets outside [0, V)."""
    import torch

    valid = y != ignore_index
    bad = valid & ((y < 0) | (y >= vocab))
    yc = torch.where(valid & ~bad, y, 0)
    w_y = valid.to(acc) if weight is None else torch.where(valid, weight.to(acc)[yc], 0)
    return torch.where(bad, math.nan, w_y)


def row_loss_torch(z: Any, y: Any, weight: Any, lse: Any, ignore_index: int, label_smoothing: float,
                   z_loss: float) -> Any:
    """Per-row losses from logits z (T, V) (after soft-capping) and their lse (T,): the maths of
    ``ce_rows`` (0 for ignored rows, NaN for targets outside [0, V)), differentiable."""
    import torch

    V = z.shape[1]
    w_y = _target_weights(y, weight, V, ignore_index, z.dtype)
    valid = y != ignore_index
    yc = torch.where(valid & (y >= 0) & (y < V), y, 0)
    per = (1 - label_smoothing) * w_y * (lse - z.gather(1, yc[:, None])[:, 0])
    if label_smoothing:
        d = lse[:, None] - z
        smooth = d.sum(1) if weight is None else (d * weight.to(z.dtype)).sum(1)
        per = per + torch.where(valid, label_smoothing / V * smooth, 0)
    if z_loss:
        per = per + torch.where(valid, z_loss * lse * lse, 0)
    return per


def stats_torch(target: Any, weight: Any, vocab: int, ignore_index: int, mean: bool, acc: Any) -> Any:
    """``ce_stats`` in torch: [scale of the loss, scale of the gradients, sum of the class
    weights] (see raw_kernels/cross_entropy.cu)."""
    import torch

    y = target.reshape(-1).long()
    sw = _target_weights(y, weight, vocab, ignore_index, acc).sum()
    one = torch.ones((), dtype=acc, device=y.device)
    s_loss = 1 / sw if mean else one
    s_grad = torch.where((y != ignore_index).any(), 1 / sw, torch.zeros_like(sw)) if mean else one
    total = torch.full((), float(vocab), dtype=acc, device=y.device) if weight is None else weight.to(acc).sum()
    return torch.stack([s_loss, s_grad, total])


def dlogits_torch(z: Any, y: Any, weight: Any, lse: Any, stats: Any, u: Any, v: Any, ignore_index: int,
                  label_smoothing: float, z_loss: float, softcap: float) -> Any:
    """``d loss / d (x W^T + b)`` per row, the gradient ``ce_rows`` writes: z (T, V) soft-capped
    logits, lse (T,), stats (ce_stats), u (T,) the upstream gradient of each row's loss, v (T,)
    that of its lse (or None). Rows with an invalid target are NaN."""
    import torch

    V = z.shape[1]
    w_y = _target_weights(y, weight, V, ignore_index, z.dtype)
    valid = y != ignore_index
    u = torch.where(valid, u, 0)
    a = (1 - label_smoothing) * w_y
    cp = u * (a + label_smoothing / V * stats[2] + 2 * z_loss * lse)
    if v is not None:
        cp = cp + v
    g = cp[:, None] * torch.exp(z - lse[:, None])
    if label_smoothing:
        g = g - (u * (label_smoothing / V))[:, None] * (1 if weight is None else weight.to(z.dtype)[None])
    yc = torch.where(valid & (y >= 0) & (y < V), y, 0)
    g = g.scatter_add(1, yc[:, None], -(u * a)[:, None])
    if softcap:
        g = g * (1 - (z / softcap) ** 2)
    return g


def reference_grad_torch(
    x: Any, linear_weight: Any, target: Any, linear_bias: Any, weight: Any, *, reduction: str,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, grad_loss: Any,
    grad_lse: Any = None, lse: Any = None, stats: Any = None, round_product: bool = False,
) -> tuple[Any, Any, Any]:
    """The gradients ``(dx, dW, db)`` of (loss, lse) for upstream gradients `grad_loss` (0-d
    for 'mean'/'sum', (T,) for 'none') and `grad_lse` ((T,) or None), by the kernels' closed
    form (the CPU backward, and the oracle of the kernels' gradient): x (T, H), target (T,).
    Results in the dtypes of x, linear_weight and linear_bias (db None without a bias).
    `round_product`: see :func:`reference_logits_torch`."""
    import torch

    V = linear_weight.shape[0]
    y = target.reshape(-1).long()
    z = reference_logits_torch(x, linear_weight, linear_bias, softcap, round_product=round_product)
    acc = z.dtype
    lse = (torch.logsumexp(z, dim=1) if z.shape[0] else z.new_zeros(0)) if lse is None else lse.to(acc)
    if stats is None:
        stats = stats_torch(y, weight, V, ignore_index, reduction == "mean", acc)
    if reduction == "none":
        u = grad_loss.reshape(-1).to(acc)
    else:
        u = (grad_loss.to(acc) * stats[1]).expand(y.shape[0])
    v = None if grad_lse is None else grad_lse.reshape(-1).to(acc)
    g = dlogits_torch(z, y, weight, lse, stats, u, v, ignore_index, label_smoothing, z_loss, softcap)
    dx = (g @ linear_weight.to(acc)).to(x.dtype)
    dw = (g.T @ x.to(acc)).to(linear_weight.dtype)
    db = None if linear_bias is None else g.sum(0).to(linear_bias.dtype)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------


def _ptr(a: Any) -> int:
    if a is None:
        return 0
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def _empty(shape: tuple[int, ...], dtype: str, like: Any, zero: bool = False) -> Any:
    if hasattr(like, "data_ptr"):
        import torch

        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=getattr(torch, dtype), device=like.device)
    import cupy

    with like.device:
        return (cupy.zeros if zero else cupy.empty)(shape, dtype=dtype)


def _fill_zero(a: Any) -> None:
    if hasattr(a, "zero_"):
        a.zero_()
    else:
        a.fill(0)


def _view_as(a: Any, dtype: str) -> Any:
    """The same memory as another dtype (the workspace's rows read as the gradient dtype)."""
    if hasattr(a, "data_ptr"):
        import torch

        return a.view(getattr(torch, dtype))
    from cukit.interop import numpy_dtype

    return a.view(numpy_dtype(dtype))


class DeviceSteps:
    """The kernel launches of one signature (held by its plan), one method per step. Each takes
    arrays (and a row offset into the per-token ones) and launches on `stream`; launches are
    prepared once per distinct row count (a plan sees two: the chunk size and the last chunk's).
    ``tests/test_linear_cross_entropy.py`` runs the same chunk loops on the CPU with a torch
    emulation of these methods, which pins down what each kernel must compute."""

    def __init__(self, dtype: str, ydtype: str, device: int, vocab: int, ld: int, spec: Spec,
                 wdt: str | None = None) -> None:
        self.dtype, self.acc = dtype, _acc_name(dtype)
        self.wdt = wdt or self.acc  # the logits workspace's dtype
        self.t, self.a, self.y = DTYPES[dtype].ctype, DTYPES[self.acc].ctype, DTYPES[ydtype].ctype
        self.w = DTYPES[self.wdt].ctype
        self.asize, self.ysize = DTYPES[self.acc].itemsize, DTYPES[ydtype].itemsize
        self.wsize = DTYPES[self.wdt].itemsize
        self.device, self.V, self.ld, self.spec = device, vocab, ld, spec
        self._launches: dict[tuple, Any] = {}

    def _get(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], tail: tuple) -> Any:
        """`name`'s launch, prepared once per (grid, block, scalar arguments): the arguments are
        baked into it, so a call that differs in any of them (the forward's stored gradient and the
        backward's workspace differ in their row strides) gets a launch of its own."""
        key = (name, grid, block, tail)
        run = self._launches.get(key)
        if run is None:
            run = self._launches[key] = KERNELS.prepare(name, grid, block, tail, device=self.device)
        return run

    def stats(self, target: Any, cw: Any, stats: Any, n: int, stream: Any) -> None:
        """stats = [scale of the loss, scale of the gradients, sum of the class weights]."""
        sp = self.spec
        run = self._get(f"ce_stats<{self.a}, {self.y}>", (1,), (1024,),
                        (n, self.V, sp.ignore_index, int(sp.reduction == "mean")))
        run((_ptr(target), _ptr(cw), _ptr(stats)), stream)

    def rows(self, mode: int, ws: Any, bias: Any, target: Any, cw: Any, stats: Any, row_grad: Any, grad0: Any,
             lse_grad: Any, lse: Any, row_loss: Any, r0: int, n: int, stream: Any, *, col0: int = 0,
             cols: int | None = None, ld: int | None = None, out: Any = None, ldo: int = 0) -> None:
        """ce_rows over rows [r0, r0 + n) of the per-token arrays, rows [0, n) of ws (the logits
        workspace's dtype, row stride `ld`, default the plan's), each holding the classes
        [col0, col0 + cols) (default all).
        The gradient goes over ws, or into rows [0, n) of `out` (row stride `ldo` elements of the
        input dtype) when given."""
        sp = self.spec
        cols = self.V if cols is None else cols
        ld = self.ld if ld is None else ld
        if out is None:
            ldo = ld * self.wsize // DTYPES[self.dtype].itemsize
        key = ("rows", mode, n, cols, ld, ldo)
        run = self._launches.get(key)
        if run is None and mode == MODE_GRAD and col0 == 0 and cols == self.V:
            held = held_config(cols, self.dtype, self.wdt) if device_caps(self.device).cc == 90 else None
            if held is not None:
                cl, r, threads = held
                # clusters loop over the rows; the hardware places them as SMs free up
                clusters = max(1, min(n, _HELD_CLUSTERS_PER_SM * sm_count(self.device)))
                run = self._launches[key] = KERNELS_SM90.prepare(
                    f"ce_rows_held<{self.t}, {self.w}, {self.y}, {cl}, {r}>", (cl, clusters), (threads,),
                    (n, cols, ld, ldo, self.V, sp.ignore_index, sp.label_smoothing, sp.z_loss, sp.softcap),
                    device=self.device)
        if run is None:
            nvec = -(-cols // _vec(self.wdt))
            threads = min(_ROW_THREADS, max(32, -(-nvec // 32) * 32))
            grid = max(1, min(n, sm_count(self.device) * _ROW_BLOCKS_PER_SM))
            # kept by the short key, which fixes every argument (the spec is the plan's): one lookup per chunk
            run = self._launches[key] = KERNELS.prepare(
                f"ce_rows<{self.t}, {self.w}, {self.y}, {mode}>", (grid,), (threads,),
                (n, cols, ld, ldo, self.V, sp.ignore_index, sp.label_smoothing, sp.z_loss, sp.softcap), device=self.device)
        a = self.asize * r0

        def at(x: Any) -> int:
            return 0 if x is None else _ptr(x) + a

        run((_ptr(ws), _ptr(ws if out is None else out), _ptr(bias), _ptr(target) + self.ysize * r0, _ptr(cw),
             _ptr(stats), at(row_grad), _ptr(grad0), at(lse_grad), at(lse), at(row_loss), np.int64(col0)), stream)

    def total(self, row_loss: Any, stats: Any, out: Any, n: int, stream: Any) -> None:
        """out = stats[0] * sum(row_loss)."""
        self._get(f"ce_total<{self.a}>", (1,), (1024,), (n,))(
            (_ptr(row_loss), _ptr(stats), _ptr(out)), stream)

    def colsum(self, g: Any, ldg: int, partial: Any, acc: Any, n: int, first: bool, stream: Any) -> None:
        """acc (+)= the column sums of g (n, V) (row stride ldg), in a fixed order."""
        splits = -(-n // _COLSUM_ROWS)
        rps = -(-n // splits)
        cols = -(-self.V // _ELEMENTWISE_BLOCK)
        main = self._get(f"ce_colsum<{self.t}>", (cols, splits), (_ELEMENTWISE_BLOCK,), (n, self.V, ldg, rps))
        fin = self._get(f"ce_colsum_finish<{self.a}>",
                        (max(1, min(cols, sm_count(self.device) * 8)),), (_ELEMENTWISE_BLOCK,),
                        (splits, self.V, int(not first)))
        main((_ptr(g), _ptr(partial)), stream)
        fin((_ptr(partial), _ptr(acc)), stream)

    def scale_cast(self, src: Any, dst: Any, s0: Any, s1: Any, factor: float, stream: Any) -> None:
        """dst = src * s0[0] * s1[0] * factor, rounded once to dst's dtype (see scale_cast_gpu)."""
        _scale_cast(src, dst, s0, s1, factor, self.device, stream)


def _scale_cast(src: Any, dst: Any, s0: Any, s1: Any, factor: float, device: int, stream: Any) -> None:
    n = math.prod(src.shape)
    if n == 0:
        return
    sd, dd = DTYPES[dtype_name(src)], DTYPES[dtype_name(dst)]
    ps, pd = _ptr(src), _ptr(dst)
    vec = 4 if n % 4 == 0 and ps % (4 * sd.itemsize) == 0 and pd % (4 * dd.itemsize) == 0 else 1
    key = (sd.name, dd.name, n, vec, float(factor), device)
    run = _CASTS.get(key)
    if run is None:
        blocks = max(1, min(-(-(n // vec) // _ELEMENTWISE_BLOCK), sm_count(device) * 16))
        run = _CASTS.put(key, KERNELS.prepare(f"scale_cast<{sd.ctype}, {dd.ctype}, {vec}>", (blocks,),
                                              (_ELEMENTWISE_BLOCK,), (n, float(factor)), device=device))
    run((ps, pd, _ptr(s0), _ptr(s1)), stream)


_CASTS = PlanCache("linear_cross_entropy_cast", maxsize=256)


def stored_dw(g: Any, x: Any, dw: Any, s0: Any, s1: Any, cast: Any) -> Any:
    """``dw = s0[0] s1[0] g^T x`` for the stored logit gradient g (T, V) (a view: unit column
    stride) and x (T, H), rounded once into dw (V, H): the float32 product of each block of classes
    (one GEMM over all T tokens) into a scratch that stays in L2 (:data:`STORED_SCRATCH_BYTES`),
    then ``cast(src, dst, s0, s1)`` rounds it into its rows of dw."""
    V, H = int(dw.shape[0]), int(dw.shape[1])
    vb = min(V, max(128, STORED_SCRATCH_BYTES // (4 * max(H, 1)) // 128 * 128))
    scratch = _empty((vb, H), "float32", x)
    for c0 in range(0, V, vb):
        nb = min(vb, V - c0)
        _matmul.gemm(g[:, c0:c0 + nb].T, x, scratch[:nb])
        cast(scratch[:nb], dw[c0:c0 + nb], s0, s1)
    return dw


def stored_dw_gpu(g: Any, x: Any, vocab: int, dtype: str, s0: Any = None, s1: Any = None) -> Any:
    """``dw = s0[0] s1[0] g^T x`` on the GPU into a new (vocab, H) array of `dtype`: g is the
    forward's stored gradient buffer (T, ldg), x the input (T, H). One GEMM whose epilogue reads
    the scale on the device (``cukit.ops.matmul.gemm_device_scale``) where the TMA kernels run,
    else :func:`stored_dw` (float32 blocks and a scaling cast); either way each element is the
    float32 product times the scale, rounded once."""
    device = device_of(x)
    stream = current_stream(device, hasattr(x, "data_ptr"))
    dw = _empty((vocab, int(x.shape[1])), dtype, x)
    if hasattr(x, "data_ptr") and x.stride(-1) != 1:
        x = x.contiguous()
    scale = _scale_product(s0, s1)
    if scale is not None and _matmul.gemm_device_scale(g[:, :vocab].T, x, dw, scale):
        return dw
    return stored_dw(g[:, :vocab], x, dw, s0, s1,
                     lambda src, dst, a, b: _scale_cast(src, dst, a, b, 1.0, device, stream))


def _scale_product(s0: Any, s1: Any) -> Any:
    """s0[0] * s1[0] as a 1-element float32 array on their device (as scale_cast forms its scale),
    or None when both are None."""
    parts = [s.reshape(1) for s in (s0, s1) if s is not None]
    parts = [s.float() if hasattr(s, "data_ptr") else s.astype("float32") for s in parts]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] * parts[1]


def scale_cast_gpu(src: Any, dtype: str, s0: Any = None, s1: Any = None, factor: float = 1.0, *,
                   inplace: bool = False) -> Any:
    """``(src * s0[0] * s1[0] * factor)`` rounded once to `dtype` (s0, s1: 1-element device arrays
    of the accumulator dtype, or None): how the gradients the forward computed become the
    parameters' gradients. In place (returning src) when `inplace` and src already has `dtype`."""
    device = device_of(src)
    out = src if inplace and dtype_name(src) == dtype else _empty(tuple(src.shape), dtype, src)
    _scale_cast(src, out, s0, s1, factor, device, current_stream(device, hasattr(src, "data_ptr")))
    return out


@dataclasses.dataclass
class Plan:
    """What a signature determines: sizes, the chunk size, the workspace's row stride, the
    gradient buffers' dtypes, and the prepared launches."""

    T: int
    H: int
    V: int
    tc: int  # tokens per chunk
    ld: int  # workspace row stride (elements of wdt)
    dtype: str
    acc: str
    spec: Spec
    accumulate: str  # "float32", "input" or "recompute"
    steps: Any
    vb: int = 0  # "recompute": classes per block of the second pass
    ldb: int = 0  # "recompute": the second pass's workspace row stride
    wdt: str = ""  # the logits workspace's dtype (logits_dtype; "": the accumulator's)

    def __post_init__(self) -> None:
        self.wdt = self.wdt or self.acc

    @property
    def recompute(self) -> bool:
        return self.accumulate == "recompute"

    @property
    def narrow(self) -> bool:
        """The gradient (input dtype) is narrower than the workspace (16-bit inputs, float32 logits)."""
        return self.dtype != self.wdt

    @property
    def stored(self) -> bool:
        """The forward keeps every token's logit gradient for the backward's dW (stores_logit_grads)."""
        return stores_logit_grads(self.T, self.H, self.V, self.dtype, self.accumulate, self.spec.reduction)

    def grad_dtype(self) -> str:
        """dtype of the dx / dW buffers the forward fills (see grad_accumulation)."""
        return self.acc if self.accumulate == "float32" else self.dtype

    def dw_alpha(self) -> float:
        """GEMM alpha of the forward's dW: 1 / T for float16 "input" accumulation (keeps the partial
        sums of up to T tokens in float16's range; the backward multiplies T back)."""
        return 1.0 / self.T if self.accumulate == "input" and self.dtype == "float16" and self.T else 1.0


_PLANS = PlanCache("linear_cross_entropy", maxsize=256)


def _key(x: Any, w: Any, target: Any, bias: Any, cw: Any, spec: Spec, tc: int, accumulate: str, vb: int,
         logits: str) -> tuple:
    """A call's signature: what the plan and the first call's validation depend on (shapes,
    dtypes, devices of every array; the options), never the data pointers."""
    torch_kind = hasattr(x, "data_ptr")

    def meta(a: Any) -> tuple | None:
        if a is None:
            return None
        return (tuple(a.shape), a.dtype, a.get_device() if torch_kind else a.device.id)

    # return_lse changes nothing the kernels do: the forward and the backward share a plan
    spec = dataclasses.replace(spec, return_lse=False) if spec.return_lse else spec
    return (torch_kind, meta(x), meta(w), meta(target), meta(bias), meta(cw), spec, tc, accumulate, vb, logits)


def _plan(x: Any, w: Any, target: Any, bias: Any, cw: Any, spec: Spec, tc: int, accumulate: str, vb: int,
          logits: str) -> Plan:
    key = _key(x, w, target, bias, cw, spec, tc, accumulate, vb, logits)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    kind = validate(x, w, target, bias, cw, f"{FN} (GPU path)")
    device = device_of(x)
    if device is None:
        raise ValueError(f"{FN} (GPU path): input must be a CUDA array; got an array on the CPU")
    if x.ndim != 2 or target.ndim != 1:
        raise ValueError(f"{FN} (GPU path): input must be 2-D (tokens, H) and target 1-D; got {tuple(x.shape)}")
    if not (_is_int(tc) and tc >= 1) or accumulate not in ACCUMULATIONS or logits not in LOGITS or not (
            _is_int(vb) and (vb >= 1 if accumulate == "recompute" else vb == 0)):
        raise ValueError(f"{FN} (GPU path): chunk size {tc!r}, accumulation {accumulate!r}, logits {logits!r} or "
                         f"vocabulary block {vb!r} invalid")
    dtype = dtype_name(x, kind)
    acc, wdt = _acc_name(dtype), logits_dtype(dtype, logits)
    T, H, V = int(x.shape[0]), int(x.shape[1]), int(w.shape[0])
    wsize = DTYPES[wdt].itemsize
    ld = _ld(V, wsize)
    steps = DeviceSteps(dtype, dtype_name(target, kind), device, V, ld, spec, wdt)
    vb = min(vb, V)
    plan = Plan(T, H, V, min(tc, max(T, 1)), ld, dtype, acc, spec, accumulate, steps, vb,
                _ld(vb, wsize) if vb else 0, wdt)
    return _PLANS.put(key, plan)


def _prepare_inputs(x: Any, w: Any, target: Any, bias: Any, cw: Any, acc: str) -> tuple[Any, Any, Any, Any, Any]:
    """Unit-stride rows for the GEMMs, contiguous per-token and per-class vectors, class weights
    in the accumulator dtype (a no-op for arrays that already are)."""
    if hasattr(x, "data_ptr"):
        import torch

        if x.stride(-1) != 1:
            x = x.contiguous()
        if w.stride(-1) != 1:
            w = w.contiguous()
        target = target.contiguous()
        bias = None if bias is None else bias.contiguous()
        cw = None if cw is None else cw.to(getattr(torch, acc)).contiguous()
        return x, w, target, bias, cw
    import cupy

    cw = None if cw is None else cupy.ascontiguousarray(cw, dtype=acc)
    x = x if x.strides[-1] == x.itemsize else cupy.ascontiguousarray(x)
    w = w if w.strides[-1] == w.itemsize else cupy.ascontiguousarray(w)
    bias = None if bias is None else cupy.ascontiguousarray(bias)
    return x, w, cupy.ascontiguousarray(target), bias, cw


def forward_gpu(
    x: Any, w: Any, target: Any, bias: Any, cw: Any, spec: Spec, tc: int, accumulate: str = "float32",
    vocab_block: int = 0, logits: str = "float32", *, need_dx: bool = False, need_dw: bool = False,
    need_db: bool = False,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The chunked forward for CuPy arrays or torch CUDA tensors: x (T, H), w (V, H), target (T,),
    bias (V,) or None, cw (V,) class weights or None; `tc` tokens per chunk.

    Returns (loss, lse, dx_buf, dw_buf, db_buf, stats): the loss (0-d, or (T,) for 'none') and
    lse (T,) in the accumulator dtype; for 'mean'/'sum' with need_* the gradients of the
    *unscaled* sum of the per-token losses (dx (T, H) and dW (V, H) in ``plan.grad_dtype()``, db
    (V,) in the accumulator dtype, None where not needed): the backward multiplies them by
    ``stats[1]`` (the reduction's scale; "recompute" has applied it already), the upstream
    gradient and, for dW, ``1 / plan.dw_alpha()`` (:func:`scale_cast_gpu`). Where
    :func:`stores_logit_grads` holds, dw_buf is instead the logit gradient G (T, stored_ld(V)) in
    the input dtype, and dW = the same scales times G^T x (:func:`stored_dw_gpu`). stats: see
    ``ce_stats``. `vocab_block`: classes per block of the "recompute" mode's second pass (0
    otherwise); `logits`: the option of that name. Validated on a signature's first call."""
    plan = _plan(x, w, target, bias, cw, spec, tc, accumulate, vocab_block, logits)
    x, w, target, bias, cw = _prepare_inputs(x, w, target, bias, cw, plan.acc)
    stream = current_stream(plan.steps.device, hasattr(x, "data_ptr"))
    grads = spec.reduction != "none" and (need_dx or need_dw or need_db)
    return run_forward(plan, plan.steps, stream, x, w, target, bias, cw, need_dx=grads and need_dx,
                       need_dw=grads and need_dw, need_db=grads and need_db and bias is not None)


def run_forward(plan: Plan, steps: Any, stream: Any, x: Any, w: Any, target: Any, bias: Any, cw: Any, *,
                need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The forward's chunk loop (see forward_gpu): `steps` launches the row kernels, GEMMs go
    through ``cukit.ops.matmul.gemm``."""
    T, H, V, acc = plan.T, plan.H, plan.V, plan.acc
    none = plan.spec.reduction == "none"
    stats = _empty((3,), acc, x)
    lse = _empty((T,), acc, x)
    row_loss = _empty((T,), acc, x)
    loss = row_loss if none else _empty((), acc, x)
    steps.stats(target, cw, stats, T, stream)
    grads = need_dx or need_dw or need_db
    gdt = plan.grad_dtype()
    dx_buf = _empty((T, H), gdt, x) if need_dx else None
    # the stored logit gradient replaces the float32 dW (the backward makes dW from it)
    stored = need_dw and plan.stored
    # "recompute" allocates dW after the first pass, whose workspace may be as large
    dw_buf = _empty((V, H), gdt, x, zero=T == 0) if need_dw and not (plan.recompute and T) and not stored else None
    db_buf = _empty((V,), acc, x, zero=T == 0) if need_db else None
    # "recompute": the gradients come scaled by the reduction (u = one * stats[1] per row)
    one = _ones(acc, x) if plan.recompute and grads else None
    if T:
        ws, gview, ldg = _workspace(plan, x)
        if stored:
            ldg = stored_ld(V)
            gall = _empty((T, ldg), plan.dtype, x)
            if ldg > V:  # the row padding is an output too (of the torch op): defined, not garbage
                _fill_zero(gall[:, V:])
        partial = _empty((-(-plan.tc // _COLSUM_ROWS), V), acc, x) if need_db else None
        for i, r0 in enumerate(range(0, T, plan.tc)):
            n = min(plan.tc, T - r0)
            _logits(x[r0:r0 + n], w, ws[:n, :V])
            if stored:
                steps.rows(MODE_GRAD, ws, bias, target, cw, stats, None, one, None, lse, row_loss, r0, n, stream,
                           out=gall[r0:r0 + n], ldo=ldg)
                g = gall[r0:r0 + n, :V]
            else:
                steps.rows(MODE_GRAD if grads else MODE_LOSS, ws, bias, target, cw, stats, None, one, None, lse,
                           row_loss, r0, n, stream)
                g = gview[:n, :V]
            if not grads:
                continue
            if need_dx and H:
                _matmul.gemm(g, w, dx_buf[r0:r0 + n])
            if need_dw and H and not plan.recompute and not stored:
                _matmul.gemm(g.T, x[r0:r0 + n], dw_buf, alpha=plan.dw_alpha(), beta=0.0 if i == 0 else 1.0)
            if need_db:
                steps.colsum(g, ldg, partial, db_buf, n, i == 0, stream)
        if stored:
            dw_buf = gall
        if need_dw and plan.recompute:
            # every view of the first pass's workspace goes (the loop's `g` too): dW takes its place
            del ws, gview, partial, g
            dw_buf = _empty((V, H), gdt, x)
            _dw_by_vocab_blocks(plan, steps, stream, x, w, target, bias, cw, stats, None, one, None, lse, dw_buf)
    if not none:
        steps.total(row_loss, stats, loss, T, stream)
    return loss, lse, dx_buf, dw_buf, db_buf, stats


def _dw_by_vocab_blocks(plan: Plan, steps: Any, stream: Any, x: Any, w: Any, target: Any, bias: Any, cw: Any,
                        stats: Any, row_grad: Any, grad0: Any, lse_grad: Any, lse: Any, dw: Any) -> None:
    """The "recompute" mode's second pass: for each block of `plan.vb` classes, every token's
    logits (one GEMM), their gradient from the saved lse (ce_rows MODE_REGRAD over the block's
    columns: u = row_grad, or grad0 * stats[1]; v = lse_grad), and the block's rows of dW from one
    GEMM over all tokens (float32 inside it, rounded once into dw)."""
    T, H, V, vb, ldb = plan.T, plan.H, plan.V, plan.vb, plan.ldb
    ws = _empty((T, ldb), plan.wdt, x)
    gview = _view_as(ws, plan.dtype) if plan.narrow else ws  # the gradient written over its logits
    for c0 in range(0, V, vb):
        nb = min(vb, V - c0)
        _logits(x, w[c0:c0 + nb], ws[:, :nb])
        steps.rows(MODE_REGRAD, ws, bias, target, cw, stats, row_grad, grad0, lse_grad, lse, None, 0, T, stream,
                   col0=c0, cols=nb, ld=ldb)
        if H:
            _matmul.gemm(gview[:, :nb].T, x, dw[c0:c0 + nb])


def _logits(x: Any, w: Any, out: Any) -> None:
    """out = x @ w.T (raw logits into a workspace slice; zeros when H == 0)."""
    if x.shape[1]:
        _matmul.gemm(x, w.T, out)
    else:
        _fill_zero(out)


def _ones(dtype: str, like: Any) -> Any:
    """A 1-element array holding 1 on `like`'s device (the kernels' grad0 for u = stats[1])."""
    one = _empty((1,), dtype, like)
    if hasattr(one, "fill_"):
        one.fill_(1)
    else:
        one.fill(1)
    return one


def _workspace(plan: Plan, like: Any) -> tuple[Any, Any, int]:
    """The chunk's logits buffer (rows, ld) in the workspace dtype, the same memory viewed as the
    gradient's dtype, and the gradient's row stride in elements."""
    ws = _empty((min(plan.tc, plan.T), plan.ld), plan.wdt, like)
    if not plan.narrow:
        return ws, ws, plan.ld
    return ws, _view_as(ws, plan.dtype), 2 * plan.ld


def backward_gpu(
    x: Any, w: Any, target: Any, bias: Any, cw: Any, lse: Any, stats: Any, spec: Spec, tc: int,
    accumulate: str = "float32", vocab_block: int = 0, logits: str = "float32", *, grad_loss: Any,
    grad_lse: Any = None, need_dx: bool = True, need_dw: bool = True, need_db: bool = True,
) -> tuple[Any, Any, Any]:
    """The recomputing backward: (dx, dW, db) of (loss, lse) for the upstream gradients
    `grad_loss` ((T,) for 'none', 0-d otherwise) and `grad_lse` ((T,) or None), from the saved
    lse and stats. Arrays as forward_gpu's; None for a gradient not needed (db without a bias)."""
    plan = _plan(x, w, target, bias, cw, spec, tc, accumulate, vocab_block, logits)
    x, w, target, bias, cw = _prepare_inputs(x, w, target, bias, cw, plan.acc)
    stream = current_stream(plan.steps.device, hasattr(x, "data_ptr"))
    if hasattr(x, "data_ptr"):
        grad_loss = grad_loss.contiguous()
        grad_lse = None if grad_lse is None else grad_lse.contiguous()
    return run_backward(plan, plan.steps, stream, x, w, target, bias, cw, lse, stats, grad_loss, grad_lse,
                        need_dx=need_dx, need_dw=need_dw, need_db=need_db and bias is not None)


def run_backward(plan: Plan, steps: Any, stream: Any, x: Any, w: Any, target: Any, bias: Any, cw: Any, lse: Any,
                 stats: Any, grad_loss: Any, grad_lse: Any, *, need_dx: bool, need_dw: bool,
                 need_db: bool) -> tuple[Any, Any, Any]:
    """The backward's chunk loop (see backward_gpu)."""
    T, H, V, acc = plan.T, plan.H, plan.V, plan.acc
    none = plan.spec.reduction == "none"
    dx = _empty((T, H), plan.dtype, x) if need_dx else None
    # 16-bit inputs: a float32 dW, rounded once at the end
    separate = plan.accumulate == "float32" and plan.dtype != plan.acc
    blocks = plan.recompute and T > 0  # dW from the second pass (allocated after the first)
    dw = _empty((V, H), plan.dtype, x, zero=T == 0) if need_dw and not blocks else None
    dw_acc = _empty((V, H), acc, x, zero=T == 0) if need_dw and separate else dw
    db_acc = _empty((V,), acc, x, zero=T == 0) if need_db else None
    if T:
        ws, gview, ldg = _workspace(plan, x)
        partial = _empty((-(-plan.tc // _COLSUM_ROWS), V), acc, x) if need_db else None
        row_grad, grad0 = (grad_loss, None) if none else (None, grad_loss)
        for i, r0 in enumerate(range(0, T, plan.tc)):
            n = min(plan.tc, T - r0)
            _logits(x[r0:r0 + n], w, ws[:n, :V])
            steps.rows(MODE_REGRAD, ws, bias, target, cw, stats, row_grad, grad0, grad_lse, lse, None, r0, n,
                       stream)
            g = gview[:n, :V]
            if need_dx and H:
                _matmul.gemm(g, w, dx[r0:r0 + n])
            if need_dw and H and not blocks:
                _matmul.gemm(g.T, x[r0:r0 + n], dw_acc, beta=0.0 if i == 0 else 1.0)
            if need_db:
                steps.colsum(g, ldg, partial, db_acc, n, i == 0, stream)
        if need_dw and blocks:
            # every view of the first pass's workspace goes (the loop's `g` too): dW takes its place
            del ws, gview, partial, g
            dw = _empty((V, H), plan.dtype, x)
            _dw_by_vocab_blocks(plan, steps, stream, x, w, target, bias, cw, stats, row_grad, grad0, grad_lse, lse,
                                dw)
    if need_dw and separate:
        steps.scale_cast(dw_acc, dw, None, None, 1.0, stream)
    db = None
    if need_db:
        db = _empty((V,), dtype_name(bias), x)
        steps.scale_cast(db_acc, db, None, None, 1.0, stream)
    return dx, dw, db
