"""Dynamic sparse training: topology primitives, optimizer state following its connection, SET and
RigL against a Dense+Mask reference of the same rules, sparsify, checkpoint/resume."""

import copy
import gc
import math

import pytest
import torch
from torch import nn

import snack
from helpers import assert_matmul, assert_same_values

ops = snack.ops


def dense_map(layer, per_slot):
    out = torch.zeros(layer.out_features, layer.in_features, dtype=per_slot.dtype, device=per_slot.device)
    out[layer.row_idx.long(), layer.col_idx.long()] = per_slot
    return out


# ---- primitives ------------------------------------------------------------------------------------
def test_prune_slots_lowest_scores_ties_to_lower_slot(device):
    score = torch.tensor([3.0, 1.0, 2.0, 1.0, 0.5, 1.0], device=device)
    assert ops.prune_slots(score, 3).tolist() == [1, 3, 4]
    assert ops.prune_slots(score, 0).numel() == 0
    with pytest.raises(ValueError, match="k=7"):
        ops.prune_slots(score, 7)


def test_update_is_the_same_with_int32_and_uint16_indices(device):
    layers = [snack.SparseLinear(50, 40, density=0.2, device=device, index_dtype=t,
                                 generator=torch.Generator().manual_seed(0)) for t in (torch.uint16, torch.int32)]
    for step in range(3):
        gen = [torch.Generator(device=device).manual_seed(step) for _ in layers]
        for layer, g in zip(layers, gen):
            drop = snack.dst.prune_magnitude(layer, 100)
            layer.update_topology(drop, snack.dst.grow_random(layer, 100, g))
        assert torch.equal(layers[0].row_idx.long(), layers[1].row_idx.long())
        assert torch.equal(layers[0].col_idx.long(), layers[1].col_idx.long())
        assert torch.equal(layers[0].values, layers[1].values)
        keys = layers[1].row_idx.long() * 50 + layers[1].col_idx.long()
        assert bool((keys[1:] > keys[:-1]).all())


