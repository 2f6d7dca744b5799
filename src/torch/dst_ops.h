// The dynamic-sparse-training operators' shared parts: their checked inputs and the ATen
// implementations that run on the CPU (dst_ops.cpp) and, where the device's bitmap kernels do not
// apply (a bitmap too large for the pattern, other dtypes), on CUDA (dst_ops_cuda.cpp). Both give
// the same results, except sample_absent's random stream. None synchronises with the host, except
// replace_slots(validate=True)'s checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace snack::binding {

// prune_slots: `score` 1-D, k in [0, nnz].
void check_prune(const at::Tensor& score, int64_t k, const char* op);
at::Tensor prune_slots_aten(const at::Tensor& score, int64_t k);

// sample_absent: what both implementations draw from.
struct SampleInputs {
  int64_t total = 0, nnz = 0, absent = 0;
  bool dense_regime = false;  // draw priorities over every absent position rather than candidate draws
  int64_t draws = 0;          // candidate draws of the sparse regime
  at::Device device = at::kCPU;
  at::TensorOptions draw_options;  // int64 where the generator lives
};
SampleInputs sample_inputs(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features,
                           int64_t in_features, int64_t k, const std::optional<at::Generator>& generator,
                           const char* op);
// A multiplier coprime with `total` (so x -> a x + b mod total permutes the positions).
int64_t scramble_multiplier(int64_t total);
at::Tensor sample_absent_aten(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features, int64_t k,
                              std::optional<at::Generator> generator, const SampleInputs& in);

// topk_absent_gradient: dy [N, M], x [N, K]; block_rows resolved (0 -> about 2^23 scores).
struct TopkInputs {
  int64_t m = 0, kin = 0, nnz = 0, rows_per_block = 0;
  at::ScalarType score_type = at::kFloat;
};
TopkInputs topk_inputs(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                       int64_t k, int64_t block_rows, const char* op);
at::Tensor topk_absent_gradient_aten(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                     const at::Tensor& col_idx, int64_t k, const TopkInputs& in);

// replace_slots: drop and grow as int64 on the pattern's device, range-checked when validating.
struct ReplaceInputs {
  at::Tensor drop, grow;
  int64_t nnz = 0, k = 0, total = 0;
};
ReplaceInputs replace_inputs(const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& drop,
                             const at::Tensor& grow, int64_t out_features, int64_t in_features, bool validate,
                             const char* op);
// The kept slots and the grown positions as ascending keys; with validate, repeated drops, repeated
// grows and grows onto kept positions are refused.
struct KeptSlots {
  at::Tensor kept_src, kept_keys, grow_sorted;
  at::ScalarType key_type = at::kLong;
};
KeptSlots kept_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features,
                     const ReplaceInputs& in, bool validate, const char* op);
// The new slots: the two ascending, disjoint key lists merged.
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_slots(const KeptSlots& kept, const ReplaceInputs& in,
                                                           int64_t in_features, at::ScalarType index_type,
                                                           const at::TensorOptions& long_options);

// remap_slots_: source int64 and fill (a scalar or one per slot) on target's device.
at::Tensor check_remap(const at::Tensor& target, const at::Tensor& source, const at::Tensor& fill, const char* op);
void remap_slots_aten(at::Tensor& target, const at::Tensor& source, const at::Tensor& fill);

}  // namespace snack::binding
