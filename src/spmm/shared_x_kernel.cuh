// The SpMM for large batches on CUDA cores: X staged in shared memory and shared by a band of rows.
//
// The row kernels read X (or its transposed copy) through L1 once per stored entry; at a batch of
// hundreds of rows that stream no longer fits L1 and runs from L2, whose bandwidth bounds them
// (~5 useful TFLOP/s in fp32 on the H200). Here a block owns a band of shared_x_band_rows output rows
// and one batch tile of shared_x_tile(sizeof(T)) rows (one 16-byte vector per lane), walks the input
// columns in chunks, and copies each chunk of the transposed input [chunk][tile] into shared memory
// once (cp.async, double-buffered); every row of the band then reads its entries' inputs there. L2
// sees X once per band instead of once per entry, and the bound becomes shared memory's bandwidth:
// one 16-byte vector per lane and entry.
//
// Each of its kWarps warps owns R rows and keeps, per row, a cursor and a window of its next 32
// slots (one per lane). Rows are sorted by column, so the slots of a chunk are a prefix of the
// window: a ballot counts them, the lanes park their (offset, value) pairs in a per-warp buffer, and
// the warp reads them back two at a time as broadcasts while each lane multiplies its batch values.
// The window is reloaded after the row's entries of the chunk, so the load has the rest of the
// chunk to arrive. Every output is summed in slot order: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/vector_load.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "views.cuh"

namespace snack::cuda::detail {

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band blockIdx.x and the batch
// tile blockIdx.y. in_t: the transposed tiles [tiles][in_dim + 1][kTile] written by
// transpose_tile_kernel just before (possibly a programmatic launch: W's slots are read before the
// wait, X^T after it). chunk: input columns per stage (a multiple of 8).
template <typename T, typename View, int kWarps, int R>
__global__ void __launch_bounds__(kWarps * 32, 1)
    spmm_shared_x_kernel(View view, int64_t out_dim, int64_t in_dim, const T* __restrict__ in_t, int64_t n,
                         const T* __restrict__ bias, T* __restrict__ out, Activation act, int chunk) {
  using A = accum_t<T>;
  constexpr int V = 16 / int(sizeof(T));
  constexpr int kTile = 32 * V;
  constexpr int kBand = kWarps * R;
  constexpr int kThreads = kWarps * 32;
  extern __shared__ __align__(16) unsigned char smem[];
  const size_t stage_elems = size_t(chunk) * kTile;
  T* stages = reinterpret_cast<T*>(smem);
  const size_t buffers_at = (kSharedXStages * stage_elems * sizeof(T) > sizeof(float) * kTile * (kBand + 1))
                                ? kSharedXStages * stage_elems * sizeof(T)
                                : sizeof(float) * kTile * (kBand + 1);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // This warp's buffer of (offset into the stage, value bits) pairs, 16-byte aligned.
  int2* slots = reinterpret_cast<int2*>(smem + buffers_at) + warp * kSharedXWindow;

  const int64_t band0 = int64_t(blockIdx.x) * kBand;
  const int64_t n0 = int64_t(blockIdx.y) * kTile;
  in_t += int64_t(blockIdx.y) * (in_dim + 1) * kTile;
  const int64_t chunks = (in_dim + chunk - 1) / chunk;

  // Per row: its cursor, its end, and the window of slots cursor + lane (column INT_MAX past the end).
  int32_t pos[R], end[R], col[R];
  A val[R];
  auto load_window = [&](int32_t first, int32_t last, int32_t& c, A& v) {
    const int32_t e = first + lane;
    const bool ok = e < last;
    c = ok ? view.input(e) : INT_MAX;
    v = ok ? to_accum(view.value(e)) : A(0);
  };
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t o = band0 + warp * R + r;
    pos[r] = o < out_dim ? view.ptr[o] : 0;
    end[r] = o < out_dim ? view.ptr[o + 1] : 0;
    load_window(pos[r], end[r], col[r], val[r]);
  }
  A acc[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[r][j] = A(0);

  // Chunk c of the transposed tile (rows [c * chunk, ...) of in_t, contiguous) into stage s.
  auto stage_chunk = [&](int64_t c, int s) {
    const int64_t rows = (in_dim - c * chunk) < chunk ? (in_dim - c * chunk) : chunk;
    const int64_t pieces = rows * (kTile * int64_t(sizeof(T)) / 16);
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
    const T* stage = stages + s * stage_elems + lane * V;
    const int32_t c0 = int32_t(c * chunk);
    const int32_t c_end = c0 + chunk;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      while (true) {  // warp-uniform: more than a window of the row's slots may fall in the chunk
        const bool in = col[r] < c_end;
        const int count = __popc(__ballot_sync(0xffffffffu, in));
        if (count == 0) break;
        if (in) slots[lane] = make_int2((col[r] - c0) * kTile, __float_as_int(float(val[r])));
        __syncwarp();
        auto multiply = [&](int offset, int bits) {
          A x[V];
          load_vec<T, V, true>(stage + offset, x);
          const A v = A(__int_as_float(bits));
#pragma unroll
          for (int j = 0; j < V; ++j) acc[r][j] = fmaf(v, x[j], acc[r][j]);
        };
        int i = 0;
#pragma unroll 2
        for (; i + 1 < count; i += 2) {
          const int4 pair = *reinterpret_cast<const int4*>(slots + i);
          multiply(pair.x, pair.y);
          multiply(pair.z, pair.w);
        }
        if (i < count) {
          const int2 last = slots[i];
          multiply(last.x, last.y);
        }
        __syncwarp();
        pos[r] += count;
        load_window(pos[r], end[r], col[r], val[r]);
        if (count < kSharedXWindow) break;
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
    for (int j = 0; j < V; ++j) tile[(lane * V + j) * (kBand + 1) + warp * R + r] = float(acc[r][j]);
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
