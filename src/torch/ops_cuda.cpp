// The CUDA implementations of snack's operators: each checks its inputs (ops_common.cpp), takes
// the cached plan of its product (plans.cpp), its workspace from PyTorch's caching allocator, and
// enqueues the core's kernels on PyTorch's current stream.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_context.h"
#include "ops_common.h"
#include "plans.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"
#include "snack/topology.h"

namespace snack::binding {

Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

namespace {
class TorchCudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream stream) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
  }
  void deallocate(void* ptr, Stream) override { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
};
}  // namespace

DeviceAllocator& torch_cuda_allocator() {
  static TorchCudaAllocator allocator;
  return allocator;
}

namespace {

// A plan's workspace from the caching allocator (undefined where it needs none).
at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return bytes ? at::empty({int64_t(bytes)}, like.options().dtype(at::kByte)) : at::Tensor();
}
void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

SpmmProblem forward_problem(const PatternArg& p, int64_t n, const at::Tensor& values, SpmmVariant variant,
                            TileValues packed_tiles = TileValues::kNone) {
  SpmmProblem problem = binding_problem(
      SpmmProblem{p.rows, p.cols, p.nnz, n, int(values.element_size()), false, variant}, p.has_tile_view());
  problem.packed_tiles = packed_tiles;
  return problem;
}

// kDenseBlocks, the GEMM side (cuBLAS through ATen, on the current stream): out[:, o:o+b] = in
// block^T (+ bias[o:o+b]) for blocks of plan.block_rows outputs of the product's view of W (rows
// of W for the forward, of W^T for the transposed product), each written by expand_block into one
// workspace that the next block reuses; the activation over the whole output last.
void dense_blocks_product(const PatternArg& p, const at::Tensor& values, const at::Tensor& in,
                          const std::optional<at::Tensor>& bias, Activation act, const SpmmPlan& plan,
                          at::Tensor& out, const char* op) {
  const bool transposed = plan.problem.transposed;
  const int64_t outputs = transposed ? p.cols : p.rows, width = transposed ? p.rows : p.cols;
  const at::Tensor block = at::empty({std::min(plan.block_rows, outputs), width}, values.options());
  for (int64_t first = 0; first < outputs; first += plan.block_rows) {
    const int64_t count = std::min(plan.block_rows, outputs - first);
    dispatch_value_type(values, op, [&](auto tag) {
      using T = decltype(tag);
      throw_if_error(with_pattern(p,
                                  [&](auto w) {
                                    return cuda::expand_block(w, data_as<T>(values), transposed, first, count,
                                                              data_as<T>(block), current_stream());
                                  }),
                     op);
    });
    const at::Tensor b = block.narrow(0, 0, count);
    at::Tensor o = out.narrow(1, first, count);
    if (bias) {
      at::addmm_out(o, bias->narrow(0, first, count), in, b.t());
    } else {
      at::mm_out(o, in, b.t());
    }
  }
  if (act == Activation::kReLU) out.relu_();
  if (act == Activation::kGELU) out.copy_(at::gelu(out));  // the exact (erf) GELU, as the kernels'
}

// kDenseBlocks for the weight gradient: per block of plan.block_rows rows of W, g = dY[:, rows]^T X
// by the GEMM, then `read(g, first_row, rows)` takes the slots out of it.
template <typename Read>
void dense_blocks_weight_grad(const PatternArg& p, const at::Tensor& dy, const at::Tensor& x, const SddmmPlan& plan,
                              Read&& read) {
  const at::Tensor block = at::empty({std::min(plan.block_rows, p.rows), p.cols}, dy.options());
  for (int64_t first = 0; first < p.rows; first += plan.block_rows) {
    const int64_t count = std::min(plan.block_rows, p.rows - first);
    at::Tensor g = block.narrow(0, 0, count);
    at::mm_out(g, dy.narrow(1, first, count).t(), x);
    read(g, first, count);
  }
}

