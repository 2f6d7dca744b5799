// CPU construction of slot patterns and their views.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "snack/topology.h"

namespace snack::cpu {
namespace {

Status check_coo_element(int64_t i, int64_t row, int64_t col, int64_t m, int64_t k) {
  if (row < 0 || row >= m)
    return Status(StatusCode::kOutOfRange, "rows[" + std::to_string(i) + "]=" + std::to_string(row) +
                                               " is outside [0, " + std::to_string(m) + ")");
  if (col < 0 || col >= k)
    return Status(StatusCode::kOutOfRange, "cols[" + std::to_string(i) + "]=" + std::to_string(col) +
                                               " is outside [0, " + std::to_string(k) + ")");
  return Status::Ok();
}

}  // namespace

template <typename Index>
Status slots_from_coo(int64_t m, int64_t k, int64_t nnz, const int64_t* rows, const int64_t* cols,
                      Index* row_idx, Index* col_idx, int64_t* order) {
  SNACK_RETURN_IF_ERROR(detail::check_dims_fit<Index>(m, k, nnz));
  if (nnz == 0) return Status::Ok();
  if (!rows || !cols || !row_idx || !col_idx || !order) return InvalidArgument("slots_from_coo: null array");
  for (int64_t i = 0; i < nnz; ++i) SNACK_RETURN_IF_ERROR(check_coo_element(i, rows[i], cols[i], m, k));
  std::vector<int64_t> perm(nnz);
  std::iota(perm.begin(), perm.end(), int64_t{0});
  auto key = [&](int64_t i) { return rows[i] * k + cols[i]; };
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
  for (int64_t s = 1; s < nnz; ++s) {
    if (key(perm[s]) == key(perm[s - 1]))
      return Status(StatusCode::kDuplicateEntry,
                    "position (" + std::to_string(rows[perm[s]]) + ", " + std::to_string(cols[perm[s]]) +
                        ") appears more than once (elements " + std::to_string(perm[s - 1]) + " and " +
                        std::to_string(perm[s]) + ")");
  }
  for (int64_t s = 0; s < nnz; ++s) {
    row_idx[s] = static_cast<Index>(rows[perm[s]]);
    col_idx[s] = static_cast<Index>(cols[perm[s]]);
    order[s] = perm[s];
  }
  return Status::Ok();
}

template <typename Index>
Status check_slots(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx) {
  SNACK_RETURN_IF_ERROR(detail::check_dims_fit<Index>(m, k, nnz));
  if (nnz > 0 && (!row_idx || !col_idx)) return InvalidArgument("null slot array");
  int64_t previous = -1;
  for (int64_t s = 0; s < nnz; ++s) {
    const int64_t row = int64_t(row_idx[s]), col = int64_t(col_idx[s]);
    if (row < 0 || row >= m || col < 0 || col >= k)
      return Status(StatusCode::kOutOfRange, "slot " + std::to_string(s) + " is at (" + std::to_string(row) + ", " +
                                                 std::to_string(col) + "), outside the " + std::to_string(m) + "x" +
                                                 std::to_string(k) + " matrix");
    const int64_t position = row * k + col;
    if (position == previous)
      return Status(StatusCode::kDuplicateEntry, "slots " + std::to_string(s - 1) + " and " + std::to_string(s) +
                                                     " are both at (" + std::to_string(row) + ", " +
                                                     std::to_string(col) + ")");
    if (position < previous)
      return InvalidArgument("the slots are not sorted row-major: slot " + std::to_string(s) + " at (" +
                             std::to_string(row) + ", " + std::to_string(col) + ") comes after (" +
                             std::to_string(previous / k) + ", " + std::to_string(previous % k) + ")");
    previous = position;
  }
  return Status::Ok();
}

template <typename Index>
Status check_pattern(const SlotPattern<Index>& w) {
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w, PatternNeeds::kForward));
  if (!w.forward_only()) SNACK_RETURN_IF_ERROR(check_slots(w.rows, w.cols, w.nnz, w.row_idx, w.col_idx));
  const auto view_error = [](const std::string& what) {
    return InvalidArgument("the pattern's views disagree with its slots: " + what +
                           " (build the pattern with snack.Pattern, which derives them)");
  };
  // CSR: offsets from 0 to nnz, and every slot in its row's range (the slots are sorted, so the
  // ranges are then exactly the rows' slots). A forward-only pattern's rows are these ranges.
  if (w.row_ptr[0] != 0 || w.row_ptr[w.rows] != w.nnz) return view_error("row_ptr must run from 0 to nnz");
  std::vector<Index> rows_of_ranges;
  if (w.forward_only()) rows_of_ranges.resize(size_t(w.nnz));
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t begin = w.row_ptr[r], end = w.row_ptr[r + 1];
    if (end < begin) return view_error("row_ptr decreases at row " + std::to_string(r));
    if (end > w.nnz) return view_error("row_ptr passes nnz at row " + std::to_string(r));
    for (int64_t s = begin; s < end; ++s) {
      if (w.forward_only()) rows_of_ranges[size_t(s)] = static_cast<Index>(r);
      else if (int64_t(w.row_idx[s]) != r)
        return view_error("slot " + std::to_string(s) + " is not in row " + std::to_string(r));
    }
  }
  const Index* row_idx = w.forward_only() ? rows_of_ranges.data() : w.row_idx;
  if (w.forward_only()) SNACK_RETURN_IF_ERROR(check_slots(w.rows, w.cols, w.nnz, row_idx, w.col_idx));
  // CSC: offsets from 0 to nnz; each column's entries name slots of that column in ascending order.
  // A slot belongs to one column and cannot repeat inside it, so nnz such entries are a permutation.
  // Without the permutation, each column's range holds as many entries as the column has slots.
  if (w.col_ptr[0] != 0 || w.col_ptr[w.cols] != w.nnz) return view_error("col_ptr must run from 0 to nnz");
  std::vector<int64_t> column_slots;
  if (w.forward_only()) {
    column_slots.assign(size_t(w.cols), 0);
    for (int64_t s = 0; s < w.nnz; ++s) ++column_slots[size_t(w.col_idx[s])];
  }
  for (int64_t c = 0; c < w.cols; ++c) {
    const int64_t begin = w.col_ptr[c], end = w.col_ptr[c + 1];
    if (end < begin) return view_error("col_ptr decreases at column " + std::to_string(c));
    if (end > w.nnz) return view_error("col_ptr passes nnz at column " + std::to_string(c));
    if (w.forward_only()) {
      if (end - begin != column_slots[size_t(c)])
        return view_error("col_ptr gives column " + std::to_string(c) + " " + std::to_string(end - begin) +
                          " slots, it has " + std::to_string(column_slots[size_t(c)]));
      continue;
    }
    int64_t previous = -1;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t s = w.csc_perm[j];
      if (s < 0 || s >= w.nnz || int64_t(w.col_idx[s]) != c || s <= previous)
        return view_error("csc_perm[" + std::to_string(j) + "] is not the next slot of column " + std::to_string(c));
      previous = s;
    }
  }
  // The tile view, where given, is the one build_tile_view derives.
  if (w.tile_ptr != nullptr) {
    std::vector<int32_t> tile_ptr(size_t(tile_view_ptr_length(w.rows, w.cols)));
    std::vector<uint32_t> entries(size_t(tile_view_entries_length(w.rows, w.cols, w.nnz)));
    SNACK_RETURN_IF_ERROR(
        build_tile_view(w.rows, w.cols, w.nnz, row_idx, w.col_idx, w.row_ptr, tile_ptr.data(), entries.data()));
    if (!std::equal(tile_ptr.begin(), tile_ptr.end(), w.tile_ptr)) return view_error("tile_ptr differs");
    if (!entries.empty() && (w.tile_entries == nullptr || !std::equal(entries.begin(), entries.end(), w.tile_entries)))
      return view_error("tile_entries differ");
  }
  return Status::Ok();
}

