// Plans, kernel names and the shared counting rules, and the operators that report them
// (explain, kernel_variants, pattern_fields, index_bits, dense_block_min_rows, tile_view_geometry, tile_fragment_words,
// channels_first_paths, nnz_for_density, set_default_spmm_variant, set_default_csc_read,
// set_default_tile_view_splits):
// they read metadata only, so they run for any device and under tracing.
#include "plans.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cpu_plan.h"
#include "op_args.h"
#include "snack/batch_tiles.h"

namespace snack::binding {

DeviceLimits cuda_device_limits(int device) {
#ifdef SNACK_WITH_CUDA
  DeviceLimits limits;
  throw_if_error(cuda::device_limits(device, &limits), "device_limits");
  return limits;
#else
  (void)device;
  TORCH_CHECK_NOT_IMPLEMENTED(false, "snack was built without CUDA: no CUDA plans");
#endif
}

namespace {

// A small thread-safe cache of plans per (device, problem); bounded, cleared when full.
template <typename Problem, typename Plan>
class PlanCache {
 public:
  template <typename PlanFn>
  Plan get(const Problem& problem, int device, PlanFn&& plan_fn) {
    const Key key{problem, device};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    const Plan plan = plan_fn();  // raises for a problem the planner refuses: nothing cached
    std::lock_guard<std::mutex> lock(mutex_);
    if (plans_.size() >= kCapacity) plans_.clear();
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  static constexpr size_t kCapacity = 4096;
  struct Key {
    Problem problem;
    int device;
    bool operator==(const Key& o) const { return device == o.device && problem == o.problem; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      // Every field of the problem, as raw bytes of its integers, mixed FNV-style.
      uint64_t h = 1469598103934665603ull ^ uint64_t(k.device);
      const auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
      for_each_field(k.problem, mix);
      return size_t(h);
    }
  };
  template <typename Mix>
  static void for_each_field(const SpmmProblem& p, Mix&& mix) {
    mix(uint64_t(p.out_dim));
    mix(uint64_t(p.in_dim));
    mix(uint64_t(p.nnz));
    mix(uint64_t(p.n));
    mix(uint64_t(p.value_bytes) << 8 | uint64_t(p.transposed) << 4 | uint64_t(p.requested));
    mix(uint64_t(p.gemm) << 1 | uint64_t(p.tf32));
    mix(uint64_t(p.can_pack_fragments) << 5 | uint64_t(p.csc) << 3 | uint64_t(p.tile_view) << 2 |
        uint64_t(p.packed_tiles));
    mix(uint64_t(p.tile_view_splits) << 8 | uint64_t(p.fragment_warpgroups));
  }
  template <typename Mix>
  static void for_each_field(const SddmmProblem& p, Mix&& mix) {
    mix(uint64_t(p.rows));
    mix(uint64_t(p.cols));
    mix(uint64_t(p.nnz));
    mix(uint64_t(p.n));
    mix(uint64_t(p.x_t_stride));
    mix(uint64_t(p.value_bytes) << 8 | uint64_t(p.epilogue) << 4 | uint64_t(p.requested));
    mix(uint64_t(p.gemm) << 2 | uint64_t(p.tf32) << 1 | uint64_t(p.tile_view));
    mix(uint64_t(p.tile_view_splits) << 8 | uint64_t(p.warpgroups));
  }
  std::mutex mutex_;
  std::unordered_map<Key, Plan, Hash> plans_;
};

PlanCache<SpmmProblem, SpmmPlan>& spmm_cache() {
  static PlanCache<SpmmProblem, SpmmPlan> cache;
  return cache;
}
PlanCache<SddmmProblem, SddmmPlan>& sddmm_cache() {
  static PlanCache<SddmmProblem, SddmmPlan> cache;
  return cache;
}

}  // namespace

bool tf32_matmuls() { return at::globalContext().allowTF32CuBLAS(); }

SpmmPlan spmm_plan(const SpmmProblem& problem, int device, const char* op) {
  return spmm_cache().get(problem, device, [&] {
    SpmmPlan plan;
    throw_if_error(plan_spmm(problem, cuda_device_limits(device), &plan), op);
    return plan;
  });
}

SddmmPlan sddmm_plan(const SddmmProblem& problem, int device, const char* op) {
  return sddmm_cache().get(problem, device, [&] {
    SddmmPlan plan;
    throw_if_error(plan_sddmm(problem, cuda_device_limits(device), &plan), op);
    return plan;
  });
}

namespace {

using ExplainResult = std::tuple<std::string, std::string, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, bool, std::string>;

// A 1x1 convolution on NCHW images of n pixels in all (images x pixels per image).
ExplainResult explain_channels_first(const at::Tensor& values, const PatternArg& p, int64_t n, int64_t pixels,
                                     c10::string_view variant, Activation act) {
  const ChannelsFirstPath forced = channels_first_path_arg(variant, "explain");
  const char* reason = forced != ChannelsFirstPath::kAuto ? "forced" : values.is_cuda() ? "planner" : "cpu_rule";
  if (!values.is_cuda())
    return {"in_place", reason, 1, 1, 1, 1, 1, 0, 0, false,
            "in_place (cpu): each output channel's slots summed over blocks of 16 pixels of the images"};
  const ChannelsFirstProblem problem{p.rows, p.cols, p.nnz, n / pixels, pixels, int(values.element_size()),
                                    at::globalContext().allowTF32CuDNN(), act};
  const ChannelsFirstPath path = forced != ChannelsFirstPath::kAuto
                                     ? forced
                                     : plan_channels_first(problem, cuda_device_limits(values.device().index()));
  const int64_t bytes = int64_t(values.element_size());
  if (path == ChannelsFirstPath::kDenseBlocks) {
    const int64_t rows = channels_first_block_rows(problem);
    return {"dense_blocks", reason, 1, 1, 1, 1, 1, 0, rows * p.cols * bytes, false,
            "dense_blocks: W expanded " + std::to_string(rows) +
                " output channels at a time, each block multiplied by cuDNN's 1x1 convolution over the images in "
                "place"};
  }
  if (path == ChannelsFirstPath::kPixelRows)
    return {"pixel_rows", reason, 1, 1, 1, 1, 1, 0, n * (p.rows + p.cols) * bytes, false,
            "pixel_rows: the images transposed into rows of channels, the forward product as its planner runs it, "
            "the result transposed back"};
  return {"in_place", reason, 1, 1, 1, 1, 1, 0, 0, false,
          "in_place: a warp per output channel and tile of pixels, each slot one coalesced read of its input "
          "channel's pixels"};
}

ExplainResult explain(const at::Tensor& values, at::TensorList pattern, int64_t n, c10::string_view op_name,
                      c10::string_view variant, c10::string_view activation, int64_t pixels, bool packed,
                      bool fragments, bool bitmaps) {
  const char* op = "explain";
  const Activation act = activation_arg(activation, op);
  const std::string which(op_name);
  TORCH_CHECK_VALUE(which == "forward" || which == "input_grad" || which == "weight_grad" || which == "channels_first",
                    "snack.explain: op must be forward, input_grad, weight_grad or channels_first, got '", which, "'");
  const bool forward_only = which == "forward" || which == "channels_first";
  const PatternArg p = pattern_arg(pattern, op, forward_only ? PatternNeeds::kForward : PatternNeeds::kAll);
  check_values(values, p, op);
  TORCH_CHECK_VALUE(n >= 0, "snack.explain: n must be non-negative, got ", n);
  TORCH_CHECK_VALUE(pixels >= 1 && n % pixels == 0, "snack.explain: pixels per image must be positive and divide n (",
                    n, " pixels in all), got ", pixels);
  if (which == "channels_first") return explain_channels_first(values, p, n, pixels, variant, act);
  if (!values.is_cuda()) {
    const CpuProduct product = which == "forward"      ? CpuProduct::kForward
                               : which == "input_grad" ? CpuProduct::kTransposed
                                                       : CpuProduct::kWeightGrad;
    const CpuPath path = product == CpuProduct::kWeightGrad
                             ? cpu_path(sddmm_variant_arg(variant, op))
                             : cpu_path(spmm_variant_arg(variant, product == CpuProduct::kTransposed, op));
    const char* reason = path == CpuPath::kChoose ? "cpu_rule" : "forced";
    if (cpu_dense_blocks(p, n, values.scalar_type(), product, path, product == CpuProduct::kForward ? act
                                                                                                 : Activation::kNone)) {
      const CpuBlocks blocks = cpu_blocks(p, n, product);
      // Each block's GEMM takes the whole batch.
      const int whole_batch = int(std::min<int64_t>(n, std::numeric_limits<int>::max()));
      return {"dense_blocks", reason, whole_batch, 1, 1, 1, 1, 0, blocks.per_block * blocks.width * int64_t(values.element_size()),
              false,
              "dense_blocks (cpu): W expanded " + std::to_string(blocks.per_block) +
                  (blocks.columns ? " columns" : " rows") + " at a time, each block multiplied by ATen's GEMM"};
    }
    const int tile = cpu::batch_tile_width(n);
    return {"cpu", reason, tile, 1, 1, 1, 1, 0, 0, false,
            "cpu: sparse loops over the batch in tiles of " + std::to_string(tile) +
                " rows, outputs split over threads, each summed in a fixed order"};
  }
  const int device = values.device().index();
  const int value_bytes = int(values.element_size());
  if (which == "weight_grad") {
    SddmmProblem problem;
    problem.rows = p.rows;
    problem.cols = p.cols;
    problem.nnz = p.nnz;
    problem.n = n;
    problem.value_bytes = value_bytes;
    problem.requested = sddmm_variant_arg(variant, op);
    const SddmmPlan plan = sddmm_plan(binding_problem(problem, p.has_tile_view()), device, op);
    return {sddmm_variant_name(plan.variant), sddmm_reason_name(plan.reason), plan.padded_batch, plan.lanes_per_row,
            plan.batch_lanes, plan.grid_x * plan.grid_y * plan.batch_splits, plan.threads, int64_t(plan.smem_bytes),
            int64_t(plan.workspace_bytes), false,
            describe(plan)};
  }
  const bool transposed = which == "input_grad";
  SpmmProblem problem = binding_problem(SpmmProblem{transposed ? p.cols : p.rows, transposed ? p.rows : p.cols, p.nnz,
                                                    n, value_bytes, transposed,
                                                    spmm_variant_arg(variant, transposed, op)},
                                        p.has_tile_view());
  TORCH_CHECK_VALUE(int(packed) + int(fragments) + int(bitmaps) <= 1,
                    "snack.explain: give at most one of packed, fragments and bitmaps");
  // The planner reads it for the forward's 16-bit products over the view (dX is given none: what the
  // layer holds in tile order is W's, and spmm_t packs W^T's where its plan asks).
  if (!transposed)
    problem.packed_tiles = fragments ? TileValues::kFragments
                           : bitmaps ? TileValues::kBitmaps
                           : packed  ? TileValues::kPacked
                                     : TileValues::kNone;
  const SpmmPlan plan = spmm_plan(problem, device, op);
  return {spmm_variant_name(plan.variant), spmm_reason_name(plan.reason), plan.batch_tile, plan.lanes_per_row,
          plan.rows_per_warp, plan.grid_x, plan.threads, int64_t(plan.smem_bytes), int64_t(plan.workspace_bytes),
          plan.prefetch_l2, describe(plan)};
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
kernel_variants() {
  std::vector<std::string> forward, input_grad, weight_grad, nondeterministic;
  for (SpmmVariant v : spmm_variants()) {
    forward.emplace_back(spmm_variant_name(v));
    if (!spmm_variant_is_forward_only(v)) input_grad.emplace_back(spmm_variant_name(v));
    if (!spmm_variant_is_deterministic(v)) nondeterministic.emplace_back(spmm_variant_name(v));
  }
  for (SddmmVariant v : sddmm_variants()) weight_grad.emplace_back(sddmm_variant_name(v));
  return {forward, input_grad, weight_grad, nondeterministic};
}

std::vector<std::string> pattern_fields() {
  std::vector<std::string> names;
  for (int f = 0; f < kPatternFields; ++f) names.emplace_back(pattern_field_name(f));
  return names;
}

int64_t dense_block_min_rows() { return kDenseBlockMinRows; }
std::vector<int64_t> tile_view_geometry() { return {kTileViewRows, kTileViewCols, kTileViewMaxCols}; }
int64_t tile_fragment_words(int64_t rows, int64_t cols, int64_t nnz) {
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0 && nnz >= 0 && nnz <= rows * cols, "snack.tile_fragment_words: ", rows, "x",
                    cols, " with nnz=", nnz, " is not a pattern's size");
  return tile_fragment_layout(rows, cols, nnz).words;
}
int64_t tile_bitmap_words(int64_t rows, int64_t cols, int64_t nnz) {
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0 && nnz >= 0 && nnz <= rows * cols, "snack.tile_bitmap_words: ", rows, "x",
                    cols, " with nnz=", nnz, " is not a pattern's size");
  return tile_bitmap_layout(rows, cols, nnz).words;
}
std::vector<std::string> channels_first_paths() {
  std::vector<std::string> names;
  for (ChannelsFirstPath path : snack::channels_first_paths()) names.emplace_back(channels_first_path_name(path));
  return names;
}

int64_t index_bits(int64_t out_features, int64_t in_features) {
  check_features(out_features, in_features, "index_bits");
  return default_index_bits(out_features, in_features);
}

int64_t nnz_for_density_op(int64_t out_features, int64_t in_features, double density) {
  check_features(out_features, in_features, "nnz_for_density");
  TORCH_CHECK_VALUE(density >= 0.0 && density <= 1.0, "snack.nnz_for_density: density must lie in [0, 1], got ",
                    density);
  return nnz_for_density(out_features, in_features, density);
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CompositeImplicitAutograd, m) {
  m.impl("explain", &snack::binding::explain);
  m.impl("kernel_variants", &snack::binding::kernel_variants);
  m.impl("pattern_fields", &snack::binding::pattern_fields);
  m.impl("index_bits", &snack::binding::index_bits);
  m.impl("dense_block_min_rows", &snack::binding::dense_block_min_rows);
  m.impl("tile_view_geometry", &snack::binding::tile_view_geometry);
  m.impl("tile_fragment_words", &snack::binding::tile_fragment_words);
  m.impl("tile_bitmap_words", &snack::binding::tile_bitmap_words);
  m.impl("channels_first_paths", &snack::binding::channels_first_paths);
  m.impl("nnz_for_density", &snack::binding::nnz_for_density_op);
  m.impl("set_default_spmm_variant", &snack::binding::set_default_spmm_variant);
  m.impl("set_default_csc_read", &snack::binding::set_default_csc_read);
  m.impl("set_default_tile_view_splits", &snack::binding::set_default_tile_view_splits);
  m.impl("set_default_fragment_warpgroups", &snack::binding::set_default_fragment_warpgroups);
}
