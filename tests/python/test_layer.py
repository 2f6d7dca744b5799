"""SparseLinear: construction, forward/backward against Dense+Mask, autograd, checkpoints, conversions."""

import io

import pytest
import torch
from torch import nn

import snack
from helpers import assert_close, assert_matmul, matmul_ref


def check_layer_gradients(layer: snack.SparseLinear, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, dtype):
    """y = layer(x) and, after y.backward(grad), the gradients of x, values and bias, element-wise
    against float64 products of the layer's dense twin (each with the scale of its terms)."""
    w = layer.to_dense().detach()
    k, m = layer.in_features, layer.out_features
    x2, g2 = x.detach().reshape(-1, k), grad.reshape(-1, m)
    assert_matmul(y.reshape(-1, m), x2, w.T, dtype, bias=layer.bias.detach() if layer.bias is not None else None,
                  what="y")
    assert_matmul(x.grad.reshape(-1, k), g2, w, dtype, what="x.grad")
    full, scale = matmul_ref(g2.T, x2)
    r, c = layer.row_idx.long().cpu(), layer.col_idx.long().cpu()
    assert_close(layer.values.grad, full[r, c], scale[r, c], dtype, "values.grad")
    if layer.bias is not None:
        g64 = g2.double().cpu()
        assert_close(layer.bias.grad, g64.sum(0), g64.abs().sum(0), dtype, "bias.grad")


