// The SpMM planner: which kernel runs a product, with which batch tile, lanes and grid. A pure
// function of the problem and the device's limits (compiled without CUDA, tested on the CPU with the
// limits of several GPUs). Each rule says what it was measured on; the measurements are summarised
// in docs/kernels.md.
#include <algorithm>
#include <cmath>
#include <string>

#include "../common/dense_blocks.h"
#include "../common/grid.h"
#include "shapes.h"
#include "wgmma.h"
#include "snack/spmm.h"

namespace snack {
namespace {

using cuda::detail::kSpmmWarps;
using detail::ceil_div;

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v && p < 128) p <<= 1;
  return p;
}

// The most lanes worth splitting one output row: enough that each has about two entries, at most
// the lanes along the entries; the rest of those lanes take further rows (rows per warp = free / this).
int max_lanes_per_row(int batch_tile, double avg_row_length) {
  const int free_lanes = cuda::detail::lanes_along_entries(batch_tile);
  int lanes = 1;
  while (lanes < free_lanes && lanes * 2 <= avg_row_length) lanes <<= 1;
  return lanes;
}

// Warps of a row-kernel launch: output rows over rows per warp, times the batch tiles.
int64_t warps_for(int64_t out_dim, int64_t tiles, int batch_tile, int lanes_per_row) {
  const int64_t rows_per_warp = cuda::detail::lanes_along_entries(batch_tile) / lanes_per_row;
  return (out_dim + rows_per_warp - 1) / rows_per_warp * tiles;
}

// Warps the SMs hold at once (one wave of the row kernels, at their register bound), and the
// half of it a launch should have: enough loads of W in flight on the H200.
int64_t resident_warps(const DeviceLimits& limits) {
  return int64_t(limits.sms) * cuda::detail::kRowsBlocksPerSm * kSpmmWarps;
}
int64_t wanted_warps(const DeviceLimits& limits) { return resident_warps(limits) / 2; }

// Lanes per row: from max_lanes_per_row, halved while the launch keeps wanted_warps. Fewer lanes
// per row means more rows per warp and a longer stretch of one row per lane, which pays the
// per-row cost (row pointers, the shuffle reduction, the store) fewer times: measured on the H200
// (16384x4096, 90%) 4 lanes per row at N = 16 took 55 us against 60 us with 8.
// Two corrections, from every lanes value forced over 5 shapes x N = 1..128 x 80-99% on the H200:
// - forward: a launch left just under one wave of warps is doubled to about two when each lane
//   keeps at least 48 entries (16384x4096, 90%: N = 16 55.0 -> 50.1 us, N = 32 88.3 -> 82.6 us,
//   N = 8 at 80% 64.3 -> 59.4 us); with shorter stretches (99%) or a launch that would end 1.2
//   waves deep (5000x5000) the doubling loses.
// - transposed product (CSC view, values read through csc_perm): at most 8 lanes per row while
//   the launch keeps 4 warps per SM, the fewer warps walking longer stretches (16384x4096, 90%,
//   N = 1: 95.8 -> 69.7 us, N = 8: 133 -> 121 us; 4096x4096, N = 1: 26.4 -> 20.9 us).
// Both were measured for global_x and global_xt, the kernels that read X (or dY) through L1.
int lanes_per_row_for(SpmmVariant variant, int batch_tile, double avg_row_length, int64_t out_dim, int64_t tiles,
                      bool transposed, const DeviceLimits& limits) {
  int lanes = max_lanes_per_row(batch_tile, avg_row_length);
  const auto warps = [&](int l) { return warps_for(out_dim, tiles, batch_tile, l); };
  while (lanes > 1 && warps(lanes / 2) >= wanted_warps(limits)) lanes >>= 1;
  if (variant != SpmmVariant::kGlobalX && variant != SpmmVariant::kGlobalXT) return lanes;
  if (transposed) {
    while (lanes > 8 && warps(lanes / 2) >= int64_t(limits.sms) * 4) lanes >>= 1;
  } else if (lanes < max_lanes_per_row(batch_tile, avg_row_length) &&
             double(warps(2 * lanes)) >= 1.75 * double(resident_warps(limits)) &&
             avg_row_length >= 48.0 * (2 * lanes)) {
    lanes <<= 1;
  }
  return lanes;
}

// Batch tiles run side by side in grid.y, at most this many.
constexpr int64_t kMaxGridY = 65535;

// global_x reads X in place (no transpose launch, no workspace), but one entry costs it N sectors of
// X against N / 8 for global_xt: it pays only while X stays in L1 at a batch of at most 8, or for a
// tiny product. Since global_xt's kernel overlaps the transpose (programmatic launch), measured on
// the H200: 4096x4096, 99%, N = 8 (X 128 KiB): global_x 11.3 us, global_xt 9.4 us; 3072x768, 90%,
// N = 8 (X 24 KiB): 8.2 against 9.1 us; 3072x768, 99%, N = 16 (0.4 M multiply-adds): 7.0 against
// 7.8 us.
constexpr int64_t kGlobalXMaxBatch = 8;
constexpr int64_t kGlobalXMaxBytes = 96 * 1024;
constexpr int64_t kTinyProduct = int64_t(1) << 19;
constexpr int64_t kTinyProductMaxBatch = 32;

// A batch of one row runs wide_rows where X's row leaves room for 4 blocks per SM (32 warps), each
// warp gets a group of at least kWideRowsMinRowsPerWarp rows (so the group's slots are one long
// stream) and rows average at least kWideRowsMinAverage slots. Measured on the H200 at N = 1:
// wide_rows beats global_x by 5-25% on 12288-32768 x 4096 at 80-95% sparsity (groups of 3-8 rows;
// a tie at 12288x4096, 95%); with groups of 1-2 rows (4096-8192 rows), ~41 slots per row (99%) or
// 2 blocks per SM (16384x16384) it is 2-40% slower: its staging of X and its row-pointer load cost
// more than its faster stream saves.
// A batch of 2-4 rows (fp32) runs wide_rows under the same conditions, with the whole batch in one
// tile. Measured on the H200 at N = 2 and 4 over the five shapes of the benchmark grid, this rule
// and the global_x / global_xt rules take uniform rows 1.51x faster in geomean than the shared-
// memory tile (smem_x) chosen there before (1.11-2.23x), power-law rows 1.35x (0.92-1.99x). A tile
// of 8 fp32 rows gathers 32 bytes per slot from shared memory, whose random columns cause 5.4-way
// bank conflicts (Nsight Compute): 16384x4096 at 90%, N = 8, 40.7 us against 39.4 us for global_xt,
// hence kWideMaxGatherBytes. In bf16 a tile of 8 rows is one 16-byte gather (25.9 us against 34.1 us
// for global_xt at N = 8).
constexpr int kWideRowsMinRowsPerWarp = 3;
constexpr double kWideRowsMinAverage = 128.0;
constexpr size_t kWideMaxGatherBytes = 16;
constexpr int64_t kWide16MinInputs = 4096;  // wide_rows_pay_16bit

// Products whose slot arrays and input take at most this many bytes are bound by the latency of
// their first misses rather than by bandwidth: their blocks first prefetch W (and X) into L2.
// Measured on the H200 over the benchmark grid: 8 MiB gave 1.2% more than 64 MiB.
constexpr int64_t kPrefetchMaxBytes = int64_t(8) << 20;

// The transposed copy of X: per batch tile, in_dim rows and the zero slot (see spmm_rows_kernel).
size_t transposed_bytes(int64_t in_dim, int64_t n, int batch_tile, size_t value_bytes) {
  return size_t(in_dim + 1) * size_t((n + batch_tile - 1) / batch_tile * batch_tile) * value_bytes;
}

// Dynamic shared memory of one wide_rows block: the batch tile of X and the lanes' partial sums
// (8-byte for fp64); its static buffers come on top (wide_rows_static_smem).
size_t wide_rows_dynamic_smem(int64_t in_dim, size_t value_bytes, int tile, int rows_per_warp) {
  return cuda::detail::wide_rows_smem_bytes(value_bytes, value_bytes == 8 ? 8 : 4, in_dim, tile, rows_per_warp);
}

// Blocks of the wide_rows kernel that one SM holds: the warps it is built for, fewer where
// shared memory runs out first.
int wide_rows_blocks_per_sm(size_t block_smem, int tile, const DeviceLimits& limits) {
  const size_t by_registers = cuda::detail::wide_rows_warps_per_sm(tile) * 32 / cuda::detail::wide_rows_threads(tile);
  return int(std::max<size_t>(
      1, std::min<size_t>(by_registers, limits.smem_per_sm / (block_smem + limits.reserved_smem_per_block))));
}

// How a wide_rows launch runs a product: its batch tile, rows per warp group, dynamic shared memory
// per block and blocks per SM; tile 0 where not even one row of X fits in shared memory.
struct WideRowsShape {
  int tile = 0;
  int rows_per_warp = 1;
  size_t smem = 0;
  int blocks_per_sm = 0;
};

// The widest batch tile that fits (a power of two, at most the batch and wide_max_tile; 1 for fp64,
// which only the gradient checks use), with as few rows per warp group as still give every warp of
// the SMs a group (one wave), at most kWideMaxRows and at most what shared memory holds beside the
// tile (a longer group would only lengthen the slowest warp).
WideRowsShape wide_rows_shape(int64_t out_dim, int64_t in_dim, int64_t n, size_t value_bytes,
                              const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int widest = next_pow2(std::clamp<int64_t>(n, 1, wide_max_tile(value_bytes)));
  for (int tile = widest; tile >= 1; tile /= 2) {
    const int64_t warps = int64_t(limits.sms) * wide_rows_warps_per_sm(tile);
    const int wanted_rows = int(std::clamp<int64_t>(ceil_div(out_dim, warps), 1, kWideMaxRows));
    for (int rows = wanted_rows; rows >= 1; --rows) {
      WideRowsShape shape;
      shape.smem = wide_rows_dynamic_smem(in_dim, value_bytes, tile, rows);
      const size_t block = shape.smem + wide_rows_static_smem(tile);
      if (block > limits.smem_per_block) continue;
      shape.tile = tile;
      shape.rows_per_warp = rows;
      shape.blocks_per_sm = wide_rows_blocks_per_sm(block, tile, limits);
      return shape;
    }
  }
  return {};
}

