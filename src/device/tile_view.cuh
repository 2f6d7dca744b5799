// Reading the pattern's tile view (snack/pattern.h) on the device: each 64 x 64 tile's entries,
// packed (the slot's offset from its band's first slot, its position in the tile), read by a block
// four to a thread (TileShare below). The SpMM (forward and dX) and the SDDMM over the view share it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "snack/pattern.h"
#include "snack/status.h"

namespace snack::cuda::detail {

// What a kernel reads of the pattern: the tile view, and row_ptr for each band's first slot.
struct TileView {
  const int32_t* __restrict__ tile_ptr;
  const uint32_t* __restrict__ entries;
  const int32_t* __restrict__ row_ptr;
  int64_t chunks;  // tiles per band of W
};

// The tile view of `w` as the kernels read it, or why it cannot be read (`who` opens the message).
template <typename Index>
inline Status tile_view_of(const SlotPattern<Index>& w, const char* who, TileView* view) {
  if (w.tile_ptr == nullptr || (w.nnz > 0 && w.tile_entries == nullptr))
    return InvalidArgument(std::string(who) + ": the pattern holds no tile view");
  if (reinterpret_cast<uintptr_t>(w.tile_entries) % 16 != 0)
    return InvalidArgument(std::string(who) + ": tile_entries must start on a 16-byte boundary");
  *view = TileView{w.tile_ptr, w.tile_entries, w.row_ptr, tile_view_chunks(w.cols)};
  return Status::Ok();
}

// One thread's share of a round of a tile: four entries, at(j) for j < 4, each valid inside the tile's
// [begin, end). kEntryStride 1: four consecutive entries, read with one 16-byte load, from a round
// that starts on a multiple of 4. kEntryStride = the block's threads: thread t holds entries t + j *
// kEntryStride of the round, so the lanes of a warp hold consecutive entries, which lie in a few runs
// of consecutive slots (a tile lists its slots row by row): the warp's stores at their slots then
// touch a few lines each, against about four times as many with four consecutive entries a thread.
template <int kEntryStride>
struct TileShare {
  uint32_t entry[4];
  int32_t first;
  __device__ __forceinline__ int32_t at(int j) const { return first + j * kEntryStride; }
};

// Thread t's share of the round that starts at entry `round` of a tile ending at `end`.
template <int kEntryStride>
__device__ __forceinline__ void load_tile_share(TileShare<kEntryStride>& s, const uint32_t* __restrict__ entries,
                                                int32_t round, int32_t end, int t) {
  if constexpr (kEntryStride == 1) {
    s.first = round + 4 * t;
    if (s.first < end) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(entries + s.first));
      s.entry[0] = v.x, s.entry[1] = v.y, s.entry[2] = v.z, s.entry[3] = v.w;
    }
  } else {
    s.first = round + t;
#pragma unroll
    for (int j = 0; j < 4; ++j) s.entry[j] = s.at(j) < end ? __ldg(entries + s.at(j)) : 0u;
  }
}

}  // namespace snack::cuda::detail
