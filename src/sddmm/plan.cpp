// The SDDMM planner: which kernel computes the weight gradient, with which lanes and grid. A pure
// function of the problem and the device's limits (compiled without CUDA, tested on the CPU).
#include <algorithm>
#include <string>

#include "../common/dense_blocks.h"
#include "../common/grid.h"
#include "../spmm/wgmma.h"
#include "shapes.h"
#include "snack/sddmm.h"

namespace snack {
namespace {

using cuda::detail::kSddmmThreads;
using detail::ceil_div;
using detail::grid_for;

int64_t padded_batch(int64_t n) { return (n + 3) / 4 * 4; }

double density(const SddmmProblem& p) { return double(p.nnz) / std::max(1.0, double(p.rows) * double(p.cols)); }
int64_t weights(const SddmmProblem& p) { return p.rows * p.cols; }
// Layers of 2^25 weights and more (11008x4096, 16384x4096 in the benchmarks), where the 16-bit
// kernels' measured rules change.
bool huge(const SddmmProblem& p) { return weights(p) >= (int64_t(1) << 25); }

// Below a batch of 4 the slot kernel (one thread per slot, no transposes), but for 16-bit operands on
// layers of 2^24 weights and more, where the kernels that pad the batch to 4 win (in bf16,
// backward_nvidia_h200_tile_view_bf16.md at commit 3fd9d21, N = 1, each kernel forced): storing the
// gradient, the rows kernel from 15% density (4096x4096, 50%: 35.0 against 46.9 us; 16384x4096, 80%:
// 68.3 against 74.2; at 90% the slot kernel, 13.3 against 14.9), and with AdamW's step the vector
// kernel from 10% (16384x4096, 90%: 62.5 against 83.1; 4096x11008, 80%: 84.2 against 109.8; at 95%
// the slot kernel on 4096x4096, 15.7 against 18.8). float32 keeps the slot kernel (fastest on 8 of
// the 9 rows at N = 1 in backward_nvidia_h200.csv).
bool slot_pays(const SddmmProblem& p) {
  if (p.n >= kSddmmVectorMinBatch) return false;
  if (p.value_bytes != 2 || weights(p) < (int64_t(1) << 24)) return true;
  return density(p) < (p.epilogue == SddmmEpilogue::kAdamW ? 0.095 : 0.145);
}

// Measured on the H200 (bench/results/backward_*): the rows kernel is faster than the vector kernel
// at every shape of the benchmark grid it runs (N = 16: 2.2x at 16384x4096 and 90%, 1.7x at
// 4096x4096); below a batch of 4 the slot kernel, which needs no transposes (slot_pays). With
// AdamW's step in the epilogue the vector kernel is faster at a padded batch of 4 (16384x4096, 90%:
// 88 against 146 us), the rows kernel from 8 (105 against 142 us at N = 8, 116 against 223 at
// N = 16). Their plain SDDMMs are bitwise equal up to a batch of 32; with this epilogue they agree
// to rounding, not bitwise (tested).
SddmmVariant choose_variant(const SddmmProblem& p, int64_t np, SddmmReason* reason) {
  const bool updates_state = p.epilogue == SddmmEpilogue::kAdamW;
  if (slot_pays(p)) {
    *reason = SddmmReason::kSmallBatch;
    return SddmmVariant::kSlot;
  }
  if (np > kSddmmRowsMaxBatch) {
    *reason = SddmmReason::kBeyondRows;
    return SddmmVariant::kVector;
  }
  if (updates_state && np <= 4) {
    *reason = SddmmReason::kAdamWBatchOf4;
    return SddmmVariant::kVector;
  }
  *reason = SddmmReason::kRowsKernel;
  return SddmmVariant::kRows;
}

// The rows kernel's instantiation for a row length of np values (a multiple of 4, at most 128):
// GN lanes along the batch, each holding NC chunks of 4 values (3 lanes run as 4, 5..8 as 8).
void rows_instantiation(int64_t np, int* gn, int* nc) {
  *nc = np > 64 ? 4 : (np > 32 ? 2 : 1);
  if (np > 32) {
    *gn = 8;
    return;
  }
  switch (np / 4) {
    case 1: *gn = 1; break;
    case 2: *gn = 2; break;
    case 3:
    case 4: *gn = 4; break;
    default: *gn = 8; break;
  }
}

// Lanes per row as the forward plans them: about a group of 4 slots per lane at most, then, up to a
// batch of 64, fewer (more rows per warp) while the launch keeps 16 warps per SM. Batches of 65-128
// hold fewer slots per lane (kU = 4) and want the warps: measured on the H200 (every lanes-per-row
// value forced), 5000x5000, N = 128: 221 us with 4 lanes per row against 241 us with 2 (90%), 45.7
// against 48.7 us (99%); at N = 16 the halving was best or within 1%.
// With AdamW's epilogue, one row per warp where rows are long (each lane still walks at least 3
// chunks of a row) and many (two rows per resident warp: 4 blocks of 8 warps per SM): the slots a
// warp updates at once are then consecutive, so their value and moments move in full sectors instead
// of one short run per row. Measured on the H200 (every lanes value forced over 5 shapes x 80-99% x
// N = 8-64): 16384x4096, 90%: N = 16 112.0 -> 103.6 us, N = 8 98.7 -> 82.8 us; 1.010x in geomean over
// the 100 rows, none below 0.968x. Fewer rows (5000x5000, N = 8: 0.93x) or short ones (99%: 0.84x) lose.
int rows_lanes_per_row(const SddmmProblem& p, int gn, int nc, const DeviceLimits& limits) {
  const int free_lanes = 32 / gn;
  const double avg = p.rows > 0 ? double(p.nnz) / double(p.rows) : 0.0;
  int lanes = 1;
  while (lanes < free_lanes && lanes * 4 <= avg) lanes <<= 1;
  const int64_t wanted = int64_t(limits.sms) * 16;
  if (nc < 4) {
    while (lanes > 1 && ceil_div(p.rows, free_lanes / (lanes / 2)) >= wanted) lanes >>= 1;
  }
  if (p.epilogue == SddmmEpilogue::kAdamW) {
    const int slots = cuda::detail::rows_slots_per_lane(gn, nc, true);
    const int64_t resident_warps = int64_t(limits.sms) * cuda::detail::kSddmmRowsBlocksPerSm *
                                   cuda::detail::kSddmmWarpsPerBlock;
    if (avg >= 3.0 * free_lanes * slots && p.rows >= resident_warps * 2) lanes = free_lanes;
  }
  return lanes;
}

// Where the staged kernel beats the vector kernel: float32 batches past the rows kernel's (its stages
// hold float32; 16-bit and float64 operands keep the vector kernel), from 3% density, on a device
// with the shared memory for its smallest chunk and a grid for its bands. Measured on the H200 (every
// path forced, 4096x4096, 16384x4096, 3072x768, N = 1024-8192): at 90-95% staged is 1.05-2.8x faster
// than vector (N = 8192, 90%: 4.7 against 11.7 ms on 4096x4096), but for the small layer at 95% and
// N = 1024 (97 against 84 us); at 99% a tile holds too few slots to pay for its copies and vector is
// 1.1-2.4x faster.

// Why the staged kernel cannot run a problem on this device (Ok where it can): forced, the plan
// reports it; the automatic choice passes over it.
Status staged_refusal(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  if (p.value_bytes != 4) return InvalidArgument("sddmm: staged runs float32 operands (its stages hold float32)");
  if (staged_smem_bytes(kStagedMinChunk, false) > limits.smem_per_block)
    return InvalidArgument("sddmm: staged needs " + std::to_string(staged_smem_bytes(kStagedMinChunk, false)) +
                           " bytes of shared memory per block; this device offers " +
                           std::to_string(limits.smem_per_block));
  if (ceil_div(p.rows, kStagedBand) > detail::kMaxGridY)
    return InvalidArgument("sddmm: staged runs up to " + std::to_string(detail::kMaxGridY * kStagedBand) + " rows");
  return Status::Ok();
}

bool staged_pays(const SddmmProblem& p, int64_t np, const DeviceLimits& limits) {
  return np > kSddmmRowsMaxBatch && density(p) >= cuda::detail::kStagedMinDensity && staged_refusal(p, limits).ok();
}

// Columns per chunk of the staged kernel: the widest power of two (16-256) whose tiles of W expect at
// most kStagedExpectedSlots slots at the pattern's average density (the list holds 2048; a uniform
// pattern's tiles spread by ~sqrt of that, and a fuller tile runs in passes), no wider than needed
// for the columns, within the device's shared memory.
int staged_chunk_cols(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  int chunk = kStagedMaxChunk;
  while (chunk > kStagedMinChunk &&
         (double(kStagedBand) * chunk * density(p) > kStagedExpectedSlots ||
          staged_smem_bytes(chunk, false) > limits.smem_per_block || chunk >= 2 * p.cols))
    chunk /= 2;
  return chunk;
}

// Why the tensor-core kernel cannot run a problem on this device (Ok where it can).
Status tensor_core_refusal(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  if (p.value_bytes != 2) return InvalidArgument("sddmm: tensor_core runs 16-bit operands (bf16, fp16)");
  if (tc_dw_smem_bytes() > limits.smem_per_block)
    return InvalidArgument("sddmm: tensor_core needs " + std::to_string(tc_dw_smem_bytes()) +
                           " bytes of shared memory per block; this device offers " +
                           std::to_string(limits.smem_per_block));
  if (ceil_div(p.rows, kTcDwRows) > detail::kMaxGridY)
    return InvalidArgument("sddmm: tensor_core runs up to " + std::to_string(detail::kMaxGridY * kTcDwRows) + " rows");
  return Status::Ok();
}

// Where the tensor-core kernel beats the CUDA-core SDDMMs for 16-bit operands (the rows kernel's
// gathers grow with N, the tensor-core kernel's tile work with the layer's area). Storing the
// gradient (bench/results/backward_nvidia_h200_bf16.md, every path forced, 80-95%): from a batch of
// 64 at 10% density and up (N = 64: 1.1-3.0x the rows kernel at 80-90%; at 95% 0.8-1.4x) and at a
// batch of 128 from 4.5% (1.2-3.6x at 80-90%, 1.0-1.6x at 95%); past the rows kernel's 128 against
// the vector kernel from 3% density (N = 256: 1.7-10.8x at 80-95%). With AdamW's step the same
// rule holds, the step then running over the stored gradient (SddmmPlan::gradient_in_workspace): the
// rows kernel's fused step costs a little more than its plain product (16384x4096, 90%, N = 64: 211
// against 187 us in the file as committed in 1af9c8b), the tensor-core product plus a pass over the
// slots less (114 us and the pass).
//
// On layers of 2^25 weights it also beats the rows kernel from 16 rows at 25% density and from 32 at
// 15% when the gradient is stored (backward_nvidia_h200_tile_view_bf16.md at commit 3fd9d21:
// 16384x4096, 80%, N = 32: 111.2 against 217.3 us; 70%, N = 16: 134.0 against 174.9; but 4096x11008,
// 80%, N = 16: 97.0 against 81.6, not taken); with AdamW's step there the rows kernel's fused step
// wins (16384x4096, 70%, N = 16: 276.7 against 301.7). Where the pattern holds the tile view,
// `tile_view` takes those rows first (80.7 and 107.8 us).
bool tensor_core_pays(const SddmmProblem& p, int64_t np, const DeviceLimits& limits) {
  if (p.value_bytes != 2 || p.nnz == 0 || p.n == 0 || !tensor_core_refusal(p, limits).ok()) return false;
  const double d = density(p);
  if (np > kSddmmRowsMaxBatch) return d >= 0.03;
  const bool store = p.epilogue == SddmmEpilogue::kStore;
  if (store && huge(p) && ((np >= 32 && d >= 0.15) || (np >= 16 && d >= 0.25))) return true;
  return np >= 64 && d >= (np >= 128 ? 0.045 : 0.075);
}

// Tiles per block of the tensor-core kernel: as few as keep the grid within about 4 blocks per SM
// (2 rounds of its 2 resident blocks), so that a block's start (its cursor seek, the first loads) is
// paid over several tiles while the rounds still even out.
int tensor_core_tiles_per_block(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.cols, kTcDwCols));
  const int64_t bands = std::max<int64_t>(1, ceil_div(p.rows, kTcDwRows));
  const int64_t wanted_blocks = int64_t(limits.sms) * kTcDwBlocksPerSm * 2;
  return int(std::min<int64_t>(tiles, std::max<int64_t>(1, ceil_div(tiles * bands, wanted_blocks))));
}