// Stored entries over the weights of the layer (0 for an empty one).
double density_of(const SpmmProblem& p) {
  return p.out_dim > 0 && p.in_dim > 0 ? double(p.nnz) / (double(p.out_dim) * double(p.in_dim)) : 0.0;
}

// Where the tensor-core kernel beats the CUDA-core ones in 16 bits. Its cost per chunk is mostly
// fixed (zeroing and expanding 64 rows, one barrier, the products of the whole tile), so it pays
// where the row kernels' cost per slot and batch row grows past it: many batch rows at a high
// density, on large layers sooner. Measured on the H200 in bf16 (uniform rows; 768x3072, 3072x768,
// 4096x4096, 16384x4096 at 50-95%, N = 16-128, bench/results/spmm_nvidia_h200_bf16.md, every variant
// forced), thresholds a little under 5%, 10% and 30% density (the grid's layers keep
// llround(d * M * K) slots):
// - from 30% density at N >= 64 on every layer (3072x768, 70%, N = 64: 19.3 against 28.9 us for
//   global_xt), at N >= 32 on layers of at least 2^24 weights (4096x4096, 70%: 41.3 against 44.0);
// - from 10% at N >= 64 on layers of at least 2^24 weights (4096x4096, 90%: 37.2 against 48.7), at
//   N >= 32 from 2^25 (16384x4096: 73.7 against 82.4), at N >= 256 on every layer;
// - from 5% at N >= 128 on layers of at least 2^25 weights (16384x4096, 95%: 118.9 against 143.7);
// elsewhere the CUDA-core kernels are faster (16384x4096, 90%, N = 16: 68.0 against 43.7 us for
// wide_rows; 4096x4096, 95%, N = 128: 58.2 against 45.1 for global_xt).
//
// The transposed product (dX) read in place reaches each slot through csc_perm (a vector of
// positions, then the slots' rows and values gathered), so its expansion costs more; over a copy of
// the CSC view (from a batch of 256) it is planned as the forward of W^T. In place (measured in
// backward_nvidia_h200_bf16.md, its CUDA-core dX times where the planner now takes tensor cores,
// from that file at commit 885758e) the tensor-core kernel pays from 20% density at N >= 128
// (16384x4096, 80%: 377 against 700 us; 768x3072: 35.6 against 45.3), at N >= 64 on layers of at least 2^24 weights (16384x4096, 70%: 325 against 529 us;
// 4096x4096, 80%: 94.5 against 100.2; but 768x3072, 80%: 32.9 against 27.3), and from 10% at
// N >= 256 (16384x4096, 90%: 644 against 773 us); not below (90%, N = 128: 340 against 361 us is
// within the noise; 95%, N = 128: 319 against 192 us).
bool tensor_cores_pay(const SpmmProblem& p) {
  if (p.value_bytes != 2 || p.n < kTensorCoreMinBatch || p.out_dim == 0 || p.in_dim == 0) return false;
  const double density = density_of(p);
  const bool large = p.out_dim * p.in_dim >= (int64_t(1) << 24);
  const bool huge = p.out_dim * p.in_dim >= (int64_t(1) << 25);
  if (p.transposed)
    return (p.n >= 128 && density >= 0.19) || (large && p.n >= 64 && density >= 0.19) ||
           (p.n >= 256 && density >= 0.095);
  return (p.n >= 64 && density >= 0.29) || (large && p.n >= 32 && density >= 0.29) ||
         (p.n >= 256 && density >= 0.095) || (large && p.n >= 64 && density >= 0.095) ||
         (huge && p.n >= 32 && density >= 0.095) || (huge && p.n >= 128 && density >= 0.045);
}

// Where the tile view's kernel pays for dX (16 bits; the tiles read down W's columns, no csc_perm).
// Measured on the H200 in bf16 against the row kernels and tensor_core over the CSC view in place
// (backward_nvidia_h200_tile_view_bf16.md at commit 3fd9d21: 768x3072 to 16384x4096, 50-99%,
// N = 1-128, each forced): its time follows the tiles, theirs the slots, so it takes
//   - 16-128 rows from 4% density (16384x4096, 90%, N = 64: 89.3 against 193.6 us for global_xt;
//     95%, N = 16: 50.0 against 73.4), but not 65-128 rows above 40% on layers of 2^26 weights,
//     where tensor_core keeps up (16384x4096, 50%, N = 128: 500.7 against 514.7);
//   - 2-15 rows from 4% on layers of at least 2^24 weights (4096x4096, 95%, N = 8: 17.6 against
//     21.1) and from 7.5% where dX has at least 2048 outputs (768x3072, 90%: 9.6 against 9.8), not
//     on 3072x768 (768 outputs: 16.6 against 15.9 at 80%);
//   - one row from 7.5% on layers of at least 2^24 weights (16384x4096, 90%: 54.5 against 70.9), on
//     layers with more inputs than outputs (dX's out_dim > in_dim) only up to 25% (4096x11008, 50%:
//     136.7 against 122.6);
// at 99% the row kernels' few slots win (16384x4096, N = 64: 32.0 against 81.1 us).
bool tile_view_pays_transposed(const SpmmProblem& p) {
  const double density = density_of(p);
  if (p.n < 1 || p.n > 128 || density < 0.04) return false;
  const int64_t weights = p.out_dim * p.in_dim;
  if (p.n >= 16) return p.n <= 64 || density <= 0.4 || weights < (int64_t(1) << 26);
  const bool large = weights >= (int64_t(1) << 24);
  if (p.n > 1) return large || (p.out_dim >= 2048 && density >= 0.075);
  return large && density >= 0.075 && (p.out_dim <= p.in_dim || density <= 0.25);
}

// Where the tile view's kernel pays (the forward, 16 bits, a pattern that holds the view), measured
// on the H200 in bf16 with every variant forced (spmm_nvidia_h200_bf16_tile_view.md, 768x3072 to
// 16384x4096 at 80-95%, N = 16-128): its time follows the tiles (64 x 64, a batch tile of up to 64
// rows each), the others' the slots, so it takes
//   - 17-64 rows at 7.5-12% density everywhere (16384x4096, 90%, N = 64: 67.4 against 93.3 us for
//     tensor_core; 4096x4096, N = 32: 26.9 against 28.9 for global_xt);
//   - there, from 12% to 25% on layers of at least 8192 rows or under 2^23 weights (16384x4096,
//     80%, N = 64: 93.1 against 111.8; 3072x768, N = 64: 13.9 against 18.4), not between them, where
//     tensor_core is faster (4096x4096, 80%, N = 32: 34.3 against 40.9);
//   - below 7.5% from 33 rows on layers of at least 8192 rows (16384x4096, 95%, N = 64: 64.3 against
//     81.9 for global_xt) and from 17 on layers under 2^23 weights, where the row kernels win on
//     4096-row layers (4096x4096, 95%, N = 32: 19.7 against 25.5);
//   - 65-128 rows (two batch tiles) on layers under 2^23 weights (768x3072, 90%, N = 128: 15.0
//     against 22.6) and at 7.5-12% density (4096x4096, 90%: 51.6 against 59.8).
// At N <= 16 wide_rows and the row kernels stay ahead; above 25% density (not measured) tensor_core
// keeps it.
// With packed tile values (the forward given them; no value is gathered), measured on the H100 in
// bf16 with every variant forced (spmm_nvidia_h100_80gb_hbm3_bf16_packed.md, commit 3402f88, 768x3072
// to 16384x4096 at 80-95%, N = 16-128): 1.14x the gathering kernel in geometric mean (1.04-1.33x) and
// the fastest variant in 40 of 48 rows, so it takes
//   - 17-128 rows at 4-25% density (16384x4096, 80%, N = 32: 63.7 against 81.5 us for the planner's
//     choice without them; 11008x4096, 80%, N = 64: 68.6 against 86.0), within 6% of the best
//     elsewhere (4096x4096, 95%, N = 128: 47.9 against 45.5 for the planner's choice without them);
//   - 16 rows at 7.5-25% density from 4096 inputs (11008x4096, 90%: 31.8 against 35.5 for
//     wide_rows), but not sparser, where wide_rows streams fewer bytes (16384x4096, 95%: 40.6
//     against 32.7), nor on narrower layers (768x3072, 80%: 14.3 against 12.6).
// Over those 48 rows the planner given the tiles is 1.10x faster than without them in geometric mean
// (0.95-1.80x) and within 0.4% of the fastest forced kernel (at most 5.3%).
bool packed_tile_view_pays(const SpmmProblem& p) {
  const double density = density_of(p);
  if (p.n < 16 || p.n > 128 || density < 0.04 || density > 0.25) return false;
  return p.n > 16 || (density >= 0.075 && p.in_dim >= 4096);
}

