// An exact top-k selection on the device: an MSD radix select over 32-bit keys in three passes
// (histogram, then pick the digit of the k-th key), then an ordered write of the selected elements.
// Shared by prune_slots (lowest scores), sample_absent (lowest hash priorities) and RigL's growth
// (largest |score|, also over blocks of scores: TopkSelection). Deterministic: ties go to the
// lower index.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/scratch.cuh"
#include "bitmap.cuh"
#include "snack/device_limits.h"
#include "snack/dst.h"

namespace snack::cuda::detail {

// MSD radix select over 32-bit keys: digits of 11, 11 and 10 bits, high to low.
__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
__host__ __device__ constexpr int digit_bits(int pass) { return pass == 2 ? 10 : 11; }
constexpr int kMaxBins = 2048;

struct SelectState {
  unsigned long long hist[TopkSelection::kPasses][kMaxBins];
  unsigned int prefix;  // the digits of the k-th largest key picked so far (all of it after the passes)
  long long remaining;  // keys equal to the k-th that are still to be selected (ties, after the passes)
  longlong2 carry;      // (keys above the k-th, keys equal to it) in the blocks already emitted
};

// RigL's key of a score: |s| with NaN as 0; non-negative floats order like their bits.
__device__ __forceinline__ uint32_t magnitude_key(float score) {
  const float s = fabsf(score);
  return isnan(s) ? 0u : __float_as_uint(s);
}

// Keys: get(e, key) -> false when element e takes no part; get4(e0, key) does elements e0..e0+3
// with one 16-byte load (returns the mask of those taking part).
struct AbsentMagnitudeKeys {
  const float* __restrict__ scores;
  const uint32_t* __restrict__ bitmap;
  int64_t first_position;
  __device__ __forceinline__ bool from(float v, int64_t e, uint32_t& key) const {
    if (bitmap && bit_set(bitmap, first_position + e)) return false;
    key = magnitude_key(v);
    return true;
  }
  __device__ __forceinline__ bool get(int64_t e, uint32_t& key) const { return from(scores[e], e, key); }
  __device__ __forceinline__ unsigned get4(int64_t e0, uint32_t (&key)[4]) const {
    const float4 v = *reinterpret_cast<const float4*>(scores + e0);
    return unsigned(from(v.x, e0, key[0])) | unsigned(from(v.y, e0 + 1, key[1])) << 1 |
           unsigned(from(v.z, e0 + 2, key[2])) << 2 | unsigned(from(v.w, e0 + 3, key[3])) << 3;
  }
};

struct LowestScoreKeys {
  const float* __restrict__ scores;
  __device__ __forceinline__ static uint32_t from(float s) {
    uint32_t u = isnan(s) ? 0x7f800000u : __float_as_uint(s);  // NaN ranks as +inf
    if ((u << 1) == 0) u = 0;                                   // -0 ties with +0
    const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending like the floats
    return ~ordered;                                                       // the lowest score is the largest key
  }
  __device__ __forceinline__ bool get(int64_t e, uint32_t& key) const {
    key = from(scores[e]);
    return true;
  }
  __device__ __forceinline__ unsigned get4(int64_t e0, uint32_t (&key)[4]) const {
    const float4 v = *reinterpret_cast<const float4*>(scores + e0);
    key[0] = from(v.x), key[1] = from(v.y), key[2] = from(v.z), key[3] = from(v.w);
    return 0xfu;
  }
};

struct LowestPriorityKeys {
  const uint32_t* __restrict__ priority;
  __device__ __forceinline__ bool get(int64_t e, uint32_t& key) const {
    key = ~priority[e];
    return true;
  }
  __device__ __forceinline__ unsigned get4(int64_t e0, uint32_t (&key)[4]) const {
    const uint4 v = *reinterpret_cast<const uint4*>(priority + e0);
    key[0] = ~v.x, key[1] = ~v.y, key[2] = ~v.z, key[3] = ~v.w;
    return 0xfu;
  }
};


// helpers zero the copies, pick a warp's copy, and add their sum to the pass's global counts.
template <int kCopies>
__device__ __forceinline__ void zero_bins(unsigned int (&bins)[kCopies][kMaxBins]) {
  for (int i = threadIdx.x; i < kCopies * kMaxBins; i += blockDim.x) (&bins[0][0])[i] = 0;
  __syncthreads();
}
template <int kCopies>
__device__ __forceinline__ unsigned int* warp_bins(unsigned int (&bins)[kCopies][kMaxBins]) {
  return bins[(threadIdx.x >> 5) % kCopies];
}
template <int kCopies>
__device__ __forceinline__ void flush_bins(unsigned int (&bins)[kCopies][kMaxBins], int nbins,
                                           unsigned long long* __restrict__ hist) {
  __syncthreads();
  for (int i = threadIdx.x; i < nbins; i += blockDim.x) {
    unsigned int total = 0;
    for (int c = 0; c < kCopies; ++c) total += bins[c][i];
    if (total) atomicAdd(hist + i, static_cast<unsigned long long>(total));
  }
}

constexpr int kBinCopies = 4;
template <typename Keys>
__global__ void __launch_bounds__(kDstThreads)
    select_histogram_kernel(Keys keys, int64_t count, bool vector_loads, int pass, SelectState* __restrict__ state) {
  __shared__ unsigned int bins[kBinCopies][kMaxBins];
  const int nbins = 1 << digit_bits(pass);
  zero_bins(bins);
  const int shift = digit_shift(pass), high = shift + digit_bits(pass);
  const uint32_t prefix = state->prefix;
  unsigned int* my_bins = warp_bins(bins);
  const int64_t groups = (count + 3) / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const int64_t e0 = 4 * g;
    uint32_t key[4];
    unsigned valid = 0;
    if (vector_loads && e0 + 3 < count) {
      valid = keys.get4(e0, key);
    } else {
      for (int j = 0; j < 4; ++j)
        if (e0 + j < count && keys.get(e0 + j, key[j])) valid |= 1u << j;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (!((valid >> j) & 1u)) continue;
      if (high < 32 && (key[j] >> high) != (prefix >> high)) continue;  // outside the bucket picked so far
      atomicAdd(&my_bins[(key[j] >> shift) & uint32_t(nbins - 1)], 1u);
    }
  }
  flush_bins(bins, nbins, state->hist[pass]);
}

