// The SDDMM for large batches on CUDA cores, in float32: dY and X staged in shared memory and
// shared by a band of rows and a chunk of columns.
//
// The vector kernel reads both operands' vectors through L1 once per slot; at a batch of hundreds
// of rows that stream runs from L2, which bounds it at 3-4 useful TFLOP/s on the H200. Here a block
// owns the slots of W in a band of kStagedBand rows and a chunk of columns (a tile of W) and walks
// the batch in tiles of kStagedBatchTile samples: X[tile, chunk] and dY[tile, band] are copied into
// shared memory transposed, so that a row's or column's samples are contiguous, and read there by
// every slot of the tile that needs them: L2 sees each value of X once per band of rows and each
// value of dY once per chunk of columns. The copies are cp.async of 16-byte vectors of untransposed
// rows two tiles ahead, transposed on chip between two barriers, where the rows are whole aligned
// vectors and the chunk at most 128 columns; otherwise 4-byte elements written transposed,
// double-buffered (~6 L1 wavefronts per 128 bytes copied, measured with Nsight Compute).
//
// The tile's slots are listed once per block (the places of the slot's row and column in a stage),
// rows in order, and cut into 128 runs of at most kStagedSlotsPerGroup consecutive slots, one per group of 8
// lanes: every group has the same number of slots (+-1) whatever the rows' lengths, and a run
// mostly stays in one row, whose dY vectors are then read once. Each lane of a group takes 8 of the
// tile's 64 samples (two 16-byte vectors; the group's lanes read 128 contiguous bytes, conflict
// free) and keeps its run's sums in registers for the whole batch. A fixed butterfly adds the 8
// lanes at the end: every slot is summed in one order, whatever the launch (deterministic). With
// the batch split over blocks (grid.z) to fill the GPU, and with AdamW's update, the sums go to a
// float workspace and sddmm_sum_splits_kernel adds them in split order before the epilogue.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "shapes.h"
#include "snack/pattern.h"

