// RigL's growth in one call: the absent positions of largest |dY^T X|, the scores recomputed in
// registers by every pass of the radix select and never stored (memory: three bitmaps). No host
// synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/scratch.cuh"
#include "bitmap.cuh"
#include "radix_select.cuh"
#include "snack/device_limits.h"
#include "snack/dst.h"

namespace snack::cuda {
namespace {

using namespace detail;

// A block computes 64 x 64 tiles of dy^T x: each thread a 4 x 4 piece, from 32 batch rows of dy and
// x staged in shared memory at a time. The sum runs over n in ascending order (one fma per n), so
// every pass sees bitwise the same scores.
constexpr int kScoreTile = 64;
constexpr int kScoreChunk = 32;
constexpr int kScoreBinCopies = 2;

__device__ __forceinline__ void score_tile(const float* __restrict__ dy, const float* __restrict__ x, int64_t n,
                                           int64_t m, int64_t k, int64_t r0, int64_t c0,
                                           float (&dys)[kScoreChunk][kScoreTile], float (&xs)[kScoreChunk][kScoreTile],
                                           float (&acc)[4][4]) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  for (int64_t n0 = 0; n0 < n; n0 += kScoreChunk) {
    const int rows_here = int(n - n0 < kScoreChunk ? n - n0 : kScoreChunk);
    __syncthreads();  // the previous chunk (or tile) is no longer read
    for (int i = threadIdx.x; i < rows_here * kScoreTile; i += blockDim.x) {
      const int b = i / kScoreTile, j = i % kScoreTile;
      dys[b][j] = r0 + j < m ? dy[(n0 + b) * m + r0 + j] : 0.f;
      xs[b][j] = c0 + j < k ? x[(n0 + b) * k + c0 + j] : 0.f;
    }
    __syncthreads();
    for (int b = 0; b < rows_here; ++b) {
      const float4 a = *reinterpret_cast<const float4*>(&dys[b][ty * 4]);
      const float4 v = *reinterpret_cast<const float4*>(&xs[b][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], vv[j], acc[i][j]);
    }
  }
}

// kSelect = false: the histogram of one radix pass over the absent positions' keys |score|.
// kSelect = true: bits of the keys above the k-th (above_bits) and equal to it (tie_bits).
template <bool kSelect>
__global__ void __launch_bounds__(kDstThreads)
    rigl_pass_kernel(const float* __restrict__ dy, const float* __restrict__ x, int64_t n, int64_t m, int64_t k,
                     const uint32_t* __restrict__ present, int pass, SelectState* __restrict__ state,
                     uint32_t* __restrict__ above_bits, uint32_t* __restrict__ tie_bits) {
  __shared__ __align__(16) float dys[kScoreChunk][kScoreTile];
  __shared__ __align__(16) float xs[kScoreChunk][kScoreTile];
  // The selection pass needs no bins: a single dummy one keeps the shared memory small.
  __shared__ unsigned int bins[kSelect ? 1 : kScoreBinCopies][kMaxBins];
  const int nbins = 1 << digit_bits(pass);
  if constexpr (!kSelect) zero_bins(bins);  // its barrier: score_tile's do not run for an empty batch
  const int shift = digit_shift(pass), high = shift + digit_bits(pass);
  const uint32_t prefix = state->prefix;  // after the passes: the k-th key itself
  unsigned int* my_bins = warp_bins(bins);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int64_t tiles_c = detail::ceil_div(k, kScoreTile);
  const int64_t tiles = detail::ceil_div(m, kScoreTile) * tiles_c;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t r0 = (tile / tiles_c) * kScoreTile, c0 = (tile % tiles_c) * kScoreTile;
    float acc[4][4];
    score_tile(dy, x, n, m, k, r0, c0, dys, xs, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = r0 + ty * 4 + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + tx * 4 + j;
        if (r >= m || c >= k) continue;
        const int64_t p = r * k + c;
        if (bit_set(present, p)) continue;
        const uint32_t key = magnitude_key(acc[i][j]);
        if constexpr (kSelect) {
          if (key > prefix) set_bit(above_bits, p);
          else if (key == prefix) set_bit(tie_bits, p);
        } else {
          if (high < 32 && (key >> high) != (prefix >> high)) continue;
          atomicAdd(&my_bins[(key >> shift) & uint32_t(nbins - 1)], 1u);
        }
      }
    }
  }
  if constexpr (!kSelect) flush_bins(bins, nbins, state->hist[pass]);
}

