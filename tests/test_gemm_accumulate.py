"""cukit.ops.matmul.gemm: ``out = alpha * (a @ b) + beta * out`` into an existing output (float32 for
16-bit inputs, any row stride), its references, its validation, the widened Gemm contract
(cukit/ops/_gemm.py: C's dtype, ldc, C's batch stride, alpha/beta, the scaled epilogues) and every
kernel family that runs it (SIMT, mma.sync, the TMA + wgmma kernel of both tile widths).

Oracle: float64 NumPy of the exact input values. Error bound per element (as tests/test_matmul.py):
the product's accumulation |alpha| K eps_acc (|A| @ |B|), alpha's and beta's products and the sum
(a few eps_acc of |alpha AB| + |beta C|), then one rounding into out's dtype (u_out |result|).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cukit.interop import DTYPES
from cukit.ops import matmul as mm
from cukit.ops._gemm import EPI_ACCUMULATE, EPI_SCALE, EPI_SCALE_DEVICE, EPI_STORE, GEMM_SIGNATURE, Gemm
from cukit.testing import arrays, backend_dtypes, to_numpy

torch = pytest.importorskip("torch")

from test_matmul import emulate_gemm  # noqa: E402  (tests/ is on sys.path: the contract's emulator)

FLOATS = ["float16", "bfloat16", "float32", "float64"]
U_OUT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
EPS_ACC = {"float16": 2.0**-23, "bfloat16": 2.0**-23, "float32": 2.0**-23, "float64": 2.0**-52}
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}
TF32_REL = 2.0**-9
GEMM = "cukit.ops.matmul.gemm"


def out_dtypes(dtype: str) -> list[str]:
    return [dtype, "float32"] if dtype in ("float16", "bfloat16") else [dtype]


# ------------------------------------------------------------------------------------- oracle
def expected(a: Any, b: Any, c0: Any, alpha: float, beta: float, dtype: str, out_dtype: str,
             precision: str = "ieee") -> tuple[np.ndarray, np.ndarray]:
    """(exact result, allowed |error|) of alpha a @ b + beta c0 (c0: out's values before the call;
    ignored when beta == 0) stored in out_dtype."""
    a64, b64 = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    p = a64 @ b64
    l1 = np.abs(a64) @ np.abs(b64)
    K = a64.shape[-1]
    acc = "float64" if dtype == "float64" else "float32"
    eps = EPS_ACC[acc]
    rel = K * eps + (TF32_REL if precision == "tf32" and dtype == "float32" else 0.0)
    ref = alpha * p
    bound = abs(alpha) * (rel * l1 + eps * np.abs(p))
    if beta != 0:
        c64 = to_numpy(c0).astype(np.float64)
        ref = ref + beta * c64
        bound = bound + 2 * eps * (abs(alpha) * l1 + np.abs(beta * c64))
    tiny = TINY[acc]
    bound = bound * (1 + U_OUT[out_dtype]) + U_OUT[out_dtype] * np.abs(ref) + TINY[out_dtype] + (2 * K + 4) * tiny
    return ref, bound


def check(actual: Any, ref: np.ndarray, bound: np.ndarray, what: str = "") -> None:
    got = to_numpy(actual).astype(np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{what}: {int((~np.isfinite(got)).sum())} elements unwritten (NaN) or non-finite"
    err = np.abs(got - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err - bound, -np.inf))), got.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.size} elements off; at {i} got {got[i]!r}, want {ref[i]!r} "
            f"(error {err[i]:.3g} > bound {bound[i]:.3g})"
        )


# ------------------------------------------------------------------------ CPU: the references
@st.composite
def gemm_cases(draw, backend: str):
    """(a, b, out, c0, alpha, beta): a (M, K) and b (K, N) of one dtype, row-major or transposed
    views; out (M, N) of a's dtype or float32, a column block of a wider buffer or a row slice, or
    contiguous; c0 a copy of out's values (NaN when beta == 0: never read)."""
    dtype = draw(st.sampled_from(backend_dtypes(backend, FLOATS)))
    out_dtype = draw(st.sampled_from(out_dtypes(dtype)))
    M, K, N = (draw(st.integers(0, 9)) for _ in range(3))

    def operand(r, c):
        if draw(st.booleans()):
            return draw(arrays(backend, dtype, (c, r))).T
        return draw(arrays(backend, dtype, (r, c)))

    a, b = operand(M, K), operand(K, N)
    beta = draw(st.sampled_from([0.0, 1.0, 0.5, -2.0]))
    alpha = draw(st.sampled_from([1.0, -0.75, 3.0]))
    pad, lead = draw(st.integers(0, 3)), draw(st.integers(0, 2))
    buf = draw(arrays(backend, out_dtype, (M + lead, N + pad)))
    out = buf[lead:, pad // 2: pad // 2 + N] if draw(st.booleans()) else buf[lead:, :N]
    if beta == 0:
        out[...] = float("nan")
    c0 = out.copy() if backend == "numpy" else out.clone()
    return a, b, out, c0, alpha, beta, dtype, out_dtype, buf


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@given(data=st.data())
def test_cpu_gemm_matches_oracle(backend, data):
    """CPU arrays run the references: float64 oracle, out's other elements untouched, beta == 0
    never reads out (NaN-filled)."""
    a, b, out, c0, alpha, beta, dtype, out_dtype, buf = data.draw(gemm_cases(backend))
    before = to_numpy(buf).astype(np.float64).copy()
    assert mm.gemm(a, b, out, alpha=alpha, beta=beta) is out
    ref, bound = expected(a, b, c0, alpha, beta, dtype, out_dtype)
    check(out, ref, bound, f"{backend} {dtype}->{out_dtype} alpha={alpha} beta={beta}")
    after = to_numpy(buf).astype(np.float64)
    mask = np.ones(after.shape, bool)
    rows, cols = _block(buf, out)
    mask[rows, cols] = False
    assert np.array_equal(after[mask], before[mask], equal_nan=True), "gemm wrote outside out"


def _block(buf: Any, view: Any) -> tuple[slice, slice]:
    """The (rows, columns) of buf that a 2-D view of it covers (unit column stride)."""
    isz = buf.itemsize if hasattr(buf, "itemsize") else buf.element_size()
    bptr = buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()
    vptr = view.ctypes.data if isinstance(view, np.ndarray) else view.data_ptr()
    off = (vptr - bptr) // isz
    r0, c0 = divmod(off, buf.shape[1]) if buf.shape[1] else (0, 0)
    return slice(r0, r0 + view.shape[0]), slice(c0, c0 + view.shape[1])


def test_cpu_references_round_once_and_skip_out_when_beta_is_zero():
    a = np.full((2, 3), 1 + 2.0**-10, np.float16)
    b = np.ones((3, 2), np.float16)
    out = np.full((2, 2), np.nan, np.float32)
    mm.gemm_reference_numpy(a, b, out)
    assert np.array_equal(out, np.full((2, 2), 3 * (1 + 2.0**-10), np.float32))  # float32: no 16-bit rounding
    out16 = np.full((2, 2), np.nan, np.float16)
    mm.gemm_reference_numpy(a, b, out16, alpha=0.5)
    assert np.array_equal(out16, np.full((2, 2), np.float16(1.5 * (1 + 2.0**-10)), np.float16))
    t = torch.full((2, 2), float("nan"))
    mm.gemm_reference_torch(torch.from_numpy(a), torch.from_numpy(b), t)
    assert torch.equal(t, torch.from_numpy(out))
    acc = torch.ones(2, 2, dtype=torch.float64)
    for _ in range(3):
        mm.gemm(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64), acc, beta=1.0)
    assert torch.equal(acc, torch.ones(2, 2, dtype=torch.float64) + 3 * torch.eye(2, dtype=torch.float64))


