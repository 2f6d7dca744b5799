#include "op_args.h"

#include <atomic>
#include <limits>

namespace snack::binding {

void throw_if_error(const Status& status, const char* op) {
  if (status.ok()) return;
  const std::string msg = std::string("snack.") + op + ": " + status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kDuplicateEntry: TORCH_CHECK_VALUE(false, msg);
    case StatusCode::kOutOfRange: TORCH_CHECK_INDEX(false, msg);
    case StatusCode::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    default: TORCH_CHECK(false, msg);
  }
}

const char* pattern_field_name(int field) {
  static const char* const kNames[kPatternFields] = {"row_idx",  "col_idx",  "row_ptr",     "col_ptr",
                                                     "csc_perm", "tile_ptr", "tile_entries"};
  return field >= 0 && field < kPatternFields ? kNames[field] : "unknown";
}

void check_1d(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "snack.", op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.dim() == 1, "snack.", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "snack.", op, ": ", name, " must be contiguous");
}

void check_same_device(const at::Tensor& t, const at::Device& device, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.device() == device, "snack.", op, ": ", name, " is on ", t.device(), " but the pattern is on ",
                    device);
}

void check_pattern_needs(at::TensorList pattern, PatternNeeds needs, const char* op) {
  // Traced with symbolic sizes (torch.compile): the ops the trace calls check the real tensors.
  if (pattern[kRowIdx].unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      pattern[kColIdx].unsafeGetTensorImpl()->has_symbolic_sizes_strides())
    return;
  TORCH_CHECK_VALUE(!kept_for_inference(pattern[kRowIdx], pattern[kColIdx]) || needs == PatternNeeds::kForward,
                    "snack.", op,
                    ": the pattern holds only the forward's arrays (Pattern.for_inference dropped row_idx and "
                    "csc_perm), and the gradients need them: run it under torch.no_grad() or "
                    "torch.inference_mode(), or call Pattern.for_training()");
}

PatternArg pattern_arg(at::TensorList pattern, const char* op, PatternNeeds needs) {
  TORCH_CHECK_VALUE(pattern.size() == size_t(kPatternFields), "snack.", op, ": pattern must hold ", int(kPatternFields),
                    " tensors (row_idx, col_idx, row_ptr, col_ptr, csc_perm, tile_ptr, tile_entries), got ",
                    pattern.size());
  for (int f = 0; f < kPatternFields; ++f) check_1d(pattern[f], pattern_field_name(f), op);
  PatternArg p;
  p.row_idx = pattern[kRowIdx];
  p.col_idx = pattern[kColIdx];
  p.row_ptr = pattern[kRowPtr];
  p.col_ptr = pattern[kColPtr];
  p.csc_perm = pattern[kCscPerm];
  p.tile_ptr = pattern[kTilePtr];
  p.tile_entries = pattern[kTileEntries];
  p.index_type = p.row_idx.scalar_type();
  p.device = p.row_idx.device();
  TORCH_CHECK_TYPE(p.index_type == at::kUInt16 || p.index_type == at::kInt, "snack.", op,
                   ": row_idx must be uint16 or int32, got ", p.index_type);
  TORCH_CHECK_TYPE(p.col_idx.scalar_type() == p.index_type, "snack.", op, ": col_idx dtype ", p.col_idx.scalar_type(),
                   " differs from row_idx dtype ", p.index_type);
  TORCH_CHECK_TYPE(p.row_ptr.scalar_type() == at::kInt && p.col_ptr.scalar_type() == at::kInt &&
                       p.csc_perm.scalar_type() == at::kInt,
                   "snack.", op, ": row_ptr, col_ptr and csc_perm must be int32");
  TORCH_CHECK_VALUE(p.row_ptr.size(0) >= 1 && p.col_ptr.size(0) >= 1, "snack.", op,
                    ": row_ptr and col_ptr need at least one element");
  p.rows = p.row_ptr.size(0) - 1;
  p.cols = p.col_ptr.size(0) - 1;
  p.nnz = p.col_idx.size(0);
  // row_idx and csc_perm hold a slot each, or are both empty: a pattern kept for inference.
  const bool forward_only = p.forward_only() && p.csc_perm.numel() == 0;
  TORCH_CHECK_VALUE(forward_only || (p.row_idx.size(0) == p.nnz && p.csc_perm.size(0) == p.nnz), "snack.", op,
                    ": row_idx, col_idx and csc_perm must have the same length (", p.row_idx.size(0), ", ", p.nnz,
                    ", ", p.csc_perm.size(0), "), or row_idx and csc_perm none (a pattern kept for inference)");
  check_pattern_needs(pattern, needs, op);
  TORCH_CHECK_TYPE(p.tile_ptr.scalar_type() == at::kInt && p.tile_entries.scalar_type() == at::kInt, "snack.", op,
                   ": tile_ptr and tile_entries must be int32");
  // The tile view is whole or absent (both empty: the layer is wider than the view allows, or a
  // pattern list made without it).
  const bool no_tiles = p.tile_ptr.numel() == 0 && p.tile_entries.numel() == 0;
  TORCH_CHECK_VALUE(no_tiles || (p.tile_ptr.numel() == tile_view_ptr_length(p.rows, p.cols) &&
                                 p.tile_entries.numel() == tile_view_entries_length(p.rows, p.cols, p.nnz)),
                    "snack.", op, ": tile_ptr and tile_entries must hold ", tile_view_ptr_length(p.rows, p.cols),
                    " and ", tile_view_entries_length(p.rows, p.cols, p.nnz), " elements (or none), got ",
                    p.tile_ptr.numel(), " and ", p.tile_entries.numel());
  for (int f = 1; f < kPatternFields; ++f) check_same_device(pattern[f], p.device, pattern_field_name(f), op);
  return p;
}

