"""The host side of the multi-tensor engine (raw_kernels/include/cukit/multi_tensor.cuh).

A :class:`TensorTable` is the device table of one launch: the addresses of T tensors in L lists
(param, grad, states...), their sizes, per-tensor info (param group, alignment) and the work list
of (tensor, chunk) pairs. It is built once, from host-side NumPy arrays copied to the device with
a synchronous (pageable) copy, so nothing races with a kernel still reading an older table: a new
table is a new allocation, and torch's caching allocator reuses the old one only after the work
queued on the stream before it was freed. Every kernel launch then covers every chunk of every
tensor, whatever T is.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cukit._device import sm_count
from cukit._runtime import KernelModule, Launch, PlanCache
from cukit.interop import current_stream

__all__ = ["K_HP", "K_VEC", "MAX_GROUPS", "TensorTable", "launch_count", "launch_update", "no_lr"]

K_VEC = 4  # kVec in multi_tensor.cuh
MAX_GROUPS = 8  # kMaxGroups
K_HP = 8  # kHP
ALIGNED_BIT = 1 << 8
DEFAULT_CHUNK = 1 << 14  # elements per (tensor, chunk) work item: ~7.6K chunks for GPT-2 small
# C-level getters mapped over a list: the per-step checks of set_list touch every gradient
_NUMEL, _IS_CONTIGUOUS = torch.Tensor.numel, torch.Tensor.is_contiguous
_GET_DEVICE, _DATA_PTR, _DTYPE = torch.Tensor.get_device, torch.Tensor.data_ptr, operator.attrgetter("dtype")

_MAX_BLOCK = 512
_MIN_BLOCK = 64
_THREADS_PER_SM = 2048


class TensorTable:
    """The device table of one launch over T tensors in L lists.

    Args:
        lists: L sequences of T contiguous tensors on one CUDA device; tensor t of every list has
            the same number of elements (a param, its grad, its states), or ceil(n / divisors[l])
            for a list with a divisor (quantised states: 4-bit codes 2, block scales the block).
        groups: the launch-local group index (0 ... 7) of each tensor: which hyperparameters it uses.
        chunk: elements per work item (a multiple of K_VEC and of every divisor).
        divisors: each list's element ratio (default all 1).

    Attributes: ``table`` (the int64 device tensor), ``T``, ``C`` (chunks), ``chunk``, ``numel``,
    ``block`` and ``grid`` (the launch shape), ``device`` (index), ``nbytes_per_elem`` (bytes the
    lists occupy per element; benchmarks count traffic with it).
    """

    def __init__(
        self,
        lists: Sequence[Sequence[torch.Tensor]],
        groups: Sequence[int],
        *,
        chunk: int = DEFAULT_CHUNK,
        divisors: Sequence[int] | None = None,
    ) -> None:
        if not lists or not lists[0]:
            raise ValueError("a tensor table needs at least one list of at least one tensor")
        if chunk <= 0 or chunk % K_VEC:
            raise ValueError(f"chunk must be a positive multiple of {K_VEC}; got {chunk}")
        L, T = len(lists), len(lists[0])
        div = [1] * L if divisors is None else [int(d) for d in divisors]
        if len(div) != L or min(div) < 1 or div[0] != 1:
            raise ValueError(f"divisors needs {L} entries >= 1, the first 1; got {divisors}")
        if any(chunk % d for d in div):
            raise ValueError(f"chunk ({chunk}) must be a multiple of every divisor ({div})")
        first = lists[0][0]
        device = first.device
        if device.type != "cuda":
            raise ValueError(f"tensor tables live on a CUDA device; got tensors on {device}")
        sizes = np.fromiter((t.numel() for t in lists[0]), dtype=np.int64, count=T)
        addr = np.empty((L, T), dtype=np.int64)
        itemsizes, dtypes = [], []
        for li, lst in enumerate(lists):
            if len(lst) != T:
                raise ValueError(f"list {li} has {len(lst)} tensors; list 0 has {T}")
            for ti, t in enumerate(lst):
                if t.device != device:
                    raise ValueError(
                        f"list {li}, tensor {ti} is on {t.device}; the table's device is {device}"
                    )
                want = -(-int(sizes[ti]) // div[li])
                # a list with a divisor may be longer (rank-local states padded to the largest
                # shard's size): the kernels read its first `want` elements
                if t.numel() != want and not (div[li] > 1 and t.numel() > want):
                    raise ValueError(
                        f"list {li}, tensor {ti} has {t.numel()} elements; list 0's has {sizes[ti]}"
                        + (f", so list {li} (one element per {div[li]}) needs at least {want}" if div[li] > 1 else "")
                    )
                if not t.is_contiguous():
                    raise ValueError(
                        f"list {li}, tensor {ti} is not contiguous (the kernels see raw pointers)"
                    )
            addr[li] = np.fromiter((t.data_ptr() for t in lst), dtype=np.int64, count=T)
            itemsizes.append(lst[0].element_size())
            dtypes.append(lst[0].dtype)
        host, C, aligned = host_layout(addr, sizes, itemsizes, groups, chunk, div)
        self.host = host  # kept for inspection and the tests; the device copy is what kernels read
        self.table = torch.from_numpy(host).to(device)
        self.L, self.T, self.C, self.chunk = L, T, C, chunk
        self.itemsizes, self.dtypes = itemsizes, dtypes
        self.divisors = div
        self.numel = int(sizes.sum())
        self.sizes = sizes
        self.aligned = aligned
        self.device = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes_per_elem = sum(lst[0].element_size() / d for lst, d in zip(lists, div, strict=True))
        self.launches: dict[str, Launch] = {}  # kernel name -> its prepared launch over this table
        vectors_per_chunk = self.numel / max(C, 1) / K_VEC
        self.block = int(
            min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << max(0, math.ceil(math.log2(max(vectors_per_chunk, 1))))))
        )
        per_sm = _THREADS_PER_SM // self.block
        self.grid = max(1, min(C, sm_count(self.device) * per_sm * 4))

    def fits(self, li: int, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` can take list `li`'s place: as many, each with the element count, dtype
        and device of the tensor it replaces, contiguous (checked in a few C-level passes: this
        runs on every step whose backward allocated its gradients anew)."""
        T = self.T
        if len(tensors) != T:
            return False
        want = -(-self.sizes // self.divisors[li])
        return (
            np.array_equal(np.fromiter(map(_NUMEL, tensors), dtype=np.int64, count=T), want)
            and all(map(_IS_CONTIGUOUS, tensors))
            and set(map(_DTYPE, tensors)) == {self.dtypes[li]}
            and set(map(_GET_DEVICE, tensors)) == {self.device}
        )

    def set_list(self, li: int, tensors: Sequence[torch.Tensor], *, checked: bool = False) -> None:
        """Point list `li` at `tensors` (new gradients of the same parameters: see :meth:`fits`;
        `checked`: the caller has just asked it), rewriting its addresses and the alignment flags in
        place in the device table (one host-to-device copy on the current stream, after the launches
        that read the old one, from pinned memory: no host sync). The work items and launch shape
        stay; ValueError if the tensors do not fit."""
        if not checked and not self.fits(li, tensors):
            raise ValueError(
                f"list {li}: the tensors do not fit the table ({self.T} contiguous tensors of dtype "
                f"{self.dtypes[li]} on cuda:{self.device} with the element counts of the tensors they replace)"
            )
        T = self.T
        L, host = self.L, self.host
        addr = host[: L * T].reshape(L, T)
        addr[li] = np.fromiter(map(_DATA_PTR, tensors), dtype=np.int64, count=T)
        aligned = _aligned(addr, self.itemsizes, self.divisors)
        info = host[(L + 1) * T : (L + 2) * T]
        info[:] = (info & ~np.int64(ALIGNED_BIT)) | np.where(aligned, ALIGNED_BIT, 0)
        self.aligned = aligned
        # A copy from pageable memory would wait for the stream to drain (a host sync on every step
        # whose backward allocated its gradients anew). torch's pinned allocator keeps the staging
        # block until the copy has run, so the next call never overwrites it early. Only the span
        # from this list's addresses to the info row changes: the work list stays.
        lo, hi = li * T, (L + 2) * T
        staging = torch.empty(hi - lo, dtype=torch.int64, pin_memory=True)
        staging.numpy()[...] = host[lo:hi]
        self.table[lo:hi].copy_(staging, non_blocking=True)

    def tensor_of_chunk(self, c: int) -> tuple[int, int]:
        """(tensor, first element) of work item `c` (host-side decoding, for tests)."""
        w = int(self.host[(self.L + 3) * self.T + 1 + c])
        return w >> 32, (w & 0xFFFFFFFF) * self.chunk


def _aligned(addr: np.ndarray, itemsizes: Sequence[int], divisors: Sequence[int]) -> np.ndarray:
    """Per tensor: every list holds kVec of the tensor's elements at aligned addresses (K_VEC
    elements' worth of each list's storage: K_VEC * itemsize / divisor bytes, at least one item)."""
    aligned = np.ones(addr.shape[1], dtype=bool)
    for li in range(addr.shape[0]):
        aligned &= addr[li] % max(itemsizes[li], K_VEC * itemsizes[li] // divisors[li]) == 0
    return aligned


def host_layout(
    addr: np.ndarray,
    sizes: np.ndarray,
    itemsizes: Sequence[int],
    groups: Sequence[int],
    chunk: int,
    divisors: Sequence[int] | None = None,
) -> tuple[np.ndarray, int, np.ndarray]:
    """The int64 table of multi_tensor.cuh from addresses (L, T), sizes (T,), each list's itemsize
    (and element divisor: list l holds ceil(size / divisors[l]) items) and each tensor's
    launch-local group. Returns (table, number of chunks, aligned flags)."""
    L, T = addr.shape
    aligned = _aligned(addr, itemsizes, divisors or [1] * L)
    g = np.asarray(groups, dtype=np.int64)
    if len(g) != T:
        raise ValueError(f"groups has {len(g)} entries for {T} tensors")
    if T and (g.min() < 0 or g.max() >= MAX_GROUPS):
        raise ValueError(f"group indices must be in [0, {MAX_GROUPS})")
    nchunks = -(-sizes // chunk)
    if T and nchunks.max() >= 2**32:
        raise ValueError("a tensor has more than 2**32 chunks")
    chunk_begin = np.zeros(T + 1, dtype=np.int64)
    np.cumsum(nchunks, out=chunk_begin[1:])
    C = int(chunk_begin[-1])
    tensor_of = np.repeat(np.arange(T, dtype=np.int64), nchunks)
    within = np.arange(C, dtype=np.int64) - np.repeat(chunk_begin[:-1], nchunks)
    work = (tensor_of << 32) | within
    info = g | np.where(aligned, ALIGNED_BIT, 0)
    return np.concatenate([addr.ravel(), sizes, info, chunk_begin, work]), C, aligned


def no_lr() -> list[float]:
    return [0.0] * MAX_GROUPS


def launch_update(
    module: KernelModule,
    name: str,
    table: TensorTable,
    *,
    hp: torch.Tensor,
    groups: int,
    lrs: Sequence[float],
    lr_dev: torch.Tensor | None,
    grad_div: torch.Tensor | None,
    grad_mul: torch.Tensor | None,
    skip: torch.Tensor | None,
    extra: Sequence[Any] = (),
) -> None:
    """Launch one update kernel (CUKIT_MT_PARAMS + `extra`) on torch's current stream. `hp` and
    `lr_dev` are float64 device arrays (:func:`hp_tensor`), `lrs` Python floats (sent as double);
    the kernel rounds all of them to its accumulation type."""
    if table.C == 0:
        return
    # Prepared on the table's first step with every argument given per call (they change from
    # step to step): a struct pack and the driver call instead of a generic launch's conversions.
    run = table.launches.get(name)
    if run is None:
        run = table.launches[name] = module.prepare(name, (table.grid,), (table.block,), (), device=table.device)
    run(_head((table.table, table.T, table.C, table.chunk, hp, groups, *lrs, lr_dev, grad_div, grad_mul, skip,
               *extra)), current_stream(table.device, True))


# (module file, device, grid) -> the step counter's prepared launch
_COUNT_LAUNCHES = PlanCache("mt_count_step", maxsize=64)


def _head(args: Sequence[Any]) -> tuple[Any, ...]:
    """Launch arguments as a prepared launch takes them: tensors as their addresses, None as 0."""
    return tuple(0 if a is None else a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def launch_count(module: KernelModule, steps: torch.Tensor, skip: torch.Tensor | None) -> None:
    """steps += 1 (a float32 vector on the device), unless *skip != 0."""
    n = steps.numel()
    if n == 0:
        return
    device = steps.get_device()
    grid = max(1, min(-(-n // 256), 1024))
    key = (module.key, device, grid)
    run = _COUNT_LAUNCHES.get(key)
    if run is None:
        run = _COUNT_LAUNCHES.put(key, module.prepare("cukit::mt::mt_count_step<0>", (grid,), (256,), (), device=device))
    run(_head((steps, n, skip)), current_stream(device, True))


def hp_tensor(values: Sequence[float], device: torch.device | int) -> torch.Tensor:
    """The hyperparameter array of a launch (float64, the values as given: the kernels round them to
    their accumulation type): a new device allocation each time it changes (a synchronous copy from
    pageable memory; the previous array stays valid for kernels in flight)."""
    return torch.tensor(list(values), dtype=torch.float64, device=device)


def pack_hp(per_group: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """The hyperparameters of a launch's groups, K_HP floats per group (zero-padded) in group order."""
    out: list[float] = []
    for h in per_group:
        if len(h) > K_HP:
            raise ValueError(f"cukit.optim: a launch takes at most {K_HP} hyperparameters per group; got {len(h)}")
        out.extend(h)
        out.extend([0.0] * (K_HP - len(h)))
    return tuple(out)


def lr_args(lrs: Sequence[Any], device: torch.device) -> tuple[list[float], torch.Tensor | None]:
    """The learning rates of a launch's groups as the kernels take them: MAX_GROUPS Python floats,
    or (when any is a tensor) a float64 device vector, read in place for a single float64 lr tensor
    on the device (a scheduler's update reaches the kernel with no copy and no host sync)."""
    if any(isinstance(v, torch.Tensor) for v in lrs):
        if len(lrs) == 1:
            return no_lr(), torch.as_tensor(lrs[0], dtype=torch.float64, device=device).reshape(1)
        return no_lr(), torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in lrs]
        )
    return [float(v) for v in lrs] + [0.0] * (MAX_GROUPS - len(lrs)), None
