"""matmul_tc: the tensor-core kernels (mma.sync + ldmatrix) called directly with Gemm problems built
from torch CUDA tensors, against float64 products of the same (exactly representable) inputs.

Error bound per element: the inputs are exact in bf16/fp16 and the products are exact in fp32, so
only the fp32 accumulation (Higham's gamma_K for any summation order: K * eps32 * (|A| @ |B|)) and
one rounding of the output (unit roundoff u: bf16 2^-8, fp16 2^-11) remain. tf32 rounds each input
to 10 mantissa bits first: add 2 * 2^-11 * (|A| @ |B|). The epilogue (bias + activation in fp32) adds
a few fp32 roundings and the activation's slope (<= 1.2) times the accumulation error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cukit._device import DeviceCaps
from cukit.interop import DTYPES
from cukit.ops import matmul_tc as mt
from cukit.ops._gemm import EPI_ACCUMULATE, EPI_SCALE, Gemm, SplitK
from cukit.ops.bias_act import ACTIVATIONS, reference_numpy

ACT_NAMES = {v: k for k, v in ACTIVATIONS.items()}
LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]  # (A row-major, B row-major)
LAYOUT_IDS = ["NN", "NT", "TN", "TT"]  # T: stored transposed (column-major); NT: x @ W.T (nn.Linear)
EPS32 = 2.0**-23
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}


def _has_nvrtc() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def _g(dtype: str = "bfloat16", **kw) -> Gemm:
    base = dict(dtype=DTYPES[dtype], M=256, N=512, K=128, a=0, b=1 << 20, c=1 << 30, bias=0, act=-1,
                sa_m=128, sa_k=1, sb_k=512, sb_n=1)
    base.update(kw)
    return Gemm(**base)


# ------------------------------------------------------------------------------------------ CPU
# Every declared instantiation (sm_80, sm_90 and the sm_90a wgmma module) is compiled offline by
# `cukit check-kernels`, which `make test` runs before pytest.


def test_instantiations_cover_every_launch():
    declared = set(mt.KERNELS.all_instantiations())
    for dtype, loads in mt.LOADS.items():
        for load in loads:
            for a_k, b_k in LAYOUTS:
                for act in mt.ACTS:
                    assert mt.kernel_name(dtype, act, a_k, b_k, load) in declared
    wgmma = set(mt.KERNELS_SM90A.all_instantiations())
    for dtype in ("bfloat16", "float16"):
        for load in (0, 1):
            for act in mt.ACTS:
                assert mt.wgmma_name(dtype, act, load) in wgmma
    assert mt.wgmma_smem_bytes(0) <= 227 * 1024 and mt.wgmma_smem_bytes(1) <= 227 * 1024
    for dtype in ("bfloat16", "float16"):
        for a_k, b_k in LAYOUTS:
            for act in mt.ACTS:
                for bn in mt.TMA_TILE_N:
                    assert mt.tma_name(dtype, act, a_k, b_k, bn) in wgmma
    # one group per (dtype, activation, width): its four layouts together
    for dtype in ("bfloat16", "float16"):
        for act in mt.ACTS:
            for bn in mt.TMA_TILE_N:
                group = mt.KERNELS_SM90A.instantiations[f"{dtype}/tma{bn}/act{act}"]
                assert sorted(group) == sorted(mt.tma_name(dtype, act, a, b, bn) for a, b in LAYOUTS)
    # float32 (tf32): the K-major layout only (tf32 wgmma has no transposed operands), every
    # activation, width and scaled epilogue
    for bn in mt.TMA_TILE_N:
        for act in mt.ACTS:
            assert mt.KERNELS_SM90A.instantiations[f"float32/tma{bn}/act{act}"] == [
                mt.tma_name("float32", act, True, True, bn)
            ]
        for out, epi in mt.SCALED["float32"]:
            assert mt.tma_name("float32", -1, True, True, bn, out=out, epi=epi) in wgmma
        assert mt.tma_name("float32", -1, True, False, bn) not in wgmma


def test_scaled_instantiations_cover_every_launch():
    """The scaled epilogues (mt.SCALED: C's dtype and EPI per input dtype): one mma.sync group per
    (dtype, load path, C's dtype, EPI) and one TMA group per (16-bit dtype, width, C's dtype, EPI),
    each of the four layouts. The matmul path keeps its names (the template defaults)."""
    declared = mt.KERNELS.instantiations
    sm90a = mt.KERNELS_SM90A.instantiations
    names = {EPI_SCALE: "scale", EPI_ACCUMULATE: "accumulate"}
    for dtype, loads in mt.LOADS.items():
        assert {epi for _, epi in mt.SCALED[dtype]} == {EPI_SCALE, EPI_ACCUMULATE}
        for out, epi in mt.SCALED[dtype]:
            for load in loads:
                group = declared[f"{dtype}/vec{load}/{out}-{names[epi]}"]
                assert sorted(group) == sorted(mt.kernel_name(dtype, -1, a, b, load, out=out, epi=epi) for a, b in LAYOUTS)
            if dtype != "float32":
                for bn in mt.TMA_TILE_N:
                    group = sm90a[f"{dtype}/tma{bn}/{out}-{names[epi]}"]
                    assert sorted(group) == sorted(mt.tma_name(dtype, -1, a, b, bn, out=out, epi=epi) for a, b in LAYOUTS)
    assert mt.SCALED["bfloat16"] == (("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2))
    assert mt.SCALED["float32"] == (("float32", 1), ("float32", 2))
    assert mt.kernel_name("bfloat16", 1, True, False, 1) == "matmul_tc<__nv_bfloat16, 1, 1, 0, 1>"
    assert mt.kernel_name("bfloat16", -1, False, True, 0, out="float32", epi=EPI_ACCUMULATE) == (
        "matmul_tc<__nv_bfloat16, -1, 0, 1, 0, float, 2>"
    )
    assert mt.tma_name("float16", -1, True, True, 128, out="float16", epi=EPI_SCALE) == (
        "matmul_tc_tma<__half, -1, 1, 1, 128, 1, __half, 1>"
    )
    with pytest.raises(ValueError, match="no scaled instantiation"):
        mt.kernel_name("float32", -1, True, True, 1, out="float16", epi=EPI_SCALE)
    with pytest.raises(ValueError, match="the matmul epilogue writes C in the input dtype"):
        mt.kernel_name("bfloat16", -1, True, True, 1, out="float32")


def test_tma_fp32_staging_is_bank_conflict_free():
    """raw_kernels/matmul_tc.cu's wide_off (the scaled epilogues stage fp32 in passes of 64 x 64:
    rows of 256 bytes, chunk c of row r in slot c ^ 2 (r % 4)): every (row, chunk) has its own slot
    within the 64 x 264-byte staging buffer, a half-warp's 8-byte fragment writes (lane: g = lane /
    4, t = lane % 4; row 16 w + g + 8 h, chunk 2 i + t / 2) and a quarter-warp's 16-byte row reads
    (8 chunks of one row) each cover the 32 banks once."""

    def wide_off(row: int, chunk: int) -> int:
        return row * 256 + ((chunk ^ ((row & 3) << 1)) << 4)

    slots = {wide_off(r, c) for r in range(64) for c in range(16)}
    assert len(slots) == 64 * 16 and max(slots) + 16 <= 64 * 264
    for w in range(4):
        for i in range(8):
            for h in range(2):
                for half in (0, 16):
                    banks = []
                    for lane in range(half, half + 16):
                        g, t = lane >> 2, lane & 3
                        word = (wide_off(16 * w + g + 8 * h, 2 * i + (t >> 1)) + (t & 1) * 8) // 4
                        banks += [word % 32, (word + 1) % 32]
                    assert sorted(banks) == list(range(32)), (w, i, h, half)
    for row in range(64):
        for q in (0, 8):
            banks = [(wide_off(row, c) // 4 + j) % 32 for c in range(q, q + 8) for j in range(4)]
            assert sorted(banks) == list(range(32)), (row, q)


def test_tma_shared_memory_per_width():
    """tma::Cfg<BN>'s layout: as many stages as fit in 227 KiB beside the epilogue staging."""
    assert mt.TMA_TILE_N == (256, 192, 128, 64)
    assert mt.TMA_STAGES == {256: 4, 192: 4, 128: 6, 64: 8}
    staging = 2 * 64 * 264
    for bn in mt.TMA_TILE_N:
        stage = (mt.BM + bn) * mt.KB
        s = mt.TMA_STAGES[bn]
        assert mt.TMA_SMEM[bn] == s * stage + staging + 16 * s + 1024 <= 227 * 1024
        assert mt.TMA_SMEM[bn] + stage > 227 * 1024  # one more stage would not fit
    assert mt.TMA_SMEM[256] == 4 * mt.STAGE + staging + 64 + 1024  # the 128 x 256 layout is unchanged


