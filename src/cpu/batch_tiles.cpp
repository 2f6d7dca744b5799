// The batch's layout for the CPU products (snack/batch_tiles.h).
#include "snack/batch_tiles.h"

#include <cstdlib>
#include <string>

#include "tiled.h"

namespace snack::cpu {

namespace tiled {
bool has_avx2_fma() {
#if SNACK_CPU_AVX2
  // SNACK_CPU_BASELINE=1 keeps the baseline build: what the tests run it with on CPUs that have both.
  static const bool yes = [] {
    const char* baseline = std::getenv("SNACK_CPU_BASELINE");
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           !(baseline != nullptr && std::string(baseline) == "1");
  }();
  return yes;
#else
  return false;
#endif
}
}  // namespace tiled

int batch_tile_width(int64_t n) {
  int width = 1;
  while (width < n && width < kMaxBatchTile) width *= 2;
  return width;
}

int64_t batch_tiles_numel(int64_t n, int64_t cols) {
  const int64_t width = batch_tile_width(n);
  return (n + width - 1) / width * cols * width;
}

template <typename T>
BatchTiles<accum_t<T>> to_batch_tiles(const T* x, int64_t n, int64_t cols, accum_t<T>* out, int64_t tile_begin,
                                      int64_t tile_end) {
  const BatchTiles<accum_t<T>> tiles{out, n, cols, batch_tile_width(n)};
  const int width = tiles.width;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    accum_t<T>* tile = out + t * cols * width;
    const int64_t i0 = t * width;
    const int rows = int(n - i0 < width ? n - i0 : width);
    // Column blocks, so that the reads along X's rows and the writes along the tile both stay in cache.
    constexpr int64_t kBlock = 64;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
      for (int j = 0; j < width; ++j) {
        if (j < rows) {
          const T* row = x + (i0 + j) * cols;
          for (int64_t c = c0; c < c1; ++c) tile[c * width + j] = to_accum(row[c]);
        } else {
          for (int64_t c = c0; c < c1; ++c) tile[c * width + j] = accum_t<T>(0);
        }
      }
    }
  }
  return tiles;
}

template <typename A>
Status check_batch_tiles(const BatchTiles<A>& tiles, int64_t cols, const char* name) {
  if (tiles.n < 0) return InvalidArgument(std::string(name) + ": batch size must be non-negative");
  if (tiles.cols != cols)
    return InvalidArgument(std::string(name) + ": tiles of " + std::to_string(tiles.cols) + " columns, expected " +
                           std::to_string(cols));
  if (tiles.width != batch_tile_width(tiles.n))
    return InvalidArgument(std::string(name) + ": tiles " + std::to_string(tiles.width) + " rows wide, expected " +
                           std::to_string(batch_tile_width(tiles.n)) + " for a batch of " + std::to_string(tiles.n));
  if (tiles.data == nullptr && tiles.n * cols > 0) return InvalidArgument(std::string(name) + " must not be null");
  return Status::Ok();
}

template BatchTiles<float> to_batch_tiles<float>(const float*, int64_t, int64_t, float*, int64_t, int64_t);
template BatchTiles<double> to_batch_tiles<double>(const double*, int64_t, int64_t, double*, int64_t, int64_t);
template BatchTiles<float> to_batch_tiles<bfloat16>(const bfloat16*, int64_t, int64_t, float*, int64_t, int64_t);
template BatchTiles<float> to_batch_tiles<float16>(const float16*, int64_t, int64_t, float*, int64_t, int64_t);
template Status check_batch_tiles<float>(const BatchTiles<float>&, int64_t, const char*);
template Status check_batch_tiles<double>(const BatchTiles<double>&, int64_t, const char*);
template Status check_batch_tiles<bfloat16>(const BatchTiles<bfloat16>&, int64_t, const char*);

}  // namespace snack::cpu
