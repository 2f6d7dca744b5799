// The Hopper tensor-core SpMM for large batches (bf16, fp16; fp32 accumulation): W is loaded as
// sparse and multiplied as dense with wgmma, its tiles expanded on chip and never written to memory.
//
// A block owns kWgBandRows output rows (a band of the view) and kWgBatchTile batch rows, and walks
// the inputs in chunks of kWgChunk. Three warpgroups: the producer expands the band's slots of a
// chunk into a zeroed 128 x 64 tile of shared memory (the 128-byte swizzled layout that wgmma
// reads) and has the copy engine (TMA) bring the batch tile's chunk of X beside it; two consumers
// each multiply 64 of the band's rows with the chunk (wgmma m64n256k16, A and B from shared
// memory) into float accumulators. kWgStages chunks are in flight, handed over by mbarriers.
//
// The expansion reads tile lists that three small kernels build from the view (CSR for the
// forward, CSC for dX) before the product, in the workspace: a chunk's slots of the band are one
// contiguous run of packed words, so the producer streams them with coalesced loads, three chunks
// ahead. Earlier designs that walked the view's rows from the producer (a cursor and a 32-slot
// window per row, or a per-block table of chunk starts) were bound by the latency of those loads:
// 4.8x and 6.9x slower than these lists (4096 x 4096, 90%, N = 1024, batch tiles of 128, H200).
//
// A cluster of `splits` blocks along x may split a band's chunks (when the tiles alone leave SMs
// idle); their float tiles are summed through distributed shared memory in rank order, so the
// result is deterministic.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/hopper.cuh"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/value_types.h"
#include "views.cuh"

namespace snack::cuda::detail {

// ---- the tile lists ----
//
// Before the product, three small kernels sort the view's slots into tile lists: for band b and
// chunk c, the slots of rows [128 b, 128 b + 128) with inputs in [64 c, 64 c + 64), contiguous from
// tile_off[b][c], each packed in one word: row in the band (7 bits) << 22 | input in the chunk
// (6 bits) << 16 | value bits (16). The producer then streams a chunk's list with coalesced loads
// and writes each word into its place in the tile. The lists depend on the pattern and the values,
// and take 4 bytes per slot plus small tables (WgmmaLists).

// 32-bit word of a slot: its row in the band, its input in the chunk, its value.
__device__ __forceinline__ uint32_t wg_pack(int row_in_band, int input_in_chunk, uint16_t bits) {
  return uint32_t(row_in_band) << 22 | uint32_t(input_in_chunk) << 16 | bits;
}

// starts[o][j] (j in [0, chunks]): row o's first slot, relative to ptr[o], whose input is in chunk j
// or later. A warp per row, its lanes over 32 slots at a time; a slot whose chunk differs from its
// predecessor's writes the starts of the chunks in between.
template <typename View>
__global__ void wg_chunk_starts_kernel(View view, int64_t out_dim, int chunks, uint16_t* __restrict__ starts) {
  const int lane = threadIdx.x % 32;
  const int64_t o = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (o >= out_dim) return;
  uint16_t* row = starts + o * (chunks + 1);
  const int32_t begin = view.ptr[o], end = view.ptr[o + 1];
  int previous = -1;  // the chunk of the slot before this round's first
  for (int32_t base = begin; base < end; base += 4 * 32) {
    int chunk[4];  // four rounds' loads in flight
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int32_t e = base + 32 * q + lane;
      chunk[q] = e < end ? int(view.input(e) / kWgChunk) : chunks;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int32_t e = base + 32 * q + lane;
      int before = __shfl_up_sync(0xffffffffu, chunk[q], 1);
      if (lane == 0) before = previous;
      for (int j = before + 1; j <= chunk[q]; ++j) row[j] = uint16_t(e - begin);
      previous = __shfl_sync(0xffffffffu, chunk[q], 31);
    }
  }
  for (int j = previous + 1 + lane; j <= chunks; j += 32) row[j] = uint16_t(end - begin);
}

