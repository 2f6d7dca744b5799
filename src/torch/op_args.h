// The arguments of snack's operators, checked once for every backend: the pattern's tensor list,
// activations, kernel variants, dense operands, AdamW's state. A check names the op and the
// argument; core Status codes become the matching Python exception types.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "snack/activation.h"
#include "snack/optimizer_math.h"
#include "snack/pattern.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"
#include "snack/status.h"

namespace snack::binding {

// Raises the Python exception that matches the core status (ValueError, IndexError, ...).
void throw_if_error(const Status& status, const char* op);

// ---- the pattern ---------------------------------------------------------------------------------
// The fields of a pattern's tensor list, in the order every op takes them. The one statement of
// that order: the Python package and the libtorch module read it through the op snack::pattern_fields.
enum PatternField : int { kRowIdx = 0, kColIdx, kRowPtr, kColPtr, kCscPerm, kTilePtr, kTileEntries, kPatternFields };
const char* pattern_field_name(int field);

// A pattern list kept for inference (Pattern.for_inference, SlotPattern::forward_only): slots, but
// no row_idx (nor csc_perm, which pattern_arg checks).
inline bool kept_for_inference(const at::Tensor& row_idx, const at::Tensor& col_idx) {
  return col_idx.numel() > 0 && row_idx.numel() == 0;
}

// A pattern's tensors as an op receives them (Tensor[] pattern), with their shape and index type.
// Checked for dtypes, lengths and devices, not for contents.
struct PatternArg {
  at::Tensor row_idx, col_idx;             // [nnz] uint16 or int32, the slots sorted row-major
  at::Tensor row_ptr, col_ptr, csc_perm;   // [M + 1], [K + 1], [nnz] int32: the CSR and CSC views
  at::Tensor tile_ptr, tile_entries;       // int32, the tile view (snack/pattern.h), or both empty: absent
  int64_t rows = 0, cols = 0, nnz = 0;     // M and K are read from row_ptr and col_ptr
  at::ScalarType index_type = at::kInt;
  at::Device device = at::kCPU;

  bool has_tile_view() const { return tile_ptr.numel() > 0; }
  bool forward_only() const { return kept_for_inference(row_idx, col_idx); }

