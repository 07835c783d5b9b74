"""Fuzz your own kernels like cukit fuzzes its own: Hypothesis strategies for kernel-breaking
shapes, dtypes and (non-contiguous) arrays on every backend, and NumPy-oracle comparisons with
per-dtype tolerances.

``assert_close``, ``tolerance``, ``TOLERANCES``, ``to_numpy`` and ``check_against_oracle`` need only
NumPy; the strategies (``shapes``, ``dtypes``, ``arrays``, ``backends``) need hypothesis and are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cukit.testing.asserts import TOLERANCES, assert_close, check_against_oracle, to_numpy, tolerance

if TYPE_CHECKING:
    from cukit.testing.strategies import (
        BACKENDS,
        FLOAT_DTYPES,
        ODD_SIDES,
        BackendUnavailableError,
        arrays,
        backends,
        dtypes,
        shapes,
    )

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "ODD_SIDES",
    "TOLERANCES",
    "BackendUnavailableError",
    "arrays",
    "assert_close",
    "backends",
    "check_against_oracle",
    "dtypes",
    "shapes",
    "to_numpy",
    "tolerance",
]

_STRATEGIES = {
    "BACKENDS",
    "FLOAT_DTYPES",
    "ODD_SIDES",
    "BackendUnavailableError",
    "arrays",
    "backend_dtypes",
    "backends",
    "dtypes",
    "shapes",
}


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:  # imports hypothesis (ImportError with an install hint if missing)
        return getattr(importlib.import_module("cukit.testing.strategies"), name)
    raise AttributeError(f"module 'cukit.testing' has no attribute {name!r}")
