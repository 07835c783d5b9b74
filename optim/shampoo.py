"""Shampoo with blocked Kronecker factors, stacked by size (DASH) so that every step is a handful of
batched calls whatever the number of blocks.

Each parameter of two or more dimensions is viewed as a matrix ``(shape[0], numel / shape[0])`` and
cut into blocks of at most ``max_preconditioner_dim`` rows and columns. A block ``G`` (m x n) has
the factors ``L`` (m x m) and ``R`` (n x n), float32, and their inverse 4th roots. Blocks of one
shape ``(m, n)`` are stacked into (B, m, n) tensors, and every factor of size s lives in one
(N_s, s, s) stack:

- factor update: ``L <- beta2 L + (1 - beta2) G G^T`` (``beta2 == 1``: ``L += G G^T``) and ``R``
  likewise, one batched ``cukit.ops.matmul.gemm`` per block shape each;
- roots: every ``precondition_frequency`` steps, one batched ``cukit.linalg.matrix_inverse_root``
  per factor size, ``(F + epsilon lambda_max I)^(-1/4)``, in float32 or ``root_dtype`` float64;
  where the call's per-matrix ``info`` says a matrix failed (2: zero or non-finite) the previous
  root is kept, by a device-side ``torch.where`` (no host sync);
- direction: ``P = L^(-1/4) G R^(-1/4)`` (two batched gemms per block shape), grafted per block:
  ``P ||A|| / ||P||`` with A the grafting method's (Adam's second moment or Adagrad's sum)
  diagonal direction of that block. Before ``start_preconditioning_step`` and for parameters with
  fewer than two dimensions the direction is A itself.
- then momentum (``beta1``, an exponential average with bias correction) and the step, with
  decoupled (AdamW) or L2 weight decay.

On CUDA the elementwise ends of a step are two launches of the multi-tensor engine
(raw_kernels/shampoo.cu), whatever the number of parameters: ``shampoo_graft`` (unscale, sign, L2
decay, the grafting state, the float32 gradient and grafting direction buffers) and
``shampoo_update`` (momentum, its bias correction, decoupled decay and the step), plus the step
count's. Gathering the gradient blocks into their stacks and scattering the directions back are one
``torch._foreach_copy_`` each. CPU tensors (and more than 8 param groups) run the same maths in
torch's ``_foreach_*`` ops (:meth:`Shampoo._graft_torch`, :meth:`Shampoo._apply_torch`), the gemm
and the roots their references.

See also: ``distributed_shampoo.DistributedShampoo`` (facebookresearch/optimizers),
``optax.contrib.scale_by_shampoo``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from cukit.optim import _checks as chk
from cukit.optim._engine import (
    MAX_GROUPS,
    TensorTable,
    hp_tensor,
    launch_count,
    launch_update,
    lr_args,
    no_lr,
    pack_hp,
)
from cukit.optim._kernels import SHAMPOO

import cukit
from cukit.interop import DTYPES

__all__ = ["Shampoo"]

Tensor = torch.Tensor
_OWNER = "cukit.optim.Shampoo"
_GRAFTING = ("adam", "adagrad")
_ROOT = 4  # 2-D blocks: L^(-1/4) G R^(-1/4)


def _positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int; got {chk.describe(value)}")
    if value < 1:
        raise ValueError(f"{owner}: {name} must be an int >= 1; got {value}")


def _non_negative_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int; got {chk.describe(value)}")
    if value < 0:
        raise ValueError(f"{owner}: {name} must be an int >= 0; got {value}")


def _choice(options: tuple[str, ...]) -> chk.Rule:
    def rule(owner: str, name: str, value: Any) -> None:
        if value not in options:
            raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, options))}; got {value!r}")

    return rule


def _root_dtype(owner: str, name: str, value: Any) -> None:
    if value not in (torch.float32, torch.float64):
        raise TypeError(f"{owner}: {name} must be torch.float32 or torch.float64; got {value!r}")


@dataclass
class _Block:
    """One block: its parameter (index into the active list), rows [r0, r1) and cols [c0, c1) of
    the parameter's matrix view, and its positions in the stacks."""

    param: int
    index: int  # block number within the parameter (state keys L_<index> ...)
    r0: int
    r1: int
    c0: int
    c1: int


