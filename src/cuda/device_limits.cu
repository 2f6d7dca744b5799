// Per-device limits the launchers size their grids and shared memory by.
#include <cuda_runtime.h>

#include <mutex>

#include "cuda_utils.cuh"

namespace snack::cuda::detail {

Status device_limits(DeviceLimits* out) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static DeviceLimits cache[kMaxDevices];
  int dev = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  DeviceLimits fresh;
  std::lock_guard<std::mutex> lock(mutex);
  DeviceLimits& l = dev < kMaxDevices ? cache[dev] : fresh;
  if (l.sms == 0) {
    int sms = 0, per_block = 0, per_sm = 0;
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    l = DeviceLimits{sms, size_t(per_block), size_t(per_sm)};
  }
  *out = l;
  return Status::Ok();
}

}  // namespace snack::cuda::detail
