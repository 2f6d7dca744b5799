// Planning and launching of the CUDA SpMM kernels (forward and transposed).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "../common/op_checks.h"
#include "cuda_utils.cuh"
#include "snack/ops.h"
#include "spmm_kernels.cuh"
#include "spmm_wide_rows.cuh"

namespace snack {

namespace cuda {
namespace {

using detail::check_launch;
using detail::device_limits;
using detail::DeviceLimits;
using detail::CscView;
using detail::CsrView;
using detail::kSpmmWarps;

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < 128) p <<= 1;
  return p;
}

// Lanes of a warp along the entries for a batch tile (TileLayout<tile>::GS): the others hold
// the tile's 4-wide vectors.
int lanes_free_for(int batch_tile) { return 32 / (batch_tile / std::min(batch_tile, 4)); }

// The most lanes worth splitting one output row: enough that each has about two entries, at most
// the free lanes; the rest of the free lanes take further rows (rows per warp = free / this).
int max_lanes_per_row(int batch_tile, double avg_row_length) {
  const int free_lanes = lanes_free_for(batch_tile);
  int lanes = 1;
  while (lanes < free_lanes && lanes * 2 <= avg_row_length) lanes <<= 1;
  return lanes;
}

// Warps of a row-kernel launch: output rows over rows per warp, times the batch tiles.
int64_t warps_for(int64_t out_dim, int64_t tiles, int batch_tile, int lanes_per_row) {
  const int64_t rows_per_warp = lanes_free_for(batch_tile) / lanes_per_row;
  return (out_dim + rows_per_warp - 1) / rows_per_warp * tiles;
}

// Warps a row-kernel launch should have: half of what the SMs hold at once (32 warps per SM at
// the kernels' 64 registers per thread) keeps enough loads of W in flight on the H200.
int64_t wanted_warps(const DeviceLimits& limits) { return int64_t(limits.sms) * 16; }
// Warps the SMs hold at once (one wave of the row kernels).
int64_t resident_warps(const DeviceLimits& limits) { return int64_t(limits.sms) * 32; }

// Lanes per row: from max_lanes_per_row, halved while the launch keeps wanted_warps. Fewer lanes
// per row means more rows per warp and a longer stretch of one row per lane, which pays the
// per-row cost (row pointers, the shuffle reduction, the store) fewer times: measured on the H200
// (16384x4096, 90%) 4 lanes per row at N = 16 took 55 us against 60 us with 8.
// Two corrections, from every lanes value forced over 5 shapes x N = 1..128 x 80-99% on the H200
// (session 12, bench/results/archive/spmm_lanes_sweep_session12.csv; A/B in spmm_lanes_ab_session12.csv):
// - forward: a launch left just under one wave of warps is doubled to about two when each lane
//   keeps at least 48 entries (16384x4096, 90%: N = 16 55.0 -> 50.1 us, N = 32 88.3 -> 82.6 us,
//   N = 8 at 80% 64.3 -> 59.4 us); with shorter stretches (99%) or a launch that would end 1.2
//   waves deep (5000x5000) the doubling loses.
// - transposed product (CSC view, values read through csc_perm): at most 8 lanes per row while
//   the launch keeps 4 warps per SM, the fewer warps walking longer stretches (16384x4096, 90%,
//   N = 1: 95.8 -> 69.7 us, N = 8: 133 -> 121 us; 4096x4096, N = 1: 26.4 -> 20.9 us).
// Both were measured for the kernels that read X (or dY) through L1, global_x and global_xt; with
// the tile staged in shared memory (smem_x, N = 2-4) they lose (0.4-0.85x), so it keeps the first rule.
int lanes_per_row_for(SpmmVariant variant, int batch_tile, double avg_row_length, int64_t out_dim, int64_t tiles,
                      bool transposed, const DeviceLimits& limits) {
  int lanes = max_lanes_per_row(batch_tile, avg_row_length);
  const auto warps = [&](int l) { return warps_for(out_dim, tiles, batch_tile, l); };
  while (lanes > 1 && warps(lanes / 2) >= wanted_warps(limits)) lanes >>= 1;
  if (variant != SpmmVariant::kGlobalX && variant != SpmmVariant::kGlobalXT) return lanes;
  if (transposed) {
    while (lanes > 8 && warps(lanes / 2) >= int64_t(limits.sms) * 4) lanes >>= 1;
  } else if (lanes < max_lanes_per_row(batch_tile, avg_row_length) &&
             double(warps(2 * lanes)) >= 1.75 * double(resident_warps(limits)) &&
             avg_row_length >= 48.0 * (2 * lanes)) {
    lanes <<= 1;
  }
  return lanes;
}

// Batch tiles run side by side in grid.y, at most this many.
constexpr int64_t kMaxGridY = 65535;

// global_x reads X in place (no transpose launch, no workspace), but one entry costs it N sectors of
// X against N / 8 for global_xt: it pays only while X stays in L1 at a batch of at most 8, or for a
// tiny product. Since global_xt's kernel overlaps the transpose (programmatic launch), measured on
// the H200 (session 5): 4096x4096, 99%, N = 8 (X 128 KiB): global_x 11.3 us, global_xt 9.4 us;
// 3072x768, 90%, N = 8 (X 24 KiB): 8.2 against 9.1 us; 3072x768, 99%, N = 16 (0.4 M
// multiply-adds): 7.0 against 7.8 us.
constexpr int64_t kGlobalXMaxBatch = 8;
constexpr int64_t kGlobalXMaxBytes = 96 * 1024;
constexpr int64_t kTinyProduct = int64_t(1) << 19;

// A batch of one row runs wide_rows where X's row leaves room for 4 blocks per SM, each warp gets a
// group of at least this many rows (so the group's slots are one long stream) and rows average at
// least kWideRowsMinAverage slots. Measured on the H200 at N = 1 (bench/results/gpu_session14_nvidia_h200.log):
// wide_rows beats global_x by 5-25% on 12288-32768 x 4096 at 80-95% sparsity (groups of 3-8 rows;
// a tie at 12288x4096, 95%); with groups of 1-2 rows (4096-8192 rows), ~41 slots per row (99%) or
// 2 blocks per SM (16384x16384) it is 2-40% slower: its staging of X and its row-pointer load cost
// more than its faster stream saves.
constexpr int kWideRowsMinRowsPerWarp = 3;
constexpr double kWideRowsMinAverage = 128.0;
// A batch of 2-4 rows (fp32) runs wide_rows under the same conditions, with the whole batch in one
// tile. Measured on the H200 at N = 2 and 4 over the five shapes of the grid
// (bench/results/gpu_session15_nvidia_h200.log, call 1), this rule and the global_x / global_xt rules
// below take uniform rows 1.51x faster in geomean than smem_x, chosen there before (1.11-2.23x;
// within 0.88x of the fastest variant on every row), power-law rows 1.35x (0.92-1.99x). Groups of 2
// rows would win on 5000x5000 uniform (up to 1.13x over global_x) but lose up to 1.85x on its
// power-law rows. A tile of 8 fp32 rows gathers 32 bytes per slot from shared memory, whose random
// columns cause 5.4-way bank conflicts (Nsight Compute, call 2: 4.4 M shared-load wavefronts, twice
// the tile of 4): 16384x4096 at 90%, N = 8, 40.7 us against 39.4 us for global_xt, hence
// kWideMaxGatherBytes. In bf16 a tile of 8 rows is one 16-byte gather (call 3: 25.9 us against 34.1 us
// for global_xt at N = 8).
constexpr size_t kWideMaxGatherBytes = 16;

// Products whose slot arrays and input take at most this many bytes are bound by the latency of
// their first misses rather than by bandwidth: their blocks first prefetch W (and X) into L2.
// Measured on the H200 over the benchmark grid (session 5): 8 MiB gave 1.2% more than 64 MiB.
constexpr int64_t kPrefetchMaxBytes = int64_t(8) << 20;

size_t smem_for(int batch_tile, int64_t in_dim, size_t value_bytes) {
  return size_t(batch_tile) * size_t(detail::shared_x_stride(in_dim)) * value_bytes;
}

// The transposed copy of X: per batch tile, in_dim rows and the zero slot (see spmm_rows_kernel).
size_t transposed_bytes(int64_t in_dim, int64_t n, int batch_tile, size_t value_bytes) {
  return size_t(in_dim + 1) * size_t((n + batch_tile - 1) / batch_tile * batch_tile) * value_bytes;
}

// Dynamic shared memory the smem_x variant may use, next to the kernel's static buffers.
size_t smem_budget(const DeviceLimits& limits) {
  return limits.smem_per_block > detail::kRowsKernelStaticSmem ? limits.smem_per_block - detail::kRowsKernelStaticSmem
                                                                : 0;
}

// Dynamic shared memory of one wide_rows block: the batch tile of X and the lanes' partial sums
// (8-byte for fp64); its static buffers come on top (detail::wide_rows_static_smem).
size_t wide_rows_dynamic_smem(int64_t in_dim, size_t value_bytes, int tile, int rows_per_warp) {
  return detail::wide_rows_smem_bytes(value_bytes, value_bytes == 8 ? 8 : 4, in_dim, tile, rows_per_warp);
}

// Blocks of the wide_rows kernel that one SM holds: 32 warps by its register bound, fewer where
// shared memory runs out first (1 KiB of each block's share is the system's).
int wide_rows_blocks_per_sm(size_t block_smem, int tile, const DeviceLimits& limits) {
  const size_t by_registers = detail::kWideWarpsPerSm * 32 / detail::wide_rows_threads(tile);
  return int(std::max<size_t>(1, std::min<size_t>(by_registers, limits.smem_per_sm / (block_smem + 1024))));
}

// How a wide_rows launch runs a product: its batch tile, rows per warp group, dynamic shared memory
// per block and blocks per SM; tile 0 where not even one row of X fits in shared memory.
struct WideRowsShape {
  int tile = 0;
  int rows_per_warp = 1;
  size_t smem = 0;
  int blocks_per_sm = 0;
};

// The widest batch tile that fits (a power of two, at most the batch and kWideMaxTile; 1 for fp64,
// which only the gradient checks use), with as few rows per warp group as still give every warp of
// the SMs a group (one wave), at most kWideMaxRows and at most what shared memory holds beside the
// tile (a longer group would only lengthen the slowest warp).
WideRowsShape wide_rows_shape(int64_t out_dim, int64_t in_dim, int64_t n, size_t value_bytes,
                              const DeviceLimits& limits) {
  const int64_t warps = int64_t(limits.sms) * detail::kWideWarpsPerSm;
  const int wanted_rows = int(std::clamp<int64_t>(detail::ceil_div(out_dim, warps), 1, detail::kWideMaxRows));
  const int widest = value_bytes == 8 ? 1 : next_pow2(std::clamp<int64_t>(n, 1, detail::kWideMaxTile));
  for (int tile = widest; tile >= 1; tile /= 2) {
    for (int rows = wanted_rows; rows >= 1; --rows) {
      WideRowsShape shape;
      shape.smem = wide_rows_dynamic_smem(in_dim, value_bytes, tile, rows);
      const size_t block = shape.smem + detail::wide_rows_static_smem(tile);
      if (block > limits.smem_per_block) continue;
      shape.tile = tile;
      shape.rows_per_warp = rows;
      shape.blocks_per_sm = wide_rows_blocks_per_sm(block, tile, limits);
      return shape;
    }
  }
  return {};
}

template <typename T, typename Index, int kTile>
Status launch_wide_rows_tile(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* values, const T* x, int64_t n,
                             const T* bias, T* y, Activation act, Stream stream, size_t smem, int blocks_per_sm,
                             const DeviceLimits& limits) {
  auto kernel = detail::spmm_wide_rows_kernel<T, Index, kTile>;
  if (smem + detail::wide_rows_static_smem(kTile) > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t groups = detail::ceil_div(w.rows, plan.rows_per_warp);
  const int64_t resident = int64_t(limits.sms) * blocks_per_sm;
  constexpr int64_t kWarps = detail::wide_rows_threads(kTile) / 32;
  const unsigned blocks = unsigned(std::max<int64_t>(1, std::min(resident, detail::ceil_div(groups, kWarps))));
  const bool vec = reinterpret_cast<uintptr_t>(values) % 16 == 0 && reinterpret_cast<uintptr_t>(w.col_idx) % 16 == 0;
  const int64_t tiles = detail::ceil_div(n, kTile);
  for (int64_t t0 = 0; t0 < tiles; t0 += 65535) {
    const unsigned count = unsigned(std::min<int64_t>(65535, tiles - t0));
    kernel<<<dim3(blocks, count), detail::wide_rows_threads(kTile), smem, stream>>>(
        w.row_ptr, w.col_idx, values, int32_t(w.nnz), w.rows, w.cols, x, n, t0 * kTile, bias, y, act,
        plan.rows_per_warp, plan.long_row_threshold, vec);
    SNACK_RETURN_IF_ERROR(check_launch("spmm_wide_rows_kernel"));
  }
  return Status::Ok();
}

// The wide_rows kernel: per batch tile (grid.y), enough blocks for the row groups, at most as many as
// the SMs hold at once (their warps then stride over the groups). check_plan has vetted the tile and
// the rows per warp.
template <typename T, typename Index>
Status launch_wide_rows(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* values, const T* x, int64_t n,
                        const T* bias, T* y, Activation act, Stream stream) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  const int tile = plan.batch_tile;
  const size_t smem = wide_rows_dynamic_smem(w.cols, sizeof(T), tile, plan.rows_per_warp);
  const int blocks_per_sm = wide_rows_blocks_per_sm(smem + detail::wide_rows_static_smem(tile), tile, limits);
  const auto launch = [&](auto tile_constant) {
    return launch_wide_rows_tile<T, Index, decltype(tile_constant)::value>(plan, w, values, x, n, bias, y, act, stream,
                                                                          smem, blocks_per_sm, limits);
  };
  if constexpr (sizeof(T) == 8) {
    return launch(std::integral_constant<int, 1>{});  // fp64 runs a tile of 1
  } else {
    switch (tile) {
      case 1: return launch(std::integral_constant<int, 1>{});
      case 2: return launch(std::integral_constant<int, 2>{});
      case 4: return launch(std::integral_constant<int, 4>{});
      default: return launch(std::integral_constant<int, 8>{});
    }
  }
}

using detail::XLayout;

// Launch arguments of the row kernels besides the operands: W's entry count (for the L2 prefetch
// of small products) and whether the kernel follows the transpose of its input in the stream.
struct RowsLaunch {
  int64_t nnz = 0;
  bool after_transpose = false;
};

template <typename T, typename View, int NPAD, XLayout kX>
Status launch_rows(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                   const T* bias, T* out, Activation act, Stream stream, RowsLaunch rl) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(device_limits(&limits));
  constexpr bool kSmem = kX == XLayout::kShared;
  auto kernel = detail::spmm_rows_kernel<T, View, NPAD, kX>;
  constexpr int kWarps = kSmem ? detail::kSpmmSmemWarps : kSpmmWarps;
  const int rows_per_warp = detail::TileLayout<NPAD>::GS / plan.lanes_per_row;
  const int64_t warps = detail::ceil_div(out_dim, rows_per_warp);
  int64_t blocks = detail::ceil_div(warps, kWarps);
  int per_sm = 2048 / (kWarps * 32);
  if (kSmem) {
    if (plan.smem_bytes > 48 * 1024) {
      SNACK_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
    }
    per_sm = std::max<int>(1, std::min<int>(per_sm, int(limits.smem_per_sm / (plan.smem_bytes + 1024))));
  }
  // Persistent-style grid: every block stages its batch tile once, then strides over the rows;
  // grid.y runs the batch tiles side by side.
  const int64_t tiles = detail::ceil_div(n, NPAD);
  if (tiles > kMaxGridY)
    return InvalidArgument("batch too large for a batch tile of " + std::to_string(NPAD) + ": " + std::to_string(n) +
                           " rows");
  const int64_t slots = std::max<int64_t>(1, int64_t(limits.sms) * per_sm / tiles);
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, slots));
  const int64_t prefetch_nnz = plan.prefetch_l2 ? rl.nnz : 0;
  const dim3 grid{unsigned(blocks), unsigned(tiles)};
  const size_t smem = kSmem ? plan.smem_bytes : 0;
  if (rl.after_transpose) {
    // Programmatic dependent launch: the kernel starts while the transpose still runs, prefetches
    // W, and waits for the transpose before it reads X^T. This hides most of the gap between the
    // two launches, which small products feel (measured on the H200, session 5: global_xt 8% faster
    // over the benchmark grid together with the L2 prefetch).
    SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(kernel, grid, dim3(kWarps * 32), smem, stream, view, out_dim,
                                                           in_dim, in, n, bias, out, plan.lanes_per_row,
                                                           plan.long_row_threshold, act, prefetch_nnz));
  } else {
    kernel<<<grid, kWarps * 32, smem, stream>>>(view, out_dim, in_dim, in, n, bias, out, plan.lanes_per_row,
                                                 plan.long_row_threshold, act, prefetch_nnz);
  }
  return check_launch(kSmem ? "spmm_rows_kernel<shared X>"
                            : (kX == XLayout::kRowMajor ? "spmm_rows_kernel<X in place>" : "spmm_rows_kernel<X^T>"));
}

