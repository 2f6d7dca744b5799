"""Property-based fuzzing (hypothesis) of what snack accepts from outside: slot arrays, COO triplets,
pattern lists, checkpoints, topology updates, scheduler arguments and DST rules, and the products
against float64.

Every example must end in one of two ways: accepted, and then the result is valid and right; or a
TypeError / ValueError / IndexError (the documented errors), and then nothing changed. Never a
crash, a hang or a silently wrong result. ``test_fuzz.py`` runs this file in a child process per
device (a crash fails that test); ``bench/robustness.py`` runs it with more examples and writes the
outcome counts. Settings: SNACK_FUZZ_DEVICE (cpu / cuda), SNACK_FUZZ_EXAMPLES (per target),
SNACK_FUZZ_REPORT (a JSON file for the counts).
"""

from __future__ import annotations

import atexit
import json
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import snack
from bad_inputs import assert_unchanged, snapshot
from helpers import assert_close, matmul_ref

ops = snack.ops
DEVICE = torch.device(os.environ.get("SNACK_FUZZ_DEVICE", "cpu"))
EXAMPLES = int(os.environ.get("SNACK_FUZZ_EXAMPLES", "120"))
DOCUMENTED = (TypeError, ValueError, IndexError)
OUTCOMES: Counter = Counter()

fuzz = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("SNACK_FUZZ_DEVICE=cuda but no GPU is visible", allow_module_level=True)


def outcome(target: str, fn):
    """Runs fn(); counts "accepted" or the documented error it raised (anything else propagates)."""
    try:
        result = fn()
    except DOCUMENTED as error:
        OUTCOMES[(target, type(error).__name__)] += 1
        return False, error
    OUTCOMES[(target, "accepted")] += 1
    return True, result


@atexit.register
def _write_report() -> None:
    path = os.environ.get("SNACK_FUZZ_REPORT")
    if path:
        rows = [{"target": t, "outcome": o, "examples": n} for (t, o), n in sorted(OUTCOMES.items())]
        with open(path, "w") as f:
            json.dump({"device": DEVICE.type, "examples_per_target": EXAMPLES, "outcomes": rows}, f, indent=1)


def random_layer(m, k, nnz_fraction, seed, dtype=torch.float32):
    nnz = max(0, min(m * k, round(nnz_fraction * m * k)))
    gen = torch.Generator().manual_seed(seed)
    rows, cols = ops.random_slots(m, k, nnz, generator=gen)
    values = torch.randn(nnz, generator=gen).to(dtype)
    return snack.SparseLinear.from_coo(rows.long(), cols.long(), values.to(DEVICE), m, k,
                                       bias=torch.randn(m, generator=gen).to(dtype).to(DEVICE))


dims = st.integers(1, 24)
index_dtypes = st.sampled_from([torch.int32] * 3 + [torch.uint16] * 3 +
                               [torch.int64, torch.int16, torch.float32, torch.bool])


