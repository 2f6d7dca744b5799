// The reference SpMM kernels: a warp per output row (warp_row, the simple baseline) and the
// SNACK-style COO kernel with atomics (coo_atomic, opt-in: not deterministic), with the fill and
// activation passes the COO kernel needs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "../device/cuda_utils.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/pattern.h"

namespace snack::cuda::detail {

// atomicAdd of an accumulated value to a stored one (the 16-bit types through CUDA's own).
template <typename T>
__device__ __forceinline__ void atomic_add_value(T* p, accum_t<T> v) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(p), __float2bfloat16_rn(v));
  } else if constexpr (std::is_same_v<T, float16>) {
    atomicAdd(reinterpret_cast<__half*>(p), __float2half_rn(v));
  } else {
    atomicAdd(p, v);
  }
}

// Reference layout: one warp per output row, lanes split its entries, NT batch rows at a time read
// straight from the row-major input. Simple and general; the benchmarks keep it as a baseline.
template <typename T, typename View, int NT>
__global__ void __launch_bounds__(kSpmmWarps * 32)
    spmm_warp_row_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in, int64_t n,
                         const T* __restrict__ bias, T* __restrict__ out, Activation act) {
  using A = accum_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kSpmmWarps;
  for (int64_t o = int64_t(blockIdx.x) * kSpmmWarps + (threadIdx.x >> 5); o < out_dim; o += warps) {
    const int32_t begin = view.ptr[o], end = view.ptr[o + 1];
    const A b = bias ? to_accum(bias[o]) : A(0);
    for (int64_t n0 = 0; n0 < n; n0 += NT) {
      A acc[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[j] = A(0);
      for (int32_t e = begin + lane; e < end; e += 32) {
        const A v = to_accum(view.value(e));
        const int64_t c = view.input(e);
#pragma unroll
        for (int j = 0; j < NT; ++j)
          if (n0 + j < n) acc[j] += v * to_accum(in[(n0 + j) * in_dim + c]);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j] = warp_sum(acc[j]);
        if (lane == j && n0 + j < n) out[(n0 + j) * out_dim + o] = from_accum<T>(apply_activation(acc[j] + b, act));
      }
    }
  }
}

// out = act(out), elementwise: the epilogue of the atomic COO kernel, which cannot fuse it.
template <typename T>
__global__ void activation_kernel(T* __restrict__ out, int64_t count, Activation act) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += step)
    out[i] = from_accum<T>(apply_activation(to_accum(out[i]), act));
}

// out[n, o] = bias[o] (or 0): the starting value of the atomic COO kernel.
template <typename T>
__global__ void fill_rows_kernel(T* __restrict__ out, const T* __restrict__ bias, int64_t n, int64_t out_dim) {
  const int64_t total = n * out_dim, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step)
    out[i] = bias ? bias[i % out_dim] : T{};
}

// SNACK-style COO SpMM: blockIdx.y is the batch row, so the batch rows spread over the SMs; the
// slots are split evenly (no load imbalance from long rows). Each thread sums kCooItems
// consecutive slots and flushes one atomicAdd per row it touched, so contention does not grow
// with N. Float atomics make the result order-dependent: opt-in only.
template <typename T, typename Index>
__global__ void __launch_bounds__(256)
    spmm_coo_atomic_kernel(SlotPattern<Index> w, const T* __restrict__ values, const T* __restrict__ x,
                           int64_t batch_offset, T* __restrict__ y) {
  using A = accum_t<T>;
  const int64_t nb = batch_offset + blockIdx.y;
  const T* xrow = x + nb * w.cols;
  T* yrow = y + nb * w.rows;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kCooItems;
  if (first >= w.nnz) return;
  const int64_t last = first + kCooItems < w.nnz ? first + kCooItems : w.nnz;
  int64_t row = w.row_idx[first];
  A acc = 0;
  for (int64_t s = first; s < last; ++s) {
    const int64_t r = w.row_idx[s];
    if (r != row) {
      atomic_add_value(yrow + row, acc);
      acc = 0;
      row = r;
    }
    acc += to_accum(values[s]) * to_accum(xrow[w.col_idx[s]]);
  }
  atomic_add_value(yrow + row, acc);
}

}  // namespace snack::cuda::detail
