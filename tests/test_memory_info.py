"""cukit.memory_info(): the keys and their consistency on the host (CI) and on a GPU (`gpu` marker),
and bad device arguments."""

from __future__ import annotations

import pytest

import cukit

KEYS = {"device", "total_memory", "allocated_memory", "free_memory"}
GPU_KEYS = KEYS | {"torch_allocated", "torch_reserved", "cupy_used", "cupy_total"}


def test_host_figures():
    info = cukit.memory_info("cpu")
    assert set(info) == KEYS and info["device"] == "cpu"
    assert all(isinstance(info[k], int) for k in KEYS - {"device"})
    assert 0 < info["free_memory"] <= info["total_memory"]
    assert 0 < info["allocated_memory"] <= info["total_memory"]  # this process's resident set


def test_default_device_without_gpu_is_the_host():
    if cukit.is_available():
        pytest.skip("a GPU is visible: the default is the current GPU")
    assert cukit.memory_info()["device"] == "cpu"


def test_host_fallbacks(monkeypatch):
    import cukit._memory as m

    monkeypatch.setattr(m, "_meminfo", lambda: {})  # no /proc/meminfo: psutil or sysconf
    info = m.memory_info("cpu")
    assert info["total_memory"] > 0 and info["free_memory"] > 0


@pytest.mark.parametrize(("device", "exc", "msg"), [
    ("tpu", ValueError, "device must be 'cpu', 'cuda' or 'cuda:N'; got 'tpu'"),
    (1.5, TypeError, "device must be None, an int, 'cpu', 'cuda\\[:N\\]' or a torch.device; got float"),
    (True, TypeError, "device must be None, an int.*; got bool"),
    (-1, ValueError, "device must be a CUDA device index in"),
    ("cuda:99", ValueError, "device must be a CUDA device index in"),
])
def test_bad_device(device, exc, msg):
    with pytest.raises(exc, match=f"^cukit.memory_info: {msg}"):
        cukit.memory_info(device)


def test_torch_cpu_device():
    torch = pytest.importorskip("torch")
    assert cukit.memory_info(torch.device("cpu"))["device"] == "cpu"


@pytest.mark.gpu
def test_gpu_figures_follow_allocations():
    import cupy

    torch = pytest.importorskip("torch")
    before = cukit.memory_info(0)
    assert set(before) == GPU_KEYS and before["device"] == 0
    assert 0 < before["free_memory"] <= before["total_memory"]
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    c = cupy.empty(32 << 20, dtype=cupy.uint8)
    after = cukit.memory_info("cuda:0")
    assert after["torch_allocated"] - before["torch_allocated"] >= 64 << 20
    assert after["cupy_used"] - before["cupy_used"] >= 32 << 20
    assert after["allocated_memory"] == after["torch_allocated"] + after["cupy_used"]
    assert after["torch_reserved"] >= after["torch_allocated"] and after["cupy_total"] >= after["cupy_used"]
    assert cukit.memory_info(torch.device("cuda", 0))["device"] == 0
    assert cukit.memory_info()["device"] == cupy.cuda.runtime.getDevice()
    del t, c