# ---- slots and COO ------------------------------------------------------------------------------------
@fuzz
@given(m=dims, k=dims, data=st.data(), dtype=index_dtypes, sort=st.booleans())
def test_pattern_from_raw_slots(m, k, data, dtype, sort):
    n = data.draw(st.integers(0, min(40, m * k + 3)))
    hi = max(m, k) + 2
    if data.draw(st.booleans()) and n <= m * k:  # distinct positions in range: valid once sorted
        positions = data.draw(st.lists(st.integers(0, m * k - 1), min_size=n, max_size=n, unique=True))
        rows, cols = [q // k for q in positions], [q % k for q in positions]
    else:
        rows = data.draw(st.lists(st.integers(-2, hi), min_size=n, max_size=n))
        cols = data.draw(st.lists(st.integers(-2, hi), min_size=n, max_size=n))
    if sort:
        pairs = sorted(zip(rows, cols))
        rows, cols = [p[0] for p in pairs], [p[1] for p in pairs]
    if dtype == torch.uint16:
        rows, cols = [abs(r) for r in rows], [abs(c) for c in cols]
    r = torch.tensor(rows, dtype=torch.int64).to(dtype).to(DEVICE)
    c = torch.tensor(cols, dtype=torch.int64).to(dtype).to(DEVICE)
    ok, p = outcome("Pattern(row_idx, col_idx)", lambda: snack.Pattern(r, c, m, k))
    expected = (dtype in (torch.int32, torch.uint16) and all(0 <= a < m for a in rows) and
                all(0 <= b < k for b in cols) and
                all((a1, b1) < (a2, b2) for a1, b1, a2, b2 in zip(rows, cols, rows[1:], cols[1:])))
    assert ok == expected, (rows, cols, dtype, p)
    if ok:
        ops.validate_pattern(p.tensors)
        assert int(p.to_mask().sum()) == n


@fuzz
@given(m=dims, k=dims, data=st.data())
def test_layer_from_coo(m, k, data):
    n = data.draw(st.integers(0, min(40, m * k + 3)))
    rows = data.draw(st.lists(st.integers(-1, m), min_size=n, max_size=n))
    cols = data.draw(st.lists(st.integers(-1, k), min_size=n, max_size=n))
    values = torch.randn(n, dtype=torch.float64)
    r, c = torch.tensor(rows, dtype=torch.int64, device=DEVICE), torch.tensor(cols, dtype=torch.int64, device=DEVICE)
    ok, layer = outcome("SparseLinear.from_coo", lambda: snack.SparseLinear.from_coo(r, c, values.to(DEVICE), m, k))
    positions = list(zip(rows, cols))
    valid = all(0 <= a < m and 0 <= b < k for a, b in positions) and len(set(positions)) == n
    assert ok == valid
    if ok:
        expected = torch.zeros(m, k, dtype=torch.float64)
        for (a, b), v in zip(positions, values):
            expected[a, b] = v
        assert torch.equal(layer.to_dense().cpu(), expected)


# ---- pattern lists given to the operators ------------------------------------------------------------------
@fuzz
@given(m=dims, k=dims, frac=st.floats(0.05, 1.0), seed=st.integers(0, 2 ** 16),
       kept=st.sampled_from([None, False, True]), data=st.data())
def test_corrupted_pattern_lists(m, k, frac, seed, kept, data):
    layer = random_layer(m, k, frac, seed)
    if kept is not None:  # a pattern kept for inference, with or without its tile view
        layer.pattern.for_inference(tile_view=kept)
    tensors = [t.clone() for t in layer.pattern.tensors]
    present = [f for f, t in enumerate(tensors) if t.numel() > 0]  # (a kept pattern's dropped arrays are empty)
    field = data.draw(st.sampled_from(present))
    i = data.draw(st.integers(0, tensors[field].numel() - 1))
    limit = 65535 if tensors[field].dtype == torch.uint16 else 2 ** 31 - 1
    low = 0 if tensors[field].dtype == torch.uint16 else -3
    value = data.draw(st.integers(low, min(limit, 2 * (m + k + layer.nnz))))
    tensors[field][i] = value
    valid, _ = outcome("validate_pattern(corrupted list)", lambda: ops.validate_pattern(tensors))
    if DEVICE.type != "cpu":
        return  # the GPU products trust their list: snack.Pattern is what validates
    x = torch.randn(3, k, dtype=torch.float32)
    ok, y = outcome("spmm(corrupted list, CPU)", lambda: ops.spmm(x, layer.values.detach(), tensors))
    assert ok == valid  # the CPU products check exactly what validate_pattern checks
    if ok:
        # The weight the list describes. A kept pattern's rows are its row pointers, so a corrupted
        # pointer can make another valid pattern; a whole pattern's arrays check each other, so one
        # that still validates is the same pattern.
        field_of = snack.PATTERN_FIELDS.index
        row_ptr, col_idx = tensors[field_of("row_ptr")], tensors[field_of("col_idx")].long()
        rows = torch.repeat_interleave(torch.arange(m), row_ptr.diff().long())
        dense = torch.zeros(m, k, dtype=torch.float64)
        dense[rows, col_idx] = layer.values.detach().double().cpu()
        if kept is None:
            assert torch.equal(dense, layer.to_dense().detach().double().cpu())
        ref, scale = matmul_ref(x, dense.t())
        assert_close(y, ref, scale, torch.float32, "spmm")


# ---- products against float64 ------------------------------------------------------------------------------
value_dtypes = [torch.float32, torch.float64, torch.bfloat16] + ([torch.float16] if DEVICE.type == "cuda" else [])


@fuzz
@given(m=st.integers(1, 40), k=st.integers(1, 40), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16),
       n=st.integers(0, 9), lead=st.sampled_from([(), (2,)]), dtype=st.sampled_from(value_dtypes),
       activation=st.sampled_from([None, "relu", "gelu"]))
