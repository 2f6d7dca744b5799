// snack::Pattern and snack::SparseLinear for libtorch programs: their work is done by snack's
// operators, called through the dispatcher like any other.
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

#include "op_args.h"
#include "snack/torch/pattern.h"
#include "snack/torch/sparse_linear.h"

namespace snack {
namespace {

std::tuple<at::Tensor, at::Tensor> random_slots(int64_t out_features, int64_t in_features, int64_t nnz,
                                                const at::Generator& gen, at::Device device) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::random_slots", "").typed<
      std::tuple<at::Tensor, at::Tensor>(int64_t, int64_t, int64_t, std::optional<at::Generator>,
                                         std::optional<at::Device>, std::optional<at::ScalarType>)>();
  return op.call(out_features, in_features, nnz, gen, device, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_coo(const at::Tensor& rows, const at::Tensor& cols,
                                                              int64_t out_features, int64_t in_features) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::slots_from_coo", "").typed<
      std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                                     std::optional<at::ScalarType>)>();
  return op.call(rows, cols, out_features, in_features, std::nullopt);
}

using Views = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
Views build_views(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features, int64_t in_features,
                  bool tile_view) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::build_views", "").typed<
      Views(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  return op.call(row_idx, col_idx, out_features, in_features, tile_view);
}

void validate_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features, int64_t in_features) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::validate_slots", "").typed<
      void(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  op.call(row_idx, col_idx, out_features, in_features);
}

// A tensor of an archive; `what` names it in the error.
torch::Tensor read_tensor(torch::serialize::InputArchive& archive, const char* key, bool is_buffer, const char* what) {
  torch::Tensor t;
  TORCH_CHECK_VALUE(archive.try_read(key, t, is_buffer), "snack::", what, ": the checkpoint has no '", key, "'");
  return t;
}

}  // namespace

std::shared_ptr<PatternImpl> PatternImpl::random(int64_t out_features, int64_t in_features, int64_t nnz,
                                                 const at::Generator& generator, torch::Device device) {
  auto [rows, cols] = random_slots(out_features, in_features, nnz, generator, device);
  return std::make_shared<PatternImpl>(out_features, in_features, rows, cols, /*validate=*/false);
}

std::shared_ptr<PatternImpl> PatternImpl::from_coo(const torch::Tensor& rows, const torch::Tensor& cols,
                                                   int64_t out_features, int64_t in_features, torch::Tensor* order) {
  auto [row_idx, col_idx, sorted_order] = slots_from_coo(rows, cols, out_features, in_features);
  if (order) *order = sorted_order;
  return std::make_shared<PatternImpl>(out_features, in_features, row_idx, col_idx, /*validate=*/false);
}

PatternImpl::PatternImpl(int64_t out_features_, int64_t in_features_, torch::Tensor row_idx_, torch::Tensor col_idx_,
                         bool validate)
    : out_features(out_features_), in_features(in_features_), row_idx(std::move(row_idx_)),
      col_idx(std::move(col_idx_)) {
  if (validate) validate_slots(row_idx, col_idx, out_features, in_features);
  reset();
}

void PatternImpl::reset() {
  const torch::Tensor rows = slot_rows();
  auto [rp, cp, perm, tp, te] = build_views(rows, col_idx, out_features, in_features, tile_view_);
  row_idx = register_buffer("row_idx", forward_only_ ? rows.new_empty({0}) : rows);
  col_idx = register_buffer("col_idx", col_idx);
  row_ptr = register_buffer("row_ptr", rp);
  col_ptr = register_buffer("col_ptr", cp);
  csc_perm = register_buffer("csc_perm", forward_only_ ? perm.new_empty({0}) : perm);
  tile_ptr = register_buffer("tile_ptr", tp);
  tile_entries = register_buffer("tile_entries", te);
}

torch::Tensor PatternImpl::slot_rows() const {
  if (!forward_only_) return row_idx;
  const torch::Tensor rows = torch::arange(out_features, row_ptr.options());
  return torch::repeat_interleave(rows, row_ptr.diff(), /*dim=*/std::nullopt, /*output_size=*/nnz())
      .to(col_idx.scalar_type());
}

