// The SDDMM over the tile view on Hopper's wgmma (bf16, fp16; fp32 accumulation; compiled for sm_90a
// in tile_view_wgmma.cu): the weight gradient of each 64 x 64 tile of W that holds slots, computed as
// a dense tile of dY^T X, of which the tile's entries (snack/pattern.h) are read out.
//
// The same work as sddmm_tile_view_kernel (tile_view_kernel.cuh), arranged so that the products and
// the read-out overlap: a warpgroup owns a band of 64 rows of W, its dY kept in registers as wgmma's A
// operand (warp w holding rows 16 w .. 16 w + 15, mma.sync's A fragments) for all of the band's tiles,
// and per tile it issues the tile's products (m64n64k16 over X's chunk, staged N-major in the 128-byte
// swizzle, two tiles ahead in three stages, by the copy engine where X's rows are whole 16-byte
// units), reads out the tile before from shared memory while they run, then rounds the new tile into
// the other of its two tiles. Where a block holds two warpgroups, each of a band of its own, they
// share every staged chunk of X: half the chunks' traffic from L2 per tile. Past kTvDwMaxBatch rows
// the batch runs in chunks of kTvDwMaxBatch (shapes.h, tv_wg_batch_chunks): dY's band stays in shared
// memory, each chunk's A operand is loaded from it in turn, and a tile's products accumulate over its
// chunks of X, staged one after another (step j of the stages is chunk j % C of tile j / C), so a
// tile is read out once whatever the batch. Every gradient is one fixed chain of products:
// deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device/cp_async.cuh"
#include "../device/hopper.cuh"
#include "../device/mma.cuh"
#include "../device/tile_view.cuh"
#include "shapes.h"
#include "snack/pattern.h"
#include "tensor_core_kernel.cuh"
#include "tile_read_out.cuh"

