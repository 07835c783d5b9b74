"""cukit.optim's optimizers against torch.optim's for-loop implementations (foreach=False), and
Lion / LAMB against independent textbook implementations written here: >= 7 steps with a size-0
parameter, a parameter whose grad is None on one step, mixed dtypes and several param groups.
Every test runs on "cpu" (the reference path) and on "cuda" (the kernels; marked gpu)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import cukit.optim as co
import pytest

torch = pytest.importorskip("torch")

STEPS = 8
SKIP_STEP = 3  # params[0] has no grad on this step


def make_params(
    device: str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (0,), (7,), (33, 9), (1,), (130,)]
    return [
        torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtypes[i % len(dtypes)])
        for i, s in enumerate(shapes)
    ]


def groups_of(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.03}]


def drive(
    opts: list[Any],
    plists: list[list[torch.Tensor]],
    steps: int = STEPS,
    scheduler: Callable[[Any], Any] | None = None,
) -> None:
    g = torch.Generator().manual_seed(1)
    scheds = [scheduler(o) for o in opts] if scheduler else []
    for s in range(steps):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in plists[0]]
        for ps in plists:
            for i, p in enumerate(ps):
                p.grad = None if (i == 0 and s == SKIP_STEP) else grads[i].to(device=p.device, dtype=p.dtype)
        for o in opts:
            o.step()
        for sc in scheds:
            sc.step()


def assert_params_close(
    a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 2e-5, atol: float = 2e-6
) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(
            x.detach().double().cpu(),
            y.detach().double().cpu(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, i=i: f"param {i}: {m}",
        )


def leaves(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.clone().requires_grad_() for p in ps]


TORCH_CASES = [
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    ("AdamW", {"lr": 0.01, "maximize": True, "betas": (0.8, 0.95), "eps": 1e-6}),
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "weight_decay": 0.1, "maximize": True}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True}),
    ("Adagrad", {"lr": 0.05}),
    (
        "Adagrad",
        {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.2, "eps": 1e-8},
    ),
    ("Adagrad", {"lr": 0.05, "maximize": True}),
]


@pytest.mark.parametrize(
    ("name", "kwargs"), TORCH_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TORCH_CASES)]
)
def test_parity_with_torch_for_loop(device: str, name: str, kwargs: dict[str, Any]) -> None:
    base = make_params(device)
    a, b = leaves(base), leaves(base)
    ta = getattr(torch.optim, name)(groups_of(a), foreach=False, **kwargs)
    cb = getattr(co, name)(groups_of(b), **kwargs)
    drive([ta, cb], [a, b])
    assert_params_close(a, b)
    # the state is torch's: same keys, same values
    for pa, pb in zip(a, b, strict=True):
        sa, sb = ta.state[pa], cb.state[pb]
        assert set(sa) == set(sb), (set(sa), set(sb))
        for k in sa:
            torch.testing.assert_close(
                torch.as_tensor(sb[k]).double().cpu(),
                torch.as_tensor(sa[k]).double().cpu(),
                rtol=2e-5,
                atol=2e-6,
            )


@pytest.mark.parametrize(
    ("name", "kwargs"), TORCH_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(TORCH_CASES)]
)
def test_parity_with_torch_default(device: str, name: str, kwargs: dict[str, Any]) -> None:
    """Against torch's default implementation (foreach on CPU and CUDA), what users compare with."""
    base = make_params(device)
    a, b = leaves(base), leaves(base)
    ta = getattr(torch.optim, name)(groups_of(a), **kwargs)
    cb = getattr(co, name)(groups_of(b), **kwargs)
    drive([ta, cb], [a, b])
    assert_params_close(a, b)


