"""Repack rows into a 16-byte aligned layout: ``raw_kernels/repack.cu``.

``aligned_copy(x)`` returns a copy of x (same array type, values, shape and dtype) whose rows
start 16-byte aligned: a view of a fresh contiguous buffer whose row length is padded to a multiple
of 16 bytes. The matmul front end uses it to run large misaligned 16-bit problems (an odd leading
dimension such as K = 4093) on the TMA kernels, which need 16-byte aligned rows ("pad-and-run").

On the GPU, 2-byte dtypes (bfloat16, float16) whose leading dimensions collapse into one stride
take the kernel (one pass at close to copy bandwidth: vector loads and a funnel shift, no read past
a row's end); anything else copies with its own library (torch / CuPy / NumPy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cukit._runtime import KernelModule
from cukit.interop import array_kind, current_stream, device_of, element_strides

__all__ = ["KERNELS", "aligned_copy", "padded_width", "reference_numpy"]

KERNELS = KernelModule(
    "repack.cu",
    instantiations={"u16": ["pad_rows<unsigned short>"]},
    signatures={"pad_rows": "ptr ptr i64 i64 i64 i64 i64 i64"},
)

_BLOCK = 256
_MAX_GRID = 65535


def padded_width(cols: int, itemsize: int) -> int:
    """Elements per row after padding `cols` elements of `itemsize` bytes to a multiple of 16 bytes."""
    per = max(1, 16 // itemsize)
    return -(-cols // per) * per


def reference_numpy(x: np.ndarray) -> np.ndarray:
    """The padded buffer (..., R, padded_width(C)) holding x in its first C columns, zeros after.

    See also: ``numpy.pad``."""
    *lead, r, c = x.shape
    out = np.zeros((*lead, r, padded_width(c, x.dtype.itemsize)), dtype=x.dtype)
    out[..., :c] = x
    return out


def _one_batch_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int] | None:
    """(count, stride) of the leading dimensions as one, or None when they do not collapse."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n > 1]
    if not dims:
        return 1, 0
    n, s = dims[-1]
    for n_out, s_out in reversed(dims[:-1]):
        if s_out != s * n:
            return None
        n *= n_out
    return n, s


def _kernel_copy(x: Any, kind: str, device: int) -> Any | None:
    """The padded buffer filled by the kernel, or None when the kernel does not apply."""
    if x.dtype.itemsize != 2 or x.ndim < 2:
        return None
    strides = element_strides(x, kind)
    *lead, r, c = x.shape
    if strides is None or (strides[-1] != 1 and c > 1):
        return None
    batch = _one_batch_stride(tuple(lead), strides[:-2])
    if batch is None:
        return None
    nb, sb = batch
    cp = padded_width(c, 2)
    if kind == "torch":
        import torch

        buf = torch.empty((*lead, r, cp), dtype=x.dtype, device=x.device)
        src, dst = x.data_ptr(), buf.data_ptr()
    else:
        import cupy

        with cupy.cuda.Device(device):
            buf = cupy.empty((*lead, r, cp), dtype=x.dtype)
        src, dst = x.data.ptr, buf.data.ptr
    rows = nb * r
    if rows * cp == 0:
        return buf
    grid = (min(-(-(cp // 8) // _BLOCK), _MAX_GRID), min(rows, _MAX_GRID))
    KERNELS.launch(
        "pad_rows<unsigned short>",
        grid,
        (_BLOCK,),
        (src, dst, nb, r, c, strides[-2] if r > 1 else c, sb, cp),
        device=device,
        stream=current_stream(device, kind == "torch"),
    )
    return buf


def aligned_copy(x: Any) -> Any:
    """A copy of x (..., R, C) with rows starting 16-byte aligned: ``y[...] == x[...]``, same
    shape, dtype and array type (NumPy, torch CPU/CUDA, CuPy), y a view of a contiguous buffer of
    shape (..., R, padded_width(C)). Any dtype and strides; 2-byte dtypes on the GPU take the
    kernel.

    See also: ``numpy.pad`` (which returns the padded array itself, not a view of x's shape)."""
    kind = array_kind(x)
    if x.ndim < 2:
        raise ValueError(f"aligned_copy: x must have at least 2 dimensions; got shape {tuple(x.shape)}")
    c = x.shape[-1]
    if kind == "numpy":
        return reference_numpy(np.asarray(x))[..., :c]
    device = device_of(x)
    if device is not None:
        buf = _kernel_copy(x, kind, device)
        if buf is not None:
            return buf[..., :c]
    if kind == "torch":
        import torch

        buf = torch.empty((*x.shape[:-1], padded_width(c, x.element_size())), dtype=x.dtype, device=x.device)
        view = buf[..., :c]
        view.copy_(x)
        return view
    import cupy

    with cupy.cuda.Device(device):
        buf = cupy.empty((*x.shape[:-1], padded_width(c, x.itemsize)), dtype=x.dtype)
    view = buf[..., :c]
    view[...] = x
    return view
