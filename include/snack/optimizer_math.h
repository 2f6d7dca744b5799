// The AdamW update of one stored connection, one definition for the CPU and CUDA code. It follows
// torch.optim.AdamW (decoupled weight decay; the arithmetic of torch's fused kernel), so a
// trajectory matches torch's optimizer on the same gradients to rounding.
#pragma once

#include <cmath>

#include "snack/value_types.h"

namespace snack {

/// AdamW's hyperparameters, as torch.optim.AdamW names them (in double, as Python passes them; each
/// update converts them to its accumulation type). lr: step size; beta1, beta2: decay of
/// the first and second moment; eps: added to the denominator; weight_decay: decoupled (the value
/// shrinks by lr * weight_decay per step); maximize: ascend the gradient instead.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool maximize = false;
};

/// The per-step constants of the update at step `step` (1 for the first update).
template <typename A>
struct AdamWStep {
  A beta1, beta2, eps, lr_decay, step_size, bias_correction2_sqrt;
  bool maximize;

  SNACK_HOST_DEVICE static AdamWStep make(const AdamWConfig& c, A step) {
    using std::pow;
    using std::sqrt;
    AdamWStep s;
    s.beta1 = A(c.beta1);
    s.beta2 = A(c.beta2);
    s.eps = A(c.eps);
    s.lr_decay = A(c.lr) * A(c.weight_decay);
    s.step_size = A(c.lr) / (A(1) - pow(A(c.beta1), step));
    s.bias_correction2_sqrt = sqrt(A(1) - pow(A(c.beta2), step));
    s.maximize = c.maximize;
    return s;
  }

  /// One update from gradient g: value, exp_avg and exp_avg_sq in place (in accumulation precision).
  SNACK_HOST_DEVICE void apply(A g, A& value, A& exp_avg, A& exp_avg_sq) const {
    using std::sqrt;
    if (maximize) g = -g;
    value -= lr_decay * value;
    exp_avg = beta1 * exp_avg + (A(1) - beta1) * g;
    exp_avg_sq = beta2 * exp_avg_sq + (A(1) - beta2) * g * g;
    const A denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
    value -= step_size * exp_avg / denom;
  }

  /// The same update of a value and moments stored as T (A = accum_t<T>), from a gradient stored as
  /// G (T, or a 16-bit type for float32 master values under mixed precision): each is widened,
  /// updated, and rounded back once.
  template <typename G, typename T>
  SNACK_HOST_DEVICE void apply_stored(G g, T& value, T& exp_avg, T& exp_avg_sq) const {
    A v = to_accum(value), m = to_accum(exp_avg), s = to_accum(exp_avg_sq);
    apply(to_accum(g), v, m, s);
    value = from_accum<T>(v);
    exp_avg = from_accum<T>(m);
    exp_avg_sq = from_accum<T>(s);
  }
};

}  // namespace snack
