"""CPU smoke tests of ``benchmarks/bench_matmul.py`` (``--dry-run``: tiny sizes, torch CPU tensors,
cukit.matmul's torch fallback, perf_counter timing). The benchmark runs for real only on a GPU;
these make sure its code paths (planning, validation, failure rows, targets, result files) have
run somewhere first. Nothing here asserts a speed."""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _matmul_missing() -> str | None:
    try:
        import cukit
    except Exception as e:  # pragma: no cover
        return f"cukit does not import: {e}"
    missing = [n for n in ("matmul", "linear") if not hasattr(cukit, n)]
    return f"cukit.{' and cukit.'.join(missing)} not available (issue 3)" if missing else None


needs_matmul = pytest.mark.skipif(_matmul_missing() is not None, reason=str(_matmul_missing()))


@pytest.fixture(scope="module")
def bench() -> Any:
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("bench_matmul")


@pytest.fixture(scope="module")
def dry_cfg(bench: Any) -> Any:
    return bench.config_from_args(bench.parse_args(["--dry-run"]))


def test_configs_and_plan(bench: Any) -> None:
    full = bench.config_from_args(bench.parse_args([]))
    assert full.device == "cuda" and full.budget_s == 200 and full.flush_l2
    cases = bench.plan(full)
    keys = [c.key() for c in cases]
    assert len(keys) == len(set(keys))
    # the targets run first
    head = [c for c in cases if c.headline]
    assert cases[: len(head)] == head
    assert [(c.mode, c.shape_label) for c in head] == [
        ("fp32", "4096^3"), ("bf16", "4096^3"), ("bf16", "8192^3"), ("bf16", "1024x1024x1024"),
        ("bf16", "8192x768x768"), ("bf16", "4096x4096x1024"), ("bf16", "4097x4095x4093"),
        ("bf16", "8192x16384x4096")]
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        squares = sorted(c.M for c in cases if c.mode == mode and c.kind == "square" and c.impls[0] == "cukit")
        # bf16 1024^3 runs once, as the in-model headline case
        assert squares == ([256, 512, 2048, 4096, 8192] if mode == "bf16" else [256, 512, 1024, 2048, 4096, 8192])
        assert any(c.mode == mode and (c.M, c.N, c.K) == (4097, 4095, 4093) for c in cases)
        assert any(c.mode == mode and (c.M, c.N, c.K) == (32768, 1024, 1024) for c in cases)
    batched = [c for c in cases if c.kind == "batched"]
    assert [(c.mode, c.batch, c.M) for c in batched] == [("bf16", 64, 512)]
    assert batched[0].flops == 2 * 64 * 512**3
    assert {c.mode for c in cases if c.op == "linear"} == {"bf16", "fp32"}
    v1 = [c for c in cases if c.impls[0] == "cukit simt_v1"]
    assert [c.M for c in v1] == [1024, 2048, 4096] and all(c.mode == "fp32" for c in v1)
    # the weight-gradient section: fp32 and bf16, each shape once per mode
    dw = [(c.mode, (c.M, c.N, c.K)) for c in cases if c.kind == "dw"]
    assert dw == [(m, s) for m in ("fp32", "bf16") for s in bench.Config().dw]
    assert all(c.M * c.N < 4096 * 4096 and c.K >= 4096 for c in cases if c.kind == "dw")

    quick = bench.config_from_args(bench.parse_args(["--quick"]))
    assert quick.budget_s < 90
    qcases = bench.plan(quick)
    assert [c.shape_label for c in qcases if c.headline][:7] == [
        "4096^3", "4096^3", "8192^3", "1024x1024x1024", "8192x768x768", "4096x4096x1024", "4097x4095x4093"]
    assert len(qcases) < len(cases) / 2

    dry = bench.config_from_args(bench.parse_args(["--dry-run", "--modes", "bf16,fp32", "--budget-s", "5"]))
    assert dry.device == "cpu" and not dry.flush_l2 and dry.modes == ("bf16", "fp32") and dry.budget_s == 5
    assert all(max(c.M, c.N, c.K) <= 64 for c in bench.plan(dry))
    with pytest.raises(SystemExit):
        bench.config_from_args(bench.parse_args(["--modes", "int8"]))


def test_reference_rows(bench: Any, dry_cfg: Any) -> None:
    full = bench.config_from_args(bench.parse_args([]))
    assert bench.reference_rows(1024, full) is None
    rows = bench.reference_rows(4097, full)
    assert rows == sorted(set(rows)) and 256 < len(rows) <= 512
    assert rows[:128] == list(range(128)) and rows[-128:] == list(range(4097 - 128, 4097))
    assert bench.reference_rows(9, dry_cfg) is not None  # the dry run exercises the subsample path
    a = torch.randn(2, 9, 5, dtype=torch.float64)
    b = torch.randn(2, 5, 4, dtype=torch.float64)
    sub = bench.reference_rows(9, dry_cfg)
    torch.testing.assert_close(bench.reference_matmul(a, b, sub), (a @ b)[:, sub])


