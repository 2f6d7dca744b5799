// The end of a band's output tile whose input columns a thread-block cluster split: shared by the
// tensor-core kernels (tensor_core_kernel.cuh, wgmma_kernel.cuh).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_utils.cuh"
#include "snack/activation.h"
#include "snack/value_types.h"

namespace snack::cuda::detail {

// The most blocks in a cluster that every sm_90 launch may ask for (the portable cluster size).
constexpr int kPortableClusterSize = 8;

// Each of the cluster's `splits` blocks holds its float partial tile of the band in shared memory as
// kParts tiles at `partials`, part p at partials + p * kTile * kStride, each [kTile batch rows][kStride]
// with the band's kBandRows rows along a batch row (kStride a multiple of 4, `partials` 16-byte
// aligned). The parts are added in order (a block's warps that split the input columns), then, after a
// cluster barrier (a block barrier when splits is 1), block `split` sums batch rows split,
// split + splits, ... over the blocks in rank order (deterministic), adds the bias, applies the
// activation and stores them along the output rows. With several parts a thread takes 4 consecutive
// rows of one batch row at a time, so that its reads of the tiles are 16-byte loads (local, or of the
// cluster's blocks) and, where the output's rows allow, its store is one word of 4 values; a single
// part is stored a row per thread unless kRowsOfFour, as the kernels with a tight register bound want
// (the 4-row steps took the tile-view kernel of packed values from 96 to 128 registers at batch tiles
// of 32, and with the cluster's tiles read in a loop unrolled over the most blocks a cluster may have,
// its batch tiles of 16 from 72 to 96). A last barrier keeps every block until the others have read
// its tile. Threads from kThreads on (a block's producer warp) only join the barriers.
template <typename T, int kBandRows, int kTile, int kStride, int kThreads, int kParts = 1,
          bool kRowsOfFour = (kParts > 1)>
__device__ __forceinline__ void store_split_band_tile(float* partials, int64_t o0, int64_t out_dim, int64_t n0,
                                                      int64_t n, const T* __restrict__ bias, T* __restrict__ out,
                                                      Activation act, int split, int splits) {
  constexpr int kVec = 4;                             // band rows per thread and step: one float4 of a tile
  constexpr int kRowVecs = kBandRows / kVec;          // steps along one batch row
  constexpr int kPartFloats = kTile * kStride;
  static_assert(kThreads % kBandRows == 0, "whole rows of threads");
  static_assert(kBandRows % kVec == 0 && kStride % 4 == 0, "16-byte reads of the partial tiles");
  using Word = std::conditional_t<kVec * sizeof(T) == 8, uint2, uint4>;  // kVec values of the output
  static_assert(kVec * sizeof(T) == sizeof(Word), "one word of output per step");
  const int t = threadIdx.x;
  auto load4 = [](const float* p, float (&v)[kVec]) {
    const float4 q = *reinterpret_cast<const float4*>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  };
  // The kVec rows at element offset `at` of a tile, summed over this block's parts in order.
  auto sum_parts = [&](int at, float (&sum)[kVec]) {
    load4(partials + at, sum);
#pragma unroll
    for (int p = 1; p < kParts; ++p) {
      float v[kVec];
      load4(partials + p * kPartFloats + at, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum[e] += v[e];
    }
  };
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1 && kParts > 1) {
    // The other blocks read this block's whole tile: its parts are summed into part 0 first.
    __syncthreads();
    for (int i = t < kThreads ? t : kTile * kRowVecs; i < kTile * kRowVecs; i += kThreads) {
      const int at = (i / kRowVecs) * kStride + (i % kRowVecs) * kVec;
      float sum[kVec];
      sum_parts(at, sum);
      *reinterpret_cast<float4*>(partials + at) = make_float4(sum[0], sum[1], sum[2], sum[3]);
    }
  }
  if (splits > 1) cluster.sync();
  else __syncthreads();
#else
  if (splits > 1) __trap();  // clusters need sm_90 (the planners' splits assume it)
  __syncthreads();
#endif
  if constexpr (!kRowsOfFour) {
    const int row = t % kBandRows;
    const int first = t < kThreads ? split + int(t / kBandRows) * splits : kTile;
    for (int b = first; b < kTile; b += (kThreads / kBandRows) * splits) {
      float sum = 0.f;
      for (int q = 0; q < splits; ++q) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
        const float* part = splits > 1 ? cluster.map_shared_rank(partials, q) : partials;
#else
        const float* part = partials;
#endif
        sum += part[b * kStride + row];
      }
      const int64_t o = o0 + row, batch = n0 + b;
      if (o < out_dim && batch < n) {
        if (bias != nullptr) sum += to_accum(bias[o]);
        out[batch * out_dim + o] = from_accum<T>(apply_activation(sum, act));
      }
    }
  } else {
    const bool whole_words =
        reinterpret_cast<uintptr_t>(out) % sizeof(Word) == 0 && out_dim * int64_t(sizeof(T)) % sizeof(Word) == 0;
    // This block's batch rows b = split + r * splits, r < mine, each kRowVecs steps of kVec rows.
    const int mine = (kTile - split + splits - 1) / splits;
    for (int i = t < kThreads ? t : mine * kRowVecs; i < mine * kRowVecs; i += kThreads) {
      const int b = split + (i / kRowVecs) * splits, row = (i % kRowVecs) * kVec;
      const int at = b * kStride + row;
      float sum[kVec];
      if (splits == 1) {
        sum_parts(at, sum);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum[e] = 0.f;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
        // Unrolled over the most blocks a cluster may have: as a loop of `splits` steps the fragment
        // kernel ran 7-8% slower, clusters or not (the compiler laid out the whole kernel anew).
#pragma unroll
        for (int q = 0; q < kPortableClusterSize; ++q) {
          if (q < splits) {
            float v[kVec];
            load4(cluster.map_shared_rank(partials, q) + at, v);
#pragma unroll
            for (int e = 0; e < kVec; ++e) sum[e] += v[e];
          }
        }
#endif
      }
      const int64_t o = o0 + row, batch = n0 + b;
      if (batch >= n || o >= out_dim) continue;
      alignas(sizeof(Word)) T y[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float v = sum[e];
        if (bias != nullptr && o + e < out_dim) v += to_accum(bias[o + e]);
        y[e] = from_accum<T>(apply_activation(v, act));
      }
      T* dst = out + batch * out_dim + o;
      if (whole_words && o + kVec <= out_dim) {
        *reinterpret_cast<Word*>(dst) = *reinterpret_cast<const Word*>(y);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          if (o + e < out_dim) dst[e] = y[e];
      }
    }
  }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  if (splits > 1) cluster.sync();
#endif
}

}  // namespace snack::cuda::detail
