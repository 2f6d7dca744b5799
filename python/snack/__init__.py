"""snack: truly sparse neural-network layers for PyTorch.

A :class:`SparseLinear` (and :class:`SparseConv2d`, its 1x1-convolution form) stores only its non-zero connections (values plus a :class:`Pattern` of
16/32-bit slot indices) and computes forward, backward and the optimizer step on them alone, on the
CPU or with CUDA kernels. See the README for the design and the benchmarks.
"""

from pathlib import Path

from ._ops import LIBRARY_PATH, PATTERN_FIELDS, default_index_dtype, ops
from .kernels import (CHANNELS_FIRST_PATHS, CSC_READS, DENSE_BLOCK_MIN_ROWS, DETERMINISTIC_VARIANTS,
                      FORWARD_ONLY_VARIANTS, SDDMM_VARIANTS, SPMM_VARIANTS, TRANSPOSED_VARIANTS, Plan, csc_read,
                      explain, fragment_warpgroups, set_csc_read, set_fragment_warpgroups, set_spmm_variant,
                      set_tile_view_splits, spmm_variant, tile_view_splits)
from .pattern import Pattern
from .layer import SparseLinear, nnz_for_density, prepare_ddp, sparse_linear
from .conv import DepthwiseSeparable, SparseConv2d
from . import attention, dst, nn, optim
from .sparsify import sparsify
from .inference import for_inference, for_training, fuse_for_inference

__version__ = "0.1.0"

#: Prefix for CMake's ``find_package(snack)`` (C++/libtorch users), like ``torch.utils.cmake_prefix_path``.
#: Next to the installed library (in an editable install that is site-packages, not the source tree).
cmake_prefix_path = str(Path(LIBRARY_PATH).resolve().parent.parent / "share" / "cmake")

__all__ = ["SparseLinear", "SparseConv2d", "DepthwiseSeparable", "Pattern", "sparse_linear", "ops", "default_index_dtype", "nnz_for_density",
           "cmake_prefix_path", "LIBRARY_PATH", "PATTERN_FIELDS", "Plan", "explain", "set_spmm_variant",
           "spmm_variant", "set_csc_read", "csc_read", "set_tile_view_splits", "tile_view_splits",
           "set_fragment_warpgroups", "fragment_warpgroups", "CSC_READS",
           "SPMM_VARIANTS", "TRANSPOSED_VARIANTS", "SDDMM_VARIANTS", "DETERMINISTIC_VARIANTS",
           "FORWARD_ONLY_VARIANTS", "DENSE_BLOCK_MIN_ROWS", "CHANNELS_FIRST_PATHS", "attention", "dst", "nn", "optim",
           "sparsify", "prepare_ddp", "for_inference", "for_training", "fuse_for_inference"]
