// CUDA construction of slot patterns: validation, row-major sort (CUB radix sort), CSR/CSC views, the
// tile view.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cstdint>
#include <limits>
#include <string>

#include "../common/checks.h"
#include "../device/cuda_utils.cuh"
#include "../device/scratch.cuh"
#include "snack/topology.h"

namespace snack::cuda {
namespace {

using detail::check_launch;
using detail::cuda_status;
using detail::grid_for;
using detail::align_up;
using detail::kAlign;
using detail::ScratchBuffer;

constexpr int kThreads = 256;
constexpr int64_t kNoError = std::numeric_limits<int64_t>::max();
// Error slots hold the smallest offending index; all bits set (the cudaMemset fill) means none.
constexpr unsigned long long kNoErrorBits = ~0ull;

// Number of low bits that hold every value in [0, bound).
int bits_for(int64_t bound) {
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) < bound) ++bits;
  return bits;
}

// first_bad[0] <- smallest i with an out-of-range row or column.
__global__ void coo_keys_kernel(int64_t m, int64_t k, int64_t nnz, const int64_t* __restrict__ rows,
                                const int64_t* __restrict__ cols, int64_t* __restrict__ keys,
                                int64_t* __restrict__ iota, unsigned long long* __restrict__ first_bad) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nnz; i += stride) {
    const int64_t r = rows[i], c = cols[i];
    const bool ok = r >= 0 && r < m && c >= 0 && c < k;
    if (!ok) atomicMin(first_bad, static_cast<unsigned long long>(i));
    keys[i] = ok ? r * k + c : 0;
    iota[i] = i;
  }
}

// first_dup[0] <- smallest sorted position s whose key equals its predecessor's.
template <typename Index>
__global__ void coo_split_kernel(int64_t k, int64_t nnz, const int64_t* __restrict__ sorted_keys,
                                 Index* __restrict__ row_idx, Index* __restrict__ col_idx,
                                 unsigned long long* __restrict__ first_dup) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < nnz; s += stride) {
    const int64_t key = sorted_keys[s];
    if (s > 0 && sorted_keys[s - 1] == key) atomicMin(first_dup, static_cast<unsigned long long>(s));
    row_idx[s] = static_cast<Index>(key / k);
    col_idx[s] = static_cast<Index>(key % k);
  }
}

// ptr[b] = number of entries of `sorted` below b, for b in [0, bins]: CSR/CSC offsets of a sorted
// index array, by binary search, so empty leading or trailing bins need no special case.
template <typename Index>
__global__ void offsets_kernel(int64_t bins, int64_t count, const Index* __restrict__ sorted,
                               int32_t* __restrict__ ptr) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b <= bins; b += stride) {
    int64_t lo = 0, hi = count;
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (int64_t(sorted[mid]) < b) lo = mid + 1; else hi = mid;
    }
    ptr[b] = static_cast<int32_t>(lo);
  }
}

__global__ void iota32_kernel(int64_t count, int32_t* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    out[i] = static_cast<int32_t>(i);
}

template <typename T, typename Key>
__global__ void magnitude_keys_kernel(int64_t total, const T* __restrict__ dense, Key* __restrict__ keys,
                                      int64_t* __restrict__ iota, unsigned long long* __restrict__ first_bad) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const T v = dense[i];
    if (!isfinite(v)) atomicMin(first_bad, static_cast<unsigned long long>(i));
    keys[i] = static_cast<Key>(fabs(v));
    iota[i] = i;
  }
}

// Reads back an error slot written by a validation kernel; the only host synchronisation here.
Status read_error_slot(const unsigned long long* device_slot, Stream stream, int64_t* value) {
  unsigned long long host = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, device_slot, sizeof(host), cudaMemcpyDeviceToHost, stream));
  SNACK_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  *value = host == kNoErrorBits ? kNoError : static_cast<int64_t>(host);
  return Status::Ok();
}

Status init_error_slots(unsigned long long* slots, int count, Stream stream) {
  SNACK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(slots, 0xff, count * sizeof(unsigned long long), stream));
  return Status::Ok();
}

int64_t read_element(const int64_t* device_array, int64_t i, Stream stream) {
  int64_t v = 0;
  if (cudaMemcpyAsync(&v, device_array + i, sizeof(v), cudaMemcpyDeviceToHost, stream) == cudaSuccess)
    (void)cudaStreamSynchronize(stream);
  return v;
}

class CudaMallocAsyncAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream stream) override {
    void* p = nullptr;
    return cudaMallocAsync(&p, bytes, stream) == cudaSuccess ? p : nullptr;
  }
  void deallocate(void* ptr, Stream stream) override { (void)cudaFreeAsync(ptr, stream); }
};

}  // namespace

DeviceAllocator& default_device_allocator() {
  static CudaMallocAsyncAllocator allocator;
  return allocator;
}

template <typename Index>
Status slots_from_coo(int64_t m, int64_t k, int64_t nnz, const int64_t* rows, const int64_t* cols, Index* row_idx,
                      Index* col_idx, int64_t* order, DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (nnz == 0) return Status::Ok();
  if (!rows || !cols || !row_idx || !col_idx || !order) return InvalidArgument("slots_from_coo: null array");

  // Layout: keys_in, keys_out, iota [nnz] int64 each, the error slots, then CUB's temporary storage.
  size_t cub_bytes = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (int64_t*)nullptr, (int64_t*)nullptr,
                                                             (int64_t*)nullptr, (int64_t*)nullptr, nnz, 0,
                                                             bits_for(m * k), stream));
  const size_t array_bytes = size_t(nnz) * sizeof(int64_t);
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(3 * array_bytes + 2 * sizeof(unsigned long long) + cub_bytes + kAlign));
  int64_t* keys_in = scratch.as<int64_t>();
  int64_t* keys_out = keys_in + nnz;
  int64_t* iota = keys_out + nnz;
  auto* error_slots = reinterpret_cast<unsigned long long*>(iota + nnz);
  void* cub_temp = align_up(error_slots + 2);

  SNACK_RETURN_IF_ERROR(init_error_slots(error_slots, 2, stream));
  coo_keys_kernel<<<grid_for(nnz, kThreads), kThreads, 0, stream>>>(m, k, nnz, rows, cols, keys_in, iota,
                                                                     error_slots);
  SNACK_RETURN_IF_ERROR(check_launch("coo_keys_kernel"));
  int64_t first_bad = kNoError;
  SNACK_RETURN_IF_ERROR(read_error_slot(error_slots, stream, &first_bad));
  if (first_bad != kNoError) {
    const int64_t r = read_element(rows, first_bad, stream), c = read_element(cols, first_bad, stream);
    const bool row_bad = r < 0 || r >= m;
    return Status(StatusCode::kOutOfRange,
                  std::string(row_bad ? "rows[" : "cols[") + std::to_string(first_bad) + "]=" +
                      std::to_string(row_bad ? r : c) + " is outside [0, " + std::to_string(row_bad ? m : k) + ")");
  }
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, keys_in, keys_out, iota, order, nnz,
                                                             0, bits_for(m * k), stream));
  // The split writes the outputs; on a duplicate they hold a sorted but invalid pattern, and the
  // caller discards them (the torch binding allocates fresh outputs for every call).
  coo_split_kernel<Index><<<grid_for(nnz, kThreads), kThreads, 0, stream>>>(k, nnz, keys_out, row_idx, col_idx,
                                                                            error_slots + 1);
  SNACK_RETURN_IF_ERROR(check_launch("coo_split_kernel"));
  int64_t first_dup = kNoError;
  SNACK_RETURN_IF_ERROR(read_error_slot(error_slots + 1, stream, &first_dup));
  if (first_dup != kNoError) {
    const int64_t key = read_element(keys_out, first_dup, stream);
    const int64_t a = read_element(order, first_dup - 1, stream), b = read_element(order, first_dup, stream);
    return Status(StatusCode::kDuplicateEntry, "position (" + std::to_string(key / k) + ", " + std::to_string(key % k) +
                                                   ") appears more than once (elements " + std::to_string(a) +
                                                   " and " + std::to_string(b) + ")");
  }
  return Status::Ok();
}

