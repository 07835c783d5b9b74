"""The wheel carries the CUDA sources and cukit.optim; the editable install finds them too."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path):
    pytest.importorskip("setuptools")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    (whl,) = tmp_path.glob("cukit-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    cu = {p.name for p in (ROOT / "raw_kernels").glob("*.cu")}
    cuh = {p.name for p in (ROOT / "raw_kernels" / "include" / "cukit").glob("*.cuh")}
    assert {f"cukit/raw_kernels/{n}" for n in cu} <= names
    assert {f"cukit/raw_kernels/include/cukit/{n}" for n in cuh} <= names
    assert "cukit/optim/__init__.py" in names and "cukit/py.typed" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "cukit = cukit.cli:main" in zipfile.ZipFile(whl).read(entry).decode()


def test_editable_layout_resolves():
    import cukit.optim

    from cukit._runtime import include_dir, kernel_dir

    assert (kernel_dir() / "bias_act.cu").is_file()
    assert (include_dir() / "cukit" / "dtypes.cuh").is_file()
    assert cukit.optim.__name__ == "cukit.optim"
