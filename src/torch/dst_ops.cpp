// Dynamic sparse training on the fixed-nnz slots, in ATen operations: choose slots to prune, absent
// positions to grow (uniformly, or by |dY^T X|), rebuild the sorted slot arrays with the
// permutation that per-slot tensors (values, gradients, optimizer state) follow, and apply it. The
// CPU implementation of the operators, and the CUDA one's fallback (dst_ops_cuda.cpp).
#include "dst_ops.h"

#include <torch/library.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "op_args.h"
#include "ops_common.h"

namespace snack::binding {
namespace {

// Linear positions row * in_features + col of the slots, in `type` (kInt only where they fit).
at::Tensor slot_keys(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features,
                     at::ScalarType type = at::kLong) {
  return row_idx.to(type) * in_features + col_idx.to(type);  // .to() may alias: no in-place ops
}

// The narrowest key type that holds every position of an out x in matrix.
at::ScalarType position_type(int64_t total) {
  return total <= std::numeric_limits<int32_t>::max() ? at::kInt : at::kLong;
}

// Indices (ascending) of the first k set entries of `mask`, which has at least k of them. A fixed
// output size (nonzero_static: one stream compaction on the GPU) instead of a data-dependent shape,
// so no host synchronisation.
at::Tensor first_k_set(const at::Tensor& mask, int64_t k) {
  return at::nonzero_static(mask, k, /*fill_value=*/-1).reshape({k});
}

// `beyond` (modified) or'ed with the first `ties_allowed` entries of `tie`, in index order: how a
// k-selection keeps its ties deterministic (to the lower index) without a sort. ties_allowed is a
// device scalar, so no host synchronisation.
at::Tensor with_first_ties(at::Tensor beyond, const at::Tensor& tie, const at::Tensor& ties_allowed) {
  return beyond.logical_or_(tie.logical_and(tie.cumsum(0).le(ties_allowed)));
}

// Mask of the k largest (or smallest) entries of a 1-D `score` without NaN, ties to the lower index:
// every entry strictly beyond the k-th value, then the first ones equal to it. The k-th value comes
// from a radix select (topk), not from a full sort.
at::Tensor select_k_mask(const at::Tensor& score, int64_t k, bool largest) {
  const at::Tensor top = std::get<0>(at::topk(score, k, 0, largest, /*sorted=*/false));
  const at::Tensor kth = largest ? top.min() : top.max();
  const at::Tensor beyond = largest ? score.gt(kth) : score.lt(kth);
  return with_first_ties(beyond, score.eq(kth), beyond.sum().neg_().add_(k));
}

}  // namespace

// ---- prune_slots -----------------------------------------------------------------------------------
void check_prune(const at::Tensor& score, int64_t k, const char* op) {
  check_1d(score, "score", op);
  TORCH_CHECK_VALUE(k >= 0 && k <= score.size(0), "snack.", op, ": k=", k, " must lie in [0, nnz=", score.size(0), "]");
}

// The k slots of lowest score; ties go to the lower slot index: deterministic. NaN scores count as
// +inf (never pruned before a finite score).
at::Tensor prune_slots_aten(const at::Tensor& score, int64_t k) {
  if (k == 0) return at::empty({0}, score.options().dtype(at::kLong));
  at::Tensor clean = score;
  if (at::isFloatingType(score.scalar_type()))
    clean = at::where(score.isnan(), std::numeric_limits<double>::infinity(), score);
  return first_k_set(select_k_mask(clean, k, /*largest=*/false), k);
}

// ---- sample_absent ---------------------------------------------------------------------------------
int64_t scramble_multiplier(int64_t total) {
  // Near the golden ratio of `total`, and small enough that a x never overflows 64 bits.
  const int64_t cap = std::max<int64_t>(1, (int64_t{1} << 62) / std::max<int64_t>(1, total));
  int64_t a = std::min<int64_t>(cap, std::max<int64_t>(1, int64_t(0.6180339887498949 * double(total)))) | 1;
  while (std::gcd(a, total) != 1) a += 2;
  return a;
}

// k distinct positions drawn uniformly at random among the positions not in the pattern, without
// host synchronisation (so a whole SET update can be enqueued):
// - sparse regime (absent positions at least a quarter of the matrix and at least 8k of them):
//   draw D positions with replacement, keep each draw that is absent and the first occurrence of its
//   value, and take the first k kept ones in draw order. The kept draws form a uniformly random
//   sequence of distinct absent positions, so their first k are a uniformly random k-subset. D is
//   sized so that the expected number kept exceeds k by 8 standard deviations plus 64 (the draws
//   that repeat are paid for too): falling short is astronomically unlikely, and an asynchronous
//   device-side assertion would report it;
// - otherwise (dense regime): random keys over the absent mask of the whole matrix, the k smallest.
SampleInputs sample_inputs(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features,
                           int64_t in_features, int64_t k, const std::optional<at::Generator>& generator,
                           const char* op) {
  check_slot_pair(row_idx, col_idx, op);
  check_features(out_features, in_features, op);
  SampleInputs in;
  in.total = out_features * in_features;
  in.nnz = row_idx.size(0);
  in.absent = in.total - in.nnz;
  TORCH_CHECK_VALUE(k >= 0 && k <= in.absent, "snack.", op, ": cannot grow k=", k, " connections: only ", in.absent,
                    " positions are absent");
  in.device = row_idx.device();
  in.draw_options = at::TensorOptions().dtype(at::kLong).device(generator ? generator->device() : in.device);
  in.dense_regime = 4 * in.absent < in.total || 8 * k > in.absent;
  if (!in.dense_regime) {
    const double kept_fraction = double(in.absent) / double(in.total);
    const double wanted = (double(k) + 8.0 * std::sqrt(double(k)) + 64.0) / kept_fraction;
    in.draws = int64_t(std::ceil(wanted + 2.0 * wanted * wanted / double(in.total))) + 1024;
  }
  return in;
}

at::Tensor sample_absent_aten(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features, int64_t k,
                              std::optional<at::Generator> generator, const SampleInputs& in) {
  const auto& opts = in.draw_options;
  if (k == 0) return at::empty({0}, opts.device(in.device));
  const at::Device draw_device = opts.device();
  const auto key_type = position_type(in.total);  // 32-bit where positions fit: half the memory traffic
  const at::Tensor present = slot_keys(row_idx, col_idx, in_features, key_type).to(draw_device);  // ascending
  at::Tensor chosen;
  if (in.dense_regime) {
    at::Tensor is_absent = at::ones({in.total}, opts.dtype(at::kBool));
    if (in.nnz > 0) is_absent.index_fill_(0, present.to(at::kLong), false);
    const at::Tensor keys = at::where(is_absent, at::rand({in.total}, generator, opts.dtype(at::kFloat)), 2.0f);
    chosen = std::get<1>(at::topk(keys, k, 0, /*largest=*/false, /*sorted=*/false));
  } else {
    // The draws go through a fixed affine permutation of the positions: a pattern drawn by
    // random_slots from a generator seeded alike (the same seed for init and DST is common) would
    // otherwise be drawn again, and almost every candidate would be present.
    // 62 random bits reduced modulo total: a 32-bit draw modulo a range near 2^26 would favour
    // some positions by about total / 2^32.
    const at::Tensor draws = at::randint(0, int64_t{1} << 62, {in.draws}, generator, opts)
                                 .remainder_(in.total)
                                 .mul_(scramble_multiplier(in.total))
                                 .add_(in.total / 3)
                                 .remainder_(in.total)
                                 .to(key_type);
    auto [sorted, perm] = at::sort(draws, /*stable=*/std::optional<bool>(true), 0, false);
    at::Tensor keep_sorted = at::ones({in.draws}, opts.dtype(at::kBool));
    keep_sorted.slice(0, 1).copy_(sorted.slice(0, 1).ne(sorted.slice(0, 0, in.draws - 1)));  // first occurrences
    if (in.nnz > 0) {
      const at::Tensor at_or_after = at::searchsorted(present, sorted).clamp_max(in.nnz - 1);
      keep_sorted.logical_and_(present.index_select(0, at_or_after).ne(sorted));
    }
    const at::Tensor keep = at::empty({in.draws}, opts.dtype(at::kBool)).index_put_({perm}, keep_sorted);
    at::_assert_async(keep.sum().ge(k), "snack.sample_absent: too few absent candidates drawn");
    chosen = draws.index_select(0, first_k_set(keep, k));
  }
  return std::get<0>(at::sort(chosen)).to(at::kLong).to(in.device);
}

// ---- topk_absent_gradient --------------------------------------------------------------------------
TopkInputs topk_inputs(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx, const at::Tensor& col_idx,
                       int64_t k, int64_t block_rows, const char* op) {
  check_slot_pair(row_idx, col_idx, op);
  TORCH_CHECK_VALUE(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), "snack.", op,
                    ": dy [N, out_features] and x [N, in_features] must be 2-D with the same N");
  TORCH_CHECK_VALUE(block_rows >= 0, "snack.", op, ": block_rows must be positive (or 0 for the default)");
  TopkInputs in;
  in.m = dy.size(1);
  in.kin = x.size(1);
  in.nnz = row_idx.size(0);
  TORCH_CHECK_VALUE(k >= 0 && k <= in.m * in.kin - in.nnz, "snack.", op, ": cannot grow k=", k, " connections: only ",
                    in.m * in.kin - in.nnz, " positions are absent");
  in.rows_per_block =
      block_rows > 0 ? block_rows : std::max<int64_t>(1, (int64_t{1} << 23) / std::max<int64_t>(1, in.kin));
  in.score_type = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return in;
}