template <typename Index>
Status build_views(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx, int32_t* row_ptr,
                   int32_t* col_ptr, int32_t* csc_perm, DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (!row_ptr || !col_ptr) return InvalidArgument("build_views: row_ptr and col_ptr must not be null");
  if (nnz > 0 && (!row_idx || !col_idx || !csc_perm)) return InvalidArgument("build_views: null array");

  offsets_kernel<Index><<<grid_for(m + 1, kThreads), kThreads, 0, stream>>>(m, nnz, row_idx, row_ptr);
  SNACK_RETURN_IF_ERROR(check_launch("offsets_kernel(rows)"));
  if (nnz == 0) {
    offsets_kernel<Index><<<grid_for(k + 1, kThreads), kThreads, 0, stream>>>(k, 0, col_idx, col_ptr);
    return check_launch("offsets_kernel(cols)");
  }
  // A stable radix sort of the slots by column keeps row-major order inside each column.
  const int col_bits = bits_for(k);
  size_t cub_bytes = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, (const Index*)nullptr,
                                                             (Index*)nullptr, (const int32_t*)nullptr,
                                                             (int32_t*)nullptr, nnz, 0, col_bits, stream));
  const size_t index_bytes = detail::aligned_bytes(size_t(nnz) * sizeof(Index));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(scratch.reserve(index_bytes + size_t(nnz) * sizeof(int32_t) + cub_bytes + kAlign));
  Index* sorted_cols = scratch.as<Index>();
  int32_t* iota = reinterpret_cast<int32_t*>(scratch.as<char>() + index_bytes);
  void* cub_temp = align_up(iota + nnz);
  iota32_kernel<<<grid_for(nnz, kThreads), kThreads, 0, stream>>>(nnz, iota);
  SNACK_RETURN_IF_ERROR(check_launch("iota32_kernel"));
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, col_idx, sorted_cols, iota,
                                                             csc_perm, nnz, 0, col_bits, stream));
  offsets_kernel<Index><<<grid_for(k + 1, kThreads), kThreads, 0, stream>>>(k, nnz, sorted_cols, col_ptr);
  return check_launch("offsets_kernel(cols)");
}

namespace {

constexpr int kTileViewThreads = 1024;
constexpr int kTileViewSlotsPerThread = 4;  // consecutive slots per thread and pass: their loads issued together

// The tile view of band blockIdx.x (kTileViewRows rows; see snack/pattern.h). Shared memory holds,
// per (row of the band, chunk), first the row's slot count in that chunk, then (a scan down each
// chunk) how many of the tile's entries come before the row's, and finally the offset that takes
// a slot of that run to its entry: entry = base + run + (slot - band's first slot). The order inside
// a tile is row-major and every entry has one writer: deterministic, no atomics on global memory.
template <typename Index>
__global__ void __launch_bounds__(kTileViewThreads)
    tile_view_kernel(int64_t m, int64_t chunks, int64_t nnz, const Index* __restrict__ row_idx,
                     const Index* __restrict__ col_idx, const int32_t* __restrict__ row_ptr,
                     int32_t* __restrict__ tile_ptr, uint32_t* __restrict__ tile_entries) {
  extern __shared__ int32_t run[];  // [kTileViewRows][chunks], then the tiles' starts [chunks]
  int32_t* tile_start = run + kTileViewRows * chunks;
  const int64_t band = blockIdx.x, r0 = band * kTileViewRows;
  const int64_t r1 = r0 + kTileViewRows < m ? r0 + kTileViewRows : m;
  const int32_t first = row_ptr[r0], last = row_ptr[r1];
  for (int64_t i = threadIdx.x; i < kTileViewRows * chunks; i += blockDim.x) run[i] = 0;
  __syncthreads();
  // Slots are trusted, not checked (as build_views): one outside the band or the columns is skipped,
  // so that nothing is written out of bounds whatever the slots hold.
  const auto cell_of = [&](int32_t s) -> int64_t {
    const int64_t r = int64_t(row_idx[s]) - r0, c = int64_t(col_idx[s]) / kTileViewCols;
    return r >= 0 && r < kTileViewRows && c >= 0 && c < chunks ? r * chunks + c : -1;
  };
  // Each pass walks the band's slots kTileViewSlotsPerThread at a time per thread, the cells of a
  // group found before any is used, so that a thread waits for its loads once per group.
  constexpr int G = kTileViewSlotsPerThread;
  const auto cells_of = [&](int32_t s0, int64_t (&cells)[G]) {
#pragma unroll
    for (int j = 0; j < G; ++j) cells[j] = s0 + j < last ? cell_of(s0 + j) : -1;
  };
  const int32_t group_stride = G * int32_t(blockDim.x);
  for (int32_t s0 = first + G * int32_t(threadIdx.x); s0 < last; s0 += group_stride) {
    int64_t cells[G];
    cells_of(s0, cells);
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (cells[j] >= 0) atomicAdd(&run[cells[j]], 1);
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    int32_t before = 0;
    for (int64_t r = 0; r < kTileViewRows; ++r) {
      const int32_t count = run[r * chunks + c];
      run[r * chunks + c] = before;
      before += count;
    }
    tile_start[c] = before;  // the tile's size, until the scan below
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t at = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t size = tile_start[c];
      tile_start[c] = at;
      at += size;
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) tile_ptr[band * chunks + c] = first + tile_start[c];
  if (band == gridDim.x - 1 && threadIdx.x == 0) tile_ptr[int64_t(gridDim.x) * chunks] = int32_t(nnz);
  // The first slot of each run (row, chunk) turns its cell into the run's offset.
  for (int32_t s0 = first + G * int32_t(threadIdx.x); s0 < last; s0 += group_stride) {
    int64_t cells[G];
    cells_of(s0, cells);
    int64_t previous = s0 == first ? -1 : cell_of(s0 - 1);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t cell = cells[j];
      if (cell >= 0 && cell != previous) run[cell] = tile_start[cell % chunks] + run[cell] - (s0 + j - first);
      previous = cell;
    }
  }
  __syncthreads();
  for (int32_t s0 = first + G * int32_t(threadIdx.x); s0 < last; s0 += group_stride) {
    int64_t cells[G];
    cells_of(s0, cells);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int32_t s = s0 + j;
      const int64_t entry = cells[j] < 0 ? -1 : int64_t(first) + run[cells[j]] + (s - first);
      if (entry < 0 || entry >= nnz) continue;
      const int64_t col = int64_t(col_idx[s]) % kTileViewCols;
      tile_entries[entry] =
          uint32_t(s - first) << kTileViewSlotShift | uint32_t((cells[j] / chunks) * kTileViewCols + col);
    }
  }
  const int64_t padded = (nnz + 3) / 4 * 4;
  if (band == gridDim.x - 1)
    for (int64_t e = nnz + threadIdx.x; e < padded; e += blockDim.x) tile_entries[e] = 0;
}

