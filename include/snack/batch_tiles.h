// The batch laid out for the CPU products (snack/spmm.h and snack/sddmm.h, namespace cpu).
//
// A CPU product reads, for each stored entry, the batch values of one column of X (or dY). In X's
// own layout ([n, cols], row-major) those are n values `cols` apart; in tiles they are `width`
// contiguous values of the accumulation type, one or two cache lines that the compiler's vector
// loads and multiply-adds take whole. A tile of 16 batch rows is 16 float accumulators per output,
// which stay in registers.
#pragma once

#include <cstdint>

#include "snack/status.h"
#include "snack/value_types.h"

namespace snack::cpu {

/// The widest tile: batch rows read per stored entry.
inline constexpr int kMaxBatchTile = 16;

/// Batch rows per tile for a batch of n rows: the power of two >= n, at most kMaxBatchTile (1 for
/// n <= 1).
int batch_tile_width(int64_t n);

/// Values in the tiles of an [n, cols] operand: ceil(n / width) tiles of cols x width.
int64_t batch_tiles_numel(int64_t n, int64_t cols);

/// X [n, cols] in tiles: tile t holds batch rows [t * width, t * width + width) as [cols][width]
/// (column c's values of those rows contiguous), in the accumulation type A of the product's
/// values, zero past row n. width is batch_tile_width(n); `data` holds batch_tiles_numel(n, cols)
/// values.
template <typename A>
struct BatchTiles {
  const A* data = nullptr;
  int64_t n = 0;     ///< batch rows
  int64_t cols = 0;  ///< columns of the operand: rows of each tile
  int width = 1;     ///< batch rows per tile

  int64_t tiles() const { return (n + width - 1) / width; }
  const A* tile(int64_t t) const { return data + t * cols * width; }
};

/// Writes tiles [tile_begin, tile_end) of x's layout (x: [n, cols], row-major) into `out`, which
/// holds batch_tiles_numel(n, cols) values, and returns the whole layout's description. Tiles are
/// independent, so callers may fill them from several threads.
template <typename T>
BatchTiles<accum_t<T>> to_batch_tiles(const T* x, int64_t n, int64_t cols, accum_t<T>* out, int64_t tile_begin,
                                      int64_t tile_end);

/// InvalidArgument unless `tiles` is the layout of an operand of `cols` columns and tiles.n >= 0
/// rows, with data when it has values; `name` names the operand in the message.
template <typename A>
Status check_batch_tiles(const BatchTiles<A>& tiles, int64_t cols, const char* name);

}  // namespace snack::cpu
