"""SparseLinear: an ``nn.Linear`` drop-in whose weight holds only its non-zero connections."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ._checks import (SIXTEEN_BIT_DTYPES, checkpoint_tensor, integer, real_number,
                      unexpected_keys as unexpected_keys_of, value_dtype)
from ._ops import PATTERN_FIELDS, ops
from .pattern import REFUSE, Pattern

ACTIVATIONS = ("none", "relu", "gelu")
_TILE_PTR, _TILE_ENTRIES = PATTERN_FIELDS.index("tile_ptr"), PATTERN_FIELDS.index("tile_entries")

# values Parameter -> its SparseLinear (weak both ways): how snack.optim.AdamW finds the layers whose
# values it is given, to attach its update to them (SparseLinear.attach_fused_update).
_LAYER_OF_VALUES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def sparse_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], pattern: Union[Pattern, list],
                  activation: str = "none") -> Tensor:
    """Functional form of :class:`SparseLinear`: ``act(x W^T + b)``, ``x [..., K] -> [..., M]``,
    differentiable in x, values and bias. ``pattern``: a :class:`Pattern` or its ``tensors``.
    ``activation``: "none", "relu" or "gelu" (exact), fused into the kernel's epilogue (GELU is fused
    at inference; under autograd it keeps its pre-activation). ``values`` and ``bias`` may be strided
    views, as for ``F.linear`` (the kernels read contiguous copies of them)."""
    tensors = pattern.tensors if isinstance(pattern, Pattern) else pattern
    if isinstance(values, Tensor):
        values = values.contiguous()
    if isinstance(bias, Tensor):
        bias = bias.contiguous()
    return ops.sparse_linear(x, values, bias, tensors, activation)


def _resolve_density(density, sparsity, owner: str = "SparseLinear") -> float:
    if (density is None) == (sparsity is None):
        raise ValueError(f"{owner}: give exactly one of density= or sparsity=")
    name = "density" if density is not None else "sparsity"
    given = real_number(density if density is not None else sparsity, name, owner)
    value = given if density is not None else 1.0 - given
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{owner}: {name}={given!r} gives a density outside (0, 1]")
    return value


def _check_activation(activation: Optional[str], owner: str = "SparseLinear") -> str:
    name = "none" if activation is None else activation
    if name not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be None, 'relu' or 'gelu', got {activation!r}")
    return name


def nnz_for_density(out_features: int, in_features: int, density: float) -> int:
    """Slots a layer of this shape keeps at ``density``: the nearest whole number, halves rounded up
    (the C++ library's rule, shared by every constructor)."""
    return int(ops.nnz_for_density(out_features, in_features, float(density)))


#: What SparseLinear.pack_tiles holds, by its tile_format: the op that lays the values out.
TILE_FORMATS = {"fragments": ops.pack_tile_fragments, "entries": ops.pack_tile_values}


class SparseLinear(nn.Module):
    r"""Applies ``y = x W^T + b`` with a sparse ``W`` of shape ``(out_features, in_features)``.

    Only ``nnz = nnz_for_density(out_features, in_features, density)`` connections exist: the
    parameter ``values`` has shape ``[nnz]``, and the layer's :class:`Pattern` (``pattern``) says where
    each one sits and holds the views the kernels read. No dense weight or mask is ever built, in
    forward or backward.

    Args:
        in_features: size of each input sample (K).
        out_features: size of each output sample (M).
        bias: learn an additive bias (default True).
        density: fraction of connections kept, in (0, 1]. Exactly one of density/sparsity.
        sparsity: fraction of connections removed, ``1 - density``.
        device, dtype: as for ``nn.Linear``; dtype float32, float64, bfloat16 or float16 (the 16-bit
            types are stored in 16 bits and computed in float32). Under ``torch.autocast`` the layer
            computes in the autocast dtype, as ``nn.Linear`` does, and keeps its values' dtype.
        index_dtype: force ``torch.uint16`` or ``torch.int32`` slot indices (default: smallest fitting).
        generator: ``torch.Generator`` for the random pattern and initial values (CPU or the layer's device).
        activation: ``None`` (default), ``"relu"`` or ``"gelu"``: applied to the output, fused into the
            forward kernel (not part of ``nn.Linear``; use it in place of a following ReLU/GELU module).

    The pattern is drawn uniformly at random without replacement. Values and bias are drawn from
    ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` with the *effective* fan-in ``density * in_features``,
    so the output has the scale an ``nn.Linear`` would have.

    ``fused_update`` is None unless an optimizer attached an update of ``values`` to the layer's
    backward (:class:`snack.optim.AdamW` does, for the layers whose values it holds): then a forward
    under autograd runs the op whose backward applies that update at once, and ``values.grad`` stays
    ``None``. See :meth:`attach_fused_update`.

    ``pack_tiles`` is False unless :func:`snack.for_inference` was asked to pack (on a GPU): then a
    forward without gradients on 16-bit values reads them in tile order, laid out as ``tile_format``
    says: "fragments" (``snack.ops.pack_tile_fragments``, the tensor cores' operands) or "entries"
    (``snack.ops.pack_tile_values``, packed into the tile view's entries). The copy is made by the
    first such forward and again after any change of the values or the pattern, counted in
    :meth:`nbytes`, never part of a checkpoint. Set on a CPU layer, the CPU checks the copy instead of
    reading it (no faster there).
    """

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, density: Optional[float] = None,
                 sparsity: Optional[float] = None, device=None, dtype=None, index_dtype: Optional[torch.dtype] = None,
                 generator: Optional[torch.Generator] = None, activation: Optional[str] = None) -> None:
        super().__init__()
        in_features = integer(in_features, "in_features", "SparseLinear", minimum=1)
        out_features = integer(out_features, "out_features", "SparseLinear", minimum=1)
        value_dtype(dtype, "SparseLinear")
        density = _resolve_density(density, sparsity)
        nnz = nnz_for_density(out_features, in_features, density)
        if nnz == 0:  # density is in (0, 1]: a rounding to nothing
            warnings.warn(f"{type(self).__name__}: density {density:g} of a {out_features} x {in_features} weight "
                          "keeps no connection: the layer's output is its bias alone", stacklevel=2)
        pattern = Pattern.random(out_features, in_features, nnz, generator=generator, device=device,
                                 index_dtype=index_dtype)
        factory = {"device": device, "dtype": dtype}
        self._setup(pattern, torch.empty(pattern.nnz, **factory),
                    torch.empty(out_features, **factory) if bias else None, activation)
        self.reset_parameters(generator)

    def _setup(self, pattern: Pattern, values: Tensor, bias: Optional[Tensor], activation: Optional[str]) -> None:
        self.activation = _check_activation(activation)
        self.in_features, self.out_features = pattern.in_features, pattern.out_features
        self.pattern = pattern
        self.values = nn.Parameter(values)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.fused_update = None
        self.pack_tiles = False
        self.tile_format = "fragments"
        self._packed = None
        _LAYER_OF_VALUES[self.values] = self

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # fused_update: an optimizer's, not the layer's (it holds the optimizer weakly); the packed
        # tiles: a copy of the values, packed again by the next forward that reads them.
        return {**state, "fused_update": None, "_packed": None}

    def __setstate__(self, state) -> None:
        # A copy (copy.deepcopy, pickle) is a layer of its own: no optimizer's update comes with it,
        # and an optimizer given its values finds it (a copy of that optimizer attaches its own).
        super().__setstate__(state)
        self.fused_update = None
        self.__dict__.setdefault("pack_tiles", False)  # a layer pickled before the packed tiles existed
        self.__dict__.setdefault("tile_format", "entries")  # ... or before the tile fragments
        self._packed = None
        _LAYER_OF_VALUES[self.values] = self

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Re-draws values and bias uniformly in +-1/sqrt(density * in_features); the pattern stays."""
        fan_in = max(1.0, self.density * self.in_features)
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            for p in (self.values, self.bias):
                if p is None:
                    continue
                if generator is not None and not _same_device(generator.device, p.device):
                    # Drawn where the generator lives (a CUDA generator says "cuda", the tensor "cuda:0").
                    drawn = torch.empty(p.shape, dtype=p.dtype, device=generator.device)
                    p.copy_(drawn.uniform_(-bound, bound, generator=generator))
                else:
                    p.uniform_(-bound, bound, generator=generator)

    # ---- construction helpers ----------------------------------------------------------------------
    @classmethod
    def _from_parts(cls, pattern: Pattern, values: Tensor, bias: Optional[Tensor]) -> "SparseLinear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(pattern, values, bias, None)
        return layer

    @classmethod
    def from_dense(cls, linear_or_weight: Union[nn.Linear, Tensor], density: Optional[float] = None, *,
                   sparsity: Optional[float] = None, mask: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                   index_dtype: Optional[torch.dtype] = None) -> "SparseLinear":
        """Builds a layer from a dense ``nn.Linear`` or weight ``[out, in]``.

        Keeps the ``nnz_for_density(out, in, density)`` entries of largest magnitude (ties go to the
        smaller row-major position), or exactly the non-zero entries of ``mask`` when one is given.
        The bias comes from the Linear, or from ``bias=``. The result lives on the weight's device and
        dtype.
        """
        if isinstance(linear_or_weight, nn.Linear):
            weight = linear_or_weight.weight
            if bias is None:
                bias = linear_or_weight.bias
        elif isinstance(linear_or_weight, Tensor):
            weight = linear_or_weight
        else:
            raise TypeError(f"SparseLinear.from_dense: expected nn.Linear or a Tensor, got {type(linear_or_weight)}")
        if weight.dim() != 2:
            raise ValueError(f"SparseLinear.from_dense: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        value_dtype(weight.dtype, "SparseLinear.from_dense")
        weight = weight.detach()
        out_features, in_features = weight.shape
        if mask is not None:
            if density is not None or sparsity is not None:
                raise ValueError("SparseLinear.from_dense: give mask= or density=/sparsity=, not both")
            if tuple(mask.shape) != tuple(weight.shape):
                raise ValueError(f"SparseLinear.from_dense: mask shape {tuple(mask.shape)} differs from weight shape "
                                 f"{tuple(weight.shape)}")
            pattern, positions = Pattern.from_mask(mask.to(weight.device), index_dtype=index_dtype)
        else:
            d = _resolve_density(density, sparsity)
            pattern, positions = Pattern.from_dense(weight, nnz_for_density(out_features, in_features, d),
                                                    index_dtype=index_dtype)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"SparseLinear.from_dense: bias shape {tuple(bias.shape)} != ({out_features},)")
        return cls._from_parts(pattern, weight.reshape(-1).index_select(0, positions).clone(),
                               bias.detach().clone().to(weight) if bias is not None else None)

    @classmethod
    def from_coo(cls, rows: Tensor, cols: Tensor, values: Tensor, out_features: int, in_features: int,
                 bias: Optional[Tensor] = None, index_dtype: Optional[torch.dtype] = None) -> "SparseLinear":
        """Builds a layer from COO triplets (any order). Out-of-range indices raise IndexError,
        repeated positions ValueError; values keep their device and dtype."""
        if not all(isinstance(t, Tensor) for t in (rows, cols, values)):
            raise TypeError("SparseLinear.from_coo: rows, cols and values must be tensors")
        value_dtype(values.dtype, "SparseLinear.from_coo")
        if values.dim() != 1 or rows.dim() != 1 or values.shape[0] != rows.shape[0]:
            raise ValueError(f"SparseLinear.from_coo: values must be 1-D with one entry per position, got shape "
                             f"{tuple(values.shape)} for rows of shape {tuple(rows.shape)}")
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (out_features,)):
            raise ValueError(f"SparseLinear.from_coo: bias must be a tensor of shape ({out_features},), got "
                             f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
        pattern, order = Pattern.from_coo(rows.to(values.device), cols.to(values.device), out_features, in_features,
                                          index_dtype=index_dtype)
        return cls._from_parts(pattern, values.detach().index_select(0, order).clone(),
                               bias.detach().clone().to(values) if bias is not None else None)

    # ---- the layer -------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        # Parameters and the pattern read from their dicts: nn.Module.__getattr__ costs ~0.7 us a
        # name, on every forward of every layer (eager host time).
        params = self._parameters
        values, bias, tensors = params["values"], params.get("bias"), self._modules["pattern"].tensors
        update = self.fused_update
        if (update is not None and values.requires_grad and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            return ops.sparse_linear_adamw(x, values, bias, tensors, **update.arguments(self),
                                           activation=self.activation)
        if self.pack_tiles:
            tiles = self._tiles_for(x, values, bias, tensors)
            if tiles is not None:
                y = ops.spmm(x.reshape(-1, self.in_features), values, tensors, bias, self.activation, tiles=tiles)
                return y.reshape(*x.shape[:-1], self.out_features)
        return ops.sparse_linear(x, values, bias, tensors, self.activation)

    def _tiles_for(self, x: Tensor, values: Tensor, bias: Optional[Tensor], tensors: list) -> Optional[Tensor]:
        """The values in tile order this forward reads (``pack_tiles``, as ``tile_format`` lays them
        out), packed again whenever the values or the pattern changed since; None where the forward
        runs without them: under autograd or ``torch.compile``, values that are not 16-bit or
        computed in another dtype (autocast), a pattern without the tile view, an input the layer
        would refuse."""
        if torch.compiler.is_compiling() or values.dtype not in SIXTEEN_BIT_DTYPES:
            return None
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or values.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            return None
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) != values.dtype:
            return None
        tile_ptr, entries = tensors[_TILE_PTR], tensors[_TILE_ENTRIES]
        if tile_ptr.numel() == 0:
            return None
        # What the packing copied: the values and the view, each by storage and in-place version.
        key = (values.data_ptr(), values._version, values.dtype, values.device,
               entries.data_ptr(), entries._version, tile_ptr.data_ptr(), tile_ptr._version, self.tile_format)
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # the old copy goes before the new one is made
            pack = TILE_FORMATS.get(self.tile_format)
            if pack is None:
                raise ValueError(f"SparseLinear.tile_format must be one of {sorted(TILE_FORMATS)}, "
                                 f"got {self.tile_format!r}")
            self._packed = (key, pack(values.detach(), tensors))
        return self._packed[1]

    def product_rows(self, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's input and output gradient of one call as the matrices of its product,
        ``[rows, in_features]`` and ``[rows, out_features]`` (RigL's scores are their ``dY^T X``)."""
        return x.reshape(-1, self.in_features), dy.reshape(-1, self.out_features)

    def gradient_rows(self, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
        """The matrices whose ``dZ^T X`` is the dense gradient of the layer's weight for one call:
        :meth:`product_rows` of ``x`` and of ``dy`` (the gradient at the layer's output) taken back
        through the fused activation to the product's output Z. Z is recomputed from ``x`` (one
        product without autograd) where the layer has an activation; ``x`` in a 16-bit dtype (a layer
        run under autocast) computes in it, as autocast does. RigL scores growth from these."""
        x2, dy2 = self.product_rows(x, dy)
        if self.activation == "none":
            return x2, dy2
        with torch.no_grad():
            bias = self.bias.to(x2.dtype) if self.bias is not None else None
            z = ops.sparse_linear(x2, self.values.to(x2.dtype), bias, self._modules["pattern"].tensors, "none")
            if self.activation == "relu":
                return x2, torch.ops.aten.threshold_backward(dy2, z, 0)
            return x2, torch.ops.aten.gelu_backward(dy2, z)

    def attach_fused_update(self, update) -> None:
        """Runs ``update``'s optimizer step of ``values`` inside the layer's backward from now on, in
        place of returning their gradient (None: detach, the backward returns gradients again).

        ``update`` provides ``arguments(layer) -> dict``, the keyword arguments of
        ``snack.ops.sparse_linear_adamw`` for this forward (state, hyper, update_guard, bias_state,
        bias_hyper); :class:`snack.optim.AdamW` attaches its own to the layers whose values it holds,
        and a newer one replaces an older one. Under ``torch.compile`` the layer always returns the
        gradient (the fusion is an eager and CUDA-graph optimisation)."""
        self.fused_update = update

    @property
    def row_idx(self) -> Tensor:
        """The slots' rows (the pattern's buffer, or derived from its row pointers where the pattern is
        kept for inference)."""
        return self.pattern.slot_rows()

    @property
    def col_idx(self) -> Tensor:
        """The slots' columns (the pattern's buffer)."""
        return self.pattern.col_idx

    @property
    def nnz(self) -> int:
        return self.values.shape[0]

    @property
    def density(self) -> float:
        return self.nnz / float(self.out_features * self.in_features)

    def to_dense(self) -> Tensor:
        """The weight as a dense ``[out, in]`` tensor (differentiable in ``values``)."""
        dense = self.values.new_zeros((self.out_features, self.in_features))
        return dense.index_put((self.pattern.slot_rows().long(), self.pattern.col_idx.long()), self.values)

    def mask(self) -> Tensor:
        """Boolean ``[out, in]`` tensor, True at the stored connections."""
        return self.pattern.to_mask()

    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` with the same weight and bias (the fused activation, if any, is not part of it)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.values.device, dtype=self.values.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def nbytes(self) -> dict[str, int]:
        """Bytes the layer holds: values, bias, its pattern (slots and views), the values in tile order
        where it holds them (``pack_tiles``), and their total."""
        tiles = self._packed[1] if self._packed is not None else None
        sizes = {"values": self.values.numel() * self.values.element_size(),
                 "bias": self.bias.numel() * self.bias.element_size() if self.bias is not None else 0,
                 "pattern": self.pattern.nbytes()["total"],
                 "tiles": tiles.numel() * tiles.element_size() if tiles is not None else 0}
        sizes["total"] = sum(sizes.values())
        return sizes

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation != "none" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nnz={self.nnz}, density={self.density:.4g}, index_dtype={self.pattern.index_dtype}{act}")

    # ---- dynamic sparse training -------------------------------------------------------------------
    def update_topology(self, drop: Tensor, grow: Tensor, *, optimizer=None, init=None,
                        state_reset: str = "zero", validate: bool = True) -> int:
        """Frees the slots ``drop`` and reconnects them at the positions ``grow`` (linear ``row * in_features + col``).

        nnz never changes. The slots are re-sorted, and the same permutation is applied in place to
        ``values``, its gradient and every optimizer state tensor shaped like ``values`` (SGD momentum,
        Adam's moments, ...), so parameters keep their identity and optimizers, schedulers and
        checkpoints stay valid. Grown connections get values from ``init`` (zero by default) and their
        optimizer state is reset (``state_reset="zero"``; ``"mean"`` uses the mean over the kept slots,
        e.g. to keep Adam's second moment at the layer's scale). Everything is validated before anything
        changes: a bad ``drop``/``grow`` raises and leaves layer and optimizer untouched.
        ``validate=False`` skips those checks (and their host synchronisations) for ``drop``/``grow``
        that come from snack's own primitives (``snack.dst.prune_magnitude``, ``grow_random``,
        ``grow_gradient``). Returns the number of connections moved.
        """
        update = self.prepare_topology_update(drop, grow, optimizer=optimizer, init=init, state_reset=state_reset,
                                              validate=validate)
        return self.commit_topology_update(update)

    def prepare_topology_update(self, drop: Tensor, grow: Tensor, *, optimizer=None, init=None,
                                state_reset: str = "zero", validate: bool = True) -> "TopologyUpdate":
        """The first half of :meth:`update_topology`: checks everything and computes the new slots,
        changing nothing. ``commit_topology_update`` applies the result (DSTScheduler prepares every
        layer's update before it commits any, so that one failing layer leaves all as they were)."""
        if state_reset not in ("zero", "mean"):
            raise ValueError(f"state_reset must be 'zero' or 'mean', got {state_reset!r}")
        if not (isinstance(drop, Tensor) and isinstance(grow, Tensor)):
            raise TypeError("update_topology: drop and grow must be tensors of slot indices and positions")
        device = self.values.device
        drop = drop.to(device)
        row_idx, col_idx, source = ops.replace_slots(self.pattern.slot_rows(), self.pattern.col_idx, drop,
                                                     grow.to(device), self.out_features, self.in_features, validate)
        # Values for grown connections (a scalar, or one per slot of which the grown ones are kept):
        # no host sync here.
        fresh = _init_new_values(self, self.nnz, init)
        states = _per_slot_state(optimizer, self.values)
        for state in states:
            if state.device != device:
                raise ValueError(f"update_topology: an optimizer state of the values is on {state.device}, the "
                                 f"layer on {device}")
        return TopologyUpdate(self, row_idx, col_idx, source, drop, fresh, states, state_reset)

    def commit_topology_update(self, update: "TopologyUpdate") -> int:
        """Applies a prepared update (nothing left to check): remaps the per-slot tensors and moves the slots."""
        if update.layer is not self:
            raise ValueError("commit_topology_update: the update was prepared for another layer")

        def remap(t: Tensor, fill: Optional[Tensor]) -> None:
            """t <- t[source], with `fill` at the grown slots (None: the mean over the kept ones)."""
            if fill is None:  # the kept slots' sum is the whole sum less the dropped slots'
                fill = (t.sum() - t.index_select(0, update.drop).sum()) / max(1, self.nnz - update.drop.numel())
            # A 0-dim device tensor as the fill: never read on the host (no sync).
            ops.remap_slots_(t, update.source, fill.to(t.dtype))

        with torch.no_grad():
            for state in update.states:
                remap(state, None if update.state_reset == "mean" else state.new_zeros(()))
            if self.values.grad is not None:
                remap(self.values.grad, self.values.grad.new_zeros(()))
            remap(self.values, update.fresh)
        self.pattern.set_slots(update.row_idx, update.col_idx, validate=False)  # replace_slots' output
        return int(update.drop.numel())

    # ---- checkpoints -----------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # All or nothing for the layer: every entry (values, bias, the pattern's slots) is checked
        # before any is loaded. If one is missing, unexpected or wrong, none is loaded and torch is
        # told why (missing/unexpected keys, error messages): values only make sense with their slots.
        # torch passes strict=True to every module and applies the caller's strict at the end, so a
        # non-strict load that misses an entry of the layer leaves the layer as it was, and says so.
        # (torch loads a model module by module: other modules' entries follow its own rules.)
        # Checkpoints written before the pattern was a module of its own keep the slots at the layer.
        for name in ("row_idx", "col_idx"):
            if prefix + name in state_dict and prefix + "pattern." + name not in state_dict:
                state_dict[prefix + "pattern." + name] = state_dict.pop(prefix + name)
        own = ["values"] + (["bias"] if self.bias is not None else [])
        slots = ["pattern.row_idx", "pattern.col_idx"]
        try:
            extra = unexpected_keys_of(state_dict, prefix, own + slots)
            missing = [prefix + n for n in own + slots if prefix + n not in state_dict]
            if extra or missing:
                unexpected_keys.extend(extra)
                missing_keys.extend(missing)
                raise _Refused()
            for name, param in (("values", self.values), ("bias", self.bias)):
                if param is not None:
                    t = checkpoint_tensor(state_dict, prefix + name)
                    if t.shape != param.shape:
                        raise ValueError(f"size mismatch for {prefix}{name}: the checkpoint has {tuple(t.shape)}, "
                                         f"the layer {tuple(param.shape)} (nnz={self.nnz}, out_features="
                                         f"{self.out_features}; build the layer with the checkpoint's density)")
                    if not (t.dtype.is_floating_point and not t.is_complex()):
                        raise TypeError(f"{prefix}{name}: expected floating-point values, got {t.dtype}")
            # The checkpoint's slots, validated and sorted once, here: the pattern (loaded after this
            # module) takes them as they are, and the values follow their order.
            row_idx, col_idx, order = self.pattern.checked_slots(state_dict, prefix + "pattern.")
            state_dict[prefix + "values"] = state_dict[prefix + "values"].to(self.values.device)[order]
        except _Refused:
            self.pattern._parent_verdict = REFUSE
            return
        except (TypeError, ValueError, IndexError) as error:
            error_msgs.append(str(error))
            self.pattern._parent_verdict = REFUSE
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.pattern._parent_verdict = (row_idx, col_idx)  # torch loads the pattern right after this module


class TopologyUpdate(NamedTuple):
    """A checked topology update of one layer (SparseLinear.prepare_topology_update), not applied yet."""
    layer: nn.Module
    row_idx: Tensor
    col_idx: Tensor
    source: Tensor
    drop: Tensor
    fresh: Tensor
    states: list
    state_reset: str


class _Refused(Exception):
    """The checkpoint misses entries of the layer or has unexpected ones (listed for torch): load nothing."""


def _per_slot_state(optimizer, param: Tensor) -> list:
    """The optimizer state tensors of `param` that hold one entry per slot (momentum, moments, ...)."""
    if optimizer is None:
        return []
    return [v for v in optimizer.state.get(param, {}).values() if torch.is_tensor(v) and v.shape == param.shape]


def check_grow_init(init, owner: str = "grow_init") -> None:
    """Raises unless ``init`` is a value rule update_topology accepts (see _init_new_values)."""
    if init is None or (isinstance(init, str) and init in ("zero", "uniform")) or callable(init):
        return
    if isinstance(init, Tensor) and init.numel() == 1 and init.dtype.is_floating_point:
        return
    if isinstance(init, numbers.Real) and not isinstance(init, bool):
        return
    raise ValueError(f"{owner}: unknown grow init {init!r}: use 'zero', 'uniform', a number or a "
                     "callable(count, device, dtype) -> Tensor")


def _init_new_values(layer: "SparseLinear", count: int, init) -> Tensor:
    """Values for grown connections: "zero" (default) or a number as a 0-dim tensor; "uniform" (the
    layer's init bound) or a callable(count, device, dtype) -> Tensor as `count` candidates, one per
    slot, of which update_topology keeps those of the grown slots (so it needs no host sync)."""
    check_grow_init(init)
    kw = {"device": layer.values.device, "dtype": layer.values.dtype}
    if init is None or (isinstance(init, str) and init == "zero"):
        return torch.zeros((), **kw)
    if isinstance(init, str):  # "uniform"
        bound = 1.0 / math.sqrt(max(1.0, layer.density * layer.in_features))
        return torch.empty(count, **kw).uniform_(-bound, bound)
    if isinstance(init, Tensor):
        return init.detach().to(**kw).reshape(())
    if callable(init):
        out = torch.as_tensor(init(count, kw["device"], kw["dtype"]), **kw)
        if out.shape != (count,):
            raise ValueError(f"grow_init returned shape {tuple(out.shape)}, expected ({count},)")
        return out
    return torch.full((), float(init), **kw)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """True when a and b name the same device ("cuda" means the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def layer_of(values: Tensor) -> Optional[SparseLinear]:
    """The SparseLinear whose ``values`` Parameter this is, or None."""
    return _LAYER_OF_VALUES.get(values)


def prepare_ddp(model: nn.Module) -> list[str]:
    """Call before wrapping ``model`` in DistributedDataParallel.

    DDP broadcasts every buffer from rank 0, and its backends cannot send uint16 tensors, so the
    buffers of every Pattern (slot indices and derived views) are excluded from that broadcast. Build
    the model identically on every rank (same seed) and let ``snack.dst.DSTScheduler`` keep the
    topologies identical during training (it applies rank 0's decisions everywhere). Returns the
    excluded buffer names.
    """
    names = [f"{prefix}.{buf}" if prefix else buf
             for prefix, module in model.named_modules() if isinstance(module, Pattern)
             for buf, _ in module.named_buffers(recurse=False)]
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, existing + names)
    return names
