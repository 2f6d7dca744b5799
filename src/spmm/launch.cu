// The CUDA SpMM products (forward and transposed): a plan from plan.cpp, launched.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/tensor_map.h"
#include "../device/transpose.cuh"
#include "csc_copy_kernel.cuh"
#include "expand_kernel.cuh"
#include "fragment_kernel.cuh"
#include "reference_kernels.cuh"
#include "rows_kernel.cuh"
#include "shared_x_kernel.cuh"
#include "tensor_core_kernel.cuh"
#include "tile_view_kernel.cuh"
#include "snack/spmm.h"
#include "wgmma.h"
#include "wide_rows_kernel.cuh"

namespace snack::cuda {
namespace {

using detail::check_launch;
using detail::CscView;
using detail::CsrView;
using detail::kMaxGridY;  // batch tiles (or batch rows) side by side in grid.y per launch
using detail::kSpmmWarps;
using detail::XLayout;

template <typename T, typename Index, int kTile>
Status launch_wide_rows_tile(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* values, const T* x, int64_t n,
                             const T* bias, T* y, Activation act, Stream stream) {
  auto kernel = detail::spmm_wide_rows_kernel<T, Index, kTile>;
  if (plan.smem_bytes + detail::wide_rows_static_smem(kTile) > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const bool vec = reinterpret_cast<uintptr_t>(values) % 16 == 0 && reinterpret_cast<uintptr_t>(w.col_idx) % 16 == 0;
  const int64_t tiles = detail::ceil_div(n, kTile);
  for (int64_t t0 = 0; t0 < tiles; t0 += kMaxGridY) {
    const unsigned count = unsigned(std::min<int64_t>(kMaxGridY, tiles - t0));
    kernel<<<dim3(unsigned(plan.grid_x), count), plan.threads, plan.smem_bytes, stream>>>(
        w.row_ptr, w.col_idx, values, int32_t(w.nnz), w.rows, w.cols, x, n, t0 * kTile, bias, y, act,
        plan.rows_per_warp, plan.long_row_threshold, vec);
    SNACK_RETURN_IF_ERROR(check_launch("spmm_wide_rows_kernel"));
  }
  return Status::Ok();
}

// The wide_rows kernel: per batch tile (grid.y), the plan's blocks (at most as many as the SMs hold
// at once; their warps stride over the row groups).
template <typename T, typename Index>
Status launch_wide_rows(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* values, const T* x, int64_t n,
                        const T* bias, T* y, Activation act, Stream stream) {
  if constexpr (sizeof(T) == 8) {
    return launch_wide_rows_tile<T, Index, 1>(plan, w, values, x, n, bias, y, act, stream);  // fp64: a tile of 1
  } else {
    switch (plan.batch_tile) {
      case 1: return launch_wide_rows_tile<T, Index, 1>(plan, w, values, x, n, bias, y, act, stream);
      case 2: return launch_wide_rows_tile<T, Index, 2>(plan, w, values, x, n, bias, y, act, stream);
      case 4: return launch_wide_rows_tile<T, Index, 4>(plan, w, values, x, n, bias, y, act, stream);
      case 8: return launch_wide_rows_tile<T, Index, 8>(plan, w, values, x, n, bias, y, act, stream);
      default:
        if constexpr (detail::wide_max_tile(sizeof(T)) == 16) {
          return launch_wide_rows_tile<T, Index, 16>(plan, w, values, x, n, bias, y, act, stream);
        } else {
          return InvalidArgument("wide_rows: a batch tile of " + std::to_string(plan.batch_tile) + " rows");
        }
    }
  }
}

// Launch arguments of the row kernels besides the operands: W's entry count (for the L2 prefetch
// of small products) and whether the kernel follows the transpose of its input in the stream.
struct RowsLaunch {
  int64_t nnz = 0;
  bool after_transpose = false;
};

template <typename T, typename View, int NPAD, XLayout kX>
Status launch_rows(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                   const T* bias, T* out, Activation act, Stream stream, RowsLaunch rl) {
  auto kernel = detail::spmm_rows_kernel<T, View, NPAD, kX>;
  const dim3 grid{unsigned(plan.grid_x), unsigned(detail::ceil_div(n, NPAD))};
  const int64_t prefetch_nnz = plan.prefetch_l2 ? rl.nnz : 0;
  if (rl.after_transpose) {
    // Programmatic dependent launch: the kernel starts while the transpose still runs, prefetches
    // W, and waits for the transpose before it reads X^T. This hides most of the gap between the
    // two launches, which small products feel (measured on the H200: global_xt 8% faster over the
    // benchmark grid together with the L2 prefetch).
    SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(kernel, grid, dim3(plan.threads), 0, stream, view, out_dim,
                                                           in_dim, in, n, bias, out, plan.lanes_per_row,
                                                           plan.long_row_threshold, act, prefetch_nnz));
  } else {
    kernel<<<grid, plan.threads, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, plan.lanes_per_row,
                                              plan.long_row_threshold, act, prefetch_nnz);
  }
  return check_launch(kX == XLayout::kRowMajor ? "spmm_rows_kernel<X in place>" : "spmm_rows_kernel<X^T>");
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
      // Tiles of 64 and 128 only for the transposed copy: X read in place stops at 32 (scalar reads of
      // X, planned only for small products), which bounds the instantiations.
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

template <typename T, typename View, int NT>
Status launch_tensor_core_tile(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in,
                               int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  auto kernel = detail::spmm_tensor_core_kernel<T, View, NT>;
  const size_t smem = detail::tensor_core_smem_bytes(NT);
  if (smem > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const bool vec = detail::rows_of_16byte_vectors(in, in_dim);
  const dim3 grid(unsigned(plan.grid_x), unsigned(detail::ceil_div(n, NT)));
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_clusters_x(kernel, grid, dim3(detail::kTcThreads), smem, stream,
                                                       unsigned(plan.k_splits), view, out_dim, in_dim, in, n, bias,
                                                       out, act, plan.k_splits, vec));
  return check_launch("spmm_tensor_core_kernel");
}

// The plan's batch tile: 16-128 rows.
template <typename T, typename View>
Status launch_tensor_core(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                          const T* bias, T* out, Activation act, Stream stream) {
  if constexpr (kIsHalfType<T>) {
    if (plan.chunk != detail::kTcChunk)
      return InvalidArgument("tensor_core: unsupported chunk of " + std::to_string(plan.chunk) + " columns");
    switch (plan.batch_tile) {
      case 16: return launch_tensor_core_tile<T, View, 16>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      case 32: return launch_tensor_core_tile<T, View, 32>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      case 64: return launch_tensor_core_tile<T, View, 64>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      case 128: return launch_tensor_core_tile<T, View, 128>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      default:
        return InvalidArgument("tensor_core: unsupported batch tile " + std::to_string(plan.batch_tile));
    }
  } else {
    return InvalidArgument("tensor_core runs 16-bit values (bfloat16, float16) only");
  }
}

template <typename T, int NT, bool kTransposed, bool kPacked>
Status launch_tile_view_tile(const SpmmPlan& plan, const detail::TileView& view, const T* values, int64_t out_dim,
                             int64_t in_dim, const T* in, int64_t n, const T* bias, T* out, Activation act,
                             Stream stream) {
  auto kernel = detail::spmm_tile_view_kernel<T, NT, kTransposed, kPacked>;
  if (plan.smem_bytes > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const bool vec = detail::rows_of_16byte_vectors(in, in_dim);
  const dim3 grid(unsigned(plan.grid_x), unsigned(detail::ceil_div(n, NT)));
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_clusters_x(kernel, grid, dim3(detail::kTcThreads), plan.smem_bytes, stream,
                                                       unsigned(plan.k_splits), view, values, out_dim, in_dim, in, n,
                                                       bias, out, act, plan.k_splits, vec));
  return check_launch("spmm_tile_view_kernel");
}

// The product over the pattern's tile view, batch tiles of 16-64 rows: the forward (y = act(x W^T +
// bias)), or with kTransposed dX = dY W (in = dY, out = dX, no bias). kPacked (the forward): the
// kernel reads `packed` (packed tile values) in place of the view's entries and the values.
template <typename T, typename Index, bool kTransposed, bool kPacked = false>
Status launch_tile_view(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* values, const T* in, int64_t n,
                        const T* bias, T* out, Activation act, Stream stream, const uint32_t* packed = nullptr) {
  if constexpr (kIsHalfType<T>) {
    detail::TileView view;
    SNACK_RETURN_IF_ERROR(detail::tile_view_of(w, "tile_view", &view));
    if constexpr (kPacked) {
      if (reinterpret_cast<uintptr_t>(packed) % 16 != 0)
        return InvalidArgument("tile_view: packed tile values must start on a 16-byte boundary");
      view.entries = packed;
    }
    const int64_t out_dim = kTransposed ? w.cols : w.rows, in_dim = kTransposed ? w.rows : w.cols;
    switch (plan.batch_tile) {
      case 16:
        return launch_tile_view_tile<T, 16, kTransposed, kPacked>(plan, view, values, out_dim, in_dim, in, n, bias,
                                                                  out, act, stream);
      case 32:
        return launch_tile_view_tile<T, 32, kTransposed, kPacked>(plan, view, values, out_dim, in_dim, in, n, bias,
                                                                  out, act, stream);
      case 64:
        return launch_tile_view_tile<T, 64, kTransposed, kPacked>(plan, view, values, out_dim, in_dim, in, n, bias,
                                                                  out, act, stream);
      default: return InvalidArgument("tile_view: unsupported batch tile " + std::to_string(plan.batch_tile));
    }
  } else {
    return InvalidArgument("tile_view runs 16-bit values (bfloat16, float16) only");
  }
}

template <typename T, int NT>
Status launch_fragments_tile(const SpmmPlan& plan, const detail::FragmentView& view, int64_t out_dim, int64_t in_dim,
                             const T* in, int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  return detail::launch_fragment_kernel<NT>(detail::spmm_fragment_kernel<T, NT>, "spmm_fragment_kernel", plan, view,
                                            out_dim, in_dim, in, n, bias, out, act, stream);
}

// The forward over tile fragments (snack/pattern.h, the words pack_tile_fragments wrote for these
// values and this pattern): kTileView's mma.sync kernel in batch tiles of 16, 32 or 64 rows, or
// kWgmma's in batch tiles of 16 to 128. Transposed: dX = dY W as the forward of W^T over W^T's
// fragments (in: dY, out: dX), whose layout has W's offsets and W^T's tiles (W's rows as chunks).
template <typename T, typename Index>
Status launch_fragments(const SpmmPlan& plan, const SlotPattern<Index>& w, const T* in, int64_t n, const T* bias,
                        T* out, Activation act, Stream stream, const uint32_t* fragments, bool transposed = false) {
  if constexpr (kIsHalfType<T>) {
    if (tile_view_ptr_length(w.rows, w.cols) == 0)
      return InvalidArgument(std::string(spmm_variant_name(plan.variant)) +
                             ": tile fragments need a pattern with the tile view");
    if (reinterpret_cast<uintptr_t>(fragments) % 16 != 0)
      return InvalidArgument(std::string(spmm_variant_name(plan.variant)) +
                             ": tile fragments must start on a 16-byte boundary");
    const FragmentLayout layout = tile_fragment_layout(w.rows, w.cols, w.nnz);
    const int64_t out_dim = transposed ? w.cols : w.rows, in_dim = transposed ? w.rows : w.cols;
    const detail::FragmentView view{reinterpret_cast<const int2*>(fragments), fragments + layout.headers,
                                    fragments + layout.values, tile_view_chunks(in_dim)};
    if (plan.variant == SpmmVariant::kWgmma)
      return detail::launch_fragments_wgmma<T>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    switch (plan.batch_tile) {
      case 16: return launch_fragments_tile<T, 16>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      case 32: return launch_fragments_tile<T, 32>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      case 64: return launch_fragments_tile<T, 64>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
      default:
        return InvalidArgument("tile_view over tile fragments: unsupported batch tile " +
                               std::to_string(plan.batch_tile));
    }
  } else {
    return InvalidArgument("tile fragments hold 16-bit values (bfloat16, float16) only");
  }
}

// The shared_x kernel over the transposed tiles of the input (one or two 16-byte vectors of the batch
// per lane: plan.batch_tile).
template <typename T, typename View, int kVecs>
Status launch_shared_x_vectors(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in_t,
                               int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  constexpr int kWarps = detail::shared_x_warps(sizeof(T));
  auto kernel = detail::spmm_shared_x_kernel<T, View, kWarps, detail::kSharedXRowsPerWarp, kVecs>;
  SNACK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const dim3 grid{unsigned(plan.grid_x), unsigned(detail::ceil_div(n, plan.batch_tile))};
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(kernel, grid, dim3(plan.threads), plan.smem_bytes, stream,
                                                         view, out_dim, in_dim, in_t, n, bias, out, act,
                                                         plan.chunk));
  return check_launch("spmm_shared_x_kernel");
}
template <typename T, typename View>
Status launch_shared_x(const SpmmPlan& plan, View view, int64_t out_dim, int64_t in_dim, const T* in_t, int64_t n,
                       const T* bias, T* out, Activation act, Stream stream) {
  if constexpr (sizeof(T) == 8) {
    return InvalidArgument("shared_x runs float32, bfloat16 and float16 values");
  } else {
    if (plan.batch_tile == detail::shared_x_tile(sizeof(T), 1))
      return launch_shared_x_vectors<T, View, 1>(plan, view, out_dim, in_dim, in_t, n, bias, out, act, stream);
    if constexpr (detail::shared_x_max_vectors(sizeof(T)) == 2) {
      if (plan.batch_tile == detail::shared_x_tile(sizeof(T), 2))
        return launch_shared_x_vectors<T, View, 2>(plan, view, out_dim, in_dim, in_t, n, bias, out, act, stream);
    }
    return InvalidArgument("shared_x: unsupported batch tile " + std::to_string(plan.batch_tile));
  }
}

// Runs one product out[n, o] = sum value * in[n, input] over a view, as the plan says.
template <typename T, typename View>
Status run_plan(const SpmmPlan& plan, View view, int64_t nnz, int64_t out_dim, int64_t in_dim, const T* in,
                int64_t n, const T* bias, T* out, void* workspace, Stream stream, Activation act) {
  RowsLaunch rl{nnz, false};
  if (n == 0 || out_dim == 0) return Status::Ok();
  switch (plan.variant) {
    case SpmmVariant::kWarpRow: {
      const unsigned grid = unsigned(plan.grid_x);
      if (n == 1)
        detail::spmm_warp_row_kernel<T, View, 1><<<grid, plan.threads, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      else if (n <= 4)
        detail::spmm_warp_row_kernel<T, View, 4><<<grid, plan.threads, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      else
        detail::spmm_warp_row_kernel<T, View, 8><<<grid, plan.threads, 0, stream>>>(view, out_dim, in_dim, in, n, bias, out, act);
      return check_launch("spmm_warp_row_kernel");
    }
    case SpmmVariant::kGlobalX:
      return launch_rows_tile<T, View, XLayout::kRowMajor>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
    case SpmmVariant::kTensorCore:
      return launch_tensor_core<T>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    case SpmmVariant::kWgmma:
      if constexpr (kIsHalfType<T>) {
        return detail::launch_spmm_wgmma<T>(view, nnz, out_dim, in_dim, in, n, bias, out, act, plan.k_splits,
                                            workspace, stream);
      } else {
        return InvalidArgument("wgmma runs 16-bit values (bfloat16, float16) only");
      }
    case SpmmVariant::kGlobalXT:
    case SpmmVariant::kSharedX: {
      // A one-row batch tile transposed is the row itself: that is global_x's in-place read.
      if (plan.variant == SpmmVariant::kGlobalXT && plan.batch_tile == 1)
        return launch_rows_tile<T, View, XLayout::kRowMajor>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream, rl);
      const int64_t tiles = detail::ceil_div(n, plan.batch_tile);
      if (workspace == nullptr)
        return InvalidArgument(std::string(spmm_variant_name(plan.variant)) + ": the plan's workspace is missing");
      T* in_t = static_cast<T*>(workspace);
      const dim3 tgrid(unsigned(detail::ceil_div(in_dim + 1, 32)), unsigned(detail::ceil_div(plan.batch_tile, 32)),
                       unsigned(tiles));
      detail::transpose_tile_kernel<T><<<tgrid, dim3(32, 8), 0, stream>>>(in, n, in_dim, in_dim + 1, plan.batch_tile,
                                                                         in_t, detail::StepCounts{});
      SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel"));
      rl.after_transpose = true;
      if (plan.variant == SpmmVariant::kSharedX)
        return launch_shared_x<T>(plan, view, out_dim, in_dim, in_t, n, bias, out, act, stream);
      return launch_rows_tile<T, View, XLayout::kTransposed>(plan, view, out_dim, in_dim, in_t, n, bias, out, act,
                                                             stream, rl);
    }
    case SpmmVariant::kDenseBlocks:
      return InvalidArgument("dense_blocks runs through the caller's GEMM: expand_block() writes its blocks");
    default:
      return InvalidArgument(std::string("variant ") + spmm_variant_name(plan.variant) + " cannot run this product");
  }
}

