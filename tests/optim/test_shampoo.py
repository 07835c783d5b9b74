"""cukit.optim.Shampoo against a plain-torch float64 reference (one block at a time, roots by
torch.linalg.eigh), plus state_dict, schedulers, GradScaler, the root-failure fallback and errors."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from cukit.optim import Shampoo

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Reference: Distributed-Shampoo style, per block, float64
# ---------------------------------------------------------------------------------------------


def _inv_root(f: Tensor, eps: float) -> Tensor:
    w, v = torch.linalg.eigh(f)
    r = eps * w[-1].clamp_min(0)
    return (v * (w.clamp_min(0) + r).pow(-0.25)) @ v.T


class RefShampoo:
    """The maths of the class docstring, one block at a time in float64."""

    def __init__(self, params: list[Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 epsilon: float = 1e-6, weight_decay: float = 0.0, decoupled_weight_decay: bool = True,
                 max_preconditioner_dim: int = 1024, precondition_frequency: int = 1,
                 start_preconditioning_step: int = 1, grafting: str = "adam", grafting_epsilon: float = 1e-8
                 ) -> None:
        self.ps = [p.detach().double().clone() for p in params]
        self.lr, self.b1, self.b2 = lr, betas[0], betas[1]
        self.eps, self.wd, self.decoupled = epsilon, weight_decay, decoupled_weight_decay
        self.d, self.freq, self.start = max_preconditioner_dim, precondition_frequency, start_preconditioning_step
        self.grafting, self.geps = grafting, grafting_epsilon
        self.t = 0
        self.v = [torch.zeros_like(p) for p in self.ps]
        self.m = [torch.zeros_like(p) for p in self.ps]
        self.blocks: list[list[dict[str, Any]]] = []
        for p in self.ps:
            bl = []
            if p.dim() >= 2:
                rows, cols = p.shape[0], p.numel() // p.shape[0]
                for r0 in range(0, rows, self.d):
                    for c0 in range(0, cols, self.d):
                        r1, c1 = min(r0 + self.d, rows), min(c0 + self.d, cols)
                        m, n = r1 - r0, c1 - c0
                        bl.append(dict(rs=slice(r0, r1), cs=slice(c0, c1), L=torch.zeros(m, m, dtype=torch.float64),
                                       R=torch.zeros(n, n, dtype=torch.float64), QL=torch.eye(m, dtype=torch.float64),
                                       QR=torch.eye(n, dtype=torch.float64)))
            self.blocks.append(bl)

    def step(self, grads: list[Tensor], lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.t += 1
        t, b1, b2 = self.t, self.b1, self.b2
        for i, (p, g) in enumerate(zip(self.ps, grads, strict=True)):
            g = g.double().clone()
            if not self.decoupled and self.wd:
                g += self.wd * p
            if self.grafting == "adam":
                self.v[i] = self.v[i] + g * g if b2 == 1 else b2 * self.v[i] + (1 - b2) * g * g
                bc2 = t if b2 == 1 else 1 - b2**t
                a = g / ((self.v[i] / bc2).sqrt() + self.geps)
            else:
                self.v[i] = self.v[i] + g * g
                a = g / (self.v[i].sqrt() + self.geps)
            d = a.clone()
            gm, am, dm = (x.reshape(x.shape[0], -1) if x.dim() >= 2 else x for x in (g, a, d))  # dm: a view of d
            for blk in self.blocks[i]:
                gb = gm[blk["rs"], blk["cs"]]
                ab = am[blk["rs"], blk["cs"]]
                if b2 == 1:
                    blk["L"] += gb @ gb.T
                    blk["R"] += gb.T @ gb
                else:
                    blk["L"] = b2 * blk["L"] + (1 - b2) * gb @ gb.T
                    blk["R"] = b2 * blk["R"] + (1 - b2) * gb.T @ gb
                if t >= self.start:
                    if t == self.start or (t - self.start) % self.freq == 0:
                        blk["QL"] = _inv_root(blk["L"], self.eps)
                        blk["QR"] = _inv_root(blk["R"], self.eps)
                    pb = blk["QL"] @ gb @ blk["QR"]
                    pn = pb.norm()
                    dm[blk["rs"], blk["cs"]] = pb * (ab.norm() / pn if pn > 0 else 0.0)
            if b1:
                self.m[i] = self.m[i] + (1 - b1) * (d - self.m[i])
                upd = self.m[i] / (1 - b1**t)
            else:
                upd = d
            if self.decoupled and self.wd:
                p.mul_(1 - lr * self.wd)
            p.sub_(lr * upd)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

SHAPES = [(6, 5), (7,), (4, 3, 3, 3), (11, 4), (3, 9), (6, 5)]  # 2-D, 1-D, conv, dims > max dim 4, a repeat


def _params(shapes: list[tuple[int, ...]], device: str = "cpu", seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]


def _grads(shapes: list[tuple[int, ...]], steps: int, seed: int = 1) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _run(opt: Shampoo, params: list[Tensor], grads: list[list[Tensor]]) -> None:
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.to(p.device, p.dtype)
        opt.step()


CASES = [
    dict(lr=1e-2, max_preconditioner_dim=4),
    dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2, start_preconditioning_step=3,
         weight_decay=0.1),
    dict(lr=5e-2, betas=(0.0, 1.0), grafting="adagrad", weight_decay=0.05, decoupled_weight_decay=False,
         max_preconditioner_dim=5),
    dict(lr=1e-2, betas=(0.5, 0.9), epsilon=1e-3, grafting_epsilon=1e-6, precondition_frequency=3),
]


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
def test_matches_reference(kw: dict[str, Any]) -> None:
    params = _params(SHAPES)
    ref = RefShampoo(params, **kw)
    opt = Shampoo(params, **kw)
    grads = _grads(SHAPES, 7)
    for gs in grads:
        _run(opt, params, [gs])
        ref.step(gs)
        for p, r in zip(params, ref.ps, strict=True):
            torch.testing.assert_close(p.detach().double(), r, rtol=2e-4, atol=2e-5)


def test_blocks_and_state_layout() -> None:
    params = _params([(11, 4), (7,), (4, 3, 3, 3)])
    opt = Shampoo(params, max_preconditioner_dim=4)
    _run(opt, params, _grads([(11, 4), (7,), (4, 3, 3, 3)], 1))
    st = opt.state[params[0]]
    assert [tuple(st[f"L_{i}"].shape) for i in range(3)] == [(4, 4), (4, 4), (3, 3)]
    assert {"step", "exp_avg", "graft_exp_avg_sq", "L_root_0", "R_info_2"} <= set(st)
    assert not any(k.startswith("L_") for k in opt.state[params[1]])  # 1-D: grafted only
    assert [tuple(opt.state[params[2]][f"R_{i}"].shape) for i in range(7)] == [(4, 4)] * 6 + [(3, 3)]
    assert st["L_0"].dtype == torch.float32 and float(st["step"]) == 1.0


def test_state_dict_round_trip() -> None:
    kw = dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2)
    grads = _grads(SHAPES, 6)
    p1 = _params(SHAPES)
    o1 = Shampoo(p1, **kw)
    _run(o1, p1, grads[:3])
    saved = copy.deepcopy(o1.state_dict())
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    o2 = Shampoo(p2, **kw)
    o2.load_state_dict(saved)
    _run(o1, p1, grads[3:])
    _run(o2, p2, grads[3:])
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert o2.state[p2[0]]["L_0"].dtype == torch.float32


def test_state_dict_from_bfloat16_params_keeps_float32_factors() -> None:
    p = [torch.nn.Parameter(torch.randn(5, 4).bfloat16())]
    o = Shampoo(p)
    _run(o, p, _grads([(5, 4)], 2))
    o2 = Shampoo([torch.nn.Parameter(p[0].detach().clone())])
    o2.load_state_dict(o.state_dict())
    _run(o2, o2.param_groups[0]["params"], _grads([(5, 4)], 1))
    st = o2.state[o2.param_groups[0]["params"][0]]
    assert st["L_0"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32


def test_lr_scheduler() -> None:
    params = _params(SHAPES)
    ref = RefShampoo(params, lr=1e-2)
    opt = Shampoo(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for gs in _grads(SHAPES, 5):
        lr = opt.param_groups[0]["lr"]
        _run(opt, params, [gs])
        ref.step(gs, lr=lr)
        sched.step()
    for p, r in zip(params, ref.ps, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=2e-4, atol=2e-5)


def test_tensor_lr() -> None:
    params = _params(SHAPES)
    a = Shampoo(params, lr=torch.tensor(1e-2))
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b = Shampoo(p2, lr=1e-2)
    grads = _grads(SHAPES, 3)
    _run(a, params, grads)
    _run(b, p2, grads)
    for x, y in zip(params, p2, strict=True):
        torch.testing.assert_close(x, y)


def test_grad_scale_and_found_inf() -> None:
    _check_grad_scale("cpu")


def _check_grad_scale(device: str) -> None:
    """Scaled gradients with found_inf 0 step as the unscaled ones; found_inf 1 changes nothing."""
    grads = _grads(SHAPES, 3)
    p1, p2 = _params(SHAPES, device), _params(SHAPES, device)
    o1, o2 = Shampoo(p1, lr=1e-2), Shampoo(p2, lr=1e-2)
    _run(o1, p1, grads[:2])
    for k, gs in enumerate(grads[:2]):
        o2.grad_scale = torch.tensor(8.0, device=device)
        o2.found_inf = torch.tensor(0.0, device=device)
        _run(o2, p2, [[g * 8 for g in gs]])
        if k == 0:  # a skipped step (an inf in the grads) changes nothing
            before = [p.detach().clone() for p in p2]
            state = copy.deepcopy(o2.state_dict()["state"])
            o2.found_inf = torch.tensor(1.0, device=device)
            _run(o2, p2, [[g * math.inf for g in gs]])
            for a, b in zip(before, p2, strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
            after = o2.state_dict()["state"]
            for i, st in state.items():
                for key, v in st.items():
                    torch.testing.assert_close(after[i][key], v, rtol=0, atol=0, equal_nan=True)
            o2._host_step -= 1  # the host-side root schedule counts the skipped step: realign for the check
    for a, b in zip(p1, p2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grad_scaler_on_cpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = Shampoo(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_root_failure_keeps_previous_root() -> None:
    params = _params([(5, 4), (5, 4)])
    opt = Shampoo(params, lr=1e-2)
    grads = _grads([(5, 4), (5, 4)], 2)
    _run(opt, params, grads[:1])
    st = opt.state[params[0]]
    root_before = st["L_root_0"].clone()
    other_before = opt.state[params[1]]["L_root_0"].clone()
    st["L_0"].fill_(float("nan"))  # a view into the stacked factors: the next root of this matrix fails
    _run(opt, params, grads[1:])
    assert int(st["L_info_0"]) == 2
    torch.testing.assert_close(st["L_root_0"], root_before, rtol=0, atol=0)
    assert int(opt.state[params[1]]["L_info_0"]) == 0
    assert not torch.equal(opt.state[params[1]]["L_root_0"], other_before)  # the others were updated
    assert all(torch.isfinite(p).all() for p in params)
    assert 5 in opt.root_info and opt.root_info[5].dtype == torch.int32


def test_float64_roots_match() -> None:
    params = _params(SHAPES)
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = Shampoo(params, lr=1e-2, root_dtype=torch.float64)
    b = Shampoo(p2, lr=1e-2)
    grads = _grads(SHAPES, 3)
    _run(a, params, grads)
    _run(b, p2, grads)
    for x, y in zip(params, p2, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_skips_params_without_grad_and_empty() -> None:
    params = _params([(4, 3), (0, 3), (5,)])
    opt = Shampoo(params, lr=1e-2)
    params[0].grad = torch.randn(4, 3)
    params[1].grad = torch.zeros(0, 3)
    before = params[2].detach().clone()
    opt.step()
    assert torch.equal(params[2].detach(), before)
    params[2].grad = torch.randn(5)
    opt.step()  # the layout is rebuilt with the new parameter; the first's state carries over
    assert float(opt.state[params[0]]["step"]) == 2.0


def test_toy_model_beats_or_matches_adamw() -> None:
    def train(make: Any) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(256, 16, generator=gen)
        w = torch.randn(16, 4, generator=gen)
        y = torch.tanh(x @ w)
        opt = make(model.parameters())
        for _ in range(60):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x), y))

    shampoo = train(lambda ps: Shampoo(ps, lr=1e-2, betas=(0.9, 0.999)))
    adamw = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0))
    assert shampoo <= adamw * 1.05, (shampoo, adamw)


@pytest.mark.parametrize(
    ("kw", "exc", "text"),
    [
        (dict(lr=-1.0), ValueError, "cukit.optim.Shampoo: lr must"),
        (dict(lr="a"), TypeError, "cukit.optim.Shampoo: lr must"),
        (dict(betas=(0.9, 1.5)), ValueError, "cukit.optim.Shampoo: betas[1] must"),
        (dict(max_preconditioner_dim=0), ValueError, "cukit.optim.Shampoo: max_preconditioner_dim must be an int >= 1"),
        (dict(max_preconditioner_dim=2.0), TypeError, "cukit.optim.Shampoo: max_preconditioner_dim must be an int"),
        (dict(precondition_frequency=0), ValueError, "cukit.optim.Shampoo: precondition_frequency must"),
        (dict(start_preconditioning_step=-1), ValueError, "cukit.optim.Shampoo: start_preconditioning_step must"),
        (dict(grafting="sgd"), ValueError, "cukit.optim.Shampoo: grafting must be one of 'adam', 'adagrad'"),
        (dict(root_method="qr"), ValueError, "cukit.optim.Shampoo: root_method must"),
        (dict(root_dtype=torch.float16), TypeError, "cukit.optim.Shampoo: root_dtype must"),
        (dict(epsilon=-1.0), ValueError, "cukit.optim.Shampoo: epsilon must"),
        (dict(maximize=1), TypeError, "cukit.optim.Shampoo: maximize must be a bool"),
    ],
)
def test_errors(kw: dict[str, Any], exc: type, text: str) -> None:
    with pytest.raises(exc) as e:
        Shampoo(_params([(3, 3)]), **kw)
    assert text in str(e.value)


def test_errors_params_and_groups() -> None:
    with pytest.raises(TypeError, match=r"cukit\.optim\.Shampoo: params must be floating tensors"):
        Shampoo([torch.zeros(3, dtype=torch.int64)])
    opt = Shampoo(_params([(3, 3)]))
    with pytest.raises(ValueError, match="max_preconditioner_dim must be the same for every param group"):
        opt.add_param_group({"params": _params([(2, 2)]), "max_preconditioner_dim": 7})
    with pytest.raises(ValueError, match="betas must be the same for every param group"):
        opt.add_param_group({"params": _params([(2, 2)]), "betas": (0.5, 0.5)})
    opt.add_param_group({"params": _params([(2, 2)]), "lr": 0.5, "betas": [0.9, 0.999]})  # per-group lr is fine


def test_param_groups_with_different_lr_and_maximize() -> None:
    shapes = [(4, 3), (5,)]
    pa, pb = _params(shapes), _params(shapes, seed=5)
    opt = Shampoo([{"params": pa}, {"params": pb, "lr": 0.1, "maximize": True}], lr=1e-2)
    ra, rb = RefShampoo(pa, lr=1e-2), RefShampoo(pb, lr=0.1)
    for gs in _grads(shapes * 2, 3):
        for p, g in zip(pa + pb, gs, strict=True):
            p.grad = g.clone()
        opt.step()
        ra.step(gs[:2])
        rb.step([-g for g in gs[2:]])
    for p, r in zip(pa + pb, ra.ps + rb.ps, strict=True):
        torch.testing.assert_close(p.detach().double(), r, rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("method", ["auto", "eigh", "newton"])
def test_cuda_matches_reference(kw: dict[str, Any], method: str) -> None:
    params = _params(SHAPES, "cuda")
    ref = RefShampoo([p.cpu() for p in params], **kw)  # the float64 reference runs on the CPU
    opt = Shampoo(params, root_method=method, **kw)
    for gs in _grads(SHAPES, 7):
        _run(opt, params, [gs])
        ref.step(gs)
    # fp32 Newton roots (auto: n > 32) are less exact than eigh's
    tol = dict(rtol=2e-3, atol=2e-4) if method == "eigh" else dict(rtol=1e-2, atol=1e-3)
    for p, r in zip(params, ref.ps, strict=True):
        torch.testing.assert_close(p.detach().double().cpu(), r, **tol)


@pytest.mark.gpu
@cuda
def test_cuda_step_has_no_host_sync() -> None:
    params = _params([(64, 48), (48,), (130, 40)], "cuda")
    opt = Shampoo(params, lr=1e-3, max_preconditioner_dim=64, capturable=True)
    grads = [[g.cuda() for g in gs] for gs in _grads([(64, 48), (48,), (130, 40)], 3)]
    _run(opt, params, grads[:1])  # builds the layout and compiles the kernels
    scale, found = torch.tensor(4.0, device="cuda"), torch.tensor(0.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for gs in grads[1:]:
            opt.grad_scale, opt.found_inf = scale, found
            for p, g in zip(params, gs, strict=True):
                p.grad.copy_(g * 4)  # type: ignore[union-attr]
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.gpu
@cuda
def test_cuda_graph_capture() -> None:
    shapes = [(64, 48), (48,), (33, 20)]
    params = _params(shapes, "cuda")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    # the Newton route: cukit's kernels and torch allocations only (CuPy's eigh is not known to capture)
    kw = dict(lr=1e-3, max_preconditioner_dim=64, precondition_frequency=1, capturable=True, root_method="newton")
    opt, eager = Shampoo(params, **kw), Shampoo(twin, **kw)
    grads = _grads(shapes, 4)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.to("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opt.step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    _run(eager, twin, grads[:1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for gs in grads[1:]:
        for p, g in zip(params, gs, strict=True):
            p.grad.copy_(g.to("cuda"))  # type: ignore[union-attr]
        graph.replay()
        _run(eager, twin, [gs])
    torch.cuda.synchronize()
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _twins(shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> tuple[list[Tensor], list[Tensor]]:
    a = [torch.nn.Parameter(p.detach().to("cuda", dt)) for p, dt in zip(_params(shapes), dtypes, strict=True)]
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


def _assert_same_run(opt: Shampoo, ref: Shampoo, pa: list[Tensor], pb: list[Tensor], steps: int,
                     strided: bool = False) -> None:
    """Steps both optimizers on the same gradients; params and states agree at every step."""
    assert ref._use_kernels is False
    shapes = [tuple(p.shape) for p in pa]
    for k, gs in enumerate(_grads(shapes, steps)):
        for p, q, g in zip(pa, pb, gs, strict=True):
            g = g.to("cuda", p.dtype)
            if strided and g.dim() == 2:  # a transposed layout: the kernel path copies it
                g = g.mT.contiguous().mT
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        assert opt._layout is not None and opt._layout.launches, "the CUDA path did not take the kernels"
        assert ref._layout is not None and not ref._layout.launches
        for p, q in zip(pa, pb, strict=True):
            # 16-bit parameters: the two paths' float32 results may round to neighbouring values
            tol = dict(rtol=1e-5, atol=1e-6) if p.element_size() > 2 else dict(rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(p, q, **tol, msg=lambda m, k=k: f"step {k}: {m}")
        for p, q in zip(pa, pb, strict=True):
            # 16-bit parameters a rounding apart feed L2 decay and the next gradients' directions
            tol = dict(rtol=1e-4, atol=1e-6) if p.element_size() > 2 else dict(rtol=1e-2, atol=1e-3)
            for key in ("step", "exp_avg", "graft_exp_avg_sq", "graft_sum"):
                if key in opt.state[p]:
                    torch.testing.assert_close(opt.state[p][key], ref.state[q][key], **tol,
                                               msg=lambda m, k=k, key=key: f"step {k}, {key}: {m}")


KERNEL_CASES = [*CASES, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=False, max_preconditioner_dim=4,
                             betas=(0.9, 1.0))]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kw", KERNEL_CASES, ids=range(len(KERNEL_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_cuda_kernels_match_torch_ops(kw: dict[str, Any], dtype: torch.dtype) -> None:
    """raw_kernels/shampoo.cu's two passes against the same step in torch ops on the GPU."""
    pa, pb = _twins(SHAPES, [dtype] * len(SHAPES))
    opt, ref = Shampoo(pa, root_method="eigh", **kw), Shampoo(pb, root_method="eigh", **kw)
    ref._use_kernels = False
    _assert_same_run(opt, ref, pa, pb, 5)


