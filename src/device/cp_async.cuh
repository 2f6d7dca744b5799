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

// Rows [r0, r0 + kRows) x columns [c0, c0 + kCols) of a row-major [rows, cols] array of a 16-bit
// type into `smem` ([kRows][kStride]), zeros outside the array, by kThreads threads of which this is
// `thread` (the block's threads by default). vec: the array's rows are whole 16-byte vectors on
// 16-byte boundaries (cols % 8 == 0, an aligned base), copied by cp_async_16 (the caller commits the
// group); otherwise element by element.
template <int kRows, int kCols, int kStride, int kThreads, typename T>
__device__ __forceinline__ void stage_16bit_block(uint16_t* smem, const T* __restrict__ src, int64_t rows,
                                                  int64_t cols, int64_t r0, int64_t c0, bool vec,
                                                  int thread = int(threadIdx.x)) {
  static_assert(sizeof(T) == 2 && kCols % 8 == 0, "16-bit values, rows of whole 16-byte segments");
  if (vec) {
    for (int s = thread; s < kRows * (kCols / 8); s += kThreads) {
      const int row = s / (kCols / 8), seg = s % (kCols / 8);
      const int64_t r = r0 + row, c = c0 + seg * 8;
      const bool inside = r < rows && c < cols;
      cp_async_16(smem + row * kStride + seg * 8, inside ? src + r * cols + c : src, inside ? 16 : 0);
    }
  } else {
    const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
    for (int e = thread; e < kRows * kCols; e += kThreads) {
      const int row = e / kCols, col = e % kCols;
      const int64_t r = r0 + row, c = c0 + col;
      smem[row * kStride + col] = r < rows && c < cols ? raw[r * cols + c] : uint16_t(0);
    }
  }
}
// Byte offset of element (row, col) of a [rows][kCols] tile of 16-bit values whose 16-byte segments are
// swizzled by row, segment s of row r at s ^ (r % 8) within its group of eight: ldmatrix's eight rows
// of one segment lie in eight different bank groups, and at kCols = 64 it is wgmma's 128-byte swizzle.
template <int kCols>
__device__ __forceinline__ uint32_t swizzled_16bit(uint32_t row, uint32_t col) {
  static_assert(kCols % 64 == 0, "rows of whole groups of eight segments");
  if constexpr (kCols == 64) {
    return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
  } else {
    return row * (kCols * 2) + (((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7u)) << 4) + (col & 7) * 2;
  }
}

// Rows [r0, r0 + kRows) x columns [c0, c0 + kCols) of a row-major [rows, cols] array of a 16-bit type
// whose rows are whole 16-byte vectors on 16-byte boundaries into `smem` in the layout of
// swizzled_16bit, zeros outside the array, as cp_async_16 copies by kThreads threads of which this is
// `thread` (the caller commits the group).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void stage_16bit_rows_swizzled_vec(unsigned char* smem, const T* __restrict__ src,
                                                              int64_t rows, int64_t cols, int64_t r0, int64_t c0,
                                                              int thread) {
  static_assert(sizeof(T) == 2, "16-bit values");
  constexpr int kSegments = kCols / 8;
  for (int s = thread; s < kRows * kSegments; s += kThreads) {
    const int row = s / kSegments, seg = s % kSegments;
    const int64_t r = r0 + row, c = c0 + seg * 8;
    const bool inside = r < rows && c < cols;
    cp_async_16(smem + swizzled_16bit<kCols>(row, seg * 8), inside ? src + r * cols + c : src, inside ? 16 : 0);
  }
}

// Waits until at most kPending of this thread's newest cp.async groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

}  // namespace snack::cuda::detail
