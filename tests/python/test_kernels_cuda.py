"""Every CUDA SpMM variant, forced through the override, against float64 on the odd-size suite;
bitwise-equal repeated runs for the deterministic ones; the planner's choices."""

import pytest
import torch

import snack
from helpers import (ODD_SHAPES, Weight, assert_close, assert_matmul, matmul_ref, ops, poison_cache, random_positions,
                     skewed_positions)
from snack.benchmark import capture_graph

pytestmark = pytest.mark.cuda

# Odd sizes plus shapes that exercise each path: batch tiles up to 128, N > 128 (several tiles),
# and an input dimension too large for the shared-memory tile.
SHAPES = ODD_SHAPES + [(40, 70, 100, 900, 3), (17, 300, 130, 1000, 2), (64, 9000, 9, 3000, 5),
                       (8, 40000, 2, 500, 0)]


def variant_cases(transposed):
    variants = snack.TRANSPOSED_VARIANTS if transposed else snack.SPMM_VARIANTS
    for shape in SHAPES:
        for variant in variants:
            for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                yield pytest.param(shape, variant, dtype, id=f"{'x'.join(map(str, shape))}-{variant}-{str(dtype)[6:]}")


# The variants that run 16-bit values only (the planner never picks them for others), and those that
# refuse float64 (shared_x parks its slots' values as float32).
SIXTEEN_BIT_ONLY = ("tensor_core", "wgmma", "tile_view")
TILE_VIEW_MAX_INPUTS = 16384  # the widest layer whose pattern holds the tile view
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)  # wgmma runs there only
NO_FLOAT64 = ("shared_x",)


def refusal(variant, n, in_dim, dtype, cols=None):
    """The error a forced variant gives for a product it cannot run (None: it runs it); cols: W's
    columns where the product is transposed (the tile view is built up to a width)."""
    cols = in_dim if cols is None else cols
    if variant in SIXTEEN_BIT_ONLY and dtype not in (torch.bfloat16, torch.float16):
        return "16-bit"
    if variant == "wgmma" and not HOPPER:
        return "compute capability 9.0"
    if variant == "wgmma" and in_dim % 8:
        return "multiple of 8"
    if variant == "tile_view" and cols > TILE_VIEW_MAX_INPUTS:
        return "no tile view"
    if variant in NO_FLOAT64 and dtype == torch.float64:
        return "float32, bfloat16 and float16"
    return None if fits(variant, n, in_dim, dtype, cols) else "shared memory"


def fits(variant, n, in_dim, dtype, cols=None):
    """wide_rows runs only where one row of X fits in shared memory (the planner never picks it
    otherwise), tensor_core only 16-bit values, wgmma 16-bit values whose rows are a multiple of 8
    inputs on Hopper, tile_view 16-bit values of a pattern that holds the view (cols: W's columns,
    in_dim where None); the other variants run every product."""
    cols = in_dim if cols is None else cols
    if variant in SIXTEEN_BIT_ONLY:
        return dtype in (torch.bfloat16, torch.float16) and (variant != "wgmma" or (
            in_dim % 8 == 0 and HOPPER)) and (variant != "tile_view" or cols <= TILE_VIEW_MAX_INPUTS)
    if variant in NO_FLOAT64 and dtype == torch.float64:
        return False
    if variant != "wide_rows":
        return True
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    accum = 8 if dtype == torch.float64 else 4  # its narrowest block: X's row rounded to 16 bytes, one
    # partial sum per lane (256 lanes), the groups' row pointers and 8 deferred rows per warp
    return (in_dim * dtype.itemsize + 15) // 16 * 16 + 256 * accum + 8 * (17 + 3 * 8 + 1) * 4 <= limit


def assert_forward(y, x, p, bias, dtype, variant):
    if variant == "coo_atomic" and dtype in (torch.bfloat16, torch.float16):
        # Its 16-bit atomicAdd rounds each of a row's partial sums (a run of up to 8 slots each).
        ref, scale = matmul_ref(x, p.dense64.T)
        ref, scale = ref + bias.double().cpu(), scale + bias.double().cpu().abs()
        runs = int(p.pattern.row_ptr.diff().max().item()) // 8 + 2 if p.nnz else 1
        assert_close(y, ref, runs * scale, dtype, variant)
    else:
        assert_matmul(y, x, p.dense64.T, dtype, bias=bias, what=variant)


@pytest.mark.parametrize("shape,variant,dtype", list(variant_cases(False)))
def test_forward_variant(shape, variant, dtype):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, index_dtype=torch.int32 if m > 200 else None, empty_rows=empty)
    x, bias = p.randn(n, k, seed=7), p.randn(m, seed=8)
    if refusal(variant, n, k, dtype):
        with pytest.raises(ValueError, match=refusal(variant, n, k, dtype)):
            ops.spmm(x, p.values, p.tensors, bias, variant=variant)
        return
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant=variant)
    assert_forward(y, x, p, bias, dtype, variant)
    if variant in snack.DETERMINISTIC_VARIANTS:
        for _ in range(3):
            assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant=variant), y), "not bitwise reproducible"


# The variants that read the pattern in place (the CSC view, the tile view): a copy of the CSC view
# cannot be forced on them.
IN_PLACE_ONLY = ("dense_blocks", "wgmma", "tile_view")


@pytest.mark.parametrize("csc", ["in_place", "copied"])
@pytest.mark.parametrize("shape,variant,dtype", list(variant_cases(True)))
def test_transposed_variant(shape, variant, dtype, csc):
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, empty_rows=empty)
    dy = p.randn(n, m, seed=9)
    with snack.csc_read(csc):
        copy_refused = csc == "copied" and variant in IN_PLACE_ONLY
        expected = "copy of the CSC view" if copy_refused else refusal(variant, n, m, dtype, cols=k)
        if expected:
            with pytest.raises(ValueError, match=expected):
                ops.spmm_t(dy, p.values, p.tensors, variant)
            return
        poison_cache(torch.device("cuda"))
        dx = ops.spmm_t(dy, p.values, p.tensors, variant)
        assert_matmul(dx, dy, p.dense64, dtype, what=f"{variant}, CSC {csc}")
        for _ in range(3):
            assert torch.equal(ops.spmm_t(dy, p.values, p.tensors, variant), dx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("m,k,n,nnz,empty,index_dtype", [
    (512, 16384, 1, 2_200_000, 0, None),         # W^T of 16384 rows of ~134 slots: wide_rows over the copy
    (512, 16384, 8, 2_200_000, 0, torch.int32),  # int32 slots of a small weight: the copy's rows in uint16
    (300, 7001, 16, 6_000, 40, None),            # empty rows and columns (most of W^T's rows), odd K
    (70001, 33, 3, 9_000, 0, None),              # W^T's inputs past uint16: int32 rows in the copy
    (37, 50, 5, 0, 0, None),                     # nnz = 0: dX is zero
    (64, 128, 300, 4000, 3, None),               # several batch tiles
])
def test_transposed_over_csc_copy(m, k, n, nnz, empty, index_dtype, dtype):
    # dX with the CSC view gathered into a CSR copy of W^T first: the forward's planner and kernels
    # run on the copy; its plan says so, and the result matches float64 bitwise-reproducibly.
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, index_dtype=index_dtype, empty_rows=empty)
    dy = p.randn(n, m, seed=11)
    with snack.csc_read("copied"):
        plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "input_grad"))
        assert "copy of the CSC view" in plan.describe, plan.describe
        if n == 1 and dtype == torch.float32:  # the forward planner's rule for W^T (Planner.CscCopyRules)
            assert plan.variant == "wide_rows", plan.describe
        rows_bytes = 2 if max(m, k) <= 65536 else 4  # int32 slots of a small weight: uint16 rows in the copy
        copy_bytes = (nnz * rows_bytes + 15) // 16 * 16 + nnz * dtype.itemsize
        if plan.variant in ("wide_rows", "global_x"):  # no workspace of their own: the copy is all of it
            assert plan.workspace_bytes == copy_bytes, plan.describe
        else:
            assert plan.workspace_bytes >= copy_bytes, plan.describe
        poison_cache(torch.device("cuda"))
        dx = ops.spmm_t(dy, p.values, p.tensors)
        assert_matmul(dx, dy, p.dense64, dtype, what=f"{plan.variant} over the copy")
        for _ in range(2):
            assert torch.equal(ops.spmm_t(dy, p.values, p.tensors), dx)
    with snack.csc_read("in_place"):
        assert "copy of the CSC view" not in snack.Plan(*ops.explain(p.values, p.tensors, n, "input_grad")).describe


@pytest.mark.parametrize("variant", snack.FORWARD_ONLY_VARIANTS)
def test_forward_only_variants(variant):
    p = Weight(10, 12, 40, device="cuda")
    with pytest.raises(ValueError, match="forward"):
        ops.spmm_t(p.randn(3, 10), p.values, p.tensors, variant)
    with snack.spmm_variant(variant):  # as the process default, the transposed product plans itself
        dx = ops.spmm_t(p.randn(3, 10), p.values, p.tensors, "auto")
    assert_matmul(dx, p.randn(3, 10), p.dense64, torch.float32)