def test_cpu_gemm_is_not_recorded_by_autograd():
    a = torch.randn(3, 4, requires_grad=True)
    out = torch.zeros(3, 5)
    mm.gemm(a, torch.randn(4, 5), out)
    assert out.grad_fn is None and not out.requires_grad


# ------------------------------------------------------------------------ CPU: validation
def _column_major(x: Any) -> Any:
    """x's values in a column-major array (a transposed copy viewed back)."""
    return x.T.copy().T if isinstance(x, np.ndarray) else x.T.contiguous().T


def _ok(backend: str = "torch", dtype: str = "float32"):
    if backend == "numpy":
        return np.ones((3, 4), dtype), np.ones((4, 5), dtype), np.zeros((3, 5), dtype)
    tdt = getattr(torch, dtype)
    return torch.ones(3, 4, dtype=tdt), torch.ones(4, 5, dtype=tdt), torch.zeros(3, 5, dtype=tdt)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gemm_errors_name_the_argument(backend):
    a, b, out = _ok(backend)
    cases = [
        (TypeError, "a must be", ([[1.0]], b, out), {}),
        (TypeError, "out must be a numpy.ndarray", (a, b, [[0.0]]), {}),
        (TypeError, "b must have a's dtype float32", (a, _ok(backend, "float64")[1], out), {}),
        (TypeError, "out must have dtype float32", (a, b, _ok(backend, "float64")[2]), {}),
        (ValueError, "a must be 2-D", (a[0], b, out), {}),
        (ValueError, "b must have K = 4 rows", (a, b[:3], out), {}),
        (ValueError, r"out must have shape \(M, N\) = \(3, 5\)", (a, b, out[:, :4]), {}),
        (ValueError, "out must have unit column stride", (a, b, _column_major(out)), {}),
        (ValueError, "out must not overlap a or b", (a, b, b[:3]), {}),
        (TypeError, "alpha must be a real number", (a, b, out), {"alpha": "2"}),
        (TypeError, "beta must be a real number", (a, b, out), {"beta": True}),
        (ValueError, "precision must be one of", (a, b, out), {"precision": "fp8"}),
    ]
    for exc, msg, args, kw in cases:
        with pytest.raises(exc, match=f"^{GEMM}: {msg}"):
            mm.gemm(*args, **kw)


