// The planners on the CPU: the benchmark grid's plans for the H200 against the committed table,
// their invariants on the limits of several GPUs, and the rules the measurements set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "plan_grid.h"

#ifndef SNACK_TEST_DATA_DIR
#error "SNACK_TEST_DATA_DIR must name tests/cpp/data"
#endif

namespace snack::test {
namespace {

// A problem of a planner rule's table and whether the rule takes it.
struct RuleCase {
  int64_t out, in;
  double density;
  int64_t n;
  bool taken;
};
std::ostream& operator<<(std::ostream& os, const RuleCase& c) {
  return os << c.out << "x" << c.in << " density " << c.density << " n " << c.n;
}

SpmmPlan plan(int64_t out_dim, int64_t in_dim, int64_t nnz, int64_t n, int value_bytes = 4,
              SpmmVariant requested = SpmmVariant::kAuto, bool transposed = false,
              const DeviceLimits& limits = DeviceLimits::h200(), bool gemm = false, bool tf32 = false) {
  SpmmPlan p;
  const Status s = plan_spmm({out_dim, in_dim, nnz, n, value_bytes, transposed, requested, gemm, tf32}, limits, &p);
  EXPECT_TRUE(s.ok()) << s.message();
  return p;
}

SddmmPlan plan_dw(int64_t rows, int64_t cols, int64_t nnz, int64_t n, SddmmEpilogue epilogue = SddmmEpilogue::kStore,
                  SddmmVariant requested = SddmmVariant::kAuto, int64_t x_t_stride = 0, int value_bytes = 4,
                  bool gemm = false, bool tile_view = false, Status* status = nullptr) {
  SddmmProblem p;
  p.rows = rows;
  p.cols = cols;
  p.nnz = nnz;
  p.n = n;
  p.epilogue = epilogue;
  p.requested = requested;
  p.x_t_stride = x_t_stride;
  p.value_bytes = value_bytes;
  p.gemm = gemm;
  p.tile_view = tile_view;
  SddmmPlan out;
  const Status s = plan_sddmm(p, DeviceLimits::h200(), &out);
  if (status)
    *status = s;  // the caller checks it
  else
    EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

// The H200 plans of every benchmark grid point are those of the table, which the committed
// benchmark results were measured with.
// The folder of the test data: SNACK_TEST_DATA_DIR in the environment (a binary run on another
// machine), else the source tree it was built from.
std::string data_dir() {
  const char* env = std::getenv("SNACK_TEST_DATA_DIR");
  return env && *env ? env : SNACK_TEST_DATA_DIR;
}

TEST(Planner, BenchmarkGridOnTheH200MatchesTheTable) {
  std::ifstream table(data_dir() + "/plans_h200.txt");
  ASSERT_TRUE(table.good()) << "missing " << data_dir() << "/plans_h200.txt";
  std::vector<std::string> expected;
  for (std::string line; std::getline(table, line);)
    if (!line.empty() && line[0] != '#') expected.push_back(line);
  const std::vector<GridPoint> grid = benchmark_grid();
  ASSERT_EQ(expected.size(), grid.size());
  int differing = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    Status status;
    const std::string line = plan_grid_point(grid[i], DeviceLimits::h200(), &status);
    ASSERT_TRUE(status.ok()) << status.message();
    if (line != expected[i] && ++differing <= 5) ADD_FAILURE() << "planned: " << line << "\ntable:   " << expected[i];
  }
  EXPECT_EQ(differing, 0);
}

// What every plan of the row kernels, wide_rows and the SDDMM respects, on each GPU's limits.
// shared_x's batch tile: two 16-byte vectors a lane in fp32 (256 rows), one (128) where only that grid
// fills the SMs; one in 16 bits (256 rows). The stages' chunk shrinks to fit the wider tile.
TEST(Planner, SharedXBatchTile) {
  const DeviceLimits h200 = DeviceLimits::h200();
  const auto plan = [&](int64_t out, int64_t in, int64_t n, int bytes) {
    SpmmPlan p;
    const Status s = plan_spmm({out, in, out * in / 10, n, bytes, false, SpmmVariant::kSharedX}, h200, &p);
    EXPECT_TRUE(s.ok()) << s.message();
    return p;
  };
  SpmmPlan p = plan(16384, 4096, 1024, 4);  // 128 bands x 4 tiles
  EXPECT_EQ(p.batch_tile, 256);
  EXPECT_EQ(p.chunk, 64);
  p = plan(3072, 768, 512, 4);  // 24 bands: 48 blocks of 256 rows, 96 of 128
  EXPECT_EQ(p.batch_tile, 128);
  EXPECT_EQ(p.chunk, 128);
  p = plan(768, 3072, 256, 4);  // 6 bands: neither fills, the wide tile
  EXPECT_EQ(p.batch_tile, 256);
  p = plan(3072, 768, 512, 2);  // 16 bits: one vector, 256 rows
  EXPECT_EQ(p.batch_tile, 256);
  EXPECT_EQ(p.chunk, 128);
  for (const SpmmPlan& q : {plan(16384, 4096, 1024, 4), plan(3072, 768, 512, 4), plan(3072, 768, 512, 2)})
    EXPECT_LE(q.smem_bytes, h200.smem_per_block) << describe(q);
  // Past 4 M input columns the parked 32-bit byte offsets would overflow: refused when forced, not chosen.
  SpmmPlan big;
  EXPECT_FALSE(plan_spmm({64, int64_t(1) << 22, 1000, 1024, 4, false, SpmmVariant::kSharedX}, h200, &big).ok());
}

// shared_x parks its slots' values as float32: float64 products are refused, not rounded.
TEST(Planner, SharedXRefusesFloat64) {
  SpmmPlan p;
  const Status s = plan_spmm({4096, 4096, 1677722, 1024, 8, false, SpmmVariant::kSharedX}, DeviceLimits::h200(), &p);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("float32, bfloat16 and float16"), std::string::npos) << s.message();
}

// The workspace of a plan's kernel: all of it, or what precedes the copy of the CSC view.
size_t variant_workspace(const SpmmPlan& p) { return p.csc_copied ? p.copy_offset : p.workspace_bytes; }

// A copy of the CSC view only for the transposed product, where the rule or the caller takes it,
// after the kernel's own workspace: rows (16-byte aligned), then values.
void check_csc_copy(const SpmmPlan& p, bool transposed) {
  const SpmmProblem& q = p.problem;
  if (!p.csc_copied) {
    EXPECT_TRUE(!transposed || q.csc == CscRead::kInPlace || q.n < 256 || p.variant == SpmmVariant::kDenseBlocks ||
                (q.n < 1024 && double(q.nnz) < 0.03 * double(q.out_dim) * double(q.in_dim)))
        << describe(p);
    return;
  }
  EXPECT_TRUE(transposed) << describe(p);
  EXPECT_NE(p.variant, SpmmVariant::kDenseBlocks) << describe(p);
  EXPECT_EQ(p.copy_offset % 16, 0u) << describe(p);
  const size_t rows = size_t(q.nnz) * size_t(csc_copy_index_bytes(q));
  EXPECT_EQ(p.workspace_bytes, p.copy_offset + (rows + 15) / 16 * 16 + size_t(q.nnz) * size_t(q.value_bytes))
      << describe(p);
}

TEST(Planner, PlansFitTheirDevice) {
  for (const DeviceLimits& limits :
       {DeviceLimits::a100(), DeviceLimits::h100_pcie(), DeviceLimits::h100_sxm(), DeviceLimits::h200(),
        DeviceLimits::l40s()}) {
    SCOPED_TRACE(::testing::Message() << limits.sms << " SMs, " << limits.smem_per_block << " B per block");
    for (const GridPoint& g : benchmark_grid()) {
      for (const bool transposed : {false, true}) {
        for (SpmmVariant v : {SpmmVariant::kAuto, SpmmVariant::kGlobalX, SpmmVariant::kGlobalXT, SpmmVariant::kWarpRow}) {
          if (v == SpmmVariant::kGlobalX && g.n > 32 * 65535) continue;
          SpmmPlan p;
          const int64_t out = transposed ? g.k : g.m, in = transposed ? g.m : g.k;
          ASSERT_TRUE(plan_spmm({out, in, g.nnz, g.n, g.value_bytes, transposed, v}, limits, &p).ok());
          EXPECT_EQ(p.batch_tile & (p.batch_tile - 1), 0) << describe(p);
          if (p.variant == SpmmVariant::kWideRows) {
            EXPECT_LE(p.batch_tile, g.value_bytes == 2 ? 16 : 8) << describe(p);
            EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
            // One 16-byte gather per slot, two for a tile of 16 16-bit rows.
            EXPECT_LE(size_t(p.batch_tile) * size_t(g.value_bytes), g.value_bytes == 2 ? 32u : 16u) << describe(p);
          } else if (p.variant == SpmmVariant::kTensorCore) {
            EXPECT_EQ(g.value_bytes, 2) << describe(p);
            EXPECT_GE(p.batch_tile, 16) << describe(p);
            EXPECT_LE(p.batch_tile, 128) << describe(p);
            EXPECT_TRUE(p.chunk == 64 || (p.chunk == 256 && p.batch_tile <= 64)) << describe(p);
            EXPECT_EQ(p.smem_bytes, size_t(2) * (64 + 2 * p.batch_tile) * (p.chunk + 8)) << describe(p);
            EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
            // A block per band and split; the splits one power-of-two cluster of at most 8.
            EXPECT_EQ(p.grid_x, (out + 63) / 64 * p.k_splits) << describe(p);
            EXPECT_EQ(p.k_splits & (p.k_splits - 1), 0) << describe(p);
            EXPECT_LE(p.k_splits, 8) << describe(p);
          } else if (p.variant == SpmmVariant::kSharedX) {  // chosen for fp32 only, its grid a band per block
            EXPECT_EQ(g.value_bytes, 4) << describe(p);
            EXPECT_GE(g.n, 256) << describe(p);
            EXPECT_EQ(p.grid_x, (out + 127) / 128) << describe(p);
            EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
          } else if (p.variant != SpmmVariant::kWarpRow) {
            EXPECT_LE(p.batch_tile, p.variant == SpmmVariant::kGlobalXT ? 128 : 32) << describe(p);
            EXPECT_GE(p.lanes_per_row, 1) << describe(p);
            EXPECT_LE(p.lanes_per_row, 32 / (p.batch_tile / std::min(p.batch_tile, 4))) << describe(p);
            EXPECT_EQ(p.lanes_per_row & (p.lanes_per_row - 1), 0) << describe(p);
            // A persistent grid: all batch tiles' blocks together within the threads the SMs hold.
            const int64_t tiles = (g.n + p.batch_tile - 1) / p.batch_tile;
            EXPECT_LE(p.grid_x, std::max<int64_t>(1, int64_t(limits.sms) * limits.max_threads_per_sm / p.threads / tiles))
                << describe(p);
          }
          check_csc_copy(p, transposed);
          if ((p.variant == SpmmVariant::kGlobalXT && p.batch_tile > 1) || p.variant == SpmmVariant::kSharedX) {
            const int64_t padded = (g.n + p.batch_tile - 1) / p.batch_tile * p.batch_tile;
            EXPECT_EQ(variant_workspace(p), size_t((in + 1) * padded * g.value_bytes)) << describe(p);
          } else {
            EXPECT_EQ(variant_workspace(p), 0u) << describe(p);
          }
        }
      }
      for (const bool transposed : {false, true}) {  // shared_x, forced: every 4- and 2-byte product
        SpmmPlan p;
        const int64_t out = transposed ? g.k : g.m, in = transposed ? g.m : g.k;
        const Status s = plan_spmm({out, in, g.nnz, g.n, g.value_bytes, transposed, SpmmVariant::kSharedX}, limits, &p);
        if (g.value_bytes == 8) {
          EXPECT_FALSE(s.ok());
          continue;
        }
        ASSERT_TRUE(s.ok()) << s.message();
        // Two 16-byte vectors a lane in fp32 (256 rows) unless one (128) fills the SMs where two do not.
        EXPECT_TRUE(p.batch_tile == 256 || (g.value_bytes == 4 && p.batch_tile == 128)) << describe(p);
        const int64_t band = g.value_bytes == 4 ? 128 : 64;  // 32 warps of 4 rows in fp32, 16 in 16 bits
        EXPECT_EQ(p.grid_x, std::max<int64_t>(1, (out + band - 1) / band)) << describe(p);
        EXPECT_EQ(p.threads, int(band / 4 * 32)) << describe(p);
        EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
        EXPECT_EQ(p.chunk % 8, 0) << describe(p);
        check_csc_copy(p, transposed);
        EXPECT_EQ(variant_workspace(p), size_t((in + 1) * ((g.n + p.batch_tile - 1) / p.batch_tile * p.batch_tile) *
                                               g.value_bytes))
            << describe(p);
      }
      for (const SddmmEpilogue e : {SddmmEpilogue::kStore, SddmmEpilogue::kAdamW}) {
        SddmmPlan p;
        ASSERT_TRUE(plan_sddmm(sddmm_problem_at(g, e), limits, &p).ok());
        if (p.variant != SddmmVariant::kStaged)
          EXPECT_LE(p.grid_x, p.variant == SddmmVariant::kSlot ? int64_t(1) << 20 : int64_t(limits.sms) * 8)
              << describe(p);
        if (p.variant == SddmmVariant::kRows) {
          EXPECT_LE(p.padded_batch, kSddmmRowsMaxBatch) << describe(p);
          EXPECT_LE(p.lanes_per_row, 32 / p.batch_lanes) << describe(p);
          EXPECT_EQ(p.workspace_bytes, size_t(g.k * p.padded_batch * g.value_bytes)) << describe(p);
        }
        if (p.variant == SddmmVariant::kVector)
          EXPECT_EQ(p.workspace_bytes, size_t((g.k + g.m) * p.padded_batch * g.value_bytes)) << describe(p);
        if (p.variant == SddmmVariant::kSlot) EXPECT_EQ(p.workspace_bytes, 0u) << describe(p);
        if (p.variant == SddmmVariant::kDenseBlocks)
          EXPECT_EQ(p.workspace_bytes, size_t(p.block_rows * g.k * g.value_bytes)) << describe(p);
        if (p.variant == SddmmVariant::kStaged) {
          EXPECT_EQ(g.value_bytes, 4) << describe(p);
          EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
          EXPECT_TRUE(!p.staged_vector_copies || (p.chunk_cols <= 128 && g.k % 4 == 0 && g.m % 4 == 0)) << describe(p);
          EXPECT_GE(p.grid_x * p.chunk_cols, g.k) << describe(p);
          EXPECT_GE(p.batch_splits * p.split_samples, g.n) << describe(p);
          EXPECT_EQ(p.split_samples % 64, 0) << describe(p);
          EXPECT_EQ(p.staged_sums_in_workspace, p.batch_splits > 1 || e == SddmmEpilogue::kAdamW) << describe(p);
          EXPECT_EQ(p.workspace_bytes, p.staged_sums_in_workspace ? size_t(p.batch_splits) * g.nnz * 4 : 0u)
              << describe(p);
        }
      }
    }
  }
}

// The rules measured on the H200, one by one.
TEST(Planner, ForwardRules) {
  // One batch row: X read in place, no workspace.
  SpmmPlan p = plan(4096, 4096, 1677722, 1);
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(p.reason, SpmmReason::kSingleRow);
  EXPECT_EQ(p.workspace_bytes, 0u);
  // A small input (8 rows x 1024 = 32 KiB, stays in L1): in place too, operands prefetched into L2.
  p = plan(768, 1024, 78643, 8);
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(p.reason, SpmmReason::kSmallInput);
  EXPECT_TRUE(p.prefetch_l2);
  // 16 rows of it: 1.3 M multiply-adds, transposed.
  EXPECT_EQ(plan(768, 1024, 78643, 16).variant, SpmmVariant::kGlobalXT);
  // A tiny product (16.8 k entries x 16 rows) reads even a 256 KiB X in place.
  p = plan(4096, 4096, 16777, 16);
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(p.reason, SpmmReason::kTinyProduct);
  // A large product: X transposed into (in_dim + the zero slot) x the batch padded to the tile.
  p = plan(16384, 4096, 6710886, 20);
  EXPECT_EQ(p.variant, SpmmVariant::kGlobalXT);
  EXPECT_EQ(p.reason, SpmmReason::kTransposeOnce);
  const int64_t padded = (20 + p.batch_tile - 1) / p.batch_tile * p.batch_tile;
  EXPECT_EQ(p.workspace_bytes, size_t(4097 * padded * sizeof(float)));
  EXPECT_FALSE(p.prefetch_l2);  // 40 MB of slot arrays: bandwidth-bound, no prefetch
  EXPECT_TRUE(plan_transposes_whole_input(p));
  // Lanes per row on 132 SMs (16384x4096, 90%): the forward at N = 16 goes from one wave of warps
  // to two (4 lanes, not 2); at N = 1 each lane would keep too few entries for that, and stays at 8;
  // the transposed product (4096 rows of 1638 entries) takes 8 lanes at N = 1 (not 32) and at N = 16.
  EXPECT_EQ(plan(16384, 4096, 6710886, 16).lanes_per_row, 4);
  EXPECT_EQ(plan(16384, 4096, 6710886, 1, 4, SpmmVariant::kGlobalX).lanes_per_row, 8);
  EXPECT_EQ(plan(4096, 16384, 6710886, 1, 4, SpmmVariant::kAuto, true).lanes_per_row, 8);
  EXPECT_EQ(plan(4096, 16384, 6710886, 1).lanes_per_row, 32);  // the same product as a forward
  EXPECT_EQ(plan(4096, 16384, 6710886, 16, 4, SpmmVariant::kAuto, true).lanes_per_row, 8);
}

TEST(Planner, WideRowsRules) {
  // One batch row of a large layer: groups of 16384 / (132 SMs x 32 warps) -> 4 rows per warp.
  SpmmPlan p = plan(16384, 4096, 6710886, 1);
  EXPECT_EQ(p.variant, SpmmVariant::kWideRows);
  EXPECT_EQ(p.reason, SpmmReason::kWideRows);
  EXPECT_EQ(p.rows_per_warp, 4);
  EXPECT_EQ(p.threads, 256);
  EXPECT_EQ(p.grid_x, 4096 / 8);  // 4096 groups of 4 rows, a group per warp: below the 4 x 132 blocks resident
  // Not for the transposed product, 99% sparsity (41 slots per row), 8192 rows (2-row groups) or
  // 16384 inputs (X too large for 4 blocks per SM).
  EXPECT_EQ(plan(16384, 4096, 6710886, 1, 4, SpmmVariant::kAuto, true).variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(plan(16384, 4096, 671089, 1).variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(plan(8192, 8192, 6710886, 1).variant, SpmmVariant::kGlobalX);
  EXPECT_EQ(plan(16384, 16384, 26843546, 1).variant, SpmmVariant::kGlobalX);
  // A batch of 2-4 rows: the whole batch in one tile; 8 fp32 rows (32-byte gathers per slot) and
  // the transposed product: transposed once instead. In 16 bits 8 rows are one 16-byte gather.
  p = plan(16384, 4096, 6710886, 4);
  EXPECT_EQ(p.variant, SpmmVariant::kWideRows);
  EXPECT_EQ(p.batch_tile, 4);
  EXPECT_EQ(p.threads, 1024);
  EXPECT_EQ(plan(16384, 4096, 6710886, 3).batch_tile, 4);
  EXPECT_EQ(plan(16384, 4096, 6710886, 8).variant, SpmmVariant::kGlobalXT);
  EXPECT_EQ(plan(16384, 4096, 6710886, 8, 2).variant, SpmmVariant::kWideRows);
  EXPECT_EQ(plan(4096, 16384, 6710886, 2, 4, SpmmVariant::kAuto, true).variant, SpmmVariant::kGlobalXT);
  // Forced on a batch: the widest tile that fits (a power of two up to 8; 1 for fp64), with as many
  // rows per group as shared memory holds beside it (16384x4096 fp32, tile of 8: X takes 128 KiB,
  // the partial sums of 2 rows per group 68 KiB more, of 227 KiB per block).
  for (const int64_t n : {2, 3, 8, 20}) {
    p = plan(16384, 4096, 6710886, n, 4, SpmmVariant::kWideRows);
    EXPECT_EQ(p.batch_tile, std::min<int64_t>(8, n == 3 ? 4 : n)) << describe(p);
    EXPECT_EQ(p.reason, SpmmReason::kForced);
  }
  EXPECT_EQ(plan(16384, 4096, 6710886, 8, 4, SpmmVariant::kWideRows).rows_per_warp, 2);
  EXPECT_EQ(plan(16384, 4096, 6710886, 8, 8, SpmmVariant::kWideRows).batch_tile, 1);
  EXPECT_EQ(plan(100, 40000, 100000, 8, 4, SpmmVariant::kWideRows).batch_tile, 1);  // 160 KB a row
  // 16-bit values: tiles up to 16 rows, run by 16 warps per SM (one block of 512 threads), with two
  // rows per group beside X's 128 KiB; where the tile of 16 does not fit (11008 inputs), 8.
  for (const int64_t n : {12, 16, 20}) {
    p = plan(16384, 4096, 6710886, n, 2, SpmmVariant::kWideRows);
    EXPECT_EQ(p.batch_tile, 16) << describe(p);
    EXPECT_EQ(p.threads, 512) << describe(p);
    EXPECT_EQ(p.rows_per_warp, 2) << describe(p);
  }
  EXPECT_EQ(plan(16384, 4096, 6710886, 16, 2).variant, SpmmVariant::kWideRows);
  EXPECT_EQ(plan(4096, 11008, 4508877, 16, 2, SpmmVariant::kWideRows).batch_tile, 8);
  // A GPU with less shared memory per SM fits fewer wide_rows blocks: not a full SM, not chosen.
  EXPECT_EQ(plan(16384, 16384, 26843546, 1, 4, SpmmVariant::kAuto, false, DeviceLimits::l40s()).variant,
            SpmmVariant::kGlobalX);
}

TEST(Planner, ForcedVariantsThatCannotRunAreErrors) {
  SpmmPlan p;
  Status s = plan_spmm({4096, 4096, 1000, 4, 4, true, SpmmVariant::kWideRows}, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("forward"), std::string::npos) << s.message();
  EXPECT_EQ(plan_spmm({4096, 4096, 1000, 4, 4, true, SpmmVariant::kCooAtomic}, DeviceLimits::h200(), &p).code(),
            StatusCode::kInvalidArgument);
  s = plan_spmm({10, 80000, 1000, 1, 4, false, SpmmVariant::kWideRows}, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("shared memory"), std::string::npos) << s.message();
  // More batch tiles than grid.y holds (global_x stops at tiles of 32 rows).
  s = plan_spmm({8, 8, 0, 65535LL * 32 + 1, 4, false, SpmmVariant::kGlobalX}, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan(8, 8, 0, 65535LL * 32 + 1).variant, SpmmVariant::kGlobalXT);  // the automatic choice runs it
  EXPECT_EQ(plan_spmm({8, 8, 0, 1, 4, false, SpmmVariant::kAuto}, DeviceLimits{}, &p).code(),
            StatusCode::kInvalidArgument);  // limits never queried
  EXPECT_EQ(plan_spmm({8, 8, 0, 1, 3, false, SpmmVariant::kAuto}, DeviceLimits::h200(), &p).code(),
            StatusCode::kInvalidArgument);
}

// The transposed product over a copy of the CSC view (CscRead), on the H200.
TEST(Planner, CscCopyRules) {
  const DeviceLimits h200 = DeviceLimits::h200();
  const auto dx = [&](int64_t out, int64_t in, int64_t nnz, int64_t n, int bytes, CscRead csc,
                      SpmmVariant v = SpmmVariant::kAuto, bool gemm = true) {
    SpmmProblem q{out, in, nnz, n, bytes, true, v, gemm};
    q.csc = csc;
    SpmmPlan p;
    const Status s = plan_spmm(q, h200, &p);
    EXPECT_TRUE(s.ok()) << s.message();
    return p;
  };
  // dX of 16384x4096 at 90% (W^T: 4096 x 16384): in place below a batch of 256, copied from it.
  EXPECT_FALSE(dx(4096, 16384, 6710886, 128, 2, CscRead::kAuto).csc_copied);
  SpmmPlan p = dx(4096, 16384, 6710886, 8192, 4, CscRead::kAuto);
  EXPECT_TRUE(p.csc_copied);
  EXPECT_EQ(p.variant, SpmmVariant::kSharedX);
  // The copy after the kernel's own workspace (X^T), its rows in uint16, then the values.
  EXPECT_EQ(p.copy_offset, size_t(16385) * 8192 * 4);
  EXPECT_EQ(p.workspace_bytes, p.copy_offset + (size_t(6710886) * 2 + 15) / 16 * 16 + size_t(6710886) * 4);
  EXPECT_NE(describe(p).find("copy of the CSC view"), std::string::npos) << describe(p);
  // The copy is the forward of W^T: its plan is the forward planner's for that shape.
  SpmmPlan f;
  ASSERT_TRUE(plan_spmm({4096, 16384, 6710886, 8192, 4, false, SpmmVariant::kAuto, true}, h200, &f).ok());
  EXPECT_EQ(p.variant, f.variant);
  EXPECT_EQ(p.grid_x, f.grid_x);
  EXPECT_EQ(p.copy_offset, f.workspace_bytes);
  // Below 3% density the copy waits for a batch of 1024 (99%: 4096x4096, N = 256 level in place).
  EXPECT_FALSE(dx(4096, 4096, 167772, 256, 4, CscRead::kAuto).csc_copied);
  EXPECT_TRUE(dx(4096, 4096, 167772, 1024, 4, CscRead::kAuto).csc_copied);
  // Rows past uint16 get int32 indices in the copy.
  p = dx(33, 70001, 9000, 512, 4, CscRead::kCopied);
  EXPECT_EQ(p.workspace_bytes, p.copy_offset + size_t(9000) * 4 + size_t(9000) * 4);
  // Forced either way; in place never copies, a copy forced at N = 1 plans the forward's wide_rows.
  EXPECT_FALSE(dx(4096, 16384, 6710886, 8192, 4, CscRead::kInPlace).csc_copied);
  p = dx(16384, 512, 2200000, 1, 4, CscRead::kCopied);
  EXPECT_TRUE(p.csc_copied);
  EXPECT_EQ(p.variant, SpmmVariant::kWideRows);
  // In 16 bits from a batch of 1024, dense blocks chosen in place stay (they expand the view in
  // place, no copy); in fp32 the forward's model of W^T decides (768x3072, 90%, N = 8192).
  p = dx(3072, 768, 471859, 2048, 2, CscRead::kAuto);
  EXPECT_EQ(p.variant, SpmmVariant::kDenseBlocks);
  EXPECT_FALSE(p.csc_copied);
  p = dx(3072, 768, 235930, 8192, 4, CscRead::kAuto);
  EXPECT_EQ(p.variant, SpmmVariant::kSharedX);
  EXPECT_TRUE(p.csc_copied);
  // Kernels that read the view themselves refuse a forced copy; by name a forward-only kernel stays refused.
  for (SpmmVariant v : {SpmmVariant::kDenseBlocks, SpmmVariant::kWgmma, SpmmVariant::kWideRows}) {
    SpmmProblem q{4096, 4096, 1677722, 512, 2, true, v, true};
    q.csc = CscRead::kCopied;
    EXPECT_EQ(plan_spmm(q, h200, &p).code(), StatusCode::kInvalidArgument) << spmm_variant_name(v);
  }
  // The forward ignores the setting.
  SpmmProblem fwd{4096, 4096, 1677722, 8192, 4, false};
  fwd.csc = CscRead::kCopied;
  ASSERT_TRUE(plan_spmm(fwd, h200, &p).ok());
  EXPECT_FALSE(p.csc_copied);
}

TEST(Planner, TensorCoreRulesAndShape) {
  // Forward: 30% density from N = 64 on every layer, from N = 32 on 2^24 weights; 10% from N = 64 on
  // 2^24 weights and from N = 32 on 2^25; 5% from N = 128 on 2^25; never at 1%. dX: 20% density from
  // N = 128, from N = 64 on 2^24 weights; 10% from N = 256.
  struct Case {
    int64_t out, in;
    double density;
    int64_t n;
    bool transposed, tensor_core;
  };
  for (const Case& c : {Case{3072, 768, 0.3, 64, false, true}, {3072, 768, 0.3, 32, false, false},
                        {4096, 4096, 0.3, 32, false, true}, {4096, 4096, 0.1, 64, false, true},
                        {4096, 4096, 0.1, 32, false, false}, {3072, 768, 0.1, 128, false, false},
                        {16384, 4096, 0.1, 32, false, true}, {16384, 4096, 0.1, 16, false, false},
                        {16384, 4096, 0.05, 128, false, true}, {16384, 4096, 0.05, 64, false, false},
                        {4096, 4096, 0.05, 128, false, false}, {16384, 4096, 0.01, 128, false, false},
                        {16384, 4096, 0.3, 64, true, true}, {16384, 4096, 0.3, 32, true, false},
                        {3072, 768, 0.2, 64, true, false}, {3072, 768, 0.2, 128, true, true},
                        {4096, 16384, 0.1, 256, true, true}, {4096, 16384, 0.1, 128, true, false}}) {
    const SpmmPlan p = plan(c.out, c.in, nnz_for_density(c.out, c.in, c.density), c.n, 2, SpmmVariant::kAuto,
                            c.transposed);
    EXPECT_EQ(p.variant == SpmmVariant::kTensorCore, c.tensor_core)
        << c.out << "x" << c.in << " density " << c.density << " n " << c.n << (c.transposed ? " dX" : "");
  }
  EXPECT_NE(plan(16384, 4096, nnz_for_density(16384, 4096, 0.1), 64).variant, SpmmVariant::kTensorCore);  // fp32

  // One chunk width; batch tiles of 16-128 rows.
  for (const auto& [n, tile] : {std::pair<int64_t, int>{9, 16}, {16, 16}, {33, 64}, {64, 64}, {65, 128}, {1000, 128}}) {
    const SpmmPlan p = plan(4096, 4096, 1677722, n, 2, SpmmVariant::kTensorCore);
    EXPECT_EQ(p.chunk, 64);
    EXPECT_EQ(p.batch_tile, tile) << n;
    EXPECT_EQ(p.smem_bytes, size_t(2) * (64 + 2 * tile) * 72);
  }
  // Clusters split a band's columns until the grid holds two blocks per SM, each block keeping at
  // least one chunk: 48 bands of 3072x768 in clusters of 8 (96 columns each), 256 bands of
  // 16384x4096 in pairs.
  SpmmPlan p = plan(3072, 768, 707789, 64, 2, SpmmVariant::kTensorCore);
  EXPECT_EQ(p.k_splits, 8);
  EXPECT_EQ(p.grid_x, 48 * 8);
  p = plan(3072, 100, 92160, 64, 2, SpmmVariant::kTensorCore);
  EXPECT_EQ(p.k_splits, 1);  // 100 columns: fewer than two chunks
  p = plan(16384, 4096, 6710886, 16, 2, SpmmVariant::kTensorCore);
  EXPECT_EQ(p.k_splits, 2);
}

TEST(Planner, TileViewRulesAndShape) {
  // The tile view's forward (a pattern that holds the view): 17-64 rows at 7.5-12% density; 12-25% on
  // layers of 8192 rows or more or under 2^23 weights; below 7.5% from 33 rows on tall layers and from
  // 17 on small ones; 65-128 rows on small layers and at 7.5-12%. Never without the view or in fp32.
  const auto planned = [](int64_t out, int64_t in, double density, int64_t n, bool view, int value_bytes = 2,
                          bool transposed = false) {
    SpmmProblem problem{out, in, nnz_for_density(out, in, density), n, value_bytes, transposed};
    problem.tile_view = view;
    SpmmPlan p;
    const Status s = plan_spmm(problem, DeviceLimits::h200(), &p);
    EXPECT_TRUE(s.ok()) << s.message();
    return p;
  };
  for (const RuleCase& c : {RuleCase{16384, 4096, 0.1, 32, true}, {16384, 4096, 0.1, 64, true},
                            {16384, 4096, 0.1, 16, false}, {4096, 4096, 0.1, 128, true}, {4096, 4096, 0.1, 129, false},
                            {4096, 4096, 0.2, 32, false}, {16384, 4096, 0.2, 64, true}, {3072, 768, 0.2, 64, true},
                            {4096, 4096, 0.05, 64, false}, {16384, 4096, 0.05, 32, false},
                            {16384, 4096, 0.05, 64, true}, {768, 3072, 0.05, 32, true}, {16384, 4096, 0.2, 128, false},
                            {768, 3072, 0.2, 128, true}, {16384, 4096, 0.3, 64, false}, {768, 3072, 0.5, 128, false}}) {
    EXPECT_EQ(planned(c.out, c.in, c.density, c.n, true).variant == SpmmVariant::kTileView, c.taken) << c;
  }
  EXPECT_NE(planned(16384, 4096, 0.1, 64, false).variant, SpmmVariant::kTileView);        // no view
  EXPECT_NE(planned(16384, 4096, 0.1, 64, true, 4).variant, SpmmVariant::kTileView);      // fp32

  // dX (the transposed product, out = K, in = M): 16-128 rows from 4% density but not 65-128 rows
  // above 40% on 2^26 weights; 2-15 rows from 4% on 2^24 weights, from 7.5% with 2048 outputs; one
  // row from 7.5% on 2^24 weights, wide ones up to 25%.
  for (const RuleCase& c : {RuleCase{4096, 16384, 0.1, 64, true}, {4096, 16384, 0.05, 16, true},
                            {4096, 16384, 0.01, 64, false}, {4096, 16384, 0.5, 128, false},
                            {4096, 16384, 0.5, 64, true}, {4096, 4096, 0.5, 128, true}, {4096, 4096, 0.05, 8, true},
                            {3072, 768, 0.1, 8, true}, {768, 3072, 0.2, 8, false}, {768, 3072, 0.1, 16, true},
                            {3072, 768, 0.05, 8, false}, {4096, 16384, 0.1, 1, true}, {4096, 16384, 0.05, 1, false},
                            {11008, 4096, 0.2, 1, true}, {11008, 4096, 0.5, 1, false}, {4096, 4096, 0.5, 1, true},
                            {3072, 768, 0.1, 1, false}, {4096, 16384, 0.1, 129, false}}) {
    EXPECT_EQ(planned(c.out, c.in, c.density, c.n, true, 2, true).variant == SpmmVariant::kTileView, c.taken)
        << "dX " << c;
  }
  EXPECT_NE(planned(4096, 16384, 0.1, 64, false, 2, true).variant, SpmmVariant::kTileView);  // dX, no view

  // Forced: batch tiles of 16-64 rows, tensor_core's clusters, the block's tile pointers in shared memory.
  SpmmProblem problem{16384, 4096, 6710886, 100, 2, false, SpmmVariant::kTileView};
  problem.tile_view = true;
  SpmmPlan p;
  ASSERT_TRUE(plan_spmm(problem, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.batch_tile, 64);
  EXPECT_EQ(p.k_splits, 1);  // two batch tiles of 256 bands: 3.9 blocks per SM, two waves if split
  EXPECT_EQ(p.smem_bytes, size_t(2) * (3 * 64 + 2 * 64) * 72 + 4 * (64 + 1));
  problem.tile_view = false;
  const Status refused = plan_spmm(problem, DeviceLimits::h200(), &p);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("no tile view"), std::string::npos) << refused.message();

  // dX forced: the tiles read in place (never over a copy of the CSC view), W's 256 bands of rows the
  // reduction, split 6 ways (64 bands of columns: 2.9 blocks per SM), each block's starts, ends and
  // first slots held (43 steps).
  SpmmProblem dx{4096, 16384, 6710886, 64, 2, true, SpmmVariant::kTileView};
  dx.tile_view = true;
  ASSERT_TRUE(plan_spmm(dx, DeviceLimits::h200(), &p).ok());
  EXPECT_FALSE(p.csc_copied);
  EXPECT_EQ(p.k_splits, 6);
  EXPECT_EQ(p.grid_x, 64 * 6);
  EXPECT_EQ(p.smem_bytes, size_t(2) * (3 * 64 + 2 * 64) * 72 + 4 * 3 * 43);
  dx.csc = CscRead::kCopied;
  const Status no_copy = plan_spmm(dx, DeviceLimits::h200(), &p);
  EXPECT_EQ(no_copy.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_copy.message().find("copy of the CSC view"), std::string::npos) << no_copy.message();
}

// The plan of an out x in layer at `density` with the tile view, given `tiles`, on the H200 (or `limits`).
SpmmPlan plan_with_tiles(int64_t out, int64_t in, double density, int64_t n, TileValues tiles,
                         SpmmVariant requested = SpmmVariant::kAuto, int value_bytes = 2, bool transposed = false,
                         const DeviceLimits& limits = DeviceLimits::h200()) {
  SpmmProblem problem{out, in, nnz_for_density(out, in, density), n, value_bytes, transposed, requested};
  problem.tile_view = true;
  problem.packed_tiles = tiles;
  SpmmPlan p;
  const Status s = plan_spmm(problem, limits, &p);
  EXPECT_TRUE(s.ok()) << s.message();
  return p;
}

TEST(Planner, PackedTileValuesWidenTheTileView) {
  // Given packed tile values the forward takes the tile view at 17-128 rows from 4% to 25% density,
  // and at 16 rows from 7.5% on layers of 4096 inputs or more; never in fp32, for dX, or past 25%.
  const auto planned = [](int64_t out, int64_t in, double density, int64_t n, bool packed, int value_bytes = 2,
                          bool transposed = false) {
    return plan_with_tiles(out, in, density, n, packed ? TileValues::kPacked : TileValues::kNone, SpmmVariant::kAuto,
                           value_bytes, transposed);
  };
  for (const RuleCase& c : {RuleCase{4096, 4096, 0.2, 32, true}, {16384, 4096, 0.2, 128, true},
                            {4096, 4096, 0.05, 32, true}, {11008, 4096, 0.1, 16, true}, {4096, 4096, 0.2, 16, true},
                            {16384, 4096, 0.05, 16, false}, {768, 3072, 0.1, 16, false}, {4096, 4096, 0.1, 8, false},
                            {4096, 4096, 0.1, 129, false}, {4096, 4096, 0.3, 64, false},
                            {4096, 4096, 0.03, 64, false}}) {
    EXPECT_EQ(planned(c.out, c.in, c.density, c.n, true).variant == SpmmVariant::kTileView, c.taken) << c;
  }
  // Without them, the same products that the gathering kernel loses keep their kernels.
  EXPECT_NE(planned(4096, 4096, 0.2, 32, false).variant, SpmmVariant::kTileView);
  EXPECT_NE(planned(11008, 4096, 0.1, 16, false).variant, SpmmVariant::kTileView);
  EXPECT_NE(planned(4096, 4096, 0.2, 32, true, 4).variant, SpmmVariant::kTileView);  // fp32
  const SpmmPlan dx = planned(4096, 16384, 0.01, 64, true, 2, true);  // dX: its own rule, which this is outside
  EXPECT_NE(dx.variant, SpmmVariant::kTileView);
  const SpmmPlan packed = planned(16384, 4096, 0.1, 32, true);
  EXPECT_NE(describe(packed).find("values from the packed tile values"), std::string::npos) << describe(packed);
}

TEST(Planner, TileFragmentsRunTheirKernel) {
  // Given tile fragments the forward runs the fragment kernel at 8-128 rows from 4.5% to 50% density
  // on every layer, and at 1-7 rows from 35%; forced, wherever asked. Elsewhere the planner chooses as
  // without them, and a tile view it takes then reads the values. Never for dX or fp32. (A GPU or build
  // without wgmma: the mma.sync kernel at every batch; FragmentsOnHopperRunWgmma below for the rest.)
  DeviceLimits no_wgmma = DeviceLimits::h200();
  no_wgmma.wgmma = false;
  const auto planned = [&](int64_t out, int64_t in, double density, int64_t n,
                           SpmmVariant requested = SpmmVariant::kAuto, int value_bytes = 2, bool transposed = false) {
    return plan_with_tiles(out, in, density, n, TileValues::kFragments, requested, value_bytes, transposed, no_wgmma);
  };
  for (const RuleCase& c : {RuleCase{16384, 4096, 0.1, 16, true}, {16384, 4096, 0.2, 32, true},
                            {4096, 4096, 0.1, 32, true}, {768, 3072, 0.2, 16, true}, {768, 3072, 0.1, 32, true},
                            {16384, 4096, 0.05, 16, true}, {16384, 4096, 0.03, 16, false}, {16384, 4096, 0.2, 64, true},
                            {768, 3072, 0.05, 64, true}, {4096, 4096, 0.1, 128, true}, {16384, 4096, 0.1, 128, true},
                            {16384, 4096, 0.1, 8, true}, {4096, 4096, 0.1, 7, false}, {4096, 4096, 0.1, 129, false},
                            {4096, 4096, 0.3, 32, true}, {16384, 4096, 0.5, 8, true}, {4096, 4096, 0.55, 32, false},
                            {4096, 4096, 0.4, 1, true}, {768, 3072, 0.5, 4, true}, {4096, 4096, 0.3, 1, false},
                            {16384, 4096, 0.2, 1, false}}) {
    const SpmmPlan p = planned(c.out, c.in, c.density, c.n);
    EXPECT_EQ(p.reads_fragments, c.taken) << c;
    if (p.reads_fragments) {
      EXPECT_EQ(p.variant, SpmmVariant::kTileView);
      EXPECT_EQ(p.batch_tile, c.n <= 16 ? 16 : c.n <= 32 ? 32 : 64);
      EXPECT_EQ(p.threads, c.n <= 32 ? 5 * 32 : 9 * 32);  // a producer warp beside 4 or 8 consumers
      EXPECT_NE(describe(p).find("operands loaded from the tile fragments"), std::string::npos) << describe(p);
    } else if (p.variant == SpmmVariant::kTileView) {
      EXPECT_EQ(describe(p).find("tile fragments"), std::string::npos) << describe(p);
    }
  }
  EXPECT_TRUE(planned(16384, 4096, 0.01, 1, SpmmVariant::kTileView).reads_fragments);  // forced
  EXPECT_FALSE(planned(4096, 4096, 0.1, 32, SpmmVariant::kAuto, 4).reads_fragments);  // fp32
  EXPECT_FALSE(planned(4096, 4096, 0.1, 32, SpmmVariant::kTileView, 2, true).reads_fragments);  // dX
  // A stage holds the registers of a tile of the mean density and a quarter more, at most a whole tile.
  const SpmmPlan sparse = planned(16384, 4096, 0.1, 32), dense = planned(4096, 4096, 0.5, 32, SpmmVariant::kTileView);
  EXPECT_LT(sparse.smem_bytes, dense.smem_bytes);
  // Four stages of a chunk of X (32 rows of 64 values), a tile's header (128 words), its registers
  // and two mbarriers, the tiles' places (8 bytes a step, at most 64 steps) and 1024 bytes of alignment.
  const size_t fixed = 4 * (32 * 64 * 2 + 128 * 4 + 16) + 1024;
  EXPECT_GE(sparse.smem_bytes, fixed + 4 * 4 * size_t(1.25 * 0.19 * 2048));
  EXPECT_LE(dense.smem_bytes, fixed + 4 * 4 * 2048 + 8 * 64);
  // At the end the same memory holds a partial tile per k-step (4 x 32 batch rows x 68 floats),
  // more than a sparse layer's stages: its barriers and tiles' places come after them.
  const size_t partials = 4 * 32 * 68 * 4;
  EXPECT_GE(sparse.smem_bytes, partials + 4 * 16 + 1024);
  EXPECT_LE(sparse.smem_bytes, partials + 4 * 16 + 8 * 64 + 1024);
  // Blocks of 64 rows: one per SM and batch tile, at most the two an SM's registers hold.
  EXPECT_EQ(planned(4096, 4096, 0.1, 64).k_splits, 2);    // 128 blocks, not 256 in clusters of four
  EXPECT_EQ(planned(4096, 4096, 0.1, 128).k_splits, 2);   // 256 blocks for two batch tiles
  EXPECT_EQ(planned(16384, 4096, 0.1, 64).k_splits, 1);   // 256 bands already fill the SMs
  EXPECT_EQ(planned(16384, 4096, 0.1, 128).k_splits, 1);  // two batch tiles: past one wave unsplit
}

TEST(Planner, FragmentsOnHopperRunWgmma) {
  // With sm_90a code on a Hopper GPU, from 17 rows the forward over tile fragments runs wgmma's kernel
  // (batch tiles of 32 to 128 rows, a producer warp beside one consumer warpgroup, two at 128 rows where
  // the bands and batch tiles are fewer than the SMs); at 8-16 rows mma.sync's.
  const auto planned = [](int64_t out, int64_t in, double density, int64_t n,
                          SpmmVariant requested = SpmmVariant::kAuto) {
    return plan_with_tiles(out, in, density, n, TileValues::kFragments, requested);
  };
  for (const int64_t n : {8, 16, 17, 32, 64, 100, 128}) {
    const SpmmPlan p = planned(16384, 4096, 0.1, n);
    ASSERT_TRUE(p.reads_fragments) << describe(p);
    if (n <= 16) {
      EXPECT_EQ(p.variant, SpmmVariant::kTileView) << describe(p);
      continue;
    }
    EXPECT_EQ(p.variant, SpmmVariant::kWgmma) << describe(p);
    EXPECT_EQ(p.reason, SpmmReason::kFragmentWgmma);
    EXPECT_EQ(p.batch_tile, n <= 32 ? 32 : n <= 64 ? 64 : 128);
    EXPECT_EQ(p.consumer_warpgroups, 1);  // 256 bands
    EXPECT_EQ(p.threads, 5 * 32);
    EXPECT_EQ(p.workspace_bytes, 0u);  // no tile lists
    EXPECT_NE(describe(p).find("A operands in registers loaded from the tile fragments"), std::string::npos)
        << describe(p);
  }
  // Past 128 rows in batch tiles of 128: to 512 rows on layers of 2^20 weights and more at 4.5-50%
  // density, to 1024 on layers of 2^24 weights and more at 7.5-25%, ahead of dense_blocks.
  for (const RuleCase& c : {RuleCase{16384, 4096, 0.1, 129, true}, {768, 3072, 0.1, 512, true},
                            {768, 3072, 0.05, 256, true}, {768, 3072, 0.1, 513, false}, {768, 3072, 0.2, 1024, false},
                            {4096, 4096, 0.1, 1024, true}, {16384, 4096, 0.2, 1024, true},
                            {4096, 4096, 0.05, 1024, false}, {4096, 4096, 0.1, 1025, false},
                            {16384, 4096, 0.1, 4096, false}, {4096, 4096, 0.3, 256, true},
                            {16384, 4096, 0.5, 512, true}, {4096, 4096, 0.55, 256, false},
                            {16384, 4096, 0.3, 1024, false},
                            {4096, 4096, 0.03, 256, false},
                            {768, 2304, 0.1, 512, true},
                            {512, 1024, 0.1, 256, false}}) {  // under 2^20 weights: not measured
    const SpmmPlan p = planned(c.out, c.in, c.density, c.n);
    EXPECT_EQ(p.variant == SpmmVariant::kWgmma, c.taken) << c << ": " << describe(p);
    if (c.taken) {
      EXPECT_TRUE(p.reads_fragments);
      EXPECT_EQ(p.reason, SpmmReason::kFragmentWgmma);
      EXPECT_EQ(p.batch_tile, 128);
    }
  }
  // Where the caller runs GEMMs: the fragments where dense_blocks would run without them.
  for (const TileValues tiles : {TileValues::kFragments, TileValues::kNone}) {
    SpmmProblem gemm{16384, 4096, nnz_for_density(16384, 4096, 0.1), 1024, 2, false, SpmmVariant::kAuto};
    gemm.tile_view = true;
    gemm.packed_tiles = tiles;
    gemm.gemm = true;
    SpmmPlan p;
    ASSERT_TRUE(plan_spmm(gemm, DeviceLimits::h200(), &p).ok());
    EXPECT_EQ(p.variant, tiles == TileValues::kFragments ? SpmmVariant::kWgmma : SpmmVariant::kDenseBlocks)
        << describe(p);
  }
  // Outside the fragments' range, without them, for dX and where the GPU or build has no wgmma: not.
  EXPECT_NE(planned(16384, 4096, 0.55, 64).variant, SpmmVariant::kWgmma);
  EXPECT_NE(plan_with_tiles(16384, 4096, 0.1, 256, TileValues::kNone).variant, SpmmVariant::kWgmma);
  EXPECT_NE(plan_with_tiles(16384, 4096, 0.1, 64, TileValues::kNone).variant, SpmmVariant::kWgmma);
  EXPECT_NE(plan_with_tiles(16384, 4096, 0.1, 64, TileValues::kFragments, SpmmVariant::kAuto, 2, true).variant,
            SpmmVariant::kWgmma);
  for (const DeviceLimits& limits : {DeviceLimits::a100(), DeviceLimits::l40s()}) {
    const SpmmPlan p = plan_with_tiles(16384, 4096, 0.1, 64, TileValues::kFragments, SpmmVariant::kAuto, 2, false,
                                       limits);
    EXPECT_NE(p.variant, SpmmVariant::kWgmma);
  }
  // Forced, wherever asked on Hopper, in batch tiles of 16 to 128; refused elsewhere.
  EXPECT_EQ(planned(4096, 4096, 0.1, 5, SpmmVariant::kWgmma).batch_tile, 16);
  EXPECT_EQ(planned(4096, 4096, 0.1, 300, SpmmVariant::kWgmma).batch_tile, 128);
  SpmmProblem on_a100{4096, 4096, nnz_for_density(4096, 4096, 0.1), 64, 2, false, SpmmVariant::kWgmma};
  on_a100.tile_view = true;
  on_a100.packed_tiles = TileValues::kFragments;
  SpmmPlan p;
  EXPECT_EQ(plan_spmm(on_a100, DeviceLimits::a100(), &p).code(), StatusCode::kInvalidArgument);
  // Stages as the mma.sync kernel's; at the end a partial tile per warpgroup (128 batch rows x 68
  // floats), not one per k-step.
  const SpmmPlan wide = planned(4096, 4096, 0.1, 128);
  EXPECT_EQ(wide.consumer_warpgroups, 2);  // 64 bands
  EXPECT_EQ(wide.threads, 9 * 32);
  const size_t stages = 4 * (128 * 64 * 2 + 128 * 4 + 16) + 1024;
  EXPECT_GE(wide.smem_bytes, stages + 4 * 4 * size_t(1.25 * 0.19 * 2048));
  EXPECT_LE(wide.smem_bytes, stages + 4 * 4 * 2048 + 8 * 64);
  EXPECT_GE(wide.smem_bytes, size_t(2 * 128 * 68 * 4));
  EXPECT_NE(describe(wide).find("two warpgroups on alternate tiles"), std::string::npos) << describe(wide);
  EXPECT_EQ(planned(4096, 4096, 0.1, 64).consumer_warpgroups, 1);
  EXPECT_EQ(planned(4096, 4096, 0.1, 200).consumer_warpgroups, 2);   // 64 bands x 2 batch tiles: 128 blocks
  EXPECT_EQ(planned(4096, 4096, 0.1, 300).consumer_warpgroups, 1);   // x 3: 192 blocks, more than the SMs
  EXPECT_EQ(planned(768, 3072, 0.1, 128).consumer_warpgroups, 2);
  // Blocks per band: three blocks per SM at batch tiles of 32-64, one at 128.
  EXPECT_EQ(planned(16384, 4096, 0.1, 64).k_splits, 2);
  EXPECT_EQ(planned(4096, 4096, 0.1, 64).k_splits, 6);
  EXPECT_EQ(planned(16384, 4096, 0.1, 128).k_splits, 1);
  EXPECT_EQ(planned(4096, 4096, 0.1, 128).k_splits, 2);
  EXPECT_EQ(planned(11008, 4096, 0.1, 32).k_splits, 2);
  // The count forced either way, and refused past two.
  for (const int groups : {1, 2}) {
    SpmmProblem forced{4096, 4096, nnz_for_density(4096, 4096, 0.1), 20, 2, false, SpmmVariant::kWgmma};
    forced.tile_view = true;
    forced.packed_tiles = TileValues::kFragments;
    forced.fragment_warpgroups = groups;
    SpmmPlan f;
    ASSERT_TRUE(plan_spmm(forced, DeviceLimits::h200(), &f).ok());
    EXPECT_EQ(f.consumer_warpgroups, groups);
    EXPECT_EQ(f.threads, (4 * groups + 1) * 32);
    forced.fragment_warpgroups = 3;
    EXPECT_EQ(plan_spmm(forced, DeviceLimits::h200(), &f).code(), StatusCode::kInvalidArgument);
  }
}

TEST(Planner, FragmentsPackedForOneProductPastTheirRows) {
  // A 16-bit product over the tile view given no values in tile order, whose caller can pack tile
  // fragments: where wgmma's kernel over them pays at 129-512 rows the plan packs them (W^T's for dX)
  // and reads them; elsewhere it plans as without them, and it never packs for 17-128 rows or past
  // 512, for fp32, a forced variant, a GPU without wgmma or a caller that cannot pack.
  const auto planned = [](int64_t out, int64_t in, double density, int64_t n, bool can_pack = true,
                          SpmmVariant requested = SpmmVariant::kAuto, int value_bytes = 2, bool transposed = false,
                          const DeviceLimits& limits = DeviceLimits::h200()) {
    SpmmProblem problem{out, in, nnz_for_density(out, in, density), n, value_bytes, transposed, requested};
    problem.tile_view = true;
    problem.gemm = true;
    problem.can_pack_fragments = can_pack;
    SpmmPlan p;
    const Status s = plan_spmm(problem, limits, &p);
    EXPECT_TRUE(s.ok()) << s.message();
    return p;
  };
  for (const int64_t n : {129, 256, 512}) {
    const SpmmPlan p = planned(768, 3072, 0.1, n);
    EXPECT_TRUE(p.packs_fragments) << describe(p);
    EXPECT_TRUE(p.reads_fragments);
    EXPECT_EQ(p.variant, SpmmVariant::kWgmma);
    EXPECT_EQ(p.problem.packed_tiles, TileValues::kFragments);  // the launch is given them
    EXPECT_NE(describe(p).find("packed for this product, "), std::string::npos) << describe(p);
  }
  for (const int64_t n : {int64_t(513), int64_t(1024)}) {  // past kFragmentPackMaxRows: as without fragments
    const SpmmPlan p = planned(16384, 4096, 0.1, n);
    EXPECT_FALSE(p.packs_fragments) << describe(p);
    EXPECT_FALSE(p.reads_fragments) << describe(p);
  }
  EXPECT_FALSE(planned(768, 3072, 0.1, 1024).packs_fragments);  // the small layer past 512 rows
  EXPECT_FALSE(planned(16384, 4096, 0.1, 2048).packs_fragments);
  for (const int64_t n : {1, 16, 64, 128}) {
    const SpmmPlan p = planned(16384, 4096, 0.1, n);
    EXPECT_FALSE(p.packs_fragments) << describe(p);
    EXPECT_FALSE(p.reads_fragments) << describe(p);
    EXPECT_EQ(describe(p).find("tile fragments"), std::string::npos) << describe(p);
  }
  EXPECT_FALSE(planned(16384, 4096, 0.1, 256, false).packs_fragments);
  EXPECT_FALSE(planned(512, 512, 0.1, 196, true).packs_fragments);  // a MobileNet pointwise layer: too small
  EXPECT_FALSE(planned(16384, 4096, 0.3, 256).packs_fragments);  // denser than the packing's rule
  EXPECT_FALSE(planned(4096, 4096, 0.5, 512).packs_fragments);      // (given them, wgmma would run)
  EXPECT_FALSE(planned(16384, 4096, 0.1, 256, true, SpmmVariant::kTensorCore).packs_fragments);
  EXPECT_FALSE(planned(16384, 4096, 0.1, 256, true, SpmmVariant::kAuto, 4).packs_fragments);
  for (const int64_t n : {129, 256, 512}) {  // dX of a 16384 x 4096 weight: the forward of W^T
    const SpmmPlan p = planned(4096, 16384, 0.1, n, true, SpmmVariant::kAuto, 2, true);
    EXPECT_TRUE(p.packs_fragments) << describe(p);
    EXPECT_TRUE(p.reads_fragments);
    EXPECT_EQ(p.variant, SpmmVariant::kWgmma);
    EXPECT_FALSE(p.csc_copied);
    EXPECT_TRUE(p.problem.transposed);
    EXPECT_EQ(p.problem.packed_tiles, TileValues::kFragments);
    EXPECT_NE(describe(p).find("tile fragments of W^T (packed for this product, "), std::string::npos) << describe(p);
    SpmmProblem forward{4096, 16384, p.problem.nnz, n, 2, false, SpmmVariant::kAuto};
    forward.tile_view = true;
    forward.gemm = true;
    forward.packed_tiles = TileValues::kFragments;
    SpmmPlan f;
    ASSERT_TRUE(plan_spmm(forward, DeviceLimits::h200(), &f).ok());
    EXPECT_EQ(p.grid_x, f.grid_x);  // W^T's forward, launched as planned for it
    EXPECT_EQ(p.batch_tile, f.batch_tile);
    EXPECT_EQ(p.k_splits, f.k_splits);
    EXPECT_EQ(p.smem_bytes, f.smem_bytes);
  }
  for (const int64_t n : {int64_t(128), int64_t(513)})
    EXPECT_FALSE(planned(4096, 16384, 0.1, n, true, SpmmVariant::kAuto, 2, true).packs_fragments);
  EXPECT_FALSE(planned(4096, 16384, 0.1, 256, false, SpmmVariant::kAuto, 2, true).packs_fragments);
  for (const CscRead read : {CscRead::kInPlace, CscRead::kCopied}) {  // a CSC read asked for: dX stays on it
    SpmmProblem dx{4096, 16384, nnz_for_density(4096, 16384, 0.1), 256, 2, true, SpmmVariant::kAuto};
    dx.tile_view = true;
    dx.gemm = true;
    dx.can_pack_fragments = true;
    dx.csc = read;
    SpmmPlan p;
    ASSERT_TRUE(plan_spmm(dx, DeviceLimits::h200(), &p).ok());
    EXPECT_FALSE(p.packs_fragments) << describe(p);
    EXPECT_FALSE(p.reads_fragments) << describe(p);
  }
  // W's rows past the tile view's columns: W^T would have no tile view
  EXPECT_FALSE(planned(4096, 32768, 0.1, 256, true, SpmmVariant::kAuto, 2, true).packs_fragments);
  EXPECT_FALSE(planned(16384, 4096, 0.1, 256, true, SpmmVariant::kAuto, 2, false, DeviceLimits::a100())
                   .packs_fragments);
  // Given fragments, the plan reads them and packs nothing.
  SpmmProblem given{16384, 4096, nnz_for_density(16384, 4096, 0.1), 256, 2, false, SpmmVariant::kAuto};
  given.tile_view = true;
  given.packed_tiles = TileValues::kFragments;
  given.can_pack_fragments = true;
  SpmmPlan p;
  ASSERT_TRUE(plan_spmm(given, DeviceLimits::h200(), &p).ok());
  EXPECT_TRUE(p.reads_fragments);
  EXPECT_FALSE(p.packs_fragments);
}

TEST(Planner, TileViewSplits) {
  // Blocks per band of the tile view's kernel: the count of 1, 2, 4, 6, 8 that puts nearest four
  // blocks on each SM with batch tiles of 16 rows, three with 32-64, in one wave, at least one chunk a
  // block. out x in as the kernel sees them: dX's out is W's columns.
  struct Case {
    int64_t out, in, n;
    bool transposed;
    int splits;
  };
  for (const Case& c : {Case{16384, 4096, 16, false, 2}, {11008, 4096, 16, false, 4}, {4096, 4096, 16, false, 8},
                        {4096, 4096, 32, false, 6}, {4096, 11008, 64, false, 6}, {16384, 4096, 64, false, 2},
                        {16384, 4096, 128, false, 1}, {4096, 4096, 128, false, 4}, {768, 3072, 16, false, 8},
                        {3072, 768, 128, false, 4}, {11008, 4096, 8, true, 4}, {4096, 16384, 1, true, 8},
                        {3072, 128, 32, false, 2}, {3072, 64, 32, false, 1}}) {
    SpmmProblem problem{c.out, c.in, nnz_for_density(c.out, c.in, 0.1), c.n, 2, c.transposed, SpmmVariant::kTileView};
    problem.tile_view = true;
    SpmmPlan p;
    ASSERT_TRUE(plan_spmm(problem, DeviceLimits::h200(), &p).ok());
    EXPECT_EQ(p.k_splits, c.splits) << describe(p);
    EXPECT_EQ(p.grid_x, (c.out + 63) / 64 * c.splits) << describe(p);
    EXPECT_LE(p.smem_bytes, DeviceLimits::h200().smem_per_block) << describe(p);
  }
  // On every GPU's limits: a count of 1, 2, 4, 6 or 8, at most the chunks, the blocks of a split
  // launch in one wave of what shared memory holds.
  for (const DeviceLimits& limits : {DeviceLimits::a100(), DeviceLimits::h100_pcie(), DeviceLimits::l40s()}) {
    for (const int64_t out : {64, 768, 4096, 16384}) {
      for (const int64_t in : {64, 200, 3072, 16384}) {
        for (const int64_t n : {1, 16, 32, 64, 128}) {
          for (const bool transposed : {false, true}) {
            SpmmProblem problem{out, in, nnz_for_density(out, in, 0.1), n, 2, transposed, SpmmVariant::kTileView};
            problem.tile_view = true;
            SpmmPlan p;
            ASSERT_TRUE(plan_spmm(problem, limits, &p).ok()) << out << "x" << in << " n " << n;
            const int64_t chunks = (in + 63) / 64, blocks = (out + 63) / 64 * ((n + p.batch_tile - 1) / p.batch_tile);
            EXPECT_TRUE(p.k_splits == 1 || p.k_splits == 2 || p.k_splits == 4 || p.k_splits == 6 || p.k_splits == 8)
                << describe(p);
            EXPECT_LE(p.k_splits, std::max<int64_t>(1, chunks)) << describe(p);
            EXPECT_LE(p.smem_bytes, limits.smem_per_block) << describe(p);
            if (p.k_splits > 1)
              EXPECT_LE(blocks * p.k_splits,
                        int64_t(limits.sms) * int64_t(limits.smem_per_sm / (p.smem_bytes + limits.reserved_smem_per_block)))
                  << describe(p);
          }
        }
      }
    }
  }
}

TEST(Planner, TileViewSplitsAsked) {
  // A count asked (SpmmProblem / SddmmProblem::tile_view_splits) replaces the planner's where the
  // product runs it, and is refused with the counts that run it where it cannot; other variants
  // ignore it.
  SpmmProblem fwd{4096, 4096, nnz_for_density(4096, 4096, 0.1), 32, 2, false, SpmmVariant::kTileView};
  fwd.tile_view = true;
  SpmmPlan p;
  for (const int splits : {1, 3, 5, 8}) {
    fwd.tile_view_splits = splits;
    ASSERT_TRUE(plan_spmm(fwd, DeviceLimits::h200(), &p).ok());
    EXPECT_EQ(p.k_splits, splits);
    EXPECT_EQ(p.grid_x, 64 * splits);
    EXPECT_EQ(p.smem_bytes, size_t(2) * (3 * 64 + 2 * 32) * 72 + 4 * ((64 + splits - 1) / splits + 1));
  }
  fwd.tile_view_splits = 9;  // more than a cluster holds
  Status s = plan_spmm(fwd, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("1 to 8 run this product"), std::string::npos) << s.message();
  SpmmProblem narrow{4096, 150, nnz_for_density(4096, 150, 0.1), 32, 2, false, SpmmVariant::kTileView, false, false,
                     CscRead::kAuto, true, 4};  // 3 chunks
  s = plan_spmm(narrow, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("1 to 3 run this product"), std::string::npos) << s.message();
  fwd.requested = SpmmVariant::kTensorCore;  // not read
  ASSERT_TRUE(plan_spmm(fwd, DeviceLimits::h200(), &p).ok());
  fwd.tile_view_splits = 0;
  SpmmPlan planner;
  ASSERT_TRUE(plan_spmm(fwd, DeviceLimits::h200(), &planner).ok());
  EXPECT_EQ(p.k_splits, planner.k_splits);

  Status status;
  SddmmProblem dw;
  dw.rows = 4096;
  dw.cols = 4096;
  dw.nnz = nnz_for_density(4096, 4096, 0.1);
  dw.n = 16;
  dw.value_bytes = 2;
  dw.requested = SddmmVariant::kTileView;
  dw.tile_view = true;
  SddmmPlan q;
  for (const int splits : {1, 3, 64}) {
    dw.tile_view_splits = splits;
    ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &q).ok());
    EXPECT_EQ(q.tile_splits, splits);
    EXPECT_EQ(q.grid_x, 64 * splits);
  }
  dw.tile_view_splits = 65;  // more than a band's 64 tiles
  status = plan_sddmm(dw, DeviceLimits::h200(), &q);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("1 to 64 run this product"), std::string::npos) << status.message();
}

