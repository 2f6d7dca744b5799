"""Argument checks shared by the Python classes: each error names the argument and what it accepts.

The operators check their tensors in C++; these cover what only the Python API takes (numbers,
options, checkpoint entries) before anything is built or changed.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

#: The value dtypes of a sparse weight (the 16-bit ones are computed in float32).
VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)


def real_number(value, name: str, owner: str) -> float:
    """A Python or NumPy real, or a one-element real tensor, as a float; bools and complex numbers raise."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.is_meta:
            raise TypeError(f"{owner}: {name} must be a real number, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def integer(value, name: str, owner: str, *, minimum: Optional[int] = None) -> int:
    """A Python or NumPy integer (not a bool, not a float such as 2.5), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: {name} must be at least {minimum}, got {value}")
    return int(value)


def value_dtype(dtype, owner: str) -> None:
    """``dtype`` (None: the default dtype) is one a sparse weight can hold."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in VALUE_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in VALUE_DTYPES)
        raise TypeError(f"{owner}: values must be {names}, got {dtype}")


def checkpoint_tensor(state_dict: dict, key: str) -> Tensor:
    """A state_dict entry that can be loaded: a tensor with data (not on the meta device)."""
    value = state_dict[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"{key}: a checkpoint entry must be a tensor, got {type(value).__name__}")
    if value.is_meta:
        raise ValueError(f"{key}: the checkpoint's tensor is on the meta device (it has no data to load)")
    return value


def unexpected_keys(state_dict: dict, prefix: str, expected) -> list[str]:
    """The keys under ``prefix`` that name none of ``expected`` (local names, such as "values" or
    "pattern.row_idx"): what a strict load reports as unexpected for a module and its children."""
    return [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in expected]
