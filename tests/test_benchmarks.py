"""CPU smoke tests of benchmarks/harness.py and of ``bench_bias_act.py --dry-run``, and the rule
every bench follows for where results go (``--out DIR``, else a new temporary folder; never the
committed benchmarks/results/ from a dry run).

The benchmarks run for real only on a GPU (``make gpu-check``); these tests make sure every code
path they take has run somewhere first: the CUDA-event timing loop against a fake ``torch.cuda``,
the perf_counter fallback, validation, failure recording, the time budget and the result files.
A benchmark is never a timed test: nothing here asserts a speed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

torch = pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH_DIR / "results"
BENCHES = ("bench_bias_act", "bench_matmul", "bench_optim", "bench_host", "bench_models", "bench_norm", "bench_glu",
           "bench_rope", "bench_linear_cross_entropy", "bench_linalg", "bench_memory", "bench_per_sample",
           "bench_shampoo")


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Each file's mtime and hash: a run that rewrites a committed result changes one of them."""
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def harness() -> Any:
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("harness")


@pytest.fixture(scope="module")
def bench(harness: Any) -> Any:
    return importlib.import_module("bench_bias_act")


# ---------------------------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------------------------


def test_time_cuda_cpu_fallback_excludes_setup(harness: Any) -> None:
    calls = {"setup": 0, "fn": 0}

    def setup() -> int:
        calls["setup"] += 1
        time.sleep(0.02)  # untimed
        return 7

    def fn(state: int) -> None:
        assert state == 7
        calls["fn"] += 1

    t = harness.time_cuda(fn, warmup=2, repeats=5, flush_l2=True, setup=setup, cuda=False)
    assert calls == {"setup": 7, "fn": 7}
    assert t.method == "perf_counter" and t.repeats == 5 and len(t.times_ms) == 5
    assert not t.flushed_l2  # no flush without CUDA
    assert t.ms < 10.0  # the 20 ms setup is outside the timed region
    assert t.min_ms <= t.p20_ms <= t.ms <= t.p80_ms <= max(t.times_ms)
    assert "times_ms" not in t.summary()
    with pytest.raises(ValueError):
        harness.time_cuda(lambda: None, warmup=0, repeats=0, flush_l2=False, cuda=False)


class _FakeEvent:
    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()
        _FakeEvent.log.append("record")

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "event read before it was recorded"
        return (end.t - self.t) * 1e3


def test_time_cuda_event_path_with_fake_cuda(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of time_cuda, against a fake torch.cuda: per-repeat order is setup, L2
    flush, spin, start event, fn, end event; one sync at the end; events are read after it."""
    log = _FakeEvent.log
    log.clear()

    class FakeBuf:
        def fill_(self, v: int) -> None:
            log.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append("sleep"), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(harness, "_flush_buffer", lambda device: FakeBuf())

    t = harness.time_cuda(lambda s: log.append(f"fn{s}"), warmup=1, repeats=3, flush_l2=True,
                          setup=lambda: (log.append("setup"), 1)[1], cuda=True)
    assert t.method == "cuda-events" and t.flushed_l2 and t.repeats == 3
    assert log[:3] == ["setup", "fn1", "sync"]  # warm-up, then sync
    assert log[3:9] == ["setup", "flush", "sleep", "record", "fn1", "record"]
    assert log[-1] == "sync" and log.count("sync") == 2
    assert all(v >= 0 for v in t.times_ms)


def test_time_cuda_spin_outlasts_the_calls_host_time(harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spin before each timed call lasts longer than the call's host time (measured on the last
    warm-up call), so a slow-to-launch call is still timed on the device; bounded both ways."""
    spins: list[int] = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: spins.append(cycles), raising=False)
    harness.time_cuda(lambda: time.sleep(0.004), warmup=2, repeats=2, flush_l2=False, cuda=True)
    assert len(spins) == 2 and spins[0] >= 1.5 * 0.004 * harness._LEAD_HZ
    spins.clear()
    harness.time_cuda(lambda: None, warmup=1, repeats=1, flush_l2=False, cuda=True)
    assert spins == [harness._HOST_LEAD_CYCLES]  # a quick call keeps the short spin
    spins.clear()
    harness.time_cuda(lambda: None, warmup=0, repeats=1, flush_l2=False, cuda=True)
    assert spins == [harness._HOST_LEAD_CYCLES]  # no warm-up: nothing measured
    assert harness._lead_cycles(10.0) == harness._HOST_LEAD_MAX_CYCLES


