// The fused sparse attention operators on CUDA (include/snack/attention.h): q, k, v [BH, L, D]
// contiguous, one pattern shared by every batch and head.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "cuda_context.h"
#include "op_args.h"
#include "snack/attention.h"

namespace snack::binding {
namespace {

struct AttentionArgs {
  PatternArg p;
  int64_t bh = 0, head_dim = 0;
};

// q [BH, Lq, D], k and v [BH, Lk, D]: contiguous, one 16- or 32-bit floating dtype, on the pattern's
// CUDA device, Lq x Lk the pattern's shape, D a head dimension of the fused kernels.
AttentionArgs attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList pattern,
                             const char* op, PatternNeeds needs) {
  AttentionArgs a{pattern_arg(pattern, op, needs)};
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->is_contiguous(), op, ": ", name, " must be a contiguous [BH, L, D] tensor, got ",
                      t->sizes());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, ": ", name,
                      " must start at a 16-byte boundary (the kernels read rows as 16-byte vectors)");
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), op, ": q, k and v must share one dtype");
    check_same_device(*t, a.p.device, name, op);
  }
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                   op, ": the fused kernels run float32, bfloat16 and float16, got ", q.scalar_type());
  a.bh = q.size(0);
  a.head_dim = q.size(2);
  TORCH_CHECK_VALUE(k.size(0) == a.bh && v.size(0) == a.bh && k.size(2) == a.head_dim && v.size(2) == a.head_dim &&
                        q.size(1) == a.p.rows && k.size(1) == a.p.cols && v.size(1) == a.p.cols,
                    op, ": shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not fit a ", a.p.rows, " x ",
                    a.p.cols, " pattern");
  TORCH_CHECK_VALUE(cuda::sparse_attention_supports(a.head_dim), op, ": head_dim 32, 64 or 128, got ", a.head_dim);
  return a;
}

template <typename Fn>
void dispatch_attention_type(const at::Tensor& q, Fn&& fn) {
  switch (q.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(bfloat16{}); break;
    default: fn(float16{}); break;
  }
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        at::TensorList pattern, double scale, bool causal, bool bands) {
  const char* op = "sparse_attention_fwd";
  const AttentionArgs a = attention_args(q, k, v, pattern, op, PatternNeeds::kForward);
  const c10::cuda::CUDAGuard guard(a.p.device);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({a.bh, a.p.rows}, q.options().dtype(at::kFloat));
  const cuda::AttentionBands use = bands ? cuda::AttentionBands::kAuto : cuda::AttentionBands::kOff;
  dispatch_attention_type(q, [&](auto tag) {
    using T = decltype(tag);
    // The bands' scratch lives for the call (the caching allocator hands it back at once).
    const int64_t bytes = cuda::sparse_attention_forward_workspace_bytes<T>(a.p.rows, a.bh, a.head_dim, use);
    const at::Tensor workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    throw_if_error(with_pattern(a.p,
                                [&](auto w) {
                                  return cuda::sparse_attention_forward(
                                      w, data_as<T>(q), data_as<T>(k), data_as<T>(v), a.bh, a.head_dim, float(scale),
                                      causal, data_as<T>(out), lse.data_ptr<float>(),
                                      bytes > 0 ? workspace.data_ptr() : nullptr, use, current_stream());
                                }),
                   op);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attention_bwd(const at::Tensor& q, const at::Tensor& k,
                                                                    const at::Tensor& v, const at::Tensor& lse,
                                                                    const at::Tensor& dout, at::TensorList pattern,
                                                                    double scale, bool causal, bool bands) {
  const char* op = "sparse_attention_bwd";
  const AttentionArgs a = attention_args(q, k, v, pattern, op, PatternNeeds::kAll);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && dout.is_contiguous() && dout.scalar_type() == q.scalar_type() &&
                        reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 == 0,
                    op, ": dout must be contiguous, start at a 16-byte boundary and be shaped and typed like q");
  TORCH_CHECK_VALUE(lse.dim() == 2 && lse.size(0) == a.bh && lse.size(1) == a.p.rows &&
                        lse.scalar_type() == at::kFloat && lse.is_contiguous(),
                    op, ": lse must be the forward's float32 [BH, Lq]");
  check_same_device(dout, a.p.device, "dout", op);
  check_same_device(lse, a.p.device, "lse", op);
  const c10::cuda::CUDAGuard guard(a.p.device);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor row_dot = at::empty({a.bh, a.p.rows}, q.options().dtype(at::kFloat));
  const cuda::AttentionBands use = bands ? cuda::AttentionBands::kAuto : cuda::AttentionBands::kOff;
  dispatch_attention_type(q, [&](auto tag) {
    using T = decltype(tag);
    const int64_t bytes =
        cuda::sparse_attention_backward_workspace_bytes<T>(a.p.rows, a.p.cols, a.p.nnz, a.bh, a.head_dim, use);
    const at::Tensor workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    throw_if_error(with_pattern(a.p,
                                [&](auto w) {
                                  return cuda::sparse_attention_backward(
                                      w, data_as<T>(q), data_as<T>(k), data_as<T>(v), lse.data_ptr<float>(),
                                      data_as<T>(dout), a.bh, a.head_dim, float(scale), causal,
                                      row_dot.data_ptr<float>(), data_as<T>(dq), data_as<T>(dk), data_as<T>(dv),
                                      bytes > 0 ? workspace.data_ptr() : nullptr, use, current_stream());
                                }),
                   op);
  });
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> sparse_attention_bands(at::TensorList pattern, bool causal) {
  const char* op = "sparse_attention_bands";
  const PatternArg p = pattern_arg(pattern, op, PatternNeeds::kForward);
  TORCH_CHECK_VALUE(p.device.is_cuda(), op, ": the pattern must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(p.device);
  const auto options = at::TensorOptions().device(p.device).dtype(at::kInt);
  at::Tensor rows = at::empty({p.rows, 4}, options);
  at::Tensor key_ranges =
      at::empty({(p.rows + cuda::kAttentionBandRows - 1) / cuda::kAttentionBandRows, 2}, options);
  throw_if_error(with_pattern(p,
                              [&](auto w) {
                                return cuda::sparse_attention_band_rows(w, causal, rows.data_ptr<int32_t>(),
                                                                        key_ranges.data_ptr<int32_t>(),
                                                                        current_stream());
                              }),
                 op);
  return {rows, key_ranges};
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CUDA, m) {
  m.impl("sparse_attention_fwd", &snack::binding::sparse_attention_fwd);
  m.impl("sparse_attention_bwd", &snack::binding::sparse_attention_bwd);
  m.impl("sparse_attention_bands", &snack::binding::sparse_attention_bands);
}