def test_validate(bench: Any) -> None:
    a, b = torch.randn(40, 30), torch.randn(30, 20)
    ref = bench.reference_matmul(a, b, None)
    assert bench.validate(a @ b, ref, None, 1e-5, "ok") < 1e-5
    poisoned = (a @ b).clone()
    poisoned[39, 19] = float("nan")  # an unwritten element outside the validated rows
    with pytest.raises(AssertionError, match="non-finite"):
        bench.validate(poisoned, ref[:8], list(range(8)), 1e-5, "nan")
    with pytest.raises(AssertionError, match="relative error"):
        bench.validate((a @ b) * 1.01, ref, None, 1e-5, "wrong")
    # bf16 output rounding passes the bf16 bound, not the fp32 one
    ab, bb = a.bfloat16(), b.bfloat16()
    refb = bench.reference_matmul(ab, bb, None)
    assert bench.validate(ab @ bb, refb, None, 1e-2, "bf16") < 1e-2
    with pytest.raises(AssertionError):
        bench.validate(ab @ bb, refb, None, 1e-5, "bf16 strict")


def test_precision_mode_restores_flags(bench: Any) -> None:
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    with bench.precision_mode(bench.MODES["tf32"]):
        assert flags.allow_tf32
    with bench.precision_mode(bench.MODES["fp32"]):
        assert not flags.allow_tf32
    with bench.precision_mode(bench.MODES["bf16"]):
        assert flags.allow_tf32 == before
    assert flags.allow_tf32 == before


