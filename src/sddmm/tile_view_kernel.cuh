// The SDDMM over the tile view (bf16, fp16; fp32 accumulation): the weight gradient of each 64 x 64
// tile of W that holds slots, computed as a dense tile of dY^T X on mma.sync, of which the tile's
// entries (snack/pattern.h) are read out.
//
// Against the tensor-core SDDMM (tensor_core_kernel.cuh, tiles of 128 x 128 walked through row
// cursors), the view hands a block each tile's slots as one contiguous list, so the whole block reads
// them out four entries to a thread, a warp's lanes on consecutive entries: its stores at their slots
// then fall in a few runs of consecutive slots (1.0-1.9x faster in stand-alone runs than four
// consecutive entries a thread, whose lanes' stores spread over four times as many lines). A band's
// dY (at most 128 batch rows) is staged once and kept in registers as the mma's A fragments for all
// of the band's tiles: per tile the block stages X's chunk, multiplies, rounds the tile into shared
// memory and stores its slots' gradients. The chunk of the tile after next is staged while a tile is
// read out, and the entries of the next tile are loaded a tile ahead (from N = 64 those of the tile
// after next). Every gradient is one fixed chain of mma.sync products: deterministic. AdamW's step
// runs after it over the stored gradient, as for the tensor-core SDDMM.
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
#include "tile_read_out.cuh"

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
  constexpr int kShare = 4 * kTvDwThreads;  // entries per round of the block
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* dys = reinterpret_cast<uint16_t*>(smem);            // [NB][kStride]: dY's band
  uint16_t* xs = dys + NB * kStride;                             // [2][NB][kStride]: X's chunks
  uint16_t* tile = xs + 2 * NB * kStride;                        // [64][64]: the rounded tile (tile_read_out.cuh)
  int32_t* tp = reinterpret_cast<int32_t*>(tile + 64 * 64);      // [steps + 1]: the tiles' first entries

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

  // Group 0: dY's band and X's first chunk; group 1: the second chunk (empty where there is none).
  stage_16bit_block<NB, 64, kStride, kTvDwThreads>(dys, dy, n, rows, 0, r0, vec_dy);
  stage_16bit_block<NB, 64, kStride, kTvDwThreads>(xs, x, n, cols, 0, c_begin * 64, vec_x);
  cp_async_commit();
  if (steps > 1) stage_16bit_block<NB, 64, kStride, kTvDwThreads>(xs + NB * kStride, x, n, cols, 0, (c_begin + 1) * 64,
                                                                   vec_x);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  // The warp's A fragments (its 16 rows x the padded batch), for every tile of the run.
  uint32_t a[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
    ldmatrix_x4_trans(a[ks], dys + (ks * 16 + (lane / 16) * 8 + lane % 8) * kStride + warp * 16 + ((lane / 8) % 2) * 8);
  out.begin();
  const Out band_out = out.from_slot(band_first);

  const auto load_entries = [&](TileShare<kTvDwThreads>& s, int i) {
    if (i < steps) load_tile_share(s, view.entries, tp[i], tp[i + 1], t);
  };
  TileShare<kTvDwThreads> s0{}, s1{};
  load_entries(s0, 0);
  load_entries(s1, 1);
  // A share starts at a tile's first entry or a whole round past it: only the tile's end bounds it.
  const auto read_out = [&](const TileShare<kTvDwThreads>& s, int32_t end) {
    read_out_share<T>(s, end, tile, band_out);
  };

  // Tile i, whose entries `mine` holds.
  const auto run_tile = [&](int i, const TileShare<kTvDwThreads>& mine) {
    if (i > 0) {
      cp_async_wait<1>();
      __syncthreads();  // X's chunk i is in place; every thread is done reading out tile i - 1
    }
    const uint16_t* x_chunk = xs + (i & 1) * NB * kStride;
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
    uint32_t pairs[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      pairs[j][0] = round_pair<T>(acc[j][0], acc[j][1]), pairs[j][1] = round_pair<T>(acc[j][2], acc[j][3]);
    store_rounded_rows(tile, warp * 16, lane, pairs);
    __syncthreads();  // the tile is complete; every warp is done with X's chunk i
    if (i + 2 < steps)
      stage_16bit_block<NB, 64, kStride, kTvDwThreads>(xs + (i & 1) * NB * kStride, x, n, cols, 0,
                                                       (c_begin + i + 2) * 64, vec_x);
    cp_async_commit();
    const int32_t end = tp[i + 1];
    read_out(mine, end);
    // A tile fuller than one round of the block (kShare entries): the rest, read in place.
    for (int32_t round = tp[i] + kShare; round < end; round += kShare) {
      TileShare<kTvDwThreads> more;
      load_tile_share(more, view.entries, round, end, t);
      read_out(more, end);
    }
  };
  if constexpr (KS >= 4) {
    // Two tiles per turn, so that the two sets of entries take turns without a copy, which would wait
    // for the loads in flight into the set copied. Against the copy (stand-alone runs, 768x3072 to
    // 16384x4096 at 80-95%): N = 128 1.07-1.16x; N = 64 1.02x in geometric mean, from 0.78x on
    // 11008x4096 to 1.25x on 16384x4096.
    for (int i = 0; i < steps; i += 2) {
      run_tile(i, s0);
      load_entries(s0, i + 2);
      if (i + 1 < steps) {
        run_tile(i + 1, s1);
        load_entries(s1, i + 3);
      }
    }
  } else {
    // Fewer k-steps leave less work to cover the wait, and the two tiles' code and registers per turn
    // cost more than they save there (N = 1-32: 0.77-1.09x, 0.93-0.95x in geometric mean).
    for (int i = 0; i < steps; ++i) {
      run_tile(i, s0);
      s0 = s1;
      load_entries(s1, i + 2);
    }
  }
  cp_async_wait_all();
}

}  // namespace
}  // namespace snack::cuda
