// Scratch memory of the CUDA topology functions: one stream-ordered buffer from a DeviceAllocator.
#pragma once

#include <cstdint>
#include <string>

#include "snack/status.h"
#include "snack/topology.h"

namespace snack::cuda::detail {

// CUB wants its temporary storage aligned; scratch layouts leave this much slack for it.
constexpr size_t kAlign = 256;
// `bytes` rounded up to kAlign: the size of one region of a scratch layout.
inline size_t aligned_bytes(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
inline void* align_up(void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<void*>((v + kAlign - 1) / kAlign * kAlign);
}

// Scratch memory from a DeviceAllocator, returned when it goes out of scope (stream-ordered).
class ScratchBuffer {
 public:
  ScratchBuffer(DeviceAllocator& alloc, Stream stream) : alloc_(alloc), stream_(stream) {}
  ~ScratchBuffer() {
    if (ptr_) alloc_.deallocate(ptr_, stream_);
  }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  Status reserve(size_t bytes) {
    if (ptr_) alloc_.deallocate(ptr_, stream_);
    ptr_ = bytes ? alloc_.allocate(bytes, stream_) : nullptr;
    if (bytes && !ptr_)
      return Status(StatusCode::kCudaError, "out of device memory for " + std::to_string(bytes) + " scratch bytes");
    return Status::Ok();
  }
  template <typename U>
  U* as() const { return static_cast<U*>(ptr_); }

 private:
  DeviceAllocator& alloc_;
  Stream stream_;
  void* ptr_ = nullptr;
};

}  // namespace snack::cuda::detail