namespace snack::cuda {
namespace {

// dv[s] = sum_n dY[n, row(s)] X[n, col(s)] for the slots of the G bands of block group blockIdx.x /
// splits (bands G i .. G i + G - 1 of 64 rows, the last group possibly short) in its split's run of
// tiles, handed to `out` rounded to T. The batch is padded to C * 16 * KS rows (zeros past n), C =
// tv_wg_batch_chunks(n) (kChunked: at KS = kTvDwMaxBatch / 16, else 1, a separate instantiation so
// that batches of one chunk keep their registers); n > 0.
// vec_dy / vec_x: the operand's rows are 16-byte vectors (stage_16bit_block). mapped: x_map is X's
// tensor map in boxes of 64 columns x 16 KS rows (tensor_map_16bit), and the copy engine stages each
// chunk (one instruction, against 16 KS 16-byte copies per thread); otherwise the threads do.
template <typename T, int KS, int G, bool kChunked, typename Out>
__global__ void __launch_bounds__(G * 128, detail::tv_wg_blocks_per_sm(G))
    sddmm_tile_view_wgmma_kernel(const __grid_constant__ CUtensorMap x_map, detail::TileView view,
                                 const T* __restrict__ dy, const T* __restrict__ x, int64_t rows, int64_t cols,
                                 int64_t n, int64_t bands, int splits, bool vec_dy, bool vec_x, bool mapped,
                                 Out out) {
#if defined(SNACK_WGMMA_BUILT)
  using namespace detail;
  static_assert(!Out::kUpdatesState, "AdamW's step runs after the kernel (sddmm_adamw_from_gradient_kernel)");
  static_assert(kTileViewRows == 64 && kTileViewCols == 64, "a warpgroup's m64n64 tile");
  static_assert(G >= 1 && G <= kTvWgMaxGroups, "warpgroups a block");
  constexpr int NB = 16 * KS;
  static_assert(NB <= kTvDwMaxBatch && NB * kTvDwStride <= 2 * 64 * kTvDwStride, "dY's band fits the two tiles");
  constexpr int kStride = kTvDwStride;
  constexpr int kThreads = G * 128;
  constexpr int kShare = 4 * 128;                       // entries per round of a warpgroup
  constexpr uint32_t kStageBytes = NB * 64 * sizeof(uint16_t);  // [NB][64]: a multiple of the swizzle's period
  constexpr uint32_t kKStepBytes = 16 * 64 * sizeof(uint16_t);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t x_ready[kTvWgStages];  // mapped: each stage's chunk landed (one phase a chunk)
  unsigned char* xs = smem_raw + (kTvWgAlign - shared_address(smem_raw) % kTvWgAlign) % kTvWgAlign;
  const int group = threadIdx.x / 128, t = threadIdx.x % 128, warp = t / 32, lane = threadIdx.x % 32;
  // This warpgroup's two rounded tiles ([2][64][64], tile_read_out.cuh) in a region of [2][64][kStride],
  // where dY's band ([NB][kStride]) is staged first (C = 1) or after which it is kept ([C * NB][kStride]),
  // and its tile pointers.
  static_assert(!kChunked || NB == kTvDwMaxBatch, "chunks of a whole kTvDwMaxBatch");
  const int C = kChunked ? tv_wg_batch_chunks(n) : 1;
  const size_t region = tv_wg_group_elems(NB, C);
  uint16_t* tiles = reinterpret_cast<uint16_t*>(xs + kTvWgStages * kStageBytes) + group * region;
  uint16_t* dy_band = C > 1 ? tiles + 2 * 64 * kStride : tiles;
  const int split = int(blockIdx.x % unsigned(splits));
  const int64_t band = int64_t(blockIdx.x / unsigned(splits)) * G + group;
  const bool active = band < bands;  // a short last group: the spare warpgroup stages and waits only
  const int64_t r0 = band * kTileViewRows;
  const int64_t chunks = view.chunks;
  const int64_t c_begin = chunks * split / splits, c_end = chunks * (split + 1) / splits;
  const int steps = int(c_end - c_begin);
  if (steps == 0) return;  // the same for the whole block
  int32_t* tp = reinterpret_cast<int32_t*>(reinterpret_cast<uint16_t*>(xs + kTvWgStages * kStageBytes) + G * region) +
                group * (steps + 2);
  const int staged = steps * C;  // chunks of X through the stages
  int64_t band_first = 0;
  if (active) {
    for (int i = t; i <= steps; i += 128) tp[i] = view.tile_ptr[band * chunks + c_begin + i];
    if (t == 0) tp[steps + 1] = view.tile_ptr[band * chunks + c_end];  // the spare word (shapes.h)
    band_first = view.row_ptr[r0];
  }
  const auto stage_x = [&](int j) {  // batch chunk j % C of the run's tile j / C into stage j % kTvWgStages
    unsigned char* stage = xs + (j % kTvWgStages) * kStageBytes;
    const int64_t col0 = (c_begin + j / C) * 64, row0 = int64_t(j % C) * NB;
    if (!mapped) {
      stage_16bit_rows_swizzled<NB, kThreads>(stage, x, n, cols, row0, col0, vec_x, threadIdx.x);
    } else if (threadIdx.x == 0) {
      mbarrier_arrive_expect_tx(&x_ready[j % kTvWgStages], kStageBytes);
      tma_load_2d(stage, &x_map, int32_t(col0), int32_t(row0), &x_ready[j % kTvWgStages]);
    }
  };
  if (mapped && threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kTvWgStages; ++s) mbarrier_init(&x_ready[s], 1);
    mbarrier_init_fence();
  }

  // Group 0: dY's bands and X's first chunk; group 1: the second chunk (empty where there is none).
  if (active)
    for (int c = 0; c < C; ++c)
      stage_16bit_block<NB, 64, kStride, 128>(dy_band + size_t(c) * NB * kStride, dy, n, rows, int64_t(c) * NB, r0,
                                              vec_dy, t);
  stage_x(0);
  cp_async_commit();
  if (staged > 1) stage_x(1);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  // The warp's A fragments (its 16 rows x batch chunk c of dY's band): for every tile of the run where
  // the batch is one chunk, else loaded again for each chunk.
  uint32_t a[KS][4] = {};
  const auto load_a = [&](int c) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      ldmatrix_x4_trans(a[ks], dy_band + (size_t(c) * NB + ks * 16 + (lane / 16) * 8 + lane % 8) * kStride +
                                   warp * 16 + ((lane / 8) % 2) * 8);
  };
  if (active) load_a(0);
  out.begin();
  const Out band_out = out.from_slot(band_first);