template <typename T, typename View, XLayout kX>
Status launch_rows_tile(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                        const T* bias, T* out, Activation act, Stream stream, RowsLaunch rl) {
  switch (plan.batch_tile) {
    case 1:
      // One-row tiles of the transposed layout run as kRowMajor (run_plan): not instantiated here.
      if constexpr (kX != XLayout::kTransposed)
        return launch_rows<T, View, 1, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
      break;
    case 2: return launch_rows<T, View, 2, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case 4: return launch_rows<T, View, 4, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case 8: return launch_rows<T, View, 8, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case 16: return launch_rows<T, View, 16, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case 32: return launch_rows<T, View, 32, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    default:
      // Tiles of 64 and 128 only for the transposed copy: the other layouts stop at 32 (shared
      // memory; scalar reads of X, planned only for small products), which bounds the instantiations.
      if constexpr (kX == XLayout::kTransposed) {
        if (plan.batch_tile == 64)
          return launch_rows<T, View, 64, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
        if (plan.batch_tile == 128)
          return launch_rows<T, View, 128, kX>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
      }
      break;
  }
  return InvalidArgument("unsupported batch tile " + std::to_string(plan.batch_tile));
}

// Runs one product out[n, o] = sum value * in[n, input] over a view, as the plan says.
template <typename T, typename View>
Status run_plan(const SpmmPlan& plan, View view, int64_t nnz, int64_t out_dim, int64_t in_dim, const T* in,
                int64_t n, const T* bias, T* out, void* workspace, Stream stream, Activation act) {
  RowsLaunch rl{nnz, false};
  if (n == 0 || out_dim == 0) return Status::Ok();
  switch (plan.variant) {
    case SpmmVariant::kWarpRow: {
      const unsigned grid = detail::grid_for(out_dim, kSpmmWarps);
      if (n == 1)
        detail::spmm_warp_row_kernel<T, View, 1><<<grid, kSpmmWarps * 32, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      else if (n <= 4)
        detail::spmm_warp_row_kernel<T, View, 4><<<grid, kSpmmWarps * 32, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      else
        detail::spmm_warp_row_kernel<T, View, 8><<<grid, kSpmmWarps * 32, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      return check_launch("spmm_warp_row_kernel");
    }
    case SpmmVariant::kSmemX:
      return launch_rows_tile<T, View, XLayout::kShared>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case SpmmVariant::kGlobalX:
      return launch_rows_tile<T, View, XLayout::kRowMajor>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case SpmmVariant::kGlobalXT: {
      // A one-row batch tile transposed is the row itself: that is global_x's in-place read.
      if (plan.batch_tile == 1)
        return launch_rows_tile<T, View, XLayout::kRowMajor>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
      const int64_t tiles = detail::ceil_div(n, plan.batch_tile);
      if (workspace == nullptr || plan.workspace_bytes < transposed_bytes(in_dim, n, plan.batch_tile, sizeof(T)))
        return InvalidArgument("global_xt: the workspace is missing or too small for this batch");
      T* in_t = static_cast<T*>(workspace);
      const dim3 tgrid(unsigned(detail::ceil_div(in_dim + 1, 32)), unsigned(detail::ceil_div(plan.batch_tile, 32)),
                       unsigned(tiles));
      detail::transpose_tile_kernel<T><<<tgrid, dim3(32, 8), 0, stream>>>(in, n, in_dim, in_dim + 1, plan.batch_tile,
                                                                         in_t, detail::StepCounts{});
      SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel"));
      rl.after_transpose = true;
      return launch_rows_tile<T, View, XLayout::kTransposed>(plan, view, out_dim, in_dim, in_t, n, bias, out, act, stream,
                                                             rl);
    }
    default:
      return InvalidArgument(std::string("variant ") + spmm_variant_name(plan.variant) + " cannot run this product");
  }
}

}  // namespace

