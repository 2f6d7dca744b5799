// The inputs of the operators, checked once for the CPU and CUDA implementations, and the
// operators that ATen computes alike on every device (slots_from_mask, random_slots).
#include "ops_common.h"

#include <torch/library.h>

#include <limits>

#include "snack/topology.h"

namespace snack::binding {

SpmmInputs spmm_inputs(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                       const std::optional<at::Tensor>& bias, c10::string_view activation, const char* op,
                       bool channels_first) {
  SpmmInputs in{pattern_arg(pattern, op, PatternNeeds::kForward), at::Tensor(), bias, activation_arg(activation, op)};
  check_values(values, in.p, op);
  check_dense(x, values, in.p.cols, in.p, "x", op, channels_first);
  check_bias(bias, values, in.p, op);
  in.x = x.contiguous();
  return in;
}

namespace {
void check_packable(const at::Tensor& values, const PatternArg& p, const char* op) {
  TORCH_CHECK_TYPE(values.scalar_type() == at::kBFloat16 || values.scalar_type() == at::kHalf, "snack.", op,
                   ": packed tile values hold bfloat16 or float16 values, got ", values.scalar_type());
  TORCH_CHECK_VALUE(p.has_tile_view(), "snack.", op, ": the pattern holds no tile view (its layer is wider than ",
                    kTileViewMaxCols, " inputs, empty, or kept without it: Pattern.for_inference(tile_view=True))");
}
}  // namespace

GivenTiles packed_tiles_arg(const std::optional<at::Tensor>& tiles, const at::Tensor& values, const PatternArg& p,
                            const char* op) {
  if (!tiles) return {};
  check_packable(values, p, op);
  if (tiles->scalar_type() == at::kShort) {
    const int64_t halves = 2 * tile_bitmap_layout(p.rows, p.cols, p.nnz).words;
    TORCH_CHECK_VALUE(tiles->dim() == 1 && tiles->size(0) == halves, "snack.", op, ": bitmap fragments must have shape [",
                      halves, "] (snack.ops.pack_tile_bitmaps), got ", tiles->sizes());
    TORCH_CHECK_VALUE(tiles->is_contiguous() && reinterpret_cast<uintptr_t>(tiles->data_ptr()) % 16 == 0, "snack.", op,
                      ": tiles must be contiguous and start on a 16-byte boundary");
    check_same_device(*tiles, p.device, "tiles", op);
    return {reinterpret_cast<const uint32_t*>(tiles->data_ptr()), TileValues::kBitmaps};
  }
  if (tiles->scalar_type() == at::kInt) {
    const int64_t words = tile_fragment_layout(p.rows, p.cols, p.nnz).words;
    TORCH_CHECK_VALUE(tiles->dim() == 1 && tiles->size(0) == words, "snack.", op, ": tile fragments must have shape [",
                      words, "] (snack.ops.pack_tile_fragments), got ", tiles->sizes());
    TORCH_CHECK_VALUE(tiles->is_contiguous() && reinterpret_cast<uintptr_t>(tiles->data_ptr()) % 16 == 0, "snack.", op,
                      ": tiles must be contiguous and start on a 16-byte boundary");
    check_same_device(*tiles, p.device, "tiles", op);
    return {reinterpret_cast<const uint32_t*>(tiles->data_ptr()), TileValues::kFragments};
  }
  const int64_t entries = tile_view_entries_length(p.rows, p.cols, p.nnz);
  TORCH_CHECK_TYPE(tiles->scalar_type() == values.scalar_type(), "snack.", op, ": tiles dtype ", tiles->scalar_type(),
                   " is neither the weight dtype ", values.scalar_type(),
                   " (snack.ops.pack_tile_values), int32 (snack.ops.pack_tile_fragments) nor int16 "
                   "(snack.ops.pack_tile_bitmaps)");
  TORCH_CHECK_VALUE(tiles->dim() == 2 && tiles->size(0) == entries && tiles->size(1) == 2, "snack.", op,
                    ": tiles must have shape [", entries, ", 2] (snack.ops.pack_tile_values), got ", tiles->sizes());
  TORCH_CHECK_VALUE(tiles->is_contiguous() && reinterpret_cast<uintptr_t>(tiles->data_ptr()) % 16 == 0, "snack.", op,
                    ": tiles must be contiguous and start on a 16-byte boundary");
  check_same_device(*tiles, p.device, "tiles", op);
  return {reinterpret_cast<const uint32_t*>(tiles->data_ptr()), TileValues::kPacked};
}

at::Tensor empty_tiles(const at::Tensor& values, const PatternArg& p, TileValues kind, const char* op) {
  check_values(values, p, op);
  check_packable(values, p, op);
  if (kind == TileValues::kFragments)
    return at::empty({tile_fragment_layout(p.rows, p.cols, p.nnz).words}, values.options().dtype(at::kInt));
  if (kind == TileValues::kBitmaps)
    return at::empty({2 * tile_bitmap_layout(p.rows, p.cols, p.nnz).words}, values.options().dtype(at::kShort));
  return at::empty({tile_view_entries_length(p.rows, p.cols, p.nnz), 2}, values.options());
}

SpmmTInputs spmm_t_inputs(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern, const char* op) {
  SpmmTInputs in{pattern_arg(pattern, op), at::Tensor()};
  check_values(values, in.p, op);
  check_dense(dy, values, in.p.rows, in.p, "dy", op);
  in.dy = dy.contiguous();
  return in;
}

SddmmInputs sddmm_inputs(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& like,
                         const char* op) {
  SddmmInputs in{pattern_arg(pattern, op), at::Tensor(), at::Tensor()};
  check_value_dtype(like, op);
  check_dense(dy, like, in.p.rows, in.p, "dy", op);
  check_dense(x, like, in.p.cols, in.p, "x", op);
  TORCH_CHECK_VALUE(dy.size(0) == x.size(0), "snack.", op, ": dy has ", dy.size(0), " rows but x has ", x.size(0));
  in.dy = dy.contiguous();
  in.x = x.contiguous();
  return in;
}

bool is_mixed_precision(const at::Tensor& operand, const at::Tensor& param) {
  const at::ScalarType t = operand.scalar_type();
  return param.scalar_type() == at::kFloat && (t == at::kBFloat16 || t == at::kHalf);
}

SddmmAdamWInputs sddmm_adamw_inputs(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern,
                                    const at::Tensor& values, at::TensorList state, at::ArrayRef<double> hyper,
                                    const std::optional<at::Tensor>& bias, at::TensorList bias_state,
                                    at::ArrayRef<double> bias_hyper, const char* op) {
  // dy and x of the values' dtype, or 16-bit with float32 values (mixed precision).
  const at::Tensor& operand_like = is_mixed_precision(dy, values) ? dy : values;
  SddmmAdamWInputs in{sddmm_inputs(dy, x, pattern, operand_like, op), adamw_arg(values, state, hyper, op, "values"),
                      std::nullopt};
  check_values(values, in.s.p, op);
  const bool bias_given = bias.has_value();
  TORCH_CHECK_VALUE(bias_given == !bias_state.empty() && bias_given == !bias_hyper.empty(), "snack.", op,
                    ": give bias, bias_state and bias_hyper together");
  if (bias_given) {
    check_bias(bias, values, in.s.p, op);
    in.bias = adamw_arg(*bias, bias_state, bias_hyper, op, "bias");
    TORCH_CHECK_VALUE(!in.bias->step.is_same(in.values.step) &&
                          in.bias->step.data_ptr() != in.values.step.data_ptr(),
                      "snack.", op, ": the bias's and the values' step must be distinct tensors (each is advanced once)");
  }
  return in;
}

void advance_steps(const SddmmAdamWInputs& in) {
  if (in.bias) at::_foreach_add_(at::TensorList{in.values.step, in.bias->step}, 1);
  else in.values.step.add_(1);
}

at::Tensor bias_grad_input(const at::Tensor& dy, const char* op) {
  check_value_dtype(dy, op);
  TORCH_CHECK_VALUE(dy.dim() == 2, "snack.", op, ": dy must be 2-D, got shape ", dy.sizes());
  return dy.contiguous();
}

BiasAdamWInputs bias_grad_adamw_inputs(const at::Tensor& dy, const at::Tensor& bias, at::TensorList state,
                                       at::ArrayRef<double> hyper, const char* op) {
  BiasAdamWInputs in{bias_grad_input(dy, op), adamw_arg(bias, state, hyper, op, "bias")};
  TORCH_CHECK_VALUE(in.dy.size(1) == bias.size(0) &&
                        (in.dy.scalar_type() == bias.scalar_type() || is_mixed_precision(in.dy, bias)),
                    "snack.", op, ": dy must be [N, ", bias.size(0), "] of the bias's dtype (or 16-bit for a float32 "
                    "bias), got ", in.dy.sizes(), " ", in.dy.scalar_type());
  check_same_device(in.dy, bias.device(), "dy", op);
  return in;
}

CooInputs coo_inputs(const at::Tensor& rows, const at::Tensor& cols, int64_t out_features, int64_t in_features,
                     std::optional<at::ScalarType> index_dtype, const char* op) {
  check_features(out_features, in_features, op);
  TORCH_CHECK_VALUE(rows.dim() == 1 && cols.dim() == 1, "snack.", op, ": rows and cols must be 1-D, got shapes ",
                    rows.sizes(), " and ", cols.sizes());
  TORCH_CHECK_VALUE(rows.size(0) == cols.size(0), "snack.", op, ": rows has ", rows.size(0), " elements but cols has ",
                    cols.size(0));
  TORCH_CHECK_TYPE(!at::isFloatingType(rows.scalar_type()) && !at::isFloatingType(cols.scalar_type()) &&
                       rows.scalar_type() != at::kBool && cols.scalar_type() != at::kBool,
                   "snack.", op, ": rows and cols must be integer tensors, got ", rows.scalar_type(), " and ",
                   cols.scalar_type());
  TORCH_CHECK_VALUE(rows.device() == cols.device(), "snack.", op, ": rows is on ", rows.device(), " but cols is on ",
                    cols.device());
  return {rows.to(at::kLong).contiguous(), cols.to(at::kLong).contiguous(),
          choose_index_dtype(out_features, in_features, index_dtype, op)};
}

DenseInputs dense_inputs(const at::Tensor& dense, int64_t nnz, std::optional<at::ScalarType> index_dtype,
                         const char* op) {
  TORCH_CHECK_VALUE(dense.dim() == 2, "snack.", op, ": dense must be 2-D [out_features, in_features], got shape ",
                    dense.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(dense.scalar_type()), "snack.", op, ": dense must be floating point, got ",
                   dense.scalar_type());
  const int64_t m = dense.size(0), k = dense.size(1);
  TORCH_CHECK_VALUE(nnz >= 0 && nnz <= m * k, "snack.", op, ": nnz=", nnz, " must lie in [0, ", m * k, "]");
  return {dense.scalar_type() == at::kDouble ? dense.contiguous() : dense.to(at::kFloat).contiguous(), m, k,
          choose_index_dtype(m, k, index_dtype, op)};
}

CooOutputs empty_coo_outputs(const at::Tensor& rows, const CooInputs& in) {
  const int64_t nnz = in.rows.size(0);
  const auto index = rows.options().dtype(in.index_type);
  return {at::empty({nnz}, index), at::empty({nnz}, index), at::empty({nnz}, rows.options().dtype(at::kLong))};
}

ViewOutputs empty_views(const at::Tensor& row_idx, int64_t out_features, int64_t in_features, bool tile_view) {
  const auto opts = row_idx.options().dtype(at::kInt);
  return {at::empty({out_features + 1}, opts), at::empty({in_features + 1}, opts), at::empty({row_idx.size(0)}, opts),
          at::empty({tile_view ? tile_view_ptr_length(out_features, in_features) : 0}, opts),
          at::empty({tile_view ? tile_view_entries_length(out_features, in_features, row_idx.size(0)) : 0}, opts)};
}

void check_slot_pair(const at::Tensor& row_idx, const at::Tensor& col_idx, const char* op) {
  check_1d(row_idx, "row_idx", op);
  check_1d(col_idx, "col_idx", op);
  TORCH_CHECK_VALUE(row_idx.size(0) == col_idx.size(0), "snack.", op, ": row_idx has ", row_idx.size(0),
                    " elements but col_idx has ", col_idx.size(0));
  TORCH_CHECK_VALUE(row_idx.device() == col_idx.device(), "snack.", op,
                    ": row_idx and col_idx are on different devices");
}

void check_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features, int64_t in_features,
                 const char* op) {
  check_features(out_features, in_features, op);
  check_slot_pair(row_idx, col_idx, op);
  const auto itype = row_idx.scalar_type();
  TORCH_CHECK_TYPE((itype == at::kUInt16 || itype == at::kInt) && col_idx.scalar_type() == itype, "snack.", op,
                   ": row_idx and col_idx must both be uint16 or both int32, got ", itype, " and ",
                   col_idx.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> split_positions(const at::Tensor& positions, int64_t in_features,
                                                   at::ScalarType index_type) {
  const int64_t k = std::max<int64_t>(in_features, 1);
  return {at::div(positions, k, "floor").to(index_type), at::remainder(positions, k).to(index_type)};
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_mask(const at::Tensor& mask,
                                                               std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_mask";
  TORCH_CHECK_VALUE(mask.dim() == 2, "snack.", op, ": mask must be 2-D [out_features, in_features], got shape ",
                    mask.sizes());
  const int64_t m = mask.size(0), k = mask.size(1);
  const at::ScalarType itype = choose_index_dtype(m, k, index_dtype, op);
  at::Tensor positions = at::nonzero(mask.reshape({-1})).reshape({-1});  // ascending
  TORCH_CHECK_NOT_IMPLEMENTED(positions.size(0) <= kMaxNnz, "snack.", op, ": ",
                              nnz_limit_error(positions.size(0)).message());
  auto [row_idx, col_idx] = split_positions(positions, k, itype);
  return {row_idx, col_idx, positions};
}

std::tuple<at::Tensor, at::Tensor> random_slots(int64_t out_features, int64_t in_features, int64_t nnz,
                                                std::optional<at::Generator> generator,
                                                std::optional<at::Device> device,
                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "random_slots";
  check_features(out_features, in_features, op);
  const int64_t total = out_features * in_features;
  TORCH_CHECK_VALUE(nnz >= 0 && nnz <= total, "snack.", op, ": nnz=", nnz, " must lie in [0, out_features*in_features=",
                    total, "]");
  TORCH_CHECK_NOT_IMPLEMENTED(nnz <= kMaxNnz, "snack.", op, ": ", nnz_limit_error(nnz).message());
  const at::ScalarType itype = choose_index_dtype(out_features, in_features, index_dtype, op);
  const at::Device target = device.value_or(at::Device(at::kCPU));
  // Draw where the generator lives (a CPU generator also serves a CUDA layer), then move.
  const at::Device draw_device = generator ? generator->device() : target;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(draw_device);
  at::Tensor positions;
  if (2 * nnz > total) {
    // Dense enough that enumerating all positions costs no more than the pattern itself.
    positions = std::get<0>(at::sort(at::randperm(total, generator, opts).slice(0, 0, nnz)));
  } else {
    // Sample with replacement, deduplicate, repeat until enough; then keep a uniformly random
    // subset of the distinct draws. Every step is symmetric in the positions, so each nnz-subset
    // is equally likely. O(nnz) memory, no dense-sized temporary.
    positions = at::empty({0}, opts);
    while (positions.size(0) < nnz) {
      const int64_t missing = nnz - positions.size(0);
      const at::Tensor draws = at::randint(0, total, {missing + missing / 8 + 16}, generator, opts);
      positions = std::get<0>(at::_unique2(at::cat({positions, draws}), /*sorted=*/true));
    }
    if (positions.size(0) > nnz) {
      const at::Tensor keep = at::randperm(positions.size(0), generator, opts).slice(0, 0, nnz);
      positions = std::get<0>(at::sort(positions.index_select(0, keep)));
    }
  }
  return split_positions(positions.to(target), in_features, itype);
}

// The checks run on the host, where the core's loops are: device tensors are copied once.
void validate_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features, int64_t in_features) {
  const char* op = "validate_slots";
  check_slots(row_idx, col_idx, out_features, in_features, op);
  const at::Tensor rows = row_idx.contiguous().cpu(), cols = col_idx.contiguous().cpu();
  dispatch_index_type(rows.scalar_type(), [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cpu::check_slots<Index>(out_features, in_features, rows.size(0), data_as<Index>(rows),
                                           data_as<Index>(cols)),
                   op);
  });
}

void validate_pattern(at::TensorList pattern) {
  const char* op = "validate_pattern";
  PatternArg p = pattern_arg(pattern, op, PatternNeeds::kForward);
  for (at::Tensor* t : {&p.row_idx, &p.col_idx, &p.row_ptr, &p.col_ptr, &p.csc_perm, &p.tile_ptr, &p.tile_entries})
    *t = t->contiguous().cpu();
  throw_if_error(with_pattern(p, [](auto w) { return cpu::check_pattern(w); }), op);
}

}  // namespace
}  // namespace snack::binding

// ATen (or the host) does the work, on any device.
TORCH_LIBRARY_IMPL(snack, CompositeExplicitAutograd, m) {
  m.impl("slots_from_mask", &snack::binding::slots_from_mask);
  m.impl("validate_slots", &snack::binding::validate_slots);
  m.impl("validate_pattern", &snack::binding::validate_pattern);
}
// No tensor inputs: runs wherever it is called.
TORCH_LIBRARY_IMPL(snack, CompositeImplicitAutograd, m) { m.impl("random_slots", &snack::binding::random_slots); }