// wgmma (forced only): Hopper, 16-bit values, inputs a multiple of 8 and at most 65535; a block of 384
// threads per band of 128 rows and batch tile of 256; clusters that split the chunks while the grid
// still fits one wave and each block keeps 8 chunks; the tile lists in the workspace (4 bytes a slot,
// the bands' offsets, the rows' chunk starts and counts before them).
TEST(Planner, WgmmaPlans) {
  SpmmPlan p;
  for (const int bytes : {4, 8}) {
    const Status s = plan_spmm({4096, 4096, 1677722, 1024, bytes, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("16-bit"), std::string::npos) << s.message();
  }
  Status s = plan_spmm({64, 100, 500, 300, 2, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p);
  EXPECT_NE(s.message().find("multiple of 8"), std::string::npos) << s.message();
  s = plan_spmm({64, 65536, 500, 300, 2, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p);
  EXPECT_NE(s.message().find("65535"), std::string::npos) << s.message();
  s = plan_spmm({64, 0, 0, 300, 2, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  for (const DeviceLimits& other : {DeviceLimits::a100(), DeviceLimits::l40s()}) {
    s = plan_spmm({4096, 4096, 1677722, 1024, 2, false, SpmmVariant::kWgmma}, other, &p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("compute capability 9.0"), std::string::npos) << s.message();
  }

  ASSERT_TRUE(plan_spmm({4096, 4096, 1677722, 1024, 2, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.variant, SpmmVariant::kWgmma);
  EXPECT_EQ(p.reason, SpmmReason::kForced);
  EXPECT_EQ(p.batch_tile, 256);
  EXPECT_EQ(p.threads, 384);
  EXPECT_EQ(p.k_splits, 1);  // 32 bands x 4 tiles: one wave of the 132 SMs, two once split
  EXPECT_EQ(p.grid_x, 32);
  const size_t words = 4 * 1677722, offsets = 4 * 32 * 65, starts = 2 * 4096 * 65, before = 2 * 4096 * 64;
  const auto up16 = [](size_t b) { return (b + 15) / 16 * 16; };
  EXPECT_EQ(p.workspace_bytes, up16(words) + up16(offsets) + up16(starts) + up16(before));
  EXPECT_LE(p.smem_bytes, DeviceLimits::h200().smem_per_block);

  // 768 x 3072 at N = 512: 6 bands x 2 tiles, split in 4 (12 x 4 x 2 <= 132, but 48 chunks < 8 x 8).
  ASSERT_TRUE(plan_spmm({768, 3072, 235930, 512, 2, false, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.k_splits, 4);
  EXPECT_EQ(p.grid_x, 6 * 4);
  ASSERT_TRUE(plan_spmm({3072, 768, 235930, 512, 2, true, SpmmVariant::kWgmma}, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.k_splits, 1);  // 24 bands x 2 tiles leave SMs idle, but 12 chunks are too few to split
}

TEST(Planner, SddmmRules) {
  // Below a batch of 4: one thread per slot, no transposes, no workspace.
  SddmmPlan p = plan_dw(16384, 4096, 6710886, 3);
  EXPECT_EQ(p.variant, SddmmVariant::kSlot);
  EXPECT_EQ(p.workspace_bytes, 0u);
  // 16-bit operands below a batch of 4 on layers of 2^24 weights: the rows kernel from 15% density,
  // with AdamW the vector kernel from 10%; the slot kernel below, on smaller layers and in float32.
  const auto small_batch = [](int64_t rows, int64_t cols, double density, int64_t n, SddmmEpilogue e,
                              int value_bytes) {
    return plan_dw(rows, cols, nnz_for_density(rows, cols, density), n, e, SddmmVariant::kAuto, 0, value_bytes)
        .variant;
  };
  const SddmmEpilogue store = SddmmEpilogue::kStore, adamw_step = SddmmEpilogue::kAdamW;
  EXPECT_EQ(small_batch(16384, 4096, 0.2, 1, store, 2), SddmmVariant::kRows);
  EXPECT_EQ(small_batch(4096, 4096, 0.5, 3, store, 2), SddmmVariant::kRows);
  EXPECT_EQ(small_batch(16384, 4096, 0.1, 1, store, 2), SddmmVariant::kSlot);
  EXPECT_EQ(small_batch(16384, 4096, 0.2, 1, store, 4), SddmmVariant::kSlot);
  EXPECT_EQ(small_batch(2048, 4096, 0.5, 1, store, 2), SddmmVariant::kSlot);
  EXPECT_EQ(small_batch(16384, 4096, 0.1, 1, adamw_step, 2), SddmmVariant::kVector);
  EXPECT_EQ(small_batch(16384, 4096, 0.05, 1, adamw_step, 2), SddmmVariant::kSlot);
  EXPECT_EQ(small_batch(16384, 4096, 0.1, 1, adamw_step, 4), SddmmVariant::kSlot);
  // The rows kernel from 4 to 128, X transposed into [cols, padded batch].
  p = plan_dw(16384, 4096, 6710886, 17);
  EXPECT_EQ(p.variant, SddmmVariant::kRows);
  EXPECT_EQ(p.padded_batch, 20);
  EXPECT_EQ(p.batch_lanes, 8);
  EXPECT_EQ(p.workspace_bytes, size_t(4096 * 20 * 4));
  // With the forward's X^T the rows kernel needs no workspace; a stride it cannot read is refused.
  p = plan_dw(16384, 4096, 6710886, 17, SddmmEpilogue::kStore, SddmmVariant::kAuto, 32);
  EXPECT_TRUE(p.reads_x_t);
  EXPECT_EQ(p.workspace_bytes, 0u);
  SddmmProblem bad;
  bad.rows = 16384;
  bad.cols = 4096;
  bad.nnz = 6710886;
  bad.n = 17;
  bad.x_t_stride = 16;
  SddmmPlan q;
  EXPECT_EQ(plan_sddmm(bad, DeviceLimits::h200(), &q).code(), StatusCode::kInvalidArgument);
  // Past 128 in float32: the staged kernel, dY and X read in place; tiles of 128 rows x 128 columns
  // at 10% density (1638 slots expected of the list's 2048), 32 x 128 tiles fill the GPU without a
  // split of the batch.
  p = plan_dw(16384, 4096, 6710886, 200);
  EXPECT_EQ(p.variant, SddmmVariant::kStaged) << describe(p);
  EXPECT_EQ(p.reason, SddmmReason::kStagedTiles);
  EXPECT_EQ(p.chunk_cols, 128);
  EXPECT_EQ(p.grid_x, 32);
  EXPECT_EQ(p.grid_y, 128);
  EXPECT_EQ(p.batch_splits, 1);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_FALSE(p.transpose_x || p.transpose_dy || p.reads_x_t);
  // Rows of whole 16-byte vectors are copied as such and transposed on chip; a chunk of 256 columns
  // or rows of odd lengths take the 4-byte copies, and less shared memory.
  EXPECT_TRUE(p.staged_vector_copies);
  EXPECT_LE(p.smem_bytes, DeviceLimits::h200().smem_per_block);
  EXPECT_FALSE(plan_dw(4096, 4096, 838861, 1024).staged_vector_copies);
  const SddmmPlan odd = plan_dw(16384, 4098, 6710886, 200);
  EXPECT_EQ(odd.variant, SddmmVariant::kStaged);
  EXPECT_FALSE(odd.staged_vector_copies);
  EXPECT_LT(odd.smem_bytes, p.smem_bytes);
  // The chunk narrows as the density grows (50%: 16 columns), widens to 256 below ~5.5%, and stops
  // at the columns there are.
  EXPECT_EQ(plan_dw(4096, 4096, 8388608, 1024).chunk_cols, 16);
  EXPECT_EQ(plan_dw(4096, 4096, 838861, 1024).chunk_cols, 256);
  EXPECT_EQ(plan_dw(4096, 100, 40960, 1024).chunk_cols, 128);
  // A small layer splits the batch over blocks (each split at least 4 tiles of 64), its sums in a
  // float workspace per split.
  p = plan_dw(768, 3072, 235930, 8192);
  EXPECT_EQ(p.variant, SddmmVariant::kStaged) << describe(p);
  EXPECT_EQ(p.grid_x * p.grid_y, 24 * 6);
  EXPECT_EQ(p.batch_splits, 4);
  EXPECT_EQ(p.split_samples, 2048);
  EXPECT_EQ(p.workspace_bytes, size_t(4) * 235930 * 4);
  // AdamW's update runs in the kernel that reads the sums back, even unsplit.
  p = plan_dw(16384, 4096, 6710886, 200, SddmmEpilogue::kAdamW);
  EXPECT_EQ(p.variant, SddmmVariant::kStaged) << describe(p);
  EXPECT_EQ(p.batch_splits, 1);
  EXPECT_TRUE(p.staged_sums_in_workspace);
  EXPECT_EQ(p.workspace_bytes, size_t(6710886) * 4);
  // 16-bit operands take the tensor-core kernel there, and below 3% density the vector kernel, both
  // operands transposed (so does float32 below 3%); a forced staged kernel on 16-bit operands is an
  // error.
  p = plan_dw(16384, 4096, 6710886, 200, SddmmEpilogue::kStore, SddmmVariant::kAuto, 0, 2);
  EXPECT_EQ(p.variant, SddmmVariant::kTensorCore);
  p = plan_dw(16384, 4096, 1342177, 200, SddmmEpilogue::kStore, SddmmVariant::kAuto, 0, 2);
  EXPECT_EQ(p.variant, SddmmVariant::kVector);
  EXPECT_EQ(p.workspace_bytes, size_t((4096 + 16384) * 200 * 2));
  EXPECT_EQ(plan_dw(16384, 4096, 671088, 200).variant, SddmmVariant::kVector);
  // More bands of 128 rows than a grid holds: the vector kernel.
  EXPECT_EQ(plan_dw(9000000, 64, 57600000, 200).variant, SddmmVariant::kVector);
  SddmmProblem half = bad;
  half.n = 200;
  half.x_t_stride = 0;
  half.value_bytes = 2;
  half.requested = SddmmVariant::kStaged;
  EXPECT_EQ(plan_sddmm(half, DeviceLimits::h200(), &q).code(), StatusCode::kInvalidArgument);
  // AdamW's epilogue at a padded batch of 4 runs in the vector kernel, and with long rows on many
  // rows the rows kernel gives each row a whole warp.
  EXPECT_EQ(plan_dw(16384, 4096, 6710886, 4, SddmmEpilogue::kAdamW).variant, SddmmVariant::kVector);
  EXPECT_EQ(plan_dw(16384, 4096, 6710886, 4).variant, SddmmVariant::kRows);
  p = plan_dw(16384, 4096, 6710886, 16, SddmmEpilogue::kAdamW);
  EXPECT_EQ(p.lanes_per_row, 32 / p.batch_lanes);
  // A forced rows kernel past its batch is an error; nothing to multiply plans the slot kernel's grid.
  bad.x_t_stride = 0;
  bad.n = 200;
  bad.requested = SddmmVariant::kRows;
  EXPECT_EQ(plan_sddmm(bad, DeviceLimits::h200(), &q).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_dw(10, 10, 0, 16).workspace_bytes, 0u);
}

// The tensor-core SDDMM: 16-bit operands only; bands of 128 rows, each block a run of tiles of 128
// columns, as few tiles per block as keep the grid within 4 blocks per SM; no workspace.
TEST(Planner, SddmmTensorCoreGrid) {
  const auto forced = [](int64_t rows, int64_t cols, int64_t nnz, int64_t n, SddmmEpilogue e = SddmmEpilogue::kStore) {
    return plan_dw(rows, cols, nnz, n, e, SddmmVariant::kTensorCore, 0, 2);
  };
  SddmmPlan p = forced(16384, 4096, 6710886, 16);
  EXPECT_EQ(p.variant, SddmmVariant::kTensorCore) << describe(p);
  EXPECT_EQ(p.grid_y, 16384 / 128);
  EXPECT_EQ(p.tiles_per_block, 8);  // 128 bands x 32 tiles over 132 SMs x 4 blocks
  EXPECT_EQ(p.grid_x, 4);
  EXPECT_EQ(p.threads, 256);
  EXPECT_GT(p.smem_bytes, 48u * 1024);  // two stages of 32 batch rows of dY and X, and the tile
  EXPECT_LE(p.smem_bytes, DeviceLimits::h200().smem_per_block);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_FALSE(p.transpose_x || p.transpose_dy || p.reads_x_t);
  p = forced(4096, 4096, 1677722, 128, SddmmEpilogue::kAdamW);
  EXPECT_EQ(p.tiles_per_block, 2);
  EXPECT_EQ(p.grid_x * p.grid_y, 16 * 32);
  // A short last band and tile: 300 rows x 1001 columns, 3 bands x 8 tiles.
  p = forced(300, 1001, 90000, 7);
  EXPECT_EQ(p.grid_y, 3);
  EXPECT_EQ(p.grid_x, 8);
  // The planner's choice for 16-bit operands: from a batch of 64 at >= 7.5% density when the gradient
  // is stored, from 128 at >= 4.5% (the rows kernel below), past 128 from 3% density; with AdamW's
  // step the same, the step then in a pass over the gradient stored in the workspace.
  const auto automatic = [](int64_t nnz, int64_t n, SddmmEpilogue e = SddmmEpilogue::kStore) {
    return plan_dw(16384, 4096, nnz, n, e, SddmmVariant::kAuto, 0, 2);
  };
  EXPECT_EQ(automatic(6710886, 64).variant, SddmmVariant::kTensorCore);
  EXPECT_EQ(automatic(6710886, 64).reason, SddmmReason::kTensorCores);
  EXPECT_EQ(automatic(6710886, 128).variant, SddmmVariant::kTensorCore);
  EXPECT_EQ(automatic(6710886, 32).variant, SddmmVariant::kRows);
  EXPECT_EQ(automatic(3355443, 128).variant, SddmmVariant::kTensorCore);  // 95%
  EXPECT_EQ(automatic(3355443, 64).variant, SddmmVariant::kRows);
  const SddmmPlan adamw = automatic(6710886, 128, SddmmEpilogue::kAdamW);
  EXPECT_EQ(adamw.variant, SddmmVariant::kTensorCore);
  EXPECT_TRUE(adamw.gradient_in_workspace);
  EXPECT_EQ(adamw.workspace_bytes, size_t(6710886) * 2);  // the gradient in bf16 / fp16
  EXPECT_FALSE(automatic(6710886, 128).gradient_in_workspace);
  EXPECT_EQ(automatic(6710886, 128).workspace_bytes, size_t(0));
  EXPECT_EQ(automatic(13421773, 64, SddmmEpilogue::kAdamW).variant, SddmmVariant::kTensorCore);  // 80%
  EXPECT_EQ(automatic(3355443, 64, SddmmEpilogue::kAdamW).variant, SddmmVariant::kRows);          // 95%
  EXPECT_EQ(automatic(3355443, 256, SddmmEpilogue::kAdamW).variant, SddmmVariant::kTensorCore);
  EXPECT_EQ(automatic(671088, 256).variant, SddmmVariant::kVector);  // 99%
  EXPECT_EQ(plan_dw(16384, 4096, 6710886, 256).variant, SddmmVariant::kStaged);  // float32
  // With the caller's GEMM, dense blocks take over only where they beat the tensor-core tiles too
  // (16384x4096, 90%: N = 512 377 us for the tiles against 877 for dense blocks; N = 1024 648 against 401).
  const auto with_gemm = [](int64_t n) {
    return plan_dw(16384, 4096, 6710886, n, SddmmEpilogue::kStore, SddmmVariant::kAuto, 0, 2, true).variant;
  };
  EXPECT_EQ(with_gemm(512), SddmmVariant::kTensorCore);
  EXPECT_EQ(with_gemm(1024), SddmmVariant::kDenseBlocks);
  // Other operand types are refused, with the reason.
  SddmmProblem wide;
  wide.rows = 4096;
  wide.cols = 4096;
  wide.nnz = 1677722;
  wide.n = 16;
  wide.requested = SddmmVariant::kTensorCore;
  SddmmPlan q;
  const Status refused = plan_sddmm(wide, DeviceLimits::h200(), &q);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("16-bit"), std::string::npos) << refused.message();
}

// The tile-view SDDMM on wgmma: what the mma.sync kernel needs, and Hopper with sm_90a code; a
// warpgroup per band of 64 rows, one or two a block (two: the bands of a group share each block, the
// last group short where the bands are odd); the runs that take the fewest tiles' time in waves of
// the blocks an SM holds; three stages of X's chunk, two tiles per warpgroup and its tile pointers,
// with 1024 bytes to align the stages; with AdamW the gradient in the workspace.
// dW of 16-bit operands over a pattern with the tile view, its wgmma kernel asked for.
SddmmProblem tile_view_wgmma_dw(int64_t rows, int64_t cols, int64_t nnz, int64_t n) {
  SddmmProblem dw;
  dw.rows = rows;
  dw.cols = cols;
  dw.nnz = nnz;
  dw.n = n;
  dw.value_bytes = 2;
  dw.requested = SddmmVariant::kTileViewWgmma;
  dw.tile_view = true;
  return dw;
}

TEST(Planner, SddmmTileViewWgmmaBatchChunks) {
  // Past 128 batch rows, forced: the batch in chunks of 128, dY's band kept in each warpgroup's shared
  // memory after its two tiles; two warpgroups a block where they fit (3 chunks), else one (4).
  // The planner takes it there up to 256 rows, and up to 512 on layers under 2^24 weights.
  SddmmProblem dw = tile_view_wgmma_dw(3072, 768, 471859, 300);
  SddmmPlan p;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.threads, 256) << describe(p);
  const auto steps = [&](const SddmmPlan& plan) { return int64_t((12 + plan.tile_splits - 1) / plan.tile_splits); };
  EXPECT_EQ(p.smem_bytes, size_t(1024) + 3 * 128 * 64 * 2 + 2 * ((2 * 64 + 3 * 128) * 72 * 2 + (steps(p) + 2) * 4));
  EXPECT_NE(describe(p).find("the batch in 3 chunks of 128 rows"), std::string::npos) << describe(p);
  dw.n = 512;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.threads, 128) << describe(p);
  EXPECT_EQ(p.smem_bytes, size_t(1024) + 3 * 128 * 64 * 2 + ((2 * 64 + 4 * 128) * 72 * 2 + (steps(p) + 2) * 4));
  EXPECT_LE(p.smem_bytes + 3 * sizeof(uint64_t), DeviceLimits::h200().smem_per_block);
  dw.warpgroups = 2;  // asked for: more than a block holds
  SddmmPlan refused;
  EXPECT_NE(plan_sddmm(dw, DeviceLimits::h200(), &refused).message().find("bytes of shared memory per block"),
            std::string::npos);
  dw.warpgroups = 0;
  dw.n = 128;  // one chunk: dY's band in registers, staged where the tiles go
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(describe(p).find("chunks of"), std::string::npos) << describe(p);
  dw.requested = SddmmVariant::kAuto;
  for (const int64_t n : {129, 256, 300, 512, 513}) {
    dw.n = n;
    ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
    EXPECT_EQ(p.variant == SddmmVariant::kTileViewWgmma, n <= 512) << describe(p);
  }
  SddmmProblem large = dw;  // 4096 x 4096 at 10% density: 2^24 weights
  large.rows = large.cols = 4096;
  large.nnz = 4096 * 410;
  for (const int64_t n : {200, 256, 257, 512}) {
    large.n = n;
    ASSERT_TRUE(plan_sddmm(large, DeviceLimits::h200(), &p).ok());
    EXPECT_EQ(p.variant == SddmmVariant::kTileViewWgmma, n <= 256) << describe(p);
  }
  large.n = 200;
  large.epilogue = SddmmEpilogue::kAdamW;  // not measured with AdamW's step
  ASSERT_TRUE(plan_sddmm(large, DeviceLimits::h200(), &p).ok());
  EXPECT_NE(p.variant, SddmmVariant::kTileViewWgmma) << describe(p);
  large.epilogue = SddmmEpilogue::kStore;
  large.nnz = 4096 * 2048;  // 50% density: not measured
  ASSERT_TRUE(plan_sddmm(large, DeviceLimits::h200(), &p).ok());
  EXPECT_NE(p.variant, SddmmVariant::kTileViewWgmma) << describe(p);
}

TEST(Planner, SddmmTileViewWgmmaGrid) {
  SddmmProblem dw = tile_view_wgmma_dw(16384, 4096, 6710886, 128);
  SddmmPlan p;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.variant, SddmmVariant::kTileViewWgmma) << describe(p);
  EXPECT_EQ(p.threads, 256);  // two warpgroups at a batch padded to 128 rows, unless asked
  dw.warpgroups = 1;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.threads, 128);
  // 256 bands, 3 blocks per SM by shared memory: 4 runs of 16 tiles in 3 waves (54 tiles' time,
  // against 66 unsplit, 68 with 2 runs and 60 with 8).
  EXPECT_EQ(p.tile_splits, 4);
  EXPECT_EQ(p.grid_x, 256 * 4);
  EXPECT_EQ(p.smem_bytes, size_t(1024) + 3 * 128 * 64 * 2 + 1 * (2 * 64 * 72 * 2 + 18 * 4));
  EXPECT_EQ(p.workspace_bytes, 0u);
  dw.n = 64;  // one warpgroup below 128 padded rows
  dw.warpgroups = 0;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.threads, 128);
  dw.n = 128;
  dw.warpgroups = 2;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.threads, 256);
  // 128 groups of two bands, 2 blocks per SM: 2 runs of 32 tiles in one wave (34 tiles' time, against
  // 36 with 4 runs in two).
  EXPECT_EQ(p.tile_splits, 2);
  EXPECT_EQ(p.grid_x, 128 * 2);
  EXPECT_EQ(p.smem_bytes, size_t(1024) + 3 * 128 * 64 * 2 + 2 * (2 * 64 * 72 * 2 + 34 * 4));
  EXPECT_NE(describe(p).find("2 warpgroups a block"), std::string::npos) << describe(p);
  dw.rows = 4160;  // 65 bands: 33 groups, the last of one band
  dw.n = 16;
  dw.tile_view_splits = 2;
  dw.epilogue = SddmmEpilogue::kAdamW;
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  EXPECT_EQ(p.grid_x, 33 * 2);
  EXPECT_EQ(p.smem_bytes, size_t(1024) + 3 * 16 * 64 * 2 + 2 * (2 * 64 * 72 * 2 + 34 * 4));
  EXPECT_TRUE(p.gradient_in_workspace);
  EXPECT_EQ(p.workspace_bytes, size_t(6710886) * 2);

  const auto refusal = [&](SddmmProblem q, const DeviceLimits& limits) {
    SddmmPlan unused;
    const Status s = plan_sddmm(q, limits, &unused);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    return s.message();
  };
  dw.epilogue = SddmmEpilogue::kStore;
  dw.tile_view_splits = 0;
  EXPECT_NE(refusal(dw, DeviceLimits::a100()).find("compute capability 9.0"), std::string::npos);
  DeviceLimits no_sm90a = DeviceLimits::h100_sxm();
  no_sm90a.wgmma = false;
  EXPECT_NE(refusal(dw, no_sm90a).find("sm_90a"), std::string::npos);
  SddmmProblem q = dw;
  q.warpgroups = 3;
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("1 to 2"), std::string::npos);
  // The block's limit holds the kernel's own barriers beside the planned bytes: a limit of exactly
  // the planned bytes is refused, one that also holds the barriers is not.
  ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h200(), &p).ok());
  DeviceLimits tight = DeviceLimits::h200();
  tight.smem_per_block = p.smem_bytes;
  q = dw;
  q.tile_view_splits = p.tile_splits;  // the same plan whatever the limit does to the planner's grid
  EXPECT_NE(refusal(q, tight).find("bytes of shared memory per block"), std::string::npos);
  tight.smem_per_block = p.smem_bytes + 3 * sizeof(uint64_t);  // its three stages' barriers
  EXPECT_TRUE(plan_sddmm(q, tight, &p).ok());
  q = dw;
  q.value_bytes = 4;
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("tile_view_wgmma runs 16-bit"), std::string::npos);
  q = dw;
  q.n = 513;
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("at most 512"), std::string::npos);
  q.requested = SddmmVariant::kTileView;  // the mma.sync kernel: one chunk
  q.n = 129;
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("at most 128"), std::string::npos);
  q = dw;
  q.tile_view = false;
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("no tile view"), std::string::npos);
  q = dw;
  q.tile_view_splits = 66;  // 4096 columns: 64 tiles a band
  EXPECT_NE(refusal(q, DeviceLimits::h100_sxm()).find("1 to 64 run this product"), std::string::npos);
  // The planner's choice where the tile view pays: on Hopper past 32 batch rows (its warpgroups as
  // above), else the mma.sync kernel; never where the build has no sm_90a code or on an A100.
  dw.requested = SddmmVariant::kAuto;
  dw.warpgroups = 0;
  for (const int64_t n : {16, 32, 33, 64, 128}) {
    dw.n = n;
    ASSERT_TRUE(plan_sddmm(dw, DeviceLimits::h100_sxm(), &p).ok());
    EXPECT_EQ(p.variant, n > 32 ? SddmmVariant::kTileViewWgmma : SddmmVariant::kTileView) << n << ": " << describe(p);
    if (n > 32) {
      EXPECT_EQ(p.reason, SddmmReason::kTileViewWgmma);
      EXPECT_EQ(p.threads, n > 64 ? 256 : 128) << n;
    }
    for (const DeviceLimits& other : {no_sm90a, DeviceLimits::a100()}) {
      ASSERT_TRUE(plan_sddmm(dw, other, &p).ok());
      EXPECT_EQ(p.variant, SddmmVariant::kTileView) << n << ": " << describe(p);
    }
  }
}