def test_unknown_variant():
    p = Weight(10, 12, 40, device="cuda")
    with pytest.raises(ValueError, match="unknown variant"):
        ops.spmm(p.randn(3, 12), p.values, p.tensors, None, variant="fastest")


def test_explain_and_override():
    # The planner's own rules are tested on the CPU (tests/cpp/test_planner.cpp); here the binding
    # hands its plans over and the override reaches the kernels.
    layer = snack.SparseLinear(4096, 1024, density=0.1, device="cuda")  # 419 k slots
    one_row = snack.explain(layer, 1)
    assert (one_row.variant, one_row.reason, one_row.workspace_bytes) == ("global_x", "single_row", 0)
    assert "in place" in str(one_row)
    assert snack.explain(layer, 128).variant == "global_xt"
    assert snack.explain(layer, 8, variant="warp_row").reason == "forced"
    # The transposed product of 16 rows: 419 k slots x 16 is above the small-product threshold.
    assert snack.explain(layer, 16, op="input_grad").variant == "global_xt"
    assert snack.explain(layer, 16, op="weight_grad").variant == "rows"
    x = torch.randn(8, 4096, device="cuda")
    with snack.spmm_variant("warp_row"):
        assert snack.explain(layer, 8).variant == "warp_row"
        assert_matmul(layer(x), x, layer.to_dense().detach().T, torch.float32, bias=layer.bias.detach())
    assert snack.explain(layer, 32).variant == "global_xt"
    assert snack.explain(layer, 2).reason == "small_input"  # X of 32 KiB stays in L1
    assert snack.explain(layer, 2, op="input_grad").variant == "global_x"


def test_small_inputs_and_tiny_products_read_x_in_place():
    # X of at most 96 KiB at a batch of at most 8, or at most 512 K multiply-adds: X is read in place
    # (no transpose launch, no workspace), and operands this small are prefetched into L2.
    small = snack.SparseLinear(1024, 768, density=0.1, device="cuda")  # 79 k slots
    plan = snack.explain(small, 8)  # X: 32 KiB
    assert (plan.variant, plan.reason, plan.workspace_bytes, plan.prefetch_l2) == ("global_x", "small_input", 0, True)
    assert snack.explain(small, 16).variant == "global_xt"  # 1.3 M multiply-adds
    tiny = snack.SparseLinear(4096, 4096, density=0.001, device="cuda")  # 16.8 k slots
    assert snack.explain(tiny, 16).reason == "tiny_product"  # X 256 KiB, 268 k multiply-adds
    big = snack.SparseLinear(4096, 4096, density=0.1, device="cuda")  # 1.68 M slots
    assert snack.explain(big, 8).variant == "global_xt"  # X 128 KiB
    assert snack.explain(big, 16).workspace_bytes > 0 and not snack.explain(big, 16).prefetch_l2


def test_one_row_of_a_large_layer_runs_wide_rows():
    # A batch of one row: wide_rows where every warp gets a group of several rows with long rows
    # (12288 or more output rows on an H200, >= 128 slots per row), global_x otherwise.
    rows_per_sm = 3 * 4 * 8 * torch.cuda.get_device_properties(0).multi_processor_count  # 3-row groups, 32 warps/SM
    large = snack.SparseLinear(1024, rows_per_sm, density=0.2, device="cuda")  # ~205 slots per row
    plan = snack.explain(large, 1)
    assert (plan.variant, plan.rows_per_warp) == ("wide_rows", 3)
    w, b = large.to_dense().detach().T, large.bias.detach()
    assert_matmul(large(torch.ones(1, 1024, device="cuda")), torch.ones(1, 1024), w, torch.float32, bias=b)
    # Up to 4 rows (fp32), the whole batch in one tile; a tile of 8 fp32 rows is not chosen (its
    # 32-byte gathers are bound by the banks of shared memory).
    assert (snack.explain(large, 2).batch_tile, snack.explain(large, 2).rows_per_warp) == (2, 3)
    assert (snack.explain(large, 3).variant, snack.explain(large, 3).batch_tile) == ("wide_rows", 4)
    x = torch.randn(3, 1024, device="cuda")
    assert_matmul(large(x), x, w, torch.float32, bias=b)
    assert snack.explain(large, 5).variant != "wide_rows"
    assert snack.explain(large, 1, op="input_grad").variant != "wide_rows"
    sparse = snack.SparseLinear(1024, rows_per_sm, density=0.1, device="cuda")  # ~102 slots per row
    assert snack.explain(sparse, 1).variant == "global_x"
    fewer = snack.SparseLinear(1024, rows_per_sm // 3 * 2, density=0.2, device="cuda")  # 2-row groups
    assert snack.explain(fewer, 1).variant == "global_x"


@pytest.mark.parametrize("variant", snack.DETERMINISTIC_VARIANTS)
@pytest.mark.parametrize("n", [1, 3, 16, 40])
def test_long_rows_split_over_a_block(variant, n):
    # Rows of 5000 entries next to rows of ~10: the kernels hand the long rows to a whole block.
    if variant in SIXTEEN_BIT_ONLY:
        pytest.skip("a 16-bit variant: its own tests run long rows (test_tensor_core_paths, test_wgmma_bands_lists_and_splits)")
    m, k = 300, 5000
    rows, cols = skewed_positions(m, k, dense_rows=11, nnz_rest=3000, seed=n)
    p = Weight(m, k, rows.numel(), device="cuda", positions=(rows, cols))
    x, bias = p.randn(n, k, seed=3), p.randn(m, seed=4)
    y = ops.spmm(x, p.values, p.tensors, bias, variant=variant)
    assert_matmul(y, x, p.dense64.T, torch.float32, bias=bias, what=variant)
    assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant=variant), y)
    if variant in snack.TRANSPOSED_VARIANTS:
        # The transposed product walks columns: make a few columns long instead.
        rows_t, cols_t = skewed_positions(k, m, dense_rows=11, nnz_rest=3000, seed=n, transpose=True)
        q = Weight(k, m, rows_t.numel(), device="cuda", positions=(rows_t, cols_t))
        dy = q.randn(n, k, seed=5)
        dx = ops.spmm_t(dy, q.values, q.tensors, variant)
        assert_matmul(dx, dy, q.dense64, torch.float32, what=variant)
        assert torch.equal(ops.spmm_t(dy, q.values, q.tensors, variant), dx)


# (M, K, nnz, empty rows): bands of dense stretches (every input of a chunk stored: eight vectors of
# slots per row), K not a multiple of 8 (X staged element by element), a few bands over many chunks
# (a cluster of blocks splits each band's columns, each seeking its first column), a partial last
# band, sparse rows (a slot or none per chunk).
TENSOR_CORE_SHAPES = [(64, 100, 5800, 0), (130, 1001, 20000, 9), (256, 4096, 100000, 3), (70, 9000, 60000, 0),
                      (100, 2051, 18000, 5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", TENSOR_CORE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", [9, 16, 40, 128, 200])
def test_tensor_core_paths(shape, n, dtype):
    m, k, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, empty_rows=empty, seed=n)
    x, bias = p.randn(n, k, seed=1), p.randn(m, seed=2)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "tensor_core"))
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant="tensor_core")
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias, what=str(plan))
    assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant="tensor_core"), y), "not bitwise reproducible"
    dy = p.randn(n, m, seed=3)
    dx = ops.spmm_t(dy, p.values, p.tensors, "tensor_core")
    assert_matmul(dx, dy, p.dense64, dtype, what="transposed")
    assert torch.equal(ops.spmm_t(dy, p.values, p.tensors, "tensor_core"), dx)


@pytest.mark.parametrize("index_dtype", [torch.uint16, torch.int32], ids=["uint16", "int32"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
def test_tensor_core_slot_vectors(index_dtype, aligned):
    # The forward reads a row's slots eight at a time with 16-byte loads where the slot arrays allow
    # it: 32-bit indices, values that start off a 16-byte boundary (a view into a larger tensor: read
    # entry by entry), rows that start and end inside a vector, and dense stretches (a row with all
    # 100 inputs, several vectors in one chunk).
    m, k = 130, 1001
    p = Weight(m, k, 30000, device="cuda", dtype=torch.bfloat16, index_dtype=index_dtype, empty_rows=7, seed=3)
    values = p.values
    if not aligned:
        values = torch.empty(p.values.numel() + 1, dtype=p.values.dtype, device="cuda")[1:]
        values.copy_(p.values)
    for n in (16, 64):
        x = p.randn(n, k, seed=n)
        y = ops.spmm(x, values, p.tensors, None, variant="tensor_core")
        assert_matmul(y, x, p.dense64.T, torch.bfloat16, what=f"n={n}")


def test_tensor_core_splits_columns_over_a_cluster():
    p = Weight(256, 4096, 100000, device="cuda", dtype=torch.bfloat16)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, 16, "forward", "tensor_core"))
    assert "8 blocks per band" in plan.describe, plan