template <typename Index>
Status build_views(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                   int32_t* row_ptr, int32_t* col_ptr, int32_t* csc_perm) {
  if (!row_ptr || !col_ptr) return InvalidArgument("build_views: row_ptr and col_ptr must not be null");
  if (nnz > 0 && !csc_perm) return InvalidArgument("build_views: null array");
  SNACK_RETURN_IF_ERROR(check_slots(m, k, nnz, row_idx, col_idx));
  std::vector<int32_t> col_count(k + 1, 0);
  std::fill(row_ptr, row_ptr + m + 1, 0);
  for (int64_t s = 0; s < nnz; ++s) {
    ++row_ptr[int64_t(row_idx[s]) + 1];
    ++col_count[int64_t(col_idx[s]) + 1];
  }
  for (int64_t r = 0; r < m; ++r) row_ptr[r + 1] += row_ptr[r];
  for (int64_t c = 0; c < k; ++c) col_count[c + 1] += col_count[c];
  std::copy(col_count.begin(), col_count.end(), col_ptr);
  // Slots are row-major, so visiting them in order fills each column with ascending rows.
  for (int64_t s = 0; s < nnz; ++s) csc_perm[col_count[col_idx[s]]++] = static_cast<int32_t>(s);
  return Status::Ok();
}

template <typename Index>
Status build_tile_view(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                       const int32_t* row_ptr, int32_t* tile_ptr, uint32_t* tile_entries) {
  if (tile_view_ptr_length(m, k) == 0) return Status::Ok();
  if (!row_ptr || !tile_ptr) return InvalidArgument("build_tile_view: row_ptr and tile_ptr must not be null");
  if (nnz > 0 && !tile_entries) return InvalidArgument("build_tile_view: null array");
  SNACK_RETURN_IF_ERROR(check_slots(m, k, nnz, row_idx, col_idx));
  const int64_t bands = tile_view_bands(m), chunks = tile_view_chunks(k);
  std::vector<int32_t> next(chunks);
  for (int64_t b = 0; b < bands; ++b) {
    const int64_t r0 = b * kTileViewRows, r1 = std::min(m, r0 + kTileViewRows);
    const int32_t first = row_ptr[r0], last = row_ptr[r1];
    std::fill(next.begin(), next.end(), 0);
    for (int32_t s = first; s < last; ++s) ++next[int64_t(col_idx[s]) / kTileViewCols];
    int32_t at = first;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t size = next[c];
      tile_ptr[b * chunks + c] = next[c] = at;
      at += size;
    }
    // Rows in order, each row's slots by column: every tile fills row-major.
    for (int32_t s = first; s < last; ++s) {
      const int64_t r = int64_t(row_idx[s]) - r0, col = int64_t(col_idx[s]), c = col / kTileViewCols;
      tile_entries[next[c]++] =
          uint32_t(s - first) << kTileViewSlotShift | uint32_t(r * kTileViewCols + (col - c * kTileViewCols));
    }
  }
  tile_ptr[bands * chunks] = int32_t(nnz);
  std::fill(tile_entries + nnz, tile_entries + tile_view_entries_length(m, k, nnz), 0u);
  return Status::Ok();
}