// The first `remaining` ties (in position order, from their ranks) join the selection.
__global__ void take_first_ties_kernel(int64_t words, const uint32_t* __restrict__ tie_bits,
                                       const int64_t* __restrict__ tie_offsets, const SelectState* __restrict__ state,
                                       uint32_t* __restrict__ above_bits) {
  const long long wanted = state->remaining;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    uint32_t bits = tie_bits[w];
    long long rank = tie_offsets[w];
    if (!bits || rank >= wanted) continue;
    uint32_t take = 0;
    while (bits && rank < wanted) {
      const uint32_t low = bits & (~bits + 1u);
      take |= low;
      bits ^= low;
      ++rank;
    }
    above_bits[w] |= take;  // one thread per word: no race
  }
}

// out[offsets[w] + rank] = position of every set bit: the set positions, ascending.
__global__ void positions_from_bitmap_kernel(int64_t words, const uint32_t* __restrict__ bitmap,
                                             const int64_t* __restrict__ offsets, int64_t* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    uint32_t bits = bitmap[w];
    int64_t i = offsets[w];
    while (bits) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      out[i++] = w * 32 + b;
    }
  }
}

}  // namespace

template <typename Index>
Status topk_absent_gradient(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                            const float* dy, const float* x, int64_t n, int64_t count, int64_t* positions,
                            DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (count < 0 || count > m * k - nnz)
    return InvalidArgument("topk_absent_gradient: count exceeds the absent positions");
  if (n < 0) return InvalidArgument("topk_absent_gradient: negative batch");
  if (count == 0) return Status::Ok();
  if (n > 0 && (!dy || !x)) return InvalidArgument("topk_absent_gradient: null dy or x");
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  const int64_t words = bitmap_words(m, k);
  size_t cub_bytes = 0;
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{nullptr}, words, nullptr, nullptr, &cub_bytes, stream));
  const size_t state_bytes = aligned_bytes(sizeof(SelectState));
  const size_t bitmap_bytes = aligned_bytes(size_t(words) * sizeof(uint32_t));
  const size_t offset_bytes = aligned_bytes(size_t(words) * sizeof(int64_t));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(state_bytes + 3 * bitmap_bytes + offset_bytes + cub_bytes + kAlign));
  char* base = scratch.as<char>();
  auto* state = reinterpret_cast<SelectState*>(base);
  auto* present = reinterpret_cast<uint32_t*>(base + state_bytes);
  auto* above = reinterpret_cast<uint32_t*>(base + state_bytes + bitmap_bytes);
  auto* ties = reinterpret_cast<uint32_t*>(base + state_bytes + 2 * bitmap_bytes);
  auto* offsets = reinterpret_cast<int64_t*>(base + state_bytes + 3 * bitmap_bytes);
  void* cub_temp = align_up(base + state_bytes + 3 * bitmap_bytes + offset_bytes);

  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(present, 0, 3 * bitmap_bytes, stream));  // present, above, ties
  if (nnz > 0) {
    mark_slots_kernel<Index><<<stride_grid(nnz, limits), kDstThreads, 0, stream>>>(
        k, nnz, row_idx, col_idx, nullptr, present);
    SNACK_RETURN_IF_ERROR(check_launch("mark_slots_kernel"));
  }
  SNACK_RETURN_IF_ERROR(select_init(state, count, stream));
  const int64_t tiles = detail::ceil_div(m, kScoreTile) * detail::ceil_div(k, kScoreTile);
  const auto grid = unsigned(std::min<int64_t>(tiles, int64_t(limits.sms) * 4));
  for (int pass = 0; pass < TopkSelection::kPasses; ++pass) {
    rigl_pass_kernel<false><<<grid, kDstThreads, 0, stream>>>(dy, x, n, m, k, present, pass, state, nullptr, nullptr);
    SNACK_RETURN_IF_ERROR(check_launch("rigl_pass_kernel<histogram>"));
    SNACK_RETURN_IF_ERROR(select_pick(pass, state, stream));
  }
  rigl_pass_kernel<true><<<grid, kDstThreads, 0, stream>>>(dy, x, n, m, k, present, 0, state, above, ties);
  SNACK_RETURN_IF_ERROR(check_launch("rigl_pass_kernel<select>"));
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{ties}, words, offsets, cub_temp, &cub_bytes, stream));
  take_first_ties_kernel<<<stride_grid(words, limits), kDstThreads, 0, stream>>>(words, ties, offsets, state, above);
  SNACK_RETURN_IF_ERROR(check_launch("take_first_ties_kernel"));
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{above}, words, offsets, cub_temp, &cub_bytes, stream));
  positions_from_bitmap_kernel<<<stride_grid(words, limits), kDstThreads, 0, stream>>>(
      words, above, offsets, positions);
  return check_launch("positions_from_bitmap_kernel");
}

template Status topk_absent_gradient<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
                                               const float*, const float*, int64_t, int64_t, int64_t*,
                                               DeviceAllocator&, Stream);
template Status topk_absent_gradient<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, const float*,
                                              const float*, int64_t, int64_t, int64_t*, DeviceAllocator&, Stream);

}  // namespace snack::cuda