// Why a tile-view kernel (`name`: tile_view or tile_view_wgmma) cannot run a problem (Ok where it can).
// The wgmma kernel takes batches past kTvDwMaxBatch in chunks of it, up to kTvWgMaxBatch
// (tile_view_wgmma_chunks_pay).
Status tile_view_refusal(const SddmmProblem& p, const std::string& name) {
  using namespace cuda::detail;
  const int64_t max_batch = name == "tile_view_wgmma" ? kTvWgMaxBatch : kTvDwMaxBatch;
  if (p.value_bytes != 2) return InvalidArgument("sddmm: " + name + " runs 16-bit operands (bf16, fp16)");
  if (!p.tile_view)
    return InvalidArgument("sddmm: " + name + ": the pattern holds no tile view (it is built for layers of at most " +
                           std::to_string(kTileViewMaxCols) + " inputs, unless left out)");
  if (p.n > max_batch)
    return InvalidArgument("sddmm: " + name + " runs batches of at most " + std::to_string(max_batch));
  return Status::Ok();
}

// The blocks per band (per group of bands) a tile-view kernel was asked for, or why they cannot run.
Status check_tile_view_splits(const SddmmProblem& p, const std::string& name) {
  const int64_t chunks = std::max<int64_t>(1, tile_view_chunks(p.cols));
  if (p.tile_view_splits < 0 || p.tile_view_splits > chunks)  // 0 asks the planner
    return InvalidArgument("sddmm: " + name + ": " + std::to_string(p.tile_view_splits) +
                           " blocks per band asked; 1 to " + std::to_string(chunks) +
                           " run this product (its bands' tiles)");
  return Status::Ok();
}

