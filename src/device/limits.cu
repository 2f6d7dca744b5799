// The limits of each CUDA device, queried once (cudaDeviceGetAttribute does not synchronise).
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "../spmm/wgmma.h"
#include "cuda_utils.cuh"
#include "snack/device_limits.h"

namespace snack::cuda {

Status device_limits(int device, DeviceLimits* out) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static DeviceLimits cache[kMaxDevices];
  if (device < 0 || device >= kMaxDevices)
    return InvalidArgument("device_limits: device index " + std::to_string(device) + " is outside [0, 64)");
  std::lock_guard<std::mutex> lock(mutex);
  DeviceLimits& l = cache[device];
  if (l.sms == 0) {
    int sms = 0, per_block = 0, per_sm = 0, threads = 0, reserved = 0, major = 0, minor = 0;
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    SNACK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (sms <= 0) return Status(StatusCode::kCudaError, "device_limits: the device reports no multiprocessors");
    const int capability = 10 * major + minor;
    l = DeviceLimits{sms,         size_t(per_block), size_t(per_sm), threads, size_t(reserved),
                     capability, capability == 90 && detail::wgmma_built()};
  }
  *out = l;
  return Status::Ok();
}

Status current_device_limits(DeviceLimits* out) {
  int device = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  return device_limits(device, out);
}

}  // namespace snack::cuda