def test_forward_and_backward_against_float64(m, k, frac, seed, n, lead, dtype, activation):
    layer = random_layer(m, k, frac, seed, dtype)
    layer.activation = activation or "none"
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, n, k, generator=gen).to(dtype).to(DEVICE).requires_grad_(True)
    y = layer(x)
    OUTCOMES[("forward/backward vs float64", "accepted")] += 1
    dense = layer.to_dense().detach().double().cpu()
    x2 = x.detach().reshape(-1, k)
    ref, scale = matmul_ref(x2, dense.t())
    ref = ref + layer.bias.detach().double().cpu()
    scale = scale + layer.bias.detach().double().abs().cpu()
    if activation == "relu":
        ref = torch.relu(ref)
    elif activation == "gelu":
        ref = torch.nn.functional.gelu(ref)
        # Under autograd GELU runs unfused on the stored pre-activation: in 16 bits two roundings
        # (pre-activation, output), as torch's own linear + gelu in that dtype.
        scale = scale * (1.2 if dtype in (torch.float32, torch.float64) else 2.5)
    assert_close(y.reshape(-1, m), ref, scale, dtype, "forward")
    g = torch.randn(y.shape, generator=gen).to(dtype).to(DEVICE)
    y.backward(g)
    if activation is None:
        dx_ref, dx_scale = matmul_ref(g.reshape(-1, m), dense)
        assert_close(x.grad.reshape(-1, k), dx_ref, dx_scale, dtype, "dx")
        dv_ref = (g.reshape(-1, m).double().cpu().t() @ x2.double().cpu())
        dv_scale = (g.reshape(-1, m).double().abs().cpu().t() @ x2.double().abs().cpu())
        r, c = layer.row_idx.long().cpu(), layer.col_idx.long().cpu()
        assert_close(layer.values.grad, dv_ref[r, c], dv_scale[r, c], dtype, "dvalues")


# ---- checkpoints ---------------------------------------------------------------------------------------------
def mutate(sd: dict, kind: str, key: str, data) -> dict:
    sd = {k: v.clone() if torch.is_tensor(v) else v for k, v in sd.items()}
    t = sd[key]
    if kind == "drop":
        sd.pop(key)
    elif kind == "extra":
        sd[key + "_extra"] = torch.zeros(1)
    elif kind == "entry" and t.numel() > 0:
        i = data.draw(st.integers(0, t.numel() - 1))
        if t.dtype.is_floating_point:
            t[i] = data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
        else:
            t[i] = data.draw(st.integers(0, 70))
    elif kind == "shape":
        sd[key] = t[: max(0, t.numel() - 1)]
    elif kind == "dtype":
        sd[key] = t.to(data.draw(st.sampled_from([torch.float64, torch.int64, torch.int32, torch.float16,
                                                   torch.bool, torch.complex64])))
    elif kind == "meta":
        sd[key] = t.to("meta")
    elif kind == "not a tensor":
        sd[key] = t.tolist()
    elif kind == "shuffle":  # the same connections in another order: valid
        names = ("values", "pattern.row_idx", "pattern.col_idx")
        if all(torch.is_tensor(sd.get(n)) and not sd[n].is_meta for n in names):
            perm = torch.randperm(sd["values"].numel())
            for name in names:
                if sd[name].shape == perm.shape:
                    sd[name] = sd[name].cpu()[perm].to(sd[name].device)  # torch indexes no CUDA uint16
    return sd