// The emit pass walks each chunk of kEmitChunk elements warp by warp, 32 consecutive elements per
// round, so that ballots give every element its rank in position order.
constexpr int kEmitRounds = 16;
constexpr int kWarpsPerBlock = kDstThreads / 32;
constexpr int kEmitChunk = kDstThreads * kEmitRounds;

struct PairSum {
  __host__ __device__ longlong2 operator()(const longlong2& a, const longlong2& b) const {
    return make_longlong2(a.x + b.x, a.y + b.y);
  }
};

template <typename Keys>
__device__ __forceinline__ void classify(const Keys& keys, int64_t e, int64_t count, uint32_t kth, bool& above,
                                         bool& tie) {
  uint32_t key = 0;
  const bool valid = e < count && keys.get(e, key);
  above = valid && key > kth;
  tie = valid && key == kth;
}

// Per warp of this chunk: (keys above the k-th, keys equal to it), into shared memory.
template <typename Keys>
__device__ __forceinline__ void count_warp(const Keys& keys, int64_t count, uint32_t kth, int (&above_n)[kWarpsPerBlock],
                                           int (&tie_n)[kWarpsPerBlock]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t base = int64_t(blockIdx.x) * kEmitChunk + warp * (kEmitRounds * 32);
  int a_n = 0, t_n = 0;
  for (int r = 0; r < kEmitRounds; ++r) {
    bool a, t;
    classify(keys, base + r * 32 + lane, count, kth, a, t);
    a_n += __popc(__ballot_sync(~0u, a));
    t_n += __popc(__ballot_sync(~0u, t));
  }
  if (lane == 0) {
    above_n[warp] = a_n;
    tie_n[warp] = t_n;
  }
}

template <typename Keys>
__global__ void __launch_bounds__(kDstThreads)
    select_count_kernel(Keys keys, int64_t count, const SelectState* __restrict__ state,
                        longlong2* __restrict__ chunk_counts) {
  __shared__ int above_n[kWarpsPerBlock], tie_n[kWarpsPerBlock];
  count_warp(keys, count, state->prefix, above_n, tie_n);
  __syncthreads();
  if (threadIdx.x == 0) {
    long long a = 0, t = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      a += above_n[w];
      t += tie_n[w];
    }
    chunk_counts[blockIdx.x] = make_longlong2(a, t);
  }
}

