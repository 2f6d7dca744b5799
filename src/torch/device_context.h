// The binding's CUDA context for the core functions: PyTorch's current stream and caching allocator
// (defined in kernels.cpp).
#pragma once

#include "snack/status.h"
#include "snack/topology.h"

namespace snack::binding {

/// Scratch memory for the core's CUDA functions from PyTorch's caching allocator (a CPU-only build
/// gets an allocator that returns nullptr; its CUDA branches are never taken).
DeviceAllocator& torch_allocator();

#ifdef SNACK_WITH_CUDA
/// PyTorch's current CUDA stream on the current device.
Stream current_stream();
#endif

}  // namespace snack::binding