STORAGE_CASES = [
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05}),
    ("Lion", {"lr": 0.01, "weight_decay": 0.1}),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "kwargs"), STORAGE_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(STORAGE_CASES)]
)
def test_16bit_storage_rounds_the_float32_step(name: str, kwargs: dict[str, Any], dtype: torch.dtype) -> None:
    """16-bit params and state (no master weights) on the CPU path: every step is the float32 step
    from the stored values, rounded once to storage (bit for bit), with a skipped gradient."""
    base = make_params("cpu", (torch.float32,))
    low = [p.to(dtype).requires_grad_() for p in base]
    high = [p.detach().float().requires_grad_() for p in low]
    olow, ohigh = getattr(co, name)(low, **kwargs), getattr(co, name)(high, **kwargs)
    g = torch.Generator().manual_seed(4)
    for s in range(7):
        for i, (p, q) in enumerate(zip(low, high, strict=True)):
            gi = None if (i == 0 and s == SKIP_STEP) else torch.randn(p.shape, generator=g).to(dtype)
            p.grad, q.grad = gi, None if gi is None else gi.float()
            with torch.no_grad():  # the float32 run starts each step from the stored values
                q.copy_(p.float())
                for k, v in olow.state[p].items():
                    if k != "step":
                        ohigh.state[q][k].copy_(v.float())
        olow.step()
        ohigh.step()
        for p, q in zip(low, high, strict=True):
            assert torch.equal(p.detach(), q.detach().to(dtype))
            for k, v in olow.state[p].items():
                assert v.dtype == (torch.float32 if k == "step" else dtype), k
                assert torch.equal(v, ohigh.state[q][k].to(v.dtype)), k


def test_parity_under_lr_scheduler(device: str) -> None:
    base = make_params(device)
    a, b = leaves(base), leaves(base)
    ta = torch.optim.AdamW(groups_of(a), lr=0.02, foreach=False)
    cb = co.AdamW(groups_of(b), lr=0.02)

    def sched(o: Any) -> Any:
        return torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3)

    drive([ta, cb], [a, b], scheduler=sched)
    assert cb.param_groups[0]["lr"] == pytest.approx(0.02 * 0.3**4)
    assert_params_close(a, b)
    # and the schedule changed the result: a constant lr gives other params
    c = leaves(base)
    drive([co.AdamW(groups_of(c), lr=0.02)], [c])
    assert not all(torch.allclose(x, y) for x, y in zip(b, c, strict=True) if x.numel())


# ---------------------------------------------------------------------------- Lion and LAMB
def lion_textbook(ps: list[torch.Tensor], lr: float, b1: float, b2: float, wd: float) -> Callable[[], None]:
    """lion-pytorch's update, in float64."""
    m = {id(p): torch.zeros_like(p, dtype=torch.float64) for p in ps}

    def step() -> None:
        for p in ps:
            if p.grad is None:
                continue
            g = p.grad.double()
            w = p.detach().double() * (1 - lr * wd)
            u = (m[id(p)] * b1 + g * (1 - b1)).sign()
            p.data.copy_(w - lr * u)
            m[id(p)] = m[id(p)] * b2 + g * (1 - b2)

    return step


def lamb_textbook(
    ps: list[torch.Tensor], lr: float, b1: float, b2: float, eps: float, wd: float
) -> Callable[[], None]:
    """LAMB (You et al. 2020, Algorithm 2 with bias correction and phi = identity), in float64."""
    st = {
        id(p): [torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64), 0]
        for p in ps
    }

    def step() -> None:
        for p in ps:
            if p.grad is None:
                continue
            s = st[id(p)]
            s[2] += 1
            g, w = p.grad.double(), p.detach().double()
            s[0] = b1 * s[0] + (1 - b1) * g
            s[1] = b2 * s[1] + (1 - b2) * g * g
            mh, vh = s[0] / (1 - b1 ** s[2]), s[1] / (1 - b2 ** s[2])
            u = mh / (vh.sqrt() + eps) + wd * w
            wn, un = w.norm(), u.norm()
            r = wn / un if wn > 0 and un > 0 else 1.0
            p.data.copy_(w - lr * r * u)

    return step


class _Stepper:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.step = fn


