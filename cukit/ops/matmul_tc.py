"""Tensor-core matmul kernels: ``raw_kernels/matmul_tc.cu``.

Inputs bfloat16 or float16 (fp32 accumulation), or float32 with precision "tf32" (each operand
rounded to tf32 with ``cvt.rna``, fp32 accumulation); C in the input dtype, after the fused
epilogue ``act(acc + bias)`` in fp32.

The kernel contract is :class:`cukit.ops._gemm.Gemm`: any M, N, K (K == 0: C = act(bias)), either
operand row- or column-major (by its unit stride; no transposed copies), up to three broadcast
batch dimensions on ``blockIdx.z``. Block tiles of 128 x 256 x 128 bytes of K, 256 threads.

Two kernel families in the one file:

- ``matmul_tc`` (``mma.sync`` + ``ldmatrix``, sm_80+): every dtype and layout. 8 warps of 64 x 64;
  K-major tiles feed ``ldmatrix``, M/N-major ones ``ldmatrix.trans`` (fp32: 32-bit loads).
- ``matmul_tc_wgmma`` (Hopper's warpgroup MMA, compiled for sm_90a, used on compute capability 9.0
  only, :func:`uses_wgmma`): bfloat16/float16 with A and B both K-major, i.e. ``x @ W.T`` as in
  ``nn.Linear``. 2 warpgroups of 64 x 256 reading both operands from shared memory.

Load paths (template ``VEC``), picked per problem by :func:`load_path`:

- 1: every operand row starts 16-byte aligned: ``cp.async`` 16 B into a ring of 3-4 stages.
- 2 (float32 only): rows 4-byte aligned: the same ring with 4-byte ``cp.async``.
- 0 (16-bit only): any alignment (an odd leading dimension, e.g. K = 4093): aligned 16-byte
  chunks are staged two k-tiles ahead and shifted into place in shared memory.

The front end (``cukit/ops/matmul.py``) builds the :class:`Gemm`; :func:`supports` says whether
this family takes it and :func:`launch` runs it on a stream.
"""

from __future__ import annotations

from typing import Any

from cukit._device import device_caps
from cukit._runtime import KernelModule
from cukit.interop import DTYPES
from cukit.ops._gemm import GEMM_SIGNATURE, Gemm

__all__ = [
    "KERNELS",
    "KERNELS_SM90A",
    "LOADS",
    "kernel_name",
    "launch",
    "load_path",
    "operand_layouts",
    "smem_bytes",
    "supports",
    "uses_wgmma",
    "wgmma_name",
]

# Activation ids: -1 (none) and cukit/activations.cuh's (bias_act's ACTIVATIONS).
ACTS = (-1, 0, 1, 2, 3)
# (A K-major, B K-major): A row-major / column-major, B column-major (nn.Linear's weight) / row-major.
LAYOUTS = ((True, True), (True, False), (False, True), (False, False))
# Load paths instantiated per dtype (see the module docstring).
LOADS: dict[str, tuple[int, ...]] = {"bfloat16": (1, 0), "float16": (1, 0), "float32": (1, 2)}

BM, BN, KB, THREADS = 128, 256, 128, 256  # must match raw_kernels/matmul_tc.cu
STAGE = (BM + BN) * KB  # bytes of one A + B k-tile (48 KiB)
_MAX_GRID_Z = 65535
_INT32_MAX = 2**31 - 1


def kernel_name(dtype: str, act: int, a_k: bool, b_k: bool, load: int) -> str:
    """The NVRTC name expression of one instantiation."""
    return f"matmul_tc<{DTYPES[dtype].ctype}, {act}, {int(a_k)}, {int(b_k)}, {load}>"


def _instantiations() -> dict[str, list[str]]:
    # One group per (dtype, load path, activation), its four layouts together (~2.5 s of NVRTC):
    # a model's forward (one activation) and backward (none, three layouts) compile two groups.
    groups: dict[str, list[str]] = {}
    for dtype, loads in LOADS.items():
        for load in loads:
            for act in ACTS:
                groups[f"{dtype}/vec{load}/act{act}"] = [
                    kernel_name(dtype, act, a, b, load) for a, b in LAYOUTS
                ]
    return groups


KERNELS = KernelModule(
    "matmul_tc.cu", instantiations=_instantiations(), signatures={"matmul_tc": GEMM_SIGNATURE}
)


