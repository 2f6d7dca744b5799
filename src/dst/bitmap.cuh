// Bitmaps with one bit per position of a matrix (bit p of word p / 32), and the scan that gives
// every set bit its rank: how the topology functions order positions without sorting them.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <cstdint>

#include "../device/cuda_utils.cuh"
#include "snack/device_limits.h"

namespace snack::cuda::detail {

constexpr int kDstThreads = 256;

// Blocks for a grid-stride loop over `items`: enough to fill the device, not one per item.
inline unsigned stride_grid(int64_t items, const DeviceLimits& limits) {
  return grid_for(items, kDstThreads * 4, int64_t(limits.sms) * 8);
}

__device__ __forceinline__ bool bit_set(const uint32_t* bitmap, int64_t p) { return (bitmap[p >> 5] >> (p & 31)) & 1u; }
__device__ __forceinline__ void set_bit(uint32_t* bitmap, int64_t p) { atomicOr(bitmap + (p >> 5), 1u << (p & 31)); }

// Rank of set bit p among all set bits: the set bits before its word plus those below it in the word.
__device__ __forceinline__ int64_t bit_rank(const uint32_t* bitmap, const int64_t* word_offsets, int64_t p) {
  const int64_t w = p >> 5;
  return word_offsets[w] + __popc(bitmap[w] & ((1u << (p & 31)) - 1u));
}

struct WordPopcount {
  const uint32_t* bitmap;
  __host__ __device__ int64_t operator()(int64_t w) const {
#ifdef __CUDA_ARCH__
    return __popc(bitmap[w]);
#else
    return 0;
#endif
  }
};

// bitmap |= positions of the slots, except those with skip[s] != 0.
template <typename Index>
__global__ void mark_slots_kernel(int64_t k, int64_t nnz, const Index* __restrict__ row_idx,
                                  const Index* __restrict__ col_idx, const uint8_t* __restrict__ skip,
                                  uint32_t* __restrict__ bitmap) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    if (skip && skip[s]) continue;
    set_bit(bitmap, int64_t(row_idx[s]) * k + int64_t(col_idx[s]));
  }
}


// offsets[w] = the counts of words [0, w) (an exclusive scan of count_of(w)). With temp == nullptr
// only sets *temp_bytes, as CUB does.
template <typename WordCount>
Status scan_word_counts(WordCount count_of, int64_t words, int64_t* offsets, void* temp, size_t* temp_bytes,
                        cudaStream_t stream) {
  auto counts = thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), count_of);
  return cuda_status(cub::DeviceScan::ExclusiveSum(temp, *temp_bytes, counts, offsets, words, stream),
                     "cub::DeviceScan::ExclusiveSum(word counts)");
}

}  // namespace snack::cuda::detail
