"""float64 parameters keep float64 precision (issue 13, item 1): every option set of every
optimizer, step by step against torch's single-tensor implementations (``foreach=False``) for Adam,
AdamW, SGD and Adagrad, and against float64 implementations written here for Lion and LAMB (torch
has neither). float64 agrees to float64 rounding (1e-13 after 7 steps); float32 to float32's.

Tensor hyperparameters (lr, betas, SGD's weight_decay) are tensors of the parameters' dtype on their
device, as a user would make them. ``capturable=True`` is compared with torch's capturable path on
CUDA; torch refuses it on the CPU, where it is compared with torch's plain path (torch's
implementations agree with each other to 1e-15). torch's capturable path keeps ``step`` in the
default dtype, so under a float32 default its bias corrections ``1 - beta**step`` are rounded to
float32 (a 1e-7 relative error in float64 parameters); cukit computes them in float64, and the
comparison runs torch's capturable steps with float64 as the default dtype, where torch is exact too. Every test runs on "cpu" (the reference path) and
"cuda" (the kernels; marked gpu).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import cukit.optim as co
import pytest

torch = pytest.importorskip("torch")

STEPS = 7
SKIP_STEP = 3  # params[0] has no grad on this step
SHAPES = [(5, 3), (0,), (7,), (33, 9), (1,), (130,), (4097,)]
DTYPES = [torch.float32, torch.float64]
# (rtol, atol) per dtype: float64 is the issue's target, float32 the existing parity tests' bound
TOL = {torch.float64: (1e-13, 1e-13), torch.float32: (2e-5, 2e-6)}


# ---------------------------------------------------------------------------- option sets
def _adam_cases() -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    out: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []
    for name in ("Adam", "AdamW"):
        for amsgrad in (False, True):
            for maximize in (False, True):
                for wd in (0.0, 0.1):
                    out.append(
                        (name, {"lr": 0.01, "amsgrad": amsgrad, "maximize": maximize, "weight_decay": wd}, ())
                    )
        base = {"lr": 0.01, "weight_decay": 0.1}
        out += [
            (name, {**base, "betas": (0.3, 0.95), "eps": 1e-6}, ()),  # lerp weight above 0.5
            (name, {**base, "capturable": True}, ()),
            (name, {**base, "amsgrad": True, "capturable": True}, ()),
            (name, base, ("lr",)),
            (name, {**base, "capturable": True}, ("lr",)),
            (name, {**base, "betas": (0.8, 0.95)}, ("betas",)),
            (name, {**base, "amsgrad": True, "maximize": True, "capturable": True}, ("lr", "betas")),
        ]
    return out


def _sgd_cases() -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    out: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []
    for maximize in (False, True):
        for wd in (0.0, 0.1):
            out.append(("SGD", {"lr": 0.05, "weight_decay": wd, "maximize": maximize}, ()))
            for dampening in (0.0, 0.3):
                out.append(
                    (
                        "SGD",
                        {
                            "lr": 0.05,
                            "momentum": 0.9,
                            "dampening": dampening,
                            "weight_decay": wd,
                            "maximize": maximize,
                        },
                        (),
                    )
                )
            out.append(
                (
                    "SGD",
                    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": wd, "maximize": maximize},
                    (),
                )
            )
    out += [
        ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}, ("lr",)),
        ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}, ("lr", "weight_decay")),
    ]
    return out


def _adagrad_cases() -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    out: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []
    for lr_decay in (0.0, 0.01):
        for wd in (0.0, 0.1):
            for maximize in (False, True):
                out.append(
                    (
                        "Adagrad",
                        {"lr": 0.05, "lr_decay": lr_decay, "weight_decay": wd, "maximize": maximize},
                        (),
                    )
                )
    out += [
        ("Adagrad", {"lr": 0.05, "initial_accumulator_value": 0.2, "eps": 1e-8}, ()),
        ("Adagrad", {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.1}, ("lr",)),
    ]
    return out


TORCH_CASES = _adam_cases() + _sgd_cases() + _adagrad_cases()


def _case_id(case: tuple[str, dict[str, Any], tuple[str, ...]]) -> str:
    name, kw, tensors = case
    parts = [name, *(f"{k}={v}" for k, v in kw.items() if k != "lr")]
    parts += [f"tensor_{t}" for t in tensors]
    return "-".join(parts).replace(" ", "")


def _hyper(kw: dict[str, Any], tensors: tuple[str, ...], device: str, dtype: torch.dtype) -> dict[str, Any]:
    """`kw` with the arguments named in `tensors` as tensors of `dtype` on `device`."""
    out = dict(kw)
    for k in tensors:
        v = out.get(k, (0.9, 0.999) if k == "betas" else None)
        if k == "betas":
            out[k] = tuple(torch.tensor(x, dtype=dtype, device=device) for x in v)
        else:
            out[k] = torch.tensor(v, dtype=dtype, device=device)
    return out


# ---------------------------------------------------------------------------- helpers
def make_params(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
        for s in SHAPES
    ]


def groups_of(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Two param groups in one launch, the second with its own (float) lr."""
    return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.03}]


