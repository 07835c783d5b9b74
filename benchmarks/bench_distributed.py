"""Benchmark ``cukit.optim.AdamW`` against torch's fused AdamW under torch.distributed (issue 13 item 4).

Usage::

    torchrun --nproc-per-node=2 benchmarks/bench_distributed.py [--out DIR] [--quick] [--steps N]
    python benchmarks/bench_distributed.py --dry-run     # 2 CPU gloo processes, tiny model (smoke test)

Per sharding (DDP, FSDP2 ``fully_shard``, ZeroRedundancyOptimizer) and optimizer (cukit AdamW,
torch AdamW ``fused=True``) on the same model (an MLP stack, 8 blocks of d -> 4d -> d, ~67M
parameters at d=1024): the device time of ``optimizer.step()`` per rank (CUDA events, median; the
gradients stay from one backward), the time of a whole training iteration, and the peak memory per
rank. Then the loss curve of FSDP2 + cukit AdamW with clipping over ``--steps`` steps against a
single-GPU run of the same model on the whole batches (rank 0 runs it), as the largest relative
difference of the losses. Targets (printed PASS/FAIL): FSDP2 losses match the single-GPU run to
fp32 rounding (relative difference <= 1e-5 over 20 steps); cukit's step >= 1.1x torch fused's under
each sharding.

Results (rank 0) go to ``--out DIR`` ("-": none), else to a new temporary folder (printed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

try:  # run as a script: benchmarks/ is on sys.path
    import harness
except ImportError:  # imported as benchmarks.bench_distributed from the repository root
    from benchmarks import harness

NAME = "bench_distributed"
SHARDINGS = ("ddp", "fsdp2", "zero")
IMPLS = ("cukit", "torch-fused")


@dataclass
class Config:
    device: str = "cuda"
    d: int = 1024
    blocks: int = 8
    batch: int = 64  # per rank
    steps: int = 20  # loss-curve steps
    warmup: int = 3
    repeats: int = 20
    dry_run: bool = False
    out: str | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="2 CPU gloo processes, tiny sizes")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--steps", type=int, default=20, help="loss-curve steps (default 20)")
    harness.add_out_argument(ap)
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = Config(steps=args.steps, out=args.out)
    if args.quick:
        cfg = replace(cfg, repeats=8)
    if args.dry_run:
        cfg = replace(cfg, device="cpu", d=16, blocks=2, batch=4, steps=3, warmup=1, repeats=2, dry_run=True)
    return cfg


def make_model(cfg: Config, device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(cfg.blocks):
        layers += [torch.nn.Linear(cfg.d, 4 * cfg.d), torch.nn.GELU(), torch.nn.Linear(4 * cfg.d, cfg.d)]
    return torch.nn.Sequential(*layers).to(device)


def batches(cfg: Config, n: int, device: Any, world: int) -> list[tuple[Any, Any]]:
    """`n` global batches (world x per-rank batch rows), the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    rows = cfg.batch * world
    return [(torch.randn(rows, cfg.d, generator=g).to(device), torch.randn(rows, cfg.d, generator=g).to(device))
            for _ in range(n)]


def wrap(model: Any, sharding: str, device: Any, rank: int, world: int) -> Any:
    if sharding in ("ddp", "zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[rank] if device.type == "cuda" else None)
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_opt(model: Any, sharding: str, impl: str, cuda: bool, max_grad_norm: float | None = None) -> Any:
    import cukit.optim as co
    import torch

    if impl == "cukit":
        cls: Any = co.AdamW
        kw: dict[str, Any] = {"max_grad_norm": max_grad_norm} if max_grad_norm else {}
    else:
        cls, kw = torch.optim.AdamW, ({"fused": True} if cuda else {"foreach": True})
    if sharding == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, lr=1e-4, **kw)
    return cls(model.parameters(), lr=1e-4, **kw)


def loss_of(model: Any, x: Any, y: Any) -> Any:
    return (model(x) - y).square().mean()


def part(t: Any, rank: int, world: int) -> Any:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def measure(cfg: Config, sharding: str, impl: str, rank: int, world: int, device: Any) -> dict[str, Any]:
    import torch

    cuda = device.type == "cuda"
    row: dict[str, Any] = {"sharding": sharding, "impl": impl, "rank": rank}
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = wrap(make_model(cfg, device), sharding, device, rank, world)
        opt = make_opt(model, sharding, impl, cuda)
        (x, y), = batches(cfg, 1, device, world)
        x, y = part(x, rank, world), part(y, rank, world)

        def iteration() -> None:
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()

        for _ in range(cfg.warmup):
            iteration()
        step = harness.time_cuda(opt.step, warmup=1, repeats=cfg.repeats, flush_l2=False, cuda=cuda)
        it = harness.time_cuda(iteration, warmup=1, repeats=cfg.repeats, flush_l2=False, cuda=cuda)
        row.update(step_ms=step.ms, iter_ms=it.ms, timing=step.method)
        if cuda:
            row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["params_local"] = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
        )
    except Exception as e:  # recorded, the run goes on
        row["error"] = harness.short_error(e)
    return row