Activation activation_arg(c10::string_view name, const char* op) {
  Activation act = Activation::kNone;
  TORCH_CHECK_VALUE(parse_activation(std::string(name), &act), "snack.", op, ": unknown activation '", name,
                    "' (expected none, relu or gelu)");
  return act;
}

namespace {
std::atomic<int> g_default_variant{static_cast<int>(SpmmVariant::kAuto)};

// "auto, " and the names of `values` (an enum's values but kAuto), for the errors of unknown names.
template <typename E>
std::string names_with_auto(const std::vector<E>& values, const char* (*name)(E)) {
  std::string names = "auto";
  for (E v : values) names += std::string(", ") + name(v);
  return names;
}
std::string spmm_variant_list() { return names_with_auto(spmm_variants(), &spmm_variant_name); }
}  // namespace

SpmmVariant spmm_variant_arg(c10::string_view name, bool transposed, const char* op) {
  SpmmVariant v = SpmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_spmm_variant(std::string(name), &v), "snack.", op, ": unknown variant '", name,
                    "' (expected ", spmm_variant_list(), ")");
  if (v == SpmmVariant::kAuto) v = static_cast<SpmmVariant>(g_default_variant.load());
  // The process default may name a forward-only kernel; the transposed product then plans itself.
  if (transposed && spmm_variant_is_forward_only(v)) {
    TORCH_CHECK_VALUE(name == "auto", "snack.", op, ": ", spmm_variant_name(v), " runs only the forward product");
    v = SpmmVariant::kAuto;
  }
  return v;
}

ChannelsFirstPath channels_first_path_arg(c10::string_view name, const char* op) {
  ChannelsFirstPath path = ChannelsFirstPath::kAuto;
  TORCH_CHECK_VALUE(parse_channels_first_path(std::string(name), &path), "snack.", op, ": unknown variant '", name,
                    "' (expected ", names_with_auto(channels_first_paths(), &channels_first_path_name), ")");
  return path;
}

void set_default_spmm_variant(c10::string_view name) {
  SpmmVariant v = SpmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_spmm_variant(std::string(name), &v), "snack.set_default_spmm_variant: unknown variant '",
                    name, "' (expected ", spmm_variant_list(), ")");
  g_default_variant.store(static_cast<int>(v));
}

namespace {
std::atomic<int> g_default_csc_read{static_cast<int>(CscRead::kAuto)};
}  // namespace

CscRead default_csc_read() { return static_cast<CscRead>(g_default_csc_read.load()); }

