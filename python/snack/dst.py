"""Dynamic sparse training: prune and regrow the connections of SparseLinear layers during training.

The topology work runs in C++ operators (``snack.ops.prune_slots``, ``sample_absent``,
``topk_absent_gradient``, ``replace_slots``, ``remap_slots_``) on the layer's device; this module
decides when and how much. ``DSTScheduler`` attaches to the user's optimizer with ``register_step_post_hook`` (no
monkey-patching) and carries the optimizer state of every moved connection along.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Union

import torch
from torch import nn

from ._checks import SIXTEEN_BIT_DTYPES, integer, real_number
from ._ops import ops
from .layer import SparseLinear, check_grow_init

__all__ = ["DSTRule", "SET", "RigL", "DSTScheduler", "DenseMaskLinear", "prune_magnitude", "grow_random",
           "grow_gradient"]


class DenseMaskLinear(nn.Module):
    """The Dense+Mask baseline of dynamic sparse training: a dense weight times a 0/1 mask.

    What DST code usually does, kept here as a reference to compare with (no memory saved, dense
    compute). It offers the slot interface of SparseLinear (``values``, ``row_idx``, ``col_idx``,
    ``nnz``, ``update_topology``), so DSTScheduler and the rules drive it the same way: with the same
    seeds it follows the same topology path as a SparseLinear built from the same weights.
    """

    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter((weight * mask).detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.register_buffer("mask_", mask.detach().to(weight.dtype).clone())
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_sparse(cls, layer: SparseLinear) -> "DenseMaskLinear":
        return cls(layer.to_dense().detach(), layer.mask(), layer.bias)

    def forward(self, x):
        return nn.functional.linear(x, self.weight * self.mask_, self.bias)

    product_rows = SparseLinear.product_rows  # the same product: rows of x against rows of dy
    gradient_rows = SparseLinear.product_rows  # no fused activation

    def _active(self) -> torch.Tensor:
        return self.mask_.flatten().nonzero().flatten()  # ascending = the slot order of SparseLinear

    @property
    def row_idx(self):
        return self._active() // self.in_features

    @property
    def col_idx(self):
        return self._active() % self.in_features

    @property
    def values(self):
        return self.weight.flatten()[self._active()]

    @property
    def nnz(self) -> int:
        return int(self.mask_.sum().item())

    @property
    def density(self) -> float:
        return self.nnz / float(self.out_features * self.in_features)

    def update_topology(self, drop, grow, *, optimizer=None, init=None, state_reset="zero", validate=True) -> int:
        return self.commit_topology_update(self.prepare_topology_update(drop, grow, optimizer=optimizer, init=init,
                                                                        state_reset=state_reset, validate=validate))

    def prepare_topology_update(self, drop, grow, *, optimizer=None, init=None, state_reset="zero", validate=True):
        """Checks the update and computes the positions it changes; changes nothing."""
        if not (init is None or (isinstance(init, str) and init == "zero")):
            raise ValueError("DenseMaskLinear grows connections at zero only")
        active = self._active()
        drop_pos = active[drop.to(active.device)]
        grow_pos = grow.to(active.device)
        if validate:
            remaining = self.mask_.view(-1).clone()
            remaining[drop_pos] = 0
            if bool(remaining[grow_pos].any()):
                raise ValueError("grow names a position that stays connected")
        return (drop_pos, grow_pos, optimizer, int(drop.numel()))

    def commit_topology_update(self, update) -> int:
        drop_pos, grow_pos, optimizer, moved = update
        with torch.no_grad():
            flat_mask = self.mask_.view(-1)
            flat_mask[drop_pos] = 0
            flat_mask[grow_pos] = 1
            self.weight.view(-1)[drop_pos] = 0
            self.weight.view(-1)[grow_pos] = 0
            state = optimizer.state.get(self.weight, {}) if optimizer is not None else {}
            for value in state.values():
                if torch.is_tensor(value) and value.shape == self.weight.shape:
                    value.view(-1)[grow_pos] = 0
            if self.weight.grad is not None:
                self.weight.grad.view(-1)[grow_pos] = 0
        return moved


def prune_magnitude(layer: SparseLinear, k: int, score: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Slots of the k smallest |value| (or smallest ``score``), ties to the lower slot."""
    return ops.prune_slots(layer.values.detach().abs() if score is None else score, k)