@pytest.fixture
def h100(monkeypatch):
    """Device queries answer as an H100 SXM (compute capability 9.0, 132 SMs, 227 KiB opt-in)."""
    monkeypatch.setattr(mt, "device_caps", lambda device: DeviceCaps(90, 132, 227 * 1024))


def _tn(M, N, sms=132, batch=1, K=768):
    g = _g(M=M, N=N, K=K, sa_m=K, sb_k=N, batch=(1, 1, batch), sa_batch=(0, 0, M * K), sb_batch=(0, 0, K * N))
    return mt.tma_tile_n(g, sms)


def test_tma_tile_n_wave_model():
    # the Llama shapes of the problem statement, on an H100's 132 SMs
    assert _tn(8192, 768) == 128  # 192 tiles of 256 = 1.45 waves (eff 0.73 x 0.86); 384 of 128 = 2.9 (0.97 x 0.94)
    assert _tn(1024, 1024) == 64  # 32 tiles (0.24), 64 (0.48 x 0.94) or 128 of 128 x 64 (0.97 x 0.84)
    assert _tn(4096, 4096, K=4096) == 256  # 512 tiles: 4 full waves (0.97 x 0.97) vs 8 (0.97 x 0.94)
    assert _tn(4096, 4096, K=1024) == 128  # ... but at K = 1024 the cooperative epilogue costs 11%
    assert _tn(8192, 2048) == 128  # K = 768: likewise
    assert _tn(8192, 2048, K=8192) == 256
    assert _tn(4096, 1024, K=4096) == 256  # 128 tiles in 1 wave (0.97 x 0.97) vs 256 in 2 (0.97 x 0.94)
    # 96 tiles of 256 in 1 wave (0.73 x 0.86), 128 of 192 in 1 (0.97 x 0.86), 192 of 128 in 2 (0.73 x 0.94),
    # 384 of 64 in 3 (0.97 x 0.84)
    assert _tn(4096, 768) == 192
    assert _tn(768, 2048, K=4096) == 128  # dW of an MLP projection: 48 tiles (0.36) vs 96 (0.65)
    assert _tn(8192, 8192, K=8192) == 256 and _tn(32768, 1024, K=4096) == 256  # many waves, deep K
    # 2,048 tiles of 256 in 16 waves (0.97 x 0.98) against 2,752 of 192 in 21 (0.99 x 0.98 x 0.98)
    assert _tn(8192, 8192, K=8192) == 256
    assert _tn(4096, 1536, K=4096) == 192  # 96 tiles of 256 (0.73), 128 of 192: one full wave
    assert _tn(1, 1) == 64 and _tn(100, 200) == 64  # a few tiles: less zero-filled work
    assert _tn(2048, 2048, K=2048) == 256  # 128 tiles of 128 x 256 fill a wave: the widest tile
    # the SM count matters: 192 tiles of 256 are one full wave on 192 SMs
    assert _tn(8192, 768, sms=192, K=4096) == 256
    # the batch multiplies the tiles: 3 x 1024^2 is 96 tiles of 256 (0.73 x 0.97), 192 of 128
    # (0.73 x 0.94) or 384 of 64 (0.97 x 0.84)
    assert _tn(1024, 1024, batch=3, K=4096) == 64
    assert _tn(1024, 1024, batch=4, K=4096) == 256  # 128 tiles of 256: one wave
    assert _tn(1024, 1024, batch=0) == 256  # empty problems: any width; the default


def test_tma_tile_rate():
    """Ping-pong tiles run at a constant rate; the cooperative ones lose their epilogue's share,
    which falls with K."""
    assert mt.tma_tile_rate(128, 768) == mt.tma_tile_rate(128, 8192) == mt.TMA_PINGPONG_RATE
    assert mt.tma_tile_rate(256, 128) == pytest.approx(0.5)
    assert mt.tma_tile_rate(256, 768) < mt.tma_tile_rate(128, 768) < mt.tma_tile_rate(256, 8192) < 1.0
    assert mt.tma_tile_rate(256, 0) == 1.0
    assert mt.tma_tile_rate(64, 768) == mt.tma_tile_rate(64, 8192) == mt.TMA_NARROW_RATE < mt.TMA_PINGPONG_RATE
    assert mt.TMA_PINGPONG == {256: False, 192: False, 128: True, 64: True}
    # 128 x 192 is cooperative, with a little more traffic per FLOP than 128 x 256
    for K in (128, 768, 8192):
        assert mt.tma_tile_rate(192, K) == pytest.approx(mt.tma_tile_rate(256, K) * mt.TMA_MID_RATE)
    assert mt.tma_tile_rate(192, 8192) < mt.tma_tile_rate(256, 8192)