// Where the tile-view kernel beats the others for 16-bit operands (a pattern that holds the view, at
// most 128 batch rows). Its time follows the tiles, the rows kernel's the slots times the batch, the
// tensor-core kernel's its 128 x 128 tiles walked through row cursors. Measured on the H200 in bf16
// with every SDDMM kernel forced (backward_nvidia_h200_tile_view_bf16.md at commit 3fd9d21, 768x3072
// to 16384x4096, 50-99%, N = 1-128). Storing the gradient:
//   - on layers under 2^23 weights from 2 rows and 1% density (768x3072, 90%, N = 16: 6.8 against
//     15.4 us for tensor_core; 99%, N = 64: 7.9 against 13.0 for the rows kernel), but not at one row,
//     where the slot kernel is faster (768x3072, 90%: 5.5 against 6.6; its time grows with the batch,
//     the tile view's does not);
//   - on the others from 4% density past 8 rows (16384x4096, 90%, N = 64: 64.0 against 114.3 us for
//     tensor_core; 95%, N = 16: 34.3 against 37.7 for the rows kernel); at 8 rows below 2^25
//     weights (4096x4096, 90%, N = 8: 12.9 against 18.2 for the rows kernel), and on the layers of
//     2^25 weights and more from 7.5% density (11008x4096, N = 8: 90%, 30.2 against 36.5; 50%, 95.8
//     against 134.6; 1.08x in geometric mean over their 12 rows at 50-90%, 0.91-1.40x), but not at
//     95% there (16384x4096, N = 8: 32.6 against 28.4);
// not at one row on the larger layers (16384x4096, 90%: 43.2 against 40.2 for the slot kernel) nor at
// 99% there, where the slots are few (16384x4096, 99%, N = 64: 54.3 against 33.8).
// With AdamW's step (a pass after it over the stored gradient, against the rows and vector kernels'
// step inside their read-out), from 4% density: past 16 rows on layers of 2^23 weights and more
// (16384x4096, 90%, N = 32: 102.6 against 146.9 us for the rows kernel); on the smaller ones past
// 16 rows (from 8 at 10% density) where they have no more rows than columns, else past 32 (past 16
// from 10%) (768x3072, 90%, N = 16: 14.8 against 18.3 for the vector kernel; N = 8: 14.6 against 17.4
// for the rows kernel, 50%: 30.0 against 44.6; 3072x768, 90%, N = 16: 14.8 against 14.4 for the rows
// kernel).
bool tile_view_pays(const SddmmProblem& p) {
  if (p.value_bytes != 2 || !p.tile_view || p.nnz == 0 || p.n == 0 || p.n > cuda::detail::kTvDwMaxBatch)
    return false;
  const double d = density(p);
  const bool small = weights(p) < (int64_t(1) << 23);
  if (p.epilogue == SddmmEpilogue::kAdamW) {
    if (d < 0.04) return false;
    if (!small) return p.n > 16;
    const bool wide = p.rows <= p.cols;
    const int64_t from = wide ? 8 : 16;  // rows past which it pays from 10% density (from 8 on wide layers)
    return p.n > 2 * from || (d >= 0.1 && (p.n > from || (wide && p.n == from)));
  }
  if (small) return p.n > 1 && d >= 0.01;
  if (d < 0.04) return false;
  return p.n > 8 || (p.n == 8 && (!huge(p) || d >= 0.075));
}

