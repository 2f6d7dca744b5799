"""The bad-input matrix: untrusted input (constructors' arguments, checkpoints, hand-built pattern
lists, DST rules, optimizer misuse) given to snack as a user would give it.

Each case checks the contract: a clear error of the documented type naming the argument, and the
layer, optimizer, scheduler and generators exactly as they were; or, where the input is valid, the
right result. ``test_bad_inputs.py`` runs every case on every device; the cases marked ``isolated``
hand raw memory to a kernel and run in a child process, so that a crash fails the test instead of
killing the runner (``python tests/python/bad_inputs.py CASE DEVICE`` runs one).
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

import snack

ops = snack.ops


@dataclass(frozen=True)
class Case:
    run: Callable[[torch.device], None]
    isolated: bool = False   # hands memory to a kernel: runs in a child process
    gpu_only: bool = False


CASES: dict[str, Case] = {}


def case(isolated: bool = False, gpu_only: bool = False):
    def register(fn):
        CASES[fn.__name__] = Case(fn, isolated, gpu_only)
        return fn
    return register


# ---- helpers ---------------------------------------------------------------------------------------
def layer(device, m=6, k=8, density=0.5, seed=0, **kw) -> snack.SparseLinear:
    return snack.SparseLinear(k, m, density=density, device=device, generator=torch.Generator().manual_seed(seed),
                              **kw)


def snapshot(*objects) -> list:
    """Copies of every tensor (and number) that the objects hold: modules' parameters and buffers
    (views included), optimizers' state, schedulers' counters, generators' states."""
    out = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            out += [(n, t.detach().clone()) for n, t in obj.named_parameters()]
            out += [(n, t.clone()) for n, t in obj.named_buffers()]
            out += [(n, None if p.grad is None else p.grad.clone()) for n, p in obj.named_parameters()]
        elif isinstance(obj, torch.optim.Optimizer):
            for p, state in obj.state.items():
                out += [(k, v.clone() if torch.is_tensor(v) else v) for k, v in state.items()]
        elif isinstance(obj, snack.dst.DSTScheduler):
            out += [("steps", obj.steps), ("last_moved", dict(obj.last_moved))]
        elif isinstance(obj, torch.Generator):
            out.append(("generator", obj.get_state()))
        else:
            raise TypeError(type(obj))
    return out


def assert_unchanged(before: list, after: list) -> None:
    assert len(before) == len(after)
    for (name, a), (_, b) in zip(before, after):
        if torch.is_tensor(a):
            assert b is not None and a.dtype == b.dtype and torch.equal(a, b), f"{name} changed"
        else:
            assert a == b, f"{name} changed: {a} -> {b}"


def refused(objects: tuple, error, match, fn: Callable[[], object]) -> None:
    """fn() raises `error` matching `match`, and leaves every object as it was."""
    before = snapshot(*objects)
    with pytest.raises(error, match=match):
        fn()
    assert_unchanged(before, snapshot(*objects))


def works(l: snack.SparseLinear) -> None:
    """The layer is valid and computes what its dense twin does."""
    ops.validate_pattern(l.pattern.tensors)
    x = torch.randn(3, l.in_features, device=l.values.device, dtype=l.values.dtype)
    y = l(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, l.to_dense(), l.bias), rtol=1e-4, atol=1e-5)


def slots(device, rows, cols, dtype=torch.int32):
    return torch.tensor(rows, dtype=dtype, device=device), torch.tensor(cols, dtype=dtype, device=device)