def test_tma_tile_n_follows_the_calibrated_rates(monkeypatch):
    """The third factor is tma_tile_rate: a ping-pong rate equal to the cooperative one makes
    4096 x 4096 x 4096 a near-tie that the wider tile keeps; a faster 128 x 128 takes it; a slow
    one loses 8192 x 768 too. 128 x 64 tiles take the problems whose wider tiles leave SMs idle,
    and more as their rate approaches the 128 x 128 one."""
    monkeypatch.setattr(mt, "TMA_NARROW_RATE", 0.4)  # out of the way of the wider widths' cases
    monkeypatch.setattr(mt, "TMA_PINGPONG_RATE", 0.96)
    assert _tn(4096, 4096, K=4096) == 256
    monkeypatch.setattr(mt, "TMA_PINGPONG_RATE", 1.05)
    assert _tn(4096, 4096, K=4096) == 128
    monkeypatch.setattr(mt, "TMA_PINGPONG_RATE", 0.6)  # 256 tiles of 192 in 2 full waves take it
    assert _tn(8192, 768) == 192
    monkeypatch.setattr(mt, "TMA_EPILOGUE_K", 0)  # a free epilogue: the wider tile at 4096 x 4096 x 1024
    monkeypatch.setattr(mt, "TMA_PINGPONG_RATE", 0.94)
    assert _tn(4096, 4096, K=1024) == 256
    monkeypatch.setattr(mt, "TMA_EPILOGUE_K", 128)
    assert _tn(1024, 1024) == 128  # 64 tiles (0.48 x 0.94) against 128 of 128 x 64 (0.97 x 0.4)
    monkeypatch.setattr(mt, "TMA_NARROW_RATE", 0.5)
    assert _tn(1024, 1024) == 64
    monkeypatch.setattr(mt, "TMA_NARROW_RATE", 0.95)  # as fast as 128 x 128: 8192 x 768 too (a tie keeps 128)
    assert _tn(8192, 768) == 64


def test_tma_tile_n_counts_zero_filled_edges():
    """N = 384 is 1.5 tiles of 256: a quarter of the 128 x 256 work is on zero-filled columns.
    32768 x 384 x 4096: 512 tiles of 256 in 4 waves (0.97 of the slots x 0.75 filled x 0.97 =
    0.71) against 512 of 192 in 4 (0.97 x 1.0 x 0.97 = 0.94) and 768 of 128 in 6 (0.97 x 1.0 x
    0.94 = 0.91): 192, where counting tiles alone would say 256. 32768 x 512 fills 256 and 128:
    256."""
    assert _tn(32768, 384, K=4096) == 192
    assert _tn(32768, 640, K=4096) == 128  # 3 tiles of 256 across, 5/6 filled; 4 of 192, 5/6 filled
    assert _tn(32768, 512, K=4096) == 256


def test_tma_tile_n_reads_the_device(h100):
    g = _g(M=8192, N=768, K=768, sa_m=768, sb_k=768)
    assert mt.tma_tile_n(g) == 128 == mt.tma_tile_n(g, 132)


def _layout_gemm(a_k, b_k, M=300, N=200, K=136, batch=1):
    """A Gemm of contiguous operands in one layout (A row-major: K-major; B column-major: K-major)."""
    return _g(M=M, N=N, K=K, sa_m=K if a_k else 1, sa_k=1 if a_k else M, sb_k=1 if b_k else N,
              sb_n=K if b_k else 1, batch=(1, 1, batch), sa_batch=(0, 0, M * K), sb_batch=(0, 0, K * N))


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_tma_specs_per_width(layout):
    """B's box spans the tile width when B is K-major ({64 k, tile_n n}); every other box (and
    every dimension and stride) is the same for both widths."""
    a_k, b_k = layout
    g = _layout_gemm(a_k, b_k, batch=3)
    specs = {bn: mt.tma_specs(g, bn) for bn in mt.TMA_TILE_N}
    for bn, (spa, spb, nb) in specs.items():
        assert nb == 3
        assert spa[0] == ((136, 300, 3) if a_k else (300, 136, 3))
        assert spa[1] == ((136 * 2, 300 * 136 * 2) if a_k else (300 * 2, 300 * 136 * 2))
        assert spa[2] == ((64, 128) if a_k else (64, 64))
        assert spb[0] == ((136, 200, 3) if b_k else (200, 136, 3))
        assert spb[1] == ((136 * 2, 200 * 136 * 2) if b_k else (200 * 2, 200 * 136 * 2))
        assert spb[2] == ((64, bn) if b_k else (64, 64))
    assert specs[256][0] == specs[128][0]
    with pytest.raises(ValueError, match="tile width"):
        mt.tma_specs(g, 96)


def test_tma_specs_float32_boxes_span_128_bytes_of_k():
    """tf32 k-tiles are 32 float32 elements (128 bytes, like 64 of a 16-bit type): the boxes'
    K extent halves, the byte strides double."""
    g = replace(_layout_gemm(True, True, batch=3), dtype=DTYPES["float32"], precision="tf32")
    for bn in mt.TMA_TILE_N:
        spa, spb, nb = mt.tma_specs(g, bn)
        assert nb == 3 and spa[0] == (136, 300, 3) and spb[0] == (136, 200, 3)
        assert spa[1] == (136 * 4, 300 * 136 * 4) and spb[1] == (136 * 4, 200 * 136 * 4)
        assert spa[2] == (32, 128) and spb[2] == (32, bn)


def test_tma_takes_float32_only_as_tf32_with_k_major_operands(h100):
    nt = replace(_layout_gemm(True, True), dtype=DTYPES["float32"], precision="tf32")
    assert mt.uses_tma(nt) and mt.route(nt) == "tma"
    assert not mt.uses_tma(replace(nt, precision="ieee"))
    for a_k, b_k in LAYOUTS[1:]:  # an MN-major operand: mma.sync
        g = replace(_layout_gemm(a_k, b_k), dtype=DTYPES["float32"], precision="tf32")
        assert not mt.tma_if_aligned(g) and mt.route(g) == "mma"


def test_tma_specs_default_to_the_model(h100):
    g = _layout_gemm(True, True, M=8192, N=768, K=768)
    assert mt.tma_specs(g)[1][2] == (64, 128)
    g = _layout_gemm(True, True, M=4096, N=4096, K=4096)
    assert mt.tma_specs(g)[1][2] == (64, 256)
    g = _layout_gemm(True, True, M=4096, N=4096, K=1024)  # the cooperative epilogue's share tips it
    assert mt.tma_specs(g)[1][2] == (64, 128)


def test_prepare_checks_the_forced_width(h100):
    """tile_n forces the TMA kernel's width (tests, benchmarks): one of TMA_TILE_N, and only where
    the TMA kernel runs. Both checks come before anything is compiled."""
    g = _layout_gemm(True, False)
    assert mt.route(g) == "tma"
    with pytest.raises(ValueError, match="tile width"):
        mt.prepare(g, version="tma", tile_n=96)
    with pytest.raises(ValueError, match="tile_n sets the TMA kernel"):
        mt.prepare(g, version="mma", tile_n=128)
    with pytest.raises(ValueError, match="tile_n sets the TMA kernel"):
        mt.prepare(_layout_gemm(True, False, K=135), tile_n=128)  # misaligned rows: not TMA


