// Dynamic sparse training primitives on the fixed-nnz slots: choose slots to prune, choose absent
// positions to grow (uniformly, or by |dY^T X|), rebuild the sorted slot arrays with the permutation
// that per-slot tensors (values, gradients, optimizer state) must follow, and apply it. On CUDA the
// core's bitmap kernels run (src/cuda/topology_update.cu); on the CPU, and where such a bitmap is too
// large, ATen operations do the same work (same results, except sample_absent's random stream).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "binding_utils.h"
#include "device_context.h"

#ifdef SNACK_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "snack/topology.h"
#endif

namespace snack::binding {
namespace {

#ifdef SNACK_WITH_CUDA
namespace gpu = ::snack::cuda;

// Up to this many batch rows, RigL's scores are recomputed in registers on each pass rather than
// written out by cuBLAS and read back (16384 x 4096, N = 16: the selection 1.93 -> 0.96 ms).
constexpr int64_t kFusedRiglBatch = 256;

// Calls fn(index_tag, row_idx, col_idx) with the slot arrays as uint16 or int32 (int64 arrays, as
// the Dense+Mask reference passes them, are narrowed: the same positions take the same path).
template <typename Fn>
decltype(auto) with_device_indices(const at::Tensor& row_idx, const at::Tensor& col_idx, Fn&& fn) {
  if (row_idx.scalar_type() == at::kUInt16 && col_idx.scalar_type() == at::kUInt16)
    return fn(uint16_t{}, row_idx.contiguous(), col_idx.contiguous());
  return fn(int32_t{}, row_idx.to(at::kInt).contiguous(), col_idx.to(at::kInt).contiguous());
}
#endif

// Linear positions row * in_features + col of the slots, in `type` (kInt only where they fit).
at::Tensor slot_keys(const at::Tensor& row_idx, const at::Tensor& col_idx, int64_t in_features,
                     at::ScalarType type = at::kLong) {
  return row_idx.to(type) * in_features + col_idx.to(type);  // .to() may alias: no in-place ops
}

// The narrowest key type that holds every position of an out x in matrix.
at::ScalarType position_type(int64_t total) {
  return total <= std::numeric_limits<int32_t>::max() ? at::kInt : at::kLong;
}

void check_slot_arrays(const at::Tensor& row_idx, const at::Tensor& col_idx, const char* op) {
  check_1d(row_idx, "row_idx", op);
  check_1d(col_idx, "col_idx", op);
  TORCH_CHECK_VALUE(row_idx.size(0) == col_idx.size(0), "snack.", op, ": row_idx and col_idx lengths differ");
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

// The k slots of lowest score; ties go to the lower slot index: deterministic. NaN scores count as
// +inf (never pruned before a finite score). No host synchronisation.
at::Tensor prune_slots(const at::Tensor& score, int64_t k) {
  const char* op = "prune_slots";
  check_1d(score, "score", op);
  TORCH_CHECK_VALUE(k >= 0 && k <= score.size(0), "snack.", op, ": k=", k, " must lie in [0, nnz=", score.size(0), "]");
  if (k == 0) return at::empty({0}, score.options().dtype(at::kLong));
#ifdef SNACK_WITH_CUDA
  // 16-bit scores widen to float exactly (same order, same ties) and take the device selection.
  if (score.is_cuda() && (score.scalar_type() == at::kBFloat16 || score.scalar_type() == at::kHalf))
    return prune_slots(score.to(at::kFloat), k);
  if (score.is_cuda() && score.scalar_type() == at::kFloat) {
    const c10::cuda::CUDAGuard guard(score.device());
    const at::Tensor s = score.contiguous();
    at::Tensor out = at::empty({k}, s.options().dtype(at::kLong));
    throw_if_error(gpu::lowest_slots(s.data_ptr<float>(), s.numel(), k, out.data_ptr<int64_t>(), torch_allocator(),
                                     current_stream()),
                   op);
    return out;
  }
#endif
  at::Tensor clean = score;
  if (at::isFloatingType(score.scalar_type()))
    clean = at::where(score.isnan(), std::numeric_limits<double>::infinity(), score);
  return first_k_set(select_k_mask(clean, k, /*largest=*/false), k);
}

// A multiplier coprime with `total` (so x -> a x + b mod total permutes the positions), near the
// golden ratio of `total` and small enough that a x never overflows 64 bits.
int64_t scramble_multiplier(int64_t total) {
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
  const bool dense_regime = 4 * absent < total || 8 * k > absent;
  // Draws that keep, with overwhelming probability, at least k distinct absent positions: the
  // expected number kept exceeds k by 8 standard deviations plus 64, and the repeats are paid for.
  auto draw_count = [&] {
    const double kept_fraction = double(absent) / double(total);
    const double wanted = (double(k) + 8.0 * std::sqrt(double(k)) + 64.0) / kept_fraction;
    return int64_t(std::ceil(wanted + 2.0 * wanted * wanted / double(total))) + 1024;
  };
#ifdef SNACK_WITH_CUDA
  if (device.is_cuda() && gpu::bitmap_affordable(out_features, in_features, nnz)) {
    // Device path: candidates are the distinct absent draws (every absent position in the dense
    // regime), marked in a bitmap; the k of lowest hash priority are kept (src/cuda/topology_update.cu).
    const c10::cuda::CUDAGuard guard(device);
    const int64_t draws = dense_regime ? 0 : draw_count();
    // 62 random bits per draw (reduced modulo total on the device: a 32-bit draw modulo a range
    // near 2^26 would favour some positions by about total / 2^32); the first seeds the priorities.
    const at::Tensor random_bits = at::randint(0, int64_t{1} << 62, {draws + 1}, generator, opts).to(device);
    at::Tensor out = at::empty({k}, opts.device(device));
    at::Tensor candidates = at::empty({1}, opts.device(device));
    with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& rows, const at::Tensor& cols) {
      using Index = decltype(tag);
      throw_if_error(gpu::sample_absent<Index>(out_features, in_features, nnz, static_cast<const Index*>(rows.data_ptr()),
                                               static_cast<const Index*>(cols.data_ptr()), random_bits.data_ptr<int64_t>(), draws,
                                               scramble_multiplier(total), total / 3, k, out.data_ptr<int64_t>(),
                                               candidates.data_ptr<int64_t>(), torch_allocator(), current_stream()),
                     op);
    });
    at::_assert_async(candidates.ge(k).all(), "snack.sample_absent: too few absent candidates drawn");
    return out;
  }
#endif
  const auto key_type = position_type(total);  // 32-bit where positions fit: half the memory traffic
  const at::Tensor present = slot_keys(row_idx, col_idx, in_features, key_type).to(draw_device);  // ascending
  at::Tensor chosen;
  if (dense_regime) {
    at::Tensor is_absent = at::ones({total}, opts.dtype(at::kBool));
    if (nnz > 0) is_absent.index_fill_(0, present.to(at::kLong), false);
    const at::Tensor keys = at::where(is_absent, at::rand({total}, generator, opts.dtype(at::kFloat)), 2.0f);
    chosen = std::get<1>(at::topk(keys, k, 0, /*largest=*/false, /*sorted=*/false));
  } else {
    const int64_t draws_n = draw_count();
    // The draws go through a fixed affine permutation of the positions: a pattern drawn by
    // random_slots from a generator seeded alike (the same seed for init and DST is common) would
    // otherwise be drawn again, and almost every candidate would be present.
    // 62 random bits reduced modulo total: a 32-bit draw modulo a range near 2^26 would favour
    // some positions by about total / 2^32.
    const at::Tensor draws = at::randint(0, int64_t{1} << 62, {draws_n}, generator, opts)
                                 .remainder_(total)
                                 .mul_(scramble_multiplier(total))
                                 .add_(total / 3)
                                 .remainder_(total)
                                 .to(key_type);
    auto [sorted, perm] = at::sort(draws, /*stable=*/std::optional<bool>(true), 0, false);
    at::Tensor keep_sorted = at::ones({draws_n}, opts.dtype(at::kBool));
    keep_sorted.slice(0, 1).copy_(sorted.slice(0, 1).ne(sorted.slice(0, 0, draws_n - 1)));  // first occurrences
    if (nnz > 0) {
      const at::Tensor at_or_after = at::searchsorted(present, sorted).clamp_max(nnz - 1);
      keep_sorted.logical_and_(present.index_select(0, at_or_after).ne(sorted));
    }
    const at::Tensor keep = at::empty({draws_n}, opts.dtype(at::kBool)).index_put_({perm}, keep_sorted);
    at::_assert_async(keep.sum().ge(k), "snack.sample_absent: too few absent candidates drawn");
    chosen = draws.index_select(0, first_k_set(keep, k));
  }
  return std::get<0>(at::sort(chosen)).to(at::kLong).to(device);
}

// The k absent positions of largest |(dY^T X)[r, c]|, ties to the smaller position, computed
// `block_rows` output rows at a time (0: blocks of about 2^23 scores) so that memory stays bounded
// by the block. Two passes over the blocks (the block products are recomputed, which is cheap next
// to ranking them): the first finds the k-th largest score with a running radix select, the second
// takes every score above it and the first ties, in position order, into the output. Scores are
// ranked in the gradient's precision (fp32 for fp32 layers); NaN scores count as 0. No host
// synchronisation.
at::Tensor topk_absent_gradient(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& row_idx,
                                const at::Tensor& col_idx, int64_t k, int64_t block_rows) {
  const char* op = "topk_absent_gradient";
  check_slot_arrays(row_idx, col_idx, op);
  TORCH_CHECK_VALUE(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), "snack.", op,
                    ": dy [N, out_features] and x [N, in_features] must be 2-D with the same N");
  TORCH_CHECK_VALUE(block_rows >= 0, "snack.", op, ": block_rows must be positive (or 0 for the default)");
  const int64_t m = dy.size(1), kin = x.size(1), nnz = row_idx.size(0);
  TORCH_CHECK_VALUE(k >= 0 && k <= m * kin - nnz, "snack.", op, ": cannot grow k=", k, " connections: only ",
                    m * kin - nnz, " positions are absent");
  const auto long_opts = row_idx.options().dtype(at::kLong);
  if (k == 0) return at::empty({0}, long_opts);
  const int64_t rows = block_rows > 0 ? block_rows : std::max<int64_t>(1, (int64_t{1} << 23) / std::max<int64_t>(1, kin));
  const auto score_type = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor dyt = dy.to(score_type).t(), xs = x.to(score_type);
#ifdef SNACK_WITH_CUDA
  if (dy.is_cuda() && score_type == at::kFloat && gpu::bitmap_affordable(m, kin, nnz)) {
    // Device path: a bitmap of the present positions and an exact radix select (three passes, then
    // the selection) over scores that each pass recomputes (src/cuda/topology_update.cu).
    const c10::cuda::CUDAGuard guard(dy.device());
    const Stream stream = current_stream();
    at::Tensor out = at::empty({k}, long_opts);
    if (dy.size(0) <= kFusedRiglBatch) {
      // Small batch: the scores are recomputed in registers by every pass, never written out.
      const at::Tensor dyc = dy.to(at::kFloat).contiguous(), xc = x.to(at::kFloat).contiguous();
      with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
        using Index = decltype(tag);
        throw_if_error(gpu::topk_absent_gradient<Index>(m, kin, nnz, static_cast<const Index*>(r.data_ptr()),
                                                        static_cast<const Index*>(c.data_ptr()), dyc.data_ptr<float>(),
                                                        xc.data_ptr<float>(), dyc.size(0), k, out.data_ptr<int64_t>(),
                                                        torch_allocator(), stream),
                       op);
      });
      return out;
    }
    // Large batch: cuBLAS writes each block of scores, and the passes read it back.
    at::Tensor bitmap = at::empty({gpu::bitmap_words(m, kin)}, dy.options().dtype(at::kInt));
    auto* bits = reinterpret_cast<uint32_t*>(bitmap.data_ptr());
    with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
      using Index = decltype(tag);
      throw_if_error(gpu::mark_present<Index>(m, kin, nnz, static_cast<const Index*>(r.data_ptr()),
                                              static_cast<const Index*>(c.data_ptr()), bits, stream),
                     op);
    });
    at::Tensor block = at::empty({std::min(m, rows), kin}, dy.options().dtype(at::kFloat));
    bool whole_matrix_ready = false;  // one block covering every row is computed once, not once per pass
    auto block_scores = [&](int64_t r0, int64_t r1) {
      at::Tensor body = block.slice(0, 0, r1 - r0);
      if (!whole_matrix_ready) at::mm_out(body, dyt.slice(0, r0, r1), xs);
      whole_matrix_ready = rows >= m;
      return body;
    };
    gpu::TopkSelection selection(k, bits, torch_allocator(), stream);
    throw_if_error(selection.begin(), op);
    for (int pass = 0; pass < gpu::TopkSelection::kPasses; ++pass) {
      for (int64_t r0 = 0; r0 < m; r0 += rows) {
        const int64_t r1 = std::min(m, r0 + rows);
        const at::Tensor score = block_scores(r0, r1);
        throw_if_error(selection.histogram(pass, score.data_ptr<float>(), score.numel(), r0 * kin), op);
      }
      throw_if_error(selection.pick(pass), op);
    }
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      const int64_t r1 = std::min(m, r0 + rows);
      const at::Tensor score = block_scores(r0, r1);
      throw_if_error(selection.emit(score.data_ptr<float>(), score.numel(), r0 * kin, out.data_ptr<int64_t>()), op);
    }
    return out;
  }
