#include "snack/torch/sparse_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>

namespace snack {
namespace {

std::tuple<at::Tensor, at::Tensor> random_slots(int64_t out_features, int64_t in_features, int64_t nnz,
                                                const at::Generator& gen) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::random_slots", "").typed<
      std::tuple<at::Tensor, at::Tensor>(int64_t, int64_t, int64_t, std::optional<at::Generator>,
                                         std::optional<at::Device>, std::optional<at::ScalarType>)>();
  return op.call(out_features, in_features, nnz, gen, at::Device(at::kCPU), std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_views(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                           int64_t out_features, int64_t in_features) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::build_views", "").typed<
      std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  return op.call(row_idx, col_idx, out_features, in_features);
}

}  // namespace

SparseLinearImpl::SparseLinearImpl(const SparseLinearOptions& options_) : options(options_) { reset(); }

void SparseLinearImpl::reset() {
  const int64_t m = options.out_features(), k = options.in_features();
  TORCH_CHECK_VALUE(m > 0 && k > 0, "SparseLinear: in_features and out_features must be positive");
  TORCH_CHECK_VALUE(options.density() > 0.0 && options.density() <= 1.0,
                    "SparseLinear: density must lie in (0, 1], got ", options.density());
  const int64_t nnz = static_cast<int64_t>(std::llround(options.density() * static_cast<double>(m * k)));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  auto [rows, cols] = random_slots(m, k, nnz, gen);
  auto [rp, cp, perm] = build_views(rows, cols, m, k);
  const double bound = 1.0 / std::sqrt(std::max(1.0, options.density() * static_cast<double>(k)));
  values = register_parameter("values", torch::empty({nnz}).uniform_(-bound, bound, gen));
  if (options.bias())
    bias = register_parameter("bias", torch::empty({m}).uniform_(-bound, bound, gen));
  row_idx = register_buffer("row_idx", rows);
  col_idx = register_buffer("col_idx", cols);
  row_ptr = register_buffer("row_ptr", rp);
  col_ptr = register_buffer("col_ptr", cp);
  csc_perm = register_buffer("csc_perm", perm);
}

torch::Tensor SparseLinearImpl::forward(const torch::Tensor& x) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sparse_linear", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view)>();
  std::optional<at::Tensor> b;
  if (bias.defined()) b = bias;
  return op.call(x, values, b, row_idx, col_idx, row_ptr, col_ptr, csc_perm, "none");
}

torch::Tensor SparseLinearImpl::to_dense() const {
  torch::Tensor dense = torch::zeros({options.out_features(), options.in_features()}, values.options());
  dense.index_put_({row_idx.to(torch::kLong), col_idx.to(torch::kLong)}, values.detach());
  return dense;
}

}  // namespace snack
