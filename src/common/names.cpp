// Names of the enums that the Python API passes as strings (activations, SpMM and SDDMM variants):
// one table per enum serves both directions.
#include <string>

#include "snack/ops.h"
#include "snack/spmm_plan.h"

namespace snack {
namespace {

template <typename E>
struct Named {
  E value;
  const char* name;
};

constexpr Named<Activation> kActivations[] = {
    {Activation::kNone, "none"}, {Activation::kReLU, "relu"}, {Activation::kGELU, "gelu"}};
constexpr Named<SpmmVariant> kSpmmVariants[] = {{SpmmVariant::kAuto, "auto"},
                                                {SpmmVariant::kWarpRow, "warp_row"},
                                                {SpmmVariant::kSmemX, "smem_x"},
                                                {SpmmVariant::kGlobalXT, "global_xt"},
                                                {SpmmVariant::kGlobalX, "global_x"},
                                                {SpmmVariant::kCooAtomic, "coo_atomic"},
                                                {SpmmVariant::kWideRows, "wide_rows"}};
constexpr Named<SddmmVariant> kSddmmVariants[] = {{SddmmVariant::kAuto, "auto"},
                                                  {SddmmVariant::kSlot, "slot"},
                                                  {SddmmVariant::kVector, "vector"},
                                                  {SddmmVariant::kRows, "rows"}};

template <typename E, size_t N>
const char* name_in(const Named<E> (&table)[N], E v) {
  for (const Named<E>& entry : table)
    if (entry.value == v) return entry.name;
  return "unknown";
}

template <typename E, size_t N>
bool parse_in(const Named<E> (&table)[N], const std::string& name, E* out) {
  for (const Named<E>& entry : table) {
    if (name == entry.name) {
      *out = entry.value;
      return true;
    }
  }
  return false;
}

}  // namespace

const char* activation_name(Activation act) { return name_in(kActivations, act); }
bool parse_activation(const std::string& name, Activation* out) { return parse_in(kActivations, name, out); }

const char* spmm_variant_name(SpmmVariant v) { return name_in(kSpmmVariants, v); }
bool parse_spmm_variant(const std::string& name, SpmmVariant* out) { return parse_in(kSpmmVariants, name, out); }

const char* sddmm_variant_name(SddmmVariant v) { return name_in(kSddmmVariants, v); }
bool parse_sddmm_variant(const std::string& name, SddmmVariant* out) { return parse_in(kSddmmVariants, name, out); }

}  // namespace snack