def test_choose_split_takes_narrow_outputs_with_long_k(h100):
    # dW (M, N) = G^T X over K tokens: G^T a column-major view (A M-major), X row-major (B N-major)
    def dw(M, N, K, **kw):
        return _g(M=M, N=N, K=K, sa_m=1, sa_k=M, sb_k=N, sb_n=1, **kw)

    s = mt.choose_split(dw(1024, 256, 16384))
    assert s > 1 and 16384 % s == 0 and (16384 // s) % 64 == 0
    assert mt.choose_split(dw(4096, 4096, 4096)) == 1  # 512 tiles: the GPU is full
    assert mt.choose_split(dw(1024, 256, 512)) == 1  # K too short to split
    assert mt.choose_split(dw(1024, 256, 16384, batch=(1, 1, 2), sa_batch=(0, 0, 1), sb_batch=(0, 0, 1))) == 1
    assert mt.choose_split(dw(1024, 256, 16392)) == 1  # 16392 = 8 * 2049: no slice of whole k-tiles
    assert mt.choose_split(replace(dw(1024, 256, 16384), dtype=DTYPES["float32"], precision="tf32")) == 1  # not TMA
    # the model's numbers: the split's estimate beats one pass by the margin
    g = dw(1024, 256, 16384)
    part = mt.split_slices(g, s)
    t_split = mt._tma_seconds(part, 132) + mt.split_seconds(g, s)
    assert t_split < mt.SPLIT_GAIN * mt._tma_seconds(g, 132)


def test_prepare_split_rejects_bad_slices(h100):
    ws = lambda n: (None, 0)  # noqa: E731
    g = _g(M=256, N=256, K=4096, sa_m=4096, sb_k=256)
    with pytest.raises(ValueError, match="divide K"):
        mt.prepare(g, splits=3, workspace=ws)
    with pytest.raises(ValueError, match="without a workspace"):
        mt.prepare(g, splits=2)


def test_tma_batch_collapses_dimensions_or_declines():
    assert mt.tma_batch(_g()) == (1, 0, 0)
    # (2, 3) batches of contiguous (M, K) and (K, N) operands: one dimension of 6
    mk, kn = 256 * 128, 128 * 512
    assert mt.tma_batch(_g(batch=(1, 2, 3), sa_batch=(0, 3 * mk, mk), sb_batch=(0, 3 * kn, kn))) == (6, mk, kn)
    # a broadcast operand (stride 0) has no tensor-map stride
    assert mt.tma_batch(_g(batch=(1, 1, 4), sa_batch=(0, 0, mk), sb_batch=(0, 0, 0))) is None
    # permuted batch dimensions do not collapse
    assert mt.tma_batch(_g(batch=(1, 2, 3), sa_batch=(0, mk, 2 * mk), sb_batch=(0, 3 * kn, kn))) is None


def test_route_declines_what_tma_cannot_take():
    assert not mt.uses_tma(_g(K=0))
    assert not mt.uses_tma(_g(a=2))  # misaligned rows: the copy engine needs 16-byte alignment
    assert not mt.uses_tma(_g("float32", precision="tf32"))
    mk = 256 * 128
    assert not mt.uses_tma(_g(batch=(1, 1, 4), sa_batch=(0, 0, mk), sb_batch=(0, 0, 0)))  # broadcast B
    # pad-and-run asks whether aligned copies would help: not for these, whatever the device
    assert not mt.tma_if_aligned(_g(K=0)) and not mt.tma_if_aligned(_g("float32", precision="tf32"))
    assert not mt.tma_if_aligned(_g(batch=(1, 1, 4), sa_batch=(0, 0, mk), sb_batch=(0, 0, 0)))
    assert mt.tma_if_aligned(_g(a=2)) == mt.tma_if_aligned(_g())  # alignment is the only difference
    with pytest.raises(ValueError, match="TMA kernel cannot run"):
        mt.route(_g(a=2), version="tma")
    with pytest.raises(ValueError, match="wgmma kernel cannot run"):
        mt.route(_g(), version="wgmma")  # B row-major: the cp.async wgmma kernel takes K-major B only
    with pytest.raises(ValueError, match="unknown version"):
        mt.route(_g(), version="cublas")


def test_operand_layouts_follow_the_unit_stride():
    assert mt.operand_layouts(_g()) == (True, False)  # row-major A, row-major B
    assert mt.operand_layouts(_g(sa_m=1, sa_k=256, sb_k=1, sb_n=128)) == (False, True)
    # a size-1 dimension: the layout that never multiplies by its stride
    assert mt.operand_layouts(_g(M=1, sa_m=7, sa_k=3)) == (False, False)
    assert mt.operand_layouts(_g(K=1, sa_m=7, sa_k=3, sb_k=5, sb_n=9)) == (True, True)
    assert mt.operand_layouts(_g(N=1, sb_k=5, sb_n=9)) == (True, False)


def test_load_path_checks_every_row_start():
    assert mt.load_path(_g()) == 1
    assert mt.load_path(_g(a=2)) == 0  # pointer off by one bf16 element
    assert mt.load_path(_g(K=4093, sa_m=4093)) == 0  # odd leading dimension
    assert mt.load_path(_g(M=1, sa_m=4093)) == 1  # ... unless there is one row
    assert mt.load_path(_g(batch=(2, 1, 1), sa_batch=(4, 0, 0))) == 0  # batch stride 8 bytes
    assert mt.load_path(_g(batch=(2, 1, 1), sa_batch=(8, 0, 0), sb_batch=(0, 0, 0))) == 1
    assert mt.load_path(_g("float32", precision="tf32")) == 1
    assert mt.load_path(_g("float32", precision="tf32", K=127, sa_m=127)) == 2
    assert mt.load_path(_g("float32", precision="tf32", b=(1 << 20) + 4)) == 2


def test_shared_memory_fits_hopper_and_a100():
    h100, a100 = 227 * 1024, 163 * 1024
    for dtype in ("bfloat16", "float16", "float32"):
        for a_k, b_k in LAYOUTS:
            g = _g(dtype, sa_m=128 if a_k else 1, sa_k=1 if a_k else 256,
                   sb_k=1 if b_k else 512, sb_n=128 if b_k else 1)
            for load in mt.LOADS[dtype]:
                assert 0 < mt.smem_bytes(g, load, h100) <= h100
                if load != 0:
                    assert mt.smem_bytes(g, load, a100) == 3 * mt.STAGE
    assert mt.smem_bytes(_g(), 0, a100) == 0  # the staged path needs Hopper's shared memory


def test_supports_dtypes_and_precisions():
    assert not mt.supports(_g("float32"))  # IEEE float32: the SIMT family
    assert not mt.supports(_g("float64"))
    assert not mt.supports(_g(act=7))


# ------------------------------------------------------------------------------------------ GPU
torch = pytest.importorskip("torch")


def _tensor(shape, dtype, device="cuda", row_major=True, scale=1.0):
    """Random values exactly representable in dtype; row_major=False stores the last two
    dimensions transposed (a .mT view, no copy)."""
    tdt = getattr(torch, dtype)
    if row_major or len(shape) < 2:
        t = torch.randn(*shape, device=device)
    else:
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device).mT
    return (t * scale).to(tdt)


