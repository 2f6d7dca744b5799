"""Attention over the stored positions of a sparse seq x seq pattern, in memory O(nnz).

``sparse_attention(q, k, v, pattern)`` computes, for every batch and head, the scores at the stored
positions only (``s[e] = scale * q[row_e] . k[col_e]``), a numerically stable softmax over each
row's stored scores, and ``out = P V``, with the backward (dQ, dK, dV).

On CUDA, with one pattern for every head, head_dim 32, 64 or 128 (for q, k and v) and float32,
bfloat16 or float16 inputs, it runs fused (``snack.ops.sparse_attention_fwd`` / ``_bwd``,
``src/attention/attention.cu``): a warp per query row with an online softmax, every batch and head in
one launch, float32 arithmetic, one float32 log-sum-exp per row stored for the backward, which
recomputes the probabilities (a warp per query for dQ, per key for dK and dV over the
pattern's CSC view). In bfloat16 and float16 at head_dim 64 and 128 both run each query's longest
run of consecutive keys (the local window of the usual patterns) on tensor cores, blocks of 64
queries (keys, for dK and dV) at a time, where the runs are long enough (``bands`` shows the split),
beside the warps over the other positions. Otherwise (the CPU, a pattern per head, other head sizes,
float64) it runs
unfused: per batch and head the SDDMM, a row softmax and the SpMM through snack's C++ operators
(``snack.ops.sddmm``, ``spmm``, ``spmm_t``) in float32 (float64 for float64 inputs), the
probabilities kept for the backward.

Pattern generators build the usual patterns from COO without a dense mask: ``local_pattern``
(a window, global tokens, random keys per query), ``strided_pattern`` and ``dilated_pattern``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ._checks import integer
from ._ops import PATTERN_FIELDS, ops
from .pattern import Pattern

__all__ = ["sparse_attention", "SparseAttention", "bands", "local_pattern", "strided_pattern", "dilated_pattern"]

Patterns = Union[Pattern, Sequence[Pattern]]


# ---- patterns ---------------------------------------------------------------------------------------
def _pattern(rows: Tensor, cols: Tensor, seq: int, causal: bool, index_dtype) -> Pattern:
    keep = (rows >= 0) & (rows < seq) & (cols >= 0) & (cols < seq)
    if causal:
        keep &= cols <= rows
    keys = torch.unique(rows[keep] * seq + cols[keep])  # sorted, distinct
    return Pattern.from_coo(keys // seq, keys % seq, seq, seq, index_dtype=index_dtype)[0]


def local_pattern(seq: int, window: int, *, global_tokens: int = 0, random_per_row: int = 0, causal: bool = False,
                  generator: Optional[torch.Generator] = None, device=None,
                  index_dtype: Optional[torch.dtype] = None) -> Pattern:
    """Each query attends to the keys within ``window`` positions (|i - j| <= window; j <= i when
    ``causal``), the first ``global_tokens`` keys and queries attend and are attended everywhere
    (BigBird / Longformer), and ``random_per_row`` keys per query are drawn uniformly (``generator``)."""
    seq = integer(seq, "seq", "local_pattern", minimum=1)
    window = integer(window, "window", "local_pattern", minimum=0)
    global_tokens = integer(global_tokens, "global_tokens", "local_pattern", minimum=0)
    random_per_row = integer(random_per_row, "random_per_row", "local_pattern", minimum=0)
    i = torch.arange(seq, device=device)
    offsets = torch.arange(-window, window + 1, device=device)
    rows, cols = [i.repeat_interleave(offsets.numel())], [(i[:, None] + offsets).flatten()]
    g = min(global_tokens, seq)
    if g:
        gi = torch.arange(g, device=device)
        rows += [gi.repeat_interleave(seq), i.repeat(g)]
        cols += [i.repeat(g), gi.repeat_interleave(seq)]
    if random_per_row:
        drawn = torch.randint(0, seq, (seq * random_per_row,), generator=generator,
                              device=generator.device if generator is not None else device).to(i.device)
        rows.append(i.repeat_interleave(random_per_row))
        cols.append(drawn)
    return _pattern(torch.cat(rows), torch.cat(cols), seq, causal, index_dtype)


def strided_pattern(seq: int, stride: int, *, causal: bool = False, device=None,
                    index_dtype: Optional[torch.dtype] = None) -> Pattern:
    """The strided pattern of Child et al. (2019): the previous ``stride`` keys (and next, unless
    ``causal``), and every key j with (i - j) a multiple of ``stride``."""
    seq = integer(seq, "seq", "strided_pattern", minimum=1)
    stride = integer(stride, "stride", "strided_pattern", minimum=1)
    i = torch.arange(seq, device=device)
    near = torch.arange(-stride + 1, stride, device=device)
    far = torch.arange(-(seq // stride), seq // stride + 1, device=device) * stride
    rows = torch.cat([i.repeat_interleave(near.numel()), i.repeat_interleave(far.numel())])
    cols = torch.cat([(i[:, None] + near).flatten(), (i[:, None] + far).flatten()])
    return _pattern(rows, cols, seq, causal, index_dtype)


def dilated_pattern(seq: int, window: int, dilation: int, *, causal: bool = False, device=None,
                    index_dtype: Optional[torch.dtype] = None) -> Pattern:
    """Each query attends to the keys i + dilation * t for |t| <= window (t <= 0 when ``causal``)."""
    seq = integer(seq, "seq", "dilated_pattern", minimum=1)
    window = integer(window, "window", "dilated_pattern", minimum=0)
    dilation = integer(dilation, "dilation", "dilated_pattern", minimum=1)
    i = torch.arange(seq, device=device)
    offsets = torch.arange(-window, window + 1, device=device) * dilation
    return _pattern(i.repeat_interleave(offsets.numel()), (i[:, None] + offsets).flatten(), seq, causal, index_dtype)


# ---- the attention ----------------------------------------------------------------------------------
def bands(pattern: Pattern, *, causal: bool = False) -> tuple[Tensor, Tensor]:
    """How the fused 16-bit forward splits ``pattern`` (on CUDA) between its tensor-core bands and the
    warp per query row: ``(rows, key_ranges)``, int32 on the pattern's device. ``rows[i]`` is
    ``(run_begin, run_end, key_first, key_last)``: query i's slots ``[run_begin, run_end)``, its keys
    ``key_first .. key_last``, go to the bands (none where ``run_begin == run_end``); each row's
    longest run of consecutive keys (with ``causal``, of keys ``j <= i``) is taken where it holds at
    least 16 keys and, if longer than 64, at most 4x the mean of its block's runs (a global token's
    row stays out), and the runs of its block of 64 queries fill at least a quarter of the block's key
    range x 64. ``key_ranges[b]`` is the first and last key of block b's tiles (first > last: none)."""
    if not pattern.row_ptr.is_cuda:
        raise ValueError("bands: the pattern must be on a CUDA device (the bands are the CUDA forward's)")
    return ops.sparse_attention_bands(pattern.tensors, causal)


