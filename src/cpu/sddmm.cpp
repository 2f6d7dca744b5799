// The CPU backend of the weight and bias gradients and of AdamW's update. The SDDMM reads dY and X
// in tiles (snack/batch_tiles.h) and sums each slot in a fixed order: deterministic, whatever the
// split of the slots over threads. The 16-bit types accumulate in float and round once per output.
#include <string>
#include <vector>

#include "../common/checks.h"
#include "snack/sddmm.h"
#include "snack/value_types.h"
#include "loops.h"
#include "tiled.h"

namespace snack::cpu {
namespace {
using detail::check_op;
using detail::required_if;
using tiled::check_range;
using tiled::with_tile_width;
}  // namespace

template <typename T, typename Index>
Status sddmm_slots(const SlotPattern<Index>& w, const BatchTiles<accum_t<T>>& dy, const BatchTiles<accum_t<T>>& x,
                   T* dvalues, int64_t slot_begin, int64_t slot_end) {
  SNACK_RETURN_IF_ERROR(check_op(w, x.n, required_if(w.nnz > 0, dvalues), {}));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(dy, w.rows, "dy"));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(x, w.cols, "x"));
  if (dy.n != x.n)
    return InvalidArgument("dy has " + std::to_string(dy.n) + " batch rows and x " + std::to_string(x.n));
  SNACK_RETURN_IF_ERROR(check_range(slot_begin, slot_end, w.nnz, "slots"));
  std::vector<accum_t<T>> sums(size_t(slot_end - slot_begin), accum_t<T>(0));
  return with_tile_width(x.width, [&](auto width) {
    with_loops([&](auto loops) {
      loops.template sddmm_tiles<decltype(width)::value, T>(w, dy, x, slot_begin, slot_end, sums.data());
    });
    for (int64_t s = slot_begin; s < slot_end; ++s) dvalues[s] = from_accum<T>(sums[size_t(s - slot_begin)]);
    return Status::Ok();
  });
}

template <typename T, typename Index>
Status sddmm(const SlotPattern<Index>& w, const T* dy, const T* x, int64_t n, T* dvalues) {
  SNACK_RETURN_IF_ERROR(check_op(w, n, required_if(w.nnz > 0, dvalues),
                                 {{"dy", required_if(n * w.rows > 0, dy)}, {"x", required_if(n * w.cols > 0, x)}}));
  const int64_t tiles = (n + batch_tile_width(n) - 1) / batch_tile_width(n);
  std::vector<accum_t<T>> dy_tiles(size_t(batch_tiles_numel(n, w.rows))), x_tiles(size_t(batch_tiles_numel(n, w.cols)));
  return sddmm_slots(w, to_batch_tiles(dy, n, w.rows, dy_tiles.data(), 0, tiles),
                     to_batch_tiles(x, n, w.cols, x_tiles.data(), 0, tiles), dvalues, 0, w.nnz);
}

template <typename T, typename Index>
Status gather_rows(const SlotPattern<Index>& w, const T* g, int64_t first, int64_t count, T* dvalues) {
  SNACK_RETURN_IF_ERROR(check_op(w, 0, required_if(w.nnz > 0, dvalues),
                                 {{"g", required_if(count * w.cols > 0, g)}}, PatternNeeds::kForward));
  SNACK_RETURN_IF_ERROR(check_range(first, first + count, w.rows, "rows"));
  for (int64_t r = first; r < first + count; ++r)
    for (int32_t s = w.row_ptr[r]; s < w.row_ptr[r + 1]; ++s) dvalues[s] = g[(r - first) * w.cols + w.col_idx[s]];
  return Status::Ok();
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
  template Status gather_rows<T, Index>(const SlotPattern<Index>&, const T*, int64_t, int64_t, T*);             \
  template Status sddmm_slots<T, Index>(const SlotPattern<Index>&, const BatchTiles<accum_t<T>>&,               \
                                       const BatchTiles<accum_t<T>>&, T*, int64_t, int64_t);

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
