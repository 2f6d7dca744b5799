// Depthwise-separable convolutions: a dense 3x3 depthwise convolution, its bias and activation,
// then a sparse 1x1 (pointwise) convolution, as one kernel on channels-last or NCHW images.
//
//   z[b, i, j, c] = dw_act(sum_{u,v < 3} dw[c, u, v] x[b, s i + u - 1, s j + v - 1, c] (+ dw_bias[c]))
//                   (zero padding of one pixel, stride s of 1 or 2), rounded to T
//   y[b, i, j, r] = act(sum_{t in row r} values[t] z[b, i, j, col(t)] (+ bias[r]))
//
// x and y are contiguous images, channels last (x [batch, height, width, channels], y [batch, out_h,
// out_w, w.rows]: a channels_last tensor's memory) or first (NCHW). MobileNet's blocks are this
// pair; run apart they write z and read it back, and take three or four kernels where this takes
// one: the depthwise output of a tile of pixels stays in shared memory, where the sparse product
// reads it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "snack/activation.h"
#include "snack/device_limits.h"
#include "snack/pattern.h"
#include "snack/status.h"

namespace snack {

/// A depthwise-separable convolution's shape. `channels` = w.cols of the pointwise pattern.
struct SeparableConvShape {
  int64_t batch = 0;
  int64_t height = 0;
  int64_t width = 0;
  int64_t channels = 0;
  int64_t out_channels = 0;
  int stride = 1;  ///< 1 or 2
  bool channels_last = true;  ///< x and y NHWC; false: NCHW
  int64_t out_height() const { return (height - 1) / stride + 1; }
  int64_t out_width() const { return (width - 1) / stride + 1; }
};

/// How the fused kernel runs a shape: `pixels_per_lane` x 32 output pixels a block (1, 2 or 4),
/// `group_rows` output channels a block (the grid's y splits them where the pixels leave SMs idle;
/// each group recomputes its tile's depthwise output), and the dynamic shared memory that takes.
/// `fits` is false where no tile fits the device's shared memory (thousands of channels), or, channels
/// last, the channels are not whole 16-byte vectors (the depthwise loads): the caller runs the two apart.
struct SeparableConvPlan {
  bool fits = false;
  int pixels_per_lane = 0;
  int64_t group_rows = 0;
  int64_t tiles_per_image = 0;
  int64_t groups = 0;
  size_t smem_bytes = 0;
};
SeparableConvPlan plan_separable_conv(const SeparableConvShape& s, int value_bytes, const DeviceLimits& limits);

namespace cuda {

/// The fused depthwise-separable convolution above in s.channels_last's layout, enqueued on
/// `stream`. T: float, bfloat16 or float16 (accumulated in float; z rounded to T as the depthwise
/// convolution's output would be).
/// dw_weight [channels, 9] (an nn.Conv2d(C, C, 3, groups=C) weight's memory), dw_bias [channels] or
/// null, bias [w.rows] or null; channels last, `x` 16-byte aligned. Fails with kInvalidArgument where
/// plan_separable_conv says it does not fit.
template <typename T, typename Index>
Status separable_conv(const SeparableConvShape& s, const T* x, const T* dw_weight, const T* dw_bias,
                      Activation dw_act, const SlotPattern<Index>& w, const T* values, const T* bias, Activation act,
                      T* y, const DeviceLimits& limits, Stream stream);

}  // namespace cuda
}  // namespace snack