def make_gemm(a, b, c, bias=None, act=-1, precision="ieee") -> Gemm:
    """The Gemm of c = act(a @ b + bias) for torch tensors a (..., M, K), b (..., K, N) and a
    contiguous c (..., M, N), batch dimensions broadcast (up to 3)."""
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    assert len(batch) <= 3 and c.is_contiguous() and tuple(c.shape) == (*batch, M, N)
    ae, be = a.expand(*batch, M, K), b.expand(*batch, K, N)
    pad = 3 - len(batch)
    return Gemm(
        dtype=DTYPES[str(a.dtype).removeprefix("torch.")], M=M, N=N, K=K,
        a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), bias=0 if bias is None else bias.data_ptr(), act=act,
        sa_m=ae.stride(-2), sa_k=ae.stride(-1), sb_k=be.stride(-2), sb_n=be.stride(-1),
        batch=(1,) * pad + batch, sa_batch=(0,) * pad + tuple(ae.stride()[:-2]),
        sb_batch=(0,) * pad + tuple(be.stride()[:-2]), precision=precision, device=a.device.index or 0,
    )


def run(a, b, bias=None, act=-1, precision="ieee", load=None, out=None, version=None, tile_n=None):
    """Launch on torch's current stream into a NaN-poisoned c; returns c. version: None (the
    default route: TMA on Hopper for aligned 16-bit problems), "tma", "wgmma" or "mma"; tile_n:
    the TMA kernel's block-tile width (None: the wave model's)."""
    from cukit.interop import current_stream

    M, N = a.shape[-2], b.shape[-1]
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    c = out if out is not None else torch.full((*batch, M, N), float("nan"), dtype=a.dtype, device=a.device)
    g = make_gemm(a, b, c, bias, act, precision)
    mt.launch(g, current_stream(g.device, True), load=load, version=version, tile_n=tile_n)
    torch.cuda.synchronize()
    return c


def check(c, a, b, bias=None, act=-1, tf32=False):
    """c against float64, with the bound in the module docstring; every element must be written."""
    dtype = str(c.dtype).removeprefix("torch.")
    K = a.shape[-1]
    assert not torch.isnan(c).any(), f"{int(torch.isnan(c).sum())} elements not written (or NaN)"
    ad, bd = a.double(), b.double()
    z = ad @ bd
    mag = ad.abs() @ bd.abs()
    if bias is not None:
        z = z + bias.double()
        mag = mag + bias.double().abs()
    acc_err = (K + 2) * EPS32 * mag
    if tf32:  # each operand rounded (mma.sync: cvt.rna, 2^-11) or truncated (TMA's wgmma: 2^-10) to tf32
        acc_err = acc_err + 2 * 2.0**-10 * mag
    if act >= 0:
        y = torch.from_numpy(reference_numpy(z.cpu().numpy(), np.zeros(z.shape[-1]), ACT_NAMES[act])).to(z.device)
        bound = 1.2 * acc_err + 8 * EPS32 * (z.abs() + y.abs()) + 1e-30
    else:
        y, bound = z, acc_err
    bound = bound + UNIT_ROUNDOFF[dtype] * (y.abs() + bound) + (2.0**-24 if dtype == "float16" else 1e-38)
    err = (c.double() - y).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(
            f"{int(bad.sum())} of {c.numel()} elements off; worst at flat index {i}: got {c.flatten()[i].item()}, "
            f"want {y.flatten()[i].item()} (bound {bound.flatten()[i].item():.3g})"
        )


gpu = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def versions_for(dtype, layout):
    """Every kernel that can run a problem of this dtype and layout: the default route (TMA on
    Hopper when aligned) and mma.sync; the cp.async wgmma kernel for x @ W.T on Hopper."""
    if dtype == "float32":
        return (None,)
    return (None, "mma", "wgmma") if _hopper() and layout == (True, False) else (None, "mma")


DTYPE_PARAMS = [("bfloat16", "ieee"), ("float16", "ieee"), ("float32", "tf32")]
SHAPES = [(1, 1, 1), (5, 3, 2), (7, 13, 5), (129, 257, 67), (64, 100, 200), (200, 40, 33), (256, 512, 256)]


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("dtype", "precision"), DTYPE_PARAMS, ids=[d for d, _ in DTYPE_PARAMS])
def test_gpu_odd_shapes_every_layout(dtype, precision, layout):
    """M, N, K of 1, primes, K and N not multiples of 8, several tiles; the natural load path
    (misaligned leading dimensions take path 0 / 2), then the unaligned path forced on each; for
    x @ W.T both kernel families."""
    torch.manual_seed(0)
    slow = {"bfloat16": 0, "float16": 0, "float32": 2}[dtype]
    versions = versions_for(dtype, layout)
    for M, N, K in SHAPES:
        a = _tensor((M, K), dtype, row_major=layout[0])
        b = _tensor((K, N), dtype, row_major=layout[1])
        for load in (None, slow):
            for version in versions:
                check(run(a, b, precision=precision, load=load, version=version), a, b, tf32=precision == "tf32")


@gpu
@pytest.mark.parametrize("layout", [(True, True), (True, False)], ids=["NN", "NT"])
def test_gpu_prime_4097x4095x4093(layout):
    """The misaligned case that makes cuBLAS slow: every leading dimension odd."""
    torch.manual_seed(1)
    a = _tensor((4097, 4093), "bfloat16")
    b = _tensor((4093, 4095), "bfloat16", row_major=layout[1])
    g = make_gemm(a, b, torch.empty(4097, 4095, dtype=torch.bfloat16, device="cuda"))
    assert mt.load_path(g) == 0
    rows = torch.cat([torch.tensor([0, 4096]), torch.randperm(4097)[:62]]).cuda()
    for version in versions_for("bfloat16", layout):
        c = run(a, b, version=version)
        assert not torch.isnan(c).any()
        check(c[rows], a[rows], b)


