// The weight gradient at the stored slots (an SDDMM), the bias gradient, and AdamW's step fused into
// both, on the CPU and on CUDA, and the planner that chooses how the CUDA SDDMM runs.
//
// Notation as in spmm.h (W is M x K in the slots of a SlotPattern; dY is N x M, X is N x K):
//
//   sddmm           dv[s] = sum_n dY[n, row(s)] * X[n, col(s)]
//   bias_grad       db[r] = sum_n dY[n, r]
//   sddmm_adamw     AdamW's step of v[s] from dv[s], with dv never stored
//   bias_grad_adamw AdamW's step of b[r] from db[r], with db never stored
//
// Every output element is written; each is reduced by one thread in a fixed order, so results are
// bitwise reproducible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "snack/batch_tiles.h"
#include "snack/device_limits.h"
#include "snack/optimizer_math.h"
#include "snack/pattern.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack {

/// The CUDA kernels of the SDDMM; every one can be forced, for benchmarks and tests.
enum class SddmmVariant : int {
  kAuto = 0,  ///< let the planner choose
  kSlot,      ///< one thread per slot, dY and X read in place
  kVector,    ///< dY and X transposed once; G lanes per slot read 16-byte vectors of both through L1
  kRows,      ///< a warp per row of W keeps dY's row in registers, gathers X^T through L1 (batch <= 128)
  kDenseBlocks,  ///< large batches: the caller's GEMM computes G = dY[:, rows]^T X for a block of
                 ///< SddmmPlan::block_rows rows at a time, sddmm_from_block reads the slots out of it.
                 ///< Planned only for a problem with `gemm` set.
  kStaged,       ///< large batches in float32: a block per tile of W (128 rows x chunk_cols columns) streams
                 ///< dY and X through shared memory, each slot's sum kept in registers (dY, X read in place)
  kTensorCore,   ///< 16-bit operands: dense 128 x 128 tiles of dY^T X on tensor cores (dY, X read in place),
                 ///< the stored slots read out of each tile
  kTileView,     ///< 16-bit operands, batches of at most 128: the pattern's tile view, each 64 x 64 tile that
                 ///< holds slots computed as dense dY^T X on tensor cores (dY's band kept in registers) and
                 ///< its entries read out by the whole block. Needs a pattern with the tile view.
  kTileViewWgmma,  ///< kTileView's work on Hopper's wgmma: a warpgroup per band of 64 rows multiplies each tile
                   ///< while it reads out the one before; one or two warpgroups a block share X's chunks.
                   ///< Needs the tile view, a build with sm_90a code and a GPU of compute capability 9.0
                   ///< (the planner's choice there past 32 batch rows).
};

/// Names used by the Python API ("auto", "slot", "vector", "rows", "dense_blocks", "staged", "tensor_core",
/// "tile_view", "tile_view_wgmma").
const char* sddmm_variant_name(SddmmVariant v);
/// Parses a name; returns false for an unknown name.
bool parse_sddmm_variant(const std::string& name, SddmmVariant* out);
/// Every variant but kAuto, in declaration order.
const std::vector<SddmmVariant>& sddmm_variants();

/// What happens to each slot's gradient.
enum class SddmmEpilogue : int {
  kStore = 0,  ///< written to dvalues
  kAdamW,      ///< AdamW's step of the slot's value and moments, the gradient never stored
};

