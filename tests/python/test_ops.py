"""Every operator against a float64 dense reference, on odd sizes, both index widths, CPU and CUDA."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

import snack
from helpers import (ODD_SHAPES, Weight, assert_close, assert_matmul, matmul_ref, ops, poison_cache,
                     skewed_positions)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INDEX_DTYPES = [torch.uint16, torch.int32]


def cases():
    for shape, dtype, itype in itertools.product(ODD_SHAPES, DTYPES, INDEX_DTYPES):
        yield pytest.param(shape, dtype, itype, id=f"{'x'.join(map(str, shape))}-{str(dtype)[6:]}-{str(itype)[6:]}")


@pytest.mark.parametrize("shape,dtype,itype", list(cases()))
def test_spmm_forward(device, shape, dtype, itype):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device=device, dtype=dtype, index_dtype=itype, empty_rows=empty)
    x = p.randn(n, k, seed=2)
    bias = p.randn(m, seed=3)
    for b in (None, bias):
        poison_cache(device)
        y = ops.spmm(x, p.values, p.tensors, b)
        assert y.shape == (n, m) and y.dtype == dtype and y.device.type == device.type
        assert_matmul(y, x, p.dense64.T, dtype, bias=b)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_spmm_fused_activation(device, shape, activation):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device=device, empty_rows=empty)
    x, bias = p.randn(n, k, seed=2), p.randn(m, seed=3)
    y = ops.spmm(x, p.values, p.tensors, bias, activation=activation)
    z, scale = (t + b for t, b in zip(matmul_ref(x, p.dense64.T), (bias.double().cpu(), bias.double().cpu().abs())))
    ref = torch.relu(z) if activation == "relu" else torch.nn.functional.gelu(z)
    # Both functions have slope at most ~1.13, so the pre-activation's bound carries over.
    assert_close(y, ref, 1.2 * scale, torch.float32)


@pytest.mark.parametrize("shape,dtype,itype", list(cases()))
def test_spmm_transposed(device, shape, dtype, itype):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device=device, dtype=dtype, index_dtype=itype, empty_rows=empty)
    dy = p.randn(n, m, seed=4)
    poison_cache(device)
    dx = ops.spmm_t(dy, p.values, p.tensors)
    assert dx.shape == (n, k)
    assert_matmul(dx, dy, p.dense64, dtype)


@pytest.mark.parametrize("shape,dtype,itype", list(cases()))
def test_sddmm(device, shape, dtype, itype):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device=device, dtype=dtype, index_dtype=itype, empty_rows=empty)
    dy, x = p.randn(n, m, seed=5), p.randn(n, k, seed=6)
    poison_cache(device)
    dv = ops.sddmm(dy, x, p.tensors)
    assert dv.shape == (p.nnz,)
    assert_close(dv, *p.slot_ref(dy, x), dtype)


def test_sddmm_variant_names(device):
    # Every kernel name is accepted on every device (the CPU has one kernel and ignores it); an
    # unknown one is a ValueError that lists the names.
    p = Weight(9, 11, 40, device=device)
    dy, x = p.randn(5, 9), p.randn(5, 11)
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    for variant in snack.SDDMM_VARIANTS:
        if variant == "tile_view_wgmma" and device.type == "cuda" and not hopper:
            with pytest.raises(ValueError, match="tile_view_wgmma: .*Hopper"):
                ops.sddmm(dy, x, p.tensors, variant=variant)
            continue
        if variant in ("tensor_core", "tile_view", "tile_view_wgmma") and device.type == "cuda":  # 16-bit only
            q = Weight(9, 11, 40, device=device, dtype=torch.bfloat16)
            a, b = q.randn(5, 9), q.randn(5, 11)
            assert_close(ops.sddmm(a, b, q.tensors, variant=variant), *q.slot_ref(a, b), torch.bfloat16, variant)
            with pytest.raises(ValueError, match=f"{variant} runs 16-bit operands"):
                ops.sddmm(dy, x, p.tensors, variant=variant)
            continue
        assert_close(ops.sddmm(dy, x, p.tensors, variant=variant), *p.slot_ref(dy, x), torch.float32, variant)
    with pytest.raises(ValueError, match="unknown variant 'tiles'.*rows"):
        ops.sddmm(dy, x, p.tensors, variant="tiles")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,m", [(1, 1), (3, 7), (257, 33), (0, 5), (5000, 97)])
def test_bias_grad(device, dtype, n, m):
    dy = torch.randn(n, m, dtype=torch.float64).to(device, dtype)
    poison_cache(device)
    db = ops.bias_grad(dy)
    assert_close(db, dy.double().cpu().sum(0), dy.double().cpu().abs().sum(0), dtype)


def test_batch_zero(device):
    p = Weight(6, 5, 10, device=device)
    assert ops.spmm(p.randn(0, 5), p.values, p.tensors, None).shape == (0, 6)
    assert ops.spmm_t(p.randn(0, 6), p.values, p.tensors).shape == (0, 5)
    dv = ops.sddmm(p.randn(0, 6), p.randn(0, 5), p.tensors)
    assert torch.equal(dv.cpu(), torch.zeros(10))


def test_non_contiguous_inputs(device):
    p = Weight(20, 30, 100, device=device)
    big = p.randn(7, 60)
    x = big[:, ::2]
    assert not x.is_contiguous()
    y = ops.spmm(x, p.values, p.tensors, None)
    assert_matmul(y, x, p.dense64.T, torch.float32)


def test_deterministic(device):
    p = Weight(300, 50, 1500, device=device)
    x = p.randn(33, 50)
    dy = p.randn(33, 300)
    a = [ops.spmm(x, p.values, p.tensors, None) for _ in range(3)]
    b = [ops.spmm_t(dy, p.values, p.tensors) for _ in range(3)]
    c = [ops.sddmm(dy, x, p.tensors) for _ in range(3)]
    for runs in (a, b, c):
        for r in runs[1:]:
            assert torch.equal(r, runs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 6, 40])
def test_cpu_results_do_not_depend_on_the_threads(dtype, n):
    """The CPU splits each product's outputs (slots for the SDDMM) over PyTorch's threads, by work
    (long rows and columns weigh more); each output is summed in one fixed order, so any count of
    threads gives the same bits, and the float64 reference still holds."""
    m, k = 700, 300
    rows, cols = skewed_positions(m, k, dense_rows=4, nnz_rest=30000, seed=n)
    p = Weight(m, k, rows.numel(), device="cpu", dtype=dtype, positions=(rows, cols))
    x, dy, bias = p.randn(n, k, seed=2), p.randn(n, m, seed=3), p.randn(m, seed=4)
    images = p.randn(2, k, n, seed=5)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append((ops.spmm(x, p.values, p.tensors, bias), ops.spmm_t(dy, p.values, p.tensors),
                            ops.sddmm(dy, x, p.tensors), ops.spmm_channels_first(images, p.values, p.tensors, bias)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    y, dx, dv, y_images = results[0]
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias)
    assert_matmul(dx, dy, p.dense64, dtype)
    ref, scale = p.slot_ref(dy, x)
    assert_close(dv, ref, scale, dtype)
    assert_matmul(y_images.transpose(1, 2).reshape(-1, m), images.transpose(1, 2).reshape(-1, k), p.dense64.T, dtype,
                  bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,density", [(300, 260, 65, 0.6), (5, 9, 3, 1.0), (257, 33, 100, 0.3), (70, 40, 80, 0.9),
                                            (300, 5000, 20, 0.05)])
def test_cpu_dense_blocks(dtype, m, k, n, density):
    """The CPU's dense blocks (W expanded a block of rows at a time, for dX of columns, multiplied by
    ATen's GEMM), forced by variant="dense_blocks", against float64: the forward with bias and both
    activations, dX (two blocks of columns where K = 5000) and dW. "auto" takes them for large batches at a high density on layers of 2^16 weights or more:
    then its results are theirs bit for bit; otherwise the loops'."""
    nnz = max(1, int(density * m * k))
    p = Weight(m, k, nnz, device="cpu", dtype=dtype, empty_rows=2)
    x, dy, bias = p.randn(n, k, seed=2), p.randn(n, m, seed=3), p.randn(m, seed=4)
    y = ops.spmm(x, p.values, p.tensors, bias, variant="dense_blocks")
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias)
    z, scale = (t + b for t, b in zip(matmul_ref(x, p.dense64.T), (bias.double(), bias.double().abs())))
    assert_close(ops.spmm(x, p.values, p.tensors, bias, activation="relu", variant="dense_blocks"), torch.relu(z),
                 1.2 * scale, dtype)
    assert_close(ops.spmm(x, p.values, p.tensors, bias, activation="gelu", variant="dense_blocks"),
                 torch.nn.functional.gelu(z), 1.2 * scale, dtype)
    assert_matmul(ops.spmm_t(dy, p.values, p.tensors, "dense_blocks"), dy, p.dense64, dtype)
    ref, scale = p.slot_ref(dy, x)
    assert_close(ops.sddmm(dy, x, p.tensors, "dense_blocks"), ref, scale, dtype)

    blocks = n >= 64 and density >= 0.6 and m * k >= 1 << 16  # every rule's density is at most 0.6
    auto = ops.spmm(x, p.values, p.tensors, bias)
    assert torch.equal(auto, y if blocks else ops.spmm(x, p.values, p.tensors, bias, variant="warp_row"))
    auto_dv = ops.sddmm(dy, x, p.tensors)
    if blocks:
        assert torch.equal(auto_dv, ops.sddmm(dy, x, p.tensors, "dense_blocks"))
    elif n < 64:
        assert torch.equal(auto_dv, ops.sddmm(dy, x, p.tensors, "slot"))


