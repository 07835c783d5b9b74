"""The loader: sources, header digests, typed arguments, caching, compile errors, the first-compile
note, check-kernels."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

from cukit import KernelCompileError, _warmup, cli
from cukit import _runtime as rt
from cukit.cli import main as cli_main

needs_nvrtc = pytest.mark.skipif(
    importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None,
    reason="offline NVRTC needs cuda-bindings (pip install 'cukit[nvrtc]')",
)

GOOD = """
#include <cukit/dtypes.cuh>
template <typename T> __global__ void scale(T* x, long long n, float a) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) x[i] = cukit::from_acc<T>(a * cukit::to_acc<float>(x[i]));
}
"""
BAD = GOOD.replace("x[i] =", "x[i] = undefined_symbol +")


def _module(tmp_path: Path, src: str, **kw) -> rt.KernelModule:
    f = tmp_path / "user_kernel.cu"
    f.write_text(src)
    return rt.KernelModule(
        str(f),
        instantiations={"f32": ["scale<float>"], "f16": ["scale<__half>"]},
        signatures={"scale": "ptr i64 f32"},
        register=False,
        **kw,
    )


def test_sources_ship_with_the_package():
    d = rt.kernel_dir()
    assert (d / "bias_act.cu").is_file()
    for h in ("dtypes.cuh", "vec.cuh", "activations.cuh"):
        assert (rt.include_dir() / "cukit" / h).is_file()


def test_header_edit_changes_the_source_handed_to_nvrtc(tmp_path: Path):
    inc = tmp_path / "include" / "cukit"
    inc.mkdir(parents=True)
    (inc / "a.cuh").write_text("#define A 1\n")
    d1 = rt.headers_digest(tmp_path / "include")
    (inc / "a.cuh").write_text("#define A 2\n")
    d2 = rt.headers_digest(tmp_path / "include")
    assert d1 != d2
    src = "__global__ void k() {}"
    assert rt.prepare_source(src, d1) != rt.prepare_source(src, d2)
    assert rt.prepare_source(src, d1).endswith(src)
    (inc / "b.cuh").write_text("")  # a new header changes it too
    assert rt.headers_digest(tmp_path / "include") != d2


def test_typed_scalars_follow_the_signature():
    out = rt.convert_args("k", ("ptr", "i32", "i64", "f32", "f64"), (1234, 3, 2**40, 0.1, 0.1))
    assert out[0] == 1234
    assert type(out[1]) is np.int32 and type(out[2]) is np.int64
    assert type(out[3]) is np.float32 and out[3] == np.float32(0.1)  # never a Python float (a double)
    assert type(out[4]) is np.float64


def test_typed_scalars_reject_bad_values():
    with pytest.raises(ValueError, match="does not fit in i32"):
        rt.convert_args("k", ("i32",), (2**31,))
    with pytest.raises(TypeError, match="argument 0 is i64"):
        rt.convert_args("k", ("i64",), (1.5,))
    with pytest.raises(TypeError, match="argument 0 is i64"):
        rt.convert_args("k", ("i64",), (True,))
    with pytest.raises(TypeError, match="argument 0 is f32"):
        rt.convert_args("k", ("f32",), ("1.0",))
    with pytest.raises(TypeError, match="takes 2 arguments"):
        rt.convert_args("k", ("ptr", "i64"), (0,))
    with pytest.raises(TypeError, match="is a pointer"):
        rt.convert_args("k", ("ptr",), (1.0,))


def test_pointer_arguments_from_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.zeros(4)
    assert rt.convert_args("k", ("ptr",), (t,)) == (t.data_ptr(),)
    assert rt.convert_args("k", ("ptr",), (None,)) == (0,)


def test_declarations_are_checked(tmp_path: Path):
    with pytest.raises(ValueError, match="no signature declared"):
        rt.KernelModule("x.cu", instantiations={"g": ["other<float>"]}, signatures={"k": "ptr"}, register=False)
    with pytest.raises(ValueError, match="unknown argument kinds"):
        rt.KernelModule("x.cu", instantiations={}, signatures={"k": "ptr f16"}, register=False)
    m = _module(tmp_path, GOOD)
    with pytest.raises(ValueError, match="not a declared instantiation"):
        m.function("scale<double>", 0)


def test_compile_cache_compiles_each_group_once_per_device(tmp_path: Path, monkeypatch):
    m = _module(tmp_path, GOOD)
    calls: list[tuple[str, int]] = []

    def fake_compile(group: str, device: int) -> None:
        calls.append((group, device))
        for e in m.instantiations[group]:
            m._functions[(e, device)] = f"fn:{e}:{device}"

    monkeypatch.setattr(m, "_compile_group", fake_compile)
    assert m.function("scale<float>", 0) == "fn:scale<float>:0"
    assert m.function("scale<float>", 0) == "fn:scale<float>:0"
    m.function("scale<__half>", 0)
    m.function("scale<float>", 1)
    assert calls == [("f32", 0), ("f16", 0), ("f32", 1)]


class _SlowCompiles:
    """A fake compile of `m`'s groups that advances a fake clock by each group's duration."""

    def __init__(self, m: rt.KernelModule, seconds: dict[str, float], monkeypatch) -> None:
        self.m, self.seconds, self.now, self.calls = m, seconds, 0.0, 0
        monkeypatch.setattr(rt, "_clock", lambda: self.now)
        monkeypatch.setattr(m, "_compile_group", self)
        monkeypatch.setattr(rt, "_notice_shown", False)
        monkeypatch.setattr(rt, "_device_arch", lambda device: f"sm_9{device}")
        monkeypatch.delenv("CUKIT_QUIET", raising=False)

    def __call__(self, group: str, device: int) -> None:
        self.calls += 1
        self.now += self.seconds[group]
        for e in self.m.instantiations[group]:
            self.m._functions[(e, device)] = f"fn:{e}:{device}"


def test_first_compile_note_once_and_only_when_slow(tmp_path: Path, monkeypatch, capsys):
    m = _module(tmp_path, GOOD)
    fake = _SlowCompiles(m, {"f32": 0.4, "f16": 3.25}, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note, not a warning: `-W error` runs are unaffected
        m.function("scale<float>", 0)  # under the threshold (a disk-cache hit is milliseconds)
        assert capsys.readouterr().err == ""
        m.function("scale<__half>", 0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cukit: compiled user_kernel.cu [f16] for sm_90 in 3.2 s")
    assert "`cukit warmup`" in err and "CUKIT_QUIET=1" in err
    m.function("scale<__half>", 0)  # in the process's table: no compile
    m.function("scale<__half>", 1)  # another slow compile: the note was shown already
    assert fake.calls == 3 and capsys.readouterr().err == ""


def test_first_compile_note_can_be_silenced(tmp_path: Path, monkeypatch, capsys):
    m = _module(tmp_path, GOOD)
    fake = _SlowCompiles(m, {"f32": 2.0, "f16": 2.0}, monkeypatch)
    monkeypatch.setenv("CUKIT_QUIET", "1")
    m.function("scale<float>", 0)
    monkeypatch.setenv("CUKIT_QUIET", "0")
    with rt.compile_notices_muted():  # what warmup and `cukit info` do around their own compiles
        m.function("scale<__half>", 0)
    assert capsys.readouterr().err == "" and fake.calls == 2
    m.function("scale<float>", 1)  # silenced compiles did not use up the one note
    assert "for sm_91 in 2.0 s" in capsys.readouterr().err


def test_first_compile_note_names_the_target_of_an_arch_specific_module(tmp_path: Path, monkeypatch, capsys):
    assert rt._device_arch(10_000).startswith(("sm_", "GPU 10000"))  # a failed device query does not raise
    m = _module(tmp_path, GOOD, arch="sm_90a")
    _SlowCompiles(m, {"f32": 1.5, "f16": 1.5}, monkeypatch)
    m.function("scale<float>", 0)
    assert "compiled user_kernel.cu[sm_90a] [f32] for sm_90a in 1.5 s" in capsys.readouterr().err


def test_every_declared_instantiation_has_a_signature():
    mods = cli.all_modules()
    assert "bias_act.cu" in mods
    for m in mods.values():
        assert m.all_instantiations()
        for e in m.all_instantiations():
            assert rt._template_name(e) in m._signatures


@needs_nvrtc
def test_offline_compile_of_a_user_kernel(tmp_path: Path):
    m = _module(tmp_path, GOOD)
    assert m.compile_offline("sm_80") == 2


@needs_nvrtc
def test_compile_error_names_file_instantiation_and_log(tmp_path: Path):
    m = _module(tmp_path, BAD)
    with pytest.raises(KernelCompileError) as ei:
        m.compile_offline("sm_90", ["f32"])
    e = ei.value
    assert e.file.endswith("user_kernel.cu")
    assert "scale<float>" in e.instantiation
    assert "undefined_symbol" in e.log
    assert "user_kernel.cu" in str(e) and "scale<float>" in str(e)


@needs_nvrtc
def test_check_kernels_cli_counts_and_fails(tmp_path: Path, capsys, monkeypatch):
    # The CLI over a small registry (`make test` runs the real one over every kernel file).
    good = _module(tmp_path, GOOD)
    monkeypatch.setattr(_warmup, "all_modules", lambda: {"good.cu": good})
    assert cli_main(["check-kernels", "--arch", "sm_80,sm_90"]) == 0
    out = capsys.readouterr().out
    assert "compiled 4 instantiations for sm_80,sm_90, 0 failed" in out
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = _module(bad_dir, BAD)
    monkeypatch.setattr(_warmup, "all_modules", lambda: {"good.cu": good, "user_kernel.cu": bad})
    assert cli_main(["check-kernels", "--arch", "sm_80"]) == 1
    err = capsys.readouterr()
    assert "FAIL user_kernel.cu" in err.err and "2 failed" in err.out


def test_cli_info_runs_without_a_gpu(capsys):
    assert cli_main(["info", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "cukit" in out and "kernels" in out and "bias_act.cu" in out


@pytest.mark.gpu
def test_gpu_compile_error_is_a_kernel_compile_error(tmp_path: Path):
    m = _module(tmp_path, BAD)
    with pytest.raises(KernelCompileError, match="undefined_symbol"):
        m.function("scale<float>", 0)


@pytest.mark.gpu
def test_gpu_user_kernel_launch_with_typed_scalar(tmp_path: Path):
    import cupy

    m = _module(tmp_path, GOOD)
    x = cupy.arange(1000, dtype=cupy.float32)
    m.launch("scale<float>", (4,), (256,), (x, x.size, 0.5), device=0, stream=cupy.cuda.get_current_stream())
    cupy.testing.assert_allclose(x, cupy.arange(1000, dtype=cupy.float32) * 0.5)
    assert m.compiles == 1
    m.launch("scale<float>", (4,), (256,), (x, x.size, 2.0), device=0, stream=cupy.cuda.get_current_stream())
    assert m.compiles == 1  # memoised
    cupy.testing.assert_allclose(x, cupy.arange(1000, dtype=cupy.float32))


@pytest.mark.gpu
def test_gpu_prepared_launch_from_a_fresh_thread():
    """A prepared launch (the driver call) from a thread that has no current CUDA context, as
    torch's autograd worker can be, retries in the device's primary context instead of failing;
    the result matches the main thread's."""
    import threading

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import cukit

    x = torch.randn(64, 48, device="cuda")
    b = torch.randn(48, device="cuda")
    want = cukit.bias_act(x, b, "gelu")  # the plan is built here
    got: list[object] = []

    def worker() -> None:
        try:
            got.append(cukit.bias_act(x, b, "gelu"))
        except BaseException as e:  # surfaced by the assertion below
            got.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    torch.cuda.synchronize()
    assert isinstance(got[0], torch.Tensor), got[0]
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)


def test_launch_without_the_driver_types_scalars_by_the_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libcuda cannot be called directly, a prepared launch goes through CuPy, which would send
    a Python int or float at 8 bytes: the leading arguments are typed by the kernel's signature."""
    monkeypatch.setattr(rt, "_cu_launch_kernel", lambda: None)
    monkeypatch.setattr(rt, "_get_device", lambda: 0)
    seen = []

    def fn(grid: object, block: object, args: tuple, shared_mem: int, stream: object) -> None:
        seen.append(args)

    run = rt.Launch(fn, (4,), (32,), (np.int32(7),), 0, 0, "k", ("ptr", "i32", "f32", "f64", "i64"), ("i32",))
    run((123, 5, 0.5, 0.25, -3), None)
    (args,) = seen
    assert [type(a) for a in args] == [int, np.int32, np.float32, np.float64, np.int64, np.int32]
    assert args[:5] == (123, 5, 0.5, 0.25, -3) and args[5] == 7