namespace {
std::atomic<int> g_default_tile_view_splits{0};
}  // namespace

int default_tile_view_splits() { return g_default_tile_view_splits.load(); }

void set_default_tile_view_splits(int64_t splits) {
  // The planner checks a count against each product (at most 8 for the SpMM's clusters, at most the
  // band's tiles, never more than 256); here only what no product runs.
  TORCH_CHECK_VALUE(splits >= 0 && splits <= 1024, "snack.set_default_tile_view_splits: ", splits,
                    " blocks per band (expected 0, the planner's choice, or a count from 1)");
  g_default_tile_view_splits.store(int(splits));
}

namespace {
std::atomic<int> g_default_fragment_warpgroups{0};
}  // namespace

int default_fragment_warpgroups() { return g_default_fragment_warpgroups.load(); }

void set_default_fragment_warpgroups(int64_t groups) {
  TORCH_CHECK_VALUE(groups >= 0 && groups <= kMaxFragmentWarpgroups, "snack.set_default_fragment_warpgroups: ", groups,
                    " consumer warpgroups a block (expected 0, the planner's choice, or 1 to ", kMaxFragmentWarpgroups,
                    ")");
  g_default_fragment_warpgroups.store(int(groups));
}

void set_default_csc_read(c10::string_view name) {
  CscRead r = CscRead::kAuto;
  TORCH_CHECK_VALUE(parse_csc_read(std::string(name), &r), "snack.set_default_csc_read: unknown choice '", name,
                    "' (expected auto, in_place or copied)");
  g_default_csc_read.store(static_cast<int>(r));
}

SddmmVariant sddmm_variant_arg(c10::string_view name, const char* op) {
  SddmmVariant variant = SddmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_sddmm_variant(std::string(name), &variant), "snack.", op, ": unknown variant '", name,
                    "' (expected ", names_with_auto(sddmm_variants(), &sddmm_variant_name), ")");
  return variant;
}

void check_value_dtype(const at::Tensor& values, const char* op) {
  const at::ScalarType t = values.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, "snack.", op,
                   ": values must be float32, float64, bfloat16 or float16, got ", t);
}

void check_dense(const at::Tensor& t, const at::Tensor& like, int64_t cols, const PatternArg& p, const char* name,
                 const char* op, bool channels_first) {
  if (channels_first) {
    TORCH_CHECK_VALUE(t.dim() == 3, "snack.", op, ": ", name, " must be 3-D [B, ", cols, ", pixels], got shape ",
                      t.sizes());
  } else {
    TORCH_CHECK_VALUE(t.dim() == 2, "snack.", op, ": ", name, " must be 2-D [N, ", cols, "], got shape ", t.sizes());
  }
  TORCH_CHECK_VALUE(t.size(1) == cols, "snack.", op, ": ", name, " has ", t.size(1),
                    channels_first ? " channels, expected " : " columns, expected ", cols);
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), "snack.", op, ": ", name, " dtype ", t.scalar_type(),
                   " differs from the weight dtype ", like.scalar_type());
  check_same_device(t, p.device, name, op);
}

void check_values(const at::Tensor& values, const PatternArg& p, const char* op) {
  check_value_dtype(values, op);
  check_1d(values, "values", op);
  TORCH_CHECK_VALUE(values.size(0) == p.nnz, "snack.", op, ": values has ", values.size(0),
                    " elements but the pattern has nnz=", p.nnz);
  check_same_device(values, p.device, "values", op);
}

void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& values, const PatternArg& p, const char* op) {
  if (!bias) return;
  check_1d(*bias, "bias", op);
  TORCH_CHECK_VALUE(bias->size(0) == p.rows, "snack.", op, ": bias has ", bias->size(0), " elements, expected one per "
                    "output feature (", p.rows, ")");
  TORCH_CHECK_TYPE(bias->scalar_type() == values.scalar_type(), "snack.", op, ": bias dtype ", bias->scalar_type(),
                   " differs from the weight dtype ", values.scalar_type());
  check_same_device(*bias, p.device, "bias", op);
}

