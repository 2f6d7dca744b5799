// The launch geometry of the SpMM kernels: one statement of each number, read by the kernels
// (rows_kernel.cuh, wide_rows_kernel.cuh) and by the planner (plan.cpp, compiled without CUDA).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../common/grid.h"
#include "snack/pattern.h"
#include "snack/spmm.h"
#include "snack/value_types.h"

namespace snack::cuda::detail {

// `bytes` rounded up to a whole number of 16-byte vectors.
SNACK_HOST_DEVICE constexpr size_t round_up_16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// ---- the row kernels (rows_kernel.cuh) ----
constexpr int kSpmmWarps = 8;    // warps per block
constexpr int kRowsBlocksPerSm = 4;  // resident blocks per SM at the kernel's 64-register bound (32 warps)
constexpr int kUnroll = 8;       // entries per lane per chunk (the next chunk is requested before this one is used)
constexpr int kLongPerWarp = 8;  // long rows a warp can hand to its block

// Lane layout of a batch tile: V consecutive batch rows per lane (4 where possible, so one entry's
// inputs come in 16-byte vectors), GN lanes along the batch, GS = 32 / GN lanes along the entries.
template <int NPAD>
struct TileLayout {
  static constexpr int V = NPAD < 4 ? NPAD : 4;
  static constexpr int GN = NPAD / V;
  static constexpr int GS = 32 / GN;
  static_assert(GN >= 1 && GN <= 32 && GN * GS == 32, "batch tile must be a power of two in [1, 128]");
};
// TileLayout<tile>::GS for a tile known at run time: the lanes along the entries.
constexpr int lanes_along_entries(int batch_tile) { return 32 / (batch_tile / (batch_tile < 4 ? batch_tile : 4)); }

// ---- the wide_rows kernel (wide_rows_kernel.cuh) ----
constexpr int kWideSlots = 8;                // consecutive slots per lane per chunk
constexpr int kWideChunk = 32 * kWideSlots;  // slots per warp per chunk
constexpr int kWideMaxRows = 16;             // rows per warp group, at most
constexpr int kWideXPerThread = 8;           // X values a thread stages per round (tile of 1)
constexpr int kWideLongPerWarp = 8;          // long rows a warp can hand to its block

// Batch rows per pass, at most: 16 for 16-bit values (a column's tile is two 16-byte pieces), 8 for
// fp32 (see kWideMaxGatherBytes in plan.cpp), 1 for fp64.
SNACK_HOST_DEVICE constexpr int wide_max_tile(size_t value_bytes) {
  return value_bytes == 2 ? 16 : value_bytes == 4 ? 8 : 1;
}

// Warps per SM the kernel is built for: 32 (a 64-register bound), 16 for a tile of 16 rows, whose 16
// running sums per lane spill under 64 registers.
SNACK_HOST_DEVICE constexpr int wide_rows_warps_per_sm(int tile) { return tile == 16 ? 16 : 32; }

// Threads per block: a tile of one row runs 4 blocks of 256 per SM (each stages its own copy of the
// row, 4-16 KiB; measured faster than one block of 1024); a wider tile (up to 16 x in_dim values)
// is staged once per SM by one block of all the SM's warps.
SNACK_HOST_DEVICE constexpr int wide_rows_threads(int tile) { return tile == 1 ? 256 : wide_rows_warps_per_sm(tile) * 32; }

// Bytes of the batch tile of X in shared memory (in_dim x tile values), rounded up to 16.
SNACK_HOST_DEVICE size_t wide_rows_tile_bytes(size_t value_bytes, int64_t in_dim, int tile) {
  return round_up_16(size_t(in_dim) * size_t(tile) * value_bytes);
}

// The lanes' partial sums of one group: rows_per_warp x tile per lane, an odd stride so that lanes
// parking the same row at once fall in different banks.
SNACK_HOST_DEVICE constexpr int wide_rows_partial_stride(int rows_per_warp, int tile) {
  return (rows_per_warp * tile) | 1;
}

// Dynamic shared memory of the kernel: the tile of X, then the lanes' partial sums.
SNACK_HOST_DEVICE size_t wide_rows_smem_bytes(size_t value_bytes, size_t accum_bytes, int64_t in_dim, int tile,
                                              int rows_per_warp) {
  return wide_rows_tile_bytes(value_bytes, in_dim, tile) +
         size_t(wide_rows_threads(tile)) * size_t(wide_rows_partial_stride(rows_per_warp, tile)) * accum_bytes;
}

// Static shared memory of the kernel (the groups' row pointers, the lists of deferred long rows).
SNACK_HOST_DEVICE constexpr size_t wide_rows_static_smem(int tile) {
  return sizeof(int32_t) * size_t(wide_rows_threads(tile) / 32) * (kWideMaxRows + 1 + 3 * kWideLongPerWarp + 1);
}

// ---- the shared_x kernel (shared_x_kernel.cuh) ----
// A block owns a band of output rows and one batch tile; the tile's transposed input is staged in
// shared memory chunk by chunk, and every row of the band reads it there.
constexpr int kSharedXRowsPerWarp = 4;     // output rows a warp owns (its accumulators: rows x a lane's batch rows)
constexpr int kSharedXStages = 2;          // chunks of X in flight: the next one is copied while this one is used
constexpr int kSharedXWindow = 32;         // a row's slots loaded per round (one per lane)

// Warps per block: 32 in fp32, a band of 128 rows (each staged chunk feeds twice the rows of 16
// warps, and the SM has twice the warps to hide the latency of its shared-memory loads: measured on
// the H200, 16384x4096 fp32, N = 1024, 90% / 95%: 1560 / 996 us against 2042 / 1385 us with 16
// warps of 4 rows, 1810 / 1151 us with 16 warps of 8); 16 warps (64 rows) for 16-bit values, whose
// 8 accumulators per row would spill under the 64-register bound of 1024 threads.
SNACK_HOST_DEVICE constexpr int shared_x_warps(size_t value_bytes) { return value_bytes == 4 ? 32 : 16; }
SNACK_HOST_DEVICE constexpr int shared_x_band_rows(size_t value_bytes) {
  return shared_x_warps(value_bytes) * kSharedXRowsPerWarp;
}

// 16-byte vectors of the batch per lane: up to two in fp32 (the planner takes one where the grid of
// two would leave SMs idle), one in 16 bits. At two a lane multiplies 8 batch rows per entry, as it
// does in 16 bits, so that an entry's broadcast and address cost spread over 8 multiply-adds.
SNACK_HOST_DEVICE constexpr int shared_x_max_vectors(size_t value_bytes) { return value_bytes == 4 ? 2 : 1; }

// Batch rows of a block: `vectors` 16-byte vectors of the value type per lane (128 or 256 fp32 rows,
// 256 16-bit rows).
SNACK_HOST_DEVICE constexpr int shared_x_tile(size_t value_bytes, int vectors) {
  return int(32 * (16 / value_bytes)) * vectors;
}

// Dynamic shared memory of one block: the stages of the chunk ([chunk][tile] values each), which the
// epilogue reuses for the band's output tile ([tile][band + 1] floats), then the rows' windows of
// parked slots and the rows' ends.
SNACK_HOST_DEVICE constexpr size_t shared_x_stage_bytes(size_t value_bytes, int chunk, int tile) {
  return size_t(chunk) * size_t(tile) * value_bytes;
}
SNACK_HOST_DEVICE constexpr size_t shared_x_smem_bytes(size_t value_bytes, int chunk, int tile) {
  const size_t stages = kSharedXStages * shared_x_stage_bytes(value_bytes, chunk, tile);
  const size_t epilogue = sizeof(float) * size_t(tile) * size_t(shared_x_band_rows(value_bytes) + 1);
  const size_t windows = size_t(shared_x_band_rows(value_bytes)) * kSharedXWindow * 8;  // (offset, value) pairs
  const size_t row_ends = sizeof(int32_t) * size_t(shared_x_band_rows(value_bytes));
  return (stages > epilogue ? stages : epilogue) + windows + row_ends;
}

// ---- the tensor-core kernel (tensor_core_kernel.cuh) ----
constexpr int kTcWarps = 4;                   // warps per block, 16 output rows each
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kTcBandRows = kTcWarps * 16;    // output rows per block
constexpr int kTcChunk = 64;                  // input columns per expanded tile
constexpr int kTcMaxSplits = 8;               // blocks of a cluster that split one band's chunks
constexpr int kTcSplitMinColumns = 2 * kTcChunk;  // a band splits in two from this many input columns
constexpr int kTcMinTile = 16;                // batch rows per block: 16, 32, 64 or 128
constexpr int kTcMaxTile = 128;
constexpr int kTileViewMaxTile = 64;          // tile_view_kernel.cuh: batch rows per block, 16 to 64
constexpr int kTcPartialStride = kTcBandRows + 4;  // floats per batch row of the partial tile

// Values per row of a staged tile of `chunk` columns: 16-byte rows whose stride is an odd number of
// 16-byte units, so that ldmatrix's eight row addresses fall in different bank groups.
SNACK_HOST_DEVICE constexpr int tensor_core_stride(int chunk) { return chunk + 8; }

// Dynamic shared memory of one block: the warps' expanded tiles and two stages of the chunk of X
// (the partial tile of the epilogue reuses them).
SNACK_HOST_DEVICE constexpr size_t tensor_core_smem_bytes(int tile) {
  return sizeof(uint16_t) * size_t(kTcWarps * 16 + 2 * tile) * size_t(tensor_core_stride(kTcChunk));
}
// The tile_view kernel's: three tiles, two stages of the input's chunk, and where its `steps` tiles
// lie (the forward's steps + 1 starts; the transposed product's starts, ends and first slots).
SNACK_HOST_DEVICE constexpr size_t tile_view_smem_bytes(int tile, int64_t steps, bool transposed) {
  return sizeof(uint16_t) * size_t(3 * kTcBandRows + 2 * tile) * size_t(tensor_core_stride(kTcChunk)) +
         sizeof(int32_t) * size_t(transposed ? 3 * steps : steps + 1);
}
static_assert(sizeof(float) * kTcMinTile * kTcPartialStride <= tensor_core_smem_bytes(kTcMinTile) &&
                  sizeof(float) * kTcMaxTile * kTcPartialStride <= tensor_core_smem_bytes(kTcMaxTile),
              "the partial tile fits in the staging buffers");

// ---- the tile fragments' kernel (fragment_kernel.cuh) ----
// Tiles (and chunks of X) in flight through shared memory. 5-8 stages were no faster and, taking
// more shared memory, cost some launches their clusters (docs/kernels.md, "Measured and not kept").
constexpr int kFragmentStages = 4;
constexpr int kFragmentMaxTile = 64;    // batch rows per block: 16, 32 or 64
// A block's warps: consumers that multiply (a warp per k-step of a tile; two per k-step, each with
// half of the rows, at batch tiles of 64), and one producer warp that feeds the stages.
SNACK_HOST_DEVICE constexpr int fragment_consumers(int tile) { return tile == 64 ? 2 * kTcWarps : kTcWarps; }
SNACK_HOST_DEVICE constexpr int fragment_threads(int tile) { return (fragment_consumers(tile) + 1) * 32; }
// Blocks an SM holds by their registers: the kernel's __launch_bounds__ minimum (64 / 96 / 96
// registers a thread at batch tiles of 16 / 32 / 64; no local memory at 16, 32-36 bytes a thread
// spilled at 32 and 64 by CUDA 13.0's ptxas), which the planner's clusters count on.
SNACK_HOST_DEVICE constexpr int fragment_blocks_per_sm(int tile) { return tile == 16 ? 6 : tile == 32 ? 4 : 2; }

// The part of a block's shared memory that holds first its `stages` stages (a chunk of X, a tile's
// header and up to `stage_words` of its registers each), then, at the end, the block's partial tile of
// the band in `parts` parts (kTcWarps, one per k-step, for the mma.sync kernel; one for the wgmma
// kernel), [tile][kTcPartialStride] floats each; its barriers and the steps' tiles follow it.
SNACK_HOST_DEVICE constexpr size_t fragment_body_bytes(int tile, int stage_words, int stages, int parts = kTcWarps) {
  const size_t staged = size_t(stages) * (sizeof(uint16_t) * size_t(tile) * size_t(kTcChunk) +
                                          sizeof(uint32_t) * size_t(kFragmentHeaderWords + stage_words));
  const size_t partials = sizeof(float) * size_t(parts) * size_t(tile) * size_t(kTcPartialStride);
  return staged > partials ? staged : partials;
}
// Dynamic shared memory of one block: the stages or the partial tiles (fragment_body_bytes), the
// stages' two mbarriers each, where its `steps` tiles lie, and the slack that aligns the chunks of X
// to 1024 bytes (their swizzle).
SNACK_HOST_DEVICE constexpr size_t fragment_smem_bytes(int tile, int stage_words, int64_t steps,
                                                       int parts = kTcWarps) {
  return fragment_body_bytes(tile, stage_words, kFragmentStages, parts) +
         2 * sizeof(uint64_t) * size_t(kFragmentStages) + 2 * sizeof(int32_t) * size_t(steps) + 1024;
}

// ---- the tile fragments on wgmma (fragment_wgmma_kernel.cuh; sm_90a) ----
// One or two consumer warpgroups (warp w of a warpgroup multiplies row block w of every k-step of a
// tile, its A operands in registers, with wgmma m64nNk16 over the chunk of X in shared memory; two
// take the band's tiles in turn, each with accumulators of its own) and the producer warp.
constexpr int kFragmentWgmmaMaxTile = 128;  // batch rows per block: 16, 32, 64 or 128 (the wgmma's N)
constexpr int kFragmentWgmmaMaxGroups = kMaxFragmentWarpgroups;
static_assert(kFragmentStages % kFragmentWgmmaMaxGroups == 0, "a warpgroup's steps keep to its own stages");
SNACK_HOST_DEVICE constexpr int fragment_wgmma_threads(int groups) { return (groups * kTcWarps + 1) * 32; }
// Blocks an SM holds by their registers (the kernel's __launch_bounds__ minimum): the accumulators
// (tile / 2 a thread) and a row block's operands of the four k-steps (16 registers); 58 / 61 / 77 /
// 110 registers a thread at batch tiles of 16 / 32 / 64 / 128 with one warpgroup, 64 / 64 / 77 / 110
// with two, no local memory. One warpgroup: 5 / 5 / 4 / 2 blocks (at 128 the stages' shared memory
// holds two); two: 3 / 3 / 2 / 1.
SNACK_HOST_DEVICE constexpr int fragment_wgmma_blocks_per_sm(int tile, int groups = 1) {
  return groups == 1 ? (tile == 16 || tile == 32 ? 5 : tile == 64 ? 4 : 2)
                     : (tile == 16 || tile == 32 ? 3 : tile == 64 ? 2 : 1);
}

// The blocks of a fragment kernel, as the planner's clusters count them.
struct FragmentBlocks {
  int words = 0;          // register words a stage holds (fragment_stage_words)
  int parts = kTcWarps;   // parts of the partial tile (fragment_body_bytes)
  int threads = 0;
  int blocks_per_sm = 0;  // by registers
  bool wgmma = false;     // the wgmma kernel's blocks
};
// groups: the wgmma kernel's consumer warpgroups, one part of the partial tile each.
SNACK_HOST_DEVICE constexpr FragmentBlocks fragment_blocks(int tile, int words, bool wgmma, int groups = 1) {
  return wgmma ? FragmentBlocks{words, groups, fragment_wgmma_threads(groups),
                                fragment_wgmma_blocks_per_sm(tile, groups), true}
               : FragmentBlocks{words, kTcWarps, fragment_threads(tile), fragment_blocks_per_sm(tile), false};
}
// Register words a stage holds: those of a tile of the layer's mean density (a register holds two
// positions of a row), a quarter more and 64 to spare, in 16-byte units, at most a whole tile's. A
// denser tile is read from global memory in place.
inline int fragment_stage_words(int64_t out_dim, int64_t in_dim, int64_t nnz) {
  const double density = out_dim * in_dim > 0 ? double(nnz) / (double(out_dim) * double(in_dim)) : 0.0;
  const double filled = 1.0 - (1.0 - density) * (1.0 - density);
  const int all = int(kFragmentHeaderWords) * kFragmentRegisters;
  const int words = int(std::ceil((1.25 * filled * all + 64.0) / 4.0)) * 4;
  return words < all ? words : all;
}

// ---- the wgmma kernel (wgmma_kernel.cuh; sm_90a) ----
constexpr int kWgBandRows = 128;     // output rows per block: two consumer warpgroups of 64
constexpr int kWgBatchTile = 256;    // batch rows per block (the wgmma's N: each expanded tile feeds 256 rows)
constexpr int kWgChunk = 64;         // input columns per stage: one 128-byte swizzle row of 16-bit values
constexpr int kWgStages = 4;         // chunks in flight
constexpr int kWgThreads = 384;      // the producer warpgroup and two consumers
constexpr int kWgMaxSplits = 8;      // blocks of a cluster that split one band's chunks
constexpr int kWgTileBytes = kWgBandRows * kWgChunk * 2;    // one expanded W tile
constexpr int kWgXTileBytes = kWgBatchTile * kWgChunk * 2;   // the chunk of X beside it
constexpr int kWgStageBytes = kWgTileBytes + kWgXTileBytes;
constexpr int kWgPartialStride = kWgBandRows + 4;  // floats per batch row of a split block's partial tile

// Dynamic shared memory of one block: the stages, their full and empty barriers, 16 spare bytes, and
// the slack that aligns the stages to 1024 bytes (the swizzle's period).
SNACK_HOST_DEVICE constexpr size_t wgmma_smem_bytes() {
  return size_t(kWgStages) * kWgStageBytes + 2 * kWgStages * sizeof(uint64_t) + 16 + 1024;
}

// The tile lists of a product (wgmma_kernel.cuh) in its workspace, byte offsets from its start: the
// packed words (4 bytes a slot), the bands' list offsets, the rows' chunk starts and their slots
// before them in the band's chunk lists.
struct WgmmaLists {
  size_t tile_off = 0, starts = 0, row_before = 0, bytes = 0;
};
SNACK_HOST_DEVICE WgmmaLists wgmma_lists(int64_t out_dim, int64_t in_dim, int64_t nnz) {
  const size_t chunks = size_t((in_dim + kWgChunk - 1) / kWgChunk);
  const size_t bands = size_t((out_dim + kWgBandRows - 1) / kWgBandRows);
  WgmmaLists l;
  l.tile_off = round_up_16(sizeof(uint32_t) * size_t(nnz));
  l.starts = l.tile_off + round_up_16(sizeof(int32_t) * bands * (chunks + 1));
  l.row_before = l.starts + round_up_16(sizeof(uint16_t) * size_t(out_dim) * (chunks + 1));
  l.bytes = l.row_before + round_up_16(sizeof(uint16_t) * size_t(out_dim) * chunks);
  return l;
}
static_assert(sizeof(float) * kWgBatchTile * kWgPartialStride <= size_t(kWgStages) * kWgStageBytes,
              "the partial tile fits in the stages");
static_assert(kWgBandRows == 128 && kWgBatchTile == 256 && kWgChunk == 64 && kWgThreads == 384,
              "the kernel's roles and wgmma shape assume these");

// ---- dense blocks ----
constexpr int kExpandThreads = 256;  // a warp per expanded output row; the staged kernel's block per row
// The widest row the staged expansion builds in shared memory (the default 48 KB a block, no opt-in):
// 24576 16-bit or 12288 fp32 values; wider rows take the warp-per-row kernel.
constexpr int64_t kExpandStagedMaxBytes = 48 * 1024;
constexpr int64_t expand_staged_row_bytes(int64_t width, int64_t value_bytes) {
  return (width * value_bytes + 15) / 16 * 16;
}
// Blocks of the staged expansion: a row each, at most this many in flight over a grid that loops.
constexpr int64_t kExpandStagedMaxBlocks = 8192;
// How expand_block launches for `count` outputs of `width` values (and so what the planner's
// kDenseBlocks plan reports): a block per output row staged in shared memory (smem_bytes) where the
// row fits, else a warp per output row; kExpandThreads threads either way.
struct ExpandLaunch {
  bool staged = false;
  int64_t grid = 1;
  size_t smem_bytes = 0;
};
inline ExpandLaunch expand_launch(int64_t count, int64_t width, int64_t value_bytes) {
  const int64_t row_bytes = expand_staged_row_bytes(width, value_bytes);
  if (row_bytes <= kExpandStagedMaxBytes)
    return {true, ::snack::detail::grid_for(count, 1, kExpandStagedMaxBlocks), size_t(row_bytes)};
  return {false, ::snack::detail::grid_for(count * 32, kExpandThreads), 0};  // the warps loop past its cap
}

// ---- the reference kernels ----
constexpr int kCooItems = 8;  // consecutive slots per thread of the atomic COO kernel

}  // namespace snack::cuda::detail
