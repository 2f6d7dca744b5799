"""Keeping a model's sparse weights for inference: only what the forward products read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .layer import SparseLinear
from .pattern import Pattern


def for_inference(model: nn.Module, *, tile_view: Optional[bool] = None) -> nn.Module:
    """Keeps every :class:`Pattern` of ``model`` for inference (:meth:`Pattern.for_inference`), in
    place, and returns the model: each drops the slots' rows and the CSC permutation, the arrays of
    dX and dW, and the tile view unless kept. A float32 layer with uint16 indices then
    holds 6 bytes per connection (value and column) instead of 16.

    Run the model under ``torch.no_grad()`` or ``torch.inference_mode()``: a sparse layer's forward
    whose inputs or values require gradients raises, since its backward could not run.
    :func:`for_training` undoes it. CUDA graphs captured before must be captured again (the arrays
    are new tensors).

    Args:
        model: any module; its Patterns are found among its submodules (a pattern shared by several
            layers is kept once).
        tile_view: keep the tile view. None (default): kept for the patterns of layers whose values are
            16-bit (their tensor-core forward reads it at batches of 16 to 128 rows), dropped for the
            others (float32 and float64 values, sparse attention's patterns).
    """
    keep: dict[int, tuple[Pattern, bool]] = {}
    for module in model.modules():
        if isinstance(module, Pattern):
            keep.setdefault(id(module), (module, False))
        if isinstance(module, SparseLinear):
            sixteen_bits = module.values.dtype in (torch.bfloat16, torch.float16)
            pattern, kept = keep.get(id(module.pattern), (module.pattern, False))
            keep[id(pattern)] = (pattern, kept or sixteen_bits)
    for pattern, sixteen_bits in keep.values():
        pattern.for_inference(tile_view=sixteen_bits if tile_view is None else bool(tile_view))
    return model


def for_training(model: nn.Module) -> nn.Module:
    """Rebuilds what :func:`for_inference` dropped from every Pattern of ``model`` (in place; the
    connections and values stay); returns the model."""
    for module in model.modules():
        if isinstance(module, Pattern):
            module.for_training()
    return model
