// The CUDA plans of the binding: each device's limits, queried once, and the planners' results
// cached per (device, problem), so the hot path neither plans nor formats text.
#pragma once

#include <type_traits>

#include "snack/device_limits.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"

#include "op_args.h"

namespace snack::binding {

/// The limits of CUDA device `device`, queried once; a failed query raises.
DeviceLimits cuda_device_limits(int device);

/// Whether torch lets float32 matmuls round to TF32 (torch.backends.cuda.matmul.allow_tf32).
bool tf32_matmuls();

/// A product (SpmmProblem or SddmmProblem) as the binding runs it: with its GEMM for kDenseBlocks
/// (cuBLAS through ATen), float32 GEMMs in TF32 where torch allows them, a transposed SpMM
/// reading the CSC view as the process asks (set_default_csc_read), told whether its pattern
/// holds the tile view (`tile_view`), and the tile view's blocks per band and the wgmma kernels'
/// warpgroups per block (the forward over fragments, the tile-view SDDMM) the process asks
/// (set_default_tile_view_splits, set_default_fragment_warpgroups). A 16-bit product over the view
/// can have tile fragments packed for it where its plan asks (the CUDA forward packs W's, dX W^T's).
template <typename Problem>
Problem binding_problem(Problem p, bool tile_view) {
  p.gemm = true;
  p.tf32 = p.value_bytes == 4 && tf32_matmuls();
  if constexpr (std::is_same_v<Problem, SpmmProblem>) {
    if (p.transposed) p.csc = default_csc_read();
    p.can_pack_fragments = p.value_bytes == 2 && tile_view;
  }
  p.tile_view = tile_view;
  p.tile_view_splits = default_tile_view_splits();
  if constexpr (std::is_same_v<Problem, SpmmProblem>) {
    p.fragment_warpgroups = default_fragment_warpgroups();
  } else {
    p.warpgroups = default_fragment_warpgroups();
  }
  return p;
}

/// The plan of a product on CUDA device `device`. A forced variant that cannot run it raises
/// ValueError naming `op`.
SpmmPlan spmm_plan(const SpmmProblem& problem, int device, const char* op);
SddmmPlan sddmm_plan(const SddmmProblem& problem, int device, const char* op);

}  // namespace snack::binding
