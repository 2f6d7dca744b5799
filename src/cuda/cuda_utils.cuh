// Small CUDA helpers shared by the kernels: error checks, accumulator types, warp reductions.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "snack/status.h"

namespace snack::cuda::detail {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                            cudaGetErrorString(err) + ")");
}

// Reports a failed launch (bad configuration, missing kernel image) right after it was enqueued.
inline Status check_launch(const char* kernel_name) { return cuda_status(cudaGetLastError(), kernel_name); }

#define SNACK_CUDA_RETURN_IF_ERROR(call) SNACK_RETURN_IF_ERROR(::snack::cuda::detail::cuda_status((call), #call))

// Accumulation type: fp32 for every 16/32-bit value type, fp64 for fp64.
template <typename T>
struct Accum { using type = float; };
template <>
struct Accum<double> { using type = double; };
template <typename T>
using accum_t = typename Accum<T>::type;

template <typename T>
__device__ __forceinline__ accum_t<T> to_accum(T v) { return static_cast<accum_t<T>>(v); }
template <typename T>
__device__ __forceinline__ T from_accum(accum_t<T> v) { return static_cast<T>(v); }

// Butterfly sum over the 32 lanes: every lane ends with the total, always in the same order.
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

struct DeviceLimits {
  int sms = 0;
  size_t smem_per_block = 0;  // opt-in maximum of dynamic shared memory per block, bytes
  size_t smem_per_sm = 0;     // bytes
};

// The current device's limits, queried once per device (cudaDeviceGetAttribute does not synchronise).
Status device_limits(DeviceLimits* out);

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid sizes are capped so that a grid-stride loop covers the rest (grid.x <= 2^31-1 anyway).
inline unsigned grid_for(int64_t work_items, int items_per_block, int64_t cap = 1 << 20) {
  int64_t blocks = ceil_div(work_items, items_per_block);
  if (blocks < 1) blocks = 1;
  if (blocks > cap) blocks = cap;
  return static_cast<unsigned>(blocks);
}

}  // namespace snack::cuda::detail