Status pack_tile_values(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const uint32_t* tile_entries,
                        const uint16_t* value_bits, uint32_t* packed) {
  SNACK_RETURN_IF_ERROR(detail::check_pack_tile_values(m, k, nnz, row_ptr, tile_entries, value_bits, packed));
  for (int64_t b = 0; b < tile_view_bands(m); ++b) {
    const int32_t first = row_ptr[b * kTileViewRows], last = row_ptr[std::min(m, (b + 1) * kTileViewRows)];
    for (int32_t e = first; e < last; ++e) {
      const uint32_t entry = tile_entries[e];
      packed[e] = packed_tile_entry(entry, value_bits[first + int64_t(entry >> kTileViewSlotShift)]);
    }
  }
  std::fill(packed + nnz, packed + tile_view_entries_length(m, k, nnz), 0u);
  return Status::Ok();
}

Status pack_tile_fragments(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                           const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* fragments,
                           bool transposed) {
  SNACK_RETURN_IF_ERROR(detail::check_pack_tile_fragments(m, k, nnz, row_ptr, tile_ptr, tile_entries, value_bits,
                                                          fragments));
  const FragmentLayout layout = tile_fragment_layout(m, k, nnz);
  std::fill(fragments, fragments + layout.words, 0);
  const int64_t chunks = tile_view_chunks(k), bands = tile_view_bands(m);
  std::vector<uint32_t> regs(static_cast<size_t>(kFragmentHeaderWords * kFragmentRegisters));
  std::vector<uint32_t> masks(static_cast<size_t>(kFragmentHeaderWords));
  for (int64_t b = 0; b < bands; ++b) {
    const int32_t first = row_ptr[b * kTileViewRows];
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t tile = b * chunks + c;
      const int64_t at = tile_fragment_start(b, c, chunks, first, tile_ptr[tile]);  // from layout.values
      const int64_t index = transposed ? transposed_fragment_tile(b, c, bands) : tile;  // its pair and header
      std::fill(regs.begin(), regs.end(), 0u);
      std::fill(masks.begin(), masks.end(), 0u);
      for (int32_t e = tile_ptr[tile]; e < tile_ptr[tile + 1]; ++e) {
        const uint32_t entry = tile_entries[e];
        const FragmentPlace f = entry_fragment_place(entry, transposed);
        const int owner = fragment_owner(f);
        regs[size_t(owner) * kFragmentRegisters + f.reg] |=
            uint32_t(value_bits[first + int64_t(entry >> kTileViewSlotShift)]) << (16 * f.half);
        masks[size_t(owner)] |= 1u << f.reg;
      }
      int32_t* header = fragments + layout.headers + kFragmentHeaderWords * index;
      int64_t stored = 0;
      for (int owner = 0; owner < kFragmentHeaderWords; ++owner) {
        header[owner] = int32_t(masks[size_t(owner)] | uint32_t(stored) << 16);
        for (int r = 0; r < kFragmentRegisters; ++r)
          if (masks[size_t(owner)] >> r & 1u)
            fragments[layout.values + at + stored++] = int32_t(regs[size_t(owner) * kFragmentRegisters + r]);
      }
      const int64_t words = (stored + 3) / 4 * 4;
      fragments[2 * index] = stored > 0 ? int32_t(at) : 0;
      fragments[2 * index + 1] = int32_t(words);
    }
  }
  return Status::Ok();
}

