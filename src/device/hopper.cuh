// Hopper building blocks: mbarriers, the copy engine's bulk and tensor loads and the async-proxy fence
// (sm_90); for the wgmma kernels (sm_90a) wgmma's shared-memory descriptors in the 128-byte swizzle,
// the m64n256k16 product with both operands in shared memory and the m64n16-128k16 products with A in
// registers, fp32 accumulators.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cp_async.cuh"
#include "snack/value_types.h"

namespace snack::cuda::detail {

// ---- mbarriers and the copy engine ----

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count));
}
// Makes the barriers this thread initialised visible to the copy engine (before the block's barrier).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}
// Adds `bytes` to the transactions the current phase waits for (no arrival).
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` of the barrier has completed. suspend_ns > 0: each try
// may suspend the thread for up to that many nanoseconds until the phase completes, so that a warp
// that waits long (a producer ahead of its consumers) does not take issue slots polling; 0: the
// hardware's own limit per try.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, uint32_t suspend_ns = 0) {
  uint32_t done = 0;
  do {
    if (suspend_ns == 0)
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(shared_address(bar)), "r"(parity)
          : "memory");
    else
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done)
          : "r"(shared_address(bar)), "r"(parity), "r"(suspend_ns)
          : "memory");
  } while (!done);
}
// The box of the 2-D tensor map at (inner, outer) into shared memory; completes on `bar` as bytes.
__device__ __forceinline__ void tma_load_2d(void* smem, const CUtensorMap* map, int32_t inner, int32_t outer,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          shared_address(smem)),
      "l"(map), "r"(inner), "r"(outer), "r"(shared_address(bar))
      : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> this block's shared memory by
// the copy engine; completes on `bar` as bytes. One instruction however long the copy: a kernel that
// moves whole runs of words this way spends no issue slots per 16 bytes.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(smem)),
      "l"(gmem), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
// Arrives on `bar` and adds `bytes` to the transactions its current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
// Orders this thread's ordinary shared-memory stores before the tensor cores' reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- wgmma ----

// The descriptor of a K-major tile whose rows are 128 bytes, 8-row groups 1024 bytes apart, in the
// 128-byte swizzle (the tile 1024-byte aligned; moving along K moves the start address).
__device__ __forceinline__ uint64_t wg_descriptor(const void* smem) {
  const uint64_t address = shared_address(smem);
  return ((address & 0x3ffff) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// Byte offset of element (row, col) of a [rows][64] 16-bit tile in that layout.
__device__ __forceinline__ uint32_t wg_swizzled(uint32_t row, uint32_t col) { return swizzled_16bit<64>(row, col); }

// Rows [r0, r0 + kRows) x columns [c0, c0 + 64) of a row-major [rows, cols] array of a 16-bit type
// into `smem` ([kRows][64] in the 128-byte swizzle of wg_swizzled), zeros outside the array, element
// by element (any alignment) by `threads` threads of which this is `thread`: the copy engine's layout
// where its tensor map cannot read the array.
template <int kRows, typename T>
__device__ __forceinline__ void copy_16bit_rows_swizzled(unsigned char* smem, const T* __restrict__ src, int64_t rows,
                                                         int64_t cols, int64_t r0, int64_t c0, int thread,
                                                         int threads) {
  static_assert(sizeof(T) == 2, "16-bit values");
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  for (int e = thread; e < kRows * 64; e += threads) {
    const int row = e / 64, col = e % 64;
    const int64_t r = r0 + row, c = c0 + col;
    *reinterpret_cast<uint16_t*>(smem + wg_swizzled(row, col)) = r < rows && c < cols ? raw[r * cols + c] : 0;
  }
}

// The same block (smem 1024-byte aligned) by kThreads threads: vec, the array's rows are whole
// 16-byte vectors on 16-byte boundaries, copied by cp_async_16 (the caller commits the group);
// otherwise element by element. Either way the tensor cores read them only after fence_proxy_async.
template <int kRows, int kThreads, typename T>
__device__ __forceinline__ void stage_16bit_rows_swizzled(unsigned char* smem, const T* __restrict__ src,
                                                          int64_t rows, int64_t cols, int64_t r0, int64_t c0,
                                                          bool vec, int thread) {
  static_assert(sizeof(T) == 2, "16-bit values");
  if (vec) {
    stage_16bit_rows_swizzled_vec<kRows, 64, kThreads>(smem, src, rows, cols, r0, c0, thread);
  } else {
    copy_16bit_rows_swizzled<kRows>(smem, src, rows, cols, r0, c0, thread, kThreads);
  }
}

// Keeps the compiler from moving accesses of the accumulators across the asynchronous products.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// acc (64 x 256, the m64n256 accumulator layout) += A (64 x 16) B^T (256 x 16), both K-major in
// shared memory.
#define SNACK_WG_ACC8(i)                                                                                    \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define SNACK_WG_ACC32(i) SNACK_WG_ACC8(i), SNACK_WG_ACC8(i + 8), SNACK_WG_ACC8(i + 16), SNACK_WG_ACC8(i + 24)
#define SNACK_WG_MMA(types)                                                                                       \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n wgmma.mma_async.sync.aligned.m64n256k16.f32." types \
               " {" \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
               "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
               "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
               "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
               "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
               "}, %128, %129, p, 1, 1, 0, 0;\n}" \
               : SNACK_WG_ACC32(0), SNACK_WG_ACC32(32), SNACK_WG_ACC32(64), SNACK_WG_ACC32(96)                   \
               : "l"(a), "l"(b), "r"(1))
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    SNACK_WG_MMA("bf16.bf16");
  } else {
    SNACK_WG_MMA("f16.f16");
  }
}
#undef SNACK_WG_MMA

// acc (64 x N, the m64nN accumulator layout: a warp's 16 rows as mma.sync m16n8's, n-tile j in
// acc[4 j .. 4 j + 3]) += A (64 x 16) B^T (N x 16): A in registers, warp w of the warpgroup holding rows
// 16 w .. 16 w + 15 as mma.sync m16n8k16's A operand; B in shared memory, K-major, or with kMnMajorB
// N-major (B's 16 rows of N values each 128 bytes apart in the 128-byte swizzle: N = 64 at most, one
// swizzle atom wide, so that wg_descriptor's strides describe it).
#define SNACK_WG_RS16(types, tnsp)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"                                                        \
               " wgmma.mma_async.sync.aligned.m64n16k16.f32." types " {"                                             \
               "%0, %1, %2, %3, %4, %5, %6, %7"                                                                      \
               "}, {%8, %9, %10, %11}, %12, p, 1, 1, " tnsp ";\n}"                                                   \
               : SNACK_WG_ACC8(0)                                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define SNACK_WG_RS32(types, tnsp)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"                                                        \
               " wgmma.mma_async.sync.aligned.m64n32k16.f32." types " {"                                             \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"                                \
               "}, {%16, %17, %18, %19}, %20, p, 1, 1, " tnsp ";\n}"                                                 \
               : SNACK_WG_ACC8(0), SNACK_WG_ACC8(8)                                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define SNACK_WG_RS64(types, tnsp)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                                        \
               " wgmma.mma_async.sync.aligned.m64n64k16.f32." types " {"                                             \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                      \
               "}, {%32, %33, %34, %35}, %36, p, 1, 1, " tnsp ";\n}"                                                 \
               : SNACK_WG_ACC8(0), SNACK_WG_ACC8(8), SNACK_WG_ACC8(16), SNACK_WG_ACC8(24)                            \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define SNACK_WG_RS128(types, tnsp)                                                                                  \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                                        \
               " wgmma.mma_async.sync.aligned.m64n128k16.f32." types " {"                                            \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                              \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                    \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                    \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                      \
               "}, {%64, %65, %66, %67}, %68, p, 1, 1, " tnsp ";\n}"                                                 \
               : SNACK_WG_ACC8(0), SNACK_WG_ACC8(8), SNACK_WG_ACC8(16), SNACK_WG_ACC8(24),                           \
                 SNACK_WG_ACC8(32), SNACK_WG_ACC8(40), SNACK_WG_ACC8(48), SNACK_WG_ACC8(56)                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <typename T, int N, bool kMnMajorB = false>
__device__ __forceinline__ void wgmma_m64nk16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "m64n16, n32, n64 or n128");
  static_assert(!kMnMajorB || N <= 64, "an N-major B one swizzle atom wide");
  constexpr bool kBf16 = std::is_same_v<T, bfloat16>;
#define SNACK_WG_RS_TYPED(shape)                                          \
  if constexpr (kBf16 && kMnMajorB) shape("bf16.bf16", "1");              \
  else if constexpr (kBf16) shape("bf16.bf16", "0");                      \
  else if constexpr (kMnMajorB) shape("f16.f16", "1");                    \
  else shape("f16.f16", "0")
  if constexpr (N == 16) {
    SNACK_WG_RS_TYPED(SNACK_WG_RS16);
  } else if constexpr (N == 32) {
    SNACK_WG_RS_TYPED(SNACK_WG_RS32);
  } else if constexpr (N == 64) {
    SNACK_WG_RS_TYPED(SNACK_WG_RS64);
  } else {
    SNACK_WG_RS_TYPED(SNACK_WG_RS128);
  }
#undef SNACK_WG_RS_TYPED
}
#undef SNACK_WG_RS16
#undef SNACK_WG_RS32
#undef SNACK_WG_RS64
#undef SNACK_WG_RS128
#undef SNACK_WG_ACC32
#undef SNACK_WG_ACC8

}  // namespace snack::cuda::detail
