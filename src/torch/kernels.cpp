// CPU and CUDA implementations of snack's operators: argument checks, then the core functions.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <vector>
#include <string>

#include "binding_utils.h"
#include "device_context.h"
#include "snack/ops.h"
#include "snack/topology.h"

#ifdef SNACK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace snack::binding {

#ifdef SNACK_WITH_CUDA
Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

namespace {
// Scratch memory of the core's CUDA topology functions, from PyTorch's caching allocator.
class TorchCudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream stream) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
  }
  void deallocate(void* ptr, Stream) override { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
};
}  // namespace

DeviceAllocator& torch_allocator() {
  static TorchCudaAllocator allocator;
  return allocator;
}
#else
// A CPU-only build: the CUDA branches below still compile, and on_device never takes them.
DeviceAllocator& torch_allocator() {
  struct NoDevice final : DeviceAllocator {
    void* allocate(size_t, Stream) override { return nullptr; }
    void deallocate(void*, Stream) override {}
  };
  static NoDevice allocator;
  return allocator;
}
#endif

namespace {
#ifdef SNACK_WITH_CUDA
namespace gpu = ::snack::cuda;
#else
namespace gpu {
inline Status unsupported() { return Status(StatusCode::kUnsupported, "snack was built without CUDA"); }
template <typename... Args>
Status spmm_forward(Args&&...) { return unsupported(); }
template <typename... Args>
Status spmm_transposed(Args&&...) { return unsupported(); }
template <typename... Args>
Status sddmm(Args&&...) { return unsupported(); }
template <typename... Args>
Status bias_grad(Args&&...) { return unsupported(); }
template <typename... Args>
Status sddmm_adamw(Args&&...) { return unsupported(); }
template <typename... Args>
Status bias_grad_adamw(Args&&...) { return unsupported(); }
template <typename Index, typename... Args>
Status slots_from_coo(Args&&...) { return unsupported(); }
template <typename Index, typename... Args>
Status slots_from_positions(Args&&...) { return unsupported(); }
template <typename Index, typename... Args>
Status build_views(Args&&...) { return unsupported(); }
template <typename T, typename... Args>
Status dense_topk_positions(Args&&...) { return unsupported(); }
inline size_t sddmm_workspace_bytes(int64_t, int64_t, int64_t, size_t, SddmmVariant, bool) { return 0; }
inline bool plan_transposes_whole_input(const SpmmPlan&, int64_t) { return false; }
inline SpmmPlan plan_spmm(int64_t, int64_t, int64_t, int64_t, size_t, SpmmVariant, bool) { return SpmmPlan(); }
inline std::string describe(const SpmmPlan&) { return "built without CUDA"; }
}  // namespace gpu
#endif

// Runs fn(begin, end) over [0, count) in chunks on PyTorch's intra-op threads (CPU backend);
// every chunk writes a disjoint part of the output, so the result does not depend on the split.
template <typename Fn>
Status parallel_chunks(int64_t count, int64_t grain, Fn&& fn) {
  if (count <= grain) return fn(int64_t{0}, count);
  std::vector<Status> statuses(size_t(at::get_num_threads()) + 1);
  std::atomic<int> failed{-1};
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    Status st = fn(begin, end);
    if (!st.ok()) {
      int expected = -1;
      const int slot = at::get_thread_num();
      statuses[size_t(slot)] = std::move(st);
      failed.compare_exchange_strong(expected, slot);
    }
  });
  return failed.load() >= 0 ? statuses[size_t(failed.load())] : Status::Ok();
}

// Runs `cpu_fn()` or `cuda_fn(stream)` for the device of `t`, with that device current.
template <typename CpuFn, typename CudaFn>
Status on_device(const at::Tensor& t, CpuFn&& cpu_fn, [[maybe_unused]] CudaFn&& cuda_fn, const char* op) {
  if (t.is_cpu()) return cpu_fn();
#ifdef SNACK_WITH_CUDA
  if (t.is_cuda()) {
    c10::cuda::CUDAGuard guard(t.device());
    return cuda_fn(current_stream());
  }
#endif
  TORCH_CHECK_NOT_IMPLEMENTED(false, "snack.", op, ": no implementation for device ", t.device());
}

std::atomic<int> g_default_variant{static_cast<int>(SpmmVariant::kAuto)};

SpmmVariant resolve_variant(const std::string& name, bool transposed, const char* op) {
  SpmmVariant v = SpmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_spmm_variant(name, &v), "snack.", op, ": unknown variant '", name,
                    "' (expected auto, warp_row, smem_x, global_xt, global_x, wide_rows or coo_atomic)");
  if (v == SpmmVariant::kAuto) v = static_cast<SpmmVariant>(g_default_variant.load());
  // The process default may name a forward-only kernel; the transposed product then plans itself.
  if (transposed && spmm_variant_is_forward_only(v)) {
    TORCH_CHECK_VALUE(name == "auto", "snack.", op, ": ", spmm_variant_name(v), " runs only the forward product");
    v = SpmmVariant::kAuto;
  }
  return v;
}

