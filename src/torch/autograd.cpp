// sparse_linear and sparse_linear_adamw: the layer's operators with their autograd, in C++ so that
// Python and libtorch users train the same way. Forward and backward call the product operators
// through the dispatcher, so torch.compile traces them through their fake kernels and every device
// runs its own implementation.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "op_args.h"
#include "ops_common.h"

namespace snack::binding {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

at::Tensor call_spmm(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern, const OptionalTensor& bias,
                     c10::string_view activation) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::spmm", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, at::TensorList, const OptionalTensor&, c10::string_view,
      c10::string_view, const OptionalTensor&)>();
  return op.call(x, values, pattern, bias, activation, "auto", std::nullopt);
}

std::tuple<at::Tensor, at::Tensor> call_spmm_for_step(const at::Tensor& x, const at::Tensor& values,
                                                      at::TensorList pattern, const OptionalTensor& bias,
                                                      c10::string_view activation) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::spmm_for_step", "").typed<
      std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, at::TensorList, const OptionalTensor&,
                                         c10::string_view)>();
  return op.call(x, values, pattern, bias, activation);
}

at::Tensor call_spmm_t(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::spmm_t", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view)>();
  return op.call(dy, values, pattern, "auto");
}

at::Tensor call_sddmm(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sddmm", "").typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view)>();
  return op.call(dy, x, pattern, "auto");
}

at::Tensor call_bias_grad(const at::Tensor& dy) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("snack::bias_grad", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(dy);
}

void call_sddmm_adamw(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& values,
                      at::TensorList state, at::ArrayRef<double> hyper, const OptionalTensor& bias,
                      at::TensorList bias_state, at::ArrayRef<double> bias_hyper, const OptionalTensor& x_t) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sddmm_adamw_", "").typed<void(
      const at::Tensor&, const at::Tensor&, at::TensorList, const at::Tensor&, at::TensorList, at::ArrayRef<double>,
      at::TensorList, const OptionalTensor&, at::ArrayRef<double>, const OptionalTensor&, c10::string_view)>();
  op.call(dy, x, pattern, values, state, hyper, bias_state, bias, bias_hyper, x_t, "auto");
}

// The pattern's M and K, from its views.
int64_t out_features_of(at::TensorList pattern) { return pattern[kRowPtr].size(0) - 1; }
int64_t in_features_of(at::TensorList pattern) { return pattern[kColPtr].size(0) - 1; }

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

// What the products of sparse_linear_adamw read: values and bias as given, or, for 16-bit x with
// float32 values (mixed precision: torch.autocast casts only x for this op, since the backward
// updates the float32 masters in place), 16-bit copies of them.
std::pair<at::Tensor, OptionalTensor> product_parameters(const at::Tensor& x, const at::Tensor& values,
                                                         const OptionalTensor& bias) {
  if (!is_mixed_precision(x, values)) return {values, bias};
  const at::ScalarType t = x.scalar_type();
  return {values.to(t), bias ? OptionalTensor(bias->to(t)) : std::nullopt};
}

void check_pattern_list(at::TensorList pattern) {
  TORCH_CHECK_VALUE(pattern.size() == size_t(kPatternFields), "snack.sparse_linear: pattern must hold ",
                    int(kPatternFields), " tensors, got ", pattern.size());
}

// The forward, below autograd (also inference under autograd when nothing needs a gradient).
at::Tensor sparse_linear_forward(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                 at::TensorList pattern, c10::string_view activation) {
  check_pattern_list(pattern);
  const at::Tensor y2d = call_spmm(flatten_input(x, in_features_of(pattern)), values, pattern, bias, activation);
  return y2d.view(output_shape(x, out_features_of(pattern)));
}