#endif
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
    at::Tensor score = at::empty({size + kTrash}, dy.options().dtype(score_type));
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

#ifdef SNACK_WITH_CUDA
// replace_slots on the device: the new pattern's bitmap read back in position order
// (src/cuda/topology_update.cu). drop and grow are trusted here (validated before, or by the caller);
// an untrusted grow that names a kept position (validate=False) leaves zeros: still in range.
std::tuple<at::Tensor, at::Tensor, at::Tensor> replace_on_device(const at::Tensor& row_idx, const at::Tensor& col_idx,
                                                                 const at::Tensor& drop, const at::Tensor& grow,
                                                                 int64_t out_features, int64_t in_features) {
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const int64_t nnz = row_idx.size(0);
  at::Tensor source = at::empty({nnz}, row_idx.options().dtype(at::kLong));
  const at::Tensor d = drop.contiguous(), g = grow.contiguous();
  return with_device_indices(row_idx, col_idx, [&](auto tag, const at::Tensor& r, const at::Tensor& c) {
    using Index = decltype(tag);
    at::Tensor new_rows = at::empty({nnz}, r.options()), new_cols = at::empty({nnz}, c.options());
    throw_if_error(gpu::replace_slots<Index>(out_features, in_features, nnz, static_cast<const Index*>(r.data_ptr()),
                                             static_cast<const Index*>(c.data_ptr()), d.size(0),
                                             d.data_ptr<int64_t>(), g.data_ptr<int64_t>(),
                                             static_cast<Index*>(new_rows.data_ptr()),
                                             static_cast<Index*>(new_cols.data_ptr()), source.data_ptr<int64_t>(),
                                             torch_allocator(), current_stream()),
                   "replace_slots");
    return std::make_tuple(new_rows.to(row_idx.scalar_type()), new_cols.to(col_idx.scalar_type()), source);
  });
}
#endif

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
  [[maybe_unused]] bool on_device = false;
