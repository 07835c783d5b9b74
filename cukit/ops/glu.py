"""Gated activations of gated MLPs: ``y = act(gate) * up`` (SwiGLU: silu; GeGLU: gelu, erf or tanh).

Kernels: ``raw_kernels/glu.cu``. The NumPy and torch references below are the CPU fallbacks and the
test oracles. torch registration (autograd, torch.compile, CUDA graphs): ``cukit/torch/glu.py``.

This is the GLU family of Shazeer's "GLU Variants Improve Transformer" as Llama-style MLPs compute
it from two projections, ``down(act(gate(x)) * up(x))``; not ``torch.nn.functional.glu``, which
splits one input in halves and gates with a sigmoid.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cukit._runtime import Densify, KernelModule, PlanCache
from cukit.interop import (
    DTYPES,
    DType,
    NotAnArrayError,
    array_class,
    array_kind,
    as_arrays,
    current_stream,
    device_of,
    dtype_name,
    not_an_array_error,
    type_name,
)
from cukit.ops.bias_act import (
    _IEEE,
    ACTIVATIONS,
    FLOAT_DTYPES,
    _acc_dtype,
    _dtypes_text,
    _empty,
    _np_act,
    _np_act_grad,
    _ptr,
    _torch_act,
    _torch_act_grad,
    _where,
)

__all__ = [
    "GLU_ACTIVATIONS",
    "backward_gpu",
    "check_grad",
    "forward_gpu",
    "geglu",
    "geglu_backward",
    "gelu_activation",
    "glu_activation_id",
    "public_name",
    "reference_backward_numpy",
    "reference_backward_torch",
    "reference_numpy",
    "reference_torch",
    "swiglu",
    "swiglu_backward",
    "validate",
]

# The activations a gate takes, by cukit's activation names (ids: raw_kernels/include/cukit/activations.cuh).
GLU_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh")
_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}  # F.gelu's approximate= -> activation


def _instantiations() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in FLOAT_DTYPES:
        dt = DTYPES[name]
        exprs: list[str] = []
        for act in GLU_ACTIVATIONS:
            a = ACTIVATIONS[act]
            for v in (16 // dt.itemsize, 1):  # the 16-byte vector path and the scalar path
                exprs += [f"glu_fwd<{dt.ctype}, {a}, {v}>", f"glu_bwd<{dt.ctype}, {a}, {v}>"]
        groups[name] = exprs
    return groups


KERNELS = KernelModule(
    "glu.cu",
    instantiations=_instantiations(),
    signatures={
        "glu_fwd": "ptr ptr ptr i64",
        "glu_bwd": "ptr ptr ptr ptr ptr i64",
    },
)

_BLOCK = 256
# vectors per thread (GLU_FWD_UNROLL / GLU_BWD_UNROLL in glu.cu): the grid covers the arrays once,
# one block per _BLOCK * unroll vectors; blocks that retire hand their SM to the next ones, which
# keeps more loads in flight than a grid-stride loop over a fixed number of resident blocks
_FWD_UNROLL = 1
_BWD_UNROLL = 1
_MAX_GRID = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def public_name(activation: str, backward: bool = False) -> str:
    """The public function computing a gate activation ("cukit.swiglu", "cukit.geglu", or their
    ``_backward``): the name errors carry."""
    base = "cukit.swiglu" if activation == "silu" else "cukit.geglu" if activation in _GELU_FORMS.values() else "cukit.glu"
    return base + "_backward" if backward else base


def glu_activation_id(activation: str, fn: str = "cukit.glu") -> int:
    """The kernel's id of a gate activation ("silu", "gelu", "gelu_tanh"); ValueError otherwise."""
    if activation not in GLU_ACTIVATIONS:
        names = ", ".join(repr(a) for a in GLU_ACTIVATIONS)
        raise ValueError(f"{fn}: activation must be one of {names}; got {activation!r}")
    return ACTIVATIONS[activation]


def gelu_activation(approximate: str, fn: str = "cukit.geglu") -> str:
    """GeGLU's activation for ``torch.nn.functional.gelu``'s ``approximate`` ("none" or "tanh")."""
    try:
        return _GELU_FORMS[approximate]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: approximate must be 'none' or 'tanh'; got {approximate!r}") from None