Status pack_tile_bitmaps(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                         const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* bitmaps, bool transposed) {
  SNACK_RETURN_IF_ERROR(detail::check_pack_tile_fragments(m, k, nnz, row_ptr, tile_ptr, tile_entries, value_bits,
                                                          bitmaps, "pack_tile_bitmaps"));
  const FragmentLayout layout = tile_bitmap_layout(m, k, nnz);
  std::fill(bitmaps, bitmaps + layout.words, 0);
  const int64_t chunks = tile_view_chunks(k), bands = tile_view_bands(m);
  constexpr int kBlockValues = 64;
  std::vector<uint16_t> halves(static_cast<size_t>(kBitmapBlocks * kBlockValues));
  std::vector<uint64_t> masks(static_cast<size_t>(kBitmapBlocks));
  for (int64_t b = 0; b < bands; ++b) {
    const int32_t first = row_ptr[b * kTileViewRows];
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t tile = b * chunks + c;
      const int64_t at = tile_bitmap_start(b, c, chunks, first, tile_ptr[tile]);  // from layout.values
      const int64_t index = transposed ? transposed_fragment_tile(b, c, bands) : tile;  // its pair and header
      std::fill(masks.begin(), masks.end(), uint64_t(0));
      for (int32_t e = tile_ptr[tile]; e < tile_ptr[tile + 1]; ++e) {
        const uint32_t entry = tile_entries[e];
        const BitmapPlace place = bitmap_place(entry_fragment_place(entry, transposed));
        halves[size_t(place.block) * kBlockValues + size_t(place.bit)] =
            value_bits[first + int64_t(entry >> kTileViewSlotShift)];
        masks[size_t(place.block)] |= uint64_t(1) << place.bit;
      }
      int32_t* header = bitmaps + layout.headers + kBitmapHeaderWords * index;
      auto* values = reinterpret_cast<uint16_t*>(bitmaps + layout.values + at);  // little-endian: low half first
      int64_t stored = 0;
      for (int block = 0; block < kBitmapBlocks; ++block) {
        const uint64_t mask = masks[size_t(block)];
        if (block % 4 == 0) header[2 * kBitmapBlocks + block / 4] = int32_t(stored);
        header[2 * block] = int32_t(uint32_t(mask));
        header[2 * block + 1] = int32_t(uint32_t(mask >> 32));
        for (int bit = 0; bit < kBlockValues; ++bit)
          if (mask >> bit & 1u) values[stored++] = halves[size_t(block) * kBlockValues + size_t(bit)];
      }
      const int64_t words = (stored + 7) / 8 * 4;
      bitmaps[2 * index] = stored > 0 ? int32_t(at) : 0;
      bitmaps[2 * index + 1] = int32_t(words);
    }
  }
  return Status::Ok();
}