def test_gemm_errors_on_dtypes_and_strides():
    a, b, _ = _ok("torch", "bfloat16")
    mm.gemm(a, b, torch.zeros(3, 5))  # float32 out for 16-bit a
    with pytest.raises(TypeError, match=f"^{GEMM}: out must have dtype bfloat16 or float32"):
        mm.gemm(a, b, torch.zeros(3, 5, dtype=torch.float16))
    with pytest.raises(TypeError, match=f"^{GEMM}: out must have dtype float64 \\(a's\\); got float32"):
        mm.gemm(a.double(), b.double(), torch.zeros(3, 5))
    with pytest.raises(TypeError, match=f"^{GEMM}: a must have dtype float16, bfloat16, float32 or float64; got int32"):
        mm.gemm(a.int(), b.int(), torch.zeros(3, 5, dtype=torch.int32))
    a32, b32, out32 = _ok("torch")
    with pytest.raises(ValueError, match=f"^{GEMM}: a must have unit stride along one dimension"):
        mm.gemm(torch.ones(6, 8)[::2, ::2], b32, out32)  # no unit stride: gemm copies nothing
    with pytest.raises(ValueError, match=f"^{GEMM}: b must have unit stride along one dimension and no broadcast"):
        mm.gemm(a32, torch.ones(1, 5).expand(4, 5), out32)
    with pytest.raises(ValueError, match=f"^{GEMM}: out must have unit column stride and a row stride >= N = 5"):
        mm.gemm(a32, b32, torch.zeros(1, 5).expand(3, 5))


def test_gemm_accepts_views_and_numpy_scalars():
    x = torch.randn(6, 7, dtype=torch.float64)
    g = torch.randn(6, 4, dtype=torch.float64)
    buf = torch.full((5, 9), 7.0, dtype=torch.float64)
    dw = buf[1:5, 2:9]  # (4, 7): a block of a larger buffer, row stride 9
    dw.zero_()
    mm.gemm(g.T, x, dw, alpha=np.float32(0.5), beta=np.int64(1))
    torch.testing.assert_close(dw, 0.5 * g.T @ x)
    assert (buf[0] == 7).all() and (buf[:, :2] == 7).all()


# ------------------------------------------------------------------------ CPU: the contract
def _gemm(**kw) -> Gemm:
    base = dict(dtype=DTYPES["bfloat16"], M=4, N=6, K=8, a=0, b=1 << 20, c=1 << 30, bias=0, act=-1,
                sa_m=8, sa_k=1, sb_k=6, sb_n=1)
    base.update(kw)
    return Gemm(**base)


def test_gemm_contract_defaults_and_epilogues():
    g = _gemm()
    assert (g.ldc, g.sc_batch, g.out_dtype.name, g.epilogue, g.n_head) == (6, 24, "bfloat16", EPI_STORE, 4)
    assert g.head() == (0, 1 << 20, 1 << 30, 0)
    assert len(g.kernel_args()) == len(GEMM_SIGNATURE.split()) == 24
    assert g.kernel_tail() == g.kernel_args()[4:] and g.kernel_args()[4:6] == (1.0, 0.0)
    f32 = DTYPES["float32"]
    assert _gemm(c_dtype=f32).epilogue == EPI_SCALE  # float32 C: the scaled epilogue with alpha 1
    s = _gemm(c_dtype=f32, ldc=10, alpha=2.0, beta=0.0, scaled=True)
    assert (s.epilogue, s.n_head, s.head()[4:], s.sc_batch) == (EPI_SCALE, 6, (2.0, 0.0), 40)
    assert s.kernel_tail() == (4, 6, 8, 10, 40, 8, 1, 6, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0)
    assert _gemm(beta=1, scaled=True).epilogue == EPI_ACCUMULATE
    assert _gemm(beta=float("nan"), scaled=True).epilogue == EPI_ACCUMULATE  # NaN != 0: C is read


def test_gemm_contract_rejects_inconsistent_problems():
    f32 = DTYPES["float32"]
    with pytest.raises(ValueError, match="ldc=5 < N=6"):
        _gemm(ldc=5)
    with pytest.raises(ValueError, match="alpha and beta need scaled=True"):
        _gemm(beta=1.0)
    with pytest.raises(ValueError, match="an activation needs the matmul epilogue"):
        _gemm(act=1, scaled=True)
    with pytest.raises(ValueError, match="an activation needs the matmul epilogue"):
        _gemm(act=1, c_dtype=f32)
    with pytest.raises(ValueError, match="C must have A's dtype float64"):
        _gemm(dtype=DTYPES["float64"], c_dtype=f32)
    with pytest.raises(ValueError, match="C's batches overlap"):
        _gemm(batch=(1, 1, 2), sc_batch=12)
    _gemm(M=1, ldc=1)  # one row: its stride is never used
    _gemm(batch=(1, 1, 2), sc_batch=3 * 6 + 6)  # batches back to back


