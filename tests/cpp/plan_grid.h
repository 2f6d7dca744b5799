// The problems of the benchmark grid (bench/spmm.py, bench/layer.py) as the planners see them, and
// one line of text per plan: shared by the planner test and the tool that writes its table
// (plan_table.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "snack/conv.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"

namespace snack::test {

struct GridPoint {
  int64_t m, k, nnz, n;
  int value_bytes;
};

// Shapes, batches and sparsities of the benchmarks, in fp32 and 16-bit values.
inline std::vector<GridPoint> benchmark_grid() {
  const int64_t shapes[][2] = {{768, 3072},  {3072, 768},  {768, 2304},   {4096, 4096},
                               {5000, 5000}, {16384, 4096}, {4096, 11008}, {11008, 4096}};
  const int64_t batches[] = {1, 2, 4, 8, 16, 32, 128, 512, 1024, 8192, 16384};
  const double sparsities[] = {0.5, 0.8, 0.9, 0.95, 0.99};
  std::vector<GridPoint> grid;
  for (const auto& shape : shapes)
    for (double sparsity : sparsities)
      for (int64_t n : batches)
        for (int value_bytes : {2, 4})
          grid.push_back({shape[0], shape[1], nnz_for_density(shape[0], shape[1], 1.0 - sparsity), n, value_bytes});
  return grid;
}

inline std::string plan_line(const GridPoint& g, const SpmmPlan& fwd, const SpmmPlan& dx, const SddmmPlan& dw,
                             const SddmmPlan& dw_adamw) {
  const auto spmm = [](const SpmmPlan& p) {
    return std::string(spmm_variant_name(p.variant)) + " " + std::to_string(p.batch_tile) + " " +
           std::to_string(p.lanes_per_row) + " " + std::to_string(p.rows_per_warp) + " " +
           std::to_string(p.grid_x) + " " + std::to_string(p.smem_bytes) + " " + std::to_string(p.workspace_bytes) +
           " " + (p.prefetch_l2 ? "1" : "0") + (p.csc_copied ? " copied" : "");
  };
  const auto sddmm = [](const SddmmPlan& p) {
    return std::string(sddmm_variant_name(p.variant)) + " " + std::to_string(p.batch_lanes) + " " +
           std::to_string(p.batch_chunks) + " " + std::to_string(p.lanes_per_row) + " " + std::to_string(p.grid_x) +
           " " + std::to_string(p.workspace_bytes) + " " + std::to_string(p.chunk_cols) + " " +
           std::to_string(p.batch_splits);
  };
  return std::to_string(g.m) + "x" + std::to_string(g.k) + " nnz " + std::to_string(g.nnz) + " n " +
         std::to_string(g.n) + " bytes " + std::to_string(g.value_bytes) + " | " + spmm(fwd) + " | " + spmm(dx) +
         " | " + sddmm(dw) + " | " + sddmm(dw_adamw);
}

// The weight gradient's problem at a grid point, as the torch front end plans it (its GEMM there
// for dense_blocks, TF32 off).
inline SddmmProblem sddmm_problem_at(const GridPoint& g, SddmmEpilogue epilogue) {
  SddmmProblem s;
  s.rows = g.m;
  s.cols = g.k;
  s.nnz = g.nnz;
  s.n = g.n;
  s.value_bytes = g.value_bytes;
  s.epilogue = epilogue;
  s.gemm = true;
  return s;
}

// The four plans of a layer's step at one grid point (forward, dX, dW, dW with AdamW), as the torch
// front end plans them.
inline std::string plan_grid_point(const GridPoint& g, const DeviceLimits& limits, Status* status) {
  SpmmPlan fwd, dx;
  SddmmPlan dw, dw_adamw;
  SpmmProblem p{g.m, g.k, g.nnz, g.n, g.value_bytes, false, SpmmVariant::kAuto, true};
  *status = plan_spmm(p, limits, &fwd);
  if (!status->ok()) return "";
  p = SpmmProblem{g.k, g.m, g.nnz, g.n, g.value_bytes, true, SpmmVariant::kAuto, true};
  *status = plan_spmm(p, limits, &dx);
  if (!status->ok()) return "";
  *status = plan_sddmm(sddmm_problem_at(g, SddmmEpilogue::kStore), limits, &dw);
  if (!status->ok()) return "";
  *status = plan_sddmm(sddmm_problem_at(g, SddmmEpilogue::kAdamW), limits, &dw_adamw);
  if (!status->ok()) return "";
  return plan_line(g, fwd, dx, dw, dw_adamw);
}

}  // namespace snack::test
