// The forward over tile fragments on Hopper's wgmma (sm_90a; bf16, fp16; fp32 accumulation). The
// fragments (snack/pattern.h) lay each 16 x 16 block of a tile out as mma.sync m16n8k16's A operand,
// which is also the register operand of wgmma m64nNk16 for one warp of a warpgroup: warp w loads row
// block w of the tile's four k-steps (its lanes' stored registers, zeros elsewhere) and the warpgroup
// multiplies the 64 x 64 tile by the chunk of X with four wgmma, B read by the tensor cores from the
// swizzled chunk in shared memory. Against the mma.sync kernel (fragment_kernel.cuh): no ldmatrix of
// X, one instruction per k-step for all N batch rows instead of one per 16 x 8 block, the k-steps
// accumulated in the same registers (one partial tile at the end, not four), and batch tiles of 128.
//
// A block is kGroups consumer warpgroups and the producer warp of the mma.sync kernel
// (feed_fragment_stages: the copy engine brings each tile's header, registers and chunk of X into
// `stages` stages). A warpgroup loads a step's operands, multiplies, waits for the products and
// releases the stage; with two, they take the band's steps in turn (each its own accumulators and
// stages: steps g, g + 2, ...), so that one loads while the other's products run without more blocks
// splitting the band, and their partial tiles are summed in order at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/hopper.cuh"
#include "fragment_kernel.cuh"
#include "shapes.h"

namespace snack::cuda::detail {

// a[g] = row block `block` (16 rows) of the tile's k-step g, from the lane's stored registers: the
// header word of (g, lane) says which of its 16 registers (four per row block) are stored and where
// the first is, at `regs` (shared memory, or kInPlace global memory).
template <bool kInPlace>
__device__ __forceinline__ void load_row_block(uint32_t (&a)[kTcWarps][4], const uint32_t* headers,
                                               const uint32_t* regs, int block, int lane) {
#pragma unroll
  for (int g = 0; g < kTcWarps; ++g) {
    const uint32_t head = headers[g * kFragmentLanes + lane];
    const uint32_t mask = (head >> (4 * block)) & 0xfu;
    const uint32_t* at = regs + (head >> 16) + __popc(head & ((1u << (4 * block)) - 1u));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      a[g][q] = 0u;
      if (mask >> q & 1u) { a[g][q] = kInPlace ? __ldg(at) : *at; ++at; }
    }
  }
}