void PatternImpl::hold(bool forward_only, bool tile_view) {
  if (forward_only == forward_only_ && tile_view == tile_view_) return;
  const torch::Tensor rows = slot_rows();
  auto [rp, cp, perm, tp, te] = build_views(rows, col_idx, out_features, in_features, tile_view);
  forward_only_ = forward_only;
  tile_view_ = tile_view;
  torch::NoGradGuard no_grad;
  // set_() refills or empties a buffer in place: the module's registered tensor is the same object.
  if (forward_only) {
    row_idx.set_();
    csc_perm.set_();
  } else {
    row_idx.set_(rows);
    csc_perm.set_(perm);
  }
  tile_ptr.set_(tp);
  tile_entries.set_(te);
}

void PatternImpl::for_inference(bool tile_view) { hold(true, tile_view); }

void PatternImpl::for_training(bool tile_view) { hold(false, tile_view); }

void PatternImpl::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& buffer : named_buffers(/*recurse=*/false))
    archive.write(buffer.key(), buffer.key() == "row_idx" ? slot_rows() : buffer.value(), /*is_buffer=*/true);
}

std::vector<torch::Tensor> PatternImpl::tensors() const {
  std::vector<torch::Tensor> out(binding::kPatternFields);
  out[binding::kRowIdx] = row_idx;
  out[binding::kColIdx] = col_idx;
  out[binding::kRowPtr] = row_ptr;
  out[binding::kColPtr] = col_ptr;
  out[binding::kCscPerm] = csc_perm;
  out[binding::kTilePtr] = tile_ptr;
  out[binding::kTileEntries] = tile_entries;
  return out;
}

void PatternImpl::set_slots(const torch::Tensor& new_row_idx, const torch::Tensor& new_col_idx, bool validate) {
  TORCH_CHECK_VALUE(new_row_idx.sizes() == col_idx.sizes() && new_col_idx.sizes() == col_idx.sizes(),
                    "snack::Pattern::set_slots: the slot count never changes (", nnz(), ")");
  if (validate) validate_slots(new_row_idx, new_col_idx, out_features, in_features);
  auto [rp, cp, perm, tp, te] = build_views(new_row_idx, new_col_idx, out_features, in_features, tile_view_);  // first
  torch::NoGradGuard no_grad;
  col_idx.copy_(new_col_idx);
  row_ptr.copy_(rp);
  col_ptr.copy_(cp);
  if (!forward_only_) {
    row_idx.copy_(new_row_idx);
    csc_perm.copy_(perm);
  }
  tile_ptr.copy_(tp);  // (empty, both, where the tile view is left out)
  tile_entries.copy_(te);
}

void PatternImpl::load(torch::serialize::InputArchive& archive) {
  const torch::Tensor rows = read_tensor(archive, "row_idx", true, "Pattern::load");
  const torch::Tensor cols = read_tensor(archive, "col_idx", true, "Pattern::load");
  TORCH_CHECK_VALUE(rows.sizes() == col_idx.sizes() && cols.sizes() == col_idx.sizes(),
                    "snack::Pattern::load: the checkpoint has ", rows.numel(), " slots, the pattern ", nnz());
  set_slots(rows.to(col_idx.options()), cols.to(col_idx.options()));  // checked, views derived
}

int64_t PatternImpl::nbytes() const {
  int64_t total = 0;
  for (const torch::Tensor& t : tensors()) total += t.numel() * t.element_size();
  return total;
}

torch::Tensor PatternImpl::to_mask() const {
  torch::Tensor mask = torch::zeros({out_features, in_features}, col_idx.options().dtype(torch::kBool));
  mask.index_put_({slot_rows().to(torch::kLong), col_idx.to(torch::kLong)}, true);
  return mask;
}

SparseLinearImpl::SparseLinearImpl(const SparseLinearOptions& options_) : options(options_) { reset(); }

void SparseLinearImpl::reset() {
  const int64_t m = options.out_features(), k = options.in_features();
  TORCH_CHECK_VALUE(m > 0 && k > 0, "SparseLinear: in_features and out_features must be positive");
  TORCH_CHECK_VALUE(options.density() > 0.0 && options.density() <= 1.0,
                    "SparseLinear: density must lie in (0, 1], got ", options.density());
  const int64_t nnz = nnz_for_density(m, k, options.density());
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  pattern = register_module("pattern", Pattern(PatternImpl::random(m, k, nnz, gen)));
  const double bound = 1.0 / std::sqrt(std::max(1.0, options.density() * static_cast<double>(k)));
  values = register_parameter("values", torch::empty({nnz}).uniform_(-bound, bound, gen));
  if (options.bias()) bias = register_parameter("bias", torch::empty({m}).uniform_(-bound, bound, gen));
}

