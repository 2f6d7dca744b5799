// The tensor-core forward over tile fragments (snack/pattern.h; bf16, fp16; fp32 accumulation): each
// 64 x 64 tile of W arrives already laid out as the A operands of mma.sync m16n8k16, only the
// registers that hold a slot, so nothing is expanded in shared memory: no zeroed tile, no scatter, no
// ldmatrix of W. Per lane and k-step a header word says which of its 16 registers are stored and where
// they start; the lane walks its stored registers in order, one pointer step per stored register.
//
// A block owns a band of 64 output rows and a batch tile of 16, 32 or 64 rows, and walks the band's
// tiles (a thread-block cluster splits them and sums the partial tiles as the other tensor-core
// kernels do). Its consumer warps split each tile's 64 columns: warp g multiplies the tile's k-step g
// (16 columns), so each warp loads a quarter of the chunk of X (one ldmatrix per 16 batch rows)
// instead of all of it, and the partial tiles are summed once at the end, in k-step order
// (deterministic). At batch tiles of 64 two warps share a k-step, each with half of the rows, so
// that a warp's accumulators stay at 64. A producer warp hands each tile's header and registers
// (whole runs of 16-byte words) and its chunk of X (a box of the input's tensor map, swizzled, zeros
// past the batch and the inputs) to the copy engine, which completes them on the stage's mbarrier,
// `stages` steps ahead (kFragmentStages); the consumers release a stage on a second mbarrier, and no
// block barrier paces the steps. Without a tensor map (rows of X not 16-byte aligned) the consumers
// stage X in the same layout. A tile with more registers than a stage holds (denser than the launch
// planned for) is read from global memory in place. The stages, the producer and the block's set-up
// are shared with the wgmma kernel over the same fragments (fragment_wgmma_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cluster.cuh"
#include "../device/cuda_utils.cuh"
#include "../device/hopper.cuh"
#include "../device/mma.cuh"
#include "../device/tensor_map.h"
#include "shapes.h"
#include "snack/activation.h"
#include "snack/pattern.h"
#include "snack/spmm.h"
#include "snack/value_types.h"
#include "tensor_core_kernel.cuh"

namespace snack::cuda::detail {

static_assert(kTcBandRows == kTileViewRows && kTcChunk == kTileViewCols && kTcWarps == kFragmentGroups,
              "a warp per k-step of the view's tiles");

// What the kernel reads of the tile fragments (pack_tile_fragments) or bitmap fragments
// (pack_tile_bitmaps).
struct FragmentView {
  const int2* __restrict__ tiles;        // per tile: first value word (from `values`), value words
  const uint32_t* __restrict__ headers;  // per tile, fragment_header_words(bitmaps)
  const uint32_t* __restrict__ values;
  int64_t chunks;  // tiles per band
  bool bitmaps;    // bitmap fragments: the kernels' kBitmaps
};

// Header words a tile's stage holds.
SNACK_HOST_DEVICE constexpr int fragment_header_words(bool bitmaps) {
  return int(bitmaps ? kBitmapHeaderWords : kFragmentHeaderWords);
}

// a = one 16 x 16 A operand (a k-step's row block) from bitmap fragments: its four 8 x 8 blocks'
// masks (`masks`, eight words, 8-byte aligned, in shared memory) and values from `vals` (the
// operand's first, in shared memory or kInPlace global memory), zeros where nothing is stored. A
// lane's two positions of a block are its bits 2 lane and 2 lane + 1; `below` masks the bits before
// them. The lanes loading a block read one run of at most 64 values.
template <bool kInPlace>
__device__ __forceinline__ void load_bitmap_operand(uint32_t (&a)[4], const uint32_t* masks, const uint16_t* vals,
                                                    uint64_t below, int lane) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint2 words = reinterpret_cast<const uint2*>(masks)[q];
    const uint64_t mask = uint64_t(words.x) | uint64_t(words.y) << 32;
    const uint32_t two = uint32_t(mask >> (2 * lane)) & 3u;
    const uint16_t* at = vals + __popcll(mask & below);
    uint32_t lo = 0u, hi = 0u;
    if (two & 1u) lo = kInPlace ? __ldg(at) : *at;
    if (two & 2u) hi = kInPlace ? __ldg(at + (two & 1u)) : at[two & 1u];
    a[q] = lo | hi << 16;
    vals += __popcll(mask);
  }
}

