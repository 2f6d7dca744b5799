// Compute kernels of a sparse layer, framework-free: raw pointers and sizes in, a Status out.
//
// Notation (PyTorch's nn.Linear conventions): the weight W is `M x K` (rows = output features),
// held in the slots of a SlotPattern with one value per slot; activations are row-major with
// N rows: X is `N x K`, Y and dY are `N x M`. Every array is dense and contiguous.
//
//   spmm_forward    Y[n, r]  = act(sum_{s in row r} v[s] * X[n, col(s)] (+ bias[r]))
//   spmm_transposed dX[n, c] = sum_{s in col c} v[s] * dY[n, row(s)]        (dX = dY W)
//   sddmm           dv[s]    = sum_n dY[n, row(s)] * X[n, col(s)]            (dW at the slots)
//   bias_grad       db[r]    = sum_n dY[n, r]
//   sddmm_adamw     AdamW's step of v[s] from dv[s], with dv never stored           (the update fused)
//   bias_grad_adamw AdamW's step of b[r] from db[r], with db never stored
//
// Every output element is written (no zero-initialisation is needed). Results are deterministic:
// each output is reduced in a fixed order, with no atomics.
// Value types: float, double, bfloat16 and float16 (snack/value_types.h; computed in float, each
// output rounded once) on the CPU and on CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "snack/optimizer_math.h"
#include "snack/pattern.h"
#include "snack/spmm_plan.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack {

/// Elementwise function fused into the forward's epilogue: y = act(x W^T + b).
/// kGELU is the exact (erf) GELU, as torch.nn.functional.gelu with approximate="none".
enum class Activation : int { kNone = 0, kReLU = 1, kGELU = 2 };
/// "none", "relu", "gelu".
const char* activation_name(Activation act);
/// Parses a name; returns false for an unknown name.
bool parse_activation(const std::string& name, Activation* out);

namespace cpu {

/// Y = act(X W^T (+ bias)). x: [n, w.cols]; bias: [w.rows] or nullptr; y: [n, w.rows].
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias,
                    T* y, Activation act = Activation::kNone);

/// dX = dY W. dy: [n, w.rows]; dx: [n, w.cols]. Walks the CSC view.
template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx);

/// dv[s] = sum_n dY[n, row(s)] X[n, col(s)]. dy: [n, w.rows]; x: [n, w.cols]; dvalues: [w.nnz].
template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues);

/// The same SDDMM on transposed operands: dy_t [w.rows, n] and x_t [w.cols, n] (row-major), so one
/// slot's two vectors are contiguous. Callers that split the slots over threads transpose once.
template <typename T, typename Index>
Status sddmm_on_transposed(const SlotPattern<Index>& w, const T* dy_t, const T* x_t, int64_t n, T* dvalues);

/// db[r] = sum_n dY[n, r]. dy: [n, m]; dbias: [m].
template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias);

/// AdamW's step of `count` values from their gradient, in place: grad, values, exp_avg and
/// exp_avg_sq are [count]; `step` is the number of this update (1 for the first). The gradient
/// is used as stored (in T); the update is computed in float (double for double) and rounded once.
template <typename T>
Status adamw_update(const T* grad, int64_t count, double step, const AdamWConfig& config, T* values, T* exp_avg,
                    T* exp_avg_sq);

}  // namespace cpu

namespace cuda {

/// One parameter tensor under AdamW, in device memory: its values with their two moments, its float
/// count of updates (`step`, as for sddmm_adamw()) and the parameter group's settings.
template <typename T>
struct AdamWParameter {
  T* values = nullptr;
  T* exp_avg = nullptr;
  T* exp_avg_sq = nullptr;
  float* step = nullptr;
  AdamWConfig config;
};

/// X already transposed, as the forward leaves it when its plan transposes the whole batch at once
/// (plan_transposes_whole_input()): row c holds X[0..n-1, c] followed by zeros up to `stride`
/// values per row (the plan's batch tile), for c < w.cols. Given to sddmm() / sddmm_adamw(), it
/// spares their transpose of X where they run the kRows kernel (elsewhere it is not read).
template <typename T>
struct TransposedInput {
  const T* data = nullptr;
  int64_t stride = 0;  ///< values per row: a multiple of 4, from n rounded up to a multiple of 4 to 128
};

/// CUDA versions of the ops above: same arguments, all pointers in device memory of the current
/// device, work enqueued on `stream` (nullptr = the legacy default stream). A non-ok Status means
/// the launch failed; errors raised asynchronously by a kernel surface at the next synchronisation.
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias,
                    T* y, Stream stream, Activation act = Activation::kNone);

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       Stream stream);

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues,
             Stream stream);

