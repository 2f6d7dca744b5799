"""Which CUDA kernel runs a layer's products, and how to force one (benchmarks, A/B tests)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from ._ops import ops

#: Kernel variants of the forward SpMM. ``coo_atomic`` (the SNACK-style COO kernel) uses float
#: atomics, so its results may differ in the last bits between runs: it is never chosen
#: automatically. ``wide_rows`` and ``coo_atomic`` compute only the forward product
#: (``FORWARD_ONLY_VARIANTS``); the transposed product (dX) runs ``TRANSPOSED_VARIANTS``.
SPMM_VARIANTS = ("warp_row", "smem_x", "global_xt", "global_x", "wide_rows", "coo_atomic")
DETERMINISTIC_VARIANTS = tuple(v for v in SPMM_VARIANTS if v != "coo_atomic")
FORWARD_ONLY_VARIANTS = ("wide_rows", "coo_atomic")
TRANSPOSED_VARIANTS = tuple(v for v in DETERMINISTIC_VARIANTS if v not in FORWARD_ONLY_VARIANTS)

_current_default = "auto"


def explain(layer, n: int, *, transposed: bool = False, variant: str = "auto") -> str:
    """One line: the kernel that computes ``layer`` (a SparseLinear) for a batch of ``n`` rows, and why.
    ``transposed=True`` explains the input-gradient product instead."""
    return ops.explain_spmm(layer.values, layer.row_ptr, layer.col_ptr, n, transposed, variant)


def set_spmm_variant(variant: str) -> None:
    """Makes every ``auto`` SpMM of this process run ``variant`` (``"auto"`` restores the planner)."""
    global _current_default
    ops.set_default_spmm_variant(variant)
    _current_default = variant


@contextlib.contextmanager
def spmm_variant(variant: str) -> Iterator[None]:
    """Context manager form of :func:`set_spmm_variant`, restoring the previous choice on exit."""
    previous = _current_default
    set_spmm_variant(variant)
    try:
        yield
    finally:
        set_spmm_variant(previous)