@pytest.mark.parametrize("m,n", [(65535, 32768), (65536, 32768), (100000, 100000)])
def test_sample_and_replace_with_64_bit_positions(m, n):
    # Matrices with 2^31 - 32768, 2^31 and 10^10 positions: 32-bit and 64-bit position keys.
    total = m * n
    gen = torch.Generator().manual_seed(0)
    pos = torch.unique(torch.cat([torch.randint(0, total, (5000,), generator=gen), torch.tensor([0, total - 1])]))
    rows, cols = (pos // n).int(), (pos % n).int()
    got = ops.sample_absent(rows, cols, m, n, 1000, generator=torch.Generator().manual_seed(3))
    assert torch.unique(got).numel() == 1000 and not torch.isin(got, pos).any()
    assert got.min() >= 0 and got.max() < total
    new_rows, new_cols, source = ops.replace_slots(rows, cols, torch.arange(1000), got, m, n, True)
    expected = torch.sort(torch.cat([pos[1000:], got])).values
    assert torch.equal(new_rows.long() * n + new_cols.long(), expected)
    kept = source >= 0
    assert torch.equal(pos[source[kept]], (new_rows.long() * n + new_cols.long())[kept])


def test_grow_gradient_with_nan_and_inf_gradients(device):
    # NaN scores (inf * 0) count as 0 and inf scores rank first: the result stays k valid, distinct,
    # absent positions (it feeds the trusted update path).
    layer = snack.SparseLinear(16, 12, density=0.25, device=device, generator=torch.Generator().manual_seed(2))
    x = torch.randn(4, 16, device=device)
    dy = torch.randn(4, 12, device=device)
    x[0, 3], dy[0, :] = float("inf"), 0.0  # column 3: inf * 0 = NaN in every row
    dy[1, 5] = float("inf")  # row 5: inf where x[1] is non-zero
    for block_rows in (0, 1, 5):
        got = snack.dst.grow_gradient(layer, 60, x, dy, block_rows=block_rows).cpu()
        present = (layer.row_idx.long() * 16 + layer.col_idx.long()).cpu()
        assert got.numel() == 60 and torch.unique(got).numel() == 60
        assert not torch.isin(got, present).any() and got.min() >= 0 and got.max() < 16 * 12
        inf_positions = torch.tensor([5 * 16 + c for c in range(16) if c != 3 and x[1, c] != 0])
        absent_inf = inf_positions[~torch.isin(inf_positions, present)]
        assert torch.isin(absent_inf, got).all()


def test_prune_slots_nan_counts_as_inf(device):
    score = torch.tensor([float("nan"), 1.0, float("inf"), 0.0, 2.0], device=device)
    assert ops.prune_slots(score, 3).tolist() == [1, 3, 4]
    assert ops.prune_slots(score, 4).tolist() == [0, 1, 3, 4]  # NaN and inf tie: the lower slot first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 31, 4096, 4097, 5001, 100_003])
def test_prune_slots_matches_stable_sort(device, dtype, n):
    # Many chunks of the device's ordered write, heavy ties, negative scores, -0.0 and NaN: the k
    # lowest, ties to the lower slot, exactly as a stable sort orders them.
    gen = torch.Generator().manual_seed(n)
    score = (torch.randint(-50, 50, (n,), generator=gen).to(dtype) / 8)
    score[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = float("nan")
    score[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = -0.0
    clean = torch.where(score.isnan(), torch.tensor(float("inf"), dtype=dtype), score)
    order = torch.sort(clean, stable=True).indices
    for k in sorted({1, n // 3 + 1, n // 2, n - 1, n} - {0}):
        got = ops.prune_slots(score.to(device), k).cpu()
        assert torch.equal(got, torch.sort(order[:k]).values), k


def test_sample_absent_many_positions_sparse_regime(device):
    # 108000 absent positions, k = 13000 (the candidate-drawing path at scale): distinct and absent.
    rows, cols = ops.random_slots(300, 400, 12000, generator=torch.Generator().manual_seed(1))
    rows, cols = rows.to(device), cols.to(device)
    gen = torch.Generator(device=device).manual_seed(2)
    got = ops.sample_absent(rows, cols, 300, 400, 13000, generator=gen).cpu()
    present = (rows.long() * 400 + cols.long()).cpu()
    assert got.numel() == 13000 and torch.equal(got, torch.sort(got).values)
    assert torch.unique(got).numel() == 13000 and not torch.isin(got, present).any()
    assert got.min() >= 0 and got.max() < 300 * 400


def test_sample_absent_with_the_pattern_seed(device):
    # The pattern and the regrowth drawn from generators seeded alike (the same seed for the layer
    # and for DST is common): the candidates must not replay the pattern's own draws.
    for seed in range(20):
        rows, cols = ops.random_slots(192, 64, 1229, generator=torch.Generator().manual_seed(seed))
        rows, cols = rows.to(device), cols.to(device)
        got = ops.sample_absent(rows, cols, 192, 64, 92, generator=torch.Generator(device=device).manual_seed(seed))
        assert torch.unique(got).numel() == 92
        assert not torch.isin(got.cpu(), (rows.long() * 64 + cols.long()).cpu()).any()


@pytest.mark.parametrize("m,k,nnz,grow", [(30, 40, 100, 50), (6, 5, 20, 9), (50, 60, 10, 2990)])
def test_sample_absent(device, m, k, nnz, grow):
    layer = snack.SparseLinear(k, m, density=nnz / (m * k), device=device)
    gen = torch.Generator(device=device).manual_seed(3)
    pos = ops.sample_absent(layer.row_idx, layer.col_idx, m, k, grow, generator=gen)
    present = set((layer.row_idx.long() * k + layer.col_idx.long()).tolist())
    got = pos.tolist()
    assert len(got) == grow == len(set(got)) and not present & set(got) and all(0 <= p < m * k for p in got)
    again = ops.sample_absent(layer.row_idx, layer.col_idx, m, k, grow, generator=torch.Generator(device=device).manual_seed(3))
    assert torch.equal(pos, again)
    with pytest.raises(ValueError, match="absent"):
        ops.sample_absent(layer.row_idx, layer.col_idx, m, k, m * k - layer.nnz + 1)


def test_sample_absent_is_uniform_over_a_small_matrix():
    layer = snack.SparseLinear.from_coo(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.ones(2), 2, 3)
    counts = torch.zeros(6)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[ops.sample_absent(layer.row_idx, layer.col_idx, 2, 3, 2, generator=gen)] += 1
    freq = counts[[1, 2, 3, 4]] / 3000  # absent positions, each chosen with probability 2/4
    assert counts[0] == 0 and counts[5] == 0 and torch.all((freq - 0.5).abs() < 0.05), freq


@pytest.mark.parametrize("block_rows", [0, 1, 7])
def test_topk_absent_gradient_ties_at_zero_across_blocks(device, block_rows):
    # Zero input columns give exactly-zero scores; k exceeds the non-zero ones, so the k-th score
    # is a tie at 0 spread over every block: the smaller positions must win.
    layer = snack.SparseLinear(24, 20, density=0.2, device=device, generator=torch.Generator().manual_seed(4))
    x = torch.randn(6, 24, device=device)
    x[:, 5:] = 0
    dy = torch.randn(6, 20, device=device)
    score = (dy.t() @ x).abs().flatten()
    score[layer.row_idx.long() * 24 + layer.col_idx.long()] = -1
    k = 200
    assert int((score > 0).sum()) < k
    ref = torch.sort(torch.sort(score.cpu(), stable=True, descending=True).indices[:k]).values
    got = snack.dst.grow_gradient(layer, k, x, dy, block_rows=block_rows)
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("block_rows", [0, 1, 3, 1024])
def test_topk_absent_gradient_matches_dense(device, block_rows):
    torch.manual_seed(0)
    layer = snack.SparseLinear(17, 11, density=0.3, device=device, dtype=torch.float64)
    x = torch.randn(5, 17, dtype=torch.float64, device=device)
    dy = torch.randn(5, 11, dtype=torch.float64, device=device)
    got = snack.dst.grow_gradient(layer, 20, x, dy, block_rows=block_rows)
    score = (dy.t() @ x).abs().flatten()
    score[(layer.row_idx.long() * 17 + layer.col_idx.long())] = -1
    ref = torch.sort(torch.sort(score, stable=True, descending=True).indices[:20]).values
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [5, 300])
def test_topk_absent_gradient_of_16bit_operands(device, dtype, n):
    # A layer under autocast: dY in 16 bits, X in fp32 (a LayerNorm's output) cast to dY's dtype.
    # Integer operands make every product and sum exact in fp32 in any order, so the selection must
    # equal the float64 reference exactly, ties included; above 256 rows on the GPU the blocks are
    # 16-bit GEMMs (a bf16 accumulation would round these sums, up to 2700, and fail).
    gen = torch.Generator().manual_seed(n)
    layer = snack.SparseLinear(50, 40, density=0.2, device=device, generator=gen)
    x = torch.randint(-3, 4, (n, 50), generator=gen).float().to(device)
    dy = torch.randint(-3, 4, (n, 40), generator=gen).to(device=device, dtype=dtype)
    k = 150
    score = (dy.double().t() @ x.double()).abs().flatten()
    score[layer.row_idx.long() * 50 + layer.col_idx.long()] = -1
    ref = torch.sort(torch.sort(score.cpu(), stable=True, descending=True).indices[:k]).values
    for block_rows in (0, 7):
        got = snack.dst.grow_gradient(layer, k, x, dy, block_rows=block_rows)
        assert torch.equal(got.cpu(), ref), f"block_rows={block_rows}"


def test_topk_absent_gradient_ties_to_smaller_position():
    layer = snack.SparseLinear.from_coo(torch.tensor([0]), torch.tensor([1]), torch.ones(1, dtype=torch.float64), 2, 3)
    x = torch.ones(1, 3, dtype=torch.float64)
    dy = torch.ones(1, 2, dtype=torch.float64)  # every |gradient| is 1
    assert snack.dst.grow_gradient(layer, 3, x, dy, block_rows=1).tolist() == [0, 2, 3]


# ---- update_topology ---------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_update_topology_moves_values_grads_and_optimizer_state(device, opt_name):
    torch.manual_seed(1)
    layer = snack.SparseLinear(30, 20, density=0.25, device=device, dtype=torch.float64)
    values_param = layer.values
    opt = (torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(layer.parameters(), lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        layer(torch.randn(8, 30, dtype=torch.float64, device=device)).square().sum().backward()
        opt.step()
    states = {k: v.clone() for k, v in opt.state[layer.values].items() if torch.is_tensor(v) and v.shape == layer.values.shape}
    assert states
    before_w, before_g = layer.to_dense().detach().clone(), dense_map(layer, layer.values.grad)
    before_s = {k: dense_map(layer, v) for k, v in states.items()}
    drop = snack.dst.prune_magnitude(layer, 30)
    dropped = set((layer.row_idx.long()[drop] * 30 + layer.col_idx.long()[drop]).tolist())
    grow = snack.dst.grow_random(layer, 30, torch.Generator(device=device).manual_seed(2))
    assert layer.update_topology(drop, grow, optimizer=opt) == 30
    assert layer.values is values_param and layer.nnz == 150
    after_w, after_g = layer.to_dense().detach(), dense_map(layer, layer.values.grad)
    keys = (layer.row_idx.long() * 30 + layer.col_idx.long())
    assert torch.all(keys[1:] > keys[:-1]), "slots stay sorted row-major"
    new = torch.zeros(20 * 30, dtype=torch.bool, device=device)
    new[grow] = True
    new = new.view(20, 30)
    kept = layer.mask() & ~new
    assert torch.equal(after_w[kept], before_w[kept]) and torch.all(after_w[new] == 0)
    assert torch.equal(after_g[kept], before_g[kept]) and torch.all(after_g[new] == 0)
    for key, before in before_s.items():
        after = dense_map(layer, opt.state[layer.values][key])
        assert torch.equal(after[kept], before[kept]) and torch.all(after[new] == 0), key
    removed = torch.zeros(600, dtype=torch.bool, device=device)
    removed[list(dropped - set(grow.tolist()))] = True
    assert not torch.any(layer.mask().flatten() & removed)
    for name, view in zip(snack.PATTERN_FIELDS[2:], ops.build_views(layer.row_idx, layer.col_idx, 20, 30),
                          strict=True):
        assert torch.equal(view, getattr(layer.pattern, name)), name


def test_update_topology_errors_leave_layer_unchanged(device):
    layer = snack.SparseLinear(10, 8, density=0.3, device=device)
    opt = torch.optim.Adam(layer.parameters())
    snapshot = {k: v.clone() for k, v in layer.state_dict().items()}
    present = (layer.row_idx.long() * 10 + layer.col_idx.long())
    absent = torch.tensor([p for p in range(80) if p not in set(present.tolist())][:2], device=device)
    cases = [
        (torch.tensor([0, 0]), absent, "repeated slots"),
        (torch.tensor([0, 1]), torch.stack([absent[0], absent[0]]), "repeated positions"),
        (torch.tensor([0, 1]), torch.stack([absent[0], present[5]]), "stays connected"),
        (torch.tensor([0, 99]), absent, "drop slots"),
        (torch.tensor([0, 1]), torch.tensor([0, 80]), "grow positions"),
        (torch.tensor([0]), absent, "nnz never changes"),
    ]
    for drop, grow, msg in cases:
        with pytest.raises((ValueError, IndexError), match=msg):
            layer.update_topology(drop.to(device), grow.to(device), optimizer=opt)
        for k, v in layer.state_dict().items():
            assert torch.equal(v, snapshot[k]), (msg, k)


def test_update_topology_state_reset_mean(device):
    layer = snack.SparseLinear(12, 10, density=0.4, device=device, dtype=torch.float64)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 12, dtype=torch.float64, device=device)).square().sum().backward()
    opt.step()
    drop = snack.dst.prune_magnitude(layer, 6)
    keep = torch.ones(layer.nnz, dtype=torch.bool, device=device)
    keep[drop] = False
    kept_mean = opt.state[layer.values]["exp_avg_sq"][keep].mean()
    grow = snack.dst.grow_random(layer, 6, torch.Generator(device=device).manual_seed(1))
    layer.update_topology(drop, grow, optimizer=opt, state_reset="mean")
    sq = dense_map(layer, opt.state[layer.values]["exp_avg_sq"]).flatten()[grow]
    assert torch.allclose(sq, kept_mean.expand_as(sq))
    with pytest.raises(ValueError, match="state_reset"):
        layer.update_topology(drop, grow, state_reset="keep")


def test_update_topology_grow_init(device):
    layer = snack.SparseLinear(10, 8, density=0.3, device=device)
    drop = snack.dst.prune_magnitude(layer, 4)
    grow = snack.dst.grow_random(layer, 4, torch.Generator(device=device).manual_seed(0))
    layer.update_topology(drop, grow, init=lambda n, device, dtype: torch.full((n,), 0.5, device=device, dtype=dtype))
    assert (layer.to_dense().flatten()[grow] == 0.5).all()
    kept_before = layer.to_dense().flatten()
    drop = snack.dst.prune_magnitude(layer, 3)
    grow = snack.dst.grow_random(layer, 3, torch.Generator(device=device).manual_seed(1))
    layer.update_topology(drop, grow, init=-0.25)
    after = layer.to_dense().flatten()
    assert (after[grow] == -0.25).all()
    unchanged = layer.mask().flatten().bool()
    unchanged[grow] = False
    assert torch.equal(after[unchanged], kept_before[unchanged])
    layer.update_topology(snack.dst.prune_magnitude(layer, 2),
                          snack.dst.grow_random(layer, 2, torch.Generator(device=device).manual_seed(2)))
    assert int((layer.values == 0).sum()) >= 2  # the default: grown at zero
    with pytest.raises(ValueError, match="grow init"):
        layer.update_topology(snack.dst.prune_magnitude(layer, 1), snack.dst.grow_random(layer, 1), init="normal")


# ---- schedulers against Dense+Mask references --------------------------------------------------------
class DenseMaskRef:
    """The same rule on a dense weight times a mask, with a dense AdamW: the reference."""

    def __init__(self, layer, lr, wd):
        self.w = nn.Parameter(layer.to_dense().detach().clone())
        self.b = nn.Parameter(layer.bias.detach().clone())
        self.mask = layer.mask().to(self.w.dtype)
        self.opt = torch.optim.AdamW([self.w, self.b], lr=lr, weight_decay=wd)
        self.grad_full = None

    def step(self, x, target):
        self.opt.zero_grad()
        w_eff = self.w * self.mask
        w_eff.retain_grad()
        ((nn.functional.linear(x, w_eff, self.b) - target) ** 2).mean().backward()
        self.grad_full = w_eff.grad.detach().clone()  # dY^T X, not masked
        self.opt.step()

    def update(self, k, algorithm, positions_for_set):
        m, n = self.mask.shape
        flat_mask = self.mask.flatten().bool()
        active = flat_mask.nonzero().flatten()  # ascending = slot order
        mag = (self.w.detach() * self.mask).abs().flatten()[active]
        drop_pos = active[torch.sort(torch.sort(mag, stable=True).indices[:k]).values]
        if algorithm == "set":
            grow_pos = positions_for_set
        else:
            score = self.grad_full.abs().flatten().clone()
            score[active] = -1
            grow_pos = torch.sort(torch.sort(score, stable=True, descending=True).indices[:k]).values
        new_mask = flat_mask.clone()
        new_mask[drop_pos] = False
        new_mask[grow_pos] = True
        with torch.no_grad():
            self.w.view(-1)[grow_pos] = 0
            self.w.view(-1)[drop_pos] = 0
            state = self.opt.state[self.w]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].view(-1)[grow_pos] = 0
        self.mask = new_mask.view(m, n).to(self.w.dtype)


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_scheduler_matches_dense_mask_reference(device, algorithm):
    dtype = torch.float64
    torch.manual_seed(0)
    layer = snack.SparseLinear(24, 16, density=0.25, device=device, dtype=dtype)
    ref = DenseMaskRef(layer, lr=1e-2, wd=0.01)
    model = nn.Sequential(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator(device=device).manual_seed(7)
    sched = snack.dst.DSTScheduler(model, opt, algorithm=algorithm, update_every=3, end=20, drop_fraction=0.3,
                                   drop_schedule="cosine", generator=gen)
    ref_gen = torch.Generator(device=device).manual_seed(7)
    data = torch.Generator().manual_seed(5)
    updates = 0
    for step in range(1, 16):
        x = torch.randn(8, 24, generator=data, dtype=dtype).to(device)
        target = torch.randn(8, 16, generator=data, dtype=dtype).to(device)
        # The reference's SET draws come from the same sampler and generator stream.
        is_update = sched.is_update_step(step)
        k = int(sched.fraction(step) * layer.nnz) if is_update else 0
        set_positions = None
        ref.step(x, target)
        opt.zero_grad()
        ((layer(x) - target) ** 2).mean().backward()
        if is_update and algorithm == "set":
            # sample_absent sees the pattern before the update, as the scheduler's grow does.
            set_positions = ops.sample_absent(layer.row_idx, layer.col_idx, 16, 24, k, generator=ref_gen)
        opt.step()  # runs the scheduler
        if is_update:
            ref.update(k, algorithm, set_positions)
            updates += 1
        assert torch.equal(layer.mask(), ref.mask.bool()), f"topology differs at step {step}"
        rows, cols = layer.row_idx.long(), layer.col_idx.long()
        assert_same_values(layer.values, ref.w.detach()[rows, cols], 1e-12, floor=0.1, what=f"weights at step {step}")
    assert updates == 5 and sched.report()[0]["nnz"] == layer.nnz


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_scheduler_on_a_bfloat16_layer(device, algorithm):
    # DST on 16-bit values: the topology moves, stays valid, and the layer, its AdamW state and its
    # views stay consistent with its own dense weight.
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    layer = snack.SparseLinear(48, 32, density=0.2, device=device, dtype=bf16)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    sched = snack.dst.DSTScheduler(nn.Sequential(layer), opt, algorithm=algorithm, update_every=2, end=10,
                                   drop_fraction=0.3, generator=torch.Generator(device=device).manual_seed(1))
    before = layer.mask().clone()
    for _ in range(8):
        x = torch.randn(8, 48, device=device, dtype=bf16)
        opt.zero_grad()
        (layer(x).float() ** 2).mean().backward()
        opt.step()
    assert not torch.equal(layer.mask(), before)
    pos = layer.row_idx.long() * 48 + layer.col_idx.long()
    assert torch.unique(pos).numel() == layer.nnz and torch.equal(pos, torch.sort(pos).values)
    assert layer.values.dtype == bf16 and torch.isfinite(layer.values.float()).all()
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt.state[layer.values][key]
        assert state.dtype == bf16 and state.shape == layer.values.shape and torch.isfinite(state.float()).all()
    x = torch.randn(5, 48, device=device, dtype=bf16)
    assert_matmul(layer(x), x, layer.to_dense().detach().t(), bf16, bias=layer.bias.detach())


def test_scheduler_schedules_and_errors():
    layer = snack.SparseLinear(10, 10, density=0.5)
    model, opt = nn.Sequential(layer), torch.optim.SGD(layer.parameters(), lr=0.1)
    s = snack.dst.DSTScheduler(model, opt, drop_fraction=0.4, start=10, end=110, update_every=10)
    assert s.fraction(10) == pytest.approx(0.4) and s.fraction(60) == pytest.approx(0.2) and s.fraction(110) < 1e-12
    assert not s.is_update_step(5) and s.is_update_step(20) and not s.is_update_step(110)
    s.remove()
    lin = snack.dst.DSTScheduler(model, opt, drop_fraction=0.4, end=100, drop_schedule="linear")
    assert lin.fraction(50) == pytest.approx(0.2)
    lin.remove()
    custom = snack.dst.DSTScheduler(model, opt, drop_schedule=lambda step: 0.125)
    assert custom.fraction(3) == 0.125
    custom.remove()
    with pytest.raises(ValueError, match="SparseLinear"):
        snack.dst.DSTScheduler(nn.Sequential(nn.Linear(3, 3)), opt)
    with pytest.raises(ValueError, match="drop_fraction"):
        snack.dst.DSTScheduler(model, opt, drop_fraction=1.5)
    with pytest.raises(ValueError, match="algorithm"):
        snack.dst.DSTScheduler(model, opt, algorithm="mest")


def test_custom_rule():
    class GrowFirstAbsent(snack.dst.DSTRule):
        def grow(self, layer, k, *, generator=None, x=None, dy=None):
            present = set((layer.row_idx.long() * layer.in_features + layer.col_idx.long()).tolist())
            return torch.tensor([p for p in range(layer.out_features * layer.in_features) if p not in present][:k])

    layer = snack.SparseLinear(8, 6, density=0.5)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = snack.dst.DSTScheduler(nn.Sequential(layer), opt, algorithm=GrowFirstAbsent(), update_every=1,
                                   drop_fraction=0.25, drop_schedule="constant")
    layer(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert sched.last_moved and sched.report()[0]["moved"] == 6


def test_gradient_rule_error_in_backward_leaves_everything_unchanged():
    # A gradient rule's grow runs during the backward pass; its error surfaces at the optimizer step,
    # which leaves the layers, the step count and the generator (drawn from by the first layer's
    # grow) as they were.
    class FailsOnSecondLayer(snack.dst.DSTRule):
        needs_gradient = True

        def grow(self, layer, k, *, generator=None, x=None, dy=None):
            if layer is second:
                raise RuntimeError("no growth for the second layer")
            return snack.dst.grow_random(layer, k, generator)

    torch.manual_seed(0)
    first, second = snack.SparseLinear(12, 10, density=0.4), snack.SparseLinear(10, 8, density=0.4)
    model = nn.Sequential(first, nn.ReLU(), second)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    sched = snack.dst.DSTScheduler(model, opt, algorithm=FailsOnSecondLayer(), update_every=1,
                                   drop_fraction=0.3, drop_schedule="constant", generator=gen)
    masks, gen_state = [first.mask().clone(), second.mask().clone()], gen.get_state()
    model(torch.randn(4, 12)).square().sum().backward()  # the error is held, not raised here
    assert not torch.equal(gen.get_state(), gen_state)  # the first layer's grow drew
    with pytest.raises(RuntimeError, match="second layer"):
        opt.step()
    assert torch.equal(first.mask(), masks[0]) and torch.equal(second.mask(), masks[1])
    assert sched.steps == 0 and torch.equal(gen.get_state(), gen_state)


def test_rigl_under_autocast_computes_as_without_the_scheduler(device):
    # On the step before an update the scheduler hands the layer its input already in the autocast
    # dtype: the cast autocast makes anyway, so outputs and gradients are bitwise a twin's without it.
    torch.manual_seed(0)
    layer = snack.SparseLinear(32, 24, density=0.3, device=device)
    twin = copy.deepcopy(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = snack.dst.DSTScheduler(nn.Sequential(layer), opt, algorithm="rigl", update_every=1, drop_fraction=0.3)
    x = torch.randn(16, 32, device=device, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y, y_twin = layer(x=x), twin(x_twin)  # the input as a keyword reaches the hooks too
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_twin)
    y.float().square().sum().backward()
    y_twin.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_twin.grad)
    assert torch.equal(layer.values.grad, twin.values.grad) and torch.equal(layer.bias.grad, twin.bias.grad)
    opt.step()
    assert sched.steps == 1 and sched.report()[0]["moved"] > 0


def test_rigl_update_leaves_no_rows_alive_with_the_loss(device):
    # The graph's hooks outlive the update while the caller keeps the loss: what they held for the
    # growth (each layer's input and output gradient) goes with the decision, so an update step ends
    # with as many live activations as a plain one (counted among the objects the collector tracks).
    def live_activations():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and tuple(o.shape) == (96, 64))

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (snack.SparseLinear(64, 64, density=0.2, device=device),
                                                          nn.LayerNorm(64, device=device))])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=2, drop_fraction=0.3)
    x = torch.randn(96, 64, device=device)
    counts = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        counts.append(live_activations())  # the loss, and so its graph and hooks, still alive
    assert sched.steps == 2 and sum(r["moved"] for r in sched.report()) > 0
    assert counts[1] == counts[0], f"live activations after a plain step {counts[0]}, after the update {counts[1]}"


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_rigl_update_holds_one_layer_gradient_at_a_time(precision):
    # RigL's growth runs in the backward pass, on the input the layer saved itself: an update step's
    # peak stays near a plain step's, instead of also keeping every layer's dY (6 x 8 MiB in fp32)
    # until the optimizer step, or under autocast the float32 LayerNorm outputs (5 x 8 MiB) beside the
    # bf16 copies the layers save.
    torch.manual_seed(0)
    width, batch = 1024, 2048
    model = nn.Sequential(*[m for _ in range(6) for m in (snack.SparseLinear(width, width, density=0.05, device="cuda"),
                                                            nn.LayerNorm(width, device="cuda"))])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=3, drop_fraction=0.3)
    x = torch.randn(batch, width, device="cuda")
    # Six steps, updates at the third and the sixth. The first update's score GEMMs make the libraries'
    # workspaces (cuBLAS's, 32 MiB on a Hopper GPU), which stay allocated; so the second update is
    # compared with the plain step before it.
    peaks, allocated = [], []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        allocated.append(torch.cuda.memory_allocated())  # the loss, and so its graph, still alive
    assert sched.steps == 6 and sum(r["moved"] for r in sched.report()) > 0
    one_fp32_activation = batch * width * 4
    assert peaks[5] - peaks[4] < 2 * one_fp32_activation, \
        f"update step peak {peaks[5] / 2**20:.1f} MiB, plain step {peaks[4] / 2**20:.1f} MiB"
    assert allocated[5] - allocated[4] < one_fp32_activation, "the update step left its inputs allocated"