def test_cpu_explain_names_the_path():
    layer = snack.SparseLinear(512, 256, sparsity=0.3)  # 131072 weights, 70% of them stored
    small, large = snack.explain(layer, 8), snack.explain(layer, 128)
    assert (small.variant, small.reason) == ("cpu", "cpu_rule")
    assert small.batch_tile == 8 and "tiles of 8 rows" in small.describe
    assert (large.variant, large.reason) == ("dense_blocks", "cpu_rule") and "256 rows at a time" in large.describe
    assert large.batch_tile == 128  # each block's GEMM takes the whole batch
    forced = snack.explain(layer, 1, op="weight_grad", variant="dense_blocks")
    assert (forced.variant, forced.reason) == ("dense_blocks", "forced")
    blocks_dx = snack.explain(layer, 128, op="input_grad", variant="dense_blocks")
    assert "512 columns at a time" in blocks_dx.describe, blocks_dx  # 2^20 / 256 rows of W
    loops = snack.explain(layer, 128, op="input_grad", variant="warp_row")
    assert (loops.variant, loops.reason) == ("cpu", "forced")
    sparse = snack.explain(snack.SparseLinear(512, 256, sparsity=0.95), 128)
    assert sparse.variant == "cpu" and "tiles of 16 rows" in sparse.describe and sparse.batch_tile == 16
    # The layer's fused GELU on 16-bit values keeps the forward in the loops, and explain says so;
    # the input gradient has no activation.
    gelu = snack.SparseLinear(512, 256, sparsity=0.3, activation="gelu").to(torch.bfloat16)
    assert snack.explain(gelu, 128).variant == "cpu"
    assert snack.explain(gelu.to(torch.float32), 128).variant == "dense_blocks"
    assert snack.explain(gelu, 128, op="input_grad").variant == "dense_blocks"


