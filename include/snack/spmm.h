// The sparse-dense products of a layer: the forward Y = act(X W^T + b) over the CSR view and the
// input gradient dX = dY W over the CSC view, on the CPU and on CUDA, and the planner that chooses
// how a CUDA product runs.
//
// Notation (PyTorch's nn.Linear conventions): the weight W is `M x K` (rows = output features),
// held in the slots of a SlotPattern with one value per slot; activations are row-major with N
// rows: X is `N x K`, Y and dY are `N x M`. Every array is dense and contiguous.
//
//   spmm_forward    Y[n, r]  = act(sum_{s in row r} v[s] * X[n, col(s)] (+ bias[r]))
//   spmm_transposed dX[n, c] = sum_{s in col c} v[s] * dY[n, row(s)]
//   spmm_channels_first  Y[b, r, p] = act(sum_{s in row r} v[s] * X[b, col(s), p] (+ bias[r]))
//                   (X [batch, K, pixels] and Y [batch, M, pixels]: a 1x1 convolution on NCHW images)
//
// Every output element is written (no zero-initialisation is needed). Results are deterministic
// (each output reduced in a fixed order, no atomics) except with the opt-in kCooAtomic variant.
// Value types: float, double, bfloat16 and float16 (snack/value_types.h; the 16-bit types are
// computed in float, each output rounded once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "snack/activation.h"
#include "snack/batch_tiles.h"
#include "snack/device_limits.h"
#include "snack/pattern.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack {

/// The CUDA kernels of a product. Each can be forced (benchmarks, tests); kAuto lets the planner choose.
enum class SpmmVariant : int {
  kAuto = 0,
  kWarpRow,    ///< reference: a warp per output row, X read row-major from global memory
  kGlobalXT,   ///< X transposed once into a [K + 1, tile] workspace, read as 16-byte vectors through L1
  kGlobalX,    ///< X read in place (row-major) through L1: no transpose launch, no workspace
  kWideRows,   ///< a warp per group of consecutive rows streams their slots with 16-byte loads, a batch
               ///< tile of X (1, 2, 4 or 8 rows) in shared memory. Forward only by name (dX runs it as the
               ///< planner's choice over a copy of the CSC view).
  kCooAtomic,  ///< SNACK-style COO: grid.y maps batch rows, slots split evenly, atomicAdd per row segment.
               ///< Float atomics make it non-deterministic: only when forced. Forward only.
  kTensorCore, ///< 16-bit values only: bands of 64 rows expanded chunk by chunk into dense tiles in shared
               ///< memory and multiplied with mma.sync (fp32 accumulation); a cluster splits a band's columns.
  kDenseBlocks,  ///< large batches: W expanded a block of SpmmPlan::block_rows outputs at a time into a dense
                 ///< workspace (expand_block) that the caller multiplies with its dense GEMM (cuBLAS through
                 ///< the torch front end). Planned only for a problem with `gemm` set.
  kSharedX,    ///< large batches on CUDA cores (fp32 and 16-bit): a block owns a band of rows and a batch tile of
               ///< 128 (fp32) or 256 (16-bit) rows; chunks of X, transposed once, are staged in shared memory and
               ///< read there by every row of the band.
  kWgmma,      ///< 16-bit values on Hopper (sm_90a build, compute capability 9.0). Given tile fragments (forward):
               ///< a warpgroup loads each tile's A operands from them into registers and multiplies with wgmma,
               ///< batch tiles of 16-128 rows (the planner's choice from 17 rows; SpmmReason::kFragmentWgmma).
               ///< Without them, forced only: the slots sorted into per-tile lists (workspace), expanded on chip
               ///< by a producer warpgroup while the copy engine brings X and two consumer warpgroups multiply
               ///< with wgmma; in_dim a multiple of 8.
  kTileView,   ///< 16-bit values: the pattern's tile view (SlotPattern::tile_ptr) read tile by tile, each
               ///< 64 x 64 tile's slots scattered by the whole block into shared memory (values gathered in
               ///< slot order), multiplied with mma.sync; a cluster splits a band's tiles. dX reads the same
               ///< tiles down W's columns, each scattered transposed. Batch tiles of 16-64 rows. Needs a
               ///< pattern with the tile view (at most 16384 inputs).
};