// The values of pattern `p` in the layout `kind`, on the current stream.
at::Tensor pack_tiles_of(const PatternArg& p, const at::Tensor& values, TileValues kind, const char* op,
                         bool transposed = false) {
  at::Tensor out = empty_tiles(values, p, kind, op);
  const c10::cuda::CUDAGuard guard(p.device);
  const auto* entries = reinterpret_cast<const uint32_t*>(p.tile_entries.data_ptr<int32_t>());
  const auto* bits = static_cast<const uint16_t*>(values.data_ptr());
  auto* words = static_cast<int32_t*>(out.data_ptr());
  throw_if_error(kind == TileValues::kFragments
                     ? cuda::pack_tile_fragments(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(),
                                                 p.tile_ptr.data_ptr<int32_t>(), entries, bits, words,
                                                 current_stream(), transposed)
                 : kind == TileValues::kBitmaps
                     ? cuda::pack_tile_bitmaps(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(),
                                               p.tile_ptr.data_ptr<int32_t>(), entries, bits, words,
                                               current_stream(), transposed)
                     : cuda::pack_tile_values(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(), entries, bits,
                                              static_cast<uint32_t*>(out.data_ptr()), current_stream()),
                 op);
  return out;
}

// The forward. keep_x_t: where the plan transposes the whole batch, its workspace is allocated as
// that copy, [K + 1, batch tile] in the values' dtype (cuda::TransposedInput), and returned; else
// an empty tensor.
// tiles: the values in tile order (packed_tiles_arg), read where the plan runs kTileView; given none,
// the plan may have the tile fragments packed for this one product (SpmmPlan::packs_fragments).
std::tuple<at::Tensor, at::Tensor> forward(const SpmmInputs& in, const at::Tensor& values, SpmmVariant variant,
                                           bool keep_x_t, const char* op, GivenTiles tiles = {}) {
  const c10::cuda::CUDAGuard guard(in.p.device);
  const int64_t n = in.x.size(0);
  const SpmmPlan plan = spmm_plan(forward_problem(in.p, n, values, variant, tiles.kind), in.p.device.index(), op);
  at::Tensor fragments;  // packed for this product where the plan asks: freed after it
  if (plan.packs_fragments) {
    fragments = pack_tiles_of(in.p, values, TileValues::kFragments, op);
    tiles = {reinterpret_cast<const uint32_t*>(fragments.data_ptr()), TileValues::kFragments};
  }
  at::Tensor ws, x_t = at::empty({0, 0}, values.options());
  if (plan.variant == SpmmVariant::kDenseBlocks) {  // its workspace is the block dense_blocks_product takes
    at::Tensor y = at::empty({n, in.p.rows}, values.options());
    dense_blocks_product(in.p, values, in.x, in.bias, in.act, plan, y, op);
    return {y, x_t};
  }
  if (keep_x_t && plan_transposes_whole_input(plan)) {
    x_t = at::empty({in.p.cols + 1, plan.batch_tile}, values.options());
    TORCH_INTERNAL_ASSERT(size_t(x_t.nbytes()) == plan.workspace_bytes);
    ws = x_t;
  } else {
    ws = workspace(plan.workspace_bytes, values);
  }
  at::Tensor y = at::empty({n, in.p.rows}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return cuda::spmm_forward(w, data_as<T>(values), data_as<T>(in.x), n, b,
                                                            data_as<T>(y), plan, data_or_null(ws), current_stream(),
                                                            in.act, tiles.words);
                                }),
                   op);
  });
  return {y, x_t};
}

at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                const std::optional<at::Tensor>& bias, c10::string_view activation, c10::string_view variant,
                const std::optional<at::Tensor>& tiles) {
  const char* op = "spmm";
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op);
  return std::get<0>(
      forward(in, values, spmm_variant_arg(variant, false, op), false, op, packed_tiles_arg(tiles, values, in.p, op)));
}

