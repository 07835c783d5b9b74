"""Multi-tensor utilities: global and per-tensor L2 norms, clip_grad_norm_, a GPU-side
non-finite flag. One pass over every tensor (kernels: raw_kernels/multi_tensor_l2norm.cu), no
host sync; tensor tables are cached by the tensors' pointers, so a training loop builds them once.

CuPy arrays are viewed as torch tensors (DLPack, zero copy) and the work runs on CuPy's current
stream (:func:`on_cupy_stream`), so it is ordered with the caller's CuPy work on both sides; the
results come back as CuPy arrays when every input was one.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from cukit.optim import _distributed
from cukit.optim import _engine as eng
from cukit.optim._kernels import L2NORM

import cukit
from cukit.interop import DTYPES, current_stream

__all__ = [
    "clip_grad_norm_",
    "is_cupy",
    "multi_tensor_l2norm",
    "nonfinite_flag",
    "on_cupy_stream",
    "reference_l2norm",
]

Tensor = torch.Tensor
_CACHE: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
_CACHE_SIZE = 8
# Prepared norms used inside a CUDA-graph capture: never evicted (the graph replays them).
_CAPTURED: dict[tuple[Any, ...], dict[str, Any]] = {}
_NORM_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_TORCH_STREAMS: dict[tuple[int, int], Any] = {}


def is_cupy(x: Any) -> bool:
    """Whether `x` is a CuPy array (checked by module name: CuPy is not imported here)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


@contextlib.contextmanager
def on_cupy_stream(arrays: Sequence[Any]) -> Iterator[None]:
    """Within the block, torch's current stream is CuPy's current stream on the arrays' device
    when any of `arrays` is a CuPy array (else nothing changes).

    Why: cukit.optim launches on torch's current stream (so it orders with torch's work and is
    captured in CUDA graphs), and DLPack only orders the hand-over of the inputs; a CuPy caller
    reads the results on CuPy's stream, so the kernels (and torch's small ops around them) must
    run there too.
    """
    arr = next((a for a in arrays if is_cupy(a)), None)
    if arr is None:
        yield
        return
    import cupy

    device = int(arr.device.id)
    ptr = int(cupy.cuda.get_current_stream(device).ptr)
    if ptr == torch.cuda.current_stream(device).cuda_stream:
        yield
        return
    stream = _TORCH_STREAMS.get((ptr, device))
    if stream is None:
        # 0 is the legacy default stream, which is torch's default stream; any other pointer is
        # wrapped once (a wrapper neither owns nor destroys the stream)
        stream = torch.cuda.default_stream(device) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=device)
        _TORCH_STREAMS[(ptr, device)] = stream
    with torch.cuda.stream(stream):
        yield


def _like_inputs(t: Tensor, inputs: Sequence[Any]) -> Any:
    """`t` as a CuPy array (zero copy) when every input was one, else `t`."""
    if inputs and all(is_cupy(x) for x in inputs):
        return cukit.asarray(t)
    return t


def _as_tensors(tensors: Any, what: str) -> list[Tensor]:
    if isinstance(tensors, Tensor):
        return [tensors]
    out: list[Tensor] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            if is_cupy(t):
                t = cukit.to_torch(t)
            else:
                raise TypeError(
                    f"{what}[{i}] must be a torch.Tensor or cupy.ndarray; got {type(t).__qualname__}"
                )
        if t.dtype not in _NORM_DTYPES:
            raise TypeError(f"{what}[{i}] must be float16, bfloat16, float32 or float64; got {t.dtype}")
        out.append(t)
    return out


def _kernels_apply(tensors: Sequence[Tensor]) -> bool:
    return (
        bool(tensors)
        and cukit.is_available()
        and all(t.is_cuda for t in tensors)
        and (len({t.device for t in tensors}) == 1)
    )


