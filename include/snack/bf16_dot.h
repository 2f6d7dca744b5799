// The CPU weight gradient of bfloat16 operands on CPUs with AVX512-BF16: dY and X kept in 16-bit
// batch tiles, each slot's products summed by the CPU's dot products of bfloat16 pairs into float.
#pragma once

#include <cstdint>

#include "snack/batch_tiles.h"
#include "snack/pattern.h"
#include "snack/status.h"
#include "snack/value_types.h"

namespace snack::cpu {

/// Whether this CPU runs AVX512-BF16 dot products (asked once; SNACK_CPU_BASELINE=1 says no, as it
/// keeps the loops' baseline build, and SNACK_CPU_BF16_DOT=0 keeps the loops over float tiles, for
/// measuring one against the other).
bool has_bf16_dot();

/// The narrowest batch tile sddmm_slots_bf16 runs: a tile row of 8 values is one 16-byte vector.
inline constexpr int kBf16DotMinTile = 8;

/// x [n, cols] (bfloat16) in batch tiles as snack/batch_tiles.h lays them out, the values kept in
/// bfloat16 (not widened): tiles [tile_begin, tile_end) written into `out`, which holds
/// batch_tiles_numel(n, cols) values.
BatchTiles<bfloat16> to_batch_tiles16(const bfloat16* x, int64_t n, int64_t cols, bfloat16* out, int64_t tile_begin,
                                      int64_t tile_end);

/// dvalues[s] = sum over the batch of dy[b, row(s)] * x[b, col(s)] for the slots [slot_begin,
/// slot_end), from 16-bit tiles of 8 or 16 rows: per slot and group of four tiles, one AVX512-BF16 dot
/// product per tile row (each float lane adds the products of two batch rows), the lanes added by a
/// fixed tree, the groups in order, rounded once to bfloat16. Deterministic whatever the split of the
/// slots; the dot products flush subnormal inputs and results to zero. Unsupported where
/// !has_bf16_dot() or the tiles are narrower than kBf16DotMinTile.
template <typename Index>
Status sddmm_slots_bf16(const SlotPattern<Index>& w, const BatchTiles<bfloat16>& dy, const BatchTiles<bfloat16>& x,
                        bfloat16* dvalues, int64_t slot_begin, int64_t slot_end);

}  // namespace snack::cpu
