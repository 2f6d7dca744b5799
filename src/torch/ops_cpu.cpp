// The CPU implementations of snack's operators: the core's loops (src/cpu/) over the batch in tiles
// (snack/batch_tiles.h), split over PyTorch's intra-op threads where every chunk writes a disjoint
// part of the output, so the result does not depend on the split.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_plan.h"
#include "ops_common.h"
#include "snack/batch_tiles.h"
#include "snack/bf16_dot.h"
#include "snack/sddmm.h"
#include "snack/spmm.h"
#include "snack/topology.h"

namespace snack::binding {
namespace {

// Runs fn(begin, end) over [0, count) in chunks on PyTorch's intra-op threads; the first failing
// chunk's status is returned.
template <typename Fn>
Status parallel_chunks(int64_t count, int64_t grain, Fn&& fn) {
  if (count <= grain) return fn(int64_t{0}, count);
  std::vector<Status> statuses(size_t(at::get_num_threads()) + 1);
  std::atomic<int> failed{-1};
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    Status st = fn(begin, end);
    if (!st.ok()) {
      int expected = -1;
      const int slot = at::get_thread_num();
      statuses[size_t(slot)] = std::move(st);
      failed.compare_exchange_strong(expected, slot);
    }
  });
  return failed.load() >= 0 ? statuses[size_t(failed.load())] : Status::Ok();
}

// The outputs [0, count) of a product whose output o sums the entries [ptr[o], ptr[o + 1]) over a
// batch of n rows, run as fn(begin, end) in chunks of about equal work (entries, and one per output
// for its store) on the intra-op threads; the first failing chunk's status is returned. Chunks of
// equal work, not equal counts: a few long rows (power-law patterns) would leave threads idle.
// chunks_per_thread: at most that many chunks per thread (each chunk of dX scans every row of W).
template <typename Fn>
Status parallel_outputs(const int32_t* ptr, int64_t count, int64_t n, Fn&& fn, int64_t chunks_per_thread = 8) {
  constexpr int64_t kWorkPerChunk = 1 << 15;  // multiply-adds: a chunk costs more than its dispatch
  const int64_t work = count > 0 ? int64_t(ptr[count]) + count : 0;
  const int64_t chunks =
      std::clamp<int64_t>(work * std::max<int64_t>(n, 1) / kWorkPerChunk, 1,
                          std::min<int64_t>(std::max<int64_t>(count, 1), chunks_per_thread * at::get_num_threads()));
  if (chunks == 1) return fn(int64_t{0}, count);
  // The first output of chunk c: the first o whose work before it, ptr[o] + o (increasing), reaches
  // c / chunks of the whole.
  auto first_of = [&](int64_t c) {
    const int64_t target = work * c / chunks;
    int64_t lo = 0, hi = count;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (int64_t(ptr[mid]) + mid < target) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  return parallel_chunks(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      SNACK_RETURN_IF_ERROR(fn(first_of(c), c == chunks - 1 ? count : first_of(c + 1)));
    return Status::Ok();
  });
}

// x [n, cols] (contiguous) in the CPU products' batch tiles of S values (snack/batch_tiles.h), stored
// as `type`, each range of tiles written by fill(tiles, t0, t1) on the intra-op threads. The returned
// tensor owns the tiles' storage.
template <typename S, typename Fill>
std::pair<at::Tensor, cpu::BatchTiles<S>> tiles_of(const at::Tensor& x, at::ScalarType type, Fill&& fill) {
  const int64_t n = x.size(0), cols = x.size(1);
  at::Tensor storage = at::empty({cpu::batch_tiles_numel(n, cols)}, x.options().dtype(type));
  const int width = cpu::batch_tile_width(n);
  const int64_t tiles = (n + width - 1) / width;
  const cpu::BatchTiles<S> layout{data_as<S>(storage), n, cols, width};
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(cols * width, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { fill(data_as<S>(storage), t0, t1); });
  return {storage, layout};
}