def test_failures_are_recorded_not_fatal(bench: Any, dry_cfg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import cukit

    case = bench.Case("matmul", "fp32", 12, 10, 8)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(cukit, "matmul", boom, raising=False)
    b = bench.Bench(dry_cfg)
    rows = {r["impl"]: r for r in bench.run_case(b, case)}
    assert "kernel exploded" in rows["cukit"]["error"] and "ms" not in rows["cukit"]
    assert rows["cuBLAS"].get("error") is None and rows["cuBLAS"]["ms"] > 0 and rows["cuBLAS"]["tflops"] > 0
    assert len(b.failures) == 1

    # a wrong result is caught by validation, not timed
    monkeypatch.setattr(cukit, "matmul", lambda a, b, **kw: torch.matmul(a, b) * 1.001, raising=False)
    b2 = bench.Bench(dry_cfg)
    wrong = next(r for r in bench.run_case(b2, case) if r["impl"] == "cukit")
    assert "relative error" in wrong["error"] and "ms" not in wrong

    # precision= reaches cukit.matmul for float32 modes only
    seen: list[dict[str, Any]] = []

    def spy(a: Any, b: Any, **kw: Any) -> Any:
        seen.append(kw)
        return torch.matmul(a, b)

    monkeypatch.setattr(cukit, "matmul", spy, raising=False)
    for mode in ("fp32", "tf32", "bf16"):
        seen.clear()
        r = next(r for r in bench.run_case(bench.Bench(dry_cfg), bench.Case("matmul", mode, 9, 7, 5))
                 if r["impl"] == "cukit")
        assert r.get("error") is None and r["vs_cublas"] > 0
        assert r.get("tf32_seen") is (False if mode == "tf32" else None)  # the CPU has no TF32
        assert seen and all(kw == ({"precision": bench.MODES[mode].precision} if mode != "bf16" else {})
                            for kw in seen)

    # a spent budget skips the remaining cases with a reason
    b3 = bench.Bench(dry_cfg)
    b3.cfg = type(dry_cfg)(**{**vars(dry_cfg), "budget_s": 1.0})
    b3.t0 -= 10
    assert all("time budget" in r["error"] for r in bench.run_case(b3, case))

    # a lost CUDA context stops further launches
    b4 = bench.Bench(dry_cfg)
    b4.fail({"op": "matmul"}, RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert b4.skip_reason() and "CUDA context" in b4.skip_reason()


def test_missing_front_end_fails_clearly(bench: Any, dry_cfg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import cukit

    monkeypatch.delattr(cukit, "matmul", raising=False)
    monkeypatch.delattr(cukit, "linear", raising=False)
    b = bench.Bench(dry_cfg)
    rows = bench.run_case(b, bench.Case("matmul", "bf16", 8, 8, 8))
    rows += bench.run_case(b, bench.Case("linear", "bf16", 8, 6, 4, kind="linear",
                                         impls=("cukit.linear", "torch eager")))
    by = {r["impl"]: r for r in rows}
    assert "cukit.matmul is not available" in by["cukit"]["error"]
    assert "cukit.linear is not available" in by["cukit.linear"]["error"]
    assert by["cuBLAS"]["ms"] > 0 and by["torch eager"]["ms"] > 0


def test_kernel_hook(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The private kernel hook is looked up by name and called with kernel=; a module without
    one gives an AttributeError that says what it does have."""
    calls: list[dict[str, Any]] = []

    def _matmul_gpu(a: Any, b: Any, *, kernel: str | None = None, precision: str | None = None) -> Any:
        calls.append({"kernel": kernel, "precision": precision})
        return torch.matmul(a, b)

    fake = types.ModuleType("cukit.ops.matmul")
    fake._matmul_gpu = _matmul_gpu  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cukit.ops.matmul", fake)
    import cukit.ops

    monkeypatch.setattr(cukit.ops, "matmul", fake, raising=False)
    hook = bench.kernel_hook("simt_v1")
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(hook(a, b), a @ b)
    assert calls == [{"kernel": "simt_v1", "precision": "ieee"}]
    fn = bench.make_matmul("cukit simt_v1", bench.MODES["fp32"], a, b)
    torch.testing.assert_close(fn(), a @ b)

    empty = types.ModuleType("cukit.ops.matmul")
    monkeypatch.setitem(sys.modules, "cukit.ops.matmul", empty)
    monkeypatch.setattr(cukit.ops, "matmul", empty, raising=False)
    with pytest.raises(AttributeError, match="no kernel hook"):
        bench.kernel_hook("simt_v1")


def test_target_lines(bench: Any) -> None:
    full = bench.config_from_args(bench.parse_args([]))

    def row(op: str, mode: str, shape: tuple[int, int, int], impl: str, **kw: Any) -> dict[str, Any]:
        return {"op": op, "mode": mode, "M": shape[0], "N": shape[1], "K": shape[2], "batch": 1, "impl": impl, **kw}

    rows = [
        row("matmul", "fp32", (4096,) * 3, "cukit", vs_cublas=0.95),
        row("matmul", "bf16", (4096,) * 3, "cukit", vs_cublas=0.70),
        row("matmul", "bf16", (8192, 768, 768), "cukit", vs_cublas=0.91),
        row("matmul", "bf16", (4096, 4096, 1024), "cukit", vs_cublas=0.89),
        row("matmul", "bf16", (4097, 4095, 4093), "cukit", error="AssertionError: boom"),
        row("linear", "bf16", full.linear, "cukit.linear", vs_torch=1.25),
    ]
    lines = bench.target_lines(rows, full)
    text = "\n".join(lines)
    assert len(lines) == 8
    assert lines[0].split()[0] == "PASS" and "4096^3" in lines[0]
    assert lines[1].split()[0] == "FAIL" and "0.700x" in lines[1]
    assert lines[2].split()[0] == "NOT" and "8192^3" in lines[2]
    assert lines[3].split()[0] == "NOT" and "1024x1024x1024 (per call)" in lines[3]
    assert lines[4].split()[0] == "PASS" and "8192x768x768" in lines[4] and "(target >= 0.9x)" in lines[4]
    assert lines[5].split()[0] == "FAIL" and "0.890x" in lines[5]
    assert lines[6].split()[0] == "FAIL" and "boom" in lines[6]
    assert lines[7].split()[0] == "PASS" and "linear" in lines[7]
    assert "(info)" not in text
    lines = bench.target_lines([*rows, row("linear", "fp32", full.linear, "cukit.linear", vs_torch=1.01)], full)
    assert "(info)" in lines[-1] and "1.010x" in lines[-1]


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir()) if p.is_file()}


@needs_matmul
def test_dry_run(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No --out: a new temporary folder; benchmarks/results/ (committed) is left as it was."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _snapshot(BENCH_DIR / "results")
    assert bench.main(["--dry-run"]) == 0
    assert _snapshot(BENCH_DIR / "results") == before
    (out_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("bench_matmul-dry-")]
    out = capsys.readouterr().out
    tail = out[out.index("SUMMARY bench_matmul"):]
    assert "targets (dry run" in tail and "all cases validated and timed" in tail
    assert tail.splitlines()[-1].startswith(f"results: {out_dir}")  # the summary is last
    assert set(p.name for p in out_dir.iterdir()) <= {"bench_matmul.json", "bench_matmul.csv",
                                                      "bench_matmul.png"}
    assert (out_dir / "bench_matmul.csv").exists()
    doc = json.loads((out_dir / "bench_matmul.json").read_text())
    rows = doc["rows"]
    errors = [(r["op"], r["mode"], r["shape"], r["impl"], r.get("error")) for r in rows if r.get("error")]
    assert not errors, errors
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["timing"] == "perf_counter"
        assert r["rel_err"] <= doc["meta"]["rel_tol"][r["mode"]]
        for key in ("dtype", "precision", "M", "N", "K", "batch", "impl"):
            assert key in r
        if r["impl"] == "cukit":
            assert r["vs_cublas"] > 0
        if r["impl"] == "cukit.linear":
            assert r["vs_torch"] > 0
    assert {r["mode"] for r in rows} == {"fp32", "tf32", "bf16", "fp16"}
    assert {r["kind"] for r in rows} == {"square", "medium", "odd", "tall", "batched", "linear", "dw"}
    assert any(r.get("ref_rows", 0) < r["M"] for r in rows)  # the row subsample was exercised
    for line in tail.splitlines():
        if line.startswith("  ") and "(target >=" in line:
            assert line.split()[0] in ("PASS", "FAIL")  # every target ran at its dry-run size


@pytest.mark.gpu
@needs_matmul
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
def test_dry_run_sizes_on_gpu(bench: Any, tmp_path: Path) -> None:
    """On a GPU (make gpu-check): the tiny sizes through the real CUDA paths (events, L2 flush, the
    kernel hook's simt_v1 rows, the TMA widths forced on compute capability 9.0); every cukit
    kernel must validate."""
    assert bench.main(["--dry-run", "--device", "cuda", "--tiles", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_matmul.json").read_text())
    hopper = torch.cuda.get_device_capability() == (9, 0)
    errors = [(r["mode"], r["shape"], r["impl"], r.get("error")) for r in doc["rows"] if r.get("error")
              and (hopper or not r["impl"].startswith(bench.TILE_PREFIX))]
    assert not errors, errors
    rows = [r for r in doc["rows"] if not r.get("error")]
    if hopper:
        assert {r["impl"] for r in rows if r["kind"] == "tiles"} == {*bench.TILE_IMPLS, "cukit", "cuBLAS"}
    assert all(r["timing"] == "cuda-events" and r["flushed_l2"] for r in rows)
    assert any(r["impl"] == "cukit simt_v1" for r in rows)


def test_tiles_section(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--tiles adds section 6 (the TMA kernel forced to each width at the calibration shapes); on a
    device without the TMA kernel its rows say skipped and the run has no failure."""
    full = bench.config_from_args(bench.parse_args(["--tiles"]))
    tiles = [c for c in bench.plan(full) if c.kind == "tiles"]
    assert [(c.M, c.N, c.K) for c in tiles] == list(full.tile_shapes)
    assert all(c.impls == (*bench.TILE_IMPLS, "cukit", "cuBLAS") and c.mode == "bf16" for c in tiles)
    assert bench.TILE_IMPLS == ("cukit tma256", "cukit tma192", "cukit tma128", "cukit tma64")
    assert not [c for c in bench.plan(bench.config_from_args(bench.parse_args([]))) if c.kind == "tiles"]
    assert not [c for c in bench.plan(bench.config_from_args(bench.parse_args(["--tiles", "--modes", "fp32"])))
                if c.kind == "tiles"]
    dry = bench.config_from_args(bench.parse_args(["--dry-run", "--tiles", "--modes", "bf16"]))
    (case,) = [c for c in bench.plan(dry) if c.kind == "tiles"]
    b = bench.Bench(dry)
    rows = bench.run_case(b, case)
    assert [r["impl"] for r in rows] == [*bench.TILE_IMPLS, "cukit", "cuBLAS"]
    n = len(bench.TILE_IMPLS)
    for r in rows[:n]:
        assert r["error"].startswith("skipped: the TMA kernel runs on compute capability 9.0")
    assert all(r.get("ms") for r in rows[n:]) and not b.failures


def test_tile_lines(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"kind": "tiles", "M": 1024, "N": 1024, "K": 1024, "impl": impl, "ms": ms}
            for impl, ms in (("cukit tma256", 0.0192), ("cukit tma128", 0.0139), ("cukit tma64", 0.0112),
                             ("cukit", 0.0112), ("cuBLAS", 0.0096))]
    rows.append({"kind": "tiles", "M": 8192, "N": 768, "K": 768, "impl": "cukit tma128", "ms": 0.024})
    rows.append({"kind": "tiles", "M": 8192, "N": 768, "K": 768, "impl": "cukit tma64", "ms": 0.0276})
    rows.append({"kind": "tiles", "M": 64, "N": 64, "K": 64, "impl": "cukit tma64", "error": "skipped"})
    monkeypatch.setattr(bench, "TILE_PICKS", {(1024, 1024, 1024): 64, (8192, 768, 768): 64})
    lines = bench.tile_lines(rows)
    assert lines == [
        "  1024x1024x1024: 256: 19.2  128: 13.9  64: 11.2  cuBLAS 9.6  fastest 64  model picks it",
        "  8192x768x768: 128: 24.0  64: 27.6  fastest 128  model picks 64 (+15.0%)",
    ]
    assert bench.tile_lines([]) == []
