// Cursors into a band of 16 rows of a sorted view of W, moved to a column: the tensor-core kernels
// start a block's walk of its rows' slots at the first chunk or tile it owns.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace snack::cuda::detail {

// Lanes r < 16 hold the cursor (next slot) of row r of the warp's 16, lanes 16 + r its end.
// Moves every cursor to the first slot whose input is >= k_begin: rounds of 32 probes per row,
// the 16 rows' probes issued together.
template <typename View>
__device__ __forceinline__ int32_t seek_cursors(const View& view, int32_t cursor_or_end, int64_t k_begin) {
  const int lane = threadIdx.x % 32;
  int32_t lo = cursor_or_end;
  int32_t len = __shfl_down_sync(0xffffffffu, cursor_or_end, 16) - cursor_or_end;  // lanes < 16: the row's length
  while (__any_sync(0xffffffffu, lane < 16 && len > 0)) {
    int32_t probe[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int32_t row_lo = __shfl_sync(0xffffffffu, lo, r), row_len = __shfl_sync(0xffffffffu, len, r);
      const int32_t step = (row_len + 31) / 32;
      const int32_t at = lane * step;
      probe[r] = row_len > 0 && at < row_len ? view.input(row_lo + at) : INT_MAX;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int32_t row_len = __shfl_sync(0xffffffffu, len, r);
      const int32_t step = (row_len + 31) / 32;
      const int32_t below = __popc(__ballot_sync(0xffffffffu, probe[r] < k_begin));
      if (lane == r && row_len > 0) {
        if (below == 0) {
          len = 0;
        } else {
          const int32_t skipped = (below - 1) * step + 1;  // the probes below, and the slots before the last
          lo += skipped;
          len = min(step - 1, row_len - skipped);
        }
      }
    }
  }
  return lane < 16 ? lo : cursor_or_end;
}

}  // namespace snack::cuda::detail
