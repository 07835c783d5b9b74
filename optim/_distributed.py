"""cukit.optim under torch.distributed: DTensor parameters (FSDP2's ``fully_shard``, tensor
parallelism) and the cross-rank reductions of global-norm clipping and the non-finite flag.

A DTensor parameter is updated through its local shard: the plans of :class:`MultiTensorOptimizer`
hold ``p._local_tensor`` and ``p.grad._local_tensor`` (zero-size shards are legal) and the step
stays one launch over every local shard. The optimizer state is stored as torch's own optimizers
store it under FSDP2: a DTensor with the parameter's mesh and placements around a local tensor of
the shard's shape (``step`` a plain 0-dim tensor), so ``state_dict()``,
``torch.distributed.checkpoint`` (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) and
resharding work unchanged. Which tensors an optimizer treats specially never depends on the shard:
the elementwise optimizers (Adam, AdamW, SGD, Lion, Adagrad) treat every tensor alike, and LAMB
(a per-tensor norm) refuses DTensor parameters.

Norms: each rank sums the squares of its local shards (the multi-tensor norm kernels on CUDA,
float64 ``_foreach_norm`` on the CPU), one ``all_reduce(SUM)`` per distinct set of sharded mesh
dimensions (one for FSDP2 and HSDP) adds the ranks' sums, and the square root and the clipping
coefficient follow on the device: no host sync. A replicated tensor (a Replicate placement, or a
plain tensor beside DTensors) is counted once, not once per rank. The non-finite flag is an
``all_reduce(MAX)`` of the local flags.

Data-parallel wrappers that keep plain tensors (DDP, ZeroRedundancyOptimizer) need nothing here:
DDP all-reduces the gradients, ZeRO builds the optimizer on its subset of the parameters.

See also: ``torch.nn.utils.clip_grad_norm_`` with DTensor gradients,
``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cukit.optim._base import MultiTensorOptimizer, _Plan

__all__ = [
    "all_reduce_max",
    "any_dtensor",
    "check_params",
    "clip_coefficients",
    "global_norm",
    "largest_shard_numel",
    "local",
    "localize_plan",
    "optimizer_norm",
    "pointer_key",
    "rank_local",
]

Tensor = torch.Tensor
_ReduceKey = tuple[Any, tuple[int, ...]]  # (device mesh, the mesh dims a tensor is sharded over)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_dtensor(t: Any) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def any_dtensor(tensors: Sequence[Any]) -> bool:
    """Whether any of `tensors` is a DTensor (torch.distributed.tensor)."""
    return _DTENSOR is not None and any(isinstance(t, _DTENSOR) for t in tensors)


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), same storage.

    ``_local_tensor`` rather than ``to_local()``: the public call makes a new autograd view per
    call (about 2 µs), and the pointer check of every step reads it for every parameter and grad.
    """
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def check_params(opt: MultiTensorOptimizer) -> bool:
    """Whether `opt` has DTensor parameters; refuses the options that cannot hold for them
    (ValueError / NotImplementedError naming the optimizer)."""
    if not any_dtensor(opt._all):
        return False
    owner = type(opt).__name__
    if opt._flat:
        raise ValueError(
            f"{owner}: flat_grads=True needs plain tensor parameters; got DTensor parameters "
            "(FSDP2 assigns each sharded gradient itself)"
        )
    if opt._no_sharding is not None:
        raise NotImplementedError(f"{owner}: DTensor (sharded) parameters are not supported: {opt._no_sharding}")
    return True


def pointer_key(params: Sequence[Tensor]) -> list[int]:
    """The pointers of the local shards of `params` and of their gradients (-1: no gradient):
    a DTensor's own ``data_ptr()`` is 0, and FSDP2 assigns new gradient shards every backward."""
    key = [local(p).data_ptr() for p in params]
    key += (-1 if (g := p.grad) is None else local(g).data_ptr() for p in params)
    return key