def validate(gate: Any, up: Any, activation: str, fn: str | None = None) -> tuple[str, int, DType]:
    """Check the arguments of ``act(gate) * up``; return (array kind, activation id, dtype).

    NotAnArrayError when gate or up is not an array (the public functions then convert
    array-likes), TypeError/ValueError naming fn (default: the public function of `activation`)
    and the argument otherwise."""
    fn = fn or public_name(activation)
    try:
        kind = array_kind(gate)
        up_kind = array_kind(up)
    except NotAnArrayError:
        raise not_an_array_error(fn, (("gate", gate), ("up", up))) from None
    if up_kind != kind:
        raise TypeError(f"{fn}: up must be the same array type as gate ({array_class(kind)}); got {type_name(up)}")
    act = glu_activation_id(activation, fn)
    name = dtype_name(gate, kind)
    if name not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: gate must have dtype {_dtypes_text(FLOAT_DTYPES)}; got {name}")
    if up.dtype != gate.dtype and dtype_name(up, kind) != name:
        raise TypeError(
            f"{fn}: up must have gate's dtype {name}; got {dtype_name(up, kind)} "
            "(no dtype promotion here: cast one of them; torch.autocast promotes)"
        )
    if tuple(up.shape) != tuple(gate.shape):
        raise ValueError(
            f"{fn}: up must have gate's shape {tuple(gate.shape)} (no broadcasting); got {tuple(up.shape)}"
        )
    dg, du = device_of(gate), device_of(up)
    if dg != du:
        raise ValueError(f"{fn}: gate and up must be on the same device; got {_where(dg)} and {_where(du)}")
    return kind, act, DTYPES[name]


def check_grad(fn: str, grad: Any, gate: Any, kind: str) -> None:
    """grad must be gate's array type, dtype, shape and device."""
    try:
        grad_kind = array_kind(grad)
    except NotAnArrayError:
        raise not_an_array_error(fn, (("grad", grad),)) from None
    if grad_kind != kind:
        raise TypeError(f"{fn}: grad must be the same array type as gate ({array_class(kind)}); got {type_name(grad)}")
    if grad.dtype != gate.dtype and dtype_name(grad, kind) != dtype_name(gate, kind):
        raise TypeError(f"{fn}: grad must have gate's dtype {dtype_name(gate, kind)}; got {dtype_name(grad, kind)}")
    if tuple(grad.shape) != tuple(gate.shape):
        raise ValueError(f"{fn}: grad must have gate's shape {tuple(gate.shape)}; got {tuple(grad.shape)}")
    if device_of(grad) != device_of(gate):
        raise ValueError(f"{fn}: grad must be on gate's device ({_where(device_of(gate))}); got {_where(device_of(grad))}")


# ---------------------------------------------------------------------------------------------
# Public API (array level; cukit/_api.py routes torch tensors to cukit/torch/glu.py)
# ---------------------------------------------------------------------------------------------


def swiglu(gate: Any, up: Any) -> Any:
    """SwiGLU, the gate of Llama/Mistral/Qwen MLPs: ``y = silu(gate) * up = gate * sigmoid(gate) * up``.

    Args:
        gate, up: arrays of the same shape (any, size 0 included), dtype (float16, bfloat16, float32
            or float64), array type (NumPy, CuPy or torch, CPU or CUDA) and device; no broadcasting.
            Contiguous inputs are read in place (nn.Linear outputs are); others are copied to a
            contiguous buffer first. Array-likes convert as ``numpy.asarray`` converts them.

    Returns:
        y, contiguous, gate's shape, dtype and array type. CUDA inputs run one kernel (maths in
        float32 for the 16-bit types, float64 for float64, rounded once); NumPy and torch-CPU inputs
        run the reference. torch tensors are differentiable (to any order), follow ``torch.autocast``
        as an elementwise op (gate and up cast to the wider dtype) and work under torch.compile.

    Raises:
        TypeError (wrong type or dtype) and ValueError (shapes or devices differ), naming
        ``cukit.swiglu`` and the argument.

    See also: ``torch.nn.functional.silu(gate) * up``; ``transformers``' ``LlamaMLP``.
    """
    return _public("cukit.swiglu", gate, up, "silu")


