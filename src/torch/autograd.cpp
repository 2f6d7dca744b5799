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

// bias_* given (all, or none): the bias is updated in the same pass (see sddmm_adamw_'s schema).
// x_t: the forward's copy of X^T (kept only for real CUDA tensors), read in place of a transpose
// by a direct call; undefined: the op through the dispatcher.
void call_sddmm_adamw(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                      const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                      const at::Tensor& values, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& step, double lr, double beta1, double beta2, double eps, double weight_decay,
                      bool maximize, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& bias_exp_avg, const std::optional<at::Tensor>& bias_exp_avg_sq,
                      const std::optional<at::Tensor>& bias_step, std::optional<c10::ArrayRef<double>> bias_hyper,
                      const at::Tensor& x_t) {
  if (x_t.defined()) {
    sddmm_adamw_given_transposed_input(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, values, exp_avg,
                                       exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize, "auto", bias,
                                       bias_exp_avg, bias_exp_avg_sq, bias_step, bias_hyper, x_t);
    return;
  }
  using OptionalTensor = const std::optional<at::Tensor>&;
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("snack::sddmm_adamw_", "").typed<void(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, double, double, double, double, double, bool, c10::string_view, OptionalTensor,
      OptionalTensor, OptionalTensor, OptionalTensor, std::optional<c10::ArrayRef<double>>)>();
  op.call(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, values, exp_avg, exp_avg_sq, step, lr, beta1, beta2,
          eps, weight_decay, maximize, "auto", bias, bias_exp_avg, bias_exp_avg_sq, bias_step, bias_hyper);
}

// Whether t is a real CUDA tensor, not a fake, meta or functional one of a tracer: only then may the
// layer run kernels outside the dispatcher.
bool real_cuda_tensor(const at::Tensor& t) {
  return t.is_cuda() &&
         !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// The forward of both autograd functions below. ReLU is fused and its gradient mask comes from
// the output. GELU's gradient needs the pre-activation, so under autograd it is computed unfused
// and the pre-activation is saved. With keep_transposed_input, X transposed by the forward's
// kernel (where its plan makes that copy of the whole batch) is kept in ctx->saved_data["x_t"]
// for the SDDMM of the backward, which then does not transpose X again.
at::Tensor forward_and_save(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const std::optional<at::Tensor>& bias, const at::Tensor& row_idx, const at::Tensor& col_idx,
                            const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                            c10::string_view activation, bool keep_transposed_input = false) {
  const Activation act = activation_arg(activation, "sparse_linear");
  ctx->saved_data["has_bias"] = bias.has_value();
  ctx->saved_data["activation"] = static_cast<int64_t>(act);
  const auto product = [&](c10::string_view fused_activation) {
    if (!keep_transposed_input)
      return sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, fused_activation);
    const int64_t in_features = col_ptr.size(0) - 1, out_features = row_ptr.size(0) - 1;
    at::Tensor x_t;
    const at::Tensor y2d = spmm_keeping_transposed_input(flatten_input(x, in_features), values, row_idx, col_idx,
                                                         row_ptr, col_ptr, csc_perm, bias, fused_activation, "auto",
                                                         &x_t);
    if (x_t.defined()) ctx->saved_data["x_t"] = x_t;
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
  ctx->save_for_backward({x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, saved_activation});
  return y;
}

// What forward_and_save kept, and dY: the output gradient through the activation, as [N, M].
struct Saved {
  at::Tensor x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, dy;
  int64_t in_features;
};

Saved unpack(AutogradContext* ctx, const variable_list& grad_outputs) {
  const auto saved = ctx->get_saved_variables();
  Saved s{saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6], at::Tensor(), saved[5].size(0) - 1};
  const int64_t out_features = s.row_ptr.size(0) - 1;
  at::Tensor grad = grad_outputs[0];
  switch (static_cast<Activation>(ctx->saved_data["activation"].toInt())) {
    case Activation::kReLU: grad = at::threshold_backward(grad, saved[7], 0); break;  // one kernel: grad where y > 0
    case Activation::kGELU: grad = at::gelu_backward(grad, saved[7]); break;
    default: break;
  }
  s.dy = grad.reshape({-1, out_features}).contiguous();
  return s;
}

at::Tensor input_grad(const Saved& s) {
  return call_spmm_t(s.dy, s.values, s.row_idx, s.col_idx, s.row_ptr, s.col_ptr, s.csc_perm).view(s.x.sizes());
}

at::Tensor bias_grad_if_needed(AutogradContext* ctx, const Saved& s) {
  return ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2) ? call_bias_grad(s.dy) : at::Tensor();
}