def test_gemm_contract_device_scale():
    """EPI_SCALE_DEVICE: a scaled problem (beta 0, no activation) whose bias argument is the scale's
    address; the kernels take it from the head as the bias."""
    g = _gemm(scaled=True, device_scale=True, bias=4096, alpha=1.0)
    assert (g.epilogue, g.n_head, g.head()[3:]) == (EPI_SCALE_DEVICE, 6, (4096, 1.0, 0.0))
    for kw in ({"scaled": False}, {"scaled": True, "beta": 1.0}, {"scaled": True, "act": 1}):
        with pytest.raises(ValueError, match="device_scale needs scaled=True, beta == 0 and no activation"):
            _gemm(device_scale=True, bias=4096, **kw)


def test_families_take_the_device_scale_on_the_tma_kernels_only(monkeypatch):
    """Which family runs the device scale (device queries answer as an H100 and an A100): the TMA
    kernels, 16-bit A with C in A's dtype; no other kernel, dtype or device."""
    from cukit._device import DeviceCaps
    from cukit.ops import matmul_simt as ms
    from cukit.ops import matmul_tc as mt

    f32, f16 = DTYPES["float32"], DTYPES["float16"]
    base = dict(scaled=True, device_scale=True, bias=4096, M=256, N=512, K=128, sa_m=128, sb_k=512, c=1 << 30)
    monkeypatch.setattr(mt, "device_caps", lambda device: DeviceCaps(90, 132, 227 * 1024))
    for dt in (DTYPES["bfloat16"], f16):
        g = _gemm(dtype=dt, **base)
        assert mt.supports(g) and mt.route(g) == "tma"
        assert not mt.supports(_gemm(dtype=dt, c_dtype=f32, **base))  # float32 C: the other route
    assert not mt.supports(_gemm(dtype=f32, precision="tf32", **{**base, "sa_m": 1, "sa_k": 256}))
    assert not mt.supports(_gemm(**{**base, "sb_k": 513}))  # rows not 16-byte aligned: no TMA
    assert not ms.supports(_gemm(dtype=f32, **base))
    monkeypatch.setattr(mt, "device_caps", lambda device: DeviceCaps(80, 108, 163 * 1024))
    assert not mt.supports(_gemm(**base))


