// The CUDA SDDMM (the weight gradient at the stored slots), the bias gradient, and both with AdamW's
// step fused: a plan from plan.cpp, launched with its epilogue.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/transpose.cuh"
#include "epilogues.cuh"
#include "kernels.cuh"
#include "staged_kernel.cuh"
#include "tensor_core_kernel.cuh"
#include "tile_view_kernel.cuh"
#include "wgmma.h"
#include "snack/sddmm.h"

namespace snack::cuda {
namespace {

using detail::ceil_div;
using detail::check_launch;
using detail::grid_for;

// Whether p is aligned for one load of 4 elements of `elem` bytes.
bool aligned_for_4(const void* p, size_t elem) { return reinterpret_cast<uintptr_t>(p) % (4 * elem < 16 ? 4 * elem : 16) == 0; }

template <typename T, typename Index, int GN, int NC, typename Out>
Status launch_sddmm_rows(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy, int64_t n, const T* x_t,
                         int64_t np, const Out& out, const Out* bias_out, Stream stream) {
  const bool vector_ok = aligned_for_4(w.col_idx, sizeof(Index));
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(sddmm_rows_kernel<T, Index, GN, NC, Out>,
                                                         dim3(unsigned(plan.grid_x)), dim3(kThreads), 0, stream, w,
                                                         vector_ok, dy, n, x_t, np, plan.lanes_per_row, out,
                                                         bias_out ? *bias_out : out, bias_out != nullptr));
  return check_launch("sddmm_rows_kernel");
}

// The rows kernel's instantiation the plan names (batch lanes and chunks).
template <typename T, typename Index, typename Out>
Status launch_sddmm_rows_for_plan(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy, int64_t n,
                                  const T* x_t, int64_t np, const Out& out, const Out* bias_out, Stream stream) {
  const auto run = [&](auto gn, auto nc) {
    return launch_sddmm_rows<T, Index, decltype(gn)::value, decltype(nc)::value>(plan, w, dy, n, x_t, np, out,
                                                                                 bias_out, stream);
  };
  using std::integral_constant;
  if (plan.batch_chunks == 4) return run(integral_constant<int, 8>{}, integral_constant<int, 4>{});
  if (plan.batch_chunks == 2) return run(integral_constant<int, 8>{}, integral_constant<int, 2>{});
  switch (plan.batch_lanes) {
    case 1: return run(integral_constant<int, 1>{}, integral_constant<int, 1>{});
    case 2: return run(integral_constant<int, 2>{}, integral_constant<int, 1>{});
    case 4: return run(integral_constant<int, 4>{}, integral_constant<int, 1>{});
    default: return run(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  }
}

template <typename T, typename Index, int G, typename Out>
Status launch_sddmm_vector(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy_t, const T* x_t,
                           int64_t np, const Out& out, Stream stream) {
  // Programmatic launch: starts during the transpose of X (see detail::launch_programmatic).
  SNACK_CUDA_RETURN_IF_ERROR(detail::launch_programmatic(sddmm_vector_kernel<T, Index, G, Out>,
                                                         dim3(unsigned(plan.grid_x)), dim3(kThreads), 0, stream, w,
                                                         dy_t, x_t, np, out));
  return check_launch("sddmm_vector_kernel");
}

template <typename T, typename Index, typename Out>
Status launch_sddmm_vector_for_plan(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy_t, const T* x_t,
                                    int64_t np, const Out& out, Stream stream) {
  switch (plan.batch_lanes) {
    case 1: return launch_sddmm_vector<T, Index, 1>(plan, w, dy_t, x_t, np, out, stream);
    case 2: return launch_sddmm_vector<T, Index, 2>(plan, w, dy_t, x_t, np, out, stream);
    case 4: return launch_sddmm_vector<T, Index, 4>(plan, w, dy_t, x_t, np, out, stream);
    case 8: return launch_sddmm_vector<T, Index, 8>(plan, w, dy_t, x_t, np, out, stream);
    case 16: return launch_sddmm_vector<T, Index, 16>(plan, w, dy_t, x_t, np, out, stream);
    default: return launch_sddmm_vector<T, Index, 32>(plan, w, dy_t, x_t, np, out, stream);
  }
}

// The staged kernel, and where its sums go through the workspace, the kernel that adds the splits'
// sums and hands them to `out`.
template <typename Index, typename Out>
Status launch_sddmm_staged(const SddmmPlan& plan, const SlotPattern<Index>& w, const float* dy, const float* x,
                           int64_t n, const Out& out, void* workspace, Stream stream) {
  // AdamW's update always runs in the second kernel (plan_sddmm): the staged kernel only stores sums.
  using KernelOut = std::conditional_t<Out::kUpdatesState, StoreGradient<float>, Out>;
  KernelOut kernel_out{};
  if constexpr (!Out::kUpdatesState) kernel_out = out;
  float* partial = plan.staged_sums_in_workspace ? static_cast<float*>(workspace) : nullptr;
  if (Out::kUpdatesState && partial == nullptr)
    return InvalidArgument("sddmm: the staged kernel's plan for AdamW must send its sums through the workspace");
  const auto kernel = sddmm_staged_kernel<Index, KernelOut>;
  SNACK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  int log2_chunk_8 = 0;
  while ((8 << log2_chunk_8) < plan.chunk_cols) ++log2_chunk_8;
  // The plan's 16-byte copies need both operands on a 16-byte boundary (its shared memory covers
  // either copy).
  const bool vector_copies = plan.staged_vector_copies && reinterpret_cast<uintptr_t>(dy) % 16 == 0 &&
                             reinterpret_cast<uintptr_t>(x) % 16 == 0;
  kernel<<<dim3(unsigned(plan.grid_x), unsigned(plan.grid_y), unsigned(plan.batch_splits)), detail::kStagedThreads,
           plan.smem_bytes, stream>>>(w, dy, x, n, plan.chunk_cols, log2_chunk_8, plan.split_samples, vector_copies,
                                      partial, kernel_out);
  SNACK_RETURN_IF_ERROR(check_launch("sddmm_staged_kernel"));
  if (partial == nullptr) return Status::Ok();
  sddmm_sum_splits_kernel<Out><<<grid_for(w.nnz, 256), 256, 0, stream>>>(partial, plan.batch_splits, w.nnz, out);
  return check_launch("sddmm_sum_splits_kernel");
}

// The tensor-core kernel over the plan's bands and runs of tiles.
template <typename T, typename Index, typename Out>
Status launch_sddmm_tensor_core(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy, const T* x,
                                int64_t n, const Out& out, Stream stream) {
  const auto kernel = sddmm_tensor_core_kernel<T, Index, Out>;
  SNACK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const bool vec_dy = detail::rows_of_16byte_vectors(dy, w.rows);
  const bool vec_x = detail::rows_of_16byte_vectors(x, w.cols);
  kernel<<<dim3(unsigned(plan.grid_x), unsigned(plan.grid_y)), detail::kTcDwThreads, plan.smem_bytes, stream>>>(
      w, dy, x, n, plan.tiles_per_block, vec_dy, vec_x, out);
  return check_launch("sddmm_tensor_core_kernel");
}

// The tile-view kernel over the plan's bands and runs, for a batch of KS k-steps of 16 rows.
template <typename T, int KS, typename Out>
Status launch_sddmm_tile_view_steps(const SddmmPlan& plan, const detail::TileView& view, const T* dy, const T* x,
                                    int64_t rows, int64_t cols, int64_t n, const Out& out, Stream stream) {
  const auto kernel = sddmm_tile_view_kernel<T, KS, Out>;
  if (plan.smem_bytes > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  const bool vec_dy = detail::rows_of_16byte_vectors(dy, rows);
  const bool vec_x = detail::rows_of_16byte_vectors(x, cols);
  kernel<<<unsigned(plan.grid_x), detail::kTvDwThreads, plan.smem_bytes, stream>>>(view, dy, x, rows, cols, n,
                                                                                  plan.tile_splits, vec_dy, vec_x, out);
  return check_launch("sddmm_tile_view_kernel");
}

template <typename T, typename Index, typename Out>
Status launch_sddmm_tile_view(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n,
                              const Out& out, Stream stream) {
  detail::TileView view;
  SNACK_RETURN_IF_ERROR(detail::tile_view_of(w, "sddmm: tile_view", &view));
  switch (detail::tv_dw_k_steps(n)) {
    case 1: return launch_sddmm_tile_view_steps<T, 1>(plan, view, dy, x, w.rows, w.cols, n, out, stream);
    case 2: return launch_sddmm_tile_view_steps<T, 2>(plan, view, dy, x, w.rows, w.cols, n, out, stream);
    case 4: return launch_sddmm_tile_view_steps<T, 4>(plan, view, dy, x, w.rows, w.cols, n, out, stream);
    case 8: return launch_sddmm_tile_view_steps<T, 8>(plan, view, dy, x, w.rows, w.cols, n, out, stream);
    default: return InvalidArgument("sddmm: tile_view runs batches of at most " + std::to_string(detail::kTvDwMaxBatch));
  }
}

Status advance_counts(const detail::StepCounts& counts, Stream stream) {
  if (!counts.any()) return Status::Ok();
  advance_counts_kernel<<<1, 1, 0, stream>>>(counts);
  return check_launch("advance_counts_kernel");
}

template <typename T, typename Out>
Status launch_bias_grad(const T* dy, int64_t n, int64_t m, const Out& out, Stream stream) {
  bias_grad_kernel<T><<<grid_for(m, kBiasColumns), kBiasColumns * kBiasWarps, 0, stream>>>(dy, n, m, out);
  return check_launch("bias_grad_kernel");
}

// The plan must be the one made for this SDDMM, and the operands it reads must be there.
template <typename T, typename Index>
Status check_plan_matches(const SddmmPlan& plan, const SlotPattern<Index>& w, int64_t n, SddmmEpilogue epilogue,
                          void* workspace, const TransposedInput<T>& x_t) {
  const SddmmProblem& p = plan.problem;
  if (p.rows != w.rows || p.cols != w.cols || p.nnz != w.nnz || p.n != n || p.value_bytes != int(sizeof(T)) ||
      p.epilogue != epilogue)
    return InvalidArgument("sddmm: the plan was made for another product (" + std::to_string(p.rows) + "x" +
                           std::to_string(p.cols) + ", nnz " + std::to_string(p.nnz) + ", batch " +
                           std::to_string(p.n) + "); plan this one with plan_sddmm()");
  if (plan.variant == SddmmVariant::kAuto) return InvalidArgument("sddmm: plan the product first (variant auto)");
  if (plan.variant == SddmmVariant::kDenseBlocks)
    return InvalidArgument("dense_blocks runs through the caller's GEMM: sddmm_from_block() reads its blocks");
  if ((x_t.data != nullptr) != (p.x_t_stride != 0) || (x_t.data && x_t.stride != p.x_t_stride))
    return InvalidArgument("sddmm: the transposed input differs from the one the plan was made for");
  if (plan.workspace_bytes > 0 && workspace == nullptr)
    return InvalidArgument("sddmm: the plan's workspace of " + std::to_string(plan.workspace_bytes) +
                           " bytes is missing");
  return Status::Ok();
}

// The SDDMM kernels with `out` as their epilogue: the transposes and the launch the plan says.
// With bias_out, the bias gradient goes to that epilogue too: inside the rows kernel, else by
// bias_grad_kernel after the product (bias_out's arrays have w.rows elements). The epilogues' step
// counts are advanced first, by the first transpose where there is one, else by a one-thread kernel.
template <typename T, typename Index, typename Out>
Status run_sddmm(const SddmmPlan& plan, const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n,
                 const Out& out, const Out* bias_out, void* workspace, Stream stream, TransposedInput<T> given_x_t) {
  const int64_t np = plan.padded_batch;
  const detail::StepCounts counts{out.count(), bias_out ? bias_out->count() : nullptr};
  if (plan.variant == SddmmVariant::kStaged && w.nnz > 0 && n > 0) {  // dY and X read in place
    if constexpr (std::is_same_v<T, float>) {
      SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
      SNACK_RETURN_IF_ERROR(launch_sddmm_staged(plan, w, dy, x, n, out, workspace, stream));
      return bias_out ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
    } else {
      return InvalidArgument("sddmm: staged runs float32 operands");
    }
  }
  const bool tiles_on_tensor_cores = plan.variant == SddmmVariant::kTensorCore ||
                                     plan.variant == SddmmVariant::kTileView ||
                                     plan.variant == SddmmVariant::kTileViewWgmma;
  if (tiles_on_tensor_cores && w.nnz > 0 && n > 0) {  // dY and X read in place
    if constexpr (kIsHalfType<T>) {
      const auto launch = [&](const auto& tile_out) -> Status {
        if (plan.variant == SddmmVariant::kTileViewWgmma) {
          if constexpr (std::is_same_v<std::decay_t<decltype(tile_out)>, StoreGradient<T>>) {
            detail::TileView view;
            SNACK_RETURN_IF_ERROR(detail::tile_view_of(w, "sddmm: tile_view_wgmma", &view));
            return detail::launch_sddmm_tile_view_wgmma(plan, view, dy, x, w.rows, w.cols, n, tile_out.dvalues,
                                                        stream);
          } else {
            return InvalidArgument("sddmm: tile_view_wgmma stores the gradient (AdamW's step runs after it)");
          }
        }
        return plan.variant == SddmmVariant::kTileView ? launch_sddmm_tile_view(plan, w, dy, x, n, tile_out, stream)
                                                       : launch_sddmm_tensor_core(plan, w, dy, x, n, tile_out, stream);
      };
      SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
      if constexpr (Out::kUpdatesState) {
        if (!plan.gradient_in_workspace)
          return InvalidArgument("sddmm: the tensor-core plan for AdamW must store the gradient in the workspace");
        T* gradient = static_cast<T*>(workspace);
        SNACK_RETURN_IF_ERROR(launch(StoreGradient<T>{gradient}));
        sddmm_adamw_from_gradient_kernel<T, Out>
            <<<grid_for(ceil_div(w.nnz, 8), 256, int64_t(4096)), 256, 0, stream>>>(gradient, w.nnz, out);
        SNACK_RETURN_IF_ERROR(check_launch("sddmm_adamw_from_gradient_kernel"));
      } else {
        SNACK_RETURN_IF_ERROR(launch(out));
      }
      return bias_out ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
    } else {
      return InvalidArgument(std::string("sddmm: ") + sddmm_variant_name(plan.variant) +
                             " runs 16-bit operands (bf16, fp16)");
    }
  }
  if (!plan.transpose_x && !plan.reads_x_t) {  // nothing to multiply, or the slot kernel
    SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
    if (w.nnz > 0) {
      sddmm_thread_slot_kernel<T, Index, Out><<<unsigned(plan.grid_x), kThreads, 0, stream>>>(w, dy, x, n, out);
      SNACK_RETURN_IF_ERROR(check_launch("sddmm_thread_slot_kernel"));
    }
    return bias_out && w.rows > 0 ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
  }
  if (plan.reads_x_t) {  // the rows kernel reads the forward's X^T
    SNACK_RETURN_IF_ERROR(advance_counts(counts, stream));
    return launch_sddmm_rows_for_plan(plan, w, dy, n, given_x_t.data, given_x_t.stride, out, bias_out, stream);
  }
  // X transposed once into [cols, np] (zero-padded); the vector kernel also takes dY as [rows, np].
  T* x_t = static_cast<T*>(workspace);
  T* dy_t = x_t + w.cols * np;
  const dim3 block(32, 8);
  if (plan.transpose_dy) {
    detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.rows, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                       stream>>>(dy, n, w.rows, w.rows, int(np), dy_t, counts);
    SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(dy)"));
  }
  detail::transpose_tile_kernel<T><<<dim3(unsigned(ceil_div(w.cols, 32)), unsigned(ceil_div(np, 32)), 1), block, 0,
                                     stream>>>(x, n, w.cols, w.cols, int(np), x_t,
                                               plan.transpose_dy ? detail::StepCounts{} : counts);
  SNACK_RETURN_IF_ERROR(check_launch("transpose_tile_kernel(x)"));
  if (plan.variant == SddmmVariant::kRows)
    return launch_sddmm_rows_for_plan(plan, w, dy, n, x_t, np, out, bias_out, stream);
  SNACK_RETURN_IF_ERROR(launch_sddmm_vector_for_plan(plan, w, dy_t, x_t, np, out, stream));
  return bias_out ? launch_bias_grad(dy, n, w.rows, *bias_out, stream) : Status::Ok();
}

}  // namespace

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, const SddmmPlan& plan,
             void* workspace, Stream stream, TransposedInput<T> x_t) {
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, dvalues),
      {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  SNACK_RETURN_IF_ERROR(check_plan_matches(plan, w, n, SddmmEpilogue::kStore, workspace, x_t));
  return run_sddmm(plan, w, dy, x, n, StoreGradient<T>{dvalues}, static_cast<const StoreGradient<T>*>(nullptr),
                   workspace, stream, x_t);
}

template <typename T, typename Index, typename P>
Status sddmm_adamw(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, const AdamWParameter<P>& values,
                   const typename AdamWParameter<P>::Self* bias, const SddmmPlan& plan, void* workspace, Stream stream,
                   TransposedInput<T> x_t) {
  static_assert(std::is_same_v<P, T> || (kIsHalfType<T> && std::is_same_v<P, float>),
                "sddmm_adamw: parameters of the operands' type, or float32 masters of 16-bit operands");
  using snack::detail::required_if;
  SNACK_RETURN_IF_ERROR(snack::detail::check_op(
      w, n, required_if(w.nnz > 0, values.values),
      {{"dy", required_if(n * w.rows > 0, dy)},
       {"x", required_if(n * w.cols > 0, x)},
       {"exp_avg", required_if(w.nnz > 0, values.exp_avg)},
       {"exp_avg_sq", required_if(w.nnz > 0, values.exp_avg_sq)},
       {"step", required_if(w.nnz > 0, values.step)}}));
  if (bias && w.rows > 0 && !(bias->values && bias->exp_avg && bias->exp_avg_sq && bias->step))
    return InvalidArgument("sddmm_adamw: the bias's values, exp_avg, exp_avg_sq and step must not be null");
  SNACK_RETURN_IF_ERROR(check_plan_matches(plan, w, n, SddmmEpilogue::kAdamW, workspace, x_t));
  const AdamWUpdate<T, P> bias_update{bias ? bias->values : nullptr, bias ? bias->exp_avg : nullptr,
                                   bias ? bias->exp_avg_sq : nullptr, bias ? bias->step : nullptr,
                                   bias ? bias->config : AdamWConfig{}, {}};
  return run_sddmm(plan, w, dy, x, n,
                   AdamWUpdate<T, P>{values.values, values.exp_avg, values.exp_avg_sq, values.step, values.config, {}},
                   bias ? &bias_update : nullptr, workspace, stream, x_t);
}

namespace {
// The slots of a block of rows read out of the caller's GEMM result, with `out` as their epilogue.
template <typename T, typename Index, typename Out>
Status run_from_block(const char* op, const SlotPattern<Index>& w, const T* g, int64_t ld, int64_t first_row,
                      int64_t rows, const Out& out, Stream stream) {
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w));
  if (first_row < 0 || rows < 0 || first_row + rows > w.rows)
    return InvalidArgument(std::string(op) + ": rows [" + std::to_string(first_row) + ", " +
                           std::to_string(first_row + rows) + ") outside the pattern's " + std::to_string(w.rows));
  if (ld < w.cols) return InvalidArgument(std::string(op) + ": the block's rows hold " + std::to_string(ld) +
                                          " values, fewer than the pattern's " + std::to_string(w.cols) + " columns");
  if (rows == 0 || w.nnz == 0) return Status::Ok();
  if (g == nullptr) return InvalidArgument(std::string(op) + ": the block must not be null");
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  const unsigned grid = grid_for(rows * 32, kThreads, int64_t(limits.sms) * 8);  // as plan_sddmm() plans it
  sddmm_from_block_kernel<T, Index, Out><<<grid, kThreads, 0, stream>>>(w.row_ptr, w.col_idx, g, ld, first_row, rows,
                                                                        out);
  return check_launch("sddmm_from_block_kernel");
}
}  // namespace