// Writes out[i] = the position of the i-th selected element: every key above the k-th, and the
// first `remaining` keys equal to it, in position order over all blocks.
template <typename Keys>
__global__ void __launch_bounds__(kDstThreads)
    select_write_kernel(Keys keys, int64_t count, int64_t first_position, const int64_t* __restrict__ position_of,
                        SelectState* __restrict__ state, const longlong2* __restrict__ chunk_counts,
                        const longlong2* __restrict__ chunk_offsets, int64_t* __restrict__ out) {
  __shared__ int above_n[kWarpsPerBlock], tie_n[kWarpsPerBlock];
  const uint32_t kth = state->prefix;
  const long long ties_wanted = state->remaining;
  count_warp(keys, count, kth, above_n, tie_n);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  long long above_before = chunk_offsets[blockIdx.x].x, ties_before = chunk_offsets[blockIdx.x].y;
  for (int w = 0; w < warp; ++w) {
    above_before += above_n[w];
    ties_before += tie_n[w];
  }
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t base = int64_t(blockIdx.x) * kEmitChunk + warp * (kEmitRounds * 32);
  for (int r = 0; r < kEmitRounds; ++r) {
    const int64_t e = base + r * 32 + lane;
    bool a, t;
    classify(keys, e, count, kth, a, t);
    const unsigned ballot_a = __ballot_sync(~0u, a), ballot_t = __ballot_sync(~0u, t);
    const long long s_e = above_before + __popc(ballot_a & lower_lanes);
    const long long t_e = ties_before + __popc(ballot_t & lower_lanes);
    if (a || (t && t_e < ties_wanted)) {
      const long long slot = s_e + (t_e < ties_wanted ? t_e : ties_wanted);
      out[slot] = position_of ? position_of[e] : first_position + e;
    }
    above_before += __popc(ballot_a);
    ties_before += __popc(ballot_t);
  }
  // The next block continues after this one (the scan of this block read the carry already).
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0)
    state->carry = PairSum()(chunk_offsets[blockIdx.x], chunk_counts[blockIdx.x]);
}

template <typename Keys>
Status select_histogram(const Keys& keys, int64_t count, bool vector_loads, int pass, SelectState* state,
                        const DeviceLimits& limits, Stream stream) {
  if (count == 0) return Status::Ok();
  select_histogram_kernel<Keys><<<stride_grid((count + 3) / 4, limits), kDstThreads, 0, stream>>>(
      keys, count, vector_loads, pass, state);
  return check_launch("select_histogram_kernel");
}

template <typename Keys>
Status select_emit(const Keys& keys, int64_t count, int64_t first_position, const int64_t* position_of,
                   SelectState* state, int64_t* out, DeviceAllocator& alloc, Stream stream) {
  if (count == 0) return Status::Ok();
  const int64_t chunks = detail::ceil_div(count, kEmitChunk);
  if (chunks > (int64_t{1} << 31) - 1) return InvalidArgument("select: too many elements in one block");
  const auto init = cub::FutureValue<longlong2>(&state->carry);
  size_t cub_bytes = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveScan(nullptr, cub_bytes, (longlong2*)nullptr,
                                                            (longlong2*)nullptr, PairSum(), init, chunks, stream));
  const size_t pair_bytes = aligned_bytes(size_t(chunks) * sizeof(longlong2));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(2 * pair_bytes + cub_bytes + kAlign));
  auto* counts = scratch.as<longlong2>();
  auto* offsets = reinterpret_cast<longlong2*>(scratch.as<char>() + pair_bytes);
  void* cub_temp = align_up(scratch.as<char>() + 2 * pair_bytes);
  select_count_kernel<Keys><<<unsigned(chunks), kDstThreads, 0, stream>>>(keys, count, state, counts);
  SNACK_RETURN_IF_ERROR(check_launch("select_count_kernel"));
  SNACK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::ExclusiveScan(cub_temp, cub_bytes, counts, offsets, PairSum(), init, chunks, stream));
  select_write_kernel<Keys><<<unsigned(chunks), kDstThreads, 0, stream>>>(keys, count, first_position, position_of,
                                                                        state, counts, offsets, out);
  return check_launch("select_write_kernel");
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool aligned16(const LowestPriorityKeys& keys) { return aligned16(keys.priority); }
inline bool aligned16(const LowestScoreKeys& keys) { return aligned16(keys.scores); }

// Resets the selection state for the k largest keys (radix_select.cu).
Status select_init(SelectState* state, int64_t k, Stream stream);
// Fixes the pass's digit of the k-th key from the counts of every block (radix_select.cu).
Status select_pick(int pass, SelectState* state, Stream stream);

// The k largest of `count` keys, as ascending indices (or position_of[index]) into out [k].
template <typename Keys>
Status select_all(const Keys& keys, int64_t count, int64_t k, const int64_t* position_of, int64_t* out,
                  DeviceAllocator& alloc, const DeviceLimits& limits, Stream stream) {
  ScratchBuffer state(alloc, stream);
  SNACK_RETURN_IF_ERROR(state.reserve(sizeof(SelectState)));
  auto* st = state.as<SelectState>();
  SNACK_RETURN_IF_ERROR(select_init(st, k, stream));
  for (int pass = 0; pass < TopkSelection::kPasses; ++pass) {
    SNACK_RETURN_IF_ERROR(select_histogram(keys, count, aligned16(keys), pass, st, limits, stream));
    SNACK_RETURN_IF_ERROR(select_pick(pass, st, stream));
  }
  return select_emit(keys, count, 0, position_of, st, out, alloc, stream);
}

}  // namespace snack::cuda::detail
