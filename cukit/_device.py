"""Device queries: is a GPU usable, what is it, how much memory is in use."""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

__all__ = ["DeviceCaps", "device_caps", "device_info", "is_available", "sm_count"]


class DeviceCaps(NamedTuple):
    """What kernel choice and launch configuration read from a device."""

    cc: int  # compute capability as 10 * major + minor (90 for H100/H200)
    sm_count: int  # multiprocessors
    smem_optin: int  # bytes of shared memory one block may opt in to


@functools.lru_cache(maxsize=1)
def is_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device (kernels can run)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=64)
def device_caps(device: int) -> DeviceCaps:
    """Compute capability, SM count and opt-in shared memory of a device, read once per device
    (``cudaGetDeviceProperties`` costs tens of microseconds; launches read these every call)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    return DeviceCaps(
        cc=10 * int(props["major"]) + int(props["minor"]),
        sm_count=int(props["multiProcessorCount"]),
        smem_optin=int(props.get("sharedMemPerBlockOptin", 0)),
    )


def sm_count(device: int) -> int:
    """Number of multiprocessors of a device (sizes persistent grids)."""
    return device_caps(device).sm_count


def device_info(device: int | None = None) -> dict[str, Any]:
    """What cukit runs on: GPU name, compute capability, SM count, memory total/free, and the bytes
    held by torch's and CuPy's memory pools. ``{"available": False, ...}`` without a GPU."""
    info: dict[str, Any] = {"available": is_available()}
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as e:  # not installed or broken install
        info["cupy"] = None
        info["reason"] = f"CuPy unavailable: {e}"
    if not info["available"]:
        info.setdefault("reason", "no CUDA device visible to CuPy")
        return info
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device is None else device
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    with cupy.cuda.Device(dev):
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        info.update(
            device=dev,
            name=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
            compute_capability=f"{props['major']}.{props['minor']}",
            sm_count=int(props["multiProcessorCount"]),
            l2_bytes=int(props["l2CacheSize"]),
            shared_mem_per_block_optin=int(props.get("sharedMemPerBlockOptin", 0)),
            memory_total=int(total),
            memory_free=int(free),
            cupy_pool_used=int(pool.used_bytes()),
            cupy_pool_total=int(pool.total_bytes()),
            cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
            cuda_driver=cupy.cuda.runtime.driverGetVersion(),
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        info["torch_allocated"] = int(torch.cuda.memory_allocated(dev))
        info["torch_reserved"] = int(torch.cuda.memory_reserved(dev))
    return info