@pytest.mark.parametrize("shape", [(13,), (1, 13), (4, 13), (2, 3, 13), (2, 1, 5, 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_backward_match_dense_mask(device, shape, dtype, bias):
    torch.manual_seed(0)
    layer = snack.SparseLinear(13, 9, bias=bias, density=0.3, device=device, dtype=dtype)
    x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    y = layer(x)
    assert y.shape == (*shape[:-1], 9) and y.dtype == dtype
    grad = torch.randn_like(y)
    y.backward(grad)
    check_layer_gradients(layer, x, y, grad, dtype)


def test_gradcheck(device):
    torch.manual_seed(1)
    layer = snack.SparseLinear(11, 7, density=0.4, device=device, dtype=torch.float64)
    x = torch.randn(2, 3, 11, dtype=torch.float64, device=device, requires_grad=True)
    def fn(x, values, bias):
        return snack.sparse_linear(x, values, bias, layer.pattern)

    assert torch.autograd.gradcheck(fn, (x, layer.values, layer.bias))


def test_gradcheck_empty_rows_and_no_bias(device):
    rows = torch.tensor([0, 0, 3, 4, 4, 4])
    cols = torch.tensor([1, 4, 0, 2, 3, 5])
    values = torch.randn(6, dtype=torch.float64)
    layer = snack.SparseLinear.from_coo(rows, cols, values, out_features=6, in_features=7).to(device)
    x = torch.randn(5, 7, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v: snack.sparse_linear(x, v, None, layer.pattern), (x, layer.values))


def test_density_and_sparsity():
    a = snack.SparseLinear(100, 50, density=0.1)
    b = snack.SparseLinear(100, 50, sparsity=0.9)
    assert a.nnz == b.nnz == 500 and abs(a.density - 0.1) < 1e-12
    assert a.values.shape == (500,) and a.row_idx.dtype == torch.uint16
    assert snack.SparseLinear(10, 10, density=1.0).nnz == 100


def test_functional_form_takes_strided_values_and_bias(device):
    layer = snack.SparseLinear(20, 12, density=0.3, device=device, dtype=torch.float64)
    values = torch.zeros(2 * layer.nnz, device=device, dtype=torch.float64)[::2]
    values.copy_(layer.values.detach())
    bias = torch.zeros(12, 2, device=device, dtype=torch.float64)[:, 1]
    bias.copy_(layer.bias.detach())
    values.requires_grad_()
    x = torch.randn(3, 20, device=device, dtype=torch.float64)
    y = snack.sparse_linear(x, values, bias, layer.pattern)
    with torch.no_grad():
        assert torch.equal(y, layer(x))
    y.sum().backward()
    assert values.grad.shape == values.shape and values.grad.abs().sum() > 0


def test_a_density_that_keeps_no_connection_warns():
    with pytest.warns(UserWarning, match="keeps no connection"):
        layer = snack.SparseLinear(16, 8, density=1e-4)
    assert layer.nnz == 0
    torch.testing.assert_close(layer(torch.randn(3, 16)), layer.bias.expand(3, 8))


@pytest.mark.parametrize("kwargs", [{}, {"density": 0.1, "sparsity": 0.9}, {"density": 0.0}, {"density": 1.5},
                                    {"sparsity": 1.0}, {"sparsity": -0.1}])
def test_bad_density(kwargs):
    with pytest.raises(ValueError, match="density|sparsity"):
        snack.SparseLinear(10, 10, **kwargs)


def test_bad_features():
    with pytest.raises(ValueError, match="at least 1"):
        snack.SparseLinear(0, 10, density=0.5)


def test_index_dtype_selection():
    assert snack.SparseLinear(65536, 2, density=1e-4).row_idx.dtype == torch.uint16
    assert snack.SparseLinear(65537, 2, density=1e-4).row_idx.dtype == torch.int32
    assert snack.SparseLinear(30, 20, density=0.5, index_dtype=torch.int32).row_idx.dtype == torch.int32
    with pytest.raises(ValueError, match="int32"):
        snack.SparseLinear(70000, 2, density=1e-4, index_dtype=torch.uint16)
    with pytest.raises(TypeError, match="index_dtype"):
        snack.SparseLinear(30, 20, density=0.5, index_dtype=torch.int64)


def test_generator_determinism():
    a = snack.SparseLinear(40, 30, density=0.2, generator=torch.Generator().manual_seed(7))
    b = snack.SparseLinear(40, 30, density=0.2, generator=torch.Generator().manual_seed(7))
    c = snack.SparseLinear(40, 30, density=0.2, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.row_idx, b.row_idx) and torch.equal(a.values, b.values)
    assert not (torch.equal(a.row_idx, c.row_idx) and torch.equal(a.col_idx, c.col_idx))


@pytest.mark.parametrize("generator_device", ["cpu", "device"])
def test_generator_on_either_device(device, generator_device):
    """A generator on the layer's device (as "cuda", without an index) or on the CPU both work, and
    the same seed gives the same layer."""
    if generator_device == "device" and torch.device(device).type == "cpu":
        pytest.skip("on the CPU both generators are the CPU generator (the cpu case covers it)")
    gen_device = device if generator_device == "device" else "cpu"
    make = lambda seed: snack.SparseLinear(40, 30, density=0.2, device=device,  # noqa: E731
                                           generator=torch.Generator(device=gen_device).manual_seed(seed))
    a, b = make(3), make(3)
    assert a.values.device.type == torch.device(device).type
    assert torch.equal(a.row_idx, b.row_idx) and torch.equal(a.col_idx, b.col_idx)
    assert torch.equal(a.values, b.values) and torch.equal(a.bias, b.bias)
    bound = 1.0 / (0.2 * 40) ** 0.5
    assert a.values.abs().max() <= bound and a.values.std() > bound / 4


def test_init_scale():
    torch.manual_seed(0)
    layer = snack.SparseLinear(1000, 1000, density=0.04)
    bound = 1 / (0.04 * 1000) ** 0.5
    assert layer.values.abs().max() <= bound and layer.values.abs().max() > 0.9 * bound


def test_from_dense_linear_topk(device):
    torch.manual_seed(2)
    linear = nn.Linear(20, 12).to(device)
    layer = snack.SparseLinear.from_dense(linear, density=0.25)
    assert layer.nnz == 60
    w = linear.weight.detach()
    keep = torch.zeros(240, dtype=torch.bool, device=device)
    keep[w.abs().flatten().topk(60).indices] = True
    assert torch.equal(layer.mask().flatten(), keep)
    assert torch.equal(layer.to_dense(), w * keep.view(12, 20))
    assert torch.equal(layer.bias, linear.bias)
    x = torch.randn(3, 20, device=device)
    assert_matmul(layer(x), x, (w * keep.view(12, 20)).T, torch.float32, bias=linear.bias.detach())


def test_from_dense_mask_and_weight(device):
    w = torch.randn(8, 10, device=device, dtype=torch.float64)
    mask = torch.rand(8, 10, device=device) < 0.5
    layer = snack.SparseLinear.from_dense(w, mask=mask)
    assert layer.bias is None and layer.values.dtype == torch.float64
    assert torch.equal(layer.mask(), mask) and torch.equal(layer.to_dense(), w * mask)
    with pytest.raises(ValueError, match="not both"):
        snack.SparseLinear.from_dense(w, 0.5, mask=mask)
    with pytest.raises(ValueError, match="mask shape"):
        snack.SparseLinear.from_dense(w, mask=mask[:, :5])
    with pytest.raises(ValueError, match="2-D"):
        snack.SparseLinear.from_dense(w[0], 0.5)


def test_to_linear_and_back(device):
    layer = snack.SparseLinear(15, 6, density=0.5, device=device)
    linear = layer.to_linear()
    x = torch.randn(4, 15, device=device)
    assert_matmul(layer(x), x, linear.weight.detach().T, torch.float32, bias=linear.bias.detach())
    again = snack.SparseLinear.from_dense(linear, mask=layer.mask())
    assert torch.equal(again.values, layer.values) and torch.equal(again.row_idx, layer.row_idx)


def test_from_coo_sorts_and_validates(device):
    rows = torch.tensor([2, 0, 1, 0])
    cols = torch.tensor([1, 3, 0, 0])
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], device=device)
    layer = snack.SparseLinear.from_coo(rows, cols, values, 3, 4)
    assert layer.row_idx.tolist() == [0, 0, 1, 2] and layer.col_idx.tolist() == [0, 3, 0, 1]
    assert layer.values.tolist() == [4.0, 2.0, 3.0, 1.0]
    with pytest.raises(IndexError, match=r"rows\[1\]=3"):
        snack.SparseLinear.from_coo(torch.tensor([0, 3]), torch.tensor([0, 0]), values[:2], 3, 4)
    with pytest.raises(IndexError, match=r"cols\[0\]=-1"):
        snack.SparseLinear.from_coo(torch.tensor([0, 1]), torch.tensor([-1, 0]), values[:2], 3, 4)
    with pytest.raises(ValueError, match=r"\(0, 1\) appears more than once"):
        snack.SparseLinear.from_coo(torch.tensor([0, 1, 0]), torch.tensor([1, 1, 1]), values[:3], 3, 4)
    with pytest.raises(ValueError, match="one entry per position"):
        snack.SparseLinear.from_coo(rows, cols, values[:3], 3, 4)
    with pytest.raises(ValueError, match="same|elements"):
        snack.ops.slots_from_coo(torch.tensor([0, 1]), torch.tensor([0]), 3, 4)
    with pytest.raises(TypeError, match="integer"):
        snack.ops.slots_from_coo(torch.tensor([0.0]), torch.tensor([0]), 3, 4)


def test_from_dense_errors(device):
    w = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="nnz=13"):
        snack.ops.slots_from_dense(w, 13)
    bad = w.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite entry at \(1, 2\)"):
        snack.SparseLinear.from_dense(bad, 0.5)


