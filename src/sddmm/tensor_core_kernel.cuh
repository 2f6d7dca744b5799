// The tensor-core SDDMM for 16-bit operands (bf16, fp16; fp32 accumulation): the weight gradient
// computed as dense tiles of dY^T X on mma.sync, of which only the stored slots are read out.
//
// Where it pays: a row-wise SDDMM gathers X's column for every slot (nnz * N values through L1),
// while a dense tile of 128 x 128 gradients costs 128 x 128 x N / 4096 tensor-core instructions
// from operands staged once per tile; from a batch of about 64 at densities from 5-10% (past 128
// from 3%) the tile is cheaper than its slots' gathers, and what remains is the tile's fixed work
// and the slots' own traffic (their columns read, their gradients written): plan.cpp has the rule.
//
// A block owns a band of kTcDwRows rows of W and a run of tiles of kTcDwCols columns (shapes.h).
// For each tile it streams the batch through shared memory in chunks (cp.async, three stages: the
// next two chunks, of this tile or the next, load while one multiplies), multiplies, rounds the
// tile to T into shared memory and reads the slots out of it: lanes r and r + 16 of warp w share row
// 16 w + r, keep a cursor into its slots (sorted by column) and walk them eight at a time until one
// falls past the tile; each lane loads the first vector of its next tile as it finishes one, and
// the block asks L2 for its rows' slots when it starts; a vector of 8 slots that lies whole in the
// tile goes out at once as one 16-byte store of its gradients. AdamW's step runs after the kernel,
// over the gradient stored in the workspace (sddmm_adamw_from_gradient_kernel below): inside the
// read-out, its loads and stores of the state cost more than a pass of its own. The gradient is
// stored in T, as AdamWUpdate rounds it to T first anyway, so the staged tile loses nothing.
// Every gradient is one fixed chain of mma.sync products: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "../device/row_cursors.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/pattern.h"

