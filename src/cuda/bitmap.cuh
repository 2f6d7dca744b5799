// Bitmaps with one bit per position of a matrix (bit p of word p / 32), and the scan that gives
// every set bit its rank: how the topology functions order positions without sorting them.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <cstdint>

#include "cuda_utils.cuh"

namespace snack::cuda::detail {

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