def test_op_argument_errors(device):
    layer = snack.SparseLinear(10, 6, density=0.5, device=device)
    with pytest.raises(ValueError, match="in_features=10"):
        layer(torch.randn(3, 9, device=device))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.randn(3, 10, device=device, dtype=torch.float64))
    pattern = layer.pattern.tensors
    with pytest.raises(ValueError, match="values has 5 elements"):
        snack.ops.spmm(torch.randn(3, 10, device=device), layer.values[:5], pattern, None)
    with pytest.raises(ValueError, match="bias has 5"):
        snack.ops.spmm(torch.randn(3, 10, device=device), layer.values, pattern, torch.randn(5, device=device))
    with pytest.raises(TypeError, match="int32"):
        snack.ops.spmm(torch.randn(3, 10, device=device), layer.values,
                       [t.long() if name == "row_ptr" else t for name, t in zip(snack.PATTERN_FIELDS, pattern)], None)
    with pytest.raises(ValueError, match=f"pattern must hold {len(snack.PATTERN_FIELDS)} tensors"):
        snack.ops.spmm(torch.randn(3, 10, device=device), layer.values, pattern[:4], None)
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        snack.ops.spmm(torch.randn(3, 10, device=device).to(torch.int32), layer.values.to(torch.int32), pattern, None)
    with pytest.raises(TypeError, match="differs from the weight dtype"):
        snack.ops.spmm(torch.randn(3, 10, device=device).half(), layer.values.bfloat16(), pattern, None)


