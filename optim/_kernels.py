"""The kernel modules of cukit.optim: every instantiation of raw_kernels/{adam,sgd,lion,lamb,adagrad,
shampoo,multi_tensor_l2norm}.cu, declared once here so that ``cukit check-kernels`` compiles them all offline.

Imports neither torch nor CuPy (``cukit check-kernels`` imports it on machines without either).
"""

from __future__ import annotations

from cukit._runtime import KernelModule
from cukit.interop import DTYPES

__all__ = [
    "ADAGRAD",
    "ADAM",
    "COMBOS",
    "L2NORM",
    "LAMB",
    "LION",
    "MT_PARAMS",
    "SGD",
    "SHAMPOO",
    "combo_key",
]

# The arguments every update kernel starts with: CUKIT_MT_PARAMS in multi_tensor.cuh. The lrs travel
# as double (the kernel rounds them to its accumulation type), so float64 launches see them exactly.
MT_PARAMS = "ptr i64 i64 i64 ptr i64 " + "f64 " * 8 + "ptr ptr ptr ptr"

# (param dtype, state dtype, float32 master weights): the storage combinations the kernels are
# built for. float32 params keep float32 (default) or bfloat16 state; 16-bit params keep their own
# dtype (torch's default) or float32 state, with or without float32 master weights; float64 is
# float64 throughout.
COMBOS: tuple[tuple[str, str, bool], ...] = (
    ("float32", "float32", False),
    ("float32", "bfloat16", False),
    ("float64", "float64", False),
    *((p, s, m) for p in ("float16", "bfloat16") for s in (p, "float32") for m in (False, True)),
)


def combo_key(param: str, state: str, master: bool) -> str:
    """The instantiation group of one storage combination, e.g. ``bfloat16/float32/master``."""
    return f"{param}/{state}" + ("/master" if master else "")


def _c(name: str) -> str:
    return DTYPES[name].ctype


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def _groups(make: object) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p, s, m in COMBOS:
        out[combo_key(p, s, m)] = list(make(_c(p), _c(s), _b(m)))  # type: ignore[operator]
    return out


# Blockwise-quantised states (optim/lowbit.py): parameter dtype, code bits, master weights (0 none,
# 1 float32 copy for 16-bit parameters, 2 int8 residual for bfloat16 ones).
LOWBIT_DTYPES = ("float32", "float16", "bfloat16")
LOWBIT_BITS = (8, 4)


def lowbit_masters(param: str) -> tuple[int, ...]:
    """The master-weight modes the quantised kernels are built for with parameters of `param`."""
    return {"float32": (0,), "float16": (0, 1), "bfloat16": (0, 1, 2)}[param]


def _lowbit(make: object) -> dict[str, list[str]]:
    return {
        f"{p}/lowbit": [x for bits in LOWBIT_BITS for m in lowbit_masters(p) for x in make(_c(p), bits, m)]  # type: ignore[operator]
        for p in LOWBIT_DTYPES
    }


ADAM = KernelModule(
    "adam.cu",
    instantiations={
        **_groups(
            lambda p, s, m: [
                f"adam_step<{p}, {s}, {ams}, {m}, {dec}>"
                for ams in ("false", "true")
                for dec in ("false", "true")
            ]
        ),
        **_lowbit(lambda p, b, m: [f"adam_qstep<{p}, {b}, {m}, {d}>" for d in ("false", "true")]),
        "steps": ["cukit::mt::mt_count_step<0>"],
    },
    signatures={
        "adam_step": MT_PARAMS + " ptr",
        "adam_qstep": MT_PARAMS + " ptr ptr",
        "cukit::mt::mt_count_step": "ptr i64 ptr",
    },
)

SGD = KernelModule(
    "sgd.cu",
    instantiations={
        **_groups(lambda p, s, m: [f"sgd_step<{p}, {s}, {mom}, {m}>" for mom in ("false", "true")]),
        **_lowbit(lambda p, b, m: [f"sgd_qstep<{p}, {b}, {m}>"]),
        "steps": ["cukit::mt::mt_count_step<0>"],
    },
    signatures={
        "sgd_step": MT_PARAMS + " ptr",
        "sgd_qstep": MT_PARAMS + " ptr ptr",
        "cukit::mt::mt_count_step": "ptr i64 ptr",
    },
)

LION = KernelModule(
    "lion.cu",
    instantiations={
        **_groups(lambda p, s, m: [f"lion_step<{p}, {s}, {m}>"]),
        **_lowbit(lambda p, b, m: [f"lion_qstep<{p}, {b}, {m}>"]),
    },
    signatures={"lion_step": MT_PARAMS, "lion_qstep": MT_PARAMS + " ptr"},
)

ADAGRAD = KernelModule(
    "adagrad.cu",
    instantiations={
        **_groups(lambda p, s, m: [f"adagrad_step<{p}, {s}, {m}>"]),
        "steps": ["cukit::mt::mt_count_step<0>"],
    },
    signatures={"adagrad_step": MT_PARAMS + " ptr", "cukit::mt::mt_count_step": "ptr i64 ptr"},
)

LAMB = KernelModule(
    "lamb.cu",
    instantiations={
        **_groups(lambda p, s, m: [f"lamb_stage1<{p}, {s}, {m}>", f"lamb_stage2<{p}, {s}, {m}>"]),
        "ratio": ["lamb_ratio<4>", "lamb_ratio<5>"],
        "steps": ["cukit::mt::mt_count_step<0>"],
    },
    signatures={
        "lamb_stage1": MT_PARAMS + " ptr ptr",
        "lamb_stage2": MT_PARAMS + " ptr ptr",
        "lamb_ratio": "ptr i64 i64 ptr ptr ptr",
        "cukit::mt::mt_count_step": "ptr i64 ptr",
    },
)

_NORM_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Shampoo's elementwise passes (optim/shampoo.py): float32 maths and states for every parameter dtype.
SHAMPOO = KernelModule(
    "shampoo.cu",
    instantiations={
        **{name: [f"shampoo_graft<{_c(name)}>", f"shampoo_update<{_c(name)}, false>",
                  f"shampoo_update<{_c(name)}, true>"] for name in _NORM_DTYPES},
        "steps": ["cukit::mt::mt_count_step<0>"],
    },
    signatures={
        "shampoo_graft": MT_PARAMS + " ptr",
        "shampoo_update": MT_PARAMS + " ptr",
        "cukit::mt::mt_count_step": "ptr i64 ptr",
    },
)

L2NORM = KernelModule(
    "multi_tensor_l2norm.cu",
    instantiations={
        **{name: [f"mt_sumsq<{_c(name)}>", f"mt_scale<{_c(name)}>"] for name in _NORM_DTYPES},
        "reduce": ["mt_norm_finalize<0>", "mt_norm_per_tensor<0>"],
    },
    signatures={
        "mt_sumsq": "ptr i64 i64 i64 ptr ptr",
        "mt_scale": "ptr i64 i64 i64 ptr",
        "mt_norm_finalize": "ptr ptr i64 ptr f32 ptr ptr ptr",
        "mt_norm_per_tensor": "ptr i64 i64 ptr ptr ptr",
    },
)
