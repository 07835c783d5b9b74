"""Devices for cukit.optim's tests: "cpu" runs the plain-torch reference path everywhere; "cuda"
runs the kernels and is marked `gpu` (skipped without a CUDA GPU, see tests/conftest.py)."""

from __future__ import annotations

import pytest

import cukit

torch = pytest.importorskip("torch")

GPU = cukit.is_available() and torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")]),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param
