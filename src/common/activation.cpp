#include <string>

#include "snack/ops.h"

namespace snack {

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kNone: return "none";
    case Activation::kReLU: return "relu";
    case Activation::kGELU: return "gelu";
  }
  return "unknown";
}

bool parse_activation(const std::string& name, Activation* out) {
  for (Activation a : {Activation::kNone, Activation::kReLU, Activation::kGELU}) {
    if (name == activation_name(a)) {
      *out = a;
      return true;
    }
  }
  return false;
}

}  // namespace snack
