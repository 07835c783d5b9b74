"""cukit.linalg: inverse roots, roots, powers, eigh, kron, kron_matvec; and the batched form of
cukit.ops.matmul.gemm that the Newton route runs on. Every route against float64 oracles built
from numpy.linalg.eigh / numpy.kron (independent of cukit's references), on NumPy and torch CPU;
the same on CUDA (CuPy, torch) under the `gpu` marker, with no host sync and CUDA-graph capture."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
import cukit.linalg as la
from cukit.ops import linalg as L
from cukit.ops import matmul as mm
from cukit.testing import assert_close, to_numpy

torch = pytest.importorskip("torch")

MATRIX_DTYPES = ["float32", "float64"]
# Inverse roots amplify rounding by the condition number; the test matrices keep it below ~100.
ROOT_TOL = {"float32": (2e-4, 2e-4), "float64": (1e-10, 1e-10)}


# ------------------------------------------------------------------------------------- oracles
def spd(batch: tuple[int, ...], n: int, dtype: str = "float64", ridge: float = 0.3, seed: int = 0) -> np.ndarray:
    """Symmetric positive definite test matrices G = A A^T / n + ridge I (condition number < ~50)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((*batch, n, n))
    return (a @ np.swapaxes(a, -1, -2) / max(n, 1) + ridge * np.eye(n)).astype(dtype)


def oracle_power(a: np.ndarray, expo: float, eps: float = 0.0) -> np.ndarray:
    """(A + eps lambda_max I)^expo in float64 by numpy.linalg.eigh (eigenvalues below 0 as 0)."""
    a = np.asarray(a, np.float64)
    w, v = np.linalg.eigh(a)
    r = eps * np.maximum(w[..., -1:], 0)
    d = (np.maximum(w, 0) + r) ** expo
    return (v * d[..., None, :]) @ np.swapaxes(v, -1, -2)


def check(actual, expected, dtype: str) -> None:
    atol, rtol = ROOT_TOL[dtype]
    scale = float(np.abs(expected).max()) if np.size(expected) else 1.0
    assert_close(actual, expected, atol=atol * scale, rtol=rtol)


# ------------------------------------------------------------------------------------- matrix_inverse_root
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("batch,n", [((), 1), ((3,), 5), ((2, 2), 17), ((2,), 33)])
def test_inverse_root_numpy(dtype, method, p, batch, n):
    a = spd(batch, n, dtype)
    x, info = la.matrix_inverse_root(a, p, eps=0.0, method=method, return_info=True)
    assert isinstance(x, np.ndarray) and x.dtype == np.dtype(dtype) and x.shape == a.shape
    assert info.dtype == np.int32 and info.shape == batch and not info.any()
    check(x, oracle_power(a, -1.0 / p), dtype)


@pytest.mark.parametrize("method", ["auto", "eigh", "newton"])
def test_inverse_root_torch_cpu(method):
    a = torch.from_numpy(spd((4,), 9))
    x, info = la.matrix_inverse_root(a, 4, eps=0.0, method=method, return_info=True)
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float64 and x.device.type == "cpu"
    assert isinstance(info, torch.Tensor) and info.dtype == torch.int32 and info.shape == (4,)
    check(x, oracle_power(a.numpy(), -0.25), "float64")


def test_inverse_root_relative_eps_regularises_rank_deficiency():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((3, 8, 3))
    a = g @ np.swapaxes(g, -1, -2)  # rank 3 of 8: singular
    x, info = la.matrix_inverse_root(a, 2, eps=1e-3, method="eigh", return_info=True)
    assert not info.any()
    check(x, oracle_power(a, -0.5, 1e-3), "float64")
    # the Newton route estimates lambda_max by power iterations: close, not equal, ridges
    xn, info_n = la.matrix_inverse_root(a, 2, eps=1e-3, method="newton", max_iters=40, return_info=True)
    assert not info_n.any()
    assert_close(xn, x, atol=0.05 * np.abs(x).max(), rtol=0.05)
    # without the ridge the eigh route flags the singular matrices instead of returning inf silently
    _, bad = la.matrix_inverse_root(a, 2, eps=0.0, method="eigh", return_info=True)
    assert (bad == 2).all()


def test_inverse_root_scale_invariance_of_eps():
    a = spd((2,), 6)
    x1 = la.matrix_inverse_root(a, 4, eps=1e-2, method="eigh")
    x2 = la.matrix_inverse_root(1e6 * a, 4, eps=1e-2, method="eigh")
    check(x2 * 1e6**0.25, x1, "float64")


def test_newton_info_flags():
    a = spd((4,), 6)
    a[1] = 0.0  # zero matrix: no scale
    a[2, 0, 0] = np.nan
    _, info = L.newton_reference(a, 2, 1e-6, 20, L.default_tol("float64", 6))
    assert info.tolist() == [0, 2, 2, 0]
    _, info1 = la.matrix_inverse_root(spd((2,), 6), 4, method="newton", max_iters=1, return_info=True)
    assert (info1 == 1).all()  # one step is not enough


def test_newton_freezes_converged_matrices_exactly():
    a = spd((3,), 10)
    tol = L.default_tol("float64", 10)
    x30, i30 = L.newton_reference(a, 4, 0.0, 30, tol)
    x50, i50 = L.newton_reference(a, 4, 0.0, 50, tol)
    assert not i30.any() and not i50.any()
    np.testing.assert_array_equal(x30, x50)  # T = I once converged: the GEMMs reproduce X exactly


def test_newton_reference_torch_matches_numpy():
    a = spd((3,), 12)
    tol = L.default_tol("float64", 12)
    xn, infon = L.newton_reference(a, 4, 1e-6, 25, tol)
    xt, infot = L.newton_reference_torch(torch.from_numpy(a), 4, 1e-6, 25, tol)
    assert_close(xt, xn, atol=1e-12, rtol=1e-10)
    assert infot.tolist() == infon.tolist()


