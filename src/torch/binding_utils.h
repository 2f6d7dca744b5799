// Shared helpers of the PyTorch binding: argument checks that name the argument, conversion of
// tensors to core views, dtype dispatch, and mapping core Status codes to Python exception types.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "snack/ops.h"
#include "snack/pattern.h"
#include "snack/status.h"

namespace snack::binding {

// Raises the Python exception that matches the core status (ValueError, IndexError, ...).
inline void throw_if_error(const Status& status, const char* op) {
  if (status.ok()) return;
  const std::string msg = std::string("snack.") + op + ": " + status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kDuplicateEntry: TORCH_CHECK_VALUE(false, msg);
    case StatusCode::kOutOfRange: TORCH_CHECK_INDEX(false, msg);
    case StatusCode::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    default: TORCH_CHECK(false, msg);
  }
}

// The five tensors that describe a pattern, always passed to the ops in this order.
struct PatternTensors {
  const at::Tensor& row_idx;
  const at::Tensor& col_idx;
  const at::Tensor& row_ptr;
  const at::Tensor& col_ptr;
  const at::Tensor& csc_perm;
  int64_t rows() const { return row_ptr.size(0) - 1; }
  int64_t cols() const { return col_ptr.size(0) - 1; }
  int64_t nnz() const { return row_idx.size(0); }
};

// The Activation named by a schema string argument; a clear error naming the op otherwise.
inline Activation activation_arg(c10::string_view name, const char* op) {
  Activation act = Activation::kNone;
  TORCH_CHECK_VALUE(parse_activation(std::string(name), &act), "snack.", op, ": unknown activation '", name,
                    "' (expected none, relu or gelu)");
  return act;
}

inline void check_1d(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.dim() == 1, "snack.", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "snack.", op, ": ", name, " must be contiguous");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* op) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "snack.", op, ": ", name, " is on ", t.device(),
                    " but the weight is on ", ref.device());
}

// Validates the pattern tensors' dtypes, shapes and devices (not their contents).
inline void check_pattern(const PatternTensors& p, const at::Tensor& values, const char* op) {
  check_1d(p.row_idx, "row_idx", op);
  check_1d(p.col_idx, "col_idx", op);
  check_1d(p.row_ptr, "row_ptr", op);
  check_1d(p.col_ptr, "col_ptr", op);
  check_1d(p.csc_perm, "csc_perm", op);
  const auto index_type = p.row_idx.scalar_type();
  TORCH_CHECK_TYPE(index_type == at::kUInt16 || index_type == at::kInt, "snack.", op,
                   ": row_idx must be uint16 or int32, got ", index_type);
  TORCH_CHECK_TYPE(p.col_idx.scalar_type() == index_type, "snack.", op, ": col_idx dtype ",
                   p.col_idx.scalar_type(), " differs from row_idx dtype ", index_type);
  TORCH_CHECK_TYPE(p.row_ptr.scalar_type() == at::kInt && p.col_ptr.scalar_type() == at::kInt &&
                       p.csc_perm.scalar_type() == at::kInt,
                   "snack.", op, ": row_ptr, col_ptr and csc_perm must be int32");
  TORCH_CHECK_VALUE(p.row_ptr.size(0) >= 1 && p.col_ptr.size(0) >= 1, "snack.", op,
                    ": row_ptr and col_ptr need at least one element");
  TORCH_CHECK_VALUE(p.col_idx.size(0) == p.nnz() && p.csc_perm.size(0) == p.nnz(), "snack.", op,
                    ": row_idx, col_idx and csc_perm must have the same length (", p.nnz(), ", ",
                    p.col_idx.size(0), ", ", p.csc_perm.size(0), ")");
  if (values.defined()) {
    check_1d(values, "values", op);
    TORCH_CHECK_VALUE(values.size(0) == p.nnz(), "snack.", op, ": values has ", values.size(0),
                      " elements but the pattern has nnz=", p.nnz());
    for (const at::Tensor* t : {&p.row_idx, &p.col_idx, &p.row_ptr, &p.col_ptr, &p.csc_perm})
      check_same_device(*t, values, "pattern index tensor", op);
  }
}

