"""Patterns kept for inference (Pattern.for_inference, snack.for_inference): the forward products on
what remains, against float64 and against the whole pattern; the refusals of everything that needs
what was dropped; bytes, checkpoints, copies, topology updates and for_training."""

import copy
import io
import pickle

import pytest
import torch

import snack
from helpers import ODD_SHAPES, Weight, assert_matmul, poison_cache

ops = snack.ops
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def kept(pattern: snack.Pattern, tile_view: bool = False) -> snack.Pattern:
    return copy.deepcopy(pattern).for_inference(tile_view=tile_view)


@pytest.mark.parametrize("m,k,n,nnz,empty_rows", ODD_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile_view", [False, True])
def test_forward_products_match_float64_and_the_whole_pattern(device, m, k, n, nnz, empty_rows, dtype, tile_view):
    if device.type == "cuda" and dtype == torch.float64:
        pytest.skip("the CUDA products run float32 and 16-bit values")
    w = Weight(m, k, nnz, device=device, dtype=dtype, seed=m + k + nnz, empty_rows=empty_rows)
    x, bias = w.randn(n, k, seed=2), w.randn(m, seed=3)
    pattern = kept(w.pattern, tile_view)
    assert pattern.forward_only
    poison_cache(device)
    y = ops.spmm(x, w.values, pattern.tensors, bias)
    assert_matmul(y, x, w.dense64.T, dtype, bias=bias.double(), what="spmm")
    whole = ops.spmm(x, w.values, w.tensors, bias)
    if device.type == "cpu" or dtype == torch.float32 or tile_view:
        # the same kernel as the whole pattern's (16-bit CUDA products may plan another without the tile view)
        assert torch.equal(y, whole)
    images = w.randn(2, k, 3, seed=4)
    y_cf = ops.spmm_channels_first(images, w.values, pattern.tensors, bias, "relu")
    assert torch.equal(y_cf, ops.spmm_channels_first(images, w.values, w.tensors, bias, "relu"))


@pytest.mark.parametrize("shape", [(13,), (1, 13), (5, 13), (2, 3, 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_layer_forward_without_gradients(device, shape, dtype, activation):
    torch.manual_seed(0)
    layer = snack.SparseLinear(13, 9, density=0.4, device=device, dtype=dtype, activation=activation)
    x = torch.randn(shape, device=device, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
    snack.for_inference(layer)
    assert layer.pattern.forward_only
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    layer.requires_grad_(False)
    assert torch.equal(layer(x), expected)  # grad mode on, but nothing needs a gradient


def test_gradients_are_refused_before_the_forward(device):
    layer = snack.SparseLinear(20, 8, density=0.3, device=device)
    snack.for_inference(layer)
    x = torch.randn(4, 20, device=device)
    with pytest.raises(ValueError, match="for_inference.*torch.no_grad"):
        layer(x)  # values require gradients
    layer.requires_grad_(False)
    with pytest.raises(ValueError, match="for_inference"):
        layer(x.requires_grad_())  # dX
    optimizer = snack.optim.AdamW(layer.parameters())
    layer.requires_grad_(True)
    with pytest.raises(ValueError, match="for_inference"):
        layer(x.detach())  # the fused update's forward
    optimizer.release()


def test_products_that_need_the_dropped_arrays_raise(device):
    w = Weight(12, 10, 40, device=device)
    tensors = kept(w.pattern).tensors
    dy, x = w.randn(3, 12), w.randn(3, 10)
    for call in (lambda: ops.spmm_t(dy, w.values, tensors),
                 lambda: ops.sddmm(dy, x, tensors),
                 lambda: ops.explain(w.values, tensors, 8, "input_grad"),
                 lambda: ops.explain(w.values, tensors, 8, "weight_grad")):
        with pytest.raises(ValueError, match="only the forward's arrays"):
            call()
    assert ops.explain(w.values, tensors, 8, "forward")[0]  # the forward plans as before


def test_a_half_dropped_list_is_refused(device):
    w = Weight(12, 10, 40, device=device)
    tensors = list(w.tensors)
    tensors[snack.PATTERN_FIELDS.index("row_idx")] = tensors[0][:0]
    with pytest.raises(ValueError, match="same length"):
        ops.spmm(w.randn(2, 10), w.values, tensors)


def test_validate_pattern_checks_what_remains():
    w = Weight(30, 17, 120, device="cpu", empty_rows=4)
    tensors = kept(w.pattern, tile_view=True).tensors
    ops.validate_pattern(tensors)
    col_ptr = tensors[snack.PATTERN_FIELDS.index("col_ptr")]
    bad = list(tensors)
    shifted = col_ptr.clone()
    shifted[1:-1] += 1  # column 0 claims one slot more than it has
    bad[snack.PATTERN_FIELDS.index("col_ptr")] = shifted
    with pytest.raises(ValueError, match="col_ptr gives column 0"):
        ops.validate_pattern(bad)
    bad = list(tensors)
    row_ptr = tensors[snack.PATTERN_FIELDS.index("row_ptr")].clone()
    row_ptr[1] = 200
    bad[snack.PATTERN_FIELDS.index("row_ptr")] = row_ptr
    with pytest.raises(ValueError, match="row_ptr"):
        ops.validate_pattern(bad)


@pytest.mark.parametrize("index_dtype,index_bytes", [(torch.uint16, 2), (torch.int32, 4)])
def test_bytes_kept(index_dtype, index_bytes):
    layer = snack.SparseLinear(300, 200, density=0.1, index_dtype=index_dtype)
    nnz, whole = layer.nnz, layer.pattern.nbytes()["total"]
    offsets = 4 * (300 + 1 + 200 + 1)
    tile_ptr = layer.pattern.tile_ptr.numel() * 4
    assert whole == nnz * (2 * index_bytes + 4) + offsets + tile_ptr + layer.pattern.tile_entries.numel() * 4
    layer.pattern.for_inference()
    assert layer.pattern.nbytes()["total"] == nnz * index_bytes + offsets
    layer.pattern.for_inference(tile_view=True)
    assert layer.pattern.nbytes()["total"] == nnz * index_bytes + offsets + tile_ptr + (nnz + 3) // 4 * 16


def test_for_training_rebuilds_every_array(device):
    w = Weight(70, 130, 900, device=device, empty_rows=9)
    pattern = kept(w.pattern)
    assert pattern.row_idx.numel() == 0 and pattern.csc_perm.numel() == 0 and pattern.tile_entries.numel() == 0
    assert torch.equal(pattern.slot_rows(), w.row_idx)
    assert torch.equal(pattern.positions(), w.pattern.positions())
    assert torch.equal(pattern.to_mask(), w.pattern.to_mask())
    pattern.for_training()
    assert not pattern.forward_only
    for a, b in zip(pattern.tensors, w.tensors, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_tile_view_kept_and_dropped_again(device):
    w = Weight(70, 130, 900, device=device)
    pattern = kept(w.pattern, tile_view=False)
    pattern.for_inference(tile_view=True)  # rebuilt from the rows
    field = snack.PATTERN_FIELDS.index("tile_entries")
    assert torch.equal(pattern.tensors[field], w.tensors[field])
    pattern.for_inference(tile_view=False)
    assert pattern.tensors[field].numel() == 0


def test_checkpoints_are_the_same_in_either_form(device):
    torch.manual_seed(1)
    layer = snack.SparseLinear(40, 24, density=0.2, device=device)
    whole = layer.state_dict()
    snack.for_inference(layer)
    state = layer.state_dict()
    assert state.keys() == whole.keys()
    for key in whole:
        assert state[key].dtype == whole[key].dtype and torch.equal(state[key], whole[key]), key
    buffer = io.BytesIO()
    torch.save(state, buffer)
    twin = snack.SparseLinear(40, 24, density=0.2, device=device)
    twin.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    snack.for_inference(twin)
    twin.load_state_dict(whole)  # a kept pattern loads a checkpoint and stays kept
    assert twin.pattern.forward_only
    x = torch.randn(3, 40, device=device)
    with torch.no_grad():
        assert torch.equal(twin(x), layer(x))


def test_copies_keep_the_form(device):
    layer = snack.SparseLinear(40, 24, density=0.2, device=device)
    snack.for_inference(layer)
    x = torch.randn(3, 40, device=device)
    with torch.no_grad():
        expected = layer(x)
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert twin.pattern.forward_only and twin.pattern.row_idx.numel() == 0
            assert torch.equal(twin(x), expected)


def test_topology_updates_keep_the_form(device):
    torch.manual_seed(2)
    layer = snack.SparseLinear(50, 30, density=0.2, device=device)
    twin = copy.deepcopy(layer)
    snack.for_inference(layer)
    gen = torch.Generator(device=device).manual_seed(5)
    drop = snack.dst.prune_magnitude(twin, 20)
    grow = snack.dst.grow_random(twin, 20, generator=gen)
    twin.update_topology(drop, grow)
    layer.update_topology(drop, grow)
    assert layer.pattern.forward_only
    assert torch.equal(layer.row_idx, twin.row_idx) and torch.equal(layer.col_idx, twin.col_idx)
    x = torch.randn(4, 50, device=device)
    with torch.no_grad():
        assert torch.equal(layer(x), twin(x))
    layer.pattern.for_training()
    for a, b in zip(layer.pattern.tensors, twin.pattern.tensors, strict=True):
        assert torch.equal(a, b)


def test_model_wide_choice_of_the_tile_view(device):
    shared = snack.Pattern.random(32, 48, 300, device=device)
    model = torch.nn.Sequential(snack.SparseLinear(48, 32, density=0.2, device=device, dtype=torch.bfloat16),
                                snack.SparseLinear(32, 48, density=0.2, device=device),
                                snack.attention.SparseAttention(shared))
    snack.for_inference(model)
    assert all(p.forward_only for p in model.modules() if isinstance(p, snack.Pattern))
    assert model[0].pattern.tile_entries.numel() > 0  # 16-bit values read it
    assert model[1].pattern.tile_entries.numel() == 0
    assert model[2].pattern.tile_entries.numel() == 0
    snack.for_inference(model, tile_view=True)
    assert model[1].pattern.tile_entries.numel() > 0
    snack.for_training(model)
    assert not any(p.forward_only for p in model.modules() if isinstance(p, snack.Pattern))


def test_conv_inference_on_nchw_images(device):
    torch.manual_seed(3)
    conv = snack.SparseConv2d(24, 40, density=0.25, device=device)
    images = torch.randn(2, 24, 7, 5, device=device)
    with torch.no_grad():
        expected = conv(images)
        snack.for_inference(conv)
        assert torch.equal(conv(images), expected)


def test_sparse_attention_unfused_path_is_refused():
    pattern = snack.attention.local_pattern(16, 4)
    q = torch.randn(1, 2, 16, 8)
    kept_pattern = kept(pattern)
    with pytest.raises(ValueError, match="fused CUDA forward"):
        snack.attention.sparse_attention(q, q, q, kept_pattern)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_fused_forward(dtype):
    pattern = snack.attention.local_pattern(96, 8, global_tokens=2, random_per_row=3, device="cuda")
    q, k, v = (torch.randn(2, 3, 96, 64, device="cuda", dtype=dtype) for _ in range(3))
    kept_pattern = kept(pattern)
    with torch.no_grad():
        expected = snack.attention.sparse_attention(q, k, v, pattern, causal=True)
        assert torch.equal(snack.attention.sparse_attention(q, k, v, kept_pattern, causal=True), expected)
    with pytest.raises(ValueError, match="torch.no_grad"):
        snack.attention.sparse_attention(q.requires_grad_(), k, v, kept_pattern)


def test_opcheck_forward_products(device):
    w = Weight(11, 13, 40, device=device, seed=3, empty_rows=2)
    tensors = kept(w.pattern).tensors
    x, bias = w.randn(5, 13, seed=1), w.randn(11, seed=3)
    torch.library.opcheck(ops.spmm.default, (x, w.values, tensors, bias))
    torch.library.opcheck(ops.spmm_channels_first.default, (w.randn(2, 13, 9, seed=6), w.values, tensors, bias))
    torch.library.opcheck(ops.sparse_linear.default, (x, w.values, bias, tensors))


def test_compiled_inference(device):
    torch.manual_seed(4)
    model = torch.nn.Sequential(snack.SparseLinear(24, 40, density=0.3, device=device, activation="relu"),
                                snack.SparseLinear(40, 8, density=0.3, device=device))
    snack.for_inference(model)
    x = torch.randn(6, 24, device=device)
    with torch.inference_mode():
        expected = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), expected)


def test_autocast_inference(device):
    torch.manual_seed(5)
    layer = snack.SparseLinear(48, 40, density=0.25, device=device)  # float32 master values
    x = torch.randn(3, 48, device=device)
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16):
        expected = layer(x)
        snack.for_inference(layer, tile_view=True)  # the 16-bit products' view, kept
        kept_with_tiles = layer(x)
        snack.for_inference(layer)
        kept = layer(x)
    assert expected.dtype == kept.dtype == torch.bfloat16
    assert torch.equal(kept_with_tiles, expected)
    w64 = layer.to_dense().double().to(torch.bfloat16).double().cpu()
    bias64 = layer.bias.detach().to(torch.bfloat16).double()
    assert_matmul(kept, x.to(torch.bfloat16), w64.T, torch.bfloat16, bias=bias64, what="autocast forward")


def test_layers_built_under_inference_mode(device):
    # Inference tensors have no version counter, by which the CPU products remember checked patterns.
    x = torch.randn(3, 16, device=device)
    with torch.inference_mode():
        torch.manual_seed(6)
        layer = snack.SparseLinear(16, 8, density=0.3, device=device)
        first = layer(x)
        assert torch.equal(layer(x), first)
        snack.for_inference(layer)
        assert torch.equal(layer(x), first)
        snack.for_training(layer)
    assert not layer.pattern.row_idx.is_inference()  # rebuilt as buffers, usable outside the mode
    w = layer.to_dense().detach()
    assert_matmul(first, x, w.T, torch.float32, bias=layer.bias.detach().double(), what="forward")


def test_training_without_the_tile_view(device):
    torch.manual_seed(7)
    layer = snack.SparseLinear(130, 70, density=0.2, device=device)
    twin = copy.deepcopy(layer)
    whole_bytes = layer.pattern.nbytes()["total"]
    tile_bytes = 4 * (layer.pattern.tile_ptr.numel() + layer.pattern.tile_entries.numel())
    assert tile_bytes > 0
    snack.for_training(layer, tile_view=False)
    assert not layer.pattern.has_tile_view and not layer.pattern.forward_only
    assert layer.pattern.nbytes()["total"] == whole_bytes - tile_bytes
    x = torch.randn(5, 130, device=device, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    layer(x).square().sum().backward()
    twin(x_twin).square().sum().backward()
    assert torch.equal(x.grad, x_twin.grad) and torch.equal(layer.values.grad, twin.values.grad)
    # Topology updates rebuild the other views and leave the tile view out.
    gen = torch.Generator(device=device).manual_seed(8)
    drop = snack.dst.prune_magnitude(twin, 30)
    grow = snack.dst.grow_random(twin, 30, generator=gen)
    twin.update_topology(drop, grow)
    layer.update_topology(drop, grow)
    for name, a, b in zip(snack.PATTERN_FIELDS, layer.pattern.tensors, twin.pattern.tensors, strict=True):
        assert a.numel() == 0 if name.startswith("tile") else torch.equal(a, b), name
    layer.pattern.for_training()  # the tile view back, as the twin derives it
    for a, b in zip(layer.pattern.tensors, twin.pattern.tensors, strict=True):
        assert torch.equal(a, b)


def test_build_views_without_the_tile_view(device):
    w = Weight(70, 130, 900, device=device)
    views = ops.build_views(w.row_idx, w.col_idx, 70, 130, False)
    whole = ops.build_views(w.row_idx, w.col_idx, 70, 130)
    for field, (a, b) in enumerate(zip(views, whole, strict=True)):
        assert a.numel() == 0 if field >= 3 else torch.equal(a, b)
    torch.library.opcheck(ops.build_views.default, (w.row_idx, w.col_idx, 70, 130, False))


def _batch_norm(channels: int, cls=torch.nn.BatchNorm2d, affine: bool = True, seed: int = 0, **kw):
    """An eval-mode batch norm with running statistics and affine parameters far from their defaults."""
    gen = torch.Generator().manual_seed(seed)
    bn = cls(channels, affine=affine, **kw)
    bn.running_mean.copy_(torch.randn(channels, generator=gen))
    bn.running_var.copy_(torch.rand(channels, generator=gen) * 2 + 0.1)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.randn(channels, generator=gen))
            bn.bias.copy_(torch.randn(channels, generator=gen))
    return bn.eval()


def _mobile_block(cin: int, cout: int, stride: int, seed: int) -> torch.nn.Sequential:
    """A depthwise-separable block as MobileNet's: depthwise 3x3 + BN + ReLU, sparse 1x1 + BN + ReLU."""
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), _batch_norm(cin, seed=seed),
        torch.nn.ReLU(inplace=True),
        snack.SparseConv2d(cin, cout, 1, bias=False, density=0.3, generator=gen), _batch_norm(cout, seed=seed + 1),
        torch.nn.ReLU(inplace=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("separable", [False, True])
def test_fuse_for_inference_keeps_the_outputs(device, dtype, channels_last, separable):
    if device.type == "cuda" and dtype == torch.float64:
        pytest.skip("the CUDA products run float32 and 16-bit values")
    torch.manual_seed(0)
    model = torch.nn.Sequential(_mobile_block(6, 13, 2, seed=1), _mobile_block(13, 9, 1, seed=3),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                snack.SparseLinear(9, 5, density=0.5), _batch_norm(5, torch.nn.BatchNorm1d, seed=7),
                                torch.nn.GELU())
    model = model.to(device=device, dtype=dtype).eval()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(3, 6, 11, 10, device=device, dtype=dtype).to(memory_format=fmt)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        expected = reference(x.double())
        values = model[0][3].values
        assert snack.fuse_for_inference(model, separable=separable) is model
        y = model(x)
    for block in model[:2]:
        kinds = [type(m) for m in block]
        if separable:  # the depthwise convolution, its ReLU and the pointwise layer as one module
            assert kinds == [snack.DepthwiseSeparable] + [torch.nn.Identity] * 5, kinds
            depthwise, pointwise = block[0].depthwise, block[0].pointwise
            assert block[0].activation == "relu"
        else:
            assert kinds == [torch.nn.Conv2d, torch.nn.Identity, torch.nn.ReLU, snack.SparseConv2d, torch.nn.Identity,
                             torch.nn.Identity], kinds
            depthwise, pointwise = block[0], block[3]
        assert pointwise.activation == "relu" and pointwise.bias is not None and depthwise.bias is not None
    assert (model[0][0].pointwise if separable else model[0][3]).values is values  # scaled in place
    assert model[4].activation == "gelu" and isinstance(model[5], torch.nn.Identity)
    assert isinstance(model[6], torch.nn.Identity)
    # the folded weights round once more than the reference's: torch's own rounding of the model's ops
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_fuse_for_inference_folds_only_what_it_can():
    gen = torch.Generator().manual_seed(0)
    with_act = snack.SparseLinear(8, 6, density=0.5, activation="relu", generator=gen)
    no_stats = torch.nn.BatchNorm1d(6, track_running_stats=False).eval()
    model = torch.nn.Sequential(
        with_act, _batch_norm(6, torch.nn.BatchNorm1d),       # the activation comes before the batch norm
        torch.nn.Linear(6, 6), no_stats,                       # nothing to fold
        snack.SparseLinear(6, 7, density=0.5, generator=gen), torch.nn.GELU(approximate="tanh"),  # not fused
        snack.SparseLinear(7, 7, density=0.5, generator=gen), torch.nn.ReLU(),                   # fused, no BN
        torch.nn.Linear(7, 4), _batch_norm(4, torch.nn.BatchNorm1d, affine=False), torch.nn.ReLU())  # dense: BN only
    model.eval()
    x = torch.randn(5, 8, dtype=torch.float64)
    model.double()
    with torch.no_grad():
        expected = model(x)
        snack.fuse_for_inference(model)
        y = model(x)
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["SparseLinear", "BatchNorm1d", "Linear", "BatchNorm1d", "SparseLinear", "GELU", "SparseLinear",
                     "Identity", "Linear", "Identity", "ReLU"], kinds
    assert model[6].activation == "relu" and model[4].activation == "none"
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_fuse_for_inference_refuses_training_batch_norms():
    model = torch.nn.Sequential(snack.SparseLinear(8, 6, density=0.5), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                snack.SparseLinear(6, 6, density=0.5), torch.nn.ReLU())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="training mode"):
        snack.fuse_for_inference(model)
    assert [type(m).__name__ for m in model] == ["SparseLinear", "BatchNorm1d", "ReLU", "SparseLinear", "ReLU"]
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing changed
    assert model[3].activation == "none"