// acc[m] += the warp's k-step of the tile (its row blocks m < kBlocks) x the chunk of X (b: the
// k-step's B fragments, two n-tiles of 8 per entry). `mask` and `regs`: the lane's stored registers
// of those row blocks (four bits each) and where they start, in shared memory or (kInPlace) in
// global memory. Each row block finds its first stored register by a popcount and then steps
// through its own, so the pointer chains are independent.
template <typename T, int NT, int kBlocks, bool kInPlace>
__device__ __forceinline__ void multiply_fragments(float (&acc)[kBlocks][NT / 8][4], const uint32_t (&b)[NT / 16][4],
                                                   uint32_t mask, const uint32_t* regs) {
#pragma unroll
  for (int m = 0; m < kBlocks; ++m) {
    const uint32_t* at = regs + (m == 0 ? 0 : __popc(mask & ((1u << (4 * m)) - 1u)));
    uint32_t a[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      a[q] = 0u;
      if (mask >> (4 * m + q) & 1u) { a[q] = kInPlace ? __ldg(at) : *at; ++at; }
    }
#pragma unroll
    for (int j = 0; j < NT / 16; ++j) {
      mma_16816<T>(acc[m][2 * j], a, b[j][0], b[j][1]);
      mma_16816<T>(acc[m][2 * j + 1], a, b[j][2], b[j][3]);
    }
  }
}

// acc[m] += the warp's k-step of the tile as multiply_fragments, from bitmap fragments: `header` the
// tile's (masks and operands' first values), `vals` its values; the warp's k-step `group` and its
// first row block.
template <typename T, int NT, int kBlocks, bool kInPlace>
__device__ __forceinline__ void multiply_bitmaps(float (&acc)[kBlocks][NT / 8][4], const uint32_t (&b)[NT / 16][4],
                                                 const uint32_t* header, const uint16_t* vals, int group,
                                                 int first_block, int lane) {
  const uint64_t below = (uint64_t(1) << (2 * lane)) - 1u;
#pragma unroll
  for (int m = 0; m < kBlocks; ++m) {
    const int operand = group * 4 + first_block + m;
    uint32_t a[4];
    load_bitmap_operand<kInPlace>(a, header + 8 * operand, vals + header[2 * kBitmapBlocks + operand], below, lane);
#pragma unroll
    for (int j = 0; j < NT / 16; ++j) {
      mma_16816<T>(acc[m][2 * j], a, b[j][0], b[j][1]);
      mma_16816<T>(acc[m][2 * j + 1], a, b[j][2], b[j][3]);
    }
  }
}

// Where a block's stages lie in its dynamic shared memory (fragment_smem_bytes): the chunks of X,
// [stages][NT][128 bytes] swizzled from a 1024-byte boundary, then per stage a tile's header
// (header_words) and up to stage_words of its registers (its values, for bitmap fragments); after the
// body (fragment_body_bytes, which the partial tiles reuse at the end) the stages' barriers (filled:
// the step landed; released: the consumers are done with it) and the block's steps' tiles.
struct FragmentStages {
  unsigned char* xs;
  uint32_t* words;
  int stride;  // words per stage
  uint64_t* filled;
  uint64_t* released;
  int2* step_tiles;
  float* partials;  // [parts][NT][kTcPartialStride] over the stages, at the end
};
template <int NT>
__device__ __forceinline__ FragmentStages carve_fragment_stages(unsigned char* smem_raw, int stage_words, int stages,
                                                                int parts, int header_words) {
  constexpr uint32_t kChunkBytes = NT * kTcChunk * 2;
  unsigned char* smem = smem_raw + ((1024u - (shared_address(smem_raw) & 1023u)) & 1023u);
  FragmentStages st;
  st.xs = smem;
  st.words = reinterpret_cast<uint32_t*>(smem + stages * kChunkBytes);
  st.stride = header_words + stage_words;
  st.filled = reinterpret_cast<uint64_t*>(
      smem + fragment_body_bytes(NT, stage_words + header_words - int(kFragmentHeaderWords), stages, parts));
  st.released = st.filled + stages;
  st.step_tiles = reinterpret_cast<int2*>(st.released + stages);
  st.partials = reinterpret_cast<float*>(smem);
  return st;
}