void set_default_spmm_variant(const std::string& name) {
  SpmmVariant v = SpmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_spmm_variant(name, &v), "snack.set_default_spmm_variant: unknown variant '", name, "'");
  g_default_variant.store(static_cast<int>(v));
}

// Plans a CUDA product and allocates its workspace from PyTorch's caching allocator.
struct PlannedProduct {
  SpmmPlan plan;
  at::Tensor workspace;
  void* workspace_ptr() const { return workspace.defined() ? workspace.data_ptr() : nullptr; }
};

// keep_transposed_input: where the plan transposes the whole batch, the workspace is allocated as
// that copy, [in_dim + 1, batch tile] in the values' dtype (see cuda::TransposedInput), so that
// the caller can keep it.
PlannedProduct plan_product(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, const at::Tensor& values,
                            SpmmVariant variant, bool transposed, bool keep_transposed_input = false) {
  PlannedProduct p;
  const c10::DeviceGuard guard(values.device());
  p.plan = gpu::plan_spmm(out_dim, in_dim, nnz, n, values.element_size(), variant, transposed);
  if (keep_transposed_input && gpu::plan_transposes_whole_input(p.plan, n)) {
    p.workspace = at::empty({in_dim + 1, p.plan.batch_tile}, values.options());
    TORCH_INTERNAL_ASSERT(size_t(p.workspace.nbytes()) == p.plan.workspace_bytes);
  } else if (p.plan.workspace_bytes > 0) {
    p.workspace = at::empty({int64_t(p.plan.workspace_bytes)}, values.options().dtype(at::kByte));
  }
  return p;
}

std::string explain_spmm(const at::Tensor& values, const at::Tensor& row_ptr, const at::Tensor& col_ptr, int64_t n,
                         bool transposed, const std::string& variant) {
  const char* op = "explain_spmm";
  const SpmmVariant v = resolve_variant(variant, transposed, op);
  const int64_t rows = row_ptr.size(0) - 1, cols = col_ptr.size(0) - 1;
  if (!values.is_cuda()) return "cpu: reference loops (one output at a time, fixed order)";
  const c10::DeviceGuard guard(values.device());
  const int64_t out_dim = transposed ? cols : rows, in_dim = transposed ? rows : cols;
  return gpu::describe(gpu::plan_spmm(out_dim, in_dim, values.size(0), n, values.element_size(), v, transposed));
}

// float or double (the dense inputs of slots_from_dense, converted to one of them).
template <typename Fn>
void dispatch_float_or_double(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kDouble) fn(double{});
  else fn(float{});
}

}  // namespace

at::Tensor spmm_keeping_transposed_input(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx,
                                         const at::Tensor& col_idx, const at::Tensor& row_ptr,
                                         const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                                         const std::optional<at::Tensor>& bias, c10::string_view activation_name,
                                         c10::string_view variant_name, at::Tensor* x_t) {
  if (x_t) *x_t = at::Tensor();
  const SpmmVariant variant = resolve_variant(std::string(variant_name), false, "spmm");
  const Activation act = activation_arg(activation_name, "spmm");
  const PatternTensors p{row_idx, col_idx, row_ptr, col_ptr, csc_perm};
  check_pattern(p, values, "spmm");
  check_dense(x, values, p.cols(), "x", "spmm");
  if (bias) {
    check_1d(*bias, "bias", "spmm");
    TORCH_CHECK_VALUE(bias->size(0) == p.rows(), "snack.spmm: bias has ", bias->size(0), " elements, expected ",
                      p.rows());
    TORCH_CHECK_TYPE(bias->scalar_type() == values.scalar_type(), "snack.spmm: bias dtype ", bias->scalar_type(),
                     " differs from the weight dtype ", values.scalar_type());
    check_same_device(*bias, values, "bias", "spmm");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), p.rows()}, values.options());
  dispatch_value_type(values, "spmm", [&](auto tag) {
    using T = decltype(tag);
    const T* b = bias ? data_as<T>(*bias) : nullptr;
    throw_if_error(with_pattern(p, [&](auto w) {
                     return on_device(
                         values,
                         [&] {
                           return parallel_chunks(xc.size(0), 1, [&](int64_t n0, int64_t n1) {
                             return cpu::spmm_forward(w, data_as<T>(values), data_as<T>(xc) + n0 * w.cols, n1 - n0, b,
                                                      data_as<T>(y) + n0 * w.rows, act);
                           });
                         },
                         [&](Stream s) {
                           const PlannedProduct p =
                               plan_product(w.rows, w.cols, w.nnz, xc.size(0), values, variant, false, x_t != nullptr);
                           if (x_t && gpu::plan_transposes_whole_input(p.plan, xc.size(0))) *x_t = p.workspace;
                           return gpu::spmm_forward(w, data_as<T>(values), data_as<T>(xc), xc.size(0), b, data_as<T>(y), p.plan, p.workspace_ptr(), s, act);
                         },
                         "spmm");
                   }),
                   "spmm");
  });
  return y;
}