constexpr int kPackThreads = 256;

// Band blockIdx.x's entries with their slots' values (snack/pattern.h, packed tile values): each
// thread reads consecutive entries, so the entries and the packed words move coalesced and the
// values come from the band's own slots. An entry whose slot lies outside the band (a view that is
// not the pattern's) packs a zero value, so nothing is read out of bounds.
__global__ void __launch_bounds__(kPackThreads)
    pack_tile_values_kernel(int64_t m, int64_t nnz, const int32_t* __restrict__ row_ptr,
                            const uint32_t* __restrict__ tile_entries, const uint16_t* __restrict__ value_bits,
                            uint32_t* __restrict__ packed) {
  const int64_t r0 = int64_t(blockIdx.x) * kTileViewRows;
  const int64_t r1 = r0 + kTileViewRows < m ? r0 + kTileViewRows : m;
  const int32_t first = row_ptr[r0], last = row_ptr[r1];
  for (int64_t e = first + int64_t(threadIdx.x); e < last && e < nnz; e += kPackThreads) {
    const uint32_t entry = tile_entries[e];
    const int64_t slot = int64_t(first) + (entry >> kTileViewSlotShift);
    packed[e] = packed_tile_entry(entry, slot < last ? value_bits[slot] : uint16_t(0));
  }
  const int64_t padded = (nnz + 3) / 4 * 4;
  if (blockIdx.x == gridDim.x - 1)
    for (int64_t e = nnz + threadIdx.x; e < padded; e += kPackThreads) packed[e] = 0;
}

