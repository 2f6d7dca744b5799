// The launchers of the wgmma SpMMs, compiled for sm_90a in their own translation units and called by
// the SpMM products (launch.cu) when their plan says kWgmma: over tile lists sorted from the slots
// (wgmma_kernel.cuh, wgmma.cu), or over the tile fragments the forward is given
// (fragment_wgmma_kernel.cuh, fragment_wgmma.cu).
#pragma once

#include <cstdint>
#include <string>

#include "snack/activation.h"
#include "snack/pattern.h"
#include "snack/spmm.h"
#include "snack/status.h"

namespace snack::cuda::detail {

/// Whether this build holds the wgmma kernel (sm_90a code): the planner offers it only then, and
/// only on a device of compute capability 9.0.
bool wgmma_built();

/// Why a device of this compute capability (major * 10 + minor) cannot run the wgmma kernels: the
/// planner's refusal and the launchers' say the same.
inline std::string wgmma_needs_hopper(int compute_capability) {
  return "wgmma needs a GPU of compute capability 9.0 (Hopper), this one is " +
         std::to_string(compute_capability / 10) + "." + std::to_string(compute_capability % 10);
}

/// Ok where the wgmma kernels run: this build holds them and the current device is of compute
/// capability 9.0; kUnsupported otherwise.
Status check_wgmma_device();

/// Bytes of the workspace launch_spmm_wgmma takes (the tile lists: 4 bytes a slot and small tables).
size_t wgmma_workspace_bytes(int64_t out_dim, int64_t in_dim, int64_t nnz);

/// out[n, o] = act(sum over the view's slots of value * in[n, input] + bias[o]) on the tensor cores:
/// `view` a CsrView (forward) or CscView (transposed product) of 16-bit values with `nnz` slots and
/// out_dim rows; `in` [n][in_dim], in_dim a multiple of 8 and at most 65535, `in` 16-byte aligned
/// (the copy engine's rows); `out` [n][out_dim]; `splits` blocks of a cluster (1-8) share each
/// band's input columns; `workspace` wgmma_workspace_bytes() bytes, 16-byte aligned.
template <typename T, typename View>
Status launch_spmm_wgmma(const View& view, int64_t nnz, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                         const T* bias, T* out, Activation act, int splits, void* workspace, Stream stream);

struct FragmentView;  // fragment_kernel.cuh

/// The forward over tile fragments with wgmma: out[n, o] = act(sum over the slots of value *
/// in[n, input] + bias[o]) for a plan of kWgmma that reads the fragments (batch tiles of 16 to 128
/// rows; plan.k_splits blocks of a cluster per band; plan.smem_bytes of shared memory a block);
/// `view` the fragments' words, `in` [n][in_dim], `out` [n][out_dim]. kUnsupported without sm_90a
/// code or on a device other than compute capability 9.0.
template <typename T>
Status launch_fragments_wgmma(const SpmmPlan& plan, const FragmentView& view, int64_t out_dim, int64_t in_dim,
                              const T* in, int64_t n, const T* bias, T* out, Activation act, Stream stream);

}  // namespace snack::cuda::detail