def test_inverse_root_empty_and_1x1():
    assert la.matrix_inverse_root(np.zeros((0, 3, 3)), 2).shape == (0, 3, 3)
    x = la.matrix_inverse_root(np.array([[4.0]]), 2, eps=0.0, method="newton")
    assert_close(x, np.array([[0.5]]), atol=1e-12, rtol=1e-12)


@given(
    n=st.integers(1, 12),
    b=st.integers(0, 3),
    p=st.integers(1, 4),
    dtype=st.sampled_from(MATRIX_DTYPES),
    method=st.sampled_from(["eigh", "newton"]),
    seed=st.integers(0, 2**16),
)
def test_inverse_root_property(n, b, p, dtype, method, seed):
    a = spd((b,), n, dtype, seed=seed)
    x, info = la.matrix_inverse_root(a, p, eps=0.0, method=method, return_info=True)
    assert not info.any()
    check(x, oracle_power(a, -1.0 / p), dtype)


# ------------------------------------------------------------------------------------- matrix_root, matrix_power
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("p", [1, 2, 4])
def test_matrix_root(dtype, method, p):
    a = spd((3,), 7, dtype)
    y = la.matrix_root(a, p, method=method)
    check(y, oracle_power(a, 1.0 / p), dtype)
    # with a ridge: (A + r I)^(1/p), r from the same lambda_max on the eigh route
    if method == "eigh":
        check(la.matrix_root(a, p, eps=0.1, method="eigh"), oracle_power(a, 1.0 / p, 0.1), dtype)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8])