def test_resume_follows_the_same_topology_path():
    def run(stop_at=None, resume=None):
        torch.manual_seed(0)
        layer = snack.SparseLinear(20, 12, density=0.3)
        model = nn.Sequential(layer)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(11)
        sched = snack.dst.DSTScheduler(model, opt, algorithm="set", update_every=2, drop_fraction=0.3,
                                       drop_schedule="constant", generator=gen)
        start = 0
        if resume is not None:
            model.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            sched.load_state_dict(resume["sched"])
            start = resume["step"]
        data = torch.Generator().manual_seed(3)
        for step in range(12):
            x = torch.randn(4, 20, generator=data)
            if step < start:
                continue
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if stop_at is not None and step + 1 == stop_at:
                return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                        "sched": copy.deepcopy(sched.state_dict()), "step": stop_at}
        return layer

    full = run()
    resumed = run(resume=run(stop_at=5))
    assert torch.equal(full.row_idx, resumed.row_idx) and torch.equal(full.col_idx, resumed.col_idx)
    assert torch.equal(full.values, resumed.values)


# ---- sparsify --------------------------------------------------------------------------------------
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


@pytest.mark.parametrize("distribution", ["erk", "uniform"])
def test_sparsify_meets_the_budget_exactly(distribution):
    model = mlp()
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    total = sum(w.numel() for w in dense.values())
    densities = snack.sparsify(model, 0.1, distribution=distribution, generator=torch.Generator().manual_seed(0))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, snack.SparseLinear)}
    assert set(layers) == set(dense) == set(densities)
    assert sum(lyr.nnz for lyr in layers.values()) == round(0.1 * total)
    for name, layer in layers.items():
        assert layer.density == pytest.approx(densities[name])
        # values are the dense layer's values at the kept positions
        assert torch.equal(layer.to_dense()[layer.mask()], dense[name][layer.mask()])
    if distribution == "erk":
        assert densities["4"] > densities["2"], "ERK gives small layers more density"
    assert model(torch.randn(3, 64)).shape == (3, 10)


