"""SparseConv2d: 1x1 convolutions against float64 references of F.conv2d with the layer's dense weight
(NCHW and channels_last, strides, odd sizes, unbatched input, gradients, autocast), construction
from nn.Conv2d, sparsify and DST over convolutions."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import snack
from helpers import Weight, assert_close, assert_same_values, ops, poison_cache


@pytest.fixture(autouse=True)
def exact_float32_convolutions():
    # The dense path of NCHW inference is cuDNN's convolution, which rounds float32 to TF32 where
    # torch.backends.cudnn.allow_tf32 lets it (PyTorch's default), as nn.Conv2d does; the float64
    # comparisons here want float32 products.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


def conv_ref(layer, x):
    """F.conv2d with the layer's dense weight in float64 on the CPU, and the same with magnitudes (the scale)."""
    w = layer.to_dense().detach().double().cpu()[:, :, None, None]
    b = layer.bias.detach().double().cpu() if layer.bias is not None else None
    x64 = x.detach().double().cpu()
    ref = F.conv2d(x64, w, b, stride=layer.stride)
    scale = F.conv2d(x64.abs(), w.abs(), b.abs() if b is not None else None, stride=layer.stride)
    if layer.activation == "relu":
        ref = ref.clamp_min(0)
    return ref, scale


@pytest.mark.parametrize("shape,stride", [((3, 13, 5, 7), 1), ((1, 5, 9, 4), 2), ((2, 8, 1, 1), 1),
                                          ((4, 13, 6, 5), (2, 1))])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("bias,activation", [(True, None), (False, "relu")])
def test_forward_matches_conv2d(device, shape, stride, layout, bias, activation):
    gen = torch.Generator().manual_seed(shape[1] * 7 + shape[2])
    layer = snack.SparseConv2d(shape[1], 11, stride=stride, bias=bias, density=0.3, generator=gen,
                               activation=activation).to(device)
    x = torch.randn(shape, generator=gen).to(device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    y = layer(x)
    ref, scale = conv_ref(layer, x)
    assert_close(y, ref, scale, torch.float32, f"{shape} stride {stride} {layout}")
    # The output keeps the input's memory format, as nn.Conv2d's does.
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)


# (images, M, K, pixels, nnz, empty rows): pixels odd (one-element lanes), a multiple of 2, 4, 8, and 1;
# K not a multiple of 4; empty rows; nnz = 0 (bias and activation only); a full weight; no images.
CHANNELS_FIRST_CASES = [
    (1, 1, 1, 1, 1, 0),
    (2, 7, 13, 35, 40, 0),
    (3, 33, 65, 49, 200, 5),
    (1, 64, 37, 144, 500, 10),
    (2, 130, 257, 18, 1700, 30),
    (2, 9, 11, 20, 0, 0),
    (5, 6, 5, 300, 30, 0),
    (0, 4, 4, 9, 5, 0),
]


CHANNELS_FIRST_PATHS = ("auto",) + snack.CHANNELS_FIRST_PATHS


def channels_first_ref(w, x, bias, activation):
    """act(W x + b) per image in float64 on the CPU, and its scale (the sum of the terms' magnitudes)."""
    x64, b64 = x.double().cpu(), bias.double().cpu()[None, :, None]
    ref = torch.einsum("mk,bkp->bmp", w.dense64, x64) + b64
    scale = torch.einsum("mk,bkp->bmp", w.dense64.abs(), x64.abs()) + b64.abs()
    if activation == "relu":
        ref = ref.clamp_min(0)
    elif activation == "gelu":
        ref, scale = F.gelu(ref), 1.13 * scale  # |gelu'| <= 1.13: the input's error, at most that much larger
    return ref, scale


