// The tensor-core forward over tile fragments (snack/pattern.h; bf16, fp16; fp32 accumulation): each
// 64 x 64 tile of W arrives already laid out as the A operands of mma.sync m16n8k16, only the
// registers that hold a slot, so nothing is expanded in shared memory: no zeroed tile, no scatter, no
// ldmatrix of W. Per lane and k-step a header word says which of its 16 registers are stored and where
// they start; a register's word is the popcount of the mask below it past that start.
//
// A block owns a band of 64 output rows and a batch tile of 16 or 32 rows, and walks the band's tiles
// (a thread-block cluster splits them and sums the partial tiles as the other tensor-core kernels do).
// Its warps split each tile's 64 columns: warp g multiplies the tile's k-step g (16 columns) for all
// 64 rows, so each warp loads a quarter of the chunk of X (one ldmatrix per 16 batch rows) instead of
// all of it, and the four warps' partial tiles are summed once at the end, in warp order
// (deterministic). The tiles' headers and registers and the chunks of X move with cp.async through
// kFragmentStages stages, one barrier per tile. A tile with more registers than a stage holds (denser
// than the launch planned for) is read from global memory in place.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/pattern.h"
#include "snack/value_types.h"
#include "tensor_core_kernel.cuh"

namespace snack::cuda::detail {

static_assert(kTcBandRows == kTileViewRows && kTcChunk == kTileViewCols && kTcWarps == kFragmentGroups,
              "a warp per k-step of the view's tiles");

// What the kernel reads of the tile fragments (pack_tile_fragments).
struct FragmentView {
  const int2* __restrict__ tiles;        // per tile: first value word (from `values`), value words
  const uint32_t* __restrict__ headers;  // per tile, kFragmentHeaderWords
  const uint32_t* __restrict__ values;
  int64_t chunks;  // tiles per band
};

// acc[m] += the warp's k-step of the tile (row blocks m = 0..3) x the chunk of X (b: the k-step's B
// fragments, two n-tiles of 8 per entry). `mask` and `regs`: the lane's stored registers and where
// they start, in shared memory or (kInPlace) in global memory.
template <typename T, int NT, bool kInPlace>
__device__ __forceinline__ void multiply_fragments(float (&acc)[4][NT / 8][4], const uint32_t (&b)[NT / 16][4],
                                                   uint32_t mask, const uint32_t* regs) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t a[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = 4 * m + q;
      const uint32_t* at = regs + __popc(mask & ((1u << r) - 1u));
      a[q] = 0u;
      if (mask >> r & 1u) a[q] = kInPlace ? __ldg(at) : *at;
    }
#pragma unroll
    for (int j = 0; j < NT / 16; ++j) {
      mma_16816<T>(acc[m][2 * j], a, b[j][0], b[j][1]);
      mma_16816<T>(acc[m][2 * j + 1], a, b[j][2], b[j][3]);
    }
  }
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and the
// batch tile of blockIdx.y; the cluster's blocks split the band's tiles. stage_words: the value words
// a stage holds (fragment_smem_bytes).
template <typename T, int NT>
__global__ void __launch_bounds__(kTcThreads) spmm_fragment_kernel(FragmentView view, int64_t out_dim, int64_t in_dim,
                                                                   const T* __restrict__ in, int64_t n,
                                                                   const T* __restrict__ bias, T* __restrict__ out,
                                                                   Activation act, int splits, int stage_words,
                                                                   bool vec) {
  static_assert(NT == 16 || NT == 32, "batch tiles of 16 or 32 rows");
  constexpr int CW = kTcChunk;
  constexpr int kStride = tensor_core_stride(CW);
  constexpr int S = kFragmentStages;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);                                 // [S][NT][kStride]
  uint32_t* words = reinterpret_cast<uint32_t*>(xs + S * NT * kStride);             // [S][headers + stage_words]
  const int stage_stride = int(kFragmentHeaderWords) + stage_words;
  int2* step_tiles = reinterpret_cast<int2*>(words + S * stage_stride);             // [steps]
  float* partial = reinterpret_cast<float*>(smem);                                   // [NT][kTcPartialStride], at the end

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t band = blockIdx.x / unsigned(splits);
  const int64_t o0 = band * kTcBandRows;
  const int64_t n0 = int64_t(blockIdx.y) * NT;
  const int64_t c_begin = view.chunks * split / splits, c_end = view.chunks * (split + 1) / splits;
  const int steps = int(c_end - c_begin);
  const int64_t first_tile = band * view.chunks + c_begin;
  for (int i = t; i < steps; i += kTcThreads) step_tiles[i] = view.tiles[first_tile + i];
  __syncthreads();

  // Step i's header, registers (those that fit a stage) and chunk of X into stage i % S.
  auto issue = [&](int i) {
    const int2 at = step_tiles[i];
    if (at.y == 0) return;  // no slot in the tile: nothing to multiply
    const int s = i % S;
    const uint32_t* header = view.headers + (first_tile + i) * kFragmentHeaderWords;
    const uint32_t* regs = view.values + at.x;
    uint32_t* dst = words + s * stage_stride;
    constexpr int kHeaderVectors = int(kFragmentHeaderWords) / 4;
    const int vectors = kHeaderVectors + (at.y <= stage_words ? at.y / 4 : 0);
    for (int v = t; v < vectors; v += kTcThreads)
      cp_async_16(dst + 4 * v, v < kHeaderVectors ? header + 4 * v : regs + 4 * (v - kHeaderVectors), 16);
    stage_input_chunk<T, NT, CW>(xs + s * NT * kStride, in, n, in_dim, n0, (c_begin + i) * CW, vec);
  };

  float acc[4][NT / 8][4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int j = 0; j < NT / 8; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();  // step i is in its stage; every warp is done with step i - 1's, which step i + S - 1 takes
    if (i + S - 1 < steps) issue(i + S - 1);
    cp_async_commit();
    const int2 at = step_tiles[i];
    if (at.y == 0) continue;
    const int s = i % S;
    const uint32_t* stage = words + s * stage_stride;
    const uint32_t head = stage[warp * kFragmentLanes + lane];
    const uint32_t mask = head & 0xffffu, offset = head >> 16;
    uint32_t b[NT / 16][4];
    const uint16_t* x_chunk = xs + s * NT * kStride;
#pragma unroll
    for (int j = 0; j < NT / 16; ++j)
      ldmatrix_x4(b[j], x_chunk + ((2 * j + lane / 16) * 8 + lane % 8) * kStride + warp * 16 + ((lane / 8) % 2) * 8);
    if (at.y <= stage_words)
      multiply_fragments<T, NT, false>(acc, b, mask, stage + kFragmentHeaderWords + offset);
    else
      multiply_fragments<T, NT, true>(acc, b, mask, view.values + at.x + offset);
  }

  // The warps' partial tiles summed in warp order over the stages, then across the cluster.
  cp_async_wait_all();
  __syncthreads();
  for (int w = 0; w < kTcWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int j = 0; j < NT / 8; ++j) {
          const int row = m * 16 + lane / 4, b = j * 8 + (lane % 4) * 2;
          float* p = partial + b * kTcPartialStride + row;
          if (w == 0) {
            p[0] = acc[m][j][0], p[kTcPartialStride] = acc[m][j][1];
            p[8] = acc[m][j][2], p[kTcPartialStride + 8] = acc[m][j][3];
          } else {
            p[0] += acc[m][j][0], p[kTcPartialStride] += acc[m][j][1];
            p[8] += acc[m][j][2], p[kTcPartialStride + 8] += acc[m][j][3];
          }
        }
    }
    if (w + 1 < kTcWarps) __syncthreads();
  }
  store_split_band_tile<T, kTcBandRows, NT, kTcPartialStride, kTcThreads>(partial, o0, out_dim, n0, n, bias, out, act,
                                                                           split, splits);
}

}  // namespace snack::cuda::detail
