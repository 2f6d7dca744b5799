"""Optimizers that update a SparseLinear's values inside the backward pass.

:class:`AdamW` is ``torch.optim.AdamW`` (same arguments, state and checkpoints) with one change:
the values of every :class:`snack.SparseLinear` whose parameters it holds are updated by the
layer's backward, in the kernel that computes their gradient (``snack.ops.sddmm_adamw_``). That
gradient is never stored: a step moves fewer bytes and runs fewer kernels, and ``values.grad``
stays ``None`` (4 bytes per connection less memory). Every other parameter (dense layers, ...)
is updated by ``step()`` as ``torch.optim.AdamW`` does.

The contract is explicit: the optimizer attaches a :class:`FusedAdamWUpdate` to each such layer
(``layer.fused_update``, see ``SparseLinear.attach_fused_update``), which hands the layer's forward
the state and settings its backward updates with; :meth:`AdamW.release` detaches them again, and an
optimizer built later over the same values takes them over.

The layer's bias, when this optimizer holds it, is updated the same way and in the same call, with
its own parameter group's settings (on the GPU the SDDMM's rows kernel sums the bias gradient from
the dY it reads anyway).

The update happens when the backward runs, so it suits the common loop
``zero_grad(); loss.backward(); step()`` on one process. What needs the values' gradient first
cannot be combined with it:

* gradient accumulation over several backward passes, and a layer applied twice in one forward
  (both raise ``RuntimeError`` in the backward, before a second update);
* gradient clipping, gradient scaling (AMP's ``GradScaler``: ``scaler.step`` raises while the
  optimizer fuses, after the backward has applied one update of the scaled gradient), and
  ``DistributedDataParallel``, which need the gradient before the update.

Under ``torch.autocast`` (bf16, or fp16 without a GradScaler) the fused update works as torch's
AdamW does on an autocast ``nn.Linear``: the layer computes in the autocast dtype from 16-bit
copies of its values and bias, and the backward computes their gradient from the 16-bit
operands, rounds it to 16 bits, and updates the float32 values, bias and moments.

Use ``torch.optim.AdamW`` for those (call :meth:`AdamW.release` first if a fused one was built); the
two share their state layout, so a checkpoint of one loads into the other. Capturing the whole step
in a CUDA graph works (the step count lives on the GPU). Under ``torch.compile`` the layer returns
its values' gradient as usual and ``step()`` applies the same AdamW to it: the fusion is an
eager-mode (and CUDA-graph) optimisation.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .layer import layer_of

__all__ = ["AdamW", "FusedAdamWUpdate"]


class FusedAdamWUpdate:
    """AdamW's step of one SparseLinear's values (and bias), run by the layer's backward.

    ``arguments(layer)`` gives the layer's forward the keyword arguments of
    ``snack.ops.sparse_linear_adamw``: the parameters' state (created as torch.optim.AdamW creates
    it, the step count on the device), their groups' current settings, and the update guard, a
    one-element CPU flag that the backward sets and the optimizer's ``step()`` clears (no second
    update before a step). It holds its optimizer weakly.
    """

    def __init__(self, optimizer: "AdamW") -> None:
        self._optimizer = weakref.ref(optimizer)
        self.update_guard = torch.zeros(1, dtype=torch.int64)

    def arguments(self, layer) -> dict:
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("snack.optim.AdamW: the optimizer attached to this SparseLinear no longer exists; "
                               "attach another one or call layer.attach_fused_update(None)")
        return optimizer._fused_arguments(layer, self.update_guard)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update of SparseLinear values is fused into their backward.

    Args: as ``torch.optim.AdamW`` (``params``, ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``maximize``, ``foreach``, ``capturable``, ``fused``: the last three choose how ``step()``
    updates the other parameters), except that ``amsgrad`` and ``differentiable`` are not offered
    and ``lr`` must be a number.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 fused: Optional[bool] = None) -> None:
        _check_lr(lr)  # before torch's own checks, which would name other options
        # The layers this optimizer updates in their backward, with the update attached to each.
        self._updates: dict = {}
        # id(parameter) -> index of its group (load_state_dict replaces the group dicts, not their
        # order). Keyed by id: the groups hold their parameters alive, and a plain dict is read on every
        # forward of every fused layer.
        self._group_index: dict[int, int] = {}
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                         maximize=maximize, foreach=foreach, capturable=capturable, fused=fused)
        # A step pre-hook, not an override of step(): a second step wrapper (profiling range, grad
        # mode) costs more host time than the hook.
        self.register_step_pre_hook(_clear_update_guards)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # While it fuses, GradScaler.step must come here rather than unscale gradients that the
        # fused values never had: _clear_update_guards then refuses the step (found_inf is set).
        return bool(self._updates)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value) -> None:
        pass  # torch.optim.Adam's __init__ assigns it (True only with fused=True); the property decides

    def add_param_group(self, param_group: dict) -> None:
        _check_lr(param_group.get("lr", self.defaults["lr"]))  # before the group is added: nothing half-done
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._group_index[id(p)] = len(self.param_groups) - 1
            self._attach(p)

    # ---- copies (copy.deepcopy, pickle) -------------------------------------------------------------
    def __getstate__(self) -> dict:
        return super().__getstate__()  # defaults, state, param_groups: no weak references, no hooks

    def __setstate__(self, state: dict) -> None:
        # A copy of the optimizer fuses again into the layers that own its (copied) values: a model
        # and its optimizer deep-copied or pickled together keep training the same way.
        super().__setstate__(state)
        self._updates, self._group_index = {}, {}
        self.register_step_pre_hook(_clear_update_guards)
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_index[id(p)] = index
                self._attach(p)

    def _attach(self, param: Tensor) -> None:
        layer = layer_of(param)
        if layer is not None:
            update = FusedAdamWUpdate(self)
            self._updates[id(layer)] = (weakref.ref(layer), update)
            layer.attach_fused_update(update)
            _FUSING.add(self)

    def release(self) -> None:
        """Detaches this optimizer's updates from its layers: their backward returns gradients again
        (for another optimizer, say). Layers whose update another optimizer took over keep that one."""
        for layer_ref, update in self._updates.values():
            layer = layer_ref()
            if layer is not None and layer.fused_update is update:
                layer.attach_fused_update(None)
        self._updates.clear()
        _FUSING.discard(self)

    def _group_of(self, param: Tensor) -> Optional[dict]:
        index = self._group_index.get(id(param))
        return self.param_groups[index] if index is not None else None

    def _state_of(self, param: Tensor) -> dict:
        """A parameter's AdamW state, created as torch.optim.AdamW creates it; the step count on its device."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif state["step"].device != param.device or state["step"].dtype != torch.float32:
            # A checkpoint of a torch.optim.AdamW without capturable/fused keeps the count on the CPU.
            state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
        return state

    @staticmethod
    def _hyper(group: dict) -> list[float]:
        beta1, beta2 = group["betas"]
        return [float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                float(bool(group["maximize"]))]

    def _fused_arguments(self, layer, update_guard: Tensor) -> dict:
        """The keyword arguments of snack.ops.sparse_linear_adamw for one forward of `layer`."""
        params = layer._parameters  # (not layer.values: see SparseLinear.forward)
        values, bias = params["values"], params.get("bias")
        group = self._group_of(values)
        if group is None:
            raise RuntimeError("snack.optim.AdamW: this SparseLinear's values are not in the optimizer attached to it")
        state = self._state_of(values)
        args = dict(state=[state["exp_avg"], state["exp_avg_sq"], state["step"]], hyper=self._hyper(group),
                    bias_state=[], update_guard=update_guard)
        bias_group = self._group_of(bias) if bias is not None and bias.requires_grad else None
        if bias_group is not None:
            bias_state = self._state_of(bias)
            args.update(bias_state=[bias_state["exp_avg"], bias_state["exp_avg_sq"], bias_state["step"]],
                        bias_hyper=self._hyper(bias_group))
        return args


