"""The contract between the matmul front end (cukit/ops/matmul.py) and the matmul kernel families
(cukit/ops/matmul_<family>.py with raw_kernels/matmul_<family>.cu).

A :class:`Gemm` describes one launch-ready problem on one device. Its epilogue
(:attr:`Gemm.epilogue`, ``cukit/gemm.cuh``'s ``Epilogue``) is one of::

    EPI_STORE       C[z, m, n] = act(sum_k A[z, m, k] * B[z, k, n] + bias[n])
    EPI_SCALE       C[z, m, n] = alpha * (sum_k A[z, m, k] * B[z, k, n] + bias[n])
    EPI_ACCUMULATE  C[z, m, n] = alpha * (sum_k A[z, m, k] * B[z, k, n] + bias[n]) + beta * C[z, m, n]
    EPI_SCALE_DEVICE  C[z, m, n] = alpha * s * sum_k A[z, m, k] * B[z, k, n], s = the float32 at ``bias``

for z in range(batch). EPI_STORE is the matmul path (C in A's dtype, alpha == 1, beta == 0); the
scaled epilogues take no activation, EPI_SCALE never reads C (beta == 0: C may hold NaN garbage)
and EPI_ACCUMULATE reads each element of C once before writing it (beta != 0). EPI_SCALE_DEVICE
(``device_scale=True``: beta 0, no bias) reads its scale on the device when the kernel runs, so a
scale computed by earlier kernels needs no host sync; only the TMA kernels run it.

- Element strides, not bytes. A is addressed ``A[z, m, k] = a + off_a(z) + m * sa_m + k * sa_k``
  with exactly one of ``sa_m``, ``sa_k`` equal to 1 (the front end copies operands that have no
  unit stride), likewise B with ``sb_k``, ``sb_n``. So each operand is either "row-major" or
  "column-major" (a transpose is a stride swap, never a copy).
- C is row-major with unit column stride: ``C[z, m, n] = c + z * sc_batch + m * ldc + n``, ldc >= N
  (default N) and sc_batch its batch stride (default M * ldc: contiguous C when ldc == N). Its
  dtype ``c_dtype`` is A's (None) or float32 (for bfloat16/float16 A: fp32 outputs of fp32
  accumulation).
- Batch: up to 3 batch dimensions (the broadcast result shape, outermost first, padded with 1s),
  each with A's and B's element stride (0 where that operand is broadcast). The flattened batch
  index z runs over ``nb0 * nb1 * nb2``; kernels decode it with ``cukit/gemm.cuh``'s
  ``batch_offset``. Strides and offsets are 64-bit.
- bias: a pointer to N elements of A's dtype, or 0. act: -1 (none) or an id of
  ``cukit/activations.cuh`` (bias_act's ACTIVATIONS); EPI_STORE only.
- alpha, beta: the scaled epilogues' scalars (doubles in the kernels' parameter lists, used in the
  accumulation type). ``scaled=True`` makes them launch arguments: a prepared run then takes
  ``(a, b, c, bias, alpha, beta)`` per call, so that changing them needs no new plan (only whether
  beta is 0 picks the kernel); ``scaled=False`` fixes them in the plan (alpha 1, beta 0) and a run
  takes ``(a, b, c, bias)``.
- M, N or K may be 0 or 1; K == 0 means C = act(bias) (or zeros; scaled: alpha * bias + beta * C):
  the front end handles M == 0 / N == 0 / batch == 0 (nothing to launch) but kernels must handle
  K == 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cukit.interop import DTYPES, DType

__all__ = [
    "EPI_ACCUMULATE",
    "EPI_SCALE",
    "EPI_SCALE_DEVICE",
    "EPI_STORE",
    "GEMM_SIGNATURE",
    "MAX_BATCH_DIMS",
    "SPLITK_SIGNATURE",
    "SPLITK_THREADS",
    "SPLIT_GAIN",
    "Gemm",
    "GemmFamily",
    "GemmRun",
    "SplitK",
    "Workspace",
    "prepare_split",
    "split_seconds",
    "split_slices",
    "split_traffic",
    "splitk_grid",
    "splitk_name",
]

# A ready launch: ``run(head, stream)`` with ``head = Gemm.head()``'s shape: device pointers
# (a, b, c, bias) of arrays that have the shapes, strides and alignment of the Gemm it was
# prepared for, followed by (alpha, beta) as Python floats when the Gemm is ``scaled``.
GemmRun = Callable[[tuple[Any, ...], Any], None]

# Scratch memory for a launch that needs it (split-K): ``workspace(nbytes)`` returns
# ``(owner, pointer)``, nbytes of device memory on the launch's device, 16-byte aligned, from a
# pool ordered on the stream the launch then uses (torch's caching allocator, CuPy's pool); the
# run keeps ``owner`` until its launches are queued.
Workspace = Callable[[int], tuple[Any, int]]

MAX_BATCH_DIMS = 3

# cukit/gemm.cuh's Epilogue.
EPI_STORE, EPI_SCALE, EPI_ACCUMULATE, EPI_SCALE_DEVICE = 0, 1, 2, 3

# The kernel parameter list every matmul kernel takes, in this order (see Gemm.kernel_args):
# A, B, C, bias, alpha, beta, M, N, K, ldc, sc, sa_m, sa_k, sb_k, sb_n, nb0, nb1, nb2, sa0, sa1, sa2,
# sb0, sb1, sb2
GEMM_SIGNATURE = "ptr ptr ptr ptr f64 f64 " + " ".join(["i64"] * 18)

_WIDE_OUT = ("bfloat16", "float16")  # A dtypes whose products may be written in float32


@dataclass(frozen=True)
class Gemm:
    """One batched GEMM problem, ready to launch (see the module docstring for the maths)."""

    dtype: DType  # A, B and bias share it
    M: int
    N: int
    K: int
    a: int  # device pointers
    b: int
    c: int
    bias: int  # 0: no bias
    act: int  # -1: no activation
    sa_m: int
    sa_k: int
    sb_k: int
    sb_n: int
    batch: tuple[int, int, int] = (1, 1, 1)
    sa_batch: tuple[int, int, int] = (0, 0, 0)
    sb_batch: tuple[int, int, int] = (0, 0, 0)
    precision: str = "ieee"  # or "tf32" (float32 inputs only)
    device: int = 0
    c_dtype: DType | None = None  # None: dtype
    ldc: int | None = None  # C's row stride in elements; None: N
    sc_batch: int | None = None  # C's stride between consecutive batches z; None: M * ldc
    alpha: float = 1.0
    beta: float = 0.0
    scaled: bool = False  # alpha and beta are launch arguments (see the module docstring)
    device_scale: bool = False  # EPI_SCALE_DEVICE: ``bias`` points to a float32 scale of the product

    def __post_init__(self) -> None:
        if (self.sa_m == 1) == (self.sa_k == 1) and not (self.M <= 1 or self.K <= 1):
            raise ValueError(f"A needs exactly one unit stride; got sa_m={self.sa_m}, sa_k={self.sa_k}")
        if (self.sb_k == 1) == (self.sb_n == 1) and not (self.K <= 1 or self.N <= 1):
            raise ValueError(f"B needs exactly one unit stride; got sb_k={self.sb_k}, sb_n={self.sb_n}")
        if self.ldc is None:
            object.__setattr__(self, "ldc", self.N)
        if self.sc_batch is None:
            object.__setattr__(self, "sc_batch", self.M * self.ldc)
        out = self.out_dtype.name
        if out != self.dtype.name and not (out == "float32" and self.dtype.name in _WIDE_OUT):
            raise ValueError(f"C must have A's dtype {self.dtype.name} (or float32 for 16-bit A); got {out}")
        if self.M > 1 and self.ldc < self.N:
            raise ValueError(f"C's rows overlap: ldc={self.ldc} < N={self.N}")
        if self.batch_count > 1 and self.M > 0 and self.N > 0 and self.sc_batch < (self.M - 1) * self.ldc + self.N:
            raise ValueError(f"C's batches overlap: sc_batch={self.sc_batch} for {self.M} rows of stride {self.ldc}")
        if not self.scaled and (self.alpha != 1.0 or self.beta != 0.0):
            raise ValueError(f"alpha and beta need scaled=True; got alpha={self.alpha}, beta={self.beta}")
        if self.device_scale and (not self.scaled or self.beta != 0.0 or self.act >= 0):
            raise ValueError("device_scale needs scaled=True, beta == 0 and no activation")
        if self.act >= 0 and self.epilogue != EPI_STORE:
            raise ValueError(
                "an activation needs the matmul epilogue (C in A's dtype, alpha == 1, beta == 0, scaled=False)"
            )

    @property
    def batch_count(self) -> int:
        return self.batch[0] * self.batch[1] * self.batch[2]

    @property
    def out_dtype(self) -> DType:
        """C's dtype."""
        return self.dtype if self.c_dtype is None else self.c_dtype

    @property
    def epilogue(self) -> int:
        """The kernels' EPI: EPI_STORE for the matmul path (not scaled, C in A's dtype),
        EPI_SCALE_DEVICE for ``device_scale``, else EPI_ACCUMULATE when beta != 0 and EPI_SCALE
        when it is 0 (C is then never read)."""
        if self.device_scale:
            return EPI_SCALE_DEVICE
        if not self.scaled and self.out_dtype.name == self.dtype.name:
            return EPI_STORE
        return EPI_ACCUMULATE if self.beta != 0 else EPI_SCALE

    @property
    def a_row_major(self) -> bool:
        """A[m, k] has unit stride along k (the usual layout; False: a transposed view)."""
        return self.sa_k == 1

    @property
    def b_row_major(self) -> bool:
        """B[k, n] has unit stride along n (False: B is the transpose of a row-major (N, K),
        e.g. nn.Linear's weight)."""
        return self.sb_n == 1

    @property
    def n_head(self) -> int:
        """How many leading kernel arguments a prepared run takes per call: the 4 pointers, and
        alpha and beta when ``scaled``."""
        return 6 if self.scaled else 4

    def head(self) -> tuple[Any, ...]:
        """A prepared run's per-call arguments for this problem: ``(a, b, c, bias)``, plus
        ``(alpha, beta)`` when ``scaled``."""
        if self.scaled:
            return (self.a, self.b, self.c, self.bias, float(self.alpha), float(self.beta))
        return (self.a, self.b, self.c, self.bias)

    def kernel_args(self) -> tuple[Any, ...]:
        """The argument tuple for GEMM_SIGNATURE."""
        return (
            self.a, self.b, self.c, self.bias, float(self.alpha), float(self.beta),
            self.M, self.N, self.K, self.ldc, self.sc_batch,
            self.sa_m, self.sa_k, self.sb_k, self.sb_n,
            *self.batch, *self.sa_batch, *self.sb_batch,
        )

    def kernel_tail(self) -> tuple[Any, ...]:
        """The kernel arguments a prepared run fixes (those after :meth:`head`'s)."""
        return self.kernel_args()[self.n_head:]