/// Name used by the Python API and the benchmarks ("auto", "warp_row", "global_xt", "global_x",
/// "wide_rows", "coo_atomic", "tensor_core", "dense_blocks", "shared_x", "wgmma", "tile_view").
const char* spmm_variant_name(SpmmVariant v);
/// Parses a name; returns false for an unknown name.
bool parse_spmm_variant(const std::string& name, SpmmVariant* out);
/// Every variant but kAuto, in declaration order.
const std::vector<SpmmVariant>& spmm_variants();
/// Whether a variant computes only the forward product, not dX = dY W.
inline bool spmm_variant_is_forward_only(SpmmVariant v) {
  return v == SpmmVariant::kCooAtomic || v == SpmmVariant::kWideRows;
}
/// Whether repeated runs give bitwise equal results.
inline bool spmm_variant_is_deterministic(SpmmVariant v) { return v != SpmmVariant::kCooAtomic; }

/// Why the planner chose its variant.
enum class SpmmReason : int {
  kForced = 0,     ///< the caller named the variant
  kWideRows,       ///< 1-4 batch rows (1-8 in 16 bits) of a large layer: W streamed, the batch in shared memory
  kSingleRow,      ///< one batch row: X read in place through L1
  kSmallInput,     ///< X small enough to stay in L1: read in place, no transpose launch
  kTinyProduct,    ///< too few multiply-adds for a transpose launch to pay
  kTransposeOnce,  ///< X transposed once and read as 16-byte vectors through L1
  kTensorCores,    ///< 16-bit values, many batch rows, a high density: tensor cores
  kDenseBlocks,    ///< a batch large enough that a dense GEMM over expanded blocks of W beats the sparse kernels
  kSharedInput,    ///< a batch of hundreds of rows: X staged in shared memory, shared by a band of rows
  kTileView,       ///< 16-bit values, up to 128 batch rows of a sparse layer: the tile view on tensor cores
  kFragmentWgmma,  ///< tile fragments given, 17-128 batch rows, on Hopper: wgmma with the operands in registers
};

/// Smallest batch the tensor-core kernel is ever planned for (below it wide_rows and the row kernels
/// read fewer bytes of X per slot than a tensor core wastes); plan.cpp says where above it it pays.
inline constexpr int64_t kTensorCoreMinBatch = 9;
/// A short token ("forced", "wide_rows", "single_row", "small_input", "tiny_product",
/// "transpose_once", "tensor_cores", "dense_blocks", "shared_input", "tile_view", "fragment_wgmma") and a
/// sentence saying what it means.
const char* spmm_reason_name(SpmmReason r);
const char* spmm_reason_text(SpmmReason r);

/// How the transposed product (dX) reaches W's slots in column order.
enum class CscRead : int {
  kAuto = 0,  ///< the planner chooses
  kInPlace,   ///< the kernel reads each slot through csc_perm: a position, then the slot's row and value gathered
  kCopied,    ///< one pass first gathers the CSC view into the workspace as the CSR arrays of W^T (each entry's
              ///< row and value, in column order); the product then runs as a forward over them, planned and
              ///< launched as the forward of a K x M weight (wide_rows as the planner's choice only;
              ///< never dense_blocks, wgmma or coo_atomic)
};
/// "auto", "in_place", "copied".
const char* csc_read_name(CscRead r);
/// Parses a name; returns false for an unknown name.
bool parse_csc_read(const std::string& name, CscRead* out);