// The end of a tile-view kernel's plan (`name`): its shared memory against the device's, and with
// AdamW's step, which runs after the kernel over the stored gradient as for the tensor-core kernel,
// the gradient in the workspace.
// static_smem: the kernel's own __shared__ bytes, which the block's limit holds beside plan.smem_bytes.
Status finish_tile_view_plan(SddmmPlan plan, const std::string& name, const DeviceLimits& limits, SddmmPlan* out,
                             size_t static_smem = 0) {
  if (plan.smem_bytes + static_smem > limits.smem_per_block)
    return InvalidArgument("sddmm: " + name + " needs " + std::to_string(plan.smem_bytes + static_smem) +
                           " bytes of shared memory per block; this device offers " +
                           std::to_string(limits.smem_per_block));
  const SddmmProblem& p = plan.problem;
  plan.gradient_in_workspace = p.epilogue == SddmmEpilogue::kAdamW;
  plan.workspace_bytes = plan.gradient_in_workspace ? size_t(p.nnz) * size_t(p.value_bytes) : 0;
  *out = plan;
  return Status::Ok();
}

// Where the tile view pays, whether its wgmma kernel beats its mma.sync one: on Hopper (a build with
// sm_90a code) past 32 batch rows. Measured on the H100 in bf16, each forced, in one run (768x3072 to
// 16384x4096, 80-95%, N = 1-128, cold L2; the wgmma kernel with three sets of entries): at N = 64 it
// is faster on every layer and density (16384x4096, 90%: 54.1 against 64.4 us; 4096x4096, 90%: 20.0
// against 22.7; 768x3072, 90%: 8.7 against 8.9), at N = 128 by 1.1-1.7x with two warpgroups a block
// (16384x4096, 95%: 60.7 against 100.6; 4096x4096, 90%: 24.4 against 35.8); at N = 32 mixed
// (11008x4096, 95%: 37.8 against 34.5; 16384x4096, 90%: 47.9 against 57.4) and at N <= 16 slower
// but on 16384x4096.
bool tile_view_wgmma_pays(const SddmmProblem& p, const DeviceLimits& limits) {
  return limits.wgmma && p.n > 32;  // limits.wgmma: sm_90a code and a GPU of compute capability 9.0
}

// Past 128 batch rows, the wgmma tile-view kernel over the batch in chunks of 128 against the planner's
// choice before it (tensor_core). Measured on the H100 in bf16 at 80% and 95%, each forced, in one run
// (backward_nvidia_h100_80gb_hbm3_dw_batch_chunks_bf16.md, commit ca4c393, which holds this kernel):
// at 256 rows faster on every layer (3072x768, 80%: 15.3 against 24.5 us; 4096x4096: 52.6 against
// 76.4; 16384x4096, 95%: 134.8 against 216.6), at 512 rows on the layers under 2^24 weights (768x3072,
// 80%: 27.7 against 34.0; 768x2304: 24.1 against 27.5) but not on the larger ones (4096x4096, 80%:
// 115.9 against 112.8; 16384x4096: 430.0 against 390.4). Without AdamW's step (not measured with it)
// and at 4-25% density, the range measured.
bool tile_view_wgmma_chunks_pay(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  if (!limits.wgmma || p.value_bytes != 2 || !p.tile_view || p.nnz == 0 || p.epilogue != SddmmEpilogue::kStore)
    return false;
  if (p.n <= kTvDwMaxBatch || p.n > kTvWgMaxBatch) return false;
  const double d = density(p);
  return d >= 0.04 && d <= 0.25 && (p.n <= 2 * kTvDwMaxBatch || weights(p) < (int64_t(1) << 24));
}

