// sparse_linear: the layer's operator with its autograd, in C++ so that Python and libtorch users
// train the same way. Forward and backward call the spmm / spmm_t / sddmm / bias_grad operators
// through the dispatcher, so torch.compile traces them through their fake kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "binding_utils.h"
#include "snack/ops.h"

namespace snack::binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_spmm(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& bias,
                     const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& row_ptr,
                     const at::Tensor& col_ptr, const at::Tensor& csc_perm, c10::string_view activation) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::spmm", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view, c10::string_view)>();
  return op.call(x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, bias, activation, "auto");
}

// spmm_t and sddmm: two tensors, the five pattern tensors, the kernel variant.
using PatternOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view);

at::Tensor call_spmm_t(const at::Tensor& dy, const at::Tensor& values, const at::Tensor& row_idx,
                       const at::Tensor& col_idx, const at::Tensor& row_ptr, const at::Tensor& col_ptr,
                       const at::Tensor& csc_perm) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::spmm_t", "").typed<PatternOp>();
  return op.call(dy, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, "auto");
}

at::Tensor call_sddmm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                      const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sddmm", "").typed<PatternOp>();
  return op.call(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, "auto");
}

at::Tensor call_bias_grad(const at::Tensor& dy) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("snack::bias_grad", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(dy);
}

// Flattens x [..., K] to [N, K]; the output takes x's leading shape.
at::Tensor flatten_input(const at::Tensor& x, int64_t in_features) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "snack.sparse_linear: x must have at least one dimension");
  TORCH_CHECK_VALUE(x.size(-1) == in_features, "snack.sparse_linear: x has ", x.size(-1),
                    " features in its last dimension but the layer has in_features=", in_features);
  return x.reshape({-1, in_features});
}

std::vector<int64_t> output_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

// The fused forward, below autograd (also inference under autograd when nothing needs a gradient).
at::Tensor sparse_linear_forward(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                 const at::Tensor& col_ptr, const at::Tensor& csc_perm, c10::string_view activation) {
  const int64_t in_features = col_ptr.size(0) - 1, out_features = row_ptr.size(0) - 1;
  const at::Tensor y2d = call_spmm(flatten_input(x, in_features), values, bias, row_idx, col_idx, row_ptr, col_ptr,
                                   csc_perm, activation);
  return y2d.view(output_shape(x, out_features));
}

class SparseLinearFunction : public torch::autograd::Function<SparseLinearFunction> {
 public:
  // ReLU is fused and its gradient mask comes from the output. GELU's gradient needs the
  // pre-activation, so under autograd it is computed unfused and the pre-activation is saved.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const std::optional<at::Tensor>& bias, const at::Tensor& row_idx,
                            const at::Tensor& col_idx, const at::Tensor& row_ptr, const at::Tensor& col_ptr,
                            const at::Tensor& csc_perm, c10::string_view activation) {
    const Activation act = activation_arg(activation, "sparse_linear");
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["activation"] = static_cast<int64_t>(act);
    at::Tensor y, saved_activation;
    if (act == Activation::kGELU) {
      const at::Tensor z = sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, "none");
      y = at::gelu(z);
      saved_activation = z;
    } else {
      y = sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
      if (act == Activation::kReLU) saved_activation = y;
    }
    ctx->save_for_backward({x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, saved_activation});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &values = saved[1], &row_idx = saved[2], &col_idx = saved[3],
                     &row_ptr = saved[4], &col_ptr = saved[5], &csc_perm = saved[6];
    const int64_t in_features = col_ptr.size(0) - 1, out_features = row_ptr.size(0) - 1;
    at::Tensor grad = grad_outputs[0];
    switch (static_cast<Activation>(ctx->saved_data["activation"].toInt())) {
      case Activation::kReLU: grad = at::threshold_backward(grad, saved[7], 0); break;  // one kernel: grad where y > 0
      case Activation::kGELU: grad = at::gelu_backward(grad, saved[7]); break;
      default: break;
    }
    const at::Tensor dy = grad.reshape({-1, out_features}).contiguous();
    at::Tensor dx, dvalues, dbias;
    if (ctx->needs_input_grad(0))
      dx = call_spmm_t(dy, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm).view(x.sizes());
    if (ctx->needs_input_grad(1))
      dvalues = call_sddmm(dy, flatten_input(x, in_features), row_idx, col_idx, row_ptr, col_ptr, csc_perm);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) dbias = call_bias_grad(dy);
    return {dx, dvalues, dbias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor sparse_linear_autograd(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                  const at::Tensor& col_ptr, const at::Tensor& csc_perm, c10::string_view activation) {
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (x.requires_grad() || values.requires_grad() || (bias && bias->requires_grad()));
  if (!needs_grad) {  // inference: the fully fused kernel, nothing saved
    at::AutoDispatchBelowADInplaceOrView guard;
    return sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
  }
  return SparseLinearFunction::apply(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, Autograd, m) { m.impl("sparse_linear", &snack::binding::sparse_linear_autograd); }
// Below autograd (inference, tracing, meta/fake tensors) the layer is just spmm on a flattened input.
TORCH_LIBRARY_IMPL(snack, CompositeExplicitAutograd, m) {
  m.impl("sparse_linear", &snack::binding::sparse_linear_forward);
}