SpmmPlan plan_spmm(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, size_t value_bytes,
                   SpmmVariant requested, bool transposed) {
  SpmmPlan plan;
  DeviceLimits limits;
  if (!device_limits(&limits).ok()) limits = DeviceLimits{1, 48 * 1024, 48 * 1024};
  const double avg = out_dim > 0 ? double(nnz) / double(out_dim) : 0.0;
  const WideRowsShape wide = transposed ? WideRowsShape{} : wide_rows_shape(out_dim, in_dim, n, value_bytes, limits);
  SpmmVariant v = requested;
  if (v == SpmmVariant::kAuto) {
    // Measured on the H200 (bench/results/spmm_nvidia_h200.md; batches of 2-4:
    // bench/results/gpu_session15_nvidia_h200.log): a single row of a large product streams W
    // fastest with wide_rows (kWideRowsMinRowsPerWarp); otherwise it is read in place through L1
    // (staging it in shared memory costs a round trip and a block barrier before the first product,
    // about as long as the whole product at 99% sparsity). A batch of 2-4 rows runs wide_rows under
    // the same conditions, with the whole batch in one tile, while each slot's gather from the tile
    // is one 16-byte vector (kWideMaxGatherBytes; a wider one is bound by the banks of shared
    // memory). Otherwise X is read in place where it is small enough to stay in L1 or the product is
    // tiny (kGlobalXMaxBytes, kTinyProduct), and transposed once (read through L1) where it is not.
    // smem_x, chosen for 2-4 rows until session 15, is never chosen: measured at N = 2 and 4 over the
    // grid's shapes (bench/results/gpu_session15_nvidia_h200.log, calls 1 and 5), the rules above
    // run the forward 1.51x and the transposed product 1.32x faster in geomean on uniform rows (up
    // to 2.3x; the transposed product loses up to 16% on uniform and 22% on power-law rows of
    // 4096x4096 and 5000x5000 at 80-90%, N = 2).
    const bool wide_full = wide.tile > 0 && wide.blocks_per_sm * detail::wide_rows_threads(wide.tile) ==
                                                 detail::kWideWarpsPerSm * 32;  // 32 warps per SM
    if (wide_full && wide.tile >= n && size_t(wide.tile) * value_bytes <= kWideMaxGatherBytes &&
        wide.rows_per_warp >= kWideRowsMinRowsPerWarp && avg >= kWideRowsMinAverage) {
      v = SpmmVariant::kWideRows;
      plan.reason = "batch of " + std::to_string(n) + ", " + std::to_string(out_dim) + " rows of " +
                    std::to_string(int64_t(avg)) +
                    " slots on average: a warp per group of rows reads their slots with 16-byte loads, " +
                    (n == 1 ? "X's row" : "the batch") + " in shared memory";
    } else if (n == 1) {
      v = SpmmVariant::kGlobalX;
      plan.reason = "batch of 1: X read in place through L1";
    } else if ((n <= kGlobalXMaxBatch && n * in_dim * int64_t(value_bytes) <= kGlobalXMaxBytes) ||
               (n <= 32 && nnz * n <= kTinyProduct)) {
      v = SpmmVariant::kGlobalX;
      plan.reason = "small X (" + std::to_string(n * in_dim * int64_t(value_bytes)) + " B) or product (" +
                    std::to_string(nnz * n) + " multiply-adds): X read in place through L1, no transpose launch";
    } else {
      v = SpmmVariant::kGlobalXT;
      plan.reason = "X transposed once, 16-byte vectors of it read through L1";
    }
  } else {
    plan.reason = "forced";
  }
  plan.variant = v;
  switch (v) {
    case SpmmVariant::kSmemX:
      plan.batch_tile = next_pow2(std::max<int64_t>(1, std::min<int64_t>(n, 32)));
      plan.smem_bytes = smem_for(plan.batch_tile, in_dim, value_bytes);
      break;
    case SpmmVariant::kGlobalX:
    case SpmmVariant::kGlobalXT: {
      // The largest batch tile that still gives the GPU enough warps (few output rows, large
      // batch: split the batch into more tiles rather than leave SMs idle).
      const int64_t max_tile = v == SpmmVariant::kGlobalXT ? 128 : 32;
      int tile = next_pow2(std::max<int64_t>(1, std::min<int64_t>(n, max_tile)));
      while (tile > 8 && warps_for(out_dim, (n + tile - 1) / tile, tile, max_lanes_per_row(tile, avg)) <
                             wanted_warps(limits))
        tile >>= 1;
      plan.batch_tile = tile;
      if (v == SpmmVariant::kGlobalXT && tile > 1) plan.workspace_bytes = transposed_bytes(in_dim, n, tile, value_bytes);
      break;
    }
    case SpmmVariant::kWarpRow:
      plan.batch_tile = n <= 1 ? 1 : (n <= 4 ? 4 : 8);
      break;
    case SpmmVariant::kWideRows:
      if (wide.tile > 0) {
        plan.batch_tile = wide.tile;
        plan.rows_per_warp = wide.rows_per_warp;
        plan.smem_bytes = wide.smem;
      } else {  // the launch says what does not fit
        plan.batch_tile = 1;
        plan.rows_per_warp = 1;
        plan.smem_bytes = wide_rows_dynamic_smem(in_dim, value_bytes, 1, 1);
      }
      break;
    default:
      plan.batch_tile = 1;
      break;
  }
  plan.lanes_per_row = v == SpmmVariant::kWarpRow || v == SpmmVariant::kWideRows
                           ? 32
                           : lanes_per_row_for(v, plan.batch_tile, avg, out_dim,
                                               (n + plan.batch_tile - 1) / plan.batch_tile, transposed, limits);
  // An estimate (4-byte indices, no csc_perm): the threshold separates latency- from bandwidth-bound.
  const int64_t operand_bytes = nnz * int64_t(value_bytes + sizeof(int32_t)) + n * in_dim * int64_t(value_bytes);
  plan.prefetch_l2 = v != SpmmVariant::kWarpRow && v != SpmmVariant::kCooAtomic && v != SpmmVariant::kWideRows &&
                     operand_bytes <= kPrefetchMaxBytes;
  // A row this long is summed by a whole block rather than one warp (skewed row lengths).
  plan.long_row_threshold = int32_t(std::min<double>(1 << 30, std::max(1024.0, 4.0 * avg)));
  return plan;
}

