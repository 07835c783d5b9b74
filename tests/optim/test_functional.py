"""cukit.optim.functional: the list-level forms of every optimizer's spec. Checked against the
classes (the same functional step, so the same bits) and against torch's own functional forms in
float64 (foreach=False, to float64 rounding), with mixed dtypes in one call, tensor lr, clipping,
and the errors of bad lists. Every test runs on "cpu" (the reference path) and on "cuda" (the
kernels; marked gpu)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cukit.optim as co
import pytest
from cukit.optim import functional as F

import cukit

torch = pytest.importorskip("torch")

GPU = cukit.is_available() and torch.cuda.is_available()

SHAPES = [(5, 3), (0,), (7,), (33, 9), (130,)]

# name: (functional form, optimizer class, class kwargs, functional kwargs, state names, counts steps)
CASES: dict[str, tuple[Callable[..., None], type, dict[str, Any], dict[str, Any], tuple[str, ...], bool]] = {
    "adamw": (F.adamw, co.AdamW, {"lr": 0.01, "betas": (0.8, 0.95), "weight_decay": 0.1},
              {"lr": 0.01, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.1}, ("exp_avg", "exp_avg_sq"), True),
    "adam-amsgrad": (F.adam, co.Adam, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True, "maximize": True},
                     {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True, "maximize": True},
                     ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), True),
    "sgd-nesterov": (F.sgd, co.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                     {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, ("momentum_buffer",),
                     False),
    "sgd-plain": (F.sgd, co.SGD, {"lr": 0.05}, {"lr": 0.05}, (), False),
    "lion": (F.lion, co.Lion, {"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.1},
             ("exp_avg",), False),
    "adagrad": (F.adagrad, co.Adagrad, {"lr": 0.05, "lr_decay": 0.01}, {"lr": 0.05, "lr_decay": 0.01}, ("sum",),
                True),
    "lamb": (F.lamb, co.LAMB, {"lr": 0.01, "weight_decay": 0.02}, {"lr": 0.01, "weight_decay": 0.02},
             ("exp_avg", "exp_avg_sq"), True),
}


def params_on(device: str, dtypes: tuple[torch.dtype, ...] = (torch.float32,), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtypes[i % len(dtypes)])
            for i, s in enumerate(SHAPES)]


def grads_like(ps: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64).to(device=p.device, dtype=p.dtype) for p in ps]


def call(name: str, ps: list[torch.Tensor], gs: list[torch.Tensor], states: dict[str, list[torch.Tensor]],
         steps: list[torch.Tensor] | None, **extra: Any) -> None:
    fn, _, _, fkw, _, _ = CASES[name]
    args: list[Any] = [ps, gs]
    kw = {**fkw, **extra}
    if name.startswith("adam"):
        args += [states["exp_avg"], states["exp_avg_sq"], steps]
        if "max_exp_avg_sq" in states:
            kw["max_exp_avg_sqs"] = states["max_exp_avg_sq"]
    elif name.startswith("sgd"):
        args += [states.get("momentum_buffer")]
    elif name == "lion":
        args += [states["exp_avg"]]
    elif name == "adagrad":
        args += [states["sum"], steps]
    else:
        args += [states["exp_avg"], states["exp_avg_sq"], steps]
    fn(*args, **kw)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16, torch.float64)],
                         ids=["float32", "mixed"])
def test_functional_matches_the_class(device: str, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Four steps of the functional form on the caller's lists and of the class on copies: the same
    spec step, so bit-equal params, states and step counts (SGD's buffers start as the class's
    first step leaves them)."""
    _, cls, ckw, _, names, has_steps = CASES[name]
    ps = params_on(device, dtypes)
    qs = [p.clone().requires_grad_() for p in ps]
    opt = cls(qs, **ckw)
    states: dict[str, list[torch.Tensor]] = {k: [torch.zeros_like(p) for p in ps] for k in names}
    steps = [torch.zeros((), device=device) for _ in ps] if has_steps else None
    for k in range(4):
        gs = grads_like(ps, 10 + k)
        for q, g in zip(qs, gs, strict=True):
            q.grad = g.clone()
        opt.step()
        if k == 0 and name.startswith("sgd") and names:
            states["momentum_buffer"] = [opt.state[q]["momentum_buffer"].clone() for q in qs]
            for p, q in zip(ps, qs, strict=True):
                p.copy_(q.detach())  # the class's first step, taken here from its result
            continue
        call(name, ps, gs, states, steps)
    for i, (p, q) in enumerate(zip(ps, qs, strict=True)):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=0, msg=f"param {i}")
        for k in names:
            torch.testing.assert_close(states[k][i], opt.state[q][k], rtol=0, atol=0, msg=f"{k} {i}")
    if steps is not None:
        assert [float(s) for s in steps] == [4.0] * len(ps)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_forms_match_torch_in_float64(device: str, amsgrad: bool, decoupled: bool) -> None:
    """float64 lists against torch.optim.adam(w).adam(w) single-tensor: 7 steps to 1e-13."""
    from torch.optim.adam import adam as t_adam
    from torch.optim.adamw import adamw as t_adamw

    ps = params_on(device, (torch.float64,))
    ref = [p.clone() for p in ps]
    n = len(ps)
    st = {k: [[torch.zeros_like(p) for p in ps] for _ in range(2)] for k in ("m", "v", "vmax")}
    steps = [[torch.zeros((), dtype=torch.float32, device=device) for _ in range(n)] for _ in range(2)]
    tsteps = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
    kw = dict(lr=0.01, beta1=0.85, beta2=0.97, eps=1e-8, weight_decay=0.03, amsgrad=amsgrad, maximize=False)
    for k in range(7):
        gs = grads_like(ps, 20 + k)
        (F.adamw if decoupled else F.adam)(ps, gs, st["m"][0], st["v"][0], steps[0],
                                           max_exp_avg_sqs=st["vmax"][0] if amsgrad else None, **kw)
        (t_adamw if decoupled else t_adam)(ref, gs, st["m"][1], st["v"][1], st["vmax"][1], tsteps, foreach=False,
                                           capturable=False, differentiable=False, fused=None, grad_scale=None,
                                           found_inf=None, has_complex=False, **kw)
    for i in range(n):
        torch.testing.assert_close(ps[i], ref[i], rtol=1e-13, atol=1e-13, msg=f"param {i}")
    assert [float(s) for s in steps[0]] == [7.0] * n