// tile_off[b][j] (the view's slot number where the list of band b, chunk j starts; j in [0, chunks])
// and row_before[o][j] (the slots of chunk j in the band's rows before o). A block of 32 warps per
// band, a warp per chunk: lane l adds up rows 4 l .. 4 l + 3 and a warp scan places them.
template <typename View>
__global__ void __launch_bounds__(1024) wg_tile_offsets_kernel(View view, int64_t out_dim, int chunks,
                                                               const uint16_t* __restrict__ starts,
                                                               uint16_t* __restrict__ row_before,
                                                               int32_t* __restrict__ tile_off) {
  static_assert(kWgBandRows == 4 * 32, "four rows a lane");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t o0 = int64_t(blockIdx.x) * kWgBandRows;
  int32_t* band_off = tile_off + int64_t(blockIdx.x) * (chunks + 1);
  __shared__ int32_t totals[1024];
  for (int j0 = 0; j0 < chunks; j0 += 1024) {  // rounds of 1024 chunks
    for (int j = j0 + warp; j < min(j0 + 1024, chunks); j += 32) {
      int32_t count[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t o = o0 + 4 * lane + q;
        const uint16_t* row = starts + o * (chunks + 1);
        count[q] = o < out_dim ? int32_t(row[j + 1]) - int32_t(row[j]) : 0;
      }
      const int32_t mine = count[0] + count[1] + count[2] + count[3];
      int32_t before = mine;  // inclusive scan over the lanes, then exclusive
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int32_t up = __shfl_up_sync(0xffffffffu, before, d);
        if (lane >= d) before += up;
      }
      if (lane == 31) totals[j - j0] = before;
      before -= mine;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t o = o0 + 4 * lane + q;
        if (o < out_dim) row_before[o * chunks + j] = uint16_t(before);
        before += count[q];
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the band's chunks in order
      int32_t at = j0 == 0 ? view.ptr[o0] : band_off[j0];
      for (int q = 0; q < 1024 && j0 + q < chunks; ++q) {
        band_off[j0 + q] = at;
        at += totals[q];
      }
      band_off[min(j0 + 1024, chunks)] = at;
    }
    __syncthreads();
  }
  if (chunks == 0 && threadIdx.x == 0) band_off[0] = view.ptr[o0];
}

// lists[tile_off[b][j] + row_before[o][j] + (e - start)] = the word of slot e. A warp per row.
template <typename View>
__global__ void wg_pack_kernel(View view, int64_t out_dim, int chunks, const uint16_t* __restrict__ starts,
                               const uint16_t* __restrict__ row_before, const int32_t* __restrict__ tile_off,
                               uint32_t* __restrict__ lists) {
  const int lane = threadIdx.x % 32;
  const int64_t o = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (o >= out_dim) return;
  const int32_t begin = view.ptr[o], end = view.ptr[o + 1];
  const int64_t band = o / kWgBandRows;
  const uint16_t* row_starts = starts + o * (chunks + 1);
#pragma unroll 4
  for (int32_t e = begin + lane; e < end; e += 32) {
    const int32_t input = view.input(e);
    const int j = input / kWgChunk;
    const int64_t at = int64_t(tile_off[band * (chunks + 1) + j]) + row_before[o * chunks + j] +
                       (e - begin - int32_t(row_starts[j]));
    lists[at] = wg_pack(int(o - band * kWgBandRows), input - j * kWgChunk, view.value(e).bits);
  }
}

