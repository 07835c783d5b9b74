"""cukit.optim under torch.distributed, two processes on one machine: DDP, FSDP2 (``fully_shard``,
DTensor parameters with a zero-size shard), ZeroRedundancyOptimizer(optimizer_class=AdamW),
clip_grad_norm_ / nonfinite_flag over DTensor gradients, and a torch.distributed.checkpoint
save / load round trip. Each case is compared with a single-process run of the same model on the
whole batch, to fp32 rounding.

"cpu": two gloo processes (CI; the reference path of the optimizers, the distributed code paths
all run); "cuda": two NCCL processes on two GPUs (the kernels; marked gpu, skipped with fewer than
two GPUs). The processes start once per backend (a module fixture runs every case and records
"ok" or the traceback of each), because starting them costs more than the cases themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cukit.optim as co
import pytest

import cukit

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

WORLD = 2
STEPS = 4
LR = 0.05
MAX_NORM = 0.05  # below the gradients' norm: clipping is active in every step
RTOL, ATOL = 1e-5, 1e-6  # fp32 rounding (reduction order differs from the single-process run)
TWO_GPUS = cukit.is_available() and torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
CASES = ("ddp", "fsdp2", "fsdp2_torch_layout", "clip_and_flag", "zero", "dcp", "fsdp2_lowbit", "dcp_lowbit")


# ---------------------------------------------------------------------------------------------
# the cases (run in each of the two processes)
# ---------------------------------------------------------------------------------------------


def _model(device: str, seed: int = 0) -> torch.nn.Module:
    """Linear(7, 1): its weight (1, 7) and bias (1,) give rank 1 zero-size shards under FSDP2."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).to(device)


def _batches(device: str, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 5, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)) for _ in range(steps)]