@gpu
def test_gpu_k_zero_is_the_epilogue_of_zero():
    torch.manual_seed(2)
    a = torch.empty(70, 0, dtype=torch.bfloat16, device="cuda")
    b = torch.empty(0, 300, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(run(a, b), torch.zeros(70, 300, dtype=torch.bfloat16, device="cuda"))
    bias = _tensor((300,), "bfloat16")
    c = run(a, b, bias, act=ACTIVATIONS["gelu_tanh"])
    check(c, a, b, bias, ACTIVATIONS["gelu_tanh"])
    bt = torch.empty(300, 0, dtype=torch.bfloat16, device="cuda").t()  # K-major: the wgmma kernel on Hopper
    c = run(a, bt, bias, act=ACTIVATIONS["gelu_tanh"])
    check(c, a, bt, bias, ACTIVATIONS["gelu_tanh"])


@gpu
@pytest.mark.parametrize(("dtype", "precision"), DTYPE_PARAMS, ids=[d for d, _ in DTYPE_PARAMS])
def test_gpu_batched_with_broadcast(dtype, precision):
    """Three batch dimensions, A broadcast along the first (stride 0), B along the second."""
    torch.manual_seed(3)
    a = _tensor((1, 3, 2, 70, 48), dtype).expand(4, 3, 2, 70, 48)
    b = _tensor((4, 1, 2, 48, 90), dtype, row_major=False).expand(4, 3, 2, 48, 90)
    check(run(a, b, precision=precision), a, b, tf32=precision == "tf32")
    a2 = _tensor((2, 33, 21), dtype)  # odd K: misaligned batch strides
    b2 = _tensor((21, 17), dtype)
    check(run(a2, b2, precision=precision), a2, b2, tf32=precision == "tf32")


@gpu
def test_gpu_more_batches_than_grid_z():
    torch.manual_seed(4)
    a = _tensor((70000, 3, 8), "bfloat16")
    b = _tensor((70000, 8, 5), "bfloat16")
    check(run(a, b), a, b)
    bt = _tensor((70000, 8, 5), "bfloat16", row_major=False)
    check(run(a, bt), a, bt)


@gpu
@pytest.mark.parametrize("act", [-1, *ACTIVATIONS.values()], ids=["none", *ACTIVATIONS])
def test_gpu_epilogue_bias_and_activation(act):
    """bias + each activation on nn.Linear's layout (x @ W.T), both kernel families, aligned;
    gelu also misaligned."""
    torch.manual_seed(5)
    x = _tensor((300, 96), "bfloat16")
    w = _tensor((260, 96), "bfloat16")  # (out, in)
    bias = _tensor((260,), "bfloat16")
    for version in versions_for("bfloat16", (True, False)):
        check(run(x, w.t(), bias, act, version=version), x, w.t(), bias, act)
    for version in versions_for("float16", (True, True)):  # a @ b: TMA with N-major B on Hopper
        w16 = _tensor((96, 260), "float16")
        x16 = x.to(torch.float16)
        check(run(x16, w16, bias.to(torch.float16), act, version=version), x16, w16, bias.to(torch.float16), act)
    if act == ACTIVATIONS["gelu"]:
        x2, w2 = _tensor((131, 77), "bfloat16"), _tensor((259, 77), "bfloat16")
        bias2 = _tensor((259,), "bfloat16")
        for version in (None, "mma"):
            check(run(x2, w2.t(), bias2, act, version=version), x2, w2.t(), bias2, act)


@gpu
@pytest.mark.parametrize(("dtype", "precision"), DTYPE_PARAMS, ids=[d for d, _ in DTYPE_PARAMS])
def test_gpu_misaligned_pointers_and_guarded_output(dtype, precision):
    """Operands and C starting one element past an aligned address; the elements around C stay
    untouched."""
    torch.manual_seed(6)
    M, N, K = 150, 270, 96
    tdt = getattr(torch, dtype)
    abuf, bbuf = _tensor((M * K + 1,), dtype), _tensor((K * N + 1,), dtype)
    a, b = abuf[1:].view(M, K), bbuf[1:].view(K, N)
    cbuf = torch.full((M * N + 2,), 7.0, dtype=tdt, device="cuda")
    c = cbuf[1:-1].view(M, N)
    c.fill_(float("nan"))
    g = make_gemm(a, b, c, precision=precision)
    assert mt.load_path(g) == (2 if dtype == "float32" else 0)
    run(a, b, precision=precision, out=c)
    check(c, a, b, tf32=precision == "tf32")
    assert cbuf[0].item() == 7.0 and cbuf[-1].item() == 7.0
    if dtype != "float32":  # x @ W.T with a misaligned W: the staged wgmma kernel on Hopper
        bt = bbuf[1:].view(N, K).t()
        c.fill_(float("nan"))
        run(a, bt, out=c)
        check(c, a, bt)
        assert cbuf[0].item() == 7.0 and cbuf[-1].item() == 7.0


@gpu
def test_gpu_tf32_rounds_the_inputs():
    """1 + 2^-15 is 1 in tf32 (10 mantissa bits, cvt.rna): the product of a row of them with ones
    is exactly K, not K (1 + 2^-15) as in fp32."""
    K = 64
    a = torch.full((32, K), 1 + 2.0**-15, device="cuda")
    b = torch.ones(K, 40, device="cuda")
    c = run(a, b, precision="tf32")
    assert torch.equal(c, torch.full_like(c, float(K)))


@gpu
@pytest.mark.parametrize("tile_n", [None, 256, 192, 128, 64])
def test_gpu_tma_tf32_widths_bias_activations(tile_n):
    """float32 as tf32 on the TMA kernel (x @ W.T: both operands K-major), each tile width forced:
    ragged tiles, K not a multiple of the 32-element k-tile, a batch of persistent tiles, bias with
    every activation (the fp32 epilogue's exact forms)."""
    if not _hopper():
        pytest.skip("the TMA kernels run on compute capability 9.0")
    torch.manual_seed(11)
    for batch, M, N, K in (((), 300, 200, 136), ((3,), 129, 264, 1028)):
        a, w = _tensor((*batch, M, K), "float32"), _tensor((*batch, N, K), "float32")
        b = w.mT
        assert mt.route(make_gemm(a, b, torch.empty(*batch, M, N, device="cuda"), precision="tf32")) == "tma"
        check(run(a, b, precision="tf32", version="tma", tile_n=tile_n), a, b, tf32=True)
        bias = _tensor((N,), "float32")
        for act in mt.ACTS[1:]:
            c = run(a, b, bias, act, precision="tf32", version="tma", tile_n=tile_n)
            check(c, a, b, bias, act, tf32=True)


@gpu
def test_gpu_large_values_do_not_overflow_the_accumulator():
    """bf16 inputs near 2^100: products need fp32's exponent range (fp16 accumulation would fail)."""
    torch.manual_seed(7)
    a = _tensor((64, 128), "bfloat16", scale=2.0**50)
    b = _tensor((128, 72), "bfloat16", scale=2.0**50)
    check(run(a, b), a, b)


@gpu
def test_gpu_route_on_hopper():
    """On compute capability 9.0, aligned 16-bit problems of every layout take the TMA kernels,
    misaligned x @ W.T the cp.async wgmma kernel, other misaligned layouts and broadcast batches
    mma.sync; float32 (tf32) x @ W.T the TMA kernel, its other layouts mma.sync. Elsewhere
    everything runs on mma.sync."""
    hopper = _hopper()
    x, w = _tensor((64, 96), "bfloat16"), _tensor((40, 96), "bfloat16")
    c = torch.empty(64, 40, dtype=torch.bfloat16, device="cuda")
    assert mt.route(make_gemm(x, w.t(), c)) == ("tma" if hopper else "mma")
    assert mt.route(make_gemm(x, w.t().contiguous(), c)) == ("tma" if hopper else "mma")
    assert mt.route(make_gemm(x.t().contiguous().t(), w.t(), c)) == ("tma" if hopper else "mma")
    x2, w2 = _tensor((64, 95), "bfloat16"), _tensor((40, 95), "bfloat16")
    assert mt.route(make_gemm(x2, w2.t(), c)) == ("wgmma" if hopper else "mma")
    assert mt.route(make_gemm(x2, w2.t().contiguous(), c)) == "mma"
    xb = _tensor((1, 64, 96), "bfloat16").expand(3, 64, 96)
    cb = torch.empty(3, 64, 40, dtype=torch.bfloat16, device="cuda")
    assert mt.route(make_gemm(xb, w.t(), cb)) == ("wgmma" if hopper else "mma")  # broadcast A: no TMA
    xf, wf = _tensor((64, 96), "float32"), _tensor((40, 96), "float32")
    cf = torch.empty(64, 40, device="cuda")
    assert mt.route(make_gemm(xf, wf.t(), cf, precision="tf32")) == ("tma" if hopper else "mma")
    assert mt.route(make_gemm(xf, wf.t().contiguous(), cf, precision="tf32")) == "mma"  # N-major B
    xf2, wf2 = _tensor((64, 98), "float32"), _tensor((40, 98), "float32")
    assert mt.route(make_gemm(xf2, wf2.t(), cf, precision="tf32")) == "mma"  # rows not 16-byte aligned


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("K", [72, 200, 256, 1000])
def test_gpu_tma_persistent_tiles_and_ring_phases(layout, K):
    """More tiles than SMs (each CTA runs several, its ring's phases carried across tiles), K of
    2 to 16 k-tiles with a ragged last one (zero-filled by the copy engine), every layout;
    sampled rows and columns against float64, every element written."""
    if not _hopper():
        pytest.skip("the TMA kernels run on compute capability 9.0")
    torch.manual_seed(8)
    M, N = 2 * 1024 + 72, 4096 + 200  # ragged last tiles; multiples of 8 so that M-/N-major rows align
    a = _tensor((M, K), "bfloat16", row_major=layout[0])
    b = _tensor((K, N), "bfloat16", row_major=layout[1])
    assert mt.route(make_gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16, device="cuda"))) == "tma"
    c = run(a, b)
    assert not torch.isnan(c).any()
    rows = torch.cat([torch.tensor([0, M - 1]), torch.randperm(M)[:30]]).cuda()
    check(c[rows], a[rows], b)
    cols = torch.cat([torch.tensor([0, N - 1]), torch.randperm(N)[:30]]).cuda()
    check(c[:, cols], a, b[:, cols])


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_gpu_tma_batched(layout):
    """Batches as the tensor map's third dimension: 3 batches, and (2, 3) batches that collapse
    into one dimension of 6; M and N not multiples of the tile."""
    torch.manual_seed(9)
    for batch in ((3,), (2, 3)):
        a = _tensor((*batch, 136, 64), "float16", row_major=layout[0])
        b = _tensor((*batch, 64, 264), "float16", row_major=layout[1])
        c = torch.empty(*batch, 136, 264, dtype=torch.float16, device="cuda")
        if _hopper():
            assert mt.route(make_gemm(a, b, c)) == "tma"
        check(run(a, b), a, b)