def test_matrix_power(k):
    a = np.random.default_rng(2).standard_normal((2, 3, 4, 4)) / 2
    assert_close(la.matrix_power(a, k), np.linalg.matrix_power(a, k), atol=1e-12, rtol=1e-12)
    t = torch.from_numpy(a)
    assert_close(la.matrix_power(t, k), torch.linalg.matrix_power(t, k), atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------- eigh
@pytest.mark.parametrize("uplo", ["L", "U"])
def test_eigh(uplo):
    a = spd((2, 3), 6)
    w, v = la.eigh(a, uplo)
    w0, _ = np.linalg.eigh(a, UPLO=uplo)
    assert_close(w, w0, atol=1e-12, rtol=1e-12)
    assert_close((v * w[..., None, :]) @ np.swapaxes(v, -1, -2), a, atol=1e-10, rtol=1e-10)
    wt, vt = la.eigh(torch.from_numpy(a), uplo)
    assert isinstance(wt, torch.Tensor) and wt.shape == (2, 3, 6) and vt.shape == a.shape
    assert_close(wt, w0, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------- kron
KRON_SHAPES = [((), (3,)), ((2,), (3,)), ((2, 3), (4, 5)), ((3,), (2, 2)), ((2, 1, 3), (1, 4, 2)),
               ((2, 3, 1, 2), (1, 2, 2)), ((2, 1, 1, 1, 2), (1, 2, 1, 2, 1)), ((0, 3), (2, 2))]


@pytest.mark.parametrize("sa,sb", KRON_SHAPES)
def test_kron_matches_numpy(sa, sb):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    expected = np.kron(a, b)
    np.testing.assert_array_equal(la.kron(a, b), expected)
    np.testing.assert_array_equal(L.kron_reference(a, b), expected)
    got = la.kron(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("batch", [(4,), (2, 3)])
def test_kron_batched(batch):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((*batch, 2, 3)), rng.standard_normal((*batch, 5, 2))
    got = la.kron(a, b, batch_dims=len(batch))
    expected = np.stack([np.kron(x, y) for x, y in zip(a.reshape(-1, 2, 3), b.reshape(-1, 5, 2), strict=True)])
    np.testing.assert_array_equal(got, expected.reshape(*batch, 10, 6))
    gt = la.kron(torch.from_numpy(a), torch.from_numpy(b), batch_dims=len(batch))
    np.testing.assert_array_equal(gt.numpy(), got)


def test_kron_array_likes():
    np.testing.assert_array_equal(la.kron([1.0, 2.0], [[1.0], [3.0]]), np.kron([1.0, 2.0], [[1.0], [3.0]]))
    got = la.kron(torch.ones(2), [1.0, 2.0])
    assert isinstance(got, torch.Tensor)


# ------------------------------------------------------------------------------------- kron_matvec
@pytest.mark.parametrize("m,n,p,q", [(3, 4, 5, 2), (1, 1, 1, 1), (6, 2, 2, 7)])
def test_kron_matvec(m, n, p, q):
    rng = np.random.default_rng(5)
    A, B, X = rng.standard_normal((m, n)), rng.standard_normal((p, q)), rng.standard_normal((n, q))
    y = la.kron_matvec(A, B, X)
    assert y.shape == (m, p)
    assert_close(y.reshape(-1), np.kron(A, B) @ X.reshape(-1), atol=1e-12, rtol=1e-12)  # row-major vec
    z = X.T  # the column-major statement: (A ⊗ B) vec(Z) = vec(B Z A^T), vec stacking columns
    assert_close(np.kron(A, B) @ z.reshape(-1, order="F"), (B @ z @ A.T).reshape(-1, order="F"), atol=1e-12, rtol=0)
    yt = la.kron_matvec(torch.from_numpy(A), torch.from_numpy(B), torch.from_numpy(X))
    assert isinstance(yt, torch.Tensor)
    assert_close(yt, y, atol=1e-12, rtol=1e-12)


def test_kron_matvec_batched_broadcast():
    rng = np.random.default_rng(6)
    A, B, X = rng.standard_normal((3, 4, 2)), rng.standard_normal((5, 3)), rng.standard_normal((3, 2, 3))
    y = la.kron_matvec(A, B, X)
    for i in range(3):
        assert_close(y[i].reshape(-1), np.kron(A[i], B) @ X[i].reshape(-1), atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------- errors
def test_errors_name_function_and_argument():
    a = spd((2,), 3)
    f = "cukit.linalg.matrix_inverse_root"
    with pytest.raises(TypeError, match=f"^{f}: A must have dtype float32 or float64; got int64"):
        la.matrix_inverse_root(np.ones((2, 2), np.int64), 2)
    with pytest.raises(ValueError, match=rf"^{f}: A must be a stack of square matrices \(\.\.\., n, n\); got shape \(2, 3\)"):
        la.matrix_inverse_root(np.ones((2, 3)), 2)
    with pytest.raises(ValueError, match=f"^{f}: p must be an integer >= 1; got 0"):
        la.matrix_inverse_root(a, 0)
    with pytest.raises(TypeError, match=f"^{f}: p must be an integer; got float"):
        la.matrix_inverse_root(a, 0.5)
    with pytest.raises(ValueError, match=f"^{f}: eps must be a finite number >= 0.0; got -1"):
        la.matrix_inverse_root(a, 2, eps=-1)
    with pytest.raises(ValueError, match=f"^{f}: method must be one of 'auto', 'eigh', 'newton'; got 'qr'"):
        la.matrix_inverse_root(a, 2, method="qr")
    with pytest.raises(TypeError, match=f"^{f}: A must be an array-like"):
        la.matrix_inverse_root("x", 2)
    with pytest.raises(ValueError, match=r"^cukit\.linalg\.matrix_power: k must be an integer >= 0; got -1"):
        la.matrix_power(a, -1)
    with pytest.raises(ValueError, match=r"^cukit\.linalg\.kron: a and b must have the same 1 leading batch"):
        la.kron(np.ones((2, 3)), np.ones((3, 3)), batch_dims=1)
    with pytest.raises(TypeError, match=r"^cukit.linalg.kron: b must be the same array type as a \(numpy.ndarray\)"):
        la.kron(np.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"^cukit.linalg.kron_matvec: X must be \(\.\.\., n, q\)"):
        la.kron_matvec(np.ones((2, 3)), np.ones((4, 5)), np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"^cukit\.linalg\.eigh: UPLO must be 'L' or 'U'"):
        la.eigh(a, "X")


def test_choose_method():
    assert L.choose_method(128, 512, "float32", None) == "eigh"
    assert L.choose_method(L.EIGH_MAX_N, 64, "float32", 0) == "eigh"
    assert L.choose_method(L.EIGH_MAX_N + 1, 64, "float32", 0) == "newton"


def test_public_surface():
    assert "linalg" in dir(cukit) and cukit.linalg is la
    for name in la.__all__:
        assert getattr(la, name) is getattr(L, name)


# ------------------------------------------------------------------------------------- batched gemm (CPU)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gemm_batched_cpu(backend):
    rng = np.random.default_rng(7)
    a, b, c = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 6, 5)), rng.standard_normal((3, 4, 6))
    expected = 2.0 * a @ np.swapaxes(b, -1, -2) + 0.5 * c
    if backend == "torch":
        a, b, c = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
    out = mm.gemm(a, np.swapaxes(b, -1, -2) if backend == "numpy" else b.mT, c, alpha=2.0, beta=0.5)
    assert out is c
    assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_gemm_batched_errors():
    g = "cukit.ops.matmul.gemm"
    a, b, c = np.ones((3, 4, 5)), np.ones((3, 5, 6)), np.zeros((3, 4, 6))
    with pytest.raises(ValueError, match=rf"^{g}: b must be 3-D \(B, K, N\) like a"):
        mm.gemm(a, b[0], c)
    with pytest.raises(ValueError, match=f"^{g}: out must have a's batch size 3"):
        mm.gemm(a, b, c[:2])
    with pytest.raises(ValueError, match=f"^{g}: a must be 2-D"):
        mm.gemm(a[0, 0], b, c)
    with pytest.raises(ValueError, match=f"^{g}: out must have a batch stride >= 24"):
        mm.gemm(a, b, np.broadcast_to(np.zeros((1, 4, 6)), (3, 4, 6)))


# ------------------------------------------------------------------------------------- GPU
def _cuda_tensor(x: np.ndarray):
    return torch.from_numpy(x).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("batch,n", [((), 1), ((3,), 5), ((2, 3), 17), ((4,), 64), ((2,), 129)])
def test_gpu_inverse_root(dtype, method, p, batch, n):
    import cupy

    a = spd(batch, n, dtype)
    expected = oracle_power(a, -1.0 / p)
    for arr in (cupy.asarray(a), _cuda_tensor(a)):
        x, info = la.matrix_inverse_root(arr, p, eps=0.0, method=method, return_info=True)
        assert type(x) is type(arr) and x.shape == a.shape and to_numpy(x).dtype == np.dtype(dtype)
        assert type(info) is type(arr) and not to_numpy(info).any()
        check(x, expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
def test_gpu_newton_matches_reference_with_ridge(dtype):
    a = spd((6,), 40, dtype, ridge=1e-2)
    tol = L.default_tol(dtype, 40)
    xr, ir = L.newton_reference(a, 4, 1e-4, 20, tol)
    x, info = la.matrix_inverse_root(_cuda_tensor(a), 4, eps=1e-4, method="newton", max_iters=20, tol=tol,
                                     return_info=True)
    assert to_numpy(info).tolist() == ir.tolist()
    check(x, xr, dtype)


# The fused Newton kernel (newton_fused: one block per matrix, the loop on chip) takes n up to its
# dtype's largest tile; the GEMM path (L._FUSED_NEWTON = False) is the other implementation.
FUSED_CASES = [("float32", n) for n in (1, 2, 17, 64, L._FUSED_TILES["float32"][-1])] + [
    ("float64", n) for n in (1, 2, 17, 64, L._FUSED_TILES["float64"][-1])]


@pytest.fixture
def gemm_newton(monkeypatch):
    """The Newton route on batched GEMMs for every n (the fused kernel off)."""
    monkeypatch.setattr(L, "_FUSED_NEWTON", False)


def mixed_batch(n: int, dtype: str) -> tuple[np.ndarray, list[int]]:
    """Matrices that stop at different steps: well conditioned (converges early), worse conditioned,
    a NaN element (fails in newton_start), negative definite (diverges: fails inside the loop), a
    middle one. Returns (batch, indices of the good ones)."""
    a = np.concatenate([spd((1,), n, dtype, ridge=2.0, seed=1), spd((1,), n, dtype, ridge=0.05, seed=2),
                        spd((1,), n, dtype, seed=3), -spd((1,), n, dtype, seed=4), spd((1,), n, dtype, seed=5)])
    a[2, 0, n - 1] = np.nan
    return a, [0, 1, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,n", FUSED_CASES)
def test_gpu_newton_fused_matches_reference(dtype, n, p):
    import cupy

    from cukit.interop import DTYPES

    assert L._fused_tile(n, DTYPES[dtype], torch.cuda.current_device())  # this test runs the fused kernel
    tol, iters = L.default_tol(dtype, n), L.default_max_iters(dtype)
    a, good = mixed_batch(n, dtype)
    xr, ir = L.newton_reference(a, p, 1e-6, iters, tol)
    assert ir.tolist() == [0, 0, 2, 2, 0]
    x, info = la.matrix_inverse_root(_cuda_tensor(a), p, method="newton", return_info=True)
    assert info.tolist() == ir.tolist()
    check(x[good], xr[good], dtype)
    # each matrix is its own block: the good ones alone give the same bits, one alone too
    alone = la.matrix_inverse_root(_cuda_tensor(a[good]), p, method="newton")
    assert torch.equal(alone, x[good])
    x1, i1 = la.matrix_inverse_root(cupy.asarray(a[1]), p, method="newton", return_info=True)
    assert int(i1) == 0 and (cupy.asnumpy(x1) == to_numpy(x[1])).all()
    # too few steps: not converged in both implementations; max_iters = 0 tests M_0
    for k in (0, 2):
        xk, ik = la.matrix_inverse_root(_cuda_tensor(a), p, method="newton", max_iters=k, return_info=True)
        xkr, ikr = L.newton_reference(a, p, 1e-6, k, tol)
        assert ik.tolist() == ikr.tolist()
        check(xk[good], xkr[good], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n", [c for c in FUSED_CASES if c[1] > L.EIGH_MAX_N])
def test_gpu_newton_fused_is_the_default_route(dtype, n):
    a = _cuda_tensor(spd((3,), n, dtype, ridge=0.1))
    x_auto, i_auto = la.matrix_inverse_root(a, 4, return_info=True)  # auto: newton at this n, fused
    x_new, i_new = la.matrix_inverse_root(a, 4, method="newton", return_info=True)
    assert torch.equal(x_auto, x_new) and torch.equal(i_auto, i_new) and not i_new.any().item()
    # converged matrices leave the loop: more steps change no bit
    x_more = la.matrix_inverse_root(a, 4, method="newton", max_iters=60)
    assert torch.equal(x_more, x_new)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,n", FUSED_CASES)
def test_gpu_newton_fused_agrees_with_gemm_path(request, dtype, n, p):
    a, good = mixed_batch(n, dtype)
    t = _cuda_tensor(a)
    x_f, i_f = la.matrix_inverse_root(t, p, method="newton", return_info=True)
    y_f = la.matrix_root(t[good], p, eps=1e-3, method="newton")
    request.getfixturevalue("gemm_newton")
    x_g, i_g = la.matrix_inverse_root(t, p, method="newton", return_info=True)
    y_g = la.matrix_root(t[good], p, eps=1e-3, method="newton")
    assert i_f.tolist() == i_g.tolist() == [0, 0, 2, 2, 0]
    check(x_f[good], to_numpy(x_g[good]), dtype)
    check(y_f, to_numpy(y_g), dtype)
    yr, _ = L.newton_reference(a[good], p, 1e-3, L.default_max_iters(dtype), L.default_tol(dtype, n), root=True)
    check(y_f, yr, dtype)  # the ridge comes from the route's lambda_max estimate: its reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("n", [200, 600])
def test_gpu_newton_gemm_path_row_chunks(dtype, n):
    """n above the fused tiles: the O(n^2) kernels (power iteration, start, residual, step, finish)
    run on several row chunks per matrix (_chunk_rows) and reduce their partials in a later launch;
    per-matrix states, failures, ridge and X as the reference's."""
    assert -(-n // L._chunk_rows(n)) > 1
    tol, iters = L.default_tol(dtype, n), L.default_max_iters(dtype)
    a, good = mixed_batch(n, dtype)
    xr, ir = L.newton_reference(a, 4, 1e-6, iters, tol)
    assert ir[2] == ir[3] == 2
    x, info = la.matrix_inverse_root(_cuda_tensor(a), 4, method="newton", return_info=True)
    assert info.tolist() == ir.tolist()
    check(x[good], xr[good], dtype)
    y = la.matrix_root(_cuda_tensor(a[good]), 2, eps=1e-3, method="newton")
    yr, _ = L.newton_reference(a[good], 2, 1e-3, iters, tol, root=True)
    check(y, yr, dtype)


@pytest.mark.gpu
def test_gpu_newton_flags_stay_on_device_and_no_host_sync():
    a = spd((5,), 48, "float32")
    a[1] = 0.0
    a[3, 2, 2] = np.nan
    t = _cuda_tensor(a)
    la.matrix_inverse_root(t, 4, method="newton", return_info=True)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, info = la.matrix_inverse_root(t, 4, method="newton", return_info=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert info.is_cuda and info.tolist() == [0, 2, 0, 2, 0]
    good = [0, 2, 4]
    check(x[good], oracle_power(a[good], -0.25, 1e-6), "float32")


@pytest.mark.gpu
def test_gpu_newton_cuda_graph_capture():
    a = spd((8,), 64, "float32")
    t = _cuda_tensor(a)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        la.matrix_inverse_root(t, 4, method="newton", return_info=True)  # compiles, builds the plans
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, info = la.matrix_inverse_root(t, 4, method="newton", return_info=True)
    b = spd((8,), 64, "float32", seed=9)
    t.copy_(torch.from_numpy(b))
    graph.replay()
    torch.cuda.synchronize()
    assert not info.any().item()
    check(x, oracle_power(b, -0.25, 1e-6), "float32")


@pytest.mark.gpu
def test_gpu_newton_on_current_stream():
    a = spd((4,), 96, "float32")
    src = _cuda_tensor(a)
    t = torch.zeros_like(src)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        t.copy_(src)
        x = la.matrix_inverse_root(t, 2, method="newton")
        y = la.matrix_inverse_root(t, 2, method="eigh")
    torch.cuda.synchronize()
    check(x, oracle_power(a, -0.5, 1e-6), "float32")
    check(y, oracle_power(a, -0.5, 1e-6), "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_gpu_matrix_root(method, p):
    a = spd((3,), 20)
    y = la.matrix_root(_cuda_tensor(a), p, eps=0.01, method=method)
    if method == "eigh":
        check(y, oracle_power(a, 1.0 / p, 0.01), "float64")
    else:  # the Newton route's ridge comes from its lambda_max estimate: compare to its reference
        xr, _ = L.newton_reference(a, p, 0.01, L.default_max_iters("float64"), L.default_tol("float64", 20),
                                   root=True)
        check(y, xr, "float64")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 1, 2, 5, 8])
def test_gpu_matrix_power(k):
    import cupy

    a = np.random.default_rng(8).standard_normal((3, 33, 33)) / 6
    for arr in (cupy.asarray(a), _cuda_tensor(a)):
        assert_close(la.matrix_power(arr, k), np.linalg.matrix_power(a, k), atol=1e-12, rtol=1e-10)


@pytest.mark.gpu
def test_gpu_eigh():
    import cupy

    a = spd((4,), 40)
    w0 = np.linalg.eigh(a)[0]
    for arr in (cupy.asarray(a), _cuda_tensor(a)):
        w, v = la.eigh(arr)
        assert type(w) is type(arr)
        assert_close(w, w0, atol=1e-10, rtol=1e-10)
        vn = to_numpy(v)
        assert_close((vn * w0[..., None, :]) @ np.swapaxes(vn, -1, -2), a, atol=1e-10, rtol=1e-10)


GPU_KRON_DTYPES = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_KRON_DTYPES)
@pytest.mark.parametrize("sa,sb", [*KRON_SHAPES, ((5, 123), (3, 8)), ((7, 3), (4097,)), ((1,), (1,))])
def test_gpu_kron(dtype, sa, sb):
    rng = np.random.default_rng(10)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    ta = torch.from_numpy(a).to("cuda", getattr(torch, dtype))
    tb = torch.from_numpy(b).to("cuda", getattr(torch, dtype))
    expected = torch.kron(ta.cpu().double(), tb.cpu().double()).numpy()  # products of the rounded inputs
    got = la.kron(ta, tb)
    assert got.dtype == ta.dtype and got.is_cuda
    assert_close(got, expected, dtype=dtype)
    got2 = la.kron(ta, tb)  # the cached plan
    assert_close(got2, expected, dtype=dtype)


@pytest.mark.gpu
def test_gpu_kron_batched_unaligned_and_cupy():
    import cupy

    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((6, 3, 5)), rng.standard_normal((6, 4, 8))
    expected = np.stack([np.kron(x, y) for x, y in zip(a, b, strict=True)])
    assert_close(la.kron(cupy.asarray(a), cupy.asarray(b), batch_dims=1), expected, atol=0, rtol=0)
    tb = torch.from_numpy(b).float().cuda()  # 16-byte aligned, q = 8: the vector path
    tb_odd = torch.cat([tb.new_zeros(1), tb.reshape(-1)])[1:].reshape(b.shape)  # 4-byte offset: scalar path
    for bb in (tb, tb_odd):
        assert_close(la.kron(torch.from_numpy(a).float().cuda(), bb, batch_dims=1), expected, dtype="float32")


@pytest.mark.gpu
def test_gpu_kron_matvec():
    import cupy

    rng = np.random.default_rng(12)
    A, B, X = rng.standard_normal((2, 30, 20)), rng.standard_normal((2, 40, 10)), rng.standard_normal((2, 20, 10))
    expected = A @ X @ np.swapaxes(B, -1, -2)
    for conv in (cupy.asarray, _cuda_tensor):
        assert_close(la.kron_matvec(conv(A), conv(B), conv(X)), expected, atol=1e-10, rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_gpu_gemm_batched(dtype):
    rng = np.random.default_rng(13)
    tdt = getattr(torch, dtype)
    a = torch.from_numpy(rng.standard_normal((5, 33, 17))).to("cuda", tdt)
    b = torch.from_numpy(rng.standard_normal((5, 40, 17))).to("cuda", tdt)
    c0 = torch.from_numpy(rng.standard_normal((5, 33, 40))).to("cuda", torch.float32 if dtype == "bfloat16" else tdt)
    for beta in (0.0, 0.5):
        c = c0.clone()
        ref = mm.gemm_reference_torch(a.cpu(), b.mT.cpu(), c0.cpu().clone(), alpha=2.0, beta=beta)
        mm.gemm(a, b.mT, c, alpha=2.0, beta=beta)
        assert_close(c, ref, dtype="float32" if dtype == "bfloat16" else dtype)
    # a column block of a larger batched buffer, and a broadcast (zero batch stride) a
    big = torch.zeros(5, 33, 50, device="cuda", dtype=c0.dtype)
    one = a[:1].expand(5, 33, 17)
    mm.gemm(one, b.mT, big[:, :, 5:45])
    ref = mm.gemm_reference_torch(one.cpu(), b.mT.cpu(), torch.zeros(5, 33, 40, dtype=c0.dtype))
    assert_close(big[:, :, 5:45], ref, dtype="float32" if dtype == "bfloat16" else dtype)
    assert not big[:, :, :5].any() and not big[:, :, 45:].any()


@pytest.mark.gpu
@given(
    n=st.integers(1, 70),
    b=st.integers(0, 4),
    p=st.integers(1, 4),
    dtype=st.sampled_from(MATRIX_DTYPES),
    method=st.sampled_from(["auto", "eigh", "newton"]),
    seed=st.integers(0, 2**16),
)
def test_gpu_inverse_root_property(n, b, p, dtype, method, seed):
    a = spd((b,), n, dtype, seed=seed)
    x, info = la.matrix_inverse_root(_cuda_tensor(a), p, eps=0.0, method=method, return_info=True)
    assert not info.any().item()
    check(x, oracle_power(a, -1.0 / p), dtype)


@pytest.mark.gpu
@given(
    sa=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    sb=st.lists(st.integers(1, 9), min_size=0, max_size=4),
    dtype=st.sampled_from(GPU_KRON_DTYPES),
    offset=st.booleans(),
)
def test_gpu_kron_property(sa, sb, dtype, offset):
    rng = np.random.default_rng(len(sa) * 10 + len(sb))
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    tdt = getattr(torch, dtype)
    ta = torch.from_numpy(a).to("cuda", tdt)
    tb = torch.from_numpy(b).to("cuda", tdt)
    if offset and tb.numel():  # a misaligned b: the scalar path
        tb = torch.cat([tb.new_zeros(1), tb.reshape(-1)])[1:].reshape(tb.shape)
    expected = np.kron(to_numpy(ta).astype(np.float64), to_numpy(tb).astype(np.float64))
    assert_close(la.kron(ta, tb), expected, dtype=dtype)


# ------------------------------------------------------------------------------------- GPU orchestration on the CPU
class _FakeDevice:
    """Runs the GPU routes' host code on torch CPU tensors: allocations are registered so that the
    pointers the launches get can be resolved to tensors, and each linalg.cu kernel is emulated in
    torch from its CUDA source (same maths, whole-array form). What this checks is the host side
    (buffer ping-pong, argument order and tails, the batched GEMMs), not the kernels' maths."""

    def __init__(self) -> None:
        self.bases: list = []

    def empty(self, shape, like, kind, dtype=None):
        t = torch.empty(shape, dtype=getattr(torch, dtype) if dtype else like.dtype)
        self.bases.append(t)
        return t

    def flat(self, ptr: int, count: int, dtype):
        for b in self.bases:
            lo = b.data_ptr()
            if lo <= ptr < lo + b.numel() * b.element_size() and b.dtype == dtype:
                off = (ptr - lo) // b.element_size()
                return b.view(-1)[off:off + count]
        raise AssertionError(f"pointer {ptr:#x} is in no allocation of dtype {dtype}")

    def prepare(self, name, grid, block, tail, *, device, shared_mem=0):
        kernel = name.split("<")[0]
        dt = torch.float64 if "double" in name else torch.float32
        return lambda head, stream: getattr(self, kernel)(dt, head, tail)

    def _part(self, pp, n, rows, dt):
        """The partial sums (quantity, matrix, chunk); the emulation keeps each total in chunk 0."""
        chunks = -(-n // rows)
        return self.flat(pp, L._NEWTON_PARTS * self.nb * chunks, dt).view(L._NEWTON_PARTS, self.nb, chunks)

    def newton_power(self, dt, head, tail):
        pa, pw, pp = head
        n, rows, it = tail
        nb = self.nb
        a = self.flat(pa, nb * n * n, dt).view(nb, n, n)
        work = self.flat(pw, nb * (2 * n + 1), dt).view(nb, 2 * n + 1)
        part = self._part(pp, n, rows, dt)
        if it == 0:
            v = torch.from_numpy(L._power_start(n, np.float64)).to(dt).expand(nb, n).clone()
            vv = (v * v).sum(-1)
        else:
            v = work[:, ((it + 1) % 2) * n:((it + 1) % 2) * n + n].clone()
            vv = part[3 + 2 * ((it + 1) % 2)].sum(-1)
        live = vv > 0
        inv = torch.where(live, 1 / vv.sqrt(), torch.zeros_like(vv))
        y = (a @ v[..., None])[..., 0] * inv[:, None]
        work[:, (it % 2) * n:(it % 2) * n + n] = y
        for q, val in ((2 + 2 * (it % 2), (v * y).sum(-1) * inv), (3 + 2 * (it % 2), (y * y).sum(-1))):
            part[q].zero_()
            part[q][:, 0] = val
        if it == 0:
            part[0:2].zero_()
            part[0][:, 0] = (a * a).sum((-2, -1))
            part[1][:, 0] = a.diagonal(dim1=-2, dim2=-1).sum(-1)

    def newton_start(self, dt, head, tail):
        pa, px, pm, ps, pw, pp = head
        n, p, eps, rows, iters = tail
        nb = self.nb
        a = self.flat(pa, nb * n * n, dt).view(nb, n, n)
        x, m = self.flat(px, nb * n * n, dt).view(nb, n, n), self.flat(pm, nb * n * n, dt).view(nb, n, n)
        work = self.flat(pw, nb * (2 * n + 1), dt).view(nb, 2 * n + 1)
        part = self._part(pp, n, rows, dt)
        ss, tr, lam = part[0].sum(-1), part[1].sum(-1), part[2 + 2 * ((iters + 1) % 2)].sum(-1)
        r = eps * lam.clamp_min(0)
        fro = (ss + 2 * r * tr + n * r * r).clamp_min(0).sqrt()
        ok = (fro > 0) & fro.isfinite()
        sc = torch.where(ok, (p + 1) / (2 * fro), torch.zeros_like(fro))
        xs = torch.where(ok, sc ** (1 / p), torch.full_like(fro, float("nan")))
        eye = torch.eye(n, dtype=dt)
        x.copy_(xs[:, None, None] * eye)
        m.copy_(sc[:, None, None] * (a + r[:, None, None] * eye))
        work[:, 2 * n] = r
        self.flat(ps, nb, torch.int32).copy_(torch.where(ok, 0, 2))

    def newton_resid(self, dt, head, tail):
        pm, px, ps, pp = head
        n, rows = tail
        nb = self.nb
        m = self.flat(pm, nb * n * n, dt).view(nb, n, n)
        d = m - torch.eye(n, dtype=dt)
        bad = ~d.isfinite().all(-1).all(-1)
        if px:
            bad |= ~self.flat(px, nb * n * n, dt).view(nb, n, n).isfinite().all(-1).all(-1)
        res = torch.where(bad, torch.full_like(bad, float("inf"), dtype=dt), d.abs().amax((-2, -1)))
        if ps:
            res = torch.where(self.flat(ps, nb, torch.int32) == 0, res, torch.zeros_like(res))
        part = self._part(pp, n, rows, dt)
        part[0].zero_()
        part[0][:, 0] = res

    def newton_step(self, dt, head, tail):
        pm, pt, ps, pp = head
        n, p, tol, rows = tail
        nb = self.nb
        m, t = self.flat(pm, nb * n * n, dt).view(nb, n, n), self.flat(pt, nb * n * n, dt).view(nb, n, n)
        state = self.flat(ps, nb, torch.int32)
        eye = torch.eye(n, dtype=dt)
        res = self._part(pp, n, rows, dt)[0].amax(-1)
        run = state == 0
        new = torch.where(run & res.isinf(), 2, torch.where(run & (res <= tol), 1, state)).to(torch.int32)
        state.copy_(new)
        t.copy_(torch.where((new == 0)[:, None, None], m * (-1 / p) + eye * ((p + 1) / p), eye))

    def newton_fused(self, dt, head, tail):
        px, pm, ps, pi = head
        n, p, iters, tol = tail
        nb = self.nb
        xo = self.flat(px, nb * n * n, dt).view(nb, n, n)
        x, m = xo.clone(), self.flat(pm, nb * n * n, dt).view(nb, n, n).clone()
        state = self.flat(ps, nb, torch.int32).clone()
        eye = torch.eye(n, dtype=dt)
        for k in range(iters):  # a stopped matrix leaves the loop: T = I changes nothing here
            res = (m - eye).abs().amax((-2, -1))
            state = torch.where((state == 0) & (res <= tol), 1, state).to(torch.int32)
            t = torch.where((state == 0)[:, None, None], m * (-1 / p) + eye * ((p + 1) / p), eye)
            x = x @ t
            if k + 1 < iters:
                m = torch.linalg.matrix_power(t, p) @ m
        xo.copy_(x)
        res = (m - eye).abs().amax((-2, -1))
        self.flat(pi, nb, torch.int32).copy_(torch.where((state == 1) | (res <= tol), 0, 1))

    def newton_finish(self, dt, head, tail):
        pp, ps, pi = head
        chunks, tol = tail
        nb = self.nb
        res = self.flat(pp, L._NEWTON_PARTS * nb * chunks, dt).view(L._NEWTON_PARTS, nb, chunks)[0].amax(-1)
        state = self.flat(ps, nb, torch.int32)
        info = torch.where((state == 2) | res.isinf(), 2, torch.where((state == 1) | (res <= tol), 0, 1))
        self.flat(pi, nb, torch.int32).copy_(info)

    def add_diag(self, dt, head, tail):
        pm, pw = head
        nb, n = tail
        m = self.flat(pm, nb * n * n, dt).view(nb, n, n)
        r = self.flat(pw, nb * (2 * n + 1), dt).view(nb, 2 * n + 1)[:, 2 * n]
        m.diagonal(dim1=-2, dim2=-1).add_(r[:, None])

    def eig_scale(self, dt, head, tail):
        pv, pw, ps, pi = head
        nb, n, expo, eps = tail
        e = np.arange(nb * n * n)  # the kernel's flat loop, index for index
        z, j = e // (n * n), e % n
        w = self.flat(pw, nb * n, dt).numpy()
        lmax = w[z * n + n - 1]
        r = eps * np.maximum(lmax, 0)
        d = np.maximum(w[z * n + j], 0) + r
        with np.errstate(divide="ignore", invalid="ignore"):  # the zero matrix: inf * 0, as on the GPU
            s = self.flat(pv, nb * n * n, dt).numpy() * d**expo
        self.flat(ps, nb * n * n, dt).copy_(torch.from_numpy(s))
        first = e % (n * n) == 0
        dmin = np.maximum(w[z * n], 0) + r
        bad = ~np.isfinite(lmax) | ((expo < 0) & ~(dmin > 0))
        self.flat(pi, nb, torch.int32).copy_(torch.from_numpy(np.where(bad, 2, 0)[first].astype(np.int32)))

    def kron_kernel(self, dt, head, tail):
        pa, pb, po = head
        rows, p0, p1, p2, p3, q0, q1, q2, q3 = tail
        vec = int(self.vec)
        a_mat, b_mat, W = p0 * p1 * p2 * p3, q0 * q1 * q2 * q3, p3 * q3
        nbatch = rows // (p0 * q0 * p1 * q1 * p2 * q2)
        A = self.flat(pa, nbatch * a_mat, dt).numpy()
        B = self.flat(pb, nbatch * b_mat, dt).numpy()
        out = self.flat(po, rows * W, dt)
        r = np.arange(rows)[:, None]  # the kernel's per-row decode and per-vector column split
        t = r
        o2, t = t % (p2 * q2), t // (p2 * q2)
        o1, t = t % (p1 * q1), t // (p1 * q1)
        o0, zb = t % (p0 * q0), t // (p0 * q0)
        abase = zb * a_mat + (((o0 // q0) * p1 + o1 // q1) * p2 + o2 // q2) * p3
        bbase = zb * b_mat + (((o0 % q0) * q1 + o1 % q1) * q2 + o2 % q2) * q3
        c = np.arange(W // vec)[None, :]
        qv = q3 // vec
        i3, k3 = c // qv, (c % qv) * vec
        vals = np.stack([A[abase + i3] * B[bbase + k3 + k] for k in range(vec)], axis=-1)
        out.copy_(torch.from_numpy(vals.reshape(-1)))


@pytest.mark.parametrize("sa,sb", [s for s in KRON_SHAPES if 0 not in s[0]] + [((3, 2), (2, 8)), ((5,), (4,))])
@pytest.mark.parametrize("batch_dims", [0, 1])
def test_kron_route_host_side_on_cpu(monkeypatch, sa, sb, batch_dims):
    fake = _FakeDevice()
    monkeypatch.setattr(L, "_empty", fake.empty)
    monkeypatch.setattr(L.KERNELS, "prepare", lambda name, grid, block, tail, *, device, shared_mem=0: (
        setattr(fake, "vec", name.split(",")[1].strip(" >")), fake.prepare(name, grid, block, tail, device=device))[1])
    monkeypatch.setattr(L, "current_stream", lambda device, torch_involved: None)
    monkeypatch.setattr(L, "_KRON_PLANS", L.PlanCache("test_kron", maxsize=4))
    rng = np.random.default_rng(14)
    if batch_dims:
        sa, sb = (3, *sa), (3, *sb)
    a, b = torch.from_numpy(rng.standard_normal(sa)).float(), torch.from_numpy(rng.standard_normal(sb)).float()
    fake.bases += [a, b]
    got = L._kron_gpu(a, b, batch_dims, "torch", 0, cukit.interop.DTYPES["float32"])
    np.testing.assert_array_equal(got.numpy(), L.kron_reference(a, b, batch_dims).numpy())
    again = L._kron_gpu(a, b, batch_dims, "torch", 0, cukit.interop.DTYPES["float32"])  # the cached plan
    np.testing.assert_array_equal(again.numpy(), got.numpy())


@pytest.mark.parametrize("expo", [-0.25, 0.5])
def test_eigh_route_host_side_on_cpu(monkeypatch, expo):
    from cukit.interop import DTYPES

    fake = _FakeDevice()
    monkeypatch.setattr(L, "_empty", fake.empty)
    monkeypatch.setattr(L.KERNELS, "prepare", fake.prepare)
    monkeypatch.setattr(L, "current_stream", lambda device, torch_involved: None)
    monkeypatch.setattr(L, "_eigh_gpu", lambda a, kind, device: torch.linalg.eigh(a))  # V column-major
    monkeypatch.setattr(L, "contiguous", lambda t, kind: fake.bases.append(c := t.contiguous()) or c)
    a = spd((4,), 7)
    a[2] = 0.0
    ta = torch.from_numpy(a)
    x, info = L._eigh_root_gpu(ta, "torch", 0, DTYPES["float64"], expo, 1e-3)
    xr, ir = L.eigh_root_reference(a, expo, 1e-3)
    assert info.tolist() == ir.tolist() == ([0, 0, 2, 0] if expo < 0 else [0, 0, 0, 0])
    good = [0, 1, 3]
    assert_close(x[good], xr[good], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 6, 7])
def test_matrix_power_host_side_on_cpu(monkeypatch, k):
    fake = _FakeDevice()
    monkeypatch.setattr(L, "_empty", fake.empty)
    monkeypatch.setattr(L, "device_of", lambda x: 0)
    monkeypatch.setattr(L, "_eye", lambda nb, n, like, kind: torch.eye(n, dtype=like.dtype).expand(nb, n, n).clone())
    a = torch.from_numpy(np.random.default_rng(15).standard_normal((2, 3, 5, 5)) / 2)
    assert_close(L.matrix_power(a, k), np.linalg.matrix_power(a.numpy(), k), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("root", [False, True])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_newton_route_host_side_on_cpu(monkeypatch, p, root, fused):
    from cukit.interop import DTYPES

    fake = _FakeDevice()
    launched: list[str] = []
    monkeypatch.setattr(L, "_empty", fake.empty)
    monkeypatch.setattr(L.KERNELS, "prepare", lambda name, *args, **kw: (
        launched.append(name.split("<")[0]), fake.prepare(name, *args, **kw))[1])
    monkeypatch.setattr(L, "current_stream", lambda device, torch_involved: None)
    monkeypatch.setattr(L, "_NEWTON_PLANS", L.PlanCache("test_newton", maxsize=4))
    monkeypatch.setattr(L, "_smem_optin", lambda device: 227 * 1024 if fused else 0)
    a = spd((3,), 9)
    fake.nb = 3
    fake.bases.append(ta := torch.from_numpy(a))
    tol = L.default_tol("float64", 9)
    x, info = L._newton_gpu(ta, "torch", 0, DTYPES["float64"], p, 1e-3, 20, tol, "ieee", root)
    xr, ir = L.newton_reference(a, p, 1e-3, 20, tol, root=root)
    assert info.tolist() == ir.tolist() == [0, 0, 0]
    assert_close(x, xr, atol=1e-12, rtol=1e-10)
    assert not any(x.data_ptr() == b.data_ptr() and b.numel() > x.numel() for b in fake.bases)  # no workspace view
    assert ("newton_fused" in launched) == fused and ("newton_step" in launched) != fused


def test_fused_tiles_fit_and_choose():
    from cukit.interop import DTYPES

    h100 = 227 * 1024
    for name, tiles in L._FUSED_TILES.items():
        dt = DTYPES[name]
        assert list(tiles) == sorted(tiles)
        assert L._fused_smem(tiles[-1], dt.itemsize) + 32 * dt.itemsize <= h100
        assert L._fused_smem(tiles[-1] + 32, dt.itemsize) > h100  # the next tile size would not fit
    f32, f64 = DTYPES["float32"], DTYPES["float64"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L, "_smem_optin", lambda device: h100)
        assert [L._fused_tile(n, f32, 0) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 0]
        assert [L._fused_tile(n, f64, 0) for n in (1, 33, 64, 96, 97)] == [32, 64, 64, 96, 0]
        mp.setattr(L, "_smem_optin", lambda device: 163 * 1024)  # A100: the largest float32 tile does not fit
        assert [L._fused_tile(n, f32, 0) for n in (64, 100)] == [64, 0]
