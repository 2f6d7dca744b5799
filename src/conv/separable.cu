// The fused depthwise-separable convolution (snack/conv.h) on channels-last or NCHW images.
//
// A block owns a tile of 32 x P output pixels of one image and a group of output channels:
// 1. the depthwise phase: channels last, each thread computes 16 bytes of channels of one pixel of
//    the tile (nine 16-byte loads of x, the lanes of a warp on consecutive channels so that they read
//    whole lines); NCHW, one channel of one pixel, the lanes on consecutive pixels; the weights from
//    shared memory. It applies the bias and the activation, rounds to T as a separate depthwise
//    convolution would, and parks the result in z [channel][pixel] in shared memory;
// 2. the sparse phase: a warp per output channel, lane l the pixels l, l + 32, ... of the tile, as
//    spmm_channels_first over z: the row's slots read 32 at a time and handed round by shuffles, each
//    slot P conflict-free reads of its channel's row of z;
// 3. channels last, the outputs of 64 channels at a time go through shared memory, so that each
//    pixel's run of channels is written contiguously; NCHW, the lanes store their pixels of the row.
// z never reaches global memory, and the block runs one kernel for what the two convolutions, their
// bias and their activations take three or four for.
//
// Channels last, z's rows are XOR-swizzled: pixel p of channel c sits at p ^ swizzle(c) of its row, a
// value below 32 that differs between the channels that a warp's lanes write at once (their banks
// would otherwise be one, their rows being 32 x P words apart), while the reads of one row by the 32
// lanes stay a permutation of 32 banks. NCHW, a warp writes one row and needs none.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "../device/warp_row_slots.cuh"
#include "separable.h"
#include "snack/conv.h"

