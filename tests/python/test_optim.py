"""snack.optim.AdamW (the update of SparseLinear values fused into their backward) and the op under
it, snack.ops.sddmm_adamw_: trajectories equal torch.optim.AdamW (and Dense+Mask), every SDDMM
kernel forced against a float64 reference, the guards, checkpoints, DST, CUDA graphs, compile."""

import copy

import pytest
import torch
from torch import nn

import snack
from helpers import Weight, assert_close, assert_same_values, ops, tolerance
from snack.benchmark import capture_graph

HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


# AdamW's arithmetic mixes terms of order 1 (values, moments) even where a result is near zero: the
# element-wise bounds below are relative to |result| + UPDATE_FLOOR.
UPDATE_FLOOR = 0.1


def close(got, want, dtype=torch.float32, what=""):
    """Two trajectories of one computation in other roundings: element-wise within the dtype's
    tolerance (float64: 1e-12) of |want| + UPDATE_FLOOR."""
    assert_same_values(got, want, 1e-12 if dtype == torch.float64 else 1e-5, floor=UPDATE_FLOOR, what=what)


def sddmm_adamw(dy, x, tensors, values, exp_avg, exp_avg_sq, step, hyper, maximize=False, variant="auto", bias=None,
                **kwargs):
    """snack.ops.sddmm_adamw_ with AdamW's settings as (lr, beta1, beta2, eps, weight_decay) and
    maximize; bias: None or (bias, exp_avg, exp_avg_sq, step, its six settings)."""
    settings = [*hyper, float(maximize)]
    if bias is None:
        ops.sddmm_adamw_(dy, x, tensors, values, [exp_avg, exp_avg_sq, step], settings, [], variant=variant, **kwargs)
    else:
        b, bm, bv, bstep, bhyper = bias
        ops.sddmm_adamw_(dy, x, tensors, values, [exp_avg, exp_avg_sq, step], settings, [bm, bv, bstep], bias=b,
                         bias_hyper=list(bhyper), variant=variant, **kwargs)


def twin_layers(device, dtype=torch.float32, m=48, k=40, density=0.2, activation=None, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = snack.SparseLinear(k, m, density=density, device=device, dtype=dtype, activation=activation, bias=bias)
    return layer, copy.deepcopy(layer)


def step(layer, opt, x, target):
    opt.zero_grad()
    ((layer(x) - target) ** 2).mean().backward()
    opt.step()


def batches(count, n, k, m, dtype, device, seed=1, lead=()):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*lead, n, k, generator=gen, dtype=torch.float64).to(device, dtype),
             torch.randn(*lead, n, m, generator=gen, dtype=torch.float64).to(device, dtype)) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation,bias,lead,n,maximize",
                         [(None, True, (), 6, False), ("relu", False, (), 1, False), ("gelu", True, (2,), 5, True),
                          (None, True, (), 16, False), (None, True, (), 40, False)])
def test_trajectory_equals_torch_adamw(device, dtype, activation, bias, lead, n, maximize):
    fused_layer, torch_layer = twin_layers(device, dtype, activation=activation, bias=bias)
    fused = snack.optim.AdamW(fused_layer.parameters(), maximize=maximize, **HYPER)
    reference = torch.optim.AdamW(torch_layer.parameters(), maximize=maximize, **HYPER)
    for x, target in batches(10, n, 40, 48, dtype, device, lead=lead):
        step(fused_layer, fused, x, target)
        step(torch_layer, reference, x, target)
        assert fused_layer.values.grad is None  # the gradients of values and bias are never stored
        assert fused_layer.bias is None or fused_layer.bias.grad is None
    state, ref_state = fused.state[fused_layer.values], reference.state[torch_layer.values]
    close(fused_layer.values, torch_layer.values, dtype, "values")
    close(state["exp_avg"], ref_state["exp_avg"], dtype, "exp_avg")
    close(state["exp_avg_sq"], ref_state["exp_avg_sq"], dtype, "exp_avg_sq")
    assert float(state["step"]) == 10.0 and state["step"].device == fused_layer.values.device
    if bias:
        close(fused_layer.bias, torch_layer.bias, dtype, "bias")


def test_bias_in_its_own_group(device):
    """A common set-up: no weight decay and another learning rate for biases. The bias, updated in
    the backward too, follows its own group's settings; a frozen bias is left alone."""
    fused_layer, torch_layer = twin_layers(device)

    def groups(layer):
        return [{"params": [layer.values]}, {"params": [layer.bias], "weight_decay": 0.0, "lr": 3e-2}]

    fused = snack.optim.AdamW(groups(fused_layer), **HYPER)
    reference = torch.optim.AdamW(groups(torch_layer), **HYPER)
    for x, target in batches(8, 6, 40, 48, torch.float32, device):
        step(fused_layer, fused, x, target)
        step(torch_layer, reference, x, target)
    assert fused_layer.bias.grad is None
    close(fused_layer.bias, torch_layer.bias)
    close(fused_layer.values, torch_layer.values)
    fused_layer.bias.requires_grad_(False)
    frozen = fused_layer.bias.detach().clone()
    step(fused_layer, fused, x, target)
    assert torch.equal(fused_layer.bias, frozen)