def test_gemm_device_scale_cpu_arrays_and_errors():
    """CPU arrays: False, out untouched (the caller's other route runs); bad arguments raise naming
    the function and the argument."""
    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 6, dtype=torch.bfloat16)
    out, s = torch.full((4, 6), 7.0, dtype=torch.bfloat16), torch.tensor([0.5])
    assert mm.gemm_device_scale(a, b, out, s) is False and bool((out == 7).all())
    fn = "cukit.ops.matmul.gemm_device_scale"
    with pytest.raises(TypeError, match=f"{fn}: scale must be a 1-element float32 array; got float64"):
        mm.gemm_device_scale(a, b, out, torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(TypeError, match=f"{fn}: scale must be a 1-element float32 array; got float32 of shape \\(2,\\)"):
        mm.gemm_device_scale(a, b, out, torch.ones(2))
    with pytest.raises(ValueError, match=f"{fn}: b must have"):
        mm.gemm_device_scale(a, torch.ones(7, 6, dtype=torch.bfloat16), out, s)
    with pytest.raises(TypeError, match=f"{fn}: scale must be the same array type as a"):
        mm.gemm_device_scale(a, b, out, np.ones(1, np.float32))


@given(data=st.data())
def test_gemm_problem_from_views_follows_the_contract(data):
    """gemm's Gemm (strides, transposed views, ldc of a column block) run by the contract's
    emulator on host memory equals the reference."""
    M, K, N = (data.draw(st.integers(1, 7)) for _ in range(3))
    dtype = data.draw(st.sampled_from(["float32", "float64"]))

    def operand(r, c):
        if data.draw(st.booleans()):
            return data.draw(arrays("torch", dtype, (c, r))).T
        return data.draw(arrays("torch", dtype, (r, c)))

    a, b = operand(M, K), operand(K, N)
    buf = data.draw(arrays("torch", dtype, (M, N + 3)))
    out = buf[:, 1: N + 1]
    alpha, beta = data.draw(st.sampled_from([(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)]))
    want = out.clone()
    mm.gemm_reference_torch(a, b, want, alpha=alpha, beta=beta)
    g = mm._gemm_problem(a, b, out, "torch", 0, alpha=alpha, beta=beta, precision="ieee")
    assert g.scaled and g.ldc == (N + 3 if M > 1 else N) and g.c == out.data_ptr()
    emulate_gemm(g)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_families_take_the_scaled_epilogues(monkeypatch):
    """Which kernel runs which widened problem (device queries answer as an H100 and an A100)."""
    from cukit._device import DeviceCaps
    from cukit.ops import matmul_simt as ms
    from cukit.ops import matmul_tc as mt

    f32 = DTYPES["float32"]
    wide = _gemm(c_dtype=f32, ldc=520, beta=1.0, scaled=True, M=256, N=512, K=128, sa_m=128, sb_k=512)
    for cc, smem, route in ((90, 227 * 1024, "tma"), (80, 163 * 1024, "mma")):
        monkeypatch.setattr(mt, "device_caps", lambda device, cc=cc, smem=smem: DeviceCaps(cc, 132, smem))
        assert mt.supports(wide) and mt.route(wide) == route
        tf32 = _gemm(dtype=f32, precision="tf32", beta=0.5, scaled=True)
        assert mt.supports(tf32) and mt.route(tf32) == "mma"
    # misaligned x @ W.T on Hopper: the cp.async wgmma kernel runs the matmul epilogue only, so mma.sync
    monkeypatch.setattr(mt, "device_caps", lambda device: DeviceCaps(90, 132, 227 * 1024))
    nt = _gemm(c_dtype=f32, beta=1.0, scaled=True, K=7, sa_m=7, sb_k=1, sb_n=7)
    assert mt.load_path(nt) == 0 and mt.supports(nt) and not mt.uses_wgmma(nt) and mt.route(nt) == "mma"
    assert mt.uses_wgmma(_gemm(K=7, sa_m=7, sb_k=1, sb_n=7))
    assert not ms.supports(wide)
    assert ms.supports(_gemm(dtype=f32, beta=1.0, scaled=True))
    assert ms.supports(_gemm(dtype=DTYPES["float64"], ldc=9, alpha=3.0, scaled=True))
    assert not mt.supports(_gemm(dtype=f32, beta=1.0, scaled=True))  # IEEE float32: SIMT


# ------------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _t(shape, dtype, *, transposed=False, scale=1.0):
    """Random CUDA values exactly representable in dtype; transposed: a .T view of a (c, r) tensor."""
    tdt = getattr(torch, dtype)
    r, c = shape
    t = torch.randn(c, r, device="cuda").T if transposed else torch.randn(r, c, device="cuda")
    return (t * scale).to(tdt)


def _out(M, N, dtype, *, beta, pad=0, lead=0, fill=None):
    """(out, its buffer): out (M, N) as columns pad .. pad + N of rows lead .. of a wider buffer
    (sentinel 7 elsewhere); NaN when beta == 0 (never read), else random values."""
    tdt = getattr(torch, dtype)
    buf = torch.full((M + lead, N + 2 * pad), 7.0, dtype=tdt, device="cuda")
    out = buf[lead:, pad: pad + N]
    if fill is not None:
        out.fill_(fill)
    elif beta == 0:
        out.fill_(float("nan"))
    else:
        out.copy_(torch.randn(M, N, device="cuda").to(tdt))
    return out, buf


def _run_gemm(a, b, out, alpha, beta, kernel=None, precision=None):
    c0 = out.clone()
    with mm.force_kernel(kernel):
        assert mm.gemm(a, b, out, alpha=alpha, beta=beta, precision=precision) is out
    torch.cuda.synchronize()
    return c0


def _check_gemm(a, b, out, c0, alpha, beta, dtype, out_dtype, what, precision="ieee", buf=None, pad=0, lead=0):
    ref, bound = expected(a, b, c0, alpha, beta, dtype, out_dtype, precision)
    check(out, ref, bound, what)
    if buf is not None:  # the rest of the buffer keeps its sentinel
        mask = torch.ones(buf.shape, dtype=torch.bool, device="cuda")
        mask[lead:, pad: pad + out.shape[1]] = False
        assert bool((buf[mask] == 7).all()), f"{what}: gemm wrote outside out"


def _tc_kernels() -> list[str]:
    """The tensor-core kernels to force: mma.sync everywhere, TMA on Hopper (the default route)."""
    return ["tc_mma", "tc_tma"] if _hopper() else ["tc_mma"]


LAYOUTS = [(False, False), (False, True), (True, False)]  # (A transposed, B transposed): NN, NT, TN
LAYOUT_IDS = ["NN", "NT", "TN"]
SHAPES = [(1, 1, 1), (7, 129, 1000), (129, 7, 33), (1000, 1000, 129), (129, 1000, 7), (7, 1, 129), (1000, 129, 1)]


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("out_dtype", ["float32", "same"])
def test_gpu_16bit_inputs_every_tc_kernel(dtype, out_dtype, layout):
    """bf16/fp16 -> fp32 (and -> the input dtype), beta in {0, 1, 0.5} (NaN-filled out for 0),
    alpha 1 and -0.75, odd M, N, K (K not a multiple of the k-tile), written into a column block of
    a wider buffer (ldc > N: 16-byte aligned or not) whose other elements stay untouched, or into a
    contiguous out; mma.sync and (on Hopper) TMA. Misaligned shapes (odd K or N) take mma.sync's
    staged load path and its scalar stores."""
    torch.manual_seed(0)
    od = dtype if out_dtype == "same" else out_dtype
    from cukit.ops import matmul_tc as mt

    for kernel in _tc_kernels():
        for M, N, K in SHAPES:
            a = _t((M, K), dtype, transposed=layout[0])
            b = _t((K, N), dtype, transposed=layout[1])
            for j, (alpha, beta) in enumerate(((1.0, 0.0), (-0.75, 1.0), (1.0, 0.5))):
                pad = (4, 3, 0)[(j + len(kernel)) % 3]  # aligned / misaligned column block, contiguous
                out, buf = _out(M, N, od, beta=beta, pad=pad)
                g = mm._gemm_problem(a, b, out, "torch", 0, alpha=alpha, beta=beta, precision="ieee")
                if kernel == "tc_tma" and mt.route(g) != "tma":
                    continue  # TMA needs 16-byte aligned rows: odd K or M/N go to mma.sync (tested there)
                c0 = _run_gemm(a, b, out, alpha, beta, kernel)
                _check_gemm(a, b, out, c0, alpha, beta, dtype, od, f"{kernel} {dtype}->{od} {M}x{N}x{K} "
                            f"alpha={alpha} beta={beta}", buf=buf, pad=pad)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("tile_n", [256, 128])
@pytest.mark.parametrize("epi", ["scale", "accumulate"])
def test_gpu_tma_tile_widths(tile_n, epi, layout):
    """The TMA kernel forced to each tile width (cooperative 128 x 256, ping-pong 128 x 128) with
    the fp32-staged epilogue: aligned shapes with ragged last tiles, batches of tiles across
    persistent CTAs, C a column block (16-byte stores) and a misaligned column block (scalar
    stores), bf16 -> fp32 and -> bf16."""
    if not _hopper():
        pytest.skip("the TMA kernels run on compute capability 9.0")
    from cukit.interop import current_stream
    from cukit.ops import matmul_tc as mt

    torch.manual_seed(1)
    beta = 1.0 if epi == "accumulate" else 0.0
    for od in ("float32", "bfloat16"):
        for M, N, K, pad in ((136, 264, 64, 4), (776, 776, 1032, 1), (2104, 2056, 200, 8), (1, 8, 8, 0)):
            a = _t((M, K), "bfloat16", transposed=layout[0])
            b = _t((K, N), "bfloat16", transposed=layout[1])
            out, buf = _out(M, N, od, beta=beta, pad=pad)
            c0 = out.clone()
            g = mm._gemm_problem(a, b, out, "torch", 0, alpha=-1.5, beta=beta, precision="ieee")
            assert mt.route(g) == "tma", (M, N, K)
            mt.prepare(g, version="tma", tile_n=tile_n)(g.head(), current_stream(0, True))
            torch.cuda.synchronize()
            _check_gemm(a, b, out, c0, -1.5, beta, "bfloat16", od, f"tma{tile_n} {od} {M}x{N}x{K} pad={pad}",
                        buf=buf, pad=pad)


@gpu
@pytest.mark.parametrize("tile_n", [256, 192, 128, 64])
@pytest.mark.parametrize("epi", ["scale", "accumulate"])
def test_gpu_tma_tf32_tile_widths(tile_n, epi):
    """float32 as tf32 on the TMA kernel (A row-major, B column-major: both K-major, the layout
    tf32 wgmma reads) forced to each tile width with the scaled epilogues: ragged last tiles, K not
    a multiple of the 32-element k-tile, C a column block (16-byte stores) and a misaligned one."""
    if not _hopper():
        pytest.skip("the TMA kernels run on compute capability 9.0")
    from cukit.interop import current_stream
    from cukit.ops import matmul_tc as mt

    torch.manual_seed(4)
    beta = 1.0 if epi == "accumulate" else 0.0
    for M, N, K, pad in ((136, 264, 68, 4), (776, 776, 1036, 1), (1, 8, 8, 0)):
        a, b = _t((M, K), "float32"), _t((K, N), "float32", transposed=True)
        out, buf = _out(M, N, "float32", beta=beta, pad=pad)
        c0 = out.clone()
        g = mm._gemm_problem(a, b, out, "torch", 0, alpha=-1.5, beta=beta, precision="tf32")
        assert mt.route(g) == "tma", (M, N, K)
        mt.prepare(g, version="tma", tile_n=tile_n)(g.head(), current_stream(0, True))
        torch.cuda.synchronize()
        _check_gemm(a, b, out, c0, -1.5, beta, "float32", "float32", f"tf32 tma{tile_n} {M}x{N}x{K} pad={pad}",
                    "tf32", buf=buf, pad=pad)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("version", "config"), [("simt", "large"), ("simt", "small"), ("v1", None)])
