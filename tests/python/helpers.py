"""Shared test helpers: random patterns with odd shapes, float64 references, relative errors."""

from __future__ import annotations

import torch

import snack

ops = snack.ops


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are empty or zero); NaN never passes."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out64.shape == ref64.shape, (out64.shape, ref64.shape)
    assert torch.isfinite(out64).all(), "output has non-finite entries (unwritten or NaN)"
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed against float64 on inputs of `dtype` (the 16-bit types accumulate in
    float32 and round each output once: their error is their unit roundoff, 2^-8 and 2^-11)."""
    return {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def random_positions(m: int, k: int, nnz: int, gen: torch.Generator, empty_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """nnz distinct positions in an m x k matrix, in random order; the first `empty_rows` random rows stay empty."""
    rows_allowed = torch.randperm(m, generator=gen)[empty_rows:]
    allowed = (rows_allowed[:, None] * k + torch.arange(k)[None, :]).reshape(-1)
    nnz = min(nnz, allowed.numel())
    chosen = allowed[torch.randperm(allowed.numel(), generator=gen)[:nnz]]
    return chosen // k, chosen % k


class Pattern:
    """A pattern built through snack's own constructor, with its dense float64 twin."""

    def __init__(self, m, k, nnz, *, device, dtype=torch.float32, index_dtype=None, seed=0, empty_rows=0,
                 positions=None):
        gen = torch.Generator().manual_seed(seed)
        rows, cols = positions if positions is not None else random_positions(m, k, nnz, gen, empty_rows)
        values = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)
        self.m, self.k = m, k
        self.row_idx, self.col_idx, order = ops.slots_from_coo(rows.to(device), cols.to(device), m, k,
                                                               index_dtype=index_dtype)
        self.values = values.to(device)[order].to(dtype)
        self.row_ptr, self.col_ptr, self.csc_perm = ops.build_views(self.row_idx, self.col_idx, m, k)
        self.dense64 = torch.zeros(m, k, dtype=torch.float64)
        self.dense64[rows, cols] = values.to(dtype).double()  # the stored (rounded) values
        self.device, self.dtype = torch.device(device), dtype

    @property
    def tensors(self):
        return (self.row_idx, self.col_idx, self.row_ptr, self.col_ptr, self.csc_perm)

    @property
    def nnz(self):
        return self.values.numel()

    def randn(self, *shape, seed=1):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(self.device, self.dtype)


# (M, K, N, nnz, empty_rows): odd sizes, K not a multiple of 4 or 8, N=1, empty rows, nnz=0, full.
ODD_SHAPES = [
    (1, 1, 1, 1, 0),
    (7, 13, 3, 40, 0),
    (33, 65, 1, 200, 5),
    (64, 37, 17, 500, 10),
    (130, 257, 5, 1700, 30),
    (9, 11, 4, 0, 0),
    (5, 6, 2, 30, 0),
    (300, 50, 33, 1500, 0),
]


def poison_cache(device: torch.device, numel: int = 1 << 20) -> None:
    """Fills memory the allocator is about to hand out with NaN, so that unwritten outputs show."""
    t = torch.full((numel,), float("nan"), device=device)
    del t


def skewed_positions(m: int, k: int, dense_rows: int, nnz_rest: int, seed: int = 0, transpose: bool = False):
    """A few completely full rows (or columns, with transpose=True) plus random positions elsewhere:
    row lengths far above the average, as in power-law patterns."""
    gen = torch.Generator().manual_seed(seed)
    if transpose:
        cols, rows = skewed_positions(k, m, dense_rows, nnz_rest, seed)
        return rows, cols
    full = torch.arange(dense_rows * k)
    rest = dense_rows * k + torch.randperm((m - dense_rows) * k, generator=gen)[:nnz_rest]
    pos = torch.cat([full, rest])
    return pos // k, pos % k
