"""Which arrays a model's sparse weights hold: only what the forward products read (inference), or
what training reads, with or without the tile view of the 16-bit products."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ._checks import SIXTEEN_BIT_DTYPES
from .conv import DepthwiseSeparable, SparseConv2d, is_fusable_depthwise
from .layer import TILE_FORMATS, SparseLinear
from .pattern import Pattern


def for_inference(model: nn.Module, *, tile_view: Optional[bool] = None,
                  pack_tiles: Union[bool, str] = False) -> nn.Module:
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
            16-bit (their tensor-core forward reads it at batches of 17 to 128 rows, from 8 with tile
            fragments), dropped for the others (float32 and float64 values, sparse attention's
            patterns). A float32 model served under ``torch.autocast`` in 16 bits computes in 16 bits
            but keeps no view by this default: convert it (``model.to(torch.bfloat16)``) before this
            call, which also saves the cast of every weight at every forward, or pass True.
        pack_tiles: the :class:`SparseLinear` layers on a GPU with 16-bit values and a tile view hold
            a copy of their values in tile order, which the tile view's forward reads instead of the
            values (``SparseLinear.tile_format``): True or "fragments" lays them out as the tensor
            cores' operands (``snack.ops.pack_tile_fragments``: about 5 bytes a connection at 90%
            sparsity; the fragment kernels run at 8-128 rows from 4.5% to 50% density and at 1-7
            rows from 35%, where their worst case measured best: mma.sync's, and from 17 rows on
            Hopper wgmma's, which also takes 129-512 rows on layers of 2^20 weights or more, 1024 on
            those of 2^24 at 75-92.5% sparsity), "entries"
            packs them into the view's entries
            (``snack.ops.pack_tile_values``: 4 bytes a connection, 16-128 rows). Packed by the first
            forward and again whenever the values or the pattern change. Off by default: it trades
            memory for speed at 8-128 batch rows, to 1024 on Hopper (docs/kernels.md, "Tile
            fragments"); without it, a forward of 129-512 rows on Hopper packs the fragments for
            that one product where wgmma's kernel pays, at a cost of 6-97 us on the H100's
            768x3072 to 16384x4096 layers, which holding them saves.
    """
    keep: dict[int, tuple[Pattern, bool]] = {}
    for module in model.modules():
        if isinstance(module, Pattern):
            keep.setdefault(id(module), (module, False))
        if isinstance(module, SparseLinear):
            sixteen_bits = module.values.dtype in SIXTEEN_BIT_DTYPES
            pattern, kept = keep.get(id(module.pattern), (module.pattern, False))
            keep[id(pattern)] = (pattern, kept or sixteen_bits)
    for pattern, sixteen_bits in keep.values():
        pattern.for_inference(tile_view=sixteen_bits if tile_view is None else bool(tile_view))
    tile_format = "fragments" if pack_tiles is True else pack_tiles
    if pack_tiles is not False and tile_format not in TILE_FORMATS:
        raise ValueError(f"for_inference: pack_tiles is True, False or one of {sorted(TILE_FORMATS)}, "
                         f"got {pack_tiles!r}")
    for module in model.modules():
        if isinstance(module, SparseLinear):
            # Where the tile view's kernels read them: the CPU would only check them.
            module.pack_tiles = pack_tiles is not False and module.values.is_cuda and \
                module.pattern.has_tile_view and module.values.dtype in SIXTEEN_BIT_DTYPES
            if module.pack_tiles:
                module.tile_format = tile_format
            module._packed = None
    return model


def for_training(model: nn.Module, *, tile_view: bool = True) -> nn.Module:
    """Holds every array the training products read in every :class:`Pattern` of ``model``
    (:meth:`Pattern.for_training`, in place; the connections and values stay): rebuilds what
    :func:`for_inference` dropped, and drops the packed tile values. Returns the model.

    Args:
        tile_view: hold the tile view (default). ``False`` leaves it out, for a model whose products
            never run in 16 bits (float32 values, no ``torch.autocast``): 4 bytes less per
            connection, and one build less in every topology update.
    """
    for module in model.modules():
        if isinstance(module, Pattern):
            module.for_training(tile_view=tile_view)
        if isinstance(module, SparseLinear):
            module.pack_tiles, module._packed = False, None
    return model


# The layers a batch norm folds into (their output channels are dim 0 of the weight) and the
# activations a snack layer's epilogue computes (nn.GELU only in its exact form).
_DENSE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _fused_activation(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU) and module.approximate == "none":
        return "gelu"
    return None


def _out_channels(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, (SparseLinear, nn.Linear)) else layer.out_channels


@torch.no_grad()
def _fold(layer: nn.Module, bn: nn.Module) -> None:
    """layer(x) then bn, in eval mode, as one layer: each output channel's weights times s and its bias
    (b - mean) * s + beta, with s = gamma / sqrt(var + eps), computed in float32 at least and rounded
    once into the layer's dtype. The weight and bias tensors are updated in place (an optimizer's
    references to them hold); a layer without a bias gets one. (torch.nn.utils.fusion computes in the
    weight's dtype, bf16 for a bf16 model, and has no path for a snack layer's stored values.)"""
    weight = layer.values if isinstance(layer, SparseLinear) else layer.weight
    compute = torch.promote_types(weight.dtype, torch.float32)
    mean, var = bn.running_mean.to(compute), bn.running_var.to(compute)
    gamma = bn.weight.to(compute) if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.to(compute) if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma * torch.rsqrt(var + bn.eps)
    if isinstance(layer, SparseLinear):  # the stored values, each scaled by its row's channel
        per_weight = scale[layer.pattern.slot_rows().to(device=weight.device, dtype=torch.long)]
    else:
        per_weight = scale.view(-1, *([1] * (weight.dim() - 1)))
    weight.copy_((weight.to(compute) * per_weight).to(weight.dtype))
    bias = layer.bias.to(compute) if layer.bias is not None else torch.zeros_like(mean)
    folded_bias = (bias - mean) * scale + beta
    if layer.bias is not None:
        layer.bias.copy_(folded_bias.to(layer.bias.dtype))
    else:
        layer.bias = nn.Parameter(folded_bias.to(weight.dtype), requires_grad=weight.requires_grad)