torch::Tensor SparseLinearImpl::forward(const torch::Tensor& x) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sparse_linear", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::TensorList, c10::string_view)>();
  std::optional<at::Tensor> b;
  if (bias.defined()) b = bias;
  return op.call(x, values, b, pattern->tensors(), "none");
}

void SparseLinearImpl::load(torch::serialize::InputArchive& archive) {
  const char* what = "SparseLinear::load";
  const torch::Tensor new_values = read_tensor(archive, "values", false, what);
  torch::Tensor new_bias;
  if (bias.defined()) new_bias = read_tensor(archive, "bias", false, what);
  torch::serialize::InputArchive pattern_archive;
  TORCH_CHECK_VALUE(archive.try_read("pattern", pattern_archive), "snack::", what, ": the checkpoint has no pattern");
  const torch::Tensor rows = read_tensor(pattern_archive, "row_idx", true, what);
  const torch::Tensor cols = read_tensor(pattern_archive, "col_idx", true, what);
  TORCH_CHECK_VALUE(new_values.sizes() == values.sizes() && rows.sizes() == values.sizes() &&
                        cols.sizes() == values.sizes(),
                    "snack::", what, ": the checkpoint has ", new_values.numel(), " values and ", rows.numel(),
                    " slots, the layer nnz=", nnz());
  TORCH_CHECK_VALUE(!bias.defined() || new_bias.sizes() == bias.sizes(), "snack::", what, ": bias has shape ",
                    new_bias.sizes(), ", expected ", bias.sizes());
  TORCH_CHECK_TYPE(new_values.is_floating_point(), "snack::", what, ": values must be floating point");
  // Validated and sorted (IndexError / ValueError), the values following their slots; then copied.
  const torch::Device device = values.device();
  auto [row_idx, col_idx, order] = slots_from_coo(rows.to(device, torch::kLong), cols.to(device, torch::kLong),
                                                  options.out_features(), options.in_features());
  torch::NoGradGuard no_grad;
  const torch::Tensor sorted_values = new_values.to(device).index_select(0, order).to(values.dtype());
  pattern->set_slots(row_idx.to(pattern->col_idx.dtype()), col_idx.to(pattern->col_idx.dtype()), /*validate=*/false);
  values.copy_(sorted_values);
  if (bias.defined()) bias.copy_(new_bias);
}

torch::Tensor SparseLinearImpl::to_dense() const {
  torch::Tensor dense = torch::zeros({options.out_features(), options.in_features()}, values.options());
  dense.index_put_({pattern->slot_rows().to(torch::kLong), pattern->col_idx.to(torch::kLong)}, values.detach());
  return dense;
}

namespace {
// fn(module) for `model` and every module below it (modules(true) would need the model to be held
// by a shared_ptr).
template <typename Fn>
void for_each_module(torch::nn::Module& model, Fn&& fn) {
  fn(&model);
  for (const auto& module : model.modules(/*include_self=*/false)) fn(module.get());
}
}  // namespace

void for_inference(torch::nn::Module& model, std::optional<bool> tile_view) {
  // Each pattern once, keeping its tile view if any layer that reads it holds 16-bit values.
  std::vector<std::pair<PatternImpl*, bool>> patterns;
  const auto entry = [&](PatternImpl* p) -> std::pair<PatternImpl*, bool>& {
    for (auto& e : patterns)
      if (e.first == p) return e;
    return patterns.emplace_back(p, false);
  };
  for_each_module(model, [&](torch::nn::Module* module) {
    if (auto* p = dynamic_cast<PatternImpl*>(module)) entry(p);
    if (auto* layer = dynamic_cast<SparseLinearImpl*>(module)) {
      const auto dtype = layer->values.scalar_type();
      entry(layer->pattern.get()).second |= dtype == torch::kBFloat16 || dtype == torch::kHalf;
    }
  });
  for (auto& [pattern, sixteen_bits] : patterns) pattern->for_inference(tile_view.value_or(sixteen_bits));
}

void for_training(torch::nn::Module& model, bool tile_view) {
  for_each_module(model, [&](torch::nn::Module* module) {
    if (auto* p = dynamic_cast<PatternImpl*>(module)) p->for_training(tile_view);
  });
}

}  // namespace snack
