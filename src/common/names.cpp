// Names of the enums that the Python API passes as strings (activations, SpMM and SDDMM variants).
#include <initializer_list>
#include <string>

#include "snack/ops.h"
#include "snack/spmm_plan.h"

namespace snack {

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kNone: return "none";
    case Activation::kReLU: return "relu";
    case Activation::kGELU: return "gelu";
  }
  return "unknown";
}

namespace {
// Finds the value among `all` whose name_of is `name`.
template <typename E>
bool parse_name(const std::string& name, std::initializer_list<E> all, const char* (*name_of)(E), E* out) {
  for (E v : all) {
    if (name == name_of(v)) {
      *out = v;
      return true;
    }
  }
  return false;
}
}  // namespace

bool parse_activation(const std::string& name, Activation* out) {
  return parse_name(name, {Activation::kNone, Activation::kReLU, Activation::kGELU}, activation_name, out);
}

const char* spmm_variant_name(SpmmVariant v) {
  switch (v) {
    case SpmmVariant::kAuto: return "auto";
    case SpmmVariant::kWarpRow: return "warp_row";
    case SpmmVariant::kSmemX: return "smem_x";
    case SpmmVariant::kGlobalXT: return "global_xt";
    case SpmmVariant::kGlobalX: return "global_x";
    case SpmmVariant::kCooAtomic: return "coo_atomic";
  }
  return "unknown";
}

bool parse_spmm_variant(const std::string& name, SpmmVariant* out) {
  return parse_name(name,
                    {SpmmVariant::kAuto, SpmmVariant::kWarpRow, SpmmVariant::kSmemX, SpmmVariant::kGlobalXT,
                     SpmmVariant::kGlobalX, SpmmVariant::kCooAtomic},
                    spmm_variant_name, out);
}

const char* sddmm_variant_name(SddmmVariant v) {
  switch (v) {
    case SddmmVariant::kAuto: return "auto";
    case SddmmVariant::kSlot: return "slot";
    case SddmmVariant::kVector: return "vector";
    case SddmmVariant::kSmemX: return "smem_x";
    case SddmmVariant::kRows: return "rows";
  }
  return "unknown";
}

bool parse_sddmm_variant(const std::string& name, SddmmVariant* out) {
  return parse_name(name,
                    {SddmmVariant::kAuto, SddmmVariant::kSlot, SddmmVariant::kVector, SddmmVariant::kSmemX,
                     SddmmVariant::kRows},
                    sddmm_variant_name, out);
}

}  // namespace snack
