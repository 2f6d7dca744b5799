// How the SpMM kernels see W: for output row o, where its entries are and which input column and
// value each has. The forward walks the CSR view, the transposed product the CSC view; the kernels
// never care which of the two products they compute.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"

namespace snack::cuda::detail {

// Entries [e8, e8 + 8) of a view one by one (the views' load8 where a whole vector cannot be read):
// inputs and 16-bit value bits, input INT_MAX outside [lo, hi).
template <typename View>
__device__ __forceinline__ void load8_entrywise(const View& view, int32_t e8, int32_t lo, int32_t hi,
                                                int32_t (&input8)[8], uint16_t (&bits8)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int32_t e = e8 + j;
    const bool valid = e >= lo && e < hi;
    input8[j] = valid ? view.input(e) : INT_MAX;
    bits8[j] = valid ? view.value(e).bits : uint16_t(0);
  }
}

// Rows of W (forward): entries s in [row_ptr[o], row_ptr[o+1]), input column col_idx[s], value values[s].
template <typename T, typename Index>
struct CsrView {
  const int32_t* __restrict__ ptr;
  const Index* __restrict__ idx;
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[e]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[e]; }
  // Whether load8 may read whole vectors: the slot arrays start on 16 bytes.
  __device__ __forceinline__ bool vectors_aligned() const {
    return ((reinterpret_cast<uintptr_t>(idx) | reinterpret_cast<uintptr_t>(values)) & 15) == 0;
  }
  // Entries [e8, e8 + 8) (e8 a multiple of 8) with inputs and 16-bit value bits; outside [lo, hi)
  // the input reads INT_MAX. A vector inside [0, hi) is two or three 16-byte loads where `aligned`.
  __device__ __forceinline__ void load8(int32_t e8, int32_t lo, int32_t hi, bool aligned, int32_t (&input8)[8],
                                        uint16_t (&bits8)[8]) const {
    if (aligned && e8 + 8 <= hi) {
      uint32_t v[4], c[8 * sizeof(Index) / 4];
      load_words(values + e8, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) bits8[j] = uint16_t(packed_element<T>(v, j));
      load_words(idx + e8, c);
#pragma unroll
      for (int j = 0; j < 8; ++j) input8[j] = int32_t(packed_element<Index>(c, j));
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (e8 + j < lo) input8[j] = INT_MAX;
      return;
    }
    load8_entrywise(*this, e8, lo, hi, input8, bits8);
  }
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
  const int32_t* __restrict__ ptr;
  const int32_t* __restrict__ perm;
  const Index* __restrict__ idx;  // row_idx
  const T* __restrict__ values;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(idx[perm[e]]); }
  __device__ __forceinline__ T value(int32_t e) const { return values[perm[e]]; }
  __device__ __forceinline__ bool vectors_aligned() const { return (reinterpret_cast<uintptr_t>(perm) & 15) == 0; }
  // As CsrView::load8: a vector of csc_perm's positions, then the slots' rows and values gathered.
  __device__ __forceinline__ void load8(int32_t e8, int32_t lo, int32_t hi, bool aligned, int32_t (&input8)[8],
                                        uint16_t (&bits8)[8]) const {
    if (aligned && e8 + 8 <= hi) {
      uint32_t slot[8];
      load_words(perm + e8, slot);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool valid = e8 + j >= lo;
        input8[j] = valid ? int32_t(idx[int32_t(slot[j])]) : INT_MAX;
        bits8[j] = valid ? values[int32_t(slot[j])].bits : uint16_t(0);
      }
      return;
    }
    load8_entrywise(*this, e8, lo, hi, input8, bits8);
  }
  __device__ __forceinline__ void prefetch_l2(int64_t nnz) const {
    prefetch_l2_share(perm, nnz * int64_t(sizeof(int32_t)));
    prefetch_l2_share(values, nnz * int64_t(sizeof(T)));
    prefetch_l2_share(idx, nnz * int64_t(sizeof(Index)));
  }
};

}  // namespace snack::cuda::detail
