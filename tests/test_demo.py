"""`cukit demo`: the digits MLP trained with stock torch and with cukit.nn.BiasAct (CPU here; the
GPU run is `make gpu-check`'s business). A few epochs only: these check the plumbing and that the
two variants compute the same thing, not how fast either is."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("sklearn")
torch = pytest.importorskip("torch")

import cukit  # noqa: E402
from cukit import demo  # noqa: E402  (after the skips: the demo needs torch and scikit-learn)


def torch_cuda() -> bool:
    return torch.cuda.is_available() and cukit.is_available()


@pytest.fixture(scope="module")
def mlp_cpu() -> dict:
    return demo.run_mlp(epochs=2, device="cpu", seed=0)


def test_run_mlp_learns_and_variants_agree(mlp_cpu: dict) -> None:
    r = mlp_cpu
    assert r["device"] == "CPU"
    assert r["torch_device"] == "cpu"
    assert r["sizes"] == [64, 256, 256, 10]
    assert r["n_train"] + r["n_test"] == 1797
    assert r["steps"] == 2 * -(-r["n_train"] // 64)
    assert set(r["variants"]) == {"torch", "cukit"}
    for v in r["variants"].values():
        assert v["test_accuracy"] > 0.8  # chance is 0.1; two epochs reach ~0.95
        assert 0 < v["final_loss"] < 1.0
        assert v["ms_per_step"] > 0
        assert len(v["losses"]) == r["steps"]
        assert v["losses"][-1] < v["losses"][0]  # it trained
    assert r["variants"]["torch"]["speedup"] == 1.0
    assert r["loss_max_abs_diff"] < 1e-4
    assert r["losses_agree"]
    t, c = r["variants"]["torch"], r["variants"]["cukit"]
    assert abs(t["test_accuracy"] - c["test_accuracy"]) <= 1 / r["n_test"] + 1e-9


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_every_activation_matches_torch(activation: str) -> None:
    r = demo.run_mlp(epochs=1, device="cpu", activation=activation, hidden=(32,))
    assert r["sizes"] == [64, 32, 10]
    assert r["loss_max_abs_diff"] < 1e-4


def test_models_start_identical() -> None:
    stock, fused = demo.mlp_models([64, 16, 8, 10], "gelu", seed=3)
    lin = [m for m in stock if isinstance(m, torch.nn.Linear)]
    nobias = [m for m in fused if isinstance(m, torch.nn.Linear)]
    bias_acts = [m for m in fused if type(m).__name__ == "BiasAct"]
    assert len(lin) == len(nobias) == 3 and len(bias_acts) == 2
    for a, b in zip(lin, nobias, strict=True):
        assert torch.equal(a.weight, b.weight)
    for a, ba in zip(lin[:-1], bias_acts, strict=True):
        assert torch.equal(a.bias, ba.bias)
    assert nobias[0].bias is None and torch.equal(lin[-1].bias, nobias[-1].bias)
    x = torch.randn(5, 64)
    torch.testing.assert_close(fused(x), stock(x))


def test_optimizer_is_one_argument() -> None:
    built: list[type] = []

    def sgd(params):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(params, lr=0.05)
        built.append(type(opt))
        return opt

    r = demo.run_mlp(epochs=1, device="cpu", hidden=(32,), optimizer=sgd)
    assert built == [torch.optim.SGD, torch.optim.SGD]  # one per variant
    assert r["loss_max_abs_diff"] < 1e-4


def test_same_seed_same_numbers() -> None:
    run = functools.partial(demo.run_mlp, epochs=1, device="cpu", hidden=(32,), seed=7)
    a, b = run(), run()
    assert a["variants"]["cukit"]["losses"] == b["variants"]["cukit"]["losses"]


def test_main_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--epochs", "2", "--device", "cpu", "--activation", "relu"]) == 0
    out = capsys.readouterr().out
    assert "device: CPU" in out
    for text in ("test acc", "train loss", "ms/step", "vs torch", "nn.Linear + F.relu", "cukit.nn.BiasAct"):
        assert text in out
    assert "loss curves agree: yes" in out
    table = [line for line in out.splitlines() if line.startswith("mlp ")]
    assert [line.split()[1] for line in table] == ["torch", "cukit"]


def test_main_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--epochs", "2", "--device", "cpu", "--quiet"]) == 0
    assert capsys.readouterr().out == ""


def test_main_fails_when_an_experiment_disagrees(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(opts: demo.DemoOptions) -> demo.ExperimentResult:
        row = demo.Row("broken", "cukit", "x", 0.1, 2.3, 1.0, 1.0)
        return demo.ExperimentResult("broken", "broken: always disagrees", [row], ["broken: NO"], ok=False)

    monkeypatch.setattr(demo, "EXPERIMENTS", {"broken": broken})
    assert demo.main(["--device", "cpu"]) == 1
    assert "broken: NO" in capsys.readouterr().out


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--epochs", "0", "--quiet"]) == 2
    with pytest.raises(SystemExit):
        demo.main(["--activation", "tanh"])
    with pytest.raises(ValueError, match="activation"):
        demo.run_mlp(epochs=1, device="cpu", activation="tanh")


@pytest.mark.skipif(torch_cuda(), reason="a GPU is usable here")
def test_device_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--device", "cuda", "--quiet"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_auto_device_is_cpu_without_gpu() -> None:
    expected = "cuda" if torch_cuda() else "cpu"
    assert demo.resolve_device("auto").type == expected
