"""SIMT (CUDA-core) matmul kernels for float32 (IEEE) and float64: ``raw_kernels/matmul_simt.cu``.

The kernel contract is :class:`cukit.ops._gemm.Gemm`: every kernel takes ``GEMM_SIGNATURE`` and
computes ``C[z] = act(A[z] @ B[z] + bias)`` (or the scaled epilogues ``alpha (A[z] @ B[z] + bias)
(+ beta C[z])``, C in the input dtype) for any M, N, K (K == 0 included), either operand row- or
column-major (chosen by its unit stride), up to three broadcast batch dimensions, C's rows ``ldc``
apart.

Two versions:

- ``"v1"`` (``matmul_v1``): 32x32 shared-memory tiles, one output per thread. The readable reference.
- ``"simt"`` (``matmul_simt``): register-blocked. A block computes a BM x BN tile of C with
  (BM/TM) x (BN/TN) threads of TM x TN outputs each; operands go global -> registers -> shared
  memory (k-major, two buffers, 16-byte loads where alignment allows), one K-tile ahead.
  :data:`CONFIGS` holds the tile shapes; :func:`choose_config` picks the smaller tile when the
  larger one would leave SMs idle. Both kinds of kernel launch on the caller's stream and never
  synchronize.

Split-K (:func:`choose_split`): when a product's tiles leave most SMs idle and K is long (a
weight gradient ``dW = G^T X`` summed over many tokens), ``matmul_simt`` runs S slices of K / S as
one batched launch into a workspace the caller allocates (``prepare(..., workspace=...)``), and
``splitk_reduce`` sums the S partial products in slice order (deterministic) and applies the
epilogue.

The front end (``cukit/ops/matmul.py``) builds the :class:`Gemm`; :func:`supports` says whether
this family takes it and :func:`launch` runs it on a stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from cukit._device import sm_count
from cukit._runtime import KernelModule
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
    "CONFIGS", "KERNELS", "SPLITS_K", "Tile", "choose_config", "choose_split", "kernel_name", "launch",
    "prepare", "supports",
]

# Activation ids: -1 (none) and cukit/activations.cuh's (bias_act's ACTIVATIONS).
ACTS = (-1, 0, 1, 2, 3)
# (A row-major, B row-major): the four operand layouts every config is instantiated for.
LAYOUTS = ((True, True), (True, False), (False, True), (False, False))
# The scaled epilogues (cukit/gemm.cuh), instantiated without activation; C in the input dtype.
SCALED_EPIS = (EPI_SCALE, EPI_ACCUMULATE)
_EPI_NAMES = {EPI_SCALE: "scale", EPI_ACCUMULATE: "accumulate"}


class Tile(NamedTuple):
    """One tile config of matmul_simt: a block computes BM x BN outputs with (BM/TM) x (BN/TN)
    threads of TM x TN each, over K-tiles of BK. per_sm (blocks resident per SM) and rate (its
    throughput relative to the dtype's "large" config, measured at 4096^3 on an H200) feed
    :func:`choose_config`'s wave model."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    per_sm: int
    rate: float

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def template_args(self) -> str:
        return ", ".join(map(str, (self.bm, self.bn, self.bk, self.tm, self.tn)))


# Per dtype: "large" for problems that fill the GPU, "small" (many more blocks) for those that
# would not. ptxas (sm_90), over the 4 layouts x 5 epilogues: float32 large 213-225 registers (one
# 256-thread block per SM), small 89-103 (two); float64 large 240-254 (one), small 118-126 (two);
# no spills. H200, 4096^3 NN: float32 large 44.0 TFLOP/s, small 31.0 (cuBLAS, TF32 off: 51.1);
# float64 large 20.8, small 15.7 (benchmarks/NOTES.md, "matmul SIMT").
CONFIGS: dict[str, dict[str, Tile]] = {
    "float32": {"large": Tile(128, 256, 8, 8, 16, 1, 1.0), "small": Tile(64, 64, 16, 4, 4, 2, 0.7)},
    "float64": {"large": Tile(128, 128, 8, 8, 8, 1, 1.0), "small": Tile(64, 64, 8, 4, 4, 2, 0.75)},
}
V1_TILE = 32
_MAX_GRID_YZ = 65535
_INT32_MAX = 2**31 - 1

# Split-K's cost model (choose_split), in seconds: one SM's multiply-adds per second at rate 1.0
# (H200, 4096^3: float32 44.0 and float64 20.8 TFLOP/s over 132 SMs), plus the workspace's round
# trip and the sum (cukit/ops/_gemm.py's split_seconds, SPLIT_GAIN).
SPLITS_K = True  # prepare() takes workspace= (cukit/ops/_gemm.py's GemmFamily)
_SM_MACS = {"float32": 1.67e11, "float64": 0.79e11}
MAX_SPLITS = 32
MIN_SLICE_K = 256


def _b(v: bool) -> str:
    return "true" if v else "false"


def _epi_arg(act: int, epi: int) -> str:
    """The trailing EPI template argument; "" for the matmul epilogue (the kernels' default)."""
    if epi == EPI_STORE:
        return ""
    if epi not in SCALED_EPIS or act != -1:
        raise ValueError(f"matmul_simt: no instantiation for epilogue {epi} with activation {act}")
    return f", {epi}"


def kernel_name(dtype: str, config: str, a_row: bool, b_row: bool, act: int, *, epi: int = EPI_STORE) -> str:
    """The NVRTC name expression of one matmul_simt instantiation (`epi`: cukit/gemm.cuh's
    epilogue; the scaled ones take act -1)."""
    cfg = CONFIGS[dtype][config].template_args
    return f"matmul_simt<{DTYPES[dtype].ctype}, {cfg}, {_b(a_row)}, {_b(b_row)}, {act}{_epi_arg(act, epi)}>"


def v1_name(dtype: str, act: int, *, epi: int = EPI_STORE) -> str:
    return f"matmul_v1<{DTYPES[dtype].ctype}, {act}{_epi_arg(act, epi)}>"


def reduce_name(dtype: str, act: int, *, epi: int = EPI_STORE) -> str:
    """The NVRTC name expression of split-K's sum (``cukit/gemm.cuh``'s ``splitk_reduce``) for C in
    `dtype` with the epilogue `epi` and activation `act`."""
    _epi_arg(act, epi)
    return splitk_name(dtype, dtype, act, epi)


def _instantiations() -> dict[str, list[str]]:
    # Small groups, so that a first call compiles ~1 s of code: one per (dtype, config, act) and per
    # (dtype, config, scaled epilogue), the four layouts together; v1 one group per dtype.
    groups: dict[str, list[str]] = {}
    for dtype, configs in CONFIGS.items():
        for config in configs:
            for act in ACTS:
                groups[f"{dtype}/{config}/act{act}"] = [
                    kernel_name(dtype, config, a, b, act) for a, b in LAYOUTS
                ]
            for epi in SCALED_EPIS:
                groups[f"{dtype}/{config}/{_EPI_NAMES[epi]}"] = [
                    kernel_name(dtype, config, a, b, -1, epi=epi) for a, b in LAYOUTS
                ]
        groups[f"{dtype}/v1"] = [v1_name(dtype, act) for act in ACTS] + [
            v1_name(dtype, -1, epi=epi) for epi in SCALED_EPIS
        ]
        groups[f"{dtype}/splitk"] = [reduce_name(dtype, act) for act in ACTS] + [
            reduce_name(dtype, -1, epi=epi) for epi in SCALED_EPIS
        ]
    return groups


KERNELS = KernelModule(
    "matmul_simt.cu",
    instantiations=_instantiations(),
    signatures={
        "matmul_simt": GEMM_SIGNATURE,
        "matmul_v1": GEMM_SIGNATURE,
        "splitk_reduce": SPLITK_SIGNATURE,
    },
)


def supports(g: Gemm) -> bool:
    """float32 with IEEE precision, or float64; C in the input dtype, any epilogue but the device
    scale (the scaled ones without activation)."""
    name = g.dtype.name
    if not ((name == "float32" and g.precision == "ieee") or name == "float64") or g.out_dtype.name != name:
        return False
    if g.epilogue == EPI_SCALE_DEVICE:
        return False
    return g.epilogue == EPI_STORE or g.act == -1


def operand_layouts(g: Gemm) -> tuple[bool, bool]:
    """(A row-major, B row-major) as the kernels read them. With a size-1 dimension an operand
    may have no unit stride at all; then the layout that never uses the stride of that size-1
    dimension is picked (A row-major assumes sa_k == 1 and uses sa_m; column-major the reverse)."""
    if g.sa_k == 1:
        a_row = True
    elif g.sa_m == 1:
        a_row = False
    else:  # M <= 1 or K <= 1: with M <= 1 only sa_k is used (column-major), else only sa_m
        a_row = g.M > 1
    if g.sb_n == 1:
        b_row = True
    elif g.sb_k == 1:
        b_row = False
    else:  # N <= 1: only sb_k is used (row-major); K <= 1: only sb_n (column-major)
        b_row = g.N <= 1
    return a_row, b_row


def choose_config(g: Gemm) -> str:
    """The config with the least estimated time: waves (blocks over per_sm x SMs, rounded up)
    times one wave's work (per_sm x BM x BN per SM) over the config's rate. A problem too small to
    fill the GPU with large tiles gets the small ones."""
    sms = sm_count(g.device)
    best, best_t = "large", float("inf")
    for name, t in CONFIGS[g.dtype.name].items():
        blocks = -(-g.M // t.bm) * -(-g.N // t.bn) * g.batch_count
        est = -(-blocks // (t.per_sm * sms)) * t.per_sm * t.bm * t.bn / t.rate
        if est < best_t:
            best, best_t = name, est
    return best


def _estimate(g: Gemm, t: Tile, splits: int) -> float:
    """Seconds for ``g`` on tile ``t`` in ``splits`` slices of K: waves of blocks times one wave's
    multiply-adds per SM at the tile's rate, plus (splits > 1) the workspace's round trip and the
    sum's launch."""
    sms = sm_count(g.device)
    blocks = -(-g.M // t.bm) * -(-g.N // t.bn) * g.batch_count * splits
    k = -(-(g.K // splits) // t.bk) * t.bk
    est = -(-blocks // (t.per_sm * sms)) * t.per_sm * t.bm * t.bn * k / (t.rate * _SM_MACS[g.dtype.name])
    if splits > 1:
        est += split_seconds(g, splits)
    return est


def _split_candidates(g: Gemm) -> list[int]:
    """Slice counts S that divide K into slices of at least MIN_SLICE_K whose starts keep 16-byte
    alignment (K / S a multiple of 16 bytes of elements); [1] where split-K does not apply (a
    batched problem, K too short)."""
    vec = 16 // g.dtype.itemsize
    if g.batch_count != 1 or g.K < 2 * MIN_SLICE_K:
        return [1]
    return [1] + [s for s in range(2, MAX_SPLITS + 1)
                  if g.K % s == 0 and g.K // s >= MIN_SLICE_K and (g.K // s) % vec == 0]


def choose_split(g: Gemm, config: str | None = None) -> tuple[str, int]:
    """(config, S): the tile config (``config`` when given) and number of K slices with the least
    :func:`_estimate`, S = 1 (one pass) unless a split beats the best one-pass estimate by
    SPLIT_GAIN. Only unbatched problems split (S divides K, see _split_candidates): a weight
    gradient over 16,384 tokens into 1024 x 256 outputs is 8 large tiles on 132 SMs in one pass,
    128 blocks in 16 slices."""
    tiles = CONFIGS[g.dtype.name]
    names = [config] if config is not None else list(tiles)
    one_t, one = min((_estimate(g, tiles[n], 1), n) for n in names)
    best_t, best, best_s = one_t, one, 1
    for s in _split_candidates(g)[1:]:
        for n in names:
            t = _estimate(g, tiles[n], s)
            if t < best_t:
                best_t, best, best_s = t, n, s
    if best_t >= SPLIT_GAIN * one_t:
        return one, 1
    return best, best_s


def _prepare_split(g: Gemm, config: str, splits: int, workspace: Workspace) -> SplitK:
    """matmul_simt over ``splits`` slices of K (:func:`cukit.ops._gemm.split_slices`) with tile
    ``config``, and the sum's launch."""
    slices = prepare(split_slices(g, splits), config=config)
    return prepare_split(g, splits, slices, KERNELS, sm_count(g.device), workspace)


def _fold(rows: int) -> tuple[int, int]:
    """(grid.y, grid.z) covering `rows` (batch x M-tile) blocks, both <= 65535."""
    gy = min(rows, _MAX_GRID_YZ)
    gz = -(-rows // gy)
    if gz > _MAX_GRID_YZ:
        raise ValueError(f"matmul: {rows} (batch x row-tile) blocks exceed the CUDA grid")
    return gy, gz


def _noop(head: tuple[int, ...], stream: Any) -> None:
    """The launch of an empty problem (M, N or the batch is 0)."""


def prepare(
    g: Gemm,
    *,
    version: str = "simt",
    config: str | None = None,
    splits: int | None = None,
    workspace: Workspace | None = None,
) -> Callable[..., None]:
    """A ready launch for every problem of ``g``'s signature, called as ``run(head, stream)`` with
    ``head`` shaped as ``g.head()`` (device pointers, then alpha and beta when ``g.scaled``).
    version "simt" (fast) or "v1" (reference); config "large" / "small" overrides
    :func:`choose_config`. workspace (version "simt"): an allocator that lets the launch split K
    (:func:`choose_split`, or ``splits`` slices when given: it must divide K); without one, one
    pass."""
    if not supports(g):
        raise ValueError(
            f"matmul_simt takes float32 (precision 'ieee') or float64, C in the same dtype; got {g.dtype} "
            f"{g.precision}, C {g.out_dtype}"
        )
    if g.act not in ACTS:
        raise ValueError(f"matmul_simt: unknown activation id {g.act}")
    batch = g.batch_count
    if g.M <= 0 or g.N <= 0 or batch <= 0:
        return _noop
    tail = g.kernel_tail()
    epi = g.epilogue
    if version == "v1":
        gy, gz = min(-(-g.M // V1_TILE), _MAX_GRID_YZ), min(batch, _MAX_GRID_YZ)
        return KERNELS.prepare(
            v1_name(g.dtype.name, g.act, epi=epi), (-(-g.N // V1_TILE), gy, gz), (V1_TILE, V1_TILE), tail,
            device=g.device,
        )
    if version != "simt":
        raise ValueError(f"matmul_simt: version must be 'simt' or 'v1'; got {version!r}")
    if splits is not None and (splits < 1 or (splits > 1 and (workspace is None or g.K % splits or g.batch_count != 1))):
        raise ValueError(
            f"matmul_simt: splits must be 1, or divide K = {g.K} of an unbatched problem and come with a workspace; "
            f"got splits={splits} for batch {g.batch}{'' if workspace is not None else ' without a workspace'}"
        )
    if workspace is not None:
        if splits is None:
            config, splits = choose_split(g, config)
        if splits > 1:
            return _prepare_split(g, config or choose_config(g), splits, workspace)
    config = config or choose_config(g)
    tile = CONFIGS[g.dtype.name][config]
    bm, bn, bk = tile.bm, tile.bn, tile.bk
    if g.K // bk > _INT32_MAX:
        raise ValueError(f"matmul_simt: K = {g.K} is too large")
    gx = -(-g.N // bn)
    if gx > _INT32_MAX:
        raise ValueError(f"matmul_simt: N = {g.N} is too large")
    gy, gz = _fold(batch * -(-g.M // bm))
    a_row, b_row = operand_layouts(g)
    return KERNELS.prepare(
        kernel_name(g.dtype.name, config, a_row, b_row, g.act, epi=epi), (gx, gy, gz), (tile.threads,), tail,
        device=g.device,
    )


def launch(
    g: Gemm,
    stream: Any,
    *,
    version: str = "simt",
    config: str | None = None,
    splits: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Run one problem on `stream` (an object with ``.ptr``): ``prepare(g, ...)`` then launch it
    with ``g``'s pointers (and alpha, beta: ``g.head()``)."""
    prepare(g, version=version, config=config, splits=splits, workspace=workspace)(g.head(), stream)
