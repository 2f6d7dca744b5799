// The forward on channels-first activations (snack/spmm.h, spmm_channels_first): a 1x1 convolution
// on NCHW images, read and written in place.
//
// For one image, X [K, P] and Y [M, P] hold a channel's pixels contiguously, so output channel r is
// a sum of whole input rows: Y[r, :] = sum_{s in row r} v[s] X[col(s), :]. A warp owns one output
// channel and a tile of 32 x V pixels: each slot is one coalesced load of V pixels per lane (16
// bytes where the pixel count allows), V multiply-adds per lane, and the tile is stored once with
// the bias and the activation applied. The slots of the row are read 32 at a time (one per lane,
// the next 32 requested before the current ones are used) and handed round by shuffles, so the
// loop over slots is warp-uniform. No transposed copy of X or Y, no workspace, one launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "../device/warp_row_slots.cuh"
#include "snack/spmm.h"

namespace snack::cuda {
namespace detail {
namespace {

constexpr int kChannelsFirstWarps = 8;  // output channels per block (a warp each)
constexpr int kSlotGroup = 8;           // slots whose loads are issued before their multiply-adds

// blockIdx.x: image b = blockIdx.x / tiles and pixel tile blockIdx.x % tiles; the warps of a block
// take consecutive output channels, and the grid's y strides over them.
template <typename T, typename Index, int V>
__global__ void __launch_bounds__(kChannelsFirstWarps * 32)
    spmm_channels_first_kernel(const int32_t* __restrict__ row_ptr, const Index* __restrict__ col_idx,
                               const T* __restrict__ values, int64_t rows, int64_t cols, const T* __restrict__ x,
                               int64_t pixels, int64_t tiles, const T* __restrict__ bias, T* __restrict__ y,
                               Activation act) {
  using A = accum_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t b = int64_t(blockIdx.x) / tiles;
  const int64_t p = (int64_t(blockIdx.x) % tiles) * (32 * V) + lane * V;  // this lane's first pixel
  const bool active = p < pixels;  // pixels % V == 0: a lane's V pixels all exist or none does
  const T* xb = x + b * cols * pixels + p;
  for (int64_t r = int64_t(blockIdx.y) * kChannelsFirstWarps + (threadIdx.x >> 5); r < rows;
       r += int64_t(gridDim.y) * kChannelsFirstWarps) {
    const int32_t begin = row_ptr[r], end = row_ptr[r + 1];
    A acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = A(0);
    for_each_slot_group<kSlotGroup>(values, col_idx, begin, end, lane, [&](A value, int32_t column, int t0, int count) {
      A v[kSlotGroup], xv[kSlotGroup][V];
#pragma unroll
      for (int u = 0; u < kSlotGroup; ++u) {
        v[u] = __shfl_sync(0xffffffffu, value, t0 + u);
        const int32_t c = __shfl_sync(0xffffffffu, column, t0 + u);
        if (active && t0 + u < count) {
          load_vec<T, V>(xb + int64_t(c) * pixels, xv[u]);
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) xv[u][j] = A(0);  // past the row: adds 0 * 0, never 0 * inf
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotGroup; ++u) {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = fma(v[u], xv[u][j], acc[j]);
      }
    });
    if (active) {
      const A b_r = bias ? to_accum(bias[r]) : A(0);
      T out[V];
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = from_accum<T>(apply_activation(acc[j] + b_r, act));
      store_run<T, V>(y + (b * rows + r) * pixels + p, out);
    }
  }
}

template <typename T, typename Index, int V>
Status launch_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                             const T* bias, T* y, Stream stream, Activation act) {
  const int64_t tiles = ceil_div(pixels, int64_t(32 * V));
  if (tiles > (int64_t(1) << 31) - 1) return InvalidArgument("spmm_channels_first: too many pixels per image");
  const int64_t row_groups = std::min(ceil_div(w.rows, int64_t(kChannelsFirstWarps)), kMaxGridY);
  // grid.x holds batch x tiles blocks: launched in slices of whole images where that is over 2^31 - 1.
  const int64_t images_per_launch = std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / tiles);
  for (int64_t b0 = 0; b0 < batch; b0 += images_per_launch) {
    const int64_t images = std::min(images_per_launch, batch - b0);
    spmm_channels_first_kernel<T, Index, V><<<dim3(unsigned(images * tiles), unsigned(row_groups)),
                                              kChannelsFirstWarps * 32, 0, stream>>>(
        w.row_ptr, w.col_idx, values, w.rows, w.cols, x + b0 * w.cols * pixels, pixels, tiles, bias,
        y + b0 * w.rows * pixels, act);
    SNACK_RETURN_IF_ERROR(check_launch("spmm_channels_first_kernel"));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace detail

template <typename T, typename Index>
Status spmm_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                           const T* bias, T* y, Stream stream, Activation act) {
  using namespace detail;
  if (pixels < 0) return InvalidArgument("pixels must be non-negative, got " + std::to_string(pixels));
  SNACK_RETURN_IF_ERROR(::snack::detail::check_op(
      w, batch, values,
      {{"x", ::snack::detail::required_if(batch * w.cols * pixels > 0, x)},
       {"y", ::snack::detail::required_if(batch * w.rows * pixels > 0, y)}},
      PatternNeeds::kForward));
  if (batch == 0 || pixels == 0 || w.rows == 0) return Status::Ok();
  // The widest vector (at most 16 bytes) whose elements tile every channel's row of pixels and whose
  // loads and stores stay aligned.
  const auto aligned = [&](int v) {
    const uintptr_t bytes = uintptr_t(v) * sizeof(T);
    return pixels % v == 0 && reinterpret_cast<uintptr_t>(x) % bytes == 0 &&
           reinterpret_cast<uintptr_t>(y) % bytes == 0;
  };
  constexpr int kWidest = int(16 / sizeof(T));
  if constexpr (kWidest >= 8) {
    if (aligned(8)) return launch_channels_first<T, Index, 8>(w, values, x, batch, pixels, bias, y, stream, act);
  }
  if constexpr (kWidest >= 4) {
    if (aligned(4)) return launch_channels_first<T, Index, 4>(w, values, x, batch, pixels, bias, y, stream, act);
  }
  if (aligned(2)) return launch_channels_first<T, Index, 2>(w, values, x, batch, pixels, bias, y, stream, act);
  return launch_channels_first<T, Index, 1>(w, values, x, batch, pixels, bias, y, stream, act);
}

#define SNACK_INSTANTIATE_CHANNELS_FIRST(T, Index)                                                                \
  template Status spmm_channels_first<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, int64_t, \
                                                const T*, T*, Stream, Activation);

SNACK_INSTANTIATE_CHANNELS_FIRST(float, uint16_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(float, int32_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(double, uint16_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(double, int32_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(bfloat16, uint16_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(bfloat16, int32_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(float16, uint16_t)
SNACK_INSTANTIATE_CHANNELS_FIRST(float16, int32_t)

}  // namespace snack::cuda
