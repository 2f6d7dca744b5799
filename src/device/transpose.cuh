// The transpose of a batch of activations into tiles of `npad` values per column, which the row
// and SDDMM kernels read as vectors, and the optimizer step counts it can advance on the way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_utils.cuh"

namespace snack::cuda::detail {

// Up to two optimizer step counts (float, device memory; null: none) that a kernel advances by one,
// so that the kernels after it read the number of this update without a launch of its own.
struct StepCounts {
  float* first = nullptr;
  float* second = nullptr;
  __host__ __device__ bool any() const { return first != nullptr || second != nullptr; }
  __device__ void advance() const {
    if (first) *first += 1.0f;
    if (second) *second += 1.0f;
  }
};

// in_t[t, c, j] = in[t * npad + j, c] for c < in_dim, zero past the batch and for the rows
// in_dim <= c < out_rows (the row kernels' zero slot): every batch tile t = blockIdx.z, transposed
// into [tiles, out_rows, npad]. One thread also advances `counts`.
template <typename T>
__global__ void transpose_tile_kernel(const T* __restrict__ in, int64_t n, int64_t in_dim, int64_t out_rows, int npad,
                                      T* __restrict__ in_t, StepCounts counts) {
  __shared__ T tile[32][33];
  allow_dependent_launch();  // the rows kernel after it prefetches W meanwhile, then waits for this grid
  if (counts.any() && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0)
    counts.advance();
  const int64_t c0 = int64_t(blockIdx.x) * 32;
  const int64_t j0 = int64_t(blockIdx.y) * 32;
  const int64_t n0 = int64_t(blockIdx.z) * npad;
  in_t += int64_t(blockIdx.z) * out_rows * npad;
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t j = j0 + dy, c = c0 + threadIdx.x;
    tile[dy][threadIdx.x] = (j < npad && n0 + j < n && c < in_dim) ? in[(n0 + j) * in_dim + c] : T{};
  }
  __syncthreads();
  for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
    const int64_t c = c0 + dy, j = j0 + threadIdx.x;
    if (c < out_rows && j < npad) in_t[c * npad + j] = tile[threadIdx.x][dy];
  }
}

}  // namespace snack::cuda::detail
