"""Smoke tests of benchmarks/bench_models.py and benchmarks/bench_host.py: their ``--dry-run`` on the
CPU end to end into a temporary folder (JSON/CSV with the documented columns, summary printed last),
the loss-curve / noise-floor / target bookkeeping on made-up rows, failure recording, and (marked
`gpu`) the tiny configs through the real CUDA paths. A benchmark is never a timed test: nothing here
asserts a speed.

The cukit side of bench_models needs ``cukit.nn.patch``: when it is missing the patched rows fail
and so does :func:`test_models_dry_run_demo_models`, by design (the benchmark uses no stand-in).
On the CPU, the autocast rows of the cukit side are allowed to fail (cukit's autocast rules may be
CUDA-only); the GPU test requires every row.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"

MODEL_COLUMNS = {
    "model", "setting", "mode", "precision", "impl", "params", "cukit_modules", "batch", "tokens_per_step",
    "ms", "ms_p20", "ms_p80", "ms_min", "first_step_s", "samples_per_s", "tokens_per_s", "loss_first",
    "loss_last", "losses", "speedup", "loss_rel_diff", "noise_floor",
}
HOST_COLUMNS = {
    "op", "dtype", "pass", "shape", "torch_call", "cukit_call", "torch_us", "cukit_us", "ratio", "target",
    "verdict", "torch_device_us", "cukit_device_us", "bound", "rel_err",
}


def _import(name: str) -> Any:
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def models() -> Any:
    return _import("bench_models")


@pytest.fixture(scope="module")
def host() -> Any:
    return _import("bench_host")


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


def _load(out: Path, name: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    doc = json.loads((out / f"{name}.json").read_text())
    with (out / f"{name}.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(doc["rows"])
    return doc, csv_rows


def _summary_is_last(out: str, title: str) -> str:
    assert f"SUMMARY {title}" in out
    tail = out[out.rindex(f"SUMMARY {title}"):]
    assert tail.strip().splitlines()[-1].startswith("results: ")
    return tail


# ---------------------------------------------------------------------------------------------
# bench_models
# ---------------------------------------------------------------------------------------------


def test_models_dry_run_demo_models(models: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo MLP and CNN in all four settings: every torch row trains, the cukit rows of the
    pure-bf16 settings train too (patch present), the files carry the documented columns."""
    assert models.main(["--dry-run", "--models", "mlp,cnn", "--out", str(tmp_path)]) == 0
    tail = _summary_is_last(capsys.readouterr().out, "bench_models")
    assert "demo MLP/CNN cukit >= 1.0x" in tail and "Llama-style decoder" in tail
    name = "bench_models-mlp-cnn"  # a subset of the models: its own files
    assert {p.name for p in tmp_path.iterdir()} <= {f"{name}.json", f"{name}.csv", f"{name}.png"}
    doc, csv_rows = _load(tmp_path, name)
    rows = doc["rows"]
    assert doc["meta"]["complete"] and doc["environment"]["device"] in ("cpu", "cuda")
    expected = {(m, s, i) for m in ("mlp", "cnn") for s in models.SETTINGS for i in models.IMPLS[m]}
    assert {(r["model"], r["setting"], r["impl"]) for r in rows} == expected
    missing = MODEL_COLUMNS - set(csv_rows[0])  # the CSV header is the union of the rows' keys
    assert not missing, missing
    steps = doc["meta"]["config"]["steps"]
    for r in rows:
        if r["impl"] == "torch":
            assert r.get("error") is None, r
            assert r["ms"] > 0 and r["speedup"] == 1.0 and r["loss_rel_diff"] == 0.0
            assert len(r["losses"]) == steps and r["cukit_modules"] == 0
        else:
            assert r.get("error") or r["ms"] > 0, r  # numbers, or why not
    failed_bf16 = {(r["model"], r["setting"], r["impl"]): r["error"] for r in rows
                   if r["precision"] == "bf16" and r.get("error")}
    assert not failed_bf16, failed_bf16  # fails loudly while cukit.nn.patch is missing
    patched = [r for r in rows if r["impl"] == "cukit" and r["precision"] == "bf16"]
    assert all(r["cukit_modules"] > 0 and r["params"] > 0 for r in patched)
    # the loss curves start from the same weights and data: the first loss agrees closely
    first = {(r["model"], r["setting"]): r["loss_first"] for r in rows if r["impl"] == "torch"}
    for r in patched:
        assert abs(r["loss_first"] - first[(r["model"], r["setting"])]) < 5e-2 * abs(r["loss_first"])
    for r in rows:  # the noise floor needs torch eager and compiled of one precision
        assert r["noise_floor"] is not None