def test_sparsify_warns_of_a_layer_left_without_connections():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1000))
    with pytest.warns(UserWarning, match="the layers 0 keep no connection"):
        densities = snack.sparsify(model, 0.01, generator=torch.Generator().manual_seed(0))
    assert densities["0"] == 0.0 and model[0].nnz == 0


def test_sparsify_filters_and_errors():
    model = mlp()
    out = snack.sparsify(model, 0.2, exclude="4")
    assert set(out) == {"0", "2"} and isinstance(model[4], nn.Linear)
    model = mlp()
    assert set(snack.sparsify(model, 0.5, include=lambda name, m: m.in_features == 256)) == {"2", "4"}
    with pytest.raises(ValueError, match="density"):
        snack.sparsify(mlp(), 0.0)
    with pytest.raises(ValueError, match="nothing|no nn.Linear"):
        snack.sparsify(nn.Sequential(nn.ReLU()), 0.5)
    with pytest.raises(ValueError, match="distribution"):
        snack.sparsify(mlp(), 0.5, distribution="normal")


def test_erk_densities_are_capped():
    d = snack.sparsify.__globals__["erk_densities"]({"a": (4, 4), "b": (1000, 1000)}, 0.5)
    assert d["a"] == 1.0 and math.isclose(d["b"] * 1e6 + 16, 0.5 * (1e6 + 16), rel_tol=1e-9)


