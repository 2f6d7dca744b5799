// snack::separable_conv on CUDA: the fused kernel (snack/conv.h) on channels_last images where its
// tile fits the device, else the two convolutions apart (conv_ops.cpp).
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
  const SeparableConvPlan plan = plan_separable_conv(in.shape, int(values.element_size()), limits);
  // channels_last: the NHWC memory the kernel reads (a tensor of one channel or one pixel is both).
  const bool channels_last = x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
  const bool fused = in.variant == "fused" || (in.variant == "auto" && channels_last && plan.fits);
  if (!fused) return separable_conv_unfused(in, x, dw_weight, dw_bias, values, pattern, bias, activation);
  TORCH_CHECK_VALUE(plan.fits, "snack.", op, ": the fused kernel takes float32, bfloat16 or float16 values and ",
                    "channels in whole 16-byte vectors within the device's shared memory; got ", values.scalar_type(),
                    " with ", in.shape.channels, " channels (variant='unfused' runs the two convolutions apart)");
  const at::Tensor images = x.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor weight = dw_weight.contiguous();
  // Undefined where absent.
  const at::Tensor weight_bias = dw_bias ? dw_bias->contiguous() : at::Tensor();
  const at::Tensor out_bias = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({in.shape.batch, in.shape.out_channels, in.shape.out_height(), in.shape.out_width()},
                           values.options().memory_format(at::MemoryFormat::ChannelsLast));
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK_VALUE(false, "snack.", op, ": the fused kernel takes no float64 values");
    } else {
      throw_if_error(with_pattern(in.p,
                                  [&](auto w) {
                                    return cuda::separable_conv_nhwc(
                                        in.shape, data_as<T>(images), data_as<T>(weight),
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
