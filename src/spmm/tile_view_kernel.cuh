// The tensor-core SpMM over the tile view (bf16, fp16; fp32 accumulation): the forward, and dX = dY W
// over the same tiles read column by column. The tile view (snack/pattern.h) lists each 64 x 64
// tile's slots contiguously as packed 32-bit entries (the slot's offset from its band's first slot,
// its position in the tile), so a block reads a tile's entries with coalesced 16-byte loads (four
// consecutive entries a thread) and gathers their values from the layer's own values in slot order: the
// values are never copied, and nothing goes stale when they change. (A warp's lanes on consecutive
// entries, as in the SDDMM over the view, gathered the values from fewer lines but ran the forward no
// faster, 0.98-1.08x, and dX at batch tiles of 32 slower, 0.62-0.85x.)
//
// A block owns a band of kTcBandRows outputs and a range of chunks (a thread-block cluster splits a
// band's chunks as in the tensor_core kernel, and sums their partial tiles the same way). In the
// forward a band is 64 rows of W and its chunks the tiles along the row; in the transposed product a
// band is 64 columns of W, its chunks the tiles down the column, each scattered transposed (W^T's
// tile), with the offsets counted from each tile's own band of W. Per chunk the whole block scatters
// the tile's entries into a zeroed tile in shared memory, the chunk of the input is staged beside it
// (cp.async, double-buffered), and each warp multiplies its 16 outputs with mma.sync m16n8k16. Three
// tiles rotate, so that one barrier per chunk orders everything: at step i the block scatters and
// multiplies tile i and zeroes the buffer of tile i - 1, which every warp finished before the barrier.
// A step's entries are loaded three steps ahead and its values gathered two steps ahead, in registers,
// so that their latency runs under the steps between.
//
// The forward also reads packed tile values (snack/pattern.h) in place of the entries where the caller
// holds them: the values then arrive with the entries' 16-byte loads, and no slot is gathered.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "../device/tile_view.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/pattern.h"
#include "snack/value_types.h"
#include "tensor_core_kernel.cuh"

namespace snack::cuda::detail {

static_assert(kTcBandRows == kTileViewRows && kTcChunk == kTileViewCols, "the kernel's tiles are the view's");

// The share's values: gathered from the slots the entries name, or, with kPacked, taken from the
// entries themselves (packed tile values, snack/pattern.h), which the share's load already brought.
template <bool kPacked, typename T>
__device__ __forceinline__ void gather_share_values(const TileShare<1>& s, uint16_t (&bits)[4],
                                                    const T* __restrict__ band_values, int32_t begin, int32_t end) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(band_values);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int32_t e = s.at(j);
    if constexpr (kPacked)
      bits[j] = e >= begin && e < end ? uint16_t(s.entry[j] >> kTilePackedValueShift) : uint16_t(0);
    else
      bits[j] = e >= begin && e < end ? raw[s.entry[j] >> kTileViewSlotShift] : uint16_t(0);
  }
}

// The share's values into the tile at their positions: W's tile as stored, or its transpose.
template <bool kTransposed>
__device__ __forceinline__ void scatter_share(const TileShare<1>& s, const uint16_t (&bits)[4], uint16_t* tile,
                                              int32_t begin, int32_t end) {
  constexpr int kStride = tensor_core_stride(kTcChunk);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int32_t e = s.at(j);
    if (e >= begin && e < end) {
      const uint32_t pos = s.entry[j] & kTileViewPositionMask;
      const uint32_t row = pos / kTcChunk, col = pos % kTcChunk;
      if constexpr (kTransposed)
        tile[col * kStride + row] = bits[j];
      else
        tile[row * kStride + col] = bits[j];
    }
  }
}