  // A tile's first kTvWgRoundsAhead rounds of entries, loaded a step ahead of its read-out.
  struct Entries {
    TileShare<128> round[kTvWgRoundsAhead];
  };
  const auto load_entries = [&](Entries& s, int i) {
    if (!active || i >= steps) return;
#pragma unroll
    for (int q = 0; q < kTvWgRoundsAhead; ++q) load_tile_share(s.round[q], view.entries, tp[i] + q * kShare, tp[i + 1], t);
  };
  // Tile i's gradients out of tiles[i % 2]. A share starts at a tile's first entry or a whole round
  // past it: only the tile's end bounds it.
  const auto read_out = [&](const Entries& s, int i) {
    const uint16_t* tile = tiles + (i & 1) * 64 * 64;
    const int32_t end = tp[i + 1];
    const auto apply = [&](const TileShare<128>& share) { read_out_share<T>(share, end, tile, band_out); };
#pragma unroll
    for (int q = 0; q < kTvWgRoundsAhead; ++q) apply(s.round[q]);
    // A tile fuller than the rounds loaded ahead: the rest, read in place.
    for (int32_t round = tp[i] + kTvWgRoundsAhead * kShare; round < end; round += kShare) {
      TileShare<128> more;
      load_tile_share(more, view.entries, round, end, t);
      apply(more);
    }
  };

  // kTvWgEntrySets sets of entries (two or three) take turns: set i % kTvWgEntrySets holds tile i's,
  // loaded kTvWgEntrySets - 1 steps before its read-out. Named sets and unrolled turns keep them in
  // registers (an array of them, or a reference to either, would go to local memory).
  constexpr int kSets = kTvWgEntrySets;
  static_assert(kSets == 2 || kSets == 3, "two or three sets of entries");
  Entries s0{}, s1{}, s2{};
  load_entries(s0, 0);
  load_entries(s1, 1);
  if constexpr (kSets == 3) load_entries(s2, 2);
  // Step i: tile i's products (over its C chunks of X), tile i - 1 read out with `before` (its
  // entries) during the first, which then takes tile i + kSets - 1's.
  const auto step = [&](int i, Entries& before) {
    float acc[32];
#pragma unroll
    for (int q = 0; q < 32; ++q) acc[q] = 0.f;
    for (int c = 0; c < C; ++c) {
      const int j = i * C + c;
      cp_async_wait<1>();
      fence_proxy_async();  // this thread's copies of chunk j, before the tensor cores read them
      __syncthreads();      // chunk j in place; tile i - 1 complete; every product of chunk j - 1 done
      if (j + 2 < staged) stage_x(j + 2);  // into the stage that chunk j - 1 left
      cp_async_commit();
      if (!active) continue;
      // The stage's k-th chunk (k = j / kTvWgStages) completes its barrier's phase k. The chunk after
      // next goes into a stage only past the barrier above, by which every thread has waited for the
      // stage's chunk before: no thread is two phases behind.
      if (mapped) mbarrier_wait(&x_ready[j % kTvWgStages], uint32_t(j / kTvWgStages) & 1u);
      if (C > 1) load_a(c);
      wgmma_fence();
      const uint64_t b0 = wg_descriptor(xs + (j % kTvWgStages) * kStageBytes);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        wgmma_m64nk16_rs<T, 64, true>(acc, a[ks], b0 + ((ks * kKStepBytes) >> 4));
      wgmma_commit();
      if (c == 0 && i > 0) {
        read_out(before, i - 1);
        load_entries(before, i + kSets - 1);
      }
      wgmma_wait<0>();
      wgmma_fence_operands(acc);
    }
    if (!active) return;
    uint16_t* tile = tiles + (i & 1) * 64 * 64;
    uint32_t pairs[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      pairs[j][0] = round_pair<T>(acc[4 * j], acc[4 * j + 1]);
      pairs[j][1] = round_pair<T>(acc[4 * j + 2], acc[4 * j + 3]);
    }
    store_rounded_rows(tile, warp * 16, lane, pairs);
  };
  // kSets steps a turn, so that the sets take turns without a copy (a copy waits for the loads in
  // flight into the set copied).
  for (int i = 0; i < steps; i += kSets) {
    step(i, kSets == 2 ? s1 : s2);
    if (i + 1 < steps) step(i + 1, s0);
    if (kSets == 3 && i + 2 < steps) step(i + 2, s1);
  }
  __syncthreads();  // the last tile complete
  if (active) {
    const int last = (steps - 1) % kSets;
    if (last == 0) read_out(s0, steps - 1);
    if (last == 1) read_out(s1, steps - 1);
    if (kSets == 3 && last == 2) read_out(s2, steps - 1);
  }
  cp_async_wait_all();
#else
  __trap();  // built without sm_90a: the launcher refuses it (check_wgmma_device)
#endif
}

}  // namespace
}  // namespace snack::cuda