class Conv1D(nn.Module):
    """Shaped like Hugging Face GPT-2's Conv1D: y = x @ weight + bias, weight [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def test_sparsify_hf_conv1d_layout():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(12, 20))
    dense_w, dense_b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    snack.sparsify(model, 1.0)  # density 1: the same function in sparse form
    layer = model[0]
    assert isinstance(layer, snack.SparseLinear) and (layer.in_features, layer.out_features) == (20, 12)
    x = torch.randn(3, 20)
    assert_matmul(layer(x), x, dense_w, torch.float32, bias=dense_b)


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_dense_mask_linear_follows_the_same_path(algorithm):
    # The library's own Dense+Mask baseline, driven by the same scheduler, stays in lockstep with snack.
    torch.manual_seed(0)
    sparse = snack.SparseLinear(20, 12, density=0.3, dtype=torch.float64)
    dense_mask = snack.dst.DenseMaskLinear.from_sparse(sparse)
    runs = []
    for layer in (sparse, dense_mask):
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        sched = snack.dst.DSTScheduler(nn.Sequential(layer), opt, algorithm=algorithm, update_every=2, drop_fraction=0.3,
                                       drop_schedule="constant", generator=torch.Generator().manual_seed(4))
        data = torch.Generator().manual_seed(9)
        for _ in range(9):
            x = torch.randn(5, 20, generator=data, dtype=torch.float64)
            opt.zero_grad()
            layer(x).square().mean().backward()
            opt.step()
        runs.append((layer.row_idx.clone(), layer.col_idx.clone(), layer.values.detach().clone(), sched))
    (r0, c0, v0, s0), (r1, c1, v1, s1) = runs
    assert torch.equal(r0.long(), r1) and torch.equal(c0.long(), c1)
    assert_same_values(v0, v1, 1e-12, floor=0.1)
    assert sum(r["moved"] for r in s0.report()) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_gpu_update_has_no_host_synchronisation(algorithm):
    layer = snack.SparseLinear(256, 128, density=0.1, device="cuda")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x, dy = torch.randn(16, 256, device="cuda"), torch.randn(16, 128, device="cuda")
    layer(x).square().mean().backward()
    opt.step()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = int(0.3 * layer.nnz)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        drop = snack.dst.prune_magnitude(layer, k)
        grow = (snack.dst.grow_random(layer, k, gen) if algorithm == "set"
                else snack.dst.grow_gradient(layer, k, x, dy, block_rows=64))
        layer.update_topology(drop, grow, optimizer=opt, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    keys = layer.row_idx.long() * 256 + layer.col_idx.long()
    assert torch.all(keys[1:] > keys[:-1])


# ---- the device paths of the topology operators (bitmap + radix select, src/cuda/topology_update.cu) ----
@pytest.mark.cuda
@pytest.mark.parametrize("m,k,density,validate", [(64, 48, 0.3, True), (300, 257, 0.1, False), (2048, 1500, 0.05, False),
                                                   (40, 70000, 0.02, True)])
def test_replace_slots_on_device_matches_the_cpu(m, k, density, validate):
    gen = torch.Generator().manual_seed(m)
    layer = snack.SparseLinear(k, m, density=density, generator=gen)
    count = layer.nnz // 3
    drop = ops.prune_slots(torch.rand(layer.nnz, generator=gen), count)
    grow = ops.sample_absent(layer.row_idx, layer.col_idx, m, k, count, generator=gen)
    want = ops.replace_slots(layer.row_idx, layer.col_idx, drop, grow, m, k, True)
    got = ops.replace_slots(layer.row_idx.cuda(), layer.col_idx.cuda(), drop.cuda(), grow.cuda(), m, k, validate)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
    with pytest.raises(ValueError, match="stays connected"):
        keys = layer.row_idx.long() * k + layer.col_idx.long()
        kept = torch.ones(layer.nnz, dtype=torch.bool)
        kept[drop] = False
        bad = grow.clone()
        bad[0] = keys[kept][0]
        ops.replace_slots(layer.row_idx.cuda(), layer.col_idx.cuda(), drop.cuda(), bad.cuda(), m, k, True)


@pytest.mark.parametrize("m,k,nnz,grow", [(20, 20, 40, 5), (12, 10, 100, 10)])
def test_sample_absent_is_uniform(device, m, k, nnz, grow):
    # (20, 20): the candidate-drawing path (no host synchronisation); (12, 10): dense, every absent
    # position a candidate.
    rows, cols = ops.random_slots(m, k, nnz, generator=torch.Generator().manual_seed(0))
    rows, cols = rows.to(device), cols.to(device)
    present = set((rows.long() * k + cols.long()).tolist())
    absent = torch.tensor([p for p in range(m * k) if p not in present])
    gen = torch.Generator(device=device).manual_seed(1)
    counts = torch.zeros(m * k)
    trials = 4000
    for _ in range(trials):
        got = ops.sample_absent(rows, cols, m, k, grow, generator=gen).cpu()
        assert torch.equal(got, torch.unique(got)) and got.numel() == grow
        counts[got] += 1
    assert counts.sum() == trials * grow and counts[list(present)].sum() == 0
    mean = trials * grow / absent.numel()
    assert torch.all((counts[absent] - mean).abs() < 5 * mean ** 0.5), counts[absent]


# ---- RigL's growth scores the whole dense gradient of the weight ------------------------------------
def _rigl_growth(model: nn.Module, layer, loss_of, k_fraction: float = 0.3, forwards: int = 1) -> list[int]:
    """The positions RigL grows in ``layer`` after ``forwards`` backward passes of loss_of(model) and one
    step (SGD at lr 0: the weights do not move)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=1, drop_fraction=k_fraction,
                                   drop_schedule="constant", generator=torch.Generator().manual_seed(0))
    before = layer.mask().bool()
    for i in range(forwards):
        loss_of(model, i).backward()
    opt.step()
    sched.remove()
    return (layer.mask().bool() & ~before).flatten().nonzero().flatten().tolist()