// The plan must be the one made for this product (its launch shape and shared memory follow it).
Status check_plan_matches(const SpmmPlan& plan, const SpmmProblem& problem) {
  const SpmmProblem& p = plan.problem;
  if (p.out_dim != problem.out_dim || p.in_dim != problem.in_dim || p.nnz != problem.nnz || p.n != problem.n ||
      p.value_bytes != problem.value_bytes || p.transposed != problem.transposed)
    return InvalidArgument("spmm: the plan was made for another product (" + std::to_string(p.out_dim) + "x" +
                           std::to_string(p.in_dim) + ", nnz " + std::to_string(p.nnz) + ", batch " +
                           std::to_string(p.n) + "); plan this one with plan_spmm()");
  if (plan.variant == SpmmVariant::kAuto) return InvalidArgument("spmm: plan the product first (variant auto)");
  return Status::Ok();
}

template <typename T>
SpmmProblem problem_of(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, bool transposed) {
  SpmmProblem p;
  p.out_dim = out_dim;
  p.in_dim = in_dim;
  p.nnz = nnz;
  p.n = n;
  p.value_bytes = int(sizeof(T));
  p.transposed = transposed;
  return p;
}

// The transposed product over a copy of the CSC view (plan.csc_copied): the copy is the CSR form of
// W^T, so the plan's kernel runs as the forward of that K x M weight.
template <typename T, typename Index, typename CopyIndex>
Status run_over_csc_copy(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                         const SpmmPlan& plan, void* workspace, Stream stream) {
  if (n == 0 || w.cols == 0) return Status::Ok();
  if (workspace == nullptr && w.nnz > 0) return InvalidArgument("spmm_transposed: the plan's workspace is missing");
  char* ws = static_cast<char*>(workspace);
  CopyIndex* rows = reinterpret_cast<CopyIndex*>(ws + plan.copy_offset);
  T* copied = reinterpret_cast<T*>(ws + plan.copy_offset + detail::round_up_16(size_t(w.nnz) * sizeof(CopyIndex)));
  if (w.nnz > 0) {
    constexpr int64_t kPerBlock = int64_t(detail::kCscCopyThreads) * detail::kCscCopyPerThread;
    detail::copy_csc_kernel<T, Index, CopyIndex>
        <<<detail::grid_for(detail::ceil_div(w.nnz, kPerBlock), 1, 65535), detail::kCscCopyThreads, 0, stream>>>(
            w.csc_perm, w.row_idx, values, w.nnz, rows, copied);
    SNACK_RETURN_IF_ERROR(check_launch("copy_csc_kernel"));
  }
  if (plan.variant == SpmmVariant::kWideRows) {
    SlotPattern<CopyIndex> wt;
    wt.rows = w.cols;
    wt.cols = w.rows;
    wt.nnz = w.nnz;
    wt.row_ptr = w.col_ptr;
    wt.col_idx = rows;
    return launch_wide_rows<T, CopyIndex>(plan, wt, copied, dy, n, static_cast<const T*>(nullptr), dx,
                                          Activation::kNone, stream);
  }
  const CsrView<T, CopyIndex> view{w.col_ptr, rows, copied};
  return run_plan<T>(plan, view, w.nnz, w.cols, w.rows, dy, n, static_cast<const T*>(nullptr), dx, workspace, stream,
                     Activation::kNone);
}

}  // namespace

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    const SpmmPlan& plan, void* workspace, Stream stream, Activation act,
                    const uint32_t* packed_tiles) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"x", required_if(n * w.cols > 0, x)}, {"y", required_if(n * w.rows > 0, y)}},
      PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_plan_matches(plan, problem_of<T>(w.rows, w.cols, w.nnz, n, false)));
  if (plan.variant == SpmmVariant::kCooAtomic && w.forward_only())
    return InvalidArgument("coo_atomic reads the slots' rows, which a forward-only pattern does not hold");
  if (packed_tiles != nullptr && !kIsHalfType<T>)
    return InvalidArgument("packed tile values hold 16-bit values (bfloat16, float16) only");
  // (Packed tile values of a pattern without slots are empty: null, and nothing to read.)
  if (packed_tiles != nullptr && plan.problem.packed_tiles == TileValues::kNone)
    return InvalidArgument("spmm: values in tile order given to a plan made without them (set "
                           "SpmmProblem::packed_tiles)");
  if (packed_tiles == nullptr && plan.problem.packed_tiles == TileValues::kFragments)
    return InvalidArgument("spmm: the plan was made for tile fragments, and none are given");
  if (n == 0 || w.rows == 0) return Status::Ok();
  if (plan.variant == SpmmVariant::kCooAtomic) {
    detail::fill_rows_kernel<T><<<detail::grid_for(n * w.rows, 256, 4096), 256, 0, stream>>>(y, bias, n, w.rows);
    SNACK_RETURN_IF_ERROR(check_launch("fill_rows_kernel"));
    if (w.nnz == 0) return Status::Ok();
    for (int64_t b0 = 0; b0 < n; b0 += kMaxGridY) {
      const unsigned gy = unsigned(std::min<int64_t>(kMaxGridY, n - b0));
      detail::spmm_coo_atomic_kernel<T, Index>
          <<<dim3(unsigned(plan.grid_x), gy), plan.threads, 0, stream>>>(w, values, x, b0, y);
      SNACK_RETURN_IF_ERROR(check_launch("spmm_coo_atomic_kernel"));
    }
    if (act != Activation::kNone) {
      detail::activation_kernel<T><<<detail::grid_for(n * w.rows, 256, 4096), 256, 0, stream>>>(y, n * w.rows, act);
      SNACK_RETURN_IF_ERROR(check_launch("activation_kernel"));
    }
    return Status::Ok();
  }
  if (plan.variant == SpmmVariant::kWideRows) return launch_wide_rows<T, Index>(plan, w, values, x, n, bias, y, act, stream);
  if (plan.reads_fragments) return launch_fragments<T, Index>(plan, w, x, n, bias, y, act, stream, packed_tiles);
  if (plan.variant == SpmmVariant::kTileView) {
    if (packed_tiles != nullptr && plan.problem.packed_tiles == TileValues::kPacked)
      return launch_tile_view<T, Index, false, true>(plan, w, values, x, n, bias, y, act, stream, packed_tiles);
    return launch_tile_view<T, Index, false>(plan, w, values, x, n, bias, y, act, stream);
  }
  CsrView<T, Index> view{w.row_ptr, w.col_idx, values};
  return run_plan<T>(plan, view, w.nnz, w.rows, w.cols, x, n, bias, y, workspace, stream, act);
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       const SpmmPlan& plan, void* workspace, Stream stream, const uint32_t* fragments) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, values, {{"dy", required_if(n * w.rows > 0, dy)}, {"dx", required_if(n * w.cols > 0, dx)}}));
  SNACK_RETURN_IF_ERROR(check_plan_matches(plan, problem_of<T>(w.cols, w.rows, w.nnz, n, true)));
  if (fragments != nullptr && !plan.reads_fragments)
    return InvalidArgument("spmm_transposed: tile fragments given to a plan that does not read them");
  if (plan.reads_fragments) {
    if (fragments == nullptr)
      return InvalidArgument("spmm_transposed: the plan reads W^T's tile fragments, and none are given");
    if (n == 0 || w.cols == 0) return Status::Ok();
    return launch_fragments<T, Index>(plan, w, dy, n, static_cast<const T*>(nullptr), dx, Activation::kNone, stream,
                                      fragments, true);
  }
  if (plan.csc_copied) {
    if (plan.variant == SpmmVariant::kCooAtomic || plan.variant == SpmmVariant::kDenseBlocks ||
        plan.variant == SpmmVariant::kWgmma)
      return InvalidArgument(std::string("spmm_transposed: ") + spmm_variant_name(plan.variant) +
                             " does not run over a copy of the CSC view");
    if (csc_copy_index_bytes(plan.problem) == 2)
      return run_over_csc_copy<T, Index, uint16_t>(w, values, dy, n, dx, plan, workspace, stream);
    return run_over_csc_copy<T, Index, int32_t>(w, values, dy, n, dx, plan, workspace, stream);
  }
  if (plan.variant == SpmmVariant::kTileView) {
    if (n == 0 || w.cols == 0) return Status::Ok();
    return launch_tile_view<T, Index, true>(plan, w, values, dy, n, static_cast<const T*>(nullptr), dx,
                                            Activation::kNone, stream);
  }
  CscView<T, Index> view{w.col_ptr, w.csc_perm, w.row_idx, values};
  return run_plan<T>(plan, view, w.nnz, w.cols, w.rows, dy, n, static_cast<const T*>(nullptr), dx, workspace,
                     stream, Activation::kNone);
}

