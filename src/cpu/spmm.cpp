// CPU reference and backend of the SpMM products. Plain loops in a fixed order: deterministic, and
// the float64 instantiation doubles as the reference the tests compare against. The 16-bit types
// accumulate in float and round once per output.
#include <algorithm>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "snack/activation.h"
#include "snack/spmm.h"
#include "snack/value_types.h"

namespace snack::cpu {
namespace {
using detail::check_op;
using detail::required_if;
}  // namespace

template <typename T, typename Index>
Status spmm_forward(const SlotPattern<Index>& w, const T* values, const T* x, int64_t n, const T* bias,
                    T* y, Activation act) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, values,
                                 {{"x", required_if(n * w.cols > 0, x)}, {"y", required_if(n * w.rows > 0, y)}},
                                 PatternNeeds::kForward));
  for (int64_t i = 0; i < n; ++i) {
    const T* xrow = x + i * w.cols;
    T* yrow = y + i * w.rows;
    for (int64_t r = 0; r < w.rows; ++r) {
      accum_t<T> acc = 0;
      for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) {
        acc += to_accum(values[s]) * to_accum(xrow[w.col_idx[s]]);
      }
      yrow[r] = from_accum<T>(apply_activation(bias ? acc + to_accum(bias[r]) : acc, act));
    }
  }
  return Status::Ok();
}

template <typename T, typename Index>
Status spmm_transposed(const SlotPattern<Index>& w, const T* values, const T* dy, int64_t n, T* dx) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, values,
                                 {{"dy", required_if(n * w.rows > 0, dy)}, {"dx", required_if(n * w.cols > 0, dx)}}));
  for (int64_t i = 0; i < n; ++i) {
    const T* dyrow = dy + i * w.rows;
    T* dxrow = dx + i * w.cols;
    for (int64_t c = 0; c < w.cols; ++c) {
      accum_t<T> acc = 0;
      for (int32_t j = w.col_ptr[c]; j < w.col_ptr[c + 1]; ++j) {
        const int32_t s = w.csc_perm[j];
        acc += to_accum(values[s]) * to_accum(dyrow[w.row_idx[s]]);
      }
      dxrow[c] = from_accum<T>(acc);
    }
  }
  return Status::Ok();
}

template <typename T, typename Index>
Status spmm_channels_first(const SlotPattern<Index>& w, const T* values, const T* x, int64_t batch, int64_t pixels,
                           const T* bias, T* y, Activation act) {
  if (pixels < 0) return InvalidArgument("pixels must be non-negative, got " + std::to_string(pixels));
  SNACK_RETURN_IF_ERROR(check_op(w, batch, values,
                                 {{"x", required_if(batch * w.cols * pixels > 0, x)},
                                  {"y", required_if(batch * w.rows * pixels > 0, y)}},
                                 PatternNeeds::kForward));
  std::vector<accum_t<T>> acc(static_cast<size_t>(pixels));
  for (int64_t b = 0; b < batch; ++b) {
    const T* xb = x + b * w.cols * pixels;
    for (int64_t r = 0; r < w.rows; ++r) {
      std::fill(acc.begin(), acc.end(), accum_t<T>(0));
      for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) {
        const accum_t<T> v = to_accum(values[s]);
        const T* xrow = xb + int64_t(w.col_idx[s]) * pixels;
        for (int64_t p = 0; p < pixels; ++p) acc[size_t(p)] += v * to_accum(xrow[p]);
      }
      T* yrow = y + (b * w.rows + r) * pixels;
      for (int64_t p = 0; p < pixels; ++p) {
        const accum_t<T> a = acc[size_t(p)];
        yrow[p] = from_accum<T>(apply_activation(bias ? a + to_accum(bias[r]) : a, act));
      }
    }
  }
  return Status::Ok();
}

#define SNACK_INSTANTIATE_CPU_SPMM(T, Index)                                                                 \
  template Status spmm_forward<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, const T*, T*,   \
                                         Activation);                                                            \
  template Status spmm_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*);          \
  template Status spmm_channels_first<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, int64_t,  \
                                                const T*, T*, Activation);

SNACK_INSTANTIATE_CPU_SPMM(float, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(float, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(double, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(double, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(bfloat16, int32_t)
SNACK_INSTANTIATE_CPU_SPMM(float16, uint16_t)
SNACK_INSTANTIATE_CPU_SPMM(float16, int32_t)

}  // namespace snack::cpu