/// SDDMM with a caller-provided workspace of sddmm_workspace_bytes() bytes (it holds X transposed,
/// and dY too for the kVector kernel; 0 bytes, workspace may be null, for the kSlot kernel).
/// `variant` forces a kernel (kAuto: kSlot below a batch of kSddmmVectorMinBatch, else chosen from
/// the shape); a forced variant that cannot run this product returns InvalidArgument.
/// `x_t`: X already transposed (TransposedInput), or empty.
template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, void* workspace,
             Stream stream, SddmmVariant variant = SddmmVariant::kAuto, TransposedInput<T> x_t = {});
/// Batch size from which the automatic choice transposes the operands (and needs a workspace).
inline constexpr int64_t kSddmmVectorMinBatch = 4;
/// Largest batch (padded to a multiple of 4) of the kRows SDDMM kernel.
inline constexpr int64_t kSddmmRowsMaxBatch = 128;
/// Workspace bytes of sddmm() and sddmm_adamw() for w.rows = rows, w.cols = cols, batch n and values of
/// value_bytes; with x_transposed_given, for a call given X transposed (0 where the kRows kernel runs).
size_t sddmm_workspace_bytes(int64_t rows, int64_t cols, int64_t n, size_t value_bytes,
                             SddmmVariant variant = SddmmVariant::kAuto, bool x_transposed_given = false);

/// The weight gradient and AdamW's step in one pass: each slot's gradient dv[s], computed as
/// sddmm() computes it and rounded to T, updates values[s], exp_avg[s] and exp_avg_sq[s] in place
/// (cpu::adamw_update's arithmetic) and is never stored, so the step costs no gradient buffer and
/// its loads and stores overlap the products. `step` points to one float in device memory, the
/// number of updates so far: advanced by one on the device (by the first kernel of the call), then
/// read by the update, so that a replayed CUDA graph uses the current count and the caller
/// launches nothing for it. values must not alias dy or x. Workspace (sddmm_workspace_bytes()) and
/// variant as for sddmm(), except that kAuto takes kVector at a batch of 4 (padded), where it runs
/// this epilogue faster than kRows (the two agree to rounding).
///
/// `bias` (optional): a bias of w.rows values updated in the same call from its gradient
/// db[r] = sum_n dY[n, r], as bias_grad_adamw() would, with its own settings and count. The kRows
/// kernel computes it from the dY it holds anyway (no launch of its own); the others launch the
/// bias kernel after the product. `x_t`: X already transposed, as for sddmm().
template <typename T, typename Index>
Status sddmm_adamw(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, float* step,
                   const AdamWConfig& config, T* values, T* exp_avg, T* exp_avg_sq, void* workspace, Stream stream,
                   SddmmVariant variant = SddmmVariant::kAuto, const AdamWParameter<T>* bias = nullptr,
                   TransposedInput<T> x_t = {});

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream);

/// The bias gradient and AdamW's step of the bias in one kernel, as sddmm_adamw() for the values:
/// db[r] (rounded to T) updates bias[r], exp_avg[r] and exp_avg_sq[r] in place and is never stored;
/// `step` points to the float count of updates so far in device memory, advanced by one first.
template <typename T>
Status bias_grad_adamw(const T* dy, int64_t n, int64_t m, float* step, const AdamWConfig& config, T* bias,
                       T* exp_avg, T* exp_avg_sq, Stream stream);

/// Plans a product with `out_dim` outputs per batch row, `in_dim` inputs, `nnz` entries and batch
/// `n`, for values of `value_bytes` bytes: the forward is (w.rows, w.cols), the transposed product
/// (w.cols, w.rows). `requested` forces a variant (kAuto: choose). `transposed`: the plan is for
/// spmm_transposed() (the CSC view, whose lanes per row are chosen by their own measured rule).
/// Uses the current device's limits.
SpmmPlan plan_spmm(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, size_t value_bytes,
                   SpmmVariant requested = SpmmVariant::kAuto, bool transposed = false);
/// One line saying which kernel a plan runs and why.
std::string describe(const SpmmPlan& plan);
/// Whether spmm_forward() with this plan, for a batch of n, leaves all of X transposed in its
/// workspace as TransposedInput describes it (stride plan.batch_tile): a global_xt plan whose one
/// batch tile holds the whole batch.
bool plan_transposes_whole_input(const SpmmPlan& plan, int64_t n);

/// The two products with an explicit plan. `workspace` must hold plan.workspace_bytes bytes of
/// device memory (may be null when that is 0) and stays in use until the work on `stream` is done.
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    const SpmmPlan& plan, void* workspace, Stream stream, Activation act = Activation::kNone);
template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       const SpmmPlan& plan, void* workspace, Stream stream);

}  // namespace cuda
}  // namespace snack