// load_row_block from bitmap fragments: `header` the tile's masks and operands' first values,
// `vals` its values.
template <bool kInPlace>
__device__ __forceinline__ void load_bitmap_row_block(uint32_t (&a)[kTcWarps][4], const uint32_t* header,
                                                      const uint16_t* vals, int block, int lane) {
  const uint64_t below = (uint64_t(1) << (2 * lane)) - 1u;
#pragma unroll
  for (int g = 0; g < kTcWarps; ++g) {
    const int operand = g * 4 + block;
    load_bitmap_operand<kInPlace>(a[g], header + 8 * operand, vals + header[2 * kBitmapBlocks + operand], below, lane);
  }
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and
// the batch tile of blockIdx.y, as spmm_fragment_kernel computes it (the same arguments), with NT =
// 16-128 batch rows a block and kGroups (1 or 2) consumer warpgroups; kBitmaps as there.
template <typename T, int NT, int kGroups, bool kBitmaps>
__global__ void __launch_bounds__(fragment_wgmma_threads(kGroups), fragment_wgmma_blocks_per_sm(NT, kGroups))
    spmm_fragment_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, FragmentView view, int64_t out_dim,
                               int64_t in_dim, const T* __restrict__ in, int64_t n, const T* __restrict__ bias,
                               T* __restrict__ out, Activation act, int splits, int stage_words, int stages,
                               bool mapped) {
#if defined(SNACK_WGMMA_BUILT)
  static_assert(NT == 16 || NT == 32 || NT == 64 || NT == 128, "batch tiles of 16, 32, 64 or 128 rows");
  static_assert(kGroups >= 1 && kGroups <= kFragmentWgmmaMaxGroups, "one or two consumer warpgroups");
  static_assert(kTcChunk * sizeof(T) == 128, "a chunk's row of X is one 128-byte swizzled row");
  constexpr uint32_t kChunkBytes = NT * kTcChunk * sizeof(T);
  constexpr int kGroupThreads = kTcWarps * 32;  // a warpgroup
  constexpr int kConsumerThreads = kGroups * kGroupThreads;
  constexpr int kProducer = kGroups * kTcWarps;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  constexpr int kHeaderWords = fragment_header_words(kBitmaps);
  const FragmentStages st = carve_fragment_stages<NT>(smem_raw, stage_words, stages, kGroups, kHeaderWords);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / kTcWarps, block = warp % kTcWarps, t = threadIdx.x % kGroupThreads;
  // A stage is released by the warps of the one warpgroup that took its step.
  const FragmentSteps share =
      begin_fragment_steps<NT>(st, view, splits, stages, kTcWarps, fragment_wgmma_threads(kGroups));
  const int split = share.split, steps = share.steps;
  const int64_t o0 = share.o0, n0 = share.n0, c_begin = share.c_begin, first_tile = share.first_tile;

  float acc[NT / 2];
  if (warp == kProducer) {
    feed_fragment_stages<NT>(st, x_map, view, first_tile, c_begin, n0, steps, stage_words, stages, mapped, lane);
  } else {
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
    // Without a map of X a warpgroup stages its step i's chunk into its stage `stages` steps ahead
    // (its own step again: kGroups divides the stages), once its warps are done with the step before
    // there (a barrier of the warpgroup), and fences their writes for the tensor cores' reads.
    auto stage_x = [&](int i) {
      if (st.step_tiles[i].y != 0)
        copy_16bit_rows_swizzled<NT>(st.xs + (i % stages) * kChunkBytes, in, n, in_dim, n0,
                                     (c_begin + i) * kTcChunk, t, kGroupThreads);
      fence_proxy_async();
    };
    if (!mapped) {
      for (int i = group; i < stages && i < steps; i += kGroups) stage_x(i);
      named_barrier_sync(1 + group, kGroupThreads);
    }
    // Step i's operands (false: an empty tile, nothing to multiply), once its stage `s` has landed.
    auto load = [&](int i, int s, uint32_t parity, uint32_t(&a)[kTcWarps][4]) {
      mbarrier_wait(&st.filled[s], parity, kFragmentSuspendNs);
      const int2 at = st.step_tiles[i];
      if (at.y == 0) return false;
      const uint32_t* stage = st.words + s * st.stride;
      if constexpr (kBitmaps) {
        if (at.y <= stage_words)
          load_bitmap_row_block<false>(a, stage, reinterpret_cast<const uint16_t*>(stage + kHeaderWords), block, lane);
        else
          load_bitmap_row_block<true>(a, stage, reinterpret_cast<const uint16_t*>(view.values + at.x), block, lane);
      } else {
        if (at.y <= stage_words)
          load_row_block<false>(a, stage, stage + kHeaderWords, block, lane);
        else
          load_row_block<true>(a, stage, view.values + at.x, block, lane);
      }
      return true;
    };
    // One step at a time: the operands are loaded after the products that read the previous ones
    // have completed. (Loading step i + 1's while step i's products ran let ptxas give the new loads
    // the registers the tensor cores were still reading: garbage outputs at 2-5 blocks an SM.) The
    // block's other warps (the producer, the other warpgroup) and the SM's other blocks overlap with
    // the products.
    int s = group;         // step i's stage
    uint32_t parity = 0u;  // of its barrier's phase: flips each round of the stages
    for (int i = group; i < steps; i += kGroups) {
      uint32_t a[kTcWarps][4];
      if (load(i, s, parity, a)) {
        __syncwarp();
        wgmma_fence_operands(acc);
        wgmma_fence();
        const unsigned char* x_chunk = st.xs + s * kChunkBytes;
#pragma unroll
        for (int g = 0; g < kTcWarps; ++g) wgmma_m64nk16_rs<T, NT>(acc, a[g], wg_descriptor(x_chunk + g * 32));
        wgmma_commit();
        wgmma_wait<0>();  // the products have read the stage and the registers
        wgmma_fence_operands(acc);
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&st.released[s]);
      if (!mapped) {
        named_barrier_sync(1 + group, kGroupThreads);
        if (i + stages < steps) stage_x(i + stages);
      }
      if ((s += kGroups) >= stages) s -= stages, parity ^= 1u;
    }
    // A warpgroup with a step fewer than the first (an odd count of steps) passes its barrier once
    // more, so that both run as many: compute-sanitizer's racecheck pairs the block's barriers by
    // how many each thread has passed, whatever their id, and with unequal counts reports the
    // partial tiles' stores and reads below, which the block barrier orders, as races.
    if (!mapped) {
      const int taken = steps > group ? (steps - group + kGroups - 1) / kGroups : 0;
      for (int k = taken; k < (steps + kGroups - 1) / kGroups; ++k) named_barrier_sync(1 + group, kGroupThreads);
    }
  }

  // Each warpgroup's partial tile into its own place over the stages (every copy has landed: the
  // consumers waited for each), then summed in warpgroup order and across the cluster as they are stored.
  __syncthreads();
  if (warp < kProducer) {
    float* part = st.partials + group * NT * kTcPartialStride;
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
      store_accumulator_quad(part, block * 16, j * 8, lane, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  }
  store_split_band_tile<T, kTcBandRows, NT, kTcPartialStride, kConsumerThreads, kGroups, true>(
      st.partials, o0, out_dim, n0, n, bias, out, act, split, splits);
#else
  __trap();  // built without sm_90a: the launcher refuses it (check_wgmma_device)
#endif
}

}  // namespace snack::cuda::detail