@fuzz
@given(seed=st.integers(0, 2 ** 16), kinds=st.lists(st.sampled_from(["shuffle", "shuffle", "drop", "extra", "entry",
                                                                     "shape", "dtype", "meta", "not a tensor"]),
                                                    min_size=1, max_size=3),
       data=st.data(), strict=st.booleans())
def test_checkpoints(seed, kinds, data, strict):
    source, target = random_layer(9, 11, 0.4, seed), random_layer(9, 11, 0.4, seed + 1)
    sd = source.state_dict()
    for kind in kinds:
        key = data.draw(st.sampled_from(sorted(k for k in sd if torch.is_tensor(sd[k]) and not sd[k].is_meta) or
                                        ["values"]))
        if key in sd and torch.is_tensor(sd[key]) and not sd[key].is_meta:
            sd = mutate(sd, kind, key, data)
    before = snapshot(target)
    try:
        target.load_state_dict(sd, strict=strict)
        changed = any(not torch.equal(a, b) for (_, a), (_, b) in zip(before, snapshot(target))
                      if torch.is_tensor(a))
        OUTCOMES[("load_state_dict(mutated)", "loaded" if changed else "left unchanged")] += 1
    except RuntimeError:  # torch's error list (what a size mismatch raises too)
        OUTCOMES[("load_state_dict(mutated)", "RuntimeError")] += 1
        assert_unchanged(before, snapshot(target))
    ops.validate_pattern(target.pattern.tensors)
    y = target(torch.randn(2, 11, device=DEVICE))
    assert y.shape == (2, 9)


# ---- topology updates and DST -----------------------------------------------------------------------------------
@fuzz
@given(seed=st.integers(0, 2 ** 16), data=st.data(), validate=st.just(True))
def test_update_topology(seed, data, validate):
    layer = random_layer(7, 9, 0.5, seed)
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 9, device=DEVICE)).sum().backward()
    opt.step()
    k = data.draw(st.integers(0, 6))
    drop = torch.tensor(data.draw(st.lists(st.integers(-1, layer.nnz), min_size=k, max_size=k)), dtype=torch.long)
    grow_len = data.draw(st.sampled_from([k, k, k + 1]))
    grow = torch.tensor(data.draw(st.lists(st.integers(-1, 63), min_size=grow_len, max_size=grow_len)),
                        dtype=torch.long)
    before_mask, before = layer.mask().clone(), snapshot(layer, opt)
    ok, _ = outcome("update_topology(random drop, grow)",
                    lambda: layer.update_topology(drop.to(DEVICE), grow.to(DEVICE), optimizer=opt, validate=validate))
    if not ok:
        assert_unchanged(before, snapshot(layer, opt))
        return
    ops.validate_pattern(layer.pattern.tensors)
    positions = set(layer.pattern.positions().tolist())
    old = before_mask.flatten().nonzero().flatten().tolist()
    assert positions == (set(old) - {old[i] for i in drop.tolist()}) | set(grow.tolist())


