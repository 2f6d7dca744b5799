// Dynamic sparse training on the device: replacing slots, sampling absent positions and exact top-k
// selection, built on a bitmap of the pattern's positions instead of sorts. Every function enqueues
// work on its stream and returns; none waits for the device, and every result is deterministic.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../common/op_checks.h"
#include "bitmap.cuh"
#include "cuda_utils.cuh"
#include "scratch.cuh"
#include "snack/topology.h"

namespace snack::cuda {
namespace {

using detail::align_up;
using detail::aligned_bytes;
using detail::bit_rank;
using detail::bit_set;
using detail::check_launch;
using detail::device_limits;
using detail::DeviceLimits;
using detail::grid_for;
using detail::kAlign;
using detail::scan_word_counts;
using detail::ScratchBuffer;
using detail::set_bit;
using detail::WordPopcount;

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `items`: enough to fill the device, not one per item.
unsigned stride_grid(int64_t items) {
  DeviceLimits limits;
  const int sms = device_limits(&limits).ok() ? limits.sms : 132;
  return grid_for(items, kThreads * 4, int64_t(sms) * 8);
}

// ---- bitmaps ------------------------------------------------------------------------------------
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

// Out-of-range entries (possible only from an unvalidated caller) are ignored: never a stray write.
__global__ void mark_positions_kernel(int64_t count, const int64_t* __restrict__ positions, int64_t total,
                                      uint32_t* __restrict__ bitmap) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t p = positions[i];
    if (p >= 0 && p < total) set_bit(bitmap, p);
  }
}

__global__ void flag_kernel(int64_t count, const int64_t* __restrict__ slots, int64_t nnz,
                            uint8_t* __restrict__ flags) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t s = slots[i];
    if (s >= 0 && s < nnz) flags[s] = 1;
  }
}

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

// ---- replace_slots -------------------------------------------------------------------------------
// Every set bit of the new bitmap becomes a slot, in position order: slot = offsets[w] + rank in
// word. A word spans at most a few rows, so the row is found once per word, not by a division per bit.
template <typename Index>
__global__ void slots_from_bitmap_kernel(int64_t k, int64_t nnz, int64_t words, const uint32_t* __restrict__ bitmap,
                                         const int64_t* __restrict__ offsets, Index* __restrict__ row_idx,
                                         Index* __restrict__ col_idx) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    uint32_t bits = bitmap[w];
    if (!bits) continue;
    int64_t slot = offsets[w];
    const int64_t first = w * 32;
    int64_t row = first / k;
    int64_t row_start = row * k;
    // slot < nnz: more set bits than slots only come from unvalidated input (repeated drops).
    while (bits && slot < nnz) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      const int64_t p = first + b;
      while (p >= row_start + k) {
        ++row;
        row_start += k;
      }
      row_idx[slot] = Index(row);
      col_idx[slot] = Index(p - row_start);
      ++slot;
    }
  }
}

// source[new slot of s] = s for every kept slot s (the grown slots keep the -1 fill).
template <typename Index>
__global__ void kept_sources_kernel(int64_t k, int64_t nnz, const Index* __restrict__ row_idx,
                                    const Index* __restrict__ col_idx, const uint8_t* __restrict__ dropped,
                                    const uint32_t* __restrict__ bitmap, const int64_t* __restrict__ offsets,
                                    int64_t* __restrict__ source) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    if (dropped[s]) continue;
    const int64_t slot = bit_rank(bitmap, offsets, int64_t(row_idx[s]) * k + int64_t(col_idx[s]));
    if (slot < nnz) source[slot] = s;  // always true for validated input
  }
}

// ---- following the permutation ---------------------------------------------------------------------
template <typename T>
__global__ void gather_slots_kernel(int64_t nnz, const T* __restrict__ in, const int64_t* __restrict__ source,
                                    const T* __restrict__ fill, bool fill_per_slot, T* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    const int64_t from = source[s];
    // Out-of-range entries (never from replace_slots) take the fill rather than read out of bounds.
    out[s] = (from >= 0 && from < nnz) ? in[from] : fill[fill_per_slot ? s : 0];
  }
}

