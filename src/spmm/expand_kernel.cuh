// kDenseBlocks' expansion: outputs of a view of W written dense into a block that the caller's GEMM
// multiplies. Where a row fits shared memory (kExpandStagedMaxBytes) a block builds each row there
// and stores it once; otherwise a warp per output row zeroes the row with 16-byte stores where the
// rows are aligned for them, then writes the row's slots into it (the row is still in L2, so the
// scattered stores cost no second pass over memory).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cuda_utils.cuh"
#include "shapes.h"

namespace snack::cuda::detail {

// block[o - first, :] = row o of the view, dense, for o in [first, first + count); `width` values
// per block row. vector_rows: every block row starts 16-byte aligned and is a whole number of
// 16-byte units.
template <typename T, typename View>
__global__ void expand_block_kernel(View view, int64_t first, int64_t count, int64_t width, bool vector_rows,
                                    T* __restrict__ block) {
  const int lane = int(threadIdx.x & 31);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < count; r += warps) {
    T* row = block + r * width;
    if (vector_rows) {
      uint4* row16 = reinterpret_cast<uint4*>(row);
      const int64_t units = width * int64_t(sizeof(T)) / 16;
      for (int64_t i = lane; i < units; i += 32) row16[i] = make_uint4(0, 0, 0, 0);
    } else {
      for (int64_t i = lane; i < width; i += 32) row[i] = from_accum<T>(accum_t<T>(0));
    }
    __syncwarp();  // the zeros before the slots: ordered among the warp's lanes
    const int32_t begin = view.ptr[first + r], end = view.ptr[first + r + 1];
    for (int32_t e = begin + lane; e < end; e += 32) row[view.input(e)] = view.value(e);
  }
}

// expand_block_kernel's rows built in shared memory, a block per row at a time: the row's zeros and
// slots written there, then the row stored once with coalesced (16-byte where vector_rows) stores,
// instead of zeros stored and slots scattered over them in global memory. `smem` holds one row padded
// to 16 bytes (expand_staged_row_bytes).
template <typename T, typename View>
__global__ void __launch_bounds__(kExpandThreads)
    expand_block_staged_kernel(View view, int64_t first, int64_t count, int64_t width, bool vector_rows,
                               T* __restrict__ block) {
  extern __shared__ __align__(16) unsigned char expand_smem[];
  T* staged = reinterpret_cast<T*>(expand_smem);
  uint4* staged16 = reinterpret_cast<uint4*>(expand_smem);
  const int t = int(threadIdx.x);
  const int64_t units = (width * int64_t(sizeof(T)) + 15) / 16;
  for (int64_t r = blockIdx.x; r < count; r += gridDim.x) {
    for (int64_t i = t; i < units; i += kExpandThreads) staged16[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    const int32_t begin = view.ptr[first + r], end = view.ptr[first + r + 1];
    for (int32_t e = begin + t; e < end; e += kExpandThreads) staged[view.input(e)] = view.value(e);
    __syncthreads();
    T* row = block + r * width;
    if (vector_rows) {
      uint4* row16 = reinterpret_cast<uint4*>(row);
      for (int64_t i = t; i < units; i += kExpandThreads) row16[i] = staged16[i];
    } else {
      for (int64_t i = t; i < width; i += kExpandThreads) row[i] = staged[i];
    }
    __syncthreads();  // the row is stored before the next one's zeros
  }
}

}  // namespace snack::cuda::detail