# ---- constructors ------------------------------------------------------------------------------------
@case()
def pattern_rejects_bad_slots(device):
    for rows, cols, error, match in (([0, 9], [0, 1], IndexError, "outside"), ([0, 0], [0, 9], IndexError, "outside"),
                                     ([1, 0], [0, 0], ValueError, "not sorted"), ([0, 0], [2, 1], ValueError,
                                                                                   "not sorted"),
                                     ([2, 2], [3, 3], ValueError, "both at"), ([-1, 0], [0, 0], IndexError,
                                                                                 "outside")):
        r, c = slots(device, rows, cols)
        with pytest.raises(error, match=match):
            snack.Pattern(r, c, 4, 4)
    r, c = slots(device, [0, 1], [0, 1], torch.int64)
    with pytest.raises(TypeError, match="uint16 or both int32"):
        snack.Pattern(r, c, 4, 4)
    with pytest.raises(TypeError, match="uint16 or both int32"):
        snack.Pattern(r.float(), c.float(), 4, 4)
    r, c = slots(device, [0, 1], [0])
    with pytest.raises(ValueError, match="elements"):
        snack.Pattern(r, c, 4, 4)
    with pytest.raises(TypeError, match="integer"):
        snack.Pattern(*slots(device, [0], [0]), 4.5, 4)
    with pytest.raises(ValueError, match="at least 1"):
        snack.Pattern(*slots(device, [], []), 0, 4)
    p = snack.Pattern(*slots(device, [0, 0, 3], [1, 2, 0]), 4, 4)
    assert p.nnz == 3 and p.to_mask().sum() == 3


@case()
def from_coo_rejects_bad_input(device):
    ones = torch.ones(2, device=device)
    r, c = torch.tensor([0, 1], device=device), torch.tensor([0, 1], device=device)
    for rows, cols, error, match in ((r.float(), c.float(), TypeError, "integer"), (r.bool(), c.bool(), TypeError,
                                                                                    "integer"),
                                     (r + 3, c, IndexError, "outside"), (r * 0, c * 0, ValueError, "more than once")):
        with pytest.raises(error, match=match):
            snack.SparseLinear.from_coo(rows, cols, ones, 3, 3)
    with pytest.raises(ValueError, match="one entry per position"):
        snack.SparseLinear.from_coo(r, c, torch.ones(3, device=device), 3, 3)
    with pytest.raises(ValueError, match="bias"):
        snack.SparseLinear.from_coo(r, c, ones, 3, 3, bias=torch.ones(7, device=device))
    with pytest.raises(TypeError, match="float32"):
        snack.SparseLinear.from_coo(r, c, ones.to(torch.complex64), 3, 3)
    with pytest.raises(TypeError, match="float32"):
        snack.SparseLinear.from_coo(r, c, ones.long(), 3, 3)
    works(snack.SparseLinear.from_coo(r.flip(0), c, ones, 3, 3, bias=torch.zeros(3, device=device)))


@case()
def layer_arguments_are_checked(device):
    for kw, error, match in ((dict(density=0.0), ValueError, "outside"), (dict(density=1.5), ValueError, "outside"),
                             (dict(density=True), TypeError, "real number"), (dict(density="0.5"), TypeError,
                                                                              "real number"),
                             (dict(density=0.5, sparsity=0.5), ValueError, "exactly one"),
                             (dict(density=0.5, dtype=torch.complex64), TypeError, "float32"),
                             (dict(density=0.5, dtype=torch.int32), TypeError, "float32"),
                             (dict(density=0.5, activation="tanh"), ValueError, "activation"),
                             (dict(density=torch.ones(2)), TypeError, "real number")):
        with pytest.raises(error, match=match):
            snack.SparseLinear(8, 6, device=device, **kw)
    with pytest.raises(TypeError, match="in_features must be an integer"):
        snack.SparseLinear(8.0, 6, density=0.5, device=device)
    with pytest.raises(ValueError, match="at least 1"):
        snack.SparseLinear(0, 6, density=0.5, device=device)
    works(snack.SparseLinear(8, 6, density=torch.tensor(0.5), device=device))
    assert snack.SparseLinear(8, 6, sparsity=torch.tensor(0.75), device=device).nnz == 12