bool plan_transposes_whole_input(const SpmmPlan& plan, int64_t n) {
  return plan.variant == SpmmVariant::kGlobalXT && plan.batch_tile > 1 && n >= 1 && n <= plan.batch_tile;
}

std::string describe(const SpmmPlan& plan) {
  if (plan.variant == SpmmVariant::kWideRows)
    return "wide_rows (batch tile " + std::to_string(plan.batch_tile) + ", " + std::to_string(plan.rows_per_warp) +
           " rows per warp, " +
           std::to_string(plan.smem_bytes) + " B shared memory): " + plan.reason;
  std::string s = std::string(spmm_variant_name(plan.variant)) + " (batch tile " + std::to_string(plan.batch_tile) +
                  ", " + std::to_string(plan.lanes_per_row) + " lanes per row";
  if (plan.smem_bytes) s += ", " + std::to_string(plan.smem_bytes) + " B shared memory";
  if (plan.workspace_bytes) s += ", " + std::to_string(plan.workspace_bytes) + " B workspace";
  if (plan.prefetch_l2) s += ", L2 prefetch";
  return s + "): " + plan.reason;
}

Status check_plan(const SpmmPlan& plan, int64_t in_dim, size_t value_bytes, bool forward) {
  if (plan.variant == SpmmVariant::kAuto) return InvalidArgument("plan the product first (variant auto)");
  if (!forward && spmm_variant_is_forward_only(plan.variant))
    return InvalidArgument(std::string(spmm_variant_name(plan.variant)) + " runs only the forward product");
  if (plan.variant == SpmmVariant::kSmemX) {
    DeviceLimits limits;
    SNACK_RETURN_IF_ERROR(device_limits(&limits));
    if (plan.batch_tile > 32 || smem_for(plan.batch_tile, in_dim, value_bytes) > smem_budget(limits))
      return InvalidArgument("smem_x: a " + std::to_string(plan.batch_tile) + " x " + std::to_string(in_dim) +
                             " tile of X does not fit in shared memory");
  }
  if (plan.variant == SpmmVariant::kWideRows) {
    const int tile = plan.batch_tile;
    if (tile < 1 || tile > detail::kWideMaxTile || (tile & (tile - 1)) || (value_bytes == 8 && tile != 1))
      return InvalidArgument("wide_rows: the batch tile must be 1, 2, 4 or 8 (1 for float64)");
    if (plan.rows_per_warp < 1 || plan.rows_per_warp > detail::kWideMaxRows)
      return InvalidArgument("wide_rows: rows per warp must be in [1, " + std::to_string(detail::kWideMaxRows) + "]");
    DeviceLimits limits;
    SNACK_RETURN_IF_ERROR(device_limits(&limits));
    if (wide_rows_dynamic_smem(in_dim, value_bytes, tile, plan.rows_per_warp) + detail::wide_rows_static_smem(tile) >
        limits.smem_per_block)
      return InvalidArgument("wide_rows: a batch tile of " + std::to_string(tile) + " x " + std::to_string(in_dim) +
                             " values of X and the partial sums of " + std::to_string(plan.rows_per_warp) +
                             " rows per warp do not fit in shared memory");
  }
  return Status::Ok();
}

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    const SpmmPlan& plan, void* workspace, Stream stream, Activation act) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"x", required_if(n * w.cols > 0, x)}, {"y", required_if(n * w.rows > 0, y)}}));
  SNACK_RETURN_IF_ERROR(check_plan(plan, w.cols, sizeof(T), true));
  if (n == 0 || w.rows == 0) return Status::Ok();
  if (plan.variant == SpmmVariant::kCooAtomic) {
    detail::fill_rows_kernel<T><<<detail::grid_for(n * w.rows, 256, 4096), 256, 0, stream>>>(y, bias, n, w.rows);
    SNACK_RETURN_IF_ERROR(check_launch("fill_rows_kernel"));
    if (w.nnz == 0) return Status::Ok();
    const unsigned gx = unsigned(detail::ceil_div(w.nnz, 256 * detail::kCooItems));
    for (int64_t b0 = 0; b0 < n; b0 += 65535) {
      const unsigned gy = unsigned(std::min<int64_t>(65535, n - b0));
      detail::spmm_coo_atomic_kernel<T, Index><<<dim3(gx, gy), 256, 0, stream>>>(w, values, x, b0, y);
      SNACK_RETURN_IF_ERROR(check_launch("spmm_coo_atomic_kernel"));
    }
    if (act != Activation::kNone) {
      detail::activation_kernel<T><<<detail::grid_for(n * w.rows, 256, 4096), 256, 0, stream>>>(y, n * w.rows, act);
      SNACK_RETURN_IF_ERROR(check_launch("activation_kernel"));
    }
    return Status::Ok();
  }
  if (plan.variant == SpmmVariant::kWideRows) return launch_wide_rows<T, Index>(plan, w, values, x, n, bias, y, act, stream);
  CsrView<T, Index> view{w.row_ptr, w.col_idx, values};
  return run_plan<T>(plan, view, w.nnz, w.rows, w.cols, x, n, bias, y, workspace, stream, act);
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       const SpmmPlan& plan, void* workspace, Stream stream) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"dy", required_if(n * w.rows > 0, dy)}, {"dx", required_if(n * w.cols > 0, dx)}}));
  SNACK_RETURN_IF_ERROR(check_plan(plan, w.rows, sizeof(T), false));
  CscView<T, Index> view{w.col_ptr, w.csc_perm, w.row_idx, values};
  return run_plan<T>(plan, view, w.nnz, w.cols, w.rows, dy, n, static_cast<const T*>(nullptr), dx, workspace,
                     stream, Activation::kNone);
}

