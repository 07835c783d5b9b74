"""Argument checks of every cukit.optim optimizer (optim/_checks.py): a wrong type is a TypeError, a
value out of torch's range a ValueError, both at construction (or in add_param_group) and naming
the class and the argument; what torch accepts (a 1-element tensor lr, ints, numpy floats) still
works, and so do LR schedulers."""

from __future__ import annotations

import math
from typing import Any

import cukit.optim as co
import numpy as np
import pytest

torch = pytest.importorskip("torch")

OPTIMIZERS = ["AdamW", "Adam", "SGD", "Lion", "LAMB", "Adagrad"]

# (kwargs, exception, argument named in the message): for every optimizer
COMMON: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"lr": "1e-3"}, TypeError, "lr"),
    ({"lr": None}, TypeError, "lr"),
    ({"lr": True}, TypeError, "lr"),
    ({"lr": [0.1]}, TypeError, "lr"),
    ({"lr": -1e-3}, ValueError, "lr"),
    ({"lr": -1}, ValueError, "lr"),
    ({"lr": math.nan}, ValueError, "lr"),
    ({"lr": torch.tensor([1e-3, 2e-3])}, ValueError, "lr"),
    ({"lr": torch.tensor(-1e-3)}, ValueError, "lr"),
    ({"lr": torch.tensor(1)}, TypeError, "lr"),
    ({"maximize": "False"}, TypeError, "maximize"),
    ({"maximize": 1}, TypeError, "maximize"),
    ({"max_grad_norm": "1"}, TypeError, "max_grad_norm"),
    ({"max_grad_norm": True}, TypeError, "max_grad_norm"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ({"state_dtype": torch.float16}, TypeError, "state_dtype"),  # float32 params: float32 or bfloat16
    ({"state_dtype": torch.int32}, TypeError, "state_dtype"),
    ({"state_dtype": "float32"}, TypeError, "state_dtype"),
    ({"state_dtype": np.float32}, TypeError, "state_dtype"),
    ({"flat_grads": "yes"}, TypeError, "flat_grads"),
    ({"master_weights": 1}, TypeError, "master_weights"),
]

SPECIFIC: dict[str, list[tuple[dict[str, Any], type[Exception], str]]] = {
    "Adam": [
        ({"betas": (0.9, 1.0)}, ValueError, "betas[1]"),
        ({"betas": (-0.1, 0.999)}, ValueError, "betas[0]"),
        ({"betas": ("0.9", 0.999)}, TypeError, "betas[0]"),
        ({"betas": 0.9}, TypeError, "betas"),
        ({"betas": "0.9, 0.999"}, TypeError, "betas"),
        ({"betas": (0.9,)}, ValueError, "betas"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"eps": "1e-8"}, TypeError, "eps"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"weight_decay": None}, TypeError, "weight_decay"),
        ({"amsgrad": "False"}, TypeError, "amsgrad"),
        ({"foreach": "True"}, TypeError, "foreach"),
        ({"capturable": None}, TypeError, "capturable"),
        ({"fused": 1}, TypeError, "fused"),
        ({"differentiable": True}, ValueError, "differentiable"),
    ],
    "SGD": [
        ({"lr": 0.1, "momentum": -0.9}, ValueError, "momentum"),
        ({"lr": 0.1, "momentum": "0.9"}, TypeError, "momentum"),
        ({"lr": 0.1, "dampening": None}, TypeError, "dampening"),
        ({"lr": 0.1, "weight_decay": -1e-4}, ValueError, "weight_decay"),
        ({"lr": 0.1, "nesterov": True}, ValueError, "nesterov"),
        ({"lr": 0.1, "nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, "nesterov"),
        ({"lr": 0.1, "nesterov": "True", "momentum": 0.9}, TypeError, "nesterov"),
        ({"lr": 0.1, "foreach": "no"}, TypeError, "foreach"),
    ],
    "Lion": [
        ({"betas": (0.9, 1.01)}, ValueError, "betas[1]"),
        ({"betas": [0.9]}, ValueError, "betas"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"weight_decay": "0.1"}, TypeError, "weight_decay"),
    ],
    "LAMB": [
        ({"betas": (1.0, 0.999)}, ValueError, "betas[0]"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"weight_decay": -0.01}, ValueError, "weight_decay"),
        ({"bias_correction": "yes"}, TypeError, "bias_correction"),
        ({"capturable": 0}, TypeError, "capturable"),
    ],
    "Adagrad": [
        ({"lr_decay": -0.1}, ValueError, "lr_decay"),
        ({"lr_decay": "0"}, TypeError, "lr_decay"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"initial_accumulator_value": -1.0}, ValueError, "initial_accumulator_value"),
        ({"initial_accumulator_value": None}, TypeError, "initial_accumulator_value"),
        ({"eps": -1e-10}, ValueError, "eps"),
        ({"foreach": "yes"}, TypeError, "foreach"),
    ],
}
SPECIFIC["AdamW"] = SPECIFIC["Adam"]