// x in tiles of T's accumulation type (16-bit values widened once).
template <typename T>
std::pair<at::Tensor, cpu::BatchTiles<accum_t<T>>> batch_tiles(const at::Tensor& x) {
  using A = accum_t<T>;
  return tiles_of<A>(x, std::is_same_v<A, double> ? at::kDouble : at::kFloat, [&](A* out, int64_t t0, int64_t t1) {
    cpu::to_batch_tiles(data_as<T>(x), x.size(0), x.size(1), out, t0, t1);
  });
}

// x (bfloat16) in 16-bit tiles for the AVX512-BF16 dot products (snack/bf16_dot.h).
std::pair<at::Tensor, cpu::BatchTiles<bfloat16>> batch_tiles16(const at::Tensor& x) {
  return tiles_of<bfloat16>(x, at::kBFloat16, [&](bfloat16* out, int64_t t0, int64_t t1) {
    cpu::to_batch_tiles16(data_as<bfloat16>(x), x.size(0), x.size(1), out, t0, t1);
  });
}

// The CPU loops read every index of the pattern, so its contents are checked (cpu::check_pattern,
// O(M + K + nnz)): a corrupted or hand-assembled pattern is an error, not a read out of bounds. A
// check costs as much as a product of one row, so each pattern is checked once: the lists that
// passed are remembered by their tensors' storages (held weakly, so that a freed storage's address
// cannot come back as another's), offsets, lengths and version counters (which every in-place write
// through torch advances). A list edited behind torch's back (shared NumPy memory) is not rechecked.
// Inference tensors (made under torch.inference_mode) have no version counter: a list holding one is
// checked at every call.
class CheckedPatterns {
 public:
  void check(const PatternArg& p, const char* op) {
    const auto fields = fields_of(p);
    const bool keyed = std::none_of(fields.begin(), fields.end(), [](const at::Tensor* t) { return t->is_inference(); });
    Key key;
    if (keyed) {
      key = key_of(p);
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Key& k : checked_)
        if (same(k, key)) return;
    }
    throw_if_error(with_pattern(p, [](auto w) { return cpu::check_pattern(w); }), op);
    if (!keyed) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (checked_.size() < kRemembered) checked_.push_back(std::move(key));
    else checked_[next_++ % kRemembered] = std::move(key);  // the oldest goes
  }

 private:
  struct Field {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t offset, numel;
    uint32_t version;
  };
  using Key = std::vector<Field>;
  static constexpr size_t kRemembered = 64;

  // What the CPU loops read of a pattern list, so what a check of it covers.
  static std::array<const at::Tensor*, 5> fields_of(const PatternArg& p) {
    return {&p.row_idx, &p.col_idx, &p.row_ptr, &p.col_ptr, &p.csc_perm};
  }
  static Key key_of(const PatternArg& p) {
    Key key;
    for (const at::Tensor* t : fields_of(p))
      key.push_back({t->storage().getWeakStorageImpl(), t->storage_offset(), t->numel(),
                     t->unsafeGetTensorImpl()->version_counter().current_version()});
    return key;
  }
  static bool same(const Key& a, const Key& b) {
    for (size_t f = 0; f < a.size(); ++f) {
      if (a[f].storage.expired() || a[f].storage._unsafe_get_target() != b[f].storage._unsafe_get_target() ||
          a[f].offset != b[f].offset || a[f].numel != b[f].numel || a[f].version != b[f].version)
        return false;
    }
    return true;
  }

  std::mutex mutex_;
  std::vector<Key> checked_;  // the patterns checked last
  size_t next_ = 0;
};

void check_contents(const PatternArg& p, const char* op) {
  static CheckedPatterns checked;
  checked.check(p, op);
}