namespace snack::cuda {
namespace {

using detail::kStagedBand;
using detail::kStagedBatchTile;
using detail::kStagedCapacity;
using detail::kStagedGroupLanes;
using detail::kStagedSlotsPerGroup;
using detail::kStagedStride;
using detail::kStagedThreads;
constexpr int kStagedBandLog2Of8 = 4;  // kStagedBand / 8 = 2^4
static_assert(kStagedBand == 8 << kStagedBandLog2Of8, "the band's copy maps 8 columns per warp");

// First slot in [begin, end) of a row whose column is at least `column` (a row's columns ascend).
template <typename Index>
__device__ __forceinline__ int32_t first_column_at_least(const Index* __restrict__ col_idx, int32_t begin, int32_t end,
                                                         int64_t column) {
  while (begin < end) {
    const int32_t mid = begin + (end - begin) / 2;
    if (int64_t(col_idx[mid]) < column) begin = mid + 1;
    else end = mid;
  }
  return begin;
}

// A copy of kStagedBatchTile rows from row0 and tile_cols columns from col0 of a row-major matrix
// src (`cols` values per row) into dst[column][row] (kStagedStride floats per column), zero past
// row_end and past the matrix's columns, as 4-byte cp.async elements. A warp covers 8 columns of 4
// rows at a time, so its reads are four 32-byte sectors and its shared-memory writes hit 32 banks
// ((4 column + row) mod 32); a thread keeps one column and steps down its rows, so that each
// element costs a copy and a few additions. log2_cols_8: log2 of the tile's columns / 8 (at most 5).
__device__ __forceinline__ void stage_transposed(float* __restrict__ dst, const float* __restrict__ src, int64_t cols,
                                                 int64_t row0, int64_t row_end, int64_t col0, int tile_cols,
                                                 int log2_cols_8) {
  const int t = int(threadIdx.x), group = t >> 5;
  const int c = ((group & ((1 << log2_cols_8) - 1)) << 3) | (t & 7);
  const int first = ((group >> log2_cols_8) << 2) | ((t >> 3) & 3);
  const int log2_step = 7 - log2_cols_8;  // rows between a thread's elements: 4 x 32 warps / (columns / 8)
  const int count = tile_cols * kStagedBatchTile / kStagedThreads;
  // The thread's elements inside the matrix: a prefix of its `count` (all or none past its columns).
  const int64_t rows_left = row_end - (row0 + first);
  int inside = rows_left <= 0 ? 0 : int(((rows_left - 1) >> log2_step) + 1);
  inside = col0 + c < cols ? (inside < count ? inside : count) : 0;
  // Past the matrix the copy reads nothing (zero fill): the pointer is passed, never dereferenced.
  const float* p = src + (row0 + first) * cols + col0 + c;
  const int64_t jump = cols << log2_step;
  float* d = dst + c * kStagedStride + first;
#pragma unroll 4
  for (int i = 0; i < count; ++i, p += jump, d += 1 << log2_step) detail::cp_async_4(d, p, i < inside ? 4 : 0);
}

// 16-byte copies of kStagedBatchTile rows from row0 and tile_cols columns from col0 of a row-major
// matrix src (`cols` values per row, a multiple of 4, 16-byte aligned) into raw[row][column] (tile_cols
// + 4 floats per row), zero past row_end and past the matrix's columns: consecutive threads take
// consecutive vectors of a row. log2_vectors: log2 of tile_cols / 4.
__device__ __forceinline__ void stage_rows(float* __restrict__ raw, const float* __restrict__ src, int64_t cols,
                                           int64_t row0, int64_t row_end, int64_t col0, int tile_cols,
                                           int log2_vectors) {
  const int elements = kStagedBatchTile << log2_vectors;
  for (int e = int(threadIdx.x); e < elements; e += kStagedThreads) {
    const int r = e >> log2_vectors, v = e & ((1 << log2_vectors) - 1);
    const int64_t gr = row0 + r, gc = col0 + 4 * v;
    const bool inside = gr < row_end && gc < cols;
    detail::cp_async_16(raw + r * (tile_cols + 4) + 4 * v, inside ? src + gr * cols + gc : src, inside ? 16 : 0);
  }
}

// raw[row][column] (tile_cols + 4 floats per row) transposed into dst[column][row] (kStagedStride
// floats per column): a warp moves 4 columns of 32 rows, one 16-byte read per lane (rows 4 words
// apart modulo 32 banks: the 8 lanes of a phase hit 8 different bank quads) and four 4-byte writes
// of 32 consecutive rows (32 banks).
__device__ __forceinline__ void transpose_stage(float* __restrict__ dst, const float* __restrict__ raw,
                                                int tile_cols) {
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const int tasks = tile_cols / 4 * (kStagedBatchTile / 32);
  for (int t = warp; t < tasks; t += kStagedThreads / 32) {
    const int group = t / (kStagedBatchTile / 32), r = (t % (kStagedBatchTile / 32)) * 32 + lane;
    const float4 v = *reinterpret_cast<const float4*>(raw + r * (tile_cols + 4) + 4 * group);
    float* d = dst + 4 * group * kStagedStride + r;
    d[0] = v.x;
    d[kStagedStride] = v.y;
    d[2 * kStagedStride] = v.z;
    d[3 * kStagedStride] = v.w;
  }
}

// A slot's word in the block's list: the row's and the column's places in a stage, in 16-byte units
// (kStagedVectorsPerRow to a staged row), so that the products address shared memory with a shift.
constexpr int kStagedVectorsPerRow = kStagedStride / 4;
static_assert(kStagedVectorsPerRow * detail::kStagedMaxChunk < 65536 && kStagedVectorsPerRow * kStagedBand < 65536,
              "a place fits 16 bits");
__device__ __forceinline__ uint32_t slot_word(int row, int col) {
  return (uint32_t(row * kStagedVectorsPerRow) << 16) | uint32_t(col * kStagedVectorsPerRow);
}

// dv[s] for the slots of W in the band blockIdx.y x the chunk blockIdx.x (chunk_cols columns, a power
// of two from 16 to 256), over the samples [blockIdx.z * split, +split) of the batch. With `partial`
// (SddmmPlan::staged_sums_in_workspace), the sums go to partial[blockIdx.z * nnz + s] for
// sddmm_sum_splits_kernel; without it, to the epilogue.
template <typename Index, typename Out>
__global__ void __launch_bounds__(kStagedThreads, 1)
    sddmm_staged_kernel(SlotPattern<Index> w, const float* __restrict__ dy, const float* __restrict__ x, int64_t n,
                        int chunk_cols, int log2_chunk_8, int64_t split, bool vector_copies,
                        float* __restrict__ partial, Out out) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Stages: with 4-byte copies two of X [chunk][stride] and dY [band][stride], written transposed by
  // the copies; with 16-byte copies one of each, written by a transposing pass from two stages of
  // untransposed rows ([tile][chunk + 4] and [tile][band + 4]). detail::staged_stage_floats.
  float* const x_stages = reinterpret_cast<float*>(smem);
  float* const dy_stages = x_stages + (vector_copies ? 1 : 2) * chunk_cols * kStagedStride;
  float* const x_rows = dy_stages + (vector_copies ? 1 : 2) * kStagedBand * kStagedStride;
  float* const dy_rows = x_rows + 2 * kStagedBatchTile * (chunk_cols + 4);
  uint32_t* const slot_words =
      reinterpret_cast<uint32_t*>(x_stages + detail::staged_stage_floats(chunk_cols, vector_copies));
  // Each row's first slot in the chunk, and its place in the block's list ([kStagedBand]: the total).
  int32_t* const row_lo = reinterpret_cast<int32_t*>(slot_words + kStagedCapacity + kStagedSlotsPerGroup);
  int32_t* const row_first = row_lo + kStagedBand;
  int32_t* const warp_totals = row_first + kStagedBand + 1;  // the scan's sum of each warp's rows