template <typename T>
Status dense_topk_positions(int64_t m, int64_t k, const T* dense, int64_t count, int64_t* positions) {
  SNACK_RETURN_IF_ERROR(detail::check_topk(m, k, count, dense, positions));
  if (count == 0) return Status::Ok();
  const int64_t total = m * k;
  for (int64_t i = 0; i < total; ++i)
    if (!std::isfinite(static_cast<double>(dense[i])))
      return InvalidArgument("dense weight has a non-finite entry at (" + std::to_string(i / k) + ", " +
                             std::to_string(i % k) + ")");
  std::vector<int64_t> order(total);
  std::iota(order.begin(), order.end(), int64_t{0});
  auto larger = [&](int64_t a, int64_t b) {
    const T ma = std::abs(dense[a]), mb = std::abs(dense[b]);
    return ma > mb || (ma == mb && a < b);
  };
  std::nth_element(order.begin(), order.begin() + (count - 1), order.end(), larger);
  std::sort(order.begin(), order.begin() + count);
  std::copy(order.begin(), order.begin() + count, positions);
  return Status::Ok();
}

template Status slots_from_coo<uint16_t>(int64_t, int64_t, int64_t, const int64_t*, const int64_t*, uint16_t*,
                                         uint16_t*, int64_t*);
template Status slots_from_coo<int32_t>(int64_t, int64_t, int64_t, const int64_t*, const int64_t*, int32_t*,
                                        int32_t*, int64_t*);
template Status check_slots<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*);
template Status check_slots<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*);
template Status check_pattern<uint16_t>(const SlotPattern<uint16_t>&);
template Status check_pattern<int32_t>(const SlotPattern<int32_t>&);
template Status build_views<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int32_t*,
                                      int32_t*, int32_t*);
template Status build_views<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, int32_t*,
                                     int32_t*, int32_t*);
template Status build_tile_view<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, const int32_t*,
                                          int32_t*, uint32_t*);
template Status build_tile_view<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, const int32_t*,
                                         int32_t*, uint32_t*);
template Status dense_topk_positions<float>(int64_t, int64_t, const float*, int64_t, int64_t*);
template Status dense_topk_positions<double>(int64_t, int64_t, const double*, int64_t, int64_t*);

}  // namespace snack::cpu