// The tile-view SDDMM: 16-bit operands, batches of at most 128, a pattern that holds the view; a block
// of 128 threads per run of a band's tiles, the runs halved while they hold more entries than a block
// reads out best or the grid stays under 6 blocks per SM; dY's band, two stages of X's chunk (the
// batch padded to 16, 32, 64 or 128) and the tile in shared memory; with AdamW the gradient in the
// workspace.
TEST(Planner, SddmmTileViewGrid) {
  const auto forced = [](int64_t rows, int64_t cols, int64_t nnz, int64_t n, SddmmEpilogue e = SddmmEpilogue::kStore,
                         int value_bytes = 2, bool view = true, SddmmPlan* out = nullptr) {
    Status s;
    const SddmmPlan plan = plan_dw(rows, cols, nnz, n, e, SddmmVariant::kTileView, 0, value_bytes, false, view, &s);
    if (out) *out = plan;
    return s;
  };
  SddmmPlan p;
  ASSERT_TRUE(forced(16384, 4096, 6710886, 64, SddmmEpilogue::kStore, 2, true, &p).ok());
  EXPECT_EQ(p.variant, SddmmVariant::kTileView) << describe(p);
  // 256 bands of 64 tiles of ~410 entries (10%): past 32 rows, runs of at most 9600 entries: 4 of 16
  // tiles (1024 blocks, past 6 per SM).
  EXPECT_EQ(p.tile_splits, 4);
  EXPECT_EQ(p.grid_x, 256 * 4);
  SddmmPlan shorter;  // up to 32 rows, runs of at most 2400 entries: 16 of 4 tiles
  ASSERT_TRUE(forced(16384, 4096, 6710886, 32, SddmmEpilogue::kStore, 2, true, &shorter).ok());
  EXPECT_EQ(shorter.tile_splits, 16);
  ASSERT_TRUE(forced(16384, 4096, 6710886 / 2, 32, SddmmEpilogue::kStore, 2, true, &shorter).ok());
  EXPECT_EQ(shorter.tile_splits, 8);  // 5%: 8 tiles of ~205 entries
  ASSERT_TRUE(forced(4096, 4096, 1677722, 16, SddmmEpilogue::kStore, 2, true, &shorter).ok());
  EXPECT_EQ(shorter.tile_splits, 16);  // 64 bands; 10%: runs of 4 tiles, 1024 blocks
  ASSERT_TRUE(forced(4096, 4096, 2 * 1677722, 16, SddmmEpilogue::kStore, 2, true, &shorter).ok());
  EXPECT_EQ(shorter.tile_splits, 32);  // 20%: runs of 2 tiles
  ASSERT_TRUE(forced(4096, 4096, 1677722 / 5, 16, SddmmEpilogue::kStore, 2, true, &shorter).ok());
  EXPECT_EQ(shorter.tile_splits, 16);  // 2%: runs of 4 tiles to keep 6 blocks per SM
  EXPECT_EQ(p.threads, 128);
  EXPECT_EQ(p.smem_bytes, size_t(3 * 64 * 72 + 64 * 64) * 2 + 18 * 4);
  EXPECT_EQ(p.workspace_bytes, 0u);
  EXPECT_FALSE(p.transpose_x || p.transpose_dy || p.reads_x_t);
  ASSERT_TRUE(forced(16384, 4096, 6710886, 100, SddmmEpilogue::kAdamW, 2, true, &p).ok());
  EXPECT_EQ(p.smem_bytes, size_t(3 * 128 * 72 + 64 * 64) * 2 + 18 * 4);  // 100 rows padded to 128
  EXPECT_TRUE(p.gradient_in_workspace);
  EXPECT_EQ(p.workspace_bytes, size_t(6710886) * 2);
  ASSERT_TRUE(forced(768, 3072, 235930, 1, SddmmEpilogue::kStore, 2, true, &p).ok());
  EXPECT_EQ(p.tile_splits, 32);  // 12 bands x 48 tiles: runs of 1-2 tiles
  EXPECT_EQ(p.smem_bytes, size_t(3 * 16 * 72 + 64 * 64) * 2 + 4 * 4);
  // The planner's choice (a pattern with the view, 16 bits). Storing the gradient: on layers under 2^23
  // weights from 2 rows and 1% density; on larger ones from 4% past 8 rows, and at 8 rows below 2^25
  // weights (from 7.5% at 2^25 and more). With AdamW, from 4%: past 16 rows from 2^23 weights;
  // below, past 16 rows (from 8 at 10% density) where rows <= columns, else past 32 (16 from 10%).
  // Past 128 rows its wgmma kernel over the batch in chunks, storing the gradient at 4-25% density: to
  // 256 rows, to 512 under 2^24 weights (SddmmTileViewWgmmaBatchChunks). Never without the view or in
  // float32.
  const auto automatic = [](int64_t rows, int64_t cols, double density, int64_t n,
                            SddmmEpilogue e = SddmmEpilogue::kStore, bool view = true, int value_bytes = 2) {
    return plan_dw(rows, cols, nnz_for_density(rows, cols, density), n, e, SddmmVariant::kAuto, 0, value_bytes, false,
                   view)
        .variant;
  };
  const std::vector<RuleCase> store = {
      {16384, 4096, 0.1, 64, true},  {16384, 4096, 0.2, 64, true},  {16384, 4096, 0.05, 16, true},
      {16384, 4096, 0.5, 9, true},   {16384, 4096, 0.1, 8, true},   {16384, 4096, 0.05, 8, false},
      {11008, 4096, 0.075, 8, true}, {11008, 4096, 0.07, 8, false}, {4096, 4096, 0.1, 8, true},
      {4096, 4096, 0.1, 7, false},   {4096, 4096, 0.1, 1, false},   {768, 3072, 0.1, 2, true},
      {768, 3072, 0.1, 1, false},    {768, 3072, 0.01, 64, true},   {768, 3072, 0.005, 64, false},
      {4096, 4096, 0.03, 64, false}, {4096, 4096, 0.04, 64, true},  {4096, 4096, 0.1, 129, true},
      {4096, 4096, 0.1, 257, false}, {4096, 4096, 0.5, 129, false}, {768, 3072, 0.1, 512, true}};
  const std::vector<RuleCase> with_adamw = {
      {16384, 4096, 0.1, 16, false}, {16384, 4096, 0.1, 17, true}, {16384, 4096, 0.03, 64, false},
      {768, 3072, 0.05, 16, false},  {768, 3072, 0.05, 17, true},  {3072, 768, 0.05, 32, false},
      {3072, 768, 0.05, 33, true},   {3072, 768, 0.1, 17, true},   {768, 3072, 0.1, 9, true},
      {768, 3072, 0.1, 8, true},     {768, 3072, 0.1, 7, false},   {768, 3072, 0.09, 8, false},
      {3072, 768, 0.1, 16, false}};
  for (const auto& [epilogue, cases] :
       {std::pair{SddmmEpilogue::kStore, &store}, std::pair{SddmmEpilogue::kAdamW, &with_adamw}}) {
    for (const RuleCase& c : *cases)  // its wgmma kernel past 32 rows on Hopper (SddmmTileViewWgmmaGrid)
      EXPECT_EQ(automatic(c.out, c.in, c.density, c.n, epilogue) ==
                    (c.n > 32 ? SddmmVariant::kTileViewWgmma : SddmmVariant::kTileView),
                c.taken)
          << c
          << (epilogue == SddmmEpilogue::kAdamW ? " with AdamW" : "");
  }
  EXPECT_EQ(automatic(16384, 4096, 0.1, 64, SddmmEpilogue::kStore, false), SddmmVariant::kTensorCore);
  EXPECT_NE(automatic(16384, 4096, 0.1, 64, SddmmEpilogue::kStore, true, 4), SddmmVariant::kTileView);
  EXPECT_NE(automatic(16384, 4096, 0.1, 64, SddmmEpilogue::kStore, true, 4), SddmmVariant::kTileViewWgmma);
  for (const auto& [status, words] :
       {std::pair{forced(4096, 4096, 1677722, 16, SddmmEpilogue::kStore, 4), "16-bit"},
        std::pair{forced(4096, 4096, 1677722, 129), "at most 128"},
        std::pair{forced(4096, 4096, 1677722, 16, SddmmEpilogue::kStore, 2, false), "no tile view"}}) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(words), std::string::npos) << status.message();
  }
}