def test_trajectory_equals_dense_mask(device):
    """The issue's statement: a 10-step AdamW trajectory equals Dense+Mask AdamW restricted to the mask."""
    layer, _ = twin_layers(device)
    mask = layer.mask().float()
    dense_w = nn.Parameter(layer.to_dense().detach().clone())
    dense_b = nn.Parameter(layer.bias.detach().clone())
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    opt_d = torch.optim.AdamW([dense_w, dense_b], **HYPER)
    for x, target in batches(10, 6, 40, 48, torch.float32, device):
        step(layer, opt, x, target)
        step(lambda x: nn.functional.linear(x, dense_w * mask, dense_b), opt_d, x, target)
    rows, cols = layer.row_idx.long(), layer.col_idx.long()
    close(layer.values, dense_w.detach()[rows, cols])
    close(layer.bias, dense_b)


def test_other_parameters_step_as_torch_adamw(device):
    torch.manual_seed(2)
    model = nn.Sequential(snack.SparseLinear(20, 30, density=0.3, device=device), nn.ReLU(),
                          nn.Linear(30, 7, device=device))
    twin = copy.deepcopy(model)
    opt = snack.optim.AdamW(model.parameters(), **HYPER)
    ref = torch.optim.AdamW(twin.parameters(), **HYPER)
    for x, target in batches(5, 9, 20, 7, torch.float32, device):
        step(model, opt, x, target)
        step(twin, ref, x, target)
    for p, q in zip(model.parameters(), twin.parameters()):
        close(p, q)
    assert model[2].weight.grad is not None and model[0].values.grad is None


def test_second_backward_before_step_raises(device):
    layer, _ = twin_layers(device)
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    (x, target), (x2, _) = batches(2, 6, 40, 48, torch.float32, device)
    ((layer(x) - target) ** 2).mean().backward()
    after_first = layer.values.detach().clone()
    with pytest.raises(RuntimeError, match="already updated"):
        ((layer(x2) - target) ** 2).mean().backward()
    assert torch.equal(layer.values.detach(), after_first)  # no second update
    opt.step()
    step(layer, opt, x, target)  # after step() the next backward updates again
    assert not torch.equal(layer.values.detach(), after_first)


def test_layer_applied_twice_raises(device):
    layer = snack.SparseLinear(16, 16, density=0.5, device=device)
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)  # noqa: F841 (attached to the layer while it lives)
    x = torch.randn(3, 16, device=device)
    with pytest.raises(RuntimeError):
        layer(layer(x)).sum().backward()


def test_no_update_without_gradient(device):
    layer, _ = twin_layers(device)
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    before = layer.values.detach().clone()
    x = torch.randn(4, 40, device=device)
    with torch.no_grad():
        layer(x)
    assert not opt.state  # nothing created by an inference forward
    layer.values.requires_grad_(False)
    layer(x).sum().backward()  # only the bias learns
    opt.step()
    assert torch.equal(layer.values, before) and layer.values not in opt.state
    assert layer.bias.grad is not None


def test_bias_updated_in_the_backward_has_no_autograd_edge(device):
    """A parameter updated by the backward gets no gradient; it must not have an autograd edge
    either (an AccumulateGrad node that only ever receives an undefined gradient breaks CUDA-graph
    capture in torch 2.11, pytorch#189371). When the values do not learn, the op cannot update the
    bias in a backward that may never run: the bias then takes its usual gradient."""
    layer, _ = twin_layers(device)
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    x = torch.randn(4, 40, device=device)
    y = layer(x)
    leaves = [fn.variable for fn, _ in y.grad_fn.next_functions if fn is not None and hasattr(fn, "variable")]
    assert any(v is layer.values for v in leaves) and not any(v is layer.bias for v in leaves)
    y.sum().backward()
    assert layer.bias.grad is None and layer.values.grad is None
    opt.step()

    values = layer.values.detach().clone()
    bias_state = opt.state[layer.bias]
    y = ops.sparse_linear_adamw(x, values, layer.bias, layer.pattern.tensors,
                                [torch.zeros_like(values), torch.zeros_like(values), torch.zeros((), device=device)],
                                [1e-2, 0.9, 0.999, 1e-8, 0.0, 0.0],
                                [bias_state["exp_avg"], bias_state["exp_avg_sq"], bias_state["step"]],
                                bias_hyper=[1e-2, 0.9, 0.999, 1e-8, 0.0, 0.0])
    y.sum().backward()
    assert torch.equal(layer.bias.grad, torch.full_like(layer.bias, 4.0))