class GemmFamily(Protocol):
    """What a kernel family module (``cukit/ops/matmul_<family>.py``) provides to the front end."""

    def supports(self, g: Gemm) -> bool:
        """Whether the family runs ``g`` (dtype, C's dtype, epilogue, precision, layout, alignment,
        device)."""
        ...

    def prepare(self, g: Gemm, *, version: str) -> GemmRun:
        """A ready launch for every problem of ``g``'s signature (the plan cache keeps it), called
        as ``run(head, stream)`` with ``head`` shaped as ``g.head()``. A family whose module sets
        ``SPLITS_K = True`` also takes ``workspace=`` (a :data:`Workspace`), which lets the run
        split K over scratch memory."""
        ...

    def launch(self, g: Gemm, stream: Any) -> None:
        """``prepare(g)(g.head(), stream)``."""
        ...


# ---------------------------------------------------------------------------------------------
# Split-K, shared by the families that offer it (SPLITS_K)
# ---------------------------------------------------------------------------------------------


def split_slices(g: Gemm, splits: int) -> Gemm:
    """The first pass of ``g`` split into ``splits`` slices of K (splits divides K, ``g`` unbatched):
    a batch of ``splits`` products, slice s reading A and B at k in [s K / S, (s + 1) K / S) (a batch
    stride of K / S along k), into a workspace of ``splits`` contiguous M x N partial products in the
    accumulation type (float32 for 16-bit inputs, written through the scaled epilogue, which keeps
    them unrounded), no bias, no activation. Its run takes ``(a, b, workspace, 0)``, plus
    ``(1.0, 0.0)`` when it is ``scaled``."""
    ks = g.K // splits
    acc = DTYPES["float64" if g.dtype.name == "float64" else "float32"]
    wide = acc.name != g.dtype.name
    return dataclasses.replace(
        g, K=ks, batch=(splits, 1, 1), sa_batch=(ks * g.sa_k, 0, 0), sb_batch=(ks * g.sb_k, 0, 0), c=0, bias=0,
        act=-1, c_dtype=acc if wide else None, ldc=g.N, sc_batch=g.M * g.N, alpha=1.0, beta=0.0, scaled=wide,
        device_scale=False,
    )


