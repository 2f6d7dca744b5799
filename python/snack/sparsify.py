"""snack.sparsify: replace a model's dense linear layers and 1x1 convolutions by sparse ones at a global density."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from ._checks import real_number
from ._ops import ops
from .conv import SparseConv2d, is_pointwise_conv
from .layer import SparseLinear

Selector = Union[None, str, Iterable[str], Callable[[str, nn.Module], bool]]


def _is_hf_conv1d(module: nn.Module) -> bool:
    # Hugging Face GPT-2's Conv1D: y = x @ weight + bias with weight [in, out]. Matched by name so that
    # transformers stays optional.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _selected(name: str, module: nn.Module, selector: Selector, default: bool) -> bool:
    if selector is None:
        return default
    if callable(selector):
        return bool(selector(name, module))
    patterns = [selector] if isinstance(selector, str) else list(selector)
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def erk_densities(shapes: dict[str, tuple[int, int]], density: float) -> dict[str, float]:
    """Erdos-Renyi-Kernel densities: proportional to (in + out) / (in * out), capped at 1, scaled so
    that the total number of connections is density * (all weights)."""
    total = sum(o * i for o, i in shapes.values())
    budget = density * total
    dense: set[str] = set()
    while True:
        free = {n: (o + i) / (o * i) for n, (o, i) in shapes.items() if n not in dense}
        remaining = budget - sum(shapes[n][0] * shapes[n][1] for n in dense)
        if not free or remaining <= 0:  # every layer capped (density 1, or nearly)
            return {n: 1.0 if n in dense else 0.0 for n in shapes}
        scale = remaining / sum(raw * shapes[n][0] * shapes[n][1] for n, raw in free.items())
        over = [n for n, raw in free.items() if raw * scale > 1.0]
        if not over:
            return {n: (1.0 if n in dense else free[n] * scale) for n in shapes}
        dense.update(over)


def _nnz_per_layer(shapes: dict[str, tuple[int, int]], densities: dict[str, float], density: float) -> dict[str, int]:
    """Integer connection counts that add up exactly to round(density * total) (largest remainder)."""
    total = sum(o * i for o, i in shapes.values())
    target = int(round(density * total))
    exact = {n: densities[n] * shapes[n][0] * shapes[n][1] for n in shapes}
    nnz = {n: min(int(exact[n]), shapes[n][0] * shapes[n][1]) for n in shapes}
    order = sorted(shapes, key=lambda n: (-(exact[n] - int(exact[n])), n))
    i = 0
    while sum(nnz.values()) < target:
        n = order[i % len(order)]
        if nnz[n] < shapes[n][0] * shapes[n][1]:
            nnz[n] += 1
        i += 1
    return nnz


def _no_fast_path(module, args):
    return None


def _keep_off_dense_fast_paths(parent: nn.Module) -> None:
    # nn.TransformerEncoderLayer's inference fast path passes its Linears' dense weights to one fused
    # kernel; it skips that path when a forward hook is attached to any of its modules.
    if isinstance(parent, nn.TransformerEncoderLayer) and _no_fast_path not in parent._forward_pre_hooks.values():
        parent.register_forward_pre_hook(_no_fast_path)


def sparsify(model: nn.Module, density: float, *, distribution: str = "erk", include: Selector = None,
             exclude: Selector = None, generator: Optional[torch.Generator] = None) -> dict[str, float]:
    """Replaces every selected ``nn.Linear`` (and Hugging Face ``Conv1D``) of ``model`` by a SparseLinear,
    and every 1x1 ``nn.Conv2d`` (no padding, no groups) by a :class:`SparseConv2d` of the same stride.

    The layers together keep ``round(density * total weights)`` connections exactly, spread by
    ``distribution``: "erk" (Erdos-Renyi-Kernel, the usual choice for DST) or "uniform". Each layer's
    connections are drawn uniformly at random (``generator``) and keep the dense layer's values and
    bias, so a freshly initialised model keeps its initial scale. ``include``/``exclude``: module-name
    patterns (fnmatch), lists of them, or callables(name, module). Returns {module name: density}.

    A Linear used in several places becomes one SparseLinear used in all of them. The ``out_proj`` of
    ``nn.MultiheadAttention`` stays dense (the attention reads its weight directly), and an
    ``nn.TransformerEncoderLayer`` gets a no-op forward pre-hook that keeps it off its inference fast
    path, which would do the same with its Linears.
    """
    density = real_number(density, "density", "sparsify")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"sparsify: density must lie in (0, 1], got {density!r}")
    if distribution not in ("erk", "uniform"):
        raise ValueError(f"sparsify: distribution must be 'erk' or 'uniform', got {distribution!r}")
    # Every place a module is used (one Linear may be shared by several parents, or appear twice in
    # one): all of them get the same SparseLinear. nn.MultiheadAttention reads its out_proj's weight
    # directly, so that Linear stays dense.
    targets: dict[str, nn.Module] = {}                    # first name -> module
    places: dict[int, list[tuple[nn.Module, str]]] = {}   # id(module) -> (parent, attribute) of each use
    seen: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or isinstance(module, SparseLinear) or not (isinstance(module, nn.Linear) or _is_hf_conv1d(module)
                                                                or is_pointwise_conv(module)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.MultiheadAttention):
            continue
        if id(module) not in seen:
            seen.add(id(module))
            if not (_selected(name, module, include, True) and not _selected(name, module, exclude, False)):
                continue
            targets[name] = module
            places[id(module)] = []
        if id(module) in places:
            places[id(module)].append((parent, child))
    if not targets:
        raise ValueError("sparsify: the model has no nn.Linear (or Conv1D, or 1x1 Conv2d) layer to sparsify with these "
                         "filters")
    shapes = {}
    for name, module in targets.items():
        w = module.weight
        shapes[name] = (w.shape[1], w.shape[0]) if _is_hf_conv1d(module) else (w.shape[0], w.shape[1])
    densities = erk_densities(shapes, density) if distribution == "erk" else {n: float(density) for n in shapes}
    counts = _nnz_per_layer(shapes, densities, density)
    empty = [name for name in shapes if counts[name] == 0]
    if empty:
        warnings.warn(f"snack.sparsify: at density {density:g} ({distribution}) the layers {', '.join(empty)} keep no "
                      "connection, so their outputs are their biases alone; raise the density or keep them dense "
                      "with exclude=", stacklevel=2)
    result = {}
    for name, module in targets.items():
        out_f, in_f = shapes[name]
        weight = module.weight.detach()
        weight = weight.t() if _is_hf_conv1d(module) else weight.flatten(1)  # a 1x1 kernel: [out, in]
        rows, cols = ops.random_slots(out_f, in_f, counts[name], generator=generator, device=weight.device)
        rows, cols = rows.long(), cols.long()
        kind = SparseConv2d if is_pointwise_conv(module) else SparseLinear
        sparse = kind.from_coo(rows, cols, weight[rows, cols], out_f, in_f,
                               bias=module.bias.detach() if module.bias is not None else None)
        if kind is SparseConv2d:
            sparse.stride = tuple(module.stride)
        for parent, child in places[id(module)]:
            setattr(parent, child, sparse)
            _keep_off_dense_fast_paths(parent)
        result[name] = counts[name] / float(out_f * in_f)
    return result
