"""Loads the C++ operator library and registers the fake kernels that torch.compile traces with.

The operator schemas are defined once, in ``src/torch/schema.cpp``; their CPU, CUDA and autograd
kernels live in C++. This module only adds the shape functions that tracing needs.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

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

#: The names of a pattern's tensors, in the order every op takes them (from the C++ library).
PATTERN_FIELDS = tuple(ops.pattern_fields())
#: The tile view's tiles (rows, columns) and the widest layer that has the view (snack/pattern.h).
_TILE_ROWS, _TILE_COLS, _TILE_MAX_INPUTS = ops.tile_view_geometry()


def default_index_dtype(out_features: int, in_features: int) -> torch.dtype:
    """The slot index dtype a pattern of this shape gets: uint16 where both dimensions fit in 16
    bits, int32 otherwise (the C++ library's rule)."""
    return torch.uint16 if ops.index_bits(out_features, in_features) == 16 else torch.int32


def _index_dtype(out_features, in_features, index_dtype):
    return index_dtype if index_dtype is not None else default_index_dtype(out_features, in_features)


def _shape(pattern):
    """(M, K) of a pattern's tensor list: its CSR and CSC offsets have M + 1 and K + 1 entries."""
    return pattern[PATTERN_FIELDS.index("row_ptr")].shape[0] - 1, pattern[PATTERN_FIELDS.index("col_ptr")].shape[0] - 1


def _nnz(pattern):
    return pattern[PATTERN_FIELDS.index("col_idx")].shape[0]  # row_idx is empty in a pattern kept for inference


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _register_fake(name: str):
    """Registers the shape function of ``snack::name``. It runs for meta and fake tensors only: a
    real tensor among meta ones (a checkpoint entry on "meta", say) would otherwise get back
    uninitialised memory, so it raises instead."""
    def register(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            real = [t for t in _tensors((*args, *kwargs.values())) if not (t.is_meta or is_fake(t))]
            if real:
                devices = sorted({str(t.device) for t in _tensors((*args, *kwargs.values()))})
                raise RuntimeError(f"snack.{name}: its tensors must be on one device, got {', '.join(devices)} "
                                   "(a meta tensor has no data to compute with)")
            return fn(*args, **kwargs)
        torch.library.register_fake(f"snack::{name}")(checked)
        return fn
    return register


@_register_fake("spmm")
def _spmm_fake(x, values, pattern, bias=None, activation="none", variant="auto", tiles=None):
    return values.new_empty((x.shape[0], _shape(pattern)[0]))


@_register_fake("pack_tile_values")
def _pack_tile_values_fake(values, pattern):
    return values.new_empty((pattern[PATTERN_FIELDS.index("tile_entries")].shape[0], 2))


@_register_fake("pack_tile_fragments")
def _pack_tile_fragments_fake(values, pattern, transposed=False):
    rows, cols = _shape(pattern)
    words = ops.tile_fragment_words(rows, cols, _nnz(pattern))
    return values.new_empty((words,), dtype=torch.int32)


@_register_fake("spmm_channels_first")
def _spmm_channels_first_fake(x, values, pattern, bias=None, activation="none", variant="auto"):
    return values.new_empty((x.shape[0], _shape(pattern)[0], x.shape[2]))


@_register_fake("separable_conv")
def _separable_conv_fake(x, dw_weight, dw_bias, stride, dw_activation, values, pattern, bias=None, activation="none",
                         variant="auto"):
    batch, _, height, width = x.shape
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    y = values.new_empty((batch, _shape(pattern)[0], (height - 1) // stride + 1, (width - 1) // stride + 1))
    return y.contiguous(memory_format=torch.channels_last) if channels_last else y


@_register_fake("spmm_for_step")
def _spmm_for_step_fake(x, values, pattern, bias=None, activation="none"):
    # X transposed, where the device's plan makes that copy of the whole batch: a shape only the
    # plan knows.
    ctx = torch.library.get_ctx()
    return _spmm_fake(x, values, pattern), values.new_empty((ctx.new_dynamic_size(), ctx.new_dynamic_size()))


@_register_fake("sparse_attention_fwd")
def _sparse_attention_fwd_fake(q, k, v, pattern, scale, causal, bands=True):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@_register_fake("sparse_attention_bands")
def _sparse_attention_bands_fake(pattern, causal):
    rows, blocks = _shape(pattern)[0], torch.library.get_ctx().new_dynamic_size()  # blocks of queries
    return (torch.empty((rows, 4), dtype=torch.int32, device=pattern[0].device),
            torch.empty((blocks, 2), dtype=torch.int32, device=pattern[0].device))


@_register_fake("sparse_attention_bwd")
def _sparse_attention_bwd_fake(q, k, v, lse, dout, pattern, scale, causal, bands=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_register_fake("spmm_t")
def _spmm_t_fake(dy, values, pattern, variant="auto"):
    return values.new_empty((dy.shape[0], _shape(pattern)[1]))


@_register_fake("sddmm")
def _sddmm_fake(dy, x, pattern, variant="auto"):
    return dy.new_empty((_nnz(pattern),))


@_register_fake("bias_grad")
def _bias_grad_fake(dy):
    return dy.new_empty((dy.shape[1],))


@_register_fake("sparse_linear")
def _sparse_linear_fake(x, values, bias, pattern, activation="none"):
    return values.new_empty((*x.shape[:-1], _shape(pattern)[0]))


@_register_fake("sparse_linear_adamw")
def _sparse_linear_adamw_fake(x, values, bias, pattern, state, hyper, bias_state, update_guard=None, bias_hyper=(),
                              activation="none"):
    return _sparse_linear_fake(x, values, bias, pattern, activation)


@_register_fake("sddmm_adamw_")
def _sddmm_adamw_fake(dy, x, pattern, values, state, hyper, bias_state, bias=None, bias_hyper=(), x_t=None,
                      variant="auto"):
    return None


@_register_fake("bias_grad_adamw_")
def _bias_grad_adamw_fake(dy, bias, state, hyper):
    return None


@_register_fake("slots_from_coo")
def _slots_from_coo_fake(rows, cols, out_features, in_features, index_dtype=None):
    dtype = _index_dtype(out_features, in_features, index_dtype)
    n = rows.shape[0]
    return rows.new_empty((n,), dtype=dtype), rows.new_empty((n,), dtype=dtype), rows.new_empty((n,), dtype=torch.int64)


@_register_fake("slots_from_dense")
def _slots_from_dense_fake(dense, nnz, index_dtype=None):
    dtype = _index_dtype(dense.shape[0], dense.shape[1], index_dtype)
    return (dense.new_empty((nnz,), dtype=dtype), dense.new_empty((nnz,), dtype=dtype),
            dense.new_empty((nnz,), dtype=torch.int64))


@_register_fake("slots_from_mask")
def _slots_from_mask_fake(mask, index_dtype=None):
    dtype = _index_dtype(mask.shape[0], mask.shape[1], index_dtype)
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (mask.new_empty((nnz,), dtype=dtype), mask.new_empty((nnz,), dtype=dtype),
            mask.new_empty((nnz,), dtype=torch.int64))


@_register_fake("build_views")
def _build_views_fake(row_idx, col_idx, out_features, in_features, tile_view=True):
    nnz = row_idx.shape[0]
    tiles = tile_view and out_features > 0 and 0 < in_features <= _TILE_MAX_INPUTS
    tile_ptr = -(-out_features // _TILE_ROWS) * -(-in_features // _TILE_COLS) + 1 if tiles else 0
    return (row_idx.new_empty((out_features + 1,), dtype=torch.int32),
            row_idx.new_empty((in_features + 1,), dtype=torch.int32),
            row_idx.new_empty((nnz,), dtype=torch.int32),
            row_idx.new_empty((tile_ptr,), dtype=torch.int32),
            row_idx.new_empty(((nnz + 3) // 4 * 4 if tiles else 0,), dtype=torch.int32))


@_register_fake("prune_slots")
def _prune_slots_fake(score, k):
    return score.new_empty((k,), dtype=torch.int64)


@_register_fake("sample_absent")
def _sample_absent_fake(row_idx, col_idx, out_features, in_features, k, generator=None):
    return row_idx.new_empty((k,), dtype=torch.int64)


@_register_fake("topk_absent_gradient")
def _topk_absent_gradient_fake(dy, x, row_idx, col_idx, k, block_rows):
    return row_idx.new_empty((k,), dtype=torch.int64)


@_register_fake("replace_slots")
def _replace_slots_fake(row_idx, col_idx, drop, grow, out_features, in_features, validate=True):
    return torch.empty_like(row_idx), torch.empty_like(col_idx), row_idx.new_empty(row_idx.shape, dtype=torch.int64)


@_register_fake("remap_slots_")
def _remap_slots_fake(target, source, fill):
    return None


@_register_fake("validate_slots")
def _validate_slots_fake(row_idx, col_idx, out_features, in_features):
    return None  # contents are unknown while tracing: the real call checks them


@_register_fake("validate_pattern")
def _validate_pattern_fake(pattern):
    return None