# Split-K's cost beyond its slices (split_seconds): the bytes per second of the workspace's round
# trip (written by the slices, read by the sum; mostly in L2) and the sum's launch. A family takes
# a split only when its estimate beats one pass by SPLIT_GAIN.
_WS_BYTES_PER_S = 2.5e12
_REDUCE_S = 4e-6
SPLIT_GAIN = 0.85


def split_traffic(g: Gemm, splits: int) -> int:
    """Bytes split-K moves beyond the one-pass product: the workspace written by the slices and read
    by the sum, C written by the sum (and read, for EPI_ACCUMULATE)."""
    acc = 8 if g.dtype.name == "float64" else 4
    return (2 * splits * acc + g.out_dtype.itemsize * (1 + (g.epilogue == EPI_ACCUMULATE))) * g.M * g.N


def split_seconds(g: Gemm, splits: int) -> float:
    """Estimated seconds split-K adds to its slices' product: :func:`split_traffic` and the sum's
    launch (the families' cost models add it to their estimate of the slices)."""
    return split_traffic(g, splits) / _WS_BYTES_PER_S + _REDUCE_S


def splitk_name(dtype: str, out: str, act: int, epi: int) -> str:
    """The NVRTC name of ``cukit/gemm.cuh``'s ``splitk_reduce`` for inputs (and bias) in `dtype`, C in
    `out`, activation `act` and epilogue `epi` (a Gemm's: ``dtype.name, out_dtype.name, act,
    epilogue``)."""
    return f"splitk_reduce<{DTYPES[dtype].ctype}, {DTYPES[out].ctype}, {act}, {epi}>"


