"""Training-step properties: AdamW trajectories equal Dense+Mask restricted to the mask, CUDA-graph
capture of a whole step, and no dense-sized buffer during a step."""

import copy

import pytest
import torch
from torch import nn

import snack
from helpers import assert_same_values
from snack.benchmark import capture_graph


def make_pair(device, dtype, m=48, k=40, density=0.2, seed=0):
    torch.manual_seed(seed)
    layer = snack.SparseLinear(k, m, density=density, device=device, dtype=dtype)
    mask = layer.mask().to(dtype)
    dense_w = nn.Parameter(layer.to_dense().detach().clone())
    dense_b = nn.Parameter(layer.bias.detach().clone())
    return layer, mask, dense_w, dense_b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_trajectory_equals_dense_mask(device, dtype):
    layer, mask, dense_w, dense_b = make_pair(device, dtype)
    opt_s = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    opt_d = torch.optim.AdamW([dense_w, dense_b], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        x = torch.randn(6, 40, generator=gen, dtype=dtype).to(device)
        target = torch.randn(6, 48, generator=gen, dtype=dtype).to(device)
        for opt, fwd in ((opt_s, layer), (opt_d, lambda x: nn.functional.linear(x, dense_w * mask, dense_b))):
            opt.zero_grad()
            ((fwd(x) - target) ** 2).mean().backward()
            opt.step()
    rows, cols = layer.row_idx.long(), layer.col_idx.long()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # Element-wise, relative to |value| + 0.1: AdamW's terms are of order 1 even where a value is not.
    assert_same_values(layer.values, dense_w.detach()[rows, cols], tol, floor=0.1)
    assert_same_values(layer.bias, dense_b, tol, floor=0.1)
    # Outside the mask the Dense+Mask weight only decays from zero: it stays zero.
    assert torch.count_nonzero(dense_w.detach() * (1 - mask)) == 0


def squared_error_step(layer, opt, x, target):
    """One training step on a squared error; the gradients stay allocated (a captured graph reuses them)."""
    opt.zero_grad(set_to_none=False)
    ((layer(x) - target) ** 2).mean().backward()
    opt.step()


@pytest.mark.cuda
def test_cuda_graph_capture_of_a_training_step():
    layers = []
    for _ in range(2):
        torch.manual_seed(3)
        layers.append(snack.SparseLinear(300, 200, density=0.1, device="cuda", activation="relu"))
    eager, captured = layers
    x = torch.randn(16, 300, device="cuda")
    target = torch.randn(16, 200, device="cuda")
    opts = [torch.optim.AdamW(lyr.parameters(), lr=1e-3, capturable=True) for lyr in layers]
    graph = capture_graph(lambda: squared_error_step(captured, opts[1], x, target), warmup=3)
    for _ in range(3):
        graph.replay()
    for _ in range(6):
        squared_error_step(eager, opts[0], x, target)
    torch.cuda.synchronize()
    # The same kernels on the same inputs: bitwise equal, replayed or not.
    assert torch.equal(captured.values, eager.values) and torch.equal(captured.bias, eager.bias)


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_cuda_graph_stays_valid_across_topology_updates(algorithm):
    """A captured step replays correctly after the topology changed: the update rewrites the slot
    arrays, views and optimizer state in place."""
    torch.manual_seed(5)
    layer = snack.SparseLinear(96, 64, density=0.15, device="cuda")
    twin = copy.deepcopy(layer)
    x, target = torch.randn(8, 96, device="cuda"), torch.randn(8, 64, device="cuda")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, capturable=True)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, capturable=True)

    def step(lyr, o):
        squared_error_step(lyr, o, x, target)

    graph = capture_graph(lambda: step(layer, opt), warmup=2)
    for _ in range(2):
        step(twin, twin_opt)
    graph.replay()
    step(twin, twin_opt)
    for update in range(3):
        k = layer.nnz // 4
        gen = torch.Generator(device="cuda").manual_seed(update)
        drop = snack.dst.prune_magnitude(layer, k)
        grow = (snack.dst.grow_random(layer, k, gen) if algorithm == "set"
                else snack.dst.grow_gradient(layer, k, x, torch.randn(8, 64, device="cuda", generator=gen)))
        for lyr, o in ((layer, opt), (twin, twin_opt)):
            lyr.update_topology(drop, grow, optimizer=o)
        graph.replay()
        step(twin, twin_opt)
        torch.cuda.synchronize()
        assert torch.equal(layer.row_idx, twin.row_idx) and torch.equal(layer.col_idx, twin.col_idx)
        assert torch.equal(layer.values, twin.values)
    assert torch.equal(layer(x), twin(x))


@pytest.mark.cuda
def test_no_dense_sized_buffer_during_a_step():
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    layer = snack.SparseLinear(4096, 4096, density=0.01, device="cuda")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(16, 4096, device="cuda")
    for _ in range(2):  # optimizer state exists from here on
        opt.zero_grad()
        layer(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    opt.zero_grad()
    layer(x).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    dense_weight_bytes = 4096 * 4096 * 4
    # Everything the step holds at once (values, grads, moments, indices, activations, workspaces) stays
    # far below a single dense weight (64 MiB): no dense buffer is ever materialised.
    assert peak < dense_weight_bytes / 8, f"peak {peak / 2**20:.1f} MiB during a step"
