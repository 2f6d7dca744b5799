// The SDDMM over the tile view (bf16, fp16; fp32 accumulation): the weight gradient of each 64 x 64
// tile of W that holds slots, computed as a dense tile of dY^T X on mma.sync, of which the tile's
// entries (snack/pattern.h) are read out.
//
// Against the tensor-core SDDMM (tensor_core_kernel.cuh, tiles of 128 x 128 walked through row
// cursors), the view hands a block each tile's slots as one contiguous list, so the whole block reads
// them out, a warp's lanes on consecutive entries: its stores at their slots then fall in a few runs
// of consecutive slots (1.0-1.9x faster in stand-alone runs than four consecutive entries a thread,
// whose lanes' stores spread over four times as many lines). A band's dY (at most 128 batch rows) is
// staged once and kept in registers as the mma's A fragments for all of the band's tiles. Each tile's
// chunk of X and its entries are copied into a stage of their own several tiles ahead
// (tv_dw_stages), so that a tile waits on no load of its own: with the entries held in registers one
// tile ahead, each tile waited about one round trip to memory. Per tile the block multiplies, rounds
// the tile into shared memory and stores its slots' gradients. Every gradient is one fixed chain of
// mma.sync products: deterministic. AdamW's step runs after it over the stored gradient, as for the
// tensor-core SDDMM.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "../device/tile_view.cuh"
#include "shapes.h"
#include "snack/pattern.h"
#include "tensor_core_kernel.cuh"

