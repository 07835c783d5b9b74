"""cukit.optim's 8-bit and 4-bit optimizers (optim/lowbit.py).

- the code tables and blockwise quantisation against an independent NumPy implementation
  (nearest code by argmin of the distance), round trips, odd sizes, zero and NaN blocks;
- each optimizer, step by step, against a textbook loop written here: decode with the public
  functions, the float32 twin's formula in float64-free plain torch, encode (the reference path on
  "cpu", the kernels on "cuda": a kernel may round an update differently in the last bit, which
  can move a value across a midpoint, so codes are compared up to a small fraction of neighbours);
- the layout (min_8bit_size by the parameter's size, bitsandbytes' names and shapes), state bytes
  per parameter, state_dicts both ways and bitsandbytes' form, residual master weights, GradScaler's
  skipped step, tensor lr, and the argument errors.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from cukit.optim import lowbit as lb  # noqa: E402

CLASSES = ["AdamW8bit", "Adam8bit", "AdamW4bit", "Lion8bit", "SGD8bit"]


# ---------------------------------------------------------------- code tables and quantisation
def np_quantize(x: np.ndarray, code: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Nearest code by argmin of |x / absmax - code| (first minimum: ties to the lower code)."""
    n = x.size
    nb = -(-n // block)
    pad = np.zeros(nb * block, np.float32)
    pad[:n] = x
    blocks = pad.reshape(nb, block)
    absmax = np.abs(blocks).max(axis=1)
    xn = np.where(absmax[:, None] > 0, blocks / np.where(absmax > 0, absmax, 1)[:, None], 0).astype(np.float32)
    idx = np.abs(xn.reshape(-1, 1) - code.reshape(1, -1)).argmin(axis=1)[:n]
    return idx.astype(np.uint8), absmax


def test_maps_are_sorted_and_span_the_range() -> None:
    for signed, bits, size in ((True, 8, 256), (False, 8, 256), (True, 4, 16)):
        m = lb.dynamic_map(signed, bits)
        assert m.numel() == size and m.dtype == torch.float32
        assert torch.all(m[1:] >= m[:-1]) and m[-1] == 1.0 and (m == 0).any()
        assert (m.min() < -0.85) if signed else (m.min() == 0)
    lin = lb.linear_map(4)
    assert lin.numel() == 16 and lin[0] == 1 / 16 and lin[-1] == 1 and not (lin == 0).any()
    with pytest.raises(ValueError, match="dynamic_map: bits must be 4 or 8"):
        lb.dynamic_map(True, 3)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 1300), scale=st.sampled_from([1e-8, 1.0, 1e4]), signed=st.booleans(),
       bits=st.sampled_from([8, 4]), seed=st.integers(0, 2**16))
def test_quantize_matches_numpy_argmin(n: int, scale: float, signed: bool, bits: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if not signed:
        x = np.abs(x)
    if n > 300:
        x[128:256] = 0  # a zero block for either block size
    code = lb.dynamic_map(signed, bits) if (signed or bits == 8) else lb.linear_map(4)
    block = 256 if bits == 8 else 128
    codes, absmax = lb.quantize_blockwise(torch.from_numpy(x), code, block, bits)
    want, want_max = np_quantize(x, code.numpy(), block)
    assert np.array_equal(absmax.numpy(), want_max)
    got = codes.numpy()
    if bits == 4:
        assert got.size == -(-n // 2)
        got = np.stack([got & 0xF, got >> 4], axis=1).reshape(-1)[:n]
        if n % 2:
            assert (codes[-1] >> 4) == 0  # the padding nibble
    assert np.array_equal(got, want)
    back = lb.dequantize_blockwise(codes, absmax, code, block, n, bits)
    gap = max(float((code[1:] - code[:-1]).max()), 2 * float(code[0]))  # the linear map has no zero
    scale_of = np.repeat(want_max, block)[:n]
    assert np.all(np.abs(back.numpy() - x) <= scale_of * (gap / 2 * (1 + 1e-5) + 1e-6))


@pytest.mark.parametrize("which", ["signed8", "unsigned8", "signed4", "linear4"])
def test_bucket_search_finds_the_nearest_code(which: str) -> None:
    """The kernels' encoder (QCodec::encode) emulated: start at the bucket table's entry, step up
    while the next midpoint is below the value; equal to searchsorted over the midpoints for values
    across 10 decades, both zeros and the ends, in one step."""
    code = {"signed8": lb.dynamic_map(True), "unsigned8": lb.dynamic_map(False),
            "signed4": lb.dynamic_map(True, 4), "linear4": lb.linear_map(4)}[which]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(100_000, generator=gen) * 10.0 ** torch.randint(-9, 1, (100_000,), generator=gen)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-25, -(2.0**-25), 2.0**-24])]).clamp(-1, 1)
    if code.min() >= 0:
        x = x.abs()
    mids = lb._midpoints(code).numpy()
    table = lb.bucket_table(code).numpy().astype(np.int64)
    assert table.size == 2 * lb._BUCKETS
    u = x.view(torch.int32).numpy().astype(np.int64) & 0xFFFFFFFF
    b = np.clip(((u & 0x7FFFFFFF) >> lb._BUCKET_SHIFT) - lb._BUCKET_LO, 0, lb._BUCKETS - 1)
    lo = table[(u >> 31) * lb._BUCKETS + b]
    sentinel = np.append(mids, np.inf)  # the kernels' table: +inf after the last midpoint
    lo = lo + (sentinel[lo] < x.numpy())  # QCodec::kSteps = 1 compare
    assert np.array_equal(lo, torch.searchsorted(lb._midpoints(code), x, right=False).numpy())