@dataclass
class _ShapeGroup:
    """The blocks of one shape (m, n): slices [l0, l0 + B) of the size-m stack and [r0, r0 + B)
    of the size-n stack hold their L and R."""

    m: int
    n: int
    blocks: list[_Block] = field(default_factory=list)
    l0: int = 0
    r0: int = 0
    g: Tensor | None = None  # (B, m, n) float32 gradient blocks
    a: Tensor | None = None  # (B, m, n) grafting directions
    t: Tensor | None = None  # (B, m, n) scratch: L^(-1/4) G
    p: Tensor | None = None  # (B, m, n) preconditioned directions


@dataclass
class _Launch:
    """The parameters of one dtype on the CUDA path: their indices in the layout and the tables of
    raw_kernels/shampoo.cu's two launches over them."""

    ctype: str
    index: list[int]
    graft: Any  # TensorTable: param, grad, graft state, G, A
    update: Any  # TensorTable: param, direction, [exp_avg]


@dataclass
class _Layout:
    params: list[Tensor]
    gids: list[int]
    matrices: list[bool]  # preconditioned (ndim >= 2 and not empty)
    groups: list[_ShapeGroup]
    factors: dict[int, Tensor]  # size -> (N_s, s, s) float32 factors
    roots: dict[int, Tensor]  # size -> (N_s, s, s) float32 inverse roots
    infos: dict[int, Tensor]  # size -> (N_s,) int32: the last root computation's info
    step: Tensor  # float32 0-dim, on the parameters' device
    key: tuple[int, ...] = ()
    # the CUDA path: one (graft, update) pair of tensor tables per parameter dtype, or none (torch ops)
    launches: list[_Launch] = field(default_factory=list)
    active_groups: list[int] = field(default_factory=list)  # the param groups in the launches, in table order
    grad_ptrs: list[int] = field(default_factory=list)  # the gradients the graft tables point at
    hp_key: tuple[float, ...] = ()
    hp: Tensor | None = None  # float64 device array of the launch's hyperparameters
    # float32 working buffers, one per parameter: the gradients, then the directions
    graft: list[Tensor] = field(default_factory=list)  # the parameters' grafting state
    moments: list[Tensor] = field(default_factory=list)  # their exp_avg (beta1 > 0)
    gbuf: list[Tensor] = field(default_factory=list)
    dbuf: list[Tensor] = field(default_factory=list)
    # the block views, built once: gradient and grafting blocks -> stacks; directions <- stacks
    gather_dst: list[Tensor] = field(default_factory=list)
    gather_src: list[Tensor] = field(default_factory=list)
    scatter_dst: list[Tensor] = field(default_factory=list)
    scatter_src: list[Tensor] = field(default_factory=list)


