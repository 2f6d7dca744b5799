// snack::separable_conv on CUDA: the fused kernel (snack/conv.h) on channels_last or NCHW images where
// its tile fits the device, else the two convolutions apart (conv_ops.cpp).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "conv_ops.h"
#include "cuda_context.h"
#include "plans.h"

namespace snack::binding {
namespace {

at::Tensor separable_conv_cuda(const at::Tensor& x, const at::Tensor& dw_weight,
                               const std::optional<at::Tensor>& dw_bias, int64_t stride,
                               c10::string_view dw_activation, const at::Tensor& values, at::TensorList pattern,
                               const std::optional<at::Tensor>& bias, c10::string_view activation,
                               c10::string_view variant) {
  const char* op = "separable_conv";
  const SeparableInputs in = separable_inputs(x, dw_weight, dw_bias, stride, dw_activation, values, pattern, bias,
                                              activation, variant, op);
  const c10::cuda::CUDAGuard guard(in.p.device);
  const DeviceLimits limits = cuda_device_limits(in.p.device.index());
  // The kernel reads and writes x's layout: channels_last memory, else NCHW (a tensor of one channel or
  // one pixel is both, and runs as NCHW).
  SeparableConvShape shape = in.shape;
  shape.channels_last = x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
  const SeparableConvPlan plan = plan_separable_conv(shape, int(values.element_size()), limits);
  const bool fused = in.variant == "fused" || (in.variant == "auto" && plan.fits);
  if (!fused) return separable_conv_unfused(in, x, dw_weight, dw_bias, values, pattern, bias, activation);
  TORCH_CHECK_VALUE(plan.fits, "snack.", op, ": the fused kernel takes float32, bfloat16 or float16 values, within the ",
                    "device's shared memory, and channels_last images of whole 16-byte vectors of channels; got ",
                    values.scalar_type(), " with ", shape.channels, " channels",
                    shape.channels_last ? " channels_last" : "", " (variant='unfused' runs the two convolutions apart)");
  const at::MemoryFormat format = shape.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const at::Tensor images = x.contiguous(format);
  const at::Tensor weight = dw_weight.contiguous();
  // Undefined where absent.
  const at::Tensor weight_bias = dw_bias ? dw_bias->contiguous() : at::Tensor();
  const at::Tensor out_bias = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({shape.batch, shape.out_channels, shape.out_height(), shape.out_width()},
                           values.options().memory_format(format));
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK_VALUE(false, "snack.", op, ": the fused kernel takes no float64 values");
    } else {
      throw_if_error(with_pattern(in.p,
                                  [&](auto w) {
                                    return cuda::separable_conv(
                                        shape, data_as<T>(images), data_as<T>(weight),
                                        weight_bias.defined() ? data_as<T>(weight_bias) : nullptr, in.dw_act, w,
                                        data_as<T>(values), out_bias.defined() ? data_as<T>(out_bias) : nullptr, in.act,
                                        data_as<T>(y), limits, current_stream());
                                  }),
                     op);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(snack, CUDA, m) { m.impl("separable_conv", &separable_conv_cuda); }

}  // namespace snack::binding