// The forward of both autograd functions below. ReLU is fused and its gradient mask comes from the
// output. GELU's gradient needs the pre-activation, so under autograd it is computed unfused and the
// pre-activation is saved. With for_step, the forward runs as spmm_for_step and X transposed by it
// (where its plan makes that copy of the whole batch) is kept in ctx->saved_data["x_t"] for the
// SDDMM of the backward, which then does not transpose X again.
at::Tensor forward_and_save(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const OptionalTensor& bias, at::TensorList pattern, c10::string_view activation,
                            bool for_step) {
  check_pattern_list(pattern);
  const Activation act = activation_arg(activation, "sparse_linear");
  ctx->saved_data["has_bias"] = bias.has_value();
  ctx->saved_data["activation"] = static_cast<int64_t>(act);
  const int64_t in_features = in_features_of(pattern), out_features = out_features_of(pattern);
  const auto product = [&](c10::string_view fused_activation) {
    const at::Tensor x2d = flatten_input(x, in_features);
    at::Tensor y2d;
    if (for_step) {
      at::Tensor x_t;
      std::tie(y2d, x_t) = call_spmm_for_step(x2d, values, pattern, bias, fused_activation);
      ctx->saved_data["x_t"] = x_t;  // empty where the plan made no such copy
    } else {
      y2d = call_spmm(x2d, values, pattern, bias, fused_activation);
    }
    return y2d.view(output_shape(x, out_features));
  };
  at::Tensor y, saved_activation;
  if (act == Activation::kGELU) {
    const at::Tensor z = product("none");
    y = at::gelu(z);
    saved_activation = z;
  } else {
    y = product(activation);
    if (act == Activation::kReLU) saved_activation = y;
  }
  std::vector<at::Tensor> saved{x, values, saved_activation};
  saved.insert(saved.end(), pattern.begin(), pattern.end());
  ctx->save_for_backward(saved);
  return y;
}

// What forward_and_save kept, and dY: the output gradient through the activation, as [N, M].
struct Saved {
  at::Tensor x, values, dy;
  std::vector<at::Tensor> pattern;
  int64_t in_features;
};

Saved unpack(AutogradContext* ctx, const variable_list& grad_outputs) {
  // Autograd enables grad mode in a backward only for create_graph=True. The products below are not
  // differentiable, so a second derivative would silently be zero: refuse it instead.
  TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(),
                              "snack.SparseLinear: double backward (create_graph=True: gradient penalties, "
                              "Hessian-vector products) is not supported; its backward is not differentiable");
  const auto saved = ctx->get_saved_variables();
  Saved s{saved[0], saved[1], at::Tensor(), std::vector<at::Tensor>(saved.begin() + 3, saved.end()), 0};
  s.in_features = in_features_of(s.pattern);
  at::Tensor grad = grad_outputs[0];
  switch (static_cast<Activation>(ctx->saved_data["activation"].toInt())) {
    case Activation::kReLU: grad = at::threshold_backward(grad, saved[2], 0); break;  // one kernel: grad where y > 0
    case Activation::kGELU: grad = at::gelu_backward(grad, saved[2]); break;
    default: break;
  }
  s.dy = grad.reshape({-1, out_features_of(s.pattern)}).contiguous();
  return s;
}

at::Tensor input_grad(const Saved& s) { return call_spmm_t(s.dy, s.values, s.pattern).view(s.x.sizes()); }

at::Tensor bias_grad_if_needed(AutogradContext* ctx, const Saved& s) {
  return ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2) ? call_bias_grad(s.dy) : at::Tensor();
}

// Gradients for every input of a node: autograd counts each tensor of a list as one input.
variable_list gradients(size_t count, at::Tensor dx, at::Tensor dvalues, at::Tensor dbias) {
  variable_list grads(count);
  grads[0] = std::move(dx);
  grads[1] = std::move(dvalues);
  grads[2] = std::move(dbias);
  return grads;
}

class SparseLinearFunction : public torch::autograd::Function<SparseLinearFunction> {
 public:
  // x, values, bias, the pattern's tensors, activation.
  static constexpr size_t kInputs = 3 + kPatternFields + 1;

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const OptionalTensor& bias, at::TensorList pattern, c10::string_view activation) {
    return forward_and_save(ctx, x, values, bias, pattern, activation, false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const Saved s = unpack(ctx, grad_outputs);
    at::Tensor dx, dvalues;
    if (ctx->needs_input_grad(0)) dx = input_grad(s);
    if (ctx->needs_input_grad(1)) dvalues = call_sddmm(s.dy, flatten_input(s.x, s.in_features), s.pattern);
    return gradients(kInputs, dx, dvalues, bias_grad_if_needed(ctx, s));
  }
};

