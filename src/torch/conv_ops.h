// What the CPU and CUDA implementations of snack::separable_conv share (conv_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "op_args.h"
#include "snack/conv.h"

namespace snack::binding {

// x [B, C, H, W] (any memory format), dw_weight [C, 1, 3, 3], dw_bias [C], stride 1 or 2, the
// pointwise values, pattern ([O, C]) and bias [O], both activations and the variant ("auto", "fused",
// "unfused"), checked.
struct SeparableInputs {
  PatternArg p;
  SeparableConvShape shape;
  Activation dw_act = Activation::kNone;
  Activation act = Activation::kNone;
  std::string variant;
};
SeparableInputs separable_inputs(const at::Tensor& x, const at::Tensor& dw_weight,
                                 const std::optional<at::Tensor>& dw_bias, int64_t stride,
                                 c10::string_view dw_activation, const at::Tensor& values, at::TensorList pattern,
                                 const std::optional<at::Tensor>& bias, c10::string_view activation,
                                 c10::string_view variant, const char* op);

// The two convolutions apart: the framework's depthwise convolution and activation, then snack's
// 1x1 convolution on the result's layout (channels_last: spmm over the pixels as rows, in place;
// else spmm_channels_first). The output has the depthwise output's memory format.
at::Tensor separable_conv_unfused(const SeparableInputs& in, const at::Tensor& x, const at::Tensor& dw_weight,
                                  const std::optional<at::Tensor>& dw_bias, const at::Tensor& values,
                                  at::TensorList pattern, const std::optional<at::Tensor>& bias,
                                  c10::string_view activation);

}  // namespace snack::binding