class SparseLinearFunction : public torch::autograd::Function<SparseLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const std::optional<at::Tensor>& bias, const at::Tensor& row_idx,
                            const at::Tensor& col_idx, const at::Tensor& row_ptr, const at::Tensor& col_ptr,
                            const at::Tensor& csc_perm, c10::string_view activation) {
    return forward_and_save(ctx, x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const Saved s = unpack(ctx, grad_outputs);
    at::Tensor dx, dvalues;
    if (ctx->needs_input_grad(0)) dx = input_grad(s);
    if (ctx->needs_input_grad(1))
      dvalues = call_sddmm(s.dy, flatten_input(s.x, s.in_features), s.row_idx, s.col_idx, s.row_ptr, s.col_ptr,
                           s.csc_perm);
    return {dx, dvalues, bias_grad_if_needed(ctx, s), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Whether sparse_linear_adamw was given the bias's AdamW state (all four arguments, or none).
bool bias_state_given(const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& bias_exp_avg,
                      const std::optional<at::Tensor>& bias_exp_avg_sq, const std::optional<at::Tensor>& bias_step,
                      std::optional<c10::ArrayRef<double>> bias_hyper) {
  const int given = int(bias_exp_avg.has_value()) + int(bias_exp_avg_sq.has_value()) + int(bias_step.has_value()) +
                    int(bias_hyper.has_value());
  TORCH_CHECK_VALUE(given == 0 || (given == 4 && bias.has_value()), "snack.sparse_linear_adamw: give bias_exp_avg, "
                    "bias_exp_avg_sq, bias_step and bias_hyper together, and only with a bias");
  if (given == 0) return false;
  TORCH_CHECK_VALUE(bias_hyper->size() == 6, "snack.sparse_linear_adamw: bias_hyper holds lr, beta1, beta2, eps, "
                    "weight_decay and maximize, got ", bias_hyper->size(), " numbers");
  return true;
}

// The layer with AdamW applied to values inside its backward: no gradient is returned for them.
class SparseLinearAdamWFunction : public torch::autograd::Function<SparseLinearAdamWFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& values,
                            const std::optional<at::Tensor>& bias, const at::Tensor& row_idx,
                            const at::Tensor& col_idx, const at::Tensor& row_ptr, const at::Tensor& col_ptr,
                            const at::Tensor& csc_perm, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const at::Tensor& step, const std::optional<at::Tensor>& update_guard, double lr,
                            double beta1, double beta2, double eps, double weight_decay, bool maximize,
                            c10::string_view activation, const std::optional<at::Tensor>& bias_exp_avg,
                            const std::optional<at::Tensor>& bias_exp_avg_sq,
                            const std::optional<at::Tensor>& bias_step,
                            std::optional<c10::ArrayRef<double>> bias_hyper) {
    if (bias_step) {  // given together, checked by sparse_linear_adamw_autograd
      ctx->saved_data["bias_exp_avg"] = *bias_exp_avg;
      ctx->saved_data["bias_exp_avg_sq"] = *bias_exp_avg_sq;
      ctx->saved_data["bias_step"] = *bias_step;
      ctx->saved_data["bias_hyper"] = bias_hyper->vec();
      ctx->saved_data["bias"] = *bias;
    }
    if (update_guard) {
      TORCH_CHECK_VALUE(update_guard->is_cpu() && update_guard->scalar_type() == at::kLong &&
                            update_guard->numel() == 1,
                        "snack.sparse_linear_adamw: update_guard must be a one-element int64 CPU tensor");
      ctx->saved_data["update_guard"] = *update_guard;
    }
    // The optimizer's tensors are not saved variables: the backward updates them, and they have no gradient.
    ctx->saved_data["exp_avg"] = exp_avg;
    ctx->saved_data["exp_avg_sq"] = exp_avg_sq;
    ctx->saved_data["step"] = step;
    ctx->saved_data["hyper"] = std::vector<double>{lr, beta1, beta2, eps, weight_decay};
    ctx->saved_data["maximize"] = maximize;
    // The SDDMM of the backward reads the forward's copy of X^T where there is one (the GPU).
    const bool keep_transposed_input = values.requires_grad() && real_cuda_tensor(x) && real_cuda_tensor(values);
    return forward_and_save(ctx, x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation,
                            keep_transposed_input);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const Saved s = unpack(ctx, grad_outputs);
    at::Tensor dx;
    if (ctx->needs_input_grad(0)) dx = input_grad(s);  // enqueued first: it reads the values before the update
    // The bias entered detached (see sparse_linear_adamw_autograd): it is an input of this node,
    // not a saved variable, since the layer's next forward reads it.
    const bool bias_in_backward = ctx->saved_data.count("bias_step") > 0;
    std::optional<at::Tensor> bias, bias_exp_avg, bias_exp_avg_sq, bias_step;
    std::vector<double> bias_hyper;
    if (bias_in_backward) {
      bias = ctx->saved_data["bias"].toTensor();
      bias_exp_avg = ctx->saved_data["bias_exp_avg"].toTensor();
      bias_exp_avg_sq = ctx->saved_data["bias_exp_avg_sq"].toTensor();
      bias_step = ctx->saved_data["bias_step"].toTensor();
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
        *updated = 1;
      }
      const auto hyper = ctx->saved_data["hyper"].toDoubleVector();
      const at::Tensor x_t = ctx->saved_data.count("x_t") ? ctx->saved_data["x_t"].toTensor() : at::Tensor();
      ctx->saved_data.erase("x_t");  // freed once the update below is enqueued
      // The bias's update rides along in the same pass over dY.
      call_sddmm_adamw(s.dy, flatten_input(s.x, s.in_features), s.row_idx, s.col_idx, s.row_ptr, s.col_ptr,
                       s.csc_perm, s.values, ctx->saved_data["exp_avg"].toTensor(),
                       ctx->saved_data["exp_avg_sq"].toTensor(), ctx->saved_data["step"].toTensor(), hyper[0],
                       hyper[1], hyper[2], hyper[3], hyper[4], ctx->saved_data["maximize"].toBool(), bias,
                       bias_exp_avg, bias_exp_avg_sq, bias_step,
                       bias_in_backward ? std::optional<c10::ArrayRef<double>>(bias_hyper) : std::nullopt, x_t);
      // A second backward through a graph that saved these values (the layer applied twice, or a
      // retained graph) now fails autograd's version check instead of using updated values.
      s.values.unsafeGetTensorImpl()->bump_version();
    }
    variable_list grads(23);
    grads[0] = dx;
    if (bias_in_backward) {
      bias->unsafeGetTensorImpl()->bump_version();
    } else {
      grads[2] = bias_grad_if_needed(ctx, s);
    }
    return grads;
  }
};

