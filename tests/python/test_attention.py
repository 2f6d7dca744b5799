"""Sparse attention against float64 references of dense attention with the pattern as a mask:
outputs and dQ, dK, dV, causal and not, shared and per-head patterns, empty rows, 16-bit inputs,
autocast; the pattern generators against their definitions."""

import math

import pytest
import torch

import snack
from snack import attention as sa
from helpers import assert_close


def dense_reference(q, k, v, masks, scale, causal):
    """Masked softmax attention in float64 (a query with no key: zeros), its probabilities and the
    scale of its output (the sum of its terms' magnitudes, P |V|)."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    mask = torch.stack([m.cpu() for m in masks])[None]  # [1, H, Lq, Lk]
    if causal:
        mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    s = (q64 @ k64.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
    return q64, k64, v64, p @ v64, p.detach() @ v64.detach().abs(), p.detach()


def gradient_scales(q64, k64, v64, p, dout64, scale):
    """The sum of the magnitudes of the terms of dQ, dK and dV: with dP = dout v^T, D = rowsum(P dP) and
    dS = P (dP - D), dQ = scale dS k and dK = scale dS^T q sum terms of magnitude P (|dP| + |D|) |k| (|q|),
    dV = P^T dout terms P |dout|. Their cancellation is what a kernel's float32 rounding is measured against."""
    q64, k64, v64 = (t.detach() for t in (q64, k64, v64))
    dp = dout64 @ v64.transpose(-1, -2)
    terms = p * (dp.abs() + (p * dp).sum(-1, keepdim=True).abs())
    return (scale * terms @ k64.abs(), scale * terms.transpose(-1, -2) @ q64.abs(),
            p.transpose(-1, -2) @ dout64.abs())


def run_case(device, dtype, patterns, batch=2, dim=8, dim_v=5, causal=False, bands=True):
    heads = len(patterns)
    seq_q, seq_k = patterns[0].out_features, patterns[0].in_features
    gen = torch.Generator().manual_seed(seq_q * 31 + heads)
    q, k, v = (torch.randn(batch, heads, n, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
               .requires_grad_() for n, d in ((seq_q, dim), (seq_k, dim), (seq_k, dim_v)))
    out = snack.nn.functional.sparse_attention(q, k, v, patterns if heads > 1 else patterns[0], causal=causal,
                                               bands=bands)
    assert out.dtype == dtype and out.shape == (batch, heads, seq_q, dim_v)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out.backward(dout)
    scale = 1 / math.sqrt(dim)
    q64, k64, v64, ref, ref_scale, p = dense_reference(q, k, v, [p.to_mask() for p in patterns], scale, causal)
    dout64 = dout.double().cpu()
    ref.backward(dout64)
    # Element-wise, each relative to the magnitudes of its terms; the gradients also to 1% of their
    # largest element. The bands round P and dS to the 16-bit type for their tensor-core products (as
    # FlashAttention does): one rounding more than the warps' one of each output, so twice the error.
    tol = dtype
    rounding = 2.0 if bands and q.is_cuda and dtype in (torch.bfloat16, torch.float16) and dim in (64, 128) else 1.0
    assert_close(out, ref.detach(), rounding * ref_scale, tol, "out")
    scales = gradient_scales(q64, k64, v64, p, dout64, scale)
    for name, got, want, terms in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad),
                                      scales):
        assert_close(got, want, rounding * terms + 1e-2 * want.abs().max(), tol, name)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_attention_float64(device, causal):
    pattern = sa.local_pattern(37, 3, global_tokens=2, random_per_row=2, generator=torch.Generator().manual_seed(0),
                               device=device)
    run_case(device, torch.float64, [pattern], causal=causal)