// pack_tile_values, pack_tile_fragments and pack_tile_bitmaps: the values in the layout `kind`, on the
// current stream.
at::Tensor pack_tiles(const at::Tensor& values, at::TensorList pattern, TileValues kind, const char* op,
                      bool transposed = false) {
  return pack_tiles_of(pattern_arg(pattern, op, PatternNeeds::kForward), values, kind, op, transposed);
}

at::Tensor pack_tile_values(const at::Tensor& values, at::TensorList pattern) {
  return pack_tiles(values, pattern, TileValues::kPacked, "pack_tile_values");
}

at::Tensor pack_tile_fragments(const at::Tensor& values, at::TensorList pattern, bool transposed) {
  return pack_tiles(values, pattern, TileValues::kFragments, "pack_tile_fragments", transposed);
}

at::Tensor pack_tile_bitmaps(const at::Tensor& values, at::TensorList pattern, bool transposed) {
  return pack_tiles(values, pattern, TileValues::kBitmaps, "pack_tile_bitmaps", transposed);
}

// kDenseBlocks on NCHW images: blocks of output channels of W expanded by expand_block, each
// multiplied by cuDNN's 1x1 convolution over the images where they lie (as nn.Conv2d: float32 follows
// torch.backends.cudnn.allow_tf32), its activation applied, written into y's channels.
at::Tensor channels_first_dense_blocks(const SpmmInputs& in, const at::Tensor& values,
                                       const ChannelsFirstProblem& problem, const char* op) {
  const int64_t rows = std::max<int64_t>(channels_first_block_rows(problem), 1), batch = problem.batch;
  // GELU on 16-bit values (forced: the planner takes the pixel rows): the convolution in float32, so
  // that the output is rounded once, as the kernels' is.
  const bool widen = in.act == Activation::kGELU && values.element_size() == 2;
  // The pixels as a near-square image (a 1x1 convolution does not see the shape): nn.Conv2d on 7 x 7
  // bf16 images ran 3-4x faster than this convolution of the same 49 pixels as a column.
  int64_t height = 1;
  for (int64_t h = 1; h * h <= problem.pixels; ++h)
    if (problem.pixels % h == 0) height = h;
  at::Tensor images = in.x.view({batch, in.p.cols, height, problem.pixels / std::max<int64_t>(height, 1)});
  if (widen) images = images.to(at::kFloat);
  const at::Tensor block = at::empty({rows, in.p.cols, 1, 1}, values.options());
  at::Tensor y;
  for (int64_t first = 0; first < in.p.rows; first += rows) {
    const int64_t count = std::min(rows, in.p.rows - first);
    dispatch_value_type(values, op, [&](auto tag) {
      using T = decltype(tag);
      throw_if_error(with_pattern(in.p,
                                  [&](auto w) {
                                    return cuda::expand_block(w, data_as<T>(values), false, first, count,
                                                              data_as<T>(block), current_stream());
                                  }),
                     op);
    });
    const std::optional<at::Tensor> b = in.bias ? std::optional<at::Tensor>(in.bias->narrow(0, first, count))
                                                : std::nullopt;
    const at::Tensor w = block.narrow(0, 0, count);
    at::Tensor part = widen ? at::conv2d(images, w.to(at::kFloat), b ? b->to(at::kFloat) : b) : at::conv2d(images, w, b);
    if (in.act == Activation::kReLU) part.relu_();
    if (in.act == Activation::kGELU) part = at::gelu(part);  // the exact (erf) GELU, as the kernels'
    part = part.view({batch, count, problem.pixels});
    if (count == in.p.rows) {
      y = part.to(values.scalar_type()).contiguous();
    } else {
      if (!y.defined()) y = at::empty({batch, in.p.rows, problem.pixels}, values.options());
      y.narrow(1, first, count).copy_(part);
    }
  }
  if (!y.defined()) y = at::empty({batch, in.p.rows, problem.pixels}, values.options());  // no outputs
  return y;
}

