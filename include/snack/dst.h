// Dynamic sparse training on the device: the topology updates of a fixed-nnz pattern (prune the
// lowest-scoring slots, grow absent positions uniformly or by |dY^T X|, rebuild the sorted slots and
// the permutation that per-slot tensors follow). CPU versions of these live in the torch binding,
// as ATen operations (src/torch/dst_ops.cpp).
#pragma once

#include <cstdint>

#include "snack/pattern.h"
#include "snack/status.h"
#include "snack/topology.h"

namespace snack::cuda {

// No function below synchronises with the host, and every result is deterministic. They keep a
// bitmap of one bit per position of the m x k matrix (m * k / 8 bytes: 1/32 of a dense fp32
// weight) instead of sorting; callers pick them where that bitmap is affordable.

/// 32-bit words of a bitmap with one bit per position of an m x k matrix.
int64_t bitmap_words(int64_t m, int64_t k);

/// Whether that bitmap is worth keeping next to nnz slots: m*k/8 bytes within 64 bytes per slot
/// plus 64 MiB (density above ~1/512 for large matrices). The binding takes the functions below
/// only when it holds.
bool bitmap_affordable(int64_t m, int64_t k, int64_t nnz);

/// bitmap [bitmap_words(m, k)] <- the positions of the slots (zeroed first).
template <typename Index>
Status mark_present(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, uint32_t* bitmap,
                    Stream stream);

/// Slots `drop` [count] (distinct, in [0, nnz)) freed and refilled with the positions `grow` [count]
/// (distinct, absent, in [0, m*k)): the new row-major slot arrays new_row_idx/new_col_idx [nnz] and
/// source [nnz], the old slot each new slot came from (-1 = grown). The inputs are trusted (the
/// binding validates untrusted ones first). Scratch: the bitmap, its word offsets and nnz flags.
template <typename Index>
Status replace_slots(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, int64_t count,
                     const int64_t* drop, const int64_t* grow, Index* new_row_idx, Index* new_col_idx, int64_t* source,
                     DeviceAllocator& alloc, Stream stream);

/// `count` distinct positions absent from the pattern, uniformly at random, ascending, into
/// positions [count]. random_bits [draws + 1]: independent random integers in [0, 2^62) from the
/// caller's generator; random_bits[0] seeds the priorities, the others are candidate draws.
/// draws == 0 makes every absent position a candidate (for dense patterns). The candidates are the
/// distinct absent draws (scrambled by x -> (x * multiplier + offset) mod m*k, a permutation when
/// multiplier is coprime with m*k); the `count` of lowest hash priority are kept, which is a
/// uniform choice among them. candidate_count [1] receives how many candidates there were: fewer
/// than `count` means the draws fell short, and the output is then incomplete (callers assert it).
template <typename Index>
Status sample_absent(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                     const int64_t* random_bits, int64_t draws, int64_t multiplier, int64_t offset, int64_t count,
                     int64_t* positions, int64_t* candidate_count, DeviceAllocator& alloc, Stream stream);

/// out[s] = source[s] in [0, nnz) ? in[source[s]] : fill[fill_per_slot ? s : 0] for s in [0, nnz): how
/// a per-slot tensor (values, gradient, optimizer state) follows replace_slots' permutation (-1 =
/// grown; any other out-of-range entry also takes the fill). `out` must not alias `in`. T: float or
/// double.
template <typename T>
Status gather_slots(int64_t nnz, const T* in, const int64_t* source, const T* fill, bool fill_per_slot, T* out,
                    Stream stream);

/// RigL's regrowth in one call: the `count` positions absent from the pattern of largest
/// |sum_n dy[n, r] * x[n, c]| (NaN counts as 0; ties: the smaller position), ascending, into
/// positions [count]. dy [n, m] and x [n, k]: row-major fp32. The scores are recomputed in
/// registers by each of four passes (three radix passes, then the selection into a bitmap) and
/// never stored: memory is three bitmaps. Best for small n (up to a few hundred), where the
/// passes are cheap next to writing the scores out.
template <typename Index>
Status topk_absent_gradient(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                            const float* dy, const float* x, int64_t n, int64_t count, int64_t* positions,
                            DeviceAllocator& alloc, Stream stream);

/// The k lowest of scores [count] (fp32; NaN ranks as +inf, -0 ties with +0; ties go to the lower
/// index), as ascending indices into slots [k]: prune_slots on the device. An exact MSD radix select
/// over 32-bit keys in three passes, then an ordered write; k in [0, count].
Status lowest_slots(const float* scores, int64_t count, int64_t k, int64_t* slots, DeviceAllocator& alloc,
                    Stream stream);

/// RigL's selection over scores too many to hold at once, arriving in blocks: the k largest |score|
/// (NaN counts as 0; positions set in `bitmap` are skipped; ties go to the smaller position), by the
/// radix select of lowest_slots, where every pass sees every block again, in the same order. Holds
/// its device state; not thread-safe.
///   for pass in 0..kPasses-1: for each block: histogram(pass, ...); then pick(pass)
///   for each block: emit(...)  -> out [k] ascending positions (block's first_position + index)
class TopkSelection {
 public:
  static constexpr int kPasses = 3;
  /// k >= 1 of the keys to select, at most the number of positions taking part (the caller checks
  /// it: with fewer, no digit is found and the output is incomplete); `bitmap` marks the positions
  /// to skip (the present ones; nullptr: none).
  TopkSelection(int64_t k, const uint32_t* bitmap, DeviceAllocator& alloc, Stream stream);
  ~TopkSelection();
  TopkSelection(const TopkSelection&) = delete;
  TopkSelection& operator=(const TopkSelection&) = delete;
  /// Allocates and resets the device state; call once before the passes.
  Status begin();
  /// Counts the keys of scores [count] (positions first_position ..) that match the digits picked so far.
  Status histogram(int pass, const float* scores, int64_t count, int64_t first_position);
  /// Fixes the pass's digit of the k-th key from the counts of every block.
  Status pick(int pass);
  /// Writes the selected positions of this block to out, after those of the blocks before it.
  Status emit(const float* scores, int64_t count, int64_t first_position, int64_t* out);

 private:
  int64_t k_;
  const uint32_t* bitmap_;
  DeviceAllocator& alloc_;
  Stream stream_;
  void* state_ = nullptr;
};

}  // namespace snack::cuda