// Given tile fragments, the forward runs the fragment kernel at 8-128 rows from 4.5% to 50%
// density (and at 1-7 rows from 35%), on every layer: the kernel whose worst case is best, since
// the planner does not see how the slots spread over the rows. Measured on the H100 in bf16
// (spmm_nvidia_h100_80gb_hbm3_bf16_fragments.md, commit df9c518; the rule came from the kernel
// before its producer warp, at e6ef0af and 5191b25, with the same conclusions; 768x3072 to
// 16384x4096 at 80-95%, uniform and power-law rows, the kernel forced against the planner's choice
// without it):
//   - at 16-128 rows it is 1.60x / 1.58x faster in geometric mean on uniform rows of layers of
//     4096x4096 and more (16-64 / 128 rows; never slower: 1.11x at least, 4096x4096, 95%, N = 16)
//     and 2.61x / 2.13x on power-law rows; on 768x3072 1.25x (uniform) and 1.62x (power-law) at
//     16-64 rows;
//   - at 8 rows it loses on uniform rows, where wide_rows streams fewer bytes (0.93x in geometric
//     mean, 0.79x at worst; still 1.31x dense's speed or more on the layers of 4096x4096 and more),
//     and wins 2.26x on power-law rows, where the kernels without it fall to a third of dense's
//     speed;
//   - below 8 rows and outside 4.5-25% density it is not measured.
// At 25-50% density (50-75% sparsity) the kernels without them stream the slots and their columns,
// near or above dense's bytes, while the fragments' registers hold two values each. Measured on the
// H100 in bf16 (spmm_nvidia_h100_80gb_hbm3_bf16_fragments_dense_side.md, commit 5899644; 768x3072,
// 4096x4096, 4096x11008 and 16384x4096 at 50/60/70%, uniform rows, N = 1-128, each fragment kernel
// forced): from 8 rows the fragment kernels are 1.4-3.6x faster than the planner's choice without
// them on every layer (16384x4096, 70%, N = 16: 1.32x dense's speed against 0.77x; 4096x4096, 50%,
// N = 128: 28.0 against 98.8 us), at one row from 40% density (4096x11008, 50%: 1.00x dense
// against 0.84x) but not at 30%, where wide_rows ties or wins (768x3072, 70%: 0.95x against 1.06x).
// Past 50% density it is not measured. Elsewhere the planner chooses as without the fragments.
bool fragments_pay(const SpmmProblem& p) {
  const double density = density_of(p);
  if (p.n > 128 || density < 0.045 || density > 0.5) return false;
  return p.n >= 8 || (p.n >= 1 && density >= 0.35);
}

// Given tile fragments on Hopper (a build with sm_90a code), from 17 rows the forward multiplies them
// with wgmma, its operands loaded from the fragments into registers (fragment_wgmma_kernel.cuh). Measured
// on the H100 in bf16 against the mma.sync kernel, each forced (spmm_nvidia_h100_80gb_hbm3_bf16_wgmma_ab.md,
// commit de06a9e; 768x3072 to 16384x4096 at 80-95%, uniform rows): at 32 rows 1.06-1.12x faster, at 64
// rows 0.99-1.15x (with the clusters before the rule below),
// at 128 rows 1.07-1.84x (16384x4096, 90%: 47.3 against 86.9 us; batch tiles of 128 read each tile
// once where mma.sync's 64 read it twice); at 8-16 rows 0.85-1.08x, 0.96x in geometric mean on the
// layers of 4096x4096 and more, so there the mma.sync kernel stays.
//
// Past 128 rows it runs the batch in tiles of 128, each reading the fragments again. Measured on the
// H200 in bf16 (spmm_nvidia_h200_bf16_large_fragments.md, commit 39ff459; 768x3072, 4096x4096 and
// 16384x4096 at 80-95%, uniform rows; forced, against the planner's choice without the fragments,
// `tensor_core` or `dense_blocks` there):
//   - 256 rows: 1.9-3.3x faster on every layer (4096x4096, 90%: 30.6 against 95.1 us; dense 22.7);
//   - 1024 rows: 1.12-1.21x on 4096x4096 and 16384x4096 at 80-90% (16384x4096, 90%: 345.5 against
//     392.8 us), 1.31x on 16384x4096 at 95%, but 0.96x on 4096x4096 at 95% and 0.67-0.80x on 768x3072;
//   - 4096 rows: 0.51-0.78x. It does the dense product's work, ~400 TFLOP/s dense-equivalent on the
//     large layers, where cuBLAS reaches ~850.
// So it takes up to 512 rows on layers of 2^20 weights and more, and up to 1024 on layers of 2^24
// weights and more at 7.5-25% density. 768x2304 (1.77 M weights) at 256 and 512 rows, H200
// (spmm_nvidia_h200_bf16_large_small_layers.md, commit 5899644): 12.0 / 15.6 us forced at 80%
// against 25.1 / 24.0 for the plan without them. At 25-50% density, 256 and 512 rows (H100,
// spmm_nvidia_h100_80gb_hbm3_bf16_large_fragments_dense_side.md, the four layers at 50/70%): 2.0-4.5x
// the plan without them (16384x4096, 50%, 512 rows: 201.1 against 549.7 us, dense_blocks 507.2).
bool fragments_pay_past_128(const SpmmProblem& p) {
  const double density = density_of(p);
  if (p.n <= 128 || density < 0.045 || density > 0.5 || p.out_dim * p.in_dim < (int64_t(1) << 20)) return false;
  return p.n <= 512 ||
         (p.n <= 1024 && density >= 0.075 && density <= 0.25 && p.out_dim * p.in_dim >= (int64_t(1) << 24));
}

bool fragment_wgmma_pays(const SpmmProblem& p, const DeviceLimits& limits) {
  return limits.wgmma && p.value_bytes == 2 && p.tile_view && !p.transposed &&
         p.packed_tiles == TileValues::kFragments && ((fragments_pay(p) && p.n > 16) || fragments_pay_past_128(p));
}

bool tile_view_pays(const SpmmProblem& p) {
  if (p.value_bytes != 2 || !p.tile_view) return false;
  if (p.transposed) return tile_view_pays_transposed(p);
  if (p.packed_tiles == TileValues::kFragments && fragments_pay(p)) return true;
  if (p.packed_tiles == TileValues::kPacked) return packed_tile_view_pays(p);
  if (p.n < 17 || p.n > 128) return false;
  const double density = density_of(p);
  const bool small = p.out_dim * p.in_dim < (int64_t(1) << 23), tall = p.out_dim >= 8192;
  const bool ninety = density >= 0.075 && density <= 0.12;
  if (density > 0.25) return false;  // not measured denser: tensor_core expands such tiles for less
  if (p.n > 64) return small || ninety;
  if (ninety) return true;
  if (density > 0.12) return small || tall;
  return small || (tall && p.n >= 33);
}

// Where wide_rows pays in 16 bits beyond its fp32 rule (one tile of the whole batch, three rows per warp
// group): its tile of 8 rows is one 16-byte gather per slot, and from 4096 inputs the gathers from shared
// memory beat global_xt's through L1 even with a row per warp group, and at 9-16 rows (one tile of 16
// where it fits, else two of 8) where rows are dense or the layer large. Measured on the H200 in bf16
// (spmm_nvidia_h200_bf16.md, wide_rows forced beside global_xt): 4096x4096, N = 8: 27.3 / 20.5 / 13.5 /
// 11.1 us against 35.0 / 24.6 / 16.0 / 12.6 at 50 / 70 / 90 / 95% (and 44.8 / 30.0 / 17.5 / 13.3 for
// global_x, the choice before, at commit 062c5c5); N = 16: 46.9 against 56.5 us at 50%, 33.9 against 37.6
// at 70%, but 21.7 against 19.3 at 90%; 16384x4096, N = 16: 137.2 / 92.5 / 43.7 against 193.2 / 124.1 /
// 50.3 us at 50 / 70 / 90%, 33.5 against 31.8 at 95%. Below 4096 inputs global_x and global_xt stay
// (3072x768, N = 16, 50%: 18.4 against 15.1 us), and rows as short as the fp32 rule's. Those N = 16 times
// are two tiles of 8; one tile of 16 (16 warps per SM) was then 1.10-1.12x faster at 50-70% and level at
// 90-95% (16384x4096, N = 16: 50% 130.0 -> 114.4 us, 90% 42.4 -> 42.6; 4096x4096, 70%: 31.7 -> 28.8;
// 11008x4096, 90%: 33.6 -> 35.1).
bool wide_rows_pay_16bit(const SpmmProblem& p, const WideRowsShape& wide, bool wide_full, double avg) {
  using namespace cuda::detail;
  if (p.value_bytes != 2 || !wide_full || p.in_dim < kWide16MinInputs || avg < kWideRowsMinAverage) return false;
  const double density = density_of(p);
  const bool huge = p.out_dim * p.in_dim >= (int64_t(1) << 25);
  const bool tile_of_8 = p.n > 4 && p.n <= 8 && wide.tile == 8;
  const bool up_to_16 = p.n > 8 && p.n <= 16 && wide.tile >= 8 && (density >= 0.29 || (huge && density >= 0.095));
  return tile_of_8 || up_to_16;
}

// The kernel parks each slot's input column as a 32-bit byte offset (column x a staged column's bytes).
bool shared_x_offsets_overflow(const SpmmProblem& p) {
  using namespace cuda::detail;
  const size_t vb = size_t(p.value_bytes);
  const int64_t column_bytes = int64_t(shared_x_tile(vb, shared_x_max_vectors(vb))) * p.value_bytes;
  return p.in_dim >= (int64_t(1) << 32) / column_bytes;
}

// A grid of one block per SM fills the SMs: at least 70% of a wave, and its last wave at least 70% full.
bool shared_x_grid_fills(int64_t blocks, const DeviceLimits& limits) {
  const double waves = double(blocks) / double(limits.sms);
  return waves >= 0.7 && waves / std::ceil(waves) >= 0.7;
}

// The batch tile: the widest (two vectors a lane in fp32) unless its grid leaves SMs idle where one
// vector's fills them (3072x768 at N = 512: 24 bands x 2 tiles of 256 rows, against 4 of 128), or its
// epilogue's tile does not fit the device's shared memory (~100 KB per block on an L40S).
int shared_x_batch_tile(const SpmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const size_t vb = size_t(p.value_bytes);
  const int wide = shared_x_tile(vb, shared_x_max_vectors(vb));
  const int narrow = shared_x_tile(vb, 1);
  if (shared_x_smem_bytes(vb, 32, wide) > limits.smem_per_block) return narrow;
  const int64_t bands = ceil_div(p.out_dim, shared_x_band_rows(vb));
  const auto fills = [&](int tile) {
    return shared_x_grid_fills(bands * ceil_div(std::max<int64_t>(p.n, 1), tile), limits);
  };
  return (fills(wide) || !fills(narrow)) ? wide : narrow;
}

