"""Hypothesis profiles and the `gpu` marker.

Profiles: `dev` (default, quick), `ci` (CI=true), `gpu` (make gpu-check), `sanitizer` (few examples:
every launch is slow under compute-sanitizer). Pick one with HYPOTHESIS_PROFILE.
Tests marked `gpu` are skipped when CuPy sees no CUDA device.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import cukit

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("ci", max_examples=40, derandomize=False, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=60, print_blob=True, **_common)
settings.register_profile("sanitizer", max_examples=4, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

GPU = cukit.is_available()

if GPU and os.environ.get("CUKIT_NO_CUPY_POOL"):
    # Under compute-sanitizer: every CuPy array is its own cudaMalloc, so bounds are exact.
    import cupy

    cupy.cuda.set_allocator(None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to CuPy (run `make gpu-check` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return GPU and torch.cuda.is_available()


@pytest.fixture(params=["inductor", "kernels"])
def compile_policy(request: pytest.FixtureRequest):
    """Run a torch.compile test under each compile policy (``cukit.torch.set_compile_policy``):
    cukit ops traced as torch's ops, or kept as ``torch.ops.cukit`` custom ops."""
    import torch

    from cukit.torch import get_compile_policy, set_compile_policy

    old = get_compile_policy()
    set_compile_policy(request.param)
    torch._dynamo.reset()
    yield request.param
    set_compile_policy(old)
    torch._dynamo.reset()
