"""Optimizers with 8-bit and 4-bit states: AdamW8bit, Adam8bit, Lion8bit, SGD8bit and AdamW4bit.

Each keeps its float32 twin's maths (:class:`~cukit.optim.AdamW`, ...; the Adam kernels divide by
the fast reciprocal, 2 ulp, where the float32 ones divide exactly) and stores the states
blockwise-quantised: per block of 256 elements (8-bit) or 128 (4-bit), the codes of the values
divided by the block's largest magnitude ``absmax``, on bitsandbytes' dynamic map (signed for
first moments and momentum, unsigned for second moments; the 4-bit second moment uses the linear
map ``k / 16``, k = 1..16, which has no zero). A step decodes, updates in float32 and re-encodes
in the same single launch over every tensor (the multi-tensor engine, with the codes and the scales
as two more lists per state: raw_kernels/include/cukit/multi_tensor.cuh). Tensors whose parameter
has fewer than ``min_8bit_size`` elements (the parameter's global size: a DTensor shard does not
change it) keep float32 states and run the twin's float32 kernel in a second launch.

State per parameter, under bitsandbytes' names so its state_dicts load here and
(:func:`to_bitsandbytes`) ours there: ``state1``/``state2`` (uint8 codes in the parameter's shape
for 8-bit; packed two per byte, ``ceil(n / 2)``, for 4-bit; float32 below ``min_8bit_size``),
``absmax1``/``absmax2`` (float32, one per block), ``qmap1``/``qmap2`` (the 256- or 16-entry code
tables), ``step``. ``master_weights=True`` keeps a float32 copy of 16-bit parameters
(``master_param``); ``master_weights="residual"`` keeps bfloat16 parameters plus an int8 residual
(``master_residual``, ``w = p + r ulp(p) / 254``): AdamW8bit then takes 2 + 1 + 2 bytes per
parameter for weights and states instead of 2 + 4 + 8.

lr may be a tensor (a device scalar: schedulers change it without any host sync or recompile).
Without a GPU the same classes decode, run the twin's plain-torch reference and re-encode, with
the kernels' encoding (nearest code, ties to the lower, by the same float32 midpoints).

See also: ``bitsandbytes.optim.AdamW8bit``, ``torchao.optim.AdamW8bit`` / ``AdamW4bit``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from cukit.optim import _checks as chk
from cukit.optim import _distributed
from cukit.optim._base import MultiTensorOptimizer, _Plan
from cukit.optim._kernels import lowbit_masters
from cukit.optim._spec import Spec, kernel_name, quantised
from cukit.optim.adam import ADAM_SPEC, ADAMW_SPEC, Adam
from cukit.optim.lion import LION_SPEC, Lion
from cukit.optim.sgd import SGD, SGD_SPEC

from cukit._device import sm_count

__all__ = [
    "Adam8bit",
    "AdamW4bit",
    "AdamW8bit",
    "Lion8bit",
    "SGD8bit",
    "dequantize_blockwise",
    "dynamic_map",
    "linear_map",
    "quantize_blockwise",
    "to_bitsandbytes",
]

Tensor = torch.Tensor
_QTABLE = 2304  # floats per state in a launch's code tables (kQTable in multi_tensor.cuh)
_BUCKET_SHIFT = 16  # kBucketShift: a bucket is |x|'s float bits >> 16
_BUCKET_LO = 0x33800000 >> _BUCKET_SHIFT
_BUCKETS = (0x3F800000 >> _BUCKET_SHIFT) - _BUCKET_LO + 1
_STEPS = {256: 1, 16: 1}  # QCodec::kSteps by table size
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"  # bitsandbytes nests its quantisation state here


# ---------------------------------------------------------------- code tables
def dynamic_map(signed: bool = True, bits: int = 8) -> Tensor:
    """bitsandbytes' dynamic quantisation map (``create_dynamic_map``): 2**bits sorted float32 codes
    in [-1, 1] (signed) or [0, 1], a decimal exponent and a linear fraction whose precision grows
    towards zero. ``bits`` 8 uses 7 exponent bits (bitsandbytes' optimizers), 4 uses 3.

    See also: ``bitsandbytes.functional.create_dynamic_map``."""
    if bits not in (4, 8):
        raise ValueError(f"dynamic_map: bits must be 4 or 8; got {bits!r}")
    exp_bits = 7 if bits == 8 else 3
    frac_bits = bits - 1 - exp_bits  # 0 for both: no extra linear items
    data: list[float] = []
    for i in range(exp_bits):
        items = 2 ** (i + frac_bits) + 1 if signed else 2 ** (i + frac_bits + 1) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (-(exp_bits - 1) + i)
        data += (scale * means).tolist()  # float32 products, as bitsandbytes rounds them
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def linear_map(bits: int = 4) -> Tensor:
    """The unsigned linear map without zero, ``k / 2**bits`` for k = 1 .. 2**bits: second moments in
    4 bits (a zero code would turn small second moments into division by eps)."""
    n = 2**bits
    return torch.arange(1, n + 1, dtype=torch.float32) / n


def _midpoints(code: Tensor) -> Tensor:
    return (code[:-1] + code[1:]) / 2


def bucket_table(code: Tensor) -> Tensor:
    """The kernels' search start for each bucket of normalised values (uint8, 2 x _BUCKETS): for
    positive values of bucket b (|x|'s float bits >> 18, from 2^-24 up to 1; bucket 0 also holds
    zero) the count of midpoints below the bucket's lowest value, for negative ones the count below
    minus its highest. Each is at most the value's nearest-code index, which the kernel then
    reaches by comparing with the next midpoints."""
    mids = _midpoints(code.float()).double()
    b = torch.arange(_BUCKETS, dtype=torch.int64)
    lower = ((b + _BUCKET_LO) << _BUCKET_SHIFT).to(torch.int32).view(torch.float32).double()
    lower[0] = 0.0
    upper = ((b + _BUCKET_LO + 1) << _BUCKET_SHIFT).to(torch.int32).view(torch.float32).double()
    pos = torch.searchsorted(mids, lower, right=False)
    neg = torch.searchsorted(mids, -upper, right=False)
    # the kernel takes a fixed number of steps from the start: the most midpoints in one bucket
    steps = max(int((torch.searchsorted(mids, upper, right=False) - pos).max()),
                int((torch.searchsorted(mids, -lower, right=True) - neg).max()))
    if steps > _STEPS[code.numel()]:
        raise ValueError(f"bucket_table: a bucket holds {steps} midpoints; the kernels take {_STEPS[code.numel()]} steps")
    return torch.cat([pos, neg]).to(torch.uint8)


def quantize_blockwise(x: Tensor, code: Tensor, block: int, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Blockwise quantisation: ``absmax_b = max |x|`` over each block of `block` elements (of x
    flattened), ``codes = nearest(code, x · (1 / absmax_b))`` (ties to the lower code; the float32
    reciprocal as the kernels compute it; 0 for an all-zero block). Returns (uint8 codes: n of them for 8 bits, ceil(n / 2) for 4, the even element in the
    low nibble; float32 absmax, ceil(n / block)). `x` any floating dtype, computed in float32.

    See also: ``bitsandbytes.functional.quantize_blockwise``."""
    if bits not in (4, 8):
        raise ValueError(f"quantize_blockwise: bits must be 4 or 8; got {bits!r}")
    if code.numel() != 2**bits:
        raise ValueError(f"quantize_blockwise: code must have {2**bits} entries for {bits} bits; got {code.numel()}")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block, dtype=torch.float32, device=flat.device)
    pad[:n] = flat
    blocks = pad.view(nb, block)
    absmax = blocks.abs().amax(dim=1) if n else torch.zeros(0, device=flat.device)
    absmax = torch.where(blocks.isnan().any(dim=1), torch.nan, absmax) if n else absmax
    inv = torch.where(absmax > 0, 1.0 / torch.where(absmax > 0, absmax, 1.0), 0.0)  # as the kernels
    xn = (blocks * inv[:, None]).reshape(-1)[:n]
    mids = _midpoints(code.to(device=flat.device, dtype=torch.float32))
    idx = torch.searchsorted(mids, xn.contiguous(), right=False)
    idx = torch.where(xn.isnan(), 0, idx).to(torch.uint8)
    if bits == 4:
        if n % 2:
            idx = torch.cat([idx, idx.new_zeros(1)])
        idx = idx[0::2] | (idx[1::2] << 4)
    return idx, absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, code: Tensor, block: int, n: int, bits: int = 8) -> Tensor:
    """The inverse of :func:`quantize_blockwise`: float32 values (n,), ``code[c] * absmax_block``."""
    c = codes.reshape(-1).to(torch.long)
    if bits == 4:
        c = torch.stack([c & 0xF, c >> 4], dim=1).reshape(-1)
    c = c[:n]
    scale = absmax.float().repeat_interleave(block)[:n] if n else absmax.new_zeros(0)
    return code.to(device=codes.device, dtype=torch.float32)[c] * scale