at::Tensor spmm_channels_first(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                               const std::optional<at::Tensor>& bias, c10::string_view activation,
                               c10::string_view variant) {
  const char* op = "spmm_channels_first";
  ChannelsFirstPath path = channels_first_path_arg(variant, op);
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op, true);
  const c10::cuda::CUDAGuard guard(in.p.device);
  const int64_t batch = in.x.size(0), pixels = in.x.size(2);
  const ChannelsFirstProblem problem{in.p.rows, in.p.cols, in.p.nnz, batch, pixels, int(values.element_size()),
                                     at::globalContext().allowTF32CuDNN(), in.act};
  if (path == ChannelsFirstPath::kAuto) path = plan_channels_first(problem, cuda_device_limits(in.p.device.index()));
  if (path == ChannelsFirstPath::kPixelRows) {  // [B, K, P] -> [B P, K], the forward, and back
    SpmmInputs rows = in;
    rows.x = in.x.transpose(1, 2).reshape({batch * pixels, in.p.cols}).contiguous();  // one image: a view
    const at::Tensor y = std::get<0>(forward(rows, values, spmm_variant_arg("auto", false, op), false, op));
    return y.view({batch, pixels, in.p.rows}).transpose(1, 2).contiguous();
  }
  if (path == ChannelsFirstPath::kDenseBlocks) return channels_first_dense_blocks(in, values, problem, op);
  at::Tensor y = at::empty({batch, in.p.rows, pixels}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return cuda::spmm_channels_first(w, data_as<T>(values), data_as<T>(in.x), batch,
                                                                   pixels, b, data_as<T>(y), current_stream(), in.act);
                                }),
                   op);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> spmm_for_step(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                                                 const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const char* op = "spmm_for_step";
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op);
  return forward(in, values, spmm_variant_arg("auto", false, op), true, op);
}

at::Tensor spmm_t(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern, c10::string_view variant) {
  const char* op = "spmm_t";
  const SpmmTInputs in = spmm_t_inputs(dy, values, pattern, op);
  const c10::cuda::CUDAGuard guard(in.p.device);
  const int64_t n = in.dy.size(0);
  const SpmmProblem problem = binding_problem(SpmmProblem{in.p.cols, in.p.rows, in.p.nnz, n,
                                                          int(values.element_size()), true,
                                                          spmm_variant_arg(variant, true, op)},
                                              in.p.has_tile_view());
  const SpmmPlan plan = spmm_plan(problem, in.p.device.index(), op);
  at::Tensor dx = at::empty({n, in.p.cols}, values.options());
  if (plan.variant == SpmmVariant::kDenseBlocks) {
    dense_blocks_product(in.p, values, in.dy, std::nullopt, Activation::kNone, plan, dx, op);
    return dx;
  }
  // W^T's tile fragments, packed for this product where the plan asks: freed after it
  const at::Tensor fragments = plan.packs_fragments
                                   ? pack_tiles_of(in.p, values, TileValues::kFragments, op, /*transposed=*/true)
                                   : at::Tensor();
  const auto* words = fragments.defined() ? reinterpret_cast<const uint32_t*>(fragments.data_ptr()) : nullptr;
  const at::Tensor ws = workspace(plan.workspace_bytes, values);
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return cuda::spmm_transposed(w, data_as<T>(values), data_as<T>(in.dy), n,
                                                               data_as<T>(dx), plan, data_or_null(ws),
                                                               current_stream(), words);
                                }),
                   op);
  });
  return dx;
}

SddmmProblem sddmm_problem(const SddmmInputs& in, const at::Tensor& like, SddmmEpilogue epilogue, SddmmVariant variant,
                           int64_t x_t_stride) {
  SddmmProblem problem;
  problem.rows = in.p.rows;
  problem.cols = in.p.cols;
  problem.nnz = in.p.nnz;
  problem.n = in.x.size(0);
  problem.value_bytes = int(like.element_size());
  problem.epilogue = epilogue;
  problem.requested = variant;
  problem.x_t_stride = x_t_stride;
  return binding_problem(problem, in.p.has_tile_view());
}