@case()
def from_dense_rejects_bad_weights(device):
    with pytest.raises(TypeError, match="float32"):
        snack.SparseLinear.from_dense(torch.ones(3, 4, device=device, dtype=torch.complex64), density=0.5)
    with pytest.raises(ValueError, match="2-D"):
        snack.SparseLinear.from_dense(torch.ones(3, device=device), density=0.5)
    with pytest.raises(ValueError, match="mask shape"):
        snack.SparseLinear.from_dense(torch.ones(3, 4, device=device), mask=torch.ones(4, 3, device=device))
    w = torch.randn(3, 4, device=device)
    w[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        snack.SparseLinear.from_dense(w, density=0.5)


# ---- hand-built pattern lists and raw ops --------------------------------------------------------------
def corrupted_lists(l: snack.SparseLinear) -> dict:
    """Pattern lists whose views disagree with their slots, one corruption each."""
    def with_field(field, edit):
        tensors = [t.clone() for t in l.pattern.tensors]
        edit(tensors[snack.PATTERN_FIELDS.index(field)])
        return tensors

    def setitem(i, v):
        def edit(t):
            t[i] = v
        return edit
    nnz = l.nnz
    return {"row_ptr past nnz": with_field("row_ptr", setitem(-1, nnz + 1000)),
            "row_ptr negative": with_field("row_ptr", setitem(1, -5)),
            "col_ptr past nnz": with_field("col_ptr", setitem(2, 10 ** 6)),
            "csc_perm out of range": with_field("csc_perm", setitem(0, 10 ** 6)),
            "csc_perm negative": with_field("csc_perm", setitem(0, -1)),
            "csc_perm repeats": with_field("csc_perm", lambda t: t.__setitem__(1, t[0].item())),
            "tile_ptr past nnz": with_field("tile_ptr", setitem(1, nnz + 1000)),
            "tile_entries moved": with_field("tile_entries", setitem(0, 1 << 12)),
            "slot out of range": with_field("col_idx", setitem(0, l.in_features + 3)),
            "slots unsorted": with_field("row_idx", setitem(0, l.out_features - 1))}


@case(isolated=True)
def cpu_ops_check_the_pattern_they_read(device):
    l = layer("cpu")
    x, dy = torch.randn(3, 8), torch.randn(3, 6)
    state = [torch.zeros(l.nnz), torch.zeros(l.nnz), torch.zeros(())]
    for what, tensors in corrupted_lists(l).items():
        for op in (lambda: ops.spmm(x, l.values.detach(), tensors), lambda: ops.spmm_t(dy, l.values.detach(), tensors),
                   lambda: ops.sddmm(dy, x, tensors), lambda: ops.sparse_linear(x, l.values, l.bias, tensors)):
            with pytest.raises((ValueError, IndexError)):
                op()
        values = l.values.detach().clone()
        with pytest.raises((ValueError, IndexError)):
            ops.sddmm_adamw_(dy, x, tensors, values, state, [1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0], [])
        assert torch.equal(values, l.values.detach()) and float(state[2]) == 0, what
        with pytest.raises((ValueError, IndexError)):
            ops.validate_pattern(tensors)
    # A list already checked (and remembered) is checked again once it changes in place.
    tensors = [t.clone() for t in l.pattern.tensors]
    ops.spmm(x, l.values.detach(), tensors)
    tensors[snack.PATTERN_FIELDS.index("csc_perm")][0] = 10 ** 6
    with pytest.raises(ValueError):
        ops.spmm_t(dy, l.values.detach(), tensors)


@case(isolated=True)
def validate_pattern_finds_every_corruption(device):
    l = layer(device)
    ops.validate_pattern(l.pattern.tensors)
    for what, tensors in corrupted_lists(l).items():
        with pytest.raises((ValueError, IndexError)):
            ops.validate_pattern(tensors)


@case(isolated=True)
def build_views_stays_in_bounds(device):
    r, c = slots(device, [0, 100, 2], [0, 1, 70000 % 4])
    if device.type == "cpu":
        with pytest.raises(IndexError, match="outside"):
            ops.build_views(r, c, 4, 4)
    else:  # no synchronisation on the GPU: it trusts its slots, and the kernels stay within their buffers
        views = ops.build_views(r, c, 4, 4)
        torch.cuda.synchronize()
        with pytest.raises((ValueError, IndexError)):
            ops.validate_pattern([r, c, *views])


@case(isolated=True)
def fake_kernels_refuse_real_tensors(device):
    l = layer(device)
    meta_x = torch.randn(2, 8, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        l(meta_x)
    with pytest.raises(RuntimeError, match="meta"):
        ops.slots_from_coo(torch.tensor([0, 1], device=device), torch.tensor([0, 1], device="meta"), 3, 3)
    with pytest.raises(RuntimeError, match="meta"):
        ops.build_views(l.row_idx, l.col_idx.to("meta"), 6, 8)
    # All on meta: shapes only (what tracing needs).
    y = ops.spmm(meta_x, l.values.detach().to("meta"), [t.to("meta") for t in l.pattern.tensors])
    assert y.is_meta and y.shape == (2, 6)


@case(gpu_only=True)
def devices_must_agree(device):
    l = layer(device)
    with pytest.raises((RuntimeError, ValueError)):
        l(torch.randn(2, 8))  # a CPU input to a GPU layer
    with pytest.raises((RuntimeError, ValueError)):
        ops.spmm(torch.randn(2, 8, device=device), l.values.detach().cpu(), l.pattern.tensors)


# ---- checkpoints -------------------------------------------------------------------------------------------
def bad_checkpoints(l: snack.SparseLinear) -> dict:
    sd = {k: v.clone() for k, v in l.state_dict().items()}

    def edit(fn):
        d = {k: v.clone() for k, v in sd.items()}
        fn(d)
        return d
    return {
        "slot out of range": (edit(lambda d: d["pattern.col_idx"].__setitem__(0, l.in_features)), "outside"),
        "row out of range": (edit(lambda d: d["pattern.row_idx"].__setitem__(0, 60000)), "outside"),
        "repeated slot": (edit(lambda d: (d["pattern.row_idx"].__setitem__(1, d["pattern.row_idx"][0]),
                                          d["pattern.col_idx"].__setitem__(1, d["pattern.col_idx"][0]))),
                          "more than once"),
        "values missing": (edit(lambda d: d.pop("values")), "Missing"),
        "slots missing": (edit(lambda d: d.pop("pattern.col_idx")), "Missing"),
        "bias wrong shape": (edit(lambda d: d.__setitem__("bias", torch.zeros(l.out_features + 1))), "bias"),
        "values wrong shape": (edit(lambda d: d.__setitem__("values", torch.zeros(l.nnz + 1))), "values"),
        "values complex": (edit(lambda d: d.__setitem__("values", d["values"].to(torch.complex64))), "floating"),
        "unexpected key": (edit(lambda d: d.__setitem__("extra", torch.zeros(1))), "Unexpected"),
        "unexpected view": (edit(lambda d: d.__setitem__("pattern.row_ptr", torch.zeros(7, dtype=torch.int32))),
                            "Unexpected"),
        "meta slots": (edit(lambda d: d.__setitem__("pattern.col_idx", d["pattern.col_idx"].to("meta"))), "meta"),
        "meta values": (edit(lambda d: d.__setitem__("values", d["values"].to("meta"))), "meta"),
        "list values": (edit(lambda d: d.__setitem__("values", [1.0] * l.nnz)), "must be a tensor"),
        "float slots": (edit(lambda d: d.__setitem__("pattern.row_idx", d["pattern.row_idx"].float())), "integers"),
        "wrong nnz": (edit(lambda d: (d.__setitem__("values", d["values"][:-1]),
                                      d.__setitem__("pattern.row_idx", d["pattern.row_idx"][:-1]),
                                      d.__setitem__("pattern.col_idx", d["pattern.col_idx"][:-1]))), "size mismatch"),
    }


@case(isolated=True)
def checkpoints_load_all_or_nothing(device):
    l = layer(device)
    opt = torch.optim.SGD(l.parameters(), lr=0.1)
    for what, (sd, match) in bad_checkpoints(l).items():
        refused((l, opt), RuntimeError, match, lambda: l.load_state_dict(sd))
        # strict=False: the layer still loads all of its entries or none, and says which are missing.
        before = snapshot(l)
        try:
            result = l.load_state_dict(sd, strict=False)
        except RuntimeError:
            result = None
        assert_unchanged(before, snapshot(l))
        if what in ("values missing", "slots missing"):
            assert result is not None and result.missing_keys, what
        works(l)


@case()
def checkpoints_that_are_valid_load(device):
    l = layer(device, seed=1)
    sd = l.state_dict()
    perm = torch.randperm(l.nnz)
    # Permuted on the CPU: torch indexes no uint16 tensor on CUDA.
    shuffled = {**sd, **{n: sd[n].cpu()[perm].to(sd[n].device) for n in ("values", "pattern.row_idx",
                                                                          "pattern.col_idx")}}
    other = layer(device, seed=2)
    other.load_state_dict(shuffled)
    assert torch.equal(other.to_dense(), l.to_dense())
    works(other)
    legacy = {"values": sd["values"], "bias": sd["bias"], "row_idx": sd["pattern.row_idx"].long(),
              "col_idx": sd["pattern.col_idx"].long()}
    third = layer(device, seed=3)
    third.load_state_dict(legacy)
    assert torch.equal(third.to_dense(), l.to_dense())
    cpu = layer("cpu", seed=4)
    cpu.load_state_dict({k: v.cpu() for k, v in sd.items()})
    assert torch.equal(cpu.to_dense(), l.to_dense().cpu())


@case()
def a_pattern_loads_both_slot_arrays_or_neither(device):
    p = layer(device).pattern
    sd = {k: v.clone() for k, v in p.state_dict().items()}
    sd.pop("col_idx")
    before = snapshot(p)
    with pytest.raises(RuntimeError, match="Missing"):
        p.load_state_dict(sd)
    assert p.load_state_dict(sd, strict=False).missing_keys == ["col_idx"]
    assert_unchanged(before, snapshot(p))


# ---- autograd and activations ---------------------------------------------------------------------------
@case()
def relu_passes_nan_as_torch_does(device):
    l = snack.SparseLinear(4, 3, density=1.0, device=device, activation="relu")
    x = torch.tensor([[float("nan"), 1.0, -2.0, 0.5], [1.0, -1.0, 2.0, -3.0]], device=device, requires_grad=True)
    y = l(x)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = torch.relu(torch.nn.functional.linear(x_ref, l.to_dense().detach(), l.bias.detach()))
    torch.testing.assert_close(y, ref, equal_nan=True)
    with torch.no_grad():  # the fully fused inference kernel
        torch.testing.assert_close(l(x), ref, equal_nan=True)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, equal_nan=True)


@case()
def double_backward_is_refused(device):
    l = layer(device)
    x = torch.randn(2, 8, device=device, requires_grad=True)
    y = l(x).pow(2).sum()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(y, x, create_graph=True)
    g, = torch.autograd.grad(l(x).pow(2).sum(), x)  # first order still works
    assert g.shape == x.shape


# ---- the fused optimizer ------------------------------------------------------------------------------------
def fused_pair(device):
    l = layer(device)
    return l, snack.optim.AdamW(l.parameters(), lr=0.1)


@case()
def a_failed_fused_update_changes_nothing(device):
    l, opt = fused_pair(device)
    x = torch.randn(3, 8, device=device)
    l(x).sum().backward()
    opt.step()
    state = opt.state[l.values]
    good = state["exp_avg"]
    state["exp_avg"] = good.double()  # a corrupted state: the fused update refuses it
    before = snapshot(l, opt)
    with pytest.raises(TypeError):
        l(x).sum().backward()
    assert_unchanged(before, snapshot(l, opt))
    state["exp_avg"] = good
    l(x).sum().backward()  # the failed backward left the guard clear
    opt.step()
    assert float(opt.state[l.values]["step"]) == 2


@case()
def another_optimizer_cannot_step_fused_values(device):
    l, opt = fused_pair(device)
    x = torch.randn(3, 8, device=device)
    other = torch.optim.SGD(l.parameters(), lr=0.1)
    l(x).sum().backward()
    with pytest.raises(RuntimeError, match="release"):
        other.step()
    opt.release()
    other.zero_grad()
    l(x).sum().backward()
    assert l.values.grad is not None
    other.step()


@case()
def copies_of_model_and_optimizer_train_alike(device):
    l, opt = fused_pair(device)
    x = torch.randn(3, 8, device=device)
    for make in (lambda: copy.deepcopy((l, opt)), lambda: pickle.loads(pickle.dumps((l, opt)))):
        before = snapshot(l, opt)
        l2, opt2 = make()
        assert l2.fused_update is not None and l2.pattern.row_idx.dtype == l.pattern.row_idx.dtype
        values = l2.values.detach().clone()
        l2(x).sum().backward()
        opt2.step()
        assert l2.values.grad is None and not torch.equal(values, l2.values.detach())
        assert_unchanged(before, snapshot(l, opt))
    buffer = io.BytesIO()
    torch.save((l, opt), buffer)
    buffer.seek(0)
    l3, _ = torch.load(buffer, weights_only=False)
    assert l3.fused_update is not None and torch.equal(l3.to_dense(), l.to_dense())


@case()
def accumulation_under_the_fused_update_is_refused(device):
    l, opt = fused_pair(device)
    x = torch.randn(3, 8, device=device)
    l(x).sum().backward()
    before = snapshot(l, opt)
    with pytest.raises(RuntimeError, match="already updated"):
        l(x).sum().backward()
    assert_unchanged(before, snapshot(l, opt))


# ---- dynamic sparse training --------------------------------------------------------------------------------
class _BadSecondLayer(snack.dst.SET):
    """Grows a position that is already connected, in the second layer only."""

    def __init__(self, failure):
        self.failure, self.calls = failure, 0

    def grow(self, layer, k, *, generator=None, x=None, dy=None):
        self.calls += 1
        grow = super().grow(layer, k, generator=generator)
        if self.failure and self.calls % 2 == 0:
            if self.failure == "raise":
                raise RuntimeError("rule failed")
            grow = grow.clone()
            grow[0] = layer.row_idx[0].long() * layer.in_features + layer.col_idx[0].long()  # kept, not absent
        return grow


@case()
def a_failed_update_leaves_every_layer_as_it_was(device):
    for failure, error in (("raise", RuntimeError), ("invalid", ValueError)):
        model = nn.Sequential(layer(device, 8, 8, seed=1), layer(device, 6, 8, seed=2))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 8, device=device)).sum().backward()
        opt.step()  # Adam's moments exist: the update must carry them
        gen = torch.Generator(device=device).manual_seed(0)
        sched = snack.dst.DSTScheduler(model, opt, algorithm=_BadSecondLayer(failure), update_every=1,
                                       drop_fraction=0.5, generator=gen)
        sched.remove()  # driven by hand below
        # The first layer's decision is made (and draws from the generator) before the second fails.
        refused((model, opt, sched, gen), error, None, sched.step)
        sched.rule.failure = None  # the next update succeeds on both layers
        assert sched.step() and sched.steps == 1
        for l in model:
            works(l)