// The k absent positions of largest |(dY^T X)[r, c]|, ties to the smaller position, computed
// `rows_per_block` output rows at a time so that memory stays bounded by the block. Two passes over
// the blocks (the block products are recomputed, which is cheap next to ranking them): the first
// finds the k-th largest score with a running top-k, the second takes every score above it and the
// first ties, in position order, into the output. Scores are ranked in the gradient's precision
// (fp32 for fp32 layers); NaN scores count as 0.
at::Tensor topk_absent_gradient_aten(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                     const at::Tensor& col_idx, int64_t k, const TopkInputs& in) {
  const auto long_opts = row_idx.options().dtype(at::kLong);
  if (k == 0) return at::empty({0}, long_opts);
  const int64_t m = in.m, kin = in.kin, rows = in.rows_per_block;
  const at::Tensor dyt = dy.to(in.score_type).t(), xs = x.to(in.score_type);
  const at::Tensor present = slot_keys(row_idx, col_idx, kin);

  // |dY^T X| of rows [r0, r1) flattened, present positions set to -1 (never grown). One block
  // covering every row is computed once and reused by both passes.
  at::Tensor whole_matrix;
  auto block_scores = [&](int64_t r0, int64_t r1) {
    if (whole_matrix.defined()) return whole_matrix;
    const int64_t size = (r1 - r0) * kin;
    // A trash region past the block collects the present positions of other rows, so that marking
    // this block's present positions needs no data-dependent shape; spread over kTrash elements,
    // those writes do not all contend for one address.
    constexpr int64_t kTrash = 4096;
    at::Tensor score = at::empty({size + kTrash}, dy.options().dtype(in.score_type));
    at::Tensor body = score.slice(0, 0, size);
    at::Tensor body_2d = body.view({r1 - r0, kin});
    at::mm_out(body_2d, dyt.slice(0, r0, r1), xs);
    // NaN (from inf * 0 in x or dy) counts as 0: still a valid absent position, never above a number.
    body.abs_().nan_to_num_(0.0);
    const at::Tensor in_block = present.ge(r0 * kin).logical_and(present.lt(r1 * kin));
    score.index_fill_(0, at::where(in_block, present - r0 * kin, present.remainder(kTrash).add_(size)), -1.0);
    if (rows >= m) whole_matrix = body;
    return body;
  };

  // Pass 1: the k-th largest score (absent scores are >= 0 > -1 and there are at least k of them).
  at::Tensor best;
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    const at::Tensor score = block_scores(r0, r1);
    at::Tensor top = std::get<0>(at::topk(score, std::min(k, score.size(0)), 0, true, /*sorted=*/false));
    if (best.defined()) {
      top = at::cat({best, top});
      top = std::get<0>(at::topk(top, std::min(k, top.size(0)), 0, true, /*sorted=*/false));
    }
    best = top;
  }
  const at::Tensor kth = best.min();
  const at::Tensor ties_needed = best.gt(kth).sum().neg_().add_(k);

  // Pass 2: positions above the k-th score and the first `ties_needed` equal to it, in position order.
  const int64_t max_take = std::min(k, std::min(m, rows) * kin);
  at::Tensor out = at::empty({k + max_take}, long_opts);
  at::Tensor taken = at::zeros({1}, long_opts), ties_seen = at::zeros({}, long_opts);
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    const at::Tensor score = block_scores(r0, r1);
    const at::Tensor tie = score.eq(kth);
    const at::Tensor take = with_first_ties(score.gt(kth), tie, ties_needed - ties_seen);
    ties_seen.add_(tie.sum());
    // The block's taken positions land at out[taken, ...); the entries after them are overwritten
    // by the next block or fall past k.
    const int64_t span = std::min(k, score.size(0));
    out.index_copy_(0, at::arange(span, long_opts).add_(taken), first_k_set(take, span).add_(r0 * kin));
    taken.add_(take.sum());
  }
  // Exactly k by construction (the blocks are recomputed bit for bit); a mismatch would leave
  // filler in the output, so it is checked on the device.
  at::_assert_async(taken.eq(k).all(), "snack.topk_absent_gradient: selected count differs from k");
  return out.slice(0, 0, k);
}