// ---- exact top-k selection -----------------------------------------------------------------------
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

__global__ void select_init_kernel(SelectState* state, long long k) {
  unsigned long long* hist = &state->hist[0][0];
  for (int i = threadIdx.x; i < TopkSelection::kPasses * kMaxBins; i += blockDim.x) hist[i] = 0;
  if (threadIdx.x == 0) {
    state->prefix = 0;
    state->remaining = k;
    state->carry = make_longlong2(0, 0);
  }
}

// Histograms are counted in shared memory in several copies, one per group of warps: keys crowd
// into few bins (one exponent range), and shared-memory atomics on one address serialise. These
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
__global__ void __launch_bounds__(kThreads)
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

// The bucket of this pass that holds the `remaining`-th largest key: walk the bins from the top.
constexpr int kPickThreads = kMaxBins / 2;
__global__ void __launch_bounds__(kPickThreads) select_pick_kernel(int pass, SelectState* __restrict__ state) {
  using Scan = cub::BlockScan<unsigned long long, kPickThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int nbins = 1 << digit_bits(pass);
  const int b0 = nbins - 1 - 2 * int(threadIdx.x), b1 = b0 - 1;
  const unsigned long long h0 = b0 >= 0 ? state->hist[pass][b0] : 0, h1 = b1 >= 0 ? state->hist[pass][b1] : 0;
  unsigned long long above = 0;
  Scan(temp).ExclusiveSum(h0 + h1, above);
  const long long want = state->remaining;
  __syncthreads();  // every thread has read `remaining` before one of them rewrites it
  const auto need = static_cast<unsigned long long>(want);
  int picked = -1;
  unsigned long long before = 0;
  if (b0 >= 0 && above < need && need <= above + h0) {
    picked = b0;
    before = above;
  } else if (b1 >= 0 && above + h0 < need && need <= above + h0 + h1) {
    picked = b1;
    before = above + h0;
  }
  if (picked >= 0) {
    state->prefix |= uint32_t(picked) << digit_shift(pass);
    state->remaining = want - static_cast<long long>(before);
  }
}

// The emit pass walks each chunk of kEmitChunk elements warp by warp, 32 consecutive elements per
// round, so that ballots give every element its rank in position order.
constexpr int kEmitRounds = 16;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kEmitChunk = kThreads * kEmitRounds;

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
__global__ void __launch_bounds__(kThreads)
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
__global__ void __launch_bounds__(kThreads)
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
                        Stream stream) {
  if (count == 0) return Status::Ok();
  select_histogram_kernel<Keys><<<stride_grid((count + 3) / 4), kThreads, 0, stream>>>(keys, count, vector_loads, pass,
                                                                                       state);
  return check_launch("select_histogram_kernel");
}

Status select_pick(int pass, SelectState* state, Stream stream) {
  select_pick_kernel<<<1, kPickThreads, 0, stream>>>(pass, state);
  return check_launch("select_pick_kernel");
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
  select_count_kernel<Keys><<<unsigned(chunks), kThreads, 0, stream>>>(keys, count, state, counts);
  SNACK_RETURN_IF_ERROR(check_launch("select_count_kernel"));
  SNACK_CUDA_RETURN_IF_ERROR(
      cub::DeviceScan::ExclusiveScan(cub_temp, cub_bytes, counts, offsets, PairSum(), init, chunks, stream));
  select_write_kernel<Keys><<<unsigned(chunks), kThreads, 0, stream>>>(keys, count, first_position, position_of,
                                                                        state, counts, offsets, out);
  return check_launch("select_write_kernel");
}

// ---- RigL: the scores computed in registers, never stored ----------------------------------------
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
__global__ void __launch_bounds__(kThreads)
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

// ---- sample_absent -------------------------------------------------------------------------------
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool aligned16(const LowestPriorityKeys& keys) { return aligned16(keys.priority); }
bool aligned16(const LowestScoreKeys& keys) { return aligned16(keys.scores); }