# (M, K, nnz, empty rows): as TENSOR_CORE_SHAPES, plus a tile fuller than one round of the block
# (a dense 64 x 64 corner: 4096 entries, eight rounds), nnz = 0, and the widest layer with the view.
TILE_VIEW_SHAPES = TENSOR_CORE_SHAPES + [(64, 64, 4096, 0), (200, 90, 0, 0), (65, 16384, 40000, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", TILE_VIEW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", [1, 9, 16, 40, 64, 100])
def test_tile_view_paths(shape, n, dtype):
    # The forward and dX over the tile view: batch tiles of 16, 32 and 64 (and two of 64 at N = 100),
    # a cluster splitting a band's tiles (and a block with a single one), against float64 on a
    # poisoned output, bitwise repeated; the forward with bias and an activation.
    m, k, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, empty_rows=empty, seed=n)
    x, bias, dy = p.randn(n, k, seed=1), p.randn(m, seed=2), p.randn(n, m, seed=3)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "tile_view"))
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant="tile_view")
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias, what=str(plan))
    assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant="tile_view"), y), "not bitwise reproducible"
    relu = ops.spmm(x, p.values, p.tensors, bias, "relu", variant="tile_view")
    assert torch.equal(relu, torch.relu(y)), "the activation is applied to the rounded sum"
    plan_t = snack.Plan(*ops.explain(p.values, p.tensors, n, "input_grad", "tile_view"))
    poison_cache(torch.device("cuda"))
    dx = ops.spmm_t(dy, p.values, p.tensors, "tile_view")
    assert_matmul(dx, dy, p.dense64, dtype, what=str(plan_t))
    assert torch.equal(ops.spmm_t(dy, p.values, p.tensors, "tile_view"), dx), "not bitwise reproducible"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", TILE_VIEW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", [16, 40, 100])
def test_tile_view_reads_packed_tile_values(shape, n, dtype):
    # The forward over the tile view reading the packed tile values instead of gathering the values:
    # the same tiles in shared memory, so bitwise the result of the gathering kernel, and float64's
    # within tolerance; with a bias and an activation, the planner's clusters (up to 8 blocks per band
    # on the wide layers) and its own choice (which reads the tiles only where it runs the tile view).
    m, k, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, empty_rows=empty, seed=n + 1)
    x, bias = p.randn(n, k, seed=1), p.randn(m, seed=2)
    tiles = ops.pack_tile_values(p.values, p.tensors)
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant="tile_view", tiles=tiles)
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias, what="packed")
    assert torch.equal(y, ops.spmm(x, p.values, p.tensors, bias, variant="tile_view")), "differs from the gathers"
    gelu = ops.spmm(x, p.values, p.tensors, bias, "gelu", variant="tile_view", tiles=tiles)
    assert torch.equal(gelu, ops.spmm(x, p.values, p.tensors, bias, "gelu", variant="tile_view"))
    # The planner given the tiles (which may take another kernel than without them).
    planned = ops.spmm(x, p.values, p.tensors, bias, tiles=tiles)
    assert_matmul(planned, x, p.dense64.T, dtype, bias=bias, what="planned with packed tiles")
    if snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "auto", "none", 1, True)).variant == "tile_view":
        assert torch.equal(planned, y)


def test_planner_takes_the_tile_view_given_packed_tile_values():
    # 4096 x 4096 at 80%, 32 rows: tensor_core without them, the tile view reading them with them
    # (src/spmm/plan.cpp, packed_tile_view_pays); the layer's explain follows its pack_tiles, and its
    # tile_format: a fragment kernel with tile fragments (wgmma's on Hopper at 32 rows).
    layer = snack.SparseLinear(4096, 4096, density=0.2, device="cuda", dtype=torch.bfloat16)
    assert snack.explain(layer, 32).variant != "tile_view"
    dense = layer.to_dense().double()
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    for pack_tiles, described in (("entries", "packed tile values"), (True, "tile fragments")):
        snack.for_inference(layer, pack_tiles=pack_tiles)
        plan = snack.explain(layer, 32)
        kernel = "wgmma" if HOPPER and pack_tiles is True else "tile_view"
        assert plan.variant == kernel and described in plan.describe, plan
        with torch.no_grad():
            assert_matmul(layer(x), x, dense.T, torch.bfloat16, bias=layer.bias)


def test_packed_tile_values_replay_in_a_cuda_graph_and_stay_in_bounds_of_a_foreign_view():
    # A layer packed for inference captured in a CUDA graph replays its forward; tiles packed over a
    # view that lists slots outside their band (not the pattern's) pack zeros, never a read past it.
    layer = snack.SparseLinear(300, 200, density=0.1, device="cuda", dtype=torch.bfloat16)
    snack.for_inference(layer, pack_tiles=True)
    x = torch.randn(48, 300, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = layer(x)
        out = {}
        graph = capture_graph(lambda: out.update(y=layer(x)))
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out["y"], layer(x)) and not torch.equal(out["y"], expected)
    p = Weight(64, 64, 100, device="cuda", dtype=torch.bfloat16)
    tensors = list(p.tensors)
    entries = tensors[snack.PATTERN_FIELDS.index("tile_entries")].clone()
    entries[0] = entries[0] | (4000 << 12)  # slot offset far past the band's 100 slots
    tensors[snack.PATTERN_FIELDS.index("tile_entries")] = entries
    words = ops.pack_tile_values(p.values, tensors).view(torch.int32).flatten()
    torch.cuda.synchronize()
    assert int(words[0]) >> 16 == 0


@pytest.mark.parametrize("splits", [1, 3, 5, 8])
def test_tile_view_runs_every_count_of_blocks_per_band(splits):
    # snack.tile_view_splits(k) sets the blocks per band of the forward, dX and dW over the tile view
    # (clusters of any size up to 8 for the SpMM, runs of tiles for the SDDMM), each against float64;
    # the plans show the count, and a count a product cannot run is refused naming the ones it can.
    p = Weight(520, 700, 20000, device="cuda", dtype=torch.bfloat16, empty_rows=3, seed=splits)
    x, dy = p.randn(24, 700, seed=1), p.randn(24, 520, seed=2)
    with snack.tile_view_splits(splits):
        for op, bands in (("forward", 9), ("input_grad", 11), ("weight_grad", 9)):
            plan = snack.Plan(*ops.explain(p.values, p.tensors, 24, op, "tile_view"))
            assert plan.grid == bands * splits, plan
        poison_cache(torch.device("cuda"))
        assert_matmul(ops.spmm(x, p.values, p.tensors, None, variant="tile_view"), x, p.dense64.T, torch.bfloat16)
        assert_matmul(ops.spmm_t(dy, p.values, p.tensors, "tile_view"), dy, p.dense64, torch.bfloat16)
        assert_close(ops.sddmm(dy, x, p.tensors, variant="tile_view"), *p.slot_ref(dy, x), torch.bfloat16, "tile_view")
    with snack.tile_view_splits(9), pytest.raises(ValueError, match="1 to 8 run this product"):
        ops.spmm(x, p.values, p.tensors, None, variant="tile_view")
    with snack.tile_view_splits(12), pytest.raises(ValueError, match="1 to 11 run this product"):
        ops.sddmm(dy, x, p.tensors, variant="tile_view")