#ifdef SNACK_WITH_CUDA
  on_device = row_idx.is_cuda() && gpu::bitmap_affordable(out_features, in_features, nnz);
  if (on_device && !validate) return replace_on_device(row_idx, col_idx, d, g, out_features, in_features);
#endif
  at::Tensor keep = at::ones({nnz}, long_opts.dtype(at::kBool));
  keep.index_fill_(0, d, false);
  if (validate)
    TORCH_CHECK_VALUE(keep.sum().item<int64_t>() == nnz - k, "snack.", op, ": drop has repeated slots");
  // Kept slots keep their (ascending) order; first_k_set finds them without a data-dependent shape,
  // so the trusted path never synchronises with the device. 32-bit keys where positions fit: half the memory traffic of the searches and copies below.
  const auto key_type = position_type(total);
  const at::Tensor keys = slot_keys(row_idx, col_idx, in_features, key_type);
  const at::Tensor kept_src = first_k_set(keep, nnz - k);
  const at::Tensor kept_keys = keys.index_select(0, kept_src);  // ascending
  const at::Tensor g_sorted = std::get<0>(at::sort(g.to(key_type)));
  if (validate && k > 1)
    TORCH_CHECK_VALUE(g_sorted.slice(0, 1).ne(g_sorted.slice(0, 0, k - 1)).all().item<bool>(), "snack.", op,
                      ": grow has repeated positions");
  if (validate && k > 0 && kept_keys.size(0) > 0) {
    const at::Tensor idx = at::searchsorted(kept_keys, g_sorted).clamp_max(kept_keys.size(0) - 1);
    TORCH_CHECK_VALUE(kept_keys.index_select(0, idx).ne(g_sorted).all().item<bool>(), "snack.", op,
                      ": grow names a position that stays connected");
  }
