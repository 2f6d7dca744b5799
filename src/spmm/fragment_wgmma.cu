// The launcher of the forward over tile fragments with wgmma (fragment_wgmma_kernel.cuh). Built for
// sm_90a only (CMakeLists.txt); without that target the kernel traps and the launcher refuses it.
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "../device/cuda_utils.cuh"
#include "fragment_wgmma_kernel.cuh"
#include "wgmma.h"

namespace snack::cuda::detail {

namespace {

template <typename T, int NT, bool kBitmaps>
Status launch_format(const SpmmPlan& plan, const FragmentView& view, int64_t out_dim, int64_t in_dim, const T* in,
                     int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  static_assert(kFragmentWgmmaMaxGroups == 2, "the counts below");
  if (plan.consumer_warpgroups == 2)
    return launch_fragment_kernel<NT>(spmm_fragment_wgmma_kernel<T, NT, 2, kBitmaps>, "spmm_fragment_wgmma_kernel",
                                      plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
  return launch_fragment_kernel<NT>(spmm_fragment_wgmma_kernel<T, NT, 1, kBitmaps>, "spmm_fragment_wgmma_kernel",
                                    plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
}

template <typename T, int NT>
Status launch_tile(const SpmmPlan& plan, const FragmentView& view, int64_t out_dim, int64_t in_dim, const T* in,
                   int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  if (view.bitmaps) return launch_format<T, NT, true>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
  return launch_format<T, NT, false>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
}

}  // namespace

template <typename T>
Status launch_fragments_wgmma(const SpmmPlan& plan, const FragmentView& view, int64_t out_dim, int64_t in_dim,
                              const T* in, int64_t n, const T* bias, T* out, Activation act, Stream stream) {
  SNACK_RETURN_IF_ERROR(check_wgmma_device());
  if (plan.consumer_warpgroups < 1 || plan.consumer_warpgroups > kFragmentWgmmaMaxGroups)
    return InvalidArgument("wgmma over tile fragments: " + std::to_string(plan.consumer_warpgroups) +
                           " consumer warpgroups a block (1 or 2)");
  switch (plan.batch_tile) {
    case 16: return launch_tile<T, 16>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    case 32: return launch_tile<T, 32>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    case 64: return launch_tile<T, 64>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    case 128: return launch_tile<T, 128>(plan, view, out_dim, in_dim, in, n, bias, out, act, stream);
    default:
      return InvalidArgument("wgmma over tile fragments: unsupported batch tile " + std::to_string(plan.batch_tile));
  }
}

template Status launch_fragments_wgmma<bfloat16>(const SpmmPlan&, const FragmentView&, int64_t, int64_t,
                                                 const bfloat16*, int64_t, const bfloat16*, bfloat16*, Activation,
                                                 Stream);
template Status launch_fragments_wgmma<float16>(const SpmmPlan&, const FragmentView&, int64_t, int64_t,
                                                const float16*, int64_t, const float16*, float16*, Activation, Stream);

}  // namespace snack::cuda::detail