// Where shared_x beats the row kernels: fp32 (in 16 bits the tensor-core kernel and dense blocks win
// at these batches), a batch of at least 256, rows of 4-35% density (from 0.5% at a batch of 8192,
// where global_xt's stream of X from L2 slows down; the forward from 1% at 512), and a grid whose
// last wave of one block per SM is at least 70% full. Measured on the H200 with every variant forced (fp32, uniform rows,
// bench/results/spmm_nvidia_h200_large.md at commit 145b557): 16384x4096, N = 1024, 90% / 95%:
// 1577 / 1025 us against 2763 / 1438 us for global_xt; at 99% global_xt stays faster up to N = 4096
// (a chunk of 128 columns holds ~1.3 slots of a row: 561 against 418 us at N = 1024, 2209 against
// 2181 at N = 4096) but not at N = 16384 (8621 against 19484 us; 4096x4096 2379 against 3676). Under-
// filled grids lose: 768x3072, N = 256 (6 bands of 128 rows x 2 batch tiles) 154 against 35 us. The
// transposed product, whose slots come through csc_perm (16384x4096 at N = 1024 / 4096): 90% 2043 /
// 8125 us against 3379 / 21398 for global_xt, 95% 1716 / 6749 against 1750 / 10880. (These are the
// kernel's figures with one vector a lane and a window reloaded per row and chunk.) With eight batch
// rows a lane (H100, bench/results/spmm_nvidia_h100_80gb_hbm3_shared_x_wide.md, commit 8da4065) it
// also wins the forward at 99% from N = 512: 16384x4096 229.8 / 454.0 / 1779 us against 233.1 /
// 470.5 / 2691 for the planner's global_xt at N = 512 / 1024 / 4096, 4096x4096 70.9 / 132.5 / 499.2
// against 72.2 / 136.3 / 625.2, 3072x768 21.0 / 36.0 / 98.0 against 39.7 / 69.2 / 283.7 (the
// transposed product there is not measured).
constexpr int64_t kSharedXMinBatch = 256;
constexpr int64_t kSharedXSparseRowsBatch = 8192;
constexpr int64_t kSharedXOnePercentBatch = 512;
bool shared_x_pays(const SpmmProblem& p, const DeviceLimits& limits) {
  using namespace cuda::detail;
  if (p.value_bytes != 4 || p.n < kSharedXMinBatch || p.out_dim == 0 || p.in_dim == 0) return false;
  if (shared_x_offsets_overflow(p)) return false;
  const double density = density_of(p);
  const double least = p.n >= kSharedXSparseRowsBatch                      ? 0.005
                       : p.n >= kSharedXOnePercentBatch && !p.transposed ? 0.0095
                                                                         : 0.04;
  if (density < least || density > 0.35) return false;
  const int64_t bands = ceil_div(p.out_dim, shared_x_band_rows(4));
  return shared_x_grid_fills(bands * ceil_div(p.n, shared_x_batch_tile(p, limits)), limits);
}

// tensor_cores / shared_x: the planner's tensor_cores_pay(p) and shared_x_pays(p), what the sparse
// side would run.
detail::DenseBlocksProblem dense_blocks_problem(const SpmmProblem& p, bool tensor_cores, bool shared_x) {
  return {p.transposed ? detail::DenseBlocksOp::kTransposed : detail::DenseBlocksOp::kForward,
          p.out_dim, p.in_dim, p.nnz, p.n, p.value_bytes, p.tf32, tensor_cores, shared_x};
}

// The automatic choice (measured on the H200 over the benchmark grid, bench/results/spmm_*): a few
// rows of a large product stream W fastest with wide_rows; otherwise X is read in place where one
// row is all, where it is small enough to stay in L1 or the product is tiny, and transposed once
// (read through L1) where it is not.
SpmmVariant choose_variant(const SpmmProblem& p, const WideRowsShape& wide, double avg, SpmmReason* reason,
                           const DeviceLimits& limits) {
  using namespace cuda::detail;
  // Given tile fragments where they pay, ahead of dense_blocks, which their rule was measured against.
  if (fragment_wgmma_pays(p, limits)) {
    *reason = SpmmReason::kFragmentWgmma;
    return SpmmVariant::kWgmma;
  }
  const bool tensor_cores = tensor_cores_pay(p);
  const bool shared_x = shared_x_pays(p, limits);
  if (p.gemm && detail::dense_blocks_pay(dense_blocks_problem(p, tensor_cores, shared_x), limits)) {
    *reason = SpmmReason::kDenseBlocks;
    return SpmmVariant::kDenseBlocks;
  }
  if (shared_x) {
    *reason = SpmmReason::kSharedInput;
    return SpmmVariant::kSharedX;
  }
  if (tile_view_pays(p)) {
    *reason = SpmmReason::kTileView;
    return SpmmVariant::kTileView;
  }
  if (tensor_cores) {
    *reason = SpmmReason::kTensorCores;
    return SpmmVariant::kTensorCore;
  }
  const bool wide_full = wide.tile > 0 && wide.blocks_per_sm * wide_rows_threads(wide.tile) ==
                                              wide_rows_warps_per_sm(wide.tile) * 32;  // all the warps it is built for
  if (wide_rows_pay_16bit(p, wide, wide_full, avg)) {
    *reason = SpmmReason::kWideRows;
    return SpmmVariant::kWideRows;
  }
  if (wide_full && wide.tile >= p.n && size_t(wide.tile) * size_t(p.value_bytes) <= kWideMaxGatherBytes &&
      wide.rows_per_warp >= kWideRowsMinRowsPerWarp && avg >= kWideRowsMinAverage) {
    *reason = SpmmReason::kWideRows;
    return SpmmVariant::kWideRows;
  }
  if (p.n == 1) {
    *reason = SpmmReason::kSingleRow;
    return SpmmVariant::kGlobalX;
  }
  if (p.n <= kGlobalXMaxBatch && p.n * p.in_dim * int64_t(p.value_bytes) <= kGlobalXMaxBytes) {
    *reason = SpmmReason::kSmallInput;
    return SpmmVariant::kGlobalX;
  }
  if (p.n <= kTinyProductMaxBatch && p.nnz * p.n <= kTinyProduct) {
    *reason = SpmmReason::kTinyProduct;
    return SpmmVariant::kGlobalX;
  }
  *reason = SpmmReason::kTransposeOnce;
  return SpmmVariant::kGlobalXT;
}

// The row kernels' grid: a persistent-style grid, every block strides over the rows; grid.y runs
// the batch tiles side by side, and the blocks of all tiles together fill the SMs.
Status rows_grid(const SpmmProblem& p, SpmmPlan* plan, const DeviceLimits& limits) {
  const int64_t rows_per_warp = cuda::detail::lanes_along_entries(plan->batch_tile) / plan->lanes_per_row;
  const int64_t blocks = ceil_div(ceil_div(p.out_dim, rows_per_warp), kSpmmWarps);
  const int64_t tiles = ceil_div(std::max<int64_t>(p.n, 1), plan->batch_tile);
  if (tiles > kMaxGridY)
    return InvalidArgument("batch too large for a batch tile of " + std::to_string(plan->batch_tile) + ": " +
                           std::to_string(p.n) + " rows");
  const int64_t per_sm = limits.max_threads_per_sm / (kSpmmWarps * 32);
  const int64_t slots = std::max<int64_t>(1, int64_t(limits.sms) * per_sm / tiles);
  plan->grid_x = std::max<int64_t>(1, std::min<int64_t>(blocks, slots));
  plan->threads = kSpmmWarps * 32;
  return Status::Ok();
}

