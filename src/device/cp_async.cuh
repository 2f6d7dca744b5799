// Asynchronous copies from global to shared memory (cp.async, sm_80 and later), shared by the kernels
// that stage operands in shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace snack::cuda::detail {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, of which the first src_bytes are read and the rest zero-filled.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(smem)), "l"(gmem),
               "r"(src_bytes));
}
// 4 bytes global -> shared (through L1), zero-filled where src_bytes is 0: single elements, so that a
// kernel can transpose while it stages.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_address(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most kPending of this thread's newest cp.async groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

}  // namespace snack::cuda::detail