template <typename Keys>
Status select_all(const Keys& keys, int64_t count, int64_t k, const int64_t* position_of, int64_t* out,
                  DeviceAllocator& alloc, Stream stream) {
  ScratchBuffer state(alloc, stream);
  SNACK_RETURN_IF_ERROR(state.reserve(sizeof(SelectState)));
  auto* st = state.as<SelectState>();
  select_init_kernel<<<1, 1024, 0, stream>>>(st, k);
  SNACK_RETURN_IF_ERROR(check_launch("select_init_kernel"));
  for (int pass = 0; pass < TopkSelection::kPasses; ++pass) {
    SNACK_RETURN_IF_ERROR(select_histogram(keys, count, aligned16(keys), pass, st, stream));
    SNACK_RETURN_IF_ERROR(select_pick(pass, st, stream));
  }
  return select_emit(keys, count, 0, position_of, st, out, alloc, stream);
}

}  // namespace

int64_t bitmap_words(int64_t m, int64_t k) { return detail::ceil_div(m * k, 32); }

// Up to 64 bytes of bitmap per slot plus 64 MiB: sparser or larger matrices take paths whose
// memory follows nnz.
bool bitmap_affordable(int64_t m, int64_t k, int64_t nnz) {
  const int64_t total = m * k;
  return total < (int64_t{1} << 40) && total / 8 <= 64 * nnz + (int64_t{64} << 20);
}

template <typename Index>
Status replace_slots(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, int64_t count,
                     const int64_t* drop, const int64_t* grow, Index* new_row_idx, Index* new_col_idx, int64_t* source,
                     DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (count < 0 || count > nnz) return InvalidArgument("replace_slots: count must lie in [0, nnz]");
  if (nnz == 0) return Status::Ok();
  const int64_t words = bitmap_words(m, k);
  size_t cub_bytes = 0;
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{nullptr}, words, nullptr, nullptr, &cub_bytes, stream));
  const size_t bitmap_bytes = aligned_bytes(size_t(words) * sizeof(uint32_t));
  const size_t offset_bytes = aligned_bytes(size_t(words) * sizeof(int64_t));
  const size_t flag_bytes = aligned_bytes(size_t(nnz));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(bitmap_bytes + offset_bytes + flag_bytes + cub_bytes + kAlign));
  auto* bitmap = scratch.as<uint32_t>();
  auto* offsets = reinterpret_cast<int64_t*>(scratch.as<char>() + bitmap_bytes);
  auto* dropped = reinterpret_cast<uint8_t*>(scratch.as<char>() + bitmap_bytes + offset_bytes);
  void* cub_temp = align_up(dropped + flag_bytes);

  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bitmap, 0, size_t(words) * sizeof(uint32_t), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dropped, 0, size_t(nnz), stream));
  if (count > 0) {
    flag_kernel<<<stride_grid(count), kThreads, 0, stream>>>(count, drop, nnz, dropped);
    SNACK_RETURN_IF_ERROR(check_launch("flag_kernel"));
  }
  mark_slots_kernel<Index><<<stride_grid(nnz), kThreads, 0, stream>>>(k, nnz, row_idx, col_idx, dropped, bitmap);
  SNACK_RETURN_IF_ERROR(check_launch("mark_slots_kernel"));
  if (count > 0) {
    mark_positions_kernel<<<stride_grid(count), kThreads, 0, stream>>>(count, grow, m * k, bitmap);
    SNACK_RETURN_IF_ERROR(check_launch("mark_positions_kernel"));
  }
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{bitmap}, words, offsets, cub_temp, &cub_bytes, stream));
  // Zeros where an unvalidated grow left slots unfilled (a grown position that was kept): in range.
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(new_row_idx, 0, size_t(nnz) * sizeof(Index), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(new_col_idx, 0, size_t(nnz) * sizeof(Index), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(source, 0xff, size_t(nnz) * sizeof(int64_t), stream));  // -1
  slots_from_bitmap_kernel<Index><<<stride_grid(words), kThreads, 0, stream>>>(k, nnz, words, bitmap, offsets,
                                                                               new_row_idx, new_col_idx);
  SNACK_RETURN_IF_ERROR(check_launch("slots_from_bitmap_kernel"));
  kept_sources_kernel<Index><<<stride_grid(nnz), kThreads, 0, stream>>>(k, nnz, row_idx, col_idx, dropped, bitmap,
                                                                        offsets, source);
  return check_launch("kept_sources_kernel");
}