def test_host_cost_and_copy_bandwidth_on_cpu(harness: Any) -> None:
    n = {"calls": 0}

    def fn() -> None:
        n["calls"] += 1

    us = harness.host_cost_us(fn, iters=50, rounds=3, warmup=5)
    assert n["calls"] == 5 + 150
    assert 0 < us < 1e4
    bw = harness.copy_bandwidth("cpu", nbytes=1 << 20, warmup=1, repeats=3)
    assert math.isfinite(bw) and bw > 1e6  # bytes per second


def test_check_close(harness: Any) -> None:
    ref = torch.randn(1000, dtype=torch.float64)
    ok = harness.check_close(ref.float(), ref, name="f32")
    assert ok.ok and ok.rel_err < 1e-7 and ok.n_bad == 0
    bad = ref.float().clone()
    bad[17] = float("nan")  # an unwritten (poisoned) element
    with pytest.raises(AssertionError, match="non-finite"):
        harness.check_close(bad, ref)
    res = harness.check_close(ref.float() * 1.01, ref, raise_on_fail=False)
    assert not res.ok and res.rel_err == pytest.approx(0.01, rel=1e-3)
    # tolerances follow the result's dtype: bf16 rounding passes against a float64 reference
    assert harness.check_close(ref.bfloat16(), ref).ok
    # norm-only comparison for baselines that round differently
    assert harness.check_close(ref.float() * 1.001, ref, elementwise=False, rel_tol=2e-3).ok
    with pytest.raises(AssertionError, match="shape"):
        harness.check_close(ref[:10], ref)
    inf_ref = torch.tensor([1.0, float("inf")], dtype=torch.float64)
    assert harness.check_close(inf_ref.float(), inf_ref).ok
    assert not harness.check_close(torch.tensor([1.0, 2.0]), inf_ref, raise_on_fail=False).ok


def test_poison_allocator_never_fails(harness: Any) -> None:
    harness.poison_allocator((4, 8), torch.float32, "cpu")
    harness.poison_allocator(3, torch.int32, "cpu")
    harness.poison_allocator((2,), "not a dtype", "cpu")  # swallowed


def test_fatal_errors_and_short_error(harness: Any) -> None:
    assert harness.is_fatal_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not harness.is_fatal_cuda_error(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    s = harness.short_error(ValueError("x\n" * 500), limit=50)
    assert len(s) == 50 and "\n" not in s and s.startswith("ValueError")


def test_save_run_writes_the_runs_meta_and_records_a_failure(harness: Any, tmp_path: Path) -> None:
    class Run:
        rows: ClassVar[list[dict[str, Any]]] = [{"impl": "x", "ms": 1.0}]
        meta: ClassVar[dict[str, Any]] = {"config": {"seed": 0}}

        def __init__(self) -> None:
            self.failures: list[str] = []

        def elapsed(self) -> float:
            return 2.5

    b = Run()
    saved = harness.save_run(b, "bench_x", tmp_path, {"gpu": None}, meta={"rel_tol": 0.1})
    assert [Path(p).name for p in saved] == ["bench_x.json", "bench_x.csv"] and not b.failures
    doc = json.loads((tmp_path / "bench_x.json").read_text())
    assert doc["meta"] == {"config": {"seed": 0}, "failures": [], "elapsed_s": 2.5, "rel_tol": 0.1}
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert harness.save_run(b, "bench_x", blocker / "sub", {"gpu": None}) == []
    assert len(b.failures) == 1 and b.failures[0].startswith("saving results:")


def test_print_table(harness: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"impl": "cukit", "ms": 0.123456, "n": 4096}, {"impl": "torch.compile", "ms": None, "n": 7}]
    text = harness.print_table(rows, ["impl", ("ms", "time ms"), "n"], title="T")
    assert capsys.readouterr().out.strip() == text.strip()
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["impl", "time", "ms", "n"]
    assert "0.1235" in lines[3] and lines[4].split()[1] == "-"
    assert lines[3].index("4096") + 4 == lines[4].index("7") + 1  # numbers right-aligned


