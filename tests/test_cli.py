"""The ``cukit`` command's long-running parts: check-kernels' progress, ``cukit warmup`` and
``cukit bench`` (where its results go). Compiles are stubbed or restricted to a tiny kernel: the
full check is ``make test``'s ``cukit check-kernels``."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cukit import _device, _warmup
from cukit._runtime import KernelCompileError, KernelModule
from cukit.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def _tiny_modules(tmp_path: Path) -> dict[str, KernelModule]:
    """Two small fake kernel files (3 groups), never compiled: compile_offline is stubbed."""
    f = tmp_path / "tiny.cu"
    f.write_text("// never compiled\n")
    a = KernelModule(str(f), instantiations={"float32": ["k<float>", "k<float, 1>"], "steps": ["s<0>"]},
                     signatures={"k": "ptr", "s": "ptr"}, register=False)
    b = KernelModule(str(f), instantiations={"float16": ["k<__half>"]}, signatures={"k": "ptr"}, register=False)
    return {"a.cu": a, "b.cu": b}


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The registry replaced by :func:`_tiny_modules`; each offline compile recorded as (arch, group)."""
    calls: list[tuple[str, str]] = []

    def fake(self: KernelModule, arch: str, groups: Any = None) -> int:
        (group,) = groups
        calls.append((arch, group))
        if group == "float16" and arch == "sm_80":
            raise KernelCompileError(self.file, "k<__half>", "error: no half on this one", arch)
        return len(self.instantiations[group])

    monkeypatch.setattr(_warmup, "all_modules", lambda: _tiny_modules(tmp_path))
    monkeypatch.setattr(KernelModule, "compile_offline", fake)
    return calls


def test_check_kernels_progress_per_architecture(tiny: list[tuple[str, str]],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check-kernels", "--arch", "sm_80,sm_90", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    assert sorted(tiny) == sorted((a, g) for a in ("sm_80", "sm_90") for g in ("float32", "steps", "float16"))
    lines = err.splitlines()
    # stderr is no terminal under pytest: plain lines, a start line and a summary per architecture
    assert lines[0] == "check-kernels sm_80: 0/3 groups (0%), 0 s"
    assert any(ln.startswith("check-kernels sm_80: 1/3 groups (33%)") for ln in lines)
    summaries = [ln.rsplit(" in ", 1)[0] for ln in lines if " in " in ln]
    assert summaries == ["check-kernels sm_80: 3 groups, 3 instantiations compiled, 1 failed",
                         "check-kernels sm_90: 3 groups, 4 instantiations compiled, 0 failed"]
    assert lines.index("check-kernels sm_90: 0/3 groups (0%), 0 s") > lines.index(
        next(ln for ln in lines if ln.startswith("check-kernels sm_80: 3 groups,")))
    assert "FAIL b.cu [float16] sm_80" in err and "no half on this one" in err
    assert out.strip().startswith("check-kernels: compiled 7 instantiations for sm_80,sm_90, 1 failed")


def test_check_kernels_selection_and_errors(tiny: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check-kernels", "--arch", "sm_90", "--dtypes", "float32", "--jobs", "1"]) == 0
    assert sorted(tiny) == [("sm_90", "float32"), ("sm_90", "steps")]  # shared groups come along
    capsys.readouterr()
    assert cli_main(["check-kernels", "--arch", "sm90"]) == 2
    assert "cukit check-kernels: --arch: expected architectures such as sm_80" in capsys.readouterr().err
    assert cli_main(["check-kernels", "--ops", "matmul,convolution"]) == 2
    assert "cukit check-kernels: --ops: unknown op 'convolution'" in capsys.readouterr().err


def test_check_kernels_in_worker_processes(tiny: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]) -> None:
    # forked workers see the parent's (here: stubbed) registry; their results come back in any order
    assert cli_main(["check-kernels", "--arch", "sm_90", "--jobs", "2"]) == 0
    assert "check-kernels sm_90: 3 groups, 4 instantiations compiled, 0 failed" in capsys.readouterr().err


def test_warmup_cli_errors(tiny: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_device, "is_available", lambda: False)
    assert cli_main(["warmup", "--ops", "matmul"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cukit warmup: no CUDA GPU is visible") and "--arch sm_90" in err
    assert cli_main(["warmup", "--ops", "matmul,nope", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert "cukit warmup: --ops: unknown op 'nope'; expected one or more of bias_act, " in err and " matmul," in err
    assert cli_main(["warmup", "--dtypes", "half8", "--arch", "sm_90"]) == 2
    assert "cukit warmup: --dtypes: 'half8' is not a dtype" in capsys.readouterr().err
    assert cli_main(["warmup", "--arch", "sm_80,sm_90"]) == 2
    assert "one architecture at a time" in capsys.readouterr().err
    assert not tiny  # nothing compiled

    assert cli_main(["warmup", "--arch", "sm_80", "--jobs", "1"]) == 1  # the tiny registry: one group fails
    err = capsys.readouterr().err
    assert "cukit warmup sm_80 (offline): 2 groups (3 instantiations) compiled, 1 failed" in err
    assert "cukit warmup: failed to compile" in err and "no half on this one" in err


def test_warmup_cli_offline(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(KernelModule, "compile_offline", lambda self, arch, groups=None: 0)
    assert cli_main(["warmup", "--ops", "bias_act", "--dtypes", "float32", "--arch", "sm_90", "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().startswith("warmup: compiled 33 instantiations (1 group) of bias_act for float32 offline "
                                  "for sm_90 (a compile check: nothing cached) in ")
    assert err.splitlines()[-1].startswith("cukit warmup sm_90 (offline): 1 group (33 instantiations) compiled")


# ---------------------------------------------------------------------------------------------
# cukit bench
# ---------------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_bench_forwards_arguments_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bench_fake.py").write_text(
        "import sys\nprint('argv', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    import sys

    argv, path = list(sys.argv), list(sys.path)
    assert cli_main(["bench", "--dir", str(tmp_path), "fake", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == "argv ['--dry-run']"
    assert cli_main(["bench", "--dir", str(tmp_path), "--out", "R", "fake", "--dry-run", "--fail"]) == 3
    assert capsys.readouterr().out.strip() == "argv ['--out', 'R', '--dry-run', '--fail']"
    assert (sys.argv, sys.path) == (argv, path)  # restored for the caller
    assert cli_main(["bench", "--dir", str(tmp_path), "missing"]) == 2
    assert "bench_missing.py not found" in capsys.readouterr().err


def test_bench_dry_run_writes_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`cukit bench matmul --dry-run` (the cheapest dry run) leaves the committed results alone."""
    pytest.importorskip("torch")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _snapshot(RESULTS)
    assert cli_main(["bench", "--dir", str(REPO / "benchmarks"), "matmul", "--dry-run"]) == 0
    assert _snapshot(RESULTS) == before
    (made,) = [p for p in tmp_path.iterdir() if p.name.startswith("bench_matmul")]
    assert made.name.startswith("bench_matmul-dry-") and (made / "bench_matmul.json").is_file()
    out = capsys.readouterr().out
    assert out.startswith(f"bench_matmul: results go to {made} (a new temporary folder")
    assert out.strip().splitlines()[-1].startswith(f"results: {made / 'bench_matmul.json'}")
    assert cli_main(["bench", "--dir", str(REPO / "benchmarks"), "--out", str(RESULTS), "matmul", "--dry-run"]) == 2
    assert "--dry-run never writes into" in capsys.readouterr().err
    assert _snapshot(RESULTS) == before