def set_grads(plists: list[list[torch.Tensor]], g: torch.Generator, step: int) -> None:
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in plists[0]]
    for ps in plists:
        for i, p in enumerate(ps):
            p.grad = None if (i == 0 and step == SKIP_STEP) else grads[i].to(device=p.device, dtype=p.dtype)


def assert_close(got: Any, want: Any, dtype: torch.dtype, what: str) -> None:
    """`got` == `want` within the tolerance of `dtype` (float64: the issue's 1e-13), same dtypes."""
    rtol, atol = TOL[dtype]
    got, want = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    torch.testing.assert_close(
        got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


# ---------------------------------------------------------------------------- against torch
@contextlib.contextmanager
def _torch_exact_step(dtype: torch.dtype) -> Iterator[None]:
    """torch's optimizer steps with `dtype` as the default dtype: for float64 parameters its
    capturable path then keeps ``step`` (and so its bias corrections) in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize(("name", "kwargs", "tensors"), TORCH_CASES, ids=[_case_id(c) for c in TORCH_CASES])
def test_matches_torch_single_tensor_step_by_step(
    device: str, dtype: torch.dtype, name: str, kwargs: dict[str, Any], tensors: tuple[str, ...]
) -> None:
    base = make_params(device, dtype)
    a = [p.detach().clone().requires_grad_() for p in base]
    b = [p.detach().clone().requires_grad_() for p in base]
    ours = getattr(co, name)(groups_of(b), **_hyper(kwargs, tensors, device, dtype))
    theirs_kw = dict(kwargs)
    if device == "cpu":
        theirs_kw.pop("capturable", None)  # torch's capturable path refuses CPU tensors
    theirs = getattr(torch.optim, name)(
        groups_of(a), foreach=False, **_hyper(theirs_kw, tensors, device, dtype)
    )
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads([a, b], g, step)
        with _torch_exact_step(dtype):
            theirs.step()
        ours.step()
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            assert_close(pb, pa, dtype, f"step {step}, param {i}")
            sa, sb = theirs.state[pa], ours.state[pb]
            assert set(sa) == set(sb), (set(sa), set(sb))
            for k in sa:
                if k == "step":  # a count: its dtype follows torch's default dtype (see above)
                    assert float(sb[k]) == float(sa[k]), (step, i, float(sb[k]), float(sa[k]))
                else:
                    assert_close(sb[k], sa[k], dtype, f"step {step}, {k} {i}")


# ---------------------------------------------------------------------------- Lion and LAMB
class Lion64:
    """lion-pytorch's update in float64 with Python-float hyperparameters:
    ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g); m = b2 m + (1-b2) g``."""

    def __init__(
        self,
        ps: list[torch.Tensor],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        maximize: bool,
    ) -> None:
        self.ps, self.lr, self.b1, self.b2, self.wd, self.maximize = ps, lr, *betas, weight_decay, maximize
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.ps:
            if p.grad is None:
                continue
            st = self.state.setdefault(p, {"exp_avg": torch.zeros_like(p, dtype=torch.float64)})
            m = st["exp_avg"]
            g = -p.grad.double() if self.maximize else p.grad.double()
            u = (m * self.b1 + g * (1 - self.b1)).sign()
            p.copy_(p.double() * (1 - self.lr * self.wd) - self.lr * u)
            st["exp_avg"] = m * self.b2 + g * (1 - self.b2)


class Lamb64:
    """LAMB (You et al. 2020, Algorithm 2, phi = identity) in float64 with Python-float
    hyperparameters: ``u = m̂ / (sqrt(v̂) + eps) + wd p; p -= lr (‖p‖ / ‖u‖) u`` (ratio 1 when a
    norm is 0), bias corrections ``1 - b^t`` or none."""

    def __init__(
        self,
        ps: list[torch.Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        maximize: bool,
    ) -> None:
        self.ps, self.lr, self.b1, self.b2, self.eps = ps, lr, *betas, eps
        self.wd, self.bc, self.maximize = weight_decay, bias_correction, maximize
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.ps:
            if p.grad is None:
                continue
            zeros = torch.zeros_like(p, dtype=torch.float64)
            st = self.state.setdefault(p, {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros.clone()})
            st["step"] += 1
            t = st["step"]
            g = -p.grad.double() if self.maximize else p.grad.double()
            w = p.double()
            st["exp_avg"] = self.b1 * st["exp_avg"] + (1 - self.b1) * g
            st["exp_avg_sq"] = self.b2 * st["exp_avg_sq"] + (1 - self.b2) * g * g
            bc1, bc2 = (1 - self.b1**t, 1 - self.b2**t) if self.bc else (1.0, 1.0)
            u = (st["exp_avg"] / bc1) / ((st["exp_avg_sq"] / bc2).sqrt() + self.eps) + self.wd * w
            wn, un = float(w.norm()), float(u.norm())
            r = wn / un if wn > 0 and un > 0 else 1.0
            p.copy_(w - self.lr * r * u)


LION_CASES: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    *(
        ({"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": wd, "maximize": mx}, ())
        for wd in (0.0, 0.1)
        for mx in (False, True)
    ),
    ({"lr": 0.01, "betas": (0.95, 0.98), "weight_decay": 0.1, "maximize": False}, ("lr", "betas")),
]

LAMB_CASES: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    *(
        (
            {
                "lr": 0.01,
                "betas": (0.9, 0.999),
                "eps": 1e-6,
                "weight_decay": wd,
                "bias_correction": bc,
                "maximize": mx,
            },
            (),
        )
        for wd in (0.0, 0.01)
        for bc in (True, False)
        for mx in (False, True)
    ),
    (
        {
            "lr": 0.01,
            "betas": (0.8, 0.99),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "bias_correction": True,
            "maximize": False,
            "capturable": True,
        },
        ("lr", "betas"),
    ),
]


def _run_against(
    device: str, dtype: torch.dtype, make_ours: Any, make_ref: Any, keys: tuple[str, ...]
) -> None:
    """Steps cukit's optimizer on params of `dtype` and the float64 reference on float64 copies of
    them, with the same gradients; compares the params and `keys` of the state after each step."""
    base = make_params(device, dtype)
    a = [p.detach().double().requires_grad_() for p in base]
    b = [p.detach().clone().requires_grad_() for p in base]
    ours, ref = make_ours(b), make_ref(a)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads([a, b], g, step)
        ref.step()
        ours.step()
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            assert_close(pb.double(), pa, dtype, f"step {step}, param {i}")
            if pa in ref.state:
                for k in keys:
                    assert_close(ours.state[pb][k].double(), ref.state[pa][k], dtype, f"step {step}, {k} {i}")


def _plain(kw: dict[str, Any]) -> dict[str, Any]:
    """The reference's arguments: `kw` without cukit's ``capturable`` (which changes nothing)."""
    return {k: v for k, v in kw.items() if k != "capturable"}


@pytest.mark.parametrize(("kwargs", "tensors"), LION_CASES, ids=[f"lion{i}" for i in range(len(LION_CASES))])
def test_lion_matches_float64_reference_step_by_step(
    device: str, kwargs: dict[str, Any], tensors: tuple[str, ...]
) -> None:
    """float64 only: in float32, sign() parts the trajectories wherever b1 m + (1-b1) g is tiny."""
    dtype = torch.float64
    _run_against(
        device,
        dtype,
        lambda ps: co.Lion(ps, **_hyper(kwargs, tensors, device, dtype)),
        lambda ps: Lion64(ps, **_plain(kwargs)),
        ("exp_avg",),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize(("kwargs", "tensors"), LAMB_CASES, ids=[f"lamb{i}" for i in range(len(LAMB_CASES))])
def test_lamb_matches_float64_reference_step_by_step(
    device: str, dtype: torch.dtype, kwargs: dict[str, Any], tensors: tuple[str, ...]
) -> None:
    _run_against(
        device,
        dtype,
        lambda ps: co.LAMB(ps, **_hyper(kwargs, tensors, device, dtype)),
        lambda ps: Lamb64(ps, **_plain(kwargs)),
        ("exp_avg", "exp_avg_sq"),
    )


# ---------------------------------------------------------------------------- the engine's scalars
def test_hyperparameters_travel_as_float64() -> None:
    """The launch arguments carry float64 (the kernels round them to float32 for float launches)."""
    from cukit.optim import _engine as eng
    from cukit.optim._kernels import MT_PARAMS

    assert MT_PARAMS.split()[6:14] == ["f64"] * 8
    hp = eng.hp_tensor((0.9, 0.999, 1e-8), "cpu")
    assert hp.dtype == torch.float64 and hp.tolist() == [0.9, 0.999, 1e-8]


def test_float32_rounding_is_unchanged() -> None:
    """float32 params still see float32 hyperparameters: an lr that float32 rounds gives the same
    float32 step as its rounding."""
    lr = 0.1 + 2**-30  # float32 rounds it to 0.1f's neighbour
    lr32 = float(torch.tensor(lr, dtype=torch.float32))
    assert lr != lr32
    outs = []
    for value in (lr, lr32):
        p = torch.ones(5, requires_grad=True)
        opt = co.SGD([p], lr=value)
        p.grad = torch.full((5,), 0.37)
        opt.step()
        outs.append(p.detach().clone())
    assert torch.equal(outs[0], outs[1])
    # and float64 params do not round it
    q = torch.ones(5, dtype=torch.float64, requires_grad=True)
    q.grad = torch.full((5,), 0.37, dtype=torch.float64)
    co.SGD([q], lr=lr).step()
    assert torch.equal(q.detach(), torch.full((5,), 1.0 - lr * 0.37, dtype=torch.float64))


# ---------------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("amsgrad", [False, True])
def test_float64_capture_with_tensor_lr_matches_torch_capturable(amsgrad: bool) -> None:
    """A captured float64 AdamW step with a float64 lr tensor that changes between replays (a
    scheduler writing it in place) follows torch's capturable single-tensor AdamW to 1e-13 (torch's