// The producer's words of one chunk in flight: thread t holds words t, t + 128, ... of the list.
constexpr int kWgWordsPerThread = 8;
struct WgWords {
  uint32_t word[kWgWordsPerThread];
  int32_t count;  // the list's length
};
__device__ __forceinline__ void wg_load_words(const uint32_t* __restrict__ lists, int32_t first, int32_t count,
                                              WgWords& w) {
  w.count = count;
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int i = 0; i < kWgWordsPerThread; ++i) {
    const int32_t k = t + 128 * i;
    w.word[i] = k < count ? __ldg(lists + first + k) : 0xffffffffu;
  }
}
// Shared-memory stores by address (the tiles are addressed from the aligned base as 32-bit shared
// addresses, so no generic stores).
__device__ __forceinline__ void st_shared_u16(uint32_t address, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(address), "h"(v) : "memory");
}
__device__ __forceinline__ void st_shared_zero16(uint32_t address) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(address), "r"(0) : "memory");
}
// Writes word `word` into the tile at `tile` (a shared address); the words past the list (all ones)
// go to `spare`, so that the stores need no branch.
__device__ __forceinline__ void wg_store_word(uint32_t tile, uint32_t spare, uint32_t word) {
  const uint32_t at = word == 0xffffffffu ? spare : tile + wg_swizzled(word >> 22, (word >> 16) & 63);
  st_shared_u16(at, uint16_t(word & 0xffff));
}
// Writes the words into the tile; a list longer than the words in flight is finished here.
__device__ __forceinline__ void wg_store_words(const uint32_t* __restrict__ lists, int32_t first, const WgWords& w,
                                               uint32_t tile, uint32_t spare) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int i = 0; i < kWgWordsPerThread; ++i) wg_store_word(tile, spare, w.word[i]);
  for (int32_t k = 128 * kWgWordsPerThread + t; k < w.count; k += 128) wg_store_word(tile, spare, __ldg(lists + first + k));
}

// ---- the kernel ----

// out[n, o] = act(sum over the slots of value * in[n, input] + bias[o]) for the band blockIdx.x /
// splits and the batch tile blockIdx.y, from the tile lists (`lists`, `tile_off`: the band's
// chunks' lists); x_map is the tensor map of `in` ([n][in_dim], boxes of kWgChunk x kWgBatchTile in
// the 128-byte swizzle).
template <typename T>
__global__ void __launch_bounds__(kWgThreads, 1)
    spmm_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, const uint32_t* __restrict__ lists,
                      const int32_t* __restrict__ tile_off, int64_t out_dim, int64_t in_dim, int64_t n,
                      const T* __restrict__ bias, T* __restrict__ out, Activation act, int splits) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Stages: [kWgStages][W tile 16 KiB | X tile 32 KiB], 1024-byte aligned; then the barriers.
  unsigned char* smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kWgStages * kWgStageBytes);
  uint64_t* empty = full + kWgStages;
  const uint32_t spare = shared_address(empty + kWgStages);  // 16 bytes that take the stores past a list

  const int warpgroup = threadIdx.x / 128;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t o0 = int64_t(blockIdx.x / unsigned(splits)) * kWgBandRows;
  const int64_t n0 = int64_t(blockIdx.y) * kWgBatchTile;
  const int64_t chunks = (in_dim + kWgChunk - 1) / kWgChunk;
  const int64_t c_begin = chunks * split / splits, c_end = chunks * (split + 1) / splits;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      mbarrier_init(&full[s], 128);      // the producer's threads, and the bytes of X
      mbarrier_init(&empty[s], 256);     // the consumers' threads
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // The producer: the next three chunks' lists are in flight while this one is written (their
    // loads take longer than writing one chunk).
    const int64_t band = o0 / kWgBandRows;
    const int32_t* offsets = tile_off + band * (chunks + 1);
    const auto load = [&](WgWords& w, int64_t c) {
      if (c < c_end) wg_load_words(lists, offsets[c], offsets[c + 1] - offsets[c], w);
    };
    WgWords w0, w1, w2;
    load(w0, c_begin);
    load(w1, c_begin + 1);
    load(w2, c_begin + 2);
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int i = int(c - c_begin), s = i % kWgStages;
      if (i >= kWgStages) mbarrier_wait(&empty[s], ((i / kWgStages) - 1) & 1);
      unsigned char* w_tile = smem + s * kWgStageBytes;
      if (threadIdx.x == 0) {
        mbarrier_expect_tx(&full[s], kWgXTileBytes);
        tma_load_2d(w_tile + kWgTileBytes, &x_map, int32_t(c * kWgChunk), int32_t(n0), &full[s]);
      }
      // Zero the tile (16 KiB: 8 16-byte stores per thread), then the words over it.
      const uint32_t tile = shared_address(w_tile);