def _row_sums(values: Tensor, rows: Tensor, seq: int) -> Tensor:
    """Each row's sum of its slots' values (slots sorted by row), in a fixed order: a segmented
    reduction, where index_add's float atomics would add in whatever order they land."""
    return torch.segment_reduce(values, "sum", lengths=torch.bincount(rows, minlength=seq))


def _row_softmax(scores: Tensor, rows: Tensor, seq: int) -> Tensor:
    """Softmax of each row's stored scores (a row of -inf only, or with no slot, gives zeros)."""
    peak = scores.new_full((seq,), -math.inf).scatter_reduce(0, rows, scores, "amax")
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    e = torch.exp(scores - peak[rows])
    total = _row_sums(e, rows, seq)
    return e / total.clamp_min(torch.finfo(total.dtype).tiny)[rows]


def _head_patterns(pattern: Patterns, heads: int) -> list[Pattern]:
    if isinstance(pattern, Pattern):
        return [pattern] * heads
    patterns = list(pattern)
    if len(patterns) != heads or not all(isinstance(p, Pattern) for p in patterns):
        raise ValueError(f"sparse_attention: pattern must be a Pattern or one per head ({heads}), got {len(patterns)}")
    return patterns


_FIELDS = len(PATTERN_FIELDS)
_ROW, _COL = PATTERN_FIELDS.index("row_idx"), PATTERN_FIELDS.index("col_idx")


