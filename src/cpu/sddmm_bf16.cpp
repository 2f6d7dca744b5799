// The CPU weight gradient of bfloat16 operands with AVX512-BF16 (snack/bf16_dot.h). Against the loops
// over float tiles (loops.inc), a slot's tile rows are half the bytes, kept as stored (not widened), and
// a tile row of 16 batch rows is one dot-product instruction instead of two multiply-adds.
#include "snack/bf16_dot.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "tiled.h"

#if SNACK_CPU_AVX2 && __GNUC__ >= 10
#define SNACK_CPU_BF16_DOT 1
#include <immintrin.h>
#else
#define SNACK_CPU_BF16_DOT 0
#endif

namespace snack::cpu {

bool has_bf16_dot() {
#if SNACK_CPU_BF16_DOT
  static const bool yes = [] {
    const char* baseline = std::getenv("SNACK_CPU_BASELINE");
    const char* dot = std::getenv("SNACK_CPU_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl") &&
           !(baseline != nullptr && std::string(baseline) == "1") && !(dot != nullptr && std::string(dot) == "0");
  }();
  return yes;
#else
  return false;
#endif
}

BatchTiles<bfloat16> to_batch_tiles16(const bfloat16* x, int64_t n, int64_t cols, bfloat16* out, int64_t tile_begin,
                                      int64_t tile_end) {
  const BatchTiles<bfloat16> tiles{out, n, cols, batch_tile_width(n)};
  const int width = tiles.width;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    bfloat16* tile = out + t * cols * width;
    const int64_t i0 = t * width;
    const int rows = int(n - i0 < width ? n - i0 : width);
    constexpr int64_t kBlock = 64;  // as to_batch_tiles: reads along X's rows and writes along the tile in cache
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
      for (int j = 0; j < width; ++j) {
        const bfloat16* row = j < rows ? x + (i0 + j) * cols : nullptr;
        for (int64_t c = c0; c < c1; ++c) tile[c * width + j] = row ? row[c] : bfloat16{0};
      }
    }
  }
  return tiles;
}

#if SNACK_CPU_BF16_DOT
// Everything in this block, lambdas included, is built for AVX512-BF16; it runs only where
// has_bf16_dot() says the CPU has it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bf16")
namespace {

// A tile row of W batch rows as one vector of bfloat16 pairs: its dot product into float lanes, and
// four slots' lanes folded into one vector of their sums, each slot's lanes added as ((0+1)+(2+3))
// (+((4+5)+(6+7)) for 8 lanes) whether it is folded with others or alone.
template <int W>
struct Dot;
template <>
struct Dot<16> {
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V dot(V acc, const bfloat16* a, const bfloat16* b) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                            (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  }
  static __m128 fold4(V v0, V v1, V v2, V v3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
  }
};
template <>
struct Dot<8> {
  using V = __m128;
  static V zero() { return _mm_setzero_ps(); }
  static V dot(V acc, const bfloat16* a, const bfloat16* b) {
    return _mm_dpbf16_ps(acc, (__m128bh)_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)),
                         (__m128bh)_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  }
  static __m128 fold4(V v0, V v1, V v2, V v3) { return _mm_hadd_ps(_mm_hadd_ps(v0, v1), _mm_hadd_ps(v2, v3)); }
};

// The slots' sums of one group of tiles of W rows, four slots folded at a time.
template <int W, typename Index>
void group_sums(const SlotPattern<Index>& w, const bfloat16* dy_tiles, int64_t dy_tile_size, const bfloat16* x_tiles,
                int64_t x_tile_size, int64_t group, int64_t s0, int64_t s1, float* sums) {
  using D = Dot<W>;
  const auto products = [&](int64_t s) {
    const bfloat16* a = dy_tiles + int64_t(w.row_idx[s]) * W;
    const bfloat16* b = x_tiles + int64_t(w.col_idx[s]) * W;
    typename D::V acc = D::zero();
    for (int64_t g = 0; g < group; ++g) acc = D::dot(acc, a + g * dy_tile_size, b + g * x_tile_size);
    return acc;
  };
  int64_t s = s0;
  for (; s + 4 <= s1; s += 4) {
    float* out = sums + (s - s0);
    _mm_storeu_ps(out, _mm_add_ps(_mm_loadu_ps(out),
                                  D::fold4(products(s), products(s + 1), products(s + 2), products(s + 3))));
  }
  for (; s < s1; ++s) {
    const typename D::V v = products(s);
    sums[s - s0] += _mm_cvtss_f32(D::fold4(v, v, v, v));
  }
}

}  // namespace
#pragma GCC pop_options
#endif

template <typename Index>
Status sddmm_slots_bf16(const SlotPattern<Index>& w, const BatchTiles<bfloat16>& dy, const BatchTiles<bfloat16>& x,
                        bfloat16* dvalues, int64_t slot_begin, int64_t slot_end) {
  SNACK_RETURN_IF_ERROR(detail::check_op(w, x.n, detail::required_if(w.nnz > 0, dvalues), {}));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(dy, w.rows, "dy"));
  SNACK_RETURN_IF_ERROR(check_batch_tiles(x, w.cols, "x"));
  if (dy.n != x.n)
    return InvalidArgument("dy has " + std::to_string(dy.n) + " batch rows and x " + std::to_string(x.n));
  SNACK_RETURN_IF_ERROR(tiled::check_range(slot_begin, slot_end, w.nnz, "slots"));
  if (!has_bf16_dot()) return Status(StatusCode::kUnsupported, "sddmm_slots_bf16: this CPU has no AVX512-BF16");
  if (x.width < kBf16DotMinTile)
    return Status(StatusCode::kUnsupported, "sddmm_slots_bf16: tiles of " + std::to_string(x.width) +
                                                " rows; the dot products take tiles of 8 or 16");
#if SNACK_CPU_BF16_DOT
  std::vector<float> sums(size_t(slot_end - slot_begin), 0.f);
  constexpr int64_t kGroup = 4;  // tiles per pass over the slots, as loops.inc: their rows stay in cache
  const int64_t dy_tile_size = dy.cols * dy.width, x_tile_size = x.cols * x.width;
  for (int64_t t0 = 0; t0 < x.tiles(); t0 += kGroup) {
    const int64_t group = x.tiles() - t0 < kGroup ? x.tiles() - t0 : kGroup;
    if (x.width == 16)
      group_sums<16>(w, dy.tile(t0), dy_tile_size, x.tile(t0), x_tile_size, group, slot_begin, slot_end, sums.data());
    else
      group_sums<8>(w, dy.tile(t0), dy_tile_size, x.tile(t0), x_tile_size, group, slot_begin, slot_end, sums.data());
  }
  for (int64_t s = slot_begin; s < slot_end; ++s) dvalues[s] = from_accum<bfloat16>(sums[size_t(s - slot_begin)]);
#endif
  return Status::Ok();
}

template Status sddmm_slots_bf16<uint16_t>(const SlotPattern<uint16_t>&, const BatchTiles<bfloat16>&,
                                           const BatchTiles<bfloat16>&, bfloat16*, int64_t, int64_t);
template Status sddmm_slots_bf16<int32_t>(const SlotPattern<int32_t>&, const BatchTiles<bfloat16>&,
                                          const BatchTiles<bfloat16>&, bfloat16*, int64_t, int64_t);

}  // namespace snack::cpu
