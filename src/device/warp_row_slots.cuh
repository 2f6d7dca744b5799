// A warp's walk over one CSR row's slots, for the kernels that give a row of W to a warp and its
// pixels to the lanes (spmm_channels_first, separable_conv): each lane reads one slot of every 32 (the
// next 32 requested before the current ones are used), and the caller takes them in warp-uniform
// groups, handed round by shuffles.
#pragma once

#include <cstdint>

#include "cuda_utils.cuh"

namespace snack::cuda::detail {

// Calls group(value, column, t0, count) for t0 = 0, kGroup, 2 kGroup, ... below count, for each
// chunk of up to 32 slots of [begin, end): value and column are this lane's slot of the chunk (lane u
// holds slot u of it; value 0 and column 0 past the row), count the chunk's slots. The caller shuffles
// slot t0 + u from lane t0 + u and takes those below count.
template <int kGroup, typename T, typename Index, typename Group>
__device__ __forceinline__ void for_each_slot_group(const T* __restrict__ values, const Index* __restrict__ col_idx,
                                                    int32_t begin, int32_t end, int lane, Group&& group) {
  using A = accum_t<T>;
  const auto slot = [&](int32_t base, A& value, int32_t& column) {
    const int32_t e = base + lane;
    value = e < end ? to_accum(values[e]) : A(0);
    column = e < end ? int32_t(col_idx[e]) : 0;
  };
  A value;
  int32_t column;
  if (begin < end) slot(begin, value, column);
  for (int32_t base = begin; base < end; base += 32) {
    A next_value;
    int32_t next_column;
    slot(base + 32, next_value, next_column);
    const int count = end - base < 32 ? int(end - base) : 32;
    for (int t0 = 0; t0 < count; t0 += kGroup) group(value, column, t0, count);  // warp-uniform
    value = next_value;
    column = next_column;
  }
}

}  // namespace snack::cuda::detail