/// Why the planner chose its variant.
enum class SddmmReason : int {
  kForced = 0,     ///< the caller named the variant
  kSmallBatch,     ///< below a batch of 4: no transposes, one thread per slot
  kRowsKernel,     ///< dY's row kept in registers, X^T gathered through L1
  kBeyondRows,     ///< a batch past the rows kernel's 128: both operands transposed
  kAdamWBatchOf4,  ///< AdamW's epilogue at a padded batch of 4 runs faster in the vector kernel
  kDenseBlocks,    ///< a batch large enough that dense GEMMs over blocks of rows beat the sparse kernels
  kStagedTiles,    ///< a float32 batch past the rows kernel's 128: dY and X staged on chip per tile of W
  kTensorCores,    ///< 16-bit operands where dense tiles of dY^T X on tensor cores beat the slots' gathers
  kTileView,       ///< 16-bit operands, up to 128 batch rows: the tile view's tiles on tensor cores
  kTileViewWgmma,  ///< the same on Hopper past 32 batch rows: the tiles on wgmma, overlapped with the read-out
};
/// A short token ("forced", "small_batch", "rows_kernel", "beyond_rows", "adamw_batch_of_4",
/// "dense_blocks", "staged_tiles", "tensor_cores", "tile_view", "tile_view_wgmma") and
/// a sentence saying what it means.
const char* sddmm_reason_name(SddmmReason r);
const char* sddmm_reason_text(SddmmReason r);

/// Batch size from which the planner transposes the operands (and needs a workspace).
inline constexpr int64_t kSddmmVectorMinBatch = 4;
/// Largest batch (padded to a multiple of 4) of the kRows kernel.
inline constexpr int64_t kSddmmRowsMaxBatch = 128;

/// One SDDMM to plan, for a pattern of `rows` x `cols` with `nnz` slots and a batch of n rows.
struct SddmmProblem {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t nnz = 0;
  int64_t n = 0;
  int value_bytes = 4;
  SddmmEpilogue epilogue = SddmmEpilogue::kStore;
  SddmmVariant requested = SddmmVariant::kAuto;
  /// X already transposed by the caller (the forward's copy, TransposedInput) with this many
  /// values per row; 0: not given. Only the kRows kernel reads it.
  int64_t x_t_stride = 0;
  /// The caller multiplies dense blocks with a GEMM of its own (kDenseBlocks may be planned).
  bool gemm = false;
  /// The caller's float32 GEMMs may round to TF32 (torch.backends.cuda.matmul.allow_tf32).
  bool tf32 = false;
  /// The pattern holds the tile view (SlotPattern::tile_ptr): kTileView may run.
  bool tile_view = false;
  /// kTileView, kTileViewWgmma: blocks per band (per group of bands for kTileViewWgmma), each a run of
  /// the band's tiles, at most the band's tiles; 0 lets the planner choose. Other variants ignore it.
  int tile_view_splits = 0;
  /// kTileViewWgmma: warpgroups a block, each a band of its own (1 or 2); 0 lets the planner
  /// choose. Other variants ignore it.
  int warpgroups = 0;
  bool operator==(const SddmmProblem& o) const {
    return rows == o.rows && cols == o.cols && nnz == o.nnz && n == o.n && value_bytes == o.value_bytes &&
           epilogue == o.epilogue && requested == o.requested && x_t_stride == o.x_t_stride && gemm == o.gemm &&
           tf32 == o.tf32 && tile_view == o.tile_view && tile_view_splits == o.tile_view_splits &&
           warpgroups == o.warpgroups;
  }
};