def _matrix(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


def _contiguous_grads(params: list[Tensor]) -> list[Tensor]:
    """The parameters' gradients as the tables read them (a strided one copied, each step)."""
    out = []
    for p in params:
        g: Tensor = p.grad  # type: ignore[assignment]
        out.append(g if g.is_contiguous() else g.contiguous())
    return out


def _cuts(size: int, most: int) -> list[tuple[int, int]]:
    return [(s, min(s + most, size)) for s in range(0, size, most)]


class Shampoo(torch.optim.Optimizer):
    """Shampoo (Gupta et al. 2018; Distributed Shampoo's blocked, grafted form), batched by size.

    ``L += G G^T``, ``R += G^T G`` per block (or their exponential averages with beta2 < 1),
    direction ``L^(-1/4) G R^(-1/4)`` rescaled per block to the norm of the grafting method's
    direction, momentum, then ``p -= lr (d + wd p)`` (decoupled) or L2 decay in the gradient.
    See the module docstring for the layout and the batched calls.

    Args:
        params: tensors or param groups (any floating dtype; factors and state are float32).
        lr: learning rate, a float or a 1-element tensor (LR schedulers work as for torch's).
        betas: (beta1, beta2): beta1 the momentum of the final direction (0: none), beta2 the
            factors' and Adam grafting's second-moment decay (1.0: sums, as Adagrad).
        epsilon: the roots' ridge relative to each factor's largest eigenvalue.
        weight_decay: decoupled (AdamW style, default) or L2 (``decoupled_weight_decay=False``).
        max_preconditioner_dim: the largest block side; larger dimensions are cut into blocks.
        precondition_frequency: recompute the roots every this many steps.
        start_preconditioning_step: steps before this one use the grafted direction alone (the
            factors are still accumulated; the roots are first computed at this step).
        grafting: "adam" (RMSProp with bias correction, Distributed Shampoo's AdamGrafting) or
            "adagrad"; ``grafting_epsilon`` its denominator's epsilon.
        root_method: ``cukit.linalg.matrix_inverse_root``'s method ("auto", "eigh", "newton").
        root_dtype: torch.float32, or torch.float64 to compute the roots in float64 (factors and
            roots are stored in float32).
        matmul_precision: the float32 GEMMs' precision on CUDA (factor updates, preconditioning and
            the Newton roots' products): "ieee" (default) or "tf32" (tensor cores, inputs rounded to
            10 mantissa bits; see :func:`cukit.set_matmul_precision`).
        maximize: ascend instead.
        Per param group: lr, weight_decay, decoupled_weight_decay, maximize; the others are the
        optimizer's (a group that sets another value raises ValueError).
        capturable: accepted for compatibility: on CUDA the step never syncs with the host (the
            root schedule is a host-side step count; a captured graph replays the step it captured).

    State per parameter (torch style): ``step`` (float32 0-dim), ``exp_avg`` (beta1 > 0), the
    grafting state ``graft_exp_avg_sq`` or ``graft_sum``, and per block ``i`` the float32 factors
    ``L_i``, ``R_i`` and roots ``L_root_i``, ``R_root_i``, ``L_info_i``/``R_info_i`` (int32: the
    last root's info, 0 ok, 1 not converged, 2 failed and the previous root kept).

    Works with ``torch.amp.GradScaler`` (``grad_scale`` / ``found_inf`` read on the device: a
    skipped step changes nothing) and LR schedulers.

    See also: ``distributed_shampoo.DistributedShampoo``, :class:`cukit.optim.AdamW`,
    :func:`cukit.linalg.matrix_inverse_root`.
    """

    _step_supports_amp_scaling: ClassVar[bool] = True
    # False: CUDA tensors take the torch-ops path too (the tests compare the two)
    _use_kernels: bool = True
    _rules: ClassVar[dict[str, chk.Rule]] = {
        "lr": chk.LR,
        "betas": chk.betas(high_open=False),
        "epsilon": chk.number(),
        "weight_decay": chk.NON_NEGATIVE,
        "decoupled_weight_decay": chk.FLAG,
        "max_preconditioner_dim": _positive_int,
        "precondition_frequency": _positive_int,
        "start_preconditioning_step": _non_negative_int,
        "grafting": _choice(_GRAFTING),
        "grafting_epsilon": chk.NON_NEGATIVE,
        "root_method": _choice(("auto", "eigh", "newton")),
        "root_dtype": _root_dtype,
        "matmul_precision": _choice(("ieee", "tf32")),
        "maximize": chk.FLAG,
        "capturable": chk.FLAG,
    }
    # one value for the whole optimizer (the layout, the root schedule and the stacked state are
    # shared by every group); lr, weight_decay, decoupled_weight_decay and maximize are per group
    _GLOBAL = ("betas", "epsilon", "max_preconditioner_dim", "precondition_frequency", "start_preconditioning_step",
               "grafting", "grafting_epsilon", "root_method", "root_dtype", "matmul_precision")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = True,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
        grafting: str = "adam",
        grafting_epsilon: float = 1e-8,
        root_method: str = "auto",
        root_dtype: torch.dtype = torch.float32,
        matmul_precision: str = "ieee",
        maximize: bool = False,
        capturable: bool = False,
    ) -> None:
        values = dict(
            lr=lr, betas=betas, epsilon=epsilon, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay, max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency, start_preconditioning_step=start_preconditioning_step,
            grafting=grafting, grafting_epsilon=grafting_epsilon, root_method=root_method, root_dtype=root_dtype,
            matmul_precision=matmul_precision, maximize=maximize, capturable=capturable,
        )
        chk.check(_OWNER, self._rules, values)
        values["betas"] = tuple(values["betas"])
        super().__init__(params, values)
        for g in self.param_groups:
            for p in g["params"]:
                if not isinstance(p, Tensor) or not p.is_floating_point():
                    raise TypeError(f"{_OWNER}: params must be floating tensors; got {chk.describe(p)}")
                if p.is_sparse:
                    raise TypeError(f"{_OWNER}: params must be dense tensors; got a sparse tensor")
        self._layout: _Layout | None = None
        self._host_step = 0

    # ---------------------------------------------------------------- torch.optim.Optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, plus the constructor's checks for the hyperparameters the group sets."""
        if isinstance(param_group, dict):
            overrides = {k: v for k, v in param_group.items() if k != "params"}
            chk.check(_OWNER, self._rules, overrides, f"param group {len(self.param_groups)}")
            for k in self._GLOBAL:
                same = k not in overrides or not hasattr(self, "defaults") or (
                    tuple(overrides[k]) == self.defaults[k] if k == "betas" else overrides[k] == self.defaults[k])
                if not same:
                    raise ValueError(f"{_OWNER}: {k} must be the same for every param group; got {overrides[k]!r} "
                                     f"in param group {len(self.param_groups)}")
        super().add_param_group(param_group)
        self._layout = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts floating state to each parameter's dtype: factors and roots stay float32 here
        saved = state_dict["state"]
        keep = {i: {k: v for k, v in st.items() if isinstance(v, Tensor)} for i, st in saved.items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            for k, v in keep.get(i, {}).items():
                self.state[p][k] = v.to(device=p.device, copy=True)
        # the root schedule's host-side count resumes from the saved step (one read, at load time)
        steps = [float(st["step"]) for st in saved.values() if isinstance(st.get("step"), Tensor)]
        self._host_step = int(max(steps, default=0.0))
        self._layout = None

    @property
    def root_info(self) -> dict[int, Tensor]:
        """The last root computation's info per factor size: int32 (N_s,) on the device (0 ok,
        1 not converged, 2 failed: the previous root was kept). Empty before the first roots."""
        return {} if self._layout is None else dict(self._layout.infos)

    # ---------------------------------------------------------------- layout
    def _active(self) -> tuple[list[Tensor], list[int]]:
        ps: list[Tensor] = []
        gids: list[int] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                g = p.grad
                if g is None or p.numel() == 0:
                    continue
                if g.is_sparse:
                    raise TypeError(f"{_OWNER}: gradients must be dense; got a sparse gradient")
                if g.shape != p.shape:
                    raise ValueError(f"{_OWNER}: a gradient must have its parameter's shape {tuple(p.shape)}; "
                                     f"got {tuple(g.shape)}")
                ps.append(p)
                gids.append(gi)
        return ps, gids

    def _build(self, ps: list[Tensor], gids: list[int]) -> _Layout:
        """Cut the parameters into blocks, stack the factors by size and create (or adopt from a
        loaded state_dict) each parameter's state, whose factor entries become views into the stacks."""
        d = self.defaults["max_preconditioner_dim"]
        dev = ps[0].device
        if any(p.device != dev for p in ps):
            raise ValueError(f"{_OWNER}: params must be on one device; got {sorted({str(p.device) for p in ps})}")
        shapes: dict[tuple[int, int], _ShapeGroup] = {}
        matrices = []
        for i, p in enumerate(ps):
            is_matrix = p.dim() >= 2
            matrices.append(is_matrix)
            if not is_matrix:
                continue
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            k = 0
            for r0, r1 in _cuts(rows, d):
                for c0, c1 in _cuts(cols, d):
                    grp = shapes.setdefault((r1 - r0, c1 - c0), _ShapeGroup(r1 - r0, c1 - c0))
                    grp.blocks.append(_Block(i, k, r0, r1, c0, c1))
                    k += 1
        groups = [shapes[k] for k in sorted(shapes)]
        counts: dict[int, int] = {}
        for grp in groups:
            grp.l0 = counts.get(grp.m, 0)
            counts[grp.m] = grp.l0 + len(grp.blocks)
            grp.r0 = counts.get(grp.n, 0)
            counts[grp.n] = grp.r0 + len(grp.blocks)
        f32 = torch.float32
        factors = {s: torch.zeros(c, s, s, dtype=f32, device=dev) for s, c in counts.items()}
        roots = {s: torch.eye(s, dtype=f32, device=dev).expand(c, s, s).clone() for s, c in counts.items()}
        infos = {s: torch.zeros(c, dtype=torch.int32, device=dev) for s, c in counts.items()}
        for grp in groups:
            b, m, n = len(grp.blocks), grp.m, grp.n
            grp.g = torch.empty(b, m, n, dtype=f32, device=dev)
            grp.a = torch.empty_like(grp.g)
            grp.t = torch.empty_like(grp.g)
            grp.p = torch.empty_like(grp.g)
            for j, blk in enumerate(grp.blocks):
                st = self.state[ps[blk.param]]
                for side, s, pos in (("L", m, grp.l0 + j), ("R", n, grp.r0 + j)):
                    for key, stack in ((f"{side}_{blk.index}", factors[s]), (f"{side}_root_{blk.index}", roots[s]),
                                       (f"{side}_info_{blk.index}", infos[s])):
                        old = st.get(key)
                        if isinstance(old, Tensor) and old.shape == stack[pos].shape:
                            stack[pos].copy_(old)
                        st[key] = stack[pos]
        step = None
        for p in ps:
            s = self.state[p].get("step")
            if isinstance(s, Tensor):
                step = s.detach().to(device=dev, dtype=f32, copy=True).reshape(())
                break
        if step is None:
            step = torch.zeros((), dtype=f32, device=dev)
        beta1 = self.defaults["betas"][0]
        gkey = "graft_exp_avg_sq" if self.defaults["grafting"] == "adam" else "graft_sum"
        for p in ps:
            st = self.state[p]
            st["step"] = step
            for key, needed in ((gkey, True), ("exp_avg", beta1 != 0)):
                old = st.get(key)
                if needed and not (isinstance(old, Tensor) and old.shape == p.shape and old.dtype == f32):
                    st[key] = torch.zeros(p.shape, dtype=f32, device=dev) if old is None else old.to(f32)
        key = tuple(x for p in ps for x in (id(p), p.data_ptr()))
        lay = _Layout(ps, gids, matrices, groups, factors, roots, infos, step, key)
        lay.graft = [self.state[p][gkey] for p in ps]
        lay.moments = [self.state[p]["exp_avg"] for p in ps] if beta1 != 0 else []
        # zeros, not empty: a step skipped by GradScaler leaves them as they were, and the factors'
        # select (lerp with weight 0) must not meet a NaN of uninitialised memory
        lay.gbuf = [torch.zeros(p.shape, dtype=f32, device=dev) for p in ps]
        lay.dbuf = [torch.zeros(p.shape, dtype=f32, device=dev) for p in ps]
        for grp in groups:
            for j, blk in enumerate(grp.blocks):
                rows, cols = slice(blk.r0, blk.r1), slice(blk.c0, blk.c1)
                lay.gather_dst += [grp.g[j], grp.a[j]]  # type: ignore[index]
                lay.gather_src += [_matrix(lay.gbuf[blk.param])[rows, cols], _matrix(lay.dbuf[blk.param])[rows, cols]]
                lay.scatter_dst.append(_matrix(lay.dbuf[blk.param])[rows, cols])
                lay.scatter_src.append(grp.p[j])  # type: ignore[index]
        if self._use_kernels and dev.type == "cuda" and cukit.is_available() and len(set(gids)) <= MAX_GROUPS:
            self._build_launches(lay)
        return lay

    def _build_launches(self, lay: _Layout) -> None:
        """The tensor tables of the CUDA path, one pair per parameter dtype (the kernels are built
        per dtype); each tensor's table group is its param group's position among the active ones."""
        if not all(p.is_contiguous() for p in lay.params):
            return  # the torch path: the tables see raw pointers
        lay.active_groups = order = sorted(set(lay.gids))
        local = [order.index(gi) for gi in lay.gids]
        grads = _contiguous_grads(lay.params)
        for dtype in sorted({p.dtype for p in lay.params}, key=str):
            idx = [i for i, p in enumerate(lay.params) if p.dtype == dtype]
            params, grads_, graft, gbuf, dbuf, groups = (
                [xs[i] for i in idx] for xs in (lay.params, grads, lay.graft, lay.gbuf, lay.dbuf, local)
            )
            lists = [params, dbuf] + ([[lay.moments[i] for i in idx]] if lay.moments else [])
            lay.launches.append(_Launch(DTYPES[str(dtype).removeprefix("torch.")].ctype, idx,
                                        TensorTable([params, grads_, graft, gbuf, dbuf], groups),
                                        TensorTable(lists, groups)))
        lay.grad_ptrs = [g.data_ptr() for g in grads]

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Shampoo step over every parameter with a gradient (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ps, gids = self._active()
        if not ps:
            return loss
        lay = self._layout
        if lay is None or lay.key != tuple(x for p in ps for x in (id(p), p.data_ptr())):
            lay = self._layout = self._build(ps, gids)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        dev = ps[0].device
        ok: Tensor | None = None  # 1.0 where the step runs, 0.0 where GradScaler found an inf
        if found_inf is not None:
            ok = (found_inf.to(dev) == 0).to(torch.float32)
        self._host_step += 1
        self._update(lay, grad_scale, ok, found_inf)
        return loss

    def _commit(self, dst: list[Tensor], new: list[Tensor], ok: Tensor | None) -> None:
        """dst <- new, or dst <- ok ? new : dst, exactly: dst * (1 - ok) + new * ok with ok 0 or 1
        and both finite (a skipped step's gradients are zeroed first). `new` is overwritten.
        Multiplies by a device tensor: a foreach lerp would read its weight on the host."""
        if not dst:
            return
        if ok is None:
            torch._foreach_copy_(dst, new)
        else:
            torch._foreach_mul_(new, ok)
            torch._foreach_mul_(dst, 1.0 - ok)
            torch._foreach_add_(dst, new)

    def _update(self, lay: _Layout, grad_scale: Tensor | None, ok: Tensor | None,
                found_inf: Tensor | None) -> None:
        from cukit.ops.matmul import gemm as _gemm

        hp = self.defaults
        gemm = functools.partial(_gemm, precision=hp["matmul_precision"])
        beta2 = float(hp["betas"][1])
        dev = lay.params[0].device
        f32 = torch.float32
        skip = None if found_inf is None else found_inf.to(device=dev, dtype=f32, non_blocking=True)
        scale = None if grad_scale is None else grad_scale.to(device=dev, dtype=f32, non_blocking=True)
        if lay.launches:
            self._launch(lay, "graft", scale, skip)
        else:
            self._graft_torch(lay, scale, ok)
        # ---- Kronecker factors, roots and the preconditioned, grafted directions
        t_host = self._host_step
        start = hp["start_preconditioning_step"]
        precondition = t_host >= start
        if lay.groups:
            self._factors(lay, ok, beta2, gemm, gather_dirs=precondition)
            if precondition and (t_host == start or (t_host - start) % hp["precondition_frequency"] == 0):
                self._roots(lay)
            if precondition:
                self._precondition(lay, gemm)
        if lay.launches:
            self._launch(lay, "update", scale, skip)
        else:
            self._apply_torch(lay, ok)

    def _hyperparameters(self, lay: _Layout) -> tuple[float, ...]:
        """The kernels' per-group values (raw_kernels/shampoo.cu's hp), in the tables' group order."""
        hp = self.defaults
        beta1, beta2 = (float(b) for b in hp["betas"])
        adam = hp["grafting"] == "adam"
        decay = beta2 if adam and beta2 != 1.0 else 1.0
        rows = []
        for gi in lay.active_groups:
            g = self.param_groups[gi]
            wd, dec = float(g["weight_decay"]), bool(g["decoupled_weight_decay"])
            rows.append((-1.0 if g["maximize"] else 1.0, 0.0 if dec else wd, decay, float(hp["grafting_epsilon"]),
                         beta1, wd if dec else 0.0, 1.0 if adam else 0.0))
        return pack_hp(rows)

    def _launch(self, lay: _Layout, which: str, scale: Tensor | None, skip: Tensor | None) -> None:
        """One of raw_kernels/shampoo.cu's passes over every parameter ("graft" also counts the
        step, unless skipped, and points its tables at this step's gradients)."""
        dev = lay.params[0].device
        if which == "graft":
            grads = _contiguous_grads(lay.params)
            ptrs = [g.data_ptr() for g in grads]
            if ptrs != lay.grad_ptrs:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"{_OWNER}: the gradients moved during CUDA-graph capture; run the step "
                                       "once before capturing, with the gradient tensors the graph will see")
                for ln in lay.launches:
                    ln.graft.set_list(1, [grads[i] for i in ln.index])
                lay.grad_ptrs = ptrs
            key = self._hyperparameters(lay)
            if key != lay.hp_key:
                lay.hp, lay.hp_key = hp_tensor(key, dev), key
            launch_count(SHAMPOO, lay.step, skip)
        if which == "graft":  # shampoo_graft reads no learning rate: nothing to convert or upload
            lrs, lr_dev = no_lr(), None
        else:
            lrs, lr_dev = lr_args([self.param_groups[gi]["lr"] for gi in lay.active_groups], dev)
        momentum = "true" if lay.moments else "false"
        for ln in lay.launches:
            table = ln.graft if which == "graft" else ln.update
            name = f"shampoo_graft<{ln.ctype}>" if which == "graft" else f"shampoo_update<{ln.ctype}, {momentum}>"
            launch_update(SHAMPOO, name, table, hp=lay.hp, groups=len(lay.active_groups), lrs=lrs,  # type: ignore[arg-type]
                          lr_dev=lr_dev, grad_div=scale, grad_mul=None, skip=skip, extra=(lay.step,))

    def _graft_torch(self, lay: _Layout, scale: Tensor | None, ok: Tensor | None) -> None:
        """shampoo_graft's maths in torch ops: the float32 gradients (unscaled, signed, L2-decayed; a
        skipped step's zeroed so every later value is finite) and the grafting directions."""
        hp = self.defaults
        beta2 = float(hp["betas"][1])
        f32 = torch.float32
        ps = lay.params
        gs = lay.gbuf
        torch._foreach_copy_(gs, [p.grad for p in ps])  # type: ignore[misc]
        if scale is not None:
            torch._foreach_mul_(gs, 1.0 / scale)
        if ok is not None:
            skip = ok == 0
            for g in gs:
                g.masked_fill_(skip, 0.0)
        if any(self.param_groups[gi]["maximize"] for gi in set(lay.gids)):
            for i, gi in enumerate(lay.gids):
                if self.param_groups[gi]["maximize"]:
                    gs[i].neg_()
        l2 = [(i, self.param_groups[gi]["weight_decay"]) for i, gi in enumerate(lay.gids)
              if not self.param_groups[gi]["decoupled_weight_decay"] and self.param_groups[gi]["weight_decay"] != 0]
        for i, wd in l2:
            gs[i].add_(ps[i].to(f32), alpha=float(wd))
        new_step = lay.step + (1.0 if ok is None else ok)
        adam = hp["grafting"] == "adam"
        vs = lay.graft
        decay = beta2 if adam and beta2 != 1.0 else 1.0
        # in place, unless a skipped step must be able to leave the state as it was
        nv = vs if ok is None else [v.clone() for v in vs]
        if decay != 1.0:
            torch._foreach_mul_(nv, decay)
        torch._foreach_addcmul_(nv, gs, gs, value=1.0 - decay if decay != 1.0 else 1.0)
        if adam:  # bias correction of the average (of the sum: the mean, beta2 == 1)
            bc2 = new_step if decay == 1.0 else 1.0 - torch.pow(decay, new_step)
            denom = torch._foreach_div(nv, bc2)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(nv)
        torch._foreach_add_(denom, float(hp["grafting_epsilon"]))
        dirs = lay.dbuf
        torch._foreach_copy_(dirs, gs)
        torch._foreach_div_(dirs, denom)
        if ok is not None:
            self._commit(vs, nv, ok)

    def _apply_torch(self, lay: _Layout, ok: Tensor | None) -> None:
        """shampoo_update's maths in torch ops: momentum, decay and the step; then the step count."""
        beta1 = float(self.defaults["betas"][0])
        f32 = torch.float32
        ps, dirs, step = lay.params, lay.dbuf, lay.step
        new_step = step + (1.0 if ok is None else ok)
        if beta1 != 0:
            ms = lay.moments
            if ok is None:
                torch._foreach_lerp_(ms, dirs, 1.0 - beta1)
                nm = ms
            else:
                nm = list(torch._foreach_lerp(ms, dirs, 1.0 - beta1))
                self._commit(ms, nm, ok)
            bc1 = 1.0 - torch.pow(beta1, new_step)
            upd = torch._foreach_div(nm, bc1)
        else:
            upd = dirs
        for gi, group in enumerate(self.param_groups):
            idx = [i for i, g in enumerate(lay.gids) if g == gi]
            if not idx:
                continue
            # a float lr stays a Python scalar: a new device tensor per step would be a host copy,
            # and under CUDA-graph capture a copy from a host buffer the replays would not refresh
            lr: float | Tensor = group["lr"]
            lr = lr.to(device=ps[0].device, dtype=f32) if isinstance(lr, Tensor) else float(lr)
            if ok is not None:
                lr = ok * lr
            sub_p = [ps[i] for i in idx]
            work = [p if p.dtype == f32 else p.to(f32) for p in sub_p]
            wd = float(group["weight_decay"])
            if group["decoupled_weight_decay"] and wd != 0:
                torch._foreach_mul_(work, 1.0 - lr * wd)
            torch._foreach_sub_(work, torch._foreach_mul([upd[i] for i in idx], lr))
            for p, w in zip(sub_p, work, strict=True):
                if w is not p:
                    p.copy_(w)
        step.copy_(new_step)

    def _factors(self, lay: _Layout, ok: Tensor | None, beta2: float, gemm: Any, *, gather_dirs: bool) -> None:
        """Gather the gradient (and grafting) blocks into their stacks, then one batched gemm per
        block shape and side: ``F <- beta2 F + (1 - beta2) X X^T`` (sums when beta2 == 1)."""
        if gather_dirs:
            torch._foreach_copy_(lay.gather_dst, lay.gather_src)
        else:
            torch._foreach_copy_(lay.gather_dst[::2], lay.gather_src[::2])
        alpha, beta = (1.0, 1.0) if beta2 == 1.0 else (1.0 - beta2, beta2)
        for grp in lay.groups:
            g = grp.g
            nb = len(grp.blocks)
            lf = lay.factors[grp.m][grp.l0 : grp.l0 + nb]
            rf = lay.factors[grp.n][grp.r0 : grp.r0 + nb]
            for f, x, xt in ((lf, g, g.mT), (rf, g.mT, g)):  # type: ignore[union-attr]
                if ok is None:
                    gemm(x, xt, f, alpha=alpha, beta=beta)
                else:  # a skipped step must leave F as it was: the update into a copy, then a select
                    new = f.clone()
                    gemm(x, xt, new, alpha=alpha, beta=beta)
                    f.lerp_(new, ok)

    def _roots(self, lay: _Layout) -> None:
        """One batched inverse 4th root per factor size; failed matrices keep their previous root."""
        from cukit.linalg import matrix_inverse_root

        hp = self.defaults
        rdt = hp["root_dtype"]
        for s, f in lay.factors.items():
            a = f if rdt == torch.float32 else f.to(rdt)
            prec = hp["matmul_precision"] if rdt == torch.float32 else "ieee"
            x, info = matrix_inverse_root(a, _ROOT, eps=float(hp["epsilon"]), method=hp["root_method"],
                                          return_info=True, precision=prec)
            x = x.to(device=f.device, dtype=torch.float32)
            info = info.to(device=f.device)
            # info 1 (Newton not converged within max_iters) is still a finite, improving iterate
            keep = (info == 2)[:, None, None]
            lay.roots[s].copy_(torch.where(keep, lay.roots[s], x))
            lay.infos[s].copy_(info)

    def _precondition(self, lay: _Layout, gemm: Any) -> None:
        """P = L^(-1/4) G R^(-1/4) per block shape (two batched gemms), grafted to the norm of the
        block's grafting direction, scattered into the direction buffers."""
        for grp in lay.groups:
            nb = len(grp.blocks)
            ql = lay.roots[grp.m][grp.l0 : grp.l0 + nb]
            qr = lay.roots[grp.n][grp.r0 : grp.r0 + nb]
            gemm(ql, grp.g, grp.t)
            gemm(grp.t, qr, grp.p)
            pn = torch.linalg.vector_norm(grp.p, dim=(1, 2))
            an = torch.linalg.vector_norm(grp.a, dim=(1, 2))
            scale = torch.where(pn > 0, an / pn, torch.zeros_like(pn))
            grp.p.mul_(scale[:, None, None])  # type: ignore[union-attr]
        torch._foreach_copy_(lay.scatter_dst, lay.scatter_src)