// ---- replace_slots ---------------------------------------------------------------------------------
ReplaceInputs replace_inputs(const at::Tensor& row_idx, const at::Tensor& col_idx, const at::Tensor& drop,
                             const at::Tensor& grow, int64_t out_features, int64_t in_features, bool validate,
                             const char* op) {
  check_slot_pair(row_idx, col_idx, op);
  check_features(out_features, in_features, op);
  check_1d(drop, "drop", op);
  check_1d(grow, "grow", op);
  for (const auto& [t, name] : {std::pair{&drop, "drop"}, std::pair{&grow, "grow"}})
    TORCH_CHECK_TYPE(at::isIntegralType(t->scalar_type(), /*includeBool=*/false), "snack.", op, ": ", name,
                     " must hold integers (slots and positions), got ", t->scalar_type());
  ReplaceInputs in;
  in.nnz = row_idx.size(0);
  in.k = drop.size(0);
  in.total = out_features * in_features;
  TORCH_CHECK_VALUE(grow.size(0) == in.k, "snack.", op, ": drop has ", in.k, " slots but grow has ", grow.size(0),
                    " positions (nnz never changes)");
  const auto long_opts = row_idx.options().dtype(at::kLong);
  in.drop = drop.to(long_opts);
  in.grow = grow.to(long_opts);
  if (validate && in.k > 0) {
    TORCH_CHECK_INDEX(in.drop.min().item<int64_t>() >= 0 && in.drop.max().item<int64_t>() < in.nnz, "snack.", op,
                      ": drop slots must lie in [0, nnz=", in.nnz, ")");
    TORCH_CHECK_INDEX(in.grow.min().item<int64_t>() >= 0 && in.grow.max().item<int64_t>() < in.total, "snack.", op,
                      ": grow positions must lie in [0, out_features*in_features=", in.total, ")");
  }
  return in;
}