template <typename Index>
Status sample_absent(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                     const int64_t* random_bits, int64_t draws, int64_t multiplier, int64_t offset, int64_t count,
                     int64_t* positions, int64_t* candidate_count, DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  const int64_t total = m * k;
  if (count < 0 || count > total - nnz) return InvalidArgument("sample_absent: count exceeds the absent positions");
  if (draws < 0) return InvalidArgument("sample_absent: draws must be >= 0");
  if (count == 0) return Status::Ok();
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
    mark_draws_kernel<<<stride_grid(draws), kThreads, 0, stream>>>(draws, random_bits + 1, total, multiplier, offset,
                                                                   drawn);
    SNACK_RETURN_IF_ERROR(check_launch("mark_draws_kernel"));
  }
  const CandidateWord words_of{present, drawn, total};
  SNACK_RETURN_IF_ERROR(scan_word_counts(words_of, words, offsets, cub_temp, &cub_bytes, stream));
  candidates_kernel<<<stride_grid(words), kThreads, 0, stream>>>(words_of, words, capacity, offsets, random_bits, cand_positions,
                                                                 priority, candidate_count);
  SNACK_RETURN_IF_ERROR(check_launch("candidates_kernel"));
  // The `count` candidates of lowest priority (ties: the smaller position), in position order.
  return select_all(LowestPriorityKeys{priority}, capacity, count, cand_positions, positions, alloc, stream);
}

Status lowest_slots(const float* scores, int64_t count, int64_t k, int64_t* slots, DeviceAllocator& alloc,
                    Stream stream) {
  if (k < 0 || k > count) return InvalidArgument("lowest_slots: k must lie in [0, count]");
  if (k == 0) return Status::Ok();
  if (!scores || !slots) return InvalidArgument("lowest_slots: null array");
  return select_all(LowestScoreKeys{scores}, count, k, nullptr, slots, alloc, stream);
}

// ---- TopkSelection --------------------------------------------------------------------------------
TopkSelection::TopkSelection(int64_t k, const uint32_t* bitmap, DeviceAllocator& alloc, Stream stream)
    : k_(k), bitmap_(bitmap), alloc_(alloc), stream_(stream) {}

TopkSelection::~TopkSelection() {
  if (state_) alloc_.deallocate(state_, stream_);
}

Status TopkSelection::begin() {
  if (k_ < 1) return InvalidArgument("TopkSelection: k must be at least 1");
  if (!state_) state_ = alloc_.allocate(sizeof(SelectState), stream_);
  if (!state_) return Status(StatusCode::kCudaError, "out of device memory for the selection state");
  select_init_kernel<<<1, 1024, 0, stream_>>>(static_cast<SelectState*>(state_), k_);
  return check_launch("select_init_kernel");
}

Status TopkSelection::histogram(int pass, const float* scores, int64_t count, int64_t first_position) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  if (pass < 0 || pass >= kPasses) return InvalidArgument("TopkSelection: pass out of range");
  return select_histogram(AbsentMagnitudeKeys{scores, bitmap_, first_position}, count, aligned16(scores), pass,
                          static_cast<SelectState*>(state_), stream_);
}

Status TopkSelection::pick(int pass) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  if (pass < 0 || pass >= kPasses) return InvalidArgument("TopkSelection: pass out of range");
  return select_pick(pass, static_cast<SelectState*>(state_), stream_);
}

Status TopkSelection::emit(const float* scores, int64_t count, int64_t first_position, int64_t* out) {
  if (!state_) return InvalidArgument("TopkSelection: call begin() first");
  return select_emit(AbsentMagnitudeKeys{scores, bitmap_, first_position}, count, first_position, nullptr,
                     static_cast<SelectState*>(state_), out, alloc_, stream_);
}

