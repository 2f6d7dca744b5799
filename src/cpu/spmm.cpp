// The CPU backend of the SpMM products, over the batch in tiles (snack/batch_tiles.h): each stored
// entry multiplies a tile's contiguous batch values, so the loops (loops.inc) run on vector units
// and read X from cache instead of gathering one value per batch row from X's rows. A thread owns a
// range of outputs and sums each in a fixed order (the entries round-robin over a few chains, then
// a fixed tree), so results are deterministic and do not depend on how the outputs are split. The
// 16-bit types accumulate in float and round once per output.
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "snack/activation.h"
#include "snack/spmm.h"
#include "snack/value_types.h"
#include "loops.h"
#include "tiled.h"

namespace snack::cpu {
namespace {
using detail::check_op;
using detail::required_if;
using tiled::check_range;
using tiled::with_tile_width;

// The whole operand in tiles, for the callers that hand the core X itself.
template <typename T>
BatchTiles<accum_t<T>> tiles_of(const T* x, int64_t n, int64_t cols, std::vector<accum_t<T>>& storage) {
  storage.resize(size_t(batch_tiles_numel(n, cols)));
  const int64_t width = batch_tile_width(n);
  return to_batch_tiles(x, n, cols, storage.data(), 0, (n + width - 1) / width);
}
}  // namespace

template <typename T, typename Index>
Status spmm_forward_rows(const SlotPattern<Index>& w, const T* values, const BatchTiles<accum_t<T>>& x,
                         const T* bias, T* y, Activation act, int64_t row_begin, int64_t row_end) {
  SNACK_RETURN_IF_ERROR(check_op(w, x.n, values, {{"y", required_if(x.n * w.rows > 0, y)}}, PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(x, w.cols, "x"));
  SNACK_RETURN_IF_ERROR(check_range(row_begin, row_end, w.rows, "output rows"));
  return with_tile_width(x.width, [&](auto width) {
    with_loops([&](auto loops) {
      loops.template forward_rows<decltype(width)::value>(w, values, x, bias, y, act, row_begin, row_end);
    });
    return Status::Ok();
  });
}

template <typename T, typename Index>
Status spmm_transposed_columns(const SlotPattern<Index>& w, const T* values, const BatchTiles<accum_t<T>>& dy, T* dx,
                               int64_t col_begin, int64_t col_end) {
  SNACK_RETURN_IF_ERROR(check_op(w, dy.n, values, {{"dx", required_if(dy.n * w.cols > 0, dx)}}));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(dy, w.rows, "dy"));
  SNACK_RETURN_IF_ERROR(check_range(col_begin, col_end, w.cols, "output columns"));
  std::vector<accum_t<T>> acc(size_t((col_end - col_begin) * dy.width));
  return with_tile_width(dy.width, [&](auto width) {
    with_loops([&](auto loops) {
      loops.template transposed_columns<decltype(width)::value>(w, values, dy, dx, col_begin, col_end, acc.data());
    });
    return Status::Ok();
  });
}

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias, T* y,
                    Activation act) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, values,
                                 {{"x", required_if(n * w.cols > 0, x)}, {"y", required_if(n * w.rows > 0, y)}},
                                 PatternNeeds::kForward));
  std::vector<accum_t<T>> storage;
  return spmm_forward_rows(w, values, tiles_of(x, n, w.cols, storage), bias, y, act, 0, w.rows);
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, values,
                                 {{"dy", required_if(n * w.rows > 0, dy)}, {"dx", required_if(n * w.cols > 0, dx)}}));
  std::vector<accum_t<T>> storage;
  return spmm_transposed_columns(w, values, tiles_of(dy, n, w.rows, storage), dx, 0, w.cols);
}