/// How a CUDA SDDMM runs; made by plan_sddmm() for one problem.
struct SddmmPlan {
  SddmmProblem problem;
  SddmmVariant variant = SddmmVariant::kSlot;
  SddmmReason reason = SddmmReason::kForced;
  int64_t padded_batch = 0;    ///< the batch rounded up to a multiple of 4 (the transposes' row length)
  int batch_lanes = 1;         ///< kVector: lanes per slot; kRows: lanes along the batch
  int batch_chunks = 1;        ///< kRows: 4-value chunks of dY's row per batch lane
  int lanes_per_row = 1;       ///< kRows: lanes that split one row's slots
  int64_t grid_x = 1;          ///< blocks of the product's kernel
  int threads = 256;           ///< threads per block
  bool transpose_x = false;    ///< X is transposed into the workspace first
  bool reads_x_t = false;      ///< the kRows kernel reads the caller's X^T (problem.x_t_stride) instead
  bool transpose_dy = false;   ///< dY too (kVector)
  size_t workspace_bytes = 0;  ///< device workspace the caller provides
  int64_t block_rows = 0;      ///< kDenseBlocks: rows of W per GEMM block (workspace: block_rows x cols values)
  int chunk_cols = 0;          ///< kStaged: columns of W per block (a power of two, 16-256)
  int64_t grid_y = 1;          ///< kStaged, kTensorCore: bands of 128 rows of W (kTileView: 1, its bands along x)
  int batch_splits = 1;        ///< kStaged: blocks that split the batch (grid.z), their float sums added
                               ///< in split order
  int64_t split_samples = 0;   ///< kStaged: batch rows per split (a multiple of the batch tile)
  bool staged_vector_copies = false;  ///< kStaged: X and dY copied in 16-byte vectors, then transposed on chip
  bool staged_sums_in_workspace = false;  ///< kStaged: the sums go through the workspace to a second kernel
                                          ///< that hands them to the epilogue (a split batch, or AdamW)
  size_t smem_bytes = 0;       ///< kStaged, kTensorCore, kTileView(Wgmma): dynamic shared memory per block
  int tiles_per_block = 0;     ///< kTensorCore: tiles of 128 columns per block (grid_x blocks along the
                               ///< columns, grid_y bands of 128 rows)
  bool gradient_in_workspace = false;  ///< kTensorCore, kTileView(Wgmma) with AdamW: the gradient, rounded to the
                                       ///< operands' type, goes to the workspace, and a second kernel applies
                                       ///< AdamW's step
  int tile_splits = 1;         ///< kTileView: blocks per band of 64 rows, each a run of the band's tiles
                               ///< (grid_x = bands x tile_splits); kTileViewWgmma: per group of
                               ///< threads / 128 bands
};

/// Plans an SDDMM on a GPU with `limits`. A forced kRows on a batch past kSddmmRowsMaxBatch, or a
/// given X^T whose stride the kRows kernel cannot read, is an InvalidArgument. Pure.
Status plan_sddmm(const SddmmProblem& problem, const DeviceLimits& limits, SddmmPlan* plan);
/// One line: the variant, its launch shape and why.
std::string describe(const SddmmPlan& plan);

namespace cpu {

/// dv[s] = sum_n dY[n, row(s)] X[n, col(s)]. dy: [n, w.rows]; x: [n, w.cols]; dvalues: [w.nnz].
/// One thread; dY and X are first laid out in tiles (snack/batch_tiles.h).
template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues);

/// Slots [slot_begin, slot_end) of the SDDMM, from dY and X in tiles (dy.n == x.n batch rows, of
/// w.rows and w.cols columns). Each slot is summed in a fixed order (tile by tile, a fixed tree
/// within a tile), so the result does not depend on how the slots are split over threads.
template <typename T, typename Index>
Status sddmm_slots(const SlotPattern<Index>& w, const BatchTiles<accum_t<T>>& dy, const BatchTiles<accum_t<T>>& x,
                   T* dvalues, int64_t slot_begin, int64_t slot_end);

/// The slots of rows [first, first + count) of W read out of a dense block of dY^T X: g is
/// [count, w.cols] row-major (rows first.. of dY^T X), dvalues[s] = g[row(s) - first, col(s)] for the
/// rows' slots. Used with expand_rows (spmm.h) by callers that multiply dense blocks themselves.
template <typename T, typename Index>
Status gather_rows(const SlotPattern<Index>& w, const T* g, int64_t first, int64_t count, T* dvalues);

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
/// count of updates (`step`) and the parameter group's settings.
template <typename T>
struct AdamWParameter {
  T* values = nullptr;
  T* exp_avg = nullptr;
  T* exp_avg_sq = nullptr;
  float* step = nullptr;
  AdamWConfig config;
  using Self = AdamWParameter;  // names the type where P must not be deduced (a bias given as nullptr)
};

