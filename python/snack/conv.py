"""Sparse pointwise (1x1) convolutions: the SparseLinear product over the channels of every pixel."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from ._checks import integer
from ._ops import ops
from .layer import SparseLinear, _check_activation

__all__ = ["SparseConv2d", "DepthwiseSeparable"]


def _pair(value, name: str) -> tuple[int, int]:
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"SparseConv2d: {name} must be an int or a pair, got {value!r}")
    return tuple(integer(v, name, "SparseConv2d", minimum=0) for v in pair)


def _check_pointwise(kernel_size, padding, groups) -> None:
    if _pair(kernel_size, "kernel_size") != (1, 1):
        raise ValueError(f"SparseConv2d: only 1x1 (pointwise) convolutions are sparse, got kernel_size={kernel_size!r}")
    if _pair(padding, "padding") != (0, 0):
        raise ValueError(f"SparseConv2d: a 1x1 convolution takes padding=0, got padding={padding!r}")
    if groups != 1:
        raise ValueError(f"SparseConv2d: groups must be 1 (a grouped or depthwise convolution stays dense), got {groups}")


def is_pointwise_conv(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Conv2d`` that SparseConv2d computes: a product over channels
    (1x1, no padding, which would add bias-only borders, no groups; dilation does not matter)."""
    return (isinstance(module, nn.Conv2d) and tuple(module.kernel_size) == (1, 1)
            and module.padding in ((0, 0), "valid") and module.groups == 1)


