// snack::separable_conv, a depthwise-separable convolution (snack/conv.h): the inputs checked once
// for every device, the convolution run as its two parts (every device, every layout), and the CPU
// implementation, which is those two parts.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "conv_ops.h"
#include "op_handle.h"

namespace snack::binding {

SeparableInputs separable_inputs(const at::Tensor& x, const at::Tensor& dw_weight,
                                 const std::optional<at::Tensor>& dw_bias, int64_t stride,
                                 c10::string_view dw_activation, const at::Tensor& values, at::TensorList pattern,
                                 const std::optional<at::Tensor>& bias, c10::string_view activation,
                                 c10::string_view variant, const char* op) {
  SeparableInputs in;
  in.p = pattern_arg(pattern, op, PatternNeeds::kForward);
  check_values(values, in.p, op);
  check_bias(bias, values, in.p, op);
  in.dw_act = activation_arg(dw_activation, op);
  in.act = activation_arg(activation, op);
  TORCH_CHECK_VALUE(variant == "auto" || variant == "fused" || variant == "unfused", "snack.", op,
                    ": variant must be auto, fused or unfused, got '", std::string(variant), "'");
  in.variant = std::string(variant);
  TORCH_CHECK_VALUE(x.dim() == 4, "snack.", op, ": x must be [batch, channels, height, width], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == values.scalar_type(), "snack.", op, ": x is ", x.scalar_type(),
                   ", values ", values.scalar_type());
  check_same_device(x, in.p.device, "x", op);
  const int64_t channels = x.size(1);
  TORCH_CHECK_VALUE(channels == in.p.cols, "snack.", op, ": x has ", channels, " channels, the pattern ", in.p.cols,
                    " columns");
  TORCH_CHECK_VALUE(dw_weight.dim() == 4 && dw_weight.size(0) == channels && dw_weight.size(1) == 1 &&
                        dw_weight.size(2) == 3 && dw_weight.size(3) == 3,
                    "snack.", op, ": dw_weight must be [", channels, ", 1, 3, 3] (a depthwise 3x3 weight), got ",
                    dw_weight.sizes());
  TORCH_CHECK_TYPE(dw_weight.scalar_type() == values.scalar_type(), "snack.", op, ": dw_weight is ",
                   dw_weight.scalar_type(), ", values ", values.scalar_type());
  check_same_device(dw_weight, in.p.device, "dw_weight", op);
  if (dw_bias) {
    TORCH_CHECK_VALUE(dw_bias->dim() == 1 && dw_bias->size(0) == channels, "snack.", op, ": dw_bias must be [",
                      channels, "], got ", dw_bias->sizes());
    TORCH_CHECK_TYPE(dw_bias->scalar_type() == values.scalar_type(), "snack.", op, ": dw_bias is ",
                     dw_bias->scalar_type(), ", values ", values.scalar_type());
    check_same_device(*dw_bias, in.p.device, "dw_bias", op);
  }
  TORCH_CHECK_VALUE(stride == 1 || stride == 2, "snack.", op, ": stride must be 1 or 2, got ", stride);
  in.shape = SeparableConvShape{x.size(0), x.size(2), x.size(3), channels, in.p.rows, int(stride)};
  return in;
}

namespace {
at::Tensor activated(at::Tensor z, Activation act) {
  switch (act) {
    case Activation::kReLU: return at::relu(z);
    case Activation::kGELU: return at::gelu(z);
    default: return z;
  }
}
}  // namespace

at::Tensor separable_conv_unfused(const SeparableInputs& in, const at::Tensor& x, const at::Tensor& dw_weight,
                                  const std::optional<at::Tensor>& dw_bias, const at::Tensor& values,
                                  at::TensorList pattern, const std::optional<at::Tensor>& bias,
                                  c10::string_view activation) {
  using OptionalTensor = std::optional<at::Tensor>;
  const int64_t channels = in.shape.channels, stride = in.shape.stride;
  const at::Tensor z =
      activated(at::conv2d(x, dw_weight, dw_bias, {stride, stride}, {1, 1}, {1, 1}, channels), in.dw_act);
  const int64_t batch = z.size(0), out_h = z.size(2), out_w = z.size(3), out_channels = in.shape.out_channels;
  if (z.is_contiguous(at::MemoryFormat::ChannelsLast) && !z.is_contiguous()) {  // the pixels as rows, in place
    static auto spmm = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList,
                                            const OptionalTensor&, c10::string_view, c10::string_view,
                                            const OptionalTensor&)>("snack::spmm");
    const at::Tensor rows = z.permute({0, 2, 3, 1}).reshape({batch * out_h * out_w, channels});
    return spmm.call(rows, values, pattern, bias, activation, "auto", std::nullopt)
        .view({batch, out_h, out_w, out_channels})
        .permute({0, 3, 1, 2});
  }
  static auto channels_first = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList,
                                                    const OptionalTensor&, c10::string_view, c10::string_view)>(
      "snack::spmm_channels_first");
  return channels_first.call(z.contiguous().view({batch, channels, out_h * out_w}), values, pattern, bias, activation,
                             "auto")
      .view({batch, out_channels, out_h, out_w});
}

namespace {
at::Tensor separable_conv_cpu(const at::Tensor& x, const at::Tensor& dw_weight,
                              const std::optional<at::Tensor>& dw_bias, int64_t stride,
                              c10::string_view dw_activation, const at::Tensor& values, at::TensorList pattern,
                              const std::optional<at::Tensor>& bias, c10::string_view activation,
                              c10::string_view variant) {
  const char* op = "separable_conv";
  const SeparableInputs in = separable_inputs(x, dw_weight, dw_bias, stride, dw_activation, values, pattern, bias,
                                              activation, variant, op);
  TORCH_CHECK_VALUE(in.variant != "fused", "snack.", op, ": the fused kernel runs on CUDA devices only");
  return separable_conv_unfused(in, x, dw_weight, dw_bias, values, pattern, bias, activation);
}
}  // namespace

TORCH_LIBRARY_IMPL(snack, CPU, m) { m.impl("separable_conv", &separable_conv_cpu); }

}  // namespace snack::binding