/// X already transposed, as the forward leaves it when its plan transposes the whole batch at once
/// (plan_transposes_whole_input()): row c holds X[0..n-1, c] followed by zeros up to `stride`
/// values per row (the plan's batch tile), for c < w.cols. Its stride goes into the SddmmProblem.
template <typename T>
struct TransposedInput {
  const T* data = nullptr;
  int64_t stride = 0;  ///< values per row: a multiple of 4, from n rounded up to a multiple of 4 to 128
};

/// The SDDMM as `plan` says (plan_sddmm() with the kStore epilogue). Device pointers, work on
/// `stream`; `workspace` holds plan.workspace_bytes bytes (may be null when that is 0); `x_t` is
/// given exactly when the plan's problem names its stride.
template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, const SddmmPlan& plan,
             void* workspace, Stream stream, TransposedInput<T> x_t = {});

/// The weight gradient and AdamW's step in one pass (plan_sddmm() with the kAdamW epilogue): each
/// slot's gradient, computed as sddmm() computes it and rounded to T, updates values[s], exp_avg[s]
/// and exp_avg_sq[s] in place (cpu::adamw_update's arithmetic) and is never stored. The count
/// *values.step (device memory, the updates so far) is advanced by one on the device by the first
/// kernel of the call, then read by the update, so that a replayed CUDA graph uses the current
/// count and the caller launches nothing for it. values must not alias dy or x.
///
/// `bias` (optional): a bias of w.rows values updated in the same call from its gradient
/// db[r] = sum_n dY[n, r], with its own settings and count. The kRows kernel computes it from the
/// dY it holds anyway (no launch of its own); the others launch the bias kernel after the product.
///
/// P, the parameters' type, is T, or float for 16-bit T (mixed precision: float32 master values
/// and moments updated from the gradient computed from T and rounded to T, as torch.autocast
/// trains an nn.Linear).
template <typename T, typename Index, typename P = T>
Status sddmm_adamw(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, const AdamWParameter<P>& values,
                   const typename AdamWParameter<P>::Self* bias, const SddmmPlan& plan, void* workspace, Stream stream,
                   TransposedInput<T> x_t = {});

/// kDenseBlocks: the SDDMM of rows [first_row, first_row + rows) of W read from the caller's dense
/// block g = dY[:, first_row:first_row+rows]^T X ([rows, w.cols] row-major, `ld` values per row):
/// dvalues[s] = g[row(s) - first_row, col(s)] for the slots of those rows.
template <typename T, typename Index>
Status sddmm_from_block(const SlotPattern<Index>& w, const T* g, int64_t ld, int64_t first_row, int64_t rows,
                        T* dvalues, Stream stream);

/// The same with AdamW's step of those slots (sddmm_adamw()'s arithmetic; P as there). The call for
/// the first block of a step (first_block) advances *values.step by one before its update.
template <typename T, typename Index, typename P = T>
Status sddmm_adamw_from_block(const SlotPattern<Index>& w, const T* g, int64_t ld, int64_t first_row, int64_t rows,
                              const AdamWParameter<P>& values, bool first_block, Stream stream);

/// The SDDMM planned for the current device, its workspace from cudaMallocAsync (C++ users
/// without a framework).
template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues, Stream stream);

/// db = dY summed over the batch.
template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias, Stream stream);

/// The bias gradient and AdamW's step of the bias in one kernel, as sddmm_adamw() for the values:
/// db[r] (rounded to T) updates bias.values[r] and its moments in place and is never stored;
/// *bias.step is advanced by one first. P as for sddmm_adamw().
template <typename T, typename P = T>
Status bias_grad_adamw(const T* dy, int64_t n, int64_t m, const AdamWParameter<P>& bias, Stream stream);

}  // namespace cuda
}  // namespace snack