// Rows [first, first + count) of W, dense, filled on the intra-op threads.
template <typename T, typename Index>
at::Tensor expanded_rows(const SlotPattern<Index>& w, const at::Tensor& values, int64_t first, int64_t count) {
  at::Tensor block = at::empty({count, w.cols}, values.options());
  throw_if_error(parallel_chunks(count, std::max<int64_t>(1, 4096 / std::max<int64_t>(w.cols / 64, 1)),
                                 [&](int64_t r0, int64_t r1) {
                                   return cpu::expand_rows(w, data_as<T>(values), first + r0, r1 - r0,
                                                           data_as<T>(block) + r0 * w.cols);
                                 }),
                 "dense block");
  return block;
}

// Columns [first, first + count) of W, dense ([rows, count]), filled on the intra-op threads.
template <typename T, typename Index>
at::Tensor expanded_columns(const SlotPattern<Index>& w, const at::Tensor& values, int64_t first, int64_t count) {
  at::Tensor block = at::empty({w.rows, count}, values.options());
  throw_if_error(parallel_chunks(w.rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(count / 64, 1)),
                                 [&](int64_t r0, int64_t r1) {
                                   return cpu::expand_columns(w, data_as<T>(values), first, count, r0, r1,
                                                              data_as<T>(block));
                                 }),
                 "dense block");
  return block;
}

// fn(T{}, w, first, count) for each of the product's dense blocks in order (cpu_blocks: rows of W, or
// columns for dX), T the value type of `like` and w the pattern's SlotPattern.
template <typename Fn>
void for_each_block(const PatternArg& p, const at::Tensor& like, int64_t n, const char* op, CpuProduct product,
                    Fn&& fn) {
  const CpuBlocks blocks = cpu_blocks(p, n, product);
  const int64_t lines = blocks.lines, per_block = blocks.per_block;
  dispatch_value_type(like, op, [&](auto tag) {
    throw_if_error(with_pattern(p,
                                [&](auto w) {
                                  for (int64_t i0 = 0; i0 < lines; i0 += per_block)
                                    SNACK_RETURN_IF_ERROR(fn(tag, w, i0, std::min(per_block, lines - i0)));
                                  return Status::Ok();
                                }),
                   op);
  });
}

// The values over a checked pattern that holds the tile view, in the layout `kind` (packed tile
// values, tile fragments or bitmap fragments), into `out` (empty_tiles).
// Transposed: W^T's fragments.
void pack_into(const PatternArg& p, const at::Tensor& values, TileValues kind, at::Tensor& out, const char* op,
               bool transposed = false) {
  const auto* entries = reinterpret_cast<const uint32_t*>(p.tile_entries.data_ptr<int32_t>());
  const auto* bits = static_cast<const uint16_t*>(values.data_ptr());
  auto* words = static_cast<int32_t*>(out.data_ptr());
  throw_if_error(kind == TileValues::kFragments
                     ? cpu::pack_tile_fragments(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(),
                                                p.tile_ptr.data_ptr<int32_t>(), entries, bits, words, transposed)
                 : kind == TileValues::kBitmaps
                     ? cpu::pack_tile_bitmaps(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(),
                                              p.tile_ptr.data_ptr<int32_t>(), entries, bits, words, transposed)
                     : cpu::pack_tile_values(p.rows, p.cols, p.nnz, p.row_ptr.data_ptr<int32_t>(), entries, bits,
                                             static_cast<uint32_t*>(out.data_ptr())),
                 op);
}