@pytest.mark.parametrize("maximize", [False, True])
def test_lion_matches_textbook(device: str, maximize: bool) -> None:
    base = make_params(device, (torch.float64,))
    a, b = leaves(base), leaves(base)
    ref = lion_textbook(a, 0.01, 0.9, 0.99, 0.1)
    opt = co.Lion(b, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, maximize=maximize)
    if maximize:  # maximising f is minimising -f

        def ref_step() -> None:
            for p in a:
                if p.grad is not None:
                    p.grad = -p.grad
            ref()

        drive([_Stepper(ref_step), opt], [a, b])
    else:
        drive([_Stepper(ref), opt], [a, b])
    assert_params_close(a, b, rtol=1e-6, atol=1e-6)  # hyperparameters travel as float32


def test_lamb_matches_textbook(device: str) -> None:
    base = make_params(device, (torch.float64,))
    a, b = leaves(base), leaves(base)
    ref = lamb_textbook(a, 0.01, 0.9, 0.999, 1e-6, 0.01)
    opt = co.LAMB([{"params": b[:3]}, {"params": b[3:]}], lr=0.01, weight_decay=0.01)
    drive([_Stepper(ref), opt], [a, b])
    assert_params_close(a, b, rtol=1e-6, atol=1e-6)  # hyperparameters travel as float32
    assert set(opt.state[b[2]]) == {"step", "exp_avg", "exp_avg_sq"}