// Tile fragments (snack/pattern.h), a block per tile: every tile of every band packs at once, its
// first word following from the tile view (tile_fragment_start), so no tile waits for the others.
// (A block per band walking its tiles in turn left most SMs idle: 12 blocks for a 768x3072 layer.)
// The block ORs each entry's value into its register and the register's bit into its owner's mask
// in shared memory (the two values of a register may come from two threads). Each thread loads
// kFragmentPackBatch entries, then their values, before it ORs any: with one entry and then its value
// in flight per thread the packing was bound by memory latency (~1 TB/s). Thread t, owner of
// (group, lane) t, then writes its header word and moves its stored registers to the offset a block
// scan gives it, so that the block stores the tile's words in order, coalesced, with zeros up to the
// next tile's first (the band's end after its last tile, the layout's after the last band's): every
// word of the layout is written. Transposed (W^T's fragments), the block swaps each entry's row and
// column and writes its tile's pair and header at W^T's tile index.
constexpr int kFragmentPackThreads = int(kFragmentHeaderWords);
constexpr int kFragmentPackBatch = 8;  // 1024 entries a round: a tile at 75% sparsity in one
__global__ void __launch_bounds__(kFragmentPackThreads)
    pack_tile_fragments_kernel(int64_t m, int64_t chunks, const int32_t* __restrict__ row_ptr,
                               const int32_t* __restrict__ tile_ptr, const uint32_t* __restrict__ tile_entries,
                               const uint16_t* __restrict__ value_bits, int32_t* __restrict__ fragments,
                               FragmentLayout layout, bool transposed) {
  using Scan = cub::BlockScan<int, kFragmentPackThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ alignas(16) uint32_t regs[kFragmentHeaderWords * kFragmentRegisters];
  __shared__ uint32_t masks[kFragmentHeaderWords];
  const int t = int(threadIdx.x);
  const int64_t tile = blockIdx.x, band = tile / chunks, chunk = tile % chunks;
  const int64_t index = transposed ? transposed_fragment_tile(band, chunk, layout.tiles / chunks) : tile;
  const int64_t r1 = (band + 1) * kTileViewRows < m ? (band + 1) * kTileViewRows : m;
  const int32_t first = row_ptr[band * kTileViewRows], last = row_ptr[r1];
  const int32_t e0 = tile_ptr[tile], e1 = tile_ptr[tile + 1];
  for (int i = t; i < kFragmentHeaderWords * kFragmentRegisters; i += kFragmentPackThreads) regs[i] = 0;
  masks[t] = 0;
  __syncthreads();
  for (int32_t base = e0 + t; base < e1; base += kFragmentPackThreads * kFragmentPackBatch) {
    uint32_t entries[kFragmentPackBatch], bits[kFragmentPackBatch];
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      const int32_t e = base + i * kFragmentPackThreads;
      entries[i] = e < e1 ? tile_entries[e] : 0u;
    }
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      const int64_t slot = int64_t(first) + (entries[i] >> kTileViewSlotShift);
      // a foreign view reads nothing out of bounds
      bits[i] = base + i * kFragmentPackThreads < e1 && slot < last ? value_bits[slot] : 0u;
    }
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      if (base + i * kFragmentPackThreads >= e1) break;
      const FragmentPlace f = entry_fragment_place(entries[i], transposed);
      const int owner = fragment_owner(f);
      atomicOr(&regs[owner * kFragmentRegisters + f.reg], bits[i] << (16 * f.half));
      atomicOr(&masks[owner], 1u << f.reg);
    }
  }
  __syncthreads();
  const uint32_t mask = masks[t];
  uint32_t mine[kFragmentRegisters];
#pragma unroll
  for (int q = 0; q < kFragmentRegisters / 4; ++q) {
    const uint4 v = reinterpret_cast<const uint4*>(regs)[t * (kFragmentRegisters / 4) + q];
    mine[4 * q] = v.x, mine[4 * q + 1] = v.y, mine[4 * q + 2] = v.z, mine[4 * q + 3] = v.w;
  }
  int offset = 0, stored = 0;
  Scan(scan).ExclusiveSum(__popc(mask), offset, stored);
  const int64_t at = tile_fragment_start(band, chunk, chunks, first, e0);
  const int32_t words = (stored + 3) / 4 * 4;
  fragments[layout.headers + kFragmentHeaderWords * index + t] = int32_t(mask | uint32_t(offset) << 16);
  __syncthreads();  // every thread has its registers before any is overwritten
#pragma unroll
  for (int r = 0, k = offset; r < kFragmentRegisters; ++r)
    if (mask >> r & 1u) regs[k++] = mine[r];
  __syncthreads();
  int32_t* out = fragments + layout.values + at;
  const int64_t next = chunk + 1 < chunks ? tile_fragment_start(band, chunk + 1, chunks, first, e1)
                       : r1 < m           ? tile_fragment_start(band + 1, 0, chunks, last, last)
                                          : layout.words - layout.values;
  for (int64_t w = t; w < next - at; w += kFragmentPackThreads) out[w] = w < stored ? int32_t(regs[w]) : 0;
  if (t == 0) {
    fragments[2 * index] = stored > 0 ? int32_t(at) : 0;
    fragments[2 * index + 1] = words;
  }
  if (tile == 0)  // the pairs' padding
    for (int64_t w = 2 * layout.tiles + t; w < layout.headers; w += kFragmentPackThreads) fragments[w] = 0;
}