def test_tile_view_follows_topology_updates_and_refuses_what_it_cannot_run():
    # The view is rebuilt in place with the slots (a DST update), so the forward and dX read the new
    # pattern; float32 values, a pattern list without the view and a copy of the CSC view are refused.
    layer = snack.SparseLinear(300, 200, density=0.1, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(40, 300, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(40, 200, device="cuda", dtype=torch.bfloat16)
    before = ops.spmm(x, layer.values.detach(), layer.pattern.tensors, None, variant="tile_view")
    rows, cols = ops.random_slots(200, 300, layer.nnz, generator=torch.Generator().manual_seed(1), device="cuda")
    layer.pattern.set_slots(rows, cols)
    y = ops.spmm(x, layer.values.detach(), layer.pattern.tensors, None, variant="tile_view")
    assert_matmul(y, x, layer.to_dense().detach().double().T, torch.bfloat16)
    assert not torch.equal(y, before)
    dx = ops.spmm_t(dy, layer.values.detach(), layer.pattern.tensors, "tile_view")
    assert_matmul(dx, dy, layer.to_dense().detach().double(), torch.bfloat16)
    fp32 = Weight(64, 100, 500, device="cuda")
    with pytest.raises(ValueError, match="16-bit"):
        ops.spmm(fp32.randn(20, 100), fp32.values, fp32.tensors, None, variant="tile_view")
    bf16 = Weight(64, 100, 500, device="cuda", dtype=torch.bfloat16)
    without = bf16.tensors[:5] + [torch.zeros(0, dtype=torch.int32, device="cuda")] * 2
    with pytest.raises(ValueError, match="no tile view"):
        ops.spmm(bf16.randn(20, 100), bf16.values, without, None, variant="tile_view")
    assert_matmul(ops.spmm(bf16.randn(20, 100), bf16.values, without, None), bf16.randn(20, 100), bf16.dense64.T,
                  torch.bfloat16)
    with pytest.raises(ValueError, match="no tile view"):
        ops.spmm_t(bf16.randn(20, 64), bf16.values, without, "tile_view")
    with snack.csc_read("copied"), pytest.raises(ValueError, match="copy of the CSC view"):
        ops.spmm_t(bf16.randn(20, 64), bf16.values, bf16.tensors, "tile_view")


def test_the_planner_takes_the_tile_view_for_mid_batches_of_sparse_layers():
    layer = snack.SparseLinear(4096, 4096, density=0.1, device="cuda")
    for n in (32, 64):
        assert snack.explain(layer, n, dtype=torch.bfloat16).variant == "tile_view", n
        assert snack.explain(layer, n).variant != "tile_view", n  # float32
    assert snack.explain(layer, 16, dtype=torch.bfloat16).variant != "tile_view"
    assert snack.explain(layer, 128, dtype=torch.bfloat16).variant == "tile_view"  # two batch tiles
    assert snack.explain(layer, 129, dtype=torch.bfloat16).variant != "tile_view"
    for n in (1, 8, 16, 64, 128):  # dX: the tiles read down W's columns from one row on a layer this large
        assert snack.explain(layer, n, dtype=torch.bfloat16, op="input_grad").variant == "tile_view", n
    assert snack.explain(layer, 256, dtype=torch.bfloat16, op="input_grad").variant != "tile_view"
    very_sparse = snack.SparseLinear(4096, 4096, density=0.01, device="cuda")
    assert snack.explain(very_sparse, 64, dtype=torch.bfloat16, op="input_grad").variant != "tile_view"
    dense = snack.SparseLinear(4096, 4096, density=0.3, device="cuda")
    assert snack.explain(dense, 64, dtype=torch.bfloat16).variant != "tile_view"


def test_the_planner_takes_tensor_cores_for_many_rows_at_a_high_density():
    dense_enough = Weight(768, 3072, 768 * 3072 // 2, device="cuda", dtype=torch.bfloat16)
    assert snack.Plan(*ops.explain(dense_enough.values, dense_enough.tensors, 128, "forward", "auto")).variant == \
        "tensor_core"
    assert snack.Plan(*ops.explain(dense_enough.values, dense_enough.tensors, 16, "forward", "auto")).variant != \
        "tensor_core"
    fp32 = Weight(768, 3072, 768 * 3072 // 2, device="cuda")
    assert snack.Plan(*ops.explain(fp32.values, fp32.tensors, 128, "forward", "auto")).variant != "tensor_core"
    layer = snack.SparseLinear(3072, 768, density=0.5, device="cuda")  # float32 values, run under autocast
    assert snack.explain(layer, 128).variant != "tensor_core"
    assert snack.explain(layer, 128, dtype=torch.bfloat16).variant == "tensor_core"


def test_the_planner_takes_wide_rows_for_16bit_batches_of_8_to_16_from_4096_inputs():
    def variant(m, k, sparsity, n, dtype=torch.bfloat16):
        layer = snack.SparseLinear(k, m, sparsity=sparsity, device="cuda", dtype=dtype)
        return snack.explain(layer, n).variant
    assert variant(4096, 4096, 0.9, 8) == "wide_rows"           # one tile of 8, a row per warp group
    assert variant(4096, 4096, 0.5, 16) == "wide_rows"          # one tile of 16, dense rows
    assert variant(4096, 4096, 0.9, 16) != "wide_rows"          # sparse rows: global_xt
    assert variant(16384, 4096, 0.9, 16) == "wide_rows"         # sparse rows of a large layer
    assert variant(3072, 768, 0.5, 8) != "wide_rows"            # fewer than 4096 inputs
    assert variant(4096, 4096, 0.9, 8, torch.float32) != "wide_rows"  # fp32 keeps its own rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [None, torch.int32])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 11, 16])
def test_wide_rows_closes_every_row_once(n, index_dtype, dtype):
    # Few rows, so one row per warp: rows over many chunks of 256 slots that start and end anywhere
    # in a lane's 8 slots, runs of empty rows between and after them, rows of one slot, and a first
    # row that ends on a chunk boundary. Batch tiles of 1, 2, 8 and (16-bit values) 16 rows; 5 and
    # 11 rows leave a tile's last rows empty.
    k = 5000
    gen = torch.Generator().manual_seed(n)
    lengths = [2048, 0, 0, 2040, 8, 4096, 1, 0, 3, 2048, 4999, 0, 0] + [1] * 40 + [0] * 7
    rows = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    cols = torch.cat([torch.randperm(k, generator=gen)[:length] for length in lengths])
    p = Weight(len(lengths), k, rows.numel(), device="cuda", dtype=dtype, index_dtype=index_dtype,
                positions=(rows, cols))
    x, bias = p.randn(n, k, seed=11), p.randn(len(lengths), seed=12)
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant="wide_rows")
    assert_matmul(y, x, p.dense64.T, dtype, bias=bias)
    assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant="wide_rows"), y)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "wide_rows"))
    assert plan.batch_tile == min(16 if dtype.itemsize == 2 else 8, 1 << (n - 1).bit_length())


def spread_positions(lengths, k, seed):
    """Positions of rows with the given lengths (each <= k): row r holds columns start_r + 7 j mod k,
    distinct while 7 and k are coprime."""
    assert k % 7 != 0
    gen = torch.Generator().manual_seed(seed)
    m = lengths.numel()
    rows = torch.repeat_interleave(torch.arange(m), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    offset = torch.arange(rows.numel()) - first[rows]
    start = torch.randint(0, k, (m,), generator=gen)
    return rows, (start[rows] + 7 * offset) % k


def wide_rows_case(lengths, k, index_dtype, seed, n=1):
    """Runs wide_rows with bias and ReLU on rows of the given lengths and a batch of n rows; returns
    the result, its float64 reference and scale (sparse products, no dense twin), and the plan."""
    m = lengths.numel()
    rows, cols = spread_positions(lengths, k, seed)
    pattern, _ = snack.Pattern.from_coo(rows.cuda(), cols.cuda(), m, k, index_dtype=index_dtype)
    row_idx, col_idx = pattern.row_idx.long(), pattern.col_idx.long()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(pattern.nnz, device="cuda", generator=gen)
    x = torch.randn(n, k, device="cuda", dtype=torch.float64, generator=gen).float().double()
    bias = torch.randn(m, device="cuda", dtype=torch.float64, generator=gen).float().double()
    products = values.double() * x[:, col_idx]
    zeros = torch.zeros(n, m, device="cuda", dtype=torch.float64)
    ref = torch.relu(zeros.index_add(1, row_idx, products) + bias)
    scale = zeros.index_add(1, row_idx, products.abs()) + bias.abs()  # ReLU only shrinks the error
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x.float(), values, pattern.tensors, bias.float(), activation="relu", variant="wide_rows")
    assert torch.equal(ops.spmm(x.float(), values, pattern.tensors, bias.float(), activation="relu",
                                variant="wide_rows"), y)
    return y, ref, scale, snack.Plan(*ops.explain(values, pattern.tensors, n, "forward", "wide_rows"))


@pytest.mark.parametrize("m,index_dtype,n", [(65000, None, 1), (120000, torch.int32, 1), (65000, None, 6)])
def test_wide_rows_groups_of_many_rows(m, index_dtype, n):
    # Enough rows for groups of several rows per warp (16 on an H200 at n = 1; 120000 rows: more groups
    # than resident warps, so warps take further groups; a tile of 8 rows: 4 rows per group, as many as
    # shared memory holds beside the tile): row lengths 0..60, runs of empty rows and of one-slot rows,
    # and rows longer than the long-row threshold (1024) anywhere in a group, some groups with two (the
    # first is handed to the block, the second summed by the warp).
    k = 2000
    gen = torch.Generator().manual_seed(m)
    kind = torch.randint(0, 50, (m,), generator=gen)
    lengths = torch.where(kind == 0, torch.randint(1100, k + 1, (m,), generator=gen),
                          torch.where(kind < 10, 0, torch.where(kind < 20, 1, torch.randint(0, 61, (m,), generator=gen))))
    lengths[1000:1300] = 0
    lengths[5000:5004] = k
    y, ref, scale, plan = wide_rows_case(lengths, k, index_dtype, seed=m, n=n)
    assert plan.rows_per_warp > 1
    assert_close(y, ref, scale, torch.float32)


