// A tiled tensor-core SpMM for 16-bit values, measured and not kept (docs/kernels.md, "Measured and
// not kept"): W cut into tiles of 16 rows x 64 columns whose slots are listed contiguously as 16-bit
// in-tile positions (a view built on the GPU from the CSR view, no host synchronisation), the values
// read in slot order (entry e of a tile row is slot e + delta[row]) by 4-byte cp.async gathers, all of
// a chunk's bytes streamed through a 5-stage shared-memory ring, the tile expanded per warp and
// multiplied by mma.sync. Correct (float64 reference, poisoned output, compute-sanitizer memcheck
// clean; racecheck clean in its first form, with run-time capacities) but slower than the
// tensor_core kernel it was meant to replace.
//
// This file holds the view's builder, the kernel and the benchmark: it checks the product, then times
// the build and the kernel for each cluster split against cuBLAS bf16 (cold L2: a 256 MiB memset
// before each run; CUDA events; median of 20). Not part of the build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Iinclude [-DTILED_CHUNK=128] -o tiled_spmm \
//     bench/micro/tiled_spmm.cu -lcublas
//   ./tiled_spmm M K N density [cap]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/device/device_scan.cuh>
#include <random>
#include <type_traits>
#include <vector>

#include "../../src/device/cuda_utils.cuh"
#include "../../src/device/scratch.cuh"
#include "../../src/spmm/shapes.h"
#include "../../src/spmm/tensor_core_kernel.cuh"
#include "cold_l2_timer.cuh"
#include "snack/pattern.h"
#include "snack/status.h"

namespace snack::cuda::detail {
// ---- the geometry ----
constexpr int kTiledRows = 16;
#ifndef TILED_CHUNK
#define TILED_CHUNK 64
#endif
constexpr int kTiledChunk = TILED_CHUNK;    // 64 or 128 (-DTILED_CHUNK=...)
constexpr int kTiledColBits = kTiledChunk == 64 ? 6 : 7;  // a position is (row in tile) << bits | (column in chunk)
constexpr int kTiledStages = 5;             // chunks in flight in the shared-memory ring
constexpr int kTiledAhead = 2;              // chunks between a chunk's values being requested and used
static_assert(kTiledStages >= 2 * kTiledAhead + 1, "a chunk's positions land before its values are requested");
constexpr int kTiledMaxTile = 64;           // batch rows per block, at most (the ring holds kTiledStages chunks of X)
static_assert((1 << kTiledColBits) == kTiledChunk, "positions address every column of a chunk");

// Tiles of a rows x cols pattern: ceil(rows / 16) bands of ceil(cols / 64) chunks, band-major.
SNACK_HOST_DEVICE constexpr int64_t tiled_chunks(int64_t cols) { return (cols + kTiledChunk - 1) / kTiledChunk; }
SNACK_HOST_DEVICE constexpr int64_t tiled_tiles(int64_t rows, int64_t cols) {
  return (rows + kTiledRows - 1) / kTiledRows * tiled_chunks(cols);
}
// Length of the positions array: nnz rounded up to 16-byte segments, and one segment more (a ring
// stage copies whole segments that cover its tile).
SNACK_HOST_DEVICE constexpr int64_t tiled_positions(int64_t nnz) { return (nnz + 7) / 8 * 8 + 8; }

// Shared memory of one block: the warps' expanded tiles, then per ring stage the chunk of X and,
// per warp, the tile's positions (cap + 16: whole segments), its 16 row offsets and cap values (one
// 32-bit word holding each).
SNACK_HOST_DEVICE constexpr size_t tiled_stage_bytes(int tile, int cap) {
  return sizeof(uint16_t) * size_t(tile) * size_t(tensor_core_stride(kTiledChunk)) +
         size_t(kTcWarps) * (sizeof(uint16_t) * size_t(cap + 16) + sizeof(int32_t) * kTiledRows +
                             sizeof(uint32_t) * size_t(cap));
}
SNACK_HOST_DEVICE constexpr size_t tiled_smem_bytes(int tile, int cap) {
  return sizeof(uint16_t) * size_t(kTcBandRows) * size_t(tensor_core_stride(kTiledChunk)) +
         size_t(kTiledStages) * tiled_stage_bytes(tile, cap);
}

}  // namespace snack::cuda::detail