template <typename T, typename Index>
Status expand_block(const SlotPattern<Index>& w, const T* values, bool transposed, int64_t first, int64_t count,
                    T* block, Stream stream) {
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w, transposed ? PatternNeeds::kAll : PatternNeeds::kForward));
  const int64_t outputs = transposed ? w.cols : w.rows, width = transposed ? w.rows : w.cols;
  if (first < 0 || count < 0 || first + count > outputs)
    return InvalidArgument("expand_block: outputs [" + std::to_string(first) + ", " + std::to_string(first + count) +
                           ") outside the product's " + std::to_string(outputs));
  if (count == 0 || width == 0) return Status::Ok();
  if (block == nullptr || (w.nnz > 0 && values == nullptr))
    return InvalidArgument("expand_block: block and values must not be null");
  const bool vector_rows = reinterpret_cast<uintptr_t>(block) % 16 == 0 && (width * int64_t(sizeof(T))) % 16 == 0;
  constexpr int kThreads = detail::kExpandThreads;
  const detail::ExpandLaunch launch = detail::expand_launch(count, width, int64_t(sizeof(T)));
  const auto expand = [&](const auto& view) {
    if (launch.staged) {
      detail::expand_block_staged_kernel<T><<<unsigned(launch.grid), kThreads, launch.smem_bytes, stream>>>(
          view, first, count, width, vector_rows, block);
      return check_launch("expand_block_staged_kernel");
    }
    detail::expand_block_kernel<T><<<unsigned(launch.grid), kThreads, 0, stream>>>(view, first, count, width,
                                                                                    vector_rows, block);
    return check_launch("expand_block_kernel");
  };
  if (transposed) return expand(CscView<T, Index>{w.col_ptr, w.csc_perm, w.row_idx, values});
  return expand(CsrView<T, Index>{w.row_ptr, w.col_idx, values});
}