  const int tid = int(threadIdx.x);
  const int64_t col0 = int64_t(blockIdx.x) * chunk_cols;
  const int64_t row0 = int64_t(blockIdx.y) * kStagedBand;
  const int64_t sample0 = int64_t(blockIdx.z) * split;
  const int64_t sample_end = sample0 + split < n ? sample0 + split : n;
  const int tiles = int((sample_end - sample0 + kStagedBatchTile - 1) / kStagedBatchTile);
  if (partial == nullptr) out.begin();

  // Each row's slots in the chunk, and their place in the block's list (a scan over the band).
  int32_t inclusive = 0;
  if (tid < kStagedBand) {
    const int64_t r = row0 + tid;
    int32_t lo = 0, hi = 0;
    if (r < w.rows) {
      const int32_t begin = w.row_ptr[r], end = w.row_ptr[r + 1];
      lo = first_column_at_least(w.col_idx, begin, end, col0);
      hi = first_column_at_least(w.col_idx, lo, end, col0 + chunk_cols);
    }
    row_lo[tid] = lo;
    inclusive = hi - lo;
    const int lane = tid & 31;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == 31) warp_totals[tid >> 5] = inclusive;
  }
  __syncthreads();
  if (tid < kStagedBand) {
    for (int warp = 0; warp < (tid >> 5); ++warp) inclusive += warp_totals[warp];
    row_first[tid + 1] = inclusive;
    if (tid == 0) row_first[0] = 0;
  }
  __syncthreads();
  const int32_t total = row_first[kStagedBand];