// A block's share of its band: the band's first output row, the batch tile's first row, the block's
// chunks (steps) and its first tile. Sets up the stages' barriers (`consumers` warps release a stage)
// and reads where the block's tiles lie into shared memory, all `threads` taking part.
struct FragmentSteps {
  int split;
  int64_t o0, n0, c_begin, first_tile;
  int steps;
};
template <int NT>
__device__ __forceinline__ FragmentSteps begin_fragment_steps(const FragmentStages& st, const FragmentView& view,
                                                              int splits, int stages, int consumers, int threads) {
  FragmentSteps b;
  b.split = int(blockIdx.x % unsigned(splits));
  const int64_t band = blockIdx.x / unsigned(splits);
  b.o0 = band * kTcBandRows;
  b.n0 = int64_t(blockIdx.y) * NT;
  b.c_begin = view.chunks * b.split / splits;
  b.steps = int(view.chunks * (b.split + 1) / splits - b.c_begin);
  b.first_tile = band * view.chunks + b.c_begin;
  const int t = threadIdx.x;
  if (t == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&st.filled[s], 1), mbarrier_init(&st.released[s], consumers);
    mbarrier_init_fence();
  }
  for (int i = t; i < b.steps; i += threads) st.step_tiles[i] = view.tiles[b.first_tile + i];
  __syncthreads();
  return b;
}

// How long a waiting warp may sleep per try: the phase's completion wakes it sooner.
constexpr uint32_t kFragmentSuspendNs = 1u << 20;

// The producer warp: step i's header, registers (those that fit a stage) and chunk of X (with a map)
// into stage i % stages once the consumer warps have released the step before it there (every one
// arrived on `released`); one lane hands the copies to the copy engine, which completes them on the
// stage's `filled` barrier.
template <int NT>
__device__ __forceinline__ void feed_fragment_stages(const FragmentStages& st, const CUtensorMap& x_map,
                                                     const FragmentView& view, int64_t first_tile, int64_t c_begin,
                                                     int64_t n0, int steps, int stage_words, int stages, bool mapped,
                                                     int lane) {
  const int header_words = fragment_header_words(view.bitmaps);
  const uint32_t header_bytes = uint32_t(header_words) * sizeof(uint32_t);
  constexpr uint32_t kChunkBytes = NT * kTcChunk * 2;
  int s = 0;
  uint32_t parity = 0u;  // of the phase of released[s] that frees the stage
  for (int i = 0; i < steps; ++i) {
    if (i >= stages) mbarrier_wait(&st.released[s], parity, kFragmentSuspendNs);
    if (lane == 0) {
      const int2 at = st.step_tiles[i];
      uint64_t* bar = &st.filled[s];
      if (at.y == 0) {  // no slot in the tile: nothing to multiply, the phase completes empty
        mbarrier_arrive(bar);
      } else {
        const bool fits = at.y <= stage_words;
        mbarrier_arrive_expect_tx(bar, header_bytes + (fits ? uint32_t(at.y) * 4u : 0u) + (mapped ? kChunkBytes : 0u));
        uint32_t* dst = st.words + s * st.stride;
        bulk_load(dst, view.headers + (first_tile + i) * header_words, header_bytes, bar);
        if (fits) bulk_load(dst + header_words, view.values + at.x, uint32_t(at.y) * 4u, bar);
        if (mapped) tma_load_2d(st.xs + s * kChunkBytes, &x_map, int32_t((c_begin + i) * kTcChunk), int32_t(n0), bar);
      }
    }
    // Round r of the stages (r >= 1) waits for phase r - 1 of their released barriers.
    if (++s == stages) s = 0, parity ^= i + 1 > stages ? 1u : 0u;
  }
}

// Where X's rows are not 16-byte aligned the consumers stage each chunk with copy_16bit_rows_swizzled
// (hopper.cuh), whose rows are 64 values: the copy engine's box of a chunk.
static_assert(kTcChunk == 64, "a chunk of X is one swizzled row of 64 inputs (copy_16bit_rows_swizzled)");