namespace snack::cuda {
namespace {

// dv[s] = sum_n dY[n, row(s)] X[n, col(s)] for the slots of band blockIdx.x / splits (64 rows of W)
// in its split's run of tiles, handed to `out` rounded to T. The batch is padded to 16 * KS rows
// (zeros past n); n > 0 (an empty batch's zero gradients come from the slot kernel). vec_dy / vec_x:
// the operand's rows are 16-byte vectors (stage_16bit_block).
template <typename T, int KS, typename Out>
__global__ void __launch_bounds__(detail::kTvDwThreads)
    sddmm_tile_view_kernel(detail::TileView view, const T* __restrict__ dy, const T* __restrict__ x, int64_t rows,
                           int64_t cols, int64_t n, int splits, bool vec_dy, bool vec_x, Out out) {
  using namespace detail;
  static_assert(!Out::kUpdatesState, "AdamW's step runs after the kernel (sddmm_adamw_from_gradient_kernel)");
  static_assert(kTileViewRows == kTvDwWarps * 16 && kTileViewCols == 64, "a warp's 16 rows of a 64 x 64 tile");
  constexpr int NB = 16 * KS;
  static_assert(NB <= kTvDwMaxBatch, "the batch the planner allows");
  constexpr int kStride = kTvDwStride;
  constexpr int kStages = tv_dw_stages(KS);
  static_assert(kStages >= 2 && kTvDwStageEntries % 4 == 0, "a stage's entries are whole 16-byte vectors");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* dys = reinterpret_cast<uint16_t*>(smem);              // [NB][kStride]: dY's band
  uint16_t* xs = dys + NB * kStride;                               // [kStages][NB][kStride]: X's chunks
  uint16_t* tile = xs + kStages * NB * kStride;                    // [64][kStride]: the rounded tile
  uint32_t* ring = reinterpret_cast<uint32_t*>(tile + 64 * kStride);  // [kStages][kTvDwStageWords]: entries
  int32_t* tp = reinterpret_cast<int32_t*>(ring + kStages * kTvDwStageWords);  // [steps + 2]: tiles' first entries

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t band = blockIdx.x / unsigned(splits);
  const int64_t r0 = band * kTileViewRows;
  const int64_t chunks = view.chunks;
  const int64_t c_begin = chunks * split / splits, c_end = chunks * (split + 1) / splits;
  const int steps = int(c_end - c_begin);
  if (steps == 0) return;
  for (int i = t; i <= steps; i += kTvDwThreads) tp[i] = view.tile_ptr[band * chunks + c_begin + i];
  if (t == 0) tp[steps + 1] = view.tile_ptr[band * chunks + c_end];  // the spare word (shapes.h)
  const int64_t band_first = view.row_ptr[r0];
  __syncthreads();  // the tile pointers, which size the copies of the entries

  // Stage i % kStages: tile i's chunk of X and its first kTvDwStageEntries entries, copied from the
  // 16-byte boundary at or before its first entry (never past its last: the view ends there).
  const auto stage_tile = [&](int i) {
    if (i >= steps) return;
    const int s = i % kStages;
    stage_16bit_block<NB, 64, kStride, kTvDwThreads>(xs + s * NB * kStride, x, n, cols, 0, (c_begin + i) * 64, vec_x);
    const int32_t first = tp[i], staged_end = min(tp[i + 1], first + kTvDwStageEntries);
    const int32_t aligned = first & ~3;
    uint32_t* words = ring + s * kTvDwStageWords;
    for (int32_t v = t; aligned + 4 * v < staged_end; v += kTvDwThreads) {
      const int32_t at = aligned + 4 * v;
      cp_async_16(words + 4 * v, view.entries + at, 4 * min(4, staged_end - at));
    }
  };
  // Group 0: dY's band and tile 0; groups 1 to kStages - 2: the next tiles (empty past the run).
  stage_16bit_block<NB, 64, kStride, kTvDwThreads>(dys, dy, n, rows, 0, r0, vec_dy);
#pragma unroll
  for (int i = 0; i + 1 < kStages; ++i) {
    stage_tile(i);
    cp_async_commit();
  }
  cp_async_wait<kStages - 2>();
  __syncthreads();

  // The warp's A fragments (its 16 rows x the padded batch), for every tile of the run.
  uint32_t a[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
    ldmatrix_x4_trans(a[ks], dys + (ks * 16 + (lane / 16) * 8 + lane % 8) * kStride + warp * 16 + ((lane / 8) % 2) * 8);
  out.begin();

  const auto read_out = [&](uint32_t entry) {
    const uint32_t pos = entry & kTileViewPositionMask;
    const int64_t slot = band_first + int64_t(entry >> kTileViewSlotShift);
    out.apply_rounded(slot, T{tile[(pos / 64) * kStride + pos % 64]}, out.fetch(slot));
  };

  for (int i = 0; i < steps; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile i's stage is in place; every thread is done reading out tile i - 1
    stage_tile(i + kStages - 1);  // into tile i - 1's stage
    cp_async_commit();

    const uint16_t* x_chunk = xs + (i % kStages) * NB * kStride;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        // B (batch x columns): matrices (batch 0-7, 8-15) of columns 16 p..16 p + 7, then of the next 8.
        uint32_t b[4];
        ldmatrix_x4_trans(b, x_chunk + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride + p * 16 + (lane / 16) * 8);
        mma_16816<T>(acc[2 * p], a[ks], b[0], b[1]);
        mma_16816<T>(acc[2 * p + 1], a[ks], b[2], b[3]);
      }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int r = warp * 16 + lane / 4, c = j * 8 + (lane % 4) * 2;
      *reinterpret_cast<uint32_t*>(tile + r * kStride + c) = round_pair<T>(acc[j][0], acc[j][1]);
      *reinterpret_cast<uint32_t*>(tile + (r + 8) * kStride + c) = round_pair<T>(acc[j][2], acc[j][3]);
    }
    __syncthreads();  // the tile is complete

    // The lanes of a warp on consecutive entries: their stores fall in a few runs of slots.
    const int32_t first = tp[i], count = tp[i + 1] - first;
    const int32_t staged = min(count, kTvDwStageEntries);
    const uint32_t* words = ring + (i % kStages) * kTvDwStageWords + (first & 3);
#pragma unroll 4
    for (int32_t e = t; e < staged; e += kTvDwThreads) read_out(words[e]);
    for (int32_t e = staged + t; e < count; e += kTvDwThreads) read_out(__ldg(view.entries + first + e));
  }
  cp_async_wait_all();
}

}  // namespace
}  // namespace snack::cuda
