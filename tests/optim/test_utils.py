"""multi_tensor_l2norm, clip_grad_norm_ and nonfinite_flag against torch; the functional forms
against the classes; CUDA-graph capture and replay of a step against eager steps (GPU)."""

from __future__ import annotations

import cukit.optim as co
import pytest
from cukit.optim import functional as F

torch = pytest.importorskip("torch")


def tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(0,), (3,), (17, 5), (4097,), (1,), (70000,)]
    dts = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32, torch.float32]
    return [torch.randn(s, generator=g).to(device=device, dtype=d) for s, d in zip(shapes, dts, strict=True)]


def test_l2norm(device: str) -> None:
    ts = tensors(device)
    expected = torch.linalg.vector_norm(torch.stack([t.double().norm() for t in ts]))
    total, per = co.multi_tensor_l2norm(ts, per_tensor=True)
    assert total.dtype == torch.float32 and total.device == ts[0].device
    torch.testing.assert_close(total.double().cpu(), expected.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        per.double().cpu(), torch.stack([t.double().norm() for t in ts]).cpu(), rtol=1e-5, atol=1e-6
    )
    assert float(co.multi_tensor_l2norm([torch.zeros(0, device=device)])) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_l2norm_chunk_boundaries_and_misaligned_views(device: str, dtype: str) -> None:
    """Sizes around the chunk (16,384) and the kernel's unrolled trip (4 vectors per thread), views
    one element off alignment (the scalar path), and a non-finite value in each region of a chunk."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    sizes = [1, 4, 5, 2047, 2048, 8191, 8192, 8197, 16383, 16384, 16385, 3 * 16384 + 11]
    base = [torch.randn(n + 1, generator=g).to(device=device, dtype=dt) for n in sizes]
    ts = [b[: n] for b, n in zip(base, sizes, strict=True)] + [b[1:] for b in base]  # aligned, then off by one
    total, per = co.multi_tensor_l2norm(ts, per_tensor=True)
    want = torch.stack([t.double().norm() for t in ts])
    rtol = 1e-5 if dt in (torch.float32, torch.float64) else 1e-3
    torch.testing.assert_close(per.double().cpu(), want.cpu(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(total.double().cpu(), want.norm().cpu(), rtol=rtol, atol=1e-6)
    big = ts[len(sizes) - 1]
    for pos in (0, 5, 2048 * 4 + 3, 16383, 16384, big.numel() - 1):
        big[pos] = float("inf")
        assert float(co.nonfinite_flag(ts)) == 1.0, pos
        big[pos] = 0.0
    assert float(co.nonfinite_flag(ts)) == 0.0


def test_clip_grad_norm_matches_torch(device: str) -> None:
    ts = [t.float() for t in tensors(device)]
    a = [t.clone().requires_grad_() for t in ts]
    b = [t.clone().requires_grad_() for t in ts]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    na = torch.nn.utils.clip_grad_norm_(a, 1.0)
    nb = co.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(nb.double().cpu(), na.double().cpu(), rtol=1e-5, atol=1e-6)
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
    # max_norm above the norm: grads unchanged (coefficient clamped to 1)
    before = [q.grad.clone() for q in b]
    co.clip_grad_norm_(b, 1e6)
    assert all(torch.equal(x, q.grad) for x, q in zip(before, b, strict=True))


def test_nonfinite_flag(device: str) -> None:
    ts = tensors(device)
    assert float(co.nonfinite_flag(ts)) == 0.0
    ts[3][7] = float("nan")
    assert float(co.nonfinite_flag(ts)) == 1.0
    ts[3][7] = 0.0
    ts[5][-1] = float("-inf")
    assert float(co.nonfinite_flag(ts)) == 1.0


def test_bad_tensor_lists() -> None:
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        co.multi_tensor_l2norm([torch.zeros(2), [1.0, 2.0]])
    with pytest.raises(TypeError, match="float16"):
        co.nonfinite_flag([torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="same length"):
        F.adamw([torch.zeros(2)], [], [torch.zeros(2)], [torch.zeros(2)], [torch.tensor(0.0)])


def test_functional_matches_class(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).to(device) for s in [(3, 4), (0,), (9,)]]
    a = [p.clone() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    m = [torch.zeros_like(p) for p in a]
    v = [torch.zeros_like(p) for p in a]
    steps = [torch.tensor(0.0) for _ in a]
    opt = co.AdamW(b, lr=0.01, weight_decay=0.1)
    for _ in range(7):
        gs = [torch.randn(p.shape, generator=g).to(device) for p in ps]
        for q, gi in zip(b, gs, strict=True):
            q.grad = gi.clone()
        F.adamw(a, gs, m, v, steps, lr=0.01, weight_decay=0.1)
        opt.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y.detach())
    assert [float(s) for s in steps] == [7.0] * 3
    torch.testing.assert_close(m[0], opt.state[b[0]]["exp_avg"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["AdamW", "SGD", "LAMB"])
def test_cuda_graph_capture_replay_equals_eager(name: str) -> None:
    kw = {"momentum": 0.9} if name == "SGD" else {}
    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(s, device="cuda", generator=g) for s in [(64, 33), (0,), (5000,)]]
    a = [p.clone().requires_grad_() for p in base]
    b = [p.clone().requires_grad_() for p in base]
    oa = (
        getattr(co, name)(a, lr=torch.tensor(0.01, device="cuda"), capturable=True, **kw)
        if name != "SGD"
        else getattr(co, name)(a, lr=torch.tensor(0.01, device="cuda"), **kw)
    )
    ob = getattr(co, name)(b, lr=0.01, **kw)
    grads = [torch.randn_like(p) for p in a]
    for p, q, gi in zip(a, b, grads, strict=True):
        p.grad, q.grad = gi, gi.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compiles the kernels and builds the tables
        oa.step()
    torch.cuda.current_stream().wait_stream(s)
    ob.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oa.step()
    for _ in range(6):
        new = [torch.randn_like(p) for p in a]
        for p, q, gi in zip(a, b, new, strict=True):
            p.grad.copy_(gi)
            q.grad.copy_(gi)
        graph.replay()
        ob.step()
    torch.cuda.synchronize()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p.detach(), q.detach())
    if name != "SGD":
        assert float(oa.state[a[0]]["step"]) == float(ob.state[b[0]]["step"]) == 7.0