class _SparseAttention(torch.autograd.Function):
    # Takes the heads' pattern tensors flattened (PATTERN_FIELDS per head) and saves them beside q, k,
    # v: a pattern rewritten in place between the forward and the backward fails autograd's version check.
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, *flat):
        with torch.autocast(q.device.type, enabled=False):  # the products stay in the working precision
            out, probs = _attention_forward(q, k, v, scale, causal, _split(flat))
        ctx.save_for_backward(q, k, v, *flat, *probs)
        ctx.scale, ctx.heads = scale, len(flat) // _FIELDS
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, *rest = ctx.saved_tensors
        flat, probs = rest[:ctx.heads * _FIELDS], rest[ctx.heads * _FIELDS:]
        with torch.autocast(dout.device.type, enabled=False):
            dq, dk, dv = _attention_backward(q, k, v, dout, ctx.scale, _split(flat), probs)
        return (dq, dk, dv, None, None) + (None,) * len(flat)


class _FusedSparseAttention(torch.autograd.Function):
    # q, k, v as [BH, L, D] contiguous; the pattern's tensors saved beside them (autograd's version
    # check catches a pattern rewritten in place before the backward).
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, bands, *pattern):
        out, lse = ops.sparse_attention_fwd(q, k, v, list(pattern), scale, causal, bands)
        ctx.save_for_backward(q, k, v, lse, *pattern)
        ctx.scale, ctx.causal, ctx.bands = scale, causal, bands
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, *pattern = ctx.saved_tensors
        dq, dk, dv = ops.sparse_attention_bwd(q, k, v, lse, _aligned(dout), pattern, ctx.scale, ctx.causal, ctx.bands)
        return (dq, dk, dv, None, None, None) + (None,) * len(pattern)


def _fused(q, k, v, patterns) -> bool:
    """Whether the fused CUDA kernels run this call."""
    return (q.is_cuda and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and
            q.shape[-1] == v.shape[-1] and q.shape[-1] in (32, 64, 128) and all(p is patterns[0] for p in patterns))


def _aligned(t: Tensor) -> Tensor:
    """t contiguous, starting at a 16-byte boundary (the fused kernels read rows as 16-byte vectors):
    a copy only where a view starts elsewhere."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _split(flat) -> list[list[Tensor]]:
    return [list(flat[i:i + _FIELDS]) for i in range(0, len(flat), _FIELDS)]


def _slot_rows(patterns) -> list[Tensor]:
    """Each head's slot rows as int64, converted once per distinct pattern (heads often share one)."""
    converted = {}
    for p in patterns:
        if id(p[_ROW]) not in converted:
            converted[id(p[_ROW])] = p[_ROW].long()
    return [converted[id(p[_ROW])] for p in patterns]


def _attention_forward(q, k, v, scale, causal, patterns):
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, seq_q, _ = q.shape
    out, probs = [], []  # per (head, batch)
    for h, (pattern, rows) in enumerate(zip(patterns, _slot_rows(patterns))):
        masked = (pattern[_COL].long() > rows) if causal else None
        for b in range(batch):
            qt, kt, vt = (t[b, h].to(work).t().contiguous() for t in (q, k, v))
            s = ops.sddmm(qt, kt, pattern) * scale
            if masked is not None:
                s = s.masked_fill(masked, -math.inf)
            p = _row_softmax(s, rows, seq_q)
            out.append(ops.spmm(vt, p, pattern).t())
            probs.append(p)
    return _stack(out, batch, heads).to(q.dtype), probs


def _attention_backward(q, k, v, dout, scale, patterns, probs):
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, seq_q, _ = q.shape
    dq, dk, dv = [], [], []
    for h, (pattern, rows) in enumerate(zip(patterns, _slot_rows(patterns))):
        for b in range(batch):
            p = probs[h * batch + b]
            qt, kt, vt = (t[b, h].to(work).t().contiguous() for t in (q, k, v))
            dot = dout[b, h].to(work).t().contiguous()
            dv.append(ops.spmm_t(dot, p, pattern).t())   # P^T dO
            dp = ops.sddmm(dot, vt, pattern)              # dO V^T at the stored positions
            row_dot = _row_sums(p * dp, rows, seq_q)
            ds = p * (dp - row_dot[rows]) * scale
            dq.append(ops.spmm(kt, ds, pattern).t())      # dS K
            dk.append(ops.spmm_t(qt, ds, pattern).t())    # dS^T Q
    return tuple(_stack(g, batch, heads).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))