def _part(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[0] // WORLD
    return t[rank * n : (rank + 1) * n]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


def _train(model: torch.nn.Module, opt: Any, batches: list[Any], rank: int | None) -> list[float]:
    """`rank` None: the whole batch (the single-process reference); else this rank's half."""
    losses = []
    for x, y in batches:
        if rank is not None:
            x, y = _part(x, rank), _part(y, rank)
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _reference(device: str, steps: int = STEPS, **kw: Any) -> tuple[torch.nn.Module, Any, list[float]]:
    """The single-process run on the whole batches: model, optimizer, losses."""
    model = _model(device)
    opt = co.AdamW(model.parameters(), lr=LR, **kw)
    losses = _train(model, opt, _batches(device, steps), None)
    return model, opt, losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close_params(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _mesh(device: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (WORLD,))


def _fsdp(device: str, seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(device, seed)
    mesh = _mesh(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def case_ddp(rank: int, device: str, tmp: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(device)
    ddp = DDP(model, device_ids=[rank] if device == "cuda" else None)
    opt = co.AdamW(ddp.parameters(), lr=LR, max_grad_norm=MAX_NORM)
    _train(ddp, opt, _batches(device), rank)
    ref, _, _ = _reference(device, max_grad_norm=MAX_NORM)
    _close_params(model, ref)


def case_fsdp2(rank: int, device: str, tmp: str) -> None:
    """The step on local shards (rank 1 holds zero-size ones), clipping over both ranks, the
    state laid out as torch's optimizers lay it out under FSDP2."""
    from torch.distributed.tensor import DTensor

    model = _fsdp(device)
    opt = co.AdamW(model.parameters(), lr=LR, max_grad_norm=MAX_NORM)
    losses = _train(model, opt, _batches(device), rank)
    ref, ref_opt, ref_losses = _reference(device, max_grad_norm=MAX_NORM)
    _close_params(model, ref)
    shard_sizes = []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert isinstance(p, DTensor)
        st, rst = opt.state[p], ref_opt.state[q]
        assert not isinstance(st["step"], DTensor) and float(st["step"]) == STEPS
        for k in ("exp_avg", "exp_avg_sq"):
            v = st[k]
            assert isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape
            assert v.to_local().shape == p.to_local().shape
            torch.testing.assert_close(v.full_tensor(), rst[k], rtol=RTOL, atol=ATOL)
        shard_sizes.append(p.to_local().numel())
    if rank == 1:
        assert 0 in shard_sizes  # the zero-size shard took part
    # the loss curve: the mean over ranks of the half-batch losses is the whole batch's
    mean = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    torch.testing.assert_close((mean / WORLD).tolist(), ref_losses, rtol=RTOL, atol=ATOL)


def case_fsdp2_torch_layout(rank: int, device: str, tmp: str) -> None:
    """cukit's AdamW and torch's under the same FSDP2 sharding: same parameters, and the same
    state types and shapes (so tools written for torch's state work)."""
    from torch.distributed.tensor import DTensor

    models = [_fsdp(device), _fsdp(device)]
    opts = [co.AdamW(models[0].parameters(), lr=LR), torch.optim.AdamW(models[1].parameters(), lr=LR, foreach=False)]
    for m, o in zip(models, opts, strict=True):
        _train(m, o, _batches(device), rank)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=RTOL, atol=ATOL)
        a, b = opts[0].state[p], opts[1].state[q]
        assert a.keys() == b.keys()
        for k in a:
            assert isinstance(a[k], DTensor) == isinstance(b[k], DTensor), k
            assert a[k].shape == b[k].shape, k


def case_clip_and_flag(rank: int, device: str, tmp: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    model = _fsdp(device)
    x, y = _batches(device, 1)[0]
    _loss(model, _part(x, rank), _part(y, rank)).backward()
    params = list(model.parameters())
    full = [p.grad.full_tensor().double() for p in params]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
    assert float(co.nonfinite_flag([p.grad for p in params])) == 0.0
    norm = co.clip_grad_norm_(params, 0.1)
    assert isinstance(norm, DTensor) and norm.placements == (Replicate(),)  # as torch returns it
    torch.testing.assert_close(norm.to_local().double(), expected, rtol=RTOL, atol=0.0)
    coef = min(1.0, 0.1 / (float(expected) + 1e-6))
    for p, g in zip(params, full, strict=True):
        torch.testing.assert_close(p.grad.full_tensor().double(), g * coef, rtol=RTOL, atol=ATOL)
    # an inf in rank 1's shard only: every rank sees the flag
    if rank == 1:
        params[0].grad.to_local()[0, 0] = float("inf")
    flag = co.nonfinite_flag([p.grad for p in params])
    assert float(flag) == 1.0


def case_zero(rank: int, device: str, tmp: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(device)
    ddp = DDP(model, device_ids=[rank] if device == "cuda" else None)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=co.AdamW, lr=LR)
    assert isinstance(opt.optim, co.AdamW)
    _train(ddp, opt, _batches(device), rank)
    ref, ref_opt, _ = _reference(device)
    _close_params(model, ref)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        assert len(sd["state"]) == len(list(model.parameters()))
        loaded = co.AdamW(_model(device).parameters(), lr=LR)
        loaded.load_state_dict(sd)
        for q, p in zip(ref.parameters(), loaded.param_groups[0]["params"], strict=True):
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(loaded.state[p][k], ref_opt.state[q][k], rtol=RTOL, atol=ATOL)
            assert float(loaded.state[p]["step"]) == STEPS


def _dcp_round_trip(model: torch.nn.Module, opt: Any, other: torch.nn.Module, other_opt: Any, path: str) -> None:
    """Save `model` and `opt` with torch.distributed.checkpoint and load them into `other`, `other_opt`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    sd = {"model": get_model_state_dict(other), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(other, sd["model"])
    set_optimizer_state_dict(other, other_opt, sd["optim"])


def _same_after_one_step(model: torch.nn.Module, opt: Any, other: torch.nn.Module, other_opt: Any,
                         batches: list[Any], rank: int) -> None:
    _train(model, opt, batches, rank)
    _train(other, other_opt, batches, rank)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q.to_local(), p.to_local(), rtol=0.0, atol=0.0)


def case_dcp(rank: int, device: str, tmp: str) -> None:
    """Save model + optimizer with torch.distributed.checkpoint, load them into a fresh model and
    optimizer, take one more step on both: same parameters."""
    batches = _batches(device, STEPS + 1)
    model = _fsdp(device)
    opt = co.AdamW(model.parameters(), lr=LR, max_grad_norm=MAX_NORM)
    _train(model, opt, batches[:STEPS], rank)
    other = _fsdp(device, seed=5)
    other_opt = co.AdamW(other.parameters(), lr=LR, max_grad_norm=MAX_NORM)
    _dcp_round_trip(model, opt, other, other_opt, os.path.join(tmp, "dcp"))
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert float(other_opt.state[q]["step"]) == STEPS
        torch.testing.assert_close(other_opt.state[q]["exp_avg"].to_local(), opt.state[p]["exp_avg"].to_local())
    _same_after_one_step(model, opt, other, other_opt, batches[STEPS:], rank)


def case_fsdp2_lowbit(rank: int, device: str, tmp: str) -> None:
    """AdamW8bit under FSDP2: which tensors get 8-bit state follows the parameter's global size
    (the first weight has 35 elements, min_8bit_size 30; its shards hold 20 and 15), the step runs
    on the local shards with rank-local block scales, and the parameters stay close to a
    single-process AdamW8bit run (blocks of a shard, not of the whole tensor: not bitwise)."""
    from torch.distributed.tensor import DTensor

    model = _fsdp(device)
    opt = co.AdamW8bit(model.parameters(), lr=LR, min_8bit_size=30)
    losses = _train(model, opt, _batches(device), rank)
    ref = _model(device)
    ref_opt = co.AdamW8bit(ref.parameters(), lr=LR, min_8bit_size=30)
    ref_losses = _train(ref, ref_opt, _batches(device), None)
    w = next(iter(model.parameters()))
    assert isinstance(w, DTensor) and w.numel() == 35 and w.to_local().numel() == (20 if rank == 0 else 15)
    st = opt.state[w]
    assert st["state1"].dtype == torch.uint8 and st["absmax1"].to_local().numel() == 1  # the shard's one block
    for p in list(model.parameters())[1:]:
        assert opt.state[p]["state1"].dtype == torch.float32  # 7, 7 and 1 elements
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=0.0, atol=0.03)
    mean = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    torch.testing.assert_close((mean / WORLD).tolist(), ref_losses, rtol=0.05, atol=0.0)


def case_dcp_lowbit(rank: int, device: str, tmp: str) -> None:
    """AdamW8bit and AdamW4bit under FSDP2 through torch.distributed.checkpoint: every rank gets
    back its own block scales and packed codes (they describe its shard, and differ between the
    ranks), and one more step on the saved and the loaded optimizer gives the same parameters."""
    from torch.distributed.tensor import DTensor, Shard

    batches = _batches(device, STEPS + 1)
    for cls in (co.AdamW8bit, co.AdamW4bit):
        model = _fsdp(device)
        opt = cls(model.parameters(), lr=LR, min_8bit_size=30)
        _train(model, opt, batches[:STEPS], rank)
        w = next(iter(model.parameters()))
        scales = opt.state[w]["absmax1"]
        assert isinstance(scales, DTensor) and tuple(scales.placements) == (Shard(0),) and scales.shape == (2,)
        parts = [torch.zeros(1, device=device) for _ in range(WORLD)]
        dist.all_gather(parts, scales.to_local()[:1].contiguous())
        assert float(parts[0]) != float(parts[1])  # rank-local values: a replicated save would lose one
        other = _fsdp(device, seed=5)
        other_opt = cls(other.parameters(), lr=LR, min_8bit_size=30)
        _dcp_round_trip(model, opt, other, other_opt, os.path.join(tmp, f"dcp_{cls.__name__}"))
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert float(other_opt.state[q]["step"]) == STEPS
            for key in ("state1", "absmax1", "state2", "absmax2"):
                if key in opt.state[p]:
                    a, b = opt.state[p][key], other_opt.state[q][key]
                    torch.testing.assert_close(_distributed_local(b), _distributed_local(a), rtol=0, atol=0,
                                               msg=lambda m, k=key, c=cls.__name__: f"{c} {k}: {m}")
        _same_after_one_step(model, opt, other, other_opt, batches[STEPS:], rank)


def _distributed_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


CASE_FNS: dict[str, Callable[[int, str, str], None]] = {name: globals()[f"case_{name}"] for name in CASES}


# ---------------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------------


def _worker(rank: int, port: int, device: str, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    # a failed collective in one process must not hang the other for the default 10 minutes
    dist.init_process_group(backend, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results: dict[str, str] = {}
    try:
        for name, fn in CASE_FNS.items():
            try:
                fn(rank, device, tmp)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_processes(device: str, timeout_s: float = 240.0) -> dict[int, dict[str, str]]:
    """Every case in two processes; each rank's {case: "ok" or traceback}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(_free_port(), device, tmp), nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {WORLD} processes did not finish in {timeout_s} s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return {r: json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)}


@pytest.fixture(scope="module")
def gloo_results() -> dict[int, dict[str, str]]:
    return run_two_processes("cpu")


@pytest.fixture(scope="module")
def nccl_results() -> dict[int, dict[str, str]]:
    return run_two_processes("cuda")


def _check(results: dict[int, dict[str, str]], case: str) -> None:
    failed = {r: res.get(case, "not run") for r, res in results.items() if res.get(case) != "ok"}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


@pytest.mark.parametrize("case", CASES)
def test_gloo(gloo_results: dict[int, dict[str, str]], case: str) -> None:
    _check(gloo_results, case)


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs and CuPy")
@pytest.mark.parametrize("case", CASES)
def test_nccl(nccl_results: dict[int, dict[str, str]], case: str) -> None:
    _check(nccl_results, case)


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options that cannot hold for DTensor parameters fail in the constructor, with the reason."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # this process's own group of one, torn down below
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)]))
        with pytest.raises(ValueError, match="flat_grads=True needs plain tensor parameters"):
            co.AdamW([p], flat_grads=True)
        with pytest.raises(NotImplementedError, match="LAMB's trust ratio"):
            co.LAMB([p])
        opt = co.SGD([p], lr=0.1, momentum=0.9)
        p.grad = distribute_tensor(torch.ones(4, 3), p.device_mesh, [Shard(0)])
        opt.step()
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].full_tensor(), torch.ones(4, 3))
    finally:
        dist.destroy_process_group()