at::Tensor pack_tiles(const at::Tensor& values, at::TensorList pattern, TileValues kind, const char* op,
                      bool transposed = false) {
  const PatternArg p = pattern_arg(pattern, op, PatternNeeds::kForward);
  at::Tensor out = empty_tiles(values, p, kind, op);
  check_contents(p, op);
  pack_into(p, values, kind, out, op, transposed);
  return out;
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

at::Tensor spmm(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                const std::optional<at::Tensor>& bias, c10::string_view activation, c10::string_view variant,
                const std::optional<at::Tensor>& tiles) {
  const char* op = "spmm";
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op);
  const SpmmVariant v = spmm_variant_arg(variant, false, op);
  check_contents(in.p, op);
  if (const GivenTiles given = packed_tiles_arg(tiles, values, in.p, op); given.words != nullptr) {
    // The CPU reads the values; the packing it is given must still be theirs, as the GPU reads it.
    const char* packer = given.kind == TileValues::kFragments ? "pack_tile_fragments"
                         : given.kind == TileValues::kBitmaps ? "pack_tile_bitmaps"
                                                              : "pack_tile_values";
    at::Tensor expected = at::empty_like(*tiles);
    pack_into(in.p, values, given.kind, expected, op);
    const int64_t words = int64_t(expected.nbytes() / sizeof(uint32_t));
    TORCH_CHECK_VALUE(std::equal(given.words, given.words + words, static_cast<const uint32_t*>(expected.data_ptr())),
                      "snack.", op, ": tiles are not the packing of these values over this pattern (pack them again "
                      "with snack.ops.", packer,
                      " after the values or the pattern change)");
  }
  const int64_t n = in.x.size(0);
  if (cpu_dense_blocks(in.p, n, values.scalar_type(), CpuProduct::kForward, cpu_path(v), in.act)) {
    at::Tensor y = at::empty({n, in.p.rows}, values.options());
    // GELU on a rounded 16-bit product would round twice: such blocks run in float (forced only).
    const bool gelu_in_float = is_16_bit(values.scalar_type()) && in.act == Activation::kGELU;
    const at::Tensor x_in = gelu_in_float ? in.x.to(at::kFloat) : in.x;
    for_each_block(in.p, values, n, op, CpuProduct::kForward, [&](auto tag, auto w, int64_t r0, int64_t count) {
      at::Tensor wb = expanded_rows<decltype(tag)>(w, values, r0, count);
      std::optional<at::Tensor> b;
      if (in.bias) b = in.bias->narrow(0, r0, count);
      if (gelu_in_float) {
        wb = wb.to(at::kFloat);
        if (b) b = b->to(at::kFloat);
      }
      at::Tensor yb = b ? at::addmm(*b, x_in, wb.t()) : at::mm(x_in, wb.t());
      if (gelu_in_float) yb = at::gelu(yb);
      y.narrow(1, r0, count).copy_(yb);
      return Status::Ok();
    });
    if (in.act == Activation::kReLU) y.relu_();  // exact: commutes with the rounding
    if (in.act == Activation::kGELU && !gelu_in_float) y = at::gelu(y);
    return y;
  }
  at::Tensor y = at::empty({n, in.p.rows}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    const auto [storage, x_tiles] = batch_tiles<T>(in.x);
    throw_if_error(with_pattern(in.p,
                                [&, &x_tiles = x_tiles](auto w) {
                                  return parallel_outputs(w.row_ptr, w.rows, x_tiles.n, [&](int64_t r0, int64_t r1) {
                                    return cpu::spmm_forward_rows(w, data_as<T>(values), x_tiles, b, data_as<T>(y),
                                                                  in.act, r0, r1);
                                  });
                                }),
                   op);
  });
  return y;
}