@pytest.mark.gpu
@cuda
def test_cuda_kernels_groups_dtypes_strided_grads() -> None:
    """Two param groups (lr float and tensor, maximize, decoupled and L2 decay), float32 and bfloat16
    parameters in one optimizer (one launch per dtype), gradients in a transposed layout."""
    shapes = [(6, 5), (7,), (11, 4), (4, 3, 3, 3), (3, 9)]
    dts = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    pa, pb = _twins(shapes, dts)

    def groups(ps: list[Tensor]) -> list[dict[str, Any]]:
        return [dict(params=ps[:3], weight_decay=0.1),
                dict(params=ps[3:], lr=torch.tensor(0.05, device="cuda"), maximize=True, weight_decay=0.05,
                     decoupled_weight_decay=False)]

    kw = dict(lr=1e-2, max_preconditioner_dim=4, root_method="eigh")
    opt, ref = Shampoo(groups(pa), **kw), Shampoo(groups(pb), **kw)
    ref._use_kernels = False
    _assert_same_run(opt, ref, pa, pb, 4, strided=True)
    assert len(opt._layout.launches) == 2  # type: ignore[union-attr]


@pytest.mark.gpu
@cuda
def test_cuda_grad_scale_and_found_inf() -> None:
    _check_grad_scale("cuda")


def test_matmul_precision_option() -> None:
    """matmul_precision is checked, kept in the defaults, and "tf32" changes nothing on the CPU
    (the reference GEMMs); on CUDA it selects the tensor-core GEMMs (bench_shampoo times them)."""
    with pytest.raises(ValueError, match=r"matmul_precision"):
        Shampoo([torch.zeros(4, 4, requires_grad=True)], matmul_precision="fp16")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=g)
    grads = [torch.randn(6, 5, generator=g) for _ in range(3)]
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    oa, ob = Shampoo([a], lr=0.01), Shampoo([b], lr=0.01, matmul_precision="tf32")
    assert ob.defaults["matmul_precision"] == "tf32"
    for gr in grads:
        a.grad, b.grad = gr.clone(), gr.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