// Blocks per band of the tile_view kernel, one cluster that splits the band's chunks: of 1, 2, 4, 6
// and 8, the count whose launch puts nearest (in ratio) four blocks on each SM with batch tiles of 16
// rows, three with 32-64 (the fragment kernel at 64: below), within one wave of what shared memory
// (and, for the fragment kernel, the registers) holds and at least one chunk a block.
// Measured on the H200 in bf16 with each count forced over 768x3072 to 16384x4096, 80-95%, the
// forward at N = 16-128 and dX at N = 1-64
// (bench/results/spmm_nvidia_h200_bf16_tile_view_splits.md): this choice is within 1% of the best
// count in geometric mean, 1.04x faster than the clusters doubled while under two blocks per SM
// (the tensor_core rule, which it replaced here; never more than 1% slower), e.g. at 90%:
//   - 11008x4096, N = 16: 4 splits, 36.5 against 42.8 us with 2 (2.6 blocks per SM leave it short of
//     warps); dX of 4096x11008 at N = 8 likewise: 39.7 against 42.5;
//   - 4096x4096, N = 32: 6 splits, 23.1 against 27.2 with 8; 4096x11008, N = 64: 60.3 against 65.9;
//     dX of 16384x4096 at N = 64: 83.5 against 89.8 (four blocks of 32-64 rows per SM run slower);
//   - 16384x4096, N = 16-64: 2 splits (3.9 blocks per SM), against 1.04-1.36x longer with 4 (two
//     waves) and 1.14-1.33x with 3 (clusters of three lost everywhere but two points, hence no 3).
// fragments.words > 0: the blocks of a fragment kernel, whose stages hold that many register words
// (measured with this rule, not tuned for it: spmm_nvidia_h100_80gb_hbm3_bf16_fragments.md). The wgmma
// kernel's (one warpgroup, 2-5 blocks an SM) aim at three blocks per SM at batch tiles of 32-64 and one
// at 128, where shared memory holds two; on the H100 at 90%, each count forced, us with 1 / 2 / 4 / 6
// / 8 blocks per band: 16384x4096, N = 64: 40.4 / 32.6 / 47.9 / 55.1 / 58.1 (this rule: 2); N = 128:
// 47.2 / 56.3 / 80.7 / 93.8 / 105.8 (1); 4096x4096, N = 64: 35.5 / 22.8 / 18.1 / 17.6 / 22.8 (6);
// N = 128: 41.3 / 26.6 / 32.4 / 29.2 / 35.0 (2). With two warpgroups a block, one block per SM at 128
// rows (4096x4096, N = 128, us with 1 / 2 / 3 / 4 / 6 / 8: 29.7 / 21.2 / 30.2 / 36.8 / 43.0 / 48.0,
// spmm_nvidia_h100_80gb_hbm3_bf16_wgmma_groups.md's build) and, forced, one and a half at 32-64.
int tile_view_splits(int64_t bands, int64_t batch_tiles, int64_t chunks, int batch_tile, bool transposed,
                     const DeviceLimits& limits, const cuda::detail::FragmentBlocks& fragments) {
  using namespace cuda::detail;
  const int64_t blocks_unsplit = bands * batch_tiles;
  static_assert(kTcMaxSplits == 8, "the counts tried below");
  // Blocks per SM. The fragment kernel's blocks of 64 rows (eight consumer warps, two blocks per SM
  // by their registers) ran fastest at one block per SM and batch tile, up to the two that fit
  // (4096x4096, 90%, each count forced on an H100: N = 64 26.6 us in pairs against 34.9 in clusters
  // of four; N = 128 32.4 in pairs against 39.8 unsplit).
  const int fragment_words = fragments.words;
  const double wanted = batch_tile == 16 ? 4.0
                        : fragments.wgmma ? (batch_tile == 128 ? 1.0 : 3.0 / fragments.parts)
                        : batch_tile == 64 && fragment_words > 0
                            ? double(std::min<int64_t>(batch_tiles, fragments.blocks_per_sm))
                            : 3.0;
  int best = 1;
  double best_miss = 0.0;
  for (const int splits : {1, 2, 4, 6, 8}) {
    if (splits > 1 && chunks < splits) break;
    const size_t block = (fragment_words > 0 ? fragment_smem_bytes(batch_tile, fragment_words, ceil_div(chunks, splits),
                                                                   fragments.parts)
                                             : tile_view_smem_bytes(batch_tile, ceil_div(chunks, splits), transposed)) +
                         limits.reserved_smem_per_block;
    const int64_t by_smem = int64_t(limits.smem_per_sm / block);
    const int64_t per_sm =
        fragment_words > 0 ? std::min<int64_t>({by_smem, int64_t(fragments.blocks_per_sm),
                                                int64_t(limits.max_threads_per_sm / fragments.threads)})
                           : std::min<int64_t>(by_smem, limits.max_threads_per_sm / kTcThreads);
    const int64_t blocks = blocks_unsplit * splits;
    if (splits > 1 && blocks > per_sm * limits.sms) break;
    const double miss = std::fabs(std::log(double(blocks) / double(limits.sms) / wanted));
    if (splits == 1 || miss < best_miss) best = splits, best_miss = miss;
  }
  return best;
}

// The tensor-core kernel's grid: a block per band of kTcBandRows output rows and batch tile, and
// per band a cluster of k_splits blocks that split its columns, doubled while the launch stays
// under two blocks per SM and each block keeps at least one chunk (3072x768, 70%, N = 64: 19.3 us
// in clusters of 8, 26.8 us in pairs when a block had to keep 256 columns; aiming at eight blocks
// per SM instead of two was slower on 16384x4096: 79.3 against 68.0 us at 90%, N = 16). The
// tile_view kernel, on the same grid, takes its clusters from tile_view_splits.
Status tensor_core_grid(const SpmmProblem& p, SpmmPlan* plan, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int64_t bands = ceil_div(p.out_dim, kTcBandRows);
  const int64_t tiles = ceil_div(std::max<int64_t>(p.n, 1), plan->batch_tile);
  if (tiles > kMaxGridY)
    return InvalidArgument("batch too large for a batch tile of " + std::to_string(plan->batch_tile) + ": " +
                           std::to_string(p.n) + " rows");
  int splits = 1;
  const bool fragments = plan->reads_fragments;
  const FragmentBlocks blocks =
      fragments ? fragment_blocks(plan->batch_tile, fragment_stage_words(p.out_dim, p.in_dim, p.nnz),
                                  plan->variant == SpmmVariant::kWgmma, plan->consumer_warpgroups)
                : FragmentBlocks{};
  if (plan->variant == SpmmVariant::kTileView || fragments) {
    const int64_t chunks = ceil_div(p.in_dim, kTcChunk);
    const int64_t most = std::min<int64_t>(kTcMaxSplits, std::max<int64_t>(1, chunks));  // 0 asks the planner
    if (p.tile_view_splits < 0 || p.tile_view_splits > most)
      return InvalidArgument("tile_view: " + std::to_string(p.tile_view_splits) + " blocks per band asked; 1 to " +
                             std::to_string(most) + " run this product (" + std::to_string(chunks) + " chunks of " +
                             std::to_string(kTcChunk) + " inputs per band)");
    splits = p.tile_view_splits != 0
                 ? p.tile_view_splits
                 : tile_view_splits(bands, tiles, chunks, plan->batch_tile, p.transposed, limits, blocks);
  } else {
    while (splits < kTcMaxSplits && bands * tiles * splits < 2 * int64_t(limits.sms) &&
           p.in_dim >= kTcSplitMinColumns * splits)
      splits *= 2;
  }
  plan->k_splits = splits;
  plan->grid_x = std::max<int64_t>(1, bands) * splits;
  plan->threads = fragments ? blocks.threads : kTcThreads;
  // tile_view also holds where its steps' tiles lie, at most ceil(chunks / splits) steps.
  const int64_t steps = ceil_div(ceil_div(p.in_dim, kTcChunk), splits);
  plan->smem_bytes = fragments ? fragment_smem_bytes(plan->batch_tile, blocks.words, steps, blocks.parts)
                     : plan->variant == SpmmVariant::kTileView
                         ? tile_view_smem_bytes(plan->batch_tile, steps, p.transposed)
                         : tensor_core_smem_bytes(plan->batch_tile);
  if (plan->smem_bytes > limits.smem_per_block)
    return InvalidArgument(std::string(spmm_variant_name(plan->variant)) + ": " + std::to_string(plan->smem_bytes) +
                           " B of shared memory per block exceed the device's " +
                           std::to_string(limits.smem_per_block));
  return Status::Ok();
}

// Input columns per stage of the shared_x kernel: two stages of up to 128 columns, halved until the
// block's shared memory fits the device's (on the H200: 64 columns of 256 fp32 batch rows, 128 of a
// tile of 128 fp32 or 256 16-bit rows; 128 KiB of stages either way).
int shared_x_chunk(const SpmmProblem& p, int tile, const DeviceLimits& limits) {
  int chunk = 128;
  while (chunk > 32 && cuda::detail::shared_x_smem_bytes(size_t(p.value_bytes), chunk, tile) > limits.smem_per_block)
    chunk /= 2;
  return chunk;
}

// The shared_x kernel's grid: a block per band of shared_x_band_rows outputs and batch tile.
Status shared_x_grid(const SpmmProblem& p, SpmmPlan* plan, const DeviceLimits& limits) {
  using namespace cuda::detail;
  const int64_t tiles = ceil_div(std::max<int64_t>(p.n, 1), plan->batch_tile);
  if (tiles > kMaxGridY)
    return InvalidArgument("batch too large for a batch tile of " + std::to_string(plan->batch_tile) + ": " +
                           std::to_string(p.n) + " rows");
  if (shared_x_offsets_overflow(p))
    return InvalidArgument("shared_x: " + std::to_string(p.in_dim) + " input columns overflow the kernel's 32-bit "
                           "offsets into a staged chunk");
  plan->grid_x = std::max<int64_t>(1, ceil_div(p.out_dim, shared_x_band_rows(size_t(p.value_bytes))));
  plan->threads = shared_x_warps(size_t(p.value_bytes)) * 32;
  plan->smem_bytes = shared_x_smem_bytes(size_t(p.value_bytes), plan->chunk, plan->batch_tile);
  if (plan->smem_bytes > limits.smem_per_block)
    return InvalidArgument("shared_x: " + std::to_string(plan->smem_bytes) + " B of shared memory per block exceed "
                           "the device's " + std::to_string(limits.smem_per_block));
  return Status::Ok();
}

// What both wgmma kernels need: 16-bit values and a Hopper GPU.
Status check_wgmma_problem(const SpmmProblem& p, const DeviceLimits& limits) {
  if (p.value_bytes != 2) return InvalidArgument("wgmma runs 16-bit values (bfloat16, float16) only");
  if (limits.compute_capability != 90)
    return InvalidArgument(cuda::detail::wgmma_needs_hopper(limits.compute_capability));
  return Status::Ok();
}

// The wgmma kernel's plan: a block per band of kWgBandRows outputs and batch tile of kWgBatchTile
// rows (one block per SM), and per band a cluster of k_splits blocks that split its chunks, doubled
// while the grid still fits one wave and each block keeps at least 8 chunks.
Status wgmma_plan(const SpmmProblem& p, SpmmPlan* plan, const DeviceLimits& limits) {
  using namespace cuda::detail;
  SNACK_RETURN_IF_ERROR(check_wgmma_problem(p, limits));
  if (p.in_dim == 0) return InvalidArgument("wgmma: a product without inputs (in_dim 0) has no chunk to copy");
  if (p.in_dim % 8 != 0)
    return InvalidArgument("wgmma: the inputs (" + std::to_string(p.in_dim) +
                           ") must be a multiple of 8 (the copy engine reads 16-byte rows)");
  if (p.in_dim > 65535) return InvalidArgument("wgmma: at most 65535 inputs, got " + std::to_string(p.in_dim));
  const int64_t bands = ceil_div(p.out_dim, kWgBandRows);
  const int64_t tiles = ceil_div(std::max<int64_t>(p.n, 1), kWgBatchTile);
  if (tiles > kMaxGridY) return InvalidArgument("wgmma: batch too large: " + std::to_string(p.n) + " rows");
  const int64_t chunks = ceil_div(p.in_dim, kWgChunk);
  int splits = 1;
  while (splits < kWgMaxSplits && bands * tiles * splits * 2 <= int64_t(limits.sms) && chunks >= 8 * splits * 2)
    splits *= 2;
  plan->batch_tile = kWgBatchTile;
  plan->chunk = kWgChunk;
  plan->k_splits = splits;
  plan->grid_x = std::max<int64_t>(1, bands) * splits;
  plan->threads = kWgThreads;
  plan->smem_bytes = wgmma_smem_bytes();
  plan->workspace_bytes = wgmma_lists(p.out_dim, p.in_dim, p.nnz).bytes;
  if (plan->smem_bytes > limits.smem_per_block)
    return InvalidArgument("wgmma: " + std::to_string(plan->smem_bytes) + " B of shared memory per block exceed "
                           "the device's " + std::to_string(limits.smem_per_block));
  return Status::Ok();
}

