// The CUDA implementations of the dynamic-sparse-training operators: the core's bitmap kernels
// (src/dst/), which need no sorts and never synchronise with the host, where their bitmap of the
// matrix's positions is affordable (cuda::bitmap_affordable); the ATen implementations of
// dst_ops.cpp otherwise.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_context.h"
#include "dst_ops.h"
#include "op_args.h"
#include "snack/dst.h"

namespace snack::binding {
namespace {

// Up to this many batch rows, RigL's scores are recomputed in registers on each pass rather than
// written out by cuBLAS and read back (16384 x 4096, N = 16: the selection 1.93 -> 0.96 ms on the H200).
constexpr int64_t kFusedRiglBatch = 256;

// Calls fn(index_tag, row_idx, col_idx) with the slot arrays as uint16 or int32 (int64 arrays, as
// the Dense+Mask reference passes them, are narrowed: the same positions take the same path).
template <typename Fn>
decltype(auto) with_device_indices(const at::Tensor& row_idx, const at::Tensor& col_idx, Fn&& fn) {
  if (row_idx.scalar_type() == at::kUInt16 && col_idx.scalar_type() == at::kUInt16)
    return fn(uint16_t{}, row_idx.contiguous(), col_idx.contiguous());
  return fn(int32_t{}, row_idx.to(at::kInt).contiguous(), col_idx.to(at::kInt).contiguous());
}

at::Tensor prune_slots(const at::Tensor& score, int64_t k) {
  const char* op = "prune_slots";
  check_prune(score, k, op);
  if (k == 0) return at::empty({0}, score.options().dtype(at::kLong));
  // 16-bit scores widen to float exactly (same order, same ties) and take the device selection.
  if (score.scalar_type() == at::kBFloat16 || score.scalar_type() == at::kHalf) {
    return prune_slots(score.to(at::kFloat), k);
  }
  if (score.scalar_type() != at::kFloat) return prune_slots_aten(score, k);
  const c10::cuda::CUDAGuard guard(score.device());
  const at::Tensor s = score.contiguous();
  at::Tensor out = at::empty({k}, s.options().dtype(at::kLong));
  throw_if_error(cuda::lowest_slots(s.data_ptr<float>(), s.numel(), k, out.data_ptr<int64_t>(), torch_cuda_allocator(),
                                    current_stream()),
                 op);
  return out;
}

at::Tensor sample_absent(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features,
                         int64_t in_features, int64_t k, std::optional<at::Generator> generator) {
  const char* op = "sample_absent";
  const SampleInputs in = sample_inputs(row_idx, col_idx, out_features, in_features, k, generator, op);
  if (k == 0 || !cuda::bitmap_affordable(out_features, in_features, in.nnz))
    return sample_absent_aten(row_idx, col_idx, in_features, k, generator, in);
  // Candidates are the distinct absent draws (every absent position in the dense regime), marked in
  // a bitmap; the k of lowest hash priority are kept (src/dst/sample.cu).
  const c10::cuda::CUDAGuard guard(in.device);
  const int64_t draws = in.dense_regime ? 0 : in.draws;
  // 62 random bits per draw (reduced modulo total on the device: a 32-bit draw modulo a range near
  // 2^26 would favour some positions by about total / 2^32); the first seeds the priorities.
  const at::Tensor random_bits =
      at::randint(0, int64_t{1} << 62, {draws + 1}, generator, in.draw_options).to(in.device);
  const auto opts = in.draw_options.device(in.device);
  at::Tensor out = at::empty({k}, opts), candidates = at::empty({1}, opts);
  with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& rows, const at::Tensor& cols) {
    using Index = decltype(tag);
    throw_if_error(cuda::sample_absent<Index>(out_features, in_features, in.nnz,
                                              static_cast<const Index*>(rows.data_ptr()),
                                              static_cast<const Index*>(cols.data_ptr()),
                                              random_bits.data_ptr<int64_t>(), draws, scramble_multiplier(in.total),
                                              in.total / 3, k, out.data_ptr<int64_t>(), candidates.data_ptr<int64_t>(),
                                              torch_cuda_allocator(), current_stream()),
                   op);
  });
  at::_assert_async(candidates.ge(k).all(), "snack.sample_absent: too few absent candidates drawn");
  return out;
}

