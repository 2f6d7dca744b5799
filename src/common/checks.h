// Argument checks shared by the CPU and CUDA ops, so both backends reject the same inputs.
#pragma once

#include <string>

#include "snack/pattern.h"
#include "snack/status.h"

namespace snack::detail {

template <typename Index>
Status check_op(const SlotPattern<Index>& w, int64_t n, const void* values,
                std::initializer_list<std::pair<const char*, const void*>> operands,
                PatternNeeds needs = PatternNeeds::kAll) {
  SNACK_RETURN_IF_ERROR(check_pattern_shape(w, needs));
  if (n < 0) return InvalidArgument("batch size n must be non-negative, got " + std::to_string(n));
  if (w.nnz > 0 && values == nullptr) return InvalidArgument("values must not be null when nnz > 0");
  for (const auto& [name, ptr] : operands) {
    if (ptr == nullptr) return InvalidArgument(std::string(name) + " must not be null");
  }
  return Status::Ok();
}

// Pointers of empty arrays may legitimately be null: only require them when the array has elements.
inline const void* required_if(bool nonempty, const void* ptr) {
  static const char kPresent = 0;
  return nonempty ? ptr : static_cast<const void*>(&kPresent);
}

template <typename Index>
Status check_dims_fit(int64_t m, int64_t k, int64_t nnz) {
  if (m < 0 || k < 0 || nnz < 0)
    return InvalidArgument("sizes must be non-negative (m=" + std::to_string(m) + ", k=" + std::to_string(k) +
                           ", nnz=" + std::to_string(nnz) + ")");
  if (m > max_dim_for_index<Index>() || k > max_dim_for_index<Index>())
    return InvalidArgument("matrix " + std::to_string(m) + "x" + std::to_string(k) +
                           " is too large for the slot index type");
  if (nnz > kMaxNnz) return nnz_limit_error(nnz);
  if (nnz > m * k)
    return InvalidArgument("nnz=" + std::to_string(nnz) + " exceeds rows*cols=" + std::to_string(m * k));
  return Status::Ok();
}

// Arguments of dense_topk_positions (both backends).
inline Status check_topk(int64_t m, int64_t k, int64_t count, const void* dense, const void* positions) {
  if (m < 0 || k < 0) return InvalidArgument("dense_topk_positions: negative dimensions");
  if (count < 0 || count > m * k)
    return InvalidArgument("nnz=" + std::to_string(count) + " must lie in [0, rows*cols=" + std::to_string(m * k) + "]");
  if (count > 0 && (!dense || !positions)) return InvalidArgument("dense_topk_positions: null array");
  return Status::Ok();
}

// Arguments of pack_tile_values (both backends).
inline Status check_pack_tile_values(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr,
                                     const uint32_t* tile_entries, const uint16_t* value_bits, const uint32_t* packed) {
  if (m < 0 || k < 0 || nnz < 0 || (m * k > 0 ? nnz > m * k : nnz != 0))
    return InvalidArgument("pack_tile_values: sizes " + std::to_string(m) + "x" + std::to_string(k) + " with nnz=" +
                           std::to_string(nnz) + " are not a pattern's");
  if (tile_view_ptr_length(m, k) == 0)
    return InvalidArgument("pack_tile_values: a " + std::to_string(m) + "x" + std::to_string(k) +
                           " pattern has no tile view (empty, or more than " + std::to_string(kTileViewMaxCols) +
                           " columns)");
  if (!row_ptr || (nnz > 0 && (!tile_entries || !value_bits)) || (tile_view_entries_length(m, k, nnz) > 0 && !packed))
    return InvalidArgument("pack_tile_values: null array");
  return Status::Ok();
}

// Arguments of pack_tile_fragments and pack_tile_bitmaps (`op`; both backends).
inline Status check_pack_tile_fragments(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr,
                                        const int32_t* tile_ptr, const uint32_t* tile_entries,
                                        const uint16_t* value_bits, const int32_t* fragments,
                                        const std::string& op = "pack_tile_fragments") {
  if (m < 0 || k < 0 || nnz < 0 || (m * k > 0 ? nnz > m * k : nnz != 0))
    return InvalidArgument(op + ": sizes " + std::to_string(m) + "x" + std::to_string(k) +
                           " with nnz=" + std::to_string(nnz) + " are not a pattern's");
  if (tile_view_ptr_length(m, k) == 0)
    return InvalidArgument(op + ": a " + std::to_string(m) + "x" + std::to_string(k) +
                           " pattern has no tile view (empty, or more than " + std::to_string(kTileViewMaxCols) +
                           " columns)");
  if (!row_ptr || !tile_ptr || !fragments || (nnz > 0 && (!tile_entries || !value_bits)))
    return InvalidArgument(op + ": null array");
  return Status::Ok();
}

}  // namespace snack::detail
