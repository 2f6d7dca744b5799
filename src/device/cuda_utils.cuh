// Small CUDA helpers shared by the kernels: error checks, read-only loads, L2 prefetches,
// programmatic dependent launch, warp reductions, grid sizes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "../common/grid.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack::cuda::detail {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                            cudaGetErrorString(err) + ")");
}

// Reports a failed launch (bad configuration, missing kernel image) right after it was enqueued.
inline Status check_launch(const char* kernel_name) { return cuda_status(cudaGetLastError(), kernel_name); }

// Whether a row-major matrix of 16-bit values at `base` with `cols` columns is rows of whole 16-byte
// vectors from a 16-byte aligned start: the kernels that stage such rows copy them 16 bytes at a time.
inline bool rows_of_16byte_vectors(const void* base, int64_t cols) {
  return cols % 8 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

#define SNACK_CUDA_RETURN_IF_ERROR(call) SNACK_RETURN_IF_ERROR(::snack::cuda::detail::cuda_status((call), #call))

// Accumulation type and conversions (snack/value_types.h): fp32 for fp32 and the 16-bit types,
// fp64 for fp64.
using ::snack::accum_t;
using ::snack::from_accum;
using ::snack::to_accum;

// A read-only load through the non-coherent path; the 16-bit types as their raw bits.
template <typename T>
__device__ __forceinline__ T load_ro(const T* p) {
  if constexpr (kIsHalfType<T>) {
    return T{__ldg(reinterpret_cast<const unsigned short*>(p))};
  } else {
    return __ldg(p);
  }
}

// Asks L2 to fetch the 16-byte-aligned part of bytes [begin, end) of a global array, without
// waiting for it (Hopper's bulk prefetch; nothing on older GPUs).
__device__ __forceinline__ void prefetch_l2(const void* base, int64_t begin, int64_t end) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint64_t lo = (reinterpret_cast<uint64_t>(base) + uint64_t(begin) + 15) & ~uint64_t(15);
  const uint64_t hi = (reinterpret_cast<uint64_t>(base) + uint64_t(end)) & ~uint64_t(15);
  if (hi > lo)
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; cp.async.bulk.prefetch.L2.global [g], %1; }" ::"l"(lo),
                 "r"(uint32_t(hi - lo))
                 : "memory");
#endif
}

// This block's share of an array of `bytes` bytes, prefetched to L2 (blocks numbered over the grid's x and y).
__device__ __forceinline__ void prefetch_l2_share(const void* base, int64_t bytes) {
  const int64_t blocks = int64_t(gridDim.x) * gridDim.y;
  const int64_t block = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t chunk = (bytes + blocks - 1) / blocks;
  const int64_t begin = block * chunk;
  prefetch_l2(base, begin, begin + chunk < bytes ? begin + chunk : bytes);
}

// Barrier `id` (1-15; 0 is __syncthreads') of `threads` threads, whole warps: part of a block
// synchronises without the rest.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Programmatic dependent launch (Hopper): a kernel launched with programmatic stream
// serialization may start while the kernel before it still runs; it waits here before it reads
// that kernel's output. A no-op when the launch was an ordinary one.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the kernel launched after this one (with programmatic serialization) start early.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Launches `kernel` with one launch attribute, or none where `attribute` is null.
template <typename... Params, typename... Args>
cudaError_t launch_with_attribute(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  const cudaLaunchAttribute* attribute, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = const_cast<cudaLaunchAttribute*>(attribute);
  config.numAttrs = attribute != nullptr ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization:
// it may start before the kernel ahead of it in the stream has finished, and must call
// wait_for_prior_grid() before it reads that kernel's output. In a build with an architecture
// below sm_90 (SNACK_NO_PROGRAMMATIC_LAUNCH, set by CMake) that wait may compile to nothing, so
// the launch is an ordinary one.
template <typename... Params, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                Args&&... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
#if defined(SNACK_NO_PROGRAMMATIC_LAUNCH)
  const cudaLaunchAttribute* used = nullptr;
#else
  const cudaLaunchAttribute* used = &attribute;
#endif
  return launch_with_attribute(kernel, grid, block, smem, stream, used, std::forward<Args>(args)...);
}

// Launches `kernel` in thread-block clusters of `cluster_x` blocks along x (sm_90 and later; an
// ordinary launch where cluster_x is 1). The grid's x must be a multiple of cluster_x.
template <typename... Params, typename... Args>
cudaError_t launch_clusters_x(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                              unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_x;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return launch_with_attribute(kernel, grid, block, smem, stream, cluster_x > 1 ? &attribute : nullptr,
                               std::forward<Args>(args)...);
}

// Butterfly sum over the 32 lanes: every lane ends with the total, always in the same order.
template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

using ::snack::detail::ceil_div;
using ::snack::detail::kMaxGridY;
using ::snack::detail::grid_for;

}  // namespace snack::cuda::detail