namespace {

at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& row_idx, const at::Tensor& col_idx,
                const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                const std::optional<at::Tensor>& bias, c10::string_view activation_name,
                c10::string_view variant_name) {
  return spmm_keeping_transposed_input(x, values, row_idx, col_idx, row_ptr, col_ptr, csc_perm, bias, activation_name,
                                       variant_name, nullptr);
}

at::Tensor spmm_t(const at::Tensor& dy, const at::Tensor& values, const at::Tensor& row_idx, const at::Tensor& col_idx,
                  const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                  c10::string_view variant_name) {
  const SpmmVariant variant = resolve_variant(std::string(variant_name), true, "spmm_t");
  const PatternTensors p{row_idx, col_idx, row_ptr, col_ptr, csc_perm};
  check_pattern(p, values, "spmm_t");
  check_dense(dy, values, p.rows(), "dy", "spmm_t");
  const at::Tensor dyc = dy.contiguous();
  at::Tensor dx = at::empty({dy.size(0), p.cols()}, values.options());
  dispatch_value_type(values, "spmm_t", [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(with_pattern(p, [&](auto w) {
                     return on_device(
                         values,
                         [&] {
                           return parallel_chunks(dyc.size(0), 1, [&](int64_t n0, int64_t n1) {
                             return cpu::spmm_transposed(w, data_as<T>(values), data_as<T>(dyc) + n0 * w.rows, n1 - n0,
                                                         data_as<T>(dx) + n0 * w.cols);
                           });
                         },
                         [&](Stream s) {
                           const PlannedProduct p = plan_product(w.cols, w.rows, w.nnz, dyc.size(0), values, variant, true);
                           return gpu::spmm_transposed(w, data_as<T>(values), data_as<T>(dyc), dyc.size(0), data_as<T>(dx), p.plan, p.workspace_ptr(), s);
                         },
                         "spmm_t");
                   }),
                   "spmm_t");
  });
  return dx;
}

// The SDDMM kernel a schema string names.
SddmmVariant sddmm_variant_arg(c10::string_view name, const char* op) {
  SddmmVariant variant = SddmmVariant::kAuto;
  TORCH_CHECK_VALUE(parse_sddmm_variant(std::string(name), &variant), "snack.", op, ": unknown variant '", name,
                    "' (expected auto, slot, vector or rows)");
  return variant;
}

// dy [N, M] and x [N, K] of an SDDMM over pattern p, of `like`'s dtype and device.
void check_sddmm_operands(const at::Tensor& dy, const at::Tensor& x, const PatternTensors& p, const at::Tensor& like,
                          const char* op) {
  check_dense(dy, like, p.rows(), "dy", op);
  check_dense(x, like, p.cols(), "x", op);
  TORCH_CHECK_VALUE(dy.size(0) == x.size(0), "snack.", op, ": dy has ", dy.size(0), " rows but x has ", x.size(0));
}

// The CUDA SDDMM's workspace for a batch of n rows of `like`'s dtype (undefined where none is needed).
template <typename Pattern>
at::Tensor sddmm_workspace(const Pattern& w, int64_t n, SddmmVariant variant, const at::Tensor& like,
                           bool x_transposed_given = false) {
  const size_t bytes = gpu::sddmm_workspace_bytes(w.rows, w.cols, n, like.element_size(), variant, x_transposed_given);
  return bytes ? at::empty({int64_t(bytes)}, like.options().dtype(at::kByte)) : at::Tensor();
}

at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                 const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                 c10::string_view variant_name) {
  const PatternTensors p{row_idx, col_idx, row_ptr, col_ptr, csc_perm};
  const SddmmVariant variant = sddmm_variant_arg(variant_name, "sddmm");
  check_value_dtype(dy, "sddmm");
  check_pattern(p, at::Tensor(), "sddmm");
  check_same_device(row_idx, dy, "row_idx", "sddmm");
  check_sddmm_operands(dy, x, p, dy, "sddmm");
  const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
  at::Tensor dv = at::empty({p.nnz()}, dy.options());
  dispatch_value_type(dy, "sddmm", [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(with_pattern(p, [&](auto w) {
                     return on_device(
                         dy,
                         [&] {
                           // Transpose once, then split the slots over threads: a chunk is a pattern
                           // view over a contiguous slice of the slots.
                           const at::Tensor dy_t = dyc.t().contiguous(), x_t = xc.t().contiguous();
                           return parallel_chunks(w.nnz, 4096, [&](int64_t s0, int64_t s1) {
                             auto part = w;
                             part.nnz = s1 - s0;
                             part.row_idx = w.row_idx + s0;
                             part.col_idx = w.col_idx + s0;
                             part.csc_perm = w.csc_perm + s0;
                             return cpu::sddmm_on_transposed(part, data_as<T>(dy_t), data_as<T>(x_t), xc.size(0),
                                                             data_as<T>(dv) + s0);
                           });
                         },
                         [&](Stream s) {
                           const at::Tensor ws = sddmm_workspace(w, xc.size(0), variant, dy);
                           return gpu::sddmm(w, data_as<T>(dyc), data_as<T>(xc), xc.size(0), data_as<T>(dv),
                                             ws.defined() ? ws.data_ptr() : nullptr, s, variant);
                         },
                         "sddmm");
                   }),
                   "sddmm");
  });
  return dv;
}