namespace snack::cuda {
namespace {

// What seek_cursors reads: the columns of W's rows.
template <typename Index>
struct ColumnsOfRows {
  const Index* __restrict__ idx;
  __device__ __forceinline__ int32_t input(int32_t e) const { return int32_t(__ldg(idx + e)); }
};

// Rows [first, first + kTcDwBatchChunk) of a [n, dim] operand, columns [c0, c0 + kTcDwRows), into
// `stage` ([kTcDwBatchChunk][kTcDwOperandStride]), zeros outside the operand (stage_16bit_block;
// vec: 16-byte rows, and the caller commits the group).
template <typename T>
__device__ __forceinline__ void stage_operand_chunk(uint16_t* stage, const T* __restrict__ op, int64_t n,
                                                    int64_t dim, int64_t first, int64_t c0, bool vec) {
  using namespace detail;
  stage_16bit_block<kTcDwBatchChunk, kTcDwRows, kTcDwOperandStride, kTcDwThreads>(stage, op, n, dim, first, c0, vec);
}

// acc (the warp's 32 rows x 64 columns: 2 x 8 m16n8 tiles) += dY's chunk^T x X's chunk, both staged
// with the batch along rows, so both operands reach their fragments through ldmatrix.trans.
template <typename T>
__device__ __forceinline__ void multiply_dw_chunk(float (&acc)[2][8][4], const uint16_t* dy_chunk,
                                                  const uint16_t* x_chunk, int row0, int col0) {
  using namespace detail;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < kTcDwBatchChunk / 16; ++ks) {
    // A (rows of W x batch): matrices (rows 0-7 | 8-15) x (batch 0-7 | 8-15), lanes 8 i.. address matrix i.
    uint32_t a[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      ldmatrix_x4_trans(a[mt], dy_chunk + (ks * 16 + (lane / 16) * 8 + lane % 8) * kTcDwOperandStride + row0 +
                                   mt * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      // B (batch x columns of W): matrices (batch 0-7, 8-15) of columns 0-7, then of columns 8-15.
      uint32_t b[4];
      ldmatrix_x4_trans(b, x_chunk + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kTcDwOperandStride + col0 +
                               p * 16 + (lane / 16) * 8);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma_16816<T>(acc[mt][2 * p], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * p + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// The warp's accumulators rounded to T into the staged tile ([kTcDwRows][kTcDwTileStride]), then cleared.
template <typename T>
__device__ __forceinline__ void stage_dw_tile(float (&acc)[2][8][4], uint16_t* tile, int row0, int col0) {
  using namespace detail;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int r = row0 + mt * 16 + lane / 4, c = col0 + nt * 8 + (lane % 4) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint32_t*>(tile + (r + 8 * h) * kTcDwTileStride + c) =
            round_pair<T>(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
        acc[mt][nt][2 * h] = acc[mt][nt][2 * h + 1] = 0.f;
      }
    }
}

// The columns of 8 consecutive slots as loaded (packed as load_words leaves them), so that a lane can
// load the vector it will read next one tile ahead and keep it in a few registers meanwhile.
template <typename Index>
struct ColumnVector {
  uint32_t words[8 * sizeof(Index) / 4];
};

// Slots [e8, e8 + 8) of a row whose slots end at hi: one or two 16-byte loads where the vector is
// whole and `aligned`, else element by element (zeros past hi).
template <typename Index>
__device__ __forceinline__ ColumnVector<Index> load_column_vector(const Index* __restrict__ idx, int32_t e8,
                                                                  int32_t hi, bool aligned) {
  using namespace detail;
  ColumnVector<Index> v;
  if (aligned && e8 + 8 <= hi) {
    load_words(idx + e8, v.words);
    return v;
  }
#pragma unroll
  for (int i = 0; i < int(sizeof(v.words) / 4); ++i) v.words[i] = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (e8 + j < hi) packed_insert<Index>(v.words, j, uint32_t(__ldg(idx + e8 + j)));
  return v;
}

// Hands the slots of the lane's row with columns in [c0, c0 + kTcDwCols) to `out`, their gradients
// read from the staged row `tile_row`; lanes r and r + 16 take every other vector of 8 slots from
// the row's cursor, then both advance it past what the pair took. `next` holds the lane's first
// vector (loaded at the end of the previous tile) and, on return, the one of the next tile.
// vector_stores (Out::stores_vectors()): a vector of 8 slots all in the tile goes to the epilogue
// at once (Out::apply8_rounded).
template <typename T, typename Index, typename Out>
__device__ __forceinline__ void read_out_row(const Index* __restrict__ col_idx, bool aligned, bool vector_stores,
                                             const uint16_t* tile_row, int32_t& cursor, int32_t end, int32_t c0,
                                             ColumnVector<Index>& next, const Out& out) {
  using namespace detail;
  const int lane = threadIdx.x % 32;
  const int32_t c_end = c0 + kTcDwCols;
  int32_t taken = 0;
  ColumnVector<Index> v = next;
  for (int32_t e8 = (cursor & ~7) + 8 * (lane / 16); e8 < end; e8 += 16) {
    int32_t col[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      col[j] = e8 + j >= cursor && e8 + j < end ? int32_t(packed_element<Index>(v.words, j)) : INT_MAX;
    if (vector_stores && e8 >= cursor && e8 + 8 <= end && col[7] < c_end) {
      uint32_t pairs[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        pairs[j] = uint32_t(tile_row[col[2 * j] - c0]) | (uint32_t(tile_row[col[2 * j + 1] - c0]) << 16);
      out.apply8_rounded(e8, make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]));
      taken += 8;
    } else {
      typename Out::Fetched fetched[8];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (col[j] < c_end) fetched[j] = out.fetch(e8 + j);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (col[j] < c_end) {
          out.apply_rounded(e8 + j, T{tile_row[col[j] - c0]}, fetched[j]);
          ++taken;
        }
    }
    if (e8 + 8 >= end || col[7] >= c_end) break;
    if (e8 + 16 < end) v = load_column_vector(col_idx, e8 + 16, end, aligned);
  }
  cursor += taken + __shfl_xor_sync(0xffffffffu, taken, 16);
  const int32_t e8 = (cursor & ~7) + 8 * (lane / 16);
  if (e8 < end) next = load_column_vector(col_idx, e8, end, aligned);
}

// dv[s] = sum_n dY[n, row(s)] X[n, col(s)] for the slots of band blockIdx.y (kTcDwRows rows of W)
// in tiles [blockIdx.x * tiles_per_block, ...) of kTcDwCols columns, handed to `out`. n > 0 (an
// empty batch's zero gradients come from the slot kernel). vec_dy / vec_x: the operand's rows are
// 16-byte vectors (stage_operand_chunk).
template <typename T, typename Index, typename Out>
__global__ void __launch_bounds__(detail::kTcDwThreads, detail::kTcDwBlocksPerSm)
    sddmm_tensor_core_kernel(SlotPattern<Index> w, const T* __restrict__ dy, const T* __restrict__ x, int64_t n,
                             int tiles_per_block, bool vec_dy, bool vec_x, Out out) {
  using namespace detail;
  static_assert(!Out::kUpdatesState, "AdamW's step runs after the kernel (sddmm_adamw_from_gradient_kernel)");
  constexpr int kStage = 2 * kTcDwBatchChunk * kTcDwOperandStride;  // dY's chunk, then X's
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* stages = reinterpret_cast<uint16_t*>(smem);  // [kTcDwStages][kStage]
  uint16_t* tile = stages + kTcDwStages * kStage;         // [kTcDwRows][kTcDwTileStride]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = int64_t(blockIdx.y) * kTcDwRows;
  const int64_t tiles = (w.cols + kTcDwCols - 1) / kTcDwCols;
  const int64_t t_begin = int64_t(blockIdx.x) * tiles_per_block;
  const int64_t t_end = t_begin + tiles_per_block < tiles ? t_begin + tiles_per_block : tiles;
  const int chunks = int((n + kTcDwBatchChunk - 1) / kTcDwBatchChunk);

  // The next chunk to stage, as (tile, chunk) counters and its stage (no divisions in the loop).
  int64_t load_tile = t_begin;
  int load_chunk = 0, load_stage = 0;
  const auto stage_next = [&] {
    if (load_tile < t_end) {
      uint16_t* into = stages + load_stage * kStage;
      const int64_t first = int64_t(load_chunk) * kTcDwBatchChunk;
      stage_operand_chunk(into, dy, n, w.rows, first, r0, vec_dy);
      stage_operand_chunk(into + kTcDwBatchChunk * kTcDwOperandStride, x, n, w.cols, first, load_tile * kTcDwCols,
                          vec_x);
      if (++load_chunk == chunks) {
        load_chunk = 0;
        ++load_tile;
      }
      load_stage = load_stage + 1 == kTcDwStages ? 0 : load_stage + 1;
    }
    cp_async_commit();
  };
  // The first chunks load while the cursors are found.
#pragma unroll
  for (int s = 0; s < kTcDwStages - 1; ++s) stage_next();
  out.begin();

  // Cursors of the warp's 16 rows: lane r < 16 the row's next slot, lane 16 + r its end (for the
  // seek), then both lanes of a row hold both.
  const int64_t my_row = r0 + warp * 16 + lane % 16;
  int32_t cursor_or_end = 0;
  if (my_row < w.rows) cursor_or_end = w.row_ptr[my_row + (lane < 16 ? 0 : 1)];
  if (t_begin > 0 && t_begin < t_end)
    cursor_or_end = seek_cursors(ColumnsOfRows<Index>{w.col_idx}, cursor_or_end, t_begin * kTcDwCols);
  int32_t cursor = __shfl_sync(0xffffffffu, cursor_or_end, lane % 16);
  const int32_t end = __shfl_sync(0xffffffffu, cursor_or_end, 16 + lane % 16);
  const bool aligned = (reinterpret_cast<uintptr_t>(w.col_idx) & 15) == 0;
  const bool vector_stores = out.stores_vectors();
  // The run's slots of each row (estimated from its share of the row's remaining tiles), and what
  // the epilogue reads of them, requested into L2 now: the reads of each tile then wait on L2, not DRAM.
  if (lane < 16 && cursor < end) {
    const int64_t left = end - cursor;
    const int64_t run = t_end == tiles ? left
                                       : left * (t_end - t_begin) / (tiles - t_begin) + left / 4 + 16;
    const int64_t run_end = cursor + (run < left ? run : left);
    prefetch_l2(w.col_idx, int64_t(cursor) * int64_t(sizeof(Index)), run_end * int64_t(sizeof(Index)));
    out.prefetch_l2(cursor, run_end);
  }
  ColumnVector<Index> next{};
  const int32_t first8 = (cursor & ~7) + 8 * (lane / 16);
  if (first8 < end) next = load_column_vector(w.col_idx, first8, end, aligned);

  // The MMA warps: 4 along the band's rows, 2 along the tile's columns.
  const int row0 = (warp % 4) * 32, col0 = (warp / 4) * 64;
  float acc[2][8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  int stage = 0;
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int c = 0; c < chunks; ++c) {
      cp_async_wait<kTcDwStages - 2>();
      __syncthreads();  // this chunk is staged; every warp is done with the stage the next load reuses
      stage_next();
      const uint16_t* current = stages + stage * kStage;
      multiply_dw_chunk<T>(acc, current, current + kTcDwBatchChunk * kTcDwOperandStride, row0, col0);
      stage = stage + 1 == kTcDwStages ? 0 : stage + 1;
    }
    // The tile is complete: stage it, then each warp reads its rows' slots out of it. The next
    // tile's staging waits for the barrier at the top of the loop, which every warp passes only
    // when its reads are done.
    stage_dw_tile<T>(acc, tile, row0, col0);
    __syncthreads();
    read_out_row<T>(w.col_idx, aligned, vector_stores, tile + (warp * 16 + lane % 16) * kTcDwTileStride, cursor,
                    end, int32_t(t * kTcDwCols), next, out);
  }
  cp_async_wait_all();
}


// AdamW's step (`out`) over the gradient the tensor-core kernel stored, rounded to T, in the workspace
// (SddmmPlan::gradient_in_workspace): eight consecutive slots per thread, with apply8_rounded's
// 16-byte moves where the arrays allow, else slot by slot. The same arithmetic as the fused step.
template <typename T, typename Out>
__global__ void __launch_bounds__(256) sddmm_adamw_from_gradient_kernel(const T* __restrict__ gradient, int64_t nnz,
                                                                       Out out) {
  out.begin();
  const bool vectors = out.stores_vectors() && (reinterpret_cast<uintptr_t>(gradient) & 15) == 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x * 8;
  for (int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8; e < nnz; e += stride) {
    if (vectors && e + 8 <= nnz) {
      out.apply8_rounded(e, *reinterpret_cast<const uint4*>(gradient + e));
    } else {
      for (int64_t s = e; s < e + 8 && s < nnz; ++s) out.apply_rounded(s, gradient[s], out.fetch(s));
    }
  }
}

}  // namespace
}  // namespace snack::cuda