#ifdef SNACK_WITH_CUDA
  if (on_device) return replace_on_device(row_idx, col_idx, d, g, out_features, in_features);
#endif
  // Merge the two ascending, disjoint key lists: a key's new slot is its index in its own list plus
  // the number of keys of the other list below it. The zero/-1 fills only matter for an untrusted
  // grow that names a kept position (validate=False): the arrays then stay in range.
  at::Tensor new_keys = at::zeros({nnz}, long_opts.dtype(key_type));
  at::Tensor source = at::full({nnz}, -1, long_opts);
  const int64_t kept_n = nnz - k;
  if (kept_n > 0) {
    at::Tensor slot = at::arange(kept_n, long_opts);
    if (k > 0) slot.add_(at::searchsorted(g_sorted, kept_keys));
    new_keys.index_copy_(0, slot, kept_keys);
    source.index_copy_(0, slot, kept_src);
  }
  if (k > 0) {
    at::Tensor slot = at::arange(k, long_opts);
    if (kept_n > 0) slot.add_(at::searchsorted(kept_keys, g_sorted));
    new_keys.index_copy_(0, slot, g_sorted);
  }
  const auto itype = row_idx.scalar_type();
  return {at::div(new_keys, in_features, "floor").to(itype), at::remainder(new_keys, in_features).to(itype), source};
}