at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, c10::string_view variant) {
  const char* op = "sddmm";
  const SddmmVariant v = sddmm_variant_arg(variant, op);
  const SddmmInputs in = sddmm_inputs(dy, x, pattern, dy, op);
  const c10::cuda::CUDAGuard guard(in.p.device);
  const SddmmPlan plan = sddmm_plan(sddmm_problem(in, dy, SddmmEpilogue::kStore, v, 0), in.p.device.index(), op);
  at::Tensor dv = at::empty({in.p.nnz}, dy.options());
  if (plan.variant == SddmmVariant::kDenseBlocks) {
    dense_blocks_weight_grad(in.p, in.dy, in.x, plan, [&](const at::Tensor& g, int64_t first, int64_t count) {
      dispatch_value_type(dy, op, [&](auto tag) {
        using T = decltype(tag);
        throw_if_error(with_pattern(in.p,
                                    [&](auto w) {
                                      return cuda::sddmm_from_block(w, data_as<T>(g), g.stride(0), first, count,
                                                                    data_as<T>(dv), current_stream());
                                    }),
                       op);
      });
    });
    return dv;
  }
  const at::Tensor ws = workspace(plan.workspace_bytes, dy);
  dispatch_value_type(dy, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return cuda::sddmm(w, data_as<T>(in.dy), data_as<T>(in.x), in.x.size(0),
                                                     data_as<T>(dv), plan, data_or_null(ws), current_stream());
                                }),
                   op);
  });
  return dv;
}

at::Tensor bias_grad(const at::Tensor& dy) {
  const char* op = "bias_grad";
  const at::Tensor dyc = bias_grad_input(dy, op);
  const c10::cuda::CUDAGuard guard(dyc.device());
  at::Tensor db = at::empty({dyc.size(1)}, dyc.options());
  dispatch_value_type(dyc, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(cuda::bias_grad(data_as<T>(dyc), dyc.size(0), dyc.size(1), data_as<T>(db), current_stream()), op);
  });
  return db;
}

template <typename T>
cuda::AdamWParameter<T> adamw_parameter(const AdamWArg& a) {
  return {data_as<T>(a.param), data_as<T>(a.exp_avg), data_as<T>(a.exp_avg_sq), a.step.data_ptr<float>(), a.config};
}

// Calls fn(operand tag, parameter tag) with the types of a fused AdamW step: the operands' and the
// parameter's dtype, or a 16-bit operand type with float32 parameters (mixed precision).
template <typename Fn>
void dispatch_adamw_types(const at::Tensor& operand, const at::Tensor& param, const char* op, Fn&& fn) {
  if (!is_mixed_precision(operand, param)) {
    dispatch_value_type(param, op, [&](auto tag) { fn(tag, tag); });
  } else if (operand.scalar_type() == at::kBFloat16) {
    fn(bfloat16{}, float{});
  } else {
    fn(float16{}, float{});
  }
}

// sddmm_adamw_ as dense blocks: each block's slots updated as they are read out of it (the first
// block advances the values' count), then the bias's step from dY.
void dense_blocks_adamw(const SddmmAdamWInputs& in, const SddmmPlan& plan, const char* op) {
  const auto run = [&](auto operand_tag, auto param_tag) {
    using T = decltype(operand_tag);
    using P = decltype(param_tag);
    const cuda::AdamWParameter<P> values = adamw_parameter<P>(in.values);
    dense_blocks_weight_grad(in.s.p, in.s.dy, in.s.x, plan, [&](const at::Tensor& g, int64_t first, int64_t count) {
      throw_if_error(with_pattern(in.s.p,
                                  [&](auto w) {
                                    return cuda::sddmm_adamw_from_block(w, data_as<T>(g), g.stride(0), first, count,
                                                                        values, first == 0, current_stream());
                                  }),
                     op);
    });
    if (in.bias)
      throw_if_error(cuda::bias_grad_adamw(data_as<T>(in.s.dy), in.s.dy.size(0), in.s.dy.size(1),
                                           adamw_parameter<P>(*in.bias), current_stream()),
                     op);
  };
  dispatch_adamw_types(in.s.dy, in.values.param, op, run);
}