@pytest.mark.parametrize("n", [5, 8, 16, 33, 70])
@pytest.mark.parametrize("index_dtype", [None, torch.int32], ids=["uint16", "int32"])
def test_cpu_bf16_weight_gradient(n, index_dtype):
    """bfloat16 dW on the CPU: where the CPU has AVX512-BF16 (snack/bf16_dot.h), 16-bit tiles of 8 or
    16 rows and its dot products of bfloat16 pairs (one, three and five tiles: one group of four and
    a partial one; a slot count that leaves a remainder after the blocks of 8); the loops over float
    tiles elsewhere. Against float64, repeated bitwise; nnz = 0 writes nothing."""
    p = Weight(203, 157, 3001, device="cpu", dtype=torch.bfloat16, index_dtype=index_dtype, empty_rows=5, seed=n)
    dy, x = p.randn(n, 203, seed=1), p.randn(n, 157, seed=2)
    dv = ops.sddmm(dy, x, p.tensors)
    assert_close(dv, *p.slot_ref(dy, x), torch.bfloat16)
    assert torch.equal(ops.sddmm(dy, x, p.tensors), dv)
    empty = Weight(50, 40, 0, device="cpu", dtype=torch.bfloat16)
    assert ops.sddmm(empty.randn(n, 50), empty.randn(n, 40), empty.tensors).numel() == 0


