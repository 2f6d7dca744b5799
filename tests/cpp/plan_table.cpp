// Prints the plans of the benchmark grid for the H200's limits: the table tests/cpp/data/plans_h200.txt
// that test_planner.cpp compares the planners with.
//   build/ctest/tests/cpp/snack_plan_table > tests/cpp/data/plans_h200.txt
// Regenerate it only with a planner change whose new choices were measured on the H200 (and say so
// in the commit): the table is what the committed benchmark results were measured with.
#include <cstdio>

#include "plan_grid.h"

int main() {
  using namespace snack;
  std::printf("# plans of the benchmark grid on the H200's limits (tests/cpp/plan_table.cpp)\n");
  std::printf("# shape nnz n bytes | forward: variant tile lanes rows_per_warp grid smem workspace prefetch"
              " | dX: the same | dW and dW with AdamW: variant batch_lanes chunks lanes grid workspace chunk_cols splits\n");
  for (const test::GridPoint& g : test::benchmark_grid()) {
    Status status;
    const std::string line = test::plan_grid_point(g, DeviceLimits::h200(), &status);
    if (!status.ok()) {
      std::fprintf(stderr, "%s\n", status.message().c_str());
      return 1;
    }
    std::printf("%s\n", line.c_str());
  }
  return 0;
}