// dense_blocks: only for a caller with a GEMM, only at large batches, and with a workspace no larger
// than the op's activation operand.
TEST(Planner, DenseBlocksRules) {
  const DeviceLimits h200 = DeviceLimits::h200();
  const auto spmm_with_gemm = [&](int64_t out, int64_t in, int64_t nnz, int64_t n, int bytes, bool transposed,
                                  SpmmVariant v = SpmmVariant::kAuto, bool tf32 = false) {
    return plan(out, in, nnz, n, bytes, v, transposed, h200, true, tf32);
  };
  const auto sddmm_with_gemm = [&](int64_t rows, int64_t cols, int64_t nnz, int64_t n, int bytes,
                                   SddmmEpilogue e = SddmmEpilogue::kStore) {
    return plan_dw(rows, cols, nnz, n, e, SddmmVariant::kAuto, 0, bytes, true);
  };
  // Without a GEMM it is never planned, and forcing it is an error.
  EXPECT_NE(plan(4096, 4096, 1677722, 8192, 2).variant, SpmmVariant::kDenseBlocks);
  SpmmPlan refused;
  EXPECT_EQ(plan_spmm({4096, 4096, 1677722, 8192, 2, false, SpmmVariant::kDenseBlocks}, h200, &refused).code(),
            StatusCode::kInvalidArgument);
  SddmmProblem q;
  q.rows = q.cols = 4096;
  q.nnz = 1677722;
  q.n = 8192;
  q.requested = SddmmVariant::kDenseBlocks;
  SddmmPlan refused_dw;
  EXPECT_EQ(plan_sddmm(q, h200, &refused_dw).code(), StatusCode::kInvalidArgument);
  // A training batch at 90% in bf16: all three products as dense blocks, each block all of W
  // (4096 rows <= N), the workspace the size of W in bf16.
  for (const bool transposed : {false, true}) {
    const SpmmPlan p = spmm_with_gemm(4096, 4096, 1677722, 8192, 2, transposed);
    EXPECT_EQ(p.variant, SpmmVariant::kDenseBlocks) << describe(p);
    EXPECT_EQ(p.reason, SpmmReason::kDenseBlocks);
    EXPECT_EQ(p.block_rows, 4096);
    EXPECT_EQ(p.workspace_bytes, size_t(4096) * 4096 * 2);
  }
  for (const SddmmEpilogue e : {SddmmEpilogue::kStore, SddmmEpilogue::kAdamW}) {
    const SddmmPlan p = sddmm_with_gemm(4096, 4096, 1677722, 8192, 2, e);
    EXPECT_EQ(p.variant, SddmmVariant::kDenseBlocks) << describe(p);
    EXPECT_EQ(p.block_rows, 4096);
  }
  // Small batches stay sparse at any density.
  for (const int64_t n : {1, 8, 16, 64})
    for (const int bytes : {2, 4}) {
      EXPECT_NE(spmm_with_gemm(4096, 4096, 8388608, n, bytes, false).variant, SpmmVariant::kDenseBlocks) << n;
      EXPECT_NE(sddmm_with_gemm(4096, 4096, 8388608, n, bytes).variant, SddmmVariant::kDenseBlocks) << n;
    }
  // Blocks of at most the batch's rows where W has more (a multiple of 64), at least 128 rows when forced.
  SpmmPlan p = spmm_with_gemm(16384, 4096, 6710886, 1000, 2, false, SpmmVariant::kDenseBlocks);
  EXPECT_EQ(p.block_rows, 960);
  EXPECT_LE(p.workspace_bytes, size_t(1000) * 4096 * 2);
  EXPECT_EQ(spmm_with_gemm(16384, 4096, 6710886, 3, 2, false, SpmmVariant::kDenseBlocks).block_rows, 128);
  // Wherever it is chosen, its workspace stays within the activation operand.
  for (const GridPoint& g : benchmark_grid())
    for (const bool transposed : {false, true}) {
      const int64_t out = transposed ? g.k : g.m, in = transposed ? g.m : g.k;
      const SpmmPlan a = spmm_with_gemm(out, in, g.nnz, g.n, g.value_bytes, transposed);
      if (a.variant != SpmmVariant::kDenseBlocks) continue;
      EXPECT_GE(g.n, kDenseBlockMinRows);
      EXPECT_LE(a.workspace_bytes, size_t(g.n) * size_t(in) * size_t(g.value_bytes)) << describe(a);
    }
  // TF32 makes the fp32 GEMM faster: dense blocks wherever they paid in fp32, and more often.
  int fp32 = 0, tf32 = 0;
  for (const GridPoint& g : benchmark_grid()) {
    if (g.value_bytes != 4) continue;
    const bool plain = spmm_with_gemm(g.m, g.k, g.nnz, g.n, 4, false).variant == SpmmVariant::kDenseBlocks;
    const bool rounded =
        spmm_with_gemm(g.m, g.k, g.nnz, g.n, 4, false, SpmmVariant::kAuto, true).variant == SpmmVariant::kDenseBlocks;
    EXPECT_TRUE(rounded || !plain) << g.m << "x" << g.k << " n " << g.n;
    fp32 += plain;
    tf32 += rounded;
  }
  EXPECT_GT(tf32, fp32);
}