// Warpgroups a block of the wgmma tile-view kernel: two, sharing each chunk of X, at a batch padded to
// 128 rows, where the chunks' reads from L2 weigh most (the same run: 16384x4096, 90%, N = 128: 64.7
// against 82.7 us with one; 4096x4096, 80%: 31.2 against 39.3), one below (N = 64: 11008x4096, 90%:
// 46.9 against 52.1 with two; 768x3072, 90%: 8.7 against 8.8). Past one chunk of the batch each
// warpgroup keeps dY's band in shared memory: one where two do not fit a block (four chunks).
int tile_view_wgmma_groups(const SddmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int batch = 16 * tv_dw_k_steps(p.n);
  if (batch <= 64) return 1;
  const size_t two = tv_wg_smem_bytes(batch, 2, tile_view_chunks(p.cols), tv_wg_batch_chunks(p.n)) + kTvWgStaticSmem;
  return two <= limits.smem_per_block ? 2 : 1;
}

// Blocks per group of bands of the wgmma tile-view kernel: the power of two (at most the band's tiles)
// whose grid takes the fewest tiles' time, counted as waves of the blocks an SM holds (by registers,
// tv_wg_blocks_per_sm, or by shared memory) times each block's run of tiles and two more for its
// start (dY's band staged and loaded, X's first chunks). Fitted to a sweep on the H200 with 1-64
// splits forced (768x3072 to 16384x4096, 80-98%, N = 32-128, one and two warpgroups); measured on the
// H100 with the planner's warpgroups (bench/results/tile_view_splits_nvidia_h100_80gb_hbm3_bf16_dw_wgmma.md,
// commit fbe12d0): within 1.9% of the best count in geometric mean over 72 problems, 1.17x at worst
// (16384x4096, 90%, N = 32: 59.5 against 50.8 us with 8). The rule before it, runs halved while the
// grid stayed under 4 warpgroups per SM, took 4 where this takes 8 on 11008x4096 at 80%, N = 128 (96.2
// against 80.4 us in the same file).
int tile_view_wgmma_splits(const SddmmProblem& p, int groups, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int64_t band_groups = ceil_div(std::max<int64_t>(1, tile_view_bands(p.rows)), groups);
  const int64_t chunks = std::max<int64_t>(1, tile_view_chunks(p.cols));
  const int batch = 16 * tv_dw_k_steps(p.n);
  int best = 1;
  int64_t best_cost = 0;
  for (int splits = 1; splits <= chunks; splits *= 2) {
    const int64_t steps = ceil_div(chunks, splits);
    const size_t block_smem = tv_wg_smem_bytes(batch, groups, steps, tv_wg_batch_chunks(p.n)) + kTvWgStaticSmem +
                              limits.reserved_smem_per_block;
    const int64_t per_sm = std::max<int64_t>(
        1, std::min<int64_t>(tv_wg_blocks_per_sm(groups), int64_t(limits.smem_per_sm / block_smem)));
    const int64_t cost = ceil_div(band_groups * splits, per_sm * limits.sms) * (steps + 2);
    if (splits == 1 || cost < best_cost) best = splits, best_cost = cost;
  }
  return best;
}

// Blocks per band of the mma.sync tile-view kernel: runs of the band's tiles halved while a run holds
// more entries than a block reads out best (2400 in all up to 32 batch rows, 9600 past, where each
// tile's products take longer) or the grid is under 6 blocks per SM, each run keeping at least one
// tile. Short runs pay: more blocks read out at once, and the read-out bounds the kernel. Fitted to a
// sweep on the H200 with 1-64 splits forced (768x3072 to 16384x4096, 80-98%, N = 8-128); measured on
// the H100 (bench/results/tile_view_splits_nvidia_h100_80gb_hbm3_bf16_dw.md, commit fbe12d0): within
// 2.3% of the best count in geometric mean over 144 problems (N = 1-128), 1.21x at worst (4096x11008,
// 80%, N = 64: 77.8 against 64.1 us with 64; 16384x4096, 80%, N = 64: 100.1 against 87.1 with 16).
// The rule before it, on the grid alone (under 8 blocks per SM at these densities), took 8 where this
// takes 32 on 16384x4096 at 80%, N = 16 (96.9 against 62.2 us in the same file) and on 11008x4096
// (67.1 against 45.6).
int tile_view_splits(const SddmmProblem& p, const DeviceLimits& limits) {
  const int64_t bands = std::max<int64_t>(1, tile_view_bands(p.rows));
  const int64_t chunks = std::max<int64_t>(1, tile_view_chunks(p.cols));
  const double per_tile = double(p.nnz) / double(bands * chunks);
  const double run_entries = p.n <= 32 ? 2400.0 : 9600.0;
  int splits = 1;
  while (2 * splits <= chunks && (double(ceil_div(chunks, splits)) * per_tile > run_entries ||
                                  bands * splits < 6 * int64_t(limits.sms)))
    splits *= 2;
  return splits;
}

