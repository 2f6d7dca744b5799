// The launcher of the SDDMM over the tile view with wgmma (tile_view_wgmma_kernel.cuh). Built for
// sm_90a only (CMakeLists.txt); without that target the kernel traps and the launcher refuses it.
#include <cuda_runtime.h>

#include <string>

#include "../device/cuda_utils.cuh"
#include "../device/tensor_map.h"
#include "../spmm/wgmma.h"
#include "epilogues.cuh"
#include "shapes.h"
#include "tile_view_wgmma_kernel.cuh"
#include "wgmma.h"

namespace snack::cuda::detail {

namespace {

template <typename T, int KS, int G, bool kChunked = false>
Status launch_steps(const SddmmPlan& plan, const TileView& view, const T* dy, const T* x, int64_t rows, int64_t cols,
                    int64_t n, T* dvalues, Stream stream) {
  const auto kernel = sddmm_tile_view_wgmma_kernel<T, KS, G, kChunked, StoreGradient<T>>;
  SNACK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const bool vec_dy = rows_of_16byte_vectors(dy, rows);
  const bool vec_x = rows_of_16byte_vectors(x, cols);
  // X's chunks through the copy engine where its rows are whole 16-byte units.
  CUtensorMap x_map{};
  const bool mapped = tensor_map_16bit_fits(x, cols);
  if (mapped) SNACK_RETURN_IF_ERROR(tensor_map_16bit(x, n, cols, 64, uint32_t(16 * KS), &x_map));
  const int64_t bands = tile_view_bands(rows);
  kernel<<<unsigned(plan.grid_x), G * 128, plan.smem_bytes, stream>>>(
      x_map, view, dy, x, rows, cols, n, bands, plan.tile_splits, vec_dy, vec_x, mapped, StoreGradient<T>{dvalues});
  return check_launch("sddmm_tile_view_wgmma_kernel");
}

template <typename T, int G>
Status launch_groups(const SddmmPlan& plan, const TileView& view, const T* dy, const T* x, int64_t rows,
                     int64_t cols, int64_t n, T* dvalues, Stream stream) {
  if (n > kTvWgMaxBatch)
    return InvalidArgument("sddmm: tile_view_wgmma runs batches of at most " + std::to_string(kTvWgMaxBatch));
  switch (tv_dw_k_steps(n)) {  // past kTvDwMaxBatch rows: 8, in tv_wg_batch_chunks(n) chunks
    case 1: return launch_steps<T, 1, G>(plan, view, dy, x, rows, cols, n, dvalues, stream);
    case 2: return launch_steps<T, 2, G>(plan, view, dy, x, rows, cols, n, dvalues, stream);
    case 4: return launch_steps<T, 4, G>(plan, view, dy, x, rows, cols, n, dvalues, stream);
    case 8:
      return tv_wg_batch_chunks(n) > 1 ? launch_steps<T, 8, G, true>(plan, view, dy, x, rows, cols, n, dvalues, stream)
                                       : launch_steps<T, 8, G>(plan, view, dy, x, rows, cols, n, dvalues, stream);
    default:
      return InvalidArgument("sddmm: tile_view_wgmma runs batches of at most " + std::to_string(kTvWgMaxBatch));
  }
}

}  // namespace

template <typename T>
Status launch_sddmm_tile_view_wgmma(const SddmmPlan& plan, const TileView& view, const T* dy, const T* x,
                                    int64_t rows, int64_t cols, int64_t n, T* dvalues, Stream stream) {
  SNACK_RETURN_IF_ERROR(check_wgmma_device());
  static_assert(kTvWgMaxGroups == 2, "the counts below");
  if (plan.threads == 2 * 128) return launch_groups<T, 2>(plan, view, dy, x, rows, cols, n, dvalues, stream);
  if (plan.threads == 128) return launch_groups<T, 1>(plan, view, dy, x, rows, cols, n, dvalues, stream);
  return InvalidArgument("sddmm: tile_view_wgmma runs blocks of 1 or 2 warpgroups, the plan has " +
                         std::to_string(plan.threads) + " threads");
}

template Status launch_sddmm_tile_view_wgmma<bfloat16>(const SddmmPlan&, const TileView&, const bfloat16*,
                                                       const bfloat16*, int64_t, int64_t, int64_t, bfloat16*, Stream);
template Status launch_sddmm_tile_view_wgmma<float16>(const SddmmPlan&, const TileView&, const float16*,
                                                      const float16*, int64_t, int64_t, int64_t, float16*, Stream);

}  // namespace snack::cuda::detail