// The slot tensors of the optimizer: [nnz], the weight's dtype and device, distinct memory.
void check_slot_state(const at::Tensor& t, const at::Tensor& values, const char* name, const char* op) {
  check_1d(t, name, op);
  TORCH_CHECK_VALUE(t.size(0) == values.size(0), "snack.", op, ": ", name, " has ", t.size(0),
                    " elements, expected one per slot (", values.size(0), ")");
  TORCH_CHECK_TYPE(t.scalar_type() == values.scalar_type(), "snack.", op, ": ", name, " dtype ", t.scalar_type(),
                   " differs from the weight dtype ", values.scalar_type());
  check_same_device(t, values, name, op);
  TORCH_CHECK_VALUE(values.numel() == 0 || t.data_ptr() != values.data_ptr(), "snack.", op, ": ", name,
                    " shares memory with values");
}

// The optimizer's arguments of sddmm_adamw_ and bias_grad_adamw_ (params: values or bias, 1-D).
AdamWConfig check_adamw(const at::Tensor& params, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        const at::Tensor& step, double lr, double beta1, double beta2, double eps,
                        double weight_decay, bool maximize, const char* op) {
  check_slot_state(exp_avg, params, "exp_avg", op);
  check_slot_state(exp_avg_sq, params, "exp_avg_sq", op);
  TORCH_CHECK_VALUE(params.numel() == 0 || exp_avg.data_ptr() != exp_avg_sq.data_ptr(), "snack.", op,
                    ": exp_avg and exp_avg_sq share memory");
  TORCH_CHECK_TYPE(step.scalar_type() == at::kFloat, "snack.", op, ": step must be float32, got ", step.scalar_type());
  TORCH_CHECK_VALUE(step.numel() == 1, "snack.", op, ": step must hold one number, got shape ", step.sizes());
  check_same_device(step, params, "step", op);
  // torch.optim.AdamW's checks of its hyperparameters.
  TORCH_CHECK_VALUE(lr >= 0, "snack.", op, ": invalid learning rate ", lr);
  TORCH_CHECK_VALUE(eps >= 0, "snack.", op, ": invalid epsilon ", eps);
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1, "snack.", op, ": invalid beta1 ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0 && beta2 < 1, "snack.", op, ": invalid beta2 ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0, "snack.", op, ": invalid weight_decay ", weight_decay);
  return AdamWConfig{lr, beta1, beta2, eps, weight_decay, maximize};
}

// AdamW's step of the parameters from a stored gradient `grad` on the CPU (the count already
// advanced): the CPU has no fused kernels.
template <typename T>
Status adamw_on_cpu(const at::Tensor& grad, const at::Tensor& params, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& step, const AdamWConfig& config) {
  const double count = step.item<double>();
  return parallel_chunks(params.size(0), 1 << 14, [&](int64_t s0, int64_t s1) {
    return cpu::adamw_update(data_as<T>(grad) + s0, s1 - s0, count, config, data_as<T>(params) + s0,
                             data_as<T>(exp_avg) + s0, data_as<T>(exp_avg_sq) + s0);
  });
}

at::Tensor bias_grad(const at::Tensor& dy);

// sddmm_adamw_'s optional bias: none of the five arguments, or all of them, checked.
struct BiasUpdate {
  at::Tensor bias, exp_avg, exp_avg_sq, step;
  AdamWConfig config;
};

std::optional<BiasUpdate> bias_update_arg(const std::optional<at::Tensor>& bias,
                                          const std::optional<at::Tensor>& exp_avg,
                                          const std::optional<at::Tensor>& exp_avg_sq,
                                          const std::optional<at::Tensor>& step,
                                          std::optional<c10::ArrayRef<double>> hyper, const at::Tensor& values,
                                          const at::Tensor& values_step, int64_t rows, const char* op) {
  const int given = int(bias.has_value()) + int(exp_avg.has_value()) + int(exp_avg_sq.has_value()) +
                    int(step.has_value()) + int(hyper.has_value());
  if (given == 0) return std::nullopt;
  TORCH_CHECK_VALUE(given == 5, "snack.", op, ": give bias, bias_exp_avg, bias_exp_avg_sq, bias_step and bias_hyper "
                    "together");
  TORCH_CHECK_VALUE(hyper->size() == 6, "snack.", op, ": bias_hyper holds lr, beta1, beta2, eps, weight_decay and "
                    "maximize, got ", hyper->size(), " numbers");
  check_1d(*bias, "bias", op);
  TORCH_CHECK_VALUE(bias->size(0) == rows, "snack.", op, ": bias has ", bias->size(0), " elements, expected one per "
                    "output feature (", rows, ")");
  TORCH_CHECK_TYPE(bias->scalar_type() == values.scalar_type(), "snack.", op, ": bias dtype ", bias->scalar_type(),
                   " differs from the weight dtype ", values.scalar_type());
  check_same_device(*bias, values, "bias", op);
  TORCH_CHECK_VALUE(!step->is_same(values_step) && step->data_ptr() != values_step.data_ptr(), "snack.", op,
                    ": bias_step and step must be distinct tensors (each is advanced once)");
  const auto& h = *hyper;
  BiasUpdate update{*bias, *exp_avg, *exp_avg_sq, *step, {}};
  update.config = check_adamw(update.bias, update.exp_avg, update.exp_avg_sq, update.step, h[0], h[1], h[2], h[3],
                              h[4], h[5] != 0, op);
  return update;
}

}  // namespace

