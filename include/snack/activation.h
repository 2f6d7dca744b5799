// The elementwise function fused into the forward's epilogue, y = act(x W^T + b): one definition
// for the CPU and the CUDA code.
#pragma once

#include <cmath>
#include <string>

#include "snack/value_types.h"

namespace snack {

/// kGELU is the exact (erf) GELU, as torch.nn.functional.gelu with approximate="none".
enum class Activation : int { kNone = 0, kReLU = 1, kGELU = 2 };

/// "none", "relu", "gelu".
const char* activation_name(Activation act);
/// Parses a name; returns false for an unknown name.
bool parse_activation(const std::string& name, Activation* out);

/// act(v).
template <typename A>
SNACK_HOST_DEVICE A apply_activation(A v, Activation act) {
  switch (act) {
    case Activation::kReLU: return v < A(0) ? A(0) : v;  // NaN and -0 pass through, as in torch.relu
    case Activation::kGELU: return A(0.5) * v * (A(1) + erf(v * A(0.70710678118654752440)));
    default: return v;
  }
}

}  // namespace snack