def test_cpu_baseline_loops():
    """The CPU loops are built twice (baseline ISA, and AVX2 with FMA where the CPU has them); the
    threads test above runs the build this CPU takes, this one the baseline build, in a process
    started with SNACK_CPU_BASELINE=1."""
    code = (
        "import sys, torch; sys.path[:0] = sys.argv[1:]\n"
        "from test_ops import test_cpu_results_do_not_depend_on_the_threads as t\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for n in (1, 6, 40):\n"
        "        t(dtype, n)\n"
        "print('ok')\n")
    env = dict(os.environ, SNACK_CPU_BASELINE="1")
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", code, here], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_build_views_match_definition(device):
    p = Weight(40, 23, 300, device=device, empty_rows=7)
    rows, cols = p.row_idx.long().cpu(), p.col_idx.long().cpu()
    row_ptr, col_ptr, csc_perm = p.pattern.row_ptr, p.pattern.col_ptr, p.pattern.csc_perm
    key = rows * p.k + cols
    assert torch.all(key[1:] > key[:-1]), "slots must be sorted row-major and unique"
    assert torch.equal(row_ptr.cpu().long(), torch.searchsorted(rows, torch.arange(p.m + 1)))
    perm = csc_perm.long().cpu()
    assert torch.equal(perm.sort().values, torch.arange(p.nnz))
    ccols, crows = cols[perm], rows[perm]
    ckey = ccols * p.m + crows
    assert torch.all(ckey[1:] > ckey[:-1]), "CSC view must be column-major with ascending rows"
    assert torch.equal(col_ptr.cpu().long(), torch.searchsorted(ccols, torch.arange(p.k + 1)))


def tile_view_reference(rows, cols, m, k):
    """The tile view by its definition (snack/pattern.h): band b's slots listed tile by tile (64-column
    chunks in order), row-major inside a tile, each as (slot - band's first slot) << 12 | position."""
    if k > 16384:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    bands, chunks = (m + 63) // 64, (k + 63) // 64
    slot = torch.arange(rows.numel())
    band, chunk = rows // 64, cols // 64
    order = torch.argsort(band * (chunks * 64 * 16384) + chunk * (64 * 16384) + (rows % 64) * 16384 + cols % 64,
                          stable=True)
    first = torch.searchsorted(rows, band * 64)  # each slot's band's first slot
    packed = ((slot - first) << 12) | ((rows % 64) * 64 + cols % 64)
    entries = torch.zeros((rows.numel() + 3) // 4 * 4, dtype=torch.int64)
    entries[:rows.numel()] = packed[order]
    tile = band * chunks + chunk
    ptr = torch.searchsorted(tile[order], torch.arange(bands * chunks + 1))
    return ptr.to(torch.int32), entries.to(torch.int32)


@pytest.mark.parametrize("m,k,nnz", [(40, 23, 300), (130, 200, 9000), (200, 1001, 5000), (64, 64, 4096), (9, 9, 0),
                                     (70, 16384, 20000), (70, 16385, 2000)])
def test_tile_view_matches_definition(device, m, k, nnz):
    # Every slot once, in its tile's place, for partial bands and chunks, empty tiles, a full tile,
    # nnz = 0, the widest layer that has the view and one past it (no view: both arrays empty).
    p = Weight(m, k, nnz, device=device, empty_rows=3 if m > 9 else 0)
    want_ptr, want_entries = tile_view_reference(p.row_idx.long().cpu(), p.col_idx.long().cpu(), m, k)
    assert torch.equal(p.pattern.tile_ptr.cpu(), want_ptr)
    assert torch.equal(p.pattern.tile_entries.cpu(), want_entries)
    assert p.pattern.nbytes()["tile_entries"] == 4 * want_entries.numel()


def test_slots_from_dense_topk_and_ties(device):
    w = torch.tensor([[0.5, -3.0, 0.0, 1.0], [1.0, 2.0, -1.0, 0.25]], device=device)
    r, c, pos = ops.slots_from_dense(w, 4)
    # |w| sorted: 3.0 (0,1), 2.0 (1,1), then three ties at 1.0: (0,3), (1,0), (1,2) -> smaller positions win.
    assert pos.tolist() == [1, 3, 4, 5]
    assert r.tolist() == [0, 0, 1, 1] and c.tolist() == [1, 3, 0, 1]


def test_slots_from_dense_random(device):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 41, generator=gen, dtype=torch.float64).to(device)
    nnz = 300
    _, _, pos = ops.slots_from_dense(w, nnz)
    ref = torch.topk(w.abs().flatten().cpu(), nnz).indices.sort().values
    assert torch.equal(pos.cpu(), ref)


def test_slots_from_mask(device):
    mask = torch.rand(13, 17, generator=torch.Generator().manual_seed(0)) < 0.3
    r, c, pos = ops.slots_from_mask(mask.to(device))
    assert torch.equal(pos.cpu(), mask.flatten().nonzero().flatten())
    assert torch.equal(r.long().cpu() * 17 + c.long().cpu(), pos.cpu())