def test_gpu_simt_float32_float64(dtype, version, config):
    """The SIMT kernels (register-blocked in both tile configs, and v1) with beta and ldc: fp32 and
    fp64, odd shapes in every layout, out a row slice and a column block (aligned and misaligned)."""
    from cukit.interop import current_stream
    from cukit.ops import matmul_simt as ms

    torch.manual_seed(2)
    for i, (M, N, K) in enumerate([(1, 1, 1), (7, 129, 1000), (129, 7, 33), (1000, 1000, 129), (300, 257, 7)]):
        layout = LAYOUTS[i % 3]
        a = _t((M, K), dtype, transposed=layout[0])
        b = _t((K, N), dtype, transposed=layout[1])
        for alpha, beta in ((1.0, 0.0), (2.0, 1.0), (-1.0, 0.5)):
            for pad, lead in ((0, 0), (1, 2), (4, 0)):
                out, buf = _out(M, N, dtype, beta=beta, pad=pad, lead=lead)
                c0 = out.clone()
                g = mm._gemm_problem(a, b, out, "torch", 0, alpha=alpha, beta=beta, precision="ieee")
                ms.prepare(g, version=version, config=config)(g.head(), current_stream(0, True))
                torch.cuda.synchronize()
                _check_gemm(a, b, out, c0, alpha, beta, dtype, dtype, f"{version}/{config} {dtype} {M}x{N}x{K} "
                            f"pad={pad} alpha={alpha} beta={beta}", buf=buf, pad=pad, lead=lead)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_simt_through_the_front_end(dtype):
    """gemm picks the SIMT family for IEEE float32 and float64 (and force_kernel's v1 runs too)."""
    torch.manual_seed(7)
    a, b = _t((300, 70), dtype, transposed=True), _t((70, 130), dtype)
    for kernel in (None, "simt_v1"):
        out, buf = _out(300, 130, dtype, beta=1.0, pad=2, lead=1)
        c0 = _run_gemm(a, b, out, 0.5, 1.0, kernel)
        _check_gemm(a, b, out, c0, 0.5, 1.0, dtype, dtype, f"{kernel} {dtype}", buf=buf, pad=2, lead=1)