def test_environment_and_save_results(harness: Any, tmp_path: Path) -> None:
    env = harness.environment()
    for key in ("date", "git_commit", "torch", "cukit", "cupy", "gpu", "sm_count", "python"):
        assert key in env
    rows = [
        {"op": "fwd", "dtype": "float32", "numel": 4096, "impl": "a", "gbps": 1.5, "ms": 0.1},
        {"op": "fwd", "dtype": "float32", "numel": 65536, "impl": "a", "gbps": float("nan"), "error": "boom"},
        {"op": "fwd", "dtype": "float32", "numel": 65536, "impl": "b", "gbps": 2.0, "extra": [1, 2]},
    ]
    paths = harness.save_results(rows, "t", tmp_path, env=env, meta={"k": 1},
                                 plot_kwargs={"hline": 3.0, "panels": ("op", "dtype")})
    names = {p.name for p in paths}
    assert {"t.json", "t.csv"} <= names
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["environment"]["git_commit"] == env["git_commit"] and doc["meta"] == {"k": 1}
    assert doc["rows"][1]["gbps"] is None  # NaN is not JSON
    header, *lines = (tmp_path / "t.csv").read_text().splitlines()
    assert header.split(",")[:4] == ["op", "dtype", "numel", "impl"] and len(lines) == 3
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "t.png" not in names
    else:
        assert (tmp_path / "t.png").stat().st_size > 1000


def test_results_dir_rules(harness: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert harness.RESULTS_DIR == RESULTS
    made = Path(harness.results_dir(None, "bench_x"))
    assert made.parent == tmp_path and made.is_dir() and made.name.startswith("bench_x-")
    assert f"bench_x: results go to {made}" in capsys.readouterr().out
    assert Path(harness.results_dir(None, "bench_x", dry_run=True)).name.startswith("bench_x-dry-")
    assert harness.results_dir(tmp_path / "mine", "bench_x", dry_run=True) == str(tmp_path / "mine")
    assert harness.results_dir("-", "bench_x", dry_run=True) == "-"
    assert harness.results_dir(RESULTS, "bench_x") == str(RESULTS)  # a real run, told to: allowed
    for committed in (RESULTS, RESULTS / "sub", BENCH_DIR / "results" / ".." / "results"):
        with pytest.raises(ValueError, match="--dry-run never writes into"):
            harness.results_dir(committed, "bench_x", dry_run=True)
    # a config resolved once keeps its folder (main() resolves, then run() again for direct callers)

    @dataclasses.dataclass
    class Cfg:
        out: str | None = None
        dry_run: bool = True

    resolved = harness.with_results_dir(Cfg(), "bench_x")
    assert Path(resolved.out).parent == tmp_path
    assert harness.with_results_dir(resolved, "bench_x") == resolved
    # save_results without a folder: a temporary one too; "-": nothing
    paths = harness.save_results([{"a": 1}], "t", env={})
    assert paths and paths[0].parent.parent == tmp_path
    assert harness.save_results([{"a": 1}], "t", "-", env={}) == []


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_follows_the_out_rule(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], harness: Any) -> None:
    """Each script's main with its run() stubbed: where the run would write, and the refusals."""
    module = importlib.import_module(name)
    seen: list[str] = []
    monkeypatch.setattr(module, "run", lambda cfg: seen.append(cfg.out))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = snapshot(RESULTS)

    assert module.main(["--dry-run"]) == 0
    (made,) = [p for p in tmp_path.iterdir() if p.name.startswith(module.NAME)]
    assert seen == [str(made)] and made.name.startswith(f"{module.NAME}-dry-")
    assert f"{module.NAME}: results go to {made}" in capsys.readouterr().out
    assert module.main(["--dry-run", "--out", str(tmp_path / "mine")]) == 0
    assert module.main(["--dry-run", "--out", "-"]) == 0
    assert seen[1:] == [str(tmp_path / "mine"), "-"]
    assert module.main(["--dry-run", "--out", str(RESULTS)]) == 2
    assert len(seen) == 3 and "--dry-run never writes into" in capsys.readouterr().err
    assert snapshot(RESULTS) == before


# ---------------------------------------------------------------------------------------------
# bench_bias_act
# ---------------------------------------------------------------------------------------------


def test_configs(bench: Any) -> None:
    full = bench.config_from_args(bench.parse_args([]))
    assert full.device == "cuda" and full.fwd_sizes[-1] == 1 << 28 and full.compile
    quick = bench.config_from_args(bench.parse_args(["--quick"]))
    assert 1 << 26 in quick.fwd_sizes and quick.budget_s < 60
    dry = bench.config_from_args(bench.parse_args(["--dry-run", "--no-compile"]))
    assert dry.device == "cpu" and not dry.compile and max(dry.fwd_sizes) <= 1 << 16
    assert bench.shape_for(4096) == (1, 4096) and bench.shape_for(1 << 26) == (1 << 14, 4096)
    assert bench.fmt_numel(1 << 26) == "64M" and bench.fmt_numel(1000) == "1000"