@pytest.mark.parametrize("m,k,nnz", [(50, 40, 100), (50, 40, 1900), (7, 3, 21), (9, 9, 0), (1000, 3000, 30000)])
def test_random_slots(device, m, k, nnz):
    gen = torch.Generator(device=device).manual_seed(5)
    r, c = ops.random_slots(m, k, nnz, generator=gen, device=device)
    assert r.device.type == device.type and r.numel() == nnz
    key = r.long().cpu() * k + c.long().cpu()
    assert torch.all(key[1:] > key[:-1]) and (key.numel() == 0 or (key[0] >= 0 and key[-1] < m * k))
    gen2 = torch.Generator(device=device).manual_seed(5)
    r2, c2 = ops.random_slots(m, k, nnz, generator=gen2, device=device)
    assert torch.equal(r, r2) and torch.equal(c, c2), "same seed, same pattern"


def test_random_slots_uniform():
    # Each of 20 positions should be chosen with probability 5/20 over many draws.
    counts = torch.zeros(20)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        r, c = ops.random_slots(4, 5, 5, generator=gen)
        counts[r.long() * 5 + c.long()] += 1
    freq = counts / 2000
    assert torch.all((freq - 0.25).abs() < 0.04), freq


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,nnz", [(40, 23, 300), (7, 5, 35), (3000, 70000, 50000), (30000, 30000, 1000),
                                     (70000, 20000, 3000), (4100, 16384, 2_000_000), (70000, 1000, 500_000)])
def test_build_views_on_device_match_the_cpu(m, k, nnz):
    # The device's views (a CUB radix sort by column; the tile view a block per band) equal the CPU's
    # exactly, from tiny to very sparse and large matrices, uint16 and int32 indices.
    rows, cols = ops.random_slots(m, k, nnz, generator=torch.Generator().manual_seed(m))
    want = ops.build_views(rows, cols, m, k)
    got = ops.build_views(rows.cuda(), cols.cuda(), m, k)
    for w, g in zip(want, got):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_values_round_like_torch(device, dtype):
    # A 1x1 weight times a column of every finite 16-bit value, then times a scale: each output is
    # one product computed in float and rounded once, so it must equal torch's own rounding of the
    # float product, bit for bit (subnormals and overflow included; zeros compared by value).
    pattern, _ = snack.Pattern.from_coo(torch.tensor([0], device=device), torch.tensor([0], device=device), 1, 1)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every)].to(device)
    for scale in (1.0, 1.2345678, 3e-3, 700.0):
        w = torch.tensor([scale], dtype=dtype, device=device)
        y = ops.spmm(every[:, None].contiguous(), w, pattern.tensors, None)[:, 0]
        ref = (every.float() * w.float()).to(dtype)
        same = (y.view(torch.int16) == ref.view(torch.int16)) | ((y == 0) & (ref == 0))
        assert bool(same.all()), f"scale {scale}: {int((~same).sum())} outputs rounded differently"


def test_process_wide_choices_restore():
    # The context managers restore the previous choice on exit, nested or after an error; a bad name
    # is refused and changes nothing.
    from snack import kernels
    with pytest.raises(ValueError, match="in_place or copied"):
        snack.set_csc_read("transposed")
    assert snack.CSC_READS == ("auto", "in_place", "copied")
    with snack.csc_read("copied"):
        with snack.csc_read("in_place"), snack.spmm_variant("global_xt"):
            assert kernels._current == {"spmm_variant": "global_xt", "csc_read": "in_place", "tile_view_splits": 0,
                                        "fragment_warpgroups": 0}
        assert kernels._current == {"spmm_variant": "auto", "csc_read": "copied", "tile_view_splits": 0,
                                    "fragment_warpgroups": 0}
        with pytest.raises(RuntimeError, match="inside"):
            with snack.csc_read("in_place"):
                raise RuntimeError("inside")
        assert kernels._current["csc_read"] == "copied"
    assert kernels._current == {"spmm_variant": "auto", "csc_read": "auto", "tile_view_splits": 0,
                                "fragment_warpgroups": 0}
    with pytest.raises(ValueError, match="blocks per band"):
        snack.set_tile_view_splits(-1)
    with snack.tile_view_splits(6):
        assert kernels._current["tile_view_splits"] == 6
        with snack.tile_view_splits(0):
            assert kernels._current["tile_view_splits"] == 0
        assert kernels._current["tile_view_splits"] == 6
    assert kernels._current["tile_view_splits"] == 0
    with pytest.raises(ValueError, match="0, the planner's choice, or 1 to 2"):
        snack.set_fragment_warpgroups(3)
    with snack.fragment_warpgroups(2):
        assert kernels._current["fragment_warpgroups"] == 2
        with snack.fragment_warpgroups(1):
            assert kernels._current["fragment_warpgroups"] == 1
        assert kernels._current["fragment_warpgroups"] == 2
    assert kernels._current["fragment_warpgroups"] == 0
