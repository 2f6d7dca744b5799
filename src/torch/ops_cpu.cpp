// The CPU implementations of snack's operators: the core's reference loops (src/cpu/), split
// over PyTorch's intra-op threads where every chunk writes a disjoint part of the output, so the
// result does not depend on the split.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <vector>

#include "ops_common.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"
#include "snack/topology.h"

namespace snack::binding {
namespace {

// Runs fn(begin, end) over [0, count) in chunks on PyTorch's intra-op threads; the first failing
// chunk's status is returned.
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

// The CPU loops read every index of the pattern, so its contents are checked (cpu::check_pattern,
// O(M + K + nnz)): a corrupted or hand-assembled pattern is an error, not a read out of bounds. A
// check costs as much as a product of one row, so each pattern is checked once: the lists that
// passed are remembered by their tensors' storages (held weakly, so that a freed storage's address
// cannot come back as another's), offsets, lengths and version counters (which every in-place write
// through torch advances). A list edited behind torch's back (shared NumPy memory) is not rechecked.
// Inference tensors (made under torch.inference_mode) have no version counter: a list holding one is
// checked at every call.
class CheckedPatterns {
 public:
  void check(const PatternArg& p, const char* op) {
    const auto fields = fields_of(p);
    const bool keyed = std::none_of(fields.begin(), fields.end(), [](const at::Tensor* t) { return t->is_inference(); });
    Key key;
    if (keyed) {
      key = key_of(p);
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Key& k : checked_)
        if (same(k, key)) return;
    }
    throw_if_error(with_pattern(p, [](auto w) { return cpu::check_pattern(w); }), op);
    if (!keyed) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (checked_.size() < kRemembered) checked_.push_back(std::move(key));
    else checked_[next_++ % kRemembered] = std::move(key);  // the oldest goes
  }

 private:
  struct Field {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t offset, numel;
    uint32_t version;
  };
  using Key = std::vector<Field>;
  static constexpr size_t kRemembered = 64;

  // What the CPU loops read of a pattern list, so what a check of it covers.
  static std::array<const at::Tensor*, 5> fields_of(const PatternArg& p) {
    return {&p.row_idx, &p.col_idx, &p.row_ptr, &p.col_ptr, &p.csc_perm};
  }
  static Key key_of(const PatternArg& p) {
    Key key;
    for (const at::Tensor* t : fields_of(p))
      key.push_back({t->storage().getWeakStorageImpl(), t->storage_offset(), t->numel(),
                     t->unsafeGetTensorImpl()->version_counter().current_version()});
    return key;
  }
  static bool same(const Key& a, const Key& b) {
    for (size_t f = 0; f < a.size(); ++f) {
      if (a[f].storage.expired() || a[f].storage._unsafe_get_target() != b[f].storage._unsafe_get_target() ||
          a[f].offset != b[f].offset || a[f].numel != b[f].numel || a[f].version != b[f].version)
        return false;
    }
    return true;
  }

  std::mutex mutex_;
  std::vector<Key> checked_;  // the patterns checked last
  size_t next_ = 0;
};

void check_contents(const PatternArg& p, const char* op) {
  static CheckedPatterns checked;
  checked.check(p, op);
}

at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                const std::optional<at::Tensor>& bias, c10::string_view activation, c10::string_view variant) {
  const char* op = "spmm";
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op);
  spmm_variant_arg(variant, false, op);  // the name is checked; the CPU has one kernel
  check_contents(in.p, op);
  at::Tensor y = at::empty({in.x.size(0), in.p.rows}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return parallel_chunks(in.x.size(0), 1, [&](int64_t n0, int64_t n1) {
                                    return cpu::spmm_forward(w, data_as<T>(values), data_as<T>(in.x) + n0 * w.cols,
                                                             n1 - n0, b, data_as<T>(y) + n0 * w.rows, in.act);
                                  });
                                }),
                   op);
  });
  return y;
}