def _top_absent(dense_grad: torch.Tensor, mask: torch.Tensor, k: int) -> list[int]:
    """The k absent positions of largest |gradient|, ties to the smaller position."""
    scores = dense_grad.abs().flatten().tolist()
    absent = [p for p, present in enumerate(mask.flatten().tolist()) if not present]
    return sorted(sorted(absent, key=lambda p: (-scores[p], p))[:k])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("conv", [False, True])
def test_rigl_grows_from_the_gradient_before_a_fused_activation(device, activation, conv):
    if device.type == "cuda":
        pytest.skip("float64 reference: the CPU products")
    gen = torch.Generator().manual_seed(1)
    if conv:
        layer = snack.SparseConv2d(6, 10, density=0.3, activation=activation, dtype=torch.float64, generator=gen)
        x = torch.randn(2, 6, 5, 4, dtype=torch.float64, generator=gen)
    else:
        layer = snack.SparseLinear(32, 24, density=0.2, activation=activation, dtype=torch.float64, generator=gen)
        x = torch.randn(3, 5, 32, dtype=torch.float64, generator=gen)  # 3-D: rows of every batch
    target = torch.randn(layer(x).shape, dtype=torch.float64, generator=gen)
    weight = layer.to_dense().detach().clone().requires_grad_()
    act = torch.relu if activation == "relu" else nn.functional.gelu
    z = (nn.functional.conv2d(x, weight[:, :, None, None], layer.bias) if conv
         else nn.functional.linear(x, weight, layer.bias))
    (act(z) * target).sum().backward()
    k = int(0.3 * layer.nnz)
    expected = _top_absent(weight.grad, layer.mask(), k)
    grown = _rigl_growth(nn.Sequential(layer), layer, lambda m, i: (m(x) * target).sum())
    assert grown == expected