def geglu(gate: Any, up: Any, approximate: str = "none") -> Any:
    """GeGLU, the gate of Gemma and T5 v1.1 MLPs: ``y = gelu(gate, approximate) * up``.

    approximate: "none" (exact, erf) or "tanh" (Gemma's ``gelu_pytorch_tanh``), as in
    ``torch.nn.functional.gelu``. gate and up as for :func:`swiglu` (same shape, dtype, array type
    and device); the same computation, return value and errors (naming ``cukit.geglu``).

    See also: ``torch.nn.functional.gelu(gate, approximate=approximate) * up``.
    """
    return _public("cukit.geglu", gate, up, gelu_activation(approximate))


def swiglu_backward(grad: Any, gate: Any, up: Any) -> tuple[Any, Any]:
    """Gradients of swiglu: ``dgate = grad * up * silu'(gate)``, ``dup = grad * silu(gate)``.

    For NumPy and CuPy users (torch users get this through autograd). grad has gate's shape,
    dtype, type and device; gate and up as for :func:`swiglu`. One kernel on CUDA inputs. Errors
    name ``cukit.swiglu_backward``.

    See also: ``torch.autograd.grad``.
    """
    return _public_backward("cukit.swiglu_backward", grad, gate, up, "silu")


def geglu_backward(grad: Any, gate: Any, up: Any, approximate: str = "none") -> tuple[Any, Any]:
    """Gradients of geglu: ``dgate = grad * up * gelu'(gate)``, ``dup = grad * gelu(gate)``; as
    :func:`swiglu_backward` otherwise (errors name ``cukit.geglu_backward``).

    See also: ``torch.autograd.grad``.
    """
    return _public_backward("cukit.geglu_backward", grad, gate, up,
                            gelu_activation(approximate, "cukit.geglu_backward"))


def _public(fn: str, gate: Any, up: Any, activation: str) -> Any:
    try:
        return _glu_arrays(gate, up, activation, fn)
    except NotAnArrayError:
        gate, up = as_arrays(fn, (("gate", gate), ("up", up)))
    return _glu_arrays(gate, up, activation, fn)


def _public_backward(fn: str, grad: Any, gate: Any, up: Any, activation: str) -> tuple[Any, Any]:
    try:
        return _backward_arrays(grad, gate, up, activation, fn)
    except NotAnArrayError:
        grad, gate, up = as_arrays(fn, (("grad", grad), ("gate", gate), ("up", up)))
    return _backward_arrays(grad, gate, up, activation, fn)


def _glu_arrays(gate: Any, up: Any, activation: str, fn: str) -> Any:
    """glu for arrays (NotAnArrayError for anything else, before any work)."""
    kind, act, _ = validate(gate, up, activation, fn)
    if kind == "numpy":
        return reference_numpy(gate, up, activation)
    if device_of(gate) is None:  # torch CPU (autograd-aware use goes through cukit.torch)
        return reference_torch(gate, up, activation)
    return forward_gpu(gate, up, act)


def _backward_arrays(grad: Any, gate: Any, up: Any, activation: str, fn: str) -> tuple[Any, Any]:
    """glu_backward for arrays (NotAnArrayError for anything else, before any work)."""
    kind, act, _ = validate(gate, up, activation, fn)
    check_grad(fn, grad, gate, kind)
    if kind == "numpy":
        return reference_backward_numpy(grad, gate, up, activation)
    if device_of(gate) is None:
        return reference_backward_torch(grad, gate, up, activation)
    return backward_gpu(grad, gate, up, act)


# ---------------------------------------------------------------------------------------------
# GPU path (CuPy arrays and torch CUDA tensors)
# ---------------------------------------------------------------------------------------------

# Signatures -> plans. A plan launches on contiguous arrays, whose pointers are then the only
# per-call inputs; a signature with non-contiguous arrays maps to a Densify entry (copy, then the
# contiguous signature's plan). Fresh outputs are always 16-byte aligned.
_FWD_PLANS = PlanCache("glu_fwd", maxsize=1024)
_BWD_PLANS = PlanCache("glu_bwd", maxsize=1024)
_ACT_NAMES = {ACTIVATIONS[a]: a for a in GLU_ACTIVATIONS}