// Consumer warpgroups per block of the wgmma kernel over fragments: two, taking the band's tiles in
// turn, at batch tiles of 128 rows where the grid has fewer bands and batch tiles than the GPU has
// SMs, so that an SM would otherwise hold one warpgroup (more blocks per band ran slower: the
// clusters' sums and fewer steps a block); one elsewhere, where the blocks fill the SMs and two
// warpgroups would share one producer's stages. Each count forced on the H100
// (spmm_nvidia_h100_80gb_hbm3_bf16_wgmma_groups.md, commit a986894, 80-95%): 4096x4096, N = 128:
// 20.9-22.7 us with two against 26.7-27.4 with one (dense 21.7-22.1); 768x3072: 12.1-12.5 against
// 12.3-12.8; 16384x4096, N = 128: 56.8-63.9 against 46.4-47.9, N = 64: 33.2-41.5 against 33.3-41.1;
// 4096x4096, N = 64: 24.1-26.2 against 17.9-18.7.
int fragment_wgmma_groups(const SpmmProblem& p, int batch_tile, const DeviceLimits& limits) {
  using namespace cuda::detail;
  if (p.fragment_warpgroups != 0) return p.fragment_warpgroups;
  const int64_t blocks = ceil_div(p.out_dim, kTcBandRows) * ceil_div(std::max<int64_t>(p.n, 1), batch_tile);
  return batch_tile == kFragmentWgmmaMaxTile && blocks < limits.sms ? 2 : 1;
}

// The forward over tile fragments with wgmma: the tile_view grid (bands of 64 rows, clusters from
// tile_view_splits) with batch tiles of 16 to 128 rows and one or two consumer warpgroups a block.
Status fragment_wgmma_plan(const SpmmProblem& p, SpmmPlan* plan, const DeviceLimits& limits) {
  using namespace cuda::detail;
  SNACK_RETURN_IF_ERROR(check_wgmma_problem(p, limits));
  if (!p.tile_view)
    return InvalidArgument("wgmma: tile fragments need a pattern with the tile view (built for layers of at most " +
                           std::to_string(kTileViewMaxCols) + " inputs, unless left out)");
  if (p.fragment_warpgroups < 0 || p.fragment_warpgroups > kFragmentWgmmaMaxGroups)
    return InvalidArgument("wgmma: " + std::to_string(p.fragment_warpgroups) +
                           " consumer warpgroups a block asked over tile fragments (1 or 2; 0: the planner's)");
  plan->chunk = kTcChunk;
  plan->batch_tile = int(std::clamp<int64_t>(next_pow2(p.n), kTcMinTile, kFragmentWgmmaMaxTile));
  plan->consumer_warpgroups = fragment_wgmma_groups(p, plan->batch_tile, limits);
  return tensor_core_grid(p, plan, limits);
}

Status check_limits(const DeviceLimits& limits) {
  if (limits.sms <= 0 || limits.max_threads_per_sm <= 0 || limits.smem_per_block == 0 || limits.smem_per_sm == 0)
    return InvalidArgument("plan_spmm: device limits must be positive (query them with cuda::device_limits)");
  return Status::Ok();
}

// Where the transposed product runs faster over a copy of the CSC view than through csc_perm in
// place: from a batch of 256 (1024 below 3% density). The copy costs one pass of two random gathers
// per slot, each its own 32-byte L2 sector (16384x4096, 90%: ~95 us on the H200), which the kernels
// in place pay once per batch tile: below 256 rows there are few tiles and the copy loses, above it
// the copy is paid once and every tile reads the slots in order. Measured with both forced
// (backward_nvidia_h200_csc_kernels.md, fp32; backward_nvidia_h200_csc_bf16.md), 16384x4096:
// fp32, 90%, N = 1024 1693 against 2044 us, N = 8192 12782 against 16341; 99%, N = 8192 5054
// against 10777; bf16, 90%, N = 16 146.8 against 124.2; bf16 4096x4096, 90%, N = 256 118.9 against
// 180.2. At 99% and N = 256 the two are level or the copy loses (fp32 4096x4096: 43.1 against 40.6).
constexpr int64_t kCscCopyMinBatch = 256;
constexpr int64_t kCscCopySparseMinBatch = 1024;
bool csc_copy_pays(const SpmmProblem& p) {
  return p.transposed && (p.n >= kCscCopySparseMinBatch || (p.n >= kCscCopyMinBatch && density_of(p) >= 0.03));
}

// A product whose kernels read W through the view the problem names: the forward's CSR view, or for
// the transposed product the CSC view in place (through csc_perm).
Status plan_direct(const SpmmProblem& p, const DeviceLimits& limits, SpmmPlan* out) {
  SpmmPlan plan;
  plan.problem = p;
  const double avg = p.out_dim > 0 ? double(p.nnz) / double(p.out_dim) : 0.0;
  const size_t vb = size_t(p.value_bytes);
  const WideRowsShape wide =
      p.transposed ? WideRowsShape{} : wide_rows_shape(p.out_dim, p.in_dim, p.n, vb, limits);
  plan.variant = p.requested;
  plan.reason = SpmmReason::kForced;
  if (p.requested == SpmmVariant::kAuto) plan.variant = choose_variant(p, wide, avg, &plan.reason, limits);
  // Given tile fragments, kTileView's forward reads them where named or where they pay; where the
  // planner takes the view for its own rule, its kernel reads the values.
  // kWgmma's forward given them always reads them.
  plan.reads_fragments = !p.transposed && p.packed_tiles == TileValues::kFragments &&
                         ((plan.variant == SpmmVariant::kTileView &&
                           (p.requested == SpmmVariant::kTileView || fragments_pay(p))) ||
                          plan.variant == SpmmVariant::kWgmma);
  const SpmmVariant v = plan.variant;
  const int64_t batch = std::max<int64_t>(p.n, 1);
  switch (v) {
    case SpmmVariant::kGlobalX:
    case SpmmVariant::kGlobalXT: {
      // The largest batch tile that still gives the GPU enough warps (few output rows, large
      // batch: split the batch into more tiles rather than leave SMs idle).
      const int64_t max_tile = v == SpmmVariant::kGlobalXT ? 128 : 32;
      int tile = next_pow2(std::max<int64_t>(1, std::min<int64_t>(p.n, max_tile)));
      while (tile > 8 && warps_for(p.out_dim, (p.n + tile - 1) / tile, tile, max_lanes_per_row(tile, avg)) <
                             wanted_warps(limits))
        tile >>= 1;
      plan.batch_tile = tile;
      if (v == SpmmVariant::kGlobalXT && tile > 1) plan.workspace_bytes = transposed_bytes(p.in_dim, p.n, tile, vb);
      break;
    }
    case SpmmVariant::kWarpRow:
      plan.batch_tile = p.n <= 1 ? 1 : (p.n <= 4 ? 4 : 8);
      break;
    case SpmmVariant::kTensorCore:
      if (p.value_bytes != 2)
        return InvalidArgument("tensor_core runs 16-bit values (bfloat16, float16) only");
      plan.chunk = cuda::detail::kTcChunk;
      plan.batch_tile = int(std::clamp<int64_t>(next_pow2(p.n), cuda::detail::kTcMinTile, cuda::detail::kTcMaxTile));
      break;
    case SpmmVariant::kTileView:
      if (p.value_bytes != 2) return InvalidArgument("tile_view runs 16-bit values (bfloat16, float16) only");
      if (!p.tile_view)
        return InvalidArgument("tile_view: the pattern holds no tile view (it is built for layers of at most " +
                               std::to_string(kTileViewMaxCols) + " inputs, unless left out)");
      plan.chunk = cuda::detail::kTcChunk;
      plan.batch_tile = int(std::clamp<int64_t>(next_pow2(p.n), cuda::detail::kTcMinTile,
                                                plan.reads_fragments ? cuda::detail::kFragmentMaxTile
                                                                      : cuda::detail::kTileViewMaxTile));
      break;
    case SpmmVariant::kDenseBlocks:
      if (!p.gemm)
        return InvalidArgument("dense_blocks runs through the caller's GEMM: plan it with SpmmProblem::gemm set (the "
                               "torch front end does)");
      plan.block_rows = detail::dense_block_rows(p.out_dim, p.n);
      plan.workspace_bytes = size_t(plan.block_rows) * size_t(p.in_dim) * vb;
      break;
    case SpmmVariant::kSharedX:
      if (p.value_bytes == 8) return InvalidArgument("shared_x runs float32, bfloat16 and float16 values");
      plan.batch_tile = shared_x_batch_tile(p, limits);
      plan.chunk = shared_x_chunk(p, plan.batch_tile, limits);
      plan.workspace_bytes = transposed_bytes(p.in_dim, p.n, plan.batch_tile, vb);
      break;
    case SpmmVariant::kWideRows:
      if (wide.tile == 0)
        return InvalidArgument("wide_rows: a batch tile of 1 x " + std::to_string(p.in_dim) +
                               " values of X and the partial sums of one row per warp do not fit in shared memory");
      plan.batch_tile = wide.tile;
      plan.rows_per_warp = wide.rows_per_warp;
      plan.smem_bytes = wide.smem;
      break;
    default:
      plan.batch_tile = 1;
      break;
  }
  plan.lanes_per_row = v == SpmmVariant::kWarpRow || v == SpmmVariant::kWideRows || v == SpmmVariant::kTensorCore ||
                               v == SpmmVariant::kDenseBlocks || v == SpmmVariant::kSharedX ||
                               v == SpmmVariant::kWgmma || v == SpmmVariant::kTileView
                           ? 32
                           : lanes_per_row_for(v, plan.batch_tile, avg, p.out_dim,
                                               (p.n + plan.batch_tile - 1) / plan.batch_tile, p.transposed, limits);
  // An estimate (4-byte indices, no csc_perm): the threshold separates latency- from bandwidth-bound.
  const int64_t operand_bytes = p.nnz * int64_t(vb + sizeof(int32_t)) + p.n * p.in_dim * int64_t(vb);
  plan.prefetch_l2 = v != SpmmVariant::kWarpRow && v != SpmmVariant::kCooAtomic && v != SpmmVariant::kWideRows &&
                     v != SpmmVariant::kTensorCore && v != SpmmVariant::kDenseBlocks && v != SpmmVariant::kSharedX &&
                     v != SpmmVariant::kWgmma && v != SpmmVariant::kTileView &&
                     operand_bytes <= kPrefetchMaxBytes;
  // A row this long is summed by a whole block rather than one warp (skewed row lengths).
  plan.long_row_threshold = int32_t(std::min<double>(1 << 30, std::max(1024.0, 4.0 * avg)));
  switch (v) {
    case SpmmVariant::kWarpRow:
      plan.grid_x = detail::grid_for(p.out_dim, kSpmmWarps);
      plan.threads = kSpmmWarps * 32;
      break;
    case SpmmVariant::kCooAtomic:
      plan.grid_x = std::max<int64_t>(1, ceil_div(p.nnz, 256 * cuda::detail::kCooItems));
      plan.threads = 256;
      break;
    case SpmmVariant::kWideRows: {
      const int threads = cuda::detail::wide_rows_threads(plan.batch_tile);
      const int64_t groups = ceil_div(p.out_dim, plan.rows_per_warp);
      const int64_t resident = int64_t(limits.sms) * wide.blocks_per_sm;
      plan.grid_x = std::max<int64_t>(1, std::min(resident, ceil_div(groups, threads / 32)));
      plan.threads = threads;
      if (ceil_div(batch, plan.batch_tile) > int64_t(1) << 31)
        return InvalidArgument("wide_rows: batch too large");
      break;
    }
    case SpmmVariant::kTensorCore:
    case SpmmVariant::kTileView:
      SNACK_RETURN_IF_ERROR(tensor_core_grid(p, &plan, limits));
      break;
    case SpmmVariant::kSharedX:
      SNACK_RETURN_IF_ERROR(shared_x_grid(p, &plan, limits));
      break;
    case SpmmVariant::kWgmma:
      SNACK_RETURN_IF_ERROR(plan.reads_fragments ? fragment_wgmma_plan(p, &plan, limits)
                                                 : wgmma_plan(p, &plan, limits));
      break;
    case SpmmVariant::kDenseBlocks: {  // the expansion of one block, as expand_block launches it
      const cuda::detail::ExpandLaunch launch =
          cuda::detail::expand_launch(plan.block_rows, p.transposed ? p.out_dim : p.in_dim, p.value_bytes);
      plan.threads = cuda::detail::kExpandThreads;
      plan.grid_x = launch.grid;
      plan.smem_bytes = launch.smem_bytes;
      break;
    }
    default:
      SNACK_RETURN_IF_ERROR(rows_grid(p, &plan, limits));
      break;
  }
  *out = plan;
  return Status::Ok();
}

}  // namespace