void sddmm_adamw_given_transposed_input(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
    const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm, const at::Tensor& values,
    const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
    double beta2, double eps, double weight_decay, bool maximize, c10::string_view variant_name,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& bias_exp_avg,
    const std::optional<at::Tensor>& bias_exp_avg_sq, const std::optional<at::Tensor>& bias_step,
    std::optional<c10::ArrayRef<double>> bias_hyper, const at::Tensor& x_t) {
  const char* op = "sddmm_adamw_";
  const PatternTensors p{row_idx, col_idx, row_ptr, col_ptr, csc_perm};
  const SddmmVariant variant = sddmm_variant_arg(variant_name, op);
  check_value_dtype(values, op);
  check_pattern(p, values, op);
  check_sddmm_operands(dy, x, p, values, op);
  const AdamWConfig config =
      check_adamw(values, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize, op);
  const std::optional<BiasUpdate> b =
      bias_update_arg(bias, bias_exp_avg, bias_exp_avg_sq, bias_step, bias_hyper, values, step, p.rows(), op);
  // The counts advance on the device (no host synchronisation), then the updates read them: in the
  // CUDA call (its first kernel advances them, no launch of their own), or here.
  const auto advance_counts = [&] {
    if (b) at::_foreach_add_(at::TensorList{step, b->step}, 1);
    else step.add_(1);
  };
  if (values.numel() == 0 && (!b || b->bias.numel() == 0)) {
    advance_counts();
    return;
  }
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
    throw_if_error(with_pattern(p, [&](auto w) {
                     return on_device(
                         values,
                         [&] {
                           advance_counts();
                           SNACK_RETURN_IF_ERROR(adamw_on_cpu<T>(sddmm(dyc, xc, row_idx, col_idx, row_ptr, col_ptr,
                                                                       csc_perm, variant_name),
                                                                 values, exp_avg, exp_avg_sq, step, config));
                           return b ? adamw_on_cpu<T>(bias_grad(dyc), b->bias, b->exp_avg, b->exp_avg_sq, b->step,
                                                      b->config)
                                    : Status::Ok();
                         },
                         [&](Stream s) {
                           const bool x_t_given = x_t.defined();
                           if (x_t_given) {  // from spmm_keeping_transposed_input: checked for what the kernel reads
                             TORCH_INTERNAL_ASSERT(x_t.device() == values.device() && x_t.dtype() == values.dtype() &&
                                                   x_t.dim() == 2 && x_t.is_contiguous() && x_t.size(0) > w.cols);
                           }
                           const at::Tensor ws = sddmm_workspace(w, xc.size(0), variant, values, x_t_given);
                           const snack::cuda::TransposedInput<T> given{x_t_given ? data_as<T>(x_t) : nullptr,
                                                                       x_t_given ? x_t.size(1) : 0};
                           gpu::AdamWParameter<T> bias_param;
                           if (b) {
                             bias_param = {data_as<T>(b->bias), data_as<T>(b->exp_avg), data_as<T>(b->exp_avg_sq),
                                           b->step.data_ptr<float>(), b->config};
                           }
                           return gpu::sddmm_adamw(w, data_as<T>(dyc), data_as<T>(xc), xc.size(0),
                                                   step.data_ptr<float>(), config, data_as<T>(values),
                                                   data_as<T>(exp_avg), data_as<T>(exp_avg_sq),
                                                   ws.defined() ? ws.data_ptr() : nullptr, s, variant,
                                                   b ? &bias_param : nullptr, given);
                         },
                         op);
                   }),
                   op);
  });
}

