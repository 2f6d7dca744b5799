// The launch geometry of the SDDMM kernels, read by the kernels (kernels.cuh) and by the planner
// (plan.cpp, compiled without CUDA).
#pragma once

#include <cstddef>
#include <cstdint>

namespace snack::cuda::detail {

constexpr int kSddmmWarpsPerBlock = 8;
constexpr int kSddmmThreads = kSddmmWarpsPerBlock * 32;
constexpr int kSddmmRowsBlocksPerSm = 4;  // the rows kernel's launch bound
constexpr int kSddmmVectorSlotsPerLane = 4;  // slots a lane group of the vector kernel takes per pass

// Slots per lane per chunk of sddmm_rows_kernel (its kU): fewer where the row's dY takes more
// registers (NC chunks of 4 values), and with AdamW's step in the epilogue up to 4 batch lanes,
// where a lane would otherwise keep 2-8 slots' sums, values and moments (measured on the H200, with
// AdamW: 16384x4096, 90%, N = 8: 105 against 184 us, N = 16: 116 against 123 us; at N = 32, 8 batch
// lanes, 4 slots lost: 185 against 149 us).
constexpr int rows_slots_per_lane(int GN, int NC, bool updates_state) {
  return NC >= 4 || (updates_state && GN <= 4) ? 4 : 8;
}

// The staged kernel (sddmm_staged_kernel): a block of kStagedThreads owns a band of kStagedBand rows
// of W and a chunk of columns, and streams the batch through shared memory in tiles of
// kStagedBatchTile samples: X[tile, chunk] and dY[tile, band], both transposed on the way in, so that
// a slot's samples are contiguous. Groups of kStagedGroupLanes lanes each take a run of at most
// kStagedSlotsPerGroup of the block's slots, whose sums stay in registers for the whole batch; a
// chunk with more than kStagedCapacity slots runs in passes.
constexpr int kStagedBand = 128;
constexpr int kStagedThreads = 1024;
constexpr int kStagedGroupLanes = 8;
constexpr int kStagedGroups = kStagedThreads / kStagedGroupLanes;
constexpr int kStagedSlotsPerGroup = 16;
constexpr int kStagedCapacity = kStagedGroups * kStagedSlotsPerGroup;
constexpr int kStagedBatchTile = kStagedGroupLanes * 4 * 2;  // two 16-byte vectors of a slot per lane
constexpr int kStagedStride = kStagedBatchTile + 4;  // floats per staged row: 16-byte aligned, no store conflicts
constexpr int kStagedMaxChunk = 256;                 // a column's place in a stage fits a slot word's 16 bits
constexpr int kStagedMinChunk = 16;                  // a tile's copy is at least one element per thread
constexpr double kStagedExpectedSlots = 1800.0;      // slots a tile of W is planned to hold on average
constexpr double kStagedMinDensity = 0.03;           // below it the vector kernel keeps large batches

// Floats of the staged kernel's stages for chunks of `chunk_cols` columns: with 4-byte copies two
// transposed stages of X and dY; with 16-byte copies one, and two stages of untransposed rows.
constexpr size_t staged_stage_floats(int chunk_cols, bool vector_copies) {
  return vector_copies ? size_t(chunk_cols + kStagedBand) * kStagedStride +
                             size_t(2) * kStagedBatchTile * size_t(chunk_cols + 4 + kStagedBand + 4)
                       : size_t(2) * size_t(chunk_cols + kStagedBand) * kStagedStride;
}

// Bytes of shared memory of the staged kernel: its stages, the slots' (row, column) words, each
// row's first slot and place in the block's list, and the warps' sums of the scan that places them.
constexpr size_t staged_smem_bytes(int chunk_cols, bool vector_copies) {
  return staged_stage_floats(chunk_cols, vector_copies) * sizeof(float) +
         size_t(kStagedCapacity + kStagedSlotsPerGroup) * sizeof(uint32_t) +
         size_t(2 * kStagedBand + 1 + kStagedBand / 32) * sizeof(int32_t);
}

// 16-byte copies take chunks of at most this many columns (two stages of rows and one transposed
// stage of 256 columns would not fit).
constexpr int kStagedMaxVectorChunk = 128;

// The tensor-core SDDMM (sddmm_tensor_core_kernel, 16-bit operands): a block of kTcDwThreads owns a
// band of kTcDwRows rows of W and a run of tiles of kTcDwCols columns. For each tile it streams the
// batch through shared memory kTcDwBatchChunk samples at a time in kTcDwStages stages (dY's band and
// X's tile, each row of kTcDwRows or kTcDwCols values padded by kTcDwPad so that ldmatrix reads
// without bank conflicts), multiplies on mma.sync (warps 4 x 2, each 32 rows x 64 columns), then rounds the tile to the
// operands' type into shared memory, from which each warp reads the stored slots of its 16 rows.
constexpr int kTcDwRows = 128;
constexpr int kTcDwCols = 128;
constexpr int kTcDwBatchChunk = 32;
constexpr int kTcDwStages = 3;  // chunks staged ahead: two load while one multiplies
constexpr int kTcDwPad = 8;
constexpr int kTcDwWarps = 8;
constexpr int kTcDwThreads = kTcDwWarps * 32;
constexpr int kTcDwBlocksPerSm = 2;  // the launch bound: 128 registers per thread
constexpr int kTcDwOperandStride = kTcDwRows + kTcDwPad;  // 16-bit values per staged row of dY or X
constexpr int kTcDwTileStride = kTcDwCols + kTcDwPad;     // 16-bit values per row of the staged tile
static_assert(kTcDwRows == kTcDwCols, "dY's band and X's tile share one staged row length");
static_assert(kTcDwRows == kTcDwWarps * 16, "each warp reads the slots of 16 rows");

// Dynamic shared memory of the tensor-core SDDMM: the stages of dY's band and X's tile, and the tile.
constexpr size_t tc_dw_smem_bytes() {
  return (size_t(kTcDwStages) * 2 * kTcDwBatchChunk * kTcDwOperandStride + size_t(kTcDwRows) * kTcDwTileStride) *
         sizeof(uint16_t);
}

// The SDDMM over the tile view (sddmm_tile_view_kernel, 16-bit operands, batches of at most
// kTvDwMaxBatch): a block of kTvDwThreads owns a band of 64 rows of W (the view's) and a run of its
// tiles; dY's band is staged once, the batch padded to a multiple of 16, and kept in registers as
// the mma's A fragments; each tile's chunk of X is staged beside it (two stages), multiplied, rounded
// to the operands' type into shared memory, and the tile's entries read out of it.
constexpr int kTvDwWarps = 4;  // 16 rows of the band each
constexpr int kTvDwThreads = kTvDwWarps * 32;
constexpr int kTvDwMaxBatch = 128;
constexpr int kTvDwStride = 64 + 8;  // 16-bit values per staged row (ldmatrix without bank conflicts)

// The batch in the kernel's k-steps of 16 rows: a power of two, 1 to kTvDwMaxBatch / 16.
constexpr int tv_dw_k_steps(int64_t n) {
  int ks = 1;
  while (16 * ks < n && 16 * ks < kTvDwMaxBatch) ks *= 2;
  return ks;
}

// Dynamic shared memory for a batch padded to `batch` rows and `steps` tiles per block: dY's band and
// two stages of X's chunk ([batch][kTvDwStride] each), the rounded tile ([64][64], tile_read_out.cuh),
// and the block's tile pointers (steps + 1, and one spare word: the compiler may read the next tile's
// pair of pointers with one vector load before it knows whether there is a next tile).
constexpr size_t tv_dw_smem_bytes(int batch, int64_t steps) {
  return (size_t(3 * batch) * kTvDwStride + 64 * 64) * sizeof(uint16_t) + size_t(steps + 2) * sizeof(int32_t);
}

// The SDDMM over the tile view with wgmma (sddmm_tile_view_wgmma_kernel, Hopper, batches of at most
// kTvDwMaxBatch): a warpgroup per band of 64 rows, one or kTvWgMaxGroups of them a block sharing each
// chunk of X. dY's band stays in registers as wgmma's A operand; each tile's chunk of X is staged
// N-major in the 128-byte swizzle (kTvWgStages stages, two tiles ahead), and a tile's products run
// while the warpgroup reads out the tile before, which it rounded into one of two tiles in shared
// memory.
constexpr int kTvWgMaxGroups = 2;
// Blocks an SM holds by registers, the kernel's launch bound: at most 128 registers a thread.
constexpr int tv_wg_blocks_per_sm(int groups) { return 4 / groups; }
constexpr int kTvWgStages = 3;
constexpr int kTvWgAlign = 1024;  // the swizzle's period: the stages start on it
constexpr size_t kTvWgStaticSmem = kTvWgStages * sizeof(uint64_t);  // the stages' barriers (copy engine)
// Rounds of a warpgroup's 512 entries loaded into registers a step ahead of a tile's read-out; the
// rest of a fuller tile is read in place.
constexpr int kTvWgRoundsAhead = 1;
// Sets of those registers that take turns: a tile's entries are loaded kTvWgEntrySets - 1 steps
// ahead of its read-out. Three against two (H100, bf16, forced, one warpgroup a block): 16384x4096,
// 90%, N = 16: 45.5 against 56.1 us; 11008x4096, 90%, N = 16: 41.4 against 49.2; with two a block
// within 5% either way. Two rounds of entries ahead instead of one: 80% 1.08x faster (16384x4096,
// N = 16, two warpgroups: 82.8 against 90.2 us), 90-95% 1.04-1.07x slower (N = 16: 50.7 against 48.9).
constexpr int kTvWgEntrySets = 3;

// Batches of kTvDwMaxBatch + 1 to kTvWgMaxBatch rows run in batch_chunks chunks of kTvDwMaxBatch: dY's
// band stays in shared memory, each chunk's A operand is loaded from it in turn, and each tile's
// products accumulate over the chunks of X, staged one after another through the same stages.
constexpr int kTvWgMaxBatch = 4 * kTvDwMaxBatch;
constexpr int tv_wg_batch_chunks(int64_t n) {
  return n <= kTvDwMaxBatch ? 1 : int((n + kTvDwMaxBatch - 1) / kTvDwMaxBatch);
}
// 16-bit values of a warpgroup's region: its two rounded tiles ([2][64][kTvDwStride]), where dY's band
// is staged first when it fits one chunk, and past one chunk dY's band after them.
constexpr size_t tv_wg_group_elems(int batch, int batch_chunks) {
  return size_t(2 * 64 * kTvDwStride) + (batch_chunks > 1 ? size_t(batch_chunks) * batch * kTvDwStride : 0);
}

// Dynamic shared memory for a batch padded to `batch` rows, `groups` warpgroups and `steps` tiles per
// block: the slack to align the stages, the stages of X's chunk ([batch][64] each), per warpgroup a
// region of [2][64][kTvDwStride] where dY's band is staged first and its two rounded tiles ([64][64]
// each) are held after, and each warpgroup's tile pointers (steps + 1 and the spare word, as
// tv_dw_smem_bytes).
// Past kTvDwMaxBatch rows (batch_chunks > 1) each warpgroup's region also holds all of dY's band
// ([batch_chunks * batch][kTvDwStride]) after its two tiles.
constexpr size_t tv_wg_smem_bytes(int batch, int groups, int64_t steps, int batch_chunks = 1) {
  return size_t(kTvWgAlign) + size_t(kTvWgStages) * batch * 64 * sizeof(uint16_t) +
         size_t(groups) * (tv_wg_group_elems(batch, batch_chunks) * sizeof(uint16_t) + size_t(steps + 2) * sizeof(int32_t));
}

}  // namespace snack::cuda::detail
