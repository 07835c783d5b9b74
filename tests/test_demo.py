"""`cukit demo`: the digits MLP trained with stock torch and with cukit.nn.BiasAct, the stock side
stepping with torch.optim.AdamW and the cukit side with cukit.optim.AdamW (CPU here; the GPU tests
are marked `gpu` and run under `make gpu-check`). A few epochs only: these check the plumbing and that the
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
    assert t["optimizer"] == "torch.optim.AdamW" and c["optimizer"] == "cukit.optim.AdamW"


def test_cukit_variant_steps_with_cukit_optim_adamw() -> None:
    """The default pairing: torch.optim.AdamW for the stock model, cukit.optim.AdamW (same lr and
    weight decay, flat gradients) for the cukit model; the gradients stay views of its buffer."""
    built: list[torch.optim.Optimizer] = []

    def record(factory):  # type: ignore[no-untyped-def]
        def make(params):  # type: ignore[no-untyped-def]
            built.append(factory(params))
            return built[-1]

        return make

    r = demo.run_mlp(
        epochs=1,
        device="cpu",
        hidden=(32,),
        optimizer=record(demo.default_optimizer),
        cukit_optimizer=record(demo.default_cukit_optimizer),
    )
    stock, fused = built
    assert type(stock) is torch.optim.AdamW and type(fused) is cukit.optim.AdamW
    for key in ("lr", "weight_decay", "betas", "eps"):
        assert stock.param_groups[0][key] == fused.param_groups[0][key], key
    assert fused.state and all(int(s["step"]) == r["steps"] for s in fused.state.values())
    (buffer,) = fused._flat_buffers
    for p in fused.param_groups[0]["params"]:
        assert p.grad is not None
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert r["loss_max_abs_diff"] < 1e-4


def test_explicit_cukit_optimizer_is_used() -> None:
    def sgd(params):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(params, lr=0.05)

    def cukit_sgd(params):  # type: ignore[no-untyped-def]
        return cukit.optim.SGD(params, lr=0.05)

    r = demo.run_mlp(epochs=1, device="cpu", hidden=(32,), optimizer=sgd, cukit_optimizer=cukit_sgd)
    assert r["variants"]["torch"]["optimizer"] == "torch.optim.SGD"
    assert r["variants"]["cukit"]["optimizer"] == "cukit.optim.SGD"
    assert r["loss_max_abs_diff"] < 1e-4


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
    assert built == [torch.optim.SGD, torch.optim.SGD]  # one per variant: a custom optimizer is used on both
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
    assert "torch.optim.AdamW" in table[0] and "cukit.optim.AdamW" in table[1]


def test_main_backward_thread(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch._C._is_multithreading_enabled()
    assert demo.main(["--epochs", "1", "--device", "cpu"]) == 0
    assert demo.BACKWARD_THREAD_NOTE["worker"] in capsys.readouterr().out  # torch's default
    assert demo.main(["--epochs", "1", "--device", "cpu", "--backward-thread", "caller"]) == 0
    assert demo.BACKWARD_THREAD_NOTE["caller"] in capsys.readouterr().out
    assert torch._C._is_multithreading_enabled() == before  # restored for the caller
    with pytest.raises(SystemExit):
        demo.main(["--backward-thread", "main"])


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA GPU visible to torch and CuPy")
@pytest.mark.parametrize("experiment", ["mlp", "cnn"])
def test_demo_on_cuda_agrees_with_cukit_optim_kernels(experiment: str) -> None:
    """On the GPU the cukit variant's step is cukit.optim.AdamW's fused kernel (flat gradients):
    its loss curve must still follow torch.optim.AdamW's within the demo's tolerance."""
    if experiment == "cnn" and demo.cnn_missing() is not None:
        pytest.skip(f"cnn experiment: {demo.cnn_missing()}")
    run = demo.run_mlp if experiment == "mlp" else demo.run_cnn
    r = run(epochs=2, device="cuda", seed=0)
    assert r["torch_device"].startswith("cuda")
    assert set(r["variants"]) == {"torch", "cukit", "cukit+graph"}
    assert r["variants"]["cukit"]["optimizer"] == "cukit.optim.AdamW"
    assert r["variants"]["cukit+graph"]["optimizer"] == "cukit.optim.AdamW"
    assert r["losses_agree"], r["loss_max_abs_diff"]
    for v in r["variants"].values():
        assert v["test_accuracy"] > 0.8 and v["losses"][-1] < v["losses"][0]
    # the graphed step is the eager cukit step replayed (the epoch's smaller last batch eager):
    # the same kernels on the same batches, so the curves agree to float32 rounding
    eager, graphed = r["variants"]["cukit"]["losses"], r["variants"]["cukit+graph"]["losses"]
    assert len(graphed) == r["steps"] and r["n_train"] % r["batch_size"]  # a partial batch was in it
    assert max(abs(a - b) for a, b in zip(eager, graphed, strict=True)) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch_cuda(), reason="needs a CUDA GPU visible to torch and CuPy")
def test_demo_graphed_variant_can_be_turned_off() -> None:
    r = demo.run_mlp(epochs=1, device="cuda", seed=0, graphed=False)
    assert set(r["variants"]) == {"torch", "cukit"}


def test_graphed_variant_needs_cuda() -> None:
    assert set(demo.run_mlp(epochs=1, device="cpu", seed=0)["variants"]) == {"torch", "cukit"}
    with pytest.raises(ValueError, match="graphed=True needs a CUDA device"):
        demo.run_mlp(epochs=1, device="cpu", seed=0, graphed=True)


# ---------------------------------------------------------------------------------------------
# The cnn experiment: cukit.nn.Conv2d convolutions (activation fused), cukit.nn.Linear classifier
# ---------------------------------------------------------------------------------------------

needs_cnn = pytest.mark.skipif(
    demo.cnn_missing() is not None, reason=f"cnn experiment: {demo.cnn_missing()}"
)


@pytest.fixture(scope="module")
def cnn_cpu() -> dict:
    if demo.cnn_missing() is not None:
        pytest.skip(f"cnn experiment: {demo.cnn_missing()}")
    return demo.run_cnn(epochs=2, device="cpu", seed=0)


@needs_cnn
def test_run_cnn_learns_and_variants_agree(cnn_cpu: dict) -> None:
    r = cnn_cpu
    assert r["device"] == "CPU" and r["torch_device"] == "cpu"
    assert r["channels"] == [16, 32] and r["n_train"] + r["n_test"] == 1797
    assert r["steps"] == 2 * -(-r["n_train"] // 64)
    assert set(r["variants"]) == {"torch", "cukit"}
    for v in r["variants"].values():
        assert v["test_accuracy"] > 0.8  # chance is 0.1; two epochs reach ~0.93
        assert 0 < v["final_loss"] < 1.0
        assert v["ms_per_step"] > 0 and len(v["losses"]) == r["steps"]
        assert v["losses"][-1] < v["losses"][0]
    assert r["variants"]["torch"]["speedup"] == 1.0
    assert r["loss_max_abs_diff"] < 1e-4  # ~1e-7 measured on the CPU
    assert r["losses_agree"] and r["loss_tolerance"] == demo.CNN_LOSS_TOLERANCE
    t, c = r["variants"]["torch"], r["variants"]["cukit"]
    assert abs(t["test_accuracy"] - c["test_accuracy"]) <= 1 / r["n_test"] + 1e-9


@needs_cnn
def test_cnn_models_start_identical() -> None:
    import cukit.nn

    stock, fused = demo.cnn_models("gelu", channels=(4, 8), seed=3)
    convs = [m for m in stock if type(m) is torch.nn.Conv2d]
    twins = [m for m in fused if isinstance(m, cukit.nn.Conv2d)]
    assert len(convs) == len(twins) == 2 and len(fused) == len(stock) - 2  # activations fused
    assert all(m.activation == "gelu" for m in twins)
    for a, b in zip(convs, twins, strict=True):
        assert a.weight.shape == b.weight.shape and torch.equal(a.weight, b.weight)
        assert torch.equal(a.bias, b.bias)
    head, fused_head = stock[-1], fused[-1]
    assert isinstance(head, torch.nn.Linear) and isinstance(fused_head, cukit.nn.Linear)
    assert torch.equal(head.weight, fused_head.weight) and torch.equal(head.bias, fused_head.bias)
    assert head.weight.shape == (10, 8 * 64)
    x = torch.randn(5, 64)
    torch.testing.assert_close(fused(x), stock(x), rtol=1e-5, atol=1e-5)
    # the same seed builds the same stock weights
    stock2, old = demo.cnn_models("gelu", channels=(4, 8), seed=3, conv="im2col")
    for p, q in zip(stock.parameters(), stock2.parameters(), strict=True):
        assert torch.equal(p, q)
    # the im2col twin (examples/cnn_matmul_kernels.py) computes the same
    assert sum(isinstance(m, demo.MatmulConv2d) for m in old) == 2
    torch.testing.assert_close(old(x), stock(x), rtol=1e-5, atol=1e-5)


@needs_cnn
@pytest.mark.parametrize(("activation", "padding", "shape"), [
    ("relu", 1, (3, 2, 8, 8)),
    ("silu", 0, (2, 3, 7, 5)),  # no padding, non-square: the output is smaller than the input
    ("gelu_tanh", 2, (1, 1, 4, 6)),
])
def test_matmul_conv2d_matches_conv2d(activation: str, padding: int, shape: tuple[int, ...]) -> None:
    """MatmulConv2d is conv2d + bias + activation, values and gradients (input, weight, bias)."""
    torch.manual_seed(0)
    n, c, h, w = shape
    conv = demo.MatmulConv2d(c, 5, 3, padding=padding, activation=activation)
    x = torch.randn(shape, dtype=torch.float32, requires_grad=True)
    y = conv(x)
    act = demo.torch_activation(activation)
    xr = x.detach().double().requires_grad_()
    wr = conv.weight.detach().double().requires_grad_()
    br = conv.bias.detach().double().requires_grad_()
    yr = act(torch.nn.functional.conv2d(xr, wr, br, padding=padding))
    assert y.shape == yr.shape == (n, 5, h + 2 * padding - 2, w + 2 * padding - 2)
    torch.testing.assert_close(y.double(), yr, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g.double())
    for got, want in ((x.grad, xr.grad), (conv.weight.grad, wr.grad), (conv.bias.grad, br.grad)):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_cnn
def test_cnn_optimizer_is_one_argument() -> None:
    built: list[type] = []

    def sgd(params):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(params, lr=0.05)
        built.append(type(opt))
        return opt

    r = demo.run_cnn(epochs=1, device="cpu", channels=(4,), activation="relu", optimizer=sgd)
    assert built == [torch.optim.SGD, torch.optim.SGD]
    assert r["channels"] == [4] and r["loss_max_abs_diff"] < 1e-4


@needs_cnn
def test_main_prints_cnn_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert "cnn" in demo.EXPERIMENTS
    assert demo.main(["--epochs", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cnn: loss curves agree: yes" in out and "mlp: loss curves agree: yes" in out
    table = [line for line in out.splitlines() if line.startswith(("mlp ", "cnn "))]
    assert [line.split()[:2] for line in table] == [
        ["mlp", "torch"], ["mlp", "cukit"], ["cnn", "torch"], ["cnn", "cukit"]
    ]
    assert "cukit.nn.Conv2d" in out and "nn.Conv2d" in out


def test_cnn_skipped_with_a_note_without_cukit_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "cnn_missing", lambda: "cukit.nn.Conv2d not available")
    opts = demo.DemoOptions(device=torch.device("cpu"), epochs=1)
    r = demo.cnn_experiment(opts)
    assert r.ok and r.rows == [] and "skipped" in r.notes[0]
    with pytest.raises(RuntimeError, match=r"cukit\.nn\.Conv2d"):
        demo.run_cnn(epochs=1, device="cpu")


def test_cnn_bad_arguments() -> None:
    with pytest.raises(ValueError, match="activation"):
        demo.MatmulConv2d(1, 2, 3, activation="tanh")
    if demo.cnn_missing() is None:
        with pytest.raises(ValueError, match="activation"):
            demo.run_cnn(epochs=1, device="cpu", activation="tanh")
        with pytest.raises(ValueError, match="epochs"):
            demo.run_cnn(epochs=0, device="cpu")
        with pytest.raises(ValueError, match="conv must be"):
            demo.cnn_models("relu", conv="unfold")
