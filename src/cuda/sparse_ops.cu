// First CUDA implementations of the sparse ops: one warp per output row (forward), per input
// column (transposed) or per weight row (SDDMM). Lanes split the slots of a row, each keeps a small
// tile of NT batch rows in registers, and a butterfly reduction combines the lanes in a fixed order,
// so results are bitwise reproducible.
#include <cuda_runtime.h>

#include "../common/op_checks.h"
#include "cuda_utils.cuh"
#include "snack/ops.h"

namespace snack::cuda {
namespace {

using detail::accum_t;
using detail::check_launch;
using detail::from_accum;
using detail::grid_for;
using detail::to_accum;
using detail::warp_sum;

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

// Y[n, r] for every n of one tile of NT batch rows starting at n0.
template <typename T, typename Index, int NT>
__device__ __forceinline__ void forward_row_tile(const SlotPattern<Index>& w, const T* __restrict__ values,
                                                 const T* __restrict__ x, int64_t n, int64_t n0, int32_t begin,
                                                 int32_t end, int lane, accum_t<T> (&acc)[NT]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j] = 0;
  for (int32_t s = begin + lane; s < end; s += 32) {
    const accum_t<T> v = to_accum(values[s]);
    const int64_t c = w.col_idx[s];
#pragma unroll
    for (int j = 0; j < NT; ++j)
      if (n0 + j < n) acc[j] += v * to_accum(x[(n0 + j) * w.cols + c]);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j] = warp_sum(acc[j]);
}

template <typename T, typename Index, int NT>
__global__ void __launch_bounds__(kThreads) spmm_forward_warp_row_kernel(SlotPattern<Index> w,
                                                                         const T* __restrict__ values,
                                                                         const T* __restrict__ x, int64_t n,
                                                                         const T* __restrict__ bias,
                                                                         T* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < w.rows; r += warps) {
    const int32_t begin = w.row_ptr[r], end = w.row_ptr[r + 1];
    const accum_t<T> b = bias ? to_accum(bias[r]) : accum_t<T>(0);
    for (int64_t n0 = 0; n0 < n; n0 += NT) {
      accum_t<T> acc[NT];
      forward_row_tile<T, Index, NT>(w, values, x, n, n0, begin, end, lane, acc);
#pragma unroll
      for (int j = 0; j < NT; ++j)
        if (lane == j && n0 + j < n) y[(n0 + j) * w.rows + r] = from_accum<T>(acc[j] + b);
    }
  }
}

template <typename T, typename Index, int NT>
__global__ void __launch_bounds__(kThreads) spmm_transposed_warp_col_kernel(SlotPattern<Index> w,
                                                                            const T* __restrict__ values,
                                                                            const T* __restrict__ dy, int64_t n,
                                                                            T* __restrict__ dx) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t c = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); c < w.cols; c += warps) {
    const int32_t begin = w.col_ptr[c], end = w.col_ptr[c + 1];
    for (int64_t n0 = 0; n0 < n; n0 += NT) {
      accum_t<T> acc[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) acc[j] = 0;
      for (int32_t e = begin + lane; e < end; e += 32) {
        const int32_t s = w.csc_perm[e];
        const accum_t<T> v = to_accum(values[s]);
        const int64_t r = w.row_idx[s];
#pragma unroll
        for (int j = 0; j < NT; ++j)
          if (n0 + j < n) acc[j] += v * to_accum(dy[(n0 + j) * w.rows + r]);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j] = warp_sum(acc[j]);
        if (lane == j && n0 + j < n) dx[(n0 + j) * w.cols + c] = from_accum<T>(acc[j]);
      }
    }
  }
}

// One thread per slot; neighbouring threads share a row, so dY[n, r] is mostly a broadcast.
template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads) sddmm_thread_slot_kernel(SlotPattern<Index> w, const T* __restrict__ dy,
                                                                     const T* __restrict__ x, int64_t n,
                                                                     T* __restrict__ dvalues) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < w.nnz; s += stride) {
    const int64_t r = w.row_idx[s], c = w.col_idx[s];
    accum_t<T> acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += to_accum(dy[i * w.rows + r]) * to_accum(x[i * w.cols + c]);
    dvalues[s] = from_accum<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) bias_grad_kernel(const T* __restrict__ dy, int64_t n, int64_t m,
                                                             T* __restrict__ dbias) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < m; r += stride) {
    accum_t<T> acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += to_accum(dy[i * m + r]);
    dbias[r] = from_accum<T>(acc);
  }
}

}  // namespace

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Stream stream) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"x", required_if(n * w.cols > 0, x)}, {"y", required_if(n * w.rows > 0, y)}}));
  if (n == 0 || w.rows == 0) return Status::Ok();
  const unsigned grid = grid_for(w.rows, kWarpsPerBlock);
  if (n == 1)
    spmm_forward_warp_row_kernel<T, Index, 1><<<grid, kThreads, 0, stream>>>(w, values, x, n, bias, y);
  else if (n <= 4)
    spmm_forward_warp_row_kernel<T, Index, 4><<<grid, kThreads, 0, stream>>>(w, values, x, n, bias, y);
  else
    spmm_forward_warp_row_kernel<T, Index, 8><<<grid, kThreads, 0, stream>>>(w, values, x, n, bias, y);
  return check_launch("spmm_forward_warp_row_kernel");
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       Stream stream) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"dy", required_if(n * w.rows > 0, dy)}, {"dx", required_if(n * w.cols > 0, dx)}}));
  if (n == 0 || w.cols == 0) return Status::Ok();
  const unsigned grid = grid_for(w.cols, kWarpsPerBlock);
  if (n == 1)
    spmm_transposed_warp_col_kernel<T, Index, 1><<<grid, kThreads, 0, stream>>>(w, values, dy, n, dx);
  else if (n <= 4)
    spmm_transposed_warp_col_kernel<T, Index, 4><<<grid, kThreads, 0, stream>>>(w, values, dy, n, dx);
  else
    spmm_transposed_warp_col_kernel<T, Index, 8><<<grid, kThreads, 0, stream>>>(w, values, dy, n, dx);
  return check_launch("spmm_transposed_warp_col_kernel");
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, Stream stream) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, dvalues),
      {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  if (w.nnz == 0) return Status::Ok();
  sddmm_thread_slot_kernel<T, Index><<<grid_for(w.nnz, kThreads), kThreads, 0, stream>>>(w, dy, x, n, dvalues);
  return check_launch("sddmm_thread_slot_kernel");
}

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream) {
  if (n < 0 || m < 0) return InvalidArgument("bias_grad: sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && dbias == nullptr) return InvalidArgument("dbias must not be null");
  if (m == 0) return Status::Ok();
  bias_grad_kernel<T><<<grid_for(m, kThreads), kThreads, 0, stream>>>(dy, n, m, dbias);
  return check_launch("bias_grad_kernel");
}

#define SNACK_INSTANTIATE_CUDA_OPS(T, Index)                                                                     \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         Stream);                                                                \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream); \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);

SNACK_INSTANTIATE_CUDA_OPS(float, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(float, int32_t)
SNACK_INSTANTIATE_CUDA_OPS(double, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(double, int32_t)
template Status bias_grad<float>(const float*, int64_t, int64_t, float*, Stream);
template Status bias_grad<double>(const double*, int64_t, int64_t, double*, Stream);

}  // namespace snack::cuda