// Lanes per slot of the vector kernel: one per 4 batch values, rounded up to a power of two, at most 32.
int vector_lanes(int64_t np) {
  const int64_t chunks = std::min<int64_t>(32, np / 4);
  int g = 1;
  while (g < chunks) g <<= 1;
  return g;
}

}  // namespace

Status plan_sddmm(const SddmmProblem& p, const DeviceLimits& limits, SddmmPlan* out) {
  if (limits.sms <= 0) return InvalidArgument("plan_sddmm: device limits must be positive");
  if (p.rows < 0 || p.cols < 0 || p.nnz < 0 || p.n < 0) return InvalidArgument("plan_sddmm: sizes must be non-negative");
  if (p.value_bytes != 2 && p.value_bytes != 4 && p.value_bytes != 8)
    return InvalidArgument("plan_sddmm: values are 2, 4 or 8 bytes, got " + std::to_string(p.value_bytes));
  SddmmPlan plan;
  plan.problem = p;
  const int64_t np = padded_batch(p.n);
  plan.padded_batch = np;
  plan.threads = kSddmmThreads;
  plan.variant = p.requested;
  plan.reason = SddmmReason::kForced;
  if (p.requested == SddmmVariant::kAuto) {
    const bool staged = p.nnz > 0 && staged_pays(p, np, limits);
    detail::DenseBlocksProblem dense{detail::DenseBlocksOp::kWeightGrad, p.rows, p.cols, p.nnz, p.n,
                                     p.value_bytes, p.tf32};
    dense.staged = staged;
    dense.tensor_cores = tensor_core_pays(p, np, limits);
    if (p.gemm && detail::dense_blocks_pay(dense, limits)) {
      plan.variant = SddmmVariant::kDenseBlocks;
      plan.reason = SddmmReason::kDenseBlocks;
    } else if (staged) {
      plan.variant = SddmmVariant::kStaged;
      plan.reason = SddmmReason::kStagedTiles;
    } else if (tile_view_pays(p)) {
      const bool wgmma = tile_view_wgmma_pays(p, limits);
      plan.variant = wgmma ? SddmmVariant::kTileViewWgmma : SddmmVariant::kTileView;
      plan.reason = wgmma ? SddmmReason::kTileViewWgmma : SddmmReason::kTileView;
    } else if (tile_view_wgmma_chunks_pay(p, limits)) {
      plan.variant = SddmmVariant::kTileViewWgmma;
      plan.reason = SddmmReason::kTileViewWgmma;
    } else if (dense.tensor_cores) {
      plan.variant = SddmmVariant::kTensorCore;
      plan.reason = SddmmReason::kTensorCores;
    } else {
      plan.variant = choose_variant(p, np, &plan.reason);
    }
  }
  if (plan.variant == SddmmVariant::kStaged) {
    using namespace cuda::detail;
    SNACK_RETURN_IF_ERROR(staged_refusal(p, limits));
    plan.threads = kStagedThreads;
    plan.chunk_cols = staged_chunk_cols(p, limits);
    // 16-byte copies where rows of X and dY are whole vectors (the launch also checks the pointers)
    // and the chunk fits their stages.
    plan.staged_vector_copies = p.cols % 4 == 0 && p.rows % 4 == 0 && plan.chunk_cols <= kStagedMaxVectorChunk &&
                                staged_smem_bytes(plan.chunk_cols, true) <= limits.smem_per_block;
    plan.smem_bytes = staged_smem_bytes(plan.chunk_cols, plan.staged_vector_copies);
    plan.grid_x = std::max<int64_t>(1, ceil_div(p.cols, plan.chunk_cols));
    plan.grid_y = std::max<int64_t>(1, ceil_div(p.rows, kStagedBand));
    // The batch split over blocks while the tiles of W alone leave the GPU short of 4 blocks per SM
    // in turn, each split keeping at least 4 batch tiles.
    const int64_t tiles = std::max<int64_t>(1, ceil_div(p.n, kStagedBatchTile));
    const int64_t blocks = plan.grid_x * plan.grid_y;
    int64_t splits = 1;
    while (blocks * splits < int64_t(limits.sms) * 4 && tiles >= 8 * splits) splits *= 2;
    plan.split_samples = ceil_div(tiles, splits) * kStagedBatchTile;
    plan.batch_splits = int(std::max<int64_t>(1, ceil_div(p.n, plan.split_samples)));
    // Each split's sums go to a float workspace, added by a kernel of their own that hands them to the
    // epilogue; so do AdamW's, even unsplit: its update at the end of each block, one block per SM,
    // cost more than a separate pass over the slots (16384x4096, 95%, N = 1024, measured on the H200:
    // 1909 us against 1659 for the SDDMM followed by torch's AdamW).
    plan.staged_sums_in_workspace = plan.batch_splits > 1 || p.epilogue == SddmmEpilogue::kAdamW;
    plan.workspace_bytes =
        plan.staged_sums_in_workspace ? size_t(plan.batch_splits) * size_t(p.nnz) * sizeof(float) : 0;
    *out = plan;
    return Status::Ok();
  }
  if (plan.variant == SddmmVariant::kTensorCore) {
    using namespace cuda::detail;
    SNACK_RETURN_IF_ERROR(tensor_core_refusal(p, limits));
    plan.threads = kTcDwThreads;
    plan.smem_bytes = tc_dw_smem_bytes();
    plan.tiles_per_block = tensor_core_tiles_per_block(p, limits);
    plan.grid_x = std::max<int64_t>(1, ceil_div(ceil_div(p.cols, kTcDwCols), plan.tiles_per_block));
    plan.grid_y = std::max<int64_t>(1, ceil_div(p.rows, kTcDwRows));
    // AdamW's step in a pass of its own over the stored gradient, as the staged kernel does: inside the
    // tile's read-out its loads and stores of the state cost more than the pass (bf16, 16384x4096, 80%,
    // N = 128: 461 us fused against 165 us for the stored gradient, backward_nvidia_h200_bf16.md as
    // committed in 1af9c8b).
    plan.gradient_in_workspace = p.epilogue == SddmmEpilogue::kAdamW;
    plan.workspace_bytes = plan.gradient_in_workspace ? size_t(p.nnz) * size_t(p.value_bytes) : 0;
    *out = plan;
    return Status::Ok();
  }
  if (plan.variant == SddmmVariant::kTileViewWgmma) {
    using namespace cuda::detail;
    const std::string name = "tile_view_wgmma";
    SNACK_RETURN_IF_ERROR(tile_view_refusal(p, name));
    if (limits.compute_capability != 90)
      return InvalidArgument("sddmm: tile_view_wgmma: " + wgmma_needs_hopper(limits.compute_capability));
    if (!limits.wgmma)
      return InvalidArgument("sddmm: tile_view_wgmma: this build has no sm_90a code (build for CUDA architecture 90)");
    SNACK_RETURN_IF_ERROR(check_tile_view_splits(p, name));
    if (p.warpgroups < 0 || p.warpgroups > kTvWgMaxGroups)
      return InvalidArgument("sddmm: tile_view_wgmma: " + std::to_string(p.warpgroups) +
                             " warpgroups a block asked; 1 to " + std::to_string(kTvWgMaxGroups));
    const int groups = p.warpgroups != 0 ? p.warpgroups : tile_view_wgmma_groups(p, limits);
    const int batch_chunks = tv_wg_batch_chunks(p.n);
    plan.threads = 128 * groups;
    const int64_t chunks = std::max<int64_t>(1, tile_view_chunks(p.cols));
    plan.tile_splits = p.tile_view_splits != 0 ? p.tile_view_splits : tile_view_wgmma_splits(p, groups, limits);
    plan.grid_x = ceil_div(std::max<int64_t>(1, tile_view_bands(p.rows)), groups) * plan.tile_splits;
    const int64_t steps = ceil_div(chunks, plan.tile_splits);
    plan.smem_bytes = tv_wg_smem_bytes(16 * tv_dw_k_steps(p.n), groups, steps, batch_chunks);
    return finish_tile_view_plan(plan, name, limits, out, kTvWgStaticSmem);
  }
  if (plan.variant == SddmmVariant::kTileView) {
    using namespace cuda::detail;
    SNACK_RETURN_IF_ERROR(tile_view_refusal(p, "tile_view"));
    SNACK_RETURN_IF_ERROR(check_tile_view_splits(p, "tile_view"));
    plan.threads = kTvDwThreads;
    const int64_t chunks = std::max<int64_t>(1, tile_view_chunks(p.cols));
    plan.tile_splits = p.tile_view_splits != 0 ? p.tile_view_splits : tile_view_splits(p, limits);
    plan.grid_x = std::max<int64_t>(1, tile_view_bands(p.rows)) * plan.tile_splits;
    const int64_t steps = ceil_div(chunks, plan.tile_splits);
    plan.smem_bytes = tv_dw_smem_bytes(16 * tv_dw_k_steps(p.n), steps);
    return finish_tile_view_plan(plan, "tile_view", limits, out);
  }
  if (plan.variant == SddmmVariant::kDenseBlocks) {
    if (!p.gemm)
      return InvalidArgument("dense_blocks runs through the caller's GEMM: plan it with SddmmProblem::gemm set (the "
                             "torch front end does)");
    // The caller's GEMM writes each block of G = dY^T X; sddmm_from_block reads it, a warp per row.
    plan.block_rows = detail::dense_block_rows(p.rows, p.n);
    plan.workspace_bytes = size_t(plan.block_rows) * size_t(p.cols) * size_t(p.value_bytes);
    plan.grid_x = grid_for(plan.block_rows * 32, kSddmmThreads, int64_t(limits.sms) * 8);
    *out = plan;
    return Status::Ok();
  }
  const bool transposed = p.nnz > 0 && p.n > 0 && plan.variant != SddmmVariant::kSlot;
  if (transposed && plan.variant == SddmmVariant::kRows && np > kSddmmRowsMaxBatch)
    return InvalidArgument("sddmm: rows runs batches of at most " + std::to_string(kSddmmRowsMaxBatch));
  // X^T from the caller (the forward's copy) spares the rows kernel its transpose. The kernel takes
  // its stride as the padded batch: the extra values are zeros (and so are dY's past n), the same
  // instantiation runs (a power-of-two tile and n rounded up to 4 give the same batch lanes), and
  // the row kernel keeps one stride parameter (a separate one cost it 1-3% on the H200).
  const bool reads_x_t = transposed && plan.variant == SddmmVariant::kRows && p.x_t_stride != 0;
  if (reads_x_t && (p.x_t_stride < np || p.x_t_stride % 4 != 0 || p.x_t_stride > kSddmmRowsMaxBatch))
    return InvalidArgument("sddmm: the transposed input's stride (" + std::to_string(p.x_t_stride) +
                           ") must be a multiple of 4 from the padded batch (" + std::to_string(np) + ") to " +
                           std::to_string(kSddmmRowsMaxBatch));
  plan.reads_x_t = reads_x_t;
  plan.transpose_x = transposed && !reads_x_t;
  plan.transpose_dy = transposed && plan.variant == SddmmVariant::kVector;
  plan.workspace_bytes =
      plan.transpose_x ? size_t(p.cols + (plan.transpose_dy ? p.rows : 0)) * size_t(np) * size_t(p.value_bytes) : 0;
  const int64_t sm_cap = int64_t(limits.sms) * 8;
  switch (plan.variant) {
    case SddmmVariant::kRows: {
      int gn = 1, nc = 1;
      rows_instantiation(reads_x_t ? p.x_t_stride : np, &gn, &nc);
      plan.batch_lanes = gn;
      plan.batch_chunks = nc;
      plan.lanes_per_row = rows_lanes_per_row(p, gn, nc, limits);
      const int64_t warps = ceil_div(p.rows, (32 / gn) / plan.lanes_per_row);
      plan.grid_x = grid_for(warps * 32, kSddmmThreads, sm_cap);
      break;
    }
    case SddmmVariant::kVector: {
      plan.batch_lanes = vector_lanes(np);
      const int64_t warps =
          ceil_div(p.nnz, int64_t(32 / plan.batch_lanes) * cuda::detail::kSddmmVectorSlotsPerLane);
      plan.grid_x = grid_for(warps * 32, kSddmmThreads, sm_cap);
      break;
    }
    default:
      break;
  }
  // Nothing to transpose (a batch below 4, an empty one, no slots): the slot kernel runs.
  if (!transposed) plan.grid_x = grid_for(p.nnz, kSddmmThreads);
  *out = plan;
  return Status::Ok();
}

