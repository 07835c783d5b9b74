"""``cukit.warmup`` and its machinery (cukit/_warmup.py): choosing groups by op and dtype, argument
errors, the progress line, and both compile paths with the compiler stubbed out (the real offline
compile is exercised by ``cukit check-kernels`` and test_runtime; the real GPU path by ``cukit info``
in ``make gpu-check``)."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import pytest

import cukit
from cukit import _device, _warmup
from cukit import _runtime as rt
from cukit._runtime import KernelCompileError, KernelModule


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Every offline compile as (file, arch, group), without compiling."""
    calls: list[tuple[str, str, str]] = []

    def fake(self: KernelModule, arch: str, groups: Any = None) -> int:
        calls.extend((self.key, arch, g) for g in groups)
        return sum(len(self.instantiations[g]) for g in groups)

    monkeypatch.setattr(KernelModule, "compile_offline", fake)
    return calls


# ---------------------------------------------------------------------------------------------
# Choosing groups
# ---------------------------------------------------------------------------------------------


def test_op_names_aliases_and_errors() -> None:
    assert _warmup.parse_ops(None) is None
    assert _warmup.parse_ops("matmul, Linear,bias_act") == ["matmul", "bias_act"]
    assert _warmup.parse_ops(["AdamW", "clip_grad_norm_"]) == ["adam", "multi_tensor_l2norm"]
    with pytest.raises(ValueError) as e:
        _warmup.parse_ops(["matmul", "matmull"])
    msg = str(e.value)
    assert msg.startswith("cukit.warmup: ops: unknown op 'matmull'")
    assert "bias_act" in msg and "linear (= matmul)" in msg and "got ['matmul', 'matmull']" in msg
    with pytest.raises(ValueError, match="cukit warmup: --ops: no op given"):
        _warmup.parse_ops("", where="cukit warmup: --ops")
    with pytest.raises(ValueError, match="unknown op 3"):
        _warmup.parse_ops([3])  # type: ignore[list-item]


def test_dtype_names_and_errors() -> None:
    torch = pytest.importorskip("torch")
    assert _warmup.parse_dtypes(None) is None
    assert _warmup.parse_dtypes("bfloat16,float32") == ["bfloat16", "float32"]
    assert _warmup.parse_dtypes([torch.float16, np.float64, "float16"]) == ["float16", "float64"]
    for bad in ("int32", "bf16"):
        with pytest.raises(ValueError) as e:
            _warmup.parse_dtypes(["float32", bad])
        msg = str(e.value)
        assert msg.startswith(f"cukit.warmup: dtypes: '{bad}' is not a dtype the kernels are built for")
        assert "float16, bfloat16, float32, float64" in msg and f"got ['float32', '{bad}']" in msg


def test_arch_names() -> None:
    assert _warmup.parse_archs("sm_80, sm_90a") == ["sm_80", "sm_90a"]
    for bad in ("sm90", "", "compute_90", "sm_80,90"):
        with pytest.raises(ValueError, match="expected architectures such as sm_80"):
            _warmup.parse_archs(bad)


def test_ops_table_covers_every_kernel_file() -> None:
    files = {os.path.basename(m.file) for m in _warmup.all_modules().values()}
    listed = {f for fs in _warmup.OPS.values() for f in fs}
    assert listed == files  # a new kernel file needs an op here, a renamed one its new name


def test_plan_selects_by_op_dtype_and_arch() -> None:
    jobs = _warmup.plan("sm_90", ["bias_act"], ["float32"])
    assert [(j.module, j.group, j.arch, j.size) for j in jobs] == [("bias_act.cu", "float32", "sm_90", 33)]

    sm80 = _warmup.plan("sm_80", ["matmul"], ["bfloat16"])
    sm90 = _warmup.plan("sm_90", ["matmul"], ["bfloat16"])
    assert {j.module for j in sm80} == {"matmul_tc.cu", "repack.cu"}  # no bfloat16 SIMT kernels
    assert {j.module for j in sm90} == {"matmul_tc.cu", "matmul_tc.cu[sm_90a]", "repack.cu"}
    assert all(j.group.startswith("bfloat16/") or j.group == "u16" for j in sm90)
    assert [j.size for j in sm90] == sorted((j.size for j in sm90), reverse=True)  # largest first

    adam = {(j.module, j.group) for j in _warmup.plan("sm_80", _warmup.parse_ops("adamw"), ["float32"])}
    assert ("adam.cu", "steps") in adam and ("multi_tensor_l2norm.cu", "reduce") in adam  # shared groups
    assert ("adam.cu", "float32/bfloat16") in adam and ("adam.cu", "bfloat16/float32") not in adam

    everything = _warmup.plan("sm_90")
    assert len(everything) == sum(len(m.instantiations) for m in _warmup.all_modules().values())


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_on_a_terminal_rewrites_one_line() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = _warmup.Progress("check-kernels sm_90", 3, stream=out, tty=True, clock=clock)
    clock.t += 5
    bar.advance(detail="bias_act.cu [float32]")
    clock.t += 70
    bar.advance(detail="x.cu [f16]", failed=True)
    bar.advance(detail="y.cu [f32]")
    bar.finish("3 groups, 0 failed in 1m15s")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, rewritten with \r
    frames = text.split("\r")[1:]
    assert frames[0].startswith("check-kernels sm_90: 0/3 groups (0%), 0 s")
    assert frames[1].startswith("check-kernels sm_90: 1/3 groups (33%), 5 s  bias_act.cu [float32]")
    assert frames[2].startswith("check-kernels sm_90: 2/3 groups (66%), 1m15s, 1 failed  x.cu [f16]")
    assert frames[3].rstrip().endswith("3/3 groups (100%), 1m15s, 1 failed  y.cu [f32]")
    assert len(frames[3]) >= len(frames[2].rstrip())  # a shorter line blanks the longer one's tail
    assert frames[4].startswith("check-kernels sm_90: 3 groups, 0 failed in 1m15s")