// Launches a fragment kernel (`kernel`, its batch tiles of NT rows; `name` for a launch error) as
// `plan` says: its grid, clusters, threads and shared memory. X goes through the copy engine where
// its rows are whole 16-byte units, else the kernel's threads stage it.
template <int NT, typename T, typename... Params>
Status launch_fragment_kernel(void (*kernel)(Params...), const char* name, const SpmmPlan& plan,
                              const FragmentView& view, int64_t out_dim, int64_t in_dim, const T* in, int64_t n,
                              const T* bias, T* out, Activation act, Stream stream) {
  if (plan.smem_bytes > 48 * 1024)
    SNACK_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  CUtensorMap x_map{};
  const bool mapped = tensor_map_16bit_fits(in, in_dim);
  if (mapped) SNACK_RETURN_IF_ERROR(tensor_map_16bit(in, n, in_dim, kTcChunk, NT, &x_map));
  // Bitmap fragments hold fewer value words than registers, at every density: their stages take the
  // registers' shared memory (as the planner counted it), the longer header included.
  const int stage_words = fragment_stage_words(out_dim, in_dim, plan.problem.nnz) -
                          (fragment_header_words(view.bitmaps) - int(kFragmentHeaderWords));
  const dim3 grid(unsigned(plan.grid_x), unsigned(ceil_div(n, NT)));
  SNACK_CUDA_RETURN_IF_ERROR(launch_clusters_x(kernel, grid, dim3(unsigned(plan.threads)), plan.smem_bytes, stream,
                                               unsigned(plan.k_splits), x_map, view, out_dim, in_dim, in, n, bias,
                                               out, act, plan.k_splits, stage_words, kFragmentStages, mapped));
  return check_launch(name);
}

