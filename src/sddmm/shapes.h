// The launch geometry of the SDDMM kernels, read by the kernels (kernels.cuh) and by the planner
// (plan.cpp, compiled without CUDA).
#pragma once

namespace snack::cuda::detail {

constexpr int kSddmmWarpsPerBlock = 8;
constexpr int kSddmmThreads = kSddmmWarpsPerBlock * 32;
constexpr int kSddmmRowsBlocksPerSm = 4;  // the rows kernel's launch bound
constexpr int kSddmmVectorSlotsPerLane = 4;  // slots a lane group of the vector kernel takes per pass

// Slots per lane per chunk of sddmm_rows_kernel (its kU): fewer where the row's dY takes more
// registers (NC chunks of 4 values), and with AdamW's step in the epilogue up to 4 batch lanes,
// where a lane would otherwise keep 2-8 slots' sums, values and moments (measured on the H200, with
// AdamW: 16384x4096, 90%, N = 8: 105 against 184 us, N = 16: 116 against 123 us; at N = 32, 8 batch
// lanes, 4 slots lost: 185 against 149 us).
constexpr int rows_slots_per_lane(int GN, int NC, bool updates_state) {
  return NC >= 4 || (updates_state && GN <= 4) ? 4 : 8;
}

}  // namespace snack::cuda::detail
