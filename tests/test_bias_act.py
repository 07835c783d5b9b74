"""bias_act: y = act(x + bias). Every path against an independent float64 oracle (torch.nn.functional
on the CPU), forward and backward; the torch integration (autograd, opcheck, compile, CUDA graphs,
streams); bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cukit
from cukit.ops import bias_act as ba
from cukit.testing import arrays, assert_close, backend_dtypes, shapes, to_numpy

torch = pytest.importorskip("torch")
F = torch.nn.functional

ACTS = list(ba.ACTIVATIONS)
FLOATS = ["float16", "bfloat16", "float32", "float64"]

NUMPY_FLOATS = backend_dtypes("numpy", FLOATS)


# ------------------------------------------------------------------------------------- oracles
def oracle(x: np.ndarray, b: np.ndarray, activation: str) -> np.ndarray:
    """torch.nn.functional in float64: independent of cukit's own reference formulas."""
    z = torch.from_numpy(np.asarray(x, np.float64)) + torch.from_numpy(np.asarray(b, np.float64))
    fn = {
        "relu": F.relu,
        "gelu": lambda t: F.gelu(t, approximate="none"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[activation]
    return fn(z).numpy()


def oracle_backward(g: np.ndarray, x: np.ndarray, b: np.ndarray, activation: str):
    """(dx, dbias, |dx| summed like dbias) from torch autograd in float64."""
    xt = torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()
    bt = torch.from_numpy(np.asarray(b, np.float64)).requires_grad_()
    gt = torch.from_numpy(np.asarray(g, np.float64))
    fn = {
        "relu": F.relu,
        "gelu": lambda t: F.gelu(t, approximate="none"),
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[activation]
    y = fn(xt + bt)
    dx, db = torch.autograd.grad(y, (xt, bt), gt, allow_unused=True)
    dx = torch.zeros_like(xt) if dx is None else dx
    db = torch.zeros_like(bt) if db is None else db
    l1 = dx.abs().reshape(-1, x.shape[-1]).sum(0) if dx.numel() else torch.zeros_like(bt)
    return dx.numpy(), db.numpy(), l1.detach().numpy()


def check_dbias(actual, expected: np.ndarray, l1: np.ndarray, dtype: str, rows: int) -> None:
    """dbias is a sum of `rows` terms accumulated in float32 (float64 for float64): besides one
    rounding to the storage dtype, its error is bounded by rows * eps_acc * sum|terms| (Higham's
    gamma_n bound for any summation order), not by a multiple of the result."""
    from cukit.testing import tolerance

    atol, rtol = tolerance(dtype)
    eps_acc = np.finfo(np.float64 if dtype == "float64" else np.float32).eps
    a = to_numpy(actual).astype(np.float64)
    bound = atol + rtol * np.abs(expected) + (rows * eps_acc + rtol) * l1
    # A sum beyond the dtype's range rounds to inf (as torch's does): accept the inf of the right
    # sign wherever the exact sum is within the bound of the largest finite value.
    top = float(torch.finfo(getattr(torch, dtype)).max)
    overflow = np.isinf(a) & (np.sign(a) == np.sign(expected)) & (np.abs(expected) + bound >= top)
    err = np.where(overflow, 0.0, np.abs(a - expected))
    assert np.all(err <= bound), f"dbias off by {err.max()} (bound {bound[np.argmax(err - bound)]})"


def test_check_dbias_accepts_overflow_to_inf_only_past_the_range():
    # 32856 rows of 2.0 sum to 65712, beyond float16's 65504: the float16 result is inf.
    check_dbias(np.array([np.inf], np.float16), np.array([65712.0]), np.array([65712.0]), "float16", 32856)
    with pytest.raises(AssertionError):
        check_dbias(np.array([-np.inf], np.float16), np.array([65712.0]), np.array([65712.0]), "float16", 32856)
    with pytest.raises(AssertionError):
        check_dbias(np.array([np.inf], np.float16), np.array([600.0]), np.array([600.0]), "float16", 300)


def _rows(x) -> int:
    return int(np.prod(x.shape[:-1]))


# ----------------------------------------------------------------------- CPU fallbacks (CI)
@given(
    shape=shapes(min_dims=1, max_dims=3, max_side=40),
    dtype=st.sampled_from(NUMPY_FLOATS),
    activation=st.sampled_from(ACTS),
    noncontiguous=st.booleans(),
    data=st.data(),
)
def test_numpy_fallback_matches_oracle(shape, dtype, activation, noncontiguous, data):
    x = data.draw(arrays("numpy", dtype, shape, noncontiguous=noncontiguous))
    b = data.draw(arrays("numpy", dtype, shape[-1:]))
    y = cukit.bias_act(x, b, activation)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, oracle(to_numpy(x), to_numpy(b), activation), dtype=dtype)


@given(
    shape=shapes(min_dims=1, max_dims=3, max_side=40),
    dtype=st.sampled_from(FLOATS),
    activation=st.sampled_from(ACTS),
    noncontiguous=st.booleans(),
    data=st.data(),
)
def test_torch_cpu_fallback_matches_oracle(shape, dtype, activation, noncontiguous, data):
    x = data.draw(arrays("torch", dtype, shape, noncontiguous=noncontiguous))
    b = data.draw(arrays("torch", dtype, shape[-1:]))
    y = cukit.bias_act(x, b, activation)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    assert_close(y, oracle(to_numpy(x), to_numpy(b), activation), dtype=dtype)


@given(
    shape=shapes(min_dims=1, max_dims=3, max_side=30),
    dtype=st.sampled_from(["float32", "float64"]),
    activation=st.sampled_from(ACTS),
    data=st.data(),
)
def test_backward_references_match_autograd(shape, dtype, activation, data):
    x = data.draw(arrays("numpy", dtype, shape))
    b = data.draw(arrays("numpy", dtype, shape[-1:]))
    g = data.draw(arrays("numpy", dtype, shape))
    dx_ref, db_ref, l1 = oracle_backward(g, x, b, activation)
    dx, db = cukit.bias_act_backward(g, x, b, activation)  # NumPy reference
    assert_close(dx, dx_ref, dtype=dtype)
    check_dbias(db, db_ref, l1, dtype, _rows(x))
    tdx, tdb = cukit.bias_act_backward(torch.from_numpy(g), torch.from_numpy(x), torch.from_numpy(b), activation)
    assert_close(tdx, dx_ref, dtype=dtype)
    check_dbias(tdb, db_ref, l1, dtype, _rows(x))


@pytest.mark.parametrize("activation", ACTS)
def test_cpu_autograd_gradcheck(activation):
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    if activation == "relu":  # keep clear of the kink at 0, where finite differences disagree
        with torch.no_grad():
            x.copy_(x.sign() * (x.abs() + 0.1))
            b.zero_()
    assert torch.autograd.gradcheck(lambda x, b: cukit.bias_act(x, b, activation), (x, b))


def test_cpu_opcheck():
    x = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.bias_act.default, (x, b, "gelu"))
    torch.library.opcheck(torch.ops.cukit.bias_act_backward.default, (torch.randn(4, 6), x.detach(), b.detach(), "silu"))


def test_cpu_torch_compile_fullgraph(compile_policy: str):
    def f(x, b):
        return cukit.bias_act(x * 2, b, "silu").sum()

    x = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, b)
    out.backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    f(x2, b2).backward()
    assert_close(out, f(x2, b2))
    assert_close(x.grad, x2.grad)
    assert_close(b.grad, b2.grad)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