def test_bias_state_is_given_whole_or_not_at_all(device):
    layer, _ = twin_layers(device)
    state = [torch.zeros_like(layer.values), torch.zeros_like(layer.values), torch.zeros((), device=device)]
    args = (torch.randn(4, 40, device=device), layer.values, layer.bias, layer.pattern.tensors, state,
            [1e-2, 0.9, 0.999, 1e-8, 0.0, 0.0])
    zeros = torch.zeros_like(layer.bias)
    bias_state = [zeros, zeros.clone(), torch.zeros((), device=device)]
    for x_grad in (False, True):  # checked with and without a backward to run
        with torch.set_grad_enabled(x_grad):
            with pytest.raises(ValueError, match="together"):
                ops.sparse_linear_adamw(*args, bias_state)
            with pytest.raises(ValueError, match="bias_hyper six numbers"):
                ops.sparse_linear_adamw(*args, bias_state, bias_hyper=[1e-2, 0.9])
            with pytest.raises(ValueError, match="only with a bias"):
                ops.sparse_linear_adamw(args[0], args[1], None, *args[3:], bias_state,
                                        bias_hyper=[1e-2, 0.9, 0.999, 1e-8, 0.0, 0.0])


def test_checkpoints_load_across_torch_and_snack(device):
    fused_layer, torch_layer = twin_layers(device)
    fused = snack.optim.AdamW(fused_layer.parameters(), **HYPER)
    reference = torch.optim.AdamW(torch_layer.parameters(), **HYPER)
    data = batches(6, 6, 40, 48, torch.float32, device)
    for x, target in data[:3]:
        step(fused_layer, fused, x, target)
        step(torch_layer, reference, x, target)
    # Swap: torch's state (step on the CPU) into snack's optimizer, and snack's into torch's.
    a_layer, b_layer = copy.deepcopy(torch_layer), copy.deepcopy(fused_layer)
    a = snack.optim.AdamW(a_layer.parameters(), **HYPER)
    a.load_state_dict(copy.deepcopy(reference.state_dict()))  # as from a saved checkpoint
    b = torch.optim.AdamW(b_layer.parameters(), **HYPER)
    b.load_state_dict(copy.deepcopy(fused.state_dict()))
    for x, target in data[3:]:
        for lyr, o in ((fused_layer, fused), (torch_layer, reference), (a_layer, a), (b_layer, b)):
            step(lyr, o, x, target)
    for lyr in (torch_layer, a_layer, b_layer):
        close(lyr.values, fused_layer.values)


def test_learning_rate_is_read_from_the_current_param_groups(device):
    """A scheduler (or load_state_dict) changes the group's lr: the next fused update uses it."""
    layer, _ = twin_layers(device)
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    (x, target), (x2, t2) = batches(2, 6, 40, 48, torch.float32, device)
    step(layer, opt, x, target)
    sched.step()  # lr is now 0: no change at all (the decay is lr * weight_decay too)
    before = layer.values.detach().clone()
    step(layer, opt, x2, t2)
    assert torch.equal(layer.values.detach(), before)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()) | {"param_groups": [dict(g, lr=1e-2) for g in opt.state_dict()["param_groups"]]})
    step(layer, opt, x, target)
    assert not torch.equal(layer.values.detach(), before)


def test_topology_update_remaps_the_fused_state(device):
    fused_layer, torch_layer = twin_layers(device, density=0.3)
    fused = snack.optim.AdamW(fused_layer.parameters(), **HYPER)
    reference = torch.optim.AdamW(torch_layer.parameters(), **HYPER)
    data = batches(6, 6, 40, 48, torch.float32, device)
    for i, (x, target) in enumerate(data):
        step(fused_layer, fused, x, target)
        step(torch_layer, reference, x, target)
        if i in (1, 3):
            k = fused_layer.nnz // 5
            gen = torch.Generator(device=device).manual_seed(i)
            drop = snack.dst.prune_magnitude(fused_layer, k)
            grow = snack.dst.grow_random(fused_layer, k, gen)
            fused_layer.update_topology(drop, grow, optimizer=fused)
            torch_layer.update_topology(drop, grow, optimizer=reference)
    assert torch.equal(fused_layer.row_idx, torch_layer.row_idx)
    close(fused_layer.values, torch_layer.values)
    close(fused.state[fused_layer.values]["exp_avg_sq"], reference.state[torch_layer.values]["exp_avg_sq"])