namespace {

void sddmm_adamw_(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                  const at::Tensor& row_ptr, const at::Tensor& col_ptr, const at::Tensor& csc_perm,
                  const at::Tensor& values, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                  const at::Tensor& step, double lr, double beta1, double beta2, double eps, double weight_decay,
                  bool maximize, c10::string_view variant_name, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& bias_exp_avg, const std::optional<at::Tensor>& bias_exp_avg_sq,
                  const std::optional<at::Tensor>& bias_step, std::optional<c10::ArrayRef<double>> bias_hyper) {
  sddmm_adamw_given_transposed_input(dy, x, row_idx, col_idx, row_ptr, col_ptr, csc_perm, values, exp_avg, exp_avg_sq,
                                     step, lr, beta1, beta2, eps, weight_decay, maximize, variant_name, bias,
                                     bias_exp_avg, bias_exp_avg_sq, bias_step, bias_hyper, at::Tensor());
}

at::Tensor bias_grad(const at::Tensor& dy) {
  check_value_dtype(dy, "bias_grad");
  TORCH_CHECK_VALUE(dy.dim() == 2, "snack.bias_grad: dy must be 2-D, got shape ", dy.sizes());
  const at::Tensor dyc = dy.contiguous();
  at::Tensor db = at::empty({dy.size(1)}, dy.options());
  dispatch_value_type(dy, "bias_grad", [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(on_device(
                       dy, [&] { return cpu::bias_grad(data_as<T>(dyc), dyc.size(0), dyc.size(1), data_as<T>(db)); },
                       [&](Stream s) { return gpu::bias_grad(data_as<T>(dyc), dyc.size(0), dyc.size(1), data_as<T>(db), s); },
                       "bias_grad"),
                   "bias_grad");
  });
  return db;
}

void bias_grad_adamw_(const at::Tensor& dy, const at::Tensor& bias, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool maximize) {
  const char* op = "bias_grad_adamw_";
  check_value_dtype(bias, op);
  check_1d(bias, "bias", op);
  check_dense(dy, bias, bias.size(0), "dy", op);
  const AdamWConfig config =
      check_adamw(bias, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, maximize, op);
  // The count advances on the device (no host synchronisation): in the CUDA call, or here.
  if (bias.numel() == 0) {
    step.add_(1);
    return;
  }
  const at::Tensor dyc = dy.contiguous();
  dispatch_value_type(bias, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(on_device(
                       bias,
                       [&] {
                         step.add_(1);
                         return adamw_on_cpu<T>(bias_grad(dyc), bias, exp_avg, exp_avg_sq, step, config);
                       },
                       [&](Stream s) {
                         return gpu::bias_grad_adamw(data_as<T>(dyc), dyc.size(0), dyc.size(1), step.data_ptr<float>(),
                                                     config, data_as<T>(bias), data_as<T>(exp_avg),
                                                     data_as<T>(exp_avg_sq), s);
                       },
                       op),
                   op);
  });
}

template <typename Fn>
void dispatch_index_type(at::ScalarType index_dtype, Fn&& fn) {
  if (index_dtype == at::kUInt16) fn(uint16_t{});
  else fn(int32_t{});
}