def _stack(per_head_batch: list[Tensor], batch: int, heads: int) -> Tensor:
    """[B, H, L, D] from the list of [L, D] in (head, batch) order."""
    return torch.stack(per_head_batch).unflatten(0, (heads, batch)).transpose(0, 1).contiguous()


# torch.compile runs it eagerly, behind a graph break: Dynamo's trace of this autograd.Function (a
# Python loop over the heads around the custom operators) returned zero input gradients (torch 2.11).
@torch.compiler.disable
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, pattern: Patterns, *, scale: Optional[float] = None,
                     causal: bool = False, bands: bool = True) -> Tensor:
    """softmax(scale * Q K^T restricted to ``pattern``) V for q [B, H, Lq, D], k [B, H, Lk, D],
    v [B, H, Lk, Dv] (PyTorch's layout), ``pattern`` an Lq x Lk :class:`Pattern` shared by the
    heads, or one per head. ``scale`` defaults to 1/sqrt(D); ``causal`` also drops the stored
    positions above the diagonal. A query with no stored (or unmasked) key gets zeros. ``bands=False``
    keeps the fused 16-bit kernels off their tensor-core bands (every position on the warps per row and
    per key; for comparisons). Memory beyond the inputs and output: one float per query row (fused;
    with bands, during the forward and the backward, float32 partial sums of up to 64 MiB, or one
    head's), else the probabilities, nnz per batch and head."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"sparse_attention: {name} must be a 4-D tensor [batch, heads, seq, dim]")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"sparse_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                         "not fit [B, H, Lq, D], [B, H, Lk, D], [B, H, Lk, Dv]")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"sparse_attention: q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if q.shape[-1] == 0:
        raise ValueError(f"sparse_attention: q and k need a head dimension of at least 1, got {tuple(q.shape)}")
    patterns = _head_patterns(pattern, q.shape[1])
    for p in patterns:
        if (p.out_features, p.in_features) != (q.shape[2], k.shape[2]):
            raise ValueError(f"sparse_attention: pattern is {p.out_features} x {p.in_features}, the attention "
                             f"{q.shape[2]} x {k.shape[2]}")
        if p.col_idx.device != q.device:
            raise ValueError(f"sparse_attention: pattern on {p.col_idx.device}, q on {q.device}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q.shape[0] * q.shape[1] == 0:  # no batch or no head: an empty output, still part of the graph
        return torch.einsum("bhqd,bhkd,bhke->bhqe", q, k, v)
    fused = _fused(q, k, v, patterns)
    if any(p.forward_only for p in patterns):
        if not fused:
            raise ValueError("sparse_attention: a pattern kept for inference (Pattern.for_inference) runs only the "
                             "fused CUDA forward (one pattern for every head, D 32, 64 or 128); call for_training()")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("sparse_attention: the pattern is kept for inference (Pattern.for_inference), and the "
                             "gradients need what it dropped: run under torch.no_grad() or torch.inference_mode(), "
                             "or call for_training()")
    if fused:
        b, h, lq, d = q.shape
        flat = [_aligned(t.reshape(b * h, t.shape[2], d)) for t in (q, k, v)]
        out = _FusedSparseAttention.apply(*flat, scale, bool(causal), bool(bands), *patterns[0].tensors)
        return out.view(b, h, lq, d)
    return _SparseAttention.apply(q, k, v, scale, bool(causal), *[t for p in patterns for t in p.tensors])


class SparseAttention(nn.Module):
    """``sparse_attention`` with its pattern held as a submodule (moved by ``.to()``, saved in
    ``state_dict``): ``SparseAttention(local_pattern(4096, 128), causal=True)(q, k, v)``."""

    def __init__(self, pattern: Pattern, *, scale: Optional[float] = None, causal: bool = False) -> None:
        super().__init__()
        if not isinstance(pattern, Pattern):
            raise TypeError(f"SparseAttention: pattern must be a snack.Pattern, got {type(pattern).__name__}")
        self.pattern, self.scale, self.causal = pattern, scale, causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sparse_attention(q, k, v, self.pattern, scale=self.scale, causal=self.causal)

    def extra_repr(self) -> str:
        return f"seq={self.pattern.out_features}x{self.pattern.in_features}, nnz={self.pattern.nnz}, causal={self.causal}"