def test_tensor_lr_and_clipping_match_the_class(device: str) -> None:
    """lr as a tensor and max_grad_norm: the class and the form agree (clipping over every list)."""
    ps = params_on(device)
    qs = [p.clone().requires_grad_() for p in ps]
    lr = torch.tensor(0.02, dtype=torch.float64, device=device)
    opt = co.AdamW(qs, lr=lr, max_grad_norm=0.5)
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    t = [torch.zeros((), device=device) for _ in ps]
    for k in range(3):
        gs = grads_like(ps, 30 + k)
        for q, g in zip(qs, gs, strict=True):
            q.grad = g.clone()
        opt.step()
        F.adamw(ps, gs, m, v, t, lr=lr, max_grad_norm=0.5)
        lr.mul_(0.5)  # a scheduler's in-place update reaches both
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=0)


def test_step_counts_on_the_cpu_follow_the_caller(device: str) -> None:
    """float32 CPU step tensors (torch's default) work with CUDA params, and a caller's reset of a
    count (set back to 0) is what the next step sees."""
    ps = params_on(device)
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = [torch.zeros(()) for _ in ps]
    for k in range(2):
        F.adamw(ps, grads_like(ps, k), m, v, t)
    assert [float(s) for s in t] == [2.0] * len(ps)
    t[2].zero_()
    F.adamw(ps, grads_like(ps, 5), m, v, t)
    assert [float(s) for s in t] == [3.0, 3.0, 1.0, 3.0, 3.0]


def test_bad_lists_are_refused(device: str) -> None:
    ps = params_on(device)
    gs = grads_like(ps, 1)
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    t = [torch.zeros((), device=device) for _ in ps]
    with pytest.raises(ValueError, match=r"^AdamW: params and grads must have the same length; got 5 and 4"):
        F.adamw(ps, gs[:4], m, v, t)
    with pytest.raises(ValueError, match=r"^AdamW: exp_avg_sq must have one tensor per param; got 3 for 5"):
        F.adamw(ps, gs, m, v[:3], t)
    with pytest.raises(ValueError, match=r"^AdamW: the max_exp_avg_sq lists are required"):
        F.adamw(ps, gs, m, v, t, amsgrad=True)
    with pytest.raises(ValueError, match=r"^SGD: the momentum_buffer lists are required"):
        F.sgd(ps, gs, None, momentum=0.9)
    with pytest.raises(ValueError, match=r"^AdamW: grads\[3\] must match params\[3\]"):
        F.adamw(ps, [*gs[:3], gs[3].T.contiguous(), gs[4]], m, v, t)
    with pytest.raises(ValueError, match=r"^AdamW: exp_avg\[2\] must be a floating tensor of params\[2\]'s shape"):
        F.adamw(ps, gs, [*m[:2], torch.zeros(8, device=device), *m[3:]], v, t)
    with pytest.raises(TypeError, match=r"^AdamW: grads\[1\] must be a torch.Tensor or cupy.ndarray; got list"):
        F.adamw(ps, [gs[0], [1.0], *gs[2:]], m, v, t)
    with pytest.raises(TypeError, match=r"^AdamW: params must be a list of tensors; got Tensor"):
        F.adamw(ps[0], gs, m, v, t)
    with pytest.raises(ValueError, match=r"^SGD: nesterov=True needs momentum > 0"):
        F.sgd(ps, gs, None, nesterov=True)
    with pytest.raises(ValueError, match=r"^Lion: max_grad_norm"):
        F.lion(ps, gs, m, max_grad_norm=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_non_contiguous_lists_are_refused_on_the_gpu() -> None:
    p = [torch.zeros(6, 4, device="cuda").T]
    with pytest.raises(ValueError, match=r"^Lion: params\[0\] is not contiguous"):
        F.lion(p, [torch.zeros(4, 6, device="cuda")], [torch.zeros(4, 6, device="cuda")])


def test_a_reallocated_list_of_another_size_gets_its_own_table(device: str) -> None:
    """The cache is keyed by address, size, dtype and layout: tensors freed and reallocated at the
    same addresses with other sizes (torch's caching allocator reuses blocks) are stepped right."""
    for n in (10, 300, 7):
        ps = [torch.ones(n, device=device)]
        gs = [torch.full((n,), 2.0, device=device)]
        bufs = [torch.zeros(n, device=device)]
        F.sgd(ps, gs, bufs, lr=0.5, momentum=0.5)
        torch.testing.assert_close(ps[0], torch.zeros(n, device=device))
        torch.testing.assert_close(bufs[0], torch.full((n,), 2.0, device=device))
        del ps, gs, bufs