// target <- where(source < 0, fill, target[source]), in place (one gather kernel on the GPU).
void remap_slots_(at::Tensor& target, const at::Tensor& source, const at::Tensor& fill) {
  const char* op = "remap_slots_";
  check_1d(target, "target", op);
  check_1d(source, "source", op);
  TORCH_CHECK_VALUE(source.size(0) == target.size(0), "snack.", op, ": source has ", source.size(0),
                    " slots, target ", target.size(0));
  TORCH_CHECK_TYPE(source.scalar_type() == at::kLong, "snack.", op, ": source must be int64");
  TORCH_CHECK_VALUE(fill.numel() == 1 || (fill.dim() == 1 && fill.size(0) == target.size(0)), "snack.", op,
                    ": fill must be a scalar or hold one value per slot");
  check_same_device(source, target, "source", op);
  check_same_device(fill, target, "fill", op);
  const at::Tensor f = fill.to(target.scalar_type()).reshape({-1}).contiguous();
#ifdef SNACK_WITH_CUDA
  const auto dtype = target.scalar_type();
  if (target.is_cuda() && (dtype == at::kFloat || dtype == at::kDouble)) {
    const c10::cuda::CUDAGuard guard(target.device());
    at::Tensor out = at::empty_like(target);  // check_1d: source and target are contiguous
    AT_DISPATCH_FLOATING_TYPES(dtype, "remap_slots_", [&] {
      throw_if_error(gpu::gather_slots<scalar_t>(target.size(0), target.data_ptr<scalar_t>(), source.data_ptr<int64_t>(),
                                                 f.data_ptr<scalar_t>(), f.numel() > 1, out.data_ptr<scalar_t>(),
                                                 current_stream()),
                     op);
    });
    target.copy_(out);
    return;
  }
#endif
  target.copy_(at::where(source.lt(0), f.numel() > 1 ? f : f.reshape({}), target.index_select(0, source.clamp_min(0))));
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CompositeImplicitAutograd, m) {
  m.impl("prune_slots", &snack::binding::prune_slots);
  m.impl("sample_absent", &snack::binding::sample_absent);
  m.impl("topk_absent_gradient", &snack::binding::topk_absent_gradient);
  m.impl("replace_slots", &snack::binding::replace_slots);
  m.impl("remap_slots_", &snack::binding::remap_slots_);
}