TEST(Planner, ChannelsFirstRules) {
  const DeviceLimits h200 = DeviceLimits::h200();
  const auto path = [&](int64_t out, int64_t in, double density, int64_t images, int64_t pixels, int bytes = 4,
                        bool tf32 = true, Activation act = Activation::kNone) {
    const ChannelsFirstProblem p{out, in, int64_t(density * double(out * in)), images, pixels, bytes, tf32, act};
    return plan_channels_first(p, h200);
  };
  // float64 (no measured rates) and empty problems: in place.
  EXPECT_EQ(path(1024, 1024, 0.1, 64, 7 * 7, 8), ChannelsFirstPath::kInPlace);
  EXPECT_EQ(path(1024, 1024, 0.1, 0, 7 * 7), ChannelsFirstPath::kInPlace);
  EXPECT_EQ(path(1024, 1024, 0.0, 64, 7 * 7), ChannelsFirstPath::kInPlace);
  // MobileNetV1's pointwise layers at 90% (bench/results/conv_paths_nvidia_h200.md): one image of
  // width 1 in place; 64 images through cuDNN on the expanded W; the 7 x 7 layers of width 2 at one
  // image as pixel rows (an expansion of 8-16 MiB costs more than the product).
  EXPECT_EQ(path(512, 512, 0.1, 1, 14 * 14), ChannelsFirstPath::kInPlace);
  EXPECT_EQ(path(256, 128, 0.1, 1, 28 * 28, 2), ChannelsFirstPath::kInPlace);
  EXPECT_EQ(path(256, 256, 0.1, 64, 28 * 28), ChannelsFirstPath::kDenseBlocks);
  EXPECT_EQ(path(256, 256, 0.1, 64, 56 * 56, 2), ChannelsFirstPath::kDenseBlocks);
  EXPECT_EQ(path(2048, 2048, 0.1, 64, 7 * 7), ChannelsFirstPath::kDenseBlocks);
  EXPECT_EQ(path(2048, 2048, 0.1, 1, 7 * 7), ChannelsFirstPath::kPixelRows);
  EXPECT_EQ(path(2048, 1024, 0.1, 1, 7 * 7, 2), ChannelsFirstPath::kPixelRows);
  EXPECT_EQ(path(1024, 1024, 0.1, 64, 7 * 7, 2), ChannelsFirstPath::kPixelRows);  // cuDNN slow there in bf16
  // One image of 7 x 7 holds 49 of W's rows: a dense path of many blocks is never taken.
  EXPECT_NE(path(1024, 512, 0.1, 1, 7 * 7), ChannelsFirstPath::kDenseBlocks);
  EXPECT_NE(path(1024, 1024, 0.1, 1, 14 * 14), ChannelsFirstPath::kDenseBlocks);
  // GELU on 16-bit values: the pixel rows apply it to float sums where the dense path would not.
  EXPECT_EQ(path(256, 256, 0.1, 64, 56 * 56, 2, true, Activation::kGELU), ChannelsFirstPath::kPixelRows);
  EXPECT_EQ(path(256, 256, 0.1, 64, 28 * 28, 4, true, Activation::kGELU), ChannelsFirstPath::kDenseBlocks);
  EXPECT_EQ(path(256, 256, 0.1, 64, 56 * 56, 2, true, Activation::kReLU), ChannelsFirstPath::kDenseBlocks);
  // Without TF32 the fp32 convolution is slower, so dense blocks are taken less often.
  int with_tf32 = 0, without = 0;
  for (const int64_t c : {64, 128, 256, 512, 1024, 2048})
    for (const int64_t side : {7, 14, 28, 56})
      for (const int64_t images : {1, 8, 64}) {
        with_tf32 += path(c, c, 0.1, images, side * side) == ChannelsFirstPath::kDenseBlocks;
        without += path(c, c, 0.1, images, side * side, 4, false) == ChannelsFirstPath::kDenseBlocks;
      }
  EXPECT_GT(with_tf32, without);
  // Blocks of dense W: all of it where the images hold as many values, else a multiple of 64 rows
  // (at least 64, at most all) that they hold.
  EXPECT_EQ(channels_first_block_rows({1024, 1024, 104858, 64, 49, 4, false}), 1024);
  EXPECT_EQ(channels_first_block_rows({1024, 1024, 104858, 1, 49, 4, false}), 64);
  EXPECT_EQ(channels_first_block_rows({1024, 1024, 104858, 2, 300, 4, false}), 576);
  EXPECT_EQ(channels_first_block_rows({40, 16, 64, 1, 9, 4, false}), 40);
  EXPECT_EQ(channels_first_block_rows({40, 16, 64, 0, 9, 4, false}), 40);
}