def _check_lr(lr) -> None:
    if isinstance(lr, Tensor):
        raise ValueError("snack.optim.AdamW: lr must be a number (the fused update takes it as an argument)")


def _clear_update_guards(optimizer: AdamW, args, kwargs) -> None:
    """step() pre-hook: the values may be updated again by the next backward. Refuses a step from
    torch.amp.GradScaler, which sets found_inf for optimizers that handle scaling themselves."""
    if optimizer._updates and "found_inf" in vars(optimizer):
        # GradScaler removes its two attributes only after a step that returns: the next plain
        # step() must not see them.
        vars(optimizer).pop("found_inf", None)
        vars(optimizer).pop("grad_scale", None)
        raise RuntimeError(
            "snack.optim.AdamW cannot step under torch.amp.GradScaler: the update of SparseLinear values is fused "
            "into their backward, which has already applied it from the scaled gradient (no unscaling, no skip on "
            "inf). Train in bfloat16 (no scaler needed), or call release() and use torch.optim.AdamW with the scaler")
    for _, update in optimizer._updates.values():
        update.update_guard.zero_()


# The snack.optim.AdamW instances that have attached updates: what the hook below checks against.
_FUSING: "weakref.WeakSet[AdamW]" = weakref.WeakSet()


def _no_other_optimizer_steps_fused_values(optimizer, args, kwargs) -> None:
    """A step pre-hook of every torch optimizer: values whose update is fused into their layer's
    backward (by a snack.optim.AdamW) must not also be stepped by another optimizer, which would
    see no gradient (the update already happened) while the old one kept updating them silently.
    Costs nothing while no snack.optim.AdamW fuses; a set lookup per parameter otherwise."""
    if not _FUSING or isinstance(optimizer, AdamW):
        return
    fused = {id(layer.values) for fusing in list(_FUSING) for layer_ref, update in fusing._updates.values()
             if (layer := layer_ref()) is not None and layer.fused_update is update}
    if any(id(p) in fused for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): the values of a SparseLinear it holds are updated inside their "
            "backward by a snack.optim.AdamW that still exists; call that optimizer's release() (or "
            "layer.attach_fused_update(None)) before training them with another optimizer")


register_optimizer_step_pre_hook(_no_other_optimizer_steps_fused_values)