at::Tensor topk_absent_gradient(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                const at::Tensor& col_idx, int64_t k, int64_t block_rows) {
  const char* op = "topk_absent_gradient";
  const TopkInputs in = topk_inputs(dy, x, row_idx, col_idx, k, block_rows, op);
  if (k == 0 || in.score_type != at::kFloat || !cuda::bitmap_affordable(in.m, in.kin, in.nnz))
    return topk_absent_gradient_aten(dy, x, row_idx, col_idx, k, in);
  // A bitmap of the present positions and an exact radix select (three passes, then the selection)
  // over scores that each pass recomputes (src/dst/rigl.cu) or reads back block by block.
  const c10::cuda::CUDAGuard guard(dy.device());
  const Stream stream = current_stream();
  const int64_t m = in.m, kin = in.kin, rows = in.rows_per_block;
  at::Tensor out = at::empty({k}, row_idx.options().dtype(at::kLong));
  if (dy.size(0) <= kFusedRiglBatch) {
    // Small batch: the scores are recomputed in registers by every pass, never written out.
    const at::Tensor dyc = dy.to(at::kFloat).contiguous(), xc = x.to(at::kFloat).contiguous();
    with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
      using Index = decltype(tag);
      throw_if_error(cuda::topk_absent_gradient<Index>(m, kin, in.nnz, static_cast<const Index*>(r.data_ptr()),
                                                       static_cast<const Index*>(c.data_ptr()), dyc.data_ptr<float>(),
                                                       xc.data_ptr<float>(), dyc.size(0), k, out.data_ptr<int64_t>(),
                                                       torch_cuda_allocator(), stream),
                     op);
    });
    return out;
  }
  // Large batch: cuBLAS writes each block of scores in fp32, and the passes read it back. 16-bit
  // operands of one dtype (a layer under autocast) stay 16-bit: tensor cores, fp32 accumulation,
  // and no fp32 copies of dY and X.
  const bool half_operands = dy.scalar_type() == x.scalar_type() &&
                             (dy.scalar_type() == at::kBFloat16 || dy.scalar_type() == at::kHalf);
  const at::ScalarType operand_type = half_operands ? dy.scalar_type() : at::kFloat;
  const at::Tensor dyt = dy.to(operand_type).t(), xs = x.to(operand_type);
  at::Tensor bitmap = at::empty({cuda::bitmap_words(m, kin)}, dy.options().dtype(at::kInt));
  auto* bits = reinterpret_cast<uint32_t*>(bitmap.data_ptr());
  with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
    using Index = decltype(tag);
    throw_if_error(cuda::mark_present<Index>(m, kin, in.nnz, static_cast<const Index*>(r.data_ptr()),
                                             static_cast<const Index*>(c.data_ptr()), bits, stream),
                   op);
  });
  at::Tensor block = at::empty({std::min(m, rows), kin}, dy.options().dtype(at::kFloat));
  bool whole_matrix_ready = false;  // one block covering every row is computed once, not once per pass
  auto block_scores = [&](int64_t r0, int64_t r1) {
    at::Tensor body = block.slice(0, 0, r1 - r0);
    if (!whole_matrix_ready) {
      if (half_operands) at::mm_out(body, dyt.slice(0, r0, r1), xs, at::kFloat);
      else at::mm_out(body, dyt.slice(0, r0, r1), xs);
    }
    whole_matrix_ready = rows >= m;
    return body;
  };
  cuda::TopkSelection selection(k, bits, torch_cuda_allocator(), stream);
  throw_if_error(selection.begin(), op);
  for (int pass = 0; pass < cuda::TopkSelection::kPasses; ++pass) {
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      const at::Tensor score = block_scores(r0, std::min(m, r0 + rows));
      throw_if_error(selection.histogram(pass, score.data_ptr<float>(), score.numel(), r0 * kin), op);
    }
    throw_if_error(selection.pick(pass), op);
  }
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const at::Tensor score = block_scores(r0, std::min(m, r0 + rows));
    throw_if_error(selection.emit(score.data_ptr<float>(), score.numel(), r0 * kin, out.data_ptr<int64_t>()), op);
  }
  return out;
}