#pragma unroll
      for (int q = 0; q < kWgTileBytes / 16 / 128; ++q) st_shared_zero16(tile + (threadIdx.x + 128 * q) * 16);
      named_barrier_sync(1, 128);
      wg_store_words(lists, offsets[c], w0, tile, spare);
      w0 = w1;
      w1 = w2;
      load(w2, c + 3);
      fence_proxy_async();
      mbarrier_arrive(&full[s]);
    }
  } else {
    // A consumer: rows 64 (warpgroup - 1) .. + 63 of the band.
    constexpr int kAcc = kWgBatchTile / 2;  // the m64nN accumulators per thread
    float acc[kAcc];
#pragma unroll
    for (int j = 0; j < kAcc; ++j) acc[j] = 0.f;
    const int half = warpgroup - 1;
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int i = int(c - c_begin), s = i % kWgStages;
      mbarrier_wait(&full[s], (i / kWgStages) & 1);
      const unsigned char* w_tile = smem + s * kWgStageBytes + half * 64 * 128;
      const unsigned char* x_tile = smem + s * kWgStageBytes + kWgTileBytes;
      wgmma_fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kWgChunk / 16; ++k)
        wgmma_m64n256k16<T>(acc, wg_descriptor(w_tile + k * 32), wg_descriptor(x_tile + k * 32));
      wgmma_commit();
      // One chunk's products stay queued behind this one's: the previous chunk's stage is free.
      wgmma_wait<1>();
      wgmma_fence_operands(acc);
      if (i > 0) mbarrier_arrive(&empty[(i - 1) % kWgStages]);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);

    // The epilogue: thread (warp w, lane l) holds rows 16 w + l / 4 (+ 8) of its 64 and batch rows
    // 8 j + 2 (l % 4) (+ 1) of the tile.
    const int t = threadIdx.x % 128, w = t / 32, l = t % 32;
    if (splits > 1) {
      // Partial tiles through shared memory, [kWgBatchTile][kWgBandRows + 4] floats over the stages.
      __syncwarp();
      named_barrier_sync(2, 256);
      float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
      for (int j = 0; j < kWgBatchTile / 8; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int row = half * 64 + w * 16 + l / 4 + (q / 2) * 8, b = j * 8 + (l % 4) * 2 + (q % 2);
          partial[b * kWgPartialStride + row] = acc[4 * j + q];
        }
      }
    }
    if (splits == 1) {
#pragma unroll
      for (int j = 0; j < kWgBatchTile / 8; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int64_t o = o0 + half * 64 + w * 16 + l / 4 + (q / 2) * 8;
          const int64_t b = n0 + j * 8 + (l % 4) * 2 + (q % 2);
          if (o < out_dim && b < n) {
            float v = acc[4 * j + q];
            if (bias != nullptr) v += to_accum(bias[o]);
            out[b * out_dim + o] = from_accum<T>(apply_activation(v, act));
          }
        }
      }
    }
  }
  if (splits > 1)
    store_split_band_tile<T, kWgBandRows, kWgBatchTile, kWgPartialStride, kWgThreads>(
        reinterpret_cast<float*>(smem), o0, out_dim, n0, n, bias, out, act, split, splits);
#else
  __trap();  // built for sm_90a only; the planner takes this kernel on compute capability 9.0
#endif
}

}  // namespace snack::cuda::detail
