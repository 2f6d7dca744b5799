// The activation functions of the forward epilogue, one definition for the CPU and CUDA code.
#pragma once

#include <cmath>

#include "snack/ops.h"
#include "snack/value_types.h"

namespace snack {

template <typename A>
SNACK_HOST_DEVICE A apply_activation(A v, Activation act) {
  switch (act) {
    case Activation::kReLU: return v > A(0) ? v : A(0);
    case Activation::kGELU: return A(0.5) * v * (A(1) + erf(v * A(0.70710678118654752440)));
    default: return v;
  }
}

}  // namespace snack
