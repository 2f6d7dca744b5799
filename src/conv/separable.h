// What the fused depthwise-separable kernel and its plan share: the output chunk and the shared
// memory of a tile.
#pragma once

#include <cstddef>
#include <cstdint>

namespace snack::detail {

// Output channels a block writes back at a time: their tile of pixels x channels is staged in shared
// memory, so each pixel's channels are stored as one contiguous run.
inline constexpr int kSeparableOutputChunk = 64;

// z (channels x the tile, float), the depthwise weights (9 x channels, float) and, for channels_last
// outputs, the staged outputs (the tile x a chunk, each pixel's run padded by one float so that the
// lanes' writes spread over the banks; NCHW outputs are stored from registers, a channel's pixels
// being contiguous).
inline size_t separable_smem_bytes(int64_t channels, int pixels_per_lane, bool channels_last) {
  const int64_t tile = 32 * int64_t(pixels_per_lane);
  const int64_t staged = channels_last ? tile * (kSeparableOutputChunk + 1) : 0;
  return size_t(channels * tile + 9 * channels + staged) * sizeof(float);
}

}  // namespace snack::detail