def wgmma_name(dtype: str, act: int, load: int) -> str:
    """The NVRTC name expression of one sm_90a (wgmma) instantiation."""
    return f"matmul_tc_wgmma<{DTYPES[dtype].ctype}, {act}, {load}>"


# The wgmma kernels (sm_90a only: Hopper's warpgroup MMA) for A and B both K-major, bfloat16 and
# float16, both load paths: one group per (dtype, activation). `cukit check-kernels --arch sm_90`
# compiles it for sm_90a.
KERNELS_SM90A = KernelModule(
    "matmul_tc.cu",
    instantiations={
        f"{dtype}/wgmma/act{act}": [wgmma_name(dtype, act, load) for load in (1, 0)]
        for dtype in ("bfloat16", "float16")
        for act in ACTS
    },
    signatures={"matmul_tc_wgmma": GEMM_SIGNATURE},
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
    """Whether :func:`launch` runs ``g`` on the wgmma kernels: a compute capability 9.0 device
    (sm_90a code runs there only), bfloat16/float16, A and B both K-major (x @ W.T), load path 0
    or 1."""
    if g.dtype.name not in ("bfloat16", "float16") or operand_layouts(g) != (True, True):
        return False
    load = load_path(g) if load is None else load
    if load not in (0, 1):
        return False
    try:
        cc, optin = _device_caps(g.device)
    except Exception:
        return False
    return cc == 90 and wgmma_smem_bytes(load) <= optin


def _device_caps(device: int) -> tuple[int, int]:
    """(compute capability as 10 * major + minor, opt-in shared memory per block)."""
    caps = device_caps(device)
    return caps.cc, caps.smem_optin


def supports(g: Gemm) -> bool:
    """bfloat16 / float16 (any precision: they always accumulate in fp32), float32 with precision
    "tf32"; on devices of compute capability 8.0+ with room for the tiles in shared memory
    (>= 144 KiB opt-in, >= 204 KiB for misaligned 16-bit operands: A100, H100, H200; not the
    consumer parts, which fall back to the SIMT family)."""
    name = g.dtype.name
    if not (name in ("bfloat16", "float16") or (name == "float32" and g.precision == "tf32")):
        return False
    if g.act not in ACTS:
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


def launch(g: Gemm, stream: Any, *, version: str | None = None, load: int | None = None) -> None:
    """Run one problem on `stream` (an object with ``.ptr``). version None or "tc": the wgmma
    kernels where :func:`uses_wgmma` says so, else mma.sync; "mma": mma.sync only. `load`
    overrides :func:`load_path` (0 works for any 16-bit problem, 2 for any float32 one: for tests
    and benchmarks)."""
    if version not in (None, "tc", "mma"):
        raise ValueError(f"matmul_tc: unknown version {version!r} (None, 'tc' or 'mma')")
    if not supports(g):
        raise ValueError(
            f"matmul_tc takes bfloat16/float16, or float32 with precision 'tf32', on sm_80+; got {g.dtype} "
            f"{g.precision} act={g.act}"
        )
    batch = g.batch_count
    if g.M <= 0 or g.N <= 0 or batch <= 0:
        return
    natural = load_path(g)
    if load is None:
        load = natural
    elif load not in LOADS[g.dtype.name] or (load == 1 and natural != 1):
        raise ValueError(
            f"matmul_tc: load path {load} cannot run this {g.dtype} problem (natural: {natural})"
        )
    tiles = -(-g.M // BM) * -(-g.N // BN)
    grid = (tiles, 1, min(batch, _MAX_GRID_Z))
    if version != "mma" and uses_wgmma(g, load):
        module, name, smem = KERNELS_SM90A, wgmma_name(g.dtype.name, g.act, load), wgmma_smem_bytes(load)
    else:
        _, optin = _device_caps(g.device)
        smem = smem_bytes(g, load, optin)
        if smem == 0:
            raise ValueError(f"matmul_tc: load path {load} needs more shared memory than the device has")
        a_k, b_k = operand_layouts(g)
        module, name = KERNELS, kernel_name(g.dtype.name, g.act, a_k, b_k, load)
    module.launch(name, grid, (THREADS,), g.kernel_args(), device=g.device, stream=stream, shared_mem=smem)
