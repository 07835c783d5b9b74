"""cukit.linalg: batched matrix functions for preconditioners (Shampoo, K-FAC) on NumPy, CuPy and
torch arrays; each returns the array type it was given (torch tensors on their device, computed on
torch's current stream; NumPy and torch-CPU inputs through the NumPy references).

- ``matrix_inverse_root(A, p)``: ``(A + eps lambda_max I)^(-1/p)`` for symmetric PSD stacks, by
  CuPy's batched eigensolver or a coupled Newton iteration (one kernel per batch for matrices that
  fit in shared memory, cukit's batched GEMMs for larger ones; ``method="auto"`` picks,
  :func:`choose_method`), with per-matrix failure flags on the device.
- ``matrix_root(A, p)``, ``matrix_power(A, k)``: the same machinery.
- ``eigh(A)``: batched, ``numpy.linalg.eigh``'s convention.
- ``kron(a, b)``: ``numpy.kron`` (optionally batched); ``kron_matvec(A, B, X)``: ``A X B^T``, the
  Kronecker product applied without forming it.

Not differentiable (the results are plain tensors). The implementation and the references are in
``cukit/ops/linalg.py`` and ``raw_kernels/linalg.cu``.
"""

from cukit.ops.linalg import (
    EIGH_MAX_N,
    METHODS,
    choose_method,
    default_max_iters,
    default_tol,
    eigh,
    kron,
    kron_matvec,
    matrix_inverse_root,
    matrix_power,
    matrix_root,
)

__all__ = [
    "EIGH_MAX_N",
    "METHODS",
    "choose_method",
    "default_max_iters",
    "default_tol",
    "eigh",
    "kron",
    "kron_matvec",
    "matrix_inverse_root",
    "matrix_power",
    "matrix_root",
]
