"""Which CUDA kernel runs a layer's products, and how to force one (benchmarks, A/B tests)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from ._ops import ops

_forward, _input_grad, _weight_grad, _nondeterministic = ops.kernel_variants()
#: Kernel variants of the forward SpMM, of the input-gradient product (the forward's less the
#: forward-only ones) and of the weight gradient (the SDDMM), as the C++ library names them.
SPMM_VARIANTS = tuple(_forward)
TRANSPOSED_VARIANTS = tuple(_input_grad)
SDDMM_VARIANTS = tuple(_weight_grad)
FORWARD_ONLY_VARIANTS = tuple(v for v in SPMM_VARIANTS if v not in TRANSPOSED_VARIANTS)
#: The variants whose repeated runs are bitwise equal (all but the atomic COO kernel).
DETERMINISTIC_VARIANTS = tuple(v for v in SPMM_VARIANTS if v not in _nondeterministic)
#: The smallest batch for which the planner considers dense_blocks (a dense GEMM over blocks of W
#: expanded into a workspace of at most max(N, this) rows of W).
DENSE_BLOCK_MIN_ROWS = ops.dense_block_min_rows()
#: The paths of a 1x1 convolution on NCHW images on CUDA (``snack.ops.spmm_channels_first``'s
#: ``variant``, besides "auto"; ``snack.explain(..., op="channels_first")`` names the planner's).
CHANNELS_FIRST_PATHS = tuple(ops.channels_first_paths())

#: How the input-gradient product may read the weight's columns (see :func:`set_csc_read`).
CSC_READS = ("auto", "in_place", "copied")


@dataclass(frozen=True)
class Plan:
    """How one product of a layer runs (``snack.explain``): the planner's fields.

    ``variant``: the kernel ("cpu" for a CPU layer's loops, "dense_blocks" for its dense blocks);
    ``reason``: why, as a token ("cpu_rule" or "forced" on the CPU; ``describe`` has the
    sentence); ``batch_tile``: batch rows per pass (the SDDMM: the batch padded to a multiple of
    4; on the CPU the loops' batch tile, or the whole batch for ``dense_blocks``' GEMMs);
    ``lanes_per_row``: lanes that split one row's entries; ``rows_per_warp``: wide_rows' rows per
    warp group (the SDDMM: its batch lanes); ``grid`` and ``threads``: the launch; ``smem_bytes``,
    ``workspace_bytes``: memory per block and for the call; ``prefetch_l2``: operands requested into
    L2 first."""

    variant: str
    reason: str
    batch_tile: int
    lanes_per_row: int
    rows_per_warp: int
    grid: int
    threads: int
    smem_bytes: int
    workspace_bytes: int
    prefetch_l2: bool
    describe: str

    def __str__(self) -> str:
        return self.describe


def explain(layer, n: int, *, op: str = "forward", variant: str = "auto", dtype=None, pixels: int = 1) -> Plan:
    """The plan of one product of ``layer`` (a SparseLinear) for a batch of ``n`` rows: ``op`` is
    "forward", "input_grad" (dX) or "weight_grad" (dW, the SDDMM); "channels_first" is the path of a
    SparseConv2d's inference on NCHW images (``variant`` "in_place", "pixel_rows" or "dense_blocks":
    ``snack.ops.spmm_channels_first``), ``n`` their pixels in all and ``pixels`` those of one image
    (height x width, a divisor of ``n``). The layer's fused activation is planned for as its forward
    plans it, and the forward of a layer that holds its values in tile order (``pack_tiles``) as given them.
    ``dtype``: the dtype the product runs in, where it is not the values' (``torch.bfloat16`` under
    ``torch.autocast(dtype=torch.bfloat16)``)."""
    values = layer.values.detach()
    if dtype is not None and dtype != values.dtype:
        values = values.new_empty(values.shape, dtype=dtype)  # the planner reads its dtype, not its contents
    activation = getattr(layer, "activation", "none")
    tiles = getattr(layer, "tile_format", "entries") if getattr(layer, "pack_tiles", False) else None
    return Plan(*ops.explain(values, layer.pattern.tensors, n, op, variant, activation, pixels, tiles == "entries",
                             tiles == "fragments", tiles == "bitmaps"))


# The process-wide choices that "auto" defers to, as last set (the C++ side holds the live value).
_current = {"spmm_variant": "auto", "csc_read": "auto", "tile_view_splits": 0, "fragment_warpgroups": 0}


@contextlib.contextmanager
def _restoring(name: str, setter, value) -> Iterator[None]:
    previous = _current[name]
    setter(value)
    try:
        yield
    finally:
        setter(previous)


def set_spmm_variant(variant: str) -> None:
    """Makes every ``auto`` SpMM of this process run ``variant`` (``"auto"`` restores the planner)."""
    ops.set_default_spmm_variant(variant)
    _current["spmm_variant"] = variant


def spmm_variant(variant: str) -> contextlib.AbstractContextManager:
    """Context manager form of :func:`set_spmm_variant`, restoring the previous choice on exit."""
    return _restoring("spmm_variant", set_spmm_variant, variant)


def set_csc_read(csc: str) -> None:
    """How every input-gradient product (dX = dY W) of this process reads W's columns: ``"copied"``
    gathers them first into a CSR copy of W^T in the product's workspace (one pass over the slots;
    the product then runs the forward's kernels on it), ``"in_place"`` reads each slot through the
    column permutation inside the kernel, ``"auto"`` (the default) lets the planner choose."""
    ops.set_default_csc_read(csc)
    _current["csc_read"] = csc


def csc_read(csc: str) -> contextlib.AbstractContextManager:
    """Context manager form of :func:`set_csc_read`, restoring the previous choice on exit."""
    return _restoring("csc_read", set_csc_read, csc)


def set_tile_view_splits(splits: int) -> None:
    """Makes every product of this process over the tile view (``tile_view``'s forward, dX and dW, and
    ``wgmma``'s forward over tile fragments)
    split each band of 64 rows (64 columns for dX) over ``splits`` blocks instead of the planner's
    count; ``0`` restores the planner. For measuring the grid: a count that a product cannot run
    (the SpMM's clusters hold 1 to 8 blocks; no count may exceed the band's tiles) makes that
    product raise ``ValueError``; other kernels ignore it."""
    ops.set_default_tile_view_splits(int(splits))
    _current["tile_view_splits"] = int(splits)


def tile_view_splits(splits: int) -> contextlib.AbstractContextManager:
    """Context manager form of :func:`set_tile_view_splits`, restoring the previous count on exit."""
    return _restoring("tile_view_splits", set_tile_view_splits, splits)


def set_fragment_warpgroups(groups: int) -> None:
    """Makes every ``wgmma`` forward over tile fragments of this process give each block ``groups``
    consumer warpgroups (1, or 2 that take a band's tiles in turn), and every ``tile_view_wgmma``
    weight gradient ``groups`` warpgroups (each a band of its own, sharing X's chunks), instead of
    the planner's count; ``0`` restores the planner. For measuring the kernels; other kernels ignore
    it. Raises ``ValueError`` for a count other than 0, 1 or 2."""
    ops.set_default_fragment_warpgroups(int(groups))
    _current["fragment_warpgroups"] = int(groups)


def fragment_warpgroups(groups: int) -> contextlib.AbstractContextManager:
    """Context manager form of :func:`set_fragment_warpgroups`, restoring the previous count on exit."""
    return _restoring("fragment_warpgroups", set_fragment_warpgroups, groups)
