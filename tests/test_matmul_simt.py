"""matmul_simt: the SIMT matmul kernels (v1 and the register-blocked v2) called directly with Gemm
problems, against NumPy float64. Error bound per element (Higham's gamma_K for any summation order):
|C - ref| <= K * eps * (|A| @ |B|) (+ the epilogue's few roundings), with |A| @ |B| in float64."""

from __future__ import annotations

import numpy as np
import pytest

from cukit.ops import matmul_simt as ms
from cukit.ops._gemm import EPI_ACCUMULATE, EPI_SCALE, Gemm, SplitK
from cukit.ops.bias_act import ACTIVATIONS, reference_numpy

ACT_NAMES = {v: k for k, v in ACTIVATIONS.items()}
LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]
LAYOUT_IDS = ["NN", "NT", "TN", "TT"]  # T: stored transposed (column-major)
VERSIONS = [("simt", "large"), ("simt", "small"), ("v1", None)]
VERSION_IDS = ["simt-large", "simt-small", "v1"]


def _has_nvrtc() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------ CPU
def _compile_group(group: str) -> tuple[int, str]:
    from cukit._runtime import KernelCompileError

    try:
        return ms.KERNELS.compile_offline("sm_90", [group]), ""
    except KernelCompileError as e:  # its constructor does not survive pickling: send the text
        return 0, str(e)


# Every declared instantiation is compiled offline by `cukit check-kernels` (run by `make test`).


def test_instantiations_cover_every_launch():
    declared = set(ms.KERNELS.all_instantiations())
    for dtype, configs in ms.CONFIGS.items():
        for config, tile in configs.items():
            assert tile.threads in (128, 256) and tile.bm % tile.tm == 0 and tile.bn % tile.tn == 0
            for a, b in LAYOUTS:
                for act in ms.ACTS:
                    assert ms.kernel_name(dtype, config, a, b, act) in declared
        for act in ms.ACTS:
            assert ms.v1_name(dtype, act) in declared


def test_scaled_instantiations_cover_every_launch():
    """The scaled epilogues (no activation): one group per (dtype, config, EPI) of the four layouts;
    v1's group holds them too. The matmul path keeps its names (the template default)."""
    for dtype, configs in ms.CONFIGS.items():
        for config in configs:
            for epi, name in ((EPI_SCALE, "scale"), (EPI_ACCUMULATE, "accumulate")):
                group = ms.KERNELS.instantiations[f"{dtype}/{config}/{name}"]
                assert sorted(group) == sorted(ms.kernel_name(dtype, config, a, b, -1, epi=epi) for a, b in LAYOUTS)
        for epi in ms.SCALED_EPIS:
            assert ms.v1_name(dtype, -1, epi=epi) in ms.KERNELS.instantiations[f"{dtype}/v1"]
    assert ms.kernel_name("float32", "large", True, True, 0) == "matmul_simt<float, 128, 256, 8, 8, 16, true, true, 0>"
    assert ms.kernel_name("float64", "small", False, True, -1, epi=EPI_ACCUMULATE) == (
        "matmul_simt<double, 64, 64, 8, 4, 4, false, true, -1, 2>"
    )
    assert ms.v1_name("float32", -1, epi=EPI_SCALE) == "matmul_v1<float, -1, 1>"
    with pytest.raises(ValueError, match="no instantiation"):
        ms.kernel_name("float32", "large", True, True, 0, epi=EPI_ACCUMULATE)


def _g(**kw) -> Gemm:
    from cukit.interop import DTYPES

    base = dict(dtype=DTYPES["float32"], M=4, N=4, K=4, a=0, b=0, c=0, bias=0, act=-1,
                sa_m=4, sa_k=1, sb_k=4, sb_n=1)
    base.update(kw)
    return Gemm(**base)


def test_operand_layouts_follow_the_unit_stride():
    assert ms.operand_layouts(_g()) == (True, True)
    assert ms.operand_layouts(_g(sa_m=1, sa_k=4, sb_k=1, sb_n=4)) == (False, False)
    # a size-1 dimension: the layout that never uses that dimension's stride
    assert ms.operand_layouts(_g(M=1, sa_m=7, sa_k=3)) == (False, True)
    assert ms.operand_layouts(_g(K=1, sa_m=7, sa_k=3, sb_k=5, sb_n=9)) == (True, False)
    assert ms.operand_layouts(_g(N=1, sb_k=5, sb_n=9)) == (True, True)