namespace {
// The plan-free entry points: plan for the current device, take the workspace from cudaMallocAsync.
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

Status plan_for_current_device(const SpmmProblem& problem, SpmmPlan* plan) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  return plan_spmm(problem, limits, plan);
}
}  // namespace

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Stream stream, Activation act) {
  SpmmPlan plan;
  SNACK_RETURN_IF_ERROR(plan_for_current_device(problem_of<T>(w.rows, w.cols, w.nnz, n, false), &plan));
  AsyncWorkspace ws(stream);
  SNACK_RETURN_IF_ERROR(ws.reserve(plan.workspace_bytes));
  return spmm_forward(w, values, x, n, bias, y, plan, ws.ptr, stream, act);
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx, Stream stream) {
  SpmmPlan plan;
  SNACK_RETURN_IF_ERROR(plan_for_current_device(problem_of<T>(w.cols, w.rows, w.nnz, n, true), &plan));
  AsyncWorkspace ws(stream);
  SNACK_RETURN_IF_ERROR(ws.reserve(plan.workspace_bytes));
  return spmm_transposed(w, values, dy, n, dx, plan, ws.ptr, stream);
}

#define SNACK_INSTANTIATE_SPMM(T, Index)                                                                         \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         const SpmmPlan&, void*, Stream, Activation, const uint32_t*);           \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*,          \
                                            const SpmmPlan&, void*, Stream, const uint32_t*);                    \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         Stream, Activation);                                                    \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream); \
  template Status expand_block<T, Index>(const SlotPattern<Index>&, const T*, bool, int64_t, int64_t, T*, Stream);

SNACK_INSTANTIATE_SPMM(float, uint16_t)
SNACK_INSTANTIATE_SPMM(float, int32_t)
SNACK_INSTANTIATE_SPMM(double, uint16_t)
SNACK_INSTANTIATE_SPMM(double, int32_t)
SNACK_INSTANTIATE_SPMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_SPMM(bfloat16, int32_t)
SNACK_INSTANTIATE_SPMM(float16, uint16_t)
SNACK_INSTANTIATE_SPMM(float16, int32_t)

}  // namespace snack::cuda