def test_dst_scheduler_drives_layers_updated_in_the_backward(device):
    """RigL captures dY through a hook on the layer's output, which the fused op keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    snack.sparsify(model, 0.2)
    opt = snack.optim.AdamW(model.parameters(), lr=1e-2)
    dst = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=5, end=40, drop_fraction=0.3,
                                 generator=torch.Generator(device=device).manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen).to(device), torch.randint(0, 10, (64,), generator=gen).to(device)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert sum(entry["moved"] for entry in dst.report()) > 0
    assert all(m.values.grad is None for m in model if isinstance(m, snack.SparseLinear))


def test_compile_falls_back_to_the_stored_gradient(device):
    torch._dynamo.reset()
    fused_layer, torch_layer = twin_layers(device)
    fused = snack.optim.AdamW(fused_layer.parameters(), **HYPER)
    reference = torch.optim.AdamW(torch_layer.parameters(), **HYPER)
    compiled = torch.compile(fused_layer, fullgraph=True, backend="aot_eager")
    for x, target in batches(3, 6, 40, 48, torch.float32, device):
        step(compiled, fused, x, target)
        step(torch_layer, reference, x, target)
    close(fused_layer.values, torch_layer.values)


def test_rejects_a_tensor_learning_rate():
    layer = snack.SparseLinear(8, 8, density=0.5)
    with pytest.raises(ValueError, match="lr must be a number"):
        snack.optim.AdamW(layer.parameters(), lr=torch.tensor(1e-3))
    opt = snack.optim.AdamW([layer.values])
    with pytest.raises(ValueError, match="lr must be a number"):
        opt.add_param_group({"params": [layer.bias], "lr": torch.tensor(1e-3)})
    assert len(opt.param_groups) == 1  # the rejected group was not added


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["float32", "autocast_bf16"])
def test_cuda_graph_capture_of_a_fused_step(precision):
    # Every parameter here is updated in the backward, so none receives a gradient: under
    # compute-sanitizer torch cannot capture such a backward (scripts/repro_capture_memcheck.py,
    # torch only); scripts/gpu_check.sh leaves this test out of its memcheck run. autocast_bf16:
    # the standard mixed-precision step (autocast's cache off, as capture requires).
    eager, captured = twin_layers("cuda", activation="relu", density=0.1, m=200, k=300)
    x, target = torch.randn(16, 300, device="cuda"), torch.randn(16, 200, device="cuda")
    opts = [snack.optim.AdamW(lyr.parameters(), capturable=True, **HYPER) for lyr in (eager, captured)]

    def fused_step(layer, opt):
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=precision != "float32"):
            y = layer(x)
        ((y.float() - target) ** 2).mean().backward()
        opt.step()

    graph = capture_graph(lambda: fused_step(captured, opts[1]), warmup=3)
    for _ in range(3):
        graph.replay()
    for _ in range(6):
        fused_step(eager, opts[0])
    torch.cuda.synchronize()
    assert float(opts[1].state[captured.values]["step"]) == 6.0
    assert torch.equal(captured.values, eager.values) and torch.equal(captured.bias, eager.bias)


@pytest.mark.cuda
@pytest.mark.parametrize("activation,lead,n", [(None, (), 16), ("relu", (), 12), ("gelu", (2,), 8), (None, (), 40)])
def test_fused_step_reads_the_forward_copy_of_x(activation, lead, n):
    """Where the forward transposes the whole batch (global_xt, one batch tile), the backward's fused
    update reads that copy of X^T instead of transposing X again: one transpose in the step, and the
    update bitwise that of sddmm_adamw_ transposing X itself."""
    k, m = 2048, 2304  # enough output rows for one batch tile of 16-64 rows
    torch.manual_seed(0)
    layer = snack.SparseLinear(k, m, density=0.02, device="cuda", activation=activation)
    rows = n * (lead[0] if lead else 1)
    plan = snack.explain(layer, rows)
    if not (plan.variant == "global_xt" and plan.batch_tile >= rows):
        pytest.skip(f"this GPU splits the batch into tiles here: {plan}")  # a device with many more SMs than 132
    opt = snack.optim.AdamW(layer.parameters(), **HYPER)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(*lead, n, k, generator=gen).cuda(), torch.randn(*lead, n, m, generator=gen).cuda()
    # The reference: dY through the activation as autograd forms it, then the op on the same state.
    pattern = layer.pattern.tensors
    values, bias = layer.values.detach().clone(), layer.bias.detach().clone()
    x2, g2 = x.reshape(-1, k), g.reshape(-1, m)
    if activation == "relu":
        dy = torch.ops.aten.threshold_backward(g2, ops.spmm(x2, values, pattern, bias, "relu"), 0)
    elif activation == "gelu":
        dy = torch.ops.aten.gelu_backward(g2, ops.spmm(x2, values, pattern, bias))
    else:
        dy = g2
    lr, (beta1, beta2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    state = [torch.zeros_like(values), torch.zeros_like(values), torch.zeros((), device="cuda")]
    bias_state = [torch.zeros_like(bias), torch.zeros_like(bias), torch.zeros((), device="cuda")]
    sddmm_adamw(dy.contiguous(), x2, pattern, values, *state, (lr, beta1, beta2, eps, wd),
                bias=(bias, *bias_state, [lr, beta1, beta2, eps, wd, 0.0]))

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.zero_grad()
        (layer(x) * g).sum().backward()
        opt.step()
        torch.cuda.synchronize()
    fused = opt.state[layer.values]
    assert torch.equal(layer.values.detach(), values) and torch.equal(layer.bias.detach(), bias)
    assert torch.equal(fused["exp_avg"], state[0]) and torch.equal(fused["exp_avg_sq"], state[1])
    kernels = {e.key: e.count for e in prof.key_averages() if "snack::cuda" in e.key}  # snack's kernels
    if not kernels:
        pytest.skip("the profiler recorded no kernels (under compute-sanitizer)")
    assert sum(c for name, c in kernels.items() if "transpose_tile_kernel" in name) == 1, kernels


# ---- the op: snack.ops.sddmm_adamw_ ----------------------------------------------------------------

def reference_update(p, dy, x, values, m, v, step, lr, beta1, beta2, eps, wd, maximize, dtype, grad=None):
    """float64 AdamW from the float64 SDDMM, the gradient rounded to `dtype` first as a stored one would be;
    or from `grad`, a gradient the library stored."""
    if grad is None:
        dense = dy.double().t() @ x.double()
        g = dense[p.row_idx.long().cpu(), p.col_idx.long().cpu()].to(dtype).double()
    else:
        g = grad.double().cpu()
    if maximize:
        g = -g
    values, m, v = values.double(), m.double(), v.double()
    values = values - lr * wd * values
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    return values - lr / (1 - beta1 ** step) * m / denom, m, v


SHAPES = [  # m, k, nnz, n, empty rows
    (37, 29, 300, 1, 3), (37, 29, 300, 3, 0), (64, 53, 900, 5, 4), (130, 77, 2000, 16, 7), (33, 1, 20, 40, 0),
    (70, 90, 1500, 130, 2), (5, 7, 0, 4, 0), (300, 77, 5000, 6, 9),  # the last: dense_blocks in 3 blocks
]


def sddmm_case(device, shape, dtype, variant):
    """The pattern, dy and x of one of SHAPES; skips a forced rows kernel past its largest batch."""
    m, k, nnz, n, empty = shape
    if variant == "rows" and n > 128:
        pytest.skip("rows runs batches up to 128")
    if variant == "staged" and dtype != torch.float32:
        pytest.skip("staged runs float32 operands")
    if variant in ("tensor_core", "tile_view", "tile_view_wgmma") and dtype not in (torch.bfloat16, torch.float16):
        pytest.skip(f"{variant} runs 16-bit operands")
    if variant in ("tile_view", "tile_view_wgmma") and n > 128:
        pytest.skip(f"{variant} runs batches up to 128")
    if variant == "tile_view_wgmma" and not (device.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("tile_view_wgmma runs on Hopper")
    p = Weight(m, k, nnz, device=device, dtype=dtype, seed=m + n, empty_rows=empty)
    return p, p.randn(n, m, seed=1), p.randn(n, k, seed=2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["auto", "slot", "vector", "rows", "dense_blocks", "staged", "tensor_core",
                                     "tile_view", "tile_view_wgmma"])
def test_sddmm_adamw_op(device, shape, dtype, variant):
    n = shape[3]
    if device.type == "cpu" and (variant not in ("auto", "dense_blocks") or dtype in (torch.bfloat16, torch.float16) and n > 5):
        pytest.skip("the CPU runs its loops or dense blocks; the 16-bit types once")
    p, dy, x = sddmm_case(device, shape, dtype, variant)
    gen = torch.Generator().manual_seed(3)
    values = p.values.clone()
    exp_avg = torch.randn(p.nnz, generator=gen).to(device, dtype)
    exp_avg_sq = torch.rand(p.nnz, generator=gen).to(device, dtype)
    step = torch.full((), 4.0, device=device)
    hyper = (1e-2, 0.9, 0.99, 1e-6, 0.05)
    # A gradient summed over 130 terms can land on the other side of a 16-bit rounding than the
    # float64 one (tensor cores add in their own order), and the update then moves by more than its
    # tolerance: each element must match the update from the float64 gradient rounded once, or the
    # one from the gradient the same kernel stores (itself checked against float64 in the SDDMM tests).
    stored = ops.sddmm(dy, x, p.tensors, variant=variant)
    for maximize in (False, True):
        args = (p, dy.cpu(), x.cpu(), values.cpu(), exp_avg.cpu(), exp_avg_sq.cpu(), float(step) + 1, *hyper, maximize,
                dtype)
        ref, from_stored = reference_update(*args), reference_update(*args, grad=stored)
        sddmm_adamw(dy, x, p.tensors, values, exp_avg, exp_avg_sq, step, hyper, maximize, variant)
        for got, want, alt, what in zip((values, exp_avg, exp_avg_sq), ref, from_stored,
                                        ("values", "exp_avg", "exp_avg_sq")):
            tol = adamw_tolerance(dtype) * (want.abs() + UPDATE_FLOOR)
            got64 = got.double().cpu()
            assert bool(torch.isfinite(got64).all()), what
            assert bool(((got64 - want).abs() <= tol).logical_or((got64 - alt).abs() <= tol).all()), \
                (what, float(torch.minimum((got64 - want).abs() - tol, (got64 - alt).abs() - tol).max()))
        values, exp_avg, exp_avg_sq = (t.to(dtype) for t in ref)  # the next round starts from the reference
        values, exp_avg, exp_avg_sq = (t.to(device).contiguous() for t in (values, exp_avg, exp_avg_sq))
    assert float(step) == 6.0


@pytest.mark.cuda
@pytest.mark.parametrize("n", [2, 16, 40])
def test_sddmm_adamw_is_bitwise_reproducible_and_matches_sddmm(n):
    """Same inputs, same bits; and the fused update equals the unfused one (sddmm, then the same math)."""
    p = Weight(300, 200, 6000, device="cuda", seed=n, empty_rows=5)
    dy, x = p.randn(n, 300, seed=1), p.randn(n, 200, seed=2)
    start = [p.values.clone(), torch.randn_like(p.values), torch.rand_like(p.values)]
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01)
    results = []
    for _ in range(2):
        state = [t.clone() for t in start] + [torch.zeros((), device="cuda")]
        sddmm_adamw(dy, x, p.tensors, *state, hyper)
        results.append(state)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    cpu_state = [t.cpu().clone() for t in start] + [torch.zeros(())]
    grad = ops.sddmm(dy, x, p.tensors).cpu()
    cpu_p = Weight(300, 200, 6000, device="cpu", seed=n, empty_rows=5)
    assert_close(grad, *cpu_p.slot_ref(dy, x), torch.float32)
    sddmm_adamw(dy.cpu(), x.cpu(), cpu_p.tensors, *cpu_state, hyper)
    for got, want in zip(results[0][:3], cpu_state[:3]):
        close(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4, 7, 8, 12, 16, 32])
def test_sddmm_adamw_rows_and_vector_agree(n):
    """The automatic choice of the fused update switches between the rows and the vector kernel by
    batch size (the rows kernel holds 4 slots per lane up to a batch of 16, 8 above). Their plain
    SDDMMs are bitwise equal up to a batch of 32 (test_kernels_cuda.py); with AdamW's epilogue they
    agree to fp32 rounding, not bitwise (measured on the H200)."""
    p = Weight(300, 700, 20000, device="cuda", seed=n, empty_rows=9)
    dy, x = p.randn(n, 300, seed=5), p.randn(n, 700, seed=6)
    start = [p.values.clone(), torch.randn_like(p.values), torch.rand_like(p.values)]
    results = {}
    for variant in ("rows", "vector"):
        state = [t.clone() for t in start] + [torch.zeros((), device="cuda")]
        sddmm_adamw(dy, x, p.tensors, *state, (1e-2, 0.9, 0.99, 1e-6, 0.05), variant=variant)
        results[variant] = state[:3]
    for a, b in zip(results["rows"], results["vector"]):
        close(a, b)


def reference_bias_update(dy, bias, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd, maximize, dtype,
                          grad=None):
    """float64 AdamW of a bias from dy.sum(0), the gradient rounded to `dtype` first as a stored one would be;
    or from `grad`, a gradient the library stored."""
    g = (dy.double().sum(0).to(dtype) if grad is None else grad).double().cpu()
    if maximize:
        g = -g
    b, ma, v = bias.double().cpu(), exp_avg.double().cpu(), exp_avg_sq.double().cpu()
    b = b - lr * wd * b
    ma = beta1 * ma + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return b - lr / (1 - beta1 ** step) * ma / (v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps), ma, v


def adamw_tolerance(dtype):
    """The update's error against a float64 one from the same rounded gradient: one rounding of each
    state in the 16-bit types."""
    return 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,m", [(1, 37), (6, 130), (0, 9), (3, 0), (3001, 70)])
def test_bias_grad_adamw_op(device, dtype, n, m):
    gen = torch.Generator().manual_seed(n + m)
    dy = torch.randn(n, m, generator=gen, dtype=torch.float64).to(device, dtype)
    bias = torch.randn(m, generator=gen, dtype=torch.float64).to(device, dtype)
    exp_avg = torch.randn(m, generator=gen).to(device, dtype)
    exp_avg_sq = torch.rand(m, generator=gen).to(device, dtype)
    step = torch.full((), 2.0, device=device)
    hyper = (1e-2, 0.9, 0.99, 1e-6, 0.05)
    want = reference_bias_update(dy, bias, exp_avg, exp_avg_sq, 3, *hyper, False, dtype)
    ops.bias_grad_adamw_(dy, bias, [exp_avg, exp_avg_sq, step], [*hyper, 0.0])
    assert float(step) == 3.0
    for got, ref in zip((bias, exp_avg, exp_avg_sq), want):
        assert_same_values(got, ref, adamw_tolerance(dtype), floor=UPDATE_FLOOR)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["auto", "slot", "vector", "rows", "dense_blocks", "staged", "tensor_core",
                                     "tile_view", "tile_view_wgmma"])
def test_sddmm_adamw_updates_the_bias_in_the_same_pass(device, shape, dtype, variant):
    """With the bias's state, sddmm_adamw_ also updates the bias from dy.sum(0) (inside the rows
    kernel; after the product for the others) with its own settings and count, and the values
    exactly as without it."""
    m = shape[0]
    if device.type == "cpu" and variant not in ("auto", "dense_blocks"):
        pytest.skip("the CPU runs its loops or dense blocks")
    p, dy, x = sddmm_case(device, shape, dtype, variant)
    gen = torch.Generator().manual_seed(4)
    start = [p.values.clone(), torch.randn(p.nnz, generator=gen).to(device, dtype),
             torch.rand(p.nnz, generator=gen).to(device, dtype)]
    bias = torch.randn(m, generator=gen).to(device, dtype)
    bias_m, bias_v = torch.randn(m, generator=gen).to(device, dtype), torch.rand(m, generator=gen).to(device, dtype)
    hyper, bias_hyper = (1e-2, 0.9, 0.99, 1e-6, 0.05), (3e-2, 0.8, 0.95, 1e-5, 0.1)
    # A sum of 130 terms can cancel, and the last bits of the gradient then move the update by more
    # than the tolerance: each element must match the update from the gradient rounded once, or the one
    # from the gradient that the bias kernel stores (the kernel the variants other than rows run).
    stored = ops.bias_grad(dy)
    for maximize in (False, True):
        want = reference_bias_update(dy, bias, bias_m, bias_v, 8, *bias_hyper, maximize, dtype)
        from_stored = reference_bias_update(dy, bias, bias_m, bias_v, 8, *bias_hyper, maximize, dtype, grad=stored)
        alone = [t.clone() for t in start] + [torch.full((), 2.0, device=device)]
        sddmm_adamw(dy, x, p.tensors, *alone, hyper, variant=variant)
        fused = [t.clone() for t in start] + [torch.full((), 2.0, device=device)]
        bias_step = torch.full((), 7.0, device=device)
        sddmm_adamw(dy, x, p.tensors, *fused, hyper, variant=variant,
                    bias=(bias, bias_m, bias_v, bias_step, [*bias_hyper, float(maximize)]))
        assert float(fused[3]) == 3.0 and float(bias_step) == 8.0
        for a, b in zip(alone, fused):
            assert torch.equal(a, b)
        for got, ref, alt in zip((bias, bias_m, bias_v), want, from_stored):
            tol = adamw_tolerance(dtype) * (ref.abs() + UPDATE_FLOOR)
            got64 = got.double().cpu()
            assert bool(((got64 - ref).abs() <= tol).logical_or((got64 - alt).abs() <= tol).all()), \
                float(torch.minimum((got64 - ref).abs() - tol, (got64 - alt).abs() - tol).max())
        bias, bias_m, bias_v = (t.to(device, dtype) for t in want)


def test_sddmm_adamw_checks_its_arguments(device):
    p = Weight(11, 13, 40, device=device, seed=3)
    dy, x = p.randn(5, 11, seed=1), p.randn(5, 13, seed=2)
    m, v = torch.zeros_like(p.values), torch.zeros_like(p.values)
    step = torch.zeros((), device=device)
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0]
    with pytest.raises(TypeError, match="step must be float32"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step.double()], hyper, [])
    with pytest.raises(ValueError, match="exp_avg has 39 elements"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m[1:], v, step], hyper, [])
    with pytest.raises(ValueError, match="shares memory"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [p.values, v, step], hyper, [])
    with pytest.raises(ValueError, match="invalid beta2"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], [1e-3, 0.9, 1.0, 1e-8, 0.0, 0.0], [])
    with pytest.raises(ValueError, match="state holds exp_avg, exp_avg_sq and step"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v], hyper, [])
    with pytest.raises(ValueError, match="dy has 5 rows but x has 4"):
        ops.sddmm_adamw_(dy, x[:4], p.tensors, p.values, [m, v, step], hyper, [])
    bias, bias_m, bias_v = p.randn(11, seed=4), torch.zeros(11, device=device), torch.zeros(11, device=device)
    bias_step = torch.zeros((), device=device)
    bias_state = [bias_m, bias_v, bias_step]
    with pytest.raises(ValueError, match="together"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, bias_state, bias=bias)
    with pytest.raises(ValueError, match="bias has 10 elements"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, bias_state, bias=bias[1:], bias_hyper=hyper)
    with pytest.raises(ValueError, match="distinct"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, [bias_m, bias_v, step], bias=bias,
                         bias_hyper=hyper)
    with pytest.raises(ValueError, match="bias hyper holds"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, bias_state, bias=bias, bias_hyper=[1e-3])
    with pytest.raises(ValueError, match="invalid beta1"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, bias_state, bias=bias,
                         bias_hyper=[1e-3, 1.5, 0.999, 1e-8, 0.0, 0.0])
    with pytest.raises(TypeError, match="bias dtype"):
        ops.sddmm_adamw_(dy, x, p.tensors, p.values, [m, v, step], hyper, bias_state, bias=bias.double(),
                         bias_hyper=hyper)
    assert float(step) == 0.0 and float(bias_step) == 0.0  # nothing changed by a rejected call


def test_opcheck_sddmm_adamw(device):
    p = Weight(11, 13, 40, device=device, seed=3, empty_rows=2)
    dy, x = p.randn(5, 11, seed=1), p.randn(5, 13, seed=2)
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0]
    state = [torch.zeros_like(p.values), torch.zeros_like(p.values), torch.zeros((), device=device)]
    args = (dy, x, p.tensors, p.values.clone(), state, hyper, [])
    torch.library.opcheck(ops.sddmm_adamw_.default, args)
    bias = p.randn(11, seed=4)
    bias_state = [torch.zeros_like(bias), torch.zeros_like(bias), torch.zeros((), device=device)]
    torch.library.opcheck(ops.sddmm_adamw_.default, (dy, x, p.tensors, p.values.clone(), state, hyper, bias_state),
                          dict(bias=bias.clone(), bias_hyper=hyper))
    torch.library.opcheck(ops.bias_grad_adamw_.default, (dy, bias, bias_state, hyper))
    layer_args = (x, p.values, None, p.tensors, state, hyper, [], torch.zeros(1, dtype=torch.int64))
    # Its backward updates the optimizer's tensors, which the schema of the forward cannot declare:
    # checked without AOT dispatch (compile takes the stored-gradient path, test above).
    torch.library.opcheck(ops.sparse_linear_adamw.default, layer_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_the_fused_update_is_attached_to_the_layer_and_released(device):
    """The layer holds the update it runs (layer.fused_update); a later snack.optim.AdamW over the same
    values takes it over, and release() hands the layer back to gradients for another optimizer."""
    layer, twin = twin_layers(device)
    first = snack.optim.AdamW(layer.parameters(), **HYPER)
    assert layer.fused_update is not None and twin.fused_update is None
    second = snack.optim.AdamW(layer.parameters(), **HYPER)
    x, target = batches(1, 6, 40, 48, torch.float32, device)[0]
    step(layer, second, x, target)
    assert layer.values not in first.state and layer.values in second.state
    first.release()  # not its update any more: nothing changes
    assert layer.fused_update is not None
    second.release()
    assert layer.fused_update is None
    reference = torch.optim.AdamW(layer.parameters(), **HYPER)
    step(layer, reference, x, target)
    assert layer.values.grad is not None  # the backward returns the gradient again


def test_an_update_whose_optimizer_is_gone_says_so(device):
    layer, _ = twin_layers(device)
    snack.optim.AdamW(layer.parameters(), **HYPER)  # dropped at once: the layer keeps a weak reference
    import gc
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        layer(torch.randn(2, 40, device=device)).sum().backward()
    layer.attach_fused_update(None)
    layer(torch.randn(2, 40, device=device)).sum().backward()
    assert layer.values.grad is not None