template <typename T>
Status gather_slots(int64_t nnz, const T* in, const int64_t* source, const T* fill, bool fill_per_slot, T* out,
                    Stream stream) {
  if (nnz == 0) return Status::Ok();
  if (!in || !source || !fill || !out) return InvalidArgument("gather_slots: null array");
  gather_slots_kernel<T><<<stride_grid(nnz), kThreads, 0, stream>>>(nnz, in, source, fill, fill_per_slot, out);
  return check_launch("gather_slots_kernel");
}

template Status gather_slots<float>(int64_t, const float*, const int64_t*, const float*, bool, float*, Stream);
template Status gather_slots<double>(int64_t, const double*, const int64_t*, const double*, bool, double*, Stream);

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
    mark_slots_kernel<Index><<<stride_grid(nnz), kThreads, 0, stream>>>(k, nnz, row_idx, col_idx, nullptr, present);
    SNACK_RETURN_IF_ERROR(check_launch("mark_slots_kernel"));
  }
  select_init_kernel<<<1, 1024, 0, stream>>>(state, count);
  SNACK_RETURN_IF_ERROR(check_launch("select_init_kernel"));
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  const int64_t tiles = detail::ceil_div(m, kScoreTile) * detail::ceil_div(k, kScoreTile);
  const auto grid = unsigned(std::min<int64_t>(tiles, int64_t(limits.sms) * 4));
  for (int pass = 0; pass < TopkSelection::kPasses; ++pass) {
    rigl_pass_kernel<false><<<grid, kThreads, 0, stream>>>(dy, x, n, m, k, present, pass, state, nullptr, nullptr);
    SNACK_RETURN_IF_ERROR(check_launch("rigl_pass_kernel<histogram>"));
    SNACK_RETURN_IF_ERROR(select_pick(pass, state, stream));
  }
  rigl_pass_kernel<true><<<grid, kThreads, 0, stream>>>(dy, x, n, m, k, present, 0, state, above, ties);
  SNACK_RETURN_IF_ERROR(check_launch("rigl_pass_kernel<select>"));
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{ties}, words, offsets, cub_temp, &cub_bytes, stream));
  take_first_ties_kernel<<<stride_grid(words), kThreads, 0, stream>>>(words, ties, offsets, state, above);
  SNACK_RETURN_IF_ERROR(check_launch("take_first_ties_kernel"));
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{above}, words, offsets, cub_temp, &cub_bytes, stream));
  positions_from_bitmap_kernel<<<stride_grid(words), kThreads, 0, stream>>>(words, above, offsets, positions);
  return check_launch("positions_from_bitmap_kernel");
}

template <typename Index>
Status mark_present(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, uint32_t* bitmap,
                    Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bitmap, 0, size_t(bitmap_words(m, k)) * sizeof(uint32_t), stream));
  if (nnz == 0) return Status::Ok();
  mark_slots_kernel<Index><<<stride_grid(nnz), kThreads, 0, stream>>>(k, nnz, row_idx, col_idx, nullptr, bitmap);
  return check_launch("mark_slots_kernel");
}

#define SNACK_INSTANTIATE_DST(Index)                                                                               \
  template Status replace_slots<Index>(int64_t, int64_t, int64_t, const Index*, const Index*, int64_t,             \
                                       const int64_t*, const int64_t*, Index*, Index*, int64_t*, DeviceAllocator&, \
                                       Stream);                                                                    \
  template Status sample_absent<Index>(int64_t, int64_t, int64_t, const Index*, const Index*, const int64_t*,      \
                                       int64_t, int64_t, int64_t, int64_t, int64_t*, int64_t*, DeviceAllocator&,   \
                                       Stream);                                                                    \
  template Status mark_present<Index>(int64_t, int64_t, int64_t, const Index*, const Index*, uint32_t*, Stream);    \
  template Status topk_absent_gradient<Index>(int64_t, int64_t, int64_t, const Index*, const Index*, const float*, \
                                              const float*, int64_t, int64_t, int64_t*, DeviceAllocator&, Stream);

SNACK_INSTANTIATE_DST(uint16_t)
SNACK_INSTANTIATE_DST(int32_t)

}  // namespace snack::cuda
