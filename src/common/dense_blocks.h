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
#include <cmath>
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
  bool tf32 = false;  ///< float32 GEMMs may round to TF32 (ignored for 16-bit values)
  bool tensor_cores = false;  ///< the sparse side of a 16-bit product runs a tensor-core kernel
  bool shared_x = false;      ///< the sparse side of an fp32 product runs the shared_x kernel
  bool staged = false;        ///< the sparse side of an fp32 weight gradient runs the staged SDDMM
};

// Rates measured on the H200 with every path forced (bench/results/spmm_nvidia_h200*_large.md and
// backward_nvidia_h200_large.csv; dX and dW also on 4096x4096 at N = 256-4096). GEMM: cuBLAS through torch.mm on the large shapes, 2 x M x K x N over its time
// (bf16 760-860, fp32 50 TFLOP/s). Sparse: useful TFLOP/s (2 x nnz x N over the time) of the
// planner's kernels from N = 256 at 80-95% sparsity (global_xt forward fp32 4.5-4.9, bf16 6.5-6.9;
// dX 4.0-4.6 / 5.5; dW (vector) 2.9-4.0 / 6.7; the staged dW below), lower at 99% where the sparse
// kernels win anyway;
// the tensor-core forward as the dense work it does (136-141 TFLOP/s); rows of ~40 slots (99%) run
// at about half those rates, and a sparse product pays ~10 us of transposes and launches. Expansion:
// ~1.2 TB/s of the dense block written; the SDDMM's read of the slots out of its block ~2.5 TB/s.
// Each block enqueues an expansion and a cuBLAS call from the host, ~20-35 us per block, and small
// blocks leave the GPU waiting for them (4096x4096, N = 256, 16 blocks: 596 us against 186 us for
// dense in fp32): a product of many blocks takes at least that long.
struct DenseBlocksRates {
  double gemm_16bit = 800.0;
  double gemm_tf32 = 350.0;  // an estimate from the fp32 and bf16 rates, not measured
  double gemm_fp32 = 50.0;
  double sparse_fp32[3] = {4.7, 4.0, 3.0};  // forward, transposed, weight gradient
  double sparse_16bit[3] = {6.5, 5.5, 6.0};
  // The shared_x forward at 20% density (9.5 of the 10.0 measured, so that dense blocks, whose workspace
  // is smaller, keep the ties; 8.5-9.0 at 10%, 7.0 at 5%: its rate goes with the fourth root of the
  // density) and its dX (6.7 at 10%, 4.1 at 5%: about three quarters of the forward's).
  double shared_x_fp32[2] = {9.5, 7.0};
  double shared_x_density = 0.2;
  // The staged SDDMM at 10% density, in useful TFLOP/s: 5.3-5.9 measured from N = 1024 on
  // 4096x4096 and 16384x4096 with its 16-byte copies (3.7-5.1 on 3072x768); 3.9-4.6 at 5%, where its
  // chunks take the 4-byte copies. Other densities: the fourth root, as for shared_x, up to twice
  // this density (its 20% rows were measured with the 4-byte copies only).
  double staged_fp32 = 5.6;
  double staged_density = 0.1;
  // The tensor-core kernels as the dense work they do, 2 x M x K x N over their time: the forward, dX
  // over the CSC view (16384x4096, 70%, N = 128-256: 401-805 us, ~43 TFLOP/s; without it the planner
  // took dense_blocks there, 3160 us against 401), and the SDDMM's tiles (153-190 at 80-95%, N = 512,
  // on 4096x4096 and 16384x4096 in backward_nvidia_h200_bf16.md; 16384x4096, 90%: 375 against 521 us
  // for dense blocks, which the planner took there before the estimate knew the tiles).
  double tensor_core_dense_equivalent[3] = {140.0, 40.0, 150.0};
  double gemm_bandwidth_gbs = 3000.0;           // what a GEMM streams at best
  double expand_bandwidth_gbs = 1200.0;         // the expansion's writes of the block
  double gather_bandwidth_gbs = 2500.0;         // the SDDMM's reads of its block
  double launch_us = 5.0;        // the first block's launches
  double host_block_us = 28.0;   // the host's enqueue of one block
  double sparse_fixed_us = 10.0; // a sparse product's transposes and launches
  double full_row_slots = 128.0; // rows shorter than this run the sparse kernels at sqrt(len / this) of their rate
  int reference_sms = 132;
};
inline constexpr DenseBlocksRates kDenseBlocksRates{};