// Bitmap fragments (snack/pattern.h), as pack_tile_fragments_kernel packs the tile fragments: a block
// per tile, thread t the owner of mask word t (the low or high half of 8 x 8 block t / 2). The
// entries' values go into their places in shared memory and their bits into the mask words; each
// owner then takes its 32 places into registers and, at the offset a block scan gives it, writes its
// stored values back in order, so that the block stores the tile's words coalesced, zeros up to the
// next tile's first.
constexpr int kBitmapPackThreads = 2 * kBitmapBlocks;
static_assert(kBitmapPackThreads == kFragmentPackThreads, "a thread per mask word");
__global__ void __launch_bounds__(kBitmapPackThreads)
    pack_tile_bitmaps_kernel(int64_t m, int64_t chunks, const int32_t* __restrict__ row_ptr,
                             const int32_t* __restrict__ tile_ptr, const uint32_t* __restrict__ tile_entries,
                             const uint16_t* __restrict__ value_bits, int32_t* __restrict__ bitmaps,
                             FragmentLayout layout, bool transposed) {
  constexpr int kWordValues = 32;
  using Scan = cub::BlockScan<int, kBitmapPackThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ alignas(16) uint16_t halves[kBitmapPackThreads * kWordValues];
  __shared__ uint32_t masks[kBitmapPackThreads];
  const int t = int(threadIdx.x);
  const int64_t tile = blockIdx.x, band = tile / chunks, chunk = tile % chunks;
  const int64_t index = transposed ? transposed_fragment_tile(band, chunk, layout.tiles / chunks) : tile;
  const int64_t r1 = (band + 1) * kTileViewRows < m ? (band + 1) * kTileViewRows : m;
  const int32_t first = row_ptr[band * kTileViewRows], last = row_ptr[r1];
  const int32_t e0 = tile_ptr[tile], e1 = tile_ptr[tile + 1];
  masks[t] = 0;  // the places are read only where a mask bit says a value was written
  __syncthreads();
  for (int32_t base = e0 + t; base < e1; base += kBitmapPackThreads * kFragmentPackBatch) {
    uint32_t entries[kFragmentPackBatch];
    uint16_t bits[kFragmentPackBatch];
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      const int32_t e = base + i * kBitmapPackThreads;
      entries[i] = e < e1 ? tile_entries[e] : 0u;
    }
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      const int64_t slot = int64_t(first) + (entries[i] >> kTileViewSlotShift);
      bits[i] = base + i * kBitmapPackThreads < e1 && slot < last ? value_bits[slot] : uint16_t(0);
    }
#pragma unroll
    for (int i = 0; i < kFragmentPackBatch; ++i) {
      if (base + i * kBitmapPackThreads >= e1) break;
      const BitmapPlace place = bitmap_place(entry_fragment_place(entries[i], transposed));
      halves[place.block * 64 + place.bit] = bits[i];  // mask word 2 block + bit / 32, its bit % 32
      atomicOr(&masks[2 * place.block + place.bit / kWordValues], 1u << (place.bit % kWordValues));
    }
  }
  __syncthreads();
  const uint32_t mask = masks[t];
  uint16_t mine[kWordValues];
#pragma unroll
  for (int b = 0; b < kWordValues; ++b) mine[b] = halves[t * kWordValues + b];
  int offset = 0, stored = 0;
  Scan(scan).ExclusiveSum(__popc(mask), offset, stored);
  const int64_t at = tile_bitmap_start(band, chunk, chunks, first, e0);
  const int32_t words = (stored + 7) / 8 * 4;
  int32_t* header = bitmaps + layout.headers + kBitmapHeaderWords * index;
  header[t] = int32_t(mask);
  if (t % 8 == 0) header[kBitmapPackThreads + t / 8] = offset;  // a 16 x 16 operand: four blocks, 8 words
  __syncthreads();  // every thread has its places before any is overwritten