def test_size_zero(shape):
    for x, b in [
        (np.zeros(shape, np.float32), np.zeros(shape[-1:], np.float32)),
        (torch.zeros(shape), torch.zeros(shape[-1:])),
    ]:
        y = cukit.bias_act(x, b, "gelu")
        assert tuple(y.shape) == shape
        dx, db = cukit.bias_act_backward(y, x, b, "gelu")
        assert tuple(dx.shape) == shape and tuple(db.shape) == shape[-1:]
        assert float(np.abs(to_numpy(db)).sum()) == 0.0


def test_module_matches_functional_and_learns():
    m = cukit.nn.BiasAct(6, "gelu_tanh", dtype=torch.float64)
    with torch.no_grad():
        m.bias.copy_(torch.randn(6, dtype=torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64)
    y = m(x)
    assert_close(y, oracle(x.numpy(), m.bias.detach().numpy(), "gelu_tanh"))
    y.sum().backward()
    assert m.bias.grad is not None and m.bias.grad.shape == (6,)
    assert "gelu_tanh" in repr(m)


# ----------------------------------------------------------------------------------- errors
def test_bad_input_raises_clear_errors():
    x = np.zeros((2, 3), np.float32)
    b = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="activation must be one of"):
        cukit.bias_act(x, b, "tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        cukit.bias_act(x, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"bias must have shape"):
        cukit.bias_act(x, np.zeros((1, 3), np.float32))
    with pytest.raises(TypeError, match="bias must have x's dtype float32; got float64"):
        cukit.bias_act(x, np.zeros(3))
    with pytest.raises(TypeError, match=r"cukit\.bias_act: x must have dtype float16, bfloat16, float32 or float64; got int32"):
        cukit.bias_act(np.zeros((2, 3), np.int32), np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="bias must be the same array type as x"):
        cukit.bias_act(x, torch.zeros(3))
    with pytest.raises(ValueError, match="at least one dimension"):
        cukit.bias_act(np.ones((), np.float32), np.zeros(1, np.float32))
    with pytest.raises(TypeError, match=r"cukit\.bias_act: x must be an array-like convertible to a numeric array; got dict"):
        cukit.bias_act({}, b)
    with pytest.raises(ValueError, match=r"bias_act_backward: grad must have x.s shape \(2, 3\); got \(2, 2\)"):
        cukit.bias_act_backward(np.zeros((2, 2), np.float32), x, b)
    with pytest.raises(TypeError, match=r"x must have dtype float16, bfloat16, float32 or float64; got complex128"):
        cukit.bias_act(np.zeros((2, 3), np.complex128), np.zeros(3, np.complex128))


# ------------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = ["cupy", "torch-cuda"]


@pytest.mark.gpu
@given(
    backend=st.sampled_from(GPU_BACKENDS),
    shape=shapes(min_dims=1, max_dims=3, max_side=300, max_elements=60_000),
    dtype=st.sampled_from(FLOATS),
    activation=st.sampled_from(ACTS),
    noncontiguous=st.booleans(),
    data=st.data(),
)
def test_gpu_forward_backward_match_oracle(backend, shape, dtype, activation, noncontiguous, data):
    if dtype not in backend_dtypes(backend):
        return
    x = data.draw(arrays(backend, dtype, shape, noncontiguous=noncontiguous))
    b = data.draw(arrays(backend, dtype, shape[-1:]))
    g = data.draw(arrays(backend, dtype, shape))
    xn, bn, gn = to_numpy(x), to_numpy(b), to_numpy(g)
    y = cukit.bias_act(x, b, activation)
    assert type(y) is type(x) and str(y.dtype) == str(x.dtype)
    assert_close(y, oracle(xn, bn, activation), dtype=dtype)
    dx, db = cukit.bias_act_backward(g, x, b, activation)
    dx_ref, db_ref, l1 = oracle_backward(gn, xn, bn, activation)
    assert_close(dx, dx_ref, dtype=dtype)
    check_dbias(db, db_ref, l1, dtype, _rows(x))


def _cuda(shape, dtype, offset=0, scale=2.0):
    """A contiguous CUDA tensor whose data starts `offset` elements into its buffer (offset=1
    breaks 16-byte alignment and forces the scalar path)."""
    n = int(np.prod(shape))
    buf = torch.randn(n + offset, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)
    return buf[offset:].view(shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("shape", [(3, 1), (5, 3), (1031, 8), (4099, 1024), (7, 33, 520), (2, 65536)])
def test_gpu_vector_and_scalar_paths(dtype, offset, shape):
    x = _cuda(shape, dtype, offset)
    b = _cuda(shape[-1:], dtype, offset)
    g = _cuda(shape, dtype, offset)
    dname = str(dtype).removeprefix("torch.")
    for act in ACTS:
        y = cukit.bias_act(x, b, act)
        assert_close(y, oracle(to_numpy(x), to_numpy(b), act), dtype=dname)
        dx, db = cukit.bias_act_backward(g, x, b, act)
        dx_ref, db_ref, l1 = oracle_backward(to_numpy(g), to_numpy(x), to_numpy(b), act)
        assert_close(dx, dx_ref, dtype=dname)
        check_dbias(db, db_ref, l1, dname, _rows(x))


@pytest.mark.gpu
def test_gpu_every_output_element_is_written():
    # A poisoned output buffer would show through if any element were skipped.
    x = _cuda((1234, 77), torch.float32)
    b = _cuda((77,), torch.float32)
    for act in ACTS:
        y = cukit.bias_act(x, b, act)
        assert torch.isfinite(y).all()
        assert_close(y, oracle(to_numpy(x), to_numpy(b), act), dtype="float32")


@pytest.mark.gpu
def test_gpu_rows_past_the_grid_y_limit():
    # The row kernel's grid covers the rows in one trip up to 65,535 row blocks; past that its
    # row-stride loop takes the rest. 2,048 bfloat16 columns make one row per block.
    rows = 65535 + 7
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    y = cukit.bias_act(x, b, "relu")
    assert torch.equal(y, (x.float() + b.float()).relu().to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape, one_launch", [((64, 256), True), ((2, 3, 40), True), ((129, 7), True),
                                               ((4096, 256), False), ((3000, 7), False)])
def test_gpu_backward_one_launch_for_small_problems(dtype, shape, one_launch):
    # Small problems sum whole columns in one launch and write dbias themselves; large ones take
    # per-split partial sums and a second, reducing launch. Both must match the oracle, on the
    # first call (plan built) and on the cached call, bitwise alike.
    from cukit.ops import bias_act as op

    x, b, g = _cuda(shape, dtype), _cuda(shape[-1:], dtype), _cuda(shape, dtype)
    dname = str(dtype).removeprefix("torch.")
    op._BWD_PLANS.clear()
    first = cukit.bias_act_backward(g, x, b, "gelu")
    (plan,) = op._BWD_PLANS._data.values()
    assert (plan.reduce is None) == one_launch and (plan.splits == 1) == one_launch
    again = cukit.bias_act_backward(g, x, b, "gelu")
    assert op._BWD_PLANS.hits >= 1
    dx_ref, db_ref, l1 = oracle_backward(to_numpy(g), to_numpy(x), to_numpy(b), "gelu")
    for dx, db in (first, again):
        assert db.dtype == dtype and db.shape == shape[-1:]
        assert_close(dx, dx_ref, dtype=dname)
        check_dbias(db, db_ref, l1, dname, _rows(x))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.gpu
def test_gpu_dbias_is_deterministic():
    x = _cuda((8192, 1000), torch.float32)
    b = _cuda((1000,), torch.float32)
    g = _cuda((8192, 1000), torch.float32)
    runs = [cukit.bias_act_backward(g, x, b, "gelu")[1] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
def test_gpu_gradcheck_float64(activation):
    x = torch.randn(17, 24, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, device="cuda", requires_grad=True)
    if activation == "relu":
        with torch.no_grad():
            x.copy_(x.sign() * (x.abs() + 0.1))
            b.zero_()
    assert torch.autograd.gradcheck(lambda x, b: cukit.bias_act(x, b, activation), (x, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_opcheck(dtype):
    x = torch.randn(33, 64, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(64, device="cuda", dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.cukit.bias_act.default, (x, b, "gelu"))
    g = torch.randn(33, 64, device="cuda", dtype=dtype)
    torch.library.opcheck(torch.ops.cukit.bias_act_backward.default, (g, x.detach(), b.detach(), "gelu_tanh"))


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_inductor(compile_policy: str):
    def f(x, b):
        h = cukit.bias_act(x @ x.T, b, "gelu")
        return (h * h).mean()

    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    b = torch.randn(64, device="cuda", requires_grad=True)
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x, b)
    out.backward()
    x2, b2 = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = f(x2, b2)
    ref.backward()
    assert_close(out, ref, dtype="float32")
    assert_close(x.grad, x2.grad, dtype="float32")
    assert_close(b.grad, b2.grad, dtype="float32")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    b = torch.randn(256, device="cuda", requires_grad=True)
    g = torch.randn(512, 256, device="cuda")
    # Warm up on a side stream (compiles the kernels, as capture requires), then capture
    # forward + backward through autograd.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            x.grad = b.grad = None
            cukit.bias_act(x, b, "silu").backward(g)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cukit.bias_act(x, b, "silu")
        y.backward(g)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        b.copy_(torch.randn_like(b))
    graph.replay()
    torch.cuda.synchronize()
    xn, bn = to_numpy(x), to_numpy(b)
    assert_close(y, oracle(xn, bn, "silu"), dtype="float32")
    dx_ref, db_ref, l1 = oracle_backward(to_numpy(g), xn, bn, "silu")
    assert_close(x.grad, dx_ref, dtype="float32")
    check_dbias(b.grad, db_ref, l1, "float32", _rows(x))
    # the no-grad fast path captures too
    xs = torch.randn(300, 100, device="cuda")
    bs = torch.randn(100, device="cuda")
    cukit.bias_act(xs, bs, "gelu")
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        ys = cukit.bias_act(xs, bs, "gelu")
    xs.copy_(torch.randn_like(xs))
    graph2.replay()
    torch.cuda.synchronize()
    assert_close(ys, oracle(to_numpy(xs), to_numpy(bs), "gelu"), dtype="float32")


@pytest.mark.gpu
def test_gpu_launches_on_torchs_current_stream():
    # x is written on a side stream after a long sleep; bias_act queued on the same stream must see
    # the new values. A launch on any other stream would read x before the copy lands.
    n, c = 4096, 1024
    src = torch.randn(n, c, device="cuda")
    x = torch.zeros(n, c, device="cuda")
    b = torch.randn(c, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.copy_(src)
        y = cukit.bias_act(x, b, "relu")
        dx, _ = cukit.bias_act_backward(src, x, b, "relu")
    torch.cuda.synchronize()
    assert_close(y, oracle(to_numpy(src), to_numpy(b), "relu"), dtype="float32")
    assert_close(dx, oracle_backward(to_numpy(src), to_numpy(src), to_numpy(b), "relu")[0], dtype="float32")


@pytest.mark.gpu
def test_gpu_cupy_launches_on_cupys_current_stream():
    import cupy

    src = cupy.random.standard_normal((2048, 512), dtype=cupy.float32)
    b = cupy.random.standard_normal(512, dtype=cupy.float32)
    x = cupy.zeros_like(src)
    cupy.cuda.Device().synchronize()
    with cupy.cuda.Stream(non_blocking=True) as s:
        cupy.cuda.runtime.memcpyAsync(x.data.ptr, src.data.ptr, src.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, s.ptr)
        y = cukit.bias_act(x, b, "gelu")
    s.synchronize()
    assert_close(y, oracle(to_numpy(src), to_numpy(b), "gelu"), dtype="float32")


@pytest.mark.gpu
def test_gpu_mixed_devices_are_rejected():
    x = torch.randn(4, 3, device="cuda")
    with pytest.raises(ValueError, match="same device"):
        cukit.bias_act(x, torch.randn(3), "relu")
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="same device"):
            cukit.bias_act(x, torch.randn(3, device="cuda:1"), "relu")


@pytest.mark.gpu
@pytest.mark.skipif("torch.cuda.device_count() < 2")
def test_gpu_second_device():
    x = torch.randn(64, 48, device="cuda:1")
    b = torch.randn(48, device="cuda:1")
    y = cukit.bias_act(x, b, "gelu")
    assert y.device == x.device
    assert_close(y, oracle(to_numpy(x), to_numpy(b), "gelu"), dtype="float32")


@pytest.mark.gpu
def test_gpu_requires_grad_fast_path_is_not_taken():
    x = torch.randn(8, 4, device="cuda", requires_grad=True)
    b = torch.randn(4, device="cuda")
    y = cukit.bias_act(x, b, "gelu")
    assert y.grad_fn is not None
    with torch.no_grad():
        assert cukit.bias_act(x, b, "gelu").grad_fn is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_nan_and_inf_propagate_like_torch(dtype):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 3.0]], device="cuda", dtype=dtype)
    b = torch.zeros(8, device="cuda", dtype=dtype)
    for act in ACTS:
        y = cukit.bias_act(x, b, act)
        ref = torch.from_numpy(oracle(x.float().cpu().numpy(), b.float().cpu().numpy(), act)).to(dtype)
        assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref)), act
        finite = ~torch.isnan(ref)
        assert_close(y.cpu()[finite], ref[finite], dtype=str(dtype).removeprefix("torch."))