def test_models_dry_run_hf_models(models: Any, tmp_path: Path) -> None:
    """Llama and GPT-2 (tiny configs) when transformers is importable; a clear skip row each otherwise."""
    args = ["--dry-run", "--models", "llama,gpt2", "--settings", "eager-bf16,compile-bf16", "--out", str(tmp_path)]
    assert models.main(args) == 0
    doc, _ = _load(tmp_path, "bench_models-llama-gpt2-eager-bf16-compile-bf16")
    rows = doc["rows"]
    assert {(r["model"], r["setting"], r["impl"]) for r in rows} == {
        (m, s, i) for m in ("llama", "gpt2") for s in ("eager-bf16", "compile-bf16") for i in ("torch", "cukit")}
    if not _has_transformers():
        assert all(r["error"].startswith("skipped: transformers is not importable") for r in rows)
        return
    errors = [(r["model"], r["setting"], r["impl"], r.get("error")) for r in rows if r.get("error")]
    assert not errors, errors
    for r in rows:
        assert r["tokens_per_step"] == 2 * 32 and r["tokens_per_s"] > 0
        assert r["noise_floor"] is not None and r["loss_rel_diff"] is not None
    assert all(r["cukit_modules"] > 0 for r in rows if r["impl"] == "cukit")


def test_models_dry_run_defaults_to_a_temporary_folder(models: Any) -> None:
    cfg = models.config_from_args(models.parse_args(["--dry-run", "--models", "mlp", "--settings", "eager-bf16"]))
    assert cfg.device == "cpu" and cfg.out is None and cfg.compile_backend == "eager" and cfg.steps == 4
    with _import("harness").one_cpu_thread(cfg.device):
        b = models.run(cfg)
    try:
        out = Path(b.cfg.out)
        assert out.is_relative_to(Path(tempfile.gettempdir()))
        assert not out.is_relative_to(Path(models.harness.RESULTS_DIR))
        assert (out / "bench_models-mlp-eager-bf16.json").exists()
    finally:
        shutil.rmtree(b.cfg.out, ignore_errors=True)


def test_models_config(models: Any) -> None:
    full = models.config_from_args(models.parse_args([]))
    assert full.device == "cuda" and full.steps >= 30 and full.budget_s > 0
    assert full.models == models.MODELS and full.settings == models.SETTINGS
    assert models.results_name(full) == "bench_models"
    cuda_dry = models.config_from_args(models.parse_args(["--dry-run", "--device", "cuda"]))
    assert cuda_dry.device == "cuda" and cuda_dry.compile_backend == "inductor"
    assert full.compile_kwargs() == {"backend": "inductor"}
    with pytest.raises(SystemExit):
        models.config_from_args(models.parse_args(["--models", "resnet"]))
    off = models.config_from_args(models.parse_args(["--models", "llama", "--patch-off", "lm_head_loss, rope"]))
    assert off.patch_off == ("lm_head_loss", "rope")
    assert models.results_name(off) == "bench_models-llama-off-lm_head_loss-rope"
    with pytest.raises(SystemExit, match="unknown rule"):
        models.config_from_args(models.parse_args(["--patch-off", "lm_head"]))
    assert full.backward_thread == "worker"  # torch's default
    assert full.interleave > 0  # a setting's impls side by side by default
    alone = models.config_from_args(models.parse_args(["--models", "mlp", "--interleave", "0"]))
    assert alone.interleave == 0 and models.results_name(alone) == "bench_models-mlp-alone"
    with pytest.raises(SystemExit, match="interleave"):
        models.config_from_args(models.parse_args(["--interleave", "-1"]))
    caller = models.config_from_args(models.parse_args(["--models", "mlp", "--backward-thread", "caller"]))
    assert caller.backward_thread == "caller" and models.results_name(caller) == "bench_models-mlp-backward-caller"