KeptSlots kept_slots(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features,
                     const ReplaceInputs& in, bool validate, const char* op) {
  const auto long_opts = row_idx.options().dtype(at::kLong);
  at::Tensor keep = at::ones({in.nnz}, long_opts.dtype(at::kBool));
  keep.index_fill_(0, in.drop, false);
  if (validate)
    TORCH_CHECK_VALUE(keep.sum().item<int64_t>() == in.nnz - in.k, "snack.", op, ": drop has repeated slots");
  // Kept slots keep their (ascending) order; first_k_set finds them without a data-dependent shape,
  // so the trusted path never synchronises with the device. 32-bit keys where positions fit: half
  // the memory traffic of the searches and copies below.
  KeptSlots kept;
  kept.key_type = position_type(in.total);
  const at::Tensor keys = slot_keys(row_idx, col_idx, in_features, kept.key_type);
  kept.kept_src = first_k_set(keep, in.nnz - in.k);
  kept.kept_keys = keys.index_select(0, kept.kept_src);  // ascending
  kept.grow_sorted = std::get<0>(at::sort(in.grow.to(kept.key_type)));
  const at::Tensor& g = kept.grow_sorted;
  if (validate && in.k > 1)
    TORCH_CHECK_VALUE(g.slice(0, 1).ne(g.slice(0, 0, in.k - 1)).all().item<bool>(), "snack.", op,
                      ": grow has repeated positions");
  if (validate && in.k > 0 && kept.kept_keys.size(0) > 0) {
    const at::Tensor idx = at::searchsorted(kept.kept_keys, g).clamp_max(kept.kept_keys.size(0) - 1);
    TORCH_CHECK_VALUE(kept.kept_keys.index_select(0, idx).ne(g).all().item<bool>(), "snack.", op,
                      ": grow names a position that stays connected");
  }
  return kept;
}