#pragma unroll
  for (int b = 0, k = offset; b < kWordValues; ++b)
    if (mask >> b & 1u) halves[k++] = mine[b];
  __syncthreads();
  const uint32_t* packed = reinterpret_cast<const uint32_t*>(halves);
  int32_t* out = bitmaps + layout.values + at;
  const int64_t next = chunk + 1 < chunks ? tile_bitmap_start(band, chunk + 1, chunks, first, e1)
                       : r1 < m           ? tile_bitmap_start(band + 1, 0, chunks, last, last)
                                          : layout.words - layout.values;
  for (int64_t w = t; w < next - at; w += kBitmapPackThreads) {
    // a stored count that is odd leaves the last word's high half to zero
    const uint32_t word = 2 * w + 1 < stored ? packed[w] : 2 * w < stored ? uint32_t(halves[2 * w]) : 0u;
    out[w] = int32_t(word);
  }
  if (t == 0) {
    bitmaps[2 * index] = stored > 0 ? int32_t(at) : 0;
    bitmaps[2 * index + 1] = words;
  }
  if (tile == 0)  // the pairs' padding
    for (int64_t w = 2 * layout.tiles + t; w < layout.headers; w += kBitmapPackThreads) bitmaps[w] = 0;
}

}  // namespace

Status pack_tile_values(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const uint32_t* tile_entries,
                        const uint16_t* value_bits, uint32_t* packed, Stream stream) {
  SNACK_RETURN_IF_ERROR(
      snack::detail::check_pack_tile_values(m, k, nnz, row_ptr, tile_entries, value_bits, packed));
  pack_tile_values_kernel<<<unsigned(tile_view_bands(m)), kPackThreads, 0, stream>>>(m, nnz, row_ptr, tile_entries,
                                                                                      value_bits, packed);
  return check_launch("pack_tile_values_kernel");
}

Status pack_tile_fragments(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                           const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* fragments,
                           Stream stream, bool transposed) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_pack_tile_fragments(m, k, nnz, row_ptr, tile_ptr, tile_entries,
                                                                 value_bits, fragments));
  const FragmentLayout layout = tile_fragment_layout(m, k, nnz);
  if (layout.tiles == 0) return Status::Ok();
  pack_tile_fragments_kernel<<<unsigned(layout.tiles), kFragmentPackThreads, 0, stream>>>(
      m, tile_view_chunks(k), row_ptr, tile_ptr, tile_entries, value_bits, fragments, layout, transposed);
  return check_launch("pack_tile_fragments_kernel");
}

Status pack_tile_bitmaps(int64_t m, int64_t k, int64_t nnz, const int32_t* row_ptr, const int32_t* tile_ptr,
                         const uint32_t* tile_entries, const uint16_t* value_bits, int32_t* bitmaps, Stream stream,
                         bool transposed) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_pack_tile_fragments(m, k, nnz, row_ptr, tile_ptr, tile_entries,
                                                                 value_bits, bitmaps, "pack_tile_bitmaps"));
  const FragmentLayout layout = tile_bitmap_layout(m, k, nnz);
  if (layout.tiles == 0) return Status::Ok();
  pack_tile_bitmaps_kernel<<<unsigned(layout.tiles), kBitmapPackThreads, 0, stream>>>(
      m, tile_view_chunks(k), row_ptr, tile_ptr, tile_entries, value_bits, bitmaps, layout, transposed);
  return check_launch("pack_tile_bitmaps_kernel");
}

template <typename Index>
Status build_tile_view(int64_t m, int64_t k, int64_t nnz, const Index* row_idx, const Index* col_idx,
                       const int32_t* row_ptr, int32_t* tile_ptr, uint32_t* tile_entries, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_dims_fit<Index>(m, k, nnz));
  if (tile_view_ptr_length(m, k) == 0) return Status::Ok();
  if (!row_ptr || !tile_ptr) return InvalidArgument("build_tile_view: row_ptr and tile_ptr must not be null");
  if (nnz > 0 && (!row_idx || !col_idx || !tile_entries)) return InvalidArgument("build_tile_view: null array");
  const int64_t bands = tile_view_bands(m), chunks = tile_view_chunks(k);
  const size_t smem = sizeof(int32_t) * size_t(kTileViewRows + 1) * size_t(chunks);
  auto kernel = tile_view_kernel<Index>;
  SNACK_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<unsigned(bands), kTileViewThreads, smem, stream>>>(m, chunks, nnz, row_idx, col_idx, row_ptr, tile_ptr,
                                                             tile_entries);
  return check_launch("tile_view_kernel");
}

