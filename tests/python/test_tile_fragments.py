"""Tile fragments (snack.ops.pack_tile_fragments): the 16-bit values of the tile view's tiles laid out
as the A operands of mma.sync, only the registers that hold a slot, and bitmap fragments
(snack.ops.pack_tile_bitmaps): the same places, a mask per lane and the values one by one
(snack/pattern.h). Both formats decoded here against the slots, both backends' packing, the forward
that reads them (the CUDA fragment kernels, mma.sync's under tile_view and, on Hopper, wgmma's,
against float64 on odd shapes, empty tiles, dense tiles read in place) and the checks spmm makes of
them."""

import copy

import pytest
import torch

import snack
from helpers import ODD_SHAPES, Weight, assert_matmul, poison_cache, skewed_positions

ops = snack.ops
SIXTEEN_BITS = [torch.bfloat16, torch.float16]
TILE_ROWS, TILE_COLS, _ = ops.tile_view_geometry()
HEADER_WORDS, REGISTERS = 128, 16
GROUPS = 4
# The two layouts of the values as the tensor cores' operands, by SparseLinear.tile_format.
PACKERS = {"fragments": ops.pack_tile_fragments, "bitmaps": ops.pack_tile_bitmaps}
LAYOUTS = list(PACKERS)
CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability() == (9, 0)
# The kernels that read the fragments: mma.sync's (tile_view) everywhere, wgmma's on Hopper only, with
# one consumer warpgroup a block or two on alternate tiles. (variant, warpgroups; 0: the planner's.)
_ON_HOPPER = pytest.mark.skipif(not HOPPER, reason="wgmma: Hopper")
FRAGMENT_KERNELS = [pytest.param(("tile_view", 0), id="tile_view"),
                    pytest.param(("wgmma", 1), id="wgmma-1group", marks=_ON_HOPPER),
                    pytest.param(("wgmma", 2), id="wgmma-2groups", marks=_ON_HOPPER)]


def pack(layout: str, w, **kwargs) -> torch.Tensor:
    return PACKERS[layout](w.values, w.tensors, **kwargs)


def fragment_spmm(kernel, x, w, fragments, *args):
    """ops.spmm over the fragments with `kernel` (a FRAGMENT_KERNELS pair) forced."""
    variant, groups = kernel
    with snack.fragment_warpgroups(groups):
        return ops.spmm(x, w.values, w.tensors, *args, variant=variant, tiles=fragments)


def slot_bits(w: Weight) -> dict:
    bits = w.values.cpu().view(torch.int16).long() & 0xFFFF
    rows, cols = w.row_idx.long().cpu(), w.col_idx.long().cpu()
    return {(int(r), int(c)): int(b) for r, c, b in zip(rows, cols, bits, strict=True)}


