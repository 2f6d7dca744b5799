// sample_absent: positions absent from a pattern, uniformly at random without replacement, from
// candidate draws marked in a bitmap and kept by hash priority (the radix select). No host
// synchronisation.
#include <cuda_runtime.h>

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

// Bits of word w that stand for positions below `total` (the last word may be partly past the end).
__device__ __forceinline__ uint32_t in_range_bits(int64_t w, int64_t total) {
  const int64_t left = total - w * 32;
  return left >= 32 ? ~0u : ((1u << left) - 1u);
}

// Candidate positions of sample_absent in word w: drawn, absent and in range.
struct CandidateWord {
  const uint32_t* present;
  const uint32_t* drawn;
  int64_t total;
  __device__ __forceinline__ uint32_t bits(int64_t w) const { return drawn[w] & ~present[w] & in_range_bits(w, total); }
  __host__ __device__ int64_t operator()(int64_t w) const {
#ifdef __CUDA_ARCH__
    return __popc(bits(w));
#else
    return 0;
#endif
  }
};

// SplitMix64's finaliser: a strong 64-bit mix, so that priorities of distinct positions behave as
// independent uniform draws for a random seed.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void mark_draws_kernel(int64_t draws, const int64_t* __restrict__ random_bits, int64_t total,
                                  int64_t multiplier, int64_t offset, uint32_t* __restrict__ drawn) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < draws; i += stride) {
    // multiplier * (total - 1) < 2^62 (chosen so by the caller): no overflow.
    const int64_t p = ((random_bits[i] % total) * multiplier + offset) % total;
    set_bit(drawn, p);
  }
}

// The candidates in position order with their priorities (never 0xffffffff, which marks the
// unused tail of the buffer); the last thread reports how many there are.
__global__ void candidates_kernel(CandidateWord words_of, int64_t words, int64_t capacity,
                                  const int64_t* __restrict__ offsets,
                                  const int64_t* __restrict__ random_bits, int64_t* __restrict__ positions,
                                  uint32_t* __restrict__ priority, int64_t* __restrict__ candidate_count) {
  const uint64_t seed = static_cast<uint64_t>(random_bits[0]);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    uint32_t bits = words_of.bits(w);
    int64_t i = offsets[w];
    if (w == words - 1) *candidate_count = i + __popc(bits);
    // i < capacity always holds for a valid pattern (distinct slots); it keeps bad input in bounds.
    while (bits && i < capacity) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      const int64_t p = w * 32 + b;
      const uint32_t h = uint32_t(mix64(static_cast<uint64_t>(p) ^ seed) >> 32);
      positions[i] = p;
      priority[i] = h < 0xffffffffu ? h : 0xfffffffeu;
      ++i;
    }
  }
}

}  // namespace

template <typename Index>
Status sample_absent(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                     const int64_t* random_bits, int64_t draws, int64_t multiplier, int64_t offset, int64_t count,
                     int64_t* positions, int64_t* candidate_count, DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  const int64_t total = m * k;
  if (count < 0 || count > total - nnz) return InvalidArgument("sample_absent: count exceeds the absent positions");
  if (draws < 0) return InvalidArgument("sample_absent: draws must be >= 0");
  if (count == 0) return Status::Ok();
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  const int64_t words = bitmap_words(m, k);
  const int64_t capacity = draws > 0 ? draws : total - nnz;  // distinct candidates never exceed it
  size_t cub_bytes = 0;
  SNACK_RETURN_IF_ERROR(scan_word_counts(CandidateWord{nullptr, nullptr, total}, words, nullptr, nullptr, &cub_bytes,
                                         stream));
  const size_t bitmap_bytes = aligned_bytes(size_t(words) * sizeof(uint32_t));
  const size_t offset_bytes = aligned_bytes(size_t(words) * sizeof(int64_t));
  const size_t position_bytes = aligned_bytes(size_t(capacity) * sizeof(int64_t));
  const size_t priority_bytes = aligned_bytes(size_t(capacity) * sizeof(uint32_t));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(
      scratch.reserve(2 * bitmap_bytes + offset_bytes + position_bytes + priority_bytes + cub_bytes + kAlign));
  char* base = scratch.as<char>();
  auto* present = reinterpret_cast<uint32_t*>(base);
  auto* drawn = reinterpret_cast<uint32_t*>(base + bitmap_bytes);
  auto* offsets = reinterpret_cast<int64_t*>(base + 2 * bitmap_bytes);
  auto* cand_positions = reinterpret_cast<int64_t*>(base + 2 * bitmap_bytes + offset_bytes);
  auto* priority = reinterpret_cast<uint32_t*>(base + 2 * bitmap_bytes + offset_bytes + position_bytes);
  void* cub_temp = align_up(base + 2 * bitmap_bytes + offset_bytes + position_bytes + priority_bytes);

  SNACK_RETURN_IF_ERROR(mark_present<Index>(m, k, nnz, row_idx, col_idx, present, stream));
  // No draws: every absent position is a candidate.
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(drawn, draws > 0 ? 0 : 0xff, size_t(words) * sizeof(uint32_t), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(priority, 0xff, size_t(capacity) * sizeof(uint32_t), stream));
  // -1 where no candidate was written: after a (reported) shortfall the output names no real
  // position, and replace_slots' bitmap ignores it.
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(cand_positions, 0xff, size_t(capacity) * sizeof(int64_t), stream));
  if (draws > 0) {
    mark_draws_kernel<<<stride_grid(draws, limits), kDstThreads, 0, stream>>>(
        draws, random_bits + 1, total, multiplier, offset, drawn);
    SNACK_RETURN_IF_ERROR(check_launch("mark_draws_kernel"));
  }
  const CandidateWord words_of{present, drawn, total};
  SNACK_RETURN_IF_ERROR(scan_word_counts(words_of, words, offsets, cub_temp, &cub_bytes, stream));
  candidates_kernel<<<stride_grid(words, limits), kDstThreads, 0, stream>>>(
      words_of, words, capacity, offsets, random_bits, cand_positions, priority, candidate_count);
  SNACK_RETURN_IF_ERROR(check_launch("candidates_kernel"));
  // The `count` candidates of lowest priority (ties: the smaller position), in position order.
  return select_all(LowestPriorityKeys{priority}, capacity, count, cand_positions, positions, alloc, limits, stream);
}

template Status sample_absent<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, const int64_t*,
                                        int64_t, int64_t, int64_t, int64_t, int64_t*, int64_t*, DeviceAllocator&,
                                        Stream);
template Status sample_absent<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, const int64_t*,
                                       int64_t, int64_t, int64_t, int64_t, int64_t*, int64_t*, DeviceAllocator&,
                                       Stream);

}  // namespace snack::cuda