void sddmm_adamw_(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& values,
                  at::TensorList state, at::ArrayRef<double> hyper, at::TensorList bias_state,
                  const std::optional<at::Tensor>& bias, at::ArrayRef<double> bias_hyper,
                  const std::optional<at::Tensor>& x_t, c10::string_view variant) {
  const char* op = "sddmm_adamw_";
  const SddmmVariant v = sddmm_variant_arg(variant, op);
  const SddmmAdamWInputs in =
      sddmm_adamw_inputs(dy, x, pattern, values, state, hyper, bias, bias_state, bias_hyper, op);
  const c10::cuda::CUDAGuard guard(in.s.p.device);
  if (values.numel() == 0 && (!in.bias || in.bias->param.numel() == 0)) {
    advance_steps(in);
    return;
  }
  const bool with_x_t = given(x_t);
  if (with_x_t) {  // the forward's copy (spmm_for_step): checked for what the kernel reads
    TORCH_CHECK_VALUE(x_t->device() == values.device() && x_t->scalar_type() == in.s.x.scalar_type() &&
                          x_t->dim() == 2 && x_t->is_contiguous() && x_t->size(0) == in.s.p.cols + 1,
                      "snack.", op, ": x_t must be the forward's [", in.s.p.cols + 1, ", stride] copy of x, got ",
                      x_t->sizes());
  }
  const SddmmPlan plan = sddmm_plan(sddmm_problem(in.s, in.s.dy, SddmmEpilogue::kAdamW, v, with_x_t ? x_t->size(1) : 0),
                                    in.s.p.device.index(), op);
  if (plan.variant == SddmmVariant::kDenseBlocks) {  // the forward's X^T is not needed
    dense_blocks_adamw(in, plan, op);
    return;
  }
  const at::Tensor ws = workspace(plan.workspace_bytes, values);
  // T: the operands' type; P: the parameters' (T, or float32 masters of 16-bit operands).
  const auto run = [&](auto operand_tag, auto param_tag) {
    using T = decltype(operand_tag);
    using P = decltype(param_tag);
    const cuda::TransposedInput<T> given_x_t{with_x_t ? data_as<T>(*x_t) : nullptr, with_x_t ? x_t->size(1) : 0};
    cuda::AdamWParameter<P> bias_param;
    if (in.bias) bias_param = adamw_parameter<P>(*in.bias);
    throw_if_error(with_pattern(in.s.p,
                                [&](auto w) {
                                  return cuda::sddmm_adamw(w, data_as<T>(in.s.dy), data_as<T>(in.s.x), in.s.x.size(0),
                                                           adamw_parameter<P>(in.values),
                                                           in.bias ? &bias_param : nullptr, plan, data_or_null(ws),
                                                           current_stream(), given_x_t);
                                }),
                   op);
  };
  dispatch_adamw_types(in.s.dy, values, op, run);
}