// ---- the view ----
// The tiled view: W cut into tiles of 16 rows x kTiledChunk columns (band-major: tile t = band *
// chunks + chunk), each tile's slots listed contiguously in row-major order as 16-bit in-tile
// positions. Values are not copied: entry e of row r of tile t is slot e + delta[16 t + r] (a row's
// slots in one tile are consecutive slots).
//
// Built from the CSR view in five steps on the stream, no host synchronisation: each row's first slot
// per chunk (binary search), tile sizes, their exclusive sum (CUB), row offsets, positions.
namespace snack::cuda {
namespace tiled_detail {

constexpr int kThreads = 256;

// start[r * (chunks + 1) + c]: the first slot of row r whose column is >= 64 c (the row's end for c = chunks).
template <typename Index>
__global__ void chunk_starts_kernel(int64_t rows, int64_t chunks, const int32_t* __restrict__ row_ptr,
                                    const Index* __restrict__ col_idx, int32_t* __restrict__ start) {
  const int64_t total = rows * (chunks + 1), stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = i / (chunks + 1), c = i % (chunks + 1);
    int32_t lo = row_ptr[r], hi = row_ptr[r + 1];
    const int64_t key = c * detail::kTiledChunk;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo) / 2;
      if (int64_t(col_idx[mid]) < key) lo = mid + 1; else hi = mid;
    }
    start[i] = lo;
  }
}

// sizes[t] = slots of tile t (t < tiles), sizes[tiles] = 0.
__global__ void tile_sizes_kernel(int64_t rows, int64_t chunks, int64_t tiles, const int32_t* __restrict__ start,
                                  int32_t* __restrict__ sizes) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t <= tiles; t += stride) {
    int32_t size = 0;
    if (t < tiles) {
      const int64_t band = t / chunks, c = t % chunks;
      for (int64_t r = band * detail::kTiledRows; r < min(rows, (band + 1) * detail::kTiledRows); ++r)
        size += start[r * (chunks + 1) + c + 1] - start[r * (chunks + 1) + c];
    }
    sizes[t] = size;
  }
}

// delta[16 t + r] = (first slot of row r in tile t) - (its first entry), 0 for rows past the matrix.
__global__ void row_offsets_kernel(int64_t rows, int64_t chunks, int64_t tiles, const int32_t* __restrict__ start,
                                   const int32_t* __restrict__ tile_ptr, int32_t* __restrict__ delta) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < tiles; t += stride) {
    const int64_t band = t / chunks, c = t % chunks;
    int32_t entry = tile_ptr[t];
    for (int rl = 0; rl < detail::kTiledRows; ++rl) {
      const int64_t r = band * detail::kTiledRows + rl;
      if (r < rows) {
        const int32_t first = start[r * (chunks + 1) + c];
        delta[t * detail::kTiledRows + rl] = first - entry;
        entry += start[r * (chunks + 1) + c + 1] - first;
      } else {
        delta[t * detail::kTiledRows + rl] = 0;
      }
    }
  }
}

// pos[entry of slot s] = (row in tile) << kTiledColBits | (column in chunk); the padding after nnz is zero.
template <typename Index>
__global__ void positions_kernel(int64_t nnz, int64_t padded, int64_t chunks, const Index* __restrict__ row_idx,
                                 const Index* __restrict__ col_idx, const int32_t* __restrict__ delta,
                                 uint16_t* __restrict__ pos) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < padded; s += stride) {
    if (s >= nnz) {
      pos[s] = 0;
      continue;
    }
    const int64_t r = int64_t(row_idx[s]), k = int64_t(col_idx[s]);
    const int64_t t = r / detail::kTiledRows * chunks + k / detail::kTiledChunk;
    const int rl = int(r % detail::kTiledRows);
    pos[s - delta[t * detail::kTiledRows + rl]] =
        uint16_t((rl << detail::kTiledColBits) | int(k % detail::kTiledChunk));
  }
}

}  // namespace tiled_detail

/// Bytes of temporary device memory build_tiled_view needs for a rows x cols pattern.
inline Status tiled_view_temp_bytes(int64_t rows, int64_t cols, size_t* bytes) {
  const int64_t chunks = detail::tiled_chunks(cols), tiles = detail::tiled_tiles(rows, cols);
  size_t cub_bytes = 0;
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(nullptr, cub_bytes, (const int32_t*)nullptr,
                                                           (int32_t*)nullptr, tiles + 1));
  *bytes = detail::aligned_bytes(sizeof(int32_t) * size_t(rows * (chunks + 1))) +
           detail::aligned_bytes(sizeof(int32_t) * size_t(tiles + 1)) + cub_bytes;
  return Status::Ok();
}

