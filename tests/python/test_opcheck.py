"""torch.library.opcheck on every operator (schema, autograd registration, fake kernels, AOT dispatch),
and the layer under torch.compile(fullgraph=True)."""

import pytest
import torch

import snack
from helpers import Weight, assert_close, ops


def sample_weight(device, dtype=torch.float32, itype=None):
    return Weight(11, 13, 40, device=device, dtype=dtype, index_dtype=itype, seed=3, empty_rows=2)


@pytest.mark.parametrize("itype", [torch.uint16, torch.int32])
def test_opcheck_compute_ops(device, itype):
    p = sample_weight(device, itype=itype)
    x, dy = p.randn(5, 13, seed=1), p.randn(5, 11, seed=2)
    bias = p.randn(11, seed=3)
    torch.library.opcheck(ops.spmm.default, (x, p.values, p.tensors, bias))
    torch.library.opcheck(ops.spmm.default, (x, p.values, p.tensors, None))
    torch.library.opcheck(ops.spmm.default, (x, p.values, p.tensors, bias), {"activation": "gelu"})
    torch.library.opcheck(ops.spmm_t.default, (dy, p.values, p.tensors))
    images = p.randn(2, 13, 9, seed=6)
    torch.library.opcheck(ops.spmm_channels_first.default, (images, p.values, p.tensors, bias), {"activation": "relu"})
    torch.library.opcheck(ops.spmm_channels_first.default, (images, p.values, p.tensors, None))
    torch.library.opcheck(ops.sddmm.default, (dy, x, p.tensors))
    torch.library.opcheck(ops.bias_grad.default, (dy,))
    half = sample_weight(device, dtype=torch.bfloat16, itype=itype)
    tiles = ops.pack_tile_values(half.values, half.tensors)
    torch.library.opcheck(ops.pack_tile_values.default, (half.values, half.tensors))
    torch.library.opcheck(ops.spmm.default, (x.bfloat16(), half.values, half.tensors, None), {"tiles": tiles})
    fragments = ops.pack_tile_fragments(half.values, half.tensors)
    torch.library.opcheck(ops.pack_tile_fragments.default, (half.values, half.tensors))
    torch.library.opcheck(ops.spmm.default, (x.bfloat16(), half.values, half.tensors, None), {"tiles": fragments})
    # The forward of a fused step and its update: the copy of X^T it may hand over has a shape only
    # the device's plan knows, so only the schema and the autograd registration are checked.
    utils = ("test_schema", "test_autograd_registration")
    torch.library.opcheck(ops.spmm_for_step.default, (x, p.values, p.tensors, bias), test_utils=utils)
    state = [torch.zeros_like(p.values), torch.zeros_like(p.values), torch.zeros((), device=device)]
    hyper = [1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.0]
    torch.library.opcheck(ops.sddmm_adamw_.default, (dy, x, p.tensors, p.values.clone(), state, hyper, []),
                          test_utils=utils)


@pytest.mark.parametrize("shape", [(5, 13), (2, 3, 13)])
def test_opcheck_sparse_linear(device, shape):
    p = sample_weight(device, dtype=torch.float64)
    x = p.randn(*shape, seed=4).requires_grad_()
    values = p.values.clone().requires_grad_()
    bias = p.randn(11, seed=5).requires_grad_()
    torch.library.opcheck(ops.sparse_linear.default, (x, values, bias, p.tensors))
    torch.library.opcheck(ops.sparse_linear.default, (x, values, None, p.tensors))
    for activation in ("relu", "gelu"):
        torch.library.opcheck(ops.sparse_linear.default, (x, values, bias, p.tensors), {"activation": activation})


def test_opcheck_topology_ops(device):
    rows = torch.tensor([3, 0, 2, 0], device=device)
    cols = torch.tensor([1, 2, 0, 0], device=device)
    torch.library.opcheck(ops.slots_from_coo.default, (rows, cols, 4, 3), {"index_dtype": torch.int32})
    dense = torch.randn(6, 7, device=device)
    torch.library.opcheck(ops.slots_from_dense.default, (dense, 10))
    torch.library.opcheck(ops.slots_from_mask.default, (dense > 0,),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    r, c, _ = ops.slots_from_coo(rows, cols, 4, 3)
    torch.library.opcheck(ops.build_views.default, (r, c, 4, 3))
    torch.library.opcheck(ops.random_slots.default, (5, 6, 7), {"device": device},
                          test_utils=("test_schema", "test_autograd_registration"))


def test_compile_fullgraph_forward_backward(device):
    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = snack.SparseLinear(24, 10, density=0.3, device=device)
    model = torch.nn.Sequential(layer, torch.nn.ReLU(), torch.nn.Linear(10, 3).to(device))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 24, device=device)
    out, ref = compiled(x), model(x)
    assert torch.equal(out, ref), "the same kernels run, compiled or not"
    out.sum().backward()
    g_compiled = layer.values.grad.clone()
    layer.values.grad = None
    ref.sum().backward()
    assert torch.equal(g_compiled, layer.values.grad)


@pytest.mark.cuda
def test_compile_fullgraph_inductor_on_gpu():
    """The default backend (Inductor, Triton on the GPU) around the custom ops, with no graph break."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = snack.SparseLinear(40, 24, density=0.2, device="cuda", activation="relu")
    model = torch.nn.Sequential(layer, torch.nn.Linear(24, 3).to("cuda"))
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(7, 40, device="cuda")
    out, ref = compiled(x), model(x)
    # Inductor may fuse the dense layer's epilogue differently: torch's own rounding of it.
    assert_close(out, ref, ref.abs() + 1, torch.float32)
    out.square().sum().backward()
    g_compiled = layer.values.grad.clone()
    layer.values.grad = None
    ref.square().sum().backward()
    assert_close(g_compiled, layer.values.grad, layer.values.grad.abs() + 1, torch.float32)


def test_opcheck_dst_ops(device):
    # Every check, fake kernels included: their outputs' sizes are given by k.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    layer = snack.SparseLinear(9, 7, density=0.4, device=device)
    score = torch.rand(layer.nnz, device=device)
    torch.library.opcheck(ops.prune_slots.default, (score, 3), test_utils=utils)
    torch.library.opcheck(ops.sample_absent.default, (layer.row_idx, layer.col_idx, 7, 9, 4), test_utils=utils)
    torch.library.opcheck(ops.topk_absent_gradient.default,
                          (torch.randn(3, 7, device=device), torch.randn(3, 9, device=device), layer.row_idx,
                           layer.col_idx, 4, 2), test_utils=utils)
    drop = ops.prune_slots(score, 3)
    grow = ops.sample_absent(layer.row_idx, layer.col_idx, 7, 9, 3)
    torch.library.opcheck(ops.replace_slots.default, (layer.row_idx, layer.col_idx, drop, grow, 7, 9), test_utils=utils)
    new_rows, new_cols, source = ops.replace_slots(layer.row_idx, layer.col_idx, drop, grow, 7, 9)
    torch.library.opcheck(ops.remap_slots_.default, (layer.values.detach().clone(), source, torch.zeros((), device=device)),
                          test_utils=utils)