def test_supports_and_grid_fold():
    from cukit.interop import DTYPES

    assert ms.supports(_g())
    assert not ms.supports(_g(precision="tf32"))
    assert ms.supports(_g(dtype=DTYPES["float64"], sa_m=4))
    assert not ms.supports(_g(dtype=DTYPES["float16"]))
    assert ms._fold(5) == (5, 1)
    gy, gz = ms._fold(70000 * 3)
    assert gy <= 65535 and gz <= 65535 and gy * gz >= 70000 * 3


def test_choose_config_wave_model(monkeypatch):
    monkeypatch.setattr(ms, "sm_count", lambda device: 132)
    assert ms.choose_config(_g(M=4096, N=4096, sa_m=4096, sb_k=4096)) == "large"
    assert ms.choose_config(_g(M=2048, N=2048, sa_m=2048, sb_k=2048)) == "large"
    assert ms.choose_config(_g(M=1024, N=1024, sa_m=1024, sb_k=1024)) == "small"
    assert ms.choose_config(_g(M=64, N=64, batch=(64, 1, 1), sa_m=64, sb_k=64)) == "small"
    assert ms.choose_config(_g(M=3, N=5)) == "small"


def test_choose_split_takes_long_k_with_few_tiles(monkeypatch):
    from cukit.interop import DTYPES

    monkeypatch.setattr(ms, "sm_count", lambda device: 132)
    # a weight gradient over 16,384 tokens into 1024 x 256: 8 large tiles in one pass
    dw = _g(M=1024, N=256, K=16384, sa_m=1, sa_k=1024, sb_k=256)
    config, s = ms.choose_split(dw)
    assert s > 1 and 16384 % s == 0 and (16384 // s) % 4 == 0
    assert ms._estimate(dw, ms.CONFIGS["float32"][config], s) < ms.SPLIT_GAIN * min(
        ms._estimate(dw, t, 1) for t in ms.CONFIGS["float32"].values())
    assert ms.choose_split(_g(dtype=DTYPES["float64"], M=1024, N=256, K=16384, sa_m=16384, sb_k=256))[1] > 1
    # problems that fill the GPU, short K, a batch, or a K without a usable divisor: one pass
    assert ms.choose_split(_g(M=4096, N=4096, K=4096, sa_m=4096, sb_k=4096)) == ("large", 1)
    assert ms.choose_split(_g(M=64, N=64, K=256, sa_m=256, sb_k=64))[1] == 1
    assert ms.choose_split(_g(M=64, N=64, K=16384, batch=(2, 1, 1), sa_m=16384, sb_k=64))[1] == 1
    assert ms.choose_split(_g(M=64, N=64, K=16381, sa_m=16381, sb_k=64))[1] == 1  # prime
    assert ms._split_candidates(_g(M=8, N=8, K=1030, sa_m=1030, sb_k=8)) == [1]  # 515 * 2: slices not 16-byte
    # a forced config keeps it
    assert ms.choose_split(dw, "small")[0] == "small"


def test_prepare_split_rejects_bad_slices():
    ws = lambda n: (None, 0)  # noqa: E731
    with pytest.raises(ValueError, match="divide K"):
        ms.prepare(_g(K=1024, sa_m=1024), splits=3, workspace=ws)
    with pytest.raises(ValueError, match="without a workspace"):
        ms.prepare(_g(K=1024, sa_m=1024), splits=2)
    with pytest.raises(ValueError, match="unbatched"):
        ms.prepare(_g(K=1024, sa_m=1024, batch=(2, 1, 1)), splits=2, workspace=ws)


# ------------------------------------------------------------------------------------------ GPU
def _torch():
    return pytest.importorskip("torch")


def _dev_array(x: np.ndarray, offset: int = 0):
    """A CUDA tensor holding x, starting `offset` elements into its allocation (offset 1: not
    16-byte aligned, so the kernels take their scalar paths)."""
    torch = _torch()
    flat = torch.empty(x.size + offset, dtype=getattr(torch, x.dtype.name), device="cuda")
    flat[offset:] = torch.from_numpy(np.ascontiguousarray(x).reshape(-1)).cuda()
    return flat[offset:].view(x.shape)


def _operand(x: np.ndarray, row_major: bool, offset: int = 0):
    """A CUDA view of x (..., R, S) that is row-major or column-major (a transposed copy viewed
    back, so the strides carry the transpose)."""
    if row_major:
        return _dev_array(x, offset)
    return _dev_array(np.swapaxes(x, -1, -2), offset).transpose(-1, -2)


def _gemm(a, b, c, bias=None, act: int = -1) -> Gemm:
    """The Gemm for c = act(a @ b + bias) with torch CUDA tensors; a (..., M, K) and b (..., K, N)
    broadcast over the batch dimensions (expand: stride 0); c contiguous (batch..., M, N)."""
    torch = _torch()
    from cukit.interop import as_dtype

    bshape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    ae = a.expand(*bshape, *a.shape[-2:])
    be = b.expand(*bshape, *b.shape[-2:])
    pad = 3 - len(bshape)
    assert pad >= 0 and tuple(c.shape) == (*bshape, a.shape[-2], b.shape[-1]) and c.is_contiguous()
    return Gemm(
        dtype=as_dtype(a.dtype), M=a.shape[-2], N=b.shape[-1], K=a.shape[-1],
        a=ae.data_ptr(), b=be.data_ptr(), c=c.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
        act=act, sa_m=ae.stride(-2), sa_k=ae.stride(-1), sb_k=be.stride(-2), sb_n=be.stride(-1),
        batch=(1,) * pad + tuple(bshape), sa_batch=(0,) * pad + ae.stride()[:-2],
        sb_batch=(0,) * pad + be.stride()[:-2], device=a.device.index,
    )


def _stream():
    from cukit.interop import current_stream

    return current_stream(_torch().cuda.current_device(), True)


def _run(g: Gemm, version: str, config: str | None) -> None:
    torch = _torch()
    from cukit.interop import current_stream

    ms.launch(g, current_stream(g.device, True), version=version, config=config)
    torch.cuda.synchronize()


def _reference(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, act: int, rows=None):
    """(act(a @ b + bias), the error bound) in float64, a and b broadcast; rows: a subsample of M."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if rows is not None:
        a64 = a64[..., rows, :]
    z = a64 @ b64
    mag = np.abs(a64) @ np.abs(b64)
    K = a.shape[-1]
    eps = np.finfo(a.dtype).eps
    bound = K * eps * mag
    if bias is not None:
        z = z + bias.astype(np.float64)
        bound = bound + eps * (np.abs(z) + np.abs(bias.astype(np.float64)))  # the bias add
    if act >= 0:
        # the activation is 1.13-Lipschitz at most; plus its own few roundings in the kernel
        # (erf/tanh near -1 cost about eps * |z| absolute in 0.5 z (1 + erf), as in any fp32 gelu)
        ref = reference_numpy(z, np.zeros(z.shape[-1]), ACT_NAMES[act])
        bound = 1.2 * bound + 8 * eps * (np.abs(ref) + np.abs(z))
    else:
        ref = z
    return ref, bound + 1e-30


def _check(out, ref: np.ndarray, bound: np.ndarray, what: str = "") -> None:
    got = out.double().cpu().numpy() if hasattr(out, "cpu") else np.asarray(out, np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    err = np.abs(got - ref)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        pytest.fail(f"{what}: {bad.sum()} elements off; worst at {i}: {got[i]} vs {ref[i]} (bound {bound[i]})")


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _problem(dtype, M, N, K, layout=(True, True), bias=False, act=-1, offset=0, seed=0, batch_a=(), batch_b=()):
    torch = _torch()
    rng = _rng(seed)
    a = rng.standard_normal((*batch_a, M, K)).astype(dtype)
    b = rng.standard_normal((*batch_b, K, N)).astype(dtype)
    bi = rng.standard_normal(N).astype(dtype) if bias else None
    da = _operand(a, layout[0], offset)
    db = _operand(b, layout[1], offset)
    dbias = _dev_array(bi, offset) if bias else None
    bshape = torch.broadcast_shapes(da.shape[:-2], db.shape[:-2])
    c = _dev_array(np.full((*bshape, M, N), np.nan, dtype), offset)  # poisoned
    return a, b, bi, da, db, dbias, c


SHAPES = [
    (1, 1, 1), (1, 1, 0), (3, 5, 0), (1, 7, 1), (7, 1, 13), (2, 3, 4), (5, 123, 123),
    (127, 131, 137), (128, 128, 8), (129, 127, 9), (257, 129, 67), (64, 64, 16), (65, 63, 17),
    (3, 5, 4099), (33, 200, 1031),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("version", "config"), VERSIONS, ids=VERSION_IDS)
def test_odd_shapes_all_layouts(dtype, layout, version, config):
    for i, (M, N, K) in enumerate(SHAPES):
        a, b, _, da, db, _, c = _problem(dtype, M, N, K, layout, seed=i)
        _run(_gemm(da, db, c), version, config)
        ref, bound = _reference(a, b, None, -1)
        _check(c, ref, bound, f"{version}/{config} {dtype} {LAYOUT_IDS[LAYOUTS.index(layout)]} M,N,K={M},{N},{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize(("version", "config"), VERSIONS, ids=VERSION_IDS)
def test_misaligned_pointers_take_the_scalar_path(dtype, layout, version, config):
    # offset by one element: A, B, C and bias all misaligned; K and N not multiples of 4
    for i, (M, N, K) in enumerate([(37, 41, 43), (130, 67, 129), (64, 64, 16), (5, 6, 7)]):
        a, b, bi, da, db, dbias, c = _problem(dtype, M, N, K, layout, bias=True, offset=1, seed=i)
        _run(_gemm(da, db, c, dbias), version, config)
        ref, bound = _reference(a, b, bi, -1)
        _check(c, ref, bound, f"misaligned {version}/{config} {dtype} M,N,K={M},{N},{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("act", ms.ACTS)
@pytest.mark.parametrize(("version", "config"), VERSIONS, ids=VERSION_IDS)
def test_epilogue_bias_and_activation(dtype, act, version, config):
    for i, (M, N, K, layout, bias) in enumerate([
        (67, 129, 45, (True, False), True),   # nn.Linear's layout: B = W^T
        (130, 66, 33, (True, True), True),
        (9, 260, 1, (False, True), False),
        (3, 7, 0, (True, True), True),         # K == 0: C = act(bias)
        (5, 9, 0, (False, False), False),      # K == 0, no bias: C = act(0)
    ]):
        a, b, bi, da, db, dbias, c = _problem(dtype, M, N, K, layout, bias=bias, act=act, seed=i)
        _run(_gemm(da, db, c, dbias, act), version, config)
        ref, bound = _reference(a, b, bi, act)
        _check(c, ref, bound, f"{version}/{config} {dtype} act={act} bias={bias} M,N,K={M},{N},{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("version", "config"), VERSIONS, ids=VERSION_IDS)
def test_batched_with_broadcast(dtype, version, config):
    for i, (ba, bb, layout) in enumerate([
        ((2, 1, 3), (1, 4, 1), (True, True)),
        ((5,), (1,), (False, True)),
        ((1,), (6,), (True, False)),
        ((2, 3), (2, 3), (False, False)),
    ]):
        a, b, bi, da, db, dbias, c = _problem(dtype, 37, 70, 19, layout, bias=True, act=0, seed=i,
                                              batch_a=ba, batch_b=bb)
        _run(_gemm(da, db, c, dbias, 0), version, config)
        ref, bound = _reference(a, b, bi, 0)
        _check(c, ref, bound, f"batched {version}/{config} {dtype} {ba} x {bb}")


@pytest.mark.gpu
@pytest.mark.parametrize(("version", "config"), VERSIONS, ids=VERSION_IDS)
def test_grid_limits_batch_and_rows_past_65535(version, config):
    # 70000 batches: grid.z (v1) or the folded grid.y x grid.z (simt) past 65535
    a, b, _, da, db, _, c = _problem("float32", 3, 5, 6, seed=1, batch_a=(70000,), batch_b=(1,))
    _run(_gemm(da, db, c), version, config)
    ref, bound = _reference(a, b, None, -1)
    _check(c, ref, bound, f"batch 70000 {version}/{config}")
    # 9e6 rows: more than 65535 row tiles of 128
    M = 9_000_000
    a, b, _, da, db, _, c = _problem("float32", M, 3, 2, (False, True), seed=2)
    _run(_gemm(da, db, c), version, config)
    ref, bound = _reference(a, b, None, -1)
    _check(c, ref, bound, f"M={M} {version}/{config}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_large_odd_problem_subsampled(dtype, layout):
    torch = _torch()
    M, N, K = 4097, 4095, 4093
    a, b, _, da, db, _, c = _problem(dtype, M, N, K, layout, seed=7)
    rows = np.unique(np.r_[0, M - 1, 127, 128, 4096, _rng(3).integers(0, M, 40)])
    for version, config in [("simt", None), ("v1", None)] if layout == (True, True) else [("simt", None)]:
        c.fill_(float("nan"))
        _run(_gemm(da, db, c), version, config)
        ref, bound = _reference(a, b, None, -1, rows=rows)
        _check(c[torch.as_tensor(rows, device=c.device)], ref, bound, f"{version} {dtype} {M}x{N}x{K}")


@pytest.mark.gpu
def test_long_k_and_cupy_arrays():
    import cupy

    from cukit.interop import DTYPES, current_stream

    rng = _rng(11)
    M, N, K = 19, 45, 100_003
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    da, db = cupy.asarray(a), cupy.asarray(b)
    for version in ("simt", "v1"):
        c = cupy.full((M, N), np.nan, np.float32)
        g = Gemm(dtype=DTYPES["float32"], M=M, N=N, K=K, a=da.data.ptr, b=db.data.ptr, c=c.data.ptr, bias=0,
                 act=-1, sa_m=K, sa_k=1, sb_k=N, sb_n=1, device=da.device.id)
        ms.launch(g, current_stream(g.device, False), version=version)
        ref, bound = _reference(a, b, None, -1)
        _check(cupy.asnumpy(c), ref, bound, f"long K {version}")


def _torch_workspace():
    torch = _torch()
    from cukit.ops.matmul import _workspace

    return _workspace("torch", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_k_all_layouts_and_epilogues(dtype, layout, splits):
    # N = 45: the sum's scalar path (rows not whole 16-byte groups); N = 64: its vector path
    ws = _torch_workspace()
    for i, (M, N, K) in enumerate([(37, 45, 24 * 64), (130, 64, 24 * 100)]):
        for act in ms.ACTS:
            a, b, bi, da, db, dbias, c = _problem(dtype, M, N, K, layout, bias=True, act=act, seed=i)
            g = _gemm(da, db, c, dbias, act)
            run = ms.prepare(g, splits=splits, workspace=ws)
            assert isinstance(run, SplitK)
            run(g.head(), _stream())
            ref, bound = _reference(a, b, bi, act)
            _check(c, ref, bound, f"split {splits} {dtype} {LAYOUT_IDS[LAYOUTS.index(layout)]} act {act} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_split_k_scaled_epilogues(dtype):
    import dataclasses

    torch = _torch()
    M, N, K = 33, 40, 4096
    a, b, _, da, db, _, c = _problem(dtype, M, N, K, seed=5)
    c0 = _rng(6).standard_normal((M, N)).astype(dtype)
    for beta in (0.0, -0.5):
        c.copy_(torch.from_numpy(c0))
        g = dataclasses.replace(_gemm(da, db, c), scaled=True, alpha=1.5, beta=beta)
        ms.prepare(g, splits=4, workspace=_torch_workspace())(g.head(), _stream())
        ref, bound = _reference(a, b, None, -1)
        _check(c, 1.5 * ref + beta * c0, 1.5 * bound + 4 * np.finfo(dtype).eps * np.abs(c0), f"beta {beta}")


@pytest.mark.gpu
def test_split_k_through_matmul_plan_cache_cupy_and_graphs():
    """The front end splits a long-K product on its own (the cost model), on torch and CuPy
    arrays; the plan is reused with new pointers, and the split launches capture in a CUDA graph."""
    import cupy

    import cukit
    from cukit.ops import matmul as mm

    torch = _torch()
    M, N, K = 256, 96, 16384
    a = torch.randn(K, M, device="cuda").t()  # a dW's G^T: column-major
    b = torch.randn(K, N, device="cuda")
    g, _, _ = mm._build_gemm(a, b, "torch", batch=(), M=M, K=K, N=N, c_ptr=0, bias_ptr=0, act=-1,
                             precision="ieee", device=0, dtype=mm.DTYPES["float32"])
    assert ms.choose_split(g)[1] > 1
    ref = a.double() @ b.double()
    bound = K * np.finfo(np.float32).eps * (a.double().abs() @ b.double().abs())
    for _ in range(2):  # the first call builds the plan, the second is a lookup
        assert (cukit.matmul(a, b).double() - ref).abs().le(bound).all()
    key = mm._plan_key("matmul", a, b, None, -1, "ieee", None)
    assert isinstance(mm._PLANS.get(key).run, SplitK)
    a2, b2 = a.clone(), b + 1  # new pointers, same signature
    assert (cukit.matmul(a2, b2).double() - a2.double() @ b2.double()).abs().le(
        K * np.finfo(np.float32).eps * (a2.double().abs() @ b2.double().abs())).all()
    ca, cb = cupy.asarray(a.contiguous()), cupy.asarray(b)
    got = cukit.matmul(ca, cb)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(got), (a.double() @ b.double()).cpu().numpy(), rtol=0,
                               atol=float(bound.max()))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cukit.matmul(a, b)  # warm on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cukit.matmul(a, b)
    a.copy_(a2)
    b.copy_(b2)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.double() - a2.double() @ b2.double()).abs().le(
        K * np.finfo(np.float32).eps * (a2.double().abs() @ b2.double().abs())).all()


def test_launch_rejects_what_it_does_not_support():
    from cukit.interop import DTYPES

    with pytest.raises(ValueError, match="float32"):
        ms.launch(_g(dtype=DTYPES["float16"]), None)
    with pytest.raises(ValueError, match="float32"):
        ms.launch(_g(precision="tf32"), None)
    with pytest.raises(ValueError, match="version"):
        ms.launch(_g(), None, version="v9")
