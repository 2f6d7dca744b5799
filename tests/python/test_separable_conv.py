"""snack.ops.separable_conv and snack.DepthwiseSeparable: a 3x3 depthwise convolution, its activation
and a sparse 1x1 convolution, fused on CUDA (channels_last and NCHW images), against float64 references
(odd image sizes, strides 1 and 2, output channels that are not whole chunks, empty rows, nnz = 0, the
widest channel counts that fit, every tile width), the unfused path, fuse_for_inference and autocast."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import snack
from helpers import Weight, assert_close, ops, poison_cache


@pytest.fixture(autouse=True)
def exact_float32_convolutions():
    # The unfused path convolves with cuDNN, which rounds float32 to TF32 where PyTorch lets it.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


def separable_ref(x, dw, dw_bias, stride, dw_act, w, bias, act, dtype):
    """The float64 reference and its scale (the magnitudes of every term). The depthwise output is
    rounded to `dtype`, as a separate depthwise convolution's output is."""
    x64, dw64 = x.double().cpu(), dw.double().cpu()
    db64 = dw_bias.double().cpu() if dw_bias is not None else None
    channels = x.shape[1]
    z = F.conv2d(x64, dw64, db64, stride=stride, padding=1, groups=channels)
    z_scale = F.conv2d(x64.abs(), dw64.abs(), db64.abs() if db64 is not None else None, stride=stride, padding=1,
                       groups=channels)
    if dw_act == "relu":
        z = z.clamp_min(0)
    elif dw_act == "gelu":
        z, z_scale = F.gelu(z), 1.13 * z_scale
    z = z.to(dtype).double()
    b64 = bias.double().cpu() if bias is not None else torch.zeros(w.m, dtype=torch.float64)
    ref = torch.einsum("ok,bkhw->bohw", w.dense64, z) + b64[None, :, None, None]
    scale = torch.einsum("ok,bkhw->bohw", w.dense64.abs(), z_scale.abs() + z.abs()) + b64.abs()[None, :, None, None]
    if act == "relu":
        ref = ref.clamp_min(0)
    elif act == "gelu":
        ref, scale = F.gelu(ref), 1.13 * scale
    return ref, scale


# (batch, channels, height, width, out_channels, stride, density, empty rows): 1x1 images, odd sizes,
# out_channels past a chunk of 64 and below one, a pixel tile of 128 (2 x 96 x 96 pixels), MobileNet's
# 14 x 14 x 512 and 7 x 7 x 1024 (the widest that fits in float32), empty rows, nnz = 0.
CASES = [
    (2, 16, 1, 1, 5, 2, 0.5, 0),
    (1, 8, 7, 7, 16, 1, 0.4, 2),
    (2, 32, 13, 11, 70, 2, 0.2, 5),
    (3, 64, 5, 9, 130, 1, 0.1, 0),
    (2, 16, 96, 96, 24, 1, 0.3, 0),
    (1, 512, 14, 14, 512, 1, 0.1, 20),
    (1, 1024, 7, 7, 1024, 1, 0.05, 0),
    (2, 24, 6, 6, 9, 1, 0.0, 0),
]


def make_case(case, device, dtype, seed=0):
    batch, channels, height, width, out_channels, stride, density, empty = case
    nnz = int(density * out_channels * channels)
    w = Weight(out_channels, channels, nnz, device=device, dtype=dtype, empty_rows=empty, seed=seed + channels,
               index_dtype=torch.int32 if out_channels == 130 else None)
    x = w.randn(batch, channels, height, width, seed=seed + 1)
    dw = w.randn(channels, 1, 3, 3, seed=seed + 2)
    dw_bias, bias = w.randn(channels, seed=seed + 3), w.randn(out_channels, seed=seed + 4)
    return w, x, dw, dw_bias, bias, stride


def variants(device):
    return ("auto", "fused", "unfused") if device.type == "cuda" else ("auto", "unfused")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("acts", [("relu", "relu"), ("none", "gelu"), ("gelu", "none")])
