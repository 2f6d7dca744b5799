// The forward over tile fragments on Hopper's wgmma (sm_90a; bf16, fp16; fp32 accumulation). The
// fragments (snack/pattern.h) lay each 16 x 16 block of a tile out as mma.sync m16n8k16's A operand:
// warp w of a warpgroup loads row block w of the tile's four k-steps (its lanes' stored registers,
// zeros elsewhere) and writes it into the step's 64 x 64 A tile in shared memory, and the warpgroup
// multiplies the tile by the chunk of X with four wgmma m64nNk16, both operands read by the tensor
// cores from shared memory in the 128-byte swizzle. Against the mma.sync kernel (fragment_kernel.cuh):
// no ldmatrix of X, one instruction per k-step for all N batch rows instead of one per 16 x 8 block,
// the k-steps accumulated in the same registers (one partial tile at the end, not four), and batch
// tiles of 128. A in shared memory rather than in registers lets a step's products run while the next
// step's operands are loaded (with A in registers, ptxas gave the next loads the registers the
// products were still reading; docs/kernels.md).
//
// A block is kGroups consumer warpgroups and the producer warp of the mma.sync kernel
// (feed_fragment_stages: the copy engine brings each tile's header, registers and chunk of X into
// `stages` stages). With two warpgroups they take the band's steps in turn (each its own
// accumulators, A tiles and stages: steps g, g + 2, ...), and their partial tiles are summed in order
// at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/hopper.cuh"
#include "fragment_kernel.cuh"
#include "shapes.h"

namespace snack::cuda::detail {

// Row block `block` (16 rows) of the tile's four k-steps into the step's A tile `a_tile` (64 x 64, the
// 128-byte swizzle of the chunks of X): the header word of (g, lane) says which of its 16 registers
// (four per row block) are stored and where the first is, at `regs` (shared memory, or kInPlace global
// memory). Register q of k-step g (mma.sync m16n8k16's A layout) holds the pair at row 16 block +
// (q % 2) 8 + lane / 4, column 16 g + (q / 2) 8 + 2 (lane % 4): a warp's 32 stores of one register
// fall in 32 different banks.
template <bool kInPlace>
__device__ __forceinline__ void expand_row_block(unsigned char* a_tile, const uint32_t* headers, const uint32_t* regs,
                                                 int block, int lane) {
  uint32_t a[kTcWarps][4];
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
#pragma unroll
  for (int g = 0; g < kTcWarps; ++g)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      *reinterpret_cast<uint32_t*>(a_tile + wg_swizzled(16 * block + (q % 2) * 8 + lane / 4,
                                                        16 * g + (q / 2) * 8 + (lane % 4) * 2)) = a[g][q];
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and
// the batch tile of blockIdx.y, as spmm_fragment_kernel computes it (the same arguments), with NT =
// 16-128 batch rows a block and kGroups (1 or 2) consumer warpgroups.
template <typename T, int NT, int kGroups>
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
  const FragmentStages st =
      carve_fragment_stages<NT>(smem_raw, stage_words, stages, kGroups, kGroups * kFragmentWgmmaATiles);

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
    unsigned char* const a_tiles = st.a_tiles + group * kFragmentWgmmaATiles * kFragmentATileBytes;
    // Without a map of X a warpgroup stages its step i's chunk into its stage `stages` steps ahead
    // (its own step again: kGroups divides the stages), once its warps are done with the step before
    // there (a barrier of the warpgroup), and fences their writes for the tensor cores' reads.
    auto stage_x = [&](int i) {
      if (st.step_tiles[i].y != 0)
        stage_fragment_x<NT>(st.xs + (i % stages) * kChunkBytes, in, n, in_dim, n0, (c_begin + i) * kTcChunk, t,
                             kGroupThreads);
      fence_proxy_async();
    };
    if (!mapped) {
      for (int i = group; i < stages && i < steps; i += kGroups) stage_x(i);
      named_barrier_sync(1 + group, kGroupThreads);
    }
    auto release = [&](int stage) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&st.released[stage]);
    };
    // Per step: once its stage has landed, each warp expands its row block into the next A tile, the
    // warpgroup meets (every row in place, fenced for the tensor cores), issues the four products and
    // waits for those of its step before, whose stage it then releases: a step's products run while
    // the next step's operands are read and expanded. A tiles go round three, so that the one written
    // was last read two steps before, whose products every warp has waited for before the barrier of
    // the step between. Without a map of X the warpgroup stages X itself into a stage as soon as it
    // releases it, so there it waits for each step's own products.
    int s = group;         // step i's stage
    uint32_t parity = 0u;  // of its barrier's phase: flips each round of the stages
    int pending = -1;      // the stage whose products are still running
    int a_next = 0;        // the next A tile
    for (int i = group; i < steps; i += kGroups) {
      mbarrier_wait(&st.filled[s], parity, kFragmentSuspendNs);
      const int2 at = st.step_tiles[i];
      if (at.y != 0) {
        unsigned char* const a_tile = a_tiles + a_next * kFragmentATileBytes;
        const uint32_t* stage = st.words + s * st.stride;
        if (at.y <= stage_words)
          expand_row_block<false>(a_tile, stage, stage + kFragmentHeaderWords, block, lane);
        else
          expand_row_block<true>(a_tile, stage, view.values + at.x, block, lane);
        fence_proxy_async();
        named_barrier_sync(1 + group, kGroupThreads);
        wgmma_fence_operands(acc);
        wgmma_fence();
        const unsigned char* x_chunk = st.xs + s * kChunkBytes;
#pragma unroll
        for (int g = 0; g < kTcWarps; ++g)
          wgmma_m64nk16_ss<T, NT>(acc, wg_descriptor(a_tile + g * 32), wg_descriptor(x_chunk + g * 32));
        wgmma_commit();
        if (++a_next == kFragmentWgmmaATiles) a_next = 0;
        if (mapped) {
          wgmma_wait<1>();  // the step before's products have read their stage
          wgmma_fence_operands(acc);
          if (pending >= 0) release(pending);
          pending = s;
        } else {
          wgmma_wait<0>();
          wgmma_fence_operands(acc);
          release(s);
        }
      } else {
        release(s);  // an empty tile: nothing read its stage
      }
      if (!mapped) {
        named_barrier_sync(1 + group, kGroupThreads);
        if (i + stages < steps) stage_x(i + stages);
      }
      if ((s += kGroups) >= stages) s -= stages, parity ^= 1u;
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    if (pending >= 0) release(pending);
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
