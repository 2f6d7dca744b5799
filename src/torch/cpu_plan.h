// How a CPU product runs: the sparse loops (src/cpu/) or dense blocks. Shared by the CPU operators
// (ops_cpu.cpp) and explain (plans.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "op_args.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"

namespace snack::binding {

// Dense blocks on the CPU: at a high density and a large batch ATen's GEMM (vendor BLAS, many FLOPs
// per byte) beats the sparse loops (one tile row read per multiply-add). W is then expanded a block
// of rows at a time (cpu_blocks: never more than max(N, 2^20 / K) rows of it at once) into a
// dense block that ATen multiplies; no dense copy of the whole layer is kept. The products are then
// ATen's: its 16-bit GEMMs round each output once but may flush subnormals, which the loops keep,
// and a BLAS may sum in another order on another number of threads, which the loops never do.
// dX runs over blocks of W's columns instead, each block of dX one GEMM over all of W's rows.
enum class CpuProduct { kForward, kTransposed, kWeightGrad };
constexpr int64_t kCpuDenseBlockMinBatch = 64;         // below it the sparse loops always win
constexpr int64_t kCpuDenseBlockMinValues = 1 << 20;   // per block at least: smaller GEMMs run slowly
constexpr int64_t kCpuDenseBlockMinWeights = 1 << 16;  // smaller layers: the loops' time is the calls'

inline bool is_16_bit(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The densities from which the dense blocks are faster, per product, value type and batch: measured
// on 768x3072, 3072x768 and 4096x4096 at N = 128 and 512 with both paths forced
// (bench/results/spmm_cpu.md has the planner's choice beside dense). The loops gain on the GEMM as
// the batch shrinks, so the forward and dX cross later below N = 256. ATen's 16-bit GEMMs on the
// CPU ran at about twice float32's rate, so they pay from lower densities (16-bit dX over blocks of
// W's columns: blocks faster in all six rows at 30% density, N = 128 and 512; loops as fast or faster
// at 10% and N = 128, level at N = 512). A CPU with other GEMM rates moves the crossings, which
// `variant=` lets a user force either way.
inline double cpu_dense_block_density(CpuProduct product, at::ScalarType t, int64_t n) {
  const bool half = is_16_bit(t), small = n < 256;
  switch (product) {
    case CpuProduct::kForward: return half ? 0.3 : small ? 0.6 : 0.5;
    case CpuProduct::kTransposed: return half ? 0.3 : small ? 0.4 : 0.3;
    default: return half ? 0.2 : 0.4;
  }
}

// How a variant name runs on the CPU: "auto" lets cpu_dense_blocks choose, "dense_blocks" forces
// the dense blocks, every other name the sparse loops.
enum class CpuPath { kChoose, kLoops, kDenseBlocks };
inline CpuPath cpu_path(SpmmVariant v) {
  return v == SpmmVariant::kAuto ? CpuPath::kChoose
                                 : v == SpmmVariant::kDenseBlocks ? CpuPath::kDenseBlocks : CpuPath::kLoops;
}
inline CpuPath cpu_path(SddmmVariant v) {
  return v == SddmmVariant::kAuto ? CpuPath::kChoose
                                  : v == SddmmVariant::kDenseBlocks ? CpuPath::kDenseBlocks : CpuPath::kLoops;
}

// Whether the product runs on dense blocks.
inline bool cpu_dense_blocks(const PatternArg& p, int64_t n, at::ScalarType t, CpuProduct product, CpuPath path,
                             Activation act = Activation::kNone) {
  if (path != CpuPath::kChoose) return path == CpuPath::kDenseBlocks;
  if (n < kCpuDenseBlockMinBatch || p.rows * p.cols < kCpuDenseBlockMinWeights) return false;
  // The forward with GELU on 16-bit values would run its blocks in float, at float's GEMM rate.
  if (act == Activation::kGELU && is_16_bit(t)) return false;
  return double(p.nnz) >= cpu_dense_block_density(product, t, n) * double(p.rows) * double(p.cols);
}

// How a product's dense blocks cut W: blocks of its columns for dX (each block of dX one GEMM over all
// of W's rows), of its rows for the forward and dW.
struct CpuBlocks {
  bool columns;       // blocks of W's columns
  int64_t lines;      // W's columns (columns) or rows, all the blocks together
  int64_t width;      // values per line: W's rows (columns) or columns
  int64_t per_block;  // lines per block: as many as the batch's rows, or enough for
                      // kCpuDenseBlockMinValues values, whichever is more, and at most all of them
};
inline CpuBlocks cpu_blocks(const PatternArg& p, int64_t n, CpuProduct product) {
  const bool columns = product == CpuProduct::kTransposed;
  const int64_t lines = columns ? p.cols : p.rows, width = columns ? p.rows : p.cols;
  const int64_t at_least = (kCpuDenseBlockMinValues + std::max<int64_t>(width, 1) - 1) / std::max<int64_t>(width, 1);
  return {columns, lines, width, std::max<int64_t>(1, std::min<int64_t>(lines, std::max<int64_t>(n, at_least)))};
}

}  // namespace snack::binding
