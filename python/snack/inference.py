"""Which arrays a model's sparse weights hold: only what the forward products read (inference), or
what training reads, with or without the tile view of the 16-bit products."""

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


def for_training(model: nn.Module, *, tile_view: bool = True) -> nn.Module:
    """Holds every array the training products read in every :class:`Pattern` of ``model``
    (:meth:`Pattern.for_training`, in place; the connections and values stay): rebuilds what
    :func:`for_inference` dropped. Returns the model.

    Args:
        tile_view: hold the tile view (default). ``False`` leaves it out, for a model whose products
            never run in 16 bits (float32 values, no ``torch.autocast``): 4 bytes less per
            connection, and one build less in every topology update.
    """
    for module in model.modules():
        if isinstance(module, Pattern):
            module.for_training(tile_view=tile_view)
    return model
