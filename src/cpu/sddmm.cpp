// CPU reference and backend of the weight and bias gradients and of AdamW's update. Plain loops in a
// fixed order: deterministic; the 16-bit types accumulate in float and round once per output.
#include <vector>

#include "../common/checks.h"
#include "snack/sddmm.h"
#include "snack/value_types.h"

namespace snack::cpu {
namespace {
using detail::check_op;
using detail::required_if;
}  // namespace

template <typename T, typename Index>
Status sddmm_on_transposed(const SlotPattern<Index>& w, const T* dy_t, const T* x_t, int64_t n, T* dvalues) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, required_if(w.nnz > 0, dvalues),
                                 {{"dy_t", required_if(n * w.rows > 0, dy_t)},
                                  {"x_t", required_if(n * w.cols > 0, x_t)}}));
  for (int64_t s = 0; s < w.nnz; ++s) {
    const T* a = dy_t + int64_t(w.row_idx[s]) * n;
    const T* b = x_t + int64_t(w.col_idx[s]) * n;
    accum_t<T> acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += to_accum(a[i]) * to_accum(b[i]);
    dvalues[s] = from_accum<T>(acc);
  }
  return Status::Ok();
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues) {
  if (n <= 1) return sddmm_on_transposed(w, dy, x, n, dvalues);  // one row is its own transpose
  SNACK_RETURN_IF_ERROR(check_op(w, n, required_if(w.nnz > 0, dvalues),
                                 {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  std::vector<T> dy_t(size_t(w.rows) * n), x_t(size_t(w.cols) * n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < w.rows; ++r) dy_t[r * n + i] = dy[i * w.rows + r];
    for (int64_t c = 0; c < w.cols; ++c) x_t[c * n + i] = x[i * w.cols + c];
  }
  return sddmm_on_transposed(w, dy_t.data(), x_t.data(), n, dvalues);
}

template <typename T>
Status bias_grad(const T* dy, int64_t n, int64_t m, T* dbias) {
  if (n < 0 || m < 0) return InvalidArgument("bias_grad: sizes must be non-negative");
  if (n * m > 0 && dy == nullptr) return InvalidArgument("dy must not be null");
  if (m > 0 && dbias == nullptr) return InvalidArgument("dbias must not be null");
  std::vector<accum_t<T>> acc(size_t(m), accum_t<T>(0));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < m; ++r) acc[r] += to_accum(dy[i * m + r]);
  for (int64_t r = 0; r < m; ++r) dbias[r] = from_accum<T>(acc[r]);
  return Status::Ok();
}

template <typename T>
Status adamw_update(const T* grad, int64_t count, double step, const AdamWConfig& config, T* values, T* exp_avg,
                    T* exp_avg_sq) {
  if (count < 0) return InvalidArgument("adamw_update: count must be non-negative");
  if (count > 0 && (!grad || !values || !exp_avg || !exp_avg_sq))
    return InvalidArgument("adamw_update: grad, values, exp_avg and exp_avg_sq must not be null");
  if (!(step >= 1)) return InvalidArgument("adamw_update: step must be at least 1, got " + std::to_string(step));
  using A = accum_t<T>;
  const AdamWStep<A> constants = AdamWStep<A>::make(config, A(step));
  for (int64_t s = 0; s < count; ++s) constants.apply_stored(grad[s], values[s], exp_avg[s], exp_avg_sq[s]);
  return Status::Ok();
}

#define SNACK_INSTANTIATE_CPU_SDDMM(T, Index)                                                                  \
  template Status sddmm<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*);                \
  template Status sddmm_on_transposed<T, Index>(const SlotPattern<Index>&, const T*, const T*, int64_t, T*);

SNACK_INSTANTIATE_CPU_SDDMM(float, uint16_t)
SNACK_INSTANTIATE_CPU_SDDMM(float, int32_t)
SNACK_INSTANTIATE_CPU_SDDMM(double, uint16_t)
SNACK_INSTANTIATE_CPU_SDDMM(double, int32_t)
SNACK_INSTANTIATE_CPU_SDDMM(bfloat16, uint16_t)
SNACK_INSTANTIATE_CPU_SDDMM(bfloat16, int32_t)
SNACK_INSTANTIATE_CPU_SDDMM(float16, uint16_t)
SNACK_INSTANTIATE_CPU_SDDMM(float16, int32_t)
template Status bias_grad<float>(const float*, int64_t, int64_t, float*);
template Status bias_grad<double>(const double*, int64_t, int64_t, double*);
template Status bias_grad<bfloat16>(const bfloat16*, int64_t, int64_t, bfloat16*);
template Status bias_grad<float16>(const float16*, int64_t, int64_t, float16*);
template Status adamw_update<float>(const float*, int64_t, double, const AdamWConfig&, float*, float*, float*);
template Status adamw_update<double>(const double*, int64_t, double, const AdamWConfig&, double*, double*, double*);
template Status adamw_update<bfloat16>(const bfloat16*, int64_t, double, const AdamWConfig&, bfloat16*, bfloat16*,
                                       bfloat16*);
template Status adamw_update<float16>(const float16*, int64_t, double, const AdamWConfig&, float16*, float16*,
                                      float16*);

}  // namespace snack::cpu