/// Builds the tiled view of the pattern w (CSR view and slots on the device) into tile_ptr
/// ([tiled_tiles + 1]), pos ([tiled_positions(nnz)]) and delta ([tiled_tiles * 16]), using `temp`
/// (tiled_view_temp_bytes). Asynchronous on `stream`.
template <typename Index>
Status build_tiled_view(const SlotPattern<Index>& w, int32_t* tile_ptr, uint16_t* pos, int32_t* delta, void* temp,
                        size_t temp_bytes, Stream stream) {
  using namespace tiled_detail;
  const int64_t chunks = detail::tiled_chunks(w.cols), tiles = detail::tiled_tiles(w.rows, w.cols);
  size_t needed = 0;
  SNACK_RETURN_IF_ERROR(tiled_view_temp_bytes(w.rows, w.cols, &needed));
  if (temp_bytes < needed) return InvalidArgument("build_tiled_view: temporary buffer too small");
  char* cursor = static_cast<char*>(temp);
  int32_t* start = reinterpret_cast<int32_t*>(cursor);
  cursor += detail::aligned_bytes(sizeof(int32_t) * size_t(w.rows * (chunks + 1)));
  int32_t* sizes = reinterpret_cast<int32_t*>(cursor);
  cursor += detail::aligned_bytes(sizeof(int32_t) * size_t(tiles + 1));
  size_t cub_bytes = temp_bytes - size_t(cursor - static_cast<char*>(temp));

  chunk_starts_kernel<Index><<<detail::grid_for(w.rows * (chunks + 1), kThreads), kThreads, 0, stream>>>(
      w.rows, chunks, w.row_ptr, w.col_idx, start);
  SNACK_RETURN_IF_ERROR(detail::check_launch("tiled chunk_starts_kernel"));
  tile_sizes_kernel<<<detail::grid_for(tiles + 1, kThreads), kThreads, 0, stream>>>(w.rows, chunks, tiles, start,
                                                                                    sizes);
  SNACK_RETURN_IF_ERROR(detail::check_launch("tiled tile_sizes_kernel"));
  SNACK_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(cursor, cub_bytes, sizes, tile_ptr, tiles + 1, stream));
  if (tiles > 0) {
    row_offsets_kernel<<<detail::grid_for(tiles, kThreads), kThreads, 0, stream>>>(w.rows, chunks, tiles, start,
                                                                                   tile_ptr, delta);
    SNACK_RETURN_IF_ERROR(detail::check_launch("tiled row_offsets_kernel"));
  }
  const int64_t padded = detail::tiled_positions(w.nnz);
  positions_kernel<Index><<<detail::grid_for(padded, kThreads), kThreads, 0, stream>>>(w.nnz, padded, chunks, w.row_idx,
                                                                                       w.col_idx, delta, pos);
  return detail::check_launch("tiled positions_kernel");
}

}  // namespace snack::cuda