/// How a 1x1 convolution on NCHW images (x [B, K, P] -> y [B, M, P], spmm_channels_first) runs on
/// the GPU. The CPU reads the images in place whatever the path.
enum class ChannelsFirstPath : int {
  kAuto = 0,     ///< the planner chooses (plan_channels_first)
  kInPlace,      ///< the images read in place: a warp per output channel and tile of pixels
                 ///< (cuda::spmm_channels_first)
  kPixelRows,    ///< the pixels as the batch rows of the forward product, between two transposes of the
                 ///< activations (spmm's planner then picks the kernel)
  kDenseBlocks,  ///< W expanded a block of output channels at a time into a workspace no larger than the
                 ///< images, each block multiplied by the framework's dense 1x1 convolution (cuDNN)
                 ///< over the images in place
};
/// "auto", "in_place", "pixel_rows", "dense_blocks".
const char* channels_first_path_name(ChannelsFirstPath p);
/// Parses a name; returns false for an unknown name.
bool parse_channels_first_path(const std::string& name, ChannelsFirstPath* out);
/// Every path but kAuto, in declaration order.
const std::vector<ChannelsFirstPath>& channels_first_paths();

/// A 1x1 convolution to plan: W is out_channels x in_channels with nnz slots; `batch` images of
/// `pixels` pixels each.
struct ChannelsFirstProblem {
  int64_t out_channels = 0;
  int64_t in_channels = 0;
  int64_t nnz = 0;
  int64_t batch = 0;
  int64_t pixels = 0;
  int value_bytes = 4;
  bool tf32 = false;  ///< float32 convolutions may round to TF32 (torch.backends.cudnn.allow_tf32)
  Activation act = Activation::kNone;  ///< fused into the product
};

/// How the forward is given the weight's 16-bit values besides the slots (snack/pattern.h).
enum class TileValues : int {
  kNone = 0,   ///< the values alone, in slot order
  kPacked,     ///< packed tile values (pack_tile_values): kTileView reads them with the view's entries
  kFragments,  ///< tile fragments (pack_tile_fragments): kTileView loads them as mma.sync operands, kWgmma as
               ///< wgmma's A operands
  kBitmaps,    ///< bitmap fragments (pack_tile_bitmaps): read by the same kernels as kFragments, each
               ///< operand built from the stored values one by one
};

/// Whether the forward is given tile fragments of either layout (kFragments, kBitmaps): the planner
/// plans both alike.
constexpr bool holds_fragments(TileValues t) { return t == TileValues::kFragments || t == TileValues::kBitmaps; }

/// The most consumer warpgroups a block of the wgmma forward over tile fragments holds
/// (SpmmProblem::fragment_warpgroups).
constexpr int kMaxFragmentWarpgroups = 2;

/// One product to plan. The forward is (out_dim, in_dim) = (M, K); the transposed product, over the
/// CSC view, is (K, M).
struct SpmmProblem {
  int64_t out_dim = 0;  ///< outputs per batch row
  int64_t in_dim = 0;   ///< inputs per batch row
  int64_t nnz = 0;      ///< stored entries
  int64_t n = 0;        ///< batch rows
  int value_bytes = 4;  ///< bytes of a value (and of an activation): 2, 4 or 8
  bool transposed = false;
  SpmmVariant requested = SpmmVariant::kAuto;
  /// The caller multiplies dense blocks with a GEMM of its own (kDenseBlocks may be planned).
  bool gemm = false;
  /// The caller's float32 GEMMs may round to TF32 (torch.backends.cuda.matmul.allow_tf32).
  bool tf32 = false;
  /// The transposed product: how its kernels read the CSC view (ignored for the forward).
  CscRead csc = CscRead::kAuto;
  /// The pattern holds the tile view (SlotPattern::tile_ptr): kTileView may run the product.
  bool tile_view = false;
  /// kTileView, and kWgmma over tile fragments: blocks per band (one cluster that splits the band's
  /// chunks), 1 to 8 and at most the band's chunks of 64 inputs; 0 lets the planner choose. Other
  /// variants ignore it.
  int tile_view_splits = 0;
  /// kWgmma over tile fragments: consumer warpgroups per block (1 to kMaxFragmentWarpgroups, which
  /// take the band's tiles in turn); 0 lets the planner choose. Other variants ignore it.
  int fragment_warpgroups = 0;
  /// What the forward is given of the weight's values in tile order (snack/pattern.h): kTileView reads
  /// them instead of gathering the values, and the planner takes it over a wider range. The
  /// transposed product is given none (a plan that packs W^T's fragments names kFragments).
  TileValues packed_tiles = TileValues::kNone;
  /// Given no values in tile order (packed_tiles kNone), the caller can pack tile fragments for this
  /// one product where the plan asks for them (SpmmPlan::packs_fragments): W's for the forward, W^T's
  /// (transposed tile fragments) for the transposed product. kAuto only.
  bool can_pack_fragments = false;
  bool operator==(const SpmmProblem& o) const {
    return out_dim == o.out_dim && in_dim == o.in_dim && nnz == o.nnz && n == o.n && value_bytes == o.value_bytes &&
           transposed == o.transposed && requested == o.requested && gemm == o.gemm && tf32 == o.tf32 &&
           csc == o.csc && tile_view == o.tile_view && tile_view_splits == o.tile_view_splits &&
           fragment_warpgroups == o.fragment_warpgroups && packed_tiles == o.packed_tiles &&
           can_pack_fragments == o.can_pack_fragments;
  }
};

