"""MultiTensorOptimizer: the torch.optim.Optimizer subclass every cukit optimizer derives from.

Per step on the GPU: one pointer check (a tuple of the params' and grads' data_ptr()s, or in
flat-gradient mode an identity check of two grads), then for each launch (one per device, dtype
combination and compile-time variant, up to 8 param groups each) the lrs by value and one kernel
over every tensor. The device tables are rebuilt only when a pointer changes. Step counts live in
one float32 device vector per launch; ``state[p]["step"]`` are 0-dim views into it (torch's layout:
a float32 scalar tensor per parameter), so state_dicts load both ways.

Without a GPU (or for CPU tensors) the same class runs ``optim/_reference.py`` over the same lists
(torch's ``_foreach_*`` ops: a constant number of torch calls per launch, whatever the number of
tensors). Arguments are checked by ``optim/_checks.py`` in the constructor and ``add_param_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict

import torch
from cukit.optim import _checks as chk
from cukit.optim import _distributed
from cukit.optim import _engine as eng
from cukit.optim._kernels import COMBOS

import cukit

__all__ = ["MultiTensorOptimizer"]

Tensor = torch.Tensor
_DATA_PTR = Tensor.data_ptr
_MAX_GRAD_NORM = chk.number(low_open=True, none="no clipping")


@dataclass
class _Plan:
    """One kernel launch's worth of tensors and the device objects it needs."""

    gids: list[int]  # optimizer param-group indices, launch-local index = position
    params: list[Tensor]
    grads: list[Tensor]
    states: dict[str, list[Tensor]]
    masters: list[Tensor] | None
    pname: str
    sname: str
    variant: tuple[Any, ...]
    table: eng.TensorTable | None = None
    steps: Tensor | None = None  # float32 [T]: state[p]["step"] are views into it
    counts: Tensor | None = None  # SGD: steps taken with each momentum buffer
    hp: Tensor | None = None
    hp_values: tuple[float, ...] = ()
    member_gids: list[int] = field(default_factory=list)  # the param group of each tensor
    scratch: dict[str, Any] = field(default_factory=dict)
    extra: tuple[Any, ...] = ()  # appended to the update kernel's arguments (quantised: code tables)


class EngineOptions(TypedDict, total=False):
    """The keyword-only options every cukit optimizer takes (see :class:`MultiTensorOptimizer`)."""

    flat_grads: bool
    master_weights: bool
    state_dtype: torch.dtype | None
    max_grad_norm: float | None


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


