"""Pattern: which positions of a sparse weight are stored, and the views its operators read."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ._ops import PATTERN_FIELDS, ops

_SLOTS = ("row_idx", "col_idx")


class Pattern(nn.Module):
    r"""The ``nnz`` stored positions of an ``out_features x in_features`` weight, and their views.

    The slots are kept sorted row-major in two buffers, ``row_idx`` and ``col_idx`` (uint16 when both
    dimensions are at most 65536, else int32), which ``state_dict`` holds. From them the pattern
    derives, on the slots' device, the views the kernels read: CSR row pointers (``row_ptr``) and a
    CSC view (``col_ptr``, ``csc_perm``, a permutation into the same slots), left out of
    ``state_dict``. ``tensors`` is the list every snack operator takes, in the C++ library's order.

    A pattern changes only through :meth:`set_slots`, which keeps ``nnz``, copies the new slots in
    place and rebuilds every view in place: a CUDA graph captured with the pattern keeps reading
    valid memory across topology updates. Build one with :meth:`random`, :meth:`from_coo`,
    :meth:`from_dense` or :meth:`from_mask`; the constructor itself trusts its slots.
    """

    def __init__(self, row_idx: Tensor, col_idx: Tensor, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.register_buffer("row_idx", row_idx)
        self.register_buffer("col_idx", col_idx)
        for name, view in zip(("row_ptr", "col_ptr", "csc_perm"), self._views(row_idx, col_idx)):
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
        return cls(row_idx, col_idx, out_features, in_features)

    @classmethod
    def from_coo(cls, rows: Tensor, cols: Tensor, out_features: int, in_features: int,
                 index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The positions ``(rows[i], cols[i])``, any order, on their device. Returns the pattern and
        ``order``: slot s holds position ``order[s]`` (sort values with ``values[order]``).
        Out-of-range positions raise IndexError, repeated ones ValueError."""
        row_idx, col_idx, order = ops.slots_from_coo(rows, cols, out_features, in_features, index_dtype=index_dtype)
        return cls(row_idx, col_idx, out_features, in_features), order

    @classmethod
    def from_dense(cls, weight: Tensor, nnz: int, index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The ``nnz`` entries of largest magnitude of a dense ``[out, in]`` weight (ties to the smaller
        row-major position). Returns the pattern and the ascending linear positions it keeps."""
        row_idx, col_idx, positions = ops.slots_from_dense(weight, nnz, index_dtype=index_dtype)
        return cls(row_idx, col_idx, weight.shape[0], weight.shape[1]), positions

    @classmethod
    def from_mask(cls, mask: Tensor, index_dtype: Optional[torch.dtype] = None) -> tuple["Pattern", Tensor]:
        """The non-zero entries of a ``[out, in]`` mask. Returns the pattern and its linear positions."""
        row_idx, col_idx, positions = ops.slots_from_mask(mask, index_dtype=index_dtype)
        return cls(row_idx, col_idx, mask.shape[0], mask.shape[1]), positions

    # ---- what the operators read -------------------------------------------------------------------
    @property
    def tensors(self) -> list[Tensor]:
        """The pattern's tensors in the order snack's operators take them."""
        return [getattr(self, name) for name in PATTERN_FIELDS]

    def _views(self, row_idx: Tensor, col_idx: Tensor):
        return ops.build_views(row_idx, col_idx, self.out_features, self.in_features)

    def set_slots(self, row_idx: Tensor, col_idx: Tensor) -> None:
        """Moves the connections to the sorted, valid slots ``row_idx``/``col_idx`` (same count):
        copied in place, and every view rebuilt in place."""
        if row_idx.shape != self.row_idx.shape or col_idx.shape != self.col_idx.shape:
            raise ValueError(f"Pattern.set_slots: the slot count never changes ({self.nnz}), got "
                             f"{tuple(row_idx.shape)} and {tuple(col_idx.shape)}")
        views = self._views(row_idx, col_idx)  # before anything is copied
        with torch.no_grad():
            self.row_idx.copy_(row_idx)
            self.col_idx.copy_(col_idx)
            self._copy_views(views)

    def _copy_views(self, views) -> None:
        with torch.no_grad():
            for name, view in zip(("row_ptr", "col_ptr", "csc_perm"), views):
                getattr(self, name).copy_(view)

    # ---- what it is --------------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return self.row_idx.shape[0]

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
        return self.row_idx.long() * self.in_features + self.col_idx.long()

    def to_mask(self) -> Tensor:
        """Boolean ``[out, in]`` tensor, True at the stored positions (for inspection: it is dense)."""
        mask = torch.zeros((self.out_features, self.in_features), dtype=torch.bool, device=self.row_idx.device)
        mask[self.row_idx.long(), self.col_idx.long()] = True
        return mask

    def extra_repr(self) -> str:
        return (f"out_features={self.out_features}, in_features={self.in_features}, nnz={self.nnz}, "
                f"index_dtype={self.index_dtype}")

    # ---- checkpoints -------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        keys = [prefix + name for name in _SLOTS]
        if not all(k in state_dict for k in keys):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            return
        rows, cols = (state_dict[k] for k in keys)
        if rows.shape != self.row_idx.shape or cols.shape != self.col_idx.shape:
            error_msgs.append(f"size mismatch for {prefix}row_idx/col_idx: the checkpoint has {tuple(rows.shape)}/"
                              f"{tuple(cols.shape)} slots, the pattern has nnz={self.nnz}")
            return
        # Untrusted: validated (in range, no repeats) before anything changes. A layer that loads its
        # values with the pattern has sorted both already; slots out of order here would no longer
        # match values loaded elsewhere, so they are refused.
        row_idx, col_idx, order = ops.slots_from_coo(rows.long().to(self.row_idx.device),
                                                     cols.long().to(self.row_idx.device), self.out_features,
                                                     self.in_features, index_dtype=self.index_dtype)
        if not torch.equal(order, torch.arange(order.numel(), device=order.device)):
            error_msgs.append(f"{prefix}row_idx/col_idx are not sorted row-major: load them through their layer "
                              "(SparseLinear.load_state_dict sorts the values with them)")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._copy_views(self._views(self.row_idx, self.col_idx))  # the views of the loaded slots