/// Bytes of one row index in the copy of the CSC view (CscRead::kCopied): 2 where both dimensions
/// fit a uint16 slot index, else 4.
inline int csc_copy_index_bytes(const SpmmProblem& p) {
  return p.out_dim <= kMaxDim16 && p.in_dim <= kMaxDim16 ? 2 : 4;
}

/// kDenseBlocks never holds more of W at once than this many outputs' rows, or the batch's N
/// where that is more: the workspace stays within the product's own activation operand (X, or dY
/// for the transposed product) wherever the planner chooses it (at batches of at least this).
inline constexpr int64_t kDenseBlockMinRows = 128;
/// The most batch rows for which a forward packs tile fragments for one product
/// (SpmmPlan::packs_fragments): past them the packing costs more than it gains.
inline constexpr int64_t kFragmentPackMaxRows = 512;
/// ... and the densest weight (stored slots over rows x cols) for which it does.
inline constexpr double kFragmentPackMaxDensity = 0.25;

/// How a CUDA product runs. Made by plan_spmm() for one problem; the launch checks that it is given
/// that problem.
struct SpmmPlan {
  SpmmProblem problem;
  SpmmVariant variant = SpmmVariant::kWarpRow;
  SpmmReason reason = SpmmReason::kForced;
  int batch_tile = 1;          ///< batch rows per pass (a power of two: 1..128; kWideRows 1..8)
  int lanes_per_row = 32;      ///< lanes of a warp that split one row's entries (row kernels)
  int rows_per_warp = 1;       ///< kWideRows: consecutive rows a warp group sums at once (1..16)
  int32_t long_row_threshold = 1 << 30;  ///< rows with more entries are summed by a whole block
  int64_t grid_x = 1;          ///< blocks along x (grid.y runs the batch tiles)
  int threads = 256;           ///< threads per block
  size_t smem_bytes = 0;       ///< dynamic shared memory per block
  size_t workspace_bytes = 0;  ///< device workspace the caller provides (X^T of kGlobalXT with a tile > 1 and
                               ///< kSharedX, kDenseBlocks' block, kWgmma's lists, a copy of the CSC view)
  bool prefetch_l2 = false;    ///< small product: each block first asks L2 for its share of the operands
  int k_splits = 1;            ///< kTensorCore, kWgmma: blocks (one cluster) that split each band's columns
  int chunk = 0;               ///< kTensorCore, kWgmma: input columns per expanded tile (64); kSharedX: per stage
  int64_t block_rows = 0;      ///< kDenseBlocks: outputs per expanded block (workspace: block_rows x in_dim values)
  /// The forward runs a fragment kernel over the tile fragments it is given: kTileView's (mma.sync;
  /// forced, or where they pay) or kWgmma's (always, given them). Otherwise kTileView's kernel reads
  /// the values (or the packed tile values).
  bool reads_fragments = false;
  /// The caller packs the tile fragments (pack_tile_fragments; transposed for the transposed product,
  /// which then runs as the forward of W^T over them) before the launch and gives them to it: a
  /// problem that can (SpmmProblem::can_pack_fragments) and where the packing pays. The plan's problem
  /// then names them given (packed_tiles kFragments).
  bool packs_fragments = false;
  /// kWgmma over tile fragments: consumer warpgroups per block, each taking every other tile of the
  /// band with accumulators of its own (1 or 2).
  int consumer_warpgroups = 1;
  /// Transposed product: the CSC view is first copied into the workspace (CscRead::kCopied) and the
  /// variant runs as the forward over the copy, whose row indices (csc_copy_index_bytes each) start
  /// at byte copy_offset and whose values follow at the next 16-byte boundary.
  bool csc_copied = false;
  size_t copy_offset = 0;
};

