// replace_slots (free slots and refill them with new positions: the new sorted slots and the
// permutation per-slot tensors follow), gather_slots (a per-slot tensor following it) and the
// bitmap of a pattern's positions they are built on. None synchronises with the host.
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/scratch.cuh"
#include "bitmap.cuh"
#include "snack/device_limits.h"
#include "snack/dst.h"

namespace snack::cuda {
namespace {

using namespace detail;

// Out-of-range entries (possible only from an unvalidated caller) are ignored: never a stray write.
__global__ void mark_positions_kernel(int64_t count, const int64_t* __restrict__ positions, int64_t total,
                                      uint32_t* __restrict__ bitmap) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t p = positions[i];
    if (p >= 0 && p < total) set_bit(bitmap, p);
  }
}

__global__ void flag_kernel(int64_t count, const int64_t* __restrict__ slots, int64_t nnz,
                            uint8_t* __restrict__ flags) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t s = slots[i];
    if (s >= 0 && s < nnz) flags[s] = 1;
  }
}

// ---- replace_slots -------------------------------------------------------------------------------
// Every set bit of the new bitmap becomes a slot, in position order: slot = offsets[w] + rank in
// word. A word spans at most a few rows, so the row is found once per word, not by a division per bit.
template <typename Index>
__global__ void slots_from_bitmap_kernel(int64_t k, int64_t nnz, int64_t words, const uint32_t* __restrict__ bitmap,
                                         const int64_t* __restrict__ offsets, Index* __restrict__ row_idx,
                                         Index* __restrict__ col_idx) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    uint32_t bits = bitmap[w];
    if (!bits) continue;
    int64_t slot = offsets[w];
    const int64_t first = w * 32;
    int64_t row = first / k;
    int64_t row_start = row * k;
    // slot < nnz: more set bits than slots only come from unvalidated input (repeated drops).
    while (bits && slot < nnz) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      const int64_t p = first + b;
      while (p >= row_start + k) {
        ++row;
        row_start += k;
      }
      row_idx[slot] = Index(row);
      col_idx[slot] = Index(p - row_start);
      ++slot;
    }
  }
}

// source[new slot of s] = s for every kept slot s (the grown slots keep the -1 fill).
template <typename Index>
__global__ void kept_sources_kernel(int64_t k, int64_t nnz, const Index* __restrict__ row_idx,
                                    const Index* __restrict__ col_idx, const uint8_t* __restrict__ dropped,
                                    const uint32_t* __restrict__ bitmap, const int64_t* __restrict__ offsets,
                                    int64_t* __restrict__ source) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    if (dropped[s]) continue;
    const int64_t slot = bit_rank(bitmap, offsets, int64_t(row_idx[s]) * k + int64_t(col_idx[s]));
    if (slot < nnz) source[slot] = s;  // always true for validated input
  }
}

// ---- following the permutation ---------------------------------------------------------------------
template <typename T>
__global__ void gather_slots_kernel(int64_t nnz, const T* __restrict__ in, const int64_t* __restrict__ source,
                                    const T* __restrict__ fill, bool fill_per_slot, T* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    const int64_t from = source[s];
    // Out-of-range entries (never from replace_slots) take the fill rather than read out of bounds.
    out[s] = (from >= 0 && from < nnz) ? in[from] : fill[fill_per_slot ? s : 0];
  }
}

}  // namespace

int64_t bitmap_words(int64_t m, int64_t k) { return detail::ceil_div(m * k, 32); }

// Up to 64 bytes of bitmap per slot plus 64 MiB: sparser or larger matrices take paths whose
// memory follows nnz.
bool bitmap_affordable(int64_t m, int64_t k, int64_t nnz) {
  const int64_t total = m * k;
  return total < (int64_t{1} << 40) && total / 8 <= 64 * nnz + (int64_t{64} << 20);
}