  const int group = tid / kStagedGroupLanes, g = tid % kStagedGroupLanes;
  for (int32_t base = 0; base < total; base += kStagedCapacity) {
    const int32_t count = total - base < kStagedCapacity ? total - base : kStagedCapacity;
    {  // this pass's list: 8 threads per row write the row's slots that fall into it
      const int row = tid / kStagedGroupLanes;
      const int32_t first = row_first[row], len = row_first[row + 1] - first, lo = row_lo[row];
      const int32_t i_begin = base > first ? base - first : 0;
      const int32_t i_end = base + count - first < len ? base + count - first : len;
      for (int32_t i = i_begin + g; i < i_end; i += kStagedGroupLanes)
        slot_words[first + i - base] = slot_word(row, int(int64_t(w.col_idx[lo + i]) - col0));
    }
    // Words past the list: a warp runs its longest group's count, the others read a valid place.
    if (tid < kStagedSlotsPerGroup) slot_words[count + tid] = 0;
    __syncthreads();
    const int32_t start = int32_t(int64_t(group) * count / detail::kStagedGroups);
    const int run = int(int64_t(group + 1) * count / detail::kStagedGroups) - start;
    const int warp_run = __reduce_max_sync(0xffffffffu, unsigned(run));

    float acc[kStagedSlotsPerGroup];
#pragma unroll
    for (int i = 0; i < kStagedSlotsPerGroup; ++i) acc[i] = 0.0f;

    // The products of one staged tile: each group's run of slots against its lanes' 8 samples.
    auto products = [&](const float* x_stage, const float* dy_stage) {
      const char* xs = reinterpret_cast<const char*>(x_stage + 4 * g);
      const char* ds = reinterpret_cast<const char*>(dy_stage + 4 * g);
      uint32_t current = ~0u;
      float4 d0 = make_float4(0.f, 0.f, 0.f, 0.f), d1 = d0;
#pragma unroll
      for (int i = 0; i < kStagedSlotsPerGroup; ++i) {
        if (i >= warp_run) break;  // warp-uniform; a group past its run adds into sums it never hands on
        const uint32_t word = slot_words[start + i];
        const uint32_t row_at = (word >> 16) << 4, col_at = (word & 0xffffu) << 4;
        if (row_at != current) {
          d0 = *reinterpret_cast<const float4*>(ds + row_at);
          d1 = *reinterpret_cast<const float4*>(ds + row_at + 128);
          current = row_at;
        }
        const float4 x0 = *reinterpret_cast<const float4*>(xs + col_at);
        const float4 x1 = *reinterpret_cast<const float4*>(xs + col_at + 128);
        float a = acc[i];
        a = __fmaf_rn(d0.x, x0.x, a);
        a = __fmaf_rn(d0.y, x0.y, a);
        a = __fmaf_rn(d0.z, x0.z, a);
        a = __fmaf_rn(d0.w, x0.w, a);
        a = __fmaf_rn(d1.x, x1.x, a);
        a = __fmaf_rn(d1.y, x1.y, a);
        a = __fmaf_rn(d1.z, x1.z, a);
        a = __fmaf_rn(d1.w, x1.w, a);
        acc[i] = a;
      }
    };
    if (vector_copies) {
      // Untransposed rows two tiles ahead; each tile transposed into the one stage between two barriers.
      auto stage = [&](int tile) {
        if (tile < tiles) {
          const int64_t s0 = sample0 + int64_t(tile) * kStagedBatchTile;
          stage_rows(x_rows + (tile & 1) * kStagedBatchTile * (chunk_cols + 4), x, w.cols, s0, sample_end, col0,
                     chunk_cols, log2_chunk_8 + 1);
          stage_rows(dy_rows + (tile & 1) * kStagedBatchTile * (kStagedBand + 4), dy, w.rows, s0, sample_end, row0,
                     kStagedBand, kStagedBandLog2Of8 + 1);
        }
        detail::cp_async_commit();  // every tile a group, empty past the last: the waits count tiles
      };
      stage(0);
      stage(1);
      for (int t = 0; t < tiles; ++t) {
        detail::cp_async_wait<1>();
        __syncthreads();  // tile t's rows are in, and every thread is done with the stage's tile t - 1
        transpose_stage(x_stages, x_rows + (t & 1) * kStagedBatchTile * (chunk_cols + 4), chunk_cols);
        transpose_stage(dy_stages, dy_rows + (t & 1) * kStagedBatchTile * (kStagedBand + 4), kStagedBand);
        __syncthreads();  // the stage is written, and tile t's rows are free for tile t + 2
        stage(t + 2);
        products(x_stages, dy_stages);
      }
      detail::cp_async_wait_all();
    } else {
      auto stage = [&](int tile, int buffer) {
        const int64_t s0 = sample0 + int64_t(tile) * kStagedBatchTile;
        stage_transposed(x_stages + buffer * chunk_cols * kStagedStride, x, w.cols, s0, sample_end, col0, chunk_cols,
                         log2_chunk_8);
        stage_transposed(dy_stages + buffer * kStagedBand * kStagedStride, dy, w.rows, s0, sample_end, row0,
                         kStagedBand, kStagedBandLog2Of8);
        detail::cp_async_commit();
      };
      if (tiles > 0) stage(0, 0);
      for (int t = 0; t < tiles; ++t) {
        detail::cp_async_wait_all();
        __syncthreads();  // tile t is in for every thread, and every thread is done with tile t - 1
        if (t + 1 < tiles) stage(t + 1, (t + 1) & 1);
        products(x_stages + (t & 1) * chunk_cols * kStagedStride, dy_stages + (t & 1) * kStagedBand * kStagedStride);
      }
    }
    // The group's 8 lanes added by a butterfly (each lane ends with the same bits), then lane i % 8
    // hands slot i to the epilogue or the split's workspace.
#pragma unroll
    for (int i = 0; i < kStagedSlotsPerGroup; ++i) {
      float v = acc[i];
#pragma unroll
      for (int offset = 1; offset < kStagedGroupLanes; offset <<= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (i < run && i % kStagedGroupLanes == g) {
        const int32_t f = start + i;
        const int row = int(slot_words[f] >> 16) / kStagedVectorsPerRow;
        const int64_t s = int64_t(row_lo[row]) + (base + f - row_first[row]);
        if (partial != nullptr) {
          partial[int64_t(blockIdx.z) * w.nnz + s] = v;
        } else {
          const auto fetched = out.fetch(s);
          out.apply(s, v, fetched);
        }
      }
    }
    __syncthreads();  // the next pass rewrites the list
  }
}

// The staged kernel's split sums added in split order, then handed to the epilogue.
template <typename Out>
__global__ void __launch_bounds__(256) sddmm_sum_splits_kernel(const float* __restrict__ partial, int splits,
                                                               int64_t nnz, Out out) {
  out.begin();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    const auto fetched = out.fetch(s);
    float v = partial[s];
    for (int k = 1; k < splits; ++k) v += partial[int64_t(k) * nnz + s];
    out.apply(s, v, fetched);
  }
}

}  // namespace
}  // namespace snack::cuda