class SparseConv2d(SparseLinear):
    r"""A 1x1 convolution with a sparse weight ``[out_channels, in_channels]``:
    ``y[n, o, i, j] = act(sum_c W[o, c] x[n, c, s_h i, s_w j] + b[o])``.

    It is a :class:`SparseLinear` over the channels of every pixel (its ``values``, ``pattern``,
    optimizers, DST and checkpoints are those of a SparseLinear with ``in_features = in_channels``),
    applied to inputs ``[N, C, H, W]`` (or unbatched ``[C, H, W]``) as ``nn.Conv2d`` takes them. A
    ``channels_last`` input is read in place, its pixels being rows of channels. Where nothing needs
    a gradient (inference) an NCHW input goes to ``snack.ops.spmm_channels_first``, whose planner
    reads the images in place (each output channel a sum of whole input channels; on the CPU always),
    runs cuDNN's convolution on the weight expanded a block of output channels at a time (large
    products) or runs the product over pixels as rows between two transposes; under autograd
    an NCHW input is transposed into the channels-last layout (one copy) and trains as a
    SparseLinear. The output has the input's memory format.

    Args:
        in_channels, out_channels: channels of the input and the output.
        kernel_size: 1 (or (1, 1)); padding: 0; groups: 1. Other convolutions stay dense
            (``nn.Conv2d``; :func:`snack.sparsify` leaves them alone).
        stride: int or pair: the pixels read, every ``stride`` in each direction, as ``nn.Conv2d``.
        bias, density, sparsity, device, dtype, index_dtype, generator, activation: as for
            :class:`SparseLinear` (``activation`` "relu" or "gelu" fused into the product).
    """

    stride: tuple[int, int] = (1, 1)

    def __init__(self, in_channels: int, out_channels: int, kernel_size=1, stride=1, padding=0, groups: int = 1,
                 bias: bool = True, *, density: Optional[float] = None, sparsity: Optional[float] = None, device=None,
                 dtype=None, index_dtype: Optional[torch.dtype] = None, generator: Optional[torch.Generator] = None,
                 activation: Optional[str] = None) -> None:
        _check_pointwise(kernel_size, padding, groups)
        stride = self._checked_stride(stride)
        super().__init__(in_channels, out_channels, bias, density=density, sparsity=sparsity, device=device,
                         dtype=dtype, index_dtype=index_dtype, generator=generator, activation=activation)
        self.stride = stride

    @staticmethod
    def _checked_stride(stride) -> tuple[int, int]:
        pair = _pair(stride, "stride")
        if min(pair) < 1:
            raise ValueError(f"SparseConv2d: stride must be >= 1, got {stride!r}")
        return pair

    @property
    def in_channels(self) -> int:
        return self.in_features

    @property
    def out_channels(self) -> int:
        return self.out_features

    @property
    def kernel_size(self) -> tuple[int, int]:
        return (1, 1)

    # ---- construction helpers ----------------------------------------------------------------------
    @classmethod
    def from_dense(cls, conv_or_weight: Union[nn.Conv2d, Tensor], density: Optional[float] = None, *,
                   sparsity: Optional[float] = None, mask: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                   index_dtype: Optional[torch.dtype] = None, stride=None) -> "SparseConv2d":
        """Builds a layer from a 1x1 ``nn.Conv2d`` or a weight ``[out, in]`` / ``[out, in, 1, 1]``,
        keeping the entries of largest magnitude (or those of ``mask``) as
        :meth:`SparseLinear.from_dense` does. The stride comes from the convolution, or ``stride=``."""
        if isinstance(conv_or_weight, nn.Conv2d):
            conv = conv_or_weight
            if not is_pointwise_conv(conv):
                raise ValueError(f"SparseConv2d.from_dense: only 1x1 convolutions without padding or groups are sparse, "
                                 f"got kernel_size={conv.kernel_size}, padding={conv.padding}, groups={conv.groups}")
            weight = conv.weight
            bias = conv.bias if bias is None else bias
            stride = conv.stride if stride is None else stride
        elif isinstance(conv_or_weight, Tensor):
            weight = conv_or_weight
        else:
            raise TypeError(f"SparseConv2d.from_dense: expected nn.Conv2d or a Tensor, got {type(conv_or_weight)}")
        if weight.dim() == 4:
            if tuple(weight.shape[2:]) != (1, 1):
                raise ValueError(f"SparseConv2d.from_dense: weight must be [out, in, 1, 1], got {tuple(weight.shape)}")
            weight = weight.flatten(1)
        if mask is not None and mask.dim() == 4:
            mask = mask.flatten(1)
        layer = super().from_dense(weight, density, sparsity=sparsity, mask=mask, bias=bias, index_dtype=index_dtype)
        layer.stride = cls._checked_stride(1 if stride is None else stride)
        return layer

    def to_conv2d(self) -> nn.Conv2d:
        """A dense ``nn.Conv2d`` with the same weight, bias and stride (the fused activation is not part of it)."""
        conv = nn.Conv2d(self.in_channels, self.out_channels, 1, stride=self.stride, bias=self.bias is not None,
                         device=self.values.device, dtype=self.values.dtype)
        with torch.no_grad():
            conv.weight.copy_(self.to_dense()[:, :, None, None])
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    # ---- the layer -------------------------------------------------------------------------------
    def _pixels(self, x: Tensor) -> Tensor:
        """x [N, C, H, W] or [C, H, W], strided, with the channels last: [..., H', W', C]."""
        if not isinstance(x, Tensor) or x.dim() not in (3, 4):
            raise ValueError(f"SparseConv2d: input must be [N, C, H, W] or [C, H, W], got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.shape[-3] != self.in_channels:
            raise ValueError(f"SparseConv2d: input has {x.shape[-3]} channels, the layer {self.in_channels}")
        if self.stride != (1, 1):
            x = x[..., ::self.stride[0], ::self.stride[1]]
        return x.movedim(-3, -1)

    def forward(self, x: Tensor) -> Tensor:
        pixels = self._pixels(x)
        channels_last = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        if not channels_last and not self._needs_grad(x):
            images = pixels.movedim(-1, -3)  # [..., C, H', W'], x or its strided view
            images = images if images.dim() == 4 else images.unsqueeze(0)
            n, c, h, w = images.shape
            y = ops.spmm_channels_first(images.reshape(n, c, h * w), self.values, self.pattern.tensors, self.bias,
                                        self.activation)
            y = y.view(n, self.out_channels, h, w)
            return y if x.dim() == 4 else y[0]
        y = super().forward(pixels).movedim(-1, -3)
        if channels_last:
            return y  # already channels_last: [N, H', W', O] in memory
        return y.contiguous()

    def _needs_grad(self, x: Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.values.requires_grad
                                            or (self.bias is not None and self.bias.requires_grad))

    def product_rows(self, x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's input and output gradient of one call as the matrices of its product: one row
        per output pixel, ``[pixels, in_channels]`` and ``[pixels, out_channels]``."""
        return (self._pixels(x).reshape(-1, self.in_channels),
                dy.movedim(-3, -1).reshape(-1, self.out_channels))

    def extra_repr(self) -> str:
        stride = f", stride={self.stride}" if self.stride != (1, 1) else ""
        return (super().extra_repr().replace("in_features=", "in_channels=").replace("out_features=", "out_channels=")
                + stride)


def is_fusable_depthwise(module: nn.Module) -> bool:
    """Whether ``module`` is a depthwise convolution that :class:`DepthwiseSeparable` runs in its
    kernel: ``nn.Conv2d`` with 3x3 kernels, one per channel (``groups == in_channels ==
    out_channels``), zero padding of 1, stride 1 or 2 and no dilation."""
    return (isinstance(module, nn.Conv2d) and tuple(module.kernel_size) == (3, 3)
            and module.groups == module.in_channels == module.out_channels
            and tuple(module.padding) == (1, 1) and module.padding_mode == "zeros"
            and tuple(module.dilation) == (1, 1) and module.stride in ((1, 1), (2, 2)))


class DepthwiseSeparable(nn.Module):
    r"""A depthwise-separable convolution for inference: a dense 3x3 depthwise ``nn.Conv2d``, an
    activation, then a :class:`SparseConv2d` (with its bias and fused activation), as MobileNet's
    blocks are, run as one kernel (``snack.ops.separable_conv``).

    On CUDA, for NCHW or ``channels_last`` inputs of float32, bfloat16 or float16 whose channels fit
    the device's shared memory (up to ~1100 on an H100 or H200; channels_last, a multiple of 4 in
    float32 and of 8 in 16 bits), a block of the kernel computes the depthwise output of a tile of
    pixels into shared memory and the sparse product reads it there: that output never reaches global
    memory, and one kernel runs where the two convolutions and their activations take three or four.
    Other inputs run the two apart, with the same result up to rounding. The output has the input's
    memory format.

    Where a gradient is needed (training), it runs its two modules as they are, so the parameters
    train as before; :func:`snack.fuse_for_inference` builds it from a model's modules.

    Args:
        depthwise: the depthwise convolution (see :func:`is_fusable_depthwise`), bias optional.
        pointwise: the :class:`SparseConv2d` after it (stride 1).
        activation: "relu", "gelu" (exact) or None: what follows the depthwise convolution.
    """

    def __init__(self, depthwise: nn.Conv2d, pointwise: SparseConv2d, activation: Optional[str] = None) -> None:
        super().__init__()
        if not is_fusable_depthwise(depthwise):
            raise ValueError(f"DepthwiseSeparable: depthwise must be a 3x3 nn.Conv2d with groups = channels, padding 1, "
                             f"stride 1 or 2 and no dilation, got {depthwise}")
        if not isinstance(pointwise, SparseConv2d) or pointwise.stride != (1, 1):
            raise ValueError(f"DepthwiseSeparable: pointwise must be a SparseConv2d of stride 1, got {pointwise}")
        if pointwise.in_channels != depthwise.out_channels:
            raise ValueError(f"DepthwiseSeparable: the depthwise convolution has {depthwise.out_channels} channels, "
                             f"the pointwise one takes {pointwise.in_channels}")
        self.activation = _check_activation(activation, "DepthwiseSeparable")
        self.depthwise = depthwise
        self.pointwise = pointwise

    def _depthwise_output(self, x: Tensor) -> Tensor:
        z = self.depthwise(x)
        if self.activation == "relu":
            return torch.relu(z)
        return torch.nn.functional.gelu(z) if self.activation == "gelu" else z

    def forward(self, x: Tensor) -> Tensor:
        params = (self.depthwise.weight, self.depthwise.bias, self.pointwise.values, self.pointwise.bias)
        if x.dim() != 4 or (torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for p in params))):
            return self.pointwise(self._depthwise_output(x))
        return ops.separable_conv(x, self.depthwise.weight, self.depthwise.bias, self.depthwise.stride[0],
                                  self.activation, self.pointwise.values, self.pointwise.pattern.tensors,
                                  self.pointwise.bias, self.pointwise.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"
