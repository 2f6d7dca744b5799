"""Loads the C++ operator library and registers the fake (meta) kernels used by torch.compile.

The operator schemas are defined once, in ``src/torch/schema.cpp``; their CPU, CUDA and autograd
kernels live in C++. This module only adds the shape functions that tracing needs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

_LIBRARY_NAME = "libsnack_torch.so"


def _find_library() -> Path:
    override = os.environ.get("SNACK_TORCH_LIBRARY")
    candidates = [Path(override)] if override else []
    candidates.append(Path(__file__).resolve().parent / "lib" / _LIBRARY_NAME)
    # An editable install keeps the Python files here and installs the library into site-packages.
    candidates += [Path(entry) / "snack" / "lib" / _LIBRARY_NAME for entry in sys.path if entry]
    for path in candidates:
        if path.is_file():
            return path
    raise ImportError(
        f"snack: cannot find {_LIBRARY_NAME} (looked next to the package and in sys.path). "
        "Install the package with `pip install --no-build-isolation .` or point SNACK_TORCH_LIBRARY at a build."
    )


LIBRARY_PATH = _find_library()
torch.ops.load_library(str(LIBRARY_PATH))
ops = torch.ops.snack


def default_index_dtype(out_features: int, in_features: int) -> torch.dtype:
    """uint16 when both dimensions fit in 16 bits (<= 65536), int32 otherwise (as the C++ side)."""
    return torch.uint16 if max(out_features, in_features) <= 65536 else torch.int32


def _index_dtype(out_features, in_features, index_dtype):
    return index_dtype if index_dtype is not None else default_index_dtype(out_features, in_features)


@torch.library.register_fake("snack::spmm")
def _spmm_fake(x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, bias, activation="none", variant="auto"):
    return values.new_empty((x.shape[0], row_ptr.shape[0] - 1))


@torch.library.register_fake("snack::spmm_t")
def _spmm_t_fake(dy, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, variant="auto"):
    return values.new_empty((dy.shape[0], col_ptr.shape[0] - 1))


@torch.library.register_fake("snack::sddmm")
def _sddmm_fake(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, variant="auto"):
    return dy.new_empty((row_idx.shape[0],))


@torch.library.register_fake("snack::bias_grad")
def _bias_grad_fake(dy):
    return dy.new_empty((dy.shape[1],))


@torch.library.register_fake("snack::sparse_linear")
def _sparse_linear_fake(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation="none"):
    return values.new_empty((*x.shape[:-1], row_ptr.shape[0] - 1))


@torch.library.register_fake("snack::sparse_linear_adamw")
def _sparse_linear_adamw_fake(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, exp_avg, exp_avg_sq, step,
                              update_guard, lr, beta1, beta2, eps, weight_decay, maximize=False, activation="none",
                              bias_exp_avg=None, bias_exp_avg_sq=None, bias_step=None, bias_hyper=None):
    return _sparse_linear_fake(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation)


@torch.library.register_fake("snack::sddmm_adamw_")
def _sddmm_adamw_fake(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, values, exp_avg, exp_avg_sq, step, lr,
                      beta1, beta2, eps, weight_decay, maximize=False, variant="auto", bias=None, bias_exp_avg=None,
                      bias_exp_avg_sq=None, bias_step=None, bias_hyper=None):
    return None


@torch.library.register_fake("snack::bias_grad_adamw_")
def _bias_grad_adamw_fake(dy, bias, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize=False):
    return None


@torch.library.register_fake("snack::slots_from_coo")
def _slots_from_coo_fake(rows, cols, out_features, in_features, index_dtype=None):
    dtype = _index_dtype(out_features, in_features, index_dtype)
    n = rows.shape[0]
    return rows.new_empty((n,), dtype=dtype), rows.new_empty((n,), dtype=dtype), rows.new_empty((n,), dtype=torch.int64)


@torch.library.register_fake("snack::slots_from_dense")
def _slots_from_dense_fake(dense, nnz, index_dtype=None):
    dtype = _index_dtype(dense.shape[0], dense.shape[1], index_dtype)
    return (dense.new_empty((nnz,), dtype=dtype), dense.new_empty((nnz,), dtype=dtype),
            dense.new_empty((nnz,), dtype=torch.int64))


@torch.library.register_fake("snack::slots_from_mask")
def _slots_from_mask_fake(mask, index_dtype=None):
    dtype = _index_dtype(mask.shape[0], mask.shape[1], index_dtype)
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (mask.new_empty((nnz,), dtype=dtype), mask.new_empty((nnz,), dtype=dtype),
            mask.new_empty((nnz,), dtype=torch.int64))


@torch.library.register_fake("snack::build_views")
def _build_views_fake(row_idx, col_idx, out_features, in_features):
    return (row_idx.new_empty((out_features + 1,), dtype=torch.int32),
            row_idx.new_empty((in_features + 1,), dtype=torch.int32),
            row_idx.new_empty((row_idx.shape[0],), dtype=torch.int32))