// The layer with AdamW applied to values inside its backward: no gradient is returned for them.
class SparseLinearAdamWFunction : public torch::autograd::Function<SparseLinearAdamWFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const OptionalTensor& bias, at::TensorList pattern, at::TensorList state,
                            at::ArrayRef<double> hyper, at::TensorList bias_state, const OptionalTensor& update_guard,
                            at::ArrayRef<double> bias_hyper, c10::string_view activation) {
    // x, values, bias, the pattern's tensors, the state's, hyper, the bias state's, update_guard,
    // bias_hyper, activation.
    ctx->saved_data["inputs"] = int64_t(3 + pattern.size() + state.size() + 2 + bias_state.size() + 2);
    if (!bias_state.empty()) {  // given with the bias: checked by sparse_linear_adamw_autograd
      ctx->saved_data["bias_state"] = bias_state.vec();
      ctx->saved_data["bias_hyper"] = bias_hyper.vec();
      ctx->saved_data["bias"] = *bias;
    }
    if (update_guard) {
      TORCH_CHECK_VALUE(update_guard->is_cpu() && update_guard->scalar_type() == at::kLong &&
                            update_guard->numel() == 1,
                        "snack.sparse_linear_adamw: update_guard must be a one-element int64 CPU tensor");
      ctx->saved_data["update_guard"] = *update_guard;
    }
    // The optimizer's tensors are not saved variables: the backward updates them, and they have no gradient.
    ctx->saved_data["state"] = state.vec();
    ctx->saved_data["hyper"] = hyper.vec();
    const auto [product_values, product_bias] = product_parameters(x, values, bias);
    // Mixed precision: the products read the 16-bit copy (saved for dX), the update writes the masters.
    if (!product_values.is_same(values)) ctx->saved_data["master_values"] = values;
    return forward_and_save(ctx, x, product_values, product_bias, pattern, activation, values.requires_grad());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const Saved s = unpack(ctx, grad_outputs);
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) dx = input_grad(s);  // enqueued first: it reads the values before the update
    // The bias entered detached (see sparse_linear_adamw_autograd): it is an input of this node,
    // not a saved variable, since the layer's next forward reads it.
    const bool bias_in_backward = ctx->saved_data.count("bias_state") > 0;
    OptionalTensor bias;
    std::vector<at::Tensor> bias_state;
    std::vector<double> bias_hyper;
    if (bias_in_backward) {
      bias = ctx->saved_data["bias"].toTensor();
      bias_state = ctx->saved_data["bias_state"].toTensorVector();
      bias_hyper = ctx->saved_data["bias_hyper"].toDoubleVector();
    }
    // The bias enters the backward only with values that learn (sparse_linear_adamw_autograd).
    TORCH_INTERNAL_ASSERT(!bias_in_backward || ctx->needs_input_grad(1));
    if (ctx->needs_input_grad(1)) {
      if (ctx->saved_data.count("update_guard")) {  // host memory: no synchronisation
        int64_t* updated = ctx->saved_data["update_guard"].toTensor().data_ptr<int64_t>();
        TORCH_CHECK(*updated == 0,
                    "snack.optim.AdamW: this SparseLinear's values were already updated by a backward since the last "
                    "optimizer.step() (a second backward pass, or the layer applied twice); the update is fused into "
                    "the backward, so gradients cannot be accumulated. Call step() after every backward, or use "
                    "torch.optim.AdamW");
      }
      const OptionalTensor x_t =
          ctx->saved_data.count("x_t") ? OptionalTensor(ctx->saved_data["x_t"].toTensor()) : std::nullopt;
      ctx->saved_data.erase("x_t");  // freed once the update below is enqueued
      const at::Tensor values = ctx->saved_data.count("master_values") ? ctx->saved_data["master_values"].toTensor()
                                                                        : s.values;
      // The bias's update rides along in the same pass over dY.
      call_sddmm_adamw(s.dy, flatten_input(s.x, s.in_features), s.pattern, values,
                       ctx->saved_data["state"].toTensorVector(), ctx->saved_data["hyper"].toDoubleVector(), bias,
                       bias_state, bias_hyper, x_t);
      // Set once the update is enqueued: a call that raised updated nothing, and the next backward may.
      if (ctx->saved_data.count("update_guard")) *ctx->saved_data["update_guard"].toTensor().data_ptr<int64_t>() = 1;
      // A second backward through a graph that saved these values (the layer applied twice, or a
      // retained graph) now fails autograd's version check instead of using updated values.
      values.unsafeGetTensorImpl()->bump_version();
    }
    variable_list grads = gradients(size_t(ctx->saved_data["inputs"].toInt()), dx, at::Tensor(), at::Tensor());
    if (bias_in_backward) {
      bias->unsafeGetTensorImpl()->bump_version();
    } else {
      grads[2] = bias_grad_if_needed(ctx, s);
    }
    return grads;
  }
};