template <typename Index>
SlotPattern<Index> to_view(const PatternTensors& p) {
  SlotPattern<Index> w;
  w.rows = p.rows();
  w.cols = p.cols();
  w.nnz = p.nnz();
  w.row_idx = reinterpret_cast<const Index*>(p.row_idx.data_ptr());
  w.col_idx = reinterpret_cast<const Index*>(p.col_idx.data_ptr());
  w.row_ptr = p.row_ptr.data_ptr<int32_t>();
  w.col_ptr = p.col_ptr.data_ptr<int32_t>();
  w.csc_perm = p.csc_perm.data_ptr<int32_t>();
  return w;
}

// Calls fn(SlotPattern<Index>) with the index type of the pattern.
template <typename Fn>
decltype(auto) with_pattern(const PatternTensors& p, Fn&& fn) {
  if (p.row_idx.scalar_type() == at::kUInt16) return fn(to_view<uint16_t>(p));
  return fn(to_view<int32_t>(p));
}

// Checks an activation-shaped operand: floating dtype equal to the weight's, same device, 2-D.
inline void check_dense(const at::Tensor& t, const at::Tensor& values, int64_t cols, const char* name,
                        const char* op) {
  TORCH_CHECK_VALUE(t.dim() == 2, "snack.", op, ": ", name, " must be 2-D [N, ", cols, "], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(1) == cols, "snack.", op, ": ", name, " has ", t.size(1), " columns, expected ", cols);
  TORCH_CHECK_TYPE(t.scalar_type() == values.scalar_type(), "snack.", op, ": ", name, " dtype ", t.scalar_type(),
                   " differs from the weight dtype ", values.scalar_type());
  check_same_device(t, values, name, op);
}

inline void check_value_dtype(const at::Tensor& values, const char* op) {
  const at::ScalarType t = values.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, "snack.", op,
                   ": values must be float32, float64, bfloat16 or float16, got ", t);
}

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

// A tensor's data as the snack value type T (any of dispatch_value_type's).
template <typename T>
T* data_as(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Index dtype for a `rows x cols` pattern: uint16 where both dimensions fit, int32 otherwise.
inline at::ScalarType choose_index_dtype(int64_t rows, int64_t cols, std::optional<at::ScalarType> requested,
                                         const char* op) {
  const bool fits16 = rows <= kMaxDim16 && cols <= kMaxDim16;
  if (!requested) return fits16 ? at::kUInt16 : at::kInt;
  TORCH_CHECK_TYPE(*requested == at::kUInt16 || *requested == at::kInt, "snack.", op,
                   ": index_dtype must be torch.uint16 or torch.int32, got ", *requested);
  TORCH_CHECK_VALUE(*requested == at::kInt || fits16, "snack.", op, ": a ", rows, "x", cols,
                    " matrix needs int32 indices (uint16 addresses at most 65536 rows and columns)");
  TORCH_CHECK_VALUE(rows <= std::numeric_limits<int32_t>::max() && cols <= std::numeric_limits<int32_t>::max(),
                    "snack.", op, ": dimensions beyond 2^31-1 are not supported");
  return *requested;
}

// The bodies of the ops spmm and sddmm_adamw_ (kernels.cpp), which the layer's autograd with
// snack.optim.AdamW (autograd.cpp) also calls directly, real tensors only (they read data pointers
// outside the dispatcher): spmm setting *x_t (when x_t is not null) to X transposed where the CUDA
// plan made that copy of the whole batch (else undefined), and sddmm_adamw_ reading such a copy
// (x_t defined) instead of transposing X again.
at::Tensor spmm_keeping_transposed_input(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                                         const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                         const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                                         const std::optional<at::Tensor>& bias, c10::string_view activation_name,
                                         c10::string_view variant_name, at::Tensor* x_t);
void sddmm_adamw_given_transposed_input(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
    const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm, const at::Tensor& values,
    const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
    double beta2, double eps, double weight_decay, bool maximize, c10::string_view variant_name,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& bias_exp_avg,
    const std::optional<at::Tensor>& bias_exp_avg_sq, const std::optional<at::Tensor>& bias_step,
    std::optional<c10::ArrayRef<double>> bias_hyper, const at::Tensor& x_t);

}  // namespace snack::binding