template <typename T, typename Index>
Status sddmm_from_block(const SlotPattern<Index>& w, const T* g, int64_t ld, int64_t first_row, int64_t rows,
                        T* dvalues, Stream stream) {
  if (w.nnz > 0 && dvalues == nullptr) return InvalidArgument("sddmm_from_block: dvalues must not be null");
  return run_from_block("sddmm_from_block", w, g, ld, first_row, rows, StoreGradient<T>{dvalues}, stream);
}

template <typename T, typename Index, typename P>
Status sddmm_adamw_from_block(const SlotPattern<Index>& w, const T* g, int64_t ld, int64_t first_row, int64_t rows,
                              const AdamWParameter<P>& values, bool first_block, Stream stream) {
  static_assert(std::is_same_v<P, T> || (kIsHalfType<T> && std::is_same_v<P, float>),
                "sddmm_adamw_from_block: parameters of the operands' type, or float32 masters of 16-bit operands");
  if (w.nnz > 0 && !(values.values && values.exp_avg && values.exp_avg_sq && values.step))
    return InvalidArgument("sddmm_adamw_from_block: values, exp_avg, exp_avg_sq and step must not be null");
  if (first_block) SNACK_RETURN_IF_ERROR(advance_counts(detail::StepCounts{values.step, nullptr}, stream));
  return run_from_block("sddmm_adamw_from_block", w, g, ld, first_row, rows,
                        AdamWUpdate<T, P>{values.values, values.exp_avg, values.exp_avg_sq, values.step,
                                          values.config, {}},
                        stream);
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, Stream stream) {
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  SddmmProblem problem;
  problem.rows = w.rows;
  problem.cols = w.cols;
  problem.nnz = w.nnz;
  problem.n = n;
  problem.value_bytes = int(sizeof(T));
  SddmmPlan plan;
  SNACK_RETURN_IF_ERROR(plan_sddmm(problem, limits, &plan));
  void* ws = nullptr;
  if (plan.workspace_bytes > 0) SNACK_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&ws, plan.workspace_bytes, stream));
  const Status status = sddmm(w, dy, x, n, dvalues, plan, ws, stream);
  if (ws) (void)cudaFreeAsync(ws, stream);
  return status;
}

