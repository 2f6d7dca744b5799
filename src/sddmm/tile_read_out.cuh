// The rounded tile of the tile-view SDDMM kernels (tile_view_kernel.cuh on mma.sync,
// tile_view_wgmma_kernel.cuh on wgmma) and the read-out of its entries' gradients, which both share.
//
// The read-out is most of those kernels' instructions: a tile at 80% sparsity holds ~820 entries, each
// one shared-memory load and one store at its slot. Two things keep it short: the tile is held in
// 64-value rows whose 16-byte granules are swizzled by row (an entry's place is two operations from its
// position, against five for padded rows, and a warp's accumulator rows still store without bank
// conflicts), and a thread loads its four values before it stores any, so the loads' latencies overlap
// and the stores need no branches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/mma.cuh"
#include "../device/tile_view.cuh"
#include "snack/pattern.h"

namespace snack::cuda::detail {

// Where position `pos` (row * 64 + column) of a rounded tile lies in shared memory: [64][64] 16-bit
// values, granule g (8 values) of row r at granule g ^ (r % 8). A warp's accumulator pairs (rows r0 +
// lane / 4, columns 8 j + 2 (lane % 4)) then fall on 32 distinct banks.
__device__ __forceinline__ uint32_t rounded_tile_index(uint32_t pos) { return pos ^ ((pos >> 3) & 0x38u); }

// Stores a pair of rounded values at (row, col) of the tile, col even: the pair stays in one granule.
__device__ __forceinline__ void store_rounded_pair(uint16_t* tile, int row, int col, uint32_t pair) {
  *reinterpret_cast<uint32_t*>(tile + rounded_tile_index(uint32_t(row * 64 + col))) = pair;
}

// Stores a warp's 16 rows of the rounded tile, rows row0 .. row0 + 15 (row0 a multiple of 8) and all
// 64 columns: pairs[j][h] is the thread's pair of rows row0 + lane / 4 + 8 h, columns 8 j + 2 (lane %
// 4) and the next (the m16n8 accumulator layout, which a warp's rows of wgmma's m64n64 share). On
// sm_90 four stmatrix store its sixteen 8 x 8 blocks, a block's row being one granule, in place of
// sixteen 32-bit stores each with its own address.
__device__ __forceinline__ void store_rounded_rows(uint16_t* tile, int row0, int lane, const uint32_t (&pairs)[8][2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Lane l names row l % 8 of block l / 8: blocks (j, h) = (2 q, 0), (2 q, 1), (2 q + 1, 0), (2 q + 1, 1)
  // in stmatrix q. row0 % 8 == 0, so the row's swizzle is l % 8.
  const int block = lane / 8, r = lane % 8;
  uint16_t* row = tile + (row0 + (block % 2) * 8 + r) * 64;
#pragma unroll
  for (int q = 0; q < 4; ++q)
    stmatrix_x4(row + (((2 * q + block / 2) ^ r) * 8), pairs[2 * q][0], pairs[2 * q][1], pairs[2 * q + 1][0],
                pairs[2 * q + 1][1]);
#else
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = row0 + lane / 4, c = j * 8 + (lane % 4) * 2;
    store_rounded_pair(tile, r, c, pairs[j][0]);
    store_rounded_pair(tile, r + 8, c, pairs[j][1]);
  }
#endif
}

// Thread's share `s` of a tile's gradients, out of the rounded tile: the gradients of the entries
// before `end`, handed as T to `band_out`, whose slots count from the first of the tile's band
// (Out::from_slot(row_ptr[64 b])). The four values are read first, from whatever position each entry
// names (every masked entry is a place in the tile, so those past `end` read harmlessly), then the
// stores.
template <typename T, int kEntryStride, typename Out>
__device__ __forceinline__ void read_out_share(const TileShare<kEntryStride>& s, int32_t end, const uint16_t* tile,
                                               const Out& band_out) {
  uint16_t bits[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bits[j] = tile[rounded_tile_index(s.entry[j] & kTileViewPositionMask)];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (s.at(j) < end) {
      const int64_t slot = int64_t(s.entry[j] >> kTileViewSlotShift);
      band_out.apply_rounded(slot, T{bits[j]}, band_out.fetch(slot));
    }
  }
}

}  // namespace snack::cuda::detail
