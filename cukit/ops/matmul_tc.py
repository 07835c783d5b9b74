"""Tensor-core matmul kernels: ``raw_kernels/matmul_tc.cu``.

Inputs bfloat16 or float16 (fp32 accumulation), or float32 with precision "tf32" (each operand
rounded to tf32 with ``cvt.rna`` by mma.sync, truncated to it by the TMA kernel's wgmma; fp32
accumulation); C in the input dtype after the fused
epilogue ``act(acc + bias)`` in fp32 (the matmul path), or with the scaled epilogues
``alpha * (acc + bias) (+ beta * C)`` in the input dtype or float32, rows ``ldc`` apart
(:class:`cukit.ops._gemm.Gemm`; ``matmul_tc`` and ``matmul_tc_tma`` run them, the cp.async wgmma
kernel does not).

The kernel contract is :class:`cukit.ops._gemm.Gemm`: any M, N, K (K == 0: C = act(bias)), either
operand row- or column-major (by its unit stride; no transposed copies), up to three broadcast
batch dimensions (``blockIdx.z``; the TMA kernel: a tensor-map dimension). Block tiles of
128 x 256 x 128 bytes of K (the TMA kernel: 128 x 256, 128 x 128 or 128 x 64, :func:`tma_tile_n`).

Three kernels in the one file (:func:`route` picks one):

- ``matmul_tc`` (``mma.sync`` + ``ldmatrix``, sm_80+): every dtype and layout. 8 warps of 64 x 64;
  K-major tiles feed ``ldmatrix``, M/N-major ones ``ldmatrix.trans`` (fp32: 32-bit loads).
- ``matmul_tc_tma`` (Hopper, sm_90a, compute capability 9.0 only, :func:`uses_tma`): bfloat16 /
  float16 in any layout, float32 as tf32 with A and B both K-major (``x @ W.T``; tf32 wgmma has no
  transposed operands), 16-byte aligned rows. Warp-specialised: one producer thread feeds a ring
  of 4 (6, 8) stages with the bulk tensor copy engine (TMA, tensor maps encoded here by the
  driver's ``cuTensorMapEncodeTiled``), 2 consumer warpgroups run wgmma; persistent grid. Tiles
  of 128 x 256 are cooperative (each warpgroup 64 x 256 of every tile), tiles of 128 x 128 and
  128 x 64 ping-pong (each warpgroup whole tiles in turn, one's epilogue under the other's
  mainloop). The width is chosen per problem by a wave-quantisation model, :func:`tma_tile_n`.
- ``matmul_tc_wgmma`` (Hopper, sm_90a): bfloat16/float16 with A and B both K-major, loaded by
  ``cp.async``; it runs the misaligned case (load path 0) of ``x @ W.T``, which TMA cannot take.

Load paths (template ``VEC``), picked per problem by :func:`load_path`:

- 1: every operand row starts 16-byte aligned: ``cp.async`` 16 B into a ring of 3-4 stages.
- 2 (float32 only): rows 4-byte aligned: the same ring with 4-byte ``cp.async``.
- 0 (16-bit only): any alignment (an odd leading dimension, e.g. K = 4093): aligned 16-byte
  chunks are staged two k-tiles ahead and shifted into place in shared memory.

Split-K (:func:`choose_split`, TMA problems only): when the tiles of an unbatched product leave
SMs idle and K is long (a weight gradient ``dW = G^T X`` over many tokens into a narrow layer),
the TMA kernel runs S slices of K / S as one batched launch into a float32 workspace the caller
allocates (``prepare(..., workspace=...)``), and ``splitk_reduce`` sums the partial products in
slice order (deterministic), applies the epilogue and rounds once to C's dtype.

The front end (``cukit/ops/matmul.py``) builds the :class:`Gemm`; :func:`supports` says whether
this family takes it and :func:`launch` runs it on a stream.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from cukit._device import device_caps
from cukit._runtime import KernelModule, Launch, retry_without_context
from cukit.interop import DTYPES
from cukit.ops._gemm import (
    EPI_ACCUMULATE,
    EPI_SCALE,
    EPI_SCALE_DEVICE,
    EPI_STORE,
    GEMM_SIGNATURE,
    SPLIT_GAIN,
    SPLITK_SIGNATURE,
    Gemm,
    SplitK,
    Workspace,
    prepare_split,
    split_seconds,
    split_slices,
    splitk_name,
)

__all__ = [
    "KERNELS",
    "KERNELS_SM90A",
    "LOADS",
    "SCALED",
    "SCALED_TMA",
    "SPLITS_K",
    "choose_split",
    "kernel_name",
    "launch",
    "load_path",
    "operand_layouts",
    "prepare",
    "route",
    "smem_bytes",
    "supports",
    "tma_if_aligned",
    "tma_maps",
    "tma_name",
    "tma_specs",
    "tma_tile_n",
    "tma_tile_rate",
    "uses_tma",
    "uses_wgmma",
    "wgmma_name",
]

# Activation ids: -1 (none) and cukit/activations.cuh's (bias_act's ACTIVATIONS).
ACTS = (-1, 0, 1, 2, 3)
# (A K-major, B K-major): A row-major / column-major, B column-major (nn.Linear's weight) / row-major.
LAYOUTS = ((True, True), (True, False), (False, True), (False, False))
# Load paths instantiated per dtype (see the module docstring).
LOADS: dict[str, tuple[int, ...]] = {"bfloat16": (1, 0), "float16": (1, 0), "float32": (1, 2)}
# The scaled epilogues instantiated per input dtype, (C's dtype, EPI) (cukit/gemm.cuh): no
# activation; C in the input dtype or, for 16-bit inputs, float32 (the fp32 accumulation's own
# precision: dW += G^T X of a fused loss, optimizer statistics).
SCALED: dict[str, tuple[tuple[str, int], ...]] = {
    "bfloat16": tuple((out, epi) for out in ("float32", "bfloat16") for epi in (EPI_SCALE, EPI_ACCUMULATE)),
    "float16": tuple((out, epi) for out in ("float32", "float16") for epi in (EPI_SCALE, EPI_ACCUMULATE)),
    "float32": (("float32", EPI_SCALE), ("float32", EPI_ACCUMULATE)),
}
# EPI_SCALE_DEVICE (a scale read on the device): the TMA kernels only, C in the 16-bit input dtype
# (a fused loss's dW, rounded once after the scale its kernels computed).
SCALED_TMA: dict[str, tuple[tuple[str, int], ...]] = {
    "bfloat16": (("bfloat16", EPI_SCALE_DEVICE),),
    "float16": (("float16", EPI_SCALE_DEVICE),),
}
_EPI_NAMES = {EPI_SCALE: "scale", EPI_ACCUMULATE: "accumulate", EPI_SCALE_DEVICE: "scale_device"}

BM, BN, KB, THREADS = 128, 256, 128, 256  # must match raw_kernels/matmul_tc.cu
STAGE = (BM + BN) * KB  # bytes of one A + B k-tile (48 KiB)
_MAX_GRID_Z = 65535
_INT32_MAX = 2**31 - 1


def _scaled_args(dtype: str, out: str | None, epi: int, tma: bool = False) -> str:
    """The trailing template arguments (C's type, EPI) of a scaled instantiation; "" for the
    matmul epilogue (the kernels' defaults: C in the input type, EPI_STORE). `tma`: the TMA
    kernel's, which also has :data:`SCALED_TMA`."""
    if epi == EPI_STORE:
        if out not in (None, dtype):
            raise ValueError(f"matmul_tc: the matmul epilogue writes C in the input dtype {dtype}; got {out}")
        return ""
    if (out or dtype, epi) not in SCALED[dtype] + (SCALED_TMA.get(dtype, ()) if tma else ()):
        raise ValueError(f"matmul_tc: no scaled instantiation for {dtype} -> {out or dtype}, epilogue {epi}")
    return f", {DTYPES[out or dtype].ctype}, {epi}"


def kernel_name(
    dtype: str, act: int, a_k: bool, b_k: bool, load: int, *, out: str | None = None, epi: int = EPI_STORE
) -> str:
    """The NVRTC name expression of one instantiation; `out` (C's dtype, None: the input's) and
    `epi` select the scaled epilogues (:data:`SCALED`)."""
    tail = _scaled_args(dtype, out, epi)
    return f"matmul_tc<{DTYPES[dtype].ctype}, {act}, {int(a_k)}, {int(b_k)}, {load}{tail}>"


def _instantiations() -> dict[str, list[str]]:
    # One group per (dtype, load path, activation), its four layouts together (~2.5 s of NVRTC):
    # a model's forward (one activation) and backward (none, three layouts) compile two groups.
    # The scaled epilogues: one group per (dtype, load path, C's dtype, EPI).
    groups: dict[str, list[str]] = {}
    for dtype, loads in LOADS.items():
        for load in loads:
            for act in ACTS:
                groups[f"{dtype}/vec{load}/act{act}"] = [
                    kernel_name(dtype, act, a, b, load) for a, b in LAYOUTS
                ]
            for out, epi in SCALED[dtype]:
                groups[f"{dtype}/vec{load}/{out}-{_EPI_NAMES[epi]}"] = [
                    kernel_name(dtype, -1, a, b, load, out=out, epi=epi) for a, b in LAYOUTS
                ]
        # split-K's sum (cukit/gemm.cuh): every epilogue the one-pass kernels have
        groups[f"{dtype}/splitk"] = [splitk_name(dtype, dtype, act, EPI_STORE) for act in ACTS] + [
            splitk_name(dtype, out, -1, epi) for out, epi in SCALED[dtype]
        ]
    return groups


KERNELS = KernelModule(
    "matmul_tc.cu",
    instantiations=_instantiations(),
    signatures={"matmul_tc": GEMM_SIGNATURE, "splitk_reduce": SPLITK_SIGNATURE},
)


def wgmma_name(dtype: str, act: int, load: int) -> str:
    """The NVRTC name expression of one sm_90a (wgmma) instantiation."""
    return f"matmul_tc_wgmma<{DTYPES[dtype].ctype}, {act}, {load}>"


def tma_name(
    dtype: str,
    act: int,
    a_k: bool,
    b_k: bool,
    tile_n: int = 256,
    pingpong: bool | None = None,
    *,
    out: str | None = None,
    epi: int = EPI_STORE,
) -> str:
    """The NVRTC name expression of one TMA + wgmma instantiation (block tiles 128 x tile_n).
    `pingpong` None: the schedule :data:`TMA_PINGPONG` gives the width (128 x 256 tiles run
    cooperatively, 128 x 128 ping-pong); True/False instantiates the other one (benchmarks).
    `out`, `epi`: as :func:`kernel_name`."""
    pp = TMA_PINGPONG[tile_n] if pingpong is None else pingpong
    tail = _scaled_args(dtype, out, epi, tma=True)
    return f"matmul_tc_tma<{DTYPES[dtype].ctype}, {act}, {int(a_k)}, {int(b_k)}, {tile_n}, {int(pp)}{tail}>"


# map_a, map_b (CUtensorMap by value), C, bias, alpha, beta, M, N, K, ldc, sc (C's batch stride), batch
TMA_SIGNATURE = "b128 b128 ptr ptr f64 f64 i64 i64 i64 i64 i64 i64"
TMA_THREADS = 288  # 2 consumer warpgroups + 1 producer warp
# Block-tile widths of the TMA kernel (its template BN; the tiles are 128 x BN), widest first.
TMA_TILE_N = (256, 192, 128, 64)
# The consumer schedule per width: 128 x 256 tiles are cooperative (both warpgroups on each tile,
# 64 x 256 each: a warpgroup cannot hold 128 x 256 accumulators); 128 x 128 tiles are ping-pong
# (each warpgroup takes whole tiles in turn, so one's epilogue runs under the other's mainloop);
# so are 128 x 64 tiles, which exist for problems too small to give every SM a 128 x 128 tile.
# 128 x 192 tiles are cooperative like 128 x 256 (96 accumulators per thread): they fill waves that
# 256 leaves ragged (4096 x 768 is 128 of them: one full wave on 132 SMs; N = 384 is two).
TMA_PINGPONG: dict[int, bool] = {256: False, 192: False, 128: True, 64: True}
# Throughput per unit of useful work when every wave is full (the wave model's third factor, see
# tma_tile_n and tma_tile_rate), relative to 128 x 256 tiles whose epilogue would cost nothing.
# Cooperative 128 x 256 tiles stop the tensor cores for each tile's epilogue, a cost that does not
# shrink with K: rate K / (K + TMA_EPILOGUE_K). Ping-pong 128 x 128 tiles hide it under the other
# warpgroup's mainloop but move 1.33x the bytes per FLOP into shared memory (32 KiB per 2.1 MFLOP
# vs 48 KiB per 4.2): a constant rate. Calibrated on an H100 (bf16, NN and NT, both widths
# forced, shapes whose waves are full for both, K from 768 to 8192: ping-pong / cooperative
# throughput 1.08-1.10 at K = 768, 1.07 at 1024, 0.96 at 8192; benchmarks/NOTES.md, matmul v7).
TMA_EPILOGUE_K = 128
TMA_PINGPONG_RATE = 0.94
# 128 x 64 tiles move 1.5x the shared-memory bytes per FLOP of 128 x 128 ones (24 KiB per 1 MFLOP)
# and their wgmma (m64n64k16) does half the work per instruction: a lower constant rate, so that
# they win only where the wider tiles would leave SMs idle (1024^3: 64 tiles of 128 x 128 on 132
# SMs, 128 of 128 x 64). Calibrated on an H100 (bf16, NN and NT, shapes where both widths run two or
# more tiles per CTA in full waves, K = 768 to 1024: 128 x 64 / 128 x 128 throughput 0.78-0.85,
# times TMA_PINGPONG_RATE; benchmarks/NOTES.md, matmul v8 and v10).
TMA_NARROW_RATE = 0.80
# 128 x 192 tiles move 1.11x the bytes per FLOP of 128 x 256 ones (40 KiB per 3.1 MFLOP vs 48 per
# 4.2): the cooperative rate times this factor. Calibrated on an H100 (bf16, both widths in full
# waves, K = 3072 to 8192: 128 x 192 / 128 x 256 throughput 0.98-1.0; benchmarks/NOTES.md, v10).
TMA_MID_RATE = 0.98
# Dynamic shared memory per width, as raw_kernels/matmul_tc.cu's tma::Cfg<BN> lays it out: as many
# ring stages (A + B k-tile: 48 / 32 / 24 KiB) as fit in 227 KiB beside the two epilogue staging
# buffers (64 x (256 + 8) bytes each), 2 mbarriers per stage and 1 KiB lost to alignment, at most 8:
# 4 / 6 / 8 stages.
_SMEM_OPTIN_SM90 = 227 * 1024
_TMA_OUT = 2 * 64 * (128 * 2 + 8)
TMA_STAGES: dict[int, int] = {
    bn: min(8, (_SMEM_OPTIN_SM90 - _TMA_OUT - 1024) // ((BM + bn) * KB + 16)) for bn in TMA_TILE_N
}
TMA_SMEM: dict[int, int] = {bn: TMA_STAGES[bn] * ((BM + bn) * KB + 16) + _TMA_OUT + 1024 for bn in TMA_TILE_N}

# The sm_90a kernels (Hopper's warpgroup MMA): per (dtype, activation) one group of the cp.async
# wgmma kernels (K-major A and B, both load paths) and per (dtype, activation, tile width) one of
# the TMA kernels (4 layouts; float32 as tf32: the K-major one only): a model's forward (its
# activation) and backward (none, 3 layouts) compile the groups of the widths its shapes pick;
# per (dtype, tile width, C's dtype, EPI) one of the scaled TMA kernels. `cukit check-kernels
# --arch sm_90` compiles them for sm_90a.
_TMA_LAYOUTS: dict[str, tuple[tuple[bool, bool], ...]] = {
    "bfloat16": LAYOUTS, "float16": LAYOUTS, "float32": ((True, True),)
}
KERNELS_SM90A = KernelModule(
    "matmul_tc.cu",
    instantiations={
        **{
            f"{dtype}/wgmma/act{act}": [wgmma_name(dtype, act, load) for load in (1, 0)]
            for dtype in ("bfloat16", "float16")
            for act in ACTS
        },
        **{
            f"{dtype}/tma{bn}/act{act}": [tma_name(dtype, act, a, b, bn) for a, b in layouts]
            for dtype, layouts in _TMA_LAYOUTS.items()
            for act in ACTS
            for bn in TMA_TILE_N
        },
        **{
            f"{dtype}/tma{bn}/{out}-{_EPI_NAMES[epi]}": [
                tma_name(dtype, -1, a, b, bn, out=out, epi=epi) for a, b in layouts
            ]
            for dtype, layouts in _TMA_LAYOUTS.items()
            for out, epi in SCALED[dtype] + SCALED_TMA.get(dtype, ())
            for bn in TMA_TILE_N
        },
    },
    signatures={"matmul_tc_wgmma": GEMM_SIGNATURE, "matmul_tc_tma": TMA_SIGNATURE},
    arch="sm_90a",
)


# ---------------------------------------------------------------------------------------------
# Problem analysis (pure functions of the Gemm: testable without a GPU)
# ---------------------------------------------------------------------------------------------


def operand_layouts(g: Gemm) -> tuple[bool, bool]:
    """(A K-major, B K-major) as the kernel reads them. K-major A addresses A[m, k] as
    m * sa_m + k (needs sa_k == 1 unless K <= 1); M-major as k * sa_k + m (needs sa_m == 1 unless
    M <= 1). Likewise B with (sb_n, sb_k) and N."""
    a_k = g.sa_k == 1 or (g.sa_m != 1 and g.M > 1)
    b_k = g.sb_k == 1 or (g.sb_n != 1 and g.N > 1)
    return a_k, b_k


def _aligned(
    ptr: int,
    rows: int,
    ld: int,
    batch: tuple[int, int, int],
    strides: tuple[int, int, int],
    itemsize: int,
    align: int,
) -> bool:
    if ptr % align:
        return False
    if rows > 1 and (ld * itemsize) % align:
        return False
    return all(n <= 1 or (s * itemsize) % align == 0 for n, s in zip(batch, strides, strict=True))


def load_path(g: Gemm) -> int:
    """The kernel's VEC template argument for this problem: 1 when every row start of A and B
    (pointer, leading dimension, batch strides) is 16-byte aligned, else 2 for float32 (4-byte
    copies) and 0 for the 16-bit types (staged and shifted)."""
    a_k, b_k = operand_layouts(g)
    sz = g.dtype.itemsize
    rows_a, ld_a = (g.M, g.sa_m) if a_k else (g.K, g.sa_k)
    rows_b, ld_b = (g.N, g.sb_n) if b_k else (g.K, g.sb_k)

    def ok(align: int) -> bool:
        return _aligned(g.a, rows_a, ld_a, g.batch, g.sa_batch, sz, align) and _aligned(
            g.b, rows_b, ld_b, g.batch, g.sb_batch, sz, align
        )

    if ok(16):
        return 1
    if g.dtype.name == "float32" and ok(4):
        return 2
    return 0 if sz == 2 else -1


def _geo_staging(itemsize: int, k_major: bool, mn: int) -> int:
    """Bytes of one operand's staging tile (load path 0): rows x (chunks per row + 1) x 16."""
    rows = mn if k_major else KB // itemsize
    chunks = KB // 16 if k_major else mn * itemsize // 16
    return rows * (chunks + 1) * 16


def smem_bytes(g: Gemm, load: int, optin: int) -> int:
    """Dynamic shared memory of a launch (0: does not fit in `optin` bytes). Paths 1 and 2: as
    many 48 KiB stages as fit, up to 4 (3 at least); path 0: 2 compute tiles + 2 staging tiles."""
    if load == 0:
        a_k, b_k = operand_layouts(g)
        sz = g.dtype.itemsize
        need = 2 * STAGE + 2 * (_geo_staging(sz, a_k, BM) + _geo_staging(sz, b_k, BN))
        return need if need <= optin else 0
    stages = min(4, optin // STAGE)
    return stages * STAGE if stages >= 3 else 0


def wgmma_smem_bytes(load: int) -> int:
    """Dynamic shared memory of a wgmma launch (+1 KiB to align the tiles to 1024 bytes)."""
    if load == 1:
        return 4 * STAGE + 1024
    return 2 * STAGE + 2 * (_geo_staging(2, True, BM) + _geo_staging(2, True, BN)) + 1024


def uses_wgmma(g: Gemm, load: int | None = None) -> bool:
    """Whether the cp.async wgmma kernels can run ``g``: a compute capability 9.0 device (sm_90a
    code runs there only), bfloat16/float16, A and B both K-major (x @ W.T), load path 0 or 1,
    the matmul epilogue (the scaled ones run on TMA or mma.sync)."""
    if g.dtype.name not in ("bfloat16", "float16") or operand_layouts(g) != (True, True):
        return False
    if g.epilogue != EPI_STORE:
        return False
    load = load_path(g) if load is None else load
    if load not in (0, 1):
        return False
    try:
        cc, optin = _device_caps(g.device)
    except Exception:
        return False
    return cc == 90 and wgmma_smem_bytes(load) <= optin


_TMA_MAX_DIM = 2**31 - 1  # TMA coordinates are signed 32-bit
_TMA_MAX_STRIDE = 2**40  # bytes


def tma_batch(g: Gemm) -> tuple[int, int, int] | None:
    """The batch as one tensor-map dimension: (count, A's stride, B's stride) in elements, when the
    batch dimensions collapse into one and neither operand is broadcast (TMA strides are positive);
    else None."""
    dims = [(n, sa, sb) for n, sa, sb in zip(g.batch, g.sa_batch, g.sb_batch, strict=True) if n > 1]
    if not dims:
        return 1, 0, 0
    n, sa, sb = dims[-1]
    for n_out, sa_out, sb_out in reversed(dims[:-1]):
        if sa_out != sa * n or sb_out != sb * n:
            return None
        n *= n_out
    return (n, sa, sb) if sa > 0 and sb > 0 else None


def tma_if_aligned(g: Gemm) -> bool:
    """Whether the TMA + wgmma kernels would run ``g`` were its rows 16-byte aligned: compute
    capability 9.0, bfloat16/float16 or float32 with precision "tf32" and both operands K-major,
    K > 0, the batch as one dimension (:func:`tma_batch`) and sizes within the tensor map's ranges.
    The matmul front end asks it before repacking misaligned operands ("pad-and-run")."""
    if g.K <= 0:
        return False
    if g.dtype.name == "float32":
        if g.precision != "tf32" or operand_layouts(g) != (True, True):
            return False
    elif g.dtype.name not in ("bfloat16", "float16"):
        return False
    b = tma_batch(g)
    if b is None or max(g.M, g.N, g.K, b[0]) > _TMA_MAX_DIM:
        return False
    sz = g.dtype.itemsize
    if max(abs(g.sa_m), abs(g.sa_k), abs(g.sb_k), abs(g.sb_n), b[1], b[2]) * sz >= _TMA_MAX_STRIDE:
        return False
    try:
        cc, optin = _device_caps(g.device)
    except Exception:
        return False
    return cc == 90 and optin >= max(TMA_SMEM.values())


def tma_tile_rate(tile_n: int, K: int) -> float:
    """Relative throughput of the TMA kernel's 128 x `tile_n` tiles on a problem of depth `K` when
    every wave is full: ``TMA_NARROW_RATE`` for 128 x 64 tiles, ``TMA_PINGPONG_RATE`` for the
    other ping-pong tiles, ``K / (K + TMA_EPILOGUE_K)`` for cooperative ones (the epilogue's share
    of a tile's time falls as K grows), times ``TMA_MID_RATE`` for 128 x 192."""
    if tile_n == 64:
        return TMA_NARROW_RATE
    if TMA_PINGPONG[tile_n]:
        return TMA_PINGPONG_RATE
    coop = K / (K + TMA_EPILOGUE_K) if K > 0 else 1.0
    return coop * TMA_MID_RATE if tile_n == 192 else coop


def tma_tile_n(g: Gemm, sms: int | None = None) -> int:
    """The TMA kernel's block-tile width (256, 192, 128 or 64, :data:`TMA_TILE_N`) for ``g`` on a device
    of `sms` multiprocessors (None: ``g``'s device): a wave-quantisation model.

    With 128 x bn tiles the persistent grid (one CTA per SM) runs
    ``tiles = ceil(M / 128) * ceil(N / bn) * batch`` in ``waves = ceil(tiles / sms)`` rounds of
    one tile each, a tile taking time proportional to ``bn / tma_tile_rate(bn, K)``. The fraction
    of that time spent on the problem is ::

        eff(bn) = M * N * batch / (waves * sms * 128 * bn) * tma_tile_rate(bn, K)

    i.e. ``tiles / (waves * sms)`` (the SMs left idle in the last wave) times the part of the
    tiles inside C (ragged edge tiles compute zero-filled rows and columns) times the width's
    relative throughput. The width of the highest eff wins; a tie goes to the wider tile (fewer
    bytes per FLOP). On 132 SMs: 8192 x 768 x 768 takes 192 tiles of 128 x 256 in 2 waves (eff
    0.73 x 0.86 = 0.62), 256 of 128 x 192 in 2 (0.97 x 0.84 = 0.82) or 384 of 128 x 128 in 3
    (0.97 x 0.94 = 0.91): 128; 4096 x 4096 x 4096 is 512 tiles in 4 full waves (0.97 x 0.97 =
    0.94) or 1024 in 8 (0.97 x 0.94 = 0.91): 256, but at K = 1024 the cooperative epilogue tips
    it (0.86): 128; 1024^3 is 64 tiles of 128 x 128 (0.48 x 0.94 = 0.46) or 128 of 128 x 64
    (0.97 x 0.80 = 0.78): 64; 4096 x 768 x 768 is one full wave of 128 x 192 (0.97 x 0.84 =
    0.81) against three of 128 x 64 (0.97 x 0.80 = 0.78): 192."""
    if sms is None:
        sms = device_caps(g.device).sm_count
    return _tma_best(g, sms)[0]


def _tma_best(g: Gemm, sms: int) -> tuple[int, float]:
    """(tile width, its eff) of :func:`tma_tile_n`'s model."""
    nb = g.batch_count
    best, best_eff = TMA_TILE_N[0], -1.0
    for bn in TMA_TILE_N:
        tiles = -(-g.M // BM) * -(-g.N // bn) * nb
        if tiles <= 0 or sms <= 0:
            return TMA_TILE_N[0], 0.0
        waves = -(-tiles // sms)
        eff = g.M * g.N * nb / (waves * sms * BM * bn) * tma_tile_rate(bn, g.K)
        if eff > best_eff:
            best, best_eff = bn, eff
    return best, best_eff


# Split-K's cost model (choose_split), in seconds: the TMA kernel's multiply-add rate at eff 1.0
# (H100, 4096^3 bf16 ~620 TFLOP/s at eff 0.94; tf32 half of it), plus the workspace's round trip
# and the sum (cukit/ops/_gemm.py's split_seconds, SPLIT_GAIN).
SPLITS_K = True  # prepare() takes workspace= (cukit/ops/_gemm.py's GemmFamily)
_TMA_FLOPS = {"bfloat16": 6.6e14, "float16": 6.6e14, "float32": 3.3e14}
MAX_SPLITS = 16
MIN_SLICE_K = 512


def _tma_seconds(g: Gemm, sms: int) -> float:
    return 2.0 * g.M * g.N * g.K * g.batch_count / (max(_tma_best(g, sms)[1], 1e-9) * _TMA_FLOPS[g.dtype.name])


def choose_split(g: Gemm) -> int:
    """Slices of K (1: one pass) for a problem the TMA kernel runs: the S dividing K (into slices of
    whole 128-byte k-tiles, at least MIN_SLICE_K long) whose slices, as a batch on the TMA kernel
    (:func:`tma_tile_n`'s wave model), plus the workspace's round trip, beat the one-pass estimate
    by SPLIT_GAIN. Unbatched problems only. On 132 SMs, 1024 x 256 x 16384 (a dW over 16,384
    tokens) is 32 tiles of 128 x 64 in one pass, 128 in 4 slices."""
    if g.batch_count != 1 or g.K < 2 * MIN_SLICE_K or g.epilogue == EPI_SCALE_DEVICE or not uses_tma(g):
        return 1
    sms = device_caps(g.device).sm_count
    one = _tma_seconds(g, sms)
    best_t, best = one, 1
    kt = KB // g.dtype.itemsize
    for s in range(2, MAX_SPLITS + 1):
        ks = g.K // s
        if g.K % s or ks < MIN_SLICE_K or ks % kt:
            continue
        part = split_slices(g, s)
        if not uses_tma(part):
            continue
        t = _tma_seconds(part, sms) + split_seconds(g, s)
        if t < best_t:
            best_t, best = t, s
    return best if best_t < SPLIT_GAIN * one else 1


def _prepare_split(g: Gemm, splits: int, workspace: Workspace) -> SplitK:
    """The TMA kernel over ``splits`` slices of K (:func:`cukit.ops._gemm.split_slices`: float32
    partial products), and the sum's launch."""
    slices = prepare(split_slices(g, splits), version="tma")
    return prepare_split(g, splits, slices, KERNELS, device_caps(g.device).sm_count, workspace)


def uses_tma(g: Gemm, load: int | None = None) -> bool:
    """Whether :func:`launch` runs ``g`` on the TMA + wgmma kernels (by default): every row start
    16-byte aligned (load path 1: the copy engine needs 16-byte aligned addresses and strides; a
    forced `load` other than 1 declines) and :func:`tma_if_aligned`."""
    return load in (None, 1) and load_path(g) == 1 and tma_if_aligned(g)


def route(g: Gemm, load: int | None = None, version: str | None = None) -> str:
    """Which kernel :func:`launch` runs: "tma", "wgmma" or "mma". version None/"tc": TMA where
    :func:`uses_tma`, else the cp.async wgmma kernel where :func:`uses_wgmma`, else mma.sync;
    "tma", "wgmma", "mma" ask for one (ValueError when it cannot run the problem)."""
    if version in (None, "tc"):
        if uses_tma(g, load):
            return "tma"
        return "wgmma" if uses_wgmma(g, load) else "mma"
    if version == "tma" and not uses_tma(g, load):
        raise ValueError("matmul_tc: the TMA kernel cannot run this problem (see uses_tma)")
    if version == "wgmma" and not uses_wgmma(g, load):
        raise ValueError("matmul_tc: the wgmma kernel cannot run this problem (see uses_wgmma)")
    if version not in ("tma", "wgmma", "mma"):
        raise ValueError(f"matmul_tc: unknown version {version!r} (None, 'tc', 'tma', 'wgmma' or 'mma')")
    return version


# ---------------------------------------------------------------------------------------------
# Tensor maps (CUtensorMap) for the TMA kernels
# ---------------------------------------------------------------------------------------------

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
# float32 as FLOAT32: the copy engine moves the bits; wgmma truncates them to tf32.
_CU_TENSOR_MAP_DTYPE = {"float16": 6, "bfloat16": 9, "float32": 7}
_CU_SWIZZLE_128B = 3
_CU_L2_PROMOTION_256B = 3
_MAP_DTYPE = np.dtype((np.void, 128))


@functools.lru_cache(maxsize=1)
def _encode_tiled() -> Any:
    """The driver's cuTensorMapEncodeTiled (libcuda, loaded once through ctypes: no extra package)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
        u64p,
        u64p,
        u32p,
        u32p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return fn


@functools.lru_cache(maxsize=512)
def tensor_map(
    dtype: str, ptr: int, dims: tuple[int, int, int], strides: tuple[int, int], box: tuple[int, int],
    device: int | None = None,
) -> np.ndarray:
    """A 3-D tiled tensor map (dims innermost first, strides of dims 1 and 2 in bytes), 128-byte
    swizzle, zero fill out of bounds, as one 128-byte NumPy element to pass by value. Cached: a
    training loop reuses the same few (pointer, shape) pairs."""
    buf = np.zeros(256, np.uint8)
    off = -buf.ctypes.data % 64  # CUtensorMap is 64-byte aligned
    out = buf[off : off + 128].view(_MAP_DTYPE)
    u64x3, u64x2, u32x3 = ctypes.c_uint64 * 3, ctypes.c_uint64 * 2, ctypes.c_uint32 * 3
    args = (
        out.ctypes.data, _CU_TENSOR_MAP_DTYPE[dtype], 3, ptr, u64x3(*dims), u64x2(*strides), u32x3(box[0], box[1], 1),
        u32x3(1, 1, 1), 0, _CU_SWIZZLE_128B, _CU_L2_PROMOTION_256B, 0,
    )
    err = _encode_tiled()(*args)
    if device is not None:
        err = retry_without_context(err, device, lambda: _encode_tiled()(*args))
    if err != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed (CUresult {err}) for dims {dims}, strides {strides}, box {box}"
        )
    out.flags.writeable = False
    return out


def _operand_spec(
    sz: int, inner: int, outer: int, ld: int, batch: int, sbatch: int, box: tuple[int, int]
) -> tuple[tuple[int, int, int], tuple[int, int], tuple[int, int]]:
    """(dims, byte strides, box) of one operand's tensor map; only the pointer varies per call."""
    # A leading dimension that is never stepped over (outer <= 1) may be anything: give TMA a
    # valid one. Likewise the batch stride when there is one batch.
    ld_bytes = ld * sz if outer > 1 else -(-inner * sz // 16) * 16
    b_bytes = sbatch * sz if batch > 1 else ld_bytes * outer
    return (inner, outer, batch), (ld_bytes, b_bytes), box


def tma_specs(g: Gemm, tile_n: int | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
    """(A's map spec, B's map spec, batch count) for :func:`uses_tma` problems run with block tiles
    of 128 x `tile_n` (None: :func:`tma_tile_n`); a spec is (dims, strides, box) as
    :func:`tensor_map` takes them after the pointer. Boxes per k-tile of 128 bytes (kt = 64
    elements of 16-bit types, 32 of float32): A K-major (kt, 128), M-major (64, 64) twice; B
    K-major (kt, tile_n), N-major (64, 64) tile_n / 64 times."""
    bn = tma_tile_n(g) if tile_n is None else tile_n
    if bn not in TMA_TILE_N:
        raise ValueError(f"matmul_tc: TMA tile width {bn} is not one of {TMA_TILE_N}")
    nb, sa, sb = tma_batch(g)  # type: ignore[misc]
    a_k, b_k = operand_layouts(g)
    sz = g.dtype.itemsize
    kt = KB // sz
    if a_k:
        spa = _operand_spec(sz, g.K, g.M, g.sa_m, nb, sa, (kt, BM))
    else:
        spa = _operand_spec(sz, g.M, g.K, g.sa_k, nb, sa, (64, 64))
    if b_k:
        spb = _operand_spec(sz, g.K, g.N, g.sb_n, nb, sb, (kt, bn))
    else:
        spb = _operand_spec(sz, g.N, g.K, g.sb_k, nb, sb, (64, 64))
    return spa, spb, nb


def tma_maps(g: Gemm, tile_n: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(map of A, map of B, batch count) for :func:`uses_tma` problems (tile_n: as :func:`tma_specs`)."""
    spa, spb, nb = tma_specs(g, tile_n)
    return tensor_map(g.dtype.name, g.a, *spa, g.device), tensor_map(g.dtype.name, g.b, *spb, g.device), nb


def _device_caps(device: int) -> tuple[int, int]:
    """(compute capability as 10 * major + minor, opt-in shared memory per block)."""
    caps = device_caps(device)
    return caps.cc, caps.smem_optin


def supports(g: Gemm) -> bool:
    """bfloat16 / float16 (any precision: they always accumulate in fp32), float32 with precision
    "tf32"; every epilogue (C in the input dtype or, scaled, float32 for 16-bit inputs: :data:`SCALED`;
    the device scale on the TMA kernels: :data:`SCALED_TMA`);
    on devices of compute capability 8.0+ with room for the tiles in shared memory
    (>= 144 KiB opt-in, >= 204 KiB for misaligned 16-bit operands: A100, H100, H200; not the
    consumer parts, which fall back to the SIMT family)."""
    name = g.dtype.name
    if not (name in ("bfloat16", "float16") or (name == "float32" and g.precision == "tf32")):
        return False
    if g.act not in ACTS:
        return False
    if g.epilogue == EPI_SCALE_DEVICE:  # the TMA kernels' epilogue only
        if (g.out_dtype.name, g.epilogue) not in SCALED_TMA.get(name, ()) or not uses_tma(g):
            return False
    elif g.epilogue != EPI_STORE and (g.act >= 0 or (g.out_dtype.name, g.epilogue) not in SCALED[name]):
        return False
    load = load_path(g)
    if load < 0:
        return False
    if -(-g.M // BM) * -(-g.N // BN) > _INT32_MAX or -(-g.K // (KB // g.dtype.itemsize)) > _INT32_MAX:
        return False
    try:
        cc, optin = _device_caps(g.device)
    except Exception:  # no CuPy / no such device
        return False
    return cc >= 80 and smem_bytes(g, load, optin) > 0


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------


class _TmaLaunch:
    """A TMA kernel launch whose tensor maps follow the operands' pointers: each operand keeps the
    maps of the last few pointers it saw (a training loop cycles through few addresses), so a
    repeated call encodes nothing."""

    __slots__ = ("a_maps", "b_maps", "dtype", "launch", "spa", "spb")
    _MAPS_PER_OPERAND = 16

    def __init__(self, launch: Launch, dtype: str, spa: tuple[Any, ...], spb: tuple[Any, ...]) -> None:
        self.launch, self.dtype, self.spa, self.spb = launch, dtype, spa, spb
        self.a_maps: dict[int, bytes] = {}
        self.b_maps: dict[int, bytes] = {}

    def _map(self, maps: dict[int, bytes], spec: tuple[Any, ...], ptr: int) -> bytes:
        if len(maps) >= self._MAPS_PER_OPERAND:
            maps.clear()
        m = maps[ptr] = tensor_map(self.dtype, ptr, *spec, self.launch.device).tobytes()  # as the launch packs them
        return m

    def __call__(self, head: tuple[Any, ...], stream: Any) -> None:
        a, b = head[0], head[1]
        ma = self.a_maps.get(a)
        if ma is None:
            ma = self._map(self.a_maps, self.spa, a)
        mb = self.b_maps.get(b)
        if mb is None:
            mb = self._map(self.b_maps, self.spb, b)
        self.launch((ma, mb, *head[2:]), stream)


def _noop(head: tuple[int, ...], stream: Any) -> None:
    """The launch of an empty problem (M, N or the batch is 0)."""


def prepare(
    g: Gemm,
    *,
    version: str | None = None,
    load: int | None = None,
    tile_n: int | None = None,
    splits: int | None = None,
    workspace: Workspace | None = None,
) -> Callable[..., None]:
    """A ready launch for every problem of ``g``'s signature: call it as ``run(head, stream)``
    with ``head`` shaped as ``g.head()``: device pointers ``(a, b, c, bias)`` (those of ``g`` or
    any other arrays of the same shapes, strides and 16-byte alignment), then ``(alpha, beta)``
    when ``g.scaled``. version None or "tc": the kernel
    :func:`route` picks (TMA, then cp.async wgmma, then mma.sync); "tma", "wgmma", "mma": that one.
    `load` overrides :func:`load_path` (0 works for any 16-bit problem, 2 for any float32 one) and
    `tile_n` the TMA kernel's block-tile width (:data:`TMA_TILE_N`; :func:`tma_tile_n` by default;
    a ValueError when the TMA kernel does not run ``g``): for tests and benchmarks. workspace (an
    allocator, :data:`cukit.ops._gemm.Workspace`): lets a TMA problem split K (:func:`choose_split`,
    or ``splits`` slices when given: it must divide K of an unbatched TMA problem)."""
    if version not in (None, "tc", "tma", "wgmma", "mma"):
        raise ValueError(f"matmul_tc: unknown version {version!r} (None, 'tc', 'tma', 'wgmma' or 'mma')")
    if tile_n is not None and tile_n not in TMA_TILE_N:
        raise ValueError(f"matmul_tc: TMA tile width {tile_n!r} is not one of {TMA_TILE_N}")
    if not supports(g):
        raise ValueError(
            f"matmul_tc takes bfloat16/float16, or float32 with precision 'tf32', on sm_80+; got {g.dtype} "
            f"{g.precision} act={g.act} C {g.out_dtype} epilogue {g.epilogue}"
        )
    batch = g.batch_count
    if g.M <= 0 or g.N <= 0 or batch <= 0:
        return _noop
    if splits is not None and splits != 1:
        if (splits < 1 or workspace is None or g.K % splits or batch != 1 or g.epilogue == EPI_SCALE_DEVICE
                or not uses_tma(g) or not uses_tma(split_slices(g, splits))):
            raise ValueError(
                f"matmul_tc: splits must be 1, or divide K = {g.K} of an unbatched TMA problem and come with a "
                f"workspace; got splits={splits}{'' if workspace is not None else ' without a workspace'}"
            )
        return _prepare_split(g, splits, workspace)
    if workspace is not None and splits is None and version in (None, "tc") and load is None and tile_n is None:
        s = choose_split(g)
        if s > 1:
            return _prepare_split(g, s, workspace)
    natural = load_path(g)
    if load is None:
        load = natural
    elif load not in LOADS[g.dtype.name] or (load == 1 and natural != 1):
        raise ValueError(
            f"matmul_tc: load path {load} cannot run this {g.dtype} problem (natural: {natural})"
        )
    kernel = route(g, load, version)
    if tile_n is not None and kernel != "tma":
        raise ValueError(f"matmul_tc: tile_n sets the TMA kernel's tile; this problem runs on {kernel!r}")
    if kernel == "tma":
        sms = device_caps(g.device).sm_count
        bn = tma_tile_n(g, sms) if tile_n is None else tile_n
        spa, spb, nb = tma_specs(g, bn)
        tiles = -(-g.M // BM) * -(-g.N // bn) * nb
        grid = (min(tiles, sms),)
        a_k, b_k = operand_layouts(g)
        tail = (g.M, g.N, g.K, g.ldc, g.sc_batch, nb)
        run = KERNELS_SM90A.prepare(
            tma_name(g.dtype.name, g.act, a_k, b_k, bn, **_scaled(g)),
            grid,
            (TMA_THREADS,),
            tail if g.scaled else (float(g.alpha), float(g.beta), *tail),
            device=g.device,
            shared_mem=TMA_SMEM[bn],
        )
        return _TmaLaunch(run, g.dtype.name, spa, spb)
    tiles = -(-g.M // BM) * -(-g.N // BN)
    grid = (tiles, 1, min(batch, _MAX_GRID_Z))
    if kernel == "wgmma":
        module, name, smem = KERNELS_SM90A, wgmma_name(g.dtype.name, g.act, load), wgmma_smem_bytes(load)
    else:
        _, optin = _device_caps(g.device)
        smem = smem_bytes(g, load, optin)
        if smem == 0:
            raise ValueError(f"matmul_tc: load path {load} needs more shared memory than the device has")
        a_k, b_k = operand_layouts(g)
        module, name = KERNELS, kernel_name(g.dtype.name, g.act, a_k, b_k, load, **_scaled(g))
    return module.prepare(name, grid, (THREADS,), g.kernel_tail(), device=g.device, shared_mem=smem)


def _scaled(g: Gemm) -> dict[str, Any]:
    """kernel_name's / tma_name's `out` and `epi` for ``g``."""
    return {} if g.epilogue == EPI_STORE else {"out": g.out_dtype.name, "epi": g.epilogue}


def launch(
    g: Gemm,
    stream: Any,
    *,
    version: str | None = None,
    load: int | None = None,
    tile_n: int | None = None,
    splits: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Run one problem on `stream` (an object with ``.ptr``): ``prepare(g, ...)`` then launch it
    with ``g``'s pointers (and alpha, beta: ``g.head()``)."""
    prepare(g, version=version, load=load, tile_n=tile_n, splits=splits, workspace=workspace)(g.head(), stream)