def test_matches_float64(device, case, dtype, acts):
    w, x, dw, dw_bias, bias, stride = make_case(case, device, dtype)
    dw_act, act = acts
    if case[6] == 0.5:  # no biases on one case
        dw_bias = bias = None
    ref, scale = separable_ref(x, dw, dw_bias, stride, dw_act, w, bias, act, dtype)
    # Two roundings in 16 bits: the depthwise output's (which may fall the other way than the
    # reference's) and the output's.
    wider = 2 if dtype in (torch.bfloat16, torch.float16) else 1
    for layout in ("channels_last", "nchw"):
        images = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
        for variant in variants(device):
            if device.type == "cuda":
                poison_cache(device)
            y = ops.separable_conv(images, dw, dw_bias, stride, dw_act, w.values, w.tensors, bias, act, variant)
            what = f"{case} {dtype} {acts} {layout} {variant}"
            assert y.dtype == dtype and y.shape == ref.shape, what
            assert_close(y, ref, wider * scale, dtype, what)
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            assert y.is_contiguous(memory_format=fmt), what
            assert torch.equal(ops.separable_conv(images, dw, dw_bias, stride, dw_act, w.values, w.tensors, bias, act,
                                                  variant), y), f"{what}: not reproducible"


def test_fallbacks_and_errors(device):
    # float32 channels that are not whole 16-byte vectors run apart under "auto"; "fused" refuses them,
    # and float64.
    w, x, dw, dw_bias, bias, _ = make_case((2, 6, 5, 5, 7, 1, 0.5, 0), device, torch.float32)
    images = x.contiguous(memory_format=torch.channels_last)
    ref, scale = separable_ref(x, dw, dw_bias, 1, "relu", w, bias, "none", torch.float32)
    assert_close(ops.separable_conv(images, dw, dw_bias, 1, "relu", w.values, w.tensors, bias), ref, scale,
                 torch.float32, "6 channels")
    with pytest.raises(ValueError, match="fused"):
        ops.separable_conv(images, dw, dw_bias, 1, "relu", w.values, w.tensors, bias, variant="fused")
    if device.type == "cuda":  # NCHW, the kernel reads one channel a thread: any count
        assert_close(ops.separable_conv(x, dw, dw_bias, 1, "relu", w.values, w.tensors, bias, variant="fused"), ref,
                     scale, torch.float32, "6 channels, NCHW")
    w64, x64, dw64, _, _, _ = make_case((1, 8, 4, 4, 3, 1, 0.5, 0), device, torch.float64)
    y = ops.separable_conv(x64, dw64, None, 1, "none", w64.values, w64.tensors)
    ref, scale = separable_ref(x64, dw64, None, 1, "none", w64, None, "none", torch.float64)
    assert_close(y, ref, scale, torch.float64, "float64")
    with pytest.raises(ValueError, match="fused"):
        ops.separable_conv(x64, dw64, None, 1, "none", w64.values, w64.tensors, variant="fused")
    with pytest.raises(ValueError, match="stride"):
        ops.separable_conv(images, dw, dw_bias, 3, "relu", w.values, w.tensors)
    with pytest.raises(ValueError, match=r"\[6, 1, 3, 3\]"):
        ops.separable_conv(images, dw[:, :, :2], dw_bias, 1, "relu", w.values, w.tensors)
    with pytest.raises(ValueError, match="channels"):
        ops.separable_conv(images[:, :5], dw[:5], dw_bias[:5], 1, "relu", w.values, w.tensors)
    with pytest.raises(ValueError, match="variant"):
        ops.separable_conv(images, dw, dw_bias, 1, "relu", w.values, w.tensors, variant="fast")
    with pytest.raises(TypeError, match="dw_weight"):
        ops.separable_conv(images, dw.double(), dw_bias, 1, "relu", w.values, w.tensors)


def test_opcheck(device):
    w, x, dw, dw_bias, bias, stride = make_case((2, 16, 5, 7, 9, 2, 0.3, 1), device, torch.float32)
    for images in (x, x.contiguous(memory_format=torch.channels_last)):
        torch.library.opcheck(ops.separable_conv.default, (images, dw, dw_bias, stride, "relu", w.values, w.tensors,
                                                           bias), {"activation": "relu"})
        torch.library.opcheck(ops.separable_conv.default, (images, dw, None, 1, "none", w.values, w.tensors))