// out[n, o] = act(sum_e value(e) * in[n, input(e)] + bias[o]) for the band of blockIdx.x / splits and the
// batch tile of blockIdx.y; the cluster's blocks split the band's tiles. stage_words: the value words
// a stage holds, `stages` the stages (kFragmentStages, fragment_smem_bytes; a launch argument rather
// than a template constant, with which the compiler took more registers). mapped: x_map is `in`'s
// tensor map in boxes of kTcChunk inputs x NT rows (tensor_map_16bit); otherwise (rows of `in` not
// 16-byte aligned) the consumers stage X.
//
// Warps 0 .. consumers - 1 multiply (fragment_consumers(NT)); the last warp only feeds the stages,
// `stages` steps ahead: it waits for a stage's `released` barrier (every consumer's arrival), then
// one lane hands the step's copies to the copy engine, which completes them on the stage's `filled`
// barrier. No block barrier per step: a consumer waits only for its stage to land.
//
// kBitmaps: `view` holds bitmap fragments (pack_tile_bitmaps): each operand built from its blocks'
// masks and values (load_bitmap_operand).
template <typename T, int NT, bool kBitmaps>
__global__ void __launch_bounds__(fragment_threads(NT), fragment_blocks_per_sm(NT)) spmm_fragment_kernel(
    const __grid_constant__ CUtensorMap x_map, FragmentView view, int64_t out_dim, int64_t in_dim,
    const T* __restrict__ in, int64_t n, const T* __restrict__ bias, T* __restrict__ out, Activation act, int splits,
    int stage_words, int stages, bool mapped) {
  static_assert(NT == 16 || NT == 32 || NT == 64, "batch tiles of 16, 32 or 64 rows");
  static_assert(kTcChunk * sizeof(T) == 128, "a chunk's row of X is one 128-byte swizzled row");
  constexpr uint32_t kChunkBytes = NT * kTcChunk * sizeof(T);
  constexpr int kConsumers = fragment_consumers(NT);
  constexpr int kConsumerThreads = kConsumers * 32;
  constexpr int kProducer = kConsumers;            // the warp that feeds the stages
  constexpr int kBlocks = 4 * kTcWarps / kConsumers;  // row blocks of 16 per consumer
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  constexpr int kHeaderWords = fragment_header_words(kBitmaps);
  const FragmentStages st = carve_fragment_stages<NT>(smem_raw, stage_words, stages, kTcWarps, kHeaderWords);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = threadIdx.x;
  const FragmentSteps share = begin_fragment_steps<NT>(st, view, splits, stages, kConsumers, fragment_threads(NT));
  const int split = share.split, steps = share.steps;
  const int64_t o0 = share.o0, n0 = share.n0, c_begin = share.c_begin, first_tile = share.first_tile;

  // A consumer's k-step and first row block, and its accumulators (the producer's are never used).
  const int group = warp % kTcWarps, first_block = kConsumers == kTcWarps ? 0 : (warp / kTcWarps) * kBlocks;
  float acc[kBlocks][NT / 8][4];
  if (warp == kProducer) {
    feed_fragment_stages<NT>(st, x_map, view, first_tile, c_begin, n0, steps, stage_words, stages, mapped, lane);
  } else {
#pragma unroll
    for (int m = 0; m < kBlocks; ++m)
#pragma unroll
      for (int j = 0; j < NT / 8; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    // Without a map of X the consumers stage its chunks, stages - 1 steps ahead: step i's chunk into
    // stage i % stages, which every consumer left at the barrier of step i - stages + 1.
    auto stage_x = [&](int i) {
      if (st.step_tiles[i].y == 0) return;
      copy_16bit_rows_swizzled<NT>(st.xs + (i % stages) * kChunkBytes, in, n, in_dim, n0, (c_begin + i) * kTcChunk,
                                   t, kConsumerThreads);
    };
    if (!mapped)
      for (int i = 0; i < stages - 1 && i < steps; ++i) stage_x(i);
    int s = 0;             // step i's stage
    uint32_t parity = 0u;  // of its barrier's phase: flips each round of the stages
    for (int i = 0; i < steps; ++i) {
      if (!mapped) {
        named_barrier_sync(1, kConsumerThreads);  // the consumers are done with step i - 1 and have staged step i
        if (i + stages - 1 < steps) stage_x(i + stages - 1);
      }
      mbarrier_wait(&st.filled[s], parity, kFragmentSuspendNs);
      const int2 at = st.step_tiles[i];
      if (at.y != 0) {
        const uint32_t* stage = st.words + s * st.stride;
        // B fragments: 8 x 8 matrices of batch rows (2 j + lane / 16) * 8 + lane % 8, columns 16 group +
        // 8 ((lane / 8) % 2), in the swizzled chunk.
        uint32_t b[NT / 16][4];
        const unsigned char* x_chunk = st.xs + s * kChunkBytes;
#pragma unroll
        for (int j = 0; j < NT / 16; ++j)
          ldmatrix_x4(b[j],
                      x_chunk + wg_swizzled((2 * j + lane / 16) * 8 + lane % 8, group * 16 + ((lane / 8) % 2) * 8));
        if constexpr (kBitmaps) {
          if (at.y <= stage_words)
            multiply_bitmaps<T, NT, kBlocks, false>(acc, b, stage,
                                                    reinterpret_cast<const uint16_t*>(stage + kHeaderWords), group,
                                                    first_block, lane);
          else
            multiply_bitmaps<T, NT, kBlocks, true>(acc, b, stage,
                                                   reinterpret_cast<const uint16_t*>(view.values + at.x), group,
                                                   first_block, lane);
        } else {
          // The warp's row blocks' bits of the lane's mask, and where their registers start.
          const uint32_t head = stage[group * kFragmentLanes + lane];
          const uint32_t before = (1u << (4 * first_block)) - 1u;
          const uint32_t mask = (head & 0xffffu) >> (4 * first_block);
          const uint32_t offset = (head >> 16) + (first_block == 0 ? 0u : __popc(head & before));
          if (at.y <= stage_words)
            multiply_fragments<T, NT, kBlocks, false>(acc, b, mask, stage + kHeaderWords + offset);
          else
            multiply_fragments<T, NT, kBlocks, true>(acc, b, mask, view.values + at.x + offset);
        }
      }
      // The warp's reads of the stage are done (its registers hold what it loaded): one arrival.
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&st.released[s]);
      if (++s == stages) s = 0, parity ^= 1u;
    }
  }

  // Each k-step's partial tile into its own place over the stages (every copy has landed: the
  // consumers waited for each), then summed in k-step order and across the cluster as they are stored.
  __syncthreads();
  if (warp < kConsumers) {
    float* part = st.partials + group * NT * kTcPartialStride;
#pragma unroll
    for (int m = 0; m < kBlocks; ++m)
#pragma unroll
      for (int j = 0; j < NT / 8; ++j)
        store_accumulator_quad(part, (first_block + m) * 16, j * 8, lane, acc[m][j][0], acc[m][j][1], acc[m][j][2],
                               acc[m][j][3]);
  }
  // The consumers store; the producer joins the barriers.
  store_split_band_tile<T, kTcBandRows, NT, kTcPartialStride, kConsumerThreads, kTcWarps>(
      st.partials, o0, out_dim, n0, n, bias, out, act, split, splits);
}

}  // namespace snack::cuda::detail