@pytest.mark.parametrize("n", [1, 8])
def test_wide_rows_more_long_rows_than_a_warp_keeps(n):
    # 600000 rows, every 16th one full (1100 slots, above the long-row threshold): several groups per
    # warp on an H200 hold a long row, so a warp's list of 8 deferred rows fills and it sums the rest
    # itself. With a tile of 8 rows a block's 32 warps defer more rows than its partial sums hold
    # slices of at once (5 rows per group: 164 rows per round), so they are summed in rounds. Which
    # rows are deferred must not vary between runs (bitwise).
    m, k = 600000, 1100
    lengths = torch.zeros(m, dtype=torch.int64)
    lengths[5::16] = k
    lengths[7::64] = 3
    y, ref, scale, _ = wide_rows_case(lengths, k, torch.int32, seed=5, n=n)
    assert_close(y, ref, scale, torch.float32)


@pytest.mark.parametrize("variant", snack.SPMM_VARIANTS)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_activation_every_variant(variant, activation):
    if variant == "wgmma" and not HOPPER:
        pytest.skip("wgmma needs compute capability 9.0")
    dtype = torch.bfloat16 if variant in SIXTEEN_BIT_ONLY else torch.float32
    k = 96 if variant == "wgmma" else 90  # wgmma's rows of X are whole 16-byte units
    p = Weight(70, k, 900, device="cuda", dtype=dtype, empty_rows=4)
    x, bias = p.randn(6, k, seed=1), p.randn(70, seed=2)
    y = ops.spmm(x, p.values, p.tensors, bias, activation=activation, variant=variant)
    z, scale = matmul_ref(x, p.dense64.T)
    z, scale = z + bias.double().cpu(), scale + bias.double().cpu().abs()
    ref = torch.relu(z) if activation == "relu" else torch.nn.functional.gelu(z)
    assert_close(y, ref, 1.2 * scale, dtype, variant)  # both activations have slope below 1.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 16, 64, 130])
def test_sddmm_paths(n, dtype):
    # The automatic choice: one thread per slot below n = 4, the rows kernel up to n = 128 (n = 64:
    # two chunks of dY per batch lane), the vector kernel above (n = 130).
    check_sddmm(Weight(90, 300, 4000, device="cuda", dtype=dtype, empty_rows=7), n, dtype)


def check_sddmm(p, n, dtype, variant="auto"):
    """SDDMM on a poisoned cache against float64, then bitwise-equal on a second run."""
    dy, x = p.randn(n, p.m, seed=1), p.randn(n, p.k, seed=2)
    poison_cache(torch.device("cuda"))
    dv = ops.sddmm(dy, x, p.tensors, variant=variant)
    assert_close(dv, *p.slot_ref(dy, x), dtype, variant)
    assert torch.equal(ops.sddmm(dy, x, p.tensors, variant=variant), dv)


