// torch.autocast for snack's operators: under autocast a SparseLinear computes as nn.Linear does.
//
// The products (spmm, spmm_t, spmm_channels_first, sddmm, separable_conv) and sparse_linear follow
// autocast's lower-precision policy: every floating-point operand on the autocast device, values and bias included, is cast to the
// autocast dtype (with autocast's cache, as nn.Linear's weight is), and the op runs in that dtype
// with float32 accumulation. Autograd sees those casts, so the gradients of float32 values and
// bias come back in float32. sparse_linear_adamw casts x only: its backward updates the values and
// bias in place, so they stay the float32 masters, its products read 16-bit copies of them, and the
// fused step computes their gradient from the 16-bit operands (autograd.cpp, sddmm_adamw_).
//
// These kernels sit above Autograd in the dispatcher, so torch.compile and CUDA graphs see the
// casts as ordinary ops. Operands of other devices, integer tensors and float64 tensors are left as
// they are (autocast's eligibility rule), which gives the ops' own dtype errors, as for nn.Linear.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <optional>

#include "op_handle.h"

namespace snack::binding {
namespace {

using OptionalTensor = std::optional<at::Tensor>;
using at::autocast::cached_cast;

// Runs below autocast for device type D: the guard keeps the op's own call from re-entering here.
template <c10::DeviceType D>
struct BelowAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{at::autocast::get_autocast_dispatch_key_from_device_type(D)};
  at::ScalarType dtype = at::autocast::get_autocast_dtype(D);
};

template <c10::DeviceType D>
at::Tensor spmm_autocast(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                         const OptionalTensor& bias, c10::string_view activation, c10::string_view variant,
                         const OptionalTensor& tiles) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, const OptionalTensor&,
                                        c10::string_view, c10::string_view, const OptionalTensor&)>("snack::spmm");
  BelowAutocast<D> below;
  // The packed tiles are bits, never cast: the op checks them against the values it receives.
  return op.call(cached_cast(below.dtype, x, D), cached_cast(below.dtype, values, D), pattern,
                 cached_cast(below.dtype, bias, D), activation, variant, tiles);
}

template <c10::DeviceType D>
at::Tensor spmm_channels_first_autocast(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                                        const OptionalTensor& bias, c10::string_view activation,
                                        c10::string_view variant) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, const OptionalTensor&,
                                        c10::string_view, c10::string_view)>("snack::spmm_channels_first");
  BelowAutocast<D> below;
  return op.call(cached_cast(below.dtype, x, D), cached_cast(below.dtype, values, D), pattern,
                 cached_cast(below.dtype, bias, D), activation, variant);
}

template <c10::DeviceType D>
at::Tensor spmm_t_autocast(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern,
                           c10::string_view variant) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view)>(
      "snack::spmm_t");
  BelowAutocast<D> below;
  return op.call(cached_cast(below.dtype, dy, D), cached_cast(below.dtype, values, D), pattern, variant);
}

template <c10::DeviceType D>
at::Tensor sddmm_autocast(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, c10::string_view variant) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, at::TensorList, c10::string_view)>(
      "snack::sddmm");
  BelowAutocast<D> below;
  return op.call(cached_cast(below.dtype, dy, D), cached_cast(below.dtype, x, D), pattern, variant);
}

template <c10::DeviceType D>
at::Tensor separable_conv_autocast(const at::Tensor& x, const at::Tensor& dw_weight, const OptionalTensor& dw_bias,
                                   int64_t stride, c10::string_view dw_activation, const at::Tensor& values,
                                   at::TensorList pattern, const OptionalTensor& bias, c10::string_view activation,
                                   c10::string_view variant) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t,
                                        c10::string_view, const at::Tensor&, at::TensorList, const OptionalTensor&,
                                        c10::string_view, c10::string_view)>("snack::separable_conv");
  BelowAutocast<D> below;
  return op.call(cached_cast(below.dtype, x, D), cached_cast(below.dtype, dw_weight, D),
                 cached_cast(below.dtype, dw_bias, D), stride, dw_activation, cached_cast(below.dtype, values, D),
                 pattern, cached_cast(below.dtype, bias, D), activation, variant);
}

template <c10::DeviceType D>
at::Tensor sparse_linear_autocast(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                  at::TensorList pattern, c10::string_view activation) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, at::TensorList,
                                        c10::string_view)>("snack::sparse_linear");
  BelowAutocast<D> below;
  return op.call(cached_cast(below.dtype, x, D), cached_cast(below.dtype, values, D), cached_cast(below.dtype, bias, D),
                 pattern, activation);
}

template <c10::DeviceType D>
at::Tensor sparse_linear_adamw_autocast(const at::Tensor& x, const at::Tensor& values, const OptionalTensor& bias,
                                        at::TensorList pattern, at::TensorList state, at::ArrayRef<double> hyper,
                                        at::TensorList bias_state, const OptionalTensor& update_guard,
                                        at::ArrayRef<double> bias_hyper, c10::string_view activation) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, at::TensorList,
                                        at::TensorList, at::ArrayRef<double>, at::TensorList, const OptionalTensor&,
                                        at::ArrayRef<double>, c10::string_view)>("snack::sparse_linear_adamw");
  BelowAutocast<D> below;
  const at::Tensor x_cast = cached_cast(below.dtype, x, D);
  // The masters are updated in place: they must be float32 (any 16-bit x then works) or already
  // of the autocast dtype; a 16-bit copy of another type would take the update instead of them.
  TORCH_CHECK_TYPE(x_cast.scalar_type() != below.dtype || values.scalar_type() == at::kFloat ||
                       values.scalar_type() == below.dtype,
                   "snack.optim.AdamW under torch.autocast(dtype=", below.dtype, "): the fused update needs float32 "
                   "values or values of the autocast dtype, got ", values.scalar_type());
  return op.call(x_cast, values, bias, pattern, state, hyper, bias_state, update_guard, bias_hyper, activation);
}

template <c10::DeviceType D>
void register_autocast(torch::Library& m) {
  m.impl("spmm", &spmm_autocast<D>);
  m.impl("spmm_t", &spmm_t_autocast<D>);
  m.impl("spmm_channels_first", &spmm_channels_first_autocast<D>);
  m.impl("sddmm", &sddmm_autocast<D>);
  m.impl("separable_conv", &separable_conv_autocast<D>);
  m.impl("sparse_linear", &sparse_linear_autocast<D>);
  m.impl("sparse_linear_adamw", &sparse_linear_adamw_autocast<D>);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, AutocastCUDA, m) { snack::binding::register_autocast<c10::DeviceType::CUDA>(m); }
TORCH_LIBRARY_IMPL(snack, AutocastCPU, m) { snack::binding::register_autocast<c10::DeviceType::CPU>(m); }