def loss_curve(cfg: Config, rank: int, world: int, device: Any) -> dict[str, Any]:
    """FSDP2 + cukit AdamW (clipping on) against the single-process run of rank 0."""
    import cukit.optim as co
    import torch
    import torch.distributed as dist

    data = batches(cfg, cfg.steps, device, world)
    model = wrap(make_model(cfg, device), "fsdp2", device, rank, world)
    opt = make_opt(model, "fsdp2", "cukit", device.type == "cuda", max_grad_norm=1.0)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_of(model, part(x, rank, world), part(y, rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.detach().double())
    dist_losses = torch.stack(losses)
    dist.all_reduce(dist_losses)
    dist_losses /= world
    row: dict[str, Any] = {"sharding": "fsdp2-vs-1gpu", "impl": "cukit", "rank": rank, "steps": cfg.steps}
    if rank == 0:
        single = make_model(cfg, device)
        sopt = co.AdamW(single.parameters(), lr=1e-4, max_grad_norm=1.0)
        ref = []
        for x, y in data:
            sopt.zero_grad()
            loss = loss_of(single, x, y)
            loss.backward()
            sopt.step()
            ref.append(loss.detach().double())
        r = torch.stack(ref)
        row["max_rel_loss_diff"] = float(((dist_losses - r).abs() / r.abs()).max())
        row["loss_first"], row["loss_last"] = float(r[0]), float(r[-1])
    dist.barrier()
    return row


def run_rank(cfg: Config, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        rows = [measure(cfg, s, i, rank, world, device) for s in SHARDINGS for i in IMPLS]
        rows.append(loss_curve(cfg, rank, world, device))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            report(cfg, [r for part_rows in gathered for r in part_rows])
    finally:
        dist.destroy_process_group()


def report(cfg: Config, rows: list[dict[str, Any]]) -> None:
    by = {(r["sharding"], r["impl"], r["rank"]): r for r in rows}
    for r in rows:
        t = by.get((r["sharding"], "torch-fused", r["rank"]), {})
        if r["impl"] == "cukit" and r.get("step_ms") and t.get("step_ms"):
            r["step_speedup_vs_torch"] = t["step_ms"] / r["step_ms"]
    cols = ["sharding", "impl", "rank", ("step_ms", "step ms"), ("iter_ms", "iter ms"), ("peak_mib", "peak MiB"),
            ("step_speedup_vs_torch", "x torch"), "params_local", "error"]
    harness.print_table([r for r in rows if r["sharding"] in SHARDINGS], cols, title="optimizer step per rank")
    curve = next((r for r in rows if r["sharding"] == "fsdp2-vs-1gpu" and r["rank"] == 0), {})
    diff = curve.get("max_rel_loss_diff")
    print(f"\nSUMMARY {NAME} (device {cfg.device}, {cfg.blocks} blocks of d={cfg.d}, batch {cfg.batch} per rank)")
    ok_loss = diff is not None and diff <= 1e-5
    print(f"  FSDP2 loss vs single GPU over {cfg.steps} steps: max rel diff {diff}: {'PASS' if ok_loss else 'FAIL'}")
    failures = [f"{r['sharding']}/{r['impl']}/rank{r['rank']}: {r['error']}" for r in rows if r.get("error")]
    for s in SHARDINGS:
        ratios = [r["step_speedup_vs_torch"] for r in rows if r["sharding"] == s and "step_speedup_vs_torch" in r]
        if ratios:
            worst = min(ratios)
            print(f"  {s}: cukit step / torch fused, worst rank: {worst:.2f}x ({'PASS' if worst >= 1.1 else 'FAIL'} >= 1.1x)")
    saved = [str(p) for p in harness.save_results(rows, NAME, cfg.out, meta={"config": cfg.__dict__})]
    harness.print_outcome(failures, saved)


def _spawned(rank: int, cfg: Config, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    run_rank(cfg, rank, world)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_args(parse_args(argv))
    if "RANK" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if cfg.device == "cuda" and not harness.cuda_available():
            print(f"{NAME}: torch sees no CUDA device; use --dry-run for the CPU smoke mode", file=sys.stderr)
            return 2
        if rank == 0:
            try:
                cfg = harness.with_results_dir(cfg, NAME)
            except ValueError as e:
                print(f"{NAME}: {e}", file=sys.stderr)
                return 2
        run_rank(cfg, rank, world)
        return 0
    if not cfg.dry_run:
        print(f"{NAME}: run under torchrun --nproc-per-node=2 (or --dry-run for 2 CPU processes)", file=sys.stderr)
        return 2
    try:
        cfg = harness.with_results_dir(cfg, NAME)
    except ValueError as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 2
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    run: Callable[..., Any] = mp.start_processes
    run(_spawned, args=(cfg, port, 2), nprocs=2, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
