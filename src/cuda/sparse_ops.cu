// CUDA SDDMM (the weight gradient at the stored slots) and the bias gradient. The SpMM products
// live in spmm.cu. Each output is reduced by one thread in a fixed order: bitwise reproducible.
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
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);

SNACK_INSTANTIATE_CUDA_OPS(float, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(float, int32_t)
SNACK_INSTANTIATE_CUDA_OPS(double, uint16_t)
SNACK_INSTANTIATE_CUDA_OPS(double, int32_t)
template Status bias_grad<float>(const float*, int64_t, int64_t, float*, Stream);
template Status bias_grad<double>(const double*, int64_t, int64_t, double*, Stream);

}  // namespace snack::cuda