// Zeroes a block's tile of kTcBandRows x kTcChunk values.
__device__ __forceinline__ void zero_block_tile(uint16_t* tile) {
  zero_tile_rows<kTcBandRows, kTcChunk, kTcThreads>(tile, int(threadIdx.x));
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and the
// batch tile of blockIdx.y; the cluster's blocks split the band's chunks. kTransposed: dX = dY W, out
// and in being dX [n][cols of W] and dY [n][rows of W]. kPacked: view.entries are packed tile values
// (the forward only), and `values` is not read.
template <typename T, int NT, bool kTransposed, bool kPacked = false>
__global__ void __launch_bounds__(kTcThreads) spmm_tile_view_kernel(TileView view, const T* __restrict__ values,
                                                                    int64_t out_dim, int64_t in_dim,
                                                                    const T* __restrict__ in, int64_t n,
                                                                    const T* __restrict__ bias, T* __restrict__ out,
                                                                    Activation act, int splits, bool vec) {
  static_assert(NT % 16 == 0 && NT <= 64, "batch tiles of 16 to 64 rows");
  static_assert(!(kPacked && kTransposed), "packed tile values serve the forward");
  constexpr int CW = kTcChunk;
  constexpr int kStride = tensor_core_stride(CW);
  constexpr int kTileValues = kTcBandRows * kStride;
  constexpr int kShare = 4 * kTcThreads;  // entries per round of the block
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);               // [3][kTcBandRows][kStride]
  uint16_t* xs = tiles + 3 * kTileValues;                             // [2][NT][kStride]
  // Step i's tile: its entries [begin, end) and the slot their offsets count from. The forward's
  // tiles follow each other ([steps + 1] starts, one band's slots); the transposed product's lie
  // apart ([3][steps]: starts, ends, each tile's band's first slot).
  int32_t* tp = reinterpret_cast<int32_t*>(xs + 2 * NT * kStride);
  float* partial = reinterpret_cast<float*>(smem);                    // [NT][kTcPartialStride], after the loop

  const int warp = threadIdx.x / 32, t = threadIdx.x;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t band = blockIdx.x / unsigned(splits);
  const int64_t o0 = band * kTcBandRows;
  const int64_t n0 = int64_t(blockIdx.y) * NT;
  const int64_t chunks = kTransposed ? (in_dim + kTcChunk - 1) / kTcChunk : view.chunks;
  const int64_t c_begin = chunks * split / splits, c_end = chunks * (split + 1) / splits;
  const int steps = int(c_end - c_begin);
  const T* band_values = values;
  if constexpr (kTransposed) {
    for (int i = t; i < steps; i += kTcThreads) {
      const int64_t tile = (c_begin + i) * view.chunks + band;
      tp[i] = view.tile_ptr[tile];
      tp[steps + i] = view.tile_ptr[tile + 1];
      tp[2 * steps + i] = view.row_ptr[(c_begin + i) * kTcBandRows];
    }
  } else {
    if constexpr (!kPacked) band_values = values + view.row_ptr[o0];
    for (int i = t; i <= steps; i += kTcThreads) tp[i] = view.tile_ptr[band * chunks + c_begin + i];
  }
  __syncthreads();
  auto step_begin = [&](int i) { return tp[i]; };
  auto step_end = [&](int i) { return kTransposed ? tp[steps + i] : tp[i + 1]; };
  auto step_values = [&](int i) { return kTransposed ? values + tp[2 * steps + i] : band_values; };

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // The pipeline: s0 / b0 this step's tile (entries, values), s1 / b1 the next one's, s2 the entries
  // of the one after.
  TileShare<1> s0{}, s1{}, s2{};
  uint16_t b0[4] = {0, 0, 0, 0}, b1[4] = {0, 0, 0, 0};
  if (steps > 0) load_tile_share(s0, view.entries, step_begin(0) & ~3, step_end(0), t);
  if (steps > 1) load_tile_share(s1, view.entries, step_begin(1) & ~3, step_end(1), t);
  if (steps > 2) load_tile_share(s2, view.entries, step_begin(2) & ~3, step_end(2), t);
  if (steps > 0) {
    gather_share_values<kPacked>(s0, b0, step_values(0), step_begin(0), step_end(0));
    stage_input_chunk<T, NT, CW>(xs, in, n, in_dim, n0, c_begin * CW, vec);
  }
  if (steps > 1) gather_share_values<kPacked>(s1, b1, step_values(1), step_begin(1), step_end(1));
  cp_async_commit();
  zero_block_tile(tiles);
  zero_block_tile(tiles + kTileValues);
  __syncthreads();

  int slot = 0;  // the tile buffer of step i: i % 3
  for (int i = 0; i < steps; ++i) {
    uint16_t* tile = tiles + slot * kTileValues;
    const int32_t begin = step_begin(i), end = step_end(i);
    scatter_share<kTransposed>(s0, b0, tile, begin, end);
    // A tile fuller than one round of the block (kShare entries): the rest, read in place.
    for (int32_t round = (begin & ~3) + kShare; round < end; round += kShare) {
      TileShare<1> more;
      uint16_t bits[4];
      load_tile_share(more, view.entries, round, end, t);
      gather_share_values<kPacked>(more, bits, step_values(i), begin, end);
      scatter_share<kTransposed>(more, bits, tile, begin, end);
    }
    s0 = s1;
#pragma unroll
    for (int j = 0; j < 4; ++j) b0[j] = b1[j];
    s1 = s2;
    if (i + 2 < steps) gather_share_values<kPacked>(s1, b1, step_values(i + 2), step_begin(i + 2), step_end(i + 2));
    if (i + 3 < steps) load_tile_share(s2, view.entries, step_begin(i + 3) & ~3, step_end(i + 3), t);
    if (vec) cp_async_wait_all();
    __syncthreads();  // tile i and X's chunk i are in place; every warp is done with tile i - 1 and X's i - 1
    zero_block_tile(tiles + (slot == 0 ? 2 : slot - 1) * kTileValues);
    if (i + 1 < steps)
      stage_input_chunk<T, NT, CW>(xs + ((i + 1) & 1) * NT * kStride, in, n, in_dim, n0, (c_begin + i + 1) * CW, vec);
    cp_async_commit();
    multiply_chunk<T, NT, CW>(acc, tile + warp * 16 * kStride, xs + (i & 1) * NT * kStride);
    slot = slot == 2 ? 0 : slot + 1;
  }

  finish_band_tile<T, NT>(acc, partial, o0, out_dim, n0, n, bias, out, act, split, splits);
}

}  // namespace snack::cuda::detail