Status plan_spmm(const SpmmProblem& p, const DeviceLimits& limits, SpmmPlan* out) {
  SNACK_RETURN_IF_ERROR(check_limits(limits));
  if (p.out_dim < 0 || p.in_dim < 0 || p.nnz < 0 || p.n < 0)
    return InvalidArgument("plan_spmm: sizes must be non-negative");
  if (p.value_bytes != 2 && p.value_bytes != 4 && p.value_bytes != 8)
    return InvalidArgument("plan_spmm: values are 2, 4 or 8 bytes, got " + std::to_string(p.value_bytes));
  // A forward-only kernel runs dX only as the planner's choice over a copy of the CSC view, never by name.
  if (p.transposed && spmm_variant_is_forward_only(p.requested))
    return InvalidArgument(std::string(spmm_variant_name(p.requested)) + " runs only the forward product");
  if (p.can_pack_fragments && p.packed_tiles == TileValues::kNone && p.requested == SpmmVariant::kAuto &&
      (!p.transposed || p.csc == CscRead::kAuto) && p.n > 128 && p.n <= kFragmentPackMaxRows &&
      density_of(p) <= kFragmentPackMaxDensity) {
    // Fragments packed for this one product where the wgmma kernel over them pays past 128 rows
    // (fragments_pay_past_128: 1.9-3.3x the kernels without them at 256 rows), up to 512 rows: W's
    // for the forward; for dX = dY W, W^T's (transposed tile fragments, from the same tile view), the
    // product then running as the forward of the K x M weight W^T, whose rule it follows (W's rows
    // are W^T's columns, which the tile view bounds; a CSC read asked for keeps dX on the CSC view).
    // The packing (one pass over the weight's values and tile view, writing ~5 bytes a connection at
    // 90%) costs the planner given the fragments 6-8 us on 768x3072 and 3072x768, 17-29 on 4096x4096
    // and 54-97 on 16384x4096 at 80-95% (H100, bf16: spmm_nvidia_h100_80gb_hbm3_bf16_pack_batch.md,
    // commit d897787, `snack` against `snack_fragments`). With it the product still beats
    // dense_blocks at 256 and 512 rows (16384x4096, 80%, 512 rows: 275 against 496 us) but not at
    // 1024, where the kernel given the fragments plus the packing exceed dense_blocks (16384x4096,
    // 80%: 351 + ~97 against 393 us, spmm_nvidia_h100_80gb_hbm3_bf16_large_one_pass.md), so the
    // plan is the one without fragments. Not at 17-128 rows, where the kernel gains less than the
    // packing costs on the small layers, nor past 25% density, where the packing (its time grows with
    // the slots: ~2.5x at 50% what it costs at 80%) is not measured against the gain (16384x4096, 50%,
    // 256 rows: 107.8 us given the fragments against 285.9 without, so about even).
    SpmmProblem forward = p;
    forward.transposed = false;
    forward.csc = CscRead::kAuto;
    forward.packed_tiles = TileValues::kFragments;
    forward.can_pack_fragments = false;
    if (p.in_dim <= kTileViewMaxCols && fragment_wgmma_pays(forward, limits)) {
      SNACK_RETURN_IF_ERROR(plan_direct(forward, limits, out));
      out->problem = p;  // the launch is given them
      out->problem.packed_tiles = TileValues::kFragments;
      out->problem.can_pack_fragments = false;
      out->packs_fragments = true;
      return Status::Ok();
    }
  }
  if (!p.transposed || p.csc == CscRead::kInPlace) return plan_direct(p, limits, out);
  // dense_blocks expands W^T from the CSC view itself, wgmma sorts the view's slots into its own
  // lists and tile_view reads the forward's tile view: they read the pattern in place.
  const bool copyable = p.requested != SpmmVariant::kDenseBlocks && p.requested != SpmmVariant::kWgmma &&
                        p.requested != SpmmVariant::kTileView;
  if (p.csc == CscRead::kCopied && !copyable)
    return InvalidArgument(std::string(spmm_variant_name(p.requested)) +
                           " cannot run the transposed product over a copy of the CSC view (csc_read in_place or "
                           "auto)");
  if (!copyable || (p.csc == CscRead::kAuto && !csc_copy_pays(p))) return plan_direct(p, limits, out);
  if (p.csc == CscRead::kAuto && p.gemm && p.requested == SpmmVariant::kAuto && p.value_bytes == 2 &&
      p.n >= kCscCopySparseMinBatch) {
    // In 16 bits from a batch of 1024, where dense blocks beat the sparse kernels read in place they
    // stay: the forward's model of W^T would sometimes take the tensor-core kernel, which loses to
    // them (bf16 768x3072, 80%, N = 2048: 104.6 us over the copy against 37.0 for dense blocks).
    // Below that batch the blocks' expansion through csc_perm costs more than the GEMM (bf16
    // 16384x4096, 80%, N = 256: 1175 us against 552 over the copy), and in fp32 the forward's model
    // holds (768x3072, 90%, N = 8192: 504 us for shared_x over the copy against 796 for dense blocks).
    SNACK_RETURN_IF_ERROR(plan_direct(p, limits, out));
    if (out->variant == SpmmVariant::kDenseBlocks) return Status::Ok();
  }
  // The copy is the CSR form of W^T: plan the forward of that K x M weight.
  SpmmProblem forward = p;
  forward.transposed = false;
  forward.csc = CscRead::kAuto;
  forward.tile_view = false;  // the copy holds no tile view
  if (p.csc == CscRead::kCopied) forward.gemm = false;  // asked for a sparse kernel over the copy
  SpmmPlan plan;
  SNACK_RETURN_IF_ERROR(plan_direct(forward, limits, &plan));
  if (plan.variant == SpmmVariant::kDenseBlocks) {
    // Dense blocks pay on this problem even over the faster sparse kernels: they expand the CSC view
    // in place, a block at a time (no copy).
    SpmmProblem blocks = p;
    blocks.requested = SpmmVariant::kDenseBlocks;
    SNACK_RETURN_IF_ERROR(plan_direct(blocks, limits, &plan));
    plan.problem = p;
    plan.reason = SpmmReason::kDenseBlocks;
    *out = plan;
    return Status::Ok();
  }
  plan.problem = p;
  plan.csc_copied = true;
  plan.copy_offset = cuda::detail::round_up_16(plan.workspace_bytes);
  plan.workspace_bytes = plan.copy_offset + cuda::detail::round_up_16(size_t(p.nnz) * size_t(csc_copy_index_bytes(p))) +
                         size_t(p.nnz) * size_t(p.value_bytes);
  *out = plan;
  return Status::Ok();
}