SPLITK_SIGNATURE = "ptr ptr ptr f64 f64 i64 i64 i64 i64"  # W, C, bias, alpha, beta, S, M, N, ldc
SPLITK_THREADS = 256  # splitk_reduce's __launch_bounds__


def splitk_grid(g: Gemm, sms: int) -> tuple[int]:
    """splitk_reduce's grid for ``g``: one thread per 16-byte vector of the workspace's rows, at most
    four blocks per SM (the kernel strides over the rest)."""
    vec = 16 // (8 if g.dtype.name == "float64" else 4)
    total = g.M * -(-g.N // vec)
    return (max(1, min(-(-total // SPLITK_THREADS), 4 * sms)),)


class SplitK:
    """The ready launch (``run(head, stream)``, a :data:`GemmRun`) of a split-K problem: a workspace
    from the caller's allocator, the slices' batched product into it (``slices``, prepared for
    :func:`split_slices`), then ``splitk_reduce`` (``reduce``, head ``(W, C, bias, alpha, beta)``)
    into C with the problem's bias, activation and alpha / beta."""

    __slots__ = ("nbytes", "reduce", "scaled", "slice_scalars", "slices", "splits", "workspace")

    def __init__(self, g: Gemm, splits: int, slices: GemmRun, reduce: GemmRun, workspace: Workspace) -> None:
        part = split_slices(g, splits)
        self.slices, self.reduce, self.workspace, self.splits = slices, reduce, workspace, splits
        self.nbytes = splits * g.M * g.N * part.out_dtype.itemsize
        self.scaled = g.scaled
        self.slice_scalars: tuple[float, ...] = (1.0, 0.0) if part.scaled else ()

    def __call__(self, head: tuple[Any, ...], stream: Any) -> None:
        owner, ws = self.workspace(self.nbytes)
        self.slices((head[0], head[1], ws, 0, *self.slice_scalars), stream)
        alpha, beta = (head[4], head[5]) if self.scaled else (1.0, 0.0)
        self.reduce((ws, head[2], head[3], alpha, beta), stream)
        del owner  # a stream-ordered pool hands it out again only to work queued after these launches


def prepare_split(g: Gemm, splits: int, slices: GemmRun, module: Any, sms: int, workspace: Workspace) -> SplitK:
    """The :class:`SplitK` run of ``g``: ``slices`` (the family's run of :func:`split_slices`) and
    the sum, prepared from the family's kernel module (a ``cukit._runtime.KernelModule`` that
    instantiates ``splitk_reduce`` for ``g``'s types) on a device of `sms` SMs."""
    reduce = module.prepare(
        splitk_name(g.dtype.name, g.out_dtype.name, g.act, g.epilogue), splitk_grid(g, sms), (SPLITK_THREADS,),
        (splits, g.M, g.N, g.ldc), device=g.device,
    )
    return SplitK(g, splits, slices, reduce, workspace)