def _bf16_ulp(p: Tensor) -> Tensor:
    """The spacing of bfloat16 values at `p` (bfloat16): 2**(e - 7) with e p's binary exponent, the
    subnormal spacing 2**-133 at zero and below (multi_tensor.cuh's bf16_ulp)."""
    bits = p.view(torch.int16).to(torch.int32) & 0x7FFF
    e = (bits >> 7).clamp(min=1)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 134)


def residual_weights(p: Tensor, r: Tensor) -> Tensor:
    """float32 weights from bfloat16 parameters and int8 residuals: ``p + r ulp(p) / 254``."""
    return p.float() + r.float() * (_bf16_ulp(p) * (1.0 / 254.0))


def split_residual(w: Tensor) -> tuple[Tensor, Tensor]:
    """float32 weights as (bfloat16 rounding, int8 residual ``round((w - p) / ulp(p) · 254)``)."""
    p = w.to(torch.bfloat16)
    e = (w - p.float()) / _bf16_ulp(p) * 254.0
    r = torch.where(e.isfinite(), e.round().clamp(-127, 127), 0.0).to(torch.int8)
    return p, r


# ---------------------------------------------------------------- the shared optimizer part
class _LowBit(MultiTensorOptimizer):
    """Quantised states for a float32-state twin (the next class in the MRO): the twin's arguments,
    hyperparameters, kernels' maths and reference; here the state layout, the launches with codes,
    and the state_dict mapping."""

    spec: ClassVar[Spec]  # a quantised spec (optim/_spec.py quantised): its bits, qstates, qkernel

    def _lowbit_setup(self, min_8bit_size: int, master_weights: bool | str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Checks and keeps the low-bit options; returns the twin's keyword arguments: `kwargs`
        plus the master-weight flag and float32 state (``state_dtype`` is refused)."""
        owner = type(self).__name__
        if "state_dtype" in kwargs:
            raise TypeError(f"{owner}: state_dtype does not apply (the states are quantised)")
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise TypeError(f"{owner}: min_8bit_size must be an int >= 0; got {chk.describe(min_8bit_size)}")
        if not (isinstance(master_weights, bool) or master_weights == "residual"):
            error = ValueError if isinstance(master_weights, str) else TypeError
            raise error(f"{owner}: master_weights must be False, True or 'residual'; got {chk.describe(master_weights)}")
        self._min_size = min_8bit_size
        self._residual = master_weights == "residual"
        if self._residual:
            self._master_key = "master_residual"
        self._block = 256 if self.spec.bits == 8 else 128
        self._qtables: dict[torch.device, Tensor] = {}
        return {**kwargs, "master_weights": bool(master_weights), "state_dtype": torch.float32}

    def _codes(self) -> list[Tensor]:
        """The code table of each state (built once per optimizer: the CPU reference reads them every step)."""
        codes = self.__dict__.get("_code_tables")
        if codes is None:
            if self.spec.bits == 8:
                codes = [dynamic_map(signed, 8) for _, signed in self.spec.qstates]
            else:
                codes = [dynamic_map(True, 4) if signed else linear_map(4) for _, signed in self.spec.qstates]
            self._code_tables = codes
        return codes

    def _qtable(self, device: torch.device) -> Tensor:
        t = self._qtables.get(device)
        if t is None:
            rows = []
            for code in self._codes():
                row = torch.zeros(_QTABLE, dtype=torch.float32)
                row[: code.numel()] = code
                row[256 : 256 + code.numel() - 1] = _midpoints(code)
                row[256 + code.numel() - 1] = math.inf  # the search's sentinel past the last midpoint
                buckets = bucket_table(code)
                row.view(torch.uint8)[512 * 4 : 512 * 4 + buckets.numel()] = buckets
                rows.append(row)
            t = self._qtables[device] = torch.stack(rows).to(device)
        return t

    def quantised(self, p: Tensor) -> bool:
        """Whether `p` keeps quantised states: its global element count reaches min_8bit_size."""
        return p.numel() >= max(self._min_size, 1)

    # -------------------------------------------------------------- hooks of MultiTensorOptimizer
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group.get("params") if isinstance(param_group, dict) else None
        ps = [params] if isinstance(params, Tensor) else list(params or [])
        for i, p in enumerate(ps):
            if isinstance(p, Tensor) and p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise TypeError(
                    f"{type(self).__name__}: parameters must be float16, bfloat16 or float32 (the quantised "
                    f"states are decoded to float32); got {p.dtype} (parameter {i} of param group "
                    f"{len(self.param_groups)})"
                )
            if getattr(self, "_residual", False) and isinstance(p, Tensor) and p.dtype != torch.bfloat16:
                raise TypeError(
                    f"{type(self).__name__}: master_weights='residual' needs bfloat16 parameters; got "
                    f"{p.dtype} (parameter {i} of param group {len(self.param_groups)})"
                )
        super().add_param_group(param_group)

    def _param_variant(self, p: Tensor) -> tuple[Any, ...]:
        return (self.quantised(p),)

    def _plan_state_keys(self, group: dict[str, Any], variant: tuple[Any, ...]) -> tuple[str, ...]:
        n = len(self.spec.qstates)
        if variant[-1]:
            return tuple(k for i in range(1, n + 1) for k in (f"state{i}", f"absmax{i}"))
        return tuple(f"state{i}" for i in range(1, n + 1))

    def _state_dtype_for(self, p: Tensor, key: str, sdt: torch.dtype) -> torch.dtype:
        return torch.uint8 if key.startswith("state") and self.quantised(p) else torch.float32

    def _rank_local_state(self, p: Tensor, key: str) -> bool:
        return self.quantised(p) and (key.startswith("absmax") or (key.startswith("state") and self.spec.bits == 4))

    def _state_numel(self, p: Tensor, key: str) -> int:
        """Elements of state `key` of `p` on this rank: the local shard's for float32 states and
        8-bit codes, half of them for 4-bit codes, one per block for the scales. Under sharding
        the last two are counted for the largest shard on every rank (rank-local states are
        padded to one size: _distributed.rank_local)."""
        if not self._rank_local_state(p, key):
            return _distributed.local(p).numel()
        n = _distributed.largest_shard_numel(p) if _distributed.is_dtensor(p) else p.numel()
        return -(-n // self._block) if key.startswith("absmax") else -(-n // 2)

    def _new_state(self, p: Tensor, key: str, group: dict[str, Any], dtype: torch.dtype) -> Tensor:
        if not self.quantised(p):
            return super()._new_state(p, key, group, dtype)
        if key.startswith("absmax"):
            i = key.removeprefix("absmax")
            self.state[p][f"qmap{i}"] = self._codes()[int(i) - 1].to(p.device)
            return torch.zeros(self._state_numel(p, key), dtype=torch.float32, device=p.device)
        if self.spec.bits == 8:  # laid out like the parameter (a DTensor parameter's codes are sharded like it)
            return torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
        return torch.zeros(self._state_numel(p, key), dtype=torch.uint8, device=p.device)

    def _check_state(self, p: Tensor, key: str, v: Tensor) -> None:
        """A loaded state's size must be this layout's (bitsandbytes' min_8bit_size may differ)."""
        q = self.quantised(p)
        want = self._state_numel(p, key)
        got = _distributed.local(v).numel()
        if got != want or (key.startswith("state") and (v.dtype == torch.uint8) != q):
            raise ValueError(
                f"{type(self).__name__}: state {key!r} of a parameter of shape {tuple(p.shape)} has {got} "
                f"{v.dtype} elements; this optimizer keeps {want} {'uint8 codes' if q and key.startswith('state') else 'float32'} "
                f"(min_8bit_size={self._min_size}, {self.spec.bits}-bit)"
            )

    def _make_masters(self, params: list[Tensor]) -> list[Tensor]:
        if not self._residual:
            return super()._make_masters(params)
        out = []
        for p in params:
            r = self.state[p].get("master_residual")
            if r is None or r.dtype != torch.int8 or r.shape != p.shape:
                r = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
                self.state[p]["master_residual"] = r
            out.append(r)
        return out

    def _divisors(self, plan: _Plan) -> list[int] | None:
        if not plan.variant[-1]:
            return None
        per = [1 if self.spec.bits == 8 else 2, self._block]
        return [1, 1, *(per * len(self.spec.qstates)), *([1] if plan.masters is not None else [])]

    def _launch(self, plan: _Plan, common: dict[str, Any]) -> None:
        if plan.variant[-1] and "kernel" not in plan.scratch:
            mode = 0 if plan.masters is None else (2 if self._residual else 1)
            if mode not in lowbit_masters(plan.pname):
                raise TypeError(f"{type(self).__name__}: no quantised kernel for {plan.pname} with master mode {mode}")
            kernel_name(self.spec, plan, mode)
            plan.extra = (self._qtable(plan.params[0].device),)
            # two resident blocks per SM walk every chunk: each block stages the code tables once
            plan.table.grid = min(plan.table.grid, 2 * sm_count(plan.table.device))  # type: ignore[union-attr]
        super()._launch(plan, common)

    def _reference(self, group: dict[str, Any], plan: _Plan, steps: list[float], gmul: Tensor | None) -> None:
        """The twin's reference on the states under its names: decoded first and re-encoded after
        for a quantised plan, as they are for a float32 one."""
        quant = plan.variant[-1]
        codes = self._codes()
        states: dict[str, list[Tensor]] = {}
        for i, (name, _) in enumerate(self.spec.qstates):
            st = plan.states[f"state{i + 1}"]
            if quant:
                scales = plan.states[f"absmax{i + 1}"]
                st = [dequantize_blockwise(c, a, codes[i], self._block, p.numel(), self.spec.bits).view(p.shape)
                      for p, c, a in zip(plan.params, st, scales, strict=True)]
            states[name] = st
        twin = _Plan(plan.gids, plan.params, plan.grads, states, None if self._residual else plan.masters,
                     plan.pname, plan.sname, plan.variant[:-1])
        twin.scratch = plan.scratch
        if self._residual and plan.masters is not None:
            self._reference_residual(group, plan, twin, steps, gmul)
        else:
            super()._reference(group, twin, steps, gmul)
        if quant:
            for i, (name, _) in enumerate(self.spec.qstates):
                for x, c, a in zip(states[name], plan.states[f"state{i + 1}"], plan.states[f"absmax{i + 1}"],
                                   strict=True):
                    nc, na = quantize_blockwise(x, codes[i], self._block, self.spec.bits)
                    # under sharding the rank-local states are padded past the shard's own part
                    c.view(-1)[: nc.numel()].copy_(nc)
                    a[: na.numel()].copy_(na)

    def _reference_residual(
        self, group: dict[str, Any], plan: _Plan, twin: _Plan, steps: list[float], gmul: Tensor | None
    ) -> None:
        """The twin's reference on float32 weights rebuilt from bfloat16 + residual, split back."""
        masters = [residual_weights(p, r) for p, r in zip(plan.params, plan.masters, strict=True)]  # type: ignore[arg-type]
        twin.masters = masters
        super()._reference(group, twin, steps, gmul)
        for p, r, w in zip(plan.params, plan.masters, masters, strict=True):  # type: ignore[arg-type]
            hi, lo = split_residual(w)
            p.copy_(hi)
            r.copy_(lo)

    # -------------------------------------------------------------- state_dicts
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this class's state_dicts and bitsandbytes' (its nested quantisation state and
        integer steps); ValueError if a state's size does not match this optimizer's layout."""
        sd = dict(state_dict)
        sd["state"] = {}
        for k, st in state_dict["state"].items():
            st = dict(st)
            st.update(st.pop(_BNB_WRAPPED, {}))
            if "step" in st and not isinstance(st["step"], Tensor):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
            sd["state"][k] = st
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=False):
            for key, v in sd["state"].get(i, {}).items():
                if isinstance(v, Tensor) and (key.startswith("state") or key.startswith("absmax")):
                    self._check_state(p, key, v)
        super().load_state_dict(sd)


def to_bitsandbytes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A cukit 8-bit optimizer's state_dict in bitsandbytes' form: integer steps and the
    quantisation tensors nested under its FSDP key, so ``bitsandbytes.optim.AdamW8bit`` (same
    min_8bit_size) loads it. The tensors are shared, not copied."""
    out = {"param_groups": state_dict["param_groups"], "state": {}}
    keys = {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}
    for k, st in state_dict["state"].items():
        st = dict(st)
        if isinstance(st.get("step"), Tensor):
            st["step"] = int(st["step"].item())
        wrapped = {key: st.pop(key) for key in list(st) if key in keys}
        if wrapped:
            st[_BNB_WRAPPED] = wrapped
        out["state"][k] = st
    return out


# ---------------------------------------------------------------- the optimizers
_LOWBIT_DOC = """
    Keyword-only: ``min_8bit_size`` (default 4096: smaller parameters keep float32 states),
    ``master_weights`` (False, True: a float32 copy of 16-bit parameters, or "residual": bfloat16
    parameters plus an int8 residual), ``flat_grads`` and ``max_grad_norm`` as
    :class:`cukit.optim.MultiTensorOptimizer`. Parameters: float16, bfloat16, float32."""


class Adam8bit(_LowBit, Adam):
    """Adam (L2 weight decay, as ``torch.optim.Adam``) with 8-bit blockwise states: ``state1`` the
    first moment (signed dynamic map), ``state2`` the second (unsigned), blocks of 256. Maths and
    arguments as :class:`cukit.optim.Adam` (amsgrad not supported).

    See also: ``bitsandbytes.optim.Adam8bit`` (which decays the weights decoupled, as AdamW)."""

    __doc__ = (__doc__ or "") + _LOWBIT_DOC
    spec = quantised(ADAM_SPEC, 8, "Adam8bit")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        min_8bit_size: int = 4096,
        master_weights: bool | str = False,
        **kwargs: Any,
    ) -> None:
        if amsgrad is True:
            raise ValueError(f"{type(self).__name__}: amsgrad=True is not supported with quantised states")
        kw = self._lowbit_setup(min_8bit_size, master_weights, kwargs)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kw)


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay, default 0.01) with 8-bit blockwise states; everything else as
    :class:`Adam8bit`.

    See also: ``bitsandbytes.optim.AdamW8bit``, ``torchao.optim.AdamW8bit``."""

    __doc__ = (__doc__ or "") + _LOWBIT_DOC
    spec = quantised(ADAMW_SPEC, 8, "AdamW8bit")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class AdamW4bit(AdamW8bit):
    """AdamW with 4-bit blockwise states (blocks of 128): the first moment on the signed 4-bit
    dynamic map, the second on the linear map k/16 (no zero), two codes per byte.

    See also: ``torchao.optim.AdamW4bit``."""

    __doc__ = (__doc__ or "") + _LOWBIT_DOC
    spec = quantised(ADAMW_SPEC, 4, "AdamW4bit")


class Lion8bit(_LowBit, Lion):
    """Lion with an 8-bit blockwise ``state1`` (the momentum, signed dynamic map, blocks of 256);
    maths and arguments as :class:`cukit.optim.Lion`.

    See also: ``bitsandbytes.optim.Lion8bit``."""

    __doc__ = (__doc__ or "") + _LOWBIT_DOC
    spec = quantised(LION_SPEC, 8, "Lion8bit")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        min_8bit_size: int = 4096,
        master_weights: bool | str = False,
        **kwargs: Any,
    ) -> None:
        kw = self._lowbit_setup(min_8bit_size, master_weights, kwargs)
        super().__init__(params, lr, betas, weight_decay, **kw)


def _sgd8bit_check(group: Mapping[str, Any], owner: str) -> None:
    momentum = group.get("momentum", 0)
    if isinstance(momentum, (int, float)) and not momentum > 0:
        raise ValueError(f"{owner}: momentum must be > 0 (the 8-bit state is the momentum buffer); got {momentum!r}")
    assert SGD_SPEC.check is not None
    SGD_SPEC.check(group, owner)


class SGD8bit(_LowBit, SGD):
    """SGD with momentum (required, > 0) and an 8-bit blockwise ``state1`` (the momentum buffer,
    signed dynamic map, blocks of 256); maths and arguments as :class:`cukit.optim.SGD`.

    See also: ``bitsandbytes.optim.SGD8bit``."""

    __doc__ = (__doc__ or "") + _LOWBIT_DOC
    spec = quantised(SGD_SPEC, 8, "SGD8bit").replace(check=_sgd8bit_check)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        min_8bit_size: int = 4096,
        master_weights: bool | str = False,
        **kwargs: Any,
    ) -> None:
        kw = self._lowbit_setup(min_8bit_size, master_weights, kwargs)
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, **kw)