def test_nan_block_decodes_to_nan() -> None:
    x = torch.randn(600)
    x[300] = float("nan")
    codes, absmax = lb.quantize_blockwise(x, lb.dynamic_map(), 256)
    assert torch.isnan(absmax[1]) and not torch.isnan(absmax[[0, 2]]).any()
    back = lb.dequantize_blockwise(codes, absmax, lb.dynamic_map(), 256, 600)
    assert torch.isnan(back[256:512]).all() and not torch.isnan(back[:256]).any()


def test_residual_weights_round_trip() -> None:
    w = torch.cat([torch.randn(10_000) * 10.0 ** torch.randint(-30, 30, (10_000,)), torch.zeros(3)])
    p, r = lb.split_residual(w)
    back = lb.residual_weights(p, r)
    ulp = lb._bf16_ulp(p)
    assert torch.all((back - w).abs() <= ulp / 254 * 0.5 + 1e-45)
    assert p.dtype == torch.bfloat16 and r.dtype == torch.int8


# ---------------------------------------------------------------- textbook loops
def textbook(name: str, kw: dict[str, Any]) -> Any:
    """One step of `name` on (w float32, g, decoded states, step) by the formulas, with torch ops."""
    r = lambda x: float(np.float32(x))  # noqa: E731  hyperparameters as a float32 launch sees them
    lr = r(kw.get("lr", 1e-3))

    def adam(w: torch.Tensor, g: torch.Tensor, s: list[torch.Tensor], t: int) -> None:
        b1, b2 = (r(b) for b in kw.get("betas", (0.9, 0.999)))
        eps, wd = r(kw.get("eps", 1e-8)), r(kw.get("weight_decay", 1e-2 if name != "Adam8bit" else 0.0))
        if name == "Adam8bit":
            g = g + wd * w
        else:
            w.mul_(1 - lr * wd)
        s[0].add_((1 - b1) * (g - s[0]))
        s[1].mul_(b2).add_((1 - b2) * g * g)
        denom = s[1].sqrt() / (1 - b2**t) ** 0.5 + eps
        w.sub_(lr / (1 - b1**t) * (s[0] / denom))

    def lion(w: torch.Tensor, g: torch.Tensor, s: list[torch.Tensor], t: int) -> None:
        b1, b2 = (r(b) for b in kw.get("betas", (0.9, 0.99)))
        w.mul_(1 - lr * r(kw.get("weight_decay", 0.0)))
        w.sub_(lr * torch.sign(b1 * s[0] + (1 - b1) * g))
        s[0].mul_(b2).add_((1 - b2) * g)

    def sgd(w: torch.Tensor, g: torch.Tensor, s: list[torch.Tensor], t: int) -> None:
        mom = r(kw.get("momentum", 0.9))
        g = g + r(kw.get("weight_decay", 0.0)) * w
        if t == 1:
            s[0].copy_(g)
        else:
            s[0].mul_(mom).add_(g)
        w.sub_(lr * (g + mom * s[0] if kw.get("nesterov") else s[0]))

    return {"AdamW8bit": adam, "Adam8bit": adam, "AdamW4bit": adam, "Lion8bit": lion, "SGD8bit": sgd}[name]


