// The tensor-core SpMM for 16-bit values (bf16, fp16; fp32 accumulation): W is loaded as sparse and
// multiplied as dense. A block owns a band of kTcBandRows output rows and a range of column chunks of
// kTcChunk; for each chunk every warp expands its 16 rows' slots into a dense 16 x kTcChunk tile in
// shared memory (zeros elsewhere), the block stages the chunk of X (NT batch rows) beside it, and
// mma.sync m16n8k16 multiplies the two.
//
// The tile contents come from the CSR view itself (or the CSC view for dX): a band's rows are
// consecutive slots, sorted by column, so each row keeps a cursor, and two lanes per row read its next
// slots eight at a time until one falls past the chunk. No tiled copy of the pattern is stored or
// rebuilt.
//
// Several blocks of one band split its chunks (a thread-block cluster of 2-8 blocks along x) when
// the bands alone would leave SMs idle; their partial tiles are summed through distributed shared
// memory in a fixed order, so the result is deterministic. Each block's cursors start from a sampled
// search (32 probes per round) of its first column in every row.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/cp_async.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/mma.cuh"
#include "../device/row_cursors.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/value_types.h"
#include "views.cuh"

namespace snack::cuda::detail {

// The chunk of the input [n0, n0 + NT) x [k0, k0 + CW) into xs ([NT][tensor_core_stride(CW)]), zeros
// outside the input (stage_16bit_block; with vec the caller commits the cp.async group).
template <typename T, int NT, int CW>
__device__ __forceinline__ void stage_input_chunk(uint16_t* xs, const T* __restrict__ in, int64_t n, int64_t in_dim,
                                                  int64_t n0, int64_t k0, bool vec) {
  stage_16bit_block<NT, CW, tensor_core_stride(CW), kTcThreads>(xs, in, n, in_dim, n0, k0, vec);
}

// One m16n8 accumulator of a warp (the layout of mma.sync's m16n8 and of each n-tile of wgmma's
// m64nN: c0, c1 at rows row0 + lane / 4, batch rows b0 + 2 (lane % 4) and + 1; c2, c3 eight rows
// further) into a partial tile [batch row][kTcPartialStride] of a band's rows.
__device__ __forceinline__ void store_accumulator_quad(float* partial, int row0, int b0, int lane, float c0, float c1,
                                                       float c2, float c3) {
  const int row = row0 + lane / 4, b = b0 + (lane % 4) * 2;
  float* p = partial + b * kTcPartialStride + row;
  p[0] = c0, p[kTcPartialStride] = c1;
  p[8] = c2, p[kTcPartialStride + 8] = c3;
}

// The end of a band's block: its partial tile [NT][64 rows] (acc of the m16n8k16 layout, warp w
// rows 16 w..16 w + 15) through shared memory (`partial`, over the staging buffers), summed over the
// cluster's `splits` blocks in rank order, then bias, activation and the store along the output rows.
// Block `split` of the cluster finishes batch rows split, split + splits, ... of the tile (a thread per
// output row).
template <typename T, int NT>
__device__ __forceinline__ void finish_band_tile(const float (&acc)[NT / 8][4], float* partial, int64_t o0,
                                                 int64_t out_dim, int64_t n0, int64_t n, const T* __restrict__ bias,
                                                 T* __restrict__ out, Activation act, int split, int splits) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NT / 8; ++j)
    store_accumulator_quad(partial, warp * 16, j * 8, lane, acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  store_split_band_tile<T, kTcBandRows, NT, kTcPartialStride, kTcThreads>(partial, o0, out_dim, n0, n, bias, out, act,
                                                                           split, splits);
}

// Zeroes kRows rows of CW values at tensor_core_stride(CW) (the padding columns are never read), by
// kThreads threads of which this is thread t: 16-byte stores, kRows * CW / 8 / kThreads per thread.
template <int kRows, int CW, int kThreads>
__device__ __forceinline__ void zero_tile_rows(uint16_t* tile, int t) {
  constexpr int kStride = tensor_core_stride(CW);
  constexpr int kSegments = kRows * CW / 8;
  static_assert(kSegments % kThreads == 0, "whole rounds of 16-byte stores");
#pragma unroll
  for (int i = 0; i < kSegments / kThreads; ++i) {
    const int seg = t + kThreads * i;
    *reinterpret_cast<uint4*>(tile + (seg / (CW / 8)) * kStride + (seg % (CW / 8)) * 8) = make_uint4(0, 0, 0, 0);
  }
}