@gpu
def test_gpu_tf32_precision_uses_the_tensor_cores():
    torch.manual_seed(3)
    a, b = _t((129, 1000), "float32"), _t((1000, 257), "float32", transposed=True)
    for beta in (0.0, 1.0):
        out, buf = _out(129, 257, "float32", beta=beta, pad=2)
        c0 = _run_gemm(a, b, out, 0.5, beta, precision="tf32")
        _check_gemm(a, b, out, c0, 0.5, beta, "float32", "float32", f"tf32 beta={beta}", "tf32", buf=buf, pad=2)


@gpu
def test_gpu_large_dw_accumulation_over_chunks():
    """The fused-loss pattern: dW (V, H) += G_c^T X_c over token chunks (a TN product, beta = 1
    after the first chunk), bf16 inputs, fp32 dW, 4096 x 1024 x 4096 in 4 chunks of K; then one
    4096 x 1024 x 4096 product, rows and columns sampled against float64."""
    torch.manual_seed(4)
    T, H, V = 4096, 1024, 4096
    x = _t((T, H), "bfloat16")
    g = _t((T, V), "bfloat16", scale=0.1)
    dw = torch.full((V, H), float("nan"), device="cuda")
    for i, c in enumerate(range(0, T, 1024)):
        mm.gemm(g[c: c + 1024].T, x[c: c + 1024], dw, beta=0.0 if i == 0 else 1.0)
    torch.cuda.synchronize()
    rows = torch.cat([torch.tensor([0, V - 1]), torch.randperm(V)[:40]]).cuda()
    ref, bound = expected(g.T[rows], x, None, 1.0, 0.0, "bfloat16", "float32")
    check(dw[rows], ref, bound, "dW accumulated over 4 chunks")  # chunked sums: one more summation order
    out = torch.full((V, H), float("nan"), device="cuda")
    mm.gemm(g.T, x, out)
    torch.cuda.synchronize()
    ref, bound = expected(g.T[rows], x, None, 1.0, 0.0, "bfloat16", "float32")
    check(out[rows], ref, bound, "4096 x 1024 x 4096")


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_gemm_device_scale(dtype):
    """gemm_device_scale on the TMA kernels: bitwise the float32 product times the scale rounded
    once (what a float32 gemm and a scaling cast give), over transposed views (a fused loss's
    G^T X), ragged tiles and a column block of C; the scale is read when the kernel runs (a value
    written after the plan was made is the one used, with no new plan); elsewhere False."""
    from cukit.ops import matmul_tc as mt

    torch.manual_seed(2)
    s = torch.tensor([0.37], device="cuda")
    for M, N, K, ta, pad in ((136, 264, 64, True, 0), (776, 776, 1032, False, 4), (2104, 2056, 200, True, 8),
                             (1, 8, 8, False, 0)):
        a, b = _t((M, K), dtype, transposed=ta), _t((K, N), dtype)
        out, _ = _out(M, N, dtype, beta=0.0, pad=pad)
        f32 = torch.empty(M, N, device="cuda")
        mm.gemm(a, b, f32)
        g = mm._gemm_problem(a, b, out, "torch", 0, alpha=1.0, beta=0.0, precision="ieee")
        runs = _hopper() and mt.supports(dataclasses.replace(g, device_scale=True, bias=s.data_ptr()))
        for value in (0.37, -2.5):
            s.fill_(value)
            assert mm.gemm_device_scale(a, b, out, s) is runs, (M, N, K)
            if runs:
                torch.testing.assert_close(out, (f32 * s).to(out.dtype), atol=0, rtol=0)
    if _hopper():
        a = _t((64, 64), dtype)
        out = torch.empty(64, 64, dtype=torch.float32, device="cuda")
        assert mm.gemm_device_scale(a, a, out, s) is False  # float32 C: not this epilogue
        ab = torch.stack([_t((200, 72), dtype) for _ in range(3)])  # batched, one launch
        bb = torch.stack([_t((72, 136), dtype) for _ in range(3)])
        out, f32 = torch.empty(3, 200, 136, dtype=ab.dtype, device="cuda"), torch.empty(3, 200, 136, device="cuda")
        mm.gemm(ab, bb, f32)
        assert mm.gemm_device_scale(ab, bb, out, s) is True
        torch.testing.assert_close(out, (f32 * s).to(out.dtype), atol=0, rtol=0)
        buf = _t((64, 128), dtype)
        with pytest.raises(ValueError, match=r"cukit\.ops\.matmul\.gemm_device_scale: out must not overlap a or b"):
            mm.gemm_device_scale(buf[:, :64], _t((64, 64), dtype), buf[:, 32:96], s)