def test_dry_run(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No --out: the results go to a new temporary folder; the committed ones stay as they were."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = snapshot(RESULTS)
    assert bench.main(["--dry-run"]) == 0
    assert snapshot(RESULTS) == before
    # (torch.compile puts its own caches in the temporary directory too)
    (out_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("bench_bias_act-")]
    assert out_dir.name.startswith("bench_bias_act-dry-")
    out = capsys.readouterr().out
    assert out.startswith(f"bench_bias_act: results go to {out_dir}")
    assert "SUMMARY bench_bias_act" in out and "targets (forward" in out
    tail = out[out.index("SUMMARY"):]
    assert "small-call host cost" in tail and "results:" in tail.splitlines()[-1]  # summary is last
    assert str(out_dir / "bench_bias_act.json") in tail.splitlines()[-1]
    doc = json.loads((out_dir / "bench_bias_act.json").read_text())
    assert (out_dir / "bench_bias_act.csv").exists()
    assert set(p.name for p in out_dir.iterdir()) <= {"bench_bias_act.json", "bench_bias_act.csv",
                                                      "bench_bias_act.png"}
    rows = doc["rows"]
    ops = {r["op"] for r in rows}
    assert ops == {"copy", "host", "fwd", "bwd"}
    for r in rows:  # every row either has its measurement or says why not
        assert r.get("error") or r.get("gbps") or r.get("us_per_call"), r
    # the torch baselines must validate and time on any machine
    for r in rows:
        if r["op"] in ("fwd", "bwd") and r["impl"] in ("torch", "torch.compile"):
            assert r.get("error") is None, r
            assert r["ms"] > 0 and r["timing"] == "perf_counter" and r["speedup_vs_torch"] > 0
    acts = {r["activation"] for r in rows if r["op"] == "fwd"}
    assert acts == set(bench.ACTIVATIONS)
    assert {r["impl"] for r in rows if r["op"] == "bwd"} >= {"cukit", "cukit-autograd", "torch"}
    assert doc["environment"]["device"] in ("cpu", "cuda")


def test_failures_are_recorded_not_fatal(bench: Any, harness: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raising implementation, a raising compile and a spent budget each leave error rows and
    the rest of the run goes on."""
    import cukit

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel exploded")

    cfg = bench.config_from_args(bench.parse_args(["--dry-run"]))
    b = bench.Bench(cfg)
    groups: dict[Any, Any] = {}
    monkeypatch.setattr(cukit, "bias_act", boom)
    broken = bench.CompileGroup(bench.EAGER["gelu"], "eager")
    broken.error = "RuntimeError: no compiler"
    groups[("fwd", "float32", "gelu")] = broken
    bench.run_forward_case(b, "float32", "gelu", 4096, True, groups)
    by_impl = {r["impl"]: r for r in b.rows}
    assert "kernel exploded" in by_impl["cukit"]["error"]
    assert "compile failed earlier" in by_impl["torch.compile"]["error"]
    assert by_impl["torch"].get("error") is None and by_impl["torch"]["ms"] > 0
    assert len(b.failures) == 2

    # a wrong result is caught by validation, not timed
    monkeypatch.setattr(cukit, "bias_act", lambda x, bias, act: torch.zeros_like(x))
    b2 = bench.Bench(cfg)
    bench.run_forward_case(b2, "bfloat16", "gelu", 4096, False, {})
    wrong = next(r for r in b2.rows if r["impl"] == "cukit")
    assert "AssertionError" in wrong["error"] and "ms" not in wrong

    # a spent budget skips the remaining cases with a reason
    b3 = bench.Bench(dataclasses.replace(cfg, budget_s=1.0))
    b3.t0 -= 10
    bench.run_backward_case(b3, "float32", "gelu", 4096, False, {})
    assert b3.rows and all("time budget" in r["error"] for r in b3.rows)

    # a lost CUDA context stops further launches
    b4 = bench.Bench(cfg)
    b4.fail({"op": "fwd"}, RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert b4.skip_reason() and "CUDA context" in b4.skip_reason()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
def test_dry_run_sizes_on_gpu(bench: Any, tmp_path: Path) -> None:
    """On a GPU (make gpu-check): the tiny sizes through the real CUDA paths (events, L2 flush,
    CuPy rows), and cukit's kernels must validate."""
    assert bench.main(["--dry-run", "--device", "cuda", "--no-compile", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_bias_act.json").read_text())
    errors = [(r["op"], r["impl"], r.get("error")) for r in doc["rows"] if r.get("error")]
    assert not errors, errors
    timed = [r for r in doc["rows"] if r["op"] in ("fwd", "bwd")]
    assert timed and all(r["timing"] == "cuda-events" and r["flushed_l2"] for r in timed)