def mobile_blocks(device, dtype=torch.float32):
    """Two MobileNet blocks (depthwise 3x3 + BN + ReLU, then a pointwise 1x1 + BN + ReLU), the second
    of stride 2, with a sparse pointwise layer each, in eval mode with non-trivial statistics."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)

    def block(cin, cout, stride):
        return [nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.BatchNorm2d(cin),
                              nn.ReLU(inplace=True)),
                nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))]

    model = nn.Sequential(*block(16, 32, 1), *block(32, 64, 2), nn.AdaptiveAvgPool2d(1))
    snack.sparsify(model, 0.3, include=lambda name, m: isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1),
                   generator=gen)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2, generator=gen)
            m.running_var.uniform_(0.5, 1.5, generator=gen)
    return model.to(device=device, dtype=dtype).eval()


def test_fuse_for_inference_builds_the_blocks(device):
    model = mobile_blocks(device)
    x = torch.randn(3, 16, 11, 10, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        expected = model(x)
        plain = snack.fuse_for_inference(copy.deepcopy(model), separable=False)
        fused = snack.fuse_for_inference(copy.deepcopy(model))
        assert not any(isinstance(m, snack.DepthwiseSeparable) for m in plain.modules())
        blocks = [m for m in fused.modules() if isinstance(m, snack.DepthwiseSeparable)]
        assert len(blocks) == 2 and all(b.activation == "relu" for b in blocks)
        assert blocks[1].depthwise.stride == (2, 2)
        for layout in (torch.contiguous_format, torch.channels_last):
            images = x.contiguous(memory_format=layout)
            for name, m in (("plain", plain), ("fused", fused)):
                y = m(images)
                scale = expected.abs() + 1.0
                assert_close(y, expected.double(), scale.double(), torch.float32, f"{name} {layout}")


def test_module_trains_through_its_layers(device):
    model = snack.fuse_for_inference(mobile_blocks(device))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.train()
    block = next(m for m in model.modules() if isinstance(m, snack.DepthwiseSeparable))
    x = torch.randn(2, 16, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    y = block(x)
    with torch.no_grad():
        expected = block(x)
    assert_close(y, expected.double(), expected.abs().double() + 1.0, torch.float32, "grad path")
    y.sum().backward()
    assert block.depthwise.weight.grad is not None and block.pointwise.values.grad is not None


def test_module_checks_its_layers():
    pointwise = snack.SparseConv2d(8, 4, density=0.5)
    with pytest.raises(ValueError, match="depthwise"):
        snack.DepthwiseSeparable(nn.Conv2d(8, 8, 3, padding=1), pointwise)  # not grouped
    with pytest.raises(ValueError, match="depthwise"):
        snack.DepthwiseSeparable(nn.Conv2d(8, 8, 5, padding=2, groups=8), pointwise)
    with pytest.raises(ValueError, match="channels"):
        snack.DepthwiseSeparable(nn.Conv2d(6, 6, 3, padding=1, groups=6), pointwise)
    with pytest.raises(ValueError, match="activation"):
        snack.DepthwiseSeparable(nn.Conv2d(8, 8, 3, padding=1, groups=8), pointwise, "tanh")


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_autocast_computes_in_16_bits(device, layout):
    w, x, dw, dw_bias, bias, stride = make_case((2, 32, 9, 9, 40, 1, 0.25, 0), device, torch.float32)
    images = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
    dtype = torch.bfloat16
    with torch.autocast(device.type, dtype=dtype):
        y = ops.separable_conv(images, dw, dw_bias, stride, "relu", w.values, w.tensors, bias, "relu")
    assert y.dtype == dtype
    w16 = copy.copy(w)
    w16.dense64 = w.dense64.to(dtype).double()
    ref, scale = separable_ref(x.to(dtype), dw.to(dtype), dw_bias.to(dtype), stride, "relu", w16, bias.to(dtype),
                               "relu", dtype)
    assert_close(y, ref, 2 * scale, dtype, f"autocast {layout}")
