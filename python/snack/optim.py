"""Optimizers that update a SparseLinear's values inside the backward pass.

:class:`AdamW` is ``torch.optim.AdamW`` (same arguments, state and checkpoints) with one change:
the values of every :class:`snack.SparseLinear` whose parameters it holds are updated by the
layer's backward, in the kernel that computes their gradient (``snack.ops.sddmm_adamw_``). That
gradient is never stored: a step moves fewer bytes and runs fewer kernels, and ``values.grad``
stays ``None`` (4 bytes per connection less memory). Every other parameter (dense layers, ...)
is updated by ``step()`` as ``torch.optim.AdamW`` does.

The layer's bias, when this optimizer holds it, is updated the same way and in the same call
(``sddmm_adamw_`` with the bias's state; on the GPU the SDDMM's rows kernel sums the bias gradient
from the dY it reads anyway), with its own parameter group's settings.

The update happens when the backward runs, so it suits the common loop
``zero_grad(); loss.backward(); step()`` on one process. What needs the values' gradient first
cannot be combined with it:

* gradient accumulation over several backward passes, and a layer applied twice in one forward
  (both raise ``RuntimeError`` in the backward, before a second update);
* gradient clipping, gradient scaling (AMP's ``GradScaler``), and ``DistributedDataParallel``,
  which need the gradient before the update.

Use ``torch.optim.AdamW`` for those; the two share their state layout, so a checkpoint of one
loads into the other. Capturing the whole step in a CUDA graph works (the step count lives on the
GPU). Under ``torch.compile`` the layer returns its values' gradient as usual and ``step()``
applies the same AdamW to it: the fusion is an eager-mode (and CUDA-graph) optimisation.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ._ops import ops

__all__ = ["AdamW"]

# values Parameter -> the AdamW that updates it in the backward (a weak reference both ways).
_IN_BACKWARD: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
        # Per values Parameter, a one-element CPU flag: set by the backward that updates it, cleared
        # before every step(); the backward refuses a second update before a step (the accumulation
        # guard). A step pre-hook, not an override of step(): a second step wrapper (profiling
        # range, grad mode) costs more host time than the hook.
        self._update_guards = WeakIdKeyDictionary()
        # Parameter -> index of its group (load_state_dict replaces the group dicts, not their order).
        self._group_index = WeakIdKeyDictionary()
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                         maximize=maximize, foreach=foreach, capturable=capturable, fused=fused)
        self.register_step_pre_hook(_clear_update_guards)

    def add_param_group(self, param_group: dict) -> None:
        _check_lr(param_group.get("lr", self.defaults["lr"]))  # before the group is added: nothing half-done
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            _IN_BACKWARD[p] = weakref.ref(self)
            self._group_index[p] = len(self.param_groups) - 1

    def _slot_state(self, values: Tensor) -> dict:
        """A parameter's AdamW state, created as torch.optim.AdamW creates it; the step count on its device."""
        state = self.state[values]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=values.device)
            state["exp_avg"] = torch.zeros_like(values, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(values, memory_format=torch.preserve_format)
        elif state["step"].device != values.device or state["step"].dtype != torch.float32:
            # A checkpoint of a torch.optim.AdamW without capturable/fused keeps the count on the CPU.
            state["step"] = state["step"].to(device=values.device, dtype=torch.float32)
        return state

    def _apply_layer(self, layer, x: Tensor) -> Tensor:
        """layer(x), with AdamW's update of layer.values (and of layer.bias, when this optimizer holds
        it and it learns) in the backward."""
        values, bias = layer.values, layer.bias
        group = self.param_groups[self._group_index[values]]
        state = self._slot_state(values)
        beta1, beta2 = group["betas"]
        guard = self._update_guards.get(values)
        if guard is None:
            guard = self._update_guards[values] = torch.zeros(1, dtype=torch.int64)
        bias_args = {}
        bias_index = self._group_index.get(bias) if bias is not None and bias.requires_grad else None
        if bias_index is not None:
            bias_group, bias_state = self.param_groups[bias_index], self._slot_state(bias)
            b1, b2 = bias_group["betas"]
            bias_args = dict(bias_exp_avg=bias_state["exp_avg"], bias_exp_avg_sq=bias_state["exp_avg_sq"],
                             bias_step=bias_state["step"],
                             bias_hyper=[float(bias_group["lr"]), float(b1), float(b2), float(bias_group["eps"]),
                                         float(bias_group["weight_decay"]), float(bool(bias_group["maximize"]))])
        return ops.sparse_linear_adamw(x, values, bias, layer.row_idx, layer.col_idx, layer.row_ptr,
                                       layer.col_ptr, layer.csc_perm, state["exp_avg"], state["exp_avg_sq"],
                                       state["step"], guard, float(group["lr"]), float(beta1), float(beta2),
                                       float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"]),
                                       layer.activation, **bias_args)


def _check_lr(lr) -> None:
    if isinstance(lr, Tensor):
        raise ValueError("snack.optim.AdamW: lr must be a number (the fused update takes it as an argument)")


def _clear_update_guards(optimizer: AdamW, args, kwargs) -> None:
    """step() pre-hook: the values may be updated again by the next backward."""
    for flag in optimizer._update_guards.values():
        flag.zero_()


def in_backward_optimizer(values: Tensor) -> Optional[AdamW]:
    """The snack.optim.AdamW that updates `values` in the backward, or None."""
    ref = _IN_BACKWARD.get(values)
    return ref() if ref is not None else None