at::Tensor spmm_channels_first(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                               const std::optional<at::Tensor>& bias, c10::string_view activation,
                               c10::string_view variant) {
  const char* op = "spmm_channels_first";
  channels_first_path_arg(variant, op);  // a known name; the CPU has one path
  const SpmmInputs in = spmm_inputs(x, values, pattern, bias, activation, op, true);
  check_contents(in.p, op);
  const int64_t batch = in.x.size(0), pixels = in.x.size(2);
  at::Tensor y = at::empty({batch, in.p.rows, pixels}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    using A = accum_t<T>;
    const T* b = in.bias ? data_as<T>(*in.bias) : nullptr;
    // 16-bit images widened once, for all the output channels.
    const at::Tensor images = std::is_same_v<T, A> ? in.x : in.x.to(at::kFloat);
    throw_if_error(with_pattern(in.p,
                                [&](auto w) {
                                  return parallel_outputs(w.row_ptr, w.rows, batch * pixels,
                                                          [&](int64_t r0, int64_t r1) {
                                                            return cpu::spmm_channels_first_rows(
                                                                w, data_as<T>(values), data_as<A>(images), batch,
                                                                pixels, b, data_as<T>(y), in.act, r0, r1);
                                                          });
                                }),
                   op);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> spmm_for_step(const at::Tensor& x, const at::Tensor& values, at::TensorList pattern,
                                                 const std::optional<at::Tensor>& bias, c10::string_view activation) {
  return {spmm(x, values, pattern, bias, activation, "auto", std::nullopt), at::empty({0, 0}, values.options())};
}

at::Tensor spmm_t(const at::Tensor& dy, const at::Tensor& values, at::TensorList pattern, c10::string_view variant) {
  const char* op = "spmm_t";
  const SpmmTInputs in = spmm_t_inputs(dy, values, pattern, op);
  const SpmmVariant v = spmm_variant_arg(variant, true, op);
  check_contents(in.p, op);
  const int64_t n = in.dy.size(0);
  if (cpu_dense_blocks(in.p, n, values.scalar_type(), CpuProduct::kTransposed, cpu_path(v))) {
    // Blocks of W's columns: each block of dX is one GEMM over all of W's rows, in the operands'
    // dtype (a 16-bit GEMM at its own rate, each output rounded once).
    at::Tensor dx = at::empty({n, in.p.cols}, values.options());
    for_each_block(in.p, values, n, op, CpuProduct::kTransposed, [&](auto tag, auto w, int64_t c0, int64_t count) {
      dx.narrow(1, c0, count).copy_(at::mm(in.dy, expanded_columns<decltype(tag)>(w, values, c0, count)));
      return Status::Ok();
    });
    return dx;
  }
  at::Tensor dx = at::empty({n, in.p.cols}, values.options());
  dispatch_value_type(values, op, [&](auto tag) {
    using T = decltype(tag);
    const auto [storage, dy_tiles] = batch_tiles<T>(in.dy);
    throw_if_error(with_pattern(in.p,
                                [&, &dy_tiles = dy_tiles](auto w) {
                                  return parallel_outputs(
                                      w.col_ptr, w.cols, dy_tiles.n,
                                      [&](int64_t c0, int64_t c1) {
                                        return cpu::spmm_transposed_columns(w, data_as<T>(values), dy_tiles,
                                                                            data_as<T>(dx), c0, c1);
                                      },
                                      1);
                                }),
                   op);
  });
  return dx;
}

// The SDDMM's slots split over the intra-op threads in chunks of at least 1024 (fewer slots per
// chunk the larger the batch), each chunk's sums by slots(w, s0, s1) -> Status.
template <typename Pattern, typename F>
void sddmm_over_threads(const Pattern& p, int64_t n, const char* op, F&& slots) {
  const int64_t grain = std::max<int64_t>(1024, (int64_t(1) << 15) / std::max<int64_t>(n, 1));
  throw_if_error(with_pattern(p,
                              [&](auto w) {
                                return parallel_chunks(w.nnz, grain,
                                                       [&](int64_t s0, int64_t s1) { return slots(w, s0, s1); });
                              }),
                 op);
}

// dv = sddmm(dy, x) of checked inputs: dY and X in tiles once, then the slots split over threads;
// or, on dense blocks, blocks of rows of dY^T X from ATen's GEMM, the stored slots read out of each.
at::Tensor sddmm_of(const SddmmInputs& in, SddmmVariant v, const char* op) {
  at::Tensor dv = at::empty({in.p.nnz}, in.dy.options());
  const int64_t n = in.x.size(0);
  if (cpu_dense_blocks(in.p, n, in.dy.scalar_type(), CpuProduct::kWeightGrad, cpu_path(v))) {
    for_each_block(in.p, in.dy, n, op, CpuProduct::kWeightGrad, [&](auto tag, auto w, int64_t r0, int64_t count) {
      using T = decltype(tag);
      const at::Tensor g = at::mm(in.dy.narrow(1, r0, count).t(), in.x);
      return parallel_chunks(count, 16, [&](int64_t a, int64_t b) {
        return cpu::gather_rows(w, data_as<T>(g) + a * w.cols, r0 + a, b - a, data_as<T>(dv));
      });
    });
    return dv;
  }
  if (in.dy.scalar_type() == at::kBFloat16 && cpu::has_bf16_dot() && cpu::batch_tile_width(n) >= cpu::kBf16DotMinTile) {
    // bfloat16 pairs multiplied into float by the CPU's dot products, the tiles kept in 16 bits.
    const auto [dy_storage, dy_tiles] = batch_tiles16(in.dy);
    const auto [x_storage, x_tiles] = batch_tiles16(in.x);
    sddmm_over_threads(in.p, n, op, [&, &dy_tiles = dy_tiles, &x_tiles = x_tiles](auto w, int64_t s0, int64_t s1) {
      return cpu::sddmm_slots_bf16(w, dy_tiles, x_tiles, data_as<bfloat16>(dv), s0, s1);
    });
    return dv;
  }
  dispatch_value_type(in.dy, op, [&](auto tag) {
    using T = decltype(tag);
    const auto [dy_storage, dy_tiles] = batch_tiles<T>(in.dy);
    const auto [x_storage, x_tiles] = batch_tiles<T>(in.x);
    sddmm_over_threads(in.p, n, op, [&, &dy_tiles = dy_tiles, &x_tiles = x_tiles](auto w, int64_t s0, int64_t s1) {
      return cpu::sddmm_slots(w, dy_tiles, x_tiles, data_as<T>(dv), s0, s1);
    });
  });
  return dv;
}

at::Tensor sddmm(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, c10::string_view variant) {
  const char* op = "sddmm";
  const SddmmVariant v = sddmm_variant_arg(variant, op);
  const SddmmInputs in = sddmm_inputs(dy, x, pattern, dy, op);
  check_contents(in.p, op);
  return sddmm_of(in, v, op);
}

at::Tensor bias_grad_of(const at::Tensor& dyc, const char* op) {
  at::Tensor db = at::empty({dyc.size(1)}, dyc.options());
  dispatch_value_type(dyc, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(cpu::bias_grad(data_as<T>(dyc), dyc.size(0), dyc.size(1), data_as<T>(db)), op);
  });
  return db;
}

at::Tensor bias_grad(const at::Tensor& dy) {
  const char* op = "bias_grad";
  return bias_grad_of(bias_grad_input(dy, op), op);
}

// AdamW's step of a parameter from a stored gradient (the count already advanced): the CPU has no
// fused kernels. A 16-bit gradient of a float32 parameter (mixed precision) is widened exactly first.
void adamw_step(const at::Tensor& stored_grad, const AdamWArg& a, const char* op) {
  const double count = a.step.item<double>();
  const at::Tensor grad = stored_grad.to(a.param.scalar_type());
  dispatch_value_type(a.param, op, [&](auto tag) {
    using T = decltype(tag);
    throw_if_error(parallel_chunks(a.param.size(0), 1 << 14,
                                   [&](int64_t s0, int64_t s1) {
                                     return cpu::adamw_update(data_as<T>(grad) + s0, s1 - s0, count, a.config,
                                                              data_as<T>(a.param) + s0, data_as<T>(a.exp_avg) + s0,
                                                              data_as<T>(a.exp_avg_sq) + s0);
                                   }),
                   op);
  });
}

void sddmm_adamw_(const at::Tensor& dy, const at::Tensor& x, at::TensorList pattern, const at::Tensor& values,
                  at::TensorList state, at::ArrayRef<double> hyper, at::TensorList bias_state,
                  const std::optional<at::Tensor>& bias, at::ArrayRef<double> bias_hyper,
                  const std::optional<at::Tensor>& x_t, c10::string_view variant) {
  const char* op = "sddmm_adamw_";
  const SddmmVariant v = sddmm_variant_arg(variant, op);
  const SddmmAdamWInputs in =
      sddmm_adamw_inputs(dy, x, pattern, values, state, hyper, bias, bias_state, bias_hyper, op);
  (void)x_t;  // a GPU forward's copy: the CPU computes from x
  check_contents(in.s.p, op);
  advance_steps(in);
  if (values.numel() > 0) adamw_step(sddmm_of(in.s, v, op), in.values, op);
  if (in.bias && in.bias->param.numel() > 0) adamw_step(bias_grad_of(in.s.dy, op), *in.bias, op);
}

void bias_grad_adamw_(const at::Tensor& dy, const at::Tensor& bias, at::TensorList state, at::ArrayRef<double> hyper) {
  const char* op = "bias_grad_adamw_";
  const BiasAdamWInputs in = bias_grad_adamw_inputs(dy, bias, state, hyper, op);
  in.bias.step.add_(1);
  if (bias.numel() > 0) adamw_step(bias_grad_of(in.dy, op), in.bias, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_coo(const at::Tensor& rows, const at::Tensor& cols,
                                                              int64_t out_features, int64_t in_features,
                                                              std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_coo";
  const CooInputs in = coo_inputs(rows, cols, out_features, in_features, index_dtype, op);
  const int64_t nnz = in.rows.size(0);
  const CooOutputs out = empty_coo_outputs(rows, in);
  dispatch_index_type(in.index_type, [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cpu::slots_from_coo<Index>(out_features, in_features, nnz, in.rows.data_ptr<int64_t>(),
                                              in.cols.data_ptr<int64_t>(), data_as<Index>(out.row_idx),
                                              data_as<Index>(out.col_idx), out.order.data_ptr<int64_t>()),
                   op);
  });
  return {out.row_idx, out.col_idx, out.order};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slots_from_dense(const at::Tensor& dense, int64_t nnz,
                                                                std::optional<at::ScalarType> index_dtype) {
  const char* op = "slots_from_dense";
  const DenseInputs in = dense_inputs(dense, nnz, index_dtype, op);
  at::Tensor positions = at::empty({nnz}, dense.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(in.dense.scalar_type(), "slots_from_dense", [&] {
    throw_if_error(cpu::dense_topk_positions<scalar_t>(in.rows, in.cols, in.dense.data_ptr<scalar_t>(), nnz,
                                                       positions.data_ptr<int64_t>()),
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
  const int64_t nnz = row_idx.size(0);
  const ViewOutputs out = empty_views(row_idx, out_features, in_features, tile_view);
  dispatch_index_type(row_idx.scalar_type(), [&](auto tag) {
    using Index = decltype(tag);
    throw_if_error(cpu::build_views<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                           data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                           out.col_ptr.data_ptr<int32_t>(), out.csc_perm.data_ptr<int32_t>()),
                   op);
    if (!tile_view) return;
    throw_if_error(cpu::build_tile_view<Index>(out_features, in_features, nnz, data_as<Index>(row_idx),
                                               data_as<Index>(col_idx), out.row_ptr.data_ptr<int32_t>(),
                                               out.tile_ptr.data_ptr<int32_t>(),
                                               reinterpret_cast<uint32_t*>(out.tile_entries.data_ptr<int32_t>())),
                   op);
  });
  return out.tuple();
}

}  // namespace
}  // namespace snack::binding

TORCH_LIBRARY_IMPL(snack, CPU, m) {
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