namespace {
// The bias-gradient kernel with `out` as its epilogue; `op` names the caller in errors. `outputs`
// says whether the epilogue's arrays are all non-null (checked where m > 0).
template <typename T, typename Out>
Status run_bias_grad(const char* op, const T* dy, int64_t n, int64_t m, bool outputs, const char* outputs_error,
                     const Out& out, Stream stream) {
  if (n < 0 || m < 0) return InvalidArgument(std::string(op) + ": sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && !outputs) return InvalidArgument(outputs_error);
  SNACK_RETURN_IF_ERROR(advance_counts(detail::StepCounts{out.count(), nullptr}, stream));
  if (m == 0) return Status::Ok();
  return launch_bias_grad(dy, n, m, out, stream);
}
}  // namespace

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream) {
  return run_bias_grad("bias_grad", dy, n, m, dbias != nullptr, "dbias must not be null", StoreGradient<T>{dbias},
                       stream);
}

template <typename T, typename P>
Status bias_grad_adamw(const T* dy, int64_t n, int64_t m, const AdamWParameter<P>& bias, Stream stream) {
  return run_bias_grad("bias_grad_adamw", dy, n, m, bias.values && bias.exp_avg && bias.exp_avg_sq && bias.step,
                       "bias, exp_avg, exp_avg_sq and step must not be null",
                       AdamWUpdate<T, P>{bias.values, bias.exp_avg, bias.exp_avg_sq, bias.step, bias.config, {}}, stream);
}

