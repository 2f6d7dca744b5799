// Integer helpers for launch shapes, shared by the planners (host code) and the kernels.
#pragma once

#include <cstdint>

#include "snack/value_types.h"

namespace snack::detail {

SNACK_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most blocks a launch takes along y (and z): more run as several launches.
inline constexpr int64_t kMaxGridY = 65535;

// Blocks for `work_items` at `items_per_block`, at least 1 and at most `cap`: a grid-stride loop
// covers the rest (grid.x <= 2^31 - 1 anyway).
inline unsigned grid_for(int64_t work_items, int items_per_block, int64_t cap = 1 << 20) {
  int64_t blocks = ceil_div(work_items, items_per_block);
  if (blocks < 1) blocks = 1;
  if (blocks > cap) blocks = cap;
  return static_cast<unsigned>(blocks);
}

}  // namespace snack::detail
