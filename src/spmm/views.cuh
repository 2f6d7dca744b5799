// How the SpMM kernels see W: for output row o, where its entries are and which input column and
// value each has. The forward walks the CSR view, the transposed product the CSC view; the kernels
// never care which of the two products they compute.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cuda_utils.cuh"

namespace snack::cuda::detail {

// Rows of W (forward): entries s in [row_ptr[o], row_ptr[o+1]), input column col_idx[s], value values[s].
template <typename T, typename Index>
struct CsrView {
  using IndexType = Index;
  static constexpr bool kContiguousSlots = true;  // an output row's entries are consecutive slots
  const int32_t* __restrict__ ptr;
  const Index* __restrict__ idx;
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[e]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[e]; }
  // This block's share of the slot arrays of nnz entries, requested into L2.
  __device__ __forceinline__ void prefetch_l2(int64_t nnz) const {
    prefetch_l2_share(values, nnz * int64_t(sizeof(T)));
    prefetch_l2_share(idx, nnz * int64_t(sizeof(Index)));
  }
};

// Columns of W (transposed product): entries j in [col_ptr[o], col_ptr[o+1]) are slots csc_perm[j],
// whose input is the row of the slot.
template <typename T, typename Index>
struct CscView {
  using IndexType = Index;
  static constexpr bool kContiguousSlots = false;
  const int32_t* __restrict__ ptr;
  const int32_t* __restrict__ perm;
  const Index* __restrict__ idx;  // row_idx
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[perm[e]]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[perm[e]]; }
  __device__ __forceinline__ void prefetch_l2(int64_t nnz) const {
    prefetch_l2_share(perm, nnz * int64_t(sizeof(int32_t)));
    prefetch_l2_share(values, nnz * int64_t(sizeof(T)));
    prefetch_l2_share(idx, nnz * int64_t(sizeof(Index)));
  }
};

}  // namespace snack::cuda::detail
