// The SpMM for large batches on CUDA cores: X staged in shared memory and shared by a band of rows.
//
// The row kernels read X (or its transposed copy) through L1 once per stored entry; at a batch of
// hundreds of rows that stream no longer fits L1 and runs from L2, whose bandwidth bounds them
// (~5 useful TFLOP/s in fp32 on the H200). Here a block owns a band of shared_x_band_rows output rows
// and one batch tile of kVecs 16-byte vectors per lane (shared_x_tile rows; the plan's batch tile),
// walks the input columns in chunks, and copies each chunk of the transposed input [chunk][tile]
// into shared memory once (cp.async, double-buffered); every row of the band then reads its entries'
// inputs there. L2 sees X once per band instead of once per entry, and the bound becomes shared
// memory's bandwidth: one 16-byte vector per lane, entry and vector.
//
// Each of its kWarps warps owns R rows and keeps, per row, a window of its next 32 slots: one column
// per lane in a register, and every lane's (byte offset into a staged chunk, value) pair parked in
// the warp's shared-memory buffer. Rows are sorted by column, so a chunk's slots are the window's
// entries between two ballots (columns below the chunk's start: multiplied in earlier chunks; below
// its end: this chunk's), and the warp reads their pairs back two at a time as broadcasts while each
// lane multiplies its batch values. A window is reloaded only once all 32 of its slots are used, so
// a (row, chunk) costs two ballots beside its entries. Every output is summed in slot order:
// deterministic.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "views.cuh"