def test_per_head_patterns_rectangular_and_empty_rows(device):
    # Lq != Lk, rows without any key, a pattern with nnz = 0.
    rows = torch.tensor([0, 0, 3, 5, 5, 5])
    cols = torch.tensor([1, 8, 0, 2, 3, 10])
    sparse = snack.Pattern.from_coo(rows, cols, 7, 11)[0].to(device)
    empty = snack.Pattern.from_coo(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 7, 11)[0]
    full = snack.Pattern.from_mask(torch.ones(7, 11, dtype=torch.bool))[0]
    run_case(device, torch.float64, [sparse, empty.to(device), full.to(device)], batch=1, dim=3, dim_v=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(device, dtype):
    pattern = sa.strided_pattern(50, 6, causal=True, device=device)
    run_case(device, dtype, [pattern], dim=16, dim_v=16, causal=True)


def test_autocast_and_module_form(device):
    pattern = sa.dilated_pattern(40, 2, 3, device=device)
    layer = snack.nn.SparseAttention(pattern)
    q, k, v = (torch.randn(1, 2, 40, 8, device=device) for _ in range(3))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = layer(q, k, v)
    assert out.dtype == torch.float32  # the products ran in float32, not in the autocast dtype
    assert torch.equal(out, snack.nn.functional.sparse_attention(q, k, v, pattern))
    assert "nnz" in repr(layer)


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_kernels_match_dense_attention(dim, dtype, causal):
    # The fused CUDA path: rows of more than 32 keys (several windows of the online softmax), a global
    # token (a row and a column of every key), random keys (with causal, some above the diagonal are
    # dropped inside a window), an odd length.
    cuda = torch.device("cuda")
    pattern = sa.local_pattern(75, 20, global_tokens=1, random_per_row=5, generator=torch.Generator().manual_seed(1),
                               device=cuda)
    probe = torch.empty(1, 1, 75, dim, device=cuda, dtype=dtype)
    assert sa._fused(probe, probe, probe, [pattern])
    run_case(cuda, dtype, [pattern], batch=2, dim=dim, dim_v=dim, causal=causal)


def banded_pattern(seq_q: int, seq_k: int, index_dtype=None, seed: int = 3) -> snack.Pattern:
    """Blocks of 64 queries whose rows the bands treat differently: windows of 61 keys plus random keys
    (block 0), random keys only (1: no run of 16), windows of 91 keys in even rows and 7 in odd ones
    (2: the short runs stay with the warp per row), windows of 121 keys, several tiles of 64 keys
    (3), a query of every key in block 0 (a run 4x the block's mean: left out) and a query without
    keys; Lq and Lk not multiples of 64."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = [], []
    for i in range(seq_q):
        centre, block = i * seq_k // seq_q, i // 64
        half = {0: 30, 1: -1, 2: 45 if i % 2 == 0 else 3}.get(block, 60)
        keys = set(range(max(0, centre - half), min(seq_k, centre + half + 1))) if half >= 0 else set()
        keys |= set(torch.randint(0, seq_k, (12 if block == 1 else 6,), generator=gen).tolist())
        if i == 3:
            keys = set(range(seq_k))
        if i == seq_q - 2:
            keys = set()
        rows += [i] * len(keys)
        cols += sorted(keys)
    return snack.Pattern.from_coo(torch.tensor(rows), torch.tensor(cols), seq_q, seq_k, index_dtype=index_dtype)[0]


def band_rule(pattern: snack.Pattern, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """snack.attention.bands by its definition, on the host: each row's longest run of consecutive keys
    (keys j <= i with causal; the first of equal runs) of at least 16 keys and, if longer than 64, at
    most 4x the mean of its block's such runs, kept where the runs of the row's block of 64 queries
    cover at least a quarter of the block's key range x 64."""
    row_ptr, cols = pattern.row_ptr.cpu().tolist(), pattern.col_idx.cpu().long().tolist()
    seq_q = pattern.out_features
    runs = []  # (first slot, length) per row
    for i in range(seq_q):
        begin, best, start = row_ptr[i], (row_ptr[i], 0), row_ptr[i]
        for e in range(begin, row_ptr[i + 1]):
            if causal and cols[e] > i:
                break
            if e == begin or cols[e] != cols[e - 1] + 1:
                start = e
            if e + 1 - start > best[1]:
                best = (start, e + 1 - start)
        runs.append(best if best[1] >= 16 else (begin, 0))
    rows, ranges = [], []
    for b0 in range(0, seq_q, 64):
        block = range(b0, min(seq_q, b0 + 64))
        lengths = [runs[i][1] for i in block if runs[i][1]]
        for i in block:  # runs over 4x the block's mean (and over a tile) stay out
            if runs[i][1] > 64 and runs[i][1] * len(lengths) > 4 * sum(lengths):
                runs[i] = (row_ptr[i], 0)
        firsts = [cols[runs[i][0]] for i in block if runs[i][1]]
        lasts = [cols[runs[i][0]] + runs[i][1] - 1 for i in block if runs[i][1]]
        covered = sum(runs[i][1] for i in block)
        keep = covered > 0 and covered * 4 >= (max(lasts) - min(firsts) + 1) * 64
        ranges.append([min(firsts), max(lasts)] if keep else [1, 0])
        for i in block:
            start, length = runs[i]
            rows.append([start, start + length, cols[start], cols[start] + length - 1] if keep and length
                        else [row_ptr[i], row_ptr[i], 1, 0])
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(ranges, dtype=torch.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("index_dtype", [torch.uint16, torch.int32], ids=["uint16", "int32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bands_split_by_their_definition(index_dtype, causal):
    pattern = banded_pattern(230, 260, index_dtype).to(torch.device("cuda"))
    rows, key_ranges = sa.bands(pattern, causal=causal)
    want_rows, want_ranges = band_rule(pattern, causal)
    # The pattern exercises what it is meant to: blocks with and without bands, rows left out of a kept one.
    kept = want_ranges[:, 0] <= want_ranges[:, 1]
    assert kept.any() and not kept.all()
    assert ((want_rows[:, 0] == want_rows[:, 1]) & kept.repeat_interleave(64)[:230]).any()
    assert causal or want_rows[3, 0] == want_rows[3, 1]  # the query of every key
    assert torch.equal(key_ranges.cpu(), want_ranges)
    assert torch.equal(rows.cpu(), want_rows)
    with pytest.raises(ValueError, match="CUDA"):
        sa.bands(pattern.to("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_forward_with_bands_matches_dense_attention(dim, dtype, causal):
    # The tensor-core bands merged with the warps per row and per key, forward and backward, and the
    # same without bands, against float64; the two forwards' outputs and log-sum-exps side by side.
    cuda = torch.device("cuda")
    pattern = banded_pattern(230, 260).to(cuda)
    assert sa._fused(torch.empty(1, 1, 230, dim, device=cuda, dtype=dtype),
                     torch.empty(1, 1, 260, dim, device=cuda, dtype=dtype),
                     torch.empty(1, 1, 260, dim, device=cuda, dtype=dtype), [pattern])
    key_ranges = sa.bands(pattern, causal=causal)[1]
    assert (key_ranges[:, 0] <= key_ranges[:, 1]).any()  # some blocks run on the bands
    run_case(cuda, dtype, [pattern], batch=2, dim=dim, dim_v=dim, causal=causal)
    run_case(cuda, dtype, [pattern], batch=1, dim=dim, dim_v=dim, causal=causal, bands=False)
    gen = torch.Generator(device=cuda).manual_seed(4)
    q, k, v = (torch.randn(3, n, dim, device=cuda, generator=gen).to(dtype) for n in (230, 260, 260))
    scale = 1 / math.sqrt(dim)
    banded, lse = snack.ops.sparse_attention_fwd(q, k, v, pattern.tensors, scale, causal)
    plain, plain_lse = snack.ops.sparse_attention_fwd(q, k, v, pattern.tensors, scale, causal, bands=False)
    _, _, _, ref, ref_scale, _ = dense_reference(q[None], k[None], v[None], [pattern.to_mask()] * 3, scale, causal)
    assert_close(banded, ref[0].detach(), 2 * ref_scale[0], dtype, "out with bands")  # P rounded: run_case
    assert_close(plain, ref[0].detach(), ref_scale[0], dtype, "out without bands")
    assert torch.allclose(lse, plain_lse, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert torch.equal(banded, snack.ops.sparse_attention_fwd(q, k, v, pattern.tensors, scale, causal)[0])
    # The gradients with and without bands, side by side: within the two paths' roundings (two and one
    # units of the magnitudes of the terms), without the float64 comparison's slack for the largest
    # elements.
    q, k, v = (t[None] for t in (q, k, v))
    dout = torch.randn(q.shape, device=cuda, generator=gen).to(dtype)
    grads = []
    for bands in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        snack.nn.functional.sparse_attention(*leaves, pattern, causal=causal, bands=bands).backward(dout)
        grads.append([t.grad for t in leaves])
    q64, k64, v64, _, _, p = dense_reference(q, k, v, [pattern.to_mask()] * 3, scale, causal)
    for name, with_bands, without, terms in zip(("dQ", "dK", "dV"), *grads,
                                                gradient_scales(q64, k64, v64, p, dout.double().cpu(), scale)):
        assert_close(with_bands, without.double(), 3 * terms, dtype, name + " with and without bands")


@pytest.mark.cuda
@pytest.mark.parametrize("index_dtype", [torch.uint16, torch.int32], ids=["uint16", "int32"])
def test_fused_kernels_rectangular_empty_rows_and_no_slots(index_dtype):
    # Lq != Lk, queries without keys (zeros, no gradient), keys no query stores (zero dK, dV), nnz = 0,
    # and bitwise-equal repeats.
    cuda = torch.device("cuda")
    rows = torch.tensor([0, 0, 3, 5, 5, 5, 6])
    cols = torch.tensor([1, 8, 0, 2, 3, 10, 10])
    sparse = snack.Pattern.from_coo(rows, cols, 7, 11, index_dtype=index_dtype)[0].to(cuda)
    run_case(cuda, torch.float32, [sparse], batch=3, dim=32, dim_v=32)
    run_case(cuda, torch.float32, [sparse], batch=1, dim=64, dim_v=64, causal=True)
    empty = snack.Pattern.from_coo(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 7, 11,
                                   index_dtype=index_dtype)[0].to(cuda)
    run_case(cuda, torch.float32, [empty], batch=1, dim=32, dim_v=32)
    q, k, v = (torch.randn(2, 3, n, 64, device=cuda) for n in (7, 11, 11))
    first = snack.nn.functional.sparse_attention(q, k, v, sparse)
    assert torch.equal(first, snack.nn.functional.sparse_attention(q, k, v, sparse))


@pytest.mark.cuda
def test_fused_kernels_take_views_off_a_16_byte_boundary():
    # q, k, v and dout that start 4 bytes past an aligned address: sparse_attention copies them to an
    # aligned start (the same results, bitwise), the op itself refuses them.
    cuda = torch.device("cuda")
    pattern = sa.local_pattern(40, 9, generator=torch.Generator().manual_seed(2), device=cuda)
    shape, numel = (1, 2, 40, 32), 2 * 40 * 32
    aligned = [torch.randn(shape, device=cuda, generator=torch.Generator(device=cuda).manual_seed(s))
               for s in range(4)]
    bases = []
    for t in aligned:
        base = torch.empty(numel + 1, device=cuda)
        base[1:] = t.flatten()
        bases.append(base.requires_grad_())
    shifted = [b[1:].view(shape) for b in bases]
    assert all(t.data_ptr() % 16 == 4 for t in shifted)
    want = [t.clone().requires_grad_() for t in aligned[:3]]
    out = snack.nn.functional.sparse_attention(*shifted[:3], pattern)
    ref = snack.nn.functional.sparse_attention(*want, pattern)
    assert torch.equal(out, ref)
    out.backward(shifted[3].detach())
    ref.backward(aligned[3])
    assert all(torch.equal(b.grad[1:].view(shape), w.grad) for b, w in zip(bases, want))
    flat = [t.detach().view(2, 40, 32) for t in shifted[:3]]
    with pytest.raises(ValueError, match="16-byte boundary"):
        snack.ops.sparse_attention_fwd(*flat, pattern.tensors, 0.5, False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,dim,seq,window", [(torch.float32, 32, 3, 1), (torch.bfloat16, 64, 20, 19)],
                         ids=["float32", "bfloat16-bands"])
def test_fused_kernels_run_more_than_65535_heads(dtype, dim, seq, window):
    # batch x heads above a grid's 65535 rows of blocks run in slices: the last heads (across the cut)
    # equal the same heads run on their own, forward and backward, bitwise; in bfloat16 on the bands.
    cuda = torch.device("cuda")
    pattern = sa.local_pattern(seq, window, device=cuda)
    if dtype != torch.float32:
        key_ranges = sa.bands(pattern)[1]
        assert (key_ranges[:, 0] <= key_ranges[:, 1]).all()
    gen = torch.Generator(device=cuda).manual_seed(5)
    q, k, v = (torch.randn(65537, 1, seq, dim, device=cuda, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    out = snack.nn.functional.sparse_attention(q, k, v, pattern)
    dout = torch.randn(out.shape, device=cuda, generator=gen).to(dtype)
    out.backward(dout)
    tail = [t.detach()[-3:].clone().requires_grad_() for t in (q, k, v)]
    out_tail = snack.nn.functional.sparse_attention(*tail, pattern)
    out_tail.backward(dout[-3:])
    assert torch.equal(out[-3:], out_tail)
    assert all(torch.equal(full.grad[-3:], part.grad) for full, part in zip((q, k, v), tail))


def test_pattern_generators_follow_their_definitions():
    seq = 30
    local = sa.local_pattern(seq, 2, global_tokens=1, causal=True).to_mask()
    i, j = torch.meshgrid(torch.arange(seq), torch.arange(seq), indexing="ij")
    assert torch.equal(local, (((i - j).abs() <= 2) | (i == 0) | (j == 0)) & (j <= i))
    strided = sa.strided_pattern(seq, 4).to_mask()
    assert torch.equal(strided, ((i - j).abs() < 4) | ((i - j) % 4 == 0))
    dilated = sa.dilated_pattern(seq, 2, 3).to_mask()
    assert torch.equal(dilated, ((i - j).abs() <= 6) & ((i - j) % 3 == 0))
    drawn = sa.local_pattern(seq, 0, random_per_row=3, generator=torch.Generator().manual_seed(1)).to_mask()
    assert drawn.diagonal().all() and (drawn.sum(1) <= 4).all() and drawn.sum() > seq


def test_errors():
    pattern = sa.local_pattern(8, 1)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="pattern is 8 x 8"):
        snack.nn.functional.sparse_attention(q, torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), pattern)
    with pytest.raises(ValueError, match="one per head"):
        snack.nn.functional.sparse_attention(q, q, q, [pattern])
    with pytest.raises(TypeError, match="dtype"):
        snack.nn.functional.sparse_attention(q, q.double(), q, pattern)
    with pytest.raises(ValueError, match="4-D"):
        snack.nn.functional.sparse_attention(q[0], q, q, pattern)
    with pytest.raises(ValueError, match="head dimension"):
        snack.nn.functional.sparse_attention(q[..., :0], q[..., :0], q, pattern)


@pytest.mark.parametrize("batch,heads", [(0, 2), (2, 0)])
def test_no_batch_or_no_head_gives_an_empty_output_and_gradients(device, batch, heads):
    pattern = sa.local_pattern(8, 1, device=device)
    q, k = (torch.randn(batch, heads, 8, 4, device=device, requires_grad=True) for _ in range(2))
    v = torch.randn(batch, heads, 8, 6, device=device, requires_grad=True)
    out = snack.nn.functional.sparse_attention(q, k, v, pattern, causal=True)
    assert out.shape == (batch, heads, 8, 6) and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_compile_runs_it_eagerly_with_its_gradients(device):
    torch._dynamo.reset()
    pattern = sa.local_pattern(32, 2, device=device)

    def loss(q, k, v):
        return snack.nn.functional.sparse_attention(q, k, v, pattern, causal=True).square().sum()

    inputs = [torch.randn(1, 2, 32, 8, device=device, requires_grad=True) for _ in range(3)]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    compiled = torch.compile(loss, backend="aot_eager")(*inputs)  # a graph break around the attention
    eager = loss(*twins)
    assert torch.equal(compiled, eager)
    compiled.backward()
    eager.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(inputs, twins))


def test_pattern_rewritten_before_the_backward_is_refused():
    pattern = sa.local_pattern(16, 2)
    q = torch.randn(1, 1, 16, 4, requires_grad=True)
    out = snack.nn.functional.sparse_attention(q, q, q, pattern)
    pattern.set_slots(pattern.row_idx.clone(), pattern.col_idx.clone())  # a topology update, in place
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()