def _key(tag: str, act: int, *arrays: Any) -> tuple:
    """A call's signature: shape, strides, dtype, device and 16-byte alignment of each array."""
    if hasattr(arrays[0], "data_ptr"):
        a, b = arrays[0], arrays[1]  # written out: a generator costs a microsecond more per call
        key = (tag, act, a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() & 15,
               b.shape, b.stride(), b.dtype, b.get_device(), b.data_ptr() & 15)
        if len(arrays) == 3:
            c = arrays[2]
            key += (c.shape, c.stride(), c.dtype, c.get_device(), c.data_ptr() & 15)
        return key
    for t in arrays:
        if type(t) is np.ndarray:
            raise TypeError(
                "cukit.ops.glu: the GPU path (forward_gpu, backward_gpu) needs CuPy arrays or torch CUDA "
                "tensors; got a numpy.ndarray"
            )
    return (tag, act, *((t.shape, t.strides, t.dtype, t.device.id, t.data.ptr & 15) for t in arrays))


class _Plan:
    __slots__ = ("run", "shape")

    def __init__(self, shape: tuple[int, ...], run: Any) -> None:
        self.shape, self.run = shape, run


def _launch_shape(dt: DType, n: int, ptrs: list[int], unroll: int) -> tuple[int, int]:
    """(vector width, blocks) of a flat launch over n elements, `unroll` vectors per thread."""
    vec = 16 // dt.itemsize if all(p % 16 == 0 for p in ptrs) else 1
    blocks = max(1, min(-(-(n // vec) // (_BLOCK * unroll)), _MAX_GRID))
    return vec, blocks


def forward_gpu(gate: Any, up: Any, act: int) -> Any:
    """``act(gate) * up`` for CuPy arrays or torch CUDA tensors: one launch. Validated on a
    signature's first call; later calls are a plan-cache lookup, an allocation and a launch."""
    key = _key("fwd", act, gate, up)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        return _forward_first(gate, up, act, key)
    if plan.__class__ is Densify:
        return forward_gpu(*plan.apply((gate, up)), act)
    if hasattr(gate, "data_ptr"):
        y = gate.new_empty(plan.shape)
        if plan.run is not None:
            plan.run((gate.data_ptr(), up.data_ptr(), y.data_ptr()), current_stream(gate.get_device(), True))
        return y
    y = _empty(plan.shape, gate, "cupy")
    if plan.run is not None:
        plan.run((gate.data.ptr, up.data.ptr, y.data.ptr), current_stream(gate.device.id, False))
    return y


def _forward_first(gate: Any, up: Any, act: int, key: tuple) -> Any:
    kind, _, dt = validate(gate, up, _ACT_NAMES.get(act, act))  # type: ignore[arg-type]
    device = device_of(gate)
    if device is None:
        raise ValueError("cukit.ops.glu.forward_gpu: gate and up must be CUDA arrays; got arrays on the CPU")
    dense = Densify.needed((gate, up), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _FWD_PLANS.put(key, dense)
        return forward_gpu(*dense.apply((gate, up)), act)
    y = _empty(tuple(gate.shape), gate, kind)
    n = math.prod(gate.shape)
    run = None
    if n:
        pg, pu, py = _ptr(gate, kind), _ptr(up, kind), _ptr(y, kind)
        vec, blocks = _launch_shape(dt, n, [pg, pu, py], _FWD_UNROLL)
        run = KERNELS.prepare(f"glu_fwd<{dt.ctype}, {act}, {vec}>", (blocks,), (_BLOCK,), (n,), device=device)
        run((pg, pu, py), current_stream(device, kind == "torch"))
    _FWD_PLANS.put(key, _Plan(tuple(y.shape), run))
    return y


def backward_gpu(grad: Any, gate: Any, up: Any, act: int) -> tuple[Any, Any]:
    """``(grad * up * act'(gate), grad * act(gate))`` for CuPy arrays or torch CUDA tensors: one
    launch reading grad, gate and up and writing both gradients. Validated on a signature's first call."""
    key = _key("bwd", act, grad, gate, up)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        return _backward_first(grad, gate, up, act, key)
    if plan.__class__ is Densify:
        return backward_gpu(*plan.apply((grad, gate, up)), act)
    if hasattr(gate, "data_ptr"):
        dg, du = gate.new_empty(plan.shape), gate.new_empty(plan.shape)
        if plan.run is not None:
            plan.run((grad.data_ptr(), gate.data_ptr(), up.data_ptr(), dg.data_ptr(), du.data_ptr()),
                     current_stream(gate.get_device(), True))
        return dg, du
    dg, du = _empty(plan.shape, gate, "cupy"), _empty(plan.shape, gate, "cupy")
    if plan.run is not None:
        plan.run((grad.data.ptr, gate.data.ptr, up.data.ptr, dg.data.ptr, du.data.ptr),
                 current_stream(gate.device.id, False))
    return dg, du


def _backward_first(grad: Any, gate: Any, up: Any, act: int, key: tuple) -> tuple[Any, Any]:
    activation = _ACT_NAMES.get(act, act)
    fn = public_name(activation, backward=True)  # type: ignore[arg-type]
    kind, _, dt = validate(gate, up, activation, fn)  # type: ignore[arg-type]
    check_grad(fn, grad, gate, kind)
    device = device_of(gate)
    if device is None:
        raise ValueError("cukit.ops.glu.backward_gpu: grad, gate and up must be CUDA arrays; got arrays on the CPU")
    dense = Densify.needed((grad, gate, up), kind)
    if dense is not None:  # later calls copy and take the dense signature's plan
        _BWD_PLANS.put(key, dense)
        return backward_gpu(*dense.apply((grad, gate, up)), act)
    shape = tuple(gate.shape)
    dg, du = _empty(shape, gate, kind), _empty(shape, gate, kind)
    n = math.prod(shape)
    run = None
    if n:
        ptrs = [_ptr(t, kind) for t in (grad, gate, up, dg, du)]
        vec, blocks = _launch_shape(dt, n, ptrs, _BWD_UNROLL)
        run = KERNELS.prepare(f"glu_bwd<{dt.ctype}, {act}, {vec}>", (blocks,), (_BLOCK,), (n,), device=device)
        run(tuple(ptrs), current_stream(device, kind == "torch"))
    _BWD_PLANS.put(key, _Plan(shape, run))
    return dg, du


# ---------------------------------------------------------------------------------------------
# References: CPU fallbacks and test oracles (the activations' forms are bias_act's, the kernels')
# ---------------------------------------------------------------------------------------------


def reference_numpy(gate: np.ndarray, up: np.ndarray, activation: str) -> np.ndarray:
    """NumPy glu, ``act(gate) * up`` computed in float64 and rounded once to gate's dtype."""
    glu_activation_id(activation)
    with np.errstate(**_IEEE):
        g = np.asarray(gate, dtype=np.float64)
        y = _np_act(g, activation) * np.asarray(up, dtype=np.float64)
        return np.asarray(y, dtype=gate.dtype)  # fresh, C-contiguous; 0-d stays 0-d


def reference_backward_numpy(
    grad: np.ndarray, gate: np.ndarray, up: np.ndarray, activation: str
) -> tuple[np.ndarray, np.ndarray]:
    """NumPy glu backward in float64: (dgate, dup) in gate's dtype."""
    glu_activation_id(activation)
    with np.errstate(**_IEEE):
        g = np.asarray(gate, dtype=np.float64)
        d = np.asarray(grad, dtype=np.float64)
        dgate = d * np.asarray(up, dtype=np.float64) * _np_act_grad(g, activation)
        dup = d * _np_act(g, activation)
        return np.asarray(dgate, dtype=gate.dtype), np.asarray(dup, dtype=gate.dtype)


def reference_torch(gate: Any, up: Any, activation: str) -> Any:
    """torch glu with the kernel's maths (float32 for the 16-bit types, one rounding); the
    torch-CPU fallback and what torch.compile traces (inductor fuses it into one kernel)."""
    glu_activation_id(activation)
    acc = _acc_dtype(gate)
    return (_torch_act(gate.to(acc), activation) * up.to(acc)).to(gate.dtype).contiguous()


def reference_backward_torch(grad: Any, gate: Any, up: Any, activation: str) -> tuple[Any, Any]:
    """torch glu backward with the kernel's maths: (dgate, dup)."""
    glu_activation_id(activation)
    acc = _acc_dtype(gate)
    g, d = gate.to(acc), grad.to(acc)
    dgate = d * up.to(acc) * _torch_act_grad(g, activation)
    dup = d * _torch_act(g, activation)
    return dgate.to(gate.dtype).contiguous(), dup.to(gate.dtype).contiguous()