@case()
def update_topology_checks_before_it_changes(device):
    l = layer(device)
    opt = torch.optim.Adam(l.parameters(), lr=0.1)
    l(torch.randn(2, 8, device=device)).sum().backward()
    opt.step()
    absent = (~l.mask().flatten()).nonzero().flatten()
    kept = l.pattern.positions()[1:2]  # slot 1 stays: its position is not free
    for drop, grow in ((torch.tensor([l.nnz + 5]), absent[:1]), (torch.tensor([0]), torch.tensor([10 ** 6])),
                       (torch.tensor([0, 0]), absent[:2]), (torch.tensor([0]), kept), (torch.tensor([0]), absent[:2]),
                       (torch.tensor([0.5]), absent[:1])):
        refused((l, opt), (ValueError, IndexError, TypeError), None,
                lambda: l.update_topology(drop, grow, optimizer=opt))
    with pytest.raises(ValueError, match="state_reset"):
        l.update_topology(torch.tensor([0]), absent[:1], state_reset="bogus")
    dm = snack.dst.DenseMaskLinear.from_sparse(l)
    kept = int(l.row_idx[0]) * l.in_features + int(l.col_idx[0])
    refused((dm,), ValueError, "stays connected", lambda: dm.update_topology(torch.tensor([1]), torch.tensor([kept])))


