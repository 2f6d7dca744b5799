"""Shared test helpers: random sparse weights with odd shapes and their float64 twins, element-wise
checks against float64 references."""

from __future__ import annotations

import torch

import snack

ops = snack.ops


def tolerance(dtype: torch.dtype) -> float:
    """Error allowed per element, relative to the sum of the magnitudes of the terms that made it
    (float64 references): the 16-bit types accumulate in float32 and round each output once, so
    their error is within their unit roundoff (2^-8 for bfloat16, 2^-11 for float16): one unit for
    bfloat16, two for float16."""
    return {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2 ** -8, torch.float16: 1e-3}[dtype]


def subnormal_spacing(dtype: torch.dtype) -> float:
    """The absolute error of rounding to `dtype` near zero, where its values are subnormal: a 16-bit
    result there is off by up to half this spacing whatever the relative tolerance."""
    return {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}.get(dtype, 1e-300)


def assert_close(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Every element of `out` finite and within tolerance(dtype) * scale of `ref` (scale: the sum of
    the magnitudes of the terms of each element, float64); names the worst elements otherwise."""
    out64 = out.detach().double().cpu()
    ref64, scale64 = ref.double().cpu(), scale.double().cpu()
    assert out64.shape == ref64.shape, (what, out64.shape, ref64.shape)
    bad = ~torch.isfinite(out64)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} non-finite elements (unwritten or NaN)"
    excess = (out64 - ref64).abs() - tolerance(dtype) * scale64 - subnormal_spacing(dtype)
    if bool((excess > 0).any()):
        worst = torch.topk(excess.flatten(), min(3, excess.numel())).indices
        detail = ", ".join(f"[{int(i)}] {out64.flatten()[i].item():.8g} vs {ref64.flatten()[i].item():.8g}"
                           for i in worst)
        raise AssertionError(f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements off ({detail})")


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ b in float64 on the CPU, and |a| @ |b|: the reference of a product and its scale."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    return a64 @ b64, a64.abs() @ b64.abs()


def assert_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, bias=None,
                  what: str = "") -> None:
    """out equals a @ b (+ bias) element-wise, within the tolerance of `dtype`."""
    ref, scale = matmul_ref(a, b)
    if bias is not None:
        ref, scale = ref + bias.double().cpu(), scale + bias.double().cpu().abs()
    assert_close(out, ref, scale, dtype, what)


def assert_same_values(out: torch.Tensor, ref: torch.Tensor, rtol: float, floor: float = 1e-3, what: str = "") -> None:
    """Values computed elsewhere in other rounding (an optimizer's update from a gradient summed in
    another order, say): every element within rtol * (|ref| + floor)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out64.shape == ref64.shape, (what, out64.shape, ref64.shape)
    assert bool(torch.isfinite(out64).all()), f"{what}: non-finite elements"
    excess = (out64 - ref64).abs() - rtol * (ref64.abs() + floor)
    assert not bool((excess > 0).any()), f"{what}: {int((excess > 0).sum())} elements off, worst by {excess.max():.3g}"


def random_positions(m: int, k: int, nnz: int, gen: torch.Generator, empty_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """nnz distinct positions in an m x k matrix, in random order; the first `empty_rows` random rows stay empty."""
    rows_allowed = torch.randperm(m, generator=gen)[empty_rows:]
    allowed = (rows_allowed[:, None] * k + torch.arange(k)[None, :]).reshape(-1)
    nnz = min(nnz, allowed.numel())
    chosen = allowed[torch.randperm(allowed.numel(), generator=gen)[:nnz]]
    return chosen // k, chosen % k


class Weight:
    """A random sparse weight built through snack's own constructor (a snack.Pattern and values in
    its slot order), with its dense float64 twin."""

    def __init__(self, m, k, nnz, *, device, dtype=torch.float32, index_dtype=None, seed=0, empty_rows=0,
                 positions=None):
        gen = torch.Generator().manual_seed(seed)
        rows, cols = positions if positions is not None else random_positions(m, k, nnz, gen, empty_rows)
        values = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)
        self.m, self.k = m, k
        self.pattern, order = snack.Pattern.from_coo(rows.to(device), cols.to(device), m, k, index_dtype=index_dtype)
        self.values = values.to(device)[order].to(dtype)
        self.dense64 = torch.zeros(m, k, dtype=torch.float64)
        self.dense64[rows, cols] = values.to(dtype).double()  # the stored (rounded) values
        self.device, self.dtype = torch.device(device), dtype

    @property
    def tensors(self):
        """The pattern's tensors, as the ops take them."""
        return self.pattern.tensors

    @property
    def row_idx(self):
        return self.pattern.row_idx

    @property
    def col_idx(self):
        return self.pattern.col_idx

    @property
    def nnz(self):
        return self.values.numel()

    def randn(self, *shape, seed=1):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(self.device, self.dtype)

    def slot_ref(self, dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The SDDMM's reference at the slots, (dy^T x)[row, col], and its scale."""
        full, scale = matmul_ref(dy.T, x)
        r, c = self.row_idx.long().cpu(), self.col_idx.long().cpu()
        return full[r, c], scale[r, c]


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