@gpu
def test_gpu_k_zero_and_empty():
    for od in ("float32", "bfloat16"):
        a = torch.empty(70, 0, dtype=torch.bfloat16, device="cuda")
        b = torch.empty(0, 300, dtype=torch.bfloat16, device="cuda")
        out = torch.full((70, 300), 2.0, dtype=getattr(torch, od), device="cuda")
        mm.gemm(a, b, out, alpha=5.0, beta=0.5)
        assert bool((out == 1.0).all())  # alpha * 0 + 0.5 * 2
        out.fill_(float("nan"))
        mm.gemm(a, b, out)
        assert bool((out == 0).all())
    e = torch.empty(0, 5, device="cuda")
    mm.gemm(e, torch.ones(5, 3, device="cuda"), torch.empty(0, 3, device="cuda"), beta=1.0)


@gpu
def test_gpu_plan_cache_ignores_alpha_and_beta_values():
    """alpha and beta are launch arguments: new values reuse the plan; only beta == 0 (C not read)
    against beta != 0 makes a second one. The hot path allocates nothing and never syncs: it runs
    inside a CUDA-graph capture."""
    torch.manual_seed(5)
    a, b = _t((300, 200), "bfloat16"), _t((200, 500), "bfloat16", transposed=True)
    out = torch.zeros(300, 500, device="cuda")
    mm._PLANS.clear()
    mm.gemm(a, b, out)
    n = len(mm._PLANS)
    for alpha in (0.5, 2.0, -1.0):
        mm.gemm(a, b, out, alpha=alpha)
    assert len(mm._PLANS) == n
    mm.gemm(a, b, out, beta=1.0)
    mm.gemm(a, b, out, alpha=3.0, beta=-0.5)
    assert len(mm._PLANS) == n + 1
    hits = mm._PLANS.hits
    graph = torch.cuda.CUDAGraph()
    acc = torch.zeros(300, 500, device="cuda")
    with torch.cuda.graph(graph):
        mm.gemm(a, b, acc, alpha=0.25, beta=1.0)
    assert mm._PLANS.hits == hits + 1
    acc.zero_()
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    ref, bound = expected(a, b, None, 1.0, 0.0, "bfloat16", "float32")
    check(acc, ref, 4 * bound, "4 replays of acc += a @ b / 4")


@gpu
def test_gpu_launches_on_the_current_stream_and_cupy_arrays():
    import cupy

    torch.manual_seed(6)
    a, b = _t((257, 130), "float16"), _t((130, 65), "float16")
    s = torch.cuda.Stream()
    out = torch.zeros(257, 65, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            mm.gemm(a, b, out, beta=1.0)
    s.synchronize()
    ref, bound = expected(a, b, None, 3.0, 0.0, "float16", "float32")
    check(out, ref, 3 * bound, "torch side stream")
    ca, cb = cupy.asarray(a), cupy.asarray(b)
    cout = cupy.full((257, 80), np.nan, np.float32)[:, 5:70]
    mm.gemm(ca, cb, cout, alpha=2.0)
    ref, bound = expected(a, b, None, 2.0, 0.0, "float16", "float32")
    check(cupy.asnumpy(cout), ref, bound, "cupy")


@gpu
def test_gpu_errors_before_any_launch():
    a, b = torch.ones(4, 8, device="cuda"), torch.ones(8, 6, device="cuda")
    with pytest.raises(ValueError, match=f"^{GEMM}: out must not overlap a or b"):
        mm.gemm(a, b, a[:, :6])
    out = torch.zeros(4, 6, device="cuda")
    mm.gemm(a, b, out)  # the signature's plan exists: later calls check overlap on the hot path too
    buf = torch.zeros(4 * 8 + 8 * 6, device="cuda")
    a2, b2 = buf[:32].view(4, 8), buf[32:].view(8, 6)
    with pytest.raises(ValueError, match=f"^{GEMM}: out must not overlap a or b"):
        mm.gemm(a2, b2, buf[8:32].view(4, 6))
    with pytest.raises(ValueError, match="same device"):
        mm.gemm(a, b, torch.zeros(4, 6))
    with pytest.raises(TypeError, match=f"^{GEMM}: out must have dtype float32"):
        mm.gemm(a, b, torch.zeros(4, 6, device="cuda", dtype=torch.float16))
    assert math.isfinite(float(out.sum()))