void check_features(int64_t out_features, int64_t in_features, const char* op) {
  TORCH_CHECK_VALUE(out_features >= 0 && in_features >= 0, "snack.", op,
                    ": out_features and in_features must be non-negative, got ", out_features, " and ", in_features);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_coo(const at::Tensor& rows, const at::Tensor& cols,
                                                              int64_t out_features, int64_t in_features,
                                                              std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_coo";
  check_features(out_features, in_features, op);
  TORCH_CHECK_VALUE(rows.dim() == 1 && cols.dim() == 1, "snack.", op, ": rows and cols must be 1-D, got shapes ",
                    rows.sizes(), " and ", cols.sizes());
  TORCH_CHECK_VALUE(rows.size(0) == cols.size(0), "snack.", op, ": rows has ", rows.size(0), " elements but cols has ",
                    cols.size(0));
  TORCH_CHECK_TYPE(!at::isFloatingType(rows.scalar_type()) && !at::isFloatingType(cols.scalar_type()) &&
                       rows.scalar_type() != at::kBool && cols.scalar_type() != at::kBool,
                   "snack.", op, ": rows and cols must be integer tensors, got ", rows.scalar_type(), " and ",
                   cols.scalar_type());
  TORCH_CHECK_VALUE(rows.device() == cols.device(), "snack.", op, ": rows is on ", rows.device(), " but cols is on ",
                    cols.device());
  const at::ScalarType itype = choose_index_dtype(out_features, in_features, index_dtype, op);
  const int64_t nnz = rows.size(0);
  const at::Tensor r64 = rows.to(at::kLong).contiguous(), c64 = cols.to(at::kLong).contiguous();
  at::Tensor row_idx = at::empty({nnz}, rows.options().dtype(itype));
  at::Tensor col_idx = at::empty({nnz}, rows.options().dtype(itype));
  at::Tensor order = at::empty({nnz}, rows.options().dtype(at::kLong));
  dispatch_index_type(itype, [&](auto tag) {
    using Index = decltype(tag);
    auto* ri = reinterpret_cast<Index*>(row_idx.data_ptr());
    auto* ci = reinterpret_cast<Index*>(col_idx.data_ptr());
    throw_if_error(
        on_device(
            rows,
            [&] { return cpu::slots_from_coo<Index>(out_features, in_features, nnz, r64.data_ptr<int64_t>(), c64.data_ptr<int64_t>(), ri, ci, order.data_ptr<int64_t>()); },
            [&](Stream s) {
              return gpu::slots_from_coo<Index>(out_features, in_features, nnz, r64.data_ptr<int64_t>(), c64.data_ptr<int64_t>(), ri, ci, order.data_ptr<int64_t>(), torch_allocator(), s);
            },
            op),
        op);
  });
  return {row_idx, col_idx, order};
}

// Slots for ascending unique linear positions (already validated by the caller).
std::pair<at::Tensor, at::Tensor> slots_from_positions(const at::Tensor& positions, int64_t out_features,
                                                       int64_t in_features, at::ScalarType itype, const char* op) {
  const int64_t nnz = positions.size(0);
  at::Tensor row_idx = at::empty({nnz}, positions.options().dtype(itype));
  at::Tensor col_idx = at::empty({nnz}, positions.options().dtype(itype));
  dispatch_index_type(itype, [&](auto tag) {
    using Index = decltype(tag);
    auto* ri = reinterpret_cast<Index*>(row_idx.data_ptr());
    auto* ci = reinterpret_cast<Index*>(col_idx.data_ptr());
    const int64_t* pos = positions.data_ptr<int64_t>();
    throw_if_error(on_device(
                       positions, [&] { return cpu::slots_from_positions<Index>(out_features, in_features, nnz, pos, ri, ci); },
                       [&](Stream s) {
                         return gpu::slots_from_positions<Index>(out_features, in_features, nnz, pos, ri, ci, s);
                       },
                       op),
                   op);
  });
  return {row_idx, col_idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_dense(const at::Tensor& dense, int64_t nnz,
                                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_dense";
  TORCH_CHECK_VALUE(dense.dim() == 2, "snack.", op, ": dense must be 2-D [out_features, in_features], got shape ",
                    dense.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(dense.scalar_type()), "snack.", op, ": dense must be floating point, got ",
                   dense.scalar_type());
  const int64_t m = dense.size(0), k = dense.size(1);
  TORCH_CHECK_VALUE(nnz >= 0 && nnz <= m * k, "snack.", op, ": nnz=", nnz, " must lie in [0, ", m * k, "]");
  const at::ScalarType itype = choose_index_dtype(m, k, index_dtype, op);
  const at::Tensor d = dense.scalar_type() == at::kDouble ? dense.contiguous() : dense.to(at::kFloat).contiguous();
  at::Tensor positions = at::empty({nnz}, dense.options().dtype(at::kLong));
  dispatch_float_or_double(d, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(on_device(
                       d, [&] { return cpu::dense_topk_positions<T>(m, k, d.data_ptr<T>(), nnz, positions.data_ptr<int64_t>()); },
                       [&](Stream s) {
                         return gpu::dense_topk_positions<T>(m, k, d.data_ptr<T>(), nnz, positions.data_ptr<int64_t>(), torch_allocator(), s);
                       },
                       op),
                   op);
  });
  auto [row_idx, col_idx] = slots_from_positions(positions, m, k, itype, op);
  return {row_idx, col_idx, positions};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_mask(const at::Tensor& mask,
                                                               std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_mask";
  TORCH_CHECK_VALUE(mask.dim() == 2, "snack.", op, ": mask must be 2-D [out_features, in_features], got shape ",
                    mask.sizes());
  const int64_t m = mask.size(0), k = mask.size(1);
  const at::ScalarType itype = choose_index_dtype(m, k, index_dtype, op);
  at::Tensor positions = at::nonzero(mask.reshape({-1})).reshape({-1});  // ascending
  TORCH_CHECK_NOT_IMPLEMENTED(positions.size(0) <= kMaxNnz, "snack.", op, ": ",
                              nnz_limit_error(positions.size(0)).message());
  auto [row_idx, col_idx] = slots_from_positions(positions, m, k, itype, op);
  return {row_idx, col_idx, positions};
}

std::tuple<at::Tensor, at::Tensor> random_slots(int64_t out_features, int64_t in_features, int64_t nnz,
                                                std::optional<at::Generator> generator,
                                                std::optional<at::Device> device,
                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "random_slots";
  check_features(out_features, in_features, op);
  const int64_t total = out_features * in_features;
  TORCH_CHECK_VALUE(nnz >= 0 && nnz <= total, "snack.", op, ": nnz=", nnz, " must lie in [0, out_features*in_features=",
                    total, "]");
  TORCH_CHECK_NOT_IMPLEMENTED(nnz <= kMaxNnz, "snack.", op, ": ", nnz_limit_error(nnz).message());
  const at::ScalarType itype = choose_index_dtype(out_features, in_features, index_dtype, op);
  const at::Device target = device.value_or(at::Device(at::kCPU));
  // Draw where the generator lives (a CPU generator also serves a CUDA layer), then move.
  const at::Device draw_device = generator ? generator->device() : target;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(draw_device);
  at::Tensor positions;
  if (2 * nnz > total) {
    // Dense enough that enumerating all positions costs no more than the pattern itself.
    positions = std::get<0>(at::sort(at::randperm(total, generator, opts).slice(0, 0, nnz)));
  } else {
    // Sample with replacement, deduplicate, repeat until enough; then keep a uniformly random
    // subset of the distinct draws. Every step is symmetric in the positions, so each nnz-subset
    // is equally likely. O(nnz) memory, no dense-sized temporary.
    positions = at::empty({0}, opts);
    while (positions.size(0) < nnz) {
      const int64_t missing = nnz - positions.size(0);
      const at::Tensor draws = at::randint(0, total, {missing + missing / 8 + 16}, generator, opts);
      positions = std::get<0>(at::_unique2(at::cat({positions, draws}), /*sorted=*/true));
    }
    if (positions.size(0) > nnz) {
      const at::Tensor keep = at::randperm(positions.size(0), generator, opts).slice(0, 0, nnz);
      positions = std::get<0>(at::sort(positions.index_select(0, keep)));
    }
  }
  positions = positions.to(target);
  auto [row_idx, col_idx] = slots_from_positions(positions, out_features, in_features, itype, op);
  return {row_idx, col_idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_views(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                           int64_t out_features, int64_t in_features) {
  const char* op = "build_views";
  check_features(out_features, in_features, op);
  check_1d(row_idx, "row_idx", op);
  check_1d(col_idx, "col_idx", op);
  const auto itype = row_idx.scalar_type();
  TORCH_CHECK_TYPE((itype == at::kUInt16 || itype == at::kInt) && col_idx.scalar_type() == itype, "snack.", op,
                   ": row_idx and col_idx must both be uint16 or both int32, got ", itype, " and ",
                   col_idx.scalar_type());
  TORCH_CHECK_VALUE(row_idx.size(0) == col_idx.size(0), "snack.", op, ": row_idx has ", row_idx.size(0),
                    " elements but col_idx has ", col_idx.size(0));
  TORCH_CHECK_VALUE(row_idx.device() == col_idx.device(), "snack.", op, ": row_idx and col_idx are on different devices");
  const int64_t nnz = row_idx.size(0);
  const auto opts = row_idx.options().dtype(at::kInt);
  at::Tensor row_ptr = at::empty({out_features + 1}, opts);
  at::Tensor col_ptr = at::empty({in_features + 1}, opts);
  at::Tensor csc_perm = at::empty({nnz}, opts);
  dispatch_index_type(itype, [&](auto tag) {
    using Index = decltype(tag);
    const auto* ri = reinterpret_cast<const Index*>(row_idx.data_ptr());
    const auto* ci = reinterpret_cast<const Index*>(col_idx.data_ptr());
    int32_t* rp = row_ptr.data_ptr<int32_t>();
    int32_t* cp = col_ptr.data_ptr<int32_t>();
    int32_t* perm = csc_perm.data_ptr<int32_t>();
    throw_if_error(on_device(
                       row_idx, [&] { return cpu::build_views<Index>(out_features, in_features, nnz, ri, ci, rp, cp, perm); },
                       [&](Stream s) {
                         return gpu::build_views<Index>(out_features, in_features, nnz, ri, ci, rp, cp, perm, torch_allocator(), s);
                       },
                       op),
                   op);
  });
  return {row_ptr, col_ptr, csc_perm};
}

}  // namespace
}  // namespace snack::binding

namespace {
// The same kernels serve both backends: each op branches on its tensors' device.
void register_device_kernels(torch::Library& m) {
  using namespace snack::binding;
  m.impl("spmm", &spmm);
  m.impl("spmm_t", &spmm_t);
  m.impl("sddmm", &sddmm);
  m.impl("bias_grad", &bias_grad);
  m.impl("sddmm_adamw_", &sddmm_adamw_);
  m.impl("bias_grad_adamw_", &bias_grad_adamw_);
  m.impl("slots_from_coo", &slots_from_coo);
  m.impl("slots_from_dense", &slots_from_dense);
  m.impl("slots_from_mask", &slots_from_mask);
  m.impl("build_views", &build_views);
}
}  // namespace

TORCH_LIBRARY_IMPL(snack, CPU, m) { register_device_kernels(m); }
#ifdef SNACK_WITH_CUDA
TORCH_LIBRARY_IMPL(snack, CUDA, m) { register_device_kernels(m); }
#endif

// No tensor inputs, or only metadata of them: these run wherever they are called.
TORCH_LIBRARY_IMPL(snack, CompositeImplicitAutograd, m) {
  m.impl("random_slots", &snack::binding::random_slots);
  m.impl("set_default_spmm_variant", &snack::binding::set_default_spmm_variant);
  m.impl("explain_spmm", &snack::binding::explain_spmm);
}
