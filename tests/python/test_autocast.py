"""torch.autocast: a SparseLinear behaves as an autocast nn.Linear (computes in the autocast dtype,
keeps float32 values, returns float32 gradients), with torch's GradScaler, snack.optim.AdamW's
fused step, torch.compile and the low-level ops; every result against float64 references of the
16-bit operands."""

import copy

import pytest
import torch
from torch import nn

import snack
from helpers import assert_close, assert_same_values, ops, tolerance

DTYPES = [torch.bfloat16, torch.float16]


def rounded(t, dtype):
    """t as the kernel reads it: rounded to dtype, then exact in float64."""
    return t.detach().to(dtype).double().cpu()


def layer_and_input(device, activation=None, lead=(), n=7, k=45, m=31, density=0.3, seed=0):
    torch.manual_seed(seed)
    layer = snack.SparseLinear(k, m, density=density, device=device, activation=activation)
    x = torch.randn(*lead, n, k, device=device, requires_grad=True)
    return layer, x


def act64(z, activation):
    return {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[activation](z)


@pytest.mark.parametrize("dtype", DTYPES)
# Batches of 96 and 4 x 40 tokens take the tensor-core SDDMM for dW on CUDA (from 64 rows).
@pytest.mark.parametrize("activation,lead,n", [(None, (), 7), ("relu", (2,), 5), ("gelu", (), 1), (None, (3,), 0),
                                               ("relu", (), 96), (None, (4,), 40)])
def test_forward_and_gradients_in_the_autocast_dtype(device, dtype, activation, lead, n):
    layer, x = layer_and_input(device, activation, lead, n)
    with torch.autocast(device.type, dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype and layer.values.dtype == torch.float32
    w64, b64, x64 = rounded(layer.to_dense(), dtype), rounded(layer.bias, dtype), rounded(x, dtype)
    z64 = x64 @ w64.T + b64
    scale = x64.abs() @ w64.abs().T + b64.abs()
    # The activation runs on the 16-bit pre-activation: its error is the product's, then one rounding.
    assert_close(y, act64(z64, activation), scale + act64(z64, activation).abs(), dtype, "y")

    g = torch.randn(y.shape, device=device).to(dtype)
    y.backward(g)
    assert layer.values.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    # dZ as autograd computes it in the autocast dtype (the activation's gradient at the 16-bit
    # pre-activation, which the same product kernel gives): the sparse products are checked from it.
    z16 = ops.spmm(x.detach().to(dtype).reshape(-1, layer.in_features), layer.values.detach().to(dtype),
                   layer.pattern.tensors, layer.bias.detach().to(dtype)).reshape(g.shape)
    dz = {None: lambda: g, "relu": lambda: torch.where(z16 > 0, g, 0),
          "gelu": lambda: torch.ops.aten.gelu_backward(g, z16)}[activation]().double().cpu()
    dz2, x2 = dz.reshape(-1, layer.out_features), x64.reshape(-1, layer.in_features)
    rows, cols = layer.row_idx.long().cpu(), layer.col_idx.long().cpu()
    dv = (dz2.T @ x2)[rows, cols]
    dv_scale = (dz2.abs().T @ x2.abs())[rows, cols]
    assert_close(layer.values.grad, dv, dv_scale + dv.abs(), dtype, "values.grad")
    assert_close(layer.bias.grad, dz2.sum(0), dz2.abs().sum(0), dtype, "bias.grad")
    assert_close(x.grad, dz @ w64, dz.abs() @ w64.abs(), dtype, "x.grad")


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_an_autocast_linear_with_the_same_weight(device, dtype):
    """The mixed-precision loop of a user: an autocast nn.Linear hands its 16-bit output to the layer."""
    torch.manual_seed(1)
    first = nn.Linear(12, 40, device=device)
    layer = snack.SparseLinear(40, 24, density=0.25, device=device)
    dense = layer.to_linear()
    x = torch.randn(6, 12, device=device)
    with torch.autocast(device.type, dtype=dtype):
        h = first(x)
        y, y_dense = layer(h), dense(h)
    assert h.dtype == dtype and y.dtype == y_dense.dtype == dtype
    h64, w64 = rounded(h, dtype), rounded(dense.weight, dtype)
    assert_close(y, y_dense.double(), h64.abs() @ w64.abs().T + rounded(dense.bias, dtype).abs(), dtype)


def test_outside_autocast_a_16_bit_input_still_needs_16_bit_values(device):
    layer, _ = layer_and_input(device)
    with pytest.raises(TypeError, match="differs from the weight dtype"):
        layer(torch.randn(3, 45, device=device, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_cast_their_operands(device, dtype):
    layer, x = layer_and_input(device)
    tensors, values = layer.pattern.tensors, layer.values.detach()
    dy = torch.randn(7, 31, device=device)
    with torch.autocast(device.type, dtype=dtype):
        y = ops.spmm(x.detach(), values, tensors, layer.bias.detach())
        dx = ops.spmm_t(dy, values, tensors)
        dv = ops.sddmm(dy, x.detach(), tensors)
    assert y.dtype == dx.dtype == dv.dtype == dtype
    with torch.autocast(device.type, dtype=dtype, enabled=False):
        y32 = ops.spmm(x.detach(), values, tensors, layer.bias.detach())
    assert y32.dtype == torch.float32
    w64 = rounded(layer.to_dense(), dtype)
    assert_close(dx, rounded(dy, dtype) @ w64, rounded(dy, dtype).abs() @ w64.abs(), dtype, "spmm_t")


def test_float64_inputs_are_left_as_they_are(device):
    """autocast leaves float64 alone: a float64 layer keeps computing in float64."""
    torch.manual_seed(2)
    layer = snack.SparseLinear(20, 9, density=0.4, device=device, dtype=torch.float64)
    x = torch.randn(4, 20, device=device, dtype=torch.float64)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float64
    assert_close(y, x.cpu() @ layer.to_dense().detach().cpu().T + layer.bias.detach().cpu(),
                 x.abs().cpu() @ layer.to_dense().detach().abs().cpu().T + 1, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,bias_group,tokens", [(None, "same", (2, 5)), ("relu", "own", (2, 5)),
                                                          ("gelu", "none", (2, 5)), (None, "own", (3, 50))])
def test_fused_adamw_equals_torch_adamw_under_autocast(device, dtype, activation, bias_group, tokens):
    """The fused step updates the float32 masters from the 16-bit gradient: the trajectory of
    torch.optim.AdamW on the same autocast layer (150 tokens: the tensor-core SDDMM on CUDA)."""
    torch.manual_seed(3)
    fused_layer = snack.SparseLinear(40, 48, density=0.2, device=device, activation=activation)
    torch_layer = copy.deepcopy(fused_layer)
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)

    def groups(layer):
        if bias_group == "same":
            return [{"params": [layer.values, layer.bias]}]
        if bias_group == "own":
            return [{"params": [layer.values]}, {"params": [layer.bias], "lr": 3e-3}]
        layer.bias.requires_grad_(False)
        return [{"params": [layer.values]}]

    fused = snack.optim.AdamW(groups(fused_layer), **hyper)
    reference = torch.optim.AdamW(groups(torch_layer), **hyper)
    gen = torch.Generator().manual_seed(4)
    for _ in range(6):
        x = torch.randn(*tokens, 40, generator=gen).to(device)
        target = torch.randn(*tokens, 48, generator=gen).to(device)
        for layer, opt in ((fused_layer, fused), (torch_layer, reference)):
            opt.zero_grad()
            with torch.autocast(device.type, dtype=dtype):
                y = layer(x)
            assert y.dtype == dtype
            ((y.float() - target) ** 2).mean().backward()
            opt.step()
        assert fused_layer.values.grad is None and fused_layer.values.dtype == torch.float32
    # The same 16-bit gradients, summed in other orders on the GPU: a 16-bit rounding apart at most.
    rtol = 1e-5 if device.type == "cpu" else tolerance(dtype)
    assert_same_values(fused_layer.values, torch_layer.values, rtol, floor=0.1, what="values")
    state, ref_state = fused.state[fused_layer.values], reference.state[torch_layer.values]
    assert state["exp_avg"].dtype == torch.float32
    assert_same_values(state["exp_avg_sq"], ref_state["exp_avg_sq"], 4 * rtol, floor=0.1, what="exp_avg_sq")
    assert_same_values(fused_layer.bias, torch_layer.bias, rtol, floor=0.1, what="bias")


def test_fused_adamw_refuses_values_of_another_16_bit_type(device):
    torch.manual_seed(5)
    layer = snack.SparseLinear(16, 8, density=0.5, device=device, dtype=torch.bfloat16)
    opt = snack.optim.AdamW(layer.parameters())  # noqa: F841  (kept alive: it fuses while it exists)
    with torch.autocast(device.type, dtype=torch.float16), pytest.raises(TypeError, match="autocast"):
        layer(torch.randn(3, 16, device=device))


def test_sddmm_adamw_op_with_float32_masters(device):
    """The op itself: 16-bit dy and x, float32 values, moments and bias, against float64."""
    torch.manual_seed(6)
    layer = snack.SparseLinear(33, 21, density=0.3, device=device)
    for dtype in DTYPES:
        dy, x = torch.randn(9, 21, device=device).to(dtype), torch.randn(9, 33, device=device).to(dtype)
        values, bias = layer.values.detach().clone(), layer.bias.detach().clone()
        m, v = torch.zeros_like(values), torch.zeros_like(values)
        bm, bv = torch.zeros_like(bias), torch.zeros_like(bias)
        step, bstep = torch.zeros((), device=device), torch.zeros((), device=device)
        hyper = [1e-2, 0.9, 0.99, 1e-6, 0.05, 0.0]
        ops.sddmm_adamw_(dy, x, layer.pattern.tensors, values, [m, v, step], hyper, [bm, bv, bstep], bias=bias,
                         bias_hyper=hyper)
        rows, cols = layer.row_idx.long().cpu(), layer.col_idx.long().cpu()
        g = (dy.double().cpu().T @ x.double().cpu())[rows, cols].to(dtype).double()
        gb = dy.double().cpu().sum(0).to(dtype).double()
        for got, start, grad in ((values, layer.values, g), (bias, layer.bias, gb)):
            p0 = start.detach().double().cpu()
            p0 = p0 - 1e-2 * 0.05 * p0
            mm, vv = 0.1 * grad, 0.01 * grad * grad
            want = p0 - 1e-2 / 0.1 * mm / (vv.sqrt() / 0.01 ** 0.5 + 1e-6)
            assert_same_values(got, want, 1e-5, floor=0.1, what=f"{dtype}")
            assert got.dtype == torch.float32
        with pytest.raises(TypeError, match="differs"):
            ops.sddmm_adamw_(dy, x.float(), layer.pattern.tensors, values, [m, v, step], hyper, [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_with_torch_adamw(device, dtype):
    """fp16 training with GradScaler: scaled backward, unscaled step, a step skipped on inf."""
    torch.manual_seed(7)
    layer = snack.SparseLinear(30, 20, density=0.3, device=device)
    twin = copy.deepcopy(layer)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    x = torch.randn(8, 30, device=device)
    with torch.autocast(device.type, dtype=dtype):
        loss = layer(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    with torch.autocast(device.type, dtype=dtype):
        twin(x).float().square().mean().backward()
    # Scaled by 2^10 in 16 bits and unscaled again: the unscaled gradient to 16-bit rounding.
    assert_same_values(layer.values.grad, twin.values.grad, 2 * tolerance(dtype), floor=1e-3, what="unscaled")
    before = layer.values.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(layer.values.detach(), before)
    opt.zero_grad()
    before = layer.values.detach().clone()
    with torch.autocast(device.type, dtype=dtype):
        loss = layer(torch.full_like(x, float("inf"))).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)  # skipped: found inf
    scaler.update()
    assert torch.equal(layer.values.detach(), before) and scaler.get_scale() < 2.0 ** 10


def test_grad_scaler_refuses_the_fused_step(device):
    torch.manual_seed(8)
    layer = snack.SparseLinear(30, 20, density=0.3, device=device)
    opt = snack.optim.AdamW(layer.parameters())
    scaler = torch.amp.GradScaler(device.type)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = layer(torch.randn(4, 30, device=device)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    opt.step()  # without the scaler the fused optimizer steps again
    opt.release()  # then torch's path works with the same optimizer object's parameters
    assert not opt._step_supports_amp_scaling


@pytest.mark.parametrize("dtype", DTYPES)
def test_compile_under_autocast(device, dtype):
    torch._dynamo.reset()
    layer, x = layer_and_input(device, "relu", (2,), 5)
    model = nn.Sequential(nn.Linear(45, 45).to(device), layer)

    def run(m):
        with torch.autocast(device.type, dtype=dtype):
            return m(x)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, ref = run(compiled), run(model)
    assert out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    out.float().sum().backward()
    g = layer.values.grad.clone()
    layer.values.grad = None
    ref.float().sum().backward()
    assert g.dtype == torch.float32 and torch.equal(g, layer.values.grad)


def test_rigl_under_autocast(device):
    """Gradient-based growth reads the captured 16-bit activations and output gradients."""
    torch.manual_seed(9)
    layer = snack.SparseLinear(40, 30, density=0.2, device=device)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    scheduler = snack.dst.DSTScheduler(layer, opt, algorithm="rigl", update_every=1, drop_fraction=0.3,
                                       drop_schedule="constant")
    before = layer.pattern.to_mask().clone()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = layer(torch.randn(6, 40, device=device)).float().square().sum()
    loss.backward()
    opt.step()
    assert scheduler.steps == 1 and not torch.equal(layer.pattern.to_mask(), before)
    snack.ops.validate_pattern(layer.pattern.tensors)