@pytest.mark.parametrize("case", CHANNELS_FIRST_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_spmm_channels_first(device, case, dtype, activation):
    images, m, k, pixels, nnz, empty = case
    w = Weight(m, k, nnz, device=device, dtype=dtype, index_dtype=torch.int32 if m > 100 else None, empty_rows=empty,
               seed=m + pixels)
    x, bias = w.randn(images, k, pixels, seed=3), w.randn(m, seed=4)
    if device.type == "cuda":
        poison_cache(device)
    ref, scale = channels_first_ref(w, x, bias, activation)
    # Every path on CUDA (the CPU has one and ignores the name), each reproducible.
    for variant in CHANNELS_FIRST_PATHS if device.type == "cuda" else ("auto", "dense_blocks"):
        y = ops.spmm_channels_first(x, w.values, w.tensors, bias, activation, variant)
        assert y.shape == (images, m, pixels) and y.dtype == dtype and y.is_contiguous()
        # cuDNN's 16-bit convolution rounds its sums before the bias: nn.Conv2d's own error, up to twice
        # the kernels' (one rounding).
        wider = 2 if variant == "dense_blocks" and dtype in (torch.bfloat16, torch.float16) else 1
        assert_close(y, ref, wider * scale, dtype, f"{case} {activation} {variant}")
        for _ in range(2):
            assert torch.equal(ops.spmm_channels_first(x, w.values, w.tensors, bias, activation, variant), y), \
                f"{variant} not reproducible"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spmm_channels_first_unaligned_and_strided_inputs(device, dtype):
    # x one element past an aligned address (each lane then reads single elements), and a
    # non-contiguous x (made contiguous by the op): the same results as the aligned, contiguous input.
    w = Weight(24, 10, 90, device=device, dtype=dtype, seed=5)
    flat = w.randn(2 * 10 * 64 + 1, seed=6)
    x = flat[1:].view(2, 10, 64)
    wide = w.randn(2, 10, 128, seed=7)
    for variant in CHANNELS_FIRST_PATHS:
        ref, scale = channels_first_ref(w, x, torch.zeros(24), "none")
        assert_close(ops.spmm_channels_first(x, w.values, w.tensors, variant=variant), ref, scale, dtype,
                     f"unaligned {variant}")
        ref, scale = channels_first_ref(w, wide[:, :, ::2], torch.zeros(24), "none")
        assert_close(ops.spmm_channels_first(wide[:, :, ::2], w.values, w.tensors, variant=variant), ref, scale,
                     dtype, f"strided {variant}")


def test_spmm_channels_first_errors(device):
    w = Weight(5, 6, 12, device=device, seed=8)
    with pytest.raises(ValueError, match="3-D"):
        ops.spmm_channels_first(w.randn(6, 4), w.values, w.tensors)
    with pytest.raises(ValueError, match="7 channels, expected 6"):
        ops.spmm_channels_first(w.randn(1, 7, 4), w.values, w.tensors)
    with pytest.raises(TypeError, match="differs from the weight dtype"):
        ops.spmm_channels_first(w.randn(1, 6, 4).double(), w.values, w.tensors)
    with pytest.raises(ValueError, match="bias"):
        ops.spmm_channels_first(w.randn(1, 6, 4), w.values, w.tensors, w.randn(4))
    with pytest.raises(ValueError, match="unknown variant 'dense'.*in_place, pixel_rows, dense_blocks"):
        ops.spmm_channels_first(w.randn(1, 6, 4), w.values, w.tensors, variant="dense")


@pytest.mark.parametrize("shape,stride", [((3, 13, 5, 7), 1), ((1, 5, 9, 4), 2), ((2, 8, 1, 1), 1),
                                          ((4, 13, 6, 5), (2, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nchw_inference_reads_the_images_in_place(device, shape, stride, dtype):
    # Without autograd an NCHW input takes spmm_channels_first; the result is the convolution's, in
    # the input's (contiguous) format, batched or not, as under autograd.
    gen = torch.Generator().manual_seed(shape[1] + shape[3])
    layer = snack.SparseConv2d(shape[1], 11, stride=stride, density=0.3, generator=gen, activation="relu",
                               dtype=dtype).to(device)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    with torch.no_grad():
        y = layer(x)
        unbatched = layer(x[0])
    ref, scale = conv_ref(layer, x)
    assert_close(y, ref, scale, dtype, f"{shape} stride {stride}")
    assert y.is_contiguous() and torch.equal(unbatched, y[0])
    with torch.inference_mode():
        assert torch.equal(layer(x), y)
    trained = layer(x)  # under autograd: the channels-last product, the same function
    assert trained.requires_grad and trained.is_contiguous()
    assert_close(trained, ref, scale, dtype, f"{shape} stride {stride} under autograd")


def test_nchw_inference_path_is_the_planners(device):
    # A SparseConv2d's NCHW inference runs the path snack.explain names: in place for a small product
    # (always on the CPU), the dense blocks or the pixel rows for a large one on CUDA; each path is
    # the convolution, in the contiguous format.
    layer = snack.SparseConv2d(256, 96, density=0.3, generator=torch.Generator().manual_seed(4)).to(device)
    for images, side in ((1, 3), (32, 20)):
        plan = snack.explain(layer, images * side * side, op="channels_first", pixels=side * side)
        assert plan.variant == "in_place" if device.type == "cpu" or images == 1 else plan.variant != "in_place"
        assert plan.reason == ("cpu_rule" if device.type == "cpu" else "planner")
        x = torch.randn(images, 256, side, side, device=device)
        with torch.no_grad():
            y = layer(x)
        ref, scale = conv_ref(layer, x)
        assert_close(y, ref, scale, torch.float32, f"{images} images of {side}x{side}, {plan.variant}")
        assert y.is_contiguous()
    forced = snack.explain(layer, 10, op="channels_first", variant="dense_blocks")
    assert (forced.variant, forced.reason) == ("in_place" if device.type == "cpu" else "dense_blocks", "forced")


@pytest.mark.cuda
def test_gelu_on_16_bit_images_takes_the_pixel_rows():
    # The dense path would round cuDNN's 16-bit sums before GELU: the planner, and explain with it,
    # takes the pixel rows, which apply it to the float sums (each path's GELU is checked against
    # float64 in test_spmm_channels_first).
    gen = torch.Generator().manual_seed(5)
    plain = snack.SparseConv2d(256, 256, density=0.1, generator=gen, dtype=torch.bfloat16).cuda()
    gelu = snack.SparseConv2d(256, 256, density=0.1, generator=gen, dtype=torch.bfloat16, activation="gelu").cuda()
    assert snack.explain(plain, 64 * 56 * 56, op="channels_first", pixels=56 * 56).variant == "dense_blocks"
    assert snack.explain(gelu, 64 * 56 * 56, op="channels_first", pixels=56 * 56).variant == "pixel_rows"
    # As many pixels in images of one pixel: the planner's rule for images under 64 pixels.
    assert snack.explain(plain, 64 * 56 * 56, op="channels_first").variant == "pixel_rows"


@pytest.mark.cuda
def test_dense_path_follows_cudnn_tf32():
    # With TF32 allowed the dense path rounds float32 as nn.Conv2d does; the in-place kernel never does.
    w = Weight(96, 512, 5000, device="cuda", seed=9)
    x = w.randn(2, 512, 300, seed=10)
    ref, scale = channels_first_ref(w, x, torch.zeros(96), "none")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        rounded = ops.spmm_channels_first(x, w.values, w.tensors, variant="dense_blocks")
        in_place = ops.spmm_channels_first(x, w.values, w.tensors, variant="in_place")
    exact = ops.spmm_channels_first(x, w.values, w.tensors, variant="dense_blocks")
    assert_close(exact, ref, scale, torch.float32, "dense, TF32 off")
    assert_close(in_place, ref, scale, torch.float32, "in place, TF32 on")
    assert_close(rounded, ref, scale, torch.bfloat16, "dense, TF32 on")  # TF32's 10 mantissa bits pass bf16's
    assert not torch.equal(rounded, exact)


def test_unbatched_input_and_errors():
    layer = snack.SparseConv2d(6, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 5, 3)
    ref, scale = conv_ref(layer, x[None])
    assert_close(layer(x), ref[0], scale[0], torch.float32, "unbatched")
    with pytest.raises(ValueError, match="5 channels, the layer 6"):
        layer(torch.randn(2, 5, 3, 3))
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        layer(torch.randn(2, 6))
    with pytest.raises(ValueError, match="1x1"):
        snack.SparseConv2d(6, 4, kernel_size=3, density=0.5)
    with pytest.raises(ValueError, match="padding"):
        snack.SparseConv2d(6, 4, padding=1, density=0.5)
    with pytest.raises(ValueError, match="groups"):
        snack.SparseConv2d(6, 4, groups=2, density=0.5)
    with pytest.raises(ValueError, match="stride"):
        snack.SparseConv2d(6, 4, stride=0, density=0.5)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_gradients_match_the_dense_convolution(device, layout):
    # dX, the values' gradient at the stored positions and the bias gradient, against autograd
    # through F.conv2d with the dense weight, in float64.
    gen = torch.Generator().manual_seed(3)
    layer = snack.SparseConv2d(9, 5, stride=2, density=0.4, dtype=torch.float64, generator=gen).to(device)
    x = torch.randn(3, 9, 7, 5, dtype=torch.float64, generator=gen).to(device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    upstream = torch.randn(3, 5, 4, 3, dtype=torch.float64, generator=gen).to(device)
    (layer(x) * upstream).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.to_dense().detach().clone().requires_grad_()
    b_ref = layer.bias.detach().clone().requires_grad_()
    (F.conv2d(x_ref, w_ref[:, :, None, None], b_ref, stride=2) * upstream).sum().backward()
    rows, cols = layer.row_idx.long(), layer.col_idx.long()
    assert_same_values(x.grad, x_ref.grad, 1e-12, what="dX")
    assert_same_values(layer.values.grad, w_ref.grad[rows, cols], 1e-12, what="dW at the stored positions")
    assert_same_values(layer.bias.grad, b_ref.grad, 1e-12, what="bias gradient")


@pytest.mark.parametrize("layout,grad", [("channels_last", True), ("nchw", False)], ids=["channels_last", "nchw_inference"])
def test_autocast_computes_in_bfloat16(device, layout, grad):
    # channels_last under autograd, and NCHW at inference (spmm_channels_first's autocast kernel).
    layer = snack.SparseConv2d(16, 12, density=0.25, generator=torch.Generator().manual_seed(1)).to(device)
    x = torch.randn(2, 16, 5, 5, device=device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.requires_grad == grad
    # The reference: the product of the bf16-rounded operands, accumulated exactly.
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.values.copy_(layer.values.bfloat16().float())
        twin.bias.copy_(layer.bias.bfloat16().float())
    ref, scale = conv_ref(twin, x.bfloat16().float())
    assert_close(y, ref, scale, torch.bfloat16, f"autocast {layout}")


def test_from_dense_and_back():
    conv = nn.Conv2d(10, 6, 1, stride=2)
    layer = snack.SparseConv2d.from_dense(conv, density=0.5)
    assert layer.stride == (2, 2) and layer.nnz == snack.nnz_for_density(6, 10, 0.5)
    w = conv.weight.detach().flatten(1)
    kept = torch.zeros_like(w, dtype=torch.bool)
    kept[layer.row_idx.long(), layer.col_idx.long()] = True
    assert w.abs()[kept].min() >= w.abs()[~kept].max()  # the largest magnitudes are kept
    dense = layer.to_conv2d()
    x = torch.randn(2, 10, 6, 6)
    assert torch.allclose(dense(x), layer(x), atol=1e-6)
    full = snack.SparseConv2d.from_dense(conv.weight, density=1.0, bias=conv.bias, stride=2)
    assert torch.allclose(full(x), conv(x), atol=1e-6)
    with pytest.raises(ValueError, match="1x1"):
        snack.SparseConv2d.from_dense(nn.Conv2d(10, 6, 3), density=0.5)


def test_state_dict_and_copies_keep_the_layer():
    layer = snack.SparseConv2d(8, 4, stride=2, density=0.5, generator=torch.Generator().manual_seed(2))
    other = snack.SparseConv2d(8, 4, stride=2, density=0.5, generator=torch.Generator().manual_seed(5))
    other.load_state_dict(layer.state_dict())
    x = torch.randn(1, 8, 4, 4)
    assert torch.equal(other(x), layer(x))
    clone = copy.deepcopy(layer)
    assert isinstance(clone, snack.SparseConv2d) and clone.stride == (2, 2) and torch.equal(clone(x), layer(x))
    assert snack.nn.SparseConv2d is snack.SparseConv2d and snack.nn.SparseLinear is snack.SparseLinear


def mobile_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.Conv2d(16, 32, 1), nn.ReLU(),
                         nn.Conv2d(32, 32, 1, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))


def test_sparsify_converts_pointwise_convolutions_only():
    model = mobile_block()
    x = torch.randn(2, 3, 8, 8)
    want = model(x)
    densities = snack.sparsify(model, 1.0)  # density 1: the same function in sparse form
    kinds = [type(m).__name__ for m in model]
    assert kinds[0] == "Conv2d" and kinds[2] == "Conv2d"  # 3x3 and depthwise stay dense
    assert kinds[3] == "SparseConv2d" and kinds[5] == "SparseConv2d" and kinds[8] == "SparseLinear"
    assert model[5].stride == (2, 2) and set(densities) == {"3", "5", "8"}
    assert torch.allclose(model(x), want, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_dst_moves_the_connections_of_convolutions(device, algorithm):
    model = mobile_block().to(device)
    snack.sparsify(model, 0.3, generator=torch.Generator(device=device).manual_seed(1))
    convs = [m for m in model if isinstance(m, snack.SparseConv2d)]
    masks = [c.mask().clone() for c in convs]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = snack.dst.DSTScheduler(model, opt, algorithm=algorithm, update_every=2, drop_fraction=0.3,
                                   generator=torch.Generator(device=device).manual_seed(2))
    x = torch.randn(4, 3, 8, 8, device=device).to(memory_format=torch.channels_last)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert sched.steps == 2
    assert all(not torch.equal(c.mask(), m) for c, m in zip(convs, masks))
    assert all(c.nnz == int(m.sum()) for c, m in zip(convs, masks))


def test_rigl_scores_of_a_convolution_are_its_dense_gradient():
    # RigL grows where |dL/dW| of the dense 1x1 convolution is largest: the sum over output pixels
    # of dY x^T, with the stride's pixels only.
    gen = torch.Generator().manual_seed(4)
    layer = snack.SparseConv2d(7, 6, stride=2, density=0.3, dtype=torch.float64, generator=gen)
    x = torch.randn(2, 7, 5, 6, dtype=torch.float64, generator=gen)
    dy = torch.randn(2, 6, 3, 3, dtype=torch.float64, generator=gen)
    w = layer.to_dense().detach().requires_grad_()
    (F.conv2d(x, w[:, :, None, None], stride=2) * dy).sum().backward()
    score = w.grad.abs().flatten()
    score[layer.row_idx.long() * 7 + layer.col_idx.long()] = -1
    k = 10
    ref = torch.sort(torch.sort(score, stable=True, descending=True).indices[:k]).values
    assert torch.equal(snack.dst.grow_gradient(layer, k, x, dy), ref)


def test_compile_fullgraph_forward_backward(device):
    torch._dynamo.reset()
    layer = snack.SparseConv2d(12, 8, stride=2, density=0.3, generator=torch.Generator().manual_seed(6)).to(device)
    model = nn.Sequential(layer, nn.ReLU())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 12, 7, 7, device=device).to(memory_format=torch.channels_last)
    out, ref = compiled(x), model(x)
    assert torch.equal(out, ref), "the same kernels run, compiled or not"
    out.sum().backward()
    g_compiled = layer.values.grad.clone()
    layer.values.grad = None
    ref.sum().backward()
    assert torch.equal(g_compiled, layer.values.grad)
    with torch.no_grad():  # NCHW inference: spmm_channels_first through its fake kernel
        nchw = x.contiguous()
        assert torch.equal(compiled(nchw), model(nchw))