void bias_grad_adamw_(const at::Tensor& dy, const at::Tensor& bias, at::TensorList state, at::ArrayRef<double> hyper) {
  const char* op = "bias_grad_adamw_";
  const BiasAdamWInputs in = bias_grad_adamw_inputs(dy, bias, state, hyper, op);
  const c10::cuda::CUDAGuard guard(bias.device());
  const auto run = [&](auto operand_tag, auto param_tag) {
    using T = decltype(operand_tag);
    using P = decltype(param_tag);
    throw_if_error(cuda::bias_grad_adamw(data_as<T>(in.dy), in.dy.size(0), in.dy.size(1), adamw_parameter<P>(in.bias),
                                         current_stream()),
                   op);
  };
  dispatch_adamw_types(in.dy, bias, op, run);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_coo(const at::Tensor& rows, const at::Tensor& cols,
                                                              int64_t out_features, int64_t in_features,
                                                              std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_coo";
  const CooInputs in = coo_inputs(rows, cols, out_features, in_features, index_dtype, op);
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t nnz = in.rows.size(0);
  const CooOutputs out = empty_coo_outputs(rows, in);
  dispatch_index_type(in.index_type, [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cuda::slots_from_coo<Index>(out_features, in_features, nnz, in.rows.data_ptr<int64_t>(),
                                               in.cols.data_ptr<int64_t>(), data_as<Index>(out.row_idx),
                                               data_as<Index>(out.col_idx), out.order.data_ptr<int64_t>(),
                                               torch_cuda_allocator(), current_stream()),
                   op);
  });
  return {out.row_idx, out.col_idx, out.order};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_dense(const at::Tensor& dense, int64_t nnz,
                                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_dense";
  const DenseInputs in = dense_inputs(dense, nnz, index_dtype, op);
  const c10::cuda::CUDAGuard guard(dense.device());
  at::Tensor positions = at::empty({nnz}, dense.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(in.dense.scalar_type(), "slots_from_dense", [&] {
    throw_if_error(cuda::dense_topk_positions<scalar_t>(in.rows, in.cols, in.dense.data_ptr<scalar_t>(), nnz,
                                                        positions.data_ptr<int64_t>(), torch_cuda_allocator(),
                                                        current_stream()),
                   op);
  });
  auto [row_idx, col_idx] = split_positions(positions, in.cols, in.index_type);
  return {row_idx, col_idx, positions};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_views(const at::Tensor& row_idx,
                                                                                   const at::Tensor& col_idx,
                                                                                   int64_t out_features,
                                                                                   int64_t in_features,
                                                                                   bool tile_view) {
  const char* op = "build_views";
  check_slots(row_idx, col_idx, out_features, in_features, op);
  const c10::cuda::CUDAGuard guard(row_idx.device());
  const int64_t nnz = row_idx.size(0);
  const ViewOutputs out = empty_views(row_idx, out_features, in_features, tile_view);
  dispatch_index_type(row_idx.scalar_type(), [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cuda::build_views<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                            data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                            out.col_ptr.data_ptr<int32_t>(), out.csc_perm.data_ptr<int32_t>(),
                                            torch_cuda_allocator(), current_stream()),
                   op);
    if (!tile_view) return;
    throw_if_error(cuda::build_tile_view<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                                data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                                out.tile_ptr.data_ptr<int32_t>(),
                                                reinterpret_cast<uint32_t*>(out.tile_entries.data_ptr<int32_t>()),
                                                current_stream()),
                   op);
  });
  return out.tuple();
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CUDA, m) {
  using namespace snack::binding;
  m.impl("spmm", &spmm);
  m.impl("pack_tile_values", &pack_tile_values);
  m.impl("pack_tile_fragments", &pack_tile_fragments);
  m.impl("pack_tile_bitmaps", &pack_tile_bitmaps);
  m.impl("spmm_for_step", &spmm_for_step);
  m.impl("spmm_channels_first", &spmm_channels_first);
  m.impl("spmm_t", &spmm_t);
  m.impl("sddmm", &sddmm);
  m.impl("bias_grad", &bias_grad);
  m.impl("sddmm_adamw_", &sddmm_adamw_);
  m.impl("bias_grad_adamw_", &bias_grad_adamw_);
  m.impl("slots_from_coo", &slots_from_coo);
  m.impl("slots_from_dense", &slots_from_dense);
  m.impl("build_views", &build_views);
}