namespace snack::cuda::detail {

// One 16-byte vector of T at a shared-memory address, widened.
template <typename T>
__device__ __forceinline__ void load_shared_vector(uint32_t address, accum_t<T> (&out)[16 / sizeof(T)]) {
  uint32_t w[4];
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(address));
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = __uint_as_float(w[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) unpack_pair<T>(w[j], out[2 * j], out[2 * j + 1]);
  }
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band blockIdx.x and the batch
// tile blockIdx.y. in_t: the transposed tiles [tiles][in_dim + 1][kTile] written by
// transpose_tile_kernel just before (possibly a programmatic launch: W's slots are read before the
// wait, X^T after it). chunk: input columns per stage (a multiple of 8). The planner guarantees
// in_dim * kTile * sizeof(T) < 2^32 (the parked byte offsets are 32-bit).
template <typename T, typename View, int kWarps, int R, int kVecs>
__global__ void __launch_bounds__(kWarps * 32, 1)
    spmm_shared_x_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in_t, int64_t n,
                         const T* __restrict__ bias, T* __restrict__ out, Activation act, int chunk) {
  using A = accum_t<T>;
  constexpr int V = 16 / int(sizeof(T));  // elements of one 16-byte vector
  constexpr int kLane = V * kVecs;        // batch rows of one lane
  constexpr int kTile = 32 * kLane;
  constexpr int kBand = kWarps * R;
  constexpr int kThreads = kWarps * 32;
  constexpr uint32_t kRowBytes = uint32_t(kTile * sizeof(T));  // one staged input column
  extern __shared__ __align__(16) unsigned char smem[];
  const size_t stage_elems = size_t(chunk) * kTile;
  T* stages = reinterpret_cast<T*>(smem);
  const size_t buffers_at = (kSharedXStages * stage_elems * sizeof(T) > sizeof(float) * kTile * (kBand + 1))
                                ? kSharedXStages * stage_elems * sizeof(T)
                                : sizeof(float) * kTile * (kBand + 1);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // This warp's windows: R x 32 (byte offset of the column in a staged chunk, value bits) pairs.
  int2* windows = reinterpret_cast<int2*>(smem + buffers_at) + warp * R * kSharedXWindow;
  int32_t* row_end = reinterpret_cast<int32_t*>(smem + buffers_at) + 2 * kBand * kSharedXWindow + warp * R;

  const int64_t band0 = int64_t(blockIdx.x) * kBand;
  const int64_t n0 = int64_t(blockIdx.y) * kTile;
  in_t += int64_t(blockIdx.y) * (in_dim + 1) * kTile;
  const int64_t chunks = (in_dim + chunk - 1) / chunk;

  // Parks the window of slots [first + lane] (a row's next 32) and returns this lane's column
  // (INT_MAX past the row's end, so that no ballot counts it).
  auto park_window = [&](int r, int32_t first, int32_t last) {
    const int32_t e = first + lane;
    const bool ok = e < last;
    const int32_t c = ok ? view.input(e) : INT_MAX;
    const float v = ok ? float(to_accum(view.value(e))) : 0.0f;
    windows[r * kSharedXWindow + lane] = make_int2(int(uint32_t(ok ? c : 0) * kRowBytes), __float_as_int(v));
    return c;
  };
  int32_t pos[R], col[R];  // per row: its window's first slot, this lane's column in it
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t o = band0 + warp * R + r;
    pos[r] = o < out_dim ? view.ptr[o] : 0;
    const int32_t last = o < out_dim ? view.ptr[o + 1] : 0;
    if (lane == 0) row_end[r] = last;
    col[r] = park_window(r, pos[r], last);
  }
  __syncwarp();
  A acc[R][kLane];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < kLane; ++j) acc[r][j] = A(0);

  // Chunk c of the transposed tile (rows [c * chunk, ...) of in_t, contiguous) into stage s.
  auto stage_chunk = [&](int64_t c, int s) {
    const int64_t rows = (in_dim - c * chunk) < chunk ? (in_dim - c * chunk) : chunk;
    const int64_t pieces = rows * (kRowBytes / 16);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(in_t + c * chunk * kTile);
    unsigned char* dst = reinterpret_cast<unsigned char*>(stages + s * stage_elems);
    for (int64_t i = threadIdx.x; i < pieces; i += kThreads) cp_async_16(dst + 16 * i, src + 16 * i, 16);
  };

  wait_for_prior_grid();  // in_t is the output of the transpose launched before
  if (chunks > 0) stage_chunk(0, 0);
  cp_async_commit();
  for (int64_t c = 0; c < chunks; ++c) {
    const int s = int(c & 1);
    if (c + 1 < chunks) stage_chunk(c + 1, s ^ 1);  // the other stage was released by the last barrier
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int32_t c0 = int32_t(c * chunk);
    const int32_t c_end = c0 + chunk;
    // Byte address of this lane's first vector of column 0 if it were staged here: a parked offset
    // added to it lands in the stage (unsigned arithmetic, so the wrap below the stage is defined).
    const uint32_t base = shared_address(stages + s * stage_elems) + uint32_t(lane * 16) - uint32_t(c0) * kRowBytes;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      auto multiply = [&](int offset, int bits) {
        const A v = A(__int_as_float(bits));
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          A x[V];
          load_shared_vector<T>(base + uint32_t(offset) + uint32_t(q * 512), x);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[r][q * V + j] = fmaf(v, x[j], acc[r][q * V + j]);
        }
      };
      const int2* window = windows + r * kSharedXWindow;
      while (true) {  // warp-uniform: the chunk may hold more than a window of the row's slots
        const int done = __popc(__ballot_sync(0xffffffffu, col[r] < c0));
        const int upto = __popc(__ballot_sync(0xffffffffu, col[r] < c_end));
        int i = done;
        if ((i & 1) && i < upto) {
          multiply(window[i].x, window[i].y);
          ++i;
        }
#pragma unroll 2
        for (; i + 1 < upto; i += 2) {
          const int4 pair = *reinterpret_cast<const int4*>(window + i);
          multiply(pair.x, pair.y);
          multiply(pair.z, pair.w);
        }
        if (i < upto) multiply(window[i].x, window[i].y);
        if (upto < kSharedXWindow) break;
        pos[r] += kSharedXWindow;  // every slot of the window is used: park the next one
        __syncwarp();
        col[r] = park_window(r, pos[r], row_end[r]);
        __syncwarp();
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait_all();

  // The band's outputs through shared memory, so that the stores run along the output rows.
  float* tile = reinterpret_cast<float*>(smem);
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < kVecs; ++q)
#pragma unroll
      for (int j = 0; j < V; ++j)
        tile[(q * 32 * V + lane * V + j) * (kBand + 1) + warp * R + r] = float(acc[r][q * V + j]);
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * kBand; i += kThreads) {
    const int row = i % kBand, b = i / kBand;
    const int64_t o = band0 + row, nn = n0 + b;
    if (o < out_dim && nn < n) {
      const A bias_o = bias ? to_accum(bias[o]) : A(0);
      out[nn * out_dim + o] = from_accum<T>(apply_activation(A(tile[b * (kBand + 1) + row]) + bias_o, act));
    }
  }
}

}  // namespace snack::cuda::detail
