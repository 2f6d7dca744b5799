// What the CUDA implementations hand the core: PyTorch's current stream and its caching allocator
// (defined in ops_cuda.cpp; CUDA builds only).
#pragma once

#include "snack/topology.h"

namespace snack::binding {

/// Scratch memory for the core's CUDA functions from PyTorch's caching allocator.
DeviceAllocator& torch_cuda_allocator();
/// PyTorch's current CUDA stream on the current device.
Stream current_stream();

}  // namespace snack::binding