bool needs_grad(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias) {
  return at::GradMode::is_enabled() && (x.requires_grad() || values.requires_grad() || (bias && bias->requires_grad()));
}

at::Tensor sparse_linear_autograd(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                  at::TensorList pattern, c10::string_view activation) {
  if (!needs_grad(x, values, bias)) {  // inference: the fully fused kernel, nothing saved
    at::AutoDispatchBelowADInplaceOrView guard;
    return sparse_linear_forward(x, values, bias, pattern, activation);
  }
  check_pattern_list(pattern);
  if (x.requires_grad() || values.requires_grad()) check_pattern_needs(pattern, PatternNeeds::kAll, "sparse_linear");
  return SparseLinearFunction::apply(x, values, bias, pattern, activation);
}

// Below autograd the optimizer's arguments play no part: the layer's forward.
at::Tensor sparse_linear_adamw_forward(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                       at::TensorList pattern, at::TensorList, at::ArrayRef<double>, at::TensorList,
                                       const OptionalTensor&, at::ArrayRef<double>, c10::string_view activation) {
  const auto [product_values, product_bias] = product_parameters(x, values, bias);
  return sparse_linear_forward(x, product_values, product_bias, pattern, activation);
}

at::Tensor sparse_linear_adamw_autograd(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                        at::TensorList pattern, at::TensorList state, at::ArrayRef<double> hyper,
                                        at::TensorList bias_state, const OptionalTensor& update_guard,
                                        at::ArrayRef<double> bias_hyper, c10::string_view activation) {
  const char* op = "sparse_linear_adamw";
  TORCH_CHECK_VALUE(state.size() == 3 && hyper.size() == 6, "snack.", op, ": state holds exp_avg, exp_avg_sq and "
                    "step, hyper lr, beta1, beta2, eps, weight_decay and maximize");
  TORCH_CHECK_VALUE(bias_state.empty() == bias_hyper.empty() && (bias_state.empty() || bias.has_value()), "snack.", op,
                    ": give bias_state and bias_hyper together, and only with a bias");
  TORCH_CHECK_VALUE(bias_state.empty() || (bias_state.size() == 3 && bias_hyper.size() == 6), "snack.", op,
                    ": bias_state holds exp_avg, exp_avg_sq and step, bias_hyper six numbers");
  if (!needs_grad(x, values, bias)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return sparse_linear_adamw_forward(x, values, bias, pattern, state, hyper, bias_state, update_guard, bias_hyper,
                                       activation);
  }
  // A bias updated by the backward enters the node detached: autograd gives it no edge, so no
  // AccumulateGrad node of it runs with an undefined gradient. (Such a node keeps the stream it was
  // created on, and torch 2.11's engine makes the caller's stream wait on it at the end of the
  // backward: under CUDA-graph capture that crosses the capture boundary, pytorch#189371.) Without
  // values that learn the node may never run, and the bias then takes the usual gradient.
  check_pattern_list(pattern);
  if (x.requires_grad() || values.requires_grad()) check_pattern_needs(pattern, PatternNeeds::kAll, op);
  const bool bias_in_backward = !bias_state.empty() && values.requires_grad();
  const OptionalTensor bias_input = bias_in_backward ? OptionalTensor(bias->detach()) : bias;
  return SparseLinearAdamWFunction::apply(x, values, bias_input, pattern, state, hyper,
                                          bias_in_backward ? bias_state : at::TensorList(), update_guard,
                                          bias_in_backward ? bias_hyper : at::ArrayRef<double>(), activation);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, Autograd, m) {
  m.impl("sparse_linear", &snack::binding::sparse_linear_autograd);
  m.impl("sparse_linear_adamw", &snack::binding::sparse_linear_adamw_autograd);
}
// Below autograd (inference, tracing, meta/fake tensors) the layer is just spmm on a flattened input.
TORCH_LIBRARY_IMPL(snack, CompositeExplicitAutograd, m) {
  m.impl("sparse_linear", &snack::binding::sparse_linear_forward);
  m.impl("sparse_linear_adamw", &snack::binding::sparse_linear_adamw_forward);
}