at::Tensor spmm_channels_first(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                               const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const char* op = "spmm_channels_first";
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op, true);
  check_contents(in.p, op);
  const int64_t batch = in.x.size(0), pixels = in.x.size(2);
  at::Tensor y = at::empty({batch, in.p.rows, pixels}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return parallel_chunks(batch, 1, [&](int64_t b0, int64_t b1) {
                                    return cpu::spmm_channels_first(w, data_as<T>(values),
                                                                    data_as<T>(in.x) + b0 * w.cols * pixels, b1 - b0,
                                                                    pixels, b, data_as<T>(y) + b0 * w.rows * pixels,
                                                                    in.act);
                                  });
                                }),
                   op);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> spmm_for_step(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                                                 const std::optional<at::Tensor>& bias, c10::string_view activation) {
  return {spmm(x, values, pattern, bias, activation, "auto"), at::empty({0, 0}, values.options())};
}

at::Tensor spmm_t(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern, c10::string_view variant) {
  const char* op = "spmm_t";
  const SpmmTInputs in = spmm_t_inputs(dy, values, pattern, op);
  spmm_variant_arg(variant, true, op);
  check_contents(in.p, op);
  at::Tensor dx = at::empty({in.dy.size(0), in.p.cols}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return parallel_chunks(in.dy.size(0), 1, [&](int64_t n0, int64_t n1) {
                                    return cpu::spmm_transposed(w, data_as<T>(values), data_as<T>(in.dy) + n0 * w.rows,
                                                                n1 - n0, data_as<T>(dx) + n0 * w.cols);
                                  });
                                }),
                   op);
  });
  return dx;
}

// dv = sddmm(dy, x) of checked inputs: transposed once, then the slots split over threads (a chunk
// is a pattern view over a contiguous slice of the slots).
at::Tensor sddmm_of(const SddmmInputs& in, const char* op) {
  at::Tensor dv = at::empty({in.p.nnz}, in.dy.options());
  dispatch_value_type(in.dy, op, [&](auto tag) {
    using T = decltype(tag);
    const at::Tensor dy_t = in.dy.t().contiguous(), x_t = in.x.t().contiguous();
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return parallel_chunks(w.nnz, 4096, [&](int64_t s0, int64_t s1) {
                                    auto part = w;
                                    part.nnz = s1 - s0;
                                    part.row_idx = w.row_idx + s0;
                                    part.col_idx = w.col_idx + s0;
                                    part.csc_perm = w.csc_perm + s0;
                                    return cpu::sddmm_on_transposed(part, data_as<T>(dy_t), data_as<T>(x_t),
                                                                    in.x.size(0), data_as<T>(dv) + s0);
                                  });
                                }),
                   op);
  });
  return dv;
}

at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, c10::string_view variant) {
  const char* op = "sddmm";
  sddmm_variant_arg(variant, op);
  const SddmmInputs in = sddmm_inputs(dy, x, pattern, dy, op);
  check_contents(in.p, op);
  return sddmm_of(in, op);
}

at::Tensor bias_grad_of(const at::Tensor& dyc, const char* op) {
  at::Tensor db = at::empty({dyc.size(1)}, dyc.options());
  dispatch_value_type(dyc, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(cpu::bias_grad(data_as<T>(dyc), dyc.size(0), dyc.size(1), data_as<T>(db)), op);
  });
  return db;
}

at::Tensor bias_grad(const at::Tensor& dy) {
  const char* op = "bias_grad";
  return bias_grad_of(bias_grad_input(dy, op), op);
}

// AdamW's step of a parameter from a stored gradient (the count already advanced): the CPU has no
// fused kernels. A 16-bit gradient of a float32 parameter (mixed precision) is widened exactly first.
void adamw_step(const at::Tensor& stored_grad, const AdamWArg& a, const char* op) {
  const double count = a.step.item<double>();
  const at::Tensor grad = stored_grad.to(a.param.scalar_type());
  dispatch_value_type(a.param, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(parallel_chunks(a.param.size(0), 1 << 14,
                                   [&](int64_t s0, int64_t s1) {
                                     return cpu::adamw_update(data_as<T>(grad) + s0, s1 - s0, count, a.config,
                                                              data_as<T>(a.param) + s0, data_as<T>(a.exp_avg) + s0,
                                                              data_as<T>(a.exp_avg_sq) + s0);
                                   }),
                   op);
  });
}

