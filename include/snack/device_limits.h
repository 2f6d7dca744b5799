// What a GPU offers the kernels' launch shapes: the planners (spmm.h, sddmm.h) take these facts as
// an argument, so a plan is a pure function of the problem and the device, testable on the CPU with
// the limits of any GPU.
#pragma once

#include <cstddef>

#include "snack/status.h"

namespace snack {

struct DeviceLimits {
  int sms = 0;                          ///< streaming multiprocessors
  size_t smem_per_block = 0;            ///< opt-in maximum of dynamic shared memory per block, bytes
  size_t smem_per_sm = 0;               ///< shared memory per SM, bytes
  int max_threads_per_sm = 0;           ///< resident threads per SM
  size_t reserved_smem_per_block = 0;   ///< shared memory the system takes from each resident block, bytes
  int compute_capability = 0;           ///< major * 10 + minor (90 for Hopper); 0 where unknown
  /// The build holds the kernels for Hopper's architecture-specific target (sm_90a: wgmma) and the
  /// device runs them (compute capability 9.0): the planner may choose them.
  bool wgmma = false;

  /// The published limits of some GPUs (CUDA's device attributes on each), for tests and planning
  /// without a device; the Hopper GPUs as a default build (which holds sm_90a code) sees them.
  static constexpr DeviceLimits a100() { return {108, 166912, 167936, 2048, 1024, 80, false}; }
  static constexpr DeviceLimits h100_sxm() { return {132, 232448, 233472, 2048, 1024, 90, true}; }
  static constexpr DeviceLimits h100_pcie() { return {114, 232448, 233472, 2048, 1024, 90, true}; }
  static constexpr DeviceLimits h200() { return {132, 232448, 233472, 2048, 1024, 90, true}; }
  static constexpr DeviceLimits l40s() { return {142, 101376, 102400, 1536, 1024, 89, false}; }
};

namespace cuda {
/// The limits of CUDA device `device`, queried once and cached (the query does not synchronise).
/// A failed query is an error: no plan is made for a device that cannot be asked.
Status device_limits(int device, DeviceLimits* out);
/// The limits of the current device.
Status current_device_limits(DeviceLimits* out);
}  // namespace cuda

}  // namespace snack