// ---- the kernel ----
// The kernel.
//
// A block of 4 warps owns a band of 64 output rows (warp w its tile row of 16) and a range of
// kTiledChunk-column chunks; several blocks of one band (a thread-block cluster) split the chunks when the
// bands alone would leave SMs idle, as in tensor_core_kernel.cuh, summing their partial tiles in rank
// order. Per chunk a warp's slots are one contiguous stretch of the view's positions; its values stay
// in slot order (the layer's own values tensor, no tiled copy), at slot = entry + delta[row], so each
// value is gathered by a 4-byte cp.async of the word that holds it.
//
// The ring of kTiledStages stages, per chunk c of the block:
//   iteration c - S + 1: positions and row offsets of chunk c (16-byte cp.async), its chunk of X;
//   iteration c - A:     values of chunk c (4-byte cp.async per slot, addresses from the landed positions);
//   iteration c:         the warp zeroes its tile, scatters the values, and multiplies the tile by X.
// Each iteration commits one cp.async group per thread, so the wait for iteration c is the same
// count every time; one block barrier per chunk.
namespace snack::cuda::detail {

// The tiled view of a pattern (built by build_tiled_view).
struct TiledView {
  const int32_t* __restrict__ tile_ptr;  // [tiles + 1] first entry of tile t = band * chunks + chunk
  const uint16_t* __restrict__ pos;      // [tiled_positions(nnz)] (row in tile) << kTiledColBits | (column in chunk)
  const int32_t* __restrict__ delta;     // [tiles * 16] slot of entry e of row r of tile t: e + delta[16 t + r]
  int64_t bands = 0;                     // ceil(rows / 16)
  int64_t chunks = 0;                    // ceil(cols / kTiledChunk)
};

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and
// the batch tile of blockIdx.y. CAP: slots of a tile the ring holds (a multiple of 32; the rest of a
// larger tile is read directly). vec: X rows 16-byte aligned.
template <typename T, int NT, int CAP>
__global__ void __launch_bounds__(kTcThreads) spmm_tiled_kernel(TiledView view, const T* __restrict__ values,
                                                                int64_t nnz, int64_t out_dim, int64_t in_dim,
                                                                const T* __restrict__ in, int64_t n,
                                                                const T* __restrict__ bias, T* __restrict__ out,
                                                                Activation act, int splits, bool vec) {
  static_assert(NT % 16 == 0 && NT <= kTiledMaxTile, "batch tiles of 16 to 64 rows");
  static_assert(CAP % 32 == 0, "whole rounds of a warp");
  constexpr int CW = kTiledChunk, S = kTiledStages, A = kTiledAhead;
  constexpr int kStride = tensor_core_stride(CW);
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int32_t first_entry[S][kTcWarps][2];  // each stage's tile: [first, end) of its entries

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t band64 = blockIdx.x / unsigned(splits);
  const int64_t o0 = band64 * kTcBandRows, n0 = int64_t(blockIdx.y) * NT;
  const int64_t band = band64 * kTcWarps + warp;  // the warp's tile row
  const bool has_rows = band < view.bands;
  const int c_begin = int(view.chunks * split / splits), c_end = int(view.chunks * (split + 1) / splits);

  uint16_t* tile = reinterpret_cast<uint16_t*>(smem) + warp * kTiledRows * kStride;
  unsigned char* ring = smem + sizeof(uint16_t) * kTcBandRows * kStride;
  constexpr uint32_t stage_bytes = uint32_t(tiled_stage_bytes(NT, CAP));
  // Stage s: X [NT][kStride], then per warp positions [CAP + 16], row offsets [16], values [CAP].
  auto x_stage = [&](int s) { return reinterpret_cast<uint16_t*>(ring + s * stage_bytes); };
  auto warp_stage = [&](int s) {
    return ring + s * stage_bytes + sizeof(uint16_t) * NT * kStride +
           warp * (sizeof(uint16_t) * (CAP + 16) + sizeof(int32_t) * kTiledRows + sizeof(uint32_t) * CAP);
  };
  auto pos_stage = [&](int s) { return reinterpret_cast<uint16_t*>(warp_stage(s)); };
  auto delta_stage = [&](int s) { return reinterpret_cast<int32_t*>(warp_stage(s) + sizeof(uint16_t) * (CAP + 16)); };
  auto value_stage = [&](int s) {
    return reinterpret_cast<uint32_t*>(warp_stage(s) + sizeof(uint16_t) * (CAP + 16) + sizeof(int32_t) * kTiledRows);
  };
  const int32_t* tile_ptr = view.tile_ptr + (has_rows ? band * view.chunks : 0);

  // Positions, row offsets and X of chunk c into stage s; entries [lo, hi) of the warp's tile.
  auto request_positions = [&](int c, int s, int32_t lo, int32_t hi) {
    stage_input_chunk<T, NT, CW>(x_stage(s), in, n, in_dim, n0, c * CW, vec);
    if (!has_rows) return;
    if (lane == 0) {
      first_entry[s][warp][0] = lo;
      first_entry[s][warp][1] = hi;
    }
    const int32_t seg0 = lo / 8, segments = min((hi + 7) / 8 - seg0, (CAP + 16) / 8);
#pragma unroll
    for (int i = 0; i < (CAP / 8 + 2 + 31) / 32; ++i) {
      const int g = lane + 32 * i;
      if (g < segments) cp_async_16(pos_stage(s) + g * 8, view.pos + (seg0 + g) * 8, 16);
    }
    if (lane < kTiledRows / 4)
      cp_async_16(delta_stage(s) + lane * 4, view.delta + (band * view.chunks + c) * kTiledRows + lane * 4, 16);
  };
  // Values of the chunk in stage s (its positions landed): the 32-bit word holding each slot's value.
  auto request_values = [&](int s) {
    if (!has_rows) return;
    const int32_t lo = first_entry[s][warp][0], count = min(first_entry[s][warp][1] - lo, CAP);
    const uint16_t* pos = pos_stage(s) + lo % 8;
    const int32_t* delta = delta_stage(s);
    uint32_t* words = value_stage(s);
#pragma unroll
    for (int i = 0; i < CAP / 32; ++i) {
      const int j = lane + 32 * i;
      if (j < count) {
        const int32_t slot = lo + j + delta[pos[j] >> kTiledColBits];
        const int32_t even = slot & ~1;
        cp_async_4(words + j, values + even, even + 1 < nnz ? 4 : 2);
      }
    }
  };

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // Prologue: the first S - 1 chunks' positions and X, then the first A chunks' values.
  int32_t next_lo = has_rows && c_begin < c_end ? tile_ptr[c_begin] : 0;
  for (int k = 0; k < S - 1; ++k) {
    const int c = c_begin + k;
    if (c < c_end) {
      const int32_t hi = has_rows ? tile_ptr[c + 1] : 0;
      request_positions(c, k, next_lo, hi);
      next_lo = hi;
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  for (int k = 0; k < A; ++k) {
    if (c_begin + k < c_end) request_values(k);
    cp_async_commit();
  }
  // The upper end of the tile S - 1 chunks ahead, loaded an iteration before its request.
  int32_t next_hi = has_rows && c_begin + S - 1 < c_end ? tile_ptr[c_begin + S] : 0;

  for (int c = c_begin, s = 0; c < c_end; ++c, s = s + 1 == S ? 0 : s + 1) {
    cp_async_wait<A - 1>();  // this chunk's values, and the positions of chunk c + A
    __syncthreads();         // ... from every thread; every warp is done with chunk c - 1's stage
    const int ahead = c + S - 1;
    if (ahead < c_end) {
      request_positions(ahead, s == 0 ? S - 1 : s - 1, next_lo, next_hi);
      next_lo = next_hi;
      if (has_rows && ahead + 1 < c_end) next_hi = tile_ptr[ahead + 2];
    }
    if (c + A < c_end) request_values(s + A < S ? s + A : s + A - S);  // its bounds: written S - A - 1 chunks ago
    cp_async_commit();

    // The warp's tile of chunk c: zero it, scatter its slots, multiply.
    zero_warp_tile<CW>(tile);
    __syncwarp();
    if (has_rows) {
      const int32_t lo = first_entry[s][warp][0], hi = first_entry[s][warp][1];
      const int32_t staged = min(hi - lo, CAP);
      const uint16_t* pos = pos_stage(s) + lo % 8;
      const int32_t* delta = delta_stage(s);
      const uint32_t* words = value_stage(s);
#pragma unroll
      for (int i = 0; i < CAP / 32; ++i) {
        const int j = lane + 32 * i;
        if (j < staged) {
          const uint16_t p = pos[j];
          const int32_t slot = lo + j + delta[p >> kTiledColBits];
          const uint32_t word = words[j];
          tile[(p >> kTiledColBits) * kStride + (p & (CW - 1))] = uint16_t(slot & 1 ? word >> 16 : word & 0xffffu);
        }
      }
      for (int32_t e = lo + CAP + lane; e < hi; e += 32) {  // a tile larger than the ring's stage
        const uint16_t p = view.pos[e];
        const int32_t slot = e + delta[p >> kTiledColBits];
        tile[(p >> kTiledColBits) * kStride + (p & (CW - 1))] = values[slot].bits;
      }
    }
    __syncwarp();
    multiply_chunk<T, NT, CW>(acc, tile, x_stage(s));
  }
  cp_async_wait<0>();  // no copy may land in the partial tile below

  finish_band_tile<T, NT>(acc, reinterpret_cast<float*>(smem), o0, out_dim, n0, n, bias, out, act, split, splits);
}

}  // namespace snack::cuda::detail

// ---- the benchmark ----
using snack::bfloat16;
namespace d = snack::cuda::detail;

static uint16_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bits(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int NT, int CAP>
cudaError_t launch(const d::TiledView& v, const bfloat16* values, int64_t nnz, int64_t m, int64_t k, const bfloat16* x,
                   int64_t n, bfloat16* y, int splits) {
  auto kernel = d::spmm_tiled_kernel<bfloat16, NT, CAP>;
  const size_t smem = d::tiled_smem_bytes(NT, CAP);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned((m + 63) / 64 * splits), unsigned((n + NT - 1) / NT));
  config.blockDim = dim3(d::kTcThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(splits);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = splits > 1 ? 1 : 0;
  const bool vec = k % 8 == 0;
  return cudaLaunchKernelEx(&config, kernel, v, values, nnz, m, k, x, n, (const bfloat16*)nullptr, y,
                            snack::Activation::kNone, splits, vec);
}

cudaError_t launch_any(int nt, const d::TiledView& v, const bfloat16* values, int64_t nnz, int64_t m, int64_t k,
                       const bfloat16* x, int64_t n, bfloat16* y, int splits, int cap) {
  auto with_cap = [&](auto nt_tag) {
    constexpr int NT = decltype(nt_tag)::value;
    if (cap <= 128) return launch<NT, 128>(v, values, nnz, m, k, x, n, y, splits);
    if (cap <= 256) return launch<NT, 256>(v, values, nnz, m, k, x, n, y, splits);
    return launch<NT, 512>(v, values, nnz, m, k, x, n, y, splits);
  };
  if (nt == 16) return with_cap(std::integral_constant<int, 16>{});
  if (nt == 32) return with_cap(std::integral_constant<int, 32>{});
  return with_cap(std::integral_constant<int, 64>{});
}

int main(int argc, char** argv) {
  const int64_t m = std::atol(argv[1]), k = std::atol(argv[2]), n = std::atol(argv[3]);
  const double density = std::atof(argv[4]);
  const int cap_arg = argc > 5 ? std::atoi(argv[5]) : 0;
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::bernoulli_distribution keep(density);
  std::vector<uint16_t> row_idx, col_idx;
  std::vector<int32_t> row_ptr(m + 1, 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c)
      if (keep(rng)) {
        row_idx.push_back(uint16_t(r));
        col_idx.push_back(uint16_t(c));
      }
    row_ptr[r + 1] = int32_t(row_idx.size());
  }
  const int64_t nnz = int64_t(row_idx.size());
  std::vector<uint16_t> values(nnz), xs(n * k), dense(m * k, 0);
  for (auto& v : values) v = to_bits(uni(rng));
  for (auto& v : xs) v = to_bits(uni(rng));
  for (int64_t r = 0; r < m; ++r)
    for (int32_t e = row_ptr[r]; e < row_ptr[r + 1]; ++e) dense[r * k + col_idx[e]] = values[e];

  uint16_t *d_row, *d_col, *d_val, *d_x, *d_y, *d_dense, *d_yd, *d_pos;
  int32_t *d_rp, *d_tp, *d_delta;
  const int64_t tiles = d::tiled_tiles(m, k);
  CHECK(cudaMalloc(&d_row, 2 * nnz + 16));
  CHECK(cudaMalloc(&d_col, 2 * nnz + 16));
  CHECK(cudaMalloc(&d_val, 2 * nnz + 16));
  CHECK(cudaMalloc(&d_x, 2 * n * k));
  CHECK(cudaMalloc(&d_y, 2 * n * m));
  CHECK(cudaMalloc(&d_yd, 2 * n * m));
  CHECK(cudaMalloc(&d_dense, 2 * m * k));
  CHECK(cudaMalloc(&d_rp, 4 * (m + 1)));
  CHECK(cudaMalloc(&d_tp, 4 * (tiles + 1)));
  CHECK(cudaMalloc(&d_delta, 4 * tiles * 16));
  CHECK(cudaMalloc(&d_pos, 2 * d::tiled_positions(nnz)));
  CHECK(cudaMemcpy(d_row, row_idx.data(), 2 * nnz, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_col, col_idx.data(), 2 * nnz, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_val, values.data(), 2 * nnz, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_x, xs.data(), 2 * n * k, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_dense, dense.data(), 2 * m * k, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_rp, row_ptr.data(), 4 * (m + 1), cudaMemcpyHostToDevice));
  snack::SlotPattern<uint16_t> w;
  w.rows = m; w.cols = k; w.nnz = nnz; w.row_idx = d_row; w.col_idx = d_col; w.row_ptr = d_rp;
  size_t temp_bytes = 0;
  if (!snack::cuda::tiled_view_temp_bytes(m, k, &temp_bytes).ok()) return 1;
  void* temp;
  CHECK(cudaMalloc(&temp, temp_bytes));
  // One warm-up call, median of 20; no hold after the flush.
  ColdL2Timer timer;
  auto timed = [&](auto&& fn) { return timer.median_us(fn, 20, 1, 0); };
  const float build_us = timed([&] {
    auto st = snack::cuda::build_tiled_view(w, d_tp, d_pos, d_delta, temp, temp_bytes, nullptr);
    if (!st.ok()) { std::printf("build: %s\n", st.message().c_str()); std::exit(1); }
  });
  d::TiledView v;
  v.tile_ptr = d_tp; v.pos = d_pos; v.delta = d_delta; v.bands = (m + 15) / 16; v.chunks = d::tiled_chunks(k);

  // float64 reference and the error bound: 2^-8 of sum |w x| (bf16 output rounding) per output
  std::vector<double> ref(n * m), mag(n * m);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t r = 0; r < m; ++r) {
      double s = 0, a = 0;
      for (int32_t e = row_ptr[r]; e < row_ptr[r + 1]; ++e) {
        const double t = double(from_bits(values[e])) * double(from_bits(xs[b * k + col_idx[e]]));
        s += t;
        a += std::fabs(t);
      }
      ref[b * m + r] = s;
      mag[b * m + r] = a;
    }
  const int nt = n <= 16 ? 16 : n <= 32 ? 32 : 64;
  const double tile_mean = density * 16 * d::kTiledChunk;
  const double want = cap_arg > 0 ? cap_arg : tile_mean * 1.2 + 16;
  const int cap = want <= 128 ? 128 : want <= 256 ? 256 : 512;
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1.f, beta = 0.f;
  const float dense_us = timed([&] {
    cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(m), int(n), int(k), &alpha, d_dense, CUDA_R_16BF, int(k), d_x,
                 CUDA_R_16BF, int(k), &beta, d_yd, CUDA_R_16BF, int(m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  const double bytes = 4.0 * nnz + 4.0 * tiles * 16 + 2.0 * n * (k + m);
  std::printf("chunk=%d M=%ld K=%ld N=%ld density=%.3f nnz=%ld cap=%d tile=%d build=%.1f us dense=%.1f us "
              "floor=%.1f us\n",
              d::kTiledChunk, long(m), long(k), long(n), density, long(nnz), cap, nt, build_us, dense_us,
              bytes / 3.3e6);
  for (int splits : {1, 2, 4, 8}) {
    if (d::tiled_chunks(k) < splits) continue;
    CHECK(cudaMemset(d_y, 0xff, 2 * n * m));  // poisoned: every output must be written
    CHECK(launch_any(nt, v, reinterpret_cast<bfloat16*>(d_val), nnz, m, k, reinterpret_cast<bfloat16*>(d_x), n,
                     reinterpret_cast<bfloat16*>(d_y), splits, cap));
    CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> y(n * m);
    CHECK(cudaMemcpy(y.data(), d_y, 2 * n * m, cudaMemcpyDeviceToHost));
    double worst = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < n * m; ++i) {
      const double err = std::fabs(double(from_bits(y[i])) - ref[i]) / (mag[i] * 0.0079 + 1e-6);
      if (!(err <= 1.0)) ++bad;
      worst = std::max(worst, std::isnan(err) ? 1e9 : err);
    }
    const float us = timed([&] {
      launch_any(nt, v, reinterpret_cast<bfloat16*>(d_val), nnz, m, k, reinterpret_cast<bfloat16*>(d_x), n,
                 reinterpret_cast<bfloat16*>(d_y), splits, cap);
    });
    std::printf("  splits=%d  %.1f us  %.2fx dense  %.0f%% floor  err/bound=%.3f bad=%ld\n", splits, us, dense_us / us,
                100.0 * bytes / 3.3e6 / us, worst, long(bad));
  }
  return 0;
}
