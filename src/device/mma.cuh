// Tensor-core building blocks of the 16-bit kernels (mma.sync and ldmatrix, sm_80 and later), shared
// by the tensor-core SpMM, SDDMM and attention.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "snack/value_types.h"

namespace snack::cuda::detail {

// The m16n8k16 product of the 16-bit type T, accumulated in float.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to nearest-even T in one conversion instruction (lo in the low half). The same
// rounding as from_accum<T> but for NaN payloads (the instruction returns the canonical NaN).
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
  uint32_t packed;
  if constexpr (std::is_same_v<T, bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}

// Stores four 8x8 matrices of 16-bit values (sm_90 and later): lanes 8 i .. 8 i + 7 name the rows
// (16-byte aligned) of matrix i, and r[i] is the lane's pair of matrix i, row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1: the layout of an mma accumulator rounded to pairs.
__device__ __forceinline__ void stmatrix_x4(void* smem, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};"
               :
               : "r"(shared_address(smem)), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#else
  __trap();  // callers take another path below sm_90
#endif
}

// ldmatrix_x4 with each 8x8 matrix transposed: lane t receives elements [2 (t % 4)][t / 4] and
// [2 (t % 4) + 1][t / 4] of the matrix whose rows the lanes 8 i .. 8 i + 7 address. Operands stored
// with the reduction dimension along rows (dY and X as they lie in memory) become mma fragments.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(smem)));
}

}  // namespace snack::cuda::detail