def grow_random(layer: SparseLinear, k: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """k absent positions drawn uniformly without replacement (SET)."""
    return ops.sample_absent(layer.row_idx, layer.col_idx, layer.out_features, layer.in_features, k,
                             generator=generator)


def grow_gradient(layer: SparseLinear, k: int, x: torch.Tensor, dy: torch.Tensor, block_rows: int = 0) -> torch.Tensor:
    """The k absent positions of largest |dense gradient| = |dY^T X| (RigL), ties to the smaller
    position, without ever holding the dense gradient: on the GPU with up to 256 rows of ``x`` the
    scores are recomputed in registers (``block_rows`` does not matter); otherwise they are computed
    ``block_rows`` output rows at a time (0: blocks of about 2^23 scores, 32 MiB in fp32).

    ``x`` and ``dy``: the rows of the product, ``[rows, in_features]`` and ``[rows, out_features]``,
    with ``dy`` the gradient at the product's output, before the layer's fused activation if it has
    one: what ``layer.gradient_rows(input, output_gradient)`` returns and the scheduler passes. Other
    shapes (a SparseConv2d's images, a 3-D batch) are taken to rows by ``layer.product_rows``.

    A 16-bit ``dy`` (a layer run under autocast) keeps the scores in that precision's operands: ``x``
    is cast to it, as the layer's product cast it, and on the GPU the blocks are tensor-core GEMMs
    accumulated and ranked in fp32. Otherwise both are taken in the layer's values' dtype."""
    dtype = dy.dtype if dy.dtype in SIXTEEN_BIT_DTYPES else layer.values.dtype
    x2, dy2 = (x, dy) if x.dim() == 2 and dy.dim() == 2 else layer.product_rows(x, dy)
    return ops.topk_absent_gradient(dy2.to(dtype), x2.to(dtype), layer.row_idx, layer.col_idx, k, block_rows)


class DSTRule:
    """A prune-and-grow rule. Subclass and override ``prune`` and/or ``grow``.

    ``needs_gradient``: on the step before an update, the scheduler calls ``grow`` during the backward
    pass, as soon as the layer's output gradient is known (so that only one layer's are alive at a
    time), with the rows of the layer's product: ``x`` ``[rows, in_features]`` and ``dy``
    ``[rows, out_features]``, the gradient at the product's output (before a fused activation), so
    that ``dy^T x`` is the dense gradient of the weight (``layer.gradient_rows``). A layer called
    several times in one forward gets every call's rows, concatenated in call order. ``prune`` runs
    at the optimizer step, after the weights moved. Rules without it have both called at the step."""

    needs_gradient = False

    def prune(self, layer: SparseLinear, k: int) -> torch.Tensor:
        return prune_magnitude(layer, k)

    def grow(self, layer: SparseLinear, k: int, *, generator=None, x=None, dy=None) -> torch.Tensor:
        raise NotImplementedError


class SET(DSTRule):
    """Prune by magnitude, regrow uniformly at random (Mocanu et al. 2018)."""

    def grow(self, layer, k, *, generator=None, x=None, dy=None):
        return grow_random(layer, k, generator)


class RigL(DSTRule):
    """Prune by magnitude, regrow by |dense gradient| (Evci et al. 2020)."""

    needs_gradient = True

    def grow(self, layer, k, *, generator=None, x=None, dy=None):
        if x is None or dy is None:
            raise RuntimeError("RigL needs the input and output gradient of the step before the update")
        return grow_gradient(layer, k, x, dy)


_SCHEDULES = ("cosine", "constant", "linear")


def _agree_across_ranks(drop: torch.Tensor, grow: torch.Tensor):
    """Under torch.distributed, every rank applies rank 0's decision, so that all ranks end each
    update with the same topology (ranks see different batches, so their own scores differ)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return drop, grow
    backend_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    both = torch.cat([drop.long(), grow.long()]).to(backend_device)
    dist.broadcast(both, src=0)
    both = both.to(drop.device)
    return both[: drop.numel()], both[drop.numel():]


class DSTScheduler:
    """Updates the topology of every SparseLinear of ``model`` every ``update_every`` optimizer steps
    between ``start`` and ``end``: prunes ``fraction(step)`` of each layer's connections and regrows as
    many, where ``fraction`` follows ``drop_schedule`` from ``drop_fraction`` ("cosine" decays it to 0
    at ``end``, "linear" likewise, "constant" keeps it; or a callable(step) -> fraction).

    Call nothing yourself: the scheduler runs after each ``optimizer.step()``. ``step()`` (also called
    by the hook) returns whether the topology changed at this step. ``state_dict()``/``load_state_dict``
    make a resumed run follow the same topology path. Under ``torch.distributed`` (DDP) every rank
    applies rank 0's prune/grow decision, so all ranks keep identical topologies.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 algorithm: Union[str, DSTRule] = "set", update_every: int = 100, start: int = 0,
                 end: Optional[int] = None, drop_fraction: float = 0.3,
                 drop_schedule: Union[str, Callable[[int], float]] = "cosine", grow_init="zero",
                 generator: Optional[torch.Generator] = None) -> None:
        if isinstance(algorithm, str):
            rules = {"set": SET, "rigl": RigL}
            if algorithm not in rules:
                raise ValueError(f"algorithm must be 'set', 'rigl' or a DSTRule, got {algorithm!r}")
            algorithm = rules[algorithm]()
        if not isinstance(algorithm, DSTRule):
            raise TypeError("algorithm must be 'set', 'rigl' or a DSTRule instance")
        owner = "DSTScheduler"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{owner}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        update_every = integer(update_every, "update_every", owner, minimum=1)
        start = integer(start, "start", owner, minimum=0)
        if end is not None:
            end = integer(end, "end", owner)
            if end <= start:
                raise ValueError(f"{owner}: end ({end}) must come after start ({start})")
        drop_fraction = real_number(drop_fraction, "drop_fraction", owner)
        if not 0.0 <= drop_fraction <= 1.0:
            raise ValueError(f"{owner}: drop_fraction must lie in [0, 1], got {drop_fraction}")
        if not callable(drop_schedule) and drop_schedule not in _SCHEDULES:
            raise ValueError(f"{owner}: drop_schedule must be one of {_SCHEDULES} or a callable, got {drop_schedule!r}")
        check_grow_init(grow_init, f"{owner}: grow_init")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{owner}: generator must be a torch.Generator, got {type(generator).__name__}")
        if generator is None and isinstance(algorithm, SET):
            warnings.warn(f"{owner}: no generator given: {type(algorithm).__name__} regrows from torch's global "
                          "random state, which its state_dict() cannot restore, so a resumed run will take another "
                          "topology path; pass generator=torch.Generator().manual_seed(...) to make it reproducible",
                          stacklevel=2)
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, (SparseLinear, DenseMaskLinear))}
        if not self.layers:
            raise ValueError("DSTScheduler: the model has no SparseLinear layer (use snack.sparsify first)")
        self.optimizer, self.rule = optimizer, algorithm
        self.update_every, self.start, self.end = update_every, start, end
        self.drop_fraction, self.drop_schedule, self.grow_init = drop_fraction, drop_schedule, grow_init
        self.generator = generator
        self.steps = 0
        self.last_moved = {name: 0 for name in self.layers}
        self._grown = {}  # layer name -> grow decision (or its error) made during the backward pass
        self._calls = {}  # layer name -> its calls of this forward: {"count": n, "rows": {call: (x, dy)}}
        self._warned_accumulation = False
        self._early_generator_states = []
        self._hooks = [optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())]
        if self.rule.needs_gradient:
            for name, layer in self.layers.items():
                self._hooks.append(layer.register_forward_pre_hook(self._autocast_input_hook, with_kwargs=True))
                self._hooks.append(layer.register_forward_hook(self._capture_hook(name), with_kwargs=True))

    # ---- schedule ---------------------------------------------------------------------------------
    def fraction(self, step: int) -> float:
        if callable(self.drop_schedule):
            return float(self.drop_schedule(step))
        if self.drop_schedule == "constant" or self.end is None:
            return self.drop_fraction
        progress = min(1.0, max(0.0, (step - self.start) / max(1, self.end - self.start)))
        if self.drop_schedule == "linear":
            return self.drop_fraction * (1.0 - progress)
        return self.drop_fraction * 0.5 * (1.0 + math.cos(math.pi * progress))

    def is_update_step(self, step: int) -> bool:
        return (step >= self.start and (self.end is None or step < self.end) and step > 0
                and step % self.update_every == 0)

    # ---- gradient-based growth, during the backward pass ------------------------------------------
    def _count(self, layer, step: int) -> int:
        """Connections to move in ``layer`` at update step ``step``."""
        k = int(self.fraction(step) * layer.nnz)
        return min(k, layer.nnz, layer.out_features * layer.in_features - layer.nnz)

    @staticmethod
    def _input_key(args, kwargs):
        """Where the layer's input is in a forward call: 0 (the first positional argument), "x", or None."""
        if args:
            return 0 if torch.is_tensor(args[0]) else None
        return "x" if torch.is_tensor(kwargs.get("x")) else None

    def _autocast_input_hook(self, module, args, kwargs):
        # On the step before an update, under autocast, the layer gets its input already in the
        # autocast dtype (the cast autocast would make, so the same product and gradient): the capture
        # below then holds the very tensor the layer saves for its backward, not also the wider
        # original (GPT-2 small at 8 x 1024: 1.7 GiB of float32 LayerNorm and GELU outputs).
        key = self._input_key(args, kwargs)
        if key is None or not self.is_update_step(self.steps + 1):
            return None
        x = args[0] if key == 0 else kwargs["x"]
        kind = x.device.type
        if not (torch.is_grad_enabled() and torch.is_autocast_enabled(kind) and x.is_floating_point()
                and x.dtype != torch.float64):
            return None
        dtype = torch.get_autocast_dtype(kind)
        if x.dtype == dtype:
            return None
        if key == 0:
            return (x.to(dtype),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "x": x.to(dtype)}

    def _capture_hook(self, name):
        # The rule's grow runs as soon as the layer's output gradient arrives, so that X and dY of one
        # layer at a time are alive, not those of every layer until the optimizer step. The topology
        # does not change before the step, so the decision is the one the step would make; an error
        # is raised by the step. A layer called n times in one forward (a shared layer) is decided
        # when the n-th gradient arrives, from every call's rows: dY^T X of their concatenation is the
        # sum of the calls' gradients.
        def hook(module, args, kwargs, output):
            step = self.steps + 1
            key = self._input_key(args, kwargs)
            if key is None or not self.is_update_step(step) or not torch.is_grad_enabled():
                return
            if name in self._grown:  # decided by an earlier backward of this step: a later micro-batch
                if not self._warned_accumulation:
                    self._warned_accumulation = True
                    warnings.warn(f"DSTScheduler: layer {name!r} ran forward again after its backward in the step "
                                  f"before a {type(self.rule).__name__} update (gradient accumulation?): its growth "
                                  "is scored on the gradient of the last backward pass, not on the accumulated one",
                                  stacklevel=2)
                del self._grown[name]
                self._drop_calls(name)
            calls = self._calls.setdefault(name, {"count": 0, "rows": {}})
            call = calls["count"]
            calls["count"] += 1
            # Handed over once: the graph's nodes keep this hook (and what it holds) for as long as
            # the caller keeps the loss, usually until the next step.
            held = [(args[0] if key == 0 else kwargs["x"]).detach()]

            def grow_now(grad):
                if not held or self._calls.get(name) is not calls:  # a second backward through a retained graph
                    return
                x = held.pop()
                k = self._count(module, step)
                if k <= 0:
                    return
                try:
                    calls["rows"][call] = module.gradient_rows(x, grad.detach())
                except Exception as exc:  # raised by the step; the layer's other calls are not decided
                    self._grown[name] = exc
                    self._drop_calls(name)
                    return
                if len(calls["rows"]) == calls["count"]:
                    self._decide(name, module, k)

            output.register_hook(grow_now)
        return hook

    def _drop_calls(self, name=None) -> None:
        """Forgets the calls of layer ``name`` (None: of every layer) and the rows they hold: the hooks
        on the graph still reach each calls' dict for as long as the caller keeps the loss."""
        for calls in [self._calls.pop(name, None)] if name is not None else list(self._calls.values()):
            if calls is not None:
                calls["rows"].clear()
        if name is None:
            self._calls.clear()

    def _decide(self, name: str, module, k: int) -> None:
        """The rule's growth of ``module`` from the rows its calls left (or its error, raised by the step)."""
        calls = self._calls[name]
        rows = [calls["rows"][c] for c in sorted(calls["rows"])]
        self._drop_calls(name)
        x = rows[0][0] if len(rows) == 1 else torch.cat([r[0] for r in rows])
        dy = rows[0][1] if len(rows) == 1 else torch.cat([r[1] for r in rows])
        if not self._early_generator_states:  # the first draw of this update: kept for a rollback
            self._early_generator_states = self._save_generators()
        try:
            self._grown[name] = self.rule.grow(module, k, generator=self.generator, x=x, dy=dy)
        except Exception as exc:  # raised by the step, which restores the generators
            self._grown[name] = exc

    def _save_generators(self) -> list:
        # (A CUDA generator cannot report its state while a graph is captured; nothing is retried there.)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return [(g, g.get_state()) for g in self._generators() if not (capturing and g.device.type == "cuda")]

    # ---- the update -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Counts an optimizer step; updates the topology when the schedule says so. Returns whether it did.

        An update is all or nothing: every layer's decision is made and checked (rules, custom or
        not, run here, or for rules that need the gradient, their grow during the backward pass)
        before any layer changes; if anything raises, every layer, the optimizer's state, the step
        count and the random generators are left as they were."""
        step = self.steps + 1
        if not self.is_update_step(step):
            self.steps = step
            self._grown.clear()
            self._drop_calls()
            self._early_generator_states = []
            return False
        for name in [n for n, calls in self._calls.items() if calls["rows"] and n not in self._grown]:
            # Some calls' outputs took no part in the loss: decided from those that did.
            self._decide(name, self.layers[name], self._count(self.layers[name], step))
        self._drop_calls()
        saved = self._early_generator_states or self._save_generators()
        grown, self._grown, self._early_generator_states = self._grown, {}, []
        try:
            updates = []
            for name, layer in self.layers.items():
                k = self._count(layer, step)
                if k <= 0:
                    updates.append((name, layer, None))
                    continue
                drop = self.rule.prune(layer, k)
                grow = grown.get(name)
                if isinstance(grow, Exception):
                    raise grow
                if grow is None:  # a rule without the gradient, or a layer the backward did not reach
                    grow = self.rule.grow(layer, k, generator=self.generator, x=None, dy=None)
                drop, grow = _agree_across_ranks(drop, grow)
                # SET and RigL produce valid decisions by construction; a custom rule's are checked.
                trusted = type(self.rule) in (SET, RigL)
                updates.append((name, layer, layer.prepare_topology_update(
                    drop, grow, optimizer=self.optimizer, init=self.grow_init, validate=not trusted)))
        except BaseException:
            for g, state in saved:
                g.set_state(state)
            raise
        for name, layer, update in updates:
            self.last_moved[name] = layer.commit_topology_update(update) if update is not None else 0
        self.steps = step
        return any(update is not None for _, _, update in updates)

    def _generators(self) -> list:
        """The generators an update draws from: the scheduler's, else torch's default ones of the layers' devices."""
        if self.generator is not None:
            return [self.generator]
        devices = {layer.values.device if isinstance(layer, SparseLinear) else layer.weight.device
                   for layer in self.layers.values()}
        generators = [torch.default_generator]
        for d in devices:
            if d.type == "cuda":
                generators.append(torch.cuda.default_generators[d.index if d.index is not None
                                                                else torch.cuda.current_device()])
        return generators

    def report(self) -> list[dict]:
        return [{"layer": name, "nnz": layer.nnz, "density": layer.density, "moved": self.last_moved[name]}
                for name, layer in self.layers.items()]

    def state_dict(self) -> dict:
        return {"steps": self.steps, "last_moved": dict(self.last_moved),
                "generator": self.generator.get_state() if self.generator is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()``: the step count, the moves last reported and the generator's state."""
        if not isinstance(state, dict) or "steps" not in state:
            raise ValueError("DSTScheduler.load_state_dict: expected the dict of DSTScheduler.state_dict()")
        steps = integer(state["steps"], "steps", "DSTScheduler.load_state_dict", minimum=0)
        generator_state = state.get("generator")
        if generator_state is not None and self.generator is None:
            warnings.warn("DSTScheduler.load_state_dict: the checkpoint has a generator state but this scheduler has "
                          "no generator: the resumed run will take another topology path", stacklevel=2)
        if generator_state is not None and self.generator is not None:
            self.generator.set_state(generator_state)  # first: it is what can still fail
        self.steps = steps
        self.last_moved.update(state.get("last_moved", {}))

    def remove(self) -> None:
        """Detaches the scheduler from the optimizer and the layers."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
