"""CuPy arrays in cukit.optim.functional and the utilities (multi_tensor_l2norm, nonfinite_flag):
the same numbers as torch tensors, the caller's arrays updated in place (state_steps included),
CuPy results for CuPy inputs, and the work queued on CuPy's current stream. GPU tests are marked
`gpu` (CuPy needs a CUDA device); `make gpu-check` runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cukit.optim as co
import numpy as np
import pytest
from cukit.optim import functional as F
from cukit.optim.utils import is_cupy, on_cupy_stream

import cukit

torch = pytest.importorskip("torch")

GPU = cukit.is_available() and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
SHAPES = [(5, 3), (0,), (7,), (33, 9), (130,)]


def test_is_cupy_and_the_stream_context_leave_torch_inputs_alone() -> None:
    t = torch.zeros(3)
    assert not is_cupy(t) and not is_cupy(np.zeros(3)) and not is_cupy([1.0])
    with on_cupy_stream([t, np.zeros(2)]):  # nothing to switch: no CuPy array
        pass


@pytest.fixture
def cp() -> Any:
    return pytest.importorskip("cupy")


def arrays(cp: Any, seed: int, dtype: str = "float32") -> list[Any]:
    rs = np.random.default_rng(seed)
    return [cp.asarray(rs.standard_normal(s).astype(dtype)) for s in SHAPES]


def twins(xs: list[Any]) -> list[torch.Tensor]:
    """torch CUDA copies (not views) of CuPy arrays."""
    return [torch.as_tensor(x.get(), device="cuda") for x in xs]


def assert_same(cupys: list[Any], tensors: list[torch.Tensor]) -> None:
    for i, (a, t) in enumerate(zip(cupys, tensors, strict=True)):
        np.testing.assert_array_equal(a.get(), t.cpu().numpy(), err_msg=f"tensor {i}")


FORMS: dict[str, tuple[Callable[..., None], int, bool, dict[str, Any]]] = {
    # name: (function, number of state lists, takes state_steps, hyperparameters)
    "adam": (F.adam, 2, True, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw": (F.adamw, 2, True, {"lr": 0.01, "max_grad_norm": 0.5}),
    "sgd": (F.sgd, 1, False, {"lr": 0.05, "momentum": 0.9}),
    "lion": (F.lion, 1, False, {"lr": 0.01}),
    "adagrad": (F.adagrad, 1, True, {"lr": 0.05}),
    "lamb": (F.lamb, 2, True, {"lr": 0.01}),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(FORMS))
def test_functional_on_cupy_equals_torch(cp: Any, name: str) -> None:
    """Three steps of each functional form on CuPy arrays and on torch copies: the same kernels, so
    the same bits; the CuPy arrays (params, states, step counts) are updated in place."""
    fn, n_states, has_steps, hyper = FORMS[name]
    params = arrays(cp, 0)
    states = [[cp.zeros_like(p) for p in params] for _ in range(n_states)]
    steps = [cp.zeros((), dtype=cp.float32) for _ in params] if has_steps else None
    tparams, tstates = twins(params), [twins(s) for s in states]
    tsteps = [torch.zeros((), device="cuda") for _ in params] if has_steps else None
    for k in range(3):
        grads = arrays(cp, 10 + k)
        tgrads = twins(grads)
        args: list[Any] = [params, grads, *states] + ([steps] if has_steps else [])
        targs: list[Any] = [tparams, tgrads, *tstates] + ([tsteps] if has_steps else [])
        fn(*args, **hyper)
        fn(*targs, **hyper)
    torch.cuda.synchronize()
    assert_same(params, tparams)
    for s, ts in zip(states, tstates, strict=True):
        assert_same(s, ts)
    assert any(float(abs(p).sum()) != float(abs(q).sum()) for p, q in zip(params, arrays(cp, 0), strict=True))
    if steps is not None:
        assert [float(s) for s in steps] == [3.0] * len(params)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_functional_runs_on_cupys_current_stream(cp: Any, name: str) -> None:
    """Gradients written on a non-default CuPy stream, the step, then the params read on that same
    stream, with no synchronisation in between: correct only if the step ran on that stream."""
    fn, n_states, has_steps, hyper = FORMS[name]
    params = arrays(cp, 1)
    tparams = twins(params)
    tstates = [[torch.zeros_like(p) for p in tparams] for _ in range(n_states)]
    tsteps = [torch.zeros((), device="cuda") for _ in params]
    tgrads = [torch.full_like(p, 0.25) for p in tparams]
    fn(tparams, tgrads, *tstates, *([tsteps] if has_steps else []), **hyper)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        states = [[cp.zeros_like(p) for p in params] for _ in range(n_states)]
        steps = [cp.zeros((), dtype=cp.float32) for _ in params]
        big = cp.ones(1 << 24, dtype=cp.float32)
        grads = []
        for p in params:
            for _ in range(4):  # keep the stream busy so a racing step would read unwritten grads
                big *= 1.0001
            grads.append(cp.full_like(p, 0.25))
        fn(params, grads, *states, *([steps] if has_steps else []), **hyper)
        with on_cupy_stream(params):
            assert torch.cuda.current_stream().cuda_stream == stream.ptr
        got = [cp.asnumpy(p, stream=stream) for p in params]
        stream.synchronize()
    torch.cuda.synchronize()
    for i, (g, t) in enumerate(zip(got, tparams, strict=True)):
        np.testing.assert_array_equal(g, t.cpu().numpy(), err_msg=f"param {i}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_l2norm_of_cupy_arrays_is_a_cupy_array(cp: Any, dtype: str) -> None:
    xs = arrays(cp, 2, dtype)
    total = co.multi_tensor_l2norm(xs)
    total2, per = co.multi_tensor_l2norm(xs, per_tensor=True)
    assert isinstance(total, cp.ndarray) and isinstance(per, cp.ndarray)
    assert total.dtype == cp.float32 and total.shape == () and per.shape == (len(xs),)
    want_per = np.array([np.linalg.norm(x.get().astype(np.float64)) for x in xs])
    rtol = 1e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(per.get(), want_per, rtol=rtol)
    np.testing.assert_allclose(float(total), np.linalg.norm(want_per), rtol=rtol)
    assert float(total2) == float(total)
    # the torch path gives the same numbers, as torch tensors
    t = co.multi_tensor_l2norm(twins(xs))
    assert isinstance(t, torch.Tensor) and float(t) == float(total)
    single = co.multi_tensor_l2norm(xs[3])
    assert isinstance(single, cp.ndarray)
    np.testing.assert_allclose(float(single), want_per[3], rtol=rtol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_nonfinite_flag_of_cupy_arrays(cp: Any, bad: float | None) -> None:
    xs = arrays(cp, 3)
    if bad is not None:
        xs[3][4, 2] = bad
    flag = co.nonfinite_flag(xs)
    assert isinstance(flag, cp.ndarray) and flag.shape == ()
    assert float(flag) == (0.0 if bad is None else 1.0)
    mixed = co.nonfinite_flag([xs[0], *twins(xs[1:])])  # not all CuPy: a torch result
    assert isinstance(mixed, torch.Tensor) and float(mixed) == float(flag)