/// Rows of W per block: the batch (the block then holds no more values than the op's activation
/// operand), at least kDenseBlockMinRows, at most all; a multiple of 64 when it is not all of them.
inline int64_t dense_block_rows(int64_t outputs, int64_t n) {
  const int64_t rows = std::max<int64_t>(n, kDenseBlockMinRows);
  return rows >= outputs ? std::max<int64_t>(outputs, 0) : rows / 64 * 64;
}

/// Estimated microseconds of the product as dense blocks: the GEMMs (bound by their arithmetic or
/// by the bytes they stream) and the expansion (or the SDDMM's read of its blocks), or the host's
/// enqueue of the blocks where that takes longer.
inline double dense_blocks_us(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  const DenseBlocksRates& r = kDenseBlocksRates;
  const double scale = double(limits.sms) / r.reference_sms;
  const double rate = p.value_bytes == 2 ? r.gemm_16bit : (p.tf32 ? r.gemm_tf32 : r.gemm_fp32);
  const double weights = double(p.outputs) * double(p.inputs);
  const double weight_bytes = weights * p.value_bytes;
  const double streamed = weight_bytes + double(p.n) * double(p.outputs + p.inputs) * p.value_bytes;
  const double gemm = std::max(2.0 * weights * double(p.n) / (rate * scale * 1e6),
                               streamed / (r.gemm_bandwidth_gbs * scale * 1e3));
  const double side = weight_bytes / ((p.op == DenseBlocksOp::kWeightGrad ? r.gather_bandwidth_gbs
                                                                            : r.expand_bandwidth_gbs) * scale * 1e3);
  const int64_t rows = std::max<int64_t>(1, dense_block_rows(p.outputs, p.n));
  const double blocks = double((p.outputs + rows - 1) / rows);
  return std::max(gemm + side, blocks * r.host_block_us) + r.launch_us;
}

/// Estimated microseconds of the product in the sparse kernels the planner would take instead: the
/// CUDA-core kernels, or for 16-bit values the tensor-core kernel where the planner takes it.
inline double sparse_us(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  const DenseBlocksRates& r = kDenseBlocksRates;
  const double scale = double(limits.sms) / r.reference_sms;
  const int op = int(p.op);
  const double useful = 2.0 * double(p.nnz) * double(p.n);
  const double row = double(p.nnz) / double(std::max<int64_t>(1, p.outputs));
  const double short_rows = std::sqrt(std::min(1.0, row / r.full_row_slots));
  const double density = double(p.nnz) / std::max(1.0, double(p.outputs) * double(p.inputs));
  // shared_x and the staged SDDMM: the rate measured at one density, scaled by the fourth root of the
  // density against it (up to `cap` times it).
  const auto at_density = [&](double measured, double measured_density, double cap) {
    return measured * std::pow(std::min(cap, density / measured_density), 0.25);
  };
  double rate;
  if (p.value_bytes == 2)
    rate = r.sparse_16bit[op] * short_rows;
  else if (p.staged && p.op == DenseBlocksOp::kWeightGrad)  // its tiles' slots split evenly whatever the rows
    rate = at_density(r.staged_fp32, r.staged_density, 2.0);
  else
    rate = (p.shared_x && op < 2 ? at_density(r.shared_x_fp32[op], r.shared_x_density, 1.0) : r.sparse_fp32[op]) *
           short_rows;
  double us = r.sparse_fixed_us + useful / (std::max(rate, 1e-3) * scale * 1e6);
  if (p.value_bytes == 2 && p.tensor_cores) {
    const double tiles = 2.0 * double(p.outputs) * double(p.inputs) * double(p.n);
    us = std::min(us, r.sparse_fixed_us + tiles / (r.tensor_core_dense_equivalent[op] * scale * 1e6));
  }
  return us;
}

/// Whether dense blocks beat the sparse kernels: 16- or 32-bit values (float64 keeps the sparse
/// kernels: its rates were not measured), a batch of at least kDenseBlockMinRows and a shorter
/// estimated time.
inline bool dense_blocks_pay(const DenseBlocksProblem& p, const DeviceLimits& limits) {
  if (p.value_bytes == 8 || p.n < kDenseBlockMinRows || p.outputs <= 0 || p.inputs <= 0) return false;
  return dense_blocks_us(p, limits) < sparse_us(p, limits);
}

}  // namespace snack::detail
