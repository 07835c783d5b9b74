"""``cukit.memory_info()``: device (or host) memory in one dict, the caching pools' figures included."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["memory_info"]


def memory_info(device: Any = None) -> dict[str, Any]:
    """Memory figures of a GPU, or of the host, in bytes.

    Args:
        device: None (the current CUDA device when CuPy sees one, else the host), an int or
            "cuda:N" / "cuda" / a torch.device (a GPU), or "cpu" (the host).

    Returns:
        On a GPU: ``device`` (the index), ``total_memory`` and ``free_memory`` (``cudaMemGetInfo``:
        free is what the driver can still hand out, so it counts the pools' cached blocks as used),
        ``allocated_memory`` (bytes in live tensors and arrays: torch's allocated plus CuPy's pool's
        used bytes), ``torch_allocated`` / ``torch_reserved`` (``torch.cuda.memory_allocated`` /
        ``memory_reserved``; 0 when torch is not imported or sees no GPU), ``cupy_used`` /
        ``cupy_total`` (the default pool's ``used_bytes`` / ``total_bytes``; 0 after
        ``cukit.use_torch_allocator()``, whose arrays torch's figures count).
        On the host: ``device`` "cpu", ``total_memory`` (physical RAM), ``free_memory`` (available:
        /proc/meminfo's MemAvailable, else free pages), ``allocated_memory`` (this process's
        resident set size), from /proc or ``os.sysconf``, psutil when installed.

    Nothing here synchronises a stream or allocates device memory.

    See also: ``torch.cuda.mem_get_info``, ``torch.cuda.memory_stats``, ``cupy.get_default_memory_pool``.
    """
    dev = _device_index(device)
    if dev is None:
        return _host_info()
    import cupy

    with cupy.cuda.Device(dev):
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        cupy_used, cupy_total = int(pool.used_bytes()), int(pool.total_bytes())
    torch_allocated = torch_reserved = 0
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and dev < torch.cuda.device_count():
        torch_allocated = int(torch.cuda.memory_allocated(dev))
        torch_reserved = int(torch.cuda.memory_reserved(dev))
    return {
        "device": dev,
        "total_memory": int(total),
        "allocated_memory": torch_allocated + cupy_used,
        "free_memory": int(free),
        "torch_allocated": torch_allocated,
        "torch_reserved": torch_reserved,
        "cupy_used": cupy_used,
        "cupy_total": cupy_total,
    }


def _device_index(device: Any) -> int | None:
    """The CUDA device index that `device` names, None for the host; ValueError/TypeError otherwise."""
    fn = "cukit.memory_info"
    if device is None:
        from cukit._device import is_available

        if not is_available():
            return None
        import cupy

        return int(cupy.cuda.runtime.getDevice())
    if isinstance(device, bool):
        raise TypeError(f"{fn}: device must be None, an int, 'cpu', 'cuda[:N]' or a torch.device; got bool")
    text = str(device) if type(device).__name__ == "device" else device  # torch.device
    if isinstance(text, str):
        if text == "cpu":
            return None
        if text == "cuda":
            if not _has_gpu():
                raise ValueError(f"{fn}: device must name a visible GPU; got 'cuda' with no CUDA device visible")
            import cupy

            return int(cupy.cuda.runtime.getDevice())
        if text.startswith("cuda:") and text[5:].isdigit():
            return _checked(int(text[5:]))
        raise ValueError(f"{fn}: device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r}")
    if isinstance(text, int):
        return _checked(text)
    raise TypeError(f"{fn}: device must be None, an int, 'cpu', 'cuda[:N]' or a torch.device; got {type(device).__name__}")


def _has_gpu() -> bool:
    from cukit._device import is_available

    return is_available()


def _checked(index: int) -> int:
    count = 0
    if _has_gpu():
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    if not 0 <= index < count:
        raise ValueError(f"cukit.memory_info: device must be a CUDA device index in [0, {count}); got {index}")
    return index


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # not installed, or no such figure on this platform
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak: the best left
        return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _host_info() -> dict[str, Any]:
    mi = _meminfo()
    total, free = mi.get("MemTotal"), mi.get("MemAvailable", mi.get("MemFree"))
    if total is None or free is None:
        try:
            import psutil

            vm = psutil.virtual_memory()
            total, free = int(vm.total), int(vm.available)
        except Exception:  # psutil absent: sysconf's pages (free pages, not "available")
            page = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page
            free = os.sysconf("SC_AVPHYS_PAGES") * page
    return {"device": "cpu", "total_memory": int(total), "allocated_memory": _rss(), "free_memory": int(free)}
