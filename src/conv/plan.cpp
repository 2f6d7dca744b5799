// How the fused depthwise-separable kernel tiles a shape (snack/conv.h): host code, so that the CPU
// build and its tests see the same plan as the GPU.
#include <algorithm>

#include "../common/grid.h"
#include "separable.h"
#include "snack/conv.h"

namespace snack {

SeparableConvPlan plan_separable_conv(const SeparableConvShape& s, int value_bytes, const DeviceLimits& limits) {
  SeparableConvPlan plan;
  if ((value_bytes != 2 && value_bytes != 4) || s.channels <= 0 || (s.stride != 1 && s.stride != 2)) return plan;
  // channels_last: the depthwise phase loads 16-byte vectors of channels.
  if (s.channels_last && s.channels % (16 / value_bytes) != 0) return plan;
  const int64_t pixels = s.out_height() * s.out_width();
  const size_t budget = limits.smem_per_block;  // the opt-in maximum a block may take
  const auto blocks = [&](int ppl) { return s.batch * detail::ceil_div(pixels, 32 * int64_t(ppl)); };
  // The widest tile whose pixels still give every SM a block; else the narrowest that fits.
  int chosen = 0;
  for (int ppl : {4, 2, 1}) {
    if (detail::separable_smem_bytes(s.channels, ppl, s.channels_last) > budget) continue;
    chosen = ppl;
    if (blocks(ppl) >= limits.sms) break;
  }
  if (chosen == 0 || blocks(chosen) > (int64_t(1) << 31) - 1) return plan;
  plan.pixels_per_lane = chosen;
  plan.tiles_per_image = detail::ceil_div(pixels, 32 * int64_t(chosen));
  // Output channels split over the grid's y until two blocks a SM run, in whole chunks.
  const int64_t chunks = std::max<int64_t>(1, detail::ceil_div(s.out_channels, int64_t(detail::kSeparableOutputChunk)));
  const int64_t wanted = detail::ceil_div(2 * int64_t(std::max(limits.sms, 1)), std::max<int64_t>(1, blocks(chosen)));
  const int64_t groups = std::clamp<int64_t>(wanted, 1, std::min<int64_t>(chunks, detail::kMaxGridY));
  plan.group_rows = detail::ceil_div(chunks, groups) * int64_t(detail::kSeparableOutputChunk);
  plan.groups = std::max<int64_t>(1, detail::ceil_div(s.out_channels, plan.group_rows));
  plan.smem_bytes = detail::separable_smem_bytes(s.channels, chosen, s.channels_last);
  plan.fits = true;
  return plan;
}

}  // namespace snack
