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
Status build_views(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                   int32_t* row_ptr, int32_t* col_ptr, int32_t* csc_perm) {
  SNACK_RETURN_IF_ERROR(detail::check_dims_fit<Index>(m, k, nnz));
  if (!row_ptr || !col_ptr) return InvalidArgument("build_views: row_ptr and col_ptr must not be null");
  if (nnz > 0 && (!row_idx || !col_idx || !csc_perm)) return InvalidArgument("build_views: null array");
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
template Status build_views<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int32_t*,
                                      int32_t*, int32_t*);
template Status build_views<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, int32_t*,
                                     int32_t*, int32_t*);
template Status dense_topk_positions<float>(int64_t, int64_t, const float*, int64_t, int64_t*);
template Status dense_topk_positions<double>(int64_t, int64_t, const double*, int64_t, int64_t*);

}  // namespace snack::cpu