BAD = [(name, *case) for name in OPTIMIZERS for case in COMMON + SPECIFIC[name]]

# the 8-bit and 4-bit optimizers (tests/optim/test_lowbit.py): their twin's checks, and state_dtype
# refused outright (the states are quantised)
LOWBIT = {"AdamW8bit": "AdamW", "Adam8bit": "Adam", "AdamW4bit": "AdamW", "Lion8bit": "Lion", "SGD8bit": "SGD"}
_SGD8 = [c for c in SPECIFIC["SGD"] if "nesterov" not in c[0] or "momentum" in c[0]]  # momentum defaults to 0.9
BAD += [
    (name, *case)
    for name, twin in LOWBIT.items()
    for case in COMMON + (_SGD8 if twin == "SGD" else SPECIFIC[twin])
]
BAD += [
    ("SGD8bit", {"momentum": 0.0}, ValueError, "momentum"),
    ("AdamW8bit", {"min_8bit_size": "4096"}, TypeError, "min_8bit_size"),
    ("AdamW8bit", {"master_weights": "bf16"}, ValueError, "master_weights"),
    ("AdamW8bit", {"amsgrad": True}, ValueError, "amsgrad"),
]


def params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        torch.zeros(4, 3, dtype=dtype, requires_grad=True),
        torch.zeros(3, dtype=dtype, requires_grad=True),
    ]


def test_every_exported_optimizer_is_covered() -> None:
    exported = {
        n
        for n in co.__all__
        if isinstance(getattr(co, n), type) and issubclass(getattr(co, n), co.MultiTensorOptimizer)
    }
    assert exported - {"MultiTensorOptimizer"} == set(OPTIMIZERS) | set(LOWBIT)


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "arg"),
    BAD,
    ids=[f"{n}-{'-'.join(map(str, k))}-{i}" for i, (n, k, _, _) in enumerate(BAD)],
)
def test_bad_argument_raises_naming_class_and_argument(
    name: str, kwargs: dict[str, Any], error: type[Exception], arg: str
) -> None:
    with pytest.raises(error) as info:
        getattr(co, name)(params(), **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{name}: "), msg
    assert arg in msg, msg


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_add_param_group_checks_the_group(name: str) -> None:
    opt = getattr(co, name)(params(), lr=0.1)
    for group, error, arg in [
        ({"lr": "0.1"}, TypeError, "lr"),
        ({"lr": -0.1}, ValueError, "lr"),
        ({"maximize": "yes"}, TypeError, "maximize"),
    ]:
        with pytest.raises(error, match=rf"^{name} \(param group 1\): {arg} "):
            opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], **group})
    with pytest.raises(
        TypeError, match=rf"^{name}: parameters must be float16, bfloat16, float32 or float64"
    ):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int64)]})
    assert len(opt.param_groups) == 1  # nothing half-added
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": 0.01})
    assert opt.param_groups[1]["lr"] == 0.01


def test_add_param_group_checks_combinations_and_state_dtype() -> None:
    opt = co.SGD(params(), lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match=r"^SGD \(param group 1\): nesterov"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "momentum": 0.0})
    adam = co.AdamW(params(), state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^AdamW: state_dtype torch.bfloat16 is not supported for float64"):
        adam.add_param_group({"params": [torch.zeros(2, dtype=torch.float64, requires_grad=True)]})
    assert len(opt.param_groups) == 1 and len(adam.param_groups) == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_what_torch_accepts_still_works(name: str) -> None:
    """int, numpy and 1-element tensor learning rates; supported state dtypes; steps run."""
    for lr in (1, np.float32(0.01), np.float64(0.01), torch.tensor(0.01), torch.tensor([0.01])):
        ps = params()
        opt = getattr(co, name)(ps, lr=lr, max_grad_norm=1)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(not torch.equal(p.detach(), torch.zeros_like(p)) for p in ps)
    getattr(co, name)(params(), state_dtype=torch.bfloat16)
    getattr(co, name)(params(torch.bfloat16), state_dtype=torch.float32, master_weights=True)
    getattr(co, name)(params(torch.float16), state_dtype=torch.float16)
    getattr(co, name)(params(torch.float64), state_dtype=torch.float64)


def test_tensor_betas_still_work() -> None:
    ps = params()
    opt = co.Adam(ps, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_lr_scheduler(name: str) -> None:
    ps = params()
    opt = getattr(co, name)(ps, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert sched.get_last_lr() == [pytest.approx(0.025)]


def test_functional_form_checks_every_call() -> None:
    from cukit.optim import functional as F

    p, g = [torch.zeros(3)], [torch.ones(3)]
    m, v, t = [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(())]
    with pytest.raises(TypeError, match=r"^AdamW: lr"):
        F.adamw(p, g, m, v, t, lr="1e-3")  # type: ignore[arg-type]
    F.adamw(p, g, m, v, t, lr=1e-3)
    with pytest.raises(ValueError, match=r"^AdamW: betas"):
        F.adamw(p, g, m, v, t, lr=1e-3, beta2=1.5)  # the cached optimizer checks too