def fuse_for_inference(model: nn.Module, *, separable: bool = True) -> nn.Module:
    """Folds each batch norm of ``model`` into the layer before it and each ReLU or exact GELU after a
    snack layer into that layer's fused activation, in place, and returns the model: fewer kernels
    per forward, the same outputs up to rounding.

    In every ``nn.Sequential`` of the model, a linear or convolution layer (:class:`SparseLinear`,
    :class:`SparseConv2d`, ``nn.Linear``, ``nn.Conv1d/2d/3d``) directly followed by a batch norm
    that tracks running statistics absorbs it: the weight (a snack layer's stored values) is scaled
    per output channel and the bias shifted, and the batch norm becomes ``nn.Identity``. A snack
    layer without an activation then also takes a ``nn.ReLU`` or ``nn.GELU()`` that follows it
    (after the batch norm, if there was one), which becomes ``nn.Identity`` too. Dense layers keep
    their activation modules. Layers that already apply an activation fold nothing (it comes before
    the batch norm). Batch norms of other places (outside an ``nn.Sequential``, or after another
    module) are left as they are.

    For inference: the batch norms' running statistics are folded, so every one that would be folded
    must be in eval mode (``model.eval()``), else ``ValueError`` is raised and nothing is changed.
    Call it before :func:`for_inference` and before capturing CUDA graphs; a model in 16-bit folds
    in float32 and rounds each value once.

    Then (``separable=True``) each 3x3 depthwise ``nn.Conv2d`` followed by an optional ReLU or exact
    GELU and a :class:`SparseConv2d` of stride 1, in the order the model's ``nn.Sequential`` modules run
    them (nested ones opened), becomes one :class:`DepthwiseSeparable` module, whose forward on
    CUDA is one kernel (the activation and the pointwise layer are replaced by
    ``nn.Identity``). The module keeps both layers and runs them apart where a gradient is needed.

    Args:
        model: any module; it is changed in place.
        separable: fuse depthwise-separable pairs as above (default True).

    Returns:
        ``model``.
    """
    folds: list[tuple[nn.Sequential, int, Optional[int], Optional[int], Optional[str]]] = []
    for name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq)
        for i, layer in enumerate(children):
            if not isinstance(layer, (SparseLinear, *_DENSE_LAYERS)):
                continue
            if isinstance(layer, SparseLinear) and layer.activation != "none":
                continue
            nxt, bn_at, act_at, act = i + 1, None, None, None
            if (nxt < len(children) and isinstance(children[nxt], _BATCH_NORMS)
                    and children[nxt].running_mean is not None
                    and children[nxt].num_features == _out_channels(layer)):
                if children[nxt].training:
                    raise ValueError(f"snack.fuse_for_inference: the batch norm {name}.{nxt} is in training mode; "
                                     "call model.eval() first (its running statistics are what is folded)")
                bn_at, nxt = nxt, nxt + 1
            if isinstance(layer, SparseLinear) and nxt < len(children):
                act = _fused_activation(children[nxt])
                act_at = nxt if act is not None else None
            if bn_at is not None or act_at is not None:
                folds.append((seq, i, bn_at, act_at, act))
    for seq, i, bn_at, act_at, act in folds:
        if bn_at is not None:
            _fold(seq[i], seq[bn_at])
            seq[bn_at] = nn.Identity()
        if act_at is not None:
            seq[i].activation = act
            seq[act_at] = nn.Identity()
    if separable:
        _fuse_separable(model)
    return model


def _leaves(seq: nn.Sequential) -> list[tuple[nn.Sequential, int, nn.Module]]:
    """(parent, index, module) of the modules ``seq`` runs, in order, its nested Sequentials opened."""
    leaves = []
    for i, module in enumerate(seq):
        leaves += _leaves(module) if isinstance(module, nn.Sequential) else [(seq, i, module)]
    return leaves


def _fuse_separable(model: nn.Module) -> None:
    """fuse_for_inference's depthwise-separable pairs, in every outermost nn.Sequential of model."""
    sequentials = [m for m in model.modules() if isinstance(m, nn.Sequential)]
    nested = {id(child) for seq in sequentials for child in seq if isinstance(child, nn.Sequential)}
    for root in (seq for seq in sequentials if id(seq) not in nested):
        leaves = _leaves(root)
        i = 0
        while i < len(leaves):
            parent, index, depthwise = leaves[i]
            if not is_fusable_depthwise(depthwise):
                i += 1
                continue
            j, act_at = i + 1, None
            while j < len(leaves) and isinstance(leaves[j][2], nn.Identity):
                j += 1
            act = _fused_activation(leaves[j][2]) if j < len(leaves) else None
            if act is not None:
                act_at, j = j, j + 1
            while j < len(leaves) and isinstance(leaves[j][2], nn.Identity):
                j += 1
            pointwise = leaves[j][2] if j < len(leaves) else None
            if (isinstance(pointwise, SparseConv2d) and pointwise.stride == (1, 1)
                    and pointwise.in_channels == depthwise.out_channels):
                parent[index] = DepthwiseSeparable(depthwise, pointwise, act)
                for k in ([act_at] if act_at is not None else []) + [j]:
                    leaves[k][0][leaves[k][1]] = nn.Identity()
                i = j + 1
            else:
                i += 1