#define SNACK_INSTANTIATE_CUDA_SDDMM(T, Index)                                                                     \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, Stream);             \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*, const SddmmPlan&,   \
                                  void*, Stream, TransposedInput<T>);                                              \
  template Status sddmm_from_block<T, Index>(const SlotPattern<Index>&, const T*, int64_t, int64_t, int64_t, T*,   \
                                             Stream);                                                              \
  SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(T, Index, T)

// The AdamW step of parameters of type P from operands of type T.
#define SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(T, Index, P)                                                        \
  template Status sddmm_adamw<T, Index, P>(const SlotPattern<Index>&, const T*, const T*, int64_t,             \
                                           const AdamWParameter<P>&, const AdamWParameter<P>*, const SddmmPlan&, \
                                           void*, Stream, TransposedInput<T>);                                 \
  template Status sddmm_adamw_from_block<T, Index, P>(const SlotPattern<Index>&, const T*, int64_t, int64_t,   \
                                                      int64_t, const AdamWParameter<P>&, bool, Stream);

SNACK_INSTANTIATE_CUDA_SDDMM(float, uint16_t)
SNACK_INSTANTIATE_CUDA_SDDMM(float, int32_t)
SNACK_INSTANTIATE_CUDA_SDDMM(double, uint16_t)
SNACK_INSTANTIATE_CUDA_SDDMM(double, int32_t)
SNACK_INSTANTIATE_CUDA_SDDMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_CUDA_SDDMM(bfloat16, int32_t)
SNACK_INSTANTIATE_CUDA_SDDMM(float16, uint16_t)
SNACK_INSTANTIATE_CUDA_SDDMM(float16, int32_t)
SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(bfloat16, uint16_t, float)
SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(bfloat16, int32_t, float)
SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(float16, uint16_t, float)
SNACK_INSTANTIATE_CUDA_SDDMM_ADAMW(float16, int32_t, float)
template Status bias_grad<float>(const float*, int64_t, int64_t, float*, Stream);
template Status bias_grad<double>(const double*, int64_t, int64_t, double*, Stream);
template Status bias_grad<bfloat16>(const bfloat16*, int64_t, int64_t, bfloat16*, Stream);
template Status bias_grad<float16>(const float16*, int64_t, int64_t, float16*, Stream);
#define SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(T, P) \
  template Status bias_grad_adamw<T, P>(const T*, int64_t, int64_t, const AdamWParameter<P>&, Stream);
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(float, float)
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(double, double)
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(bfloat16, bfloat16)
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(float16, float16)
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(bfloat16, float)
SNACK_INSTANTIATE_CUDA_BIAS_ADAMW(float16, float)

}  // namespace snack::cuda