/// Plans a product on a GPU with `limits`. A requested variant that cannot run the problem (a
/// forward-only variant named for the transposed product, a copy of the CSC view forced on
/// kDenseBlocks or kWgmma, a wide_rows tile of X that does not fit in shared memory, more batch
/// tiles than a grid holds) is an InvalidArgument; kAuto always plans.
/// Pure: no device is queried.
Status plan_spmm(const SpmmProblem& problem, const DeviceLimits& limits, SpmmPlan* plan);
/// Whether the forward run with this plan leaves all of X transposed in its workspace, as
/// TransposedInput (sddmm.h) describes it (stride plan.batch_tile): a global_xt plan whose one batch
/// tile holds the whole batch.
bool plan_transposes_whole_input(const SpmmPlan& plan);
/// One line: the variant, its launch shape and why.
std::string describe(const SpmmPlan& plan);

/// The path of a 1x1 convolution on NCHW images (never kAuto): the one of the three whose estimated
/// time is least, from rates measured on the H200 and scaled by the SM count (docs/kernels.md, "1x1
/// convolutions on NCHW images"). Pure: no device is queried.
ChannelsFirstPath plan_channels_first(const ChannelsFirstProblem& problem, const DeviceLimits& limits);
/// Output channels per block of kDenseBlocks: all of them where the dense W is no larger than the
/// images (batch x pixels x in_channels values), else as many as that holds, a multiple of 64 and
/// at least 64.
int64_t channels_first_block_rows(const ChannelsFirstProblem& problem);

namespace cpu {

/// Y = act(X W^T (+ bias)). x: [n, w.cols]; bias: [w.rows] or nullptr; y: [n, w.rows]. One thread;
/// X is first laid out in tiles (snack/batch_tiles.h).
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Activation act = Activation::kNone);

/// Output rows [row_begin, row_end) of the forward, from X in tiles (x.n batch rows of w.cols
/// columns): y[i, r] for every batch row i. Each output is summed in a fixed order, so the result
/// does not depend on how the rows are split over threads.
template <typename T, typename Index>
Status spmm_forward_rows(const SlotPattern<Index>& w, const T* values, const BatchTiles<accum_t<T>>& x,
                         const T* bias, T* y, Activation act, int64_t row_begin, int64_t row_end);

/// dX = dY W. dy: [n, w.rows]; dx: [n, w.cols]. Walks W's rows (CSR), scattering into dX's
/// columns. One thread.
template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx);

/// Output columns [col_begin, col_end) of dX, from dY in tiles (dy.n batch rows of w.rows columns):
/// every row of W adds its slots in those columns, rows in order, so the result does not depend on
/// how the columns are split over threads. Needs the whole pattern, as every dX does.
template <typename T, typename Index>
Status spmm_transposed_columns(const SlotPattern<Index>& w, const T* values, const BatchTiles<accum_t<T>>& dy, T* dx,
                               int64_t col_begin, int64_t col_end);

/// The forward on channels-first activations, a 1x1 convolution on NCHW images read in place:
/// x [batch, w.cols, pixels], y [batch, w.rows, pixels],
/// y[b, r, p] = act(sum_{s in row r} v[s] * x[b, col(s), p] (+ bias[r])).
template <typename T, typename Index>
Status spmm_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                           const T* bias, T* y, Activation act = Activation::kNone);