// The fused depthwise-separable kernel's tiles (snack/conv.h) on MobileNetV1's blocks on the H200:
// the widest pixel tile that still gives every SM a block, output channels split over the grid where
// the pixels leave SMs idle, and the shared memory within the device's.
TEST(Planner, SeparableConvTiles) {
  const DeviceLimits h200 = DeviceLimits::h200();
  const auto plan = [&](int64_t batch, int64_t side, int64_t channels, int64_t out, int stride, int bytes) {
    return plan_separable_conv({batch, side, side, channels, out, stride}, bytes, h200);
  };
  // 64 images of 112 x 112 x 32 -> 64: 128-pixel tiles, one group.
  SeparableConvPlan p = plan(64, 112, 32, 64, 1, 4);
  ASSERT_TRUE(p.fits);
  EXPECT_EQ(p.pixels_per_lane, 4);
  EXPECT_EQ(p.tiles_per_image, 98);
  EXPECT_EQ(p.groups, 1);
  EXPECT_GE(p.group_rows, 64);
  // One image of 14 x 14 x 512 (stride 2 from 28 x 28 in MobileNet; here the 14 x 14 block): 32-pixel
  // tiles, the 512 outputs over 8 groups of a chunk each for 56 blocks.
  p = plan(1, 14, 512, 512, 1, 4);
  ASSERT_TRUE(p.fits);
  EXPECT_EQ(p.pixels_per_lane, 1);
  EXPECT_EQ(p.tiles_per_image, 7);
  EXPECT_EQ(p.group_rows, 64);
  EXPECT_EQ(p.groups, 8);
  EXPECT_LE(p.smem_bytes, h200.smem_per_block);
  // Stride 2 halves each side, rounding up: 7 x 7 from 13 x 13.
  p = plan(2, 13, 64, 10, 2, 2);
  ASSERT_TRUE(p.fits);
  EXPECT_EQ(p.tiles_per_image, 2);
  EXPECT_EQ(p.groups, 1);
  // The widest that fits in float32 (1024 channels: 172 KiB) and one that does not (2048); channels that
  // are not whole 16-byte vectors, float64 and stride 3 are refused.
  p = plan(1, 7, 1024, 1024, 1, 4);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.smem_bytes, size_t(1024 * 32 + 9 * 1024 + 32 * 65) * 4);
  EXPECT_FALSE(plan(1, 7, 2048, 2048, 1, 4).fits);
  EXPECT_FALSE(plan(1, 7, 6, 8, 1, 4).fits);
  EXPECT_FALSE(plan(1, 7, 12, 8, 1, 2).fits);
  EXPECT_TRUE(plan(1, 7, 12, 8, 1, 4).fits);
  EXPECT_FALSE(plan(1, 7, 16, 8, 1, 8).fits);
  EXPECT_FALSE(plan(1, 7, 16, 8, 3, 4).fits);
  // NCHW: a thread takes one channel (any count), and the outputs are stored from registers (no staging).
  SeparableConvShape nchw{1, 7, 7, 1024, 1024, 1};
  nchw.channels_last = false;
  p = plan_separable_conv(nchw, 4, h200);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.smem_bytes, size_t(1024 * 32 + 9 * 1024) * 4);
  nchw.channels = 6;
  EXPECT_TRUE(plan_separable_conv(nchw, 4, h200).fits);
}

}  // namespace
}  // namespace snack::test