std::string describe(const SddmmPlan& plan) {
  std::string s = std::string(sddmm_variant_name(plan.variant)) + " (padded batch " + std::to_string(plan.padded_batch);
  if (plan.variant == SddmmVariant::kRows)
    s += ", " + std::to_string(plan.batch_lanes) + " batch lanes x " + std::to_string(plan.batch_chunks) +
         " chunks, " + std::to_string(plan.lanes_per_row) + " lanes per row";
  if (plan.variant == SddmmVariant::kVector) s += ", " + std::to_string(plan.batch_lanes) + " lanes per slot";
  if (plan.variant == SddmmVariant::kDenseBlocks) s += ", blocks of " + std::to_string(plan.block_rows) + " rows";
  if (plan.variant == SddmmVariant::kStaged)
    s += ", tiles of " + std::to_string(cuda::detail::kStagedBand) + " rows x " + std::to_string(plan.chunk_cols) +
         " columns, " + std::to_string(plan.grid_y) + " x " + std::to_string(plan.grid_x) + " tiles x " +
         std::to_string(plan.batch_splits) + " batch splits";
  else if (plan.variant == SddmmVariant::kTensorCore)
    s += ", " + std::to_string(plan.grid_y) + " bands of " + std::to_string(cuda::detail::kTcDwRows) + " rows x " +
         std::to_string(plan.grid_x) + " runs of " + std::to_string(plan.tiles_per_block) + " tiles of " +
         std::to_string(cuda::detail::kTcDwCols) + " columns";
  else if (plan.variant == SddmmVariant::kTileView)
    s += ", bands of " + std::to_string(kTileViewRows) + " rows, " + std::to_string(plan.tile_splits) + " block" +
         (plan.tile_splits > 1 ? "s" : "") + " per band, " + std::to_string(plan.grid_x) + " blocks";
  else if (plan.variant == SddmmVariant::kTileViewWgmma) {
    s += ", bands of " + std::to_string(kTileViewRows) + " rows, " + std::to_string(plan.threads / 128) +
         " warpgroup" + (plan.threads > 128 ? "s" : "") + " a block, " + std::to_string(plan.tile_splits) +
         " block" + (plan.tile_splits > 1 ? "s" : "") + " per group of bands, " + std::to_string(plan.grid_x) +
         " blocks";
    if (const int chunks = cuda::detail::tv_wg_batch_chunks(plan.problem.n); chunks > 1)
      s += ", the batch in " + std::to_string(chunks) + " chunks of " + std::to_string(cuda::detail::kTvDwMaxBatch) +
           " rows";
  } else
    s += ", " + std::to_string(plan.grid_x) + " blocks";
  if (plan.workspace_bytes) s += ", " + std::to_string(plan.workspace_bytes) + " B workspace";
  return s + "): " + sddmm_reason_text(plan.reason);
}

}  // namespace snack