# Both TMA tile widths on shapes that are not multiples of either tile (1, 127, 129, 255, 257,
# 777 x 769 x 1031), batched, every layout, bias + every activation. TMA needs 16-byte aligned
# rows: the operands are views of buffers whose rows are padded to 8 elements, the padding NaN
# (the copy engine must read only the logical extent: a NaN read would reach C).
TMA_ODD_SHAPES = [(1, 1, 1), (127, 129, 1), (129, 255, 127), (255, 257, 129), (257, 127, 255), (1, 264, 257),
                  (136, 264, 64), (777, 769, 1031)]
TMA_ODD_BATCHED = [((3,), 129, 257, 127), ((2, 3), 127, 136, 255)]


def _padded(shape, dtype, row_major=True):
    """Random exactly-representable values of `shape` (..., R, C) in a view of a buffer whose
    rows hold a multiple of 8 elements, the padding NaN; row_major=False stores the last two
    dimensions transposed (the buffer is (..., C, R8), the view its .mT)."""
    *batch, r, c = shape
    inner, outer = (c, r) if row_major else (r, c)
    buf = _tensor((*batch, outer, -(-inner // 8) * 8), dtype)
    buf[..., inner:] = float("nan")
    v = buf[..., :inner]
    return v if row_major else v.mT


def _hopper_or_skip():
    if not _hopper():
        pytest.skip("the TMA kernels run on compute capability 9.0")


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("tile_n", mt.TMA_TILE_N)
def test_gpu_tma_tile_widths_odd_shapes(tile_n, layout):
    """Each width forced, bf16 over the odd shapes and batches, fp16 over the largest and a batch;
    every element against float64 (and every element written: C starts NaN)."""
    _hopper_or_skip()
    torch.manual_seed(10)
    cases = [("bfloat16", (), M, N, K) for M, N, K in TMA_ODD_SHAPES]
    cases += [("bfloat16", batch, M, N, K) for batch, M, N, K in TMA_ODD_BATCHED]
    cases += [("float16", (), 777, 769, 1031), ("float16", *TMA_ODD_BATCHED[1])]
    for dtype, batch, M, N, K in cases:
        a = _padded((*batch, M, K), dtype, row_major=layout[0])
        b = _padded((*batch, K, N), dtype, row_major=layout[1])
        c = torch.full((*batch, M, N), float("nan"), dtype=a.dtype, device="cuda")
        assert mt.route(make_gemm(a, b, c)) == "tma", (dtype, batch, M, N, K)
        check(run(a, b, version="tma", tile_n=tile_n), a, b)


@gpu
@pytest.mark.parametrize("act", [-1, *ACTIVATIONS.values()], ids=["none", *ACTIVATIONS])
@pytest.mark.parametrize("tile_n", mt.TMA_TILE_N)
def test_gpu_tma_tile_widths_bias_activation(tile_n, act):
    """bias + each activation through the staged epilogue of each width, every layout, 777 x 769 x
    1031 (odd N: 2-byte stores) and a batched 129 x 264 x 127 (16-byte stores, ragged last tile)."""
    _hopper_or_skip()
    torch.manual_seed(11)
    for layout in LAYOUTS:
        for batch, M, N, K in (((), 777, 769, 1031), ((2,), 129, 264, 127)):
            a = _padded((*batch, M, K), "bfloat16", row_major=layout[0])
            b = _padded((*batch, K, N), "bfloat16", row_major=layout[1])
            bias = _tensor((N,), "bfloat16")
            check(run(a, b, bias, act, version="tma", tile_n=tile_n), a, b, bias, act)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("tile_n", mt.TMA_TILE_N)
def test_gpu_tma_tile_widths_persistent(tile_n, layout):
    """More tiles than SMs for each width (2 x 9 x 9 of 128 x 256, 2 x 9 x 17 of 128 x 128): each
    CTA runs several tiles across the batch boundary, the producer filling the next tile's stages
    during the epilogue; K of 4 k-tiles (fewer than the ring's stages) and of 17 (the ring wraps
    within a tile)."""
    _hopper_or_skip()
    torch.manual_seed(12)
    for K in (200, 1031):
        a = _padded((2, 1100, K), "bfloat16", row_major=layout[0])
        b = _padded((2, K, 2100), "bfloat16", row_major=layout[1])
        bias = _tensor((2100,), "bfloat16")
        check(run(a, b, bias, version="tma", tile_n=tile_n), a, b, bias)


@gpu
def test_gpu_tma_default_width_is_the_models():
    """prepare without tile_n launches the width (and schedule) tma_tile_n picks for the device
    (8192 x 768 x 768 and 4096 x 4096 x 1024 take 128 x 128 ping-pong on an H100 or H200, 1024^3
    128 x 64 ping-pong, 4096^3 128 x 256 cooperative, 4096 x 768 x 768 128 x 192 cooperative), with
    its grid and shared memory."""
    _hopper_or_skip()
    from cukit._device import device_caps

    sms = device_caps(0).sm_count
    picked = set()
    for M, N, K in ((8192, 768, 768), (1024, 1024, 1024), (4096, 4096, 1024), (4096, 4096, 4096), (4096, 768, 768)):
        # prepare encodes no tensor map and reads no memory: aligned fake pointers do
        g = _g(M=M, N=N, K=K, sa_m=K, sb_k=1, sb_n=K, a=1 << 20, b=1 << 30, c=1 << 31)
        bn = mt.tma_tile_n(g)
        assert bn == mt.tma_tile_n(g, sms)
        launch = mt.prepare(g).launch
        assert launch.name == mt.tma_name("bfloat16", -1, True, True, bn)
        assert launch.grid[0] == min(sms, -(-M // 128) * -(-N // bn)) and launch.smem == mt.TMA_SMEM[bn]
        picked.add(bn)
    assert picked == set(mt.TMA_TILE_N)


def _split_run(a, b, c, splits, bias=None, act=-1, precision="ieee", **scaled):
    from cukit.interop import current_stream
    from cukit.ops.matmul import _workspace

    g = make_gemm(a, b, c, bias, act, precision)
    if scaled:
        g = replace(g, scaled=True, **scaled)
    run_ = mt.prepare(g, splits=splits, workspace=_workspace("torch", g.device))
    assert isinstance(run_, SplitK) and run_.splits == splits
    run_(g.head(), current_stream(g.device, True))
    torch.cuda.synchronize()
    return c


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("dtype", "precision"), DTYPE_PARAMS, ids=[d for d, _ in DTYPE_PARAMS])
def test_gpu_tma_split_k_every_layout_and_activation(dtype, precision, layout):
    """K split into 2 and 4 slices on the TMA kernel, then splitk_reduce: M, N not multiples of
    the tile or of the sum's 4-column groups (the scalar path), bias and every activation; the
    operands are views of NaN-padded rows (the slices must read only their own part of K)."""
    _hopper_or_skip()
    if precision == "tf32" and layout != (True, False):
        pytest.skip("tf32 runs on the TMA kernel with K-major operands only (x @ W.T)")
    torch.manual_seed(12)
    for M, N, K in ((136, 72, 2048), (129, 42, 3072)):
        a = _padded((M, K), dtype, row_major=layout[0])
        b = _padded((K, N), dtype, row_major=layout[1])
        bias = _tensor((N,), dtype)
        for splits in (2, 4):
            for act in (-1, *ACTIVATIONS.values()):
                c = torch.full((M, N), float("nan"), dtype=a.dtype, device="cuda")
                check(_split_run(a, b, c, splits, bias, act, precision), a, b, bias, act, tf32=precision == "tf32")


@gpu
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_gpu_tma_split_k_scaled_epilogues(out):
    """alpha (A B) + beta C into float32 or bfloat16 C, beta 0 (C never read: NaN stays out) and not."""
    _hopper_or_skip()
    torch.manual_seed(13)
    M, N, K = 200, 96, 4096
    a = _tensor((K, M), "bfloat16").mT  # G^T
    b = _tensor((K, N), "bfloat16")
    c0 = torch.randn(M, N, device="cuda").to(getattr(torch, out))
    ref = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    for beta in (0.0, 0.5):
        c = c0.clone() if beta else torch.full((M, N), float("nan"), dtype=c0.dtype, device="cuda")
        _split_run(a, b, c, 4, alpha=2.0, beta=beta, c_dtype=DTYPES[out])
        want = 2.0 * ref + beta * c0.double()
        bound = 2.0 * (K + 2) * EPS32 * mag + UNIT_ROUNDOFF[out] * (want.abs() + 1e-30) + 1e-30
        err = (c.double() - want).abs()
        assert not torch.isnan(c).any() and (err <= bound).all(), f"beta {beta}: worst {float((err - bound).max())}"


@gpu
def test_gpu_split_k_through_matmul_and_autograd():
    """The front end splits a dW-shaped bf16 product on its own (cukit.matmul of G^T and X, and
    cukit.nn.Linear's weight gradient), with the plan cached."""
    _hopper_or_skip()
    import cukit
    from cukit.ops import matmul as mm

    torch.manual_seed(14)
    T, o, i = 16384, 1024, 256
    g = _tensor((T, o), "bfloat16")
    x = _tensor((T, i), "bfloat16")
    gm, _, _ = mm._build_gemm(g.mT, x, "torch", batch=(), M=o, K=T, N=i, c_ptr=0, bias_ptr=0, act=-1,
                              precision="ieee", device=0, dtype=DTYPES["bfloat16"])
    assert mt.choose_split(gm) > 1
    for _ in range(2):
        c = cukit.matmul(g.mT, x)
        check(c, g.mT, x)
    key = mm._plan_key("matmul", g.mT, x, None, -1, mm.get_matmul_precision(), None)
    assert isinstance(mm._PLANS.get(key).run, SplitK)
    lin = cukit.nn.Linear(i, o, bias=False, device="cuda", dtype=torch.bfloat16)
    xi = x.clone().requires_grad_(False)
    lin(xi).backward(g)
    check(lin.weight.grad, g.mT, x)