at::ScalarType choose_index_dtype(int64_t rows, int64_t cols, std::optional<at::ScalarType> requested,
                                  const char* op) {
  TORCH_CHECK_VALUE(rows <= std::numeric_limits<int32_t>::max() && cols <= std::numeric_limits<int32_t>::max(),
                    "snack.", op, ": dimensions beyond 2^31-1 are not supported");
  const bool fits16 = default_index_bits(rows, cols) == 16;
  if (!requested) return fits16 ? at::kUInt16 : at::kInt;
  TORCH_CHECK_TYPE(*requested == at::kUInt16 || *requested == at::kInt, "snack.", op,
                   ": index_dtype must be torch.uint16 or torch.int32, got ", *requested);
  TORCH_CHECK_VALUE(*requested == at::kInt || fits16, "snack.", op, ": a ", rows, "x", cols,
                    " matrix needs int32 indices (uint16 addresses at most 65536 rows and columns)");
  return *requested;
}

void check_features(int64_t out_features, int64_t in_features, const char* op) {
  TORCH_CHECK_VALUE(out_features >= 0 && in_features >= 0, "snack.", op,
                    ": out_features and in_features must be non-negative, got ", out_features, " and ", in_features);
}

namespace {
// The state tensors of one parameter: [count], the parameter's dtype and device, distinct memory.
void check_state(const at::Tensor& t, const at::Tensor& param, const char* name, const char* op) {
  check_1d(t, name, op);
  TORCH_CHECK_VALUE(t.size(0) == param.size(0), "snack.", op, ": ", name, " has ", t.size(0),
                    " elements, expected one per element of the parameter (", param.size(0), ")");
  TORCH_CHECK_TYPE(t.scalar_type() == param.scalar_type(), "snack.", op, ": ", name, " dtype ", t.scalar_type(),
                   " differs from the parameter dtype ", param.scalar_type());
  check_same_device(t, param.device(), name, op);
  TORCH_CHECK_VALUE(param.numel() == 0 || t.data_ptr() != param.data_ptr(), "snack.", op, ": ", name,
                    " shares memory with the parameter");
}
}  // namespace

AdamWArg adamw_arg(const at::Tensor& param, at::TensorList state, at::ArrayRef<double> hyper, const char* op,
                   const char* what) {
  TORCH_CHECK_VALUE(state.size() == 3, "snack.", op, ": ", what, " state holds exp_avg, exp_avg_sq and step, got ",
                    state.size(), " tensors");
  TORCH_CHECK_VALUE(hyper.size() == 6, "snack.", op, ": ", what, " hyper holds lr, beta1, beta2, eps, weight_decay "
                    "and maximize, got ", hyper.size(), " numbers");
  check_value_dtype(param, op);
  check_1d(param, what, op);
  AdamWArg a{param, state[0], state[1], state[2], {}};
  check_state(a.exp_avg, param, "exp_avg", op);
  check_state(a.exp_avg_sq, param, "exp_avg_sq", op);
  TORCH_CHECK_VALUE(param.numel() == 0 || a.exp_avg.data_ptr() != a.exp_avg_sq.data_ptr(), "snack.", op,
                    ": exp_avg and exp_avg_sq share memory");
  TORCH_CHECK_TYPE(a.step.scalar_type() == at::kFloat, "snack.", op, ": step must be float32, got ",
                   a.step.scalar_type());
  TORCH_CHECK_VALUE(a.step.numel() == 1, "snack.", op, ": step must hold one number, got shape ", a.step.sizes());
  check_same_device(a.step, param.device(), "step", op);
  const double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], weight_decay = hyper[4];
  // torch.optim.AdamW's checks of its hyperparameters.
  TORCH_CHECK_VALUE(lr >= 0, "snack.", op, ": invalid learning rate ", lr);
  TORCH_CHECK_VALUE(eps >= 0, "snack.", op, ": invalid epsilon ", eps);
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1, "snack.", op, ": invalid beta1 ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0 && beta2 < 1, "snack.", op, ": invalid beta2 ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0, "snack.", op, ": invalid weight_decay ", weight_decay);
  a.config = AdamWConfig{lr, beta1, beta2, eps, weight_decay, hyper[5] != 0};
  return a;
}

}  // namespace snack::binding