  template <typename Index>
  SlotPattern<Index> view() const {
    SlotPattern<Index> w;
    w.rows = rows;
    w.cols = cols;
    w.nnz = nnz;
    w.col_idx = static_cast<const Index*>(col_idx.data_ptr());
    w.row_ptr = row_ptr.data_ptr<int32_t>();
    w.col_ptr = col_ptr.data_ptr<int32_t>();
    if (!forward_only()) {
      w.row_idx = static_cast<const Index*>(row_idx.data_ptr());
      w.csc_perm = csc_perm.data_ptr<int32_t>();
    }
    if (has_tile_view()) {
      w.tile_ptr = tile_ptr.data_ptr<int32_t>();
      w.tile_entries = reinterpret_cast<const uint32_t*>(tile_entries.data_ptr<int32_t>());
    }
    return w;
  }
};

// A pattern that holds only the forward's arrays (Pattern.for_inference) is refused where `needs`
// is kAll, before anything runs.
PatternArg pattern_arg(at::TensorList pattern, const char* op, PatternNeeds needs = PatternNeeds::kAll);
// The same refusal alone, for a pattern list of the right length: the layer's autograd calls it
// before a forward whose backward would need dX or dW.
void check_pattern_needs(at::TensorList pattern, PatternNeeds needs, const char* op);

// Calls fn(SlotPattern<Index>) with the index type of the pattern.
template <typename Fn>
decltype(auto) with_pattern(const PatternArg& p, Fn&& fn) {
  if (p.index_type == at::kUInt16) return fn(p.view<uint16_t>());
  return fn(p.view<int32_t>());
}

// ---- names ---------------------------------------------------------------------------------------
Activation activation_arg(c10::string_view name, const char* op);
// The variant a schema string names; "auto" means the process default (set_default_spmm_variant),
// which the transposed product ignores where it names a forward-only kernel.
SpmmVariant spmm_variant_arg(c10::string_view name, bool transposed, const char* op);
SddmmVariant sddmm_variant_arg(c10::string_view name, const char* op);
// The path spmm_channels_first's string names (kAuto: the planner chooses).
ChannelsFirstPath channels_first_path_arg(c10::string_view name, const char* op);
void set_default_spmm_variant(c10::string_view name);
// How this process's transposed products read the CSC view (set_default_csc_read; auto: the planner).
CscRead default_csc_read();
void set_default_csc_read(c10::string_view name);
// Blocks per band of this process's tile_view products, SpMM and SDDMM (set_default_tile_view_splits;
// 0: the planner's choice).
int default_tile_view_splits();
void set_default_tile_view_splits(int64_t splits);
// Consumer warpgroups per block of this process's wgmma forwards over tile fragments
// (set_default_fragment_warpgroups; 0: the planner's choice).
int default_fragment_warpgroups();
void set_default_fragment_warpgroups(int64_t groups);

// ---- dense operands ------------------------------------------------------------------------------
void check_1d(const at::Tensor& t, const char* name, const char* op);
void check_same_device(const at::Tensor& t, const at::Device& device, const char* name, const char* op);
void check_value_dtype(const at::Tensor& values, const char* op);
// An activation-shaped operand: 2-D [N, cols] (channels_first: 3-D [B, cols, pixels]), the dtype of
// `like`, on the pattern's device.
void check_dense(const at::Tensor& t, const at::Tensor& like, int64_t cols, const PatternArg& p, const char* name,
                 const char* op, bool channels_first = false);
// values: 1-D, one per slot, a value dtype, on the pattern's device.
void check_values(const at::Tensor& values, const PatternArg& p, const char* op);
// bias (when given): [M], the dtype of values, on the pattern's device.
void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& values, const PatternArg& p, const char* op);

// Calls fn(T{}) with the snack value type of a tensor of a supported dtype (snack/value_types.h:
// the 16-bit types share the bit layout of torch.bfloat16 and torch.float16).
template <typename Fn>
void dispatch_value_type(const at::Tensor& values, const char* op, Fn&& fn) {
  check_value_dtype(values, op);
  switch (values.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kDouble: fn(double{}); break;
    case at::kBFloat16: fn(bfloat16{}); break;
    default: fn(float16{}); break;
  }
}

// A tensor's data as T: a value type of dispatch_value_type or an index type of dispatch_index_type.
template <typename T>
T* data_as(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

template <typename Fn>
void dispatch_index_type(at::ScalarType index_dtype, Fn&& fn) {
  if (index_dtype == at::kUInt16) fn(uint16_t{});
  else fn(int32_t{});
}

// Index dtype for a `rows x cols` pattern: the requested one, checked, or default_index_bits().
at::ScalarType choose_index_dtype(int64_t rows, int64_t cols, std::optional<at::ScalarType> requested, const char* op);
void check_features(int64_t out_features, int64_t in_features, const char* op);

// ---- AdamW ---------------------------------------------------------------------------------------
// A parameter (values or bias) under AdamW: state = [exp_avg, exp_avg_sq, step] (moments shaped
// like the parameter, the float32 count of updates on its device), hyper = [lr, beta1, beta2, eps,
// weight_decay, maximize as 0 or 1], checked as torch.optim.AdamW checks them.
struct AdamWArg {
  at::Tensor param, exp_avg, exp_avg_sq, step;
  AdamWConfig config;
};
AdamWArg adamw_arg(const at::Tensor& param, at::TensorList state, at::ArrayRef<double> hyper, const char* op,
                   const char* what);

// The transposed input a forward may hand its SDDMM (spmm_for_step's x_t): defined and non-empty.
inline bool given(const std::optional<at::Tensor>& x_t) { return x_t && x_t->defined() && x_t->numel() > 0; }

}  // namespace snack::binding