bool plan_transposes_whole_input(const SpmmPlan& plan) {
  const int64_t n = plan.problem.n;
  return plan.variant == SpmmVariant::kGlobalXT && plan.batch_tile > 1 && n >= 1 && n <= plan.batch_tile;
}

std::string describe(const SpmmPlan& plan) {
  std::string s = std::string(spmm_variant_name(plan.variant)) + " (batch tile " + std::to_string(plan.batch_tile);
  if (plan.variant == SpmmVariant::kWideRows) {
    s += ", " + std::to_string(plan.rows_per_warp) + " rows per warp";
  } else if (plan.variant == SpmmVariant::kTensorCore || plan.variant == SpmmVariant::kTileView ||
             plan.reads_fragments) {
    s += ", bands of " + std::to_string(cuda::detail::kTcBandRows) + " rows, chunks of " +
         std::to_string(plan.chunk) + " columns, " + std::to_string(plan.k_splits) +
         " block" + (plan.k_splits > 1 ? "s" : "") + " per band";
    if (plan.reads_fragments) {
      const SpmmProblem& q = plan.problem;
      const int words = cuda::detail::fragment_stage_words(q.out_dim, q.in_dim, q.nnz);
      // W's dimensions: the transposed product's out_dim is W's columns
      const int64_t rows = q.transposed ? q.in_dim : q.out_dim, cols = q.transposed ? q.out_dim : q.in_dim;
      s += std::string(plan.variant == SpmmVariant::kWgmma
                           ? (plan.consumer_warpgroups == 2 ? ", two warpgroups on alternate tiles" : "") +
                                 std::string(", A operands in registers")
                           : ", operands") +
           " loaded from the tile fragments" + (q.transposed ? " of W^T" : "") +
           (plan.packs_fragments
                ? " (packed for this product, " + std::to_string(4 * tile_fragment_layout(rows, cols, q.nnz).words) +
                      " B)"
                : std::string()) +
           ", " + std::to_string(cuda::detail::kFragmentStages) + " stages of " + std::to_string(words) +
           " register words";
    } else if (plan.variant == SpmmVariant::kTileView && plan.problem.packed_tiles == TileValues::kPacked &&
             !plan.problem.transposed)
      s += ", values from the packed tile values";
  } else if (plan.variant == SpmmVariant::kSharedX) {
    s += ", bands of " + std::to_string(cuda::detail::shared_x_band_rows(size_t(plan.problem.value_bytes))) +
         " rows, chunks of " +
         std::to_string(plan.chunk) + " columns";
  } else if (plan.variant == SpmmVariant::kDenseBlocks) {
    s += ", blocks of " + std::to_string(plan.block_rows) + " outputs";
  } else if (plan.variant == SpmmVariant::kWgmma) {
    s += ", bands of " + std::to_string(cuda::detail::kWgBandRows) + " rows, chunks of " + std::to_string(plan.chunk) +
         " columns, " + std::to_string(plan.k_splits) + " block" + (plan.k_splits > 1 ? "s" : "") + " per band";
  } else if (plan.variant != SpmmVariant::kWarpRow && plan.variant != SpmmVariant::kCooAtomic) {
    s += ", " + std::to_string(plan.lanes_per_row) + " lanes per row";
  }
  s += ", " + std::to_string(plan.grid_x) + " blocks of " + std::to_string(plan.threads);
  if (plan.smem_bytes) s += ", " + std::to_string(plan.smem_bytes) + " B shared memory";
  if (plan.workspace_bytes) s += ", " + std::to_string(plan.workspace_bytes) + " B workspace";
  if (plan.csc_copied) s += ", over a copy of the CSC view";
  if (plan.prefetch_l2) s += ", L2 prefetch";
  return s + "): " + spmm_reason_text(plan.reason);
}

}  // namespace snack

namespace snack {

int64_t channels_first_block_rows(const ChannelsFirstProblem& p) {
  const int64_t image_rows = p.batch * p.pixels;  // W's rows the images' values would hold
  if (image_rows >= p.out_channels) return std::max<int64_t>(p.out_channels, 0);
  return std::min(p.out_channels, std::max<int64_t>(64, image_rows / 64 * 64));
}

namespace {
// The paths' costs on the H200 (132 SMs; bench/results/conv_paths_nvidia_h200.md: MobileNetV1's
// pointwise layers at 90%, 1 and 64 images, each path forced, CUDA-graph replays), in microseconds,
// scaled by the SM count. A launch in a graph costs ~8 us for the first kernel and ~3 for each one
// after it (the dense path counts three: the expansion and cuDNN's, the pixel rows three: the
// transposes and the product). In place: ~0.7 us per million multiply-adds where the pixels go two or more to a lane
// (1.6 for odd pixel counts, one to a lane), and ~3 us per million outputs (a warp's fixed work per
// output channel and tile of pixels; layers of 64-128 channels over many pixels). Dense: the
// expansion (~1.2 TB/s written), cuDNN's read of W (~3 TB/s), its pass over the activations (~1.4
// TB/s in fp32, ~0.9 in 16 bits on NCHW) and its arithmetic (~250 TFLOP/s in 16 bits, ~200 with
// TF32, ~50 in fp32), and ~12 us for each block of W after the first (one image of 7 x 7 pixels
// holds the values of 49 of W's rows: a 1024 x 1024 layer then takes 16 blocks, ~200 us). Pixel rows: two transposes (~0.5 TB/s each way, strided) around the linear
// product (dense_blocks.h's estimates, their ~10 us of launches counted here as the path's kernels).
struct ChannelsFirstRates {
  double first_kernel_us = 8.0;
  double next_kernel_us = 3.0;
  double in_place_us_per_mmac[2] = {0.7, 1.6};  // pixels even, odd
  double in_place_us_per_moutput = 3.0;
  double expand_gbs = 1200.0;
  double weight_read_gbs = 3000.0;
  double conv_activation_gbs[2] = {1400.0, 900.0};  // fp32, 16-bit
  double conv_tflops_16bit = 250.0;
  double conv_tflops_tf32 = 200.0;
  double conv_tflops_fp32 = 50.0;
  double transpose_gbs = 500.0;
  double dense_block_us = 12.0;  // each block after the first: its expansion and cuDNN's launches
  int reference_sms = 132;
};
constexpr ChannelsFirstRates kChannelsFirstRates{};
}  // namespace

ChannelsFirstPath plan_channels_first(const ChannelsFirstProblem& p, const DeviceLimits& limits) {
  const int64_t n = p.batch * p.pixels;
  if (p.value_bytes == 8 || n == 0 || p.out_channels == 0 || p.in_channels == 0 || p.nnz == 0)
    return ChannelsFirstPath::kInPlace;
  const ChannelsFirstRates& r = kChannelsFirstRates;
  const double scale = double(limits.sms) / r.reference_sms;
  const double bytes = p.value_bytes, macs = double(p.nnz) * double(n), outputs = double(p.out_channels) * double(n);
  const double weight_bytes = double(p.out_channels) * double(p.in_channels) * bytes;
  const double activation_bytes = double(n) * double(p.in_channels + p.out_channels) * bytes;
  const double in_place = r.first_kernel_us + (macs * r.in_place_us_per_mmac[p.pixels % 2] +
                                               outputs * r.in_place_us_per_moutput) / (1e6 * scale);
  const double conv_tflops = p.value_bytes == 2 ? r.conv_tflops_16bit : p.tf32 ? r.conv_tflops_tf32 : r.conv_tflops_fp32;
  const double dense = r.first_kernel_us + 2.0 * r.next_kernel_us +  // the expansion, cuDNN's kernels
                       (weight_bytes / r.expand_gbs + weight_bytes / r.weight_read_gbs +
                        activation_bytes / r.conv_activation_gbs[p.value_bytes == 2]) / (1e3 * scale) +
                       2.0 * weight_bytes / bytes * double(n) / (conv_tflops * 1e6 * scale) +
                       double(ceil_div(p.out_channels, channels_first_block_rows(p)) - 1) * r.dense_block_us;
  const detail::DenseBlocksProblem product{detail::DenseBlocksOp::kForward, p.out_channels, p.in_channels, p.nnz, n,
                                           p.value_bytes, false};
  const double linear = n >= kDenseBlockMinRows ? std::min(detail::sparse_us(product, limits),
                                                            detail::dense_blocks_us(product, limits))
                                                : detail::sparse_us(product, limits);
  const double pixel_rows = r.first_kernel_us + 2.0 * r.next_kernel_us +
                            2.0 * activation_bytes / (r.transpose_gbs * 1e3 * scale) + linear -
                            detail::kDenseBlocksRates.sparse_fixed_us;
  if (in_place <= dense && in_place <= pixel_rows) return ChannelsFirstPath::kInPlace;
  // GELU on 16-bit values: the dense path would convolve in float32 to round once (cuDNN rounds its
  // 16-bit sums); the pixel rows apply it to the float sums.
  if (p.value_bytes == 2 && p.act == Activation::kGELU) return ChannelsFirstPath::kPixelRows;
  // 16-bit images of fewer than 64 pixels: cuDNN's convolution ran 2.3-4.2x slower than the pixel
  // rows there (bf16, 7 x 7, 64 images of 1024 channels: 166 against 52 us; measured with the pixels
  // passed as one column, before they were passed as a near-square image).
  if (p.value_bytes == 2 && p.pixels < 64 && dense < pixel_rows) return ChannelsFirstPath::kPixelRows;
  return dense <= pixel_rows ? ChannelsFirstPath::kDenseBlocks : ChannelsFirstPath::kPixelRows;
}

}  // namespace snack
