"""cukit.train: RunningMean / Metrics against plain Python, NonFiniteGuard with cukit.optim's
reference (CPU) and kernels (GPU), capture_step's refusals, and on the GPU the graphed step against
the same eager loop (losses, parameters, optimizer state, metrics, skipped NaN steps), the
CaptureError of a step that calls .item(), and a usable CUDA context after a failed capture.
The example examples/sync_free_training.py runs with tiny sizes (CPU variants in CI)."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cukit.optim as co
import pytest

import cukit

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cukit.train as ct  # noqa: E402

GPU = cukit.is_available() and torch.cuda.is_available()
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sync_free_training.py"


# ------------------------------------------------------------------------------ RunningMean / Metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_running_mean_matches_python(dtype: torch.dtype) -> None:
    """Scalars, vectors, Python and tensor weights (broadcast), Python values: Σ w x / Σ w."""
    rng = random.Random(0)
    m = ct.RunningMean(dtype=dtype)
    num = den = 0.0
    for i in range(12):
        n = rng.randint(1, 5)
        xs = [rng.uniform(0, 3) for _ in range(n)]  # positive: no cancellation in the float32 sum
        x = torch.tensor(xs, dtype=torch.float64).to(torch.float32 if i % 2 else torch.float64)
        if i % 3 == 0:
            w = rng.uniform(0.1, 4)
            m.update(x, weight=w)
            num += w * sum(x.double().tolist())
            den += w * n
        elif i % 3 == 1:
            ws = [rng.uniform(0.1, 4) for _ in range(n)]
            m.update(x, weight=torch.tensor(ws, dtype=torch.float64))
            num += sum(a * b for a, b in zip(x.double().tolist(), ws, strict=True))
            den += sum(ws)
        else:
            w0 = rng.uniform(0.1, 4)
            m.update(x, weight=torch.tensor(w0, dtype=torch.float64))  # 0-dim weight broadcast over x
            num += w0 * sum(x.double().tolist())
            den += w0 * n
    m.update(2.5)  # a Python value
    num, den = num + 2.5, den + 1
    out = m.compute()
    assert out.dtype == dtype and out.shape == () and out.device.type == "cpu"
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert m.read() == pytest.approx(num / den, rel=tol)
    assert float(m.weight()) == pytest.approx(den, rel=1e-12)


def test_running_mean_zero_weight_ignores_nonfinite_and_reset() -> None:
    m = ct.RunningMean()
    assert math.isnan(m.read())  # no weight yet
    m.update(torch.tensor([1.0, float("nan"), 3.0]), weight=torch.tensor([1.0, 0.0, 1.0]))
    m.update(torch.tensor(float("inf")), weight=0)
    m.update(torch.tensor(float("nan")), weight=torch.tensor(0.0))
    assert m.read() == 2.0
    buf = m._sum
    assert m.read(reset=True) == 2.0
    assert math.isnan(m.read())
    assert m._sum is buf  # reset zeroes in place: a captured graph keeps writing into the same buffer
    m.update(torch.tensor(7, dtype=torch.int64))  # integers are averaged as dtype
    assert m.read() == 7.0


def test_running_mean_errors() -> None:
    with pytest.raises(TypeError, match=r"float32 or torch\.float64"):
        ct.RunningMean(dtype=torch.float16)
    m = ct.RunningMean()
    with pytest.raises(ValueError, match="does not broadcast"):
        m.update(torch.tensor(1.0), weight=torch.ones(3))
    assert "RunningMean(" in repr(m)


def test_metrics_read_together_reset_and_new_names() -> None:
    rng = random.Random(1)
    mt = ct.Metrics("loss", "acc", "never", dtype=torch.float64)
    ref: dict[str, list[tuple[float, float]]] = {"loss": [], "acc": []}
    for _ in range(6):
        loss, acc, w = rng.uniform(0, 2), rng.uniform(0, 1), float(rng.randint(1, 8))
        mt.update(loss=torch.tensor(loss, dtype=torch.float64), acc=acc, weight=w)
        ref["loss"].append((loss, w))
        ref["acc"].append((acc, w))
    mt.update({"lr": torch.tensor(0.5)})  # a new name
    out = mt.read()
    assert list(out) == ["loss", "acc", "never", "lr"] == list(mt)
    for name, pairs in ref.items():
        assert out[name] == pytest.approx(sum(a * b for a, b in pairs) / sum(b for _, b in pairs), rel=1e-12)
    assert math.isnan(out["never"]) and out["lr"] == 0.5
    assert isinstance(mt["loss"], ct.RunningMean) and len(mt) == 4
    assert set(mt.compute()) == set(out)
    mt.read(reset=True)
    assert all(math.isnan(v) for v in mt.read().values())


# ------------------------------------------------------------------------------ NonFiniteGuard (CPU)


def tiny_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[Any]:
    return [
        (p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()})
        for p in params
    ]


def assert_unchanged(opt: torch.optim.Optimizer, params: list[torch.Tensor], snap: list[Any]) -> None:
    for i, (p, (value, state)) in enumerate(zip(params, snap, strict=True)):
        assert torch.equal(p.detach(), value), f"param {i} changed on a skipped step"
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[k])), (i, k)


def make_opt(name: str, params: Any, **kw: Any) -> torch.optim.Optimizer:
    if name == "SGD":
        return co.SGD(params, lr=0.05, momentum=0.9, **kw)
    return co.AdamW(params, lr=0.01, weight_decay=0.1, **kw)


def batches(
    n: int, device: str, bad: dict[int, str] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(n):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        if bad and i in bad:
            x[1, 2] = float(bad[i])
        out.append((x.to(device), y.to(device)))
    return out


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_guard_skips_nonfinite_steps_cpu(name: str) -> None:
    """A NaN loss and an inf gradient (finite loss) each leave params and state untouched, are
    counted, and the run equals one that never saw those batches; finite steps equal unguarded ones."""
    data = batches(7, "cpu", bad={1: "nan"})
    guarded, plain = tiny_model(), tiny_model()
    og, op = make_opt(name, guarded.parameters()), make_opt(name, plain.parameters())
    guard = ct.NonFiniteGuard(og)
    gp, pp = list(guarded.parameters()), list(plain.parameters())
    losses = ct.RunningMean()
    ref_losses = []
    for i, (x, y) in enumerate(data):
        og.zero_grad()
        loss = F.mse_loss(guarded(x), y)
        loss.backward()
        if i == 4:  # a finite loss with an inf gradient: only the gradient check catches it
            gp[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        snap = snapshot(og, gp)
        guard.step(loss)
        losses.update(loss, weight=guard.finite)
        assert not hasattr(og, "found_inf")  # handed over for the step only, as GradScaler does
        if i in (1, 4):
            assert float(guard.flag) == 1.0 and float(guard.finite) == 0.0  # type: ignore[arg-type]
            assert_unchanged(og, gp, snap)
            continue
        assert float(guard.flag) == 0.0  # type: ignore[arg-type]
        op.zero_grad()
        ref = F.mse_loss(plain(x), y)
        ref.backward()
        op.step()
        ref_losses.append(float(ref.detach()))
        torch.testing.assert_close(loss.detach(), ref.detach())
        for a, b in zip(gp, pp, strict=True):
            torch.testing.assert_close(a.detach(), b.detach())
    assert guard.skipped() == 2 and guard.steps() == 7
    assert losses.read() == pytest.approx(sum(ref_losses) / len(ref_losses), rel=1e-6)
    guard.reset()
    assert guard.skipped() == 0 and guard.steps() == 0


def test_guard_check_arms_the_next_optimizer_step() -> None:
    """check() then a plain optimizer.step(): the step hooks hand the flag over and count; a step
    without a check is not counted; remove() detaches the guard."""
    model = tiny_model()
    opt = co.SGD(model.parameters(), lr=0.1)
    guard = ct.NonFiniteGuard(opt)
    p = next(model.parameters())
    x, y = batches(1, "cpu")[0]
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert float(guard.check(loss)) == 0.0
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p.detach(), before) and guard.steps() == 1
    opt.step()  # not armed: not counted
    assert guard.steps() == 1 and guard.skipped() == 0
    guard.check(torch.tensor(float("inf")))
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before) and guard.skipped() == 1
    guard.remove()
    guard.check(torch.tensor(float("nan")))  # computes the flag, but nothing hands it over now
    opt.step()
    assert not torch.equal(p.detach(), before) and guard.steps() == 2


def test_guard_loss_only() -> None:
    model = tiny_model()
    opt = co.SGD(model.parameters(), lr=0.1)
    guard = ct.NonFiniteGuard(opt, check_grads=False)
    x, y = batches(1, "cpu")[0]
    loss = F.mse_loss(model(x), y)
    loss.backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    assert float(guard.check(loss)) == 0.0  # the gradients are not looked at
    with pytest.raises(ValueError, match="nothing to check"):
        guard.check()


def test_guard_refuses_torch_optimizers_and_grad_scaler_conflict() -> None:
    model = tiny_model()
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD.*cukit\.optim\.SGD"):
        ct.NonFiniteGuard(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"cukit\.optim\.AdamW"):
        ct.NonFiniteGuard(torch.optim.AdamW(model.parameters(), fused=False))
    opt = co.SGD(model.parameters(), lr=0.1)
    guard = ct.NonFiniteGuard(opt)
    x, y = batches(1, "cpu")[0]
    loss = F.mse_loss(model(x), y)
    loss.backward()
    guard.check(loss)
    opt.found_inf = torch.zeros(())  # what GradScaler.step does before calling step()
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step()


# ------------------------------------------------------------------------------ capture_step refusals (CPU)


def test_capture_step_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_model()
    opt = co.AdamW(model.parameters(), capturable=True)
    with pytest.raises(ct.CaptureError, match=r"needs a CUDA GPU: torch\.cuda\.is_available\(\) is False"):
        ct.capture_step(model, F.mse_loss, opt, batches(1, "cpu")[0])


def test_capture_step_refuses_torch_optimizers() -> None:
    model = tiny_model()
    sample = batches(1, "cpu")[0]
    with pytest.raises(ct.CaptureError, match=r"capturable=False") as e:
        ct.capture_step(model, F.mse_loss, torch.optim.Adam(model.parameters()), sample)
    assert "cukit.optim.Adam" in str(e.value) and "found_inf" in str(e.value)
    with pytest.raises(ct.CaptureError, match=r"got torch\.optim\.sgd\.SGD.*cukit\.optim\.SGD"):
        ct.capture_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), sample)


def test_capture_step_refuses_a_cpu_lr_tensor() -> None:
    """A non-capturable cukit.optim optimizer: its lr is a CPU tensor (read on the host per step)."""
    model = tiny_model()
    opt = co.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    with pytest.raises(ct.CaptureError, match=r"param group 0's lr is a tensor on cpu"):
        ct.capture_step(model, F.mse_loss, opt, batches(1, "cpu")[0])


def test_capture_step_refuses_a_cpu_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cukit, "is_available", lambda: True)
    model = tiny_model()
    with pytest.raises(ct.CaptureError, match=r"parameter 0\.weight is on cpu.*model\.to\('cuda'\)"):
        ct.capture_step(model, F.mse_loss, co.SGD(model.parameters(), lr=0.1), batches(1, "cpu")[0])


def test_capture_step_argument_errors() -> None:
    model = tiny_model()
    opt = co.SGD(model.parameters(), lr=0.1)
    x, y = batches(1, "cpu")[0]
    with pytest.raises(TypeError, match="tuple or list"):
        ct.capture_step(model, F.mse_loss, opt, x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_targets=2"):
        ct.capture_step(model, F.mse_loss, opt, (x, y), n_targets=2)
    with pytest.raises(ValueError, match="warmup"):
        ct.capture_step(model, F.mse_loss, opt, (x, y), warmup=0)
    with pytest.raises(ValueError, match="another optimizer"):
        ct.capture_step(model, F.mse_loss, opt, (x, y), guard=ct.NonFiniteGuard(co.SGD(model.parameters())))


def test_capture_error_explains_a_sync_and_names_the_line() -> None:
    """The message built from a failed capture's chained errors, without a GPU: as with
    torch.cuda.graph, the error raised in the step is the context of the one capture_end raises."""

    class FakeGraph:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def users_loss(out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")  # a .item()

    with pytest.raises(RuntimeError) as e, FakeGraph():
        users_loss(torch.zeros(()))
    msg = ct._explain(e.value, "during capture", tiny_model())
    assert ".item()" in msg and "host synchronisation" in msg
    where = next(line for line in msg.splitlines() if "Where:" in line)
    assert "test_train.py" in where and "# a .item()" in where
    assert "operation not permitted when stream is capturing" in msg  # the original error


# ------------------------------------------------------------------------------ the example


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("sync_free_training", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


TINY = {"warmup": 2, "steps": 4, "sync_steps": 2, "batch_size": 16, "samples": 128, "log_every": 2}


def test_example_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    ex = load_example()
    results = ex.main(ex.Config(**TINY), device="cpu")
    assert [r.name[0] for r in results] == ["1", "2"]
    a, b = results
    assert a.final_loss == pytest.approx(b.final_loss, rel=1e-6) and a.skipped == b.skipped
    assert a.syncs_per_step is None
    out = capsys.readouterr().out
    assert "ms/step" in out and "need a CUDA GPU" in out


# ------------------------------------------------------------------------------ GPU


def gpu_batches(n: int, bad: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if i == bad:
            x[0, 0] = float("nan")
        out.append((x.cuda(), y.cuda()))
    return out


def gpu_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()


def gpu_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "AdamW":
        return co.AdamW(params, lr=1e-2, weight_decay=0.1, capturable=True)
    return co.SGD(params, lr=0.05, momentum=0.9)


def eager_and_graphed(
    name: str, *, bad: int | None = None, guarded: bool = False, loss_fn: Callable[..., Any] = F.mse_loss
) -> dict[str, Any]:
    """Ten steps of the same model, data and optimizer, eagerly and through capture_step."""
    data = gpu_batches(10, bad)
    eager, graphed = gpu_model(), gpu_model()
    oe, og = gpu_opt(name, eager.parameters()), gpu_opt(name, graphed.parameters())
    ge = ct.NonFiniteGuard(oe) if guarded else None
    gg = ct.NonFiniteGuard(og) if guarded else None
    me, mg = ct.RunningMean(), ct.RunningMean()
    step = ct.capture_step(graphed, loss_fn, og, data[0], metrics=mg, guard=gg)
    pe, pg = list(eager.parameters()), list(graphed.parameters())
    eager_losses, graphed_losses, unchanged = [], [], []
    for x, y in data:
        oe.zero_grad(set_to_none=False)
        le = loss_fn(eager(x), y)
        le.backward()
        if ge is not None:
            ge.step(le)
            me.update(le, weight=ge.finite)
        else:
            oe.step()
            me.update(le)
        before = [p.detach().clone() for p in pg]
        lg = step(x, y).clone()
        unchanged.append(all(torch.equal(a, b.detach()) for a, b in zip(before, pg, strict=True)))
        eager_losses.append(le.detach())
        graphed_losses.append(lg)
    torch.cuda.synchronize()
    return {
        "eager": (eager, oe, pe, eager_losses, me, ge),
        "graphed": (graphed, og, pg, graphed_losses, mg, gg),
        "unchanged": unchanged,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_graphed_step_equals_eager(name: str) -> None:
    r = eager_and_graphed(name)
    _, oe, pe, le, me, _ = r["eager"]
    _, og, pg, lg, mg, _ = r["graphed"]
    for i, (a, b) in enumerate(zip(le, lg, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"loss of step {i}: {m}")
    for i, (a, b) in enumerate(zip(pe, pg, strict=True)):
        torch.testing.assert_close(
            b.detach(), a.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"param {i}: {m}"
        )
        for k, v in oe.state[a].items():
            torch.testing.assert_close(og.state[b][k], v, rtol=1e-5, atol=1e-6)
    if name == "AdamW":
        assert float(og.state[pg[0]]["step"]) == 10.0  # the warm-up steps were skipped
    assert mg.read() == pytest.approx(me.read(), rel=1e-5)  # metrics updated inside the graph
    assert mg.read() == pytest.approx(float(torch.stack(le).double().mean()), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_guard_skips_a_nan_batch_eager_and_graphed(name: str) -> None:
    r = eager_and_graphed(name, bad=3, guarded=True)
    _, oe, pe, le, me, ge = r["eager"]
    _, og, pg, lg, mg, gg = r["graphed"]
    assert r["unchanged"] == [i == 3 for i in range(10)]  # the graphed params froze on the NaN step only
    assert ge.skipped() == gg.skipped() == 1 and gg.steps() == 10
    assert torch.isnan(lg[3]) and torch.isnan(le[3])
    for a, b in zip(pe, pg, strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)
    if name == "AdamW":
        assert float(og.state[pg[0]]["step"]) == float(oe.state[pe[0]]["step"]) == 9.0
    finite = [float(v) for i, v in enumerate(le) if i != 3]
    assert mg.read() == pytest.approx(sum(finite) / len(finite), rel=1e-5)  # the NaN step has weight 0
    assert me.read() == pytest.approx(mg.read(), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_metrics_with_extras_inside_the_graph() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.mse_loss(out, y), {"mae": (out - y).abs().mean()}

    model = gpu_model()
    opt = gpu_opt("SGD", model.parameters())
    data = gpu_batches(5)
    metrics = ct.Metrics()
    step = ct.capture_step(model, loss_fn, opt, data[0], metrics=metrics)
    ref = ct.Metrics()
    twin = gpu_model()
    opt2 = gpu_opt("SGD", twin.parameters())
    for x, y in data:
        step(x, y)
        opt2.zero_grad()
        loss, extra = loss_fn(twin(x), y)
        loss.backward()
        opt2.step()
        ref.update(loss=loss, **extra)
    got, want = metrics.read(), ref.read()
    assert list(got) == ["loss", "mae"]
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("check_syncs", [True, False], ids=["caught-in-warmup", "caught-by-capture"])
def test_item_in_the_step_raises_capture_error_naming_it(check_syncs: bool) -> None:
    """With check_syncs the last warm-up step catches the sync; without, the capture fails for
    real: either way a CaptureError names .item() and this file's line, and afterwards the
    caller's stream is current, eager work runs and a good step captures and replays."""
    seen: list[float] = []

    def loss_with_item(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, y)
        seen.append(loss.item())  # a host sync: not capturable
        return loss

    model = gpu_model()
    opt = gpu_opt("AdamW", model.parameters())
    data = gpu_batches(3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ct.CaptureError) as e:
        ct.capture_step(model, loss_with_item, opt, data[0], check_syncs=check_syncs)
    msg = str(e.value)
    assert ".item()" in msg and "host synchronisation" in msg, msg
    assert "test_train.py" in msg and "seen.append(loss.item())" in msg, msg
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.synchronize()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())  # the warm-up trained nothing
    step = ct.capture_step(model, F.mse_loss, opt, data[0])  # the same model and optimizer, a good step
    x, y = data[1]
    with torch.no_grad():
        expected = F.mse_loss(model(x), y)  # the loss a replay computes before its update
    torch.testing.assert_close(step(x, y), expected, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_replay_checks_inputs_and_hyperparameters() -> None:
    model = gpu_model()
    lr = torch.tensor(1e-2, device="cuda")
    opt = co.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    data = gpu_batches(2)
    step = ct.capture_step(model, F.mse_loss, opt, data[0])
    x, y = data[1]
    with pytest.raises(ValueError, match=r"argument 0 has shape \(5, 16\).*drop_last=True"):
        step(x[:5], y[:5])
    with pytest.raises(ValueError, match=r"argument 1 .*cpu.*non_blocking=True"):
        step(x, y.cpu())
    with pytest.raises(ValueError, match=r"argument 0 .*torch.float64"):
        step(x.double(), y)
    with pytest.raises(TypeError, match="takes 2 tensors"):
        step(x)
    lr.fill_(0.0)  # a tensor lr is read on the device at every replay
    before = [p.detach().clone() for p in model.parameters()]
    step(x, y)
    torch.cuda.synchronize()
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr: not a step hyperparameter
    step(x, y)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ct.CaptureError, match=r"param group 0's 'weight_decay' changed since capture"):
        step(x, y)
    opt.param_groups[0]["weight_decay"] = 0.1
    step(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_replay_refuses_stale_tensors() -> None:
    """The graph writes into the tensors it was captured with: after the optimizer rebuilt its own
    or the grads were set to None, a replay raises; a model state_dict loads in place."""
    model = gpu_model()
    opt = gpu_opt("SGD", model.parameters())
    x, y = gpu_batches(1)[0]
    step = ct.capture_step(model, F.mse_loss, opt, (x, y))
    model.load_state_dict(gpu_model().state_dict())
    step(x, y)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ct.CaptureError, match="optimizer rebuilt its tensors"):
        step(x, y)
    step = ct.capture_step(model, F.mse_loss, opt, (x, y))  # capturing again is the fix
    step(x, y)
    opt.zero_grad(set_to_none=True)
    with pytest.raises(ct.CaptureError, match="capture the step again"):
        step(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_capture_step_refuses_cpu_inputs_and_no_grad() -> None:
    model = gpu_model()
    opt = gpu_opt("SGD", model.parameters())
    x, y = gpu_batches(1)[0]
    with pytest.raises(ct.CaptureError, match=r"sample_inputs\[1\] is on cpu"):
        ct.capture_step(model, F.mse_loss, opt, (x, y.cpu()))
    with pytest.raises(ct.CaptureError, match="no parameter of the optimizer has a gradient"):
        ct.capture_step(model, lambda out, y: F.mse_loss(out.detach().requires_grad_(), y), opt, (x, y))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_running_mean_update_inside_a_captured_graph() -> None:
    """Python and tensor weights inside a graph you capture yourself: every replay accumulates."""
    x = torch.zeros(3, device="cuda")
    w = torch.ones(3, device="cuda")
    m, mw = ct.RunningMean(), ct.RunningMean(dtype=torch.float64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first update allocates the buffers: not inside the capture
        m.update(x * 2, weight=2)
        mw.update(x, weight=w)
    torch.cuda.current_stream().wait_stream(side)
    m.reset()
    mw.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m.update(x * 2, weight=2)  # a Python weight: counted on the device while capturing
        mw.update(x, weight=w)
    rows = []
    for k in range(5):
        x.copy_(torch.arange(3, device="cuda", dtype=torch.float32) + k)
        w.fill_(k + 1)
        graph.replay()
        rows.append(([float(v) for v in range(k, k + 3)], k + 1))
    assert m.read() == pytest.approx(sum(2 * v for xs, _ in rows for v in xs) / 15, rel=1e-6)
    weighted = sum(v * wk for xs, wk in rows for v in xs) / sum(3 * wk for _, wk in rows)
    assert mw.read() == pytest.approx(weighted, rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with CuPy")
def test_example_on_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    ex = load_example()
    cfg = ex.Config(warmup=5, steps=40, sync_steps=40, batch_size=64, samples=2048, log_every=20)
    results = ex.main(cfg, device="cuda")
    assert [r.name[0] for r in results] == ["1", "2", "3", "4"]
    naive, device_side, pinned, graphed = results
    assert naive.syncs_per_step >= 3  # two blocking copies, isfinite, .item()
    assert device_side.syncs_per_step >= 2  # the blocking copies remain
    assert pinned.syncs_per_step <= 0.1 and graphed.syncs_per_step <= 0.1  # one read per 20 steps
    for r in results[1:]:
        assert r.final_loss == pytest.approx(naive.final_loss, rel=1e-4), r.name
        assert r.skipped == naive.skipped >= 1
    print(capsys.readouterr().out)