void sddmm_adamw_(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& values,
                  at::TensorList state, at::ArrayRef<double> hyper, at::TensorList bias_state,
                  const std::optional<at::Tensor>& bias, at::ArrayRef<double> bias_hyper,
                  const std::optional<at::Tensor>& x_t, c10::string_view variant) {
  const char* op = "sddmm_adamw_";
  sddmm_variant_arg(variant, op);
  const SddmmAdamWInputs in =
      sddmm_adamw_inputs(dy, x, pattern, values, state, hyper, bias, bias_state, bias_hyper, op);
  (void)x_t;  // a GPU forward's copy: the CPU computes from x
  check_contents(in.s.p, op);
  advance_steps(in);
  if (values.numel() > 0) adamw_step(sddmm_of(in.s, op), in.values, op);
  if (in.bias && in.bias->param.numel() > 0) adamw_step(bias_grad_of(in.s.dy, op), *in.bias, op);
}

void bias_grad_adamw_(const at::Tensor& dy, const at::Tensor& bias, at::TensorList state, at::ArrayRef<double> hyper) {
  const char* op = "bias_grad_adamw_";
  const BiasAdamWInputs in = bias_grad_adamw_inputs(dy, bias, state, hyper, op);
  in.bias.step.add_(1);
  if (bias.numel() > 0) adamw_step(bias_grad_of(in.dy, op), in.bias, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_coo(const at::Tensor& rows, const at::Tensor& cols,
                                                              int64_t out_features, int64_t in_features,
                                                              std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_coo";
  const CooInputs in = coo_inputs(rows, cols, out_features, in_features, index_dtype, op);
  const int64_t nnz = in.rows.size(0);
  const CooOutputs out = empty_coo_outputs(rows, in);
  dispatch_index_type(in.index_type, [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cpu::slots_from_coo<Index>(out_features, in_features, nnz, in.rows.data_ptr<int64_t>(),
                                              in.cols.data_ptr<int64_t>(), data_as<Index>(out.row_idx),
                                              data_as<Index>(out.col_idx), out.order.data_ptr<int64_t>()),
                   op);
  });
  return {out.row_idx, out.col_idx, out.order};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_dense(const at::Tensor& dense, int64_t nnz,
                                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_dense";
  const DenseInputs in = dense_inputs(dense, nnz, index_dtype, op);
  at::Tensor positions = at::empty({nnz}, dense.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(in.dense.scalar_type(), "slots_from_dense", [&] {
    throw_if_error(cpu::dense_topk_positions<scalar_t>(in.rows, in.cols, in.dense.data_ptr<scalar_t>(), nnz,
                                                       positions.data_ptr<int64_t>()),
                   op);
  });
  auto [row_idx, col_idx] = split_positions(positions, in.cols, in.index_type);
  return {row_idx, col_idx, positions};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_views(const at::Tensor& row_idx,
                                                                                   const at::Tensor& col_idx,
                                                                                   int64_t out_features,
                                                                                   int64_t in_features,
                                                                                   bool tile_view) {
  const char* op = "build_views";
  check_slots(row_idx, col_idx, out_features, in_features, op);
  const int64_t nnz = row_idx.size(0);
  const ViewOutputs out = empty_views(row_idx, out_features, in_features, tile_view);
  dispatch_index_type(row_idx.scalar_type(), [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cpu::build_views<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                           data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                           out.col_ptr.data_ptr<int32_t>(), out.csc_perm.data_ptr<int32_t>()),
                   op);
    if (!tile_view) return;
    throw_if_error(cpu::build_tile_view<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                               data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                               out.tile_ptr.data_ptr<int32_t>(),
                                               reinterpret_cast<uint32_t*>(out.tile_entries.data_ptr<int32_t>())),
                   op);
  });
  return out.tuple();
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CPU, m) {
  using namespace snack::binding;
  m.impl("spmm", &spmm);
  m.impl("spmm_for_step", &spmm_for_step);
  m.impl("spmm_channels_first", &spmm_channels_first);
  m.impl("spmm_t", &spmm_t);
  m.impl("sddmm", &sddmm);
  m.impl("bias_grad", &bias_grad);
  m.impl("sddmm_adamw_", &sddmm_adamw_);
  m.impl("bias_grad_adamw_", &bias_grad_adamw_);
  m.impl("slots_from_coo", &slots_from_coo);
  m.impl("slots_from_dense", &slots_from_dense);
  m.impl("build_views", &build_views);
}
