// Dynamic sparse training primitives on the fixed-nnz slots, built from ATen operations so that
// they run wherever the layer lives (CPU or CUDA): choose slots to prune, choose absent positions to
// grow (uniformly, or by |dY^T X| in row blocks), and rebuild the sorted slot arrays with the
// permutation that per-slot tensors (values, gradients, optimizer state) must follow.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "binding_utils.h"

namespace snack::binding {
namespace {

at::Tensor slot_keys(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features) {
  return row_idx.to(at::kLong) * in_features + col_idx.to(at::kLong);
}

void check_slot_arrays(const at::Tensor& row_idx, const at::Tensor& col_idx, const char* op) {
  check_1d(row_idx, "row_idx", op);
  check_1d(col_idx, "col_idx", op);
  TORCH_CHECK_VALUE(row_idx.size(0) == col_idx.size(0), "snack.", op, ": row_idx and col_idx lengths differ");
}

// The k slots of lowest score; ties go to the lower slot index (stable sort): deterministic. NaN
// scores sort last (never pruned before a finite score). No host synchronisation.
at::Tensor prune_slots(const at::Tensor& score, int64_t k) {
  const char* op = "prune_slots";
  check_1d(score, "score", op);
  TORCH_CHECK_VALUE(k >= 0 && k <= score.size(0), "snack.", op, ": k=", k, " must lie in [0, nnz=", score.size(0), "]");
  const at::Tensor order = std::get<1>(at::sort(score, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  return std::get<0>(at::sort(order.slice(0, 0, k)));
}

// k distinct positions drawn uniformly at random among the positions not in the pattern, without
// host synchronisation (so a whole SET update can be enqueued):
// - sparse regime (absent positions at least a quarter of the matrix and at least 8k of them): draw
//   8k + 2048 candidates with replacement, keep the absent, first-occurring ones, and take k of them
//   by random keys. At least a quarter of the draws land on absent positions and few repeat, so the
//   expected number of valid candidates exceeds k by 0.75k + 384, over 15 standard deviations for
//   every k: falling short is astronomically unlikely, and an asynchronous device-side assertion
//   would report it;
// - otherwise (dense regime): random keys over the absent mask of the whole matrix, the k smallest.
// Both choose a uniformly random k-subset of the absent positions (every step is symmetric in them).
at::Tensor sample_absent(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features,
                         int64_t in_features, int64_t k, std::optional<at::Generator> generator) {
  const char* op = "sample_absent";
  check_slot_arrays(row_idx, col_idx, op);
  const int64_t total = out_features * in_features, nnz = row_idx.size(0), absent = total - nnz;
  TORCH_CHECK_VALUE(k >= 0 && k <= absent, "snack.", op, ": cannot grow k=", k, " connections: only ", absent,
                    " positions are absent");
  const at::Device device = row_idx.device();
  const at::Device draw_device = generator ? generator->device() : device;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(draw_device);
  if (k == 0) return at::empty({0}, opts.device(device));
  const at::Tensor present = slot_keys(row_idx, col_idx, in_features).to(draw_device);  // ascending
  at::Tensor chosen;
  if (4 * absent < total || 8 * k > absent) {
    at::Tensor is_absent = at::ones({total}, opts.dtype(at::kBool));
    if (nnz > 0) is_absent.index_fill_(0, present, false);
    const at::Tensor keys = at::where(is_absent, at::rand({total}, generator, opts.dtype(at::kFloat)), 2.0f);
    chosen = std::get<1>(at::topk(keys, k, 0, /*largest=*/false, /*sorted=*/false));
  } else {
    const int64_t draws_n = 8 * k + 2048;
    at::Tensor draws = std::get<0>(at::sort(at::randint(0, total, {draws_n}, generator, opts)));
    at::Tensor valid = at::ones({draws_n}, opts.dtype(at::kBool));
    valid.slice(0, 1).copy_(draws.slice(0, 1).ne(draws.slice(0, 0, draws_n - 1)));  // first occurrences
    if (nnz > 0) {
      const at::Tensor at_or_after = at::searchsorted(present, draws).clamp_max(nnz - 1);
      valid.logical_and_(present.index_select(0, at_or_after).ne(draws));
    }
    at::_assert_async(valid.sum().ge(k), "snack.sample_absent: too few absent candidates drawn");
    const at::Tensor keys = at::where(valid, at::rand({draws_n}, generator, opts.dtype(at::kFloat)), 2.0f);
    chosen = draws.index_select(0, std::get<1>(at::topk(keys, k, 0, /*largest=*/false, /*sorted=*/false)));
  }
  return std::get<0>(at::sort(chosen)).to(device);
}

// The k absent positions of largest |(dY^T X)[r, c]|, computed `block_rows` output rows at a time so
// that memory stays at block_rows x in_features. Ties go to the smaller position.
at::Tensor topk_absent_gradient(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                const at::Tensor& col_idx, int64_t k, int64_t block_rows) {
  const char* op = "topk_absent_gradient";
  check_slot_arrays(row_idx, col_idx, op);
  TORCH_CHECK_VALUE(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), "snack.", op,
                    ": dy [N, out_features] and x [N, in_features] must be 2-D with the same N");
  TORCH_CHECK_VALUE(block_rows > 0, "snack.", op, ": block_rows must be positive");
  const int64_t m = dy.size(1), kin = x.size(1), nnz = row_idx.size(0);
  TORCH_CHECK_VALUE(k >= 0 && k <= m * kin - nnz, "snack.", op, ": cannot grow k=", k, " connections: only ",
                    m * kin - nnz, " positions are absent");
  const auto long_opts = row_idx.options().dtype(at::kLong);
  if (k == 0) return at::empty({0}, long_opts);
  const at::Tensor present = slot_keys(row_idx, col_idx, kin);
  at::Tensor best_scores = at::empty({0}, dy.options().dtype(at::kDouble));
  at::Tensor best_pos = at::empty({0}, long_opts);
  const at::Tensor dyt = dy.t();
  for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
    const int64_t r1 = std::min(m, r0 + block_rows);
    const int64_t block_size = (r1 - r0) * kin;
    // One extra element past the block collects the present positions of other rows, so that
    // marking this block's present positions needs no data-dependent shape (no synchronisation).
    at::Tensor score = at::empty({block_size + 1}, dy.options().dtype(at::kDouble));
    score.slice(0, 0, block_size).copy_(at::mm(dyt.slice(0, r0, r1), x).abs().reshape({-1}));
    const at::Tensor in_block = present.ge(r0 * kin).logical_and(present.lt(r1 * kin));
    score.index_fill_(0, at::where(in_block, present - r0 * kin, block_size), -1.0);  // present: cannot grow
    score = score.slice(0, 0, block_size);
    const int64_t keep = std::min<int64_t>(k, score.size(0));
    // Stable descending sort: equal scores keep ascending positions.
    auto [vals, idx] = at::sort(score, /*stable=*/true, /*dim=*/0, /*descending=*/true);
    best_scores = at::cat({best_scores, vals.slice(0, 0, keep)});
    best_pos = at::cat({best_pos, idx.slice(0, 0, keep) + r0 * kin});
    // Merge: candidates are in ascending block order, so a stable sort keeps smaller positions first.
    auto [merged, order] = at::sort(best_scores, /*stable=*/true, /*dim=*/0, /*descending=*/true);
    best_scores = merged.slice(0, 0, k);
    best_pos = best_pos.index_select(0, order.slice(0, 0, k));
  }
  // k <= the number of absent positions (checked above), so no present position (score -1) is among them.
  return std::get<0>(at::sort(best_pos));
}

// Frees the slots `drop` and fills them with the positions `grow`; returns the new sorted slot
// arrays and, for every new slot, the old slot it came from (-1 for a grown connection).
// Validates everything first: on error nothing is returned and nothing was changed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> replace_slots(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                             const at::Tensor& drop, const at::Tensor& grow,
                                                             int64_t out_features, int64_t in_features,
                                                             bool validate) {
  const char* op = "replace_slots";
  check_slot_arrays(row_idx, col_idx, op);
  check_1d(drop, "drop", op);
  check_1d(grow, "grow", op);
  const int64_t nnz = row_idx.size(0), k = drop.size(0), total = out_features * in_features;
  TORCH_CHECK_VALUE(grow.size(0) == k, "snack.", op, ": drop has ", k, " slots but grow has ", grow.size(0),
                    " positions (nnz never changes)");
  const auto long_opts = row_idx.options().dtype(at::kLong);
  const at::Tensor d = drop.to(long_opts), g = grow.to(long_opts);
  if (validate && k > 0) {
    TORCH_CHECK_INDEX(d.min().item<int64_t>() >= 0 && d.max().item<int64_t>() < nnz, "snack.", op,
                      ": drop slots must lie in [0, nnz=", nnz, ")");
    TORCH_CHECK_INDEX(g.min().item<int64_t>() >= 0 && g.max().item<int64_t>() < total, "snack.", op,
                      ": grow positions must lie in [0, out_features*in_features=", total, ")");
  }
  at::Tensor keep = at::ones({nnz}, long_opts.dtype(at::kBool));
  keep.index_fill_(0, d, false);
  if (validate)
    TORCH_CHECK_VALUE(keep.sum().item<int64_t>() == nnz - k, "snack.", op, ": drop has repeated slots");
  // Kept slots keep their (ascending) order; a stable sort by the keep flag finds them without a
  // data-dependent shape, so the trusted path never synchronises with the device.
  const at::Tensor keys = slot_keys(row_idx, col_idx, in_features);
  const at::Tensor kept_src =
      std::get<1>(at::sort(keep.logical_not().to(at::kByte), /*stable=*/std::optional<bool>(true), 0, false))
          .slice(0, 0, nnz - k);
  const at::Tensor kept_keys = keys.index_select(0, kept_src);  // ascending
  const at::Tensor g_sorted = std::get<0>(at::sort(g));
  if (validate && k > 1)
    TORCH_CHECK_VALUE(g_sorted.slice(0, 1).ne(g_sorted.slice(0, 0, k - 1)).all().item<bool>(), "snack.", op,
                      ": grow has repeated positions");
  if (validate && k > 0 && kept_keys.size(0) > 0) {
    const at::Tensor idx = at::searchsorted(kept_keys, g_sorted).clamp_max(kept_keys.size(0) - 1);
    TORCH_CHECK_VALUE(kept_keys.index_select(0, idx).ne(g_sorted).all().item<bool>(), "snack.", op,
                      ": grow names a position that stays connected");
  }
  const at::Tensor all_keys = at::cat({kept_keys, g_sorted});
  const at::Tensor all_src = at::cat({kept_src, at::full({k}, -1, long_opts)});
  auto [new_keys, order] = at::sort(all_keys, /*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  const at::Tensor source = all_src.index_select(0, order);
  const auto itype = row_idx.scalar_type();
  return {at::div(new_keys, in_features, "floor").to(itype), at::remainder(new_keys, in_features).to(itype), source};
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CompositeImplicitAutograd, m) {
  m.impl("prune_slots", &snack::binding::prune_slots);
  m.impl("sample_absent", &snack::binding::sample_absent);
  m.impl("topk_absent_gradient", &snack::binding::topk_absent_gradient);
  m.impl("replace_slots", &snack::binding::replace_slots);
}