def _codes(cls: type, bits: int) -> list[torch.Tensor]:
    n = len(cls.spec.qstates)
    if bits == 8:
        return [lb.dynamic_map(s, 8) for _, s in cls.spec.qstates][:n]
    return [lb.dynamic_map(True, 4) if s else lb.linear_map(4) for _, s in cls.spec.qstates]


CASES = [
    ("AdamW8bit", {"lr": 0.01}),
    ("AdamW8bit", {"lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}),
    ("Adam8bit", {"lr": 0.01, "weight_decay": 0.05}),
    ("AdamW4bit", {"lr": 0.01}),
    ("Lion8bit", {"lr": 0.003, "weight_decay": 0.1}),
    ("SGD8bit", {"lr": 0.05, "momentum": 0.9}),
    ("SGD8bit", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
]
SHAPES = [(5000,), (64, 100), (4097,), (10, 10), (129, 33)]  # odd tails, one under min_8bit_size


@pytest.mark.parametrize(("name", "kw"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_match_textbook(device: str, name: str, kw: dict[str, Any], dtype: torch.dtype) -> None:
    """Each step from the optimizer's own previous state: the codes it stores equal the textbook's
    encoding of the textbook update (but for values a last-bit difference moves across a midpoint:
    at most 1 in 200, to a neighbouring code), the weights agree to float32 rounding where the
    codes agree."""
    cls = getattr(lb, name)
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]
    opt = cls(ps, min_8bit_size=2000, **kw)
    step = textbook(name, kw)
    bits, block = cls.spec.bits, (256 if cls.spec.bits == 8 else 128)
    codes = _codes(cls, bits)
    for t in range(1, 6):
        before = copy.deepcopy({i: {k: v for k, v in opt.state[p].items()} for i, p in enumerate(ps)})
        w0 = [p.detach().float().cpu().clone() for p in ps]
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.to(device=device, dtype=dtype)
        opt.step()
        for i, p in enumerate(ps):
            g = grads[i].to(dtype).float()
            quant = p.numel() >= 2000
            st = before.get(i, {})
            k = len(cls.spec.qstates)
            if t == 1 or not st:
                states = [torch.zeros(p.numel()) for _ in range(k)]
            elif quant:
                states = [lb.dequantize_blockwise(st[f"state{j + 1}"].cpu(), st[f"absmax{j + 1}"].cpu(), codes[j],
                                                  block, p.numel(), bits) for j in range(k)]
            else:
                states = [st[f"state{j + 1}"].float().cpu().reshape(-1).clone() for j in range(k)]
            w = w0[i].reshape(-1).clone()
            step(w, g.reshape(-1), states, t)
            now = opt.state[p]
            if quant:
                assert now["state1"].dtype == torch.uint8
                agree = torch.ones(p.numel(), dtype=torch.bool)
                for j in range(k):
                    want, want_max = lb.quantize_blockwise(states[j], codes[j], block, bits)
                    got = now[f"state{j + 1}"].cpu().reshape(-1)
                    torch.testing.assert_close(now[f"absmax{j + 1}"].cpu(), want_max, rtol=1e-5, atol=1e-30)
                    if bits == 4:
                        got = torch.stack([got & 0xF, got >> 4], 1).reshape(-1)[: p.numel()]
                        want = torch.stack([want & 0xF, want >> 4], 1).reshape(-1)[: p.numel()]
                    diff = (got.int() - want.int()).abs()
                    assert int((diff > 1).sum()) == 0, (name, t, i, j)
                    assert float((diff != 0).float().mean()) <= 0.005, (name, t, i, j)
                    agree &= diff == 0
            else:
                assert now["state1"].dtype == torch.float32
                agree = torch.ones(p.numel(), dtype=torch.bool)
                for j in range(k):
                    torch.testing.assert_close(now[f"state{j + 1}"].cpu().reshape(-1), states[j], rtol=1e-5, atol=1e-6)
            got_w = p.detach().float().cpu().reshape(-1)
            want_w = w.to(dtype).float()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got_w[agree], want_w[agree], rtol=tol, atol=tol * 1e-1)


# ---------------------------------------------------------------- layout, bytes, state_dicts
def test_layout_follows_bitsandbytes() -> None:
    big, small = torch.zeros(5000, requires_grad=True), torch.zeros(10, 10, requires_grad=True)
    opt = lb.AdamW8bit([big, small])
    for p in (big, small):
        p.grad = torch.ones_like(p)
    opt.step()
    s = opt.state[big]
    assert s["state1"].shape == (5000,) and s["state1"].dtype == torch.uint8
    assert s["absmax1"].shape == (20,) and s["qmap1"].shape == (256,) and s["qmap2"].min() == 0
    assert opt.state[small]["state1"].dtype == torch.float32  # under min_8bit_size: float32
    four = torch.zeros(5001, requires_grad=True)
    o4 = lb.AdamW4bit([four])
    four.grad = torch.ones_like(four)
    o4.step()
    assert o4.state[four]["state1"].shape == (2501,) and o4.state[four]["absmax2"].shape == (40,)


def state_bytes(opt: Any) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k not in ("step", "qmap1", "qmap2"))


def gpt2_small_shapes(layers: int = 2) -> list[tuple[int, ...]]:
    d = 768
    per = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [(50257, d), (1024, d), *(per * layers), (d,), (d,)]


@pytest.mark.parametrize(("name", "most"), [("AdamW8bit", 2.1), ("AdamW4bit", 1.1)])
def test_state_bytes_per_parameter(name: str, most: float) -> None:
    ps = [torch.zeros(s, requires_grad=True) for s in gpt2_small_shapes()]
    opt = getattr(lb, name)(ps)
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    n = sum(p.numel() for p in ps)
    assert state_bytes(opt) / n <= most


def test_state_dict_round_trip_and_bitsandbytes_form(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(s, generator=gen) for s in ((5000,), (30,))]
    a = [p.clone().to(device).requires_grad_() for p in base]
    b = [p.clone().to(device).requires_grad_() for p in base]
    oa = lb.AdamW8bit(a, lr=0.01)
    for _ in range(3):
        for p in a:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        oa.step()
    sd = oa.state_dict()
    bnb = lb.to_bitsandbytes(sd)
    st = bnb["state"][0]
    assert isinstance(st["step"], int) and set(st["__bnb_optimizer_quant_state__"]) >= {"state1", "absmax2", "qmap1"}
    with torch.no_grad():
        for p, q in zip(a, b, strict=True):
            q.copy_(p)
    for form in (sd, bnb):
        ob = lb.AdamW8bit(b, lr=0.01)
        ob.load_state_dict(form)
        assert ob.state[b[0]]["state1"].dtype == torch.uint8 and ob.state[b[0]]["absmax1"].dtype == torch.float32
        for k in ("state1", "state2", "absmax1", "absmax2"):
            assert torch.equal(ob.state[b[0]][k], oa.state[a[0]][k])
        assert float(ob.state[b[0]]["step"]) == 3.0
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in a]
    for ps, o in ((a, oa), (b, ob)):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        o.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


def test_loading_another_layout_is_a_value_error() -> None:
    p = torch.zeros(3000, requires_grad=True)
    o = lb.AdamW8bit([p], min_8bit_size=100)
    p.grad = torch.ones_like(p)
    o.step()
    with pytest.raises(ValueError, match=r"AdamW8bit: state 'state1' .* torch.uint8 elements; .* keeps 3000 float32 \(min_8bit_size=4096"):
        lb.AdamW8bit([p]).load_state_dict(o.state_dict())


def test_residual_master_weights_track_float32_masters(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6000, generator=gen)
    a = base.to(device=device, dtype=torch.bfloat16).requires_grad_()
    b = base.to(device=device, dtype=torch.bfloat16).requires_grad_()
    oa = lb.AdamW8bit([a], lr=1e-4, master_weights=True)
    ob = lb.AdamW8bit([b], lr=1e-4, master_weights="residual")
    for _ in range(20):
        g = torch.randn(6000, generator=gen).to(device=device, dtype=torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    master = oa.state[a]["master_param"].float().cpu()
    rebuilt = lb.residual_weights(b.detach().cpu(), ob.state[b]["master_residual"].cpu())
    # bf16 alone would sit ~1e-2 relative away; with the residual, a few 1e-5 (codes may differ)
    assert float((rebuilt - master).abs().max()) <= 1e-4 * float(master.abs().max())
    assert not torch.equal(b.detach().float().cpu(), master)
    assert ob.state[b]["master_residual"].dtype == torch.int8


@pytest.mark.parametrize("name", CLASSES)
def test_found_inf_skips_and_grad_scale_unscales(device: str, name: str) -> None:
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=gen) for s in ((5000,), (9,))]
    a = [p.to(device).requires_grad_() for p in base]
    b = [p.to(device).requires_grad_() for p in base]
    oa, ob = getattr(lb, name)(a, lr=0.01), getattr(lb, name)(b, lr=0.01)
    scale = torch.tensor(256.0, device=device)
    for _ in range(3):
        gs = [torch.randn(p.shape, generator=gen).to(device) for p in a]
        for p, q, g in zip(a, b, gs, strict=True):
            p.grad, q.grad = g.clone(), g * 256.0
        oa.step()
        ob.grad_scale, ob.found_inf = scale, torch.zeros((), device=device)
        ob.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
    saved = copy.deepcopy({i: dict(ob.state[p]) for i, p in enumerate(b)})
    before = [p.detach().clone() for p in b]
    for p in b:
        p.grad = torch.full_like(p, float("inf"))
    ob.found_inf = torch.ones((), device=device)
    ob.step()
    for i, p in enumerate(b):
        assert torch.equal(p, before[i])
        for k, v in ob.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(saved[i][k])), (name, i, k)


