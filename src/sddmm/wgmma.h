// The launcher of the SDDMM over the tile view with wgmma (tile_view_wgmma_kernel.cuh), compiled for
// sm_90a in its own translation unit (tile_view_wgmma.cu) and called by run_sddmm (launch.cu) when its
// plan says kTileViewWgmma.
#pragma once

#include <cstdint>

#include "../device/tile_view.cuh"
#include "snack/sddmm.h"
#include "snack/status.h"

namespace snack::cuda::detail {

/// dvalues[s] = sum_n dY[n, row(s)] X[n, col(s)], rounded to T, for every slot of the view's tiles:
/// `dy` [n][rows], `x` [n][cols], 0 < n <= kTvWgMaxBatch, on the plan's grid (plan.threads / 128
/// warpgroups a block, each a band of 64 rows; plan.tile_splits blocks per group of bands).
/// kUnsupported without sm_90a code or on a device other than compute capability 9.0.
template <typename T>
Status launch_sddmm_tile_view_wgmma(const SddmmPlan& plan, const TileView& view, const T* dy, const T* x,
                                    int64_t rows, int64_t cols, int64_t n, T* dvalues, Stream stream);

}  // namespace snack::cuda::detail
