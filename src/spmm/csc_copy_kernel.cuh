// The CSC view of W copied as the CSR arrays of W^T (SpmmPlan::csc_copied): entry j, in column order,
// gets the row and the value of slot csc_perm[j]. Read in place, every batch tile of the transposed
// product pays a position and two dependent gathers per slot, and the kernels' per-warp chains of
// them leave the memory system idle; here all the gathers are independent and in flight at once,
// and the product then streams both arrays with the forward's vector loads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace snack::cuda::detail {

constexpr int kCscCopyThreads = 256;
constexpr int kCscCopyPerThread = 4;  // entries per thread per round: their gathers issued together

template <typename T, typename Index, typename CopyIndex>
__global__ void __launch_bounds__(kCscCopyThreads)
    copy_csc_kernel(const int32_t* __restrict__ perm, const Index* __restrict__ row_idx, const T* __restrict__ values,
                    int64_t nnz, CopyIndex* __restrict__ rows_out, T* __restrict__ values_out) {
  const int64_t round = int64_t(gridDim.x) * kCscCopyThreads * kCscCopyPerThread;
  for (int64_t base = int64_t(blockIdx.x) * kCscCopyThreads * kCscCopyPerThread + threadIdx.x; base < nnz;
       base += round) {
    int32_t slot[kCscCopyPerThread];
#pragma unroll
    for (int k = 0; k < kCscCopyPerThread; ++k) {
      const int64_t j = base + int64_t(k) * kCscCopyThreads;
      slot[k] = j < nnz ? perm[j] : 0;
    }
    Index row[kCscCopyPerThread];
    T value[kCscCopyPerThread];
#pragma unroll
    for (int k = 0; k < kCscCopyPerThread; ++k) {
      row[k] = row_idx[slot[k]];
      value[k] = values[slot[k]];
    }
#pragma unroll
    for (int k = 0; k < kCscCopyPerThread; ++k) {
      const int64_t j = base + int64_t(k) * kCscCopyThreads;
      if (j < nnz) {
        rows_out[j] = CopyIndex(row[k]);
        values_out[j] = value[k];
      }
    }
  }
}

}  // namespace snack::cuda::detail
