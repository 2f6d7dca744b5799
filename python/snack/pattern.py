"""Pattern: which positions of a sparse weight are stored, and the views its operators read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ._checks import checkpoint_tensor, integer, unexpected_keys as unexpected_keys_of
from ._ops import PATTERN_FIELDS, ops

_SLOTS = ("row_idx", "col_idx")
#: The views a pattern derives from its slots (every field of PATTERN_FIELDS after the slots).
_VIEWS = PATTERN_FIELDS[len(_SLOTS):]
#: A parent's verdict on a checkpoint: load nothing (see Pattern._parent_verdict).
REFUSE = object()


class Pattern(nn.Module):
    r"""The ``nnz`` stored positions of an ``out_features x in_features`` weight, and their views.

    The slots are kept sorted row-major in two buffers, ``row_idx`` and ``col_idx`` (uint16 when both
    dimensions are at most 65536, else int32), which ``state_dict`` holds. From them the pattern
    derives, on the slots' device, the views the kernels read: CSR row pointers (``row_ptr``), a
    CSC view (``col_ptr``, ``csc_perm``, a permutation into the same slots) and the tile view of the
    16-bit tensor-core forward, dX and dW (``tile_ptr``, ``tile_entries``: each 64 x 64 tile's slots listed
    contiguously, 4 bytes per slot; empty for more than 16384 inputs), left out of ``state_dict``.
    ``tensors`` is the list every snack operator takes, in the C++ library's order.

    :meth:`for_inference` keeps only what the forward products read (``col_idx``, ``row_ptr``,
    ``col_ptr``, and the tile view if asked): a model served, never trained, stores 2 bytes of index
    per slot (uint16) instead of 12. :meth:`for_training` rebuilds the rest, and
    ``for_training(tile_view=False)`` leaves out the tile view of a layer that never computes in 16
    bits (4 bytes per slot, and its build in every topology update).

    A pattern changes only through :meth:`set_slots`, which keeps ``nnz``, copies the new slots in
    place and rebuilds every view in place: a CUDA graph captured with the pattern keeps reading
    valid memory across topology updates. Build one with :meth:`random`, :meth:`from_coo`,
    :meth:`from_dense` or :meth:`from_mask`, or from sorted slots with the constructor.

    What enters a pattern is validated once (O(nnz), one host copy for device tensors): slots in
    range, sorted row-major, no repeats; a checkpoint's slots likewise, before anything is loaded.
    The views are always derived here, never taken from outside, so every pattern the operators
    see is consistent (the CUDA operators trust their pattern list; see ``snack.ops.validate_pattern``).

    Args:
        row_idx, col_idx: ``[nnz]`` uint16 or int32 slot indices, sorted row-major.
        out_features, in_features: the weight's shape (M, K).
        validate: check the slots (default). ``False`` is for slots made by snack's own operators.
    """

    def __init__(self, row_idx: Tensor, col_idx: Tensor, out_features: int, in_features: int, *,
                 validate: bool = True) -> None:
        super().__init__()
        out_features = integer(out_features, "out_features", "Pattern", minimum=1)
        in_features = integer(in_features, "in_features", "Pattern", minimum=1)
        if not (isinstance(row_idx, Tensor) and isinstance(col_idx, Tensor)):
            raise TypeError(f"Pattern: row_idx and col_idx must be tensors, got {type(row_idx).__name__} and "
                            f"{type(col_idx).__name__}")
        if validate:
            ops.validate_slots(row_idx, col_idx, out_features, in_features)
        self.out_features, self.in_features = out_features, in_features
        # What the parent layer decided about the checkpoint it is loading (None: load on our own):
        # REFUSE (it found the checkpoint invalid and said why), or the slots it already checked.
        self._parent_verdict = None
        # The arrays held (for_inference, for_training): all but row_idx and csc_perm where
        # forward_only, the tile view where tile_view.
        self._forward_only, self._tile_view = False, True
        self.register_buffer("row_idx", row_idx)
        self.register_buffer("col_idx", col_idx)
        for name, view in zip(_VIEWS, self._views(row_idx, col_idx), strict=True):
            self.register_buffer(name, view, persistent=False)

    # ---- constructors ------------------------------------------------------------------------------
    @classmethod
    def random(cls, out_features: int, in_features: int, nnz: int, *, generator: Optional[torch.Generator] = None,
               device=None, index_dtype: Optional[torch.dtype] = None) -> "Pattern":
        """``nnz`` positions drawn uniformly at random without replacement (``generator`` may live on
        the CPU or on ``device``)."""
        row_idx, col_idx = ops.random_slots(out_features, in_features, nnz, generator=generator,
                                            device=torch.device(device) if device is not None else None,
                                            index_dtype=index_dtype)
        return cls(row_idx, col_idx, out_features, in_features, validate=False)

    @classmethod
    def from_coo(cls, rows: Tensor, cols: Tensor, out_features: int, in_features: int,
                 index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The positions ``(rows[i], cols[i])``, any order, on their device. Returns the pattern and
        ``order``: slot s holds position ``order[s]`` (sort values with ``values[order]``).
        Out-of-range positions raise IndexError, repeated ones ValueError."""
        row_idx, col_idx, order = ops.slots_from_coo(rows, cols, out_features, in_features, index_dtype=index_dtype)
        return cls(row_idx, col_idx, out_features, in_features, validate=False), order

    @classmethod
    def from_dense(cls, weight: Tensor, nnz: int, index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The ``nnz`` entries of largest magnitude of a dense ``[out, in]`` weight (ties to the smaller
        row-major position). Returns the pattern and the ascending linear positions it keeps."""
        row_idx, col_idx, positions = ops.slots_from_dense(weight, nnz, index_dtype=index_dtype)
        return cls(row_idx, col_idx, weight.shape[0], weight.shape[1], validate=False), positions

    @classmethod
    def from_mask(cls, mask: Tensor, index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The non-zero entries of a ``[out, in]`` mask. Returns the pattern and its linear positions."""
        row_idx, col_idx, positions = ops.slots_from_mask(mask, index_dtype=index_dtype)
        return cls(row_idx, col_idx, mask.shape[0], mask.shape[1], validate=False), positions

    # ---- what the operators read -------------------------------------------------------------------
    @property
    def tensors(self) -> list[Tensor]:
        """The pattern's tensors in the order snack's operators take them."""
        # Read from the buffer dict: nn.Module.__getattr__ costs ~0.7 us per buffer, on every
        # forward of every layer.
        buffers = self._buffers
        return [buffers[name] for name in PATTERN_FIELDS]

    def _views(self, row_idx: Tensor, col_idx: Tensor):
        return ops.build_views(row_idx, col_idx, self.out_features, self.in_features, self._tile_view)

    def set_slots(self, row_idx: Tensor, col_idx: Tensor, *, validate: bool = True) -> None:
        """Moves the connections to the slots ``row_idx``/``col_idx`` (same count, sorted row-major):
        copied in place, and every view rebuilt in place. ``validate=False`` skips the check of the
        slots (and its host copy) for slots from snack's own operators (``replace_slots``), as a
        topology update inside a captured CUDA graph needs."""
        if row_idx.shape != self.col_idx.shape or col_idx.shape != self.col_idx.shape:
            raise ValueError(f"Pattern.set_slots: the slot count never changes ({self.nnz}), got "
                             f"{tuple(row_idx.shape)} and {tuple(col_idx.shape)}")
        if validate:
            ops.validate_slots(row_idx, col_idx, self.out_features, self.in_features)
        views = self._views(row_idx, col_idx)  # before anything is copied
        with torch.no_grad():
            for name, t in zip(PATTERN_FIELDS, (row_idx, col_idx, *views), strict=True):
                if name not in self._dropped():
                    getattr(self, name).copy_(t)

    def _dropped(self) -> tuple[str, ...]:
        """The fields a pattern kept for inference does not hold (empty tensors in ``tensors``)."""
        return ("row_idx", "csc_perm") if self._forward_only else ()

    # ---- which arrays it holds ---------------------------------------------------------------------
    @property
    def forward_only(self) -> bool:
        """True while the pattern is kept for inference (:meth:`for_inference`)."""
        return self._forward_only

    @property
    def has_tile_view(self) -> bool:
        """Whether the pattern holds the tile view (built unless left out, for at most 16384 inputs)."""
        return self.tile_ptr.numel() > 0

    def _hold(self, forward_only: bool, tile_view: bool) -> "Pattern":
        """Holds the arrays of that form, in place (new tensors where the form changes)."""
        if (forward_only, tile_view) == (self._forward_only, self._tile_view):
            return self
        with torch.inference_mode(False):  # buffers, not inference tensors, even under inference_mode
            row_idx = self.slot_rows()
            self._forward_only, self._tile_view = forward_only, tile_view
            views = self._views(row_idx, self.col_idx)
            for name, t in zip(PATTERN_FIELDS, (row_idx, self.col_idx, *views), strict=True):
                setattr(self, name, t.new_empty((0,)) if name in self._dropped() else t)
        return self

    def for_inference(self, *, tile_view: bool = False) -> "Pattern":
        """Keeps only what the forward products read, in place, and returns the pattern.

        Drops the slots' rows (``row_idx``, 2 or 4 bytes per slot) and the CSC permutation
        (``csc_perm``, 4 bytes per slot), and the tile view (4 bytes per slot) unless ``tile_view``:
        the 16-bit tensor-core forward reads it at batches of 17 to 128 rows, and without it the
        planner takes another kernel. Kept: ``col_idx``, ``row_ptr``, ``col_ptr``.

        The forward products run as before: the layer's forward where no gradient is needed
        (``torch.no_grad``, ``torch.inference_mode``, frozen inputs and values), ``snack.ops.spmm``,
        ``spmm_channels_first`` and sparse attention's forward. What needs the dropped arrays (dX,
        dW, attention's backward) raises ValueError until :meth:`for_training` rebuilds them; a
        layer's forward that would need them later raises at once. Topology updates (``set_slots``)
        still work and keep the pattern as it is. ``state_dict`` still holds ``row_idx`` (derived from
        ``row_ptr``), so a checkpoint loads the same into either form. Where the arrays held change,
        they are new tensors: capture CUDA graphs after the change.

        Args:
            tile_view: keep the tile view (where the layer has one: at most 16384 inputs).
        """
        return self._hold(True, bool(tile_view))

    def for_training(self, *, tile_view: bool = True) -> "Pattern":
        """Holds every array the training products read, in place, and returns the pattern: rebuilds
        what :meth:`for_inference` dropped (the slots stay).

        Args:
            tile_view: hold the tile view (default). ``False`` leaves it out, for a layer whose
                products never run in 16 bits (float32 values, no ``torch.autocast``): 4 bytes less
                per slot, and one build less in every topology update; the 16-bit products then run
                the planner's other kernels. (New tensors where the arrays held change, as above.)
        """
        return self._hold(False, bool(tile_view))

    def slot_rows(self) -> Tensor:
        """The row of every slot (``[nnz]``, the index dtype): ``row_idx``, or, while the pattern is
        kept for inference, derived from ``row_ptr`` (no host synchronisation)."""
        if not self._forward_only:
            return self.row_idx
        rows = torch.arange(self.out_features, dtype=torch.int32, device=self.row_ptr.device)
        return torch.repeat_interleave(rows, self.row_ptr.diff(), output_size=self.nnz).to(self.index_dtype)

    # ---- what it is --------------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return self.col_idx.shape[0]

    @property
    def density(self) -> float:
        return self.nnz / float(self.out_features * self.in_features)

    @property
    def index_dtype(self) -> torch.dtype:
        return self.row_idx.dtype

    def nbytes(self) -> dict[str, int]:
        """Bytes the pattern holds: its slots, each view, and their total."""
        sizes = {name: t.numel() * t.element_size() for name, t in zip(PATTERN_FIELDS, self.tensors)}
        sizes["total"] = sum(sizes.values())
        return sizes

    def positions(self) -> Tensor:
        """The linear positions ``row * in_features + col`` of the slots, ascending (int64)."""
        return self.slot_rows().long() * self.in_features + self.col_idx.long()

    def to_mask(self) -> Tensor:
        """Boolean ``[out, in]`` tensor, True at the stored positions (for inspection: it is dense)."""
        mask = torch.zeros((self.out_features, self.in_features), dtype=torch.bool, device=self.col_idx.device)
        mask[self.slot_rows().long(), self.col_idx.long()] = True
        return mask

    def extra_repr(self) -> str:
        kept = (", for_inference" if self._forward_only else "") + ("" if self._tile_view else ", tile_view=False")
        return (f"out_features={self.out_features}, in_features={self.in_features}, nnz={self.nnz}, "
                f"index_dtype={self.index_dtype}{kept}")

    # ---- copies (pickle, copy.deepcopy, torch.save of the module) ---------------------------------
    def __getstate__(self) -> dict:
        # torch cannot pickle uint16 tensors (its storage unpickler has no such dtype): they travel
        # as int32 and are narrowed back.
        state = super().__getstate__()
        buffers = state["_buffers"]
        narrow = [name for name, t in buffers.items() if t is not None and t.dtype == torch.uint16]
        state["_buffers"] = {name: t.to(torch.int32) if name in narrow else t for name, t in buffers.items()}
        state["_uint16_buffers"] = narrow
        return state

    def __setstate__(self, state: dict) -> None:
        narrow = state.pop("_uint16_buffers", [])
        state.setdefault("_forward_only", False)  # pickled before patterns held a choice of arrays
        state.setdefault("_tile_view", True)
        super().__setstate__(state)
        for name in narrow:
            self._buffers[name] = self._buffers[name].to(torch.uint16)

    # ---- checkpoints -------------------------------------------------------------------------------
    def checked_slots(self, state_dict: dict, prefix: str) -> tuple[Tensor, Tensor, Tensor]:
        """The checkpoint's slots under ``prefix`` validated for this pattern (same count, in range, no
        repeats), sorted row-major on this pattern's device, with ``order`` (slot s holds the
        checkpoint's entry order[s]). Raises TypeError / ValueError / IndexError naming the entry."""
        rows, cols = (checkpoint_tensor(state_dict, prefix + name) for name in _SLOTS)
        for key, t in zip(_SLOTS, (rows, cols)):
            if t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
                raise TypeError(f"{prefix}{key}: slot indices must be integers, got {t.dtype}")
        if rows.shape != self.col_idx.shape or cols.shape != self.col_idx.shape:
            raise ValueError(f"size mismatch for {prefix}row_idx/col_idx: the checkpoint has {tuple(rows.shape)}/"
                             f"{tuple(cols.shape)} slots, the pattern has nnz={self.nnz} (build the layer with "
                             "the checkpoint's density)")
        device = self.col_idx.device
        return ops.slots_from_coo(rows.to(device=device, dtype=torch.long), cols.to(device=device, dtype=torch.long),
                                  self.out_features, self.in_features, index_dtype=self.index_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.forward_only:  # the same checkpoint as the whole pattern's
            destination[prefix + "row_idx"] = self.slot_rows()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Atomic: the slots are validated before either is copied, and both load or neither does.
        verdict, self._parent_verdict = self._parent_verdict, None
        if verdict is REFUSE:
            return
        if verdict is not None:  # checked and sorted by the layer, with its values
            self.set_slots(*verdict, validate=False)
            return
        # (torch passes strict=True to every module and applies the caller's strict at the end.)
        extra = unexpected_keys_of(state_dict, prefix, _SLOTS)
        missing = [prefix + name for name in _SLOTS if prefix + name not in state_dict]
        if extra or missing:
            unexpected_keys.extend(extra)
            missing_keys.extend(missing)
            return
        try:
            row_idx, col_idx, order = self.checked_slots(state_dict, prefix)
        except (TypeError, ValueError, IndexError) as error:
            error_msgs.append(str(error))
            return
        if not torch.equal(order, torch.arange(order.numel(), device=order.device)):
            # Slots out of order would no longer match values loaded elsewhere.
            error_msgs.append(f"{prefix}row_idx/col_idx are not sorted row-major: load them through their layer "
                              "(SparseLinear.load_state_dict sorts the values with them)")
            return
        self.set_slots(row_idx, col_idx, validate=False)