@pytest.mark.parametrize("variant", ["rows", "vector"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,m,k,density", [(32, 3000, 1700, 0.25), (16, 4000, 1200, 0.2), (13, 60, 700, 0.2)])
def test_sddmm_skewed_rows(n, m, k, density, dtype, variant):
    # Three full rows among sparse ones: the rows kernel walks each long row with one warp, the
    # vector kernel splits the slots evenly.
    nnz_rest = int(density * m * k)
    rows, cols = skewed_positions(m, k, dense_rows=3, nnz_rest=nnz_rest, seed=n)
    check_sddmm(Weight(m, k, rows.numel(), device="cuda", dtype=dtype, positions=(rows, cols)), n, dtype, variant)


def sddmm_cases():
    for shape in SHAPES:
        for variant in snack.SDDMM_VARIANTS:
            for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
                yield pytest.param(shape, variant, dtype, id=f"{'x'.join(map(str, shape))}-{variant}-{str(dtype)[6:]}")


def sddmm_runs(variant, n, dtype, k):
    """The rows kernel runs batches of at most 128 (padded to a multiple of 4), the staged kernel
    float32 operands, the tensor-core kernel 16-bit ones, the tile-view kernel 16-bit ones of at most
    128 rows on patterns that hold the view (k: W's columns), its wgmma form up to 512 (in chunks of
    128); the others any."""
    if variant == "staged":
        return dtype == torch.float32
    if variant == "tensor_core":
        return dtype in (torch.bfloat16, torch.float16)
    if variant in ("tile_view", "tile_view_wgmma"):
        return (dtype in (torch.bfloat16, torch.float16) and n <= (128 if variant == "tile_view" else 512) and
                k <= TILE_VIEW_MAX_INPUTS and (variant == "tile_view" or HOPPER))
    return variant != "rows" or (n + 3) // 4 * 4 <= 128


@pytest.mark.parametrize("shape,variant,dtype", list(sddmm_cases()))
def test_sddmm_variant(shape, variant, dtype):
    # Every SDDMM kernel, forced, on the odd-size suite (int32 indices on the larger shapes), against
    # float64 on a poisoned cache, bitwise reproducible.
    m, k, n, nnz, empty = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, index_dtype=torch.int32 if m > 200 else None, empty_rows=empty)
    dy, x = p.randn(n, m, seed=3), p.randn(n, k, seed=4)
    if not sddmm_runs(variant, n, dtype, k):
        with pytest.raises(ValueError, match="sddmm"):
            ops.sddmm(dy, x, p.tensors, variant=variant)
        return
    poison_cache(torch.device("cuda"))
    dv = ops.sddmm(dy, x, p.tensors, variant=variant)
    assert_close(dv, *p.slot_ref(dy, x), dtype, variant)
    for _ in range(2):
        assert torch.equal(ops.sddmm(dy, x, p.tensors, variant=variant), dv), "not bitwise reproducible"


# (m, k, density, n, index dtype, full rows): chunks of 16 to 256 columns (the planner's width from the
# density), layers that end inside a band, a chunk and a batch tile, the batch split over blocks
# (small layers, large batches) or not, and full rows that put more than the block's list of 2048
# slots into one tile (passes); 16-byte copies where both dimensions are multiples of 4 and the chunk
# at most 128 columns (the first and last cases), else 4-byte ones.
STAGED_CASES = [(300, 700, 0.1, 200, None, 0), (130, 90, 0.5, 1000, torch.int32, 0), (1000, 2000, 0.03, 129, None, 0),
                (257, 5000, 0.05, 333, torch.int32, 12), (64, 300, 0.02, 4097, None, 0), (200, 17, 0.9, 65, None, 3),
                (512, 1024, 0.02, 1100, None, 60)]


@pytest.mark.parametrize("m,k,density,n,index_dtype,full_rows", STAGED_CASES)
def test_sddmm_staged_tiles_passes_and_splits(m, k, density, n, index_dtype, full_rows):
    nnz = int(density * m * k)
    positions = skewed_positions(m, k, dense_rows=full_rows, nnz_rest=nnz, seed=n) if full_rows else None
    p = Weight(m, k, nnz, device="cuda", index_dtype=index_dtype, empty_rows=0 if full_rows else 5,
               positions=positions)
    dy, x = p.randn(n, m, seed=7), p.randn(n, k, seed=8)
    poison_cache(torch.device("cuda"))
    dv = ops.sddmm(dy, x, p.tensors, variant="staged")
    assert_close(dv, *p.slot_ref(dy, x), torch.float32, "staged")
    assert torch.equal(ops.sddmm(dy, x, p.tensors, variant="staged"), dv), "not bitwise reproducible"
    plan = ops.explain(p.values, p.tensors, n, "weight_grad", "staged")
    assert plan[0] == "staged" and plan[7] > 0, plan


# (m, k, density, n, index dtype, full rows, unaligned operands): runs of several tiles per block where
# the bands x tiles pass 4 blocks per SM (2048 x 9000 on the H200: 3, the cursors seeked to a later tile),
# K not a multiple of 8 and unaligned operands (copied element by element), rows with more slots in
# a tile than a pass of the pair of lanes takes (30% and full rows), batches of one chunk, of several
# and a partial last one, a band cut short (129, 300 rows), one batch row.
TENSOR_CORE_SDDMM_CASES = [(2048, 9000, 0.05, 37, None, 0, False), (300, 1001, 0.3, 16, None, 4, False),
                           (1000, 4096, 0.1, 200, torch.int32, 0, False), (129, 64, 0.5, 1, None, 0, False),
                           (520, 3000, 0.02, 8, None, 2, True), (256, 640, 0.2, 64, torch.int32, 0, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,density,n,index_dtype,full_rows,misaligned", TENSOR_CORE_SDDMM_CASES)
def test_sddmm_tensor_core_tiles(m, k, density, n, index_dtype, full_rows, misaligned, dtype):
    check_sddmm_tiles("tensor_core", m, k, density, n, full_rows, misaligned, dtype, index_dtype)


def check_sddmm_tiles(variant, m, k, density, n, full_rows, misaligned, dtype, index_dtype=None):
    """A tile kernel forced on a pattern of `density` with `full_rows` full rows (else 7 empty ones),
    against float64 on a poisoned cache, bitwise reproducible, its plan with no workspace."""
    nnz = int(density * m * k)
    positions = skewed_positions(m, k, dense_rows=full_rows, nnz_rest=nnz, seed=n) if full_rows else None
    p = Weight(m, k, nnz, device="cuda", dtype=dtype, index_dtype=index_dtype,
               empty_rows=0 if full_rows or density == 1.0 else 7, positions=positions, seed=m + n)
    dy, x = p.randn(n, m, seed=9), p.randn(n, k, seed=10)
    if misaligned:
        dy, x = unaligned(dy), unaligned(x)
    poison_cache(torch.device("cuda"))
    dv = ops.sddmm(dy, x, p.tensors, variant=variant)
    assert_close(dv, *p.slot_ref(dy, x), dtype, variant)
    assert torch.equal(ops.sddmm(dy, x, p.tensors, variant=variant), dv), "not bitwise reproducible"
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "weight_grad", variant))
    assert plan.variant == variant and plan.smem_bytes > 0 and plan.workspace_bytes == 0, plan


# (m, k, density, n, full rows, unaligned operands): batches of one to eight k-steps (1, 16, 37 padded
# to 64, 100 padded to 128), a band and a chunk cut short, K not a multiple of 8 with unaligned
# operands (copied element by element), full rows that put a whole 64 x 64 tile (4096 entries, eight
# rounds of the block) in the view, runs of one tile per block and of several (2048 x 9000), nnz = 0.
TILE_VIEW_SDDMM_CASES = [(2048, 9000, 0.05, 37, 0, False), (300, 1001, 0.3, 16, 4, False), (129, 64, 0.5, 1, 0, False),
                         (520, 3000, 0.02, 100, 2, True), (64, 64, 1.0, 128, 0, False), (200, 90, 0.0, 20, 0, False),
                         (70, 16384, 0.03, 64, 0, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,density,n,full_rows,misaligned", TILE_VIEW_SDDMM_CASES)
def test_sddmm_tile_view_tiles(m, k, density, n, full_rows, misaligned, dtype):
    check_sddmm_tiles("tile_view", m, k, density, n, full_rows, misaligned, dtype)


@pytest.mark.skipif(not HOPPER, reason="wgmma: Hopper")
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,density,n,full_rows,misaligned", TILE_VIEW_SDDMM_CASES)
def test_sddmm_tile_view_wgmma_tiles(m, k, density, n, full_rows, misaligned, dtype, groups):
    # The wgmma kernel on the mma.sync kernel's cases, with one warpgroup a block and with two (an odd
    # count of bands leaves the last block's second warpgroup without one: 300, 129, 520 and 200 rows).
    with snack.fragment_warpgroups(groups):
        check_sddmm_tiles("tile_view_wgmma", m, k, density, n, full_rows, misaligned, dtype)
        q = Weight(m, k, 10, device="cuda", dtype=dtype)
        plan = snack.Plan(*ops.explain(q.values, q.tensors, n, "weight_grad", "tile_view_wgmma"))
        assert plan.threads == 128 * groups, plan


# Past 128 batch rows the wgmma kernel runs the batch in chunks of 128 (dY's band kept in shared
# memory): two to four chunks, the last one short, K not a multiple of 8 with unaligned operands,
# full rows (whole tiles), runs of several tiles per block, nnz = 0.
TILE_VIEW_WGMMA_CHUNK_CASES = [(300, 1001, 0.3, 129, 4, False), (520, 3000, 0.05, 300, 2, True),
                               (129, 64, 0.5, 512, 0, False), (2048, 1000, 0.1, 260, 0, False),
                               (200, 90, 0.0, 300, 0, False)]


@pytest.mark.skipif(not HOPPER, reason="wgmma: Hopper")
@pytest.mark.parametrize("groups", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,density,n,full_rows,misaligned", TILE_VIEW_WGMMA_CHUNK_CASES)
def test_sddmm_tile_view_wgmma_batch_chunks(m, k, density, n, full_rows, misaligned, dtype, groups):
    if groups == 2 and n > 384:
        pytest.skip("two warpgroups keeping four chunks of dY exceed a block's shared memory")
    with snack.fragment_warpgroups(groups):  # 0: the planner's count
        check_sddmm_tiles("tile_view_wgmma", m, k, density, n, full_rows, misaligned, dtype)
        q = Weight(m, k, 10, device="cuda", dtype=dtype)
        plan = snack.Plan(*ops.explain(q.values, q.tensors, n, "weight_grad", "tile_view_wgmma"))
        assert f"the batch in {(n + 127) // 128} chunks of 128 rows" in plan.describe, plan
        assert plan.threads == 128 * (groups or (2 if n <= 384 else 1)), plan


@pytest.mark.skipif(not HOPPER, reason="wgmma: Hopper")
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_sddmm_tile_view_wgmma_runs_of_tiles(splits):
    # Runs of 1 to 22 tiles a block (the parity of a run's last tile picks the set of entries read
    # last), tiles fuller than a warpgroup's round of 512 entries, a batch of three k-steps padded to 4.
    p = Weight(256, 1400, 90000, device="cuda", dtype=torch.bfloat16, empty_rows=3, seed=splits)
    dy, x = p.randn(50, 256, seed=11), p.randn(50, 1400, seed=12)
    with snack.tile_view_splits(splits), snack.fragment_warpgroups(2):
        poison_cache(torch.device("cuda"))
        dv = ops.sddmm(dy, x, p.tensors, variant="tile_view_wgmma")
    assert_close(dv, *p.slot_ref(dy, x), torch.bfloat16, "tile_view_wgmma")


def test_sddmm_tile_view_wgmma_refusals():
    p = Weight(64, 80, 900, device="cuda", dtype=torch.bfloat16)
    dy, x = p.randn(16, 64, seed=1), p.randn(16, 80, seed=2)
    if not HOPPER:
        with pytest.raises(ValueError, match="compute capability 9.0"):
            ops.sddmm(dy, x, p.tensors, variant="tile_view_wgmma")
        return
    fp32 = Weight(64, 80, 900, device="cuda")
    with pytest.raises(ValueError, match="tile_view_wgmma runs 16-bit operands"):
        ops.sddmm(fp32.randn(16, 64, seed=1), fp32.randn(16, 80, seed=2), fp32.tensors, variant="tile_view_wgmma")
    with pytest.raises(ValueError, match="batches of at most 512"):
        ops.sddmm(p.randn(513, 64, seed=1), p.randn(513, 80, seed=2), p.tensors, variant="tile_view_wgmma")
    with pytest.raises(ValueError, match="batches of at most 128"):
        ops.sddmm(p.randn(129, 64, seed=1), p.randn(129, 80, seed=2), p.tensors, variant="tile_view")
    without = p.tensors[:5] + [torch.zeros(0, dtype=torch.int32, device="cuda")] * 2
    with pytest.raises(ValueError, match="no tile view"):
        ops.sddmm(dy, x, without, variant="tile_view_wgmma")


def test_the_planner_takes_the_tile_view_for_the_weight_gradient_where_it_pays():
    layer = snack.SparseLinear(4096, 16384, density=0.1, device="cuda")
    past_32 = "tile_view_wgmma" if HOPPER else "tile_view"  # its wgmma kernel past 32 rows on Hopper
    for n, groups in ((33, 1), (64, 1), (65, 2), (128, 2)):
        plan = snack.explain(layer, n, dtype=torch.bfloat16, op="weight_grad")
        assert plan.variant == past_32 and (not HOPPER or plan.threads == 128 * groups), (n, plan)
    assert snack.explain(layer, 32, dtype=torch.bfloat16, op="weight_grad").variant == "tile_view"
    assert snack.explain(layer, 16, dtype=torch.bfloat16, op="weight_grad").variant == "tile_view"
    assert snack.explain(layer, 8, dtype=torch.bfloat16, op="weight_grad").variant == "tile_view"
    assert snack.explain(layer, 7, dtype=torch.bfloat16, op="weight_grad").variant != "tile_view"
    sparser = snack.SparseLinear(4096, 16384, density=0.05, device="cuda")
    assert snack.explain(sparser, 8, dtype=torch.bfloat16, op="weight_grad").variant != "tile_view"
    assert snack.explain(layer, 64, op="weight_grad").variant != "tile_view"  # float32
    small = snack.SparseLinear(3072, 768, density=0.1, device="cuda")
    assert snack.explain(small, 8, dtype=torch.bfloat16, op="weight_grad").variant == "tile_view"
    assert snack.explain(small, 1, dtype=torch.bfloat16, op="weight_grad").variant != "tile_view"
    if HOPPER:  # past 128 rows, the batch in chunks of 128: to 256 rows, to 512 on layers under 2^24 weights
        for n in (129, 256):
            assert snack.explain(layer, n, dtype=torch.bfloat16, op="weight_grad").variant == "tile_view_wgmma", n
        assert snack.explain(layer, 300, dtype=torch.bfloat16, op="weight_grad").variant != "tile_view_wgmma"
        plan = snack.explain(small, 512, dtype=torch.bfloat16, op="weight_grad")
        assert plan.variant == "tile_view_wgmma" and "the batch in 4 chunks" in plan.describe, plan


def test_sddmm_tile_view_refuses_what_it_cannot_run():
    fp32 = Weight(64, 80, 900, device="cuda")
    with pytest.raises(ValueError, match="tile_view runs 16-bit operands"):
        ops.sddmm(fp32.randn(16, 64, seed=1), fp32.randn(16, 80, seed=2), fp32.tensors, variant="tile_view")
    p = Weight(64, 80, 900, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="batches of at most 128"):
        ops.sddmm(p.randn(129, 64, seed=1), p.randn(129, 80, seed=2), p.tensors, variant="tile_view")
    without = p.tensors[:5] + [torch.zeros(0, dtype=torch.int32, device="cuda")] * 2
    with pytest.raises(ValueError, match="no tile view"):
        ops.sddmm(p.randn(16, 64, seed=1), p.randn(16, 80, seed=2), without, variant="tile_view")
    wide = Weight(8, 20000, 300, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no tile view"):
        ops.sddmm(wide.randn(16, 8, seed=1), wide.randn(16, 20000, seed=2), wide.tensors, variant="tile_view")


def test_sddmm_tensor_core_refuses_other_types():
    p = Weight(64, 80, 900, device="cuda")
    dy, x = p.randn(16, 64, seed=1), p.randn(16, 80, seed=2)
    with pytest.raises(ValueError, match="tensor_core runs 16-bit operands"):
        ops.sddmm(dy, x, p.tensors, variant="tensor_core")


@pytest.mark.parametrize("n", [4, 7, 12, 16, 32])
def test_sddmm_rows_equals_vector_bitwise(n):
    # Up to a batch of 32 the rows kernel's reduce-scatter adds in the vector kernel's butterfly
    # order, over the same per-lane dot products: equal bits.
    p = Weight(300, 700, 20000, device="cuda", empty_rows=9)
    dy, x = p.randn(n, 300, seed=5), p.randn(n, 700, seed=6)
    assert torch.equal(ops.sddmm(dy, x, p.tensors, variant="rows"), ops.sddmm(dy, x, p.tensors, variant="vector"))


def unaligned(t):
    """A copy of t, of its shape, whose data starts one element past an aligned address (a contiguous view)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("index_dtype", [None, torch.int32])
@pytest.mark.parametrize("nnz", [2001, 2000])
def test_unaligned_slot_arrays_give_the_same_bits(nnz, index_dtype):
    # Slot arrays that do not start on a vector boundary (contiguous views with an odd offset) give
    # bitwise the results of aligned ones: the rows SDDMM, which reads column indices 4 at a time,
    # falls back to one at a time; the row kernels of the forward and transposed products read one
    # slot per load anyway.
    p = Weight(120, 333, nnz, device="cuda", index_dtype=index_dtype, empty_rows=3)
    moved = [unaligned(t) if name in ("col_idx", "csc_perm") else t for name, t in zip(snack.PATTERN_FIELDS, p.tensors)]
    values = unaligned(p.values)
    for n in (1, 3, 16):
        x, dy = p.randn(n, 333, seed=n), p.randn(n, 120, seed=n + 1)
        for variant in snack.DETERMINISTIC_VARIANTS:
            if fits(variant, n, 333, torch.float32):
                assert torch.equal(ops.spmm(x, values, moved, None, variant=variant),
                                   ops.spmm(x, p.values, p.tensors, None, variant=variant)), (n, variant)
            if variant in snack.TRANSPOSED_VARIANTS and fits(variant, n, 120, torch.float32):
                assert torch.equal(ops.spmm_t(dy, values, moved, variant),
                                   ops.spmm_t(dy, p.values, p.tensors, variant)), (n, variant)
        assert torch.equal(ops.sddmm(dy, x, moved, variant="rows"), ops.sddmm(dy, x, p.tensors, variant="rows"))


# dense_blocks multiplies the zeros of its expanded blocks like a dense layer: an infinite input
# reaches every output there (0 * inf is NaN), as in nn.Linear.
SPARSE_ONLY_VARIANTS = tuple(v for v in snack.DETERMINISTIC_VARIANTS if v != "dense_blocks")


def test_stored_entries_alone_see_an_infinite_input():
    # An infinite input reaches only the outputs whose rows hold its column: no sparse kernel
    # multiplies a slot outside a row's range by it (0 * inf would be NaN). Forward (column 0 of X
    # infinite) and transposed product (column 0 of dY infinite).
    p = Weight(64, 50, 600, device="cuda")
    dense = p.dense64
    for n in (1, 3, 16, 40):
        x = p.randn(n, 50, seed=n)
        x[:, 0] = float("inf")
        for variant in SPARSE_ONLY_VARIANTS:
            if not fits(variant, n, 50, torch.float32):
                continue
            y = ops.spmm(x, p.values, p.tensors, None, variant=variant).cpu()
            touched = (dense[:, 0] != 0)[None, :].expand_as(y)
            assert torch.isfinite(y[~touched]).all(), variant
            assert not torch.isfinite(y[touched]).any(), variant
        dy = p.randn(n, 64, seed=n + 1)
        dy[:, 0] = float("inf")
        for variant in snack.TRANSPOSED_VARIANTS:  # the transposed product: row 0 of W
            if variant not in SPARSE_ONLY_VARIANTS or not fits(variant, n, 64, torch.float32):
                continue
            dx = ops.spmm_t(dy, p.values, p.tensors, variant).cpu()
            touched = (dense[0, :] != 0)[None, :].expand_as(dx)
            assert torch.isfinite(dx[~touched]).all(), variant
            assert not torch.isfinite(dx[touched]).any(), variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n", [5, 300])
def test_dense_blocks_in_many_blocks(n, dtype):
    # More outputs than one block holds (max(N, 128) of them): the forward over blocks of rows of W,
    # dX over blocks of rows of W^T (columns of W), dW over blocks of rows, each last block partial;
    # K odd (rows not a whole number of 16-byte units), empty rows, a bias and both activations.
    m, k = 1000, 301
    p = Weight(m, k, 30000, device="cuda", dtype=dtype, index_dtype=torch.int32, empty_rows=20)
    x, bias, dy = p.randn(n, k, seed=1), p.randn(m, seed=2), p.randn(n, m, seed=3)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "dense_blocks"))
    assert plan.workspace_bytes == min(m, max(n, 128) // 64 * 64) * k * dtype.itemsize
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant="dense_blocks")
    assert_forward(y, x, p, bias, dtype, "dense_blocks")
    for activation in ("relu", "gelu"):
        y = ops.spmm(x, p.values, p.tensors, bias, activation=activation, variant="dense_blocks")
        z, scale = matmul_ref(x, p.dense64.T)
        z, scale = z + bias.double().cpu(), scale + bias.double().cpu().abs()
        ref = torch.relu(z) if activation == "relu" else torch.nn.functional.gelu(z)
        assert_close(y, ref, 1.2 * scale, dtype, activation)
    dx = ops.spmm_t(dy, p.values, p.tensors, "dense_blocks")
    assert_matmul(dx, dy, p.dense64, dtype, what="dense_blocks dX")
    dv = ops.sddmm(dy, x, p.tensors, variant="dense_blocks")
    assert_close(dv, *p.slot_ref(dy, x), dtype, "dense_blocks dW")
    assert torch.equal(ops.sddmm(dy, x, p.tensors, variant="dense_blocks"), dv)


def check_forward_and_activation(p, x, bias, dtype, variant, activation):
    """The forward with `variant` forced into a poisoned cache against the float64 reference, bitwise
    repeatable, and with `activation` ("relu" or "gelu") fused."""
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, p.values, p.tensors, bias, variant=variant)
    assert_forward(y, x, p, bias, dtype, variant)
    assert torch.equal(ops.spmm(x, p.values, p.tensors, bias, variant=variant), y), "not bitwise reproducible"
    y = ops.spmm(x, p.values, p.tensors, bias, activation=activation, variant=variant)
    z, scale = matmul_ref(x, p.dense64.T)
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    assert_close(y, act(z + bias.double().cpu()), 1.2 * (scale + bias.double().cpu().abs()), dtype,
                 f"{variant} {activation}")


def weight_with_a_full_row(m, k, nnz, gen, dtype, *, empty_rows, extra):
    """About nnz random positions with `empty_rows` rows left empty, row 3 holding every input, and the
    (row, input) positions of `extra` (a row of one slot, say)."""
    rows, cols = random_positions(m, k, nnz, gen, empty_rows=empty_rows)
    keep = rows != 3
    extra_rows, extra_cols = zip(*extra)
    rows = torch.cat([rows[keep], torch.full((k,), 3), torch.tensor(extra_rows)])
    cols = torch.cat([cols[keep], torch.arange(k), torch.tensor(extra_cols)])
    keys = torch.unique(rows * k + cols)
    return Weight(m, k, keys.numel(), device="cuda", dtype=dtype, positions=(keys // k, keys % k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n", [1, 300, 600])
def test_shared_x_bands_tiles_and_chunks(n, dtype):
    # Bands of 128 rows in fp32 and of 64 in 16 bits (the last partial), K = 1001 (sixteen chunks of 64
    # in fp32, the last of 41; eight of 128 in 16 bits, the last of 105), one to three batch tiles of 256
    # rows (two 16-byte vectors a lane in fp32, one in 16 bits), empty rows, a row full across several
    # chunks (windows of 32 slots used up inside one chunk), rows whose windows span chunks and rows of a
    # single slot; the transposed product over the CSC view, K = 130 outputs. Bitwise-equal repeats.
    m, k = 130, 1001
    p = weight_with_a_full_row(m, k, 9000, torch.Generator().manual_seed(n), dtype, empty_rows=7,
                               extra=((5, k - 1), (6, 0)))
    x, bias, dy = p.randn(n, k, seed=1), p.randn(m, seed=2), p.randn(n, m, seed=3)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "shared_x"))
    assert plan.batch_tile == 256
    assert f"chunks of {64 if dtype == torch.float32 else 128} columns" in plan.describe
    assert plan.workspace_bytes == (k + 1) * -(-n // plan.batch_tile) * plan.batch_tile * dtype.itemsize
    check_forward_and_activation(p, x, bias, dtype, "shared_x", "gelu")
    poison_cache(torch.device("cuda"))
    dx = ops.spmm_t(dy, p.values, p.tensors, "shared_x")
    assert_matmul(dx, dy, p.dense64, dtype, what="shared_x dX")
    assert torch.equal(ops.spmm_t(dy, p.values, p.tensors, "shared_x"), dx)


def test_shared_x_one_vector_a_lane_in_fp32():
    # fp32 takes batch tiles of 128 rows (one 16-byte vector a lane, chunks of 128 columns) where only
    # that grid fills the SMs: a band count that fills them with four tiles of 128 rows and not with
    # two of 256 (N = 512), K = 257 (the last chunk of one column), an empty row, a full row; then dX.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bands = -(-3 * sms // 16)  # 4 x bands ~ 0.75 of the SMs, 2 x bands ~ 0.375
    m, k, n = 128 * bands, 257, 512
    p = weight_with_a_full_row(m, k, m * k // 10, torch.Generator().manual_seed(5), torch.float32, empty_rows=3,
                               extra=((5, k - 1),))
    x, bias = p.randn(n, k, seed=1), p.randn(m, seed=2)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "shared_x"))
    assert plan.batch_tile == 128 and "chunks of 128 columns" in plan.describe
    check_forward_and_activation(p, x, bias, torch.float32, "shared_x", "relu")
    # The transposed product over the CSC view: K = 257 outputs of ~m / 10 entries each (a window of
    # 32 slots reloaded many times per output), 500 batch rows (the last batch tile partial).
    dy = p.randn(500, m, seed=3)
    poison_cache(torch.device("cuda"))
    dx = ops.spmm_t(dy, p.values, p.tensors, "shared_x")
    assert_matmul(dx, dy, p.dense64, torch.float32, what="shared_x dX")


@pytest.mark.skipif(not HOPPER, reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("m,k,n,density", [(300, 1000, 130, 0.1), (130, 2048, 257, 0.1), (640, 88, 1, 0.1),
                                           (128, 200, 128, 0.7)])
def test_wgmma_bands_lists_and_splits(m, k, n, density, dtype):
    # Bands of 128 rows (the last partial), chunks of 64 inputs (the last partial where k % 64 != 0),
    # batch tiles of 256 (partial), clusters that split the chunks (2048 inputs: 4 blocks per band), empty rows, a row full across every chunk, rows of one slot, lists longer than the
    # producer's words in flight (1024 a chunk: 70% of 128 x 64); the transposed product over the CSC
    # view.
    # Bitwise-equal repeats; the workspace is the tile lists.
    p = weight_with_a_full_row(m, k, int(m * k * density), torch.Generator().manual_seed(m + k + n), dtype,
                               empty_rows=5, extra=((m - 1, 0),))
    x, bias, dy = p.randn(n, k, seed=1), p.randn(m, seed=2), p.randn(n, m, seed=3)
    plan = snack.Plan(*ops.explain(p.values, p.tensors, n, "forward", "wgmma"))
    assert (plan.variant, plan.batch_tile, plan.threads) == ("wgmma", 256, 384)
    assert plan.workspace_bytes >= 4 * p.nnz
    check_forward_and_activation(p, x, bias, dtype, "wgmma", "relu")
    if m % 8 == 0:
        poison_cache(torch.device("cuda"))
        dx = ops.spmm_t(dy, p.values, p.tensors, "wgmma")
        assert_matmul(dx, dy, p.dense64, dtype, what="wgmma dX")
        assert torch.equal(ops.spmm_t(dy, p.values, p.tensors, "wgmma"), dx)
    else:
        with pytest.raises(ValueError, match="multiple of 8"):
            ops.spmm_t(dy, p.values, p.tensors, "wgmma")


@pytest.mark.skipif(not HOPPER, reason="wgmma needs compute capability 9.0")
def test_wgmma_without_slots():
    p = Weight(256, 128, 0, device="cuda", dtype=torch.bfloat16)
    x = p.randn(200, 128, seed=1)
    y = ops.spmm(x, p.values, p.tensors, None, variant="wgmma")
    assert torch.equal(y, torch.zeros_like(y))


def test_the_planner_takes_dense_blocks_at_large_batches():
    # At a large batch and a moderate density a dense GEMM over expanded blocks of W beats the sparse
    # kernels; its workspace is never larger than the op's activation operand. The rule itself is
    # tested on the CPU (tests/cpp/test_planner.cpp).
    layer = snack.SparseLinear(2048, 2048, density=0.3, device="cuda")
    for op in ("forward", "input_grad", "weight_grad"):
        plan = snack.explain(layer, 4096, op=op)
        assert (plan.variant, plan.reason) == ("dense_blocks", "dense_blocks"), (op, plan)
        assert plan.workspace_bytes <= 4096 * 2048 * 4
    assert snack.explain(layer, 16).variant != "dense_blocks"
    x = torch.randn(4096, 2048, device="cuda")
    assert_matmul(layer(x), x, layer.to_dense().detach().T, torch.float32, bias=layer.bias.detach())


# (M, K, nnz): two shapes; both SDDMM kernels that follow the transposes run in the graph (the
# automatic choice, the rows kernel, and the vector kernel forced).
GRAPH_SHAPES = [(700, 900, 40000), (1000, 64, 45000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GRAPH_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("n", [16, 40])
def test_programmatic_launches_replay_in_a_cuda_graph(n, shape, dtype):
    # The row kernel after the transpose of X (global_xt) and the SDDMM after the transposes of dY
    # and X start before those finish (programmatic dependent launch) and wait for them on the
    # device; captured in a graph they must give the eager results, bitwise, on fresh inputs, and
    # both must match float64.
    m, k, nnz = shape
    p = Weight(m, k, nnz, device="cuda", dtype=dtype)
    x, dy = p.randn(n, k), p.randn(n, m, seed=2)
    outputs = {}
    sddmm_variants = ["auto", "vector"]

    def products():
        outputs["y"] = ops.spmm(x, p.values, p.tensors, None, "none", "global_xt")
        outputs["dx"] = ops.spmm_t(dy, p.values, p.tensors, "global_xt")
        for variant in sddmm_variants:
            outputs[f"dw_{variant}"] = ops.sddmm(dy, x, p.tensors, variant=variant)

    graph = capture_graph(products, warmup=1)
    x.copy_(p.randn(n, k, seed=3))
    dy.copy_(p.randn(n, m, seed=4))
    graph.replay()
    torch.cuda.synchronize()
    eager = {"y": ops.spmm(x, p.values, p.tensors, None, "none", "global_xt"),
             "dx": ops.spmm_t(dy, p.values, p.tensors, "global_xt")}
    for variant in sddmm_variants:
        eager[f"dw_{variant}"] = ops.sddmm(dy, x, p.tensors, variant=variant)
    for name, value in eager.items():
        assert torch.equal(outputs[name], value), name
    assert_matmul(outputs["y"], x, p.dense64.t(), dtype, what="y")
    assert_matmul(outputs["dx"], dy, p.dense64, dtype, what="dx")
    for variant in sddmm_variants:
        assert_close(outputs[f"dw_{variant}"], *p.slot_ref(dy, x), dtype, variant)