class _FuzzRule(snack.dst.DSTRule):
    """Decisions drawn by hypothesis: often valid (distinct kept slots, distinct absent positions),
    otherwise anything (out of range, repeated, the wrong count, a position that stays)."""

    def __init__(self, data):
        self.data = data
        self.valid = data.draw(st.booleans())  # this update's decisions are all valid

    def prune(self, layer, k):
        if self.valid or self.data.draw(st.booleans()):
            drop = self.data.draw(st.lists(st.integers(0, layer.nnz - 1), min_size=k, max_size=k, unique=True))
        else:
            drop = self.data.draw(st.lists(st.integers(-1, layer.nnz), min_size=k, max_size=k))
        return torch.tensor(drop, dtype=torch.long, device=layer.values.device)

    def grow(self, layer, k, *, generator=None, x=None, dy=None):
        total = layer.out_features * layer.in_features
        absent = (~layer.mask().flatten()).nonzero().flatten().tolist()
        if (self.valid or self.data.draw(st.booleans())) and len(absent) >= k:
            grow = self.data.draw(st.lists(st.sampled_from(absent), min_size=k, max_size=k, unique=True))
        else:
            n = max(0, self.data.draw(st.sampled_from([k, k, k - 1])))
            grow = self.data.draw(st.lists(st.integers(-1, total), min_size=n, max_size=n))
        return torch.tensor(grow, dtype=torch.long, device=layer.values.device)


@fuzz
@given(seed=st.integers(0, 2 ** 16), data=st.data())
def test_scheduler_with_a_random_rule(seed, data):
    model = nn.Sequential(random_layer(6, 6, 0.5, seed), nn.ReLU(), random_layer(5, 6, 0.5, seed + 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 6, device=DEVICE)).sum().backward()
    opt.step()
    sched = snack.dst.DSTScheduler(model, opt, algorithm=_FuzzRule(data), update_every=1, drop_fraction=0.3)
    sched.remove()
    before = snapshot(model, opt, sched)
    ok, _ = outcome("DSTScheduler.step(random rule)", sched.step)
    if not ok:
        assert_unchanged(before, snapshot(model, opt, sched))
    for layer in (model[0], model[2]):
        ops.validate_pattern(layer.pattern.tensors)
    model(torch.randn(2, 6, device=DEVICE)).sum().backward()


VALID_ARGUMENTS = dict(update_every=st.integers(1, 5), start=st.integers(0, 5),
                       end=st.one_of(st.none(), st.integers(6, 12)), drop_fraction=st.floats(0, 1),
                       grow_init=st.sampled_from(["zero", "uniform", None, 0.5]))
INVALID_ARGUMENTS = dict(update_every=st.one_of(st.integers(-2, 0), st.floats(-1, 5), st.booleans(), st.none()),
                         start=st.one_of(st.integers(-3, -1), st.floats(0, 3), st.text(max_size=1)),
                         end=st.one_of(st.integers(-2, 5), st.floats(0, 20)),
                         drop_fraction=st.one_of(st.floats(1.01, 3), st.floats(-2, -0.01), st.just(float("nan")),
                                                 st.text(max_size=2)),
                         grow_init=st.one_of(st.just("bogus"), st.booleans(), st.lists(st.integers(), max_size=2)))


@fuzz
@given(data=st.data(), bad=st.sampled_from([None] + sorted(VALID_ARGUMENTS)))
def test_scheduler_arguments(data, bad):
    args = {name: data.draw(strategy) for name, strategy in VALID_ARGUMENTS.items()}
    if bad is not None:
        args[bad] = data.draw(INVALID_ARGUMENTS[bad])
    if bad == "end" and isinstance(args["end"], int) and args["end"] > args["start"]:
        bad = None  # an end after the start is valid after all
    model = nn.Sequential(random_layer(6, 6, 0.5, 0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ok, sched = outcome("DSTScheduler(random arguments)", lambda: snack.dst.DSTScheduler(
        model, opt, generator=torch.Generator().manual_seed(0), **args))
    assert ok == (bad is None), (args, bad)
    if ok:
        for _ in range(4):
            model(torch.randn(2, 6, device=DEVICE)).sum().backward()
            opt.step()
            opt.zero_grad()
        ops.validate_pattern(model[0].pattern.tensors)