template <typename Index>
Status replace_slots(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, int64_t count,
                     const int64_t* drop, const int64_t* grow, Index* new_row_idx, Index* new_col_idx, int64_t* source,
                     DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (count < 0 || count > nnz) return InvalidArgument("replace_slots: count must lie in [0, nnz]");
  if (nnz == 0) return Status::Ok();
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  const int64_t words = bitmap_words(m, k);
  size_t cub_bytes = 0;
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{nullptr}, words, nullptr, nullptr, &cub_bytes, stream));
  const size_t bitmap_bytes = aligned_bytes(size_t(words) * sizeof(uint32_t));
  const size_t offset_bytes = aligned_bytes(size_t(words) * sizeof(int64_t));
  const size_t flag_bytes = aligned_bytes(size_t(nnz));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(bitmap_bytes + offset_bytes + flag_bytes + cub_bytes + kAlign));
  auto* bitmap = scratch.as<uint32_t>();
  auto* offsets = reinterpret_cast<int64_t*>(scratch.as<char>() + bitmap_bytes);
  auto* dropped = reinterpret_cast<uint8_t*>(scratch.as<char>() + bitmap_bytes + offset_bytes);
  void* cub_temp = align_up(dropped + flag_bytes);

  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bitmap, 0, size_t(words) * sizeof(uint32_t), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dropped, 0, size_t(nnz), stream));
  if (count > 0) {
    flag_kernel<<<stride_grid(count, limits), kDstThreads, 0, stream>>>(count, drop, nnz, dropped);
    SNACK_RETURN_IF_ERROR(check_launch("flag_kernel"));
  }
  mark_slots_kernel<Index><<<stride_grid(nnz, limits), kDstThreads, 0, stream>>>(
      k, nnz, row_idx, col_idx, dropped, bitmap);
  SNACK_RETURN_IF_ERROR(check_launch("mark_slots_kernel"));
  if (count > 0) {
    mark_positions_kernel<<<stride_grid(count, limits), kDstThreads, 0, stream>>>(count, grow, m * k, bitmap);
    SNACK_RETURN_IF_ERROR(check_launch("mark_positions_kernel"));
  }
  SNACK_RETURN_IF_ERROR(scan_word_counts(WordPopcount{bitmap}, words, offsets, cub_temp, &cub_bytes, stream));
  // Zeros where an unvalidated grow left slots unfilled (a grown position that was kept): in range.
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(new_row_idx, 0, size_t(nnz) * sizeof(Index), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(new_col_idx, 0, size_t(nnz) * sizeof(Index), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(source, 0xff, size_t(nnz) * sizeof(int64_t), stream));  // -1
  slots_from_bitmap_kernel<Index><<<stride_grid(words, limits), kDstThreads, 0, stream>>>(
      k, nnz, words, bitmap, offsets, new_row_idx, new_col_idx);
  SNACK_RETURN_IF_ERROR(check_launch("slots_from_bitmap_kernel"));
  kept_sources_kernel<Index><<<stride_grid(nnz, limits), kDstThreads, 0, stream>>>(
      k, nnz, row_idx, col_idx, dropped, bitmap, offsets, source);
  return check_launch("kept_sources_kernel");
}

template <typename T>
Status gather_slots(int64_t nnz, const T* in, const int64_t* source, const T* fill, bool fill_per_slot, T* out,
                    Stream stream) {
  if (nnz == 0) return Status::Ok();
  if (!in || !source || !fill || !out) return InvalidArgument("gather_slots: null array");
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  gather_slots_kernel<T><<<stride_grid(nnz, limits), kDstThreads, 0, stream>>>(
      nnz, in, source, fill, fill_per_slot, out);
  return check_launch("gather_slots_kernel");
}

template Status gather_slots<float>(int64_t, const float*, const int64_t*, const float*, bool, float*, Stream);
template Status gather_slots<double>(int64_t, const double*, const int64_t*, const double*, bool, double*, Stream);

template <typename Index>
Status mark_present(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, uint32_t* bitmap,
                    Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  DeviceLimits limits;
  SNACK_RETURN_IF_ERROR(current_device_limits(&limits));
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bitmap, 0, size_t(bitmap_words(m, k)) * sizeof(uint32_t), stream));
  if (nnz == 0) return Status::Ok();
  mark_slots_kernel<Index><<<stride_grid(nnz, limits), kDstThreads, 0, stream>>>(
      k, nnz, row_idx, col_idx, nullptr, bitmap);
  return check_launch("mark_slots_kernel");
}

template Status replace_slots<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t,
                                        const int64_t*, const int64_t*, uint16_t*, uint16_t*, int64_t*,
                                        DeviceAllocator&, Stream);
template Status replace_slots<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, int64_t,
                                       const int64_t*, const int64_t*, int32_t*, int32_t*, int64_t*, DeviceAllocator&,
                                       Stream);
template Status mark_present<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, uint32_t*, Stream);
template Status mark_present<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, uint32_t*, Stream);

}  // namespace snack::cuda