class MultiTensorOptimizer(torch.optim.Optimizer):
    """Base of cukit's fused multi-tensor optimizers (see the module docstring).

    Options shared by every optimizer (keyword-only, not part of the param groups, so a state_dict
    stays torch's):
        flat_grads: the optimizer owns one gradient buffer per (device, dtype); each ``p.grad`` is a
            view into it and :meth:`zero_grad` clears it in place. The per-step host cost then does
            not depend on the number of tensors. Every parameter has a gradient (zeros when unused).
        master_weights: keep a float32 copy of 16-bit parameters (``state[p]["master_param"]``); the
            update runs on it and the parameter receives its rounding.
        state_dtype: dtype of the optimizer state (default: the parameter's, as torch); float32 for
            16-bit parameters, or bfloat16 for float32 parameters.
        max_grad_norm: clip the gradients' global L2 norm to this inside the step (the gradients
            themselves are left as they are), computed on the GPU with no host sync.
    """

    _step_supports_amp_scaling: ClassVar[bool] = True  # GradScaler passes grad_scale / found_inf
    _has_step: ClassVar[bool] = True
    # the state holding a launch's master-weight list (the low-bit optimizers' residual mode: another)
    _master_key: str = "master_param"
    # why DTensor (sharded) parameters cannot hold for this optimizer, or None (elementwise updates)
    _no_sharding: ClassVar[str | None] = None

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        flat_grads: bool = False,
        master_weights: bool = False,
        state_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        owner = type(self).__name__
        chk.FLAG(owner, "flat_grads", flat_grads)
        chk.FLAG(owner, "master_weights", master_weights)
        chk.check_state_dtype(owner, state_dtype)
        _MAX_GRAD_NORM(owner, "max_grad_norm", max_grad_norm)
        self._flat = flat_grads
        self._master = master_weights
        self._state_dtype = state_dtype
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._key: list[int] | None = None
        self._plans: list[_Plan] = []
        self._norm: dict[int, dict[str, Any]] | None = None  # clipping: prepared norms by device
        self._flat_buffers: list[Tensor] = []
        self._sentinels: list[tuple[Tensor, Tensor, int, int]] = []  # (param, its grad view, their pointers)
        super().__init__(params, defaults)
        self._all = [p for g in self.param_groups for p in g["params"]]
        for p in self._all:
            if not isinstance(p, Tensor):
                raise TypeError(f"params must be tensors; got {type(p).__qualname__}")
            if p.is_sparse:
                raise TypeError("cukit.optim does not support sparse parameters")
        self._sharded = _distributed.check_params(self)  # DTensor params: steps on local shards
        if self._flat:
            self._make_flat_grads()

    # ---------------------------------------------------------------- argument checks
    def _check_args(self, values: Mapping[str, Any], where: str = "") -> None:
        """Check `values` (argument name -> value), one by one and in combination; TypeError /
        ValueError naming the class and the argument (SpecOptimizer: by its spec's rules)."""
        raise NotImplementedError

    def _defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The param-group defaults from the constructor's arguments, checked first
        (:meth:`_check_args`): betas as a tuple; ``differentiable`` refused when True and stored
        False, ``fused`` stored None (cukit's engine runs whatever was asked: torch's flags are
        accepted for drop-in use)."""
        self._check_args(values)
        if values.get("differentiable"):
            raise ValueError(f"{type(self).__name__}: differentiable=True is not supported by cukit.optim")
        out = dict(values)
        if "betas" in out:
            out["betas"] = tuple(out["betas"])
        if "differentiable" in out:
            out["differentiable"] = False
        if "fused" in out:
            out["fused"] = None
        return out

    # ---------------------------------------------------------------- subclass hooks
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _variant(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """Compile-time choices a launch cannot mix (part of the partition key)."""
        return ()

    def _param_variant(self, p: Tensor) -> tuple[Any, ...]:
        """Per-parameter compile-time choices (appended to the group's :meth:`_variant`)."""
        return ()

    def _plan_state_keys(self, group: dict[str, Any], variant: tuple[Any, ...]) -> tuple[str, ...]:
        """The state lists of a launch with this variant (default :meth:`_state_keys`)."""
        return self._state_keys(group)

    def _state_dtype_for(self, p: Tensor, key: str, sdt: torch.dtype) -> torch.dtype:
        """The dtype state `key` of `p` is kept in (default: the launch's state dtype)."""
        return sdt

    def _rank_local_state(self, p: Tensor, key: str) -> bool:
        """Whether state `key` of DTensor `p` describes the rank's local shard rather than a part
        of p's global tensor (quantised states' block scales); stored by _distributed.rank_local."""
        return False

    def _state_numel(self, p: Tensor, key: str) -> int:
        """Elements of a rank-local state `key` of `p` on this rank (:meth:`_rank_local_state`)."""
        raise NotImplementedError

    def _new_state(self, p: Tensor, key: str, group: dict[str, Any], dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)  # DTensor p: sharded

    def _make_masters(self, params: list[Tensor]) -> list[Tensor]:
        """The master-weight list of a launch: float32 copies (``state[p]["master_param"]``)."""
        masters = []
        for p in params:
            m = self.state[p].get("master_param")
            if m is None or m.dtype != torch.float32 or m.device != p.device or not m.is_contiguous():
                m = (p if m is None else m).detach().to(torch.float32, copy=True).contiguous()
                self.state[p]["master_param"] = m
            masters.append(m)
        return masters

    def _divisors(self, plan: _Plan) -> list[int] | None:
        """Each list's element ratio in the launch's tensor table (None: all 1)."""
        return None

    def _launch(self, plan: _Plan, common: dict[str, Any]) -> None:
        raise NotImplementedError

    def _reference(self, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: Tensor | None) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- torch.optim.Optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, plus the checks of the constructor for the hyperparameters the group sets
        (TypeError / ValueError) and for its parameters' dtypes (with ``state_dtype``)."""
        where = f"param group {len(self.param_groups)}"
        if isinstance(param_group, dict):
            overrides = {k: v for k, v in param_group.items() if k != "params"}
            if overrides:
                self._check_args({**self.defaults, **overrides}, where)
        super().add_param_group(param_group)
        try:
            chk.check_param_dtypes(
                type(self).__name__, self.param_groups[-1]["params"], self._state_dtype, self._master, where
            )
        except TypeError:
            self.param_groups.pop()
            raise
        if hasattr(self, "_all"):
            self._all = [p for g in self.param_groups for p in g["params"]]
            self._sharded = _distributed.check_params(self)
            self._invalidate()
            if self._flat:
                self._make_flat_grads()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts state to the parameter's dtype; float32 masters, states of another dtype and
        # integer states (quantised codes) keep theirs here.
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        keep: dict[int, dict[str, Tensor]] = {}
        for i in ids:
            st = saved.get(i, {})
            keep[i] = {
                k: v for k, v in st.items() if isinstance(v, Tensor) and k != "step"
            }
        super().load_state_dict(state_dict)
        for i, p in zip(ids, self._all, strict=False):
            for k, v in keep.get(i, {}).items():
                if k == "master_param":
                    target = torch.float32
                else:
                    target = (self._state_dtype or v.dtype) if v.is_floating_point() else v.dtype
                self.state[p][k] = v.to(device=p.device, dtype=target, copy=True)
        self._invalidate()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients. In flat-gradient mode the one buffer is zeroed in place (the grads
        stay views into it, whatever `set_to_none` says)."""
        if self._flat:
            self._check_flat()
            for b in self._flat_buffers:
                b.zero_()
            return
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every parameter with a gradient. Reads ``self.grad_scale`` and
        ``self.found_inf`` when torch.amp.GradScaler sets them (``_step_supports_amp_scaling``): the
        gradients are unscaled in the kernel and, when found_inf != 0, nothing changes (no host
        sync). Both may live on another device than some parameters (GradScaler keeps them on its
        own device): each device's launches read a copy made on that device for this step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        if not self._refresh():
            return loss
        if self._plans[0].table is None:
            self._reference_step(grad_scale, found_inf)
            return loss
        scale_on, inf_on = _OnDevice(grad_scale), _OnDevice(found_inf)
        gmuls = self._clip_coefficients(scale_on) if self._max_grad_norm is not None else {}
        for plan in self._plans:
            dev = plan.table.device  # type: ignore[union-attr]
            common = {"grad_div": scale_on.get(dev), "grad_mul": gmuls.get(dev), "skip": inf_on.get(dev)}
            self._launch(plan, common)
        return loss

    # ---------------------------------------------------------------- pointers and plans
    def _invalidate(self) -> None:
        self._key = None

    def _refresh(self) -> bool:
        """Rebuild the plans if a param or grad pointer changed. False when no param has a grad."""
        if self._flat and self._key is not None:
            self._check_flat()  # may rebuild the buffers, which invalidates the plans
            if self._key is not None:
                return bool(self._plans)
        ps = self._all
        if self._sharded:  # a DTensor's data_ptr() is 0: its local shard's pointer is the key
            key = _distributed.pointer_key(ps)
            if key != self._key:
                self._build()
                self._key = key
            return bool(self._plans)
        # Every pointer, params' too (module.to() moves a param's storage in place: p.data = ...).
        # ~160 ns per tensor on a CPU, bound by touching three objects per tensor: p.grad ~65 ns,
        # each data_ptr() ~45 ns (10,000 tensors, 2-core dev box). Two map()s over the C getter
        # into one list measured 12% under a generator with a None test per grad; a None grad
        # (rare after the first step) takes the slow path. flat_grads makes the check constant.
        grads = [p.grad for p in ps]
        key = list(map(_DATA_PTR, ps))
        try:
            key += map(_DATA_PTR, grads)
        except TypeError:  # some grad is None (a frozen param): every step, so the params' part stays
            del key[len(ps) :]
            key += (-1 if g is None else g.data_ptr() for g in grads)
        if key != self._key:
            if not self._repoint_grads(key):
                self._build()
            self._key = key
        return bool(self._plans)

    def _repoint_grads(self, key: list[int]) -> bool:
        """Only gradient pointers moved (a backward that allocated its gradients anew: set_to_none,
        a compiled backward): point each plan's table at the new gradients and keep everything
        else (states, steps, hyperparameters). False when anything else changed: rebuild."""
        old, n = self._key, len(self._all)
        if old is None or len(old) != len(key) or old[:n] != key[:n] or -1 in key[n:] or -1 in old[n:]:
            return False
        if not self._plans or any(plan.table is None for plan in self._plans):
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False  # _build raises the capture error
        news = []
        for plan in self._plans:
            grads = [p.grad for p in plan.params]
            # element count, dtype, device and layout: what the kernels rely on (torch's grad setter
            # and AccumulateGrad keep each grad's shape equal to its param's)
            if not plan.table.fits(1, grads):  # type: ignore[union-attr]
                return False  # _build raises the error for it
            news.append(grads)
        for plan, grads in zip(self._plans, news, strict=True):
            plan.table.set_list(1, grads, checked=True)  # type: ignore[union-attr]
            plan.grads = grads
        self._norm = None  # the clipping norm's prepared lists hold the old gradients
        return True

    def _use_kernels(self, params: Sequence[Tensor]) -> bool:
        return cukit.is_available() and all(p.is_cuda for p in params)

    def _build(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "cukit.optim: the parameters or gradients changed during CUDA-graph capture; run the "
                "step once before capturing (with the same gradient tensors)"
            )
        active: list[tuple[int, Tensor]] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise TypeError("cukit.optim does not support sparse gradients")
                if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                    raise ValueError(
                        f"a gradient does not match its parameter (shape {tuple(p.shape)}, {p.dtype}, {p.device})"
                    )
                active.append((gi, p))
        kernels = bool(active) and self._use_kernels([p for _, p in active])
        parts: dict[tuple[Any, ...], list[tuple[int, Tensor]]] = {}
        for gi, p in active:
            group = self.param_groups[gi]
            pname = _dtype_name(p.dtype)
            sdt = self._state_dtype or p.dtype
            sname = _dtype_name(sdt)
            master = self._master and p.dtype in (torch.float16, torch.bfloat16)
            if (pname, sname, master) not in COMBOS:
                raise TypeError(
                    f"cukit.optim: parameters of dtype {pname} with state_dtype {sname} are not supported; "
                    f"supported (param, state): {sorted({(a, b) for a, b, _ in COMBOS})}"
                )
            k = (p.device, pname, sname, master, self._variant(group) + self._param_variant(p))
            parts.setdefault(k, []).append((gi, p))
        plans: list[_Plan] = []
        for (_, pname, sname, master, variant), members in parts.items():
            gids = list(dict.fromkeys(gi for gi, _ in members))
            for s in range(0, len(gids), eng.MAX_GROUPS):
                chosen = gids[s : s + eng.MAX_GROUPS]
                sub = [(gi, p) for gi, p in members if gi in chosen]
                plans.append(self._make_plan(chosen, sub, pname, sname, master, variant, kernels))
        self._plans = plans
        self._norm = None

    def _make_plan(
        self,
        gids: list[int],
        members: list[tuple[int, Tensor]],
        pname: str,
        sname: str,
        master: bool,
        variant: tuple[Any, ...],
        kernels: bool,
    ) -> _Plan:
        params = [p for _, p in members]
        grads = [p.grad for p in params]
        for i, p in enumerate(params):
            if kernels and not p.is_contiguous():
                raise ValueError(
                    f"cukit.optim: parameter {i} of a launch is not contiguous (shape {tuple(p.shape)})"
                )
            if kernels and not grads[i].is_contiguous():  # type: ignore[union-attr]
                raise ValueError(
                    f"cukit.optim: the gradient of parameter of shape {tuple(p.shape)} is not contiguous"
                )
        sdt = getattr(torch, sname)
        states: dict[str, list[Tensor]] = {}
        group0 = self.param_groups[gids[0]]
        fresh: list[bool] = []
        keys = self._plan_state_keys(group0, variant)
        for key in keys:
            lst = []
            for gi, p in members:
                st = self.state[p]
                v = st.get(key)
                if key == keys[0]:
                    fresh.append(v is None)
                want = self._state_dtype_for(p, key, sdt)
                if v is None:
                    v = self._new_state(p, key, self.param_groups[gi], want)
                elif v.dtype != want or v.device != p.device or not v.is_contiguous():
                    v = v.to(device=p.device, dtype=want, memory_format=torch.contiguous_format)
                st[key] = v
                lst.append(v)
            states[key] = lst
        masters = self._make_masters(params) if master else None
        plan = _Plan(gids, params, grads, states, masters, pname, sname, variant)  # type: ignore[arg-type]
        plan.member_gids = [gi for gi, _ in members]
        plan.scratch["fresh"] = torch.tensor(fresh or [False] * len(params))
        if self._has_step:
            for p in params:
                if "step" not in self.state[p]:
                    self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        if self._sharded:  # the lists become local shards; `params` (DTensors) still key the state
            _distributed.localize_plan(self, plan, kernels)
        if not kernels:
            return plan
        local = {gi: i for i, gi in enumerate(gids)}
        lists = [plan.params, plan.grads, *plan.states.values(), *([plan.masters] if masters is not None else [])]
        plan.table = eng.TensorTable(  # type: ignore[arg-type]
            lists, [local[gi] for gi, _ in members], divisors=self._divisors(plan)
        )
        device = params[0].device
        if self._has_step:
            plan.steps = _gather_steps([self.state[p]["step"] for p in params], device)
            for i, p in enumerate(params):
                self.state[p]["step"] = plan.steps[i]
        return plan

    # ---------------------------------------------------------------- flat gradients
    def _make_flat_grads(self) -> None:
        by: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in self._all:
            by.setdefault((p.device, p.dtype), []).append(p)
        self._flat_buffers = []
        self._sentinels = []
        with torch.no_grad():
            for (device, dtype), ps in by.items():
                # each view starts on a 16-byte boundary, so every grad takes the vector path
                align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
                offs, n = [], 0
                for p in ps:
                    offs.append(n)
                    n += -(-p.numel() // align) * align
                buf = torch.zeros(n, dtype=dtype, device=device)
                for p, o in zip(ps, offs, strict=True):
                    view = buf[o : o + p.numel()].view(p.shape)
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
                self._flat_buffers.append(buf)
                for p in (ps[0], ps[-1]):
                    self._sentinels.append((p, p.grad, p.data_ptr(), p.grad.data_ptr()))  # type: ignore[union-attr]
        self._invalidate()

    def _check_flat(self) -> None:
        """Constant-cost check of the flat gradients: the first and last parameter of each buffer.
        Their grads must still be our views; if their storage moved (``model.to()`` assigns
        ``p.data`` and ``p.grad.data`` of every parameter), the buffers are rebuilt around the
        moved gradients."""
        for p, view, pptr, gptr in self._sentinels:
            if p.grad is view and (p.data_ptr() != pptr or view.data_ptr() != gptr):
                self._make_flat_grads()
                return
        for p, view, _, _ in self._sentinels:
            if p.grad is not view:
                raise RuntimeError(
                    "cukit.optim (flat_grads=True): a parameter's .grad is no longer the optimizer's view "
                    "(model.zero_grad() sets grads to None); clear grads with optimizer.zero_grad()"
                )

    # ---------------------------------------------------------------- clipping
    def _clip_coefficients(self, grad_scale: _OnDevice) -> dict[int, Tensor]:
        """The clipping coefficient over every gradient (:func:`clip_coefficients`), a float32
        0-dim tensor on each device that has parameters (no host sync)."""
        from cukit.optim import utils

        if self._sharded:  # the norm over every rank's shards: one all_reduce
            return _distributed.clip_coefficients(self, grad_scale, sumsq=utils.local_sumsq)
        if self._norm is None:
            by: dict[int, list[Tensor]] = {}
            for plan in self._plans:
                by.setdefault(plan.table.device, []).extend(plan.grads)  # type: ignore[union-attr]
            self._norm = {d: utils.prepare_norm(gs) for d, gs in by.items()}
        return clip_coefficients(self._norm, self._max_grad_norm, grad_scale)  # type: ignore[arg-type]

    # ---------------------------------------------------------------- reference path
    def _reference_step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        if found_inf is not None and float(found_inf) != 0.0:
            return
        gmul: Tensor | None = None
        if grad_scale is not None:
            gmul = 1.0 / grad_scale.to(torch.float32)
        if self._max_grad_norm is not None:
            from cukit.optim import utils

            grads = [g for plan in self._plans for g in plan.grads]
            norm = (_distributed.optimizer_norm(self, sumsq=utils.local_sumsq) if self._sharded
                    else utils.reference_l2norm(grads))
            if grad_scale is not None:
                norm = norm / grad_scale.to(norm.dtype)
            coef = torch.clamp(self._max_grad_norm / (norm + 1e-6), max=1.0)
            gmul = coef if gmul is None else gmul * coef
        for plan in self._plans:
            steps: list[float] = []
            if self._has_step:
                counts = [self.state[p]["step"] for p in plan.scratch.get("keys", plan.params)]
                torch._foreach_add_(counts, 1.0)
                steps = values(counts)
            first = plan.scratch.get("first")
            if first is None:
                first = plan.scratch["first"] = plan.scratch["fresh"].tolist()
            for gi, sub, sel in self._reference_groups(plan):
                if sel is None:
                    sub.scratch["first"] = first
                    self._reference(self.param_groups[gi], sub, steps, gmul)
                else:
                    sub.scratch["first"] = [first[i] for i in sel]
                    self._reference(self.param_groups[gi], sub, [steps[i] for i in sel] if steps else [], gmul)
            if any(first):
                plan.scratch["fresh"] = torch.zeros_like(plan.scratch["fresh"])
                plan.scratch["first"] = [False] * len(first)

    def _reference_groups(self, plan: _Plan) -> list[tuple[int, _Plan, list[int] | None]]:
        """The plan split by param group, once per plan: (group index, its part of the plan, the
        part's positions in the plan, None when the plan has one group)."""
        parts = plan.scratch.get("groups")
        if parts is not None:
            return parts
        if len(plan.gids) == 1:
            parts = [(plan.gids[0], plan, None)]
        else:
            parts = []
            for gi in plan.gids:
                sel = [i for i, g in enumerate(plan.member_gids) if g == gi]
                sub = _Plan(
                    [gi],
                    [plan.params[i] for i in sel],
                    [plan.grads[i] for i in sel],
                    {k: [v[i] for i in sel] for k, v in plan.states.items()},
                    None if plan.masters is None else [plan.masters[i] for i in sel],
                    plan.pname,
                    plan.sname,
                    plan.variant,
                )
                parts.append((gi, sub, sel))
        plan.scratch["groups"] = parts
        return parts


def clip_coefficients(norms: dict[int, dict[str, Any]], max_norm: float, grad_scale: _OnDevice) -> dict[int, Tensor]:
    """The clipping coefficient ``min(1, max_norm / (||g / grad_scale|| + 1e-6))`` on each device of
    `norms` (device -> utils.prepare_norm of its gradients), with no host sync. One device: the norm
    kernels' finalize computes it. Several: each device's norm, combined in float64 on the first
    device, and the coefficient copied to the others."""
    from cukit.optim import utils

    if len(norms) == 1:
        ((d, prep),) = norms.items()
        return {d: utils.run_norm(prep, grad_div=grad_scale.get(d), max_norm=max_norm)["coef"]}
    first = next(iter(norms))
    home = torch.device("cuda", first)
    parts = [
        utils.run_norm(prep, grad_div=grad_scale.get(d))["norm"].to(home, non_blocking=True)
        for d, prep in norms.items()
    ]
    total = torch.stack(parts).double().square().sum().sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # type: ignore[operator]
    return {d: coef if d == first else coef.to(torch.device("cuda", d), non_blocking=True) for d in norms}


def values(counts: list[Tensor]) -> list[float]:
    """The values of 0-dim tensors: one stack and one read when they share a device (as the
    reference's step counts do, unless a state_dict put some elsewhere)."""
    if not counts:
        return []
    try:
        return torch.stack(counts).tolist()
    except RuntimeError:
        return [float(c) for c in counts]


class _OnDevice:
    """GradScaler's ``grad_scale`` or ``found_inf`` (a float32 scalar tensor on the scaler's device,
    or None) as seen by the launches on each CUDA device: the tensor itself on its own device, else
    one copy per device and step, queued on the stream (``non_blocking``: no host sync). A kernel
    must not dereference a pointer into another GPU's memory; torch's fused optimizers make the same
    per-device copies. Not cached across steps: GradScaler updates the values in place."""

    __slots__ = ("copies", "t")

    def __init__(self, t: Tensor | float | None) -> None:
        if t is not None and not isinstance(t, Tensor):
            t = torch.tensor(float(t), dtype=torch.float32)
        self.t = t
        self.copies: dict[int, Tensor] = {}

    def get(self, device: int) -> Tensor | None:
        t = self.t
        if t is None:
            return None
        c = self.copies.get(device)
        if c is None:
            c = t.to(device=torch.device("cuda", device), dtype=torch.float32, non_blocking=True)
            self.copies[device] = c
        return c


def _gather_steps(steps: list[Tensor], device: torch.device) -> Tensor:
    """A float32 device vector with the values of `steps` (0-dim tensors anywhere): views into one
    of our earlier vectors are gathered with one index_select per vector, the rest copied."""
    out = torch.zeros(len(steps), dtype=torch.float32, device=device)
    by_base: dict[int, tuple[Tensor, list[int], list[int]]] = {}
    for i, s in enumerate(steps):
        base = s._base
        if (
            base is not None
            and base.dim() == 1
            and base.dtype == torch.float32
            and base.device == device
            and s.dim() == 0
        ):
            entry = by_base.setdefault(id(base), (base, [], []))
            entry[1].append(i)
            entry[2].append(s.storage_offset() - base.storage_offset())
        else:
            out[i] = s.detach().to(device=device, dtype=torch.float32)
    for base, dst, src in by_base.values():
        idx_src = torch.tensor(src, dtype=torch.long, device=device)
        idx_dst = torch.tensor(dst, dtype=torch.long, device=device)
        out.index_copy_(0, idx_dst, base.index_select(0, idx_src))
    return out