# ---------------------------------------------------------------------------- options
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Adagrad", "Lion", "LAMB"])
def test_grad_scale_and_found_inf(device: str, name: str) -> None:
    """GradScaler's protocol: grads scaled by S with grad_scale=S equal an unscaled step; with
    found_inf != 0 nothing changes (params, state, step counts)."""
    kw = {"momentum": 0.9} if name == "SGD" else {}
    base = make_params(device, (torch.float32,))
    a, b = leaves(base), leaves(base)
    oa, ob = getattr(co, name)(a, lr=0.01, **kw), getattr(co, name)(b, lr=0.01, **kw)
    scale = torch.tensor(1024.0, device=device)
    for _ in range(4):
        g = [torch.randn_like(p) for p in a]
        for p, q, gi in zip(a, b, g, strict=True):
            p.grad, q.grad = gi.clone(), gi * 1024.0
        oa.step()
        ob.grad_scale, ob.found_inf = scale, torch.zeros((), device=device)
        ob.step()
        del ob.grad_scale, ob.found_inf
    assert_params_close(a, b, rtol=1e-6, atol=1e-7)
    before_p = [p.detach().clone() for p in b]
    before_s = copy.deepcopy(
        {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in ob.state[p].items()}
            for i, p in enumerate(b)
        }
    )
    for p in b:
        p.grad = torch.full_like(p, float("inf"))
    ob.grad_scale, ob.found_inf = scale, torch.ones((), device=device)
    ob.step()
    for p, q in zip(b, before_p, strict=True):
        assert torch.equal(p.detach(), q)
    for i, p in enumerate(b):
        for k, v in ob.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(before_s[i][k])), (i, k)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_max_grad_norm_equals_clip_then_step(device: str, name: str) -> None:
    base = make_params(device)
    a, b = leaves(base), leaves(base)
    ta = getattr(torch.optim, name)(a, lr=0.01, foreach=False)
    cb = getattr(co, name)(b, lr=0.01, max_grad_norm=0.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        for p, q in zip(a, b, strict=True):
            gi = torch.randn(p.shape, generator=g, dtype=torch.float64).to(device=device, dtype=p.dtype)
            p.grad, q.grad = gi.clone(), gi.clone()
        torch.nn.utils.clip_grad_norm_(a, 0.5, foreach=False)
        ta.step()
        cb.step()
    assert_params_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(
        not torch.equal(p.grad, q.grad) for p, q in zip(a, b, strict=True) if p.numel()
    )  # grads untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_follow_float32_training(device: str, dtype: torch.dtype) -> None:
    base = make_params(device, (torch.float32,))
    ref32 = leaves(base)
    low = [p.detach().to(dtype).requires_grad_() for p in base]
    o32 = co.AdamW(ref32, lr=0.01)
    olow = co.AdamW(low, lr=0.01, master_weights=True, state_dtype=torch.float32)
    # both start from the 16-bit values, so the master holds exactly what float32 training holds
    with torch.no_grad():
        for p, q in zip(ref32, low, strict=True):
            p.copy_(q.float())
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        for p, q in zip(ref32, low, strict=True):
            gi = torch.randn(p.shape, generator=g).to(device).to(dtype)
            p.grad, q.grad = gi.float(), gi
        o32.step()
        olow.step()
    for p, q in zip(ref32, low, strict=True):
        m = olow.state[q]["master_param"]
        assert m.dtype == torch.float32 and olow.state[q]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(m, p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(q.detach(), p.detach().to(dtype), rtol=0, atol=0)


def test_bfloat16_state(device: str) -> None:
    base = make_params(device, (torch.float32,))
    a, b = leaves(base), leaves(base)
    oa, ob = co.AdamW(a, lr=0.01), co.AdamW(b, lr=0.01, state_dtype=torch.bfloat16)
    drive([oa, ob], [a, b])
    assert ob.state[b[0]]["exp_avg"].dtype == torch.bfloat16
    assert_params_close(a, b, rtol=0.05, atol=0.02)


def test_flat_grads(device: str) -> None:
    base = make_params(device)
    a, b = leaves(base), leaves(base)
    oa, ob = co.SGD(a, lr=0.05, momentum=0.9), co.SGD(b, lr=0.05, momentum=0.9, flat_grads=True)
    views = [p.grad for p in b]
    assert all(v is not None and v.numel() == p.numel() for v, p in zip(views, b, strict=True))
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        ob.zero_grad()
        for p, q in zip(a, b, strict=True):
            gi = torch.randn(p.shape, generator=g, dtype=torch.float64).to(device=device, dtype=p.dtype)
            p.grad = gi.clone()
            q.grad += gi  # autograd accumulates into the view in place
        oa.step()
        ob.step()
    assert all(p.grad is v for p, v in zip(b, views, strict=True))
    assert_params_close(a, b)
    ob.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0 for p in b)
    b[0].grad = None
    with pytest.raises(RuntimeError, match="zero_grad"):
        ob.step()


def test_flat_grads_fill_through_autograd(device: str) -> None:
    lin = torch.nn.Linear(4, 3).to(device)
    opt = co.AdamW(lin.parameters(), lr=0.1, flat_grads=True)
    w = lin.weight.detach().clone()
    views = [p.grad for p in lin.parameters()]
    lin(torch.randn(2, 4, device=device)).sum().backward()
    assert all(p.grad is v for p, v in zip(lin.parameters(), views, strict=True))
    assert float(lin.weight.grad.abs().sum()) > 0
    opt.step()
    assert not torch.equal(lin.weight.detach(), w)


# ---------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad"])
@pytest.mark.parametrize("direction", ["torch->cukit", "cukit->torch"])
def test_state_dict_round_trip(device: str, name: str, direction: str) -> None:
    kw = {"momentum": 0.9} if name == "SGD" else {}
    base = make_params(device)
    first, second = (torch.optim, co) if direction == "torch->cukit" else (co, torch.optim)
    extra = {"foreach": False} if first is torch.optim else {}
    a = leaves(base)
    oa = getattr(first, name)(groups_of(a), lr=0.01, **kw, **extra)
    drive([oa], [a], steps=3)
    sd = copy.deepcopy(oa.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    extra2 = {"foreach": False} if second is torch.optim else {}
    ob = getattr(second, name)(groups_of(b), lr=0.5, **kw, **extra2)
    ob.load_state_dict(sd)
    assert ob.param_groups[1]["lr"] == 0.03
    drive([oa, ob], [a, b], steps=4)
    assert_params_close(a, b)
    sd2 = ob.state_dict()
    assert set(sd2["state"]) == set(oa.state_dict()["state"])


def test_many_tensors(device: str) -> None:
    n = 10_000 if device == "cuda" else 600
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1 + (i % 37), generator=g).to(device) for i in range(n)]
    a, b = leaves(base), leaves(base)
    ta, cb = torch.optim.AdamW(a, lr=0.01, foreach=True), co.AdamW(b, lr=0.01)
    for _ in range(7):
        for p, q in zip(a, b, strict=True):
            gi = torch.randn(p.shape, generator=g).to(device)
            p.grad, q.grad = gi, gi.clone()
        ta.step()
        cb.step()
    assert_params_close(a, b)