def test_rigl_sums_the_gradient_of_every_call_of_a_shared_layer():
    gen = torch.Generator().manual_seed(2)
    layer = snack.SparseLinear(16, 16, density=0.25, dtype=torch.float64, generator=gen)
    model = nn.Sequential(layer, nn.Tanh(), layer)  # one layer, called twice
    x = torch.randn(7, 16, dtype=torch.float64, generator=gen)
    weight = layer.to_dense().detach().clone().requires_grad_()
    lin = lambda t: nn.functional.linear(t, weight, layer.bias)  # noqa: E731
    lin(torch.tanh(lin(x))).square().sum().backward()
    expected = _top_absent(weight.grad, layer.mask(), int(0.3 * layer.nnz))
    assert _rigl_growth(model, layer, lambda m, i: m(x).square().sum()) == expected


def test_rigl_decides_from_the_calls_that_reach_the_loss():
    gen = torch.Generator().manual_seed(3)
    layer = snack.SparseLinear(16, 12, density=0.25, dtype=torch.float64, generator=gen)
    x, unused = torch.randn(5, 16, dtype=torch.float64, generator=gen), torch.randn(4, 16, dtype=torch.float64)
    weight = layer.to_dense().detach().clone().requires_grad_()
    nn.functional.linear(x, weight, layer.bias).square().sum().backward()
    expected = _top_absent(weight.grad, layer.mask(), int(0.3 * layer.nnz))

    def loss(model, i):
        model(unused)  # a call whose output takes no part in the loss
        return model(x).square().sum()
    assert _rigl_growth(nn.Sequential(layer), layer, loss) == expected


