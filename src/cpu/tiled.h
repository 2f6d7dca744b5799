// What the CPU products over batch tiles (snack/batch_tiles.h) share: the dispatch on the tile's
// width, the check of a range of outputs, the count of accumulator chains, and the CPU's ISA.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "snack/batch_tiles.h"
#include "snack/status.h"

// Whether the loops are also built for AVX2 with FMA (GCC on x86-64: `#pragma GCC target`).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SNACK_CPU_AVX2 1
#else
#define SNACK_CPU_AVX2 0
#endif

namespace snack::cpu::tiled {

// f(std::integral_constant<int, W>{}) for the tile width W in {1, 2, 4, 8, 16}: the loops over a
// tile's rows have a constant trip count, so their accumulators live in vector registers.
template <typename F>
Status with_tile_width(int width, F&& f) {
  static_assert(kMaxBatchTile == 16, "one case per width");
  switch (width) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    default: return InvalidArgument("batch tiles of " + std::to_string(width) + " rows are not a layout");
  }
}

inline Status check_range(int64_t begin, int64_t end, int64_t count, const char* what) {
  if (begin < 0 || begin > end || end > count)
    return InvalidArgument(std::string(what) + " [" + std::to_string(begin) + ", " + std::to_string(end) +
                           ") is not within [0, " + std::to_string(count) + ")");
  return Status::Ok();
}

// Independent partial sums per output: a short tile's one accumulator chain would wait on the
// adder's latency at every entry, so entries go round-robin to P chains, summed at the end.
template <int W>
inline constexpr int kChains = W >= 4 ? 2 : 8 / W;

// Whether this CPU runs AVX2 and FMA (asked once): loops.h then takes the loops built for them.
bool has_avx2_fma();

}  // namespace snack::cpu::tiled