def test_patch_off_switches_the_rules_off(models: Any) -> None:
    pytest.importorskip("transformers")
    tf = models._transformers()
    cfg = tf.LlamaConfig(**models.LLAMA_TINY)
    on = models.count_cukit_modules(models.cukit_patch(tf.LlamaForCausalLM(cfg)))
    off = models.count_cukit_modules(models.cukit_patch(tf.LlamaForCausalLM(cfg), off=("rms_norm",)))
    assert on - off == 2 * models.LLAMA_TINY["num_hidden_layers"] + 1  # the RMSNorms


def test_interleaved_cases_train_as_they_would_alone(models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Side by side (blocks of 2 steps, order alternating) each model still sees its own batches in
    order: the loss curves equal those of the cases trained one after another. An impl that fails
    mid-run leaves an error row and the others finish."""
    args = ["--dry-run", "--models", "mlp", "--settings", "eager-bf16", "--steps", "7", "--warmup", "2"]
    curves = {}
    for interleave in ("2", "0"):
        cfg = models.config_from_args(models.parse_args([*args, "--interleave", interleave]))
        with _import("harness").one_cpu_thread(cfg.device):
            rows = models.run_model(models.Bench(cfg), "mlp")
        assert all(r.get("error") is None and r["timed_steps"] == 5 for r in rows), rows
        curves[interleave] = {r["impl"]: r["losses"] for r in rows}
    assert curves["2"] == curves["0"] and len(curves["2"]) == len(models.IMPLS["mlp"])

    real = models.make_optimizer

    def failing_late(impl: str, params: list[Any], lr: float) -> Any:
        opt = real(impl, params, lr)
        if impl == "cukit":
            calls = []

            def late(*_: Any) -> None:
                calls.append(1)
                if len(calls) == 4:
                    raise RuntimeError("step 4 exploded")

            opt.register_step_pre_hook(late)
        return opt

    monkeypatch.setattr(models, "make_optimizer", failing_late)
    cfg = models.config_from_args(models.parse_args([*args, "--interleave", "2"]))
    with _import("harness").one_cpu_thread(cfg.device):
        rows = models.run_model(models.Bench(cfg), "mlp")
    by = {r["impl"]: r for r in rows}
    assert "step 4 exploded" in by["cukit"]["error"]
    assert by["torch"]["losses"] == curves["0"]["torch"] and by["cukit-demo"]["losses"] == curves["0"]["cukit-demo"]


def test_a_missing_optional_baseline_is_a_skip_row(models: Any) -> None:
    """Without liger_kernel, llama8's Liger rows say they were skipped and why; the others train."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger_kernel is installed")
    cfg = models.config_from_args(models.parse_args(["--dry-run", "--models", "llama8", "--settings", "eager-bf16"]))
    with _import("harness").one_cpu_thread(cfg.device):
        rows = models.run_model(models.Bench(cfg), "llama8")
    by = {r["impl"]: r for r in rows}
    assert by["liger"]["error"].startswith("skipped: liger_kernel is not importable"), by["liger"]
    assert by["torch"].get("error") is None and by["cukit"].get("error") is None


def _row(model: str, setting: str, impl: str, ms: float | None, losses: list[float] | None) -> dict[str, Any]:
    mode, precision = setting.split("-")
    r: dict[str, Any] = {"model": model, "setting": setting, "mode": mode, "precision": precision, "impl": impl}
    if ms is not None:
        r.update(ms=ms, losses=losses)
    return r


def test_loss_bookkeeping_and_targets(models: Any) -> None:
    assert models.loss_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert models.loss_rel_diff([1.0, float("nan")], [1.0, 2.0]) == float("inf")
    assert models.loss_rel_diff([1.0], [1.0, 2.0]) is None and models.loss_rel_diff(None, [1.0]) is None

    base = [10.0, 8.0, 6.0]
    rows: list[dict[str, Any]] = []
    for s in models.SETTINGS:
        compiled = s.startswith("compile")
        torch_curve = [v * (1.001 if compiled else 1.0) for v in base]  # eager vs compiled: 1e-3
        rows += [_row("llama", s, "torch", 10.0, torch_curve),
                 _row("llama", s, "cukit", 8.0, [v * 1.0015 for v in torch_curve])]
        rows += [_row("mlp", s, "torch", 1.0, base), _row("mlp", s, "cukit", 0.5, base),
                 _row("cnn", s, "torch", 1.0, base), _row("cnn", s, "cukit", 1.25, base)]
    for m in ("llama", "mlp", "cnn"):
        mrows = [r for r in rows if r["model"] == m]
        for s in models.SETTINGS:
            models.compare_setting([r for r in mrows if r["setting"] == s])
        models.noise_floors(mrows)
    llama = [r for r in rows if r["model"] == "llama" and r["impl"] == "cukit"]
    assert all(r["speedup"] == pytest.approx(1.25) for r in llama)
    assert all(r["noise_floor"] == pytest.approx(1e-3) and r["within_noise"] for r in llama)  # 1.5e-3 <= 2x
    cfg = models.Config(models=("llama", "mlp", "cnn"))
    lines = models.target_lines(rows, cfg)
    assert lines[0].startswith("  [PASS] Llama-style decoder")
    demo = next(line for line in lines if "demo MLP/CNN" in line)
    assert demo.startswith("  [FAIL]")  # the CNN is 0.8x
    # a cukit loss curve outside the margin fails the Llama target even when faster
    for r in llama:
        r["within_noise"] = False
    assert models.target_lines(rows, cfg)[0].startswith("  [FAIL]")
    # a missing setting is a FAIL, a model not selected is n/a
    assert models.target_lines([], cfg)[0].startswith("  [FAIL]")
    assert models.target_lines([], models.Config(models=("gpt2",)))[0].startswith("  [n/a ]")


def test_models_failures_are_recorded_not_fatal(models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raising case leaves an error row and the others run; a lost CUDA context or a spent budget
    skips what follows, with the reason."""
    cfg = models.config_from_args(models.parse_args(["--dry-run", "--settings", "eager-bf16,eager-amp"]))
    real = models.make_optimizer

    def flaky(impl: str, params: list[Any], lr: float) -> Any:
        if impl == "cukit-demo":
            raise RuntimeError("optimizer exploded")
        return real(impl, params, lr)

    monkeypatch.setattr(models, "make_optimizer", flaky)
    b = models.Bench(cfg)
    with _import("harness").one_cpu_thread(cfg.device):
        rows = models.run_model(b, "mlp")
    by = {(r["setting"], r["impl"]): r for r in rows}
    assert "optimizer exploded" in by[("eager-bf16", "cukit-demo")]["error"]
    assert by[("eager-bf16", "torch")].get("error") is None and by[("eager-amp", "torch")]["ms"] > 0
    assert any("optimizer exploded" in f for f in b.failures)

    b2 = models.Bench(cfg)
    b2.fail({"model": "x"}, RuntimeError("CUDA error: an illegal memory access was encountered"))
    rows2 = models.run_model(b2, "cnn")
    assert rows2 and all("CUDA context" in r["error"] for r in rows2)

    b3 = models.Bench(models.Config(**{**vars(cfg), "budget_s": 1.0}))
    b3.t0 -= 10
    assert all("time budget" in r["error"] for r in models.run_model(b3, "mlp"))
    b4 = models.Bench(models.Config(**{**vars(cfg), "budget_s": 100.0}))
    assert "predicted" in b4.skip_reason(estimate_s=1000.0)


# ---------------------------------------------------------------------------------------------
# bench_host
# ---------------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_host_dry_run(host: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No --out: a new temporary folder; benchmarks/results/ (committed) is left as it was."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _snapshot(BENCH_DIR / "results")
    assert host.main(["--dry-run"]) == 0
    assert _snapshot(BENCH_DIR / "results") == before
    (out_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("bench_host-dry-")]
    tail = _summary_is_last(capsys.readouterr().out, "bench_host")
    assert "numbers mean nothing" in tail and "target: cukit host cost <= 1.5x" in tail
    assert {p.name for p in out_dir.iterdir()} == {"bench_host.json", "bench_host.csv"}
    doc, csv_rows = _load(out_dir, "bench_host")
    rows = doc["rows"]
    missing = HOST_COLUMNS - set(csv_rows[0])
    assert not missing, missing
    cases = {(r["op"], r["dtype"], r["pass"]) for r in rows}
    expected = {(op, d, p) for op in host.OPS for d in ("float32", "bfloat16") for p in host.PASSES}
    expected |= {(op, "float32+autocast", p) for op in host.AUTOCAST_OPS for p in host.PASSES}
    assert cases == expected and len(rows) == len(expected)
    for r in rows:
        if r["dtype"] in ("float32", "bfloat16"):  # cukit's CPU path must run and match torch
            assert r.get("error") is None, r
        if r.get("error") is None:
            assert r["torch_us"] > 0 and r["cukit_us"] > 0 and r["torch_device_us"] > 0
            assert r["ratio"] == pytest.approx(r["cukit_us"] / r["torch_us"])
            assert r["verdict"] == ("PASS" if r["ratio"] <= 1.5 else "FAIL")


def test_host_case_checks_output_dtype(host: Any) -> None:
    """A cukit call that ignores autocast (float32 out where torch gives bfloat16) fails the check,
    so its host time is not compared with a cheaper bfloat16 call's."""
    cfg = host.config_from_args(host.parse_args(["--dry-run"]))
    case = host.build_case(cfg, "linear", "float32", "fwd")
    case.out_dtypes = (torch.bfloat16, torch.float32)
    with pytest.raises(AssertionError, match="dtype"):
        host.check(case, cfg)
    ok = host.build_case(cfg, "bias_act", "float32", "fwd+bwd")
    assert host.check(ok, cfg) < 1e-5


# ---------------------------------------------------------------------------------------------
# On a GPU (make gpu-check)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
def test_models_tiny_on_gpu(models: Any, tmp_path: Path) -> None:
    """Tiny configs of every model on the GPU through cukit's kernels; torch.compile with the
    aot_eager backend (dynamo + AOTAutograd over cukit's fake and autograd registrations, without
    inductor's minutes of codegen). Every row must train and carry its memory figures."""
    args = ["--dry-run", "--device", "cuda", "--settings", "eager-bf16,eager-amp,compile-amp",
            "--compile-backend", "aot_eager", "--out", str(tmp_path)]
    assert models.main(args) == 0
    doc, _ = _load(tmp_path, "bench_models-eager-bf16-eager-amp-compile-amp")
    rows = doc["rows"]
    skipped_hf = {"llama", "gpt2"} if not _has_transformers() else set()
    no_liger = "skipped: liger_kernel is not importable"  # an optional baseline, not on every GPU machine
    errors = [(r["model"], r["setting"], r["impl"], r.get("error")) for r in rows
              if r.get("error") and r["model"] not in skipped_hf and not r["error"].startswith(no_liger)]
    assert not errors, errors
    for r in rows:
        if r["model"] not in skipped_hf and not (r.get("error") or "").startswith(no_liger):
            assert r["peak_mib"] > 0 and r["state_mib"] > 0 and r["ms"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
def test_host_on_gpu(host: Any, tmp_path: Path) -> None:
    assert host.main(["--iters", "20", "--rounds", "2", "--out", str(tmp_path)]) == 0
    doc, _ = _load(tmp_path, "bench_host")
    errors = [(r["op"], r["dtype"], r["pass"], r.get("error")) for r in doc["rows"] if r.get("error")]
    assert not errors, errors
    assert all(r["cukit_device_us"] > 0 and r["bound"] in ("host", "device?") for r in doc["rows"])