// acc += tile (the warp's 16 rows x CW columns) x the chunk of X ([NT][CW]), both in shared memory
// at tensor_core_stride(CW).
template <typename T, int NT, int CW>
__device__ __forceinline__ void multiply_chunk(float (&acc)[NT / 8][4], const uint16_t* tile, const uint16_t* x_chunk) {
  constexpr int kStride = tensor_core_stride(CW);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < CW / 16; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, tile + (lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
#pragma unroll
    for (int j = 0; j < NT / 8; j += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, x_chunk + ((j + lane / 16) * 8 + lane % 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
      mma_16816<T>(acc[j], a, b[0], b[1]);
      mma_16816<T>(acc[j + 1], a, b[2], b[3]);
    }
  }
}

// Expands the slots of the warp's 16 rows with inputs in [k0, k0 + CW) into `tile`
// ([16][tensor_core_stride(CW)], zeroed), advancing the cursors. Lanes r and r + 16 share row r:
// each walks every other vector of 8 entries from the row's cursor until a vector ends past the
// chunk (the slots are sorted by input, so the rest of the row is too), then the pair adds up what
// it took. Every lane stores its own entries: no ballots, no shuffles per slot. `aligned`: the
// view's vectors_aligned().
template <int CW, typename View>
__device__ __forceinline__ void expand_chunk(const View& view, uint16_t* tile, int32_t& cursor, int32_t end,
                                             int64_t k0, bool aligned) {
  constexpr int kStride = tensor_core_stride(CW);
  const int lane = threadIdx.x % 32;
  const int row = lane % 16;
  const int32_t k_end = int32_t(k0 + CW);
  int32_t taken = 0;
  for (int32_t e8 = (cursor & ~7) + 8 * (lane / 16); e8 < end; e8 += 16) {
    int32_t input[8];
    uint16_t bits[8];
    view.load8(e8, cursor, end, aligned, input, bits);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (input[j] < k_end) {
        tile[row * kStride + (input[j] - int32_t(k0))] = bits[j];
        ++taken;
      }
    }
    if (e8 + 8 >= end || input[7] >= k_end) break;
  }
  cursor += taken + __shfl_xor_sync(0xffffffffu, taken, 16);
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits,
// the batch tile of blockIdx.y; the cluster's blocks split the band's chunks.
template <typename T, typename View, int NT>
__global__ void __launch_bounds__(kTcThreads) spmm_tensor_core_kernel(View view, int64_t out_dim, int64_t in_dim,
                                                                      const T* __restrict__ in, int64_t n,
                                                                      const T* __restrict__ bias, T* __restrict__ out,
                                                                      Activation act, int splits, bool vec) {
  static_assert(NT % 16 == 0 && NT <= 128, "batch tiles of 16 to 128 rows");
  constexpr int CW = kTcChunk;
  static_assert(CW % 64 == 0, "chunks of whole 16-byte segments per lane");
  constexpr int kStride = tensor_core_stride(CW);
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);                 // [warps][16][kStride]
  uint16_t* xs = tiles + kTcWarps * 16 * kStride;                       // [2][NT][kStride]
  float* partial = reinterpret_cast<float*>(smem);                      // [NT][kTcPartialStride], after the loop

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t o0 = int64_t(blockIdx.x / unsigned(splits)) * kTcBandRows;
  const int64_t n0 = int64_t(blockIdx.y) * NT;
  const int64_t chunks = (in_dim + CW - 1) / CW;
  const int64_t c_begin = chunks * split / splits, c_end = chunks * (split + 1) / splits;

  // Cursors: lane r < 16 the first slot of row o0 + 16 warp + r, lane 16 + r its end (for the seek).
  const int64_t my_row = o0 + warp * 16 + (lane % 16);
  int32_t cursor_or_end = 0;
  if (my_row < out_dim) cursor_or_end = view.ptr[my_row + (lane < 16 ? 0 : 1)];
  if (c_begin > 0) cursor_or_end = seek_cursors(view, cursor_or_end, c_begin * CW);
  // From here lanes r and r + 16 both hold row r's cursor and end.
  int32_t cursor = __shfl_sync(0xffffffffu, cursor_or_end, lane % 16);
  const int32_t end = __shfl_sync(0xffffffffu, cursor_or_end, 16 + lane % 16);
  const bool aligned = view.vectors_aligned();

  float acc[NT / 8][4];
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  uint16_t* tile = tiles + warp * 16 * kStride;
  if (c_begin < c_end) stage_input_chunk<T, NT, CW>(xs, in, n, in_dim, n0, c_begin * CW, vec);
  cp_async_commit();
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int buf = int((c - c_begin) & 1);
    __syncwarp();
    zero_tile_rows<16, CW, 32>(tile, int(threadIdx.x % 32));
    __syncwarp();
    expand_chunk<CW>(view, tile, cursor, end, c * CW, aligned);
    if (vec) cp_async_wait_all();
    __syncthreads();  // the chunk of X is staged; every warp is done with the other buffer
    if (c + 1 < c_end)
      stage_input_chunk<T, NT, CW>(xs + (buf ^ 1) * NT * kStride, in, n, in_dim, n0, (c + 1) * CW, vec);
    cp_async_commit();
    multiply_chunk<T, NT, CW>(acc, tile, xs + buf * NT * kStride);
  }

  finish_band_tile<T, NT>(acc, partial, o0, out_dim, n0, n, bias, out, act, split, splits);
}

}  // namespace snack::cuda::detail