// A key's new slot is its index in its own list plus the number of keys of the other list below it.
// The zero/-1 fills only matter for an untrusted grow that names a kept position (validate=False):
// the arrays then stay in range.
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_slots(const KeptSlots& kept, const ReplaceInputs& in,
                                                           int64_t in_features, at::ScalarType index_type,
                                                           const at::TensorOptions& long_options) {
  at::Tensor new_keys = at::zeros({in.nnz}, long_options.dtype(kept.key_type));
  at::Tensor source = at::full({in.nnz}, -1, long_options);
  const int64_t kept_n = in.nnz - in.k;
  if (kept_n > 0) {
    at::Tensor slot = at::arange(kept_n, long_options);
    if (in.k > 0) slot.add_(at::searchsorted(kept.grow_sorted, kept.kept_keys));
    new_keys.index_copy_(0, slot, kept.kept_keys);
    source.index_copy_(0, slot, kept.kept_src);
  }
  if (in.k > 0) {
    at::Tensor slot = at::arange(in.k, long_options);
    if (kept_n > 0) slot.add_(at::searchsorted(kept.kept_keys, kept.grow_sorted));
    new_keys.index_copy_(0, slot, kept.grow_sorted);
  }
  return {at::div(new_keys, in_features, "floor").to(index_type), at::remainder(new_keys, in_features).to(index_type),
          source};
}

// ---- remap_slots_ ----------------------------------------------------------------------------------
at::Tensor check_remap(const at::Tensor& target, const at::Tensor& source, const at::Tensor& fill, const char* op) {
  check_1d(target, "target", op);
  check_1d(source, "source", op);
  TORCH_CHECK_VALUE(source.size(0) == target.size(0), "snack.", op, ": source has ", source.size(0), " slots, target ",
                    target.size(0));
  TORCH_CHECK_TYPE(source.scalar_type() == at::kLong, "snack.", op, ": source must be int64");
  TORCH_CHECK_VALUE(fill.numel() == 1 || (fill.dim() == 1 && fill.size(0) == target.size(0)), "snack.", op,
                    ": fill must be a scalar or hold one value per slot");
  check_same_device(source, target.device(), "source", op);
  check_same_device(fill, target.device(), "fill", op);
  return fill.to(target.scalar_type()).reshape({-1}).contiguous();
}

// target <- where(source < 0, fill, target[source]), in place.
void remap_slots_aten(at::Tensor& target, const at::Tensor& source, const at::Tensor& fill) {
  target.copy_(at::where(source.lt(0), fill.numel() > 1 ? fill : fill.reshape({}),
                         target.index_select(0, source.clamp_min(0))));
}

namespace {

at::Tensor prune_slots(const at::Tensor& score, int64_t k) {
  check_prune(score, k, "prune_slots");
  return prune_slots_aten(score, k);
}

at::Tensor sample_absent(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t out_features,
                         int64_t in_features, int64_t k, std::optional<at::Generator> generator) {
  const SampleInputs in = sample_inputs(row_idx, col_idx, out_features, in_features, k, generator, "sample_absent");
  return sample_absent_aten(row_idx, col_idx, in_features, k, generator, in);
}

at::Tensor topk_absent_gradient(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                const at::Tensor& col_idx, int64_t k, int64_t block_rows) {
  const TopkInputs in = topk_inputs(dy, x, row_idx, col_idx, k, block_rows, "topk_absent_gradient");
  return topk_absent_gradient_aten(dy, x, row_idx, col_idx, k, in);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> replace_slots(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                             const at::Tensor& drop, const at::Tensor& grow,
                                                             int64_t out_features, int64_t in_features,
                                                             bool validate) {
  const char* op = "replace_slots";
  const ReplaceInputs in = replace_inputs(row_idx, col_idx, drop, grow, out_features, in_features, validate, op);
  const KeptSlots kept = kept_slots(row_idx, col_idx, in_features, in, validate, op);
  return merge_slots(kept, in, in_features, row_idx.scalar_type(), row_idx.options().dtype(at::kLong));
}

void remap_slots_(at::Tensor& target, const at::Tensor& source, const at::Tensor& fill) {
  const at::Tensor f = check_remap(target, source, fill, "remap_slots_");
  TORCH_CHECK_INDEX(source.numel() == 0 || source.max().item<int64_t>() < target.size(0),
                    "snack.remap_slots_: source names a slot past nnz=", target.size(0));
  remap_slots_aten(target, source, f);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CPU, m) {
  m.impl("prune_slots", &snack::binding::prune_slots);
  m.impl("sample_absent", &snack::binding::sample_absent);
  m.impl("topk_absent_gradient", &snack::binding::topk_absent_gradient);
  m.impl("replace_slots", &snack::binding::replace_slots);
  m.impl("remap_slots_", &snack::binding::remap_slots_);
}
