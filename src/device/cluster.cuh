// The end of a band's output tile whose input columns a thread-block cluster split: shared by the
// tensor-core kernels (tensor_core_kernel.cuh, wgmma_kernel.cuh).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_utils.cuh"
#include "snack/activation.h"
#include "snack/value_types.h"

namespace snack::cuda::detail {

// Each of the cluster's `splits` blocks holds its float partial tile of the band at `partial` in
// shared memory, [kTile batch rows][kStride], the band's kBandRows rows along a batch row. After a
// cluster barrier (a block barrier when splits is 1), block `split` sums batch rows split,
// split + splits, ... over the blocks in rank order (deterministic), adds the bias, applies the
// activation and stores them along the output rows, a thread per row of the band; a last barrier
// keeps every block until the others have read its tile. Threads from kThreads on (a block's
// producer warp) only join the barriers.
template <typename T, int kBandRows, int kTile, int kStride, int kThreads>
__device__ __forceinline__ void store_split_band_tile(const float* partial, int64_t o0, int64_t out_dim, int64_t n0,
                                                      int64_t n, const T* __restrict__ bias, T* __restrict__ out,
                                                      Activation act, int split, int splits) {
  static_assert(kThreads % kBandRows == 0, "whole rows of threads");
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1) cluster.sync();
  else __syncthreads();
#else
  if (splits > 1) __trap();  // clusters need sm_90 (the planners' splits assume it)
  __syncthreads();
#endif
  const int row = threadIdx.x % kBandRows;
  const int first = threadIdx.x < kThreads ? split + int(threadIdx.x / kBandRows) * splits : kTile;
  for (int b = first; b < kTile; b += (kThreads / kBandRows) * splits) {
    float sum = 0.f;
    for (int q = 0; q < splits; ++q) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
      const float* part = splits > 1 ? cluster.map_shared_rank(partial, q) : partial;
#else
      const float* part = partial;
#endif
      sum += part[b * kStride + row];
    }
    const int64_t o = o0 + row, batch = n0 + b;
    if (o < out_dim && batch < n) {
      if (bias != nullptr) sum += to_accum(bias[o]);
      out[batch * out_dim + o] = from_accum<T>(apply_activation(sum, act));
    }
  }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  if (splits > 1) cluster.sync();
#endif
}

}  // namespace snack::cuda::detail