def test_progress_in_a_log_prints_about_ten_lines() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = _warmup.Progress("warmup", 300, stream=out, tty=False, clock=clock)
    for i in range(300):
        clock.t += 0.5 if i != 40 else 31.0  # one slow step: a line after 30 s of silence
        bar.advance(detail="never shown in a log")
    bar.finish()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and not any("never shown" in ln for ln in lines)
    assert lines[0] == "warmup: 0/300 groups (0%), 0 s"
    assert lines[-1].startswith("warmup: 300/300 groups (100%)")
    assert 10 <= len(lines) <= 13, lines
    assert any(ln.startswith("warmup: 41/300 groups") for ln in lines)  # the 30 s line


def test_progress_can_be_silent() -> None:
    out = io.StringIO()
    bar = _warmup.Progress("x", 2, stream=out, enabled=False)
    bar.advance()
    bar.finish()
    assert out.getvalue() == ""


# ---------------------------------------------------------------------------------------------
# warmup()
# ---------------------------------------------------------------------------------------------


def test_warmup_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"cukit\.warmup: ops: unknown op 'nope'.*got \['nope'\]"):
        _warmup.warmup(ops="nope", arch="sm_90")
    with pytest.raises(ValueError, match=r"cukit\.warmup: dtypes: 'int64' is not a dtype"):
        _warmup.warmup(dtypes=["int64"], arch="sm_90")
    with pytest.raises(ValueError, match=r"cukit\.warmup: arch: expected architectures"):
        _warmup.warmup(arch="90")
    with pytest.raises(ValueError, match="one architecture at a time"):
        _warmup.warmup(arch="sm_80,sm_90")
    with pytest.raises(ValueError, match=r"cukit\.warmup: jobs: expected an integer >= 1; got 0"):
        _warmup.warmup(arch="sm_90", jobs=0)
    monkeypatch.setattr(_device, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"no CUDA GPU is visible.*arch='sm_90'"):
        _warmup.warmup(ops="matmul")


def test_warmup_offline_with_progress(compiled: list[tuple[str, str, str]], capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUKIT_QUIET", raising=False)
    done = _warmup.warmup(ops="bias_act,bias_act_backward", dtypes=["float32", "float64"], arch="sm_80")
    assert sorted(compiled) == [("bias_act.cu", "sm_80", "float32"), ("bias_act.cu", "sm_80", "float64")]
    assert (done.arch, done.groups, done.instantiations, done.offline, done.device) == ("sm_80", 2, 66, True, None)
    err = capsys.readouterr().err.splitlines()  # stderr is not a terminal here: plain lines
    assert err[0] == "cukit warmup sm_80 (offline): 0/2 groups (0%), 0 s"
    assert err[-1].startswith("cukit warmup sm_80 (offline): 2 groups (66 instantiations) compiled in ")

    monkeypatch.setenv("CUKIT_QUIET", "1")  # no progress unless asked for
    _warmup.warmup(ops="bias_act", dtypes="float16", arch="sm_90")
    assert capsys.readouterr().err == ""


def test_warmup_offline_failure_raises_the_compile_error(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def fake(self: KernelModule, arch: str, groups: Any = None) -> int:
        if groups == ["float16"]:
            raise KernelCompileError(self.file, "bias_act_fwd<__half, 0, 8, int>", "error: boom", arch)
        return 1

    monkeypatch.setattr(KernelModule, "compile_offline", fake)
    with pytest.raises(KernelCompileError, match="boom") as e:
        _warmup.warmup(ops="bias_act", arch="sm_90", progress=True)
    assert e.value.arch == "sm_90"
    assert "3 groups (99 instantiations) compiled, 1 failed" in capsys.readouterr().err


def test_warmup_on_a_gpu_goes_through_the_loader(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU path with the device and the loader's compile stubbed: one ``function`` call per
    group (it compiles the group), on the chosen device, first-compile notes muted."""
    calls: list[tuple[str, str, int, int]] = []

    def fake_function(self: KernelModule, name_expr: str, device: int) -> str:
        calls.append((self.key, name_expr, device, rt._notice_mute.depth))
        return "fn"

    monkeypatch.setattr(_device, "is_available", lambda: True)
    monkeypatch.setattr(_device, "device_caps", lambda d: _device.DeviceCaps(cc=90, sm_count=132, smem_optin=232448))
    monkeypatch.setattr(_warmup, "_current_device", lambda: 1)
    monkeypatch.setattr(KernelModule, "function", fake_function)
    done = _warmup.warmup(ops=["bias_act"], dtypes=["float16"], progress=True)
    assert calls == [("bias_act.cu", "bias_act_fwd<__half, 0, 8, int>", 1, 1)]
    assert (done.arch, done.device, done.offline, done.instantiations) == ("sm_90", 1, False, 33)
    assert "cukit warmup sm_90 (GPU 1): 1 group (33 instantiations) compiled" in capsys.readouterr().err

    calls.clear()
    _warmup.warmup(ops="matmul", dtypes="bfloat16", device=0, progress=False)
    assert {c[0] for c in calls} == {"matmul_tc.cu", "matmul_tc.cu[sm_90a]", "repack.cu"}
    assert {c[2] for c in calls} == {0}


@pytest.mark.skipif(not hasattr(cukit, "warmup"), reason="cukit/__init__.py does not export warmup yet")
def test_warmup_is_exported() -> None:
    assert cukit.warmup is _warmup.warmup and "warmup" in cukit.__all__