// The new pattern's bitmap read back in position order (src/dst/replace.cu). drop and grow are
// trusted here (validated before, or by the caller); an untrusted grow that names a kept position
// (validate=False) leaves zeros: still in range.
std::tuple<at::Tensor, at::Tensor, at::Tensor> replace_on_device(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                                 const ReplaceInputs& in, int64_t out_features,
                                                                 int64_t in_features) {
  const c10::cuda::CUDAGuard guard(row_idx.device());
  at::Tensor source = at::empty({in.nnz}, row_idx.options().dtype(at::kLong));
  const at::Tensor d = in.drop.contiguous(), g = in.grow.contiguous();
  return with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
    using Index = decltype(tag);
    at::Tensor new_rows = at::empty({in.nnz}, r.options()), new_cols = at::empty({in.nnz}, c.options());
    throw_if_error(cuda::replace_slots<Index>(out_features, in_features, in.nnz, static_cast<const Index*>(r.data_ptr()),
                                              static_cast<const Index*>(c.data_ptr()), d.size(0),
                                              d.data_ptr<int64_t>(), g.data_ptr<int64_t>(),
                                              static_cast<Index*>(new_rows.data_ptr()),
                                              static_cast<Index*>(new_cols.data_ptr()), source.data_ptr<int64_t>(),
                                              torch_cuda_allocator(), current_stream()),
                   "replace_slots");
    return std::make_tuple(new_rows.to(row_idx.scalar_type()), new_cols.to(col_idx.scalar_type()), source);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replace_slots(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                             const at::Tensor& drop, const at::Tensor& grow,
                                                             int64_t out_features, int64_t in_features,
                                                             bool validate) {
  const char* op = "replace_slots";
  const ReplaceInputs in = replace_inputs(row_idx, col_idx, drop, grow, out_features, in_features, validate, op);
  const bool on_device = cuda::bitmap_affordable(out_features, in_features, in.nnz);
  if (on_device && !validate) return replace_on_device(row_idx, col_idx, in, out_features, in_features);
  const KeptSlots kept = kept_slots(row_idx, col_idx, in_features, in, validate, op);  // checks, with validate
  if (on_device) return replace_on_device(row_idx, col_idx, in, out_features, in_features);
  return merge_slots(kept, in, in_features, row_idx.scalar_type(), row_idx.options().dtype(at::kLong));
}

// One gather kernel for float and double (an entry >= nnz takes the fill: no host synchronisation);
// ATen for the other dtypes.
void remap_slots_(at::Tensor& target, const at::Tensor& source, const at::Tensor& fill) {
  const char* op = "remap_slots_";
  const at::Tensor f = check_remap(target, source, fill, op);
  const auto dtype = target.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) {
    remap_slots_aten(target, source, f);
    return;
  }
  const c10::cuda::CUDAGuard guard(target.device());
  at::Tensor out = at::empty_like(target);  // check_remap: source and target are contiguous
  AT_DISPATCH_FLOATING_TYPES(dtype, "remap_slots_", [&] {
    throw_if_error(cuda::gather_slots<scalar_t>(target.size(0), target.data_ptr<scalar_t>(), source.data_ptr<int64_t>(),
                                                f.data_ptr<scalar_t>(), f.numel() > 1, out.data_ptr<scalar_t>(),
                                                current_stream()),
                   op);
  });
  target.copy_(out);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CUDA, m) {
  m.impl("prune_slots", &snack::binding::prune_slots);
  m.impl("sample_absent", &snack::binding::sample_absent);
  m.impl("topk_absent_gradient", &snack::binding::topk_absent_gradient);
  m.impl("replace_slots", &snack::binding::replace_slots);
  m.impl("remap_slots_", &snack::binding::remap_slots_);
}
