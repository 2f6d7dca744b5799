// Names of the enums that the Python API passes as strings or reads back (activations, kernel
// variants, the planners' reasons): one table per enum serves both directions.
#include <string>
#include <vector>

#include "snack/activation.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"

namespace snack {
namespace {

template <typename E>
struct Named {
  E value;
  const char* name;
  const char* text = "";
};

constexpr Named<Activation> kActivations[] = {
    {Activation::kNone, "none"}, {Activation::kReLU, "relu"}, {Activation::kGELU, "gelu"}};
constexpr Named<CscRead> kCscReads[] = {
    {CscRead::kAuto, "auto"}, {CscRead::kInPlace, "in_place"}, {CscRead::kCopied, "copied"}};
constexpr Named<ChannelsFirstPath> kChannelsFirstPaths[] = {{ChannelsFirstPath::kAuto, "auto"},
                                                            {ChannelsFirstPath::kInPlace, "in_place"},
                                                            {ChannelsFirstPath::kPixelRows, "pixel_rows"},
                                                            {ChannelsFirstPath::kDenseBlocks, "dense_blocks"}};
constexpr Named<SpmmVariant> kSpmmVariants[] = {{SpmmVariant::kAuto, "auto"},
                                                {SpmmVariant::kWarpRow, "warp_row"},
                                                {SpmmVariant::kGlobalXT, "global_xt"},
                                                {SpmmVariant::kGlobalX, "global_x"},
                                                {SpmmVariant::kWideRows, "wide_rows"},
                                                {SpmmVariant::kCooAtomic, "coo_atomic"},
                                                {SpmmVariant::kTensorCore, "tensor_core"},
                                                {SpmmVariant::kDenseBlocks, "dense_blocks"},
                                                {SpmmVariant::kSharedX, "shared_x"},
                                                {SpmmVariant::kWgmma, "wgmma"},
                                                {SpmmVariant::kTileView, "tile_view"}};
constexpr Named<SddmmVariant> kSddmmVariants[] = {{SddmmVariant::kAuto, "auto"},
                                                  {SddmmVariant::kSlot, "slot"},
                                                  {SddmmVariant::kVector, "vector"},
                                                  {SddmmVariant::kRows, "rows"},
                                                  {SddmmVariant::kDenseBlocks, "dense_blocks"},
                                                  {SddmmVariant::kStaged, "staged"},
                                                  {SddmmVariant::kTensorCore, "tensor_core"},
                                                  {SddmmVariant::kTileView, "tile_view"},
                                                  {SddmmVariant::kTileViewWgmma, "tile_view_wgmma"}};
constexpr Named<SpmmReason> kSpmmReasons[] = {
    {SpmmReason::kForced, "forced", "the variant was named by the caller"},
    {SpmmReason::kWideRows, "wide_rows",
     "a few batch rows of a large layer: a warp per group of rows streams their slots with 16-byte loads, the batch "
     "in shared memory"},
    {SpmmReason::kSingleRow, "single_row", "one batch row: X read in place through L1"},
    {SpmmReason::kSmallInput, "small_input", "X small enough to stay in L1: read in place, no transpose launch"},
    {SpmmReason::kTinyProduct, "tiny_product",
     "too few multiply-adds for a transpose launch to pay: X read in place through L1"},
    {SpmmReason::kTransposeOnce, "transpose_once", "X transposed once, 16-byte vectors of it read through L1"},
    {SpmmReason::kTensorCores, "tensor_cores",
     "16-bit values, many batch rows and a high density: tiles of W expanded in shared memory, multiplied on tensor "
     "cores"},
    {SpmmReason::kDenseBlocks, "dense_blocks",
     "a batch large enough that a dense GEMM beats the sparse kernels: W expanded a block of outputs at a time into "
     "a workspace no larger than the batch's activations, multiplied by cuBLAS"},
    {SpmmReason::kTileView, "tile_view",
     "16-bit values, up to 128 batch rows of a sparse layer: each 64 x 64 tile's slots read contiguously from the "
     "pattern's tile view (down W's columns for dX), expanded in shared memory and multiplied on tensor cores"},
    {SpmmReason::kFragmentWgmma, "fragment_wgmma",
     "tile fragments given, 17-128 batch rows, on Hopper: a warpgroup loads each 64 x 64 tile's operands from the "
     "fragments into registers and multiplies them with wgmma over the chunk of X in shared memory"},
    {SpmmReason::kSharedInput, "shared_input",
     "a batch of hundreds of rows: X transposed once and staged in shared memory chunk by chunk, each chunk read by "
     "a band of output rows (X crosses L2 once per band, not once per entry)"}};
constexpr Named<SddmmReason> kSddmmReasons[] = {
    {SddmmReason::kForced, "forced", "the variant was named by the caller"},
    {SddmmReason::kSmallBatch, "small_batch", "below a batch of 4: one thread per slot, no transposes"},
    {SddmmReason::kRowsKernel, "rows_kernel",
     "a warp per row of W keeps dY's row in registers and gathers X^T through L1"},
    {SddmmReason::kBeyondRows, "beyond_rows", "a batch past the rows kernel's 128: dY and X transposed once"},
    {SddmmReason::kAdamWBatchOf4, "adamw_batch_of_4",
     "AdamW's epilogue at a padded batch of 4 runs faster in the vector kernel"},
    {SddmmReason::kDenseBlocks, "dense_blocks",
     "a batch large enough that a dense GEMM beats the sparse kernels: dY^T X computed by cuBLAS a block of rows at a "
     "time (a workspace no larger than X), the stored slots read out of each block"},
    {SddmmReason::kStagedTiles, "staged_tiles",
     "a float32 batch past the rows kernel's 128: a block per tile of W streams dY and X through shared memory, "
     "each slot's sum kept in registers (X crosses L2 once per band of rows, dY once per chunk of columns)"},
    {SddmmReason::kTensorCores, "tensor_cores",
     "16-bit operands: dense 128 x 128 tiles of dY^T X multiplied on tensor cores from dY and X staged in shared "
     "memory, the stored slots read out of each tile (no gather of X per slot)"},
    {SddmmReason::kTileView, "tile_view",
     "16-bit operands, up to 128 batch rows: each 64 x 64 tile of the pattern's tile view that holds slots computed "
     "as dense dY^T X on tensor cores, its slots read out of the list the view keeps"},
    {SddmmReason::kTileViewWgmma, "tile_view_wgmma",
     "16-bit operands, 33-128 batch rows, on Hopper: the tile view's 64 x 64 tiles of dY^T X multiplied with wgmma "
     "(dY's band in registers) while the warpgroup reads the slots of the tile before out of shared memory"}};

template <typename E, size_t N>
const Named<E>* find(const Named<E> (&table)[N], E v) {
  for (const Named<E>& entry : table)
    if (entry.value == v) return &entry;
  return nullptr;
}

template <typename E, size_t N>
bool parse_in(const Named<E> (&table)[N], const std::string& name, E* out) {
  for (const Named<E>& entry : table) {
    if (name == entry.name) {
      *out = entry.value;
      return true;
    }
  }
  return false;
}

// Every value of a variant table but the first (kAuto).
template <typename E, size_t N>
std::vector<E> all_but_auto(const Named<E> (&table)[N]) {
  std::vector<E> out;
  for (size_t i = 1; i < N; ++i) out.push_back(table[i].value);
  return out;
}

template <typename E, size_t N>
const char* name_in(const Named<E> (&table)[N], E v) {
  const Named<E>* entry = find(table, v);
  return entry ? entry->name : "unknown";
}

template <typename E, size_t N>
const char* text_in(const Named<E> (&table)[N], E v) {
  const Named<E>* entry = find(table, v);
  return entry ? entry->text : "unknown";
}

}  // namespace

const char* activation_name(Activation act) { return name_in(kActivations, act); }
bool parse_activation(const std::string& name, Activation* out) { return parse_in(kActivations, name, out); }

const char* spmm_variant_name(SpmmVariant v) { return name_in(kSpmmVariants, v); }
bool parse_spmm_variant(const std::string& name, SpmmVariant* out) { return parse_in(kSpmmVariants, name, out); }
const std::vector<SpmmVariant>& spmm_variants() {
  static const std::vector<SpmmVariant> all = all_but_auto(kSpmmVariants);
  return all;
}
const char* csc_read_name(CscRead r) { return name_in(kCscReads, r); }
bool parse_csc_read(const std::string& name, CscRead* out) { return parse_in(kCscReads, name, out); }
const char* channels_first_path_name(ChannelsFirstPath p) { return name_in(kChannelsFirstPaths, p); }
bool parse_channels_first_path(const std::string& name, ChannelsFirstPath* out) {
  return parse_in(kChannelsFirstPaths, name, out);
}
const std::vector<ChannelsFirstPath>& channels_first_paths() {
  static const std::vector<ChannelsFirstPath> all = all_but_auto(kChannelsFirstPaths);
  return all;
}
const char* spmm_reason_name(SpmmReason r) { return name_in(kSpmmReasons, r); }
const char* spmm_reason_text(SpmmReason r) { return text_in(kSpmmReasons, r); }

const char* sddmm_variant_name(SddmmVariant v) { return name_in(kSddmmVariants, v); }
bool parse_sddmm_variant(const std::string& name, SddmmVariant* out) { return parse_in(kSddmmVariants, name, out); }
const std::vector<SddmmVariant>& sddmm_variants() {
  static const std::vector<SddmmVariant> all = all_but_auto(kSddmmVariants);
  return all;
}
const char* sddmm_reason_name(SddmmReason r) { return name_in(kSddmmReasons, r); }
const char* sddmm_reason_text(SddmmReason r) { return text_in(kSddmmReasons, r); }

}  // namespace snack
