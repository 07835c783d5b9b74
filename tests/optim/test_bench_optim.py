"""CPU smoke test of benchmarks/bench_optim.py --dry-run: every row validated and timed, results
written. A benchmark is never a timed test: nothing here asserts a speed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def test_dry_run_writes_validated_rows(tmp_path: Path) -> None:
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    bench = importlib.import_module("bench_optim")
    assert len(bench.gpt2_small_shapes()) == 148
    assert sum(int(__import__("math").prod(s)) for s in bench.gpt2_small_shapes()) == 124_439_808
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_optim.json").read_text())
    rows = doc["rows"]
    assert rows and not [r for r in rows if r.get("error")]
    assert {r["opt"] for r in rows} >= {"AdamW", "SGD", "Lion", "LAMB", "AdamW +clip+scaler"}
    steps = [r for r in rows if "final_loss" not in r]
    assert all(r["host_us"] > 0 and r["ms"] > 0 for r in steps)
    # the low-bit part: every optimizer beside its baselines, state bytes, and the training run
    assert {r["opt"] for r in rows} >= {"AdamW8bit", "Adam8bit", "AdamW4bit", "Lion8bit", "SGD8bit"}
    assert all(r["state_bytes_per_param"] > 0 for r in steps if r["opt"].endswith("bit"))
    trained = [r for r in rows if "final_loss" in r]
    assert {r["impl"] for r in trained} >= {"cukit AdamW8bit", "torch AdamW", "cukit SGD8bit"}
    assert all(abs(r["loss_vs_fp32"]) < 0.05 for r in trained)