@case()
def scheduler_arguments_are_checked(device):
    model = nn.Sequential(layer(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for kw, error, match in ((dict(update_every=2.5), TypeError, "update_every"), (dict(update_every=0), ValueError,
                                                                                  "update_every"),
                             (dict(update_every=True), TypeError, "update_every"),
                             (dict(start=10, end=5), ValueError, "after start"), (dict(start=-1), ValueError, "start"),
                             (dict(end=2.0), TypeError, "end"), (dict(grow_init="bogus"), ValueError, "grow init"),
                             (dict(grow_init=[1]), ValueError, "grow init"),
                             (dict(drop_fraction=1.5), ValueError, "drop_fraction"),
                             (dict(drop_fraction="x"), TypeError, "drop_fraction"),
                             (dict(drop_schedule="steps"), ValueError, "drop_schedule"),
                             (dict(algorithm="magic"), ValueError, "algorithm"),
                             (dict(generator=0), TypeError, "generator")):
        with pytest.raises(error, match=match):
            snack.dst.DSTScheduler(model, opt, **{"generator": gen, **kw})
    with pytest.raises(TypeError, match="optimizer"):
        snack.dst.DSTScheduler(model, None, generator=gen)
    with pytest.warns(UserWarning, match="generator"):
        snack.dst.DSTScheduler(model, opt, algorithm="set")
    sched = snack.dst.DSTScheduler(model, opt, generator=gen)
    with pytest.raises(ValueError, match="state_dict"):
        sched.load_state_dict({"bogus": 1})
    with pytest.raises(ValueError, match="at least 0"):
        sched.load_state_dict({"steps": -3})
    bare = snack.dst.DSTScheduler(model, opt, algorithm="rigl")
    with pytest.warns(UserWarning, match="generator state"):
        bare.load_state_dict(sched.state_dict())
    def ones(n, device, dtype):
        return torch.ones(n, device=device, dtype=dtype)
    for init in (0.5, torch.tensor(0.25), "uniform", ones):
        snack.dst.DSTScheduler(model, opt, grow_init=init, generator=gen).remove()


# ---- sparsify ---------------------------------------------------------------------------------------------
@case()
def sparsify_handles_shared_and_nested_modules(device):
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, nn.Linear(8, 4))).to(device)
    snack.sparsify(model, 0.5)
    assert isinstance(model[0], snack.SparseLinear) and model[0] is model[2][0]
    assert isinstance(model[2][1], snack.SparseLinear)
    model(torch.randn(2, 8, device=device)).sum().backward()
    enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).to(device)
    densities = snack.sparsify(enc, 0.5)
    assert set(densities) == {"linear1", "linear2"} and isinstance(enc.self_attn.out_proj, nn.Linear)
    x = torch.randn(2, 3, 16, device=device)
    enc(x).sum().backward()
    enc.eval()
    with torch.no_grad():
        assert enc(x).shape == x.shape
    dense = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(device)
    assert snack.sparsify(dense, 1.0) == {"0": 1.0, "1": 1.0} and dense[0].nnz == 64
    assert snack.sparsify(nn.Sequential(nn.Linear(8, 8)).to(device), torch.tensor(0.25)) == {"0": 0.25}
    for bad, error in ((0.0, ValueError), (True, TypeError), ("0.5", TypeError)):
        with pytest.raises(error):
            snack.sparsify(nn.Sequential(nn.Linear(8, 8)).to(device), bad)


def run_in_this_process(name: str, device: str) -> None:
    """Runs one case with warnings shown (a case that expects one asserts it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        CASES[name].run(torch.device(device))


if __name__ == "__main__":  # python tests/python/bad_inputs.py CASE DEVICE
    run_in_this_process(sys.argv[1], sys.argv[2])
    print(f"case {sys.argv[1]} on {sys.argv[2]}: passed")