def register_positions(group: int, lane: int, reg: int) -> tuple[int, int]:
    """(row, col) in the tile of the register's low half (its high half is col + 1): the m16n8k16
    A fragment's layout, written out independently of the library."""
    block, which = divmod(reg, 4)
    row = block * 16 + (which % 2) * 8 + lane // 4
    col = group * 16 + (which // 2) * 8 + (lane % 4) * 2
    return row, col


def decode(fragments: torch.Tensor, m: int, k: int, slots: dict, length: int | None = None) -> dict:
    """{(row, col): value bits} of the tile fragments of an m x k matrix; checks the layout's
    invariants on the way. length: the words, where not the m x k layout's (W^T's fragments have W's)."""
    words = fragments.cpu().long() & 0xFFFFFFFF
    bands, chunks = -(-m // TILE_ROWS), -(-k // TILE_COLS)
    tiles = bands * chunks
    headers = (2 * tiles + 3) // 4 * 4
    values = headers + HEADER_WORDS * tiles
    assert words.numel() == (ops.tile_fragment_words(m, k, len(slots)) if length is None else length)
    found = {}
    for tile in range(tiles):
        band, chunk = divmod(tile, chunks)
        start, count = int(words[2 * tile]), int(words[2 * tile + 1])
        assert start % 4 == 0 and count % 4 == 0, "16-byte aligned tiles"
        stored = 0
        for owner in range(HEADER_WORDS):
            head = int(words[headers + HEADER_WORDS * tile + owner])
            mask, offset = head & 0xFFFF, head >> 16
            assert offset == stored, f"tile {tile}, owner {owner}: registers not in (group, lane) order"
            group, lane = divmod(owner, 32)
            for reg in range(REGISTERS):
                if not mask >> reg & 1:
                    continue
                word = int(words[values + start + stored])
                stored += 1
                row, col = register_positions(group, lane, reg)
                held = 0
                for half in range(2):
                    key = (band * TILE_ROWS + row, chunk * TILE_COLS + col + half)
                    bits = word >> (16 * half) & 0xFFFF
                    if key in slots:
                        assert key not in found, f"{key} stored twice"
                        found[key] = bits
                        held += 1
                    else:
                        assert bits == 0, f"{key}: a value where no slot is"
                assert held, f"tile {tile}: a register stored without a slot"
        assert count == (stored + 3) // 4 * 4, f"tile {tile}: {count} words for {stored} registers"
        if count:
            assert not bool(words[values + start + stored:values + start + count].any()), "zero padding"
    return found


def decode_bitmaps(bitmaps: torch.Tensor, m: int, k: int, slots: dict, length: int | None = None) -> dict:
    """{(row, col): value bits} of the bitmap fragments of an m x k matrix, the layout written out
    independently of the library: per tile its pair, the 64-bit masks of its 64 blocks (block
    16 group + register, bit 2 lane + half), the first value of each four blocks, then its values as
    16-bit halves, blocks ascending, each in bit order."""
    assert bitmaps.dtype == torch.int16
    halves = bitmaps.cpu().long() & 0xFFFF
    words = halves[0::2] | halves[1::2] << 16
    bands, chunks = -(-m // TILE_ROWS), -(-k // TILE_COLS)
    tiles = bands * chunks
    blocks = GROUPS * REGISTERS
    header_words = 2 * blocks + blocks // 4
    headers = (2 * tiles + 3) // 4 * 4
    values = headers + header_words * tiles
    assert words.numel() == (ops.tile_bitmap_words(m, k, len(slots)) if length is None else length)
    found = {}
    for tile in range(tiles):
        band, chunk = divmod(tile, chunks)
        start, count = int(words[2 * tile]), int(words[2 * tile + 1])
        assert start % 4 == 0 and count % 4 == 0, "16-byte aligned tiles"
        header = words[headers + header_words * tile:][:header_words]
        stored = 0
        for block in range(blocks):
            group, reg = divmod(block, REGISTERS)
            if block % 4 == 0:
                assert int(header[2 * blocks + block // 4]) == stored, f"tile {tile}: operand {block // 4}'s first"
            mask = int(header[2 * block]) | int(header[2 * block + 1]) << 32
            for bit in range(64):
                lane, half = divmod(bit, 2)
                row, col = register_positions(group, lane, reg)
                key = (band * TILE_ROWS + row, chunk * TILE_COLS + col + half)
                if not mask >> bit & 1:
                    assert key not in slots, f"{key}: a slot left out of its mask"
                    continue
                assert key in slots and key not in found, f"tile {tile}: {key} stored without a slot or twice"
                found[key] = int(halves[2 * (values + start) + stored])
                stored += 1
        assert count == (stored + 7) // 8 * 4, f"tile {tile}: {count} words for {stored} values"
        if count:
            assert not bool(halves[2 * (values + start) + stored:2 * (values + start + count)].any()), "zero padding"
    return found


WORDS = {"fragments": ops.tile_fragment_words, "bitmaps": ops.tile_bitmap_words}


@pytest.mark.parametrize("m,k,n,nnz,empty_rows", ODD_SHAPES + [(64, 64, 1, 4096, 0), (130, 200, 1, 0, 0),
                                                 (300, 520, 1, 78000, 10)])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_every_slot_in_its_bitmap_place(device, m, k, n, nnz, empty_rows, dtype):
    # (300 x 520 at 50% density: every tile near half full, the layout's tightest spacing.)
    w = Weight(m, k, nnz, device=device, dtype=dtype, empty_rows=empty_rows, seed=m + k)
    poison_cache(device)  # every word is written: the padding, the gaps between bands
    bitmaps = ops.pack_tile_bitmaps(w.values, w.tensors)
    assert bitmaps.dtype == torch.int16 and bitmaps.device == w.values.device
    slots = slot_bits(w)
    assert decode_bitmaps(bitmaps, m, k, slots) == slots
    if device.type == "cuda":  # both backends pack the same words
        cpu = copy.deepcopy(w.pattern).to("cpu")
        assert torch.equal(ops.pack_tile_bitmaps(w.values.cpu(), cpu.tensors), bitmaps.cpu())
    slots_t = {(c, r): bits for (r, c), bits in slots.items()}
    transposed = ops.pack_tile_bitmaps(w.values, w.tensors, transposed=True)
    assert decode_bitmaps(transposed, k, m, slots_t, length=ops.tile_bitmap_words(m, k, nnz)) == slots_t


@pytest.mark.parametrize("m,k,n,nnz,empty_rows", ODD_SHAPES + [(64, 64, 1, 4096, 0), (130, 200, 1, 0, 0)])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_every_slot_in_its_register(device, m, k, n, nnz, empty_rows, dtype):
    w = Weight(m, k, nnz, device=device, dtype=dtype, empty_rows=empty_rows, seed=m + k)
    poison_cache(device)  # every word is written: the padding, the gaps between bands
    fragments = ops.pack_tile_fragments(w.values, w.tensors)
    assert fragments.dtype == torch.int32 and fragments.device == w.values.device
    slots = slot_bits(w)
    assert decode(fragments, m, k, slots) == slots
    if device.type == "cuda":  # both backends pack the same words
        cpu = copy.deepcopy(w.pattern).to("cpu")
        assert torch.equal(ops.pack_tile_fragments(w.values.cpu(), cpu.tensors), fragments.cpu())


@pytest.mark.parametrize("m,k,n,nnz,empty_rows", ODD_SHAPES + [(64, 64, 1, 4096, 0), (130, 200, 1, 0, 0),
                                                 (200, 70, 1, 3000, 20)])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_transposed_fragments_are_w_t_fragments(device, m, k, n, nnz, empty_rows, dtype):
    # W^T's tile fragments (dX = dY W as the forward of W^T): tile (c, b) of W^T holds W's tile (b, c)
    # transposed, in W's length.
    w = Weight(m, k, nnz, device=device, dtype=dtype, empty_rows=empty_rows, seed=m + 2 * k)
    poison_cache(device)
    fragments = ops.pack_tile_fragments(w.values, w.tensors, transposed=True)
    assert fragments.shape == (ops.tile_fragment_words(m, k, nnz),) and fragments.dtype == torch.int32
    slots_t = {(c, r): bits for (r, c), bits in slot_bits(w).items()}
    assert decode(fragments, k, m, slots_t, length=ops.tile_fragment_words(m, k, nnz)) == slots_t
    if device.type == "cuda":  # both backends pack the same words
        cpu = copy.deepcopy(w.pattern).to("cpu")
        assert torch.equal(ops.pack_tile_fragments(w.values.cpu(), cpu.tensors, transposed=True), fragments.cpu())


@pytest.mark.skipif(not HOPPER, reason="wgmma runs on Hopper")
@pytest.mark.parametrize("m,k,empty_rows", [(1030, 2053, 40), (2048, 1024, 0)])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_input_grad_packs_w_t_fragments_past_128_rows(m, k, empty_rows, dtype):
    # dX of a 16-bit layer of 2^21 weights and more at 129-512 rows: W^T's fragments packed for the
    # product, wgmma's forward kernel over them (dY rows not 16-byte aligned where W has 1030 rows),
    # against float64; elsewhere the plan is the one without them.
    w = Weight(m, k, m * k // 10, device="cuda", dtype=dtype, empty_rows=empty_rows, seed=m)
    for n in (128, 129, 300, 512, 513):
        plan = snack.Plan(*ops.explain(w.values, w.tensors, n, "input_grad", "auto", "none", 1, False, False))
        assert ("tile fragments of W^T (packed for this product" in plan.describe) == (128 < n <= 512), plan
    for n in (129, 300, 512):
        dy = w.randn(n, m, seed=n)
        poison_cache(torch.device("cuda"))
        dx = ops.spmm_t(dy, w.values, w.tensors)
        assert_matmul(dx, dy, w.dense64, dtype, what=f"dX over W^T's fragments, N = {n}")
        assert torch.equal(ops.spmm_t(dy, w.values, w.tensors), dx), "deterministic"


def test_packing_follows_a_pattern_kept_for_inference(device):
    # (What neither layout packs: test_packed_tiles.py, test_packing_refuses_what_it_cannot_pack.)
    w = Weight(70, 130, 900, device=device, dtype=torch.bfloat16, index_dtype=torch.int32)
    kept = copy.deepcopy(w.pattern).for_inference(tile_view=True)
    assert torch.equal(ops.pack_tile_fragments(w.values, kept.tensors), ops.pack_tile_fragments(w.values, w.tensors))


def test_spmm_checks_the_fragments_it_is_given(device):
    w = Weight(130, 200, 3000, device=device, dtype=torch.bfloat16, seed=5)
    x = w.randn(20, 200)
    fragments = ops.pack_tile_fragments(w.values, w.tensors)
    with pytest.raises(ValueError, match="tile fragments must have shape"):
        ops.spmm(x, w.values, w.tensors, tiles=fragments[:-4])
    with pytest.raises(TypeError, match="int32"):
        ops.spmm(x, w.values, w.tensors, tiles=fragments.float())
    bitmaps = ops.pack_tile_bitmaps(w.values, w.tensors)
    with pytest.raises(ValueError, match="bitmap fragments must have shape"):
        ops.spmm(x, w.values, w.tensors, tiles=bitmaps[:-8])
    if device.type == "cpu":
        # The CPU reads the values but checks the fragments it is given, as the GPU would read them.
        with pytest.raises(ValueError, match="pack_tile_fragments"):
            ops.spmm(x, w.values * 2, w.tensors, tiles=fragments)
        with pytest.raises(ValueError, match="pack_tile_bitmaps"):
            ops.spmm(x, w.values * 2, w.tensors, tiles=bitmaps)
        assert torch.equal(ops.spmm(x, w.values, w.tensors, tiles=bitmaps), ops.spmm(x, w.values, w.tensors))


# The forward over the fragments: batch tiles of 16 and 32 (N = 1 to 100, partial tiles), inputs that
# are not a multiple of 8 (X staged by the threads, not through a tensor map) and that are (a last
# chunk the copy engine fills with zeros past the inputs), empty rows and tiles, tiles with more
# registers than a stage holds (read in place).
FORWARD_CASES = {
    "partial_band_and_chunk": dict(m=70, k=90, nnz=3000, empty_rows=6),
    "partial_chunk_through_the_tensor_map": dict(m=70, k=200, nnz=2500, empty_rows=4),
    "empty_rows": dict(m=130, k=257, nnz=1700, empty_rows=30),
    "one_full_tile": dict(m=64, k=64, nnz=4096),
    "dense_band_read_in_place": dict(m=640, k=300, positions=skewed_positions(640, 300, 64, 3000)),
    "dense_band_in_place_through_the_tensor_map": dict(m=640, k=328, positions=skewed_positions(640, 328, 64, 3000)),
    "no_slots": dict(m=128, k=192, nnz=0),
    "several_blocks_per_band": dict(m=300, k=1024, nnz=12000),
}


def forward_weight(case: str, dtype, seed: int) -> Weight:
    args = dict(FORWARD_CASES[case])
    m, k, nnz = args.pop("m"), args.pop("k"), args.pop("nnz", 0)
    return Weight(m, k, nnz, device="cuda", dtype=dtype, seed=seed, **args)


@pytest.mark.skipif(not CUDA, reason="the fragment kernels run on CUDA")
@pytest.mark.parametrize("kernel", FRAGMENT_KERNELS)
@pytest.mark.parametrize("case", list(FORWARD_CASES))
@pytest.mark.parametrize("n", [1, 5, 16, 17, 32, 33, 100, 129])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_reads_fragments(case, n, dtype, kernel, layout):
    w = forward_weight(case, dtype, seed=n)
    fragments = pack(layout, w)
    x, bias = w.randn(n, w.k, seed=n), w.randn(w.m, seed=3)
    poison_cache(torch.device("cuda"))  # an output left unwritten shows as NaN
    y = fragment_spmm(kernel, x, w, fragments, bias)
    assert_matmul(y, x, w.dense64.T, dtype, bias=bias, what=f"{layout}, {kernel}, {case}")
    assert torch.equal(fragment_spmm(kernel, x, w, fragments, bias), y), "deterministic"
    relu = fragment_spmm(kernel, x, w, fragments, bias, "relu")
    assert torch.equal(relu, torch.relu(y))


@pytest.mark.skipif(not CUDA, reason="the fragment kernels run on CUDA")
@pytest.mark.parametrize("kernel", FRAGMENT_KERNELS)
@pytest.mark.parametrize("n", [21, 100])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_reads_fragments_with_unaligned_input(kernel, n, layout):
    # Rows of X a multiple of 8 values that start off a 16-byte boundary: no tensor map, the threads
    # stage X; the same outputs as from an aligned copy of it.
    w = Weight(130, 456, 7000, device="cuda", dtype=torch.bfloat16, seed=8)
    fragments = pack(layout, w)
    x = w.randn(n, 456, seed=4)
    shifted = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    y = fragment_spmm(kernel, shifted, w, fragments)
    assert_matmul(y, x, w.dense64.T, torch.bfloat16, what=f"unaligned input, {kernel}")
    assert torch.equal(y, fragment_spmm(kernel, x, w, fragments))


@pytest.mark.skipif(not CUDA, reason="the fragment kernels run on CUDA")
@pytest.mark.parametrize("kernel", FRAGMENT_KERNELS)
@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [40, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_reads_fragments_in_clusters(splits, n, kernel, layout):
    # 512 inputs: 8 steps a band, 2-8 a block, so that a second warpgroup may have one step or none.
    w = Weight(192, 512, 9000 if layout == "fragments" else 40000, device="cuda", dtype=torch.bfloat16, seed=splits)
    fragments = pack(layout, w)
    x = w.randn(n, 512, seed=2)
    with snack.tile_view_splits(splits):
        y = fragment_spmm(kernel, x, w, fragments)
    assert_matmul(y, x, w.dense64.T, torch.bfloat16, what=f"{kernel}, {splits} blocks per band")


@pytest.mark.skipif(not CUDA, reason="the fragment kernels run on CUDA")
@pytest.mark.parametrize("kernel", FRAGMENT_KERNELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_reads_fragments_of_a_large_layer(kernel, layout):
    # 64 steps a band and several blocks an SM: every stage used 16 times, the next step's operands
    # loaded while the tensor cores still multiply the step before (a first wgmma form let the loads
    # overwrite the registers being multiplied; the small cases above did not show it). Bitmaps at
    # the density they are for.
    density = 0.1 if layout == "fragments" else 0.5
    w = Weight(4096, 4096, int(4096 * 4096 * density), device="cuda", dtype=torch.bfloat16, seed=11)
    fragments = pack(layout, w)
    for n in (8, 16, 64, 128):
        x = w.randn(n, 4096, seed=n)
        poison_cache(torch.device("cuda"))
        assert_matmul(fragment_spmm(kernel, x, w, fragments), x, w.dense64.T, torch.bfloat16,
                      what=f"{kernel}, 4096x4096, N = {n}")


@pytest.mark.skipif(not HOPPER, reason="wgmma runs on Hopper")
def test_wgmma_reads_fragments_in_batch_tiles_of_up_to_128():
    w = Weight(256, 1024, 26000, device="cuda", dtype=torch.bfloat16, seed=6)
    fragments = ops.pack_tile_fragments(w.values, w.tensors)
    for n, tile in ((8, 16), (20, 32), (64, 64), (65, 128), (300, 128)):
        plan = snack.Plan(*ops.explain(w.values, w.tensors, n, "forward", "wgmma", "none", 1, False, True))
        assert plan.variant == "wgmma" and plan.batch_tile == tile and "A operands in registers" in plan.describe
        assert ("two warpgroups" in plan.describe) == (tile == 128), plan.describe  # 4 bands: fewer than the SMs
        x = w.randn(n, 1024, seed=n)
        assert_matmul(ops.spmm(x, w.values, w.tensors, variant="wgmma", tiles=fragments), x, w.dense64.T,
                      torch.bfloat16, what=f"wgmma, N = {n}")


@pytest.mark.skipif(not CUDA, reason="the planner's CUDA plan")
def test_planner_reads_fragments_where_given():
    # mma.sync's kernel at 16 rows; from 17 rows wgmma's on Hopper, mma.sync's elsewhere.
    w = Weight(4096, 4096, 4096 * 410, device="cuda", dtype=torch.bfloat16, seed=1)
    fragments = ops.pack_tile_fragments(w.values, w.tensors)
    for n, tile in ((16, 16), (32, 32), (128, 128 if HOPPER else 64)):
        plan = snack.Plan(*ops.explain(w.values, w.tensors, n, "forward", "auto", "none", 1, False, True))
        kernel = "wgmma" if HOPPER and n > 16 else "tile_view"
        assert plan.variant == kernel and plan.batch_tile == tile and "tile fragments" in plan.describe, plan
        x = w.randn(n, 4096)
        assert torch.equal(ops.spmm(x, w.values, w.tensors, tiles=fragments),
                           ops.spmm(x, w.values, w.tensors, variant=kernel, tiles=fragments))
    with pytest.raises(ValueError, match="at most one"):
        ops.explain(w.values, w.tensors, 32, "forward", "auto", "none", 1, True, True)


@pytest.mark.skipif(not CUDA, reason="the planner's CUDA plan")
@pytest.mark.parametrize("density", [0.3, 0.5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_planner_reads_fragments_at_denser_weights(density, layout):
    # At 25-50% density the fragments given are read from 8 rows, and from one row at 35% and more;
    # past 128 rows on Hopper too, but never packed for one product there. Outputs against float64.
    k = 1000  # inputs not a multiple of 8: X staged by the threads
    w = Weight(1100, k, int(1100 * k * density), device="cuda", dtype=torch.bfloat16, seed=4)  # >= 2^20 weights
    fragments = pack(layout, w)
    given = (False, layout == "fragments", layout == "bitmaps")
    named = "bitmap fragments" if layout == "bitmaps" else "tile fragments"
    for n in (1, 3, 8, 40, 128) + ((300,) if HOPPER else ()):
        plan = snack.Plan(*ops.explain(w.values, w.tensors, n, "forward", "auto", "none", 1, *given))
        reads = n >= 8 or density >= 0.35
        assert (named in plan.describe) == reads, (n, plan)
        if n > 128:
            packed = snack.Plan(*ops.explain(w.values, w.tensors, n, "forward", "auto", "none", 1, False, False))
            assert "tile fragments" not in packed.describe, packed
        x = w.randn(n, k, seed=n)
        poison_cache(torch.device("cuda"))
        y = ops.spmm(x, w.values, w.tensors, tiles=fragments)
        assert_matmul(y, x, w.dense64.T, torch.bfloat16, what=f"the planner given {layout}, {density}, N = {n}")


@pytest.mark.skipif(not HOPPER, reason="wgmma runs on Hopper")
def test_planner_reads_fragments_past_128_rows_on_hopper():
    # wgmma's fragment kernel in batch tiles of 128 from 129 to 1024 rows on a layer of 2^24 weights
    # at 90% over the fragments given, not past 1024; given none, packed for the product up to 512
    # rows (kFragmentPackMaxRows), past which the plan is the one without them.
    w = Weight(4096, 4096, 4096 * 410, device="cuda", dtype=torch.bfloat16, seed=3)
    fragments = ops.pack_tile_fragments(w.values, w.tensors)
    for n in (129, 300, 512, 513, 1024, 1025):
        for given in (True, False):
            plan = snack.Plan(*ops.explain(w.values, w.tensors, n, "forward", "auto", "none", 1, False, given))
            reads = n <= 1024 if given else n <= 512
            assert (plan.variant == "wgmma" and "tile fragments" in plan.describe) == reads, plan
            assert ("packed for this product" in plan.describe) == (n <= 512 and not given), plan
    x = w.randn(300, 4096, seed=5)
    poison_cache(torch.device("cuda"))
    y = ops.spmm(x, w.values, w.tensors, tiles=fragments)
    assert_matmul(y, x, w.dense64.T, torch.bfloat16, what="the planner's fragment kernel, N = 300")
    assert torch.equal(ops.spmm(x, w.values, w.tensors), y)  # packed for the product: the same kernel


@pytest.mark.skipif(not HOPPER, reason="wgmma runs on Hopper")
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_training_forward_packs_fragments_past_128_rows(dtype):
    # A layer of 2^21 weights and more trained under autocast at 129-512 rows:
    # its forward packs the fragments of the values it multiplies, so an update of the values is
    # seen at the next forward; outputs and gradients against float64.
    torch.manual_seed(2)
    layer = snack.SparseLinear(3072, 768, density=0.1, device="cuda", bias=True)
    assert "packed for this product" in snack.explain(layer, 300, dtype=dtype).describe
    assert "of W^T (packed for this product" in snack.explain(layer, 300, op="input_grad", dtype=dtype).describe
    x = torch.randn(3, 100, 3072, device="cuda")
    for step in range(2):
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype):
            y = layer(xg)
        assert y.dtype == dtype
        w16 = layer.to_dense().detach().to(dtype).double().cpu()
        x16 = x.to(dtype).double().cpu()
        assert_matmul(y.reshape(-1, 768), x16.reshape(-1, 3072), w16.T, dtype, bias=layer.bias.detach().to(dtype),
                      what=f"autocast forward, step {step}")
        dy = torch.randn_like(y)
        y.backward(dy)
        assert_matmul(xg.grad.reshape(-1, 3072), dy.double().cpu().reshape(-1, 768), w16, dtype,
                      what=f"dX, step {step}")
        with torch.no_grad():
            layer.values.mul_(-0.5)  # an update: the next forward must multiply the new values
        layer.zero_grad()


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_holds_fragments_for_inference_and_packs_again_after_changes(device, dtype, layout):
    torch.manual_seed(0)
    layer = snack.SparseLinear(200, 130, density=0.2, device=device, dtype=dtype, activation="gelu")
    reference = copy.deepcopy(layer)
    snack.for_inference(layer, pack_tiles=True if layout == "fragments" else layout)
    assert layer.pack_tiles == (device.type == "cuda")
    assert layer.tile_format == (layout if device.type == "cuda" else "fragments")  # the CPU packs none
    layer.pack_tiles = True  # on the CPU too: its product checks the copy it is given, so a stale one fails
    layer.tile_format = layout
    x = torch.randn(3, 33, 200, device=device, dtype=dtype)  # a 3-D input
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (3, 33, 130)
        assert torch.allclose(y.float(), reference(x).float(), rtol=2e-2, atol=2e-2)
        words = WORDS[layout](130, 200, layer.pattern.nnz)
        assert layer.nbytes()["tiles"] == 4 * words
        first = layer._packed[1]
        assert torch.equal(layer(x), y) and layer._packed[1] is first, "unchanged values: packed once"
        layer.values.mul_(-0.5)  # in place: the copy is stale
        reference.values.mul_(-0.5)
        assert layer._packed[1] is first and not torch.equal(layer(x), y)
        assert layer._packed[1] is not first
        assert torch.allclose(layer(x).float(), reference(x).float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="tile_format"):
        layer.tile_format = "csr"
        with torch.no_grad():
            layer(x)
    layer.tile_format = layout
    with pytest.raises(ValueError, match="pack_tiles"):
        snack.for_inference(layer, pack_tiles="csr")
    snack.for_training(layer)
    assert not layer.pack_tiles and layer.nbytes()["tiles"] == 0
