"""Every script in examples/ runs: on the CPU with its small settings (here, so that none can rot),
and at full size on a GPU (``pytest -m gpu``, ``make gpu-check``). Each run must exit with status
0, which every example uses to say that its variants agree, and print its table.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
CPU_TIMEOUT_S = 180  # each takes seconds; this only bounds a hang on a loaded machine
GPU_TIMEOUT_S = 300


@dataclass(frozen=True)
class Example:
    cpu_args: tuple[str, ...]  # the small settings
    expect: tuple[str, ...]  # text the output must contain (the table's header, the verdict)
    needs: tuple[str, ...] = ("torch",)  # modules the script imports
    gpu_args: tuple[str, ...] = ("--device", "cuda")  # full size


EXAMPLES: dict[str, Example] = {
    "bias_act_vs_torch.py": Example(
        ("--device", "cpu", "--small"), ("fwd+bwd ms", "saved MiB", "outputs and gradients agree within", ": yes")
    ),
    "optimizer_launches.py": Example(
        ("--device", "cpu", "--small"), ("launches", "pred 4KB", "cukit.optim", "agree with the for-loop's: yes")
    ),
    "cnn_matmul_kernels.py": Example(
        ("--device", "cpu", "--small"), ("cukit v1", "cukit simt", "cukit tc", "GEMM TFLOP/s")
    ),
    "numpy_cupy_arrays.py": Example(
        ("--device", "cpu", "--small"),
        ("numpy.ndarray", "within 1e-04: yes", "torch imported by this NumPy-only run: no"),
        needs=(),
    ),
    "sync_free_training.py": Example(
        ("--device", "cpu", "--steps", "10"), ("syncs/step", "1 naive", "2 RunningMean + NonFiniteGuard")
    ),
    "mlp_digits.py": Example(
        ("--device", "cpu", "--small"), ("loss torch.optim", "loss cukit.optim", "loss curves agree"),
        needs=("torch", "sklearn"),
    ),
}
# What the full-size GPU run must print where it differs from the CPU run's (default: the same).
GPU_EXPECT: dict[str, tuple[str, ...]] = {
    "numpy_cupy_arrays.py": ("cupy.ndarray", "within 1e-04: yes", "cukit.to_torch(cupy array)"),
    "sync_free_training.py": ("syncs/step", "1 naive", "4 + CUDA graph (capture_step)"),
}


def scripts() -> list[str]:
    return sorted(p.name for p in EXAMPLES_DIR.glob("*.py") if not p.name.startswith("_"))


def run(name: str, args: tuple[str, ...], timeout: int, expect: tuple[str, ...]) -> str:
    example = EXAMPLES[name]
    for module in example.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}")
    # One CPU thread unless asked otherwise: on a busy 2-core CI machine torch's OpenMP threads
    # spin against the other processes and a small run takes several times longer.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, str(EXAMPLES_DIR / name), *args]
    try:
        proc = subprocess.run(cmd, cwd=EXAMPLES_DIR, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s:\n{e.stdout or ''}{e.stderr or ''}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    for text in expect:
        assert text in proc.stdout, f"{name}: {text!r} missing from the output:\n{proc.stdout}"
    return proc.stdout


def test_every_example_is_tested() -> None:
    assert scripts() == sorted(EXAMPLES), "add the new example to EXAMPLES (its small CPU arguments)"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_says_what_and_how(name: str) -> None:
    """A module docstring that says what the example shows and the command that runs it."""
    doc = ast.get_docstring(ast.parse((EXAMPLES_DIR / name).read_text(encoding="utf-8")))
    assert doc and len(doc.splitlines()) >= 3, f"{name}: no module docstring"
    assert f"python examples/{name}" in doc, f"{name}: the docstring does not say how to run it"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_small_on_the_cpu(name: str) -> None:
    run(name, EXAMPLES[name].cpu_args, CPU_TIMEOUT_S, EXAMPLES[name].expect)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_full_size_on_the_gpu(name: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    # the GPU run prints its own lines (the CPU-only run's "no torch imported" check, for one, is
    # not made where torch provides the zero-copy views)
    run(name, EXAMPLES[name].gpu_args, GPU_TIMEOUT_S, GPU_EXPECT.get(name, EXAMPLES[name].expect))


def test_device_cuda_without_a_gpu_is_a_usage_error() -> None:
    """``--device cuda`` where no GPU is usable exits with status 2 and says why (the shared option
    handling in examples/_common.py)."""
    sys.path.insert(0, str(EXAMPLES_DIR))
    try:
        import _common
    finally:
        sys.path.remove(str(EXAMPLES_DIR))
    if _common.gpu_available():
        pytest.skip("a GPU is usable here")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "bias_act_vs_torch.py"), "--device", "cuda"],
        capture_output=True, text=True, timeout=CPU_TIMEOUT_S,
    )
    assert proc.returncode == 2 and "--device cuda" in proc.stderr, proc.stderr