namespace snack::cuda {
namespace detail {
namespace {

using ::snack::detail::kSeparableOutputChunk;

// 16 warps: one block of up to ~1100 channels fills an SM's shared memory, and its warps alone hide
// the latency of the depthwise phase's loads.
constexpr int kSeparableThreads = 512;
constexpr int kSeparableWarps = kSeparableThreads / 32;
constexpr int kSlotGroup = 8;  // slots whose reads of z are issued before their multiply-adds

struct SeparableArgs {
  int64_t height, width, channels, out_width, pixels, out_channels, tiles, group_rows;
  int stride;
};

// blockIdx.x: image b = blockIdx.x / tiles and pixel tile blockIdx.x % tiles; blockIdx.y: the group of
// output channels. V: the channels of a thread's item in the depthwise phase (a 16-byte vector of T
// channels last, one channel NCHW).
template <typename T, typename Index, int P, bool kChannelsLast>
__global__ void __launch_bounds__(kSeparableThreads, 1)
    separable_conv_kernel(SeparableArgs s, const T* __restrict__ x, const T* __restrict__ dw_weight,
                          const T* __restrict__ dw_bias, Activation dw_act, const int32_t* __restrict__ row_ptr,
                          const Index* __restrict__ col_idx, const T* __restrict__ values,
                          const T* __restrict__ bias, Activation act, T* __restrict__ y) {
  constexpr int V = kChannelsLast ? 16 / int(sizeof(T)) : 1;
  constexpr int kTile = 32 * P;
  constexpr int kZRow = kTile;
  constexpr int kStagedRow = kSeparableOutputChunk + 1;
  extern __shared__ __align__(16) float smem[];
  const int channels = int(s.channels);
  float* z = smem;                                 // [channels][kZRow]
  float* dw = z + int64_t(channels) * kZRow;       // [9][channels]
  float* staged = dw + 9 * int64_t(channels);      // [kTile][kStagedRow], channels last
  const int64_t b = int64_t(blockIdx.x) / s.tiles;
  const int64_t q0 = (int64_t(blockIdx.x) % s.tiles) * kTile;  // the tile's first output pixel
  const int valid = int(std::min<int64_t>(kTile, s.pixels - q0));

  for (int i = threadIdx.x; i < 9 * channels; i += kSeparableThreads) {
    const int c = i / 9, tap = i - 9 * c;
    dw[tap * channels + c] = to_accum(dw_weight[i]);
  }
  __syncthreads();

  // 1. The depthwise phase. Channels last, the lanes of a warp on consecutive vectors of channels (of
  // consecutive pixels where a pixel has fewer than 32), whose swizzles differ; NCHW, on consecutive
  // pixels of one channel.
  const int vectors = channels / V;
  const int spread = vectors >= 32 ? 1 : 32 >> (31 - __clz(vectors));  // 32 / (vectors rounded down to 2^k)
  const auto swizzle_of = [&](int c) { return kChannelsLast ? ((c / V) * spread) & 31 : 0; };
  const int64_t image_pixels = s.height * s.width;
#pragma unroll 2
  for (int i = threadIdx.x; i < vectors * kTile; i += kSeparableThreads) {
    int p, c;
    if constexpr (kChannelsLast) {
      p = i / vectors;
      c = (i - p * vectors) * V;
    } else {
      c = i / kTile;
      p = i - c * kTile;
    }
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    if (p < valid) {
      const int64_t q = q0 + p, oy = q / s.out_width, ox = q - oy * s.out_width;
      if (dw_bias) {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = to_accum(dw_bias[c + j]);
      }
#pragma unroll
      for (int ky = 0; ky < 3; ++ky) {
        const int64_t iy = oy * s.stride - 1 + ky;
        if (iy < 0 || iy >= s.height) continue;
#pragma unroll
        for (int kx = 0; kx < 3; ++kx) {
          const int64_t ix = ox * s.stride - 1 + kx;
          if (ix < 0 || ix >= s.width) continue;
          float xv[V], wv[V];
          if constexpr (kChannelsLast) {
            load_vec<T, V>(x + ((b * s.height + iy) * s.width + ix) * s.channels + c, xv);
          } else {
            xv[0] = to_accum(load_ro(x + (b * s.channels + c) * image_pixels + iy * s.width + ix));
          }
          load_vec<float, V, true>(dw + (ky * 3 + kx) * channels + c, wv);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[j] = fmaf(wv[j], xv[j], acc[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = to_accum(from_accum<T>(apply_activation(acc[j], dw_act)));
    }
    const int swizzle = swizzle_of(c);
#pragma unroll
    for (int j = 0; j < V; ++j) z[(c + j) * kZRow + (p ^ swizzle)] = acc[j];
  }
  __syncthreads();

  // 2. and 3. The sparse phase, a chunk of output channels at a time.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t group_begin = int64_t(blockIdx.y) * s.group_rows;
  const int64_t group_end = std::min(group_begin + s.group_rows, s.out_channels);
  for (int64_t chunk = group_begin; chunk < group_end; chunk += kSeparableOutputChunk) {
    const int rows = int(std::min<int64_t>(kSeparableOutputChunk, group_end - chunk));
    for (int rr = warp; rr < rows; rr += kSeparableWarps) {
      const int64_t r = chunk + rr;
      const int32_t begin = row_ptr[r], end = row_ptr[r + 1];
      float acc[P];
#pragma unroll
      for (int j = 0; j < P; ++j) acc[j] = 0.f;
      for_each_slot_group<kSlotGroup>(values, col_idx, begin, end, lane,
                                      [&](float value, int32_t column, int t0, int count) {
        float v[kSlotGroup], zv[kSlotGroup][P];
#pragma unroll
        for (int u = 0; u < kSlotGroup; ++u) {
          v[u] = __shfl_sync(0xffffffffu, value, t0 + u);
          const int32_t c = __shfl_sync(0xffffffffu, column, t0 + u);
          if (t0 + u < count) {
            const int swizzle = swizzle_of(c);
#pragma unroll
            for (int j = 0; j < P; ++j) zv[u][j] = z[c * kZRow + ((lane + 32 * j) ^ swizzle)];
          } else {
#pragma unroll
            for (int j = 0; j < P; ++j) zv[u][j] = 0.f;
            v[u] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kSlotGroup; ++u) {
#pragma unroll
          for (int j = 0; j < P; ++j) acc[j] = fmaf(v[u], zv[u][j], acc[j]);
        }
      });
      const float bias_r = bias ? to_accum(bias[r]) : 0.f;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const int p = lane + 32 * j;
        const float out = apply_activation(acc[j] + bias_r, act);
        if constexpr (kChannelsLast) {
          staged[p * kStagedRow + rr] = out;
        } else if (p < valid) {
          y[(b * s.out_channels + r) * s.pixels + q0 + p] = from_accum<T>(out);
        }
      }
    }
    if constexpr (kChannelsLast) {
      __syncthreads();
      T* out = y + (b * s.pixels + q0) * s.out_channels + chunk;
      for (int i = threadIdx.x; i < valid * rows; i += kSeparableThreads) {
        const int p = i / rows, rr = i - p * rows;
        out[int64_t(p) * s.out_channels + rr] = from_accum<T>(staged[p * kStagedRow + rr]);
      }
      __syncthreads();
    }
  }
}

template <typename T, typename Index, int P, bool kChannelsLast>
Status launch_separable(const SeparableConvShape& shape, const SeparableConvPlan& plan, const T* x,
                        const T* dw_weight, const T* dw_bias, Activation dw_act, const SlotPattern<Index>& w,
                        const T* values, const T* bias, Activation act, T* y, Stream stream) {
  const auto kernel = separable_conv_kernel<T, Index, P, kChannelsLast>;
  SNACK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const SeparableArgs args{shape.height, shape.width, shape.channels, shape.out_width(),
                           shape.out_height() * shape.out_width(), shape.out_channels, plan.tiles_per_image,
                           plan.group_rows, shape.stride};
  kernel<<<dim3(unsigned(shape.batch * plan.tiles_per_image), unsigned(plan.groups)), kSeparableThreads,
           plan.smem_bytes, stream>>>(args, x, dw_weight, dw_bias, dw_act, w.row_ptr, w.col_idx, values, bias, act, y);
  return check_launch("separable_conv_kernel");
}

}  // namespace
}  // namespace detail

template <typename T, typename Index>
Status separable_conv(const SeparableConvShape& s, const T* x, const T* dw_weight, const T* dw_bias,
                      Activation dw_act, const SlotPattern<Index>& w, const T* values, const T* bias, Activation act,
                      T* y, const DeviceLimits& limits, Stream stream) {
  using namespace detail;
  if (s.batch < 0 || s.height < 0 || s.width < 0)
    return InvalidArgument("separable_conv: batch, height and width must be non-negative");
  if (w.cols != s.channels || w.rows != s.out_channels)
    return InvalidArgument("separable_conv: the pattern is " + std::to_string(w.rows) + " x " +
                           std::to_string(w.cols) + ", the convolution " + std::to_string(s.out_channels) + " x " +
                           std::to_string(s.channels));
  const int64_t outputs = s.batch * s.out_height() * s.out_width();
  SNACK_RETURN_IF_ERROR(::snack::detail::check_op(
      w, outputs, values,
      {{"x", ::snack::detail::required_if(outputs * s.channels > 0, x)},
       {"dw_weight", ::snack::detail::required_if(s.channels > 0, dw_weight)},
       {"y", ::snack::detail::required_if(outputs * s.out_channels > 0, y)}},
      PatternNeeds::kForward));
  if (outputs == 0 || s.out_channels == 0) return Status::Ok();
  const SeparableConvPlan plan = plan_separable_conv(s, int(sizeof(T)), limits);
  if (!plan.fits || (s.channels_last && reinterpret_cast<uintptr_t>(x) % 16 != 0))
    return InvalidArgument("separable_conv: no fused tile for " + std::to_string(s.channels) +
                           " channels of this dtype and layout on this device (or channels-last x not 16-byte "
                           "aligned)");
  const auto launch = [&](auto channels_last) {
    constexpr bool kLast = decltype(channels_last)::value;
    switch (plan.pixels_per_lane) {
      case 4:
        return launch_separable<T, Index, 4, kLast>(s, plan, x, dw_weight, dw_bias, dw_act, w, values, bias, act, y,
                                                     stream);
      case 2:
        return launch_separable<T, Index, 2, kLast>(s, plan, x, dw_weight, dw_bias, dw_act, w, values, bias, act, y,
                                                     stream);
      default:
        return launch_separable<T, Index, 1, kLast>(s, plan, x, dw_weight, dw_bias, dw_act, w, values, bias, act, y,
                                                     stream);
    }
  };
  return s.channels_last ? launch(std::true_type{}) : launch(std::false_type{});
}

#define SNACK_INSTANTIATE_SEPARABLE(T, Index)                                                                     \
  template Status separable_conv<T, Index>(const SeparableConvShape&, const T*, const T*, const T*, Activation, \
                                           const SlotPattern<Index>&, const T*, const T*, Activation, T*,        \
                                           const DeviceLimits&, Stream);

SNACK_INSTANTIATE_SEPARABLE(float, uint16_t)
SNACK_INSTANTIATE_SEPARABLE(float, int32_t)
SNACK_INSTANTIATE_SEPARABLE(bfloat16, uint16_t)
SNACK_INSTANTIATE_SEPARABLE(bfloat16, int32_t)
SNACK_INSTANTIATE_SEPARABLE(float16, uint16_t)
SNACK_INSTANTIATE_SEPARABLE(float16, int32_t)

}  // namespace snack::cuda