def test_tensor_lr_equals_float_lr(device: str) -> None:
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(5000, generator=gen)
    a, b = base.to(device).requires_grad_(), base.to(device).requires_grad_()
    oa = lb.AdamW8bit([a], lr=0.01)
    ob = lb.AdamW8bit([b], lr=torch.tensor(0.01, dtype=torch.float64, device=device))
    for _ in range(3):
        g = torch.randn(5000, generator=gen).to(device)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


def test_bad_arguments_name_themselves() -> None:
    p = torch.zeros(10, requires_grad=True)
    with pytest.raises(TypeError, match=r"AdamW8bit: parameters must be float16, bfloat16 or float32 .* torch.float64"):
        lb.AdamW8bit([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(TypeError, match=r"master_weights='residual' needs bfloat16 parameters; got torch.float32"):
        lb.AdamW8bit([p], master_weights="residual")
    with pytest.raises(ValueError, match="Adam8bit: amsgrad=True is not supported"):
        lb.Adam8bit([p], amsgrad=True)
    with pytest.raises(ValueError, match=r"SGD8bit.*momentum must be > 0"):
        lb.SGD8bit([p], momentum=0.0)
    with pytest.raises(TypeError, match="Lion8bit: min_8bit_size must be an int >= 0; got"):
        lb.Lion8bit([p], min_8bit_size=-1)
    with pytest.raises(TypeError, match="AdamW4bit: state_dtype does not apply"):
        lb.AdamW4bit([p], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="AdamW8bit: master_weights must be False, True or 'residual'"):
        lb.AdamW8bit([p], master_weights="bf16")
    with pytest.raises(ValueError, match=r"AdamW8bit.*lr"):
        lb.AdamW8bit([p], lr=-1.0)


def test_exported_from_cukit_optim() -> None:
    import cukit.optim as co

    for name in CLASSES:
        assert getattr(co, name) is getattr(lb, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "SGD8bit"])
def test_cuda_graph_replay_equals_eager_steps(name: str) -> None:
    """A captured low-bit step (tensor lr changed in place between replays, new gradients copied
    into the captured ones) gives the eager steps' parameters and codes bit for bit."""
    import cukit

    if not cukit.is_available():
        pytest.skip("needs CuPy")
    gen = torch.Generator().manual_seed(13)
    base = [torch.randn(s, generator=gen) for s in ((5000,), (300, 17), (9,))]
    a = [p.cuda().requires_grad_() for p in base]
    b = [p.cuda().requires_grad_() for p in base]
    lr_a = torch.tensor(0.01, dtype=torch.float64, device="cuda")
    lr_b = lr_a.clone()
    ours, eager = getattr(lb, name)(a, lr=lr_a), getattr(lb, name)(b, lr=lr_b)
    grads = [torch.randn(p.shape, generator=gen).cuda() for p in a]
    for p, q, g in zip(a, b, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compiles the kernels and builds the tables
        ours.step()
    torch.cuda.current_stream().wait_stream(s)
    eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours.step()
    for step in range(1, 5):
        lr_a.fill_(0.01 * 0.5**step)
        lr_b.fill_(0.01 * 0.5**step)
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, generator=gen).cuda()
            p.grad.copy_(g)  # type: ignore[union-attr]
            q.grad.copy_(g)  # type: ignore[union-attr]
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        for k, v in eager.state[q].items():
            assert torch.equal(ours.state[p][k], v), k