template <typename T, typename Index>
Status spmm_channels_first_rows(const SlotPattern<Index>& w, const T* values, const accum_t<T>* x, int64_t batch,
                                int64_t pixels, const T* bias, T* y, Activation act, int64_t row_begin,
                                int64_t row_end) {
  if (pixels < 0) return InvalidArgument("pixels must be non-negative, got " + std::to_string(pixels));
  SNACK_RETURN_IF_ERROR(check_op(w, batch, values,
                                 {{"x", required_if(batch * w.cols * pixels > 0, x)},
                                  {"y", required_if(batch * w.rows * pixels > 0, y)}},
                                 PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_range(row_begin, row_end, w.rows, "output rows"));
  with_loops([&](auto loops) {
    loops.channels_first_rows(w, values, x, batch, pixels, bias, y, act, row_begin, row_end);
  });
  return Status::Ok();
}

template <typename T, typename Index>
Status spmm_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                           const T* bias, T* y, Activation act) {
  if constexpr (std::is_same_v<T, accum_t<T>>) {
    return spmm_channels_first_rows(w, values, x, batch, pixels, bias, y, act, 0, w.rows);
  } else {  // 16-bit images widened once
    if (pixels < 0 || batch < 0) return InvalidArgument("batch and pixels must be non-negative");
    if (x == nullptr && batch * w.cols * pixels > 0) return InvalidArgument("x must not be null");
    std::vector<accum_t<T>> wide(size_t(batch * w.cols * pixels));
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = to_accum(x[i]);
    return spmm_channels_first_rows(w, values, wide.data(), batch, pixels, bias, y, act, 0, w.rows);
  }
}

template <typename T, typename Index>
Status expand_rows(const SlotPattern<Index>& w, const T* values, int64_t first, int64_t count, T* block) {
  SNACK_RETURN_IF_ERROR(check_op(w, 0, values, {{"block", required_if(count * w.cols > 0, block)}},
                                 PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_range(first, first + count, w.rows, "rows"));
  std::fill(block, block + count * w.cols, from_accum<T>(accum_t<T>(0)));
  for (int64_t r = first; r < first + count; ++r)
    for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) block[(r - first) * w.cols + w.col_idx[s]] = values[s];
  return Status::Ok();
}

template <typename T, typename Index>
Status expand_columns(const SlotPattern<Index>& w, const T* values, int64_t first, int64_t count, int64_t row_begin,
                      int64_t row_end, T* block) {
  SNACK_RETURN_IF_ERROR(check_op(w, 0, values, {{"block", required_if(count * (row_end - row_begin) > 0, block)}},
                                 PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_range(first, first + count, w.cols, "columns"));
  SNACK_RETURN_IF_ERROR(check_range(row_begin, row_end, w.rows, "rows"));
  std::fill(block + row_begin * count, block + row_end * count, from_accum<T>(accum_t<T>(0)));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const Index* last = w.col_idx + w.row_ptr[r + 1];
    for (const Index* c = std::lower_bound(w.col_idx + w.row_ptr[r], last, Index(first));
         c < last && int64_t(*c) < first + count; ++c)
      block[r * count + (int64_t(*c) - first)] = values[c - w.col_idx];
  }
  return Status::Ok();
}

#define SNACK_INSTANTIATE_CPU_SPMM(T, Index)                                                                      \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,        \
                                         Activation);                                                                 \
  template Status spmm_forward_rows<T, Index>(const SlotPattern<Index>&, const T*, const BatchTiles<accum_t<T>>&,     \
                                              const T*, T*, Activation, int64_t, int64_t);                            \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*);               \
  template Status spmm_transposed_columns<T, Index>(const SlotPattern<Index>&, const T*,                             \
                                                    const BatchTiles<accum_t<T>>&, T*, int64_t, int64_t);            \
  template Status spmm_channels_first<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, int64_t,       \
                                                const T*, T*, Activation);                                             \
  template Status expand_rows<T, Index>(const SlotPattern<Index>&, const T*, int64_t, int64_t, T*);                 \
  template Status expand_columns<T, Index>(const SlotPattern<Index>&, const T*, int64_t, int64_t, int64_t, int64_t,  \
                                           T*);                                                                       \
  template Status spmm_channels_first_rows<T, Index>(const SlotPattern<Index>&, const T*, const accum_t<T>*,         \
                                                     int64_t, int64_t, const T*, T*, Activation, int64_t, int64_t);

SNACK_INSTANTIATE_CPU_SPMM(float, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(float, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(double, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(double, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(bfloat16, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(float16, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(float16, int32_t)

}  // namespace snack::cpu