bool needs_grad(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& bias) {
  return at::GradMode::is_enabled() &&
         (x.requires_grad() || values.requires_grad() || (bias && bias->requires_grad()));
}

at::Tensor sparse_linear_autograd(const at::Tensor& x, const at::Tensor& values, const std::optional<at::Tensor>& bias,
                                  const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                  const at::Tensor& col_ptr, const at::Tensor& csc_perm, c10::string_view activation) {
  if (!needs_grad(x, values, bias)) {  // inference: the fully fused kernel, nothing saved
    at::AutoDispatchBelowADInplaceOrView guard;
    return sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
  }
  return SparseLinearFunction::apply(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
}

// Below autograd the optimizer's arguments play no part: the layer's forward.
at::Tensor sparse_linear_adamw_forward(const at::Tensor& x, const at::Tensor& values,
                                       const std::optional<at::Tensor>& bias, const at::Tensor& row_idx,
                                       const at::Tensor& col_idx, const at::Tensor& row_ptr, const at::Tensor& col_ptr,
                                       const at::Tensor& csc_perm, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, const std::optional<at::Tensor>&, double, double, double,
                                       double, double, bool, c10::string_view activation,
                                       const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>&, std::optional<c10::ArrayRef<double>>) {
  return sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
}

at::Tensor sparse_linear_adamw_autograd(const at::Tensor& x, const at::Tensor& values,
                                        const std::optional<at::Tensor>& bias, const at::Tensor& row_idx,
                                        const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                        const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                                        const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                        const at::Tensor& step, const std::optional<at::Tensor>& update_guard,
                                        double lr, double beta1, double beta2, double eps, double weight_decay,
                                        bool maximize, c10::string_view activation,
                                        const std::optional<at::Tensor>& bias_exp_avg,
                                        const std::optional<at::Tensor>& bias_exp_avg_sq,
                                        const std::optional<at::Tensor>& bias_step,
                                        std::optional<c10::ArrayRef<double>> bias_hyper) {
  const bool bias_state = bias_state_given(bias, bias_exp_avg, bias_exp_avg_sq, bias_step, bias_hyper);
  if (!needs_grad(x, values, bias)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return sparse_linear_forward(x, values, bias, row_idx, col_idx, row_ptr, col_ptr, csc_perm, activation);
  }
  // A bias updated by the backward enters the node detached: autograd gives it no edge, so no
  // AccumulateGrad node of it runs with an undefined gradient. (Such a node keeps the stream it was
  // created on, and torch 2.11's engine makes the caller's stream wait on it at the end of the
  // backward: under CUDA-graph capture that crosses the capture boundary, pytorch#189371.) Without
  // values that learn the node may never run, and the bias then takes the usual gradient.
  const bool bias_in_backward = bias_state && values.requires_grad();
  const std::optional<at::Tensor> bias_input = bias_in_backward ? std::optional<at::Tensor>(bias->detach()) : bias;
  const std::optional<at::Tensor> none;
  return SparseLinearAdamWFunction::apply(x, values, bias_input, row_idx, col_idx, row_ptr, col_ptr, csc_perm,
                                          exp_avg, exp_avg_sq, step, update_guard, lr, beta1, beta2, eps,
                                          weight_decay, maximize, activation, bias_in_backward ? bias_exp_avg : none,
                                          bias_in_backward ? bias_exp_avg_sq : none,
                                          bias_in_backward ? bias_step : none, bias_in_backward ? bias_hyper : std::nullopt);
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