# ---------------------------------------------------------------------------- errors
def test_bad_arguments_name_themselves() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="AdamW: lr"):
        co.AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        co.Adam(p, betas=(0.9, 1.5))
    with pytest.raises(TypeError, match="state_dtype"):
        co.AdamW(p, state_dtype=torch.int32)
    with pytest.raises(ValueError, match="max_grad_norm"):
        co.SGD(p, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        co.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="differentiable"):
        co.AdamW(p, differentiable=True)
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        co.Adam(p, decoupled_weight_decay=True)
    with pytest.raises(TypeError, match="state_dtype"):
        o = co.AdamW([torch.zeros(3, dtype=torch.float64, requires_grad=True)], state_dtype=torch.bfloat16)
        o.param_groups[0]["params"][0].grad = torch.zeros(3, dtype=torch.float64)
        o.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_non_contiguous_param_is_a_value_error() -> None:
    p = torch.zeros(4, 6, device="cuda").t().requires_grad_()
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="contiguous"):
        co.AdamW([p]).step()


def test_closure_and_no_grads(device: str) -> None:
    p = torch.zeros(3, device=device, requires_grad=True)
    opt = co.AdamW([p], lr=0.1)
    assert opt.step() is None  # no grad yet: nothing happens
    assert torch.equal(p.detach(), torch.zeros(3, device=device))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p - 1).pow(2).sum()
        loss.backward()
        return loss

    assert math.isclose(float(opt.step(closure).detach()), 3.0)
    assert float(p.detach().sum()) > 0