@pytest.mark.cuda
def test_wrong_device():
    layer = snack.SparseLinear(10, 6, density=0.5, device="cuda")
    with pytest.raises(ValueError, match="cpu"):
        layer(torch.randn(3, 10))


def test_state_dict_round_trip(device):
    torch.manual_seed(3)
    layer = snack.SparseLinear(30, 20, density=0.2, device=device)
    sd = layer.state_dict()
    assert set(sd) == {"values", "bias", "pattern.row_idx", "pattern.col_idx"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    other = snack.SparseLinear(30, 20, density=0.2, generator=torch.Generator().manual_seed(99))
    values_param = other.values
    other.load_state_dict(torch.load(buf))
    assert other.values is values_param, "the Parameter keeps its identity"
    for name in ("values", "bias"):
        assert torch.equal(getattr(other, name).cpu(), getattr(layer, name).cpu()), name
    for name in snack.PATTERN_FIELDS:
        assert torch.equal(getattr(other.pattern, name).cpu(), getattr(layer.pattern, name).cpu()), name
    x = torch.randn(4, 30)
    assert torch.equal(other(x), layer.cpu()(x)), "the same weight computes the same on the CPU"


def test_load_state_dict_rejects_bad_pattern_and_keeps_layer():
    layer = snack.SparseLinear(8, 5, density=0.3)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    sd = layer.state_dict()
    bad = dict(sd)
    bad["pattern.col_idx"] = sd["pattern.col_idx"].clone()
    bad["pattern.col_idx"][0] = 8  # out of range: in_features=8
    with pytest.raises(RuntimeError, match="outside"):  # torch's error list, as for a size mismatch
        layer.load_state_dict(bad)
    dup = dict(sd)
    dup["pattern.row_idx"], dup["pattern.col_idx"] = sd["pattern.row_idx"].clone(), sd["pattern.col_idx"].clone()
    dup["pattern.row_idx"][1], dup["pattern.col_idx"][1] = dup["pattern.row_idx"][0], dup["pattern.col_idx"][0]
    with pytest.raises(RuntimeError, match="more than once"):
        layer.load_state_dict(dup)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(RuntimeError, match="nnz"):
        snack.SparseLinear(8, 5, density=0.5).load_state_dict(sd)


def test_load_unsorted_checkpoint_sorts_values():
    layer = snack.SparseLinear(6, 4, density=0.5)
    sd = layer.state_dict()
    perm = torch.randperm(layer.nnz)
    shuffled = {**sd, "values": sd["values"][perm], "pattern.row_idx": sd["pattern.row_idx"][perm],
                "pattern.col_idx": sd["pattern.col_idx"][perm]}
    other = snack.SparseLinear(6, 4, density=0.5)
    other.load_state_dict(shuffled)
    assert torch.equal(other.to_dense(), layer.to_dense())


def test_load_checkpoint_with_the_slots_at_the_layer():
    # Checkpoints written before the pattern was a module of its own: row_idx and col_idx at the layer.
    layer = snack.SparseLinear(6, 4, density=0.5)
    sd = layer.state_dict()
    old = {"values": sd["values"], "bias": sd["bias"], "row_idx": sd["pattern.row_idx"],
           "col_idx": sd["pattern.col_idx"]}
    other = snack.SparseLinear(6, 4, density=0.5, generator=torch.Generator().manual_seed(5))
    other.load_state_dict(old)
    assert torch.equal(other.to_dense(), layer.to_dense())


def test_a_pattern_alone_refuses_unsorted_slots():
    layer = snack.SparseLinear(6, 4, density=0.5)
    sd = layer.pattern.state_dict()
    flipped = {name: sd[name].int().flip(0) for name in ("row_idx", "col_idx")}
    with pytest.raises(RuntimeError, match="not sorted"):
        layer.pattern.load_state_dict(flipped)
    assert torch.equal(layer.pattern.row_idx, sd["row_idx"])


def test_to_dtype_keeps_indices(device):
    layer = snack.SparseLinear(12, 7, density=0.5).to(device)
    layer64 = layer.to(torch.float64)
    assert layer64.values.dtype == torch.float64 and layer64.row_idx.dtype == torch.uint16
    assert layer64.pattern.row_ptr.dtype == torch.int32 and layer64.values.device.type == device.type
    x = torch.randn(3, 12, dtype=torch.float64, device=device)
    assert_matmul(layer64(x), x, layer64.to_dense().detach().T, torch.float64, bias=layer64.bias.detach())


@pytest.mark.cuda
def test_state_dict_across_devices():
    layer = snack.SparseLinear(25, 14, density=0.3)
    gpu = snack.SparseLinear(25, 14, density=0.3, device="cuda")
    gpu.load_state_dict(layer.state_dict())
    assert gpu.values.device.type == "cuda" and torch.equal(gpu.to_dense().cpu(), layer.to_dense())
    back = snack.SparseLinear(25, 14, density=0.3)
    back.load_state_dict(gpu.state_dict())
    assert torch.equal(back.to_dense(), layer.to_dense())
    x = torch.randn(5, 25)
    assert_matmul(gpu(x.cuda()), x, layer.to_dense().detach().T, torch.float32, bias=layer.bias.detach())


def test_training_reduces_loss(device):
    torch.manual_seed(4)
    teacher = snack.SparseLinear(32, 8, density=0.25, device=device)
    student = snack.SparseLinear.from_dense(teacher.to_dense().detach() * 0, mask=teacher.mask(),
                                            bias=torch.zeros(8, device=device))
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    x = torch.randn(256, 32, device=device)
    target = teacher(x).detach()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((student(x) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fused_activation_forward_backward(device, activation):
    torch.manual_seed(5)
    layer = snack.SparseLinear(40, 24, density=0.3, device=device, dtype=torch.float64, activation=activation)
    assert f"activation={activation}" in repr(layer)
    x = torch.randn(3, 7, 40, dtype=torch.float64, device=device, requires_grad=True)
    y = layer(x)
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    w64, b64 = layer.to_dense().detach().double().cpu(), layer.bias.detach().double().cpu()
    x64 = x.detach().cpu().requires_grad_()
    ref = act(nn.functional.linear(x64, w64, b64))
    _, scale = matmul_ref(x.detach().reshape(-1, 40), w64.T)
    scale = 1.2 * (scale + b64.abs()).reshape(ref.shape)  # both activations have slope below 1.2
    assert_close(y, ref.detach(), scale, torch.float64, "y")
    with torch.no_grad():  # the fully fused inference path
        assert_close(layer(x), ref.detach(), scale, torch.float64, "y at inference")
    # The gradients through the activation: torch's float64 autograd of the dense twin.
    grad = torch.randn_like(y)
    y.backward(grad)
    w_ref = w64.clone().requires_grad_()
    b_ref = b64.clone().requires_grad_()
    x_ref = x.detach().cpu().requires_grad_()
    act(nn.functional.linear(x_ref, w_ref, b_ref)).backward(grad.cpu())
    r, c = layer.row_idx.long().cpu(), layer.col_idx.long().cpu()
    for got, want in ((x.grad, x_ref.grad), (layer.values.grad, w_ref.grad[r, c]), (layer.bias.grad, b_ref.grad)):
        assert_close(got, want, torch.ones_like(want), torch.float64)
    xs = torch.randn(2, 40, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, b: snack.sparse_linear(x, v, b, layer.pattern, activation=activation),
                                    (xs, layer.values, layer.bias))


def test_bad_activation():
    with pytest.raises(ValueError, match="activation"):
        snack.SparseLinear(4, 4, density=0.5, activation="tanh")
    layer = snack.SparseLinear(4, 4, density=0.5)
    with pytest.raises(ValueError, match="unknown activation"):
        snack.sparse_linear(torch.randn(2, 4), layer.values, None, layer.pattern, activation="swish")


def test_counting_rules_are_the_libraries():
    # nnz at a density and the index width: the C++ rules, the same from Python and libtorch.
    assert snack.nnz_for_density(5, 1, 0.5) == 3  # 2.5 rounds up
    assert snack.SparseLinear(1, 5, density=0.5).nnz == 3
    assert snack.nnz_for_density(3, 3, 1 / 3) == 3
    assert snack.default_index_dtype(65536, 1) == torch.uint16 and snack.default_index_dtype(65537, 1) == torch.int32
    with pytest.raises(ValueError, match="density"):
        snack.nnz_for_density(3, 3, 1.5)