steps run with float64 as the default dtype: see the module's docstring)."""
    base = make_params("cuda", torch.float64)
    a = [p.detach().clone().requires_grad_() for p in base]
    b = [p.detach().clone().requires_grad_() for p in base]
    lr_a = torch.tensor(0.01, dtype=torch.float64, device="cuda")
    lr_b = lr_a.clone()
    theirs = torch.optim.AdamW(a, lr=lr_a, weight_decay=0.1, amsgrad=amsgrad, capturable=True, foreach=False)
    ours = co.AdamW(b, lr=lr_b, weight_decay=0.1, amsgrad=amsgrad, capturable=True)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64).cuda() for p in a]
    for p, q, gi in zip(a, b, grads, strict=True):
        p.grad, q.grad = gi.clone(), gi.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compiles the kernels and builds the tables
        ours.step()
    torch.cuda.current_stream().wait_stream(s)
    with _torch_exact_step(torch.float64):
        theirs.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours.step()
    for step in range(1, STEPS):
        new_lr = 0.01 * 0.7**step + 1e-9 * math.pi  # not a float32 value
        lr_a.fill_(new_lr)
        lr_b.fill_(new_lr)
        for p, q in zip(a, b, strict=True):
            gi = torch.randn(p.shape, generator=g, dtype=torch.float64).cuda()
            p.grad.copy_(gi)  # type: ignore[union-attr]
            q.grad.copy_(gi)  # type: ignore[union-attr]
        graph.replay()
        with _torch_exact_step(torch.float64):
            theirs.step()
        torch.cuda.synchronize()
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            assert_close(pb, pa, torch.float64, f"step {step}, param {i}")
            for k in ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if amsgrad else ())):
                assert_close(ours.state[pb][k], theirs.state[pa][k], torch.float64, f"step {step}, {k} {i}")