def reference_l2norm(tensors: Sequence[Tensor]) -> Tensor:
    """||concat(tensors)||_2 in float64 from the stored values (the CPU fallback and test oracle)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    dev = tensors[0].device
    with torch.no_grad():
        # one foreach call, not a few ops per tensor (each op would release and retake the GIL)
        per = torch._foreach_norm(list(tensors), 2, dtype=torch.float64)
        if any(n.device != dev for n in per):
            per = [n.to(dev) for n in per]
        return torch.linalg.vector_norm(torch.stack(per)).to(torch.float32)


def prepare_norm(tensors: Sequence[Tensor]) -> dict[str, Any]:
    """Tensor tables (one per dtype) and workspaces for the norm kernels over `tensors` (contiguous,
    on one CUDA device); cached by pointers."""
    key = tuple((t.data_ptr(), t.numel(), t.dtype) for t in tensors)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        _pin_if_captured(key, hit)
        return hit
    dev = tensors[0].device
    by: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous (the norm kernels see raw pointers)")
        by.setdefault(t.dtype, []).append(i)
    tables = []
    offset = 0
    for dtype, idx in by.items():
        table = eng.TensorTable([[tensors[i] for i in idx]], [0] * len(idx))
        tables.append((dtype, idx, table, offset))
        offset += table.C
    prep = {
        "tables": tables,
        "n": len(tensors),
        "sumsq": torch.empty(max(offset, 1), dtype=torch.float32, device=dev),
        "nonfinite": torch.empty(max(offset, 1), dtype=torch.float32, device=dev),
        "C": offset,
        "norm": torch.empty((), dtype=torch.float32, device=dev),
        "coef": torch.empty((), dtype=torch.float32, device=dev),
        "flag": torch.empty((), dtype=torch.float32, device=dev),
        "device": tables[0][2].device,
        # where each table's per-tensor norms go in the output (built once: a host-to-device copy
        # from pageable memory would synchronise the stream on every call)
        "order": [torch.tensor(idx, dtype=torch.long, device=dev) for _, idx, _, _ in tables],
    }
    _CACHE[key] = prep
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    _pin_if_captured(key, prep)
    return prep


def _pin_if_captured(key: tuple[Any, ...], prep: dict[str, Any]) -> None:
    """A CUDA graph captured while using `prep` reads its tables and buffers on every replay:
    keep them alive for the process, whatever the LRU above drops."""
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = prep


def run_norm(
    prep: dict[str, Any], *, grad_div: Tensor | None = None, max_norm: float | None = None
) -> dict[str, Any]:
    """Launch mt_sumsq per table and mt_norm_finalize: fills prep["norm"], ["flag"] and, with
    max_norm, ["coef"] = min(1, max_norm / (norm + 1e-6)). Returns prep."""
    device = prep["device"]
    stream = current_stream(device, True)
    sumsq, nonfinite = prep["sumsq"], prep["nonfinite"]
    for dtype, _, table, off in prep["tables"]:
        if table.C == 0:
            continue
        L2NORM.launch(
            f"mt_sumsq<{DTYPES[str(dtype).removeprefix('torch.')].ctype}>",
            (table.grid,),
            (table.block,),
            (
                table.table,
                table.T,
                table.C,
                table.chunk,
                sumsq.data_ptr() + 4 * off,
                nonfinite.data_ptr() + 4 * off,
            ),
            device=device,
            stream=stream,
        )
    L2NORM.launch(
        "mt_norm_finalize<0>",
        (1,),
        (1024,),
        (
            sumsq,
            nonfinite,
            prep["C"],
            grad_div,
            float(max_norm or 0.0),
            prep["norm"],
            prep["coef"] if max_norm is not None else None,
            prep["flag"],
        ),
        device=device,
        stream=stream,
    )
    return prep


def multi_tensor_l2norm(tensors: Iterable[Any], per_tensor: bool = False) -> Any:
    """The global L2 norm ``sqrt(sum_i ||t_i||²)`` of a list of tensors (float32 0-dim tensor on their
    device), and with ``per_tensor=True`` also each ``||t_i||`` (float32, shape (n,)).

    One pass over all tensors on the GPU (squares summed in float32 per chunk, chunks in float64),
    no host sync; torch CUDA tensors or CuPy arrays, contiguous, float16/bfloat16/float32/float64,
    size 0 allowed. Other inputs run the float64 reference. CuPy inputs: computed on CuPy's current
    stream and returned as CuPy arrays.

    See also: ``torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in ts]))``,
    ``torch._foreach_norm``.
    """
    inputs = [tensors] if isinstance(tensors, Tensor) or is_cupy(tensors) else list(tensors)
    ts = _as_tensors(inputs, "tensors")
    with on_cupy_stream(inputs):
        out = _l2norm(ts, per_tensor)
        if isinstance(out, tuple):
            return tuple(_like_inputs(t, inputs) for t in out)
        return _like_inputs(out, inputs)


def _l2norm(ts: list[Tensor], per_tensor: bool) -> Tensor | tuple[Tensor, Tensor]:
    if not _kernels_apply(ts):
        total = reference_l2norm(ts)
        if not per_tensor:
            return total
        per = torch.stack([t.detach().double().norm().float() for t in ts]) if ts else torch.zeros(0)
        return total, per
    prep = run_norm(prepare_norm(ts))
    total = prep["norm"].clone()
    if not per_tensor:
        return total
    dev = ts[0].device
    per = torch.empty(len(ts), dtype=torch.float32, device=dev)
    for (_, idx, table, off), order in zip(prep["tables"], prep["order"], strict=True):
        out = torch.empty(len(idx), dtype=torch.float32, device=dev)
        L2NORM.launch(
            "mt_norm_per_tensor<0>",
            (max(1, min(-(-table.T // 8), 4096)),),
            (256,),
            (table.table, table.T, table.C, prep["sumsq"].data_ptr() + 4 * off, None, out),
            device=prep["device"],
            stream=current_stream(prep["device"], True),
        )
        per.index_copy_(0, order, out)
    return total, per


def nonfinite_flag(tensors: Iterable[Any]) -> Tensor:
    """A float32 0-dim device tensor: 1.0 if any element of any tensor is inf or NaN, else 0.0,
    computed without a host sync (read it when convenient, or feed it to a step as ``found_inf``).

    CuPy inputs: computed on CuPy's current stream and returned as a CuPy array. DTensors
    (FSDP2's sharded gradients): the flag of every rank's shards, the same on every rank (one
    all_reduce(MAX) of the local flags; a plain float32 tensor).

    See also: ``torch._amp_foreach_non_finite_check_and_unscale_``.
    """
    inputs = [tensors] if isinstance(tensors, Tensor) or is_cupy(tensors) else list(tensors)
    ts = _as_tensors(inputs, "tensors")
    with on_cupy_stream(inputs):
        if _distributed.any_dtensor(ts):
            flag = _local_flag([_distributed.local(t) for t in ts])
            return _distributed.all_reduce_max(flag, ts)
        return _like_inputs(_local_flag(ts), inputs)


def _local_flag(ts: list[Tensor]) -> Tensor:
    if not ts:
        return torch.zeros(())
    if not _kernels_apply(ts):  # CPU, several devices or no CuPy: still no host sync
        dev = ts[0].device
        bad = [(~torch.isfinite(t)).any().to(dev, non_blocking=dev.type == "cuda") for t in ts]
        return torch.stack(bad).any().to(torch.float32)
    return run_norm(prepare_norm(ts))["flag"].clone()


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_``: scales every gradient by
    ``min(1, max_norm / (||g||_2 + 1e-6))`` in place and returns the total norm (float32 0-dim).

    For the 2-norm of CUDA gradients: two launches per dtype plus one, no host sync (unless
    ``error_if_nonfinite``, which must read the norm, as torch's does). Other norm types and CPU
    gradients call torch's, except the 2-norm of DTensor gradients (FSDP2): the norm of every
    rank's shards from one all_reduce of the local sums of squares, no host sync, each local
    shard scaled in place (kernels on CUDA), returned as torch returns it (a replicated DTensor).

    See also: ``torch.nn.utils.clip_grad_norm_``.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if float(norm_type) == 2.0 and _distributed.any_dtensor(grads):
        return _clip_sharded(grads, float(max_norm), error_if_nonfinite)
    if float(norm_type) != 2.0 or not _kernels_apply(grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    prep = run_norm(prepare_norm(grads), max_norm=float(max_norm))
    norm = prep["norm"].clone()
    _check_finite(norm, error_if_nonfinite, norm_type)
    _scale(prep, prep["coef"])
    return norm


def _check_finite(norm: Tensor, error_if_nonfinite: bool, norm_type: float) -> None:
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )


def _scale(prep: dict[str, Any], coef: Tensor) -> None:
    """Multiply the tensors of a prepared norm by `coef` (a float32 0-dim device tensor) in place."""
    for dtype, _, table, _ in prep["tables"]:
        if table.C == 0:
            continue
        L2NORM.launch(
            f"mt_scale<{DTYPES[str(dtype).removeprefix('torch.')].ctype}>",
            (table.grid,),
            (table.block,),
            (table.table, table.T, table.C, table.chunk, coef),
            device=prep["device"],
            stream=current_stream(prep["device"], True),
        )


def _clip_sharded(grads: list[Tensor], max_norm: float, error_if_nonfinite: bool) -> Tensor:
    """clip_grad_norm_'s 2-norm over DTensor gradients (see its docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    norm = _distributed.global_norm(grads, sumsq=local_sumsq)
    _check_finite(norm, error_if_nonfinite, 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    locals_ = [_distributed.local(g) for g in grads]
    if _kernels_apply(locals_):
        _scale(prepare_norm(locals_), coef)
    else:
        nonempty = [t for t in locals_ if t.numel()]
        if nonempty:
            torch._foreach_mul_(nonempty, coef.to(nonempty[0].device))
    mesh = next(g.device_mesh for g in grads if isinstance(g, DTensor))
    return DTensor.from_local(norm, mesh, [Replicate()] * mesh.ndim, run_check=False)


def local_sumsq(grads: list[Tensor], grad_div: Tensor | None, device: torch.device) -> Tensor:
    """``sum ||g / grad_div||²`` over local tensors, float64 0-dim on `device`: the norm kernels
    on one CUDA device (no host sync), else float64 ``_foreach_norm``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if _kernels_apply(grads):
        norm = run_norm(prepare_norm(grads), grad_div=grad_div)["norm"]
        sq = norm.double().square()
    else:
        per = torch._foreach_norm(grads, 2, dtype=torch.float64)
        sq = torch.stack([n.to(device) for n in per]).square().sum()
        if grad_div is not None:
            sq = sq / grad_div.to(device=device, dtype=torch.float64).square()
    return sq.to(device)