def test_flat_grads_survive_a_storage_move(device: str) -> None:
    """model.to() assigns p.data and p.grad.data of every parameter (same objects, new storage):
    the flat buffers are rebuilt around the moved grads, so zero_grad still clears them and the
    steps keep matching torch (the check stays constant-cost: two sentinels per buffer)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3).to(device), torch.nn.Linear(4, 3).to(device)
    b.load_state_dict(a.state_dict())
    ta = torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9, foreach=False)
    cb = co.SGD(b.parameters(), lr=0.05, momentum=0.9, flat_grads=True)
    x = torch.randn(5, 4, device=device)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for p in b.parameters():  # what nn.Module._apply does, in place of a real move
                    p.data = p.data.clone()
                    p.grad.data = p.grad.data.clone()  # type: ignore[union-attr]
        ta.zero_grad()
        cb.zero_grad()
        a(x).square().sum().backward()
        b(x).square().sum().backward()
        ta.step()
        cb.step()
        assert_params_close(list(a.parameters()), list(b.parameters()))
    (buf,) = cb._flat_buffers
    assert all(
        p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # type: ignore[union-attr]
        for p in b.parameters()
    )


def test_default_mode_follows_moved_storage(device: str) -> None:
    """Default mode: the per-step pointer check sees a param or grad whose storage moved in place
    (same objects, ``p.data = ...`` / ``p.grad.data = ...``, what module.to() does), and a grad set
    to None; the tables are rebuilt and every step keeps matching torch's for-loop."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 5).to(device), torch.nn.Linear(6, 5).to(device)
    b.load_state_dict(a.state_dict())
    ta = torch.optim.AdamW(a.parameters(), lr=0.05, foreach=False)
    cb = co.AdamW(b.parameters(), lr=0.05)
    x = torch.randn(7, 6, device=device)
    for step in range(6):
        ta.zero_grad(set_to_none=False)
        cb.zero_grad(set_to_none=False)
        a(x).square().sum().backward()
        b(x).square().sum().backward()
        wb, bb = b.weight, b.bias
        if step == 2:
            with torch.no_grad():
                wb.data = wb.data.clone()  # the param moves; its grad stays
        if step == 3:
            bb.grad.data = bb.grad.data.clone()  # type: ignore[union-attr]  # the grad moves
        if step == 4:
            a.bias.grad = None
            bb.grad = None
        ta.step()
        cb.step()
        assert_params_close(list(a.parameters()), list(b.parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_repointing_the_table_does_not_synchronize() -> None:
    """Gradients at new addresses every step (the previous ones kept alive, so none is reused):
    the steps that rewrite the table's addresses queue their copy without a host sync (torch's
    sync debug mode raises on one), and the result is torch's."""
    base = make_params("cuda", (torch.float32,))
    a = [p.detach().clone().requires_grad_() for p in base]
    b = [p.detach().clone().requires_grad_() for p in base]
    theirs, ours = torch.optim.AdamW(a, lr=0.01, weight_decay=0.1), co.AdamW(b, lr=0.01, weight_decay=0.1)
    alive = []
    for step in range(4):
        grads = [torch.randn(p.shape, device="cuda") for p in a]
        alive.append(grads)
        for p, q, gi in zip(a, b, grads, strict=True):
            p.grad, q.grad = gi.clone(), gi
        theirs.step()
        torch.cuda.set_sync_debug_mode("error" if step else 0)  # the first step builds the plan
        try:
            ours.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        table = ours._plans[0].table
        assert [int(x) for x in table.host[table.T:2 * table.T]] == [  # type: ignore[union-attr]
            q.grad.data_ptr() for q in ours._plans[0].params]
    for x, y in zip(b, a, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_gradients_reallocated_each_step_repoint_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward that allocates its gradients anew every step (set_to_none, a compiled backward)
    keeps the plan: only the table's gradient addresses (and alignment flags) are rewritten, and
    the steps still match torch's, including a step whose gradients are misaligned views."""
    kw = {"AdamW": {"lr": 0.01, "weight_decay": 0.1}, "SGD": {"lr": 0.05, "momentum": 0.9},
          "Lion": {"lr": 1e-3}}[name]
    base = make_params("cuda", (torch.float32,))
    a = [p.detach().clone().requires_grad_() for p in base]
    b = [p.detach().clone().requires_grad_() for p in base]
    theirs = getattr(co, name)(a, **kw)  # its gradients stay where they are (written in place)
    ours = getattr(co, name)(b, **kw)
    builds = []
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float32).cuda() for p in a]
        for p, q, gi in zip(a, b, grads, strict=True):
            if p.grad is None:
                p.grad = gi.clone()
            else:
                p.grad.copy_(gi)
            if step == 3:  # misaligned: a view one element into a larger buffer
                buf = torch.empty(gi.numel() + 1, device="cuda")
                q.grad = buf[1:].view(gi.shape).copy_(gi)
            else:
                q.grad = gi.clone()
        theirs.step()
        if step == 1:  # from here on every step must reuse the plan
            monkeypatch.setattr(ours, "_build", lambda: builds.append(1))
        ours.step()
        assert not builds, "the plan was rebuilt for new gradient pointers"
        if step == 3:
            assert not ours._plans[0].table.aligned.all()  # type: ignore[union-attr]
        assert [int(x) for x in ours._plans[0].table.host[ours._plans[0].table.T:2 * ours._plans[0].table.T]] == [
            q.grad.data_ptr() for q in ours._plans[0].params]  # type: ignore[union-attr]
    for x, y in zip(b, a, strict=True):  # the misaligned step ran the scalar path: same maths
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
