"""Packed tile values (snack.ops.pack_tile_values): each entry of the tile view with its slot's 16-bit
value; the format decoded here against the slots, the checks spmm makes of them, and the layer that
holds them for inference (snack.for_inference(pack_tiles="entries")), packed again whenever its values or
pattern change. The CUDA kernel that reads them: test_kernels_cuda.py."""

import copy
import pickle

import pytest
import torch

import snack
from helpers import ODD_SHAPES, Weight, assert_matmul

ops = snack.ops
SIXTEEN_BITS = [torch.bfloat16, torch.float16]
TILE_ROWS, TILE_COLS, _ = ops.tile_view_geometry()
FIELD = {name: i for i, name in enumerate(snack.PATTERN_FIELDS)}


def decode(tiles: torch.Tensor, tensors, m: int, k: int) -> dict:
    """{(row, col): value bits} of packed tiles, read through the view's tile_ptr as the kernels do."""
    words = tiles.cpu().view(torch.int32).flatten().long() & 0xFFFFFFFF
    tile_ptr = tensors[FIELD["tile_ptr"]].cpu().long()
    chunks = (k + TILE_COLS - 1) // TILE_COLS
    found = {}
    for tile in range(tile_ptr.numel() - 1):
        band, chunk = divmod(tile, chunks)
        for e in range(int(tile_ptr[tile]), int(tile_ptr[tile + 1])):
            word = int(words[e])
            assert (word >> 12) & 0xF == 0, f"entry {e}: bits between the position and the value"
            pos = word & 0xFFF
            key = (band * TILE_ROWS + pos // TILE_COLS, chunk * TILE_COLS + pos % TILE_COLS)
            assert key not in found, f"position {key} packed twice"
            found[key] = word >> 16
    return found


def slot_bits(w: Weight) -> dict:
    bits = w.values.cpu().view(torch.int16).long() & 0xFFFF
    rows, cols = w.row_idx.long().cpu(), w.col_idx.long().cpu()
    return {(int(r), int(c)): int(b) for r, c, b in zip(rows, cols, bits, strict=True)}


@pytest.mark.parametrize("m,k,n,nnz,empty_rows", ODD_SHAPES + [(64, 64, 1, 4096, 0), (130, 200, 1, 0, 0)])
@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_every_slot_packed_at_its_position_with_its_value(device, m, k, n, nnz, empty_rows, dtype):
    w = Weight(m, k, nnz, device=device, dtype=dtype, empty_rows=empty_rows, seed=m + k)
    tiles = ops.pack_tile_values(w.values, w.tensors)
    padded = w.tensors[FIELD["tile_entries"]].numel()
    assert tiles.shape == (padded, 2) and tiles.dtype == dtype and tiles.device == w.values.device
    assert decode(tiles, w.tensors, m, k) == slot_bits(w)
    words = tiles.cpu().view(torch.int32).flatten()
    assert not bool(words[nnz:].any()), "the padding after the last entry is zeros"
    if device.type == "cuda":  # both backends pack the same words
        cpu = copy.deepcopy(w.pattern).to("cpu")
        assert torch.equal(ops.pack_tile_values(w.values.cpu(), cpu.tensors), tiles.cpu())


@pytest.mark.parametrize("index_dtype", [torch.uint16, torch.int32])
def test_packing_follows_the_index_type_and_a_pattern_kept_for_inference(device, index_dtype):
    w = Weight(150, 300, 4000, device=device, dtype=torch.bfloat16, index_dtype=index_dtype, empty_rows=5)
    whole = ops.pack_tile_values(w.values, w.tensors)
    kept = copy.deepcopy(w.pattern).for_inference(tile_view=True)
    assert torch.equal(ops.pack_tile_values(w.values, kept.tensors), whole)


@pytest.mark.parametrize("pack", [ops.pack_tile_values, ops.pack_tile_fragments], ids=["values", "fragments"])
def test_packing_refuses_what_it_cannot_pack(device, pack):
    # Both layouts of the values in tile order (the fragments: test_tile_fragments.py).
    w = Weight(70, 130, 900, device=device, dtype=torch.float32)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        pack(w.values, w.tensors)
    half = w.values.to(torch.bfloat16)
    without = copy.deepcopy(w.pattern).for_inference(tile_view=False)
    with pytest.raises(ValueError, match="no tile view"):
        pack(half, without.tensors)
    wide = Weight(3, 16385, 40, device=device, dtype=torch.bfloat16)  # wider than the view
    with pytest.raises(ValueError, match="no tile view"):
        pack(wide.values, wide.tensors)
    with pytest.raises(ValueError, match="nnz"):
        pack(half[:-1], w.tensors)


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_spmm_reads_tiles_that_are_the_values_packing(device, dtype):
    w = Weight(130, 200, 3000, device=device, dtype=dtype, empty_rows=6, seed=4)
    x, bias = w.randn(40, 200, seed=1), w.randn(130, seed=2)
    tiles = ops.pack_tile_values(w.values, w.tensors)
    y = ops.spmm(x, w.values, w.tensors, bias, tiles=tiles)
    assert_matmul(y, x, w.dense64.T, dtype, bias=bias)
    assert torch.equal(y, ops.spmm(x, w.values, w.tensors, bias))
    assert torch.equal(ops.spmm(x, w.values, w.tensors, bias, "relu", tiles=tiles), torch.relu(y))


def test_spmm_checks_the_tiles_it_is_given(device):
    w = Weight(130, 200, 3000, device=device, dtype=torch.bfloat16, seed=5)
    x = w.randn(20, 200)
    tiles = ops.pack_tile_values(w.values, w.tensors)
    with pytest.raises(TypeError, match="tiles dtype"):
        ops.spmm(x, w.values, w.tensors, tiles=tiles.view(torch.float16))
    with pytest.raises(ValueError, match=r"shape \["):
        ops.spmm(x, w.values, w.tensors, tiles=tiles[:-4])
    with pytest.raises(ValueError, match="contiguous"):
        ops.spmm(x, w.values, w.tensors, tiles=torch.stack([tiles[:, 0], tiles[:, 1]], dim=1).t().contiguous().t())
    f32 = Weight(130, 200, 3000, device=device, dtype=torch.float32, seed=5)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ops.spmm(x.float(), f32.values, f32.tensors, tiles=tiles)
    if device.type == "cpu":
        # The CPU reads the values but checks the packing it is given, as the GPU would read it.
        with pytest.raises(ValueError, match="not the packing of these values"):
            ops.spmm(x, w.values * 2, w.tensors, tiles=tiles)


@pytest.mark.parametrize("dtype", SIXTEEN_BITS, ids=["bfloat16", "float16"])
def test_layer_packs_for_inference_and_again_after_changes(device, dtype):
    torch.manual_seed(0)
    layer = snack.SparseLinear(200, 130, density=0.2, device=device, dtype=dtype, activation="gelu")
    reference = copy.deepcopy(layer)
    snack.for_inference(layer, pack_tiles="entries")
    assert layer.pack_tiles == (device.type == "cuda"), "packed where the tile view's kernel reads them"
    layer.pack_tiles, layer.tile_format = True, "entries"  # on the CPU too: its product checks the copy it
    # is given, so a stale one fails
    assert layer.nbytes()["tiles"] == 0, "packed by the first forward, not before"
    x = torch.randn(3, 33, 200, device=device, dtype=dtype)
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (3, 33, 130)
        assert torch.equal(y, reference(x))
        entries = layer.pattern.tile_entries.numel()
        assert layer.nbytes()["tiles"] == 4 * entries
        first = layer._packed[1]
        assert torch.equal(layer(x), y) and layer._packed[1] is first, "unchanged values: packed once"
        layer.values.mul_(-0.5)  # in place: the packed copy is stale
        reference.values.mul_(-0.5)
        assert torch.equal(layer(x), reference(x))
        assert layer._packed[1] is not first
        layer.values = torch.nn.Parameter(reference.values.detach().clone() + 1)  # a new tensor
        reference.values = torch.nn.Parameter(reference.values.detach() + 1)
        assert torch.equal(layer(x), reference(x))
    snack.for_training(layer)
    assert not layer.pack_tiles and layer.nbytes()["tiles"] == 0


def test_layer_packs_only_where_the_forward_reads_the_tiles(device):
    layer = snack.SparseLinear(200, 130, density=0.2, device=device, dtype=torch.bfloat16)
    f32 = snack.SparseLinear(200, 130, density=0.2, device=device)
    model = torch.nn.Sequential(layer, torch.nn.ReLU(), torch.nn.Linear(130, 200, device=device), f32)
    snack.for_inference(model, pack_tiles=True)
    assert layer.pack_tiles == (device.type == "cuda") and not f32.pack_tiles, "float32 values are not packed"
    layer.pack_tiles = True
    x = torch.randn(17, 200, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="forward's arrays"):
        layer(x)  # values that need gradients: the layer's autograd path, refused as without the tiles
    assert layer._packed is None
    with torch.no_grad():
        layer(x[:0])
        layer(x[0])  # a 1-D input
        assert layer._packed is not None
        with pytest.raises(ValueError, match="in_features=200"):
            layer(torch.randn(4, 199, device=device, dtype=torch.bfloat16))  # refused as without the tiles
    kept = snack.SparseLinear(200, 130, density=0.2, device=device, dtype=torch.bfloat16)
    snack.for_inference(kept, tile_view=False, pack_tiles=True)
    assert not kept.pack_tiles, "no tile view, nothing to pack into"


def test_packed_layer_copies_and_pickles_without_its_tiles(device):
    layer = snack.SparseLinear(100, 70, density=0.3, device=device, dtype=torch.bfloat16)
    snack.for_inference(layer)
    layer.pack_tiles, layer.tile_format = True, "entries"
    x = torch.randn(20, 100, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        clone = copy.deepcopy(layer)
        assert torch.equal(clone(x), y) and clone._packed[1].data_ptr() != layer._packed[1].data_ptr()
        restored = pickle.loads(pickle.dumps(layer))
        assert restored.pack_tiles and restored._packed is None
        assert torch.equal(restored(x), y)
    assert not any("packed" in name for name in layer.state_dict()), "a cache, not a part of the checkpoint"