def test_rigl_under_gradient_accumulation_warns_and_scores_the_last_pass():
    gen = torch.Generator().manual_seed(4)
    layer = snack.SparseLinear(16, 12, density=0.25, dtype=torch.float64, generator=gen)
    batches = [torch.randn(5, 16, dtype=torch.float64, generator=gen) for _ in range(2)]
    weight = layer.to_dense().detach().clone().requires_grad_()
    nn.functional.linear(batches[1], weight, layer.bias).square().sum().backward()
    expected = _top_absent(weight.grad, layer.mask(), int(0.3 * layer.nnz))
    with pytest.warns(UserWarning, match="gradient accumulation"):
        grown = _rigl_growth(nn.Sequential(layer), layer, lambda m, i: m(batches[i]).square().sum(), forwards=2)
    assert grown == expected


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_rigl_with_a_fused_activation_under_autocast_grows_as_with_the_activation_apart(device, activation):
    # The product's output is recomputed in the autocast dtype, as the layer computed it: the growth is
    # the one of a twin whose activation is a module of its own.
    torch.manual_seed(5)
    fused = snack.SparseLinear(64, 48, density=0.2, activation=activation, device=device)
    twin = copy.deepcopy(fused)
    twin.activation = "none"
    act = nn.ReLU() if activation == "relu" else nn.GELU()
    x = torch.randn(40, 64, device=device)

    def loss(model, i):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(x).float().square().sum()
    grown = _rigl_growth(nn.Sequential(fused), fused, loss)
    assert grown and grown == _rigl_growth(nn.Sequential(twin, act), twin, loss)