namespace {
// The plan-free entry points: plan automatically, take the workspace from cudaMallocAsync.
struct AsyncWorkspace {
  void* ptr = nullptr;
  Stream stream;
  explicit AsyncWorkspace(Stream s) : stream(s) {}
  ~AsyncWorkspace() {
    if (ptr) (void)cudaFreeAsync(ptr, stream);
  }
  Status reserve(size_t bytes) {
    if (bytes == 0) return Status::Ok();
    return detail::cuda_status(cudaMallocAsync(&ptr, bytes, stream), "cudaMallocAsync(spmm workspace)");
  }
};
}  // namespace

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Stream stream, Activation act) {
  const SpmmPlan plan = plan_spmm(w.rows, w.cols, w.nnz, n, sizeof(T), SpmmVariant::kAuto);
  AsyncWorkspace ws(stream);
  SNACK_RETURN_IF_ERROR(ws.reserve(plan.workspace_bytes));
  return spmm_forward(w, values, x, n, bias, y, plan, ws.ptr, stream, act);
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx, Stream stream) {
  const SpmmPlan plan = plan_spmm(w.cols, w.rows, w.nnz, n, sizeof(T), SpmmVariant::kAuto, true);
  AsyncWorkspace ws(stream);
  SNACK_RETURN_IF_ERROR(ws.reserve(plan.workspace_bytes));
  return spmm_transposed(w, values, dy, n, dx, plan, ws.ptr, stream);
}

#define SNACK_INSTANTIATE_SPMM(T, Index)                                                                         \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         const SpmmPlan&, void*, Stream, Activation);                            \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*,          \
                                            const SpmmPlan&, void*, Stream);                                     \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         Stream, Activation);                                                    \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);

SNACK_INSTANTIATE_SPMM(float, uint16_t)
SNACK_INSTANTIATE_SPMM(float, int32_t)
SNACK_INSTANTIATE_SPMM(double, uint16_t)
SNACK_INSTANTIATE_SPMM(double, int32_t)
SNACK_INSTANTIATE_SPMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_SPMM(bfloat16, int32_t)
SNACK_INSTANTIATE_SPMM(float16, uint16_t)
SNACK_INSTANTIATE_SPMM(float16, int32_t)

}  // namespace cuda
}  // namespace snack