# ---------------------------------------------------------------- plans on local shards
def _shard_like(v: Tensor, p: Tensor) -> Tensor:
    """State tensor `v` as a DTensor laid out like DTensor `p` (mesh, placements, global shape),
    with a contiguous local tensor. Accepts a DTensor of another layout (redistributed), a plain
    tensor of p's global shape (every rank holds the whole tensor, e.g. a non-sharded state_dict
    or a ``torch.full(p.shape, ...)`` initial state: each rank keeps its part), or a plain tensor
    of the local shard's shape (taken as this rank's shard)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    lp = local(p)
    if isinstance(v, DTensor):
        if v.device_mesh != mesh or tuple(v.placements) != tuple(placements):
            v = v.redistribute(mesh, placements)
        lv = v._local_tensor  # type: ignore[attr-defined]
    elif v.shape == p.shape:
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        lv = v[index].clone(memory_format=torch.contiguous_format)  # a copy: the whole tensor is freed
    elif v.shape == lp.shape:
        lv = v
    else:
        raise ValueError(
            f"cukit.optim: a state tensor of shape {tuple(v.shape)} fits neither the DTensor parameter's "
            f"global shape {tuple(p.shape)} nor its local shard's {tuple(lp.shape)}"
        )
    if lv.device != lp.device or not lv.is_contiguous():
        lv = lv.to(device=lp.device, memory_format=torch.contiguous_format)
    if isinstance(v, DTensor) and lv is v._local_tensor:  # type: ignore[attr-defined]
        return v
    return DTensor.from_local(lv, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())


def largest_shard_numel(p: Tensor) -> int:
    """The element count of DTensor `p`'s largest local shard (a shard dimension is cut as
    torch.chunk cuts it: the first ranks hold ``ceil(size / ranks)`` rows), the same on every rank."""
    shape = list(p.shape)
    for i, pl in enumerate(p.placements):  # type: ignore[attr-defined]
        if pl.is_shard():
            d = pl.dim  # type: ignore[attr-defined]
            shape[d] = -(-shape[d] // p.device_mesh.size(i))  # type: ignore[attr-defined]
    n = 1
    for s in shape:
        n *= s
    return n


def rank_local(v: Tensor, p: Tensor, per_rank: int, key: str) -> Tensor:
    """State `v` that belongs to this rank's shard of DTensor `p` (not to a part of p's global
    tensor: block scales, packed codes) as a 1-D DTensor over p's mesh: each rank's part padded to
    `per_rank` elements, Shard(0) across the mesh dimension that shards p (Replicate across the
    others). torch.distributed.checkpoint then saves every rank's part and loads it back on the
    same layout (another world size or sharding: a shape mismatch, never another rank's scales).
    Accepts that DTensor, or a plain tensor of this rank's part (padded or not)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, placements = p.device_mesh, tuple(p.placements)  # type: ignore[attr-defined]
    sharded = [i for i, pl in enumerate(placements) if pl.is_shard()]
    if len(sharded) > 1:
        raise ValueError(
            f"cukit.optim: state {key!r} describes a parameter's local shard, which is sharded over "
            f"{len(sharded)} mesh dimensions ({_layout(p)}); quantised states support one"
        )
    want = tuple(Shard(0) if pl.is_shard() else Replicate() for pl in placements)
    total = per_rank * (mesh.size(sharded[0]) if sharded else 1)
    if isinstance(v, DTensor):
        if v.device_mesh == mesh and tuple(v.placements) == want and tuple(v.shape) == (total,):
            return v
        raise ValueError(
            f"cukit.optim: state {key!r} of a parameter of shape {tuple(p.shape)} is a DTensor of shape "
            f"{tuple(v.shape)} ({_layout(v)}); this layout keeps {total} elements, {per_rank} per shard "
            f"(Shard(0)): it was saved with another sharding"
        )
    lv = v.reshape(-1).to(device=local(p).device)
    if lv.numel() < per_rank:  # this rank's part unpadded (its shard is smaller than the largest)
        lv = torch.cat([lv, lv.new_zeros(per_rank - lv.numel())])
    elif lv.numel() != per_rank:
        raise ValueError(
            f"cukit.optim: state {key!r} of a parameter of shape {tuple(p.shape)} has {lv.numel()} elements; "
            f"this rank's part has {per_rank}"
        )
    return DTensor.from_local(lv.contiguous(), mesh, want, run_check=False, shape=(total,), stride=(1,))


def localize_plan(opt: MultiTensorOptimizer, plan: _Plan, kernels: bool) -> None:
    """Point `plan`'s lists at local shards (new lists; the caller's keep the DTensors, which key
    ``opt.state``), store each state and master weight of a DTensor parameter as a DTensor laid
    out like it, and keep the parameters in ``plan.scratch["keys"]`` for the state lookups."""
    params = plan.params
    plan.scratch["keys"] = list(params)
    plan.params = [local(p) for p in params]
    grads = []
    for p, g in zip(params, plan.grads, strict=True):
        if is_dtensor(p) != is_dtensor(g) or (
            is_dtensor(p) and tuple(g.placements) != tuple(p.placements)  # type: ignore[attr-defined]
        ):
            raise ValueError(
                f"cukit.optim: the gradient of a parameter of shape {tuple(p.shape)} is laid out differently "
                f"from it ({_layout(g)} vs {_layout(p)})"
            )
        grads.append(local(g))
    plan.grads = grads
    mkey = opt._master_key
    names = [*plan.states, *([mkey] if plan.masters is not None else [])]
    lists: dict[str, list[Tensor]] = {k: [] for k in names}
    for p in params:
        st = opt.state[p]
        for k in names:
            v = st[k]
            if is_dtensor(p):
                # a state of the rank's own (the block scales of quantised states, packed 4-bit
                # codes: they describe the local shard) is padded to one size on every rank;
                # any other is laid out like the parameter
                if opt._rank_local_state(p, k):
                    v = st[k] = rank_local(v, p, opt._state_numel(p, k), k)
                else:
                    v = st[k] = _shard_like(v, p)
            lists[k].append(local(v))
    plan.states = {k: lists[k] for k in plan.states}
    if plan.masters is not None:
        plan.masters = lists[mkey]
    if kernels:
        for i, t in enumerate(plan.params):
            if not (t.is_contiguous() and plan.grads[i].is_contiguous()):
                raise ValueError(
                    f"cukit.optim: the local shard of parameter {i} of a launch (or of its gradient) is not "
                    f"contiguous (shape {tuple(t.shape)})"
                )


def _layout(t: Tensor) -> str:
    return f"DTensor {tuple(t.placements)}" if is_dtensor(t) else "plain tensor"  # type: ignore[attr-defined]


# ---------------------------------------------------------------- cross-rank reductions
def _reduce_key(t: Tensor) -> _ReduceKey | None:
    """The mesh and the mesh dims `t` is sharded over (None: replicated everywhere)."""
    if not is_dtensor(t):
        return None
    dims = []
    for d, pl in enumerate(t.placements):  # type: ignore[attr-defined]
        if pl.is_shard():
            dims.append(d)
        elif not pl.is_replicate():
            raise ValueError(f"cukit.optim: gradients with placement {pl} are not supported (Shard or Replicate)")
    return (t.device_mesh, tuple(dims)) if dims else None  # type: ignore[attr-defined]


def _all_reduce(t: Tensor, key: _ReduceKey, op: Any) -> Tensor:
    """All-reduce `t` in place over the mesh dims of `key` (one collective per dim: one for FSDP2)."""
    import torch.distributed as dist

    mesh, dims = key
    for d in dims:
        dist.all_reduce(t, op=op, group=mesh.get_group(d))
    return t


def _partition(grads: Sequence[Tensor]) -> list[tuple[_ReduceKey | None, list[Tensor]]]:
    """The local shards of `grads` by the mesh dims their sums of squares are reduced over."""
    parts: dict[_ReduceKey | None, list[Tensor]] = {}
    for g in grads:
        parts.setdefault(_reduce_key(g), []).append(local(g))
    return list(parts.items())


# sumsq(local tensors, grad_div, device) -> float64 0-dim sum of squares on device: the norm
# kernels' runner (cukit.optim.utils.local_sumsq), passed in so that this module stays below utils
SumSq = Callable[[list[Tensor], "Tensor | None", torch.device], Tensor]


def _norm_of(parts: list[tuple[_ReduceKey | None, list[Tensor]]], grad_div: Tensor | None, device: torch.device,
             sumsq: SumSq) -> Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for key, gs in parts:
        sq = sumsq(gs, grad_div, device)
        if key is not None:
            sq = _all_reduce(sq.clone(), key, _sum())
        total = total + sq
    return total.sqrt().to(torch.float32)


def global_norm(grads: Sequence[Tensor], grad_div: Tensor | None = None, *, sumsq: SumSq) -> Tensor:
    """``||concat(g / grad_div)||_2`` over the whole (sharded) gradients, float32 0-dim on the
    first gradient's device, equal on every rank: local sums of squares, one all_reduce(SUM) per
    distinct set of sharded mesh dims, replicated tensors counted once. No host sync."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return _norm_of(_partition(grads), grad_div, local(grads[0]).device, sumsq)


def optimizer_norm(opt: MultiTensorOptimizer, grad_div: Tensor | None = None, *, sumsq: SumSq) -> Tensor:
    """:func:`global_norm` of the gradients `opt`'s plans update (the partition is kept in the
    first plan's scratch: plans are rebuilt whenever a pointer changes)."""
    plans = opt._plans
    parts = plans[0].scratch.get("dist_parts")
    if parts is None:
        grads = [p.grad for plan in plans for p in plan.scratch["keys"]]
        parts = plans[0].scratch["dist_parts"] = _partition(grads)
    return _norm_of(parts, grad_div, plans[0].params[0].device, sumsq)


def _sum() -> Any:
    import torch.distributed as dist

    return dist.ReduceOp.SUM


def all_reduce_max(flag: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """`flag` (a 0-dim tensor computed from the local shards of `tensors`) made global: an
    all_reduce(MAX) over every mesh dim any of them is sharded over. Returns `flag`."""
    import torch.distributed as dist

    keys = {k for k in map(_reduce_key, tensors) if k is not None}
    done: set[tuple[Any, int]] = set()
    for mesh, dims in keys:
        for d in dims:
            if (mesh, d) not in done:
                done.add((mesh, d))
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
    return flag


def clip_coefficients(opt: MultiTensorOptimizer, grad_scale: Any, *, sumsq: SumSq) -> dict[int, Tensor]:
    """The clipping coefficient ``min(1, max_norm / (||g / grad_scale|| + 1e-6))`` of `opt`'s
    step with DTensor gradients, the norm taken over every rank's shards: a float32 0-dim tensor
    on each CUDA device `opt`'s launches use (``grad_scale`` is the optimizer's ``_OnDevice``)."""
    plans = opt._plans
    home = plans[0].table.device  # type: ignore[union-attr]
    norm = optimizer_norm(opt, grad_scale.get(home), sumsq=sumsq)
    coef = torch.clamp(opt._max_grad_norm / (norm + 1e-6), max=1.0)  # type: ignore[operator]
    out = {home: coef}
    for plan in plans:
        d = plan.table.device  # type: ignore[union-attr]
        if d not in out:
            out[d] = coef.to(torch.device("cuda", d), non_blocking=True)
    return out
