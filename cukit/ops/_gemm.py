"""The contract between the matmul front end (cukit/ops/matmul.py) and the matmul kernel families
(cukit/ops/matmul_<family>.py with raw_kernels/matmul_<family>.cu).

A :class:`Gemm` describes one launch-ready problem on one device::

    C[z, m, n] = act(sum_k A[z, m, k] * B[z, k, n] + bias[n])      for z in range(batch)

- Element strides, not bytes. A is addressed ``A[z, m, k] = a + off_a(z) + m * sa_m + k * sa_k``
  with exactly one of ``sa_m``, ``sa_k`` equal to 1 (the front end copies operands that have no
  unit stride), likewise B with ``sb_k``, ``sb_n``. So each operand is either "row-major" or
  "column-major" (a transpose is a stride swap, never a copy).
- C is written contiguous row-major: ``C[z, m, n] = c + z * M * N + m * N + n``.
- Batch: up to 3 batch dimensions (the broadcast result shape, outermost first, padded with 1s),
  each with A's and B's element stride (0 where that operand is broadcast). The flattened batch
  index z runs over ``nb0 * nb1 * nb2``; kernels decode it with ``cukit/gemm.cuh``'s
  ``batch_offset``. Strides and offsets are 64-bit.
- bias: a pointer to N elements of C's dtype, or 0. act: -1 (none) or an id of
  ``cukit/activations.cuh`` (bias_act's ACTIVATIONS).
- M, N or K may be 0 or 1; K == 0 means C = act(bias) (or zeros): the front end handles
  M == 0 / N == 0 / batch == 0 (nothing to launch) but kernels must handle K == 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cukit.interop import DType

__all__ = ["GEMM_SIGNATURE", "MAX_BATCH_DIMS", "Gemm", "GemmFamily", "GemmRun"]

# A ready launch: ``run((a, b, c, bias), stream)`` with device pointers of arrays that have the
# shapes, strides and alignment of the Gemm it was prepared for.
GemmRun = Callable[[tuple[int, int, int, int], Any], None]

MAX_BATCH_DIMS = 3

# The kernel parameter list every matmul kernel takes, in this order (see Gemm.kernel_args):
# A, B, C, bias, M, N, K, sa_m, sa_k, sb_k, sb_n, nb0, nb1, nb2, sa0, sa1, sa2, sb0, sb1, sb2
GEMM_SIGNATURE = "ptr ptr ptr ptr i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64"


@dataclass(frozen=True)
class Gemm:
    """One batched GEMM problem, ready to launch (see the module docstring for the maths)."""

    dtype: DType  # A, B, C and bias share it
    M: int
    N: int
    K: int
    a: int  # device pointers
    b: int
    c: int
    bias: int  # 0: no bias
    act: int  # -1: no activation
    sa_m: int
    sa_k: int
    sb_k: int
    sb_n: int
    batch: tuple[int, int, int] = (1, 1, 1)
    sa_batch: tuple[int, int, int] = (0, 0, 0)
    sb_batch: tuple[int, int, int] = (0, 0, 0)
    precision: str = "ieee"  # or "tf32" (float32 inputs only)
    device: int = 0

    def __post_init__(self) -> None:
        if (self.sa_m == 1) == (self.sa_k == 1) and not (self.M <= 1 or self.K <= 1):
            raise ValueError(f"A needs exactly one unit stride; got sa_m={self.sa_m}, sa_k={self.sa_k}")
        if (self.sb_k == 1) == (self.sb_n == 1) and not (self.K <= 1 or self.N <= 1):
            raise ValueError(f"B needs exactly one unit stride; got sb_k={self.sb_k}, sb_n={self.sb_n}")

    @property
    def batch_count(self) -> int:
        return self.batch[0] * self.batch[1] * self.batch[2]

    @property
    def a_row_major(self) -> bool:
        """A[m, k] has unit stride along k (the usual layout; False: a transposed view)."""
        return self.sa_k == 1

    @property
    def b_row_major(self) -> bool:
        """B[k, n] has unit stride along n (False: B is the transpose of a row-major (N, K),
        e.g. nn.Linear's weight)."""
        return self.sb_n == 1

    def kernel_args(self) -> tuple[int, ...]:
        """The argument tuple for GEMM_SIGNATURE."""
        return (
            self.a, self.b, self.c, self.bias,
            self.M, self.N, self.K,
            self.sa_m, self.sa_k, self.sb_k, self.sb_n,
            *self.batch, *self.sa_batch, *self.sb_batch,
        )


class GemmFamily(Protocol):
    """What a kernel family module (``cukit/ops/matmul_<family>.py``) provides to the front end."""

    def supports(self, g: Gemm) -> bool:
        """Whether the family runs ``g`` (dtype, precision, layout, alignment, device)."""
        ...

    def prepare(self, g: Gemm, *, version: str) -> GemmRun:
        """A ready launch for every problem of ``g``'s signature (the plan cache keeps it)."""
        ...

    def launch(self, g: Gemm, stream: Any) -> None:
        """``prepare(g)((g.a, g.b, g.c, g.bias), stream)``."""
        ...