template <typename T>
Status dense_topk_positions(int64_t m, int64_t k, const T* dense, int64_t count, int64_t* positions,
                            DeviceAllocator& alloc, Stream stream) {
  SNACK_RETURN_IF_ERROR(snack::detail::check_topk(m, k, count, dense, positions));
  if (count == 0) return Status::Ok();
  const int64_t total = m * k;

  // Sort all magnitudes descending (radix sort is stable: equal magnitudes keep ascending
  // positions), keep the first `count` positions, then sort those ascending.
  size_t sort_bytes = 0, resort_bytes = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(
      nullptr, sort_bytes, (const T*)nullptr, (T*)nullptr, (const int64_t*)nullptr, (int64_t*)nullptr, total, 0,
      int(sizeof(T) * 8), stream));
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortKeys(nullptr, resort_bytes, (const int64_t*)nullptr,
                                                            (int64_t*)nullptr, count, 0, bits_for(total), stream));
  const size_t cub_bytes = sort_bytes > resort_bytes ? sort_bytes : resort_bytes;
  const size_t key_bytes = detail::aligned_bytes(size_t(total) * sizeof(T));
  ScratchBuffer scratch(alloc, stream);
  SNACK_RETURN_IF_ERROR(
      scratch.reserve(2 * key_bytes + 2 * size_t(total) * sizeof(int64_t) + sizeof(unsigned long long) + cub_bytes + kAlign));
  T* keys_in = scratch.as<T>();
  T* keys_out = reinterpret_cast<T*>(scratch.as<char>() + key_bytes);
  int64_t* iota = reinterpret_cast<int64_t*>(scratch.as<char>() + 2 * key_bytes);
  int64_t* order = iota + total;
  auto* error_slot = reinterpret_cast<unsigned long long*>(order + total);
  void* cub_temp = align_up(error_slot + 1);

  SNACK_RETURN_IF_ERROR(init_error_slots(error_slot, 1, stream));
  magnitude_keys_kernel<T, T><<<grid_for(total, kThreads), kThreads, 0, stream>>>(total, dense, keys_in, iota,
                                                                                 error_slot);
  SNACK_RETURN_IF_ERROR(check_launch("magnitude_keys_kernel"));
  int64_t first_bad = kNoError;
  SNACK_RETURN_IF_ERROR(read_error_slot(error_slot, stream, &first_bad));
  if (first_bad != kNoError)
    return InvalidArgument("dense weight has a non-finite entry at (" + std::to_string(first_bad / k) + ", " +
                           std::to_string(first_bad % k) + ")");
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(cub_temp, sort_bytes, keys_in, keys_out, iota,
                                                                       order, total, 0, int(sizeof(T) * 8), stream));
  SNACK_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortKeys(cub_temp, resort_bytes, order, positions, count, 0, bits_for(total), stream));
  return Status::Ok();
}

template Status slots_from_coo<uint16_t>(int64_t, int64_t, int64_t, const int64_t*, const int64_t*, uint16_t*,
                                         uint16_t*, int64_t*, DeviceAllocator&, Stream);
template Status slots_from_coo<int32_t>(int64_t, int64_t, int64_t, const int64_t*, const int64_t*, int32_t*, int32_t*,
                                        int64_t*, DeviceAllocator&, Stream);
template Status build_views<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int32_t*,
                                      int32_t*, int32_t*, DeviceAllocator&, Stream);
template Status build_views<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, int32_t*, int32_t*,
                                     int32_t*, DeviceAllocator&, Stream);
template Status build_tile_view<uint16_t>(int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, const int32_t*,
                                          int32_t*, uint32_t*, Stream);
template Status build_tile_view<int32_t>(int64_t, int64_t, int64_t, const int32_t*, const int32_t*, const int32_t*,
                                         int32_t*, uint32_t*, Stream);
template Status dense_topk_positions<float>(int64_t, int64_t, const float*, int64_t, int64_t*, DeviceAllocator&,
                                            Stream);
template Status dense_topk_positions<double>(int64_t, int64_t, const double*, int64_t, int64_t*, DeviceAllocator&,
                                             Stream);

}  // namespace snack::cuda