/// Dense blocks (large batches at a high density, where a GEMM beats the sparse loops): rows
/// [first, first + count) of W written dense into `block` ([count, w.cols] row-major, zeros where no
/// slot is stored). Rows are independent, so callers may fill a block from several threads.
template <typename T, typename Index>
Status expand_rows(const SlotPattern<Index>& w, const T* values, int64_t first, int64_t count, T* block);

/// Columns [first, first + count) of W, dense: rows [row_begin, row_end) of `block` ([w.rows, count]
/// row-major, zeros where no slot is stored), each row's entries in the range found by a binary search
/// of its sorted columns. Rows are independent, so callers may fill a block from several threads.
template <typename T, typename Index>
Status expand_columns(const SlotPattern<Index>& w, const T* values, int64_t first, int64_t count, int64_t row_begin,
                      int64_t row_end, T* block);

/// Output channels [row_begin, row_end) of spmm_channels_first, for every image and pixel, from the
/// images in T's accumulation type (16-bit images widened first, once for all the channels).
template <typename T, typename Index>
Status spmm_channels_first_rows(const SlotPattern<Index>& w, const T* values, const accum_t<T>* x, int64_t batch,
                                int64_t pixels, const T* bias, T* y, Activation act, int64_t row_begin,
                                int64_t row_end);

}  // namespace cpu

namespace cuda {

/// The two products as `plan` says (plan_spmm() for this pattern's shape and batch). All pointers
/// address device memory of the current device; work is enqueued on `stream`. `workspace` holds
/// plan.workspace_bytes bytes (may be null when that is 0) and stays in use until the work on
/// `stream` is done. A non-ok Status means the launch failed; errors raised asynchronously by a
/// kernel surface at the next synchronisation.
///
/// packed_tiles (spmm_forward, 16-bit values): the weight's values in tile order, as
/// plan.problem.packed_tiles says (snack/pattern.h): packed tile values (pack_tile_values) or tile
/// fragments (pack_tile_fragments, int32 words), made from `values` and this pattern, on a 16-byte
/// boundary; where the plan runs kTileView its kernel reads them instead of the values. nullptr (and
/// TileValues::kNone): the values alone.
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    const SpmmPlan& plan, void* workspace, Stream stream, Activation act = Activation::kNone,
                    const uint32_t* packed_tiles = nullptr);
/// fragments (spmm_transposed): W^T's tile fragments (pack_tile_fragments, transposed), made from
/// `values` and this pattern, on a 16-byte boundary, where the plan reads them (plan.reads_fragments,
/// a plan that packs them); else nullptr.
template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx,
                       const SpmmPlan& plan, void* workspace, Stream stream, const uint32_t* fragments = nullptr);

/// kDenseBlocks: outputs [first, first + count) of the product's view of W written dense into
/// `block` ([count, in_dim] row-major; zeros where no slot is stored): rows of W for the forward
/// (in_dim = w.cols), columns of W, i.e. rows of W^T, for the transposed product (in_dim = w.rows).
/// The caller then computes Y[:, first:first+count] = X block^T with its GEMM (X: [n, in_dim]).
template <typename T, typename Index>
Status expand_block(const SlotPattern<Index>& w, const T* values, bool transposed, int64_t first, int64_t count,
                    T* block, Stream stream);

/// The same, planned for the current device and with a workspace from cudaMallocAsync: for C++
/// users without a framework.
template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Stream stream, Activation act = Activation::kNone);
template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx, Stream stream);

/// cpu::spmm_channels_first on the GPU (no plan, no workspace): a warp per output channel and tile of
/// 32 x V pixels, each slot one coalesced load of V pixels of its input channel (V: the widest vector
/// of at most 16 bytes that divides `pixels` and the operands' alignment).
template <typename T, typename Index>
Status spmm_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                           const T* bias, T* y, Stream stream, Activation act = Activation::kNone);

}  // namespace cuda
}  // namespace snack
