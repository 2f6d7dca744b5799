// When a product runs faster as dense GEMMs over expanded blocks of W (kDenseBlocks) than in the
// sparse kernels, and how large a block is. Shared by the SpMM and SDDMM planners (host code).
//
// At a large batch an unstructured sparse kernel is bound by its arithmetic, not by the bytes of W:
// a CUDA-core kernel pays about one on-chip load of an operand per multiply-add, and the tensor-core
// kernel expands every tile of W whether or not it holds slots. A dense GEMM does 1/density times
// the useful work at a far higher rate, and the expansion costs one write of the dense block. So
// the choice is a comparison of two times, each from a rate measured on the H200 (132 SMs) and
// scaled by the device's SM count; docs/kernels.md ("Large batches") gives the measurements.
#pragma once

#include <algorithm>
#include <cstdint>

#include "snack/device_limits.h"
#include "snack/spmm.h"

namespace snack::detail {

/// Which product a dense-blocks estimate is for.
enum class DenseBlocksOp { kForward, kTransposed, kWeightGrad };

/// The product to estimate: W is `outputs x inputs` as the product sees it (the transposed product's
/// W^T, the SDDMM's W), with `nnz` slots and a batch of `n` rows of `value_bytes`-byte values.
struct DenseBlocksProblem {
  DenseBlocksOp op = DenseBlocksOp::kForward;
  int64_t outputs = 0;
  int64_t inputs = 0;
  int64_t nnz = 0;
  int64_t n = 0;
  int value_bytes = 4;
  bool tf32 = false;
};

// Rates on the H200 (TFLOP/s; the sparse ones count useful work, 2 x nnz x N). GEMM: cuBLAS through
// torch.mm at the benchmark's large shapes; sparse: the planner's kernels at N >= 256.
struct DenseBlocksRates {
  double gemm_16bit = 560.0;
  double gemm_tf32 = 280.0;
  double gemm_fp32 = 48.0;
  double gemm_fp64 = 48.0;
  double sparse_fp32[3] = {5.0, 3.5, 4.0};       // forward, transposed, weight gradient
  double sparse_16bit[3] = {6.0, 4.0, 5.0};
  double tensor_core_dense_equivalent = 110.0;  // the tensor-core forward, 2 x M x K x N over its time
  double bandwidth_gbs = 3000.0;
  double block_overhead_us = 6.0;               // launches of one block: expansion, GEMM, gather
  int reference_sms = 132;
};
inline constexpr DenseBlocksRates kDenseBlocksRates{};

/// Rows of W per block: the batch (the block then holds no more values than the op's activation
/// operand), at least kDenseBlockMinRows, at most all; a multiple of 64 when it is not all of them.
inline int64_t dense_block_rows(int64_t outputs, int64_t n) {
  const int64_t rows = std::max<int64_t>(n, kDenseBlockMinRows);
  return rows >= outputs ? std::max<int64_t>(outputs, 0) : rows / 64 * 64;
}

/// Estimated microseconds of the product as dense blocks, and in the best sparse kernel.
inline double dense_blocks_us(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  const DenseBlocksRates& r = kDenseBlocksRates;
  const double scale = double(limits.sms) / r.reference_sms;
  const double rate = p.value_bytes == 2 ? r.gemm_16bit
                      : p.value_bytes == 8 ? r.gemm_fp64
                                           : (p.tf32 ? r.gemm_tf32 : r.gemm_fp32);
  const double weights = double(p.outputs) * double(p.inputs);
  const double flops_us = 2.0 * weights * double(p.n) / (rate * scale * 1e6);
  const double activations = double(p.n) * double(p.outputs + p.inputs);
  // The block passes memory twice (written by the expansion and read by the GEMM; for the SDDMM
  // written by the GEMM and read by the gather); the activations are read and written once.
  const double bytes = (2.0 * weights + activations) * p.value_bytes;
  const double blocks = double((p.outputs + dense_block_rows(p.outputs, p.n) - 1) /
                               std::max<int64_t>(1, dense_block_rows(p.outputs, p.n)));
  return flops_us + bytes / (r.bandwidth_gbs * scale * 1e3) + blocks * r.block_overhead_us;
}

inline double sparse_us(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  const DenseBlocksRates& r = kDenseBlocksRates;
  const double scale = double(limits.sms) / r.reference_sms;
  const int op = int(p.op);
  const double useful = 2.0 * double(p.nnz) * double(p.n);
  double us = useful / ((p.value_bytes == 2 ? r.sparse_16bit[op] : r.sparse_fp32[op]) * scale * 1e6);
  if (p.value_bytes == 2 && p.op == DenseBlocksOp::kForward) {
    const double tiles = 2.0 * double(p.outputs) * double(p.inputs) * double(p.n);
    us = std::min(us, tiles / (r.tensor_core_dense_equivalent * scale * 1e6));
  }
  return us;
}

/// Whether dense blocks beat the sparse kernels: a batch of at least kDenseBlockMinRows and a
/// shorter estimated time.
inline bool dense_blocks_pay(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  if (p.n < kDenseBlockMinRows || p.outputs <= 0 || p.inputs <= 0) return false;
  return dense_blocks_us(p, limits) < sparse_us(p, limits);
}

}  // namespace snack::detail
